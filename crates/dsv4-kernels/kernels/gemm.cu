// Prefill GEMM: y[M, N] = x[M, K] . W[N, K]^T for chunks of many activation rows, on the decode
// GEMV's packed weight tiles and MMA operand order (gemv_tile.cu, gemv.cu), so every weight the
// GEMV takes runs here as uploaded: BF16, FP8 e4m3 with block scales (on the f16 MMA), NVFP4
// and MXFP4 (on the bf16 MMA). Plain or gate+up with the clamped SwiGLU epilogue. Grid z
// selects the z-th stack of `tiles` weight tiles, either a group (grouped projections: x
// columns [z * K, (z + 1) * K), y columns [z * N, (z + 1) * N)) or an expert (routed experts:
// its rows come from a list on the device, entry r naming x row r / row_div and y row r, and
// its epilogue multipliers from per-expert factors). Blocks walk their z's row blocks in
// grid-x strides, so a list's length is read on the device.
//
// A block is 8 warps, one 16-row weight tile each, and 64 activation rows (eight MMA column
// blocks of 8). Each weight sub-step a warp loads (1 KB: 32 k of BF16, 64 of FP8, 128 of FP4)
// is expanded once and multiplied against all eight column blocks, so a weight byte is read
// once per 64 rows (the GEMV reads it once per 16). The activations pass through shared memory
// in slabs of 256 columns, two in turn: the next slab's global loads are issued before the
// current slab's MMAs and stored after them (FP8: converted to f16 on the way, exact for the
// model's activations, gemv_tile.cu). Each warp sums the whole K of its tile in registers, in
// an order that depends only on K: a row's result does not depend on M or on the other rows.
//
// On sm_90a the MMAs are Hopper's warpgroup MMAs (wgmma): each group of four warps multiplies
// its 64 weight rows, expanded in registers as before, by the slab's rows read straight from
// shared memory (no activation fragments in registers), one asynchronous instruction per 16 k.
// The slab is then stored in wgmma's layout (`wg`); elsewhere the warps use mma.sync.
#include "gemv_tile.cu"

// Kernel arguments (layout mirrored by `GemmArgs` in dsv4_ops::gpu::gemm).
struct GemmArgs {
    const u16* x;      // [m, x_ld] bf16
    const u8* w;       // packed tiles of all of z's stacks
    const u8* s;       // packed NVFP4/MXFP4 scales
    const float* fs0;  // FP8 scales (as GemvArgs::fs0), rows of all groups
    const float* fs1;
    void* y;           // [m, y_ld] bf16 or f32
    const u32* rows;   // lists [z][list_stride] of row entries; null: rows 0..m-1
    const u32* counts; // entries in each list (with rows)
    const float* g0;   // per z: factors of post0 / post1 (null: 1)
    const float* g1;
    u32 m, n, k;       // n: output columns of one stack (SwiGLU: of h)
    float post0, post1, limit;
    u32 fp8_br;
    u32 tiles;         // tiles of one stack
    u32 y_f32;         // as GemvArgs::y_f32
    u32 x_ld, y_ld;
    u32 x_col_z, y_col_z;  // x and y column offsets per z (grouped: k and n)
    u32 list_stride, row_div;
    u32 y_perm;        // gate+up on the _tc kernels: h column c stored at fp4_k_pos(c)
};

namespace gemm {

using namespace gemv;

constexpr u32 WARPS = 8;
constexpr u32 THREADS = WARPS * 32;
// Slab columns, and the slab's row stride in shared memory. A 16-byte shared load is served a
// quarter-warp at a time (lanes g = 2h, 2h + 1 and q = 0..3), so those eight lanes must read
// the eight different 16-byte units of the 32 banks (unit = address / 16 mod 8) to take one
// pass. Counted in 16-byte units of a row, lane (g, q) reads q (BF16), 2q and 2q + 1 (FP8) or
// 4q + i for i = 0..3 (FP4) of its row. BF16 rows are 36 units apart (odd rows 4 units over),
// FP8 and FP4 rows 33 (odd rows one over); FP4 also swaps units 8-9 with 10-11 and 12-13 with
// 14-15 of each 16 (`unit`), so that lanes q and q + 2 differ.
constexpr u32 KS = 256;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
constexpr bool WG = true;
#else
constexpr bool WG = false;
#endif
template <int F> __host__ __device__ constexpr u32 row_stride() { return KS + (F == BF16 ? 32 : 8); }
template <int F> __device__ __forceinline__ u32 unit(u32 p) { return (F == NVFP4 || F == MXFP4) ? p ^ (p >> 2 & 2u) : p; }

__device__ __forceinline__ uint4 lds(const u16* p) { return *reinterpret_cast<const uint4*>(p); }

// Weight sub-steps a warp asks L1 for ahead of its loads (which keep two in flight): 12 Flash
// layers, 8k prompt on an H100: 11,727-11,821 -> 12,225 tok/s (8 ahead: 12,042-12,112).
constexpr u32 PREFETCH = 4;
__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }

// One weight sub-step expanded into MMA A fragments: k16 block b of the sub-step is a[b]
// (rows g and g + 8 of the tile at the lane's k pairs, mma.m16n8k16 order), its k order the
// lane-chunk order of the packed tile: block b holds elements 4b..4b+3 of each lane's chunk
// (pairs 4b, 4b + 1 at k 2q, 2q + 1 and 4b + 2, 4b + 3 at k 8 + 2q, 8 + 2q + 1). FP8 blocks
// carry their rows' block scales (fl, fh), applied after the MMAs.
template <int F>
struct Frags {
    u32 a[Format<F>::ELEMS / 4][4];
    float fl, fh;
};

template <int F>
__device__ __forceinline__ void expand(const Sub& f, Frags<F>& r) {
    const u32 lo[4] = {f.wl.x, f.wl.y, f.wl.z, f.wl.w};
    const u32 hi[4] = {f.wh.x, f.wh.y, f.wh.z, f.wh.w};
    if constexpr (F == BF16) {
#pragma unroll
        for (int b = 0; b < 2; ++b) {
            r.a[b][0] = lo[2 * b];
            r.a[b][1] = hi[2 * b];
            r.a[b][2] = lo[2 * b + 1];
            r.a[b][3] = hi[2 * b + 1];
        }
    } else if constexpr (F == FP8) {
        // Codes to f16 pairs; 64 columns lie in one scale block.
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            e4m3x4_to_f16x2(lo[i], r.a[i][0], r.a[i][2]);
            e4m3x4_to_f16x2(hi[i], r.a[i][1], r.a[i][3]);
        }
        r.fl = __uint_as_float(f.sl);
        r.fh = __uint_as_float(f.sh);
    } else {
        u32 sl[2], sh[2];
        if (F == NVFP4) {
            nvfp4_scales_bf16x2(f.sl, sl[0], sl[1]);
            nvfp4_scales_bf16x2(f.sh, sh[0], sh[1]);
        } else {
            sl[0] = sl[1] = mxfp4_scale_bf16x2(f.sl);
            sh[0] = sh[1] = mxfp4_scale_bf16x2(f.sh);
        }
        // Word i holds elements 8i..8i+7 of the lane's chunk: blocks 2i and 2i + 1.
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            u32 pl[4], ph[4];
            fp4x8_to_bf16(lo[i], pl);
            fp4x8_to_bf16(hi[i], ph);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                r.a[2 * i + e / 2][2 * (e & 1)] = bf16x2_mul(pl[e], sl[i >> 1]);
                r.a[2 * i + e / 2][2 * (e & 1) + 1] = bf16x2_mul(ph[e], sh[i >> 1]);
            }
        }
    }
}

// acc += an FP8 sub-step's column block t with its rows' block scales (rows g, g + 8).
__device__ __forceinline__ void scale_add(float (&acc)[4], const float (&t)[4], const Frags<FP8>& r) {
    acc[0] = fmaf(r.fl, t[0], acc[0]);
    acc[1] = fmaf(r.fl, t[1], acc[1]);
    acc[2] = fmaf(r.fh, t[2], acc[2]);
    acc[3] = fmaf(r.fh, t[3], acc[3]);
}

// One expanded weight sub-step against MT column blocks of staged activations on mma.sync:
// `xb` points at this lane's chunk in activation row g of the first block (rows 8 apart per
// block, XS apart each); FP4 words 0-1 lie `sw` elements past it and words 2-3 `sw` before
// (`unit`). Column blocks inner: consecutive MMAs add into different accumulators.
template <int F, int MT>
__device__ __forceinline__ void sub_mma(const Frags<F>& r, const u16* xb, int sw, float (&acc)[MT][4]) {
    constexpr u32 XS = row_stride<F>();
    if constexpr (F == BF16) {
        uint4 b[MT];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) b[mt] = lds(xb + mt * 8 * XS);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) mma(acc[mt], r.a[0][0], r.a[0][1], r.a[0][2], r.a[0][3], b[mt].x, b[mt].y);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) mma(acc[mt], r.a[1][0], r.a[1][1], r.a[1][2], r.a[1][3], b[mt].z, b[mt].w);
    } else if constexpr (F == FP8) {
        // The four MMAs of a column block sum into one zeroed accumulator, then scaled.
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const uint4 b0 = lds(xb + mt * 8 * XS), b1 = lds(xb + mt * 8 * XS + 8);
            const u32 y[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
            float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int i = 0; i < 4; ++i) mma<true>(t, r.a[i][0], r.a[i][1], r.a[i][2], r.a[i][3], y[2 * i], y[2 * i + 1]);
            scale_add(acc[mt], t, r);
        }
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u16* xi = xb + 8 * i + (i < 2 ? sw : -sw);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const uint4 b = lds(xi + mt * 8 * XS);
                const u32(&a0)[4] = r.a[2 * i];
                const u32(&a1)[4] = r.a[2 * i + 1];
                mma(acc[mt], a0[0], a0[1], a0[2], a0[3], b.x, b.y);
                mma(acc[mt], a1[0], a1[1], a1[2], a1[3], b.z, b.w);
            }
        }
    }
}

// On sm_90a a slab is stored for wgmma's B operand (`wg` in dsv4_common.cuh), K-major without
// swizzle: 8-element k chunks of every row, chunk c of row r at byte c * TM * 16 + r * 16
// (core matrices of 8 rows x 16 bytes, 128 bytes apart along the rows, TM * 16 along k), with
// the k order of `Frags` (chunk 2kb holds block kb's k 0..7, 2kb + 1 its k 8..15). A warp
// stages 8 rows x 4 lane chunks at a time, so its 4-byte stores hit all 32 banks.

template <int F, int MT, bool SWIGLU>
__device__ __forceinline__ void gemm_kernel(const GemmArgs& a) {
    // wgmma for the 64-row blocks; the 32-row ones (two blocks a multiprocessor) measured
    // faster on mma.sync.
    constexpr bool USE_WG = WG && MT == 8;
    extern __shared__ __align__(16) u16 xs[];
    constexpr u32 NONE = 0xffffffffu;
    __shared__ u32 x_rows[MT * 8];
    constexpr u32 TM = MT * 8;                  // activation rows of a block
    constexpr u32 XS = row_stride<F>();
    constexpr u32 E = Format<F>::ELEMS;
    constexpr u32 SPS = KS / (4 * E);           // weight sub-steps per slab
    constexpr u32 ROW_PIECES = KS / 8;          // 16-byte pieces of a slab row
    constexpr u32 PIECES = TM * ROW_PIECES / THREADS;
    constexpr u32 TR = SWIGLU ? 8 : 16;         // output rows per tile
    constexpr u32 HO = SWIGLU ? 0 : 8;          // row offset of the hi half
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const u32 g = lane >> 2, q = lane & 3u, z = blockIdx.z;
    const u32 tile = blockIdx.y * WARPS + warp;
    // Warps past the last tile compute tile 0 (a warpgroup's MMAs take all four warps) and
    // store nothing.
    const bool live = tile < a.tiles;
    const u32 t = live ? tile : 0u;
    const u32 wt = z * a.tiles + t;             // the tile among all stacks'
    const u32 chunks = a.k / E;
    const u16* x = a.x + (u64)z * a.x_col_z;
    const u32* list = a.rows ? a.rows + (u64)z * a.list_stride : nullptr;

    const u8* w_tile = a.w + (u64)wt * tile_bytes(chunks);
    const u8* s_tile = (F == NVFP4 || F == MXFP4) ? a.s + (u64)wt * tile_scale_bytes<F>(chunks) : nullptr;
    Lane L;
    lane_init<F>(L, w_tile, s_tile, chunks, x, x, lane);
    const u32 r_lo = t * TR + g, r_hi = t * TR + HO + g;
    float f_lo = 1.0f, f_hi = 1.0f;
    if (F == FP8) {
        // Scale rows of the weight's absolute rows (clamped: rows past N are dropped).
        const u32 groups = (a.k + 63) / 64, last = gridDim.z * a.n - 1;
        L.fs_lo = a.fs0 + (u64)(min(z * a.n + r_lo, last) / a.fp8_br) * (groups + 1);
        L.fs_hi = a.fs1 + (u64)(min(z * a.n + r_hi, last) / a.fp8_br) * (groups + 1);
        f_lo = __ldg(L.fs_lo + groups);
        f_hi = __ldg(L.fs_hi + groups);
    }
    // Two weight sub-steps in flight ahead of the MMAs.
    const u32 subs = L.subs;
    Sub cur, nxt;
    auto first_subs = [&]() {
        if (subs > 0) sub_load<F>(L, 0, cur);
        if (subs > 1) sub_load<F>(L, 1, nxt);
    };
    first_subs();
    pdl_wait();
    pdl_launch_dependents();
    const u32 rows = list ? a.counts[z] : a.m;
    const float post0 = a.post0 * f_lo * (a.g0 ? a.g0[z] : 1.0f);
    const float post1 = a.post1 * f_hi * (a.g1 ? a.g1[z] : 1.0f);
    const u64 y_col = (u64)z * a.y_col_z;

#pragma unroll 1
    for (u32 row0 = blockIdx.x * TM; row0 < rows; row0 += gridDim.x * TM) {
        if (row0 != blockIdx.x * TM) first_subs();
        // The block's x rows (NONE past the end: those stage zeros), in shared memory rather
        // than registers; the previous row block's last barrier has passed.
        if (threadIdx.x < TM) {
            const u32 r = row0 + threadIdx.x;
            x_rows[threadIdx.x] = r < rows ? (list ? list[r] / a.row_div : r) : NONE;
        }
        __syncthreads();
        // This thread's staging pieces, 16 bytes each (i = threadIdx.x + p * THREADS): on
        // mma.sync slab row i / ROW_PIECES, columns 8 * (i % ROW_PIECES) + [0, 8); for wgmma
        // row 8 * (i / 32 % (TM / 8)) + i % 32 / 4 and word w of lane chunk q = i % 4 in the
        // sub-step (c = i / 32 / (TM / 8): sub-step c / (E / 8), w = c % (E / 8)).
        auto piece_row = [&](u32 p) {
            const u32 i = threadIdx.x + p * THREADS;
            return USE_WG ? 8 * (i / 32 % (TM / 8)) + i % 32 / 4 : i / ROW_PIECES;
        };
        auto piece_col = [&](u32 p) {
            const u32 i = threadIdx.x + p * THREADS, c = i / 32 / (TM / 8);
            return USE_WG ? c / (E / 8) * 4 * E + i % 4 * E + c % (E / 8) * 8 : 8 * (i % ROW_PIECES);
        };
        uint4 v[PIECES];
        auto load_slab = [&](u32 s) {
#pragma unroll
            for (u32 p = 0; p < PIECES; ++p) {
                const u32 xr = x_rows[piece_row(p)], c = s * KS + piece_col(p);
                v[p] = xr != NONE && c < a.k ? ld_act(x + (u64)xr * a.x_ld + c) : make_uint4(0, 0, 0, 0);
            }
        };
        auto store_slab = [&](u32 s) {
            u16* dst = xs + (s & 1u) * TM * XS;
#pragma unroll
            for (u32 p = 0; p < PIECES; ++p) {
                uint4 w = v[p];
                if (F == FP8) {
                    w.x = bf16x2_to_f16x2(w.x);
                    w.y = bf16x2_to_f16x2(w.y);
                    w.z = bf16x2_to_f16x2(w.z);
                    w.w = bf16x2_to_f16x2(w.w);
                }
                const u32 r = piece_row(p), c = piece_col(p);
                if constexpr (USE_WG) {
                    // Word w of lane chunk q in sub-step j: its pairs are k pair q of chunks
                    // j * E / 2 + 4w + 0..3 (`Frags`: blocks 2w, 2w + 1 of the sub-step).
                    const u32 chunk = c / (4 * E) * (E / 2) + c % E / 8 * 4;
                    u32* d = reinterpret_cast<u32*>(dst + chunk * TM * 8 + r * 8) + c % (4 * E) / E;
                    d[0] = w.x;
                    d[TM * 4] = w.y;
                    d[2 * TM * 4] = w.z;
                    d[3 * TM * 4] = w.w;
                } else {
                    *reinterpret_cast<uint4*>(dst + r * XS + 8 * unit<F>(c / 8)) = w;
                }
            }
            if constexpr (USE_WG) wg::stores_to_async();
        };
        const u32 slabs = (a.k + KS - 1) / KS;
        load_slab(0);
        store_slab(0);
        __syncthreads();

        float acc[MT][4];
        zero(acc);
#pragma unroll 1
        for (u32 s = 0; s < slabs; ++s) {
            const bool more = s + 1 < slabs;
            if (more) load_slab(s + 1);
            const u16* slab = xs + (s & 1u) * TM * XS;
            const u16* xb = slab + g * XS + q * E;
            const int sw = (F == NVFP4 || F == MXFP4) && q >= 2 ? 16 : 0;
#pragma unroll
            for (u32 jj = 0; jj < SPS; ++jj) {
                const u32 j = s * SPS + jj;
                if (j < subs) {
                    const Sub f = cur;
                    cur = nxt;
                    if (j + 2 < subs) sub_load<F>(L, j + 2, nxt);
                    // The tile's codes (eight lines a sub-step) and scales (one line)
                    // PREFETCH sub-steps ahead into L1, where the loads above find them.
                    if (lane < 9 && j + PREFETCH < subs) {
                        const u32 jp = j + PREFETCH;
                        if (lane < 8) prefetch_l1(w_tile + (u64)jp * 1024 + 128 * lane);
                        else if (F == NVFP4 || F == MXFP4) prefetch_l1(s_tile + (u64)jp * (F == NVFP4 ? 128 : 64));
                    }
                    Frags<F> r;
                    expand<F>(f, r);
                    if constexpr (USE_WG) {
                        // Block b of sub-step jj: chunks 2 (jj E / 4 + b) and the next. FP8 sums
                        // the sub-step alone, then scales it into the accumulators.
                        float t[MT][4];
                        float(&d)[MT][4] = F == FP8 ? t : acc;
                        if (F == FP8) zero(t);
                        wg::hold(d);
                        wg::fence();
#pragma unroll
                        for (u32 b = 0; b < E / 4; ++b)
                            wg::mma<F == FP8>(d, r.a[b], wg::desc(slab + 2 * (jj * E / 4 + b) * TM * 8, TM * 16));
                        wg::commit();
                        wg::wait_all();
                        wg::hold(d);
                        if constexpr (F == FP8) {
#pragma unroll
                            for (int mt = 0; mt < MT; ++mt) scale_add(acc[mt], t[mt], r);
                        }
                    } else {
                        sub_mma<F, MT>(r, xb + jj * 4 * E, sw, acc);
                    }
                }
            }
            if (more) store_slab(s + 1);
            __syncthreads();
        }
        if (!live) continue;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (u32 i = 0; i < 2; ++i) {
                const u32 r = row0 + mt * 8 + 2 * q + i;
                if (r >= rows) continue;
                const u64 y0 = (u64)(list ? list[r] : r) * a.y_ld + y_col;
                store_rows<SWIGLU>(a, y0, r_lo, r_hi, r_lo, acc[mt][i], acc[mt][i + 2], post0, post1);
            }
    }
}

}  // namespace gemm

// ---- FP4 expert lists on warpgroup MMAs with the weights in registers (sm_90a) ----
//
// `gemm_*_nvfp4_tc` / `_mxfp4_tc`: a block of two warpgroups takes 128 weight rows (8 tiles,
// warp w tile 8 blockIdx.y + w, expanded by `expand` as above into the A operand of its
// warpgroup's m64 MMAs) by 128 list rows (the MMAs' N), K in the weights' 128-column
// sub-steps. The activations come permuted inside each 128 columns into the k order of
// `Frags` (fp4_k_pos: moe_chunk permutes the experts' input by `fp4_k_permute`, and gate+up
// stores h that way for down), so each 16 bytes of a row are eight consecutive k slots of one
// MMA and move by 16-byte asynchronous copies into 128-byte-swizzled shared memory, AHEAD
// sub-steps ahead. A sub-step's eight m64n128k16 MMAs run while the next sub-step is expanded
// into a second set of registers: a weight is expanded once per 128 rows (the mma.sync kernels:
// per 16-64), and no activation passes through registers.
namespace gemm_tc {

using namespace gemv;

// Position of column n inside its 128 in the permuted order: n = 32q + 8w + 2m + s (lane chunk
// q, word w, pair m, element s) goes to 32w + 8m + 2q + s, slot 2q + s of k16 block 2w + m / 2
// (half m % 2), where `expand` puts that weight.
__device__ __forceinline__ u32 fp4_k_pos(u32 n) {
    return (n & ~127u) | (n >> 3 & 3u) << 5 | (n >> 1 & 3u) << 3 | (n >> 5 & 3u) << 1 | (n & 1u);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
constexpr u32 TOKENS = 128;                 // list rows of a block
constexpr u32 HALF = TOKENS * 128;          // bytes of 64 k of every row
constexpr u32 STAGE = 2 * HALF;             // a sub-step's 128 k
constexpr u32 STAGES = 4;
constexpr u32 AHEAD = STAGES - 2;           // two stages are the MMAs' (running and in flight)
constexpr u32 NONE = 0xffffffffu;

// d += a . B on m64n128k16 in bf16: a this warp's 16 rows of A (mma.sync's A fragment), B at
// descriptor db. d[4j + i]: rows g (i < 2) and g + 8, columns 8j + 2 (lane % 4) + i % 2.
__device__ __forceinline__ void mma(float (&d)[64], const u32 (&a)[4], u64 db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        DSV4_WG_D64_REGS ", "
        "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : DSV4_WG_D64(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

template <int F, bool SWIGLU>
__device__ __forceinline__ void kernel(const GemmArgs& a) {
    extern __shared__ __align__(1024) u8 smem[];
    __shared__ u32 x_rows[TOKENS];
    const u32 tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5;
    const u32 g = lane >> 2, q = lane & 3u, z = blockIdx.z;
    const u32 tile = blockIdx.y * gemm::WARPS + warp;
    // Warps past the last tile compute tile 0 (a warpgroup's MMAs take all four warps) and
    // store nothing.
    const bool live = tile < a.tiles;
    const u32 t = live ? tile : 0u;
    const u32 wt = z * a.tiles + t;
    const u32 chunks = a.k / 32;
    const u8* w_tile = a.w + (u64)wt * tile_bytes(chunks);
    const u8* s_tile = a.s + (u64)wt * tile_scale_bytes<F>(chunks);
    Lane L;
    lane_init<F>(L, w_tile, s_tile, chunks, a.x, a.x, lane);
    const u32 subs = L.subs;
    constexpr u32 TR = SWIGLU ? 8 : 16, HO = SWIGLU ? 0 : 8;
    const u32 r_lo = t * TR + g, r_hi = t * TR + HO + g;
    // Swizzled atoms start on 1 KB (the launch adds 1 KB of slack).
    const u32 base = ((u32)__cvta_generic_to_shared(smem) + 1023u) & ~1023u;
    const u32* list = a.rows + (u64)z * a.list_stride;

    // Loaded weight sub-steps: even ones in sa, odd ones in sb, each loaded two sub-steps before
    // its expansion (no register moves, which would wait for the loads).
    Sub sa, sb;
    auto first_subs = [&]() {
        sub_load<F>(L, 0, sa);
        if (subs > 1) sub_load<F>(L, 1, sb);
    };
    first_subs();
    pdl_wait();
    pdl_launch_dependents();
    const u32 rows = a.counts[z];
    const float post0 = a.post0 * (a.g0 ? a.g0[z] : 1.0f);
    const float post1 = a.post1 * (a.g1 ? a.g1[z] : 1.0f);

    // This thread's copies: row tid / 2 of the block, 16-byte pieces c = 2i + tid % 2 (eight
    // permuted k each) of the sub-step, i = 0..7, so a thread pair reads whole 32-byte sectors:
    // half c / 8 = i / 4 of the stage, chunk c % 8 of the swizzled 128-byte row (its offset
    // depends on i % 4 only, worked out once).
    const u32 tk = tid / 2, p = tid % 2;
    u32 dst[4];
#pragma unroll
    for (u32 i = 0; i < 4; ++i) dst[i] = wg::sw128(tk, 2 * i + p);
#pragma unroll 1
    for (u32 row0 = blockIdx.x * TOKENS; row0 < rows; row0 += gridDim.x * TOKENS) {
        if (row0 != blockIdx.x * TOKENS) first_subs();
        if (tid < TOKENS) x_rows[tid] = row0 + tid < rows ? list[row0 + tid] / a.row_div : NONE;
        __syncthreads();
        const u32 xr = x_rows[tk];
        const bool ok = xr != NONE;
        const u16* src = ok ? a.x + (u64)xr * a.x_ld + 8 * p : a.x;
        auto load_stage = [&](u32 j) {
            const u32 slot = base + (j % STAGES) * STAGE;
            const u16* from = ok ? src + j * 128 : src;
#pragma unroll
            for (u32 i = 0; i < 8; ++i) cp_async16_or_zero(slot + (i / 4) * HALF + dst[i % 4], from + 16 * i, ok);
        };
#pragma unroll
        for (u32 j = 0; j < AHEAD; ++j) {
            if (j < subs) load_stage(j);
            cp_async_commit();
        }
        float acc[64];
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
        gemm::Frags<F> fa, fb;
        gemm::expand<F>(sa, fa);
        if (subs > 2) sub_load<F>(L, 2, sa);
        // Sub-step j on `cur` (expanded); `nxt` takes j + 1 from `loaded` once j - 1's MMAs
        // are done, and `loaded` then takes j + 3.
        auto step = [&](u32 j, gemm::Frags<F>& cur, gemm::Frags<F>& nxt, Sub& loaded) {
            cp_async_wait<AHEAD - 1>();
            wg::stores_to_async();
            __syncthreads();
            const u32 slot = base + (j % STAGES) * STAGE;
            wg::fence();
#pragma unroll
            for (u32 b = 0; b < 8; ++b) mma(acc, cur.a[b], wg::desc_sw128(slot + (b / 4) * HALF) + (b % 4) * 2);
            wg::commit();
            // Every warpgroup is past sub-step j - 2's MMAs (the barrier above follows their
            // waits for it), so its stage takes j + AHEAD.
            if (j + AHEAD < subs) load_stage(j + AHEAD);
            cp_async_commit();
            if (lane < 9 && j + gemm::PREFETCH < subs) {
                const u32 jp = j + gemm::PREFETCH;
                if (lane < 8) gemm::prefetch_l1(w_tile + (u64)jp * 1024 + 128 * lane);
                else gemm::prefetch_l1(s_tile + (u64)jp * (F == NVFP4 ? 128 : 64));
            }
            wg::wait<1>();
            wg::hold(nxt.a);
            if (j + 1 < subs) {
                gemm::expand<F>(loaded, nxt);
                if (j + 3 < subs) sub_load<F>(L, j + 3, loaded);
            }
        };
#pragma unroll 1
        for (u32 j = 0; j < subs; j += 2) {
            step(j, fa, fb, sb);
            if (j + 1 < subs) step(j + 1, fb, fa, sa);
        }
        wg::wait<0>();
        wg::hold(acc);
        cp_async_wait<0>();
        if (live) {
#pragma unroll
            for (u32 j = 0; j < 16; ++j)
#pragma unroll
                for (u32 i = 0; i < 2; ++i) {
                    const u32 r = row0 + 8 * j + 2 * q + i;
                    if (r >= rows) continue;
                    const u64 y0 = (u64)list[r] * a.y_ld;
                    const u32 c_lo = a.y_perm ? fp4_k_pos(r_lo) : r_lo;
                    store_rows<SWIGLU>(a, y0, r_lo, r_hi, c_lo, acc[4 * j + i], acc[4 * j + 2 + i], post0, post1);
                }
        }
        // Both warpgroups are done with the stages and x_rows before the next row block's.
        __syncthreads();
    }
}
#else
template <int F, bool SWIGLU>
__device__ __forceinline__ void kernel(const GemmArgs&) {
    __trap();
}
#endif

}  // namespace gemm_tc

// xp[r, fp4_k_pos(c)] = x[r, c] for rows [rows, k] (k a multiple of 128): the `_tc` kernels'
// activation order. Thread i writes 16 bytes of xp: four pairs from four lane chunks.
DSV4_KERNEL void fp4_k_permute(const u16* __restrict__ x, u16* __restrict__ xp, u32 rows, u32 k) {
    pdl_enter();
    const u32 pieces = k / 8;
    const u64 total = (u64)rows * pieces;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        const u64 row = (i / pieces) * k;
        const u32 p0 = 8 * (u32)(i % pieces);
        // p0 = 32w + 8m of its 128: the pairs 2q of positions p0 + 2q are natural 32q + 8w + 2m.
        const u32 n0 = (p0 & ~127u) + 8 * (p0 >> 5 & 3u) + 2 * (p0 >> 3 & 3u);
        u32 v[4];
#pragma unroll
        for (u32 qq = 0; qq < 4; ++qq) v[qq] = *reinterpret_cast<const u32*>(x + row + n0 + 32 * qq);
        *reinterpret_cast<uint4*>(xp + row + p0) = make_uint4(v[0], v[1], v[2], v[3]);
    }
}

DSV4_KERNEL void __launch_bounds__(gemm::THREADS, 1) gemm_bf16(const GemmArgs a) { gemm::gemm_kernel<gemv::BF16, 8, false>(a); }
DSV4_KERNEL void __launch_bounds__(gemm::THREADS, 1) gemm_fp8(const GemmArgs a) { gemm::gemm_kernel<gemv::FP8, 8, false>(a); }
DSV4_KERNEL void __launch_bounds__(gemm::THREADS, 1) gemm_nvfp4(const GemmArgs a) { gemm::gemm_kernel<gemv::NVFP4, 8, false>(a); }
DSV4_KERNEL void __launch_bounds__(gemm::THREADS, 1) gemm_mxfp4(const GemmArgs a) { gemm::gemm_kernel<gemv::MXFP4, 8, false>(a); }
DSV4_KERNEL void __launch_bounds__(gemm::THREADS, 1) gemm_swiglu_bf16(const GemmArgs a) { gemm::gemm_kernel<gemv::BF16, 8, true>(a); }
DSV4_KERNEL void __launch_bounds__(gemm::THREADS, 1) gemm_swiglu_fp8(const GemmArgs a) { gemm::gemm_kernel<gemv::FP8, 8, true>(a); }
DSV4_KERNEL void __launch_bounds__(gemm::THREADS, 1) gemm_swiglu_nvfp4(const GemmArgs a) { gemm::gemm_kernel<gemv::NVFP4, 8, true>(a); }
DSV4_KERNEL void __launch_bounds__(gemm::THREADS, 1) gemm_swiglu_mxfp4(const GemmArgs a) { gemm::gemm_kernel<gemv::MXFP4, 8, true>(a); }
// 32-row blocks for routed experts with few rows each (a prompt chunk's tokens spread over
// many experts), two blocks a multiprocessor: their weight streams are latency-bound.
DSV4_KERNEL void __launch_bounds__(gemm::THREADS, 2) gemm_nvfp4_m32(const GemmArgs a) { gemm::gemm_kernel<gemv::NVFP4, 4, false>(a); }
DSV4_KERNEL void __launch_bounds__(gemm::THREADS, 2) gemm_mxfp4_m32(const GemmArgs a) { gemm::gemm_kernel<gemv::MXFP4, 4, false>(a); }
DSV4_KERNEL void __launch_bounds__(gemm::THREADS, 2) gemm_swiglu_nvfp4_m32(const GemmArgs a) { gemm::gemm_kernel<gemv::NVFP4, 4, true>(a); }
DSV4_KERNEL void __launch_bounds__(gemm::THREADS, 2) gemm_swiglu_mxfp4_m32(const GemmArgs a) { gemm::gemm_kernel<gemv::MXFP4, 4, true>(a); }
// 16-row blocks for lists of a few rows (a short prompt's tokens over all the experts): half
// the MMAs and staging of a 32-row block per weight byte.
DSV4_KERNEL void __launch_bounds__(gemm::THREADS, 2) gemm_nvfp4_m16(const GemmArgs a) { gemm::gemm_kernel<gemv::NVFP4, 2, false>(a); }
DSV4_KERNEL void __launch_bounds__(gemm::THREADS, 2) gemm_mxfp4_m16(const GemmArgs a) { gemm::gemm_kernel<gemv::MXFP4, 2, false>(a); }
DSV4_KERNEL void __launch_bounds__(gemm::THREADS, 2) gemm_swiglu_nvfp4_m16(const GemmArgs a) { gemm::gemm_kernel<gemv::NVFP4, 2, true>(a); }
DSV4_KERNEL void __launch_bounds__(gemm::THREADS, 2) gemm_swiglu_mxfp4_m16(const GemmArgs a) { gemm::gemm_kernel<gemv::MXFP4, 2, true>(a); }
// FP4 expert lists averaging more than 64 rows on sm_90a, K a multiple of 128 (gemm_tc above).
DSV4_KERNEL void __launch_bounds__(gemm::THREADS, 1) gemm_nvfp4_tc(const GemmArgs a) { gemm_tc::kernel<gemv::NVFP4, false>(a); }
DSV4_KERNEL void __launch_bounds__(gemm::THREADS, 1) gemm_mxfp4_tc(const GemmArgs a) { gemm_tc::kernel<gemv::MXFP4, false>(a); }
DSV4_KERNEL void __launch_bounds__(gemm::THREADS, 1) gemm_swiglu_nvfp4_tc(const GemmArgs a) { gemm_tc::kernel<gemv::NVFP4, true>(a); }
DSV4_KERNEL void __launch_bounds__(gemm::THREADS, 1) gemm_swiglu_mxfp4_tc(const GemmArgs a) { gemm_tc::kernel<gemv::MXFP4, true>(a); }
