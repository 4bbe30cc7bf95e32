//! Decode GEMV / small-M GEMM launchers (`kernels/gemv.cu`): `y[M, N] = x[M, K] · W[N, K]ᵀ`
//! for `M <= 16` bf16 activation rows (more rows run the prefill GEMM of `kernels/gemm.cu` on
//! the same weights, through the same functions), with weights in BF16, FP8 e4m3 with block scales,
//! NVFP4 or MXFP4, dequantized in registers (W4A16 / W8A16 on tensor cores; FP8 runs on the f16
//! MMA with activations converted to f16, exact for `|x|` in `[2^-14, 65504]` and 0, but for the
//! prefill GEMM on sm_90a, which splits each activation into two e4m3 codes). The fused
//! [`gemv_swiglu`] computes `silu(min(x·W1ᵀ, L)) · clamp(x·W3ᵀ, −L, L)` in one pass.
//! Weights are repacked once, at upload, into the kernels' tile layout ([`pack`] describes it
//! and is the CPU reference of the device re-layout in [`super::relayout`]; [`pack::unpack`] is
//! its inverse).
//!
//! Launchers check every shape and enqueue on the device stream without synchronizing or
//! reading back, so they can be captured into CUDA graphs. They launch with programmatic
//! dependent launch: a kernel starts while its predecessor finishes and streams its first
//! weights before it waits for that predecessor's outputs. Matrices with few rows split K
//! across warps through a [`GemvWorkspace`] (reserve it in the [`BufferPool`]); the split
//! partials are summed in a fixed order, so results never depend on timing. CPU references:
//! [`mod@reference`].

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use cudarc::driver::DeviceRepr;
use dsv4_kernels::GEMV_FP8_RING;
use half::bf16;

use super::gemm;
use super::launch::{dim_u32, launch_struct};
use super::random;
use super::relayout;
use super::rows::ActElem;
use super::{BufferPool, DType, Device, DeviceTensor, GpuError, Reservation, Stager};
use crate::codecs::fp8_block::ScaleFormat;
use crate::codecs::mxfp4::Mxfp4Quantized;
use crate::codecs::nvfp4::Nvfp4Quantized;

/// Most activation rows the GEMV kernels take; launches with more run the prefill GEMM.
pub const MAX_M: usize = 16;

/// Largest MXFP4 scale byte the kernels take: 2^17. Larger block scales would overflow the
/// bf16 operand the kernel builds (scale · 2^110); no real weight comes near it.
pub const MXFP4_MAX_SCALE_BYTE: u8 = 144;

/// Warps of a GEMV block (one (tile, K range) item each) when it holds ranges of several tiles.
pub(crate) const MIN_BLOCK_WARPS: usize = 4;

/// Most warps of a GEMV block: up to 16 K ranges of one tile are summed in shared memory
/// (`MAX_BLOCK_WARPS` in gemv_tile.cu).
pub(crate) const MAX_BLOCK_WARPS: usize = 16;

/// Launch settings, process-wide. The defaults are the engine's; the decode benchmark varies
/// them to compare configurations within one run.
pub mod tuning {
    use super::*;

    static WARPS_PER_SM: AtomicUsize = AtomicUsize::new(0);

    /// Warps per multiprocessor that a GEMV grid (with its K splits) aims for; 0 (the default)
    /// takes as many as the kernel can keep resident, one full wave. FP8 and FP4 may use fewer to
    /// keep their K ranges two steps long (`plan`).
    pub fn set_warps_per_sm(warps: usize) {
        WARPS_PER_SM.store(warps, Ordering::Relaxed);
    }

    pub fn warps_per_sm() -> usize {
        WARPS_PER_SM.load(Ordering::Relaxed)
    }

    /// A launch choice that is on unless a benchmark or test turns it off.
    pub struct Switch(AtomicBool);

    impl Switch {
        const fn on() -> Switch {
            Switch(AtomicBool::new(true))
        }

        pub fn set(&self, on: bool) {
            self.0.store(on, Ordering::Relaxed);
        }

        pub fn get(&self) -> bool {
            self.0.load(Ordering::Relaxed)
        }
    }

    /// Kernels launch with programmatic stream serialization (`launch`'s module docs).
    pub static PROGRAMMATIC_LAUNCH: Switch = Switch::on();

    /// GEMV and MoE kernels may stage their activations in shared memory (they read them from
    /// global memory otherwise; the results are the same bits).
    pub static STAGING: Switch = Switch::on();

    /// A GEMV whose tiles span 2..=8 blocks may sum them inside a thread-block cluster (sm_90
    /// and later; the same bits as the workspace path).
    pub static CLUSTER_SUM: Switch = Switch::on();

    /// A GEMV whose tiles would sum across blocks, one K range a block, may instead give each
    /// tile one block of 5..=15 warps, one per range (the same bits).
    pub static WHOLE_TILE_BLOCKS: Switch = Switch::on();

    /// An FP8 launch of more than 16 rows on sm_90a (scale blocks of 128 columns or a multiple)
    /// runs `gemm_fp8_tc` (`kernels/gemm_fp8.cu`: activations split into two e4m3 codes, both
    /// operands in shared memory on warpgroup MMAs; other rounding) instead of `gemm_fp8`.
    pub static FP8_TENSOR_GEMM: Switch = Switch::on();

    /// A chunk's FP4 expert lists averaging more than 64 rows on sm_90a (K a multiple of 128)
    /// run the `_tc` kernels (`kernels/gemm.cu`: the weights expanded in registers as the A
    /// operand of warpgroup MMAs over 128 rows; other summation order) instead of the 64-row
    /// blocks.
    pub static FP4_TENSOR_GEMM: Switch = Switch::on();

    /// An FP8 GEMV at M = 1 whose activations are staged may stage them prescaled
    /// (`gemv_*fp8_m1`: the block scales folded into f16 activations; other rounding).
    pub static PRESCALED: Switch = Switch::on();

    /// `attention_heads` gives each warp two buffers of keys in shared memory where they fit
    /// (one otherwise; the same bits either way).
    pub static ATTENTION_DOUBLE_BUFFER: Switch = Switch::on();

    /// `attention_heads` splits a decode token's keys over a cluster of blocks that fill the
    /// SMs (sm_90 and later; one block a token and head group otherwise, other rounding).
    pub static ATTENTION_SPLITS: Switch = Switch::on();

    static ATTENTION_MMA_KEYS: AtomicUsize = AtomicUsize::new(2048);

    /// In an attention launch of fewer than 17 tokens (decode), a token that sees at least
    /// this many keys runs on tensor cores (`attention_mma`, its keys split over blocks that
    /// fill the SMs; on an H100 about 47 µs for 64 heads over 8k keys against 120 on CUDA
    /// cores, and slower than them over 1,152: bench4 after 128k positions 1.054 ms/token with
    /// 2048, 1.086 with 1024), where its block fits the GPU's shared memory. Default 2048; 0
    /// takes every token there, `usize::MAX` none.
    pub fn set_attention_mma_keys(keys: usize) {
        ATTENTION_MMA_KEYS.store(keys, Ordering::Relaxed);
    }

    pub fn attention_mma_keys() -> usize {
        ATTENTION_MMA_KEYS.load(Ordering::Relaxed)
    }
}

/// A weight's number format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemvFormat {
    Bf16,
    /// e4m3 with one scale per `block.0 x block.1` tile.
    Fp8 {
        scale: ScaleFormat,
        block: (usize, usize),
    },
    Nvfp4,
    Mxfp4,
}

impl GemvFormat {
    pub(crate) fn name(self) -> &'static str {
        match self {
            GemvFormat::Bf16 => "bf16",
            GemvFormat::Fp8 { .. } => "fp8",
            GemvFormat::Nvfp4 => "nvfp4",
            GemvFormat::Mxfp4 => "mxfp4",
        }
    }

    fn code_order(self) -> pack::CodeOrder {
        match self {
            GemvFormat::Bf16 | GemvFormat::Fp8 { .. } => pack::CodeOrder::Plain,
            GemvFormat::Nvfp4 | GemvFormat::Mxfp4 => pack::CodeOrder::Fp4,
        }
    }

    /// Elements per 16-byte chunk: K must be a multiple (rows start 16-byte aligned).
    pub(crate) fn chunk_elems(self) -> usize {
        match self {
            GemvFormat::Bf16 => 8,
            GemvFormat::Fp8 { .. } => 16,
            GemvFormat::Nvfp4 | GemvFormat::Mxfp4 => 32,
        }
    }
}

/// Host-side weight data in checkpoint layout, for [`GemvWeight::upload`] and the references.
#[derive(Debug, Clone, Copy)]
pub enum HostWeight<'a> {
    /// `[n, k]` row-major.
    Bf16(&'a [bf16]),
    /// e4m3 `weight [n, k]`; `scale` raw bytes `[ceil(n/block.0), ceil(k/block.1)]`
    /// (e8m0 bytes, or little-endian f32).
    Fp8 {
        weight: &'a [u8],
        scale: &'a [u8],
        format: ScaleFormat,
        block: (usize, usize),
    },
    /// Packed e2m1 `[n, k / 2]`, e4m3 scales `[n, k / 16]` and the global scale.
    Nvfp4 {
        weight: &'a [u8],
        weight_scale: &'a [u8],
        weight_scale_2: f32,
    },
    /// Packed e2m1 `[n, k / 2]` and e8m0 scales `[n, k / 32]`.
    Mxfp4 { weight: &'a [u8], scale: &'a [u8] },
}

impl<'a> From<&'a Nvfp4Quantized> for HostWeight<'a> {
    fn from(q: &'a Nvfp4Quantized) -> HostWeight<'a> {
        HostWeight::Nvfp4 {
            weight: &q.weight,
            weight_scale: &q.weight_scale,
            weight_scale_2: q.weight_scale_2,
        }
    }
}

impl<'a> From<&'a Mxfp4Quantized> for HostWeight<'a> {
    fn from(q: &'a Mxfp4Quantized) -> HostWeight<'a> {
        HostWeight::Mxfp4 {
            weight: &q.weight,
            scale: &q.scale,
        }
    }
}

/// The tile layout the kernels read (see `kernels/gemv_tile.cu`): a tile is 16 weight rows
/// (plain: rows 16t..16t+15; gate+up: W1 rows 8t..8t+7, then W3 rows 8t..8t+7), split into K
/// steps of 16 chunks of 16 bytes; slot `((((t * S + s) * 4 + u) * 2 + h) * 32 + l)` holds chunk
/// `16s + 4u + l % 4` of tile row `l / 4 + 8h`. Rows and K are zero-padded to whole tiles and
/// steps. NVFP4/MXFP4 scales are packed slot for slot (2 or 1 bytes per chunk), so every
/// warp-wide load of codes reads 512 contiguous bytes and a tile is one contiguous region.
pub mod pack {
    use crate::gpu::GpuError;

    /// Chunks one lane takes per row in a step.
    pub const U: usize = 4;
    /// Chunks per row in a step (4 lanes x U).
    pub const STEP_CHUNKS: usize = 4 * U;

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Layout {
        /// Rows of the source matrix (of each of W1 and W3 for gate+up).
        pub rows: usize,
        /// 16-byte chunks per source row.
        pub chunks: usize,
        /// Interleave W1 (tile rows 0-7) and W3 (tile rows 8-15).
        pub gate_up: bool,
    }

    impl Layout {
        pub fn tiles(&self) -> usize {
            self.rows.div_ceil(if self.gate_up { 8 } else { 16 })
        }

        pub fn steps(&self) -> usize {
            self.chunks.div_ceil(STEP_CHUNKS)
        }

        /// Chunk slots of the packed tensor (its bytes are `slots * unit`): 16 rows x 16
        /// chunks per tile and step.
        pub fn slots(&self) -> usize {
            self.tiles() * self.steps() * STEP_CHUNKS * 16
        }

        /// `(matrix, row, chunk)` that slot `i` holds (matrix 1 = W3), or None for padding.
        pub fn source(&self, i: usize) -> Option<(usize, usize, usize)> {
            let l = i % 32;
            let h = (i / 32) % 2;
            let u = (i / 64) % U;
            let s = (i / (64 * U)) % self.steps();
            let t = i / (64 * U * self.steps());
            let c = STEP_CHUNKS * s + 4 * u + l % 4;
            let (m, r) = if self.gate_up {
                (h, 8 * t + l / 4)
            } else {
                (0, 16 * t + 8 * h + l / 4)
            };
            (r < self.rows && c < self.chunks).then_some((m, r, c))
        }
    }

    fn check(layout: &Layout, unit: usize, what: &str, len: usize) -> Result<(), GpuError> {
        let want = layout.rows * layout.chunks * unit;
        if len == want {
            Ok(())
        } else {
            Err(GpuError::invalid(
                what,
                format!(
                    "{len} bytes where [{}, {}] x {unit} needs {want}",
                    layout.rows, layout.chunks
                ),
            ))
        }
    }

    /// Packs row-major sources (`unit` bytes per 16-byte chunk: 16 for codes, 2 for NVFP4 and 1
    /// for MXFP4 scales). `w3` is the up projection of a gate+up layout and must be empty
    /// otherwise.
    pub fn pack(layout: &Layout, unit: usize, w: &[u8], w3: &[u8]) -> Result<Vec<u8>, GpuError> {
        check(layout, unit, "pack: w", w.len())?;
        if layout.gate_up {
            check(layout, unit, "pack: w3", w3.len())?;
        } else if !w3.is_empty() {
            return Err(GpuError::invalid("pack", "a plain layout takes one matrix"));
        }
        let row = layout.chunks * unit;
        let mut out = vec![0u8; layout.slots() * unit];
        for (i, dst) in out.chunks_exact_mut(unit).enumerate() {
            if let Some((m, r, c)) = layout.source(i) {
                let src = if m == 0 { w } else { w3 };
                dst.copy_from_slice(&src[r * row + c * unit..][..unit]);
            }
        }
        Ok(out)
    }

    /// How codes are ordered inside each 32-bit word of a packed tile, so that the kernel turns
    /// a word into bf16 pairs of consecutive elements (matching activations in natural order)
    /// with few instructions.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum CodeOrder {
        /// As in the checkpoint (BF16; FP8, whose byte pairs convert to f16 pairs in hardware).
        Plain,
        /// e2m1 codes bit-permuted: see [`fp4_source_bit`].
        Fp4,
    }

    /// Where bit `b` of a packed FP4 word comes from: `(element, code bit)` of the checkpoint
    /// word (element `e` is nibble `e`; code bit 3 is the sign). The kernel forms pair `k`
    /// (elements 2k, 2k + 1) as bf16 bits `(s, e1 e0 m)` at 15, 8..6 and 31, 24..22 by
    /// `rotr(w, 2) & M`, `rotr(w, 6) & M`, `rotr(w, 12) & M` for k = 0, 1, 2 (M = 0x81c081c0)
    /// and `(w & 0x80c080c0) | (rotr(w, 8) & 0x01000100)` for k = 3.
    pub fn fp4_source_bit(b: u32) -> (u32, u32) {
        // Target bit of a pair (position in the bf16x2 word) -> (half, code bit).
        let target = |t: u32| -> Option<(u32, u32)> {
            match t {
                6 => Some((0, 0)),
                7 => Some((0, 1)),
                8 => Some((0, 2)),
                15 => Some((0, 3)),
                22 => Some((1, 0)),
                23 => Some((1, 1)),
                24 => Some((1, 2)),
                31 => Some((1, 3)),
                _ => None,
            }
        };
        // Pairs 0-2: packed bit b lands on target (b - shift) mod 32.
        for (k, shift) in [(0u32, 2u32), (1, 6), (2, 12)] {
            if let Some((half, bit)) = target((b + 32 - shift) % 32) {
                return (2 * k + half, bit);
            }
        }
        // Pair 3: in place, except targets 8 and 24, which come from bits 16 and 0.
        let t = match b {
            16 => 8,
            0 => 24,
            _ => b,
        };
        let (half, bit) = target(t).expect("the four pairs cover every bit");
        (6 + half, bit)
    }

    fn encode_word(order: CodeOrder, w: u32) -> u32 {
        match order {
            CodeOrder::Plain => w,
            CodeOrder::Fp4 => (0..32).fold(0, |acc, b| {
                let (e, bit) = fp4_source_bit(b);
                acc | (((w >> (4 * e + bit)) & 1) << b)
            }),
        }
    }

    fn decode_word(order: CodeOrder, w: u32) -> u32 {
        match order {
            CodeOrder::Plain => w,
            CodeOrder::Fp4 => (0..32).fold(0, |acc, b| {
                let (e, bit) = fp4_source_bit(b);
                acc | (((w >> b) & 1) << (4 * e + bit))
            }),
        }
    }

    fn map_words(order: CodeOrder, bytes: &mut [u8], f: fn(CodeOrder, u32) -> u32) {
        if order == CodeOrder::Plain {
            return;
        }
        for c in bytes.chunks_exact_mut(4) {
            let w = f(order, u32::from_le_bytes([c[0], c[1], c[2], c[3]]));
            c.copy_from_slice(&w.to_le_bytes());
        }
    }

    /// Reorders the codes inside every 32-bit word of packed code bytes (a multiple of 16).
    pub fn encode_codes(order: CodeOrder, packed: &mut [u8]) {
        map_words(order, packed, encode_word);
    }

    /// The inverse of [`encode_codes`].
    pub fn decode_codes(order: CodeOrder, packed: &mut [u8]) {
        map_words(order, packed, decode_word);
    }

    /// The inverse of [`pack`]: `(w, w3)` row-major (`w3` empty for a plain layout).
    pub fn unpack(
        layout: &Layout,
        unit: usize,
        packed: &[u8],
    ) -> Result<(Vec<u8>, Vec<u8>), GpuError> {
        if packed.len() != layout.slots() * unit {
            return Err(GpuError::invalid(
                "unpack",
                format!(
                    "{} bytes where {} are packed",
                    packed.len(),
                    layout.slots() * unit
                ),
            ));
        }
        let row = layout.chunks * unit;
        let n = layout.rows * row;
        let mut w = vec![0u8; n];
        let mut w3 = vec![0u8; if layout.gate_up { n } else { 0 }];
        for (i, src) in packed.chunks_exact(unit).enumerate() {
            if let Some((m, r, c)) = layout.source(i) {
                let dst = if m == 0 { &mut w } else { &mut w3 };
                dst[r * row + c * unit..][..unit].copy_from_slice(src);
            }
        }
        Ok((w, w3))
    }
}

/// A device-resident weight for [`gemv`] (`W [n, k]`) or [`gemv_swiglu`] (`W1, W3 [n, k]`),
/// repacked into the kernels' tile layout ([`pack`]) when uploaded.
pub struct GemvWeight {
    pub(crate) format: GemvFormat,
    pub(crate) n: usize,
    pub(crate) k: usize,
    pub(crate) gate_up: bool,
    pub(crate) codes: DeviceTensor<u8>,
    /// NVFP4/MXFP4 packed scales.
    pub(crate) scales: Option<DeviceTensor<u8>>,
    /// FP8 scales of W (W1) and, for gate+up, W3: f32, one per 64 columns
    /// (`[ceil(n / block.0), ceil(k / 64)]`).
    fp8: Option<(DeviceTensor<f32>, Option<DeviceTensor<f32>>)>,
    /// Epilogue multipliers of W (W1) and W3 rows.
    pub(crate) post: (f32, f32),
    /// Checkpoint bytes: codes and scales, unpadded.
    bytes: usize,
}

fn invalid(what: &str, detail: impl Into<String>) -> GpuError {
    GpuError::invalid(what, detail)
}

fn check_len(what: &str, expected: usize, found: usize) -> Result<(), GpuError> {
    if expected == found {
        Ok(())
    } else {
        Err(invalid(
            what,
            format!("expected {expected} elements, found {found}"),
        ))
    }
}

/// One matrix, validated: its format, row-major code bytes, scale bytes per chunk (NVFP4 2,
/// MXFP4 1) and FP8 block scales, and its epilogue multiplier.
struct Parts<'a> {
    format: GemvFormat,
    codes: &'a [u8],
    scales: Option<(&'a [u8], usize)>,
    fp8: Option<(&'a [u8], ScaleFormat, (usize, usize))>,
    post: f32,
    bytes: usize,
}

/// `[n, k]` in `format`: both positive, k a multiple of the format's 16-byte chunk, both u32.
fn check_shape(what: &str, format: GemvFormat, n: usize, k: usize) -> Result<(), GpuError> {
    let ce = format.chunk_elems();
    if n == 0 || k == 0 || !k.is_multiple_of(ce) {
        return Err(invalid(
            what,
            format!("n and k must be positive and k a multiple of {ce}"),
        ));
    }
    dim_u32(what, n)?;
    dim_u32(what, k)?;
    Ok(())
}

/// FP8 scale blocks the kernels take: rows a multiple of 16, columns of 64.
fn check_fp8_block(what: &str, block: (usize, usize)) -> Result<(), GpuError> {
    if block.0 == 0 || !block.0.is_multiple_of(16) || block.1 == 0 || !block.1.is_multiple_of(64) {
        return Err(invalid(
            what,
            format!("FP8 block {block:?}: rows must be a multiple of 16 and columns of 64"),
        ));
    }
    Ok(())
}

/// Whether row blocks stack in their own format ([`GemvWeight::load`]): one format (FP8 with one
/// scale format and block, NVFP4 with one global scale), and every block but the last ending
/// on a whole tile (16 rows) and FP8 scale block. The error says which rule they break.
pub fn check_stack(blocks: &[(HostWeight<'_>, usize)]) -> Result<(), String> {
    let Some((first, _)) = blocks.first() else {
        return Err("no parts".into());
    };
    let global = |w: &HostWeight<'_>| match *w {
        HostWeight::Nvfp4 { weight_scale_2, .. } => Some(weight_scale_2),
        _ => None,
    };
    let (format, scale) = (format_of(first), global(first));
    if let Some((w, _)) = blocks
        .iter()
        .find(|(w, _)| format_of(w) != format || global(w) != scale)
    {
        return Err(format!(
            "parts in {format:?} (global scale {scale:?}) and {:?} ({:?})",
            format_of(w),
            global(w)
        ));
    }
    let join = match format {
        GemvFormat::Fp8 { block, .. } => block.0.max(16),
        _ => 16,
    };
    let rows: Vec<usize> = blocks.iter().map(|&(_, n)| n).collect();
    if rows[..rows.len() - 1]
        .iter()
        .any(|r| !r.is_multiple_of(join))
    {
        return Err(format!(
            "parts of {rows:?} rows: all but the last must be a multiple of {join}"
        ));
    }
    Ok(())
}

fn format_of(w: &HostWeight<'_>) -> GemvFormat {
    match *w {
        HostWeight::Bf16(_) => GemvFormat::Bf16,
        HostWeight::Fp8 { format, block, .. } => GemvFormat::Fp8 {
            scale: format,
            block,
        },
        HostWeight::Nvfp4 { .. } => GemvFormat::Nvfp4,
        HostWeight::Mxfp4 { .. } => GemvFormat::Mxfp4,
    }
}

fn parts<'a>(w: HostWeight<'a>, n: usize, k: usize) -> Result<Parts<'a>, GpuError> {
    let format = format_of(&w);
    let what = format!("{} weight [{n}, {k}]", format.name());
    check_shape(&what, format, n, k)?;
    Ok(match w {
        HostWeight::Bf16(data) => {
            check_len(&what, n * k, data.len())?;
            Parts {
                format,
                codes: bytemuck::cast_slice(data),
                scales: None,
                fp8: None,
                post: 1.0,
                bytes: 2 * n * k,
            }
        }
        HostWeight::Fp8 {
            weight,
            scale,
            format: sf,
            block,
        } => {
            check_fp8_block(&what, block)?;
            check_len(&what, n * k, weight.len())?;
            let sn = n.div_ceil(block.0) * k.div_ceil(block.1) * sf.bytes();
            check_len(&format!("{what} scale"), sn, scale.len())?;
            // The kernel applies the block scales itself.
            Parts {
                format,
                codes: weight,
                scales: None,
                fp8: Some((scale, sf, block)),
                post: 1.0,
                bytes: n * k + sn,
            }
        }
        HostWeight::Nvfp4 {
            weight,
            weight_scale,
            weight_scale_2,
        } => {
            check_len(&what, n * k / 2, weight.len())?;
            check_len(
                &format!("{what} weight_scale"),
                n * k / 16,
                weight_scale.len(),
            )?;
            if !weight_scale_2.is_finite() {
                return Err(invalid(
                    &what,
                    format!("weight_scale_2 {weight_scale_2} is not finite"),
                ));
            }
            // Codes enter the MMA as value * 2^-16 (see gemv.cu).
            Parts {
                format,
                codes: weight,
                scales: Some((weight_scale, 2)),
                fp8: None,
                post: weight_scale_2 * 65536.0,
                bytes: n * k / 2 + n * k / 16,
            }
        }
        HostWeight::Mxfp4 { weight, scale } => {
            check_len(&what, n * k / 2, weight.len())?;
            check_len(&format!("{what} scale"), n * k / 32, scale.len())?;
            check_mxfp4_scales(&what, scale)?;
            Parts {
                format,
                codes: weight,
                scales: Some((scale, 1)),
                fp8: None,
                post: 65536.0,
                bytes: n * k / 2 + n * k / 32,
            }
        }
    })
}

/// Bytes of a host weight's codes and scales.
fn host_bytes(w: &HostWeight<'_>) -> usize {
    match *w {
        HostWeight::Bf16(v) => 2 * v.len(),
        HostWeight::Fp8 { weight, scale, .. }
        | HostWeight::Mxfp4 { weight, scale }
        | HostWeight::Nvfp4 {
            weight,
            weight_scale: scale,
            ..
        } => weight.len() + scale.len(),
    }
}

impl GemvWeight {
    /// Validates `w` as an `[n, k]` weight, copies it to the device and repacks it there into
    /// tiles ([`Self::load`] through a stager of its own).
    ///
    /// Requirements: `k` a positive multiple of 8 (BF16), 16 (FP8) or 32 (NVFP4, MXFP4); FP8
    /// blocks with `block.1 % 64 == 0` and `block.0 % 16 == 0`; MXFP4 scale bytes at most
    /// [`MXFP4_MAX_SCALE_BYTE`]; a finite NVFP4 global scale.
    pub fn upload(
        dev: &Device,
        w: HostWeight<'_>,
        n: usize,
        k: usize,
    ) -> Result<GemvWeight, GpuError> {
        let mut st = Stager::for_bytes(dev, host_bytes(&w))?;
        GemvWeight::load(&mut st, &[(w, n)], k)
    }

    /// Row blocks `blocks` (`(weight, rows)`, all `[rows, k]` in one format) stacked into one
    /// `[sum of rows, k]` weight, copied up through `st` and repacked on the device. Every part
    /// but the last must end on a whole tile (16 rows) and, in FP8, on a whole scale block;
    /// NVFP4 parts must share their global scale. Otherwise as [`Self::upload`].
    pub fn load(
        st: &mut Stager<'_>,
        blocks: &[(HostWeight<'_>, usize)],
        k: usize,
    ) -> Result<GemvWeight, GpuError> {
        let ps = blocks
            .iter()
            .map(|&(w, n)| parts(w, n, k))
            .collect::<Result<Vec<_>, _>>()?;
        let Some(p) = ps.first() else {
            return Err(invalid("stacked weight", "no parts"));
        };
        let n: usize = blocks.iter().map(|&(_, n)| n).sum();
        let what = format!(
            "{} weight [{n}, {k}] in {} parts",
            p.format.name(),
            ps.len()
        );
        check_stack(blocks).map_err(|reason| invalid(&what, reason))?;
        let layout = pack::Layout {
            rows: n,
            chunks: k / p.format.chunk_elems(),
            gate_up: false,
        };
        let dev = st.device();
        let mut codes = dev.alloc::<u8>(DType::U8, &[layout.slots() * 16])?;
        let mut scales = match p.scales {
            Some((_, unit)) => Some((dev.alloc::<u8>(DType::U8, &[layout.slots() * unit])?, unit)),
            None => None,
        };
        // Parts joined on whole tiles: their tiles follow one another.
        let order = p.format.code_order();
        let codes_of: Vec<&[u8]> = ps.iter().map(|q| q.codes).collect();
        relayout::pack_from_host(st, &mut codes, 0, &layout, 16, order, &codes_of, &[])?;
        if let Some((t, unit)) = &mut scales {
            let scales_of: Vec<&[u8]> = ps.iter().filter_map(|q| q.scales.map(|s| s.0)).collect();
            relayout::pack_from_host(
                st,
                t,
                0,
                &layout,
                *unit,
                pack::CodeOrder::Plain,
                &scales_of,
                &[],
            )?;
        }
        let fp8 = match p.fp8 {
            Some((_, sf, block)) => {
                let raw: Vec<&[u8]> = ps.iter().filter_map(|q| q.fp8.map(|f| f.0)).collect();
                Some((
                    relayout::fp8_scales_from_host(st, &raw, sf, n, k, block)?,
                    None,
                ))
            }
            None => None,
        };
        Ok(GemvWeight {
            format: p.format,
            n,
            k,
            gate_up: false,
            codes,
            scales: scales.map(|s| s.0),
            fp8,
            post: (p.post, p.post),
            bytes: ps.iter().map(|q| q.bytes).sum(),
        })
    }

    /// The gate (`w1`) and up (`w3`) projections of a SwiGLU block, both `[n, k]` in one
    /// format, interleaved tile by tile for [`gemv_swiglu`] ([`Self::load_gate_up`] through a
    /// stager of its own). Same requirements as [`Self::upload`]; FP8 block rows must also be
    /// a multiple of 8. NVFP4 global scales may differ between the two.
    pub fn upload_gate_up(
        dev: &Device,
        w1: HostWeight<'_>,
        w3: HostWeight<'_>,
        n: usize,
        k: usize,
    ) -> Result<GemvWeight, GpuError> {
        let mut st = Stager::for_bytes(dev, host_bytes(&w1) + host_bytes(&w3))?;
        GemvWeight::load_gate_up(&mut st, w1, w3, n, k)
    }

    /// [`Self::upload_gate_up`] through `st`.
    pub fn load_gate_up(
        st: &mut Stager<'_>,
        w1: HostWeight<'_>,
        w3: HostWeight<'_>,
        n: usize,
        k: usize,
    ) -> Result<GemvWeight, GpuError> {
        let (p1, p3) = (parts(w1, n, k)?, parts(w3, n, k)?);
        if p1.format != p3.format {
            return Err(invalid(
                "gate+up weight",
                format!("w1 is {:?} but w3 is {:?}", p1.format, p3.format),
            ));
        }
        let layout = pack::Layout {
            rows: n,
            chunks: k / p1.format.chunk_elems(),
            gate_up: true,
        };
        let dev = st.device();
        let mut codes = dev.alloc::<u8>(DType::U8, &[layout.slots() * 16])?;
        let order = p1.format.code_order();
        relayout::pack_from_host(
            st,
            &mut codes,
            0,
            &layout,
            16,
            order,
            &[p1.codes],
            &[p3.codes],
        )?;
        let scales = match (p1.scales, p3.scales) {
            (Some((s1, unit)), Some((s3, _))) => {
                let mut t = dev.alloc::<u8>(DType::U8, &[layout.slots() * unit])?;
                relayout::pack_from_host(
                    st,
                    &mut t,
                    0,
                    &layout,
                    unit,
                    pack::CodeOrder::Plain,
                    &[s1],
                    &[s3],
                )?;
                Some(t)
            }
            _ => None,
        };
        let fp8 = match (p1.fp8, p3.fp8) {
            (Some((r1, sf1, b1)), Some((r3, sf3, b3))) => Some((
                relayout::fp8_scales_from_host(st, &[r1], sf1, n, k, b1)?,
                Some(relayout::fp8_scales_from_host(st, &[r3], sf3, n, k, b3)?),
            )),
            _ => None,
        };
        Ok(GemvWeight {
            format: p1.format,
            n,
            k,
            gate_up: true,
            codes,
            scales,
            fp8,
            post: (p1.post, p3.post),
            bytes: p1.bytes + p3.bytes,
        })
    }

    /// A random `[n, k]` weight (or gate+up pair) generated on the device in the tile layout,
    /// for benchmarks without a checkpoint: codes uniform over a format's values, scales that
    /// give rows of RMS `1/sqrt(k)` (see [`random::unit_scale`]); the same `seed` gives the
    /// same bytes. `k` must be a multiple of the format's chunk (as for [`Self::upload`]); the
    /// tile padding gets random codes too, which the kernels never weigh (they read zero
    /// activations past K and write no rows past N).
    pub fn random(
        dev: &Device,
        format: GemvFormat,
        n: usize,
        k: usize,
        gate_up: bool,
        seed: u64,
    ) -> Result<GemvWeight, GpuError> {
        let what = format!("random {} weight [{n}, {k}]", format.name());
        check_shape(&what, format, n, k)?;
        let layout = pack::Layout {
            rows: n,
            chunks: k / format.chunk_elems(),
            gate_up,
        };
        let mats = if gate_up { 2 } else { 1 };
        let mut codes = dev.alloc::<u8>(DType::U8, &[layout.slots() * 16])?;
        let constant = |unit: usize, byte: u8| -> Result<DeviceTensor<u8>, GpuError> {
            let mut t = dev.alloc::<u8>(DType::U8, &[layout.slots() * unit])?;
            dev.fill_bytes(&mut t, byte)?;
            Ok(t)
        };
        let (mut scales, mut fp8, mut post) = (None, None, 1.0);
        let bytes = match format {
            GemvFormat::Bf16 => {
                let u = random::Uniform {
                    mean: 0.0,
                    half_range: (3.0 / k as f32).sqrt(),
                };
                random::fill_bf16_at(dev, codes.device_address(), codes.len() / 2, seed, u)?;
                2 * n * k
            }
            GemvFormat::Fp8 { scale: sf, block } => {
                check_fp8_block(&what, block)?;
                random::fill_bytes(dev, &mut codes, seed, random::FP8_CODES)?;
                let rms = random::fp8_codes_rms();
                let raw: Vec<u8> = match sf {
                    ScaleFormat::E8m0 => vec![random::unit_scale_e8m0(rms, k)],
                    ScaleFormat::F32 => random::unit_scale(rms, k).to_le_bytes().to_vec(),
                };
                let sn = n.div_ceil(block.0) * k.div_ceil(block.1);
                let raw = raw.repeat(sn);
                let mut st = Stager::for_bytes(dev, raw.len())?;
                let mut scale =
                    || relayout::fp8_scales_from_host(&mut st, &[&raw], sf, n, k, block);
                fp8 = Some((scale()?, if gate_up { Some(scale()?) } else { None }));
                n * k + raw.len()
            }
            GemvFormat::Nvfp4 => {
                random::fill_bytes(dev, &mut codes, seed, random::Bytes::ANY)?;
                // Block scales 1.0 (e4m3 0x38); the global scale carries the magnitude.
                scales = Some(constant(2, 0x38)?);
                post = random::unit_scale(random::e2m1_rms(), k) * 65536.0;
                n * k / 2 + n * k / 16
            }
            GemvFormat::Mxfp4 => {
                random::fill_bytes(dev, &mut codes, seed, random::Bytes::ANY)?;
                let byte = random::unit_scale_e8m0(random::e2m1_rms(), k);
                scales = Some(constant(1, byte.min(MXFP4_MAX_SCALE_BYTE))?);
                post = 65536.0;
                n * k / 2 + n * k / 32
            }
        };
        Ok(GemvWeight {
            format,
            n,
            k,
            gate_up,
            codes,
            scales,
            fp8,
            post: (post, post),
            bytes: mats * bytes,
        })
    }

    /// The device buffers, copied back (tests compare them with [`reference::packed`]).
    pub fn download(&self, dev: &Device) -> Result<reference::Packed, GpuError> {
        Ok(reference::Packed {
            codes: dev.download(&self.codes)?,
            scales: self.scales.as_ref().map(|t| dev.download(t)).transpose()?,
            fp8: match &self.fp8 {
                Some((a, b)) => Some((
                    dev.download(a)?,
                    b.as_ref().map(|t| dev.download(t)).transpose()?,
                )),
                None => None,
            },
        })
    }

    /// The device addresses of the FP8 scales of W (W1) and W3 (W's again for a plain weight);
    /// zero for other formats.
    pub(crate) fn fp8_scale_addresses(&self) -> (u64, u64) {
        match &self.fp8 {
            Some((s0, s1)) => (
                s0.device_address(),
                s1.as_ref().unwrap_or(s0).device_address(),
            ),
            None => (0, 0),
        }
    }

    pub fn format(&self) -> GemvFormat {
        self.format
    }

    /// Output features (rows of W, or of each of W1 and W3).
    pub fn n(&self) -> usize {
        self.n
    }

    /// Input features.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Whether this is an interleaved gate+up pair for [`gemv_swiglu`].
    pub fn is_gate_up(&self) -> bool {
        self.gate_up
    }

    /// Bytes a GEMV must read for this weight: the checkpoint's codes plus every scale
    /// (without the tile padding).
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

pub(crate) fn check_mxfp4_scales(what: &str, scale: &[u8]) -> Result<(), GpuError> {
    match scale.iter().position(|&b| b > MXFP4_MAX_SCALE_BYTE) {
        None => Ok(()),
        Some(i) => Err(invalid(
            what,
            format!(
                "scale byte {} at {i} exceeds {MXFP4_MAX_SCALE_BYTE} (block scale above 2^17)",
                scale[i]
            ),
        )),
    }
}

/// Split-K scratch: partial tiles and per-tile arrival counters. The counters must start at
/// zero (pool and `alloc` memory does) and the kernels leave them at zero. Also the FP8 prefill
/// GEMM's split activations (`gemm_fp8_tc`): their e4m3 codes and row scales.
pub struct GemvWorkspace {
    partials: DeviceTensor<f32>,
    counters: DeviceTensor<u32>,
    pub(crate) act_codes: DeviceTensor<u8>,
    pub(crate) act_scales: DeviceTensor<f32>,
}

/// [`GemvWorkspace`] buffers reserved in a pool, redeemed with [`Self::take`] after sealing.
pub struct GemvWorkspaceReservation {
    partials: Reservation<f32>,
    counters: Reservation<u32>,
    act_codes: Reservation<u8>,
    act_scales: Reservation<f32>,
}

impl GemvWorkspaceReservation {
    pub fn take(self, pool: &mut BufferPool) -> Result<GemvWorkspace, GpuError> {
        Ok(GemvWorkspace {
            partials: pool.take(self.partials)?,
            counters: pool.take(self.counters)?,
            act_codes: pool.take(self.act_codes)?,
            act_scales: pool.take(self.act_scales)?,
        })
    }
}

impl GemvWorkspace {
    /// Tile partials the workspace holds (each `16 rows x 16 columns` of f32).
    pub const PARTIALS: usize = 4096;
    /// Tiles a split launch may have (one counter each).
    pub const COUNTERS: usize = 2048;
    const PARTIAL_FLOATS: usize = 256;
    /// Bytes of split activations: a 2048-row chunk of 8192 columns (Flash wo_b) in one pass
    /// (two codes an element); longer chunks or rows run in passes.
    pub const ACT_CODE_BYTES: usize = 32 << 20;
    /// Scales of split activations (one a row and group).
    pub const ACT_SCALES: usize = 8192;

    /// Names, dtypes and shapes of the buffers.
    fn buffers(name: &str) -> [(String, DType, usize); 4] {
        [
            (
                format!("{name}.partials"),
                DType::F32,
                Self::PARTIALS * Self::PARTIAL_FLOATS,
            ),
            (format!("{name}.counters"), DType::U32, Self::COUNTERS),
            (
                format!("{name}.act_codes"),
                DType::E4M3,
                Self::ACT_CODE_BYTES,
            ),
            (format!("{name}.act_scales"), DType::F32, Self::ACT_SCALES),
        ]
    }

    /// Reserves the workspace (`<name>.partials`, `.counters`, `.act_codes`, `.act_scales`) in
    /// an open pool.
    pub fn reserve(
        pool: &mut BufferPool,
        name: &str,
    ) -> Result<GemvWorkspaceReservation, GpuError> {
        let [p, c, a, s] = Self::buffers(name);
        Ok(GemvWorkspaceReservation {
            partials: pool.reserve(&p.0, p.1, &[p.2])?,
            counters: pool.reserve(&c.0, c.1, &[c.2])?,
            act_codes: pool.reserve(&a.0, a.1, &[a.2])?,
            act_scales: pool.reserve(&s.0, s.1, &[s.2])?,
        })
    }

    /// The workspace [`Self::reserve`]d as `name`, from the sealed pool (for a sizing pass
    /// that reserved it and dropped the reservation; see [`BufferPool::take_named`]).
    pub fn take_named(pool: &mut BufferPool, name: &str) -> Result<GemvWorkspace, GpuError> {
        let [p, c, a, s] = Self::buffers(name);
        Ok(GemvWorkspace {
            partials: pool.take_named(&p.0, p.1, &[p.2])?,
            counters: pool.take_named(&c.0, c.1, &[c.2])?,
            act_codes: pool.take_named(&a.0, a.1, &[a.2])?,
            act_scales: pool.take_named(&s.0, s.1, &[s.2])?,
        })
    }

    /// A separately allocated workspace (tests, benchmarks).
    pub fn alloc(dev: &Device) -> Result<GemvWorkspace, GpuError> {
        let [p, c, a, s] = Self::buffers("");
        Ok(GemvWorkspace {
            partials: dev.alloc(p.1, &[p.2])?,
            counters: dev.alloc(c.1, &[c.2])?,
            act_codes: dev.alloc(a.1, &[a.2])?,
            act_scales: dev.alloc(s.1, &[s.2])?,
        })
    }
}

/// Kernel arguments; mirrors `struct GemvArgs` in gemv.cu field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct GemvArgs {
    x: u64,
    w: u64,
    s: u64,
    fs0: u64,
    fs1: u64,
    y: u64,
    ws: u64,
    counters: u64,
    m: u32,
    n: u32,
    k: u32,
    steps_q: u32,
    steps_r: u32,
    post0: f32,
    post1: f32,
    limit: f32,
    fp8_br: u32,
    tiles: u32,
    x_stride: u32,
    group: u32,
    tiles_log2: u32,
    cluster_sum: u32,
    mail_offset: u32,
    y_f32: u32,
    x_ld: u32,
    x_group_rows: u32,
}

// SAFETY: plain #[repr(C)] data with the exact layout of the CUDA struct.
unsafe impl DeviceRepr for GemvArgs {}

/// How a GEMV launch spreads `tiles` tiles of `steps` K steps over the GPU: each tile's steps
/// are split into `splits` contiguous ranges, one warp each. A block holds G ranges of a tile
/// (the largest power of two up to `max_warps` that divides `splits`), summed in shared
/// memory; the `splits / G` sums of a tile meet in the workspace. 8 or 16 ranges make a block
/// of as many warps; fewer share a 4-warp block with other tiles' ranges.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Plan {
    pub splits: usize,
    /// Largest block the kernel takes, in warps: a power of two, at least 4, or `splits` for
    /// one block of all of a tile's ranges (`arrange_sums`).
    pub max_warps: usize,
}

impl Plan {
    /// Ranges of a tile in one block.
    pub(crate) fn group(&self) -> usize {
        let mut g = self.max_warps;
        while !self.splits.is_multiple_of(g) {
            g /= 2;
        }
        g
    }

    /// Warps of each block.
    pub(crate) fn block_warps(&self) -> usize {
        self.group().max(MIN_BLOCK_WARPS)
    }

    /// Blocks that share one tile's K ranges (more than one: the sum goes through the
    /// workspace).
    pub(crate) fn blocks_per_tile(&self) -> usize {
        self.splits / self.group()
    }

    /// Blocks of the launch.
    #[cfg(test)]
    pub(crate) fn blocks(&self, tiles: usize) -> usize {
        self.tile_blocks(tiles) * self.blocks_per_tile()
    }

    /// Blocks that hold different tiles (the grid's x; its y is `blocks_per_tile`).
    pub(crate) fn tile_blocks(&self, tiles: usize) -> usize {
        tiles.div_ceil(self.block_warps() / self.group())
    }

    /// Steps of the longest K range one block covers: range i of a tile starts at step
    /// `i * (steps / splits) + min(i, steps % splits)`, and a block holds G consecutive ranges.
    pub(crate) fn block_steps(&self, steps: usize) -> usize {
        let g = self.group();
        g * (steps / self.splits) + g.min(steps % self.splits)
    }
}

/// Splits of about equal length (at least one step each) so that tiles x splits warps come
/// close to `target` (a full wave) without passing it, within the workspace's capacity.
/// Ranges are at least `min_steps` steps long (a kernel whose register ring is deeper than one
/// step cannot keep a one-step range's loads in flight) as long as that adds no blocks to a
/// tile's cross-block sum and keeps a third of the wave busy, or a fifth where it takes blocks
/// out of that sum. H200, FP8: [4096, 2048] 3.9 us with 4 two-step ranges a tile (1024 warps),
/// 4.4 us with 8 one-step ones in one block; [1024, 4096] 3.3 us with 16 one-step ranges in
/// one block, 3.7 us with 8 two-step ones (512 warps), and with 4-warp blocks 4.90 us with 16
/// ranges in four blocks, 4.55 us with 8 in two; [8192, 1536] 5.9 us with 4 ranges in one
/// block, 6.9 us with 3 in three blocks.
pub(crate) fn plan(
    tiles: usize,
    steps: usize,
    target: usize,
    min_steps: usize,
    max_warps: usize,
) -> Plan {
    let tiles = tiles.max(1);
    let mut p = Plan {
        splits: (target / tiles).clamp(1, steps.max(1)),
        max_warps,
    };
    let longer = Plan {
        splits: (steps / min_steps.max(1)).max(1),
        max_warps,
    };
    // The warps the longer ranges must keep busy: a fifth of the wave where they also take
    // blocks out of each tile's sum, a third where they only shorten the ranges.
    let keep = match longer.blocks_per_tile().cmp(&p.blocks_per_tile()) {
        std::cmp::Ordering::Less => target / 5,
        std::cmp::Ordering::Equal => target / 3,
        std::cmp::Ordering::Greater => usize::MAX,
    };
    if p.splits > longer.splits && tiles * longer.splits >= keep {
        p = longer;
    }
    // Sums that leave the block need a counter per tile and a partial per (tile, block).
    while p.splits > p.group()
        && (tiles > GemvWorkspace::COUNTERS
            || tiles * p.blocks_per_tile() > GemvWorkspace::PARTIALS)
    {
        p.splits -= 1;
    }
    p
}

/// Warps of `kernel` resident on the whole GPU at `threads` per block (one full wave).
pub(crate) fn resident_warps(dev: &Device, kernel: &str, threads: u32) -> Result<usize, GpuError> {
    let blocks = dev.resident_blocks(kernel, threads, 0)?;
    Ok((blocks as usize).max(1) * threads as usize / 32 * dev.sm_count())
}

/// The largest block `kernel` takes for a GEMV, in warps: 16 or 8 where the kernel allows that
/// many threads and keeps as many warps resident as in 4-warp blocks, else 4. H200, FP8 with 8
/// two-step ranges a tile in one 8-warp block instead of two 4-warp blocks that sum through
/// the workspace: [1024, 4096] 4.54 -> 3.68 us, [4096, 8192] 11.7 -> 10.7 us; [512, 4096] with
/// 16 ranges in one 16-warp block: 4.13 -> 2.97 us.
/// `base` is `resident_warps` of the kernel in 4-warp blocks.
pub(crate) fn max_block_warps(dev: &Device, kernel: &str, base: usize) -> Result<usize, GpuError> {
    let limit = dev.kernel_limits(kernel)?.max_threads as usize / 32;
    for warps in [MAX_BLOCK_WARPS, MAX_BLOCK_WARPS / 2] {
        if warps <= limit && resident_warps(dev, kernel, (warps * 32) as u32)? >= base {
            return Ok(warps);
        }
    }
    Ok(MIN_BLOCK_WARPS)
}

/// Dynamic shared memory for staging `bytes` of activations in each block of `kernel` beside
/// `other` bytes it needs anyway: `bytes` when staging is on, the block still fits the
/// device's per-block limit and as many blocks stay resident as without it, else 0 (the
/// kernel then reads its activations from global memory).
pub(crate) fn staging_bytes(
    dev: &Device,
    kernel: &str,
    threads: u32,
    other: usize,
    bytes: usize,
) -> Result<u32, GpuError> {
    let fixed = dev.kernel_limits(kernel)?.static_shared + other;
    if !tuning::STAGING.get() || bytes == 0 || fixed + bytes > dev.max_block_shared() {
        return Ok(0);
    }
    let resident = |dynamic| dev.resident_blocks(kernel, threads, dynamic as u32);
    if resident(other + bytes)? < resident(other)? {
        return Ok(0);
    }
    Ok(bytes as u32)
}

/// Dynamic shared memory for `kernel`'s blocks of `threads` threads, at least `least` bytes,
/// that holds a multiprocessor to at most `per_sm` of them (`least` where no more fit already,
/// or where no amount does): found by bisection on the occupancy calculator.
pub(crate) fn shared_for_at_most(
    dev: &Device,
    kernel: &str,
    threads: u32,
    least: u32,
    per_sm: u32,
) -> Result<u32, GpuError> {
    let fits = |bytes: u32| -> Result<bool, GpuError> {
        Ok(dev.resident_blocks(kernel, threads, bytes)? <= per_sm)
    };
    let most = (dev.max_block_shared() - dev.kernel_limits(kernel)?.static_shared) as u32;
    if per_sm == 0 || fits(least)? || !fits(most)? {
        return Ok(least);
    }
    // fits(lo) is false, fits(hi) true; the calculator counts shared memory in whole
    // allocation units, so a quarter KB is close enough.
    let (mut lo, mut hi) = (least, most);
    while hi - lo > 256 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid)? {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    Ok(hi)
}

/// Most blocks of a tile that sum inside one cluster (the portable cluster size).
const MAX_CLUSTER_SUM: usize = 8;

/// Padding (bf16) after each staged activation row, so rows do not start on the same bank.
const STAGE_PAD: usize = 8;

/// Where a launch's partial sums of one tile meet, and its dynamic shared memory.
struct Sums {
    /// The plan, its ranges regrouped into one block per tile where that replaced a
    /// cross-block sum.
    plan: Plan,
    /// The blocks of a tile form one cluster and sum in its first block's shared memory.
    cluster: bool,
    /// Row stride (bf16) of the staged activations: a block's K range plus padding.
    x_stride: usize,
    /// Bytes of staged activations (0: read from global memory); the mailbox follows.
    staged: usize,
    /// Bytes of the cluster mailbox.
    mail: usize,
}

/// Chooses how the blocks that share a tile sum their partials, in this order: inside a
/// cluster (2..=8 blocks, every cluster of the grid resident at once); in one block holding
/// all of the tile's ranges (5..=15 ranges that were one a block, every tile's block resident
/// at once); else through the workspace. All three add the ranges in the same order.
/// `k_range` gives a block's K range in elements for a plan, the activations it stages.
/// H100, Pro attn wq_a [1536, 7168] FP8 (48 clusters of 7 blocks) 7.0 -> 5.9 us and wkv
/// [512, 7168] 4.8 -> 3.5 us in clusters; where the clusters did not all fit (96 of 5 blocks
/// for Pro shared w1+w3, nearly a full wave of blocks) they cost 18.0 -> 22.2 us.
fn arrange_sums(
    dev: &Device,
    kernel: &str,
    p: Plan,
    tiles: usize,
    m: usize,
    k_range: impl Fn(&Plan) -> usize,
) -> Result<Sums, GpuError> {
    let x_stride = |p: &Plan| k_range(p) + STAGE_PAD;
    let staging = |p: &Plan| m * x_stride(p) * 2;
    let threads = |p: &Plan| (p.block_warps() * 32) as u32;
    let bpt = p.blocks_per_tile();
    if bpt > 1 && bpt <= MAX_CLUSTER_SUM && dev.arch().has_clusters() && tuning::CLUSTER_SUM.get() {
        let mail = (bpt - 1) * (p.block_warps() / p.group()) * m.div_ceil(8) * 32 * 16;
        // Both start 16-byte aligned: the staged row stride is a multiple of 8.
        let staged = staging_bytes(dev, kernel, threads(&p), mail, staging(&p))? as usize;
        let dynamic = dim_u32("gemv shared memory", staged + mail)?;
        let fit = dev.resident_clusters(kernel, threads(&p), dynamic, bpt as u32)?;
        if fit as usize >= p.tile_blocks(tiles) {
            return Ok(Sums {
                plan: p,
                cluster: true,
                x_stride: x_stride(&p),
                staged,
                mail,
            });
        }
    }
    let unclustered = |p: Plan, staged: u32| Sums {
        plan: p,
        cluster: false,
        x_stride: x_stride(&p),
        staged: staged as usize,
        mail: 0,
    };
    // Only from one range a block, so that the in-block sum adds the ranges in the order the
    // cross-block sums would (same bits).
    let fits_block = p.group() == 1
        && p.splits > MIN_BLOCK_WARPS
        && p.splits < MAX_BLOCK_WARPS
        && p.splits <= dev.kernel_limits(kernel)?.max_threads as usize / 32;
    if bpt > 1 && fits_block && tuning::WHOLE_TILE_BLOCKS.get() {
        let whole = Plan {
            splits: p.splits,
            max_warps: p.splits,
        };
        let staged = staging_bytes(dev, kernel, threads(&whole), 0, staging(&whole))?;
        let blocks = dev.resident_blocks(kernel, threads(&whole), staged)? as usize;
        if blocks * dev.sm_count() >= tiles {
            return Ok(unclustered(whole, staged));
        }
    }
    let staged = staging_bytes(dev, kernel, threads(&p), 0, staging(&p))?;
    Ok(unclustered(p, staged))
}

/// The M = 1 FP8 kernel with prescaled activations and its sums, where the launch stages its
/// activations (one copy, two for gate+up: one scaled for the gate rows, one for the up rows)
/// and each block's tiles lie in one row of scale blocks. H100, µs (docs/perf.md round 11):
/// V4-Flash shared expert w1+w3 2 x [2048, 4096] 7.8 -> 7.0-7.2, attn wq_a [1024, 4096] 3.4 ->
/// 3.0, Pro shared expert w2 [7168, 3072] 9.0 -> 8.5; Flash shared expert w2 [4096, 2048] 3.9
/// -> 4.4.
fn prescaled(
    dev: &Device,
    kernel: &str,
    w: &GemvWeight,
    m: usize,
    p: Plan,
    tiles: usize,
    k_range: &impl Fn(&Plan) -> usize,
) -> Result<Option<(String, Sums)>, GpuError> {
    let GemvFormat::Fp8 { block, .. } = w.format else {
        return Ok(None);
    };
    if m != 1 || !tuning::PRESCALED.get() {
        return Ok(None);
    }
    let kernel = kernel.replace("_m8", "_m1");
    let copies = if w.gate_up { 2 } else { 1 };
    let sums = arrange_sums(dev, &kernel, p, tiles, copies, k_range)?;
    let tile_rows = if w.gate_up { 8 } else { 16 };
    let block_rows = tile_rows * (sums.plan.block_warps() / sums.plan.group());
    if sums.staged == 0 || !block.0.is_multiple_of(block_rows) {
        return Ok(None);
    }
    Ok(Some((kernel, sums)))
}

fn check_x(x: &DeviceTensor<bf16>, k: usize) -> Result<usize, GpuError> {
    let (m, kx) = x.dims2("gemv input x", DType::BF16)?;
    if kx != k {
        return Err(GpuError::Shape {
            what: "gemv input x".to_string(),
            expected: vec![m, k],
            found: vec![m, kx],
        });
    }
    if m == 0 {
        return Err(invalid("gemv input x", "no rows"));
    }
    Ok(m)
}

#[allow(clippy::too_many_arguments)]
fn launch(
    dev: &Device,
    kernel: &str,
    x: &DeviceTensor<bf16>,
    m: usize,
    w: &GemvWeight,
    limit: f32,
    y: Output,
    groups: usize,
    ws: &mut GemvWorkspace,
) -> Result<(), GpuError> {
    let layout = pack::Layout {
        rows: w.n,
        chunks: w.k / w.format.chunk_elems(),
        gate_up: w.gate_up,
    };
    let tiles = layout.tiles();
    let resident = resident_warps(dev, kernel, (MIN_BLOCK_WARPS * 32) as u32)?;
    let target = match tuning::warps_per_sm() {
        0 => resident,
        w => w * dev.sm_count(),
    };
    // Ranges long enough to fill the FP8 ring, and two K steps at least for FP4, whose
    // one-step ranges pay a warp's start-up (ring fill, staging, the in-block sum) for one ring
    // of work: H100, Flash expert w1+w3 2 x [2048, 4096] NVFP4 5.7 us with 8 one-step ranges a
    // tile, 5.0 us with 4 two-step ones.
    let min_steps = match w.format {
        GemvFormat::Bf16 => 1,
        GemvFormat::Fp8 { .. } => (GEMV_FP8_RING as usize).div_ceil(pack::U),
        GemvFormat::Nvfp4 | GemvFormat::Mxfp4 => 2,
    };
    let max_warps = max_block_warps(dev, kernel, resident)?;
    let p = plan(tiles, layout.steps(), target, min_steps, max_warps);
    let k_range = |p: &Plan| {
        (p.block_steps(layout.steps()) * pack::STEP_CHUNKS * w.format.chunk_elems()).min(w.k)
    };
    // A grouped launch stages a block's activations only where the block's tiles share a group.
    let group_rows = w.n / groups;
    let one_group = |s: &Sums| {
        groups == 1 || group_rows.is_multiple_of(16 * (s.plan.block_warps() / s.plan.group()))
    };
    let (kernel, mut sums) = match prescaled(dev, kernel, w, m, p, tiles, &k_range)? {
        Some(chosen) if one_group(&chosen.1) => chosen,
        _ => (
            kernel.to_string(),
            arrange_sums(dev, kernel, p, tiles, m, k_range)?,
        ),
    };
    if !one_group(&sums) {
        sums.staged = 0;
    }
    let kernel = kernel.as_str();
    let (p, threads) = (sums.plan, sums.plan.block_warps() as u32 * 32);
    let shared = dim_u32("gemv shared memory", sums.staged + sums.mail)?;
    let br = match w.format {
        GemvFormat::Fp8 { block, .. } => block.0,
        _ => 1,
    };
    let (fs0, fs1) = w.fp8_scale_addresses();
    let args = GemvArgs {
        x: x.device_address(),
        w: w.codes.device_address(),
        s: w.scales.as_ref().map_or(0, |s| s.device_address()),
        fs0,
        fs1,
        y: y.address,
        ws: ws.partials.device_address(),
        counters: ws.counters.device_address(),
        m: m as u32,
        n: dim_u32("gemv n", w.n)?,
        k: dim_u32("gemv k", w.k)?,
        steps_q: (layout.steps() / p.splits) as u32,
        steps_r: (layout.steps() % p.splits) as u32,
        post0: w.post.0,
        post1: w.post.1,
        limit,
        fp8_br: br as u32,
        tiles: dim_u32("gemv tiles", tiles)?,
        x_stride: if sums.staged > 0 {
            sums.x_stride as u32
        } else {
            0
        },
        group: p.group() as u32,
        tiles_log2: (p.block_warps() / p.group()).trailing_zeros(),
        cluster_sum: u32::from(sums.cluster),
        mail_offset: sums.staged as u32,
        y_f32: y.mode,
        x_ld: dim_u32("gemv x row", groups * w.k)?,
        x_group_rows: if groups > 1 {
            dim_u32("gemv group rows", group_rows)?
        } else {
            0
        },
    };
    let grid = (
        dim_u32("gemv blocks", p.tile_blocks(tiles))?,
        p.blocks_per_tile() as u32,
        1,
    );
    // SAFETY: GemvArgs mirrors the kernels' argument; the weight's tensors hold whole packed
    // tiles; x and y were checked against (n, k); the kernel uses at most splits * tiles
    // workspace partials and tiles counters (plan bounds both).
    unsafe {
        launch_struct(
            dev,
            kernel,
            grid,
            (threads, shared),
            &args,
            tuning::PROGRAMMATIC_LAUNCH.get(),
            if sums.cluster {
                p.blocks_per_tile() as u32
            } else {
                1
            },
        )
    }
}

fn kernel_name(prefix: &str, format: GemvFormat, m: usize) -> String {
    format!(
        "{prefix}{}_{}",
        format.name(),
        if m <= 8 { "m8" } else { "m16" }
    )
}

/// Where a launch writes its results, and how (`y_f32` in gemv.cu).
pub(crate) struct Output {
    pub(crate) address: u64,
    /// 0: rounded to BF16; 1: F32 sums as they are; 2: F32 sums added to what `y` holds.
    pub(crate) mode: u32,
}

impl Output {
    fn of<Y: ActElem>(y: &DeviceTensor<Y>) -> Output {
        Output {
            address: y.device_address(),
            mode: u32::from(Y::DTYPE == DType::F32),
        }
    }
}

/// `y [M, N] = x [M, K] · Wᵀ` with `W [N, K]`, bf16 in, f32 accumulation, `y` in BF16 (rounded
/// to nearest even) or F32 (the sums as they are; the same value before rounding).
pub fn gemv<Y: ActElem>(
    dev: &Device,
    x: &DeviceTensor<bf16>,
    w: &GemvWeight,
    y: &mut DeviceTensor<Y>,
    ws: &mut GemvWorkspace,
) -> Result<(), GpuError> {
    let mode = Output::of(y).mode;
    plain("gemv", dev, x, w, 1, y, mode, ws)
}

/// `y [M, N] += x [M, K] · Wᵀ` (F32 `y`): [`gemv`] whose sums are added to `y` (one add per
/// element, so the result is what a separate add of the F32 output gives).
pub fn gemv_add(
    dev: &Device,
    x: &DeviceTensor<bf16>,
    w: &GemvWeight,
    y: &mut DeviceTensor<f32>,
    ws: &mut GemvWorkspace,
) -> Result<(), GpuError> {
    plain("gemv_add", dev, x, w, 1, y, 2, ws)
}

/// A grouped projection in one launch: `W [N, K]` is `groups` blocks of `N / groups` rows, and
/// group `g`'s rows read columns `[g·K, (g+1)·K)` of `x [M, groups·K]`:
/// `y[:, g·R..(g+1)·R] = x[:, g·K..(g+1)·K] · W[g·R..(g+1)·R]ᵀ` with `R = N / groups` (a
/// multiple of 16). Output types as [`gemv`].
pub fn gemv_grouped<Y: ActElem>(
    dev: &Device,
    x: &DeviceTensor<bf16>,
    w: &GemvWeight,
    groups: usize,
    y: &mut DeviceTensor<Y>,
    ws: &mut GemvWorkspace,
) -> Result<(), GpuError> {
    if groups == 0 || !w.n.is_multiple_of(groups) || !(w.n / groups).is_multiple_of(16) {
        return Err(invalid(
            "gemv_grouped",
            format!("{} rows are not {groups} groups of a multiple of 16", w.n),
        ));
    }
    let mode = Output::of(y).mode;
    plain("gemv_grouped", dev, x, w, groups, y, mode, ws)
}

/// The launch of [`gemv`], [`gemv_add`] and [`gemv_grouped`] (`what`): a plain weight, `x`
/// `[M, groups·K]`, `y` `[M, N]` written in `mode` ([`Output`]).
#[allow(clippy::too_many_arguments)]
fn plain<Y: ActElem>(
    what: &str,
    dev: &Device,
    x: &DeviceTensor<bf16>,
    w: &GemvWeight,
    groups: usize,
    y: &DeviceTensor<Y>,
    mode: u32,
    ws: &mut GemvWorkspace,
) -> Result<(), GpuError> {
    if w.gate_up {
        return Err(invalid(what, "a gate+up weight goes to gemv_swiglu"));
    }
    let m = check_x(x, groups * w.k)?;
    y.expect(&format!("{what} output y"), Y::DTYPE, &[m, w.n])?;
    let out = Output {
        address: y.device_address(),
        mode,
    };
    if m > MAX_M {
        return gemm::launch(dev, "gemm_", x, m, w, 0.0, out, groups, ws);
    }
    let kernel = kernel_name("gemv_", w.format, m);
    launch(dev, &kernel, x, m, w, 0.0, out, groups, ws)
}

/// Fused gate and up projections of a SwiGLU block: `h [M, I] = silu(min(x·W1ᵀ, L)) ·
/// clamp(x·W3ᵀ, −L, L)`, with `w13` from [`GemvWeight::upload_gate_up`] and `L = limit`
/// (swiglu_limit).
pub fn gemv_swiglu(
    dev: &Device,
    x: &DeviceTensor<bf16>,
    w13: &GemvWeight,
    limit: f32,
    h: &mut DeviceTensor<bf16>,
    ws: &mut GemvWorkspace,
) -> Result<(), GpuError> {
    if !w13.gate_up {
        return Err(invalid(
            "gemv_swiglu",
            "needs a gate+up weight (GemvWeight::upload_gate_up)",
        ));
    }
    if limit.is_nan() || limit <= 0.0 {
        return Err(invalid(
            "gemv_swiglu",
            format!("swiglu limit {limit} must be positive"),
        ));
    }
    let m = check_x(x, w13.k)?;
    h.expect("gemv_swiglu output h", DType::BF16, &[m, w13.n])?;
    if m > MAX_M {
        return gemm::launch(dev, "gemm_swiglu_", x, m, w13, limit, Output::of(h), 1, ws);
    }
    launch(
        dev,
        &kernel_name("gemv_swiglu_", w13.format, m),
        x,
        m,
        w13,
        limit,
        Output::of(h),
        1,
        ws,
    )
}

/// f64 CPU references on [`crate::codecs`] dequantization.
pub mod reference {
    use half::bf16;

    use super::{pack, parts, HostWeight};
    use crate::codecs::{fp8_block, mxfp4, nvfp4, CodecError};
    use crate::gpu::relayout::reference::{fp8_scale_rows, pack_tiles};
    use crate::gpu::GpuError;

    /// A [`super::GemvWeight`]'s device buffers: tile-packed codes, packed NVFP4/MXFP4 scales,
    /// and the FP8 kernel scales of W (W1) and, for gate+up, W3.
    #[derive(Debug, Clone, PartialEq)]
    pub struct Packed {
        pub codes: Vec<u8>,
        pub scales: Option<Vec<u8>>,
        pub fp8: Option<(Vec<f32>, Option<Vec<f32>>)>,
    }

    /// What [`super::GemvWeight::upload`] (`w3` None) or
    /// [`super::GemvWeight::upload_gate_up`] puts on the device, computed on the host.
    pub fn packed(
        w: HostWeight<'_>,
        w3: Option<HostWeight<'_>>,
        n: usize,
        k: usize,
    ) -> Result<Packed, GpuError> {
        let p = parts(w, n, k)?;
        let p3 = w3.map(|w| parts(w, n, k)).transpose()?;
        let layout = pack::Layout {
            rows: n,
            chunks: k / p.format.chunk_elems(),
            gate_up: p3.is_some(),
        };
        let order = p.format.code_order();
        let codes3 = p3.as_ref().map_or(&[][..], |q| q.codes);
        let scales = match (p.scales, p3.as_ref().map(|q| q.scales)) {
            (Some((s, unit)), None) => {
                Some(pack_tiles(&layout, unit, pack::CodeOrder::Plain, s, &[])?)
            }
            (Some((s, unit)), Some(Some((s3, _)))) => {
                Some(pack_tiles(&layout, unit, pack::CodeOrder::Plain, s, s3)?)
            }
            _ => None,
        };
        let fp8_of = |q: &super::Parts<'_>| {
            q.fp8
                .map(|(raw, sf, block)| fp8_scale_rows(raw, sf, n, k, block))
        };
        Ok(Packed {
            codes: pack_tiles(&layout, 16, order, p.codes, codes3)?,
            scales,
            fp8: fp8_of(&p).map(|f| (f, p3.as_ref().and_then(fp8_of))),
        })
    }

    /// The `[n, k]` weight as f32 (every dequantized value is exact in f32).
    pub fn dequantize(w: HostWeight<'_>, n: usize, k: usize) -> Result<Vec<f32>, CodecError> {
        match w {
            HostWeight::Bf16(v) => {
                crate::codecs::check_len("bf16 weight", n * k, v.len())?;
                Ok(v.iter().map(|x| x.to_f32()).collect())
            }
            HostWeight::Fp8 {
                weight,
                scale,
                format,
                block,
            } => fp8_block::dequantize(weight, scale, format, n, k, block.0, block.1),
            HostWeight::Nvfp4 {
                weight,
                weight_scale,
                weight_scale_2,
            } => nvfp4::dequantize(weight, weight_scale, weight_scale_2, n, k),
            HostWeight::Mxfp4 { weight, scale } => mxfp4::dequantize(weight, scale, n, k),
        }
    }

    /// `y [m, n] = x [m, k] · Wᵀ` in f64 with `w` dequantized `[n, k]`.
    pub fn gemv(x: &[bf16], m: usize, w: &[f32], n: usize, k: usize) -> Vec<f64> {
        let mut y = vec![0f64; m * n];
        for r in 0..m {
            let xr: Vec<f64> = x[r * k..(r + 1) * k].iter().map(|v| v.to_f64()).collect();
            for c in 0..n {
                let wr = &w[c * k..(c + 1) * k];
                y[r * n + c] = xr.iter().zip(wr).map(|(a, &b)| a * b as f64).sum();
            }
        }
        y
    }

    /// `silu(min(g, limit)) · clamp(u, −limit, limit)`.
    pub fn swiglu(g: f64, u: f64, limit: f64) -> f64 {
        let g = g.min(limit);
        g / (1.0 + (-g).exp()) * u.clamp(-limit, limit)
    }

    /// `h [m, n] = swiglu(x · W1ᵀ, x · W3ᵀ)` in f64.
    pub fn gemv_swiglu(
        x: &[bf16],
        m: usize,
        w1: &[f32],
        w3: &[f32],
        n: usize,
        k: usize,
        limit: f64,
    ) -> Vec<f64> {
        let g = gemv(x, m, w1, n, k);
        let u = gemv(x, m, w3, n, k);
        g.iter()
            .zip(&u)
            .map(|(&g, &u)| swiglu(g, u, limit))
            .collect()
    }

    /// ‖got − want‖ / ‖want‖ (0 when both are zero; NaN never passes a `<=` check).
    pub fn relative_error(got: &[f64], want: &[f64]) -> f64 {
        let num: f64 = got.iter().zip(want).map(|(a, b)| (a - b) * (a - b)).sum();
        let den: f64 = want.iter().map(|b| b * b).sum();
        if num == 0.0 {
            0.0
        } else {
            (num / den).sqrt()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
    fn gpu_shared_for_at_most_holds_a_multiprocessor_to_that_many_blocks() {
        let dev = crate::gpu::testing::device();
        let (kernel, threads, least) = ("moe_gate_up_nvfp4", 128, 8192);
        let full = dev.resident_blocks(kernel, threads, least).unwrap();
        assert!(full >= 2, "{full} blocks of {kernel} an SM");
        for per_sm in 0..=full + 1 {
            let bytes = shared_for_at_most(&dev, kernel, threads, least, per_sm).unwrap();
            let held = dev.resident_blocks(kernel, threads, bytes).unwrap();
            if per_sm == 0 || per_sm >= full {
                assert_eq!((bytes, held), (least, full), "{per_sm} an SM");
                continue;
            }
            assert_eq!(held, per_sm, "{bytes} bytes");
            // Within a quarter KB of the least that holds it there.
            let less = dev.resident_blocks(kernel, threads, bytes - 257).unwrap();
            assert!(bytes - 257 < least || less > per_sm, "{bytes} bytes");
        }
    }

    #[test]
    fn args_layout_matches_the_cuda_struct() {
        // 8 pointers, 5 u32, 3 f32, 10 u32 = 136 bytes.
        assert_eq!(std::mem::size_of::<GemvArgs>(), 136);
        assert_eq!(std::mem::align_of::<GemvArgs>(), 8);
    }

    #[test]
    fn plans_fill_the_gpu_within_bounds() {
        // Kernels that take 4-warp blocks only (BF16 m8) and up to 16 (FP8 / FP4 m8).
        let one = |splits| Plan {
            splits,
            max_warps: 4,
        };
        let big = |splits| Plan {
            splits,
            max_warps: 16,
        };
        // 24 warps on each of 132 SMs.
        let full = 24 * 132;
        // lm_head, wq_b: enough tiles, no split.
        assert_eq!(plan(8080, 32, full, 1, 4), one(1));
        assert_eq!(plan(2048, 4, full, 1, 4), one(1));
        // Pro wo_b [7168, 16384] fp8: 448 tiles of 64 steps -> 7 ranges (sums in the workspace).
        assert_eq!(plan(448, 64, full, 1, 4), one(7));
        assert_eq!(one(7).group(), 1);
        // 256 tiles of 8 steps with one-step ranges allowed (BF16's rule) -> 8 one-step
        // ranges: two 4-warp blocks a tile, or one 8-warp block.
        assert_eq!(plan(256, 8, full, 1, 4), one(8));
        assert_eq!((one(8).group(), one(8).blocks_per_tile()), (4, 2));
        assert_eq!(
            (big(8).group(), big(8).block_warps(), big(8).blocks(256)),
            (8, 8, 256)
        );
        // wkv [512, 4096] fp8: 32 tiles of 16 steps -> a step per warp, 16 warps a block.
        assert_eq!(plan(32, 16, full, 1, 16), big(16));
        assert_eq!((big(16).block_warps(), big(16).blocks(32)), (16, 32));
        // 1200 tiles: two ranges a tile, in one 4-warp block with another tile's.
        assert_eq!(plan(1200, 14, full, 1, 16), big(2));
        assert_eq!(
            (big(2).group(), big(2).block_warps(), big(2).blocks(9)),
            (2, 4, 5)
        );
        // FP8 and FP4 (two steps a range at least), 16 warps a SM: FP8 [4096, 2048] and Flash
        // expert w1+w3 2 x [2048, 4096] (256 tiles of 8 steps) -> 4 two-step ranges;
        // [1024, 4096] (64 tiles of 16 steps) keeps 16 one-step ranges, in one block where the
        // kernel takes 16 warps (8 two-step ones would leave 512 warps); with 4-warp blocks
        // the two-step ranges halve the blocks of each tile's sum.
        let fp8 = 16 * 132;
        assert_eq!(plan(256, 8, fp8, 2, 16), big(4));
        assert_eq!(plan(64, 16, fp8, 2, 16), big(16));
        assert_eq!(plan(64, 16, fp8, 2, 4), one(8));
        assert_eq!(plan(32, 16, fp8, 2, 4), one(16));
        // [8192, 1536]: 512 tiles of 6 steps keep 4 ranges in one block (3 would need three).
        assert_eq!(plan(512, 6, fp8, 2, 4), one(4));
        // A router-like [32, 16384] bf16: 2 tiles of 128 steps -> 128 one-step ranges.
        assert_eq!(plan(2, 128, full, 1, 4), one(128));
        assert_eq!(big(128).blocks_per_tile(), 8);
        // All of a tile's 5 ranges in one 5-warp block.
        let whole = Plan {
            splits: 5,
            max_warps: 5,
        };
        assert_eq!((whole.group(), whole.block_warps()), (5, 5));
        assert_eq!((whole.blocks_per_tile(), whole.tile_blocks(9)), (1, 9));
        assert_eq!(whole.block_steps(14), 14);
        assert_eq!(one(1).blocks(9), 3);
        assert_eq!(one(2).blocks(9), 5);
        assert_eq!(one(12).blocks(9), 27);
        assert_eq!(one(7).blocks(9), 21);
        for tiles in 1..3000 {
            for steps in [1, 3, 5, 8, 64, 4096] {
                for (target, min_steps, max_warps) in [
                    (132, 1, 4),
                    (16 * 132, 1, 4),
                    (full, 1, 4),
                    (16 * 132, 2, 4),
                    (full, 2, 4),
                    (16 * 132, 2, 16),
                    (full, 1, 16),
                    (full, 1, 8),
                ] {
                    let p = plan(tiles, steps, target, min_steps, max_warps);
                    assert!(p.splits >= 1 && p.splits <= steps);
                    // Ranges shorter than min_steps only to keep a third of the wave busy (a
                    // fifth if longer ones would sum in fewer blocks) or the tile's sum inside
                    // fewer blocks.
                    let longer = Plan {
                        splits: (steps / min_steps).max(1),
                        max_warps,
                    };
                    let keep = if longer.blocks_per_tile() < p.blocks_per_tile() {
                        target / 5
                    } else {
                        target / 3
                    };
                    assert!(
                        p.splits <= longer.splits
                            || tiles * longer.splits < keep
                            || longer.blocks_per_tile() > p.blocks_per_tile()
                    );
                    assert!(
                        p.splits == p.group()
                            || (tiles * p.blocks_per_tile() <= GemvWorkspace::PARTIALS
                                && tiles <= GemvWorkspace::COUNTERS)
                    );
                    // Splits only to reach the target, never past it.
                    assert!(p.splits == 1 || tiles * p.splits <= target);
                    // Blocks of 4, 8 or 16 warps, each holding whole groups of one tile's ranges.
                    let (g, w) = (p.group(), p.block_warps());
                    assert!([4, 8, 16].contains(&w) && w <= max_warps.max(4));
                    assert!(p.splits.is_multiple_of(g) && w.is_multiple_of(g));
                    assert!(p.blocks(tiles) * w / g >= tiles * p.blocks_per_tile());
                    assert!(g.is_power_of_two() && w.is_power_of_two());
                }
            }
        }
    }

    /// The kernel's ranges (gemv.cu: range i starts at step i * q + min(i, r)) cover the K
    /// steps once, differ in length by at most one step, and no block's G ranges pass
    /// `block_steps`, the length its staged activations are sized for.
    #[test]
    fn ranges_tile_k_and_fit_the_staging() {
        for steps in 1..80 {
            for splits in 1..=steps {
                for max_warps in [4, 8, 16] {
                    let p = Plan { splits, max_warps };
                    let (q, r) = (steps / splits, steps % splits);
                    let start = |i: usize| i * q + i.min(r);
                    assert_eq!((start(0), start(splits)), (0, steps));
                    for i in 0..splits {
                        assert!((q..=q + 1).contains(&(start(i + 1) - start(i))));
                    }
                    let g = p.group();
                    let longest = (0..p.blocks_per_tile())
                        .map(|b| start((b + 1) * g) - start(b * g))
                        .max();
                    assert_eq!(longest, Some(p.block_steps(steps)));
                }
            }
        }
    }

    /// The kernel's word-to-pairs expansion (gemv_tile.cu `fp4x8_to_bf16`), emulated on
    /// encoded words.
    fn fp4_pairs(w: u32) -> [u32; 4] {
        const M: u32 = 0x81c0_81c0;
        [
            w.rotate_right(2) & M,
            w.rotate_right(6) & M,
            w.rotate_right(12) & M,
            (w & 0x80c0_80c0) | (w.rotate_right(8) & 0x0100_0100),
        ]
    }

    #[test]
    fn encoded_codes_expand_to_pairs_of_consecutive_elements() {
        let mut bits = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            bits ^= bits << 13;
            bits ^= bits >> 7;
            bits ^= bits << 17;
            bits as u32
        };
        for _ in 0..2000 {
            let w = next();
            // e2m1 code c as bf16 bits worth e2m1 * 2^-126: sign at 15, magnitude at 8..6.
            let fp4 = |c: u32| ((c & 8) << 12) | ((c & 7) << 6);
            let mut v = w.to_le_bytes().to_vec();
            pack::encode_codes(pack::CodeOrder::Fp4, &mut v);
            let enc = u32::from_le_bytes([v[0], v[1], v[2], v[3]]);
            for (k, p) in fp4_pairs(enc).into_iter().enumerate() {
                let (lo, hi) = ((w >> (8 * k)) & 0xf, (w >> (8 * k + 4)) & 0xf);
                assert_eq!(p, fp4(lo) | (fp4(hi) << 16), "fp4 word {w:#x} pair {k}");
            }
            pack::decode_codes(pack::CodeOrder::Fp4, &mut v);
            assert_eq!(v, w.to_le_bytes());
        }
        // Every packed FP4 bit has exactly one source.
        let mut seen = std::collections::HashSet::new();
        for b in 0..32 {
            assert!(seen.insert(pack::fp4_source_bit(b)));
        }
    }

    #[test]
    fn pack_round_trips_and_pads_with_zeros() {
        let cases = [
            (1, 1, false, 16),
            (17, 3, false, 16),
            (33, 17, true, 2),
            (8, 40, true, 1),
            (300, 35, false, 2),
        ];
        for (rows, chunks, gate_up, unit) in cases {
            let layout = pack::Layout {
                rows,
                chunks,
                gate_up,
            };
            let n = rows * chunks * unit;
            let w: Vec<u8> = (0..n).map(|i| (i * 7 + 1) as u8 | 1).collect();
            let w3: Vec<u8> = if gate_up {
                (0..n).map(|i| (i * 13 + 5) as u8 | 1).collect()
            } else {
                vec![]
            };
            let packed = pack::pack(&layout, unit, &w, &w3).unwrap();
            assert_eq!(packed.len(), layout.slots() * unit);
            let (a, b) = pack::unpack(&layout, unit, &packed).unwrap();
            assert_eq!((a, b), (w, w3));
            // Exactly the padding slots are zero (every source byte is odd).
            let zeros = packed
                .chunks(unit)
                .filter(|c| c.iter().all(|&x| x == 0))
                .count();
            let sources = rows * chunks * if gate_up { 2 } else { 1 };
            assert_eq!(zeros, layout.slots() - sources);
        }
        // One whole tile and step: no padding at all.
        assert_eq!(
            pack::Layout {
                rows: 16,
                chunks: 16,
                gate_up: false
            }
            .slots(),
            256
        );
        assert_eq!(
            pack::Layout {
                rows: 8,
                chunks: 16,
                gate_up: true
            }
            .slots(),
            256
        );
        assert_eq!(
            pack::Layout {
                rows: 17,
                chunks: 17,
                gate_up: false
            }
            .slots(),
            4 * 256
        );
        // Tile 1, step 0, u 2, lower-half rows 8-15, lane 13: row 16 + 8 + 3, chunk 8 + 1.
        let l = pack::Layout {
            rows: 40,
            chunks: 20,
            gate_up: false,
        };
        assert_eq!(
            l.source(((((2) * 4 + 2) * 2 + 1) * 32) + 13),
            Some((0, 27, 9))
        );
        // Gate+up tile 1, u 1, W3 half, lane 4: W3 row 9, chunk 4; lane 5 is past K.
        let g = pack::Layout {
            rows: 12,
            chunks: 5,
            gate_up: true,
        };
        assert_eq!(g.source((((4 + 1) * 2 + 1) * 32) + 4), Some((1, 9, 4)));
        assert_eq!(g.source((((4 + 1) * 2 + 1) * 32) + 5), None);
        assert!(pack::pack(&l, 16, &[0; 3], &[]).is_err());
        assert!(pack::unpack(&g, 2, &[0; 5]).is_err());
    }

    #[test]
    fn mxfp4_scales_above_2_pow_17_are_refused() {
        assert!(check_mxfp4_scales("w", &[0, 127, 144]).is_ok());
        let err = check_mxfp4_scales("w", &[127, 145]).unwrap_err();
        assert!(err.to_string().contains("145 at 1"), "{err}");
    }

    #[test]
    fn stacks_need_one_format_and_joins_on_tiles_and_blocks() {
        let b = [bf16::ZERO; 64];
        let bf = |n| (HostWeight::Bf16(&b), n);
        let fp8 = |n| {
            let w = HostWeight::Fp8 {
                weight: &[],
                scale: &[],
                format: ScaleFormat::E8m0,
                block: (128, 128),
            };
            (w, n)
        };
        let nv = |g, n| {
            let w = HostWeight::Nvfp4 {
                weight: &[],
                weight_scale: &[],
                weight_scale_2: g,
            };
            (w, n)
        };
        assert!(check_stack(&[bf(16), bf(8)]).is_ok());
        assert!(check_stack(&[fp8(256), fp8(100)]).is_ok());
        assert!(check_stack(&[nv(0.5, 32), nv(0.5, 3)]).is_ok());
        let err = |blocks: &[(HostWeight<'_>, usize)]| check_stack(blocks).unwrap_err();
        assert!(err(&[bf(24), bf(16)]).contains("multiple of 16"));
        assert!(err(&[fp8(64), fp8(128)]).contains("multiple of 128"));
        assert!(err(&[bf(16), fp8(16)]).contains("parts in"));
        assert!(err(&[nv(0.5, 16), nv(0.25, 16)]).contains("global scale"));
        assert!(err(&[]).contains("no parts"));
    }

    #[test]
    fn references_compute_known_values() {
        let x = [bf16::from_f32(1.0), bf16::from_f32(-2.0)];
        let w = [3.0f32, 0.5, -1.0, 4.0];
        assert_eq!(reference::gemv(&x, 1, &w, 2, 2), vec![2.0, -9.0]);
        // g clamps to the limit; u clamps both ways.
        let s = reference::swiglu(20.0, -30.0, 10.0);
        assert!((s - 10.0 / (1.0 + (-10f64).exp()) * -10.0).abs() < 1e-12);
        assert_eq!(reference::relative_error(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert!(reference::relative_error(&[f64::NAN], &[1.0]).is_nan());
    }
}
