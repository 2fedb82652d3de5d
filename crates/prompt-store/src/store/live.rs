//! `put` and `restore` of today's live memories (iSWA, hybrid, a unified model's cache of a
//! stream per sequence). A put captures the sequence's
//! rows from each attention part and a hybrid's recurrent state as llama.cpp 0.1.161 writes
//! it, the parts a peer's file of the same state holds, so a live memory and a peer's file of
//! one conversation make the same blocks and checkpoints. A restore assembles the payload
//! 0.1.161 would read for the sequence and reads it into the memory in one transaction. (The
//! seed's unified and recurrent caches take the row path of `put` / `restore`.)

use llama_kv_cache::cache::io::Progress;
use llama_kv_cache::state::files::FileKind;
use llama_kv_cache::{KvError, Layout, Memory, MemoryKind, PartRole, ReadOptions, SeedCache};

use super::{read_whole, Bound, PromptStore, PutReport, Target};
use crate::capture::Capture;
use crate::error::{StoreError, StoreResult};
use crate::geometry::Geometry;
use crate::shape::{FileFormat, KvShape};

/// The format `write_file` defaults to for a store filled by `put` of a live memory of
/// today's kinds: the sequence file of llama.cpp 0.1.161, whose era these memories are.
fn parts_format(memory: &dyn Memory) -> FileFormat {
    let kind = FileKind::Sequence;
    FileFormat {
        kind,
        version: kind.rotation_version(),
        layout: Layout::StreamsRot,
        flash_attn: !first_stream(memory).is_some_and(SeedCache::v_trans),
        arch: None,
    }
}

/// The first attention part's cache (today's memories always have one).
fn first_stream(memory: &dyn Memory) -> Option<&SeedCache> {
    memory
        .attention_streams(0)
        .ok()
        .and_then(|parts| parts.first().map(|&(_, _, c)| c))
}

impl PromptStore {
    /// [`PromptStore::put`] of sequence `seq` of a live memory of any kind.
    pub fn put_memory(
        &self,
        memory: &dyn Memory,
        seq: i32,
        tokens: &[i32],
        progress: Option<Progress<'_>>,
    ) -> StoreResult<PutReport> {
        if let Some(c) = memory.seed() {
            return self.put(c, seq, tokens, progress);
        }
        let _timer = self.latency.put.start();
        let capture = match memory.state_kind() {
            // a unified model's cache of a stream per sequence: the stream holding `seq` is a
            // cache of that model, whose blocks a one-stream cache's put makes too
            MemoryKind::Unified => {
                let (_, _, stream) = memory.attention_streams(seq)?[0];
                Capture::of_cache(stream, seq, tokens.len())?
            }
            _ => Capture::of_memory(memory, seq, tokens.len())?,
        };
        let format = parts_format(memory);
        self.put_live_capture(&capture, tokens, format, progress)
    }

    /// [`PromptStore::restore`] into sequence `seq` of a live memory of any kind
    /// (transactionally). A memory of today's kinds is restored from the store's model record:
    /// without one (never written, or evicted from a shared store) nothing is restored.
    pub fn restore_memory(
        &self,
        memory: &mut dyn Memory,
        seq: i32,
        tokens: &[i32],
        progress: Option<Progress<'_>>,
    ) -> StoreResult<u64> {
        if let Some(c) = memory.seed_mut() {
            return self.restore(c, seq, tokens, progress);
        }
        let _timer = self.latency.restore.start();
        let n_seq_max = memory.n_seq_max();
        if seq < 0 || seq as u32 >= n_seq_max {
            return Err(StoreError::Cache(KvError::OutOfRange(format!(
                "seq id {seq} is outside [0, {n_seq_max})"
            ))));
        }
        let Some(bound) = self.known()? else {
            return Ok(0);
        };
        let target = self.live_target(&bound, memory, seq)?;
        let mut payload = Vec::new();
        let Some(len) = self.load(&bound, tokens, target, &|_| Vec::new(), &mut payload)? else {
            return Ok(0);
        };
        let opts = ReadOptions {
            layout: Some(Layout::StreamsRot),
            ..ReadOptions::default()
        };
        // the parts are read whole
        read_whole(progress, len, || {
            Ok(memory.state_read(&payload, seq, opts, None)?)
        })
    }

    /// Checks that `memory` is of the bound shape (its kind and the rows of its attention
    /// parts; a recurrent part's size is checked by the read) and returns how its payload
    /// is written: V transposed as the memory keeps it, a window cache given only the window
    /// when it is smaller than the base cache.
    fn live_target(&self, bound: &Bound, memory: &dyn Memory, seq: i32) -> StoreResult<Target> {
        let parts = memory.attention_streams(seq)?;
        let shape_of = |roles: &[PartRole]| -> StoreResult<Option<KvShape>> {
            parts
                .iter()
                .find(|(r, _, _)| roles.contains(r))
                .map(|&(_, _, cache)| {
                    let p = cache.params();
                    Ok(KvShape {
                        layers: Geometry::of_cache(cache)?,
                        rot: (p.n_rot_k, p.n_rot_v),
                    })
                })
                .transpose()
        };
        let mut live = bound.shape.clone();
        live.memory = memory.state_kind();
        live.main = shape_of(&[PartRole::Base, PartRole::Attention, PartRole::Whole])?;
        live.swa = shape_of(&[PartRole::Swa])?;
        if live != bound.shape {
            return Err(self.refuse(&bound.shape, &live));
        }
        let size = |role| {
            parts
                .iter()
                .find(|(r, _, _)| *r == role)
                .map(|(_, w, c)| (c.params().size, *w))
        };
        let swa_window = match (size(PartRole::Base), size(PartRole::Swa)) {
            (Some((base, _)), Some((swa, window))) if swa < base => Some(window.n_swa),
            _ => None,
        };
        let (_, _, first) = parts[0];
        Ok(Target {
            seq,
            // every attention part of a memory has as many streams
            n_stream: memory.parts()[0].n_stream,
            v_trans: first.v_trans(),
            swa_window,
            ext: first.params().cell_ext,
            rot_recorded: true,
        })
    }
}
