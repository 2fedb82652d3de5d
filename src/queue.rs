//! The per-cache FIFO of async operations.
//!
//! Only the task at the head of a cache's queue is on the libuv threadpool; the others wait
//! here, holding no thread, and start in call order as their predecessor settles. So
//! `Promise.all([cache.saveSequenceFile(a), cache.saveSequenceFile(b)])` runs the saves one
//! after the other without tying up threads that `fs` or other caches need. Each call gets its
//! own promise (a raw Node-API deferred, settled by us) so that a task still waiting here is
//! rejected at once when its signal aborts, with our own coded error.
//!
//! [`Shared`] pairs a cache's [`Handle`] with its queue: what the class, its tasks, its
//! streams and its slot restorers hold.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use llama_kv_cache as core;
use napi::bindgen_prelude::*;
use napi::sys;

use crate::decay;
use crate::error::{err, Code, JsResult};
use crate::handle::Handle;

/// A promise we settle ourselves, exactly once, on the JS thread.
pub struct Deferred(sys::napi_deferred);

// SAFETY: the handle is created, settled and dropped on the JS thread only; inside a task it
// passes through the threadpool without being touched there
unsafe impl Send for Deferred {}

impl Deferred {
    /// A new promise and the handle that settles it.
    pub fn new(env: sys::napi_env) -> napi::Result<(Self, sys::napi_value)> {
        let mut deferred = std::ptr::null_mut();
        let mut promise = std::ptr::null_mut();
        // SAFETY: called on the JS thread of `env`, with out-pointers to locals
        let status = unsafe { sys::napi_create_promise(env, &mut deferred, &mut promise) };
        if status != sys::Status::napi_ok {
            return Err(napi::Error::new(
                Status::from(status),
                "could not create a promise",
            ));
        }
        Ok((Deferred(deferred), promise))
    }

    /// Resolves with `Ok` or rejects with `Err`. Consumes the handle: Node-API frees it here.
    pub fn settle(
        self,
        env: sys::napi_env,
        outcome: std::result::Result<sys::napi_value, sys::napi_value>,
    ) {
        // SAFETY: on the JS thread of the env that created the deferred, which is settled once
        // (self is consumed). A failure here means the env is tearing down: nothing to settle.
        unsafe {
            match outcome {
                Ok(value) => sys::napi_resolve_deferred(env, self.0, value),
                Err(error) => sys::napi_reject_deferred(env, self.0, error),
            };
        }
    }
}

/// A promise returned to JS as is.
pub struct JsPromise(pub sys::napi_value);

impl ToNapiValue for JsPromise {
    unsafe fn to_napi_value(_: sys::napi_env, val: Self) -> napi::Result<sys::napi_value> {
        Ok(val.0)
    }
}

/// An operation waiting in a queue, started or rejected on the JS thread.
pub trait Queued: Send {
    /// Puts the operation on the threadpool. On failure it has settled its own promise.
    fn start(self: Box<Self>, env: &Env) -> bool;
    /// Rejects the operation's promise with an abort error without running it.
    fn abort(self: Box<Self>, env: &Env);
}

#[derive(Default)]
struct State {
    running: bool,
    next_id: u64,
    waiting: VecDeque<(u64, Box<dyn Queued>)>,
}

/// One cache's queue. `pending` counts operations submitted and not yet settled: synchronous
/// calls are refused (`ERR_KV_BUSY`) while it is above zero.
#[derive(Default)]
pub struct Queue {
    state: Mutex<State>,
    pending: AtomicUsize,
}

impl Queue {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether any operation is queued or running.
    pub fn is_pending(&self) -> bool {
        self.pending.load(Ordering::SeqCst) > 0
    }

    /// A fresh id for an operation about to be submitted (the handle for [`Queue::abort`]).
    pub fn next_id(&self) -> u64 {
        let mut state = self.lock();
        state.next_id += 1;
        state.next_id
    }

    /// Starts `op` now when nothing runs, else queues it behind the others.
    pub fn submit(&self, env: &Env, id: u64, op: Box<dyn Queued>) {
        self.pending.fetch_add(1, Ordering::SeqCst);
        let mut state = self.lock();
        if state.running {
            state.waiting.push_back((id, op));
            return;
        }
        state.running = true;
        drop(state);
        if !op.start(env) {
            self.finished(env);
        }
    }

    /// Called once the running operation has settled its promise: starts the next one.
    pub fn finished(&self, env: &Env) {
        self.pending.fetch_sub(1, Ordering::SeqCst);
        loop {
            let mut state = self.lock();
            let Some((_, op)) = state.waiting.pop_front() else {
                state.running = false;
                return;
            };
            drop(state);
            if op.start(env) {
                return;
            }
            self.pending.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Rejects operation `id` if it is still waiting; returns whether it was.
    pub fn abort(&self, env: &Env, id: u64) -> bool {
        let mut state = self.lock();
        let Some(at) = state.waiting.iter().position(|(i, _)| *i == id) else {
            return false;
        };
        let (_, op) = state.waiting.remove(at).expect("position is in range");
        drop(state);
        self.pending.fetch_sub(1, Ordering::SeqCst);
        op.abort(env);
        true
    }
}

/// A cache's handle and the queue of its async operations, shared by the `KvCache` object,
/// its tasks, its state streams and its slot restorers.
pub struct Shared {
    pub handle: Arc<Handle>,
    pub queue: Queue,
}

impl Shared {
    /// The shared state of a new cache.
    pub fn new(handle: Handle) -> Self {
        Shared {
            handle: Arc::new(handle),
            queue: Queue::default(),
        }
    }

    /// Runs a synchronous call on the cache: refused while async work is queued or running
    /// (`ERR_KV_BUSY`) or after `dispose()`.
    pub fn with<T>(&self, f: impl FnOnce(&mut dyn core::Memory) -> JsResult<T>) -> JsResult<T> {
        if self.queue.is_pending() {
            return Err(err(
                Code::Busy,
                "the cache is busy with an async operation; await it first",
            ));
        }
        self.handle.try_with(|m| {
            let out = f(m);
            decay::schedule(&self.handle, m);
            out
        })
    }
}
