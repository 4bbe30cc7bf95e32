//! Launchers of the attention kernels (`kernels/attention.cu`, spec §5–§7): the token
//! compressors' device state, the Lightning Indexer's scores and top-k, the sink attention over
//! the sliding window and the compressed keys, and the window ring write. Positions are read
//! from the device (`pos` U32 `[1]`, the chunk's first position); a launch of T decode tokens
//! of T sequences (a batch) passes `pos` U32 `[T]` instead, one position each, and every state
//! tensor with a leading dimension of T (sequence t's state slice t), as if each token were
//! launched alone with its own state. Every count that depends on
//! the position (visible keys and entries, closing windows) is worked out inside the kernels,
//! so the launches capture into a graph that replays at any position. Nothing is read back or
//! waited for. CPU references: [`reference`].

pub mod reference;
#[cfg(test)]
mod tests;

use cudarc::driver::LaunchConfig;

use half::{bf16, f16};

use super::gemv::tuning;
use super::launch::{self, batch_flag, dim_u32, elementwise, Args};
use super::{DType, Device, DeviceElem, DeviceTensor, GpuError};

/// Launches `kernel` with `cfg` and the arguments `args` pushes, in order.
///
/// # Safety
/// The arguments and `cfg` must be what the kernel reads and writes, in bounds (each caller
/// says why).
unsafe fn launch(
    dev: &Device,
    kernel: &str,
    cfg: LaunchConfig,
    args: impl FnOnce(&mut Args),
) -> Result<(), GpuError> {
    let mut a = Args::new();
    args(&mut a);
    // SAFETY: the caller's.
    unsafe { launch::launch(dev, kernel, cfg, &a) }
}

/// `(rows, cols)` of a 2-D tensor of `dtype` whose `rows` and `cols`, where given, are those.
fn matrix<T: DeviceElem>(
    x: &DeviceTensor<T>,
    what: &str,
    dtype: DType,
    rows: Option<usize>,
    cols: Option<usize>,
) -> Result<(usize, usize), GpuError> {
    let (r, c) = x.dims2(what, dtype)?;
    x.expect(what, dtype, &[rows.unwrap_or(r), cols.unwrap_or(c)])?;
    Ok((r, c))
}

/// Named dimensions as the kernels' 32-bit integers.
fn dims_u32<const N: usize>(dims: [(&str, usize); N]) -> Result<[u32; N], GpuError> {
    let mut out = [0u32; N];
    for (o, (what, v)) in out.iter_mut().zip(dims) {
        *o = dim_u32(what, v)?;
    }
    Ok(out)
}

/// `(rows, cols)` of one sequence's state `x` (of `dtype`: F32, or F16 entries): `[rows, cols]`
/// for a chunk, `[T, rows, cols]` for a batch of T sequences (`batch`: `Some(T)`), slice t
/// sequence t's.
fn state_dims<T: DeviceElem>(
    x: &DeviceTensor<T>,
    what: &str,
    dtype: DType,
    batch: Option<usize>,
) -> Result<(usize, usize), GpuError> {
    match (batch, x.shape()) {
        (None, _) => x.dims2(what, dtype),
        (Some(b), &[n, r, c]) if n == b => {
            x.expect(what, dtype, &[n, r, c])?;
            Ok((r, c))
        }
        (Some(b), shape) => Err(GpuError::invalid(
            what,
            format!("a batch of {b} sequences needs [{b}, rows, cols], got {shape:?}"),
        )),
    }
}

/// The shape of one sequence's state of `dims` (see [`state_dims`]).
fn state_shape(batch: Option<usize>, dims: &[usize]) -> Vec<usize> {
    batch.into_iter().chain(dims.iter().copied()).collect()
}

/// The batch [`batch_flag`] reads from `pos`: `Some(T)` for T sequences a token each.
fn batch_of(
    pos: &DeviceTensor<u32>,
    t: usize,
    what: &str,
) -> Result<(u32, Option<usize>), GpuError> {
    let flag = batch_flag(pos, t, what)?;
    Ok((flag, (flag == 1).then_some(t)))
}

/// The grid's y dimension holds one block row per token: at most 65535 tokens a launch.
fn grid_tokens(what: &str, t: usize) -> Result<u32, GpuError> {
    if t > 65535 {
        return Err(GpuError::invalid(what, format!("{t} tokens in one launch")));
    }
    dim_u32("tokens", t)
}

/// The widest attention head the kernel holds (DeepSeek-V4: 512); widths are multiples of 32.
pub const MAX_HEAD_DIM: usize = 512;
/// The most indexer heads (DeepSeek-V4: 64) and the widest indexer head (128).
pub const MAX_INDEX_HEADS: usize = 64;
pub const MAX_INDEX_DIM: usize = 128;
/// The widest compressor entry (its pooled row lives in shared memory).
pub const MAX_COMPRESSOR_WIDTH: usize = 8192;

/// One compressor's per-sequence device state (zero-initialized from the pool): `kv`, `gate`
/// `[ratio, κ·c]` F32 (the open window's projections; the gate with ape added, row p % ratio),
/// `prev_kv`, `prev_gate` `[ratio, c]` F32 (A-halves of the last closed window; used only with
/// overlap, still present (any shape) without), `entries [capacity, c]` F16 (emitted entries
/// in order, each rounded to f16 as it is written; entry e pools window e).
pub struct CompressorBuffers {
    pub kv: DeviceTensor<f32>,
    pub gate: DeviceTensor<f32>,
    pub prev_kv: DeviceTensor<f32>,
    pub prev_gate: DeviceTensor<f32>,
    pub entries: DeviceTensor<f16>,
}

/// Most threads of a `compressor_emit` block (its `__launch_bounds__`): one a channel.
const EMIT_THREADS: u32 = 512;

/// Feeds T tokens' compressor projections (`proj` F32 `[T, 2·κ·c]`: each row the κ·c values,
/// then the κ·c gate logits, as one GEMV of the stacked wkv and wgate writes them; κ = 2 with
/// overlap (CSA), 1 without (HCA)) at positions pos[0].. into the state, token by token as
/// [`reference::compressor_push`] does: gate + ape[p % ratio] stored at row p % ratio; when
/// p % ratio == ratio − 1 the window closes and entry (p + 1) / ratio − 1 is written (unless it
/// is past the capacity): softmax over the gate logits (per channel) pooling the values — with
/// overlap the previous window's A-half (channels [0, c)) followed by the current window's
/// B-half (channels [c, 2c)), the previous window absent for window 0 — then RMSNorm with
/// `norm [c]` and `eps`, then RoPE (interleaved pairs on the last 2·inv_freq.len() channels,
/// forward) at position (p + 1 − ratio); with overlap the current A-halves then become prev.
/// ratio = ape.shape[0]. Two launches: the entries (rounded to f16 as they are stored), then
/// the state.
#[allow(clippy::too_many_arguments)]
pub fn compressor_update(
    dev: &Device,
    proj: &DeviceTensor<f32>,
    ape: &DeviceTensor<f32>,
    norm: &DeviceTensor<f32>,
    inv_freq: &DeviceTensor<f32>,
    eps: f32,
    overlap: bool,
    pos: &DeviceTensor<u32>,
    state: &mut CompressorBuffers,
) -> Result<(), GpuError> {
    let (t, kc2) = proj.dims2("compressor projection", DType::F32)?;
    let kc = kc2 / 2;
    let c = norm.len();
    norm.expect("compressor norm", DType::F32, &[c])?;
    let kappa = if overlap { 2 } else { 1 };
    if c == 0 || kc2 != 2 * kappa * c || c > MAX_COMPRESSOR_WIDTH {
        return Err(GpuError::invalid(
            "compressor",
            format!(
                "projection rows of {kc2} for entries of {c} (need 2·{kappa}·c, 1 ≤ c ≤ {MAX_COMPRESSOR_WIDTH})"
            ),
        ));
    }
    let (ratio, _) = matrix(ape, "compressor ape", DType::F32, None, Some(kc))?;
    if ratio == 0 {
        return Err(GpuError::invalid("compressor", "ratio 0"));
    }
    let half = inv_freq.len();
    inv_freq.expect("compressor rope inverse frequencies", DType::F32, &[half])?;
    if 2 * half > c {
        return Err(GpuError::invalid(
            "compressor",
            format!("{} rotated channels of {c}", 2 * half),
        ));
    }
    let (batch, seqs) = batch_of(pos, t, "compressor position")?;
    state.kv.expect(
        "compressor state kv",
        DType::F32,
        &state_shape(seqs, &[ratio, kc]),
    )?;
    state.gate.expect(
        "compressor state gate",
        DType::F32,
        &state_shape(seqs, &[ratio, kc]),
    )?;
    for (prev, what) in [
        (&state.prev_kv, "compressor previous kv"),
        (&state.prev_gate, "compressor previous gate"),
    ] {
        // Not read without overlap; any shape will do.
        let shape = if overlap {
            state_shape(seqs, &[ratio, c])
        } else {
            prev.shape().to_vec()
        };
        prev.expect(what, DType::F32, &shape)?;
    }
    let (cap, width) = state_dims(&state.entries, "compressor entries", DType::F16, seqs)?;
    if width != c {
        return Err(GpuError::invalid(
            "compressor entries",
            format!("entries of {width} for a norm of {c}"),
        ));
    }
    if t == 0 {
        return Ok(());
    }
    let dims = dims_u32([
        ("tokens", t),
        ("ratio", ratio),
        ("compressor width", c),
        ("rope dim", 2 * half),
        ("compressor capacity", cap),
    ])?;
    let ov = u32::from(overlap);
    let cfg = LaunchConfig {
        // At most ceil(T / ratio) windows close inside T consecutive positions; one a batch's
        // sequence.
        grid_dim: (
            if batch == 1 {
                dims[0]
            } else {
                dims[0].div_ceil(dims[1])
            },
            1,
            1,
        ),
        // A thread a channel, whole warps, up to the kernel's bound.
        block_dim: (dims[2].next_multiple_of(32).clamp(32, EMIT_THREADS), 1, 1),
        shared_mem_bytes: dims[2] * 4,
    };
    // SAFETY: proj [t, 2·kc], ape [ratio, kc], norm [c], inv_freq [half] with
    // 2·half <= c, pos [1] (a batch: [t]), state kv and gate [ratio, kc], prev [ratio, c] (read
    // only with overlap), entries [cap, c] F16 (entries >= cap are skipped), each [t, ...] in a
    // batch, checked above; c floats of dynamic shared memory (c <= 8192).
    unsafe {
        launch(dev, "compressor_emit", cfg, |b| {
            compressor_projections(b, proj, ape, &dims, ov);
            b.ptr(norm)
                .arg(eps)
                .ptr(inv_freq)
                .arg(dims[3])
                .ptr(pos)
                .ptr(&state.kv)
                .ptr(&state.gate)
                .ptr(&state.prev_kv)
                .ptr(&state.prev_gate)
                .arg(dims[4])
                .ptr(&state.entries)
                .arg(batch);
        })
    }?;
    // A batch's block rows are its sequences.
    let mut cfg = elementwise((ratio * kc) as u64);
    if batch == 1 {
        cfg.grid_dim.1 = dims[0];
    }
    // SAFETY: as above; each thread reads and writes only its own state element (and, with
    // overlap, the prev element of the same row and channel).
    unsafe {
        launch(dev, "compressor_store", cfg, |b| {
            compressor_projections(b, proj, ape, &dims, ov);
            b.ptr(pos)
                .ptr(&state.kv)
                .ptr(&state.gate)
                .ptr(&state.prev_kv)
                .ptr(&state.prev_gate)
                .arg(batch);
        })
    }
}

/// The arguments both compressor kernels start with: the tokens' projections, their count, the
/// window (ape and its shape) and the overlap flag.
fn compressor_projections(
    b: &mut Args,
    proj: &DeviceTensor<f32>,
    ape: &DeviceTensor<f32>,
    dims: &[u32; 5],
    ov: u32,
) {
    b.ptr(proj)
        .arg(dims[0])
        .ptr(ape)
        .arg(dims[1])
        .arg(dims[2])
        .arg(ov);
}

/// Entries an `index_scores` block scores at once (its 4 warps × 4 entries).
const INDEX_STEP: usize = 16;

/// `index_scores` blocks a token: one step of entries each where that gives every SM a couple
/// of blocks, else two blocks an SM, each taking every so many steps (each block stages a
/// token's queries, 32 KB, once). The steps are dealt out by the visible count, not the
/// capacity, so a short context still spreads over the whole grid.
fn index_blocks(cap: usize, sms: usize) -> usize {
    cap.div_ceil(INDEX_STEP).min(2 * sms.max(1)).max(1)
}

/// How [`index_topk`] computes its scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IndexScoring {
    /// On CUDA cores in [`reference::index_scores`]' operation order: bit-identical scores.
    Exact,
    /// On f16 tensor-core MMAs, the keys as they are and the queries split in two f16 parts
    /// (about 22 significant bits, as `attention_mma`): within 2e-5 of the terms' magnitude
    /// (the tests' bound), not bit for bit, and several times faster over a long context (what
    /// the model takes).
    /// Needs c a multiple of 16 and 128 KiB of shared memory a block for T of 4 or more; other
    /// widths, and GPUs with less, are scored [`IndexScoring::Exact`]ly.
    TensorCores,
}

/// Tokens an `index_scores_mma` block takes (`IMMA_TOKENS`).
const INDEX_MMA_TOKENS: usize = 4;

/// Lightning Indexer (spec §7) for T queries: `q [T, nh·c]` (already rotated), `weights [T, nh]`
/// (raw weights_proj outputs: the kernel multiplies them by 1/sqrt(nh) exactly as the CPU does
/// before use), over the visible entries of the indexer compressor `entries [capacity, c]` (F16,
/// as [`compressor_update`] rounds them: a key past f16's range (|x| > 65504) is infinite, the
/// model's RMS-normalised keys are about 1; the scores are those of these keys widened to F32):
/// token t sees n_vis = min((p + 1) / ratio, capacity) entries. Score of entry w:
/// Σ_h (max(q_h·K_w, 0) · (1/sqrt(c)) · w_h), computed as `scoring` says; an entry's score
/// depends only on its key and its token's queries and weights either way. `scores` F32
/// `[T, capacity]` is scratch.
/// Writes `selected` I32 `[T, k]`: the top-k entries by score (in `f32::total_cmp` order), ties
/// to the lowest index, in ascending index order as `router::reference::top_k` returns them;
/// slots past n_vis are −1 (so fewer visible than k goes through the same code).
#[allow(clippy::too_many_arguments)]
pub fn index_topk(
    dev: &Device,
    q: &DeviceTensor<f32>,
    weights: &DeviceTensor<f32>,
    entries: &DeviceTensor<f16>,
    ratio: usize,
    pos: &DeviceTensor<u32>,
    scoring: IndexScoring,
    scores: &mut DeviceTensor<f32>,
    selected: &mut DeviceTensor<i32>,
) -> Result<(), GpuError> {
    let (t, nhc) = q.dims2("indexer queries", DType::F32)?;
    let (_, nh) = matrix(weights, "indexer weights", DType::F32, Some(t), None)?;
    let (batch, seqs) = batch_of(pos, t, "indexer position")?;
    let (cap, c) = state_dims(entries, "indexer entries", DType::F16, seqs)?;
    if nh == 0
        || nh > MAX_INDEX_HEADS
        || c == 0
        || c > MAX_INDEX_DIM
        || !c.is_multiple_of(4)
        || nhc != nh * c
    {
        return Err(GpuError::invalid(
            "indexer",
            format!(
                "queries of {nhc} for {nh} heads of entries of {c} (need nh·c, \
                 1 ≤ nh ≤ {MAX_INDEX_HEADS}, c a multiple of 4 up to {MAX_INDEX_DIM})"
            ),
        ));
    }
    // The queries are read in 16-byte pieces.
    if !q.device_address().is_multiple_of(16) {
        return Err(GpuError::invalid(
            "indexer",
            "queries not on a 16-byte boundary",
        ));
    }
    if ratio == 0 {
        return Err(GpuError::invalid("indexer", "ratio 0"));
    }
    scores.expect("indexer scores", DType::F32, &[t, cap])?;
    let (_, k) = matrix(selected, "indexer selection", DType::I32, Some(t), None)?;
    if t == 0 || k == 0 {
        return Ok(());
    }
    let tokens = grid_tokens("indexer", t)?;
    let dims = dims_u32([
        ("indexer capacity", cap),
        ("indexer heads", nh),
        ("indexer head width", c),
        ("indexer ratio", ratio),
        ("indexer top-k", k),
    ])?;
    let scale = 1.0 / (c as f32).sqrt();
    let wscale = 1.0 / (nh as f32).sqrt();
    // Each MMA block's tokens' queries as two f16 parts of 64 heads x 128 channels (a batch's
    // blocks take one token each: their keys differ).
    let per_block = if seqs.is_some() { 1 } else { INDEX_MMA_TOKENS };
    let mma_shared = t.min(per_block) * 2 * MAX_INDEX_HEADS * MAX_INDEX_DIM * 2;
    let mma = scoring == IndexScoring::TensorCores
        && c.is_multiple_of(16)
        && dev.kernel_limits("index_scores_mma")?.static_shared + mma_shared
            <= dev.max_block_shared();
    if cap > 0 {
        let cfg = if mma {
            // The keys are read 16 bytes at a time.
            if !entries.device_address().is_multiple_of(16) {
                return Err(GpuError::invalid(
                    "indexer",
                    "entries not on a 16-byte boundary",
                ));
            }
            let groups = t.div_ceil(per_block);
            // As many blocks as the SMs hold at once (two an SM where a block stages one
            // token's queries: twice the keys in flight), steps of 128 entries dealt over the
            // blocks by the visible count: at most one wave while there are fewer token groups
            // than that (rounding up gave 160 blocks to 132 SMs for 128 tokens, a second wave
            // a fifth full).
            let resident = dev.resident_blocks("index_scores_mma", 256, mma_shared as u32)?;
            let across = cap
                .div_ceil(128)
                .min(resident.max(1) as usize * dev.sm_count() / groups)
                .max(1);
            LaunchConfig {
                grid_dim: (
                    dim_u32("indexer blocks", across)?,
                    dim_u32("indexer token groups", groups)?,
                    1,
                ),
                block_dim: (256, 1, 1),
                shared_mem_bytes: mma_shared as u32,
            }
        } else {
            LaunchConfig {
                grid_dim: (
                    dim_u32("indexer blocks", index_blocks(cap, dev.sm_count()))?,
                    tokens,
                    1,
                ),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            }
        };
        let kernel = if mma {
            "index_scores_mma"
        } else {
            "index_scores"
        };
        // SAFETY: q [t, nh·c] (16-byte aligned), weights [t, nh], entries [cap, c] F16 (16-byte
        // aligned for the MMA kernel, whose c % 16 == 0) with nh <= 64, c <= 128 (the
        // kernels' shared arrays; the MMA kernel's dynamic shared memory holds a block's
        // tokens' queries), pos [1] (a batch: [t], entries [t, cap, c], its blocks one token
        // each), scores [t, cap]; entries are read below the largest
        // visible count of a block's tokens (at most cap), and each token's scores are written
        // below its own.
        unsafe {
            launch(dev, kernel, cfg, |b| {
                b.ptr(q)
                    .ptr(weights)
                    .ptr(entries)
                    .arg(dims[0])
                    .arg(dims[1])
                    .arg(dims[2])
                    .arg(dims[3])
                    .ptr(pos)
                    .arg(scale)
                    .arg(wscale)
                    .ptr(scores);
                if mma {
                    b.arg(tokens);
                }
                b.arg(batch);
            })
        }?;
    }
    // Each block stages the keys of its slice of the entries in shared memory, up to `held`
    // (as many as a block may hold past the kernel's own arrays). A token's visible entries
    // are cut evenly into a cluster of up to 16 slices (sm_90+), one per SELECT_SLICE_KEYS of
    // the capacity, so a long context's select runs on 16 multiprocessors a token instead of
    // one; past 16 slices' worth of shared memory the slices reread their scores.
    let free = dev.max_block_shared() - dev.kernel_limits("index_select")?.static_shared;
    let most = free / 4;
    let mut parts = if dev.arch().has_clusters() {
        cap.div_ceil(SELECT_SLICE_KEYS.min(most).max(1))
            .clamp(1, MAX_SELECT_SLICES)
    } else {
        1
    };
    // Where no cluster of that many blocks can be resident (past the portable 8, or a
    // partitioned GPU): 8 slices, else one block rereading the scores.
    let held_for = |parts: usize| most.min(cap.div_ceil(parts)) as u32;
    let resident = |parts: usize| {
        dev.resident_clusters("index_select", 1024, 4 * held_for(parts), parts as u32)
            .map(|n| n > 0)
    };
    if parts > PORTABLE_SELECT_SLICES && !resident(parts)? {
        parts = PORTABLE_SELECT_SLICES;
    }
    if parts > 1 && !resident(parts)? {
        parts = 1;
    }
    let held = held_for(parts);
    let cfg = LaunchConfig {
        grid_dim: (tokens, parts as u32, 1),
        block_dim: (1024, 1, 1),
        shared_mem_bytes: 4 * held,
    };
    let mut args = Args::new();
    args.ptr(scores)
        .arg(dims[0])
        .arg(dims[3])
        .ptr(pos)
        .arg(dims[4])
        .ptr(selected)
        .arg(held)
        .arg(batch);
    // SAFETY: scores [t, cap] (only [0, n_vis) of each row read, n_vis <= cap), pos [1] or [t],
    // selected [t, k], `held` keys of dynamic shared memory; clusters of `parts` <= 16 blocks
    // only where the device holds them.
    unsafe { launch::launch_clustered(dev, "index_select", cfg, &args, parts as u32) }
}

/// The compressed keys a layer attends to, besides its window.
#[derive(Clone, Copy, Debug)]
pub enum Compressed<'a> {
    /// Sliding-window-only layer.
    None,
    /// HCA: every visible entry, entries [0, min((p + 1) / ratio, capacity)).
    All {
        entries: &'a DeviceTensor<f16>,
        ratio: usize,
    },
    /// CSA: the indexer's choice among `entries`, `selected` I32 [T, k], as [`index_topk`]
    /// leaves it: ids (−1 or ≥ capacity: none) in the first min(k, visible) slots, visible =
    /// min((p + 1) / ratio, capacity of `entries`); the slots past those hold −1 and are not
    /// read. So the indexer's entries must have the same capacity as these.
    Selected {
        entries: &'a DeviceTensor<f16>,
        selected: &'a DeviceTensor<i32>,
        ratio: usize,
    },
}

/// Most blocks (one cluster: the non-portable size sm_90 allows) an `index_select` of one
/// token is cut into, and the most of the portable size.
const MAX_SELECT_SLICES: usize = 16;
const PORTABLE_SELECT_SLICES: usize = 8;
/// Entries of the capacity an `index_select` cluster takes a block for (up to 16).
const SELECT_SLICE_KEYS: usize = 4096;

/// Heads an `attention_heads` block takes, keys a warp scores at once, and most splits of a
/// token's keys (kernel constants; the splits of a token are one cluster, at most the 16
/// blocks sm_90 allows).
const ATT_HEADS: usize = 4;
const ATT_BATCH: usize = 4;
const ATT_MAX_SPLITS: usize = 16;
/// Fewest keys a split is cut for (two per warp).
const MIN_SPLIT_KEYS: usize = 16;

/// Scratch of the tensor-core decode attention split over several blocks per (token, head
/// block): each split's partial state per (token, head) row. Room for `rows` (token, head,
/// split) triples; `rows = 0` never splits there. The sums are read as 16-byte vectors: `acc`
/// must start on a 16-byte boundary.
pub struct AttentionSplits {
    /// `[rows, d]` weighted value sums.
    pub acc: DeviceTensor<f32>,
    /// `[rows, 2]` running maximum and denominator.
    pub stats: DeviceTensor<f32>,
}

impl AttentionSplits {
    /// The shapes for `rows` triples of heads `d` wide: `[acc, stats]`.
    pub fn shapes(rows: usize, d: usize) -> [Vec<usize>; 2] {
        [vec![rows, d], vec![rows, 2]]
    }
}

/// Splits of each token's keys in `attention_heads`: as many as keep every block in one wave
/// (a block fills an SM's registers), each split at least [`MIN_SPLIT_KEYS`] of the most keys a
/// token may see, at most [`ATT_MAX_SPLITS`].
fn choose_splits(sms: usize, blocks: usize, max_keys: usize) -> usize {
    (sms / blocks.max(1))
        .min(max_keys / MIN_SPLIT_KEYS)
        .clamp(1, ATT_MAX_SPLITS)
}

/// Launches of at least this many tokens (a prompt chunk) run on tensor cores (f16 pairs).
const MMA_MIN_TOKENS: usize = 17;
/// Heads and keys an `attention_mma` block takes at once (`AMMA_HEADS`, `AMMA_KEYS`).
const MMA_HEADS: usize = 64;
const MMA_KEYS: usize = 32;

/// Attention of T queries `q [T, H·d]` (one shared KV head, K = V, d = head width, a multiple
/// of 32 up to [`MAX_HEAD_DIM`]) over the window and compressed keys, with a per-head sink
/// logit `sink [H]`, scale 1/sqrt(d), as [`reference::attend`]: keys are the window positions
/// max(0, p − W + 1) ..= p in order — a position ≥ pos[0] is read from this chunk's `kv [T, d]`
/// (row p − pos[0]), an older one from the ring `window [W, d]` (slot position % W, written by
/// earlier chunks) — then the compressed keys (F16, as [`compressor_update`] stores them). A
/// selected id ≥ the entries' capacity counts as none. Each head's output is rotated back to
/// the token's position (the inverse RoPE on its last `2·inv_freq.len()` channels, as
/// [`super::rows::rope_rows`] backwards) and written as BF16 to `out [T, H·d]`, the output
/// projection's input. A launch of 17 tokens or more (a prompt chunk) runs every token's heads
/// on f16 MMAs, each f32 operand as a pair of f16 parts and each product as three MMAs (about
/// 22 significant bits; two where the key is an f16 entry), the sums in f32: queries and keys
/// must lie inside f16's range (|x| < 65504), as the model's RMS-normalised ones do. In a
/// launch of fewer tokens (decode), each token's keys are split over blocks that fill the SMs
/// (the split count depends on the device and the shapes only, so a captured launch replays at
/// any position); a token that sees at least [`tuning::attention_mma_keys`] keys (decided on
/// the device) runs on the MMAs, its splits' partial states in `splits`, the others on CUDA
/// cores with exact f32 products, their splits merged in shared memory.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    dev: &Device,
    q: &DeviceTensor<f32>,
    kv: &DeviceTensor<f32>,
    window: &DeviceTensor<f32>,
    compressed: Compressed<'_>,
    sink: &DeviceTensor<f32>,
    pos: &DeviceTensor<u32>,
    inv_freq: &DeviceTensor<f32>,
    splits: &mut AttentionSplits,
    out: &mut DeviceTensor<bf16>,
) -> Result<(), GpuError> {
    let (t, hd) = q.dims2("attention queries", DType::F32)?;
    let (_, d) = matrix(kv, "attention keys", DType::F32, Some(t), None)?;
    if d == 0 || d % 32 != 0 || d > MAX_HEAD_DIM || hd % d != 0 || hd == 0 {
        return Err(GpuError::invalid(
            "attention",
            format!(
                "queries of {hd} for heads of {d} (need whole heads of a multiple of 32 up to \
                 {MAX_HEAD_DIM})"
            ),
        ));
    }
    let heads = hd / d;
    let (batch, seqs) = batch_of(pos, t, "attention position")?;
    if seqs.is_some() && t >= MMA_MIN_TOKENS {
        return Err(GpuError::invalid(
            "attention",
            format!("a batch of {t} sequences (at most {})", MMA_MIN_TOKENS - 1),
        ));
    }
    // Rows of one sequence's state, rows of d channels.
    fn rows_of<T: DeviceElem>(
        x: &DeviceTensor<T>,
        what: &str,
        dtype: DType,
        seqs: Option<usize>,
        d: usize,
    ) -> Result<usize, GpuError> {
        match state_dims(x, what, dtype, seqs)? {
            (rows, width) if width == d => Ok(rows),
            (_, width) => Err(GpuError::invalid(
                what,
                format!("rows of {width} for heads of {d}"),
            )),
        }
    }
    let w = rows_of(window, "attention window", DType::F32, seqs, d)?;
    if w == 0 {
        return Err(GpuError::invalid("attention", "an empty window ring"));
    }
    sink.expect("attention sink", DType::F32, &[heads])?;
    let half = inv_freq.len();
    inv_freq.expect("attention rope inverse frequencies", DType::F32, &[half])?;
    if 2 * half > d {
        return Err(GpuError::invalid(
            "attention",
            format!("{} rotated channels of heads of {d}", 2 * half),
        ));
    }
    let (room, _) = matrix(
        &splits.acc,
        "attention split sums",
        DType::F32,
        None,
        Some(d),
    )?;
    if !splits.acc.device_address().is_multiple_of(16) {
        return Err(GpuError::invalid(
            "attention",
            "split sums not on a 16-byte boundary",
        ));
    }
    splits
        .stats
        .expect("attention split maxima", DType::F32, &[room, 2])?;
    out.expect("attention output", DType::BF16, &[t, hd])?;
    let (mode, entries_ptr, cap, ratio, sel_ptr, k) = match compressed {
        Compressed::None => (0u32, 0u64, 0usize, 1usize, 0u64, 0usize),
        Compressed::All { entries, ratio } => {
            let cap = rows_of(entries, "attention entries", DType::F16, seqs, d)?;
            if ratio == 0 {
                return Err(GpuError::invalid("attention", "compression ratio 0"));
            }
            (1, entries.device_address(), cap, ratio, 0, 0)
        }
        Compressed::Selected {
            entries,
            selected,
            ratio,
        } => {
            let cap = rows_of(entries, "attention entries", DType::F16, seqs, d)?;
            let (_, k) = matrix(selected, "attention selection", DType::I32, Some(t), None)?;
            if ratio == 0 {
                return Err(GpuError::invalid("attention", "compression ratio 0"));
            }
            (
                2,
                entries.device_address(),
                cap,
                ratio,
                selected.device_address(),
                k,
            )
        }
    };
    // Queries and keys are copied into shared memory in 16-byte pieces (rows of d floats keep
    // the bound).
    let aligned = [
        ("queries", q.device_address()),
        ("keys", kv.device_address()),
        ("window", window.device_address()),
        ("compressed entries", entries_ptr),
    ];
    if let Some((what, _)) = aligned.iter().find(|(_, a)| !a.is_multiple_of(16)) {
        return Err(GpuError::invalid(
            "attention",
            format!("{what} not on a 16-byte boundary"),
        ));
    }
    // The output is written a channel pair (4 bytes) at a time.
    if !out.device_address().is_multiple_of(4) {
        return Err(GpuError::invalid(
            "attention",
            "output not on a 4-byte boundary",
        ));
    }
    if t == 0 {
        return Ok(());
    }
    let tokens = grid_tokens("attention", t)?;
    let scale = 1.0 / (d as f32).sqrt();
    let dims = dims_u32([
        ("window", w),
        ("attention entries", cap),
        ("compression ratio", ratio),
        ("attention top-k", k),
        ("heads", heads),
        ("head width", d),
        ("rope half", half),
    ])?;
    // The arguments both kernels take first, q through rope_half.
    let common = |b: &mut Args| {
        b.ptr(q)
            .ptr(kv)
            .ptr(window)
            .arg(dims[0])
            .arg(mode)
            .arg(entries_ptr)
            .arg(dims[1])
            .arg(dims[2])
            .arg(sel_ptr)
            .arg(dims[3])
            .ptr(sink)
            .ptr(pos)
            .arg(dims[4])
            .arg(dims[5])
            .arg(scale)
            .ptr(inv_freq)
            .arg(dims[6]);
    };
    // On tensor cores: a prompt chunk always (one block per token and 64 heads); of a few
    // tokens, those that see many keys (split over blocks that fill the SMs), where the block
    // fits the GPU's shared memory. The others run on CUDA cores, four heads a block.
    let mma_shared = 2 * (MMA_HEADS + MMA_KEYS) * (d + 8) * 2 + 2 * MMA_HEADS * (MMA_KEYS + 1) * 4;
    let mma_fits =
        dev.kernel_limits("attention_mma")?.static_shared + mma_shared <= dev.max_block_shared();
    if t >= MMA_MIN_TOKENS && !mma_fits {
        return Err(GpuError::invalid(
            "attention",
            format!(
                "head width {d}: a chunk's block needs {mma_shared} bytes of shared memory, this \
                 GPU gives {}",
                dev.max_block_shared()
            ),
        ));
    }
    // The most keys a token may see: a selection's are at most min(k, capacity).
    let max_keys = w + if mode == 1 { cap } else { k.min(cap) };
    let mma_from = if t >= MMA_MIN_TOKENS {
        0
    } else if mma_fits && max_keys >= tuning::attention_mma_keys() {
        tuning::attention_mma_keys()
    } else {
        usize::MAX
    };
    let mma_from = u32::try_from(mma_from).unwrap_or(u32::MAX);
    // SAFETY (both kernels): q [t, heads·d], kv [t, d], window [w, d] with d % 32 == 0,
    // d <= 512, w >= 1 (q, kv, window and entries on 16-byte boundaries), entries [cap, d]
    // (mode 1 reads [0, min(n_vis, cap)), mode 2 the ids in [0, cap)), window and entries
    // [t, ...] in a batch (pos [t], its token t reading slice t), selected [t, k], sink
    // [heads], pos [1], inv_freq [half] with 2·half <= d, out [t, heads·d] BF16; a block reads
    // and writes only its heads < heads and its token's row; each token is written by one of
    // the two launches (fewer keys than mma_from: attention_heads), one after the other in
    // the stream, so they never share the split scratch at once.
    if mma_from > 0 {
        let groups = heads.div_ceil(ATT_HEADS);
        // Each key load serves four heads; splits fill the SMs. A token's splits are one
        // cluster: fewer where the GPU has no clusters or cannot hold all of them at once.
        let mut s = if dev.arch().has_clusters() && tuning::ATTENTION_SPLITS.get() {
            choose_splits(dev.sm_count(), t * groups, max_keys)
        } else {
            1
        };
        // Each of the 8 warps' ring of buffers of ATT_BATCH keys, later their states of
        // ATT_HEADS heads, in shared memory (the first launch opts the kernel in past 48 KiB):
        // two buffers where they fit (H100, bench4 after 1M positions: 1.895 ms/token with
        // two, 2.085 with one), else one.
        let stage =
            |ring: usize| 8 * (ring * ATT_BATCH).max(ATT_HEADS) * d * std::mem::size_of::<f32>();
        let limits = dev.kernel_limits("attention_heads")?;
        let fits = |ring: usize| limits.static_shared + stage(ring) <= dev.max_block_shared();
        let ring = if fits(2) && tuning::ATTENTION_DOUBLE_BUFFER.get() {
            2
        } else {
            1
        };
        let stage_bytes = stage(ring);
        if !fits(ring) {
            return Err(GpuError::invalid(
                "attention",
                format!(
                    "head width {d}: a block needs {} bytes of shared memory, this GPU gives {}",
                    limits.static_shared + stage_bytes,
                    dev.max_block_shared()
                ),
            ));
        }
        while s > 1
            && (dev.resident_clusters("attention_heads", 256, stage_bytes as u32, s as u32)?
                as usize)
                < t * groups
        {
            s -= 1;
        }
        let cfg = LaunchConfig {
            grid_dim: (
                dim_u32("head groups", groups)?,
                dim_u32("splits", s)?,
                tokens,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: stage_bytes as u32,
        };
        let mut args = Args::new();
        common(&mut args);
        args.ptr(out).arg(ring as u32).arg(batch).arg(mma_from);
        // SAFETY: above; clusters of s <= 16 blocks only where the device holds them.
        unsafe { launch::launch_clustered(dev, "attention_heads", cfg, &args, s as u32) }?;
    }
    if mma_from == u32::MAX {
        return Ok(());
    }
    let head_blocks = heads.div_ceil(MMA_HEADS);
    // Splits of a decode token fill the SMs: at most one block an SM, one wave.
    let mut s = if t >= MMA_MIN_TOKENS {
        1
    } else {
        (dev.sm_count() / (head_blocks * t))
            .min(max_keys.div_ceil(MMA_KEYS))
            .min(room / (t * heads))
            .max(1)
    };
    // Pairs of splits merge in a cluster of two before the split states go out (half the
    // states to write and merge), where the GPU holds every pair of the wave at once.
    let pairs = s >= 2
        && dev.arch().has_clusters()
        && tuning::ATTENTION_SPLITS.get()
        && 2 * dev.resident_clusters("attention_mma", 512, mma_shared as u32, 2)? as usize
            >= head_blocks * t * (s - s % 2);
    if pairs {
        s -= s % 2;
    }
    let cfg = LaunchConfig {
        grid_dim: (
            dim_u32("head blocks", head_blocks)?,
            dim_u32("splits", s)?,
            tokens,
        ),
        block_dim: (512, 1, 1),
        shared_mem_bytes: mma_shared as u32,
    };
    let mut args = Args::new();
    common(&mut args);
    args.ptr(&splits.acc)
        .ptr(&splits.stats)
        .ptr(out)
        .arg(batch)
        .arg(mma_from)
        .arg(u32::from(pairs));
    // SAFETY: above; with s > 1, t·heads·s <= room rows of the split sums and stats.
    unsafe {
        launch::launch_clustered(dev, "attention_mma", cfg, &args, if pairs { 2 } else { 1 })
    }?;
    if s == 1 {
        return Ok(());
    }
    // The split tokens' merge: a block per (head, channel chunk of up to 4, token), its
    // states' factors and the thread groups' sums in shared memory.
    let splits_u32 = dim_u32("splits", s)?;
    let cfg = LaunchConfig {
        grid_dim: (dims[4], 4, tokens),
        block_dim: (512, 1, 1),
        shared_mem_bytes: (2 * s.next_multiple_of(4) * 4 + 512 * 16) as u32,
    };
    let mut args = Args::new();
    args.ptr(pos)
        .arg(batch)
        .arg(dims[4])
        .arg(dims[5])
        .arg(dims[0])
        .arg(mode)
        .arg(dims[1])
        .arg(dims[2])
        .arg(dims[3])
        .ptr(sink)
        .ptr(inv_freq)
        .arg(dims[6])
        .ptr(&splits.acc)
        .ptr(&splits.stats)
        .arg(splits_u32)
        .arg(u32::from(pairs))
        .arg(mma_from)
        .ptr(out);
    // SAFETY: reads the states attention_mma wrote above (t·heads·s <= room rows) for the
    // tokens it split, writes their rows of out [t, heads·d].
    unsafe { launch::launch(dev, "attention_merge", cfg, &args) }
}

/// After attention: writes this chunk's keys `kv [T, d]` into the ring `window [W, d]` at slots
/// (pos[0] + t) % W, only the last min(T, W) rows (so no two rows of a launch share a slot); a
/// batch's (`pos [T]`, `window [T, W, d]`) each into its own ring at pos[t] % W.
pub fn window_write(
    dev: &Device,
    kv: &DeviceTensor<f32>,
    pos: &DeviceTensor<u32>,
    window: &mut DeviceTensor<f32>,
) -> Result<(), GpuError> {
    let (t, d) = kv.dims2("window keys", DType::F32)?;
    let (batch, seqs) = batch_of(pos, t, "window position")?;
    let (w, width) = state_dims(window, "window ring", DType::F32, seqs)?;
    if width != d || w == 0 {
        return Err(GpuError::invalid(
            "window ring",
            format!("a ring of {w} rows of {width} for keys of {d}"),
        ));
    }
    let total = (if batch == 1 { t } else { t.min(w) } * d) as u64;
    if total == 0 {
        return Ok(());
    }
    let dims = dims_u32([("tokens", t), ("head width", d), ("window", w)])?;
    // SAFETY: kv [t, d], window [w, d] with w >= 1, pos [1] (a batch: window [t, w, d], pos
    // [t]).
    unsafe {
        launch(dev, "window_write", elementwise(total), |b| {
            b.ptr(kv)
                .arg(dims[0])
                .arg(dims[1])
                .ptr(pos)
                .arg(dims[2])
                .ptr(window)
                .arg(batch);
        })
    }
}
