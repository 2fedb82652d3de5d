//! Async work on the libuv threadpool. Every long operation is a [`Job`] run either directly
//! (the `...Sync` twin, on the JS thread) or inside a [`CacheTask`] (the Promise twin), so both
//! share one implementation. A task marks the cache pending from creation to completion;
//! synchronous calls meanwhile throw `ERR_KV_BUSY`, further tasks queue.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use llama_kv_cache as core;
use napi::bindgen_prelude::*;
use napi::threadsafe_function::{ThreadsafeFunction, ThreadsafeFunctionCallMode};

use crate::error::{coded_error, err, from_core, guard, Code, JsErr, JsResult};
use crate::kv_cache::Shared;

/// JS progress callback `(done, total) => void`, callable from the threadpool.
pub type ProgressFn =
    ThreadsafeFunction<FnArgs<(f64, f64)>, Unknown<'static>, FnArgs<(f64, f64)>, Status, false>;

/// One long operation on the cache.
pub trait Job: Send + 'static {
    /// What the work produces, on the threadpool.
    type Output: Send + 'static;
    /// What JS receives.
    type Js: ToNapiValue + TypeName;
    /// Does the work. `progress(done, total)` returns false when the caller aborted.
    fn run(
        &mut self,
        cache: &mut core::KvCache,
        progress: &mut dyn FnMut(u64, u64) -> bool,
    ) -> core::Result<Self::Output>;
    /// Converts the output for JS.
    fn to_js(output: Self::Output) -> JsResult<Self::Js>;
}

/// Progress reporting and cancellation shared by a task and its JS handles.
#[derive(Default)]
pub struct Control {
    pub progress: Option<ProgressFn>,
    pub aborted: Arc<AtomicBool>,
}

impl Control {
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

/// A [`Job`] on the threadpool.
pub struct CacheTask<J: Job> {
    shared: Arc<Shared>,
    job: J,
    control: Control,
    failure: Option<JsErr>,
}

impl<J: Job> CacheTask<J> {
    /// Creates the task and marks the cache pending.
    pub fn new(shared: Arc<Shared>, job: J, control: Control) -> Self {
        shared.pending.fetch_add(1, Ordering::SeqCst);
        CacheTask {
            shared,
            job,
            control,
            failure: None,
        }
    }
}

impl<J: Job> Drop for CacheTask<J> {
    fn drop(&mut self) {
        self.shared.pending.fetch_sub(1, Ordering::SeqCst);
    }
}

impl<J: Job> Task for CacheTask<J> {
    type Output = J::Output;
    type JsValue = J::Js;

    fn compute(&mut self) -> napi::Result<Self::Output> {
        let result = guard(|| {
            let mut lock = self.shared.lock_for_task()?;
            let cache = lock
                .as_mut()
                .ok_or_else(|| err(Code::Disposed, "the cache was disposed"))?;
            let mut poll = self.control.poll();
            self.job.run(cache, &mut poll).map_err(from_core)
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
}
