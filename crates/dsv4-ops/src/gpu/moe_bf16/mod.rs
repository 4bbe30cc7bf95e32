//! Routed experts with BF16 weights for decode (`kernels/moe_bf16.cu`): the counterpart of
//! [`super::moe::moe_decode`] for BF16 checkpoints (and F32/F16 ones, converted to BF16 at
//! upload). For `M <= 16` tokens with device-resident expert ids and routing weights, two
//! launches and nothing read back (graph-capturable):
//!
//! 1. gate+up of every selected expert with the clamped SwiGLU into `h [M, top_k, I]` (f32),
//!    each expert's w1/w3 read once however many tokens chose it;
//! 2. down projections and the weighted sum into `out [M, D]` (f32), each expert's w2 read once
//!    per launch, each token's terms summed in ascending expert order with no atomics.
//!
//! Weights stream with 16-byte loads, a warp per group of 4 rows (no tensor cores: at decode
//! sizes the kernels are bound by the weight bytes). Every dot product is summed in a fixed
//! order that depends on D and I only, so a token's output is the same alone and in a batch.
//! Expert ids outside `[0, experts)` select nothing. CPU reference: [`reference`].

pub mod reference;
#[cfg(test)]
mod tests;

use cudarc::driver::{DeviceRepr, LaunchConfig};
use half::bf16;

use super::gemv::tuning::PROGRAMMATIC_LAUNCH;
use super::launch::{dim_u32, launch_struct};
use super::moe::{check_routing, same_expert_counts};
use super::random;
use super::{DType, Device, DeviceTensor, GpuError, Stager};

/// Largest number of tokens one launch takes (`MAX_M` in moe_bf16.cu).
pub const MAX_M: usize = 16;
/// Largest `M * top_k` (the kernels' shared routing tables: `MAX_PAIRS` in moe_bf16.cu).
pub const MAX_PAIRS: usize = 256;
/// D and I must be multiples of this (16-byte loads of bf16 rows).
pub const DIM_MULTIPLE: usize = 8;

/// Rows (of I for gate+up, of D for down) one 4-warp block takes (`BLOCK_ROWS` in moe_bf16.cu).
const BLOCK_ROWS: usize = 16;
const THREADS: u32 = 128;

/// Every expert's w1, w3 `[I, D]` and w2 `[D, I]` as BF16, stacked on the device: `w1`, `w3`
/// `[E, I, D]`, `w2` `[E, D, I]`.
pub struct Bf16Experts {
    experts: usize,
    d: usize,
    inter: usize,
    w1: DeviceTensor<bf16>,
    w3: DeviceTensor<bf16>,
    w2: DeviceTensor<bf16>,
}

fn check_dims(what: &str, experts: usize, d: usize, inter: usize) -> Result<(), GpuError> {
    if experts == 0
        || d == 0
        || inter == 0
        || !d.is_multiple_of(DIM_MULTIPLE)
        || !inter.is_multiple_of(DIM_MULTIPLE)
    {
        return Err(GpuError::invalid(
            what,
            format!(
                "{experts} experts, D = {d}, I = {inter}: all positive, D and I multiples of \
                 {DIM_MULTIPLE}"
            ),
        ));
    }
    dim_u32(what, experts)?;
    dim_u32(what, d)?;
    dim_u32(what, inter)?;
    Ok(())
}

impl Bf16Experts {
    /// `w1[e]`, `w3[e]` row-major `[inter, d]`, `w2[e]` `[d, inter]`, one slice per expert.
    /// `d` and `inter` must be multiples of [`DIM_MULTIPLE`] ([`Self::load`] through a stager of
    /// its own).
    pub fn upload(
        dev: &Device,
        w1: &[&[bf16]],
        w3: &[&[bf16]],
        w2: &[&[bf16]],
        d: usize,
        inter: usize,
    ) -> Result<Bf16Experts, GpuError> {
        let bytes = 2 * d * inter * 3 * w1.len();
        let mut st = Stager::for_bytes(dev, bytes)?;
        Bf16Experts::load(&mut st, w1, w3, w2, d, inter)
    }

    /// [`Self::upload`] through `st`, expert by expert (no host copy of the whole stack).
    pub fn load(
        st: &mut Stager<'_>,
        w1: &[&[bf16]],
        w3: &[&[bf16]],
        w2: &[&[bf16]],
        d: usize,
        inter: usize,
    ) -> Result<Bf16Experts, GpuError> {
        let what = "bf16 experts";
        let e = w1.len();
        same_expert_counts(what, e, w3.len(), w2.len())?;
        check_dims(what, e, d, inter)?;
        let per = d * inter;
        for (name, mats) in [("w1", w1), ("w3", w3), ("w2", w2)] {
            if let Some((i, m)) = mats.iter().enumerate().find(|(_, m)| m.len() != per) {
                return Err(GpuError::invalid(
                    what,
                    format!(
                        "expert {i} {name} has {} values where {per} (D = {d}, I = {inter}) are \
                         needed",
                        m.len()
                    ),
                ));
            }
        }
        let mut upload = |mats: &[&[bf16]], shape: [usize; 3]| {
            let mut t = st.device().alloc::<bf16>(DType::BF16, &shape)?;
            for (i, m) in mats.iter().enumerate() {
                st.copy(m, &mut t, i * per)?;
            }
            Ok::<_, GpuError>(t)
        };
        Ok(Bf16Experts {
            experts: e,
            d,
            inter,
            w1: upload(w1, [e, inter, d])?,
            w3: upload(w3, [e, inter, d])?,
            w2: upload(w2, [e, d, inter])?,
        })
    }

    /// `experts` random experts generated on the device: uniform values of RMS
    /// `1/sqrt(fan_in)`; the same `seed` gives the same values.
    pub fn random(
        dev: &Device,
        experts: usize,
        d: usize,
        inter: usize,
        seed: u64,
    ) -> Result<Bf16Experts, GpuError> {
        check_dims("random bf16 experts", experts, d, inter)?;
        let fill = |shape: [usize; 3], fan_in: usize, seed: u64| {
            let mut t = dev.alloc::<bf16>(DType::BF16, &shape)?;
            let u = random::Uniform {
                mean: 0.0,
                half_range: (3.0 / fan_in as f32).sqrt(),
            };
            random::fill_uniform(dev, &mut t, seed, u)?;
            Ok::<_, GpuError>(t)
        };
        Ok(Bf16Experts {
            experts,
            d,
            inter,
            w1: fill([experts, inter, d], d, seed)?,
            w3: fill([experts, inter, d], d, seed ^ 0x3333)?,
            w2: fill([experts, d, inter], inter, seed ^ 0x5555)?,
        })
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

    /// Bytes one expert's weights take (w1 + w3 + w2, BF16).
    pub fn expert_bytes(&self) -> usize {
        3 * self.d * self.inter * 2
    }
}

/// Kernel arguments; mirrors `struct MoeBf16Args` in moe_bf16.cu field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct MoeBf16Args {
    x: u64,
    ids: u64,
    weights: u64,
    w1: u64,
    w3: u64,
    w2: u64,
    h: u64,
    out: u64,
    m: u32,
    topk: u32,
    experts: u32,
    d: u32,
    inter: u32,
    limit: f32,
    accumulate: u32,
}

// SAFETY: plain #[repr(C)] data with the exact layout of the CUDA struct.
unsafe impl DeviceRepr for MoeBf16Args {}

/// Routed experts for `x [M, D]` (BF16): `ids` I32 `[M, k]` and `weights` F32 `[M, k]` (the
/// router's output, on the device), `h` F32 `[M, k, I]` scratch (reserve it in the pool),
/// `out [M, D]` F32 = Σⱼ weights[t, j] · W2[id](silu(min(W1[id] x, L)) ⊙ clamp(W3[id] x, −L, L))
/// with `L = limit` (swiglu_limit), each token's terms summed in ascending expert id order in a
/// fixed order (no atomics). Ids outside `[0, experts)` select nothing (a token without a valid
/// id gets zeros); a token's ids are normally distinct (repeated ones each add their term, in
/// slot order). `1 <= M <= 16`, `M · k <= 256`. With `accumulate`, the sum is added to what
/// `out` holds (one f32 add each) instead. Two launches; `between` runs after the first
/// (gate+up) and before the second (down), which writes `out`. Nothing is read back.
#[allow(clippy::too_many_arguments)]
pub fn moe_bf16(
    dev: &Device,
    x: &DeviceTensor<bf16>,
    ids: &DeviceTensor<i32>,
    weights: &DeviceTensor<f32>,
    experts: &Bf16Experts,
    limit: f32,
    h: &mut DeviceTensor<f32>,
    out: &mut DeviceTensor<f32>,
    accumulate: bool,
    between: impl FnOnce() -> Result<(), GpuError>,
) -> Result<(), GpuError> {
    let (m, d, topk) = check_routing(
        ("moe_bf16", "moe_bf16"),
        x,
        ids,
        weights,
        experts.d,
        limit,
        (MAX_M, MAX_PAIRS),
    )?;
    let inter = experts.inter;
    h.expect("moe_bf16 intermediate h", DType::F32, &[m, topk, inter])?;
    out.expect("moe_bf16 output", DType::F32, &[m, d])?;
    let args = MoeBf16Args {
        x: x.device_address(),
        ids: ids.device_address(),
        weights: weights.device_address(),
        w1: experts.w1.device_address(),
        w3: experts.w3.device_address(),
        w2: experts.w2.device_address(),
        h: h.device_address(),
        out: out.device_address(),
        m: m as u32,
        topk: topk as u32,
        experts: experts.experts as u32,
        d: d as u32,
        inter: inter as u32,
        limit,
        accumulate: u32::from(accumulate),
    };
    let up = LaunchConfig {
        grid_dim: (
            dim_u32("moe_bf16 gate+up blocks", inter.div_ceil(BLOCK_ROWS))?,
            (m * topk) as u32,
            1,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let down = LaunchConfig {
        grid_dim: (
            dim_u32("moe_bf16 down blocks", d.div_ceil(BLOCK_ROWS))?,
            1,
            1,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY (both launches): MoeBf16Args mirrors the kernels' argument; x [M, D], ids and
    // weights [M, k], h [M, k, I], out [M, D] and the stacked weights [E, I, D] / [E, D, I] were
    // checked above (D and I multiples of 8, so every 16-byte load is aligned); the kernels
    // bound-check expert ids and touch nothing outside those shapes.
    let pdl = PROGRAMMATIC_LAUNCH.get();
    let launch = |kernel, cfg: LaunchConfig| {
        let block = (cfg.block_dim.0, cfg.shared_mem_bytes);
        unsafe { launch_struct(dev, kernel, cfg.grid_dim, block, &args, pdl, 1) }
    };
    launch("moe_bf16_gate_up", up)?;
    between()?;
    launch("moe_bf16_down", down)
}
