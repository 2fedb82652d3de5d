//! Many values read straight off a socket. The `redis` crate parses every bulk reply into a
//! buffer of its own, so a restore at the 8B geometry paid a copy and the page faults of
//! 256 MiB on top of the transfer (a raw `MGET` through it: 262 ms; the same bytes read into
//! one reused buffer: 201 ms). For one server reached over plain TCP or a Unix socket, a
//! restore's `MGET` goes over a connection of this module's own instead: a small RESP2 reader,
//! on a thread of the call, reads each value straight from the socket into one of a few
//! recycled buffers and hands it over, so the caller verifies and loads one value while the
//! next arrives. The 8B restore went from 467-528 ms to 291-297 ms.
//!
//! Everything else a store does, and every deployment this reader does not serve (TLS,
//! Sentinel, Cluster), goes through the client. A failure here is not an answer: the caller
//! reads the values not visited yet through the client, whose errors are the ones a store
//! reports, and this reader stays out of the way for a second.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Mutex};
use std::time::{Duration, Instant};

use crate::resp::{invalid, Connection, Server};

/// How long the reader stays out of the way after a failure.
const PAUSE: Duration = Duration::from_secs(1);

/// Connections kept between calls (a store restores a few prompts at once at most).
const KEPT: usize = 4;

/// Values received ahead of the one the caller works on.
const IN_FLIGHT: usize = 2;

/// Reads must end by `at`: the call's whole time, as the client bounds its calls.
struct Deadline {
    at: Instant,
}

impl Deadline {
    /// Bounds the next read of `conn` by what is left.
    fn arm(&self, conn: &mut Connection) -> io::Result<()> {
        let left = self.at.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the call took too long",
            ));
        }
        conn.set_read_timeout(left)
    }
}

/// The reader of one server's values; see the module docs.
pub struct BulkReader {
    server: Server,
    idle: Mutex<Vec<Connection>>,
    paused_until: Mutex<Option<Instant>>,
    /// Calls this reader served whole (for tests and stats).
    served: AtomicU64,
}

impl BulkReader {
    /// The reader of the server `url` names, when it is reached over plain TCP or a Unix
    /// socket; `None` for TLS (and for a URL the client refuses, which it reports itself).
    pub fn for_url(url: &str, timeout: Duration) -> Option<BulkReader> {
        Some(BulkReader {
            server: Server::for_url(url, timeout)?,
            idle: Mutex::default(),
            paused_until: Mutex::default(),
            served: AtomicU64::new(0),
        })
    }

    /// The server it reads.
    pub(crate) fn server(&self) -> &Server {
        &self.server
    }

    /// Calls this reader served whole.
    pub fn served(&self) -> u64 {
        self.served.load(Ordering::Relaxed)
    }

    /// Whether the reader is out of the way after a failure.
    pub fn paused(&self) -> bool {
        let mut until = self.paused_until.lock().unwrap_or_else(|p| p.into_inner());
        match *until {
            Some(t) if Instant::now() < t => true,
            Some(_) => {
                *until = None;
                false
            }
            None => false,
        }
    }

    /// `MGET keys`, each value handed to `visit(i, value)` in order as it arrives (`None`
    /// where absent) until `visit` returns false, within the timeout (connecting included).
    /// Returns how many values were visited, and the error that ended the call early, if any:
    /// `TimedOut` when the time is up, else the caller reads the rest elsewhere.
    pub fn visit(
        &self,
        keys: &[&[u8]],
        visit: &mut dyn FnMut(usize, Option<&[u8]>) -> bool,
    ) -> (usize, Option<io::Error>) {
        let deadline = Deadline {
            at: Instant::now() + self.server.timeout(),
        };
        let taken = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let mut conn = match taken.map_or_else(|| self.server.open(), Ok) {
            Ok(c) => c,
            Err(e) => return (0, Some(self.failed(e))),
        };
        // a thread of the call receives while the caller works on the value before: values
        // travel in buffers that come back to the receiver once visited
        let (full_tx, full_rx) = mpsc::sync_channel::<(usize, Option<Vec<u8>>)>(IN_FLIGHT);
        let (empty_tx, empty_rx) = mpsc::channel::<Vec<u8>>();
        let mut visited = 0;
        let (conn, outcome) = std::thread::scope(|scope| {
            let receiver = scope.spawn(move || {
                let outcome = Self::mget(
                    &mut conn,
                    &deadline,
                    keys,
                    &mut || empty_rx.try_recv().unwrap_or_default(),
                    &mut |i, v| full_tx.send((i, v)).is_ok(),
                );
                (conn, outcome)
            });
            for (i, value) in full_rx.iter() {
                visited = i + 1;
                let go_on = visit(i, value.as_deref());
                if let Some(buf) = value {
                    let _ = empty_tx.send(buf);
                }
                if !go_on {
                    // the receiver's next hand-over fails, and it stops
                    break;
                }
            }
            drop(full_rx);
            receiver
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        });
        match outcome {
            // a reply read whole leaves the connection ready for the next call
            Ok(true) if visited == keys.len() => {
                self.served.fetch_add(1, Ordering::Relaxed);
                let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
                if idle.len() < KEPT {
                    idle.push(conn);
                }
                (visited, None)
            }
            // the caller stopped: the rest of the reply may still be coming, so the connection goes
            Ok(_) => (visited, None),
            Err(e) => (visited, Some(self.failed(e))),
        }
    }

    fn failed(&self, e: io::Error) -> io::Error {
        // a socket's read timeout shows as WouldBlock on Unix
        let e = match e.kind() {
            io::ErrorKind::WouldBlock => io::Error::new(io::ErrorKind::TimedOut, e),
            _ => e,
        };
        *self.paused_until.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now() + PAUSE);
        self.idle.lock().unwrap_or_else(|p| p.into_inner()).clear();
        e
    }

    /// Sends `MGET` and hands each value of its reply to `deliver(i, value)` in a buffer from
    /// `buffer()`; `Ok(false)` when `deliver` refused one (the caller stopped).
    fn mget(
        conn: &mut Connection,
        deadline: &Deadline,
        keys: &[&[u8]],
        buffer: &mut dyn FnMut() -> Vec<u8>,
        deliver: &mut dyn FnMut(usize, Option<Vec<u8>>) -> bool,
    ) -> io::Result<bool> {
        let mut args: Vec<&[u8]> = Vec::with_capacity(keys.len() + 1);
        args.push(b"MGET");
        args.extend_from_slice(keys);
        conn.send_command(&args)?;
        let mut line = Vec::new();
        deadline.arm(conn)?;
        let n = conn.header(b'*', &mut line)?;
        if n != keys.len() as i64 {
            return Err(invalid(format!("{n} values for {} keys", keys.len())));
        }
        for i in 0..keys.len() {
            deadline.arm(conn)?;
            let len = conn.header(b'$', &mut line)?;
            let value = match usize::try_from(len) {
                Err(_) => None,
                Ok(len) => {
                    let mut value = buffer();
                    conn.bulk_into(len, &mut value)?;
                    Some(value)
                }
            };
            if !deliver(i, value) {
                return Ok(false);
            }
        }
        Ok(true)
    }
}
