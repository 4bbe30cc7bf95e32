//! `cargo xtask gpu-test`: build the test binaries that hold GPU tests, here (no GPU needed),
//! and stage them in `.device-bin/` with a script that runs them on a GPU machine.
//!
//! GPU tests are `#[ignore]`d (so a plain `cargo test` reports them as not run) and have
//! `gpu` in their path; the script runs exactly those with `--ignored gpu`, then each of them
//! alone under compute-sanitizer's memcheck and racecheck, several at once. The binaries load
//! the CUDA driver and NVRTC dynamically, so they run on any x86-64 Linux machine with a driver
//! and CUDA 13 NVRTC.

use std::path::Path;
use std::process::{Command, Stdio};

const DEFAULT_PACKAGES: &[&str] = &["dsv4-kernels", "dsv4-ops", "dsv4-graph"];
const OUT_DIR: &str = ".device-bin";
const SCRIPT: &str = "run-gpu-tests.sh";

pub fn run(root: &Path, args: &[String]) -> Result<(), String> {
    let mut packages: Vec<String> = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "-p" | "--package" => {
                packages.push(it.next().ok_or("-p needs a package name")?.clone())
            }
            other => return Err(format!("gpu-test: unknown argument `{other}`")),
        }
    }
    if packages.is_empty() {
        packages = DEFAULT_PACKAGES.iter().map(|s| s.to_string()).collect();
    }

    let mut cmd = Command::new(env!("CARGO"));
    cmd.current_dir(root)
        .args(["test", "--release", "--no-run", "--message-format=json"])
        .args(packages.iter().flat_map(|p| ["-p", p.as_str()]))
        .stderr(Stdio::inherit());
    let output = cmd.output().map_err(|e| format!("cannot run cargo: {e}"))?;
    if !output.status.success() {
        return Err(format!("cargo test --no-run failed ({})", output.status));
    }

    let out = root.join(OUT_DIR);
    if out.exists() {
        std::fs::remove_dir_all(&out)
            .map_err(|e| format!("cannot clear {}: {e}", out.display()))?;
    }
    std::fs::create_dir_all(&out).map_err(|e| format!("cannot create {}: {e}", out.display()))?;

    let mut binaries = Vec::new();
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if msg["reason"] != "compiler-artifact" || msg["profile"]["test"] != true {
            continue;
        }
        let Some(exe) = msg["executable"].as_str() else {
            continue;
        };
        let crate_name = msg["package_id"]
            .as_str()
            .and_then(package_name)
            .unwrap_or("unknown");
        let target = msg["target"]["name"].as_str().unwrap_or("unknown");
        let kinds = msg["target"]["kind"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        // The library's unit tests get `-lib`; integration tests keep their own name.
        let name = if kinds.iter().any(|k| k == "lib") {
            format!("{crate_name}-lib")
        } else {
            format!("{crate_name}-{target}")
        };
        if !has_gpu_tests(exe)? {
            continue;
        }
        let dest = out.join(&name);
        std::fs::copy(exe, &dest).map_err(|e| format!("cannot copy {exe}: {e}"))?;
        // Debug info is most of the size; symbols stay for backtraces.
        let stripped = Command::new("strip")
            .arg("--strip-debug")
            .arg(&dest)
            .status();
        if !matches!(stripped, Ok(s) if s.success()) {
            eprintln!("warning: could not strip {}; copied as is", dest.display());
        }
        binaries.push(name);
    }
    if binaries.is_empty() {
        return Err("cargo produced no test executables".to_string());
    }
    binaries.sort();

    let script = out.join(SCRIPT);
    std::fs::write(&script, run_script(&binaries))
        .map_err(|e| format!("cannot write {}: {e}", script.display()))?;
    let total: u64 = binaries
        .iter()
        .filter_map(|b| std::fs::metadata(out.join(b)).ok())
        .map(|m| m.len())
        .sum();

    println!(
        "staged in {OUT_DIR}/ ({:.1} MiB):",
        total as f64 / (1 << 20) as f64
    );
    for b in &binaries {
        println!("  {OUT_DIR}/{b}");
    }
    println!();
    println!("On a GPU machine, from the repository root (logs go to $OUT, else {OUT_DIR}/logs):");
    println!("  bash {OUT_DIR}/{SCRIPT}");
    println!("which runs, for each binary B and each of its GPU tests T:");
    println!("  {OUT_DIR}/B --ignored --test-threads=1 --nocapture gpu");
    println!("(tests named multi_gpu_* are skipped on a machine with fewer than two GPUs)");
    println!("(their sanitizer runs add --report-api-errors no: NCCL handles its own API errors)");
    for tool in ["memcheck", "racecheck"] {
        println!(
            "  DSV4_SANITIZER_RUN=1 compute-sanitizer --tool {tool} --error-exitcode 99 \\\n    \
             {OUT_DIR}/B --ignored --exact --test-threads=1 T"
        );
    }
    println!("(DSV4_SANITIZER_RUN=1: the longest model tests take their shorter lengths)");
    Ok(())
}

/// Whether a test binary holds GPU tests (listing them needs no GPU). Binaries without any
/// are not staged: compute-sanitizer fails a program that never calls CUDA.
fn has_gpu_tests(exe: &str) -> Result<bool, String> {
    let out = Command::new(exe)
        .args(["--list", "--ignored", "gpu"])
        .output()
        .map_err(|e| format!("cannot list the tests of {exe}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "listing the tests of {exe} failed ({})",
            out.status
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .any(|l| l.ends_with(": test")))
}

/// `name` from a package id: `path+file:///.../dsv4-ops#0.1.0` (cargo >= 1.77) or
/// `dsv4-ops 0.1.0 (path+file://...)` (older).
fn package_name(id: &str) -> Option<&str> {
    if let Some((url, fragment)) = id.rsplit_once('#') {
        // `.../name#version`, or `...#name@version` when the directory differs from the name.
        match fragment.split_once('@') {
            Some((name, _)) => Some(name),
            None => url.rsplit('/').next(),
        }
    } else {
        id.split_whitespace().next()
    }
}

fn run_script(binaries: &[String]) -> String {
    format!(
        r#"#!/usr/bin/env bash
# Runs the GPU tests staged by `cargo xtask gpu-test`: each binary normally (unless
# DSV4_PLAIN=0), then every GPU test alone under compute-sanitizer memcheck and racecheck
# (those whose "tool binary test" line matches the regex DSV4_SANITIZE_ONLY, when set),
# DSV4_SANITIZE_JOBS (default 6) at a time (multi-GPU tests one at a time), each cut off after
# DSV4_SANITIZE_TIMEOUT seconds (default 560). Usage: bash {OUT_DIR}/{SCRIPT} [LOG_DIR]
set -u
here=$(cd "$(dirname "$0")" && pwd)
logs=${{1:-${{OUT:-$here/logs}}}}
mkdir -p "$logs"

# NVRTC (CUDA 13) for the run-time kernel compiler, unless the loader already finds it.
if ! ldconfig -p | grep -q 'libnvrtc.so.13'; then
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-13*/lib64; do
    if [ -e "$d/libnvrtc.so.13" ]; then export LD_LIBRARY_PATH="$d${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}"; break; fi
  done
fi
# Oracle fixtures of the tree the script sits in.
export DSV4_FIXTURES=${{DSV4_FIXTURES:-$here/../tests/fixtures}}
# A private kernel cache: the first run of each kernel family compiles it (cold), the rest
# reuse it (entries are written atomically, so parallel runs may fill it together).
export DSV4_KERNEL_CACHE=${{DSV4_KERNEL_CACHE:-$(mktemp -d)}}

command -v nvidia-smi > /dev/null && nvidia-smi -L
binaries=({bins})
status=0
summary=""
# Tests named multi_gpu_* need two GPUs or more; with fewer they are skipped, and said so.
gpus=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU')
skip=()
if [ "$gpus" -lt 2 ]; then
  skip=(--skip multi_gpu)
  summary+="multi-GPU tests NOT run ($gpus GPU(s))"$'\n'
fi
if [ "${{DSV4_PLAIN:-1}}" != 0 ]; then
  for b in "${{binaries[@]}}"; do
    "$here/$b" --ignored --test-threads=1 --nocapture "${{skip[@]}}" gpu > "$logs/$b.log" 2>&1
    rc=$?; cat "$logs/$b.log"; [ $rc -eq 0 ] || status=1
    summary+="$b: exit $rc"$'\n'
  done
fi

# One sanitizer run: tool, binary, test. Its log says the exit code on its last line. The
# longest tests take shorter lengths there (DSV4_SANITIZER_RUN, dsv4_tests::sanitizer_length).
# NCCL, the multi-GPU tests' reference, probes for kernels built for other GPUs and enables
# peer access the collectives already enabled, and handles both API errors itself: those runs
# leave API errors unreported (memory errors and races still count).
sanitize() {{
  local log="$logs/$2.$1.${{3//::/.}}.log" api=()
  [[ $3 == *multi_gpu* ]] && api=(--report-api-errors no)
  DSV4_SANITIZER_RUN=1 timeout "${{DSV4_SANITIZE_TIMEOUT:-560}}" \
    compute-sanitizer --tool "$1" "${{api[@]}}" --error-exitcode 99 "$here/$2" --ignored --exact --test-threads=1 "$3" > "$log" 2>&1
  printf '\nexit %d\n' $? >> "$log"
}}
if command -v compute-sanitizer > /dev/null; then
  # The summary reads this run's logs only.
  rm -f "$logs"/*.memcheck.*.log "$logs"/*.racecheck.*.log
  export -f sanitize
  export logs here
  for tool in memcheck racecheck; do
    for b in "${{binaries[@]}}"; do
      "$here/$b" --list --ignored "${{skip[@]}}" gpu | sed -n 's/: test$//p' | sed "s|^|$tool $b |"
    done
  done | grep -E "${{DSV4_SANITIZE_ONLY:-.}}" > "$logs/sanitize.list"
  # Multi-GPU tests take every GPU and their collectives wait on each other across them:
  # they run one at a time, after the others.
  grep -v multi_gpu "$logs/sanitize.list" | xargs -r -P "${{DSV4_SANITIZE_JOBS:-6}}" -L 1 bash -c 'sanitize "$@"' _
  grep multi_gpu "$logs/sanitize.list" | xargs -r -P 1 -L 1 bash -c 'sanitize "$@"' _
  for tool in memcheck racecheck; do
    for b in "${{binaries[@]}}"; do
      runs=0; failed=""
      for log in "$logs/$b.$tool".*.log; do
        [ -e "$log" ] || continue
        runs=$((runs + 1))
        if [ "$(tail -n 1 "$log")" != "exit 0" ]; then
          failed+=" $(basename "$log" .log) ($(tail -n 1 "$log"), $(grep -hE 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -n 1))"
        fi
      done
      [ -z "$failed" ] || status=1
      [ $runs -eq 0 ] || summary+="$b under $tool: $runs tests,${{failed:- all clean}}"$'\n'
    done
  done
else
  summary+="compute-sanitizer not found: memcheck and racecheck NOT run"$'\n'
  status=1
fi
echo "==== summary ===="
printf '%s' "$summary"
exit $status
"#,
        bins = binaries.join(" ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn package_names_from_both_id_formats() {
        assert_eq!(
            package_name("path+file:///work/main/crates/dsv4-ops#0.1.0"),
            Some("dsv4-ops")
        );
        assert_eq!(
            package_name("path+file:///work/main/tests#dsv4-tests@0.1.0"),
            Some("dsv4-tests")
        );
        assert_eq!(
            package_name("dsv4-ops 0.1.0 (path+file:///work/main/crates/dsv4-ops)"),
            Some("dsv4-ops")
        );
    }

    #[test]
    fn script_lists_every_binary_and_both_sanitizer_tools() {
        let s = run_script(&["a-lib".to_string(), "b-lib".to_string()]);
        assert!(s.contains("binaries=(a-lib b-lib)"));
        assert!(s.contains("for tool in memcheck racecheck"));
        assert!(s.contains("--ignored --test-threads=1 --nocapture \"${skip[@]}\" gpu"));
        assert!(s.contains("skip=(--skip multi_gpu)"));
        assert!(s.contains("grep multi_gpu \"$logs/sanitize.list\" | xargs -r -P 1"));
        assert!(s.contains("--ignored --exact --test-threads=1 \"$3\""));
        assert!(s.contains("[[ $3 == *multi_gpu* ]] && api=(--report-api-errors no)"));
        assert!(s.contains("compute-sanitizer --tool \"$1\" \"${api[@]}\" --error-exitcode 99"));
    }
}
