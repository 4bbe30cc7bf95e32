use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{self, CUdevice_attribute, CUfunction_attribute, CUstreamCaptureStatus};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr, PinnedHostSlice,
};
use dsv4_kernels::{driver_available, Arch, Build, KernelCache, Kernels};

use super::launch::cluster_attribute;
use super::tensor::{check_elem, numel};
use super::timeline::{self, WarpRecord};
use super::{DType, DeviceElem, DeviceTensor, GpuError};

/// A kernel's launch limits, read from the driver once.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KernelLimits {
    pub max_threads: u32,
    /// Static shared memory of a block, in bytes.
    pub static_shared: usize,
}

/// What the launchers ask the driver about one kernel.
#[derive(Default)]
struct KernelFacts {
    limits: Option<KernelLimits>,
    /// Resident blocks per multiprocessor by (threads, dynamic shared bytes).
    resident: HashMap<(u32, u32), u32>,
    /// Clusters resident on the whole GPU by (threads, dynamic shared bytes, blocks a cluster).
    clusters: HashMap<(u32, u32, u32), u32>,
}

/// A side stream of a [`Device`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    First = 0,
    Second = 1,
}

/// One GPU: its context, the stream all work is issued on, two side streams for launches that
/// may run beside it ([`Device::fork`] and [`Device::on_side`] for the first,
/// [`Device::fork_to`] and [`Device::on`] for either, [`Device::join`] for both), and the
/// loaded kernels.
///
/// Event tracking is disabled before anything is allocated, so cudarc never records or waits
/// on per-buffer events: all work is ordered by the stream (and the fork and join events), and
/// launches on it can be captured into CUDA graphs (the context's legacy default stream cannot
/// be); a side stream that waits on a capturing stream's event joins its capture.
pub struct Device {
    ordinal: usize,
    name: String,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    sides: [Arc<CudaStream>; 2],
    /// Where launches go: 0 the stream, 1 + i side stream i (inside [`Device::on`]).
    on_side: AtomicUsize,
    /// Side streams forked and not joined since: a join waits only on those (a stream that
    /// never joined a capture must not be waited on inside it).
    forked: [AtomicBool; 2],
    /// Recorded on the stream at a fork (a side waits on it) and on a side at a join (the
    /// stream or the other side waits on it).
    fork_event: CudaEvent,
    join_event: CudaEvent,
    kernels: Kernels,
    sm_count: usize,
    /// Shared memory a block may use once its kernel opts in, in bytes.
    max_block_shared: usize,
    /// The launchers size every eager launch with kernel limits and occupancy answers, which
    /// the driver computes anew on each call: they are kept here, by kernel name.
    facts: Mutex<HashMap<String, KernelFacts>>,
    /// A timeline build's log, its device address and its records per SM
    /// ([`Device::with_timeline`]).
    timeline: Option<(CudaSlice<u8>, u64, u32)>,
}

/// A tensor of `holds` elements takes `got` of them: an error naming `what` otherwise.
fn same_len(what: &str, holds: usize, got: usize) -> Result<(), GpuError> {
    if holds == got {
        return Ok(());
    }
    Err(GpuError::invalid(
        what,
        format!("tensor holds {holds} elements, got {got}"),
    ))
}

impl Device {
    /// Number of CUDA devices; 0 when there is no driver.
    pub fn count() -> Result<usize, GpuError> {
        if !driver_available() {
            return Ok(0);
        }
        let n = CudaContext::device_count().map_err(GpuError::driver("counting devices"))?;
        Ok(n.max(0) as usize)
    }

    /// Opens device `ordinal` with the default kernel cache (`$DSV4_KERNEL_CACHE`, else the
    /// user cache directory).
    pub fn new(ordinal: usize) -> Result<Device, GpuError> {
        Device::with_kernel_cache(ordinal, &KernelCache::from_env()?)
    }

    pub fn with_kernel_cache(ordinal: usize, cache: &KernelCache) -> Result<Device, GpuError> {
        Device::open(ordinal, cache, None)
    }

    /// Opens device `ordinal` with the kernels' timeline build, whose every launch stamps its
    /// warps into a log of `per_sm` records an SM ([`Device::timeline_clear`],
    /// [`Device::timeline_records`]). The stamps cost time: for a timeline, not for timings.
    pub fn with_timeline(ordinal: usize, per_sm: u32) -> Result<Device, GpuError> {
        Device::open(ordinal, &KernelCache::from_env()?, Some(per_sm))
    }

    fn open(
        ordinal: usize,
        cache: &KernelCache,
        timeline: Option<u32>,
    ) -> Result<Device, GpuError> {
        if !driver_available() {
            return Err(GpuError::NoDriver);
        }
        let count = Device::count()?;
        if ordinal >= count {
            return Err(GpuError::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal)
            .map_err(GpuError::driver(format!("opening device {ordinal}")))?;
        // SAFETY: nothing has been allocated on this context by this process through cudarc
        // yet; every later buffer is created untracked and ordered by `stream` alone.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx
            .new_stream()
            .map_err(GpuError::driver("creating the stream"))?;
        let side = || {
            ctx.new_stream()
                .map_err(GpuError::driver("creating a side stream"))
        };
        let sides = [side()?, side()?];
        let event = || {
            ctx.new_event(None)
                .map_err(GpuError::driver("creating a fork or join event"))
        };
        let (fork_event, join_event) = (event()?, event()?);
        let name = ctx
            .name()
            .map_err(GpuError::driver("reading the device name"))?;
        let attribute = |a, what: &str| {
            ctx.attribute(a)
                .map(|v| v.max(0) as usize)
                .map_err(GpuError::driver(format!("reading the {what}")))
        };
        let sm_count = attribute(
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            "multiprocessor count",
        )?
        .max(1);
        let max_block_shared = attribute(
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            "shared memory limit per block",
        )?;
        let build = if timeline.is_some() {
            Build::Timeline
        } else {
            Build::Plain
        };
        let kernels = Kernels::load_as(&ctx, cache, build)?;
        let timeline = match timeline {
            Some(per_sm) => {
                let log = stream
                    .alloc_zeros::<u8>(timeline::log_bytes(per_sm))
                    .map_err(GpuError::driver("allocating the timeline log"))?;
                let addr = {
                    let (addr, _sync) = log.device_ptr(&stream);
                    addr
                };
                kernels.set_timeline_log(&stream, addr, per_sm)?;
                Some((log, addr, per_sm))
            }
            None => None,
        };
        Ok(Device {
            ordinal,
            name,
            ctx,
            stream,
            sides,
            on_side: AtomicUsize::new(0),
            forked: [AtomicBool::new(false), AtomicBool::new(false)],
            fork_event,
            join_event,
            kernels,
            sm_count,
            max_block_shared,
            facts: Mutex::default(),
            timeline,
        })
    }

    /// Empties the timeline log (after the work issued so far): the launches from here on
    /// fill it.
    pub fn timeline_clear(&self) -> Result<(), GpuError> {
        let (_, addr, _) = self.timeline_log()?;
        // SAFETY: the log's first COUNT_BYTES, alive as long as the device, ordered on its
        // stream.
        unsafe {
            cudarc::driver::result::memset_d8_async(
                addr,
                0,
                timeline::COUNT_BYTES,
                self.stream.cu_stream(),
            )
        }
        .map_err(GpuError::driver("clearing the timeline log"))
    }

    /// The timeline log's records since [`Device::timeline_clear`] (waits for the stream), and
    /// how many were dropped past its room.
    pub fn timeline_records(&self) -> Result<(Vec<WarpRecord>, usize), GpuError> {
        let (log, _, per_sm) = self.timeline_log()?;
        let bytes = self
            .stream
            .clone_dtoh(log)
            .map_err(GpuError::driver("reading the timeline log"))?;
        self.stream
            .synchronize()
            .map_err(GpuError::driver("reading the timeline log"))?;
        Ok(timeline::parse(&bytes, per_sm))
    }

    fn timeline_log(&self) -> Result<(&CudaSlice<u8>, u64, u32), GpuError> {
        self.timeline
            .as_ref()
            .map(|(log, addr, n)| (log, *addr, *n))
            .ok_or_else(|| {
                GpuError::invalid(
                    "timeline",
                    "the device was not opened with a timeline".to_string(),
                )
            })
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn arch(&self) -> Arch {
        self.kernels.arch()
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream launches go to: the device's stream, or a side stream inside [`Device::on`].
    pub fn stream(&self) -> &Arc<CudaStream> {
        match self.on_side.load(Ordering::Relaxed) {
            0 => &self.stream,
            i => &self.sides[i - 1],
        }
    }

    /// Makes the first side stream wait for the work issued on the stream so far
    /// ([`Device::fork_to`] of [`Side::First`]).
    pub fn fork(&self) -> Result<(), GpuError> {
        self.fork_to(Side::First)
    }

    /// Makes `side` wait for the work issued on the stream so far: launches [`Device::on`]
    /// issues there next may run beside the stream's later ones.
    pub fn fork_to(&self, side: Side) -> Result<(), GpuError> {
        self.fork_event
            .record(&self.stream)
            .map_err(GpuError::driver("recording the fork event"))?;
        self.sides[side as usize]
            .wait(&self.fork_event)
            .map_err(GpuError::driver("waiting on the fork event"))?;
        self.forked[side as usize].store(true, Ordering::Relaxed);
        Ok(())
    }

    /// [`Device::on`] the first side stream.
    pub fn on_side<R>(&self, f: impl FnOnce() -> Result<R, GpuError>) -> Result<R, GpuError> {
        self.on(Side::First, f)
    }

    /// Runs `f` with its launches issued on `side` (buffers it writes must be its own until
    /// they are joined); launches go where they went before once `f` returns or unwinds.
    pub fn on<R>(
        &self,
        side: Side,
        f: impl FnOnce() -> Result<R, GpuError>,
    ) -> Result<R, GpuError> {
        struct Restore<'a>(&'a AtomicUsize, usize);
        impl Drop for Restore<'_> {
            fn drop(&mut self) {
                self.0.store(self.1, Ordering::Relaxed);
            }
        }
        let _restore = Restore(
            &self.on_side,
            self.on_side.swap(1 + side as usize, Ordering::Relaxed),
        );
        f()
    }

    /// Makes the stream wait for the work issued on the side streams since their forks.
    pub fn join(&self) -> Result<(), GpuError> {
        for side in [Side::First, Side::Second] {
            if self.forked[side as usize].load(Ordering::Relaxed) {
                self.order(&self.stream, side)?;
                self.forked[side as usize].store(false, Ordering::Relaxed);
            }
        }
        Ok(())
    }

    /// Makes `waiter` wait for the work issued on the other side stream so far. Both must have
    /// been forked since their last join (inside a capture, so that both are the capture's and
    /// the next join takes both back).
    pub fn side_waits(&self, waiter: Side) -> Result<(), GpuError> {
        let other = match waiter {
            Side::First => Side::Second,
            Side::Second => Side::First,
        };
        if ![waiter, other]
            .iter()
            .all(|&s| self.forked[s as usize].load(Ordering::Relaxed))
        {
            return Err(GpuError::invalid(
                "side_waits",
                "both side streams must be forked (and not yet joined)",
            ));
        }
        self.order(&self.sides[waiter as usize], other)
    }

    fn order(&self, waiter: &CudaStream, side: Side) -> Result<(), GpuError> {
        self.join_event
            .record(&self.sides[side as usize])
            .map_err(GpuError::driver("recording the join event"))?;
        waiter
            .wait(&self.join_event)
            .map_err(GpuError::driver("waiting on the join event"))
    }

    pub fn kernels(&self) -> &Kernels {
        &self.kernels
    }

    pub fn function(&self, name: &str) -> Result<&CudaFunction, GpuError> {
        Ok(self.kernels.function(name)?)
    }

    pub fn sm_count(&self) -> usize {
        self.sm_count
    }

    /// Shared memory (static and dynamic) one block may use, in bytes.
    pub(crate) fn max_block_shared(&self) -> usize {
        self.max_block_shared
    }

    fn facts<R>(&self, kernel: &str, f: impl FnOnce(&mut KernelFacts) -> R) -> R {
        let mut map = self.facts.lock().unwrap_or_else(|e| e.into_inner());
        // Looked up on every eager launch: the name is copied only the first time.
        if let Some(known) = map.get_mut(kernel) {
            return f(known);
        }
        f(map.entry(kernel.to_string()).or_default())
    }

    /// `kernel`'s block limits. The first call also lets it take dynamic shared memory up to
    /// the device's per-block limit (past 48 KiB a kernel must opt in) and clusters past the
    /// portable size, so no launch has to.
    pub(crate) fn kernel_limits(&self, kernel: &str) -> Result<KernelLimits, GpuError> {
        if let Some(limits) = self.facts(kernel, |k| k.limits) {
            return Ok(limits);
        }
        let f = self.function(kernel)?;
        let err = || GpuError::driver(format!("reading the limits of {kernel}"));
        self.ctx.bind_to_thread().map_err(err())?;
        let static_shared = f.shared_size_bytes().map_err(err())?.max(0) as usize;
        let limits = KernelLimits {
            max_threads: f.max_threads_per_block().map_err(err())?.max(0) as u32,
            static_shared,
        };
        f.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            self.max_block_shared.saturating_sub(static_shared) as i32,
        )
        .map_err(err())?;
        // Clusters past the portable 8 blocks, where the GPU holds them (sm_90: 16).
        if self.arch().has_clusters() {
            f.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
                1,
            )
            .map_err(err())?;
        }
        self.facts(kernel, |k| k.limits = Some(limits));
        Ok(limits)
    }

    /// Blocks of `kernel` resident on one multiprocessor at `threads` per block with `dynamic`
    /// bytes of dynamic shared memory (asked of the driver once per combination).
    pub(crate) fn resident_blocks(
        &self,
        kernel: &str,
        threads: u32,
        dynamic: u32,
    ) -> Result<u32, GpuError> {
        if let Some(blocks) = self.facts(kernel, |k| k.resident.get(&(threads, dynamic)).copied()) {
            return Ok(blocks);
        }
        let blocks = self
            .function(kernel)?
            .occupancy_max_active_blocks_per_multiprocessor(threads, dynamic as usize, None)
            .map_err(GpuError::driver(format!(
                "reading the occupancy of {kernel}"
            )))?;
        self.facts(kernel, |k| k.resident.insert((threads, dynamic), blocks));
        Ok(blocks)
    }

    /// Clusters of `cluster_y` blocks (along y) of `kernel` resident at once on the whole GPU,
    /// at `threads` per block with `dynamic` bytes of dynamic shared memory (asked of the
    /// driver once per combination).
    pub(crate) fn resident_clusters(
        &self,
        kernel: &str,
        threads: u32,
        dynamic: u32,
        cluster_y: u32,
    ) -> Result<u32, GpuError> {
        let key = (threads, dynamic, cluster_y);
        if let Some(n) = self.facts(kernel, |k| k.clusters.get(&key).copied()) {
            return Ok(n);
        }
        let f = self.function(kernel)?;
        let err = || GpuError::driver(format!("reading the cluster occupancy of {kernel}"));
        self.ctx.bind_to_thread().map_err(err())?;
        let mut attr = cluster_attribute(cluster_y);
        let cfg = sys::CUlaunchConfig {
            gridDimX: 1,
            gridDimY: cluster_y,
            gridDimZ: 1,
            blockDimX: threads,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: dynamic,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        let mut n: std::ffi::c_int = 0;
        // SAFETY: cfg and attr outlive the call; the function belongs to this context.
        unsafe { sys::cuOccupancyMaxActiveClusters(&mut n, f.cu_function(), &cfg) }
            .result()
            .map_err(err())?;
        let n = n.max(0) as u32;
        self.facts(kernel, |k| k.clusters.insert(key, n));
        Ok(n)
    }

    /// Whether the stream is being captured into a CUDA graph.
    pub fn is_capturing(&self) -> Result<bool, GpuError> {
        let status = self
            .stream
            .capture_status()
            .map_err(GpuError::driver("reading the stream's capture status"))?;
        Ok(status != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// Host-side work (allocation, copies to or from pageable memory, waiting) has no place in
    /// a captured step: it is refused with an error instead of breaking the capture.
    fn refuse_in_capture(&self, what: &'static str) -> Result<(), GpuError> {
        if self.is_capturing()? {
            return Err(GpuError::InCapture { what });
        }
        Ok(())
    }

    /// A zero-filled tensor with its own allocation (weights, tests). Activations and
    /// workspaces belong in a [`BufferPool`](super::BufferPool).
    pub fn alloc<T: DeviceElem>(
        &self,
        dtype: DType,
        shape: &[usize],
    ) -> Result<DeviceTensor<T>, GpuError> {
        self.refuse_in_capture("allocating")?;
        check_elem::<T>("alloc", dtype)?;
        let n = numel("alloc", shape)?;
        let slice = self
            .stream
            .alloc_zeros::<T>(n)
            .map_err(GpuError::driver(format!(
                "allocating {n} x {}",
                std::any::type_name::<T>()
            )))?;
        Ok(DeviceTensor::owned(dtype, shape.to_vec(), slice))
    }

    /// A new tensor holding `data`.
    pub fn upload<T: DeviceElem>(
        &self,
        dtype: DType,
        shape: &[usize],
        data: &[T],
    ) -> Result<DeviceTensor<T>, GpuError> {
        self.refuse_in_capture("uploading")?;
        check_elem::<T>("upload", dtype)?;
        let n = numel("upload", shape)?;
        if n != data.len() {
            return Err(GpuError::invalid(
                "upload",
                format!("shape {shape:?} needs {n} elements, got {}", data.len()),
            ));
        }
        let slice = self
            .stream
            .clone_htod(data)
            .map_err(GpuError::driver("uploading"))?;
        Ok(DeviceTensor::owned(dtype, shape.to_vec(), slice))
    }

    /// Copies `data` into an existing tensor of the same length.
    pub fn write<T: DeviceElem>(
        &self,
        dst: &mut DeviceTensor<T>,
        data: &[T],
    ) -> Result<(), GpuError> {
        self.refuse_in_capture("copying host data to the device")?;
        same_len("write", dst.len(), data.len())?;
        let mut view = dst.view_mut();
        self.stream
            .memcpy_htod(data, &mut view)
            .map_err(GpuError::driver("copying to the device"))
    }

    /// Copies `src` into `dst` (as many elements, not overlapping) on the main stream (also
    /// inside [`Self::on`]), after the work before it.
    pub fn copy<T: DeviceElem>(
        &self,
        src: &DeviceTensor<T>,
        dst: &mut DeviceTensor<T>,
    ) -> Result<(), GpuError> {
        same_len("copy", dst.len(), src.len())?;
        let mut view = dst.view_mut();
        self.stream
            .memcpy_dtod(src.slice(), &mut view)
            .map_err(GpuError::driver("copying on the device"))
    }

    /// Waits for the stream and copies the tensor to the host.
    pub fn download<T: DeviceElem>(&self, src: &DeviceTensor<T>) -> Result<Vec<T>, GpuError> {
        self.refuse_in_capture("copying to the host")?;
        // After the side streams' work too (a step that failed between a fork and its join).
        self.join()?;
        let mut out = vec![T::default(); src.len()];
        self.stream
            .memcpy_dtoh(src.slice(), &mut out[..])
            .map_err(GpuError::driver("copying to the host"))?;
        self.wait_stream()?;
        Ok(out)
    }

    /// A page-locked host buffer of `len` elements for values read back at every step (the
    /// sampled token): the copy goes straight to it, not through a pageable staging buffer.
    pub fn readback<T: DeviceElem>(&self, len: usize) -> Result<Readback<T>, GpuError> {
        // SAFETY: plain (not write-combined) page-locked memory, read only after a copy into it
        // has completed (`read` waits for the stream the copy ran on); every DeviceElem is
        // valid for any bit pattern.
        let buf = unsafe { self.ctx.alloc_pinned_with_flags::<T>(len, 0) }
            .map_err(GpuError::driver("allocating page-locked host memory"))?;
        Ok(Readback { buf })
    }

    /// Copies `src` into `dst` after the work already on the stream and the side streams,
    /// waits for the stream (the copy is its last work) and returns the values.
    pub fn read<'a, T: DeviceElem>(
        &self,
        src: &DeviceTensor<T>,
        dst: &'a mut Readback<T>,
    ) -> Result<&'a [T], GpuError> {
        self.refuse_in_capture("copying to the host")?;
        if dst.buf.len() != src.len() {
            return Err(GpuError::invalid(
                "read",
                format!(
                    "tensor holds {} elements, the host buffer {}",
                    src.len(),
                    dst.buf.len()
                ),
            ));
        }
        self.join()?;
        self.stream
            .memcpy_dtoh(src.slice(), &mut dst.buf)
            .map_err(GpuError::driver("copying to the host"))?;
        // With event tracking off the buffer's own event is never recorded, so its wait
        // would not wait: the stream is waited for instead.
        self.wait_stream()?;
        dst.buf
            .as_slice()
            .map_err(GpuError::driver("reading page-locked memory"))
    }

    /// Sets every byte of the tensor (stream-ordered): poisons outputs in tests.
    pub fn fill_bytes<T: DeviceElem>(
        &self,
        dst: &mut DeviceTensor<T>,
        byte: u8,
    ) -> Result<(), GpuError> {
        let addr = dst.device_address();
        // SAFETY: the range is exactly the tensor's memory, alive for the call and ordered on
        // the one stream; every DeviceElem is plain data, valid for any bit pattern.
        unsafe {
            cudarc::driver::result::memset_d8_async(
                addr,
                byte,
                dst.num_bytes(),
                self.stream.cu_stream(),
            )
            .map_err(GpuError::driver("filling a tensor"))
        }
    }

    /// `(free, total)` bytes of device memory.
    pub fn memory_info(&self) -> Result<(usize, usize), GpuError> {
        self.ctx
            .mem_get_info()
            .map_err(GpuError::driver("reading free memory"))
    }

    /// Starts (`on`) or stops the range a profiler started with `--profile-from-start off`
    /// (Nsight Compute, Nsight Systems) collects; without a profiler attached it does nothing.
    pub fn profile(&self, on: bool) -> Result<(), GpuError> {
        self.ctx
            .bind_to_thread()
            .map_err(GpuError::driver("binding the context"))?;
        // SAFETY: no arguments; the context is current on this thread.
        let r = unsafe {
            if on {
                sys::cuProfilerStart()
            } else {
                sys::cuProfilerStop()
            }
        };
        r.result()
            .map_err(GpuError::driver("marking the profiled range"))
    }

    pub fn synchronize(&self) -> Result<(), GpuError> {
        self.refuse_in_capture("waiting for the stream")?;
        // The side streams' work too (a step that failed between a fork and its join).
        self.join()?;
        self.wait_stream()
    }

    /// Waits for the stream alone (after a join, or a copy issued after one).
    fn wait_stream(&self) -> Result<(), GpuError> {
        self.stream
            .synchronize()
            .map_err(GpuError::driver("synchronizing the stream"))
    }
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("ordinal", &self.ordinal)
            .field("name", &self.name)
            .field("arch", &self.kernels.arch())
            .finish()
    }
}

/// Page-locked host memory that [`Device::read`] copies device values into.
pub struct Readback<T> {
    buf: PinnedHostSlice<T>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::testing::device;

    #[test]
    #[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
    fn gpu_read_copies_into_page_locked_memory_and_refuses_other_lengths() {
        let dev = device();
        let src = dev.upload(DType::U32, &[3], &[7u32, 8, 9]).unwrap();
        let mut three = dev.readback::<u32>(3).unwrap();
        assert_eq!(dev.read(&src, &mut three).unwrap(), [7, 8, 9]);
        let mut two = dev.readback::<u32>(2).unwrap();
        let err = dev.read(&src, &mut two).unwrap_err().to_string();
        assert!(
            err.contains("3 elements") && err.contains("host buffer 2"),
            "{err}"
        );
    }

    #[test]
    #[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
    fn gpu_a_plain_device_refuses_timeline_calls_by_name() {
        let dev = device();
        for err in [
            dev.timeline_clear().unwrap_err(),
            dev.timeline_records().unwrap_err(),
        ] {
            let err = err.to_string();
            assert!(err.contains("not opened with a timeline"), "{err}");
        }
    }

    #[test]
    #[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
    fn gpu_copy_and_write_take_their_tensor_s_length_only() {
        let dev = device();
        // Pool tensors, whose views are tensors too.
        let mut pool = crate::gpu::BufferPool::new();
        let (a, b) = (
            pool.reserve::<u32>("src", DType::U32, &[4]).unwrap(),
            pool.reserve::<u32>("dst", DType::U32, &[4]).unwrap(),
        );
        pool.seal(&dev).unwrap();
        let (mut src, mut dst) = (pool.take(a).unwrap(), pool.take(b).unwrap());
        dev.write(&mut src, &[1, 2, 3, 4]).unwrap();
        dev.copy(&src.view(1, &[2]).unwrap(), &mut dst.view(2, &[2]).unwrap())
            .unwrap();
        dev.write(&mut dst.view(0, &[2]).unwrap(), &[5, 6]).unwrap();
        assert_eq!(dev.download(&dst).unwrap(), [5, 6, 2, 3]);
        let err = dev.copy(&src, &mut dst.view(0, &[3]).unwrap());
        let err = err.unwrap_err().to_string();
        assert!(
            err.contains("copy") && err.contains("holds 3 elements, got 4"),
            "{err}"
        );
        let err = dev.write(&mut dst, &[1, 2]).unwrap_err().to_string();
        assert!(
            err.contains("write") && err.contains("holds 4 elements, got 2"),
            "{err}"
        );
    }
}
