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
//! [`moe_chunk`] does the same for a prompt chunk of any length on the prefill GEMM: each
//! expert's (token, slot) pairs listed on the device, gate+up and down over each expert's list
//! (each expert's weights read once per 16 to 64 of its rows by the lists' length, on sm_90a
//! once per 128 for long lists), each token's weighted rows summed in slot order.
//!
//! Expert ids outside `[0, experts)` select nothing. CPU reference: [`mod@reference`].

use cudarc::driver::DeviceRepr;
use half::bf16;
use rayon::prelude::*;

use super::gemm::{fp4_tensor_lists, launch_stacks, Rows, Stack};
use super::gemv::pack::{CodeOrder, Layout};
use super::gemv::{
    check_mxfp4_scales, resident_warps, shared_for_at_most, staging_bytes, tuning, HostWeight,
    MXFP4_MAX_SCALE_BYTE,
};
use super::gemv::{GemvFormat, Output};
use super::launch::{dim_u32, elementwise, grid_for, launch, launch_struct, Args};
use super::random;
use super::{DType, Device, DeviceTensor, GpuError, Stager};
use crate::codecs::mxfp4::Mxfp4Quantized;
use crate::codecs::nvfp4::Nvfp4Quantized;
use cudarc::driver::LaunchConfig;

/// Largest number of tokens one launch takes (the down kernel's per-token shared tables are
/// sized for it: `MAX_M` in moe.cu).
pub const MAX_M: usize = 16;
/// Largest `M * top_k` (the kernels stage the routing table in shared memory: `MAX_PAIRS` in
/// moe.cu).
pub const MAX_PAIRS: usize = 256;
/// Largest intermediate size: one expert's down-projection K steps must fit the kernel's
/// shared-memory partials (32 steps of 512 FP4 values).
pub const MAX_INTER: usize = 16384;
/// Most experts of a layer (the down kernel keeps a table over them in shared memory:
/// `MAX_EXPERTS` in moe.cu).
pub const MAX_EXPERTS: usize = 4096;

/// Warps of a gate+up block.
const UP_WARPS: usize = 4;
/// Warps a down-projection block (one 16-row output tile) may use.
const DOWN_WARPS: [usize; 2] = [8, 4];

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

    fn scale_block(self) -> usize {
        match self {
            MoeFormat::Nvfp4 => 16,
            MoeFormat::Mxfp4 => 32,
        }
    }

    /// Scale bytes per 16-byte chunk of codes.
    fn scale_unit(self) -> usize {
        32 / self.scale_block()
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

/// One layer's routed experts, each repacked into the GEMV tile layout
/// ([`super::gemv::pack`]) and stacked: `w13` (w1 and w3 as gate+up tiles, K = D), `w2`
/// (plain tiles, K = I), their packed scales, and for NVFP4 the global scales of w1, w3, w2.
pub struct MoeExperts {
    format: MoeFormat,
    experts: usize,
    d: usize,
    inter: usize,
    w13: DeviceTensor<u8>,
    s13: DeviceTensor<u8>,
    w2: DeviceTensor<u8>,
    s2: DeviceTensor<u8>,
    globals: Option<[DeviceTensor<f32>; 3]>,
}

fn invalid(what: &str, detail: impl Into<String>) -> GpuError {
    GpuError::invalid(what, detail)
}

fn check_dims(what: &str, experts: usize, d: usize, inter: usize) -> Result<(), GpuError> {
    if experts == 0
        || experts > MAX_EXPERTS
        || d == 0
        || inter == 0
        || !d.is_multiple_of(32)
        || !inter.is_multiple_of(32)
        || inter > MAX_INTER
    {
        return Err(invalid(
            what,
            format!(
                "{experts} experts, D = {d}, I = {inter}: all positive, D and I multiples of 32, \
                 at most {MAX_EXPERTS} experts, I at most {MAX_INTER}"
            ),
        ));
    }
    dim_u32(what, experts)?;
    dim_u32(what, d)?;
    dim_u32(what, inter)?;
    Ok(())
}

/// Tile layouts of one expert's gate+up (`[I, D]` twice) and down (`[D, I]`) weights.
pub fn layouts(d: usize, inter: usize) -> (Layout, Layout) {
    (
        Layout {
            rows: inter,
            chunks: d / 32,
            gate_up: true,
        },
        Layout {
            rows: d,
            chunks: inter / 32,
            gate_up: false,
        },
    )
}

/// Packed per-expert shapes `[w13, s13, w2, s2]` in bytes.
fn packed_bytes(format: MoeFormat, d: usize, inter: usize) -> [usize; 4] {
    let (up, down) = layouts(d, inter);
    let unit = format.scale_unit();
    [
        up.slots() * 16,
        up.slots() * unit,
        down.slots() * 16,
        down.slots() * unit,
    ]
}

impl MoeExperts {
    /// Validates the experts' weights, copies them to the device and repacks and stacks them
    /// there ([`Self::load`] through a stager of its own). `D` and `I` must be multiples of 32,
    /// `I` at most [`MAX_INTER`] and the experts at most [`MAX_EXPERTS`]; MXFP4 scale bytes at
    /// most
    /// [`super::gemv::MXFP4_MAX_SCALE_BYTE`].
    pub fn upload(
        dev: &Device,
        host: HostExperts<'_>,
        d: usize,
        inter: usize,
    ) -> Result<MoeExperts, GpuError> {
        let experts: Vec<[HostWeight<'_>; 3]> = match host {
            HostExperts::Nvfp4 { w1, w3, w2 } => {
                same_expert_counts("nvfp4 experts", w1.len(), w3.len(), w2.len())?;
                (0..w1.len())
                    .map(|e| [&w1[e], &w3[e], &w2[e]].map(HostWeight::from))
                    .collect()
            }
            HostExperts::Mxfp4 { w1, w3, w2 } => {
                same_expert_counts("mxfp4 experts", w1.len(), w3.len(), w2.len())?;
                (0..w1.len())
                    .map(|e| [&w1[e], &w3[e], &w2[e]].map(HostWeight::from))
                    .collect()
            }
        };
        let bytes = packed_bytes(MoeFormat::Nvfp4, d, inter)
            .iter()
            .sum::<usize>();
        let mut st = Stager::for_bytes(dev, bytes.saturating_mul(experts.len()))?;
        MoeExperts::load(&mut st, &experts, d, inter)
    }

    /// Experts `[w1, w3, w2]` (all NVFP4 or all MXFP4) copied up through `st` and repacked and
    /// stacked on the device. As [`Self::upload`].
    pub fn load(
        st: &mut Stager<'_>,
        experts: &[[HostWeight<'_>; 3]],
        d: usize,
        inter: usize,
    ) -> Result<MoeExperts, GpuError> {
        let format = match experts.first().map(|e| &e[0]) {
            Some(HostWeight::Mxfp4 { .. }) => MoeFormat::Mxfp4,
            _ => MoeFormat::Nvfp4,
        };
        let what = format!("{} experts", format.name());
        let e = experts.len();
        check_dims(&what, e, d, inter)?;
        let unit = format.scale_unit();
        // (codes, scales, global scale) of each matrix, checked.
        type Mat<'a> = (&'a [u8], &'a [u8], f32);
        let mats: Vec<[Mat<'_>; 3]> = experts
            .par_iter()
            .enumerate()
            .map(|(i, ws)| {
                let mut out = [(&[][..], &[][..], 1.0); 3];
                for (j, (w, o)) in ws.iter().zip(&mut out).enumerate() {
                    let ctx = || format!("{what}: expert {i} {}", ["w1", "w3", "w2"][j]);
                    *o =
                        match (*w, format) {
                            (
                                HostWeight::Nvfp4 {
                                    weight,
                                    weight_scale,
                                    weight_scale_2,
                                },
                                MoeFormat::Nvfp4,
                            ) => {
                                if !weight_scale_2.is_finite() {
                                    return Err(invalid(
                                        &ctx(),
                                        format!("weight_scale_2 {weight_scale_2} is not finite"),
                                    ));
                                }
                                (weight, weight_scale, weight_scale_2)
                            }
                            (HostWeight::Mxfp4 { weight, scale }, MoeFormat::Mxfp4) => {
                                check_mxfp4_scales(&ctx(), scale)?;
                                (weight, scale, 1.0)
                            }
                            _ => return Err(invalid(
                                &ctx(),
                                "not in the format of expert 0 w1 (experts are all NVFP4 or all \
                                 MXFP4)",
                            )),
                        };
                    let (codes, scales) = (d * inter / 2, d * inter / format.scale_block());
                    if o.0.len() != codes || o.1.len() != scales {
                        return Err(invalid(
                            &ctx(),
                            format!(
                                "{} code and {} scale bytes where D = {d}, I = {inter} needs \
                                 {codes} and {scales}",
                                o.0.len(),
                                o.1.len()
                            ),
                        ));
                    }
                }
                Ok(out)
            })
            .collect::<Result<_, GpuError>>()?;
        let (up, down) = layouts(d, inter);
        let sizes = packed_bytes(format, d, inter);
        let dev = st.device();
        let [w13, s13, w2, s2] = sizes.map(|b| dev.alloc::<u8>(DType::U8, &[e, b]));
        let (mut w13, mut s13, mut w2, mut s2) = (w13?, s13?, w2?, s2?);
        // Experts' matrices stacked row-wise end on whole tiles (I and D are multiples of 32),
        // so all experts' tiles are packed at once, expert after expert.
        let pick = |j: usize, codes: bool| -> Vec<&[u8]> {
            mats.iter()
                .map(|m| if codes { m[j].0 } else { m[j].1 })
                .collect()
        };
        let (up, down) = ([up, down])
            .map(|l| Layout {
                rows: l.rows * e,
                ..l
            })
            .into();
        let targets = [
            (&mut w13, &up, 16, CodeOrder::Fp4, true),
            (&mut s13, &up, unit, CodeOrder::Plain, false),
            (&mut w2, &down, 16, CodeOrder::Fp4, true),
            (&mut s2, &down, unit, CodeOrder::Plain, false),
        ];
        for (t, layout, unit, order, codes) in targets {
            // W1 (W3) for gate+up, W2 otherwise.
            let (w, w3) = if layout.gate_up {
                (pick(0, codes), pick(1, codes))
            } else {
                (pick(2, codes), vec![])
            };
            super::relayout::pack_from_host(st, t, 0, layout, unit, order, &w, &w3)?;
        }
        let globals = match format {
            MoeFormat::Nvfp4 => {
                let g = |j: usize| {
                    let v: Vec<f32> = mats.iter().map(|m| m[j].2).collect();
                    dev.upload(DType::F32, &[e], &v)
                };
                Some([g(0)?, g(1)?, g(2)?])
            }
            MoeFormat::Mxfp4 => None,
        };
        Ok(MoeExperts {
            format,
            experts: e,
            d,
            inter,
            w13,
            s13,
            w2,
            s2,
            globals,
        })
    }

    /// `experts` random experts generated on the device (see
    /// [`super::gemv::GemvWeight::random`]): random FP4 codes, scales that give rows of RMS
    /// `1/sqrt(fan_in)`. Same requirements as [`Self::upload`].
    pub fn random(
        dev: &Device,
        format: MoeFormat,
        experts: usize,
        d: usize,
        inter: usize,
        seed: u64,
    ) -> Result<MoeExperts, GpuError> {
        let what = format!("random {} experts", format.name());
        check_dims(&what, experts, d, inter)?;
        let [b13, bs13, b2, bs2] = packed_bytes(format, d, inter);
        let rms = random::e2m1_rms();
        let codes = |bytes: usize, seed: u64| -> Result<DeviceTensor<u8>, GpuError> {
            let mut t = dev.alloc::<u8>(DType::U8, &[experts, bytes])?;
            random::fill_bytes(dev, &mut t, seed, random::Bytes::ANY)?;
            Ok(t)
        };
        let scales = |bytes: usize, byte: u8| -> Result<DeviceTensor<u8>, GpuError> {
            let mut t = dev.alloc::<u8>(DType::U8, &[experts, bytes])?;
            dev.fill_bytes(&mut t, byte)?;
            Ok(t)
        };
        let (w13, w2) = (codes(b13, seed)?, codes(b2, seed ^ 0x5555)?);
        let (s13, s2, globals) = match format {
            // Block scales 1.0 (e4m3 0x38); the global scales carry the magnitude.
            MoeFormat::Nvfp4 => {
                let global = |k: usize| {
                    let g = vec![random::unit_scale(rms, k); experts];
                    dev.upload(DType::F32, &[experts], &g)
                };
                (
                    scales(bs13, 0x38)?,
                    scales(bs2, 0x38)?,
                    Some([global(d)?, global(d)?, global(inter)?]),
                )
            }
            MoeFormat::Mxfp4 => {
                let byte = |k| random::unit_scale_e8m0(rms, k).min(MXFP4_MAX_SCALE_BYTE);
                (scales(bs13, byte(d))?, scales(bs2, byte(inter))?, None)
            }
        };
        MoeExperts::from_parts(format, d, inter, w13, s13, w2, s2, globals)
    }

    /// Experts from already packed, stacked device tensors (U8 `[E, bytes]`, as
    /// [`Self::upload`] makes them with [`layouts`] and [`CodeOrder::Fp4`] codes): `w13` and
    /// `s13` for gate+up, `w2` and
    /// `s2` for down, and for NVFP4 the global scales `[w1, w3, w2]`, each F32 `[E]`. MXFP4
    /// scale bytes are not read back here; bytes above [`super::gemv::MXFP4_MAX_SCALE_BYTE`]
    /// give non-finite outputs.
    #[allow(clippy::too_many_arguments)]
    pub fn from_parts(
        format: MoeFormat,
        d: usize,
        inter: usize,
        w13: DeviceTensor<u8>,
        s13: DeviceTensor<u8>,
        w2: DeviceTensor<u8>,
        s2: DeviceTensor<u8>,
        globals: Option<[DeviceTensor<f32>; 3]>,
    ) -> Result<MoeExperts, GpuError> {
        let what = format!("{} experts", format.name());
        let e = w13.shape().first().copied().unwrap_or(0);
        check_dims(&what, e, d, inter)?;
        let sizes = packed_bytes(format, d, inter);
        for ((t, name), bytes) in [(&w13, "w13"), (&s13, "s13"), (&w2, "w2"), (&s2, "s2")]
            .into_iter()
            .zip(sizes)
        {
            t.expect(name, DType::U8, &[e, bytes])?;
        }
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
            w13,
            s13,
            w2,
            s2,
            globals,
        })
    }

    /// The stacked device buffers `[w13, s13, w2, s2]`, copied back (tests compare them with
    /// [`reference::packed`]).
    pub fn download(&self, dev: &Device) -> Result<[Vec<u8>; 4], GpuError> {
        Ok([
            dev.download(&self.w13)?,
            dev.download(&self.s13)?,
            dev.download(&self.w2)?,
            dev.download(&self.s2)?,
        ])
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

    /// Checkpoint bytes of one expert (w1 + w3 + w2 codes and scales, without tile padding).
    pub fn expert_bytes(&self) -> usize {
        let per_matrix = self.d * self.inter / 2 + self.d * self.inter / self.format.scale_block();
        3 * per_matrix + if self.globals.is_some() { 12 } else { 0 }
    }
}

/// The MoE output: bf16, or f32 (e.g. for a residual stream kept in f32), or added to the
/// f32 values already there (one f32 add each: e.g. onto the shared expert's output).
pub enum MoeOut<'a> {
    Bf16(&'a mut DeviceTensor<bf16>),
    F32(&'a mut DeviceTensor<f32>),
    F32Add(&'a mut DeviceTensor<f32>),
}

/// Kernel arguments; mirrors `struct MoeArgs` in moe.cu field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct MoeArgs {
    x: u64,
    ids: u64,
    weights: u64,
    w13: u64,
    s13: u64,
    w2: u64,
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
    up_wpt: u32,
    stage: u32,
}

// SAFETY: plain #[repr(C)] data with the exact layout of the CUDA struct.
unsafe impl DeviceRepr for MoeArgs {}

/// Routed experts for `x [M, D]`: `ids` I32 `[M, top_k]` and `weights` F32 `[M, top_k]` (the
/// router's choices, on the device), `h` BF16 `[M, top_k, I]` scratch (reserve it in the
/// pool), `out [M, D] = Σⱼ weights[t, j] · expert(ids[t, j], x[t])` with the clamped SwiGLU
/// (`limit` = swiglu_limit). Two launches; `between` runs after the first (gate+up) and before
/// the second (down), which writes `out` (e.g. a join of the stream that wrote what
/// [`MoeOut::F32Add`] adds onto). Nothing is read back.
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
    between: impl FnOnce() -> Result<(), GpuError>,
) -> Result<(), GpuError> {
    let (m, d, topk) = check_routing(
        ("moe", "moe_decode"),
        x,
        ids,
        weights,
        experts.d,
        limit,
        (MAX_M, MAX_PAIRS),
    )?;
    h.expect("moe intermediate h", DType::BF16, &[m, topk, experts.inter])?;
    let (out_addr, out_suffix) = match out {
        MoeOut::Bf16(t) => {
            t.expect("moe output", DType::BF16, &[m, d])?;
            (t.device_address(), "")
        }
        MoeOut::F32(t) => {
            t.expect("moe output", DType::F32, &[m, d])?;
            (t.device_address(), "_f32")
        }
        MoeOut::F32Add(t) => {
            t.expect("moe output", DType::F32, &[m, d])?;
            (t.device_address(), "_f32add")
        }
    };
    let g = |i: usize| {
        experts
            .globals
            .as_ref()
            .map_or(0, |g| g[i].device_address())
    };
    let fmt = experts.format.name();
    let gate_up = format!("moe_gate_up_{fmt}");
    let down = format!("moe_down_{fmt}{out_suffix}");
    // Gate+up: 8-row tiles of the intermediate, one set per (token, slot) pair (only the pairs
    // that compute an expert for eight of its tokens work; the rest exit at once), each tile's
    // K split over up_wpt warps so that top_k experts' tiles fill the GPU once. The split
    // depends on the shapes only, so a token's result does not depend on the other tokens.
    let up_tiles = experts.inter.div_ceil(8);
    let up_steps = (d / 32).div_ceil(16);
    let up_resident = resident_warps(dev, &gate_up, (UP_WARPS * 32) as u32)?;
    let up_wpt = [4, 2, 1]
        .into_iter()
        .find(|&w| w <= up_steps && up_tiles * topk * w <= up_resident)
        .unwrap_or(1);
    let mut args = MoeArgs {
        x: x.device_address(),
        ids: ids.device_address(),
        weights: weights.device_address(),
        w13: experts.w13.device_address(),
        s13: experts.s13.device_address(),
        w2: experts.w2.device_address(),
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
        up_wpt: up_wpt as u32,
        stage: 0,
    };
    let up_blocks = dim_u32("moe tiles", up_tiles.div_ceil(UP_WARPS / up_wpt))?;
    // Down: one block per 16-row output tile, 8 warps while all blocks stay resident.
    let tiles = d.div_ceil(16);
    let mut warps = DOWN_WARPS[1];
    for w in DOWN_WARPS {
        if tiles * w <= resident_warps(dev, &down, (w * 32) as u32)? {
            warps = w;
            break;
        }
    }
    // Gate_up's activations staged in shared memory where that costs no resident blocks: the x
    // rows of the (at most eight) tokens an expert computes at once.
    let up_threads = (UP_WARPS * 32) as u32;
    let down_threads = (warps * 32) as u32;
    let up_shared = staging_bytes(dev, &gate_up, up_threads, 0, m.min(8) * d * 2)?;
    args.stage = u32::from(up_shared > 0);
    // One token's blocks all work: held to as many an SM as the grid needs (by shared memory),
    // no SM takes more than its share, as it may under the register cap of four (H200, 12
    // Flash layers: gate+up 24.5 -> 21.4 us after its wait; 24 layers 3.317 -> 3.270 ms a
    // token). A batch's working blocks depend on the routing, so batches launch as before.
    let up_dynamic = if m == 1 {
        let per_sm = (up_blocks as usize * topk).div_ceil(dev.sm_count());
        shared_for_at_most(dev, &gate_up, up_threads, up_shared, per_sm as u32)?
    } else {
        up_shared
    };
    // The down kernel launches with programmatic serialization (as the GEMVs, `tuning`): it
    // builds its routing tables and streams its first weights while gate_up finishes. Gate_up
    // launches plainly: it has nothing to load before its inputs are ready, and its blocks
    // started early only hold resources (H200: Flash 36.1 us this way, 40.5 with both under
    // programmatic serialization, 39.4 with neither; Pro 86.0, 84.4, 87.4). The plain launch
    // is also what lets down read the expert ids and routing weights before its wait: gate_up
    // starts only after the router has finished, so they are written by then.
    // SAFETY (both launches): MoeArgs mirrors the kernels' argument; every tensor was checked
    // against (E, D, I, M, top_k) above; the kernels bound-check expert ids and read/write
    // only inside those shapes.
    unsafe {
        launch_struct(
            dev,
            &gate_up,
            (up_blocks, (m * topk) as u32, 1),
            (up_threads, up_dynamic),
            &args,
            false,
            1,
        )
    }?;
    between()?;
    unsafe {
        launch_struct(
            dev,
            &down,
            (dim_u32("moe tiles", tiles)?, 1, 1),
            (down_threads, 0),
            &args,
            tuning::PROGRAMMATIC_LAUNCH.get(),
            1,
        )
    }
}

/// Scratch of [`moe_chunk`] for `m` tokens (views of pool buffers sized for the longest
/// chunk): each expert's list of (token, slot) pairs and its length, every pair's SwiGLU row
/// and down-projection row.
pub struct MoeChunkScratch {
    /// U32 `[experts, m · top_k]`.
    pub lists: DeviceTensor<u32>,
    /// U32 `[experts]`.
    pub counts: DeviceTensor<u32>,
    /// BF16 `[m, top_k, I]`.
    pub h: DeviceTensor<bf16>,
    /// F32 `[m · top_k, D]`.
    pub rows: DeviceTensor<f32>,
    /// BF16 `[m, D]`: x in the tensor-core kernels' k order (written where they run).
    pub xp: DeviceTensor<bf16>,
}

/// Whether [`moe_chunk`] over `m` tokens routed to `top_k` experts each runs the tensor-core
/// expert kernels (`_tc`: FP4 lists averaging more than 64 rows on sm_90a, D and I multiples
/// of 128).
pub fn chunk_on_tensor_cores(dev: &Device, m: usize, top_k: usize, experts: &MoeExperts) -> bool {
    let per_stack = rows_per_expert(m, top_k, experts.experts);
    fp4_tensor_lists(dev, per_stack, &[experts.d, experts.inter])
}

/// An expert's average share of a chunk's `m · top_k` rows (at most `m`).
fn rows_per_expert(m: usize, top_k: usize, experts: usize) -> usize {
    (m * top_k).div_ceil(experts).min(m)
}

/// Routed experts for a chunk of `x [M, D]` (any M): as [`moe_decode`] with its output added
/// onto the F32 `out [M, D]`, on the prefill GEMM. Four launches (five on the tensor-core
/// kernels): the experts' pair lists, gate+up into `scratch.h`, down into `scratch.rows`, then
/// (after `between`, e.g. a join of the stream that wrote `out`) each token's rows weighted and
/// summed in slot order onto `out`.
/// Where the lists run on the tensor-core kernels (long lists on sm_90a), x is first permuted
/// into `scratch.xp`, and h is kept in that order between them. A token's result depends only
/// on its own input and routing (and on which kernels the chunk's list lengths chose).
#[allow(clippy::too_many_arguments)]
pub fn moe_chunk(
    dev: &Device,
    x: &DeviceTensor<bf16>,
    ids: &DeviceTensor<i32>,
    weights: &DeviceTensor<f32>,
    experts: &MoeExperts,
    limit: f32,
    scratch: &mut MoeChunkScratch,
    out: &mut DeviceTensor<f32>,
    between: impl FnOnce() -> Result<(), GpuError>,
) -> Result<(), GpuError> {
    let (m, d, topk) = check_routing(
        ("moe", "moe_chunk"),
        x,
        ids,
        weights,
        experts.d,
        limit,
        (usize::MAX, usize::MAX),
    )?;
    let (e, inter) = (experts.experts, experts.inter);
    let pairs = m * topk;
    scratch
        .lists
        .expect("moe pair lists", DType::U32, &[e, pairs])?;
    scratch
        .counts
        .expect("moe list lengths", DType::U32, &[e])?;
    scratch
        .h
        .expect("moe intermediate h", DType::BF16, &[m, topk, inter])?;
    scratch
        .rows
        .expect("moe pair rows", DType::F32, &[pairs, d])?;
    out.expect("moe output", DType::F32, &[m, d])?;
    // SAFETY: ids [pairs]; lists [e, pairs] (no expert has more entries than there are
    // pairs); counts [e].
    unsafe {
        launch(
            dev,
            "moe_sort",
            LaunchConfig {
                grid_dim: (dim_u32("experts", e)?, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            },
            Args::new()
                .ptr(ids)
                .arg(dim_u32("moe pairs", pairs)?)
                .arg(dim_u32("moe list", pairs)?)
                .ptr(&scratch.lists)
                .ptr(&scratch.counts),
        )
    }?;
    let (up, down) = layouts(d, inter);
    let format = match experts.format {
        MoeFormat::Nvfp4 => GemvFormat::Nvfp4,
        MoeFormat::Mxfp4 => GemvFormat::Mxfp4,
    };
    let g = |i: usize| {
        experts
            .globals
            .as_ref()
            .map_or(0, |g| g[i].device_address())
    };
    let tensor = chunk_on_tensor_cores(dev, m, topk, experts);
    if tensor {
        scratch
            .xp
            .expect("moe permuted input", DType::BF16, &[m, d])?;
        let pieces = (m * d / 8) as u64;
        // SAFETY: x and xp [m, d], d a multiple of 128 (fp4_tensor_lists).
        unsafe {
            launch(
                dev,
                "fp4_k_permute",
                elementwise(pieces),
                Args::new()
                    .ptr(x)
                    .ptr(&scratch.xp)
                    .arg(dim_u32("moe tokens", m)?)
                    .arg(dim_u32("moe width", d)?),
            )
        }?;
    }
    // Row blocks as wide and as many side by side as an expert's share of the pairs needs (a
    // crowded list's blocks walk its further rows).
    let lists = |div| Rows::Lists {
        lists: &scratch.lists,
        counts: &scratch.counts,
        div,
        per_stack: rows_per_expert(m, topk, e),
        tensor,
    };
    let stack =
        |n: usize, k: usize, gate_up, codes: &DeviceTensor<u8>, scales: &DeviceTensor<u8>| Stack {
            format,
            n,
            k,
            gate_up,
            codes: codes.device_address(),
            scales: scales.device_address(),
            fp8: (0, 0),
            post: (65536.0, 65536.0),
            factors: (0, 0),
        };
    debug_assert_eq!((up.rows, down.rows), (inter, d));
    let w13 = Stack {
        factors: (g(0), g(1)),
        ..stack(inter, d, true, &experts.w13, &experts.s13)
    };
    let h = Output {
        address: scratch.h.device_address(),
        mode: 0,
    };
    launch_stacks(
        dev,
        "gemm_swiglu_",
        if tensor { &scratch.xp } else { x },
        d,
        &w13,
        e,
        lists(topk),
        limit,
        h,
        inter,
    )?;
    let w2 = Stack {
        factors: (g(2), g(2)),
        ..stack(d, inter, false, &experts.w2, &experts.s2)
    };
    let rows = Output {
        address: scratch.rows.device_address(),
        mode: 1,
    };
    launch_stacks(
        dev,
        "gemm_",
        &scratch.h,
        inter,
        &w2,
        e,
        lists(1),
        0.0,
        rows,
        d,
    )?;
    between()?;
    // SAFETY: ids and weights [m, topk], rows [pairs, d], out [m, d], checked above.
    unsafe {
        launch(
            dev,
            "moe_combine",
            grid_for((m * d) as u64, 1024, 256),
            Args::new()
                .ptr(ids)
                .ptr(weights)
                .ptr(&scratch.rows)
                .ptr(out)
                .arg(dim_u32("moe tokens", m)?)
                .arg(dim_u32("moe top-k", topk)?)
                .arg(dim_u32("moe width", d)?)
                .arg(dim_u32("experts", e)?),
        )
    }
}

/// f64 CPU reference on [`crate::codecs`] dequantization.
pub mod reference {
    use half::bf16;

    use super::{layouts, CodeOrder, MoeFormat};
    use crate::gpu::gemv::reference::{gemv, swiglu};
    use crate::gpu::gemv::HostWeight;
    use crate::gpu::relayout::reference::pack_tiles;
    use crate::gpu::GpuError;

    /// What [`super::MoeExperts::load`] puts on the device (`[w13, s13, w2, s2]`), computed on
    /// the host expert by expert: each expert's tiles, stacked.
    pub fn packed(
        experts: &[[HostWeight<'_>; 3]],
        format: MoeFormat,
        d: usize,
        inter: usize,
    ) -> Result<[Vec<u8>; 4], GpuError> {
        let (up, down) = layouts(d, inter);
        let unit = format.scale_unit();
        let (fp4, plain) = (CodeOrder::Fp4, CodeOrder::Plain);
        let mut out: [Vec<u8>; 4] = Default::default();
        for e in experts {
            let [(c1, s1), (c3, s3), (c2, s2)] = e.map(|w| match w {
                HostWeight::Nvfp4 {
                    weight,
                    weight_scale,
                    ..
                } => (weight, weight_scale),
                HostWeight::Mxfp4 { weight, scale } => (weight, scale),
                _ => (&[][..], &[][..]),
            });
            out[0].extend(pack_tiles(&up, 16, fp4, c1, c3)?);
            out[1].extend(pack_tiles(&up, unit, plain, s1, s3)?);
            out[2].extend(pack_tiles(&down, 16, fp4, c2, &[])?);
            out[3].extend(pack_tiles(&down, unit, plain, s2, &[])?);
        }
        Ok(out)
    }

    /// The expert an id selects in every MoE: ids outside `[0, experts)` select none.
    pub fn expert_index(id: i32, experts: usize) -> Option<usize> {
        usize::try_from(id).ok().filter(|&e| e < experts)
    }

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
                let Some(e) = expert_index(ids[t * topk + j], experts.len()) else {
                    continue;
                };
                let ex = &experts[e];
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

/// The routing arguments of a grouped-MoE launch, checked: `x` BF16 `[M, D]` with `D =
/// experts_d`, `ids` I32 and `weights` F32 `[M, top_k]`, `1 <= M <= max_m`, `M · top_k <=
/// max_pairs`, and a positive swiglu `limit`. Errors name the tensors `"{prefix} …"` and the
/// launch `op`. Returns `(M, D, top_k)`.
pub(super) fn check_routing(
    (prefix, op): (&str, &str),
    x: &DeviceTensor<bf16>,
    ids: &DeviceTensor<i32>,
    weights: &DeviceTensor<f32>,
    experts_d: usize,
    limit: f32,
    (max_m, max_pairs): (usize, usize),
) -> Result<(usize, usize, usize), GpuError> {
    let (m, d) = x.dims2(&format!("{prefix} input x"), DType::BF16)?;
    if d != experts_d {
        return Err(invalid(
            &format!("{prefix} input x"),
            format!("width {d}, experts take {experts_d}"),
        ));
    }
    let (mi, topk) = ids.dims2(&format!("{prefix} expert ids"), DType::I32)?;
    weights.expect(
        &format!("{prefix} routing weights"),
        DType::F32,
        &[mi, topk],
    )?;
    if mi != m || m == 0 || m > max_m || topk == 0 || m * topk > max_pairs {
        return Err(invalid(
            op,
            format!(
                "{m} tokens with ids [{mi}, {topk}]: 1..={max_m} tokens, M * top_k <= {max_pairs}"
            ),
        ));
    }
    if limit.is_nan() || limit <= 0.0 {
        return Err(invalid(
            op,
            format!("swiglu limit {limit} must be positive"),
        ));
    }
    Ok((m, d, topk))
}

/// w1, w3 and w2 must list the same experts.
pub(super) fn same_expert_counts(
    what: &str,
    w1: usize,
    w3: usize,
    w2: usize,
) -> Result<(), GpuError> {
    if w1 == w3 && w1 == w2 {
        Ok(())
    } else {
        Err(invalid(
            what,
            format!("{w1} / {w3} / {w2} experts in w1 / w3 / w2"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args_layout_matches_the_cuda_struct() {
        // 12 pointers, 5 u32, one f32 and 2 u32.
        assert_eq!(std::mem::size_of::<MoeArgs>(), 128);
    }

    #[test]
    fn shapes_past_the_kernels_bounds_are_refused_by_name() {
        assert!(check_dims("experts", MAX_EXPERTS, 4096, MAX_INTER).is_ok());
        for (experts, d, inter, names) in [
            (MAX_EXPERTS + 1, 4096, 2048, "at most 4096 experts"),
            (256, 4096, MAX_INTER + 32, "I at most 16384"),
            (0, 4096, 2048, "all positive"),
            (256, 4100, 2048, "multiples of 32"),
        ] {
            let err = check_dims("nvfp4 experts", experts, d, inter)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("nvfp4 experts") && err.contains(names),
                "{experts} experts, D = {d}, I = {inter}: {err}"
            );
        }
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
