//! The prefill GEMM (`kernels/gemm.cu`): what [`super::gemv`]'s launchers run for more than
//! [`MAX_M`] activation rows. The same weights (the GEMV's packed tiles, every format), the same
//! products on the same MMAs, but each weight byte is read once per 64 rows and each warp sums
//! its tile's whole K in registers (no split, no workspace), so a row's result depends only on
//! its own activations, never on how many rows share the launch. CPU reference:
//! [`super::gemv::reference`]; the GPU tests are `tests/gpu_gemv.rs`.

use cudarc::driver::DeviceRepr;

use super::gemv::{pack, GemvFormat, GemvWeight, Output, MAX_M};
use super::launch::{dim_u32, launch_struct};
use super::{Device, DeviceTensor, GpuError};
use half::bf16;

/// Activation rows of one block (eight MMA column blocks of 8).
const ROWS: usize = 64;
/// Warps of a block, one 16-row weight tile each (`WARPS` in gemm.cu).
const WARPS: usize = 8;
/// Shared memory of a block: two slabs of 64 rows of 256 + 8 bf16 (`KS`, `XS` in gemm.cu).
const SHARED: usize = 2 * ROWS * (256 + 8) * 2;

/// Kernel arguments (mirrors `GemmArgs` in gemm.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct GemmArgs {
    x: u64,
    w: u64,
    s: u64,
    fs0: u64,
    fs1: u64,
    y: u64,
    m: u32,
    n: u32,
    k: u32,
    post0: f32,
    post1: f32,
    limit: f32,
    fp8_br: u32,
    tiles: u32,
    y_f32: u32,
    x_ld: u32,
    y_ld: u32,
}

// SAFETY: plain old data with the CUDA struct's layout (checked by a test).
unsafe impl DeviceRepr for GemmArgs {}

/// Launches `prefix` (`gemm_` or `gemm_swiglu_`) for `m > MAX_M` rows of `x [m, groups·K]`
/// into `y`: `groups` blocks of the weight's rows, group `g` reading x's columns
/// `[g·K, (g+1)·K)` (the caller checked every shape).
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch(
    dev: &Device,
    prefix: &str,
    x: &DeviceTensor<bf16>,
    m: usize,
    w: &GemvWeight,
    limit: f32,
    y: Output,
    groups: usize,
) -> Result<(), GpuError> {
    debug_assert!(m > MAX_M);
    let kernel = format!("{prefix}{}", w.format.name());
    let limits = dev.kernel_limits(&kernel)?;
    if SHARED + limits.static_shared > dev.max_block_shared() {
        return Err(GpuError::invalid(
            "gemm",
            format!(
                "{kernel} needs {SHARED} bytes of shared memory a block; this GPU gives {}",
                dev.max_block_shared()
            ),
        ));
    }
    let rows = w.n / groups;
    let tiles = pack::Layout {
        rows,
        chunks: w.k / w.format.chunk_elems(),
        gate_up: w.gate_up,
    }
    .tiles();
    let (fs0, fs1) = w.fp8_scale_addresses();
    let args = GemmArgs {
        x: x.device_address(),
        w: w.codes.device_address(),
        s: w.scales.as_ref().map_or(0, |s| s.device_address()),
        fs0,
        fs1,
        y: y.address,
        m: dim_u32("gemm rows", m)?,
        n: dim_u32("gemm n", rows)?,
        k: dim_u32("gemm k", w.k)?,
        post0: w.post.0,
        post1: w.post.1,
        limit,
        fp8_br: match w.format {
            GemvFormat::Fp8 { block, .. } => block.0 as u32,
            _ => 1,
        },
        tiles: dim_u32("gemm tiles", tiles)?,
        y_f32: y.mode,
        x_ld: dim_u32("gemm x row", groups * w.k)?,
        y_ld: dim_u32("gemm y row", w.n)?,
    };
    let grid = (
        dim_u32("gemm row blocks", m.div_ceil(ROWS))?,
        dim_u32("gemm tile blocks", tiles.div_ceil(WARPS))?,
        dim_u32("gemm groups", groups)?,
    );
    // SAFETY: GemmArgs mirrors the kernel's argument; the weight's tensors hold `groups * tiles`
    // whole packed tiles; x and y were checked against (m, groups * k) and (m, n).
    unsafe {
        launch_struct(
            dev,
            &kernel,
            grid,
            ((WARPS * 32) as u32, SHARED as u32),
            &args,
            super::gemv::tuning::PROGRAMMATIC_LAUNCH.get(),
            1,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args_layout_matches_the_cuda_struct() {
        // 6 pointers, 3 u32, 3 f32, 5 u32 = 92 bytes, padded to 96.
        assert_eq!(std::mem::size_of::<GemmArgs>(), 96);
        assert_eq!(std::mem::align_of::<GemmArgs>(), 8);
    }
}
