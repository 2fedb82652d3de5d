//! The `KvCache` class: converts arguments, locks the core cache, maps results. No cache logic.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};

use llama_kv_cache as core;
use llama_kv_cache::{CacheParams, Layout, PrepareOptions, ReadOptions, Tensor, WriteOptions};
use napi::bindgen_prelude::*;
use napi_derive::napi;

use crate::args::{self, Bytes, Floats, I32s, Num, Obj, Tokens};
use crate::convert::{self, i32v, opt_i32, u32v};
use crate::error::{err, from_core, guard, js_error, Code, JsErr, JsResult};
use crate::jobs::{
    self, LoadFileJob, SaveFileJob, StateReadJob, StateWriteIntoJob, StateWriteJob, UpdateJob,
};
use crate::queue::{Deferred, JsPromise, Queue};
use crate::restorer::SlotRestorer;
use crate::signal::Signal;
use crate::state_stream::{self, RawValue, Work};
use crate::tasks::{aborted, CacheTask, Control, Job, ProgressFn};
use crate::types::*;

/// The core cache shared with async tasks, plus the queue of those tasks.
pub struct Shared {
    pub cache: Mutex<Option<core::KvCache>>,
    pub queue: Queue,
    /// The env of the JS thread that made the cache.
    env: JsEnv,
    /// Host tensor bytes V8 was told about.
    external: AtomicI64,
}

/// A JS thread's env.
struct JsEnv(napi::sys::napi_env);

// SAFETY: the env is only handed to Node-API on the JS thread that created the cache (its
// synchronous calls and its tasks' completions run there); other threads only carry it
unsafe impl Send for JsEnv {}
// SAFETY: as above
unsafe impl Sync for JsEnv {}

impl Shared {
    /// Tells V8 how many host tensor bytes the cache holds in memory, so that the GC weighs an
    /// undisposed cache by what it costs. Tensors are zeroed lazily, so only written ones
    /// count: reporting a new cache's whole size made V8 run a full collection inside every
    /// `new KvCache` of a few GiB ("external memory pressure"), 3-70 ms of a creation that
    /// otherwise takes microseconds. Call on the JS thread.
    pub fn account(&self, cache: &core::KvCache) {
        self.report(cache.host_resident_bytes() as i64);
    }

    /// [`Shared::account`] when the cache is not locked (after a task or a stream).
    pub fn account_if_free(&self) {
        if let Ok(lock) = self.cache.try_lock() {
            if let Some(cache) = lock.as_ref() {
                self.account(cache);
            }
        }
    }

    /// Reports `bytes` in place of the amount reported before.
    fn report(&self, bytes: i64) {
        let before = self.external.swap(bytes, Ordering::SeqCst);
        if bytes != before {
            let mut total = 0;
            // SAFETY: on the JS thread of the env (see JsEnv); a failure only leaves V8's
            // estimate stale
            unsafe {
                napi::sys::napi_adjust_external_memory(self.env.0, bytes - before, &mut total)
            };
        }
    }

    /// Runs a synchronous call on the cache: refused while async work is queued or running
    /// (`ERR_KV_BUSY`) or after `dispose()`.
    pub fn with<T>(&self, f: impl FnOnce(&mut core::KvCache) -> JsResult<T>) -> JsResult<T> {
        guard(|| {
            if self.queue.is_pending() {
                return Err(err(
                    Code::Busy,
                    "the cache is busy with an async operation; await it first",
                ));
            }
            let mut lock = match self.cache.try_lock() {
                Ok(lock) => lock,
                Err(TryLockError::WouldBlock) => {
                    return Err(err(Code::Busy, "the cache is busy with an async operation"))
                }
                Err(TryLockError::Poisoned(_)) => return Err(poisoned()),
            };
            let cache = lock
                .as_mut()
                .ok_or_else(|| err(Code::Disposed, "the cache was disposed"))?;
            f(cache)
        })
    }

    /// Locks the cache for a task on the threadpool (tasks queue behind each other).
    pub fn lock_for_task(&self) -> JsResult<MutexGuard<'_, Option<core::KvCache>>> {
        self.cache.lock().map_err(|_| poisoned())
    }

    /// Takes the cache out for `dispose()`, also after an internal error poisoned it.
    fn take_for_dispose(&self) -> JsResult<Option<core::KvCache>> {
        match self.cache.try_lock() {
            Ok(mut lock) => Ok(lock.take()),
            Err(TryLockError::WouldBlock) => Err(err(
                Code::Busy,
                "cannot dispose while an async operation runs",
            )),
            Err(TryLockError::Poisoned(p)) => {
                let cache = p.into_inner().take();
                self.cache.clear_poison();
                Ok(cache)
            }
        }
    }
}

/// The error every call gets after an earlier one panicked while holding the cache (a bug caught
/// as `ERR_KV_INTERNAL`): the cells and tensors may be half-updated, so the cache refuses further
/// use instead of guessing, and `dispose()` still frees it.
fn poisoned() -> JsErr {
    err(
        Code::Internal,
        "an earlier call on this cache failed with an internal error, so its contents may be \
         inconsistent; dispose() it and rebuild it (for example from a saved state)",
    )
}

/// llama.cpp's unified KV cache: cells, sequences, slot search and the per-layer K/V tensors.
///
/// Metadata operations are synchronous. Work that touches tensor data in bulk (`update`, state
/// and file I/O) has an async twin that runs on the libuv threadpool. Async calls on one cache
/// queue in call order; while any is queued or running, synchronous calls throw `ERR_KV_BUSY`.
#[napi(custom_finalize)]
pub struct KvCache {
    shared: Arc<Shared>,
    model_shift: Option<core::ShiftParams>,
}

impl ObjectFinalize for KvCache {
    fn finalize(self, _: Env) -> napi::Result<()> {
        self.shared.report(0);
        Ok(())
    }
}

fn layer_and_tensor(layer: Num, v: bool) -> Result<(u32, Tensor), Code> {
    Ok((u32v("layer", layer)?, if v { Tensor::V } else { Tensor::K }))
}

fn slot(s: core::Slot) -> Slot {
    Slot {
        head: s.head,
        len: s.len,
        n: s.n,
    }
}

impl KvCache {
    /// Builds the cache on the requested devices; `model_shift` is the RoPE `update()` applies
    /// when called without `rope` (caches made by `fromModel`).
    pub(crate) fn from_params(
        env: &Env,
        params: CacheParams,
        device: &Option<Either<String, Vec<String>>>,
        model_shift: Option<core::ShiftParams>,
    ) -> JsResult<Self> {
        let devices = crate::device::devices(device, params.n_layer)?;
        let mut alloc = crate::device::allocator(devices)?;
        let cache = core::KvCache::with_allocator(params, &mut alloc).map_err(from_core)?;
        let shared = Arc::new(Shared {
            cache: Mutex::new(None),
            queue: Queue::default(),
            env: JsEnv(env.raw()),
            external: AtomicI64::new(0),
        });
        // V8 is told about host memory only, as it gets written
        shared.account(&cache);
        *shared.cache.lock().map_err(|_| poisoned())? = Some(cache);
        Ok(KvCache {
            shared,
            model_shift,
        })
    }

    fn with<T>(&self, f: impl FnOnce(&mut core::KvCache) -> JsResult<T>) -> JsResult<T> {
        self.shared.with(f)
    }

    /// Runs `job` on the calling thread (refused while the cache is busy).
    pub(crate) fn run_sync<J: Job>(&self, mut job: J) -> JsResult<J::Js> {
        self.with(|c| {
            let output = job.run(c, &mut |_, _| true);
            self.shared.account(c);
            let output = output?;
            J::to_js(output)
        })
    }

    /// Queues `job` behind the cache's pending operations and returns its promise.
    pub(crate) fn run_async<J: Job>(
        &self,
        env: &Env,
        job: J,
        progress: Option<ProgressFn>,
        signal: Option<Signal>,
    ) -> JsResult<JsPromise> {
        guard(|| {
            // refuse now rather than in the promise when the cache is disposed (while anything
            // is pending it cannot be)
            if !self.shared.queue.is_pending() {
                self.with(|_| Ok(()))?;
            }
            let (deferred, promise) =
                Deferred::new(env.raw()).map_err(|e| err(Code::Internal, e.reason.clone()))?;
            if signal.as_ref().is_some_and(|s| s.aborted) {
                deferred.settle(env.raw(), Err(js_error(env.raw(), aborted())));
                return Ok(JsPromise(promise));
            }
            let mut control = Control {
                progress,
                ..Default::default()
            };
            let id = self.shared.queue.next_id();
            if let Some(s) = &signal {
                let flag = control.aborted.clone();
                // weak: a signal that outlives the cache must not keep its tensors alive
                let shared = Arc::downgrade(&self.shared);
                let listening = s.listen(env, move |env| {
                    flag.store(true, Ordering::SeqCst);
                    // a task still waiting in the queue is rejected now; a running one stops
                    // at its next checkpoint (or before it starts) and rejects then
                    if let Some(shared) = shared.upgrade() {
                        shared.queue.abort(env, id);
                    }
                });
                match listening {
                    Ok(listener) => control.listener = Some(listener),
                    Err(e) => {
                        deferred.settle(env.raw(), Err(js_error(env.raw(), e)));
                        return Ok(JsPromise(promise));
                    }
                }
            }
            let task = CacheTask::new(self.shared.clone(), job, control, deferred);
            self.shared.queue.submit(env, id, Box::new(task));
            Ok(JsPromise(promise))
        })
    }

    /// Opens a state stream; on an idle cache its state is made now, so that bad arguments
    /// throw here rather than on the stream.
    fn open_stream(
        &self,
        env: &Env,
        mut work: Work,
        kind: &'static std::ffi::CStr,
        chunk: u32,
        signal: Option<&Signal>,
    ) -> JsResult<RawValue> {
        guard(|| {
            if !self.shared.queue.is_pending() {
                self.with(|c| work.start(c))?;
            }
            state_stream::open(env, &self.shared, work, kind, chunk, signal)
        })
    }

    fn read(&self, layer: Num, v: bool, first: Num, n: Num) -> Result<Buffer, Code> {
        let (il, which) = layer_and_tensor(layer, v)?;
        let (first, n) = (u32v("firstCell", first)?, u32v("nCells", n)?);
        self.with(|c| Ok(c.read_rows(il, which, first, n).map_err(from_core)?.into()))
    }

    fn write(&self, layer: Num, v: bool, first: Num, data: &[u8]) -> Result<(), Code> {
        let (il, which) = layer_and_tensor(layer, v)?;
        let first = u32v("firstCell", first)?;
        self.with(|c| {
            let written = c.write_rows(il, which, first, data).map_err(from_core);
            self.shared.account(c);
            written
        })
    }

    fn read_f32(&self, layer: Num, v: bool, first: Num, n: Num) -> Result<Float32Array, Code> {
        let (il, which) = layer_and_tensor(layer, v)?;
        let (first, n) = (u32v("firstCell", first)?, u32v("nCells", n)?);
        self.with(|c| {
            Ok(Float32Array::new(
                c.read_rows_f32(il, which, first, n).map_err(from_core)?,
            ))
        })
    }

    fn write_f32(&self, layer: Num, v: bool, first: Num, values: &[f32]) -> Result<(), Code> {
        let (il, which) = layer_and_tensor(layer, v)?;
        let first = u32v("firstCell", first)?;
        self.with(|c| {
            let written = c
                .write_rows_f32(il, which, first, values)
                .map_err(from_core);
            self.shared.account(c);
            written
        })
    }
}

#[napi]
impl KvCache {
    /// Creates a cache with zeroed K/V tensors in host memory.
    #[napi(constructor)]
    pub fn new(
        env: Env,
        this: This<Unknown<'_>>,
        #[napi(ts_arg_type = "KvCacheOptions")] options: Obj<KvCacheOptions>,
    ) -> Result<Self, Code> {
        let options = options.0;
        guard(|| {
            // called as a function (no `new`), `this` is whatever the receiver was: refuse
            // rather than attach a cache to it
            // SAFETY: `this` is a value of this call's env
            if unsafe { <&KvCache as ValidateNapiValue>::validate(env.raw(), this.object.raw()) }
                .is_err()
            {
                return Err(err(
                    Code::InvalidArg,
                    "KvCache is a class: call it with `new KvCache(options)`",
                ));
            }
            let k = convert::widths("nEmbdKGqa", &options.n_embd_k_gqa)?;
            let v = match &options.n_embd_v_gqa {
                Some(w) => convert::widths("nEmbdVGqa", w)?,
                None => k.clone(),
            };
            let params = CacheParams {
                size: u32v("size", options.size)?,
                n_layer: u32v("nLayer", options.n_layer)?,
                n_embd_k_gqa: k,
                n_embd_v_gqa: v,
                n_embd_k_s: options.n_embd_k_s.map_or(Ok(0), |x| u32v("nEmbdKS", x))?,
                n_embd_v_s: options.n_embd_v_s.map_or(Ok(0), |x| u32v("nEmbdVS", x))?,
                type_k: convert::ggml_type("typeK", options.type_k, core::GgmlType::F16)?,
                type_v: convert::ggml_type("typeV", options.type_v, core::GgmlType::F16)?,
                flash_attn: options.flash_attn.unwrap_or(false),
                recurrent: options.recurrent.unwrap_or(false),
                can_shift: options.can_shift.unwrap_or(true),
                n_seq_max: options.n_seq_max.map_or(Ok(1), |x| u32v("nSeqMax", x))?,
                n_rot_k: options.n_rot_k.map_or(Ok(0), |x| u32v("nRotK", x))?,
                n_rot_v: options.n_rot_v.map_or(Ok(0), |x| u32v("nRotV", x))?,
            };
            KvCache::from_params(&env, params, &options.device, None)
        })
    }

    /// Frees the tensors now. Any later call throws `ERR_KV_DISPOSED`; disposing twice is a no-op.
    #[napi]
    pub fn dispose(&self) -> Result<(), Code> {
        guard(|| {
            if self.shared.queue.is_pending() {
                return Err(err(
                    Code::Busy,
                    "cannot dispose while an async operation is pending",
                ));
            }
            if self.shared.take_for_dispose()?.is_some() {
                self.shared.report(0);
            }
            Ok(())
        })
    }

    /// `using cache = new KvCache(...)`: disposes at the end of the scope.
    #[napi(well_known_symbol = "dispose")]
    pub fn symbol_dispose(&self) -> Result<(), Code> {
        self.dispose()
    }

    /// The CUDA devices present; empty where there is no NVIDIA driver.
    #[napi]
    pub fn cuda_devices() -> Vec<CudaDevice> {
        crate::device::list()
    }

    /// Whether CUDA memory can be used here, and why not.
    #[napi]
    pub fn cuda_status() -> CudaStatus {
        crate::device::status()
    }

    /// Host tensor bytes the cache holds in memory now: tensors are zeroed lazily by the OS, so
    /// a tensor counts once it is written (`clear()` zeroes it in place and keeps its memory for
    /// the next writes). This is also what V8 is told the cache costs.
    #[napi(getter)]
    pub fn resident_bytes(&self) -> Result<f64, Code> {
        self.with(|c| Ok(c.host_resident_bytes() as f64))
    }

    /// Tensor bytes per device.
    #[napi(getter)]
    pub fn bytes_per_device(&self) -> Result<Vec<DeviceBytes>, Code> {
        self.with(|c| {
            Ok(c.bytes_per_device()
                .into_iter()
                .map(|(d, b)| DeviceBytes {
                    device: match d {
                        core::Device::Host => "cpu".into(),
                        core::Device::Cuda(n) => format!("cuda:{n}"),
                    },
                    bytes: b as f64,
                })
                .collect())
        })
    }

    /// Whether `dispose()` was called.
    #[napi(getter)]
    pub fn disposed(&self) -> bool {
        match self.shared.cache.try_lock() {
            Ok(g) => g.is_none(),
            Err(TryLockError::Poisoned(p)) => p.into_inner().is_none(),
            Err(TryLockError::WouldBlock) => false,
        }
    }

    /// Number of cells.
    #[napi(getter)]
    pub fn size(&self) -> Result<u32, Code> {
        self.with(|c| Ok(c.size()))
    }

    /// Number of layers.
    #[napi(getter)]
    pub fn n_layer(&self) -> Result<u32, Code> {
        self.with(|c| Ok(c.n_layer()))
    }

    /// Where the next slot search starts.
    #[napi(getter)]
    pub fn head(&self) -> Result<u32, Code> {
        self.with(|c| Ok(c.head()))
    }

    /// Cells the attention looks at (set by slot placement).
    #[napi(getter)]
    pub fn n(&self) -> Result<u32, Code> {
        self.with(|c| Ok(c.n()))
    }

    /// llama.cpp's `used` counter.
    #[napi(getter)]
    pub fn used_cells(&self) -> Result<u32, Code> {
        self.with(|c| Ok(c.used_cells()))
    }

    /// Sum over cells of the number of owning sequences (`llama_kv_self_n_tokens`).
    #[napi(getter)]
    pub fn n_tokens(&self) -> Result<f64, Code> {
        self.with(|c| Ok(c.n_tokens() as f64))
    }

    /// Largest position in the cache, -1 when empty.
    #[napi(getter)]
    pub fn pos_max(&self) -> Result<i32, Code> {
        self.with(|c| Ok(c.pos_max()))
    }

    /// One past the last occupied cell.
    #[napi]
    pub fn cell_max(&self) -> Result<u32, Code> {
        self.with(|c| Ok(c.cell_max()))
    }

    /// Whether a K-shift is possible.
    #[napi(getter)]
    pub fn can_shift(&self) -> Result<bool, Code> {
        self.with(|c| Ok(c.can_shift()))
    }

    /// Whether positions changed since the last K-shift.
    #[napi(getter)]
    pub fn has_shift(&self) -> Result<bool, Code> {
        self.with(|c| Ok(c.has_shift()))
    }

    /// Whether a defrag is scheduled for the next `update`.
    #[napi(getter)]
    pub fn defrag_pending(&self) -> Result<bool, Code> {
        self.with(|c| Ok(c.defrag_pending()))
    }

    /// Whether V is stored transposed (flash attention off, not recurrent).
    #[napi(getter)]
    pub fn v_trans(&self) -> Result<bool, Code> {
        self.with(|c| Ok(c.v_trans()))
    }

    /// Whether the cache is recurrent.
    #[napi(getter)]
    pub fn recurrent(&self) -> Result<bool, Code> {
        self.with(|c| Ok(c.recurrent()))
    }

    /// Padding of `n`: 256 with flash attention, else 32.
    #[napi(getter)]
    pub fn padding(&self) -> Result<u32, Code> {
        self.with(|c| Ok(c.padding()))
    }

    /// K type name.
    #[napi(getter)]
    pub fn type_k(&self) -> Result<String, Code> {
        self.with(|c| Ok(c.type_k().name().to_string()))
    }

    /// V type name.
    #[napi(getter)]
    pub fn type_v(&self) -> Result<String, Code> {
        self.with(|c| Ok(c.type_v().name().to_string()))
    }

    /// Bytes of all K and V tensors.
    #[napi(getter)]
    pub fn total_size(&self) -> Result<f64, Code> {
        self.with(|c| Ok(c.total_size() as f64))
    }

    /// Bytes of all K tensors.
    #[napi(getter)]
    pub fn size_k_bytes(&self) -> Result<f64, Code> {
        self.with(|c| Ok(c.size_k_bytes() as f64))
    }

    /// Bytes of all V tensors.
    #[napi(getter)]
    pub fn size_v_bytes(&self) -> Result<f64, Code> {
        self.with(|c| Ok(c.size_v_bytes() as f64))
    }

    /// Bytes of one row (one cell) of K or V in `layer`.
    #[napi]
    pub fn row_size(
        &self,
        #[napi(ts_arg_type = "number")] layer: Num,
        #[napi(ts_arg_type = "'k' | 'v'")] tensor: Unknown<'_>,
    ) -> Result<u32, Code> {
        let which = match args::string("tensor", &tensor)?.as_str() {
            "k" | "K" => Tensor::K,
            "v" | "V" => Tensor::V,
            other => {
                return Err(err(
                    Code::InvalidArg,
                    format!("tensor must be 'k' or 'v', got {other:?}"),
                ))
            }
        };
        let il = u32v("layer", layer)?;
        self.with(|c| Ok(c.row_size(il, which).map_err(from_core)? as u32))
    }

    /// Removes `seqId` (-1: every sequence) from cells with positions in `[p0, p1)`; negative
    /// bounds are open. Returns false when a recurrent cache refuses a partial removal.
    #[napi]
    pub fn seq_rm(
        &self,
        #[napi(ts_arg_type = "number")] seq_id: Num,
        #[napi(ts_arg_type = "number")] p0: Option<Num>,
        #[napi(ts_arg_type = "number")] p1: Option<Num>,
    ) -> Result<bool, Code> {
        let (s, p0, p1) = (
            i32v("seqId", seq_id)?,
            opt_i32("p0", p0, -1)?,
            opt_i32("p1", p1, -1)?,
        );
        self.with(|c| c.seq_rm(s, p0, p1).map_err(from_core))
    }

    /// Adds `dst` to the cells of `src` with positions in `[p0, p1)`.
    #[napi]
    pub fn seq_cp(
        &self,
        #[napi(ts_arg_type = "number")] src: Num,
        #[napi(ts_arg_type = "number")] dst: Num,
        #[napi(ts_arg_type = "number")] p0: Option<Num>,
        #[napi(ts_arg_type = "number")] p1: Option<Num>,
    ) -> Result<(), Code> {
        let (s, d) = (i32v("src", src)?, i32v("dst", dst)?);
        let (p0, p1) = (opt_i32("p0", p0, -1)?, opt_i32("p1", p1, -1)?);
        self.with(|c| c.seq_cp(s, d, p0, p1).map_err(from_core))
    }

    /// Frees every cell not owned by `seqId` and drops other sequences from the rest.
    #[napi]
    pub fn seq_keep(&self, #[napi(ts_arg_type = "number")] seq_id: Num) -> Result<(), Code> {
        let s = i32v("seqId", seq_id)?;
        self.with(|c| c.seq_keep(s).map_err(from_core))
    }

    /// Adds `delta` to positions of `seqId` in `[p0, p1)`; the K-shift is applied by `update`.
    /// `seqId` -1 matches no cell but still moves the search head to 0, as in llama.cpp.
    #[napi]
    pub fn seq_add(
        &self,
        #[napi(ts_arg_type = "number")] seq_id: Num,
        #[napi(ts_arg_type = "number")] p0: Num,
        #[napi(ts_arg_type = "number")] p1: Num,
        #[napi(ts_arg_type = "number")] delta: Num,
    ) -> Result<(), Code> {
        let (s, p0, p1, d) = range_args(seq_id, p0, p1, ("delta", delta))?;
        self.with(|c| c.seq_add(s, p0, p1, d).map_err(from_core))
    }

    /// Divides positions of `seqId` in `[p0, p1)` by `d` (> 0). `seqId` -1 matches no cell and
    /// changes nothing, as in llama.cpp.
    #[napi]
    pub fn seq_div(
        &self,
        #[napi(ts_arg_type = "number")] seq_id: Num,
        #[napi(ts_arg_type = "number")] p0: Num,
        #[napi(ts_arg_type = "number")] p1: Num,
        #[napi(ts_arg_type = "number")] d: Num,
    ) -> Result<(), Code> {
        let (s, p0, p1, d) = range_args(seq_id, p0, p1, ("d", d))?;
        self.with(|c| c.seq_div(s, p0, p1, d).map_err(from_core))
    }

    /// Largest position of `seqId`; 0 for an empty sequence, as llama.cpp of the seed's era.
    #[napi]
    pub fn seq_pos_max(&self, #[napi(ts_arg_type = "number")] seq_id: Num) -> Result<i32, Code> {
        let s = i32v("seqId", seq_id)?;
        self.with(|c| c.seq_pos_max(s).map_err(from_core))
    }

    /// Number of cells owned by `seqId`.
    #[napi]
    pub fn seq_cell_count(&self, #[napi(ts_arg_type = "number")] seq_id: Num) -> Result<u32, Code> {
        let s = i32v("seqId", seq_id)?;
        self.with(|c| c.seq_cell_count(s).map_err(from_core))
    }

    /// Frees every cell and zeroes the tensors.
    #[napi]
    pub fn clear(&self) -> Result<(), Code> {
        self.with(|c| {
            let cleared = c.clear().map_err(from_core);
            self.shared.account(c);
            cleared
        })
    }

    /// Schedules a defrag for the next `update`.
    #[napi]
    pub fn defrag(&self) -> Result<(), Code> {
        self.with(|c| {
            c.defrag();
            Ok(())
        })
    }

    /// Fragmentation as llama.cpp measures it (0 when n < 2048).
    #[napi]
    pub fn fragmentation(&self) -> Result<f64, Code> {
        self.with(|c| Ok(c.fragmentation() as f64))
    }

    /// Schedules a defrag when fragmentation exceeds `threshold`; returns whether it did.
    #[napi]
    pub fn schedule_defrag(
        &self,
        #[napi(ts_arg_type = "number")] threshold: Num,
    ) -> Result<bool, Code> {
        let threshold = threshold.0;
        if !threshold.is_finite() {
            return Err(err(
                Code::InvalidArg,
                format!("threshold must be a finite number, got {threshold}"),
            ));
        }
        self.with(|c| Ok(c.schedule_defrag(threshold as f32)))
    }

    /// Places a ubatch (llama.cpp's `find_slot`). Returns null when it does not fit.
    #[napi]
    pub fn find_slot(
        &self,
        #[napi(ts_arg_type = "UBatchInput")] ubatch: Obj<UBatchInput>,
    ) -> Result<Option<Slot>, Code> {
        let ub = convert::ubatch(&ubatch.0)?;
        self.with(|c| Ok(c.find_slot(&ub).map_err(from_core)?.map(slot)))
    }

    /// `findSlot` for a ubatch in llama_batch's packed form, without building a JS object: the
    /// fast path for decoding a token at a time. `pos` holds each token's position; `seqIds`
    /// holds one seq id per group, or, with `nSeqIds` (llama_batch's `n_seq_id`), `nSeqIds[g]`
    /// ids for group `g`, all groups' ids one after another. `nSeqTokens` is the tokens per group
    /// (default 1, llama.cpp's simple split). Returns the slot's first cell (`head`; the slot
    /// holds one cell per token, or per group in a recurrent cache, and `n` is the `n` getter),
    /// or null when the ubatch does not fit.
    #[napi]
    pub fn find_slot_packed(
        &self,
        #[napi(ts_arg_type = "Int32Array")] pos: I32s<'_>,
        #[napi(ts_arg_type = "Int32Array")] seq_ids: I32s<'_>,
        #[napi(ts_arg_type = "Int32Array | null")] n_seq_ids: Option<I32s<'_>>,
        #[napi(ts_arg_type = "number")] n_seq_tokens: Option<Num>,
    ) -> Result<Option<u32>, Code> {
        let ub = convert::packed_ubatch(pos.0, seq_ids.0, n_seq_ids.map(|n| n.0), n_seq_tokens)?;
        self.with(|c| Ok(c.find_slot(&ub).map_err(from_core)?.map(|s| s.head)))
    }

    /// The cache-side steps of llama.cpp's decode for one ubatch: head reset heuristic,
    /// `findSlot`, `n` update, head advance. Returns null when it does not fit.
    #[napi]
    pub fn prepare_batch(
        &self,
        #[napi(ts_arg_type = "UBatchInput")] ubatch: Obj<UBatchInput>,
        #[napi(ts_arg_type = "PrepareBatchOptions")] options: Option<Obj<PrepareBatchOptions>>,
    ) -> Result<Option<Slot>, Code> {
        let ub = convert::ubatch(&ubatch.0)?;
        let opts = PrepareOptions {
            advance_head: options.and_then(|o| o.0.advance_head).unwrap_or(true),
        };
        self.with(|c| Ok(c.prepare_batch(&ub, opts).map_err(from_core)?.map(slot)))
    }

    /// `prepareBatch` for a ubatch in llama_batch's packed form (the arrays of `findSlotPacked`),
    /// for a decode loop that refills the same `Int32Array`s. Returns the slot's first cell, or
    /// null when the ubatch does not fit; the slot's `n` is then the `n` getter and its `len`
    /// the tokens (groups, in a recurrent cache) passed, for `SlotRestorer.save`.
    #[napi]
    pub fn prepare_batch_packed(
        &self,
        #[napi(ts_arg_type = "Int32Array")] pos: I32s<'_>,
        #[napi(ts_arg_type = "Int32Array")] seq_ids: I32s<'_>,
        #[napi(ts_arg_type = "Int32Array | null")] n_seq_ids: Option<I32s<'_>>,
        #[napi(ts_arg_type = "number")] n_seq_tokens: Option<Num>,
        #[napi(ts_arg_type = "PrepareBatchOptions")] options: Option<Obj<PrepareBatchOptions>>,
    ) -> Result<Option<u32>, Code> {
        let ub = convert::packed_ubatch(pos.0, seq_ids.0, n_seq_ids.map(|n| n.0), n_seq_tokens)?;
        let opts = PrepareOptions {
            advance_head: options.and_then(|o| o.0.advance_head).unwrap_or(true),
        };
        self.with(|c| {
            Ok(c.prepare_batch(&ub, opts)
                .map_err(from_core)?
                .map(|s| s.head))
        })
    }

    /// Takes llama.cpp's slot restorer (`llama_kv_slot_restorer`) at the start of a decode: it
    /// keeps `head` and `n`; `save` every slot `prepareBatch` / `findSlot` returns, and `restore`
    /// on a failed ubatch to roll them all back as the seed does.
    #[napi]
    pub fn slot_restorer(&self) -> Result<SlotRestorer, Code> {
        let inner = self.with(|c| Ok(c.slot_restorer()))?;
        Ok(SlotRestorer::new(self.shared.clone(), inner))
    }

    /// Metadata of cell `index`.
    #[napi]
    pub fn cell(&self, #[napi(ts_arg_type = "number")] index: Num) -> Result<CellInfo, Code> {
        let i = u32v("index", index)?;
        self.with(|c| {
            let cell = c.cell(i).map_err(from_core)?;
            Ok(CellInfo {
                pos: cell.pos,
                delta: cell.delta,
                src: cell.src,
                tail: cell.tail,
                seq_ids: cell.seqs.iter().map(|s| s as i32).collect(),
            })
        })
    }

    /// Every cell's metadata (pos, delta, src, tail, sequence sets) as typed arrays, in one call.
    #[napi]
    pub fn cells(&self) -> Result<CellColumns, Code> {
        self.with(|c| {
            let cols = c.cell_columns().map_err(from_core)?;
            Ok(CellColumns {
                pos: Int32Array::new(cols.pos),
                delta: Int32Array::new(cols.delta),
                src: Int32Array::new(cols.src),
                tail: Int32Array::new(cols.tail),
                seq_offsets: Uint32Array::new(cols.seq_offsets),
                seq_ids: Int32Array::new(cols.seq_ids),
            })
        })
    }

    /// A snapshot of every cell, listing at most `nSeqMax` (default 4) sequences per cell.
    #[napi]
    pub fn view(
        &self,
        #[napi(ts_arg_type = "number")] n_seq_max: Option<Num>,
    ) -> Result<CacheView, Code> {
        let limit = n_seq_max.map_or(Ok(4), |n| u32v("nSeqMax", n))? as usize;
        self.with(|c| {
            let v = c.view(limit);
            Ok(CacheView {
                pos: Int32Array::new(v.pos),
                seq_ids: v.seqs,
                used_cells: v.used_cells,
                token_count: v.token_count as f64,
                max_contiguous: v.max_contiguous,
                max_contiguous_idx: v.max_contiguous_idx,
            })
        })
    }

    /// Raw K rows of cells `[firstCell, firstCell + nCells)` in the cache's type.
    #[napi]
    pub fn read_k(
        &self,
        #[napi(ts_arg_type = "number")] layer: Num,
        #[napi(ts_arg_type = "number")] first_cell: Num,
        #[napi(ts_arg_type = "number")] n_cells: Num,
    ) -> Result<Buffer, Code> {
        self.read(layer, false, first_cell, n_cells)
    }

    /// Raw V rows (one row per cell, untransposed whatever the layout).
    #[napi]
    pub fn read_v(
        &self,
        #[napi(ts_arg_type = "number")] layer: Num,
        #[napi(ts_arg_type = "number")] first_cell: Num,
        #[napi(ts_arg_type = "number")] n_cells: Num,
    ) -> Result<Buffer, Code> {
        self.read(layer, true, first_cell, n_cells)
    }

    /// Writes raw K rows from `firstCell` (length: a multiple of the row size).
    #[napi]
    pub fn write_k(
        &self,
        #[napi(ts_arg_type = "number")] layer: Num,
        #[napi(ts_arg_type = "number")] first_cell: Num,
        #[napi(ts_arg_type = "Uint8Array")] data: Bytes,
    ) -> Result<(), Code> {
        self.write(layer, false, first_cell, &data.0)
    }

    /// Writes raw V rows (one row per cell; transposed on the way in when needed).
    #[napi]
    pub fn write_v(
        &self,
        #[napi(ts_arg_type = "number")] layer: Num,
        #[napi(ts_arg_type = "number")] first_cell: Num,
        #[napi(ts_arg_type = "Uint8Array")] data: Bytes,
    ) -> Result<(), Code> {
        self.write(layer, true, first_cell, &data.0)
    }

    /// K rows as f32 (dequantized).
    #[napi(js_name = "readKF32")]
    pub fn read_k_f32(
        &self,
        #[napi(ts_arg_type = "number")] layer: Num,
        #[napi(ts_arg_type = "number")] first_cell: Num,
        #[napi(ts_arg_type = "number")] n_cells: Num,
    ) -> Result<Float32Array, Code> {
        self.read_f32(layer, false, first_cell, n_cells)
    }

    /// V rows as f32 (dequantized).
    #[napi(js_name = "readVF32")]
    pub fn read_v_f32(
        &self,
        #[napi(ts_arg_type = "number")] layer: Num,
        #[napi(ts_arg_type = "number")] first_cell: Num,
        #[napi(ts_arg_type = "number")] n_cells: Num,
    ) -> Result<Float32Array, Code> {
        self.read_f32(layer, true, first_cell, n_cells)
    }

    /// Writes f32 K rows, converted to the cache's type.
    #[napi(js_name = "writeKF32")]
    pub fn write_k_f32(
        &self,
        #[napi(ts_arg_type = "number")] layer: Num,
        #[napi(ts_arg_type = "number")] first_cell: Num,
        #[napi(ts_arg_type = "Float32Array")] values: Floats,
    ) -> Result<(), Code> {
        self.write_f32(layer, false, first_cell, &values.0)
    }

    /// Writes f32 V rows, converted to the cache's type.
    #[napi(js_name = "writeVF32")]
    pub fn write_v_f32(
        &self,
        #[napi(ts_arg_type = "number")] layer: Num,
        #[napi(ts_arg_type = "number")] first_cell: Num,
        #[napi(ts_arg_type = "Float32Array")] values: Floats,
    ) -> Result<(), Code> {
        self.write_f32(layer, true, first_cell, &values.0)
    }

    /// Applies a pending K-shift (given `rope`, or the model's RoPE for a cache made by
    /// `fromModel`) and a pending defrag, synchronously.
    #[napi]
    pub fn update_sync(
        &self,
        #[napi(ts_arg_type = "UpdateOptions")] options: Option<Obj<UpdateOptions>>,
    ) -> Result<UpdateReport, Code> {
        let (job, _) = update_job(options, &self.model_shift)?;
        self.run_sync(job)
    }

    /// Applies a pending K-shift (given `rope`, or the model's RoPE for a cache made by
    /// `fromModel`) and a pending defrag on the threadpool.
    #[napi(ts_return_type = "Promise<UpdateReport>")]
    pub fn update(
        &self,
        env: Env,
        #[napi(ts_arg_type = "UpdateOptions")] options: Option<Obj<UpdateOptions>>,
    ) -> Result<JsPromise, Code> {
        let (job, signal) = update_job(options, &self.model_shift)?;
        self.run_async(&env, job, None, signal)
    }

    /// Bytes `stateWrite(seqId, options)` will produce.
    #[napi]
    pub fn state_size(
        &self,
        #[napi(ts_arg_type = "number")] seq_id: Option<Num>,
        #[napi(ts_arg_type = "SaveOptions")] options: Option<Obj<SaveOptions>>,
    ) -> Result<f64, Code> {
        let seq = opt_i32("seqId", seq_id, -1)?;
        let (opts, ..) = save_options(options)?;
        self.with(|c| {
            Ok(c.state_size(seq, opts.layout, opts.n_stream)
                .map_err(from_core)? as f64)
        })
    }

    /// The KV state of sequence `seqId` (-1, the default: the whole cache) in llama.cpp's
    /// format (`llama_state_seq_get_data`'s KV part), synchronously.
    #[napi]
    pub fn state_write_sync(
        &self,
        env: Env,
        #[napi(ts_arg_type = "number")] seq_id: Option<Num>,
        #[napi(ts_arg_type = "SaveOptions")] options: Option<Obj<SaveOptions>>,
    ) -> Result<Buffer, Code> {
        let seq = opt_i32("seqId", seq_id, -1)?;
        let (opts, ..) = save_options(options)?;
        self.with(|c| {
            let plan = c
                .state_out(seq, opts.layout, opts.n_stream)
                .map_err(from_core)?;
            if plan.size() < jobs::NODE_BUFFER_FROM {
                let payload = c.state_write(seq, opts.layout, opts.n_stream, None);
                return Ok(payload.map_err(from_core)?.into());
            }
            let mut buf = jobs::node_buffer(&env, plan.size())?;
            c.state_out_all(&plan, buf.as_mut(), None)
                .map_err(from_core)?;
            Ok(buf)
        })
    }

    /// The KV state of sequence `seqId` (-1: the whole cache), on the threadpool.
    #[napi(ts_return_type = "Promise<Buffer>")]
    pub fn state_write(
        &self,
        env: Env,
        #[napi(ts_arg_type = "number")] seq_id: Option<Num>,
        #[napi(ts_arg_type = "SaveOptions")] options: Option<Obj<SaveOptions>>,
    ) -> Result<JsPromise, Code> {
        let seq = opt_i32("seqId", seq_id, -1)?;
        let (opts, _, progress, signal) = save_options(options)?;
        // an idle cache is what the task will find (calls from now on queue or are busy), so
        // the Buffer can come from Node's allocator here; a failed plan is left to the task,
        // which rejects with it
        let plan = match self.shared.queue.is_pending() {
            true => None,
            false => self.with(|c| Ok(c.state_out(seq, opts.layout, opts.n_stream).ok()))?,
        };
        let plan = plan.filter(|p| p.size() >= jobs::NODE_BUFFER_FROM);
        let (planned, failure) = match plan.map(|p| (jobs::node_buffer(&env, p.size()), p)) {
            Some((Ok(buf), plan)) => (Some((plan, buf)), None),
            Some((Err(e), _)) => (None, Some(e)),
            None => (None, None),
        };
        let job = StateWriteJob {
            seq,
            opts,
            planned,
            failure,
        };
        self.run_async(&env, job, progress, signal)
    }

    /// Writes the KV state of `seqId` (-1, the default: the whole cache) into the front of
    /// `buffer`, without allocating a copy, and returns its size in bytes (`stateSize`). Fails
    /// with ERR_KV_INVALID_ARG, writing nothing, when `buffer` is smaller. Synchronous.
    #[napi]
    pub fn state_write_into_sync(
        &self,
        #[napi(ts_arg_type = "Uint8Array")] buffer: Bytes,
        #[napi(ts_arg_type = "number")] seq_id: Option<Num>,
        #[napi(ts_arg_type = "SaveOptions")] options: Option<Obj<SaveOptions>>,
    ) -> Result<f64, Code> {
        let seq = opt_i32("seqId", seq_id, -1)?;
        let (opts, ..) = save_options(options)?;
        self.run_sync(StateWriteIntoJob {
            out: buffer.0,
            seq,
            opts,
        })
    }

    /// `stateWriteIntoSync` on the threadpool: do not touch `buffer` until the promise settles.
    #[napi(ts_return_type = "Promise<number>")]
    pub fn state_write_into(
        &self,
        env: Env,
        #[napi(ts_arg_type = "Uint8Array")] buffer: Bytes,
        #[napi(ts_arg_type = "number")] seq_id: Option<Num>,
        #[napi(ts_arg_type = "SaveOptions")] options: Option<Obj<SaveOptions>>,
    ) -> Result<JsPromise, Code> {
        let seq = opt_i32("seqId", seq_id, -1)?;
        let (opts, _, progress, signal) = save_options(options)?;
        let job = StateWriteIntoJob {
            out: buffer.0,
            seq,
            opts,
        };
        self.run_async(&env, job, progress, signal)
    }

    /// Restores a state into sequence `seqId` (-1: the whole cache), detecting the layout.
    /// Transactional: on any error the cache is exactly as before.
    #[napi]
    pub fn state_read_sync(
        &self,
        #[napi(ts_arg_type = "Uint8Array")] data: Bytes,
        #[napi(ts_arg_type = "number")] seq_id: Option<Num>,
        #[napi(ts_arg_type = "LoadOptions")] options: Option<Obj<LoadOptions>>,
    ) -> Result<ReadResult, Code> {
        let seq = opt_i32("seqId", seq_id, -1)?;
        let (opts, ..) = load_options(options)?;
        self.run_sync(StateReadJob {
            data: data.0,
            seq,
            opts,
        })
    }

    /// Restores a state on the threadpool (transactional). `data` is read in place, without a
    /// copy: do not modify it until the promise settles.
    #[napi(ts_return_type = "Promise<ReadResult>")]
    pub fn state_read(
        &self,
        env: Env,
        #[napi(ts_arg_type = "Uint8Array")] data: Bytes,
        #[napi(ts_arg_type = "number")] seq_id: Option<Num>,
        #[napi(ts_arg_type = "LoadOptions")] options: Option<Obj<LoadOptions>>,
    ) -> Result<JsPromise, Code> {
        let seq = opt_i32("seqId", seq_id, -1)?;
        let (opts, progress, signal) = load_options(options)?;
        self.run_async(
            &env,
            StateReadJob {
                data: data.0,
                seq,
                opts,
            },
            progress,
            signal,
        )
    }

    /// A Readable stream of the KV state of `seqId` (-1, the default: the whole cache): the
    /// bytes `stateWrite(seqId, options)` returns, copied chunk by chunk straight from the
    /// tensors, so a state of any size (above 4 GiB too, which no Buffer holds) streams with
    /// memory for a chunk or two. `size` is the total in bytes (null until the stream holds the
    /// cache). The stream holds the cache as an async call does until its last byte or until it
    /// is destroyed: it starts when the calls queued before it have settled, and meanwhile
    /// synchronous calls throw ERR_KV_BUSY and async calls wait. Needs Node.js 20.16 or later.
    #[napi(ts_return_type = "import('node:stream').Readable & { readonly size: number | null }")]
    pub fn create_state_read_stream(
        &self,
        env: Env,
        #[napi(ts_arg_type = "number")] seq_id: Option<Num>,
        #[napi(ts_arg_type = "ReadStreamOptions")] options: Option<Obj<ReadStreamOptions>>,
    ) -> Result<RawValue, Code> {
        let seq = opt_i32("seqId", seq_id, -1)?;
        let o = options.map(|o| o.0);
        let layout = jobs::layout(o.as_ref().and_then(|o| o.layout.as_deref()))?;
        let n_stream = o
            .as_ref()
            .and_then(|o| o.n_stream)
            .map_or(Ok(1), |n| u32v("nStream", n))?;
        let chunk = chunk_size(o.as_ref().and_then(|o| o.chunk_size))?;
        let work = Work::Out {
            seq,
            layout: layout.unwrap_or(Layout::Streams),
            n_stream,
            state: None,
        };
        let signal = o.as_ref().and_then(|o| o.signal.as_ref());
        self.open_stream(&env, work, c"read", chunk, signal)
    }

    /// A Writable stream that loads a state (the bytes of `stateWrite`, or of a
    /// `createStateReadStream`) into sequence `seqId` (-1, the default: the whole cache) as it
    /// arrives: the header and cell metadata are kept until the cells are placed, every later
    /// byte goes straight to the tensors, so a state of any size loads with memory for a chunk
    /// or two. `result` holds the ReadResult once 'finish' is emitted. A load that fails
    /// (ERR_KV_* errors emitted on the stream), ends early, or is destroyed or aborted before
    /// 'finish' leaves the cells and every live cell's rows as they were (rows of cells that
    /// held data before are kept aside while the load runs). Holds the cache as
    /// `createStateReadStream` does. Needs Node.js 20.16 or later.
    #[napi(
        ts_return_type = "import('node:stream').Writable & { readonly result: ReadResult | null }"
    )]
    pub fn create_state_write_stream(
        &self,
        env: Env,
        #[napi(ts_arg_type = "number")] seq_id: Option<Num>,
        #[napi(ts_arg_type = "WriteStreamOptions")] options: Option<Obj<WriteStreamOptions>>,
    ) -> Result<RawValue, Code> {
        let seq = opt_i32("seqId", seq_id, -1)?;
        let o = options.map(|o| o.0);
        let opts = ReadOptions {
            layout: jobs::layout(o.as_ref().and_then(|o| o.layout.as_deref()))?,
            allow_scattered: o.as_ref().and_then(|o| o.allow_scattered).unwrap_or(false),
            part: None,
        };
        let chunk = chunk_size(o.as_ref().and_then(|o| o.chunk_size))?;
        let work = Work::In {
            seq,
            opts,
            state: None,
        };
        let signal = o.as_ref().and_then(|o| o.signal.as_ref());
        self.open_stream(&env, work, c"write", chunk, signal)
    }

    /// Saves sequence `seqId` with its prompt `tokens` as a llama.cpp sequence file ('ggsq'),
    /// atomically (a failed save leaves the previous file intact), synchronously.
    #[napi]
    pub fn save_sequence_file_sync(
        &self,
        #[napi(ts_arg_type = "string | Uint8Array")] path: Unknown<'_>,
        #[napi(ts_arg_type = "number")] seq_id: Num,
        #[napi(ts_arg_type = "ArrayLike<number> | Int32Array")] tokens: Tokens,
        #[napi(ts_arg_type = "SaveOptions")] options: Option<Obj<SaveOptions>>,
    ) -> Result<(), Code> {
        let seq = i32v("seqId", seq_id)?;
        let (opts, arch, ..) = save_options(options)?;
        self.run_sync(SaveFileJob {
            path: args::path("path", &path)?,
            seq: Some(seq),
            arch,
            tokens: tokens.0,
            opts,
        })
    }

    /// Saves a sequence file on the threadpool.
    #[napi(ts_return_type = "Promise<void>")]
    pub fn save_sequence_file(
        &self,
        env: Env,
        #[napi(ts_arg_type = "string | Uint8Array")] path: Unknown<'_>,
        #[napi(ts_arg_type = "number")] seq_id: Num,
        #[napi(ts_arg_type = "ArrayLike<number> | Int32Array")] tokens: Tokens,
        #[napi(ts_arg_type = "SaveOptions")] options: Option<Obj<SaveOptions>>,
    ) -> Result<JsPromise, Code> {
        let seq = i32v("seqId", seq_id)?;
        let (opts, arch, progress, signal) = save_options(options)?;
        self.run_async(
            &env,
            SaveFileJob {
                path: args::path("path", &path)?,
                seq: Some(seq),
                arch,
                tokens: tokens.0,
                opts,
            },
            progress,
            signal,
        )
    }

    /// Loads a sequence file ('ggsq', any supported version and layout) into `destSeqId` and
    /// returns its tokens. Transactional.
    #[napi]
    pub fn load_sequence_file_sync(
        &self,
        #[napi(ts_arg_type = "string | Uint8Array")] path: Unknown<'_>,
        #[napi(ts_arg_type = "number")] dest_seq_id: Num,
        #[napi(ts_arg_type = "LoadOptions")] options: Option<Obj<LoadOptions>>,
    ) -> Result<LoadedFile, Code> {
        let dest = i32v("destSeqId", dest_seq_id)?;
        let (opts, ..) = load_options(options)?;
        self.run_sync(LoadFileJob {
            path: args::path("path", &path)?,
            dest: Some(dest),
            opts,
        })
    }

    /// Loads a sequence file on the threadpool.
    #[napi(ts_return_type = "Promise<LoadedFile>")]
    pub fn load_sequence_file(
        &self,
        env: Env,
        #[napi(ts_arg_type = "string | Uint8Array")] path: Unknown<'_>,
        #[napi(ts_arg_type = "number")] dest_seq_id: Num,
        #[napi(ts_arg_type = "LoadOptions")] options: Option<Obj<LoadOptions>>,
    ) -> Result<JsPromise, Code> {
        let dest = i32v("destSeqId", dest_seq_id)?;
        let (opts, progress, signal) = load_options(options)?;
        self.run_async(
            &env,
            LoadFileJob {
                path: args::path("path", &path)?,
                dest: Some(dest),
                opts,
            },
            progress,
            signal,
        )
    }

    /// Saves the whole cache as a llama.cpp session file ('ggsn') with `tokens`, atomically.
    #[napi]
    pub fn save_session_file_sync(
        &self,
        #[napi(ts_arg_type = "string | Uint8Array")] path: Unknown<'_>,
        #[napi(ts_arg_type = "ArrayLike<number> | Int32Array")] tokens: Tokens,
        #[napi(ts_arg_type = "SaveOptions")] options: Option<Obj<SaveOptions>>,
    ) -> Result<(), Code> {
        let (opts, arch, ..) = save_options(options)?;
        self.run_sync(SaveFileJob {
            path: args::path("path", &path)?,
            seq: None,
            arch,
            tokens: tokens.0,
            opts,
        })
    }

    /// Saves a session file on the threadpool.
    #[napi(ts_return_type = "Promise<void>")]
    pub fn save_session_file(
        &self,
        env: Env,
        #[napi(ts_arg_type = "string | Uint8Array")] path: Unknown<'_>,
        #[napi(ts_arg_type = "ArrayLike<number> | Int32Array")] tokens: Tokens,
        #[napi(ts_arg_type = "SaveOptions")] options: Option<Obj<SaveOptions>>,
    ) -> Result<JsPromise, Code> {
        let (opts, arch, progress, signal) = save_options(options)?;
        self.run_async(
            &env,
            SaveFileJob {
                path: args::path("path", &path)?,
                seq: None,
                arch,
                tokens: tokens.0,
                opts,
            },
            progress,
            signal,
        )
    }

    /// Loads a session file ('ggsn', seed era or today's) into the whole cache. Transactional.
    #[napi]
    pub fn load_session_file_sync(
        &self,
        #[napi(ts_arg_type = "string | Uint8Array")] path: Unknown<'_>,
        #[napi(ts_arg_type = "LoadOptions")] options: Option<Obj<LoadOptions>>,
    ) -> Result<LoadedFile, Code> {
        let (opts, ..) = load_options(options)?;
        self.run_sync(LoadFileJob {
            path: args::path("path", &path)?,
            dest: None,
            opts,
        })
    }

    /// Loads a session file on the threadpool.
    #[napi(ts_return_type = "Promise<LoadedFile>")]
    pub fn load_session_file(
        &self,
        env: Env,
        #[napi(ts_arg_type = "string | Uint8Array")] path: Unknown<'_>,
        #[napi(ts_arg_type = "LoadOptions")] options: Option<Obj<LoadOptions>>,
    ) -> Result<JsPromise, Code> {
        let (opts, progress, signal) = load_options(options)?;
        self.run_async(
            &env,
            LoadFileJob {
                path: args::path("path", &path)?,
                dest: None,
                opts,
            },
            progress,
            signal,
        )
    }
}

/// `(seqId, p0, p1, <named value>)` of `seqAdd` / `seqDiv`.
fn range_args(
    seq_id: Num,
    p0: Num,
    p1: Num,
    (name, v): (&str, Num),
) -> JsResult<(i32, i32, i32, i32)> {
    Ok((
        i32v("seqId", seq_id)?,
        i32v("p0", p0)?,
        i32v("p1", p1)?,
        i32v(name, v)?,
    ))
}

fn update_job(
    options: Option<Obj<UpdateOptions>>,
    model_shift: &Option<core::ShiftParams>,
) -> JsResult<(UpdateJob, Option<Signal>)> {
    let mut options = options.map(|o| o.0);
    let signal = options.as_mut().and_then(|o| o.signal.take());
    let (shift, max_nodes) = convert::shift(&options)?;
    // a cache made by fromModel knows its model's RoPE; an explicit `rope` still wins
    let shift = shift.or_else(|| model_shift.clone());
    Ok((UpdateJob { shift, max_nodes }, signal))
}

type SaveParts = (WriteOptions, String, Option<ProgressFn>, Option<Signal>);

fn save_options(options: Option<Obj<SaveOptions>>) -> JsResult<SaveParts> {
    let Some(Obj(o)) = options else {
        return Ok((WriteOptions::default(), "llama".into(), None, None));
    };
    let opts = WriteOptions {
        version: o.version.map(|v| u32v("version", v)).transpose()?,
        layout: jobs::layout(o.layout.as_deref())?.unwrap_or(Layout::Streams),
        n_stream: o.n_stream.map_or(Ok(1), |n| u32v("nStream", n))?,
    };
    Ok((
        opts,
        o.arch.unwrap_or_else(|| "llama".into()),
        o.on_progress,
        o.signal,
    ))
}

type LoadParts = (ReadOptions, Option<ProgressFn>, Option<Signal>);

fn load_options(options: Option<Obj<LoadOptions>>) -> JsResult<LoadParts> {
    let Some(Obj(o)) = options else {
        return Ok((ReadOptions::default(), None, None));
    };
    let opts = ReadOptions {
        layout: jobs::layout(o.layout.as_deref())?,
        allow_scattered: o.allow_scattered.unwrap_or(false),
        part: jobs::part(o.part.as_deref())?,
    };
    Ok((opts, o.on_progress, o.signal))
}

/// A stream's chunk size option: 1 byte to 1 GiB, default [`state_stream::DEFAULT_CHUNK`].
fn chunk_size(v: Option<f64>) -> JsResult<u32> {
    let Some(v) = v else {
        return Ok(state_stream::DEFAULT_CHUNK);
    };
    let n = u32v("chunkSize", v)?;
    if n == 0 || n > 1 << 30 {
        return Err(err(
            Code::OutOfRange,
            format!("chunkSize must be 1 to 1073741824 bytes, got {n}"),
        ));
    }
    Ok(n)
}
