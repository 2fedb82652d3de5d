//! Async tasks on the libuv threadpool. Each holds the shared cache and marks it pending from
//! creation to completion, so synchronous calls meanwhile throw `ERR_KV_BUSY`.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use llama_kv_cache::ShiftParams;
use napi::bindgen_prelude::*;
use napi_derive::napi;

use crate::error::{coded_error, err, from_core, guard, Code, JsErr};
use crate::kv_cache::Shared;
use crate::types::UpdateReport;

/// `update()` on the threadpool.
pub struct UpdateTask {
    shared: Arc<Shared>,
    shift: Option<ShiftParams>,
    max_nodes: Option<u32>,
    failure: Option<JsErr>,
}

impl UpdateTask {
    pub fn new(shared: Arc<Shared>, shift: Option<ShiftParams>, max_nodes: Option<u32>) -> Self {
        shared.pending.fetch_add(1, Ordering::SeqCst);
        UpdateTask {
            shared,
            shift,
            max_nodes,
            failure: None,
        }
    }
}

impl Drop for UpdateTask {
    fn drop(&mut self) {
        self.shared.pending.fetch_sub(1, Ordering::SeqCst);
    }
}

#[napi]
impl Task for UpdateTask {
    type Output = llama_kv_cache::UpdateReport;
    type JsValue = UpdateReport;

    fn compute(&mut self) -> napi::Result<Self::Output> {
        let result = guard(|| {
            let mut lock = self.shared.lock_for_task()?;
            let cache = lock
                .as_mut()
                .ok_or_else(|| err(Code::Disposed, "the cache was disposed"))?;
            cache
                .update(self.shift.as_ref(), self.max_nodes)
                .map_err(from_core)
        });
        result.map_err(|e| {
            let reason = e.reason.clone();
            self.failure = Some(e);
            napi::Error::new(Status::GenericFailure, reason)
        })
    }

    fn resolve(&mut self, _env: Env, output: Self::Output) -> napi::Result<Self::JsValue> {
        Ok(output.into())
    }

    fn reject(&mut self, env: Env, e: napi::Error) -> napi::Result<Self::JsValue> {
        Err(match self.failure.take() {
            Some(coded) => coded_error(env.raw(), coded),
            None => e,
        })
    }
}
