//! The client against a real redis-server: round trips, typed failures, reconnection.

mod common;

use std::time::Duration;

use common::server::{AclUser, RedisServer, ServerOptions};
use prompt_store_redis::{ClientError, RedisClient};

const TIMEOUT: Duration = Duration::from_secs(2);

fn key(i: usize) -> Vec<u8> {
    format!("t:{i}").into_bytes()
}

#[test]
fn set_nx_writes_once_and_mget_reads_in_order_with_misses() {
    let server = RedisServer::start();
    let client = RedisClient::new(&server.url(), TIMEOUT).unwrap();
    client.ping().unwrap();
    let written = client
        .set_nx_many(&[(&key(0), b"a"), (&key(1), b"b")], None)
        .unwrap();
    assert_eq!(written, [true, true]);
    let again = client
        .set_nx_many(&[(&key(1), b"other"), (&key(2), b"c")], None)
        .unwrap();
    assert_eq!(again, [false, true], "an existing key is left as it was");
    let values = client.get_many(&[key(0), key(9), key(1), key(2)]).unwrap();
    assert_eq!(
        values,
        [
            Some(b"a".to_vec()),
            None,
            Some(b"b".to_vec()),
            Some(b"c".to_vec())
        ]
    );
    let heads = client.heads(&[key(1), key(9)], 4).unwrap();
    assert_eq!(heads, [(1, b"b".to_vec()), (0, Vec::new())]);
}

#[test]
fn ttl_expires_keys() {
    let server = RedisServer::start();
    let client = RedisClient::new(&server.url(), TIMEOUT).unwrap();
    client
        .set_nx_many(&[(&key(0), b"a")], Some(Duration::from_millis(50)))
        .unwrap();
    std::thread::sleep(Duration::from_millis(150));
    assert_eq!(client.get_many(&[key(0)]).unwrap(), [None]);
}

#[test]
fn a_client_made_while_redis_is_down_works_once_it_is_back() {
    let mut server = RedisServer::start();
    server.kill();
    let client = RedisClient::new(&server.url(), TIMEOUT).unwrap();
    let err = client.ping().unwrap_err();
    assert!(matches!(err, ClientError::Unavailable { .. }), "{err:?}");
    server.restart();
    client.ping().unwrap();
}

#[test]
fn a_restarted_server_is_reconnected_without_a_new_client() {
    let mut server = RedisServer::start();
    let client = RedisClient::new(&server.url(), TIMEOUT).unwrap();
    client.ping().unwrap();
    server.kill();
    assert!(matches!(
        client.get_many(&[key(0)]),
        Err(ClientError::Unavailable { .. })
    ));
    server.restart();
    // the connection broke while idle: the next call must not pay for it
    client.ping().unwrap();
}

#[test]
fn wrong_or_missing_password_is_an_auth_error() {
    let server = RedisServer::start_with(ServerOptions {
        requirepass: Some("right".into()),
        ..Default::default()
    });
    let good = RedisClient::new(&server.url_with("", "right"), TIMEOUT).unwrap();
    good.ping().unwrap();
    for url in [server.url_with("", "wrong"), server.url()] {
        let client = RedisClient::new(&url, TIMEOUT).unwrap();
        let err = client.ping().unwrap_err();
        assert!(matches!(err, ClientError::Auth { .. }), "{url}: {err:?}");
        assert!(!err.to_string().contains("wrong"), "no password in {err}");
    }
}

#[test]
fn acl_user_with_right_and_wrong_password() {
    let server = RedisServer::start_with(ServerOptions {
        users: vec![AclUser {
            name: "app".into(),
            password: "pw1".into(),
        }],
        ..Default::default()
    });
    RedisClient::new(&server.url_with("app", "pw1"), TIMEOUT)
        .unwrap()
        .ping()
        .unwrap();
    let err = RedisClient::new(&server.url_with("app", "nope"), TIMEOUT)
        .unwrap()
        .ping()
        .unwrap_err();
    assert!(matches!(err, ClientError::Auth { .. }), "{err:?}");
}

#[test]
fn unreachable_port_fails_fast_as_unavailable() {
    let server = RedisServer::start();
    let url = server.url();
    drop(server);
    let client = RedisClient::new(&url, TIMEOUT).unwrap();
    let started = std::time::Instant::now();
    assert!(matches!(
        client.ping(),
        Err(ClientError::Unavailable { .. })
    ));
    assert!(started.elapsed() < TIMEOUT, "{:?}", started.elapsed());
}

#[test]
fn a_server_that_does_not_answer_in_time_is_unavailable() {
    let server = RedisServer::start();
    let client = RedisClient::new(&server.url(), Duration::from_millis(300)).unwrap();
    client.ping().unwrap();
    let mut admin = server.connection();
    common::server::pause_clients(&mut admin, 3_000);
    let started = std::time::Instant::now();
    let err = client.ping().unwrap_err();
    assert!(
        matches!(&err, ClientError::Unavailable { reason, .. } if reason.contains("no answer within 300 ms")),
        "{err:?}"
    );
    assert!(
        started.elapsed() < Duration::from_millis(2_500),
        "{:?}",
        started.elapsed()
    );
}
