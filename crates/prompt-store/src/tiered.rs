//! `tiers`: several backends in front of each other, nearest first (`memory`, `dir`, `redis`).
//! Reads ask the nearest tier first and only ask the next one for what is still missing; a hit
//! in a far tier is promoted into every nearer one. Writes go through to every tier.

use std::sync::Arc;

use crate::backend::{Backend, Key, Usage};
use crate::error::{StoreError, StoreResult};

/// Backends composed nearest first. Itself a [`Backend`], so the store does not know whether it
/// has one tier or several.
pub struct TieredBackend {
    tiers: Vec<Arc<dyn Backend>>,
}

impl TieredBackend {
    /// Tiers nearest first; at least one.
    pub fn new(tiers: Vec<Arc<dyn Backend>>) -> StoreResult<TieredBackend> {
        if tiers.is_empty() {
            return Err(StoreError::InvalidArg(
                "tiers: at least one backend is needed".into(),
            ));
        }
        Ok(TieredBackend { tiers })
    }

    /// The tiers, nearest first (for per-tier statistics).
    pub fn tiers(&self) -> &[Arc<dyn Backend>] {
        &self.tiers
    }
}

impl Backend for TieredBackend {
    fn name(&self) -> &'static str {
        "tiered"
    }

    /// Each tier is asked only for the keys no nearer tier had. Hits are promoted into the
    /// nearer tiers; a promotion that fails (a full disk) is skipped: it only costs a later
    /// read from the far tier again.
    fn get_many(&self, keys: &[Key]) -> StoreResult<Vec<Option<Vec<u8>>>> {
        let mut values: Vec<Option<Vec<u8>>> = vec![None; keys.len()];
        let mut missing: Vec<usize> = (0..keys.len()).collect();
        for (depth, tier) in self.tiers.iter().enumerate() {
            if missing.is_empty() {
                break;
            }
            let asked: Vec<Key> = missing.iter().map(|&i| keys[i]).collect();
            let found = tier.get_many(&asked)?;
            let mut still_missing = Vec::new();
            let mut hits = Vec::new();
            for (&i, value) in missing.iter().zip(found) {
                match value {
                    Some(value) => {
                        hits.push(i);
                        values[i] = Some(value);
                    }
                    None => still_missing.push(i),
                }
            }
            if depth > 0 && !hits.is_empty() {
                let promoted: Vec<(Key, &[u8])> = hits
                    .iter()
                    .filter_map(|&i| Some((keys[i], values[i].as_deref()?)))
                    .collect();
                for nearer in &self.tiers[..depth] {
                    let _ = nearer.put_many(&promoted);
                }
            }
            missing = still_missing;
        }
        Ok(values)
    }

    fn contains_many(&self, keys: &[Key]) -> StoreResult<Vec<bool>> {
        let mut present = vec![false; keys.len()];
        let mut missing: Vec<usize> = (0..keys.len()).collect();
        for tier in &self.tiers {
            if missing.is_empty() {
                break;
            }
            let asked: Vec<Key> = missing.iter().map(|&i| keys[i]).collect();
            let found = tier.contains_many(&asked)?;
            missing = missing
                .into_iter()
                .zip(found)
                .filter_map(|(i, hit)| {
                    present[i] |= hit;
                    (!hit).then_some(i)
                })
                .collect();
        }
        Ok(present)
    }

    fn put_if_absent(&self, key: &Key, value: &[u8]) -> StoreResult<bool> {
        Ok(self.put_many(&[(*key, value)])?[0])
    }

    /// Writes through to every tier, farthest (shared) first; an entry counts as stored when
    /// any tier stored it.
    fn put_many(&self, entries: &[(Key, &[u8])]) -> StoreResult<Vec<bool>> {
        let mut stored = vec![false; entries.len()];
        for tier in self.tiers.iter().rev() {
            for (flag, written) in stored.iter_mut().zip(tier.put_many(entries)?) {
                *flag |= written;
            }
        }
        Ok(stored)
    }

    fn remove(&self, key: &Key) -> StoreResult<()> {
        for tier in &self.tiers {
            tier.remove(key)?;
        }
        Ok(())
    }

    /// Blocks, bytes and budget of the farthest tier (it holds everything the nearer ones
    /// hold, as far as eviction lets it); evictions of all tiers together.
    fn usage(&self) -> StoreResult<Usage> {
        let mut evictions = 0;
        let mut last = Usage::default();
        for tier in &self.tiers {
            last = tier.usage()?;
            evictions += last.evictions;
        }
        Ok(Usage { evictions, ..last })
    }

    fn gc(&self) -> StoreResult<Usage> {
        for tier in &self.tiers {
            tier.gc()?;
        }
        self.usage()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryBackend;

    fn two_tiers() -> (Arc<MemoryBackend>, Arc<MemoryBackend>, TieredBackend) {
        let near = Arc::new(MemoryBackend::new(None));
        let far = Arc::new(MemoryBackend::new(None));
        let tiered = TieredBackend::new(vec![near.clone(), far.clone()]).unwrap();
        (near, far, tiered)
    }

    #[test]
    fn puts_write_through_to_every_tier() {
        let (near, far, tiered) = two_tiers();
        let key = Key([1; 32]);
        assert!(tiered.put_if_absent(&key, b"v").unwrap());
        assert_eq!(near.get_many(&[key]).unwrap(), [Some(b"v".to_vec())]);
        assert_eq!(far.get_many(&[key]).unwrap(), [Some(b"v".to_vec())]);
        assert!(!tiered.put_if_absent(&key, b"v").unwrap());
    }

    #[test]
    fn a_hit_in_a_far_tier_is_promoted_and_the_near_tier_answers_first() {
        let (near, far, tiered) = two_tiers();
        let (a, b, c) = (Key([1; 32]), Key([2; 32]), Key([3; 32]));
        far.put_if_absent(&a, b"far-a").unwrap();
        far.put_if_absent(&b, b"far-b").unwrap();
        near.put_if_absent(&b, b"near-b").unwrap();
        let got = tiered.get_many(&[a, b, c]).unwrap();
        assert_eq!(
            got,
            [Some(b"far-a".to_vec()), Some(b"near-b".to_vec()), None]
        );
        assert_eq!(near.get_many(&[a]).unwrap(), [Some(b"far-a".to_vec())]);
        assert_eq!(
            tiered.contains_many(&[c, a, b]).unwrap(),
            [false, true, true]
        );
        assert_eq!(tiered.present_prefix(&[a, b, c]).unwrap(), 2);
    }

    #[test]
    fn remove_clears_every_tier_and_no_tiers_is_refused() {
        let (near, far, tiered) = two_tiers();
        let key = Key([7; 32]);
        tiered.put_if_absent(&key, b"v").unwrap();
        tiered.remove(&key).unwrap();
        assert_eq!(near.contains_many(&[key]).unwrap(), [false]);
        assert_eq!(far.contains_many(&[key]).unwrap(), [false]);
        assert!(matches!(
            TieredBackend::new(Vec::new()),
            Err(StoreError::InvalidArg(_))
        ));
    }
}
