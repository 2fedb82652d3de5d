//! Argument wrappers whose conversion failures are coded errors. napi's own conversions fail
//! with codes like `InvalidArg` or `NumberExpected` and messages like "Get TypedArray info
//! failed"; these wrappers give `ERR_KV_INVALID_ARG` and say what was expected and what came.
//! The number checks every conversion builds on live here too.

use napi::bindgen_prelude::*;
use napi::sys;

use std::path::PathBuf;

use crate::error::{coded_error, err, from_core, Code, JsResult};

pub fn type_of(env: sys::napi_env, value: sys::napi_value) -> &'static str {
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

pub(crate) fn mismatch(env: sys::napi_env, value: sys::napi_value, expected: &str) -> napi::Error {
    let got = type_of(env, value);
    coded_error(
        env,
        err(Code::InvalidArg, format!("expected {expected}, got {got}")),
    )
}

/// A JS number, validated by the checks below.
pub struct Num(pub f64);

impl FromNapiValue for Num {
    unsafe fn from_napi_value(env: sys::napi_env, value: sys::napi_value) -> napi::Result<Self> {
        // one napi call on the hot path: `napi_get_value_double` itself refuses a non-number
        let mut v = 0f64;
        if sys::napi_get_value_double(env, value, &mut v) != sys::Status::napi_ok {
            return Err(mismatch(env, value, "a number"));
        }
        Ok(Num(v))
    }
}

impl From<Num> for f64 {
    fn from(n: Num) -> f64 {
        n.0
    }
}

/// An integer in `[min, max]`. JS numbers arrive as f64 so that NaN, fractions and
/// out-of-range values are refused here, by name, instead of being truncated silently.
pub fn int(name: impl std::fmt::Display, v: f64, min: i64, max: i64) -> JsResult<i64> {
    if !v.is_finite() || v.fract() != 0.0 {
        return Err(err(
            Code::InvalidArg,
            format!("{name} must be an integer, got {v}"),
        ));
    }
    if v < min as f64 || v > max as f64 {
        return Err(err(
            Code::OutOfRange,
            format!("{name} must be in [{min}, {max}], got {v}"),
        ));
    }
    Ok(v as i64)
}

/// An i32 (positions, seq ids, deltas).
pub fn i32v(name: &str, v: impl Into<f64>) -> JsResult<i32> {
    Ok(int(name, v.into(), i32::MIN as i64, i32::MAX as i64)? as i32)
}

/// A u32 (cell indices, counts).
pub fn u32v(name: impl std::fmt::Display, v: impl Into<f64>) -> JsResult<u32> {
    Ok(int(name, v.into(), 0, u32::MAX as i64)? as u32)
}

/// An i32 whose name is built only when `v` is refused: per-token conversions call this once
/// per value, and formatting every name up front cost more than the conversion.
pub fn i32_named(name: impl FnOnce() -> String, v: f64) -> JsResult<i32> {
    if v.fract() == 0.0 && v >= i32::MIN as f64 && v <= i32::MAX as f64 {
        return Ok(v as i32);
    }
    i32v(&name(), v)
}

/// An optional i32 with a default.
pub fn opt_i32(name: &str, v: Option<Num>, default: i32) -> JsResult<i32> {
    v.map_or(Ok(default), |v| i32v(name, v))
}

/// The element type of a typed array argument.
pub trait Element: Copy {
    /// Node-API's kind of the typed array holding this element.
    const KIND: sys::napi_typedarray_type;
    /// What the argument must be, for error messages.
    const EXPECTED: &'static str;
    /// The typed array's class.
    const NAME: &'static str;
}

impl Element for u8 {
    const KIND: sys::napi_typedarray_type = sys::TypedarrayType::uint8_array;
    const EXPECTED: &'static str = "a Buffer or Uint8Array";
    const NAME: &'static str = "Uint8Array";
}

impl Element for i32 {
    const KIND: sys::napi_typedarray_type = sys::TypedarrayType::int32_array;
    const EXPECTED: &'static str = "an Int32Array";
    const NAME: &'static str = "Int32Array";
}

impl Element for f32 {
    const KIND: sys::napi_typedarray_type = sys::TypedarrayType::float32_array;
    const EXPECTED: &'static str = "a Float32Array";
    const NAME: &'static str = "Float32Array";
}

/// A typed array argument, held by its handle: its data is looked up only by
/// [`View::borrow`], which a method calls once every other argument is converted.
///
/// Converting an options object runs JS (getters), and JS can detach an array's buffer
/// (`structuredClone(buf, { transfer: [buf] })`): data looked up before that would point at
/// memory the transferred copy owns, freed when it is collected. Looked up last, the slice
/// sees the array as it is when the core starts, and no JS runs while the core reads it. A
/// detached array reads as empty, which the core refuses or treats as no data. The handle is
/// valid for the call that received it only (a task copies or [`View::hold`]s the array).
pub struct View<T: Element> {
    env: sys::napi_env,
    value: sys::napi_value,
    _element: std::marker::PhantomData<T>,
}

/// The bytes of a Buffer or Uint8Array, looked up after the other arguments.
pub type Bytes = View<u8>;
/// The values of an Int32Array, looked up after the other arguments.
pub type I32s = View<i32>;
/// The values of a Float32Array, looked up after the other arguments.
pub type Floats = View<f32>;

impl<T: Element> FromNapiValue for View<T> {
    unsafe fn from_napi_value(env: sys::napi_env, value: sys::napi_value) -> napi::Result<Self> {
        // no napi call here: the kind is checked where the data is looked up (the one napi
        // call on the hot path), after every argument that can run JS is converted
        Ok(View {
            env,
            value,
            _element: std::marker::PhantomData,
        })
    }
}

impl<T: Element> View<T> {
    /// The array's data pointer and length now, or a coded error naming the argument `name`
    /// when it is not a typed array of `T`.
    fn info(&self, name: &str) -> JsResult<(*mut T, usize)> {
        let mut kind = -1;
        let (mut len, mut data, mut buf, mut off) =
            (0usize, std::ptr::null_mut(), std::ptr::null_mut(), 0usize);
        // SAFETY: env and value come from napi for the call that holds this view
        let status = unsafe {
            sys::napi_get_typedarray_info(
                self.env, self.value, &mut kind, &mut len, &mut data, &mut buf, &mut off,
            )
        };
        if status != sys::Status::napi_ok || kind != T::KIND {
            let got = if status == sys::Status::napi_ok {
                format!("a typed array other than {}", T::NAME)
            } else {
                describe(self.env, self.value)
            };
            return Err(err(
                Code::InvalidArg,
                format!("{name} must be {}, got {got}", T::EXPECTED),
            ));
        }
        Ok((data.cast(), len))
    }

    /// The array's values, read in place (no copy).
    ///
    /// # Safety
    /// Call it after every other argument of the call is converted, and let no JS run while
    /// the slice lives (the core's work only): JS could detach or resize the buffer.
    pub unsafe fn borrow(&self, name: &str) -> JsResult<&[T]> {
        let (data, len) = self.info(name)?;
        if len == 0 || data.is_null() {
            return Ok(&[]);
        }
        // SAFETY: napi reports `len` elements at `data` (aligned for `T`: typed arrays are
        // aligned to their element size); the array is an argument of this call, so it stays
        // alive, and per the contract nothing detaches it while the slice lives
        Ok(unsafe { std::slice::from_raw_parts(data, len) })
    }

    /// [`View::borrow`], writable.
    ///
    /// # Safety
    /// As [`View::borrow`].
    pub unsafe fn borrow_mut(&mut self, name: &str) -> JsResult<&mut [T]> {
        let (data, len) = self.info(name)?;
        if len == 0 || data.is_null() {
            return Ok(&mut []);
        }
        // SAFETY: as in `borrow`; `&mut self` keeps this the only slice made from the view
        Ok(unsafe { std::slice::from_raw_parts_mut(data, len) })
    }
}

impl View<u8> {
    /// A copy of the bytes in Rust-owned memory, for work on the threadpool: JS may detach or
    /// free the buffer while the work runs, and Node-API cannot pin it. Costs one memcpy of the
    /// bytes into staging memory reused from the previous copy (see
    /// [`llama_kv_cache::staging`]); an allocation failure is an `ERR_KV_BACKEND` error, not an
    /// abort. Call it after the other arguments are converted.
    pub fn copy(&self, name: &str) -> JsResult<Payload> {
        // SAFETY: the slice is copied at once, with no JS in between
        let bytes = unsafe { self.borrow(name)? };
        llama_kv_cache::staging::stage_bytes(bytes, &format!("a copy of {name}"))
            .map(Payload::Copied)
            .map_err(from_core)
    }

    /// The bytes for work on the threadpool without a copy: the array's ArrayBuffer is
    /// transferred (`structuredClone(buffer, { transfer: [buffer] })`, which moves its memory
    /// without copying it) into a clone that only this call holds, so the caller's array and
    /// every view of that ArrayBuffer are detached from now on. Nothing JS can reach then
    /// owns the memory: no write, resize, transfer or collection can touch it until the work
    /// drops the clone. An array that cannot be transferred whole (a view of part of its
    /// ArrayBuffer, as Node's pooled small Buffers are; a SharedArrayBuffer; an ArrayBuffer
    /// marked untransferable) is copied as [`View::copy`] does. Call it after the other
    /// arguments are converted.
    pub fn take(&self, name: &str) -> JsResult<Payload> {
        match self.transfer(name)? {
            Some(taken) => Ok(Payload::Taken(taken)),
            None => self.copy(name),
        }
    }

    /// [`View::take`]'s transfer: the clone as a Uint8Array held by reference, or `None` when
    /// the array is not a whole, transferable ArrayBuffer (nothing was detached then).
    fn transfer(&self, name: &str) -> JsResult<Option<Uint8Array>> {
        let (data, len) = self.info(name)?;
        let env = self.env;
        let (mut kind, mut view_len, mut view_data, mut buffer, mut offset) = (
            -1,
            0usize,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            0usize,
        );
        let (mut buffer_data, mut buffer_len) = (std::ptr::null_mut(), 0usize);
        // SAFETY: env and value come from napi for this call; out-pointers to locals. A
        // SharedArrayBuffer fails `napi_get_arraybuffer_info` (it is no ArrayBuffer)
        let whole = unsafe {
            sys::napi_get_typedarray_info(
                env,
                self.value,
                &mut kind,
                &mut view_len,
                &mut view_data,
                &mut buffer,
                &mut offset,
            ) == sys::Status::napi_ok
                && sys::napi_get_arraybuffer_info(env, buffer, &mut buffer_data, &mut buffer_len)
                    == sys::Status::napi_ok
        };
        if !whole || len == 0 || data.is_null() || offset != 0 || buffer_len != len {
            return Ok(None);
        }
        let Some(clone) = structured_clone_transfer(env, buffer) else {
            return Ok(None);
        };
        // the clone must hold the very memory the caller's ArrayBuffer held, which is now
        // detached (byte length 0: `napi_is_detached_arraybuffer` is Node-API 7, and this
        // addon targets 6): then nothing JS can reach owns that memory
        let (mut clone_data, mut clone_len) = (std::ptr::null_mut(), 0usize);
        let (mut left_data, mut left_len) = (std::ptr::null_mut(), 0usize);
        // SAFETY: as above
        let moved = unsafe {
            sys::napi_get_arraybuffer_info(env, buffer, &mut left_data, &mut left_len)
                == sys::Status::napi_ok
                && sys::napi_get_arraybuffer_info(env, clone, &mut clone_data, &mut clone_len)
                    == sys::Status::napi_ok
        };
        let detached = moved && left_len == 0;
        if !(moved && detached && clone_data == data.cast() && clone_len == len) {
            if detached {
                return Err(err(
                    Code::InvalidArg,
                    format!(
                        "{name} was detached but its memory did not move into the clone \
                         (globalThis.structuredClone was replaced?)"
                    ),
                ));
            }
            return Ok(None);
        }
        let mut view = std::ptr::null_mut();
        // SAFETY: `clone` is an ArrayBuffer of `len` bytes on this thread; the Uint8Array made
        // over it holds it by reference for as long as the work holds the Uint8Array
        let held = unsafe {
            if sys::napi_create_typedarray(
                env,
                sys::TypedarrayType::uint8_array,
                len,
                clone,
                0,
                &mut view,
            ) != sys::Status::napi_ok
            {
                return Err(err(
                    Code::Internal,
                    format!("cannot view the clone of {name}"),
                ));
            }
            Uint8Array::from_napi_value(env, view)
        };
        held.map(Some)
            .map_err(|e| err(Code::Internal, format!("{name}: {}", e.reason)))
    }

    /// The array itself, held (a reference) past this call, with its length now: for a task
    /// that writes into it on the JS thread once the work is done.
    pub fn hold(&self, name: &str) -> JsResult<(Uint8Array, usize)> {
        let (_, len) = self.info(name)?;
        // SAFETY: a Uint8Array of this call's env (checked just above)
        let held = unsafe { Uint8Array::from_napi_value(self.env, self.value) }
            .map_err(|e| err(Code::InvalidArg, format!("{name}: {}", e.reason)))?;
        Ok((held, len))
    }
}

/// Bytes an async call reads on the threadpool, owned by the call (see [`View::copy`] and
/// [`View::take`]).
pub enum Payload {
    /// A copy in staging memory.
    Copied(llama_kv_cache::staging::Staged),
    /// The caller's memory, moved into an ArrayBuffer only the call holds.
    Taken(Uint8Array),
}

impl AsRef<[u8]> for Payload {
    fn as_ref(&self) -> &[u8] {
        match self {
            Payload::Copied(staged) => staged,
            Payload::Taken(taken) => taken,
        }
    }
}

/// `structuredClone(buffer, { transfer: [buffer] })`: the ArrayBuffer that took `buffer`'s
/// memory, or `None` when the clone threw (an untransferable or detached buffer; the
/// exception is cleared, and `buffer` is as it was).
fn structured_clone_transfer(
    env: sys::napi_env,
    buffer: sys::napi_value,
) -> Option<sys::napi_value> {
    let (mut global, mut clone_fn, mut options, mut list, mut out) = (
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        std::ptr::null_mut(),
    );
    // SAFETY: on the JS thread of `env` during a call; every value is made here or is
    // `buffer`, an ArrayBuffer of this env; out-pointers to locals
    unsafe {
        let ok = |status| status == sys::Status::napi_ok;
        let made = ok(sys::napi_get_global(env, &mut global))
            && ok(sys::napi_get_named_property(
                env,
                global,
                c"structuredClone".as_ptr(),
                &mut clone_fn,
            ))
            && ok(sys::napi_create_array_with_length(env, 1, &mut list))
            && ok(sys::napi_set_element(env, list, 0, buffer))
            && ok(sys::napi_create_object(env, &mut options))
            && ok(sys::napi_set_named_property(
                env,
                options,
                c"transfer".as_ptr(),
                list,
            ));
        if made
            && ok(sys::napi_call_function(
                env,
                global,
                clone_fn,
                2,
                [buffer, options].as_ptr(),
                &mut out,
            ))
        {
            return Some(out);
        }
        // a DataCloneError (or a failed step above) leaves an exception pending: the call goes
        // on with a copy instead
        let mut pending = false;
        sys::napi_is_exception_pending(env, &mut pending);
        if pending {
            let mut exception = std::ptr::null_mut();
            sys::napi_get_and_clear_last_exception(env, &mut exception);
        }
        None
    }
}

/// The values of an Int32Array copied at conversion, for option objects: converting an
/// object's later fields runs getters, which could detach the array before it is read.
pub struct I32Copy(pub Vec<i32>);

impl TypeName for I32Copy {
    fn type_name() -> &'static str {
        "TypedArray<i32>"
    }

    fn value_type() -> ValueType {
        ValueType::Object
    }
}

impl ValidateNapiValue for I32Copy {
    unsafe fn validate(
        env: sys::napi_env,
        value: sys::napi_value,
    ) -> napi::Result<sys::napi_value> {
        Int32Array::validate(env, value)
    }
}

impl FromNapiValue for I32Copy {
    unsafe fn from_napi_value(env: sys::napi_env, value: sys::napi_value) -> napi::Result<Self> {
        let view = I32s::from_napi_value(env, value)?;
        // SAFETY: copied at once, with no JS in between
        match unsafe { view.borrow("the array") } {
            Ok(values) => Ok(I32Copy(values.to_vec())),
            Err(e) => Err(napi::Error::new(Status::InvalidArg, e.reason.clone())),
        }
    }
}

impl I32Copy {
    /// The integers of a field that takes numbers or an Int32Array: each number checked and
    /// named `name[i]` when it is not an i32.
    pub fn of(name: &str, v: Either<Vec<f64>, I32Copy>) -> JsResult<Vec<i32>> {
        match v {
            Either::A(list) => list
                .iter()
                .enumerate()
                .map(|(i, &x)| i32_named(|| format!("{name}[{i}]"), x))
                .collect(),
            Either::B(typed) => Ok(typed.0),
        }
    }
}

/// The names an options object may carry: its fields as JS names them. A key outside them is
/// refused, so a misspelled option is an error and never a default silently taken.
pub trait OptionNames {
    /// The options' names.
    const NAMES: &'static [&'static str];
}

/// Declares the [`OptionNames`] of an options type: `option_names!(Type: "a", "b")`. A field
/// left out here is refused as unknown, which every test that passes it catches.
macro_rules! option_names {
    ($t:ty: $($name:literal),* $(,)?) => {
        impl $crate::args::OptionNames for $t {
            const NAMES: &'static [&'static str] = &[$($name),*];
        }
    };
}
pub(crate) use option_names;

/// The first own enumerable string key of `object` that is not in `names`.
///
/// # Safety
/// `env` and `object` come straight from napi for this call, and `object` is an object.
unsafe fn unknown_key(
    env: sys::napi_env,
    object: sys::napi_value,
    names: &[&str],
) -> Option<String> {
    let mut keys = std::ptr::null_mut();
    let status = sys::napi_get_all_property_names(
        env,
        object,
        sys::KeyCollectionMode::own_only,
        sys::KeyFilter::enumerable | sys::KeyFilter::skip_symbols,
        sys::KeyConversion::numbers_to_strings,
        &mut keys,
    );
    if status != sys::Status::napi_ok {
        return None;
    }
    let mut len = 0;
    sys::napi_get_array_length(env, keys, &mut len);
    (0..len).find_map(|i| {
        let mut key = std::ptr::null_mut();
        sys::napi_get_element(env, keys, i, &mut key);
        let key = String::from_napi_value(env, key).ok()?;
        (!names.contains(&key.as_str())).then_some(key)
    })
}

/// An options object converted with its field-level message kept and a coded error; a key that
/// is not one of its options is refused, naming it.
pub struct Obj<T>(pub T);

impl<T: FromNapiValue + OptionNames> FromNapiValue for Obj<T> {
    unsafe fn from_napi_value(env: sys::napi_env, value: sys::napi_value) -> napi::Result<Self> {
        if type_of(env, value) != "object" {
            return Err(mismatch(env, value, "an options object"));
        }
        if let Some(key) = unknown_key(env, value, T::NAMES) {
            let message = format!(
                "unknown option '{key}' (the options are {})",
                T::NAMES.join(", ")
            );
            return Err(coded_error(env, err(Code::InvalidArg, message)));
        }
        T::from_napi_value(env, value).map(Obj).map_err(|e| {
            // a nested options object's error comes back as the JS error's text
            let reason = e.reason.strip_prefix("Error: ").unwrap_or(&e.reason);
            coded_error(env, err(Code::InvalidArg, reason.replace('`', "'")))
        })
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
            .map(|(i, &t)| i32_named(|| format!("tokens[{i}]"), t))
            .collect::<JsResult<Vec<i32>>>()
            .map(Tokens)
            .map_err(|e| coded_error(env, e))
    }
}

fn is_bytes(env: sys::napi_env, value: sys::napi_value) -> bool {
    let mut is_typed = false;
    // SAFETY: env and value come straight from napi for this call
    unsafe { sys::napi_is_typedarray(env, value, &mut is_typed) };
    is_typed
}

/// The bytes of a Buffer or Uint8Array, `None` for anything else.
fn bytes_of(env: sys::napi_env, value: sys::napi_value) -> Option<Vec<u8>> {
    if !is_bytes(env, value) {
        return None;
    }
    // SAFETY: a typed array of this call's env
    unsafe { Uint8Array::from_napi_value(env, value) }
        .ok()
        .map(|a| a.to_vec())
}

/// A JS string, or a coded error naming the argument `name`.
pub fn string(name: &str, value: &Unknown<'_>) -> JsResult<String> {
    let (env, raw) = (value.value().env, value.raw());
    if type_of(env, raw) != "string" {
        return Err(err(
            Code::InvalidArg,
            format!("{name} must be a string, got {}", type_of(env, raw)),
        ));
    }
    // SAFETY: a string value of this call's env
    unsafe { String::from_napi_value(env, raw) }
        .map_err(|e| err(Code::InvalidArg, format!("{name}: {}", e.reason)))
}

/// A string or the bytes of a Buffer / Uint8Array; else a coded error saying `expected`.
fn string_or_bytes(
    name: &str,
    value: &Unknown<'_>,
    expected: &str,
) -> JsResult<Either<String, Vec<u8>>> {
    let (env, raw) = (value.value().env, value.raw());
    if let Some(bytes) = bytes_of(env, raw) {
        return Ok(Either::B(bytes));
    }
    if type_of(env, raw) != "string" {
        let got = describe(env, raw);
        return Err(err(
            Code::InvalidArg,
            format!("{name} must be {expected}, got {got}"),
        ));
    }
    string(name, value).map(Either::A)
}

fn path_from_string(name: &str, s: String) -> JsResult<PathBuf> {
    if s.contains('\0') {
        return Err(err(
            Code::InvalidArg,
            format!("{name} must not contain a NUL byte, got {s:?}"),
        ));
    }
    Ok(PathBuf::from(s))
}

/// A file path: a string, or a Buffer / Uint8Array of its bytes as `fs` accepts.
pub fn path(name: &str, value: &Unknown<'_>) -> JsResult<PathBuf> {
    match string_or_bytes(name, value, "a path string or a Buffer")? {
        Either::A(s) => path_from_string(name, s),
        Either::B(bytes) => path_from_bytes(name, bytes),
    }
}

#[cfg(unix)]
fn path_from_bytes(name: &str, bytes: Vec<u8>) -> JsResult<PathBuf> {
    use std::os::unix::ffi::OsStringExt;
    if bytes.contains(&0) {
        return Err(err(
            Code::InvalidArg,
            format!("{name} must not contain a NUL byte"),
        ));
    }
    Ok(PathBuf::from(std::ffi::OsString::from_vec(bytes)))
}

#[cfg(not(unix))]
fn path_from_bytes(name: &str, bytes: Vec<u8>) -> JsResult<PathBuf> {
    String::from_utf8(bytes)
        .map(PathBuf::from)
        .map_err(|_| err(Code::InvalidArg, format!("{name} is not valid UTF-8")))
}

/// A state source: a path (as [`path`]) or the bytes of a Buffer / Uint8Array.
pub enum Source {
    Path(PathBuf),
    Bytes(Vec<u8>),
}

/// Reads `value` as a path string or bytes.
pub fn source(name: &str, value: &Unknown<'_>) -> JsResult<Source> {
    match string_or_bytes(name, value, "a path string, a Buffer or a Uint8Array")? {
        Either::A(s) => path_from_string(name, s).map(Source::Path),
        Either::B(bytes) => Ok(Source::Bytes(bytes)),
    }
}

/// `typeof`, with ArrayBuffer and typed arrays told apart from plain objects.
fn describe(env: sys::napi_env, value: sys::napi_value) -> String {
    let mut flag = false;
    // SAFETY: env and value come straight from napi for this call
    unsafe { sys::napi_is_arraybuffer(env, value, &mut flag) };
    if flag {
        return "an ArrayBuffer (wrap it: new Uint8Array(buffer))".into();
    }
    if is_bytes(env, value) {
        return "a typed array other than Uint8Array".into();
    }
    type_of(env, value).into()
}

/// The bytes of an option given as text (UTF-8) or as bytes: a secret, a PEM certificate.
pub fn text_or_bytes(value: &Either<String, Uint8Array>) -> &[u8] {
    match value {
        Either::A(text) => text.as_bytes(),
        Either::B(bytes) => bytes,
    }
}
