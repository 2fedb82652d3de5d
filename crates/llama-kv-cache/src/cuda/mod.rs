//! CUDA device memory for the cache's tensors (feature `cuda`).
//!
//! The driver (`libcuda`) and NVRTC (`libnvrtc`) are loaded at run time, so a binary built with
//! this feature runs on machines with and without NVIDIA drivers: without one,
//! [`cuda_status`] says why, [`cuda_devices`] is empty and every allocation on a device fails
//! with [`KvError::Backend`] whose message starts with `"CUDA unavailable: "`. Nothing here
//! panics: cudarc panics when a library or symbol is missing, so the libraries are probed first
//! and every call into cudarc runs under `catch_unwind`.
//!
//! * [`CudaBuffer`] implements [`KvBuffer`] on the memory of one device. All work of a device
//!   goes to one stream, in order; reads wait for it, device-to-device copies and memsets do not
//!   (a later read sees them; [`cuda_synchronize`] waits explicitly). Transfers of at least
//!   [`staging_threshold`] bytes go through two pinned host buffers, pipelined.
//! * [`cuda_allocator`] and [`layer_allocator`] give allocators for
//!   [`KvCache::with_allocator`](crate::KvCache::with_allocator).
//! * [`CudaBuffer::rope`] rotates f32 / f16 / bf16 K rows on the device with a kernel compiled
//!   by NVRTC (bit-identical to the host's [`RopeTable::rotate`](crate::RopeTable::rotate)
//!   followed by the host's conversion back to the K type).

mod buffer;
mod kernel;

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use cudarc::driver::{result as cu, sys, CudaContext, CudaStream};

use crate::error::{KvError, Result};
use crate::storage::{host_allocator, Device, KvBuffer};

pub use buffer::CudaBuffer;
pub use kernel::{nvrtc_check, nvrtc_version, RopeJob};

/// Why CUDA cannot be used here, or `Ok` when a driver loads, initialises and sees a device.
/// Probed once per process. Never panics.
pub fn cuda_status() -> std::result::Result<(), String> {
    driver().map(|_| ())
}

/// One CUDA device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaDeviceInfo {
    /// Device ordinal (the `n` of [`Device::Cuda`]).
    pub ordinal: usize,
    /// Device name as the driver reports it.
    pub name: String,
    /// Total device memory in bytes.
    pub total_memory: u64,
}

/// The visible CUDA devices; empty without a usable driver. Never panics.
pub fn cuda_devices() -> Vec<CudaDeviceInfo> {
    let Ok(count) = driver() else {
        return Vec::new();
    };
    (0..count)
        .filter_map(|ordinal| {
            catch_unwind(|| {
                let dev = cu::device::get(ordinal as i32).ok()?;
                let name = cu::device::get_name(dev).ok()?;
                // SAFETY: `dev` is a device handle the driver just returned.
                let total = unsafe { cu::device::total_mem(dev) }.ok()?;
                Some(CudaDeviceInfo {
                    ordinal,
                    name,
                    total_memory: total as u64,
                })
            })
            .ok()
            .flatten()
        })
        .collect()
}

/// An allocator putting every tensor on device `ordinal`. Fails up front, with
/// `KvError::Backend("CUDA unavailable: <reason>")`, when CUDA cannot be used or the device does
/// not exist.
pub fn cuda_allocator(
    ordinal: usize,
) -> Result<impl FnMut(usize, bool, usize) -> Result<Box<dyn KvBuffer>> + Send + 'static> {
    let dev = device_state(ordinal)?;
    Ok(move |_layer: usize, _is_v: bool, bytes: usize| {
        Ok(Box::new(CudaBuffer::on(&dev, bytes)?) as Box<dyn KvBuffer>)
    })
}

/// An allocator placing layer `il` on `devices[il]` ([`Device::Host`] uses host memory); a
/// single entry applies to every layer. CUDA availability is checked at the first device
/// allocation, which fails with `KvError::Backend("CUDA unavailable: <reason>")`; a layer
/// without an entry fails with [`KvError::InvalidArg`].
pub fn layer_allocator(
    devices: Vec<Device>,
) -> impl FnMut(usize, bool, usize) -> Result<Box<dyn KvBuffer>> + Send + 'static {
    move |layer: usize, is_v: bool, bytes: usize| {
        let dev = match devices.as_slice() {
            [one] => *one,
            many => *many.get(layer).ok_or_else(|| {
                KvError::InvalidArg(format!(
                    "no device given for layer {layer} ({} device entries)",
                    many.len()
                ))
            })?,
        };
        match dev {
            Device::Host => host_allocator(layer, is_v, bytes),
            Device::Cuda(n) => Ok(Box::new(CudaBuffer::new(n, bytes)?) as Box<dyn KvBuffer>),
        }
    }
}

/// Waits for all work queued on device `ordinal` by this module (copies, memsets, kernels).
pub fn cuda_synchronize(ordinal: usize) -> Result<()> {
    let dev = device_state(ordinal)?;
    guarded("synchronize", || dev.synchronize())
}

/// Default of [`staging_threshold`]: 1 MiB.
pub const DEFAULT_STAGING_THRESHOLD: usize = 1 << 20;

/// Bytes of each of the two pinned staging buffers of a device (allocated at the first staged
/// transfer).
pub const STAGING_CHUNK: usize = 8 << 20;

static STAGING_THRESHOLD: AtomicUsize = AtomicUsize::new(DEFAULT_STAGING_THRESHOLD);

/// Host<->device transfers of at least this many bytes go through pinned staging buffers;
/// smaller ones are plain copies from / to pageable memory.
pub fn staging_threshold() -> usize {
    STAGING_THRESHOLD.load(Ordering::Relaxed)
}

/// Sets [`staging_threshold`] for the process (`usize::MAX` turns staging off).
pub fn set_staging_threshold(bytes: usize) {
    STAGING_THRESHOLD.store(bytes, Ordering::Relaxed);
}

static FALLBACKS_2D: AtomicUsize = AtomicUsize::new(0);

/// How many 2D copies the driver refused (e.g. a pitch above the device limit) and were done
/// row by row instead. Diagnostic only.
pub fn copy_2d_fallbacks() -> usize {
    FALLBACKS_2D.load(Ordering::Relaxed)
}

// ---------------------------------------------------------------------------------------------
// Driver probing, errors, panics

fn driver() -> std::result::Result<usize, String> {
    static STATUS: OnceLock<std::result::Result<usize, String>> = OnceLock::new();
    STATUS.get_or_init(probe_driver).clone()
}

fn probe_driver() -> std::result::Result<usize, String> {
    // SAFETY: only tries to dlopen the driver library by its usual names.
    let present = catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false);
    if !present {
        return Err("CUDA driver library (libcuda.so) not found".into());
    }
    match catch_unwind(|| -> std::result::Result<i32, cu::DriverError> {
        cu::init()?;
        cu::device::get_count()
    }) {
        Ok(Ok(n)) if n > 0 => Ok(n as usize),
        Ok(Ok(_)) => Err("CUDA driver loaded but no CUDA device is visible".into()),
        Ok(Err(e)) => Err(format!("CUDA driver initialisation failed: {e}")),
        Err(p) => Err(format!(
            "CUDA driver initialisation failed: {}",
            panic_message(p.as_ref())
        )),
    }
}

fn panic_message(p: &(dyn Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic in the CUDA bindings".into()
    }
}

/// Runs `f`, turning a panic into `KvError::Backend("CUDA <what>: ...")`.
fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => Err(KvError::Backend(format!(
            "CUDA {what}: {}",
            panic_message(p.as_ref())
        ))),
    }
}

/// Maps a driver error to `KvError::Backend("CUDA <what>: <error>")`.
fn drv<T>(what: &str, r: std::result::Result<T, cu::DriverError>) -> Result<T> {
    r.map_err(|e| KvError::Backend(format!("CUDA {what}: {e}")))
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

// ---------------------------------------------------------------------------------------------
// Per-device state: context, stream, staging buffers, kernels

/// Two pinned host buffers and the events that say when the device is done with each.
struct Staging {
    bufs: [*mut u8; 2],
    events: [sys::CUevent; 2],
}

// SAFETY: the pointers are owned by this struct and only used under the device's mutex.
unsafe impl Send for Staging {}

pub(crate) struct DeviceState {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    max_pitch: usize,
    staging: Mutex<Option<Staging>>,
    kernels: OnceLock<std::result::Result<kernel::Kernels, String>>,
}

/// The state of device `ordinal`, created once per process.
pub(crate) fn device_state(ordinal: usize) -> Result<Arc<DeviceState>> {
    static DEVICES: Mutex<Vec<Arc<DeviceState>>> = Mutex::new(Vec::new());
    let count = driver().map_err(|r| KvError::Backend(format!("CUDA unavailable: {r}")))?;
    if ordinal >= count {
        return Err(KvError::Backend(format!(
            "CUDA unavailable: device cuda:{ordinal} does not exist ({count} device(s) visible)"
        )));
    }
    let mut devices = lock(&DEVICES);
    if let Some(d) = devices.iter().find(|d| d.ordinal == ordinal) {
        return Ok(d.clone());
    }
    let state = guarded("context creation", || {
        let ctx = drv("context creation", CudaContext::new(ordinal))?;
        let stream = drv("stream creation", ctx.new_stream())?;
        let max_pitch = drv(
            "device query",
            ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_PITCH),
        )?;
        Ok(DeviceState {
            ordinal,
            ctx,
            stream,
            max_pitch: max_pitch.max(0) as usize,
            staging: Mutex::new(None),
            kernels: OnceLock::new(),
        })
    })
    .map_err(|e| KvError::Backend(format!("CUDA unavailable on cuda:{ordinal}: {e}")))?;
    let state = Arc::new(state);
    devices.push(state.clone());
    Ok(state)
}

impl DeviceState {
    /// Makes the context current on this thread (Node runs work on several threads).
    fn bind(&self) -> Result<()> {
        drv("context", self.ctx.bind_to_thread())
    }

    fn cu_stream(&self) -> sys::CUstream {
        self.stream.cu_stream()
    }

    fn synchronize(&self) -> Result<()> {
        self.bind()?;
        drv("synchronize", self.stream.synchronize())
    }

    /// The staging buffers, allocated on first use.
    fn staging(&self) -> Result<MutexGuard<'_, Option<Staging>>> {
        let mut guard = lock(&self.staging);
        if guard.is_none() {
            let mut st = Staging {
                bufs: [std::ptr::null_mut(); 2],
                events: [std::ptr::null_mut(); 2],
            };
            let made = (|| -> Result<()> {
                for k in 0..2 {
                    // SAFETY: plain page-locked allocation, freed in Drop.
                    st.bufs[k] = drv("pinned allocation", unsafe {
                        cu::malloc_host(STAGING_CHUNK, 0)
                    })? as *mut u8;
                    st.events[k] = drv(
                        "event creation",
                        cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING),
                    )?;
                }
                Ok(())
            })();
            if let Err(e) = made {
                drop(st);
                return Err(e);
            }
            *guard = Some(st);
        }
        Ok(guard)
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = catch_unwind(AssertUnwindSafe(|| {
            for k in 0..2 {
                if !self.events[k].is_null() {
                    // SAFETY: the event was created by us and is not used after this.
                    unsafe {
                        let _ = cu::event::synchronize(self.events[k]);
                        let _ = cu::event::destroy(self.events[k]);
                    }
                }
                if !self.bufs[k].is_null() {
                    // SAFETY: allocated with malloc_host; no transfer uses it any more.
                    let _ = unsafe { cu::free_host(self.bufs[k] as *mut _) };
                }
            }
        }));
    }
}
