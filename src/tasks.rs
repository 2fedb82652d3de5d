//! Async work on the libuv threadpool. Every long operation is a [`Job`] run either directly
//! (the `...Sync` twin, on the JS thread) or inside a [`CacheTask`] (the Promise twin), so both
//! share one implementation. A task keeps the cache pending from its call until its promise
//! settles; synchronous calls meanwhile throw `ERR_KV_BUSY`, further tasks queue
//! ([`crate::queue`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use llama_kv_cache as core;
use napi::bindgen_prelude::*;
use napi::threadsafe_function::{ThreadsafeFunction, ThreadsafeFunctionCallMode};

use napi::sys;

use crate::error::{coded_error, err, guard, js_error, Code, JsErr, JsResult};
use crate::queue::{Deferred, Queued, Shared};
use crate::signal::{AbortListener, Signal};

/// JS progress callback `(done, total) => void`, callable from the threadpool.
pub type ProgressFn =
    ThreadsafeFunction<FnArgs<(f64, f64)>, Unknown<'static>, FnArgs<(f64, f64)>, Status, false>;

/// One long operation on the cache. A job run synchronously may borrow JS memory (no JS runs
/// meanwhile); one run as a task is `'static` and must own what it reads: JS can detach a
/// buffer while the threadpool works.
pub trait Job: Send {
    /// What the work produces, on the threadpool.
    type Output: Send + 'static;
    /// What JS receives.
    type Js: ToNapiValue + TypeName;
    /// Does the work. `progress(done, total)` returns false when the caller aborted. Errors
    /// are already coded, so that jobs of other modules (the prompt store) keep their codes.
    fn run(
        &mut self,
        cache: &mut dyn core::Memory,
        progress: &mut dyn FnMut(u64, u64) -> bool,
    ) -> JsResult<Self::Output>;
    /// Converts the output for JS.
    fn to_js(output: Self::Output) -> JsResult<Self::Js>;
    /// Completes an async run on the JS thread: [`Job::to_js`], unless the job must touch JS
    /// memory it holds first (copying its result into the caller's buffer).
    fn complete(&mut self, _env: &Env, output: Self::Output) -> JsResult<Self::Js> {
        Self::to_js(output)
    }
}

/// Progress reporting and cancellation shared by a task and its JS handles.
#[derive(Default)]
pub struct Control {
    pub progress: Option<ProgressFn>,
    pub aborted: Arc<AtomicBool>,
    /// The signal's `'abort'` listener, removed when the call settles.
    pub listener: Option<AbortListener>,
}

impl Control {
    /// Removes the signal's listener (on the JS thread, once the call settles).
    pub fn release(&mut self, env: &Env) {
        if let Some(listener) = self.listener.take() {
            listener.remove(env);
        }
    }

    /// The closure a job polls: forwards progress to JS (at most ~100 times) and reports aborts.
    pub fn poll(&self) -> impl FnMut(u64, u64) -> bool + '_ {
        let mut last = u64::MAX;
        move |done, total| {
            if let Some(f) = &self.progress {
                let step = (done * 100).checked_div(total).unwrap_or(0);
                if step != last {
                    last = step;
                    f.call(
                        FnArgs::from((done as f64, total as f64)),
                        ThreadsafeFunctionCallMode::NonBlocking,
                    );
                }
            }
            !self.aborted.load(Ordering::SeqCst)
        }
    }
}

/// A [`Job`] on the threadpool, settling its own promise (see [`crate::queue`]).
pub struct CacheTask<J: Job + 'static> {
    shared: Arc<Shared>,
    job: J,
    control: Control,
    deferred: Option<Deferred>,
    failure: Option<JsErr>,
}

impl<J: Job + 'static> CacheTask<J> {
    /// The task for `job`, settling `deferred` when done.
    pub fn new(shared: Arc<Shared>, job: J, control: Control, deferred: Deferred) -> Self {
        CacheTask {
            shared,
            job,
            control,
            deferred: Some(deferred),
            failure: None,
        }
    }

    /// Settles the promise and lets the next queued operation start. Never fails: napi's own
    /// promise for this work has no listener, and rejecting it would be an unhandled rejection.
    fn settle(&mut self, env: &Env, outcome: JsResult<sys::napi_value>) {
        let outcome = outcome.map_err(|e| js_error(env.raw(), e));
        if let Some(deferred) = self.deferred.take() {
            deferred.settle(env.raw(), outcome);
        }
        self.control.release(env);
        self.shared.handle.account_if_free();
        self.shared.queue.finished(env);
    }
}

impl<J: Job + 'static> Queued for CacheTask<J> {
    fn start(self: Box<Self>, env: &Env) -> bool {
        // false: the task was dropped with its promise unsettled; this only happens when
        // Node-API cannot create or queue work at all (the env is tearing down)
        env.spawn(*self).is_ok()
    }

    fn abort(mut self: Box<Self>, env: &Env) {
        if let Some(deferred) = self.deferred.take() {
            deferred.settle(env.raw(), Err(js_error(env.raw(), aborted())));
        }
        self.control.release(env);
    }
}

/// The error of an aborted operation.
pub fn aborted() -> JsErr {
    err(Code::Aborted, "the operation was aborted")
}

impl<J: Job + 'static> Task for CacheTask<J> {
    type Output = J::Output;
    type JsValue = ();

    fn compute(&mut self) -> napi::Result<Self::Output> {
        let result = guard(|| {
            if self.control.aborted.load(Ordering::SeqCst) {
                return Err(aborted());
            }
            let mut lock = self.shared.handle.lock_for_task()?;
            let cache = lock
                .as_mut()
                .ok_or_else(|| err(Code::Disposed, "the cache was disposed"))?;
            let mut poll = self.control.poll();
            let out = self.job.run(cache.as_mut(), &mut poll);
            crate::decay::schedule(&self.shared.handle, cache.as_ref());
            out
        });
        result.map_err(|e| {
            let reason = e.reason.clone();
            self.failure = Some(e);
            napi::Error::new(Status::GenericFailure, reason)
        })
    }

    fn resolve(&mut self, env: Env, output: Self::Output) -> napi::Result<()> {
        let value = self.job.complete(&env, output).and_then(|js| {
            // SAFETY: on the JS thread of `env`, inside the completion callback
            unsafe { J::Js::to_napi_value(env.raw(), js) }
                .map_err(|e| err(Code::Internal, e.reason.clone()))
        });
        self.settle(&env, value);
        Ok(())
    }

    fn reject(&mut self, env: Env, e: napi::Error) -> napi::Result<()> {
        let failure = self
            .failure
            .take()
            .unwrap_or_else(|| err(Code::Internal, e.reason.clone()));
        self.settle(&env, Err(failure));
        Ok(())
    }
}

/// Work on the threadpool that holds no cache (module functions, the prompt store): it does
/// not queue, since nothing it touches is shared with a cache's synchronous calls.
pub trait PoolJob: Send + 'static {
    /// What the work produces, on the threadpool.
    type Output: Send + 'static;
    /// What JS receives.
    type Js: ToNapiValue + TypeName;
    /// Does the work; `progress(done, total)` returns false when the caller aborted.
    fn run(&mut self, progress: &mut dyn FnMut(u64, u64) -> bool) -> JsResult<Self::Output>;
    /// Converts the output for JS.
    fn to_js(output: Self::Output) -> JsResult<Self::Js>;
}

/// A [`PoolJob`] as napi's `AsyncTask`, rejecting with the job's coded error. The signal only
/// sets the flag the job polls (and the task checks when it starts), so every abort rejects
/// with `ERR_KV_ABORTED`.
pub struct PoolTask<J: PoolJob> {
    job: J,
    control: Control,
    failure: Option<JsErr>,
}

impl<J: PoolJob> PoolTask<J> {
    /// The task for `job`, listening to `signal`.
    pub fn new(
        env: &Env,
        job: J,
        progress: Option<ProgressFn>,
        signal: Option<&Signal>,
    ) -> AsyncTask<Self> {
        let mut control = Control {
            progress,
            ..Default::default()
        };
        let mut failure = None;
        if let Some(s) = signal {
            // an already aborted signal rejects the promise when the task starts
            control.aborted.store(s.aborted, Ordering::SeqCst);
            let flag = control.aborted.clone();
            match s.listen(env, move |_| flag.store(true, Ordering::SeqCst)) {
                Ok(listener) => control.listener = Some(listener),
                // rejected when the task starts, as the promise exists only then
                Err(e) => failure = Some(e),
            }
        }
        AsyncTask::new(PoolTask {
            job,
            control,
            failure,
        })
    }
}

impl<J: PoolJob> Task for PoolTask<J> {
    type Output = J::Output;
    type JsValue = J::Js;

    fn compute(&mut self) -> napi::Result<Self::Output> {
        let refused = self.failure.take();
        let result = guard(|| {
            if let Some(e) = refused {
                return Err(e);
            }
            if self.control.aborted.load(Ordering::SeqCst) {
                return Err(aborted());
            }
            let mut poll = self.control.poll();
            self.job.run(&mut poll)
        });
        result.map_err(|e| {
            let reason = e.reason.clone();
            self.failure = Some(e);
            napi::Error::new(Status::GenericFailure, reason)
        })
    }

    fn resolve(&mut self, env: Env, output: Self::Output) -> napi::Result<Self::JsValue> {
        J::to_js(output).map_err(|e| coded_error(env.raw(), e))
    }

    fn reject(&mut self, env: Env, e: napi::Error) -> napi::Result<Self::JsValue> {
        Err(match self.failure.take() {
            Some(coded) => coded_error(env.raw(), coded),
            None => e,
        })
    }

    fn finally(mut self, env: Env) -> napi::Result<()> {
        self.control.release(&env);
        Ok(())
    }
}
