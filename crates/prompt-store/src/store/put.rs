//! `put`: a state's full blocks the store lacks and, where the blocks alone do not restore
//! it, a checkpoint at its end listed in its chain position's index; from a live cache or a
//! llama.cpp file.

use std::path::Path;
use std::thread::ScopedJoinHandle;

use llama_kv_cache::cache::io::Progress;
use llama_kv_cache::state::files::inspect_bytes;
use llama_kv_cache::{check_memory, check_state, Fit, MemoryKind, ModelInfo, SeedCache};

use super::presence::Presence;
use super::record::{live_format, Bound};
use super::{tick, PromptStore, NEEDS_SWA_BLOCKS};
use crate::block::{self, BlockId};
use crate::capture::{Capture, KvRows};
use crate::checkpoint::{self, CheckpointId, Slot, SwaRows};
use crate::error::{StoreError, StoreResult};
use crate::geometry::{chain_at, chain_keys, checkpoint_key, index_key, swa_key};
use crate::key::Key;
use crate::shape::FileFormat;

/// Blocks encoded and sent to the backend per batch: bounds memory on long prompts.
const PUT_BATCH: usize = 8;

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

impl PromptStore {
    /// Stores what sequence `seq` of `cache` needs to be restored: the full blocks of its rows
    /// that the store lacks and, when the prompt ends inside a block (or the cache is
    /// recurrent), a checkpoint at its end. The sequence's cells must hold positions `0..n`
    /// with no pending K-shift; `tokens` are the prompt's tokens. `progress(done, total)`
    /// counts blocks and may abort between batches.
    pub fn put(
        &self,
        cache: &SeedCache,
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
    pub(super) fn put_live_capture(
        &self,
        c: &Capture<'_>,
        tokens: &[i32],
        format: FileFormat,
        progress: Option<Progress<'_>>,
    ) -> StoreResult<PutReport> {
        self.check_fit(|m| check_memory(c.shape.memory, &c.shape.part_widths(), m))?;
        self.put_capture(c, tokens, format, progress)
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
        self.note_chain(keys);
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
}

/// What a block writer thread hands back: whether each entry was stored, the batch (its
/// buffers are reused), and the blocks of the put written with it.
type Written = (StoreResult<Vec<bool>>, Vec<(Key, Vec<u8>)>, usize);

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
