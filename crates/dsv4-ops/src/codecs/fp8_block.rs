//! FP8 block-scaled weights: e4m3fn weight `[rows, cols]` and one scale per
//! `block_rows x block_cols` tile, `[ceil(rows/block_rows), ceil(cols/block_cols)]`,
//! stored either as e8m0 bytes (official instruct releases) or little-endian f32 (Base releases).
//! `W[i, j] = e4m3(Wq[i, j]) * S[i / block_rows, j / block_cols]`.

use super::{amax, check_len, e4m3, e8m0, CodecError};

/// Block edge used by the DeepSeek-V4 releases.
pub const BLOCK: usize = 128;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleFormat {
    E8m0,
    F32,
}

impl ScaleFormat {
    pub fn bytes(self) -> usize {
        match self {
            ScaleFormat::E8m0 => 1,
            ScaleFormat::F32 => 4,
        }
    }

    /// Scale `i` of a raw scale buffer.
    #[inline]
    pub fn get(self, scale: &[u8], i: usize) -> f32 {
        match self {
            ScaleFormat::E8m0 => e8m0::decode(scale[i]),
            ScaleFormat::F32 => {
                let b = &scale[4 * i..4 * i + 4];
                f32::from_le_bytes([b[0], b[1], b[2], b[3]])
            }
        }
    }
}

/// Block edge implied by a dimension and its scale count: the power of two `b` with
/// `ceil(dim / b) == scale_dim` (block sizes are powers of two, so `ceil(dim/scale_dim)` is
/// rounded up to one). `None` when no block size fits.
pub fn infer_block(dim: usize, scale_dim: usize) -> Option<usize> {
    if scale_dim == 0 {
        return (dim == 0).then_some(BLOCK);
    }
    let b = dim.div_ceil(scale_dim).max(1).next_power_of_two();
    (dim.div_ceil(b) == scale_dim).then_some(b)
}

/// Dequantizes one weight row. `scale_row` holds the raw scales of the row's block-row
/// (`ceil(out.len() / block_cols)` entries); `weight_row.len() == out.len()`.
#[inline]
pub fn dequant_row(
    weight_row: &[u8],
    scale_row: &[u8],
    format: ScaleFormat,
    block_cols: usize,
    out: &mut [f32],
) {
    assert_eq!(weight_row.len(), out.len(), "fp8 row length");
    assert!(
        scale_row.len() >= out.len().div_ceil(block_cols) * format.bytes(),
        "fp8 scale row length"
    );
    for (b, (w, o)) in weight_row
        .chunks(block_cols)
        .zip(out.chunks_mut(block_cols))
        .enumerate()
    {
        e4m3::decode_scaled(w, format.get(scale_row, b), o);
    }
}

/// Dequantizes a whole `[rows, cols]` matrix.
pub fn dequantize(
    weight: &[u8],
    scale: &[u8],
    format: ScaleFormat,
    rows: usize,
    cols: usize,
    block_rows: usize,
    block_cols: usize,
) -> Result<Vec<f32>, CodecError> {
    check_block(block_rows, block_cols)?;
    check_len("fp8 weight", rows * cols, weight.len())?;
    let (sr, sc) = (rows.div_ceil(block_rows), cols.div_ceil(block_cols));
    check_len("fp8 scale", sr * sc * format.bytes(), scale.len())?;
    let mut out = vec![0f32; rows * cols];
    let srow_bytes = sc * format.bytes();
    for r in 0..rows {
        let s = &scale[(r / block_rows) * srow_bytes..][..srow_bytes];
        dequant_row(
            &weight[r * cols..][..cols],
            s,
            format,
            block_cols,
            &mut out[r * cols..][..cols],
        );
    }
    Ok(out)
}

/// FP8 weight and its raw scale bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct Fp8Quantized {
    pub weight: Vec<u8>,
    pub scale: Vec<u8>,
}

/// Quantizes `[rows, cols]` f32 weights with `block x block` tiles. With e8m0 scales each
/// tile's scale is the smallest power of two that fits the tile amax under 448 (so the
/// division is exact and only the e4m3 rounding loses precision); with f32 scales it is
/// `amax / 448`. All-zero tiles get scale 1.
pub fn quantize(
    w: &[f32],
    rows: usize,
    cols: usize,
    format: ScaleFormat,
    block: usize,
) -> Result<Fp8Quantized, CodecError> {
    check_block(block, block)?;
    check_len("fp8 input", rows * cols, w.len())?;
    let (sr, sc) = (rows.div_ceil(block), cols.div_ceil(block));
    let mut weight = vec![0u8; rows * cols];
    let mut scale = Vec::with_capacity(sr * sc * format.bytes());
    for bi in 0..sr {
        let r_end = ((bi + 1) * block).min(rows);
        for bj in 0..sc {
            let c0 = bj * block;
            let c1 = (c0 + block).min(cols);
            let m = (bi * block..r_end)
                .fold(0f32, |m, r| m.max(amax(&w[r * cols + c0..r * cols + c1])));
            let s = match format {
                ScaleFormat::E8m0 => {
                    let byte = e8m0::scale_for_amax(m, e4m3::MAX);
                    scale.push(byte);
                    e8m0::decode(byte)
                }
                ScaleFormat::F32 => {
                    let s = if m > 0.0 && m.is_finite() {
                        m / e4m3::MAX
                    } else {
                        1.0
                    };
                    scale.extend_from_slice(&s.to_le_bytes());
                    s
                }
            };
            let inv = 1.0 / s;
            for r in bi * block..r_end {
                for c in c0..c1 {
                    // e8m0 scales are powers of two, so multiplying by the inverse is exact.
                    let v = match format {
                        ScaleFormat::E8m0 => w[r * cols + c] * inv,
                        ScaleFormat::F32 => w[r * cols + c] / s,
                    };
                    weight[r * cols + c] = e4m3::encode(v);
                }
            }
        }
    }
    Ok(Fp8Quantized { weight, scale })
}

fn check_block(block_rows: usize, block_cols: usize) -> Result<(), CodecError> {
    if block_rows == 0 || block_cols == 0 {
        return Err(CodecError::Invalid {
            what: "fp8 block size",
            detail: format!("block {block_rows}x{block_cols} must be non-zero"),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn finite_code() -> impl Strategy<Value = u8> {
        any::<u8>().prop_map(|c| if c & 0x7f == 0x7f { c & 0xfe } else { c })
    }

    #[test]
    fn infer_block_sizes() {
        assert_eq!(infer_block(1024, 8), Some(128));
        assert_eq!(infer_block(200, 2), Some(128));
        assert_eq!(infer_block(129, 2), Some(128));
        assert_eq!(infer_block(100, 1), Some(128));
        assert_eq!(infer_block(512, 4), Some(128));
        assert_eq!(infer_block(256, 4), Some(64));
        assert_eq!(infer_block(256, 3), None);
        assert_eq!(infer_block(10, 0), None);
    }

    #[test]
    fn wrong_lengths_are_errors() {
        let err = dequantize(&[0; 10], &[127], ScaleFormat::E8m0, 2, 4, 128, 128).unwrap_err();
        assert_eq!(
            err,
            CodecError::Length {
                what: "fp8 weight",
                expected: 8,
                found: 10
            }
        );
        let err = dequantize(&[0; 8], &[127, 1], ScaleFormat::E8m0, 2, 4, 128, 128).unwrap_err();
        assert!(matches!(
            err,
            CodecError::Length {
                what: "fp8 scale",
                ..
            }
        ));
        assert!(quantize(&[0.0; 8], 2, 4, ScaleFormat::F32, 0).is_err());
    }

    #[test]
    fn zero_and_max_blocks() {
        let mut w = vec![0f32; 130 * 3];
        w[0] = 448.0;
        w[129 * 3 + 2] = -448.0 * 4.0;
        let q = quantize(&w, 130, 3, ScaleFormat::E8m0, 128).unwrap();
        assert_eq!(q.scale, vec![127, 129]);
        let d = dequantize(&q.weight, &q.scale, ScaleFormat::E8m0, 130, 3, 128, 128).unwrap();
        assert_eq!(d, w);
        let q = quantize(&[0f32; 6], 2, 3, ScaleFormat::F32, 128).unwrap();
        assert_eq!(q.scale, 1f32.to_le_bytes().to_vec());
        assert!(q.weight.iter().all(|&b| b == 0));
    }

    proptest! {
        #[test]
        fn e8m0_round_trip_is_exact(
            rows in 1usize..300, cols in 1usize..300,
            codes in prop::collection::vec(finite_code(), 300 * 300),
            scales in prop::collection::vec(100u8..150, 9),
        ) {
            let weight = &codes[..rows * cols];
            let (sr, sc) = (rows.div_ceil(128), cols.div_ceil(128));
            let scale = &scales[..sr * sc];
            let x = dequantize(weight, scale, ScaleFormat::E8m0, rows, cols, 128, 128).unwrap();
            let q = quantize(&x, rows, cols, ScaleFormat::E8m0, 128).unwrap();
            let y = dequantize(&q.weight, &q.scale, ScaleFormat::E8m0, rows, cols, 128, 128).unwrap();
            prop_assert_eq!(x, y);
        }

        #[test]
        fn error_is_at_most_half_a_step(
            rows in 1usize..140, cols in 1usize..140,
            vals in prop::collection::vec(-1e3f32..1e3, 140 * 140),
            f32_scale in any::<bool>(),
        ) {
            let fmt = if f32_scale { ScaleFormat::F32 } else { ScaleFormat::E8m0 };
            let w = &vals[..rows * cols];
            let q = quantize(w, rows, cols, fmt, 128).unwrap();
            let d = dequantize(&q.weight, &q.scale, fmt, rows, cols, 128, 128).unwrap();
            let sc = cols.div_ceil(128);
            for r in 0..rows {
                for c in 0..cols {
                    let s = fmt.get(&q.scale, (r / 128) * sc + c / 128);
                    let y = (w[r * cols + c] / s).abs();
                    // e4m3 spacing around y: 2^(floor(log2 y) - 3), or 2^-9 for subnormals.
                    let step = if y < 1.0 / 64.0 { 1.0 / 512.0 } else { 2f32.powi(y.log2().floor() as i32 - 3) };
                    let err = (d[r * cols + c] - w[r * cols + c]).abs();
                    prop_assert!(err <= 0.5 * step * s * (1.0 + 1e-5), "r={} c={} x={} got={}", r, c, w[r * cols + c], d[r * cols + c]);
                }
            }
        }
    }
}
