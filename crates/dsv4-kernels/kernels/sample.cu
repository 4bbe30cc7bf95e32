// Next-token sampling on the device, so a decode graph needs no host decision: greedy
// (argmax, ties to the lowest id, NaN never wins) or temperature + top-p with a counter-based
// draw from (seed, position). The position is read from the device buffer, and sample_pick
// then advances it (the step's last write), so every replay draws afresh.
//
// Greedy: argmax_spans takes the argmax of each span of ids in its own block, sample_pick the
// argmax of those. Otherwise two kernels, one block each: sample_weights writes
// w = exp((z - max) / T); sample_pick finds the top-p threshold on w by bisection over float
// bits, draws u in [0, 1) and walks the kept weights in id order. Every sum has a fixed order (per-thread id ranges, a pairwise tree over
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

DSV4_KERNEL void __launch_bounds__(SAMPLE_THREADS) sample_weights(const float* __restrict__ z, u32 vocab, float inv_t,
                                                                  float* __restrict__ w) {
    pdl_enter();
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

// Greedy, first half: block b writes the argmax id of its span of z to span_ids[b] (the
// weights scratch, as float bits).
DSV4_KERNEL void __launch_bounds__(SAMPLE_THREADS) argmax_spans(const float* __restrict__ z, u32 vocab,
                                                                float* __restrict__ span_ids) {
    pdl_enter();
    __shared__ float vals[SAMPLE_THREADS];
    __shared__ u32 ids[SAMPLE_THREADS];
    const u32 spans = argmax_spans_of(vocab), span = (vocab + spans - 1u) / spans;
    const u32 lo = min(blockIdx.x * span, vocab), hi = min(lo + span, vocab);
    const u32 best = block_argmax(z, lo, hi, vals, ids);
    if (threadIdx.x == 0u) span_ids[blockIdx.x] = __uint_as_float(best);
}

// Writes token[0]. greedy != 0 (temperature 0) takes the argmax of the span winners in w
// (argmax_spans, spans in id order, so ties still go to the lowest id); a row whose weights
// sum to zero or overflow takes the argmax of z.
DSV4_KERNEL void __launch_bounds__(SAMPLE_THREADS) sample_pick(const float* __restrict__ z, const float* __restrict__ w,
                                                               u32 vocab, u32 greedy, float top_p, u64 seed,
                                                               u32* __restrict__ pos, u32 advance,
                                                               u32* __restrict__ token) {
    pdl_enter();
    __shared__ float part[SAMPLE_THREADS];
    __shared__ u32 ids[SAMPLE_THREADS];
    const u32 chunk = (vocab + SAMPLE_THREADS - 1u) / SAMPLE_THREADS;
    const u32 lo = min(threadIdx.x * chunk, vocab);
    const u32 hi = min(lo + chunk, vocab);
    if (greedy) {
        const u32 i = threadIdx.x < argmax_spans_of(vocab) ? __float_as_uint(w[threadIdx.x]) : 0xffffffffu;
        const u32 t = block_best(i != 0xffffffffu ? z[i] : __uint_as_float(0xff800000u), i, part, ids);
        if (threadIdx.x == 0u) {
            token[0] = t == 0xffffffffu ? 0u : t;
            pos[0] += advance;
        }
        return;
    }
    const float total = kept_mass(w, lo, hi, 0.0f, part);
    if (!(total > 0.0f && isfinite(total))) {
        const u32 t = block_argmax(z, 0u, vocab, part, ids);
        if (threadIdx.x == 0u) {
            token[0] = t == 0xffffffffu ? 0u : t;
            pos[0] += advance;
        }
        return;
    }
    // The largest tau (as float bits, monotonic for w >= 0) whose kept mass reaches top_p * total.
    u32 tau_bits = 0u;
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
        for (u32 t = 0; t < SAMPLE_THREADS; t++) kept = __fadd_rn(kept, part[t]);
        const u64 r = splitmix64(seed ^ splitmix64((u64)pos[0]));
        const float target = __fmul_rn((float)(r >> 40) * (1.0f / 16777216.0f), kept);
        float acc = 0.0f;
        u32 chosen = 0xffffffffu;
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
        token[0] = chosen;
        pos[0] += advance;
    }
}
