//! KV events: what a router in front of many engines needs to know where prompts live. The
//! three kinds are vLLM's (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`), so that a
//! cache-aware router (llm-d's precise prefix-cache scorer, NVIDIA Dynamo's KV router) that
//! consumes vLLM's events can consume a prompt store's too; the binding publishes them.
//!
//! Each tier is its own medium (`"memory"`, `"dir"`, `"redis"`): a block put into two tiers is
//! stored twice, once per medium, and an eviction removes it from one medium only.
//!
//! Where events come from:
//! - stored: the values a tier's `put` actually stored (the [`crate::metrics::Metered`] wrapper
//!   of each tier sees them), blocks only (not model records, checkpoints or indexes);
//! - removed: a tier's own evictions (memory over its budget, dir over its budget or in `gc`),
//!   reported by the backend through [`TierEvents`], and the blocks the store finds corrupt
//!   and removes from every tier;
//! - cleared: the store's memory is dropped (a store whose only tier is `memory` is closed).
//!
//! A store sees only its own blocks: a value whose header carries another fingerprint (another
//! namespace or model sharing a dir) is never named. Nothing is done while nobody listens.

use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use lru::LruCache;

use crate::block::{head, named};
use crate::key::Key;

/// One change to where blocks live.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    /// Consecutive blocks of one prompt were stored in `medium`: `block_hashes[0]` follows
    /// `parent_block_hash` (`None`: it is the prompt's first block), each later one follows
    /// the one before it, and `token_ids` are their tokens, `block_size` per block.
    BlockStored {
        block_hashes: Vec<Key>,
        parent_block_hash: Option<Key>,
        token_ids: Vec<i32>,
        block_size: u32,
        medium: &'static str,
    },
    /// Blocks left `medium` (evicted, collected, or found corrupt).
    BlockRemoved {
        block_hashes: Vec<Key>,
        medium: &'static str,
    },
    /// Every block of this store is gone (its only tier, memory, was dropped).
    AllBlocksCleared,
}

/// A subscriber: called with each batch of events, in the order they happened, on the thread
/// that caused them (keep it short: it runs inside the store's call), and once with an empty
/// batch when the store is gone (no event follows).
pub type Subscriber = Arc<dyn Fn(&[KvEvent]) + Send + Sync>;

/// How many blocks a tier of bare-key evictions remembers having stored.
const KNOWN_KEYS: usize = 1 << 18;

/// How many chain links (block -> parent) are remembered for naming a stored block's parent:
/// the links of the prompts being put or restored, a few thousand at a time.
const REMEMBERED_LINKS: usize = 1 << 16;

/// The events of one store: its subscribers, its fingerprint and each tier's reporter.
pub struct EventHub {
    subscribers: Mutex<Vec<(u64, Subscriber)>>,
    next_id: AtomicU64,
    /// Whether anyone listens (read on every call: nothing is parsed or kept otherwise).
    active: AtomicBool,
    /// The store's fingerprint once bound: blocks of other fingerprints are not ours.
    own: Mutex<Option<Key>>,
    /// block key -> its parent key, for the prompts recently put or read.
    parents: Mutex<LruCache<Key, Key>>,
    tiers: Mutex<Vec<Arc<TierEvents>>>,
    /// Held while a batch is handed to the subscribers, so that all see one order.
    order: Mutex<()>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // every critical section leaves its data whole: a panic elsewhere cannot corrupt it
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Default for EventHub {
    fn default() -> Self {
        EventHub {
            subscribers: Mutex::default(),
            next_id: AtomicU64::new(1),
            active: AtomicBool::new(false),
            own: Mutex::default(),
            parents: Mutex::new(LruCache::new(
                NonZeroUsize::new(REMEMBERED_LINKS).expect("a positive constant"),
            )),
            tiers: Mutex::default(),
            order: Mutex::default(),
        }
    }
}

/// The store is gone: every subscriber hears its end, after the events of the store's
/// teardown (the hub outlives the store's backend, whose tiers hold it weakly).
impl Drop for EventHub {
    fn drop(&mut self) {
        let subs = std::mem::take(&mut *lock(&self.subscribers));
        for (_, f) in subs {
            f(&[]);
        }
    }
}

impl EventHub {
    /// A hub with no subscribers.
    pub fn new() -> Arc<EventHub> {
        Arc::new(EventHub::default())
    }

    /// Calls `f` with every later batch of events until [`EventHub::unsubscribe`] with the
    /// returned id.
    pub fn subscribe(&self, f: Subscriber) -> u64 {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        lock(&self.subscribers).push((id, f));
        self.active.store(true, Ordering::SeqCst);
        let tiers: Vec<Arc<TierEvents>> = lock(&self.tiers).clone();
        for t in tiers {
            if let Some(start) = t.starter.get() {
                start();
            }
        }
        id
    }

    /// Stops calling the subscriber `id` (an unknown id is ignored).
    pub fn unsubscribe(&self, id: u64) {
        let mut subs = lock(&self.subscribers);
        subs.retain(|(i, _)| *i != id);
        self.active.store(!subs.is_empty(), Ordering::SeqCst);
    }

    /// Whether anyone listens.
    pub fn active(&self) -> bool {
        self.active.load(Ordering::Relaxed)
    }

    /// The store's fingerprint, once it is bound: only blocks carrying it are named.
    pub fn bind(&self, fingerprint: &Key) {
        *lock(&self.own) = Some(*fingerprint);
    }

    fn is_own(&self, fingerprint: &[u8]) -> bool {
        lock(&self.own).is_some_and(|k| k.0 == fingerprint)
    }

    /// Remembers that `keys` are consecutive blocks from a prompt's first one (each follows the
    /// one before): what names a stored block's parent.
    pub fn note_chain(&self, keys: &[Key]) {
        if !self.active() {
            return;
        }
        let mut parents = lock(&self.parents);
        for pair in keys.windows(2) {
            parents.put(pair[1], pair[0]);
        }
    }

    /// The reporter of the tier `medium` (one per medium).
    pub fn tier(self: &Arc<Self>, medium: &'static str) -> Arc<TierEvents> {
        let mut tiers = lock(&self.tiers);
        if let Some(t) = tiers.iter().find(|t| t.medium == medium) {
            return t.clone();
        }
        let t = Arc::new(TierEvents {
            medium,
            hub: Arc::downgrade(self),
            evicted: Mutex::default(),
            known: Mutex::default(),
            starter: std::sync::OnceLock::new(),
        });
        tiers.push(t.clone());
        t
    }

    fn emit(&self, events: Vec<KvEvent>) {
        if events.is_empty() {
            return;
        }
        let _order = lock(&self.order);
        let subs: Vec<Subscriber> = lock(&self.subscribers)
            .iter()
            .map(|(_, f)| f.clone())
            .collect();
        for f in subs {
            f(&events);
        }
    }

    /// The block `key`, found corrupt, was removed from every tier.
    pub fn removed_everywhere(&self, key: &Key) {
        if !self.active() {
            return;
        }
        let media: Vec<&'static str> = lock(&self.tiers).iter().map(|t| t.medium).collect();
        self.emit(
            media
                .into_iter()
                .map(|medium| KvEvent::BlockRemoved {
                    block_hashes: vec![*key],
                    medium,
                })
                .collect(),
        );
    }

    /// Every block of the store is gone.
    pub fn cleared(&self) {
        if self.active() {
            self.emit(vec![KvEvent::AllBlocksCleared]);
        }
    }

    /// The events of the values `medium` stored (in the order put): one `BlockStored` per run
    /// of consecutive blocks of one prompt.
    fn stored<'a>(
        &self,
        medium: &'static str,
        values: impl Iterator<Item = &'a [u8]>,
    ) -> Vec<KvEvent> {
        let parents = lock(&self.parents);
        let mut events: Vec<KvEvent> = Vec::new();
        for h in values
            .filter_map(head)
            .filter(|h| self.is_own(h.fingerprint))
        {
            let parent = match h.index {
                0 => None,
                _ => parents.peek(&h.key).copied(),
            };
            let tokens = h
                .tokens
                .chunks_exact(4)
                .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            // a block that follows the last one joins its event
            if let Some(KvEvent::BlockStored {
                block_hashes,
                token_ids,
                ..
            }) = events.last_mut()
            {
                if parent.is_some() && block_hashes.last() == parent.as_ref() {
                    block_hashes.push(h.key);
                    token_ids.extend(tokens);
                    continue;
                }
            }
            events.push(KvEvent::BlockStored {
                block_hashes: vec![h.key],
                parent_block_hash: parent,
                token_ids: tokens.collect(),
                block_size: (h.tokens.len() / 4) as u32,
                medium,
            });
        }
        events
    }
}

/// The keys a tier of bare-key evictions tracks.
struct Keys {
    /// Blocks this store stored there (and reported).
    stored: LruCache<Key, ()>,
    /// Blocks a put is storing now, and which of them were evicted meanwhile.
    putting: std::collections::HashMap<Key, bool>,
}

/// One tier's reporter: the tier's [`crate::metrics::Metered`] wrapper reports what it stored,
/// and the backend reports what it evicted (with the value's first
/// [`crate::block::HEAD_BYTES`]), which is kept until the wrapper's call ends so that a put's
/// stores come before the evictions it caused.
pub struct TierEvents {
    medium: &'static str,
    hub: std::sync::Weak<EventHub>,
    evicted: Mutex<Vec<Key>>,
    /// For a tier whose evictions come as bare keys (a Redis server's notifications): the
    /// blocks this store stored there, the only ones such an eviction may name, and evictions
    /// heard before the put that stored the block was reported (the server evicts during the
    /// put; its notification can outrun the put's return).
    known: Mutex<Option<Keys>>,
    /// Called when someone starts listening (a tier that must start a listener of its own).
    starter: std::sync::OnceLock<Box<dyn Fn() + Send + Sync>>,
}

impl TierEvents {
    /// Whether anyone listens (a backend reads no header otherwise).
    pub fn wanted(&self) -> bool {
        self.hub.upgrade().is_some_and(|h| h.active())
    }

    /// The backend evicted the value `key`, whose first bytes are `head` (at least
    /// [`crate::block::HEAD_BYTES`] for a block; anything for other values).
    pub fn evicted(&self, key: &Key, head_bytes: &[u8]) {
        let Some(hub) = self.hub.upgrade() else {
            return;
        };
        if hub.active() && named(head_bytes).is_some_and(|(fp, k)| k == *key && hub.is_own(fp)) {
            lock(&self.evicted).push(*key);
        }
    }

    /// The tier was dropped with `values` (key, value) in it: when it was the store's only
    /// tier, every block is gone; otherwise its own blocks left this medium.
    pub fn dropped(&self, values: Vec<(Key, &[u8])>) {
        let Some(hub) = self.hub.upgrade() else {
            return;
        };
        if lock(&hub.tiers).len() == 1 {
            return hub.cleared();
        }
        for (key, value) in values {
            self.evicted(&key, value);
        }
        self.report(std::iter::empty());
    }

    /// The tier's evictions come as bare keys (see [`TierEvents::evicted_key`]): from now on,
    /// the blocks it stores while someone listens are remembered.
    pub fn track_keys(&self) {
        let keys = || LruCache::new(NonZeroUsize::new(KNOWN_KEYS).expect("a positive constant"));
        lock(&self.known).get_or_insert_with(|| Keys {
            stored: keys(),
            putting: Default::default(),
        });
    }

    /// A put of `keys` begins (a tier of bare-key evictions: an eviction heard before the put
    /// is reported is held for it). End it with [`TierEvents::put_done`].
    pub fn putting<'a>(&self, keys: impl Iterator<Item = &'a Key>) {
        if let Some(known) = lock(&self.known).as_mut().filter(|_| self.wanted()) {
            known.putting.extend(keys.map(|k| (*k, false)));
        }
    }

    /// The put of `keys` was reported.
    pub fn put_done<'a>(&self, keys: impl Iterator<Item = &'a Key>) {
        if let Some(known) = lock(&self.known).as_mut() {
            keys.for_each(|k| {
                known.putting.remove(k);
            });
        }
    }

    /// Calls `start` now if someone listens, and whenever someone starts listening (it must
    /// start its work once, however often it is called).
    pub fn on_wanted(&self, start: Box<dyn Fn() + Send + Sync>) {
        if self.starter.set(start).is_ok() && self.wanted() {
            if let Some(start) = self.starter.get() {
                start();
            }
        }
    }

    /// The tier dropped the value `key` on its own (a Redis eviction or expiry), reported at
    /// once: named only when this store stored it there.
    pub fn evicted_key(&self, key: &Key) {
        let ours = lock(&self.known).as_mut().is_some_and(|known| {
            if let Some(evicted) = known.putting.get_mut(key) {
                // stored by a put not reported yet: named after its store, if it stored it
                *evicted = true;
                return false;
            }
            known.stored.pop(key).is_some()
        });
        if ours && self.wanted() {
            lock(&self.evicted).push(*key);
            self.report(std::iter::empty());
        }
    }

    /// Ends a call to the tier: the blocks among `stored` (values it stored, in order), then
    /// what it evicted meanwhile.
    pub fn report<'a>(&self, stored: impl Iterator<Item = &'a [u8]>) {
        let Some(hub) = self.hub.upgrade() else {
            return;
        };
        if !hub.active() {
            lock(&self.evicted).clear();
            return;
        }
        let mut events = hub.stored(self.medium, stored);
        let mut evicted = std::mem::take(&mut *lock(&self.evicted));
        if let Some(known) = lock(&self.known).as_mut() {
            for e in &events {
                if let KvEvent::BlockStored { block_hashes, .. } = e {
                    for k in block_hashes {
                        match known.putting.get(k) {
                            // evicted already: removed right after its store
                            Some(true) => evicted.push(*k),
                            _ => {
                                known.stored.put(*k, ());
                            }
                        }
                    }
                }
            }
        }
        if !evicted.is_empty() {
            events.push(KvEvent::BlockRemoved {
                block_hashes: evicted,
                medium: self.medium,
            });
        }
        hub.emit(events);
    }
}
