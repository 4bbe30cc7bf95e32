// Decode GEMV / small-M GEMM: y[M, N] = x[M, K] . W[N, K]^T for M <= 16, bf16 activations,
// f32 accumulation, bf16 output, weights in BF16, FP8 e4m3 (128x128-style block scales, e8m0 or
// f32), NVFP4 (e4m3 per 16 + f32 global) or MXFP4 (e8m0 per 32). Also the fused gate+up
// projection with the clamped SwiGLU epilogue.
//
// Weights are the A operand of mma.m16n8k16 (16 weight rows x 16 k), activations the B operand
// (16 k x 8 activation rows), so one MMA covers 256 weight elements and M = 1..8 costs the same
// as M = 1. Each lane owns whole 16-byte chunks of two weight rows (g and g + 8) and feeds the
// MMA from its own chunk only: the k order inside an MMA is a free permutation as long as A and
// B use the same one, so FP4/FP8 codes are expanded to bf16 pairs in whatever order the bit
// tricks give and the activations are permuted to match with byte permutes. No weight repack.
//
// FP4 codes become bf16 by placing the code bits in the bf16 exponent/mantissa field (value =
// e2m1 * 2^-126, a bf16 subnormal for code +-0.5), then one bf16x2 multiply by the block scale
// times 2^110 makes them e2m1 * scale * 2^-16 exactly (at most 6 significant bits); the final
// 2^16 and the NVFP4 global scale are applied in f32 at the end. e4m3 codes likewise become
// e4m3 * 2^-120 and are renormalised by 2^104; their block scale is applied in f32 per chunk.
//
// Work split: a block owns one tile of 16 output rows (8 gate + 8 up rows for SwiGLU) and one
// K-split; its warps interleave over K steps and are reduced through shared memory in warp
// order. With several K-splits per tile the blocks write partials to a workspace and the last
// block to arrive (per-tile counter) sums them in split order, so results are deterministic.
#include "gemv_tile.cu"

// Kernel arguments (layout mirrored by `GemvArgs` in dsv4_ops::gpu::gemv).
struct GemvArgs {
    const u16* x;       // [m, k] bf16
    const u8* w0;       // plain: the weight; SwiGLU: w1 (gate)
    const u8* w1;       // plain: the weight again; SwiGLU: w3 (up)
    const u8* s0;       // scales of w0 (none for BF16)
    const u8* s1;       // scales of w1
    u16* y;             // [m, n] bf16
    float* ws;          // split-K partials
    u32* counters;      // split-K arrival counters, one per tile, zero between launches
    u32 m, n, k, splits;
    float post0, post1; // epilogue multipliers of w0 / w1 rows
    float limit;        // SwiGLU clamp
    u32 fp8_br, fp8_bc, fp8_f32;
    u32 pad;
};

template <int F, int MT, bool SWIGLU>
__device__ __forceinline__ void gemv_kernel(const GemvArgs& a) {
    using namespace gemv;
    constexpr u32 TR = SWIGLU ? 8 : 16;   // output rows per tile
    constexpr u32 HO = SWIGLU ? 0 : 8;    // row offset of the hi half
    const u32 tile = blockIdx.x, split = blockIdx.y;
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const u32 g = lane >> 2, q = lane & 3u;
    const u32 r_lo = tile * TR + g, r_hi = tile * TR + HO + g;
    const u64 rb = row_bytes<F>(a.k);

    Lane L;
    L.w_lo = r_lo < a.n ? a.w0 + r_lo * rb : nullptr;
    L.w_hi = r_hi < a.n ? a.w1 + r_hi * rb : nullptr;
    L.s_lo = L.s_hi = nullptr;
    if (F == NVFP4 || F == MXFP4) {
        const u64 sb = a.k / (F == NVFP4 ? 16u : 32u);
        if (L.w_lo) L.s_lo = a.s0 + r_lo * sb;
        if (L.w_hi) L.s_hi = a.s1 + r_hi * sb;
    } else if (F == FP8) {
        const u64 sb = (u64)((a.k + a.fp8_bc - 1) / a.fp8_bc) * (a.fp8_f32 ? 4u : 1u);
        if (L.w_lo) L.s_lo = a.s0 + (r_lo / a.fp8_br) * sb;
        if (L.w_hi) L.s_hi = a.s1 + (r_hi / a.fp8_br) * sb;
    }
    L.x_lo = g < a.m ? a.x + (u64)g * a.k : nullptr;
    L.x_hi = (MT == 2 && g + 8 < a.m) ? a.x + (u64)(g + 8) * a.k : nullptr;
    L.chunks = a.k / Format<F>::ELEMS;
    L.fp8_bc = a.fp8_bc;
    L.fp8_f32 = a.fp8_f32 != 0;

    float acc[MT][4];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[m][i] = 0.0f;

    const u32 steps = (L.chunks + STEP_CHUNKS - 1) / STEP_CHUNKS;
    const u32 s_begin = (u32)((u64)steps * split / a.splits);
    const u32 s_end = (u32)((u64)steps * (split + 1) / a.splits);
    for (u32 s = s_begin + warp; s < s_end; s += nw) tile_step<F, MT>(L, s, q, acc);

    if (!reduce_warps<MT>(acc)) return;
    if (!reduce_splits<MT>(acc, a.ws, a.counters, tile, split, a.splits)) return;

#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (u32 i = 0; i < 2; ++i) {
            const u32 m = mt * 8 + 2 * q + i;
            if (m >= a.m) continue;
            if (SWIGLU) {
                if (r_lo < a.n) {
                    const float h = swiglu(acc[mt][i] * a.post0, acc[mt][i + 2] * a.post1, a.limit);
                    a.y[(u64)m * a.n + r_lo] = f32_to_bf16(h);
                }
            } else {
                if (r_lo < a.n) a.y[(u64)m * a.n + r_lo] = f32_to_bf16(acc[mt][i] * a.post0);
                if (r_hi < a.n) a.y[(u64)m * a.n + r_hi] = f32_to_bf16(acc[mt][i + 2] * a.post1);
            }
        }
}

// M <= 8 uses one MMA column block (m8), 9 <= M <= 16 two (m16).
DSV4_KERNEL void gemv_bf16_m8(const GemvArgs a) { gemv_kernel<gemv::BF16, 1, false>(a); }
DSV4_KERNEL void gemv_bf16_m16(const GemvArgs a) { gemv_kernel<gemv::BF16, 2, false>(a); }
DSV4_KERNEL void gemv_swiglu_bf16_m8(const GemvArgs a) { gemv_kernel<gemv::BF16, 1, true>(a); }
DSV4_KERNEL void gemv_swiglu_bf16_m16(const GemvArgs a) { gemv_kernel<gemv::BF16, 2, true>(a); }
DSV4_KERNEL void gemv_fp8_m8(const GemvArgs a) { gemv_kernel<gemv::FP8, 1, false>(a); }
DSV4_KERNEL void gemv_fp8_m16(const GemvArgs a) { gemv_kernel<gemv::FP8, 2, false>(a); }
DSV4_KERNEL void gemv_swiglu_fp8_m8(const GemvArgs a) { gemv_kernel<gemv::FP8, 1, true>(a); }
DSV4_KERNEL void gemv_swiglu_fp8_m16(const GemvArgs a) { gemv_kernel<gemv::FP8, 2, true>(a); }
DSV4_KERNEL void gemv_nvfp4_m8(const GemvArgs a) { gemv_kernel<gemv::NVFP4, 1, false>(a); }
DSV4_KERNEL void gemv_nvfp4_m16(const GemvArgs a) { gemv_kernel<gemv::NVFP4, 2, false>(a); }
DSV4_KERNEL void gemv_swiglu_nvfp4_m8(const GemvArgs a) { gemv_kernel<gemv::NVFP4, 1, true>(a); }
DSV4_KERNEL void gemv_swiglu_nvfp4_m16(const GemvArgs a) { gemv_kernel<gemv::NVFP4, 2, true>(a); }
DSV4_KERNEL void gemv_mxfp4_m8(const GemvArgs a) { gemv_kernel<gemv::MXFP4, 1, false>(a); }
DSV4_KERNEL void gemv_mxfp4_m16(const GemvArgs a) { gemv_kernel<gemv::MXFP4, 2, false>(a); }
DSV4_KERNEL void gemv_swiglu_mxfp4_m8(const GemvArgs a) { gemv_kernel<gemv::MXFP4, 1, true>(a); }
DSV4_KERNEL void gemv_swiglu_mxfp4_m16(const GemvArgs a) { gemv_kernel<gemv::MXFP4, 2, true>(a); }
