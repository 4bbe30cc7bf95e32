//! NVRTC compilation to CUBIN (or PTX for architectures without a pinned target).
//!
//! cudarc's safe NVRTC wrapper returns PTX only and cannot pass in-memory headers, so this
//! drives the raw `nvrtc::sys` API: `nvrtcCreateProgram` with the embedded headers,
//! `nvrtcCompileProgram`, then `nvrtcGetCUBIN` or `nvrtcGetPTX`.

use std::ffi::{c_char, c_int, CString};
use std::sync::OnceLock;

use cudarc::nvrtc::sys;

use crate::{Arch, ImageKind, KernelError, KernelFamily, HEADERS};

/// A compiled family. `log` is NVRTC's program log: empty for a clean compile, otherwise the
/// warnings (compilation errors come back as [`KernelError::Nvrtc`]).
#[derive(Debug, Clone)]
pub struct CompiledImage {
    pub kind: ImageKind,
    pub image: Vec<u8>,
    pub log: String,
}

/// Whether libnvrtc can be loaded. cudarc panics when it cannot, so check this first.
pub fn nvrtc_available() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to dlopen the library by its candidate names.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

/// Whether the CUDA driver library (libcuda) can be loaded; cudarc panics when it cannot.
pub fn driver_available() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to dlopen the library by its candidate names.
    *PRESENT.get_or_init(|| unsafe { cudarc::driver::sys::is_culib_present() })
}

fn require_nvrtc() -> Result<(), KernelError> {
    if nvrtc_available() {
        Ok(())
    } else {
        Err(KernelError::NvrtcMissing)
    }
}

/// (major, minor) of the loaded NVRTC.
pub fn nvrtc_version() -> Result<(i32, i32), KernelError> {
    require_nvrtc()?;
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: plain out-parameters.
    let r = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    check(r, "", Arch::Sm90a, "nvrtcVersion", String::new())?;
    Ok((major, minor))
}

/// Sub-steps of FP8 weights each GEMV warp keeps in flight (its register ring; a K step is
/// four sub-steps). The kernels get it as `DSV4_GEMV_FP8_RING`; the GEMV planner keeps FP8 K
/// ranges long enough to fill it.
pub const GEMV_FP8_RING: u32 = 6;

/// Columns of a row each thread of `rms_norm_rows` keeps in registers. The kernels get it as
/// `DSV4_NORM_HELD`; the rows launchers bound the width of the rows it rotates by it.
pub const NORM_HELD: u32 = 8;

/// What a family's image is built for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Build {
    Plain,
    /// Every kernel stamps its warps into a device log ([`crate::timeline`]).
    Timeline,
}

impl Build {
    /// The family's source as this build compiles it.
    pub fn source(self, family: &KernelFamily) -> std::borrow::Cow<'static, str> {
        match self {
            Build::Plain => family.source.into(),
            Build::Timeline => crate::timeline::instrument(family.source).into(),
        }
    }

    /// NVRTC options for a target in this build.
    pub fn options(self, arch: Arch) -> Vec<String> {
        let mut opts = compile_options(arch);
        if self == Build::Timeline {
            opts.push("-DDSV4_TIMELINE".to_string());
        }
        opts
    }
}

/// NVRTC options for a target. Identical for run-time loading and `check-kernels`, so a clean
/// check means a clean run-time build.
pub fn compile_options(arch: Arch) -> Vec<String> {
    let mut opts = vec![
        format!("--gpu-architecture={}", arch.nvrtc_target()),
        "--std=c++17".to_string(),
        // Source lines in compute-sanitizer and profiler reports; no effect on the code.
        "--generate-line-info".to_string(),
        format!("-DDSV4_GEMV_FP8_RING={GEMV_FP8_RING}"),
        format!("-DDSV4_NORM_HELD={NORM_HELD}u"),
    ];
    if arch.image_kind() == ImageKind::Cubin {
        // Spills and local-memory arrays are performance bugs: make ptxas say so in the log.
        opts.push("--ptxas-options=--warn-on-spills".to_string());
        opts.push("--ptxas-options=--warn-on-local-memory-usage".to_string());
    }
    opts
}

fn error_string(r: sys::nvrtcResult) -> String {
    // SAFETY: nvrtcGetErrorString returns a static NUL-terminated string.
    unsafe {
        let p = sys::nvrtcGetErrorString(r);
        if p.is_null() {
            format!("{r:?}")
        } else {
            std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    }
}

fn check(
    r: sys::nvrtcResult,
    family: &str,
    arch: Arch,
    call: &'static str,
    log: String,
) -> Result<(), KernelError> {
    if r == sys::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(KernelError::Nvrtc {
            family: family.to_string(),
            arch,
            call,
            code: error_string(r),
            log,
        })
    }
}

/// Destroys the program on every exit path.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the handle came from a successful nvrtcCreateProgram and is destroyed once.
        unsafe {
            sys::nvrtcDestroyProgram(&mut self.0);
        }
    }
}

fn read_sized(
    prog: &Program,
    family: &str,
    arch: Arch,
    size_call: (
        &'static str,
        unsafe fn(sys::nvrtcProgram, *mut usize) -> sys::nvrtcResult,
    ),
    data_call: (
        &'static str,
        unsafe fn(sys::nvrtcProgram, *mut c_char) -> sys::nvrtcResult,
    ),
) -> Result<Vec<u8>, KernelError> {
    let mut size = 0usize;
    // SAFETY: `prog` is a live program; the buffer has exactly the size NVRTC reported.
    unsafe {
        check(
            (size_call.1)(prog.0, &mut size),
            family,
            arch,
            size_call.0,
            String::new(),
        )?;
        let mut buf = vec![0u8; size];
        check(
            (data_call.1)(prog.0, buf.as_mut_ptr().cast()),
            family,
            arch,
            data_call.0,
            String::new(),
        )?;
        Ok(buf)
    }
}

/// Compiles one family for `arch` with [`compile_options`] and the embedded headers.
pub fn compile_family(family: &KernelFamily, arch: Arch) -> Result<CompiledImage, KernelError> {
    compile_family_as(family, arch, Build::Plain)
}

/// [`compile_family`] for a build.
pub fn compile_family_as(
    family: &KernelFamily,
    arch: Arch,
    build: Build,
) -> Result<CompiledImage, KernelError> {
    require_nvrtc()?;
    let name = family.name;
    let cstr = |s: &str| {
        CString::new(s).map_err(|_| KernelError::Nvrtc {
            family: name.to_string(),
            arch,
            call: "source",
            code: "embedded NUL byte".to_string(),
            log: String::new(),
        })
    };
    let src = cstr(&build.source(family))?;
    let file = cstr(family.file)?;
    let header_contents = HEADERS
        .iter()
        .map(|h| cstr(h.contents))
        .collect::<Result<Vec<_>, _>>()?;
    let header_names = HEADERS
        .iter()
        .map(|h| cstr(h.name))
        .collect::<Result<Vec<_>, _>>()?;
    let contents_ptrs: Vec<*const c_char> = header_contents.iter().map(|c| c.as_ptr()).collect();
    let name_ptrs: Vec<*const c_char> = header_names.iter().map(|c| c.as_ptr()).collect();
    let options = build
        .options(arch)
        .into_iter()
        .map(|o| cstr(&o))
        .collect::<Result<Vec<_>, _>>()?;
    let option_ptrs: Vec<*const c_char> = options.iter().map(|c| c.as_ptr()).collect();

    let mut raw = std::ptr::null_mut();
    // SAFETY: all strings outlive the program (they are dropped after `prog`), and the header
    // arrays have HEADERS.len() entries each.
    let prog = unsafe {
        check(
            sys::nvrtcCreateProgram(
                &mut raw,
                src.as_ptr(),
                file.as_ptr(),
                HEADERS.len() as c_int,
                contents_ptrs.as_ptr(),
                name_ptrs.as_ptr(),
            ),
            name,
            arch,
            "nvrtcCreateProgram",
            String::new(),
        )?;
        Program(raw)
    };
    // SAFETY: live program; option pointers are valid C strings.
    let compiled = unsafe {
        sys::nvrtcCompileProgram(prog.0, option_ptrs.len() as c_int, option_ptrs.as_ptr())
    };
    let log_bytes = read_sized(
        &prog,
        name,
        arch,
        ("nvrtcGetProgramLogSize", sys::nvrtcGetProgramLogSize),
        ("nvrtcGetProgramLog", sys::nvrtcGetProgramLog),
    )?;
    let log = String::from_utf8_lossy(&log_bytes)
        .trim_end_matches('\0')
        .trim()
        .to_string();
    check(compiled, name, arch, "nvrtcCompileProgram", log.clone())?;

    let kind = arch.image_kind();
    let image = match kind {
        ImageKind::Cubin => read_sized(
            &prog,
            name,
            arch,
            ("nvrtcGetCUBINSize", sys::nvrtcGetCUBINSize),
            ("nvrtcGetCUBIN", sys::nvrtcGetCUBIN),
        )?,
        ImageKind::Ptx => {
            let mut ptx = read_sized(
                &prog,
                name,
                arch,
                ("nvrtcGetPTXSize", sys::nvrtcGetPTXSize),
                ("nvrtcGetPTX", sys::nvrtcGetPTX),
            )?;
            // The driver wants PTX text without the terminating NUL.
            while ptx.last() == Some(&0) {
                ptx.pop();
            }
            ptx
        }
    };
    Ok(CompiledImage { kind, image, log })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_name_the_target_and_only_cubins_get_ptxas_flags() {
        let sm90 = compile_options(Arch::Sm90a);
        assert_eq!(sm90[0], "--gpu-architecture=sm_90a");
        assert!(sm90.iter().any(|o| o.starts_with("--ptxas-options")));
        let ptx = compile_options(Arch::Ptx { major: 8, minor: 9 });
        assert_eq!(ptx[0], "--gpu-architecture=compute_89");
        assert!(!ptx.iter().any(|o| o.starts_with("--ptxas-options")));
    }

    fn probe(source: &str) -> KernelFamily {
        KernelFamily {
            name: "probe",
            file: "probe.cu",
            source: String::leak(source.to_string()),
            functions: &[],
        }
    }

    /// What check-kernels relies on: warnings (front end and ptxas) land in the log, and
    /// errors come back as errors carrying the log.
    #[test]
    #[ignore = "needs NVRTC on the loader path; cargo xtask check-kernels runs it"]
    fn nvrtc_reports_warnings_and_errors() {
        assert!(nvrtc_available(), "NVRTC is not on the loader path");
        let unused = probe("#include \"dsv4_common.cuh\"\nDSV4_KERNEL void k(float* o) { int unused; o[0] = 1.0f; }");
        let img = compile_family(&unused, Arch::Sm90a).unwrap();
        assert!(img.log.contains("warning"), "log: {}", img.log);

        // A dynamically indexed array that has to live in local memory.
        let local = probe(
            "extern \"C\" __global__ void k(const unsigned* idx, float* out) {
                float a[256];
                for (int i = 0; i < 256; ++i) a[i] = out[i * 7];
                a[idx[threadIdx.x + 1] & 255] += 1.0f;
                out[threadIdx.x] = a[idx[threadIdx.x] & 255];
            }",
        );
        let img = compile_family(&local, Arch::Sm90a).unwrap();
        assert!(img.log.contains("Local memory used"), "log: {}", img.log);

        let bad = probe("extern \"C\" __global__ void k(float* o) { o[0] = undefined_name; }");
        match compile_family(&bad, Arch::Sm100a) {
            Err(KernelError::Nvrtc { log, call, .. }) => {
                assert_eq!(call, "nvrtcCompileProgram");
                assert!(log.contains("undefined_name"), "log: {log}");
            }
            other => panic!("expected a compile error, got {other:?}"),
        }
    }

    /// Every family's timeline build compiles (the scopes and the log's stores).
    #[test]
    #[ignore = "needs NVRTC on the loader path; cargo xtask check-kernels runs it"]
    fn nvrtc_compiles_every_family_for_a_timeline() {
        assert!(nvrtc_available(), "NVRTC is not on the loader path");
        for family in crate::FAMILIES {
            let img = compile_family_as(family, Arch::Sm90a, Build::Timeline)
                .unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(&img.image[..4], b"\x7fELF", "{}", family.name);
        }
    }

    /// Every family through both output paths (CUBIN and PTX).
    #[test]
    #[ignore = "needs NVRTC on the loader path; cargo xtask check-kernels runs it"]
    fn nvrtc_compiles_every_family_to_cubin_and_ptx() {
        assert!(nvrtc_available(), "NVRTC is not on the loader path");
        for family in crate::FAMILIES {
            for arch in [Arch::Sm90a, Arch::Ptx { major: 8, minor: 9 }] {
                let img = compile_family(family, arch).unwrap_or_else(|e| panic!("{e}"));
                assert!(!img.image.is_empty());
                match img.kind {
                    ImageKind::Cubin => assert_eq!(&img.image[..4], b"\x7fELF"),
                    ImageKind::Ptx => {
                        let text = std::str::from_utf8(&img.image).unwrap();
                        for f in family.functions {
                            assert!(
                                text.contains(&format!(".entry {f}(")),
                                "{f} missing from PTX"
                            );
                        }
                    }
                }
            }
        }
    }
}
