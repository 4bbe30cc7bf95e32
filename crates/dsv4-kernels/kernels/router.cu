// The MoE router after the gate projection (spec §8): sqrt-softplus scores, then hash routing
// (the device token id's row of tid2eid) or learned routing (top k of score + bias, ties to
// the lowest expert, returned in ascending expert order), and the combine weights
// score / sum(scores) * scale. One warp per token; everything stays on the device.
// Also the gate projection before it (gate_logits_*, at the end), in f32.
#include "dsv4_common.cuh"

using namespace dsv4;

#define ROUTE_K_MAX 16
// Experts a lane holds: up to 32 * ROUTE_SLOTS experts (MAX_EXPERTS in router/mod.rs).
#define ROUTE_SLOTS 16

__device__ __forceinline__ float route_score(float z) {
    // sqrt(softplus(z)), softplus written as max(z, 0) + log1p(exp(-|z|)).
    return __fsqrt_rn(__fadd_rn(fmaxf(z, 0.0f), log1pf(expf(-fabsf(z)))));
}

// `better` orders candidates by value (descending), then by lower index.
__device__ __forceinline__ bool better(float v, u32 i, float w, u32 j) { return v > w || (v == w && i < j); }

// logits [n, e]; tid2eid [vocab, k] (hash, may be null) or bias [e] (learned); tokens [n];
// ids [n, k] (i32), weights [n, k].
DSV4_KERNEL void route_topk(const float* __restrict__ logits, u32 n, u32 e, u32 k, const u32* __restrict__ tokens,
                            const u32* __restrict__ tid2eid, u32 vocab, const float* __restrict__ bias, float scale,
                            int* __restrict__ ids, float* __restrict__ weights) {
    pdl_enter();
    const u32 lane = threadIdx.x & 31u;
    const u32 warps = blockDim.x >> 5;
    for (u32 t = blockIdx.x * warps + (threadIdx.x >> 5); t < n; t += gridDim.x * warps) {
        const float* z = logits + (u64)t * e;
        u32 chosen[ROUTE_K_MAX];
        if (tid2eid) {
            // An out-of-vocabulary token picks expert 0 k times rather than reading past the table.
            const u32 tok = tokens[t] < vocab ? tokens[t] : 0u;
#pragma unroll
            for (u32 j = 0; j < ROUTE_K_MAX; j++)
                if (j < k) chosen[j] = min(tid2eid[(u64)tok * k + j], e - 1u);
        } else {
            // Each lane scores its experts (lane + 32 s) once, then k rounds of a warp argmax
            // over score + bias, each round's winner marked taken by the lane holding it.
            float vals[ROUTE_SLOTS];
            u32 taken = 0u;
#pragma unroll
            for (u32 q = 0; q < ROUTE_SLOTS; q++) {
                const u32 x = lane + 32u * q;
                vals[q] = x < e ? __fadd_rn(route_score(z[x]), bias[x]) : 0.0f;
                if (x >= e) taken |= 1u << q;
            }
            u32 taken_mask[ROUTE_K_MAX];
#pragma unroll
            for (u32 r = 0; r < ROUTE_K_MAX; r++) {
                if (r >= k) break;
                float best_v = __uint_as_float(0xff800000u);  // -inf
                u32 best_i = 0xffffffffu;
#pragma unroll
                for (u32 q = 0; q < ROUTE_SLOTS; q++) {
                    const u32 x = lane + 32u * q;
                    if (!((taken >> q) & 1u) && (best_i == 0xffffffffu || better(vals[q], x, best_v, best_i))) {
                        best_v = vals[q];
                        best_i = x;
                    }
                }
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) {
                    const float ov = __shfl_xor_sync(0xffffffffu, best_v, o);
                    const u32 oi = __shfl_xor_sync(0xffffffffu, best_i, o);
                    if (oi != 0xffffffffu && (best_i == 0xffffffffu || better(ov, oi, best_v, best_i))) {
                        best_v = ov;
                        best_i = oi;
                    }
                }
                if (best_i != 0xffffffffu && (best_i & 31u) == lane) taken |= 1u << (best_i >> 5);
                taken_mask[r] = best_i;
            }
            // Ascending expert order, as the reference returns them.
#pragma unroll
            for (u32 a = 0; a < ROUTE_K_MAX; a++)
#pragma unroll
                for (u32 b = 0; b + 1 < ROUTE_K_MAX; b++)
                    if (b + 1 < k && taken_mask[b] > taken_mask[b + 1]) {
                        const u32 tmp = taken_mask[b];
                        taken_mask[b] = taken_mask[b + 1];
                        taken_mask[b + 1] = tmp;
                    }
#pragma unroll
            for (u32 j = 0; j < ROUTE_K_MAX; j++)
                if (j < k) chosen[j] = taken_mask[j];
        }
        if (lane == 0u) {
            float total = 0.0f;
#pragma unroll
            for (u32 j = 0; j < ROUTE_K_MAX; j++)
                if (j < k) total = __fadd_rn(total, route_score(z[chosen[j]]));
            total = __fadd_rn(total, 1e-20f);
#pragma unroll
            for (u32 j = 0; j < ROUTE_K_MAX; j++) {
                if (j < k) {
                    ids[(u64)t * k + j] = (int)chosen[j];
                    weights[(u64)t * k + j] = __fmul_rn(__fdiv_rn(route_score(z[chosen[j]]), total), scale);
                }
            }
        }
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
        float v = acc[t];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
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
