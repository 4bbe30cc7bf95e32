// Format kernels: NVFP4 activation quantization, weight dequantization (NVFP4, MXFP4,
// FP8 128x128), the Blackwell block-scale swizzle and the FP8 KV-cache record.
//
// Every kernel reproduces the CPU codecs in dsv4_ops::codecs bit for bit, so every float
// operation that rounds is spelled with an explicit __f*_rn intrinsic (no FMA contraction).
// Flat indices are 64-bit; all kernels use grid-stride loops, so any grid size is valid.
#include "dsv4_common.cuh"

using namespace dsv4;

__device__ __forceinline__ u64 global_thread() { return (u64)blockIdx.x * blockDim.x + threadIdx.x; }
__device__ __forceinline__ u64 grid_threads() { return (u64)gridDim.x * blockDim.x; }

// ------------------------------------------------------------------------------------------
// NVFP4 activations (W4A4 on Blackwell): global scale from the tensor amax, computed on the
// device so that quantization never reads back to the host (graph-capturable).
// ------------------------------------------------------------------------------------------

// amax_bits must be zero before the launch. It receives the f32 bits of max |x|: non-negative
// floats order like their bit patterns, so an integer atomicMax is a float max. NaN is ignored.
DSV4_KERNEL void nvfp4_act_amax(const u16* __restrict__ x, u64 n, u32* __restrict__ amax_bits) {
    float m = 0.0f;
    for (u64 i = global_thread(); i < n; i += grid_threads()) m = fmaxf(m, fabsf(bf16_to_f32(x[i])));
    m = warp_max(m);
    __shared__ float partial[32];
    const u32 lane = threadIdx.x & 31u;
    const u32 warp = threadIdx.x >> 5;
    if (lane == 0u) partial[warp] = m;
    __syncthreads();
    if (warp == 0u) {
        m = lane < ((blockDim.x + 31u) >> 5) ? partial[lane] : 0.0f;
        m = warp_max(m);
        if (lane == 0u) atomicMax(amax_bits, __float_as_uint(m));
    }
}

// amax / (6 * 448), or 1 when amax is zero or not finite (codecs::nvfp4::global_scale).
__device__ __forceinline__ float nvfp4_global_scale(float amax) {
    return (amax > 0.0f && isfinite(amax)) ? __fdiv_rn(amax, 2688.0f) : 1.0f;
}

// One thread per 16-element block. x: bf16 [rows, cols]; packed: [rows, ceil(cols/2)] (element
// 2k in the low nibble); scales: e4m3 [rows, ceil(cols/16)]; global_out: f32 [1].
DSV4_KERNEL void nvfp4_act_quantize(const u16* __restrict__ x, u32 rows, u32 cols,
                                    const u32* __restrict__ amax_bits, u8* __restrict__ packed,
                                    u8* __restrict__ scales, float* __restrict__ global_out) {
    const float global = nvfp4_global_scale(__uint_as_float(*amax_bits));
    if (global_thread() == 0) *global_out = global;
    const float six_global = __fmul_rn(6.0f, global);
    const u32 sc = (cols + 15u) / 16u;
    const u32 pc = (cols + 1u) / 2u;
    const u64 nblocks = (u64)rows * sc;
    for (u64 i = global_thread(); i < nblocks; i += grid_threads()) {
        const u32 r = (u32)(i / sc);
        const u32 b = (u32)(i % sc);
        const u32 len = min(16u, cols - b * 16u);
        const u16* src = x + (u64)r * cols + b * 16u;
        u16 h[16];
        if (len == 16u && ((u64)src & 15u) == 0u) {
            const uint4 lo = reinterpret_cast<const uint4*>(src)[0];
            const uint4 hi = reinterpret_cast<const uint4*>(src)[1];
            const u32 w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                h[2 * k] = (u16)(w[k] & 0xffffu);
                h[2 * k + 1] = (u16)(w[k] >> 16);
            }
        } else {
#pragma unroll
            for (int k = 0; k < 16; ++k) h[k] = (u32)k < len ? src[k] : (u16)0;
        }
        float v[16];
        float m = 0.0f;
#pragma unroll
        for (int k = 0; k < 16; ++k) {
            v[k] = bf16_to_f32(h[k]);
            m = fmaxf(m, fabsf(v[k]));
        }
        // All-zero blocks get scale 1.0 (0x38); others are clamped to >= 2^-9 (0x01).
        const u8 code = m == 0.0f ? (u8)0x38u : (u8)max((u32)f32_to_e4m3(__fdiv_rn(m, six_global)), 1u);
        scales[(u64)r * sc + b] = code;
        const float s = __fmul_rn(e4m3_to_f32(code), global);
        u64 bits = 0;
#pragma unroll
        for (int k = 0; k < 16; ++k) bits |= (u64)f32_to_e2m1(__fdiv_rn(v[k], s)) << (4 * k);
        u8* dst = packed + (u64)r * pc + b * 8u;
        if (len == 16u && ((u64)dst & 7u) == 0u) {
            *reinterpret_cast<u64*>(dst) = bits;
        } else {
            // Padding elements are 0, so an odd tail gets a zero high nibble.
            for (u32 k = 0; k < (len + 1u) / 2u; ++k) dst[k] = (u8)(bits >> (8u * k));
        }
    }
}

// ------------------------------------------------------------------------------------------
// Weight dequantization to bf16. One thread per packed byte / element: these run once at
// load time, so simplicity wins over bandwidth here.
// ------------------------------------------------------------------------------------------

// Both FP4 formats, packed: [rows, ceil(cols/2)]; scales: [rows, ceil(cols/BLOCK)]. One thread
// per packed byte (two elements, low nibble first); `scale` decodes a block's scale byte.
template <u32 BLOCK, typename Scale>
__device__ __forceinline__ void fp4_dequant(const u8* __restrict__ packed, const u8* __restrict__ scales, u32 rows,
                                            u32 cols, u16* __restrict__ out, Scale scale) {
    const u32 pc = (cols + 1u) / 2u;
    const u32 sc = (cols + BLOCK - 1u) / BLOCK;
    const u64 n = (u64)rows * pc;
    for (u64 i = global_thread(); i < n; i += grid_threads()) {
        const u32 r = (u32)(i / pc);
        const u32 c = 2u * (u32)(i % pc);
        const u32 byte = packed[i];
        const float s = scale(scales[(u64)r * sc + c / BLOCK]);
        u16* dst = out + (u64)r * cols + c;
        dst[0] = f32_to_bf16(__fmul_rn(e2m1_to_f32(byte & 15u), s));
        if (c + 1u < cols) dst[1] = f32_to_bf16(__fmul_rn(e2m1_to_f32(byte >> 4), s));
    }
}

// Scales e4m3 per 16; global: f32 [1]. value = e2m1 * (block scale * global), the ModelOpt order.
DSV4_KERNEL void nvfp4_dequant(const u8* __restrict__ packed, const u8* __restrict__ scales,
                               const float* __restrict__ global, u32 rows, u32 cols, u16* __restrict__ out) {
    const float g = *global;
    fp4_dequant<16>(packed, scales, rows, cols, out, [g](u8 b) { return __fmul_rn(e4m3_to_f32(b), g); });
}

// Scales e8m0 per 32. value = e2m1 * 2^(e-127).
DSV4_KERNEL void mxfp4_dequant(const u8* __restrict__ packed, const u8* __restrict__ scales, u32 rows,
                               u32 cols, u16* __restrict__ out) {
    fp4_dequant<32>(packed, scales, rows, cols, out, [](u8 b) { return e8m0_to_f32(b); });
}

// w: e4m3 [rows, cols]; scales: [ceil(rows/br), ceil(cols/bc)] of e8m0 (instruct releases) or
// f32 (Base releases). value = e4m3 * scale.
DSV4_KERNEL void fp8_block_dequant_e8m0(const u8* __restrict__ w, const u8* __restrict__ scales, u32 rows,
                                        u32 cols, u32 br, u32 bc, u16* __restrict__ out) {
    const u32 sc = (cols + bc - 1u) / bc;
    const u64 n = (u64)rows * cols;
    for (u64 i = global_thread(); i < n; i += grid_threads()) {
        const u32 r = (u32)(i / cols);
        const u32 c = (u32)(i % cols);
        const float s = e8m0_to_f32(scales[(u64)(r / br) * sc + c / bc]);
        out[i] = f32_to_bf16(__fmul_rn(e4m3_to_f32(w[i]), s));
    }
}

DSV4_KERNEL void fp8_block_dequant_f32(const u8* __restrict__ w, const float* __restrict__ scales, u32 rows,
                                       u32 cols, u32 br, u32 bc, u16* __restrict__ out) {
    const u32 sc = (cols + bc - 1u) / bc;
    const u64 n = (u64)rows * cols;
    for (u64 i = global_thread(); i < n; i += grid_threads()) {
        const u32 r = (u32)(i / cols);
        const u32 c = (u32)(i % cols);
        const float s = scales[(u64)(r / br) * sc + c / bc];
        out[i] = f32_to_bf16(__fmul_rn(e4m3_to_f32(w[i]), s));
    }
}

// ------------------------------------------------------------------------------------------
// Blackwell block-scaled MMA scale layout ("32_4_4"). A [rows, cols] byte matrix is padded to
// ceil(rows/128)*128 x ceil(cols/4)*4 with zeros and cut into 512-byte tiles of 128 rows x 4
// columns, column tiles innermost; inside a tile, (r, c) sits at
// (r % 32) * 16 + ((r % 128) / 32) * 4 + c % 4.
// ------------------------------------------------------------------------------------------

// One thread per output byte, so the padding is written too.
DSV4_KERNEL void scale_swizzle_32_4_4(const u8* __restrict__ in, u32 rows, u32 cols, u8* __restrict__ out) {
    const u32 ncb = (cols + 3u) / 4u;
    const u64 n = (u64)((rows + 127u) / 128u) * 128u * ncb * 4u;
    for (u64 o = global_thread(); o < n; o += grid_threads()) {
        const u64 tile = o / 512u;
        const u32 w = (u32)(o % 512u);
        const u64 r = (tile / ncb) * 128u + ((w % 16u) / 4u) * 32u + w / 16u;
        const u64 c = (tile % ncb) * 4u + w % 4u;
        out[o] = (r < rows && c < cols) ? in[r * cols + c] : (u8)0;
    }
}

DSV4_KERNEL void scale_unswizzle_32_4_4(const u8* __restrict__ in, u32 rows, u32 cols, u8* __restrict__ out) {
    const u32 ncb = (cols + 3u) / 4u;
    const u64 n = (u64)rows * cols;
    for (u64 i = global_thread(); i < n; i += grid_threads()) {
        const u32 r = (u32)(i / cols);
        const u32 c = (u32)(i % cols);
        const u64 tile = (u64)(r / 128u) * ncb + c / 4u;
        out[i] = in[tile * 512u + (r % 32u) * 16u + ((r % 128u) / 32u) * 4u + c % 4u];
    }
}

// ------------------------------------------------------------------------------------------
// FP8 KV-cache token record (FlashMLA MODEL1 layout, 584 bytes):
//   [0, 448)   NoPE channels 0..447 as e4m3, in 7 tiles of 64 channels
//   [448, 576) RoPE channels 448..511 as bf16, copied verbatim
//   [576, 583) the tiles' ue8m0 scales (smallest power of two fitting the tile amax under 448)
//   583        zero padding
// One warp per token: lane l owns channels 2l and 2l+1 of every tile.
// ------------------------------------------------------------------------------------------

#define KV_DIM 512u
#define KV_NOPE 448u
#define KV_TILES 7u
#define KV_RECORD 584u

DSV4_KERNEL void kv_fp8_quantize(const u16* __restrict__ kv, u32 tokens, u8* __restrict__ records) {
    const u32 lane = threadIdx.x & 31u;
    const u32 warps = blockDim.x >> 5;
    for (u64 t = (u64)blockIdx.x * warps + (threadIdx.x >> 5); t < tokens; t += (u64)gridDim.x * warps) {
        const u32* src = reinterpret_cast<const u32*>(kv + t * KV_DIM);
        u8* rec = records + t * KV_RECORD;
#pragma unroll
        for (u32 tile = 0; tile < KV_TILES; ++tile) {
            const u32 pair = src[tile * 32u + lane];
            const float a = bf16_to_f32((u16)(pair & 0xffffu));
            const float b = bf16_to_f32((u16)(pair >> 16));
            const float m = warp_max(fmaxf(fabsf(a), fabsf(b)));
            const u8 sbyte = e8m0_scale_for_amax(m, 448.0f);
            // The scale is a power of two, so multiplying by its inverse is exact.
            const float inv = __fdiv_rn(1.0f, e8m0_to_f32(sbyte));
            const u32 q = (u32)f32_to_e4m3(__fmul_rn(a, inv)) | ((u32)f32_to_e4m3(__fmul_rn(b, inv)) << 8);
            *reinterpret_cast<u16*>(rec + tile * 64u + 2u * lane) = (u16)q;
            if (lane == tile) rec[KV_NOPE + 128u + tile] = sbyte;
        }
        reinterpret_cast<u32*>(rec + KV_NOPE)[lane] = src[KV_NOPE / 2u + lane];
        if (lane == KV_TILES) rec[KV_RECORD - 1u] = 0u;
    }
}

DSV4_KERNEL void kv_fp8_dequant(const u8* __restrict__ records, u32 tokens, u16* __restrict__ kv) {
    const u32 lane = threadIdx.x & 31u;
    const u32 warps = blockDim.x >> 5;
    for (u64 t = (u64)blockIdx.x * warps + (threadIdx.x >> 5); t < tokens; t += (u64)gridDim.x * warps) {
        const u8* rec = records + t * KV_RECORD;
        u32* dst = reinterpret_cast<u32*>(kv + t * KV_DIM);
#pragma unroll
        for (u32 tile = 0; tile < KV_TILES; ++tile) {
            const float s = e8m0_to_f32(rec[KV_NOPE + 128u + tile]);
            const u32 q = *reinterpret_cast<const u16*>(rec + tile * 64u + 2u * lane);
            const u32 lo = f32_to_bf16(__fmul_rn(e4m3_to_f32((u8)(q & 0xffu)), s));
            const u32 hi = f32_to_bf16(__fmul_rn(e4m3_to_f32((u8)(q >> 8)), s));
            dst[tile * 32u + lane] = lo | (hi << 16);
        }
        dst[KV_NOPE / 2u + lane] = reinterpret_cast<const u32*>(rec + KV_NOPE)[lane];
    }
}
