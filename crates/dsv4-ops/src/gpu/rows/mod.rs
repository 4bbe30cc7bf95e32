//! Launchers of the row kernels (`kernels/rows.cu`): the embedding gather into the mHC
//! streams, RMSNorm and the rotary embedding. Token ids and positions are device buffers, so the
//! launches capture into a decode graph that replays with whatever the previous step wrote
//! there. CPU references: [`reference`].

pub mod reference;
#[cfg(test)]
mod tests;

use cudarc::driver::LaunchConfig;
use half::bf16;

use super::launch::{dim_u32, elementwise, launch, Args};
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
    norm_rows(dev, x.into(), weight, eps, out, out_b, None)
}

/// The rotary embedding [`rms_norm_rope_rows`] applies after the norm.
pub struct RowRope<'a> {
    /// `[half]`: the last `2·half` channels of each row rotate.
    pub inv_freq: &'a DeviceTensor<f32>,
    /// U32 `[1]`, the first row's position.
    pub pos: &'a DeviceTensor<u32>,
    /// Rows of one token (heads); row `r` sits at position `pos[0] + r / rows_per_token`.
    pub rows_per_token: usize,
}

/// [`rms_norm_rows`] then [`rope_rows`] (forward) on its output, in one launch.
pub fn rms_norm_rope_rows<'a>(
    dev: &Device,
    x: impl Into<ColRange<'a>>,
    weight: Option<&DeviceTensor<f32>>,
    eps: f32,
    rope: &RowRope,
    out: &mut DeviceTensor<f32>,
) -> Result<(), GpuError> {
    norm_rows(dev, x.into(), weight, eps, out, None, Some(rope))
}

fn norm_rows(
    dev: &Device,
    x: ColRange,
    weight: Option<&DeviceTensor<f32>>,
    eps: f32,
    out: &mut DeviceTensor<f32>,
    out_b: Option<&mut DeviceTensor<bf16>>,
    rope: Option<&RowRope>,
) -> Result<(), GpuError> {
    let (rows, stride) = x.x.dims2("rms_norm input", DType::F32)?;
    let width = x.width;
    if x.first + width > stride {
        return Err(GpuError::invalid(
            "rms_norm",
            format!(
                "columns {}..{} of rows of {stride}",
                x.first,
                x.first + width
            ),
        ));
    }
    out.expect("rms_norm output", DType::F32, &[rows, width])?;
    if let Some(b) = &out_b {
        b.expect("rms_norm BF16 output", DType::BF16, &[rows, width])?;
    }
    // Null selects no BF16 copy inside the kernel.
    let out_b = out_b.map_or(0, |b| b.device_address());
    if let Some(w) = weight {
        w.expect("rms_norm weight", DType::F32, &[width])?;
    }
    let (inv_freq, half, pos, per_token) = match rope {
        Some(r) => {
            let half = r.inv_freq.len();
            r.inv_freq
                .expect("rope inverse frequencies", DType::F32, &[half])?;
            r.pos.expect("rope position", DType::U32, &[1])?;
            if 2 * half > width || r.rows_per_token == 0 || rows % r.rows_per_token != 0 {
                return Err(GpuError::invalid(
                    "rms_norm_rope",
                    format!(
                        "{rows} rows of {width} with {} rotated channels, {} rows a token",
                        2 * half,
                        r.rows_per_token
                    ),
                ));
            }
            let half = dim_u32("rope half", half)?;
            let per_token = dim_u32("rows per token", r.rows_per_token)?;
            (
                r.inv_freq.device_address(),
                half,
                r.pos.device_address(),
                per_token,
            )
        }
        None => (0, 0, 0, 1),
    };
    if rows == 0 || width == 0 {
        return Ok(());
    }
    let (r32, w32, s32) = (
        dim_u32("rows", rows)?,
        dim_u32("width", width)?,
        dim_u32("row stride", stride)?,
    );
    // Null selects the unscaled norm inside the kernel.
    let weight_ptr: u64 = weight.map_or(0, DeviceTensor::device_address);
    // About four columns a thread, so that one row (a decode step's norm) spreads over a
    // whole block of up to 1024 threads; the size depends on the width only.
    let threads = (w32 / 4).next_multiple_of(32).clamp(32, 1024);
    let cfg = LaunchConfig {
        grid_dim: (r32.min(1 << 16), 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: x is [rows, stride] read from column `first` on, first + width <= stride; out and
    // out_b (when not null) are [rows, width], weight (when not null)
    // [width], inv_freq (when not null) [half] with 2·half <= width and pos [1], checked
    // above.
    unsafe {
        launch(
            dev,
            "rms_norm_rows",
            cfg,
            Args::new()
                .arg(x.x.device_address() + (x.first * 4) as u64)
                .arg(s32)
                .arg(r32)
                .arg(w32)
                .arg(weight_ptr)
                .arg(eps)
                .ptr(out)
                .arg(out_b)
                .arg(inv_freq)
                .arg(half)
                .arg(pos)
                .arg(per_token),
        )
    }?;
    Ok(())
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
/// (`pos`: U32 `[1]` on the device). Pairs `(2i, 2i+1)` turn by `position · inv_freq[i]`.
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
    pos.expect("rope position", DType::U32, &[1])?;
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
    // SAFETY: x [tokens, heads * width] with 2 * half <= width, inv_freq [half], pos [1].
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
                .arg(sign),
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
