//! A blocking facade over the async Redis client: every call is one round trip (a single
//! command or one pipeline), bounded by the configured timeout, and classified into the few
//! failures a store cares about.

use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{ErrorKind, RedisError, Value};

use crate::runtime::runtime;

/// Why a Redis call failed, in the terms a store acts on.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum ClientError {
    /// The URL does not parse or names a feature this build lacks (TLS, cluster).
    #[error("invalid Redis URL {url:?}: {reason}")]
    InvalidUrl { url: String, reason: String },
    /// Unreachable, refused, timed out, or the connection dropped mid-call.
    #[error("Redis at {address} is unavailable: {reason}")]
    Unavailable { address: String, reason: String },
    /// Wrong password or user, no credentials where they are required, or an ACL user that
    /// may not run the store's commands.
    #[error("Redis at {address} refused the credentials: {reason}")]
    Auth { address: String, reason: String },
    /// The server is at `maxmemory` with a no-eviction policy and refuses writes.
    #[error("Redis at {address} is out of memory and does not evict: {reason}")]
    OutOfMemory { address: String, reason: String },
}

/// One logical client: a self-reconnecting multiplexed connection (the `redis` crate's
/// `ConnectionManager`). It is created without connecting, so a client made while the server
/// is down starts working when the server comes back; each call makes at most one connection
/// attempt and fails fast instead of waiting through a backoff.
#[derive(Clone)]
pub struct RedisClient {
    connection: ConnectionManager,
    address: String,
    timeout: Duration,
}

/// The address and database of a URL, without its credentials (for error messages).
fn display_address(info: &redis::ConnectionInfo) -> String {
    format!("{}/{}", info.addr(), info.redis_settings().db())
}

/// A URL with any password replaced by `***`, so an error message never leaks it.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    match rest.rsplit_once('@') {
        Some((credentials, host)) => {
            let user = credentials.split_once(':').map_or(credentials, |(u, _)| u);
            format!("{scheme}://{user}:***@{host}")
        }
        None => url.to_string(),
    }
}

impl RedisClient {
    /// Parses `url` (`redis://[user[:password]@]host[:port][/db]`, or `redis+unix://`) and sets
    /// up the connection without opening it. `timeout` bounds every call: connecting plus the
    /// round trip.
    pub fn new(url: &str, timeout: Duration) -> Result<Self, ClientError> {
        let invalid = |reason: String| ClientError::InvalidUrl {
            url: redact_url(url),
            reason,
        };
        let client = redis::Client::open(url).map_err(|err| invalid(err.to_string()))?;
        let address = display_address(client.get_connection_info());
        let config = ConnectionManagerConfig::new()
            .set_number_of_retries(0)
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout));
        let runtime = runtime().map_err(|reason| ClientError::Unavailable {
            address: address.clone(),
            reason,
        })?;
        // the manager spawns its driver tasks on the runtime it finds in the current context
        let _context = runtime.enter();
        let connection = ConnectionManager::new_lazy_with_config(client, config)
            .map_err(|err| invalid(err.to_string()))?;
        Ok(RedisClient {
            connection,
            address,
            timeout,
        })
    }

    /// `host:port/db` of the server.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// Runs one command or pipeline on the runtime and waits for its answer, within the
    /// timeout. Every request the store makes is idempotent (reads, `SET NX`), so one that
    /// fails on a dead connection is sent once more on a fresh one: a connection that broke
    /// while idle (a restarted server) costs no failed call.
    fn call<T, F, Fut>(&self, request: F) -> Result<T, ClientError>
    where
        F: Fn(ConnectionManager) -> Fut,
        Fut: std::future::Future<Output = Result<T, RedisError>>,
    {
        let unavailable = |reason: String| ClientError::Unavailable {
            address: self.address.clone(),
            reason,
        };
        let runtime = runtime().map_err(unavailable)?;
        let timeout = self.timeout;
        // dropping the future on timeout abandons the request; a SET is atomic on the server,
        // so an abandoned write either landed whole or not at all
        let answer = runtime.block_on(async {
            tokio::time::timeout(timeout, async {
                match request(self.connection.clone()).await {
                    // the manager has started a new connection: wait for it
                    Err(err) if err.is_io_error() => request(self.connection.clone()).await,
                    other => other,
                }
            })
            .await
        });
        match answer {
            Err(_) => Err(unavailable(format!(
                "no answer within {} ms",
                timeout.as_millis()
            ))),
            Ok(result) => result.map_err(|err| classify(&self.address, &err)),
        }
    }

    /// One `PING`.
    pub fn ping(&self) -> Result<(), ClientError> {
        let command = redis::cmd("PING");
        self.call(|mut connection| {
            let command = &command;
            async move { command.query_async::<()>(&mut connection).await }
        })
    }

    /// `MGET` of every key in one round trip; a missing key (never written, expired or evicted)
    /// is `None`.
    pub fn get_many<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
    ) -> Result<Vec<Option<Vec<u8>>>, ClientError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let mut command = redis::cmd("MGET");
        for key in keys {
            command.arg(key.as_ref());
        }
        self.call(|mut connection| {
            let command = &command;
            async move { command.query_async(&mut connection).await }
        })
    }

    /// The length of each key's value and its first `head_len` bytes, pipelined in one round
    /// trip (`STRLEN` + `GETRANGE`): enough to check a value's header without fetching it. A
    /// missing key has length 0.
    pub fn heads<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        head_len: usize,
    ) -> Result<Vec<(u64, Vec<u8>)>, ClientError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipeline = redis::pipe();
        let last = head_len.max(1) as i64 - 1;
        for key in keys {
            pipeline.cmd("STRLEN").arg(key.as_ref());
            pipeline.cmd("GETRANGE").arg(key.as_ref()).arg(0).arg(last);
        }
        let replies: Vec<Value> = self.call(|mut connection| {
            let pipeline = &pipeline;
            async move { pipeline.query_async(&mut connection).await }
        })?;
        let mut out = Vec::with_capacity(keys.len());
        let mut replies = replies.into_iter();
        while let (Some(length), Some(head)) = (replies.next(), replies.next()) {
            let length = match length {
                Value::Int(n) => u64::try_from(n).unwrap_or(0),
                _ => 0,
            };
            let head = match head {
                Value::BulkString(bytes) => bytes,
                _ => Vec::new(),
            };
            out.push((length, head));
        }
        Ok(out)
    }

    /// `SET key value NX [PX ttl]` for every entry, pipelined in one round trip. Returns, per
    /// entry, whether it was written (`false`: the key already existed). With a TTL, an entry
    /// that existed gets its expiry set again (`PEXPIRE`): a block that is put again stays.
    pub fn set_nx_many(
        &self,
        entries: &[(&[u8], &[u8])],
        ttl: Option<Duration>,
    ) -> Result<Vec<bool>, ClientError> {
        self.set_many(entries, ttl, true)
    }

    /// Pipelined `SET`, `NX` when `only_if_absent` (else the plain overwriting `SET` that the
    /// benchmarks use as the raw baseline).
    pub fn set_many(
        &self,
        entries: &[(&[u8], &[u8])],
        ttl: Option<Duration>,
        only_if_absent: bool,
    ) -> Result<Vec<bool>, ClientError> {
        if entries.is_empty() {
            return Ok(Vec::new());
        }
        let ttl_ms = ttl.map(|ttl| ttl.as_millis().clamp(1, u64::MAX as u128) as u64);
        let refresh = only_if_absent && ttl_ms.is_some();
        let mut pipeline = redis::pipe();
        for (key, value) in entries {
            let command = pipeline.cmd("SET").arg(*key).arg(*value);
            if only_if_absent {
                command.arg("NX");
            }
            if let Some(ms) = ttl_ms {
                command.arg("PX").arg(ms);
                if refresh {
                    pipeline.cmd("PEXPIRE").arg(*key).arg(ms).ignore();
                }
            }
        }
        let replies: Vec<Value> = self.call(|mut connection| {
            let pipeline = &pipeline;
            async move { pipeline.query_async(&mut connection).await }
        })?;
        Ok(replies
            .into_iter()
            .map(|reply| matches!(reply, Value::Okay))
            .collect())
    }

    /// One command per key, built by `build`, pipelined in one round trip; the raw replies in
    /// order.
    pub fn pipeline_each<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        build: impl Fn(&mut redis::Pipeline, &[u8]),
    ) -> Result<Vec<Value>, ClientError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipeline = redis::pipe();
        for key in keys {
            build(&mut pipeline, key.as_ref());
        }
        self.call(|mut connection| {
            let pipeline = &pipeline;
            async move { pipeline.query_async(&mut connection).await }
        })
    }

    /// The number of keys matching `pattern` and the sum of their value lengths: `SCAN` in
    /// pages of 1,000 keys with a pipelined `STRLEN` per page.
    pub fn scan_sizes(&self, pattern: &[u8]) -> Result<(u64, u64), ClientError> {
        let (mut keys, mut bytes) = (0u64, 0u64);
        let mut cursor = 0u64;
        loop {
            let mut command = redis::cmd("SCAN");
            command
                .arg(cursor)
                .arg("MATCH")
                .arg(pattern)
                .arg("COUNT")
                .arg(1000);
            let (next, page): (u64, Vec<Vec<u8>>) = self.call(|mut connection| {
                let command = &command;
                async move { command.query_async(&mut connection).await }
            })?;
            for reply in self.pipeline_each(&page, |pipe, key| {
                pipe.cmd("STRLEN").arg(key);
            })? {
                if let Value::Int(len) = reply {
                    keys += 1;
                    bytes += u64::try_from(len).unwrap_or(0);
                }
            }
            if next == 0 {
                return Ok((keys, bytes));
            }
            cursor = next;
        }
    }

    /// The server's `INFO` text.
    pub fn info(&self) -> Result<String, ClientError> {
        let command = redis::cmd("INFO");
        self.call(|mut connection| {
            let command = &command;
            async move { command.query_async(&mut connection).await }
        })
    }

    /// Runs any command: for tests and tools, not for the store's data path.
    pub fn command(&self, command: redis::Cmd) -> Result<Value, ClientError> {
        self.call(|mut connection| {
            let command = &command;
            async move { command.query_async(&mut connection).await }
        })
    }
}

/// The server error codes in `err`: its own, or those of the failed commands of a pipeline.
fn server_codes(err: &RedisError) -> Vec<String> {
    let mut codes: Vec<String> = err.code().map(str::to_string).into_iter().collect();
    if let Some(items) = err.clone().into_server_errors() {
        codes.extend(items.iter().map(|(_, item)| item.code().to_string()));
    }
    codes
}

/// Sorts a client error into the store's failure kinds.
fn classify(address: &str, err: &RedisError) -> ClientError {
    let reason = err.to_string();
    let address = address.to_string();
    let codes = server_codes(err);
    let has = |wanted: &[&str]| codes.iter().any(|code| wanted.contains(&code.as_str()));
    if err.kind() == ErrorKind::AuthenticationFailed || has(&["NOAUTH", "WRONGPASS", "NOPERM"]) {
        ClientError::Auth { address, reason }
    } else if has(&["OOM"]) {
        ClientError::OutOfMemory { address, reason }
    } else {
        // I/O errors, timeouts, dropped connections, a server still loading, a replica that
        // refuses writes: all "cannot use the store now", and the caller's data is untouched
        ClientError::Unavailable { address, reason }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redact_url_hides_the_password_only() {
        assert_eq!(
            redact_url("redis://alice:s3cret@host:6379/2"),
            "redis://alice:***@host:6379/2"
        );
        assert_eq!(redact_url("redis://:s3cret@host"), "redis://:***@host");
        assert_eq!(redact_url("redis://host:6379"), "redis://host:6379");
    }

    #[test]
    fn an_unparsable_url_is_invalid_and_its_password_is_not_echoed() {
        let err = RedisClient::new("redis://u:pw@", Duration::from_secs(1))
            .err()
            .expect("refused");
        match err {
            ClientError::InvalidUrl { url, .. } => assert!(!url.contains("pw"), "{url}"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            RedisClient::new("http://host", Duration::from_secs(1)),
            Err(ClientError::InvalidUrl { .. })
        ));
    }
}
