//! Checkpoint weights → the device layouts the kernels read, once, at load: linears as
//! [`GemvWeight`] tiles (FP8 block, NVFP4, MXFP4 and BF16 kept as they are; F32 and F16 become
//! BF16), routed experts stacked per layer (NVFP4 / MXFP4 for the grouped MoE, BF16 otherwise),
//! small tensors as F32.

use std::ops::Range;

use rayon::prelude::*;

use dsv4_ops::codecs::mxfp4::Mxfp4Quantized;
use dsv4_ops::codecs::nvfp4::Nvfp4Quantized;
use dsv4_ops::gpu::gemv::{GemvWeight, HostWeight};
use dsv4_ops::gpu::mhc::DeviceHcSite;
use dsv4_ops::gpu::moe::{HostExperts, MoeExperts};
use dsv4_ops::gpu::moe_bf16::Bf16Experts;
use dsv4_ops::gpu::{DType, Device, DeviceTensor, GpuError};
use half::bf16;

use crate::linear::{Linear, LinearData};
use crate::weights::{ExpertWeights, HcWeights};

/// One linear's rows in a format [`GemvWeight::upload`] takes, owned on the host.
enum HostRows {
    Bf16(Vec<bf16>),
    Fp8 {
        weight: Vec<u8>,
        scale: Vec<u8>,
        format: dsv4_ops::codecs::fp8_block::ScaleFormat,
        block: (usize, usize),
    },
    Nvfp4(Nvfp4Quantized),
    Mxfp4(Mxfp4Quantized),
}

impl HostRows {
    fn weight(&self) -> HostWeight<'_> {
        match self {
            HostRows::Bf16(v) => HostWeight::Bf16(v),
            HostRows::Fp8 {
                weight,
                scale,
                format,
                block,
            } => HostWeight::Fp8 {
                weight,
                scale,
                format: *format,
                block: *block,
            },
            HostRows::Nvfp4(q) => HostWeight::Nvfp4(q),
            HostRows::Mxfp4(q) => HostWeight::Mxfp4(q),
        }
    }
}

fn unsupported(name: &str, detail: String) -> GpuError {
    GpuError::invalid(name, detail)
}

/// Rows `rows` of `lin` (all of them for a whole linear) in its own format; F32 and F16 are
/// rounded to BF16.
fn host_rows(name: &str, lin: &Linear, rows: Range<usize>) -> Result<HostRows, GpuError> {
    Ok(match lin.data() {
        LinearData::F32(_) | LinearData::Bf16(_) | LinearData::F16(_) => {
            HostRows::Bf16(bf16_rows(lin, rows))
        }
        LinearData::Fp8Block {
            scale_format,
            block_rows,
            block_cols,
            ..
        } => {
            if !rows.start.is_multiple_of(*block_rows)
                || (!rows.end.is_multiple_of(*block_rows) && rows.end != lin.rows())
            {
                return Err(unsupported(
                    name,
                    format!("rows {rows:?} do not start and end on {block_rows}-row scale blocks"),
                ));
            }
            let (weight, scale) = lin.encoded_rows(rows);
            HostRows::Fp8 {
                weight: weight.to_vec(),
                scale: scale.to_vec(),
                format: *scale_format,
                block: (*block_rows, *block_cols),
            }
        }
        LinearData::Mxfp4 { .. } => {
            let (weight, scale) = lin.encoded_rows(rows);
            HostRows::Mxfp4(Mxfp4Quantized {
                weight: weight.to_vec(),
                scale: scale.to_vec(),
            })
        }
        LinearData::Nvfp4 { weight_scale_2, .. } => {
            let (weight, weight_scale) = lin.encoded_rows(rows);
            HostRows::Nvfp4(Nvfp4Quantized {
                weight: weight.to_vec(),
                weight_scale: weight_scale.to_vec(),
                weight_scale_2: *weight_scale_2,
            })
        }
    })
}

/// Rows `rows` of `lin`, dequantized one at a time and rounded to BF16.
fn bf16_rows(lin: &Linear, rows: Range<usize>) -> Vec<bf16> {
    let c = lin.cols();
    let mut row = vec![0f32; c];
    let mut out = Vec::with_capacity(rows.len() * c);
    for r in rows {
        lin.dequant_row(r, &mut row);
        out.extend(row.iter().map(|&v| bf16::from_f32(v)));
    }
    out
}

fn named(name: &str) -> impl FnOnce(GpuError) -> GpuError + '_ {
    move |e| GpuError::invalid(name, e.to_string())
}

/// A whole linear for [`dsv4_ops::gpu::gemv::gemv`].
pub fn linear(dev: &Device, name: &str, lin: &Linear) -> Result<GemvWeight, GpuError> {
    let h = host_rows(name, lin, 0..lin.rows())?;
    GemvWeight::upload(dev, h.weight(), lin.rows(), lin.cols()).map_err(named(name))
}

/// Linears that read the same input stacked row-wise into one weight, so that one GEMV
/// writes their outputs side by side in each output row. Kept in their format when they share
/// it and every join falls on a whole scale block (BF16, FP8 blocks); otherwise (FP4 parts
/// included: the model stacks only attention and compressor projections) stacked as BF16.
pub fn stacked(dev: &Device, name: &str, parts: &[&Linear]) -> Result<GemvWeight, GpuError> {
    let (rows, cols, joined) = stacked_rows(name, parts)?;
    GemvWeight::upload(dev, joined.weight(), rows, cols).map_err(named(name))
}

/// [`stacked`]'s rows on the host: `(rows, cols, rows in one format)`.
fn stacked_rows(name: &str, parts: &[&Linear]) -> Result<(usize, usize, HostRows), GpuError> {
    let Some(first) = parts.first() else {
        return Err(unsupported(name, "no linears to stack".to_string()));
    };
    let cols = first.cols();
    if let Some(l) = parts.iter().find(|l| l.cols() != cols) {
        return Err(unsupported(
            name,
            format!("stacked linears of {cols} and {} columns", l.cols()),
        ));
    }
    let rows: usize = parts.iter().map(|l| l.rows()).sum();
    let host = parts
        .iter()
        .map(|l| host_rows(name, l, 0..l.rows()))
        .collect::<Result<Vec<_>, _>>()?;
    let joins_on_blocks = |block_rows: usize| {
        parts[..parts.len() - 1]
            .iter()
            .all(|l| l.rows().is_multiple_of(block_rows))
    };
    let joined = match &host[0] {
        HostRows::Bf16(_) => host
            .iter()
            .map(|h| match h {
                HostRows::Bf16(v) => Some(v.as_slice()),
                _ => None,
            })
            .collect::<Option<Vec<_>>>()
            .map(|v| HostRows::Bf16(v.concat())),
        HostRows::Fp8 { format, block, .. } if joins_on_blocks(block.0) => {
            let (format, block) = (*format, *block);
            host.iter()
                .map(|h| match h {
                    HostRows::Fp8 {
                        weight,
                        scale,
                        format: f,
                        block: b,
                    } if *f == format && *b == block => Some((weight.as_slice(), scale.as_slice())),
                    _ => None,
                })
                .collect::<Option<Vec<_>>>()
                .map(|v| HostRows::Fp8 {
                    weight: v.iter().flat_map(|p| p.0).copied().collect(),
                    scale: v.iter().flat_map(|p| p.1).copied().collect(),
                    format,
                    block,
                })
        }
        _ => None,
    };
    let joined = joined.unwrap_or_else(|| {
        HostRows::Bf16(
            parts
                .iter()
                .flat_map(|l| bf16_rows(l, 0..l.rows()))
                .collect(),
        )
    });
    Ok((rows, cols, joined))
}

/// A SwiGLU block's gate and up projections, interleaved for `gemv_swiglu`, and its down
/// projection.
pub fn expert(
    dev: &Device,
    name: &str,
    w: &ExpertWeights,
) -> Result<(GemvWeight, GemvWeight), GpuError> {
    let (n, k) = (w.w1.rows(), w.w1.cols());
    let h1 = host_rows(name, &w.w1, 0..n)?;
    let h3 = host_rows(name, &w.w3, 0..n)?;
    let w13 =
        GemvWeight::upload_gate_up(dev, h1.weight(), h3.weight(), n, k).map_err(named(name))?;
    Ok((w13, linear(dev, name, &w.w2)?))
}

/// A layer's routed experts on the device (a few per model: their sizes do not matter).
#[allow(clippy::large_enum_variant)]
pub enum RoutedExperts {
    /// NVFP4 or MXFP4, for the grouped MoE kernels.
    Fp4(MoeExperts),
    Bf16(Bf16Experts),
}

impl RoutedExperts {
    pub fn expert_bytes(&self) -> usize {
        match self {
            RoutedExperts::Fp4(e) => e.expert_bytes(),
            RoutedExperts::Bf16(e) => e.expert_bytes(),
        }
    }
}

pub fn routed_experts(
    dev: &Device,
    name: &str,
    experts: &[ExpertWeights],
) -> Result<RoutedExperts, GpuError> {
    let (d, inter) = (experts[0].w1.cols(), experts[0].w1.rows());
    let all = |pick: fn(&ExpertWeights) -> &Linear| -> Result<Vec<HostRows>, GpuError> {
        experts
            .par_iter()
            .map(|e| {
                let l = pick(e);
                host_rows(name, l, 0..l.rows())
            })
            .collect()
    };
    let (w1, w3, w2) = (all(|e| &e.w1)?, all(|e| &e.w3)?, all(|e| &e.w2)?);
    fn nvfp4(v: Vec<HostRows>) -> Option<Vec<Nvfp4Quantized>> {
        v.into_iter()
            .map(|h| match h {
                HostRows::Nvfp4(q) => Some(q),
                _ => None,
            })
            .collect()
    }
    fn mxfp4(v: Vec<HostRows>) -> Option<Vec<Mxfp4Quantized>> {
        v.into_iter()
            .map(|h| match h {
                HostRows::Mxfp4(q) => Some(q),
                _ => None,
            })
            .collect()
    }
    fn bf16s(v: &[HostRows]) -> Option<Vec<&[bf16]>> {
        v.iter()
            .map(|h| match h {
                HostRows::Bf16(q) => Some(q.as_slice()),
                _ => None,
            })
            .collect()
    }
    let mixed = || {
        unsupported(
            name,
            format!(
                "routed experts in {} (the GPU takes NVFP4, MXFP4 or BF16/F16/F32 experts, one \
                 format for all)",
                experts[0].w1.format_name()
            ),
        )
    };
    let fp4 =
        |host: HostExperts<'_>| MoeExperts::upload(dev, host, d, inter).map(RoutedExperts::Fp4);
    let uploaded = match &w1[0] {
        HostRows::Bf16(_) => match (bf16s(&w1), bf16s(&w3), bf16s(&w2)) {
            (Some(a), Some(b), Some(c)) => {
                Bf16Experts::upload(dev, &a, &b, &c, d, inter).map(RoutedExperts::Bf16)
            }
            _ => return Err(mixed()),
        },
        HostRows::Nvfp4(_) => match (nvfp4(w1), nvfp4(w3), nvfp4(w2)) {
            (Some(w1), Some(w3), Some(w2)) => fp4(HostExperts::Nvfp4 {
                w1: &w1,
                w3: &w3,
                w2: &w2,
            }),
            _ => return Err(mixed()),
        },
        HostRows::Mxfp4(_) => match (mxfp4(w1), mxfp4(w3), mxfp4(w2)) {
            (Some(w1), Some(w3), Some(w2)) => fp4(HostExperts::Mxfp4 {
                w1: &w1,
                w3: &w3,
                w2: &w2,
            }),
            _ => return Err(mixed()),
        },
        HostRows::Fp8 { .. } => return Err(mixed()),
    };
    uploaded.map_err(named(name))
}

pub fn vector(dev: &Device, v: &[f32]) -> Result<DeviceTensor<f32>, GpuError> {
    dev.upload(DType::F32, &[v.len()], v)
}

pub fn hc_site(dev: &Device, w: &HcWeights, d: usize) -> Result<DeviceHcSite, GpuError> {
    DeviceHcSite::upload(dev, &w.site(), d)
}

/// A matrix as F32 `[rows, cols]` (gates and the indexer's head weights: small, and their
/// outputs pick experts and entries, so they are not rounded to BF16).
pub fn dense_f32(dev: &Device, lin: &Linear) -> Result<DeviceTensor<f32>, GpuError> {
    dev.upload(DType::F32, &[lin.rows(), lin.cols()], &lin.to_f32())
}

/// A whole matrix as BF16 `[rows, cols]`, whatever its format (the embedding table, BF16
/// gates).
pub fn bf16_matrix(dev: &Device, lin: &Linear) -> Result<DeviceTensor<bf16>, GpuError> {
    let v = bf16_rows(lin, 0..lin.rows());
    dev.upload(DType::BF16, &[lin.rows(), lin.cols()], &v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::Blob;
    use dsv4_ops::codecs::fp8_block::{self, ScaleFormat};

    fn values(rows: usize, cols: usize, seed: u32) -> Vec<f32> {
        (0..rows * cols)
            .map(|i| {
                let h = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed);
                (h % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    fn fp8(rows: usize, cols: usize, seed: u32) -> Linear {
        let w = values(rows, cols, seed);
        let q = fp8_block::quantize(&w, rows, cols, ScaleFormat::E8m0, 128).unwrap();
        let data = LinearData::Fp8Block {
            weight: Blob::from_vec(q.weight),
            scale: Blob::from_vec(q.scale),
            scale_format: ScaleFormat::E8m0,
            block_rows: 128,
            block_cols: 128,
        };
        Linear::new(rows, cols, data).unwrap()
    }

    fn bf16_linear(rows: usize, cols: usize, seed: u32) -> Linear {
        let v: Vec<u8> = values(rows, cols, seed)
            .iter()
            .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
            .collect();
        Linear::new(rows, cols, LinearData::Bf16(Blob::from_vec(v))).unwrap()
    }

    /// Every part's rows, dequantized, one after another, rounded to BF16.
    fn bf16_rows_of(parts: &[&Linear]) -> Vec<bf16> {
        parts
            .iter()
            .flat_map(|l| l.to_f32())
            .map(bf16::from_f32)
            .collect()
    }

    #[test]
    fn fp8_parts_on_whole_scale_blocks_stack_as_fp8_with_their_scales() {
        let (a, b) = (fp8(256, 300, 1), fp8(100, 300, 2));
        let (rows, cols, h) = stacked_rows("s", &[&a, &b]).unwrap();
        assert_eq!((rows, cols), (356, 300));
        let HostRows::Fp8 {
            weight,
            scale,
            format,
            block,
        } = h
        else {
            panic!("not kept as FP8");
        };
        let data = LinearData::Fp8Block {
            weight: Blob::from_vec(weight),
            scale: Blob::from_vec(scale),
            scale_format: format,
            block_rows: block.0,
            block_cols: block.1,
        };
        let joined = Linear::new(rows, cols, data).unwrap();
        let want: Vec<f32> = [&a, &b].iter().flat_map(|l| l.to_f32()).collect();
        assert_eq!(joined.to_f32(), want);
    }

    #[test]
    fn parts_that_cannot_share_a_format_stack_as_bf16() {
        // A join inside a scale block; FP8 beside BF16; BF16 beside BF16 (kept bit for bit).
        let (a, b) = (fp8(200, 64, 3), fp8(128, 64, 4));
        let (c, d) = (bf16_linear(16, 64, 5), bf16_linear(8, 64, 6));
        for parts in [[&a, &b], [&a, &c], [&c, &d]] {
            let (rows, _, h) = stacked_rows("s", &parts).unwrap();
            let HostRows::Bf16(v) = h else {
                panic!("not BF16");
            };
            assert_eq!(v.len(), rows * 64);
            assert_eq!(v, bf16_rows_of(&parts));
        }
    }

    #[test]
    fn stacked_parts_must_exist_and_share_their_columns() {
        let parts = [&fp8(128, 64, 1), &fp8(128, 32, 2)];
        let err = stacked_rows("layers.0.attn.wq_a+wkv", &parts)
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("wq_a+wkv") && err.contains("64 and 32"),
            "{err}"
        );
        let err = stacked_rows("layers.0.attn.compressor.wkv+wgate", &[])
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("wkv+wgate") && err.contains("no linears"),
            "{err}"
        );
    }
}
