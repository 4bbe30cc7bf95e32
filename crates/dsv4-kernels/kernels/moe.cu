// Grouped routed-expert MoE for decode, in two launches and without a host round trip. Both
// kernels compute, for each selected expert, only the tokens that chose it, eight at a time (an
// MMA's columns); a batch of sequences mostly chooses different experts, so most experts serve
// one or two tokens.
//
//   moe_gate_up_*: `up_wpt` warps per (8-row tile of the intermediate, selected (token, slot)
//     pair), each a fixed part of K (summed in shared memory in warp order), four warps a
//     block. The pairs of every eighth token that selected an expert (the first, the ninth)
//     do its work, each for eight of its tokens (the other pairs exit), so each selected
//     expert's w1/w3 are read once per eight of its tokens. Fused gate+up with the clamped
//     SwiGLU epilogue into h[m, topk, inter] (bf16).
//   moe_down_*: one block per 16-row tile of the output. The block lists the distinct selected
//     experts in ascending id order and splits each into units of up to eight of its tokens.
//     It walks the units a group at a time: its warps take the group's (unit, K step) items in
//     turn and park each item's partial in shared memory, then each thread takes an output
//     (row, token) and adds, for each expert the token chose, the expert's steps in order times
//     the token's routing weight. Each token's output is therefore a fixed-order sum over its
//     own experts, independent of timing and of the other tokens' choices, with no atomics.
//     One token (down_one) skips the tables: each warp ranks the experts from the ids in its
//     lanes, so the first items start right after the wait (H200, 24 Flash layers: decode
//     3.272 -> 3.216 ms/token); its items and sums are those of the tables' path.
//
// An MMA column's sum does not depend on the other columns, and the K split of both kernels
// depends only on the shapes, never on the routing, so a token's output is the same alone and
// in a batch. Both stream weights with the ring of gemv_tile.cu. Gate_up reads the x rows of
// its tokens from a copy staged in shared memory once per block where the launcher reserved it
// (`stage`); down reads h from global memory (L2) in each item's sub-steps: staging it put a
// block-wide copy and barrier between the wait and the first item's math, on the step's
// critical path (H200, 24 Flash layers: decode 3.436 -> 3.336 ms/token without).
// Down launches with programmatic dependent launch: it reads the expert ids and routing weights
// (written before gate_up started), builds its tables and loads its first weights before it
// waits for gate_up's h. Gate_up launches plainly (moe.rs says why); its wait is immediate then,
// and keeps it correct if it is launched early.
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
    u32 stage;             // 1: gate_up stages x in shared memory
};

namespace moe {

// The launcher's bounds (`MAX_PAIRS`, `MAX_M` in dsv4_ops::gpu::moe): they size the down
// kernel's shared routing tables, so both sides change together.
constexpr u32 MAX_PAIRS = 256;
constexpr u32 MAX_M = 16;
// Most experts of a layer (`MAX_EXPERTS` in dsv4_ops::gpu::moe): the down kernel's tables over
// them share its partials' shared memory.
constexpr u32 MAX_EXPERTS = 4096;
// Tokens of one expert computed together: the MMA's columns.
constexpr u32 COLS = 8;
// Shared-memory floats for the down kernel's item partials (32 KiB).
constexpr u32 PART_FLOATS = 8192;

__device__ __forceinline__ bool valid_expert(int e, u32 experts) { return e >= 0 && (u32)e < experts; }

template <int F>
__device__ __forceinline__ float post_scale(const float* g, int e) {
    return F == gemv::NVFP4 ? __fmul_rn(__ldg(g + e), 65536.0f) : 65536.0f;
}

// Bit position of the n-th (from 0) set bit of mask; mask has more than n set bits.
__device__ __forceinline__ u32 nth_set_bit(u32 mask, u32 n) {
    for (u32 k = 0; k < n; ++k) mask &= mask - 1u;
    return __ffs(mask) - 1;
}

template <int F>
__device__ __forceinline__ void gate_up(const MoeArgs& a) {
    using namespace gemv;
    extern __shared__ __align__(16) u16 xs[];
    // Expert ids and x come from the previous kernel: nothing to prefetch before the wait.
    pdl_wait();
    pdl_launch_dependents();
    const u32 pair = blockIdx.y, token = pair / a.topk;
    const int e = a.ids[pair];
    if (!valid_expert(e, a.experts)) return;
    // A token's first slot of e computes e for columns c0 .. c0 + 7 of e's tokens (ascending)
    // when the token is column c0, a multiple of eight; every other pair exits. Each warp finds
    // the same (lane t holds token t), without a barrier before the weights' first loads.
    const u32 lane = threadIdx.x & 31u;
    bool dup = false, chose = false;
    for (u32 p = token * a.topk + lane; p < pair; p += 32) dup |= a.ids[p] == e;
    if (lane < a.m)
        for (u32 j = 0; j < a.topk; ++j) chose |= a.ids[lane * a.topk + j] == e;
    if (__any_sync(0xffffffffu, dup)) return;
    const u32 mask = __ballot_sync(0xffffffffu, chose);
    const u32 c0 = __popc(mask & ((1u << token) - 1u));
    if (c0 % COLS != 0) return;
    // Columns past the last token repeat it and are dropped.
    const u32 cols = min(COLS, (u32)__popc(mask) - c0);

    const u32 warp = threadIdx.x >> 5, G = a.up_wpt;
    const u32 tile = blockIdx.x * ((blockDim.x >> 5) / G) + warp / G, kpart = warp % G;
    const u32 chunks = a.d / 32u, tiles = (a.inter + 7) / 8;
    // Warps past the last tile only take part in the staging and the block's reduction.
    const bool live = tile < tiles;
    const u32 g = lane >> 2, col = min(g, cols - 1);
    const u32 r = tile * 8 + g;
    const u64 t = (u64)e * tiles + (live ? tile : 0);
    const bool staged = a.stage != 0u;
    const u16* x = staged ? xs + (u64)col * a.d : a.x + (u64)nth_set_bit(mask, c0 + col) * a.d;
    Lane L;
    lane_init<F>(L, a.w13 + t * tile_bytes(chunks), a.s13 + t * tile_scale_bytes<F>(chunks), chunks, x, x, lane);
    const u32 steps = live ? (chunks + STEP_CHUNKS - 1) / STEP_CHUNKS : 0;
    const u32 j0 = sub_begin(steps * kpart / G), j1 = sub_end(L, steps * (kpart + 1) / G);
    Ring<F> ring;
    if (j0 < j1) ring_load<F>(L, j0, j1, ring);
    if (staged) stage_rows(xs, a.d, [&](u32 row) { return a.x + (u64)nth_set_bit(mask, c0 + row) * a.d; }, cols, a.d);
    if (!live && G == 1) return;
    float acc[1][4];
    zero(acc);
    run_subs<F, 1>(L, j0, j1, ring, acc);
    if (G > 1 && !reduce_warps<1>(acc, G)) return;
    if (!live || r >= a.inter) return;

    const float p1 = post_scale<F>(a.g1, e), p3 = post_scale<F>(a.g3, e);
    for_each_token<1>(cols, [&](int, u32 i, u32 c) {
        const u32 m = nth_set_bit(mask, c0 + c);
        const u16 v = f32_to_bf16(swiglu(acc[0][i] * p1, acc[0][i + 2] * p3, a.limit));
        // Every slot of the token that chose e (normally exactly one).
        for (u32 j = 0; j < a.topk; ++j)
            if (a.ids[m * a.topk + j] == e) a.h[((u64)m * a.topk + j) * a.inter + r] = v;
    });
}

// How the down kernel writes out: bf16, f32, or added to the f32 already there (one add).
enum Out { OUT_BF16, OUT_F32, OUT_F32_ADD };

// Outputs of a down block, 16 rows x m tokens, summed by all threads at once: thread x holds
// outputs x, x + blockDim.x (blocks have at least 128 threads). Output o is row
// 8 * (o / 32 % 2) + o % 8 of token 4 * (o / 64) + o / 8 % 4: a warp's rows are the eight of
// one MMA row half, whose partials lie in distinct banks for each column.
__device__ __forceinline__ u32 out_token(u32 o) { return 4 * (o / 64) + o / 8 % 4; }
__device__ __forceinline__ u32 out_row(u32 o) { return 8 * (o / 32 % 2) + o % 8; }
constexpr u32 OUTS = 16 * MAX_M / 128;
// An item's partials in shared memory: accumulator i of lane l holds tile row l / 4 + 8 * (i / 2),
// column 2 * (l % 4) + i % 2.
constexpr u32 PER_ITEM = 4 * 32;
__device__ __forceinline__ u32 part_at(u32 row, u32 col) { return ((row / 8) * 2 + col % 2) * 32 + (row % 8) * 4 + col / 2; }

// Item `it` of a group (step it % steps of lc's tile) into its partials, each slot of the ring
// refilled with the loads of the warp's next item (ln: item itn of its group) where `more`.
template <int F>
__device__ __forceinline__ void down_item(const gemv::Lane& lc, const gemv::Lane& ln, bool more, u32 it, u32 itn,
                                          u32 steps, gemv::Ring<F>& ring, float* part, u32 lane) {
    using namespace gemv;
    float t[1][4], t2[1][4];
    zero(t);
    zero(t2);
    const u32 j = U * (it % steps), jn = U * (itn % steps);
#pragma unroll
    for (u32 u = 0; u < U; ++u)
        slot_step<F, 1>(lc, j + u, j + u < lc.subs, ln, jn + u, more && jn + u < ln.subs, ring.r[u], t, t2);
    fold(t, t2);
#pragma unroll
    for (int i = 0; i < 4; ++i) part[it * PER_ITEM + i * 32 + lane] = t[0][i];
}

template <int OUT>
__device__ __forceinline__ void write_out(const MoeArgs& a, const float (&acc)[OUTS]) {
#pragma unroll
    for (u32 c = 0; c < OUTS; ++c) {
        const u32 o = threadIdx.x + c * blockDim.x, m = out_token(o), r = blockIdx.x * 16 + out_row(o);
        if (m >= a.m || r >= a.d) continue;
        const u64 i = (u64)m * a.d + r;
        if (OUT == OUT_F32_ADD) static_cast<float*>(a.out)[i] = __fadd_rn(static_cast<float*>(a.out)[i], acc[c]);
        else if (OUT == OUT_F32) static_cast<float*>(a.out)[i] = acc[c];
        else static_cast<u16*>(a.out)[i] = f32_to_bf16(acc[c]);
    }
}

// True where down_one takes the launch: one token, its slots in one warp's lanes, and every
// item of its distinct experts in one group of partials.
__device__ __forceinline__ bool one_token(const MoeArgs& a, u32 steps) {
    return a.m == 1 && a.topk <= 32 && a.topk * steps <= PART_FLOATS / PER_ITEM;
}

// The down kernel for one token (one_token), without the routing tables: each warp ranks the
// distinct experts from the ids in its lanes, so its first item's weights are on their way and
// its wait for gate_up's h returns before anything else (the tables put four block barriers
// and two dependent loads there). The same items and the same sums in the same order as the
// tables' path: the same bits.
template <int F, int OUT>
__device__ __forceinline__ void down_one(const MoeArgs& a, float* part, u32 steps) {
    using namespace gemv;
    // Per rank: the expert's summed routing weight times its post scale, and whether that
    // weight is nonzero (experts of weight 0 are left out of the sum).
    __shared__ float fac[32];
    __shared__ u32 kept;
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const bool in = lane < a.topk;
    const int e = in ? a.ids[lane] : -1;
    const float w = in ? a.weights[lane] : 0.0f;
    // Lane p: whether slot p is its expert's first, that expert's weight summed in slot order,
    // and the expert's rank among the distinct valid ones (ascending ids).
    bool first = valid_expert(e, a.experts);
    float wsum = 0.0f;
    for (u32 q = 0; q < a.topk; ++q) {
        const int eq = __shfl_sync(0xffffffffu, e, q);
        const float wq = __shfl_sync(0xffffffffu, w, q);
        if (q < lane && eq == e) first = false;
        if (eq == e) wsum += wq;
    }
    const u32 firsts = __ballot_sync(0xffffffffu, first);
    u32 rank = 0;
    for (u32 q = 0; q < a.topk; ++q) {
        const int eq = __shfl_sync(0xffffffffu, e, q);
        rank += ((firsts >> q) & 1u) && eq < e;
    }
    const float post = first && warp == 0 ? post_scale<F>(a.g2, e) : 0.0f;
    const u32 tile = blockIdx.x, chunks = a.inter / 32u, tiles = (a.d + 15) / 16;
    const u32 items = __popc(firsts) * steps;
    // Item it: step it % steps of the expert of rank it / steps, its h row the expert's first
    // slot. Every lane of the warp calls it (shuffles).
    auto item_lane = [&](u32 it, Lane& L) {
        const u32 p = __ffs(__ballot_sync(0xffffffffu, first && rank == it / steps)) - 1;
        const u64 t = (u64)__shfl_sync(0xffffffffu, e, p) * tiles + tile;
        const u16* hr = a.h + (u64)p * a.inter;
        lane_init<F>(L, a.w2 + t * tile_bytes(chunks), a.s2 + t * tile_scale_bytes<F>(chunks), chunks, hr, hr, lane);
    };
    Ring<F> ring;
    Lane lc, ln;
    if (warp < items) {
        item_lane(warp, lc);
        const u32 st = warp % steps;
        ring_load<F>(lc, sub_begin(st), sub_end(lc, st + 1), ring);
    }
    pdl_wait();
    pdl_launch_dependents();
#pragma unroll 1
    for (u32 it = warp; it < items; it += nw) {
        const bool more = it + nw < items;
        if (more) item_lane(it + nw, ln);
        else ln = lc;
        down_item<F>(lc, ln, more, it, it + nw, steps, ring, part, lane);
        lc = ln;
    }
    if (warp == 0) {
        const u32 k = __ballot_sync(0xffffffffu, first && wsum != 0.0f);
        if (first) fac[rank] = wsum * post;
        // Bit r: the expert of rank r is kept.
        u32 by_rank = 0;
        for (u32 q = 0; q < a.topk; ++q) {
            const u32 rq = __shfl_sync(0xffffffffu, rank, q);
            if ((k >> q) & 1u) by_rank |= 1u << rq;
        }
        if (lane == 0) kept = by_rank;
    }
    __syncthreads();
    float acc[OUTS];
#pragma unroll
    for (u32 c = 0; c < OUTS; ++c) {
        acc[c] = 0.0f;
        const u32 o = threadIdx.x + c * blockDim.x;
        if (out_token(o) != 0) continue;
        const u32 at = part_at(out_row(o), 0);
        for (u32 r = 0; r < items / steps; ++r) {
            if (!((kept >> r) & 1u)) continue;
            float tot = 0.0f;
            for (u32 st = 0; st < steps; ++st) tot += part[(r * steps + st) * PER_ITEM + at];
            acc[c] = fmaf(fac[r], tot, acc[c]);
        }
    }
    write_out<OUT>(a, acc);
}

template <int F, int OUT>
__device__ __forceinline__ void down(const MoeArgs& a) {
    using namespace gemv;
    // Items are whole K steps of one unit: the ring must hold exactly one step.
    static_assert(RingOf<F>::R == U, "the down kernel's ring holds one K step");
    __shared__ int ids[MAX_PAIRS];
    // Routing weights and the experts' post scales by pair, read once here: read in the final
    // sum, their L2 round trips would sit between the block's last item and its output.
    __shared__ float wts[MAX_PAIRS];
    __shared__ float posts[MAX_PAIRS];
    // Per pair: whether it is its token's first slot of its expert, the expert's routing weight
    // summed over the token's slots (in slot order), and the expert's rank among the distinct
    // selected experts (ascending ids: uniq).
    __shared__ u8 tfirst[MAX_PAIRS];
    __shared__ float wsum[MAX_PAIRS];
    __shared__ u16 rank_of[MAX_PAIRS];
    __shared__ u16 uniq[MAX_PAIRS];
    // Units: rank r's tokens (bits of rmask[r]) in ascending order, COLS at a time, from unit
    // unit0[r] on (unit r while no expert can have more than COLS tokens). A unit has at least
    // one (token, expert) pair of its own, so there are at most MAX_PAIRS.
    __shared__ u32 rmask[MAX_PAIRS];
    __shared__ u32 unit0[MAX_PAIRS + 1];
    __shared__ u16 unit_rank[MAX_PAIRS];
    // unit_h[u * COLS + c]: the h row (pair) that column c of unit u reads: the first slot of
    // the column's token that chose the expert; columns past the unit's tokens repeat its last.
    __shared__ u16 unit_h[MAX_PAIRS * COLS];
    // Per token, its experts in ascending rank: the unit and column holding its sums and its
    // factor (wsum times the post scale); experts of weight 0 are left out. tok_n[t] <= topk
    // entries at tok_*[t * topk].
    __shared__ u16 tok_unit[MAX_PAIRS];
    __shared__ u8 tok_col[MAX_PAIRS];
    __shared__ float tok_f[MAX_PAIRS];
    __shared__ u32 tok_n[MAX_M];
    // Item partials of one group of units: [item][4][lane]. Before the items, the same memory
    // holds tables over the experts: the first pair that chose each, and a bit per selected
    // expert.
    __shared__ float part[PART_FLOATS];
    static_assert(MAX_EXPERTS + MAX_EXPERTS / 32 <= PART_FLOATS, "expert tables fit the partials");
    const u32 steps = (a.inter / 32u + STEP_CHUNKS - 1) / STEP_CHUNKS;
    if (one_token(a, steps)) {
        down_one<F, OUT>(a, part, steps);
        return;
    }
    u32* owner = reinterpret_cast<u32*>(part);
    u32* bits = owner + MAX_EXPERTS;
    const u32 pairs = a.m * a.topk, words = (a.experts + 31) / 32;
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (u32 i = threadIdx.x; i < pairs; i += blockDim.x) {
        ids[i] = a.ids[i];
        wts[i] = a.weights[i];
        rmask[i] = 0;
    }
    for (u32 e = threadIdx.x; e < a.experts; e += blockDim.x) owner[e] = MAX_PAIRS;
    for (u32 w = threadIdx.x; w < words; w += blockDim.x) bits[w] = 0;
    if (threadIdx.x < MAX_M) tok_n[threadIdx.x] = 0;
    __syncthreads();
    for (u32 i = threadIdx.x; i < pairs; i += blockDim.x) {
        const int e = ids[i];
        const u32 t0 = i - i % a.topk;
        bool f = valid_expert(e, a.experts);
        for (u32 p = t0; p < i && f; ++p) f = ids[p] != e;
        float w = 0.0f;
        if (f)
            for (u32 j = 0; j < a.topk; ++j)
                if (ids[t0 + j] == e) w += wts[t0 + j];
        tfirst[i] = f;
        wsum[i] = w;
        if (!valid_expert(e, a.experts)) continue;
        atomicMin(&owner[e], i);
        atomicOr(&bits[e / 32], 1u << (e % 32));
        posts[i] = post_scale<F>(a.g2, e);
    }
    __syncthreads();
    u32 distinct = 0;
    for (u32 w = 0; w < words; ++w) distinct += __popc(bits[w]);
    for (u32 i = threadIdx.x; i < pairs; i += blockDim.x) {
        const int e = ids[i];
        if (!valid_expert(e, a.experts)) continue;
        u32 r = __popc(bits[e / 32] & ((1u << (e % 32)) - 1u));
        for (u32 w = 0; w < (u32)e / 32; ++w) r += __popc(bits[w]);
        rank_of[i] = (u16)r;
        if (owner[e] == i) uniq[r] = (u16)e;
        if (tfirst[i]) atomicOr(&rmask[r], 1u << (i / a.topk));
    }
    __syncthreads();
    // Up to eight tokens every expert is one unit (no scan needed).
    const bool unit_per_expert = a.m <= COLS;
    if (!unit_per_expert) {
        if (warp == 0) {
            u32 carry = 0;
            for (u32 b = 0; b < distinct; b += 32) {
                const u32 r = b + lane;
                const u32 v = warp_inclusive_sum(r < distinct ? (__popc(rmask[r]) + COLS - 1) / COLS : 0u);
                if (r < distinct) unit0[r + 1] = carry + v;
                carry += __shfl_sync(0xffffffffu, v, 31);
            }
            if (lane == 0) unit0[0] = 0;
        }
        __syncthreads();
    }
    auto first_unit = [&](u32 r) { return unit_per_expert ? r : unit0[r]; };
    const u32 units = first_unit(distinct);
    for (u32 r = threadIdx.x; r < distinct; r += blockDim.x)
        for (u32 u = first_unit(r); u < first_unit(r + 1); ++u) unit_rank[u] = (u16)r;
    for (u32 i = threadIdx.x; i < pairs; i += blockDim.x) {
        if (!tfirst[i]) continue;
        const u32 t = i / a.topk, r = rank_of[i], mask = rmask[r];
        // The token's column among the expert's tokens; the unit's last token also fills the
        // columns past it.
        const u32 c = __popc(mask & ((1u << t) - 1u)), u = first_unit(r) + c / COLS;
        const u32 last = min((u32)__popc(mask), (c / COLS + 1) * COLS) - 1;
        for (u32 k = c % COLS; k < (c == last ? COLS : c % COLS + 1); ++k) unit_h[u * COLS + k] = (u16)i;
    }
    __syncthreads();
    // The token table, built while the first items' weights are on their way (read after the
    // first group's barrier).
    auto build_token_table = [&]() {
        for (u32 i = threadIdx.x; i < pairs; i += blockDim.x) {
            const float w = wsum[i];
            if (!tfirst[i] || w == 0.0f) continue;
            const u32 t = i / a.topk, t0 = t * a.topk, r = rank_of[i], mask = rmask[r];
            const u32 c = __popc(mask & ((1u << t) - 1u));
            // The entry's place among the token's experts of nonzero weight, by rank.
            u32 k = 0;
            for (u32 p = t0; p < t0 + a.topk; ++p) k += tfirst[p] && wsum[p] != 0.0f && rank_of[p] < r;
            tok_unit[t0 + k] = (u16)(first_unit(r) + c / COLS);
            tok_col[t0 + k] = (u8)(c % COLS);
            tok_f[t0 + k] = w * posts[i];
            atomicAdd(&tok_n[t], 1u);
        }
    };

    const u32 g = lane >> 2;
    const u32 tile = blockIdx.x;
    const u32 chunks = a.inter / 32u, tiles = (a.d + 15) / 16;
    const u32 group = max(1u, (PART_FLOATS / PER_ITEM) / steps);

    // The lane's view of item it of the group at g0: unit g0 + it / steps.
    auto item_lane = [&](u32 g0, u32 it, Lane& L) {
        const u32 u = g0 + it / steps;
        const u64 t = (u64)uniq[unit_rank[u]] * tiles + tile;
        const u16* hr = a.h + (u64)unit_h[u * COLS + g] * a.inter;
        lane_init<F>(L, a.w2 + t * tile_bytes(chunks), a.s2 + t * tile_scale_bytes<F>(chunks), chunks, hr, hr,
                     lane);
    };

    float acc[OUTS];
#pragma unroll
    for (u32 c = 0; c < OUTS; ++c) acc[c] = 0.0f;

    Ring<F> ring;
    Lane lc, ln;
    // Whether lc and the ring hold the warp's first item of the group already: its last item
    // of the group before loaded them, so the ring does not drain at the group's barriers.
    bool primed = false;
    for (u32 g0 = 0; g0 < units; g0 += group) {
        const u32 items = min(group, units - g0) * steps;
        if (warp < items && !primed) {
            item_lane(g0, warp, lc);
            const u32 st = warp % steps;
            ring_load<F>(lc, sub_begin(st), sub_end(lc, st + 1), ring);
        }
        primed = false;
        const u32 g_next = g0 + group;
        const u32 items_next = g_next < units ? min(group, units - g_next) * steps : 0u;
        // h is gate_up's output: wait for it here, while the first items' weights (constant)
        // are on their way. The ids and routing weights were written before gate_up
        // started, so they could be read above.
        if (g0 == 0) {
            build_token_table();
            pdl_wait();
            pdl_launch_dependents();
        }
        // Each item's loads are issued while the previous item is computed (the ring).
#pragma unroll 1
        for (u32 it = warp; it < items; it += nw) {
            // The warp's next item: in this group, else its first of the next group.
            const bool here = it + nw < items;
            primed = !here && warp < items_next;
            const u32 itn = here ? it + nw : warp;
            if (here || primed) item_lane(here ? g0 : g_next, itn, ln);
            else ln = lc;
            down_item<F>(lc, ln, here || primed, it, itn, steps, ring, part, lane);
            lc = ln;
        }
        __syncthreads();
        // Each output adds its token's experts of this group in ascending order, each expert's
        // steps in order; tokens without an expert skip it.
        const u32 g1 = g0 + items / steps;
#pragma unroll
        for (u32 c = 0; c < OUTS; ++c) {
            const u32 o = threadIdx.x + c * blockDim.x, m = out_token(o);
            if (m >= a.m) continue;
            for (u32 k = 0; k < tok_n[m]; ++k) {
                const u32 u = tok_unit[m * a.topk + k];
                if (u < g0 || u >= g1) continue;
                const u32 at = part_at(out_row(o), tok_col[m * a.topk + k]);
                float tot = 0.0f;
                for (u32 st = 0; st < steps; ++st) tot += part[((u - g0) * steps + st) * PER_ITEM + at];
                acc[c] = fmaf(tok_f[m * a.topk + k], tot, acc[c]);
            }
        }
        __syncthreads();
    }
    // Without a selected expert the loop above never waited.
    pdl_wait();
    write_out<OUT>(a, acc);
}

}  // namespace moe

DSV4_KERNEL void __launch_bounds__(128, M8_DEEP_BLOCKS) moe_gate_up_nvfp4(const MoeArgs a) { moe::gate_up<gemv::NVFP4>(a); }
DSV4_KERNEL void __launch_bounds__(128, M8_DEEP_BLOCKS) moe_gate_up_mxfp4(const MoeArgs a) { moe::gate_up<gemv::MXFP4>(a); }
DSV4_KERNEL void __launch_bounds__(256, M8_DEEP_BLOCKS / 2) moe_down_nvfp4(const MoeArgs a) { moe::down<gemv::NVFP4, moe::OUT_BF16>(a); }
DSV4_KERNEL void __launch_bounds__(256, M8_DEEP_BLOCKS / 2) moe_down_mxfp4(const MoeArgs a) { moe::down<gemv::MXFP4, moe::OUT_BF16>(a); }
DSV4_KERNEL void __launch_bounds__(256, M8_DEEP_BLOCKS / 2) moe_down_nvfp4_f32(const MoeArgs a) { moe::down<gemv::NVFP4, moe::OUT_F32>(a); }
DSV4_KERNEL void __launch_bounds__(256, M8_DEEP_BLOCKS / 2) moe_down_mxfp4_f32(const MoeArgs a) { moe::down<gemv::MXFP4, moe::OUT_F32>(a); }
DSV4_KERNEL void __launch_bounds__(256, M8_DEEP_BLOCKS / 2) moe_down_nvfp4_f32add(const MoeArgs a) { moe::down<gemv::NVFP4, moe::OUT_F32_ADD>(a); }
DSV4_KERNEL void __launch_bounds__(256, M8_DEEP_BLOCKS / 2) moe_down_mxfp4_f32add(const MoeArgs a) { moe::down<gemv::MXFP4, moe::OUT_F32_ADD>(a); }

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
