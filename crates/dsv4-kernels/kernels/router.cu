// The MoE router after the gate projection (spec §8): sqrt-softplus scores, then hash routing
// (the device token id's row of tid2eid) or learned routing (top k of score + bias, ties to
// the lowest expert, returned in ascending expert order), and the combine weights
// score / sum(scores) * scale. One warp per token; everything stays on the device.
#include "dsv4_common.cuh"

using namespace dsv4;

#define ROUTE_K_MAX 16

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
            // k rounds of a warp argmax over score + bias, skipping experts already taken.
            u32 taken_mask[ROUTE_K_MAX];
#pragma unroll
            for (u32 r = 0; r < ROUTE_K_MAX; r++) {
                if (r >= k) break;
                float best_v = __uint_as_float(0xff800000u);  // -inf
                u32 best_i = 0xffffffffu;
                for (u32 x = lane; x < e; x += 32u) {
                    bool skip = false;
#pragma unroll
                    for (u32 q = 0; q < ROUTE_K_MAX; q++)
                        if (q < r && taken_mask[q] == x) skip = true;
                    if (skip) continue;
                    const float v = __fadd_rn(route_score(z[x]), bias[x]);
                    if (best_i == 0xffffffffu || better(v, x, best_v, best_i)) {
                        best_v = v;
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
