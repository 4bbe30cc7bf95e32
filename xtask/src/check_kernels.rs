//! `cargo xtask check-kernels`: compile every kernel family for every target with NVRTC and
//! fail on any error or warning. Needs no GPU.
//!
//! cudarc loads libnvrtc with dlopen by name (`libnvrtc.so`, `libnvrtc.so.13`, ...), which only
//! searches the loader path fixed at process start. So the parent process makes sure a CUDA 13
//! NVRTC exists (installing the PyPI wheel into `target/nvrtc` if needed) and re-runs itself
//! with that library directory on `LD_LIBRARY_PATH`; the child does the compiling. Then the
//! NVRTC-dependent unit tests of dsv4-kernels run with the same loader path.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use dsv4_kernels::{
    compile_family, compile_options, nvrtc_version, precompile, Arch, KernelCache, FAMILIES,
};

const CHILD_FLAG: &str = "--with-nvrtc-on-path";
const NVRTC_WHEEL: &str = "nvidia-cuda-nvrtc==13.0.*";
const NVRTC_SONAME: &str = "libnvrtc.so.13";

pub fn run(root: &Path, args: &[String]) -> Result<(), String> {
    let mut archs = Vec::new();
    let mut child = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--arch" => {
                let v = it.next().ok_or("--arch needs a value")?;
                archs.push(Arch::parse(v).map_err(|e| e.to_string())?);
            }
            CHILD_FLAG => child = true,
            other => return Err(format!("check-kernels: unknown argument `{other}`")),
        }
    }
    if archs.is_empty() {
        archs = vec![Arch::Sm90a, Arch::Sm100a];
    }
    if child {
        return check(
            &archs,
            &root.join("target").join("nvrtc").join("check-cache"),
        );
    }

    let lib_dir = nvrtc_lib_dir(root)?;
    let ld_path = match std::env::var_os("LD_LIBRARY_PATH") {
        Some(old) if !old.is_empty() => {
            let mut paths = vec![lib_dir.clone()];
            paths.extend(std::env::split_paths(&old));
            std::env::join_paths(paths).map_err(|e| e.to_string())?
        }
        _ => lib_dir.clone().into_os_string(),
    };
    let exe =
        std::env::current_exe().map_err(|e| format!("cannot find the xtask executable: {e}"))?;
    let status = Command::new(exe)
        .arg("check-kernels")
        .arg(CHILD_FLAG)
        .args(
            archs
                .iter()
                .flat_map(|a| ["--arch".to_string(), a.to_string()]),
        )
        .env("LD_LIBRARY_PATH", &ld_path)
        .status()
        .map_err(|e| format!("cannot re-run xtask: {e}"))?;
    if !status.success() {
        return Err("check-kernels failed".to_string());
    }
    // The unit tests that need NVRTC are #[ignore]d in a plain `cargo test`; run them here.
    let status = Command::new(env!("CARGO"))
        .current_dir(root)
        .args([
            "test",
            "--quiet",
            "-p",
            "dsv4-kernels",
            "--lib",
            "--",
            "--ignored",
            "nvrtc_",
        ])
        .env("LD_LIBRARY_PATH", &ld_path)
        .status()
        .map_err(|e| format!("cannot run cargo test: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err("the NVRTC unit tests of dsv4-kernels failed".to_string())
    }
}

/// A directory holding libnvrtc.so.13: `$DSV4_NVRTC_LIB_DIR`, else the wheel under
/// `target/nvrtc`, installed with pip when absent.
fn nvrtc_lib_dir(root: &Path) -> Result<PathBuf, String> {
    if let Some(dir) = std::env::var_os("DSV4_NVRTC_LIB_DIR") {
        let dir = PathBuf::from(dir);
        return if dir.join(NVRTC_SONAME).is_file() {
            Ok(dir)
        } else {
            Err(format!(
                "DSV4_NVRTC_LIB_DIR={} holds no {NVRTC_SONAME}",
                dir.display()
            ))
        };
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    let install = target.join("nvrtc");
    if let Some(dir) = find_lib(&install) {
        return Ok(dir);
    }
    eprintln!(
        "NVRTC not found under {}; installing {NVRTC_WHEEL} from PyPI",
        install.display()
    );
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
            "--upgrade",
            "--target",
        ])
        .arg(&install)
        .arg(NVRTC_WHEEL)
        .status()
        .map_err(|e| format!("cannot run python3 -m pip: {e}"))?;
    if !status.success() {
        return Err(format!("pip install {NVRTC_WHEEL} failed ({status})"));
    }
    find_lib(&install).ok_or_else(|| format!("the {NVRTC_WHEEL} wheel installed no {NVRTC_SONAME}"))
}

/// The directory of the first `libnvrtc.so.13` below `dir` (wheel layouts differ between
/// releases: nvidia/cu13/lib, nvidia/cuda_nvrtc/lib).
fn find_lib(dir: &Path) -> Option<PathBuf> {
    let entries = std::fs::read_dir(dir).ok()?;
    let mut subdirs = Vec::new();
    for e in entries.flatten() {
        let path = e.path();
        if path.file_name().is_some_and(|n| n == NVRTC_SONAME) && path.is_file() {
            return Some(dir.to_path_buf());
        }
        if path.is_dir() {
            subdirs.push(path);
        }
    }
    subdirs.sort();
    subdirs.iter().find_map(|d| find_lib(d))
}

fn check(archs: &[Arch], cache_dir: &Path) -> Result<(), String> {
    let (major, minor) = nvrtc_version().map_err(|e| e.to_string())?;
    println!("NVRTC {major}.{minor}");
    let mut failures = Vec::new();
    for &arch in archs {
        println!("{arch}: {}", compile_options(arch).join(" "));
        for family in FAMILIES {
            let t = Instant::now();
            match compile_family(family, arch) {
                Ok(img) if img.log.is_empty() => println!(
                    "  ok    {:<12} {:>8} bytes  {:>6.0} ms",
                    family.file,
                    img.image.len(),
                    t.elapsed().as_secs_f64() * 1e3
                ),
                Ok(img) => {
                    println!("  WARN  {} ({arch}):\n{}", family.file, img.log);
                    failures.push(format!("{} ({arch}): warnings", family.file));
                }
                Err(e) => {
                    println!("  FAIL  {} ({arch}): {e}", family.file);
                    failures.push(format!("{} ({arch}): error", family.file));
                }
            }
        }
    }
    if failures.is_empty() {
        println!(
            "all {} kernel families compile cleanly for {} targets",
            FAMILIES.len(),
            archs.len()
        );
        // The same path as `dsv4 kernels --precompile`: compile into a cache, read it back.
        let cache = KernelCache::new(cache_dir);
        for &arch in archs {
            let report = precompile(arch, &cache).map_err(|e| e.to_string())?;
            for f in &report.families {
                println!(
                    "precompile {arch} {:<10} cold {:>6.1} ms, warm {:>5.2} ms",
                    f.family,
                    f.cold.as_secs_f64() * 1e3,
                    f.warm.as_secs_f64() * 1e3
                );
            }
        }
        Ok(())
    } else {
        Err(format!("kernel check failed:\n  {}", failures.join("\n  ")))
    }
}
