//! Project tasks: `cargo xtask <task>`.

mod check_kernels;
mod demo;
mod gpu_test;

use std::path::PathBuf;
use std::process::ExitCode;

const USAGE: &str = "usage: cargo xtask <task>

tasks:
  demo [--model DIR] [--prompt TEXT]
                                   build dsv4 (release), write the tiny synthetic checkpoint to
                                   target/demo-tiny unless --model names a real one, and
                                   generate text from it on the CPU
  check-kernels [--arch ARCH]...   compile every CUDA kernel with NVRTC (default: sm_90a and
                                   sm_100a); fails on any error or warning. Installs NVRTC
                                   into target/nvrtc from PyPI when it is missing.
  gpu-test [-p PACKAGE]...         build the GPU test binaries (release), copy them to
                                   .device-bin/ and print how to run them on a GPU machine";

/// The workspace root (xtask lives one level below it).
fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask has a parent directory")
        .to_path_buf()
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let root = workspace_root();
    let result = match args.first().map(String::as_str) {
        Some("demo") => demo::run(&root, &args[1..]),
        Some("check-kernels") => check_kernels::run(&root, &args[1..]),
        Some("gpu-test") => gpu_test::run(&root, &args[1..]),
        Some("-h" | "--help" | "help") => {
            println!("{USAGE}");
            Ok(())
        }
        _ => Err(USAGE.to_string()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            eprintln!("{msg}");
            ExitCode::FAILURE
        }
    }
}
