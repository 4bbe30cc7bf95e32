// Row kernels of the decode step: the embedding gather into the mHC streams, RMSNorm,
// rotary embedding at a position held in device memory, and the step that advances it.
//
// Token ids and positions are read from device buffers, so a captured graph replays them with
// whatever the previous step wrote there. Products and sums that the CPU reference rounds one
// by one are spelled with __f*_rn (no FMA contraction); reductions use a fixed order, so every
// launch on the same inputs gives the same bits.
#include "dsv4_common.cuh"

using namespace dsv4;

// out[t, c*d + j] = table[tokens[t], j] for each of the hc copies c: the mHC streams start as
// hc copies of the embedding. A token id outside the vocabulary gives a NaN row, never a read
// past the table.
DSV4_KERNEL void embed_hc_gather(const u16* __restrict__ table, u32 vocab, u32 d,
                                 const u32* __restrict__ tokens, u32 n, u32 hc,
                                 float* __restrict__ out) {
    pdl_enter();
    const u64 width = (u64)hc * d;
    const u64 total = (u64)n * width;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        const u64 t = i / width;
        const u32 j = (u32)((i % width) % d);
        const u32 id = tokens[t];
        out[i] = id < vocab ? bf16_to_f32(table[(u64)id * d + j]) : __uint_as_float(0x7fc00000u);
    }
}

// One row set of rms_norm_rows: rows of `width` at x + r * x_stride, their scale (null: none),
// dense output, and the rows one token has (for the position of a rotated row).
struct NormSet {
    const float* x;
    u32 x_stride;
    u32 rows;
    const float* weight;
    float* out;
    u32 rows_per_token;
};

// rms_norm_rows' argument (NormArgs in rows/mod.rs, field for field).
struct NormArgs {
    NormSet a, b;
    u32 width;
    float eps;
    u16* out_b;
    const float* inv_freq;
    u32 rope_half;
    const u32* pos;
    u32 batch;  // token_pos: rows of a batch's token t sit at pos[t]
};

// One block per row (grid-stride over rows) of set a, then of set b (b.rows may be 0):
// out = weight * (x * r), r = 1 / sqrt(mean(x^2) + eps). Rows may be some columns of a wider
// projection output; out is dense. In place when out == x and x_stride == width. A non-null
// `out_b` gets set a's values rounded to bf16. A non-null `inv_freq` then rotates the last
// 2 * rope_half channels of each row as rope_rows does, row r at the position of token
// r / rows_per_token (token_pos): those channels start at an even one and lie in the held
// columns (the launcher checks both), so a pair sits in lanes l and l ^ 1 of one held column
// and turns in registers before its one write.
DSV4_KERNEL void __launch_bounds__(1024) rms_norm_rows(const NormArgs p) {
    const NormSet &a = p.a, &b = p.b;
    const u32 width = p.width;
    const float eps = p.eps;
    u16* out_b = p.out_b;
    const float* inv_freq = p.inv_freq;
    const u32 rot0 = width - 2u * p.rope_half;  // first rotated channel
    __shared__ float scratch[32];
    // The weight of the block's first row and the held columns' rotation frequencies, before
    // the wait.
    const float* first_weight = blockIdx.x < a.rows ? a.weight : b.weight;
    float wh[NORM_HELD], freq[NORM_HELD];
    if (first_weight) load_held_weight(wh, first_weight, width, blockDim.x);
    else
#pragma unroll
        for (u32 k = 0; k < NORM_HELD; k++) wh[k] = 1.0f;
#pragma unroll
    for (u32 k = 0; k < NORM_HELD; k++) {
        const u32 j = threadIdx.x + k * blockDim.x;
        freq[k] = inv_freq && j >= rot0 && j < width ? inv_freq[(j - rot0) / 2u] : 0.0f;
    }
    pdl_enter();
    for (u32 i = blockIdx.x; i < a.rows + b.rows; i += gridDim.x) {
        // Field by field (selecting a whole parameter struct would copy it to local memory).
        const bool first = i < a.rows;
        const u32 r = first ? i : i - a.rows;
        const float* row = (first ? a.x : b.x) + (u64)r * (first ? a.x_stride : b.x_stride);
        const float* weight = first ? a.weight : b.weight;
        float* out = first ? a.out : b.out;
        const u32 rows_per_token = first ? a.rows_per_token : b.rows_per_token;
        // A thread's first NORM_HELD columns are loaded at once and kept; wider rows read the
        // rest again. The sum runs over the thread's columns in order either way.
        float held[NORM_HELD];
#pragma unroll
        for (u32 k = 0; k < NORM_HELD; k++) {
            const u32 j = threadIdx.x + k * blockDim.x;
            held[k] = j < width ? row[j] : 0.0f;
        }
        const u32 position = inv_freq ? token_pos(p.pos, r / rows_per_token, p.batch) : 0u;
        float s = 0.0f;
#pragma unroll
        for (u32 k = 0; k < NORM_HELD; k++)
            if (threadIdx.x + k * blockDim.x < width) s = __fadd_rn(s, __fmul_rn(held[k], held[k]));
        for (u32 j = threadIdx.x + NORM_HELD * blockDim.x; j < width; j += blockDim.x)
            s = __fadd_rn(s, __fmul_rn(row[j], row[j]));
        s = block_sum(s, scratch);
        const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(s, (float)width), eps)));
        float* dst = out + (u64)r * width;
        u16* dst_b = first && out_b ? out_b + (u64)r * width : nullptr;
        const auto normed = [&](float x, float w) {
            const float v = __fmul_rn(x, inv);
            return weight ? __fmul_rn(w, v) : v;
        };
        // The held columns unrolled (registers, not a select over them per column), then the rest.
#pragma unroll
        for (u32 k = 0; k < NORM_HELD; k++) {
            const u32 j = threadIdx.x + k * blockDim.x;
            float y = normed(held[k], weight == first_weight ? wh[k] : weight && j < width ? weight[j] : 1.0f);
            if (j < width && dst_b) dst_b[j] = f32_to_bf16(y);
            if (inv_freq) {
                // rope_pair's arithmetic, each lane turning its own element of the pair.
                const float other = __shfl_xor_sync(0xffffffffu, y, 1);
                if (j >= rot0 && j < width) {
                    float sn, cs;
                    rope_sin_cos(position, freq[k], sn, cs);
                    y = rope_turn(y, other, sn, cs, (j - rot0) % 2u == 0u);
                }
            }
            if (j < width) dst[j] = y;
        }
        for (u32 j = threadIdx.x + NORM_HELD * blockDim.x; j < width; j += blockDim.x) {
            const float y = normed(row[j], weight ? weight[j] : 1.0f);
            dst[j] = y;
            if (dst_b) dst_b[j] = f32_to_bf16(y);
        }
    }
}

// rms_norm_rows for many rows of 388 to 512 columns (the query heads and shared key of a prompt
// chunk), a warp a row, with rms_norm_rows' bits. At these widths that kernel runs 128 threads
// of at most 4 columns each, thread v holding columns v + 128 k; here lane l holds those of
// threads l + 32 u (u < 4), sums each thread's squares in its order, each group of 32 threads
// by warp_sum and the four group totals as block_sum does. A rotated pair (channels 2i, 2i + 1
// from an even first rotated channel, all in the last 128) sits in lanes l and l ^ 1 of one
// slot, so a row is read once and written once, with no barrier and no reread.
DSV4_KERNEL void __launch_bounds__(256) rms_norm_rows_w512(const NormArgs p) {
    constexpr u32 U = 4u, K = 4u, T = 32u * U;
    const NormSet &a = p.a, &b = p.b;
    const u32 width = p.width;
    const u32 lane = threadIdx.x & 31u;
    const u32 base = width - 2u * p.rope_half;  // first rotated channel
    pdl_enter();
    const u32 warps = gridDim.x * (blockDim.x / 32u);
    for (u32 i = blockIdx.x * (blockDim.x / 32u) + threadIdx.x / 32u; i < a.rows + b.rows; i += warps) {
        const bool first = i < a.rows;
        const u32 r = first ? i : i - a.rows;
        const float* row = (first ? a.x : b.x) + (u64)r * (first ? a.x_stride : b.x_stride);
        const float* weight = first ? a.weight : b.weight;
        float* dst = (first ? a.out : b.out) + (u64)r * width;
        u16* dst_b = first && p.out_b ? p.out_b + (u64)r * width : nullptr;
        float x[U][K];
#pragma unroll
        for (u32 u = 0; u < U; u++)
#pragma unroll
            for (u32 k = 0; k < K; k++) {
                const u32 j = lane + 32u * u + k * T;
                x[u][k] = j < width ? row[j] : 0.0f;
            }
        // Thread (lane + 32 u)'s sum, then its group's; lane u keeps group u's.
        float group = 0.0f;
#pragma unroll
        for (u32 u = 0; u < U; u++) {
            float s = 0.0f;
#pragma unroll
            for (u32 k = 0; k < K; k++)
                if (lane + 32u * u + k * T < width) s = __fadd_rn(s, __fmul_rn(x[u][k], x[u][k]));
            s = warp_sum(s);
            if (lane == u) group = s;
        }
        const float sum = warp_sum(group);
        const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(sum, (float)width), p.eps)));
        const u32 rows_per_token = first ? a.rows_per_token : b.rows_per_token;
        const u32 position = p.inv_freq ? token_pos(p.pos, r / rows_per_token, p.batch) : 0u;
#pragma unroll
        for (u32 u = 0; u < U; u++)
#pragma unroll
            for (u32 k = 0; k < K; k++) {
                const u32 j = lane + 32u * u + k * T;
                const float v = __fmul_rn(x[u][k], inv);
                x[u][k] = weight && j < width ? __fmul_rn(weight[j], v) : v;
                if (dst_b && j < width) dst_b[j] = f32_to_bf16(x[u][k]);
            }
        // The rotated channels lie in the last slot (k = K - 1, checked by the launcher). Every
        // lane takes part in the exchange; lanes outside the rotated channels ignore it.
#pragma unroll
        for (u32 u = 0; u < U; u++) {
            const u32 j = lane + 32u * u + (K - 1u) * T;
            const float y = x[u][K - 1u], other = __shfl_xor_sync(0xffffffffu, y, 1);
            if (p.inv_freq && j >= base && j < width) {
                // rope_pair's arithmetic, each lane turning its own element of the pair.
                float sn, cs;
                rope_sin_cos(position, p.inv_freq[(j - base) / 2u], sn, cs);
                x[u][K - 1u] = rope_turn(y, other, sn, cs, (j - base) % 2u == 0u);
            }
        }
#pragma unroll
        for (u32 u = 0; u < U; u++)
#pragma unroll
            for (u32 k = 0; k < K; k++) {
                const u32 j = lane + 32u * u + k * T;
                if (j < width) dst[j] = x[u][k];
            }
    }
}

// Rotates the last rope_dim channels of every width-sized vector of x in place, interleaved
// pairs (2i, 2i+1) by angle p * inv_freq[i]; `sign` -1 rotates back. x is
// [tokens, heads, width]; token t sits at token_pos(pos, t, batch).
DSV4_KERNEL void rope_rows(float* __restrict__ x, u32 tokens, u32 heads, u32 width, u32 rope_dim,
                           const float* __restrict__ inv_freq, const u32* __restrict__ pos, float sign, u32 batch) {
    pdl_enter();
    const u32 half = rope_dim / 2u;
    const u64 total = (u64)tokens * heads * half;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        const u32 k = (u32)(i % half);
        const u64 v = i / half;
        const u32 t = (u32)(v / heads);
        rope_pair(x + v * width + (width - rope_dim) + 2u * k, token_pos(pos, t, batch), inv_freq[k], sign);
    }
}

// pos[0] += n: a decode step moves its own position forward, so graph replays walk the
// sequence without the host.
DSV4_KERNEL void advance_position(u32* __restrict__ pos, u32 n) {
    pdl_enter();
    if (blockIdx.x == 0u && threadIdx.x == 0u) pos[0] += n;
}

// out[j] = pos[0] + j * step for j < count: the first positions of a long chunk's sub-chunks
// (the launches that take at most `step` tokens run once per sub-chunk at its position).
DSV4_KERNEL void chunk_positions(const u32* __restrict__ pos, u32* __restrict__ out, u32 count, u32 step) {
    pdl_enter();
    const u32 j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j < count) out[j] = pos[0] + j * step;
}
