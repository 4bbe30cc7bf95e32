//! MXFP4 weights: packed e2m1 `[rows, ceil(cols/2)]` (element 2k in the low nibble) with one
//! e8m0 scale per 32 consecutive elements of a row, `[rows, ceil(cols/32)]`.
//! `W[i, j] = e2m1(code[i, j]) * 2^(S[i, j/32] - 127)`.

use super::{amax, check_len, e2m1, e8m0, CodecError};

pub const BLOCK: usize = 32;

/// Dequantizes one row: `packed_row.len() == ceil(n/2)`, `scale_row.len() == ceil(n/32)`
/// where `n = out.len()`.
#[inline]
pub fn dequant_row(packed_row: &[u8], scale_row: &[u8], out: &mut [f32]) {
    assert_eq!(packed_row.len(), out.len().div_ceil(2), "mxfp4 row length");
    assert_eq!(
        scale_row.len(),
        out.len().div_ceil(BLOCK),
        "mxfp4 scale row length"
    );
    for ((o, p), &s) in out
        .chunks_mut(BLOCK)
        .zip(packed_row.chunks(BLOCK / 2))
        .zip(scale_row)
    {
        e2m1::decode_packed_scaled(p, e8m0::decode(s), o);
    }
}

/// Dequantizes a whole `[rows, cols]` matrix.
pub fn dequantize(
    packed: &[u8],
    scale: &[u8],
    rows: usize,
    cols: usize,
) -> Result<Vec<f32>, CodecError> {
    let (pc, sc) = (cols.div_ceil(2), cols.div_ceil(BLOCK));
    check_len("mxfp4 weight", rows * pc, packed.len())?;
    check_len("mxfp4 scale", rows * sc, scale.len())?;
    let mut out = vec![0f32; rows * cols];
    for r in 0..rows {
        dequant_row(
            &packed[r * pc..][..pc],
            &scale[r * sc..][..sc],
            &mut out[r * cols..][..cols],
        );
    }
    Ok(out)
}

/// Packed codes and e8m0 scale bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct Mxfp4Quantized {
    pub weight: Vec<u8>,
    pub scale: Vec<u8>,
}

/// Quantizes `[rows, cols]` weights. Each 32-block's scale is the smallest power of two that
/// fits its amax under 6, so no element saturates and the error is at most half an e2m1 step.
pub fn quantize(w: &[f32], rows: usize, cols: usize) -> Result<Mxfp4Quantized, CodecError> {
    check_len("mxfp4 input", rows * cols, w.len())?;
    let (pc, sc) = (cols.div_ceil(2), cols.div_ceil(BLOCK));
    let mut weight = vec![0u8; rows * pc];
    let mut scale = vec![0u8; rows * sc];
    let mut codes = [0u8; BLOCK];
    for r in 0..rows {
        let row = &w[r * cols..][..cols];
        for (b, blk) in row.chunks(BLOCK).enumerate() {
            let byte = e8m0::scale_for_amax(amax(blk), e2m1::MAX);
            scale[r * sc + b] = byte;
            // Power-of-two scale: multiplying by the inverse is exact.
            let inv = 1.0 / e8m0::decode(byte);
            for (c, &x) in codes.iter_mut().zip(blk) {
                *c = e2m1::encode(x * inv);
            }
            let start = r * pc + b * BLOCK / 2;
            e2m1::pack(
                &codes[..blk.len()],
                &mut weight[start..start + blk.len().div_ceil(2)],
            );
        }
    }
    Ok(Mxfp4Quantized { weight, scale })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codecs::e2m1_half_step;
    use proptest::prelude::*;

    #[test]
    fn known_row() {
        // Codes 1 (0.5) and 0xf (-6) in byte 0, scale 2^1.
        let mut out = [0f32; 2];
        dequant_row(&[0xf1], &[128], &mut out);
        assert_eq!(out, [1.0, -12.0]);
        assert!(dequantize(&[0; 3], &[127], 1, 4).is_err());
        assert!(dequantize(&[0; 2], &[127, 127], 1, 4).is_err());
    }

    #[test]
    fn zero_rows_get_unit_scale() {
        let q = quantize(&[0.0; 40], 1, 40).unwrap();
        assert_eq!(q.scale, vec![127, 127]);
        assert!(q.weight.iter().all(|&b| b == 0));
    }

    proptest! {
        #[test]
        fn round_trip_is_exact(
            rows in 1usize..6, cols in 1usize..100,
            codes in prop::collection::vec(0u8..16, 600),
            scales in prop::collection::vec(90u8..160, 24),
        ) {
            let pc = cols.div_ceil(2);
            let mut packed = vec![0u8; rows * pc];
            for r in 0..rows {
                e2m1::pack(&codes[r * cols..(r + 1) * cols], &mut packed[r * pc..(r + 1) * pc]);
            }
            let scale = &scales[..rows * cols.div_ceil(BLOCK)];
            let x = dequantize(&packed, scale, rows, cols).unwrap();
            let q = quantize(&x, rows, cols).unwrap();
            let y = dequantize(&q.weight, &q.scale, rows, cols).unwrap();
            prop_assert_eq!(x, y);
        }

        #[test]
        fn error_is_at_most_half_a_step(
            rows in 1usize..4, cols in 1usize..200,
            vals in prop::collection::vec(-100f32..100.0, 800),
        ) {
            let w = &vals[..rows * cols];
            let q = quantize(w, rows, cols).unwrap();
            let d = dequantize(&q.weight, &q.scale, rows, cols).unwrap();
            let sc = cols.div_ceil(BLOCK);
            for r in 0..rows {
                for c in 0..cols {
                    let s = e8m0::decode(q.scale[r * sc + c / BLOCK]);
                    let x = w[r * cols + c];
                    prop_assert!((x / s).abs() <= 6.0);
                    prop_assert!((d[r * cols + c] - x).abs() <= e2m1_half_step((x / s).abs()) * s, "x={} got={}", x, d[r * cols + c]);
                }
            }
        }
    }
}
