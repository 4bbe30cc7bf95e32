//! `cargo xtask demo`: synthesize the tiny checkpoint (unless a real one is given) and generate
//! text from it with the release `dsv4` binary.

use std::path::{Path, PathBuf};
use std::process::Command;

fn exec(cmd: &mut Command) -> Result<(), String> {
    let status = cmd
        .status()
        .map_err(|e| format!("cannot start {cmd:?}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{cmd:?} failed with {status}"))
    }
}

/// Builds `dsv4` in release mode and returns its path.
fn build_dsv4(root: &Path) -> Result<PathBuf, String> {
    exec(Command::new(env!("CARGO")).current_dir(root).args([
        "build",
        "--release",
        "-p",
        "dsv4-cli",
    ]))?;
    Ok(root.join("target/release/dsv4"))
}

pub fn run(root: &Path, args: &[String]) -> Result<(), String> {
    let mut model = None;
    let mut prompt = "The capital of France is".to_string();
    for pair in args.chunks(2) {
        let value = pair
            .get(1)
            .ok_or(format!("demo: {} needs a value", pair[0]))?;
        match pair[0].as_str() {
            "--model" => model = Some(PathBuf::from(value)),
            "--prompt" => prompt = value.clone(),
            other => return Err(format!("demo: unknown argument `{other}`")),
        }
    }
    demo(root, model, &prompt)
}

fn demo(root: &Path, model: Option<PathBuf>, prompt: &str) -> Result<(), String> {
    let dsv4 = build_dsv4(root)?;
    let model = match model {
        Some(m) => m,
        None => {
            let dir = root.join("target/demo-tiny");
            if !dir.join("config.json").is_file() {
                exec(
                    Command::new(&dsv4)
                        .args(["synth", "--preset", "tiny", "--format", "official", "--out"])
                        .arg(&dir),
                )?;
            }
            dir
        }
    };
    exec(
        Command::new(&dsv4)
            .arg("generate")
            .arg("--model")
            .arg(&model)
            .args([
                "--prompt",
                prompt,
                "--max-new-tokens",
                "32",
                "--temperature",
                "0.8",
                "--seed",
                "1",
            ]),
    )
}
