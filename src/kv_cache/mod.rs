//! The `KvCache` class: converts arguments, locks the core cache, maps results. No cache logic.
//!
//! This file holds the class itself (construction, disposal, metadata getters) and the helpers
//! every method uses to reach the cache; the methods of each concern are in the submodules,
//! each its own `#[napi] impl KvCache` block: sequences and slot placement ([`sequences`]),
//! K/V rows and `update` ([`tensors`]), state payloads and files ([`state`]), state streams
//! ([`streams`]). Submodules use this file; it uses none of them.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use llama_kv_cache as core;
use llama_kv_cache::CacheParams;
use napi::bindgen_prelude::*;
use napi_derive::napi;

use crate::args::{u32v, Num, Obj};
use crate::error::{err, from_core, guard, js_error, Code, JsResult};
use crate::handle::Handle;
use crate::options;
use crate::queue::{Deferred, JsPromise, Shared};
use crate::signal::Signal;
use crate::tasks::{aborted, CacheTask, Control, Job, ProgressFn};
use crate::types::{
    CacheView, CellColumns, CellInfo, CudaDevice, CudaStatus, DeviceBytes, KvCacheOptions,
    MemoryPart,
};

mod restorer;
pub(crate) mod sequences;
pub(crate) mod state;
pub(crate) mod streams;
pub(crate) mod tensors;

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
        self.shared.handle.report(0);
        Ok(())
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
        let cache = core::SeedCache::with_allocator(params, &mut alloc).map_err(from_core)?;
        Ok(KvCache::from_memory(env, Box::new(cache), model_shift))
    }

    /// The class around a memory of any kind.
    pub(crate) fn from_memory(
        env: &Env,
        memory: Box<dyn core::Memory>,
        model_shift: Option<core::ShiftParams>,
    ) -> Self {
        // V8 is told about host memory only, as it gets written
        let shared = Arc::new(Shared::new(Handle::new(env, memory)));
        KvCache {
            shared,
            model_shift,
        }
    }

    /// Runs a synchronous call that needs the seed's unified cache (`kv` and `recurrent`
    /// kinds; other kinds refuse with `ERR_KV_UNSUPPORTED`, naming the method `what` and their
    /// kind).
    fn with<T>(
        &self,
        what: &str,
        f: impl FnOnce(&mut core::SeedCache) -> JsResult<T>,
    ) -> JsResult<T> {
        self.shared.with(|m| f(m.kv(what).map_err(from_core)?))
    }

    /// Runs a synchronous call on a memory of any kind.
    fn with_memory<T>(&self, f: impl FnOnce(&mut dyn core::Memory) -> JsResult<T>) -> JsResult<T> {
        self.shared.with(f)
    }

    /// Sets how the memory goes back to the OS (`None`: the default).
    pub(crate) fn set_release(&self, release: Option<core::Release>) -> JsResult<()> {
        match release {
            Some(r) => self.with_memory(|m| m.set_release(r).map_err(from_core)),
            None => Ok(()),
        }
    }

    /// Runs `job` on the calling thread (refused while the cache is busy).
    pub(crate) fn run_sync<J: Job>(&self, mut job: J) -> JsResult<J::Js> {
        self.with_memory(|c| {
            let output = job.run(c, &mut |_, _| true);
            self.shared.handle.account(c);
            let output = output?;
            J::to_js(output)
        })
    }

    /// Queues `job` behind the cache's pending operations and returns its promise.
    pub(crate) fn run_async<J: Job + 'static>(
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
                self.with_memory(|_| Ok(()))?;
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
            let k = options::widths("nEmbdKGqa", &options.n_embd_k_gqa)?;
            let v = match &options.n_embd_v_gqa {
                Some(w) => options::widths("nEmbdVGqa", w)?,
                None => k.clone(),
            };
            let params = CacheParams {
                size: u32v("size", options.size)?,
                n_layer: u32v("nLayer", options.n_layer)?,
                n_embd_k_gqa: k,
                n_embd_v_gqa: v,
                n_embd_k_s: options.n_embd_k_s.map_or(Ok(0), |x| u32v("nEmbdKS", x))?,
                n_embd_v_s: options.n_embd_v_s.map_or(Ok(0), |x| u32v("nEmbdVS", x))?,
                type_k: options::ggml_type("typeK", options.type_k, core::GgmlType::F16)?,
                type_v: options::ggml_type("typeV", options.type_v, core::GgmlType::F16)?,
                flash_attn: options.flash_attn.unwrap_or(false),
                recurrent: options.recurrent.unwrap_or(false),
                can_shift: options.can_shift.unwrap_or(true),
                n_seq_max: options.n_seq_max.map_or(Ok(1), |x| u32v("nSeqMax", x))?,
                n_rot_k: options.n_rot_k.map_or(Ok(0), |x| u32v("nRotK", x))?,
                n_rot_v: options.n_rot_v.map_or(Ok(0), |x| u32v("nRotV", x))?,
                cell_ext: options::cell_ext("cellExt", options.cell_ext)?,
                mrope: options.mrope.unwrap_or(false),
                no_v: options.no_v.unwrap_or(false),
                // the constructor's recurrent cache is the seed's; fromModel builds 0.1.161's
                recurrent_rules: core::RecurrentRules::Seed,
            };
            let release = options::release(options.release_memory, options.release_delay_ms)?;
            let cache = KvCache::from_params(&env, params, &options.device, None)?;
            cache.set_release(release)?;
            Ok(cache)
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
            if self.shared.handle.take_for_dispose()?.is_some() {
                self.shared.handle.report(0);
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

    /// How the memory of host tensors goes back to the OS: the `releaseMemory` option (`true`:
    /// by decay, `'now'`, or `false`).
    #[napi(getter, ts_return_type = "boolean | 'now'")]
    pub fn release_memory(&self) -> Result<Either<bool, &'static str>, Code> {
        self.with_memory(|m| Ok(options::release_name(m.release())))
    }

    /// Hands back to the OS now the pages of every free cell, also those still within the
    /// decay's delay: for an app about to go idle, or before measuring its memory.
    #[napi]
    pub fn release_unused(&self) -> Result<(), Code> {
        self.with_memory(|m| {
            let released = m.release_unused().map_err(from_core);
            self.shared.handle.account(m);
            released
        })
    }

    /// Host tensor bytes the cache holds in memory now: tensors are mapped lazily by the OS, so
    /// a tensor counts once it is written, and no longer once `clear()` has handed its memory
    /// back (see `releaseMemory`). This is also what V8 is told the cache costs.
    #[napi(getter)]
    pub fn resident_bytes(&self) -> Result<f64, Code> {
        self.with_memory(|c| Ok(c.host_resident_bytes() as f64))
    }

    /// What memory this is: `'kv'` (the seed's unified cache), `'recurrent'` (the seed's
    /// recurrent mode, for Mamba-style models: the seed's rules, or 0.1.161's when built by
    /// `fromModel`), `'iswa'` (llama.cpp 0.1.161's sliding-window memory: a base cache for
    /// full-attention layers and a window cache for the others), `'hybrid'` (0.1.161's
    /// attention cache and recurrent memory side by side) or `'kv-streams'` (`fromModel` with
    /// `kvUnified: false` and several sequences: 0.1.161's cache of a stream per sequence,
    /// `parts[0].nStream`). Only `'kv'` and `'recurrent'` have the seed's own members (see
    /// `SeedOnly` in index.d.ts); the others throw `ERR_KV_UNSUPPORTED` there.
    #[napi(
        getter,
        ts_return_type = "'kv' | 'recurrent' | 'iswa' | 'hybrid' | 'kv-streams'"
    )]
    pub fn kind(&self) -> Result<String, Code> {
        self.with_memory(|c| Ok(c.kind().into()))
    }

    /// Each part of the memory, in state order: its role, model layers, cells, streams, window,
    /// K/V types and rotation.
    #[napi(getter)]
    pub fn parts(&self) -> Result<Vec<MemoryPart>, Code> {
        self.with_memory(|c| Ok(c.parts().iter().map(memory_part).collect()))
    }

    /// Tensor bytes per device.
    #[napi(getter)]
    pub fn bytes_per_device(&self) -> Result<Vec<DeviceBytes>, Code> {
        self.with("bytesPerDevice", |c| {
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
        self.shared.handle.is_disposed()
    }

    /// Number of cells.
    #[napi(getter)]
    pub fn size(&self) -> Result<u32, Code> {
        self.with("size", |c| Ok(c.size()))
    }

    /// Number of layers.
    #[napi(getter)]
    pub fn n_layer(&self) -> Result<u32, Code> {
        self.with_memory(|c| Ok(c.n_layer()))
    }

    /// Where the next slot search starts.
    #[napi(getter)]
    pub fn head(&self) -> Result<u32, Code> {
        self.with("head", |c| Ok(c.head()))
    }

    /// Cells the attention looks at (set by slot placement).
    #[napi(getter)]
    pub fn n(&self) -> Result<u32, Code> {
        self.with("n", |c| Ok(c.n()))
    }

    /// llama.cpp's `used` counter.
    #[napi(getter)]
    pub fn used_cells(&self) -> Result<u32, Code> {
        self.with("usedCells", |c| Ok(c.used_cells()))
    }

    /// Sum over cells of the number of owning sequences (`llama_kv_self_n_tokens`).
    #[napi(getter)]
    pub fn n_tokens(&self) -> Result<f64, Code> {
        self.with("nTokens", |c| Ok(c.n_tokens() as f64))
    }

    /// Largest position in the cache, -1 when empty.
    #[napi(getter)]
    pub fn pos_max(&self) -> Result<i32, Code> {
        self.with("posMax", |c| Ok(c.pos_max()))
    }

    /// One past the last occupied cell (the seed's `cell_max()`), 0 when empty.
    #[napi(getter)]
    pub fn cell_end(&self) -> Result<u32, Code> {
        self.with("cellEnd", |c| Ok(c.cell_max()))
    }

    /// @deprecated Use the `cellEnd` getter; `cellMax()` goes in the next minor version.
    #[napi]
    pub fn cell_max(&self) -> Result<u32, Code> {
        self.with("cellMax", |c| Ok(c.cell_max()))
    }

    /// Whether a K-shift is possible.
    #[napi(getter)]
    pub fn can_shift(&self) -> Result<bool, Code> {
        self.with_memory(|c| Ok(c.can_shift()))
    }

    /// Whether positions changed since the last K-shift.
    #[napi(getter)]
    pub fn has_shift(&self) -> Result<bool, Code> {
        self.with_memory(|c| Ok(c.has_shift()))
    }

    /// Whether a defrag is scheduled for the next `update`.
    #[napi(getter)]
    pub fn defrag_pending(&self) -> Result<bool, Code> {
        self.with("defragPending", |c| Ok(c.defrag_pending()))
    }

    /// Whether V is stored transposed (flash attention off, not recurrent).
    #[napi(getter)]
    pub fn v_trans(&self) -> Result<bool, Code> {
        self.with("vTrans", |c| Ok(c.v_trans()))
    }

    /// Whether the cache is recurrent.
    #[napi(getter)]
    pub fn recurrent(&self) -> Result<bool, Code> {
        self.with("recurrent", |c| Ok(c.recurrent()))
    }

    /// Padding of `n`: 256 with flash attention, else 32.
    #[napi(getter)]
    pub fn padding(&self) -> Result<u32, Code> {
        self.with("padding", |c| Ok(c.padding()))
    }

    /// What each cell keeps beside its position: 'none', 'pos2' or 'pos2-tok' (M-RoPE and
    /// PLE models; saved in state files after each cell's seq id count).
    #[napi(getter)]
    pub fn cell_ext(&self) -> Result<String, Code> {
        self.with("cellExt", |c| Ok(c.params().cell_ext.name().to_string()))
    }

    /// Number of sequences the cache tracks (seq ids `0..nSeqMax`).
    #[napi(getter)]
    pub fn n_seq_max(&self) -> Result<u32, Code> {
        self.with_memory(|c| Ok(c.n_seq_max()))
    }

    /// Whether the cache holds M-RoPE positions (seqAdd / seqDiv are refused).
    #[napi(getter)]
    pub fn mrope(&self) -> Result<bool, Code> {
        self.with("mrope", |c| Ok(c.params().mrope))
    }

    /// K type name.
    #[napi(getter)]
    pub fn type_k(&self) -> Result<String, Code> {
        self.with("typeK", |c| Ok(c.type_k().name().to_string()))
    }

    /// V type name.
    #[napi(getter)]
    pub fn type_v(&self) -> Result<String, Code> {
        self.with("typeV", |c| Ok(c.type_v().name().to_string()))
    }

    /// Bytes of all K and V tensors, over every part (a recurrent part's R and S included):
    /// `sizeKBytes + sizeVBytes`, and `planMemory(...).bytes` of a cache `fromModel` built.
    #[napi(getter)]
    pub fn total_bytes(&self) -> Result<f64, Code> {
        self.with_memory(|c| Ok(c.total_size() as f64))
    }

    /// @deprecated Use `totalBytes`; `totalSize` goes in the next minor version.
    #[napi(getter)]
    pub fn total_size(&self) -> Result<f64, Code> {
        self.total_bytes()
    }

    /// Bytes of all K tensors (a recurrent part's R), over every part.
    #[napi(getter)]
    pub fn size_k_bytes(&self) -> Result<f64, Code> {
        self.with_memory(|c| Ok(c.size_k_bytes() as f64))
    }

    /// Bytes of all V tensors (a recurrent part's S), over every part.
    #[napi(getter)]
    pub fn size_v_bytes(&self) -> Result<f64, Code> {
        self.with_memory(|c| Ok(c.size_v_bytes() as f64))
    }

    /// Metadata of cell `index`.
    #[napi]
    pub fn cell(&self, #[napi(ts_arg_type = "number")] index: Num) -> Result<CellInfo, Code> {
        let i = u32v("index", index)?;
        self.with("cell", |c| {
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
        self.with("cells", |c| {
            let cols = c.cell_columns().map_err(from_core)?;
            Ok(CellColumns {
                pos: Int32Array::new(cols.pos),
                delta: Int32Array::new(cols.delta),
                src: Int32Array::new(cols.src),
                tail: Int32Array::new(cols.tail),
                seq_offsets: Uint32Array::new(cols.seq_offsets),
                seq_ids: Int32Array::new(cols.seq_ids),
                ext: Int32Array::new(cols.ext),
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
        self.with("view", |c| {
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
}

/// A part of a memory for JS.
pub(crate) fn memory_part(p: &core::PartInfo) -> MemoryPart {
    MemoryPart {
        role: p.role.name().into(),
        layers: p.layers.clone(),
        size: p.size,
        n_stream: p.n_stream,
        used_cells: p.used_cells,
        n_swa: p.window.n_swa,
        swa_type: p.window.swa_type.name().into(),
        type_k: p.type_k.name().into(),
        type_v: p.type_v.map_or("none", |t| t.name()).into(),
        n_rot_k: p.n_rot.0,
        n_rot_v: p.n_rot.1,
        bytes: p.bytes as f64,
    }
}
