//! The prompt store: `put`, `lookup`, `restore`, `put_file`, `write_file`, `stats` over any
//! [`Backend`].

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use llama_kv_cache::cache::io::Progress;
use llama_kv_cache::state::files::{inspect_bytes, params_for, write_atomic, FileKind};
use llama_kv_cache::{KvCache, KvError, Layout, ReadOptions, Tensor, WriteOptions};

use sha2::{Digest, Sha256};

use crate::backend::{Backend, Key};
use crate::block::{self, BlockId};
use crate::error::{StoreError, StoreResult};
use crate::geometry::{chain_keys, Geometry, FORMAT_VERSION};
use crate::payload::PayloadBuilder;

/// Tokens per block unless configured (LMCache's chunk size).
pub const DEFAULT_BLOCK_TOKENS: u32 = 256;
/// Smallest block size.
pub const MIN_BLOCK_TOKENS: u32 = 16;
/// Largest block size.
pub const MAX_BLOCK_TOKENS: u32 = 4096;

/// Blocks encoded and sent to the backend per batch: bounds memory on long prompts.
const PUT_BATCH: usize = 8;

/// What `put` did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PutReport {
    /// Tokens covered by full blocks (the prefix the store now holds for this prompt).
    pub tokens: u64,
    /// Blocks this call stored.
    pub blocks_written: u64,
    /// Bytes this call stored.
    pub bytes_written: u64,
    /// Blocks that were already stored (by anyone).
    pub blocks_skipped: u64,
    /// Bytes of the blocks already stored.
    pub bytes_skipped: u64,
}

/// Counts of a store: what the backend holds and what this `PromptStore` saw.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreStats {
    /// Backend name.
    pub backend: &'static str,
    /// Tokens per block.
    pub block_tokens: u32,
    /// Values stored (blocks, plus one small model record per model).
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
    /// block (each counts once, at the block where it stopped).
    pub misses: u64,
    /// Blocks read that failed verification (checksum, fingerprint, key, index, tokens,
    /// geometry): counted as misses, never loaded, and removed from the backend.
    pub corrupt: u64,
}

/// How `write_file` writes a llama.cpp file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WriteFileOptions {
    /// Session (`ggsn`) or sequence (`ggsq`) file.
    pub kind: FileKind,
    /// File version; default: what today's llama.node reads (ggsn 9, ggsq 2).
    pub version: Option<u32>,
    /// Payload layout; default: today's (`streams`).
    pub layout: Layout,
    /// Whether the reader runs with flash attention (V untransposed). Default false, as in
    /// llama.node and node-llama-cpp.
    pub flash_attn: bool,
    /// Session files: the architecture name (default "llama").
    pub arch: String,
}

impl Default for WriteFileOptions {
    fn default() -> Self {
        WriteFileOptions {
            kind: FileKind::Sequence,
            version: None,
            layout: Layout::Streams,
            flash_attn: false,
            arch: "llama".into(),
        }
    }
}

/// The geometry the store's model is bound to, and the fingerprint made of it.
#[derive(Clone)]
struct Bound {
    geometry: Geometry,
    fingerprint: Key,
}

#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    corrupt: AtomicU64,
}

/// A prompt store for one model. The model's geometry is fixed by the first cache or file it
/// sees and recorded in the backend (a small model record beside the blocks), so a later
/// process can `lookup` and `write_file` without a cache; a cache of another geometry is
/// refused with [`StoreError::Geometry`] (use another `model` string for it).
pub struct PromptStore {
    backend: Arc<dyn Backend>,
    model: String,
    block_tokens: usize,
    bound: Mutex<Option<Bound>>,
    counters: Counters,
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
        Ok(PromptStore {
            backend,
            model: model.into(),
            block_tokens: block_tokens as usize,
            bound: Mutex::new(None),
            counters: Counters::default(),
        })
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
    /// model's geometry is known.
    pub fn keys(&self, tokens: &[i32]) -> StoreResult<Option<Vec<Key>>> {
        Ok(self
            .known()?
            .map(|b| chain_keys(&b.fingerprint, tokens, self.block_tokens)))
    }

    fn record_key(&self) -> Key {
        let mut h = Sha256::new();
        h.update(b"llama-kv-cache prompt-store model record\0");
        h.update(FORMAT_VERSION.to_le_bytes());
        h.update(self.model.as_bytes());
        Key(h.finalize().into())
    }

    fn encode_record(g: &Geometry) -> Vec<u8> {
        let mut out = RECORD_MAGIC.to_vec();
        g.encode(&mut out);
        let sum = blake3::hash(&out);
        out.extend_from_slice(sum.as_bytes());
        out
    }

    fn decode_record(v: &[u8]) -> Option<Geometry> {
        let body = v.get(..v.len().checked_sub(32)?)?;
        if blake3::hash(body).as_bytes() != &v[body.len()..] || body.get(..4)? != RECORD_MAGIC {
            return None;
        }
        match Geometry::decode(&body[4..]) {
            Some((g, used)) if used == body.len() - 4 => Some(g),
            _ => None,
        }
    }

    /// The recorded geometry; a corrupt record is removed and reads as absent.
    fn read_record(&self) -> StoreResult<Option<Geometry>> {
        let key = self.record_key();
        match self.backend.get_many(&[key])?.pop().flatten() {
            None => Ok(None),
            Some(v) => match Self::decode_record(&v) {
                Some(g) => Ok(Some(g)),
                None => {
                    self.counters.corrupt.fetch_add(1, Ordering::Relaxed);
                    self.backend.remove(&key)?;
                    Ok(None)
                }
            },
        }
    }

    fn bound_to(&self, g: Geometry) -> Bound {
        Bound {
            fingerprint: g.fingerprint(&self.model),
            geometry: g,
        }
    }

    /// The bound geometry, from memory or the model record.
    fn known(&self) -> StoreResult<Option<Bound>> {
        let mut bound = self.bound.lock().unwrap_or_else(|p| p.into_inner());
        if bound.is_none() {
            *bound = self.read_record()?.map(|g| self.bound_to(g));
        }
        Ok(bound.clone())
    }

    /// Binds the store to `g` (recording it when the model has no record yet) or refuses a
    /// geometry that differs from the bound one.
    fn bind(&self, g: &Geometry) -> StoreResult<Bound> {
        let mut bound = self.bound.lock().unwrap_or_else(|p| p.into_inner());
        let b = match bound.as_ref() {
            Some(b) => b.clone(),
            None => {
                let recorded = match self.read_record()? {
                    Some(r) => r,
                    None => {
                        self.backend
                            .put_if_absent(&self.record_key(), &Self::encode_record(g))?;
                        // another process may have recorded first; an instant eviction leaves ours
                        self.read_record()?.unwrap_or_else(|| g.clone())
                    }
                };
                bound.insert(self.bound_to(recorded)).clone()
            }
        };
        if &b.geometry != g {
            return Err(StoreError::Geometry(format!(
                "this store holds model {:?} as {}; the cache is {}",
                self.model,
                b.geometry.describe(),
                g.describe()
            )));
        }
        Ok(b)
    }

    /// Stores the full blocks of sequence `seq` of `cache` that the store lacks. The sequence's
    /// cells must hold positions `0..n` with no pending K-shift; `tokens` are the prompt's
    /// tokens (blocks cover `min(n, tokens.len())` tokens; a trailing partial block is not
    /// stored). `progress(done, total)` counts blocks and may abort between batches.
    pub fn put(
        &self,
        cache: &KvCache,
        seq: i32,
        tokens: &[i32],
        mut progress: Option<Progress<'_>>,
    ) -> StoreResult<PutReport> {
        let g = Geometry::of_cache(cache)?;
        if cache.has_shift() {
            return Err(StoreError::NotPrefix(
                "the cache has a pending K-shift (apply it with update() first): its K rows are not those of positions 0..n"
                    .into(),
            ));
        }
        let order = position_order(cache, seq)?;
        let bound = self.bind(&g)?;
        let usable = order.len().min(tokens.len());
        let tokens = &tokens[..usable - usable % self.block_tokens];
        let keys = chain_keys(&bound.fingerprint, tokens, self.block_tokens);
        let present = self.backend.contains_many(&keys)?;
        let mut report = PutReport {
            tokens: tokens.len() as u64,
            ..Default::default()
        };
        let total = keys.len() as u64;
        tick(&mut progress, 0, total)?;
        let bt = self.block_tokens;
        let mut pending: Vec<(Key, Vec<u8>)> = Vec::new();
        // encode buffers return here after each batch: one set of allocations per put
        let mut spare: Vec<Vec<u8>> = Vec::new();
        for (i, key) in keys.iter().enumerate() {
            let id = BlockId {
                fingerprint: &bound.fingerprint,
                key,
                index: i as u32,
                tokens: &tokens[i * bt..(i + 1) * bt],
                geometry: &g,
            };
            if present[i] {
                report.blocks_skipped += 1;
                report.bytes_skipped += block::encoded_len(&id) as u64;
            } else {
                let mut value = spare.pop().unwrap_or_default();
                let cells = &order[i * bt..(i + 1) * bt];
                block::encode_into(&id, &mut value, |out, il, is_v| {
                    append_rows(cache, cells, il, is_v, out)
                })?;
                pending.push((*key, value));
            }
            if pending.len() == PUT_BATCH || i + 1 == keys.len() {
                self.flush(&pending, &mut report)?;
                spare.extend(pending.drain(..).map(|(_, v)| v));
                tick(&mut progress, i as u64 + 1, total)?;
            }
        }
        Ok(report)
    }

    fn flush(&self, pending: &[(Key, Vec<u8>)], report: &mut PutReport) -> StoreResult<()> {
        if pending.is_empty() {
            return Ok(());
        }
        let entries: Vec<(Key, &[u8])> = pending.iter().map(|(k, v)| (*k, v.as_slice())).collect();
        let stored = self.backend.put_many(&entries)?;
        for ((_, v), s) in pending.iter().zip(stored) {
            if s {
                report.blocks_written += 1;
                report.bytes_written += v.len() as u64;
            } else {
                report.blocks_skipped += 1;
                report.bytes_skipped += v.len() as u64;
            }
        }
        Ok(())
    }

    /// The length in tokens of the longest prefix of `tokens` whose blocks are all stored:
    /// one pass over the chain (one round trip on a network backend), no values read.
    pub fn lookup(&self, tokens: &[i32]) -> StoreResult<u64> {
        let Some(bound) = self.known()? else {
            return Ok(0);
        };
        let keys = chain_keys(&bound.fingerprint, tokens, self.block_tokens);
        let n = self.backend.present_prefix(&keys)?;
        self.count(n, keys.len());
        Ok((n * self.block_tokens) as u64)
    }

    fn count(&self, found: usize, wanted: usize) {
        self.counters
            .hits
            .fetch_add(found as u64, Ordering::Relaxed);
        if found < wanted {
            self.counters.misses.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Reads and verifies the stored prefix of `tokens` block by block into a one-sequence
    /// payload for `seq`: the leading blocks that are present and pass verification. A corrupt
    /// or foreign value ends the prefix, is counted and removed. Returns the blocks loaded
    /// (0: no payload).
    fn load_prefix(
        &self,
        bound: &Bound,
        tokens: &[i32],
        seq: i32,
        v_trans: bool,
    ) -> StoreResult<(usize, Vec<u8>)> {
        let keys = chain_keys(&bound.fingerprint, tokens, self.block_tokens);
        let n = self.backend.present_prefix(&keys)?;
        if n == 0 {
            self.count(0, keys.len());
            return Ok((0, Vec::new()));
        }
        let bt = self.block_tokens;
        let mut payload = PayloadBuilder::new(&bound.geometry, bt, n, seq, v_trans)?;
        let mut corrupt = None;
        self.backend.visit_many(&keys[..n], &mut |i, value| {
            // absent: evicted between the two calls
            let Some(value) = value else { return false };
            let id = BlockId {
                fingerprint: &bound.fingerprint,
                key: &keys[i],
                index: i as u32,
                tokens: &tokens[i * bt..(i + 1) * bt],
                geometry: &bound.geometry,
            };
            match block::decode(value, &id) {
                Ok(rows) => {
                    payload.push(&rows);
                    true
                }
                Err(_) => {
                    corrupt = Some(keys[i]);
                    false
                }
            }
        })?;
        if let Some(key) = corrupt {
            self.counters.corrupt.fetch_add(1, Ordering::Relaxed);
            // best effort: a later put stores a good block under this key
            let _ = self.backend.remove(&key);
        }
        let good = payload.blocks();
        self.count(good, keys.len());
        if good == 0 {
            return Ok((0, Vec::new()));
        }
        Ok((good, payload.finish()?))
    }

    /// Loads the longest stored prefix of `tokens` into sequence `seq` of `cache`
    /// (transactionally: on any error the cache is unchanged) and returns its length in tokens.
    /// The sequence's previous cells are replaced. When nothing is stored, returns 0 and leaves
    /// the cache unchanged.
    pub fn restore(
        &self,
        cache: &mut KvCache,
        seq: i32,
        tokens: &[i32],
        progress: Option<Progress<'_>>,
    ) -> StoreResult<u64> {
        let g = Geometry::of_cache(cache)?;
        if seq < 0 || seq as u32 >= cache.params().n_seq_max {
            return Err(StoreError::Cache(KvError::OutOfRange(format!(
                "seq id {seq} is outside [0, {})",
                cache.params().n_seq_max
            ))));
        }
        // without a model record (evicted from a shared store, or never written there), the
        // cache's own geometry gives the same fingerprint a put of this model used
        let bound = match self.known()? {
            Some(bound) => bound,
            None => self.bound_to(g.clone()),
        };
        if bound.geometry != g {
            return Err(StoreError::Geometry(format!(
                "this store holds model {:?} as {}; the cache is {}",
                self.model,
                bound.geometry.describe(),
                g.describe()
            )));
        }
        let (blocks, payload) = self.load_prefix(&bound, tokens, seq, cache.v_trans())?;
        if blocks == 0 {
            return Ok(0);
        }
        let opts = ReadOptions {
            layout: Some(Layout::Streams),
            allow_scattered: true,
            ..ReadOptions::default()
        };
        cache.state_read(&payload, seq, opts, progress)?;
        Ok((blocks * self.block_tokens) as u64)
    }

    /// Ingests a llama.cpp session or sequence file's bytes: its one sequence's full blocks,
    /// with the file's tokens.
    pub fn put_bytes(
        &self,
        bytes: &[u8],
        progress: Option<Progress<'_>>,
    ) -> StoreResult<PutReport> {
        let ins = inspect_bytes(bytes)?;
        let recurrent = ins
            .arch
            .as_deref()
            .is_some_and(llama_kv_cache::model::arch::is_recurrent);
        let mut params = params_for(&ins, recurrent)?;
        let tokens = ins.header.tokens.clone();
        let read = ReadOptions {
            layout: Some(ins.payload.layout),
            allow_scattered: true,
            ..ReadOptions::default()
        };
        let seq = match ins.header.kind {
            FileKind::Sequence => {
                params.n_seq_max = params.n_seq_max.max(1);
                let mut cache = KvCache::new(params)?;
                cache.load_sequence_bytes(bytes, 0, read, None)?;
                return self.put(&cache, 0, &tokens, progress);
            }
            FileKind::Session => {
                let mut cache = KvCache::new(params)?;
                cache.load_session_bytes(bytes, read, None)?;
                let with_cells: Vec<i32> = (0..cache.params().n_seq_max as i32)
                    .filter(|&s| cache.seq_cell_count(s).unwrap_or(0) > 0)
                    .collect();
                match with_cells.as_slice() {
                    [s] => (*s, cache),
                    _ => {
                        return Err(StoreError::NotPrefix(format!(
                            "the session holds sequences {with_cells:?}; the store ingests sessions of exactly one sequence"
                        )))
                    }
                }
            }
        };
        self.put(&seq.1, seq.0, &tokens, progress)
    }

    /// [`PromptStore::put_bytes`] of a file.
    pub fn put_file(&self, path: &Path, progress: Option<Progress<'_>>) -> StoreResult<PutReport> {
        let bytes = llama_kv_cache::state::files::read_file(path)?;
        self.put_bytes(&bytes, progress)
    }

    /// The longest stored prefix of `tokens` as a llama.cpp file's bytes, with that prefix as
    /// the file's tokens, or `None` when nothing is stored.
    pub fn file_bytes(
        &self,
        tokens: &[i32],
        opts: &WriteFileOptions,
        progress: Option<Progress<'_>>,
    ) -> StoreResult<Option<(u64, Vec<u8>)>> {
        let Some(bound) = self.known()? else {
            return Ok(None);
        };
        let (blocks, payload) = self.load_prefix(&bound, tokens, 0, !opts.flash_attn)?;
        if blocks == 0 {
            return Ok(None);
        }
        let n = blocks * self.block_tokens;
        let params = bound.geometry.cache_params(n as u32, !opts.flash_attn)?;
        let mut cache = KvCache::new(params)?;
        let read = ReadOptions {
            layout: Some(Layout::Streams),
            allow_scattered: false,
            ..ReadOptions::default()
        };
        cache.state_read(&payload, 0, read, None)?;
        let write = WriteOptions {
            version: opts.version,
            layout: opts.layout,
            n_stream: 1,
        };
        let bytes = match opts.kind {
            FileKind::Sequence => cache.sequence_file_bytes(0, &tokens[..n], write, progress)?,
            FileKind::Session => {
                cache.session_file_bytes(&tokens[..n], &opts.arch, None, write, progress)?
            }
        };
        Ok(Some((n as u64, bytes)))
    }

    /// Writes the longest stored prefix of `tokens` to `path` as a llama.cpp file (atomically)
    /// and returns its length in tokens. When nothing is stored, writes nothing and returns 0.
    pub fn write_file(
        &self,
        tokens: &[i32],
        path: &Path,
        opts: &WriteFileOptions,
        progress: Option<Progress<'_>>,
    ) -> StoreResult<u64> {
        match self.file_bytes(tokens, opts, progress)? {
            Some((n, bytes)) => {
                write_atomic(path, &bytes)?;
                Ok(n)
            }
            None => Ok(0),
        }
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
        })
    }
}

/// `order[p]` = the cell holding position `p` of sequence `seq`; refuses a sequence whose
/// cells are not exactly positions `0..n`.
fn position_order(cache: &KvCache, seq: i32) -> StoreResult<Vec<u32>> {
    let n = cache.seq_cell_count(seq)? as usize;
    let mut order = vec![u32::MAX; n];
    let cells = cache.cells();
    for i in 0..cells.len() {
        let c = cells.get(i);
        if !c.seqs.contains(seq as usize) {
            continue;
        }
        let p = c.pos;
        if p < 0 || p as usize >= n || order[p as usize] != u32::MAX {
            return Err(StoreError::NotPrefix(format!(
                "sequence {seq}: its {n} cells must hold positions 0..{n} once each, found position {p}{}",
                if p >= 0 && (p as usize) < n { " twice" } else { "" }
            )));
        }
        order[p as usize] = i as u32;
    }
    Ok(order)
}

/// Appends the K (or V, as rows) of layer `il` for `cells`, in order: one read for a run of
/// consecutive cells (the usual case), else one per cell.
fn append_rows(
    cache: &KvCache,
    cells: &[u32],
    il: usize,
    is_v: bool,
    out: &mut Vec<u8>,
) -> StoreResult<()> {
    let which = if is_v { Tensor::V } else { Tensor::K };
    let il = il as u32;
    let contiguous = cells.windows(2).all(|w| w[1] == w[0] + 1);
    if contiguous {
        out.extend_from_slice(&cache.read_rows(il, which, cells[0], cells.len() as u32)?);
    } else {
        out.extend_from_slice(&cache.rows_of_cells(il, which, cells)?);
    }
    Ok(())
}
