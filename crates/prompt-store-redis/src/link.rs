//! [`Link`]: one logical connection that opens lazily and is opened again after it broke, and
//! for a cluster the map of which node serves which slot.
//!
//! The `redis` crate's `ConnectionManager` reconnects too, but only to a fixed address and
//! without a DNS resolver: a Sentinel deployment must ask the Sentinels for the primary on
//! every reconnect, and `servername` needs a resolver. So the connection is kept here: a
//! multiplexed connection (or a cluster connection) shared by every call, replaced when a call
//! finds it broken.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use redis::{RedisResult, Value};

use crate::connect::{Conn, Connector, HostPort};

/// The connection of one client.
pub(crate) struct Link {
    connector: Connector,
    /// The open connection and its generation (so a call that found connection 3 broken does
    /// not drop connection 4, which another call already opened).
    current: tokio::sync::Mutex<Option<(u64, Conn)>>,
    generations: AtomicU64,
    /// Cluster only: the slot map the last call used, until a redirect says it moved.
    slots: Mutex<Option<Arc<SlotMap>>>,
}

impl Link {
    pub(crate) fn new(connector: Connector) -> Link {
        Link {
            connector,
            current: tokio::sync::Mutex::new(None),
            generations: AtomicU64::new(0),
            slots: Mutex::new(None),
        }
    }

    /// The open connection, opened now if there is none (one attempt).
    pub(crate) async fn connection(&self) -> RedisResult<(u64, Conn)> {
        let mut current = self.current.lock().await;
        if let Some((generation, conn)) = current.as_ref() {
            return Ok((*generation, conn.clone()));
        }
        let conn = self.connector.connect().await?;
        let generation = self.generations.fetch_add(1, Ordering::Relaxed);
        *current = Some((generation, conn.clone()));
        Ok((generation, conn))
    }

    /// Drops connection `generation` after a call found it broken, so the next call opens a
    /// new one (for Sentinel: to whichever server is the primary now).
    pub(crate) async fn forget(&self, generation: u64) {
        let mut current = self.current.lock().await;
        if current.as_ref().is_some_and(|(g, _)| *g == generation) {
            *current = None;
        }
        self.forget_slots();
    }

    /// Drops the slot map after a redirect (`MOVED`, `ASK`): slots moved between nodes.
    pub(crate) fn forget_slots(&self) {
        *self.slots.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// The cluster's slot map, asked with `CLUSTER SLOTS` when none is known.
    pub(crate) async fn slot_map(&self, conn: &mut Conn) -> RedisResult<Arc<SlotMap>> {
        if let Some(map) = self.slots.lock().unwrap_or_else(|e| e.into_inner()).clone() {
            return Ok(map);
        }
        let reply: Value = redis::cmd("CLUSTER").arg("SLOTS").query_async(conn).await?;
        let map = Arc::new(SlotMap::parse(reply)?);
        *self.slots.lock().unwrap_or_else(|e| e.into_inner()) = Some(map.clone());
        Ok(map)
    }
}

/// Which primary serves each slot of a cluster.
#[derive(Debug)]
pub(crate) struct SlotMap {
    /// `(first slot, last slot, index into nodes)`, sorted by first slot.
    ranges: Vec<(u16, u16, usize)>,
    /// The primaries, each once.
    pub(crate) nodes: Vec<HostPort>,
}

impl SlotMap {
    /// Reads a `CLUSTER SLOTS` reply: `[[first, last, [host, port, id, ...], replicas...], ...]`.
    fn parse(reply: Value) -> RedisResult<SlotMap> {
        let bad = |what: &str| {
            redis::RedisError::from((
                redis::ErrorKind::Parse,
                "unexpected CLUSTER SLOTS reply",
                what.to_string(),
            ))
        };
        let Value::Array(entries) = reply else {
            return Err(bad("not an array"));
        };
        let mut map = SlotMap {
            ranges: Vec::with_capacity(entries.len()),
            nodes: Vec::new(),
        };
        for entry in entries {
            let Value::Array(fields) = entry else {
                return Err(bad("an entry is not an array"));
            };
            let (Some(Value::Int(first)), Some(Value::Int(last)), Some(Value::Array(primary))) =
                (fields.first(), fields.get(1), fields.get(2))
            else {
                return Err(bad("an entry lacks its range or primary"));
            };
            let (Some(host), Some(Value::Int(port))) = (primary.first(), primary.get(1)) else {
                return Err(bad("a primary lacks its address"));
            };
            let host = match host {
                Value::BulkString(bytes) => String::from_utf8_lossy(bytes).into_owned(),
                Value::SimpleString(text) => text.clone(),
                _ => return Err(bad("a primary's host is not a string")),
            };
            let (Ok(first), Ok(last), Ok(port)) = (
                u16::try_from(*first),
                u16::try_from(*last),
                u16::try_from(*port),
            ) else {
                return Err(bad("a slot or port is out of range"));
            };
            let node = HostPort { host, port };
            let index = match map.nodes.iter().position(|known| *known == node) {
                Some(index) => index,
                None => {
                    map.nodes.push(node);
                    map.nodes.len() - 1
                }
            };
            map.ranges.push((first, last, index));
        }
        map.ranges.sort_unstable();
        Ok(map)
    }

    /// The index (into `nodes`) of the primary that serves `key`, if the map covers its slot.
    pub(crate) fn node_of(&self, key: &[u8]) -> Option<usize> {
        let slot = key_slot(key);
        let at = self.ranges.partition_point(|&(first, _, _)| first <= slot);
        let (_, last, node) = *self.ranges.get(at.checked_sub(1)?)?;
        (slot <= last).then_some(node)
    }
}

/// The cluster slot of a key: CRC16 (XMODEM) of its hash tag (the text between the first `{`
/// and the next `}`, when not empty) or of the whole key, modulo 16384, as the cluster
/// specification defines it. (The `redis` crate computes it too but does not export it.)
fn key_slot(key: &[u8]) -> u16 {
    let tag = key.iter().position(|&b| b == b'{').and_then(|open| {
        let rest = &key[open + 1..];
        let close = rest.iter().position(|&b| b == b'}')?;
        (close > 0).then(|| &rest[..close])
    });
    crc16::State::<crc16::XMODEM>::calculate(tag.unwrap_or(key)) % 16384
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(first: i64, last: i64, host: &str, port: i64) -> Value {
        Value::Array(vec![
            Value::Int(first),
            Value::Int(last),
            Value::Array(vec![
                Value::BulkString(host.as_bytes().to_vec()),
                Value::Int(port),
                Value::BulkString(b"id".to_vec()),
            ]),
        ])
    }

    #[test]
    fn a_slot_map_finds_each_keys_primary() {
        let map = SlotMap::parse(Value::Array(vec![
            range(10923, 16383, "127.0.0.1", 7002),
            range(0, 5460, "127.0.0.1", 7000),
            range(5461, 10922, "127.0.0.1", 7001),
        ]))
        .unwrap();
        assert_eq!(map.nodes.len(), 3);
        // `CLUSTER KEYSLOT` answers 12182 for "foo" and 5061 for "bar" (and "{bar}.other")
        assert_eq!(map.nodes[map.node_of(b"foo").unwrap()].port, 7002);
        assert_eq!(map.nodes[map.node_of(b"bar").unwrap()].port, 7000);
        assert_eq!(map.nodes[map.node_of(b"{bar}.other").unwrap()].port, 7000);
    }

    #[test]
    fn key_slots_are_those_redis_computes() {
        assert_eq!(key_slot(b"foo"), 12182);
        assert_eq!(key_slot(b"bar"), 5061);
        assert_eq!(key_slot(b"{bar}.other"), 5061);
        assert_eq!(key_slot(b"{}bar"), key_slot(b"{}bar"));
        assert_ne!(
            key_slot(b"{}bar"),
            key_slot(b"bar"),
            "an empty tag hashes the whole key"
        );
    }

    #[test]
    fn a_slot_outside_the_map_has_no_node() {
        let map = SlotMap::parse(Value::Array(vec![range(0, 100, "h", 1)])).unwrap();
        assert_eq!(map.node_of(b"foo"), None);
    }

    #[test]
    fn a_malformed_reply_is_an_error() {
        assert!(SlotMap::parse(Value::Int(1)).is_err());
        assert!(SlotMap::parse(Value::Array(vec![Value::Array(vec![Value::Int(0)])])).is_err());
    }
}
