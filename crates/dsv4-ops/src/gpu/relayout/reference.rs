//! CPU references of the re-layouts.

use crate::codecs::fp8_block::ScaleFormat;
use crate::gpu::gemv::pack::{encode_codes, pack, CodeOrder, Layout};
use crate::gpu::GpuError;

/// The tiles of row-major `w` (and `w3` for gate+up) with `unit` bytes per chunk, codes in
/// `order`.
pub fn pack_tiles(
    layout: &Layout,
    unit: usize,
    order: CodeOrder,
    w: &[u8],
    w3: &[u8],
) -> Result<Vec<u8>, GpuError> {
    let mut out = pack(layout, unit, w, w3)?;
    encode_codes(order, &mut out);
    Ok(out)
}

/// The least power of two at or above `x > 0` (1 for zero or NaN, `x` for infinity), found by
/// doubling and halving, so exactly.
pub fn pow2_at_or_above(x: f32) -> f32 {
    if x.is_nan() || x <= 0.0 {
        return 1.0;
    }
    if x.is_infinite() {
        return x;
    }
    let mut f = 1.0f32;
    while f < x {
        f *= 2.0;
    }
    while f * 0.5 >= x {
        f *= 0.5;
    }
    f
}

/// The kernels' FP8 scales, row-major `[ceil(n / br), ceil(k / 64) + 1]`: for each row of scale
/// blocks, its scales repeated to one per 64 columns (the span of one lane quad in the GEMV
/// kernels, so they index them without a division and never decode e8m0) and divided by the
/// row's factor, then the factor, the least power of two at or above the row's largest scale.
/// The kernels multiply sums by the factor once at the end; the M = 1 FP8 kernels multiply
/// activations by the divided scales (at most 1) in f16, where the factor keeps them in range
/// whatever the scales' magnitude. Dividing by a power of two is exact.
pub fn fp8_scale_rows(
    raw: &[u8],
    sf: ScaleFormat,
    n: usize,
    k: usize,
    block: (usize, usize),
) -> Vec<f32> {
    let (rows, cols, groups) = (n.div_ceil(block.0), k.div_ceil(block.1), k.div_ceil(64));
    let mut v = Vec::with_capacity(rows * (groups + 1));
    for r in 0..rows {
        let row: Vec<f32> = (0..groups)
            .map(|g| sf.get(raw, r * cols + g * 64 / block.1))
            .collect();
        let factor = pow2_at_or_above(row.iter().fold(0.0f32, |a, &b| a.max(b)));
        v.extend(row.iter().map(|s| s / factor));
        v.push(factor);
    }
    v
}
