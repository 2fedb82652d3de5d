//! A blocking facade over the async Redis client: every call is one round trip (a single
//! command or one pipeline), bounded by the configured timeout, and classified into the few
//! failures a store cares about.

use std::cell::{Cell, RefCell};
use std::sync::Arc;
use std::time::Duration;

use redis::aio::ConnectionLike;
use redis::cluster_routing::RoutingInfo;
use redis::{ErrorKind, Pipeline, RedisError, RedisResult, Value};

use crate::bulk::BulkReader;
use crate::connect::{
    is_tls_error, redact_url, Conn, ConnectOptions, Connector, HostPort, Servers,
};
use crate::link::Link;
use crate::runtime::runtime;

/// How many `MGET`s [`RedisClient::visit_values`] splits its keys into: enough that the caller
/// works on one while the others arrive, few enough that each is a large read.
pub const MGET_PIECES: usize = 8;

/// Why a Redis call failed, in the terms a store acts on.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum ClientError {
    /// The URL or options do not parse or do not fit together. `what` names them without a
    /// password: `URL "redis://user:***@host"`, `Sentinel options "name"`, `Cluster options`.
    #[error("invalid Redis {what}: {reason}")]
    InvalidUrl { what: String, reason: String },
    /// Unreachable, refused, timed out, or the connection dropped mid-call.
    #[error("Redis at {address} is unavailable: {reason}")]
    Unavailable { address: String, reason: String },
    /// Wrong password or user, no credentials where they are required, or an ACL user that
    /// may not run the store's commands.
    #[error("Redis at {address} refused the credentials: {reason}")]
    Auth { address: String, reason: String },
    /// The TLS handshake failed: the server's certificate is not trusted or not for this name,
    /// or the server refused ours.
    #[error("Redis at {address} failed TLS: {reason}")]
    Tls { address: String, reason: String },
    /// The server is at `maxmemory` with a no-eviction policy and refuses writes.
    #[error("Redis at {address} is out of memory and does not evict: {reason}")]
    OutOfMemory { address: String, reason: String },
}

/// One logical client of a server, a Sentinel-managed primary or a cluster. It is created
/// without connecting, so a client made while the server is down starts working when the
/// server comes back; each call makes at most one connection attempt and fails fast instead
/// of waiting through a backoff.
#[derive(Clone)]
pub struct RedisClient {
    link: Arc<Link>,
    address: String,
    timeout: Duration,
    /// The reader of many values at once, for one server without TLS.
    bulk: Option<Arc<BulkReader>>,
}

/// What a failed request says about the connection it used.
enum Staleness {
    /// The connection broke, or (after a Sentinel failover) leads to a server that is no longer
    /// the primary: open a new one and send the request again.
    Reconnect,
    /// A cluster node answered that the slot lives elsewhere: ask for the slot map again.
    Reroute,
    /// The answer stands.
    Fresh,
}

fn staleness(err: &RedisError) -> Staleness {
    let codes = server_codes(err);
    let has = |wanted: &str| codes.iter().any(|code| code == wanted);
    if err.is_io_error() || err.is_connection_dropped() || has("READONLY") {
        Staleness::Reconnect
    } else if has("MOVED") || has("ASK") {
        Staleness::Reroute
    } else {
        Staleness::Fresh
    }
}

impl RedisClient {
    /// A client of one server by URL: `redis://[user[:password]@]host[:port][/db]`,
    /// `rediss://` or `redis+unix://`. `timeout` bounds every call: connecting plus the round
    /// trip.
    pub fn new(url: &str, timeout: Duration) -> Result<Self, ClientError> {
        Self::connect(&ConnectOptions::url(url, timeout))
    }

    /// A client for `options`; nothing is connected yet.
    pub fn connect(options: &ConnectOptions) -> Result<Self, ClientError> {
        let what = match &options.servers {
            Servers::Url(url) => format!("URL {:?}", redact_url(url)),
            Servers::Sentinel { name, .. } => format!("Sentinel options {name:?}"),
            Servers::Cluster { .. } => "Cluster options".into(),
        };
        let (connector, address) =
            Connector::new(options).map_err(|reason| ClientError::InvalidUrl { what, reason })?;
        let bulk = match (&options.servers, &options.tls) {
            (Servers::Url(url), None) => BulkReader::for_url(url, options.timeout).map(Arc::new),
            _ => None,
        };
        Ok(RedisClient {
            link: Arc::new(Link::new(connector)),
            address,
            timeout: options.timeout,
            bulk,
        })
    }

    /// The one server this client reaches over plain TCP or a Unix socket, if it is such a
    /// deployment (what the crate's own connections serve).
    pub(crate) fn plain_server(&self) -> Option<&crate::resp::Server> {
        self.bulk.as_ref().map(|b| b.server())
    }

    /// How many `visit_values` calls the bulk reader served whole (0 where there is none).
    pub fn bulk_reads(&self) -> u64 {
        self.bulk.as_ref().map_or(0, |b| b.served())
    }

    /// The server's address as error messages name it (never with a password).
    pub fn address(&self) -> &str {
        &self.address
    }

    /// Runs one request on the runtime and waits for its answer, within the timeout. Every
    /// request the store makes is idempotent (reads, `SET NX`), so one that failed on a stale
    /// connection is sent once more: on a new connection after it broke (a restarted server,
    /// a Sentinel failover), or with a new slot map after a cluster redirect.
    fn call<T, F, Fut>(&self, request: F) -> Result<T, ClientError>
    where
        F: Fn(Conn) -> Fut,
        Fut: std::future::Future<Output = RedisResult<T>>,
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
                let mut retried = false;
                loop {
                    let (generation, conn) = self.link.connection().await?;
                    let err = match request(conn).await {
                        Err(err) if !retried => err,
                        answer => return answer,
                    };
                    match staleness(&err) {
                        Staleness::Reconnect => self.link.forget(generation).await,
                        Staleness::Reroute => self.link.forget_slots(),
                        Staleness::Fresh => return Err(err),
                    }
                    retried = true;
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
        self.command(redis::cmd("PING")).map(drop)
    }

    /// Per key, the replies to the commands `build(pipeline, i)` adds for `keys[i]`, in one
    /// round trip: one pipeline to a single server; on a cluster, one pipeline per primary
    /// that holds some of the keys, all sent at once. A server error in any reply fails the
    /// call.
    pub fn per_key<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        build: impl Fn(&mut Pipeline, usize),
    ) -> Result<Vec<Vec<Value>>, ClientError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        self.call(|conn| self.per_key_on(conn, keys, &build))
    }

    async fn per_key_on<K: AsRef<[u8]>>(
        &self,
        mut conn: Conn,
        keys: &[K],
        build: &impl Fn(&mut Pipeline, usize),
    ) -> RedisResult<Vec<Vec<Value>>> {
        let groups: Vec<(Option<HostPort>, Vec<usize>)> = match conn {
            Conn::Single(_) => vec![(None, (0..keys.len()).collect())],
            Conn::Cluster(_) => {
                let map = self.link.slot_map(&mut conn).await?;
                let mut groups = vec![Vec::new(); map.nodes.len()];
                for (i, key) in keys.iter().enumerate() {
                    let Some(node) = map.node_of(key.as_ref()) else {
                        return Err(RedisError::from((
                            ErrorKind::Server(redis::ServerErrorKind::ClusterDown),
                            "no primary serves the slot of a key",
                        )));
                    };
                    groups[node].push(i);
                }
                map.nodes
                    .iter()
                    .cloned()
                    .map(Some)
                    .zip(groups)
                    .filter(|(_, group)| !group.is_empty())
                    .collect()
            }
        };
        let requests = groups.iter().map(|(node, indices)| {
            let mut pipeline = redis::pipe();
            let mut counts = Vec::with_capacity(indices.len());
            for &i in indices {
                let before = pipeline.len();
                build(&mut pipeline, i);
                counts.push(pipeline.len() - before);
            }
            let mut conn = conn.clone();
            async move {
                let n = pipeline.len();
                let replies = match (&mut conn, node) {
                    (Conn::Cluster(cluster), Some(node)) => {
                        cluster.route_pipeline(pipeline, 0, n, node.route()).await?
                    }
                    _ => conn.req_packed_commands(&pipeline, 0, n).await?,
                };
                Ok::<_, RedisError>((counts, replies))
            }
        });
        let answers = futures_util::future::try_join_all(requests).await?;
        let mut out = vec![Vec::new(); keys.len()];
        for ((_, indices), (counts, replies)) in groups.iter().zip(answers) {
            let mut replies = replies.into_iter();
            for (&i, count) in indices.iter().zip(counts) {
                out[i] = replies
                    .by_ref()
                    .take(count)
                    .map(Value::extract_error)
                    .collect::<RedisResult<_>>()?;
            }
        }
        Ok(out)
    }

    /// A `GET` of each key, in one pipeline per primary that holds some (a cluster's `MGET`
    /// may not cross slots): the replies per key.
    async fn gets_on<K: AsRef<[u8]>>(
        &self,
        conn: Conn,
        keys: &[K],
    ) -> RedisResult<Vec<Vec<Value>>> {
        let get = |pipe: &mut Pipeline, i: usize| {
            pipe.cmd("GET").arg(keys[i].as_ref());
        };
        self.per_key_on(conn, keys, &get).await
    }

    /// The value of every key in one round trip; a missing key (never written, expired or
    /// evicted) is `None`. One `MGET` on a server (pipelined `GET`s measured 0.70-0.85x of
    /// its speed for 128 values of 256 KiB); on a cluster, whose `MGET` may not cross slots,
    /// pipelined `GET`s, one pipeline per primary.
    pub fn get_many<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
    ) -> Result<Vec<Option<Vec<u8>>>, ClientError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let mut mget = redis::cmd("MGET");
        for key in keys {
            mget.arg(key.as_ref());
        }
        let values: Vec<Value> = self.call(|mut conn| {
            let mget = &mget;
            async move {
                match conn {
                    Conn::Single(_) => mget.query_async(&mut conn).await,
                    Conn::Cluster(_) => {
                        let replies = self.gets_on(conn, keys).await?;
                        Ok(replies.into_iter().flatten().collect())
                    }
                }
            }
        })?;
        Ok(values
            .into_iter()
            .map(|value| match value {
                Value::BulkString(bytes) => Some(bytes),
                _ => None,
            })
            .collect())
    }

    /// The values of `keys` as [`RedisClient::get_many`] reads them, handed to
    /// `visit(i, value)` in order as they arrive until it returns false. On a server the keys
    /// go in up to [`MGET_PIECES`] `MGET`s sent at once, each received on the runtime while
    /// the caller works on the values of the one before (a restore verifies and loads blocks
    /// meanwhile), so the reply buffers go to the caller without being gathered first; a
    /// cluster's pipelines of `GET` are visited as they complete. A retry after a stale
    /// connection asks only for the values not visited yet.
    ///
    /// One server over plain TCP or a Unix socket is read by a [`BulkReader`] instead (values
    /// straight into one reused buffer); what it could not read comes through the client.
    pub fn visit_values<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        visit: &mut dyn FnMut(usize, Option<&[u8]>) -> bool,
    ) -> Result<(), ClientError> {
        let mut from = 0;
        if let Some(bulk) = self
            .bulk
            .as_ref()
            .filter(|b| !keys.is_empty() && !b.paused())
        {
            let refs: Vec<&[u8]> = keys.iter().map(AsRef::as_ref).collect();
            let (visited, failure) = bulk.visit(&refs, visit);
            match failure {
                None => return Ok(()),
                // the call's time is spent: no second try
                Some(e) if e.kind() == std::io::ErrorKind::TimedOut => {
                    return Err(ClientError::Unavailable {
                        address: self.address.clone(),
                        reason: format!("no answer within {:?}", self.timeout),
                    })
                }
                Some(_) => from = visited,
            }
        }
        self.visit_values_via_client(&keys[from..], &mut |i, v| visit(from + i, v))
    }

    /// [`RedisClient::visit_values`] through the client's connection.
    fn visit_values_via_client<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        visit: &mut dyn FnMut(usize, Option<&[u8]>) -> bool,
    ) -> Result<(), ClientError> {
        let next = Cell::new(0);
        let stopped = Cell::new(false);
        let visit = RefCell::new(visit);
        // hands one reply to the visitor; false once it asked to stop
        let take = |value: &Value| {
            let i = next.get();
            next.set(i + 1);
            let bytes = match value {
                Value::BulkString(bytes) => Some(bytes.as_slice()),
                _ => None,
            };
            let go_on = (visit.borrow_mut())(i, bytes);
            stopped.set(!go_on);
            go_on
        };
        self.call(|conn| {
            let take = &take;
            let rest = &keys[next.get()..];
            let stop = stopped.get();
            async move {
                if stop || rest.is_empty() {
                    return Ok(());
                }
                let single = match conn {
                    Conn::Single(single) => single,
                    Conn::Cluster(_) => {
                        let replies = self.gets_on(conn, rest).await?;
                        replies.iter().flatten().all(take);
                        return Ok(());
                    }
                };
                let pieces: Vec<_> = rest
                    .chunks(rest.len().div_ceil(MGET_PIECES))
                    .map(|piece| {
                        let mut mget = redis::cmd("MGET");
                        for key in piece {
                            mget.arg(key.as_ref());
                        }
                        let mut conn = single.clone();
                        tokio::spawn(async move { mget.query_async::<Vec<Value>>(&mut conn).await })
                    })
                    .collect();
                for piece in pieces {
                    let values = piece.await.map_err(|e| {
                        RedisError::from(std::io::Error::other(format!("a read was lost: {e}")))
                    })??;
                    if !values.iter().all(take) {
                        break;
                    }
                }
                Ok(())
            }
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
        let last = head_len.max(1) as i64 - 1;
        Ok(self
            .per_key(keys, |pipe, i| {
                let key = keys[i].as_ref();
                pipe.cmd("STRLEN").arg(key);
                pipe.cmd("GETRANGE").arg(key).arg(0).arg(last);
            })?
            .into_iter()
            .map(|replies| {
                let mut replies = replies.into_iter();
                let length = match replies.next() {
                    Some(Value::Int(n)) => u64::try_from(n).unwrap_or(0),
                    _ => 0,
                };
                let head = match replies.next() {
                    Some(Value::BulkString(bytes)) => bytes,
                    _ => Vec::new(),
                };
                (length, head)
            })
            .collect())
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
        let ttl_ms = ttl.map(|ttl| ttl.as_millis().clamp(1, u64::MAX as u128) as u64);
        let refresh = only_if_absent && ttl_ms.is_some();
        let keys: Vec<&[u8]> = entries.iter().map(|(key, _)| *key).collect();
        Ok(self
            .per_key(&keys, |pipe, i| {
                let (key, value) = entries[i];
                let command = pipe.cmd("SET").arg(key).arg(value);
                if only_if_absent {
                    command.arg("NX");
                }
                if let Some(ms) = ttl_ms {
                    command.arg("PX").arg(ms);
                    if refresh {
                        pipe.cmd("PEXPIRE").arg(key).arg(ms);
                    }
                }
            })?
            .into_iter()
            .map(|replies| matches!(replies.first(), Some(Value::Okay)))
            .collect())
    }

    /// The number of keys matching `pattern` and the sum of their value lengths, over every
    /// primary: `SCAN` in pages of 1,000 keys with a pipelined `STRLEN` per page.
    pub fn scan_sizes(&self, pattern: &[u8]) -> Result<(u64, u64), ClientError> {
        let (mut keys, mut bytes) = (0u64, 0u64);
        for node in self.primaries()? {
            let mut cursor = 0u64;
            loop {
                let mut command = redis::cmd("SCAN");
                command
                    .arg(cursor)
                    .arg("MATCH")
                    .arg(pattern)
                    .arg("COUNT")
                    .arg(1000);
                let (next, page): (u64, Vec<Vec<u8>>) =
                    self.parse(self.command_on(node.as_ref(), command)?)?;
                for replies in self.per_key(&page, |pipe, i| {
                    pipe.cmd("STRLEN").arg(&page[i]);
                })? {
                    if let Some(Value::Int(len)) = replies.first() {
                        keys += 1;
                        bytes += u64::try_from(*len).unwrap_or(0);
                    }
                }
                if next == 0 {
                    break;
                }
                cursor = next;
            }
        }
        Ok((keys, bytes))
    }

    /// The `INFO` text of every primary (one for a single server).
    pub fn infos(&self) -> Result<Vec<String>, ClientError> {
        self.primaries()?
            .iter()
            .map(|node| self.parse(self.command_on(node.as_ref(), redis::cmd("INFO"))?))
            .collect()
    }

    /// Runs any command (routed by its key on a cluster): for tests and tools, not for the
    /// store's data path.
    pub fn command(&self, command: redis::Cmd) -> Result<Value, ClientError> {
        self.command_on(None, command)
    }

    /// Runs `command` on one cluster primary, or where the connection routes it (`None`).
    fn command_on(
        &self,
        node: Option<&HostPort>,
        command: redis::Cmd,
    ) -> Result<Value, ClientError> {
        self.call(|mut conn| {
            let command = &command;
            async move {
                match (&mut conn, node) {
                    (Conn::Cluster(cluster), Some(node)) => {
                        let route = RoutingInfo::SingleNode(node.route());
                        cluster.route_command(command.clone(), route).await
                    }
                    _ => command.query_async(&mut conn).await,
                }
            }
        })
    }

    /// The primaries to visit for a whole-database command: `[None]` (the one server) or each
    /// cluster primary.
    fn primaries(&self) -> Result<Vec<Option<HostPort>>, ClientError> {
        self.call(|mut conn| async move {
            Ok(match conn {
                Conn::Single(_) => vec![None],
                Conn::Cluster(_) => self
                    .link
                    .slot_map(&mut conn)
                    .await?
                    .nodes
                    .iter()
                    .cloned()
                    .map(Some)
                    .collect(),
            })
        })
    }

    /// A reply as `T`, or an error naming the server.
    fn parse<T: redis::FromRedisValue>(&self, reply: Value) -> Result<T, ClientError> {
        redis::from_redis_value(reply).map_err(|err| ClientError::Unavailable {
            address: self.address.clone(),
            reason: format!("unexpected reply: {err}"),
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
    if is_tls_error(err) {
        ClientError::Tls { address, reason }
    } else if err.kind() == ErrorKind::AuthenticationFailed
        || has(&["NOAUTH", "WRONGPASS", "NOPERM"])
    {
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
            ClientError::InvalidUrl { what, .. } => assert!(!what.contains("pw"), "{what}"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            RedisClient::new("http://host", Duration::from_secs(1)),
            Err(ClientError::InvalidUrl { .. })
        ));
    }
}
