//! Launchers of the format kernels (`kernels/formats.cu`). Each one checks dtypes and shapes,
//! then enqueues on the device stream without synchronizing or reading anything back, so all
//! of them can be captured into CUDA graphs. CPU references: [`reference`].

pub mod reference;
#[cfg(test)]
mod tests;

use cudarc::driver::{LaunchConfig, PushKernelArg};
use half::bf16;

use super::launch::{dim_u32, elementwise, grid_for, launch_err};
use super::{DType, Device, DeviceElem, DeviceTensor, GpuError};
pub use crate::codecs::fp8_block::ScaleFormat;
pub use reference::{swizzled_dims, KV_DIM, KV_RECORD};

/// Output buffers of [`nvfp4_quantize_act`] for `[rows, cols]` activations.
pub struct Nvfp4Act {
    /// E2M1x2 `[rows, ceil(cols/2)]`.
    pub packed: DeviceTensor<u8>,
    /// E4M3 `[rows, ceil(cols/16)]`, row-major (swizzle separately for Blackwell MMA).
    pub scales: DeviceTensor<u8>,
    /// F32 `[1]`: amax / (6 * 448).
    pub global: DeviceTensor<f32>,
    /// U32 `[1]` workspace: the amax accumulator.
    pub amax: DeviceTensor<u32>,
}

impl Nvfp4Act {
    pub fn shapes(rows: usize, cols: usize) -> [(DType, Vec<usize>); 4] {
        [
            (DType::E2M1x2, vec![rows, cols.div_ceil(2)]),
            (DType::E4M3, vec![rows, cols.div_ceil(16)]),
            (DType::F32, vec![1]),
            (DType::U32, vec![1]),
        ]
    }

    /// Separately allocated buffers (tests, one-off use); pools reserve [`Nvfp4Act::shapes`].
    pub fn alloc(dev: &Device, rows: usize, cols: usize) -> Result<Nvfp4Act, GpuError> {
        let [p, s, g, a] = Nvfp4Act::shapes(rows, cols);
        Ok(Nvfp4Act {
            packed: dev.alloc(p.0, &p.1)?,
            scales: dev.alloc(s.0, &s.1)?,
            global: dev.alloc(g.0, &g.1)?,
            amax: dev.alloc(a.0, &a.1)?,
        })
    }
}

/// NVFP4-quantizes bf16 activations `x [rows, cols]`: the global scale comes from the tensor
/// amax, computed and applied on the device (no host round trip). Matches
/// [`reference::nvfp4_quantize_act`] bit for bit.
pub fn nvfp4_quantize_act(
    dev: &Device,
    x: &DeviceTensor<bf16>,
    out: &mut Nvfp4Act,
) -> Result<(), GpuError> {
    let (rows, cols) = x.dims2("nvfp4 activations", DType::BF16)?;
    let [p, s, g, a] = Nvfp4Act::shapes(rows, cols);
    out.packed.expect("nvfp4 packed output", p.0, &p.1)?;
    out.scales.expect("nvfp4 scale output", s.0, &s.1)?;
    out.global.expect("nvfp4 global scale output", g.0, &g.1)?;
    out.amax.expect("nvfp4 amax workspace", a.0, &a.1)?;
    let (r32, c32) = (dim_u32("rows", rows)?, dim_u32("cols", cols)?);
    let n = (rows * cols) as u64;
    let stream = dev.stream();
    {
        let mut amax = out.amax.view_mut();
        stream
            .memset_zeros(&mut amax)
            .map_err(GpuError::driver("clearing the amax accumulator"))?;
        if n > 0 {
            let f = dev.function("nvfp4_act_amax")?;
            // SAFETY: x holds n bf16 values; amax is one u32.
            unsafe {
                stream
                    .launch_builder(f)
                    .arg(x.slice())
                    .arg(&n)
                    .arg(&mut amax)
                    .launch(elementwise(n))
            }
            .map_err(launch_err("nvfp4_act_amax"))?;
        }
    }
    let blocks = (rows * cols.div_ceil(16)) as u64;
    let f = dev.function("nvfp4_act_quantize")?;
    let mut packed = out.packed.view_mut();
    let mut scales = out.scales.view_mut();
    let mut global = out.global.view_mut();
    // With no blocks the kernel still writes the global scale (one thread).
    let cfg = if blocks == 0 {
        grid_for(1, 1, 32)
    } else {
        elementwise(blocks)
    };
    // SAFETY: shapes checked above against [rows, cols].
    unsafe {
        stream
            .launch_builder(f)
            .arg(x.slice())
            .arg(&r32)
            .arg(&c32)
            .arg(out.amax.slice())
            .arg(&mut packed)
            .arg(&mut scales)
            .arg(&mut global)
            .launch(cfg)
    }
    .map_err(launch_err("nvfp4_act_quantize"))?;
    Ok(())
}

/// NVFP4 to bf16: `packed` E2M1x2 `[rows, ceil(cols/2)]`, `scales` E4M3 `[rows, ceil(cols/16)]`,
/// `global` F32 `[1]`, `out` `[rows, cols]`.
pub fn nvfp4_dequant(
    dev: &Device,
    packed: &DeviceTensor<u8>,
    scales: &DeviceTensor<u8>,
    global: &DeviceTensor<f32>,
    out: &mut DeviceTensor<bf16>,
) -> Result<(), GpuError> {
    let (rows, cols) = out.dims2("nvfp4 dequant output", DType::BF16)?;
    packed.expect("nvfp4 packed", DType::E2M1x2, &[rows, cols.div_ceil(2)])?;
    scales.expect("nvfp4 scales", DType::E4M3, &[rows, cols.div_ceil(16)])?;
    global.expect("nvfp4 global scale", DType::F32, &[1])?;
    launch_fp4_dequant(dev, "nvfp4_dequant", packed, scales, Some(global), out)
}

/// MXFP4 to bf16: `packed` E2M1x2 `[rows, ceil(cols/2)]`, `scales` E8M0 `[rows, ceil(cols/32)]`.
pub fn mxfp4_dequant(
    dev: &Device,
    packed: &DeviceTensor<u8>,
    scales: &DeviceTensor<u8>,
    out: &mut DeviceTensor<bf16>,
) -> Result<(), GpuError> {
    let (rows, cols) = out.dims2("mxfp4 dequant output", DType::BF16)?;
    packed.expect("mxfp4 packed", DType::E2M1x2, &[rows, cols.div_ceil(2)])?;
    scales.expect("mxfp4 scales", DType::E8M0, &[rows, cols.div_ceil(32)])?;
    launch_fp4_dequant(dev, "mxfp4_dequant", packed, scales, None, out)
}

/// One thread per packed byte of an FP4 dequantize `(packed, scales, [global,] rows, cols,
/// out)`; only NVFP4 has the global scale.
fn launch_fp4_dequant(
    dev: &Device,
    kernel: &'static str,
    packed: &DeviceTensor<u8>,
    scales: &DeviceTensor<u8>,
    global: Option<&DeviceTensor<f32>>,
    out: &mut DeviceTensor<bf16>,
) -> Result<(), GpuError> {
    let n = packed.len() as u64;
    if n == 0 {
        return Ok(());
    }
    // The callers checked out as [rows, cols] and the inputs against it.
    let (rows, cols) = (out.shape()[0], out.shape()[1]);
    let (r32, c32) = (dim_u32("rows", rows)?, dim_u32("cols", cols)?);
    let f = dev.function(kernel)?;
    let mut o = out.view_mut();
    let stream = dev.stream();
    let mut b = stream.launch_builder(f);
    b.arg(packed.slice()).arg(scales.slice());
    if let Some(g) = global {
        b.arg(g.slice());
    }
    b.arg(&r32).arg(&c32).arg(&mut o);
    // SAFETY: the callers checked every shape.
    unsafe { b.launch(elementwise(n)) }.map_err(launch_err(kernel))?;
    Ok(())
}

/// Block scales of an FP8 weight: e8m0 bytes (instruct releases) or f32 (Base releases), shape
/// `[ceil(rows/block_rows), ceil(cols/block_cols)]`.
pub enum Fp8Scales<'a> {
    E8m0(&'a DeviceTensor<u8>),
    F32(&'a DeviceTensor<f32>),
}

/// FP8 e4m3 `w [rows, cols]` with block scales to bf16 `out [rows, cols]`.
pub fn fp8_block_dequant(
    dev: &Device,
    w: &DeviceTensor<u8>,
    scales: Fp8Scales<'_>,
    block: (usize, usize),
    out: &mut DeviceTensor<bf16>,
) -> Result<(), GpuError> {
    let (rows, cols) = w.dims2("fp8 weight", DType::E4M3)?;
    out.expect("fp8 dequant output", DType::BF16, &[rows, cols])?;
    if block.0 == 0 || block.1 == 0 {
        return Err(GpuError::invalid(
            "fp8 block",
            format!("block {block:?} must be non-zero"),
        ));
    }
    let sshape = [rows.div_ceil(block.0), cols.div_ceil(block.1)];
    match &scales {
        Fp8Scales::E8m0(s) => s.expect("fp8 scales", DType::E8M0, &sshape)?,
        Fp8Scales::F32(s) => s.expect("fp8 scales", DType::F32, &sshape)?,
    }
    let n = w.len() as u64;
    if n == 0 {
        return Ok(());
    }
    let (r32, c32) = (dim_u32("rows", rows)?, dim_u32("cols", cols)?);
    let (br, bc) = (
        dim_u32("block rows", block.0)?,
        dim_u32("block cols", block.1)?,
    );
    let name = match scales {
        Fp8Scales::E8m0(_) => "fp8_block_dequant_e8m0",
        Fp8Scales::F32(_) => "fp8_block_dequant_f32",
    };
    let f = dev.function(name)?;
    let mut o = out.view_mut();
    let stream = dev.stream();
    let mut b = stream.launch_builder(f);
    b.arg(w.slice());
    match &scales {
        Fp8Scales::E8m0(s) => b.arg(s.slice()),
        Fp8Scales::F32(s) => b.arg(s.slice()),
    };
    b.arg(&r32).arg(&c32).arg(&br).arg(&bc).arg(&mut o);
    // SAFETY: shapes checked above.
    unsafe { b.launch(elementwise(n)) }.map_err(launch_err(name))?;
    Ok(())
}

/// Row-major scales `[rows, cols]` (E4M3 or E8M0) to the Blackwell 32_4_4 layout,
/// `out [ceil(rows/128)*128, ceil(cols/4)*4]` of the same dtype (padding zeroed).
pub fn scale_swizzle_32_4_4(
    dev: &Device,
    scales: &DeviceTensor<u8>,
    out: &mut DeviceTensor<u8>,
) -> Result<(), GpuError> {
    let (rows, cols) = scale_dims("swizzle input", scales)?;
    out.expect("swizzle output", scales.dtype(), &swizzled_dims(rows, cols))?;
    launch_swizzle(dev, "scale_swizzle_32_4_4", scales, out, rows, cols)
}

/// Inverse of [`scale_swizzle_32_4_4`]: `swizzled` back to row-major `out [rows, cols]`.
pub fn scale_unswizzle_32_4_4(
    dev: &Device,
    swizzled: &DeviceTensor<u8>,
    out: &mut DeviceTensor<u8>,
) -> Result<(), GpuError> {
    let (rows, cols) = scale_dims("unswizzle output", out)?;
    swizzled.expect("unswizzle input", out.dtype(), &swizzled_dims(rows, cols))?;
    launch_swizzle(dev, "scale_unswizzle_32_4_4", swizzled, out, rows, cols)
}

/// `(rows, cols)` of a row-major scale matrix, which must be 2-D E4M3 or E8M0.
fn scale_dims(what: &str, scales: &DeviceTensor<u8>) -> Result<(usize, usize), GpuError> {
    let &[rows, cols] = scales.shape() else {
        return Err(GpuError::invalid(
            what,
            format!("expected 2-D, got {:?}", scales.shape()),
        ));
    };
    if !matches!(scales.dtype(), DType::E4M3 | DType::E8M0) {
        return Err(GpuError::invalid(
            what,
            format!("{:?} is not a scale dtype", scales.dtype()),
        ));
    }
    Ok((rows, cols))
}

/// One thread per output byte of a (un)swizzle over a `[rows, cols]` row-major scale matrix.
fn launch_swizzle(
    dev: &Device,
    kernel: &'static str,
    input: &DeviceTensor<u8>,
    out: &mut DeviceTensor<u8>,
    rows: usize,
    cols: usize,
) -> Result<(), GpuError> {
    let n = out.len() as u64;
    if n == 0 {
        return Ok(());
    }
    let (r32, c32) = (dim_u32("rows", rows)?, dim_u32("cols", cols)?);
    let f = dev.function(kernel)?;
    let mut o = out.view_mut();
    // SAFETY: the callers checked both shapes against [rows, cols].
    unsafe {
        dev.stream()
            .launch_builder(f)
            .arg(input.slice())
            .arg(&r32)
            .arg(&c32)
            .arg(&mut o)
            .launch(elementwise(n))
    }
    .map_err(launch_err(kernel))?;
    Ok(())
}

/// Tokens per block of the KV kernels (one warp each).
const KV_WARPS: u32 = 4;

fn kv_launch(tokens: usize) -> LaunchConfig {
    grid_for(tokens as u64, KV_WARPS as u64, 32 * KV_WARPS)
}

/// bf16 KV vectors `kv [tokens, 512]` to FP8 records `records` U8 `[tokens, 584]`
/// (see [`reference::kv_fp8_quantize`] for the layout).
pub fn kv_fp8_quantize(
    dev: &Device,
    kv: &DeviceTensor<bf16>,
    records: &mut DeviceTensor<u8>,
) -> Result<(), GpuError> {
    let tokens = kv_tokens("kv input", kv, KV_DIM)?;
    kv.expect("kv input", DType::BF16, &[tokens, KV_DIM])?;
    records.expect("kv records", DType::U8, &[tokens, KV_RECORD])?;
    launch_kv(dev, "kv_fp8_quantize", kv, records, tokens)
}

/// FP8 records U8 `[tokens, 584]` to bf16 `kv [tokens, 512]`.
pub fn kv_fp8_dequant(
    dev: &Device,
    records: &DeviceTensor<u8>,
    kv: &mut DeviceTensor<bf16>,
) -> Result<(), GpuError> {
    let tokens = kv_tokens("kv records", records, KV_RECORD)?;
    records.expect("kv records", DType::U8, &[tokens, KV_RECORD])?;
    kv.expect("kv output", DType::BF16, &[tokens, KV_DIM])?;
    launch_kv(dev, "kv_fp8_dequant", records, kv, tokens)
}

/// Rows of a `[tokens, width]` tensor.
fn kv_tokens<T: DeviceElem>(
    what: &str,
    t: &DeviceTensor<T>,
    width: usize,
) -> Result<usize, GpuError> {
    match t.shape() {
        &[tokens, w] if w == width => Ok(tokens),
        s => Err(GpuError::invalid(
            what,
            format!("expected [tokens, {width}], got {s:?}"),
        )),
    }
}

/// One warp per token of a KV record kernel `(input, tokens, output)`.
fn launch_kv<I: DeviceElem, O: DeviceElem>(
    dev: &Device,
    kernel: &'static str,
    input: &DeviceTensor<I>,
    out: &mut DeviceTensor<O>,
    tokens: usize,
) -> Result<(), GpuError> {
    if tokens == 0 {
        return Ok(());
    }
    let t32 = dim_u32("tokens", tokens)?;
    let f = dev.function(kernel)?;
    let mut o = out.view_mut();
    // SAFETY: the callers checked both shapes against `tokens`.
    unsafe {
        dev.stream()
            .launch_builder(f)
            .arg(input.slice())
            .arg(&t32)
            .arg(&mut o)
            .launch(kv_launch(tokens))
    }
    .map_err(launch_err(kernel))?;
    Ok(())
}
