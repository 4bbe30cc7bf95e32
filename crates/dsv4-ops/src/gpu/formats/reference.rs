//! CPU references of the format kernels, built on [`crate::codecs`]. The GPU kernels must
//! match these bit for bit.

use half::bf16;

use crate::codecs::fp8_block::ScaleFormat;
use crate::codecs::nvfp4::Nvfp4Quantized;
use crate::codecs::{e4m3, e8m0, fp8_block, mxfp4, nvfp4, CodecError};

fn to_bf16(v: Vec<f32>) -> Vec<bf16> {
    v.into_iter().map(bf16::from_f32).collect()
}

/// NVFP4 quantization of bf16 activations `[rows, cols]`, global scale from their amax.
pub fn nvfp4_quantize_act(
    x: &[bf16],
    rows: usize,
    cols: usize,
) -> Result<Nvfp4Quantized, CodecError> {
    let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
    nvfp4::quantize(&xf, rows, cols)
}

pub fn nvfp4_dequant(
    packed: &[u8],
    scales: &[u8],
    global: f32,
    rows: usize,
    cols: usize,
) -> Result<Vec<bf16>, CodecError> {
    nvfp4::dequantize(packed, scales, global, rows, cols).map(to_bf16)
}

pub fn mxfp4_dequant(
    packed: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
) -> Result<Vec<bf16>, CodecError> {
    mxfp4::dequantize(packed, scales, rows, cols).map(to_bf16)
}

/// `scale` holds raw scale bytes (little-endian f32 for [`ScaleFormat::F32`]).
pub fn fp8_block_dequant(
    w: &[u8],
    scale: &[u8],
    format: ScaleFormat,
    rows: usize,
    cols: usize,
    block: (usize, usize),
) -> Result<Vec<bf16>, CodecError> {
    fp8_block::dequantize(w, scale, format, rows, cols, block.0, block.1).map(to_bf16)
}

/// Padded dimensions `[rows', cols']` of the 32_4_4 swizzled scale layout.
pub fn swizzled_dims(rows: usize, cols: usize) -> [usize; 2] {
    [rows.div_ceil(128) * 128, cols.div_ceil(4) * 4]
}

/// Byte offset of scale `(r, c)` of a `cols`-wide scale matrix in the 32_4_4 layout
/// (formats-and-peers §3, CUTLASS `SfKMajorAtom`).
pub fn swizzled_offset(r: usize, c: usize, cols: usize) -> usize {
    let ncb = cols.div_ceil(4);
    let tile = (r / 128) * ncb + c / 4;
    tile * 512 + (r % 32) * 16 + ((r % 128) / 32) * 4 + c % 4
}

/// Row-major `[rows, cols]` scales to the 32_4_4 layout, zero padded.
pub fn scale_swizzle_32_4_4(
    scales: &[u8],
    rows: usize,
    cols: usize,
) -> Result<Vec<u8>, CodecError> {
    crate::codecs::check_len("swizzle input", rows * cols, scales.len())?;
    let [rp, cp] = swizzled_dims(rows, cols);
    let mut out = vec![0u8; rp * cp];
    for r in 0..rows {
        for c in 0..cols {
            out[swizzled_offset(r, c, cols)] = scales[r * cols + c];
        }
    }
    Ok(out)
}

pub fn scale_unswizzle_32_4_4(
    swizzled: &[u8],
    rows: usize,
    cols: usize,
) -> Result<Vec<u8>, CodecError> {
    let [rp, cp] = swizzled_dims(rows, cols);
    crate::codecs::check_len("unswizzle input", rp * cp, swizzled.len())?;
    let mut out = vec![0u8; rows * cols];
    for r in 0..rows {
        for c in 0..cols {
            out[r * cols + c] = swizzled[swizzled_offset(r, c, cols)];
        }
    }
    Ok(out)
}

/// Channels of one KV vector: 448 NoPE then 64 RoPE.
pub const KV_DIM: usize = 512;
pub const KV_NOPE: usize = 448;
pub const KV_TILE: usize = 64;
pub const KV_TILES: usize = KV_NOPE / KV_TILE;
/// Bytes of one token record: 448 e4m3 + 64 bf16 + 7 ue8m0 scales + 1 pad (FlashMLA MODEL1).
pub const KV_RECORD: usize = KV_NOPE + 2 * (KV_DIM - KV_NOPE) + KV_TILES + 1;
const KV_SCALES_AT: usize = KV_NOPE + 2 * (KV_DIM - KV_NOPE);

/// bf16 KV vectors `[tokens, 512]` to FP8 records `[tokens, 584]`. Each 64-channel NoPE tile
/// gets the smallest power-of-two scale fitting its amax under 448; RoPE channels are copied.
pub fn kv_fp8_quantize(kv: &[bf16]) -> Result<Vec<u8>, CodecError> {
    if !kv.len().is_multiple_of(KV_DIM) {
        return Err(CodecError::Invalid {
            what: "kv records",
            detail: format!(
                "{} values is not a whole number of {KV_DIM}-channel tokens",
                kv.len()
            ),
        });
    }
    let tokens = kv.len() / KV_DIM;
    let mut out = vec![0u8; tokens * KV_RECORD];
    for (v, rec) in kv.chunks_exact(KV_DIM).zip(out.chunks_exact_mut(KV_RECORD)) {
        for t in 0..KV_TILES {
            let tile: Vec<f32> = v[t * KV_TILE..(t + 1) * KV_TILE]
                .iter()
                .map(|x| x.to_f32())
                .collect();
            let amax = tile.iter().fold(0f32, |m, x| m.max(x.abs()));
            let byte = e8m0::scale_for_amax(amax, e4m3::MAX);
            rec[KV_SCALES_AT + t] = byte;
            // Power-of-two scale: multiplying by the inverse is exact.
            let inv = 1.0 / e8m0::decode(byte);
            for (q, x) in rec[t * KV_TILE..(t + 1) * KV_TILE].iter_mut().zip(&tile) {
                *q = e4m3::encode(x * inv);
            }
        }
        for (dst, x) in rec[KV_NOPE..KV_SCALES_AT]
            .chunks_exact_mut(2)
            .zip(&v[KV_NOPE..])
        {
            dst.copy_from_slice(&x.to_le_bytes());
        }
    }
    Ok(out)
}

/// FP8 records `[tokens, 584]` back to bf16 `[tokens, 512]`.
pub fn kv_fp8_dequant(records: &[u8]) -> Result<Vec<bf16>, CodecError> {
    if !records.len().is_multiple_of(KV_RECORD) {
        return Err(CodecError::Invalid {
            what: "kv records",
            detail: format!(
                "{} bytes is not a whole number of {KV_RECORD}-byte records",
                records.len()
            ),
        });
    }
    let mut out = Vec::with_capacity(records.len() / KV_RECORD * KV_DIM);
    let mut tile = [0f32; KV_TILE];
    for rec in records.chunks_exact(KV_RECORD) {
        for t in 0..KV_TILES {
            let scale = e8m0::decode(rec[KV_SCALES_AT + t]);
            e4m3::decode_scaled(&rec[t * KV_TILE..(t + 1) * KV_TILE], scale, &mut tile);
            out.extend(tile.iter().map(|&x| bf16::from_f32(x)));
        }
        out.extend(
            rec[KV_NOPE..KV_SCALES_AT]
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]])),
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn record_layout_matches_flashmla_model1() {
        assert_eq!(KV_RECORD, 584);
        assert_eq!(KV_SCALES_AT, 576);
        assert_eq!(KV_TILES, 7);
    }

    #[test]
    fn swizzle_offsets_match_the_documented_examples() {
        // Row r%32 of a tile holds rows {r, r+32, r+64, r+96}, 4 scale columns each.
        assert_eq!(swizzled_offset(0, 0, 8), 0);
        assert_eq!(swizzled_offset(0, 3, 8), 3);
        assert_eq!(swizzled_offset(32, 0, 8), 4);
        assert_eq!(swizzled_offset(96, 1, 8), 13);
        assert_eq!(swizzled_offset(1, 0, 8), 16);
        // Column tiles are innermost: (0, 4) starts the second tile of row-tile 0.
        assert_eq!(swizzled_offset(0, 4, 8), 512);
        assert_eq!(swizzled_offset(128, 0, 8), 1024);
        assert_eq!(swizzled_offset(127, 7, 8), 512 + 31 * 16 + 3 * 4 + 3);
        // torchao's to_blocked: view (R/128, 4, 32, C/4, 4), permute (0, 3, 2, 1, 4).
        let (rows, cols) = (256, 12);
        let mut expect = vec![0usize; rows * cols];
        let mut i = 0;
        for rt in 0..rows / 128 {
            for ct in 0..cols / 4 {
                for r32 in 0..32 {
                    for r4 in 0..4 {
                        for c4 in 0..4 {
                            expect[(rt * 128 + r4 * 32 + r32) * cols + ct * 4 + c4] = i;
                            i += 1;
                        }
                    }
                }
            }
        }
        for r in 0..rows {
            for c in 0..cols {
                assert_eq!(
                    swizzled_offset(r, c, cols),
                    expect[r * cols + c],
                    "({r}, {c})"
                );
            }
        }
    }

    #[test]
    fn swizzle_is_a_padded_bijection() {
        let (rows, cols) = (130, 7);
        let scales: Vec<u8> = (0..rows * cols).map(|i| (i % 251) as u8 + 1).collect();
        let sw = scale_swizzle_32_4_4(&scales, rows, cols).unwrap();
        assert_eq!(sw.len(), 256 * 8);
        assert_eq!(
            sw.iter().filter(|&&b| b == 0).count(),
            sw.len() - rows * cols
        );
        assert_eq!(scale_unswizzle_32_4_4(&sw, rows, cols).unwrap(), scales);
        assert!(scale_swizzle_32_4_4(&scales[1..], rows, cols).is_err());
    }

    proptest! {
        // Shapes around and between the 128-row and 4-column tile edges.
        #[test]
        fn swizzle_round_trips_any_shape(
            (rows, cols, scales) in (1usize..400, 1usize..40).prop_flat_map(|(r, c)| {
                (Just(r), Just(c), prop::collection::vec(any::<u8>(), r * c))
            })
        ) {
            let sw = scale_swizzle_32_4_4(&scales, rows, cols).unwrap();
            let [rp, cp] = swizzled_dims(rows, cols);
            prop_assert_eq!(sw.len(), rp * cp);
            prop_assert_eq!(scale_unswizzle_32_4_4(&sw, rows, cols).unwrap(), scales);
        }

        #[test]
        fn swizzle_offsets_are_a_bijection_onto_the_padded_layout(rows in 1usize..400, cols in 1usize..40) {
            let [rp, cp] = swizzled_dims(rows, cols);
            prop_assert!(rp % 128 == 0 && cp % 4 == 0 && rp >= rows && cp >= cols);
            prop_assert!(rp < rows + 128 && cp < cols + 4);
            // Every cell of the padded matrix lands on its own byte, and together they fill it.
            let mut hit = vec![false; rp * cp];
            for r in 0..rp {
                for c in 0..cp {
                    let o = swizzled_offset(r, c, cols);
                    prop_assert!(o < hit.len(), "({}, {}) -> {} past {}", r, c, o, hit.len());
                    prop_assert!(!hit[o], "({}, {}) -> {} twice", r, c, o);
                    hit[o] = true;
                }
            }
        }
    }

    #[test]
    fn kv_record_round_trip_and_layout() {
        // Tile t holds integers in [-15, 15] times 2^(t - 3): after the power-of-two scaling they
        // are still exact in e4m3, so the round trip must be exact. RoPE bits are arbitrary.
        let mut kv = vec![bf16::ZERO; 2 * KV_DIM];
        for (i, v) in kv.iter_mut().enumerate() {
            let c = i % KV_DIM;
            *v = if c < KV_NOPE {
                bf16::from_f32(((c % KV_TILE) % 31) as f32 - 15.0)
                    * bf16::from_f32(2f32.powi((c / KV_TILE) as i32 - 3))
            } else {
                bf16::from_bits(0x3c00 + i as u16)
            };
        }
        kv[KV_DIM..KV_DIM + KV_TILE].fill(bf16::ZERO);
        let rec = kv_fp8_quantize(&kv).unwrap();
        assert_eq!(rec.len(), 2 * KV_RECORD);
        for t in 0..KV_TILES {
            // amax 15 * 2^(t-3); the smallest power of two s with amax / s <= 448 is 2^(t-7).
            assert_eq!(rec[KV_SCALES_AT + t], (127 + t as i32 - 7) as u8);
        }
        assert_eq!(rec[KV_RECORD - 1], 0);
        assert_eq!(
            rec[KV_RECORD + KV_SCALES_AT],
            127,
            "all-zero tile gets scale 1"
        );
        assert_eq!(&rec[KV_NOPE..KV_NOPE + 2], &kv[KV_NOPE].to_le_bytes());
        assert_eq!(kv_fp8_dequant(&rec).unwrap(), kv);
        assert!(kv_fp8_quantize(&kv[1..]).is_err());
        assert!(kv_fp8_dequant(&rec[1..]).is_err());
    }
}
