//! CUDA kernels of the engine, compiled at run time.
//!
//! The `.cu` sources under `kernels/` are embedded in the crate. [`Kernels::load`] compiles
//! every family with NVRTC for the exact architecture of the device (CUBIN for `sm_90a` and
//! `sm_100a`, PTX for anything else), keeps the images in an on-disk [`KernelCache`], loads
//! them and hands out [`CudaFunction`]s by name.
//!
//! Adding a kernel family: put `kernels/<family>.cu` next to the others (it may include
//! `dsv4_common.cuh`), declare its entry points with `DSV4_KERNEL`, and list it in
//! [`FAMILIES`]. The unit tests check that the list and the sources agree, and
//! `cargo xtask check-kernels` compiles it for every target architecture.

mod arch;
mod cache;
mod compile;
mod registry;
mod sources;
pub mod timeline;

pub use arch::{Arch, ImageKind};
pub use cache::{
    decode_entry, encode_entry, CacheKey, CacheLookup, EntryError, KernelCache, KeyInputs,
};
pub use compile::{
    compile_family, compile_family_as, compile_options, driver_available, nvrtc_available,
    nvrtc_version, Build, CompiledImage, GEMV_FP8_RING, NORM_HELD,
};
pub use cudarc;
pub use cudarc::driver::CudaFunction;
pub use registry::{precompile, FamilyLoad, FamilyTiming, ImageSource, Kernels, PrecompileReport};
pub use sources::{family, Header, KernelFamily, FAMILIES, HEADERS};

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error(
        "the NVRTC library (libnvrtc.so.13 or libnvrtc.so) was not found on the dynamic loader path; \
         install CUDA 13 NVRTC and add its lib directory to LD_LIBRARY_PATH"
    )]
    NvrtcMissing,
    #[error("NVRTC {call} failed for family `{family}` ({arch}): {code}\n{log}")]
    Nvrtc {
        family: String,
        arch: Arch,
        call: &'static str,
        code: String,
        log: String,
    },
    #[error("CUDA driver error while {what}: {source}")]
    Driver {
        what: String,
        #[source]
        source: cudarc::driver::DriverError,
    },
    #[error("kernel cache {}: {source}", path.display())]
    Cache {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the kernel cache entry just written for `{family}` does not read back: {reason}")]
    CacheReadBack { family: String, reason: String },
    #[error("no kernel named `{0}` in any family")]
    UnknownFunction(String),
    #[error("unknown GPU architecture `{0}` (expected sm_90a, sm_100a or compute_<major><minor>)")]
    BadArch(String),
    #[error("no cache directory for kernels: set DSV4_KERNEL_CACHE")]
    NoCacheDir,
}

impl KernelError {
    pub(crate) fn driver(what: impl Into<String>, source: cudarc::driver::DriverError) -> Self {
        KernelError::Driver {
            what: what.into(),
            source,
        }
    }
}
