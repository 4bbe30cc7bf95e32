//! The model on one GPU. Weights are uploaded once into the kernels' layouts; the sequence
//! state and every activation live in one sealed buffer pool; a forward chunk is a fixed list
//! of launches on the device's stream (and its two side streams, forked and joined inside each
//! sub-layer) that reads the token ids and the position from device buffers and advances the
//! position itself. So a decode step (layers, head, sampling into the
//! token buffer) issues the same launches at every position and can be captured once as a CUDA
//! graph and replayed (`dsv4-graph`); run eagerly it is the same launches.
//!
//! Activations are F32 between kernels and BF16 into the GEMVs (W8A16 / W4A16 / BF16 weights);
//! the MoE gate and the indexer's head weights run in F32 on F32 inputs, since their outputs
//! choose experts and entries.

mod buffers;
mod random;
mod upload;

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use dsv4_ops::gpu::attention::{self, Compressed, IndexScoring};
use dsv4_ops::gpu::collective::{
    enable_peer_access, Collective, PeerTensors, RankBuffers, MAX_RANKS,
};
use dsv4_ops::gpu::gemv::{gemv, gemv_grouped, gemv_swiglu, GemvWeight};
use dsv4_ops::gpu::mhc::reference::HcParams;
use dsv4_ops::gpu::mhc::{
    hc_comb, hc_head, hc_mix, hc_post_mix, hc_pre, DeviceHcMix, DeviceHcSite, NormedInput, HC,
};
use dsv4_ops::gpu::moe::{moe_chunk, moe_decode, MoeChunkScratch, MoeOut};
use dsv4_ops::gpu::moe_bf16::moe_bf16;
use dsv4_ops::gpu::router::{gate_logits, gate_route, route_topk, DeviceRouteBy, GateWeight};
use dsv4_ops::gpu::rows::{
    advance_position, chunk_positions, embed_hc_gather, rms_norm_rope_pair, rms_norm_rows,
    rope_rows, ColRange, NormRows, RopeDirection, RowRope,
};
use dsv4_ops::gpu::sample::{sample, Sampling};
use dsv4_ops::gpu::stager::SLOT_BYTES;
use dsv4_ops::gpu::{
    BufferPool, DType, Device, DeviceElem, DeviceTensor, GpuError, Readback, Side, Stager,
};
use half::bf16;

use crate::checkpoint::{Checkpoint, LoadError};
use crate::config::{Config, LayerKind};
use crate::cpu::{ForwardError, Logits};
use crate::linear::{Linear, LinearData};
use crate::rope::Rope;
use crate::shard::{local_config, rank_weight_bytes, shard_head, shard_layer, Shard, ShardError};
use crate::synth::SynthFormat;
use crate::weights::{ModelWeights, Routing};
pub use buffers::Seqs;
pub use buffers::MAX_CHUNK;
use buffers::{Buffers, LayerView, Plan, Sizing, Taking, SELECT_ROWS};
use upload::RoutedExperts;

#[derive(Debug, thiserror::Error)]
pub enum GpuModelError {
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error(transparent)]
    Gpu(#[from] GpuError),
    #[error(transparent)]
    Forward(#[from] ForwardError),
    #[error(transparent)]
    Shard(#[from] ShardError),
    #[error(
        "too little GPU memory: the sequence state and activations for a context of {context} \
         tokens need {need} bytes, {free} bytes are free after the weights"
    )]
    OutOfMemory {
        context: usize,
        need: usize,
        free: usize,
    },
    #[error(
        "too little GPU memory: {weights} bytes of weights per GPU over {world} GPU(s) with \
         {free} bytes free on each{hint}"
    )]
    DoesNotFit {
        world: usize,
        weights: usize,
        free: usize,
        hint: String,
    },
    #[error("sequence of {needed} tokens exceeds the GPU context capacity of {capacity} (--max-context)")]
    Capacity { needed: usize, capacity: usize },
    #[error("config.json: {field} = {value} is beyond what the GPU kernels take ({limit})")]
    Unsupported {
        field: &'static str,
        value: usize,
        limit: String,
    },
    #[error("no sampled token to decode from: run a prefill first (forward and reset leave none)")]
    NoToken,
    #[error("{asked} sequences at once: the GPU state holds 1 to {most}")]
    Sequences { asked: usize, most: usize },
    #[error(
        "slot 0 is between the parts of a prompt: a one-row step would write its state (read \
         the prompt's last part first)"
    )]
    Parked,
}

/// Config values the GPU kernels cannot take, named before anything is uploaded.
fn check_gpu_config(c: &Config) -> Result<(), GpuModelError> {
    use dsv4_ops::gpu::attention::{MAX_HEAD_DIM, MAX_INDEX_DIM, MAX_INDEX_HEADS};
    use dsv4_ops::gpu::router::{MAX_EXPERTS, MAX_TOP_K};
    let checks: [(&'static str, usize, bool, String); 8] = [
        (
            "hc_mult",
            c.hc_mult,
            c.hc_mult == HC,
            format!("exactly {HC}"),
        ),
        (
            "head_dim",
            c.head_dim,
            c.head_dim <= MAX_HEAD_DIM && c.head_dim.is_multiple_of(32),
            format!("a multiple of 32 up to {MAX_HEAD_DIM}"),
        ),
        (
            "index_n_heads",
            c.index_n_heads,
            c.index_n_heads <= MAX_INDEX_HEADS,
            format!("at most {MAX_INDEX_HEADS}"),
        ),
        (
            "index_head_dim",
            c.index_head_dim,
            c.index_head_dim <= MAX_INDEX_DIM && c.index_head_dim.is_multiple_of(4),
            format!("a multiple of 4 up to {MAX_INDEX_DIM}"),
        ),
        (
            "n_routed_experts",
            c.n_routed_experts,
            c.n_routed_experts <= MAX_EXPERTS,
            format!("at most {MAX_EXPERTS}"),
        ),
        (
            "num_experts_per_tok",
            c.experts_per_token,
            c.experts_per_token <= MAX_TOP_K,
            format!("at most {MAX_TOP_K}"),
        ),
        (
            "o_lora_rank",
            c.o_lora_rank,
            c.o_lora_rank.is_multiple_of(16),
            "a multiple of 16 (the grouped output projection's tiles)".to_string(),
        ),
        (
            "moe_intermediate_size",
            c.moe_intermediate_size,
            c.moe_intermediate_size.is_multiple_of(8),
            "a multiple of 8 on each GPU (the down projections' input)".to_string(),
        ),
    ];
    match checks.into_iter().find(|(_, _, ok, _)| !ok) {
        Some((field, value, _, limit)) => Err(GpuModelError::Unsupported {
            field,
            value,
            limit,
        }),
        None => Ok(()),
    }
}

/// The device position of a slot whose rows of a decode step write none of its state (the
/// kernels' `PARKED`).
const PARKED: u32 = u32::MAX;

/// Load-time choices.
#[derive(Clone, Copy, Debug, Default)]
pub struct GpuOptions {
    /// Positions each sequence's state holds; `None` takes what fits (up to the model's
    /// limit).
    pub max_context: Option<usize>,
    /// Sequences the state holds at once, each in its own slot (batched decode): 1 to
    /// [`MAX_CHUNK`]; 0 means 1.
    pub sequences: usize,
    /// Longest prompt chunk (rounded down to a power of two, from [`MAX_CHUNK`] to 2^20);
    /// `None`: [`PREFILL_CHUNK`]. Shorter ones are still taken where memory is short.
    pub max_chunk: Option<usize>,
}

impl GpuOptions {
    /// The slots the state holds: `sequences`, at least 1.
    fn slots(&self) -> usize {
        self.sequences.max(1)
    }
}

/// A BF16 or F32 matrix for the F32 kernels (MoE gate, indexer head weights).
enum Dense {
    Bf16(DeviceTensor<bf16>),
    F32(DeviceTensor<f32>),
}

impl Dense {
    fn upload(st: &mut Stager<'_>, lin: &Linear) -> Result<Dense, GpuError> {
        Ok(match lin.data() {
            LinearData::Bf16(_) => Dense::Bf16(upload::bf16_matrix(st, lin)?),
            _ => Dense::F32(upload::dense_f32(st, lin)?),
        })
    }

    fn weight(&self) -> GateWeight<'_> {
        match self {
            Dense::Bf16(t) => GateWeight::Bf16(t),
            Dense::F32(t) => GateWeight::F32(t),
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Dense::Bf16(t) => t.num_bytes(),
            Dense::F32(t) => t.num_bytes(),
        }
    }
}

struct DevCompressor {
    /// wkv and wgate stacked: one GEMV writes the values, then the gate logits.
    proj: GemvWeight,
    ape: DeviceTensor<f32>,
    norm: DeviceTensor<f32>,
    overlap: bool,
}

struct DevIndexer {
    wq_b: GemvWeight,
    weights_proj: Dense,
    compressor: DevCompressor,
}

struct DevAttention {
    /// wq_a and wkv stacked: one GEMV writes the query latent, then the shared key/value.
    wq_a_kv: GemvWeight,
    q_norm: DeviceTensor<f32>,
    wq_b: GemvWeight,
    kv_norm: DeviceTensor<f32>,
    /// All `o_groups` groups, run by one grouped GEMV.
    wo_a: GemvWeight,
    wo_b: GemvWeight,
    sink: DeviceTensor<f32>,
    compressor: Option<DevCompressor>,
    indexer: Option<DevIndexer>,
}

enum DevRouting {
    Hash(DeviceTensor<u32>),
    Learned(DeviceTensor<f32>),
}

struct DevMoe {
    gate: Dense,
    routing: DevRouting,
    experts: RoutedExperts,
    shared_w13: GemvWeight,
    shared_w2: GemvWeight,
}

struct DevLayer {
    kind: LayerKind,
    attn_norm: DeviceTensor<f32>,
    ffn_norm: DeviceTensor<f32>,
    hc_attn: DeviceHcSite,
    hc_ffn: DeviceHcSite,
    attn: DevAttention,
    moe: DevMoe,
}

struct DevWeights {
    embed: DeviceTensor<bf16>,
    head: GemvWeight,
    norm: DeviceTensor<f32>,
    hc_head: DeviceHcSite,
    layers: Vec<DevLayer>,
    rope_main: DeviceTensor<f32>,
    rope_compress: DeviceTensor<f32>,
}

impl DevWeights {
    /// The mHC site that first reads the streams entering layer `l`: its attention site, or the
    /// head's past the last layer.
    fn entry_site(&self, l: usize) -> &DeviceHcSite {
        self.layers
            .get(l)
            .map_or(&self.hc_head, |layer| &layer.hc_attn)
    }
}

fn upload_compressor(
    st: &mut Stager<'_>,
    name: &str,
    w: &crate::weights::CompressorWeights,
) -> Result<DevCompressor, GpuError> {
    let dev = st.device();
    Ok(DevCompressor {
        proj: upload::stacked(st, &format!("{name}.wkv+wgate"), &[&w.wkv, &w.wgate])?,
        ape: dev.upload(DType::F32, &[w.ratio, w.ape.len() / w.ratio], &w.ape)?,
        norm: upload::vector(dev, &w.norm)?,
        overlap: w.overlap,
    })
}

fn upload_layer(
    st: &mut Stager<'_>,
    c: &Config,
    l: usize,
    lw: &crate::weights::LayerWeights,
) -> Result<DevLayer, GpuError> {
    let dev = st.device();
    let p = format!("layers.{l}");
    let a = &lw.attn;
    let attn = DevAttention {
        wq_a_kv: upload::stacked(st, &format!("{p}.attn.wq_a+wkv"), &[&a.wq_a, &a.wkv])?,
        q_norm: upload::vector(dev, &a.q_norm)?,
        wq_b: upload::linear(st, &format!("{p}.attn.wq_b"), &a.wq_b)?,
        kv_norm: upload::vector(dev, &a.kv_norm)?,
        wo_a: upload::linear(st, &format!("{p}.attn.wo_a"), &a.wo_a)?,
        wo_b: upload::linear(st, &format!("{p}.attn.wo_b"), &a.wo_b)?,
        sink: upload::vector(dev, &a.sink)?,
        compressor: a
            .compressor
            .as_ref()
            .map(|cw| upload_compressor(st, &format!("{p}.attn.compressor"), cw))
            .transpose()?,
        indexer: a
            .indexer
            .as_ref()
            .map(|iw| -> Result<DevIndexer, GpuError> {
                Ok(DevIndexer {
                    wq_b: upload::linear(st, &format!("{p}.attn.indexer.wq_b"), &iw.wq_b)?,
                    weights_proj: Dense::upload(st, &iw.weights_proj)?,
                    compressor: upload_compressor(
                        st,
                        &format!("{p}.attn.indexer.compressor"),
                        &iw.compressor,
                    )?,
                })
            })
            .transpose()?,
    };
    let m = &lw.moe;
    let routing = match &m.routing {
        Routing::Hash { tid2eid } => DevRouting::Hash(dev.upload(
            DType::U32,
            &[tid2eid.len() / c.experts_per_token, c.experts_per_token],
            tid2eid,
        )?),
        Routing::Learned { bias } => DevRouting::Learned(upload::vector(dev, bias)?),
    };
    let (shared_w13, shared_w2) =
        upload::expert(st, &format!("{p}.ffn.shared_experts"), &m.shared)?;
    Ok(DevLayer {
        kind: lw.kind,
        attn_norm: upload::vector(dev, &lw.attn_norm)?,
        ffn_norm: upload::vector(dev, &lw.ffn_norm)?,
        hc_attn: upload::hc_site(dev, &lw.hc_attn, c.hidden_size)?,
        hc_ffn: upload::hc_site(dev, &lw.hc_ffn, c.hidden_size)?,
        attn,
        moe: DevMoe {
            gate: Dense::upload(st, &m.gate)?,
            routing,
            experts: upload::routed_experts(st, &format!("{p}.ffn.experts"), &m.experts)?,
            shared_w13,
            shared_w2,
        },
    })
}

/// `[n, width]` over the front of a buffer (buffers shared by several widths).
fn cols<T: dsv4_ops::gpu::DeviceElem>(
    t: &DeviceTensor<T>,
    n: usize,
    width: usize,
) -> Result<DeviceTensor<T>, GpuError> {
    t.view(0, &[n, width])
}

/// Rows `[first, first + rows)` of `t` (`[n, ...]`, rows contiguous), as `[rows, ...]`.
fn row_range<T: dsv4_ops::gpu::DeviceElem>(
    t: &DeviceTensor<T>,
    first: usize,
    rows: usize,
) -> Result<DeviceTensor<T>, GpuError> {
    let mut shape = t.shape().to_vec();
    let row = t.len() / shape[0].max(1);
    shape[0] = rows;
    t.view(first * row, &shape)
}

/// A chunk of `n` tokens as pieces of at most `size`: (first row, rows).
fn pieces(n: usize, size: usize) -> Vec<(usize, usize)> {
    (0..n)
        .step_by(size)
        .map(|first| (first, size.min(n - first)))
        .collect()
}

/// A chunk of `n` tokens as sub-chunks of at most [`MAX_CHUNK`].
fn sub_chunks(n: usize) -> Vec<(usize, usize)> {
    pieces(n, MAX_CHUNK)
}

/// Rows of one sequence's `[rows, width]` state in `t` (`[rows, width]` or a batch's `[n, rows,
/// width]`).
fn per_sequence_rows<E: DeviceElem>(t: &DeviceTensor<E>) -> usize {
    let shape = t.shape();
    shape[shape.len() - 2]
}

/// The position buffer of sub-chunk `j` of `rows`' `subs`: the pass's own (`pos`) when it is
/// one sub-chunk, else its entry of `acts.sub_pos` (written at the pass's start).
fn sub_position(
    a: &buffers::Acts<Taking>,
    pos: &DeviceTensor<u32>,
    rows: &Part,
    j: usize,
    subs: usize,
) -> Result<DeviceTensor<u32>, GpuError> {
    if subs == 1 {
        pos.view(0, pos.shape())
    } else {
        a.sub_pos.view(rows.subs_at + j, &[1])
    }
}

/// Rows `[first, first + len)` of a pass: one sequence's tokens, in slot `slot`. Past
/// [`MAX_CHUNK`] tokens its sub-chunks' positions are `acts.sub_pos` from entry `subs_at`.
#[derive(Clone, Copy, Debug)]
struct Part {
    slot: usize,
    first: usize,
    len: usize,
    subs_at: usize,
}

impl Part {
    /// A pass of one sequence's `len` tokens.
    fn whole(slot: usize, len: usize) -> Part {
        Part {
            slot,
            first: 0,
            len,
            subs_at: 0,
        }
    }
}

/// The sequences of one pass over the layers.
#[derive(Clone, Copy)]
enum Pass<'a> {
    /// Prompt parts of distinct slots, in row order: the row-wise work (projections, norms,
    /// mHC, routed and shared experts, head) over all their rows at once, the attention a
    /// part at a time over its slot's state.
    Parts(&'a [Part]),
    /// A decode step of the first `n` slots, one row each.
    Batch { n: usize },
}

/// A pass's token ids: its parts' in `acts.tokens`, a batch's slots' next tokens.
fn pass_tokens(
    a: &buffers::Acts<Taking>,
    n: usize,
    pass: Pass,
) -> Result<DeviceTensor<u32>, GpuError> {
    match pass {
        Pass::Parts(_) => a.tokens.rows(n),
        Pass::Batch { n } => a.next.view(0, &[n]),
    }
}

/// Sampling settings as the sampler reads them on the device, or the setting at fault.
fn sampling_words(s: &Sampling) -> Result<[u32; 4], GpuError> {
    s.device_words()
        .map_err(|e| GpuError::invalid("sampling", e.to_string()))
}

/// One part of a sequence's prompt for [`GpuModel::prefill_parts`]: `tokens` after what slot
/// `slot` holds; with `sampling`, the prompt's last part, whose next token is sampled.
#[derive(Clone, Copy, Debug)]
pub struct PromptPart<'a> {
    pub slot: usize,
    pub tokens: &'a [u32],
    pub sampling: Option<&'a Sampling>,
}

/// One GPU's part of the model: its device, its slice of the weights and its pool (the whole
/// model on one GPU).
struct Rank {
    dev: Arc<Device>,
    w: DevWeights,
    bufs: Buffers<Taking>,
    _pool: BufferPool,
    /// With several GPUs: this rank's collectives and every rank's logits buffer (the head's
    /// all-gather output).
    tp: Option<(Collective, PeerTensors)>,
}

/// The model on one GPU or split over several of one host (tensor parallelism, see
/// [`crate::shard`]): one rank per GPU, all driven from this thread. Each rank runs the same
/// launches on its own stream at its slice's widths; the ranks meet in one-shot collectives
/// (an all-reduce after each sub-layer, an all-gather of the logits), and every rank samples
/// the same token from the same logits. Every rank's launches of a chunk are enqueued before
/// the host waits for any rank.
pub struct GpuModel {
    config: Config,
    /// One rank's widths.
    local: Config,
    ranks: Vec<Rank>,
    capacity: usize,
    /// Most tokens one forward pass takes (prefill chunks).
    chunk: usize,
    /// By slot: tokens processed (mirrors the device position, which the device advances),
    /// whether the slot's next token is a sampled one, ready for a decode step, and whether
    /// its device position is [`PARKED`] (between the parts of a prompt).
    lens: Vec<usize>,
    ready: Vec<bool>,
    parked: Vec<bool>,
    /// Where [`Self::read_tokens`] copies the sampled tokens (rank 0's).
    token_readback: Readback<u32>,
    hc: HcParams,
    weight_bytes: usize,
}

/// One device per rank, each at most once.
fn check_devices(devs: &[Arc<Device>]) -> Result<(), GpuModelError> {
    if devs.is_empty() {
        return Err(GpuError::invalid("devices", "no GPU to run on").into());
    }
    if devs.len() > MAX_RANKS {
        return Err(GpuError::invalid(
            "devices",
            format!("{} GPUs: at most {MAX_RANKS} ranks", devs.len()),
        )
        .into());
    }
    for (i, a) in devs.iter().enumerate() {
        if devs[..i].iter().any(|b| b.ordinal() == a.ordinal()) {
            return Err(GpuError::invalid(
                "devices",
                format!("GPU {} is named twice", a.ordinal()),
            )
            .into());
        }
    }
    Ok(())
}

impl GpuModel {
    /// Opens a checkpoint and uploads it to `devs` (split over them when there are several);
    /// `on_bytes(done, total)` reports the bytes copied to the GPUs.
    pub fn load(
        dir: &Path,
        devs: &[Arc<Device>],
        opts: GpuOptions,
        on_bytes: impl Fn(u64, u64) + Sync,
    ) -> Result<GpuModel, GpuModelError> {
        let ck = Checkpoint::open(dir)?;
        let weights = ModelWeights::load(&ck, |_, _| {})?;
        GpuModel::new(ck.config().clone(), &weights, devs, opts, on_bytes)
    }

    /// Uploads `weights` (of `config`) to `devs` and sets up the sequence state: rank r (on
    /// `devs[r]`) gets its slice of the split matrices and all of the rest. The ranks load at
    /// once, a thread each, layer by layer (a layer's slices are cut just before they go up);
    /// `on_bytes(done, total)` reports the bytes copied to the GPUs so far, of about `total`.
    pub fn new(
        config: Config,
        weights: &ModelWeights,
        devs: &[Arc<Device>],
        opts: GpuOptions,
        on_bytes: impl Fn(u64, u64) + Sync,
    ) -> Result<GpuModel, GpuModelError> {
        check_devices(devs)?;
        let world = devs.len();
        let local = local_config(&config, world)?;
        check_gpu_config(&local)?;
        let total = (rank_weight_bytes(weights, world) * world) as u64;
        let done = AtomicU64::new(0);
        let sent = |bytes: u64| on_bytes(done.fetch_add(bytes, Ordering::Relaxed) + bytes, total);
        let load_rank = |rank: usize, dev: &Device| -> Result<DevWeights, GpuModelError> {
            let s = Shard { rank, world };
            let c = &local;
            let mut st = Stager::new(dev, SLOT_BYTES)?.on_sent(&sent);
            let layers = weights
                .layers
                .iter()
                .enumerate()
                .map(|(l, lw)| -> Result<DevLayer, GpuModelError> {
                    if world == 1 {
                        return Ok(upload_layer(&mut st, c, l, lw)?);
                    }
                    Ok(upload_layer(
                        &mut st,
                        c,
                        l,
                        &shard_layer(&config, l, lw, s)?,
                    )?)
                })
                .collect::<Result<Vec<_>, _>>()?;
            let head = shard_head(&config, &weights.head, s)?;
            Ok(DevWeights {
                embed: upload::bf16_matrix(&mut st, &weights.embed)?,
                head: upload::linear(&mut st, "head", &head)?,
                norm: upload::vector(dev, &weights.norm)?,
                hc_head: upload::hc_site(dev, &weights.hc_head, c.hidden_size)?,
                layers,
                rope_main: upload::vector(dev, Rope::for_layer(c, false).inv_freq())?,
                rope_compress: upload::vector(dev, Rope::for_layer(c, true).inv_freq())?,
            })
        };
        let ranks = std::thread::scope(|scope| {
            let threads: Vec<_> = devs
                .iter()
                .enumerate()
                .map(|(rank, dev)| scope.spawn(move || load_rank(rank, dev)))
                .collect();
            threads
                .into_iter()
                .map(|t| t.join().expect("a rank's loading thread panicked"))
                .collect::<Result<Vec<_>, _>>()
        })?;
        GpuModel::with_weights(config, local, devs, ranks, opts)
    }

    /// A model of `config`'s widths whose weights are drawn at random on `devs` (each rank its
    /// slice's shapes), in the formats and sizes of the synthetic checkpoint of `format` (for
    /// benchmarks: no checkpoint is written or read).
    pub fn random(
        config: Config,
        format: SynthFormat,
        seed: u64,
        devs: &[Arc<Device>],
        opts: GpuOptions,
        mut on_layer: impl FnMut(usize, usize),
    ) -> Result<GpuModel, GpuModelError> {
        check_devices(devs)?;
        let world = devs.len();
        let local = local_config(&config, world)?;
        check_gpu_config(&local)?;
        let total = world * config.num_layers;
        let layers = config.num_layers;
        let head_rows = config.vocab_size / world;
        let ranks = devs
            .iter()
            .enumerate()
            .map(|(rank, dev)| {
                random::random_weights(dev, &local, head_rows, format, seed, |l, _| {
                    on_layer(rank * layers + l, total)
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        GpuModel::with_weights(config, local, devs, ranks, opts)
    }

    /// Sets up the sequence state beside each rank's device weights, and links the ranks.
    fn with_weights(
        config: Config,
        local: Config,
        devs: &[Arc<Device>],
        weights: Vec<DevWeights>,
        opts: GpuOptions,
    ) -> Result<GpuModel, GpuModelError> {
        let world = devs.len();
        let c = &local;
        let weight_bytes = step_bytes(c, &weights[0]);
        let shared_inter = weights[0].layers[0].moe.shared_w13.n();
        let mut free = usize::MAX;
        for dev in devs {
            free = free.min(dev.memory_info()?.0);
        }
        let slots = opts.slots();
        if slots > MAX_CHUNK {
            return Err(GpuModelError::Sequences {
                asked: slots,
                most: MAX_CHUNK,
            });
        }
        let sizing = Plan {
            slots,
            capacity: 0,
            chunk: 0,
            shared_inter,
            world,
        };
        let Layout { capacity, chunk } = choose_layout(c, opts, sizing, free)?;
        let plan = Plan {
            capacity,
            chunk,
            ..sizing
        };
        if world > 1 {
            enable_peer_access(devs)?;
        }
        let mut ranks = Vec::with_capacity(world);
        for (dev, w) in devs.iter().zip(weights) {
            let mut sizing = Sizing(BufferPool::new());
            Buffers::build(&mut sizing, c, plan)?;
            let mut pool = sizing.0;
            pool.seal(dev)?;
            let mut taking = Taking(pool);
            let bufs = Buffers::build(&mut taking, c, plan)?;
            ranks.push(Rank {
                dev: dev.clone(),
                w,
                bufs,
                _pool: taking.0,
                tp: None,
            });
        }
        if world > 1 {
            let comm: Vec<RankBuffers> = ranks
                .iter()
                .map(|r| r.bufs.acts.collective())
                .collect::<Result<_, _>>()?;
            let logits: Vec<&DeviceTensor<f32>> =
                ranks.iter().map(|r| &r.bufs.acts.logits).collect();
            let peers: Vec<PeerTensors> = (0..world)
                .map(|_| PeerTensors::new(&logits))
                .collect::<Result<_, _>>()?;
            let links = Collective::link(&comm)?;
            for ((rank, link), peer) in ranks.iter_mut().zip(links).zip(peers) {
                rank.tp = Some((link, peer));
            }
        }
        let token_readback = ranks[0].dev.readback(slots)?;
        Ok(GpuModel {
            hc: HcParams {
                n: c.hc_mult,
                sinkhorn_iters: c.hc_sinkhorn_iters,
                hc_eps: c.hc_eps,
                norm_eps: c.rms_norm_eps,
            },
            config,
            local,
            ranks,
            capacity,
            chunk,
            lens: vec![0; slots],
            ready: vec![false; slots],
            parked: vec![false; slots],
            token_readback,
            weight_bytes,
        })
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The first rank's device (where tokens and logits are read back).
    pub fn device(&self) -> &Arc<Device> {
        &self.ranks[0].dev
    }

    /// Every rank's device, by rank.
    pub fn devices(&self) -> Vec<Arc<Device>> {
        self.ranks.iter().map(|r| r.dev.clone()).collect()
    }

    /// GPUs the model is split over.
    pub fn world(&self) -> usize {
        self.ranks.len()
    }

    /// Identifies this model's sequence state (the device address of rank 0's next-token
    /// buffer): what a captured step reads and writes.
    pub fn state_address(&self) -> u64 {
        self.ranks[0].bufs.acts.next.device_address()
    }

    /// Positions each sequence's state holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Sequences the state holds at once (slots `0..sequences()`).
    pub fn sequences(&self) -> usize {
        self.lens.len()
    }

    /// Most tokens one forward pass takes: prompts run in chunks of this many.
    pub fn chunk(&self) -> usize {
        self.chunk
    }

    /// Tokens slot 0's sequence has processed so far (see [`Self::slot_len`]).
    pub fn len(&self) -> usize {
        self.lens[0]
    }

    pub fn is_empty(&self) -> bool {
        self.lens[0] == 0
    }

    /// Tokens slot `slot`'s sequence has processed so far.
    pub fn slot_len(&self, slot: usize) -> usize {
        self.lens[slot]
    }

    /// Weight bytes one decode step reads on each GPU (every dense weight or its slice, the
    /// selected experts' slices, the head's slice; not the sequence state).
    pub fn step_weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    /// Forgets every slot's sequence: position 0 (state buffers are overwritten before they
    /// are read).
    pub fn reset(&mut self) -> Result<(), GpuError> {
        for slot in 0..self.sequences() {
            self.reset_slot(slot)?;
        }
        Ok(())
    }

    /// Forgets slot `slot`'s sequence (the others run on).
    pub fn reset_slot(&mut self, slot: usize) -> Result<(), GpuError> {
        self.write_position(slot, 0)?;
        self.lens[slot] = 0;
        self.ready[slot] = false;
        self.parked[slot] = false;
        Ok(())
    }

    /// Starts every slot's sequence at position `n` with every layer's state filled with
    /// random values (see [`buffers::LayerState::fill_random`]; every rank alike) instead of
    /// `n` tokens' worth: what a benchmark of decoding after a long context needs, in seconds
    /// instead of a prefill of `n` tokens. The next [`Self::prefill`] continues from there.
    pub fn fill_context(&mut self, n: usize, seed: u64) -> Result<(), GpuModelError> {
        self.check_length(n)?;
        let pos = u32::try_from(n).map_err(|_| GpuModelError::Capacity {
            needed: n,
            capacity: u32::MAX as usize,
        })?;
        let slots = self.sequences();
        for r in &mut self.ranks {
            for (l, layer) in r.bufs.layers.iter_mut().enumerate() {
                layer.fill_random(&r.dev, seed ^ ((l as u64) << 32))?;
            }
            r.dev.write(&mut r.bufs.acts.positions, &vec![pos; slots])?;
        }
        self.lens.fill(n);
        self.ready.fill(false);
        self.parked.fill(false);
        Ok(())
    }

    /// `tokens` may follow slot `slot`'s sequence.
    fn check_tokens(&self, slot: usize, tokens: &[u32]) -> Result<(), GpuModelError> {
        let c = &self.config;
        if tokens.is_empty() {
            return Err(ForwardError::Empty.into());
        }
        if let Some(&token) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(ForwardError::TokenOutOfRange {
                token,
                vocab: c.vocab_size,
            }
            .into());
        }
        self.check_length(self.lens[slot] + tokens.len())
    }

    /// A sequence of `needed` positions fits the model's context limit and the state's capacity.
    fn check_length(&self, needed: usize) -> Result<(), GpuModelError> {
        let limit = self.config.max_position_embeddings;
        if needed > limit {
            return Err(ForwardError::ContextLimit { needed, limit }.into());
        }
        if needed > self.capacity {
            return Err(GpuModelError::Capacity {
                needed,
                capacity: self.capacity,
            });
        }
        Ok(())
    }

    /// Runs `tokens` (in chunks of at most [`Self::chunk`]) and returns the requested logits
    /// (`[n, vocab]` or the last token's `[vocab]`), as the CPU forward does.
    /// Slot 0's sequence.
    pub fn forward(&mut self, tokens: &[u32], which: Logits) -> Result<Vec<f32>, GpuModelError> {
        self.check_tokens(0, tokens)?;
        self.unpark(0)?;
        self.ready[0] = false;
        let mut out = Vec::new();
        let chunks: Vec<&[u32]> = tokens.chunks(self.chunk).collect();
        for (i, chunk) in chunks.iter().enumerate() {
            let n = chunk.len();
            for r in 0..self.ranks.len() {
                self.write_tokens(r, chunk)?;
            }
            self.launch_layers_all(n, Pass::Parts(&[Part::whole(0, n)]))?;
            // The head at most MAX_CHUNK rows at a time, each read back before the next.
            let heads = match which {
                Logits::All => sub_chunks(n),
                Logits::Last if i + 1 == chunks.len() => vec![(n - 1, 1)],
                Logits::Last => Vec::new(),
            };
            for (first, rows) in heads {
                for r in 0..self.ranks.len() {
                    self.launch_head(r, first, rows)?;
                }
                let r0 = &self.ranks[0];
                out.extend(r0.dev.download(&r0.bufs.acts.logits.rows(rows)?)?);
            }
            for r in 0..self.ranks.len() {
                self.launch_advance(r, 0, n)?;
            }
            self.lens[0] += n;
        }
        Ok(out)
    }

    /// Runs `prompt` in slot 0 (see [`Self::prefill_slot`]).
    pub fn prefill(&mut self, prompt: &[u32], s: &Sampling) -> Result<(), GpuModelError> {
        self.prefill_reporting(0, prompt, Some(s), usize::MAX, &mut |_| {})
    }

    /// Runs `prompt` after what slot `slot`'s sequence holds (start a new sequence with
    /// [`Self::reset_slot`]) and samples its first new token into the slot's next-token
    /// buffer (read it with [`Self::read_tokens`]); `s` stays the slot's sampling settings, on
    /// the device, for its decode steps ([`Self::launch_decode_step`]). Without `s` the tokens
    /// are only read (a prompt's earlier part) and nothing is sampled.
    pub fn prefill_slot(
        &mut self,
        slot: usize,
        prompt: &[u32],
        s: Option<&Sampling>,
    ) -> Result<(), GpuModelError> {
        self.prefill_reporting(slot, prompt, s, usize::MAX, &mut |_| {})
    }

    /// [`Self::prefill_slot`], waiting for the GPUs about every `every` tokens to report the
    /// prompt tokens done to `on_progress` (for progress on long prompts).
    pub fn prefill_reporting(
        &mut self,
        slot: usize,
        prompt: &[u32],
        s: Option<&Sampling>,
        every: usize,
        on_progress: &mut dyn FnMut(usize),
    ) -> Result<(), GpuModelError> {
        if slot >= self.sequences() {
            return Err(GpuModelError::Sequences {
                asked: slot + 1,
                most: self.sequences(),
            });
        }
        self.check_tokens(slot, prompt)?;
        if let Some(s) = s {
            let words = sampling_words(s)?;
            self.write_sampling(slot, &words)?;
        }
        self.unpark(slot)?;
        self.ready[slot] = false;
        let chunks: Vec<&[u32]> = prompt.chunks(self.chunk).collect();
        let mut reported = 0;
        for (i, chunk) in chunks.iter().enumerate() {
            let n = chunk.len();
            let ends = i + 1 == chunks.len() && s.is_some();
            self.launch_pass(chunk, &[Part::whole(slot, n)], &[ends])?;
            self.lens[slot] += n;
            let done = (i + 1) * self.chunk;
            if done - reported >= every && i + 1 < chunks.len() {
                for r in &self.ranks {
                    r.dev.synchronize()?;
                }
                reported = done;
                on_progress(done);
            }
        }
        // A prompt's earlier part: the slot's rows of decode steps until its next part write
        // none of its state.
        if s.is_none() {
            self.write_position(slot, PARKED)?;
            self.parked[slot] = true;
        }
        self.ready[slot] = s.is_some();
        Ok(())
    }

    /// Reads the prompt parts of several sequences (distinct slots, at most [`Self::chunk`]
    /// tokens in all) in one pass, each as [`Self::prefill_slot`] reads it (up to rounding:
    /// the pass's row count picks the kernels): every routed expert and projection is read
    /// once for all of them. Each part with sampling settings ends its
    /// prompt: its first new token is sampled into its slot's next-token buffer; a part
    /// without is a prompt's earlier part, its slot parked until its next part.
    pub fn prefill_parts(&mut self, parts: &[PromptPart]) -> Result<(), GpuModelError> {
        let n: usize = parts.iter().map(|p| p.tokens.len()).sum();
        if parts.is_empty() {
            return Err(ForwardError::Empty.into());
        }
        if n > self.chunk {
            return Err(GpuError::invalid(
                "prefill_parts",
                format!("{n} tokens: one pass takes at most {}", self.chunk),
            )
            .into());
        }
        for (i, p) in parts.iter().enumerate() {
            if p.slot >= self.sequences() {
                return Err(GpuModelError::Sequences {
                    asked: p.slot + 1,
                    most: self.sequences(),
                });
            }
            if parts[..i].iter().any(|q| q.slot == p.slot) {
                return Err(GpuError::invalid(
                    "prefill_parts",
                    format!("slot {} twice in one pass", p.slot),
                )
                .into());
            }
            self.check_tokens(p.slot, p.tokens)?;
        }
        // Every part's settings checked before any slot changes.
        let words = parts
            .iter()
            .map(|p| p.sampling.map(sampling_words).transpose())
            .collect::<Result<Vec<_>, _>>()?;
        let (mut rows, mut first, mut subs_at) = (Vec::new(), 0, 0);
        let mut tokens = Vec::with_capacity(n);
        for (p, words) in parts.iter().zip(&words) {
            if let Some(words) = words {
                self.write_sampling(p.slot, words)?;
            }
            self.unpark(p.slot)?;
            self.ready[p.slot] = false;
            let len = p.tokens.len();
            rows.push(Part {
                slot: p.slot,
                first,
                len,
                subs_at,
            });
            tokens.extend_from_slice(p.tokens);
            first += len;
            if len > MAX_CHUNK {
                subs_at += len.div_ceil(MAX_CHUNK);
            }
        }
        let ends: Vec<bool> = parts.iter().map(|p| p.sampling.is_some()).collect();
        self.launch_pass(&tokens, &rows, &ends)?;
        for (p, row) in parts.iter().zip(&rows) {
            self.lens[p.slot] += row.len;
            if p.sampling.is_none() {
                self.write_position(p.slot, PARKED)?;
                self.parked[p.slot] = true;
            }
            self.ready[p.slot] = p.sampling.is_some();
        }
        Ok(())
    }

    /// One pass over prompt parts on every rank: `tokens` (the parts' in row order) through
    /// the layers; each part that `ends` its prompt samples its next token from its last
    /// row's logits (keyed by that row's position, as a decode step samples with its own
    /// token's), and every part's position moves past its tokens.
    fn launch_pass(
        &mut self,
        tokens: &[u32],
        rows: &[Part],
        ends: &[bool],
    ) -> Result<(), GpuError> {
        for r in 0..self.ranks.len() {
            self.write_tokens(r, tokens)?;
        }
        self.launch_layers_all(tokens.len(), Pass::Parts(rows))?;
        let last = |p: &Part| p.first + p.len - 1;
        let ending: Vec<&Part> = rows
            .iter()
            .zip(ends)
            .filter(|e| *e.1)
            .map(|e| e.0)
            .collect();
        for r in 0..self.ranks.len() {
            // The head over one ending part's last row where it lies, or over several side
            // by side from row 0 (a row never moves onto a later part's last row, which lies
            // past it).
            let first = match ending[..] {
                [] => None,
                [p] => Some(last(p)),
                _ => {
                    let Rank { dev, bufs, .. } = &self.ranks[r];
                    for (j, p) in ending.iter().enumerate().filter(|(j, p)| last(p) != *j) {
                        for t in [&bufs.acts.streams[0], &bufs.acts.mix_partials] {
                            dev.copy(&row_range(t, last(p), 1)?, &mut row_range(t, j, 1)?)?;
                        }
                    }
                    Some(0)
                }
            };
            if let Some(first) = first {
                self.launch_head(r, first, ending.len())?;
            }
            // Ending part j's logits are row j.
            let mut j = 0;
            for (p, &end) in rows.iter().zip(ends) {
                let read = p.len - usize::from(end);
                if read > 0 {
                    self.launch_advance(r, p.slot, read)?;
                }
                if end {
                    self.launch_sample(r, p.slot, 1, j)?;
                    j += 1;
                }
            }
        }
        Ok(())
    }

    /// Slot `slot`'s sampling settings (as [`sampling_words`] gives them) on every rank.
    fn write_sampling(&mut self, slot: usize, words: &[u32; 4]) -> Result<(), GpuError> {
        for r in &mut self.ranks {
            let mut row = r.bufs.acts.sample_params.view(4 * slot, &[1, 4])?;
            r.dev.write(&mut row, words)?;
        }
        Ok(())
    }

    /// Gives a parked slot its position back (the tokens its sequence holds).
    fn unpark(&mut self, slot: usize) -> Result<(), GpuError> {
        if self.parked[slot] {
            self.write_position(slot, self.lens[slot] as u32)?;
            self.parked[slot] = false;
        }
        Ok(())
    }

    /// Slot `slot`'s device position on every rank.
    fn write_position(&mut self, slot: usize, pos: u32) -> Result<(), GpuError> {
        for r in &mut self.ranks {
            r.dev
                .write(&mut r.bufs.acts.positions.view(slot, &[1])?, &[pos])?;
        }
        Ok(())
    }

    /// Whether `steps` more decode steps of the first `n` slots may run: each has a sampled
    /// token waiting in the device buffer (after a prefill or a decode step) and room in its
    /// context.
    pub fn check_decode(&self, n: usize, steps: usize) -> Result<(), GpuModelError> {
        self.check_slots(n, &(0..n).collect::<Vec<_>>(), steps)
    }

    /// [`Self::check_decode`] of a step of the first `n` slots where only `slots` (each below
    /// `n`) hold running sequences: the other rows' tokens are computed and not used.
    pub fn check_slots(
        &self,
        n: usize,
        slots: &[usize],
        steps: usize,
    ) -> Result<(), GpuModelError> {
        if n == 0 || n > self.sequences() {
            return Err(GpuModelError::Sequences {
                asked: n,
                most: self.sequences(),
            });
        }
        // A one-row step runs the kernels' chunk form, which knows no parked row.
        if n == 1 && self.parked[0] {
            return Err(GpuModelError::Parked);
        }
        for &slot in slots {
            if slot >= n {
                return Err(GpuModelError::Sequences {
                    asked: slot + 1,
                    most: n,
                });
            }
            if !self.ready[slot] {
                return Err(GpuModelError::NoToken);
            }
            self.check_length(self.lens[slot] + steps)?;
        }
        Ok(())
    }

    /// One decode step of the first `n` slots on every rank (see
    /// [`Self::launch_rank_decode_step`]).
    pub fn launch_decode_step(&mut self, n: usize) -> Result<(), GpuError> {
        for r in 0..self.ranks.len() {
            self.launch_rank_decode_step(r, n)?;
        }
        Ok(())
    }

    /// Rank `rank`'s launches of one decode step of the first `n` slots, on its device: each
    /// slot's next token through every layer (one row each, over the slot's own state) and the
    /// head, the following token sampled with the slot's settings into the same buffer, the
    /// slot's position advanced. Identical at every position, so it is what a graph captures
    /// (one for each `n`); the caller accounts for the step with [`Self::note_decoded`]
    /// (checked first with [`Self::check_decode`]) and launches every rank's step before
    /// waiting for any.
    pub fn launch_rank_decode_step(&mut self, rank: usize, n: usize) -> Result<(), GpuError> {
        self.launch_layers(rank, n, Pass::Batch { n })?;
        self.launch_head(rank, 0, n)?;
        self.launch_sample(rank, 0, n, 0)
    }

    /// Records that `steps` decode steps ran (eagerly or as graph replays) for the sequences
    /// of `slots` (the step's other rows belong to no sequence or a parked one).
    pub fn note_decoded(&mut self, slots: &[usize], steps: usize) {
        for &slot in slots {
            self.lens[slot] += steps;
        }
    }

    /// Rank `rank`'s all-reduce of one token's hidden row, on its device (the per-layer sum of
    /// a decode step, for timing; it overwrites scratch that every step rewrites). Every rank
    /// must launch it; `None` on one GPU.
    pub fn launch_all_reduce_probe(&mut self, rank: usize) -> Option<Result<(), GpuError>> {
        let r = &mut self.ranks[rank];
        let (coll, _) = r.tp.as_ref()?;
        Some(
            r.bufs
                .acts
                .y
                .rows(1)
                .and_then(|mut y| coll.all_reduce(&r.dev, &mut y)),
        )
    }

    /// The token slot 0's last step sampled (see [`Self::read_tokens`]).
    pub fn read_token(&mut self) -> Result<u32, GpuError> {
        Ok(self.read_tokens(1)?[0])
    }

    /// The tokens the last steps sampled for the first `n` slots: one copy into page-locked
    /// memory after the work already enqueued, waited for (every rank samples the same tokens;
    /// rank 0's are read).
    pub fn read_tokens(&mut self, n: usize) -> Result<Vec<u32>, GpuError> {
        let r0 = &self.ranks[0];
        let all = r0.dev.read(&r0.bufs.acts.next, &mut self.token_readback)?;
        Ok(all[..n].to_vec())
    }

    /// The logits of the last step's row `row` (waits for the device).
    pub fn read_logits(&self, row: usize) -> Result<Vec<f32>, GpuError> {
        let v = self.config.vocab_size;
        let r0 = &self.ranks[0];
        r0.dev.download(&r0.bufs.acts.logits.view(row * v, &[v])?)
    }

    /// A chunk's token ids into rank `rank`'s token buffer.
    fn write_tokens(&mut self, rank: usize, chunk: &[u32]) -> Result<(), GpuError> {
        let r = &mut self.ranks[rank];
        let mut ids = r.bufs.acts.tokens.rows(chunk.len())?;
        r.dev.write(&mut ids, chunk)
    }

    /// Moves slot `slot`'s device position `n` tokens on.
    fn launch_advance(&mut self, rank: usize, slot: usize, n: usize) -> Result<(), GpuError> {
        let r = &mut self.ranks[rank];
        let mut pos = Seqs::Chunk { slot }.positions(&r.bufs.acts)?;
        advance_position(&r.dev, &mut pos, n as u32)
    }

    /// Samples the next token of slots `[first, first + n)`, each from its row of the logits
    /// from row `row`, with its slot's settings into its slot's next-token buffer, keyed by the
    /// slot's device position, which it then advances past that token.
    fn launch_sample(
        &mut self,
        rank: usize,
        first: usize,
        n: usize,
        row: usize,
    ) -> Result<(), GpuError> {
        let r = &mut self.ranks[rank];
        let a = &mut r.bufs.acts;
        let v = self.config.vocab_size;
        let logits = a.logits.view(row * v, &[n, v])?;
        let params = a.sample_params.view(4 * first, &[n, 4])?;
        let mut pos = a.positions.view(first, &[n])?;
        let mut next = a.next.view(first, &[n])?;
        let mut weights = a.sample_weights.view(0, &[n, v])?;
        sample(
            &r.dev,
            &logits,
            &params,
            &mut pos,
            1,
            &mut weights,
            &mut next,
        )
    }

    /// Rank `rank`'s embedding and every layer for the `n` tokens (at most [`Self::chunk`]) in
    /// its token buffer at its device position, into `acts.streams[0]` (each layer's two
    /// sub-layers end in the buffer they started from).
    fn launch_layers(&mut self, rank: usize, n: usize, pass: Pass) -> Result<(), GpuError> {
        self.launch_embed(rank, n, pass)?;
        for l in 0..self.local.num_layers {
            self.launch_layer(rank, l, n, pass)?;
        }
        Ok(())
    }

    /// All ranks' [`Self::launch_layers`], layer by layer across the ranks: a rank's all-reduce
    /// spins until every rank's has started, so no rank's launches may wait behind another
    /// rank's later layers (a long chunk's layer is a hundred launches or more, and a stream
    /// holds only so many pending ones).
    fn launch_layers_all(&mut self, n: usize, pass: Pass) -> Result<(), GpuError> {
        for r in 0..self.ranks.len() {
            self.launch_embed(r, n, pass)?;
        }
        for l in 0..self.local.num_layers {
            for r in 0..self.ranks.len() {
                self.launch_layer(r, l, n, pass)?;
            }
        }
        Ok(())
    }

    /// Rank `rank`'s embedding of its `n` tokens into `acts.streams[0]` with the first site's
    /// mix projection (and, for a part past [`MAX_CHUNK`], its sub-chunks' positions).
    fn launch_embed(&mut self, rank: usize, n: usize, pass: Pass) -> Result<(), GpuError> {
        let Rank { dev, w, bufs, .. } = &mut self.ranks[rank];
        let dev = &**dev;
        let a = &mut bufs.acts;
        let tokens = pass_tokens(a, n, pass)?;
        if let Pass::Parts(parts) = pass {
            for p in parts.iter().filter(|p| p.len > MAX_CHUNK) {
                let mut subs = a.sub_pos.view(p.subs_at, &[p.len.div_ceil(MAX_CHUNK)])?;
                let pos = Seqs::Chunk { slot: p.slot }.positions(a)?;
                chunk_positions(dev, &pos, &mut subs, MAX_CHUNK as u32)?;
            }
        }
        let mut s0 = a.streams[0].rows(n)?;
        embed_hc_gather(dev, &w.embed, &tokens, self.local.hc_mult, &mut s0)?;
        // The first site's mix projection; every later one comes with the expansion before it.
        hc_mix(
            dev,
            &s0,
            w.entry_site(0),
            &self.hc,
            &mut a.mix_partials.rows(n)?,
        )
    }

    /// Rank `rank`'s layer `l` for its `n` tokens, from and back into `acts.streams[0]`.
    fn launch_layer(
        &mut self,
        rank: usize,
        l: usize,
        n: usize,
        pass: Pass,
    ) -> Result<(), GpuError> {
        let Rank {
            dev, w, bufs, tp, ..
        } = &mut self.ranks[rank];
        let dev = &**dev;
        let tp = tp.as_ref();
        let c = &self.local;
        let a = &mut bufs.acts;
        // A sub-layer's partial sums, summed over the ranks in place.
        let reduce = |a: &mut buffers::Acts<Taking>,
                      out: fn(&buffers::Acts<Taking>) -> &DeviceTensor<f32>| {
            match tp {
                Some((coll, _)) => coll.all_reduce(dev, &mut out(a).rows(n)?),
                None => Ok(()),
            }
        };
        let tokens = pass_tokens(a, n, pass)?;
        let mut cur = 0;
        let eps = c.rms_norm_eps;
        let lw = &w.layers[l];
        // The attention's passes: each part over its slot's state, or the whole batch.
        let mut runs = Vec::new();
        let one = [Part::whole(0, n)];
        let (parts, batch) = match pass {
            Pass::Parts(parts) => (parts, false),
            Pass::Batch { .. } => (&one[..], true),
        };
        for p in parts {
            let seqs = if batch {
                Seqs::Batch { n }
            } else {
                Seqs::Chunk { slot: p.slot }
            };
            runs.push((bufs.layers[l].view(seqs)?, seqs.positions(a)?, *p));
        }
        let hc = &self.hc;
        let attn = |a: &mut buffers::Acts<Taking>| {
            // The site's Sinkhorn beside the first run's output projection.
            let mut comb = Some(a.comb.rows(n)?);
            for (ls, pos, rows) in &mut runs {
                let sinkhorn = comb.as_mut().map(|comb| (hc, comb));
                attention_layer(dev, c, w, lw, ls, a, rows, pos, sinkhorn)?;
                comb = None;
            }
            reduce(a, |a| &a.y)?;
            Ok(None)
        };
        let site = Site {
            hc: &lw.hc_attn,
            norm: &lw.attn_norm,
            next: &lw.hc_ffn,
        };
        hc_sublayer(dev, hc, a, n, &mut cur, site, eps, attn, |a| &a.y)?;
        // Over several GPUs the ranks' sums are reduced in one buffer: the shared expert's
        // output is not left apart there.
        let ffn = |a: &mut _| {
            let plus = moe_layer(dev, c, hc, lw, a, n, &tokens, tp.is_none())?;
            reduce(a, |a| &a.moe)?;
            Ok(plus)
        };
        let site = Site {
            hc: &lw.hc_ffn,
            norm: &lw.ffn_norm,
            next: w.entry_site(l + 1),
        };
        hc_sublayer(dev, hc, a, n, &mut cur, site, eps, ffn, |a| &a.moe)?;
        debug_assert_eq!(cur, 0);
        Ok(())
    }

    /// Rank `rank`'s head for rows `[first, first + n)` (`n` at most [`MAX_CHUNK`]) of the
    /// chunk [`Self::launch_layers`] ran: the final collapse with the output norm and lm_head
    /// (each rank's slice of the vocabulary, gathered into every rank's logits), the whole
    /// vocabulary's logits into `acts.logits[..n]`.
    fn launch_head(&mut self, rank: usize, first: usize, n: usize) -> Result<(), GpuError> {
        let Rank {
            dev, w, bufs, tp, ..
        } = &mut self.ranks[rank];
        let dev = &**dev;
        let a = &mut bufs.acts;
        let streams = row_range(&a.streams[0], first, n)?;
        let part = row_range(&a.mix_partials, first, n)?;
        let eps = self.local.rms_norm_eps;
        let (mut xn, mut xb) = (a.xn.rows(n)?, a.xb.rows(n)?);
        let input = NormedInput {
            weight: &w.norm,
            eps,
            xn: &mut xn,
            xb: &mut xb,
        };
        hc_head(dev, &streams, &w.hc_head, &self.hc, &part, input)?;
        match tp.as_ref() {
            Some((coll, logits)) => {
                let mut slice = a.head_part.rows(n)?;
                gemv(dev, &xb, &w.head, &mut slice, &mut a.ws)?;
                coll.all_gather_cols(dev, &slice, logits)
            }
            None => gemv(dev, &xb, &w.head, &mut a.logits.rows(n)?, &mut a.ws),
        }
    }
}

/// A sub-layer's mHC site, its norm, and the site after it (whose mix projection the
/// expansion computes).
struct Site<'a> {
    hc: &'a DeviceHcSite,
    norm: &'a DeviceTensor<f32>,
    next: &'a DeviceHcSite,
}

/// One mHC sub-layer (attention or MoE) on `streams[*cur]`, whose mix projection is in
/// `acts.mix_partials`: [`site_pre`], `block` (which writes its output to `out(a)`, and returns
/// a second part of it where it leaves one apart), then the expansion into the other stream
/// buffer, which `*cur` then names, with the next site's mix projection.
#[allow(clippy::too_many_arguments)]
fn hc_sublayer(
    dev: &Device,
    p: &HcParams,
    a: &mut buffers::Acts<Taking>,
    n: usize,
    cur: &mut usize,
    site: Site,
    eps: f32,
    block: impl FnOnce(&mut buffers::Acts<Taking>) -> Result<Option<DeviceTensor<f32>>, GpuError>,
    out: fn(&buffers::Acts<Taking>) -> &DeviceTensor<f32>,
) -> Result<(), GpuError> {
    let src = a.streams[*cur].rows(n)?;
    let mut dst = a.streams[1 - *cur].rows(n)?;
    let mix = site_pre(dev, p, a, n, &src, site.hc, site.norm, eps)?;
    let plus = block(a)?;
    let y = out(a).rows(n)?;
    let mut part = a.mix_partials.rows(n)?;
    let plus = plus.as_ref();
    hc_post_mix(dev, &src, &y, plus, &mix, &mut dst, site.next, p, &mut part)?;
    *cur = 1 - *cur;
    Ok(())
}

/// A site's collapse (from its mix projection in `acts.mix_partials`) with its norm: `acts.xn`
/// (F32) and `acts.xb` (BF16) hold the sub-layer input; returns the mix for the expansion.
#[allow(clippy::too_many_arguments)]
fn site_pre(
    dev: &Device,
    p: &HcParams,
    a: &mut buffers::Acts<Taking>,
    n: usize,
    streams: &DeviceTensor<f32>,
    site: &DeviceHcSite,
    norm: &DeviceTensor<f32>,
    eps: f32,
) -> Result<DeviceHcMix, GpuError> {
    let mut mix = DeviceHcMix {
        post: a.post.rows(n)?,
        comb: a.comb.rows(n)?,
    };
    let (mut xn, mut xb) = (a.xn.rows(n)?, a.xb.rows(n)?);
    let input = NormedInput {
        weight: norm,
        eps,
        xn: &mut xn,
        xb: &mut xb,
    };
    hc_pre(
        dev,
        streams,
        site,
        p,
        &a.mix_partials.rows(n)?,
        input,
        &mut mix,
    )?;
    Ok(mix)
}

/// `out (F32) = x (BF16) · Wᵀ`, over the front of `out`.
fn linear_f32(
    dev: &Device,
    x: &DeviceTensor<bf16>,
    w: &GemvWeight,
    out: &DeviceTensor<f32>,
    ws: &mut dsv4_ops::gpu::gemv::GemvWorkspace,
) -> Result<DeviceTensor<f32>, GpuError> {
    let mut o = cols(out, x.shape()[0], w.n())?;
    gemv(dev, x, w, &mut o, ws)?;
    Ok(o)
}

/// Attention sub-layer of the tokens of `rows` at `pos` over the state `ls`: those rows of
/// `acts.xn`/`acts.xb` in, of `acts.y` out (every scratch buffer from its first row). A
/// `sinkhorn` comb ([`hc_comb`]) is finished on the side stream beside the output projection.
#[allow(clippy::too_many_arguments)]
fn attention_layer(
    dev: &Device,
    c: &Config,
    w: &DevWeights,
    lw: &DevLayer,
    ls: &mut LayerView,
    a: &mut buffers::Acts<Taking>,
    rows: &Part,
    pos: &DeviceTensor<u32>,
    sinkhorn: Option<(&HcParams, &mut DeviceTensor<f32>)>,
) -> Result<(), GpuError> {
    let n = rows.len;
    let at = &lw.attn;
    let eps = c.rms_norm_eps;
    let (hd, q_all) = (c.head_dim, c.num_heads * c.head_dim);
    let rope = if lw.kind == LayerKind::Sliding {
        &w.rope_main
    } else {
        &w.rope_compress
    };
    let xb = row_range(&a.xb, rows.first, n)?;
    // Beside the query path (each writes only its own buffers and this layer's state): a CSA
    // layer's indexer compressor and head weights on the second side stream now, its queries
    // and selection on the first once the query latent is normalized, and the layer's
    // compressor on the second after the indexer's; other layers' compressor on the first.
    let indexed = at.indexer.is_some();
    if indexed {
        dev.fork_to(Side::Second)?;
        dev.on(Side::Second, || {
            indexer_inputs(dev, c, w, lw, ls, a, rows, pos)
        })?;
    } else {
        dev.fork()?;
        dev.on_side(|| layer_compressor(dev, c, w, lw, ls, &xb, &a.comp, pos, &mut a.ws_side))?;
    }
    // Query latent and shared key/value: one GEMV of wq_a and wkv stacked; q_norm.
    let qa_kv = linear_f32(dev, &xb, &at.wq_a_kv, &a.qa_kv, &mut a.ws)?;
    let qa = ColRange {
        x: &qa_kv,
        first: 0,
        width: c.q_lora_rank,
    };
    let (mut qa_n, mut qab) = (a.qa_n.rows(n)?, a.qab.rows(n)?);
    rms_norm_rows(dev, qa, Some(&at.q_norm), eps, &mut qa_n, Some(&mut qab))?;
    // A chunk of at most SELECT_ROWS tokens selects beside the queries; a longer one below,
    // SELECT_ROWS queries at a time (the scores' scratch holds that many).
    let subs = sub_chunks(n).len();
    let groups = pieces(n, SELECT_ROWS);
    let select_beside = groups.len() == 1;
    if indexed {
        dev.fork()?;
        dev.on_side(|| index_queries(dev, c, w, lw, a, n, pos))?;
        if select_beside {
            // After the indexer's keys and head weights.
            dev.side_waits(Side::First)?;
            dev.on_side(|| select(dev, lw, ls, a, pos, rows, 0, n, subs))?;
        }
        dev.on(Side::Second, || {
            layer_compressor(dev, c, w, lw, ls, &xb, &a.comp, pos, &mut a.ws_second)
        })?;
    }
    // Queries: wq_b; then, in one launch, each head's norm and rope, and the shared
    // key/value's kv_norm and rope.
    let q = linear_f32(dev, &qab, &at.wq_b, &a.q, &mut a.ws)?;
    let mut q_n = a.q_n.view(0, &[n * c.num_heads, hd])?;
    let heads_rope = RowRope {
        inv_freq: rope,
        pos,
        rows_per_token: c.num_heads,
    };
    let q_rows = q.reshape(&[n * c.num_heads, hd])?;
    let mut kv_n = a.kv_n.rows(n)?;
    let heads = NormRows {
        x: (&q_rows).into(),
        weight: None,
        rows_per_token: c.num_heads,
        out: &mut q_n,
    };
    let kv = NormRows {
        x: ColRange {
            x: &qa_kv,
            first: c.q_lora_rank,
            width: hd,
        },
        weight: Some(&at.kv_norm),
        rows_per_token: 1,
        out: &mut kv_n,
    };
    rms_norm_rope_pair(dev, heads, kv, eps, &heads_rope)?;
    let q_n = q_n.reshape(&[n, q_all])?;
    dev.join()?;
    // A longer chunk's selections, SELECT_ROWS queries at a time, into its rows of `selected`
    // (after the join: the indexer's queries, keys and head weights come from the side streams).
    if !select_beside {
        for &(first, count) in &groups {
            select(dev, lw, ls, a, pos, rows, first, count, subs)?;
        }
    }
    let selected;
    let compressed = match (&ls.comp, &ls.index) {
        (Some(st), Some((_, sel))) => {
            selected = sel.rows(n)?;
            Compressed::Selected {
                entries: &st.entries,
                selected: &selected,
                ratio: lw.kind.ratio(),
            }
        }
        (Some(st), None) => Compressed::All {
            entries: &st.entries,
            ratio: lw.kind.ratio(),
        },
        _ => Compressed::None,
    };
    // The output comes rotated back and in BF16.
    let mut ob = a.attn_b.rows(n)?;
    let mut splits = a.attention_splits()?;
    attention::attention(
        dev,
        &q_n,
        &kv_n,
        &ls.window,
        compressed,
        &at.sink,
        pos,
        rope,
        &mut splits,
        &mut ob,
    )?;
    // The ring takes the chunk's keys on the side stream, beside the output projection: only
    // this layer's next chunk reads it, and the join below comes before the next layer
    // rewrites kv_n (or the position moves on).
    dev.fork()?;
    dev.on_side(|| {
        attention::window_write(dev, &kv_n, pos, &mut ls.window)?;
        match sinkhorn {
            Some((p, comb)) => hc_comb(dev, p, comb),
            None => Ok(()),
        }
    })?;
    // Grouped output projection: group g's heads (columns) through its rows of wo_a, in one
    // launch, then wo_b.
    let mut z = a.z.rows(n)?;
    gemv_grouped(dev, &ob, &at.wo_a, c.o_groups, &mut z, &mut a.ws)?;
    gemv(
        dev,
        &z,
        &at.wo_b,
        &mut row_range(&a.y, rows.first, n)?,
        &mut a.ws,
    )?;
    dev.join()
}

/// One compressor's projections of `xb` (one GEMV into the front of `proj`) and its state
/// update.
#[allow(clippy::too_many_arguments)]
fn compressor_step(
    dev: &Device,
    c: &Config,
    w: &DevWeights,
    cw: &DevCompressor,
    st: &mut attention::CompressorBuffers,
    xb: &DeviceTensor<bf16>,
    proj: &DeviceTensor<f32>,
    pos: &DeviceTensor<u32>,
    ws: &mut dsv4_ops::gpu::gemv::GemvWorkspace,
) -> Result<(), GpuError> {
    let proj = linear_f32(dev, xb, &cw.proj, proj, ws)?;
    attention::compressor_update(
        dev,
        &proj,
        &cw.ape,
        &cw.norm,
        &w.rope_compress,
        c.rms_norm_eps,
        cw.overlap,
        pos,
        st,
    )
}

/// The layer's compressor step, if it has one (projections in `proj`, GEMVs on `ws`).
#[allow(clippy::too_many_arguments)]
fn layer_compressor(
    dev: &Device,
    c: &Config,
    w: &DevWeights,
    lw: &DevLayer,
    ls: &mut LayerView,
    xb: &DeviceTensor<bf16>,
    proj: &DeviceTensor<f32>,
    pos: &DeviceTensor<u32>,
    ws: &mut dsv4_ops::gpu::gemv::GemvWorkspace,
) -> Result<(), GpuError> {
    let (Some(cw), Some(st)) = (&lw.attn.compressor, &mut ls.comp) else {
        return Ok(());
    };
    compressor_step(dev, c, w, cw, st, xb, proj, pos, ws)
}

/// In a CSA layer, the indexer's work before the selection of the tokens of `rows`, on the
/// second side stream (GEMVs on `acts.ws_second`): its compressor (projections in
/// `acts.icomp`) and head weights.
#[allow(clippy::too_many_arguments)]
fn indexer_inputs(
    dev: &Device,
    c: &Config,
    w: &DevWeights,
    lw: &DevLayer,
    ls: &mut LayerView,
    a: &mut buffers::Acts<Taking>,
    rows: &Part,
    pos: &DeviceTensor<u32>,
) -> Result<(), GpuError> {
    let (Some(iw), Some((ist, _))) = (&lw.attn.indexer, &mut ls.index) else {
        return Ok(());
    };
    let n = rows.len;
    let xb = row_range(&a.xb, rows.first, n)?;
    compressor_step(
        dev,
        c,
        w,
        &iw.compressor,
        ist,
        &xb,
        &a.icomp,
        pos,
        &mut a.ws_second,
    )?;
    gate_logits(
        dev,
        &row_range(&a.xn, rows.first, n)?,
        iw.weights_proj.weight(),
        &mut a.iw.rows(n)?,
    )
}

/// In a CSA layer, the indexer's rotated queries (`acts.iq`) of the `n` tokens, from the
/// normalized query latent `acts.qab` (on the first side stream).
fn index_queries(
    dev: &Device,
    c: &Config,
    w: &DevWeights,
    lw: &DevLayer,
    a: &mut buffers::Acts<Taking>,
    n: usize,
    pos: &DeviceTensor<u32>,
) -> Result<(), GpuError> {
    let Some(iw) = &lw.attn.indexer else {
        return Ok(());
    };
    let qab = a.qab.rows(n)?;
    let mut iq = linear_f32(dev, &qab, &iw.wq_b, &a.iq, &mut a.ws_side)?;
    rope_rows(
        dev,
        &mut iq,
        c.index_head_dim,
        &w.rope_compress,
        pos,
        RopeDirection::Forward,
    )
}

/// In a CSA layer, the indexer's top-k of the compressed entries for the `rows` queries from
/// row `first` (a multiple of [`MAX_CHUNK`]: sub-chunk `first / MAX_CHUNK` of the `subs` of
/// `part` gives its position) of [`index_queries`]' output, into the same rows of the
/// layer's `selected` (scored on tensor cores, into the first rows of the shared scratch).
#[allow(clippy::too_many_arguments)]
fn select(
    dev: &Device,
    lw: &DevLayer,
    ls: &mut LayerView,
    a: &buffers::Acts<Taking>,
    pos: &DeviceTensor<u32>,
    part: &Part,
    first: usize,
    rows: usize,
    subs: usize,
) -> Result<(), GpuError> {
    let (Some(iw), Some((ist, selected))) = (&lw.attn.indexer, &mut ls.index) else {
        return Ok(());
    };
    let width = iw.wq_b.n();
    let iq = row_range(&cols(&a.iq, first + rows, width)?, first, rows)?;
    let iw_rows = row_range(&a.iw, first, rows)?;
    let mut sel = row_range(selected, first, rows)?;
    attention::index_topk(
        dev,
        &iq,
        &iw_rows,
        &ist.entries,
        lw.kind.ratio(),
        &sub_position(a, pos, part, first / MAX_CHUNK, subs)?,
        IndexScoring::TensorCores,
        &mut a
            .index_scores
            .view(0, &[rows, per_sequence_rows(&ist.entries)])?,
        &mut sel,
    )
}

/// MoE sub-layer of `n` tokens: `acts.xn`/`acts.xb` in, `acts.moe` out (routed + shared, or
/// with `apart` the routed experts' alone and the shared expert's returned).
#[allow(clippy::too_many_arguments)]
fn moe_layer(
    dev: &Device,
    c: &Config,
    hc: &HcParams,
    lw: &DevLayer,
    a: &mut buffers::Acts<Taking>,
    n: usize,
    tokens: &DeviceTensor<u32>,
    apart: bool,
) -> Result<Option<DeviceTensor<f32>>, GpuError> {
    let m = &lw.moe;
    let xb = a.xb.rows(n)?;
    // The shared expert on the side stream, beside the routing and the routed experts.
    // `apart` (one sub-chunk): it writes `moe_shared`, the routed experts write `moe`, and the
    // side joins after them, so that the routed down projection launches programmatically
    // while gate+up drains (a join in front of it would make it wait for gate+up's end); the
    // expansion adds the two. Otherwise its output goes to `acts.moe` first, and the routed
    // experts' down projection, once the side has joined, adds their sum onto it. The site's
    // Sinkhorn follows the shared expert there.
    let mut sh = a.shared_h.rows(n)?;
    let mut comb = a.comb.rows(n)?;
    let mut out = a.moe.rows(n)?;
    let apart = apart && n <= MAX_CHUNK;
    let mut shared = if apart {
        a.moe_shared.rows(n)?
    } else {
        a.moe.rows(n)?
    };
    dev.fork()?;
    dev.on_side(|| {
        gemv_swiglu(
            dev,
            &xb,
            &m.shared_w13,
            c.swiglu_limit,
            &mut sh,
            &mut a.ws_side,
        )?;
        gemv(dev, &sh, &m.shared_w2, &mut shared, &mut a.ws_side)?;
        hc_comb(dev, hc, &mut comb)
    })?;
    let mut logits = a.gate.rows(n)?;
    let by = match &m.routing {
        DevRouting::Hash(t) => DeviceRouteBy::Hash { tid2eid: t },
        DevRouting::Learned(b) => DeviceRouteBy::Learned { bias: b },
    };
    let (mut ids, mut wts) = (a.ids.rows(n)?, a.weights.rows(n)?);
    let (xn, scale) = (a.xn.rows(n)?, c.routed_scaling_factor);
    if n == 1 {
        let ticket = &mut a.route_counter;
        let (ids, wts) = (&mut ids, &mut wts);
        gate_route(
            dev,
            &xn,
            m.gate.weight(),
            tokens,
            by,
            scale,
            ticket,
            &mut logits,
            ids,
            wts,
        )?;
    } else {
        // Several tokens (a batch, a chunk) route a block each, not one after another in the
        // gate's last block: a 16-row decode step 39 -> 19 us a layer (H100).
        gate_logits(dev, &xn, m.gate.weight(), &mut logits)?;
        route_topk(dev, &logits, tokens, by, scale, &mut ids, &mut wts)?;
    }
    if let (RoutedExperts::Fp4(e), true) = (&m.experts, n > MAX_CHUNK) {
        // A long chunk's experts on the prefill GEMM, over each expert's rows.
        let experts = c.n_routed_experts;
        let k = c.experts_per_token;
        let mut scratch = MoeChunkScratch {
            lists: a.moe_lists.view(0, &[experts, n * k])?,
            counts: a.moe_counts.view(0, &[experts])?,
            h: a.h_b.rows(n)?,
            rows: a.moe_rows.view(0, &[n * k, c.hidden_size])?,
            xp: a.moe_x.rows(n)?,
        };
        let join = || dev.join();
        moe_chunk(
            dev,
            &xb,
            &ids,
            &wts,
            e,
            c.swiglu_limit,
            &mut scratch,
            &mut out,
            join,
        )?;
        return Ok(None);
    }
    // The routed experts a sub-chunk at a time; the first joins the shared expert before its
    // down projection adds onto the shared expert's output (unless apart).
    for (j, (first, rows)) in sub_chunks(n).into_iter().enumerate() {
        let join = || if j == 0 && !apart { dev.join() } else { Ok(()) };
        let (x, ids, wts) = (
            row_range(&xb, first, rows)?,
            row_range(&ids, first, rows)?,
            row_range(&wts, first, rows)?,
        );
        let mut out = row_range(&out, first, rows)?;
        match &m.experts {
            RoutedExperts::Fp4(e) => {
                let mut h = a.h_b.rows(rows)?;
                let onto = if apart {
                    MoeOut::F32(&mut out)
                } else {
                    MoeOut::F32Add(&mut out)
                };
                moe_decode(dev, &x, &ids, &wts, e, c.swiglu_limit, &mut h, onto, join)?;
            }
            RoutedExperts::Bf16(e) => {
                let mut h = a.h.rows(rows)?;
                let limit = c.swiglu_limit;
                moe_bf16(
                    dev, &x, &ids, &wts, e, limit, &mut h, &mut out, !apart, join,
                )?;
            }
        }
    }
    if !apart {
        return Ok(None);
    }
    dev.join()?;
    Ok(Some(shared))
}

/// How a model fits `world` GPUs, worked out before anything is allocated.
#[derive(Clone, Debug)]
pub struct MemoryPlan {
    pub world: usize,
    /// Free bytes on the GPU with the least.
    pub free: usize,
    /// Weight bytes each GPU holds.
    pub weights: usize,
    /// Activations, workspaces and collectives: the pool's bytes at no context.
    pub fixed: usize,
    /// Sequences the state holds, and the state bytes a context position adds (for all of them).
    pub sequences: usize,
    pub per_token: f64,
    pub capacity: usize,
    /// Most tokens one forward pass takes (see [`choose_layout`]).
    pub chunk: usize,
}

impl std::fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
        write!(
            f,
            "{} GPU(s): {:.2} GiB of weights and {:.2} GiB of activations each, {:.1} KiB of \
             state per context token ({} sequence(s)); {:.2} GiB free on each: context capacity \
             {} tokens a sequence, prompts in chunks of {}",
            self.world,
            gib(self.weights),
            gib(self.fixed),
            self.per_token / 1024.0,
            self.sequences,
            gib(self.free),
            self.capacity,
            self.chunk
        )
    }
}

/// The plan for `weights` (of `config`) on `world` GPUs with `free` bytes each: the capacity
/// asked for (or what fits), or an error naming the bytes, and the fewest GPUs of this size
/// that would hold the model when that is known.
pub fn plan_memory(
    config: &Config,
    weights: &ModelWeights,
    world: usize,
    free: usize,
    opts: GpuOptions,
) -> Result<MemoryPlan, GpuModelError> {
    let shared_inter = weights.layers.first().map_or(0, |l| l.moe.shared.w1.rows());
    let rank_bytes = |n: usize| crate::shard::rank_weight_bytes(weights, n);
    plan(config, &rank_bytes, shared_inter, world, free, opts)
}

/// [`plan_memory`] for the model [`GpuModel::random`] draws in `format`.
pub fn plan_random_memory(
    config: &Config,
    format: SynthFormat,
    world: usize,
    free: usize,
    opts: GpuOptions,
) -> Result<MemoryPlan, GpuModelError> {
    let shared_inter = random::shared_inter(config);
    let rank_bytes = |n: usize| random::rank_weight_bytes(config, format, n);
    plan(config, &rank_bytes, shared_inter, world, free, opts)
}

/// The plan for a model whose ranks of `n` GPUs hold `rank_bytes(n)` weight bytes each, with
/// shared experts `shared_inter` wide.
fn plan(
    config: &Config,
    rank_bytes: &dyn Fn(usize) -> usize,
    shared_inter: usize,
    world: usize,
    free: usize,
    opts: GpuOptions,
) -> Result<MemoryPlan, GpuModelError> {
    let local = local_config(config, world)?;
    let w = rank_bytes(world);
    let over = |n: usize| Plan {
        slots: opts.slots(),
        capacity: 0,
        chunk: 0,
        shared_inter: shared_inter / n,
        world: n,
    };
    let fits = |n: usize| -> bool {
        let Ok(lc) = local_config(config, n) else {
            return false;
        };
        free.checked_sub(rank_bytes(n))
            .is_some_and(|rest| choose_layout(&lc, opts, over(n), rest).is_ok())
    };
    let layout = free
        .checked_sub(w)
        .ok_or(())
        .and_then(|rest| choose_layout(&local, opts, over(world), rest).map_err(|_| ()));
    let Ok(Layout { capacity, chunk }) = layout else {
        let hint = [1, 2, 4, 8]
            .into_iter()
            .find(|&n| n > world && fits(n))
            .map_or_else(String::new, |n| format!(": it needs {n} GPUs of this size"));
        return Err(GpuModelError::DoesNotFit {
            world,
            weights: w,
            free,
            hint,
        });
    };
    let fixed = pool_bytes_at(&local, over(world), 0, chunk)?;
    let probe = 1 << 14;
    let per_token =
        (pool_bytes_at(&local, over(world), probe, chunk)? - fixed) as f64 / probe as f64;
    Ok(MemoryPlan {
        world,
        free,
        weights: w,
        fixed,
        sequences: opts.slots(),
        per_token,
        capacity,
        chunk,
    })
}

/// Weight bytes a decode step reads: every dense weight of every layer (the mHC projections
/// included), the selected experts (`experts_per_token` of each layer), the head and one
/// embedding row. Reads of the sequence state (window, compressed entries, indexer keys), which
/// grow with the position, are not counted.
fn step_bytes(c: &Config, w: &DevWeights) -> usize {
    let g = |x: &GemvWeight| x.bytes();
    let hc = |x: &DeviceHcSite| x.fn_.num_bytes();
    let comp = |x: &DevCompressor| g(&x.proj);
    let layers: usize = w
        .layers
        .iter()
        .map(|l| {
            let a = &l.attn;
            g(&a.wq_a_kv)
                + g(&a.wq_b)
                + g(&a.wo_a)
                + g(&a.wo_b)
                + a.compressor.as_ref().map_or(0, comp)
                + a.indexer.as_ref().map_or(0, |i| {
                    g(&i.wq_b) + i.weights_proj.bytes() + comp(&i.compressor)
                })
                + l.moe.gate.bytes()
                + c.experts_per_token * l.moe.experts.expert_bytes()
                + g(&l.moe.shared_w13)
                + g(&l.moe.shared_w2)
                + hc(&l.hc_attn)
                + hc(&l.hc_ffn)
        })
        .sum();
    layers + g(&w.head) + hc(&w.hc_head) + c.hidden_size * 2
}

/// Longest prompt chunk: its GEMMs read each weight once per this many tokens, and its routed
/// experts' lists grow long enough for the tensor-core expert kernels (about 192 rows an
/// expert for Flash). 12 Flash layers, 8k prompt, one H200: chunks of 2048 18,189 tok/s, 4096
/// 21,083, 8192 22,506-22,706.
pub const PREFILL_CHUNK: usize = 8192;
/// Longest chunk [`GpuOptions::max_chunk`] may ask for (past it, its activations' sizes would
/// leave the range the memory plan counts in).
const MOST_CHUNK: usize = 1 << 20;

/// A rank's sequence capacity and chunk length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Layout {
    capacity: usize,
    chunk: usize,
}

/// The longest chunk (a power of two from `opts.max_chunk` or [`PREFILL_CHUNK`], or from the
/// asked capacity when that is shorter, down to [`MAX_CHUNK`]) whose activations take at most
/// an eighth of `free` and leave room for the capacity [`choose_capacity`] gives.
fn choose_layout(
    c: &Config,
    opts: GpuOptions,
    plan: Plan,
    free: usize,
) -> Result<Layout, GpuModelError> {
    let asked = opts.max_context;
    let most = opts.max_chunk.map_or(PREFILL_CHUNK, |n| {
        let n = n.clamp(MAX_CHUNK, MOST_CHUNK);
        1 << n.ilog2()
    });
    let longest = asked.map_or(most, |n| n.next_power_of_two().clamp(MAX_CHUNK, most));
    let bytes = |chunk| pool_bytes_at(c, plan, 0, chunk);
    let base = bytes(MAX_CHUNK)?;
    let mut chunk = longest;
    while chunk > MAX_CHUNK {
        let extra = bytes(chunk)? - base;
        if extra <= free / 8 {
            let at = Plan { chunk, ..plan };
            if let Ok(capacity) = choose_capacity(c, asked, at, free) {
                return Ok(Layout { capacity, chunk });
            }
        }
        chunk /= 2;
    }
    let at = Plan {
        chunk: MAX_CHUNK,
        ..plan
    };
    let capacity = choose_capacity(c, asked, at, free)?;
    Ok(Layout {
        capacity,
        chunk: MAX_CHUNK,
    })
}

/// The pool's bytes for `plan` at `capacity` positions and chunks of `chunk`.
fn pool_bytes_at(c: &Config, plan: Plan, capacity: usize, chunk: usize) -> Result<usize, GpuError> {
    buffers::pool_bytes(
        c,
        Plan {
            capacity,
            chunk,
            ..plan
        },
    )
}

/// The context capacity with `plan`'s chunks and slots: the one asked for, up to the model's
/// limit (an error if it does not fit in 90% of the free memory), else the most that fits
/// there, up to the model's limit, in whole 128-token units.
fn choose_capacity(
    c: &Config,
    asked: Option<usize>,
    plan: Plan,
    free: usize,
) -> Result<usize, GpuModelError> {
    let budget = free / 10 * 9;
    let bytes = |capacity| pool_bytes_at(c, plan, capacity, plan.chunk);
    if let Some(ctx) = asked {
        // Positions past the model's limit are never run.
        let ctx = ctx.min(c.max_position_embeddings);
        let need = bytes(ctx).unwrap_or(usize::MAX);
        if need > budget {
            return Err(GpuModelError::OutOfMemory {
                context: ctx,
                need,
                free,
            });
        }
        return Ok(ctx);
    }
    let unit = 128;
    let fixed = bytes(0)?;
    let probe = 1 << 16;
    let per_unit = (bytes(probe)? - fixed).div_ceil(probe / unit);
    if fixed + per_unit > budget {
        return Err(GpuModelError::OutOfMemory {
            context: unit,
            need: fixed + per_unit,
            free,
        });
    }
    let units = (budget - fixed) / per_unit.max(1);
    Ok((units * unit).min(c.max_position_embeddings))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_fit_the_kernels_and_misfits_are_named() {
        for c in [Config::tiny(), Config::flash(), Config::pro()] {
            check_gpu_config(&c).unwrap();
        }
        let mut c = Config::tiny();
        c.hc_mult = 3;
        let err = check_gpu_config(&c).unwrap_err().to_string();
        assert!(
            err.contains("hc_mult = 3") && err.contains("exactly 4"),
            "{err}"
        );
        let mut c = Config::flash();
        c.index_head_dim = 256;
        let err = check_gpu_config(&c).unwrap_err().to_string();
        assert!(err.contains("index_head_dim = 256"), "{err}");
        c.index_head_dim = 66;
        let err = check_gpu_config(&c).unwrap_err().to_string();
        assert!(err.contains("a multiple of 4"), "{err}");
        let mut c = Config::tiny();
        c.o_lora_rank = 24;
        let err = check_gpu_config(&c).unwrap_err().to_string();
        assert!(
            err.contains("o_lora_rank = 24") && err.contains("multiple of 16"),
            "{err}"
        );
        // A split that leaves each GPU 4 intermediate channels of 8.
        let mut c = Config::tiny();
        c.moe_intermediate_size = 8;
        let local = local_config(&c, 2).unwrap();
        let err = check_gpu_config(&local).unwrap_err().to_string();
        assert!(err.contains("moe_intermediate_size = 4"), "{err}");
    }

    /// One sequence of `n` positions.
    fn context(n: usize) -> GpuOptions {
        GpuOptions {
            max_context: Some(n),
            sequences: 1,
            max_chunk: None,
        }
    }

    /// One sequence on one GPU, shared experts `inter` wide, chunks of `chunk`.
    fn one_gpu(inter: usize, chunk: usize) -> Plan {
        Plan {
            slots: 1,
            capacity: 0,
            chunk,
            shared_inter: inter,
            world: 1,
        }
    }

    #[test]
    fn capacity_is_what_was_asked_or_what_fits_and_a_misfit_names_the_bytes() {
        let c = Config::tiny();
        let inter = c.moe_intermediate_size;
        let gib = 1usize << 30;
        let m = MAX_CHUNK;
        let plan = one_gpu(inter, m);
        assert_eq!(choose_capacity(&c, Some(100), plan, gib).unwrap(), 100);
        let limit = c.max_position_embeddings;
        assert_eq!(
            choose_capacity(&c, Some(limit + 9), plan, gib).unwrap(),
            limit
        );
        let fits = choose_capacity(&c, None, plan, gib).unwrap();
        assert!(fits.is_multiple_of(128) || fits == limit, "{fits}");
        assert!(pool_bytes_at(&c, plan, fits, m).unwrap() <= gib / 10 * 9);
        let small = pool_bytes_at(&c, plan, 0, m).unwrap();
        for asked in [Some(1000), None] {
            let err = choose_capacity(&c, asked, plan, small)
                .unwrap_err()
                .to_string();
            assert!(err.contains("too little GPU memory"), "{err}");
            assert!(err.contains(&small.to_string()), "{err}");
        }
    }

    #[test]
    fn chunks_are_as_long_as_memory_and_the_asked_context_allow() {
        let c = Config::flash();
        let inter = c.moe_intermediate_size;
        let gib = 1usize << 30;
        let plan = one_gpu(inter, 0);
        let layout = |asked: Option<usize>, free| {
            let opts = GpuOptions {
                max_context: asked,
                ..context(0)
            };
            choose_layout(&c, opts, plan, free).unwrap()
        };
        assert_eq!(
            layout(Some(2 * PREFILL_CHUNK), 80 * gib).chunk,
            PREFILL_CHUNK
        );
        // A longest chunk asked for, rounded down to a power of two.
        for (most, chunk) in [
            (8192, 8192),
            (5000, 4096),
            (3, MAX_CHUNK),
            (usize::MAX, 16384),
        ] {
            let opts = GpuOptions {
                max_chunk: Some(most),
                ..context(16384)
            };
            assert_eq!(
                choose_layout(&c, opts, plan, 200 * gib).unwrap().chunk,
                chunk
            );
        }
        // No longer than the asked context needs.
        assert_eq!(layout(Some(40), 40 * gib).chunk, 64);
        assert_eq!(layout(Some(5), 40 * gib).chunk, MAX_CHUNK);
        // Activations of at most an eighth of the memory: shorter chunks where it is short.
        let extra = |chunk| {
            pool_bytes_at(&c, plan, 0, chunk).unwrap()
                - pool_bytes_at(&c, plan, 0, MAX_CHUNK).unwrap()
        };
        for free in [gib, 2 * gib, 4 * gib] {
            let l = layout(Some(4096), free);
            assert!(l.chunk < PREFILL_CHUNK && l.chunk >= MAX_CHUNK, "{l:?}");
            assert!(l.chunk == MAX_CHUNK || extra(l.chunk) <= free / 8, "{l:?}");
            assert!(extra(2 * l.chunk) > free / 8, "{l:?}");
            assert_eq!(l.capacity, 4096);
        }
        // Where only the shortest chunk leaves room for the context, that one.
        let tight = pool_bytes_at(&c, plan, 4096, MAX_CHUNK).unwrap() / 9 * 10 + 1000;
        assert_eq!(layout(Some(4096), tight).chunk, MAX_CHUNK);
    }

    #[test]
    fn random_model_plan_counts_the_bytes_of_the_synthetic_checkpoint() {
        use crate::checkpoint::Checkpoint;
        use crate::synth::{write_synthetic, SynthFormat};
        let c = Config::tiny();
        for format in [SynthFormat::Official, SynthFormat::Nvfp4, SynthFormat::Bf16] {
            let dir = tempfile::tempdir().unwrap();
            write_synthetic(&c, format, dir.path(), 1, &mut |_, _| {}).unwrap();
            let w = ModelWeights::load(&Checkpoint::open(dir.path()).unwrap(), |_, _| {}).unwrap();
            for world in [1, 2] {
                let (loaded, drawn) = (
                    crate::shard::rank_weight_bytes(&w, world) as f64,
                    random::rank_weight_bytes(&c, format, world) as f64,
                );
                // The checkpoint counts its FP8 scales as stored (e8m0), the device holds them
                // as f32 rows; everything else is the same bytes.
                assert!(
                    (drawn - loaded).abs() <= 0.01 * loaded,
                    "{format:?} over {world}: drawn {drawn} loaded {loaded}"
                );
            }
            let bytes = random::rank_weight_bytes(&c, format, 1);
            let plan = plan_random_memory(&c, format, 1, bytes + (1 << 30), context(64)).unwrap();
            assert_eq!((plan.capacity, plan.weights), (64, bytes));
            let err = plan_random_memory(&c, format, 1, bytes / 2, context(64)).unwrap_err();
            assert!(
                err.to_string().contains("bytes of weights per GPU"),
                "{err}"
            );
        }
    }

    #[test]
    fn plan_refuses_a_model_one_gpu_cannot_hold_and_says_how_many_can() {
        use crate::checkpoint::Checkpoint;
        use crate::synth::{write_synthetic, SynthFormat};
        let c = Config::tiny();
        let dir = tempfile::tempdir().unwrap();
        write_synthetic(&c, SynthFormat::Official, dir.path(), 1, &mut |_, _| {}).unwrap();
        let w = ModelWeights::load(&Checkpoint::open(dir.path()).unwrap(), |_, _| {}).unwrap();
        let (w1, w2) = (
            crate::shard::rank_weight_bytes(&w, 1),
            crate::shard::rank_weight_bytes(&w, 2),
        );
        let inter = c.moe_intermediate_size;
        let pool = |n: usize| {
            let lc = local_config(&c, n).unwrap();
            let plan = Plan {
                world: n,
                ..one_gpu(inter / n, MAX_CHUNK)
            };
            pool_bytes_at(&lc, plan, 64, MAX_CHUNK).unwrap()
        };
        // Room for a half of the split weights and the pool on each of two GPUs (the pool may
        // take 90% of what the weights leave), not for the whole on one.
        let free = w2 + pool(2) / 9 * 10 + 100;
        assert!(
            w1 + pool(1) > free,
            "the case needs the weights to outgrow one GPU"
        );
        let err = plan_memory(&c, &w, 1, free, context(64))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("{w1} bytes of weights per GPU over 1 GPU(s)"))
                && err.contains("it needs 2 GPUs of this size"),
            "{err}"
        );
        let plan = plan_memory(&c, &w, 2, free, context(64)).unwrap();
        assert_eq!((plan.world, plan.weights, plan.capacity), (2, w2, 64));
        assert!(plan.to_string().starts_with("2 GPU(s): "), "{plan}");
    }
}
