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
constexpr u32 MAX_WARPS = 16;

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
//
// Weights are stored in a tile layout made once at load time (dsv4_ops::gpu::gemv::pack), so
// that every warp-wide 16-byte load reads 512 contiguous bytes and a tile streams through one
// contiguous region. A tile is 16 rows (plain: rows 16t..16t+15; gate+up: w1 rows 8t..8t+7
// then w3 rows 8t..8t+7) of S = ceil(chunks / 16) steps, rows and K zero-padded. The 16 bytes
// at ((((t * S + s) * U + u) * 2 + h) * 32 + lane) * 16 are chunk 16s + 4u + lane % 4 of tile
// row lane / 4 + 8h. NVFP4/MXFP4 scales follow the same order, 2 (e4m3) or 1 (e8m0) bytes per
// chunk. FP8 block scales stay row-major [ceil(N/br), ceil(K/bc)].

// What a lane reads: its tile's packed codes and scales, the FP8 block-scale rows of tile rows
// g and g + 8, and activation rows g and g + 8 (null where the row does not exist).
struct Lane {
    const u8* w;      // the tile's packed codes
    const u8* s;      // the tile's packed NVFP4/MXFP4 scales
    const u8* fs_lo;  // FP8: block-scale row of tile row g (null past the last row)
    const u8* fs_hi;
    const u16* x_lo;
    const u16* x_hi;
    u32 chunks;       // 16-byte chunks per weight row (unpadded)
    u32 fp8_bc;       // FP8 block width (elements, a multiple of 64)
    bool fp8_f32;     // FP8 scales are f32 (else e8m0)
};

// Bytes of one packed tile: S steps of U x 2 x 512.
__device__ __forceinline__ u64 tile_bytes(u32 chunks) {
    return (u64)((chunks + STEP_CHUNKS - 1) / STEP_CHUNKS) * U * 2 * 512;
}

// One step's loads for one lane: U chunks of rows g and g + 8 and their scales (NVFP4: two
// e4m3 bytes per chunk, MXFP4: one e8m0 byte, FP8: the quad's block scale times 2^16).
struct Frag {
    uint4 wl[U], wh[U];
    u32 sl[U], sh[U];
    float fl[U], fh[U];
};

__device__ __forceinline__ float fp8_scale(const u8* s, u32 kb, bool is_f32) {
    if (s == nullptr) return 0.0f;
    const float v = is_f32 ? __ldg(reinterpret_cast<const float*>(s) + kb) : e8m0_to_f32(__ldg(s + kb));
    return __fmul_rn(v, 65536.0f);
}

template <int F>
__device__ __forceinline__ void frag_load(const Lane& L, u32 step, u32 lane, Frag& f) {
#pragma unroll
    for (u32 u = 0; u < U; ++u) {
        const u64 at = ((u64)step * U + u) * 2 * 32 + lane;  // in 16-byte (code) units
        f.wl[u] = ld_stream(L.w + 16 * at);
        f.wh[u] = ld_stream(L.w + 16 * (at + 32));
        if (F == NVFP4) {
            f.sl[u] = __ldg(reinterpret_cast<const u16*>(L.s) + at);
            f.sh[u] = __ldg(reinterpret_cast<const u16*>(L.s) + at + 32);
        } else if (F == MXFP4) {
            f.sl[u] = __ldg(L.s + at);
            f.sh[u] = __ldg(L.s + at + 32);
        } else if (F == FP8) {
            // One scale for the whole quad (its MMA k's): the quad's 64 elements lie in one
            // scale block, as fp8_bc is a multiple of 64.
            const u32 cq = step * STEP_CHUNKS + 4 * u;
            const bool ok = cq < L.chunks;
            const u32 kb = ok ? (cq * 16u) / L.fp8_bc : 0u;
            f.fl[u] = ok ? fp8_scale(L.fs_lo, kb, L.fp8_f32) : 0.0f;
            f.fh[u] = ok ? fp8_scale(L.fs_hi, kb, L.fp8_f32) : 0.0f;
        }
    }
}

// Adds one step's contribution to acc (FP4/BF16: in units of the epilogue scale; FP8: final).
template <int F, int MT>
__device__ __forceinline__ void frag_compute(const Lane& L, u32 step, u32 lane, const Frag& f, float (&acc)[MT][4]) {
    constexpr u32 E = Format<F>::ELEMS;
    const u32 c0 = step * STEP_CHUNKS + (lane & 3u);
#pragma unroll
    for (u32 u = 0; u < U; ++u) {
        // The quad's chunks are consecutive: skip the MMAs when the whole quad is past the row.
        if (step * STEP_CHUNKS + 4 * u >= L.chunks) break;
        const u32 c = c0 + 4 * u;
        const bool ok = c < L.chunks;
        const u32 wlo[4] = {f.wl[u].x, f.wl[u].y, f.wl[u].z, f.wl[u].w};
        const u32 whi[4] = {f.wh[u].x, f.wh[u].y, f.wh[u].z, f.wh[u].w};
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
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                acc[m][0] = fmaf(f.fl[u], t[m][0], acc[m][0]);
                acc[m][1] = fmaf(f.fl[u], t[m][1], acc[m][1]);
                acc[m][2] = fmaf(f.fh[u], t[m][2], acc[m][2]);
                acc[m][3] = fmaf(f.fh[u], t[m][3], acc[m][3]);
            }
        } else {
#pragma unroll
            for (u32 i = 0; i < 4; ++i) {
                u32 sclo, schi;
                if (F == NVFP4) {
                    // Words 0-1 of the chunk use the first 16-block scale, words 2-3 the second.
                    sclo = nvfp4_scale_bf16x2((f.sl[u] >> (8 * (i >> 1))) & 0xffu);
                    schi = nvfp4_scale_bf16x2((f.sh[u] >> (8 * (i >> 1))) & 0xffu);
                } else {
                    sclo = mxfp4_scale_bf16x2(f.sl[u]);
                    schi = mxfp4_scale_bf16x2(f.sh[u]);
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

// Steps first, first + stride, ... < end of one tile into acc, with the next step's loads in
// flight while the current one is computed. One call site of frag_compute per kernel (the loop
// is not unrolled): the FP4/FP8 step code is large, and a second copy would not fit the
// instruction cache.
template <int F, int MT>
__device__ __forceinline__ void run_steps(const Lane& L, u32 first, u32 end, u32 stride, u32 lane, float (&acc)[MT][4]) {
    if (first >= end) return;
    Frag cur, next;
    frag_load<F>(L, first, lane, cur);
#pragma unroll 1
    for (u32 s = first; s < end; s += stride) {
        if (s + stride < end) frag_load<F>(L, s + stride, lane, next);
        frag_compute<F, MT>(L, s, lane, cur, acc);
        cur = next;
    }
}

// Bytes of one tile's packed scales (NVFP4: 2 per chunk, MXFP4: 1).
template <int F>
__device__ __forceinline__ u64 tile_scale_bytes(u32 chunks) {
    return tile_bytes(chunks) / 16 * (F == NVFP4 ? 2 : 1);
}

// Sums acc over the `wpt` consecutive warps that share a tile (in warp order) into the first of
// them. Every thread of the block must call it. Returns true in each tile's first warp.
template <int MT>
__device__ __forceinline__ bool reduce_warps(float (&acc)[MT][4], u32 wpt) {
    __shared__ float red[MAX_WARPS][MT * 4][32];
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    if (wpt == 1) return true;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int i = 0; i < 4; ++i) red[warp][m * 4 + i][lane] = acc[m][i];
    __syncthreads();
    if (warp % wpt != 0) return false;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float s = red[warp][m * 4 + i][lane];
            for (u32 w = 1; w < wpt; ++w) s += red[warp + w][m * 4 + i][lane];
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

