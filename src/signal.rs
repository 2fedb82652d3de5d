//! `AbortSignal` options, handled through the signal's own JS interface.
//!
//! napi-rs's `AbortSignal` type is not used: its conversion overwrites the signal's `onabort`
//! property (losing a handler the user assigned) and napi_wraps the object (so a signal already
//! wrapped by another napi-rs addon is refused). Instead the signal is any object with a boolean
//! `aborted` and an `addEventListener` method; a call registers one `'abort'` listener
//! (`{ once: true }`) and removes it when the call settles, so a long-lived signal collects no
//! listeners.

use napi::bindgen_prelude::*;
use napi::sys;

use crate::args::mismatch;
use crate::error::{err, Code, JsResult};

const EXPECTED: &str =
    "signal to be an AbortSignal (an object with a boolean 'aborted' and 'addEventListener')";

/// An `AbortSignal` passed in an options object: valid for the call that received it.
pub struct Signal {
    /// Whether the signal was already aborted when passed.
    pub aborted: bool,
    object: sys::napi_value,
}

/// Reads property `name` of `object` and its JS type.
unsafe fn property(
    env: sys::napi_env,
    object: sys::napi_value,
    name: &std::ffi::CStr,
) -> Option<(sys::napi_value, sys::napi_valuetype)> {
    let mut value = std::ptr::null_mut();
    if sys::napi_get_named_property(env, object, name.as_ptr(), &mut value) != sys::Status::napi_ok
    {
        // a throwing getter: clear its exception, the value is refused as not a signal
        let mut pending = std::ptr::null_mut();
        sys::napi_get_and_clear_last_exception(env, &mut pending);
        return None;
    }
    let mut kind = 0;
    if sys::napi_typeof(env, value, &mut kind) != sys::Status::napi_ok {
        return None;
    }
    Some((value, kind))
}

impl Signal {
    /// The signal object itself (valid during the call that received it).
    pub fn raw(&self) -> sys::napi_value {
        self.object
    }
}

impl FromNapiValue for Signal {
    unsafe fn from_napi_value(env: sys::napi_env, value: sys::napi_value) -> napi::Result<Self> {
        let mut kind = 0;
        sys::napi_typeof(env, value, &mut kind);
        if kind != sys::ValueType::napi_object {
            return Err(mismatch(env, value, EXPECTED));
        }
        let aborted = match property(env, value, c"aborted") {
            Some((flag, sys::ValueType::napi_boolean)) => {
                let mut aborted = false;
                sys::napi_get_value_bool(env, flag, &mut aborted);
                aborted
            }
            _ => return Err(mismatch(env, value, EXPECTED)),
        };
        if !matches!(
            property(env, value, c"addEventListener"),
            Some((_, sys::ValueType::napi_function))
        ) {
            return Err(mismatch(env, value, EXPECTED));
        }
        Ok(Signal {
            aborted,
            object: value,
        })
    }
}

/// Calls `object[method]('abort', listener, extra...)`; a throw is cleared and reported.
unsafe fn call_abort_method(
    env: sys::napi_env,
    object: sys::napi_value,
    method: &std::ffi::CStr,
    listener: sys::napi_value,
    extra: Option<sys::napi_value>,
) -> bool {
    let Some((function, sys::ValueType::napi_function)) = property(env, object, method) else {
        return false;
    };
    let mut event = std::ptr::null_mut();
    if sys::napi_create_string_utf8(env, c"abort".as_ptr(), 5, &mut event) != sys::Status::napi_ok {
        return false;
    }
    let mut args = vec![event, listener];
    args.extend(extra);
    let mut result = std::ptr::null_mut();
    let status = sys::napi_call_function(
        env,
        object,
        function,
        args.len(),
        args.as_ptr(),
        &mut result,
    );
    if status != sys::Status::napi_ok {
        let mut pending = std::ptr::null_mut();
        sys::napi_get_and_clear_last_exception(env, &mut pending);
        return false;
    }
    true
}

impl Signal {
    /// Registers `on_abort` to run once, on the JS thread, when the signal aborts. The returned
    /// registration must be [`AbortListener::remove`]d when the call settles.
    pub fn listen(&self, env: &Env, on_abort: impl Fn(&Env) + 'static) -> JsResult<AbortListener> {
        let listener = env
            .create_function_from_closure::<(), (), _>("onAbort", move |ctx| {
                on_abort(ctx.env);
                Ok(())
            })
            .map_err(|e| err(Code::Internal, e.reason.clone()))?;
        let raw = env.raw();
        let listener = listener.raw();
        // SAFETY: on the JS thread of the call that received the signal; both values are live
        // handles of this call's scope
        unsafe {
            let mut options = std::ptr::null_mut();
            let mut once = std::ptr::null_mut();
            let ok = sys::napi_create_object(raw, &mut options) == sys::Status::napi_ok
                && sys::napi_get_boolean(raw, true, &mut once) == sys::Status::napi_ok
                && sys::napi_set_named_property(raw, options, c"once".as_ptr(), once)
                    == sys::Status::napi_ok;
            if !ok
                || !call_abort_method(
                    raw,
                    self.object,
                    c"addEventListener",
                    listener,
                    Some(options),
                )
            {
                return Err(err(
                    Code::InvalidArg,
                    "signal.addEventListener('abort', ...) failed",
                ));
            }
            let signal = reference(raw, self.object);
            let listener = reference(raw, listener);
            Ok(AbortListener { signal, listener })
        }
    }
}

unsafe fn reference(env: sys::napi_env, value: sys::napi_value) -> sys::napi_ref {
    let mut handle = std::ptr::null_mut();
    sys::napi_create_reference(env, value, 1, &mut handle);
    handle
}

/// An `'abort'` listener registered on a signal, held until the call settles.
pub struct AbortListener {
    signal: sys::napi_ref,
    listener: sys::napi_ref,
}

// SAFETY: the references are created and used on the JS thread only; inside a task they pass
// through the threadpool without being touched there
unsafe impl Send for AbortListener {}

impl AbortListener {
    /// Removes the listener from the signal (harmless when it already ran) and releases both.
    pub fn remove(self, env: &Env) {
        let raw = env.raw();
        // SAFETY: on the JS thread of the env that created the references, each deleted once
        // (self is consumed)
        unsafe {
            let mut signal = std::ptr::null_mut();
            let mut listener = std::ptr::null_mut();
            if sys::napi_get_reference_value(raw, self.signal, &mut signal) == sys::Status::napi_ok
                && sys::napi_get_reference_value(raw, self.listener, &mut listener)
                    == sys::Status::napi_ok
                && !signal.is_null()
                && !listener.is_null()
            {
                call_abort_method(raw, signal, c"removeEventListener", listener, None);
            }
            sys::napi_delete_reference(raw, self.signal);
            sys::napi_delete_reference(raw, self.listener);
        }
    }
}
