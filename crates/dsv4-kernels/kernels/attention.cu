// Attention of the decode / chunked-prefill step (spec §5-§7), everything positional read from
// the device: `pos[0]` is the position of the chunk's first token, token t of the chunk sits at
// p = pos[0] + t. Shapes and capacities are launch constants; counts that depend on the
// position (visible window keys, visible compressed entries, closing compressor windows) are
// worked out inside the kernels, so a captured graph replays at any position.
// Every kernel also runs a batch (`batch` != 0, see token_pos; attention_mma of fewer than 17
// tokens): token t is its own sequence's one token at pos[t], that sequence's state (window
// ring, compressor rows, entries) slice t of each state buffer, as if each token were launched
// alone as a chunk; a PARKED token's state is left as it is.
//
// - compressor_emit / compressor_store: the token compressors (spec §6). emit writes the entry
//   of every window that closes inside the chunk (one block per closing window), reading each
//   window row from the chunk's projections or from the state of earlier chunks; store then
//   moves the chunk's rows (and, with overlap, the A-halves of the last closed window) into
//   the state. Two launches, so no block reads a state row another one overwrites.
// - index_scores / index_select: the Lightning Indexer (spec §7). Scores are computed with the
//   CPU's operation order (sequential dot products, sequential sum over heads), so they are
//   bit-identical to the CPU reference; the top-k is a 4-pass 8-bit radix select over the
//   total-order key of the float bits (the order of f32::total_cmp), then a compaction in index
//   order that takes the lowest indices among the keys equal to the threshold; one block per
//   token, or past a block's shared memory a cluster of blocks, each on a slice of the entries.
// - attention_heads: sink softmax over the window ∪ compressed keys (K = V) for four heads of
//   one token per block, the token's keys split over a cluster of blocks when few blocks would
//   run; 8 warps take interleaved keys with an online softmax each, the warps' and then (over
//   the cluster's shared memory) the splits' states merge in a fixed order (so the result does
//   not depend on timing), and the output is rotated back and written in bf16.
// - attention_mma: the same on tensor cores, a block per token and 64 heads: a prompt chunk's
//   tokens, and a decode token that sees many keys (split over blocks whose states
//   attention_merge, launched after it, merges).
// - window_write: the chunk's keys into the sliding-window ring.
#include "dsv4_common.cuh"

using namespace dsv4;

#define NEG_INF __uint_as_float(0xff800000u)
#define NEG_ZERO __uint_as_float(0x80000000u)

// ---------------------------------------------------------------------------------------------
// Compressor
// ---------------------------------------------------------------------------------------------

// The chunk's compressor projections are rows of 2 κc: the κc values, then the κc gate logits.

// Gate logit and value of window row r (position q) at channel `ch` of the κc-wide rows: from
// the chunk's projections when q >= pos0 (gate + ape[r], one rounding as on the CPU), else
// from the open-window state written by earlier chunks (its gate already holds ape).
__device__ __forceinline__ void comp_row(u32 q, u32 r, u32 ch, u32 pos0, u32 kc, const float* __restrict__ proj,
                                         const float* __restrict__ ape, const float* __restrict__ st_kv,
                                         const float* __restrict__ st_gate, float& z, float& v) {
    if (q >= pos0) {
        const u64 i = (u64)(q - pos0) * 2u * kc + ch;
        v = proj[i];
        z = __fadd_rn(proj[i + kc], ape[(u64)r * kc + ch]);
    } else {
        v = st_kv[(u64)r * kc + ch];
        z = st_gate[(u64)r * kc + ch];
    }
}

// Slot i of entry e's pooling at channel j (0 <= j < c): slots [0, ratio) are the previous
// window's rows through their A-half (from the chunk, from the open-window state when that
// window closes inside this chunk, else from prev_*), slots [ratio, 2 ratio) this window's rows
// through their B-half (the whole row without overlap, b_off = 0).
__device__ __forceinline__ void comp_slot(u32 i, u32 j, u32 ws, u32 ratio, u32 c, u32 kc, u32 b_off, u32 pos0,
                                          bool prev_in_state, const float* __restrict__ proj,
                                          const float* __restrict__ ape,
                                          const float* __restrict__ st_kv, const float* __restrict__ st_gate,
                                          const float* __restrict__ prev_kv, const float* __restrict__ prev_gate,
                                          float& z, float& v) {
    if (i >= ratio) {
        const u32 r = i - ratio;
        comp_row(ws + r, r, b_off + j, pos0, kc, proj, ape, st_kv, st_gate, z, v);
        return;
    }
    const u32 q = ws - ratio + i;
    if (q >= pos0 || prev_in_state) {
        comp_row(q, i, j, pos0, kc, proj, ape, st_kv, st_gate, z, v);
    } else {
        z = prev_gate[(u64)i * c + j];
        v = prev_kv[(u64)i * c + j];
    }
}

// Window rows compressor_emit reads at once per channel.
#define EMIT_BATCH 8u
// Threads whose order compressor_emit's norm sums in.
#define EMIT_NORM_THREADS 256u

// One block per window that closes inside the chunk (block b: the b-th closing position; in a
// batch, block b per sequence b), a thread per channel (up to 512): each thread's channels
// are a chain of dependent passes over the window's rows, so more threads take HCA's 128-row
// window sooner (H100, 264 -> 137 us with 512 threads instead of 256).
// Entry e = (p + 1) / ratio - 1 pools, per channel j, the softmax of the gate logits over the
// window's rows (with overlap: the previous window's A-half rows first, then this window's
// B-half rows; no previous half for e = 0) weighting the values, with the CPU's order of
// operations (max, then the sum of exp, then the sum of value * (exp / sum)). Then the
// weighted RMSNorm over c channels and the forward RoPE at position e * ratio on the last
// rope_dim channels, rounded to f16 (half the bytes of F32 to keep and to read; the
// attention's and the indexer's MMAs take them as they are). Entries past `cap` are not
// written. Dynamic shared memory: c floats.
DSV4_KERNEL void __launch_bounds__(512) compressor_emit(const float* __restrict__ proj, u32 tokens,
                                                        const float* __restrict__ ape, u32 ratio, u32 c, u32 overlap,
                                                        const float* __restrict__ norm, float eps,
                                                        const float* __restrict__ inv_freq, u32 rope_dim,
                                                        const u32* __restrict__ pos, const float* __restrict__ st_kv,
                                                        const float* __restrict__ st_gate,
                                                        const float* __restrict__ prev_kv,
                                                        const float* __restrict__ prev_gate, u32 cap,
                                                        u16* __restrict__ entries, u32 batch) {
    pdl_enter();
    extern __shared__ float pooled[];
    __shared__ float scratch[32];
    const u32 kc = overlap ? 2u * c : c;
    // A batch's block b takes sequence b's token, a chunk of one.
    u32 block = blockIdx.x;
    if (batch) {
        pos += block;
        proj += (u64)block * 2u * kc;
        st_kv += (u64)block * ratio * kc;
        st_gate += (u64)block * ratio * kc;
        prev_kv += (u64)block * ratio * c;
        prev_gate += (u64)block * ratio * c;
        entries += (u64)block * cap * c;
        tokens = 1u;
        block = 0u;
    }
    const u32 pos0 = pos[0];
    if (batch && pos0 == PARKED) return;
    const u32 first = (ratio - 1u - pos0 % ratio);  // chunk offset of the first closing token
    const u32 off = first + block * ratio;
    if (off >= tokens) return;
    const u32 p = pos0 + off;
    const u32 e = (p + 1u) / ratio - 1u;
    if (e >= cap) return;
    const u32 ws = e * ratio;  // first position of window e
    const u32 b_off = overlap ? c : 0u;
    const bool has_prev = overlap && e > 0u;
    // Window e - 1 closed before this chunk (its A-halves moved to prev_*) unless it closes
    // inside it (ws - 1 >= pos0), in which case its older rows are still the open-window state.
    const bool prev_in_state = has_prev && ws - 1u >= pos0;

    // Three passes over the window's rows per channel (the maximum, the sum of exp, the
    // weighted values), each reading EMIT_BATCH rows at once (all in flight together) and then
    // folding them in row order. Rows that fit one batch (CSA's) are read once for all three.
    const u32 s0 = has_prev ? 0u : ratio, s1 = 2u * ratio;
    const bool one_batch = s1 - s0 <= EMIT_BATCH;
    for (u32 j = threadIdx.x; j < c; j += blockDim.x) {
        float mx = NEG_INF, sum = NEG_ZERO, o = NEG_ZERO;
        float z[EMIT_BATCH], v[EMIT_BATCH];
        for (u32 pass = 0; pass < 3u; pass++) {
            for (u32 i0 = s0; i0 < s1; i0 += EMIT_BATCH) {
#pragma unroll
                for (u32 u = 0; u < EMIT_BATCH; u++)
                    if (i0 + u < s1 && (pass == 0u || !one_batch))
                        comp_slot(i0 + u, j, ws, ratio, c, kc, b_off, pos0, prev_in_state, proj, ape, st_kv, st_gate,
                                  prev_kv, prev_gate, z[u], v[u]);
#pragma unroll
                for (u32 u = 0; u < EMIT_BATCH; u++) {
                    if (i0 + u >= s1) break;
                    if (pass == 0u) {
                        mx = fmaxf(mx, z[u]);
                        continue;
                    }
                    const float e = expf(__fsub_rn(z[u], mx));
                    if (pass == 1u) sum = __fadd_rn(sum, e);
                    else o = __fadd_rn(o, __fmul_rn(v[u], __fdiv_rn(e, sum)));
                }
            }
        }
        pooled[j] = o;
    }
    // Weighted RMSNorm: out = norm * (x * r), r = 1 / sqrt(mean(x^2) + eps). The sum of squares
    // in the order of EMIT_NORM_THREADS threads whatever the block's size (the others add
    // zeros), so the entry's bits do not depend on it.
    __syncthreads();
    float ss = 0.0f;
    if (threadIdx.x < EMIT_NORM_THREADS)
        for (u32 j = threadIdx.x; j < c; j += EMIT_NORM_THREADS) ss = __fadd_rn(ss, __fmul_rn(pooled[j], pooled[j]));
    ss = block_sum(ss, scratch);
    const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)c), eps)));
    for (u32 j = threadIdx.x; j < c; j += blockDim.x) pooled[j] = __fmul_rn(norm[j], __fmul_rn(pooled[j], inv));
    __syncthreads();
    // RoPE at the window's first position, then the entry out.
    const u32 rope_start = c - rope_dim;
    for (u32 i = threadIdx.x; i < rope_dim / 2u; i += blockDim.x)
        rope_pair(pooled + rope_start + 2u * i, ws, inv_freq[i], 1.0f);
    __syncthreads();
    u16* dst = entries + (u64)e * c;
    for (u32 j = threadIdx.x; j < c; j += blockDim.x) dst[j] = f32_to_f16(pooled[j]);
}

// After compressor_emit: one thread per state element (row r, channel j of the κc-wide rows).
// With overlap, when a window closed inside the chunk, prev_* (j < c) takes the A-half of
// row r of the last such window, from the chunk or from the old state element this same
// thread reads before overwriting it. Then row r takes the chunk's last token at a position
// ≡ r (mod ratio), if any (gate + ape).
DSV4_KERNEL void compressor_store(const float* __restrict__ proj, u32 tokens, const float* __restrict__ ape, u32 ratio, u32 c, u32 overlap,
                                  const u32* __restrict__ pos, float* __restrict__ st_kv,
                                  float* __restrict__ st_gate, float* __restrict__ prev_kv,
                                  float* __restrict__ prev_gate, u32 batch) {
    pdl_enter();
    const u32 kc = overlap ? 2u * c : c;
    const u64 total = (u64)ratio * kc;
    // A batch's block row y takes sequence y's token, a chunk of one.
    if (batch) {
        const u32 b = blockIdx.y;
        pos += b;
        proj += (u64)b * 2u * kc;
        st_kv += (u64)b * total;
        st_gate += (u64)b * total;
        prev_kv += (u64)b * ratio * c;
        prev_gate += (u64)b * ratio * c;
        tokens = 1u;
        if (pos[0] == PARKED) return;
    }
    const u32 pos0 = pos[0];
    const u32 first = ratio - 1u - pos0 % ratio;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        const u32 r = (u32)(i / kc);
        const u32 j = (u32)(i % kc);
        if (overlap && j < c && first < tokens) {
            const u32 last = first + (tokens - 1u - first) / ratio * ratio;  // chunk offset
            const u32 ws = pos0 + last + 1u - ratio;
            const u32 q = ws + r;
            float z, v;
            comp_row(q, r, j, pos0, kc, proj, ape, st_kv, st_gate, z, v);
            prev_kv[(u64)r * c + j] = v;
            prev_gate[(u64)r * c + j] = z;
        }
        // The last chunk offset t with (pos0 + t) % ratio == r.
        const u32 o = (r + ratio - pos0 % ratio) % ratio;  // first such offset
        if (o < tokens) {
            const u32 t = o + (tokens - 1u - o) / ratio * ratio;
            const u64 src = (u64)t * 2u * kc + j;
            st_kv[i] = proj[src];
            st_gate[i] = __fadd_rn(proj[src + kc], ape[i]);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Lightning Indexer
// ---------------------------------------------------------------------------------------------

#define IDX_THREADS 128u
#define IDX_WARPS (IDX_THREADS / 32u)
#define IDX_EPW 4u        // entries a warp scores at once
#define IDX_MAX_HEADS 64u
#define IDX_MAX_C 128u

// Block (x, t): steps of 16 entries x, x + gridDim.x, ... below n_vis for token t, so that the
// visible entries spread over the whole grid however few of the capacity they are. q_t sits
// in shared memory as [c][nh + 1] (the pad keeps the transposing stores off one bank); a warp
// stages 4 entries (f16 keys, widened exactly) as [c][4] and each lane computes, for heads
// lane and lane + 32, the four dot products sequentially over the channels (the CPU's order).
// The terms
// max(dot, 0) * scale * w_h (w_h = weight * wscale, rounded as on the CPU) go to shared memory
// and lanes 0..3 sum one entry's terms in head order, so scores are bit-identical to the CPU.
DSV4_KERNEL void __launch_bounds__(IDX_THREADS) index_scores(const float* __restrict__ q,
                                                             const float* __restrict__ weights,
                                                             const u16* __restrict__ entries, u32 cap, u32 nh,
                                                             u32 c, u32 ratio, const u32* __restrict__ pos,
                                                             float scale, float wscale, float* __restrict__ scores,
                                                             u32 batch) {
    pdl_enter();
    __shared__ float q_s[IDX_MAX_C * (IDX_MAX_HEADS + 1u)];
    __shared__ float4 k_s[IDX_WARPS][IDX_MAX_C];
    __shared__ float terms[IDX_WARPS][IDX_EPW][IDX_MAX_HEADS];
    __shared__ float w_s[IDX_MAX_HEADS];
    const u32 t = blockIdx.y;
    const u32 p = token_pos(pos, t, batch);
    if (batch) entries += (u64)t * cap * c;
    const u32 n_vis = min((p + 1u) / ratio, cap);
    constexpr u32 STEP = IDX_WARPS * IDX_EPW;
    if (blockIdx.x * STEP >= n_vis) return;
    const float* qt = q + (u64)t * nh * c;
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    // The token's queries, 16-byte pieces (4 channels of one head; c % 4 == 0) eight at a time
    // in flight per thread, transposed into q_s.
    const float4* q4 = reinterpret_cast<const float4*>(qt);
    for (u32 i0 = threadIdx.x; i0 < nh * c / 4u; i0 += 8u * IDX_THREADS) {
        float4 v[8];
#pragma unroll
        for (u32 u = 0; u < 8u; u++) {
            const u32 i = i0 + u * IDX_THREADS;
            v[u] = i < nh * c / 4u ? q4[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
#pragma unroll
        for (u32 u = 0; u < 8u; u++) {
            const u32 i = i0 + u * IDX_THREADS;
            if (i >= nh * c / 4u) break;
            const u32 h = 4u * i / c, ch = 4u * i % c;
            q_s[ch * (nh + 1u) + h] = v[u].x;
            q_s[(ch + 1u) * (nh + 1u) + h] = v[u].y;
            q_s[(ch + 2u) * (nh + 1u) + h] = v[u].z;
            q_s[(ch + 3u) * (nh + 1u) + h] = v[u].w;
        }
    }
    for (u32 h = threadIdx.x; h < nh; h += blockDim.x) w_s[h] = __fmul_rn(weights[(u64)t * nh + h], wscale);
    __syncthreads();
    float* out = scores + (u64)t * cap;
    for (u32 e0 = blockIdx.x * STEP + warp * IDX_EPW; e0 < n_vis; e0 += gridDim.x * STEP) {
        // Stage entries e0..e0+3 (missing ones as zeros; their scores are not written).
        for (u32 ch = lane; ch < c; ch += 32u) {
            float v[IDX_EPW];
#pragma unroll
            for (u32 x = 0; x < IDX_EPW; x++) v[x] = e0 + x < n_vis ? f16_to_f32(entries[(u64)(e0 + x) * c + ch]) : 0.0f;
            k_s[warp][ch] = make_float4(v[0], v[1], v[2], v[3]);
        }
        __syncwarp();
#pragma unroll
        for (u32 hh = 0; hh < 2u; hh++) {
            const u32 h = lane + 32u * hh;
            if (h >= nh) break;
            float d0 = NEG_ZERO, d1 = NEG_ZERO, d2 = NEG_ZERO, d3 = NEG_ZERO;
            for (u32 ch = 0; ch < c; ch++) {
                const float qv = q_s[ch * (nh + 1u) + h];
                const float4 k = k_s[warp][ch];
                d0 = __fadd_rn(d0, __fmul_rn(qv, k.x));
                d1 = __fadd_rn(d1, __fmul_rn(qv, k.y));
                d2 = __fadd_rn(d2, __fmul_rn(qv, k.z));
                d3 = __fadd_rn(d3, __fmul_rn(qv, k.w));
            }
            const float w = w_s[h];
            terms[warp][0][h] = __fmul_rn(__fmul_rn(fmaxf(d0, 0.0f), scale), w);
            terms[warp][1][h] = __fmul_rn(__fmul_rn(fmaxf(d1, 0.0f), scale), w);
            terms[warp][2][h] = __fmul_rn(__fmul_rn(fmaxf(d2, 0.0f), scale), w);
            terms[warp][3][h] = __fmul_rn(__fmul_rn(fmaxf(d3, 0.0f), scale), w);
        }
        __syncwarp();
        if (lane < IDX_EPW && e0 + lane < n_vis) {
            float s = NEG_ZERO;
            for (u32 h = 0; h < nh; h++) s = __fadd_rn(s, terms[warp][lane][h]);
            out[e0 + lane] = s;
        }
        __syncwarp();  // k_s and terms are rewritten by the next step
    }
}

#define SEL_THREADS 1024u
#define SEL_BATCH 8u   // keys a thread loads at once
#define SEL_STAGE 16u  // scores a thread loads at once in the first pass
#define SEL_MAX_PARTS 16u  // most blocks of a token's cluster (MAX_SELECT_SLICES in dsv4_ops)

// Ascending in the order of f32::total_cmp (-NaN < -inf < ... < -0 < +0 < ... < +inf < +NaN).
__device__ __forceinline__ u32 order_key(float x) {
    const u32 u = __float_as_uint(x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// selected[t, :] = the k largest of scores[t, 0..n_vis) in ascending index order (ties to
// the lowest index), -1 past n_vis when n_vis < k. One cluster of gridDim.y blocks per token
// (gridDim.y = 1: one block): block r takes the r-th of gridDim.y contiguous slices of the
// entries. The threshold key is found by a radix select (4 passes of 8 bits over the keys;
// the first counts the scores as it reads them, staging them in shared memory when the slice
// fits there; integer histograms, order-independent, summed over the cluster's blocks through
// distributed shared memory, a bin a thread with all the blocks' loads in flight at once; the
// bin found by a warp-wide scan, in every block alike; two histogram buffers used in turn, so
// one cluster barrier a pass orders both a pass's sums after every block's counts and the
// other buffer's clearing, for the next pass, after every block's sums of the pass before);
// then each warp takes a contiguous index range of its block's slice, 32 consecutive keys a
// step (distinct banks when staged, coalesced loads when not), counts the keys above and
// equal to the threshold by ballots, scans of those counts (over the block's warps, then over
// the blocks before it) give each range's first output slot, and the keys equal to the
// threshold are taken in index order until the count still needed is reached.
DSV4_KERNEL void __launch_bounds__(SEL_THREADS) index_select(const float* __restrict__ scores, u32 cap, u32 ratio,
                                                             const u32* __restrict__ pos, u32 k,
                                                             int* __restrict__ selected, u32 held_cap, u32 batch) {
    constexpr u32 warps = SEL_THREADS / 32u;
    __shared__ u32 hist[2][256];
    __shared__ __align__(16) u32 total_s[256];
    __shared__ u32 wgt_s[warps], weq_s[warps];  // the warps' counts, then the counts before them
    __shared__ u32 sh_prefix, sh_krem;
    __shared__ u32 total_gt, total_eq;  // the block's counts, read by the later blocks
    for (u32 b = threadIdx.x; b < 256u; b += blockDim.x) hist[0][b] = 0u;
    pdl_enter();
    const u32 t = blockIdx.x, rank = blockIdx.y, parts = gridDim.y;
    const u32 p = token_pos(pos, t, batch);
    const u32 n = min((p + 1u) / ratio, cap);
    int* out = selected + (u64)t * k;
    if (n <= k) {  // the same for every block of the cluster
        if (rank == 0u)
            for (u32 i = threadIdx.x; i < k; i += blockDim.x) out[i] = i < n ? (int)i : -1;
        return;
    }
    const u32 per = (n + parts - 1u) / parts;
    const u32 first = min(rank * per, n);
    const u32 m = min(first + per, n) - first;  // the block's slice: [first, first + m)
    const float* s = scores + (u64)t * cap + first;
    const u32 lane = threadIdx.x % 32u, warp = threadIdx.x / 32u;
    // The first pass: the slice's scores counted as they are read (SEL_STAGE loads a thread in
    // flight at once) and kept as keys in shared memory when they fit there (held_cap keys),
    // else reread from the scores by the later passes and the gather.
    extern __shared__ u32 keys_s[];
    const bool held = m <= held_cap;
    __syncthreads();  // hist[0] is clear
    for (u32 i0 = threadIdx.x; i0 < m; i0 += SEL_STAGE * blockDim.x) {
        float v[SEL_STAGE];
#pragma unroll
        for (u32 j = 0; j < SEL_STAGE; j++) v[j] = i0 + j * blockDim.x < m ? s[i0 + j * blockDim.x] : 0.0f;
#pragma unroll
        for (u32 j = 0; j < SEL_STAGE; j++) {
            if (i0 + j * blockDim.x >= m) break;
            const u32 key = order_key(v[j]);
            if (held) keys_s[i0 + j * blockDim.x] = key;
            atomicAdd(&hist[0][key >> 24], 1u);
        }
    }
    const auto key_at = [&](u32 i) { return held ? keys_s[i] : order_key(s[i]); };
    // Keys are read SEL_BATCH at a time per thread, all of a batch's loads in flight before
    // any is used: i0, i0 + step, ... (those below end).
    const auto load_keys = [&](u32 i0, u32 step, u32 end, u32 (&kk)[SEL_BATCH]) {
#pragma unroll
        for (u32 j = 0; j < SEL_BATCH; j++) kk[j] = i0 + j * step < end ? key_at(i0 + j * step) : 0u;
    };
    u32 prefix = 0u, mask = 0u, krem = k;
    for (int shift = 24, pass = 0; shift >= 0; shift -= 8, pass++) {
        if (pass > 0) {
            for (u32 i0 = threadIdx.x; i0 < m; i0 += SEL_BATCH * blockDim.x) {
                u32 kk[SEL_BATCH];
                load_keys(i0, blockDim.x, m, kk);
#pragma unroll
                for (u32 j = 0; j < SEL_BATCH; j++)
                    if (i0 + j * blockDim.x < m && (kk[j] & mask) == prefix)
                        atomicAdd(&hist[pass & 1][(kk[j] >> shift) & 255u], 1u);
            }
        }
        // Every block's histogram is complete (and its staged keys); every block has read the
        // other buffer's sums of the pass before, so it may be cleared for the next pass (the
        // block barrier after the sums orders that before the next pass's counts).
        cluster_sync();
        if (threadIdx.x < 256u) {
            u32 c[SEL_MAX_PARTS], sum = 0u;
#pragma unroll
            for (u32 r = 0; r < SEL_MAX_PARTS; r++) c[r] = r < parts ? cluster_peer(&hist[pass & 1][threadIdx.x], r) : 0u;
#pragma unroll
            for (u32 r = 0; r < SEL_MAX_PARTS; r++) sum += c[r];
            total_s[threadIdx.x] = sum;
            hist[(pass + 1) & 1][threadIdx.x] = 0u;
        }
        __syncthreads();
        // Warp 0 finds the bin holding the krem-th largest key: lane l takes bins 255 - 8l - j
        // (j = 0..7, descending; two 16-byte reads a lane); a scan over the lanes counts the
        // keys above each lane's bins.
        if (threadIdx.x < 32u) {
            const uint4 lo4 = reinterpret_cast<const uint4*>(total_s)[62u - 2u * lane];
            const uint4 hi4 = reinterpret_cast<const uint4*>(total_s)[63u - 2u * lane];
            const u32 c[8] = {hi4.w, hi4.z, hi4.y, hi4.x, lo4.w, lo4.z, lo4.y, lo4.x};
            u32 sum = 0u;
#pragma unroll
            for (u32 j = 0; j < 8u; j++) sum += c[j];
            const u32 incl = warp_inclusive_sum(sum);
            u32 above = incl - sum;
            bool found = !(above < krem && krem <= incl);
#pragma unroll
            for (u32 j = 0; j < 8u; j++) {
                if (!found && above + c[j] >= krem) {
                    sh_prefix = prefix | ((255u - 8u * lane - j) << shift);
                    sh_krem = krem - above;
                    found = true;
                }
                above += c[j];
            }
        }
        __syncthreads();
        prefix = sh_prefix;
        krem = sh_krem;
        mask |= 255u << shift;
    }
    // `prefix` is the k-th largest key; every larger key is taken, and the first `krem` equal
    // ones. Warp w's range [lo, hi), read 32 keys a step (lane l key i0 + l) and SEL_BATCH
    // steps at once.
    const u32 chunk = (m + warps - 1u) / warps;
    const u32 lo = min(warp * chunk, m), hi = min(lo + chunk, m);
    constexpr u32 span = 32u * SEL_BATCH;
    u32 gt = 0u, eq = 0u;
    for (u32 i0 = lo; i0 < hi; i0 += span) {
        u32 kk[SEL_BATCH];
        load_keys(i0 + lane, 32u, hi, kk);
#pragma unroll
        for (u32 j = 0; j < SEL_BATCH; j++) {
            const bool in = i0 + 32u * j + lane < hi;
            gt += __popc(__ballot_sync(0xffffffffu, in && kk[j] > prefix));
            eq += __popc(__ballot_sync(0xffffffffu, in && kk[j] == prefix));
        }
    }
    if (lane == 0u) {
        wgt_s[warp] = gt;
        weq_s[warp] = eq;
    }
    __syncthreads();
    if (warp == 0u) {  // the counts of the warps before each warp, and the block's
        const u32 g = wgt_s[lane], e = weq_s[lane];
        const u32 gi = warp_inclusive_sum(g), ei = warp_inclusive_sum(e);
        wgt_s[lane] = gi - g;
        weq_s[lane] = ei - e;
        if (lane == 31u) {
            total_gt = gi;
            total_eq = ei;
        }
    }
    static_assert(warps == 32u, "a lane per warp of the block");
    cluster_sync();
    // The counts of the blocks before this one (earlier indices): lane r reads block r's.
    const bool before = lane < rank;
    const u32 gt_before = warp_sum(before ? cluster_peer(&total_gt, lane) : 0u);
    const u32 eq_before = warp_sum(before ? cluster_peer(&total_eq, lane) : 0u);
    u32 eq_seen = eq_before + weq_s[warp];
    u32 slot = gt_before + wgt_s[warp] + min(eq_seen, krem);
    const u32 below = (1u << lane) - 1u;  // the lanes before this one
    for (u32 i0 = lo; i0 < hi; i0 += span) {
        u32 kk[SEL_BATCH];
        load_keys(i0 + lane, 32u, hi, kk);
#pragma unroll
        for (u32 j = 0; j < SEL_BATCH; j++) {
            const bool in = i0 + 32u * j + lane < hi;
            const u32 eqs = __ballot_sync(0xffffffffu, in && kk[j] == prefix);
            const bool take =
                in && (kk[j] > prefix || (kk[j] == prefix && eq_seen + __popc(eqs & below) < krem));
            const u32 takes = __ballot_sync(0xffffffffu, take);
            if (take) out[slot + __popc(takes & below)] = (int)(first + i0 + 32u * j + lane);
            slot += __popc(takes);
            eq_seen += __popc(eqs);
        }
    }
    cluster_sync();  // no block leaves while a later one may still read its counts
}

// ---------------------------------------------------------------------------------------------
// Attention
// ---------------------------------------------------------------------------------------------

#define ATT_THREADS 256u
#define ATT_WARPS (ATT_THREADS / 32u)
#define ATT_HEADS 4u    // heads a block handles
#define ATT_MAX_PIECES 4u  // 16-byte pieces of a head a lane holds: d <= 512

#define ATT_MAX_SPLITS 16u
#define ATT_BATCH 4u  // keys a warp scores at once

// One level of a multi-value warp sum: of v[0, 2 HALF) the lane keeps the half its lane bit
// 2 HALF picks, in v[0, HALF), adding the partner lane's copy of it.
template <u32 HALF>
__device__ __forceinline__ void fold_half(float* v, u32 lane) {
    const bool up = lane & (2u * HALF);
#pragma unroll
    for (u32 i = 0; i < HALF; i++) {
        const float send = up ? v[i] : v[i + HALF];
        const float keep = up ? v[i + HALF] : v[i];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, 2u * HALF);
    }
}

// Channels c, c + 1 (c even) of a head's normalized output, rotated back at p (the last
// 2 rope_half of d channels: interleaved pairs, as rope_rows with -1), to dst[c] as one bf16
// pair (the launcher checks that the output is 4-byte aligned; d is even).
__device__ __forceinline__ void write_output_pair(u16* dst, u32 c, float x, float y, u32 p, const float* inv_freq,
                                                  u32 d, u32 rope_half) {
    float pair[2] = {x, y};
    const u32 rope0 = d - 2u * rope_half;
    if (c >= rope0) rope_pair(pair, p, inv_freq[(c - rope0) / 2u], -1.0f);
    *reinterpret_cast<u32*>(dst + c) = (u32)f32_to_bf16(pair[0]) | ((u32)f32_to_bf16(pair[1]) << 16);
}

// The first position of token t's chunk; a batch's token t is a chunk of one, at pos[t]: its
// key is row t of kv, its ring and entries slice t (the pointers are moved there).
__device__ __forceinline__ u32 att_token(u32 t, const u32* __restrict__ pos, u32 batch, u32 d, u32 wsize, u32 cap,
                                         const float* __restrict__& kv, const float* __restrict__& window,
                                         const u16* __restrict__& entries) {
    if (!batch) return pos[0];
    kv += (u64)t * d;
    window += (u64)t * wsize * d;
    entries += (u64)t * cap * d;
    return pos[t];
}

// The keys a token at p sees: n_w window positions, then the compressed keys (mode 1 every
// visible entry, mode 2 the first min(k, visible) slots of its selection, where a selection
// holds its ids); n in all.
struct AttKeys {
    u32 n_w, n;
};
__device__ __forceinline__ AttKeys att_keys(u32 p, u32 wsize, u32 mode, u32 ratio, u32 cap, u32 k) {
    const u32 n_w = min(p + 1u, wsize);
    const u32 n_vis = mode == 0u ? 0u : min((p + 1u) / ratio, cap);
    return {n_w, n_w + (mode == 2u ? min(k, n_vis) : n_vis)};
}

// A window key: position kp, in ring slot `slot` (kp mod W), from the chunk's kv when kp >= pos0
// (the chunk's first position), else from the ring; F32.
__device__ __forceinline__ const float* window_key(u32 kp, u32 slot, u32 pos0, u32 d, const float* __restrict__ kv,
                                                   const float* __restrict__ window) {
    return kp >= pos0 ? kv + (u64)(kp - pos0) * d : window + (u64)slot * d;
}

// Compressed key e of a token: entry e (mode 1) or the id in slot e of its selection sel_t
// (mode 2); f16, null when a selection slot holds none (-1 or an id >= cap).
__device__ __forceinline__ const u16* entry_key(u32 e, u32 mode, const int* __restrict__ sel_t,
                                                const u16* __restrict__ entries, u32 cap, u32 d) {
    const int id = mode == 1u ? (int)e : sel_t[e];
    return id < 0 || (u32)id >= cap ? nullptr : entries + (u64)id * d;
}

// Four f16 values at p (8 bytes) as f32.
__device__ __forceinline__ float4 f16x4_to_f32(const u16* p) {
    const uint2 w = *reinterpret_cast<const uint2*>(p);
    return make_float4(f16_to_f32((u16)w.x), f16_to_f32((u16)(w.x >> 16)), f16_to_f32((u16)w.y),
                       f16_to_f32((u16)(w.y >> 16)));
}

// Key j of token t (at p; the chunk starts at pos0): window position p + 1 - n_w + j, else
// compressed key j - n_w. Keys j >= n_w are f16.
__device__ __forceinline__ const void* att_key(u32 j, u32 n_w, u32 p, u32 pos0, u32 wsize, u32 d, u32 mode,
                                               const float* __restrict__ kv, const float* __restrict__ window,
                                               const u16* __restrict__ entries, const int* __restrict__ sel_t,
                                               u32 cap) {
    if (j >= n_w) return entry_key(j - n_w, mode, sel_t, entries, cap, d);
    const u32 kp = p + 1u - n_w + j;
    return window_key(kp, kp % wsize, pos0, d, kv, window);
}

// Block (x, s, t): heads [4x, 4x + 4) ∩ [0, heads) of token t at p = pos[0] + t (a batch's: at
// pos[t], over its own sequence's keys), over split s of the token's keys (always four heads'
// arithmetic, so their chains interleave; missing heads get zero queries and write nothing).
// Keys j in order: the window positions max(0, p - W + 1) ..= p (from this chunk's kv when
// >= pos[0], else from the ring slot position % W), then the compressed keys: mode 1 every
// visible entry [0, min((p + 1) / ratio, cap)), mode 2 the ids in the first min(k, that count)
// slots of selected[t] (-1 or an id >= cap: none; index_select leaves -1 in the slots past
// them). The n keys are cut into S = gridDim.y consecutive splits of ceil(n / S), the S blocks
// of (x, t) one cluster (S <= 16). A lane holds the 16-byte pieces lane, lane + 32, ... of a
// head's width (piece i: channels 4i .. 4i + 3), so each shared-memory read is one vector.
// Warp w takes its split's window keys w, w + 8, ..., then its compressed keys w, w + 8, ...,
// four at a time (a batch holds one kind of key: f32 window rows, or f16 entries copied as
// they are into the first half of their buffers and widened as they are read). Dynamic shared
// memory: 8 · ring · 4 · d floats, each warp's ring of key buffers (two where the GPU's shared
// memory holds them: the next batch copies in while this one is scored), later the warps'
// states (8 · 4 · d). Per batch the lanes' pieces give the 16 (head, key) dot products, summed
// over the warp together, and each head's running max, sum and weighted values are updated
// once (FMAs, a fixed order; the values are rescaled only when the head's maximum moved). The
// warps' states then merge through shared memory, summed in warp order.
// Then the cluster merges the S states in split order through distributed shared memory, each
// block writing a share of the channels: the sink joins the denominator, the output is rotated
// back (inverse RoPE at p on the last 2 rope_half channels of each head) and written as bf16.
// A token with mma_from keys or more is left to attention_mma (launched after this kernel).
DSV4_KERNEL void __launch_bounds__(ATT_THREADS, 1) attention_heads(
    const float* __restrict__ q, const float* __restrict__ kv, const float* __restrict__ window, u32 wsize, u32 mode,
    const u16* __restrict__ entries, u32 cap, u32 ratio, const int* __restrict__ sel, u32 k,
    const float* __restrict__ sink, const u32* __restrict__ pos, u32 heads, u32 d, float scale,
    const float* __restrict__ inv_freq, u32 rope_half, u16* __restrict__ out, u32 ring, u32 batch, u32 mma_from) {
    const u32 h0 = blockIdx.x * ATT_HEADS;
    const u32 hv = min(ATT_HEADS, heads - h0);  // heads this block writes
    // The heads' sinks and the rotation's frequencies (weights) before the wait.
    __shared__ float sink_s[ATT_HEADS], freq_s[ATT_MAX_PIECES * 64u];
    if (threadIdx.x < hv) sink_s[threadIdx.x] = sink[h0 + threadIdx.x];
    for (u32 i = threadIdx.x; i < rope_half; i += blockDim.x) freq_s[i] = inv_freq[i];
    pdl_enter();
    __shared__ __align__(16) float q_s[ATT_HEADS * ATT_MAX_PIECES * 128u];
    __shared__ __align__(16) float acc_s[ATT_HEADS * ATT_MAX_PIECES * 128u];
    __shared__ float m_s[ATT_HEADS], l_s[ATT_HEADS];
    __shared__ float wm_s[ATT_WARPS][ATT_HEADS], wl_s[ATT_WARPS][ATT_HEADS];
    extern __shared__ __align__(16) float stage[];  // [ATT_WARPS][ring][ATT_BATCH][d] keys, then [ATT_WARPS][ATT_HEADS][d]
    const u32 t = blockIdx.z;
    const u32 splits = gridDim.y, split = blockIdx.y;
    const u32 pos0 = att_token(t, pos, batch, d, wsize, cap, kv, window, entries);
    const u32 p = batch ? pos0 : pos0 + t;
    const AttKeys keys = att_keys(p, wsize, mode, ratio, cap, k);
    const u32 n_w = keys.n_w, n = keys.n;
    if (n >= mma_from) return;  // attention_mma's token
    const u32 per = (n + splits - 1u) / splits;
    const u32 j0 = min(n, split * per), j1 = min(n, j0 + per);
    const float* qt = q + ((u64)t * heads + h0) * d;
    // 16-byte pieces, all in flight at once (d % 32 == 0); missing heads are zeros.
    for (u32 i = 4u * threadIdx.x; i < ATT_HEADS * d; i += 4u * blockDim.x) {
        if (i < hv * d) cp_async16(q_s + i, qt + i);
        else *reinterpret_cast<float4*>(q_s + i) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    cp_async_commit();
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const u32 pieces = d / 4u, np = (pieces + 31u) / 32u;  // a head's pieces; most a lane holds
    // The warp's keys: window keys jw + 8 i (i < cw), then compressed keys je + 8 i (i < ce),
    // batches [0, bw) of the first kind, [bw, batches) of the second.
    const u32 jw = j0 + warp, jw_end = min(j1, n_w), je = max(j0, n_w) + warp;
    const u32 cw = jw < jw_end ? (jw_end - jw + ATT_WARPS - 1u) / ATT_WARPS : 0u;
    const u32 ce = je < j1 ? (j1 - je + ATT_WARPS - 1u) / ATT_WARPS : 0u;
    const u32 bw = (cw + ATT_BATCH - 1u) / ATT_BATCH;
    const u32 batches = bw + (ce + ATT_BATCH - 1u) / ATT_BATCH;
    // Window key j is position first + j, in ring slot (slot0 + j) mod W (j < n_w <= W).
    const u32 first = p + 1u - n_w, slot0 = first % wsize;
    const int* sel_t = mode == 2u ? sel + (u64)t * k : sel;
    float* keybuf = stage + warp * ring * ATT_BATCH * d;
    // Issues batch b's copies into its buffer and returns its mask of present keys.
    auto load_batch = [&](u32 b) {
        const bool entry = b >= bw;
        const u32 i0 = (entry ? b - bw : b) * ATT_BATCH, count = entry ? ce : cw;
        const u32 key_pieces = entry ? pieces / 2u : pieces;
        float* buf = keybuf + (ring == 2u ? b & 1u : 0u) * ATT_BATCH * d;
        u32 mask = 0u;
#pragma unroll
        for (u32 r = 0; r < ATT_BATCH; r++) {
            if (i0 + r >= count) break;
            const void* key;
            if (!entry) {
                const u32 j = jw + (i0 + r) * ATT_WARPS;
                key = window_key(first + j, slot0 + j >= wsize ? slot0 + j - wsize : slot0 + j, pos0, d, kv, window);
            } else {
                key = entry_key(je + (i0 + r) * ATT_WARPS - n_w, mode, sel_t, entries, cap, d);
            }
            if (!key) continue;  // warp-uniform
            mask |= 1u << r;
#pragma unroll
            for (u32 x = 0; x < ATT_MAX_PIECES; x++) {
                const u32 i = lane + 32u * x;
                if (i < key_pieces)
                    cp_async16(reinterpret_cast<float4*>(buf + r * d) + i, static_cast<const float4*>(key) + i);
            }
        }
        cp_async_commit();
        return mask;
    };
    u32 mask = batches > 0u ? load_batch(0) : 0u;
    // The queries (the first group; the first batch may stay in flight).
    if (batches > 0u) cp_async_wait<1>();
    else cp_async_wait<0>();
    __syncthreads();
    const float4 zero4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float m[ATT_HEADS], l[ATT_HEADS];
    float4 acc[ATT_HEADS][ATT_MAX_PIECES];
#pragma unroll
    for (u32 h = 0; h < ATT_HEADS; h++) {
        m[h] = NEG_INF;
        l[h] = 0.0f;
#pragma unroll
        for (u32 x = 0; x < ATT_MAX_PIECES; x++) acc[h][x] = zero4;
    }
    // After the 16-value reduction lane L holds the score of head (L >> 3) & 3 and key
    // (L >> 1) & 3 of the batch.
    const u32 my_h = (lane >> 3) & 3u, my_r = (lane >> 1) & 3u;
    for (u32 b = 0; b < batches; b++) {
        const bool more = b + 1u < batches;
        u32 next_mask = ring == 2u && more ? load_batch(b + 1u) : 0u;
        if (ring == 2u && more) cp_async_wait<1>();
        else cp_async_wait<0>();  // batch b
        __syncwarp();
        const float* buf = keybuf + (ring == 2u ? b & 1u : 0u) * ATT_BATCH * d;
        // The lane's pieces of the batch's keys (zeros for absent keys and past the width).
        float4 kr[ATT_BATCH][ATT_MAX_PIECES];
        if (b >= bw) {
#pragma unroll
            for (u32 r = 0; r < ATT_BATCH; r++)
#pragma unroll
                for (u32 x = 0; x < ATT_MAX_PIECES; x++) {
                    const u32 i = lane + 32u * x;
                    kr[r][x] = zero4;
                    if (((mask >> r) & 1u) && i < pieces) {
                        kr[r][x] = f16x4_to_f32(reinterpret_cast<const u16*>(buf + r * d) + 4u * i);
                    }
                }
        } else {
#pragma unroll
            for (u32 r = 0; r < ATT_BATCH; r++)
#pragma unroll
                for (u32 x = 0; x < ATT_MAX_PIECES; x++) {
                    const u32 i = lane + 32u * x;
                    kr[r][x] = ((mask >> r) & 1u) && i < pieces ? reinterpret_cast<const float4*>(buf + r * d)[i] : zero4;
                }
        }
        __syncwarp();  // every lane has read the buffer: a later batch may overwrite it
        if (ring == 1u && more) next_mask = load_batch(b + 1u);
        // The lane's share of the 16 dot products (head h, key r at v[4 h + r]).
        float v[ATT_HEADS * ATT_BATCH];
#pragma unroll
        for (u32 i = 0; i < ATT_HEADS * ATT_BATCH; i++) v[i] = 0.0f;
#pragma unroll
        for (u32 x = 0; x < ATT_MAX_PIECES; x++) {
            if (x >= np) break;
            const u32 i = lane + 32u * x;
#pragma unroll
            for (u32 h = 0; h < ATT_HEADS; h++) {
                const float4 qv = i < pieces ? reinterpret_cast<const float4*>(q_s + h * d)[i] : zero4;
#pragma unroll
                for (u32 r = 0; r < ATT_BATCH; r++) {
                    float a = v[4 * h + r];
                    a = fmaf(qv.x, kr[r][x].x, a);
                    a = fmaf(qv.y, kr[r][x].y, a);
                    a = fmaf(qv.z, kr[r][x].z, a);
                    v[4 * h + r] = fmaf(qv.w, kr[r][x].w, a);
                }
            }
        }
        // Sixteen warp sums at once: each level halves the values a lane keeps (the half its
        // lane bit picks), adding the partner lane's copy of them; the last level is a plain
        // pair sum. 16 shuffles instead of 80, in a fixed order.
        fold_half<8>(v, lane);
        fold_half<4>(v, lane);
        fold_half<2>(v, lane);
        fold_half<1>(v, lane);
        float s = v[0] + __shfl_xor_sync(0xffffffffu, v[0], 1);
        const bool present = (mask >> my_r) & 1u;
        s = present ? s * scale : NEG_INF;
        // The head's running state, its batch maximum, factor and weights.
        const float m_h = my_h == 0u ? m[0] : my_h == 1u ? m[1] : my_h == 2u ? m[2] : m[3];
        const float l_h = my_h == 0u ? l[0] : my_h == 1u ? l[1] : my_h == 2u ? l[2] : l[3];
        float bm = fmaxf(s, __shfl_xor_sync(0xffffffffu, s, 2));
        bm = fmaxf(bm, __shfl_xor_sync(0xffffffffu, bm, 4));
        const float mn = fmaxf(m_h, bm);
        const float alpha = m_h == mn ? 1.0f : expf(m_h - mn);
        const float pr = present ? expf(s - mn) : 0.0f;
        float ps = pr + __shfl_xor_sync(0xffffffffu, pr, 2);
        ps = ps + __shfl_xor_sync(0xffffffffu, ps, 4);
        const float ln = fmaf(l_h, alpha, ps);
        float al[ATT_HEADS], pw[ATT_HEADS][ATT_BATCH];
#pragma unroll
        for (u32 h = 0; h < ATT_HEADS; h++) {
            m[h] = __shfl_sync(0xffffffffu, mn, h << 3);
            l[h] = __shfl_sync(0xffffffffu, ln, h << 3);
            al[h] = __shfl_sync(0xffffffffu, alpha, h << 3);
#pragma unroll
            for (u32 r = 0; r < ATT_BATCH; r++) pw[h][r] = __shfl_sync(0xffffffffu, pr, (h << 3) | (r << 1));
        }
#pragma unroll
        for (u32 h = 0; h < ATT_HEADS; h++) {
            if (al[h] != 1.0f) {  // warp-uniform; a factor of 1 leaves the sums as they are
#pragma unroll
                for (u32 x = 0; x < ATT_MAX_PIECES; x++) {
                    acc[h][x].x *= al[h];
                    acc[h][x].y *= al[h];
                    acc[h][x].z *= al[h];
                    acc[h][x].w *= al[h];
                }
            }
#pragma unroll
            for (u32 x = 0; x < ATT_MAX_PIECES; x++) {
                float4 a = acc[h][x];
#pragma unroll
                for (u32 r = 0; r < ATT_BATCH; r++) {
                    a.x = fmaf(pw[h][r], kr[r][x].x, a.x);
                    a.y = fmaf(pw[h][r], kr[r][x].y, a.y);
                    a.z = fmaf(pw[h][r], kr[r][x].z, a.z);
                    a.w = fmaf(pw[h][r], kr[r][x].w, a.w);
                }
                acc[h][x] = a;
            }
        }
        mask = next_mask;
    }
    // Merge the warps' partial softmaxes: each warp's factor to the heads' common maximum, then
    // the warps' scaled sums staged side by side (all heads at once) and added in warp order
    // per channel.
    if (lane == 0u) {
#pragma unroll
        for (u32 h = 0; h < ATT_HEADS; h++) {
            wm_s[warp][h] = m[h];
            wl_s[warp][h] = l[h];
        }
    }
    // Every warp's state is out, its copies have landed and its buffers are read: the stage
    // may be reused.
    __syncthreads();
    // Lane 8 h + w of every warp takes warp w's factor to head h's common maximum; warp 0 also
    // the heads' maxima and denominators (summed in warp order).
    static_assert(ATT_HEADS * ATT_WARPS == 32u && ATT_MAX_SPLITS <= 16u, "a lane per (head, warp or split)");
    const u32 lh = lane >> 3, lr = lane & 7u, lgroup = lane & ~7u;
    const float wm = wm_s[lr][lh];
    float wmx = fmaxf(wm, __shfl_xor_sync(0xffffffffu, wm, 1));
    wmx = fmaxf(wmx, __shfl_xor_sync(0xffffffffu, wmx, 2));
    wmx = fmaxf(wmx, __shfl_xor_sync(0xffffffffu, wmx, 4));
    const float wf = wm == wmx ? 1.0f : expf(__fsub_rn(wm, wmx));
    if (warp == 0u) {
        float den = 0.0f;
#pragma unroll
        for (u32 w = 0; w < ATT_WARPS; w++)
            den = __fadd_rn(den, __fmul_rn(wl_s[w][lh], __shfl_sync(0xffffffffu, wf, lgroup | w)));
        if (lr == 0u) {
            m_s[lh] = wmx;
            l_s[lh] = den;
        }
    }
    float4* stage4 = reinterpret_cast<float4*>(stage);
#pragma unroll
    for (u32 h = 0; h < ATT_HEADS; h++) {
        const float f = __shfl_sync(0xffffffffu, wf, 8u * h + warp);
#pragma unroll
        for (u32 x = 0; x < ATT_MAX_PIECES; x++) {
            const u32 i = lane + 32u * x;
            if (i < pieces)
                stage4[(warp * ATT_HEADS + h) * pieces + i] =
                    make_float4(__fmul_rn(acc[h][x].x, f), __fmul_rn(acc[h][x].y, f), __fmul_rn(acc[h][x].z, f),
                                __fmul_rn(acc[h][x].w, f));
        }
    }
    __syncthreads();
    for (u32 i = threadIdx.x; i < ATT_HEADS * pieces; i += blockDim.x) {
        float4 a = zero4;
#pragma unroll
        for (u32 w = 0; w < ATT_WARPS; w++) {
            const float4 s = stage4[w * ATT_HEADS * pieces + i];
            a = make_float4(__fadd_rn(a.x, s.x), __fadd_rn(a.y, s.y), __fadd_rn(a.z, s.z), __fadd_rn(a.w, s.w));
        }
        reinterpret_cast<float4*>(acc_s)[i] = a;
    }
    // The splits' states merge over the cluster (the blocks of (x, t), rank = split), read from
    // each block's shared memory: every block brings the S states to their common maximum in
    // split order, then takes a contiguous share of its heads' channel pairs, summing the
    // splits' scaled sums in split order. So the result depends on S but not on timing.
    cluster_sync();  // every split's state is complete
    __shared__ float f_s[ATT_HEADS][ATT_MAX_SPLITS], mx_s[ATT_HEADS], den_s[ATT_HEADS];
    // Warp 0: lane 8 h + r reads splits r and r + 8 of head h (all loads in flight together)
    // and takes their factors to the common maximum; the denominator sums in split order.
    if (warp == 0u) {
        const bool a0 = lr < splits, a1 = lr + 8u < splits;
        const float m0 = a0 ? cluster_peer(&m_s[lh], lr) : NEG_INF, l0 = a0 ? cluster_peer(&l_s[lh], lr) : 0.0f;
        const float m1 = a1 ? cluster_peer(&m_s[lh], lr + 8u) : NEG_INF;
        const float l1 = a1 ? cluster_peer(&l_s[lh], lr + 8u) : 0.0f;
        float mo = fmaxf(m0, m1);
        mo = fmaxf(mo, __shfl_xor_sync(0xffffffffu, mo, 1));
        mo = fmaxf(mo, __shfl_xor_sync(0xffffffffu, mo, 2));
        mo = fmaxf(mo, __shfl_xor_sync(0xffffffffu, mo, 4));
        const float f0 = m0 == mo ? 1.0f : expf(__fsub_rn(m0, mo));
        const float f1 = m1 == mo ? 1.0f : expf(__fsub_rn(m1, mo));
        if (a0) f_s[lh][lr] = f0;
        if (a1) f_s[lh][lr + 8u] = f1;
        const float p0 = __fmul_rn(l0, f0), p1 = __fmul_rn(l1, f1);
        float lo = 0.0f;
        for (u32 r = 0; r < splits; r++) {
            const float x0 = __shfl_sync(0xffffffffu, p0, lgroup | (r & 7u));
            const float x1 = __shfl_sync(0xffffffffu, p1, lgroup | (r & 7u));
            lo = __fadd_rn(lo, r < 8u ? x0 : x1);
        }
        if (lr == 0u) {
            // The sink: a zero-valued key of logit sink[h] (it may exceed every score). mx_s[h]
            // gets the heads' factor to the maximum with it, den_s[h] the denominator.
            const u32 h = lh;
            const float sk = h < hv ? sink_s[h] : 0.0f;
            const float mf = fmaxf(mo, sk);
            const float a = mo == mf ? 1.0f : expf(__fsub_rn(mo, mf));
            mx_s[h] = a;
            den_s[h] = __fadd_rn(__fmul_rn(lo, a), expf(__fsub_rn(sk, mf)));
        }
    }
    __syncthreads();
    // Pair i of the block's heads (channels 2i and 2i + 1 of head i / (d / 2)), for the split's
    // contiguous share of the pairs. Rotated back to the token's position (as rope_rows with
    // sign -1) on the last rope_half pairs of a head.
    const u32 half_d = d / 2u, share = (hv * half_d + splits - 1u) / splits;
    const u32 i_end = min(hv * half_d, (split + 1u) * share);
    for (u32 i = split * share + threadIdx.x; i < i_end; i += blockDim.x) {
        const u32 h = i / half_d, c = 2u * (i % half_d);
        // Every split's pair loaded before the sums (in split order) use them.
        float2 x[ATT_MAX_SPLITS];
#pragma unroll
        for (u32 r = 0; r < ATT_MAX_SPLITS; r++)
            if (r < splits) x[r] = cluster_peer(reinterpret_cast<const float2*>(acc_s + h * d + c), r);
        float v[2] = {0.0f, 0.0f};
#pragma unroll
        for (u32 r = 0; r < ATT_MAX_SPLITS; r++) {
            if (r >= splits) break;
            const float f = f_s[h][r];
            v[0] = __fadd_rn(v[0], __fmul_rn(x[r].x, f));
            v[1] = __fadd_rn(v[1], __fmul_rn(x[r].y, f));
        }
#pragma unroll
        for (u32 e = 0; e < 2u; e++) v[e] = __fdiv_rn(__fmul_rn(v[e], mx_s[h]), den_s[h]);
        write_output_pair(out + ((u64)t * heads + h0 + h) * d, c, v[0], v[1], p, freq_s, d, rope_half);
    }
    cluster_sync_after_reads();  // no block leaves while another may still read its state
}

// ---------------------------------------------------------------------------------------------
// Attention of a prompt chunk on tensor cores
// ---------------------------------------------------------------------------------------------
//
// attention_mma: the same attention as attention_heads on tensor cores, with the token's 64
// heads as the M side of f16 MMAs (the heads share one key/value head): block (x, s, t) takes
// heads [64x, 64x + 64) of token t (a batch's token t at pos[t], over its own sequence's
// state, as attention_heads) and split s of its keys. Every f32 operand is split into two f16
// parts, x = hi + lo (hi = x rounded to f16, lo = the rest rounded again: about 22
// significant bits), and a product of two is taken as hi·hi + hi·lo + lo·hi on the MMAs, with
// f32 sums: one f16 rounding of the queries moved logits enough to change a router's choice in
// a later layer of the tiny fixtures. The compressed entries are f16 already: a product with
// one is hi·k + lo·k. Queries and keys must lie inside f16's range (|x| < 65504; the model's
// are RMS-normalised). The block's queries go to shared memory once, its keys (in
// attention_heads' order: window, then compressed) 32 at a time: a tile holding window keys
// split into hi and lo rows as it is staged, a tile of entries copied as it is (cp.async) while
// the tile before it is scored. 16 warps: warp w scores heads 16 (w % 4) .. + 16 against the
// tile's 32 keys over the 32-channel steps w / 4, w / 4 + 4, ... of the head width (each query
// fragment it loads serves four key tiles), the four warps' partial scores are added in shared
// memory in a fixed order, and each warp then keeps the online softmax of its
// 16 heads (the four warps of a head group keep the same one) and accumulates probabilities
// times keys into its quarter of the head width. Then the sink joins each head's
// denominator, the output is rotated back and written in bf16, as attention_heads does.
// Splits (gridDim.y = S > 1, for launches of few tokens): the token's tiles of 32 keys are
// dealt out in contiguous runs of about equal cost (a window tile costs two entry tiles), so
// `used` <= S splits take part (the others return at once). Each used block writes its heads'
// unnormalised sums and softmax states to `part` ([t][h][S][d] sums, [t][h][S][2] max and
// denominator; with `pairs`, S even and each pair of splits one cluster, the pair's states
// merged through distributed shared memory first and written as one), and attention_merge,
// launched after it, merges them in a fixed order: the result depends on S, `pairs` and the
// position, not on timing.
// A token with fewer than mma_from keys is left to attention_heads (launched before).
#define AMMA_HEADS 64u
#define AMMA_KEYS 32u
#define AMMA_WARPS 16u
#define AMMA_WINDOW_COST 2u  // a tile of window keys against a tile of entries, in split units

__device__ __forceinline__ void mma_f16(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// The f16 pair of (a, b) and the pair of what it leaves out.
__device__ __forceinline__ void f16x2_split(float a, float b, u32& hi, u32& lo) {
    hi = f16x2(a, b);
    float ha, hb;
    asm("{ .reg .b16 x, y; mov.b32 {x, y}, %2; cvt.f32.f16 %0, x; cvt.f32.f16 %1, y; }"
        : "=f"(ha), "=f"(hb)
        : "r"(hi));
    lo = f16x2(a - ha, b - hb);
}

// Four f32 values to hi and lo f16 parts at hi_dst and lo_dst (8 bytes each).
__device__ __forceinline__ void store_split(float4 v, u16* hi_dst, u16* lo_dst) {
    u32 h0, l0, h1, l1;
    f16x2_split(v.x, v.y, h0, l0);
    f16x2_split(v.z, v.w, h1, l1);
    *reinterpret_cast<uint2*>(hi_dst) = make_uint2(h0, h1);
    *reinterpret_cast<uint2*>(lo_dst) = make_uint2(l0, l1);
}

// attention_mma keeps its scores, maxima included, in units of log2 (logit · log2 e), so that
// each probability is one ex2.
#define AMMA_LOG2E 1.4426950408889634f

// 2^x by the SFU (relative error about 2^-22, as expf's): 0 for -inf.
__device__ __forceinline__ float ex2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// The factor of a head's sums (running max m in log2 units, denominator l) once the sink, a
// zero-valued key of logit sk (it may exceed every score), joins its denominator.
__device__ __forceinline__ float amma_factor(float m, float l, float sk) {
    const float s2 = sk * AMMA_LOG2E;
    const float mf = fmaxf(m, s2);
    const float a = m == mf ? 1.0f : exp2f(m - mf);
    return a / fmaf(l, a, exp2f(s2 - mf));
}


// How attention_mma cuts a token's n keys (n_w of them the window's) over S splits: tiles of
// AMMA_KEYS keys, a window tile weighing AMMA_WINDOW_COST units and a tile of entries one,
// split s taking the tiles that start in units [s per, (s + 1) per), per = ceil(units / S);
// `used` splits take part (in pairs, whole pairs: the odd one out's partner with no keys).
struct AmmaPlan {
    u32 wt, per, used;
};
__device__ __forceinline__ AmmaPlan amma_plan(u32 n, u32 n_w, u32 splits, u32 pairs) {
    const u32 tiles = max(1u, (n + AMMA_KEYS - 1u) / AMMA_KEYS);
    const u32 wt = min(tiles, (n_w + AMMA_KEYS - 1u) / AMMA_KEYS);
    const u32 units = AMMA_WINDOW_COST * wt + (tiles - wt);
    const u32 per = (units + splits - 1u) / splits;
    u32 used = (units + per - 1u) / per;
    if (pairs) used = min(splits, used + (used & 1u));
    return {wt, per, used};
}

// Dynamic shared memory: queries [2][64][d + 8] f16 (hi, lo), keys [2][32][d + 8] f16 (a
// window tile's hi and lo parts, or two entry tiles), scores [2][64][33] f32 (two halves'
// partial sums); the split merge's factors and group sums in the keys' place.
DSV4_KERNEL void __launch_bounds__(AMMA_WARPS * 32u, 1) attention_mma(
    const float* __restrict__ q, const float* __restrict__ kv, const float* __restrict__ window, u32 wsize, u32 mode,
    const u16* __restrict__ entries, u32 cap, u32 ratio, const int* __restrict__ sel, u32 k,
    const float* __restrict__ sink, const u32* __restrict__ pos, u32 heads, u32 d, float scale,
    const float* __restrict__ inv_freq, u32 rope_half, float* __restrict__ part_acc, float* __restrict__ part_ml,
    u16* __restrict__ out, u32 batch, u32 mma_from, u32 pairs) {
    pdl_enter();
    extern __shared__ __align__(16) u16 amma[];
    const u32 ld = d + 8u;  // row stride (f16): rows 16 bytes apart in banks
    u16* q_s = amma;                          // hi, then lo at + AMMA_HEADS * ld
    u16* k_s = q_s + 2u * AMMA_HEADS * ld;    // slot 0, then slot 1 at + AMMA_KEYS * ld
    float* s_s = reinterpret_cast<float*>(k_s + 2u * AMMA_KEYS * ld);
    float* s_t = s_s + AMMA_HEADS * (AMMA_KEYS + 1u);
    __shared__ bool present_s[2][AMMA_KEYS];
    const u32 q_lo = AMMA_HEADS * ld, k_lo = AMMA_KEYS * ld;
    const u32 t = blockIdx.z, h0 = blockIdx.x * AMMA_HEADS;
    const u32 hv = min(AMMA_HEADS, heads - h0);
    const u32 pos0 = att_token(t, pos, batch, d, wsize, cap, kv, window, entries);
    const u32 p = batch ? pos0 : pos0 + t;
    const AttKeys keys = att_keys(p, wsize, mode, ratio, cap, k);
    const u32 n_w = keys.n_w, n = keys.n;
    if (n < mma_from) return;  // attention_heads' token
    // This split's keys [j_begin, j_end): whole tiles. A tile holding window keys (F32, split
    // at staging, three MMAs a product) weighs AMMA_WINDOW_COST units, a tile of entries (f16,
    // copied as they are while the tile before is scored, two MMAs) one; split s takes the
    // tiles that start in units [s per, (s + 1) per), per = ceil(units / S). A split in the
    // window's units may get no tile: it takes part in the merge with an empty state. (A
    // parked token sees no keys: one split, or one pair, and its output is zeros.)
    const u32 splits = gridDim.y, split = blockIdx.y;
    const AmmaPlan plan = amma_plan(n, n_w, splits, pairs);
    const u32 wt = plan.wt, per = plan.per, used = plan.used;
    if (split >= used) return;
    // The first tile starting at unit x or later.
    auto tile_at = [&](u32 x) {
        return x <= AMMA_WINDOW_COST * wt ? (x + AMMA_WINDOW_COST - 1u) / AMMA_WINDOW_COST
                                          : x - (AMMA_WINDOW_COST - 1u) * wt;
    };
    const u32 j_begin = min(n, tile_at(split * per) * AMMA_KEYS);
    const u32 j_end = min(n, tile_at((split + 1u) * per) * AMMA_KEYS);
    const int* sel_t = mode == 2u ? sel + (u64)t * k : sel;
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, g = lane >> 2, qd = lane & 3u;
    const u32 hg = warp & 3u, kq = warp >> 2;  // head group (16 heads), key quarter / dim quarter
    const u32 dq = d / 4u, ntiles = dq / 8u;   // this warp's output columns

    // Entry tile j0's rows (f16, as stored) into key slot sl by cp.async, 16 bytes a piece
    // (absent rows zeros), and which are present; one commit group. Thread i takes row i / 16,
    // so that it looks up one key (a selection's id is a load from memory), and its pieces
    // i % 16, + 16, ...
    static_assert(AMMA_WARPS * 32u == 16u * AMMA_KEYS, "16 threads a key row");
    auto issue = [&](u32 j0, u32 sl) {
        const u32 r = threadIdx.x / 16u, j = j0 + r, c8 = 8u * (threadIdx.x % 16u);
        const u16* key = j < j_end ? static_cast<const u16*>(
                                         att_key(j, n_w, p, pos0, wsize, d, mode, kv, window, entries, sel_t, cap))
                                   : nullptr;
        if (c8 == 0u) present_s[sl][r] = key != nullptr;
        const u32 dst = (u32)__cvta_generic_to_shared(k_s + sl * k_lo + r * ld + c8);
        const u16* src = (key ? key : entries) + c8;  // an absent row reads nothing
        for (u32 c = 0; c + c8 < d; c += 128u) cp_async16_or_zero(dst + 2u * c, src + c, key != nullptr);
        cp_async_commit();
    };
    // A first tile of entries is on its way while the queries are staged.
    bool issued = j_begin >= n_w && j_begin < j_end;
    if (issued) issue(j_begin, 0u);

    // Staging: thread i takes channels 4 (i % tpr) .. + 4 of rows i / tpr, i / tpr + rpp, ...
    // (tpr = d / 4 <= 128 threads a row, so rpp >= 4 rows a pass and eight passes cover 32
    // rows), its loads issued together before their stores.
    const u32 tpr = d / 4u, rpp = blockDim.x / tpr, c4 = 4u * (threadIdx.x % tpr), r0 = threadIdx.x / tpr;
    const bool stager = r0 < rpp;
    // Queries as f16 (missing heads zero).
    const float* qt = q + ((u64)t * heads + h0) * d;
    for (u32 hb = 0; stager && hb < AMMA_HEADS; hb += 8u * rpp) {
        float4 v[8];
#pragma unroll
        for (u32 b = 0; b < 8u; b++) {
            const u32 h = hb + r0 + b * rpp;
            v[b] = h < hv ? *reinterpret_cast<const float4*>(qt + (u64)h * d + c4) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
#pragma unroll
        for (u32 b = 0; b < 8u; b++) {
            const u32 h = hb + r0 + b * rpp;
            if (h < AMMA_HEADS) store_split(v[b], q_s + h * ld + c4, q_s + q_lo + h * ld + c4);
        }
    }
    float o[16][4];
#pragma unroll
    for (u32 i = 0; i < 16u; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    // Running max and denominator of rows g and g + 8 of the warp's head group.
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
    // Fragments by ldmatrix (one instruction for four 8x8 matrices, a lane naming a row of
    // one): the queries' (heads 16 hg + 0..15, channels c, c + 8; hi or lo).
    const u32 a_row = 16u * hg + (lane & 7u) + 8u * ((lane >> 3) & 1u);
    const u32 qa = (u32)__cvta_generic_to_shared(q_s + a_row * ld + 8u * (lane >> 4));
    auto ldm4 = [](u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                     : "r"(addr));
    };
    auto ldm4t = [](u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                     : "r"(addr));
    };
    const float scale2 = scale * AMMA_LOG2E;
    u32 et = 0u;  // entry tiles begun: tile et goes to slot et % 2
    for (u32 j0 = j_begin; j0 < j_end; j0 += AMMA_KEYS) {
        const bool entry = j0 >= n_w;
        const u32 sl = entry ? et & 1u : 0u;
        __syncthreads();  // the previous tile's keys and scores are read
        if (entry) {
            // This tile's copies (unless issued before), the next tile's into the other slot
            // (the tile before, which held it, is read), then this tile's landed.
            if (!issued) issue(j0, sl);
            issued = j0 + AMMA_KEYS < j_end;
            if (issued) {
                issue(j0 + AMMA_KEYS, sl ^ 1u);
                cp_async_wait<1>();
            } else {
                cp_async_wait<0>();
            }
            et++;
        } else if (stager) {
            // Keys j0 .. j0 + 31 split into f16 hi (slot 0) and lo (slot 1) rows (absent ones
            // zero; an entry in the tile has no lo part), and which are present.
            float4 v[8];
            u32 present = 0u;
#pragma unroll
            for (u32 b = 0; b < 8u; b++) {
                const u32 r = r0 + b * rpp, j = j0 + r;
                const void* key = r < AMMA_KEYS && j < j_end
                                      ? att_key(j, n_w, p, pos0, wsize, d, mode, kv, window, entries, sel_t, cap)
                                      : nullptr;
                v[b] = !key       ? make_float4(0.0f, 0.0f, 0.0f, 0.0f)
                       : j >= n_w ? f16x4_to_f32(static_cast<const u16*>(key) + c4)
                                  : *reinterpret_cast<const float4*>(static_cast<const float*>(key) + c4);
                present |= key ? 1u << b : 0u;
            }
#pragma unroll
            for (u32 b = 0; b < 8u; b++) {
                const u32 r = r0 + b * rpp;
                if (r >= AMMA_KEYS) continue;
                store_split(v[b], k_s + r * ld + c4, k_s + k_lo + r * ld + c4);
                if (c4 == 0u) present_s[0][r] = (present >> b) & 1u;
            }
        }
        __syncthreads();
        // Partial scores of heads 16 hg + (g, g + 8) and all 32 keys (column tiles nn: keys
        // 8 nn + 2 qd + (0, 1)) over the 32-channel steps kq, kq + 4, ... of the head width, each
        // query fragment loaded once for the four key tiles.
        {
            float sc[4][4] = {};
            // d is a multiple of 32 (the launcher's check).
            if (entry) {
                // Key fragments of channels c, c + 8 of two key tiles (keys 16 np + 0..15) in
                // one load, each used for both query parts: q·k = hi·k + lo·k.
                const u32 kb = (u32)__cvta_generic_to_shared(k_s + sl * k_lo + ((lane & 7u) + 8u * (lane >> 4)) * ld +
                                                            8u * ((lane >> 3) & 1u));
                for (u32 c0 = 32u * kq; c0 < d; c0 += 128u)
#pragma unroll 1
                    for (u32 c = c0; c < c0 + 32u; c += 16u) {
                        u32 a0, a1, a2, a3, e0, e1, e2, e3;  // the query's hi and lo parts
                        ldm4(qa + 2u * c, a0, a1, a2, a3);
                        ldm4(qa + 2u * (q_lo + c), e0, e1, e2, e3);
#pragma unroll
                        for (u32 np = 0; np < 2u; np++) {
                            u32 b0, b1, b2, b3;
                            ldm4(kb + 2u * (16u * np * ld + c), b0, b1, b2, b3);
                            mma_f16(sc[2u * np], a0, a1, a2, a3, b0, b1);
                            mma_f16(sc[2u * np + 1u], a0, a1, a2, a3, b2, b3);
                            mma_f16(sc[2u * np], e0, e1, e2, e3, b0, b1);
                            mma_f16(sc[2u * np + 1u], e0, e1, e2, e3, b2, b3);
                        }
                    }
            } else {
                // The keys' fragments (keys 8 nn + 0..7, channels c, c + 8, hi then lo):
                // hi·hi + hi·lo + lo·hi, the keys' hi parts kept for the query's lo part.
                const u32 kb = (u32)__cvta_generic_to_shared(k_s + (lane >> 4) * k_lo + (lane & 7u) * ld +
                                                            8u * ((lane >> 3) & 1u));
                for (u32 c0 = 32u * kq; c0 < d; c0 += 128u)
#pragma unroll 1
                    for (u32 c = c0; c < c0 + 32u; c += 16u) {
                        u32 a0, a1, a2, a3, bh[4][2];
                        ldm4(qa + 2u * c, a0, a1, a2, a3);
#pragma unroll
                        for (u32 nn = 0; nn < 4u; nn++) {
                            u32 l0, l1;
                            ldm4(kb + 2u * (8u * nn * ld + c), bh[nn][0], bh[nn][1], l0, l1);
                            mma_f16(sc[nn], a0, a1, a2, a3, bh[nn][0], bh[nn][1]);
                            mma_f16(sc[nn], a0, a1, a2, a3, l0, l1);
                        }
                        ldm4(qa + 2u * (q_lo + c), a0, a1, a2, a3);
#pragma unroll
                        for (u32 nn = 0; nn < 4u; nn++) mma_f16(sc[nn], a0, a1, a2, a3, bh[nn][0], bh[nn][1]);
                    }
            }
            // The four channel quarters' partials meet in a fixed order, (kq 0 + kq 2) +
            // (kq 1 + kq 3): quarters 2 and 3 put theirs in s_s and s_t, then quarters 0 and 1
            // add theirs to them.
            auto at = [&](u32 nn, u32 i) {
                return (16u * hg + g + 8u * (i >> 1)) * (AMMA_KEYS + 1u) + 8u * nn + 2u * qd + (i & 1u);
            };
            float* part = kq & 1u ? s_t : s_s;
            if (kq >= 2u)
#pragma unroll
                for (u32 nn = 0; nn < 4u; nn++)
#pragma unroll
                    for (u32 i = 0; i < 4u; i++) part[at(nn, i)] = sc[nn][i];
            __syncthreads();
            if (kq < 2u)
#pragma unroll
                for (u32 nn = 0; nn < 4u; nn++)
#pragma unroll
                    for (u32 i = 0; i < 4u; i++) part[at(nn, i)] = sc[nn][i] + part[at(nn, i)];
        }
        __syncthreads();
        // Online softmax of rows g and g + 8 over the tile's 32 keys, in log2 units: the quad's
        // lanes take 8 keys each (keys 2 qd + 8 i + (0, 1), the A fragment's columns).
        const u32 present = __ballot_sync(0xffffffffu, present_s[sl][lane]);  // bit j: key j
        float pr[2][8];
#pragma unroll
        for (u32 r = 0; r < 2u; r++) {
            const float* ss = s_s + (16u * hg + g + 8u * r) * (AMMA_KEYS + 1u) + 2u * qd;
            const float* st = s_t + (ss - s_s);
            float mx = NEG_INF;
            // Absent keys (past n, or a selection slot holding none) score -inf.
#pragma unroll
            for (u32 i = 0; i < 8u; i++) {
                const u32 col = 8u * (i >> 1) + (i & 1u);
                const float v = (ss[col] + st[col]) * scale2;
                pr[r][i] = (present >> (2u * qd + col)) & 1u ? v : NEG_INF;
                mx = fmaxf(mx, pr[r][i]);
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float mn = fmaxf(m[r], mx);
            const float alpha = m[r] == mn ? 1.0f : ex2_approx(m[r] - mn);
            // While no key is present (mn = -inf) every term is ex2(-inf) = 0.
            const float base = mn == NEG_INF ? 0.0f : mn;
            float sum = 0.0f;
#pragma unroll
            for (u32 i = 0; i < 8u; i++) {
                pr[r][i] = ex2_approx(pr[r][i] - base);
                sum += pr[r][i];
            }
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            l[r] = fmaf(l[r], alpha, sum);
            m[r] = mn;
            // Once the maxima settle most tiles change none (a factor of 1 changes no bit).
            if (__any_sync(0xffffffffu, alpha != 1.0f))
#pragma unroll
                for (u32 nt = 0; nt < 16u; nt++) {
                    o[nt][2u * r] *= alpha;
                    o[nt][2u * r + 1u] *= alpha;
                }
        }
        // o += p . keys over the warp's columns dq kq .. + dq: two k steps of 16 keys.
#pragma unroll
        for (u32 ks = 0; ks < 2u; ks++) {
            u32 a0, a1, a2, a3, e0, e1, e2, e3;  // hi and lo parts of the probabilities
            f16x2_split(pr[0][4u * ks], pr[0][4u * ks + 1u], a0, e0);
            f16x2_split(pr[1][4u * ks], pr[1][4u * ks + 1u], a1, e1);
            f16x2_split(pr[0][4u * ks + 2u], pr[0][4u * ks + 3u], a2, e2);
            f16x2_split(pr[1][4u * ks + 2u], pr[1][4u * ks + 3u], a3, e3);
            if (entry) {
                // B of two 8-column tiles by one ldmatrix.trans (lanes 0-15 name rows 16 ks +
                // lane % 16 at tile nt's columns, lanes 16-31 the same rows at tile nt + 1's;
                // past the last tile its reads are not used): p·v = hi·v + lo·v.
                const u16* rowp = k_s + sl * k_lo + (16u * ks + (lane & 15u)) * ld + dq * kq + 8u * (lane >> 4);
                const u32 base = (u32)__cvta_generic_to_shared(rowp);
#pragma unroll
                for (u32 nt = 0; nt < 16u; nt += 2u) {
                    if (nt >= ntiles) break;
                    u32 b0, b1, c0, c1;
                    ldm4t(base + nt * 16u, b0, b1, c0, c1);
                    mma_f16(o[nt], a0, a1, a2, a3, b0, b1);
                    mma_f16(o[nt], e0, e1, e2, e3, b0, b1);
                    if (nt + 1u < ntiles) {
                        mma_f16(o[nt + 1u], a0, a1, a2, a3, c0, c1);
                        mma_f16(o[nt + 1u], e0, e1, e2, e3, c0, c1);
                    }
                }
            } else {
                // B: keys 16 ks + (2 qd, 2 qd + 1) and + 8, column g of each 8-column tile, hi
                // and lo, by one ldmatrix.trans from the key rows (lanes 0-15 name rows 16 ks +
                // lane % 16 of the hi keys, lanes 16-31 the same rows of the lo keys).
                const u16* rowp = k_s + (lane >> 4) * k_lo + (16u * ks + (lane & 15u)) * ld + dq * kq;
                const u32 base = (u32)__cvta_generic_to_shared(rowp);
#pragma unroll
                for (u32 nt = 0; nt < 16u; nt++) {
                    if (nt >= ntiles) break;
                    u32 b0, b1, c0, c1;
                    ldm4t(base + nt * 16u, b0, b1, c0, c1);
                    mma_f16(o[nt], a0, a1, a2, a3, b0, b1);
                    mma_f16(o[nt], a0, a1, a2, a3, c0, c1);
                    mma_f16(o[nt], e0, e1, e2, e3, b0, b1);
                }
            }
        }
    }
    // Rows g and g + 8 are heads 16 hg + g (+ 8).
    if (used == 1u) {
#pragma unroll
        for (u32 r = 0; r < 2u; r++) {
            const u32 h = 16u * hg + g + 8u * r;
            if (h >= hv) continue;
            const float f = amma_factor(m[r], l[r], sink[h0 + h]);
            u16* dst = out + ((u64)t * heads + h0 + h) * d;
#pragma unroll
            for (u32 nt = 0; nt < 16u; nt++) {
                if (nt >= ntiles) break;
                const u32 c = dq * kq + nt * 8u + 2u * qd;
                write_output_pair(dst, c, o[nt][2u * r] * f, o[nt][2u * r + 1u] * f, p, inv_freq, d, rope_half);
            }
        }
        return;
    }
    // This split's state out (with pairs, the pair's), for attention_merge.
    const u64 row0 = (u64)t * heads + h0;  // (token, head) row of the block's first head
    bool writes = true;  // whether this warp writes its columns' state
    if (pairs) {
        // The pair (2i, 2i + 1), one cluster, merges through distributed shared memory: the
        // even block takes the output columns of warps kq = 0 and 1, the odd one 2 and 3. Each
        // block puts its maxima and denominators and, from the warps whose columns the other
        // block takes, their sums (the queries' place, [value][thread]) in its shared memory;
        // the states meet at the even split's, then the odd's, common maximum, the same
        // arithmetic whichever block does it.
        __shared__ float ml_s[AMMA_HEADS][2];
        const u32 rank = split & 1u, peer = rank ^ 1u;
        writes = (kq >> 1) == rank;
        float4* o_s = reinterpret_cast<float4*>(amma);
        __syncthreads();  // the queries are read (or, in a split with no keys, staged)
        if (kq == 0u && qd == 0u)
#pragma unroll
            for (u32 r = 0; r < 2u; r++) {
                ml_s[16u * hg + g + 8u * r][0] = m[r];
                ml_s[16u * hg + g + 8u * r][1] = l[r];
            }
        if (!writes)
#pragma unroll
            for (u32 nt = 0; nt < 16u; nt++)
                if (nt < ntiles) o_s[nt * blockDim.x + threadIdx.x] = make_float4(o[nt][0], o[nt][1], o[nt][2], o[nt][3]);
        cluster_sync();
        if (writes) {
            float fe[2], fo[2];  // the even and odd split's factors of rows g and g + 8
#pragma unroll
            for (u32 r = 0; r < 2u; r++) {
                const u32 h = 16u * hg + g + 8u * r;
                const float pm = cluster_peer(&ml_s[h][0], peer), pl = cluster_peer(&ml_s[h][1], peer);
                const float me = rank ? pm : m[r], le = rank ? pl : l[r];  // the even split's
                const float mo = rank ? m[r] : pm, lo = rank ? l[r] : pl;  // the odd split's
                const float mx = fmaxf(me, mo);
                fe[r] = me == mx ? 1.0f : exp2f(me - mx);
                fo[r] = mo == mx ? 1.0f : exp2f(mo - mx);
                m[r] = mx;
                l[r] = fmaf(lo, fo[r], le * fe[r]);
            }
            // The other block's sums, four column tiles' loads in flight at a time.
#pragma unroll
            for (u32 n0 = 0; n0 < 16u; n0 += 4u) {
                float4 po[4];
#pragma unroll
                for (u32 i = 0; i < 4u; i++)
                    if (n0 + i < ntiles) po[i] = cluster_peer(o_s + (n0 + i) * blockDim.x + threadIdx.x, peer);
#pragma unroll
                for (u32 i = 0; i < 4u; i++) {
                    if (n0 + i >= ntiles) break;
                    const float pv[4] = {po[i].x, po[i].y, po[i].z, po[i].w};
#pragma unroll
                    for (u32 c = 0; c < 4u; c++) {
                        const float ev = rank ? pv[c] : o[n0 + i][c], ov = rank ? o[n0 + i][c] : pv[c];
                        o[n0 + i][c] = fmaf(ov, fo[c >> 1], ev * fe[c >> 1]);
                    }
                }
            }
        }
        cluster_sync();  // the other block has read this one's shared memory
    }
    const u32 state = pairs ? split / 2u : split;
#pragma unroll
    for (u32 r = 0; r < 2u; r++) {
        const u32 h = 16u * hg + g + 8u * r;
        if (h >= hv || !writes) continue;
        float* dst = part_acc + ((row0 + h) * splits + state) * d + dq * kq;
#pragma unroll
        for (u32 nt = 0; nt < 16u; nt++) {
            if (nt >= ntiles) break;
            *reinterpret_cast<float2*>(dst + nt * 8u + 2u * qd) = make_float2(o[nt][2u * r], o[nt][2u * r + 1u]);
        }
        if (kq == 0u && qd == 0u) {
            float* ml = part_ml + ((row0 + h) * splits + state) * 2u;
            ml[0] = m[r];
            ml[1] = l[r];
        }
    }
}

// attention_mma's merge of a token's split states (its arguments, where attention_mma writes
// them), after it: block (h, c, t) takes head h's channel chunk c (of 1, 2 or 4 by the used
// splits a head, so every SM takes part) of token t, when t's keys ran on tensor cores over more
// than one split. Warp 0 brings the head's states to their common maximum (lane l takes states
// l, l + 32, ...; the lanes' parts combined by a fixed butterfly) and the sink joins while
// groups of threads load the sums of states g, g + G, ... (four channels a thread); then each
// group sums its states and the groups' sums are added in group order, rotated back and
// written in bf16. Dynamic shared memory: two arrays of `states` floats, each rounded up to a
// multiple of four, and blockDim.x float4s.
// States a merge thread has in flight at once (eight spill registers on sm_100a).
#define MERGE_AHEAD 4u
DSV4_KERNEL void __launch_bounds__(AMMA_WARPS * 32u) attention_merge(
    const u32* __restrict__ pos, u32 batch, u32 heads, u32 d, u32 wsize, u32 mode, u32 cap, u32 ratio, u32 k,
    const float* __restrict__ sink, const float* __restrict__ inv_freq, u32 rope_half,
    const float* __restrict__ part_acc, const float* __restrict__ part_ml, u32 splits, u32 pairs, u32 mma_from,
    u16* __restrict__ out) {
    pdl_enter();
    extern __shared__ __align__(16) float merge_s[];
    __shared__ float head_f;
    const u32 h = blockIdx.x, chunk = blockIdx.y, t = blockIdx.z;
    const u32 p = batch ? pos[t] : pos[0] + t;
    const AttKeys keys = att_keys(p, wsize, mode, ratio, cap, k);
    const u32 n_w = keys.n_w, n = keys.n;
    if (n < mma_from) return;  // attention_heads' token
    const u32 used = amma_plan(n, n_w, splits, pairs).used;
    if (used < 2u) return;  // written by attention_mma
    const u32 states = pairs ? used / 2u : used;
    const u32 hv = min(AMMA_HEADS, heads - h / AMMA_HEADS * AMMA_HEADS);
    const u32 per_head = used / hv;
    const u32 chunks = per_head >= 4u && d % 512u == 0u ? 4u : per_head >= 2u && d % 256u == 0u ? 2u : 1u;
    if (chunk >= chunks) return;
    const u32 width = d / chunks, quads = width / 4u, groups = blockDim.x / quads;
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    float* f_s = merge_s;                                  // [states] each state's factor
    float* l_s = f_s + ((states + 3u) & ~3u);              // [states] each state's denominator
    float4* sum_s = reinterpret_cast<float4*>(l_s + ((states + 3u) & ~3u));  // [groups][quads]
    const u32 c0 = chunk * width;
    const u64 row = (u64)t * heads + h;
    const u32 q = threadIdx.x % quads, grp = threadIdx.x / quads;
    const float4* src = reinterpret_cast<const float4*>(part_acc + row * splits * d + c0) + q;
    // Group grp's states grp, grp + groups, ... MERGE_AHEAD at a time, the first ones in flight
    // while warp 0 works out the factors.
    float4 v[MERGE_AHEAD];
    const auto load_states = [&](u32 s0) {
#pragma unroll
        for (u32 j = 0; j < MERGE_AHEAD; j++) {
            const u32 sp = s0 + j * groups;
            v[j] = sp < states ? __ldcg(src + (u64)sp * (d / 4u)) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    };
    if (grp < groups) load_states(grp);
    if (warp == 0u) {
        float mx = NEG_INF;
        for (u32 i = lane; i < states; i += 32u) {
            const float* ml = part_ml + (row * splits + i) * 2u;
            const float mi = __ldcg(ml);
            f_s[i] = mi;
            l_s[i] = __ldcg(ml + 1);
            mx = fmaxf(mx, mi);
        }
        mx = warp_max(mx);
        float den = 0.0f;
        for (u32 i = lane; i < states; i += 32u) {  // the lane's own states
            const float mi = f_s[i];
            const float f = mi == mx ? 1.0f : exp2f(mi - mx);  // log2 units
            f_s[i] = f;
            den = fmaf(l_s[i], f, den);
        }
        den = warp_sum(den);
        if (lane == 0u) head_f = amma_factor(mx, den, sink[h]);
    }
    __syncthreads();
    if (grp < groups) {
        float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (u32 s0 = grp; s0 < states; s0 += MERGE_AHEAD * groups) {
            if (s0 != grp) load_states(s0);
#pragma unroll
            for (u32 j = 0; j < MERGE_AHEAD; j++) {
                const u32 sp = s0 + j * groups;
                if (sp < states) {
                    const float f = f_s[sp];
                    a.x = fmaf(v[j].x, f, a.x);
                    a.y = fmaf(v[j].y, f, a.y);
                    a.z = fmaf(v[j].z, f, a.z);
                    a.w = fmaf(v[j].w, f, a.w);
                }
            }
        }
        sum_s[grp * quads + q] = a;
    }
    __syncthreads();
    if (threadIdx.x < quads) {
        float4 a = sum_s[threadIdx.x];
        for (u32 g2 = 1u; g2 < groups; g2++) {
            const float4 b = sum_s[g2 * quads + threadIdx.x];
            a.x += b.x;
            a.y += b.y;
            a.z += b.z;
            a.w += b.w;
        }
        const float f = head_f;
        u16* dst = out + row * d;
        const u32 c = c0 + 4u * threadIdx.x;
        write_output_pair(dst, c, a.x * f, a.y * f, p, inv_freq, d, rope_half);
        write_output_pair(dst, c + 2u, a.z * f, a.w * f, p, inv_freq, d, rope_half);
    }
}

// ---------------------------------------------------------------------------------------------
// Indexer scores on tensor cores
// ---------------------------------------------------------------------------------------------
//
// index_scores_mma: index_scores' scores (its arguments, then T) for T tokens on the f16 MMAs.
// The keys are f16 already; each query value is split as attention_mma's (q = hi + lo, about
// 22 significant bits) and each product is two MMAs (k·hi + k·lo) with f32 sums, so the scores
// agree with the CPU's closely, not bit for bit.
// The dot products run over the channels in an order of the kernel's own (a sum's order does
// not matter to the MMA, only that keys and queries agree): k-step 2 kk + s of lane (g, qd)
// takes channels 32 kk + 8 qd + 4 s + {0, 1} as its k pair 2 qd (+1) and + {2, 3} as 2 qd + 8
// (+9), so a lane reads a key row's 16 bytes at 32 kk + 8 qd for two k-steps at once.
// Block (x, y) takes tokens [IMMA_TOKENS y, + IMMA_TOKENS). Their queries go to shared memory
// once, as f16 parts laid out as the lanes' B fragments ([token][hi, lo][head tile nt][kk]
// [lane], 16 bytes each: conflict-free reads), each token's scaled by the power of two that
// brings its largest |value| just under 2^14 (inside f16's range, and its large values' lo
// parts clear of f16's subnormals; the head weights take the inverse, and a power of two
// rounds nothing). Then the block takes steps of 128 entries (x, x + gridDim.x, ...: a short
// context keeps most blocks idle rather than every block staging queries for a few entries),
// warp w their w-th 16, below the last token's visible count: the tile's keys stay in
// registers as the A operand (the warp's next tile's loads in flight meanwhile), and for each
// token whose visible entries reach the tile the warp takes the heads eight at a time (B, from
// shared memory) over all c channels; on sm_90a each group of four warps takes its 64 keys
// against all 64 heads in one warpgroup MMA a k-step instead (B read by the MMA from shared
// memory, the accumulators laid out as the eight tiles of mma.sync). Then it sums
// max(dot, 0) · scale · w_h over the heads in registers and across the quad. So an entry's
// score depends only on its key and its token's queries and weights, whichever tile, block or
// launch computes it. c % 16 == 0, nh <= 64.
#define IMMA_TOKENS 4u
#define IMMA_WARPS 8u
#define IMMA_NTILES (IDX_MAX_HEADS / 8u)
#define IMMA_KK (IDX_MAX_C / 32u)                       // 32-channel steps (two k-steps each)
#define IMMA_PART (IDX_MAX_HEADS * IDX_MAX_C)            // one f16 part of one token's queries

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// sm_90a: a warpgroup's four warps take 64 keys (M) against the 64 heads (N) in one warpgroup
// MMA a k-step, the queries read by the MMA from shared memory.
#define IMMA_WG 1
#else
#define IMMA_WG 0
#endif

// Where query (h, ch) of a part sits (in f16), for channels ch, ch + 1 (ch even). sm_90a:
// wgmma's B operand, K-major without swizzle, of k-step S = 2 kk + s (1024 f16 each): k
// position j of head h at (j / 8) 512 + (h / 8) 64 + (h % 8) 8 + j % 8. Otherwise the B
// fragment of head tile h / 8, channel step ch / 32 and lane 4 (h % 8) + ch % 32 / 8, element
// ch % 8.
__device__ __forceinline__ u32 imma_query_at(u32 h, u32 ch) {
#if IMMA_WG
    const u32 r = ch % 32u, qd = r / 8u, s = r % 8u / 4u, u = r % 4u;
    return (2u * (ch / 32u) + s) * 1024u + u / 2u * 512u + h / 8u * 64u + h % 8u * 8u + 2u * qd + u % 2u;
#else
    return (((h / 8u) * IMMA_KK + ch / 32u) * 32u + 4u * (h % 8u) + ch % 32u / 8u) * 8u + ch % 8u;
#endif
}

// Every shape runs the full 64 heads x 128 channels, the missing ones zero, so the MMA loops
// unroll whole with no bounds to test (with runtime bounds the kernel took 40 us for a
// 16-token launch over a few hundred entries). Two blocks an SM with warpgroup MMAs (a decode
// token's block stages 32 KB of queries); the mma.sync form needs more registers than that.
DSV4_KERNEL void __launch_bounds__(IMMA_WARPS * 32u, IMMA_WG ? 2 : 1)
    index_scores_mma(const float* __restrict__ q, const float* __restrict__ weights,
                     const u16* __restrict__ entries, u32 cap, u32 nh, u32 c, u32 ratio,
                     const u32* __restrict__ pos, float scale, float wscale, float* __restrict__ scores,
                     u32 tokens, u32 batch) {
    pdl_enter();
    extern __shared__ __align__(16) u16 imma[];
    __shared__ float w_s[IMMA_TOKENS][IDX_MAX_HEADS];
    __shared__ float red[IMMA_TOKENS][IMMA_WARPS];
    // A batch's block row takes one token, over its own sequence's entries (slice t0); pos0 is
    // then the position a chunk would start at for token t0 to sit at pos[t0].
    const u32 t0 = batch ? blockIdx.y : blockIdx.y * IMMA_TOKENS;
    const u32 tb_n = batch ? 1u : min(IMMA_TOKENS, tokens - t0);
    const u32 pos0 = batch ? pos[t0] - t0 : pos[0];
    if (batch) entries += (u64)t0 * cap * c;
    auto visible = [&](u32 t) { return min((pos0 + t + 1u) / ratio, cap); };
    const u32 n_max = visible(t0 + tb_n - 1u);
    if (blockIdx.x * IMMA_WARPS * 16u >= n_max) return;
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, g = lane >> 2, qd = lane & 3u;

    // Each token's queries, a thread's pieces loaded at once and kept: their largest |value|
    // over the block, then the scaled f16 parts (zero past nh heads and c channels).
    const float* qg = q + (u64)t0 * nh * c;
    constexpr u32 QP = IMMA_PART / (4u * IMMA_WARPS * 32u);  // 16-byte pieces a thread
    for (u32 tb = 0; tb < tb_n; tb++) {
        float4 v[QP];
        float mx = 0.0f;
#pragma unroll
        for (u32 k = 0; k < QP; k++) {
            const u32 i = 4u * (threadIdx.x + k * IMMA_WARPS * 32u), h = i / IDX_MAX_C, ch = i % IDX_MAX_C;
            v[k] = h < nh && ch < c ? *reinterpret_cast<const float4*>(qg + ((u64)tb * nh + h) * c + ch)
                                    : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
#pragma unroll
        for (u32 k = 0; k < QP; k++)
            mx = fmaxf(mx, fmaxf(fmaxf(fabsf(v[k].x), fabsf(v[k].y)), fmaxf(fabsf(v[k].z), fabsf(v[k].w))));
        mx = warp_max(mx);
        if (lane == 0u) red[tb][warp] = mx;
        __syncthreads();
        float m = red[tb][0];
        for (u32 w = 1; w < IMMA_WARPS; w++) m = fmaxf(m, red[tb][w]);
        int e = 0;
        frexpf(m, &e);
        const int sh = m > 0.0f && isfinite(m) ? max(-126, min(126, 14 - e)) : 0;
        const float f = ldexpf(1.0f, sh);
        if (threadIdx.x < IDX_MAX_HEADS) {
            const u32 h = threadIdx.x;
            w_s[tb][h] = h < nh ? __fmul_rn(weights[(u64)(t0 + tb) * nh + h], wscale) * scale * ldexpf(1.0f, -sh) : 0.0f;
        }
        u16* part = imma + tb * 2u * IMMA_PART;
#pragma unroll
        for (u32 k = 0; k < QP; k++) {
            const u32 i = 4u * (threadIdx.x + k * IMMA_WARPS * 32u), h = i / IDX_MAX_C, ch = i % IDX_MAX_C;
            u32 h0, l0, h1, l1;
            f16x2_split(v[k].x * f, v[k].y * f, h0, l0);
            f16x2_split(v[k].z * f, v[k].w * f, h1, l1);
            const u32 a0 = imma_query_at(h, ch), a1 = imma_query_at(h, ch + 2u);
            *reinterpret_cast<u32*>(part + a0) = h0;
            *reinterpret_cast<u32*>(part + IMMA_PART + a0) = l0;
            *reinterpret_cast<u32*>(part + a1) = h1;
            *reinterpret_cast<u32*>(part + IMMA_PART + a1) = l1;
        }
    }
#if IMMA_WG
    wg::stores_to_async();
#endif
    __syncthreads();

    auto ld128 = [](const u16* p) { return *reinterpret_cast<const uint4*>(p); };
    // Keys of rows e0 + g and e0 + g + 8, channels 32 kk + 8 qd .. + 7 (the A fragments of
    // k-steps 2 kk and 2 kk + 1); rows past n_max and channels past c zero.
    auto load_keys = [&](u32 e0, uint4(&k0)[IMMA_KK], uint4(&k1)[IMMA_KK]) {
        const bool v0 = e0 + g < n_max, v1 = e0 + g + 8u < n_max;
        const u16* r0 = entries + (u64)(e0 + g) * c + 8u * qd;
        const u16* r1 = r0 + 8u * c;
        const uint4 z = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (u32 kk = 0; kk < IMMA_KK; kk++) {
            const bool in = 32u * kk + 8u * qd < c;
            k0[kk] = v0 && in ? ld128(r0 + 32u * kk) : z;
            k1[kk] = v1 && in ? ld128(r1 + 32u * kk) : z;
        }
    };
    // The warp's next step's keys are in flight while it scores this one's. Loops run on the
    // first key of the warp's group of four (a warpgroup's MMAs take all four warps).
    const u32 stride = 16u * IMMA_WARPS * gridDim.x;
    uint4 k0[IMMA_KK], k1[IMMA_KK], n0[IMMA_KK], n1[IMMA_KK];
    const u32 lead = IMMA_WG ? 16u * (warp % 4u) : 0u;  // the warp's keys past its group's first
    u32 e0 = 16u * (IMMA_WARPS * blockIdx.x + warp);
    if (e0 - lead < n_max) load_keys(e0, n0, n1);
    for (; e0 - lead < n_max; e0 += stride) {
#pragma unroll
        for (u32 kk = 0; kk < IMMA_KK; kk++) {
            k0[kk] = n0[kk];
            k1[kk] = n1[kk];
        }
        if (e0 - lead + stride < n_max) load_keys(e0 + stride, n0, n1);
        for (u32 tb = 0; tb < tb_n; tb++) {
            const u32 t = t0 + tb, n_vis = visible(t);
            if (e0 - lead >= n_vis) continue;
            float acc[IMMA_NTILES][4];
#pragma unroll
            for (u32 nt = 0; nt < IMMA_NTILES; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
#if IMMA_WG
            // k-step 2 kk + s: hi, then lo (the same order as the mma.sync form).
            const u16* qh = imma + tb * 2u * IMMA_PART;
            wg::hold(acc);
            wg::fence();
#pragma unroll
            for (u32 kk = 0; kk < IMMA_KK; kk++) {
                const u32 a[4] = {k0[kk].x, k1[kk].x, k0[kk].y, k1[kk].y};
                const u32 b[4] = {k0[kk].z, k1[kk].z, k0[kk].w, k1[kk].w};
                wg::mma<true>(acc, a, wg::desc(qh + (2u * kk) * 1024u, 1024u));
                wg::mma<true>(acc, a, wg::desc(qh + IMMA_PART + (2u * kk) * 1024u, 1024u));
                wg::mma<true>(acc, b, wg::desc(qh + (2u * kk + 1u) * 1024u, 1024u));
                wg::mma<true>(acc, b, wg::desc(qh + IMMA_PART + (2u * kk + 1u) * 1024u, 1024u));
            }
            wg::commit();
            wg::wait_all();
            wg::hold(acc);
#else
            const u16* qh = imma + tb * 2u * IMMA_PART + 8u * lane;
            const u16* ql = qh + IMMA_PART;
#pragma unroll
            for (u32 kk = 0; kk < IMMA_KK; kk++) {
                const uint4 a = k0[kk], b = k1[kk];
#pragma unroll
                for (u32 nt = 0; nt < IMMA_NTILES; nt++) {
                    const u32 o = (nt * IMMA_KK + kk) * 32u * 8u;
                    const uint4 h = ld128(qh + o), l = ld128(ql + o);
                    mma_f16(acc[nt], a.x, b.x, a.y, b.y, h.x, h.y);
                    mma_f16(acc[nt], a.x, b.x, a.y, b.y, l.x, l.y);
                    mma_f16(acc[nt], a.z, b.z, a.w, b.w, h.z, h.w);
                    mma_f16(acc[nt], a.z, b.z, a.w, b.w, l.z, l.w);
                }
            }
#endif
            // Rows g and g + 8; heads 8 nt + 2 qd (+1).
            float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
            for (u32 nt = 0; nt < IMMA_NTILES; nt++) {
                const float w0 = w_s[tb][8u * nt + 2u * qd], w1 = w_s[tb][8u * nt + 2u * qd + 1u];
                s0 = fmaf(fmaxf(acc[nt][0], 0.0f), w0, s0);
                s0 = fmaf(fmaxf(acc[nt][1], 0.0f), w1, s0);
                s1 = fmaf(fmaxf(acc[nt][2], 0.0f), w0, s1);
                s1 = fmaf(fmaxf(acc[nt][3], 0.0f), w1, s1);
            }
            s0 += __shfl_xor_sync(0xffffffffu, s0, 1);
            s0 += __shfl_xor_sync(0xffffffffu, s0, 2);
            s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
            s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
            float* out = scores + (u64)t * cap + e0 + g;
            if (qd == 0u && e0 + g < n_vis) out[0] = s0;
            if (qd == 0u && e0 + g + 8u < n_vis) out[8] = s1;
        }
    }
}

// ring[(pos0 + t) % W] = kv[t] for the last min(T, W) rows t of the chunk; in a batch, each
// token into its own sequence's ring (slice t) at pos[t] % W.
DSV4_KERNEL void window_write(const float* __restrict__ kv, u32 tokens, u32 d, const u32* __restrict__ pos, u32 wsize,
                              float* __restrict__ window, u32 batch) {
    pdl_enter();
    const u32 rows = batch ? tokens : min(tokens, wsize);
    const u32 skip = tokens - rows;
    const u64 total = (u64)rows * d;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        const u32 t = skip + (u32)(i / d);
        const u32 ch = (u32)(i % d);
        const u32 p = token_pos(pos, t, batch);
        if (batch && p == PARKED) continue;
        const u64 ring = batch ? (u64)t * wsize * d : 0u;
        window[ring + (u64)(p % wsize) * d + ch] = kv[(u64)t * d + ch];
    }
}
