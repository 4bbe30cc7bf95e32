//! Launchers of the router kernels (`kernels/router.cu`): the gate projection in f32
//! ([`gate_logits`]), then from the gate logits to the expert ids and combine weights that the
//! grouped MoE reads, on the device (hash routing reads the device token ids), or both in one
//! launch ([`gate_route`]). CPU reference: [`reference`].

pub mod reference;
#[cfg(test)]
mod tests;

use cudarc::driver::LaunchConfig;
use half::bf16;

use super::launch::{dim_u32, launch, Args};
use super::{DType, Device, DeviceTensor, GpuError};

/// The largest experts-per-token the kernel holds (DeepSeek-V4 uses 6).
pub const MAX_TOP_K: usize = 16;
/// The most routed experts the kernel holds (`ROUTE_E_MAX` in router.cu, its block's keys;
/// Flash has 256, Pro 384).
pub const MAX_EXPERTS: usize = 512;

/// Threads of a `route_topk` block (`ROUTE_THREADS` in router.cu).
const ROUTE_THREADS: u32 = 256;
/// The gate's width D must be a multiple of this (16-byte loads of the rows).
pub const GATE_DIM_MULTIPLE: usize = 8;
/// Tokens one gate block takes (`gate::TOKENS` in router.cu); the grid's y covers the rest.
const GATE_TOKENS: usize = 64;
/// Expert rows of a `gate_logits_rows_*` block (`gate::EXPERTS` in router.cu), taken for
/// launches of more than GATE_ROWS_FROM tokens (on an H200, 16 decoding sequences' step 25 µs
/// shorter with them, 2 and 4 sequences' 10-24 µs longer).
const GATE_EXPERTS_PER_BLOCK: u32 = 8;
const GATE_ROWS_FROM: usize = 8;

/// How a layer picks its experts, on the device.
#[derive(Clone, Copy, Debug)]
pub enum DeviceRouteBy<'a> {
    /// `tid2eid` U32 `[vocab, k]`.
    Hash { tid2eid: &'a DeviceTensor<u32> },
    /// `bias` F32 `[E]`, for selection only.
    Learned { bias: &'a DeviceTensor<f32> },
}

/// A checked routing: `[n, e, k, vocab]`, the table and bias addresses (one null), the scale
/// and the token, id and weight addresses.
struct Route {
    dims: [u32; 4],
    tid2eid: u64,
    bias: u64,
    scale: f32,
    tensors: [u64; 3],
}

impl Route {
    /// The routing's arguments, in the order `route_topk` and `gate_route_*` end with.
    fn push_args(&self, args: &mut Args) {
        let [tokens, ids, weights] = self.tensors;
        args.arg(self.dims[2])
            .arg(tokens)
            .arg(self.tid2eid)
            .arg(self.dims[3])
            .arg(self.bias)
            .arg(self.scale)
            .arg(ids)
            .arg(weights);
    }
}

fn check_route(
    n: usize,
    e: usize,
    tokens: &DeviceTensor<u32>,
    by: DeviceRouteBy,
    scale: f32,
    ids: &DeviceTensor<i32>,
    weights: &DeviceTensor<f32>,
) -> Result<Route, GpuError> {
    let k = ids.shape().get(1).copied().unwrap_or(0);
    if k == 0 || k > MAX_TOP_K || k > e || e > MAX_EXPERTS {
        return Err(GpuError::invalid(
            "router",
            format!(
                "top-{k} of {e} experts (the kernel takes 1..={MAX_TOP_K}, at most E, and at \
                 most {MAX_EXPERTS} experts)"
            ),
        ));
    }
    ids.expect("router ids", DType::I32, &[n, k])?;
    weights.expect("router weights", DType::F32, &[n, k])?;
    tokens.expect("router token ids", DType::U32, &[n])?;
    let (tid2eid, vocab, bias) = match by {
        DeviceRouteBy::Hash { tid2eid } => {
            let (vocab, _) = tid2eid.dims2("tid2eid", DType::U32)?;
            tid2eid.expect("tid2eid", DType::U32, &[vocab, k])?;
            (tid2eid.device_address(), vocab, 0u64)
        }
        DeviceRouteBy::Learned { bias } => {
            bias.expect("router bias", DType::F32, &[e])?;
            (0u64, 0, bias.device_address())
        }
    };
    Ok(Route {
        dims: [
            dim_u32("tokens", n)?,
            dim_u32("experts", e)?,
            dim_u32("top-k", k)?,
            dim_u32("vocab", vocab)?,
        ],
        tid2eid,
        bias,
        scale,
        tensors: [
            tokens.device_address(),
            ids.device_address(),
            weights.device_address(),
        ],
    })
}

/// Routes `n` tokens: `logits [n, E]` (F32, the gate projection), `tokens` U32 `[n]` →
/// `ids` I32 `[n, k]` and `weights` F32 `[n, k]` (`score / Σ scores · scale`).
pub fn route_topk(
    dev: &Device,
    logits: &DeviceTensor<f32>,
    tokens: &DeviceTensor<u32>,
    by: DeviceRouteBy,
    scale: f32,
    ids: &mut DeviceTensor<i32>,
    weights: &mut DeviceTensor<f32>,
) -> Result<(), GpuError> {
    let (n, e) = logits.dims2("router logits", DType::F32)?;
    let r = check_route(n, e, tokens, by, scale, ids, weights)?;
    if n == 0 {
        return Ok(());
    }
    // One block per token (grid-stride past 65536).
    let cfg = LaunchConfig {
        grid_dim: (r.dims[0].min(1 << 16), 1, 1),
        block_dim: (ROUTE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut args = Args::new();
    args.ptr(logits).arg(r.dims[0]).arg(r.dims[1]);
    r.push_args(&mut args);
    // SAFETY: logits [n, e], tokens [n], tid2eid [vocab, k] or bias [e] (the other null),
    // ids and weights [n, k] with k <= 16, checked above.
    unsafe { launch(dev, "route_topk", cfg, &args) }
}

/// The MoE gate weight `[E, D]`, as the checkpoint stores it.
#[derive(Clone, Copy, Debug)]
pub enum GateWeight<'a> {
    Bf16(&'a DeviceTensor<bf16>),
    F32(&'a DeviceTensor<f32>),
}

/// A checked gate projection: the kernels for its weight format (alone, with the routing),
/// the weight's address, the launch grid and `[t, d, e]`.
struct Gate {
    kernels: (&'static str, &'static str),
    w: u64,
    cfg: LaunchConfig,
    dims: [u32; 3],
}

fn check_gate(
    x: &DeviceTensor<f32>,
    w: GateWeight<'_>,
    logits: &DeviceTensor<f32>,
) -> Result<Gate, GpuError> {
    let (t, d) = x.dims2("gate input x", DType::F32)?;
    let (kernels, (e, wd), w_addr) = match w {
        GateWeight::Bf16(w) => (
            ("gate_logits_bf16", "gate_route_bf16"),
            w.dims2("gate weight", DType::BF16)?,
            w.device_address(),
        ),
        GateWeight::F32(w) => (
            ("gate_logits_f32", "gate_route_f32"),
            w.dims2("gate weight", DType::F32)?,
            w.device_address(),
        ),
    };
    if wd != d {
        return Err(GpuError::Shape {
            what: "gate weight".to_string(),
            expected: vec![e, d],
            found: vec![e, wd],
        });
    }
    if !d.is_multiple_of(GATE_DIM_MULTIPLE) {
        return Err(GpuError::invalid(
            "gate_logits",
            format!("width D = {d} is not a multiple of {GATE_DIM_MULTIPLE}"),
        ));
    }
    logits.expect("gate logits", DType::F32, &[t, e])?;
    let token_blocks = t.div_ceil(GATE_TOKENS);
    if token_blocks > u16::MAX as usize {
        return Err(GpuError::invalid(
            "gate_logits",
            format!(
                "{t} tokens: at most {} a launch",
                u16::MAX as usize * GATE_TOKENS
            ),
        ));
    }
    let dims = [
        dim_u32("gate tokens", t)?,
        dim_u32("gate width", d)?,
        dim_u32("gate experts", e)?,
    ];
    // One 4-warp block per expert row and group of 64 tokens.
    let cfg = LaunchConfig {
        grid_dim: (dims[2], token_blocks as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    Ok(Gate {
        kernels,
        w: w_addr,
        cfg,
        dims,
    })
}

impl Gate {
    /// The gate's arguments, in the order `gate_logits_*` and `gate_route_*` begin with.
    fn args(&self, x: &DeviceTensor<f32>, logits: &DeviceTensor<f32>) -> Args {
        let mut args = Args::new();
        args.ptr(x)
            .arg(self.dims[0])
            .arg(self.dims[1])
            .arg(self.w)
            .arg(self.dims[2])
            .ptr(logits);
        args
    }
}

/// `logits [T, E]` F32 = `x [T, D]` F32 · Wᵀ, with the gate weight `w [E, D]` in BF16 or F32:
/// f32 products and sums, never rounded to bf16 (top-k gaps are ~3e-4 relative). Each logit is
/// summed in one fixed order that depends on D only, so a token's logits are the same alone and
/// in a batch. D must be a multiple of [`GATE_DIM_MULTIPLE`].
pub fn gate_logits(
    dev: &Device,
    x: &DeviceTensor<f32>,
    w: GateWeight<'_>,
    logits: &mut DeviceTensor<f32>,
) -> Result<(), GpuError> {
    let mut g = check_gate(x, w, logits)?;
    if g.dims[0] == 0 || g.dims[2] == 0 {
        return Ok(());
    }
    // Past a few tokens, a block takes GATE_EXPERTS_PER_BLOCK rows, so each token's x is read
    // once for all of them (the same sums, bit for bit).
    let kernel = if g.dims[0] as usize > GATE_ROWS_FROM {
        g.cfg.grid_dim.0 = g.dims[2].div_ceil(GATE_EXPERTS_PER_BLOCK);
        match w {
            GateWeight::Bf16(_) => "gate_logits_rows_bf16",
            GateWeight::F32(_) => "gate_logits_rows_f32",
        }
    } else {
        g.kernels.0
    };
    // SAFETY: x [t, d], w [e, d] of the kernel's element type (d a multiple of 8, so the
    // 16-byte loads are aligned), logits [t, e], checked above; the rows kernels read rows
    // below e only and write logits of rows below e only.
    unsafe { launch(dev, kernel, g.cfg, &g.args(x, logits)) }
}

/// [`gate_logits`] then [`route_topk`] in one launch: the last gate block to finish routes
/// every token. `counter` (U32 `[1]`, zero before the first launch, e.g. from a sealed pool) is
/// that block's ticket; the launch leaves it at zero. Outputs as the two launches give.
#[allow(clippy::too_many_arguments)]
pub fn gate_route(
    dev: &Device,
    x: &DeviceTensor<f32>,
    w: GateWeight<'_>,
    tokens: &DeviceTensor<u32>,
    by: DeviceRouteBy,
    scale: f32,
    counter: &mut DeviceTensor<u32>,
    logits: &mut DeviceTensor<f32>,
    ids: &mut DeviceTensor<i32>,
    weights: &mut DeviceTensor<f32>,
) -> Result<(), GpuError> {
    let g = check_gate(x, w, logits)?;
    let (n, e) = (g.dims[0] as usize, g.dims[2] as usize);
    let r = check_route(n, e, tokens, by, scale, ids, weights)?;
    counter.expect("router ticket counter", DType::U32, &[1])?;
    if n == 0 {
        return Ok(());
    }
    let mut args = g.args(x, logits);
    r.push_args(&mut args);
    args.ptr(counter);
    // SAFETY: as gate_logits and route_topk; counter [1], checked above.
    unsafe { launch(dev, g.kernels.1, g.cfg, &args) }
}
