//! Launchers of the device sampler (`kernels/sample.cu`): greedy, or temperature + top-p with
//! a counter-based draw from `(seed, position)`, writing the token where the next step reads
//! it. Nothing is read back, so it ends a captured decode step. CPU reference: [`reference`].

pub mod reference;
#[cfg(test)]
mod tests;

use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::launch::{dim_u32, launch_err};
use super::{DType, Device, DeviceTensor, GpuError};
use reference::THREADS;

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

fn one_block() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Picks the next token from `logits [vocab]` (F32) into `token` (U32 `[1]`); the draw is
/// keyed by `seed` and the device position `pos` (U32 `[1]`). `weights [vocab]` (F32) is
/// scratch.
pub fn sample(
    dev: &Device,
    logits: &DeviceTensor<f32>,
    s: &Sampling,
    pos: &DeviceTensor<u32>,
    weights: &mut DeviceTensor<f32>,
    token: &mut DeviceTensor<u32>,
) -> Result<(), GpuError> {
    let valid =
        s.temperature.is_finite() && s.temperature >= 0.0 && s.top_p > 0.0 && s.top_p <= 1.0;
    if !valid {
        return Err(GpuError::invalid(
            "sampling",
            format!(
                "temperature {} must be finite and >= 0, top-p {} in (0, 1]",
                s.temperature, s.top_p
            ),
        ));
    }
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
        let f = dev.function("sample_weights")?;
        let mut w = weights.view_mut();
        // SAFETY: logits and weights hold vocab values.
        unsafe {
            dev.stream()
                .launch_builder(f)
                .arg(logits.slice())
                .arg(&v32)
                .arg(&inv_t)
                .arg(&mut w)
                .launch(one_block())
        }
        .map_err(launch_err("sample_weights"))?;
    }
    let greedy = u32::from(inv_t.is_none());
    let f = dev.function("sample_pick")?;
    let mut t = token.view_mut();
    // SAFETY: logits and weights hold vocab values, pos and token one u32 each.
    unsafe {
        dev.stream()
            .launch_builder(f)
            .arg(logits.slice())
            .arg(weights.slice())
            .arg(&v32)
            .arg(&greedy)
            .arg(&s.top_p)
            .arg(&s.seed)
            .arg(pos.slice())
            .arg(&mut t)
            .launch(one_block())
    }
    .map_err(launch_err("sample_pick"))?;
    Ok(())
}
