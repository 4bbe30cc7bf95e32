// Shared device code of the decode GEMV and grouped-MoE kernels (gemv.cu, moe.cu): one K step
// of one 16-row weight tile on mma.m16n8k16, the in-block and cross-block reductions and the
// SwiGLU epilogue. See gemv.cu for the design.
#pragma once
#include "dsv4_common.cuh"

using namespace dsv4;

namespace gemv {

enum Fmt : int { BF16 = 0, FP8 = 1, NVFP4 = 2, MXFP4 = 3 };

// Chunks (16 bytes) one lane loads per weight row in one step. A step covers 4 * U chunks of a
// row (the four lanes of a quad take consecutive chunks).
constexpr u32 U = 4;
constexpr u32 STEP_CHUNKS = 4 * U;
constexpr u32 MAX_WARPS = 8;

template <int F> struct Format;
template <> struct Format<BF16> { static constexpr u32 ELEMS = 8; };
template <> struct Format<FP8> { static constexpr u32 ELEMS = 16; };
template <> struct Format<NVFP4> { static constexpr u32 ELEMS = 32; };
template <> struct Format<MXFP4> { static constexpr u32 ELEMS = 32; };

// ---- memory access ----

// Weights are read once: keep them out of L1.
__device__ __forceinline__ uint4 ld_stream(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// Activations are re-read by every warp of the SM: through L1.
__device__ __forceinline__ uint4 ld_act(const void* p) {
    return __ldg(reinterpret_cast<const uint4*>(p));
}

// ---- bf16 pair arithmetic ----

__device__ __forceinline__ u32 bf16x2_mul(u32 a, u32 b) {
    u32 d;
    // a * b + (-0): exact products here, and -0 keeps +0 products positive.
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
    return d;
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

__device__ __forceinline__ void mma(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Eight e2m1 codes (nibble k = element k) to four bf16 pairs p[k] = (code k, code k + 4), each
// worth e2m1 * 2^-126.
__device__ __forceinline__ void fp4x8_to_bf16(u32 q, u32 (&p)[4]) {
    p[0] = ((q << 12) & 0x80008000u) | ((q << 6) & 0x01c001c0u);
    p[1] = ((q << 8) & 0x80008000u) | ((q << 2) & 0x01c001c0u);
    p[2] = ((q << 4) & 0x80008000u) | ((q >> 2) & 0x01c001c0u);
    p[3] = (q & 0x80008000u) | ((q >> 6) & 0x01c001c0u);
}

// Four e4m3 codes to bf16 pairs (code 0, code 2) and (code 1, code 3), each worth e4m3 * 2^-120.
__device__ __forceinline__ void fp8x4_to_bf16(u32 q, u32& p02, u32& p13) {
    p02 = ((q << 8) & 0x80008000u) | ((q << 4) & 0x07f007f0u);
    p13 = (q & 0x80008000u) | ((q >> 4) & 0x07f007f0u);
}

// bf16 pair (2^104, 2^104): e4m3 * 2^-120 -> e4m3 * 2^-16, normal for every code.
constexpr u32 FP8_RENORM = 0x73807380u;

// NVFP4 block scale (e4m3 byte) as a bf16 pair worth scale * 2^110 (exact: 4 significant bits).
__device__ __forceinline__ u32 nvfp4_scale_bf16x2(u32 b) {
    float f = __uint_as_float(((b & 0x80u) << 24) | ((b & 0x7fu) << 20));  // e4m3 * 2^-120
    f = __fmul_rn(__fmul_rn(f, 0x1p115f), 0x1p115f);
    return prmt(__float_as_uint(f), 0u, 0x3232u);
}

// MXFP4 block scale (e8m0 byte e <= 144, checked when the weight is created) as a bf16 pair
// worth 2^(e - 127) * 2^110.
__device__ __forceinline__ u32 mxfp4_scale_bf16x2(u32 e) {
    const u32 h = (e + 110u) << 7;
    return h | (h << 16);
}

// ---- one K step of one 16-row tile ----

// Where a lane reads: weight rows g (lo) and g + 8 (hi) of the tile, their scale rows, and the
// activation rows g and g + 8 (null where the row does not exist).
struct Lane {
    const u8* w_lo;
    const u8* w_hi;
    const u8* s_lo;  // NVFP4/MXFP4: the row's scales; FP8: the row block's scales
    const u8* s_hi;
    const u16* x_lo;
    const u16* x_hi;
    u32 chunks;      // 16-byte chunks per weight row
    u32 fp8_bc;      // FP8 block width (elements, a multiple of 64)
    bool fp8_f32;    // FP8 scales are f32 (else e8m0)
};

__device__ __forceinline__ float fp8_scale(const u8* s, u32 kb, bool is_f32) {
    if (s == nullptr) return 0.0f;
    const float v = is_f32 ? __ldg(reinterpret_cast<const float*>(s) + kb) : e8m0_to_f32(__ldg(s + kb));
    return __fmul_rn(v, 65536.0f);
}

// Adds one step's contribution to acc (FP4/BF16: in units of the epilogue scale; FP8: final).
template <int F, int MT>
__device__ __forceinline__ void tile_step(const Lane& L, u32 step, u32 q, float (&acc)[MT][4]) {
    constexpr u32 E = Format<F>::ELEMS;
    uint4 wl[U], wh[U];
    u32 sl[U], sh[U];
    const u32 c0 = step * STEP_CHUNKS + q;
#pragma unroll
    for (u32 u = 0; u < U; ++u) {
        const u32 c = c0 + 4 * u;
        const bool ok = c < L.chunks;
        wl[u] = (ok && L.w_lo) ? ld_stream(L.w_lo + 16ull * c) : make_uint4(0, 0, 0, 0);
        wh[u] = (ok && L.w_hi) ? ld_stream(L.w_hi + 16ull * c) : make_uint4(0, 0, 0, 0);
        if (F == NVFP4) {
            sl[u] = (ok && L.s_lo) ? __ldg(reinterpret_cast<const u16*>(L.s_lo) + c) : 0u;
            sh[u] = (ok && L.s_hi) ? __ldg(reinterpret_cast<const u16*>(L.s_hi) + c) : 0u;
        } else if (F == MXFP4) {
            sl[u] = (ok && L.s_lo) ? __ldg(L.s_lo + c) : 0u;
            sh[u] = (ok && L.s_hi) ? __ldg(L.s_hi + c) : 0u;
        }
    }
#pragma unroll
    for (u32 u = 0; u < U; ++u) {
        // The quad's chunks are consecutive: skip the MMAs when the whole quad is past the row.
        if (step * STEP_CHUNKS + 4 * u >= L.chunks) break;
        const u32 c = c0 + 4 * u;
        const bool ok = c < L.chunks;
        const u32 wlo[4] = {wl[u].x, wl[u].y, wl[u].z, wl[u].w};
        const u32 whi[4] = {wh[u].x, wh[u].y, wh[u].z, wh[u].w};
        // Activation chunk(s) for rows g and g + 8: E bf16 values = E / 8 uint4.
        u32 xl[E / 2], xh[E / 2];
#pragma unroll
        for (u32 v = 0; v < E / 8; ++v) {
            const uint4 a = (ok && L.x_lo) ? ld_act(L.x_lo + (u64)c * E + 8 * v) : make_uint4(0, 0, 0, 0);
            xl[4 * v] = a.x; xl[4 * v + 1] = a.y; xl[4 * v + 2] = a.z; xl[4 * v + 3] = a.w;
            if (MT == 2) {
                const uint4 b = (ok && L.x_hi) ? ld_act(L.x_hi + (u64)c * E + 8 * v) : make_uint4(0, 0, 0, 0);
                xh[4 * v] = b.x; xh[4 * v + 1] = b.y; xh[4 * v + 2] = b.z; xh[4 * v + 3] = b.w;
            }
        }
        if (F == BF16) {
#pragma unroll
            for (u32 j = 0; j < 2; ++j) {
                mma(acc[0], wlo[2 * j], whi[2 * j], wlo[2 * j + 1], whi[2 * j + 1], xl[2 * j], xl[2 * j + 1]);
                if (MT == 2)
                    mma(acc[1], wlo[2 * j], whi[2 * j], wlo[2 * j + 1], whi[2 * j + 1], xh[2 * j], xh[2 * j + 1]);
            }
        } else if (F == FP8) {
            float t[MT][4];
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int i = 0; i < 4; ++i) t[m][i] = 0.0f;
#pragma unroll
            for (u32 j = 0; j < 4; ++j) {
                u32 l02, l13, h02, h13;
                fp8x4_to_bf16(wlo[j], l02, l13);
                fp8x4_to_bf16(whi[j], h02, h13);
                l02 = bf16x2_mul(l02, FP8_RENORM);
                l13 = bf16x2_mul(l13, FP8_RENORM);
                h02 = bf16x2_mul(h02, FP8_RENORM);
                h13 = bf16x2_mul(h13, FP8_RENORM);
                mma(t[0], l02, h02, l13, h13, prmt(xl[2 * j], xl[2 * j + 1], 0x5410u),
                    prmt(xl[2 * j], xl[2 * j + 1], 0x7632u));
                if (MT == 2)
                    mma(t[1], l02, h02, l13, h13, prmt(xh[2 * j], xh[2 * j + 1], 0x5410u),
                        prmt(xh[2 * j], xh[2 * j + 1], 0x7632u));
            }
            // The quad's 64 elements lie in one scale block (fp8_bc is a multiple of 64).
            const u32 kb = (c * 16u) / L.fp8_bc;
            const float s_lo = fp8_scale(L.s_lo, kb, L.fp8_f32);
            const float s_hi = fp8_scale(L.s_hi, kb, L.fp8_f32);
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                acc[m][0] = fmaf(s_lo, t[m][0], acc[m][0]);
                acc[m][1] = fmaf(s_lo, t[m][1], acc[m][1]);
                acc[m][2] = fmaf(s_hi, t[m][2], acc[m][2]);
                acc[m][3] = fmaf(s_hi, t[m][3], acc[m][3]);
            }
        } else {
#pragma unroll
            for (u32 i = 0; i < 4; ++i) {
                u32 sclo, schi;
                if (F == NVFP4) {
                    // Words 0-1 of the chunk use the first 16-block scale, words 2-3 the second.
                    sclo = nvfp4_scale_bf16x2((sl[u] >> (8 * (i >> 1))) & 0xffu);
                    schi = nvfp4_scale_bf16x2((sh[u] >> (8 * (i >> 1))) & 0xffu);
                } else {
                    sclo = mxfp4_scale_bf16x2(sl[u]);
                    schi = mxfp4_scale_bf16x2(sh[u]);
                }
                u32 pl[4], ph[4];
                fp4x8_to_bf16(wlo[i], pl);
                fp4x8_to_bf16(whi[i], ph);
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    pl[k] = bf16x2_mul(pl[k], sclo);
                    ph[k] = bf16x2_mul(ph[k], schi);
                }
                // Activations of word i: elements 8i..8i+7 as (0,1) (2,3) (4,5) (6,7) pairs.
                const u32 x01 = xl[4 * i], x23 = xl[4 * i + 1], x45 = xl[4 * i + 2], x67 = xl[4 * i + 3];
                mma(acc[0], pl[0], ph[0], pl[1], ph[1], prmt(x01, x45, 0x5410u), prmt(x01, x45, 0x7632u));
                mma(acc[0], pl[2], ph[2], pl[3], ph[3], prmt(x23, x67, 0x5410u), prmt(x23, x67, 0x7632u));
                if (MT == 2) {
                    const u32 y01 = xh[4 * i], y23 = xh[4 * i + 1], y45 = xh[4 * i + 2], y67 = xh[4 * i + 3];
                    mma(acc[1], pl[0], ph[0], pl[1], ph[1], prmt(y01, y45, 0x5410u), prmt(y01, y45, 0x7632u));
                    mma(acc[1], pl[2], ph[2], pl[3], ph[3], prmt(y23, y67, 0x5410u), prmt(y23, y67, 0x7632u));
                }
            }
        }
    }
}

// Bytes of one weight row and of its scale row (FP8: of one row block's scales).
template <int F>
__device__ __forceinline__ u64 row_bytes(u32 k) {
    return F == BF16 ? 2ull * k : F == FP8 ? (u64)k : (u64)k / 2;
}

// Sums acc over the block's warps (in warp order) into warp 0. Returns true in warp 0.
template <int MT>
__device__ __forceinline__ bool reduce_warps(float (&acc)[MT][4]) {
    __shared__ float red[MAX_WARPS][MT * 4][32];
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (nw == 1) return true;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int i = 0; i < 4; ++i) red[warp][m * 4 + i][lane] = acc[m][i];
    __syncthreads();
    if (warp != 0) return false;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float s = red[0][m * 4 + i][lane];
            for (u32 w = 1; w < nw; ++w) s += red[w][m * 4 + i][lane];
            acc[m][i] = s;
        }
    return true;
}

// Cross-block split-K: every split stores its tile partial; the last block to arrive sums all
// splits in order. Called by warp 0 only. Returns true in the block that must write the output.
template <int MT>
__device__ __forceinline__ bool reduce_splits(float (&acc)[MT][4], float* ws, u32* counters, u32 tile,
                                              u32 split, u32 splits) {
    if (splits == 1) return true;
    const u32 lane = threadIdx.x & 31u;
    constexpr u32 PER = MT * 4 * 32;
    float* mine = ws + ((u64)tile * splits + split) * PER;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int i = 0; i < 4; ++i) mine[(m * 4 + i) * 32 + lane] = acc[m][i];
    __threadfence();
    __syncwarp();
    u32 arrived = 0;
    if (lane == 0) arrived = atomicAdd(counters + tile, 1u);
    arrived = __shfl_sync(0xffffffffu, arrived, 0);
    if (arrived != splits - 1) return false;
    __threadfence();
    const float* all = ws + (u64)tile * splits * PER;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float s = 0.0f;
            for (u32 p = 0; p < splits; ++p) s += __ldcg(all + p * PER + (m * 4 + i) * 32 + lane);
            acc[m][i] = s;
        }
    // Ready for the next launch (graph replays included).
    if (lane == 0) counters[tile] = 0u;
    return true;
}

__device__ __forceinline__ float silu(float v) { return v / (1.0f + expf(-v)); }

__device__ __forceinline__ float swiglu(float g, float u, float limit) {
    return silu(fminf(g, limit)) * fminf(fmaxf(u, -limit), limit);
}

}  // namespace gemv

