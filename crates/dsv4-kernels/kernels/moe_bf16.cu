// Routed experts with BF16 weights for decode (dsv4_ops::gpu::moe_bf16): for m <= 16 tokens with
// device-resident expert ids [m, topk] and routing weights [m, topk], the clamped SwiGLU experts
// and their weighted sum in two launches, without the host (graph-capturable):
//
//   moe_bf16_gate_up: grid (ceil(inter / 16), m * topk), 4 warps. Block (x, pair) takes 16 rows of
//     the intermediate of expert ids[pair]. The first pair that chose an expert does the work of
//     every pair that chose it (later ones exit at once), so each selected expert's w1/w3 rows are
//     read once per launch however many tokens chose it. A warp owns 4 intermediate rows and
//     streams their w1 and w3 rows with 16-byte loads (lane-strided 8-element chunks: a warp reads
//     512 contiguous bytes of a row per step), each load serving up to 16 of the expert's tokens;
//     then the clamped SwiGLU into h[m, topk, inter] (f32, one row per pair).
//   moe_bf16_down: grid ceil(d / 16), 4 warps. Every block sorts the valid pairs by expert; warp w
//     owns rows 4w..4w+3 of the block's 16 output rows and walks the distinct selected experts,
//     streaming each one's w2 rows once against the h rows of every pair that chose it, and parks
//     each (pair, row) dot in shared memory. Then each output (token, row) sums
//     weights[pair] * dot over the token's valid pairs in ascending (expert id, slot) order with
//     separately rounded products and sums: the order of the CPU reference. No atomics.
//
// Every dot product is summed in one fixed order: each lane takes its chunks in order (fmaf), then
// a butterfly over the warp whose tree does not depend on how many values share it. A token's
// result therefore depends on D and I only, never on timing or on the other tokens of the launch.
// Expert ids outside [0, experts) select nothing; a token without a valid expert gets zeros.
#include "dsv4_common.cuh"

using namespace dsv4;

// Kernel arguments (layout mirrored by `MoeBf16Args` in dsv4_ops::gpu::moe_bf16).
struct MoeBf16Args {
    const u16* x;          // [m, d] bf16
    const int* ids;        // [m, topk]
    const float* weights;  // [m, topk]
    const u16* w1;         // [experts, inter, d] bf16
    const u16* w3;         // [experts, inter, d] bf16
    const u16* w2;         // [experts, d, inter] bf16
    float* h;              // [m, topk, inter]
    float* out;            // [m, d]
    u32 m, topk, experts, d, inter;
    float limit;
    u32 accumulate;  // nonzero: out += the sum (one add) instead of out = the sum
};

namespace moe_bf16 {

// The launcher's bounds (`MAX_M`, `MAX_PAIRS` in dsv4_ops::gpu::moe_bf16): they size the shared
// routing tables, so both sides change together. Pair indices fit a u16.
constexpr u32 MAX_M = 16;
constexpr u32 MAX_PAIRS = 256;
constexpr u32 WARPS = 4;
// Rows (of the intermediate for gate_up, of the output for down) a warp owns.
constexpr u32 WARP_ROWS = 4;
constexpr u32 BLOCK_ROWS = WARPS * WARP_ROWS;
// Tokens (pairs) one pass over a weight row serves.
constexpr u32 BATCH = 16;

__device__ __forceinline__ bool valid_expert(int e, u32 experts) { return e >= 0 && (u32)e < experts; }

// Weights are read once: keep them out of L1, where the activations are reused.
__device__ __forceinline__ uint4 ld_stream(const u16* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

// Eight bf16 (element 2k in the low half of word k) as f32.
__device__ __forceinline__ void unpack(const uint4 v, float (&f)[8]) {
    f[0] = __uint_as_float(v.x << 16);
    f[1] = __uint_as_float(v.x & 0xffff0000u);
    f[2] = __uint_as_float(v.y << 16);
    f[3] = __uint_as_float(v.y & 0xffff0000u);
    f[4] = __uint_as_float(v.z << 16);
    f[5] = __uint_as_float(v.z & 0xffff0000u);
    f[6] = __uint_as_float(v.w << 16);
    f[7] = __uint_as_float(v.w & 0xffff0000u);
}

__device__ __forceinline__ void load_act(const u16* p, float (&f)[8]) {
    unpack(*reinterpret_cast<const uint4*>(p), f);
}

__device__ __forceinline__ void load_act(const float* p, float (&f)[8]) {
    const float4 a = reinterpret_cast<const float4*>(p)[0];
    const float4 b = reinterpret_cast<const float4*>(p)[1];
    f[0] = a.x;
    f[1] = a.y;
    f[2] = a.z;
    f[3] = a.w;
    f[4] = b.x;
    f[5] = b.y;
    f[6] = b.z;
    f[7] = b.w;
}

// One butterfly step at distance O over the N values v[0..N) each lane still holds: lanes with
// bit O keep the upper half, the others the lower half, each adding its partner's copy of the
// half it keeps; once one value is left, plain butterfly steps.
template <int NV, int N, int O>
__device__ __forceinline__ void scatter_step(float (&v)[NV], u32 lane) {
    if constexpr (O > 0) {
        if constexpr (N >= 2) {
            const bool upper = (lane & (u32)O) != 0u;
#pragma unroll
            for (int i = 0; i < N / 2; ++i) {
                const float send = upper ? v[i] : v[i + N / 2];
                const float keep = upper ? v[i + N / 2] : v[i];
                v[i] = __fadd_rn(keep, __shfl_xor_sync(0xffffffffu, send, O));
            }
            scatter_step<NV, N / 2, O / 2>(v, lane);
        } else {
            v[0] = __fadd_rn(v[0], __shfl_xor_sync(0xffffffffu, v[0], O));
            scatter_step<NV, 1, O / 2>(v, lane);
        }
    }
}

// Sums each of the N values (N a power of two <= 32) over the warp, halving the values every
// lane holds at each of the first log2(N) butterfly steps. Returns, in lane l, the total of value
// l >> (5 - log2 N). Every total is the same tree (pairs at distance 16, then 8, ..., 1) whatever N.
template <int N>
__device__ __forceinline__ float reduce_scatter(float (&v)[N], u32 lane) {
    static_assert(N >= 1 && N <= 32 && (N & (N - 1)) == 0, "N is a power of two <= 32");
    scatter_step<N, N, 16>(v, lane);
    return v[0];
}

// The dots of RW bf16 weight rows with NT activation rows (n8 chunks of 8 each): lane l returns
// the total of value t * RW + r = l >> (5 - log2(NT * RW)). The whole warp must call it.
template <int NT, int RW, typename A>
__device__ __forceinline__ float warp_dots(const u16* const (&w)[RW], const A* const (&x)[NT], u32 n8, u32 lane) {
    float acc[NT * RW];
#pragma unroll
    for (int i = 0; i < NT * RW; ++i) acc[i] = 0.0f;
#pragma unroll 2
    for (u32 c = lane; c < n8; c += 32u) {
        float wf[RW][8];
#pragma unroll
        for (int r = 0; r < RW; ++r) unpack(ld_stream(w[r] + (u64)c * 8u), wf[r]);
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            float xf[8];
            load_act(x[t] + (u64)c * 8u, xf);
#pragma unroll
            for (int r = 0; r < RW; ++r)
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[t * RW + r] = fmaf(wf[r][i], xf[i], acc[t * RW + r]);
        }
    }
    return reduce_scatter<NT * RW>(acc, lane);
}

// As the CPU reference: silu(min(g, L)) * clamp(u, -L, L) with silu(v) = v * (1 / (1 + exp(-v))),
// min ignoring a NaN g (f32::min) and clamp keeping a NaN u (f32::clamp).
__device__ __forceinline__ float swiglu(float g, float u, float limit) {
    const float gc = fminf(g, limit);
    const float s = __fmul_rn(gc, __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-gc))));
    const float uc = u != u ? u : fminf(fmaxf(u, -limit), limit);
    return __fmul_rn(s, uc);
}

// Up to NT (<= BATCH) pairs `list[0..nb)` of expert e through the warp's rows row0..row0+3 of the
// intermediate: w1 and w3 rows interleaved, RI intermediate rows a pass (NT * 2 * RI <= 32
// accumulators a lane).
template <int NT>
__device__ __forceinline__ void gate_up_rows(const MoeBf16Args& a, int e, const u16* list, u32 nb, u32 row0,
                                             u32 lane) {
    constexpr int RI = NT <= 4 ? 4 : (NT == 8 ? 2 : 1);
    constexpr int RW = 2 * RI;
    constexpr u32 G = 32 / (NT * RW);  // lanes holding each total
    const u16* x[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) x[t] = a.x + (u64)(list[min((u32)t, nb - 1u)] / a.topk) * a.d;
    const u64 base = (u64)e * a.inter;
#pragma unroll 1
    for (u32 p0 = 0; p0 < WARP_ROWS; p0 += RI) {
        if (row0 + p0 >= a.inter) break;
        const u16* w[RW];
#pragma unroll
        for (int i = 0; i < RI; ++i) {
            const u64 r = base + min(row0 + p0 + (u32)i, a.inter - 1u);
            w[2 * i] = a.w1 + r * a.d;
            w[2 * i + 1] = a.w3 + r * a.d;
        }
        const float v = warp_dots<NT, RW>(w, x, a.d / 8u, lane);
        // Value t * RW + 2i is the gate of row i for pair t, the next one its up.
        const float u = __shfl_down_sync(0xffffffffu, v, G);
        const u32 idx = lane / G, t = idx / RW, row = row0 + p0 + (idx % RW) / 2;
        if (lane % (2 * G) == 0u && t < nb && row < a.inter)
            a.h[(u64)list[t] * a.inter + row] = swiglu(v, u, a.limit);
    }
}

// Up to NT (<= BATCH) pairs `list[0..nb)` of expert e through the warp's output rows
// row0..row0+3 (block rows lrow0..): y[pair * BLOCK_ROWS + block row] = W2[e][row] . h[pair].
template <int NT>
__device__ __forceinline__ void down_rows(const MoeBf16Args& a, int e, const u16* list, u32 nb, u32 row0, u32 lrow0,
                                          float* y, u32 lane) {
    constexpr int RW = NT <= 8 ? 4 : 2;
    constexpr u32 G = 32 / (NT * RW);
    const float* x[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) x[t] = a.h + (u64)list[min((u32)t, nb - 1u)] * a.inter;
    const u64 base = (u64)e * a.d;
#pragma unroll 1
    for (u32 p0 = 0; p0 < WARP_ROWS; p0 += RW) {
        if (row0 + p0 >= a.d) break;
        const u16* w[RW];
#pragma unroll
        for (int i = 0; i < RW; ++i) w[i] = a.w2 + (base + min(row0 + p0 + (u32)i, a.d - 1u)) * a.inter;
        const float v = warp_dots<NT, RW>(w, x, a.inter / 8u, lane);
        const u32 idx = lane / G, t = idx / RW;
        if (lane % G == 0u && t < nb) y[(u32)list[t] * BLOCK_ROWS + lrow0 + p0 + idx % RW] = v;
    }
}

}  // namespace moe_bf16

DSV4_KERNEL void __launch_bounds__(128) moe_bf16_gate_up(const MoeBf16Args a) {
    pdl_enter();
    using namespace moe_bf16;
    __shared__ u16 list[MAX_PAIRS];
    __shared__ u32 list_n;
    const u32 pair = blockIdx.y, pairs = a.m * a.topk;
    const int e = a.ids[pair];
    // Block-uniform exits: an invalid id, or an expert an earlier pair already took.
    if (!valid_expert(e, a.experts)) return;
    for (u32 p = 0; p < pair; ++p)
        if (a.ids[p] == e) return;
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    // Every pair that chose e, ascending.
    if (warp == 0u) {
        u32 n = 0;
        for (u32 b = 0; b < pairs; b += 32u) {
            const u32 p = b + lane;
            const bool hit = p < pairs && a.ids[p] == e;
            const u32 mask = __ballot_sync(0xffffffffu, hit);
            if (hit) list[n + __popc(mask & ((1u << lane) - 1u))] = (u16)p;
            n += __popc(mask);
        }
        if (lane == 0u) list_n = n;
    }
    __syncthreads();
    const u32 n = list_n;
    const u32 row0 = blockIdx.x * BLOCK_ROWS + warp * WARP_ROWS;
    if (row0 >= a.inter) return;
    for (u32 b = 0; b < n; b += BATCH) {
        const u32 nb = min(BATCH, n - b);
        if (nb == 1u) gate_up_rows<1>(a, e, list + b, nb, row0, lane);
        else if (nb == 2u) gate_up_rows<2>(a, e, list + b, nb, row0, lane);
        else if (nb <= 4u) gate_up_rows<4>(a, e, list + b, nb, row0, lane);
        else if (nb <= 8u) gate_up_rows<8>(a, e, list + b, nb, row0, lane);
        else gate_up_rows<16>(a, e, list + b, nb, row0, lane);
    }
}

DSV4_KERNEL void __launch_bounds__(128) moe_bf16_down(const MoeBf16Args a) {
    pdl_enter();
    using namespace moe_bf16;
    __shared__ int ids[MAX_PAIRS];         // the valid ids, -1 for the others
    __shared__ u8 head[MAX_PAIRS];         // the pair is its expert's first
    __shared__ u16 by_expert[MAX_PAIRS];   // valid pairs by (expert, pair)
    __shared__ u16 group_start[MAX_PAIRS]; // by distinct expert (ascending): its run in by_expert
    __shared__ u16 group_len[MAX_PAIRS];
    __shared__ u16 by_token[MAX_PAIRS];    // at t * topk: token t's valid pairs by (expert, slot)
    __shared__ u16 token_n[MAX_M];
    __shared__ float y[MAX_PAIRS * BLOCK_ROWS];
    const u32 pairs = a.m * a.topk, k = a.topk;
    for (u32 i = threadIdx.x; i < pairs; i += blockDim.x) {
        const int e = a.ids[i];
        ids[i] = valid_expert(e, a.experts) ? e : -1;
    }
    __syncthreads();
    for (u32 p = threadIdx.x; p < pairs; p += blockDim.x) {
        const int e = ids[p];
        head[p] = 0;
        if (e < 0) continue;
        u32 below = 0, same_before = 0;
        for (u32 q = 0; q < pairs; ++q) {
            const int o = ids[q];
            below += (o >= 0 && o < e);
            same_before += (q < p && o == e);
        }
        head[p] = same_before == 0u;
        by_expert[below + same_before] = (u16)p;
        const u32 t = p / k, j = p % k;
        u32 pos = 0;
        for (u32 q = 0; q < k; ++q) {
            const int o = ids[t * k + q];
            pos += (o >= 0 && (o < e || (o == e && q < j)));
        }
        by_token[t * k + pos] = (u16)p;
    }
    for (u32 t = threadIdx.x; t < a.m; t += blockDim.x) {
        u32 n = 0;
        for (u32 q = 0; q < k; ++q) n += ids[t * k + q] >= 0;
        token_n[t] = (u16)n;
    }
    __syncthreads();
    for (u32 p = threadIdx.x; p < pairs; p += blockDim.x) {
        if (!head[p]) continue;
        const int e = ids[p];
        u32 rank = 0, below = 0, same = 0;
        for (u32 q = 0; q < pairs; ++q) {
            const int o = ids[q];
            rank += (head[q] && o < e);
            below += (o >= 0 && o < e);
            same += o == e;
        }
        group_start[rank] = (u16)below;
        group_len[rank] = (u16)same;
    }
    u32 distinct = 0;
    for (u32 q = 0; q < pairs; ++q) distinct += head[q];
    __syncthreads();

    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const u32 row0 = blockIdx.x * BLOCK_ROWS + warp * WARP_ROWS;
    if (row0 < a.d) {
#pragma unroll 1
        for (u32 r = 0; r < distinct; ++r) {
            const u16* g = by_expert + group_start[r];
            const int e = ids[g[0]];
            const u32 n = group_len[r];
            for (u32 b = 0; b < n; b += BATCH) {
                const u32 nb = min(BATCH, n - b);
                if (nb == 1u) down_rows<1>(a, e, g + b, nb, row0, warp * WARP_ROWS, y, lane);
                else if (nb == 2u) down_rows<2>(a, e, g + b, nb, row0, warp * WARP_ROWS, y, lane);
                else if (nb <= 4u) down_rows<4>(a, e, g + b, nb, row0, warp * WARP_ROWS, y, lane);
                else if (nb <= 8u) down_rows<8>(a, e, g + b, nb, row0, warp * WARP_ROWS, y, lane);
                else down_rows<16>(a, e, g + b, nb, row0, warp * WARP_ROWS, y, lane);
            }
        }
    }
    __syncthreads();
    for (u32 o = threadIdx.x; o < a.m * BLOCK_ROWS; o += blockDim.x) {
        const u32 t = o / BLOCK_ROWS, i = o % BLOCK_ROWS, row = blockIdx.x * BLOCK_ROWS + i;
        if (row >= a.d) continue;
        float acc = 0.0f;
        for (u32 s = 0; s < token_n[t]; ++s) {
            const u32 p = by_token[t * k + s];
            acc = __fadd_rn(acc, __fmul_rn(a.weights[p], y[p * BLOCK_ROWS + i]));
        }
        const u64 at = (u64)t * a.d + row;
        a.out[at] = a.accumulate ? __fadd_rn(a.out[at], acc) : acc;
    }
}
