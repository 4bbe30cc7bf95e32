//! Grouped routed-expert MoE for decode (`kernels/moe.cu`): for `M <= 16` tokens with
//! device-resident top-k expert ids and routing weights, every selected expert's gate+up
//! projection with the clamped SwiGLU, its down projection and the weighted sum, in two
//! launches and without reading anything back (graph-capturable):
//!
//! 1. gate+up of all selected experts into `h [M, top_k, I]` (bf16), each expert's weights read
//!    once however many tokens chose it;
//! 2. down projections of all selected experts and the weighted sum into `out [M, D]`, each
//!    token's sum taken in ascending expert order in a fixed order (no atomics).
//!
//! Expert ids outside `[0, experts)` select nothing. CPU reference: [`reference`].

use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use half::bf16;

use super::gemv::check_mxfp4_scales;
use super::launch::dim_u32;
use super::{DType, Device, DeviceTensor, GpuError};
use crate::codecs::mxfp4::Mxfp4Quantized;
use crate::codecs::nvfp4::Nvfp4Quantized;

/// Largest number of tokens one launch takes.
pub const MAX_M: usize = 16;
/// Largest `M * top_k` (the kernels stage the routing table in shared memory).
pub const MAX_PAIRS: usize = 256;
/// Largest intermediate size: one expert's down-projection K steps must fit the kernel's
/// shared-memory partials (32 steps of 512 FP4 values).
pub const MAX_INTER: usize = 16384;

const GATE_UP_WARPS: u32 = 4;
const DOWN_WARPS: u32 = 8;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoeFormat {
    Nvfp4,
    Mxfp4,
}

impl MoeFormat {
    fn name(self) -> &'static str {
        match self {
            MoeFormat::Nvfp4 => "nvfp4",
            MoeFormat::Mxfp4 => "mxfp4",
        }
    }

    fn scale_dtype(self) -> DType {
        match self {
            MoeFormat::Nvfp4 => DType::E4M3,
            MoeFormat::Mxfp4 => DType::E8M0,
        }
    }

    fn scale_block(self) -> usize {
        match self {
            MoeFormat::Nvfp4 => 16,
            MoeFormat::Mxfp4 => 32,
        }
    }
}

/// Every expert's quantized `w1`, `w3` (`[I, D]`) and `w2` (`[D, I]`), host side, for
/// [`MoeExperts::upload`].
#[derive(Debug, Clone, Copy)]
pub enum HostExperts<'a> {
    Nvfp4 {
        w1: &'a [Nvfp4Quantized],
        w3: &'a [Nvfp4Quantized],
        w2: &'a [Nvfp4Quantized],
    },
    Mxfp4 {
        w1: &'a [Mxfp4Quantized],
        w3: &'a [Mxfp4Quantized],
        w2: &'a [Mxfp4Quantized],
    },
}

/// One layer's routed experts, stacked: codes `[E, rows, cols/2]`, scales `[E, rows,
/// cols/block]`, NVFP4 global scales `[E]`.
pub struct MoeExperts {
    format: MoeFormat,
    experts: usize,
    d: usize,
    inter: usize,
    w1: DeviceTensor<u8>,
    w3: DeviceTensor<u8>,
    w2: DeviceTensor<u8>,
    s1: DeviceTensor<u8>,
    s3: DeviceTensor<u8>,
    s2: DeviceTensor<u8>,
    globals: Option<[DeviceTensor<f32>; 3]>,
}

fn invalid(what: &str, detail: impl Into<String>) -> GpuError {
    GpuError::invalid(what, detail)
}

fn check_dims(what: &str, experts: usize, d: usize, inter: usize) -> Result<(), GpuError> {
    if experts == 0 || d == 0 || inter == 0 || !d.is_multiple_of(32) || !inter.is_multiple_of(32) || inter > MAX_INTER {
        return Err(invalid(
            what,
            format!(
                "{experts} experts, D = {d}, I = {inter}: all positive, D and I multiples of 32, \
                 I at most {MAX_INTER}"
            ),
        ));
    }
    dim_u32(what, experts)?;
    dim_u32(what, d)?;
    dim_u32(what, inter)?;
    Ok(())
}

impl MoeExperts {
    /// Validates and stacks the experts' weights on the device. `D` and `I` must be multiples
    /// of 32; MXFP4 scale bytes at most [`super::gemv::MXFP4_MAX_SCALE_BYTE`].
    pub fn upload(
        dev: &Device,
        host: HostExperts<'_>,
        d: usize,
        inter: usize,
    ) -> Result<MoeExperts, GpuError> {
        fn stack<'a>(
            parts: impl Iterator<Item = &'a [u8]>,
            each: usize,
            what: &str,
        ) -> Result<Vec<u8>, GpuError> {
            let mut out = Vec::new();
            for (e, p) in parts.enumerate() {
                if p.len() != each {
                    return Err(invalid(
                        what,
                        format!("expert {e}: {} bytes where {each} are needed", p.len()),
                    ));
                }
                out.extend_from_slice(p);
            }
            Ok(out)
        }
        let (format, experts) = match host {
            HostExperts::Nvfp4 { w1, w3, w2 } => (MoeFormat::Nvfp4, (w1.len(), w3.len(), w2.len())),
            HostExperts::Mxfp4 { w1, w3, w2 } => (MoeFormat::Mxfp4, (w1.len(), w3.len(), w2.len())),
        };
        let what = format!("{} experts", format.name());
        if experts.0 != experts.1 || experts.0 != experts.2 {
            return Err(invalid(&what, format!("{experts:?} experts in w1, w3, w2")));
        }
        let e = experts.0;
        check_dims(&what, e, d, inter)?;
        let blk = format.scale_block();
        let (up_codes, up_scales) = (inter * d / 2, inter * d / blk);
        let (dn_codes, dn_scales) = (d * inter / 2, d * inter / blk);
        let sd = format.scale_dtype();
        let up = [e, inter, d / 2];
        let up_s = [e, inter, d / blk];
        let dn = [e, d, inter / 2];
        let dn_s = [e, d, inter / blk];
        let (w1, w3, w2, s1, s3, s2, globals) = match host {
            HostExperts::Nvfp4 { w1, w3, w2 } => {
                let g: Vec<Vec<f32>> = [w1, w3, w2]
                    .iter()
                    .map(|w| w.iter().map(|q| q.weight_scale_2).collect())
                    .collect();
                if let Some(bad) = g.iter().flatten().find(|v| !v.is_finite()) {
                    return Err(invalid(
                        &what,
                        format!("weight_scale_2 {bad} is not finite"),
                    ));
                }
                let globals = [
                    dev.upload(DType::F32, &[e], &g[0])?,
                    dev.upload(DType::F32, &[e], &g[1])?,
                    dev.upload(DType::F32, &[e], &g[2])?,
                ];
                (
                    stack(w1.iter().map(|q| &q.weight[..]), up_codes, "w1")?,
                    stack(w3.iter().map(|q| &q.weight[..]), up_codes, "w3")?,
                    stack(w2.iter().map(|q| &q.weight[..]), dn_codes, "w2")?,
                    stack(
                        w1.iter().map(|q| &q.weight_scale[..]),
                        up_scales,
                        "w1 scales",
                    )?,
                    stack(
                        w3.iter().map(|q| &q.weight_scale[..]),
                        up_scales,
                        "w3 scales",
                    )?,
                    stack(
                        w2.iter().map(|q| &q.weight_scale[..]),
                        dn_scales,
                        "w2 scales",
                    )?,
                    Some(globals),
                )
            }
            HostExperts::Mxfp4 { w1, w3, w2 } => {
                let s1 = stack(w1.iter().map(|q| &q.scale[..]), up_scales, "w1 scales")?;
                let s3 = stack(w3.iter().map(|q| &q.scale[..]), up_scales, "w3 scales")?;
                let s2 = stack(w2.iter().map(|q| &q.scale[..]), dn_scales, "w2 scales")?;
                for s in [&s1, &s3, &s2] {
                    check_mxfp4_scales(&what, s)?;
                }
                (
                    stack(w1.iter().map(|q| &q.weight[..]), up_codes, "w1")?,
                    stack(w3.iter().map(|q| &q.weight[..]), up_codes, "w3")?,
                    stack(w2.iter().map(|q| &q.weight[..]), dn_codes, "w2")?,
                    s1,
                    s3,
                    s2,
                    None,
                )
            }
        };
        Ok(MoeExperts {
            format,
            experts: e,
            d,
            inter,
            w1: dev.upload(DType::E2M1x2, &up, &w1)?,
            w3: dev.upload(DType::E2M1x2, &up, &w3)?,
            w2: dev.upload(DType::E2M1x2, &dn, &w2)?,
            s1: dev.upload(sd, &up_s, &s1)?,
            s3: dev.upload(sd, &up_s, &s3)?,
            s2: dev.upload(sd, &dn_s, &s2)?,
            globals,
        })
    }

    /// Experts from stacked device tensors (the loader's path): `w1`, `w3` E2M1x2
    /// `[E, I, D/2]`, `w2` `[E, D, I/2]`, scales E4M3 (NVFP4, per 16) or E8M0 (MXFP4, per 32)
    /// with matching shapes, and for NVFP4 the global scales `[w1, w3, w2]`, each F32 `[E]`.
    /// MXFP4 scale bytes are not read back here; bytes above
    /// [`super::gemv::MXFP4_MAX_SCALE_BYTE`] give non-finite outputs.
    #[allow(clippy::too_many_arguments)]
    pub fn from_parts(
        format: MoeFormat,
        w1: DeviceTensor<u8>,
        w3: DeviceTensor<u8>,
        w2: DeviceTensor<u8>,
        s1: DeviceTensor<u8>,
        s3: DeviceTensor<u8>,
        s2: DeviceTensor<u8>,
        globals: Option<[DeviceTensor<f32>; 3]>,
    ) -> Result<MoeExperts, GpuError> {
        let what = format!("{} experts", format.name());
        let (e, inter, d) = match w1.shape() {
            &[e, i, half_d] => (e, i, 2 * half_d),
            s => return Err(invalid(&what, format!("w1 shape {s:?} is not [E, I, D/2]"))),
        };
        check_dims(&what, e, d, inter)?;
        let blk = format.scale_block();
        let sd = format.scale_dtype();
        w1.expect("w1", DType::E2M1x2, &[e, inter, d / 2])?;
        w3.expect("w3", DType::E2M1x2, &[e, inter, d / 2])?;
        w2.expect("w2", DType::E2M1x2, &[e, d, inter / 2])?;
        s1.expect("w1 scales", sd, &[e, inter, d / blk])?;
        s3.expect("w3 scales", sd, &[e, inter, d / blk])?;
        s2.expect("w2 scales", sd, &[e, d, inter / blk])?;
        match (&globals, format) {
            (Some(g), MoeFormat::Nvfp4) => {
                for t in g {
                    t.expect("global scales", DType::F32, &[e])?;
                }
            }
            (None, MoeFormat::Mxfp4) => {}
            _ => {
                return Err(invalid(
                    &what,
                    "NVFP4 experts need global scales, MXFP4 experts none",
                ))
            }
        }
        Ok(MoeExperts {
            format,
            experts: e,
            d,
            inter,
            w1,
            w3,
            w2,
            s1,
            s3,
            s2,
            globals,
        })
    }

    pub fn format(&self) -> MoeFormat {
        self.format
    }

    pub fn experts(&self) -> usize {
        self.experts
    }

    /// Model dimension D (input and output width).
    pub fn d(&self) -> usize {
        self.d
    }

    /// Intermediate size I.
    pub fn inter(&self) -> usize {
        self.inter
    }

    /// Bytes of one expert's weights and scales (w1 + w3 + w2).
    pub fn expert_bytes(&self) -> usize {
        let per = |t: &DeviceTensor<u8>| t.num_bytes() / self.experts;
        per(&self.w1)
            + per(&self.w3)
            + per(&self.w2)
            + per(&self.s1)
            + per(&self.s3)
            + per(&self.s2)
            + if self.globals.is_some() { 12 } else { 0 }
    }
}

/// The MoE output: bf16, or f32 (e.g. for a residual stream kept in f32).
pub enum MoeOut<'a> {
    Bf16(&'a mut DeviceTensor<bf16>),
    F32(&'a mut DeviceTensor<f32>),
}

/// Kernel arguments; mirrors `struct MoeArgs` in moe.cu field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct MoeArgs {
    x: u64,
    ids: u64,
    weights: u64,
    w1: u64,
    w3: u64,
    w2: u64,
    s1: u64,
    s3: u64,
    s2: u64,
    g1: u64,
    g3: u64,
    g2: u64,
    h: u64,
    out: u64,
    m: u32,
    topk: u32,
    experts: u32,
    d: u32,
    inter: u32,
    limit: f32,
}

// SAFETY: plain #[repr(C)] data with the exact layout of the CUDA struct.
unsafe impl DeviceRepr for MoeArgs {}

/// Routed experts for `x [M, D]`: `ids` I32 `[M, top_k]` and `weights` F32 `[M, top_k]` (the
/// router's choices, on the device), `h` BF16 `[M, top_k, I]` scratch (reserve it in the
/// pool), `out [M, D]` = Σⱼ weights[t, j] · expert_{ids[t, j]}(x[t]) with the clamped SwiGLU
/// (`limit` = swiglu_limit). Two launches; nothing is read back.
#[allow(clippy::too_many_arguments)]
pub fn moe_decode(
    dev: &Device,
    x: &DeviceTensor<bf16>,
    ids: &DeviceTensor<i32>,
    weights: &DeviceTensor<f32>,
    experts: &MoeExperts,
    limit: f32,
    h: &mut DeviceTensor<bf16>,
    out: MoeOut<'_>,
) -> Result<(), GpuError> {
    let (m, d) = x.dims2("moe input x", DType::BF16)?;
    if d != experts.d {
        return Err(invalid(
            "moe input x",
            format!("width {d}, experts take {}", experts.d),
        ));
    }
    let (mi, topk) = ids.dims2("moe expert ids", DType::I32)?;
    weights.expect("moe routing weights", DType::F32, &[mi, topk])?;
    if mi != m || m == 0 || m > MAX_M || topk == 0 || m * topk > MAX_PAIRS {
        return Err(invalid(
            "moe_decode",
            format!(
                "{m} tokens with ids [{mi}, {topk}]: 1..={MAX_M} tokens, M * top_k <= {MAX_PAIRS}"
            ),
        ));
    }
    if limit.is_nan() || limit <= 0.0 {
        return Err(invalid(
            "moe_decode",
            format!("swiglu limit {limit} must be positive"),
        ));
    }
    h.expect("moe intermediate h", DType::BF16, &[m, topk, experts.inter])?;
    let (out_addr, out_f32) = match out {
        MoeOut::Bf16(t) => {
            t.expect("moe output", DType::BF16, &[m, d])?;
            (t.device_address(), false)
        }
        MoeOut::F32(t) => {
            t.expect("moe output", DType::F32, &[m, d])?;
            (t.device_address(), true)
        }
    };
    let g = |i: usize| {
        experts
            .globals
            .as_ref()
            .map_or(0, |g| g[i].device_address())
    };
    let args = MoeArgs {
        x: x.device_address(),
        ids: ids.device_address(),
        weights: weights.device_address(),
        w1: experts.w1.device_address(),
        w3: experts.w3.device_address(),
        w2: experts.w2.device_address(),
        s1: experts.s1.device_address(),
        s3: experts.s3.device_address(),
        s2: experts.s2.device_address(),
        g1: g(0),
        g3: g(1),
        g2: g(2),
        h: h.device_address(),
        out: out_addr,
        m: m as u32,
        topk: topk as u32,
        experts: experts.experts as u32,
        d: d as u32,
        inter: experts.inter as u32,
        limit,
    };
    let mt = if m <= 8 { "m8" } else { "m16" };
    let fmt = experts.format.name();
    let gate_up = format!("moe_gate_up_{fmt}_{mt}");
    let down = format!("moe_down_{fmt}_{mt}{}", if out_f32 { "_f32" } else { "" });
    let launches = [
        (
            gate_up,
            LaunchConfig {
                grid_dim: (
                    dim_u32("moe tiles", experts.inter.div_ceil(8))?,
                    (m * topk) as u32,
                    1,
                ),
                block_dim: (GATE_UP_WARPS * 32, 1, 1),
                shared_mem_bytes: 0,
            },
        ),
        (
            down,
            LaunchConfig {
                grid_dim: (dim_u32("moe tiles", d.div_ceil(16))?, 1, 1),
                block_dim: (DOWN_WARPS * 32, 1, 1),
                shared_mem_bytes: 0,
            },
        ),
    ];
    for (kernel, cfg) in launches {
        let f = dev.function(&kernel)?;
        // SAFETY: every tensor was checked against (E, D, I, M, top_k) above; the kernels
        // bound-check expert ids and read/write only inside those shapes.
        unsafe { dev.stream().launch_builder(f).arg(&args).launch(cfg) }.map_err(|e| {
            GpuError::Driver {
                what: format!("launching {kernel}"),
                source: e,
            }
        })?;
    }
    Ok(())
}

/// f64 CPU reference on [`crate::codecs`] dequantization.
pub mod reference {
    use half::bf16;

    use crate::gpu::gemv::reference::{gemv, swiglu};

    /// One expert's dequantized weights: `w1`, `w3` `[I, D]`, `w2` `[D, I]`.
    pub struct ExpertF32<'a> {
        pub w1: &'a [f32],
        pub w3: &'a [f32],
        pub w2: &'a [f32],
    }

    /// `out [m, d]` = Σⱼ weights[t, j] · W2 (swiglu(W1 x, W3 x)) over the valid experts of each
    /// token, in f64 (no intermediate rounding).
    #[allow(clippy::too_many_arguments)]
    pub fn moe(
        x: &[bf16],
        m: usize,
        d: usize,
        inter: usize,
        ids: &[i32],
        weights: &[f32],
        topk: usize,
        experts: &[ExpertF32<'_>],
        limit: f64,
    ) -> Vec<f64> {
        let mut out = vec![0f64; m * d];
        for t in 0..m {
            let xt = &x[t * d..(t + 1) * d];
            for j in 0..topk {
                let e = ids[t * topk + j];
                if e < 0 || e as usize >= experts.len() {
                    continue;
                }
                let ex = &experts[e as usize];
                let g = gemv(xt, 1, ex.w1, inter, d);
                let u = gemv(xt, 1, ex.w3, inter, d);
                let h: Vec<f64> = g
                    .iter()
                    .zip(&u)
                    .map(|(&g, &u)| swiglu(g, u, limit))
                    .collect();
                let w = weights[t * topk + j] as f64;
                for r in 0..d {
                    let row = &ex.w2[r * inter..(r + 1) * inter];
                    let y: f64 = row.iter().zip(&h).map(|(&a, &b)| a as f64 * b).sum();
                    out[t * d + r] += w * y;
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args_layout_matches_the_cuda_struct() {
        // 14 pointers, 5 u32 and one f32.
        assert_eq!(std::mem::size_of::<MoeArgs>(), 136);
    }

    #[test]
    fn reference_skips_invalid_ids_and_weights_experts() {
        // D = 2, I = 1: w1 = w3 = [1, 0], w2 = [[1], [2]]; x = [2, 5].
        let (w1, w3, w2) = ([1.0f32, 0.0], [1.0f32, 0.0], [1.0f32, 2.0]);
        let ex = [super::reference::ExpertF32 {
            w1: &w1,
            w3: &w3,
            w2: &w2,
        }];
        let x = [bf16::from_f32(2.0), bf16::from_f32(5.0)];
        let out = super::reference::moe(&x, 1, 2, 1, &[0, -1, 7], &[0.5, 9.0, 9.0], 3, &ex, 10.0);
        let h = 2.0 / (1.0 + (-2f64).exp()) * 2.0;
        assert!(
            (out[0] - 0.5 * h).abs() < 1e-12 && (out[1] - h).abs() < 1e-12,
            "{out:?}"
        );
    }
}
