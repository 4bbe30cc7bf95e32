//! Everything the GPU forward writes, in one buffer pool: the state of each sequence slot
//! (next token, position, sampling settings, window rings, compressor windows and entries,
//! indexer keys; each state buffer `[slots, ...]`) and the activations of
//! a chunk of tokens (the plan's chunk length; the launches that take at most [`MAX_CHUNK`]
//! tokens run over its sub-chunks, and the head over at most [`MAX_CHUNK`] rows). Sizes depend only on the config and the context
//! capacity, so the same code runs twice: a sizing pass reserves every buffer by name in the
//! open pool, and after sealing a second pass takes them (fixed addresses for graph replays).

use dsv4_ops::gpu::attention::{AttentionSplits, CompressorBuffers};
use dsv4_ops::gpu::collective::{self, RankBuffers};
use dsv4_ops::gpu::gemv::GemvWorkspace;
use dsv4_ops::gpu::mhc::mix_partials_shape;
use dsv4_ops::gpu::random::{fill_uniform, Uniform};
use dsv4_ops::gpu::{BufferPool, Device, DeviceElem, DeviceTensor, GpuError};
use half::{bf16, f16};

use crate::config::{Config, LayerKind};

/// Most tokens the indexer's top-k, the BF16 routed experts and the head take at once (the
/// decode kernels' limit): a longer chunk runs them once per sub-chunk of this many.
pub const MAX_CHUNK: usize = 16;

/// Queries a chunk's indexer scores and selects at once (a multiple of [`MAX_CHUNK`]): fewer,
/// wider launches than a sub-chunk each, for a scratch of this many rows of a CSA layer's
/// entries (134 MB at 1M positions).
pub const SELECT_ROWS: usize = 128;

/// The indexer's score scratch: `[min(chunk, SELECT_ROWS), entries]` for the CSA layer with the
/// most entries.
fn index_scores_shape(c: &Config, capacity: usize, chunk: usize) -> [usize; 2] {
    let cap = c.layers.iter().filter_map(|k| match k {
        LayerKind::Csa { ratio } => Some((capacity / ratio).max(1)),
        _ => None,
    });
    match cap.max() {
        Some(cap) => [chunk.min(SELECT_ROWS), cap],
        None => [1, 1],
    }
}

/// Splits of one decode token's attention keys the scratch has room for, per head: a block
/// of a token's 64 heads a split, up to one on every SM of a GPU of 160 (21 MB at Flash's
/// widths).
const ATTENTION_SPLITS: usize = 160;

/// How [`Buffers::build`] gets a buffer: reserved in the open pool, or taken from it sealed.
pub trait Stage {
    type Buf<E: DeviceElem>;
    type Workspace;
    fn buf<E: DeviceElem>(&mut self, name: &str, shape: &[usize])
        -> Result<Self::Buf<E>, GpuError>;
    fn workspace(&mut self, name: &str) -> Result<Self::Workspace, GpuError>;
}

/// Reserves in an open pool (owned, so buffer types carry no lifetime).
pub struct Sizing(pub BufferPool);

impl Stage for Sizing {
    type Buf<E: DeviceElem> = ();
    type Workspace = ();
    fn buf<E: DeviceElem>(&mut self, name: &str, shape: &[usize]) -> Result<(), GpuError> {
        let _ = self.0.reserve::<E>(name, E::DTYPES[0], shape)?;
        Ok(())
    }
    fn workspace(&mut self, name: &str) -> Result<(), GpuError> {
        let _ = GemvWorkspace::reserve(&mut self.0, name)?;
        Ok(())
    }
}

/// Takes from the sealed pool.
pub struct Taking(pub BufferPool);

impl Stage for Taking {
    type Buf<E: DeviceElem> = DeviceTensor<E>;
    type Workspace = GemvWorkspace;
    fn buf<E: DeviceElem>(
        &mut self,
        name: &str,
        shape: &[usize],
    ) -> Result<DeviceTensor<E>, GpuError> {
        self.0.take_named(name, E::DTYPES[0], shape)
    }
    fn workspace(&mut self, name: &str) -> Result<GemvWorkspace, GpuError> {
        GemvWorkspace::take_named(&mut self.0, name)
    }
}

/// One compressor's state (see [`CompressorBuffers`]).
pub struct CompState<S: Stage> {
    kv: S::Buf<f32>,
    gate: S::Buf<f32>,
    prev_kv: S::Buf<f32>,
    prev_gate: S::Buf<f32>,
    entries: S::Buf<f16>,
}

impl<S: Stage> CompState<S> {
    fn build(
        s: &mut S,
        name: &str,
        ratio: usize,
        width: usize,
        overlap: bool,
        [slots, capacity]: [usize; 2],
    ) -> Result<Self, GpuError> {
        let row = if overlap { 2 * width } else { width };
        Ok(CompState {
            kv: s.buf(&format!("{name}.kv"), &[slots, ratio, row])?,
            gate: s.buf(&format!("{name}.gate"), &[slots, ratio, row])?,
            prev_kv: s.buf(&format!("{name}.prev_kv"), &[slots, ratio, width])?,
            prev_gate: s.buf(&format!("{name}.prev_gate"), &[slots, ratio, width])?,
            entries: s.buf(&format!("{name}.entries"), &[slots, capacity.max(1), width])?,
        })
    }
}

impl CompState<Taking> {
    /// The launchers' view of the sequences' state (the same memory).
    pub fn buffers(&self, seqs: Seqs) -> Result<CompressorBuffers, GpuError> {
        Ok(CompressorBuffers {
            kv: seqs.view(&self.kv)?,
            gate: seqs.view(&self.gate)?,
            prev_kv: seqs.view(&self.prev_kv)?,
            prev_gate: seqs.view(&self.prev_gate)?,
            entries: seqs.view(&self.entries)?,
        })
    }

    /// Fills every state row as [`LayerState::fill_random`] says, from seeds `seed`,
    /// `seed + 1`, ...
    fn fill_random(&mut self, dev: &Device, seed: u64, dist: Uniform) -> Result<(), GpuError> {
        for (k, t) in [
            &mut self.kv,
            &mut self.gate,
            &mut self.prev_kv,
            &mut self.prev_gate,
        ]
        .into_iter()
        .enumerate()
        {
            fill_uniform(dev, t, seed.wrapping_add(k as u64), dist)?;
        }
        fill_uniform(dev, &mut self.entries, seed.wrapping_add(4), dist)
    }
}

impl LayerState<Taking> {
    /// Uniform values in [-1, 1) in every state row the layer keeps across steps (window ring,
    /// compressor states and entries, the indexer's): a stand-in for a long context that
    /// costs what a real one costs to attend to, without prefilling it.
    pub fn fill_random(&mut self, dev: &Device, seed: u64) -> Result<(), GpuError> {
        let dist = Uniform {
            mean: 0.0,
            half_range: 1.0,
        };
        fill_uniform(dev, &mut self.window, seed, dist)?;
        if let Some(c) = &mut self.comp {
            c.fill_random(dev, seed.wrapping_add(1), dist)?;
        }
        if let Some(i) = &mut self.index {
            i.comp.fill_random(dev, seed.wrapping_add(6), dist)?;
        }
        Ok(())
    }
}

impl Acts<Taking> {
    /// The collectives' view of this rank's buffers (the same memory).
    pub fn collective(&self) -> Result<RankBuffers, GpuError> {
        Ok(RankBuffers {
            recv: whole(&self.coll_recv)?,
            flags: whole(&self.coll_flags)?,
            state: whole(&self.coll_state)?,
        })
    }

    /// The attention launcher's view of its split scratch (the same memory).
    pub fn attention_splits(&self) -> Result<AttentionSplits, GpuError> {
        Ok(AttentionSplits {
            acc: whole(&self.att_acc)?,
            stats: whole(&self.att_stats)?,
        })
    }
}

/// A second handle on all of `t`.
fn whole<E: DeviceElem>(t: &DeviceTensor<E>) -> Result<DeviceTensor<E>, GpuError> {
    t.view(0, t.shape())
}

/// The sequences a forward pass runs: a chunk of one slot's tokens, or the next token of each
/// of the first `n` slots (a batch; the kernels' batch form for more than one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Seqs {
    Chunk { slot: usize },
    Batch { n: usize },
}

impl Seqs {
    /// The passes's view of a `[slots, ...]` state buffer: slot `slot`'s `[...]`, or a batch's
    /// `[n, ...]` (one sequence's `[...]` when n is 1, as a chunk of one).
    pub fn view<E: DeviceElem>(self, t: &DeviceTensor<E>) -> Result<DeviceTensor<E>, GpuError> {
        let one = &t.shape()[1..];
        let size: usize = one.iter().product();
        match self {
            Seqs::Chunk { slot } => t.view(slot * size, one),
            Seqs::Batch { n: 1 } => t.view(0, one),
            Seqs::Batch { n } => {
                let shape: Vec<usize> = std::iter::once(n).chain(one.iter().copied()).collect();
                t.view(0, &shape)
            }
        }
    }

    /// The pass's positions (U32): the slot's `[1]`, or the batch's `[n]`.
    pub fn positions(self, a: &Acts<Taking>) -> Result<DeviceTensor<u32>, GpuError> {
        match self {
            Seqs::Chunk { slot } => a.positions.view(slot, &[1]),
            Seqs::Batch { n } => a.positions.view(0, &[n]),
        }
    }
}

/// One layer's state as a pass sees it (views of [`LayerState`]'s buffers, see [`Seqs::view`]).
pub struct LayerView {
    pub window: DeviceTensor<f32>,
    pub comp: Option<CompressorBuffers>,
    pub index: Option<(CompressorBuffers, DeviceTensor<i32>)>,
}

impl LayerState<Taking> {
    pub fn view(&self, seqs: Seqs) -> Result<LayerView, GpuError> {
        Ok(LayerView {
            window: seqs.view(&self.window)?,
            comp: self.comp.as_ref().map(|c| c.buffers(seqs)).transpose()?,
            index: match &self.index {
                Some(i) => Some((i.comp.buffers(seqs)?, whole(&i.selected)?)),
                None => None,
            },
        })
    }
}

/// The Lightning Indexer's compressor and choice.
pub struct IndexState<S: Stage> {
    pub comp: CompState<S>,
    pub selected: S::Buf<i32>,
}

pub struct LayerState<S: Stage> {
    pub window: S::Buf<f32>,
    pub comp: Option<CompState<S>>,
    pub index: Option<IndexState<S>>,
}

/// Activations of one chunk, `[chunk, width]` each, or `[MAX_CHUNK, width]` for what runs per
/// sub-chunk (views of the first rows serve shorter chunks).
pub struct Acts<S: Stage> {
    /// A chunk's token ids.
    pub tokens: S::Buf<u32>,
    /// Each slot's next token (the sampler writes it, a decode step reads it), position (of
    /// the next token) and sampling settings (`[slots, 4]`, [`dsv4_ops::gpu::sample::Sampling::device_words`]).
    pub next: S::Buf<u32>,
    pub positions: S::Buf<u32>,
    pub sample_params: S::Buf<u32>,
    /// Positions of a pass's parts' sub-chunks of [`MAX_CHUNK`] tokens.
    pub sub_pos: S::Buf<u32>,
    /// The mHC streams, ping-ponged by each site's expansion.
    pub streams: [S::Buf<f32>; 2],
    /// Scratch of the mHC mix projection.
    pub mix_partials: S::Buf<f32>,
    pub post: S::Buf<f32>,
    pub comb: S::Buf<f32>,
    pub xn: S::Buf<f32>,
    pub xb: S::Buf<bf16>,
    /// The query latent, then the shared key/value (one stacked GEMV's output).
    pub qa_kv: S::Buf<f32>,
    pub qa_n: S::Buf<f32>,
    pub qab: S::Buf<bf16>,
    pub q: S::Buf<f32>,
    pub q_n: S::Buf<f32>,
    pub kv_n: S::Buf<f32>,
    /// The compressor's stacked projections (values, then gate logits), up to `4·head_dim`
    /// wide, and the indexer compressor's (they may run on the two streams at once).
    pub comp: S::Buf<f32>,
    pub icomp: S::Buf<f32>,
    pub iq: S::Buf<f32>,
    pub iw: S::Buf<f32>,
    /// The indexer's scores of up to [`SELECT_ROWS`] queries over a CSA layer's entries, the
    /// scratch of every CSA layer's selection in turn (`[1, 1]` without CSA layers).
    pub index_scores: S::Buf<f32>,
    /// The attention's split states (see [`AttentionSplits`]).
    pub att_acc: S::Buf<f32>,
    pub att_stats: S::Buf<f32>,
    /// The gate-and-route launch's ticket (zero between launches).
    pub route_counter: S::Buf<u32>,
    /// The attention output, rotated back, in BF16 for the output projection.
    pub attn_b: S::Buf<bf16>,
    pub z: S::Buf<bf16>,
    pub y: S::Buf<f32>,
    pub gate: S::Buf<f32>,
    pub ids: S::Buf<i32>,
    pub weights: S::Buf<f32>,
    /// Routed-expert intermediates: BF16 for the FP4 experts (the whole chunk's), F32 for BF16
    /// experts (a sub-chunk's).
    pub h_b: S::Buf<bf16>,
    pub h: S::Buf<f32>,
    /// A chunk's routed experts ([`dsv4_ops::gpu::moe::MoeChunkScratch`]): each expert's
    /// pair list and its length, and every pair's output row.
    pub moe_lists: S::Buf<u32>,
    pub moe_counts: S::Buf<u32>,
    pub moe_rows: S::Buf<f32>,
    /// The chunk's expert input in the tensor-core expert kernels' k order.
    pub moe_x: S::Buf<bf16>,
    pub moe: S::Buf<f32>,
    /// The shared expert's output of a sub-chunk whose routed experts write `moe` apart (the
    /// expansion adds the two). One GPU only: over several, the all-reduce sums one buffer.
    pub moe_shared: S::Buf<f32>,
    pub shared_h: S::Buf<bf16>,
    /// The whole vocabulary's logits (on several GPUs, gathered from every rank's slice).
    pub logits: S::Buf<f32>,
    /// On several GPUs: this rank's slice of the logits, and its collectives' buffers.
    pub head_part: S::Buf<f32>,
    pub coll_recv: S::Buf<f32>,
    pub coll_flags: S::Buf<u32>,
    pub coll_state: S::Buf<u32>,
    pub sample_weights: S::Buf<f32>,
    /// The GEMV workspaces of the device's stream and of its two side streams (the compressors,
    /// the indexer and the shared expert run beside the main path).
    pub ws: S::Workspace,
    pub ws_side: S::Workspace,
    pub ws_second: S::Workspace,
}

pub struct Buffers<S: Stage> {
    pub acts: Acts<S>,
    pub layers: Vec<LayerState<S>>,
}

/// What the pool is sized for, besides the config: `slots` sequences of `capacity` positions,
/// chunks of `chunk` tokens, one rank of `world`, whose shared expert is `shared_inter` wide.
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    pub slots: usize,
    pub capacity: usize,
    pub chunk: usize,
    pub shared_inter: usize,
    pub world: usize,
}

impl<S: Stage> Buffers<S> {
    /// Every buffer for one rank (`c` at the rank's widths) as `plan` says.
    pub fn build(s: &mut S, c: &Config, plan: Plan) -> Result<Self, GpuError> {
        let Plan {
            slots,
            capacity,
            chunk,
            shared_inter,
            world,
        } = plan;
        let (m, sub) = (chunk, MAX_CHUNK);
        let (d, hd, q_all) = (c.hidden_size, c.head_dim, c.num_heads * c.head_dim);
        let (ni, ic) = (c.index_n_heads, c.index_head_dim);
        let (k, inter) = (c.experts_per_token, c.moe_intermediate_size);
        let split_shapes = AttentionSplits::shapes(c.num_heads * ATTENTION_SPLITS, hd);
        // One rank alone needs no collective: its buffers take one element each.
        let tp = world > 1;
        let [recv, flags, state] = collective::buffer_shapes(world, m * d);
        let tp_shape = |shape: Vec<usize>| if tp { shape } else { vec![1] };
        let acts = Acts {
            tokens: s.buf("tokens", &[m])?,
            next: s.buf("next", &[slots])?,
            positions: s.buf("positions", &[slots])?,
            sample_params: s.buf("sample_params", &[slots, 4])?,
            // Each part of a pass past `sub` tokens takes ceil(len / sub) entries: fewer than
            // 2 m / sub in all, since such parts number fewer than m / sub.
            sub_pos: s.buf("sub_pos", &[2 * m.div_ceil(sub)])?,
            streams: [
                s.buf("streams.0", &[m, c.hc_dim()])?,
                s.buf("streams.1", &[m, c.hc_dim()])?,
            ],
            mix_partials: s.buf("hc.partials", &mix_partials_shape(m, d))?,
            post: s.buf("hc.post", &[m, c.hc_mult])?,
            comb: s.buf("hc.comb", &[m, c.hc_mult * c.hc_mult])?,
            xn: s.buf("xn", &[m, d])?,
            xb: s.buf("xb", &[m, d])?,
            qa_kv: s.buf("qa_kv", &[m, c.q_lora_rank + hd])?,
            qa_n: s.buf("qa_n", &[m, c.q_lora_rank])?,
            qab: s.buf("qab", &[m, c.q_lora_rank])?,
            q: s.buf("q", &[m, q_all])?,
            q_n: s.buf("q_n", &[m, q_all])?,
            kv_n: s.buf("kv_n", &[m, hd])?,
            comp: s.buf("comp", &[m, 4 * hd])?,
            icomp: s.buf("icomp", &[m, 4 * ic])?,
            iq: s.buf("iq", &[m, ni * ic])?,
            iw: s.buf("iw", &[m, ni])?,
            index_scores: s.buf("indexer.scores", &index_scores_shape(c, capacity, m))?,
            att_acc: s.buf("attention.split_sums", &split_shapes[0])?,
            att_stats: s.buf("attention.split_stats", &split_shapes[1])?,
            route_counter: s.buf("router.ticket", &[1])?,
            attn_b: s.buf("attn_b", &[m, q_all])?,
            z: s.buf("z", &[m, c.o_groups * c.o_lora_rank])?,
            y: s.buf("y", &[m, d])?,
            gate: s.buf("gate", &[m, c.n_routed_experts])?,
            ids: s.buf("ids", &[m, k])?,
            weights: s.buf("route_weights", &[m, k])?,
            h_b: s.buf("h_b", &[m, k, inter])?,
            h: s.buf("h", &[sub, k, inter])?,
            moe_lists: s.buf("moe.lists", &[c.n_routed_experts, m * k])?,
            moe_counts: s.buf("moe.counts", &[c.n_routed_experts])?,
            moe_rows: s.buf("moe.rows", &[m * k, d])?,
            moe_x: s.buf("moe.x", &[m, d])?,
            moe: s.buf("moe", &[m, d])?,
            moe_shared: s.buf("moe.shared", &if tp { vec![1] } else { vec![sub, d] })?,
            shared_h: s.buf("shared_h", &[m, shared_inter])?,
            logits: s.buf("logits", &[sub, c.vocab_size])?,
            head_part: s.buf("head_part", &tp_shape(vec![sub, c.vocab_size / world]))?,
            coll_recv: s.buf(recv.0, &tp_shape(recv.2))?,
            coll_flags: s.buf(flags.0, &tp_shape(flags.2))?,
            coll_state: s.buf(state.0, &tp_shape(state.2))?,
            sample_weights: s.buf("sample_weights", &[slots, c.vocab_size])?,
            ws: s.workspace("gemv")?,
            ws_side: s.workspace("gemv.side")?,
            ws_second: s.workspace("gemv.second")?,
        };
        let layers = c
            .layers
            .iter()
            .enumerate()
            .map(|(l, &kind)| {
                let name = |part: &str| format!("layers.{l}.{part}");
                let window = s.buf(&name("window"), &[slots, c.sliding_window, hd])?;
                let comp = match kind {
                    LayerKind::Sliding => None,
                    LayerKind::Csa { ratio } | LayerKind::Hca { ratio } => Some(CompState::build(
                        s,
                        &name("compressor"),
                        ratio,
                        hd,
                        matches!(kind, LayerKind::Csa { .. }),
                        [slots, capacity / ratio],
                    )?),
                };
                let index = match kind {
                    LayerKind::Csa { ratio } => {
                        let cap = (capacity / ratio).max(1);
                        Some(IndexState {
                            comp: CompState::build(
                                s,
                                &name("indexer"),
                                ratio,
                                ic,
                                true,
                                [slots, cap],
                            )?,
                            selected: s.buf(&name("indexer.selected"), &[m, c.index_topk])?,
                        })
                    }
                    _ => None,
                };
                Ok(LayerState {
                    window,
                    comp,
                    index,
                })
            })
            .collect::<Result<Vec<_>, GpuError>>()?;
        Ok(Buffers { acts, layers })
    }
}

/// Bytes the pool takes for `plan`.
pub fn pool_bytes(c: &Config, plan: Plan) -> Result<usize, GpuError> {
    let mut s = Sizing(BufferPool::new());
    Buffers::build(&mut s, c, plan)?;
    Ok(s.0.total_bytes())
}
