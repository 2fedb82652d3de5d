//! `RedisBackend` against a real redis-server: the Backend contract, namespaces, TTL,
//! eviction as misses, typed failures, faults mid-call.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::server::{
    cut_client_connections, pause_clients, pause_writes, unpause, AclUser, RedisServer,
    ServerOptions,
};
use prompt_store::{Backend, Key, MemoryBackend, StoreError, TieredBackend};
use prompt_store_redis::{RedisBackend, RedisOptions};

fn backend(url: &str) -> RedisBackend {
    RedisBackend::new(RedisOptions::new(url).with_timeout(Duration::from_secs(2))).unwrap()
}

fn key(i: u32) -> Key {
    let mut k = [0u8; 32];
    k[..4].copy_from_slice(&i.to_le_bytes());
    k[31] = 0xab;
    Key(k)
}

fn value(i: u32, len: usize) -> Vec<u8> {
    (0..len).map(|j| (i as usize * 31 + j) as u8).collect()
}

/// `n` keys and values of `len` bytes each.
fn blocks(n: u32, len: usize) -> (Vec<Key>, Vec<Vec<u8>>) {
    (
        (0..n).map(key).collect(),
        (0..n).map(|i| value(i, len)).collect(),
    )
}

fn entries<'a>(keys: &[Key], values: &'a [Vec<u8>]) -> Vec<(Key, &'a [u8])> {
    keys.iter()
        .zip(values)
        .map(|(k, v)| (*k, v.as_slice()))
        .collect()
}

/// `visit_many` reads in several `MGET`s sent at once and visits each value as its reply
/// arrives: in order, absent keys as `None`, stopping when asked; with a TTL through the
/// pipeline that refreshes expiries.
#[test]
fn visit_many_hands_each_value_over_in_order_and_stops_when_asked() {
    let server = RedisServer::start();
    for ttl in [None, Some(Duration::from_secs(60))] {
        let mut options = RedisOptions::new(server.url());
        options.ttl = ttl;
        options.prefix = format!("visit-{}:", ttl.is_some());
        let store = RedisBackend::new(options).unwrap();
        let (keys, values) = blocks(21, 3000);
        // every third key absent
        let stored: Vec<(Key, &[u8])> = entries(&keys, &values)
            .into_iter()
            .enumerate()
            .filter(|(i, _)| i % 3 != 1)
            .map(|(_, e)| e)
            .collect();
        store.put_many(&stored).unwrap();
        let mut seen = Vec::new();
        store
            .visit_many(&keys, &mut |i, v| {
                seen.push((i, v.map(<[u8]>::to_vec)));
                true
            })
            .unwrap();
        let want: Vec<_> = (0..21)
            .map(|i| (i, (i % 3 != 1).then(|| values[i].clone())))
            .collect();
        assert_eq!(seen, want, "ttl {ttl:?}");
        let mut calls = 0;
        store
            .visit_many(&keys, &mut |_, _| {
                calls += 1;
                calls < 5
            })
            .unwrap();
        assert_eq!(calls, 5, "ttl {ttl:?}");
    }
}

#[test]
fn values_round_trip_under_prefixed_hex_keys_and_set_nx_keeps_the_first() {
    let server = RedisServer::start();
    let store = backend(&server.url());
    assert_eq!(store.name(), "redis");
    assert!(store.put_if_absent(&key(1), b"first").unwrap());
    assert!(!store.put_if_absent(&key(1), b"second").unwrap());
    assert_eq!(
        store.put_many(&[(key(1), b"x"), (key(2), b"two")]).unwrap(),
        [false, true]
    );
    assert_eq!(
        store.get_many(&[key(1), key(3), key(2)]).unwrap(),
        [Some(b"first".to_vec()), None, Some(b"two".to_vec())]
    );
    assert_eq!(
        store.contains_many(&[key(2), key(3), key(1)]).unwrap(),
        [true, false, true]
    );
    assert_eq!(
        store
            .present_prefix(&[key(1), key(2), key(3), key(1)])
            .unwrap(),
        2
    );
    let mut raw = server.connection();
    let stored: Vec<u8> = redis::cmd("GET")
        .arg(format!("llama-kv:{}", key(1).hex()))
        .query(&mut raw)
        .unwrap();
    assert_eq!(
        stored, b"first",
        "one plain string per block, under prefix + hex key"
    );
    store.remove(&key(1)).unwrap();
    store.remove(&key(1)).unwrap();
    assert_eq!(store.contains_many(&[key(1)]).unwrap(), [false]);
    let usage = store.usage().unwrap();
    assert_eq!((usage.blocks, usage.bytes), (1, 3));
}

#[test]
fn prefixes_keep_apps_apart_on_one_server() {
    let server = RedisServer::start();
    let a = RedisBackend::new(RedisOptions {
        prefix: "app-a:".into(),
        ..RedisOptions::new(server.url())
    })
    .unwrap();
    let b = RedisBackend::new(RedisOptions {
        prefix: "app-b:".into(),
        ..RedisOptions::new(server.url())
    })
    .unwrap();
    a.put_if_absent(&key(1), b"from a").unwrap();
    assert_eq!(b.get_many(&[key(1)]).unwrap(), [None]);
    assert!(b.put_if_absent(&key(1), b"from b").unwrap());
    assert_eq!(a.get_many(&[key(1)]).unwrap(), [Some(b"from a".to_vec())]);
    assert_eq!(a.usage().unwrap().blocks, 1);
}

/// A value that starts like a block (the TTL applies to every value but the model record).
fn block_value(tag: &[u8]) -> Vec<u8> {
    [&prompt_store::block::MAGIC[..], tag].concat()
}

#[test]
fn ttl_expires_unused_blocks_a_read_renews_a_block_and_other_values_stay() {
    let server = RedisServer::start();
    let with_ttl = |ms: u64, prefix: &str| {
        RedisBackend::new(RedisOptions {
            ttl: Some(Duration::from_millis(ms)),
            prefix: prefix.into(),
            ..RedisOptions::new(server.url())
        })
        .unwrap()
    };
    let mut raw = server.connection();
    let (read, idle) = (block_value(b"read"), block_value(b"idle"));
    let record = [&b"KVPM"[..], b"record"].concat();
    // a long TTL and only comparisons: a stalled test machine cannot make this flaky
    let store = with_ttl(60_000, "long:");
    let mut pttl = |k: u32| -> i64 {
        redis::cmd("PTTL")
            .arg(store.redis_key(&key(k)))
            .query(&mut raw)
            .unwrap()
    };
    store
        .put_many(&[(key(1), &read), (key(2), &idle), (key(3), &record)])
        .unwrap();
    std::thread::sleep(Duration::from_millis(1000));
    assert_eq!(
        store.get_many(&[key(1), key(3)]).unwrap(),
        [Some(read.clone()), Some(record.clone())]
    );
    let (renewed, aging) = (pttl(1), pttl(2));
    assert!(renewed > aging + 500, "{renewed} vs {aging}");
    assert_eq!(pttl(3), -1, "the model record never expires");

    let short = with_ttl(100, "short:");
    short
        .put_many(&[(key(1), &read), (key(3), &record)])
        .unwrap();
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(
        short.contains_many(&[key(1), key(3)]).unwrap(),
        [false, true]
    );
}

#[test]
fn evicted_blocks_are_misses_never_errors() {
    let server = RedisServer::start_with(ServerOptions {
        maxmemory: Some(4 << 20),
        ..Default::default()
    });
    let store = backend(&server.url());
    let keys: Vec<Key> = (0..48).map(key).collect();
    for (i, k) in keys.iter().enumerate() {
        store.put_if_absent(k, &value(i as u32, 256 << 10)).unwrap();
    }
    let present = store.contains_many(&keys).unwrap();
    let kept = present.iter().filter(|&&p| p).count();
    assert!(
        kept > 0 && kept < keys.len(),
        "kept {kept} of {}",
        keys.len()
    );
    assert!(!present[0], "the least recently used block went first");
    assert_eq!(store.present_prefix(&keys).unwrap(), 0);
    let values = store.get_many(&keys).unwrap();
    for (i, v) in values.iter().enumerate() {
        if let Some(v) = v {
            assert_eq!(v, &value(i as u32, 256 << 10), "a kept block is whole");
        }
    }
    let usage = store.usage().unwrap();
    assert!(usage.evictions > 0);
    assert_eq!(usage.max_bytes, Some(4 << 20));
}

#[test]
fn no_eviction_policy_refuses_puts_as_no_space() {
    let server = RedisServer::start_with(ServerOptions {
        maxmemory: Some(2 << 20),
        maxmemory_policy: Some("noeviction".into()),
        ..Default::default()
    });
    let store = backend(&server.url());
    let mut refused = None;
    for i in 0..64 {
        if let Err(err) = store.put_if_absent(&key(i), &value(i, 256 << 10)) {
            refused = Some(err);
            break;
        }
    }
    assert!(
        matches!(refused, Some(StoreError::NoSpace(_))),
        "{refused:?}"
    );
}

#[test]
fn down_at_start_is_unavailable_then_works_once_redis_is_back() {
    let mut server = RedisServer::start();
    server.kill();
    let store = backend(&server.url());
    assert!(matches!(
        store.get_many(&[key(1)]),
        Err(StoreError::Unavailable(_))
    ));
    assert!(matches!(
        store.put_if_absent(&key(1), b"v"),
        Err(StoreError::Unavailable(_))
    ));
    server.restart();
    assert!(store.put_if_absent(&key(1), b"v").unwrap());
    assert_eq!(store.get_many(&[key(1)]).unwrap(), [Some(b"v".to_vec())]);
}

#[test]
fn requirepass_and_acl_users_wrong_credentials_are_auth_errors() {
    let server = RedisServer::start_with(ServerOptions {
        requirepass: Some("fleet-pass".into()),
        users: vec![AclUser {
            name: "worker".into(),
            password: "worker-pass".into(),
        }],
        ..Default::default()
    });
    for url in [
        server.url_with("", "fleet-pass"),
        server.url_with("worker", "worker-pass"),
    ] {
        let store = backend(&url);
        store.put_if_absent(&key(1), b"v").unwrap();
        assert_eq!(store.contains_many(&[key(1)]).unwrap(), [true], "{url}");
    }
    for url in [
        server.url(),
        server.url_with("", "nope"),
        server.url_with("worker", "nope"),
        server.url_with("nobody", "worker-pass"),
    ] {
        let err = backend(&url).get_many(&[key(1)]).unwrap_err();
        assert!(matches!(err, StoreError::Auth(_)), "{url}: {err:?}");
        assert!(!err.to_string().contains("nope"), "no password in: {err}");
    }
}

#[test]
fn racing_writers_store_each_block_exactly_once() {
    let server = RedisServer::start();
    let url = server.url();
    let keys: Vec<Key> = (0..32).map(key).collect();
    let stored: Vec<Vec<bool>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..6)
            .map(|_| {
                let (url, keys) = (&url, &keys);
                scope.spawn(move || {
                    let store = backend(url);
                    let values: Vec<Vec<u8>> =
                        keys.iter().map(|k| value(k.0[0] as u32, 4096)).collect();
                    store.put_many(&entries(keys, &values)).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for i in 0..keys.len() {
        assert_eq!(stored.iter().filter(|s| s[i]).count(), 1, "block {i}");
    }
}

/// A put cut off mid-pipeline (its connection killed by the server) fails as unavailable and
/// leaves every block either absent or whole.
#[test]
fn a_put_whose_connection_drops_mid_call_is_unavailable_and_leaves_no_half_block() {
    let server = RedisServer::start();
    let store =
        RedisBackend::new(RedisOptions::new(server.url()).with_timeout(Duration::from_secs(10)))
            .unwrap();
    store.put_if_absent(&key(999), b"warm").unwrap();
    let (keys, values) = blocks(96, 1 << 20);
    let entries = entries(&keys, &values);
    let mut admin = server.connection();
    // writes are held by the server, so the put is surely in flight when its connection is
    // cut, however slowly the machine runs it (regression: under load the 96 MiB pipeline
    // could finish before the first cut, and the put succeeded)
    pause_writes(&mut admin, 10_000);
    let result = std::thread::scope(|scope| {
        let put = scope.spawn(|| store.put_many(&entries));
        while !put.is_finished() {
            std::thread::sleep(Duration::from_millis(15));
            cut_client_connections(&mut admin);
        }
        put.join().unwrap()
    });
    unpause(&mut admin);
    assert!(
        matches!(result, Err(StoreError::Unavailable(_))),
        "{:?}",
        result.map(|r| r.len())
    );
    let got = store.get_many(&keys).unwrap();
    for (i, v) in got.iter().enumerate() {
        if let Some(v) = v {
            assert_eq!(v, &values[i], "block {i} is whole");
        }
    }
}

/// Kills `server` while `read` runs, the server holding its answer (CLIENT PAUSE) so that the
/// read is surely in flight; the read must fail as Unavailable.
fn killed_mid_read<T: Send>(
    server: &mut RedisServer,
    read: impl FnOnce() -> Result<Vec<T>, StoreError> + Send,
) {
    let mut admin = server.connection();
    pause_clients(&mut admin, 10_000);
    let result = std::thread::scope(|scope| {
        let read = scope.spawn(read);
        std::thread::sleep(Duration::from_millis(100));
        server.kill();
        read.join().unwrap()
    });
    assert!(
        matches!(result, Err(StoreError::Unavailable(_))),
        "{:?}",
        result.map(|r| r.len())
    );
}

#[test]
fn killing_redis_during_a_read_is_unavailable_and_the_backend_recovers() {
    let mut server = RedisServer::start();
    let store = backend(&server.url());
    let (keys, values) = blocks(64, 1 << 20);
    store.put_many(&entries(&keys, &values)).unwrap();
    killed_mid_read(&mut server, || store.get_many(&keys));
    server.restart();
    assert_eq!(
        store.get_many(&keys[..1]).unwrap(),
        [None],
        "restarted empty"
    );
    store.put_if_absent(&keys[0], &values[0]).unwrap();
}

#[test]
fn memory_in_front_of_redis_promotes_hits_and_writes_through() {
    let server = RedisServer::start();
    let redis = Arc::new(backend(&server.url()));
    let near = Arc::new(MemoryBackend::new(None));
    let tiered = TieredBackend::new(vec![near.clone(), redis.clone()]).unwrap();
    tiered.put_if_absent(&key(1), b"both").unwrap();
    assert_eq!(redis.contains_many(&[key(1)]).unwrap(), [true]);
    assert_eq!(near.contains_many(&[key(1)]).unwrap(), [true]);
    // another machine's block is only in Redis until read here
    redis.put_if_absent(&key(2), b"remote").unwrap();
    assert_eq!(near.contains_many(&[key(2)]).unwrap(), [false]);
    assert_eq!(
        tiered.get_many(&[key(1), key(2)]).unwrap(),
        [Some(b"both".to_vec()), Some(b"remote".to_vec())]
    );
    assert_eq!(
        near.get_many(&[key(2)]).unwrap(),
        [Some(b"remote".to_vec())]
    );
}

/// Everything `visit_many` visits, as owned values.
fn visited(store: &RedisBackend, keys: &[Key]) -> Result<Vec<Option<Vec<u8>>>, StoreError> {
    let mut seen = Vec::new();
    store.visit_many(keys, &mut |_, v| {
        seen.push(v.map(<[u8]>::to_vec));
        true
    })?;
    Ok(seen)
}

/// One server without TLS is read by the bulk reader (its own connection, values straight into
/// one reused buffer): with an ACL user and a database of its own, after a stop mid-reply, and
/// the same values as `get_many` reads through the client.
#[test]
fn visit_many_on_a_plain_server_reads_off_its_own_connection_with_users_and_databases() {
    let server = RedisServer::start_with(ServerOptions {
        users: vec![AclUser {
            name: "worker".into(),
            password: "worker-pass".into(),
        }],
        ..Default::default()
    });
    let url = format!("{}/3", server.url_with("worker", "worker-pass"));
    let store = backend(&url);
    let (keys, values) = blocks(12, 300_000);
    store
        .put_many(&entries(&keys[..10], &values[..10]))
        .unwrap();
    let want = store.get_many(&keys).unwrap();
    assert_eq!(want.iter().flatten().count(), 10);
    assert_eq!(visited(&store, &keys).unwrap(), want);
    assert_eq!(store.client().bulk_reads(), 1);
    // database 3 holds them: the reader selected it
    let mut admin = server.connection();
    let in_db0: Option<Vec<u8>> = redis::cmd("GET")
        .arg(store.redis_key(&keys[0]))
        .query(&mut admin)
        .unwrap();
    assert_eq!(in_db0, None);
    // a visit stopped mid-reply drops that connection; the next reads whole again
    let mut calls = 0;
    store
        .visit_many(&keys, &mut |_, _| {
            calls += 1;
            calls < 3
        })
        .unwrap();
    assert_eq!(calls, 3);
    assert_eq!(visited(&store, &keys).unwrap(), want);
    assert_eq!(store.client().bulk_reads(), 2);
}

/// The bulk reader's failures are not answers: wrong credentials come back as the client's
/// Auth error, and a server killed mid-reply as Unavailable, after which reads recover.
#[test]
fn bulk_reads_refused_or_cut_mid_reply_fail_as_the_client_does() {
    let mut server = RedisServer::start_with(ServerOptions {
        requirepass: Some("fleet-pass".into()),
        ..Default::default()
    });
    let err = visited(&backend(&server.url_with("", "nope")), &[key(1)]).unwrap_err();
    assert!(matches!(err, StoreError::Auth(_)), "{err:?}");
    assert!(!err.to_string().contains("nope"), "no password in: {err}");

    let store = backend(&server.url_with("", "fleet-pass"));
    let (keys, values) = blocks(64, 1 << 20);
    store.put_many(&entries(&keys, &values)).unwrap();
    assert_eq!(visited(&store, &keys).unwrap().len(), 64);
    // a password without a user is the default user's, as the client sends it
    assert_eq!(store.client().bulk_reads(), 1);
    killed_mid_read(&mut server, || visited(&store, &keys));
    server.restart();
    store.put_many(&entries(&keys[..2], &values[..2])).unwrap();
    let after = visited(&store, &keys[..3]).unwrap();
    assert_eq!(
        after,
        [Some(values[0].clone()), Some(values[1].clone()), None]
    );
}

/// A server that holds its answer past the timeout fails the read within about the timeout:
/// the bulk reader's wait counts against the call, and the client is not asked again.
#[test]
fn a_bulk_read_the_server_does_not_answer_in_time_is_unavailable_within_the_timeout() {
    let server = RedisServer::start();
    let store = backend(&server.url());
    let (keys, values) = blocks(4, 1000);
    store.put_many(&entries(&keys, &values)).unwrap();
    let mut admin = server.connection();
    pause_clients(&mut admin, 6_000);
    let started = std::time::Instant::now();
    let err = visited(&store, &keys).unwrap_err();
    let took = started.elapsed();
    unpause(&mut admin);
    assert!(matches!(err, StoreError::Unavailable(_)), "{err:?}");
    assert!(
        took < Duration::from_millis(3500),
        "took {took:?} with a 2 s timeout"
    );
}
