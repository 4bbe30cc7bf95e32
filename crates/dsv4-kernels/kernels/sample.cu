// Next-token sampling on the device, so a decode graph needs no host decision: greedy
// (argmax, ties to the lowest id, NaN never wins) or temperature + top-p with a counter-based
// draw from (seed, position). Each logits row has its own settings and position in device
// memory (a batch's rows are different sequences'), and sample_pick then advances the position
// (the step's last write), so every replay draws afresh.
//
// Two kernels, a block row per logits row. Greedy: sample_prepare takes the argmax of each
// span of ids in its own block, sample_pick the argmax of those. Otherwise sample_prepare's
// first block writes w = exp((z - max) / T); sample_pick finds the top-p threshold on w by
// bisection over float bits, draws u in [0, 1) and walks the kept weights in id order. Every sum has a fixed order (per-thread id ranges, a pairwise tree over
// the threads, a sequential scan by thread 0) that the CPU reference reproduces exactly.
#include "dsv4_common.cuh"

using namespace dsv4;

#define SAMPLE_THREADS 1024u
// Ids a greedy span covers at least, and most spans (ARGMAX_SPAN, MAX_SPANS in sample/mod.rs).
#define ARGMAX_SPAN 4096u
#define MAX_SPANS 1024u

__device__ __forceinline__ u32 argmax_spans_of(u32 vocab) { return min((vocab + ARGMAX_SPAN - 1u) / ARGMAX_SPAN, MAX_SPANS); }

// Max of z, NaN ignored (fmaxf); -inf when every value is NaN or -inf.
__device__ float block_max(const float* __restrict__ z, u32 vocab, float* scratch) {
    float m = __uint_as_float(0xff800000u);
    for (u32 i = threadIdx.x; i < vocab; i += blockDim.x) m = fmaxf(m, z[i]);
    m = warp_max(m);
    __syncthreads();
    if ((threadIdx.x & 31u) == 0u) scratch[threadIdx.x >> 5] = m;
    __syncthreads();
    m = threadIdx.x < (blockDim.x >> 5) ? scratch[threadIdx.x] : __uint_as_float(0xff800000u);
    return warp_max(m);  // lanes of warp 0 hold it; broadcast below
}

// One row's sampling settings (the U32 [4] rows of `sample` in sample/mod.rs).
struct SampleParams {
    float inv_t;  // 0: greedy
    float top_p;
    u64 seed;
};

// w = exp((z - max) * inv_t), NaN logits weigh 0.
__device__ void sample_weights(const float* __restrict__ z, u32 vocab, float inv_t, float* __restrict__ w) {
    __shared__ float scratch[32];
    __shared__ float max_all;
    const float m = block_max(z, vocab, scratch);
    if (threadIdx.x == 0u) max_all = m;
    __syncthreads();
    for (u32 i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = z[i];
        w[i] = isnan(v) ? 0.0f : expf(__fmul_rn(__fsub_rn(v, max_all), inv_t));
    }
}

// Writes the sum of the kept weights (w >= tau) of this thread's id range, summed in id
// order, to part[threadIdx.x] (after a barrier, so part may still be in use before the call).
__device__ __forceinline__ void thread_kept_sum(const float* __restrict__ w, u32 lo, u32 hi, float tau, float* part) {
    float s = 0.0f;
    for (u32 i = lo; i < hi; i++)
        if (w[i] >= tau) s = __fadd_rn(s, w[i]);
    __syncthreads();
    part[threadIdx.x] = s;
    __syncthreads();
}

// The kept mass: per-thread sums, then the pairwise tree over the threads (for stride 512,
// 256, ..., 1, part[i] += part[i + stride]). Every thread returns it.
__device__ float kept_mass(const float* __restrict__ w, u32 lo, u32 hi, float tau, float* part) {
    thread_kept_sum(w, lo, hi, tau, part);
    for (u32 stride = SAMPLE_THREADS / 2u; stride > 0u; stride >>= 1) {
        if (threadIdx.x < stride) part[threadIdx.x] = __fadd_rn(part[threadIdx.x], part[threadIdx.x + stride]);
        __syncthreads();
    }
    return part[0];
}

// The block's (value, id) pairs reduced: the largest value, the lowest id among equals; NaN
// never wins; id 0xffffffff when no value exceeds -inf.
__device__ u32 block_best(float best, u32 best_i, float* vals, u32* ids) {
    vals[threadIdx.x] = best;
    ids[threadIdx.x] = best_i;
    __syncthreads();
    for (u32 stride = SAMPLE_THREADS / 2u; stride > 0u; stride >>= 1) {
        if (threadIdx.x < stride) {
            const float v = vals[threadIdx.x + stride];
            const u32 j = ids[threadIdx.x + stride];
            const u32 i = ids[threadIdx.x];
            if (j != 0xffffffffu && (i == 0xffffffffu || v > vals[threadIdx.x] || (v == vals[threadIdx.x] && j < i))) {
                vals[threadIdx.x] = v;
                ids[threadIdx.x] = j;
            }
        }
        __syncthreads();
    }
    return ids[0];
}

// Argmax of z over ids [lo, hi) (as sampling::argmax; 0xffffffff when no value exceeds -inf).
__device__ u32 block_argmax(const float* __restrict__ z, u32 lo, u32 hi, float* vals, u32* ids) {
    float best = __uint_as_float(0xff800000u);
    u32 best_i = 0xffffffffu;
    for (u32 i = lo + threadIdx.x; i < hi; i += blockDim.x)
        if (z[i] > best) {
            best = z[i];
            best_i = i;
        }
    return block_best(best, best_i, vals, ids);
}

// First half, block (x, r) for logits row r (of z [rows, vocab]): a greedy row's blocks write
// the argmax id of their span of ids to w[r, x] (as float bits); another row's first block
// writes its weights to w[r] (sample_weights), the others have nothing to do.
DSV4_KERNEL void __launch_bounds__(SAMPLE_THREADS) sample_prepare(const float* __restrict__ z, u32 vocab,
                                                                  const SampleParams* __restrict__ params,
                                                                  float* __restrict__ w) {
    pdl_enter();
    __shared__ float vals[SAMPLE_THREADS];
    __shared__ u32 ids[SAMPLE_THREADS];
    const u32 row = blockIdx.y;
    z += (u64)row * vocab;
    w += (u64)row * vocab;
    const float inv_t = params[row].inv_t;
    if (inv_t != 0.0f) {
        if (blockIdx.x == 0u) sample_weights(z, vocab, inv_t, w);
        return;
    }
    const u32 spans = argmax_spans_of(vocab), span = (vocab + spans - 1u) / spans;
    const u32 lo = min(blockIdx.x * span, vocab), hi = min(lo + span, vocab);
    const u32 best = block_argmax(z, lo, hi, vals, ids);
    if (threadIdx.x == 0u) w[blockIdx.x] = __uint_as_float(best);
}

// Thread 0's last writes for row blockIdx.x: its token, and its position moved on, unless
// the row is parked (a sequence that is not decoding keeps both).
__device__ __noinline__ void pick(u32* token, u32* pos, u32 batch, u32 advance, u32 t) {
    u32* p = pos + (batch ? blockIdx.x : 0u);
    if (batch && *p == PARKED) return;
    token[blockIdx.x] = t;
    *p += advance;
}

// Block r writes token[r] from logits row r, keyed by (and then advancing by `advance`) the
// position of token_pos(pos, r, batch). A greedy row (inv_t 0) takes the argmax of the span
// winners in w (spans in id order, so ties still go to the lowest id); a row whose weights sum
// to zero or overflow takes the argmax of z.
DSV4_KERNEL void __launch_bounds__(SAMPLE_THREADS) sample_pick(const float* __restrict__ z, const float* __restrict__ w,
                                                               u32 vocab, const SampleParams* __restrict__ params,
                                                               u32* __restrict__ pos, u32 advance,
                                                               u32* __restrict__ token, u32 batch) {
    pdl_enter();
    // The row (blockIdx.x), its settings, token and position are addressed where used: held
    // in registers through the kernel, they spill.
    w += (u64)blockIdx.x * vocab;
    const bool greedy = params[blockIdx.x].inv_t == 0.0f;
    __shared__ float part[SAMPLE_THREADS];
    __shared__ u32 ids[SAMPLE_THREADS];
    const u32 chunk = (vocab + SAMPLE_THREADS - 1u) / SAMPLE_THREADS;
    const u32 lo = min(threadIdx.x * chunk, vocab);
    const u32 hi = min(lo + chunk, vocab);
    if (greedy) {
        const u32 i = threadIdx.x < argmax_spans_of(vocab) ? __float_as_uint(w[threadIdx.x]) : 0xffffffffu;
        const float zi = i != 0xffffffffu ? z[(u64)blockIdx.x * vocab + i] : __uint_as_float(0xff800000u);
        const u32 t = block_best(zi, i, part, ids);
        if (threadIdx.x == 0u) {
            pick(token, pos, batch, advance, t == 0xffffffffu ? 0u : t);
        }
        return;
    }
    const float total = kept_mass(w, lo, hi, 0.0f, part);
    if (!(total > 0.0f && isfinite(total))) {
        const u32 t = block_argmax(z + (u64)blockIdx.x * vocab, 0u, vocab, part, ids);
        if (threadIdx.x == 0u) {
            pick(token, pos, batch, advance, t == 0xffffffffu ? 0u : t);
        }
        return;
    }
    // The largest tau (as float bits, monotonic for w >= 0) whose kept mass reaches top_p * total.
    u32 tau_bits = 0u;
    const float top_p = params[blockIdx.x].top_p;
    if (top_p < 1.0f) {
        const float need = __fmul_rn(top_p, total);
        u32 a = 0u, b = 0x3f800001u;  // mass(bits a) >= need holds; w <= 1 < bits b
        while (b - a > 1u) {
            const u32 mid = a + (b - a) / 2u;
            if (kept_mass(w, lo, hi, __uint_as_float(mid), part) >= need) a = mid; else b = mid;
        }
        tau_bits = a;
    }
    const float tau = __uint_as_float(tau_bits);
    // Per-thread kept sums, scanned in id order by thread 0, which then walks the range the
    // draw lands in.
    thread_kept_sum(w, lo, hi, tau, part);
    if (threadIdx.x == 0u) {
        float kept = 0.0f;
#pragma unroll 4
        for (u32 t = 0; t < SAMPLE_THREADS; t++) kept = __fadd_rn(kept, part[t]);
        const u64 r = splitmix64(params[blockIdx.x].seed ^ splitmix64((u64)pos[batch ? blockIdx.x : 0u]));
        const float target = __fmul_rn((float)(r >> 40) * (1.0f / 16777216.0f), kept);
        float acc = 0.0f;
        u32 chosen = 0xffffffffu;
#pragma unroll 1
        for (u32 t = 0; t < SAMPLE_THREADS && chosen == 0xffffffffu; t++) {
            const float next = __fadd_rn(acc, part[t]);
            if (!(target < next)) {
                acc = next;
                continue;
            }
            const u32 a = min(t * chunk, vocab), b = min(a + chunk, vocab);
            for (u32 i = a; i < b; i++) {
                if (w[i] >= tau && w[i] > 0.0f) {
                    acc = __fadd_rn(acc, w[i]);
                    if (target < acc) {
                        chosen = i;
                        break;
                    }
                }
            }
        }
        // Rounding can leave the target just past the last kept weight: take that token.
        if (chosen == 0xffffffffu) {
            chosen = 0u;
            for (u32 i = vocab; i-- > 0u;)
                if (w[i] >= tau && w[i] > 0.0f) {
                    chosen = i;
                    break;
                }
        }
        pick(token, pos, batch, advance, chosen);
    }
}
