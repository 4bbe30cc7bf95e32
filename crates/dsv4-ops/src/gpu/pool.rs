//! Activation and workspace memory reserved once, at fixed addresses.
//!
//! Buffers are reserved by name while the pool is open; [`BufferPool::seal`] then makes one
//! device allocation and carves it into the reserved buffers. After sealing the layout is
//! frozen: a further reservation is an error, not a hidden `cudaMalloc`, and every buffer keeps
//! its address for the life of the pool, as captured CUDA graphs require.

use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cudarc::driver::{CudaSlice, DevicePtr};

use super::tensor::{check_elem, numel};
use super::{DType, Device, DeviceElem, DeviceTensor, GpuError};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    #[error("buffer pool is sealed: cannot reserve `{name}` ({bytes} bytes)")]
    Sealed { name: String, bytes: usize },
    #[error("buffer pool is not sealed yet: cannot hand out `{name}`")]
    NotSealed { name: String },
    #[error("buffer pool is already sealed")]
    AlreadySealed,
    #[error("buffer `{name}` is reserved twice")]
    DuplicateName { name: String },
    #[error("buffer `{name}` is too large to reserve")]
    TooLarge { name: String },
    #[error("reservation `{name}` belongs to another pool")]
    ForeignReservation { name: String },
    #[error("no buffer `{name}` of {dtype:?} {shape:?} is reserved in this pool")]
    NotReserved {
        name: String,
        dtype: DType,
        shape: Vec<usize>,
    },
    #[error("buffer `{name}` is taken twice")]
    TakenTwice { name: String },
}

/// A reserved buffer, redeemed once with [`BufferPool::take`] after sealing.
#[must_use = "a reservation is only useful when taken from the sealed pool"]
#[derive(Debug)]
pub struct Reservation<T> {
    pool: u64,
    index: usize,
    name: String,
    _elem: PhantomData<fn() -> T>,
}

/// Where a buffer lives in the pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BufferInfo {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub offset: usize,
    pub bytes: usize,
}

enum State {
    Open,
    /// Layout frozen; `backing` is set once the allocation succeeded.
    Sealed(Option<Arc<CudaSlice<u8>>>),
}

pub struct BufferPool {
    id: u64,
    buffers: Vec<BufferInfo>,
    /// Whether each buffer was handed out by [`BufferPool::take_named`].
    taken: Vec<bool>,
    end: usize,
    state: State,
}

static NEXT_POOL_ID: AtomicU64 = AtomicU64::new(1);

impl Default for BufferPool {
    fn default() -> Self {
        BufferPool::new()
    }
}

impl BufferPool {
    /// Alignment of every buffer: enough for 16-byte vector accesses, TMA and 128-byte
    /// shared-memory swizzles.
    pub const ALIGN: usize = 256;

    pub fn new() -> BufferPool {
        BufferPool {
            id: NEXT_POOL_ID.fetch_add(1, Ordering::Relaxed),
            buffers: Vec::new(),
            taken: Vec::new(),
            end: 0,
            state: State::Open,
        }
    }

    /// Reserves a buffer of `shape` elements of `dtype`.
    pub fn reserve<T: DeviceElem>(
        &mut self,
        name: &str,
        dtype: DType,
        shape: &[usize],
    ) -> Result<Reservation<T>, GpuError> {
        check_elem::<T>(name, dtype)?;
        let too_large = || PoolError::TooLarge {
            name: name.to_string(),
        };
        let bytes = numel(name, shape)?
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(too_large)?;
        if let State::Sealed(_) = self.state {
            return Err(PoolError::Sealed {
                name: name.to_string(),
                bytes,
            }
            .into());
        }
        if self.buffers.iter().any(|b| b.name == name) {
            return Err(PoolError::DuplicateName {
                name: name.to_string(),
            }
            .into());
        }
        let offset = self
            .end
            .checked_next_multiple_of(Self::ALIGN)
            .ok_or_else(too_large)?;
        self.end = offset.checked_add(bytes).ok_or_else(too_large)?;
        self.buffers.push(BufferInfo {
            name: name.to_string(),
            dtype,
            shape: shape.to_vec(),
            offset,
            bytes,
        });
        self.taken.push(false);
        Ok(Reservation {
            pool: self.id,
            index: self.buffers.len() - 1,
            name: name.to_string(),
            _elem: PhantomData,
        })
    }

    /// Bytes the single allocation will take.
    pub fn total_bytes(&self) -> usize {
        self.end.next_multiple_of(Self::ALIGN).max(Self::ALIGN)
    }

    pub fn buffers(&self) -> &[BufferInfo] {
        &self.buffers
    }

    pub fn is_sealed(&self) -> bool {
        matches!(self.state, State::Sealed(_))
    }

    fn freeze(&mut self) -> Result<(), PoolError> {
        match self.state {
            State::Open => {
                self.state = State::Sealed(None);
                Ok(())
            }
            State::Sealed(_) => Err(PoolError::AlreadySealed),
        }
    }

    /// Freezes the layout and makes the one allocation (zero-filled) on `device`.
    pub fn seal(&mut self, device: &Device) -> Result<(), GpuError> {
        self.freeze()?;
        let backing = device
            .stream()
            .alloc_zeros::<u8>(self.total_bytes())
            .map_err(GpuError::driver(format!(
                "allocating the {}-byte buffer pool",
                self.total_bytes()
            )))?;
        self.state = State::Sealed(Some(Arc::new(backing)));
        Ok(())
    }

    /// The tensor for a reservation. Its address is fixed for the life of the allocation.
    pub fn take<T: DeviceElem>(&mut self, r: Reservation<T>) -> Result<DeviceTensor<T>, GpuError> {
        if r.pool != self.id {
            return Err(PoolError::ForeignReservation { name: r.name }.into());
        }
        let backing = match &self.state {
            State::Sealed(Some(b)) => b.clone(),
            _ => return Err(PoolError::NotSealed { name: r.name }.into()),
        };
        let info = &self.buffers[r.index];
        let base = {
            let (ptr, _sync) = backing.device_ptr(backing.stream());
            ptr
        };
        let len = info.bytes / std::mem::size_of::<T>();
        // SAFETY: [base + offset, + bytes) lies inside the live pool allocation (the layout
        // was fixed before allocating) and is handed out once, since reservations are not
        // Clone. The tensor leaks this slice on drop instead of freeing it.
        let slice = unsafe {
            backing
                .stream()
                .upgrade_device_ptr::<T>(base + info.offset as u64, len)
        };
        Ok(DeviceTensor::pooled(
            info.dtype,
            info.shape.clone(),
            slice,
            backing,
        ))
    }
}

impl BufferPool {
    /// The buffer reserved as `name` with exactly `dtype` and `shape`, once, after sealing:
    /// a sizing pass reserves by name and a second pass over the same code takes the buffers.
    pub fn take_named<T: DeviceElem>(
        &mut self,
        name: &str,
        dtype: DType,
        shape: &[usize],
    ) -> Result<DeviceTensor<T>, GpuError> {
        let index = self
            .buffers
            .iter()
            .position(|b| b.name == name && b.dtype == dtype && b.shape == shape)
            .ok_or_else(|| PoolError::NotReserved {
                name: name.to_string(),
                dtype,
                shape: shape.to_vec(),
            })?;
        if self.taken[index] {
            return Err(PoolError::TakenTwice {
                name: name.to_string(),
            }
            .into());
        }
        let tensor = self.take(Reservation {
            pool: self.id,
            index,
            name: name.to_string(),
            _elem: PhantomData,
        })?;
        self.taken[index] = true;
        Ok(tensor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn layout_is_aligned_ordered_and_disjoint() {
        let mut pool = BufferPool::new();
        let _a = pool.reserve::<bf16>("a", DType::BF16, &[3, 5]).unwrap();
        let _b = pool.reserve::<u8>("b", DType::E2M1x2, &[7, 300]).unwrap();
        let _c = pool.reserve::<f32>("c", DType::F32, &[1]).unwrap();
        let _d = pool.reserve::<u8>("empty", DType::U8, &[0, 4]).unwrap();
        let bufs = pool.buffers();
        assert_eq!(
            bufs.iter().map(|b| b.bytes).collect::<Vec<_>>(),
            vec![30, 2100, 4, 0]
        );
        for w in bufs.windows(2) {
            assert!(w[0].offset + w[0].bytes <= w[1].offset);
        }
        assert!(bufs.iter().all(|b| b.offset % BufferPool::ALIGN == 0));
        assert_eq!(bufs[1].offset, 256);
        assert_eq!(bufs[2].offset, 256 + 2304);
        assert_eq!(pool.total_bytes(), 256 + 2304 + 256);
    }

    #[test]
    fn reserving_after_seal_is_an_error() {
        let mut pool = BufferPool::new();
        let _a = pool.reserve::<f32>("a", DType::F32, &[8]).unwrap();
        pool.freeze().unwrap();
        let err = pool
            .reserve::<bf16>("late", DType::BF16, &[4, 4])
            .unwrap_err();
        assert!(matches!(
            err,
            GpuError::Pool(PoolError::Sealed { ref name, bytes: 32 }) if name == "late"
        ));
        assert_eq!(pool.freeze(), Err(PoolError::AlreadySealed));
        assert_eq!(pool.buffers().len(), 1);
    }

    #[test]
    fn bad_reservations_are_errors() {
        let mut pool = BufferPool::new();
        let a = pool.reserve::<f32>("a", DType::F32, &[8]).unwrap();
        assert!(matches!(
            pool.reserve::<f32>("a", DType::F32, &[1]),
            Err(GpuError::Pool(PoolError::DuplicateName { .. }))
        ));
        assert!(pool.reserve::<f32>("x", DType::BF16, &[1]).is_err());
        assert!(pool
            .reserve::<u32>("huge", DType::U32, &[usize::MAX / 2, 1])
            .is_err());
        // Taking before sealing, or from another pool.
        assert!(matches!(
            pool.take(a),
            Err(GpuError::Pool(PoolError::NotSealed { .. }))
        ));
        let mut other = BufferPool::new();
        let b = other.reserve::<f32>("b", DType::F32, &[8]).unwrap();
        pool.freeze().unwrap();
        assert!(matches!(
            pool.take(b),
            Err(GpuError::Pool(PoolError::ForeignReservation { .. }))
        ));
    }

    #[test]
    fn take_named_checks_name_shape_and_once() {
        let mut pool = BufferPool::new();
        let _ = pool.reserve::<f32>("a", DType::F32, &[2, 3]).unwrap();
        pool.freeze().unwrap();
        type Expected = fn(&GpuError) -> bool;
        let not_reserved: Expected = |e| matches!(e, GpuError::Pool(PoolError::NotReserved { .. }));
        let cases: [(&str, [usize; 2], Expected); 3] = [
            ("a", [3, 2], not_reserved),
            ("b", [2, 3], not_reserved),
            // Frozen without an allocation: the buffer cannot be handed out yet.
            ("a", [2, 3], |e| {
                matches!(e, GpuError::Pool(PoolError::NotSealed { .. }))
            }),
        ];
        for (name, shape, expected) in cases {
            let err = pool
                .take_named::<f32>(name, DType::F32, &shape)
                .unwrap_err();
            assert!(expected(&err), "{name} {shape:?}: {err}");
        }
    }
}
