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
template <int F> __host__ __device__ constexpr u32 row_stride() { return KS + (F == BF16 ? 32 : 8); }
template <int F> __device__ __forceinline__ u32 unit(u32 p) { return (F == NVFP4 || F == MXFP4) ? p ^ (p >> 2 & 2u) : p; }

__device__ __forceinline__ uint4 lds(const u16* p) { return *reinterpret_cast<const uint4*>(p); }

__device__ __forceinline__ void store(const GemmArgs& a, u64 i, float v) {
    if (a.y_f32 == 2u) static_cast<float*>(a.y)[i] = __fadd_rn(static_cast<float*>(a.y)[i], v);
    else if (a.y_f32) static_cast<float*>(a.y)[i] = v;
    else static_cast<u16*>(a.y)[i] = f32_to_bf16(v);
}

// One weight sub-step against MT column blocks of staged activations: `xb` points at this
// lane's chunk in activation row g of the first block (rows 8 apart per block, XS apart each);
// FP4 words 0-1 lie `sw` elements past it and words 2-3 `sw` before (`unit`).
template <int F, int MT>
__device__ __forceinline__ void sub_mma(const Sub& f, const u16* xb, int sw, float (&acc)[MT][4]) {
    constexpr u32 XS = row_stride<F>();
    const u32 lo[4] = {f.wl.x, f.wl.y, f.wl.z, f.wl.w};
    const u32 hi[4] = {f.wh.x, f.wh.y, f.wh.z, f.wh.w};
    if (F == BF16) {
        // Column blocks inner: consecutive MMAs add into different accumulators.
        uint4 b[MT];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) b[mt] = lds(xb + mt * 8 * XS);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) mma(acc[mt], lo[0], hi[0], lo[1], hi[1], b[mt].x, b[mt].y);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) mma(acc[mt], lo[2], hi[2], lo[3], hi[3], b[mt].z, b[mt].w);
    } else if (F == FP8) {
        // Codes to f16 pairs once; the four MMAs of a column block sum into one zeroed
        // accumulator, scaled by the sub-step's block scale (64 columns lie in one block).
        u32 l[8], h[8];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            e4m3x4_to_f16x2(lo[i], l[2 * i], l[2 * i + 1]);
            e4m3x4_to_f16x2(hi[i], h[2 * i], h[2 * i + 1]);
        }
        const float fl = __uint_as_float(f.sl), fh = __uint_as_float(f.sh);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const uint4 b0 = lds(xb + mt * 8 * XS), b1 = lds(xb + mt * 8 * XS + 8);
            const u32 y[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
            float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int i = 0; i < 4; ++i) mma<true>(t, l[2 * i], h[2 * i], l[2 * i + 1], h[2 * i + 1], y[2 * i], y[2 * i + 1]);
            acc[mt][0] = fmaf(fl, t[0], acc[mt][0]);
            acc[mt][1] = fmaf(fl, t[1], acc[mt][1]);
            acc[mt][2] = fmaf(fh, t[2], acc[mt][2]);
            acc[mt][3] = fmaf(fh, t[3], acc[mt][3]);
        }
    } else {
        u32 sl[2], sh[2];
        if (F == NVFP4) {
            nvfp4_scales_bf16x2(f.sl, sl[0], sl[1]);
            nvfp4_scales_bf16x2(f.sh, sh[0], sh[1]);
        } else {
            sl[0] = sl[1] = mxfp4_scale_bf16x2(f.sl);
            sh[0] = sh[1] = mxfp4_scale_bf16x2(f.sh);
        }
        u32 pl[4][4], ph[4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            fp4x8_to_bf16(lo[i], pl[i]);
            fp4x8_to_bf16(hi[i], ph[i]);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                pl[i][e] = bf16x2_mul(pl[i][e], sl[i >> 1]);
                ph[i][e] = bf16x2_mul(ph[i][e], sh[i >> 1]);
            }
        }
        // Word i holds elements 8i..8i+7 of the lane's chunk. Column blocks inner: consecutive
        // MMAs add into different accumulators.
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u16* xi = xb + 8 * i + (i < 2 ? sw : -sw);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const uint4 b = lds(xi + mt * 8 * XS);
                mma(acc[mt], pl[i][0], ph[i][0], pl[i][1], ph[i][1], b.x, b.y);
                mma(acc[mt], pl[i][2], ph[i][2], pl[i][3], ph[i][3], b.z, b.w);
            }
        }
    }
}

template <int F, int MT, bool SWIGLU>
__device__ __forceinline__ void gemm_kernel(const GemmArgs& a) {
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
    // Warps past the last tile only stage activations.
    const bool live = tile < a.tiles;
    const u32 t = live ? tile : 0u;
    const u32 wt = z * a.tiles + t;             // the tile among all stacks'
    const u32 chunks = a.k / E;
    const u16* x = a.x + (u64)z * a.x_col_z;
    const u32* list = a.rows ? a.rows + (u64)z * a.list_stride : nullptr;

    Lane L;
    lane_init<F>(L, a.w + (u64)wt * tile_bytes(chunks),
                 (F == NVFP4 || F == MXFP4) ? a.s + (u64)wt * tile_scale_bytes<F>(chunks) : nullptr, chunks, x, x,
                 lane);
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
    const u32 subs = live ? L.subs : 0u;
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
        // This thread's staging pieces: piece p is slab row i / ROW_PIECES, columns
        // 8 * (i % ROW_PIECES) + [0, 8) (i = threadIdx.x + p * THREADS).
        uint4 v[PIECES];
        auto load_slab = [&](u32 s) {
            const u32 c = s * KS + 8 * (threadIdx.x % ROW_PIECES);
#pragma unroll
            for (u32 p = 0; p < PIECES; ++p) {
                const u32 xr = x_rows[(threadIdx.x + p * THREADS) / ROW_PIECES];
                v[p] = xr != NONE && c < a.k ? ld_act(x + (u64)xr * a.x_ld + c) : make_uint4(0, 0, 0, 0);
            }
        };
        auto store_slab = [&](u32 s) {
            u16* dst = xs + (s & 1u) * TM * XS;
#pragma unroll
            for (u32 p = 0; p < PIECES; ++p) {
                const u32 i = threadIdx.x + p * THREADS;
                uint4 w = v[p];
                if (F == FP8) {
                    w.x = bf16x2_to_f16x2(w.x);
                    w.y = bf16x2_to_f16x2(w.y);
                    w.z = bf16x2_to_f16x2(w.z);
                    w.w = bf16x2_to_f16x2(w.w);
                }
                *reinterpret_cast<uint4*>(dst + (i / ROW_PIECES) * XS + 8 * unit<F>(i % ROW_PIECES)) = w;
            }
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
            const u16* xb = xs + (s & 1u) * TM * XS + g * XS + q * E;
            const int sw = (F == NVFP4 || F == MXFP4) && q >= 2 ? 16 : 0;
#pragma unroll
            for (u32 jj = 0; jj < SPS; ++jj) {
                const u32 j = s * SPS + jj;
                if (j < subs) {
                    const Sub f = cur;
                    cur = nxt;
                    if (j + 2 < subs) sub_load<F>(L, j + 2, nxt);
                    sub_mma<F, MT>(f, xb + jj * 4 * E, sw, acc);
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
                if (SWIGLU) {
                    if (r_lo < a.n) store(a, y0 + r_lo, swiglu(acc[mt][i] * post0, acc[mt][i + 2] * post1, a.limit));
                } else {
                    if (r_lo < a.n) store(a, y0 + r_lo, acc[mt][i] * post0);
                    if (r_hi < a.n) store(a, y0 + r_hi, acc[mt][i + 2] * post1);
                }
            }
    }
}

}  // namespace gemm

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
