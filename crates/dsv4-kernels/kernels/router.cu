// The MoE router after the gate projection (spec §8): sqrt-softplus scores, then hash routing
// (the device token id's row of tid2eid) or learned routing (top k of score + bias, ties to
// the lowest expert, returned in ascending expert order), and the combine weights
// score / sum(scores) * scale, all on the device, a token by a warp (route_topk) or by a share
// of the last block of the gate projection (gate_route_*, at the end, the gate and the routing
// in one launch). Also the gate projection alone (gate_logits_*), in f32.
#include "dsv4_common.cuh"

using namespace dsv4;

// Most experts (MAX_EXPERTS in router/mod.rs) and the block size.
#define ROUTE_E_MAX 512
#define ROUTE_THREADS 256
// Threads of a gate block (gate_logits_*, gate_route_*; router/mod.rs launches them so).
#define GATE_THREADS 128
// Tokens whose keys gate_route's last block holds at once.
#define GATE_ROUTE_TOKENS 16

__device__ __forceinline__ float route_score(float z) {
    // sqrt(softplus(z)), softplus written as max(z, 0) + log1p(exp(-|z|)).
    return __fsqrt_rn(__fadd_rn(fmaxf(z, 0.0f), log1pf(expf(-fabsf(z)))));
}

// Selection key: larger is better. The value's bits in an order-preserving form (NaN below
// everything, -0 equal to +0) above the complemented index (ties to the lower index). Keys
// are distinct and never 0, so each round of the top-k has one winner, and a taken key set
// to 0 is below every other.
__device__ __forceinline__ u64 route_key(float v, u32 x) {
    const u32 b = __float_as_uint(__fadd_rn(v, 0.0f));  // -0 as +0: equal values tie
    const u32 ordered = v != v ? 0u : (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((u64)ordered << 32) | (0xffffffffu - x);
}

// Learned routing's key of expert x of a token, high word only (route_key's low word is the
// complemented index, rebuilt where the keys are compared): z [e] read through L2 (in
// gate_route they were written by other blocks of the same launch).
__device__ __forceinline__ u32 key_word(const float* z, u32 x, const float* __restrict__ bias) {
    return (u32)(route_key(__fadd_rn(route_score(__ldcg(z + x)), bias[x]), x) >> 32);
}

// Routes token t with a group of G warps (its warp `wig` and lane: the calling thread's place
// in it), from its logits z [e] and, for learned routing, its keys' high words hi [e]
// (key_word); tid2eid [vocab, k] (hash routing; null for learned); ids [n, k] (i32),
// weights [n, k]. Learned: k rounds of a group-wide max over the keys (distinct, so each round
// has one winner; a thread owns experts wig * 32 + lane, then every 32 G on, and a bit for each
// one taken, which then counts as 0, below every key), lane j of the group's first warp keeping
// round j's winner; then the winners in ascending expert order. With G > 1 the warps meet at
// named barrier `bar` (G * 32 threads) and swap their maxima through gbest [2 G] (shared).
// Every thread of the group calls it; its first warp writes the results.
__device__ __forceinline__ void route_token(const float* z, const u32* hi, u32 t, u32 e, u32 k,
                                            const u32* __restrict__ tokens, const u32* __restrict__ tid2eid,
                                            u32 vocab, float scale, int* __restrict__ ids,
                                            float* __restrict__ weights, u32 G, u32 wig, u64* gbest, u32 bar) {
    const u32 lane = threadIdx.x & 31u, gl = wig * 32u + lane, stride = 32u * G;
    u32 chosen = 0;  // lane j < k of the first warp: slot j's expert
    if (tid2eid) {
        // An out-of-vocabulary token picks expert 0 k times rather than reading past the table.
        const u32 tok = tokens[t] < vocab ? tokens[t] : 0u;
        if (lane < k) chosen = min(tid2eid[(u64)tok * k + lane], e - 1u);
    } else {
        u32 taken = 0;
        for (u32 j = 0; j < k; j++) {
            u64 best = 0u;
            for (u32 x = gl, i = 0; x < e; x += stride, i++)
                if (!(taken >> i & 1u)) best = max(best, ((u64)hi[x] << 32) | (0xffffffffu - x));
#pragma unroll
            for (u32 o = 16u; o > 0u; o >>= 1) best = max(best, __shfl_xor_sync(0xffffffffu, best, o));
            if (G > 1u) {
                // Two buffers in turn: a round's maxima are written after every thread of the
                // group has passed the previous round's barrier, so has read the round before.
                if (lane == 0u) gbest[(j & 1u) * G + wig] = best;
                asm volatile("bar.sync %0, %1;" ::"r"(bar), "r"(stride) : "memory");
                for (u32 w = 0; w < G; w++) best = max(best, gbest[(j & 1u) * G + w]);
            }
            const u32 x = 0xffffffffu - (u32)best;
            if (x % stride == gl) taken |= 1u << (x / stride);
            if (gl == j) chosen = x;
        }
        // Ascending expert order: the winner of rank r (the count of smaller winners) moves to
        // lane r.
        u32 rank = 0;
        for (u32 i = 0; i < k; i++) rank += __shfl_sync(0xffffffffu, chosen, i) < chosen;
        u32 sorted = 0;
        for (u32 i = 0; i < k; i++) {
            const u32 v = __shfl_sync(0xffffffffu, chosen, i), r = __shfl_sync(0xffffffffu, rank, i);
            if (r == lane) sorted = v;
        }
        chosen = sorted;
    }
    if (wig != 0u) return;
    // The chosen experts' scores, summed in slot order (every lane the same sum).
    const float score = lane < k ? route_score(__ldcg(z + chosen)) : 0.0f;
    float total = 0.0f;
    for (u32 j = 0; j < k; j++) total = __fadd_rn(total, __shfl_sync(0xffffffffu, score, j));
    total = __fadd_rn(total, 1e-20f);
    if (lane < k) {
        ids[(u64)t * k + lane] = (int)chosen;
        weights[(u64)t * k + lane] = __fmul_rn(__fdiv_rn(score, total), scale);
    }
}

// One warp per token (grid-stride over the warps) routes from the gate logits [n, e]: the warp
// computes its token's key words, then routes it.
DSV4_KERNEL void __launch_bounds__(ROUTE_THREADS) route_topk(const float* __restrict__ logits, u32 n, u32 e, u32 k,
                                                             const u32* __restrict__ tokens,
                                                             const u32* __restrict__ tid2eid, u32 vocab,
                                                             const float* __restrict__ bias, float scale,
                                                             int* __restrict__ ids, float* __restrict__ weights) {
    pdl_enter();
    __shared__ u32 hi[ROUTE_THREADS / 32][ROUTE_E_MAX];
    const u32 warps = blockDim.x / 32u, warp = threadIdx.x / 32u, lane = threadIdx.x & 31u;
    for (u32 t = blockIdx.x * warps + warp; t < n; t += gridDim.x * warps) {
        const float* z = logits + (u64)t * e;
        if (!tid2eid)
            for (u32 x = lane; x < e; x += 32u) hi[warp][x] = key_word(z, x, bias);
        __syncwarp();
        route_token(z, hi[warp], t, e, k, tokens, tid2eid, vocab, scale, ids, weights, 1u, 0u, nullptr, 0u);
        __syncwarp();  // hi[warp] is rewritten for the warp's next token
    }
}

// ---- the gate projection ----
//
// logits[t, e] = x[t] . w[e] in f32 (the MoE gate; its logits are never rounded to bf16: top-k
// gaps can be ~3e-4 relative). One block of 4 warps per expert row and group of up to 64 tokens
// (grid (E, ceil(T / 64))): the block's threads take the row's 8-element chunks in turn (16-byte
// loads, so a block step reads 2 KB of a bf16 row), each weight load serving 8 tokens at a time.
// Each thread sums its chunks in order (fmaf), then a butterfly over the warp and the 4 warps in
// order: one fixed order that depends on D only, so a token's logits do not depend on the other
// tokens of the launch. The row stays in L1 for the block's later token tiles.
namespace gate {

constexpr u32 THREADS = 128;
constexpr u32 WARPS = THREADS / 32;
constexpr u32 TOKENS = 64;  // tokens a block takes (the launcher's GATE_TOKENS)
constexpr u32 TILE = 8;     // tokens one pass over the row serves

__device__ __forceinline__ void load8(const u16* p, float (&f)[8]) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    f[0] = __uint_as_float(v.x << 16);
    f[1] = __uint_as_float(v.x & 0xffff0000u);
    f[2] = __uint_as_float(v.y << 16);
    f[3] = __uint_as_float(v.y & 0xffff0000u);
    f[4] = __uint_as_float(v.z << 16);
    f[5] = __uint_as_float(v.z & 0xffff0000u);
    f[6] = __uint_as_float(v.w << 16);
    f[7] = __uint_as_float(v.w & 0xffff0000u);
}

__device__ __forceinline__ void load8(const float* p, float (&f)[8]) {
    const float4 a = reinterpret_cast<const float4*>(p)[0];
    const float4 b = reinterpret_cast<const float4*>(p)[1];
    f[0] = a.x;
    f[1] = a.y;
    f[2] = a.z;
    f[3] = a.w;
    f[4] = b.x;
    f[5] = b.y;
    f[6] = b.z;
    f[7] = b.w;
}

// Tokens t0..t0+nt (nt <= TT) against the row `w` of expert e.
template <int TT, typename W>
__device__ __forceinline__ void tile(const float* __restrict__ x, u32 d, const W* __restrict__ w, u32 experts,
                                     u32 e, u32 t0, u32 nt, float* __restrict__ logits,
                                     float (&scratch)[WARPS][TILE]) {
    const float* xr[TT];
#pragma unroll
    for (int t = 0; t < TT; ++t) xr[t] = x + (u64)(t0 + min((u32)t, nt - 1u)) * d;
    float acc[TT];
#pragma unroll
    for (int t = 0; t < TT; ++t) acc[t] = 0.0f;
    const u32 n8 = d / 8u;
#pragma unroll 4
    for (u32 c = threadIdx.x; c < n8; c += THREADS) {
        float wf[8];
        load8(w + (u64)c * 8u, wf);
#pragma unroll
        for (int t = 0; t < TT; ++t) {
            float xf[8];
            load8(xr[t] + (u64)c * 8u, xf);
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[t] = fmaf(wf[i], xf[i], acc[t]);
        }
    }
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
#pragma unroll
    for (int t = 0; t < TT; ++t) {
        const float v = warp_sum(acc[t]);
        if (lane == 0u) scratch[warp][t] = v;
    }
    __syncthreads();
    if (threadIdx.x < nt) {
        float s = scratch[0][threadIdx.x];
#pragma unroll
        for (u32 q = 1; q < WARPS; ++q) s = __fadd_rn(s, scratch[q][threadIdx.x]);
        logits[(u64)(t0 + threadIdx.x) * experts + e] = s;
    }
    __syncthreads();  // scratch is reused by the next tile
}

template <typename W>
__device__ __forceinline__ void logits_of_row(const float* __restrict__ x, u32 n, u32 d, const W* __restrict__ w,
                                              u32 experts, float* __restrict__ logits) {
    __shared__ float scratch[WARPS][TILE];
    const u32 e = blockIdx.x;
    const W* row = w + (u64)e * d;
    const u32 end = min(n, (blockIdx.y + 1u) * TOKENS);
    for (u32 t0 = blockIdx.y * TOKENS; t0 < end; t0 += TILE) {
        const u32 nt = min(TILE, end - t0);
        if (nt > 4u) tile<8>(x, d, row, experts, e, t0, nt, logits, scratch);
        else if (nt > 2u) tile<4>(x, d, row, experts, e, t0, nt, logits, scratch);
        else if (nt == 2u) tile<2>(x, d, row, experts, e, t0, nt, logits, scratch);
        else tile<1>(x, d, row, experts, e, t0, nt, logits, scratch);
    }
}

// As `tile<8>` for the EXPERTS rows from e0 at once (rows past `experts` computed on the last
// and dropped): each token's x is read once for all of them. Every logit is summed in the same
// order as `tile`'s, so it is bit-identical.
constexpr u32 EXPERTS = 8;
template <typename W>
__device__ __forceinline__ void tile_experts(const float* __restrict__ x, u32 d, const W* __restrict__ w,
                                             u32 experts, u32 e0, u32 t0, u32 nt, float* __restrict__ logits,
                                             float (&scratch)[WARPS][EXPERTS * TILE]) {
    const float* xr[TILE];
#pragma unroll
    for (u32 t = 0; t < TILE; ++t) xr[t] = x + (u64)(t0 + min(t, nt - 1u)) * d;
    const W* wr[EXPERTS];
#pragma unroll
    for (u32 r = 0; r < EXPERTS; ++r) wr[r] = w + (u64)min(e0 + r, experts - 1u) * d;
    float acc[EXPERTS][TILE];
#pragma unroll
    for (u32 r = 0; r < EXPERTS; ++r)
#pragma unroll
        for (u32 t = 0; t < TILE; ++t) acc[r][t] = 0.0f;
    const u32 n8 = d / 8u;
#pragma unroll 1
    for (u32 c = threadIdx.x; c < n8; c += THREADS) {
        float xf[TILE][8];
#pragma unroll
        for (u32 t = 0; t < TILE; ++t) load8(xr[t] + (u64)c * 8u, xf[t]);
#pragma unroll
        for (u32 r = 0; r < EXPERTS; ++r) {
            float wf[8];
            load8(wr[r] + (u64)c * 8u, wf);
#pragma unroll
            for (u32 t = 0; t < TILE; ++t)
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[r][t] = fmaf(wf[i], xf[t][i], acc[r][t]);
        }
    }
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
#pragma unroll
    for (u32 r = 0; r < EXPERTS; ++r)
#pragma unroll
        for (u32 t = 0; t < TILE; ++t) {
            const float v = warp_sum(acc[r][t]);
            if (lane == 0u) scratch[warp][r * TILE + t] = v;
        }
    __syncthreads();
    if (threadIdx.x < EXPERTS * TILE) {
        const u32 r = threadIdx.x / TILE, t = threadIdx.x % TILE;
        float s = scratch[0][threadIdx.x];
#pragma unroll
        for (u32 q = 1; q < WARPS; ++q) s = __fadd_rn(s, scratch[q][threadIdx.x]);
        if (t < nt && e0 + r < experts) logits[(u64)(t0 + t) * experts + e0 + r] = s;
    }
    __syncthreads();  // scratch is reused by the next tile
}

// A block's EXPERTS rows for its TOKENS tokens.
template <typename W>
__device__ __forceinline__ void logits_of_rows(const float* __restrict__ x, u32 n, u32 d, const W* __restrict__ w,
                                               u32 experts, float* __restrict__ logits) {
    __shared__ float scratch[WARPS][EXPERTS * TILE];
    const u32 end = min(n, (blockIdx.y + 1u) * TOKENS);
    for (u32 t0 = blockIdx.y * TOKENS; t0 < end; t0 += TILE)
        tile_experts(x, d, w, experts, blockIdx.x * EXPERTS, t0, min(TILE, end - t0), logits, scratch);
}

}  // namespace gate

// x [n, d] f32, w [experts, d] bf16 or f32 (d a multiple of 8), logits [n, experts] f32.
DSV4_KERNEL void __launch_bounds__(GATE_THREADS) gate_logits_bf16(const float* __restrict__ x, u32 n, u32 d,
                                                         const u16* __restrict__ w, u32 experts,
                                                         float* __restrict__ logits) {
    pdl_enter();
    gate::logits_of_row(x, n, d, w, experts, logits);
}

DSV4_KERNEL void __launch_bounds__(GATE_THREADS) gate_logits_f32(const float* __restrict__ x, u32 n, u32 d,
                                                        const float* __restrict__ w, u32 experts,
                                                        float* __restrict__ logits) {
    pdl_enter();
    gate::logits_of_row(x, n, d, w, experts, logits);
}

// The same for many tokens: a block takes gate::EXPERTS rows (the launcher's
// GATE_EXPERTS_PER_BLOCK) instead of one.
DSV4_KERNEL void __launch_bounds__(GATE_THREADS) gate_logits_rows_bf16(const float* __restrict__ x, u32 n, u32 d,
                                                              const u16* __restrict__ w, u32 experts,
                                                              float* __restrict__ logits) {
    pdl_enter();
    gate::logits_of_rows(x, n, d, w, experts, logits);
}

DSV4_KERNEL void __launch_bounds__(GATE_THREADS) gate_logits_rows_f32(const float* __restrict__ x, u32 n, u32 d,
                                                             const float* __restrict__ w, u32 experts,
                                                             float* __restrict__ logits) {
    pdl_enter();
    gate::logits_of_rows(x, n, d, w, experts, logits);
}

// The gate projection, then the routing of every token by the last block to finish (an atomic
// ticket on `counter`, which it resets to 0 for the next launch): one launch from x to the
// expert ids and weights. The grid and the logits are gate_logits_*'s.
template <typename W>
__device__ __forceinline__ void gate_route(const float* __restrict__ x, u32 n, u32 d, const W* __restrict__ w,
                                           u32 e, float* __restrict__ logits, u32 k, const u32* __restrict__ tokens,
                                           const u32* __restrict__ tid2eid, u32 vocab, const float* __restrict__ bias,
                                           float scale, int* __restrict__ ids, float* __restrict__ weights,
                                           u32* __restrict__ counter) {
    gate::logits_of_row(x, n, d, w, e, logits);
    __shared__ bool last;
    // [min(n, GATE_ROUTE_TOKENS)][e] (learned routing; the launcher sizes it).
    extern __shared__ u32 hi[];
    __shared__ u64 gbest[GATE_THREADS / 32][2 * (GATE_THREADS / 32)];
    __threadfence();  // this block's logits are visible before its ticket
    __syncthreads();
    if (threadIdx.x == 0u) last = atomicAdd(counter, 1u) == gridDim.x * gridDim.y - 1u;
    __syncthreads();
    if (!last) return;
    __threadfence();
    // GATE_ROUTE_TOKENS tokens at a time: the whole block computes their keys' high words,
    // then the tokens are routed side by side, each by an equal share of the block's warps (a
    // decode step's one token by all four, as many tokens by a warp each).
    for (u32 t0 = 0; t0 < n; t0 += GATE_ROUTE_TOKENS) {
        const u32 nt = min(n - t0, (u32)GATE_ROUTE_TOKENS);
        if (!tid2eid)
            for (u32 i = threadIdx.x; i < nt * e; i += blockDim.x)
                hi[i] = key_word(logits + (u64)(t0 + i / e) * e, i % e, bias);
        __syncthreads();
        const u32 warps = blockDim.x / 32u, G = warps / min(nt, warps), groups = warps / G;
        const u32 group = threadIdx.x / 32u / G, wig = threadIdx.x / 32u % G;
        for (u32 t = group; t < nt; t += groups)
            route_token(logits + (u64)(t0 + t) * e, hi + t * e, t0 + t, e, k, tokens, tid2eid, vocab, scale, ids,
                        weights, G, wig, gbest[group], 1u + group);
        __syncthreads();  // hi is rewritten for the next tokens
    }
    if (threadIdx.x == 0u) *counter = 0u;
}

DSV4_KERNEL void __launch_bounds__(GATE_THREADS) gate_route_bf16(const float* __restrict__ x, u32 n, u32 d,
                                                        const u16* __restrict__ w, u32 e, float* __restrict__ logits,
                                                        u32 k, const u32* __restrict__ tokens,
                                                        const u32* __restrict__ tid2eid, u32 vocab,
                                                        const float* __restrict__ bias, float scale,
                                                        int* __restrict__ ids, float* __restrict__ weights,
                                                        u32* __restrict__ counter) {
    pdl_enter();
    gate_route(x, n, d, w, e, logits, k, tokens, tid2eid, vocab, bias, scale, ids, weights, counter);
}

DSV4_KERNEL void __launch_bounds__(GATE_THREADS) gate_route_f32(const float* __restrict__ x, u32 n, u32 d,
                                                       const float* __restrict__ w, u32 e, float* __restrict__ logits,
                                                       u32 k, const u32* __restrict__ tokens,
                                                       const u32* __restrict__ tid2eid, u32 vocab,
                                                       const float* __restrict__ bias, float scale,
                                                       int* __restrict__ ids, float* __restrict__ weights,
                                                       u32* __restrict__ counter) {
    pdl_enter();
    gate_route(x, n, d, w, e, logits, k, tokens, tid2eid, vocab, bias, scale, ids, weights, counter);
}
