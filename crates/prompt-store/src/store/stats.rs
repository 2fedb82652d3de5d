//! What a store counts: hits, misses, corrupt and rejected values, and the backend's usage,
//! as [`StoreStats`] and as Prometheus text.

use std::sync::atomic::{AtomicU64, Ordering};

use super::PromptStore;
use crate::backend::TierHealth;
use crate::error::StoreResult;
use crate::metrics::{render, Snapshot};
use crate::seal::Broken;

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

#[derive(Default)]
pub(super) struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    corrupt: AtomicU64,
    rejected: AtomicU64,
}

impl PromptStore {
    pub(super) fn count(&self, found: usize, wanted: usize) {
        let bt = self.block_tokens;
        self.counters
            .hits
            .fetch_add(found.div_ceil(bt) as u64, Ordering::Relaxed);
        if found < wanted - wanted % bt {
            self.counters.misses.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub(super) fn count_broken(&self, broken: Broken) {
        let counter = match broken {
            Broken::Corrupt => &self.counters.corrupt,
            Broken::Rejected => &self.counters.rejected,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// This store object's figures in the Prometheus text exposition format: per tier the
    /// values found and missed, bytes read and written and evictions; corrupt and rejected
    /// blocks; latency histograms of lookup, put and restore. Every series is labelled with
    /// the store's `namespace` (`""` when none), the per-tier ones with `tier` too. Serve it
    /// from an HTTP handler.
    pub fn metrics(&self) -> StoreResult<String> {
        let mut tiers = self.backend.tier_metrics();
        if let (true, [only]) = (self.single_backend, tiers.as_mut_slice()) {
            // a tiered backend asks its tiers itself, minding their backoff
            only.evictions = self.backend.usage().ok().map(|u| u.evictions);
        }
        let l = &self.latency;
        Ok(render(&Snapshot {
            namespace: &self.namespace,
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
