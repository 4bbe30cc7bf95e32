//! Kernel launches and small helpers shared by launchers.
//!
//! Every kernel of a decode step launches with programmatic stream serialization: it may start
//! while its predecessor in the stream still runs, and waits for it in-kernel
//! (`griddepcontrol.wait`, `pdl_wait` in dsv4_common.cuh) before it touches memory that the
//! predecessor writes or reads. Launch latency and the next kernel's prologue so overlap the
//! previous kernel's tail, inside CUDA graphs too (the captured edges are programmatic).

use cudarc::driver::sys::{self as cu, CUlaunchAttribute, CUlaunchAttributeID};
use cudarc::driver::{DeviceRepr, DriverError, LaunchConfig};

use super::gemv::tuning::PROGRAMMATIC_LAUNCH;
use super::{Device, DeviceElem, DeviceTensor, GpuError};

/// Most by-value arguments a kernel of [`launch`] takes.
const MAX_ARGS: usize = 24;

/// A kernel's arguments, in order: scalars and device addresses, 8 bytes at most each (kernels
/// that take a struct launch through [`launch_struct`]).
pub(crate) struct Args {
    slots: [u64; MAX_ARGS],
    n: usize,
}

impl Args {
    pub(crate) fn new() -> Args {
        Args {
            slots: [0; MAX_ARGS],
            n: 0,
        }
    }

    /// A scalar argument (`u32`, `f32`, `u64`...).
    pub(crate) fn arg<T: DeviceRepr + Copy>(&mut self, v: T) -> &mut Args {
        const {
            assert!(
                std::mem::size_of::<T>() <= 8,
                "an argument slot holds 8 bytes"
            )
        };
        assert!(self.n < MAX_ARGS, "more than {MAX_ARGS} kernel arguments");
        // SAFETY: T is plain data of at most 8 bytes, copied into the slot's first bytes (the
        // driver reads sizeof(parameter) bytes from the slot's address).
        unsafe {
            std::ptr::copy_nonoverlapping(
                &v as *const T as *const u8,
                &mut self.slots[self.n] as *mut u64 as *mut u8,
                std::mem::size_of::<T>(),
            )
        };
        self.n += 1;
        self
    }

    /// A tensor's device address (read or written by the kernel alike).
    pub(crate) fn ptr<T: DeviceElem>(&mut self, t: &DeviceTensor<T>) -> &mut Args {
        self.arg(t.device_address())
    }
}

/// Launches `kernel` with `cfg` and `args` on the device stream (programmatic, see the module
/// docs).
///
/// # Safety
/// `args` must be the kernel's parameters in order and type, every address valid for what the
/// kernel reads and writes with `cfg`.
pub(crate) unsafe fn launch(
    dev: &Device,
    kernel: &str,
    cfg: LaunchConfig,
    args: &Args,
) -> Result<(), GpuError> {
    // SAFETY: the caller's.
    unsafe { launch_clustered(dev, kernel, cfg, args, 1) }
}

/// [`launch`] with the blocks grouped into clusters of `cluster_y` along the grid's y (1: no
/// clusters; more needs sm_90).
///
/// # Safety
/// As [`launch`].
pub(crate) unsafe fn launch_clustered(
    dev: &Device,
    kernel: &str,
    cfg: LaunchConfig,
    args: &Args,
    cluster_y: u32,
) -> Result<(), GpuError> {
    // Pointers to copies of the slots, on the stack: a launch allocates nothing.
    let mut slots = args.slots;
    let mut params = [std::ptr::null_mut::<std::ffi::c_void>(); MAX_ARGS];
    for (p, s) in params.iter_mut().zip(&mut slots) {
        *p = s as *mut u64 as *mut std::ffi::c_void;
    }
    let (grid, block) = (cfg.grid_dim, cfg.block_dim);
    debug_assert!(block.1 == 1 && block.2 == 1, "1-D blocks");
    // SAFETY: the caller's; params point into `slots`, alive for the call.
    unsafe {
        launch_params(
            dev,
            kernel,
            grid,
            (block.0, cfg.shared_mem_bytes),
            &mut params[..args.n],
            PROGRAMMATIC_LAUNCH.get(),
            cluster_y,
        )
    }
}

/// Launches `kernel`, whose single parameter is the `#[repr(C)]` struct `args`, with
/// programmatic stream serialization when `pdl` is set. `cluster_y` > 1 groups the blocks into
/// clusters of that many along the grid's y.
///
/// # Safety
/// `args` must mirror the kernel's parameter, and every address in it be valid for what the
/// kernel reads and writes with that grid and `shared` bytes of dynamic shared memory.
pub(crate) unsafe fn launch_struct<A: DeviceRepr>(
    dev: &Device,
    kernel: &str,
    grid: (u32, u32, u32),
    block_shared: (u32, u32),
    args: &A,
    pdl: bool,
    cluster_y: u32,
) -> Result<(), GpuError> {
    let mut params = [args as *const A as *mut std::ffi::c_void];
    // SAFETY: the caller's.
    unsafe { launch_params(dev, kernel, grid, block_shared, &mut params, pdl, cluster_y) }
}

/// # Safety
/// As [`launch`]: `params` point at the kernel's parameters.
unsafe fn launch_params(
    dev: &Device,
    kernel: &str,
    grid: (u32, u32, u32),
    block_shared: (u32, u32),
    params: &mut [*mut std::ffi::c_void],
    pdl: bool,
    cluster_y: u32,
) -> Result<(), GpuError> {
    let f = dev.function(kernel)?;
    // SAFETY: the caller's.
    unsafe { launch_function(dev, f, kernel, grid, block_shared, params, pdl, cluster_y) }
}

/// Launches the loaded function `f` (named `kernel` in errors) on [`Device::stream`] (a side
/// stream inside [`Device::on`]), with programmatic stream serialization when `pdl` is set
/// and clusters of `cluster_y` blocks along the grid's y when it is above 1: how every launcher
/// launches, open to functions loaded elsewhere (the benchmarks' own kernels). It sets no
/// function attribute: a function loaded elsewhere that takes more than 48 KiB of dynamic
/// shared memory, or clusters past the portable size, must be opted in by its caller.
///
/// # Safety
/// `params` must point at `f`'s parameters, and every address among them be valid for what the
/// kernel reads and writes with that grid and `shared` bytes of dynamic shared memory.
#[allow(clippy::too_many_arguments)]
pub unsafe fn launch_function(
    dev: &Device,
    f: &cudarc::driver::CudaFunction,
    kernel: &str,
    grid: (u32, u32, u32),
    (block, shared): (u32, u32),
    params: &mut [*mut std::ffi::c_void],
    pdl: bool,
    cluster_y: u32,
) -> Result<(), GpuError> {
    let stream = dev.stream();
    stream
        .context()
        .bind_to_thread()
        .map_err(launch_err(kernel))?;
    // SAFETY: a zeroed attribute is a valid C union; each id selects the field set below.
    let mut attrs: [cu::CUlaunchAttribute; 2] = unsafe { std::mem::zeroed() };
    let mut n = 0;
    if pdl {
        attrs[n].id =
            cu::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attrs[n].value.programmaticStreamSerializationAllowed = 1;
        n += 1;
    }
    if cluster_y > 1 {
        attrs[n] = cluster_attribute(cluster_y);
        n += 1;
    }
    let cfg = cu::CUlaunchConfig {
        gridDimX: grid.0,
        gridDimY: grid.1,
        gridDimZ: grid.2,
        blockDimX: block,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: shared,
        hStream: stream.cu_stream(),
        attrs: attrs.as_mut_ptr(),
        numAttrs: n as u32,
    };
    // SAFETY: the caller vouches for the kernel and its parameters; cfg and attrs outlive the
    // call.
    unsafe {
        cu::cuLaunchKernelEx(
            &cfg,
            f.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
    .map_err(launch_err(kernel))
}

/// Threads per block of the element-wise kernels.
pub(crate) const THREADS: u32 = 256;
/// Grid cap for grid-stride kernels: enough blocks to fill any current GPU several times over.
const MAX_BLOCKS: u64 = 1 << 16;

/// A 1-D launch with `work` items spread over `per_block` items per block (grid-stride
/// kernels accept any grid, so large inputs are capped). `work` must be non-zero.
pub(crate) fn grid_for(work: u64, per_block: u64, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (work.div_ceil(per_block).clamp(1, MAX_BLOCKS) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One thread per item.
pub(crate) fn elementwise(work: u64) -> LaunchConfig {
    grid_for(work, THREADS as u64, THREADS)
}

/// The error of a failed launch of `kernel`.
pub(crate) fn launch_err(kernel: &str) -> impl FnOnce(DriverError) -> GpuError + '_ {
    move |source| GpuError::Driver {
        what: format!("launching {kernel}"),
        source,
    }
}

/// A launch of `tokens` tokens reads their positions from `pos` (U32): one position, the first
/// of one sequence's chunk (the kernels' `batch` 0), or one for each token, a batch of
/// sequences a token each (1: token t at `pos[t]`, its state slice t of each state buffer).
pub(crate) fn batch_flag(
    pos: &DeviceTensor<u32>,
    tokens: usize,
    what: &str,
) -> Result<u32, GpuError> {
    let n = pos.len();
    pos.expect(what, super::DType::U32, &[n])?;
    match n {
        1 => Ok(0),
        n if n == tokens => Ok(1),
        n => Err(GpuError::invalid(
            what,
            format!("{n} positions for {tokens} tokens (one for a chunk, one a token for a batch)"),
        )),
    }
}

/// Kernel dimensions are 32-bit.
pub(crate) fn dim_u32(what: &str, v: usize) -> Result<u32, GpuError> {
    u32::try_from(v).map_err(|_| GpuError::invalid(what, format!("dimension {v} exceeds u32")))
}

/// The launch attribute that groups blocks into clusters of `y` blocks along the grid's y.
pub(crate) fn cluster_attribute(y: u32) -> CUlaunchAttribute {
    // SAFETY: a zeroed attribute is a valid C union; the id selects the field set below.
    let mut attr: CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attr.value.clusterDim.x = 1;
    attr.value.clusterDim.y = y;
    attr.value.clusterDim.z = 1;
    attr
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grids_are_capped_and_never_empty() {
        assert_eq!(elementwise(1).grid_dim.0, 1);
        assert_eq!(elementwise(256).grid_dim.0, 1);
        assert_eq!(elementwise(257).grid_dim.0, 2);
        assert_eq!(elementwise(u64::MAX / 2).grid_dim.0 as u64, MAX_BLOCKS);
        assert_eq!(grid_for(9, 4, 128).grid_dim.0, 3);
        assert!(dim_u32("d", 1 << 33).is_err());
    }
}
