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
//!   [`SeedCache::with_allocator`](crate::SeedCache::with_allocator).
//! * [`CudaBuffer::rope`] rotates f32 / f16 / bf16 K rows on the device with a kernel compiled
//!   by NVRTC (bit-identical to the host's [`RopeTable::rotate`](crate::RopeTable::rotate)
//!   followed by the host's conversion back to the K type).

mod buffer;
mod device;
mod guard;
mod kernel;
mod nvrtc;

use std::panic::catch_unwind;

use cudarc::driver::result as cu;

use crate::error::{KvError, Result};
use crate::tensors::storage::{host_allocator, Device, KvBuffer};

pub use buffer::CudaBuffer;
pub use device::{
    copy_2d_fallbacks, set_staging_threshold, staging_threshold, DEFAULT_STAGING_THRESHOLD,
    STAGING_CHUNK,
};
use device::{device_state, driver};
use guard::guarded;
pub use kernel::RopeJob;
pub use nvrtc::{nvrtc_check, nvrtc_version};

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
