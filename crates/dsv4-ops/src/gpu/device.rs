use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaFunction, CudaStream};
use dsv4_kernels::{driver_available, Arch, KernelCache, Kernels};

use super::tensor::{check_elem, numel};
use super::{DType, DeviceElem, DeviceTensor, GpuError};

/// Resident blocks per multiprocessor by kernel name, then (threads, dynamic shared bytes).
type Occupancy = HashMap<String, HashMap<(u32, u32), u32>>;

/// One GPU: its context, the single stream all work is issued on, and the loaded kernels.
///
/// Event tracking is disabled before anything is allocated, so cudarc never records or waits
/// on per-buffer events: all work is ordered by the one stream, and launches on it can be
/// captured into CUDA graphs (the context's legacy default stream cannot be).
pub struct Device {
    ordinal: usize,
    name: String,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    kernels: Kernels,
    /// The launchers size every eager launch with occupancy answers, and the driver computes
    /// each anew: they are kept here.
    occupancy: Mutex<Occupancy>,
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
        let name = ctx
            .name()
            .map_err(GpuError::driver("reading the device name"))?;
        let kernels = Kernels::load_with(&ctx, cache)?;
        Ok(Device {
            ordinal,
            name,
            ctx,
            stream,
            kernels,
            occupancy: Mutex::default(),
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

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn kernels(&self) -> &Kernels {
        &self.kernels
    }

    pub fn function(&self, name: &str) -> Result<&CudaFunction, GpuError> {
        Ok(self.kernels.function(name)?)
    }

    /// Blocks of `kernel` resident on one multiprocessor at `threads` per block with `dynamic`
    /// bytes of dynamic shared memory (asked of the driver once per combination).
    pub(crate) fn resident_blocks(
        &self,
        kernel: &str,
        threads: u32,
        dynamic: u32,
    ) -> Result<u32, GpuError> {
        let known = |map: &Occupancy| {
            map.get(kernel)
                .and_then(|by_size| by_size.get(&(threads, dynamic)))
                .copied()
        };
        if let Some(blocks) = known(&self.occupancy.lock().unwrap_or_else(|e| e.into_inner())) {
            return Ok(blocks);
        }
        let blocks = self
            .function(kernel)?
            .occupancy_max_active_blocks_per_multiprocessor(threads, dynamic as usize, None)
            .map_err(GpuError::driver(format!(
                "reading the occupancy of {kernel}"
            )))?;
        self.occupancy
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(kernel.to_string())
            .or_default()
            .insert((threads, dynamic), blocks);
        Ok(blocks)
    }

    /// A zero-filled tensor with its own allocation (weights, tests). Activations and
    /// workspaces belong in a [`BufferPool`](super::BufferPool).
    pub fn alloc<T: DeviceElem>(
        &self,
        dtype: DType,
        shape: &[usize],
    ) -> Result<DeviceTensor<T>, GpuError> {
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
        if dst.len() != data.len() {
            return Err(GpuError::invalid(
                "write",
                format!("tensor holds {} elements, got {}", dst.len(), data.len()),
            ));
        }
        let mut view = dst.view_mut();
        self.stream
            .memcpy_htod(data, &mut view)
            .map_err(GpuError::driver("copying to the device"))
    }

    /// Waits for the stream and copies the tensor to the host.
    pub fn download<T: DeviceElem>(&self, src: &DeviceTensor<T>) -> Result<Vec<T>, GpuError> {
        let mut out = vec![T::default(); src.len()];
        self.stream
            .memcpy_dtoh(src.slice(), &mut out[..])
            .map_err(GpuError::driver("copying to the host"))?;
        self.synchronize()?;
        Ok(out)
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

    pub fn synchronize(&self) -> Result<(), GpuError> {
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
