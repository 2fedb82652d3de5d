//! `restore` into a seed cache: a transformer cache loads the rows block by block as each is
//! read and verified; a recurrent cache reads an assembled payload whole. (Live memories of
//! today's kinds are restored by `restore_memory`, in `live`.)

use llama_kv_cache::cache::io::Progress;
use llama_kv_cache::{
    CellExtValue, KvError, Layout, MemoryKind, ReadOptions, ReadSummary, SeedCache, SequenceLoad,
    Tensor,
};

use super::assemble::Target;
use super::record::{live_format, Bound};
use super::{tick, PromptStore};
use crate::block::BlockRows;
use crate::capture::unified_shape;
use crate::error::{StoreError, StoreResult};
use crate::geometry::Geometry;

impl PromptStore {
    /// Loads the longest stored prefix of `tokens` into sequence `seq` of `cache`
    /// (transactionally: on any error the cache is unchanged) and returns its length in tokens.
    /// `progress` gets `(tokens loaded, tokens of the restore point)` before each block and at
    /// the end; stopping it rolls the load back.
    /// The sequence's previous cells are replaced. When nothing is stored, returns 0 and leaves
    /// the cache unchanged. The cache must be of the store's shape: a unified or recurrent
    /// cache (iSWA and hybrid states are restored through `write_file`).
    /// To load at most N tokens, restore `&tokens[..N]`: blocks and checkpoints are keyed by
    /// the tokens before them only, so its restore points are the prompt's up to N, and the
    /// longest of them loads (a block boundary, or a checkpoint where the memory needs one).
    pub fn restore(
        &self,
        cache: &mut SeedCache,
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
        cache: &mut SeedCache,
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
}

/// Runs `read` of a restore point of `len` tokens that loads whole, with progress in tokens
/// as a block-by-block load reports it: it may stop before the read, which it then rolls back
/// itself, and only hears of the end after it.
pub(super) fn read_whole(
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
