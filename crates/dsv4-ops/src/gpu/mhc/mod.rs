//! Launchers of the mHC kernels (`kernels/mhc.cu`): per token, the mix projection of the
//! RMS-normalized streams, spread over many blocks ([`hc_mix`], or fused into the previous
//! site's expansion, [`hc_post_mix`]); the collapse from it with the sub-layer's RMSNorm
//! ([`hc_pre`], [`hc_head`]); Sinkhorn on the comb, beside the sub-layer ([`hc_comb`]); the
//! expansion back ([`hc_post_mix`]). Four streams (every DeepSeek-V4 model).
//! CPU references: [`reference`].

pub mod reference;
#[cfg(test)]
mod tests;

use cudarc::driver::LaunchConfig;

use half::bf16;

use super::launch::{dim_u32, launch, Args, THREADS};
use super::rows::{norm_threads, NORM_MAX_THREADS};
use super::{DType, Device, DeviceTensor, GpuError};
use reference::{HcParams, HcSite};

/// The stream count the kernels are built for.
pub const HC: usize = 4;
/// Mixing logits of a layer site: `HC` pre, `HC` post, `HC × HC` comb.
pub const MIX: usize = (2 + HC) * HC;
/// Columns of the flattened streams one mix-projection block takes (`MIX_COLS` in mhc.cu).
const MIX_COLS: usize = 128;

/// Shape of the mix-projection partials ([`hc_mix`], read by [`hc_pre`] and [`hc_head`]) of
/// `n` tokens of width `d`: `[n, ceil(HC·d / 128), MIX + 1]` (F32).
pub fn mix_partials_shape(n: usize, d: usize) -> [usize; 3] {
    [n, (HC * d).div_ceil(MIX_COLS), MIX + 1]
}

/// The grid of the mix projection (`ceil(HC·d / 128)` column blocks by `n` tokens) after
/// checking `partials`, and the column block count.
fn mix_grid(
    n: usize,
    d: usize,
    partials: &DeviceTensor<f32>,
) -> Result<(LaunchConfig, u32), GpuError> {
    let shape = mix_partials_shape(n, d);
    partials.expect("mHC mix partials", DType::F32, &shape)?;
    if n > 65535 {
        return Err(GpuError::invalid(
            "mHC",
            format!("{n} tokens (at most 65535 a launch)"),
        ));
    }
    let splits = dim_u32("mHC column blocks", shape[1])?;
    let cfg = LaunchConfig {
        grid_dim: (splits, dim_u32("tokens", n)?, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    Ok((cfg, splits))
}

/// The mix projection of every token's RMS-normalized `streams [n, HC·D]` with `site`'s
/// `fn_` (a layer site's `MIX` rows or the head's `HC`) into `partials`
/// ([`mix_partials_shape`]): per column block, the dot products and the sum of squares.
pub fn hc_mix(
    dev: &Device,
    streams: &DeviceTensor<f32>,
    site: &DeviceHcSite,
    p: &HcParams,
    partials: &mut DeviceTensor<f32>,
) -> Result<(), GpuError> {
    let (n, d) = stream_dims(streams, p)?;
    let mix = site.rows(d)?;
    let (cfg, _) = mix_grid(n, d, partials)?;
    if n == 0 || d == 0 {
        return Ok(());
    }
    let (width, mix32) = (dim_u32("mHC width", HC * d)?, dim_u32("mHC mix", mix)?);
    let mut args = Args::new();
    args.ptr(streams)
        .arg(width)
        .ptr(&site.fn_)
        .arg(mix32)
        .ptr(partials);
    let (kernel, cfg) = by_tokens(n, cfg, &mut args, "hc_mix_partials", "hc_mix_partials_t16")?;
    // SAFETY: streams [n, HC·d], fn [mix, HC·d], partials [n, splits, MIX + 1] with
    // mix <= MIX, checked above; the sixteen-token kernel skips tokens past n.
    unsafe { launch(dev, kernel, cfg, &args) }
}

/// The one-token kernel `one` on `cfg`, or for more than [`MIX_BLOCK_TOKENS`] tokens (a prompt
/// chunk) `many`, sixteen tokens a block (each fn value read once for them; H100, the
/// expansions of a 2048-token chunk of bench4: 3.3 ms at eight a block, 2.7 at sixteen), with
/// `n` appended to `args`.
fn by_tokens(
    n: usize,
    cfg: LaunchConfig,
    args: &mut Args,
    one: &'static str,
    many: &'static str,
) -> Result<(&'static str, LaunchConfig), GpuError> {
    if n <= MIX_BLOCK_TOKENS {
        return Ok((one, cfg));
    }
    let n32 = dim_u32("tokens", n)?;
    args.arg(n32);
    let grid_dim = (cfg.grid_dim.0, n32.div_ceil(MIX_BLOCK_TOKENS as u32), 1);
    Ok((many, LaunchConfig { grid_dim, ..cfg }))
}

/// Whether the model's stream count is the kernels'.
fn check_streams(p: &HcParams) -> Result<(), GpuError> {
    if p.n != HC {
        return Err(GpuError::invalid(
            "mHC",
            format!(
                "the kernels are built for {HC} streams, the model has {}",
                p.n
            ),
        ));
    }
    Ok(())
}

/// `(tokens, D)` of `streams [n, HC·D]`, once the model's stream count is the kernels'.
fn stream_dims(streams: &DeviceTensor<f32>, p: &HcParams) -> Result<(usize, usize), GpuError> {
    check_streams(p)?;
    let (n, width) = streams.dims2("mHC streams", DType::F32)?;
    let d = width / HC;
    streams.expect("mHC streams", DType::F32, &[n, HC * d])?;
    Ok((n, d))
}

/// One site's parameters on the device: `fn_ [mix, HC·D]`, `base [mix]`, `scale [3]` (layer
/// sites, mix = [`MIX`]) or `[1]` (the head, mix = [`HC`]).
pub struct DeviceHcSite {
    pub fn_: DeviceTensor<f32>,
    pub base: DeviceTensor<f32>,
    pub scale: DeviceTensor<f32>,
}

impl DeviceHcSite {
    pub fn upload(dev: &Device, site: &HcSite, d: usize) -> Result<DeviceHcSite, GpuError> {
        let mix = site.base.len();
        Ok(DeviceHcSite {
            fn_: dev.upload(DType::F32, &[mix, HC * d], site.fn_)?,
            base: dev.upload(DType::F32, &[mix], site.base)?,
            scale: dev.upload(DType::F32, &[site.scale.len()], site.scale)?,
        })
    }

    /// Mix rows of the site: `MIX` (a layer site) or `HC` (the head).
    fn rows(&self, d: usize) -> Result<usize, GpuError> {
        let mix = self.base.len();
        if mix != MIX && mix != HC {
            return Err(GpuError::invalid(
                "mHC site",
                format!("{mix} mix rows (a layer site has {MIX}, the head {HC})"),
            ));
        }
        self.check(mix, if mix == MIX { 3 } else { 1 }, d)?;
        Ok(mix)
    }

    fn check(&self, mix: usize, scales: usize, d: usize) -> Result<(), GpuError> {
        self.fn_.expect("mHC fn", DType::F32, &[mix, HC * d])?;
        // The kernels copy fn's rows into shared memory 16 bytes at a time.
        if !self.fn_.device_address().is_multiple_of(16) {
            return Err(GpuError::invalid("mHC fn", "not on a 16-byte boundary"));
        }
        self.base.expect("mHC base", DType::F32, &[mix])?;
        self.scale.expect("mHC scale", DType::F32, &[scales])
    }
}

/// The mix [`hc_pre`] (and [`hc_comb`]) write for the matching [`hc_post_mix`], for `n`
/// tokens: `post [n, HC]` and `comb [n, HC·HC]`.
pub struct DeviceHcMix {
    pub post: DeviceTensor<f32>,
    pub comb: DeviceTensor<f32>,
}

/// The sub-layer input [`hc_pre`] and [`hc_head`] write: the collapse RMS-normalized with
/// `weight [D]` and `eps`, `xn [n, D]` (F32) and its BF16 copy `xb [n, D]`.
pub struct NormedInput<'a> {
    pub weight: &'a DeviceTensor<f32>,
    pub eps: f32,
    pub xn: &'a mut DeviceTensor<f32>,
    pub xb: &'a mut DeviceTensor<bf16>,
}

impl NormedInput<'_> {
    fn check(&self, n: usize, d: usize) -> Result<(), GpuError> {
        self.weight.expect("mHC norm weight", DType::F32, &[d])?;
        self.xn.expect("mHC normed input", DType::F32, &[n, d])?;
        self.xb
            .expect("mHC normed input (BF16)", DType::BF16, &[n, d])
    }
}

/// One block per token (at most 65535, then grid-stride): about four columns a collapsing
/// thread, as [`rms_norm_rows`](super::rows::rms_norm_rows) takes for a row of `d` (up to 31
/// warps), and one more warp for the post weights and the comb logits.
fn per_token(n: u32, d: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.clamp(1, 65535), 1, 1),
        block_dim: (norm_threads(d).min(NORM_MAX_THREADS - 32) + 32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `streams [n, HC·D]` → the site's sub-layer input, collapsed and RMS-normalized, and its mix
/// (spec §4), all on the device, from the site's mix projection in `partials` ([`hc_mix`] or
/// [`hc_post_mix`]). `mix.comb` holds the Sinkhorn's logits until [`hc_comb`] runs: beside the
/// sub-layer (only the expansion after it reads the comb), so that Sinkhorn's chain of 20
/// dependent rounds stays off the path into the sub-layer.
pub fn hc_pre(
    dev: &Device,
    streams: &DeviceTensor<f32>,
    site: &DeviceHcSite,
    p: &HcParams,
    partials: &DeviceTensor<f32>,
    input: NormedInput,
    mix: &mut DeviceHcMix,
) -> Result<(), GpuError> {
    let (n, d) = stream_dims(streams, p)?;
    site.check(MIX, 3, d)?;
    input.check(n, d)?;
    mix.post.expect("mHC post", DType::F32, &[n, HC])?;
    mix.comb.expect("mHC comb", DType::F32, &[n, HC * HC])?;
    if n == 0 || d == 0 {
        return Ok(());
    }
    let (n32, d32) = (dim_u32("tokens", n)?, dim_u32("hidden", d)?);
    let (_, splits) = mix_grid(n, d, partials)?;
    // SAFETY: streams [n, 4d], partials [n, splits, 25], base [24], scale [3], weight [d],
    // outputs [n, d] (twice), [n, 4], [n, 16], all checked above.
    unsafe {
        launch(
            dev,
            "hc_pre",
            per_token(n32, d32),
            Args::new()
                .ptr(streams)
                .arg(n32)
                .arg(d32)
                .ptr(partials)
                .arg(splits)
                .ptr(&site.base)
                .ptr(&site.scale)
                .arg(p.hc_eps)
                .arg(p.norm_eps)
                .ptr(input.weight)
                .arg(input.eps)
                .ptr(input.xn)
                .ptr(input.xb)
                .ptr(&mix.post)
                .ptr(&mix.comb),
        )
    }
}

/// Sinkhorn on the comb logits [`hc_pre`] leaves in `comb [n, HC·HC]`, in place: the mix
/// [`hc_post_mix`] reads.
pub fn hc_comb(dev: &Device, p: &HcParams, comb: &mut DeviceTensor<f32>) -> Result<(), GpuError> {
    check_streams(p)?;
    let (n, _) = comb.dims2("mHC comb", DType::F32)?;
    comb.expect("mHC comb", DType::F32, &[n, HC * HC])?;
    if n == 0 {
        return Ok(());
    }
    let iters = dim_u32("sinkhorn iterations", p.sinkhorn_iters)?;
    // A warp a token, grid-stride past 65535 blocks.
    let warps = (THREADS / 32) as usize;
    let cfg = LaunchConfig {
        grid_dim: (
            dim_u32("mHC comb blocks", n.div_ceil(warps).min(65535))?,
            1,
            1,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: comb [n, 16], checked above; the kernel's warps stop at token n.
    unsafe {
        launch(
            dev,
            "hc_comb",
            cfg,
            Args::new()
                .ptr(comb)
                .arg(dim_u32("tokens", n)?)
                .arg(iters)
                .arg(p.hc_eps),
        )
    }
}

/// The final collapse with the output norm: `streams [n, HC·D]` → the head's input, with the
/// head site's pre weights (`fn_ [HC, HC·D]`, `base [HC]`, `scale [1]`), from its mix
/// projection in `partials`.
pub fn hc_head(
    dev: &Device,
    streams: &DeviceTensor<f32>,
    site: &DeviceHcSite,
    p: &HcParams,
    partials: &DeviceTensor<f32>,
    input: NormedInput,
) -> Result<(), GpuError> {
    let (n, d) = stream_dims(streams, p)?;
    site.check(HC, 1, d)?;
    input.check(n, d)?;
    if n == 0 || d == 0 {
        return Ok(());
    }
    let (n32, d32) = (dim_u32("tokens", n)?, dim_u32("hidden", d)?);
    let (_, splits) = mix_grid(n, d, partials)?;
    // SAFETY: streams [n, 4d], partials [n, splits, 25], base [4], scale [1], weight [d],
    // outputs [n, d] (twice), checked above.
    unsafe {
        launch(
            dev,
            "hc_head",
            per_token(n32, d32),
            Args::new()
                .ptr(streams)
                .arg(n32)
                .arg(d32)
                .ptr(partials)
                .arg(splits)
                .ptr(&site.base)
                .ptr(&site.scale)
                .arg(p.hc_eps)
                .arg(p.norm_eps)
                .ptr(input.weight)
                .arg(input.eps)
                .ptr(input.xn)
                .ptr(input.xb),
        )
    }
}

/// `(tokens, D)` of an expansion's `y [n, D]`, once `streams` and `out` are `[n, HC·D]` and the
/// mix `[n, HC]` / `[n, HC·HC]`.
fn post_dims(
    streams: &DeviceTensor<f32>,
    y: &DeviceTensor<f32>,
    mix: &DeviceHcMix,
    out: &DeviceTensor<f32>,
) -> Result<(usize, usize), GpuError> {
    let (n, d) = y.dims2("mHC sub-layer output", DType::F32)?;
    streams.expect("mHC streams", DType::F32, &[n, HC * d])?;
    mix.post.expect("mHC post", DType::F32, &[n, HC])?;
    mix.comb.expect("mHC comb", DType::F32, &[n, HC * HC])?;
    out.expect("mHC new streams", DType::F32, &[n, HC * d])?;
    Ok((n, d))
}

/// The expansion back, `out[t, j] = post[t, j] · y[t] + Σ_i comb[t, i, j] · streams[t, i]`
/// (the sub-layer output `y [n, D]` into new streams `out [n, HC·D]`, a buffer other than
/// `streams`), then [`hc_mix`] of the new streams with `next` (the following site), in one
/// launch: each block expands its columns and projects them. A sub-layer output in two parts
/// (`y_plus`, of y's shape: the MoE's shared expert beside its routed experts) is summed
/// first, `y + y_plus` rounded once.
#[allow(clippy::too_many_arguments)]
pub fn hc_post_mix(
    dev: &Device,
    streams: &DeviceTensor<f32>,
    y: &DeviceTensor<f32>,
    y_plus: Option<&DeviceTensor<f32>>,
    mix: &DeviceHcMix,
    out: &mut DeviceTensor<f32>,
    next: &DeviceHcSite,
    p: &HcParams,
    partials: &mut DeviceTensor<f32>,
) -> Result<(), GpuError> {
    let (n, d) = post_dims(streams, y, mix, out)?;
    if let Some(plus) = y_plus {
        plus.expect("mHC second sub-layer output", DType::F32, &[n, d])?;
    }
    stream_dims(out, p)?;
    let rows = next.rows(d)?;
    let (cfg, _) = mix_grid(n, d, partials)?;
    if n == 0 || d == 0 {
        return Ok(());
    }
    let (d32, mix32) = (dim_u32("hidden", d)?, dim_u32("mHC mix", rows)?);
    let mut args = Args::new();
    args.ptr(streams)
        .ptr(y)
        .arg(y_plus.map_or(0, |t| t.device_address()))
        .ptr(&mix.post)
        .ptr(&mix.comb)
        .arg(d32)
        .ptr(out)
        .ptr(&next.fn_)
        .arg(mix32)
        .ptr(partials);
    let (kernel, cfg) = by_tokens(n, cfg, &mut args, "hc_post_mix", "hc_post_mix_t16")?;
    // SAFETY: streams and out [n, 4d] (distinct tensors), y (and y_plus) [n, d], post [n, 4],
    // comb [n, 16], fn [mix, 4d], partials [n, splits, MIX + 1], checked above; the
    // sixteen-token kernel skips tokens past n.
    unsafe { launch(dev, kernel, cfg, &args) }
}

// The mix kernels are built for blocks of `MIX_THREADS` = 256 threads (kernels/mhc.cu).
const _: () = assert!(THREADS == 256, "mhc.cu's MIX_THREADS");

/// Tokens an `hc_mix_partials_t16` or `hc_post_mix_t16` block takes.
const MIX_BLOCK_TOKENS: usize = 16;
