// Manifold-constrained hyper-connections (spec §4) for hc_mult = 4 streams: the mix
// projection of the RMS-normalized streams, Sinkhorn, and the collapse in one kernel per
// token (hc_pre, and hc_head with pre weights only); the expansion back (hc_post).
//
// The stream count is a compile-time 4 (every DeepSeek-V4 model), so the mixing arrays stay
// in registers. Products and sums the CPU reference rounds one by one use __f*_rn in its
// order; only the mix dot products are summed in another (fixed) order.
#include "dsv4_common.cuh"

using namespace dsv4;

#define HC 4
#define MIX ((2 + HC) * HC)

__device__ __forceinline__ float sigmoid_rn(float x) { return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-x))); }

// mu[k] = fn[k, :] . (s * rsqrt(mean(s^2) + eps)) for k < mix (mix <= MIX), into shared mu.
__device__ __forceinline__ void mix_logits(const float* __restrict__ s, u32 width, const float* __restrict__ fn,
                                           u32 mix, float norm_eps, float* mu, float* scratch) {
    float ss = 0.0f;
    for (u32 j = threadIdx.x; j < width; j += blockDim.x) ss = __fadd_rn(ss, __fmul_rn(s[j], s[j]));
    ss = block_sum(ss, scratch);
    const float r = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)width), norm_eps)));
    float acc[MIX];
#pragma unroll
    for (u32 k = 0; k < MIX; k++) acc[k] = 0.0f;
    for (u32 j = threadIdx.x; j < width; j += blockDim.x) {
        const float v = __fmul_rn(s[j], r);
#pragma unroll
        for (u32 k = 0; k < MIX; k++)
            if (k < mix) acc[k] = __fadd_rn(acc[k], __fmul_rn(fn[(u64)k * width + j], v));
    }
#pragma unroll
    for (u32 k = 0; k < MIX; k++) {
        if (k < mix) {
            const float t = block_sum(acc[k], scratch);
            if (threadIdx.x == 0u) mu[k] = t;
        }
    }
    __syncthreads();
}

// x[c] = sum_i pre[i] * s[i * d + c], accumulated from stream 0 up.
__device__ __forceinline__ void collapse(const float* __restrict__ s, u32 d, const float* pre, float* __restrict__ x) {
    for (u32 c = threadIdx.x; c < d; c += blockDim.x) {
        float acc = 0.0f;
#pragma unroll
        for (u32 i = 0; i < HC; i++) acc = __fadd_rn(acc, __fmul_rn(pre[i], s[(u64)i * d + c]));
        x[c] = acc;
    }
}

// Row softmax + eps, column normalize, then iters - 1 (row, column) rounds; eps guards each
// division (the CPU reference's order).
__device__ __forceinline__ void sinkhorn(float (&c)[HC * HC], u32 iters, float eps) {
#pragma unroll
    for (u32 i = 0; i < HC; i++) {
        float m = c[i * HC];
#pragma unroll
        for (u32 j = 1; j < HC; j++) m = fmaxf(m, c[i * HC + j]);
        float s = 0.0f;
#pragma unroll
        for (u32 j = 0; j < HC; j++) {
            c[i * HC + j] = expf(__fsub_rn(c[i * HC + j], m));
            s = __fadd_rn(s, c[i * HC + j]);
        }
#pragma unroll
        for (u32 j = 0; j < HC; j++) c[i * HC + j] = __fadd_rn(__fdiv_rn(c[i * HC + j], s), eps);
    }
    // The first column pass runs even with iters = 0, as in the reference.
    const u32 rounds = iters > 0u ? iters : 1u;
    for (u32 it = 0; it < rounds; it++) {
        if (it > 0u) {
#pragma unroll
            for (u32 i = 0; i < HC; i++) {
                float s = 0.0f;
#pragma unroll
                for (u32 j = 0; j < HC; j++) s = __fadd_rn(s, c[i * HC + j]);
#pragma unroll
                for (u32 j = 0; j < HC; j++) c[i * HC + j] = __fdiv_rn(c[i * HC + j], __fadd_rn(s, eps));
            }
        }
#pragma unroll
        for (u32 j = 0; j < HC; j++) {
            float s = 0.0f;
#pragma unroll
            for (u32 i = 0; i < HC; i++) s = __fadd_rn(s, c[i * HC + j]);
#pragma unroll
            for (u32 i = 0; i < HC; i++) c[i * HC + j] = __fdiv_rn(c[i * HC + j], __fadd_rn(s, eps));
        }
    }
}

// One block per token (grid-stride): streams [n, HC * d] -> x [n, d], post [n, HC], comb [n, HC * HC].
DSV4_KERNEL void hc_pre(const float* __restrict__ streams, u32 n, u32 d, const float* __restrict__ fn,
                        const float* __restrict__ base, const float* __restrict__ scale, u32 sinkhorn_iters,
                        float hc_eps, float norm_eps, float* __restrict__ x, float* __restrict__ post,
                        float* __restrict__ comb) {
    __shared__ float scratch[32];
    __shared__ float mu[MIX];
    __shared__ float pre[HC];
    const u32 width = HC * d;
    for (u32 t = blockIdx.x; t < n; t += gridDim.x) {
        const float* s = streams + (u64)t * width;
        mix_logits(s, width, fn, MIX, norm_eps, mu, scratch);
        if (threadIdx.x == 0u) {
            float c[HC * HC];
#pragma unroll
            for (u32 i = 0; i < HC; i++) {
                pre[i] = __fadd_rn(sigmoid_rn(__fadd_rn(__fmul_rn(scale[0], mu[i]), base[i])), hc_eps);
                post[(u64)t * HC + i] =
                    __fmul_rn(2.0f, sigmoid_rn(__fadd_rn(__fmul_rn(scale[1], mu[HC + i]), base[HC + i])));
            }
#pragma unroll
            for (u32 k = 0; k < HC * HC; k++) c[k] = __fadd_rn(__fmul_rn(scale[2], mu[2 * HC + k]), base[2 * HC + k]);
            sinkhorn(c, sinkhorn_iters, hc_eps);
#pragma unroll
            for (u32 k = 0; k < HC * HC; k++) comb[(u64)t * HC * HC + k] = c[k];
        }
        __syncthreads();
        collapse(s, d, pre, x + (u64)t * d);
        __syncthreads();  // pre and mu are rewritten for the next token
    }
}

// The final collapse before the output norm: pre weights only (fn [HC, HC * d], base [HC], scale [1]).
DSV4_KERNEL void hc_head(const float* __restrict__ streams, u32 n, u32 d, const float* __restrict__ fn,
                         const float* __restrict__ base, const float* __restrict__ scale, float hc_eps,
                         float norm_eps, float* __restrict__ x) {
    __shared__ float scratch[32];
    __shared__ float mu[MIX];
    __shared__ float pre[HC];
    const u32 width = HC * d;
    for (u32 t = blockIdx.x; t < n; t += gridDim.x) {
        const float* s = streams + (u64)t * width;
        mix_logits(s, width, fn, HC, norm_eps, mu, scratch);
        if (threadIdx.x < HC)
            pre[threadIdx.x] =
                __fadd_rn(sigmoid_rn(__fadd_rn(__fmul_rn(scale[0], mu[threadIdx.x]), base[threadIdx.x])), hc_eps);
        __syncthreads();
        collapse(s, d, pre, x + (u64)t * d);
        __syncthreads();
    }
}

// out[t, j, c] = post[t, j] * y[t, c] + sum_i comb[t, i, j] * streams[t, i, c] (out != streams).
DSV4_KERNEL void hc_post(const float* __restrict__ streams, const float* __restrict__ y, const float* __restrict__ post,
                         const float* __restrict__ comb, u32 n, u32 d, float* __restrict__ out) {
    const u64 total = (u64)n * HC * d;
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (u64)gridDim.x * blockDim.x) {
        const u64 t = e / ((u64)HC * d);
        const u32 j = (u32)((e / d) % HC);
        const u32 c = (u32)(e % d);
        const float* s = streams + t * HC * d;
        const float* m = comb + t * HC * HC;
        float acc = __fmul_rn(post[t * HC + j], y[t * d + c]);
#pragma unroll
        for (u32 i = 0; i < HC; i++) acc = __fadd_rn(acc, __fmul_rn(m[i * HC + j], s[(u64)i * d + c]));
        out[e] = acc;
    }
}
