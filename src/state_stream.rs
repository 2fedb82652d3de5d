//! `createStateReadStream` / `createStateWriteStream`: Node streams over the core's piecewise
//! state writer ([`core::StateOut`]) and loader ([`core::StateIn`]).
//!
//! A stream holds its cache the way an async call does, for its whole life: it waits for its
//! turn in the cache's queue, then keeps the queue's running slot until it ends or is
//! destroyed, so the cache cannot change under it (synchronous calls throw `ERR_KV_BUSY`,
//! async calls wait). Each chunk is copied on the JS thread, inside the stream's `_read` /
//! `_write`: a copy of a chunk costs less than a threadpool round trip would, and the stream
//! machinery (backpressure, `pipeline`, errors) is Node's own: `lib/state-stream.js` wraps the
//! session handle this module returns in a Readable or Writable.

use std::sync::{Arc, Mutex, MutexGuard};

use llama_kv_cache as core;
use napi::bindgen_prelude::*;
use napi::sys;

use crate::error::{coded_error, err, from_core, guard, js_error, Code, JsResult};
use crate::queue::{Deferred, Queued, Shared};
use crate::signal::Signal;
use crate::tasks::aborted;

/// Default bytes per chunk: large enough that per-chunk costs vanish, small enough to keep
/// the stream's memory far below its 64 MiB budget.
pub const DEFAULT_CHUNK: u32 = 4 << 20;

/// What a session does. The core state is made from the cache when the session's turn
/// comes (or at once when the cache is idle), since queued calls may change the cache first.
pub enum Work {
    /// Produces `state_write(seq, layout, n_stream)`.
    Out {
        seq: i32,
        layout: core::Layout,
        n_stream: u32,
        state: Option<core::StateOut>,
    },
    /// Loads a state into `seq` (-1: the whole cache).
    In {
        seq: i32,
        opts: core::ReadOptions,
        state: Option<core::StateIn>,
    },
}

impl Work {
    /// Makes the core state from the cache as it is now.
    pub fn start(&mut self, cache: &core::SeedCache) -> JsResult<()> {
        match self {
            Work::Out {
                seq,
                layout,
                n_stream,
                state: state @ None,
            } => {
                *state = Some(
                    cache
                        .state_out(*seq, *layout, *n_stream)
                        .map_err(from_core)?,
                )
            }
            Work::In {
                seq,
                opts,
                state: state @ None,
            } => *state = Some(cache.state_in(*seq, *opts).map_err(from_core)?),
            _ => {}
        }
        Ok(())
    }
}

fn not_started() -> crate::error::JsErr {
    err(Code::InvalidArg, "the state stream did not start")
}

struct SessionState {
    /// Holds the queue's running slot.
    open: bool,
    /// Released the slot (or left the queue): nothing more happens.
    closed: bool,
    work: Work,
}

/// One stream's hold on a cache.
pub struct Session {
    shared: Arc<Shared>,
    id: u64,
    state: Mutex<SessionState>,
}

impl Session {
    fn lock(&self) -> MutexGuard<'_, SessionState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` on the cache and the session's work, while the session holds the cache.
    fn with<T>(
        &self,
        f: impl FnOnce(&mut core::SeedCache, &mut Work) -> JsResult<T>,
    ) -> JsResult<T> {
        guard(|| {
            let mut state = self.lock();
            if state.closed {
                return Err(err(Code::InvalidArg, "the state stream is already closed"));
            }
            if !state.open {
                return Err(err(Code::Busy, "the state stream is not open yet"));
            }
            // nothing else holds the lock: the session holds the queue's running slot
            let mut lock = self.shared.handle.lock_for_task()?;
            let cache = lock
                .as_mut()
                .ok_or_else(|| err(Code::Disposed, "the cache was disposed"))?
                .kv("a state stream")
                .map_err(from_core)?;
            f(cache, &mut state.work)
        })
    }

    /// Ends the session: an unfinished load is rolled back, and the cache goes to the next
    /// queued call. Closing twice does nothing.
    fn close(&self, env: &Env) -> JsResult<()> {
        let mut state = self.lock();
        if state.closed {
            return Ok(());
        }
        let result = if state.open {
            drop(state);
            let undone = self.with(|cache, work| match work {
                Work::In {
                    state: Some(load), ..
                } => cache.state_in_abort(load).map_err(from_core),
                _ => Ok(()),
            });
            state = self.lock();
            undone
        } else {
            Ok(())
        };
        state.closed = true;
        let was_open = state.open;
        drop(state);
        if was_open {
            self.shared.handle.account_if_free();
            self.shared.queue.finished(env);
        } else {
            self.shared.queue.abort(env, self.id);
        }
        result
    }
}

/// The session's place in the cache's queue: opens it when its turn comes.
struct Opening {
    session: Arc<Session>,
    deferred: Deferred,
}

impl Queued for Opening {
    fn start(self: Box<Self>, env: &Env) -> bool {
        self.session.lock().open = true;
        // the session holds the cache from here; its stream's destroy releases it, also when
        // this start fails
        let started = self.session.with(|cache, work| work.start(cache));
        let outcome = match started {
            Ok(()) => {
                let mut undefined = std::ptr::null_mut();
                // SAFETY: on the JS thread of `env` with an out-pointer to a local
                unsafe { sys::napi_get_undefined(env.raw(), &mut undefined) };
                Ok(undefined)
            }
            Err(e) => Err(js_error(env.raw(), e)),
        };
        self.deferred.settle(env.raw(), outcome);
        true
    }

    fn abort(self: Box<Self>, env: &Env) {
        self.session.lock().closed = true;
        let error = js_error(env.raw(), aborted());
        self.deferred.settle(env.raw(), Err(error));
    }
}

/// A JS value returned as is.
pub struct RawValue(sys::napi_value);

impl ToNapiValue for RawValue {
    unsafe fn to_napi_value(_: sys::napi_env, val: Self) -> napi::Result<sys::napi_value> {
        Ok(val.0)
    }
}

fn check(status: sys::napi_status, what: &str) -> JsResult<()> {
    if status == sys::Status::napi_ok {
        Ok(())
    } else {
        Err(err(Code::Internal, format!("Node-API failed to {what}")))
    }
}

/// Sets `object[name] = value`.
fn set(
    env: &Env,
    object: sys::napi_value,
    name: &std::ffi::CStr,
    value: sys::napi_value,
) -> JsResult<()> {
    // SAFETY: both values belong to this call's env, on its thread
    check(
        unsafe { sys::napi_set_named_property(env.raw(), object, name.as_ptr(), value) },
        "set a property",
    )
}

/// Adds method `name` to `object`, calling `f` with the session; coded errors are thrown.
fn method<R: ToNapiValue>(
    env: &Env,
    object: sys::napi_value,
    name: &'static std::ffi::CStr,
    session: &Arc<Session>,
    f: impl Fn(&Session, &Env, &FunctionCallContext) -> JsResult<R> + 'static,
) -> JsResult<()> {
    let session = session.clone();
    let function = env
        .create_function_from_closure::<Unknown<'_>, _, _>(
            name.to_str().unwrap_or("method"),
            move |ctx| {
                let raw_env = ctx.env.raw();
                f(&session, ctx.env, &ctx).map_err(|e| coded_error(raw_env, e))
            },
        )
        .map_err(|e| err(Code::Internal, e.reason.clone()))?;
    // SAFETY: the function was just created on this env
    let raw = unsafe { ToNapiValue::to_napi_value(env.raw(), function) }
        .map_err(|e| err(Code::Internal, e.reason.clone()))?;
    set(env, object, name, raw)
}

/// Queues a session for `work` on the cache and returns its handle for `lib/state-stream.js`:
/// `opened` (a promise settled when the session holds the cache), `size()`, `readInto(buf)`,
/// `write(chunk)`, `finish()`, `close()`, and the stream's options `chunkSize` (its chunk and
/// buffer size) and `signal` (destroys it with `ERR_KV_ABORTED`).
pub fn open(
    env: &Env,
    shared: &Arc<Shared>,
    work: Work,
    chunk_size: u32,
    signal: Option<&Signal>,
) -> JsResult<RawValue> {
    let raw = env.raw();
    let session = Arc::new(Session {
        shared: shared.clone(),
        id: shared.queue.next_id(),
        state: Mutex::new(SessionState {
            open: false,
            closed: false,
            work,
        }),
    });
    let (deferred, opened) =
        Deferred::new(raw).map_err(|e| err(Code::Internal, e.reason.clone()))?;
    let mut handle = std::ptr::null_mut();
    // SAFETY: on the JS thread with an out-pointer to a local
    check(
        unsafe { sys::napi_create_object(raw, &mut handle) },
        "create an object",
    )?;
    set(env, handle, c"opened", opened)?;
    method(env, handle, c"size", &session, |s, _, _| {
        Ok(match &s.lock().work {
            // exact as a double: a state is far below 2^53 bytes
            Work::Out {
                state: Some(out), ..
            } => Some(out.size() as f64),
            _ => None,
        })
    })?;
    method(env, handle, c"readInto", &session, |s, _, ctx| {
        let mut buf = ctx
            .get::<Uint8Array>(0)
            .map_err(|_| err(Code::InvalidArg, "readInto expects a Uint8Array"))?;
        // SAFETY: the typed array is alive for this call, and no JS runs while we copy
        let out = unsafe { buf.as_mut() };
        s.with(|cache, work| match work {
            Work::Out {
                state: Some(state), ..
            } => Ok(cache.state_out_chunk(state, out).map_err(from_core)? as f64),
            _ => Err(not_started()),
        })
    })?;
    method(env, handle, c"write", &session, |s, _, ctx| {
        let chunk = ctx.get::<Uint8Array>(0).map_err(|_| {
            err(
                Code::InvalidArg,
                "a state stream takes Buffer or Uint8Array chunks",
            )
        })?;
        s.with(|cache, work| match work {
            Work::In {
                state: Some(load), ..
            } => cache.state_in_write(load, &chunk).map_err(from_core),
            _ => Err(not_started()),
        })
    })?;
    method(env, handle, c"finish", &session, |s, _, _| {
        s.with(|cache, work| match work {
            Work::In {
                state: Some(load), ..
            } => Ok(crate::jobs::read_result(
                cache.state_in_finish(load).map_err(from_core)?,
            )),
            _ => Err(not_started()),
        })
    })?;
    method(env, handle, c"close", &session, |s, env, _| s.close(env))?;
    let mut chunk = std::ptr::null_mut();
    // SAFETY: on the JS thread with an out-pointer to a local
    check(
        unsafe { sys::napi_create_uint32(raw, chunk_size, &mut chunk) },
        "create a number",
    )?;
    set(env, handle, c"chunkSize", chunk)?;
    if let Some(signal) = signal {
        set(env, handle, c"signal", signal.raw())?;
    }
    // queue only once nothing else can fail: from here the session owns a queue place, which
    // the stream's destroy (or its end) gives back through `close`
    shared.queue.submit(
        env,
        session.id,
        Box::new(Opening {
            session: session.clone(),
            deferred,
        }),
    );
    Ok(RawValue(handle))
}
