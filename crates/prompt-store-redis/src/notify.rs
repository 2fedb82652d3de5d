//! A Redis server's own removals as KV events. The server evicts blocks at `maxmemory` and
//! expires them after a TTL without the store asking, so a router that learned of a block from
//! a `BlockStored` event would go on sending requests for it. While someone listens to a
//! store's events, a thread subscribes to the server's key-event notifications
//! (`__keyevent@<db>__:evicted` and `:expired`) on a connection of its own and reports each
//! removed block this store stored there (the tier remembers them), so another namespace's or
//! another machine's blocks are never named.
//!
//! The server sends these notifications only when `notify-keyspace-events` has `E`, `x` and
//! `e`: the listener adds what is missing with `CONFIG SET` (the setting only adds
//! notifications), and where the server refuses `CONFIG` (an ACL user without it, a managed
//! service) it listens all the same and hears what the operator enabled. One server over plain
//! TCP or a Unix socket only, as [`crate::bulk`]; the thread ends with the backend.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use prompt_store::events::TierEvents;
use prompt_store::Key;

use crate::resp::{Connection, Server};

/// How often a quiet listener looks whether it should stop.
const POLL: Duration = Duration::from_millis(250);

/// How long a listener waits before connecting again after a failure.
const RETRY: Duration = Duration::from_secs(1);

/// The notification classes a listener needs: key-event channels, expired, evicted.
const NEEDED: [char; 3] = ['E', 'x', 'e'];

/// Starts the listener of `server`'s removals of blocks stored under `prefix`, reporting to
/// `tier` until `stop` is set or the tier is gone.
/// `listening` is set while the listener is subscribed.
pub(crate) fn spawn(
    server: Server,
    prefix: Vec<u8>,
    tier: Weak<TierEvents>,
    stop: Arc<AtomicBool>,
    listening: Arc<AtomicBool>,
) {
    let run = move || {
        while !stop.load(Ordering::Relaxed) && tier.strong_count() > 0 {
            let outcome = listen(&server, &prefix, &tier, &stop, &listening);
            listening.store(false, Ordering::Relaxed);
            if outcome.is_err() {
                // a server down or restarted: try again, looking at `stop` meanwhile
                let mut waited = Duration::ZERO;
                while waited < RETRY && !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(POLL);
                    waited += POLL;
                }
            }
        }
    };
    // without a thread the events of the server's own removals are missing, nothing else
    let _ = std::thread::Builder::new()
        .name("kv-store-redis-events".into())
        .spawn(run);
}

/// Adds the notification classes the listener needs to the server's setting, where the server
/// lets it.
fn enable_notifications(conn: &mut Connection) -> io::Result<()> {
    conn.send_command(&[b"CONFIG", b"GET", b"notify-keyspace-events"])?;
    let flags = match conn.array() {
        Ok(reply) => reply.get(1).cloned().unwrap_or_default(),
        // refused (NOPERM, a renamed CONFIG): listen to what the operator enabled
        Err(e) if e.kind() == io::ErrorKind::Other => return Ok(()),
        Err(e) => return Err(e),
    };
    let flags = String::from_utf8_lossy(&flags).into_owned();
    // 'A' stands for every class but the channels' own ('K', 'E')
    let has = |c: char| flags.contains(c) || (c != 'E' && flags.contains('A'));
    let missing: String = NEEDED.iter().copied().filter(|&c| !has(c)).collect();
    if missing.is_empty() {
        return Ok(());
    }
    let wanted = format!("{flags}{missing}");
    conn.send_command(&[
        b"CONFIG",
        b"SET",
        b"notify-keyspace-events",
        wanted.as_bytes(),
    ])?;
    let mut line = Vec::new();
    match conn.line(&mut line) {
        Err(e) if e.kind() == io::ErrorKind::Other => Ok(()),
        other => other,
    }
}

/// One connection's life: subscribe, then report each removal until told to stop.
fn listen(
    server: &Server,
    prefix: &[u8],
    tier: &Weak<TierEvents>,
    stop: &AtomicBool,
    listening: &AtomicBool,
) -> io::Result<()> {
    let mut conn = server.open()?;
    enable_notifications(&mut conn)?;
    let db = server.db();
    let channels = [
        format!("__keyevent@{db}__:evicted"),
        format!("__keyevent@{db}__:expired"),
    ];
    conn.send_command(&[b"SUBSCRIBE", channels[0].as_bytes(), channels[1].as_bytes()])?;
    for _ in &channels {
        conn.array()?;
    }
    listening.store(true, Ordering::Relaxed);
    loop {
        if stop.load(Ordering::Relaxed) {
            return Ok(());
        }
        let Some(tier) = tier.upgrade() else {
            return Ok(());
        };
        // quiet: wait a little for a message, then look at `stop` again
        conn.set_read_timeout(POLL)?;
        match conn.readable() {
            Ok(()) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                continue
            }
            Err(e) => return Err(e),
        }
        conn.set_read_timeout(server.timeout())?;
        let message = conn.array()?;
        if let [kind, _channel, name] = &message[..] {
            let hex = name
                .strip_prefix(prefix)
                .and_then(|h| std::str::from_utf8(h).ok());
            if let (b"message", Some(key)) = (kind.as_slice(), hex.and_then(Key::from_hex)) {
                tier.evicted_key(&key);
            }
        }
    }
}
