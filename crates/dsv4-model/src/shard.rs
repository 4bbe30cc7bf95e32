//! Tensor parallelism: what one of `world` GPUs holds of the model. Split are the matrices
//! read at every token that are large: the query heads (`wq_b`, the sinks), the output groups
//! (`wo_a`'s rows, `wo_b`'s columns: partial sums), each routed and shared expert's
//! intermediate (`w1`/`w3` rows, `w2` columns: partial sums) and the head's vocabulary rows.
//! The rest (embedding, the shared key/value path, compressors, indexer, norms, mHC, router)
//! is small or read once per token by every rank alike, and is replicated. A rank's model is
//! then the whole model at narrower widths ([`local_config`]), plus one all-reduce after each
//! sub-layer and an all-gather of the logits.

use std::ops::Range;

use dsv4_ops::codecs::CodecError;
use rayon::prelude::*;

use crate::config::Config;
use crate::linear::Linear;
use crate::weights::{AttentionWeights, ExpertWeights, LayerWeights, ModelWeights};

/// Rank `rank` of the `world` GPUs a model is split over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub world: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    #[error("{field} = {value} does not split evenly over {world} GPUs")]
    Uneven {
        field: &'static str,
        value: usize,
        world: usize,
    },
    #[error("{tensor}: {source}")]
    Slice {
        tensor: String,
        #[source]
        source: CodecError,
    },
}

impl Shard {
    /// This rank's part of `0..n` (`n` divisible by `world`, checked by [`local_config`]).
    fn part(&self, n: usize) -> Range<usize> {
        let each = n / self.world;
        self.rank * each..(self.rank + 1) * each
    }
}

/// The widths one rank runs with: `world` times fewer query heads, output groups and expert
/// intermediate channels; a shape that does not split is named.
pub fn local_config(c: &Config, world: usize) -> Result<Config, ShardError> {
    for (field, value) in [
        ("num_attention_heads", c.num_heads),
        ("o_groups", c.o_groups),
        ("moe_intermediate_size", c.moe_intermediate_size),
        ("vocab_size", c.vocab_size),
    ] {
        if world == 0 || !value.is_multiple_of(world) {
            return Err(ShardError::Uneven {
                field,
                value,
                world,
            });
        }
    }
    let mut local = c.clone();
    local.num_heads /= world;
    local.o_groups /= world;
    local.moe_intermediate_size /= world;
    Ok(local)
}

fn rows(name: &str, lin: &Linear, r: Range<usize>) -> Result<Linear, ShardError> {
    lin.slice_rows(r).map_err(|source| ShardError::Slice {
        tensor: name.to_string(),
        source,
    })
}

fn cols(name: &str, lin: &Linear, c: Range<usize>) -> Result<Linear, ShardError> {
    lin.slice_cols(c).map_err(|source| ShardError::Slice {
        tensor: name.to_string(),
        source,
    })
}

/// An expert's intermediate channels `part` (of its own intermediate width).
fn expert(name: &str, e: &ExpertWeights, s: Shard) -> Result<ExpertWeights, ShardError> {
    let part = s.part(e.w1.rows());
    Ok(ExpertWeights {
        w1: rows(&format!("{name}.w1"), &e.w1, part.clone())?,
        w3: rows(&format!("{name}.w3"), &e.w3, part.clone())?,
        w2: cols(&format!("{name}.w2"), &e.w2, part)?,
    })
}

fn attention(
    name: &str,
    c: &Config,
    a: &AttentionWeights,
    s: Shard,
) -> Result<AttentionWeights, ShardError> {
    let heads = s.part(c.num_heads);
    let groups = s.part(c.o_groups);
    let hd = c.head_dim;
    let orank = c.o_lora_rank;
    Ok(AttentionWeights {
        wq_b: rows(
            &format!("{name}.wq_b"),
            &a.wq_b,
            heads.start * hd..heads.end * hd,
        )?,
        wo_a: rows(
            &format!("{name}.wo_a"),
            &a.wo_a,
            groups.start * orank..groups.end * orank,
        )?,
        wo_b: cols(
            &format!("{name}.wo_b"),
            &a.wo_b,
            groups.start * orank..groups.end * orank,
        )?,
        sink: a.sink[heads].to_vec(),
        ..a.clone()
    })
}

/// What rank `s.rank` holds of layer `l` (of a model of `c`).
pub fn shard_layer(
    c: &Config,
    l: usize,
    lw: &LayerWeights,
    s: Shard,
) -> Result<LayerWeights, ShardError> {
    let p = format!("layers.{l}");
    let mut out = lw.clone();
    out.attn = attention(&format!("{p}.attn"), c, &lw.attn, s)?;
    // Column cuts copy: the experts' are made in parallel.
    out.moe.experts = lw
        .moe
        .experts
        .par_iter()
        .enumerate()
        .map(|(e, ew)| expert(&format!("{p}.ffn.experts.{e}"), ew, s))
        .collect::<Result<_, _>>()?;
    out.moe.shared = expert(&format!("{p}.ffn.shared_experts"), &lw.moe.shared, s)?;
    Ok(out)
}

/// What rank `s.rank` holds of `w` (a model of `c`): slices of the split matrices (sharing
/// the checkpoint's bytes where rows are cut), the rest as it is.
pub fn shard_weights(w: &ModelWeights, c: &Config, s: Shard) -> Result<ModelWeights, ShardError> {
    local_config(c, s.world)?;
    Ok(ModelWeights {
        embed: w.embed.clone(),
        head: shard_head(c, &w.head, s)?,
        norm: w.norm.clone(),
        hc_head: w.hc_head.clone(),
        layers: w
            .layers
            .iter()
            .enumerate()
            .map(|(l, lw)| shard_layer(c, l, lw, s))
            .collect::<Result<_, _>>()?,
    })
}

/// Rank `s.rank`'s vocabulary rows of the output head.
pub fn shard_head(c: &Config, head: &Linear, s: Shard) -> Result<Linear, ShardError> {
    rows("head", head, s.part(c.vocab_size))
}

/// Bytes a linear takes on the device (F32 and F16 become BF16 there).
fn device_bytes(lin: &Linear) -> usize {
    match lin.data() {
        crate::linear::LinearData::F32(_) => lin.bytes() / 2,
        _ => lin.bytes(),
    }
}

/// Device bytes of the weights one rank of `world` holds: the split matrices' `world`-th,
/// the rest whole (the small vectors as F32).
pub fn rank_weight_bytes(w: &ModelWeights, world: usize) -> usize {
    let f32s = |v: &[f32]| v.len() * 4;
    let hc = |h: &crate::weights::HcWeights| f32s(&h.fn_) + f32s(&h.base) + f32s(&h.scale);
    let expert =
        |e: &ExpertWeights| device_bytes(&e.w1) + device_bytes(&e.w2) + device_bytes(&e.w3);
    let comp = |c: &crate::weights::CompressorWeights| {
        device_bytes(&c.wkv) + device_bytes(&c.wgate) + f32s(&c.ape) + f32s(&c.norm)
    };
    let mut whole = device_bytes(&w.embed) + f32s(&w.norm) + hc(&w.hc_head);
    let mut split = device_bytes(&w.head);
    for l in &w.layers {
        let a = &l.attn;
        whole += f32s(&l.attn_norm) + f32s(&l.ffn_norm) + hc(&l.hc_attn) + hc(&l.hc_ffn);
        whole += device_bytes(&a.wq_a) + device_bytes(&a.wkv) + f32s(&a.q_norm) + f32s(&a.kv_norm);
        whole += a.compressor.as_ref().map_or(0, comp);
        whole += a.indexer.as_ref().map_or(0, |i| {
            device_bytes(&i.wq_b) + device_bytes(&i.weights_proj) + comp(&i.compressor)
        });
        whole += device_bytes(&l.moe.gate);
        whole += match &l.moe.routing {
            crate::weights::Routing::Hash { tid2eid } => tid2eid.len() * 4,
            crate::weights::Routing::Learned { bias } => f32s(bias),
        };
        split += device_bytes(&a.wq_b) + device_bytes(&a.wo_a) + device_bytes(&a.wo_b);
        split += f32s(&a.sink) + expert(&l.moe.shared);
        split += l.moe.experts.iter().map(expert).sum::<usize>();
    }
    whole + split / world
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::Checkpoint;
    use crate::synth::{write_synthetic, SynthFormat};

    fn synth_weights(c: &Config, format: SynthFormat) -> ModelWeights {
        let dir = tempfile::tempdir().unwrap();
        write_synthetic(c, format, dir.path(), 5, &mut |_, _| {}).unwrap();
        let ck = Checkpoint::open(dir.path()).unwrap();
        ModelWeights::load(&ck, |_, _| {}).unwrap()
    }

    #[test]
    fn ranks_split_the_large_matrices_and_share_the_rest() {
        let c = Config::tiny();
        for format in [SynthFormat::Bf16, SynthFormat::Official, SynthFormat::Nvfp4] {
            let w = synth_weights(&c, format);
            let world = 2;
            let parts: Vec<ModelWeights> = (0..world)
                .map(|rank| shard_weights(&w, &c, Shard { rank, world }).unwrap())
                .collect();
            let local = local_config(&c, world).unwrap();
            for (l, lw) in w.layers.iter().enumerate() {
                let a = &lw.attn;
                // Rows of wq_b and wo_a, columns of wo_b, the sinks: rank 0's then rank 1's.
                let cat_rows = |f: fn(&AttentionWeights) -> &Linear| -> Vec<f32> {
                    parts
                        .iter()
                        .flat_map(|p| f(&p.layers[l].attn).to_f32())
                        .collect()
                };
                assert_eq!(
                    cat_rows(|a| &a.wq_b),
                    a.wq_b.to_f32(),
                    "{format:?} layer {l} wq_b"
                );
                assert_eq!(
                    cat_rows(|a| &a.wo_a),
                    a.wo_a.to_f32(),
                    "{format:?} layer {l} wo_a"
                );
                let wo_b = a.wo_b.to_f32();
                let half = a.wo_b.cols() / world;
                for (r, p) in parts.iter().enumerate() {
                    let got = p.layers[l].attn.wo_b.to_f32();
                    for row in 0..a.wo_b.rows() {
                        let want = &wo_b[row * a.wo_b.cols() + r * half..][..half];
                        assert_eq!(
                            &got[row * half..][..half],
                            want,
                            "{format:?} wo_b row {row}"
                        );
                    }
                    assert_eq!(
                        p.layers[l].attn.sink,
                        a.sink[r * local.num_heads..][..local.num_heads]
                    );
                    assert_eq!(
                        p.layers[l].attn.wq_a.to_f32(),
                        a.wq_a.to_f32(),
                        "replicated"
                    );
                    let e = &p.layers[l].moe.experts[1];
                    assert_eq!(e.w1.rows(), local.moe_intermediate_size);
                    assert_eq!(e.w2.cols(), local.moe_intermediate_size);
                }
            }
            let heads: Vec<f32> = parts.iter().flat_map(|p| p.head.to_f32()).collect();
            assert_eq!(heads, w.head.to_f32(), "{format:?} head");
        }
    }

    #[test]
    fn shapes_that_do_not_split_are_named() {
        let c = Config::tiny();
        let err = local_config(&c, 3).unwrap_err().to_string();
        assert!(err.contains("over 3 GPUs"), "{err}");
        let mut c = Config::flash();
        c.num_heads = 66;
        c.o_groups = 6;
        let err = local_config(&c, 4).unwrap_err().to_string();
        assert!(err.contains("num_attention_heads = 66"), "{err}");
    }
}
