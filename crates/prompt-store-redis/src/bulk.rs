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

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::TcpStream;
#[cfg(unix)]
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Mutex};
use std::time::{Duration, Instant};

use redis::{ConnectionAddr, IntoConnectionInfo};

/// How long the reader stays out of the way after a failure.
const PAUSE: Duration = Duration::from_secs(1);

/// Connections kept between calls (a store restores a few prompts at once at most).
const KEPT: usize = 4;

/// Values received ahead of the one the caller works on.
const IN_FLIGHT: usize = 2;

/// The read buffer of a connection: headers come through it, large values bypass it.
const BUFFER: usize = 64 * 1024;

#[derive(Clone, Debug)]
enum Target {
    Tcp(String, u16),
    #[cfg(unix)]
    Unix(std::path::PathBuf),
}

enum Socket {
    Tcp(TcpStream),
    #[cfg(unix)]
    Unix(UnixStream),
}

impl Read for Socket {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Socket::Tcp(s) => s.read(buf),
            #[cfg(unix)]
            Socket::Unix(s) => s.read(buf),
        }
    }
}

impl Socket {
    fn set_read_timeout(&self, t: Duration) -> io::Result<()> {
        match self {
            Socket::Tcp(s) => s.set_read_timeout(Some(t)),
            #[cfg(unix)]
            Socket::Unix(s) => s.set_read_timeout(Some(t)),
        }
    }
}

impl Write for Socket {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Socket::Tcp(s) => s.write(buf),
            #[cfg(unix)]
            Socket::Unix(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Socket::Tcp(s) => s.flush(),
            #[cfg(unix)]
            Socket::Unix(s) => s.flush(),
        }
    }
}

/// One open connection, authenticated and on the right database.
struct Connection(BufReader<Socket>);

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
        conn.0.get_ref().set_read_timeout(left)
    }
}

/// The reader of one server's values; see the module docs.
pub struct BulkReader {
    target: Target,
    db: i64,
    username: Option<String>,
    password: Option<String>,
    timeout: Duration,
    idle: Mutex<Vec<Connection>>,
    paused_until: Mutex<Option<Instant>>,
    /// Calls this reader served whole (for tests and stats).
    served: AtomicU64,
}

fn invalid(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

/// A RESP2 command.
fn command(out: &mut Vec<u8>, args: &[&[u8]]) {
    out.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a);
        out.extend_from_slice(b"\r\n");
    }
}

impl Connection {
    /// One reply line without its CRLF; a server error (`-...`) is an error.
    fn line(&mut self, line: &mut Vec<u8>) -> io::Result<()> {
        line.clear();
        self.0.read_until(b'\n', line)?;
        if !line.ends_with(b"\r\n") {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the connection closed mid-reply",
            ));
        }
        line.truncate(line.len() - 2);
        if line.first() == Some(&b'-') {
            return Err(io::Error::other(
                String::from_utf8_lossy(&line[1..]).into_owned(),
            ));
        }
        Ok(())
    }

    /// The number after a reply's type byte `kind` (`*` array, `$` bulk string).
    fn header(&mut self, kind: u8, line: &mut Vec<u8>) -> io::Result<i64> {
        self.line(line)?;
        match line.split_first() {
            Some((&k, digits)) if k == kind => std::str::from_utf8(digits)
                .ok()
                .and_then(|d| d.parse().ok())
                .ok_or_else(|| invalid("a malformed reply header")),
            _ => Err(invalid(format!(
                "expected a '{}' reply, got {:?}",
                kind as char,
                String::from_utf8_lossy(line)
            ))),
        }
    }

    fn send(&mut self, bytes: &[u8]) -> io::Result<()> {
        let socket = self.0.get_mut();
        socket.write_all(bytes)?;
        socket.flush()
    }
}

impl BulkReader {
    /// The reader of the server `url` names, when it is reached over plain TCP or a Unix
    /// socket; `None` for TLS (and for a URL the client refuses, which it reports itself).
    pub fn for_url(url: &str, timeout: Duration) -> Option<BulkReader> {
        let info = url.into_connection_info().ok()?;
        let target = match info.addr() {
            ConnectionAddr::Tcp(host, port) => Target::Tcp(host.clone(), *port),
            #[cfg(unix)]
            ConnectionAddr::Unix(path) => Target::Unix(path.clone()),
            _ => return None,
        };
        let settings = info.redis_settings();
        Some(BulkReader {
            target,
            db: settings.db(),
            username: settings.username().map(str::to_owned),
            password: settings.password().map(str::to_owned),
            timeout,
            idle: Mutex::default(),
            paused_until: Mutex::default(),
            served: AtomicU64::new(0),
        })
    }

    /// Calls this reader served whole.
    pub fn served(&self) -> u64 {
        self.served.load(Ordering::Relaxed)
    }

    fn open(&self) -> io::Result<Connection> {
        let socket = match &self.target {
            Target::Tcp(host, port) => {
                let mut last = io::Error::new(io::ErrorKind::NotFound, "no address");
                let mut found = None;
                for addr in std::net::ToSocketAddrs::to_socket_addrs(&(host.as_str(), *port))? {
                    match TcpStream::connect_timeout(&addr, self.timeout) {
                        Ok(s) => {
                            found = Some(s);
                            break;
                        }
                        Err(e) => last = e,
                    }
                }
                let s = found.ok_or(last)?;
                s.set_nodelay(true)?;
                s.set_read_timeout(Some(self.timeout))?;
                s.set_write_timeout(Some(self.timeout))?;
                Socket::Tcp(s)
            }
            #[cfg(unix)]
            Target::Unix(path) => {
                let s = UnixStream::connect(path)?;
                s.set_read_timeout(Some(self.timeout))?;
                s.set_write_timeout(Some(self.timeout))?;
                Socket::Unix(s)
            }
        };
        let mut conn = Connection(BufReader::with_capacity(BUFFER, socket));
        let mut hello = Vec::new();
        let mut replies = 0;
        if let Some(password) = &self.password {
            match &self.username {
                Some(user) => command(&mut hello, &[b"AUTH", user.as_bytes(), password.as_bytes()]),
                None => command(&mut hello, &[b"AUTH", password.as_bytes()]),
            }
            replies += 1;
        }
        if self.db != 0 {
            command(&mut hello, &[b"SELECT", self.db.to_string().as_bytes()]);
            replies += 1;
        }
        if replies > 0 {
            conn.send(&hello)?;
            let mut line = Vec::new();
            for _ in 0..replies {
                conn.line(&mut line)?;
            }
        }
        Ok(conn)
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
            at: Instant::now() + self.timeout,
        };
        let taken = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let mut conn = match taken.map_or_else(|| self.open(), Ok) {
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
        let mut request = Vec::new();
        command(&mut request, &args);
        conn.send(&request)?;
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
                    value.clear();
                    value
                        .try_reserve(len + 2)
                        .map_err(|_| invalid("a value too large to hold"))?;
                    // a large value is read straight from the socket, past the small buffer
                    (&mut conn.0).take(len as u64 + 2).read_to_end(&mut value)?;
                    if value.len() != len + 2 || !value.ends_with(b"\r\n") {
                        return Err(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "the connection closed mid-value",
                        ));
                    }
                    value.truncate(len);
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
