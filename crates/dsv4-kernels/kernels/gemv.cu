// Decode GEMV / small-M GEMM: y[M, N] = x[M, K] . W[N, K]^T for M <= 16, bf16 activations,
// f32 accumulation, bf16 or f32 output (or f32 added to y), weights in BF16, FP8 e4m3
// (128x128-style block scales, e8m0 or f32), NVFP4 (e4m3 per 16 + f32 global) or MXFP4 (e8m0
// per 32). Also the fused gate+up projection with the clamped SwiGLU epilogue.
//
// Weights are the A operand of mma.m16n8k16 (16 weight rows x 16 k), activations the B operand
// (16 k x 8 activation rows), so one MMA covers 256 weight elements and M = 1..8 costs the same
// as M = 1. Each lane owns whole 16-byte chunks of two weight rows (g and g + 8) and feeds the
// MMA from its own chunk only: the k order inside an MMA is a free permutation as long as A and
// B use the same one, so FP4 codes are expanded in whatever order the bit tricks give (the
// packer permutes their bits so that the pairs come out in element order and the activations
// feed the MMA as loaded). Weights are repacked once at load into a tile layout (gemv_tile.cu)
// so that each warp-wide load reads 512 contiguous bytes.
//
// BF16 and FP4 weights run on the bf16 MMA. FP4 codes become bf16 by placing the code bits in
// the bf16 exponent/mantissa field (value = e2m1 * 2^-126, a bf16 subnormal for code +-0.5),
// then one bf16x2 multiply by the block scale times 2^110 makes them e2m1 * scale * 2^-16
// exactly (at most 6 significant bits); the final 2^16 and the NVFP4 global scale are applied
// in f32 at the end.
//
// FP8 weights run on the f16 MMA: `cvt.rn.f16x2.e4m3x2` turns two e4m3 codes (stored in
// checkpoint order) into an exact f16 pair in one instruction, the activations are converted
// bf16 -> f16 as they are loaded (exact for |x| in [2^-14, 65504] and 0, which holds for every
// GEMV input of the model: RMS-normalised vectors, attention outputs, SwiGLU outputs bounded by
// the clamp), and the 128x128 block scale is applied in f32 to each MMA's sums (four MMAs of
// 16 columns a sub-step, each on its own accumulator so that none waits for another). The
// scales are divided at upload by a power-of-two factor per row of scale blocks, which the
// epilogue applies. At M = 1 with staged activations (`gemv_*fp8_m1`, PS) the block stages
// them as f16 already multiplied by those divided scales (at most 1, so in range), one copy
// per scale row of its tiles (gate and up), and the sub-step is code conversions and MMAs
// only: the MMA's column 0 reads the gate copy, column 1 the up copy.
//
// Work split: a tile is 16 output rows (8 gate + 8 up rows for SwiGLU); its K steps are split
// into `splits` contiguous ranges (the first steps % splits of them one step longer), one warp
// each. A block of W warps holds G consecutive ranges of W / G tiles (the launcher picks G, a
// power of two dividing splits, and W = max(G, 4)): 16 or 8 ranges of a tile fill one block of
// as many warps, fewer share a 4-warp block with other tiles; 5..15 ranges may also fill one
// block of as many warps (G = W = splits). The grid's x counts groups of tiles, its y the
// blocks that share a tile's ranges, and the launcher passes G, log2 W / G and the range
// lengths, so a warp finds its tile and range without an integer division (they were
// ~170 of the ~300 instructions before the first weight load). The G warps of a tile are
// summed in shared memory (in warp order, once, at the end), and when splits > G the tile's
// block sums meet either in the first block's shared memory, the blocks being one cluster
// (`cluster_sum`, 2..8 blocks, every cluster of the grid resident at once), or through the
// workspace, where the last one to arrive (per-tile counter) adds them in order. Every
// reduction has a fixed order, so results never depend on timing. The block's warps share one
// K range (the same G consecutive ranges of each of its W / G tiles); when the launcher
// reserved shared memory for it (`x_stride` != 0), the block stages that range of every
// activation row there once.
#include "gemv_tile.cu"

// Kernel arguments (layout mirrored by `GemvArgs` in dsv4_ops::gpu::gemv).
struct GemvArgs {
    const u16* x;       // [m, k] bf16
    const u8* w;        // packed tiles (plain: W; SwiGLU: W1 and W3 interleaved)
    const u8* s;        // packed NVFP4/MXFP4 scales
    const float* fs0;   // FP8 scales of W (SwiGLU: of W1), f32 [ceil(n / br), ceil(k / 64) + 1]:
                        // each row's scales divided by its factor (a power of two), then the factor
    const float* fs1;   // FP8 scales of W (SwiGLU: of W3)
    void* y;            // [m, n] bf16, or f32 when y_f32
    float* ws;          // split-K partials
    u32* counters;      // split-K arrival counters, one per tile, zero between launches
    u32 m, n, k;
    u32 steps_q, steps_r; // K steps = q * splits + r: range i starts at step i * q + min(i, r)
    float post0, post1; // epilogue multipliers of w0 / w1 rows
    float limit;        // SwiGLU clamp
    u32 fp8_br;         // FP8 scale block rows
    u32 tiles;
    u32 x_stride;       // row stride of the staged activations in shared memory; 0: not staged
    u32 group;          // G: K ranges of a tile in one block (G divides splits; a power of two unless the
                        // block holds one tile)
    u32 tiles_log2;     // log2 of the tiles a block holds (block warps / G)
    u32 cluster_sum;    // 1: the blocks of a tile are one cluster and sum through `cluster_sum`
    u32 mail_offset;    // byte offset of the cluster mailbox in dynamic shared memory
    u32 y_f32;          // 0: y is bf16 (rounded to nearest even); 1: f32 (the sums as they are);
                        // 2: f32, the sums added to what y holds
    u32 x_ld;           // row stride of x (elements): k, or groups * k for a grouped launch
    u32 x_group_rows;   // grouped: output rows [g * x_group_rows, (g + 1) * x_group_rows) read
                        // x columns [g * k, (g + 1) * k); 0: every row reads columns [0, k)
};

// PS: FP8 at M = 1 with the block scales folded into the staged activations (stage_prescaled).
template <int F, int MT, bool SWIGLU, bool PS = false>
__device__ __forceinline__ void gemv_kernel(const GemvArgs& a) {
    using namespace gemv;
    extern __shared__ __align__(16) u16 xs[];
    constexpr u32 TR = SWIGLU ? 8 : 16;   // output rows per tile
    constexpr u32 HO = SWIGLU ? 0 : 8;    // row offset of the hi half
    constexpr u32 E = Format<F>::ELEMS;
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    // Grid: x = groups of tiles, y = the blocks that share each tile's K ranges. With several
    // tiles a block, G is a power of two: the tile's place in the block and the warp's range
    // in the tile come from shifts and masks, no division.
    const u32 G = a.group, bpt = gridDim.y;
    const u32 slot = a.tiles_log2 ? warp >> (__ffs(G) - 1) : 0u;
    const u32 tile = (blockIdx.x << a.tiles_log2) + slot;
    const u32 split = blockIdx.y * G + (a.tiles_log2 ? warp & (G - 1) : warp);
    // Warps past the last tile only take part in the staging and the block's reduction.
    const bool live = tile < a.tiles;
    const u32 t = live ? tile : 0;
    const u32 g = lane >> 2;
    const u32 r_lo = t * TR + g, r_hi = t * TR + HO + g;
    const u32 chunks = a.k / E;
    auto range_start = [&](u32 i) { return i * a.steps_q + min(i, a.steps_r); };
    // The block's K range: splits [split0, split0 + G) of its tiles.
    const u32 split0 = blockIdx.y * G;
    const u32 k0 = min(a.k, range_start(split0) * STEP_CHUNKS * E);
    const u32 k1 = min(a.k, range_start(split0 + G) * STEP_CHUNKS * E);
    const bool staged = a.x_stride != 0;
    // Grouped launches: the block's x group (what it stages; the launcher stages only where a
    // block's tiles share one) and the warp's (what it reads unstaged).
    const u16* x_block = a.x;
    const u16* x_warp = a.x;
    if (a.x_group_rows) {
        x_block += (u64)(((blockIdx.x << a.tiles_log2) * TR) / a.x_group_rows) * a.k;
        x_warp += (u64)((t * TR) / a.x_group_rows) * a.k;
    }
    // PS: lanes of MMA column 1 read the copy scaled for the up rows.
    const u16* x = staged ? xs - k0 + (PS && SWIGLU && g == 1 ? a.x_stride : 0u) : x_warp;
    const u64 x_stride = staged ? a.x_stride : a.x_ld;

    Lane L;
    lane_init<F>(L, a.w + (u64)t * tile_bytes(chunks),
                 (F == NVFP4 || F == MXFP4) ? a.s + (u64)t * tile_scale_bytes<F>(chunks) : nullptr, chunks,
                 x + min(g, a.m - 1) * x_stride, x + min(g + 8, a.m - 1) * x_stride, lane);
    // FP8 scales, expanded at upload to one per 64 columns and normalized per scale row; rows
    // past N read the last row's (their sums are dropped).
    const u32 groups = (a.k + 63) / 64;
    float f_lo = 1.0f, f_hi = 1.0f;
    if (F == FP8) {
        L.fs_lo = a.fs0 + (u64)(min(r_lo, a.n - 1) / a.fp8_br) * (groups + 1);
        L.fs_hi = a.fs1 + (u64)(min(r_hi, a.n - 1) / a.fp8_br) * (groups + 1);
    }

    const u32 s_begin = live ? range_start(split) : 0;
    const u32 s_end = live ? range_start(split + 1) : 0;
    const u32 j0 = sub_begin(s_begin), j1 = sub_end(L, s_end);
    Ring<F> ring;
    // A branch rather than only the loads' own guards: measured 15-20% faster for FP4.
    if (j0 < j1) ring_load<F, PS>(L, j0, j1, ring);
    if (F == FP8) {
        f_lo = __ldg(L.fs_lo + groups);
        f_hi = __ldg(L.fs_hi + groups);
    }
    // PS: the scale rows of all of the block's tiles (the launcher checks that they share one).
    const float* s0 = a.fs0 + (u64)(min((blockIdx.x << a.tiles_log2) * TR, a.n - 1) / a.fp8_br) * (groups + 1);
    const float* s1 = a.fs1 + (s0 - a.fs0);
    if (PS) prefetch_scales(s0, s1, k0 / 64, (k1 + 63) / 64);
    if (a.cluster_sum) cluster_sum_open();
    pdl_wait();
    pdl_launch_dependents();
    if (PS) stage_prescaled<SWIGLU>(xs, a.x_stride, x_block, k0, k1 - k0, s0, s1);
    else if (staged) stage_rows(xs, a.x_stride, [&](u32 r) { return x_block + k0 + (u64)r * a.x_ld; }, a.m, k1 - k0);
    if (!live && G == 1) return;

    float acc[MT][4];
    zero(acc);
    run_subs<F, MT, PS>(L, j0, j1, ring, acc);
    if (G > 1 && !reduce_warps<MT>(acc, G)) return;
    if (!live) return;
    if (a.cluster_sum) {
        const float4* mail = reinterpret_cast<const float4*>(reinterpret_cast<const u8*>(xs) + a.mail_offset);
        if (!cluster_sum<MT>(acc, mail, slot, 1u << a.tiles_log2, blockIdx.y, bpt)) return;
    } else if (!reduce_splits<MT>(acc, a.ws, a.counters, tile, blockIdx.y, bpt, a.m)) {
        return;
    }

    const float post0 = a.post0 * f_lo, post1 = a.post1 * f_hi;
    for_each_token<MT>(a.m, [&](int mt, u32 i, u32 m) {
        if (SWIGLU && PS) {
            // Gate sums in column 0 (acc[0][0], row g), up sums in column 1 (acc[0][3], row g + 8).
            if (r_lo < a.n) store_y(a, r_lo, swiglu(acc[0][0] * post0, acc[0][3] * post1, a.limit));
        } else if (SWIGLU) {
            if (r_lo < a.n) {
                const float h = swiglu(acc[mt][i] * post0, acc[mt][i + 2] * post1, a.limit);
                store_y(a, (u64)m * a.n + r_lo, h);
            }
        } else {
            if (r_lo < a.n) store_y(a, (u64)m * a.n + r_lo, acc[mt][i] * post0);
            if (r_hi < a.n) store_y(a, (u64)m * a.n + r_hi, acc[mt][i + 2] * post1);
        }
    });
}

// M <= 8 uses one MMA column block (m8), 9 <= M <= 16 two (m16). The m8 kernels are held to
// a register budget (M8_BLOCKS resident 4-warp blocks per multiprocessor for BF16, whose
// blocks stay at 4 warps; for the deeper early-refill rings of FP8 and FP4, blocks of up to
// MAX_BLOCK_WARPS = 16 warps at 128 registers, the cap of M8_DEEP_BLOCKS 4-warp blocks).
DSV4_KERNEL void __launch_bounds__(128, M8_BLOCKS) gemv_bf16_m8(const GemvArgs a) { gemv_kernel<gemv::BF16, 1, false>(a); }
DSV4_KERNEL void gemv_bf16_m16(const GemvArgs a) { gemv_kernel<gemv::BF16, 2, false>(a); }
DSV4_KERNEL void __launch_bounds__(128, M8_BLOCKS) gemv_swiglu_bf16_m8(const GemvArgs a) { gemv_kernel<gemv::BF16, 1, true>(a); }
DSV4_KERNEL void gemv_swiglu_bf16_m16(const GemvArgs a) { gemv_kernel<gemv::BF16, 2, true>(a); }
DSV4_KERNEL void __launch_bounds__(512, 1) gemv_fp8_m8(const GemvArgs a) { gemv_kernel<gemv::FP8, 1, false>(a); }
DSV4_KERNEL void gemv_fp8_m16(const GemvArgs a) { gemv_kernel<gemv::FP8, 2, false>(a); }
DSV4_KERNEL void __launch_bounds__(512, 1) gemv_swiglu_fp8_m8(const GemvArgs a) { gemv_kernel<gemv::FP8, 1, true>(a); }
DSV4_KERNEL void gemv_swiglu_fp8_m16(const GemvArgs a) { gemv_kernel<gemv::FP8, 2, true>(a); }
// FP8 at M = 1 with prescaled activations (PS; the launcher's choice where they are staged).
DSV4_KERNEL void __launch_bounds__(512, 1) gemv_fp8_m1(const GemvArgs a) { gemv_kernel<gemv::FP8, 1, false, true>(a); }
DSV4_KERNEL void __launch_bounds__(512, 1) gemv_swiglu_fp8_m1(const GemvArgs a) { gemv_kernel<gemv::FP8, 1, true, true>(a); }
DSV4_KERNEL void __launch_bounds__(512, 1) gemv_nvfp4_m8(const GemvArgs a) { gemv_kernel<gemv::NVFP4, 1, false>(a); }
DSV4_KERNEL void gemv_nvfp4_m16(const GemvArgs a) { gemv_kernel<gemv::NVFP4, 2, false>(a); }
DSV4_KERNEL void __launch_bounds__(512, 1) gemv_swiglu_nvfp4_m8(const GemvArgs a) { gemv_kernel<gemv::NVFP4, 1, true>(a); }
DSV4_KERNEL void gemv_swiglu_nvfp4_m16(const GemvArgs a) { gemv_kernel<gemv::NVFP4, 2, true>(a); }
DSV4_KERNEL void __launch_bounds__(512, 1) gemv_mxfp4_m8(const GemvArgs a) { gemv_kernel<gemv::MXFP4, 1, false>(a); }
DSV4_KERNEL void gemv_mxfp4_m16(const GemvArgs a) { gemv_kernel<gemv::MXFP4, 2, false>(a); }
DSV4_KERNEL void __launch_bounds__(512, 1) gemv_swiglu_mxfp4_m8(const GemvArgs a) { gemv_kernel<gemv::MXFP4, 1, true>(a); }
DSV4_KERNEL void gemv_swiglu_mxfp4_m16(const GemvArgs a) { gemv_kernel<gemv::MXFP4, 2, true>(a); }
