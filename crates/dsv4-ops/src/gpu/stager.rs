//! Host bytes to the device at copy-engine speed, for loading weights: host memory is copied
//! (by all cores) into one of two page-locked buffers while the other one's asynchronous copy
//! to the device runs, so reading the checkpoint and the PCIe transfer overlap. Bytes either go
//! straight to their tensor, or to a device scratch buffer that a re-layout kernel
//! ([`super::relayout`]) reads on the same stream.

use std::ops::Range;

use cudarc::driver::{result, CudaEvent, PinnedHostSlice};
use rayon::prelude::*;

use super::{DType, Device, DeviceElem, DeviceTensor, GpuError};

/// Bytes per page-locked buffer (and per scratch buffer) of a loader.
pub const SLOT_BYTES: usize = 64 << 20;
/// Bytes one core copies at a time when filling a buffer.
const PIECE: usize = 4 << 20;

struct Slot {
    host: PinnedHostSlice<u8>,
    scratch: DeviceTensor<u8>,
    /// Recorded after the copy out of `host`: `host` may be refilled once it completes.
    copied: CudaEvent,
}

/// Two page-locked buffers and two device scratch buffers of [`Self::slot_bytes`] each, on one
/// device's stream.
pub struct Stager<'d> {
    dev: &'d Device,
    slots: [Slot; 2],
    next: usize,
    moved: u64,
    on_sent: Option<&'d (dyn Fn(u64) + Sync)>,
}

/// Copies bytes `range` of the concatenation of `parts` into `out` (`out.len() == range.len()`).
fn gather(parts: &[&[u8]], range: Range<usize>, out: &mut [u8]) {
    let (mut start, mut at) = (0, 0);
    for p in parts {
        let end = start + p.len();
        let (lo, hi) = (range.start.max(start), range.end.min(end));
        if lo < hi {
            out[at..at + hi - lo].copy_from_slice(&p[lo - start..hi - start]);
            at += hi - lo;
        }
        start = end;
    }
    debug_assert_eq!(at, out.len());
}

impl<'d> Stager<'d> {
    /// Buffers of `slot_bytes` each (at least 16): page-locked on the host, plain on `dev`.
    pub fn new(dev: &'d Device, slot_bytes: usize) -> Result<Stager<'d>, GpuError> {
        let slot_bytes = slot_bytes.max(16).next_multiple_of(16);
        let slot = || -> Result<Slot, GpuError> {
            // SAFETY: plain page-locked memory (not write-combined: it is also read when a
            // re-layout falls back to the host), written before it is read.
            let host = unsafe { dev.context().alloc_pinned_with_flags::<u8>(slot_bytes, 0) }
                .map_err(GpuError::driver(format!(
                    "allocating {slot_bytes} bytes of page-locked host memory"
                )))?;
            Ok(Slot {
                host,
                scratch: dev.alloc::<u8>(DType::U8, &[slot_bytes])?,
                copied: dev
                    .context()
                    .new_event(None)
                    .map_err(GpuError::driver("creating an event"))?,
            })
        };
        Ok(Stager {
            dev,
            slots: [slot()?, slot()?],
            next: 0,
            moved: 0,
            on_sent: None,
        })
    }

    /// A stager for a load of `bytes` in all: buffers no larger than needed.
    pub fn for_bytes(dev: &'d Device, bytes: usize) -> Result<Stager<'d>, GpuError> {
        Stager::new(dev, bytes.min(SLOT_BYTES))
    }

    /// Calls `f(bytes)` after each copy it issues (progress reports).
    pub fn on_sent(mut self, f: &'d (dyn Fn(u64) + Sync)) -> Stager<'d> {
        self.on_sent = Some(f);
        self
    }

    pub fn device(&self) -> &'d Device {
        self.dev
    }

    /// The most bytes one [`Self::stage`] takes.
    pub fn slot_bytes(&self) -> usize {
        self.slots[0].host.len()
    }

    /// Bytes copied to the device so far.
    pub fn moved(&self) -> u64 {
        self.moved
    }

    /// Fills the next page-locked buffer with `pieces` (one after another) and copies them to
    /// device address `dst` on the stream. Returns the slot used.
    fn send(&mut self, pieces: &[&[u8]], dst: u64) -> Result<usize, GpuError> {
        let len: usize = pieces.iter().map(|p| p.len()).sum();
        if len > self.slot_bytes() {
            return Err(GpuError::invalid(
                "staging",
                format!(
                    "{len} bytes at once, more than the {} a buffer holds",
                    self.slot_bytes()
                ),
            ));
        }
        let i = self.next;
        self.next = 1 - i;
        let slot = &mut self.slots[i];
        slot.copied
            .synchronize()
            .map_err(GpuError::driver("waiting for a staging copy"))?;
        let host = slot
            .host
            .as_mut_slice()
            .map_err(GpuError::driver("mapping page-locked memory"))?;
        host[..len]
            .par_chunks_mut(PIECE)
            .enumerate()
            .for_each(|(k, out)| {
                let lo = k * PIECE;
                gather(pieces, lo..lo + out.len(), out);
            });
        let stream = self.dev.stream();
        stream
            .context()
            .bind_to_thread()
            .map_err(GpuError::driver("binding the context"))?;
        // SAFETY: `dst` holds `len` bytes (the callers' checks); the host bytes stay untouched
        // until `copied` completes, which is waited for before the buffer is refilled or freed.
        unsafe { result::memcpy_htod_async(dst, &host[..len], stream.cu_stream()) }.map_err(
            GpuError::driver(format!("copying {len} bytes to the device")),
        )?;
        slot.copied
            .record(stream)
            .map_err(GpuError::driver("recording an event"))?;
        self.moved += len as u64;
        if let Some(f) = self.on_sent {
            f(len as u64);
        }
        Ok(i)
    }

    /// Copies `pieces` (one after another, at most [`Self::slot_bytes`] in all) to a scratch
    /// buffer and returns it. It holds them for the launches issued on the device's stream until
    /// the next-but-one call.
    pub fn stage(&mut self, pieces: &[&[u8]]) -> Result<&DeviceTensor<u8>, GpuError> {
        let dst = self.slots[self.next].scratch.device_address();
        let i = self.send(pieces, dst)?;
        Ok(&self.slots[i].scratch)
    }

    /// Copies `data` into `dst` from element `at` on.
    pub fn copy<T: DeviceElem>(
        &mut self,
        data: &[T],
        dst: &mut DeviceTensor<T>,
        at: usize,
    ) -> Result<(), GpuError> {
        if at.checked_add(data.len()).is_none_or(|end| end > dst.len()) {
            return Err(GpuError::invalid(
                "copy",
                format!(
                    "{} elements at {at} into a tensor of {}",
                    data.len(),
                    dst.len()
                ),
            ));
        }
        let bytes: &[u8] = bytemuck::cast_slice(data);
        let base = dst.device_address() + (at * std::mem::size_of::<T>()) as u64;
        let step = self.slot_bytes();
        let mut done = 0;
        while done < bytes.len() {
            let len = step.min(bytes.len() - done);
            self.send(&[&bytes[done..done + len]], base + done as u64)?;
            done += len;
        }
        Ok(())
    }

    /// A new tensor holding `data`.
    pub fn upload<T: DeviceElem>(
        &mut self,
        dtype: DType,
        shape: &[usize],
        data: &[T],
    ) -> Result<DeviceTensor<T>, GpuError> {
        let mut t = self.dev.alloc::<T>(dtype, shape)?;
        if t.len() != data.len() {
            return Err(GpuError::invalid(
                "upload",
                format!(
                    "shape {shape:?} needs {} elements, got {}",
                    t.len(),
                    data.len()
                ),
            ));
        }
        self.copy(data, &mut t, 0)?;
        Ok(t)
    }
}

impl Drop for Stager<'_> {
    fn drop(&mut self) {
        // The page-locked buffers must outlive their copies (their own drop waits on an event
        // that is never recorded here).
        for s in &self.slots {
            let _ = s.copied.synchronize();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gather_reads_ranges_across_parts() {
        let parts: [&[u8]; 3] = [&[0, 1, 2], &[], &[3, 4, 5, 6]];
        let mut out = [0u8; 4];
        gather(&parts, 1..5, &mut out);
        assert_eq!(out, [1, 2, 3, 4]);
        let mut out = [0u8; 2];
        gather(&parts, 5..7, &mut out);
        assert_eq!(out, [5, 6]);
    }
}
