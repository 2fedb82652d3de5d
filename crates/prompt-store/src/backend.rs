//! The storage interface every backend implements (memory, dir, and network stores such as
//! Redis). A backend stores opaque values under 32-byte keys; it knows nothing of blocks,
//! tokens or caches. The store verifies every value it reads (checksum, fingerprint, key,
//! tokens), so a backend returns whatever bytes it holds and never has to judge them.
//!
//! Composition: a tiered backend (`memory` in front of `dir` in front of `redis`) is itself a
//! `Backend` holding `Vec<Arc<dyn Backend>>`: `get_many` asks the nearest tier first and
//! promotes hits with `put_many`, `put_many` writes through, `contains_many` ORs the tiers.
//! Nothing in the trait assumes a single tier.

use std::sync::Arc;

use crate::error::StoreResult;
use crate::events::EventHub;
use crate::key::Key;

/// What a backend holds, as far as it knows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Values stored.
    pub blocks: u64,
    /// Bytes of the values stored (not counting file system or protocol overhead).
    pub bytes: u64,
    /// Values evicted to keep the byte budget since the store was created (`dir`: over the
    /// directory's life, all processes together; `memory`: this process).
    pub evictions: u64,
    /// The byte budget, if any.
    pub max_bytes: Option<u64>,
}

/// How one tier is doing.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TierHealth {
    /// The tier's backend name.
    pub name: &'static str,
    /// Whether its last call succeeded.
    pub up: bool,
    /// The last error it gave, if any (kept after it recovers).
    pub last_error: Option<String>,
}

/// One tier's figures at a moment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TierMetrics {
    /// The tier's backend name.
    pub name: &'static str,
    /// Values found.
    pub hits: u64,
    /// Values asked for and absent.
    pub misses: u64,
    /// Bytes of values read.
    pub bytes_read: u64,
    /// Bytes of values this process stored.
    pub bytes_written: u64,
    /// Values the tier evicted (its own count; `None` when it could not be asked).
    pub evictions: Option<u64>,
}

/// Hands values a backend holds whole to `visit(i, value)`, in order, until it returns false:
/// the end of a [`Backend::visit_many`] that read them first.
pub fn visit_each<V: AsRef<[u8]>>(
    values: &[Option<V>],
    visit: &mut dyn FnMut(usize, Option<&[u8]>) -> bool,
) {
    for (i, value) in values.iter().enumerate() {
        if !visit(i, value.as_ref().map(AsRef::as_ref)) {
            break;
        }
    }
}

/// A key-value store of immutable values. Every method may be called from several threads at
/// once (and, for shared backends, from several processes or machines): values are only ever
/// added whole or removed whole, never modified in place.
///
/// Errors are transport errors: [`crate::StoreError::Unavailable`], `Auth`, `Io`, `NoSpace`.
/// An absent key is never an error, and neither is a value the backend evicted meanwhile:
/// it is simply absent.
pub trait Backend: Send + Sync {
    /// A short name for messages and stats: `"memory"`, `"dir"`, `"redis"`.
    fn name(&self) -> &'static str;

    /// The values of `keys`, in order, `None` where absent. One round trip for a network
    /// backend (`MGET` or a pipeline). A read counts as a use for LRU eviction.
    fn get_many(&self, keys: &[Key]) -> StoreResult<Vec<Option<Vec<u8>>>>;

    /// Calls `visit(i, value)` for each of `keys` in order (`None` where absent) until it returns
    /// false. For readers that use each value once: a backend may read every value into one
    /// reused buffer (`dir` does) instead of allocating them all. The default asks
    /// [`Backend::get_many`] once.
    fn visit_many(
        &self,
        keys: &[Key],
        visit: &mut dyn FnMut(usize, Option<&[u8]>) -> bool,
    ) -> StoreResult<()> {
        visit_each(&self.get_many(keys)?, visit);
        Ok(())
    }

    /// The last `n` bytes of each value (`None` where absent or shorter), in order: what a
    /// store with a secret checks to tell its own values from others' without reading them.
    /// One round trip for a network backend. The default reads the values.
    fn get_tails(&self, keys: &[Key], n: usize) -> StoreResult<Vec<Option<Vec<u8>>>> {
        Ok(self
            .get_many(keys)?
            .into_iter()
            .map(|v| v.and_then(|v| v.len().checked_sub(n).map(|at| v[at..].to_vec())))
            .collect())
    }

    /// Whether each key is present, in order, without transferring values. One round trip
    /// for a network backend (a pipeline of `EXISTS`).
    fn contains_many(&self, keys: &[Key]) -> StoreResult<Vec<bool>>;

    /// How many leading `keys` are present: a lookup along a chain stops at the first absent
    /// block. The default asks [`Backend::contains_many`] once; a backend may stop early.
    fn present_prefix(&self, keys: &[Key]) -> StoreResult<usize> {
        let present = self.contains_many(keys)?;
        Ok(present.iter().take_while(|&&p| p).count())
    }

    /// Stores `value` under `key` unless the key is present (Redis `SET NX`). Returns whether
    /// this call stored it. Idempotent: racing writers of one key store one whole value. The
    /// value is visible to readers whole or not at all.
    fn put_if_absent(&self, key: &Key, value: &[u8]) -> StoreResult<bool>;

    /// [`Backend::put_if_absent`] for several entries (one round trip for a network backend).
    /// Returns, per entry, whether this call stored it. On an error, entries before the failing
    /// one may have been stored (each whole); the caller's cache is never affected.
    fn put_many(&self, entries: &[(Key, &[u8])]) -> StoreResult<Vec<bool>> {
        entries
            .iter()
            .map(|(k, v)| self.put_if_absent(k, v))
            .collect()
    }

    /// Removes `key` if present (the store drops values that fail verification, so that a
    /// later put can store a good one). Removing an absent key is not an error.
    fn remove(&self, key: &Key) -> StoreResult<()>;

    /// Counts of what is stored.
    fn usage(&self) -> StoreResult<Usage>;

    /// How each tier is doing (a tiered backend; a single backend has no tiers to report:
    /// its calls fail or succeed as they are).
    fn health(&self) -> Vec<TierHealth> {
        Vec::new()
    }

    /// What each tier served, nearest first, for the store's metrics: a backend counts nothing
    /// itself; the metrics module's `Metered` wraps one to count.
    fn tier_metrics(&self) -> Vec<TierMetrics> {
        Vec::new()
    }

    /// Reports to `hub` what this backend stores and evicts (see [`crate::events`]): a backend
    /// that evicts on its own reports its evictions to `hub.tier(self.name())`; wrappers pass
    /// it on. The default reports nothing (a Redis server's own evictions are not seen).
    fn observe(&self, _hub: &Arc<EventHub>) {}

    /// Housekeeping: recount what is stored, enforce the byte budget, and remove leftovers of
    /// interrupted writes. Returns the usage afterwards. The default only reports usage.
    fn gc(&self) -> StoreResult<Usage> {
        self.usage()
    }
}

/// Writes the named [`Backend`] methods of a wrapper as calls to its `inner` backend, for the
/// wrappers of one tier (counting, compacting) that change a few calls and pass on the rest.
/// `put_if_absent` is written as the wrapper's own `put_many` of one entry, so a wrapper that
/// changes puts changes both.
macro_rules! pass_on {
    ($($method:ident),* $(,)?) => { $(crate::backend::pass_on!(@ $method);)* };
    // what presence checks ask, which no wrapper of a value changes
    (@ presence) => { crate::backend::pass_on!(get_tails, contains_many, present_prefix); };
    (@ name) => {
        fn name(&self) -> &'static str { self.inner.name() }
    };
    (@ get_tails) => {
        fn get_tails(&self, keys: &[Key], n: usize) -> StoreResult<Vec<Option<Vec<u8>>>> {
            self.inner.get_tails(keys, n)
        }
    };
    (@ contains_many) => {
        fn contains_many(&self, keys: &[Key]) -> StoreResult<Vec<bool>> {
            self.inner.contains_many(keys)
        }
    };
    (@ present_prefix) => {
        fn present_prefix(&self, keys: &[Key]) -> StoreResult<usize> {
            self.inner.present_prefix(keys)
        }
    };
    (@ put_if_absent) => {
        fn put_if_absent(&self, key: &Key, value: &[u8]) -> StoreResult<bool> {
            self.put_many(&[(*key, value)]).map(|stored| stored[0])
        }
    };
    (@ remove) => {
        fn remove(&self, key: &Key) -> StoreResult<()> { self.inner.remove(key) }
    };
    (@ usage) => {
        fn usage(&self) -> StoreResult<Usage> { self.inner.usage() }
    };
    (@ health) => {
        fn health(&self) -> Vec<TierHealth> { self.inner.health() }
    };
    (@ tier_metrics) => {
        fn tier_metrics(&self) -> Vec<TierMetrics> { self.inner.tier_metrics() }
    };
    (@ observe) => {
        fn observe(&self, hub: &Arc<EventHub>) { self.inner.observe(hub) }
    };
    (@ gc) => {
        fn gc(&self) -> StoreResult<Usage> { self.inner.gc() }
    };
}
pub(crate) use pass_on;
