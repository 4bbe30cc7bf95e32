// Load-time re-layouts: checkpoint bytes, already copied to the device as they are stored, into
// the layouts the decode kernels read. The CPU references are dsv4_ops::gpu::gemv::pack (the
// tile layout) and gemv::fp8_scale_rows; dsv4_ops::gpu::relayout launches these.
#include "dsv4_common.cuh"

using namespace dsv4;

// One call packs `rows` source rows (rows 8t.. of both W1 and W3 for gate+up, 16t.. otherwise,
// counted from the call's first row) into whole tiles at `dst`.
struct PackArgs {
    u8* dst;
    const u8* w;
    const u8* w3;   // gate+up only
    u64 slots;      // tiles * steps * 256
    u32 rows;
    u32 chunks;     // 16-byte chunks per source row
    u32 steps;
    u32 unit;       // bytes per chunk: 16 (codes), 2 (NVFP4 scales) or 1 (MXFP4 scales)
    u32 gate_up;
    u32 fp4;        // reorder the e2m1 codes of each word (codes only)
    u8 source_bit[32];  // packed bit b <- checkpoint bit source_bit[b] (gemv::pack::fp4_source_bit)
};

__device__ __forceinline__ u32 encode_fp4_word(u32 w, const u8 (&bit)[32]) {
    u32 out = 0u;
#pragma unroll
    for (int b = 0; b < 32; ++b) out |= ((w >> bit[b]) & 1u) << b;
    return out;
}

// Slot i holds chunk 16s + 4u + l % 4 of tile row l / 4 + 8h, with
// i = (((t * steps + s) * 4 + u) * 2 + h) * 32 + l; slots past the rows or chunks are zero.
DSV4_KERNEL void pack_tiles(const PackArgs a) {
    pdl_enter();
    u8 bit[32];
#pragma unroll
    for (int b = 0; b < 32; ++b) bit[b] = a.source_bit[b];
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < a.slots; i += (u64)gridDim.x * blockDim.x) {
        const u32 l = (u32)(i % 32u), h = (u32)(i / 32u % 2u), u = (u32)(i / 64u % 4u);
        const u64 st = i / 256u;
        const u32 s = (u32)(st % a.steps);
        const u64 t = st / a.steps;
        const u32 c = 16u * s + 4u * u + l % 4u;
        const u64 r = a.gate_up ? 8u * t + l / 4u : 16u * t + 8u * h + l / 4u;
        const u8* src = (a.gate_up && h == 1u) ? a.w3 : a.w;
        const bool real = r < a.rows && c < a.chunks;
        const u64 from = (r * a.chunks + c) * a.unit;
        if (a.unit == 16u) {
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (real) {
                v = *reinterpret_cast<const uint4*>(src + from);
                if (a.fp4) {
                    v.x = encode_fp4_word(v.x, bit);
                    v.y = encode_fp4_word(v.y, bit);
                    v.z = encode_fp4_word(v.z, bit);
                    v.w = encode_fp4_word(v.w, bit);
                }
            }
            *reinterpret_cast<uint4*>(a.dst + i * 16u) = v;
        } else {
            for (u32 k = 0; k < a.unit; ++k) a.dst[i * a.unit + k] = real ? src[from + k] : (u8)0u;
        }
    }
}

// The least power of two at or above x > 0 (1 for x = 0 or NaN, x itself for infinity), by
// doubling and halving: exact.
__device__ __forceinline__ float pow2_at_or_above(float x) {
    if (!(x > 0.0f)) return 1.0f;
    if (isinf(x)) return x;
    float f = 1.0f;
    while (f < x) f = __fmul_rn(f, 2.0f);
    while (__fmul_rn(f, 0.5f) >= x) f = __fmul_rn(f, 0.5f);
    return f;
}

__device__ __forceinline__ float scale_at(const u8* raw, u64 i, u32 f32_scales) {
    if (f32_scales) {
        const u8* b = raw + 4u * i;
        return __uint_as_float((u32)b[0] | (u32)b[1] << 8 | (u32)b[2] << 16 | (u32)b[3] << 24);
    }
    return e8m0_to_f32(raw[i]);
}

// FP8 block scales [rows, cols] (e8m0 bytes or little-endian f32) -> out [rows, groups + 1]:
// each row's scale repeated once per 64 columns and divided by the row's factor, then the
// factor (the least power of two at or above the row's largest scale). One thread per row.
DSV4_KERNEL void fp8_scale_rows(float* __restrict__ out, const u8* __restrict__ raw, u32 rows, u32 cols,
                                u32 groups, u32 block_cols, u32 f32_scales) {
    pdl_enter();
    for (u32 r = blockIdx.x * blockDim.x + threadIdx.x; r < rows; r += gridDim.x * blockDim.x) {
        float most = 0.0f;
        for (u32 g = 0; g < groups; ++g)
            most = fmaxf(most, scale_at(raw, (u64)r * cols + (u64)g * 64u / block_cols, f32_scales));
        const float factor = pow2_at_or_above(most);
        float* o = out + (u64)r * (groups + 1u);
        for (u32 g = 0; g < groups; ++g)
            o[g] = __fdiv_rn(scale_at(raw, (u64)r * cols + (u64)g * 64u / block_cols, f32_scales), factor);
        o[groups] = factor;
    }
}
