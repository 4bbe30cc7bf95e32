// Helpers shared by every kernel family. Numeric conversions are written with integer
// bit operations rather than cuda_bf16.h / cuda_fp8.h intrinsics: the NVRTC wheel ships no
// CUDA headers, and the bit patterns must match the CPU codecs in dsv4_ops::codecs exactly
// (saturation, NaN and signed-zero handling included).
#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define DSV4_KERNEL extern "C" __global__

namespace dsv4 {

// ---- bf16 (stored as raw u16) ----

__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float((u32)h << 16); }

// Round to nearest even; NaN keeps its top mantissa bits and becomes quiet (as the `half` crate).
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    const u32 x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (u16)((x >> 16) | 0x40u);
    const u32 round_bit = 0x8000u;
    if ((x & round_bit) != 0u && (x & (3u * round_bit - 1u)) != 0u) return (u16)((x >> 16) + 1u);
    return (u16)(x >> 16);
}

// ---- f16 (IEEE half, stored as raw u16) ----

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("{ .reg .b16 x; mov.b16 x, %1; cvt.f32.f16 %0, x; }" : "=f"(f) : "h"(h));
    return f;
}

// Round to nearest even, past 65504 to infinity; NaN keeps its top mantissa bits and becomes
// quiet (as the `half` crate; the conversion instruction would give one canonical NaN).
__device__ __forceinline__ u16 f32_to_f16(float f) {
    const u32 x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (u16)(((x >> 16) & 0x8000u) | 0x7e00u | ((x >> 13) & 0x3ffu));
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// ---- e4m3fn: bias 7, max 448, NaN = 0x7f/0xff, no infinity ----

__device__ __forceinline__ float e4m3_to_f32(u8 b) {
    const u32 e = (b >> 3) & 0xfu;
    const u32 m = b & 7u;
    float mag;
    if (e == 15u && m == 7u) {
        mag = __uint_as_float(0x7fc00000u);
    } else if (e == 0u) {
        mag = (float)m * (1.0f / 512.0f);
    } else {
        mag = __uint_as_float(((e + 120u) << 23) | (m << 20));
    }
    return (b & 0x80u) ? -mag : mag;
}

// Round to nearest even, saturating to +-448; NaN -> 0x7f.
__device__ __forceinline__ u8 f32_to_e4m3(float x) {
    const u32 bits = __float_as_uint(x);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fu;
    const u32 sign = (bits >> 24) & 0x80u;
    const float a = fabsf(x);
    u32 mag;
    if (a < 1.0f / 64.0f) {
        // Subnormal range, uniform step 2^-9 (the scaling is exact).
        mag = (u32)rintf(a * 512.0f);
    } else {
        const u32 b = __float_as_uint(a);
        const u32 r = (b + 0x7ffffu + ((b >> 20) & 1u)) >> 20;
        mag = min(r - (120u << 3), 0x7eu);
    }
    return (u8)(sign | mag);
}

// ---- e2m1: codes 0..7 = 0, .5, 1, 1.5, 2, 3, 4, 6; bit 3 = sign ----

__device__ __forceinline__ float e2m1_to_f32(u32 code) {
    // Magnitude m >= 2 is 2^((m >> 1) - 1) * (1 + (m & 1) / 2); m = 1 is the subnormal 0.5.
    const u32 m = code & 7u;
    const u32 mag = m == 0u ? 0u : m == 1u ? 0x3f000000u : (((m >> 1) + 126u) << 23) | ((m & 1u) << 22);
    return __uint_as_float(mag | ((code & 8u) << 28));
}

// Round to nearest even onto the grid (ModelOpt bounds), saturating to +-6; NaN -> 0.
__device__ __forceinline__ u32 f32_to_e2m1(float x) {
    const u32 bits = __float_as_uint(x);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0u;
    const float a = fabsf(x);
    const u32 mag = (u32)(a > 0.25f) + (u32)(a >= 0.75f) + (u32)(a > 1.25f) + (u32)(a >= 1.75f) +
                    (u32)(a > 2.5f) + (u32)(a >= 3.5f) + (u32)(a > 5.0f);
    return mag | ((bits >> 28) & 8u);
}

// ---- e8m0 (ue8m0): value = 2^(byte - 127), 0xff = NaN ----

__device__ __forceinline__ float e8m0_to_f32(u8 b) {
    if (b == 0u) return __uint_as_float(1u << 22);
    if (b == 0xffu) return __uint_as_float(0x7fc00000u);
    return __uint_as_float((u32)b << 23);
}

__device__ __forceinline__ float pow2_clamped(int e) {
    return e8m0_to_f32((u8)(max(-127, min(127, e)) + 127));
}

// Smallest power of two s in [2^-127, 2^127] with amax / s <= max_code (IEEE division, as the
// CPU codec); zero or non-finite amax gives 1.0 (byte 127).
__device__ __forceinline__ u8 e8m0_scale_for_amax(float amax, float max_code) {
    if (!(isfinite(amax) && amax > 0.0f)) return 127u;
    // Any start converges to the same exponent; log2 only makes the loops short.
    int e = (int)ceilf(log2f(__fdiv_rn(amax, max_code)));
    e = max(-127, min(127, e));
    while (e > -127 && __fdiv_rn(amax, pow2_clamped(e - 1)) <= max_code) e--;
    while (e < 127 && __fdiv_rn(amax, pow2_clamped(e)) > max_code) e++;
    return (u8)(e + 127);
}

// ---- reductions ----

// fmaxf ignores NaN, like f32::max on the CPU side.
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the warp in a fixed order (a butterfly: every lane returns the same bits).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ u32 warp_sum(u32 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Inclusive prefix sum over the lanes: lane l returns v of lanes 0..=l summed.
__device__ __forceinline__ u32 warp_inclusive_sum(u32 v) {
    const u32 lane = threadIdx.x & 31u;
#pragma unroll
    for (u32 o = 1u; o < 32u; o <<= 1) {
        const u32 n = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += n;
    }
    return v;
}

// Sum over the block in a fixed order (warp butterflies, then warp 0 over the warp sums).
// Every thread returns the total. `scratch` holds 32 floats.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    v = warp_sum(v);
    const u32 lane = threadIdx.x & 31u;
    const u32 warp = threadIdx.x >> 5;
    const u32 warps = (blockDim.x + 31u) >> 5;
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0u) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

// Columns of a row an RMSNorm thread of rms_norm_rows keeps in registers (hc_pre and hc_head
// keep COLLAPSE_HELD, mhc.cu); wider rows read the rest again. From the compile options
// (`NORM_HELD` in dsv4_kernels), which the rows launchers also read.
#ifndef DSV4_NORM_HELD
#error "DSV4_NORM_HELD must be defined by the compile options"
#endif
#define NORM_HELD DSV4_NORM_HELD

// The norm weight of a thread's held columns c = threadIdx.x + k * threads (1 past d), loaded
// before the kernel waits for its predecessor: a weight does not depend on it, so its DRAM
// round trip overlaps the predecessor's end instead of following the wait.
template <u32 N>
__device__ __forceinline__ void load_held_weight(float (&w)[N], const float* __restrict__ weight, u32 d,
                                                 u32 threads) {
#pragma unroll
    for (u32 k = 0; k < N; k++) {
        const u32 c = threadIdx.x + k * threads;
        w[k] = c < d ? weight[c] : 1.0f;
    }
}

// ---- rotary embedding ----

// The sine and cosine of the angle position * freq. The angle rounds to f32 as on the CPU;
// its sine and cosine are then taken in double through sincospi, whose argument reduction is
// exact (sincosf's reduction of large angles, up to ~1e6 rad here, spills to local memory).
__device__ __forceinline__ void rope_sin_cos(u32 position, float freq, float& s, float& c) {
    const double angle = (double)__fmul_rn((float)position, freq);
    double sd, cd;
    sincospi(angle * 0.31830988618379067154, &sd, &cd);
    s = (float)sd;
    c = (float)cd;
}

// Element 0 (`first`) or 1 of a pair turned by (s, c), from its own value and the other's.
__device__ __forceinline__ float rope_turn(float own, float other, float s, float c, bool first) {
    return first ? __fsub_rn(__fmul_rn(own, c), __fmul_rn(other, s)) : __fadd_rn(__fmul_rn(own, c), __fmul_rn(other, s));
}

// Rotates the pair at `pair` to `position` by angle position * freq (sign -1: back).
__device__ __forceinline__ void rope_pair(float* pair, u32 position, float freq, float sign) {
    float s, c;
    rope_sin_cos(position, freq, s, c);
    s = __fmul_rn(s, sign);
    const float a = pair[0], b = pair[1];
    pair[0] = rope_turn(a, b, s, c, true);
    pair[1] = rope_turn(b, a, s, c, false);
}

// ---- positions of a launch's tokens ----
//
// A launch either runs a chunk of one sequence (batch == 0: token t at pos[0] + t, the
// sequence's state as given) or a batch of sequences (batch != 0: token t is sequence t's
// next token, at pos[t], with its state in slice t of each state buffer).
__device__ __forceinline__ u32 token_pos(const u32* __restrict__ pos, u32 t, u32 batch) {
    return batch ? pos[t] : pos[0] + t;
}

// A batch's token at this position belongs to a sequence that is not decoding (one whose
// prompt is read in parts between decode steps): kernels write none of its state (window,
// compressor rows and entries, position), and it sees no keys.
#define PARKED 0xffffffffu

// The GPU's global clock, in ns (the same on every SM).
__device__ __forceinline__ u64 global_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// ---- timeline (`dsv4 bench --timeline`; dsv4_kernels::timeline) ----
//
// In a timeline build (DSV4_TIMELINE) the loader puts DSV4_TIMELINE_SCOPE(tag) at the top of
// every kernel. As each warp leaves, its lane 0 appends one record to its SM's part of the log
// the host put in `dsv4_timeline_log`: the kernel's tag, the SM, warp and block, the grid's
// block count, and in %globaltimer ns the warp's entry, the return from its first
// griddepcontrol.wait (0 without one) and its exit. The log: TIMELINE_SMS u32 counts, then
// `dsv4_timeline_per_sm` records of TIMELINE_WORDS u64 per SM; records past that are dropped
// (the count still grows, so the host sees the overflow).
#ifdef DSV4_TIMELINE
extern "C" {
__device__ u64 dsv4_timeline_log;
__device__ u32 dsv4_timeline_per_sm;
}
constexpr u32 TIMELINE_SMS = 256, TIMELINE_WORDS = 5;
// Per warp: when its first wait returned (this kernel's static shared memory).
__device__ __forceinline__ u64* timeline_waits() {
    __shared__ u64 waits[32];
    return waits;
}
__device__ __forceinline__ void timeline_mark_wait() {
    if ((threadIdx.x & 31u) == 0u) {
        u64* w = timeline_waits() + threadIdx.x / 32u;
        if (*w == 0u) *w = global_ns();
    }
}
struct TimelineScope {
    u64 entry;
    u32 tag;
    __device__ explicit TimelineScope(u32 t) : entry(global_ns()), tag(t) {
        if ((threadIdx.x & 31u) == 0u) timeline_waits()[threadIdx.x / 32u] = 0u;
    }
    __device__ ~TimelineScope() {
        if ((threadIdx.x & 31u) != 0u || dsv4_timeline_log == 0u) return;
        const u64 exit = global_ns();
        u32 sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        sm %= TIMELINE_SMS;
        const u32 i = atomicAdd(reinterpret_cast<u32*>(dsv4_timeline_log) + sm, 1u);
        if (i >= dsv4_timeline_per_sm) return;
        u64* r = reinterpret_cast<u64*>(dsv4_timeline_log + 4u * TIMELINE_SMS) +
                 ((u64)sm * dsv4_timeline_per_sm + i) * TIMELINE_WORDS;
        const u32 warp = threadIdx.x / 32u, block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
        r[0] = ((u64)tag << 32) | ((u64)sm << 16) | warp;
        r[1] = ((u64)block << 32) | (gridDim.x * gridDim.y * gridDim.z);
        r[2] = entry;
        r[3] = timeline_waits()[warp];
        r[4] = exit;
    }
};
#define DSV4_TIMELINE_SCOPE(tag) ::dsv4::TimelineScope dsv4_timeline_scope_(tag)
#endif

// ---- programmatic dependent launch ----
//
// Every kernel of a decode step launches with the programmatic-serialization attribute, so it
// may start while its predecessor in the stream still runs. Before `pdl_wait` returns, a kernel
// may read only what no earlier kernel writes (weights); after it, the predecessor in its
// stream (and, by induction, every earlier kernel of that stream) has finished and its writes
// are visible. Kernels of the device's other streams (its side streams) are covered only up to
// the last fork, join or wait between the two: a kernel issued after it must not read what the
// other stream writes after it. `pdl_launch_dependents` lets the successor start launching; a
// kernel calls it after its own wait, so at most two grids of a stream are resident.

__device__ __forceinline__ void pdl_wait() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
#ifdef DSV4_TIMELINE
    timeline_mark_wait();
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// ---- thread-block clusters (sm_90+; elsewhere, and in a launch without clusters, a block is
// a cluster of one) ----

// Cluster-wide barrier (all threads of every block of the cluster), ordering shared-memory
// writes before the reads after it.
__device__ __forceinline__ void cluster_sync() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
    __syncthreads();
#endif
}

// Cluster-wide barrier after this thread's reads of other blocks' shared memory, every value
// of which it has already stored (so the reads are complete whatever the order of the
// arithmetic): no block leaves while a peer may still read it. The arrive orders nothing
// (relaxed): a release would also wait for this block's outstanding global stores.
__device__ __forceinline__ void cluster_sync_after_reads() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
#else
    __syncthreads();
#endif
}

// The u32, float, float2 or float4 at `p` (this block's shared memory) in block `rank` of the
// cluster.
#if __CUDA_ARCH__ >= 900
__device__ __forceinline__ u32 cluster_addr(const void* p, u32 rank) {
    u32 a;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"((u32)__cvta_generic_to_shared(p)), "r"(rank));
    return a;
}
__device__ __forceinline__ u32 cluster_peer(const u32* p, u32 rank) {
    u32 v;
    asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(v) : "r"(cluster_addr(p, rank)) : "memory");
    return v;
}
__device__ __forceinline__ float cluster_peer(const float* p, u32 rank) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(cluster_addr(p, rank)) : "memory");
    return v;
}
__device__ __forceinline__ float2 cluster_peer(const float2* p, u32 rank) {
    float2 v;
    asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(cluster_addr(p, rank)) : "memory");
    return v;
}
__device__ __forceinline__ float4 cluster_peer(const float4* p, u32 rank) {
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(cluster_addr(p, rank))
                 : "memory");
    return v;
}
#else
template <class T>
__device__ __forceinline__ T cluster_peer(const T* p, u32) {
    return *p;
}
#endif

// Both, at the top of a kernel that has nothing to read before its predecessor ends.
__device__ __forceinline__ void pdl_enter() {
    pdl_wait();
    pdl_launch_dependents();
}

// ---- asynchronous copies into shared memory ----

// One 16-byte piece from global to shared memory (both 16-byte aligned), in flight until a
// wait: every piece a thread issues is outstanding at once, where a load-store loop would wait
// one L2 round trip per piece.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    const u32 to = (u32)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(to), "l"(gmem) : "memory");
}

// cp_async16 to the shared-memory address `to`, or 16 zero bytes there where `full` is false.
__device__ __forceinline__ void cp_async16_or_zero(u32 to, const void* gmem, bool full) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(to), "l"(gmem), "r"(full ? 16u : 0u) : "memory");
}

// Closes the thread's pieces issued since the last commit into one group.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Waits until at most N of the thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// ---- Hopper warpgroup MMAs (sm_90a) ----

namespace wg {

__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Until at most N committed groups of MMAs are still running.
template <int N>
__device__ __forceinline__ void wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Generic-proxy shared-memory stores made visible to the MMAs' (async proxy) reads.
__device__ __forceinline__ void stores_to_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Accumulators the asynchronous MMAs write: not to be read or moved across this point.
template <int MT>
__device__ __forceinline__ void hold(float (&d)[MT][4]) {
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int i = 0; i < 4; ++i) asm volatile("" : "+f"(d[m][i])::"memory");
}
template <int N>
__device__ __forceinline__ void hold(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// A-operand registers the asynchronous MMAs read: kept (not reused) up to this point.
template <int B>
__device__ __forceinline__ void hold(u32 (&a)[B][4]) {
#pragma unroll
    for (int b = 0; b < B; ++b)
#pragma unroll
        for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a[b][i])::"memory");
}

// The 64 f32 accumulators of an m64n128 warpgroup MMA (a float[64] `d`): their registers in
// the instruction (%0..%63) and their asm operands.
#define DSV4_WG_D64_REGS "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define DSV4_WG_D64(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// Byte offset of 16-byte chunk c (0..7) of row r in an operand tile stored K-major with the
// 128-byte swizzle: rows of 128 bytes, 8-row atoms of 1 KB, the chunks of row r permuted by
// r % 8 so that the MMAs' reads and the stores' writes spread over all banks.
__device__ __forceinline__ u32 sw128(u32 r, u32 c) { return r / 8 * 1024 + r % 8 * 128 + ((c ^ (r % 8)) * 16); }

// Descriptor of a K-major operand with the 128-byte swizzle at `addr` (the tile 1 KB aligned,
// plus the byte offset of a k block inside its 128-byte rows): 8-row atoms 1 KB apart. The low
// field is the address / 16, so a later offset adds offset / 16.
__device__ __forceinline__ u64 desc_sw128(u32 addr) {
    return (u64)((addr & 0x3ffffu) >> 4) | ((u64)1 << 16) | ((u64)(1024u >> 4) << 32) | ((u64)1 << 62);
}

// Descriptor of a B operand at `smem`, K-major without swizzle: core matrices of 8 rows x 16
// bytes (8 k values), those of the next 8 rows 128 bytes on, those of the next 8 k `k_stride`
// bytes on.
__device__ __forceinline__ u64 desc(const void* smem, u32 k_stride) {
    const u32 addr = (u32)__cvta_generic_to_shared(smem);
    return (u64)((addr & 0x3ffffu) >> 4) | ((u64)(k_stride >> 4) << 16) | ((u64)(128u >> 4) << 32);
}

// d += a . B on m64n64k16: a this warp's 16 rows of A (mma.sync's A fragment of m16n8k16), B
// at `desc`; f16 operands (HALF) or bf16. d[nt] holds rows g, g + 8 of the warp's 16 and
// columns 8 nt + 2 qd (+1), as mma.sync's m16n8 tile nt.
template <bool HALF>
__device__ __forceinline__ void mma(float (&d)[8][4], const u32 (&a)[4], u64 desc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if constexpr (HALF) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
                     "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
                     : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
    } else {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
                     "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
                     : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
    }
#endif
}

}  // namespace wg

// SplitMix64's output function: a counter-based generator (the sampler's draws, the random
// fills of synthetic weights).
__device__ __forceinline__ u64 splitmix64(u64 x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

}  // namespace dsv4
