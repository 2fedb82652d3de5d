//! Calls into cudarc, guarded: its panics (a missing library or symbol) and driver errors
//! become [`KvError::Backend`], and a poisoned lock is taken over.

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Mutex, MutexGuard};

use cudarc::driver::result as cu;

use crate::error::{KvError, Result};

pub(crate) fn panic_message(p: &(dyn Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic in the CUDA bindings".into()
    }
}

/// Runs `f`, turning a panic into `KvError::Backend("CUDA <what>: ...")`.
pub(crate) fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => Err(KvError::Backend(format!(
            "CUDA {what}: {}",
            panic_message(p.as_ref())
        ))),
    }
}

/// Maps a driver error to `KvError::Backend("CUDA <what>: <error>")`.
pub(crate) fn drv<T>(what: &str, r: std::result::Result<T, cu::DriverError>) -> Result<T> {
    r.map_err(|e| KvError::Backend(format!("CUDA {what}: {e}")))
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
