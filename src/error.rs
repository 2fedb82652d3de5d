//! The one place where core errors and panics become JS errors with stable `code`s.

use std::panic::{catch_unwind, AssertUnwindSafe};

use llama_kv_cache::KvError;
use napi::bindgen_prelude::*;

/// Stable error codes, the `code` property of every error this addon throws.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Code {
    InvalidArg,
    OutOfRange,
    Unsupported,
    InvalidState,
    InvalidModel,
    Io,
    Busy,
    Disposed,
    CudaUnavailable,
    Backend,
    NoSpace,
    Aborted,
    Internal,
    StoreNotPrefix,
    StoreGeometry,
    StoreIo,
    StoreFull,
    StoreUnavailable,
    StoreAuth,
    StoreTls,
}

impl AsRef<str> for Code {
    fn as_ref(&self) -> &str {
        match self {
            Code::InvalidArg => "ERR_KV_INVALID_ARG",
            Code::OutOfRange => "ERR_KV_OUT_OF_RANGE",
            Code::Unsupported => "ERR_KV_UNSUPPORTED",
            Code::InvalidState => "ERR_KV_INVALID_STATE",
            Code::InvalidModel => "ERR_KV_INVALID_MODEL",
            Code::Io => "ERR_KV_IO",
            Code::Busy => "ERR_KV_BUSY",
            Code::Disposed => "ERR_KV_DISPOSED",
            Code::CudaUnavailable => "ERR_KV_CUDA_UNAVAILABLE",
            Code::Backend => "ERR_KV_BACKEND",
            Code::NoSpace => "ERR_KV_NO_SPACE",
            Code::Aborted => "ERR_KV_ABORTED",
            Code::Internal => "ERR_KV_INTERNAL",
            Code::StoreNotPrefix => "ERR_KV_STORE_NOT_PREFIX",
            Code::StoreGeometry => "ERR_KV_STORE_GEOMETRY",
            Code::StoreIo => "ERR_KV_STORE_IO",
            Code::StoreFull => "ERR_KV_STORE_FULL",
            Code::StoreUnavailable => "ERR_KV_STORE_UNAVAILABLE",
            Code::StoreAuth => "ERR_KV_STORE_AUTH",
            Code::StoreTls => "ERR_KV_STORE_TLS",
        }
    }
}

/// An error on its way to JS.
pub type JsErr = Error<Code>;
/// Result of every exported function.
pub type JsResult<T> = Result<T, Code>;

/// Builds an error with `code`.
pub fn err(code: Code, msg: impl Into<String>) -> JsErr {
    Error::new(code, msg.into())
}

/// Maps a core error to its code.
pub fn from_core(e: KvError) -> JsErr {
    let code = match &e {
        KvError::InvalidArg(_) => Code::InvalidArg,
        KvError::OutOfRange(_) => Code::OutOfRange,
        KvError::Unsupported(_) => Code::Unsupported,
        KvError::InvalidState(_) => Code::InvalidState,
        KvError::InvalidModel(_) => Code::InvalidModel,
        KvError::Io(_) => Code::Io,
        KvError::Backend(m) if m.starts_with("CUDA unavailable") => Code::CudaUnavailable,
        KvError::Backend(_) => Code::Backend,
        KvError::NoSpace(_) => Code::NoSpace,
        KvError::Aborted(_) => Code::Aborted,
    };
    err(code, e.to_string())
}

/// Maps a prompt store error to its code (the cache's own errors keep theirs).
pub fn from_store(e: prompt_store::StoreError) -> JsErr {
    use prompt_store::StoreError as S;
    let code = match &e {
        S::Cache(core) => return from_core(core.clone()),
        S::NotPrefix(_) => Code::StoreNotPrefix,
        S::Geometry(_) => Code::StoreGeometry,
        S::Io(_) => Code::StoreIo,
        S::NoSpace(_) => Code::StoreFull,
        S::Unavailable(_) => Code::StoreUnavailable,
        S::Auth(_) => Code::StoreAuth,
        S::Tls(_) => Code::StoreTls,
        S::InvalidArg(_) => Code::InvalidArg,
    };
    err(code, e.to_string())
}

/// Runs `f`, turning a panic into an `ERR_KV_INTERNAL` error so that Node never aborts.
pub fn guard<T>(f: impl FnOnce() -> JsResult<T>) -> JsResult<T> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        let msg = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        Err(err(
            Code::Internal,
            format!("internal error (please report): {msg}"),
        ))
    })
}

/// Builds the JS error object for `e`: an `Error` with `code`, and for aborts the name
/// `AbortError` as well, as Node's own APIs do.
pub fn js_error(env: napi::sys::napi_env, e: JsErr) -> napi::sys::napi_value {
    let aborted = e.status == Code::Aborted;
    // SAFETY: `env` is the live env of the current call, on its own thread
    let raw = unsafe { JsError::from(e).into_value(env) };
    if aborted {
        // SAFETY: as above; `raw` is an object just created on this thread
        unsafe {
            let mut name = std::ptr::null_mut();
            let text = "AbortError";
            if napi::sys::napi_create_string_utf8(
                env,
                text.as_ptr().cast(),
                text.len() as isize,
                &mut name,
            ) == napi::sys::Status::napi_ok
            {
                napi::sys::napi_set_named_property(env, raw, c"name".as_ptr(), name);
            }
        }
    }
    raw
}

/// Converts a coded error into the status-typed error that napi's conversions must return,
/// keeping the code: the JS error object is built here and carried by reference.
pub fn coded_error(env: napi::sys::napi_env, e: JsErr) -> Error {
    let raw = js_error(env, e);
    // SAFETY: `raw` was just created on this env's thread and is a valid JS value
    match unsafe { Unknown::from_napi_value(env, raw) } {
        Ok(value) => Error::from(value),
        Err(e) => e,
    }
}
