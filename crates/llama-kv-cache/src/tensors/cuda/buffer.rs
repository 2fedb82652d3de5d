//! [`CudaBuffer`]: a [`KvBuffer`] in the memory of one CUDA device.

use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use cudarc::driver::{result as cu, sys};

use super::device::{device_state, staging_threshold, DeviceState, FALLBACKS_2D, STAGING_CHUNK};
use super::guard::{drv, guarded};
use crate::error::{KvError, Result};
use crate::tensors::storage::{Device, KvBuffer};

/// Overlapping device-to-device copies whose source and destination are at least this far apart
/// are done as a sequence of disjoint copies; closer ones go through a temporary buffer.
const MIN_CHUNKED_OVERLAP: usize = 64 << 10;

/// Device memory of one CUDA device holding one tensor.
///
/// Every operation binds the device's context to the calling thread first, queues its work on
/// the device's stream, and reports driver errors and cudarc panics as
/// `KvError::Backend("CUDA ...")`.
pub struct CudaBuffer {
    pub(super) dev: Arc<DeviceState>,
    pub(super) ptr: sys::CUdeviceptr,
    len: usize,
}

impl std::fmt::Debug for CudaBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBuffer")
            .field("device", &self.device())
            .field("len", &self.len)
            .finish()
    }
}

/// Copies of at least this many bytes between user memory and a pinned buffer are split over
/// several threads (one core's memcpy is slower than a PCIe 5 DMA).
const PAR_COPY_MIN: usize = 4 << 20;

/// Most threads used for one such copy.
const PAR_COPY_THREADS: usize = 4;

/// `dst[..n] = src[..n]` for raw, non-overlapping ranges, on several threads when large.
///
/// # Safety
/// `src` and `dst` must be valid for `n` bytes and not overlap.
unsafe fn par_copy(src: *const u8, dst: *mut u8, n: usize) {
    let threads = if n >= PAR_COPY_MIN {
        std::thread::available_parallelism()
            .map_or(1, |p| p.get())
            .min(PAR_COPY_THREADS)
    } else {
        1
    };
    if threads <= 1 {
        std::ptr::copy_nonoverlapping(src, dst, n);
        return;
    }
    let part = n.div_ceil(threads);
    let (src, dst) = (src as usize, dst as usize);
    std::thread::scope(|s| {
        for t in 1..threads {
            let off = t * part;
            if off < n {
                let len = part.min(n - off);
                s.spawn(move || {
                    // SAFETY: disjoint sub-ranges of the caller's valid ranges.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            (src + off) as *const u8,
                            (dst + off) as *mut u8,
                            len,
                        )
                    }
                });
            }
        }
        // SAFETY: the first sub-range, on this thread.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, part.min(n)) }
    });
}

/// A place for one side of a 2D copy: base address and pitch in bytes.
#[derive(Clone, Copy)]
enum Loc {
    Device(sys::CUdeviceptr, usize),
    Host(*const u8, usize),
    HostMut(*mut u8, usize),
}

fn check_range(what: &str, offset: usize, len: usize, size: usize) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(KvError::OutOfRange(format!(
            "{what} of {len} bytes at offset {offset} exceeds the buffer size {size}"
        ))),
    }
}

/// Checks a 2D region of `rows` pieces of `width` bytes `pitch` apart starting at `offset`.
fn check_2d(
    what: &str,
    offset: usize,
    width: usize,
    pitch: usize,
    rows: usize,
    size: usize,
) -> Result<()> {
    if rows == 0 || width == 0 {
        return Ok(());
    }
    let span = (rows - 1)
        .checked_mul(pitch)
        .and_then(|s| s.checked_add(width))
        .ok_or_else(|| KvError::OutOfRange(format!("{what}: 2D region overflows")))?;
    check_range(what, offset, span, size)
}

/// Whether the 2D regions at `src` and `dst` (same width, pitch and rows) share a byte.
fn regions_overlap(src: usize, dst: usize, width: usize, pitch: usize, rows: usize) -> bool {
    if rows == 0 || width == 0 {
        return false;
    }
    if rows == 1 || pitch == 0 {
        return src.abs_diff(dst) < width;
    }
    // row r of src meets row r' of dst when |dst - src + (r' - r) * pitch| < width
    let delta = dst as i128 - src as i128;
    let p = pitch as i128;
    let kmax = rows as i128 - 1;
    let k0 = (-delta).div_euclid(p);
    [k0, k0 + 1]
        .into_iter()
        .map(|k| k.clamp(-kmax, kmax))
        .any(|k| (delta + k * p).abs() < width as i128)
}

impl CudaBuffer {
    /// Allocates `len` zeroed bytes on device `ordinal`. Fails with
    /// `KvError::Backend("CUDA unavailable: <reason>")` when CUDA cannot be used.
    pub fn new(ordinal: usize, len: usize) -> Result<CudaBuffer> {
        let dev = device_state(ordinal)?;
        CudaBuffer::on(&dev, len)
    }

    pub(super) fn on(dev: &Arc<DeviceState>, len: usize) -> Result<CudaBuffer> {
        let ptr = if len == 0 {
            0
        } else {
            guarded("allocation", || {
                dev.bind()?;
                // SAFETY: a plain allocation, freed in Drop.
                let ptr = unsafe { cu::malloc_sync(len) }.map_err(|e| {
                    KvError::Backend(format!(
                        "CUDA out of memory? cannot allocate {len} bytes on cuda:{}: {e}",
                        dev.ordinal
                    ))
                })?;
                // SAFETY: `ptr` holds `len` bytes.
                let zeroed = drv("memset", unsafe {
                    cu::memset_d8_async(ptr, 0, len, dev.cu_stream())
                });
                if let Err(e) = zeroed {
                    // SAFETY: just allocated, nothing queued uses it.
                    let _ = unsafe { cu::free_sync(ptr) };
                    return Err(e);
                }
                Ok(ptr)
            })?
        };
        Ok(CudaBuffer {
            dev: dev.clone(),
            ptr,
            len,
        })
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.dev.ordinal
    }

    /// Waits for every operation queued on this buffer's device.
    pub fn synchronize(&self) -> Result<()> {
        guarded("synchronize", || self.dev.synchronize())
    }

    fn at(&self, offset: usize) -> sys::CUdeviceptr {
        self.ptr + offset as u64
    }

    /// One 2D copy of `rows` pieces of `width` bytes, queued on the stream.
    fn memcpy_2d(&self, src: Loc, dst: Loc, width: usize, rows: usize) -> Result<()> {
        use sys::CUmemorytype::{CU_MEMORYTYPE_DEVICE, CU_MEMORYTYPE_HOST};
        let (s_type, s_host, s_dev, s_pitch) = match src {
            Loc::Device(p, pitch) => (CU_MEMORYTYPE_DEVICE, std::ptr::null(), p, pitch),
            Loc::Host(p, pitch) => (CU_MEMORYTYPE_HOST, p as *const c_void, 0, pitch),
            Loc::HostMut(p, pitch) => (CU_MEMORYTYPE_HOST, p as *const c_void, 0, pitch),
        };
        let (d_type, d_host, d_dev, d_pitch) = match dst {
            Loc::Device(p, pitch) => (CU_MEMORYTYPE_DEVICE, std::ptr::null_mut(), p, pitch),
            Loc::HostMut(p, pitch) => (CU_MEMORYTYPE_HOST, p as *mut c_void, 0, pitch),
            Loc::Host(..) => unreachable!("2D copy into a read-only host location"),
        };
        let copy = sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: s_type,
            srcHost: s_host,
            srcDevice: s_dev,
            srcArray: std::ptr::null_mut(),
            srcPitch: s_pitch,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: d_type,
            dstHost: d_host,
            dstDevice: d_dev,
            dstArray: std::ptr::null_mut(),
            dstPitch: d_pitch,
            WidthInBytes: width,
            Height: rows,
        };
        // SAFETY: both regions were bounds-checked by the caller; host memory outlives the copy
        // (callers synchronize before returning or use the pinned staging buffers).
        drv("2D copy", unsafe {
            sys::cuMemcpy2DAsync_v2(&copy, self.dev.cu_stream()).result()
        })
    }

    /// Whether a 2D copy with these pitches can be one driver call.
    fn pitch_ok(&self, pitches: &[usize], width: usize) -> bool {
        pitches
            .iter()
            .all(|&p| p >= width && p <= self.dev.max_pitch)
    }

    /// Downloads `dst.len() / unit` units of `unit` bytes through the pinned buffers: `issue`
    /// queues the copy of units `[first, first + n)` into the host pointer it is given, packed.
    fn download_staged(
        &self,
        unit: usize,
        dst: &mut [u8],
        issue: &dyn Fn(usize, usize, *mut u8) -> Result<()>,
    ) -> Result<()> {
        let dev = &self.dev;
        let stream = dev.cu_stream();
        let mut guard = dev.staging()?;
        let st = guard.as_mut().expect("staging allocated");
        let per = (STAGING_CHUNK / unit).max(1);
        let total = dst.len() / unit;
        let n_chunks = total.div_ceil(per);
        let chunk = |k: usize| (k * per, per.min(total - k * per));
        // SAFETY (all blocks below): events and buffers belong to `st`, which we hold locked;
        // a buffer is written by the device only between an `issue` and the next synchronize of
        // its event, and read by the host only after that synchronize.
        for &ev in &st.events {
            drv("event wait", unsafe { cu::event::synchronize(ev) })?;
        }
        for k in 0..n_chunks.min(2) {
            let (f, n) = chunk(k);
            issue(f, n, st.bufs[k])?;
            drv("event record", unsafe {
                cu::event::record(st.events[k], stream)
            })?;
        }
        for k in 0..n_chunks {
            let b = k % 2;
            let (f, n) = chunk(k);
            drv("event wait", unsafe {
                cu::event::synchronize(st.events[b])
            })?;
            let bytes = n * unit;
            unsafe {
                par_copy(
                    st.bufs[b],
                    dst[f * unit..f * unit + bytes].as_mut_ptr(),
                    bytes,
                );
            }
            if k + 2 < n_chunks {
                let (f2, n2) = chunk(k + 2);
                issue(f2, n2, st.bufs[b])?;
                drv("event record", unsafe {
                    cu::event::record(st.events[b], stream)
                })?;
            }
        }
        Ok(())
    }

    /// Uploads `src` (units of `unit` bytes) through the pinned buffers: `issue` queues the copy
    /// of units `[first, first + n)` from the host pointer it is given, packed.
    fn upload_staged(
        &self,
        unit: usize,
        src: &[u8],
        issue: &dyn Fn(usize, usize, *const u8) -> Result<()>,
    ) -> Result<()> {
        let dev = &self.dev;
        let stream = dev.cu_stream();
        let mut guard = dev.staging()?;
        let st = guard.as_mut().expect("staging allocated");
        let per = (STAGING_CHUNK / unit).max(1);
        let total = src.len() / unit;
        for (k, first) in (0..total).step_by(per).enumerate() {
            let b = k % 2;
            let n = per.min(total - first);
            let bytes = n * unit;
            // SAFETY: see download_staged; the event guards the device's use of the buffer.
            drv("event wait", unsafe {
                cu::event::synchronize(st.events[b])
            })?;
            unsafe {
                par_copy(
                    src[first * unit..first * unit + bytes].as_ptr(),
                    st.bufs[b],
                    bytes,
                );
            }
            issue(first, n, st.bufs[b])?;
            drv("event record", unsafe {
                cu::event::record(st.events[b], stream)
            })?;
        }
        // surface errors of the copies now rather than at some later call
        dev.synchronize()
    }

    /// Queues a device-to-device copy of possibly overlapping ranges.
    fn dtod(&self, src: usize, dst: usize, len: usize) -> Result<()> {
        let stream = self.dev.cu_stream();
        let gap = src.abs_diff(dst);
        if gap >= len {
            // SAFETY: both ranges were bounds-checked and are disjoint.
            return drv("device copy", unsafe {
                cu::memcpy_dtod_async(self.at(dst), self.at(src), len, stream)
            });
        }
        if gap >= MIN_CHUNKED_OVERLAP {
            // memmove as disjoint pieces of `gap` bytes, in the order that never overwrites a
            // source byte before it is copied (stream order serialises the pieces)
            let pieces: Vec<usize> = (0..len).step_by(gap).collect();
            let mut copy = |off: usize| {
                let n = gap.min(len - off);
                // SAFETY: pieces are disjoint and in bounds (see above).
                drv("device copy", unsafe {
                    cu::memcpy_dtod_async(self.at(dst + off), self.at(src + off), n, stream)
                })
            };
            if dst < src {
                pieces.into_iter().try_for_each(&mut copy)?;
            } else {
                pieces.into_iter().rev().try_for_each(&mut copy)?;
            }
            return Ok(());
        }
        // close overlap: through a temporary device buffer
        // SAFETY: temporary allocation of `len` bytes, freed after the stream is drained.
        let tmp = drv("temporary allocation", unsafe { cu::malloc_sync(len) })?;
        let r = (|| {
            drv("device copy", unsafe {
                cu::memcpy_dtod_async(tmp, self.at(src), len, stream)
            })?;
            drv("device copy", unsafe {
                cu::memcpy_dtod_async(self.at(dst), tmp, len, stream)
            })?;
            self.dev.synchronize()
        })();
        let _ = self.dev.synchronize();
        // SAFETY: nothing queued uses `tmp` any more.
        let _ = unsafe { cu::free_sync(tmp) };
        r
    }
}

impl KvBuffer for CudaBuffer {
    fn len(&self) -> usize {
        self.len
    }

    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }

    fn device(&self) -> Device {
        Device::Cuda(self.dev.ordinal)
    }

    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        check_range("read", offset, dst.len(), self.len)?;
        if dst.is_empty() {
            return Ok(());
        }
        guarded("read", || {
            self.dev.bind()?;
            let stream = self.dev.cu_stream();
            let base = self.at(offset);
            if dst.len() >= staging_threshold() {
                self.download_staged(1, dst, &|first, n, host| {
                    // SAFETY: `host` is a pinned buffer of at least `n` bytes; the range is in
                    // bounds.
                    drv("copy device to host", unsafe {
                        cu::memcpy_dtoh_async(
                            std::slice::from_raw_parts_mut(host, n),
                            base + first as u64,
                            stream,
                        )
                    })
                })
            } else {
                // SAFETY: bounds checked; the stream is drained before `dst` is released.
                drv("copy device to host", unsafe {
                    cu::memcpy_dtoh_async(dst, base, stream)
                })?;
                self.dev.synchronize()
            }
        })
    }

    fn write(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        check_range("write", offset, src.len(), self.len)?;
        if src.is_empty() {
            return Ok(());
        }
        guarded("write", || {
            self.dev.bind()?;
            let stream = self.dev.cu_stream();
            let base = self.at(offset);
            if src.len() >= staging_threshold() {
                self.upload_staged(1, src, &|first, n, host| {
                    // SAFETY: `host` is a pinned buffer holding `n` bytes; range in bounds.
                    drv("copy host to device", unsafe {
                        cu::memcpy_htod_async(
                            base + first as u64,
                            std::slice::from_raw_parts(host, n),
                            stream,
                        )
                    })
                })
            } else {
                // SAFETY: bounds checked; the stream is drained before `src` is released.
                drv("copy host to device", unsafe {
                    cu::memcpy_htod_async(base, src, stream)
                })?;
                self.dev.synchronize()
            }
        })
    }

    fn copy_within(&mut self, src: usize, dst: usize, len: usize) -> Result<()> {
        check_range("copy source", src, len, self.len)?;
        check_range("copy destination", dst, len, self.len)?;
        if len == 0 || src == dst {
            return Ok(());
        }
        guarded("device copy", || {
            self.dev.bind()?;
            self.dtod(src, dst, len)
        })
    }

    fn fill_zero(&mut self) -> Result<()> {
        if self.len == 0 {
            return Ok(());
        }
        guarded("memset", || {
            self.dev.bind()?;
            // SAFETY: the whole allocation.
            drv("memset", unsafe {
                cu::memset_d8_async(self.ptr, 0, self.len, self.dev.cu_stream())
            })
        })
    }

    fn copy_within_2d(
        &mut self,
        src: usize,
        dst: usize,
        width: usize,
        pitch: usize,
        rows: usize,
    ) -> Result<()> {
        check_2d("2D copy source", src, width, pitch, rows, self.len)?;
        check_2d("2D copy destination", dst, width, pitch, rows, self.len)?;
        if rows == 0 || width == 0 || src == dst {
            return Ok(());
        }
        guarded("2D device copy", || {
            self.dev.bind()?;
            if rows == 1 {
                return self.dtod(src, dst, width);
            }
            let one_call = self.pitch_ok(&[pitch], width);
            if one_call && !regions_overlap(src, dst, width, pitch, rows) {
                let r = self.memcpy_2d(
                    Loc::Device(self.at(src), pitch),
                    Loc::Device(self.at(dst), pitch),
                    width,
                    rows,
                );
                if r.is_ok() {
                    return r;
                }
                FALLBACKS_2D.fetch_add(1, Ordering::Relaxed);
            } else if !one_call {
                FALLBACKS_2D.fetch_add(1, Ordering::Relaxed);
            }
            // row by row, in the order of the trait's default (what the host backend does), so
            // that overlapping regions give the same bytes
            for r in 0..rows {
                self.dtod(src + r * pitch, dst + r * pitch, width)?;
            }
            Ok(())
        })
    }

    fn read_2d(&self, offset: usize, width: usize, pitch: usize, dst: &mut [u8]) -> Result<()> {
        if width == 0 || dst.is_empty() {
            return Ok(());
        }
        let rows = dst.len() / width;
        check_2d("2D read", offset, width, pitch, rows, self.len)?;
        let dst = &mut dst[..rows * width];
        guarded("2D read", || {
            self.dev.bind()?;
            if rows == 1 || !self.pitch_ok(&[pitch, width], width) || width > STAGING_CHUNK {
                for (r, chunk) in dst.chunks_exact_mut(width).enumerate() {
                    self.read(offset + r * pitch, chunk)?;
                }
                return Ok(());
            }
            let base = self.at(offset);
            if dst.len() >= staging_threshold() {
                self.download_staged(width, dst, &|first, n, host| {
                    self.memcpy_2d(
                        Loc::Device(base + (first * pitch) as u64, pitch),
                        Loc::HostMut(host, width),
                        width,
                        n,
                    )
                })
            } else {
                self.memcpy_2d(
                    Loc::Device(base, pitch),
                    Loc::HostMut(dst.as_mut_ptr(), width),
                    width,
                    rows,
                )?;
                self.dev.synchronize()
            }
        })
    }

    fn write_2d(&mut self, offset: usize, width: usize, pitch: usize, src: &[u8]) -> Result<()> {
        if width == 0 || src.is_empty() {
            return Ok(());
        }
        let rows = src.len() / width;
        check_2d("2D write", offset, width, pitch, rows, self.len)?;
        let src = &src[..rows * width];
        guarded("2D write", || {
            self.dev.bind()?;
            if rows == 1 || !self.pitch_ok(&[pitch, width], width) || width > STAGING_CHUNK {
                for (r, chunk) in src.chunks_exact(width).enumerate() {
                    self.write(offset + r * pitch, chunk)?;
                }
                return Ok(());
            }
            let base = self.at(offset);
            if src.len() >= staging_threshold() {
                self.upload_staged(width, src, &|first, n, host| {
                    self.memcpy_2d(
                        Loc::Host(host, width),
                        Loc::Device(base + (first * pitch) as u64, pitch),
                        width,
                        n,
                    )
                })
            } else {
                self.memcpy_2d(
                    Loc::Host(src.as_ptr(), width),
                    Loc::Device(base, pitch),
                    width,
                    rows,
                )?;
                self.dev.synchronize()
            }
        })
    }
}

impl Drop for CudaBuffer {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return;
        }
        let ptr = self.ptr;
        let _ = guarded("free", || {
            self.dev.synchronize()?;
            // SAFETY: allocated by `on`, the stream is drained, and nothing else holds it.
            drv("free", unsafe { cu::free_sync(ptr) })
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Brute force over every row pair.
    fn overlap_slow(src: usize, dst: usize, width: usize, pitch: usize, rows: usize) -> bool {
        (0..rows).any(|r| {
            (0..rows).any(|q| {
                let (a, b) = (src + r * pitch, dst + q * pitch);
                a < b + width && b < a + width
            })
        })
    }

    #[test]
    fn overlap_test_matches_brute_force() {
        for rows in 0..5 {
            for width in 1..6 {
                for pitch in width..width + 7 {
                    for src in 0..20 {
                        for dst in 0..20 {
                            assert_eq!(
                                regions_overlap(src, dst, width, pitch, rows),
                                overlap_slow(src, dst, width, pitch, rows),
                                "src {src} dst {dst} width {width} pitch {pitch} rows {rows}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn par_copy_copies_every_byte() {
        for n in [
            0,
            1,
            1000,
            PAR_COPY_MIN,
            PAR_COPY_MIN + 3,
            3 * PAR_COPY_MIN + 1,
        ] {
            let src: Vec<u8> = (0..n).map(|i| (i * 7 + i / 251) as u8).collect();
            let mut dst = vec![0u8; n];
            // SAFETY: two distinct vectors of n bytes.
            unsafe { par_copy(src.as_ptr(), dst.as_mut_ptr(), n) };
            assert!(src == dst, "n = {n}");
        }
    }

    #[test]
    fn region_checks() {
        assert!(check_2d("t", 0, 4, 10, 3, 24).is_ok());
        assert!(check_2d("t", 1, 4, 10, 3, 24).is_err());
        assert!(check_2d("t", 0, 4, usize::MAX, 3, 24).is_err());
        assert!(check_2d("t", 100, 0, 10, 3, 24).is_ok());
    }
}
