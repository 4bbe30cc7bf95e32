//! Counter-based random fills on the device (`kernels/random.cu`): the weights of a synthetic
//! model written in place, in the kernels' layouts, so that a benchmark needs no checkpoint on
//! disk. Element `i` of a fill depends only on `(seed, i)`. CPU reference: [`reference`].

pub mod reference;
#[cfg(test)]
mod tests;

use cudarc::driver::LaunchConfig;

use super::launch::{launch, Args};
use super::{Device, DeviceElem, DeviceTensor, GpuError};
use crate::codecs::{e2m1, e4m3};
use half::{bf16, f16};

/// Bytes `lo + u · span` for u uniform in [0, 1) (span 1 gives the constant `lo`), with the
/// top bit set at random when `signed`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bytes {
    pub lo: u8,
    /// In 1..=256 and at most `256 - lo`.
    pub span: u16,
    pub signed: bool,
}

impl Bytes {
    /// Every byte value equally likely.
    pub const ANY: Bytes = Bytes {
        lo: 0,
        span: 256,
        signed: false,
    };

    pub const fn constant(b: u8) -> Bytes {
        Bytes {
            lo: b,
            span: 1,
            signed: false,
        }
    }
}

/// Uniform values in `[mean - half_range, mean + half_range)` (rounded to the tensor's type by
/// [`fill_uniform`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Uniform {
    pub mean: f32,
    pub half_range: f32,
}

/// A grid of one wave of 256-thread blocks; the kernels stride over the rest.
fn grid(dev: &Device, n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 8 * dev.sm_count().max(1));
    LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Fills `out` with [`reference::byte`]`(seed, i, dist)`.
pub fn fill_bytes(
    dev: &Device,
    out: &mut DeviceTensor<u8>,
    seed: u64,
    dist: Bytes,
) -> Result<(), GpuError> {
    if dist.span == 0 || dist.lo as usize + dist.span as usize > 256 {
        return Err(GpuError::invalid(
            "random bytes",
            format!(
                "span {} must be in 1..={} (256 - lo {})",
                dist.span,
                256 - dist.lo as usize,
                dist.lo
            ),
        ));
    }
    if out.is_empty() {
        return Ok(());
    }
    // SAFETY: out holds out.len() bytes.
    unsafe {
        launch(
            dev,
            "random_bytes",
            grid(dev, out.len()),
            Args::new()
                .ptr(out)
                .arg(out.len() as u64)
                .arg(seed)
                .arg(dist.lo as u32)
                .arg(dist.span as u32)
                .arg(u32::from(dist.signed)),
        )
    }
}

/// The element types a uniform fill writes, each with the kernel that rounds
/// [`reference::f32_value`] to it.
pub trait UniformElem: DeviceElem {
    const KERNEL: &'static str;
}
impl UniformElem for bf16 {
    const KERNEL: &'static str = "random_bf16";
}
impl UniformElem for f16 {
    const KERNEL: &'static str = "random_f16";
}
impl UniformElem for f32 {
    const KERNEL: &'static str = "random_f32";
}

/// Fills `out` with [`reference::f32_value`]`(seed, i, dist)` rounded to its element type
/// ([`reference::bf16_value`], [`reference::f16_value`]).
pub fn fill_uniform<T: UniformElem>(
    dev: &Device,
    out: &mut DeviceTensor<T>,
    seed: u64,
    dist: Uniform,
) -> Result<(), GpuError> {
    let n = out.len();
    // SAFETY: out holds n values of T, the kernel's type.
    unsafe { launch_uniform(dev, T::KERNEL, out.device_address(), n, seed, dist) }
}

/// [`fill_uniform`] over `n` BF16 values at `address` (BF16 codes inside a byte tensor).
pub(crate) fn fill_bf16_at(
    dev: &Device,
    address: u64,
    n: usize,
    seed: u64,
    dist: Uniform,
) -> Result<(), GpuError> {
    // SAFETY: the caller's address holds n BF16 values.
    unsafe { launch_uniform(dev, <bf16 as UniformElem>::KERNEL, address, n, seed, dist) }
}

/// Launches `kernel` (a [`UniformElem::KERNEL`]) over `n` values at `address`.
///
/// # Safety
/// `address` must hold `n` values of the kernel's type.
unsafe fn launch_uniform(
    dev: &Device,
    kernel: &str,
    address: u64,
    n: usize,
    seed: u64,
    dist: Uniform,
) -> Result<(), GpuError> {
    if !(dist.mean.is_finite() && dist.half_range.is_finite()) {
        return Err(GpuError::invalid(
            "random fill",
            format!(
                "mean {} and half range {} must be finite",
                dist.mean, dist.half_range
            ),
        ));
    }
    if n == 0 {
        return Ok(());
    }
    // SAFETY: the caller's.
    unsafe {
        launch(
            dev,
            kernel,
            grid(dev, n),
            Args::new()
                .arg(address)
                .arg(n as u64)
                .arg(seed)
                .arg(dist.mean)
                .arg(dist.half_range),
        )
    }
}

/// FP8 e4m3 codes below 1 in magnitude (exponent fields 0-6), either sign.
pub const FP8_CODES: Bytes = Bytes {
    lo: 0,
    span: 0x38,
    signed: true,
};

/// RMS of the values [`FP8_CODES`] draws.
pub fn fp8_codes_rms() -> f32 {
    let sum: f32 = (0..0x38u8).map(|b| e4m3::decode(b).powi(2)).sum();
    (sum / 0x38 as f32).sqrt()
}

/// RMS of e2m1 values, every code equally likely (random FP4 bytes).
pub fn e2m1_rms() -> f32 {
    let sum: f32 = e2m1::LUT.iter().map(|v| v * v).sum();
    (sum / e2m1::LUT.len() as f32).sqrt()
}

/// The scale that makes codes of RMS `code_rms` a `[n, k]` weight of RMS `1/sqrt(k)`, whose
/// rows turn a unit-RMS input into outputs of about unit variance.
pub fn unit_scale(code_rms: f32, k: usize) -> f32 {
    1.0 / (code_rms * (k as f32).sqrt())
}

/// The E8M0 byte of the power of two nearest [`unit_scale`].
pub fn unit_scale_e8m0(code_rms: f32, k: usize) -> u8 {
    (127.0 + unit_scale(code_rms, k).log2().round()).clamp(0.0, 254.0) as u8
}
