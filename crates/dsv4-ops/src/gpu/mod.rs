//! GPU runtime: a [`Device`] (context, one capturable stream, loaded kernels), typed
//! [`DeviceTensor`]s, a fixed-address [`BufferPool`], and launchers.
//!
//! Adding a kernel family, side by side:
//! 1. `crates/dsv4-kernels/kernels/<family>.cu`, listed in `dsv4_kernels::FAMILIES`;
//! 2. `gpu/<family>/mod.rs`: one launcher per kernel, taking `&Device` and tensors, checking
//!    every dtype and shape (so the kernel can trust its arguments) and returning [`GpuError`];
//! 3. `gpu/<family>/reference.rs`: the CPU reference of each launcher, on host slices;
//! 4. `gpu/<family>/tests.rs`: `#[ignore]`d tests named `gpu_*` comparing launcher and
//!    reference on fresh random inputs of random shapes (see `gpu::testing`), plus CPU-only
//!    tests of the reference itself.

pub mod attention;
pub mod bandwidth;
pub mod collective;
mod device;
pub mod formats;
mod gemm;
pub mod gemv;
mod launch;
pub mod mhc;
pub mod moe;
pub mod moe_bf16;
mod pool;
pub mod random;
pub mod relayout;
pub mod router;
pub mod rows;
pub mod sample;
pub mod stager;
mod tensor;
#[cfg(any(test, feature = "test-support"))]
pub mod testing;
pub mod timeline;

pub use device::{Device, Readback, Side};
pub use launch::launch_function;
pub use pool::{BufferInfo, BufferPool, PoolError, Reservation};
pub use stager::Stager;
pub use tensor::{DType, DeviceElem, DeviceTensor};

pub use cudarc::driver::{CudaContext, CudaFunction, CudaStream, DriverError, LaunchConfig};
pub use dsv4_kernels::{Arch, KernelCache, KernelError, Kernels};

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("no CUDA driver library (libcuda.so) on this machine")]
    NoDriver,
    #[error("no CUDA device {ordinal} (the driver reports {count})")]
    NoDevice { ordinal: usize, count: usize },
    #[error("CUDA driver error while {what}: {source}")]
    Driver {
        what: String,
        #[source]
        source: DriverError,
    },
    #[error(transparent)]
    Kernel(#[from] KernelError),
    #[error(transparent)]
    Pool(#[from] PoolError),
    #[error("{what}: dtype {found:?} where {expected:?} is needed")]
    DType {
        what: String,
        expected: DType,
        found: DType,
    },
    #[error("{what}: shape {found:?} where {expected:?} is needed")]
    Shape {
        what: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("{what}: {detail}")]
    Invalid { what: String, detail: String },
    #[error("{what} while the stream is captured into a CUDA graph: a captured step must not allocate, copy to or from the host, or wait")]
    InCapture { what: &'static str },
}

impl GpuError {
    pub(crate) fn driver(what: impl Into<String>) -> impl FnOnce(DriverError) -> GpuError {
        let what = what.into();
        move |source| GpuError::Driver { what, source }
    }

    pub fn invalid(what: impl Into<String>, detail: impl Into<String>) -> GpuError {
        GpuError::Invalid {
            what: what.into(),
            detail: detail.into(),
        }
    }
}
