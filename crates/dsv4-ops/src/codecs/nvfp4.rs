//! NVFP4 (ModelOpt) weights: packed e2m1 `[rows, ceil(cols/2)]` (element 2k in the low
//! nibble), an e4m3fn scale per 16 consecutive elements of a row `[rows, ceil(cols/16)]`, and
//! one f32 global scale `weight_scale_2`.
//! `W[i, j] = e2m1(code[i, j]) * (e4m3(S[i, j/16]) * weight_scale_2)`.

use super::{amax, check_len, e2m1, e4m3, CodecError};

pub const BLOCK: usize = 16;

/// e4m3 code of 1.0, the block scale of all-zero blocks.
const UNIT_SCALE_CODE: u8 = 0x38;
/// e4m3 code of 2^-9, the smallest block scale the exporter emits.
const MIN_SCALE_CODE: u8 = 0x01;

/// Dequantizes one row: `packed_row.len() == ceil(n/2)`, `scale_row.len() == ceil(n/16)`.
#[inline]
pub fn dequant_row(packed_row: &[u8], scale_row: &[u8], global: f32, out: &mut [f32]) {
    assert_eq!(packed_row.len(), out.len().div_ceil(2), "nvfp4 row length");
    assert_eq!(
        scale_row.len(),
        out.len().div_ceil(BLOCK),
        "nvfp4 scale row length"
    );
    for ((o, p), &s) in out
        .chunks_mut(BLOCK)
        .zip(packed_row.chunks(BLOCK / 2))
        .zip(scale_row)
    {
        // Block scale times global scale first, then times the element (ModelOpt order).
        e2m1::decode_packed_scaled(p, e4m3::decode(s) * global, o);
    }
}

/// Dequantizes a whole `[rows, cols]` matrix.
pub fn dequantize(
    packed: &[u8],
    scale: &[u8],
    global: f32,
    rows: usize,
    cols: usize,
) -> Result<Vec<f32>, CodecError> {
    let (pc, sc) = (cols.div_ceil(2), cols.div_ceil(BLOCK));
    check_len("nvfp4 weight", rows * pc, packed.len())?;
    check_len("nvfp4 weight_scale", rows * sc, scale.len())?;
    let mut out = vec![0f32; rows * cols];
    for r in 0..rows {
        dequant_row(
            &packed[r * pc..][..pc],
            &scale[r * sc..][..sc],
            global,
            &mut out[r * cols..][..cols],
        );
    }
    Ok(out)
}

/// Packed codes, e4m3 block-scale bytes and the global scale.
#[derive(Debug, Clone, PartialEq)]
pub struct Nvfp4Quantized {
    pub weight: Vec<u8>,
    pub weight_scale: Vec<u8>,
    pub weight_scale_2: f32,
}

/// `weight_scale_2` for a tensor (or tensors sharing one scale) with absolute maximum `amax`:
/// `amax / (6 * 448)`, or 1.0 when `amax` is zero or not finite.
pub fn global_scale(amax: f32) -> f32 {
    if amax > 0.0 && amax.is_finite() {
        amax / (e2m1::MAX * e4m3::MAX)
    } else {
        1.0
    }
}

/// Quantizes `[rows, cols]` weights with the global scale taken from their own amax.
pub fn quantize(w: &[f32], rows: usize, cols: usize) -> Result<Nvfp4Quantized, CodecError> {
    quantize_with_global(w, rows, cols, global_scale(amax(w)))
}

/// Quantizes with a given global scale (w1 and w3 of one expert share one, the larger).
/// ModelOpt recipe: block scale = block_amax / (6 * global), rounded to e4m3 and clamped to
/// [2^-9, 448]; all-zero blocks get 1.0; elements are divided by (block scale * global).
pub fn quantize_with_global(
    w: &[f32],
    rows: usize,
    cols: usize,
    global: f32,
) -> Result<Nvfp4Quantized, CodecError> {
    check_len("nvfp4 input", rows * cols, w.len())?;
    if !(global > 0.0 && global.is_finite()) {
        return Err(CodecError::Invalid {
            what: "nvfp4 weight_scale_2",
            detail: format!("global scale {global} must be positive and finite"),
        });
    }
    let (pc, sc) = (cols.div_ceil(2), cols.div_ceil(BLOCK));
    let mut weight = vec![0u8; rows * pc];
    let mut weight_scale = vec![0u8; rows * sc];
    let mut codes = [0u8; BLOCK];
    for r in 0..rows {
        let row = &w[r * cols..][..cols];
        for (b, blk) in row.chunks(BLOCK).enumerate() {
            let m = amax(blk);
            let code = if m == 0.0 {
                UNIT_SCALE_CODE
            } else {
                // encode() saturates at 448; the lower clamp keeps tiny blocks from flushing to 0.
                e4m3::encode(m / (e2m1::MAX * global)).max(MIN_SCALE_CODE)
            };
            weight_scale[r * sc + b] = code;
            let s = e4m3::decode(code) * global;
            for (c, &x) in codes.iter_mut().zip(blk) {
                *c = e2m1::encode(x / s);
            }
            let start = r * pc + b * BLOCK / 2;
            e2m1::pack(
                &codes[..blk.len()],
                &mut weight[start..start + blk.len().div_ceil(2)],
            );
        }
    }
    Ok(Nvfp4Quantized {
        weight,
        weight_scale,
        weight_scale_2: global,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codecs::e2m1_half_step;
    use proptest::prelude::*;

    #[test]
    fn known_row_and_bad_lengths() {
        // Codes 7 (6) and 0x9 (-0.5); block scale 2.0 (0x40), global 0.25.
        let mut out = [0f32; 2];
        dequant_row(&[0x97], &[0x40], 0.25, &mut out);
        assert_eq!(out, [3.0, -0.25]);
        assert!(dequantize(&[0; 1], &[0x38], 1.0, 1, 4).is_err());
        assert!(quantize_with_global(&[1.0; 4], 1, 4, 0.0).is_err());
        assert!(quantize_with_global(&[1.0; 4], 1, 4, f32::NAN).is_err());
    }

    #[test]
    fn zero_blocks_get_unit_scale_and_tiny_blocks_are_clamped() {
        let mut w = vec![0f32; 48];
        w[40] = 100.0;
        w[20] = 1e-9;
        let q = quantize(&w, 1, 48).unwrap();
        assert_eq!(q.weight_scale_2, 100.0 / 2688.0);
        assert_eq!(q.weight_scale, vec![UNIT_SCALE_CODE, MIN_SCALE_CODE, 0x7e]);
        let d = dequantize(&q.weight, &q.weight_scale, q.weight_scale_2, 1, 48).unwrap();
        assert!((d[40] - 100.0).abs() < 1e-4);
        assert_eq!(d[20], 0.0);
    }

    proptest! {
        /// Values built as e2m1 * e4m3 * 2^-k, where every block holds a ±6 code and one block
        /// has scale 448, quantize back exactly (the global scale is then an exact power of 2).
        #[test]
        fn round_trip_is_exact(
            rows in 1usize..5, cols in 1usize..70, k in 0i32..12,
            codes in prop::collection::vec(0u8..16, 350),
            scales in prop::collection::vec(1u8..0x7f, 25),
        ) {
            let global = 2f32.powi(-k);
            let sc = cols.div_ceil(BLOCK);
            let mut w = vec![0f32; rows * cols];
            for r in 0..rows {
                for b in 0..sc {
                    let s = if r == 0 && b == 0 { 448.0 } else { e4m3::decode(scales[r * sc + b]) };
                    for c in b * BLOCK..((b + 1) * BLOCK).min(cols) {
                        let code = if c == b * BLOCK { 7 | (codes[r * cols + c] & 8) } else { codes[r * cols + c] };
                        w[r * cols + c] = e2m1::decode(code) * s * global;
                    }
                }
            }
            let q = quantize(&w, rows, cols).unwrap();
            prop_assert_eq!(q.weight_scale_2, global);
            let d = dequantize(&q.weight, &q.weight_scale, q.weight_scale_2, rows, cols).unwrap();
            prop_assert_eq!(d, w);
        }

        #[test]
        fn error_is_at_most_half_a_step(
            rows in 1usize..4, cols in 1usize..100,
            vals in prop::collection::vec(-50f32..50.0, 400),
        ) {
            let w = &vals[..rows * cols];
            let q = quantize(w, rows, cols).unwrap();
            let d = dequantize(&q.weight, &q.weight_scale, q.weight_scale_2, rows, cols).unwrap();
            let sc = cols.div_ceil(BLOCK);
            for r in 0..rows {
                for c in 0..cols {
                    let s = e4m3::decode(q.weight_scale[r * sc + c / BLOCK]) * q.weight_scale_2;
                    let x = w[r * cols + c];
                    // e4m3 rounding of the block scale can push |x|/s slightly past 6; that
                    // saturation error is still below the top interval's half step.
                    let y = (x / s).abs().min(6.0);
                    let err = (d[r * cols + c] - x).abs();
                    prop_assert!(err <= e2m1_half_step(y) * s * (1.0 + 1e-5), "x={} got={} s={}", x, d[r * cols + c], s);
                }
            }
        }
    }
}
