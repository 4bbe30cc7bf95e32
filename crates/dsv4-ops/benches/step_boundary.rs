//! What a dependent step between kernels costs on the GPU, beside what a grid-wide barrier
//! inside one persistent kernel costs: the question behind a persistent decode kernel.
//!
//! A chain of S steps: in each, every block's warp 0 reads the previous step's row (one u32 per
//! block, from L2) and writes its own value of the next, so every step depends on every block
//! of the step before, as a layer's launches depend on each other. Timed three ways, each as a
//! CUDA graph replayed with CUDA events (per step: replay time over S):
//! - a launch per step under programmatic dependent launch (`griddepcontrol.wait` first), as
//!   the decode graph's kernels launch, with one block an SM and with a single block;
//! - the same launches without programmatic launch;
//! - one launch whose blocks (as many as SMs, all resident) meet at a grid-wide barrier between the
//!   steps: an arrival counter the last arrival resets before it advances a generation flag the
//!   others wait on, or one counter that only grows, which each block adds to and waits on.
//!
//! Every variant's rows are checked against the host's chain, after an eager run and after the
//! timed graph replays (the persistent kernels' counters then hold other launches' counts).
//! Each timed replay starts behind an untimed one, so the host's launch stays out of the time.
//! `cargo bench -p dsv4-ops --bench step_boundary`; the table is printed.

use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaFunction, CudaGraph};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
use dsv4_ops::gpu::{launch_function, DType, Device, DeviceTensor};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

const SOURCE: &str = r#"
typedef unsigned int u32;

// One step for this block: warp 0 sums the previous row (read from L2) and writes the block's
// value of the next.
__device__ __forceinline__ void step(const u32* prev, u32* next, u32 n) {
    if (threadIdx.x < 32) {
        u32 s = 0;
        for (u32 i = threadIdx.x; i < n; i += 32) s += __ldcg(prev + i);
        s = __reduce_add_sync(0xffffffffu, s);
        if (threadIdx.x == 0) next[blockIdx.x] = s * 2654435761u + blockIdx.x + 1u;
    }
}

__device__ __forceinline__ u32 load_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Every block of the grid meets here: arrivals count up in meet[0]; the last resets it and
// advances the generation meet[1] that the others wait for. The generation is read before the
// block arrives, so it cannot already be the next one.
__device__ __forceinline__ void meet_all(u32* meet) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const u32 gen = load_acquire(meet + 1);
        __threadfence();
        if (atomicAdd(meet, 1u) == gridDim.x - 1u) {
            atomicExch(meet, 0u);
            __threadfence();
            atomicAdd(meet + 1, 1u);
        } else {
            while (load_acquire(meet + 1) == gen) {
            }
        }
    }
    __syncthreads();
}

// The same meeting on one 64-bit counter that only grows (by one a block and meeting, and never
// reset): a launch's k-th meeting waits for its base + (k + 1) * blocks arrivals, the base
// being the count before the launch's first arrivals, a multiple of steps * blocks that every
// block finds from any count it reads before it first arrives (it cannot exceed that multiple
// by a whole meeting).
__device__ __forceinline__ unsigned long long load_acquire64(const unsigned long long* p) {
    unsigned long long v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

extern "C" __global__ void chain_counted(u32* rows, u32 n, u32 steps, unsigned long long* count) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    const unsigned long long per_launch = (unsigned long long)steps * gridDim.x;
    unsigned long long base = 0;
    if (threadIdx.x == 0) base = load_acquire64(count) / per_launch * per_launch;
    for (u32 s = 0; s < steps; ++s) {
        step(rows + s * n, rows + (s + 1) * n, n);
        __syncthreads();
        if (threadIdx.x == 0) {
            const unsigned long long target = base + (unsigned long long)(s + 1) * gridDim.x;
            asm volatile("red.release.gpu.global.add.u64 [%0], 1;" ::"l"(count) : "memory");
            while (load_acquire64(count) < target) {
            }
        }
        __syncthreads();
    }
}

extern "C" __global__ void chain_step(const u32* prev, u32* next, u32 n) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    step(prev, next, n);
}

extern "C" __global__ void chain_persistent(u32* rows, u32 n, u32 steps, u32* meet) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    for (u32 s = 0; s < steps; ++s) {
        step(rows + s * n, rows + (s + 1) * n, n);
        meet_all(meet);
    }
}
"#;

/// Steps of a chain.
const STEPS: usize = 64;
/// Graph replays timed per variant (the median is reported).
const REPLAYS: usize = 21;
const THREADS: u32 = 256;

/// The rows the chain writes after `first`, as the kernels do.
fn host_chain(first: &[u32]) -> Vec<u32> {
    let n = first.len();
    let mut rows = first.to_vec();
    for s in 0..STEPS {
        let sum = rows[s * n..(s + 1) * n]
            .iter()
            .fold(0u32, |a, &v| a.wrapping_add(v));
        rows.extend((0..n as u32).map(|b| sum.wrapping_mul(2_654_435_761).wrapping_add(b + 1)));
    }
    rows
}

struct Chain<'a> {
    dev: &'a Device,
    step: CudaFunction,
    persistent: CudaFunction,
    counted: CudaFunction,
    rows: DeviceTensor<u32>,
    meet: DeviceTensor<u32>,
    blocks: u32,
}

impl Chain<'_> {
    fn launch_steps(&self, pdl: bool) -> Res<()> {
        let n = self.blocks;
        for s in 0..STEPS as u64 {
            let mut prev = self.rows.device_address() + s * n as u64 * 4;
            let mut next = prev + n as u64 * 4;
            let mut n = n;
            let mut params = [
                &mut prev as *mut u64 as *mut std::ffi::c_void,
                &mut next as *mut u64 as *mut std::ffi::c_void,
                &mut n as *mut u32 as *mut std::ffi::c_void,
            ];
            // SAFETY: chain_step(prev, next, n) reads prev[0..n) and writes next[blockIdx.x],
            // rows s and s + 1 of `rows` ([STEPS + 1, blocks]).
            unsafe {
                launch_function(
                    self.dev,
                    &self.step,
                    "chain_step",
                    (n, 1, 1),
                    (THREADS, 0),
                    &mut params,
                    pdl,
                    1,
                )
            }?;
        }
        Ok(())
    }

    /// The persistent chain, its blocks meeting at `chain_persistent`'s barrier or, with
    /// `counted`, at `chain_counted`'s growing counter (`meet` then holds one u64).
    fn launch_persistent(&self, counted: bool) -> Res<()> {
        let mut rows = self.rows.device_address();
        let mut n = self.blocks;
        let mut steps = STEPS as u32;
        let mut meet = self.meet.device_address();
        let mut params = [
            &mut rows as *mut u64 as *mut std::ffi::c_void,
            &mut n as *mut u32 as *mut std::ffi::c_void,
            &mut steps as *mut u32 as *mut std::ffi::c_void,
            &mut meet as *mut u64 as *mut std::ffi::c_void,
        ];
        let (f, name) = if counted {
            (&self.counted, "chain_counted")
        } else {
            (&self.persistent, "chain_persistent")
        };
        // SAFETY: chain_persistent / chain_counted (rows, n, steps, meet) read and write rows
        // [STEPS + 1, n] and meet [2] (one u64); the `blocks` blocks (at most one an SM) are
        // all resident at once.
        unsafe {
            launch_function(
                self.dev,
                f,
                name,
                (n, 1, 1),
                (THREADS, 0),
                &mut params,
                false,
                1,
            )
        }?;
        Ok(())
    }

    /// Writes the chain's first row and clears the rest, for a run whose rows are checked.
    fn reset_rows(&mut self) -> Res<Vec<u32>> {
        let first: Vec<u32> = (0..self.blocks)
            .map(|b| b.wrapping_mul(7919) ^ 0x5eed)
            .collect();
        let mut rows = vec![0u32; (STEPS + 1) * self.blocks as usize];
        rows[..first.len()].copy_from_slice(&first);
        self.dev.write(&mut self.rows, &rows)?;
        Ok(host_chain(&first))
    }

    fn check_rows(&self, want: &[u32], run: &str) -> Res<()> {
        if self.dev.download(&self.rows)? != want {
            return Err(format!("the rows of the {run} differ from the host's chain").into());
        }
        Ok(())
    }

    /// Median seconds per step of `enqueue` captured as one graph. The rows are checked after
    /// an eager run and after the timed replays (a replay after them, on cleared rows).
    fn time(&mut self, enqueue: impl Fn(&Chain) -> Res<()>) -> Res<f64> {
        let want = self.reset_rows()?;
        enqueue(self)?;
        self.check_rows(&want, "eager run")?;
        let stream = self.dev.stream().clone();
        stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let captured = enqueue(self);
        let graph: Option<CudaGraph> = stream.end_capture(CUgraphInstantiate_flags(0))?;
        captured?;
        let graph = graph.ok_or("empty capture")?;
        let ctx = self.dev.context();
        let start = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        let end = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        let mut seconds = Vec::with_capacity(REPLAYS);
        for _ in 0..REPLAYS {
            // A replay ahead of the start keeps the GPU busy while the host launches the timed
            // one, so the host's launch stays out of the time.
            graph.launch()?;
            start.record(&stream)?;
            graph.launch()?;
            end.record(&stream)?;
            seconds.push(start.elapsed_ms(&end)? as f64 * 1e-3 / STEPS as f64);
        }
        let want = self.reset_rows()?;
        graph.launch()?;
        self.check_rows(&want, "graph replays")?;
        seconds.sort_by(f64::total_cmp);
        Ok(seconds[REPLAYS / 2])
    }
}

fn main() -> Res<()> {
    if Device::count()? == 0 {
        println!("step_boundary: no CUDA device on this machine; nothing measured");
        return Ok(());
    }
    let dev = Device::new(0)?;
    let target = dev.arch().nvrtc_target().replace("sm_", "compute_");
    let ptx = compile_ptx_with_opts(
        SOURCE,
        CompileOptions {
            options: vec![format!("--gpu-architecture={target}")],
            ..Default::default()
        },
    )?;
    let module = dev.context().load_module(ptx)?;
    let sms = dev.sm_count() as u32;
    println!(
        "{}: {sms} SMs; {STEPS} dependent steps, {THREADS}-thread blocks, median of {REPLAYS} graph replays\n",
        dev.name()
    );
    println!("| how the steps are joined | blocks | µs a step |\n|---|---:|---:|");
    for (what, blocks, pdl, persistent) in [
        ("a launch a step, programmatic launch", sms, true, None),
        ("a launch a step, programmatic launch", 1, true, None),
        ("a launch a step, plain launch", sms, false, None),
        (
            "one launch, a barrier a step (last arrival releases)",
            sms,
            false,
            Some(false),
        ),
        (
            "one launch, a barrier a step (a growing counter)",
            sms,
            false,
            Some(true),
        ),
    ] {
        let mut chain = Chain {
            dev: &dev,
            step: module.load_function("chain_step")?,
            persistent: module.load_function("chain_persistent")?,
            counted: module.load_function("chain_counted")?,
            rows: dev.alloc(DType::U32, &[STEPS + 1, blocks as usize])?,
            meet: dev.alloc(DType::U32, &[2])?,
            blocks,
        };
        let seconds = match persistent {
            Some(counted) => {
                // Its blocks wait for each other: all of them must be resident at once.
                let f = if counted {
                    &chain.counted
                } else {
                    &chain.persistent
                };
                let per_sm = f.occupancy_max_active_blocks_per_multiprocessor(THREADS, 0, None)?;
                if per_sm * sms < blocks {
                    println!("| {what} | {blocks} | not resident at once: not run |");
                    continue;
                }
                chain.time(|c| c.launch_persistent(counted))?
            }
            None => chain.time(|c| c.launch_steps(pdl))?,
        };
        println!("| {what} | {blocks} | {:.2} |", seconds * 1e6);
    }
    Ok(())
}
