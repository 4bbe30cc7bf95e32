use std::mem::ManuallyDrop;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaViewMut, DevicePtr, DeviceRepr, ValidAsZeroBits};
use half::{bf16, f16};

use super::GpuError;

/// The logical element type of a tensor. Byte-coded formats are stored as `u8`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    BF16,
    /// IEEE half precision.
    F16,
    F32,
    I32,
    U32,
    U8,
    /// FP8 e4m3fn codes.
    E4M3,
    /// ue8m0 scale bytes.
    E8M0,
    /// Two e2m1 codes per byte, element 2k in the low nibble; shapes count bytes.
    E2M1x2,
}

impl DType {
    pub fn size_bytes(self) -> usize {
        match self {
            DType::BF16 | DType::F16 => 2,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::U8 | DType::E4M3 | DType::E8M0 | DType::E2M1x2 => 1,
        }
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A Rust storage type for device tensors and the dtypes it may carry.
pub trait DeviceElem:
    DeviceRepr + ValidAsZeroBits + bytemuck::Pod + Default + Send + Sync + 'static + sealed::Sealed
{
    const DTYPES: &'static [DType];
}

macro_rules! elem {
    ($t:ty, $($d:expr),+) => {
        impl sealed::Sealed for $t {}
        impl DeviceElem for $t {
            const DTYPES: &'static [DType] = &[$($d),+];
        }
    };
}
elem!(bf16, DType::BF16);
elem!(f16, DType::F16);
elem!(f32, DType::F32);
elem!(i32, DType::I32);
elem!(u32, DType::U32);
elem!(u8, DType::U8, DType::E4M3, DType::E8M0, DType::E2M1x2);

pub(crate) fn check_elem<T: DeviceElem>(what: &str, dtype: DType) -> Result<(), GpuError> {
    if T::DTYPES.contains(&dtype) {
        Ok(())
    } else {
        Err(GpuError::invalid(
            what,
            format!(
                "dtype {dtype:?} cannot be stored as {}",
                std::any::type_name::<T>()
            ),
        ))
    }
}

pub(crate) fn numel(what: &str, shape: &[usize]) -> Result<usize, GpuError> {
    shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| GpuError::invalid(what, format!("shape {shape:?} overflows")))
}

enum Storage<T> {
    Owned(CudaSlice<T>),
    /// A range of a [`BufferPool`](super::BufferPool) allocation. The slice does not own its
    /// memory (it is leaked on drop); `_backing` keeps the allocation alive.
    Pooled {
        slice: ManuallyDrop<CudaSlice<T>>,
        _backing: Arc<CudaSlice<u8>>,
    },
}

/// A typed, shaped, contiguous (row-major) device buffer.
pub struct DeviceTensor<T> {
    dtype: DType,
    shape: Vec<usize>,
    storage: Storage<T>,
}

impl<T: DeviceElem> DeviceTensor<T> {
    pub(crate) fn owned(dtype: DType, shape: Vec<usize>, slice: CudaSlice<T>) -> DeviceTensor<T> {
        DeviceTensor {
            dtype,
            shape,
            storage: Storage::Owned(slice),
        }
    }

    pub(crate) fn pooled(
        dtype: DType,
        shape: Vec<usize>,
        slice: CudaSlice<T>,
        backing: Arc<CudaSlice<u8>>,
    ) -> DeviceTensor<T> {
        DeviceTensor {
            dtype,
            shape,
            storage: Storage::Pooled {
                slice: ManuallyDrop::new(slice),
                _backing: backing,
            },
        }
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn len(&self) -> usize {
        self.slice().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn num_bytes(&self) -> usize {
        self.len() * std::mem::size_of::<T>()
    }

    /// The underlying slice, e.g. as a kernel argument.
    pub fn slice(&self) -> &CudaSlice<T> {
        match &self.storage {
            Storage::Owned(s) => s,
            Storage::Pooled { slice, .. } => slice,
        }
    }

    /// A mutable view, for kernel outputs and copies into the tensor.
    pub fn view_mut(&mut self) -> CudaViewMut<'_, T> {
        match &mut self.storage {
            Storage::Owned(s) => s.as_view_mut(),
            Storage::Pooled { slice, .. } => slice.as_view_mut(),
        }
    }

    /// The device address of the first element. Pool tensors keep theirs for life, which is
    /// what CUDA graph replays rely on.
    pub fn device_address(&self) -> u64 {
        let s = self.slice();
        let (ptr, _sync) = s.device_ptr(s.stream());
        ptr
    }

    /// Same data, new shape with the same number of elements.
    pub fn reshape(mut self, shape: &[usize]) -> Result<DeviceTensor<T>, GpuError> {
        if numel("reshape", shape)? != self.len() {
            return Err(GpuError::Shape {
                what: "reshape".to_string(),
                expected: self.shape.clone(),
                found: shape.to_vec(),
            });
        }
        self.shape = shape.to_vec();
        Ok(self)
    }

    /// A tensor of `shape` over this pool tensor's elements from `offset` on: the same device
    /// memory (work on it is ordered by the one stream), so fixed-address buffers sized for the
    /// largest chunk serve every chunk length, and a row of a batch can be read alone.
    pub fn view(&self, offset: usize, shape: &[usize]) -> Result<DeviceTensor<T>, GpuError> {
        let Storage::Pooled { slice, _backing } = &self.storage else {
            return Err(GpuError::invalid("view", "only pool tensors have views"));
        };
        let n = numel("view", shape)?;
        if offset.checked_add(n).is_none_or(|end| end > self.len()) {
            return Err(GpuError::invalid(
                "view",
                format!(
                    "{shape:?} from element {offset} lies outside a tensor of shape {:?}",
                    self.shape
                ),
            ));
        }
        let (ptr, _sync) = slice.device_ptr(slice.stream());
        let start = ptr + (offset * std::mem::size_of::<T>()) as u64;
        // SAFETY: [start, start + n) lies inside this tensor's range of the live pool
        // allocation, which the view keeps alive through `_backing`; the view leaks its slice on
        // drop instead of freeing it.
        let view = unsafe { slice.stream().upgrade_device_ptr::<T>(start, n) };
        Ok(DeviceTensor::pooled(
            self.dtype,
            shape.to_vec(),
            view,
            _backing.clone(),
        ))
    }

    /// The first `rows` rows of a pool tensor `[R, ...]`, as `[rows, ...]`.
    pub fn rows(&self, rows: usize) -> Result<DeviceTensor<T>, GpuError> {
        let mut shape = self.shape.clone();
        match shape.first_mut() {
            Some(r) => *r = rows,
            None => {
                return Err(GpuError::invalid(
                    "rows view",
                    "a scalar tensor has no rows",
                ))
            }
        }
        self.view(0, &shape)
    }

    pub(crate) fn expect(&self, what: &str, dtype: DType, shape: &[usize]) -> Result<(), GpuError> {
        if self.dtype != dtype {
            return Err(GpuError::DType {
                what: what.to_string(),
                expected: dtype,
                found: self.dtype,
            });
        }
        if self.shape != shape {
            return Err(GpuError::Shape {
                what: what.to_string(),
                expected: shape.to_vec(),
                found: self.shape.clone(),
            });
        }
        Ok(())
    }

    /// `(rows, cols)` of a 2-D tensor of `dtype`.
    pub(crate) fn dims2(&self, what: &str, dtype: DType) -> Result<(usize, usize), GpuError> {
        match self.shape[..] {
            [r, c] => {
                self.expect(what, dtype, &[r, c])?;
                Ok((r, c))
            }
            _ => Err(GpuError::invalid(
                what,
                format!("expected a 2-D tensor, got shape {:?}", self.shape),
            )),
        }
    }
}

impl<T> Drop for DeviceTensor<T> {
    fn drop(&mut self) {
        if let Storage::Pooled { slice, .. } = &mut self.storage {
            // SAFETY: taken exactly once, here; the pool allocation outlives this range
            // and is freed only by its own CudaSlice.
            let slice = unsafe { ManuallyDrop::take(slice) };
            slice.leak();
        }
    }
}

impl<T> std::fmt::Debug for DeviceTensor<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let pooled = matches!(self.storage, Storage::Pooled { .. });
        f.debug_struct("DeviceTensor")
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .field("pooled", &pooled)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn storage_types_accept_their_dtypes_only() {
        assert!(check_elem::<u8>("t", DType::E2M1x2).is_ok());
        assert!(check_elem::<u8>("t", DType::E4M3).is_ok());
        assert!(check_elem::<u8>("t", DType::BF16).is_err());
        assert!(check_elem::<bf16>("t", DType::BF16).is_ok());
        assert!(check_elem::<f16>("t", DType::F16).is_ok());
        assert!(check_elem::<f16>("t", DType::BF16).is_err());
        assert!(check_elem::<f32>("t", DType::I32).is_err());
        for d in [
            DType::BF16,
            DType::F16,
            DType::F32,
            DType::I32,
            DType::U32,
            DType::U8,
        ] {
            let size = match d {
                DType::BF16 => std::mem::size_of::<bf16>(),
                DType::F16 => std::mem::size_of::<f16>(),
                DType::F32 | DType::I32 | DType::U32 => 4,
                _ => 1,
            };
            assert_eq!(d.size_bytes(), size);
        }
    }

    #[test]
    fn numel_rejects_overflow() {
        assert_eq!(numel("t", &[]).unwrap(), 1);
        assert_eq!(numel("t", &[3, 0, 5]).unwrap(), 0);
        assert_eq!(numel("t", &[7, 584]).unwrap(), 4088);
        assert!(numel("t", &[usize::MAX, 2]).is_err());
    }
}
