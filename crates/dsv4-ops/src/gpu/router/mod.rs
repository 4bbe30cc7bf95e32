//! Launcher of the router kernel (`kernels/router.cu`): from the gate logits to the expert
//! ids and combine weights that the grouped MoE reads, on the device (hash routing reads the
//! device token ids). CPU reference: [`reference`].

pub mod reference;
#[cfg(test)]
mod tests;

use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::launch::{dim_u32, launch_err};
use super::{DType, Device, DeviceTensor, GpuError};

/// The largest experts-per-token the kernel holds (DeepSeek-V4 uses 6).
pub const MAX_TOP_K: usize = 16;

/// How a layer picks its experts, on the device.
#[derive(Clone, Copy, Debug)]
pub enum DeviceRouteBy<'a> {
    /// `tid2eid` U32 `[vocab, k]`.
    Hash { tid2eid: &'a DeviceTensor<u32> },
    /// `bias` F32 `[E]`, for selection only.
    Learned { bias: &'a DeviceTensor<f32> },
}

/// Routes `n` tokens: `logits [n, E]` (F32, the gate projection), `tokens` U32 `[n]` →
/// `ids` I32 `[n, k]` and `weights` F32 `[n, k]` (`score / Σ scores · scale`).
pub fn route_topk(
    dev: &Device,
    logits: &DeviceTensor<f32>,
    tokens: &DeviceTensor<u32>,
    by: DeviceRouteBy,
    scale: f32,
    ids: &mut DeviceTensor<i32>,
    weights: &mut DeviceTensor<f32>,
) -> Result<(), GpuError> {
    let (n, e) = logits.dims2("router logits", DType::F32)?;
    let k = ids.shape().get(1).copied().unwrap_or(0);
    if k == 0 || k > MAX_TOP_K || k > e {
        return Err(GpuError::invalid(
            "router",
            format!("top-{k} of {e} experts (the kernel takes 1..={MAX_TOP_K}, at most E)"),
        ));
    }
    ids.expect("router ids", DType::I32, &[n, k])?;
    weights.expect("router weights", DType::F32, &[n, k])?;
    tokens.expect("router token ids", DType::U32, &[n])?;
    let (tid2eid, vocab, bias) = match by {
        DeviceRouteBy::Hash { tid2eid } => {
            let (vocab, _) = tid2eid.dims2("tid2eid", DType::U32)?;
            tid2eid.expect("tid2eid", DType::U32, &[vocab, k])?;
            (tid2eid.device_address(), vocab, 0u64)
        }
        DeviceRouteBy::Learned { bias } => {
            bias.expect("router bias", DType::F32, &[e])?;
            (0u64, 0, bias.device_address())
        }
    };
    if n == 0 {
        return Ok(());
    }
    let dims = [
        dim_u32("tokens", n)?,
        dim_u32("experts", e)?,
        dim_u32("top-k", k)?,
        dim_u32("vocab", vocab)?,
    ];
    // One warp per token, four tokens a block.
    let cfg = LaunchConfig {
        grid_dim: (dims[0].div_ceil(4).min(1 << 16), 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let f = dev.function("route_topk")?;
    let (mut iv, mut wv) = (ids.view_mut(), weights.view_mut());
    // SAFETY: logits [n, e], tokens [n], tid2eid [vocab, k] or bias [e] (the other null),
    // ids and weights [n, k] with k <= 16, checked above.
    unsafe {
        dev.stream()
            .launch_builder(f)
            .arg(logits.slice())
            .arg(&dims[0])
            .arg(&dims[1])
            .arg(&dims[2])
            .arg(tokens.slice())
            .arg(&tid2eid)
            .arg(&dims[3])
            .arg(&bias)
            .arg(&scale)
            .arg(&mut iv)
            .arg(&mut wv)
            .launch(cfg)
    }
    .map_err(launch_err("route_topk"))?;
    Ok(())
}
