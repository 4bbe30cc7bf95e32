// Counter-based random fills: the weights of a synthetic model generated in place on the
// device, in the kernels' own layouts, so a benchmark needs no checkpoint on disk (and a
// stand-in sequence state for long-context benchmarks). Element i
// of a fill depends only on (seed, i), so any grid writes the same bytes, and the CPU
// reference (dsv4_ops::gpu::random::reference) reproduces them bit for bit.
#include "dsv4_common.cuh"

using namespace dsv4;

__device__ __forceinline__ u64 element_bits(u64 seed, u64 i) { return splitmix64(seed ^ splitmix64(i)); }

// out[i] = lo + (the hash's top 32 bits * span >> 32), its sign bit (0x80) set when `sign` is
// non-zero and the hash's bit 0 is: span 256 gives every byte, span 1 the constant lo.
DSV4_KERNEL void random_bytes(u8* __restrict__ out, u64 n, u64 seed, u32 lo, u32 span, u32 sign) {
    pdl_enter();
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u64 h = element_bits(seed, i);
        u32 b = lo + (u32)(((h >> 32) * (u64)span) >> 32);
        if (sign != 0u && (h & 1u) != 0u) b |= 0x80u;
        out[i] = (u8)b;
    }
}

// mean + half_range * (2u - 1), u in [0, 1) from the hash's top 24 bits, rounded at each step.
__device__ __forceinline__ float uniform_value(u64 seed, u64 i, float mean, float half_range) {
    const float u = __fmul_rn((float)(u32)(element_bits(seed, i) >> 40), 5.9604645e-8f);
    return __fadd_rn(mean, __fmul_rn(half_range, __fsub_rn(__fmul_rn(2.0f, u), 1.0f)));
}

// out[i] = bf16(uniform_value(seed, i)).
DSV4_KERNEL void random_bf16(u16* __restrict__ out, u64 n, u64 seed, float mean, float half_range) {
    pdl_enter();
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        out[i] = f32_to_bf16(uniform_value(seed, i, mean, half_range));
}

// out[i] = f16(uniform_value(seed, i)): a benchmark's stand-in sequence state in half
// precision.
DSV4_KERNEL void random_f16(u16* __restrict__ out, u64 n, u64 seed, float mean, float half_range) {
    pdl_enter();
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        out[i] = f32_to_f16(uniform_value(seed, i, mean, half_range));
}

// out[i] = uniform_value(seed, i): a benchmark's stand-in sequence state.
DSV4_KERNEL void random_f32(float* __restrict__ out, u64 n, u64 seed, float mean, float half_range) {
    pdl_enter();
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        out[i] = uniform_value(seed, i, mean, half_range);
}
