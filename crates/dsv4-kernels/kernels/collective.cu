// One-shot collectives between the GPUs one process drives, over peer-mapped memory (NVLink or
// PCIe peer access), for the few kilobytes a tensor-parallel decode step sums per sub-layer.
//
// Every rank pushes its part straight into every rank's memory, then each block signals its
// arrival by storing the call's sequence number into a flag on every rank, and waits for the
// same block's flags from all ranks before it reads what landed. A block's data and flags
// depend only on its index, so blocks never wait on each other within a rank. The sequence
// number lives in device memory (state[0]) and the last block of a call advances it, so the
// host patches nothing between calls and a captured graph replays as is. Every rank calls the
// collectives in the same order with the same sizes, so their sequence numbers agree.
//
// The all-reduce's receive buffer has two halves, chosen by the sequence number's parity: a
// rank can be at most one call ahead of another (it cannot finish call k + 1 before every
// rank has signalled k + 1, which each does only after it has read call k's half), so a
// rank writing the next call's half never overwrites what another still reads.
//
// Sums run in rank order (rank 0's part, + rank 1's, ...), so every rank gets the same bits.
// A wait that outlasts COLL_TIMEOUT_NS (a peer that never came) traps: the launch fails with
// an error instead of hanging the process.
#include "dsv4_common.cuh"

using namespace dsv4;

#define COLL_MAX_RANKS 8u
// Blocks of one call at most: each has a flag per source rank on every rank.
#define COLL_MAX_BLOCKS 128u
#define COLL_TIMEOUT_NS 10000000000ull

// Every rank's collective buffers (CollPeers in collective/mod.rs, field for field).
struct CollPeers {
    // recv[r]: rank r's receive buffer, [2][world][cap] floats.
    float* recv[COLL_MAX_RANKS];
    // flags[r]: rank r's flags, [COLL_MAX_BLOCKS][COLL_MAX_RANKS] u32.
    u32* flags[COLL_MAX_RANKS];
};

struct AllReduceArgs {
    CollPeers peers;
    // This rank's part in, the sum out: len floats (a multiple of 4), 16-byte aligned.
    float* x;
    u32 len;
    // Floats in one rank's slot of a receive-buffer half.
    u32 cap;
    u32 rank;
    u32 world;
    // This rank's [sequence number, blocks done].
    u32* state;
};

struct AllGatherArgs {
    CollPeers peers;
    // dst[r]: rank r's [rows, world * width] output; this rank writes columns
    // [rank * width, (rank + 1) * width) of each row on every rank.
    float* dst[COLL_MAX_RANKS];
    // This rank's [rows, width] part.
    const float* src;
    u32 rows;
    u32 width;
    u32 rank;
    u32 world;
    u32* state;
};

__device__ __forceinline__ u32 ld_acquire_sys(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_release_sys(u32* p, u32 v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// After the block's pushes: thread r < world tells rank r that this block's part from `rank`
// for call `seq` has landed.
__device__ __forceinline__ void coll_signal(const CollPeers& peers, u32 rank, u32 world, u32 seq) {
    __syncthreads();
    if (threadIdx.x < world) {
        __threadfence_system();
        st_release_sys(peers.flags[threadIdx.x] + blockIdx.x * COLL_MAX_RANKS + rank, seq);
    }
}

// Waits until every rank has signalled this block for call `seq` (a flag may already hold a
// later call's number: that rank is one call ahead, having pushed this call's part first).
__device__ __forceinline__ void coll_wait(const CollPeers& peers, u32 rank, u32 world, u32 seq) {
    if (threadIdx.x < world) {
        const u32* flag = peers.flags[rank] + blockIdx.x * COLL_MAX_RANKS + threadIdx.x;
        const u64 start = global_ns();
        while ((int)(ld_acquire_sys(flag) - seq) < 0) {
            if (global_ns() - start > COLL_TIMEOUT_NS) __trap();
        }
    }
    __syncthreads();
}

// The last block of a call to finish makes `seq` the state's sequence number (every block read
// the previous one before it counted itself done).
__device__ __forceinline__ void coll_advance(u32* state, u32 seq) {
    __syncthreads();
    if (threadIdx.x == 0u) {
        if (atomicAdd(state + 1, 1u) + 1u == gridDim.x) {
            state[1] = 0u;
            state[0] = seq;
        }
    }
}

// x = sum over ranks of x, in rank order. Block b takes the float4s b * blockDim.x + t, then a
// grid's stride on; the grid is the same on every rank.
DSV4_KERNEL void __launch_bounds__(256) all_reduce_oneshot(const AllReduceArgs p) {
    pdl_enter();
    const u32 seq = p.state[0] + 1u;
    const u32 world = p.world, rank = p.rank;
    const u64 half = (u64)(seq & 1u) * world * p.cap;
    const u32 n4 = p.len / 4u;
    const u32 stride = gridDim.x * blockDim.x;
    float4* x = reinterpret_cast<float4*>(p.x);
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += stride) {
        const float4 v = x[i];
        for (u32 r = 0; r < world; r++) {
            float4* slot = reinterpret_cast<float4*>(p.peers.recv[r] + half + (u64)rank * p.cap);
            slot[i] = v;
        }
    }
    coll_signal(p.peers, rank, world, seq);
    coll_wait(p.peers, rank, world, seq);
    const float* mine = p.peers.recv[rank] + half;
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += stride) {
        float4 s = __ldcg(reinterpret_cast<const float4*>(mine) + i);
        for (u32 r = 1; r < world; r++) {
            const float4 v = __ldcg(reinterpret_cast<const float4*>(mine + (u64)r * p.cap) + i);
            s.x = __fadd_rn(s.x, v.x);
            s.y = __fadd_rn(s.y, v.y);
            s.z = __fadd_rn(s.z, v.z);
            s.w = __fadd_rn(s.w, v.w);
        }
        x[i] = s;
    }
    coll_advance(p.state, seq);
}

// Every rank's dst gets this rank's [rows, width] part at columns rank * width of each row.
DSV4_KERNEL void __launch_bounds__(256) all_gather_cols(const AllGatherArgs p) {
    pdl_enter();
    const u32 seq = p.state[0] + 1u;
    const u32 world = p.world, rank = p.rank;
    const u64 total = (u64)p.rows * p.width;
    const u64 row_out = (u64)world * p.width;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        const u64 row = i / p.width, col = i % p.width;
        const float v = p.src[i];
        const u64 at = row * row_out + (u64)rank * p.width + col;
        for (u32 r = 0; r < world; r++) p.dst[r][at] = v;
    }
    coll_signal(p.peers, rank, world, seq);
    coll_wait(p.peers, rank, world, seq);
    coll_advance(p.state, seq);
}
