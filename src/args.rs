//! Argument wrappers whose conversion failures are coded errors. napi's own conversions fail
//! with codes like `InvalidArg` or `NumberExpected` and messages like "Get TypedArray info
//! failed"; these wrappers give `ERR_KV_INVALID_ARG` and say what was expected and what came.

use napi::bindgen_prelude::*;
use napi::sys;

use crate::error::{coded_error, err, Code};

fn type_of(env: sys::napi_env, value: sys::napi_value) -> &'static str {
    let mut t = 0;
    // SAFETY: env and value come straight from napi for this call
    if unsafe { sys::napi_typeof(env, value, &mut t) } != sys::Status::napi_ok {
        return "unknown";
    }
    match t {
        sys::ValueType::napi_undefined => "undefined",
        sys::ValueType::napi_null => "null",
        sys::ValueType::napi_boolean => "boolean",
        sys::ValueType::napi_number => "number",
        sys::ValueType::napi_string => "string",
        sys::ValueType::napi_symbol => "symbol",
        sys::ValueType::napi_object => "object",
        sys::ValueType::napi_function => "function",
        sys::ValueType::napi_bigint => "bigint",
        _ => "external",
    }
}

fn mismatch(env: sys::napi_env, value: sys::napi_value, expected: &str) -> napi::Error {
    let got = type_of(env, value);
    coded_error(
        env,
        err(Code::InvalidArg, format!("expected {expected}, got {got}")),
    )
}

/// A JS number (validated further by `convert`).
pub struct Num(pub f64);

impl FromNapiValue for Num {
    unsafe fn from_napi_value(env: sys::napi_env, value: sys::napi_value) -> napi::Result<Self> {
        if type_of(env, value) != "number" {
            return Err(mismatch(env, value, "a number"));
        }
        f64::from_napi_value(env, value).map(Num)
    }
}

/// Bytes from a Buffer or Uint8Array.
pub struct Bytes(pub Uint8Array);

impl FromNapiValue for Bytes {
    unsafe fn from_napi_value(env: sys::napi_env, value: sys::napi_value) -> napi::Result<Self> {
        let mut is_typed = false;
        sys::napi_is_typedarray(env, value, &mut is_typed);
        if is_typed {
            if let Ok(a) = Uint8Array::from_napi_value(env, value) {
                return Ok(Bytes(a));
            }
        }
        Err(mismatch(env, value, "a Buffer or Uint8Array"))
    }
}

/// Values from a Float32Array.
pub struct Floats(pub Float32Array);

impl FromNapiValue for Floats {
    unsafe fn from_napi_value(env: sys::napi_env, value: sys::napi_value) -> napi::Result<Self> {
        let mut is_typed = false;
        sys::napi_is_typedarray(env, value, &mut is_typed);
        if is_typed {
            let mut kind = 0;
            let mut len = 0;
            let mut data = std::ptr::null_mut();
            let mut buf = std::ptr::null_mut();
            let mut off = 0;
            sys::napi_get_typedarray_info(
                env, value, &mut kind, &mut len, &mut data, &mut buf, &mut off,
            );
            if kind == sys::TypedarrayType::float32_array {
                return Float32Array::from_napi_value(env, value).map(Floats);
            }
        }
        Err(mismatch(env, value, "a Float32Array"))
    }
}

/// An options object converted with its field-level message kept and a coded error.
pub struct Obj<T>(pub T);

impl<T: FromNapiValue> FromNapiValue for Obj<T> {
    unsafe fn from_napi_value(env: sys::napi_env, value: sys::napi_value) -> napi::Result<Self> {
        if type_of(env, value) != "object" {
            return Err(mismatch(env, value, "an options object"));
        }
        T::from_napi_value(env, value)
            .map(Obj)
            .map_err(|e| coded_error(env, err(Code::InvalidArg, e.reason.replace('`', "'"))))
    }
}

/// An `AbortSignal`, with whether it was already aborted when passed (napi ignores those).
pub struct Signal {
    pub aborted: bool,
    pub signal: AbortSignal,
}

impl FromNapiValue for Signal {
    unsafe fn from_napi_value(env: sys::napi_env, value: sys::napi_value) -> napi::Result<Self> {
        if type_of(env, value) != "object" {
            return Err(mismatch(env, value, "an AbortSignal"));
        }
        let mut flag = std::ptr::null_mut();
        let mut aborted = false;
        if sys::napi_get_named_property(env, value, c"aborted".as_ptr(), &mut flag)
            == sys::Status::napi_ok
        {
            sys::napi_get_value_bool(env, flag, &mut aborted);
        }
        let signal = AbortSignal::from_napi_value(env, value)
            .map_err(|_| mismatch(env, value, "an AbortSignal"))?;
        Ok(Signal { aborted, signal })
    }
}

/// Token ids: an array of integers or an Int32Array.
pub struct Tokens(pub Vec<i32>);

impl FromNapiValue for Tokens {
    unsafe fn from_napi_value(env: sys::napi_env, value: sys::napi_value) -> napi::Result<Self> {
        let mut is_typed = false;
        sys::napi_is_typedarray(env, value, &mut is_typed);
        if is_typed {
            if let Ok(a) = Int32Array::from_napi_value(env, value) {
                return Ok(Tokens(a.to_vec()));
            }
            return Err(mismatch(
                env,
                value,
                "an array of token ids or an Int32Array",
            ));
        }
        let list = Vec::<f64>::from_napi_value(env, value)
            .map_err(|_| mismatch(env, value, "an array of token ids or an Int32Array"))?;
        list.iter()
            .enumerate()
            .map(|(i, &t)| crate::convert::i32v(&format!("tokens[{i}]"), t))
            .collect::<Result<Vec<i32>, crate::error::Code>>()
            .map(Tokens)
            .map_err(|e| coded_error(env, e))
    }
}
