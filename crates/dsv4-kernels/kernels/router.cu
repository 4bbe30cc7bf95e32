// The MoE router after the gate projection (spec §8): sqrt-softplus scores, then hash routing
// (the device token id's row of tid2eid) or learned routing (top k of score + bias, ties to
// the lowest expert, returned in ascending expert order), and the combine weights
// score / sum(scores) * scale, all on the device: one block per token (route_topk), or the last
// block of the gate projection for every token (gate_route_*, at the end, the gate and the
// routing in one launch). Also the gate projection alone (gate_logits_*), in f32.
#include "dsv4_common.cuh"

using namespace dsv4;

#define ROUTE_K_MAX 16
// Most experts (MAX_EXPERTS in router/mod.rs) and the block size.
#define ROUTE_E_MAX 512
#define ROUTE_THREADS 256

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

// Routes token t from its logits z [e] (read through L2: in gate_route they were written by
// other blocks of the same launch); tid2eid [vocab, k] (hash, may be null) or bias [e]
// (learned); ids [n, k] (i32), weights [n, k]. Learned: k rounds of a block-wide max over the
// keys (distinct, so each round has one winner, whose key its owner then zeroes: below every
// key), then the winners in ascending expert order. The whole block calls it; blockDim.x is a
// multiple of 32, at most 1024.
struct RouteShared {
    u64 key[ROUTE_E_MAX];
    u64 best[2][32];
    u32 chosen[ROUTE_K_MAX];
    float score[ROUTE_K_MAX];
    float total;
};

__device__ __forceinline__ void route_token(const float* z, u32 t, u32 e, u32 k, const u32* __restrict__ tokens,
                                            const u32* __restrict__ tid2eid, u32 vocab,
                                            const float* __restrict__ bias, float scale, int* __restrict__ ids,
                                            float* __restrict__ weights, RouteShared& sh) {
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    if (tid2eid) {
        // An out-of-vocabulary token picks expert 0 k times rather than reading past the table.
        const u32 tok = tokens[t] < vocab ? tokens[t] : 0u;
        if (threadIdx.x < k) sh.chosen[threadIdx.x] = min(tid2eid[(u64)tok * k + threadIdx.x], e - 1u);
    } else {
        // Each thread reads and writes only its own keys (x = threadIdx.x + i * blockDim.x).
        for (u32 x = threadIdx.x; x < e; x += blockDim.x)
            sh.key[x] = route_key(__fadd_rn(route_score(__ldcg(z + x)), bias[x]), x);
        for (u32 j = 0; j < k; j++) {
            u64 best = 0u;
            for (u32 x = threadIdx.x; x < e; x += blockDim.x) best = max(best, sh.key[x]);
#pragma unroll
            for (u32 o = 16u; o > 0u; o >>= 1) best = max(best, __shfl_xor_sync(0xffffffffu, best, o));
            if (lane == 0u) sh.best[j & 1u][warp] = best;
            __syncthreads();
            u64 win = 0u;
            for (u32 w = 0; w < warps; w++) win = max(win, sh.best[j & 1u][w]);
            const u32 x = 0xffffffffu - (u32)win;
            if (x % blockDim.x == threadIdx.x) sh.key[x] = 0u;
            if (threadIdx.x == 0u) sh.chosen[j] = x;
        }
        __syncthreads();
        if (threadIdx.x == 0u) {
            // Ascending expert order (insertion sort of k <= 16).
            for (u32 a = 1; a < k; a++) {
                const u32 v = sh.chosen[a];
                u32 b = a;
                for (; b > 0u && sh.chosen[b - 1u] > v; b--) sh.chosen[b] = sh.chosen[b - 1u];
                sh.chosen[b] = v;
            }
        }
    }
    __syncthreads();
    // The chosen experts' scores side by side, then thread 0 sums them in slot order.
    if (threadIdx.x < k) sh.score[threadIdx.x] = route_score(__ldcg(z + sh.chosen[threadIdx.x]));
    __syncthreads();
    if (threadIdx.x == 0u) {
        float total = 0.0f;
        for (u32 j = 0; j < k; j++) total = __fadd_rn(total, sh.score[j]);
        sh.total = __fadd_rn(total, 1e-20f);
    }
    __syncthreads();
    if (threadIdx.x < k) {
        ids[(u64)t * k + threadIdx.x] = (int)sh.chosen[threadIdx.x];
        weights[(u64)t * k + threadIdx.x] = __fmul_rn(__fdiv_rn(sh.score[threadIdx.x], sh.total), scale);
    }
    __syncthreads();  // the shared arrays are rewritten for the next token
}

// One block per token (grid-stride) routes from the gate logits [n, e].
DSV4_KERNEL void __launch_bounds__(ROUTE_THREADS) route_topk(const float* __restrict__ logits, u32 n, u32 e, u32 k,
                                                             const u32* __restrict__ tokens,
                                                             const u32* __restrict__ tid2eid, u32 vocab,
                                                             const float* __restrict__ bias, float scale,
                                                             int* __restrict__ ids, float* __restrict__ weights) {
    pdl_enter();
    __shared__ RouteShared sh;
    for (u32 t = blockIdx.x; t < n; t += gridDim.x)
        route_token(logits + (u64)t * e, t, e, k, tokens, tid2eid, vocab, bias, scale, ids, weights, sh);
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
DSV4_KERNEL void __launch_bounds__(128) gate_logits_bf16(const float* __restrict__ x, u32 n, u32 d,
                                                         const u16* __restrict__ w, u32 experts,
                                                         float* __restrict__ logits) {
    pdl_enter();
    gate::logits_of_row(x, n, d, w, experts, logits);
}

DSV4_KERNEL void __launch_bounds__(128) gate_logits_f32(const float* __restrict__ x, u32 n, u32 d,
                                                        const float* __restrict__ w, u32 experts,
                                                        float* __restrict__ logits) {
    pdl_enter();
    gate::logits_of_row(x, n, d, w, experts, logits);
}

// The same for many tokens: a block takes gate::EXPERTS rows (the launcher's
// GATE_EXPERTS_PER_BLOCK) instead of one.
DSV4_KERNEL void __launch_bounds__(128) gate_logits_rows_bf16(const float* __restrict__ x, u32 n, u32 d,
                                                              const u16* __restrict__ w, u32 experts,
                                                              float* __restrict__ logits) {
    pdl_enter();
    gate::logits_of_rows(x, n, d, w, experts, logits);
}

DSV4_KERNEL void __launch_bounds__(128) gate_logits_rows_f32(const float* __restrict__ x, u32 n, u32 d,
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
    __shared__ RouteShared sh;
    __threadfence();  // this block's logits are visible before its ticket
    __syncthreads();
    if (threadIdx.x == 0u) last = atomicAdd(counter, 1u) == gridDim.x * gridDim.y - 1u;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (u32 t = 0; t < n; t++)
        route_token(logits + (u64)t * e, t, e, k, tokens, tid2eid, vocab, bias, scale, ids, weights, sh);
    if (threadIdx.x == 0u) *counter = 0u;
}

DSV4_KERNEL void __launch_bounds__(128) gate_route_bf16(const float* __restrict__ x, u32 n, u32 d,
                                                        const u16* __restrict__ w, u32 e, float* __restrict__ logits,
                                                        u32 k, const u32* __restrict__ tokens,
                                                        const u32* __restrict__ tid2eid, u32 vocab,
                                                        const float* __restrict__ bias, float scale,
                                                        int* __restrict__ ids, float* __restrict__ weights,
                                                        u32* __restrict__ counter) {
    pdl_enter();
    gate_route(x, n, d, w, e, logits, k, tokens, tid2eid, vocab, bias, scale, ids, weights, counter);
}

DSV4_KERNEL void __launch_bounds__(128) gate_route_f32(const float* __restrict__ x, u32 n, u32 d,
                                                       const float* __restrict__ w, u32 e, float* __restrict__ logits,
                                                       u32 k, const u32* __restrict__ tokens,
                                                       const u32* __restrict__ tid2eid, u32 vocab,
                                                       const float* __restrict__ bias, float scale,
                                                       int* __restrict__ ids, float* __restrict__ weights,
                                                       u32* __restrict__ counter) {
    pdl_enter();
    gate_route(x, n, d, w, e, logits, k, tokens, tid2eid, vocab, bias, scale, ids, weights, counter);
}
