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

// d += a . b on mma.m16n8k16 with f32 accumulators; A and B in bf16 (BF16 and FP4 weights)
// or, with F16, in f16 (FP8 weights).
#define DSV4_MMA(T)                                                                                  \
    asm("mma.sync.aligned.m16n8k16.row.col.f32." T "." T ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, " \
        "{%8, %9}, {%0, %1, %2, %3};"                                                                \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                             \
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1))
template <bool F16 = false>
__device__ __forceinline__ void mma(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    if (F16) DSV4_MMA("f16");
    else DSV4_MMA("bf16");
}
#undef DSV4_MMA

// MMA accumulators: acc[mt][i] and acc[mt][i + 2] hold tile rows g and g + 8 of column
// (token) mt * 8 + 2 * (lane % 4) + i.
template <int MT>
__device__ __forceinline__ void zero(float (&acc)[MT][4]) {
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[m][i] = 0.0f;
}

// Calls f(mt, i, m) for each accumulator column of this lane whose token m is below `tokens`.
template <int MT, typename Fn>
__device__ __forceinline__ void for_each_token(u32 tokens, Fn f) {
    const u32 q = threadIdx.x & 3u;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (u32 i = 0; i < 2; ++i) {
            const u32 m = mt * 8 + 2 * q + i;
            if (m < tokens) f(mt, i, m);
        }
}

// Eight e2m1 codes to four bf16 pairs p[k] = (element 2k, element 2k + 1), each worth
// e2m1 * 2^-126 (code bits in the bf16 exponent/mantissa field). The packer stores the codes
// bit-permuted inside each 32-bit word (dsv4_ops::gpu::gemv::pack::encode_codes) so that three
// pairs are one rotate and one mask each and the fourth two masks around a rotate.
constexpr u32 FP4_PAIR = 0x81c081c0u;
__device__ __forceinline__ void fp4x8_to_bf16(u32 w, u32 (&p)[4]) {
    p[0] = __funnelshift_r(w, w, 2) & FP4_PAIR;
    p[1] = __funnelshift_r(w, w, 6) & FP4_PAIR;
    p[2] = __funnelshift_r(w, w, 12) & FP4_PAIR;
    p[3] = (w & 0x80c080c0u) | (__funnelshift_r(w, w, 8) & 0x01000100u);
}

// Four e4m3 codes (bytes 0-3 of w, in element order) to the f16 pairs (0, 1) and (2, 3) of
// the same values, exact (e4m3 has 3 mantissa bits and its range 2^-9..448 lies inside f16's),
// one instruction per pair.
__device__ __forceinline__ void e4m3x4_to_f16x2(u32 w, u32& p01, u32& p23) {
    asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %2; cvt.rn.f16x2.e4m3x2 %0, lo; cvt.rn.f16x2.e4m3x2 %1, hi; }"
        : "=r"(p01), "=r"(p23)
        : "r"(w));
}

// A bf16 activation pair to f16 (round to nearest). Exact for |x| in [2^-14, 65504]
// (6.1e-5..65504) and for 0: bf16 has 7 mantissa bits, f16 10. Every GEMV input of the model
// lies there: RMS-normalised vectors, attention outputs and SwiGLU outputs (bounded by the
// clamp); smaller magnitudes round to f16 subnormals (absolute error <= 2^-25).
__device__ __forceinline__ u32 bf16x2_to_f16x2(u32 x) {
    u32 h;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(h) : "f"(__uint_as_float(x & 0xffff0000u)), "f"(__uint_as_float(x << 16)));
    return h;
}

// The values of two e4m3 codes (bytes 0 and 1 of c), exact (through f16, which holds every
// e4m3 value; the hardware conversion handles subnormals).
__device__ __forceinline__ float2 e4m3x2_to_f32(u32 c) {
    u32 h;
    asm("{ .reg .b16 t; cvt.u16.u32 t, %1; cvt.rn.f16x2.e4m3x2 %0, t; }" : "=r"(h) : "r"(c));
    float2 f;
    asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %2; cvt.f32.f16 %0, lo; cvt.f32.f16 %1, hi; }" : "=f"(f.x), "=f"(f.y) : "r"(h));
    return f;
}

// The two NVFP4 block scales of a chunk (e4m3 bytes 0 and 1) as bf16 pairs worth
// scale * 2^110 (exact: 4 significant bits; the hardware e4m3 conversion handles subnormals).
__device__ __forceinline__ void nvfp4_scales_bf16x2(u32 two, u32& s0, u32& s1) {
    const float2 f = e4m3x2_to_f32(two);
    s0 = prmt(__float_as_uint(__fmul_rn(f.x, 0x1p110f)), 0u, 0x3232u);
    s1 = prmt(__float_as_uint(__fmul_rn(f.y, 0x1p110f)), 0u, 0x3232u);
}

// MXFP4 block scale (e8m0 byte e <= 144, checked when the weight is created) as a bf16 pair
// worth 2^(e - 127) * 2^110.
__device__ __forceinline__ u32 mxfp4_scale_bf16x2(u32 e) {
    const u32 h = (e + 110u) << 7;
    return h | (h << 16);
}

// ---- programmatic dependent launch (dsv4_common.cuh) ----
//
// Weights and their scales are constant, so a GEMV loads its first ones before `pdl_wait`;
// activations, the workspace and every output only after it. Each GEMV lets its successor
// launch once its own wait has returned, so at most two are resident.

// ---- one 16-row tile, streamed in 1 KB sub-steps ----
//
// Weights are stored in a tile layout made once at load time (dsv4_ops::gpu::gemv::pack), so
// that every warp-wide 16-byte load reads 512 contiguous bytes and a tile streams through one
// contiguous region. A tile is 16 rows (plain: rows 16t..16t+15; gate+up: w1 rows 8t..8t+7
// then w3 rows 8t..8t+7) of S = ceil(chunks / 16) steps, rows and K zero-padded. The 16 bytes
// at ((((t * S + s) * U + u) * 2 + h) * 32 + lane) * 16 are chunk 16s + 4u + lane % 4 of tile
// row lane / 4 + 8h. NVFP4/MXFP4 scales follow the same order, 2 (e4m3) or 1 (e8m0) bytes per
// chunk. FP8 block scales stay row-major [ceil(N/br), ceil(K/bc)].
//
// Sub-step j = 4s + u of a tile is the 1 KB at j * 1024: chunks 4j..4j+3 of all 16 rows. A
// warp keeps R sub-steps in registers (a ring, 8-10 registers each). FP8 and FP4 refill a slot
// before computing on its data (the data is copied out first), so R KB per warp stay in flight
// through the math; BF16, whose math is short, refills after it and keeps fewer registers.
//
// Activations are read through a generic pointer: from shared memory when the launch staged
// them there (stage_rows, once per block), else from global memory. Staged reads take ~30
// cycles instead of an L2 round trip inside every sub-step's dependency chain.

// What a lane reads, with its own offsets applied: its column of the tile's packed codes and
// scales, the FP8 scale rows of tile rows g and g + 8 (clamped to the last row) and the
// activations of its chunk in rows g and g + 8 (clamped to the last row: columns past M are
// computed and dropped).
struct Lane {
    const u8* w;          // the tile's packed codes + 16 * lane
    const u8* s;          // the tile's packed NVFP4/MXFP4 scales + unit * lane
    const float* fs_lo;   // FP8: scales of tile row g, one per 64 columns
    const float* fs_hi;
    const u16* x_lo;      // activations + chunk (lane % 4)
    const u16* x_hi;
    u32 subs;             // sub-steps of the tile (the last step may be partly padding)
    u32 lane_subs;        // sub-steps whose chunk of this lane is inside K
};

// Bytes of one packed tile: S steps of U x 2 x 512.
__device__ __forceinline__ u64 tile_bytes(u32 chunks) {
    return (u64)((chunks + STEP_CHUNKS - 1) / STEP_CHUNKS) * U * 2 * 512;
}

// Bytes of one tile's packed scales (NVFP4: 2 per chunk, MXFP4: 1).
template <int F>
__device__ __forceinline__ u64 tile_scale_bytes(u32 chunks) {
    return tile_bytes(chunks) / 16 * (F == NVFP4 ? 2 : 1);
}

// A lane's view of one tile: codes and scales at `w` and `s`, `chunks` chunks per row,
// activation rows x_lo and x_hi (FP8 scale rows are set by the caller).
template <int F>
__device__ __forceinline__ void lane_init(Lane& L, const u8* w, const u8* s, u32 chunks, const u16* x_lo,
                                          const u16* x_hi, u32 lane) {
    constexpr u32 E = Format<F>::ELEMS;
    const u32 q = lane & 3u;
    L.w = w + 16 * lane;
    L.s = (F == NVFP4) ? s + 2 * lane : (F == MXFP4) ? s + lane : s;
    L.x_lo = x_lo + q * E;
    L.x_hi = x_hi + q * E;
    L.subs = (chunks + 3) / 4;
    L.lane_subs = chunks > q ? (chunks - q + 3) / 4 : 0u;
}

// One sub-step's loads for one lane: a chunk of rows g and g + 8 and their scales (NVFP4: two
// e4m3 bytes, MXFP4: one e8m0 byte, FP8: the f32 block scale).
struct Sub {
    uint4 wl, wh;
    u32 sl, sh;
};

template <int F, bool PS = false>
__device__ __forceinline__ void sub_load(const Lane& L, u32 j, Sub& f) {
    const u8* w = L.w + (size_t)(j * 1024u);
    f.wl = ld_stream(w);
    f.wh = ld_stream(w + 512);
    if (F == NVFP4) {
        const u16* s = reinterpret_cast<const u16*>(L.s + (size_t)(j * 128u));
        f.sl = __ldg(s);
        f.sh = __ldg(s + 32);
    } else if (F == MXFP4) {
        const u8* s = L.s + (size_t)(j * 64u);
        f.sl = __ldg(s);
        f.sh = __ldg(s + 32);
    } else if (F == FP8 && !PS) {
        // One scale for the whole quad: its 64 elements lie in one scale block.
        f.sl = __float_as_uint(__ldg(L.fs_lo + j));
        f.sh = __float_as_uint(__ldg(L.fs_hi + j));
    }
}

// Activations: written by the previous kernel, so plain coherent loads (after pdl_wait).
__device__ __forceinline__ uint4 ld_act(const u16* p) { return *reinterpret_cast<const uint4*>(p); }

// Adds sub-step j to acc + acc2 (in units of the epilogue scale). FP4
// alternates its MMAs between the two, so that two accumulation chains run side by side
// (measured 2-3% faster); FP8 gives each of its four MMAs its own zeroed accumulator and
// scales them into acc and acc2 alternately, so that no MMA waits for another (H100, Pro
// shared w2 [7168, 3072]: 9.5 -> 9.1 us; two chains 9.3); with PS (M = 1) the FP8 block scales
// are in the staged activations instead; BF16 uses acc only (held to 64 registers).
template <int F, int MT, bool PS = false>
__device__ __forceinline__ void sub_compute(const Lane& L, u32 j, const Sub& f, float (&acc)[MT][4],
                                            float (&acc2)[MT][4]) {
    constexpr u32 E = Format<F>::ELEMS;
    const size_t c = (size_t)(j * 4u * E);
    // Lanes past K hold zero padding; their activations must not be read (0 * inf).
    const bool ok = j < L.lane_subs;
    const u32 wlo[4] = {f.wl.x, f.wl.y, f.wl.z, f.wl.w};
    const u32 whi[4] = {f.wh.x, f.wh.y, f.wh.z, f.wh.w};
    // Activation chunk(s) for rows g and g + 8: E bf16 values = E / 8 uint4.
    u32 xl[E / 2], xh[E / 2];
#pragma unroll
    for (u32 v = 0; v < E / 8; ++v) {
        const uint4 a = ok ? ld_act(L.x_lo + c + 8 * v) : make_uint4(0, 0, 0, 0);
        xl[4 * v] = a.x; xl[4 * v + 1] = a.y; xl[4 * v + 2] = a.z; xl[4 * v + 3] = a.w;
        if (MT == 2) {
            const uint4 b = ok ? ld_act(L.x_hi + c + 8 * v) : make_uint4(0, 0, 0, 0);
            xh[4 * v] = b.x; xh[4 * v + 1] = b.y; xh[4 * v + 2] = b.z; xh[4 * v + 3] = b.w;
        }
    }
    if (F == BF16) {
#pragma unroll
        for (u32 i = 0; i < 2; ++i) {
            mma(acc[0], wlo[2 * i], whi[2 * i], wlo[2 * i + 1], whi[2 * i + 1], xl[2 * i], xl[2 * i + 1]);
            if (MT == 2)
                mma(acc[1], wlo[2 * i], whi[2 * i], wlo[2 * i + 1], whi[2 * i + 1], xh[2 * i], xh[2 * i + 1]);
        }
    } else if (F == FP8 && PS) {
        // Activations staged as f16 times the block scales (stage_prescaled): the MMAs
        // accumulate scaled sums directly, alternating between acc and acc2.
#pragma unroll
        for (u32 i = 0; i < 4; ++i) {
            u32 l01, l23, h01, h23;
            e4m3x4_to_f16x2(wlo[i], l01, l23);
            e4m3x4_to_f16x2(whi[i], h01, h23);
            mma<true>((i & 1) ? acc2[0] : acc[0], l01, h01, l23, h23, xl[2 * i], xl[2 * i + 1]);
        }
    } else if (F == FP8) {
        // f16 MMA: codes convert exactly in one instruction per pair, activations once per pair.
        u32 yl[E / 2], yh[E / 2];
#pragma unroll
        for (u32 i = 0; i < E / 2; ++i) {
            yl[i] = bf16x2_to_f16x2(xl[i]);
            if (MT == 2) yh[i] = bf16x2_to_f16x2(xh[i]);
        }
        // Block scales (f32, e8m0 ones converted at upload).
        const float fl = __uint_as_float(f.sl), fh = __uint_as_float(f.sh);
#pragma unroll
        for (u32 i = 0; i < 4; ++i) {
            // Pairs (elements 0, 1) and (2, 3) of word i: activations in natural order.
            u32 l01, l23, h01, h23;
            e4m3x4_to_f16x2(wlo[i], l01, l23);
            e4m3x4_to_f16x2(whi[i], h01, h23);
            float t[MT][4];
            zero(t);
            mma<true>(t[0], l01, h01, l23, h23, yl[2 * i], yl[2 * i + 1]);
            if (MT == 2) mma<true>(t[1], l01, h01, l23, h23, yh[2 * i], yh[2 * i + 1]);
            float (&d)[MT][4] = (i & 1) ? acc2 : acc;
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                d[m][0] = fmaf(fl, t[m][0], d[m][0]);
                d[m][1] = fmaf(fl, t[m][1], d[m][1]);
                d[m][2] = fmaf(fh, t[m][2], d[m][2]);
                d[m][3] = fmaf(fh, t[m][3], d[m][3]);
            }
        }
    } else {
        u32 sl[2], sh[2];
        if (F == NVFP4) {
            // Words 0-1 of the chunk use the first 16-block scale, words 2-3 the second.
            nvfp4_scales_bf16x2(f.sl, sl[0], sl[1]);
            nvfp4_scales_bf16x2(f.sh, sh[0], sh[1]);
        } else {
            sl[0] = sl[1] = mxfp4_scale_bf16x2(f.sl);
            sh[0] = sh[1] = mxfp4_scale_bf16x2(f.sh);
        }
#pragma unroll
        for (u32 i = 0; i < 4; ++i) {
            u32 pl[4], ph[4];
            fp4x8_to_bf16(wlo[i], pl);
            fp4x8_to_bf16(whi[i], ph);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                pl[k] = bf16x2_mul(pl[k], sl[i >> 1]);
                ph[k] = bf16x2_mul(ph[k], sh[i >> 1]);
            }
            // Pairs (2k, 2k + 1) of word i against activations 8i.. in natural order.
            mma(acc[0], pl[0], ph[0], pl[1], ph[1], xl[4 * i], xl[4 * i + 1]);
            mma(acc2[0], pl[2], ph[2], pl[3], ph[3], xl[4 * i + 2], xl[4 * i + 3]);
            if (MT == 2) {
                mma(acc[1], pl[0], ph[0], pl[1], ph[1], xh[4 * i], xh[4 * i + 1]);
                mma(acc2[1], pl[2], ph[2], pl[3], ph[3], xh[4 * i + 2], xh[4 * i + 3]);
            }
        }
    }
}

// Ring depth and refill order per format (measured on the H200, docs/perf.md). The FP8 depth
// comes from the compile options (`GEMV_FP8_RING` in dsv4_kernels), which the GEMV planner
// also reads to keep FP8 K ranges long enough to fill the ring.
#ifndef DSV4_GEMV_FP8_RING
#error "DSV4_GEMV_FP8_RING must be defined by the compile options"
#endif
template <int F> struct RingOf {
    static constexpr u32 R = F == FP8 ? DSV4_GEMV_FP8_RING : U;
    static constexpr bool EARLY = F != BF16;
};

template <int F> struct Ring {
    Sub r[RingOf<F>::R];
};

// Loads sub-steps j0 .. j0 + R - 1 (those below j1) into the ring.
template <int F, bool PS = false>
__device__ __forceinline__ void ring_load(const Lane& L, u32 j0, u32 j1, Ring<F>& ring) {
#pragma unroll
    for (u32 r = 0; r < RingOf<F>::R; ++r)
        if (j0 + r < j1) sub_load<F, PS>(L, j0 + r, ring.r[r]);
}

// One slot: computes sub-step j of L's tile (if `has`) and refills the slot with sub-step jn of
// Ln's tile (if `has_next`), in the format's order.
template <int F, int MT, bool PS = false>
__device__ __forceinline__ void slot_step(const Lane& L, u32 j, bool has, const Lane& Ln, u32 jn, bool has_next,
                                          Sub& slot, float (&acc)[MT][4], float (&acc2)[MT][4]) {
    if (RingOf<F>::EARLY) {
        const Sub cur = slot;
        if (has_next) sub_load<F, PS>(Ln, jn, slot);
        if (has) sub_compute<F, MT, PS>(L, j, cur, acc, acc2);
    } else {
        if (has) sub_compute<F, MT>(L, j, slot, acc, acc2);
        if (has_next) sub_load<F>(Ln, jn, slot);
    }
}

// acc += acc2.
template <int MT>
__device__ __forceinline__ void fold(float (&acc)[MT][4], const float (&acc2)[MT][4]) {
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[m][i] += acc2[m][i];
}

// Sub-steps [j0, j1) of one tile into acc, the ring already holding j0 .. j0 + R - 1.
template <int F, int MT, bool PS = false>
__device__ __forceinline__ void run_subs(const Lane& L, u32 j0, u32 j1, Ring<F>& ring, float (&acc)[MT][4]) {
    constexpr u32 R = RingOf<F>::R;
    float acc2[MT][4];
    zero(acc2);
#pragma unroll 1
    for (u32 j = j0; j < j1; j += R)
#pragma unroll
        for (u32 r = 0; r < R; ++r)
            slot_step<F, MT, PS>(L, j + r, j + r < j1, L, j + R + r, j + R + r < j1, ring.r[r], acc, acc2);
    fold(acc, acc2);
}

// Sub-steps of steps [s0, s1) of L's tile.
__device__ __forceinline__ u32 sub_begin(u32 s0) { return U * s0; }
__device__ __forceinline__ u32 sub_end(const Lane& L, u32 s1) { return min(U * s1, L.subs); }

// Copies `rows` rows of `len` bf16 from global memory into shared memory: row r from
// row_at(r), a 16-byte aligned pointer (so a row may be gathered), to dst + r * dst_stride
// (len and dst_stride multiples of 8). Every thread of the block calls it; it ends with a
// barrier. Asynchronous copies: faster than a load-store loop (H200, 24 KB a block: a Flash
// MoE down launch 16.7 -> 15.9 us, when that kernel staged its h).
template <class RowAt>
__device__ __forceinline__ void stage_rows(u16* dst, u32 dst_stride, RowAt row_at, u32 rows, u32 len) {
    const u32 per_row = len / 8;
    for (u32 i = threadIdx.x; i < rows * per_row; i += blockDim.x) {
        const u32 r = i / per_row, c = (i % per_row) * 8;
        cp_async16(dst + (u64)r * dst_stride + c, row_at(r) + c);
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
}

// FP8 at M = 1 (PS): stages the block's K range [k0, k0 + len) of activation row 0 as f16
// times the block's FP8 scales (one per 64 columns, normalized to at most 1 per scale row):
// copy 0 with the scale row s0 and, for gate+up (TWO), copy 1 at dst + dst_stride with s1, the
// up rows' scales. The MMA's column 0 (lanes g = 0) then reads copy 0 and column 1 (g = 1)
// copy 1, so its sums come out scaled without a multiply per MMA. Exact where |x * s| >= 2^-14
// (a power-of-two scale; f16 subnormals below).
template <bool TWO>
__device__ __forceinline__ void stage_prescaled(u16* dst, u32 dst_stride, const u16* x, u32 k0, u32 len,
                                                const float* s0, const float* s1) {
    const u32 pieces = len / 8;
    for (u32 i0 = threadIdx.x; i0 < pieces; i0 += 2 * blockDim.x) {
        uint4 v[2];
        float a[2], b[2];
#pragma unroll
        for (u32 u = 0; u < 2; ++u) {
            const u32 i = i0 + u * blockDim.x;
            if (i < pieces) {
                const u32 k = k0 + 8 * i;
                v[u] = ld_act(x + k);
                a[u] = __ldg(s0 + k / 64);
                b[u] = TWO ? __ldg(s1 + k / 64) : 0.0f;
            }
        }
#pragma unroll
        for (u32 u = 0; u < 2; ++u) {
            const u32 i = i0 + u * blockDim.x;
            if (i >= pieces) continue;
            const u32 w[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
            u32 p[4], q[4];
#pragma unroll
            for (u32 e = 0; e < 4; ++e) {
                const float lo = __uint_as_float(w[e] << 16), hi = __uint_as_float(w[e] & 0xffff0000u);
                asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(p[e]) : "f"(hi * a[u]), "f"(lo * a[u]));
                asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(q[e]) : "f"(hi * b[u]), "f"(lo * b[u]));
            }
            *reinterpret_cast<uint4*>(dst + 8 * i) = make_uint4(p[0], p[1], p[2], p[3]);
            if (TWO) *reinterpret_cast<uint4*>(dst + dst_stride + 8 * i) = make_uint4(q[0], q[1], q[2], q[3]);
        }
    }
    __syncthreads();
}

// Prefetches into L2 the scales [g0, g1) of two scale rows (one thread per 128-byte line), so
// that stage_prescaled after the wait finds them there: H100, V4-Flash shared expert w2
// [4096, 2048], 5.1 -> 4.5 us.
__device__ __forceinline__ void prefetch_scales(const float* s0, const float* s1, u32 g0, u32 g1) {
    const u32 lines = (g1 - g0 + 31) / 32 + 1;
    const u32 t = threadIdx.x;
    if (t < 2 * lines) {
        const float* s = (t < lines ? s0 : s1) + min(g0 + 32 * (t % lines), g1 - 1);
        asm volatile("prefetch.global.L2 [%0];" ::"l"(s));
    }
}

// Most warps of one block whose K ranges reduce_warps sums.
constexpr u32 MAX_BLOCK_WARPS = 16;

// Resident 4-warp blocks per multiprocessor the M <= 8 GEMVs and the decode MoE kernels (every
// M) are held to (register cap).
// BF16: 64 registers, 32 warps, on sm_90 (66 registers and 28 warps measured 10-15% slower);
// sm_100 code needs a few more and keeps five. FP8 / FP4 rings refill early and hold a copy of
// a slot: four blocks (128 registers); their GEMVs take blocks of up to 16 warps at the same
// cap (`__launch_bounds__(512, 1)` in gemv.cu).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
#define M8_BLOCKS 5
#else
#define M8_BLOCKS 8
#endif
#define M8_DEEP_BLOCKS 4

// Sums acc over the G consecutive warps of a block that share a tile (in warp order) into the
// first of them. Every thread of the block must call it. Returns true in each tile's first warp.
template <int MT>
__device__ __forceinline__ bool reduce_warps(float (&acc)[MT][4], u32 G) {
    __shared__ float4 red[MAX_BLOCK_WARPS][MT][32];
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) red[warp][mt][lane] = make_float4(acc[mt][0], acc[mt][1], acc[mt][2], acc[mt][3]);
    __syncthreads();
    if (warp % G != 0) return false;
    // Eight warps' sums loaded at a time, then added in warp order: H100, V4-Flash shared
    // expert w1+w3 (8 warps a tile) 7.1 us loading one at a time, 6.9-7.0 us.
    for (u32 w0 = 1; w0 < G; w0 += 8) {
        float4 v[8][MT];
#pragma unroll
        for (u32 u = 0; u < 8; ++u)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                if (w0 + u < G) v[u][mt] = red[warp + w0 + u][mt][lane];
#pragma unroll
        for (u32 u = 0; u < 8; ++u)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                if (w0 + u < G) {
                    acc[mt][0] += v[u][mt].x; acc[mt][1] += v[u][mt].y;
                    acc[mt][2] += v[u][mt].z; acc[mt][3] += v[u][mt].w;
                }
    }
    return true;
}

// Cross-block split-K: every split stores its tile partial; the last one to arrive sums all
// splits in order. Called by one warp per split. Only lanes holding real columns (m of the MMA
// columns) store and load. Returns true in the warp that must write the output.
template <int MT>
__device__ __forceinline__ bool reduce_splits(float (&acc)[MT][4], float* ws, u32* counters, u32 tile,
                                              u32 split, u32 splits, u32 m) {
    if (splits == 1) return true;
    const u32 lane = threadIdx.x & 31u, q = lane & 3u;
    constexpr u32 PER = MT * 4 * 32;
    float4* mine = reinterpret_cast<float4*>(ws + ((u64)tile * splits + split) * PER);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        if (mt * 8 + 2 * q < m) mine[mt * 32 + lane] = make_float4(acc[mt][0], acc[mt][1], acc[mt][2], acc[mt][3]);
    __threadfence();
    __syncwarp();
    u32 arrived = 0;
    if (lane == 0) arrived = atomicAdd(counters + tile, 1u);
    arrived = __shfl_sync(0xffffffffu, arrived, 0);
    if (arrived != splits - 1) return false;
    __threadfence();
    const float4* all = reinterpret_cast<const float4*>(ws + (u64)tile * splits * PER);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        if (mt * 8 + 2 * q >= m) continue;
        float4 s = __ldcg(all + mt * 32 + lane);
#pragma unroll 4
        for (u32 p = 1; p < splits; ++p) {
            const float4 v = __ldcg(all + (u64)p * (PER / 4) + mt * 32 + lane);
            s.x += v.x; s.y += v.y; s.z += v.z; s.w += v.w;
        }
        acc[mt][0] = s.x; acc[mt][1] = s.y; acc[mt][2] = s.z; acc[mt][3] = s.w;
    }
    // Ready for the next launch (graph replays included).
    if (lane == 0) counters[tile] = 0u;
    return true;
}

// Cross-block split-K inside a thread-block cluster (sm_90+). When a tile's ranges span 2..8
// blocks, the launcher makes those blocks one cluster along the grid's y, and reserves after
// the staged activations a mailbox of (blocks - 1) x (tiles per block) tile sums. Each block
// but the first stores its sums into the first block's mailbox (distributed shared memory);
// the first block adds them in split order, the workspace path's order, so both give the same
// bits, without its global-memory fence, atomic and reloads. Two cluster barrier phases order
// it: the first (arrived at the start) makes sure every block runs before its shared memory
// is written, the second that the stores land before the first block reads them and exits.
// Threads that leave early leave both barriers' counts.

// Every thread of every block of the cluster calls this once, at the start.
__device__ __forceinline__ void cluster_sum_open() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
}

// Called by the one warp per block and tile that holds the block's sum (`slot`: the tile's
// place in the block). Returns true in the first block, with acc the sum of all splits.
template <int MT>
__device__ __forceinline__ bool cluster_sum(float (&acc)[MT][4], const float4* mail, u32 slot, u32 block_tiles,
                                            u32 split, u32 splits) {
#if __CUDA_ARCH__ >= 900
    const u32 lane = threadIdx.x & 31u;
    auto box = [&](u32 p, int mt) { return mail + (((p - 1) * block_tiles + slot) * MT + mt) * 32 + lane; };
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
    if (split != 0) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const u32 to = cluster_addr(box(split, mt), 0);
            asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(to), "f"(acc[mt][0]),
                         "f"(acc[mt][1]), "f"(acc[mt][2]), "f"(acc[mt][3])
                         : "memory");
        }
        asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
        return false;
    }
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
    for (u32 p = 1; p < splits; ++p)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const float4 v = *box(p, mt);
            acc[mt][0] += v.x; acc[mt][1] += v.y; acc[mt][2] += v.z; acc[mt][3] += v.w;
        }
#endif
    return true;
}

// Output element i of a launch whose arguments carry `y` and `y_f32` (0: rounded to bf16, 1:
// f32, 2: f32 added to what y holds).
template <class Args>
__device__ __forceinline__ void store_y(const Args& a, u64 i, float v) {
    if (a.y_f32 == 2u) static_cast<float*>(a.y)[i] = __fadd_rn(static_cast<float*>(a.y)[i], v);
    else if (a.y_f32) static_cast<float*>(a.y)[i] = v;
    else static_cast<u16*>(a.y)[i] = f32_to_bf16(v);
}

__device__ __forceinline__ float silu(float v) { return v / (1.0f + expf(-v)); }

__device__ __forceinline__ float swiglu(float g, float u, float limit) {
    return silu(fminf(g, limit)) * fminf(fmaxf(u, -limit), limit);
}

// A lane's sums of one token for tile rows g (lo) and g + 8 (hi), stored in the token's output
// row at y0: gate+up tiles (rows g and g + 8 are W1 and W3 row r_lo) their clamped SwiGLU at
// column c_lo, plain tiles each at its row's column; rows past n are dropped. The prefill
// GEMMs' epilogue (gemm.cu, gemm_fp8.cu).
template <bool SWIGLU, class Args>
__device__ __forceinline__ void store_rows(const Args& a, u64 y0, u32 r_lo, u32 r_hi, u32 c_lo, float lo, float hi,
                                           float post0, float post1) {
    if (SWIGLU) {
        if (r_lo < a.n) store_y(a, y0 + c_lo, swiglu(lo * post0, hi * post1, a.limit));
    } else {
        if (r_lo < a.n) store_y(a, y0 + r_lo, lo * post0);
        if (r_hi < a.n) store_y(a, y0 + r_hi, hi * post1);
    }
}

}  // namespace gemv

