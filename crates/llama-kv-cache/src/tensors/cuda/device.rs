//! One CUDA device as the cache uses it: the driver probe, the device's context and stream,
//! its two pinned staging buffers, and the guards that turn cudarc's panics and driver errors
//! into [`KvError::Backend`].

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use cudarc::driver::{result as cu, sys, CudaContext, CudaStream};

use super::guard::{drv, guarded, lock, panic_message};
use super::nvrtc::{load_kernels, Kernels};
use crate::error::{KvError, Result};

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

pub(crate) static FALLBACKS_2D: AtomicUsize = AtomicUsize::new(0);

/// How many 2D copies the driver refused (e.g. a pitch above the device limit) and were done
/// row by row instead. Diagnostic only.
pub fn copy_2d_fallbacks() -> usize {
    FALLBACKS_2D.load(Ordering::Relaxed)
}

// ---------------------------------------------------------------------------------------------
// Driver probing, errors, panics

pub(crate) fn driver() -> std::result::Result<usize, String> {
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

// ---------------------------------------------------------------------------------------------
// Per-device state: context, stream, staging buffers, kernels

/// Two pinned host buffers and the events that say when the device is done with each.
pub(crate) struct Staging {
    pub(crate) bufs: [*mut u8; 2],
    pub(crate) events: [sys::CUevent; 2],
}

// SAFETY: the pointers are owned by this struct and only used under the device's mutex.
unsafe impl Send for Staging {}

pub(crate) struct DeviceState {
    pub(crate) ordinal: usize,
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) max_pitch: usize,
    staging: Mutex<Option<Staging>>,
    kernels: OnceLock<std::result::Result<Kernels, String>>,
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
    pub(crate) fn bind(&self) -> Result<()> {
        drv("context", self.ctx.bind_to_thread())
    }

    pub(crate) fn cu_stream(&self) -> sys::CUstream {
        self.stream.cu_stream()
    }

    pub(crate) fn synchronize(&self) -> Result<()> {
        self.bind()?;
        drv("synchronize", self.stream.synchronize())
    }

    /// The staging buffers, allocated on first use.
    pub(crate) fn staging(&self) -> Result<MutexGuard<'_, Option<Staging>>> {
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

impl DeviceState {
    /// The kernels of this device, compiled at the first call.
    pub(crate) fn kernels(&self) -> Result<&Kernels> {
        self.kernels
            .get_or_init(|| {
                catch_unwind(AssertUnwindSafe(|| load_kernels(&self.ctx)))
                    .unwrap_or_else(|p| Err(panic_message(p.as_ref())))
            })
            .as_ref()
            .map_err(|e| KvError::Backend(format!("CUDA kernels unavailable: {e}")))
    }
}
