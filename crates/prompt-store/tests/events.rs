//! KV events of real puts, restores, evictions, collections and corrupt blocks: what a router
//! folding them learns must be exactly where the store's blocks live.

#[path = "common/caches.rs"]
mod caches;

use std::collections::HashMap;
use std::fs;
use std::sync::{Arc, Mutex};

use caches::{fill, params, tokens};
use llama_kv_cache::{GgmlType, SeedCache};
use prompt_store::events::{EventHub, KvEvent};
use prompt_store::{Backend, DirBackend, Key, MemoryBackend, PromptStore, TieredBackend};

const BT: u32 = 16;

/// Every event the hub hands out, in order.
fn listen(hub: &EventHub) -> Arc<Mutex<Vec<KvEvent>>> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let sink = seen.clone();
    hub.subscribe(Arc::new(move |events: &[KvEvent]| {
        sink.lock().unwrap().extend_from_slice(events)
    }));
    seen
}

fn taken(seen: &Mutex<Vec<KvEvent>>) -> Vec<KvEvent> {
    std::mem::take(&mut *seen.lock().unwrap())
}

/// A prompt's chain keys and tokens.
type Chain = (Vec<Key>, Vec<i32>);

/// What a router learns: the blocks of each medium, folded from the events in order, and each
/// stored block's parent and tokens, checked against its prompt's chain as it goes.
fn fold(events: &[KvEvent], chains: &[Chain]) -> HashMap<&'static str, Vec<Key>> {
    let mut live: HashMap<&'static str, Vec<Key>> = HashMap::new();
    for e in events {
        match e {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium,
            } => {
                assert_eq!(*block_size, BT);
                let (keys, toks) = chains
                    .iter()
                    .find(|c| c.0.contains(&block_hashes[0]))
                    .expect("a block of a prompt put");
                let first = keys.iter().position(|k| *k == block_hashes[0]).unwrap();
                // a run is consecutive blocks of the chain, after its parent
                assert_eq!(&keys[first..first + block_hashes.len()], &block_hashes[..]);
                let parent = first.checked_sub(1).map(|i| keys[i]);
                assert_eq!(*parent_block_hash, parent, "{e:?}");
                let bt = BT as usize;
                assert_eq!(
                    token_ids[..],
                    toks[first * bt..(first + block_hashes.len()) * bt]
                );
                live.entry(medium).or_default().extend(block_hashes);
            }
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
            } => {
                let held = live.entry(medium).or_default();
                // a removal names only blocks the router was told of
                assert!(block_hashes.iter().all(|k| held.contains(k)), "{e:?}");
                held.retain(|k| !block_hashes.contains(k));
            }
            KvEvent::AllBlocksCleared => live.clear(),
        }
    }
    live
}

fn sorted(mut keys: Vec<Key>) -> Vec<Key> {
    keys.sort();
    keys
}

/// The keys of `chain` that `backend` holds.
fn held(backend: &dyn Backend, chain: &[Key]) -> Vec<Key> {
    let present = backend.contains_many(chain).unwrap();
    sorted(
        chain
            .iter()
            .zip(present)
            .filter(|p| p.1)
            .map(|p| *p.0)
            .collect(),
    )
}

fn sorted_media(mut media: Vec<&str>) -> Vec<&str> {
    media.sort();
    media
}

fn prompt(n: u32, salt: u32) -> (SeedCache, Vec<i32>) {
    let mut c = SeedCache::new(params(false, GgmlType::F16, 256)).unwrap();
    fill(&mut c, 0, n, salt);
    (c, tokens(n, salt as i32))
}

#[test]
fn a_put_is_stored_in_every_tier_as_one_chain_and_a_longer_prompt_adds_only_its_new_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let memory: Arc<dyn Backend> = Arc::new(MemoryBackend::new(None));
    let disk: Arc<dyn Backend> = Arc::new(DirBackend::open(dir.path(), None).unwrap());
    let tiers = TieredBackend::new(vec![memory, disk]).unwrap();
    let hub = EventHub::new();
    let seen = listen(&hub);
    let store = PromptStore::new(Arc::new(tiers), "m", BT)
        .unwrap()
        .with_events(hub);
    // 12 blocks: more than one write batch, so later batches name their parent
    let (c, toks) = prompt(192, 0);
    store.put(&c, 0, &toks, None).unwrap();
    let keys = store.keys(&toks).unwrap().unwrap();
    let live = fold(&taken(&seen), &[(keys.clone(), toks)]);
    assert_eq!(sorted(live["memory"].clone()), sorted(keys.clone()));
    assert_eq!(sorted(live["dir"].clone()), sorted(keys.clone()));

    // the same prompt, longer: only blocks 12 and 13 are new, after block 11, in each tier
    let (c, toks) = prompt(224, 0);
    store.put(&c, 0, &toks, None).unwrap();
    let longer = store.keys(&toks).unwrap().unwrap();
    assert_eq!(longer[..12], keys[..]);
    let more = taken(&seen);
    let media: Vec<&str> = more
        .iter()
        .map(|e| match e {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                medium,
                ..
            } => {
                assert_eq!(block_hashes[..], longer[12..]);
                assert_eq!(*parent_block_hash, Some(keys[11]));
                assert_eq!(token_ids[..], toks[192..]);
                *medium
            }
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(sorted_media(media), ["dir", "memory"]);
}

#[test]
fn evictions_follow_the_stores_that_caused_them_and_leave_the_picture_exact() {
    for policy in [
        prompt_store::EvictionPolicy::Lru,
        prompt_store::EvictionPolicy::S3Fifo,
    ] {
        let dir = tempfile::tempdir().unwrap();
        let block = 16 * 2 * (2 * 64 + 2 * 32) as u64; // about one block of rows
        let memory = Arc::new(MemoryBackend::with_policy(Some(5 * block), policy));
        let disk = Arc::new(DirBackend::open(dir.path(), Some(7 * block)).unwrap());
        let tiers = TieredBackend::new(vec![memory.clone(), disk.clone()]).unwrap();
        let hub = EventHub::new();
        let seen = listen(&hub);
        let store = PromptStore::new(Arc::new(tiers), "m", BT)
            .unwrap()
            .with_events(hub);
        let mut chains = Vec::new();
        for salt in 0..3 {
            let (c, toks) = prompt(160, salt);
            store.put(&c, 0, &toks, None).unwrap();
            chains.push((store.keys(&toks).unwrap().unwrap(), toks));
        }
        let live = fold(&taken(&seen), &chains);
        let all: Vec<Key> = chains.iter().flat_map(|c| c.0.clone()).collect();
        let name = policy.name();
        assert!(memory.usage().unwrap().evictions > 0 && disk.usage().unwrap().evictions > 0);
        assert_eq!(
            sorted(live["memory"].clone()),
            held(memory.as_ref(), &all),
            "{name}"
        );
        assert_eq!(
            sorted(live["dir"].clone()),
            held(disk.as_ref(), &all),
            "{name}"
        );
    }
}

#[test]
fn a_gc_names_only_this_namespaces_evicted_blocks_and_a_corrupt_block_leaves_every_tier() {
    let dir = tempfile::tempdir().unwrap();
    // another tenant fills the shared directory first
    let other = PromptStore::new(
        Arc::new(DirBackend::open(dir.path(), None).unwrap()),
        "m",
        BT,
    )
    .unwrap()
    .with_namespace("other");
    let (c, toks) = prompt(128, 1);
    other.put(&c, 0, &toks, None).unwrap();
    let theirs = other.keys(&toks).unwrap().unwrap();

    let hub = EventHub::new();
    let seen = listen(&hub);
    let ours = Arc::new(DirBackend::open(dir.path(), None).unwrap());
    let store = PromptStore::new(ours.clone(), "m", BT)
        .unwrap()
        .with_events(hub);
    let (c, toks) = prompt(128, 2);
    store.put(&c, 0, &toks, None).unwrap();
    let keys = store.keys(&toks).unwrap().unwrap();
    let mut events = taken(&seen);

    // a gc under a budget of a third: the oldest files go, theirs first, ours after
    let tight =
        Arc::new(DirBackend::open(dir.path(), Some(ours.usage().unwrap().bytes / 3)).unwrap());
    let gc_store = PromptStore::new(tight.clone(), "m", BT).unwrap();
    let hub = EventHub::new();
    let gc_seen = listen(&hub);
    let gc_store = gc_store.with_events(hub);
    gc_store.keys(&toks).unwrap(); // binds it to the recorded model
    gc_store.backend().gc().unwrap();
    let removed = taken(&gc_seen);
    let named: Vec<Key> = removed
        .iter()
        .flat_map(|e| match e {
            KvEvent::BlockRemoved {
                block_hashes,
                medium: "dir",
            } => block_hashes.clone(),
            other => panic!("{other:?}"),
        })
        .collect();
    assert!(
        !named.is_empty()
            && named
                .iter()
                .all(|k| keys.contains(k) && !theirs.contains(k))
    );
    assert!(theirs
        .iter()
        .all(|k| !tight.contains_many(&[*k]).unwrap()[0]));
    events.extend(removed);
    let chain = [(keys.clone(), toks.clone())];
    assert_eq!(
        sorted(fold(&events, &chain)["dir"].clone()),
        held(ours.as_ref(), &keys)
    );

    // put again, a flipped block is found corrupt by a restore and named as removed
    store.put(&c, 0, &toks, None).unwrap();
    taken(&seen);
    let at = 2;
    let path = ours.path_of(&keys[at]);
    let mut bytes = fs::read(&path).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 1;
    fs::write(&path, bytes).unwrap();
    let mut dst = SeedCache::new(params(false, GgmlType::F16, 256)).unwrap();
    store.restore(&mut dst, 0, &toks, None).unwrap();
    let after = taken(&seen);
    assert!(
        after.contains(&KvEvent::BlockRemoved {
            block_hashes: vec![keys[at]],
            medium: "dir"
        }),
        "{after:?}"
    );
}

#[test]
fn a_memory_store_dropped_clears_everything_and_nothing_is_reported_without_listeners() {
    let hub = EventHub::new();
    let store = PromptStore::new(Arc::new(MemoryBackend::new(None)), "m", BT)
        .unwrap()
        .with_events(hub.clone());
    let (c, toks) = prompt(64, 0);
    store.put(&c, 0, &toks, None).unwrap();
    // subscribed after the put: it hears nothing of it
    let seen = listen(&hub);
    assert!(taken(&seen).is_empty());
    drop(store);
    assert_eq!(taken(&seen), [KvEvent::AllBlocksCleared]);
}
