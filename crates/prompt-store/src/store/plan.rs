//! Planning a restore: the restore points of a prompt (full blocks, and the checkpoints its
//! chain positions' indexes list), the longest one for `lookup`, and the re-planning of a
//! restore that meets a corrupt value.

use super::presence::Presence;
use super::record::Bound;
use super::{PromptStore, NEEDS_SWA_BLOCKS};
use crate::checkpoint;
use crate::error::StoreResult;
use crate::geometry::{chain_at, chain_keys, checkpoint_key, index_key, swa_key};
use crate::key::Key;

/// Restores that meet corrupt values re-plan at most this often before giving up on the
/// prompt (each round removes what it found corrupt).
const MAX_REPLANS: usize = 4;

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

/// A restore point and what serves it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Plan {
    /// Tokens restored.
    pub(super) len: usize,
    /// Full blocks of the main part (and of the SWA part when `swa_blocks`).
    pub(super) blocks: usize,
    /// Whether the SWA rows come from SWA blocks.
    pub(super) swa_blocks: bool,
    /// The checkpoint's key, when one is needed.
    pub(super) checkpoint: Option<Key>,
}

impl PromptStore {
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

    /// Plans `tokens` and tries the longest restore point with `attempt(keys, plan)`, planning
    /// again when it found a value absent or corrupt (counted and removed: the next plan is
    /// shorter); counts the hit or the miss. Returns the length of the point that loaded.
    pub(super) fn with_best_plan(
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
}
