//! A defrag's runs as the JS array of `{ src, dst, len }` objects that `update` reports.
//!
//! napi-rs builds an object with one `napi_create_object` and a `napi_define_properties` of
//! three named properties, each name internalized again: about 0.4 µs per object, 2 ms for the
//! 5,461 runs a fragmented 65,536-cell cache can move, several times the defrag itself. From
//! [`BUILD_IN_JS_FROM`] runs on, the runs go to JS as one `Uint32Array` of triples and a small
//! JS function, compiled once per environment, builds the same plain objects with object
//! literals (tens of ns each). The reports that carry the list (`DefragReport`, `UpdateReport`)
//! are defined here with it.

use napi::bindgen_prelude::{Env, ToNapiValue, TypeName, Uint32Array, ValueType};
use napi::JsValue;
use napi::{sys, Error, Result, Status};
use napi_derive::napi;

use crate::types::CellMove;

/// Runs from which the objects are built in JS; below, the typed array and the call cost more
/// than they save.
const BUILD_IN_JS_FROM: usize = 64;

/// The builder: property order and attributes (writable, enumerable, configurable) as napi-rs
/// gives `CellMove`, so both paths return the same objects.
/// It names no global (an array literal, not `Array`), so a program that replaces globals
/// gets the same report.
const BUILDER_JS: &str = "(function cellMoves(flat) {
  const n = flat.length / 3
  const out = []
  for (let j = 0; j < 3 * n; j += 3) out.push({ src: flat[j], dst: flat[j + 1], len: flat[j + 2] })
  return out
})";

/// The runs of a defrag, converted to `Array<CellMove>`.
pub struct MoveList(pub Vec<llama_kv_cache::CellMove>);

impl TypeName for MoveList {
    fn type_name() -> &'static str {
        "Array<CellMove>"
    }

    fn value_type() -> ValueType {
        ValueType::Object
    }
}

impl ToNapiValue for MoveList {
    unsafe fn to_napi_value(env: sys::napi_env, val: Self) -> Result<sys::napi_value> {
        if val.0.len() >= BUILD_IN_JS_FROM {
            // SAFETY: forwarded from our caller: on the JS thread of `env`
            if let Ok(array) = unsafe { build_in_js(env, &val.0) } {
                return Ok(array);
            }
            // a host that refuses to compile the builder (a locked-down embedder) still gets
            // its report, the slower way, without the exception the refusal left pending
            let mut pending = std::ptr::null_mut();
            // SAFETY: on the JS thread of `env`, with an out-pointer to a local
            unsafe { sys::napi_get_and_clear_last_exception(env, &mut pending) };
        }
        let moves: Vec<CellMove> = val
            .0
            .iter()
            .map(|m| CellMove {
                src: m.src,
                dst: m.dst,
                len: m.len,
            })
            .collect();
        // SAFETY: forwarded from our caller: `env` is the current environment
        unsafe { Vec::<CellMove>::to_napi_value(env, moves) }
    }
}

/// What a defrag did.
#[napi(object, object_from_js = false)]
pub struct DefragReport {
    /// The runs moved.
    #[napi(ts_type = "Array<CellMove>")]
    pub moves: MoveList,
    /// Cells moved.
    pub cells_moved: u32,
    /// Bytes copied across all layers.
    pub bytes_copied: f64,
}

/// What `update` did.
#[napi(object, object_from_js = false)]
pub struct UpdateReport {
    /// Cells whose K was rotated.
    pub shifted_cells: u32,
    /// A shift is still pending (no `rope` was given).
    pub shift_pending: bool,
    /// The defrag, when one was pending.
    pub defrag: Option<DefragReport>,
}

impl From<llama_kv_cache::UpdateReport> for UpdateReport {
    fn from(r: llama_kv_cache::UpdateReport) -> Self {
        UpdateReport {
            shifted_cells: r.shifted_cells,
            shift_pending: r.shift_pending,
            defrag: r.defrag.map(|d| DefragReport {
                moves: MoveList(d.moves),
                cells_moved: d.cells_moved,
                bytes_copied: d.bytes_copied as f64,
            }),
        }
    }
}

/// The runs as objects built by the JS builder from one `Uint32Array` of triples.
///
/// # Safety
/// On the JS thread of `env`.
unsafe fn build_in_js(
    env: sys::napi_env,
    runs: &[llama_kv_cache::CellMove],
) -> Result<sys::napi_value> {
    let flat: Vec<u32> = runs.iter().flat_map(|m| [m.src, m.dst, m.len]).collect();
    // SAFETY: on the JS thread of `env` (our caller's contract), with out-pointers to locals;
    // the builder is a function of this environment
    unsafe {
        let flat = Uint32Array::to_napi_value(env, Uint32Array::new(flat))?;
        let builder = builder(env)?;
        let mut global = std::ptr::null_mut();
        check(sys::napi_get_global(env, &mut global), "get the global")?;
        let mut out = std::ptr::null_mut();
        check(
            sys::napi_call_function(env, global, builder, 1, &flat, &mut out),
            "build the moves",
        )?;
        Ok(out)
    }
}

/// The builder function of this environment, compiled on first use and kept in the addon's
/// instance data (one per environment: the main thread and each worker).
struct EnvData {
    move_builder: sys::napi_ref,
}

/// # Safety
/// On the JS thread of `env`.
unsafe fn builder(env: sys::napi_env) -> Result<sys::napi_value> {
    let e = Env::from_raw(env);
    let mut value = std::ptr::null_mut();
    if let Some(data) = e.get_instance_data::<EnvData>()? {
        // SAFETY: the reference was made on this environment and is never deleted before it
        check(
            unsafe { sys::napi_get_reference_value(env, data.move_builder, &mut value) },
            "read the moves builder",
        )?;
        return Ok(value);
    }
    let function: napi::Unknown<'_> = e.run_script(BUILDER_JS)?;
    value = function.raw();
    let mut reference = std::ptr::null_mut();
    // SAFETY: `value` is a live function of this environment; the strong reference keeps it
    // for the environment's lifetime (Node releases references when it tears the env down)
    check(
        unsafe { sys::napi_create_reference(env, value, 1, &mut reference) },
        "keep the moves builder",
    )?;
    e.set_instance_data(
        EnvData {
            move_builder: reference,
        },
        (),
        |_| {},
    )?;
    Ok(value)
}

fn check(status: sys::napi_status, what: &str) -> Result<()> {
    if status == sys::Status::napi_ok {
        Ok(())
    } else {
        Err(Error::new(
            Status::GenericFailure,
            format!("Node-API failed to {what}"),
        ))
    }
}
