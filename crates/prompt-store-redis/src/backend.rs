//! [`RedisBackend`]: the prompt store's [`Backend`] on Redis or Valkey.
//!
//! One Redis string per block under `{prefix}{hex chain key}`: a block is never split over two
//! keys, so an eviction removes a block whole. Every trait call is one round trip (one per
//! primary of a cluster, sent together): `MGET` (pipelined `GET` on a cluster, and with
//! `PEXPIRE` when a TTL is set), pipelined `EXISTS` or `SET NX`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Once};
use std::time::Duration;

use prompt_store::events::EventHub;
use prompt_store::{visit_each, Backend, Key, StoreError, StoreResult, Usage};
use redis::Value;

use crate::client::{ClientError, RedisClient};
use crate::connect::ConnectOptions;

/// The key prefix used when none is given.
pub const DEFAULT_PREFIX: &str = "llama-kv:";
/// How long one call may take (connecting included) when no timeout is given.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

/// How to reach and use Redis.
#[derive(Clone, Debug)]
pub struct RedisOptions {
    /// The server(s), credentials, TLS and the bound on each call, connecting included.
    pub connect: ConnectOptions,
    /// Namespace: every key starts with it, so several apps or models share one server.
    pub prefix: String,
    /// Expiry of a block, counted from its last write or read (`None`: kept until evicted).
    pub ttl: Option<Duration>,
}

impl RedisOptions {
    /// One server by URL (`redis://[user[:password]@]host[:port][/db]`, `rediss://`), with the
    /// default prefix, no TTL and the default timeout.
    pub fn new(url: impl Into<String>) -> RedisOptions {
        RedisOptions {
            connect: ConnectOptions::url(url, DEFAULT_TIMEOUT),
            prefix: DEFAULT_PREFIX.into(),
            ttl: None,
        }
    }

    /// The same options with another bound on each call.
    pub fn with_timeout(mut self, timeout: Duration) -> RedisOptions {
        self.connect.timeout = timeout;
        self
    }
}

impl From<ClientError> for StoreError {
    fn from(err: ClientError) -> StoreError {
        let message = err.to_string();
        match err {
            ClientError::InvalidUrl { .. } => StoreError::InvalidArg(message),
            ClientError::Unavailable { .. } => StoreError::Unavailable(message),
            ClientError::Auth { .. } => StoreError::Auth(message),
            ClientError::Tls { .. } => StoreError::Tls(message),
            ClientError::OutOfMemory { .. } => StoreError::NoSpace(message),
        }
    }
}

/// A [`Backend`] on a Redis (or Valkey) server shared by any number of processes and machines.
///
/// Created without connecting: a backend made while the server is down works once it is up.
/// A server that evicts blocks (`maxmemory` with an `allkeys-*` policy) or expires them (TTL)
/// just makes them absent: misses, never errors.
pub struct RedisBackend {
    client: RedisClient,
    prefix: Vec<u8>,
    ttl: Option<Duration>,
    /// Ends the listener of the server's own removals ([`crate::notify`]), if one started.
    listener_stop: Arc<AtomicBool>,
    /// Whether that listener is subscribed.
    listening: Arc<AtomicBool>,
}

/// The listener of the server's removals ends with the backend.
impl Drop for RedisBackend {
    fn drop(&mut self) {
        self.listener_stop.store(true, Ordering::Relaxed);
    }
}

impl RedisBackend {
    /// Parses the URL and sets up the (lazy) connection. Fails only on a malformed URL or
    /// options.
    pub fn new(options: RedisOptions) -> StoreResult<RedisBackend> {
        if options.connect.timeout.is_zero() {
            return Err(StoreError::InvalidArg(
                "the Redis timeout must be positive".into(),
            ));
        }
        if options.ttl.is_some_and(|ttl| ttl.as_millis() == 0) {
            return Err(StoreError::InvalidArg(
                "the Redis TTL must be at least 1 ms".into(),
            ));
        }
        Ok(RedisBackend {
            client: RedisClient::connect(&options.connect)?,
            prefix: options.prefix.into_bytes(),
            ttl: options.ttl,
            listener_stop: Arc::default(),
            listening: Arc::default(),
        })
    }

    /// Whether the listener of the server's own evictions and expiries is subscribed: from
    /// then on they become KV events (it starts when someone listens to the store's events).
    pub fn listening(&self) -> bool {
        self.listening.load(Ordering::Relaxed)
    }

    /// The client, for tools and tests that talk to the same server.
    pub fn client(&self) -> &RedisClient {
        &self.client
    }

    /// The Redis key of a block: the prefix, then the chain key in hex.
    pub fn redis_key(&self, key: &Key) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.prefix.len() + 64);
        out.extend_from_slice(&self.prefix);
        out.extend_from_slice(key.hex().as_bytes());
        out
    }

    fn redis_keys(&self, keys: &[Key]) -> Vec<Vec<u8>> {
        keys.iter().map(|key| self.redis_key(key)).collect()
    }

    fn ttl_ms(&self) -> Option<u64> {
        self.ttl
            .map(|ttl| ttl.as_millis().min(u64::MAX as u128) as u64)
    }
}

impl Backend for RedisBackend {
    fn name(&self) -> &'static str {
        "redis"
    }

    /// The server evicts and expires blocks on its own: while someone listens, a thread hears
    /// of it from the server's notifications ([`crate::notify`]; one server without TLS).
    fn observe(&self, hub: &Arc<EventHub>) {
        let Some(server) = self.client.plain_server().cloned() else {
            return;
        };
        let tier = hub.tier(self.name());
        tier.track_keys();
        let prefix = self.prefix.clone();
        let (stop, listening) = (self.listener_stop.clone(), self.listening.clone());
        let weak = Arc::downgrade(&tier);
        let started = Once::new();
        tier.on_wanted(Box::new(move || {
            started.call_once(|| {
                let (server, prefix, weak) = (server.clone(), prefix.clone(), weak.clone());
                crate::notify::spawn(server, prefix, weak, stop.clone(), listening.clone())
            })
        }));
    }

    /// Without a TTL, the values are visited as their replies arrive
    /// ([`RedisClient::visit_values`]); with one, each read also sets the expiry again, in
    /// [`Backend::get_many`]'s pipeline.
    fn visit_many(
        &self,
        keys: &[Key],
        visit: &mut dyn FnMut(usize, Option<&[u8]>) -> bool,
    ) -> StoreResult<()> {
        if self.ttl.is_none() {
            return Ok(self.client.visit_values(&self.redis_keys(keys), visit)?);
        }
        visit_each(&self.get_many(keys)?, visit);
        Ok(())
    }

    fn get_many(&self, keys: &[Key]) -> StoreResult<Vec<Option<Vec<u8>>>> {
        let redis_keys = self.redis_keys(keys);
        match self.ttl_ms() {
            None => Ok(self.client.get_many(&redis_keys)?),
            // a read keeps a block alive: it sets the expiry again, of keys that have one (the
            // model record has none and keeps none)
            Some(ttl) => {
                let replies = self.client.per_key(&redis_keys, |pipe, i| {
                    let key = &redis_keys[i];
                    pipe.cmd("GET").arg(key);
                    pipe.cmd("PEXPIRE").arg(key).arg(ttl).arg("XX");
                })?;
                Ok(replies
                    .into_iter()
                    .map(|replies| match replies.into_iter().next() {
                        Some(Value::BulkString(bytes)) => Some(bytes),
                        _ => None,
                    })
                    .collect())
            }
        }
    }

    /// `GETRANGE key -n -1` per key, pipelined: a missing key reads as an empty string.
    fn get_tails(&self, keys: &[Key], n: usize) -> StoreResult<Vec<Option<Vec<u8>>>> {
        let redis_keys = self.redis_keys(keys);
        Ok(self
            .client
            .per_key(&redis_keys, |pipe, i| {
                pipe.cmd("GETRANGE")
                    .arg(&redis_keys[i])
                    .arg(-(n as i64))
                    .arg(-1);
            })?
            .into_iter()
            .map(|replies| match replies.into_iter().next() {
                Some(Value::BulkString(bytes)) if bytes.len() == n => Some(bytes),
                _ => None,
            })
            .collect())
    }

    fn contains_many(&self, keys: &[Key]) -> StoreResult<Vec<bool>> {
        let redis_keys = self.redis_keys(keys);
        Ok(self
            .client
            .per_key(&redis_keys, |pipe, i| {
                pipe.cmd("EXISTS").arg(&redis_keys[i]);
            })?
            .into_iter()
            .map(|replies| matches!(replies.first(), Some(Value::Int(1))))
            .collect())
    }

    fn put_if_absent(&self, key: &Key, value: &[u8]) -> StoreResult<bool> {
        Ok(self
            .put_many(&[(*key, value)])?
            .first()
            .copied()
            .unwrap_or(false))
    }

    /// `SET NX`, with the TTL for every value but the store's small model record (which a
    /// process needs to look up prompts without a cache), so a fleet that reads but does not
    /// put keeps finding its blocks.
    fn put_many(&self, entries: &[(Key, &[u8])]) -> StoreResult<Vec<bool>> {
        let redis_keys: Vec<Vec<u8>> = entries.iter().map(|(k, _)| self.redis_key(k)).collect();
        let pairs: Vec<(&[u8], &[u8])> = redis_keys
            .iter()
            .zip(entries)
            .map(|(key, (_, value))| (key.as_slice(), *value))
            .collect();
        let (blocks, others): (Vec<usize>, Vec<usize>) =
            (0..pairs.len()).partition(|&i| !prompt_store::is_model_record(pairs[i].1));
        if self.ttl.is_none() || others.is_empty() {
            return Ok(self.client.set_nx_many(&pairs, self.ttl)?);
        }
        let mut stored = vec![false; pairs.len()];
        for (indices, ttl) in [(blocks, self.ttl), (others, None)] {
            let part: Vec<(&[u8], &[u8])> = indices.iter().map(|&i| pairs[i]).collect();
            for (i, written) in indices
                .into_iter()
                .zip(self.client.set_nx_many(&part, ttl)?)
            {
                stored[i] = written;
            }
        }
        Ok(stored)
    }

    fn remove(&self, key: &Key) -> StoreResult<()> {
        let mut command = redis::cmd("DEL");
        command.arg(self.redis_key(key));
        self.client.command(command)?;
        Ok(())
    }

    /// Counts the keys under the prefix (a `SCAN`: several round trips, proportional to the
    /// keys in the database) and reads the server's eviction count and `maxmemory`, which
    /// cover the whole server, not only this prefix.
    fn usage(&self) -> StoreResult<Usage> {
        let mut pattern = self.prefix.clone();
        pattern.push(b'*');
        let (blocks, bytes) = self.client.scan_sizes(&pattern)?;
        // a cluster's figures are the sums over its primaries
        let infos = self.client.infos()?;
        let field = |name: &str| -> u64 {
            infos
                .iter()
                .filter_map(|info| {
                    info.lines()
                        .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
                        .and_then(|value| value.trim().parse::<u64>().ok())
                })
                .sum()
        };
        Ok(Usage {
            blocks,
            bytes,
            evictions: field("evicted_keys"),
            max_bytes: Some(field("maxmemory")).filter(|&max| max > 0),
        })
    }
}
