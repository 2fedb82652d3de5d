//! Device selection: parses the `device` option and builds the matching allocator. CUDA
//! support is compiled in by default (feature `cuda`) and loaded at run time.

use llama_kv_cache::tensors::storage::{host_allocator, KvBuffer};
use llama_kv_cache::{Device, Result as CoreResult};
use napi::bindgen_prelude::Either;

use crate::error::{err, Code, JsResult};
use crate::types::{CudaDevice, CudaStatus};

/// Parses 'cpu' | 'host' | 'cuda' | 'cuda:N'.
pub fn parse(name: &str) -> JsResult<Device> {
    match name {
        "cpu" | "host" => Ok(Device::Host),
        "cuda" => Ok(Device::Cuda(0)),
        other => other
            .strip_prefix("cuda:")
            .and_then(|n| n.parse::<usize>().ok())
            .map(Device::Cuda)
            .ok_or_else(|| {
                err(
                    Code::InvalidArg,
                    format!("device must be 'cpu', 'cuda' or 'cuda:N', got {other:?}"),
                )
            }),
    }
}

/// The devices of the `device` option (one entry, or one per layer).
pub fn devices(
    option: &Option<Either<String, Vec<String>>>,
    n_layer: u32,
) -> JsResult<Vec<Device>> {
    let list = match option {
        None => return Ok(vec![Device::Host]),
        Some(Either::A(one)) => vec![parse(one)?],
        Some(Either::B(many)) => many.iter().map(|d| parse(d)).collect::<JsResult<_>>()?,
    };
    if list.len() != 1 && list.len() != n_layer as usize {
        return Err(err(
            Code::InvalidArg,
            format!(
                "device must name 1 or nLayer ({n_layer}) devices, got {}",
                list.len()
            ),
        ));
    }
    Ok(list)
}

type BoxedAllocator = Box<dyn FnMut(usize, bool, usize) -> CoreResult<Box<dyn KvBuffer>>>;

/// The allocator for `devices`.
pub fn allocator(devices: Vec<Device>) -> JsResult<BoxedAllocator> {
    if devices.iter().all(|d| *d == Device::Host) {
        return Ok(Box::new(host_allocator));
    }
    cuda_allocator(devices)
}

#[cfg(feature = "cuda")]
fn cuda_allocator(devices: Vec<Device>) -> JsResult<BoxedAllocator> {
    if let Err(reason) = llama_kv_cache::tensors::cuda::cuda_status() {
        return Err(err(
            Code::CudaUnavailable,
            format!("CUDA unavailable: {reason}"),
        ));
    }
    Ok(Box::new(llama_kv_cache::tensors::cuda::layer_allocator(
        devices,
    )))
}

#[cfg(not(feature = "cuda"))]
fn cuda_allocator(_: Vec<Device>) -> JsResult<BoxedAllocator> {
    Err(err(
        Code::CudaUnavailable,
        "CUDA unavailable: this build of llama-kv-cache has no CUDA support",
    ))
}

/// Whether CUDA can be used.
pub fn status() -> CudaStatus {
    #[cfg(feature = "cuda")]
    let result = llama_kv_cache::tensors::cuda::cuda_status();
    #[cfg(not(feature = "cuda"))]
    let result: Result<(), String> = Err("this build has no CUDA support".into());
    match result {
        Ok(()) => CudaStatus {
            available: true,
            reason: None,
        },
        Err(reason) => CudaStatus {
            available: false,
            reason: Some(reason),
        },
    }
}

/// The CUDA devices present (empty without a driver).
pub fn list() -> Vec<CudaDevice> {
    #[cfg(feature = "cuda")]
    {
        llama_kv_cache::tensors::cuda::cuda_devices()
            .into_iter()
            .map(|d| CudaDevice {
                ordinal: d.ordinal as u32,
                name: d.name,
                total_memory: d.total_memory as f64,
            })
            .collect()
    }
    #[cfg(not(feature = "cuda"))]
    Vec::new()
}
