//! `memory`: values in this process, evicted beyond a byte budget by a policy: least recently
//! used first (the default), or S3-FIFO, which keeps the values that are read again.

use std::sync::{Arc, Mutex, MutexGuard};

use lru::LruCache;
use quick_cache::{OptionsBuilder, Weighter};

use crate::backend::{visit_each, Backend, Usage};
use crate::error::StoreResult;
use crate::events::{EventHub, TierEvents};
use crate::key::Key;

/// Which value the memory tier evicts when a put takes it over its byte budget.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EvictionPolicy {
    /// Least recently used (put or read) first.
    #[default]
    Lru,
    /// S3-FIFO (the `quick_cache` crate, weighted by bytes): a new value enters a small FIFO
    /// (10% of the budget) and leaves it unless it is read again there; a value read again moves
    /// to the main part, which evicts what has not been read since its last pass. A value put
    /// again soon after it left the small FIFO (a ghost) goes straight to the main part. So a
    /// burst of one-off prompts only churns the small FIFO, and the system prompts and
    /// documents that every request reads stay.
    S3Fifo,
}

impl EvictionPolicy {
    /// The policy named `name` as the options spell it: `"lru"` or `"s3fifo"`.
    pub fn parse(name: &str) -> Option<EvictionPolicy> {
        match name {
            "lru" => Some(EvictionPolicy::Lru),
            "s3fifo" => Some(EvictionPolicy::S3Fifo),
            _ => None,
        }
    }

    /// The name [`EvictionPolicy::parse`] reads.
    pub fn name(self) -> &'static str {
        match self {
            EvictionPolicy::Lru => "lru",
            EvictionPolicy::S3Fifo => "s3fifo",
        }
    }
}

/// A value weighs its bytes (at least 1: `quick_cache` never evicts weightless values).
#[derive(Clone)]
struct ByLen;

impl Weighter<Key, Arc<[u8]>> for ByLen {
    fn weight(&self, _: &Key, value: &Arc<[u8]>) -> u64 {
        (value.len() as u64).max(1)
    }
}

/// What one insert evicted.
type Evicted = Vec<(Key, Arc<[u8]>)>;

/// Collects the values a call evicts, to report them (`quick_cache` calls it per eviction).
#[derive(Clone, Default)]
struct Collect;

impl quick_cache::Lifecycle<Key, Arc<[u8]>> for Collect {
    type RequestState = Evicted;

    fn on_evict(&self, evicted: &mut Self::RequestState, key: Key, value: Arc<[u8]>) {
        evicted.push((key, value));
    }
}

type S3Fifo =
    quick_cache::unsync::Cache<Key, Arc<[u8]>, ByLen, quick_cache::DefaultHashBuilder, Collect>;

/// The values in their eviction order.
enum Values {
    Lru(LruCache<Key, Arc<[u8]>>),
    /// With the byte budget. `None` until the first put: `quick_cache` sizes its list of ghosts by an estimated count
    /// of values, which the budget over the first value's size gives (a store's blocks all
    /// have one size).
    S3Fifo(Option<S3Fifo>, u64),
}

impl Values {
    /// The value of `key`, counted as a use.
    fn get(&mut self, key: &Key) -> Option<&Arc<[u8]>> {
        match self {
            Values::Lru(v) => v.get(key),
            Values::S3Fifo(v, _) => v.as_ref()?.get(key),
        }
    }

    /// The value of `key`, not counted as a use.
    fn peek(&self, key: &Key) -> Option<&Arc<[u8]>> {
        match self {
            Values::Lru(v) => v.peek(key),
            Values::S3Fifo(v, _) => v.as_ref()?.peek(key),
        }
    }

    fn contains(&self, key: &Key) -> bool {
        match self {
            Values::Lru(v) => v.contains(key),
            Values::S3Fifo(v, _) => v.as_ref().is_some_and(|v| v.contains_key(key)),
        }
    }

    /// Every value held, as key and value (in no particular order).
    fn entries(&self) -> Vec<(Key, &[u8])> {
        match self {
            Values::Lru(v) => v.iter().map(|(k, v)| (*k, &v[..])).collect(),
            Values::S3Fifo(v, _) => v
                .iter()
                .flat_map(|c| c.iter())
                .map(|(k, v)| (*k, &v[..]))
                .collect(),
        }
    }

    fn len(&self) -> usize {
        match self {
            Values::Lru(v) => v.len(),
            Values::S3Fifo(v, _) => v.as_ref().map_or(0, |v| v.len()),
        }
    }

    fn pop(&mut self, key: &Key) -> Option<Arc<[u8]>> {
        match self {
            Values::Lru(v) => v.pop(key),
            Values::S3Fifo(v, _) => v.as_mut()?.remove(key).map(|(_, v)| v),
        }
    }

    /// Adds an absent value and evicts down to `max` bytes (S3-FIFO: its own budget), given
    /// the bytes held before.
    /// Returns the bytes held after and the values evicted.
    fn insert(
        &mut self,
        key: Key,
        value: Arc<[u8]>,
        bytes: u64,
        max: Option<u64>,
    ) -> (u64, Evicted) {
        let mut bytes = bytes + value.len() as u64;
        match self {
            Values::Lru(values) => {
                values.put(key, value);
                let mut evicted = Vec::new();
                while max.is_some_and(|max| bytes > max) {
                    let Some((k, v)) = values.pop_lru() else {
                        break;
                    };
                    bytes -= v.len() as u64;
                    evicted.push((k, v));
                }
                (bytes, evicted)
            }
            Values::S3Fifo(values, budget) => {
                let values = values.get_or_insert_with(|| {
                    let estimate = *budget / (value.len() as u64).max(1);
                    // S3-FIFO's own sizes (`quick_cache` defaults to a 3% small FIFO and half
                    // as many ghosts): a 10% small FIFO keeps a chat's blocks until its next
                    // turn reads them, and as many ghosts as values held send a block put
                    // again within one cache's worth of puts to the main part
                    let options = OptionsBuilder::new()
                        .estimated_items_capacity(estimate.clamp(16, 1 << 24) as usize)
                        .weight_capacity(*budget)
                        .hot_allocation(0.9)
                        .ghost_allocation(1.0)
                        .build()
                        .expect("valid by construction: a ghost allocation within 0..=1");
                    S3Fifo::with_options(options, ByLen, Default::default(), Collect)
                });
                let mut evicted = Vec::new();
                values.insert_with_lifecycle(key, value, &mut evicted);
                // every value weighs its length (values are never empty: a block has a header)
                bytes = values.weight();
                (bytes, evicted)
            }
        }
    }
}

struct Inner {
    values: Values,
    bytes: u64,
    evictions: u64,
    /// Where evictions are reported, once someone observes this tier.
    events: Option<Arc<TierEvents>>,
}

/// An in-process backend with a byte budget. Cloning values out keeps the lock short.
pub struct MemoryBackend {
    inner: Mutex<Inner>,
    max_bytes: Option<u64>,
}

impl MemoryBackend {
    /// An empty store holding at most `max_bytes` of values (`None`: unbounded), least recently
    /// used evicted first.
    pub fn new(max_bytes: Option<u64>) -> MemoryBackend {
        MemoryBackend::with_policy(max_bytes, EvictionPolicy::Lru)
    }

    /// An empty store holding at most `max_bytes` of values, evicted by `policy` (an unbounded
    /// store evicts nothing, so it keeps the plain LRU map whatever the policy).
    pub fn with_policy(max_bytes: Option<u64>, policy: EvictionPolicy) -> MemoryBackend {
        let values = match (policy, max_bytes) {
            (EvictionPolicy::S3Fifo, Some(max)) => Values::S3Fifo(None, max),
            _ => Values::Lru(LruCache::unbounded()),
        };
        MemoryBackend {
            inner: Mutex::new(Inner {
                values,
                bytes: 0,
                evictions: 0,
                events: None,
            }),
            max_bytes,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // a panic while holding the lock cannot leave the map half-updated in a harmful way
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The values go with the tier: a router must forget them.
impl Drop for MemoryBackend {
    fn drop(&mut self) {
        let inner = self.lock();
        if let Some(events) = inner.events.as_ref().filter(|e| e.wanted()) {
            events.dropped(inner.values.entries());
        }
    }
}

impl Backend for MemoryBackend {
    fn name(&self) -> &'static str {
        "memory"
    }

    fn get_many(&self, keys: &[Key]) -> StoreResult<Vec<Option<Vec<u8>>>> {
        let mut inner = self.lock();
        Ok(keys
            .iter()
            .map(|k| inner.values.get(k).map(|v| v.to_vec()))
            .collect())
    }

    /// Visits the stored values themselves: the lock is held only to take a reference to
    /// each, and nothing is copied (a restore reads its blocks straight into the cache).
    fn visit_many(
        &self,
        keys: &[Key],
        visit: &mut dyn FnMut(usize, Option<&[u8]>) -> bool,
    ) -> StoreResult<()> {
        let values: Vec<Option<Arc<[u8]>>> = {
            let mut inner = self.lock();
            keys.iter().map(|k| inner.values.get(k).cloned()).collect()
        };
        visit_each(&values, visit);
        Ok(())
    }

    fn get_tails(&self, keys: &[Key], n: usize) -> StoreResult<Vec<Option<Vec<u8>>>> {
        let inner = self.lock();
        Ok(keys
            .iter()
            .map(|k| {
                let v = inner.values.peek(k)?;
                v.len().checked_sub(n).map(|at| v[at..].to_vec())
            })
            .collect())
    }

    fn contains_many(&self, keys: &[Key]) -> StoreResult<Vec<bool>> {
        let inner = self.lock();
        Ok(keys.iter().map(|k| inner.values.contains(k)).collect())
    }

    fn present_prefix(&self, keys: &[Key]) -> StoreResult<usize> {
        let inner = self.lock();
        Ok(keys.iter().take_while(|k| inner.values.contains(k)).count())
    }

    fn put_if_absent(&self, key: &Key, value: &[u8]) -> StoreResult<bool> {
        let mut inner = self.lock();
        if inner.values.contains(key) {
            return Ok(false);
        }
        let bytes = inner.bytes;
        let (bytes, evicted) = inner
            .values
            .insert(*key, Arc::from(value), bytes, self.max_bytes);
        inner.bytes = bytes;
        inner.evictions += evicted.len() as u64;
        if let Some(events) = inner.events.as_ref().filter(|e| e.wanted()) {
            for (k, v) in &evicted {
                events.evicted(k, v);
            }
        }
        Ok(true)
    }

    fn observe(&self, hub: &Arc<EventHub>) {
        self.lock().events = Some(hub.tier(self.name()));
    }

    fn remove(&self, key: &Key) -> StoreResult<()> {
        let mut inner = self.lock();
        if let Some(v) = inner.values.pop(key) {
            inner.bytes -= v.len() as u64;
        }
        Ok(())
    }

    fn usage(&self) -> StoreResult<Usage> {
        let inner = self.lock();
        Ok(Usage {
            blocks: inner.values.len() as u64,
            bytes: inner.bytes,
            evictions: inner.evictions,
            max_bytes: self.max_bytes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn put_if_absent_stores_once() {
        let m = MemoryBackend::new(None);
        let k = Key([1; 32]);
        assert!(m.put_if_absent(&k, b"a").unwrap());
        assert!(!m.put_if_absent(&k, b"bb").unwrap());
        assert_eq!(
            m.get_many(&[k, Key([2; 32])]).unwrap(),
            [Some(b"a".to_vec()), None]
        );
        assert_eq!(m.usage().unwrap().bytes, 1);
    }

    #[test]
    fn visit_many_lends_the_stored_values_in_order_and_counts_them_as_used() {
        let m = MemoryBackend::new(Some(30));
        let keys: Vec<Key> = (0..3).map(|i| Key([i; 32])).collect();
        for (i, k) in keys.iter().enumerate() {
            m.put_if_absent(k, &[i as u8; 10]).unwrap();
        }
        let mut seen = Vec::new();
        m.visit_many(&[keys[0], Key([7; 32]), keys[2]], &mut |i, v| {
            seen.push((i, v.map(|v| v.to_vec())));
            true
        })
        .unwrap();
        assert_eq!(
            seen,
            [(0, Some(vec![0; 10])), (1, None), (2, Some(vec![2; 10]))]
        );
        // keys 0 and 2 were read after 1 was written: 1 is the least recently used
        m.put_if_absent(&Key([9; 32]), &[0; 10]).unwrap();
        assert_eq!(m.contains_many(&keys).unwrap(), [true, false, true]);
        let mut calls = 0;
        m.visit_many(&keys, &mut |_, _| {
            calls += 1;
            false
        })
        .unwrap();
        assert_eq!(calls, 1, "stops when the visitor says so");
    }

    #[test]
    fn the_budget_evicts_the_least_recently_read_value() {
        let m = MemoryBackend::new(Some(30));
        let keys: Vec<Key> = (0..3).map(|i| Key([i; 32])).collect();
        for k in &keys {
            m.put_if_absent(k, &[0; 10]).unwrap();
        }
        m.get_many(&keys[..1]).unwrap(); // key 0 is now the most recent
        m.put_if_absent(&Key([9; 32]), &[0; 10]).unwrap();
        assert_eq!(m.contains_many(&keys).unwrap(), [true, false, true]);
        let u = m.usage().unwrap();
        assert_eq!((u.blocks, u.bytes, u.evictions), (3, 30, 1));
    }

    #[test]
    fn present_prefix_stops_at_the_first_absent_key() {
        let m = MemoryBackend::new(None);
        let keys: Vec<Key> = (0..4).map(|i| Key([i; 32])).collect();
        for k in [keys[0], keys[1], keys[3]] {
            m.put_if_absent(&k, b"x").unwrap();
        }
        assert_eq!(m.present_prefix(&keys).unwrap(), 2);
        m.remove(&keys[0]).unwrap();
        assert_eq!(m.present_prefix(&keys).unwrap(), 0);
    }

    /// A value used twice close together, then once per 150 one-off values (more than the
    /// budget holds).
    fn reused_value_among_one_offs(policy: EvictionPolicy) -> bool {
        let m = MemoryBackend::with_policy(Some(100 * 10), policy);
        let reused = Key([0xee; 32]);
        for i in 1..1000u32 {
            if i == 1 || i == 20 || i % 150 == 0 {
                // the value is put when absent and read otherwise, as a store's lookup does
                if m.get_many(&[reused]).unwrap()[0].is_none() {
                    m.put_if_absent(&reused, &[1; 10]).unwrap();
                }
            }
            let mut k = [0u8; 32];
            k[..4].copy_from_slice(&i.to_le_bytes());
            m.put_if_absent(&Key(k), &[0; 10]).unwrap();
        }
        m.contains_many(&[reused]).unwrap()[0]
    }

    #[test]
    fn s3fifo_keeps_a_value_read_again_through_a_burst_of_one_offs_that_lru_loses() {
        assert!(!reused_value_among_one_offs(EvictionPolicy::Lru));
        assert!(reused_value_among_one_offs(EvictionPolicy::S3Fifo));
    }

    #[test]
    fn s3fifo_keeps_the_budget_and_counts_what_it_holds_and_evicts() {
        let m = MemoryBackend::with_policy(Some(1000), EvictionPolicy::S3Fifo);
        // a small generator: the sequence is the same on every run
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut stored = 0;
        for _ in 0..5000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let key = Key([(x % 200) as u8; 32]);
            let len = 1 + (x >> 32) as usize % 40;
            match x % 3 {
                0 => stored += u64::from(m.put_if_absent(&key, &vec![0; len]).unwrap()),
                1 => drop(m.get_many(&[key]).unwrap()),
                _ => {
                    let held = m.contains_many(&[key]).unwrap()[0];
                    m.remove(&key).unwrap();
                    stored -= u64::from(held);
                }
            }
            let u = m.usage().unwrap();
            assert!(u.bytes <= 1000, "{} bytes over the budget", u.bytes);
            let sizes: u64 = {
                let inner = m.lock();
                (0..=255)
                    .filter_map(|b| inner.values.peek(&Key([b; 32])))
                    .map(|v| v.len() as u64)
                    .sum()
            };
            assert_eq!(u.bytes, sizes, "bytes are the held values' sizes");
            assert_eq!(
                u.blocks + u.evictions,
                stored,
                "every value stored is held or evicted"
            );
        }
    }

    #[test]
    fn policies_are_named_as_the_options_spell_them() {
        for p in [EvictionPolicy::Lru, EvictionPolicy::S3Fifo] {
            assert_eq!(EvictionPolicy::parse(p.name()), Some(p));
        }
        assert_eq!(EvictionPolicy::parse("arc"), None);
    }
}
