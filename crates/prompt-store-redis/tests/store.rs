//! The prompt store through Redis with real caches: a fleet sharing one server, concurrent
//! writers, eviction, faults mid-call, bad data, a client that started while Redis was down.

mod common;

use std::time::Duration;

use common::prompts::*;
use common::server::{cut_client_connections, pause_clients, RedisServer, ServerOptions};
use llama_kv_cache::SeedCache;
use prompt_store::StoreError;

#[test]
fn a_fleet_shares_blocks_a_puts_b_restores_c_looks_up_a_longer_prompt() {
    let server = RedisServer::start();
    let (a, b, c) = (
        store_at(&server.url()),
        store_at(&server.url()),
        store_at(&server.url()),
    );
    let tokens = prompt(64, 0, 0);
    let source = evaluated(&tokens, 0);
    let report = a.put(&source, 0, &tokens, None).unwrap();
    assert_eq!((report.blocks_written, report.tokens), (4, 64));

    let mut restored = SeedCache::new(params()).unwrap();
    assert_eq!(b.restore(&mut restored, 0, &tokens, None).unwrap(), 64);
    assert_eq!(seq0_state(&restored), seq0_state(&source), "byte-exact");

    let longer: Vec<i32> = tokens.iter().copied().chain(500..540).collect();
    assert_eq!(c.lookup(&longer).unwrap(), 64);
    let again = b.put(&source, 0, &tokens, None).unwrap();
    assert_eq!((again.blocks_written, again.blocks_skipped), (0, 4));
}

#[test]
fn concurrent_machines_put_overlapping_prompts_then_each_restores_every_prompt_exactly() {
    let server = RedisServer::start();
    let url = server.url();
    let prompts: Vec<Vec<i32>> = (0..6)
        .map(|i| prompt(48, 16 + 16 * (i % 3), i as i32))
        .collect();
    std::thread::scope(|scope| {
        for (i, tokens) in prompts.iter().enumerate() {
            let url = &url;
            scope.spawn(move || {
                let store = store_at(url);
                store.put(&evaluated(tokens, 0), 0, tokens, None).unwrap();
                let _ = i;
            });
        }
    });
    std::thread::scope(|scope| {
        for _ in 0..3 {
            let (url, prompts) = (&url, &prompts);
            scope.spawn(move || {
                let store = store_at(url);
                for tokens in prompts {
                    let mut cache = SeedCache::new(params()).unwrap();
                    let n = store.restore(&mut cache, 0, tokens, None).unwrap();
                    assert_eq!(n, tokens.len() as u64);
                    assert_eq!(seq0_state(&cache), cold_state(tokens));
                }
            });
        }
    });
}

#[test]
fn evicted_blocks_shorten_lookups_and_restores_without_errors() {
    let server = RedisServer::start_with(ServerOptions {
        maxmemory: Some(1_600_000),
        ..Default::default()
    });
    let store = store_at(&server.url());
    // 16 blocks of 16 tokens x 1,280 bytes (320 KiB per prompt) fit; ten more prompts push the
    // server (about 1 MB when empty) past maxmemory: the least recently used blocks go first
    let first = prompt(256, 0, 0);
    store.put(&evaluated(&first, 0), 0, &first, None).unwrap();
    assert_eq!(store.lookup(&first).unwrap(), 256);
    for salt in 1..11 {
        let other: Vec<i32> = (0..256).map(|t| salt * 10_000 + t).collect();
        store.put(&evaluated(&other, 0), 0, &other, None).unwrap();
    }
    let found = store.lookup(&first).unwrap();
    assert!(
        found < 256,
        "some of the first prompt's blocks were evicted"
    );
    let mut cache = SeedCache::new(params()).unwrap();
    let restored = store.restore(&mut cache, 0, &first, None).unwrap();
    assert!(restored <= found);
    assert_eq!(seq0_state(&cache), cold_state(&first[..restored as usize]));
    let stats = store.stats().unwrap();
    assert!(stats.evictions > 0 && stats.misses > 0, "{stats:?}");
    assert_eq!(stats.corrupt, 0);
}

#[test]
fn a_store_made_while_redis_is_down_fails_typed_then_works_when_it_is_back() {
    let mut server = RedisServer::start();
    server.kill();
    let store = store_at(&server.url());
    let tokens = prompt(32, 0, 0);
    let source = evaluated(&tokens, 0);
    assert!(matches!(
        store.put(&source, 0, &tokens, None),
        Err(StoreError::Unavailable(_))
    ));
    assert!(matches!(
        store.lookup(&tokens),
        Err(StoreError::Unavailable(_))
    ));
    server.restart();
    assert_eq!(
        store.put(&source, 0, &tokens, None).unwrap().blocks_written,
        2
    );
    assert_eq!(store.lookup(&tokens).unwrap(), 32);
}

/// The restore is in flight (the server holds its reply: `CLIENT PAUSE`) when the server is
/// killed: the call fails as unavailable, and the cache is exactly as it was.
#[test]
fn killing_redis_during_a_restore_is_unavailable_and_the_cache_is_unchanged() {
    let mut server = RedisServer::start();
    let store = store_at(&server.url());
    let tokens = prompt(256, 0, 0);
    store.put(&evaluated(&tokens, 0), 0, &tokens, None).unwrap();
    let mut cache = evaluated(&prompt(20, 0, 3), 1);
    let before = snapshot(&cache);
    let mut admin = server.connection();
    let result = std::thread::scope(|scope| {
        let restore = scope.spawn(|| store.restore(&mut cache, 0, &tokens, None));
        pause_clients(&mut admin, 10_000);
        std::thread::sleep(Duration::from_millis(100));
        server.kill();
        restore.join().unwrap()
    });
    assert!(
        matches!(result, Err(StoreError::Unavailable(_))),
        "{result:?}"
    );
    assert_eq!(snapshot(&cache), before, "the cache is exactly as it was");
    server.restart();
    let mut fresh = SeedCache::new(params()).unwrap();
    assert_eq!(
        store.restore(&mut fresh, 0, &tokens, None).unwrap(),
        0,
        "restarted empty, and the same store works again"
    );
}

/// Redis dies after the put's first batch of blocks: the put fails as unavailable, the cache is
/// untouched, and every block that made it is whole (checked on a server whose data survives:
/// the batch's connection is killed instead of the server).
#[test]
fn killing_redis_during_a_put_is_unavailable_and_leaves_no_half_block() {
    let tokens = prompt(256, 0, 0);
    let source = evaluated(&tokens, 0);
    let before = snapshot(&source);

    let mut server = RedisServer::start();
    let store = store_at(&server.url());
    let mut kill_after_first_batch = |done: u64, _total: u64| {
        if done > 0 {
            server.kill();
        }
        true
    };
    let result = store.put(&source, 0, &tokens, Some(&mut kill_after_first_batch));
    assert!(
        matches!(result, Err(StoreError::Unavailable(_))),
        "{result:?}"
    );
    assert_eq!(snapshot(&source), before);
    server.restart();
    assert_eq!(
        store.put(&source, 0, &tokens, None).unwrap().blocks_written,
        16
    );

    // connections cut after the first batch while the server keeps its data
    let server = RedisServer::start();
    let store = store_at(&server.url());
    let mut admin = server.connection();
    let mut cut_after_first_batch = |done: u64, _total: u64| {
        if done > 0 {
            let _: redis::Value = redis::cmd("CONFIG")
                .arg("SET")
                .arg("maxclients")
                .arg(1)
                .query(&mut admin)
                .unwrap();
            cut_client_connections(&mut admin);
        }
        true
    };
    let result = store.put(&source, 0, &tokens, Some(&mut cut_after_first_batch));
    assert!(
        matches!(result, Err(StoreError::Unavailable(_))),
        "{result:?}"
    );
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxclients")
        .arg(100)
        .query(&mut admin)
        .unwrap();
    // what is stored is a whole prefix of blocks: a restore loads it exactly, no block is
    // counted corrupt
    let mut cache = SeedCache::new(params()).unwrap();
    let restored = store.restore(&mut cache, 0, &tokens, None).unwrap();
    assert_eq!(restored, 8 * BT as u64, "the first batch, whole");
    assert_eq!(seq0_state(&cache), cold_state(&tokens[..restored as usize]));
    assert_eq!(store.stats().unwrap().corrupt, 0);
}

/// Values tampered with by hand in Redis are counted misses, never loaded.
#[test]
fn garbage_truncated_and_copied_blocks_are_counted_misses_never_loaded() {
    let server = RedisServer::start();
    let store = store_at(&server.url());
    let tokens = prompt(64, 0, 0);
    let source = evaluated(&tokens, 0);
    store.put(&source, 0, &tokens, None).unwrap();
    let keys = store.keys(&tokens).unwrap().unwrap();
    let redis_key = |i: usize| format!("llama-kv:{}", keys[i].hex());
    let mut admin = server.connection();
    let good: Vec<Vec<u8>> = (0..4)
        .map(|i| {
            redis::cmd("GET")
                .arg(redis_key(i))
                .query(&mut admin)
                .unwrap()
        })
        .collect();
    let tamperings: [(&str, usize, Vec<u8>); 3] = [
        ("garbage", 2, b"not a block at all".to_vec()),
        ("truncated", 1, good[1][..good[1].len() - 100].to_vec()),
        ("copied from another key", 3, good[2].clone()),
    ];
    for (what, at, bad) in tamperings {
        let _: () = redis::cmd("SET")
            .arg(redis_key(at))
            .arg(bad)
            .query(&mut admin)
            .unwrap();
        // damaged values are corrupt; a whole value copied from another key is rejected
        let bad_values = |s: prompt_store::StoreStats| s.corrupt + s.rejected;
        let corrupt_before = bad_values(store.stats().unwrap());
        let mut cache = SeedCache::new(params()).unwrap();
        let restored = store.restore(&mut cache, 0, &tokens, None).unwrap();
        assert_eq!(
            restored,
            at as u64 * BT as u64,
            "{what}: stops before the bad block"
        );
        assert_eq!(
            seq0_state(&cache),
            cold_state(&tokens[..restored as usize]),
            "{what}"
        );
        assert_eq!(
            bad_values(store.stats().unwrap()),
            corrupt_before + 1,
            "{what}: counted"
        );
        // put it back for the next case
        let _: () = redis::cmd("SET")
            .arg(redis_key(at))
            .arg(&good[at])
            .query(&mut admin)
            .unwrap();
    }
}

/// Under `allkeys-lru` the model record (read once per process) is the coldest key and goes
/// first; a restore must still find the blocks, and a put records the model again.
#[test]
fn an_evicted_model_record_does_not_stop_restores() {
    let server = RedisServer::start();
    let tokens = prompt(64, 0, 0);
    let source = evaluated(&tokens, 0);
    let writer = store_at(&server.url());
    writer.put(&source, 0, &tokens, None).unwrap();
    let blocks: Vec<String> = writer
        .keys(&tokens)
        .unwrap()
        .unwrap()
        .iter()
        .map(|k| format!("llama-kv:{}", k.hex()))
        .collect();
    let mut admin = server.connection();
    let all: Vec<String> = redis::cmd("KEYS")
        .arg("llama-kv:*")
        .query(&mut admin)
        .unwrap();
    let record: Vec<&String> = all.iter().filter(|k| !blocks.contains(k)).collect();
    assert_eq!(record.len(), 1, "one model record beside the blocks");
    let _: () = redis::cmd("DEL").arg(record[0]).query(&mut admin).unwrap();

    let reader = store_at(&server.url()); // a process that starts after the eviction
    assert_eq!(
        reader.lookup(&tokens).unwrap(),
        0,
        "no cache, no record: a miss"
    );
    let mut cache = SeedCache::new(params()).unwrap();
    assert_eq!(reader.restore(&mut cache, 0, &tokens, None).unwrap(), 64);
    assert_eq!(seq0_state(&cache), cold_state(&tokens));
    reader.put(&source, 0, &tokens, None).unwrap();
    assert_eq!(
        store_at(&server.url()).lookup(&tokens).unwrap(),
        64,
        "recorded again"
    );
}

/// Collects a store's events; `wait_for` polls until `done(events)` holds (the server's
/// notifications arrive on a thread of their own), failing after `bound`.
struct Heard(std::sync::Arc<std::sync::Mutex<Vec<prompt_store::events::KvEvent>>>);

impl Heard {
    fn on(hub: &prompt_store::events::EventHub) -> Heard {
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = seen.clone();
        hub.subscribe(std::sync::Arc::new(
            move |e: &[prompt_store::events::KvEvent]| sink.lock().unwrap().extend_from_slice(e),
        ));
        Heard(seen)
    }

    /// The keys named removed from Redis so far.
    fn removed(&self) -> Vec<prompt_store::Key> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .flat_map(|e| match e {
                prompt_store::events::KvEvent::BlockRemoved {
                    block_hashes,
                    medium: "redis",
                } => block_hashes.clone(),
                _ => Vec::new(),
            })
            .collect()
    }

    fn wait_for(&self, what: &str, mut done: impl FnMut(&[prompt_store::Key]) -> bool) {
        let bound = std::time::Instant::now() + Duration::from_secs(30);
        while !done(&self.removed()) {
            assert!(
                std::time::Instant::now() < bound,
                "never heard {what}: {:?}",
                self.removed()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn evented(
    options: prompt_store_redis::RedisOptions,
    namespace: &str,
) -> (prompt_store::PromptStore, Heard) {
    let hub = prompt_store::events::EventHub::new();
    let heard = Heard::on(&hub);
    let store = store_with(options)
        .with_namespace(namespace)
        .with_events(hub);
    (store, heard)
}

/// The server's own evictions at maxmemory become BlockRemoved events of exactly the blocks it
/// dropped of this store's; another namespace's evicted blocks are never named.
#[test]
fn blocks_redis_evicts_are_named_removed_and_only_this_stores() {
    let server = RedisServer::start_with(ServerOptions {
        maxmemory: Some(1_600_000),
        ..Default::default()
    });
    let options =
        || prompt_store_redis::RedisOptions::new(server.url()).with_timeout(Duration::from_secs(2));
    let (store, heard) = evented(options(), "");
    let (other, other_heard) = evented(options(), "other");
    let mut ours = Vec::new();
    for salt in 0..8 {
        let p: Vec<i32> = (0..256).map(|t| salt * 10_000 + t).collect();
        store.put(&evaluated(&p, 0), 0, &p, None).unwrap();
        ours.extend(store.keys(&p).unwrap().unwrap());
        let q: Vec<i32> = (0..256).map(|t| -salt * 10_000 - t - 1).collect();
        other.put(&evaluated(&q, 0), 0, &q, None).unwrap();
    }
    let held = |keys: &[prompt_store::Key]| store.backend().contains_many(keys).unwrap();
    let gone: Vec<_> = ours
        .iter()
        .zip(held(&ours))
        .filter(|(_, h)| !h)
        .map(|(k, _)| *k)
        .collect();
    assert!(
        !gone.is_empty(),
        "the server evicted some of this store's blocks"
    );
    heard.wait_for("every evicted block of ours", |removed| {
        gone.iter().all(|k| removed.contains(k))
    });
    // only this store's, and only evicted ones
    let removed = heard.removed();
    assert!(removed.iter().all(|k| ours.contains(k)));
    assert!(held(&removed).iter().all(|h| !h));
    assert!(other_heard.removed().iter().all(|k| !ours.contains(k)));
}

/// A TTL's expiry is a removal too.
#[test]
fn blocks_that_expire_are_named_removed() {
    let server = RedisServer::start();
    let mut options =
        prompt_store_redis::RedisOptions::new(server.url()).with_timeout(Duration::from_secs(2));
    options.ttl = Some(Duration::from_millis(300));
    let (store, heard) = evented(options, "");
    let p = prompt(64, 0, 0);
    store.put(&evaluated(&p, 0), 0, &p, None).unwrap();
    let keys = store.keys(&p).unwrap().unwrap();
    heard.wait_for("the expired blocks", |removed| {
        keys.iter().all(|k| removed.contains(k))
    });
}
