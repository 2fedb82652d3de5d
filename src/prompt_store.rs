//! The `PromptStore` class: converts arguments, picks the backend, schedules the core
//! `prompt_store::PromptStore` operations on the threadpool and maps their errors. No store
//! logic lives here.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, Weak};

use llama_kv_cache as core;
use llama_kv_cache::cache::io::Progress;
use llama_kv_cache::state::files::Durability;
use llama_kv_cache::FileKind;
use napi::bindgen_prelude::*;
use napi::sys;
use napi_derive::napi;
use prompt_store as store;

use crate::args::{self, i32v, u32v, Num, Obj, Tokens};
use crate::error::{coded_error, err, from_store, guard, Code, JsResult};
use crate::kv_cache::KvCache;
use crate::queue::JsPromise;
use crate::signal::Signal;
use crate::store_backend::PromptStoreOptions;
use crate::tasks::{Job, PoolJob, PoolTask, ProgressFn};

/// Options of the async store operations.
#[napi(object, object_to_js = false)]
pub struct StoreCallOptions {
    /// Called with `(doneBlocks, totalBlocks)` (`restore`: tokens loaded of the restore point).
    #[napi(ts_type = "(done: number, total: number) => void")]
    pub on_progress: Option<ProgressFn>,
    /// Aborts the operation while queued or between batches (a restore between blocks: what
    /// it loaded is rolled back).
    #[napi(ts_type = "AbortSignal")]
    pub signal: Option<Signal>,
}

crate::args::option_names!(StoreCallOptions: "onProgress", "signal");

/// Options of `restore`.
#[napi(object, object_to_js = false)]
pub struct StoreRestoreOptions {
    /// Load at most this many tokens of the prompt (a positive integer): the restore serves the
    /// longest restore point not longer than it (a block boundary, or a checkpoint where the
    /// memory needs one: iSWA with the window only, hybrid, recurrent), as a restore of the
    /// prompt's first `maxLoadTokens` tokens would. Default: no limit.
    pub max_load_tokens: Option<f64>,
    /// Called with `(tokensLoaded, tokensOfTheRestorePoint)`.
    #[napi(ts_type = "(done: number, total: number) => void")]
    pub on_progress: Option<ProgressFn>,
    /// Aborts the restore while queued or between blocks (what it loaded is rolled back).
    #[napi(ts_type = "AbortSignal")]
    pub signal: Option<Signal>,
}

crate::args::option_names!(StoreRestoreOptions: "maxLoadTokens", "onProgress", "signal");

/// Options of `restoreSync`.
#[napi(object, object_to_js = false)]
pub struct StoreRestoreSyncOptions {
    /// As `restore`'s: load at most this many tokens of the prompt.
    pub max_load_tokens: Option<f64>,
}

crate::args::option_names!(StoreRestoreSyncOptions: "maxLoadTokens");

/// Options of `writeFile`. Every option left out is what the store's first ingested file was
/// (a store filled by `put` of a cache: a sequence file of today's version).
#[napi(object, object_to_js = false)]
pub struct StoreWriteFileOptions {
    /// 'sequence' (ggsq) or 'session' (ggsn).
    pub kind: Option<String>,
    /// File version: sequence 2 (llama.node), 3 (node-llama-cpp) or 4 (llama.cpp 0.1.161);
    /// session 9, 10 or 11.
    pub version: Option<f64>,
    /// Payload layout: 'streams-rot' (versions 4 and 11), 'streams' or 'seed' (b4944).
    pub layout: Option<String>,
    /// Whether the reader runs with flash attention (V untransposed).
    pub flash_attn: Option<bool>,
    /// Session files: the architecture name.
    pub arch: Option<String>,
    /// iSWA states kept whole (`swa_full`): write only the last `swaWindow` positions of the
    /// sliding-window cache, for a reader whose context keeps only the window.
    pub swa_window: Option<f64>,
    /// Streams of the reader's context. Default 1. A context of a stream per sequence
    /// (llama.cpp's `kv_unified` off: node-llama-cpp's contexts of several sequences) reads only
    /// files of as many streams.
    pub n_stream: Option<f64>,
    /// Whether the file is synced to the disk before it replaces `path`. Default true. Either
    /// way a reader never sees half a file; `false` is for a file a peer loads at once and
    /// removes (what the adapters do), where the sync costs most of the write.
    pub durable: Option<bool>,
    /// Called with `(doneBytes, totalBytes)` while the file is written.
    #[napi(ts_type = "(done: number, total: number) => void")]
    pub on_progress: Option<ProgressFn>,
    /// Aborts the operation.
    #[napi(ts_type = "AbortSignal")]
    pub signal: Option<Signal>,
}

crate::args::option_names!(
    StoreWriteFileOptions:
    "kind", "version", "layout", "flashAttn", "arch", "swaWindow", "nStream", "durable",
    "onProgress", "signal",
);

/// What `put` / `putFile` stored.
#[napi(object)]
pub struct StorePutResult {
    /// The restore point this put gives the prompt: tokens a later restore of it loads.
    pub tokens: f64,
    /// Blocks this call stored.
    pub blocks_written: f64,
    /// Bytes this call stored.
    pub bytes_written: f64,
    /// Blocks already stored (by anyone), not written again.
    pub blocks_skipped: f64,
    /// Bytes of the skipped blocks.
    pub bytes_skipped: f64,
    /// Checkpoints this call stored: the partial last block, a sliding window, a recurrent
    /// state.
    pub checkpoints_written: f64,
    /// Tiers that could not be reached (e.g. `['redis']`): the put landed in the others, and a
    /// later put reaches these once they are back. Empty when every tier took it.
    pub degraded: Vec<String>,
}

/// How one tier of a store is doing.
#[napi(object)]
pub struct StoreTier {
    /// 'memory', 'dir' or 'redis'.
    pub name: String,
    /// Whether its last call succeeded (a down tier is retried with backoff).
    pub up: bool,
    /// Its last error, if any (kept after it recovers).
    pub last_error: Option<String>,
}

/// Counts of a store.
#[napi(object)]
pub struct StoreStats {
    /// 'memory', 'dir', 'redis', or 'tiered' (then blocks, bytes and budget are the farthest tier's).
    pub backend: String,
    /// Tokens per block.
    pub block_tokens: u32,
    /// Values stored: blocks, plus one small model record per model.
    pub blocks: f64,
    /// Bytes stored.
    pub bytes: f64,
    /// The byte budget, if any.
    pub max_bytes: Option<f64>,
    /// Blocks evicted to keep the budget (dir: over the directory's life, all processes).
    pub evictions: f64,
    /// Blocks found by this object's lookups, restores and writeFile calls.
    pub hits: f64,
    /// This object's lookups, restores and writeFile calls that stopped before the prompt's last full block.
    pub misses: f64,
    /// Values that failed verification (checksum, model, key, tokens): counted misses, never loaded, removed.
    pub corrupt: f64,
    /// Values another writer left (without this store's secret, or copied from another key):
    /// never loaded, replaced by this store's own.
    pub rejected: f64,
    /// Each tier's state and last error (stores with `tiers`; empty otherwise).
    pub tiers: Vec<StoreTier>,
}

impl From<store::PutReport> for StorePutResult {
    fn from(r: store::PutReport) -> Self {
        StorePutResult {
            tokens: r.tokens as f64,
            blocks_written: r.blocks_written as f64,
            bytes_written: r.bytes_written as f64,
            blocks_skipped: r.blocks_skipped as f64,
            bytes_skipped: r.bytes_skipped as f64,
            checkpoints_written: r.checkpoints_written as f64,
            degraded: r.degraded.iter().map(|d| d.to_string()).collect(),
        }
    }
}

impl From<store::StoreStats> for StoreStats {
    fn from(s: store::StoreStats) -> Self {
        StoreStats {
            backend: s.backend.into(),
            block_tokens: s.block_tokens,
            blocks: s.blocks as f64,
            bytes: s.bytes as f64,
            max_bytes: s.max_bytes.map(|m| m as f64),
            evictions: s.evictions as f64,
            hits: s.hits as f64,
            misses: s.misses as f64,
            corrupt: s.corrupt as f64,
            rejected: s.rejected as f64,
            tiers: s
                .tiers
                .into_iter()
                .map(|t| StoreTier {
                    name: t.name.into(),
                    up: t.up,
                    last_error: t.last_error,
                })
                .collect(),
        }
    }
}

/// A `KvCache` argument, with a coded error for anything else.
pub struct CacheArg(&'static KvCache);

impl FromNapiValue for CacheArg {
    unsafe fn from_napi_value(env: sys::napi_env, value: sys::napi_value) -> napi::Result<Self> {
        KvCache::from_napi_ref(env, value)
            .map(CacheArg)
            .map_err(|_| coded_error(env, err(Code::InvalidArg, "expected a KvCache instance")))
    }
}

/// A store operation that needs no cache, shared by the sync twin and the async task.
pub trait StoreJob: Send + 'static {
    /// What the work produces.
    type Output: Send + 'static;
    /// What JS receives.
    type Js: ToNapiValue + TypeName;
    /// Does the work.
    fn run(
        &mut self,
        store: &store::PromptStore,
        progress: Progress<'_>,
    ) -> store::StoreResult<Self::Output>;
    /// Converts the output for JS.
    fn to_js(output: Self::Output) -> Self::Js;
}

/// Store operations on one sequence of a cache (`put`, `restore`): cache jobs, queued behind
/// the cache's other async calls like its own.
pub trait SeqJob: Job + 'static {
    /// The job for sequence `seq` and its prompt `tokens`.
    fn new(store: Arc<store::PromptStore>, seq: i32, tokens: Vec<i32>) -> Self;
}

/// `put`.
pub struct PutJob {
    store: Arc<store::PromptStore>,
    seq: i32,
    tokens: Vec<i32>,
}

impl Job for PutJob {
    type Output = store::PutReport;
    type Js = StorePutResult;
    fn run(
        &mut self,
        m: &mut dyn core::Memory,
        p: &mut dyn FnMut(u64, u64) -> bool,
    ) -> JsResult<Self::Output> {
        self.store
            .put_memory(m, self.seq, &self.tokens, Some(p))
            .map_err(from_store)
    }
    fn to_js(o: Self::Output) -> JsResult<StorePutResult> {
        Ok(o.into())
    }
}

impl SeqJob for PutJob {
    fn new(store: Arc<store::PromptStore>, seq: i32, tokens: Vec<i32>) -> Self {
        PutJob { store, seq, tokens }
    }
}

/// `restore`.
pub struct RestoreJob {
    store: Arc<store::PromptStore>,
    seq: i32,
    tokens: Vec<i32>,
}

impl Job for RestoreJob {
    type Output = u64;
    type Js = f64;
    fn run(
        &mut self,
        m: &mut dyn core::Memory,
        p: &mut dyn FnMut(u64, u64) -> bool,
    ) -> JsResult<u64> {
        self.store
            .restore_memory(m, self.seq, &self.tokens, Some(p))
            .map_err(from_store)
    }
    fn to_js(o: u64) -> JsResult<f64> {
        Ok(o as f64)
    }
}

impl SeqJob for RestoreJob {
    fn new(store: Arc<store::PromptStore>, seq: i32, tokens: Vec<i32>) -> Self {
        RestoreJob { store, seq, tokens }
    }
}

/// `lookup`.
pub struct LookupJob {
    tokens: Vec<i32>,
}

impl StoreJob for LookupJob {
    type Output = u64;
    type Js = f64;
    fn run(&mut self, s: &store::PromptStore, _: Progress<'_>) -> store::StoreResult<u64> {
        s.lookup(&self.tokens)
    }
    fn to_js(o: u64) -> f64 {
        o as f64
    }
}

/// What `lookupDetail` found.
#[napi(object)]
pub struct StoreLookupDetail {
    /// The restore point: tokens a restore (or `writeFile`) of the prompt loads.
    pub tokens: f64,
    /// Leading full blocks of the prompt stored (0 for a recurrent memory, which keeps its
    /// state in checkpoints only).
    pub blocks: f64,
    /// Where the checkpoint the restore point uses ends, if it uses one.
    pub checkpoint_at: Option<f64>,
    /// Why the restore point is where it is: 'complete' (the whole prompt), 'no-model'
    /// (nothing stored for this model yet), 'no-blocks' (not even the first block),
    /// 'no-checkpoint' (blocks past the restore point are stored, but this memory needs a
    /// checkpoint where they end and there is none: put the state at the end of the prompt or
    /// turn), 'prefix-ends' (the store holds nothing more of this prompt).
    #[napi(ts_type = "'complete' | 'no-model' | 'no-blocks' | 'no-checkpoint' | 'prefix-ends'")]
    pub reason: String,
}

/// `lookupDetail`.
pub struct LookupDetailJob {
    tokens: Vec<i32>,
}

impl StoreJob for LookupDetailJob {
    type Output = store::LookupDetail;
    type Js = StoreLookupDetail;
    fn run(&mut self, s: &store::PromptStore, _: Progress<'_>) -> store::StoreResult<Self::Output> {
        s.lookup_detail(&self.tokens)
    }
    fn to_js(o: Self::Output) -> StoreLookupDetail {
        StoreLookupDetail {
            tokens: o.tokens as f64,
            blocks: o.blocks as f64,
            checkpoint_at: o.checkpoint_at.map(|c| c as f64),
            reason: o.reason.name().into(),
        }
    }
}

/// `putFile`.
pub struct PutFileJob {
    path: PathBuf,
}

impl StoreJob for PutFileJob {
    type Output = store::PutReport;
    type Js = StorePutResult;
    fn run(&mut self, s: &store::PromptStore, p: Progress<'_>) -> store::StoreResult<Self::Output> {
        s.put_file(&self.path, Some(p))
    }
    fn to_js(o: Self::Output) -> StorePutResult {
        o.into()
    }
}

/// `writeFile`.
pub struct WriteFileJob {
    tokens: Vec<i32>,
    path: PathBuf,
    opts: store::WriteFileOptions,
}

impl StoreJob for WriteFileJob {
    type Output = u64;
    type Js = f64;
    fn run(&mut self, s: &store::PromptStore, p: Progress<'_>) -> store::StoreResult<u64> {
        s.write_file(&self.tokens, &self.path, &self.opts, Some(p))
    }
    fn to_js(o: u64) -> f64 {
        o as f64
    }
}

/// `stats` (`gc`: housekeeping first).
pub struct StatsJob {
    gc: bool,
}

impl StoreJob for StatsJob {
    type Output = store::StoreStats;
    type Js = StoreStats;
    fn run(&mut self, s: &store::PromptStore, _: Progress<'_>) -> store::StoreResult<Self::Output> {
        if self.gc {
            s.backend().gc()?;
        }
        s.stats()
    }
    fn to_js(o: Self::Output) -> StoreStats {
        o.into()
    }
}

/// `metrics`.
pub struct MetricsJob;

impl StoreJob for MetricsJob {
    type Output = String;
    type Js = String;
    fn run(&mut self, s: &store::PromptStore, _: Progress<'_>) -> store::StoreResult<String> {
        s.metrics()
    }
    fn to_js(o: String) -> String {
        o
    }
}

/// A [`StoreJob`] with the store it runs on: a [`PoolJob`]. Store operations without a cache
/// do not queue: the backends take concurrent calls.
pub struct StoreWork<J: StoreJob> {
    store: Arc<store::PromptStore>,
    job: J,
}

impl<J: StoreJob> PoolJob for StoreWork<J> {
    type Output = J::Output;
    type Js = J::Js;
    fn run(&mut self, progress: &mut dyn FnMut(u64, u64) -> bool) -> JsResult<Self::Output> {
        self.job.run(&self.store, progress).map_err(from_store)
    }
    fn to_js(output: Self::Output) -> JsResult<Self::Js> {
        Ok(J::to_js(output))
    }
}

/// The async task of a [`StoreJob`].
pub type StoreTask<J> = PoolTask<StoreWork<J>>;

/// `close`: drops the store's handle on the threadpool, where the backend's own teardown
/// (closing Redis connections) may block.
pub struct CloseWork(Option<Arc<store::PromptStore>>);

impl PoolJob for CloseWork {
    type Output = ();
    type Js = ();
    fn run(&mut self, _: &mut dyn FnMut(u64, u64) -> bool) -> JsResult<()> {
        drop(self.0.take());
        Ok(())
    }
    fn to_js(_: ()) -> JsResult<()> {
        Ok(())
    }
}

/// A prompt store: the KV rows of prompts in blocks of `blockTokens` tokens, keyed by a BLAKE3
/// chain over the tokens rooted in the model and cache geometry, so prompts share the blocks of
/// their common prefix. Blocks live in a directory (`path`, shared by processes) or in memory.
///
/// The first cache or file stored fixes the model's geometry (layers, K/V types, row sizes);
/// caches of another geometry are refused with `ERR_KV_STORE_GEOMETRY`. A block that fails
/// verification (checksum, model, key, tokens) is a counted miss (`stats().corrupt`), never
/// loaded. `close()` (or `await using`) releases the backend.
#[napi]
pub struct PromptStore {
    /// None once closed.
    inner: Mutex<Option<Arc<store::PromptStore>>>,
    /// The store's KV events (held by the store alone: its end is the store's end).
    events: Weak<store::events::EventHub>,
}

fn call_options(o: Option<Obj<StoreCallOptions>>) -> (Option<ProgressFn>, Option<Signal>) {
    o.map_or((None, None), |Obj(o)| (o.on_progress, o.signal))
}

/// The prompt a restore with `maxLoadTokens` loads from: its first `max` tokens, whose restore
/// points are the prompt's restore points up to `max` (blocks and checkpoints are keyed by the
/// tokens before them only).
fn load_prefix(mut tokens: Tokens, max: Option<f64>) -> JsResult<Tokens> {
    if let Some(max) = max {
        if !(max.is_finite() && max.fract() == 0.0 && max >= 1.0) {
            return Err(err(
                Code::InvalidArg,
                format!("maxLoadTokens must be a positive integer, got {max}"),
            ));
        }
        // past usize::MAX, `as` saturates: no limit
        tokens.0.truncate(max as usize);
    }
    Ok(tokens)
}

impl PromptStore {
    /// The open store, or `ERR_KV_DISPOSED` once `close()` was called.
    fn store(&self) -> JsResult<Arc<store::PromptStore>> {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| err(Code::Disposed, "the prompt store was closed"))
    }

    fn run_sync<J: StoreJob>(&self, mut job: J) -> JsResult<J::Js> {
        guard(|| {
            let store = self.store()?;
            let out = job.run(&store, &mut |_, _| true).map_err(from_store)?;
            Ok(J::to_js(out))
        })
    }

    fn run_async<J: StoreJob>(
        &self,
        env: &Env,
        job: J,
        progress: Option<ProgressFn>,
        signal: Option<Signal>,
    ) -> JsResult<AsyncTask<StoreTask<J>>> {
        let work = StoreWork {
            store: self.store()?,
            job,
        };
        Ok(PoolTask::new(env, work, progress, signal.as_ref()))
    }

    fn seq_sync<J: SeqJob>(&self, cache: CacheArg, seq_id: Num, tokens: Tokens) -> JsResult<J::Js> {
        let job = J::new(self.store()?, i32v("seqId", seq_id)?, tokens.0);
        cache.0.run_sync(job)
    }

    fn seq_async<J: SeqJob>(
        &self,
        env: &Env,
        cache: CacheArg,
        seq_id: Num,
        tokens: Tokens,
        (progress, signal): (Option<ProgressFn>, Option<Signal>),
    ) -> JsResult<JsPromise> {
        let job = J::new(self.store()?, i32v("seqId", seq_id)?, tokens.0);
        cache.0.run_async(env, job, progress, signal)
    }
}

fn write_file_job(
    tokens: Tokens,
    path: &Unknown<'_>,
    options: Option<Obj<StoreWriteFileOptions>>,
) -> JsResult<(WriteFileJob, Option<ProgressFn>, Option<Signal>)> {
    let mut opts = store::WriteFileOptions::default();
    let (mut progress, mut signal) = (None, None);
    if let Some(Obj(o)) = options {
        opts.kind = match o.kind.as_deref() {
            None => None,
            Some("sequence") => Some(FileKind::Sequence),
            Some("session") => Some(FileKind::Session),
            Some(k) => {
                return Err(err(
                    Code::InvalidArg,
                    format!("kind must be 'sequence' or 'session', got {k:?}"),
                ))
            }
        };
        opts.version = o.version.map(|v| u32v("version", v)).transpose()?;
        opts.layout = crate::jobs::layout(o.layout.as_deref())?;
        opts.flash_attn = o.flash_attn;
        opts.arch = o.arch;
        opts.swa_window = o.swa_window.map(|v| u32v("swaWindow", v)).transpose()?;
        opts.n_stream = match o.n_stream.map(|v| u32v("nStream", v)).transpose()? {
            Some(0) => return Err(err(Code::InvalidArg, "nStream must be at least 1, got 0")),
            n => n,
        };
        opts.durability = o.durable.map(|d| match d {
            true => Durability::Synced,
            false => Durability::Unsynced,
        });
        progress = o.on_progress;
        signal = o.signal;
    }
    let job = WriteFileJob {
        tokens: tokens.0,
        path: args::path("path", path)?,
        opts,
    };
    Ok((job, progress, signal))
}

#[napi]
impl PromptStore {
    /// Opens a store: a directory with `path` (created if missing), a Redis server with `url`,
    /// several of them with `tiers`, else in-process memory.
    #[napi(constructor)]
    pub fn new(
        #[napi(ts_arg_type = "PromptStoreOptions")] options: Obj<PromptStoreOptions>,
    ) -> Result<Self, Code> {
        guard(|| {
            let o = options.0;
            let block_tokens = match o.block_tokens {
                Some(b) => u32v("blockTokens", Num(b))?,
                None => store::DEFAULT_BLOCK_TOKENS,
            };
            let backend = crate::store_backend::open(&o)?;
            let (model, info) = crate::model::model_identity(&o.model)?;
            let hub = store::events::EventHub::new();
            let mut inner = store::PromptStore::new(backend, &model, block_tokens)
                .map_err(from_store)?
                .with_namespace(o.namespace.as_deref().unwrap_or(""))
                .with_events(hub.clone());
            if let Some(info) = info {
                inner = inner.with_model(info, &o.model);
            }
            if let Some(secret) = &o.secret {
                inner = inner
                    .with_secret(crate::args::text_or_bytes(secret))
                    .map_err(from_store)?;
            }
            Ok(PromptStore {
                inner: Mutex::new(Some(Arc::new(inner))),
                events: Arc::downgrade(&hub),
            })
        })
    }

    /// Tokens per block.
    #[napi(getter)]
    pub fn block_tokens(&self) -> Result<u32, Code> {
        Ok(self.store()?.block_tokens())
    }

    /// Closes the store: later calls throw (or reject with) `ERR_KV_DISPOSED`, and the backend
    /// (a directory's handles, Redis connections) is released once the calls already running
    /// have settled. Resolves when this object has let go of it; closing again does nothing.
    #[napi(ts_return_type = "Promise<void>")]
    pub fn close(&self, env: Env) -> AsyncTask<PoolTask<CloseWork>> {
        let store = self.inner.lock().unwrap_or_else(|p| p.into_inner()).take();
        PoolTask::new(&env, CloseWork(store), None, None)
    }

    /// Calls `callback` with each batch of the store's KV events (see `events()` in index.d.ts,
    /// which sits on this), and once with an empty batch when the store is gone. Returns the
    /// subscription's id for `unsubscribeEvents`.
    #[napi(js_name = "subscribeEvents")]
    pub fn subscribe_events(
        &self,
        #[napi(ts_arg_type = "(events: StoreKvEvent[]) => void")] callback: Unknown<'_>,
    ) -> Result<f64, Code> {
        guard(|| {
            self.store()?;
            let callback = crate::store_events::events_fn(callback)?;
            let hub = self
                .events
                .upgrade()
                .ok_or_else(|| err(Code::Disposed, "the prompt store was closed"))?;
            Ok(crate::store_events::subscribe(&hub, callback) as f64)
        })
    }

    /// Stops the subscription `id` (an unknown or ended one is ignored).
    #[napi(js_name = "unsubscribeEvents")]
    pub fn unsubscribe_events(&self, #[napi(ts_arg_type = "number")] id: Num) {
        if let Some(hub) = self.events.upgrade() {
            hub.unsubscribe(id.0 as u64);
        }
    }

    /// `await using store = new PromptStore(...)`: closes at the end of the scope.
    #[napi(well_known_symbol = "asyncDispose", ts_return_type = "Promise<void>")]
    pub fn symbol_async_dispose(&self, env: Env) -> AsyncTask<PoolTask<CloseWork>> {
        self.close(env)
    }

    /// Stores the full blocks of sequence `seqId` of `cache` that the store lacks. The sequence
    /// must hold positions 0..n-1 with no pending shift (else `ERR_KV_STORE_NOT_PREFIX`);
    /// `tokens` are its prompt tokens (blocks cover min(n, tokens.length) tokens). Every kind
    /// of cache: an iSWA or hybrid one stores what a peer's sequence file of the same state
    /// would (its window or recurrent state in a checkpoint at the prompt's end).
    #[napi(ts_return_type = "Promise<StorePutResult>")]
    pub fn put(
        &self,
        env: Env,
        #[napi(ts_arg_type = "import('./index').AnyKvCache")] cache: CacheArg,
        #[napi(ts_arg_type = "number")] seq_id: Num,
        #[napi(ts_arg_type = "ArrayLike<number> | Int32Array")] tokens: Tokens,
        #[napi(ts_arg_type = "StoreCallOptions")] options: Option<Obj<StoreCallOptions>>,
    ) -> Result<JsPromise, Code> {
        self.seq_async::<PutJob>(&env, cache, seq_id, tokens, call_options(options))
    }

    /// `put` on the calling thread.
    #[napi]
    pub fn put_sync(
        &self,
        #[napi(ts_arg_type = "import('./index').AnyKvCache")] cache: CacheArg,
        #[napi(ts_arg_type = "number")] seq_id: Num,
        #[napi(ts_arg_type = "ArrayLike<number> | Int32Array")] tokens: Tokens,
    ) -> Result<StorePutResult, Code> {
        self.seq_sync::<PutJob>(cache, seq_id, tokens)
    }

    /// The length in tokens of the longest restorable prefix of `tokens`: full blocks plus,
    /// where the memory needs one, a checkpoint ending exactly there (so not always a multiple
    /// of `blockTokens`), in one pass over the chain without reading blocks.
    #[napi(ts_return_type = "Promise<number>")]
    pub fn lookup(
        &self,
        env: Env,
        #[napi(ts_arg_type = "ArrayLike<number> | Int32Array")] tokens: Tokens,
        #[napi(ts_arg_type = "StoreCallOptions")] options: Option<Obj<StoreCallOptions>>,
    ) -> Result<AsyncTask<StoreTask<LookupJob>>, Code> {
        let (progress, signal) = call_options(options);
        self.run_async(&env, LookupJob { tokens: tokens.0 }, progress, signal)
    }

    /// `lookup` on the calling thread (cheap: no block is read).
    #[napi]
    pub fn lookup_sync(
        &self,
        #[napi(ts_arg_type = "ArrayLike<number> | Int32Array")] tokens: Tokens,
    ) -> Result<f64, Code> {
        self.run_sync(LookupJob { tokens: tokens.0 })
    }

    /// `lookup`, with what the store holds of the prompt and why the restore point is where it
    /// is: tells "nothing stored" from "blocks stored, but no checkpoint where this memory
    /// needs one".
    #[napi(ts_return_type = "Promise<StoreLookupDetail>")]
    pub fn lookup_detail(
        &self,
        env: Env,
        #[napi(ts_arg_type = "ArrayLike<number> | Int32Array")] tokens: Tokens,
        #[napi(ts_arg_type = "StoreCallOptions")] options: Option<Obj<StoreCallOptions>>,
    ) -> Result<AsyncTask<StoreTask<LookupDetailJob>>, Code> {
        let (progress, signal) = call_options(options);
        let job = LookupDetailJob { tokens: tokens.0 };
        self.run_async(&env, job, progress, signal)
    }

    /// `lookupDetail` on the calling thread (cheap: no block is read).
    #[napi]
    pub fn lookup_detail_sync(
        &self,
        #[napi(ts_arg_type = "ArrayLike<number> | Int32Array")] tokens: Tokens,
    ) -> Result<StoreLookupDetail, Code> {
        self.run_sync(LookupDetailJob { tokens: tokens.0 })
    }

    /// Loads the longest stored prefix of `tokens` into `seqId` (replacing its cells) and
    /// returns its length in tokens. Transactional: on any error the cache is unchanged. When
    /// nothing is stored, returns 0 and leaves the cache unchanged. Every kind of cache of the
    /// store's model; an iSWA or hybrid one needs the store's model record (written by every
    /// put), and its window cache gets only the window unless it is as large as the base.
    /// `maxLoadTokens` caps what is loaded at the longest restore point not longer than it.
    #[napi(ts_return_type = "Promise<number>")]
    pub fn restore(
        &self,
        env: Env,
        #[napi(ts_arg_type = "import('./index').AnyKvCache")] cache: CacheArg,
        #[napi(ts_arg_type = "number")] seq_id: Num,
        #[napi(ts_arg_type = "ArrayLike<number> | Int32Array")] tokens: Tokens,
        #[napi(ts_arg_type = "StoreRestoreOptions")] options: Option<Obj<StoreRestoreOptions>>,
    ) -> Result<JsPromise, Code> {
        let (max, call) = options.map_or((None, (None, None)), |Obj(o)| {
            (o.max_load_tokens, (o.on_progress, o.signal))
        });
        let tokens = load_prefix(tokens, max)?;
        self.seq_async::<RestoreJob>(&env, cache, seq_id, tokens, call)
    }

    /// `restore` on the calling thread.
    #[napi]
    pub fn restore_sync(
        &self,
        #[napi(ts_arg_type = "import('./index').AnyKvCache")] cache: CacheArg,
        #[napi(ts_arg_type = "number")] seq_id: Num,
        #[napi(ts_arg_type = "ArrayLike<number> | Int32Array")] tokens: Tokens,
        #[napi(ts_arg_type = "StoreRestoreSyncOptions")] options: Option<
            Obj<StoreRestoreSyncOptions>,
        >,
    ) -> Result<f64, Code> {
        let tokens = load_prefix(tokens, options.and_then(|Obj(o)| o.max_load_tokens))?;
        self.seq_sync::<RestoreJob>(cache, seq_id, tokens)
    }

    /// Ingests a llama.cpp session or sequence file (any version and layout this package reads)
    /// holding one sequence, with the file's tokens: for apps whose llama.cpp owns its cache.
    #[napi(ts_return_type = "Promise<StorePutResult>")]
    pub fn put_file(
        &self,
        env: Env,
        #[napi(ts_arg_type = "string")] path: Unknown<'_>,
        #[napi(ts_arg_type = "StoreCallOptions")] options: Option<Obj<StoreCallOptions>>,
    ) -> Result<AsyncTask<StoreTask<PutFileJob>>, Code> {
        let (progress, signal) = call_options(options);
        let path = args::path("path", &path)?;
        self.run_async(&env, PutFileJob { path }, progress, signal)
    }

    /// `putFile` on the calling thread.
    #[napi]
    pub fn put_file_sync(
        &self,
        #[napi(ts_arg_type = "string")] path: Unknown<'_>,
    ) -> Result<StorePutResult, Code> {
        let path = args::path("path", &path)?;
        self.run_sync(PutFileJob { path })
    }

    /// Writes the longest stored prefix of `tokens` to `path` (atomically) as a llama.cpp file
    /// that llama.node and node-llama-cpp load, with that prefix as the file's tokens, and
    /// returns its length in tokens. When nothing is stored, writes nothing and returns 0.
    #[napi(ts_return_type = "Promise<number>")]
    pub fn write_file(
        &self,
        env: Env,
        #[napi(ts_arg_type = "ArrayLike<number> | Int32Array")] tokens: Tokens,
        #[napi(ts_arg_type = "string")] path: Unknown<'_>,
        #[napi(ts_arg_type = "StoreWriteFileOptions")] options: Option<Obj<StoreWriteFileOptions>>,
    ) -> Result<AsyncTask<StoreTask<WriteFileJob>>, Code> {
        let (job, progress, signal) = write_file_job(tokens, &path, options)?;
        self.run_async(&env, job, progress, signal)
    }

    /// `writeFile` on the calling thread.
    #[napi]
    pub fn write_file_sync(
        &self,
        #[napi(ts_arg_type = "ArrayLike<number> | Int32Array")] tokens: Tokens,
        #[napi(ts_arg_type = "string")] path: Unknown<'_>,
        #[napi(ts_arg_type = "StoreWriteFileOptions")] options: Option<Obj<StoreWriteFileOptions>>,
    ) -> Result<f64, Code> {
        let (job, ..) = write_file_job(tokens, &path, options)?;
        self.run_sync(job)
    }

    /// Blocks, bytes, budget, evictions, and this object's hits, misses and corrupt blocks.
    #[napi(ts_return_type = "Promise<StoreStats>")]
    pub fn stats(&self, env: Env) -> Result<AsyncTask<StoreTask<StatsJob>>, Code> {
        self.run_async(&env, StatsJob { gc: false }, None, None)
    }

    /// `stats` on the calling thread.
    #[napi]
    pub fn stats_sync(&self) -> Result<StoreStats, Code> {
        self.run_sync(StatsJob { gc: false })
    }

    /// This object's figures in the Prometheus text exposition format: per tier the values
    /// found and missed, bytes read and written and evictions; corrupt and rejected blocks;
    /// latency histograms of lookup, put and restore. Every series is labelled
    /// `namespace="..."` (the store's `namespace`, `""` when none), the per-tier ones
    /// `tier="memory|dir|redis"` too.
    #[napi(ts_return_type = "Promise<string>")]
    pub fn metrics(&self, env: Env) -> Result<AsyncTask<StoreTask<MetricsJob>>, Code> {
        self.run_async(&env, MetricsJob, None, None)
    }

    /// `metrics` on the calling thread.
    #[napi]
    pub fn metrics_sync(&self) -> Result<String, Code> {
        self.run_sync(MetricsJob)
    }

    /// Housekeeping, then stats: recounts what is stored, enforces the byte budget and removes
    /// leftovers of interrupted writes (dir: temporary files older than an hour).
    #[napi(ts_return_type = "Promise<StoreStats>")]
    pub fn gc(&self, env: Env) -> Result<AsyncTask<StoreTask<StatsJob>>, Code> {
        self.run_async(&env, StatsJob { gc: true }, None, None)
    }
}
