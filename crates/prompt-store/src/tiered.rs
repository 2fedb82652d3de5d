//! `tiers`: several backends in front of each other, nearest first (`memory`, `dir`, `redis`).
//! Reads ask the nearest tier first and only ask the next one for what is still missing; a hit
//! in a far tier is promoted into every nearer one. Writes go through to every tier.
//!
//! A tier that fails (Redis down, a disk gone) does not fail the call while another tier
//! answers: reads serve what the working tiers hold, and writes land in every tier that works.
//! The failed tier is skipped until its backoff ends (0.5 s, doubling to 30 s), then tried
//! again by the next call, so one down tier costs each call nothing, and at most one timeout
//! per backoff period. A call fails only when no tier could serve it.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::backend::{Backend, TierHealth, TierMetrics, Usage};
use crate::error::{StoreError, StoreResult};
use crate::events::EventHub;
use crate::key::Key;
use crate::metrics::Metered;

/// First wait before a failed tier is tried again.
const FIRST_BACKOFF: Duration = Duration::from_millis(500);
/// Longest wait.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

#[derive(Default)]
struct TierState {
    last_error: Option<String>,
    /// Set while down: when to try again, and the backoff that led there.
    retry: Option<(Instant, Duration)>,
}

/// Backends composed nearest first. Itself a [`Backend`], so the store does not know whether it
/// has one tier or several.
pub struct TieredBackend {
    tiers: Vec<Arc<dyn Backend>>,
    states: Vec<Mutex<TierState>>,
    admit_on_reuse: bool,
}

impl TieredBackend {
    /// Tiers nearest first; at least one. Each is counted for the store's metrics.
    pub fn new(tiers: Vec<Arc<dyn Backend>>) -> StoreResult<TieredBackend> {
        if tiers.is_empty() {
            return Err(StoreError::InvalidArg(
                "tiers: at least one backend is needed".into(),
            ));
        }
        let tiers: Vec<Arc<dyn Backend>> = tiers
            .into_iter()
            .map(|t| Arc::new(Metered::new(t)) as Arc<dyn Backend>)
            .collect();
        let states = tiers.iter().map(|_| Mutex::default()).collect();
        Ok(TieredBackend {
            tiers,
            states,
            admit_on_reuse: false,
        })
    }

    /// Admission: puts skip the nearest tier, and a block enters it only when a read finds it
    /// in a farther one (its second use). A prompt used once then never takes the nearest
    /// tier's room from the blocks that are used again. A put that no farther tier takes (all
    /// down) still lands in the nearest one.
    pub fn admit_on_reuse(mut self) -> TieredBackend {
        self.admit_on_reuse = true;
        self
    }

    /// The tiers, nearest first (for per-tier statistics).
    pub fn tiers(&self) -> &[Arc<dyn Backend>] {
        &self.tiers
    }

    fn state(&self, i: usize) -> std::sync::MutexGuard<'_, TierState> {
        self.states[i].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether tier `i` may be asked now (up, or its backoff is over).
    fn ready(&self, i: usize) -> bool {
        self.state(i)
            .retry
            .is_none_or(|(at, _)| Instant::now() >= at)
    }

    /// Runs `op` on tier `i` and records how it went. `None`: the tier is backing off or
    /// failed (the error is kept for the caller in `failure`).
    fn try_tier<T>(
        &self,
        i: usize,
        failure: &mut Option<StoreError>,
        op: impl FnOnce(&dyn Backend) -> StoreResult<T>,
    ) -> Option<T> {
        if !self.ready(i) {
            return None;
        }
        match op(self.tiers[i].as_ref()) {
            Ok(v) => {
                self.state(i).retry = None;
                Some(v)
            }
            // a caller's mistake is not the tier's fault: it goes to the caller as it is
            Err(e @ StoreError::InvalidArg(_)) => {
                *failure = Some(e);
                None
            }
            Err(e) => {
                let mut st = self.state(i);
                let backoff = st
                    .retry
                    .map_or(FIRST_BACKOFF, |(_, b)| (b * 2).min(MAX_BACKOFF));
                st.retry = Some((Instant::now() + backoff, backoff));
                st.last_error = Some(e.to_string());
                *failure = Some(e);
                None
            }
        }
    }

    /// The error of a call that no tier could serve.
    fn none_served(&self, failure: Option<StoreError>) -> StoreError {
        failure.unwrap_or_else(|| {
            let why: Vec<String> = (0..self.tiers.len())
                .map(|i| {
                    let st = self.state(i);
                    format!(
                        "{}: {}",
                        self.tiers[i].name(),
                        st.last_error.as_deref().unwrap_or("backing off")
                    )
                })
                .collect();
            StoreError::Unavailable(format!(
                "no tier of the store can be reached ({})",
                why.join("; ")
            ))
        })
    }

    /// Asks each working tier, nearest first, for the positions of `keys` still `missing`
    /// after the nearer ones; `ask(tier, keys)` answers per key whether it found it (storing
    /// what it found). Fails only when no tier answered.
    fn per_tier(
        &self,
        n: usize,
        mut ask: impl FnMut(usize, &dyn Backend, &[usize]) -> StoreResult<Vec<usize>>,
    ) -> StoreResult<()> {
        let mut missing: Vec<usize> = (0..n).collect();
        let mut answered = false;
        let mut failure = None;
        for depth in 0..self.tiers.len() {
            if missing.is_empty() {
                break;
            }
            if let Some(still) = self.try_tier(depth, &mut failure, |t| ask(depth, t, &missing)) {
                missing = still;
                answered = true;
            }
        }
        if answered || n == 0 {
            Ok(())
        } else {
            Err(self.none_served(failure))
        }
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
        self.per_tier(keys.len(), |depth, tier, missing| {
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
            Ok(still_missing)
        })?;
        Ok(values)
    }

    fn get_tails(&self, keys: &[Key], n: usize) -> StoreResult<Vec<Option<Vec<u8>>>> {
        let mut tails: Vec<Option<Vec<u8>>> = vec![None; keys.len()];
        self.per_tier(keys.len(), |_, tier, missing| {
            let asked: Vec<Key> = missing.iter().map(|&i| keys[i]).collect();
            let found = tier.get_tails(&asked, n)?;
            Ok(missing
                .iter()
                .zip(found)
                .filter_map(|(&i, tail)| {
                    tails[i] = tail;
                    tails[i].is_none().then_some(i)
                })
                .collect())
        })?;
        Ok(tails)
    }

    fn contains_many(&self, keys: &[Key]) -> StoreResult<Vec<bool>> {
        let mut present = vec![false; keys.len()];
        self.per_tier(keys.len(), |_, tier, missing| {
            let asked: Vec<Key> = missing.iter().map(|&i| keys[i]).collect();
            let found = tier.contains_many(&asked)?;
            Ok(missing
                .iter()
                .zip(found)
                .filter_map(|(&i, hit)| {
                    present[i] |= hit;
                    (!hit).then_some(i)
                })
                .collect())
        })?;
        Ok(present)
    }

    fn put_if_absent(&self, key: &Key, value: &[u8]) -> StoreResult<bool> {
        Ok(self.put_many(&[(*key, value)])?[0])
    }

    /// Writes through to every working tier, farthest (shared) first (with
    /// [`TieredBackend::admit_on_reuse`], not the nearest one while a farther one took it); an
    /// entry counts as stored when any tier stored it.
    fn put_many(&self, entries: &[(Key, &[u8])]) -> StoreResult<Vec<bool>> {
        let mut stored = vec![false; entries.len()];
        let mut answered = false;
        let mut failure = None;
        for i in (0..self.tiers.len()).rev() {
            if i == 0 && self.admit_on_reuse && answered {
                break;
            }
            if let Some(written) = self.try_tier(i, &mut failure, |t| t.put_many(entries)) {
                answered = true;
                for (flag, w) in stored.iter_mut().zip(written) {
                    *flag |= w;
                }
            }
        }
        if answered || entries.is_empty() {
            Ok(stored)
        } else {
            Err(self.none_served(failure))
        }
    }

    fn remove(&self, key: &Key) -> StoreResult<()> {
        let mut failure = None;
        let mut answered = false;
        for i in 0..self.tiers.len() {
            answered |= self.try_tier(i, &mut failure, |t| t.remove(key)).is_some();
        }
        if answered {
            Ok(())
        } else {
            Err(self.none_served(failure))
        }
    }

    /// Blocks, bytes and budget of the farthest working tier (it holds everything the nearer
    /// ones hold, as far as eviction lets it); evictions of the working tiers together.
    fn usage(&self) -> StoreResult<Usage> {
        let mut evictions = 0;
        let mut last = None;
        let mut failure = None;
        for i in 0..self.tiers.len() {
            if let Some(u) = self.try_tier(i, &mut failure, |t| t.usage()) {
                evictions += u.evictions;
                last = Some(u);
            }
        }
        let last = last.ok_or_else(|| self.none_served(failure))?;
        Ok(Usage { evictions, ..last })
    }

    fn gc(&self) -> StoreResult<Usage> {
        let mut failure = None;
        for i in 0..self.tiers.len() {
            self.try_tier(i, &mut failure, |t| t.gc());
        }
        self.usage()
    }

    /// Each tier's counts, with its evictions where the tier is up (a tier backing off is not
    /// asked).
    fn observe(&self, hub: &Arc<EventHub>) {
        self.tiers.iter().for_each(|t| t.observe(hub));
    }

    fn tier_metrics(&self) -> Vec<TierMetrics> {
        let mut failure = None;
        (0..self.tiers.len())
            .flat_map(|i| {
                let evictions = self.try_tier(i, &mut failure, |t| t.usage());
                self.tiers[i].tier_metrics().into_iter().map(move |mut m| {
                    m.evictions = evictions.as_ref().map(|u| u.evictions);
                    m
                })
            })
            .collect()
    }

    fn health(&self) -> Vec<TierHealth> {
        (0..self.tiers.len())
            .map(|i| {
                let st = self.state(i);
                TierHealth {
                    name: self.tiers[i].name(),
                    up: st.retry.is_none(),
                    last_error: st.last_error.clone(),
                }
            })
            .collect()
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

    /// A backend that fails every call while `down` is set.
    struct Flaky {
        inner: MemoryBackend,
        down: std::sync::atomic::AtomicBool,
    }

    impl Flaky {
        fn check(&self) -> StoreResult<()> {
            if self.down.load(std::sync::atomic::Ordering::Relaxed) {
                return Err(StoreError::Unavailable("far tier is down".into()));
            }
            Ok(())
        }
    }

    impl Backend for Flaky {
        fn name(&self) -> &'static str {
            "flaky"
        }
        fn get_many(&self, keys: &[Key]) -> StoreResult<Vec<Option<Vec<u8>>>> {
            self.check()?;
            self.inner.get_many(keys)
        }
        fn contains_many(&self, keys: &[Key]) -> StoreResult<Vec<bool>> {
            self.check()?;
            self.inner.contains_many(keys)
        }
        fn put_if_absent(&self, key: &Key, value: &[u8]) -> StoreResult<bool> {
            self.check()?;
            self.inner.put_if_absent(key, value)
        }
        fn remove(&self, key: &Key) -> StoreResult<()> {
            self.check()?;
            self.inner.remove(key)
        }
        fn usage(&self) -> StoreResult<Usage> {
            self.check()?;
            self.inner.usage()
        }
    }

    #[test]
    fn a_down_tier_is_skipped_with_backoff_and_used_again_once_it_is_back() {
        let near = Arc::new(MemoryBackend::new(None));
        let far = Arc::new(Flaky {
            inner: MemoryBackend::new(None),
            down: Default::default(),
        });
        let tiered = TieredBackend::new(vec![near.clone(), far.clone()]).unwrap();
        let (a, b) = (Key([1; 32]), Key([2; 32]));
        tiered.put_if_absent(&a, b"a").unwrap();
        far.down.store(true, std::sync::atomic::Ordering::Relaxed);
        // reads serve the near tier; writes land there; the far tier is reported down
        assert_eq!(
            tiered.get_many(&[a, b]).unwrap(),
            [Some(b"a".to_vec()), None]
        );
        assert!(tiered.put_if_absent(&b, b"b").unwrap());
        assert_eq!(near.contains_many(&[b]).unwrap(), [true]);
        let health = tiered.health();
        assert!(health[0].up && !health[1].up);
        assert_eq!(health[1].last_error.as_deref(), Some("far tier is down"));
        // while it backs off it is not asked at all; once back and due, it is used again
        far.down.store(false, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(far.inner.contains_many(&[b]).unwrap(), [false]);
        std::thread::sleep(FIRST_BACKOFF + Duration::from_millis(50));
        let c = Key([3; 32]);
        assert!(tiered.put_if_absent(&c, b"c").unwrap());
        assert_eq!(far.inner.contains_many(&[c]).unwrap(), [true]);
        assert!(tiered.health()[1].up);
        // with every tier down, a call fails with the tiers' errors
        let only = TieredBackend::new(vec![far.clone() as Arc<dyn Backend>]).unwrap();
        far.down.store(true, std::sync::atomic::Ordering::Relaxed);
        assert!(matches!(
            only.get_many(&[a]),
            Err(StoreError::Unavailable(_))
        ));
        // the next call, inside the backoff, does not ask it and says why
        assert!(
            matches!(only.get_many(&[a]), Err(StoreError::Unavailable(m)) if m.contains("no tier") && m.contains("far tier is down"))
        );
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

    #[test]
    fn admission_on_reuse_puts_a_block_in_the_near_tier_at_its_second_use() {
        let near = Arc::new(MemoryBackend::new(None));
        let far = Arc::new(MemoryBackend::new(None));
        let tiered = TieredBackend::new(vec![near.clone(), far.clone()])
            .unwrap()
            .admit_on_reuse();
        let key = Key([5; 32]);
        assert!(tiered.put_if_absent(&key, b"v").unwrap());
        assert_eq!(near.contains_many(&[key]).unwrap(), [false]);
        assert_eq!(far.contains_many(&[key]).unwrap(), [true]);
        assert_eq!(tiered.get_many(&[key]).unwrap(), [Some(b"v".to_vec())]);
        assert_eq!(near.contains_many(&[key]).unwrap(), [true]);
    }
}
