// Grouped routed-expert MoE for decode, in two launches and without a host round trip:
//
//   moe_gate_up_*: `up_wpt` warps per (8-row tile of the intermediate, selected (token, slot)
//     pair), each a fixed part of K (summed in shared memory in warp order), four warps a
//     block. The first pair that selected an expert does the work for every token that
//     selected it (later duplicates exit), so each selected expert's w1/w3 are read once.
//     Fused gate+up with the clamped SwiGLU epilogue into h[m, topk, inter] (bf16).
//   moe_down_*: one block per 16-row tile of the output. Every block walks the distinct
//     selected experts in ascending id order, a group at a time: its warps take the group's
//     (expert, K step) items in turn and park each item's partial in shared memory, then each
//     thread takes an output (row, token) and adds, for each expert the token chose, the
//     expert's steps in order times the token's routing weight. Each token's output is
//     therefore a fixed-order sum over its own experts, independent of timing and of the other
//     tokens' choices, with no atomics. At decode sizes all selected experts form one group.
//
// The K split of both kernels depends only on the shapes, never on the routing, so a token's
// output is the same alone and in a batch. Both stream weights with the ring of gemv_tile.cu
// and, when the launcher reserved the shared memory (`stage`), read their activations (x for
// gate_up, all of h for down) from a copy staged there once per block.
// Down launches with programmatic dependent launch: it reads the expert ids and routing weights
// (written before gate_up started), sorts the ids and loads its first weights before it waits
// for gate_up's h. Gate_up launches plainly (moe.rs says why); its wait is immediate then, and
// keeps it correct if it is launched early.
// Expert ids outside [0, experts) select nothing. NVFP4 or MXFP4 weights stacked over experts.
#include "gemv_tile.cu"

// Kernel arguments (layout mirrored by `MoeArgs` in dsv4_ops::gpu::moe).
struct MoeArgs {
    const u16* x;          // [m, d] bf16
    const int* ids;        // [m, topk]
    const float* weights;  // [m, topk]
    const u8* w13;         // per expert: w1/w3 packed as gate+up tiles (gemv_tile.cu layout)
    const u8* s13;         // their packed scales (NVFP4 e4m3 per 16, MXFP4 e8m0 per 32)
    const u8* w2;          // per expert: w2 packed as plain tiles
    const u8* s2;
    const float* g1;       // NVFP4 global scales [experts] (null for MXFP4)
    const float* g3;
    const float* g2;
    u16* h;                // [m, topk, inter] bf16
    void* out;             // [m, d] bf16 or f32
    u32 m, topk, experts, d, inter;
    float limit;
    u32 up_wpt;            // gate_up: warps per tile (1, 2 or 4)
    u32 stage;             // bit 0: gate_up stages x, bit 1: down stages h (shared memory)
};

namespace moe {

// The launcher's bounds (`MAX_PAIRS`, `MAX_M` in dsv4_ops::gpu::moe): they size the down
// kernel's shared routing tables, so both sides change together.
constexpr u32 MAX_PAIRS = 256;
constexpr u32 MAX_M = 16;
// Shared-memory floats for the down kernel's item partials (32 KiB).
constexpr u32 PART_FLOATS = 8192;

__device__ __forceinline__ bool valid_expert(int e, u32 experts) { return e >= 0 && (u32)e < experts; }

template <int F>
__device__ __forceinline__ float post_scale(const float* g, int e) {
    return F == gemv::NVFP4 ? __fmul_rn(__ldg(g + e), 65536.0f) : 65536.0f;
}

template <int F, int MT>
__device__ __forceinline__ void gate_up(const MoeArgs& a) {
    using namespace gemv;
    extern __shared__ __align__(16) u16 xs[];
    // Expert ids and x come from the previous kernel: nothing to prefetch before the wait.
    pdl_wait();
    pdl_launch_dependents();
    const u32 pair = blockIdx.y;
    const int e = a.ids[pair];
    if (!valid_expert(e, a.experts)) return;
    for (u32 p = 0; p < pair; ++p)
        if (a.ids[p] == e) return;

    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, G = a.up_wpt;
    const u32 tile = blockIdx.x * ((blockDim.x >> 5) / G) + warp / G, kpart = warp % G;
    const u32 chunks = a.d / 32u, tiles = (a.inter + 7) / 8;
    // Warps past the last tile only take part in the staging and the block's reduction.
    const bool live = tile < tiles;
    const u32 g = lane >> 2;
    const u32 r = tile * 8 + g;
    const u64 t = (u64)e * tiles + (live ? tile : 0);
    const bool staged = a.stage & 1u;
    const u16* x = staged ? xs : a.x;
    // Rows of tokens that did not choose e are computed and dropped.
    Lane L;
    lane_init<F>(L, a.w13 + t * tile_bytes(chunks), a.s13 + t * tile_scale_bytes<F>(chunks), chunks,
                 x + (u64)min(g, a.m - 1) * a.d, x + (u64)min(g + 8, a.m - 1) * a.d, lane);
    const u32 steps = live ? (chunks + STEP_CHUNKS - 1) / STEP_CHUNKS : 0;
    const u32 j0 = sub_begin(steps * kpart / G), j1 = sub_end(L, steps * (kpart + 1) / G);
    Ring<F> ring;
    if (j0 < j1) ring_load<F>(L, j0, j1, ring);
    if (staged) stage_rows(xs, a.d, a.x, a.d, a.m, a.d);
    if (!live && G == 1) return;
    float acc[MT][4];
    zero(acc);
    run_subs<F, MT>(L, j0, j1, ring, acc);
    if (G > 1 && !reduce_warps<MT>(acc, G)) return;
    if (!live || r >= a.inter) return;

    const float p1 = post_scale<F>(a.g1, e), p3 = post_scale<F>(a.g3, e);
    for_each_token<MT>(a.m, [&](int mt, u32 i, u32 m) {
        const u16 v = f32_to_bf16(swiglu(acc[mt][i] * p1, acc[mt][i + 2] * p3, a.limit));
        // Every slot of the token that chose e (normally exactly one).
        for (u32 j = 0; j < a.topk; ++j)
            if (a.ids[m * a.topk + j] == e) a.h[((u64)m * a.topk + j) * a.inter + r] = v;
    });
}

// How the down kernel writes out: bf16, f32, or added to the f32 already there (one add).
enum Out { OUT_BF16, OUT_F32, OUT_F32_ADD };

template <int F, int MT, int OUT>
__device__ __forceinline__ void down(const MoeArgs& a) {
    using namespace gemv;
    // Items are whole K steps of one expert: the ring must hold exactly one step.
    static_assert(RingOf<F>::R == U, "the down kernel's ring holds one K step");
    extern __shared__ __align__(16) u16 hs[];
    __shared__ int ids[MAX_PAIRS];
    __shared__ unsigned char first[MAX_PAIRS];
    __shared__ int uniq[MAX_PAIRS];
    // Routing weights by pair and post scales by rank, read once here: read in the final sum,
    // their L2 round trips would sit between the block's last item and its output.
    __shared__ float wts[MAX_PAIRS];
    __shared__ float posts[MAX_PAIRS];
    const u32 pairs = a.m * a.topk;
    for (u32 i = threadIdx.x; i < pairs; i += blockDim.x) {
        ids[i] = a.ids[i];
        wts[i] = a.weights[i];
    }
    __syncthreads();
    // Distinct valid experts, sorted: a pair is the representative of its expert if no earlier
    // pair has it; its rank is the number of smaller representatives.
    for (u32 i = threadIdx.x; i < pairs; i += blockDim.x) {
        bool f = valid_expert(ids[i], a.experts);
        for (u32 p = 0; p < i && f; ++p) f = ids[p] != ids[i];
        first[i] = f;
    }
    __syncthreads();
    u32 distinct = 0;
    for (u32 p = 0; p < pairs; ++p) distinct += first[p];
    for (u32 i = threadIdx.x; i < pairs; i += blockDim.x) {
        if (!first[i]) continue;
        u32 rank = 0;
        for (u32 p = 0; p < pairs; ++p) rank += (first[p] && ids[p] < ids[i]);
        uniq[rank] = ids[i];
        posts[rank] = post_scale<F>(a.g2, ids[i]);
    }
    __syncthreads();
    // hslot[t * distinct + r]: the first slot of token t that chose expert uniq[r] (0 if none:
    // that token's column is computed and dropped), so that an item finds its h rows in one
    // read. Every slot is compared (no early exit): the reads do not wait on each other.
    __shared__ u8 hslot[MAX_M * MAX_PAIRS];
    for (u32 i = threadIdx.x; i < a.m * distinct; i += blockDim.x) {
        const u32 t = i / distinct;
        const int e = uniq[i % distinct];
        u32 slot = 0;
        for (u32 j = a.topk; j-- > 0;)
            if (ids[t * a.topk + j] == e) slot = j;
        hslot[i] = (u8)slot;
    }
    __syncthreads();

    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const u32 g = lane >> 2;
    const u32 tile = blockIdx.x;
    const u32 chunks = a.inter / 32u, tiles = (a.d + 15) / 16;
    const u32 steps = (chunks + STEP_CHUNKS - 1) / STEP_CHUNKS;
    const bool staged = a.stage & 2u;
    const u16* h = staged ? hs : a.h;

    // Item partials of one group of experts: [item][MT * 4][lane].
    __shared__ float part[PART_FLOATS];
    constexpr u32 PER_ITEM = MT * 4 * 32;
    const u32 group = max(1u, (PART_FLOATS / PER_ITEM) / steps);

    // The lane's view of item it of the group at g0: expert uniq[g0 + it / steps].
    const u32 t_lo = min(g, a.m - 1), t_hi = min(g + 8, a.m - 1);
    auto item_lane = [&](u32 g0, u32 it, Lane& L) {
        const u32 r = g0 + it / steps;
        const u64 t = (u64)uniq[r] * tiles + tile;
        const u16* h_lo = h + ((u64)t_lo * a.topk + hslot[t_lo * distinct + r]) * a.inter;
        const u16* h_hi = h + ((u64)t_hi * a.topk + hslot[t_hi * distinct + r]) * a.inter;
        lane_init<F>(L, a.w2 + t * tile_bytes(chunks), a.s2 + t * tile_scale_bytes<F>(chunks), chunks, h_lo,
                     h_hi, lane);
    };

    // Outputs of the block, PER_ITEM (16 rows x 8 * MT tokens in MMA accumulator order), summed
    // by all threads at once: thread x holds outputs x, x + blockDim.x, ... (blocks have at least
    // 128 threads).
    constexpr u32 OUTS = PER_ITEM / 128;
    float acc[OUTS];
#pragma unroll
    for (u32 c = 0; c < OUTS; ++c) acc[c] = 0.0f;
    // Output o is accumulator i = (o / 32) % 4 of MMA tile mt = o / 128 in lane o % 32: tile row
    // (lane / 4) + 8 * (i / 2), token mt * 8 + 2 * (lane % 4) + i % 2.
    auto out_token = [](u32 o) { return (o / 128) * 8 + 2 * (o % 4) + ((o / 32) & 1); };
    auto out_row = [&](u32 o) { return tile * 16 + (o % 32) / 4 + 8 * ((o / 64) & 1); };

    // Per token, the ranks of its experts in ascending order with their factors (routing weight
    // summed over the token's slots of the expert, in slot order, times the post scale); experts
    // of weight 0 are left out. tok_n[t] <= topk entries at tok_*[t * topk]. Built once the
    // first weights are on their way; read after the first group's barrier.
    __shared__ u16 tok_rank[MAX_PAIRS];
    __shared__ float tok_f[MAX_PAIRS];
    __shared__ u32 tok_n[MAX_M];
    auto build_token_table = [&]() {
        for (u32 t = threadIdx.x; t < a.m; t += blockDim.x) {
            u32 n = 0;
            for (u32 r = 0; r < distinct; ++r) {
                float w = 0.0f;
                for (u32 j = 0; j < a.topk; ++j)
                    if (ids[t * a.topk + j] == uniq[r]) w += wts[t * a.topk + j];
                if (w == 0.0f) continue;
                tok_rank[t * a.topk + n] = (u16)r;
                tok_f[t * a.topk + n] = w * posts[r];
                ++n;
            }
            tok_n[t] = n;
        }
    };

    Ring<F> ring;
    Lane lc, ln;
    for (u32 g0 = 0; g0 < distinct; g0 += group) {
        const u32 items = min(group, distinct - g0) * steps;
        if (warp < items) {
            item_lane(g0, warp, lc);
            const u32 st = warp % steps;
            ring_load<F>(lc, sub_begin(st), sub_end(lc, st + 1), ring);
        }
        // h is gate_up's output: wait for it here, while the first items' weights (constant)
        // are on their way. The ids and routing weights were written before gate_up
        // started, so they could be read above.
        if (g0 == 0) {
            build_token_table();
            pdl_wait();
            pdl_launch_dependents();
            if (staged) stage_rows(hs, a.inter, a.h, a.inter, pairs, a.inter);
        }
        // Each item's loads are issued while the previous item is computed (the ring).
#pragma unroll 1
        for (u32 it = warp; it < items; it += nw) {
            const bool more = it + nw < items;
            if (more) item_lane(g0, it + nw, ln);
            else ln = lc;
            float t[MT][4], t2[MT][4];
            zero(t);
            zero(t2);
            const u32 j = U * (it % steps), jn = U * ((it + nw) % steps);
#pragma unroll
            for (u32 u = 0; u < U; ++u)
                slot_step<F, MT>(lc, j + u, j + u < lc.subs, ln, jn + u, more && jn + u < ln.subs, ring.r[u], t, t2);
            fold(t, t2);
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int i = 0; i < 4; ++i) part[it * PER_ITEM + (m * 4 + i) * 32 + lane] = t[m][i];
            lc = ln;
        }
        __syncthreads();
        // Each output adds its token's experts of this group in ascending order, each expert's
        // steps in order; tokens without an expert skip it.
        const u32 g1 = g0 + items / steps;
#pragma unroll
        for (u32 c = 0; c < OUTS; ++c) {
            const u32 o = threadIdx.x + c * blockDim.x, m = out_token(o);
            if (o >= PER_ITEM || m >= a.m) continue;
            for (u32 k = 0; k < tok_n[m]; ++k) {
                const u32 r = tok_rank[m * a.topk + k];
                if (r < g0 || r >= g1) continue;
                float tot = 0.0f;
                for (u32 st = 0; st < steps; ++st) tot += part[((r - g0) * steps + st) * PER_ITEM + o];
                acc[c] = fmaf(tok_f[m * a.topk + k], tot, acc[c]);
            }
        }
        __syncthreads();
    }
    // Without a selected expert the loop above never waited.
    pdl_wait();
#pragma unroll
    for (u32 c = 0; c < OUTS; ++c) {
        const u32 o = threadIdx.x + c * blockDim.x, m = out_token(o), r = out_row(o);
        if (o >= PER_ITEM || m >= a.m || r >= a.d) continue;
        const u64 i = (u64)m * a.d + r;
        if (OUT == OUT_F32_ADD) static_cast<float*>(a.out)[i] = __fadd_rn(static_cast<float*>(a.out)[i], acc[c]);
        else if (OUT == OUT_F32) static_cast<float*>(a.out)[i] = acc[c];
        else static_cast<u16*>(a.out)[i] = f32_to_bf16(acc[c]);
    }
}

}  // namespace moe

DSV4_KERNEL void __launch_bounds__(128, M8_DEEP_BLOCKS) moe_gate_up_nvfp4_m8(const MoeArgs a) { moe::gate_up<gemv::NVFP4, 1>(a); }
DSV4_KERNEL void moe_gate_up_nvfp4_m16(const MoeArgs a) { moe::gate_up<gemv::NVFP4, 2>(a); }
DSV4_KERNEL void __launch_bounds__(128, M8_DEEP_BLOCKS) moe_gate_up_mxfp4_m8(const MoeArgs a) { moe::gate_up<gemv::MXFP4, 1>(a); }
DSV4_KERNEL void moe_gate_up_mxfp4_m16(const MoeArgs a) { moe::gate_up<gemv::MXFP4, 2>(a); }
DSV4_KERNEL void __launch_bounds__(256, M8_DEEP_BLOCKS / 2) moe_down_nvfp4_m8(const MoeArgs a) { moe::down<gemv::NVFP4, 1, moe::OUT_BF16>(a); }
DSV4_KERNEL void moe_down_nvfp4_m16(const MoeArgs a) { moe::down<gemv::NVFP4, 2, moe::OUT_BF16>(a); }
DSV4_KERNEL void __launch_bounds__(256, M8_DEEP_BLOCKS / 2) moe_down_mxfp4_m8(const MoeArgs a) { moe::down<gemv::MXFP4, 1, moe::OUT_BF16>(a); }
DSV4_KERNEL void moe_down_mxfp4_m16(const MoeArgs a) { moe::down<gemv::MXFP4, 2, moe::OUT_BF16>(a); }
DSV4_KERNEL void __launch_bounds__(256, M8_DEEP_BLOCKS / 2) moe_down_nvfp4_m8_f32(const MoeArgs a) { moe::down<gemv::NVFP4, 1, moe::OUT_F32>(a); }
DSV4_KERNEL void moe_down_nvfp4_m16_f32(const MoeArgs a) { moe::down<gemv::NVFP4, 2, moe::OUT_F32>(a); }
DSV4_KERNEL void __launch_bounds__(256, M8_DEEP_BLOCKS / 2) moe_down_mxfp4_m8_f32(const MoeArgs a) { moe::down<gemv::MXFP4, 1, moe::OUT_F32>(a); }
DSV4_KERNEL void moe_down_mxfp4_m16_f32(const MoeArgs a) { moe::down<gemv::MXFP4, 2, moe::OUT_F32>(a); }
DSV4_KERNEL void __launch_bounds__(256, M8_DEEP_BLOCKS / 2) moe_down_nvfp4_m8_f32add(const MoeArgs a) { moe::down<gemv::NVFP4, 1, moe::OUT_F32_ADD>(a); }
DSV4_KERNEL void moe_down_nvfp4_m16_f32add(const MoeArgs a) { moe::down<gemv::NVFP4, 2, moe::OUT_F32_ADD>(a); }
DSV4_KERNEL void __launch_bounds__(256, M8_DEEP_BLOCKS / 2) moe_down_mxfp4_m8_f32add(const MoeArgs a) { moe::down<gemv::MXFP4, 1, moe::OUT_F32_ADD>(a); }
DSV4_KERNEL void moe_down_mxfp4_m16_f32add(const MoeArgs a) { moe::down<gemv::MXFP4, 2, moe::OUT_F32_ADD>(a); }

// ---- routed experts over a prompt chunk (moe_chunk in dsv4_ops::gpu::moe) ----
//
// moe_sort lists each expert's (token, slot) pairs; the prefill GEMM (gemm.cu) runs gate+up and
// down over each expert's list, writing every pair's rows; moe_combine adds each token's
// weighted pair rows in slot order. Every sum has a fixed order, whatever the routing.

// lists[e * stride + i], i < counts[e]: the pairs p = token * topk + slot with ids[p] == e, in
// ascending order. One block per expert, reading every id.
DSV4_KERNEL void moe_sort(const int* __restrict__ ids, u32 pairs, u32 stride, u32* __restrict__ lists,
                          u32* __restrict__ counts) {
    __shared__ u32 warp_hits[32];
    pdl_enter();
    const u32 e = blockIdx.x, lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    u32 base = 0;
    for (u32 p0 = 0; p0 < pairs; p0 += blockDim.x) {
        const u32 p = p0 + threadIdx.x;
        const bool hit = p < pairs && ids[p] == (int)e;
        const u32 ballot = __ballot_sync(0xffffffffu, hit);
        if (lane == 0u) warp_hits[warp] = __popc(ballot);
        __syncthreads();
        u32 before = base, all = base;
        for (u32 w = 0; w < warps; ++w) {
            if (w < warp) before += warp_hits[w];
            all += warp_hits[w];
        }
        if (hit) lists[(u64)e * stride + before + __popc(ballot & ((1u << lane) - 1u))] = p;
        base = all;
        __syncthreads();
    }
    if (threadIdx.x == 0u) counts[e] = base;
}

// out[t, c] += sum over slots s of weights[t, s] * rows[t * topk + s, c], in slot order, for
// the slots whose expert id is valid (others wrote no row).
DSV4_KERNEL void moe_combine(const int* __restrict__ ids, const float* __restrict__ weights,
                             const float* __restrict__ rows, float* __restrict__ out, u32 n, u32 topk, u32 d,
                             u32 experts) {
    pdl_enter();
    const u64 total = (u64)n * d;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        const u32 t = (u32)(i / d), c = (u32)(i % d);
        float acc = 0.0f;
        for (u32 s = 0; s < topk; ++s) {
            const u32 p = t * topk + s;
            if (moe::valid_expert(ids[p], experts)) acc = fmaf(weights[p], rows[(u64)p * d + c], acc);
        }
        out[i] = __fadd_rn(out[i], acc);
    }
}
