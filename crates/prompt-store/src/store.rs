//! The prompt store: `put`, `lookup`, `restore`, `put_file`, `write_file`, `stats` over any
//! [`Backend`], for every memory llama.cpp 0.1.161 writes (unified, iSWA, hybrid, recurrent,
//! with rotated K/V or not).
//!
//! A restore point P is served by the chain's full blocks for [0, bt * floor(P / bt)) plus,
//! where the memory needs more (a partial last block, a sliding window, a recurrent state), a
//! checkpoint keyed by the exact prefix P ends (see [`crate::checkpoint`]). A lookup returns the
//! longest P for which everything is stored; a restore reads and verifies it, and falls back to
//! the next longest when a value turns out corrupt.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::ScopedJoinHandle;

use llama_kv_cache::cache::io::Progress;
use llama_kv_cache::state::dsv4;
use llama_kv_cache::state::files::{
    header_bytes, inspect_bytes, write_replacing, write_replacing_file, Durability, FileKind,
};
use llama_kv_cache::{
    check_memory, check_state, convert_bytes, CellExt, CellExtValue, ConvertOptions, Fit, KvCache,
    KvError, Layout, MemoryKind, ModelInfo, ReadOptions, ReadSummary, SequenceLoad, Tensor,
    WriteOptions,
};

use sha2::{Digest, Sha256};

use crate::backend::{Backend, Key, TierHealth};
use crate::block::{self, BlockId, BlockRows};
use crate::capture::{unified_shape, Capture, KvRows};
use crate::checkpoint::{self, CheckpointId, CheckpointView, Slot, SwaRows};
use crate::error::{StoreError, StoreResult};
use crate::geometry::{
    chain_at, chain_keys, checkpoint_key, index_key, swa_key, Geometry, FORMAT_VERSION,
};
use crate::metrics::{render, Latencies, Metered, Snapshot};
use crate::payload::{FileSink, KvPartWriter, MappedFileSink, PayloadSink, StreamAt};
use crate::seal::{Broken, Sealer, TRAILER};
use crate::shape::{Fields, FileFormat, Shape};

mod live;

/// Tokens per block unless configured (LMCache's chunk size).
pub const DEFAULT_BLOCK_TOKENS: u32 = 256;
/// Smallest block size.
pub const MIN_BLOCK_TOKENS: u32 = 16;
/// Largest block size.
pub const MAX_BLOCK_TOKENS: u32 = 4096;

/// Blocks encoded and sent to the backend per batch: bounds memory on long prompts.
const PUT_BATCH: usize = 8;

/// Restores that meet corrupt values re-plan at most this often before giving up on the
/// prompt (each round removes what it found corrupt).
const MAX_REPLANS: usize = 4;

/// Index entries: the offset, plus this bit when the checkpoint needs the SWA blocks too.
const NEEDS_SWA_BLOCKS: u32 = 1 << 31;

/// What `put` did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PutReport {
    /// The restore point this put gives the prompt: tokens a later restore of it loads.
    pub tokens: u64,
    /// Blocks this call stored.
    pub blocks_written: u64,
    /// Bytes this call stored (blocks and checkpoints).
    pub bytes_written: u64,
    /// Blocks that were already stored (by anyone).
    pub blocks_skipped: u64,
    /// Bytes of the blocks already stored.
    pub bytes_skipped: u64,
    /// Checkpoints this call stored (a partial last block, a sliding window, a recurrent
    /// state).
    pub checkpoints_written: u64,
    /// Tiers that were down after this call (their backoff running): the put landed in the
    /// others, and a later put reaches these once they are back.
    pub degraded: Vec<&'static str>,
}

/// Counts of a store: what the backend holds and what this `PromptStore` saw.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreStats {
    /// Backend name.
    pub backend: &'static str,
    /// Tokens per block.
    pub block_tokens: u32,
    /// Values stored (blocks, checkpoints and their index, plus one small model record per
    /// model).
    pub blocks: u64,
    /// Bytes stored.
    pub bytes: u64,
    /// The byte budget, if any.
    pub max_bytes: Option<u64>,
    /// Values evicted to keep the budget (see [`crate::Usage::evictions`]).
    pub evictions: u64,
    /// Blocks found by lookups and restores of this store object.
    pub hits: u64,
    /// Lookups and restores of this store object that stopped before the prompt's last full
    /// block (each counts once).
    pub misses: u64,
    /// Values read that failed verification (checksum, fingerprint, key, index, tokens,
    /// geometry), blocks and checkpoints alike: counted as misses, never loaded, and removed
    /// from the backend.
    pub corrupt: u64,
    /// Values that another writer left (not tagged with this store's secret, or copied from
    /// another key), met by reads and puts: never loaded, and replaced by this store's own.
    pub rejected: u64,
    /// Each tier's state and last error (tiered stores).
    pub tiers: Vec<TierHealth>,
}

/// What [`PromptStore::lookup_detail`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LookupDetail {
    /// The restore point: tokens a restore of the prompt loads.
    pub tokens: u64,
    /// Leading full blocks of the prompt stored for the part kept per position (0 for a
    /// recurrent memory, which keeps its state in checkpoints only).
    pub blocks: u64,
    /// Where the checkpoint the restore point uses ends, if it uses one.
    pub checkpoint_at: Option<u64>,
    /// Why the restore point is where it is.
    pub reason: LookupReason,
}

/// Why a lookup's restore point is where it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LookupReason {
    /// The whole prompt is restorable.
    Complete,
    /// Nothing is stored for this model (no put yet, or its record was evicted).
    NoModel,
    /// The model is known, but not even the prompt's first block is stored.
    NoBlocks,
    /// Blocks past the restore point are stored, but this memory (sliding window, recurrent
    /// state, or a prompt ending inside a block) needs a checkpoint where they end and there
    /// is none: a put of the state at the end of the prompt (or of a turn) adds one.
    NoCheckpoint,
    /// The store holds nothing more of this prompt: it diverges from what was stored, or goes
    /// on past it.
    PrefixEnds,
}

impl LookupReason {
    /// `"complete"`, `"no-model"`, `"no-blocks"`, `"no-checkpoint"` or `"prefix-ends"`.
    pub fn name(self) -> &'static str {
        match self {
            LookupReason::Complete => "complete",
            LookupReason::NoModel => "no-model",
            LookupReason::NoBlocks => "no-blocks",
            LookupReason::NoCheckpoint => "no-checkpoint",
            LookupReason::PrefixEnds => "prefix-ends",
        }
    }
}

/// How `write_file` writes a llama.cpp file. Every field left `None` is what the store's first
/// ingested file was (a store filled by `put` of a live cache: a sequence file of today's
/// version, V transposed).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WriteFileOptions {
    /// Session (`ggsn`) or sequence (`ggsq`) file.
    pub kind: Option<FileKind>,
    /// File version.
    pub version: Option<u32>,
    /// Payload layout of the KV parts.
    pub layout: Option<Layout>,
    /// Whether the reader runs with flash attention (V untransposed).
    pub flash_attn: Option<bool>,
    /// Session files: the architecture name.
    pub arch: Option<String>,
    /// iSWA states kept whole (`swa_full`): write only the last `swa_window` positions of the
    /// sliding-window part, for a reader whose context keeps only the window.
    pub swa_window: Option<u32>,
    /// Streams of the reader's context (`None`: 1): a context of a stream per sequence
    /// (llama.cpp's `kv_unified` off, as node-llama-cpp's contexts of several sequences) reads
    /// only files of as many streams.
    pub n_stream: Option<u32>,
    /// Whether the file is synced to the disk before it replaces `path` (`None`: synced). A
    /// file handed to a peer that loads it at once and removes it needs no sync, which costs
    /// most of the write.
    pub durability: Option<Durability>,
}

/// What the store's model is bound to: its shape, the fingerprint made of it, and the format
/// of the files it ingested.
#[derive(Clone)]
struct Bound {
    shape: Shape,
    fingerprint: Key,
    format: FileFormat,
}

#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    corrupt: AtomicU64,
    rejected: AtomicU64,
}

/// What a backend holds under a key, as far as a store can tell without reading the value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Presence {
    Absent,
    /// Present (with a secret: tagged by this store's secret).
    Ours,
    /// Present, but tagged by another writer.
    Foreign,
}

/// A restore point and what serves it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Plan {
    /// Tokens restored.
    len: usize,
    /// Full blocks of the main part (and of the SWA part when `swa_blocks`).
    blocks: usize,
    /// Whether the SWA rows come from SWA blocks.
    swa_blocks: bool,
    /// The checkpoint's key, when one is needed.
    checkpoint: Option<Key>,
}

/// Who a restored payload is for: the sequence its cells name, its V layout, and the SWA
/// window a reader keeps (`None`: every stored position).
#[derive(Clone, Copy)]
struct Target {
    seq: i32,
    /// Streams of the payload's KV parts: 1, or a live memory's stream per sequence (the
    /// sequence's stream holding its cells, the others empty); a dsv4 state's raw cache has
    /// its own.
    n_stream: u32,
    v_trans: bool,
    swa_window: Option<u32>,
    /// The cell extension the payload's cells carry: the live cache's, or the canonical
    /// file's form (x, y, tok) for a store that keeps extensions.
    ext: CellExt,
    /// Whether the KV parts record their rotation (today's layout, `streams-rot`) or not (the
    /// `streams` layout of the files llama.node and node-llama-cpp read).
    rot_recorded: bool,
}

/// A prompt store for one model. The model's shape is fixed by the first cache or file it sees
/// and recorded in the backend (a small model record beside the blocks), so a later process
/// can `lookup` and `write_file` without a cache; a cache of another shape is refused with
/// [`StoreError::Geometry`] (use another `model` string for it).
pub struct PromptStore {
    backend: Arc<dyn Backend>,
    model: String,
    namespace: String,
    sealer: Sealer,
    block_tokens: usize,
    bound: Mutex<Option<Bound>>,
    counters: Counters,
    latency: Latencies,
    /// The backend is one store, not tiers (its evictions are asked for directly).
    single_backend: bool,
    /// The model file's description, when the store was opened for one: every state put is
    /// checked against it before it can bind the store or add a block.
    model_info: Option<(ModelInfo, String)>,
}

fn aborted() -> StoreError {
    StoreError::Cache(KvError::Aborted(
        "the prompt store operation was aborted".into(),
    ))
}

fn tick(progress: &mut Option<Progress<'_>>, done: u64, total: u64) -> StoreResult<()> {
    match progress {
        Some(p) => {
            if p(done, total) {
                Ok(())
            } else {
                Err(aborted())
            }
        }
        None => Ok(()),
    }
}

const RECORD_MAGIC: [u8; 4] = *b"KVPM";

/// Whether a stored value is a store's model record (which backends with an expiry keep: a
/// process needs it to look up prompts without a cache) rather than a block, checkpoint or
/// index value.
pub fn is_model_record(value: &[u8]) -> bool {
    value.starts_with(&RECORD_MAGIC)
}

/// The format `write_file` defaults to for a store filled by `put` of a live cache: a sequence
/// file that llama.node and node-llama-cpp read (version 2), or today's version 4 when the
/// rows are rotated (only it records the rotation).
fn live_format(cache: &KvCache) -> FileFormat {
    let p = cache.params();
    let rotated = p.n_rot_k != 0 || p.n_rot_v != 0;
    let kind = FileKind::Sequence;
    FileFormat {
        kind,
        version: if rotated {
            kind.rotation_version()
        } else {
            kind.default_version()
        },
        layout: if rotated {
            Layout::StreamsRot
        } else {
            Layout::Streams
        },
        flash_attn: !cache.v_trans(),
        arch: None,
    }
}

impl PromptStore {
    /// A store for `model` (the caller's identity of the weights, e.g. the GGUF file's sha256)
    /// with blocks of `block_tokens` tokens (16 to 4096).
    pub fn new(
        backend: Arc<dyn Backend>,
        model: &str,
        block_tokens: u32,
    ) -> StoreResult<PromptStore> {
        if !(MIN_BLOCK_TOKENS..=MAX_BLOCK_TOKENS).contains(&block_tokens) {
            return Err(StoreError::InvalidArg(format!(
                "blockTokens must be between {MIN_BLOCK_TOKENS} and {MAX_BLOCK_TOKENS}, got {block_tokens}"
            )));
        }
        if model.is_empty() {
            return Err(StoreError::InvalidArg(
                "model must be a non-empty identity of the weights (e.g. the GGUF file's sha256)"
                    .into(),
            ));
        }
        // a single backend is counted here; a tiered one counts each of its tiers
        let single_backend = backend.tier_metrics().is_empty();
        let backend = match single_backend {
            true => Arc::new(Metered::new(backend)),
            false => backend,
        };
        Ok(PromptStore {
            backend,
            single_backend,
            latency: Latencies::default(),
            model: model.into(),
            namespace: String::new(),
            sealer: Sealer::new(None),
            block_tokens: block_tokens as usize,
            bound: Mutex::new(None),
            counters: Counters::default(),
            model_info: None,
        })
    }

    /// The store checked against the model `info` describes (its GGUF file): a state put by
    /// `put`, `put_memory`, `put_file` or `put_bytes` whose memory kind, parts, layer counts,
    /// widths or (files) architecture or rotation differ from the model's is refused with
    /// [`StoreError::Geometry`] naming the first difference, whether or not the store holds
    /// anything yet. A state of the same shape from another model of the same architecture
    /// cannot be told apart by its shape: that takes knowing which model wrote it (the
    /// adapters take the store's model from the peer that writes the states).
    /// `name` names the model in messages (its path).
    pub fn with_model(mut self, info: ModelInfo, name: &str) -> PromptStore {
        self.model_info = Some((info, name.into()));
        self
    }

    /// Refuses a state that does not fit the store's model, naming the first reason.
    fn check_fit(&self, fit: impl FnOnce(&ModelInfo) -> Fit) -> StoreResult<()> {
        let Some((info, name)) = &self.model_info else {
            return Ok(());
        };
        match fit(info).reasons.first() {
            None => Ok(()),
            Some(first) => Err(StoreError::Geometry(format!(
                "the state does not fit the store's model {name} ({}): {}",
                info.arch, first.message
            ))),
        }
    }

    /// The store in namespace `namespace` (a tenant): mixed into the root of every key, so two
    /// namespaces share no value and nothing one does shows in the other. The default, `""`,
    /// is shared by every store that names none.
    pub fn with_namespace(mut self, namespace: &str) -> PromptStore {
        self.namespace = namespace.into();
        self
    }

    /// The store with a `secret` (at least 16 bytes): every value it writes carries a keyed
    /// BLAKE3 tag, and a value without this tag (written without the secret, with another one,
    /// or copied from another key) is rejected on read and replaced on put.
    pub fn with_secret(mut self, secret: &[u8]) -> StoreResult<PromptStore> {
        if secret.len() < 16 {
            return Err(StoreError::InvalidArg(format!(
                "secret must be at least 16 bytes, got {}",
                secret.len()
            )));
        }
        self.sealer = Sealer::new(Some(secret));
        Ok(self)
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// Tokens per block.
    pub fn block_tokens(&self) -> u32 {
        self.block_tokens as u32
    }

    /// The chain keys of the full blocks of `tokens` under the store's fingerprint, if the
    /// model's shape is known.
    pub fn keys(&self, tokens: &[i32]) -> StoreResult<Option<Vec<Key>>> {
        Ok(self
            .known()?
            .map(|b| chain_keys(&b.fingerprint, tokens, self.block_tokens)))
    }

    /// The shape the store is bound to, if known.
    pub fn shape(&self) -> StoreResult<Option<Shape>> {
        Ok(self.known()?.map(|b| b.shape))
    }

    fn record_key(&self) -> Key {
        let mut h = Sha256::new();
        h.update(b"llama-kv-cache prompt-store model record\0");
        h.update(FORMAT_VERSION.to_le_bytes());
        for part in [&self.model, &self.namespace] {
            h.update((part.len() as u64).to_le_bytes());
            h.update(part.as_bytes());
        }
        Key(h.finalize().into())
    }

    fn encode_record(&self, shape: &Shape, format: &FileFormat) -> Vec<u8> {
        let mut out = RECORD_MAGIC.to_vec();
        shape.encode(&mut out);
        format.encode(&mut out);
        self.sealer.seal(&self.record_key(), &mut out);
        out
    }

    fn decode_record(&self, v: &[u8]) -> Result<(Shape, FileFormat), Broken> {
        let body = self.sealer.open(&self.record_key(), v)?;
        let parsed = (|| {
            if body.get(..4)? != RECORD_MAGIC {
                return None;
            }
            let mut f = Fields::new(&body[4..]);
            let shape = Shape::decode(&mut f)?;
            let format = FileFormat::decode(&mut f)?;
            (f.at == f.bytes.len()).then_some((shape, format))
        })();
        parsed.ok_or(Broken::Corrupt)
    }

    /// The recorded shape; a corrupt record is removed and reads as absent.
    fn read_record(&self) -> StoreResult<Option<(Shape, FileFormat)>> {
        let key = self.record_key();
        match self.backend.get_many(&[key])?.pop().flatten() {
            None => Ok(None),
            Some(v) => match self.decode_record(&v) {
                Ok(r) => Ok(Some(r)),
                Err(broken) => {
                    self.count_broken(broken);
                    self.backend.remove(&key)?;
                    Ok(None)
                }
            },
        }
    }

    fn bound_to(&self, shape: Shape, format: FileFormat) -> Bound {
        Bound {
            fingerprint: shape.fingerprint(&self.model, &self.namespace),
            shape,
            format,
        }
    }

    /// The bound shape, from memory or the model record.
    fn known(&self) -> StoreResult<Option<Bound>> {
        let mut bound = self.bound.lock().unwrap_or_else(|p| p.into_inner());
        if bound.is_none() {
            *bound = self.read_record()?.map(|(s, f)| self.bound_to(s, f));
        }
        Ok(bound.clone())
    }

    fn refuse(&self, bound: &Shape, got: &Shape) -> StoreError {
        StoreError::Geometry(format!(
            "this store holds model {:?} as {}; the state is {}",
            self.model,
            bound.describe(),
            got.describe()
        ))
    }

    /// Binds the store to `shape` (recording it with `format` when the model has no record yet)
    /// or refuses a shape that differs from the bound one.
    fn bind(&self, shape: &Shape, format: FileFormat) -> StoreResult<Bound> {
        let mut bound = self.bound.lock().unwrap_or_else(|p| p.into_inner());
        let b = match bound.as_ref() {
            Some(b) => {
                // the record may be gone from a shared tier that lost its data (a Redis
                // restarted without persistence): readers without a cache need it, so every
                // put restores it (a no-op `SET NX` where it is)
                self.backend
                    .put_if_absent(&self.record_key(), &self.encode_record(&b.shape, &b.format))?;
                b.clone()
            }
            None => {
                let recorded = match self.read_record()? {
                    Some(r) => r,
                    None => {
                        self.backend.put_if_absent(
                            &self.record_key(),
                            &self.encode_record(shape, &format),
                        )?;
                        // another process may have recorded first; an instant eviction leaves ours
                        self.read_record()?
                            .unwrap_or_else(|| (shape.clone(), format.clone()))
                    }
                };
                bound.insert(self.bound_to(recorded.0, recorded.1)).clone()
            }
        };
        if &b.shape != shape {
            return Err(self.refuse(&b.shape, shape));
        }
        Ok(b)
    }

    /// Stores what sequence `seq` of `cache` needs to be restored: the full blocks of its rows
    /// that the store lacks and, when the prompt ends inside a block (or the cache is
    /// recurrent), a checkpoint at its end. The sequence's cells must hold positions `0..n`
    /// with no pending K-shift; `tokens` are the prompt's tokens. `progress(done, total)`
    /// counts blocks and may abort between batches.
    pub fn put(
        &self,
        cache: &KvCache,
        seq: i32,
        tokens: &[i32],
        progress: Option<Progress<'_>>,
    ) -> StoreResult<PutReport> {
        let _timer = self.latency.put.start();
        let capture = Capture::of_cache(cache, seq, tokens.len())?;
        self.put_live_capture(&capture, tokens, live_format(cache), progress)
    }

    /// [`PromptStore::put_capture`] of a live cache or memory, checked against the store's
    /// model first (a file is checked as a whole, by `put_bytes`).
    fn put_live_capture(
        &self,
        c: &Capture<'_>,
        tokens: &[i32],
        format: FileFormat,
        progress: Option<Progress<'_>>,
    ) -> StoreResult<PutReport> {
        self.check_fit(|m| check_memory(c.shape.memory, &c.shape.part_widths(), m))?;
        self.put_capture(c, tokens, format, progress)
    }

    fn put_capture(
        &self,
        c: &Capture<'_>,
        tokens: &[i32],
        format: FileFormat,
        mut progress: Option<Progress<'_>>,
    ) -> StoreResult<PutReport> {
        let bound = self.bind(&c.shape, format)?;
        let bt = self.block_tokens;
        let len = c.len.min(tokens.len());
        let tokens = &tokens[..len];
        let keys = chain_keys(&bound.fingerprint, tokens, bt);
        // the SWA rows go into blocks when the state held the whole range
        let swa_full = c.swa.as_ref().filter(|s| s.is_prefix(len));
        let mut report = PutReport::default();
        let total = keys.len() as u64;
        tick(&mut progress, 0, total)?;
        if let Some(main) = &c.main {
            self.put_blocks(&bound, main, tokens, &keys, &mut report, &mut progress)?;
        }
        if let Some(swa) = swa_full {
            let swa_keys: Vec<Key> = keys.iter().map(swa_key).collect();
            self.put_blocks(&bound, swa, tokens, &swa_keys, &mut report, &mut progress)?;
        }
        // a checkpoint where the blocks alone do not restore the whole state: it must end
        // exactly where the tokens do
        let n_full = keys.len();
        let ends_at_len =
            |rows: &KvRows<'_>| rows.positions.last().is_none_or(|&p| p as usize + 1 == len);
        let ends_here = c.recurrent_end.is_none_or(|e| e == len)
            && c.swa.as_ref().is_none_or(ends_at_len)
            && c.window.as_ref().is_none_or(ends_at_len);
        let needs = !len.is_multiple_of(bt)
            || !c.recurrent.is_empty()
            || (c.swa.is_some() && swa_full.is_none())
            || c.window.is_some();
        report.tokens = if !needs {
            len as u64
        } else if ends_here && len > 0 {
            self.put_checkpoint(&bound, c, tokens, &keys, swa_full.is_some(), &mut report)?;
            len as u64
        } else if bound.shape.blocks_restore() && (c.swa.is_none() || swa_full.is_some()) {
            (n_full * bt) as u64
        } else {
            0
        };
        report.degraded = self
            .backend
            .health()
            .into_iter()
            .filter(|h| !h.up)
            .map(|h| h.name)
            .collect();
        Ok(report)
    }

    /// Stores the full blocks of `rows` under `keys` that the store lacks. Blocks go to the
    /// backend in batches of [`PUT_BATCH`], each written on a second thread while the next
    /// is encoded (checksums and copies overlap the writes: on two cores a put costs about
    /// what its writes cost); progress counts the blocks of each batch once it is written.
    fn put_blocks(
        &self,
        bound: &Bound,
        rows: &KvRows<'_>,
        tokens: &[i32],
        keys: &[Key],
        report: &mut PutReport,
        progress: &mut Option<Progress<'_>>,
    ) -> StoreResult<()> {
        let bt = self.block_tokens;
        let geometry = rows.source.geometry()?;
        let present = self.presence(keys)?;
        let mut pending: Vec<(Key, Vec<u8>)> = Vec::new();
        // encode buffers return here after each batch: two batches of allocations per put
        let mut spare: Vec<Vec<u8>> = Vec::new();
        let backend = &self.backend;
        std::thread::scope(|scope| {
            let mut in_flight: Option<ScopedJoinHandle<'_, Written>> = None;
            // waits for the batch being written, counts it and keeps its buffers
            let mut settle = |in_flight: &mut Option<ScopedJoinHandle<'_, Written>>,
                              spare: &mut Vec<Vec<u8>>,
                              report: &mut PutReport|
             -> StoreResult<()> {
                let Some(handle) = in_flight.take() else {
                    return Ok(());
                };
                let (stored, batch, done) = handle
                    .join()
                    .map_err(|_| StoreError::Io("a block writer thread panicked".into()))?;
                count_written(&batch, &stored?, report);
                spare.extend(batch.into_iter().map(|(_, v)| v));
                tick(progress, done as u64, keys.len() as u64)
            };
            for (i, key) in keys.iter().enumerate() {
                let id = BlockId {
                    fingerprint: &bound.fingerprint,
                    key,
                    index: i as u32,
                    tokens: &tokens[i * bt..(i + 1) * bt],
                    geometry: &geometry,
                };
                if present[i] == Presence::Ours {
                    report.blocks_skipped += 1;
                    report.bytes_skipped += block::encoded_len(&id) as u64;
                } else {
                    self.replace_foreign(key, present[i])?;
                    let mut value = spare.pop().unwrap_or_default();
                    let cells = &rows.cells[i * bt..(i + 1) * bt];
                    block::encode_into(
                        &id,
                        &self.sealer,
                        &mut value,
                        |out, il, is_v| rows.source.append(il, is_v, cells, out),
                        |out| {
                            rows.source.append_exts(cells, out);
                            Ok(())
                        },
                    )?;
                    pending.push((*key, value));
                }
                if pending.len() == PUT_BATCH || i + 1 == keys.len() {
                    settle(&mut in_flight, &mut spare, report)?;
                    let batch = std::mem::take(&mut pending);
                    in_flight = Some(scope.spawn(move || {
                        let entries: Vec<(Key, &[u8])> =
                            batch.iter().map(|(k, v)| (*k, v.as_slice())).collect();
                        let stored = match entries.is_empty() {
                            true => Ok(Vec::new()),
                            false => backend.put_many(&entries),
                        };
                        (stored, batch, i + 1)
                    }));
                }
            }
            settle(&mut in_flight, &mut spare, report)
        })
    }

    /// Stores the checkpoint at `tokens.len()` and lists it in its chain position's index.
    fn put_checkpoint(
        &self,
        bound: &Bound,
        c: &Capture<'_>,
        tokens: &[i32],
        keys: &[Key],
        swa_in_blocks: bool,
        report: &mut PutReport,
    ) -> StoreResult<()> {
        let bt = self.block_tokens;
        let n_full = keys.len();
        let at = chain_at(&bound.fingerprint, keys, n_full);
        let tail = &tokens[n_full * bt..];
        let key = checkpoint_key(&at, tail);
        let present = self.presence(&[key])?[0];
        if present != Presence::Ours {
            self.replace_foreign(&key, present)?;
            let swa = match &c.swa {
                None => SwaRows::None,
                Some(_) if swa_in_blocks => SwaRows::Tail,
                Some(s) => SwaRows::Window(s.positions.clone()),
            };
            let id = CheckpointId {
                fingerprint: &bound.fingerprint,
                key: &key,
                len: tokens.len() as u32,
                tail,
            };
            let window = c.window.as_ref().map_or(&[][..], |w| &w.positions[..]);
            let value = checkpoint::encode(
                &id,
                &self.sealer,
                &c.shape,
                (&swa, window),
                &c.recurrent,
                |out, slot| {
                    let (rows, cells) = match (slot, &c.main, &c.swa, &c.window) {
                        (Slot::Main, Some(m), _, _) => (m, &m.cells[n_full * bt..tokens.len()]),
                        (Slot::Swa, _, Some(s), _) if swa_in_blocks => {
                            (s, &s.cells[n_full * bt..tokens.len()])
                        }
                        (Slot::Swa, _, Some(s), _) => (s, &s.cells[..]),
                        (Slot::Window, _, _, Some(w)) => (w, &w.cells[..]),
                        _ => return Ok(()),
                    };
                    let geometry = rows.source.geometry()?;
                    for il in 0..geometry.layers.len() {
                        for is_v in [false, true] {
                            if !cells.is_empty() {
                                rows.source.append(il, is_v, cells, out)?;
                            }
                        }
                    }
                    if !geometry.ext.is_none() {
                        rows.source.append_exts(cells, out);
                    }
                    Ok(())
                },
            )?;
            if self.backend.put_if_absent(&key, &value)? {
                report.checkpoints_written += 1;
                report.bytes_written += value.len() as u64;
            }
        }
        let entry = tail.len() as u32 | if swa_in_blocks { NEEDS_SWA_BLOCKS } else { 0 };
        self.add_to_index(&index_key(&at), entry)
    }

    /// Adds `entry` to an index value (replacing it whole).
    fn add_to_index(&self, key: &Key, entry: u32) -> StoreResult<()> {
        let current = self.backend.get_many(&[*key])?.pop().flatten();
        let mut entries = current
            .as_deref()
            .and_then(|v| checkpoint::decode_index(key, &self.sealer, v))
            .unwrap_or_default();
        if entries.contains(&entry) {
            return Ok(());
        }
        entries.push(entry);
        entries.sort_unstable();
        if current.is_some() {
            self.backend.remove(key)?;
        }
        self.backend
            .put_if_absent(key, &checkpoint::encode_index(key, &self.sealer, &entries))?;
        Ok(())
    }

    /// The stored checkpoints of `tokens` listed at chain positions `range` that the blocks
    /// support: two round trips (the index values, then the checkpoints' presence).
    fn checkpoints_in(
        &self,
        bound: &Bound,
        tokens: &[i32],
        keys: &[Key],
        range: std::ops::Range<usize>,
        (block_point, n_swa): (usize, usize),
    ) -> StoreResult<Vec<Plan>> {
        let bt = self.block_tokens;
        let ats: Vec<Key> = range
            .clone()
            .map(|i| chain_at(&bound.fingerprint, keys, i))
            .collect();
        let index_keys: Vec<Key> = ats.iter().map(index_key).collect();
        let indexes = self.backend.get_many(&index_keys)?;
        let mut candidates = Vec::new();
        for (j, value) in indexes.iter().enumerate() {
            let i = range.start + j;
            for entry in value
                .as_deref()
                .and_then(|v| checkpoint::decode_index(&index_keys[j], &self.sealer, v))
                .unwrap_or_default()
            {
                let (o, swa_blocks) = (
                    (entry & !NEEDS_SWA_BLOCKS) as usize,
                    entry & NEEDS_SWA_BLOCKS != 0,
                );
                let len = i * bt + o;
                if o >= bt
                    || len > tokens.len()
                    || len <= block_point * bt
                    || (swa_blocks && i > n_swa)
                {
                    continue;
                }
                let key = checkpoint_key(&ats[j], &tokens[i * bt..len]);
                candidates.push(Plan {
                    len,
                    blocks: i,
                    swa_blocks,
                    checkpoint: Some(key),
                });
            }
        }
        if candidates.is_empty() {
            return Ok(candidates);
        }
        let ckpt_keys: Vec<Key> = candidates.iter().filter_map(|p| p.checkpoint).collect();
        let present = self.presence(&ckpt_keys)?;
        Ok(candidates
            .into_iter()
            .zip(present)
            .filter(|(_, p)| *p == Presence::Ours)
            .map(|(c, _)| c)
            .collect())
    }

    /// The restore points of `tokens`, longest first: what the blocks serve alone, and the
    /// listed checkpoints of the highest chain positions that have any whose blocks are
    /// present. Two round trips for the blocks, two per batch of index values; no value but
    /// the small index values read.
    /// Returns the chain keys of `tokens` with them (the restore reads those blocks), and how
    /// many leading full blocks of the part kept per position are stored.
    fn plans(&self, bound: &Bound, tokens: &[i32]) -> StoreResult<(Vec<Key>, Vec<Plan>, usize)> {
        let bt = self.block_tokens;
        let shape = &bound.shape;
        let keys = chain_keys(&bound.fingerprint, tokens, bt);
        let n_main = if shape.main.is_some() {
            self.present_prefix(&keys)?
        } else {
            keys.len()
        };
        let n_swa = if shape.swa.is_some() {
            let swa: Vec<Key> = keys[..n_main].iter().map(swa_key).collect();
            self.present_prefix(&swa)?
        } else {
            n_main
        };
        let block_point = if shape.blocks_restore() { n_swa } else { 0 };
        let mut plans = Vec::new();
        // chain positions whose checkpoints could beat the blocks (none when the blocks already
        // serve every token: no index is read then), searched from the longest down in
        // batches of 4, 16, 64, ...: the checkpoint a prompt needs is usually its last, and a
        // checkpoint at position i beats every one below it
        let first = block_point.min(n_main);
        let mut top = (first..=n_main)
            .rev()
            .find(|&i| tokens.len().min(i * bt + bt - 1) > block_point * bt)
            .map(|last| last + 1);
        let mut batch = 4;
        while let Some(end) = top {
            let start = end.saturating_sub(batch).max(first);
            let found =
                self.checkpoints_in(bound, tokens, &keys, start..end, (block_point, n_swa))?;
            if !found.is_empty() {
                plans.extend(found);
                break;
            }
            top = (start > first).then_some(start);
            batch *= 4;
        }
        if block_point > 0 {
            plans.push(Plan {
                len: block_point * bt,
                blocks: block_point,
                swa_blocks: shape.swa.is_some(),
                checkpoint: None,
            });
        }
        plans.sort_by_key(|p| std::cmp::Reverse(p.len));
        Ok((keys, plans, n_main))
    }

    /// The length in tokens of the longest prefix of `tokens` the store can restore: full
    /// blocks plus, where the memory needs one, a checkpoint at its end. Reads no rows.
    pub fn lookup(&self, tokens: &[i32]) -> StoreResult<u64> {
        Ok(self.lookup_detail(tokens)?.tokens)
    }

    /// [`PromptStore::lookup`], with what the store holds of the prompt and why the restore
    /// point is where it is, so that an app can tell "nothing stored" from "blocks stored, but
    /// no checkpoint where this memory needs one".
    pub fn lookup_detail(&self, tokens: &[i32]) -> StoreResult<LookupDetail> {
        let _timer = self.latency.lookup.start();
        let Some(bound) = self.known()? else {
            return Ok(LookupDetail {
                tokens: 0,
                blocks: 0,
                checkpoint_at: None,
                reason: LookupReason::NoModel,
            });
        };
        let (_, plans, n_main) = self.plans(&bound, tokens)?;
        let best = plans.first();
        let len = best.map_or(0, |p| p.len);
        self.count(len, tokens.len());
        let blocks = if bound.shape.main.is_some() {
            n_main
        } else {
            0
        };
        let reason = if len == tokens.len() && len > 0 {
            LookupReason::Complete
        } else if bound.shape.main.is_some() && blocks == 0 {
            LookupReason::NoBlocks
        } else if blocks * self.block_tokens > len || (bound.shape.main.is_none() && len == 0) {
            LookupReason::NoCheckpoint
        } else {
            LookupReason::PrefixEnds
        };
        Ok(LookupDetail {
            tokens: len as u64,
            blocks: blocks as u64,
            checkpoint_at: best
                .filter(|p| p.checkpoint.is_some())
                .map(|p| p.len as u64),
            reason,
        })
    }

    fn count(&self, found: usize, wanted: usize) {
        let bt = self.block_tokens;
        self.counters
            .hits
            .fetch_add(found.div_ceil(bt) as u64, Ordering::Relaxed);
        if found < wanted - wanted % bt {
            self.counters.misses.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn count_broken(&self, broken: Broken) {
        let counter = match broken {
            Broken::Corrupt => &self.counters.corrupt,
            Broken::Rejected => &self.counters.rejected,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// What the backend holds under each key: with a secret, a present value's tag is checked
    /// (its last 64 bytes, one round trip), so a value of another writer neither counts as
    /// stored nor stops a put.
    fn presence(&self, keys: &[Key]) -> StoreResult<Vec<Presence>> {
        if !self.sealer.authenticated() {
            let present = self.backend.contains_many(keys)?;
            return Ok(present
                .into_iter()
                .map(|p| if p { Presence::Ours } else { Presence::Absent })
                .collect());
        }
        let tails = self.backend.get_tails(keys, TRAILER)?;
        Ok(tails
            .iter()
            .zip(keys)
            .map(|(tail, key)| match tail {
                None => Presence::Absent,
                Some(t) if self.sealer.tail_is_ours(key, t) => Presence::Ours,
                Some(_) => Presence::Foreign,
            })
            .collect())
    }

    /// How many leading `keys` hold this store's values.
    fn present_prefix(&self, keys: &[Key]) -> StoreResult<usize> {
        if !self.sealer.authenticated() {
            return self.backend.present_prefix(keys);
        }
        let present = self.presence(keys)?;
        Ok(present.iter().take_while(|&&p| p == Presence::Ours).count())
    }

    /// Removes a value another writer left under `key`, so that ours can be stored there.
    fn replace_foreign(&self, key: &Key, presence: Presence) -> StoreResult<()> {
        if presence == Presence::Foreign {
            self.count_broken(Broken::Rejected);
            self.backend.remove(key)?;
        }
        Ok(())
    }

    fn corrupt(&self, key: &Key, broken: Broken) {
        self.count_broken(broken);
        // best effort: a later put stores a good value under this key
        let _ = self.backend.remove(key);
    }

    /// Reads and verifies the blocks `keys[..n]` of one part, calling `put(i, rows)` for each
    /// (whose first error ends the read and is returned). Returns false (after counting and
    /// removing it) when one is absent or corrupt.
    fn read_blocks(
        &self,
        bound: &Bound,
        geometry: &Geometry,
        keys: &[Key],
        tokens: &[i32],
        put: &mut dyn FnMut(usize, &BlockRows<'_>) -> StoreResult<()>,
    ) -> StoreResult<bool> {
        let bt = self.block_tokens;
        let mut ok = 0;
        let mut corrupt = None;
        let mut failed = None;
        self.backend.visit_many(keys, &mut |i, value| {
            // absent: evicted between the two calls
            let Some(value) = value else { return false };
            let id = BlockId {
                fingerprint: &bound.fingerprint,
                key: &keys[i],
                index: i as u32,
                tokens: &tokens[i * bt..(i + 1) * bt],
                geometry,
            };
            match block::decode(value, &id, &self.sealer) {
                Ok(rows) => match put(i, &rows) {
                    Ok(()) => {
                        ok += 1;
                        true
                    }
                    Err(e) => {
                        failed = Some(e);
                        false
                    }
                },
                Err(c) => {
                    corrupt = Some((keys[i], c.1));
                    false
                }
            }
        })?;
        if let Some(e) = failed {
            return Err(e);
        }
        if let Some((key, broken)) = corrupt {
            self.corrupt(&key, broken);
        }
        Ok(ok == keys.len())
    }

    /// Reads and verifies the checkpoint of `plan` (if it has one) and calls `with` on it.
    /// `None` when the value turned out absent or corrupt (counted and removed: the caller
    /// plans again).
    fn with_checkpoint<R>(
        &self,
        bound: &Bound,
        tokens: &[i32],
        keys: &[Key],
        plan: &Plan,
        with: impl FnOnce(Option<&CheckpointView<'_>>) -> StoreResult<R>,
    ) -> StoreResult<Option<R>> {
        let Some(key) = &plan.checkpoint else {
            return with(None).map(Some);
        };
        let Some(value) = self.backend.get_many(&[*key])?.pop().flatten() else {
            return Ok(None);
        };
        let tail = &tokens[plan.blocks * self.block_tokens..plan.len];
        let id = CheckpointId {
            fingerprint: &bound.fingerprint,
            key,
            len: plan.len as u32,
            tail,
        };
        debug_assert_eq!(
            *key,
            checkpoint_key(&chain_at(&bound.fingerprint, keys, plan.blocks), tail)
        );
        match checkpoint::decode(&value, &id, &self.sealer, &bound.shape) {
            Ok(c) => with(Some(&c)).map(Some),
            Err(c) => {
                self.corrupt(key, c.1);
                Ok(None)
            }
        }
    }

    /// The payload of the restore point `plan` for sequence `seq`: its parts in llama.cpp's
    /// order, V transposed or not. `None` when a value turned out absent or corrupt (counted
    /// and removed: the caller plans again).
    fn assemble(
        &self,
        bound: &Bound,
        tokens: &[i32],
        keys: &[Key],
        plan: &Plan,
        target: Target,
        out: &mut dyn PayloadSink,
    ) -> StoreResult<bool> {
        let keys = &keys[..plan.blocks];
        let assembled = self.with_checkpoint(bound, tokens, keys, plan, |ckpt| {
            let Target {
                seq,
                n_stream,
                v_trans,
                swa_window,
                ext,
                rot_recorded,
            } = target;
            let rot = |r: (u32, u32)| rot_recorded.then_some(r);
            let bt = self.block_tokens;
            let shape = &bound.shape;
            let positions: Vec<i32> = (0..plan.len as i32).collect();
            // llama.cpp's order: main, window or indexer, recurrent state; a hybrid with an
            // indexer writes its recurrent state before the indexer's cache
            let recurrent_first = shape.memory == MemoryKind::HybridIdx;
            // a dsv4 state: its envelope (full mode), then its raw cache of one stream per
            // sequence, the compressed caches and compressor states last (in the checkpoint)
            let at = match &shape.dsv4 {
                Some(d) => {
                    for x in [dsv4::MAGIC, dsv4::VERSION, 0] {
                        out.append(&x.to_le_bytes())?;
                    }
                    StreamAt {
                        seq,
                        n_stream: d.n_stream,
                    }
                }
                None => StreamAt { seq, n_stream },
            };
            if let Some(main) = &shape.main {
                let w = KvPartWriter::begin(
                    out,
                    &main.layers,
                    ext,
                    &positions,
                    at,
                    v_trans,
                    rot(main.rot),
                )?;
                let complete = self.read_blocks(
                    bound,
                    &main.layers,
                    keys,
                    tokens,
                    &mut |i: usize, rows: &BlockRows<'_>| w.put(out, i * bt, rows),
                )?;
                if !complete {
                    return Ok(false);
                }
                if let Some(rows) = ckpt.as_ref().and_then(|c| c.main.as_ref()) {
                    w.put(out, plan.blocks * bt, rows)?;
                }
            }
            if let Some(c) = ckpt.as_ref().filter(|_| recurrent_first) {
                out.append(c.recurrent)?;
            }
            if let Some(swa) = &shape.swa {
                let window = ckpt.as_ref().and_then(|c| match &c.swa_mode {
                    SwaRows::Window(p) => Some(p.clone()),
                    _ => None,
                });
                match window {
                    Some(p) => {
                        let w = KvPartWriter::begin(
                            out,
                            &swa.layers,
                            ext,
                            &p,
                            at,
                            v_trans,
                            rot(swa.rot),
                        )?;
                        if let Some(rows) = ckpt.as_ref().and_then(|c| c.swa.as_ref()) {
                            w.put(out, 0, rows)?;
                        }
                    }
                    None => {
                        // the whole range is in SWA blocks (and the tail in the checkpoint);
                        // a reader that keeps only the window gets its last positions
                        let keep = swa_window.map_or(plan.len, |n| (n as usize).min(plan.len));
                        let from = plan.len - keep;
                        let w = KvPartWriter::begin(
                            out,
                            &swa.layers,
                            ext,
                            &positions[from..],
                            at,
                            v_trans,
                            rot(swa.rot),
                        )?;
                        let swa_keys: Vec<Key> = keys.iter().map(swa_key).collect();
                        let complete = self.read_blocks(
                            bound,
                            &swa.layers,
                            &swa_keys,
                            tokens,
                            &mut |i: usize, rows: &BlockRows<'_>| {
                                put_window(&w, out, i * bt, from, rows)
                            },
                        )?;
                        if !complete {
                            return Ok(false);
                        }
                        if let Some(rows) = ckpt.as_ref().and_then(|c| c.swa.as_ref()) {
                            put_window(&w, out, plan.blocks * bt, from, rows)?;
                        }
                    }
                }
            }
            // dsa-iswa's window cache, after its indexer: in the checkpoint only
            if let Some(window) = &shape.window {
                let Some((p, rows)) = ckpt.as_ref().and_then(|c| c.window.as_ref()) else {
                    return Ok(false);
                };
                let w =
                    KvPartWriter::begin(out, &window.layers, ext, p, at, v_trans, rot(window.rot))?;
                w.put(out, 0, rows)?;
            }
            if let Some(c) = ckpt.as_ref().filter(|_| !recurrent_first) {
                out.append(c.recurrent)?;
            }
            Ok(true)
        })?;
        Ok(assembled == Some(true))
    }

    /// Plans `tokens` and tries the longest restore point with `attempt(keys, plan)`, planning
    /// again when it found a value absent or corrupt (counted and removed: the next plan is
    /// shorter); counts the hit or the miss. Returns the length of the point that loaded.
    fn with_best_plan(
        &self,
        bound: &Bound,
        tokens: &[i32],
        attempt: &mut dyn FnMut(&[Key], &Plan) -> StoreResult<bool>,
    ) -> StoreResult<Option<usize>> {
        for _ in 0..MAX_REPLANS {
            let (keys, plans, _) = self.plans(bound, tokens)?;
            let Some(plan) = plans.first() else { break };
            if attempt(&keys, plan)? {
                self.count(plan.len, tokens.len());
                return Ok(Some(plan.len));
            }
        }
        self.count(0, tokens.len());
        Ok(None)
    }

    /// Assembles the longest restore point that verifies into `out` (started again for each
    /// attempt), after `head(len)` (a file's header, or nothing). Returns its length in tokens.
    fn load(
        &self,
        bound: &Bound,
        tokens: &[i32],
        target: Target,
        head: &dyn Fn(usize) -> Vec<u8>,
        out: &mut dyn PayloadSink,
    ) -> StoreResult<Option<usize>> {
        self.with_best_plan(bound, tokens, &mut |keys, plan| {
            out.restart()?;
            out.append(&head(plan.len))?;
            self.assemble(bound, tokens, keys, plan, target, out)
        })
    }

    /// Loads the longest stored prefix of `tokens` into sequence `seq` of `cache`
    /// (transactionally: on any error the cache is unchanged) and returns its length in tokens.
    /// `progress` gets `(tokens loaded, tokens of the restore point)` before each block and at
    /// the end; stopping it rolls the load back.
    /// The sequence's previous cells are replaced. When nothing is stored, returns 0 and leaves
    /// the cache unchanged. The cache must be of the store's shape: a unified or recurrent
    /// cache (iSWA and hybrid states are restored through `write_file`).
    pub fn restore(
        &self,
        cache: &mut KvCache,
        seq: i32,
        tokens: &[i32],
        progress: Option<Progress<'_>>,
    ) -> StoreResult<u64> {
        let _timer = self.latency.restore.start();
        if seq < 0 || seq as u32 >= cache.params().n_seq_max {
            return Err(StoreError::Cache(KvError::OutOfRange(format!(
                "seq id {seq} is outside [0, {})",
                cache.params().n_seq_max
            ))));
        }
        let bound = if cache.recurrent() {
            // a recurrent cache without a state has no shape of its own: the record's is
            // used, and the load checks the state against the cache
            match self.known()? {
                Some(b) if b.shape.memory == MemoryKind::Recurrent => b,
                Some(b) => {
                    return Err(StoreError::Geometry(format!(
                        "this store holds model {:?} as {}; the cache is recurrent",
                        self.model,
                        b.shape.describe()
                    )))
                }
                None => return Ok(0),
            }
        } else {
            let shape = unified_shape(cache)?;
            // without a model record (evicted from a shared store, or never written there),
            // the cache's own shape gives the same fingerprint a put of this model used
            let bound = match self.known()? {
                Some(bound) => bound,
                None => self.bound_to(shape.clone(), live_format(cache)),
            };
            if bound.shape != shape {
                return Err(self.refuse(&bound.shape, &shape));
            }
            bound
        };
        if !cache.recurrent() {
            return self.load_rows(&bound, tokens, cache, seq, progress);
        }
        let mut payload = Vec::new();
        let Some(len) = self.load(
            &bound,
            tokens,
            Target {
                seq,
                n_stream: 1,
                v_trans: cache.v_trans(),
                swa_window: None,
                ext: cache.params().cell_ext,
                rot_recorded: true,
            },
            &|_| Vec::new(),
            &mut payload,
        )?
        else {
            return Ok(0);
        };
        let opts = ReadOptions {
            layout: Some(Layout::Seed),
            allow_scattered: true,
            ..ReadOptions::default()
        };
        // the one state is loaded whole
        read_whole(progress, len, || {
            Ok(cache.state_read(&payload, seq, opts, None)?)
        })
    }

    /// Plans `tokens`, then loads the longest restore point that verifies into sequence `seq`
    /// of a transformer cache block by block, each as it is read and verified: the rows go
    /// from the value the backend read straight into the tensors, with no payload assembled
    /// in between. On any error the cache is as before (the load is dropped).
    fn load_rows(
        &self,
        bound: &Bound,
        tokens: &[i32],
        cache: &mut KvCache,
        seq: i32,
        mut progress: Option<Progress<'_>>,
    ) -> StoreResult<u64> {
        let bt = self.block_tokens;
        let Some(main) = &bound.shape.main else {
            return Err(StoreError::Geometry(format!(
                "this store holds model {:?} as {}, which has no attention rows for this cache",
                self.model,
                bound.shape.describe()
            )));
        };
        let len = self.with_best_plan(bound, tokens, &mut |keys, plan| {
            let keys = &keys[..plan.blocks];
            let positions: Vec<i32> = (0..plan.len as i32).collect();
            let loaded = self.with_checkpoint(bound, tokens, keys, plan, |ckpt| {
                let mut load = cache.load_sequence_rows(seq, &positions, true)?;
                let mut put = |first: usize, rows: &BlockRows<'_>| {
                    tick(&mut progress, first as u64, plan.len as u64)?;
                    put_rows(&mut load, &main.layers, first, rows)
                };
                let complete =
                    self.read_blocks(bound, &main.layers, keys, tokens, &mut |i, rows| {
                        put(i * bt, rows)
                    })?;
                if !complete {
                    return Ok(false);
                }
                if let Some(rows) = ckpt.and_then(|c| c.main.as_ref()) {
                    put(plan.blocks * bt, rows)?;
                }
                tick(&mut progress, plan.len as u64, plan.len as u64)?;
                load.commit();
                Ok(true)
            })?;
            Ok(loaded == Some(true))
        })?;
        Ok(len.map_or(0, |len| len as u64))
    }

    /// Ingests a llama.cpp session or sequence file's bytes (any version, layout and memory
    /// this package reads): its one sequence's full blocks and, where needed, a checkpoint at
    /// its end, with the file's tokens.
    pub fn put_bytes(
        &self,
        bytes: &[u8],
        progress: Option<Progress<'_>>,
    ) -> StoreResult<PutReport> {
        let known = self.known()?;
        let recurrent = known.map(|b| b.shape.memory == MemoryKind::Recurrent);
        let ins = inspect_bytes(bytes)?;
        self.check_fit(|m| check_state(&ins, m))?;
        let (capture, format) = Capture::of_file(bytes, &ins, recurrent)?;
        self.put_capture(&capture, &ins.header.tokens, format, progress)
    }

    /// [`PromptStore::put_bytes`] of a file.
    pub fn put_file(&self, path: &Path, progress: Option<Progress<'_>>) -> StoreResult<PutReport> {
        let _timer = self.latency.put.start();
        let bytes = llama_kv_cache::state::files::read_file(path)?;
        self.put_bytes(&bytes, progress)
    }

    /// How `file_bytes` and `write_file` write a file for `opts`: the payload for the `target`
    /// reader, the file version of its header, and the conversion that gives the asked kind,
    /// version and layout (`None`: the payload is written as it is). The store's own form (a
    /// sequence file of today's version) and the sequence files of the versions before it
    /// (llama.node's 2, node-llama-cpp's 3: the `streams` layout, no rotation recorded) are
    /// written straight from the blocks; any other form is converted from the store's own.
    fn file_form(
        &self,
        bound: &Bound,
        opts: &WriteFileOptions,
    ) -> (Target, u32, Option<ConvertOptions>) {
        let d = &bound.format;
        let shape = &bound.shape;
        let flash_attn = opts.flash_attn.unwrap_or(d.flash_attn);
        let canonical_version = FileKind::Sequence.rotation_version();
        let mut target = Target {
            seq: 0,
            n_stream: 1,
            v_trans: !flash_attn,
            swa_window: opts.swa_window,
            ext: shape.cell_ext().map_or(CellExt::None, |_| {
                FileKind::Sequence.cell_exts(canonical_version)[0]
            }),
            rot_recorded: true,
        };
        // a dsv4 store writes sequence files: a session holds every row of every sequence's
        // compressed caches, which no stored sequence has
        let kind = opts.kind.unwrap_or(match shape.dsv4 {
            Some(_) => FileKind::Sequence,
            None => d.kind,
        });
        let version = opts.version.or((kind == d.kind).then_some(d.version));
        let rotation = version.is_none_or(|v| kind.records_rotation(v));
        let layout = match opts.layout {
            Some(l) => l,
            None if !rotation && d.layout == Layout::StreamsRot => Layout::Streams,
            None => d.layout,
        };
        let n_stream = opts.n_stream.unwrap_or(1);
        let sequence_of_one_stream = kind == FileKind::Sequence && n_stream == 1;
        if sequence_of_one_stream
            && version.unwrap_or(canonical_version) == canonical_version
            && layout != Layout::Seed
        {
            return (target, canonical_version, None);
        }
        // an older sequence file differs from the store's own form only in its header's
        // version and the rotation its KV parts do not record: where nothing is rotated, and
        // no part is of a kind whose bytes changed between the versions (cell extensions,
        // recurrent states, dsv4's sections), it is written as directly
        let unrotated = [&shape.main, &shape.swa, &shape.window]
            .iter()
            .all(|p| p.as_ref().is_none_or(|p| p.rot == (0, 0)));
        match version {
            Some(v)
                if sequence_of_one_stream
                    && layout == Layout::Streams
                    && !kind.records_rotation(v)
                    && unrotated
                    && shape.cell_ext().is_none()
                    && shape.recurrent.is_none()
                    && shape.dsv4.is_none() =>
            {
                target.rot_recorded = false;
                (target, v, None)
            }
            _ => {
                let convert = ConvertOptions {
                    write: WriteOptions {
                        version,
                        layout,
                        n_stream,
                    },
                    to: Some(kind),
                    arch: opts.arch.clone().or_else(|| d.arch.clone()),
                    recurrent: Some(shape.memory == MemoryKind::Recurrent),
                    ..ConvertOptions::default()
                };
                (target, canonical_version, Some(convert))
            }
        }
    }

    /// The header of a sequence file of `version` of `tokens`.
    fn file_head(version: u32, tokens: &[i32]) -> Vec<u8> {
        header_bytes(FileKind::Sequence, version, tokens)
    }

    /// The longest stored prefix of `tokens` as a llama.cpp file's bytes, with that prefix as
    /// the file's tokens, or `None` when nothing is stored.
    pub fn file_bytes(
        &self,
        tokens: &[i32],
        opts: &WriteFileOptions,
        progress: Option<Progress<'_>>,
    ) -> StoreResult<Option<(u64, Vec<u8>)>> {
        let _timer = self.latency.restore.start();
        let Some(bound) = self.known()? else {
            return Ok(None);
        };
        let (target, version, convert) = self.file_form(&bound, opts);
        self.assembled_file(&bound, tokens, target, version, convert, progress)
    }

    /// [`PromptStore::file_bytes`] once the form is decided: the store's own form assembled
    /// in memory, then converted if asked.
    fn assembled_file(
        &self,
        bound: &Bound,
        tokens: &[i32],
        target: Target,
        version: u32,
        convert: Option<ConvertOptions>,
        mut progress: Option<Progress<'_>>,
    ) -> StoreResult<Option<(u64, Vec<u8>)>> {
        let mut file = Vec::new();
        let head = |len: usize| Self::file_head(version, &tokens[..len]);
        let Some(len) = self.load(bound, tokens, target, &head, &mut file)? else {
            return Ok(None);
        };
        let bytes = match convert {
            None => file,
            Some(convert) => convert_bytes(&file, &convert)?,
        };
        let n = bytes.len() as u64;
        tick(&mut progress, n, n)?;
        Ok(Some((len as u64, bytes)))
    }

    /// Writes the longest stored prefix of `tokens` to `path` as a llama.cpp file (atomically)
    /// and returns its length in tokens. When nothing is stored, writes nothing and returns 0.
    /// A sequence file the blocks give directly (the store's own form, or llama.node's and
    /// node-llama-cpp's versions of it) is written straight from the blocks into the file, with
    /// no copy of it in memory: V rows (the form of files from flash-attention contexts) at
    /// their offsets, a transposed V in the file's mapped pages. Any other form is assembled in
    /// memory and converted.
    pub fn write_file(
        &self,
        tokens: &[i32],
        path: &Path,
        opts: &WriteFileOptions,
        mut progress: Option<Progress<'_>>,
    ) -> StoreResult<u64> {
        let _timer = self.latency.restore.start();
        let Some(bound) = self.known()? else {
            return Ok(0);
        };
        let (target, version, convert) = self.file_form(&bound, opts);
        let durability = opts.durability.unwrap_or(Durability::Synced);
        if convert.is_some() {
            return match self.assembled_file(&bound, tokens, target, version, convert, progress)? {
                Some((n, bytes)) => {
                    write_replacing(path, durability, &bytes)?;
                    Ok(n)
                }
                None => Ok(0),
            };
        }
        // nothing stored: no file; a store error: the temporary file goes, the old file stays
        let (mut written, mut nothing, mut failed) = (0, false, None);
        let head = |len: usize| Self::file_head(version, &tokens[..len]);
        let result = write_replacing_file(path, durability, &mut |file| {
            // V rows go to their offsets in the file; a transposed V puts each row in every
            // channel's run, so it is assembled in the file's own pages, mapped
            let loaded = if target.v_trans {
                let mut sink = MappedFileSink::new(file);
                let len = self.load(&bound, tokens, target, &head, &mut sink);
                len.and_then(|len| Ok((len, sink.len(), sink.finish()?)))
            } else {
                let mut sink = FileSink::new(file);
                let len = self.load(&bound, tokens, target, &head, &mut sink);
                len.and_then(|len| Ok((len, sink.len(), sink.finish()?)))
            };
            let loaded = loaded.and_then(|(len, n, ())| {
                if len.is_some() {
                    tick(&mut progress, n as u64, n as u64)?;
                }
                Ok(len)
            });
            match loaded {
                Ok(Some(len)) => {
                    written = len as u64;
                    Ok(())
                }
                Ok(None) => {
                    nothing = true;
                    Err(KvError::Aborted("nothing stored for these tokens".into()))
                }
                Err(e) => {
                    failed = Some(e);
                    Err(KvError::Aborted("the store failed while writing".into()))
                }
            }
        });
        if let Some(e) = failed {
            return Err(e);
        }
        if nothing {
            return Ok(0);
        }
        result?;
        Ok(written)
    }

    /// This store object's figures in the Prometheus text exposition format: per tier the
    /// values found and missed, bytes read and written and evictions; corrupt and rejected
    /// blocks; latency histograms of lookup, put and restore. Serve it from an HTTP handler.
    pub fn metrics(&self) -> StoreResult<String> {
        let mut tiers = self.backend.tier_metrics();
        if let (true, [only]) = (self.single_backend, tiers.as_mut_slice()) {
            // a tiered backend asks its tiers itself, minding their backoff
            only.evictions = self.backend.usage().ok().map(|u| u.evictions);
        }
        let l = &self.latency;
        Ok(render(&Snapshot {
            tiers,
            corrupt: self.counters.corrupt.load(Ordering::Relaxed),
            rejected: self.counters.rejected.load(Ordering::Relaxed),
            latencies: [
                ("lookup", &l.lookup),
                ("put", &l.put),
                ("restore", &l.restore),
            ],
        }))
    }

    /// Counts of the backend and of this store object.
    pub fn stats(&self) -> StoreResult<StoreStats> {
        let u = self.backend.usage()?;
        Ok(StoreStats {
            backend: self.backend.name(),
            block_tokens: self.block_tokens as u32,
            blocks: u.blocks,
            bytes: u.bytes,
            max_bytes: u.max_bytes,
            evictions: u.evictions,
            hits: self.counters.hits.load(Ordering::Relaxed),
            misses: self.counters.misses.load(Ordering::Relaxed),
            corrupt: self.counters.corrupt.load(Ordering::Relaxed),
            rejected: self.counters.rejected.load(Ordering::Relaxed),
            tiers: self.backend.health(),
        })
    }
}

/// What a block writer thread hands back: whether each entry was stored, the batch (its
/// buffers are reused), and the blocks of the put written with it.
type Written = (StoreResult<Vec<bool>>, Vec<(Key, Vec<u8>)>, usize);

/// Runs `read` of a restore point of `len` tokens that loads whole, with progress in tokens
/// as a block-by-block load reports it: it may stop before the read, which it then rolls back
/// itself, and only hears of the end after it.
fn read_whole(
    mut progress: Option<Progress<'_>>,
    len: usize,
    read: impl FnOnce() -> StoreResult<ReadSummary>,
) -> StoreResult<u64> {
    tick(&mut progress, 0, len as u64)?;
    read()?;
    if let Some(p) = progress.as_mut() {
        // loaded: too late to stop, only reported
        p(len as u64, len as u64);
    }
    Ok(len as u64)
}

/// Counts a written batch into `report`.
fn count_written(batch: &[(Key, Vec<u8>)], stored: &[bool], report: &mut PutReport) {
    for ((_, v), &s) in batch.iter().zip(stored) {
        if s {
            report.blocks_written += 1;
            report.bytes_written += v.len() as u64;
        } else {
            report.blocks_skipped += 1;
            report.bytes_skipped += v.len() as u64;
        }
    }
}

/// Writes the rows of a block (or a checkpoint's tail) into tokens `first..` of a load.
fn put_rows(
    load: &mut SequenceLoad<'_>,
    geometry: &Geometry,
    first: usize,
    rows: &BlockRows<'_>,
) -> StoreResult<()> {
    for il in 0..geometry.layers.len() {
        load.write(il as u32, Tensor::K, first, rows.k(il))?;
        load.write(il as u32, Tensor::V, first, rows.v(il))?;
    }
    if !geometry.ext.is_none() {
        let exts: Vec<CellExtValue> = (0..rows.n_tokens()).map(|k| rows.ext(k)).collect();
        load.set_exts(first, &exts)?;
    }
    Ok(())
}

/// Writes the rows of positions `first..` that fall in a window starting at position `from`.
fn put_window(
    w: &KvPartWriter<'_>,
    out: &mut dyn PayloadSink,
    first: usize,
    from: usize,
    rows: &BlockRows<'_>,
) -> StoreResult<()> {
    let n = rows.n_tokens();
    if first + n <= from {
        return Ok(());
    }
    let skip = from.saturating_sub(first);
    w.put_from(out, first + skip - from, rows, skip)
}
