//! Load-time re-layouts on the device (`kernels/relayout.cu`): checkpoint bytes, copied up as
//! stored (through a [`Stager`]), become the tiles and scales the decode kernels read, so that
//! loading costs the host only the copy. CPU reference: [`reference`].

pub mod reference;
#[cfg(test)]
mod tests;

use cudarc::driver::DeviceRepr;

use super::gemv::pack::{fp4_source_bit, CodeOrder, Layout, STEP_CHUNKS};
use super::launch::{dim_u32, elementwise, launch, launch_struct, Args, THREADS};
use super::stager::Stager;
use super::{DType, Device, DeviceTensor, GpuError};
use crate::codecs::fp8_block::ScaleFormat;

/// Mirrors `PackArgs` in relayout.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct PackArgs {
    dst: u64,
    w: u64,
    w3: u64,
    slots: u64,
    rows: u32,
    chunks: u32,
    steps: u32,
    unit: u32,
    gate_up: u32,
    fp4: u32,
    source_bit: [u8; 32],
}

// SAFETY: plain data laid out as the kernel's struct.
unsafe impl DeviceRepr for PackArgs {}

/// Rows of one tile of `layout`'s source (of each of W1 and W3 for gate+up).
fn tile_rows(layout: &Layout) -> usize {
    if layout.gate_up {
        8
    } else {
        16
    }
}

/// Bytes of `layout`'s packed tiles with `unit` bytes per chunk.
pub fn packed_bytes(layout: &Layout, unit: usize) -> usize {
    layout.slots() * unit
}

fn in_bounds(what: &str, at: usize, len: usize, size: usize) -> Result<(), GpuError> {
    if at.checked_add(len).is_some_and(|end| end <= size) {
        Ok(())
    } else {
        Err(GpuError::invalid(
            what,
            format!("{len} bytes at {at} of a {size}-byte tensor"),
        ))
    }
}

/// Packs a row-major matrix of `layout` (`unit` bytes per 16-byte chunk: 16 for codes, 2 for
/// NVFP4 and 1 for MXFP4 scales) into its tiles at byte `dst_at` of `dst`, as
/// [`reference::pack_tiles`]. Its rows are at byte `w_at` of `src`, and for gate+up W3's rows
/// at `w3_at`. `order` reorders codes (unit 16 only).
#[allow(clippy::too_many_arguments)]
pub fn pack_tiles(
    dev: &Device,
    dst: &mut DeviceTensor<u8>,
    dst_at: usize,
    src: &DeviceTensor<u8>,
    w_at: usize,
    w3_at: Option<usize>,
    layout: &Layout,
    unit: usize,
    order: CodeOrder,
) -> Result<(), GpuError> {
    let what = "pack_tiles";
    if ![1, 2, 16].contains(&unit) || (order == CodeOrder::Fp4 && unit != 16) {
        return Err(GpuError::invalid(
            what,
            format!("unit {unit} with {order:?} codes: units are 16 (codes), 2 or 1 (scales)"),
        ));
    }
    if layout.rows == 0 || layout.chunks == 0 || layout.gate_up != w3_at.is_some() {
        return Err(GpuError::invalid(
            what,
            format!("{layout:?}: rows and chunks must be positive, W3 given exactly for gate+up"),
        ));
    }
    let source = layout.rows * layout.chunks * unit;
    in_bounds(what, dst_at, packed_bytes(layout, unit), dst.len())?;
    in_bounds(what, w_at, source, src.len())?;
    if let Some(at) = w3_at {
        in_bounds(what, at, source, src.len())?;
    }
    let addr = |t: &DeviceTensor<u8>, at: usize| t.device_address() + at as u64;
    if unit == 16
        && [
            addr(dst, dst_at),
            addr(src, w_at),
            addr(src, w3_at.unwrap_or(w_at)),
        ]
        .iter()
        .any(|a| a % 16 != 0)
    {
        return Err(GpuError::invalid(
            what,
            "16-byte units need 16-byte aligned addresses",
        ));
    }
    let mut source_bit = [0u8; 32];
    for (b, s) in source_bit.iter_mut().enumerate() {
        let (e, bit) = fp4_source_bit(b as u32);
        *s = (4 * e + bit) as u8;
    }
    let slots = layout.slots() as u64;
    let args = PackArgs {
        dst: addr(dst, dst_at),
        w: addr(src, w_at),
        w3: addr(src, w3_at.unwrap_or(w_at)),
        slots,
        rows: dim_u32(what, layout.rows)?,
        chunks: dim_u32(what, layout.chunks)?,
        steps: dim_u32(what, layout.steps())?,
        unit: unit as u32,
        gate_up: u32::from(layout.gate_up),
        fp4: u32::from(order == CodeOrder::Fp4),
        source_bit,
    };
    let grid = elementwise(slots).grid_dim;
    // SAFETY: the ranges read and written were checked above.
    unsafe { launch_struct(dev, "pack_tiles", grid, (THREADS, 0), &args, false, 1) }
}

/// The kernels' FP8 scales of an `[n, k]` weight in `block`s, as
/// [`reference::fp8_scale_rows`], from its raw scale bytes at byte `raw_at` of `raw`.
#[allow(clippy::too_many_arguments)]
pub fn fp8_scale_rows(
    dev: &Device,
    out: &mut DeviceTensor<f32>,
    raw: &DeviceTensor<u8>,
    raw_at: usize,
    sf: ScaleFormat,
    n: usize,
    k: usize,
    block: (usize, usize),
) -> Result<(), GpuError> {
    let what = "fp8_scale_rows";
    if n == 0 || k == 0 || block.0 == 0 || block.1 == 0 || !block.1.is_multiple_of(64) {
        return Err(GpuError::invalid(
            what,
            format!("[{n}, {k}] in {block:?} blocks: all positive, block columns a multiple of 64"),
        ));
    }
    let (rows, cols, groups) = (n.div_ceil(block.0), k.div_ceil(block.1), k.div_ceil(64));
    out.expect(what, DType::F32, &[rows, groups + 1])?;
    in_bounds(what, raw_at, rows * cols * sf.bytes(), raw.len())?;
    // SAFETY: out is [rows, groups + 1] f32 and raw holds rows * cols scales from raw_at.
    unsafe {
        launch(
            dev,
            "fp8_scale_rows",
            elementwise(rows as u64),
            Args::new()
                .ptr(out)
                .arg(raw.device_address() + raw_at as u64)
                .arg(dim_u32(what, rows)?)
                .arg(dim_u32(what, cols)?)
                .arg(dim_u32(what, groups)?)
                .arg(dim_u32(what, block.1)?)
                .arg(u32::from(sf == ScaleFormat::F32)),
        )
    }
}

/// The slices of `pieces` (read one after another) that cover bytes `range`.
fn cover<'a>(pieces: &[&'a [u8]], range: std::ops::Range<usize>) -> Vec<&'a [u8]> {
    let mut start = 0;
    let mut out = Vec::new();
    for p in pieces {
        let end = start + p.len();
        let (lo, hi) = (range.start.max(start), range.end.min(end));
        if lo < hi {
            out.push(&p[lo - start..hi - start]);
        }
        start = end;
    }
    out
}

/// Packs a host row-major matrix of `layout` into `dst` from byte `dst_at`, through `st` in
/// chunks of whole tiles: `w` (and `w3` for gate+up; empty otherwise) is given as pieces read
/// one after another, such as the row blocks of matrices stacked on whole tiles (16 rows, 8
/// for gate+up), whose tiles are then those of each block in turn.
#[allow(clippy::too_many_arguments)]
pub fn pack_from_host(
    st: &mut Stager<'_>,
    dst: &mut DeviceTensor<u8>,
    dst_at: usize,
    layout: &Layout,
    unit: usize,
    order: CodeOrder,
    w: &[&[u8]],
    w3: &[&[u8]],
) -> Result<(), GpuError> {
    let row = layout.chunks * unit;
    let source = layout.rows * row;
    let len = |p: &[&[u8]]| p.iter().map(|x| x.len()).sum::<usize>();
    if len(w) != source || len(w3) != if layout.gate_up { source } else { 0 } {
        return Err(GpuError::invalid(
            "pack",
            format!(
                "{} and {} bytes where {layout:?} at {unit} bytes a chunk needs {source}{}",
                len(w),
                len(w3),
                if layout.gate_up { " each" } else { " and none" }
            ),
        ));
    }
    let tr = tile_rows(layout);
    let mats = if layout.gate_up { 2 } else { 1 };
    let tile_bytes = layout.steps() * STEP_CHUNKS * 16 * unit;
    let tiles = (st.slot_bytes() / (tr * row * mats)).max(1);
    let mut r0 = 0;
    while r0 < layout.rows {
        let r1 = layout.rows.min(r0 + tiles * tr);
        let part = Layout {
            rows: r1 - r0,
            ..*layout
        };
        let mut pieces = cover(w, r0 * row..r1 * row);
        if layout.gate_up {
            pieces.extend(cover(w3, r0 * row..r1 * row));
        }
        let dev = st.device();
        let scratch = st.stage(&pieces)?;
        let w3_at = layout.gate_up.then_some((r1 - r0) * row);
        pack_tiles(
            dev,
            dst,
            dst_at + r0 / tr * tile_bytes,
            scratch,
            0,
            w3_at,
            &part,
            unit,
            order,
        )?;
        r0 = r1;
    }
    Ok(())
}

/// [`fp8_scale_rows`] from host scale bytes (`raw`'s pieces one after another: the scale rows
/// of weights stacked on whole blocks), through `st`.
pub fn fp8_scales_from_host(
    st: &mut Stager<'_>,
    raw: &[&[u8]],
    sf: ScaleFormat,
    n: usize,
    k: usize,
    block: (usize, usize),
) -> Result<DeviceTensor<f32>, GpuError> {
    let staged: usize = raw.iter().map(|p| p.len()).sum();
    let want = n.div_ceil(block.0) * k.div_ceil(block.1.max(1)) * sf.bytes();
    if staged != want {
        return Err(GpuError::invalid(
            "fp8 scales",
            format!("{staged} bytes where [{n}, {k}] in {block:?} blocks has {want}"),
        ));
    }
    let dev = st.device();
    let mut out = dev.alloc::<f32>(DType::F32, &[n.div_ceil(block.0), k.div_ceil(64) + 1])?;
    let scratch = st.stage(raw)?;
    fp8_scale_rows(dev, &mut out, scratch, 0, sf, n, k, block)?;
    Ok(out)
}
