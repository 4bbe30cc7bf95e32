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
/// it and every join falls on a whole scale block (BF16, FP8 blocks); otherwise stacked as BF16.
pub fn stacked(dev: &Device, name: &str, parts: &[&Linear]) -> Result<GemvWeight, GpuError> {
    let cols = parts[0].cols();
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
    GemvWeight::upload(dev, joined.weight(), rows, cols).map_err(named(name))
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
