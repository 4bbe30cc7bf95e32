//! Small helpers shared by launchers.

use cudarc::driver::sys::{CUlaunchAttribute, CUlaunchAttributeID};
use cudarc::driver::{DriverError, LaunchConfig};

use super::GpuError;

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
