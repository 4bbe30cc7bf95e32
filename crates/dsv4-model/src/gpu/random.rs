//! A model of a configuration's widths with random weights generated on the device, for
//! `dsv4 bench --synth`: the tensors, formats and bytes per step of the synthetic checkpoint
//! ([`crate::synth`]) of the same format, without writing or reading one. The large matrices
//! are filled on the device (`dsv4_ops::gpu::random`); the small tensors (norms, mHC sites,
//! gates, biases, expert tables) are drawn on the host as the synthetic checkpoint draws them.

use std::collections::HashMap;

use dsv4_ops::codecs::fp8_block::ScaleFormat;
use dsv4_ops::gpu::gemv::{GemvFormat, GemvWeight};
use dsv4_ops::gpu::mhc::reference::HcSite;
use dsv4_ops::gpu::mhc::DeviceHcSite;
use dsv4_ops::gpu::moe::{MoeExperts, MoeFormat};
use dsv4_ops::gpu::moe_bf16::Bf16Experts;
use dsv4_ops::gpu::random::{self, Uniform};
use dsv4_ops::gpu::{DType, Device, DeviceTensor, GpuError};
use half::bf16;

use super::upload::RoutedExperts;
use super::{
    Dense, DevAttention, DevCompressor, DevIndexer, DevLayer, DevMoe, DevRouting, DevWeights,
};
use crate::checkpoint::layout::{self, LinearRole, TensorKind, TensorSpec};
use crate::config::{Config, LayerKind};
use crate::rope::Rope;
use crate::synth::{name_key, spec_expert_ids, spec_values, SynthFormat};

/// The shared experts' intermediate width.
pub(super) fn shared_inter(config: &Config) -> usize {
    config.moe_intermediate_size
}

/// Whether rank slices of a tensor (canonical name) are cut: the query heads, the output
/// groups, every expert's intermediate and the head's vocabulary (see [`crate::shard`]).
fn is_split(name: &str) -> bool {
    [
        ".attn.wq_b",
        ".attn.wo_a",
        ".attn.wo_b",
        ".attn.attn_sink",
        ".ffn.experts.",
        ".ffn.shared_experts.",
    ]
    .iter()
    .any(|p| name.contains(p))
        || name == "head"
}

/// Device bytes one rank of `world` holds of the model drawn in `format` (the split tensors'
/// `world`-th, the rest whole): the memory plan's figure, known before anything is drawn.
pub(super) fn rank_weight_bytes(config: &Config, format: SynthFormat, world: usize) -> usize {
    let stored = format != SynthFormat::Bf16;
    let (mut whole, mut split) = (0, 0);
    for TensorSpec { name, kind } in layout::layout(config) {
        let bytes = match kind {
            TensorKind::Linear { rows, cols, role } => {
                let n = rows * cols;
                match role {
                    LinearRole::Fp8 if stored => {
                        // e4m3 codes, and the kernels' f32 scale rows (one per 64 columns).
                        n + rows.div_ceil(128) * (cols.div_ceil(64) + 1) * 4
                    }
                    LinearRole::RoutedExpert { .. } => match format {
                        SynthFormat::Nvfp4 => n / 2 + n / 16,
                        SynthFormat::Official => n / 2 + n / 32,
                        SynthFormat::Bf16 => 2 * n,
                    },
                    _ => 2 * n,
                }
            }
            TensorKind::Vector { shape, .. } => 4 * shape.iter().product::<usize>(),
            TensorKind::Index { rows, cols } => 4 * rows * cols,
        };
        if is_split(&name) {
            split += bytes;
        } else {
            whole += bytes;
        }
    }
    whole + split / world
}

/// Draws each named tensor of `config`'s layout in `format`.
struct Draw<'a> {
    dev: &'a Device,
    format: SynthFormat,
    seed: u64,
    specs: HashMap<String, TensorSpec>,
}

impl Draw<'_> {
    fn spec(&self, name: &str) -> Result<&TensorSpec, GpuError> {
        self.specs
            .get(name)
            .ok_or_else(|| GpuError::invalid(name, "not a tensor of this configuration"))
    }

    fn seed(&self, name: &str) -> u64 {
        self.seed ^ name_key(name)
    }

    /// A linear's `(rows, cols, role)`.
    fn linear_spec(&self, name: &str) -> Result<(usize, usize, LinearRole), GpuError> {
        match self.spec(name)?.kind {
            TensorKind::Linear { rows, cols, role } => Ok((rows, cols, role)),
            _ => Err(GpuError::invalid(name, "not a linear")),
        }
    }

    /// The GEMV format the synthetic checkpoint stores a dense linear of `role` in.
    fn gemv_format(&self, role: LinearRole) -> GemvFormat {
        match (self.format, role) {
            (SynthFormat::Official | SynthFormat::Nvfp4, LinearRole::Fp8) => GemvFormat::Fp8 {
                scale: ScaleFormat::E8m0,
                block: (128, 128),
            },
            _ => GemvFormat::Bf16,
        }
    }

    /// Linears of one role that read the same input, stacked row-wise (one for a whole linear),
    /// in the format the upload stacks them in: their own when every join falls on a whole
    /// scale block, else BF16.
    fn linear(&self, names: &[&str]) -> Result<GemvWeight, GpuError> {
        let specs = names
            .iter()
            .map(|n| self.linear_spec(n))
            .collect::<Result<Vec<_>, _>>()?;
        let (rows, (_, cols, role)) = (specs.iter().map(|s| s.0).sum(), specs[0]);
        let format = match self.gemv_format(role) {
            GemvFormat::Fp8 { block, .. }
                if !specs[..specs.len() - 1]
                    .iter()
                    .all(|s| s.0.is_multiple_of(block.0)) =>
            {
                GemvFormat::Bf16
            }
            f => f,
        };
        let name = names.join("+");
        GemvWeight::random(self.dev, format, rows, cols, false, self.seed(&name))
            .map_err(|e| GpuError::invalid(&name, e.to_string()))
    }

    fn values(&self, name: &str) -> Result<Vec<f32>, GpuError> {
        spec_values(self.spec(name)?, self.seed)
            .ok_or_else(|| GpuError::invalid(name, "not a float tensor"))
    }

    fn vector(&self, name: &str) -> Result<DeviceTensor<f32>, GpuError> {
        let v = self.values(name)?;
        self.dev.upload(DType::F32, &[v.len()], &v)
    }

    /// A float tensor in its layout shape, F32.
    fn matrix(&self, name: &str) -> Result<DeviceTensor<f32>, GpuError> {
        let shape = match &self.spec(name)?.kind {
            TensorKind::Vector { shape, .. } => shape.clone(),
            TensorKind::Linear { rows, cols, .. } => vec![*rows, *cols],
            TensorKind::Index { .. } => return Err(GpuError::invalid(name, "not a float tensor")),
        };
        self.dev.upload(DType::F32, &shape, &self.values(name)?)
    }

    /// A small dense matrix (router gate, indexer head weights), BF16 as stored.
    fn dense(&self, name: &str) -> Result<Dense, GpuError> {
        let (rows, cols, _) = self.linear_spec(name)?;
        let v: Vec<bf16> = self.values(name)?.into_iter().map(bf16::from_f32).collect();
        Ok(Dense::Bf16(self.dev.upload(
            DType::BF16,
            &[rows, cols],
            &v,
        )?))
    }

    fn hc_site(&self, prefix: &str, d: usize) -> Result<DeviceHcSite, GpuError> {
        let (fn_, base, scale) = (
            self.values(&format!("{prefix}_fn"))?,
            self.values(&format!("{prefix}_base"))?,
            self.values(&format!("{prefix}_scale"))?,
        );
        let site = HcSite {
            fn_: &fn_,
            base: &base,
            scale: &scale,
        };
        DeviceHcSite::upload(self.dev, &site, d)
    }

    fn compressor(&self, prefix: &str, overlap: bool) -> Result<DevCompressor, GpuError> {
        Ok(DevCompressor {
            proj: self.linear(&[&format!("{prefix}.wkv"), &format!("{prefix}.wgate")])?,
            ape: self.matrix(&format!("{prefix}.ape"))?,
            norm: self.vector(&format!("{prefix}.norm.weight"))?,
            overlap,
        })
    }

    /// A SwiGLU block's gate+up pair (`<p>.w1`, `<p>.w3`) and its down projection.
    fn swiglu(&self, p: &str) -> Result<(GemvWeight, GemvWeight), GpuError> {
        let (rows, cols, role) = self.linear_spec(&format!("{p}.w1"))?;
        let name = format!("{p}.w1+w3");
        let w13 = GemvWeight::random(
            self.dev,
            self.gemv_format(role),
            rows,
            cols,
            true,
            self.seed(&name),
        )
        .map_err(|e| GpuError::invalid(&name, e.to_string()))?;
        Ok((w13, self.linear(&[&format!("{p}.w2")])?))
    }

    fn routed_experts(&self, c: &Config, p: &str) -> Result<RoutedExperts, GpuError> {
        let (e, d, inter) = (c.n_routed_experts, c.hidden_size, c.moe_intermediate_size);
        let seed = self.seed(p);
        let fp4 = |f| MoeExperts::random(self.dev, f, e, d, inter, seed).map(RoutedExperts::Fp4);
        match self.format {
            SynthFormat::Nvfp4 => fp4(MoeFormat::Nvfp4),
            SynthFormat::Official => fp4(MoeFormat::Mxfp4),
            SynthFormat::Bf16 => {
                Bf16Experts::random(self.dev, e, d, inter, seed).map(RoutedExperts::Bf16)
            }
        }
        .map_err(|err| GpuError::invalid(p, err.to_string()))
    }

    fn layer(&self, c: &Config, l: usize) -> Result<DevLayer, GpuError> {
        let p = format!("layers.{l}");
        let kind = c.layer_kind(l);
        let csa = matches!(kind, LayerKind::Csa { .. });
        let attn = DevAttention {
            wq_a_kv: self.linear(&[&format!("{p}.attn.wq_a"), &format!("{p}.attn.wkv")])?,
            q_norm: self.vector(&format!("{p}.attn.q_norm.weight"))?,
            wq_b: self.linear(&[&format!("{p}.attn.wq_b")])?,
            kv_norm: self.vector(&format!("{p}.attn.kv_norm.weight"))?,
            wo_a: self.linear(&[&format!("{p}.attn.wo_a")])?,
            wo_b: self.linear(&[&format!("{p}.attn.wo_b")])?,
            sink: self.vector(&format!("{p}.attn.attn_sink"))?,
            compressor: match kind {
                LayerKind::Sliding => None,
                _ => Some(self.compressor(&format!("{p}.attn.compressor"), csa)?),
            },
            indexer: match kind {
                LayerKind::Csa { .. } => Some(DevIndexer {
                    wq_b: self.linear(&[&format!("{p}.attn.indexer.wq_b")])?,
                    weights_proj: self.dense(&format!("{p}.attn.indexer.weights_proj"))?,
                    compressor: self.compressor(&format!("{p}.attn.indexer.compressor"), true)?,
                }),
                _ => None,
            },
        };
        let routing = if c.is_hash_layer(l) {
            let name = format!("{p}.ffn.gate.tid2eid");
            let ids = spec_expert_ids(self.spec(&name)?, c.n_routed_experts, self.seed)
                .ok_or_else(|| GpuError::invalid(&name, "not an index table"))?;
            let k = c.experts_per_token;
            DevRouting::Hash(self.dev.upload(DType::U32, &[ids.len() / k, k], &ids)?)
        } else {
            DevRouting::Learned(self.vector(&format!("{p}.ffn.gate.bias"))?)
        };
        let (shared_w13, shared_w2) = self.swiglu(&format!("{p}.ffn.shared_experts"))?;
        let d = c.hidden_size;
        Ok(DevLayer {
            kind,
            attn_norm: self.vector(&format!("{p}.attn_norm.weight"))?,
            ffn_norm: self.vector(&format!("{p}.ffn_norm.weight"))?,
            hc_attn: self.hc_site(&format!("{p}.hc_attn"), d)?,
            hc_ffn: self.hc_site(&format!("{p}.hc_ffn"), d)?,
            attn,
            moe: DevMoe {
                gate: self.dense(&format!("{p}.ffn.gate"))?,
                routing,
                experts: self.routed_experts(c, &format!("{p}.ffn.experts"))?,
                shared_w13,
                shared_w2,
            },
        })
    }
}

/// Every weight of `c` drawn at random on `dev`, as the synthetic checkpoint of `format`
/// stores it; `on_layer(done, total)` reports progress.
pub(super) fn random_weights(
    dev: &Device,
    c: &Config,
    head_rows: usize,
    format: SynthFormat,
    seed: u64,
    mut on_layer: impl FnMut(usize, usize),
) -> Result<DevWeights, GpuError> {
    let draw = Draw {
        dev,
        format,
        seed,
        specs: layout::layout(c)
            .into_iter()
            .map(|s| (s.name.clone(), s))
            .collect(),
    };
    let layers = (0..c.num_layers)
        .map(|l| {
            let layer = draw.layer(c, l);
            on_layer(l + 1, c.num_layers);
            layer
        })
        .collect::<Result<Vec<_>, _>>()?;
    let (vocab, d) = (c.vocab_size, c.hidden_size);
    let mut embed = dev.alloc::<bf16>(DType::BF16, &[vocab, d])?;
    // Unit-scale embedding rows (they feed RMSNorms), as the synthetic checkpoint's.
    let unit = Uniform {
        mean: 0.0,
        half_range: 3f32.sqrt(),
    };
    random::fill_uniform(dev, &mut embed, draw.seed("embed"), unit)?;
    Ok(DevWeights {
        embed,
        // The head's rows may be a slice of the vocabulary (one rank's).
        head: Draw {
            specs: layout::layout(&Config {
                vocab_size: head_rows,
                num_layers: 0,
                layers: Vec::new(),
                ..c.clone()
            })
            .into_iter()
            .map(|s| (s.name.clone(), s))
            .collect(),
            dev,
            format,
            seed,
        }
        .linear(&["head"])?,
        norm: draw.vector("norm.weight")?,
        hc_head: draw.hc_site("hc_head", d)?,
        layers,
        rope_main: super::upload::vector(dev, Rope::for_layer(c, false).inv_freq())?,
        rope_compress: super::upload::vector(dev, Rope::for_layer(c, true).inv_freq())?,
    })
}
