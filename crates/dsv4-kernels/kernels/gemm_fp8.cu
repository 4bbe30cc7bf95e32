// Prefill GEMM for FP8 weights with both operands in e4m3 on Hopper's warpgroup MMAs (sm_90a):
// y[M, N] = x[M, K] . W[N, K]^T, plain or gate+up with the clamped SwiGLU epilogue, grid z the
// groups of a grouped projection (as gemm.cu). The weights stay in the GEMV's packed tiles
// (gemv_tile.cu); the activations are first split by `act_split_e4m3`.
//
// The split: each activation row gets one power-of-two scale s in each group (amax / s <= 448)
// and each element v = x / s two e4m3 codes, hi = e4m3(v) and lo = e4m3(v - hi). For a bf16 x
// with |v| >= 1/4 the pair is exact (v has 8 significant bits, hi takes 4 and the rest fits
// lo); below that lo's subnormal step 2^-9 bounds the error to 2^-10 s, under 2^-17 of the
// amax. So a row's products are those of the bf16 activations, and W . (hi + lo) runs as two
// e4m3 MMAs into the same accumulators: half the FP8 MMA rate, the bf16 rate, with no
// conversion of weights or activations inside the loop.
//
// A block is two warpgroups and takes 128 weight rows (8 tiles; warpgroup w the rows of tiles
// 4w..4w+3 as its MMAs' A) by 128 activation rows (the MMAs' N), K in steps of 128 (two weight
// sub-steps, one FP8 scale block). Each step's weights and hi and lo codes go into shared
// memory by 16-byte asynchronous copies, three steps ahead, laid out as wgmma's K-major
// operands with the 128-byte swizzle: a packed sub-step already holds 16 contiguous k of a row
// in each 16 bytes, so the copies only move them. A step's eight MMAs (four k32 blocks, hi and
// lo) sum into zeroed accumulators that are then multiplied by the rows' block scales into the
// running sums (the FP8 MMAs' own accumulation is short of f32). A row's result depends only
// on its own activations and K.
//
// H100, `prefill_gemm` at 2048 rows against the f16-MMA kernel (gemm.cu): Flash wo_b 199 ->
// 448 TFLOP/s, wq_a+wkv 200 -> 276, wq_b 169 -> 274, shared w1+w3 204 -> 356, w2 195 -> 326.
// Without the swizzle (16-byte core matrices in planes) and with 64-column steps it ran at
// 125-170, bound by L2 traffic.
#include "gemv_tile.cu"

// Kernel arguments (layouts mirrored by `ActSplitArgs` and `GemmFp8Args` in
// dsv4_ops::gpu::gemm).
struct ActSplitArgs {
    const u16* x;       // [m, x_ld] bf16, groups of k columns
    u8* codes;          // [m, codes_ld]: per row the hi codes of every group (kp each), then lo
    float* scales;      // [m, groups]: each row's scale in each group
    u32 k, kp, groups, x_ld, codes_ld;
};

struct GemmFp8Args {
    const u8* codes;    // as ActSplitArgs
    const float* scales;
    const u8* w;        // packed tiles of all groups
    const float* fs0;   // FP8 scales (as GemvArgs::fs0) of W (W1) and W3
    const float* fs1;
    void* y;            // [m, y_ld] bf16 or f32
    u32 m, n, k, kp;    // n: output columns of one group (SwiGLU: of h); kp: K in whole steps
    float post0, post1, limit;
    u32 fp8_br, tiles;  // rows of a scale block; tiles of one group
    u32 y_f32;          // as GemvArgs::y_f32
    u32 y_ld, codes_ld;
};

namespace gemm_fp8 {

using namespace gemv;

constexpr u32 THREADS = 256;
constexpr float E4M3_MAX = 448.0f;

// Two floats to e4m3 codes (first in the low byte), rounded to nearest.
__device__ __forceinline__ u32 to_e4m3x2(float a, float b) {
    u32 d;
    asm("{ .reg .b16 t; cvt.rn.satfinite.e4m3x2.f32 t, %2, %1; cvt.u32.u16 %0, t; }" : "=r"(d) : "f"(a), "f"(b));
    return d;
}

}  // namespace gemm_fp8

// One block a row and group (grid y): the group's amax, scale and hi / lo codes (columns
// k..kp-1 zero).
DSV4_KERNEL void __launch_bounds__(256) act_split_e4m3(const ActSplitArgs a) {
    using namespace gemm_fp8;
    __shared__ float red[8];
    const u32 row = blockIdx.x, z = blockIdx.y;
    pdl_enter();
    const u16* x = a.x + (u64)row * a.x_ld + (u64)z * a.k;
    float amax = 0.0f;
    for (u32 c = threadIdx.x * 8; c < a.k; c += blockDim.x * 8) {
        const uint4 v = *reinterpret_cast<const uint4*>(x + c);
        const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i)
            amax = fmaxf(amax, fmaxf(fabsf(__uint_as_float(w[i] << 16)), fabsf(__uint_as_float(w[i] & 0xffff0000u))));
    }
    amax = warp_max(amax);
    if ((threadIdx.x & 31u) == 0) red[threadIdx.x >> 5] = amax;
    __syncthreads();
    amax = red[0];
    for (u32 i = 1; i < blockDim.x / 32; ++i) amax = fmaxf(amax, red[i]);
    // At least 2^-126 (a normal float, so 1 / s is finite); amax / s <= 448 either way.
    const u8 e = e8m0_scale_for_amax(amax, E4M3_MAX);
    const float s = e8m0_to_f32(e > 1 ? e : (u8)1), inv = 1.0f / s;
    if (threadIdx.x == 0) a.scales[(u64)row * a.groups + z] = s;
    u8* hi = a.codes + (u64)row * a.codes_ld + (u64)z * a.kp;
    u8* lo = hi + (u64)a.groups * a.kp;
    for (u32 c = threadIdx.x * 8; c < a.kp; c += blockDim.x * 8) {
        u32 w[4] = {0, 0, 0, 0};
        if (c < a.k) {
            const uint4 v = *reinterpret_cast<const uint4*>(x + c);
            w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
        }
        u32 h[2], l[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            u32 hc[2], lc[2];
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const u32 pair = w[2 * i + j];
                const float v0 = __uint_as_float(pair << 16) * inv, v1 = __uint_as_float(pair & 0xffff0000u) * inv;
                hc[j] = to_e4m3x2(v0, v1);
                const float2 back = e4m3x2_to_f32(hc[j]);
                lc[j] = to_e4m3x2(v0 - back.x, v1 - back.y);
            }
            h[i] = hc[0] | hc[1] << 16;
            l[i] = lc[0] | lc[1] << 16;
        }
        *reinterpret_cast<uint2*>(hi + c) = make_uint2(h[0], h[1]);
        *reinterpret_cast<uint2*>(lo + c) = make_uint2(l[0], l[1]);
    }
}

namespace gemm_fp8 {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
constexpr u32 ROWS = 128;                     // weight rows of a block
constexpr u32 TOKENS = 128;                   // activation rows of a block
constexpr u32 STEP = 128;                     // K of a step: two FP8 scale columns
constexpr u32 W_BYTES = ROWS * STEP;          // a step's weights
constexpr u32 X_BYTES = TOKENS * STEP;        // a step's hi (or lo) codes
constexpr u32 STAGE_BYTES = W_BYTES + 2 * X_BYTES;
constexpr u32 STAGES = 4;

// d (+)= A . B on m64n128k32 in e4m3; d zeroed first unless `add`. d[4j + i]: rows g (i < 2)
// and g + 8 of the warp's 16, columns 8j + 2 (lane % 4) + i % 2.
__device__ __forceinline__ void mma(float (&d)[64], u64 da, u64 db, bool add) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
        DSV4_WG_D64_REGS ", "
        "%64, %65, p, 1, 1;\n}\n"
        : DSV4_WG_D64(d)
        : "l"(da), "l"(db), "r"((u32)add));
}

// acc += t times the block scales of rows g (sl) and g + 8 (sh).
__device__ __forceinline__ void promote(float (&acc)[64], const float (&t)[64], float sl, float sh) {
#pragma unroll
    for (int i = 0; i < 64; i += 4) {
        acc[i] = fmaf(sl, t[i], acc[i]);
        acc[i + 1] = fmaf(sl, t[i + 1], acc[i + 1]);
        acc[i + 2] = fmaf(sh, t[i + 2], acc[i + 2]);
        acc[i + 3] = fmaf(sh, t[i + 3], acc[i + 3]);
    }
}

template <bool SWIGLU>
__device__ __forceinline__ void kernel(const GemmFp8Args& a) {
    extern __shared__ __align__(1024) u8 smem[];
    const u32 tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5, group = warp >> 2;
    const u32 g = lane >> 2, z = blockIdx.z;
    const u32 tok0 = blockIdx.x * TOKENS, tile0 = blockIdx.y * (ROWS / 16);
    const u32 steps = a.kp / STEP;
    // Swizzled atoms must start on 1 KB (the launch adds 1 KB of slack).
    const u32 base = ((u32)__cvta_generic_to_shared(smem) + 1023u) & ~1023u;
    const u64 tile_b = tile_bytes(a.k / 16);
    const u8* w = a.w + (u64)(z * a.tiles + tile0) * tile_b;
    const u8* x_hi = a.codes + (u64)z * a.kp;
    const u8* x_lo = x_hi + (u64)gridDim.z * a.kp;

    // Step j's copies into stage slot j % STAGES, four pieces of 16 bytes a thread for the
    // weights and for each of hi and lo. Weights: piece p = tid + 256 i is tile p / 128,
    // sub-step 2j + p / 64 % 2, its 16 bytes at p % 64 in the packed sub-step (row
    // 8 (p % 64 / 32) + p % 32 / 4 and chunk p % 4 of the tile, chunk 4 (p / 64 % 2) + p % 4
    // of the step); piece i + 1 is two tiles on (4 KB on in the slot). Codes: piece p is
    // token p / 8, chunk p % 8; piece i + 1 is 32 tokens on (4 KB on). Pieces past the tiles
    // or rows are zero-filled.
    const u32 sub = tid / 64 % 2, pp = tid % 64, wr = 8 * (pp / 32) + pp % 32 / 4;
    const u32 w_dst = wg::sw128(16 * (tid / 128) + wr, 4 * sub + pp % 4);
    const u8* w_src = w + (u64)(tid / 128) * tile_b + sub * 1024 + pp * 16;
    const u32 xn = tid / 8;
    const u32 x_dst = W_BYTES + wg::sw128(xn, tid % 8);
    const u64 x_src = (u64)(tok0 + xn) * a.codes_ld + tid % 8 * 16;
    auto load_weights = [&](u32 j) {
        const u32 slot = base + (j % STAGES) * STAGE_BYTES;
#pragma unroll
        for (u32 i = 0; i < 4; ++i) {
            const bool ok = tile0 + tid / 128 + 2 * i < a.tiles;
            cp_async16_or_zero(slot + w_dst + i * 4096, ok ? w_src + 2 * i * tile_b + (u64)j * 2048 : a.w, ok);
        }
    };
    auto load_acts = [&](u32 j) {
        const u32 slot = base + (j % STAGES) * STAGE_BYTES;
#pragma unroll
        for (u32 i = 0; i < 4; ++i) {
            const bool ok = tok0 + xn + 32 * i < a.m;
            const u64 off = ok ? x_src + (u64)(32 * i) * a.codes_ld + j * STEP : 0;
            cp_async16_or_zero(slot + x_dst + i * 4096, x_hi + off, ok);
            cp_async16_or_zero(slot + x_dst + X_BYTES + i * 4096, x_lo + off, ok);
        }
    };

    // The rows' scale rows: plain tile rows g and g + 8 are weight rows 16t + g and 16t + 8 + g;
    // gate+up tile rows g and g + 8 are W1 and W3 rows 8t + g.
    const u32 t = tile0 + 4 * group + (warp & 3u);
    const u32 tr = SWIGLU ? 8 : 16, ho = SWIGLU ? 0 : 8;
    const u32 r_lo = t * tr + g, r_hi = t * tr + ho + g;
    const u32 groups = (a.k + 63) / 64, last = gridDim.z * a.n - 1;
    const float* fs_lo = a.fs0 + (u64)(min(z * a.n + r_lo, last) / a.fp8_br) * (groups + 1);
    const float* fs_hi = a.fs1 + (u64)(min(z * a.n + r_hi, last) / a.fp8_br) * (groups + 1);

    // Weights do not depend on the previous kernel: the first steps' are asked for before the
    // wait (they join the first step's copy group).
#pragma unroll
    for (u32 j = 0; j < STAGES - 1; ++j)
        if (j < steps) load_weights(j);
    pdl_enter();
#pragma unroll
    for (u32 j = 0; j < STAGES - 1; ++j) {
        if (j < steps) load_acts(j);
        cp_async_commit();
    }

    // A step's MMAs (four k32 blocks, hi and lo) sum into zeroed accumulators, then scaled into
    // the running sums: its two scale columns are one 128-column block.
    float acc[64], tmp[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
    // Descriptors: the low field is the address / 16, so an offset adds offset / 16.
    const u64 a_desc = wg::desc_sw128(base + group * 64 * 128), b_desc = wg::desc_sw128(base + W_BYTES);
#pragma unroll 1
    for (u32 j = 0; j < steps; ++j) {
        cp_async_wait<STAGES - 2>();
        wg::stores_to_async();
        __syncthreads();
        const u32 slot = (j % STAGES) * (STAGE_BYTES / 16);
        wg::fence();
#pragma unroll
        for (u32 kk = 0; kk < 4; ++kk) {
            const u64 da = a_desc + slot + kk * 2, db = b_desc + slot + kk * 2;
            mma(tmp, da, db, kk != 0);
            mma(tmp, da, db + X_BYTES / 16, true);
        }
        wg::commit();
        // While the MMAs run: every warpgroup is past step j - 1's, so its slot takes step
        // j + STAGES - 1.
        if (j + STAGES - 1 < steps) {
            load_weights(j + STAGES - 1);
            load_acts(j + STAGES - 1);
        }
        cp_async_commit();
        // Scale column 2j (the same block as 2j + 1) of rows g and g + 8.
        const float sl = __ldg(fs_lo + 2 * j), sh = __ldg(fs_hi + 2 * j);
        wg::wait_all();
        wg::hold(tmp);
        promote(acc, tmp, sl, sh);
    }
    cp_async_wait<0>();

    if (t >= a.tiles) return;
    const float post0 = a.post0 * __ldg(fs_lo + groups), post1 = a.post1 * __ldg(fs_hi + groups);
    const u64 y_col = (u64)z * a.n;
    const u32 q = lane & 3u;
#pragma unroll
    for (u32 j = 0; j < 16; ++j)
#pragma unroll
        for (u32 i = 0; i < 2; ++i) {
            const u32 tok = tok0 + 8 * j + 2 * q + i;
            if (tok >= a.m) continue;
            const float s = a.scales[(u64)tok * gridDim.z + z];
            const u64 y0 = (u64)tok * a.y_ld + y_col;
            store_rows<SWIGLU>(a, y0, r_lo, r_hi, r_lo, acc[4 * j + i] * s, acc[4 * j + 2 + i] * s, post0, post1);
        }
}
#else
template <bool SWIGLU>
__device__ __forceinline__ void kernel(const GemmFp8Args&) {
    __trap();
}
#endif

}  // namespace gemm_fp8

DSV4_KERNEL void __launch_bounds__(gemm_fp8::THREADS, 1) gemm_fp8_tc(const GemmFp8Args a) { gemm_fp8::kernel<false>(a); }
DSV4_KERNEL void __launch_bounds__(gemm_fp8::THREADS, 1) gemm_swiglu_fp8_tc(const GemmFp8Args a) { gemm_fp8::kernel<true>(a); }
