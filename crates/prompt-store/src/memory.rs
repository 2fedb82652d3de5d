//! `memory`: values in this process, least recently used evicted first beyond a byte budget.

use std::sync::{Arc, Mutex, MutexGuard};

use lru::LruCache;

use crate::backend::{visit_each, Backend, Key, Usage};
use crate::error::StoreResult;

struct Inner {
    values: LruCache<Key, Arc<[u8]>>,
    bytes: u64,
    evictions: u64,
}

/// An in-process backend with an LRU byte budget. Cloning values out keeps the lock short.
pub struct MemoryBackend {
    inner: Mutex<Inner>,
    max_bytes: Option<u64>,
}

impl MemoryBackend {
    /// An empty store holding at most `max_bytes` of values (`None`: unbounded).
    pub fn new(max_bytes: Option<u64>) -> MemoryBackend {
        MemoryBackend {
            inner: Mutex::new(Inner {
                values: LruCache::unbounded(),
                bytes: 0,
                evictions: 0,
            }),
            max_bytes,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // a panic while holding the lock cannot leave the map half-updated in a harmful way
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
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
        inner.values.put(*key, Arc::from(value));
        inner.bytes += value.len() as u64;
        if let Some(max) = self.max_bytes {
            while inner.bytes > max {
                let Some((_, v)) = inner.values.pop_lru() else {
                    break;
                };
                inner.bytes -= v.len() as u64;
                inner.evictions += 1;
            }
        }
        Ok(true)
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
}
