//! Decode GEMV / small-M GEMM launchers (`kernels/gemv.cu`): `y[M, N] = x[M, K] · W[N, K]ᵀ`
//! for `M <= 16` bf16 activation rows, with weights in BF16, FP8 e4m3 with block scales,
//! NVFP4 or MXFP4, dequantized in registers (W4A16 / W8A16 on tensor cores). The fused
//! [`gemv_swiglu`] computes `silu(min(x·W1ᵀ, L)) · clamp(x·W3ᵀ, −L, L)` in one pass.
//!
//! Launchers check every shape and enqueue on the device stream without synchronizing or
//! reading back, so they can be captured into CUDA graphs. Small-N problems split K across
//! blocks through a [`GemvWorkspace`] (reserve it in the [`BufferPool`]); the split partials
//! are summed in a fixed order, so results never depend on timing. CPU references:
//! [`reference`].

use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use half::bf16;

use super::launch::dim_u32;
use super::{BufferPool, DType, Device, DeviceTensor, GpuError, Reservation};
use crate::codecs::fp8_block::ScaleFormat;
use crate::codecs::mxfp4::Mxfp4Quantized;
use crate::codecs::nvfp4::Nvfp4Quantized;

/// Largest number of activation rows one launch takes.
pub const MAX_M: usize = 16;

/// Largest MXFP4 scale byte the kernels take: 2^17. Larger block scales would overflow the
/// bf16 operand the kernel builds (scale · 2^110); no real weight comes near it.
pub const MXFP4_MAX_SCALE_BYTE: u8 = 144;

/// Warps per block: they split a tile's K range and are reduced in shared memory.
const WARPS: u32 = 4;
/// 16-byte chunks one K step covers per weight row (4 lanes x 4 chunks, see gemv_tile.cu).
const STEP_CHUNKS: usize = 16;
/// Blocks per multiprocessor the split-K planner aims for.
const TARGET_BLOCKS_PER_SM: usize = 4;

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
    fn name(self) -> &'static str {
        match self {
            GemvFormat::Bf16 => "bf16",
            GemvFormat::Fp8 { .. } => "fp8",
            GemvFormat::Nvfp4 => "nvfp4",
            GemvFormat::Mxfp4 => "mxfp4",
        }
    }

    /// Elements per 16-byte chunk: K must be a multiple (rows start 16-byte aligned).
    fn chunk_elems(self) -> usize {
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
    Nvfp4(&'a Nvfp4Quantized),
    Mxfp4(&'a Mxfp4Quantized),
}

enum Fp8Scale {
    E8m0(DeviceTensor<u8>),
    F32(DeviceTensor<f32>),
}

enum Storage {
    Bf16(DeviceTensor<bf16>),
    Fp8 {
        weight: DeviceTensor<u8>,
        scale: Fp8Scale,
    },
    Nvfp4 {
        weight: DeviceTensor<u8>,
        scale: DeviceTensor<u8>,
        global: f32,
    },
    Mxfp4 {
        weight: DeviceTensor<u8>,
        scale: DeviceTensor<u8>,
    },
}

/// A device-resident weight `W [n, k]` for [`gemv`] / [`gemv_swiglu`], in checkpoint layout.
pub struct GemvWeight {
    format: GemvFormat,
    n: usize,
    k: usize,
    storage: Storage,
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

impl GemvWeight {
    /// Validates `w` as an `[n, k]` weight and copies it to the device.
    ///
    /// Requirements: `k` a positive multiple of 8 (BF16), 16 (FP8) or 32 (NVFP4, MXFP4), so every
    /// row starts 16-byte aligned; FP8 blocks with `block.1 % 64 == 0` and `block.0 % 16 == 0`;
    /// MXFP4 scale bytes at most [`MXFP4_MAX_SCALE_BYTE`]; a finite NVFP4 global scale.
    pub fn upload(
        dev: &Device,
        w: HostWeight<'_>,
        n: usize,
        k: usize,
    ) -> Result<GemvWeight, GpuError> {
        let format = match w {
            HostWeight::Bf16(_) => GemvFormat::Bf16,
            HostWeight::Fp8 { format, block, .. } => GemvFormat::Fp8 {
                scale: format,
                block,
            },
            HostWeight::Nvfp4(_) => GemvFormat::Nvfp4,
            HostWeight::Mxfp4(_) => GemvFormat::Mxfp4,
        };
        let what = format!("{} weight [{n}, {k}]", format.name());
        let ce = format.chunk_elems();
        if n == 0 || k == 0 || !k.is_multiple_of(ce) {
            return Err(invalid(
                &what,
                format!("n and k must be positive and k a multiple of {ce}"),
            ));
        }
        dim_u32(&what, n)?;
        dim_u32(&what, k)?;
        let storage = match w {
            HostWeight::Bf16(data) => {
                check_len(&what, n * k, data.len())?;
                Storage::Bf16(dev.upload(DType::BF16, &[n, k], data)?)
            }
            HostWeight::Fp8 {
                weight,
                scale,
                format: sf,
                block,
            } => {
                if block.0 == 0 || block.0 % 16 != 0 || block.1 == 0 || block.1 % 64 != 0 {
                    return Err(invalid(
                        &what,
                        format!(
                            "FP8 block {block:?}: rows must be a multiple of 16 and columns of 64"
                        ),
                    ));
                }
                check_len(&what, n * k, weight.len())?;
                let shape = [n.div_ceil(block.0), k.div_ceil(block.1)];
                check_len(
                    &format!("{what} scale"),
                    shape[0] * shape[1] * sf.bytes(),
                    scale.len(),
                )?;
                let weight = dev.upload(DType::E4M3, &[n, k], weight)?;
                let scale = match sf {
                    ScaleFormat::E8m0 => Fp8Scale::E8m0(dev.upload(DType::E8M0, &shape, scale)?),
                    ScaleFormat::F32 => {
                        let v: Vec<f32> = scale
                            .chunks_exact(4)
                            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                            .collect();
                        Fp8Scale::F32(dev.upload(DType::F32, &shape, &v)?)
                    }
                };
                Storage::Fp8 { weight, scale }
            }
            HostWeight::Nvfp4(q) => {
                check_len(&what, n * k / 2, q.weight.len())?;
                check_len(
                    &format!("{what} weight_scale"),
                    n * k / 16,
                    q.weight_scale.len(),
                )?;
                if !q.weight_scale_2.is_finite() {
                    return Err(invalid(
                        &what,
                        format!("weight_scale_2 {} is not finite", q.weight_scale_2),
                    ));
                }
                Storage::Nvfp4 {
                    weight: dev.upload(DType::E2M1x2, &[n, k / 2], &q.weight)?,
                    scale: dev.upload(DType::E4M3, &[n, k / 16], &q.weight_scale)?,
                    global: q.weight_scale_2,
                }
            }
            HostWeight::Mxfp4(q) => {
                check_len(&what, n * k / 2, q.weight.len())?;
                check_len(&format!("{what} scale"), n * k / 32, q.scale.len())?;
                check_mxfp4_scales(&what, &q.scale)?;
                Storage::Mxfp4 {
                    weight: dev.upload(DType::E2M1x2, &[n, k / 2], &q.weight)?,
                    scale: dev.upload(DType::E8M0, &[n, k / 32], &q.scale)?,
                }
            }
        };
        Ok(GemvWeight {
            format,
            n,
            k,
            storage,
        })
    }

    pub fn format(&self) -> GemvFormat {
        self.format
    }

    /// Output features (rows of W).
    pub fn n(&self) -> usize {
        self.n
    }

    /// Input features (columns of W).
    pub fn k(&self) -> usize {
        self.k
    }

    /// Bytes a GEMV must read for this weight: the codes plus every scale.
    pub fn bytes(&self) -> usize {
        match &self.storage {
            Storage::Bf16(w) => w.num_bytes(),
            Storage::Fp8 { weight, scale } => {
                weight.num_bytes()
                    + match scale {
                        Fp8Scale::E8m0(s) => s.num_bytes(),
                        Fp8Scale::F32(s) => s.num_bytes(),
                    }
            }
            Storage::Nvfp4 { weight, scale, .. } | Storage::Mxfp4 { weight, scale } => {
                weight.num_bytes() + scale.num_bytes()
            }
        }
    }

    /// (weight address, scale address, epilogue multiplier).
    fn kernel_view(&self) -> (u64, u64, f32) {
        match &self.storage {
            Storage::Bf16(w) => (w.device_address(), 0, 1.0),
            Storage::Fp8 { weight, scale } => {
                let s = match scale {
                    Fp8Scale::E8m0(s) => s.device_address(),
                    Fp8Scale::F32(s) => s.device_address(),
                };
                // The kernel applies the block scales (times 2^16) itself.
                (weight.device_address(), s, 1.0)
            }
            // Codes enter the MMA as value * 2^-16 (see gemv.cu).
            Storage::Nvfp4 {
                weight,
                scale,
                global,
            } => (
                weight.device_address(),
                scale.device_address(),
                global * 65536.0,
            ),
            Storage::Mxfp4 { weight, scale } => {
                (weight.device_address(), scale.device_address(), 65536.0)
            }
        }
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
/// zero (pool and `alloc` memory does) and the kernels leave them at zero.
pub struct GemvWorkspace {
    partials: DeviceTensor<f32>,
    counters: DeviceTensor<u32>,
}

/// [`GemvWorkspace`] buffers reserved in a pool, redeemed with [`Self::take`] after sealing.
pub struct GemvWorkspaceReservation {
    partials: Reservation<f32>,
    counters: Reservation<u32>,
}

impl GemvWorkspaceReservation {
    pub fn take(self, pool: &mut BufferPool) -> Result<GemvWorkspace, GpuError> {
        Ok(GemvWorkspace {
            partials: pool.take(self.partials)?,
            counters: pool.take(self.counters)?,
        })
    }
}

impl GemvWorkspace {
    /// Tile partials the workspace holds (each `16 rows x 16 columns` of f32).
    pub const PARTIALS: usize = 4096;
    /// Tiles a split launch may have (one counter each).
    pub const COUNTERS: usize = 2048;
    const PARTIAL_FLOATS: usize = 256;

    fn shapes() -> ([usize; 1], [usize; 1]) {
        ([Self::PARTIALS * Self::PARTIAL_FLOATS], [Self::COUNTERS])
    }

    /// Reserves the workspace (`<name>.partials`, `<name>.counters`) in an open pool.
    pub fn reserve(
        pool: &mut BufferPool,
        name: &str,
    ) -> Result<GemvWorkspaceReservation, GpuError> {
        let (p, c) = Self::shapes();
        Ok(GemvWorkspaceReservation {
            partials: pool.reserve(&format!("{name}.partials"), DType::F32, &p)?,
            counters: pool.reserve(&format!("{name}.counters"), DType::U32, &c)?,
        })
    }

    /// A separately allocated workspace (tests, benchmarks).
    pub fn alloc(dev: &Device) -> Result<GemvWorkspace, GpuError> {
        let (p, c) = Self::shapes();
        Ok(GemvWorkspace {
            partials: dev.alloc(DType::F32, &p)?,
            counters: dev.alloc(DType::U32, &c)?,
        })
    }
}

/// Kernel arguments; mirrors `struct GemvArgs` in gemv.cu field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct GemvArgs {
    x: u64,
    w0: u64,
    w1: u64,
    s0: u64,
    s1: u64,
    y: u64,
    ws: u64,
    counters: u64,
    m: u32,
    n: u32,
    k: u32,
    splits: u32,
    post0: f32,
    post1: f32,
    limit: f32,
    fp8_br: u32,
    fp8_bc: u32,
    fp8_f32: u32,
    pad: u32,
}

// SAFETY: plain #[repr(C)] data with the exact layout of the CUDA struct.
unsafe impl DeviceRepr for GemvArgs {}

/// Multiprocessor count, for sizing grids.
pub(crate) fn sm_count(dev: &Device) -> Result<usize, GpuError> {
    let n = dev
        .context()
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(GpuError::driver("reading the multiprocessor count"))?;
    Ok(n.max(1) as usize)
}

/// K splits for `tiles` output tiles of `steps` K steps each: enough blocks to keep every
/// multiprocessor busy, at least one step per warp, within the workspace.
pub(crate) fn plan_splits(tiles: usize, steps: usize, sms: usize) -> usize {
    let target = TARGET_BLOCKS_PER_SM * sms;
    if tiles >= target || tiles > GemvWorkspace::COUNTERS {
        return 1;
    }
    let by_occupancy = target.div_ceil(tiles);
    let by_work = (steps / WARPS as usize).max(1);
    let by_space = (GemvWorkspace::PARTIALS / tiles).max(1);
    by_occupancy.min(by_work).min(by_space).max(1)
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
    if m == 0 || m > MAX_M {
        return Err(invalid(
            "gemv input x",
            format!("{m} rows; 1..={MAX_M} are supported"),
        ));
    }
    Ok(m)
}

#[allow(clippy::too_many_arguments)]
fn launch(
    dev: &Device,
    kernel: &str,
    x: &DeviceTensor<bf16>,
    m: usize,
    w0: &GemvWeight,
    w1: &GemvWeight,
    n: usize,
    tile_rows: usize,
    limit: f32,
    y: &mut DeviceTensor<bf16>,
    ws: &mut GemvWorkspace,
) -> Result<(), GpuError> {
    let k = w0.k;
    let tiles = n.div_ceil(tile_rows);
    let steps = (k / w0.format.chunk_elems()).div_ceil(STEP_CHUNKS);
    let splits = plan_splits(tiles, steps, sm_count(dev)?);
    let (a0, s0, post0) = w0.kernel_view();
    let (a1, s1, post1) = w1.kernel_view();
    let (br, bc, f32_scales) = match w0.format {
        GemvFormat::Fp8 { scale, block } => (block.0, block.1, scale == ScaleFormat::F32),
        _ => (1, 1, false),
    };
    let args = GemvArgs {
        x: x.device_address(),
        w0: a0,
        w1: a1,
        s0,
        s1,
        y: y.device_address(),
        ws: ws.partials.device_address(),
        counters: ws.counters.device_address(),
        m: m as u32,
        n: dim_u32("gemv n", n)?,
        k: dim_u32("gemv k", k)?,
        splits: splits as u32,
        post0,
        post1,
        limit,
        fp8_br: br as u32,
        fp8_bc: bc as u32,
        fp8_f32: f32_scales as u32,
        pad: 0,
    };
    let cfg = LaunchConfig {
        grid_dim: (dim_u32("gemv tiles", tiles)?, splits as u32, 1),
        block_dim: (WARPS * 32, 1, 1),
        shared_mem_bytes: 0,
    };
    let f = dev.function(kernel)?;
    // SAFETY: the launchers checked every shape against n, k and m; the kernel reads
    // [m, k] activations, [n, k] weights with their scales, writes [m, n] outputs, and uses at
    // most splits * tiles workspace partials and tiles counters (plan_splits bounds both).
    unsafe { dev.stream().launch_builder(f).arg(&args).launch(cfg) }.map_err(|e| {
        GpuError::Driver {
            what: format!("launching {kernel}"),
            source: e,
        }
    })?;
    Ok(())
}

fn kernel_name(prefix: &str, format: GemvFormat, m: usize) -> String {
    format!(
        "{prefix}{}_{}",
        format.name(),
        if m <= 8 { "m8" } else { "m16" }
    )
}

/// `y [M, N] = x [M, K] · Wᵀ` with `W [N, K]`, bf16 in and out, f32 accumulation.
pub fn gemv(
    dev: &Device,
    x: &DeviceTensor<bf16>,
    w: &GemvWeight,
    y: &mut DeviceTensor<bf16>,
    ws: &mut GemvWorkspace,
) -> Result<(), GpuError> {
    let m = check_x(x, w.k)?;
    y.expect("gemv output y", DType::BF16, &[m, w.n])?;
    let kernel = kernel_name("gemv_", w.format, m);
    launch(dev, &kernel, x, m, w, w, w.n, 16, 0.0, y, ws)
}

/// Fused gate and up projections of a SwiGLU block: `h [M, I] = silu(min(x·W1ᵀ, L)) ·
/// clamp(x·W3ᵀ, −L, L)` with `W1, W3 [I, K]` of the same format, `L = limit` (swiglu_limit).
pub fn gemv_swiglu(
    dev: &Device,
    x: &DeviceTensor<bf16>,
    w1: &GemvWeight,
    w3: &GemvWeight,
    limit: f32,
    h: &mut DeviceTensor<bf16>,
    ws: &mut GemvWorkspace,
) -> Result<(), GpuError> {
    if w1.format != w3.format || w1.n != w3.n || w1.k != w3.k {
        return Err(invalid(
            "gemv_swiglu",
            format!(
                "w1 is {:?} [{}, {}] but w3 is {:?} [{}, {}]",
                w1.format, w1.n, w1.k, w3.format, w3.n, w3.k
            ),
        ));
    }
    if let GemvFormat::Fp8 { block, .. } = w1.format {
        if block.0 % 8 != 0 {
            return Err(invalid(
                "gemv_swiglu",
                format!("FP8 block rows {} not a multiple of 8", block.0),
            ));
        }
    }
    if limit.is_nan() || limit <= 0.0 {
        return Err(invalid(
            "gemv_swiglu",
            format!("swiglu limit {limit} must be positive"),
        ));
    }
    let m = check_x(x, w1.k)?;
    h.expect("gemv_swiglu output h", DType::BF16, &[m, w1.n])?;
    let kernel = kernel_name("gemv_swiglu_", w1.format, m);
    launch(dev, &kernel, x, m, w1, w3, w1.n, 8, limit, h, ws)
}

/// f64 CPU references on [`crate::codecs`] dequantization.
pub mod reference {
    use half::bf16;

    use super::HostWeight;
    use crate::codecs::{fp8_block, mxfp4, nvfp4, CodecError};

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
            HostWeight::Nvfp4(q) => {
                nvfp4::dequantize(&q.weight, &q.weight_scale, q.weight_scale_2, n, k)
            }
            HostWeight::Mxfp4(q) => mxfp4::dequantize(&q.weight, &q.scale, n, k),
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
    fn args_layout_matches_the_cuda_struct() {
        // 8 pointers, 4 u32, 3 f32, 4 u32 = 108 bytes, padded to the 8-byte alignment.
        assert_eq!(std::mem::size_of::<GemvArgs>(), 112);
        assert_eq!(std::mem::align_of::<GemvArgs>(), 8);
    }

    #[test]
    fn split_plan_fills_the_gpu_within_bounds() {
        // Plenty of tiles: no split.
        assert_eq!(plan_splits(2048, 4, 132), 1);
        // wkv [512, 4096] fp8: 32 tiles of 16 steps -> 4 splits (one per warp's worth).
        assert_eq!(plan_splits(32, 16, 132), 4);
        // Long rows: limited by occupancy, 17 splits of 32 tiles make 544 >= 528 blocks.
        assert_eq!(plan_splits(32, 512, 132), 17);
        // Short rows never split below one step per warp.
        assert_eq!(plan_splits(8, 3, 132), 1);
        for tiles in 1..3000 {
            for steps in [1, 5, 64, 4096] {
                let s = plan_splits(tiles, steps, 132);
                assert!(
                    s >= 1
                        && (s == 1
                            || (tiles * s <= GemvWorkspace::PARTIALS
                                && tiles <= GemvWorkspace::COUNTERS))
                );
            }
        }
    }

    #[test]
    fn mxfp4_scales_above_2_pow_17_are_refused() {
        assert!(check_mxfp4_scales("w", &[0, 127, 144]).is_ok());
        let err = check_mxfp4_scales("w", &[127, 145]).unwrap_err();
        assert!(err.to_string().contains("145 at 1"), "{err}");
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
