//! Checkpoint weights → the device layouts the kernels read, once, at load. Bytes go up as
//! they are stored, through a [`Stager`], and are repacked on the device: linears as
//! [`GemvWeight`] tiles (FP8 block, NVFP4, MXFP4 and BF16 kept as they are; F32 and F16 become
//! BF16 on the host), routed experts stacked per layer (NVFP4 / MXFP4 for the grouped MoE, BF16
//! otherwise), small tensors as F32.

use std::borrow::Cow;

use rayon::prelude::*;

use dsv4_ops::gpu::gemv::{check_stack, GemvWeight, HostWeight};
use dsv4_ops::gpu::mhc::DeviceHcSite;
use dsv4_ops::gpu::moe::MoeExperts;
use dsv4_ops::gpu::moe_bf16::Bf16Experts;
use dsv4_ops::gpu::{DType, Device, DeviceTensor, GpuError, Stager};
use half::bf16;

use crate::linear::{Linear, LinearData};
use crate::weights::{ExpertWeights, HcWeights};

/// A linear's values as the kernels take them: the checkpoint's own bytes where its format is
/// one they read, BF16 rows otherwise.
enum HostRows<'a> {
    Bf16(Cow<'a, [bf16]>),
    Stored(HostWeight<'a>),
}

impl HostRows<'_> {
    fn weight(&self) -> HostWeight<'_> {
        match self {
            HostRows::Bf16(v) => HostWeight::Bf16(v),
            HostRows::Stored(w) => *w,
        }
    }
}

/// BF16 bytes as values, without a copy where they are aligned (a shard's tensors need not be).
fn bf16_values(bytes: &[u8]) -> Cow<'_, [bf16]> {
    match bytemuck::try_cast_slice(bytes) {
        Ok(v) => Cow::Borrowed(v),
        Err(_) => Cow::Owned(
            bytes
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]))
                .collect(),
        ),
    }
}

fn host_rows(lin: &Linear) -> HostRows<'_> {
    match lin.data() {
        LinearData::Bf16(b) => HostRows::Bf16(bf16_values(b.bytes())),
        LinearData::F32(_) | LinearData::F16(_) => HostRows::Bf16(Cow::Owned(bf16_rows(lin))),
        LinearData::Fp8Block {
            weight,
            scale,
            scale_format,
            block_rows,
            block_cols,
        } => HostRows::Stored(HostWeight::Fp8 {
            weight: weight.bytes(),
            scale: scale.bytes(),
            format: *scale_format,
            block: (*block_rows, *block_cols),
        }),
        LinearData::Mxfp4 { weight, scale } => HostRows::Stored(HostWeight::Mxfp4 {
            weight: weight.bytes(),
            scale: scale.bytes(),
        }),
        LinearData::Nvfp4 {
            weight,
            weight_scale,
            weight_scale_2,
            ..
        } => HostRows::Stored(HostWeight::Nvfp4 {
            weight: weight.bytes(),
            weight_scale: weight_scale.bytes(),
            weight_scale_2: *weight_scale_2,
        }),
    }
}

/// All rows of `lin`, dequantized one at a time and rounded to BF16.
fn bf16_rows(lin: &Linear) -> Vec<bf16> {
    let c = lin.cols();
    let mut row = vec![0f32; c];
    let mut out = Vec::with_capacity(lin.rows() * c);
    for r in 0..lin.rows() {
        lin.dequant_row(r, &mut row);
        out.extend(row.iter().map(|&v| bf16::from_f32(v)));
    }
    out
}

fn named(name: &str) -> impl FnOnce(GpuError) -> GpuError + '_ {
    move |e| GpuError::invalid(name, e.to_string())
}

/// A whole linear for [`dsv4_ops::gpu::gemv::gemv`].
pub fn linear(st: &mut Stager<'_>, name: &str, lin: &Linear) -> Result<GemvWeight, GpuError> {
    let h = host_rows(lin);
    GemvWeight::load(st, &[(h.weight(), lin.rows())], lin.cols()).map_err(named(name))
}

/// Each part's rows as the kernels take them, with its row count.
fn stack_blocks<'a>(host: &'a [HostRows<'_>], parts: &[&Linear]) -> Vec<(HostWeight<'a>, usize)> {
    host.iter()
        .zip(parts)
        .map(|(h, l)| (h.weight(), l.rows()))
        .collect()
}

/// Linears that read the same input stacked row-wise into one weight, so that one GEMV
/// writes their outputs side by side in each output row: in their format where the stacking
/// rule ([`check_stack`]) allows, as BF16 otherwise.
pub fn stacked(st: &mut Stager<'_>, name: &str, parts: &[&Linear]) -> Result<GemvWeight, GpuError> {
    let Some(first) = parts.first() else {
        return Err(GpuError::invalid(name, "no linears to stack"));
    };
    let cols = first.cols();
    if let Some(l) = parts.iter().find(|l| l.cols() != cols) {
        return Err(GpuError::invalid(
            name,
            format!("stacked linears of {cols} and {} columns", l.cols()),
        ));
    }
    let host: Vec<HostRows<'_>> = parts.iter().map(|l| host_rows(l)).collect();
    let blocks = stack_blocks(&host, parts);
    let loaded = if check_stack(&blocks).is_ok() {
        GemvWeight::load(st, &blocks, cols)
    } else {
        let rows: usize = parts.iter().map(|l| l.rows()).sum();
        let v: Vec<bf16> = parts.iter().flat_map(|l| bf16_rows(l)).collect();
        GemvWeight::load(st, &[(HostWeight::Bf16(&v), rows)], cols)
    };
    loaded.map_err(named(name))
}

/// A SwiGLU block's gate and up projections, interleaved for `gemv_swiglu`, and its down
/// projection.
pub fn expert(
    st: &mut Stager<'_>,
    name: &str,
    w: &ExpertWeights,
) -> Result<(GemvWeight, GemvWeight), GpuError> {
    let (n, k) = (w.w1.rows(), w.w1.cols());
    let (h1, h3) = (host_rows(&w.w1), host_rows(&w.w3));
    let w13 = GemvWeight::load_gate_up(st, h1.weight(), h3.weight(), n, k).map_err(named(name))?;
    Ok((w13, linear(st, name, &w.w2)?))
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
    st: &mut Stager<'_>,
    name: &str,
    experts: &[ExpertWeights],
) -> Result<RoutedExperts, GpuError> {
    let Some(first) = experts.first() else {
        return Err(GpuError::invalid(name, "no routed experts"));
    };
    let (d, inter) = (first.w1.cols(), first.w1.rows());
    let host: Vec<[HostRows<'_>; 3]> = experts
        .par_iter()
        .map(|e| [&e.w1, &e.w3, &e.w2].map(host_rows))
        .collect();
    let fp4 = |h: &HostRows<'_>| {
        matches!(
            h,
            HostRows::Stored(HostWeight::Nvfp4 { .. } | HostWeight::Mxfp4 { .. })
        )
    };
    let uploaded = if host.iter().flatten().all(fp4) {
        let ws: Vec<[HostWeight<'_>; 3]> = host
            .iter()
            .map(|m| [0, 1, 2].map(|j| m[j].weight()))
            .collect();
        MoeExperts::load(st, &ws, d, inter).map(RoutedExperts::Fp4)
    } else if host
        .iter()
        .flatten()
        .all(|h| matches!(h, HostRows::Bf16(_)))
    {
        let pick = |j: usize| -> Vec<&[bf16]> {
            host.iter()
                .map(|m| match &m[j] {
                    HostRows::Bf16(v) => &v[..],
                    HostRows::Stored(_) => unreachable!("checked above"),
                })
                .collect()
        };
        Bf16Experts::load(st, &pick(0), &pick(1), &pick(2), d, inter).map(RoutedExperts::Bf16)
    } else {
        return Err(GpuError::invalid(
            name,
            format!(
                "routed experts in {} (the GPU takes NVFP4, MXFP4 or BF16/F16/F32 experts, one \
                 format for all)",
                first.w1.format_name()
            ),
        ));
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
pub fn dense_f32(st: &mut Stager<'_>, lin: &Linear) -> Result<DeviceTensor<f32>, GpuError> {
    st.upload(DType::F32, &[lin.rows(), lin.cols()], &lin.to_f32())
}

/// A whole matrix as BF16 `[rows, cols]`, whatever its format (the embedding table, BF16
/// gates).
pub fn bf16_matrix(st: &mut Stager<'_>, lin: &Linear) -> Result<DeviceTensor<bf16>, GpuError> {
    let shape = [lin.rows(), lin.cols()];
    match host_rows(lin) {
        HostRows::Bf16(v) => st.upload(DType::BF16, &shape, &v),
        HostRows::Stored(_) => st.upload(DType::BF16, &shape, &bf16_rows(lin)),
    }
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

    #[test]
    fn parts_stack_in_their_format_only_on_whole_tiles_and_blocks() {
        let stacks = |parts: &[&Linear]| {
            let host: Vec<HostRows<'_>> = parts.iter().map(|l| host_rows(l)).collect();
            check_stack(&stack_blocks(&host, parts)).is_ok()
        };
        let (a, b) = (fp8(256, 300, 1), fp8(100, 300, 2));
        assert!(stacks(&[&a, &b]));
        // A join inside a scale block; FP8 beside BF16; BF16 off a 16-row tile.
        let (c, d) = (fp8(200, 64, 3), fp8(128, 64, 4));
        let (e, f) = (bf16_linear(16, 64, 5), bf16_linear(8, 64, 6));
        assert!(!stacks(&[&c, &d]));
        assert!(!stacks(&[&d, &e]));
        assert!(stacks(&[&e, &f]));
        assert!(!stacks(&[&f, &e]));
        // F32 rows go up as BF16 rows.
        let g = Linear::new(2, 2, LinearData::F32(Blob::from_vec(vec![0; 16]))).unwrap();
        assert!(matches!(host_rows(&g), HostRows::Bf16(Cow::Owned(_))));
        assert!(!stacks(&[]));
    }

    #[test]
    fn bf16_bytes_are_read_in_place_when_aligned_and_copied_when_not() {
        let v: Vec<bf16> = (0..9).map(|i| bf16::from_f32(i as f32)).collect();
        let bytes: Vec<u8> = std::iter::once(0u8)
            .chain(v.iter().flat_map(|x| x.to_le_bytes()))
            .collect();
        let odd = bf16_values(&bytes[1..]);
        let even = bf16_values(bytemuck::cast_slice(&v));
        assert!(matches!(even, Cow::Borrowed(_)));
        assert_eq!(&odd[..], &v[..]);
        assert_eq!(&even[..], &v[..]);
    }
}
