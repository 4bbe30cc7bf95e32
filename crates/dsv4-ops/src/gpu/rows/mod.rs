//! Launchers of the row kernels (`kernels/rows.cu`): the embedding gather into the mHC
//! streams, RMSNorm and the rotary embedding. Token ids and positions are device buffers, so the
//! launches capture into a decode graph that replays with whatever the previous step wrote
//! there. CPU references: [`reference`].

pub mod reference;
#[cfg(test)]
mod tests;

use half::bf16;

use cudarc::driver::DeviceRepr;
use dsv4_kernels::NORM_HELD;

use super::gemv::tuning::PROGRAMMATIC_LAUNCH;
use super::launch::{batch_flag, dim_u32, elementwise, launch, launch_struct, Args};
use super::{DType, Device, DeviceElem, DeviceTensor, GpuError};

/// `out [n, hc·D]` (F32) = `hc` copies of row `tokens[t]` of the BF16 `table [vocab, D]`, for
/// the `n` ids in `tokens` (U32 `[n]`, on the device). An id outside the vocabulary gives a
/// NaN row (the host checks prompt ids; sampled ids are always in range).
pub fn embed_hc_gather(
    dev: &Device,
    table: &DeviceTensor<bf16>,
    tokens: &DeviceTensor<u32>,
    hc: usize,
    out: &mut DeviceTensor<f32>,
) -> Result<(), GpuError> {
    let (vocab, d) = table.dims2("embedding table", DType::BF16)?;
    let n = tokens.len();
    tokens.expect("token ids", DType::U32, &[n])?;
    out.expect("embedding output", DType::F32, &[n, hc * d])?;
    let total = (n * hc * d) as u64;
    if total == 0 {
        return Ok(());
    }
    let (v32, d32, n32, hc32) = (
        dim_u32("vocab", vocab)?,
        dim_u32("hidden", d)?,
        dim_u32("tokens", n)?,
        dim_u32("hc", hc)?,
    );
    // SAFETY: table [vocab, d], tokens [n], out [n, hc * d], checked above; ids are bounds
    // checked inside the kernel.
    unsafe {
        launch(
            dev,
            "embed_hc_gather",
            elementwise(total),
            Args::new()
                .ptr(table)
                .arg(v32)
                .arg(d32)
                .ptr(tokens)
                .arg(n32)
                .arg(hc32)
                .ptr(out),
        )
    }?;
    Ok(())
}

/// Columns `[first, first + width)` of every row of an F32 `[rows, cols]` tensor: one
/// projection's part of a stacked GEMV's output. A whole tensor converts into all its columns.
#[derive(Clone, Copy)]
pub struct ColRange<'a> {
    pub x: &'a DeviceTensor<f32>,
    pub first: usize,
    pub width: usize,
}

impl<'a> From<&'a DeviceTensor<f32>> for ColRange<'a> {
    fn from(x: &'a DeviceTensor<f32>) -> ColRange<'a> {
        let width = x.shape().get(1).copied().unwrap_or(0);
        ColRange { x, first: 0, width }
    }
}

/// RMSNorm of every row of `x` (F32 `[rows, width]`, or a column range of a wider tensor) into
/// `out [rows, width]`: `weight · x / sqrt(mean(x²) + eps)`, no scale when `weight` is `None`;
/// with `out_b`, the same values rounded to BF16 there too (a GEMV's input).
pub fn rms_norm_rows<'a>(
    dev: &Device,
    x: impl Into<ColRange<'a>>,
    weight: Option<&DeviceTensor<f32>>,
    eps: f32,
    out: &mut DeviceTensor<f32>,
    out_b: Option<&mut DeviceTensor<bf16>>,
) -> Result<(), GpuError> {
    let set = NormRows {
        x: x.into(),
        weight,
        rows_per_token: 1,
        out,
    };
    norm_rows(dev, set, None, eps, out_b, None, Form::Fastest)
}

/// The rotary embedding [`rms_norm_rope_rows`] applies after the norm.
pub struct RowRope<'a> {
    /// `[half]`: the last `2·half` channels of each row rotate.
    pub inv_freq: &'a DeviceTensor<f32>,
    /// U32 `[1]`, the first token's position, or `[T]`, each token's (a batch of sequences).
    pub pos: &'a DeviceTensor<u32>,
    /// Rows of one token (heads); row `r` sits at position `pos[0] + r / rows_per_token` (a
    /// batch's at `pos[r / rows_per_token]`).
    pub rows_per_token: usize,
}

/// [`rms_norm_rows`] then [`rope_rows`] (forward) on its output, in one launch. The rotated
/// channels must start at an even one, in rows of at most 8,192 (`rope_rows` takes any).
pub fn rms_norm_rope_rows<'a>(
    dev: &Device,
    x: impl Into<ColRange<'a>>,
    weight: Option<&DeviceTensor<f32>>,
    eps: f32,
    rope: &RowRope,
    out: &mut DeviceTensor<f32>,
) -> Result<(), GpuError> {
    let set = NormRows {
        x: x.into(),
        weight,
        rows_per_token: rope.rows_per_token,
        out,
    };
    norm_rows(dev, set, None, eps, None, Some(rope), Form::Fastest)
}

/// Rows of one width that [`rms_norm_rope_pair`] normalizes and rotates like
/// [`rms_norm_rope_rows`].
pub struct NormRows<'a, 'o> {
    pub x: ColRange<'a>,
    pub weight: Option<&'a DeviceTensor<f32>>,
    /// Rows of one token (heads); row `r` sits at position `pos[0] + r / rows_per_token`.
    pub rows_per_token: usize,
    pub out: &'o mut DeviceTensor<f32>,
}

/// [`rms_norm_rope_rows`] of two sets of rows of one width (a token's query heads and its
/// shared key) in one launch; `rope.rows_per_token` is ignored (each set gives its own).
pub fn rms_norm_rope_pair(
    dev: &Device,
    a: NormRows,
    b: NormRows,
    eps: f32,
    rope: &RowRope,
) -> Result<(), GpuError> {
    norm_rows(dev, a, Some(b), eps, None, Some(rope), Form::Fastest)
}

/// Mirrors `struct NormSet` in rows.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct NormSet {
    x: u64,
    x_stride: u32,
    rows: u32,
    weight: u64,
    out: u64,
    rows_per_token: u32,
}

/// Mirrors `struct NormArgs` in rows.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct NormArgs {
    a: NormSet,
    b: NormSet,
    width: u32,
    eps: f32,
    out_b: u64,
    inv_freq: u64,
    rope_half: u32,
    pos: u64,
    batch: u32,
}

// SAFETY: plain #[repr(C)] data with the exact layout of the CUDA structs.
unsafe impl DeviceRepr for NormArgs {}

/// Threads of a norm block for rows of `width`: about four columns a thread, so that one row
/// (a decode step's norm) spreads over a whole block of up to 1024 threads. The summation
/// order follows from it, so it depends on the width only.
pub(crate) fn norm_threads(width: u32) -> u32 {
    (width / 4).next_multiple_of(32).clamp(32, NORM_MAX_THREADS)
}

/// The most threads of a norm block (CUDA's limit for one block).
pub(crate) const NORM_MAX_THREADS: u32 = 1024;

/// The widest rows `rms_norm_rows` rotates: it holds `NORM_HELD` columns a thread of up to
/// `NORM_MAX_THREADS` threads in registers, and a rotated pair must lie there.
const ROPE_HELD_WIDTH: usize = (NORM_HELD * NORM_MAX_THREADS) as usize;

/// Warps of an `rms_norm_rows_w512` block (a row each; its launch bounds are 256 threads).
const NORM_WARPS: u32 = 8;

/// Rows in a launch from which `rms_norm_rows_w512` takes rows of its widths: a prompt chunk's
/// heads, or a batch of 64 decoding sequences or more. Fewer rows (one token's: 65) end sooner
/// spread over whole blocks.
const NORM_WARP_ROWS: usize = 4096;

/// Whether `rows` rows of `width` (their last `2·rope_half` channels rotated) go a warp a row
/// (`rms_norm_rows_w512`, rms_norm_rows' bits): rms_norm_rows' 128-thread widths with at most
/// 4 columns a thread, rotated channels within the last 128 from an even one (a pair in lanes
/// `l`, `l^1` of a thread's last column), and many rows.
fn norm_by_warps(rows: usize, width: u32, rope_half: u32) -> bool {
    rows >= NORM_WARP_ROWS
        && norm_threads(width) == 128
        && width <= 512
        && 2 * rope_half <= width - 3 * 128
        && (width - 2 * rope_half).is_multiple_of(2)
}

/// A checked row set of `width` columns (named `what` in errors) and the kernel's view of it.
fn norm_set(set: &NormRows, width: usize, rope: bool, what: &str) -> Result<NormSet, GpuError> {
    // Errors name the set; nothing is formatted unless one occurs.
    let named = |e: GpuError| GpuError::invalid(what, e.to_string());
    let x = set.x;
    let (rows, stride) = x.x.dims2("input", DType::F32).map_err(named)?;
    if x.width != width || x.first + width > stride {
        return Err(GpuError::invalid(
            what,
            format!(
                "columns {}..{} of rows of {stride} (rows of {width} wanted)",
                x.first,
                x.first + x.width
            ),
        ));
    }
    set.out
        .expect("output", DType::F32, &[rows, width])
        .map_err(named)?;
    if let Some(w) = set.weight {
        w.expect("weight", DType::F32, &[width]).map_err(named)?;
    }
    if rope && (set.rows_per_token == 0 || rows % set.rows_per_token != 0) {
        return Err(GpuError::invalid(
            what,
            format!("{rows} rows, {} rows a token", set.rows_per_token),
        ));
    }
    Ok(NormSet {
        x: x.x.device_address() + (x.first * 4) as u64,
        x_stride: dim_u32("row stride", stride)?,
        rows: dim_u32("rows", rows)?,
        // Null selects the unscaled norm inside the kernel.
        weight: set.weight.map_or(0, DeviceTensor::device_address),
        out: set.out.device_address(),
        rows_per_token: dim_u32("rows per token", set.rows_per_token.max(1))?,
    })
}

/// Which kernel [`norm_rows`] launches: the tests hold the warp form to the block form's bits.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Form {
    /// `rms_norm_rows_w512` where [`norm_by_warps`] takes it.
    Fastest,
    /// `rms_norm_rows_w512` at any row count (its widths only).
    #[cfg(test)]
    Warps,
    /// `rms_norm_rows`, a block a row.
    #[cfg(test)]
    Block,
}

fn norm_rows(
    dev: &Device,
    a: NormRows,
    b: Option<NormRows>,
    eps: f32,
    out_b: Option<&mut DeviceTensor<bf16>>,
    rope: Option<&RowRope>,
    form: Form,
) -> Result<(), GpuError> {
    let width = a.x.width;
    let (what_a, what_b) = match (&b, rope) {
        (Some(_), _) => (
            "rms_norm_rope pair, first rows",
            "rms_norm_rope pair, second rows",
        ),
        (None, Some(_)) => ("rms_norm_rope", ""),
        (None, None) => ("rms_norm", ""),
    };
    let first = norm_set(&a, width, rope.is_some(), what_a)?;
    let second = match &b {
        Some(b) => norm_set(b, width, rope.is_some(), what_b)?,
        None => NormSet::default(),
    };
    if let Some(o) = &out_b {
        o.expect(
            "rms_norm BF16 output",
            DType::BF16,
            &[first.rows as usize, width],
        )?;
    }
    let (inv_freq, rope_half, pos, batch) = match rope {
        Some(r) => {
            let half = r.inv_freq.len();
            r.inv_freq
                .expect("rope inverse frequencies", DType::F32, &[half])?;
            // Every set's rows are the same tokens'.
            let tokens = |s: &NormSet| (s.rows / s.rows_per_token) as usize;
            let batch = batch_flag(r.pos, tokens(&first), "rope position")?;
            if batch == 1 && b.is_some() && tokens(&second) != tokens(&first) {
                return Err(GpuError::invalid(
                    "rms_norm_rope pair",
                    "both sets' rows must be the same batch's tokens",
                ));
            }
            if 2 * half > width {
                return Err(GpuError::invalid(
                    "rms_norm_rope",
                    format!("rows of {width} with {} rotated channels", 2 * half),
                ));
            }
            // A pair turns in the lanes that hold it (rms_norm_rows' held columns).
            if !(width - 2 * half).is_multiple_of(2) || width > ROPE_HELD_WIDTH {
                return Err(GpuError::invalid(
                    "rms_norm_rope",
                    format!(
                        "rows of {width} rotated from channel {}: the rotated channels must \
                         start at an even one, in rows of at most {ROPE_HELD_WIDTH}",
                        width - 2 * half
                    ),
                ));
            }
            (
                r.inv_freq.device_address(),
                dim_u32("rope half", half)?,
                r.pos.device_address(),
                batch,
            )
        }
        None => (0, 0, 0, 0),
    };
    let rows = first.rows as usize + second.rows as usize;
    if rows == 0 || width == 0 {
        return Ok(());
    }
    let w32 = dim_u32("width", width)?;
    let args = NormArgs {
        a: first,
        b: second,
        width: w32,
        eps,
        // Null selects no BF16 copy inside the kernel.
        out_b: out_b.map_or(0, |o| o.device_address()),
        inv_freq,
        rope_half,
        pos,
        batch,
    };
    let by_warps = match form {
        Form::Fastest => norm_by_warps(rows, w32, rope_half),
        #[cfg(test)]
        Form::Warps => true,
        #[cfg(test)]
        Form::Block => false,
    };
    let rows = dim_u32("rows", rows)?;
    let (kernel, grid, block) = if by_warps {
        (
            "rms_norm_rows_w512",
            rows.div_ceil(NORM_WARPS),
            32 * NORM_WARPS,
        )
    } else {
        ("rms_norm_rows", rows, norm_threads(w32))
    };
    // SAFETY: NormArgs mirrors the kernel's argument; each set's x holds its rows of `stride`
    // read from column `first` on (first + width <= stride), out [rows, width], weight (when
    // not null) [width]; out_b (when not null) set a's [rows, width]; inv_freq (when not null)
    // [half] with 2·half <= width and pos [1] or one a token, checked above. Both kernels
    // stride over the rows past the grid.
    unsafe {
        launch_struct(
            dev,
            kernel,
            (grid.min(1 << 16), 1, 1),
            (block, 0),
            &args,
            PROGRAMMATIC_LAUNCH.get(),
            1,
        )
    }
}

/// Which way [`rope_rows`] rotates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeDirection {
    Forward,
    /// By `-φ` (the attention kernel rotates its own output back the same way).
    Inverse,
}

/// Rotates the last `2 · inv_freq.len()` channels of every `width`-sized vector of
/// `x [tokens, heads · width]` (F32, in place) to its position: token `t` is at `pos[0] + t`
/// (`pos`: U32 `[1]` on the device), or at `pos[t]` (`pos` U32 `[tokens]`: a batch of
/// sequences). Pairs `(2i, 2i+1)` turn by `position · inv_freq[i]`.
pub fn rope_rows(
    dev: &Device,
    x: &mut DeviceTensor<f32>,
    width: usize,
    inv_freq: &DeviceTensor<f32>,
    pos: &DeviceTensor<u32>,
    direction: RopeDirection,
) -> Result<(), GpuError> {
    let (tokens, cols) = x.dims2("rope input", DType::F32)?;
    let half = inv_freq.len();
    inv_freq.expect("rope inverse frequencies", DType::F32, &[half])?;
    let batch = batch_flag(pos, tokens, "rope position")?;
    if width == 0 || cols % width != 0 || 2 * half > width {
        return Err(GpuError::invalid(
            "rope",
            format!(
                "rows of {cols} are not whole vectors of width {width} with {} rotated channels",
                2 * half
            ),
        ));
    }
    let heads = cols / width;
    let total = (tokens * heads * half) as u64;
    if total == 0 {
        return Ok(());
    }
    let dims = [
        dim_u32("tokens", tokens)?,
        dim_u32("heads", heads)?,
        dim_u32("width", width)?,
        dim_u32("rope dim", 2 * half)?,
    ];
    let sign: f32 = match direction {
        RopeDirection::Forward => 1.0,
        RopeDirection::Inverse => -1.0,
    };
    // SAFETY: x [tokens, heads * width] with 2 * half <= width, inv_freq [half], pos [1] or
    // [tokens].
    unsafe {
        launch(
            dev,
            "rope_rows",
            elementwise(total),
            Args::new()
                .ptr(x)
                .arg(dims[0])
                .arg(dims[1])
                .arg(dims[2])
                .arg(dims[3])
                .ptr(inv_freq)
                .ptr(pos)
                .arg(sign)
                .arg(batch),
        )
    }?;
    Ok(())
}

/// `pos[0] += n` on the device (`pos`: U32 `[1]`): the step that moves a captured decode graph
/// to its next position.
pub fn advance_position(dev: &Device, pos: &mut DeviceTensor<u32>, n: u32) -> Result<(), GpuError> {
    pos.expect("position", DType::U32, &[1])?;
    // SAFETY: pos holds one u32.
    unsafe {
        launch(
            dev,
            "advance_position",
            elementwise(1),
            Args::new().ptr(pos).arg(n),
        )
    }?;
    Ok(())
}

/// `out[j] = pos[0] + j·step` for every element of `out` (U32 `[count]`; `pos`: U32 `[1]`): the
/// first positions of a chunk's sub-chunks of `step` tokens, on the device.
pub fn chunk_positions(
    dev: &Device,
    pos: &DeviceTensor<u32>,
    out: &mut DeviceTensor<u32>,
    step: u32,
) -> Result<(), GpuError> {
    pos.expect("position", DType::U32, &[1])?;
    let count = out.len();
    out.expect("sub-chunk positions", DType::U32, &[count])?;
    if count == 0 {
        return Ok(());
    }
    // SAFETY: pos holds one u32, out `count`.
    unsafe {
        launch(
            dev,
            "chunk_positions",
            elementwise(count as u64),
            Args::new()
                .ptr(pos)
                .ptr(out)
                .arg(dim_u32("sub-chunks", count)?)
                .arg(step),
        )
    }?;
    Ok(())
}

/// An activation element type (F32 or BF16) a kernel reads or writes.
pub trait ActElem: DeviceElem {
    const DTYPE: DType;
}

impl ActElem for f32 {
    const DTYPE: DType = DType::F32;
}

impl ActElem for bf16 {
    const DTYPE: DType = DType::BF16;
}
