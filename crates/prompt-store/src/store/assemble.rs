//! Reading and verifying the values of a restore point, and assembling them into the payload
//! llama.cpp reads: its parts in llama.cpp's order, for the reader a [`Target`] describes.

use llama_kv_cache::state::dsv4;
use llama_kv_cache::{CellExt, MemoryKind};

use super::plan::Plan;
use super::record::Bound;
use super::PromptStore;
use crate::block::{self, BlockId, BlockRows};
use crate::checkpoint::{self, CheckpointId, CheckpointView, SwaRows};
use crate::error::StoreResult;
use crate::geometry::{chain_at, checkpoint_key, swa_key, Geometry};
use crate::key::Key;
use crate::payload::{KvPartWriter, PayloadSink, StreamAt};

/// Who a restored payload is for: the sequence its cells name, its V layout, and the SWA
/// window a reader keeps (`None`: every stored position).
#[derive(Clone, Copy)]
pub(super) struct Target {
    pub(super) seq: i32,
    /// Streams of the payload's KV parts: 1, or a live memory's stream per sequence (the
    /// sequence's stream holding its cells, the others empty); a dsv4 state's raw cache has
    /// its own.
    pub(super) n_stream: u32,
    pub(super) v_trans: bool,
    pub(super) swa_window: Option<u32>,
    /// The cell extension the payload's cells carry: the live cache's, or the canonical
    /// file's form (x, y, tok) for a store that keeps extensions.
    pub(super) ext: CellExt,
    /// Whether the KV parts record their rotation (today's layout, `streams-rot`) or not (the
    /// `streams` layout of the files llama.node and node-llama-cpp read).
    pub(super) rot_recorded: bool,
}

impl PromptStore {
    /// Reads and verifies the blocks `keys[..n]` of one part, calling `put(i, rows)` for each
    /// (whose first error ends the read and is returned). Returns false (after counting and
    /// removing it) when one is absent or corrupt.
    pub(super) fn read_blocks(
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
        // a far tier's hits are promoted into nearer ones: stored there as this chain's blocks
        self.note_chain(keys);
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
            if let Some(hub) = &self.events {
                hub.removed_everywhere(&key);
            }
        }
        Ok(ok == keys.len())
    }

    /// Reads and verifies the checkpoint of `plan` (if it has one) and calls `with` on it.
    /// `None` when the value turned out absent or corrupt (counted and removed: the caller
    /// plans again).
    pub(super) fn with_checkpoint<R>(
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

    /// Assembles the longest restore point that verifies into `out` (started again for each
    /// attempt), after `head(len)` (a file's header, or nothing). Returns its length in tokens.
    pub(super) fn load(
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
