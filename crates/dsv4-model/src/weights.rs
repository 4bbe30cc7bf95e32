//! The model's tensors, typed and shape-checked, as views into the memory-mapped checkpoint.
//! Names are the DeepSeek-native ones (spec §12); the checkpoint maps transformers names to them.

use crate::checkpoint::{Checkpoint, LoadError};
use crate::config::{Config, LayerKind};
use crate::linear::Linear;
use dsv4_ops::gpu::mhc::reference::HcSite;

/// mHC parameters of one site: `fn [mix, n·D]`, `base [mix]`, `scale [3]` (or `[1]` for the head).
#[derive(Clone)]
pub struct HcWeights {
    pub fn_: Vec<f32>,
    pub base: Vec<f32>,
    pub scale: Vec<f32>,
}

impl HcWeights {
    pub fn site(&self) -> HcSite<'_> {
        HcSite {
            fn_: &self.fn_,
            base: &self.base,
            scale: &self.scale,
        }
    }
}

/// A token compressor (spec §6): projections to `κ·c`, gate position bias, output norm.
#[derive(Clone)]
pub struct CompressorWeights {
    pub wkv: Linear,
    pub wgate: Linear,
    /// `[ratio, κ·c]`, added to the gate logits by position inside the window.
    pub ape: Vec<f32>,
    pub norm: Vec<f32>,
    pub ratio: usize,
    /// Output width `c`.
    pub width: usize,
    /// CSA compressors pool two overlapping windows (κ = 2).
    pub overlap: bool,
}

/// Lightning indexer of a CSA layer (spec §7).
#[derive(Clone)]
pub struct IndexerWeights {
    pub wq_b: Linear,
    pub weights_proj: Linear,
    pub compressor: CompressorWeights,
}

#[derive(Clone)]
pub struct AttentionWeights {
    pub wq_a: Linear,
    pub q_norm: Vec<f32>,
    pub wq_b: Linear,
    pub wkv: Linear,
    pub kv_norm: Vec<f32>,
    pub wo_a: Linear,
    pub wo_b: Linear,
    pub sink: Vec<f32>,
    pub compressor: Option<CompressorWeights>,
    pub indexer: Option<IndexerWeights>,
}

/// SwiGLU expert: `w1` gate, `w3` up (`[I, D]`), `w2` down (`[D, I]`).
#[derive(Clone)]
pub struct ExpertWeights {
    pub w1: Linear,
    pub w2: Linear,
    pub w3: Linear,
}

#[derive(Clone)]
pub enum Routing {
    /// Layers below `num_hash_layers`: experts fixed per token id, `[vocab, k]`.
    Hash { tid2eid: Vec<u32> },
    /// Learned top-k with a selection-only bias.
    Learned { bias: Vec<f32> },
}

#[derive(Clone)]
pub struct MoeWeights {
    pub gate: Linear,
    pub routing: Routing,
    pub experts: Vec<ExpertWeights>,
    pub shared: ExpertWeights,
}

#[derive(Clone)]
pub struct LayerWeights {
    pub kind: LayerKind,
    pub attn_norm: Vec<f32>,
    pub ffn_norm: Vec<f32>,
    pub hc_attn: HcWeights,
    pub hc_ffn: HcWeights,
    pub attn: AttentionWeights,
    pub moe: MoeWeights,
}

#[derive(Clone)]
pub struct ModelWeights {
    pub embed: Linear,
    pub head: Linear,
    pub norm: Vec<f32>,
    pub hc_head: HcWeights,
    pub layers: Vec<LayerWeights>,
}

fn load_hc(
    ck: &Checkpoint,
    prefix: &str,
    mix: usize,
    hc_dim: usize,
    scales: usize,
) -> Result<HcWeights, LoadError> {
    Ok(HcWeights {
        fn_: ck.vector_f32(&format!("{prefix}_fn"), &[mix, hc_dim])?,
        base: ck.vector_f32(&format!("{prefix}_base"), &[mix])?,
        scale: ck.vector_f32(&format!("{prefix}_scale"), &[scales])?,
    })
}

fn load_compressor(
    ck: &Checkpoint,
    prefix: &str,
    d: usize,
    width: usize,
    ratio: usize,
    overlap: bool,
) -> Result<CompressorWeights, LoadError> {
    let out = if overlap { 2 * width } else { width };
    Ok(CompressorWeights {
        wkv: ck.linear(&format!("{prefix}.wkv"), out, d)?,
        wgate: ck.linear(&format!("{prefix}.wgate"), out, d)?,
        ape: ck.vector_f32(&format!("{prefix}.ape"), &[ratio, out])?,
        norm: ck.vector_f32(&format!("{prefix}.norm.weight"), &[width])?,
        ratio,
        width,
        overlap,
    })
}

fn load_expert(
    ck: &Checkpoint,
    prefix: &str,
    d: usize,
    inter: usize,
) -> Result<ExpertWeights, LoadError> {
    Ok(ExpertWeights {
        w1: ck.linear(&format!("{prefix}.w1"), inter, d)?,
        w2: ck.linear(&format!("{prefix}.w2"), d, inter)?,
        w3: ck.linear(&format!("{prefix}.w3"), inter, d)?,
    })
}

fn load_layer(ck: &Checkpoint, c: &Config, l: usize) -> Result<LayerWeights, LoadError> {
    let p = format!("layers.{l}");
    let d = c.hidden_size;
    let hd = c.num_heads * c.head_dim;
    let kind = c.layer_kind(l);
    let compressor = match kind {
        LayerKind::Sliding => None,
        LayerKind::Csa { ratio } => Some(load_compressor(
            ck,
            &format!("{p}.attn.compressor"),
            d,
            c.head_dim,
            ratio,
            true,
        )?),
        LayerKind::Hca { ratio } => Some(load_compressor(
            ck,
            &format!("{p}.attn.compressor"),
            d,
            c.head_dim,
            ratio,
            false,
        )?),
    };
    let indexer = match kind {
        LayerKind::Csa { ratio } => Some(IndexerWeights {
            wq_b: ck.linear(
                &format!("{p}.attn.indexer.wq_b"),
                c.index_n_heads * c.index_head_dim,
                c.q_lora_rank,
            )?,
            weights_proj: ck.linear(
                &format!("{p}.attn.indexer.weights_proj"),
                c.index_n_heads,
                d,
            )?,
            compressor: load_compressor(
                ck,
                &format!("{p}.attn.indexer.compressor"),
                d,
                c.index_head_dim,
                ratio,
                true,
            )?,
        }),
        _ => None,
    };
    let attn = AttentionWeights {
        wq_a: ck.linear(&format!("{p}.attn.wq_a"), c.q_lora_rank, d)?,
        q_norm: ck.vector_f32(&format!("{p}.attn.q_norm.weight"), &[c.q_lora_rank])?,
        wq_b: ck.linear(&format!("{p}.attn.wq_b"), hd, c.q_lora_rank)?,
        wkv: ck.linear(&format!("{p}.attn.wkv"), c.head_dim, d)?,
        kv_norm: ck.vector_f32(&format!("{p}.attn.kv_norm.weight"), &[c.head_dim])?,
        wo_a: ck.linear(
            &format!("{p}.attn.wo_a"),
            c.o_groups * c.o_lora_rank,
            hd / c.o_groups,
        )?,
        wo_b: ck.linear(&format!("{p}.attn.wo_b"), d, c.o_groups * c.o_lora_rank)?,
        sink: ck.vector_f32(&format!("{p}.attn.attn_sink"), &[c.num_heads])?,
        compressor,
        indexer,
    };
    let e = c.n_routed_experts;
    let routing = if c.is_hash_layer(l) {
        let tid2eid = ck.index_table(
            &format!("{p}.ffn.gate.tid2eid"),
            c.vocab_size,
            c.experts_per_token,
        )?;
        if let Some(bad) = tid2eid.iter().find(|&&x| x as usize >= e) {
            return Err(LoadError::BadValue {
                tensor: format!("{p}.ffn.gate.tid2eid"),
                reason: format!("expert id {bad} is not below n_routed_experts {e}"),
            });
        }
        Routing::Hash { tid2eid }
    } else {
        Routing::Learned {
            bias: ck.vector_f32(&format!("{p}.ffn.gate.bias"), &[e])?,
        }
    };
    let moe = MoeWeights {
        gate: ck.linear(&format!("{p}.ffn.gate"), e, d)?,
        routing,
        experts: (0..e)
            .map(|x| {
                load_expert(
                    ck,
                    &format!("{p}.ffn.experts.{x}"),
                    d,
                    c.moe_intermediate_size,
                )
            })
            .collect::<Result<_, _>>()?,
        shared: load_expert(
            ck,
            &format!("{p}.ffn.shared_experts"),
            d,
            c.moe_intermediate_size,
        )?,
    };
    Ok(LayerWeights {
        kind,
        attn_norm: ck.vector_f32(&format!("{p}.attn_norm.weight"), &[d])?,
        ffn_norm: ck.vector_f32(&format!("{p}.ffn_norm.weight"), &[d])?,
        hc_attn: load_hc(ck, &format!("{p}.hc_attn"), c.hc_mix(), c.hc_dim(), 3)?,
        hc_ffn: load_hc(ck, &format!("{p}.hc_ffn"), c.hc_mix(), c.hc_dim(), 3)?,
        attn,
        moe,
    })
}

impl ModelWeights {
    /// Binds every tensor the config requires; `on_layer(done, total)` reports progress.
    pub fn load(
        ck: &Checkpoint,
        mut on_layer: impl FnMut(usize, usize),
    ) -> Result<ModelWeights, LoadError> {
        let c = ck.config();
        let d = c.hidden_size;
        let layers = (0..c.num_layers)
            .map(|l| {
                let w = load_layer(ck, c, l);
                on_layer(l + 1, c.num_layers);
                w
            })
            .collect::<Result<_, _>>()?;
        Ok(ModelWeights {
            embed: ck.linear("embed", c.vocab_size, d)?,
            head: ck.linear("head", c.vocab_size, d)?,
            norm: ck.vector_f32("norm.weight", &[d])?,
            hc_head: load_hc(ck, "hc_head", c.hc_mult, c.hc_dim(), 1)?,
            layers,
        })
    }
}

impl ExpertWeights {
    pub fn bytes(&self) -> usize {
        self.w1.bytes() + self.w2.bytes() + self.w3.bytes()
    }
}

impl CompressorWeights {
    fn bytes(&self) -> usize {
        self.wkv.bytes() + self.wgate.bytes()
    }
}

impl ModelWeights {
    /// Weight bytes one decode step must stream: every dense projection, `k` average routed
    /// experts per layer, the head and one embedding row.
    pub fn decode_bytes_per_token(&self, c: &Config) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                let a = &l.attn;
                let dense = [&a.wq_a, &a.wq_b, &a.wkv, &a.wo_a, &a.wo_b, &l.moe.gate]
                    .iter()
                    .map(|x| x.bytes())
                    .sum::<usize>();
                let comp = a.compressor.as_ref().map_or(0, CompressorWeights::bytes);
                let idx = a.indexer.as_ref().map_or(0, |i| {
                    i.wq_b.bytes() + i.weights_proj.bytes() + i.compressor.bytes()
                });
                let routed: usize = l.moe.experts.iter().map(ExpertWeights::bytes).sum();
                dense
                    + comp
                    + idx
                    + l.moe.shared.bytes()
                    + routed * c.experts_per_token / l.moe.experts.len()
            })
            .sum();
        layers + self.head.bytes() + self.embed.bytes() / c.vocab_size
    }
}
