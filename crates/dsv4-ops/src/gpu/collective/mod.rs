//! One-shot collectives between the GPUs one process drives (`kernels/collective.cu`): the
//! all-reduce of a tensor-parallel sub-layer's partial sums and the all-gather of the head's
//! vocabulary slices. Each rank pushes its part into every rank's memory over peer access,
//! signals with a sequence number kept on the device and waits for the others' signals, all in
//! one launch, so the calls replay inside CUDA graphs with nothing patched.
//!
//! Every rank of a group must make the same calls in the same order with the same sizes (each
//! on its own device's stream); a call waits for the same call on every other rank, so the host
//! must enqueue every rank's work before it waits for any of them.

pub mod reference;
#[cfg(test)]
mod tests;

use std::sync::Arc;

use cudarc::driver::sys;
use cudarc::driver::DeviceRepr;

use super::launch::{dim_u32, launch_struct};
use super::{DType, Device, DeviceTensor, GpuError};

/// Most ranks of a group (the kernels' peer arrays).
pub const MAX_RANKS: usize = 8;
/// Most blocks of one call: each has a flag per source rank on every rank.
pub const MAX_BLOCKS: usize = 128;
const THREADS: u32 = 256;

/// Lets every device of `devs` read and write every other's memory (NVLink or PCIe peer
/// access). A pair without peer access is named.
pub fn enable_peer_access(devs: &[Arc<Device>]) -> Result<(), GpuError> {
    for a in devs {
        for b in devs {
            if a.ordinal() == b.ordinal() {
                continue;
            }
            let mut can = 0;
            // SAFETY: both handles come from live contexts; `can` outlives the call.
            unsafe {
                sys::cuDeviceCanAccessPeer(
                    &mut can,
                    a.context().cu_device(),
                    b.context().cu_device(),
                )
            }
            .result()
            .map_err(GpuError::driver("asking for peer access"))?;
            if can == 0 {
                return Err(GpuError::invalid(
                    "tensor parallelism",
                    format!(
                        "GPU {} cannot access GPU {}'s memory (no NVLink or PCIe peer access)",
                        a.ordinal(),
                        b.ordinal()
                    ),
                ));
            }
            a.context()
                .bind_to_thread()
                .map_err(GpuError::driver("binding a context"))?;
            // SAFETY: the current context is `a`'s, the peer is `b`'s live context.
            let status = unsafe { sys::cuCtxEnablePeerAccess(b.context().cu_ctx(), 0) };
            if status != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
                status.result().map_err(GpuError::driver(format!(
                    "enabling GPU {}'s access to GPU {}",
                    a.ordinal(),
                    b.ordinal()
                )))?;
            }
            // Buffers come from the device's stream-ordered memory pool, whose mappings peer
            // access does not cover: `a` is granted access to `b`'s pool as well.
            let mut pool = std::ptr::null_mut();
            let access = sys::CUmemAccessDesc {
                location: sys::CUmemLocation {
                    type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                    id: a.context().cu_device(),
                },
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            // SAFETY: `pool` receives b's default pool handle; `access` outlives the call.
            unsafe {
                sys::cuDeviceGetDefaultMemPool(&mut pool, b.context().cu_device())
                    .result()
                    .map_err(GpuError::driver("reading a device's memory pool"))?;
                sys::cuMemPoolSetAccess(pool, &access, 1)
                    .result()
                    .map_err(GpuError::driver(format!(
                        "granting GPU {} access to GPU {}'s memory pool",
                        a.ordinal(),
                        b.ordinal()
                    )))?;
            }
        }
    }
    Ok(())
}

/// The pool buffers one rank's collectives need, by name and shape, for a group of `world`
/// ranks summing up to `cap` floats at once.
pub fn buffer_shapes(world: usize, cap: usize) -> [(&'static str, DType, Vec<usize>); 3] {
    [
        ("collective.recv", DType::F32, vec![2, world, cap]),
        ("collective.flags", DType::U32, vec![MAX_BLOCKS, MAX_RANKS]),
        ("collective.state", DType::U32, vec![2]),
    ]
}

/// One rank's own collective buffers (zeroed before the first call: a fresh pool is), shaped
/// as [`buffer_shapes`] says.
pub struct RankBuffers {
    pub recv: DeviceTensor<f32>,
    pub flags: DeviceTensor<u32>,
    pub state: DeviceTensor<u32>,
}

/// `CollPeers` in collective.cu.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CollPeers {
    recv: [u64; MAX_RANKS],
    flags: [u64; MAX_RANKS],
}

#[repr(C)]
struct AllReduceArgs {
    peers: CollPeers,
    x: u64,
    len: u32,
    cap: u32,
    rank: u32,
    world: u32,
    state: u64,
}

#[repr(C)]
struct AllGatherArgs {
    peers: CollPeers,
    dst: [u64; MAX_RANKS],
    src: u64,
    rows: u32,
    width: u32,
    rank: u32,
    world: u32,
    state: u64,
}

// SAFETY: plain #[repr(C)] data with the exact layout of the CUDA structs.
unsafe impl DeviceRepr for AllReduceArgs {}
// SAFETY: as above.
unsafe impl DeviceRepr for AllGatherArgs {}

/// A rank's handle on its group: its own buffers and views of every rank's (which keep the
/// peers' pools alive as long as this handle).
pub struct Collective {
    rank: usize,
    world: usize,
    cap: usize,
    state: DeviceTensor<u32>,
    peers: CollPeers,
    _held: Vec<DeviceTensor<f32>>,
    _held_flags: Vec<DeviceTensor<u32>>,
}

/// The same buffer on every rank of a group (the all-gather's output), by rank.
pub struct PeerTensors {
    addrs: [u64; MAX_RANKS],
    shape: Vec<usize>,
    _held: Vec<DeviceTensor<f32>>,
}

impl PeerTensors {
    /// `bufs[r]` is rank r's buffer; all of one shape.
    pub fn new(bufs: &[&DeviceTensor<f32>]) -> Result<PeerTensors, GpuError> {
        let Some(first) = bufs.first() else {
            return Err(GpuError::invalid("peer tensors", "no ranks"));
        };
        if bufs.len() > MAX_RANKS {
            return Err(GpuError::invalid(
                "peer tensors",
                format!("{} ranks, at most {MAX_RANKS}", bufs.len()),
            ));
        }
        let mut addrs = [0; MAX_RANKS];
        let mut held = Vec::new();
        for (r, b) in bufs.iter().enumerate() {
            b.expect(
                &format!("rank {r}'s peer tensor"),
                DType::F32,
                first.shape(),
            )?;
            addrs[r] = b.device_address();
            held.push(b.view(0, b.shape())?);
        }
        Ok(PeerTensors {
            addrs,
            shape: first.shape().to_vec(),
            _held: held,
        })
    }
}

impl Collective {
    /// Joins the ranks whose buffers are `ranks` (rank r's on its device, all of one group's
    /// shapes, peer access enabled between their devices): one handle per rank.
    pub fn link(ranks: &[RankBuffers]) -> Result<Vec<Collective>, GpuError> {
        let world = ranks.len();
        if world == 0 || world > MAX_RANKS {
            return Err(GpuError::invalid(
                "collective",
                format!("{world} ranks: 1 to {MAX_RANKS} are possible"),
            ));
        }
        let recv_shape = ranks[0].recv.shape().to_vec();
        if recv_shape.len() != 3 || recv_shape[0] != 2 || recv_shape[1] != world {
            return Err(GpuError::invalid(
                "collective.recv",
                format!("shape {recv_shape:?} where [2, {world}, cap] is needed"),
            ));
        }
        let cap = recv_shape[2];
        if !cap.is_multiple_of(4) {
            return Err(GpuError::invalid(
                "collective.recv",
                format!("{cap} floats a slot, not a multiple of 4"),
            ));
        }
        let mut peers = CollPeers::default();
        for (r, b) in ranks.iter().enumerate() {
            let [(_, _, rs), (_, _, fs), (_, _, ss)] = buffer_shapes(world, cap);
            b.recv
                .expect(&format!("rank {r}'s collective.recv"), DType::F32, &rs)?;
            b.flags
                .expect(&format!("rank {r}'s collective.flags"), DType::U32, &fs)?;
            b.state
                .expect(&format!("rank {r}'s collective.state"), DType::U32, &ss)?;
            peers.recv[r] = b.recv.device_address();
            peers.flags[r] = b.flags.device_address();
        }
        ranks
            .iter()
            .enumerate()
            .map(|(rank, own)| {
                Ok(Collective {
                    rank,
                    world,
                    cap,
                    state: own.state.view(0, own.state.shape())?,
                    peers,
                    _held: ranks
                        .iter()
                        .map(|b| b.recv.view(0, b.recv.shape()))
                        .collect::<Result<_, _>>()?,
                    _held_flags: ranks
                        .iter()
                        .map(|b| b.flags.view(0, b.flags.shape()))
                        .collect::<Result<_, _>>()?,
                })
            })
            .collect()
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world(&self) -> usize {
        self.world
    }

    /// Most floats one all-reduce sums.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// `x` = the sum of every rank's `x`, added in rank order (the same bits on every rank).
    /// `x` holds a multiple of 4 floats, at most [`Self::capacity`], 16-byte aligned.
    pub fn all_reduce(&self, dev: &Device, x: &mut DeviceTensor<f32>) -> Result<(), GpuError> {
        let len = x.len();
        if !len.is_multiple_of(4) || len > self.cap || len == 0 {
            return Err(GpuError::invalid(
                "all_reduce",
                format!(
                    "{len} floats: a non-zero multiple of 4 up to {} is needed",
                    self.cap
                ),
            ));
        }
        if !x.device_address().is_multiple_of(16) {
            return Err(GpuError::invalid(
                "all_reduce",
                "input off a 16-byte boundary",
            ));
        }
        let blocks = (len / 4).div_ceil(THREADS as usize).min(MAX_BLOCKS);
        let args = AllReduceArgs {
            peers: self.peers,
            x: x.device_address(),
            len: dim_u32("all_reduce length", len)?,
            cap: dim_u32("all_reduce capacity", self.cap)?,
            rank: self.rank as u32,
            world: self.world as u32,
            state: self.state.device_address(),
        };
        // SAFETY: every address in `peers` is a live buffer of the group's shapes on a
        // peer-enabled device (checked by `link`); x holds len floats (checked above).
        unsafe { launch(dev, "all_reduce_oneshot", blocks, &args) }
    }

    /// Every rank's `dst` (`[rows, world * width]`) gets this rank's `part` (`[rows, width]`)
    /// at columns `rank * width ..`; returns once (in stream order) every rank's part has
    /// landed in this rank's `dst`.
    pub fn all_gather_cols(
        &self,
        dev: &Device,
        part: &DeviceTensor<f32>,
        dst: &PeerTensors,
    ) -> Result<(), GpuError> {
        let (rows, width) = part.dims2("all_gather part", DType::F32)?;
        if dst.shape.len() != 2 || dst.shape[1] != self.world * width || dst.shape[0] < rows {
            return Err(GpuError::invalid(
                "all_gather_cols",
                format!(
                    "output {:?} for parts of [{rows}, {width}] over {} ranks",
                    dst.shape, self.world
                ),
            ));
        }
        if rows == 0 || width == 0 {
            return Err(GpuError::invalid("all_gather_cols", "an empty part"));
        }
        let blocks = (rows * width)
            .div_ceil(4 * THREADS as usize)
            .min(MAX_BLOCKS);
        let args = AllGatherArgs {
            peers: self.peers,
            dst: dst.addrs,
            src: part.device_address(),
            rows: dim_u32("all_gather rows", rows)?,
            width: dim_u32("all_gather width", width)?,
            rank: self.rank as u32,
            world: self.world as u32,
            state: self.state.device_address(),
        };
        // SAFETY: as in all_reduce; every dst holds rows x world * width floats (checked).
        unsafe { launch(dev, "all_gather_cols", blocks, &args) }
    }
}

/// Launches a collective kernel of `blocks` blocks (programmatic, like every kernel of a step).
///
/// # Safety
/// As [`launch_struct`]: `args` mirror the kernel's parameter, its addresses valid.
unsafe fn launch<A: DeviceRepr>(
    dev: &Device,
    kernel: &str,
    blocks: usize,
    args: &A,
) -> Result<(), GpuError> {
    // SAFETY: the caller's.
    unsafe {
        launch_struct(
            dev,
            kernel,
            (blocks as u32, 1, 1),
            (THREADS, 0),
            args,
            true,
            1,
        )
    }
}
