//! Launchers of the device sampler (`kernels/sample.cu`): greedy, or temperature + top-p with
//! a counter-based draw from `(seed, position)`, writing the token where the next step reads
//! it. Nothing is read back, so it ends a captured decode step. CPU reference: [`reference`].

pub mod reference;
#[cfg(test)]
mod tests;

use cudarc::driver::LaunchConfig;

use super::launch::{dim_u32, launch, Args};
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
}

/// Ids a greedy span covers at least, and most spans (kernel constants).
const ARGMAX_SPAN: u32 = 4096;
const MAX_SPANS: u32 = 1024;

/// Blocks of the greedy argmax's first half: spans of at least `ARGMAX_SPAN` ids.
fn argmax_spans(vocab: u32) -> u32 {
    vocab.div_ceil(ARGMAX_SPAN).min(MAX_SPANS)
}

fn one_block() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Picks the next token from `logits [vocab]` (F32) into `token` (U32 `[1]`); the draw is
/// keyed by `seed` and the device position `pos` (U32 `[1]`), which is then advanced by
/// `advance` (a decode step's last write). `weights [vocab]` (F32) is scratch.
#[allow(clippy::too_many_arguments)]
pub fn sample(
    dev: &Device,
    logits: &DeviceTensor<f32>,
    s: &Sampling,
    pos: &mut DeviceTensor<u32>,
    advance: u32,
    weights: &mut DeviceTensor<f32>,
    token: &mut DeviceTensor<u32>,
) -> Result<(), GpuError> {
    check_temperature(s.temperature)
        .and(check_top_p(s.top_p))
        .map_err(|e| GpuError::invalid("sampling", e.to_string()))?;
    let vocab = logits.len();
    logits.expect("sampling logits", DType::F32, &[vocab])?;
    weights.expect("sampling weights", DType::F32, &[vocab])?;
    pos.expect("sampling position", DType::U32, &[1])?;
    token.expect("sampled token", DType::U32, &[1])?;
    if vocab == 0 {
        return Err(GpuError::invalid("sampling", "no logits to sample from"));
    }
    let v32 = dim_u32("vocab", vocab)?;
    let inv_t = s.inverse_temperature();
    if let Some(inv_t) = inv_t {
        // SAFETY: logits and weights hold vocab values.
        unsafe {
            launch(
                dev,
                "sample_weights",
                one_block(),
                Args::new().ptr(logits).arg(v32).arg(inv_t).ptr(weights),
            )
        }?;
    } else {
        let cfg = LaunchConfig {
            grid_dim: (argmax_spans(v32), 1, 1),
            ..one_block()
        };
        // SAFETY: logits hold vocab values, weights at least one per span (spans <= vocab).
        unsafe {
            launch(
                dev,
                "argmax_spans",
                cfg,
                Args::new().ptr(logits).arg(v32).ptr(weights),
            )
        }?;
    }
    let greedy = u32::from(inv_t.is_none());
    // SAFETY: logits and weights hold vocab values, pos and token one u32 each.
    unsafe {
        launch(
            dev,
            "sample_pick",
            one_block(),
            Args::new()
                .ptr(logits)
                .ptr(weights)
                .arg(v32)
                .arg(greedy)
                .arg(s.top_p)
                .arg(s.seed)
                .ptr(pos)
                .arg(advance)
                .ptr(token),
        )
    }?;
    Ok(())
}
