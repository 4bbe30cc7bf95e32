//! The device copy bandwidth that decode kernels are measured against: a device-to-device
//! `cuMemcpy` of a large buffer, timed with CUDA events, counting the bytes read and written.

use cudarc::driver::sys::CUevent_flags;

use super::{DType, Device, GpuError};

/// One measurement: `bytes` copied per repetition, the median time, and the rate counting read
/// plus written bytes (`2 * bytes / seconds`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CopyBandwidth {
    pub bytes: usize,
    pub median_seconds: f64,
    pub bytes_per_second: f64,
}

/// Copies a `bytes`-sized buffer `reps` times (after one warm-up copy) and reports the median.
/// Use at least 1 GiB so that the L2 cache plays no part.
pub fn measure_copy_bandwidth(
    dev: &Device,
    bytes: usize,
    reps: usize,
) -> Result<CopyBandwidth, GpuError> {
    if bytes == 0 || reps == 0 {
        return Err(GpuError::invalid(
            "copy bandwidth",
            "bytes and reps must be positive",
        ));
    }
    let mut src = dev.alloc::<u8>(DType::U8, &[bytes])?;
    let mut dst = dev.alloc::<u8>(DType::U8, &[bytes])?;
    // Non-zero source data.
    dev.fill_bytes(&mut src, 0x5a)?;
    let stream = dev.stream();
    let ev = || {
        dev.context()
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(GpuError::driver("creating a timing event"))
    };
    let (start, end) = (ev()?, ev()?);
    let copy = |dst: &mut super::DeviceTensor<u8>| {
        let mut view = dst.view_mut();
        stream
            .memcpy_dtod(src.slice(), &mut view)
            .map_err(GpuError::driver("copying device to device"))
    };
    copy(&mut dst)?;
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        start
            .record(stream)
            .map_err(GpuError::driver("recording an event"))?;
        copy(&mut dst)?;
        end.record(stream)
            .map_err(GpuError::driver("recording an event"))?;
        let ms = start
            .elapsed_ms(&end)
            .map_err(GpuError::driver("reading an event timer"))?;
        times.push(ms as f64 * 1e-3);
    }
    times.sort_by(f64::total_cmp);
    let median_seconds = times[times.len() / 2];
    Ok(CopyBandwidth {
        bytes,
        median_seconds,
        bytes_per_second: 2.0 * bytes as f64 / median_seconds,
    })
}
