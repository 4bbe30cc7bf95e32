// Manifold-constrained hyper-connections (spec §4) for hc_mult = 4 streams: the mix
// projection of the RMS-normalized streams spread over many blocks (hc_mix_partials), then
// one block per token finishing the mix from the partials beside the collapse with the
// sub-layer's RMSNorm (hc_pre, and hc_head with pre weights only and the output norm); Sinkhorn
// on the comb logits in a launch of its own beside the sub-layer (hc_comb); the expansion back
// fused with the next site's mix projection (hc_post_mix).
//
// The stream count is a compile-time 4 (every DeepSeek-V4 model), so the mixing arrays stay
// in registers. Products and sums the CPU reference rounds one by one use __f*_rn in its
// order; the mix dot products and the norm's sum of squares are summed in another (fixed)
// order, by fused multiply-adds.
#include "dsv4_common.cuh"

using namespace dsv4;

#define HC 4
#define MIX ((2 + HC) * HC)

__device__ __forceinline__ float sigmoid_rn(float x) { return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-x))); }

// Columns of the flattened streams one hc_mix_partials block takes.
#define MIX_COLS 128
// Per (token, column block): MIX dot products and the sum of squares.
#define PART (MIX + 1)

// The block's columns [j0, j0 + len) of fn's mix rows [mix, width] into fs [mix, MIX_COLS],
// by asynchronous copies issued before the block waits for its predecessor (fn is a weight):
// its DRAM round trip overlaps the predecessor's end instead of following the wait. width and
// len are multiples of 4 (width = HC * d).
__device__ __forceinline__ void stage_fn(float* fs, const float* __restrict__ fn, u32 mix, u32 width, u32 j0,
                                         u32 len) {
    constexpr u32 PIECES = MIX_COLS / 4u;
    for (u32 i = threadIdx.x; i < mix * PIECES; i += blockDim.x) {
        const u32 k = i / PIECES, c = 4u * (i % PIECES);
        if (c < len) cp_async16(fs + k * MIX_COLS + c, fn + (u64)k * width + j0 + c);
    }
    cp_async_commit();
}

// One halving step of warp_sums at butterfly offset O: of a lane's 2N values the lower half
// stays (or the upper, where bit O of the lane is set, moved down), plus the partner's copies.
template <u32 N, u32 O>
__device__ __forceinline__ void halve(float* a, u32 lane) {
    const bool up = (lane & O) != 0u;
#pragma unroll
    for (u32 i = 0; i < N; i++) {
        const float send = up ? a[i] : a[N + i];
        const float keep = up ? a[N + i] : a[i];
        a[i] = __fadd_rn(keep, __shfl_xor_sync(0xffffffffu, send, O));
    }
}

// Warp sums of a lane's TPB values (a power of two up to 32) in warp_sum's tree, all at once:
// while a lane holds more than one, each butterfly step halves them (a lane keeps one half and
// adds its partner's copies of it), then plain butterflies. Every step adds the same two
// subtrees as warp_sum's (a + b == b + a), so the bits are warp_sum's; lane L ends with the sum
// of value L >> (5 - log2 TPB). TPB - 1 shuffles instead of 5 TPB.
template <u32 TPB>
__device__ __forceinline__ float warp_sums(float (&a)[TPB], u32 lane) {
    static_assert(TPB >= 1u && TPB <= 32u && (TPB & (TPB - 1u)) == 0u, "a power of two up to 32");
    if constexpr (TPB >= 2u) halve<TPB / 2u, 16u>(a, lane);
    if constexpr (TPB >= 4u) halve<TPB / 4u, 8u>(a, lane);
    if constexpr (TPB >= 8u) halve<TPB / 8u, 4u>(a, lane);
    if constexpr (TPB >= 16u) halve<TPB / 16u, 2u>(a, lane);
    if constexpr (TPB >= 32u) halve<1u, 1u>(a, lane);
#pragma unroll
    for (u32 o = 16u / TPB; o > 0u; o >>= 1) a[0] = __fadd_rn(a[0], __shfl_xor_sync(0xffffffffu, a[0], o));
    return a[0];
}

// Rows of the mix projection a warp takes at once, and tokens of them (fewer registers than a
// block's sixteen): each staged stream value a warp loads serves MIX_GROUP rows.
#define MIX_GROUP 3u
#define MIX_TOKENS 8u

// Block (c, y)'s part of the mix projection for TPB tokens t0 = y * TPB .. (those below n),
// with columns [c * MIX_COLS, ...) of each token's streams staged in sv (MIX_COLS apart) and
// of fn's rows in fs (stage_fn, landed): row k < mix is fn[k, cols] . s[cols], row `mix` the
// sum of squares. Warp w takes rows w, w + warps, ... below mix, MIX_GROUP at a time for
// MIX_TOKENS tokens at a time, then warp mix % warps the squares. Lane l takes columns
// 4l..4l+3 (len is a multiple of 4: the streams are HC * d wide) by fused multiply-adds;
// warp_sums adds the lanes up (each token and row in the same order, however many share the
// block or the warp). partials is [n, gridDim.x, PART].
template <u32 TPB>
__device__ __forceinline__ void mix_rows(const float* sv, u32 len, const float* fs, u32 mix,
                                         float* __restrict__ partials, u32 n) {
    static_assert(MIX_COLS == 4 * 32, "a lane's four columns");
    constexpr u32 SUB = TPB < MIX_TOKENS ? TPB : MIX_TOKENS;
    static_assert(TPB % SUB == 0u, "whole passes of tokens");
    static_assert(SUB == 1u || SUB == 2u || SUB == 4u || SUB == 8u, "a power of two up to MIX_TOKENS");
    constexpr u32 SHIFT = SUB == 1u ? 5u : SUB == 2u ? 4u : SUB == 4u ? 3u : 2u;
    const u32 warp = threadIdx.x / 32u, lane = threadIdx.x % 32u, warps = blockDim.x / 32u;
    const u32 i = 4u * lane;
    const bool live = i < len;
    // After warp_sums lane L holds the sums of the pass's token L >> SHIFT; the first lane of
    // each token writes them.
    const bool first = (lane & ((1u << SHIFT) - 1u)) == 0u;
    const auto out = [&](u32 h) -> float* {
        const u32 t = blockIdx.y * TPB + h + (lane >> SHIFT);
        return first && t < n ? partials + ((u64)t * gridDim.x + blockIdx.x) * PART : nullptr;
    };
    for (u32 k0 = warp; k0 < mix; k0 += MIX_GROUP * warps) {
        float4 w[MIX_GROUP];
#pragma unroll
        for (u32 g = 0; g < MIX_GROUP; g++) {
            const u32 k = k0 + g * warps;
            w[g] = k < mix && live ? *reinterpret_cast<const float4*>(fs + k * MIX_COLS + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
#pragma unroll
        for (u32 h = 0; h < TPB; h += SUB) {
            float acc[MIX_GROUP][SUB];
#pragma unroll
            for (u32 tt = 0; tt < SUB; tt++) {
                const float4 v = live ? *reinterpret_cast<const float4*>(sv + (h + tt) * MIX_COLS + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
                for (u32 g = 0; g < MIX_GROUP; g++)
                    acc[g][tt] = fmaf(w[g].w, v.w, fmaf(w[g].z, v.z, fmaf(w[g].y, v.y, w[g].x * v.x)));
            }
            float* dst = out(h);
#pragma unroll
            for (u32 g = 0; g < MIX_GROUP; g++) {
                const u32 k = k0 + g * warps;
                if (k >= mix) break;
                const float sum = warp_sums<SUB>(acc[g], lane);
                if (dst) dst[k] = sum;
            }
        }
    }
    if (warp == mix % warps) {
#pragma unroll
        for (u32 h = 0; h < TPB; h += SUB) {
            float acc[SUB];
#pragma unroll
            for (u32 tt = 0; tt < SUB; tt++) {
                const float4 v = live ? *reinterpret_cast<const float4*>(sv + (h + tt) * MIX_COLS + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                acc[tt] = fmaf(v.w, v.w, fmaf(v.z, v.z, fmaf(v.y, v.y, v.x * v.x)));
            }
            const float sum = warp_sums<SUB>(acc, lane);
            float* dst = out(h);
            if (dst) dst[mix] = sum;
        }
    }
}

// Threads of a mix block (the launchers' THREADS): MIX_THREADS / MIX_COLS tokens staged at once.
#define MIX_THREADS 256u

// Block (c, y) of a mix projection for TPB tokens y * TPB .. (those below n): fn's slice
// staged before the wait, then sv[tt][col] = column(e)(t) for the block's columns e of each
// token (threads take fixed columns, so `column` does a column's index arithmetic once, past
// the row's end too, where its value is never asked for; and all of a thread's tokens at
// once, so their loads are in flight together), then mix_rows.
template <u32 TPB, class Column>
__device__ __forceinline__ void mix_block(const float* __restrict__ fn, u32 mix, u32 width,
                                          float* __restrict__ partials, u32 n, Column column) {
    constexpr u32 LANES = MIX_THREADS / MIX_COLS, PER = (TPB + LANES - 1u) / LANES;
    __shared__ __align__(16) float sv[TPB * MIX_COLS];
    __shared__ __align__(16) float fs[MIX * MIX_COLS];
    const u32 t0 = blockIdx.y * TPB, j0 = blockIdx.x * MIX_COLS;
    const u32 len = min(MIX_COLS, width - j0);
    stage_fn(fs, fn, mix, width, j0, len);
    pdl_enter();
    const u32 col = threadIdx.x % MIX_COLS, lane0 = threadIdx.x / MIX_COLS;
    const auto value = column(j0 + col);
    float v[PER];
#pragma unroll
    for (u32 i = 0; i < PER; i++) {
        const u32 tt = lane0 + i * LANES;
        v[i] = tt < TPB && t0 + tt < n && col < len ? value(t0 + tt) : 0.0f;
    }
#pragma unroll
    for (u32 i = 0; i < PER; i++)
        if (lane0 + i * LANES < TPB) sv[(lane0 + i * LANES) * MIX_COLS + col] = v[i];
    cp_async_wait<0>();
    __syncthreads();
    mix_rows<TPB>(sv, len, fs, mix, partials, n);
}

// The mix projection spread over the GPU: block (c, y) stages its columns of TPB tokens'
// streams and runs mix_rows.
template <u32 TPB>
__device__ __forceinline__ void mix_partials(const float* __restrict__ streams, u32 width,
                                             const float* __restrict__ fn, u32 mix, float* __restrict__ partials,
                                             u32 n) {
    mix_block<TPB>(fn, mix, width, partials, n,
                   [&](u32 e) { return [=](u32 t) { return streams[(u64)t * width + e]; }; });
}

DSV4_KERNEL void __launch_bounds__(MIX_THREADS) hc_mix_partials(const float* __restrict__ streams, u32 width, const float* __restrict__ fn,
                                 u32 mix, float* __restrict__ partials) {
    mix_partials<1>(streams, width, fn, mix, partials, gridDim.y);
}

// Sixteen tokens a block (launches of more than sixteen): each fn value read once for them.
DSV4_KERNEL void __launch_bounds__(MIX_THREADS) hc_mix_partials_t16(const float* __restrict__ streams, u32 width, const float* __restrict__ fn,
                                    u32 mix, float* __restrict__ partials, u32 n) {
    mix_partials<16>(streams, width, fn, mix, partials, n);
}

// The expansion into out, then the next site's mix projection (fn [mix, HC * d]) of out:
// out[t, e] for flattened column e = j * d + c, written as mix_block stages it. A non-null
// y_plus is added to y first (one rounding: the MoE's shared expert beside its routed ones).
template <u32 TPB>
__device__ __forceinline__ void post_mix(const float* __restrict__ streams, const float* __restrict__ y,
                                         const float* __restrict__ y_plus, const float* __restrict__ post,
                                         const float* __restrict__ comb, u32 d,
                                         float* __restrict__ out, const float* __restrict__ fn, u32 mix,
                                         float* __restrict__ partials, u32 n) {
    const u32 width = HC * d;
    mix_block<TPB>(fn, mix, width, partials, n, [&](u32 e) {
        const u32 j = e / d, c = e % d;
        return [=](u32 t) {
            const float* s = streams + (u64)t * width + c;
            const float* m = comb + (u64)t * HC * HC + j;
            const u64 yc = (u64)t * d + c;
            const float yv = y_plus ? __fadd_rn(y[yc], y_plus[yc]) : y[yc];
            float acc = __fmul_rn(post[(u64)t * HC + j], yv);
#pragma unroll
            for (u32 i = 0; i < HC; i++) acc = __fadd_rn(acc, __fmul_rn(m[i * HC], s[(u64)i * d]));
            out[(u64)t * width + e] = acc;
            return acc;
        };
    });
}

DSV4_KERNEL void __launch_bounds__(MIX_THREADS) hc_post_mix(const float* __restrict__ streams, const float* __restrict__ y,
                             const float* __restrict__ y_plus, const float* __restrict__ post,
                             const float* __restrict__ comb, u32 d, float* __restrict__ out,
                             const float* __restrict__ fn, u32 mix, float* __restrict__ partials) {
    post_mix<1>(streams, y, y_plus, post, comb, d, out, fn, mix, partials, gridDim.y);
}

// Sixteen tokens a block (launches of more than sixteen): each fn value read once for them.
DSV4_KERNEL void __launch_bounds__(MIX_THREADS) hc_post_mix_t16(const float* __restrict__ streams, const float* __restrict__ y,
                                const float* __restrict__ y_plus, const float* __restrict__ post,
                                const float* __restrict__ comb, u32 d, float* __restrict__ out,
                                const float* __restrict__ fn, u32 mix, float* __restrict__ partials, u32 n) {
    post_mix<16>(streams, y, y_plus, post, comb, d, out, fn, mix, partials, n);
}

// mu[k] = rsqrt(mean(s^2) + eps) * (fn[k, :] . s) for k < mix, from one token's `splits`
// partials, into shared mu: warp w sums rows w, w + 8, ..., lanes striding the column blocks,
// then a fixed shuffle tree.
__device__ __forceinline__ void mix_from_partials(const float* __restrict__ part, u32 splits, u32 mix, u32 width,
                                                  float norm_eps, float* mu, float* sums) {
    const u32 warp = threadIdx.x / 32u, lane = threadIdx.x % 32u, warps = blockDim.x / 32u;
    for (u32 k = warp; k <= mix; k += warps) {
        float acc = 0.0f;
        for (u32 c = lane; c < splits; c += 32u) acc = __fadd_rn(acc, part[(u64)c * PART + k]);
        acc = warp_sum(acc);
        if (lane == 0u) sums[k] = acc;
    }
    __syncthreads();
    const float r = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(sums[mix], (float)width), norm_eps)));
    if (threadIdx.x < mix) mu[threadIdx.x] = __fmul_rn(r, sums[threadIdx.x]);
    __syncthreads();
}

// Sum of v over the block's first `threads` threads (whole warps), for all of them: a shuffle
// tree per warp, then over the warps in order. Named barrier 1 syncs only those threads, so a
// warp past them (hc_pre's mix warp) runs on meanwhile. Once per token: the callers'
// __syncthreads between tokens orders the reuse of scratch.
__device__ __forceinline__ float collapse_sum(float v, float* scratch, u32 threads) {
    v = warp_sum(v);
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    if (lane == 0u) scratch[warp] = v;
    asm volatile("bar.sync 1, %0;" ::"r"(threads) : "memory");
    return warp_sum(lane < threads / 32u ? scratch[lane] : 0.0f);
}

// Columns a collapse thread holds in registers, with their weight and their streams' values:
// all of them for widths up to COLLAPSE_HELD * 992 (V4-Flash's 4096; more would spill at 1024
// threads), the rest through xn.
#define COLLAPSE_HELD 5u

// The streams' values of a thread's held columns (columns threadIdx.x + k * threads of each of
// the HC streams), loaded at once so that their round trip overlaps the mix's (token_pre)
// instead of following it.
__device__ __forceinline__ void load_held_streams(float (&sv)[COLLAPSE_HELD][HC], const float* __restrict__ s, u32 d,
                                                  u32 threads) {
#pragma unroll
    for (u32 k = 0; k < COLLAPSE_HELD; k++) {
        const u32 c = threadIdx.x + k * threads;
#pragma unroll
        for (u32 i = 0; i < HC; i++) sv[k][i] = c < d ? s[(u64)i * d + c] : 0.0f;
    }
}

// x = sum_i pre[i] * stream(i) of one column, from stream 0 up.
template <class Stream>
__device__ __forceinline__ float collapse_column(const float* pre, Stream stream) {
    float acc = 0.0f;
#pragma unroll
    for (u32 i = 0; i < HC; i++) acc = __fadd_rn(acc, __fmul_rn(pre[i], stream(i)));
    return acc;
}

// One token's sub-layer input, collapsed and RMS-normalized by the block's first `threads`
// threads: thread i takes columns i, i + threads, ... of x = sum_i pre[i] * s[i * d + c]
// (accumulated from stream 0 up), keeping its first COLLAPSE_HELD in registers (from their
// streams' values in `sv`, load_held_streams; the rest go through xn), then xn = weight * (x *
// r), r = 1 / sqrt(mean(x^2) + eps), and its bf16 copy xb; `wh` holds the weight of the held
// columns (load_held_weight). The sum of squares runs over each thread's columns in order,
// then collapse_sum.
__device__ __forceinline__ void collapse_norm(const float* __restrict__ s, const float (&sv)[COLLAPSE_HELD][HC], u32 d,
                                              const float* pre, const float* __restrict__ weight,
                                              const float (&wh)[COLLAPSE_HELD], float eps, float* __restrict__ xn,
                                              u16* __restrict__ xb, float* scratch, u32 threads) {
    float held[COLLAPSE_HELD];
    float sq = 0.0f;
#pragma unroll
    for (u32 k = 0; k < COLLAPSE_HELD; k++) {
        const u32 c = threadIdx.x + k * threads;
        const float v = collapse_column(pre, [&](u32 i) { return sv[k][i]; });
        held[k] = c < d ? v : 0.0f;
        if (c < d) sq = __fadd_rn(sq, __fmul_rn(held[k], held[k]));
    }
    for (u32 c = threadIdx.x + COLLAPSE_HELD * threads; c < d; c += threads) {
        const float v = collapse_column(pre, [&](u32 i) { return s[(u64)i * d + c]; });
        xn[c] = v;
        sq = __fadd_rn(sq, __fmul_rn(v, v));
    }
    sq = collapse_sum(sq, scratch, threads);
    const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(sq, (float)d), eps)));
    const auto put = [&](u32 c, float x, float w) {
        const float y = __fmul_rn(w, __fmul_rn(x, inv));
        xn[c] = y;
        xb[c] = f32_to_bf16(y);
    };
#pragma unroll
    for (u32 k = 0; k < COLLAPSE_HELD; k++) {
        const u32 c = threadIdx.x + k * threads;
        if (c < d) put(c, held[k], wh[k]);
    }
    for (u32 c = threadIdx.x + COLLAPSE_HELD * threads; c < d; c += threads) put(c, xn[c], weight[c]);
}

// Sum (in index order) or max of the 4 values of lane `lane`'s row (`row` = true) or column
// of the 4x4 matrix held one element a lane by lanes 0..15 (lane = 4 * i + j).
__device__ __forceinline__ float line_sum(float v, u32 lane, bool row) {
    const u32 base = row ? (lane & 12u) : (lane & 3u);
    const u32 step = row ? 1u : 4u;
    float s = __shfl_sync(0xffffffffu, v, base);
#pragma unroll
    for (u32 k = 1; k < HC; k++) s = __fadd_rn(s, __shfl_sync(0xffffffffu, v, base + k * step));
    return s;
}

__device__ __forceinline__ float row_max(float v, u32 lane) {
    const u32 base = lane & 12u;
    float m = __shfl_sync(0xffffffffu, v, base);
#pragma unroll
    for (u32 k = 1; k < HC; k++) m = fmaxf(m, __shfl_sync(0xffffffffu, v, base + k));
    return m;
}

// Sinkhorn on the 4x4 matrix held one element a lane (warp-wide call; lanes 16..31 mirror
// 0..15): row softmax + eps, column normalize, then iters - 1 (row, column) rounds; eps guards
// each division. Every sum runs in the CPU reference's order, so the bits are the same.
__device__ __forceinline__ float sinkhorn_lane(float c, u32 lane, u32 iters, float eps) {
    lane &= 15u;
    c = expf(__fsub_rn(c, row_max(c, lane)));
    c = __fadd_rn(__fdiv_rn(c, line_sum(c, lane, true)), eps);
    // The first column pass runs even with iters = 0, as in the reference.
    const u32 rounds = iters > 0u ? iters : 1u;
    for (u32 it = 0; it < rounds; it++) {
        if (it > 0u) c = __fdiv_rn(c, __fadd_rn(line_sum(c, lane, true), eps));
        c = __fdiv_rn(c, __fadd_rn(line_sum(c, lane, false), eps));
    }
    return c;
}

// What hc_pre and hc_head keep in shared memory: the mix sums and mix, the pre weights, the
// norm's scratch, and the site's mix biases and scales.
struct SiteShared {
    float sums[PART], mu[MIX], pre[HC], scratch[32], base[MIX], scale[3];
};

// Before the wait (they are weights): the norm weight of the thread's held columns (among the
// first `threads`) into wh, the site's `mix` biases and `scales` scales into sh (visible to all
// after token_pre's barriers).
__device__ __forceinline__ void load_site(SiteShared& sh, float (&wh)[COLLAPSE_HELD], const float* __restrict__ weight,
                                          u32 d, u32 threads, const float* __restrict__ base,
                                          const float* __restrict__ scale, u32 mix, u32 scales) {
    load_held_weight(wh, weight, d, threads);
    if (threadIdx.x < mix) sh.base[threadIdx.x] = base[threadIdx.x];
    else if (threadIdx.x < mix + scales) sh.scale[threadIdx.x - mix] = scale[threadIdx.x - mix];
}

// One token's mix from its partials (sh.mu) and its pre weights sigmoid(scale[0] * mu + base) +
// eps (sh.pre); the whole block calls it.
__device__ __forceinline__ void token_pre(const float* __restrict__ part, u32 splits, u32 mix, u32 width,
                                          float norm_eps, float hc_eps, SiteShared& sh) {
    mix_from_partials(part, splits, mix, width, norm_eps, sh.mu, sh.sums);
    if (threadIdx.x < HC)
        sh.pre[threadIdx.x] =
            __fadd_rn(sigmoid_rn(__fadd_rn(__fmul_rn(sh.scale[0], sh.mu[threadIdx.x]), sh.base[threadIdx.x])), hc_eps);
    __syncthreads();
}

// After hc_mix_partials: streams [n, HC * d] -> the normalized sub-layer input xn [n, d] (and
// its bf16 copy xb), post [n, HC], and comb [n, HC * HC] as the Sinkhorn's logits (hc_comb
// finishes them beside the sub-layer: only the expansion at its end reads them). One block per
// token (grid-stride): its last warp writes post and the logits while the others collapse and
// normalize.
DSV4_KERNEL void __launch_bounds__(1024) hc_pre(const float* __restrict__ streams, u32 n, u32 d, const float* __restrict__ partials,
                        u32 splits, const float* __restrict__ base, const float* __restrict__ scale,
                        float hc_eps, float norm_eps, const float* __restrict__ weight,
                        float eps, float* __restrict__ xn, u16* __restrict__ xb, float* __restrict__ post,
                        float* __restrict__ comb) {
    __shared__ SiteShared sh;
    const u32 width = HC * d, collapse_threads = blockDim.x - 32u;
    float wh[COLLAPSE_HELD];
    load_site(sh, wh, weight, d, collapse_threads, base, scale, MIX, 3u);
    pdl_enter();
    for (u32 t = blockIdx.x; t < n; t += gridDim.x) {
        float sv[COLLAPSE_HELD][HC];
        if (threadIdx.x < collapse_threads) load_held_streams(sv, streams + (u64)t * width, d, collapse_threads);
        token_pre(partials + (u64)t * splits * PART, splits, MIX, width, norm_eps, hc_eps, sh);
        if (threadIdx.x >= collapse_threads) {
            // The last warp: lanes 0..3 the post weights, lanes 0..15 one comb logit each.
            const u32 lane = threadIdx.x - collapse_threads;
            if (lane < HC)
                post[(u64)t * HC + lane] =
                    __fmul_rn(2.0f, sigmoid_rn(__fadd_rn(__fmul_rn(sh.scale[1], sh.mu[HC + lane]), sh.base[HC + lane])));
            if (lane < HC * HC)
                comb[(u64)t * HC * HC + lane] = __fadd_rn(__fmul_rn(sh.scale[2], sh.mu[2 * HC + lane]), sh.base[2 * HC + lane]);
        } else {
            collapse_norm(streams + (u64)t * width, sv, d, sh.pre, weight, wh, eps, xn + (u64)t * d,
                          xb + (u64)t * d, sh.scratch, collapse_threads);
        }
        __syncthreads();  // pre and mu are rewritten for the next token
    }
}

// Sinkhorn on each token's comb logits from hc_pre, in place: a warp a token (grid-stride),
// lanes 0..15 one element each.
DSV4_KERNEL void hc_comb(float* __restrict__ comb, u32 n, u32 sinkhorn_iters, float hc_eps) {
    pdl_enter();
    const u32 lane = threadIdx.x & 31u, warps = gridDim.x * blockDim.x / 32u;
    for (u32 t = (blockIdx.x * blockDim.x + threadIdx.x) / 32u; t < n; t += warps) {
        float* c = comb + (u64)t * HC * HC;
        const float m = sinkhorn_lane(c[lane & 15u], lane, sinkhorn_iters, hc_eps);
        __syncwarp();  // every lane has read its logit before lanes 0..15 overwrite them
        if (lane < HC * HC) c[lane] = m;
    }
}

// The final collapse and the output norm: pre weights only (fn [HC, HC * d], base [HC],
// scale [1]); the grid as hc_pre's (its last warp idle).
DSV4_KERNEL void __launch_bounds__(1024) hc_head(const float* __restrict__ streams, u32 n, u32 d, const float* __restrict__ partials,
                         u32 splits, const float* __restrict__ base, const float* __restrict__ scale, float hc_eps,
                         float norm_eps, const float* __restrict__ weight, float eps, float* __restrict__ xn,
                         u16* __restrict__ xb) {
    __shared__ SiteShared sh;
    const u32 width = HC * d, collapse_threads = blockDim.x - 32u;
    float wh[COLLAPSE_HELD];
    load_site(sh, wh, weight, d, collapse_threads, base, scale, HC, 1u);
    pdl_enter();
    for (u32 t = blockIdx.x; t < n; t += gridDim.x) {
        float sv[COLLAPSE_HELD][HC];
        if (threadIdx.x < collapse_threads) load_held_streams(sv, streams + (u64)t * width, d, collapse_threads);
        token_pre(partials + (u64)t * splits * PART, splits, HC, width, norm_eps, hc_eps, sh);
        if (threadIdx.x < collapse_threads)
            collapse_norm(streams + (u64)t * width, sv, d, sh.pre, weight, wh, eps, xn + (u64)t * d,
                          xb + (u64)t * d, sh.scratch, collapse_threads);
        __syncthreads();
    }
}
