//! Launchers of the device sampler (`kernels/sample.cu`): greedy, or temperature + top-p with
//! a counter-based draw from `(seed, position)`, writing the token where the next step reads
//! it. Nothing is read back, so it ends a captured decode step. CPU reference: [`reference`].

pub mod reference;
#[cfg(test)]
mod tests;

use cudarc::driver::LaunchConfig;

use super::launch::{batch_flag, dim_u32, launch, Args};
use super::{DType, Device, DeviceTensor, GpuError};
use reference::THREADS;

#[derive(Debug, thiserror::Error)]
pub enum SamplingError {
    #[error("temperature {0} must be finite and at least 0 (0 = greedy)")]
    Temperature(f32),
    #[error("top-p {0} must be in (0, 1]")]
    TopP(f32),
}

/// `t` if it is a valid temperature: finite and ≥ 0.
pub fn check_temperature(t: f32) -> Result<f32, SamplingError> {
    if t.is_finite() && t >= 0.0 {
        Ok(t)
    } else {
        Err(SamplingError::Temperature(t))
    }
}

/// `p` if it is a valid nucleus mass: in (0, 1].
pub fn check_top_p(p: f32) -> Result<f32, SamplingError> {
    if p > 0.0 && p <= 1.0 {
        Ok(p)
    } else {
        Err(SamplingError::TopP(p))
    }
}

/// How the next token is chosen; fixed when a step is captured.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// 0 = greedy; finite and ≥ 0.
    pub temperature: f32,
    /// Nucleus mass in (0, 1].
    pub top_p: f32,
    pub seed: u64,
}

impl Sampling {
    /// Greedy also for a temperature whose inverse overflows.
    fn inverse_temperature(&self) -> Option<f32> {
        let inv_t = 1.0 / self.temperature;
        inv_t.is_finite().then_some(inv_t)
    }

    /// The settings as one row of [`sample`]'s parameters: the inverse temperature's bits (0:
    /// greedy), top-p's bits, the seed's low and high words. Checks them first.
    pub fn device_words(&self) -> Result<[u32; 4], SamplingError> {
        check_temperature(self.temperature)?;
        check_top_p(self.top_p)?;
        let inv_t = self.inverse_temperature().unwrap_or(0.0);
        Ok([
            inv_t.to_bits(),
            self.top_p.to_bits(),
            self.seed as u32,
            (self.seed >> 32) as u32,
        ])
    }
}

/// Ids a greedy span covers at least, and most spans (kernel constants).
const ARGMAX_SPAN: u32 = 4096;
const MAX_SPANS: u32 = 1024;

/// Blocks of the greedy argmax's first half: spans of at least `ARGMAX_SPAN` ids.
fn argmax_spans(vocab: u32) -> u32 {
    vocab.div_ceil(ARGMAX_SPAN).min(MAX_SPANS)
}

/// Picks the next token of each row of `logits [rows, vocab]` (F32) into `tokens` (U32
/// `[rows]`), with row r's settings `params[r]` (U32 `[rows, 4]`, each row
/// [`Sampling::device_words`]): the draw is keyed by the seed and the row's device position,
/// which is then advanced by `advance` (a decode step's last write). `pos` (U32) is `[1]` for a
/// single row, or `[rows]`, one position a row (a batch of sequences). `weights [rows, vocab]`
/// (F32) is scratch.
pub fn sample(
    dev: &Device,
    logits: &DeviceTensor<f32>,
    params: &DeviceTensor<u32>,
    pos: &mut DeviceTensor<u32>,
    advance: u32,
    weights: &mut DeviceTensor<f32>,
    tokens: &mut DeviceTensor<u32>,
) -> Result<(), GpuError> {
    let (rows, vocab) = logits.dims2("sampling logits", DType::F32)?;
    params.expect("sampling settings", DType::U32, &[rows, 4])?;
    weights.expect("sampling weights", DType::F32, &[rows, vocab])?;
    tokens.expect("sampled tokens", DType::U32, &[rows])?;
    let batch = batch_flag(pos, rows, "sampling position")?;
    if rows > 1 && batch == 0 {
        return Err(GpuError::invalid(
            "sampling position",
            format!("one position for {rows} rows (one a row)"),
        ));
    }
    if vocab == 0 {
        return Err(GpuError::invalid("sampling", "no logits to sample from"));
    }
    if rows == 0 {
        return Ok(());
    }
    let v32 = dim_u32("vocab", vocab)?;
    let r32 = dim_u32("sampled rows", rows)?;
    let cfg = LaunchConfig {
        grid_dim: (argmax_spans(v32), r32, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: logits and weights [rows, vocab] (a row's spans <= vocab weights), params
    // [rows, 4] (16-byte rows of the kernel's SampleParams).
    unsafe {
        launch(
            dev,
            "sample_prepare",
            cfg,
            Args::new().ptr(logits).arg(v32).ptr(params).ptr(weights),
        )
    }?;
    let cfg = LaunchConfig {
        grid_dim: (r32, 1, 1),
        ..cfg
    };
    // SAFETY: as above; pos one u32 (or one a row), tokens one a row.
    unsafe {
        launch(
            dev,
            "sample_pick",
            cfg,
            Args::new()
                .ptr(logits)
                .ptr(weights)
                .arg(v32)
                .ptr(params)
                .ptr(pos)
                .arg(advance)
                .ptr(tokens)
                .arg(batch),
        )
    }?;
    Ok(())
}
