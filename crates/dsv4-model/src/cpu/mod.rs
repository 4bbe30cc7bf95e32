//! The float32 CPU reference forward pass. It is the oracle for every GPU kernel and the
//! default backend without a GPU.
//!
//! A call processes a chunk of tokens layer by layer: projections run as one matmul over the
//! chunk, while the order-dependent parts (window ring, compressors, indexer, attention) are
//! the attention kernels' CPU references (`dsv4_ops::gpu::attention::reference`, in their
//! device layouts): the compressors walk the chunk token by token, and each token's indexer
//! choice and attention see exactly the entries and window keys of its position. Every
//! per-token value is computed in the same order whatever the chunking, so prefill in any
//! chunks followed by 1-token decode reproduces one full forward.

mod compressor;
mod moe;
mod ops;

use std::path::Path;

use rayon::prelude::*;

use crate::checkpoint::{Checkpoint, LoadError};
use crate::config::{Config, LayerKind};
use crate::rope::Rope;
use crate::weights::{AttentionWeights, LayerWeights, ModelWeights};
use compressor::CompressorState;
use dsv4_ops::gpu::attention::reference::{attention, index_topk, window_write, HostCompressed};
use dsv4_ops::gpu::mhc::reference::{hc_head, hc_post, hc_pre, HcMix, HcParams};
use ops::{gather_columns, rms_norm, rms_norm_rows};

#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error("token id {token} is outside the vocabulary (vocab_size {vocab})")]
    TokenOutOfRange { token: u32, vocab: usize },
    #[error("sequence of {needed} tokens exceeds the context limit of {limit} (max_position_embeddings)")]
    ContextLimit { needed: usize, limit: usize },
    #[error("empty input: at least one token is needed")]
    Empty,
    #[error("non-finite logits at position {position} ({})", match layer {
        Some(l) => format!("the output of layer {l} is the first that is non-finite there"),
        None => "every layer's output is finite there: the head made them".to_string(),
    })]
    NonFinite {
        position: usize,
        /// The first layer whose output at that position is non-finite.
        layer: Option<usize>,
    },
}

/// Which positions' logits a forward call returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// `[n, vocab]`: every token of the chunk.
    All,
    /// `[vocab]`: the chunk's last token (generation).
    Last,
}

struct LayerState {
    /// The sliding window's keys, a ring `[sliding_window, head_dim]`: position p in slot
    /// p mod sliding_window.
    window: Vec<f32>,
    compressor: Option<CompressorState>,
    indexer: Option<CompressorState>,
}

/// Everything decode needs from the tokens seen so far (spec §10).
pub struct SequenceState {
    pos: usize,
    layers: Vec<LayerState>,
}

impl SequenceState {
    /// Number of tokens processed.
    pub fn len(&self) -> usize {
        self.pos
    }

    pub fn is_empty(&self) -> bool {
        self.pos == 0
    }
}

pub struct CpuModel {
    config: Config,
    weights: ModelWeights,
    rope_main: Rope,
    rope_compress: Rope,
    /// Applied where the GPU rounds activations to BF16 (identity by default).
    round: fn(&mut [f32]),
}

fn keep(_: &mut [f32]) {}

fn round_bf16(v: &mut [f32]) {
    v.iter_mut()
        .for_each(|x| *x = half::bf16::from_f32(*x).to_f32());
}

impl CpuModel {
    /// Opens a checkpoint directory and binds every tensor (weights stay memory-mapped).
    pub fn load(dir: &Path, on_layer: impl FnMut(usize, usize)) -> Result<CpuModel, LoadError> {
        let ck = Checkpoint::open(dir)?;
        let weights = ModelWeights::load(&ck, on_layer)?;
        Ok(CpuModel::new(ck.config().clone(), weights))
    }

    pub fn new(config: Config, weights: ModelWeights) -> CpuModel {
        CpuModel {
            rope_main: Rope::for_layer(&config, false),
            rope_compress: Rope::for_layer(&config, true),
            config,
            weights,
            round: keep,
        }
    }

    /// The same forward with every linear's input rounded to BF16 as the GPU model rounds it
    /// (not the MoE gate's nor the indexer head weights', which it runs in F32; the compressed
    /// entries and indexer keys stay F32 here, f16 on the GPU); outputs stay F32 but where they
    /// feed another linear: the arithmetic the GPU does, to check it position by position where
    /// top-k decisions sit closer than BF16 rounding.
    pub fn with_bf16_activations(mut self) -> CpuModel {
        self.round = round_bf16;
        self
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn new_state(&self) -> SequenceState {
        let c = &self.config;
        let layers = self
            .weights
            .layers
            .iter()
            .map(|l| LayerState {
                window: vec![0.0; c.sliding_window * c.head_dim],
                compressor: l.attn.compressor.as_ref().map(CompressorState::new),
                indexer: l
                    .attn
                    .indexer
                    .as_ref()
                    .map(|i| CompressorState::new(&i.compressor)),
            })
            .collect();
        SequenceState { pos: 0, layers }
    }

    fn hc_params(&self) -> HcParams {
        let c = &self.config;
        HcParams {
            n: c.hc_mult,
            sinkhorn_iters: c.hc_sinkhorn_iters,
            hc_eps: c.hc_eps,
            norm_eps: c.rms_norm_eps,
        }
    }

    /// Runs `tokens` after what `state` has seen and returns the requested logits.
    pub fn forward(
        &self,
        state: &mut SequenceState,
        tokens: &[u32],
        which: Logits,
    ) -> Result<Vec<f32>, ForwardError> {
        let c = &self.config;
        if tokens.is_empty() {
            return Err(ForwardError::Empty);
        }
        if let Some(&token) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(ForwardError::TokenOutOfRange {
                token,
                vocab: c.vocab_size,
            });
        }
        let needed = state.pos + tokens.len();
        if needed > c.max_position_embeddings {
            return Err(ForwardError::ContextLimit {
                needed,
                limit: c.max_position_embeddings,
            });
        }
        let d = c.hidden_size;
        let n = tokens.len();
        let hc = c.hc_dim();
        // mHC state: n identical copies of the embedding per token.
        let mut streams = vec![0.0f32; n * hc];
        streams
            .par_chunks_mut(hc)
            .zip(tokens.par_iter())
            .for_each(|(x, &t)| {
                self.weights.embed.dequant_row(t as usize, &mut x[..d]);
                let (first, rest) = x.split_at_mut(d);
                rest.chunks_exact_mut(d)
                    .for_each(|copy| copy.copy_from_slice(first));
            });
        // Per token: the first layer whose output is non-finite (cheap next to the layer).
        let mut first_bad_layer: Vec<Option<usize>> = vec![None; n];
        for (l, (lw, ls)) in self
            .weights
            .layers
            .iter()
            .zip(state.layers.iter_mut())
            .enumerate()
        {
            self.layer(lw, ls, &mut streams, tokens, state.pos);
            first_bad_layer
                .par_iter_mut()
                .zip(streams.par_chunks(hc))
                .filter(|(bad, _)| bad.is_none())
                .for_each(|(bad, row)| {
                    if row.iter().any(|x| !x.is_finite()) {
                        *bad = Some(l);
                    }
                });
        }
        let pos0 = state.pos;
        state.pos += n;

        let rows: Vec<&[f32]> = match which {
            Logits::All => streams.chunks_exact(hc).collect(),
            Logits::Last => vec![&streams[(n - 1) * hc..]],
        };
        let p = self.hc_params();
        let h: Vec<f32> = rows
            .par_iter()
            .flat_map_iter(|x| {
                let mut y = hc_head(&self.weights.hc_head.site(), x, &p);
                rms_norm(&mut y, Some(&self.weights.norm), c.rms_norm_eps);
                y
            })
            .collect();
        let m = rows.len();
        let mut h = h;
        (self.round)(&mut h);
        let mut logits = vec![0.0f32; m * c.vocab_size];
        self.weights.head.matmul(&h, m, &mut logits);
        if let Some(row) = logits
            .chunks_exact(c.vocab_size)
            .position(|r| r.iter().any(|x| !x.is_finite()))
        {
            let i = row + n - m;
            return Err(ForwardError::NonFinite {
                position: pos0 + i,
                layer: first_bad_layer[i],
            });
        }
        Ok(logits)
    }

    /// Runs one mHC site: collapse, norm, `sublayer`, expand.
    fn site(
        &self,
        hc_w: &crate::weights::HcWeights,
        norm: &[f32],
        streams: &mut [f32],
        sublayer: impl FnOnce(&[f32]) -> Vec<f32>,
    ) {
        let c = &self.config;
        let (d, hc) = (c.hidden_size, c.hc_dim());
        let p = self.hc_params();
        let (mixes, mut x): (Vec<HcMix>, Vec<Vec<f32>>) = streams
            .par_chunks(hc)
            .map(|s| hc_pre(&hc_w.site(), s, &p))
            .unzip();
        x.iter_mut()
            .for_each(|row| rms_norm(row, Some(norm), c.rms_norm_eps));
        let y = sublayer(&x.concat());
        streams
            .par_chunks_mut(hc)
            .zip(y.par_chunks(d))
            .zip(mixes.par_iter())
            .for_each(|((s, y), mix)| hc_post(s, y, mix));
    }

    fn layer(
        &self,
        lw: &LayerWeights,
        ls: &mut LayerState,
        streams: &mut [f32],
        tokens: &[u32],
        pos0: usize,
    ) {
        let c = &self.config;
        self.site(&lw.hc_attn, &lw.attn_norm, streams, |x| {
            self.attention(lw, ls, x, pos0)
        });
        self.site(&lw.hc_ffn, &lw.ffn_norm, streams, |h| {
            moe::moe(
                &lw.moe,
                h,
                tokens,
                c.experts_per_token,
                c.routed_scaling_factor,
                c.swiglu_limit,
                self.round,
            )
        });
    }

    /// Attention for a chunk of normalized inputs `x` (`[n, D]`) at positions `pos0..`.
    fn attention(
        &self,
        lw: &LayerWeights,
        ls: &mut LayerState,
        x: &[f32],
        pos0: usize,
    ) -> Vec<f32> {
        let c = &self.config;
        let w: &AttentionWeights = &lw.attn;
        let (d, hd, eps) = (c.hidden_size, c.num_heads * c.head_dim, c.rms_norm_eps);
        let n = x.len() / d;
        let rope = if lw.kind == LayerKind::Sliding {
            &self.rope_main
        } else {
            &self.rope_compress
        };
        let matmul_f32 = |lin: &crate::linear::Linear, input: &[f32]| {
            let mut y = vec![0.0f32; n * lin.rows()];
            lin.matmul(input, n, &mut y);
            y
        };
        let matmul = |lin: &crate::linear::Linear, input: &[f32]| {
            let mut x = input.to_vec();
            (self.round)(&mut x);
            matmul_f32(lin, &x)
        };

        let mut q_lat = matmul(&w.wq_a, x);
        rms_norm_rows(&mut q_lat, c.q_lora_rank, Some(&w.q_norm), eps);
        let mut q = matmul(&w.wq_b, &q_lat);
        let mut kv = matmul(&w.wkv, x);
        rms_norm_rows(&mut kv, c.head_dim, Some(&w.kv_norm), eps);
        q.par_chunks_mut(hd)
            .zip(kv.par_chunks_mut(c.head_dim))
            .enumerate()
            .for_each(|(s, (qs, kvs))| {
                rms_norm_rows(qs, c.head_dim, None, eps);
                rope.apply_each(qs, c.head_dim, pos0 + s, false);
                rope.apply(kvs, pos0 + s, false);
            });

        let comp = w
            .compressor
            .as_ref()
            .map(|cw| (matmul(&cw.wkv, x), matmul(&cw.wgate, x)));
        let index = w.indexer.as_ref().map(|iw| {
            let ic = c.index_head_dim;
            let mut iq = matmul(&iw.wq_b, &q_lat);
            iq.par_chunks_mut(c.index_n_heads * ic)
                .enumerate()
                .for_each(|(s, row)| self.rope_compress.apply_each(row, ic, pos0 + s, false));
            // Raw head weights: `index_topk` scales them by 1/sqrt(index_n_heads).
            let weights = matmul_f32(&iw.weights_proj, x);
            (
                iq,
                weights,
                matmul(&iw.compressor.wkv, x),
                matmul(&iw.compressor.wgate, x),
            )
        });

        // The chunk's compressed entries first: token s sees those its position has closed.
        if let (Some(cw), Some(st), Some((ckv, cgate))) = (&w.compressor, &mut ls.compressor, &comp)
        {
            st.push(cw, ckv, cgate, pos0, &self.rope_compress, eps);
        }
        let selected = match (&w.indexer, &mut ls.indexer, &index) {
            (Some(iw), Some(ist), Some((iq, iwts, ikv, igate))) => {
                ist.push(&iw.compressor, ikv, igate, pos0, &self.rope_compress, eps);
                Some(index_topk(
                    iq,
                    iwts,
                    ist.entries(),
                    c.index_n_heads,
                    c.index_head_dim,
                    iw.compressor.ratio,
                    pos0,
                    c.index_topk,
                ))
            }
            _ => None,
        };
        let entries = ls.compressor.as_ref().map_or(&[][..], |st| st.entries());
        let compressed = match (&selected, &w.compressor) {
            (Some(selected), _) => HostCompressed::Selected {
                entries,
                selected,
                k: c.index_topk,
            },
            (None, Some(cw)) => HostCompressed::All {
                entries,
                ratio: cw.ratio,
            },
            (None, None) => HostCompressed::None,
        };
        let mut out = attention(&q, &kv, &ls.window, c.head_dim, compressed, &w.sink, pos0);
        window_write(&kv, c.head_dim, pos0, &mut ls.window);
        out.par_chunks_mut(hd)
            .enumerate()
            .for_each(|(s, o)| rope.apply_each(o, c.head_dim, pos0 + s, true));

        // Grouped output projection: group g maps its heads' outputs through rows g·r..(g+1)·r.
        let (g, r) = (c.o_groups, c.o_lora_rank);
        let gw = hd / g;
        let mut z = vec![0.0f32; n * g * r];
        for grp in 0..g {
            let mut xin = gather_columns(&out, hd, grp * gw, gw);
            (self.round)(&mut xin);
            let mut zg = vec![0.0f32; n * r];
            w.wo_a.matmul_rows(grp * r, r, &xin, n, &mut zg);
            (self.round)(&mut zg);
            for (dst, src) in z.chunks_exact_mut(g * r).zip(zg.chunks_exact(r)) {
                dst[grp * r..(grp + 1) * r].copy_from_slice(src);
            }
        }
        matmul(&w.wo_b, &z)
    }
}
