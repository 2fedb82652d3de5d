//! A plain RESP2 connection to one server, over TCP or a Unix socket, of the crate's own: what
//! the bulk reader ([`crate::bulk`]) and the eviction listener ([`crate::notify`]) speak where
//! the `redis` crate's client would copy every value or hide the server's pushes. Deployments
//! with TLS, Sentinel or Cluster are not served here; they go through the client.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::TcpStream;
#[cfg(unix)]
use std::os::unix::net::UnixStream;
use std::time::Duration;

use redis::{ConnectionAddr, IntoConnectionInfo};

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

/// One server, as a URL names it: where, which database, which credentials.
#[derive(Clone, Debug)]
pub(crate) struct Server {
    target: Target,
    db: i64,
    username: Option<String>,
    password: Option<String>,
    timeout: Duration,
}

/// One open connection, authenticated and on the right database.
pub(crate) struct Connection(BufReader<Socket>);

pub(crate) fn invalid(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

/// The decimal number of a reply header (after its type byte).
fn number(digits: &[u8]) -> io::Result<i64> {
    std::str::from_utf8(digits)
        .ok()
        .and_then(|d| d.parse().ok())
        .ok_or_else(|| invalid("a malformed reply header"))
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
    pub(crate) fn line(&mut self, line: &mut Vec<u8>) -> io::Result<()> {
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
    pub(crate) fn header(&mut self, kind: u8, line: &mut Vec<u8>) -> io::Result<i64> {
        self.line(line)?;
        match line.split_first() {
            Some((&k, digits)) if k == kind => number(digits),
            _ => Err(invalid(format!(
                "expected a '{}' reply, got {:?}",
                kind as char,
                String::from_utf8_lossy(line)
            ))),
        }
    }

    /// Returns once a reply has begun to arrive (or the read timeout passes: WouldBlock).
    pub(crate) fn readable(&mut self) -> io::Result<()> {
        if self.0.fill_buf()?.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the server closed the connection",
            ));
        }
        Ok(())
    }

    /// An array reply of bulk strings, integers and simple strings (integers and simple
    /// strings as their text; a null bulk string as empty).
    pub(crate) fn array(&mut self) -> io::Result<Vec<Vec<u8>>> {
        let mut line = Vec::new();
        let n = self.header(b'*', &mut line)?;
        let mut out = Vec::new();
        for _ in 0..n.max(0) {
            self.line(&mut line)?;
            match line.split_first() {
                Some((b'$', digits)) => {
                    let len = number(digits)?;
                    let mut value = Vec::new();
                    if let Ok(len) = usize::try_from(len) {
                        self.bulk_into(len, &mut value)?;
                    }
                    out.push(value);
                }
                Some((b':' | b'+', text)) => out.push(text.to_vec()),
                _ => return Err(invalid("an unexpected element in an array reply")),
            }
        }
        Ok(out)
    }

    /// Bounds the next reads by `t`.
    pub(crate) fn set_read_timeout(&self, t: Duration) -> io::Result<()> {
        self.0.get_ref().set_read_timeout(t)
    }

    /// The `len` bytes of a bulk string whose header was read, into `value` (its old contents
    /// replaced, its room reserved fallibly). A large value is read straight from the socket,
    /// past the small buffer.
    pub(crate) fn bulk_into(&mut self, len: usize, value: &mut Vec<u8>) -> io::Result<()> {
        value.clear();
        value
            .try_reserve(len + 2)
            .map_err(|_| invalid("a value too large to hold"))?;
        (&mut self.0).take(len as u64 + 2).read_to_end(value)?;
        if value.len() != len + 2 || !value.ends_with(b"\r\n") {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the connection closed mid-value",
            ));
        }
        value.truncate(len);
        Ok(())
    }

    /// Sends one command.
    pub(crate) fn send_command(&mut self, args: &[&[u8]]) -> io::Result<()> {
        let mut request = Vec::new();
        command(&mut request, args);
        self.send(&request)
    }

    fn send(&mut self, bytes: &[u8]) -> io::Result<()> {
        let socket = self.0.get_mut();
        socket.write_all(bytes)?;
        socket.flush()
    }
}

impl Server {
    /// The server `url` names, when it is reached over plain TCP or a Unix socket; `None` for
    /// TLS (and for a URL the client refuses, which it reports itself).
    pub(crate) fn for_url(url: &str, timeout: Duration) -> Option<Server> {
        let info = url.into_connection_info().ok()?;
        let target = match info.addr() {
            ConnectionAddr::Tcp(host, port) => Target::Tcp(host.clone(), *port),
            #[cfg(unix)]
            ConnectionAddr::Unix(path) => Target::Unix(path.clone()),
            _ => return None,
        };
        let settings = info.redis_settings();
        Some(Server {
            target,
            db: settings.db(),
            username: settings.username().map(str::to_owned),
            password: settings.password().map(str::to_owned),
            timeout,
        })
    }

    /// The database the URL selects.
    pub(crate) fn db(&self) -> i64 {
        self.db
    }

    /// The bound on each read and write.
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// A new connection, authenticated and on the URL's database; every read and write of it
    /// bounded by the timeout.
    pub(crate) fn open(&self) -> io::Result<Connection> {
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
}
