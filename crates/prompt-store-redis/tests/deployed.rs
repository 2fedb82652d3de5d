//! Redis as it is deployed, with real servers: TLS (a CA and certificates made in the test),
//! a Sentinel-managed primary and replica with a failover mid-loop, a three-primary cluster.

mod common;

use std::time::{Duration, Instant};

use common::prompts::*;
use common::server::{start_cluster, RedisServer, ServerOptions, TestCerts};
use llama_kv_cache::SeedCache;
use prompt_store_redis::{
    ClientError, ConnectOptions, Credentials, HostPort, RedisClient, RedisOptions, Servers,
    TlsOptions,
};

const TIMEOUT: Duration = Duration::from_secs(2);

fn tls_server(certs: &TestCerts, auth_clients: bool) -> RedisServer {
    RedisServer::start_with(ServerOptions {
        tls: Some(certs.server(auth_clients)),
        ..ServerOptions::default()
    })
}

fn tls_client(url: &str, tls: TlsOptions) -> Result<(), ClientError> {
    RedisClient::connect(&ConnectOptions {
        tls: Some(tls),
        ..ConnectOptions::url(url, TIMEOUT)
    })?
    .ping()
}

fn trusting(certs: &TestCerts, ca: &str) -> TlsOptions {
    TlsOptions {
        ca: Some(certs.read(ca)),
        reject_unauthorized: true,
        ..TlsOptions::default()
    }
}

#[test]
fn tls_with_the_right_ca_works_and_a_wrong_ca_is_a_tls_error() {
    let certs = TestCerts::make();
    let server = tls_server(&certs, false);
    let url = server.tls_url("127.0.0.1");
    tls_client(&url, trusting(&certs, "ca.pem")).expect("the right CA");
    for wrong in [
        trusting(&certs, "other-ca.pem"),
        // no CA: Mozilla's roots, which do not hold the test CA
        TlsOptions {
            reject_unauthorized: true,
            ..TlsOptions::default()
        },
    ] {
        let err = tls_client(&url, wrong).unwrap_err();
        assert!(matches!(err, ClientError::Tls { .. }), "{err:?}");
    }
    // encrypted but not authenticated, as Node's rejectUnauthorized: false
    tls_client(
        &url,
        TlsOptions {
            ca: Some(certs.read("other-ca.pem")),
            reject_unauthorized: false,
            ..TlsOptions::default()
        },
    )
    .expect("rejectUnauthorized: false accepts any certificate");
}

#[test]
fn a_whole_store_round_trips_over_tls() {
    let certs = TestCerts::make();
    let server = tls_server(&certs, false);
    let options = RedisOptions {
        connect: ConnectOptions {
            tls: Some(trusting(&certs, "ca.pem")),
            ..ConnectOptions::url(server.tls_url("127.0.0.1"), TIMEOUT)
        },
        ..RedisOptions::new("")
    };
    let store = store_with(options);
    let tokens = prompt(48, 16, 0);
    let source = evaluated(&tokens, 0);
    assert_eq!(
        store.put(&source, 0, &tokens, None).unwrap().blocks_written,
        4
    );
    let mut restored = SeedCache::new(params()).unwrap();
    assert_eq!(store.restore(&mut restored, 0, &tokens, None).unwrap(), 64);
    assert_eq!(seq0_state(&restored), seq0_state(&source), "byte-exact");
}

#[test]
fn servername_is_the_name_checked_when_the_url_dials_another() {
    let certs = TestCerts::make();
    let server = tls_server(&certs, false);
    // the certificate names redis.test and 127.0.0.1, not localhost
    let url = server.tls_url("localhost");
    let err = tls_client(&url, trusting(&certs, "ca.pem")).unwrap_err();
    assert!(matches!(err, ClientError::Tls { .. }), "{err:?}");
    tls_client(
        &url,
        TlsOptions {
            servername: Some("redis.test".into()),
            ..trusting(&certs, "ca.pem")
        },
    )
    .expect("servername redis.test");
}

#[test]
fn a_server_that_asks_for_client_certificates_gets_ours() {
    let certs = TestCerts::make();
    let server = tls_server(&certs, true);
    let url = server.tls_url("127.0.0.1");
    let err = tls_client(&url, trusting(&certs, "ca.pem")).unwrap_err();
    assert!(
        matches!(
            err,
            ClientError::Tls { .. } | ClientError::Unavailable { .. }
        ),
        "{err:?}"
    );
    tls_client(
        &url,
        TlsOptions {
            cert: Some(certs.read("client.pem")),
            key: Some(certs.read("client.key")),
            ..trusting(&certs, "ca.pem")
        },
    )
    .expect("a client certificate the server's CA signed");
}

#[test]
fn tls_errors_name_the_server_and_never_the_password() {
    let certs = TestCerts::make();
    let server = tls_server(&certs, false);
    let url = server
        .tls_url("127.0.0.1")
        .replace("rediss://", "rediss://:hunter2secret@");
    let err = tls_client(&url, trusting(&certs, "other-ca.pem")).unwrap_err();
    let text = err.to_string();
    assert!(text.contains(&server.tls_url("127.0.0.1")[9..]), "{text}");
    assert!(!text.contains("hunter2secret"), "{text}");
    // tls options with a plain redis:// URL cannot mean what the caller wants
    let plain = ConnectOptions {
        tls: Some(trusting(&certs, "ca.pem")),
        ..ConnectOptions::url("redis://:hunter2secret@127.0.0.1:1", TIMEOUT)
    };
    let err = RedisClient::connect(&plain).err().expect("refused");
    assert!(matches!(err, ClientError::InvalidUrl { .. }), "{err:?}");
    assert!(!err.to_string().contains("hunter2secret"), "{err}");
}

/// A primary, a replica of it, and a Sentinel that watches them.
struct SentinelSetup {
    primary: RedisServer,
    replica: RedisServer,
    sentinel: RedisServer,
}

const SERVICE: &str = "kvtest";

impl SentinelSetup {
    fn start() -> SentinelSetup {
        let primary = RedisServer::start();
        let replica = RedisServer::start_with(ServerOptions {
            replica_of: Some(primary.port()),
            ..ServerOptions::default()
        });
        let sentinel = RedisServer::start_with(ServerOptions {
            sentinel_of: Some((SERVICE.into(), primary.port())),
            ..ServerOptions::default()
        });
        let setup = SentinelSetup {
            primary,
            replica,
            sentinel,
        };
        // the Sentinel learns of the replica from the primary's INFO, every 10 s at first
        setup.wait_until(
            "the sentinel to see the replica",
            Duration::from_secs(30),
            |s| {
                let replicas: Vec<redis::Value> = redis::cmd("SENTINEL")
                    .arg("REPLICAS")
                    .arg(SERVICE)
                    .query(&mut s.sentinel.connection())
                    .unwrap_or_default();
                !replicas.is_empty()
            },
        );
        // and the replica has finished its initial sync: until then `WAIT` counts no replica
        // (a loaded machine made this the slow step)
        setup.wait_until(
            "the replica's link to the primary",
            Duration::from_secs(60),
            |s| {
                let info: String = redis::cmd("INFO")
                    .arg("replication")
                    .query(&mut s.replica.connection())
                    .unwrap_or_default();
                info.lines().any(|l| l.trim() == "master_link_status:up")
            },
        );
        setup
    }

    fn wait_until(&self, what: &str, limit: Duration, done: impl Fn(&Self) -> bool) {
        let deadline = Instant::now() + limit;
        while !done(self) {
            assert!(Instant::now() < deadline, "waited too long for {what}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The port of the primary the Sentinel names, once no failover is in progress and it
    /// deems the primary up (`None` before that): the end of a failover window.
    fn settled_primary_port(&self) -> Option<u16> {
        let fields: std::collections::HashMap<String, String> = redis::cmd("SENTINEL")
            .arg("MASTER")
            .arg(SERVICE)
            .query(&mut self.sentinel.connection())
            .expect("SENTINEL MASTER");
        let flags = &fields["flags"];
        let settled = ["failover_in_progress", "s_down", "o_down"]
            .iter()
            .all(|flag| !flags.contains(flag));
        settled.then(|| fields["port"].parse().expect("a port"))
    }

    fn options(&self) -> RedisOptions {
        RedisOptions {
            connect: ConnectOptions {
                servers: Servers::Sentinel {
                    sentinels: vec![HostPort {
                        host: "127.0.0.1".into(),
                        port: self.sentinel.port(),
                    }],
                    name: SERVICE.into(),
                    db: 0,
                },
                credentials: Credentials::default(),
                tls: None,
                timeout: Duration::from_secs(1),
            },
            ..RedisOptions::new("")
        }
    }
}

#[test]
fn a_sentinel_failover_during_a_restore_loop_loses_no_call_beyond_the_failover_window() {
    let mut setup = SentinelSetup::start();
    let store = store_with(setup.options());
    let tokens = prompt(48, 16, 0);
    let source = evaluated(&tokens, 0);
    store.put(&source, 0, &tokens, None).unwrap();
    // the blocks reached the replica before the primary dies
    let synced: i64 = redis::cmd("WAIT")
        .arg(1)
        .arg(5000)
        .query(&mut setup.primary.connection())
        .unwrap();
    assert_eq!(synced, 1, "the replica acknowledged the writes");
    let expected = seq0_state(&source);
    let old_primary = setup.primary.port();
    let (mut failed_in_window, mut ok_after) = (0, 0);
    let deadline = Instant::now() + Duration::from_secs(60);
    for round in 0.. {
        if round == 5 {
            setup.primary.kill();
        }
        // whether the Sentinel had completed the failover before this call started
        let switched = setup
            .settled_primary_port()
            .is_some_and(|port| port != old_primary);
        let mut restored = SeedCache::new(params()).unwrap();
        match store.restore(&mut restored, 0, &tokens, None) {
            Ok(n) => {
                assert_eq!(n, 64);
                assert_eq!(
                    seq0_state(&restored),
                    expected,
                    "byte-exact in round {round}"
                );
                if switched {
                    ok_after += 1;
                }
            }
            Err(err) => {
                assert!(round >= 5, "round {round} failed before the kill: {err}");
                assert!(
                    !switched,
                    "round {round} started after the failover and failed: {err}"
                );
                failed_in_window += 1;
            }
        }
        if ok_after >= 20 {
            break;
        }
        assert!(Instant::now() < deadline, "no failover within 60 s");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(setup.settled_primary_port(), Some(setup.replica.port()));
    // the new primary takes writes from the same store, with no new client
    let more = prompt(48, 32, 1);
    store.put(&evaluated(&more, 0), 0, &more, None).unwrap();
    assert_eq!(store.lookup(&more).unwrap(), 80);
    eprintln!("calls lost inside the failover window: {failed_in_window}");
}

#[test]
fn a_three_primary_cluster_dedups_and_restores_across_slots() {
    let nodes = start_cluster(3);
    let options = RedisOptions {
        connect: ConnectOptions {
            servers: Servers::Cluster {
                nodes: vec![HostPort {
                    host: "127.0.0.1".into(),
                    port: nodes[0].port(),
                }],
            },
            credentials: Credentials::default(),
            tls: None,
            timeout: TIMEOUT,
        },
        ..RedisOptions::new("")
    };
    let (a, b) = (store_with(options.clone()), store_with(options));
    let tokens = prompt(128, 64, 0);
    let source = evaluated(&tokens, 0);
    let report = a.put(&source, 0, &tokens, None).unwrap();
    assert_eq!((report.blocks_written, report.tokens), (12, 192));
    // the blocks are spread: every primary holds some
    for node in &nodes {
        let keys: u64 = redis::cmd("DBSIZE").query(&mut node.connection()).unwrap();
        assert!(keys > 0, "node {} holds no block", node.port());
    }
    let mut restored = SeedCache::new(params()).unwrap();
    assert_eq!(b.restore(&mut restored, 0, &tokens, None).unwrap(), 192);
    assert_eq!(seq0_state(&restored), seq0_state(&source), "byte-exact");
    // dedup across slots: the same prompt writes nothing, a longer one only its new blocks
    let again = b.put(&source, 0, &tokens, None).unwrap();
    assert_eq!((again.blocks_written, again.blocks_skipped), (0, 12));
    let longer = prompt(128, 96, 0);
    let grown = b.put(&evaluated(&longer, 0), 0, &longer, None).unwrap();
    assert_eq!((grown.blocks_written, grown.blocks_skipped), (2, 12));
    assert_eq!(a.lookup(&longer).unwrap(), 224);
    let stats = a.stats().unwrap();
    assert!(
        stats.blocks >= 14,
        "every primary is counted: {}",
        stats.blocks
    );
}
