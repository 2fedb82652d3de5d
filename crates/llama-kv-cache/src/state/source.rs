//! Where the state parsers read from: a byte slice in memory, or a file read in small pieces.
//! The parsers ([`crate::state::parse_payload`], [`crate::state::parts::parse_parts`],
//! [`crate::state::files::inspect_source`]) read the small fields (counts, cells, types, row sizes) and
//! only step over K/V rows, so describing a file of any size reads a few KiB of it.

use std::cell::{Cell, RefCell};
use std::fmt;
use std::io::{Read, Seek, SeekFrom};
use std::ops::Range;
use std::sync::mpsc;

use crate::error::{KvError, Result};

/// Random access to a fixed number of bytes.
pub trait ByteSource {
    /// Bytes available.
    fn len(&self) -> usize;
    /// Whether there are no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copies the bytes at `pos..pos + dst.len()` (inside `0..len()`, checked by the caller).
    fn read_at(&self, pos: usize, dst: &mut [u8]) -> Result<()>;
    /// At least the `want` bytes at `pos` (inside `0..len()`, checked by the caller), read into
    /// `scratch` where they are not in memory already. A source in memory lends every byte
    /// from `pos` on without copying.
    fn window<'s>(&'s self, pos: usize, want: usize, scratch: &'s mut Vec<u8>) -> Result<&'s [u8]> {
        scratch.clear();
        scratch.try_reserve_exact(want).map_err(|_| {
            KvError::Backend(format!("cannot allocate {want} bytes to read a state"))
        })?;
        scratch.resize(want, 0);
        self.read_at(pos, scratch)?;
        Ok(scratch)
    }
}

impl ByteSource for [u8] {
    fn len(&self) -> usize {
        <[u8]>::len(self)
    }

    #[inline]
    fn read_at(&self, pos: usize, dst: &mut [u8]) -> Result<()> {
        dst.copy_from_slice(&self[pos..pos + dst.len()]);
        Ok(())
    }

    fn window<'s>(&'s self, pos: usize, _: usize, _: &'s mut Vec<u8>) -> Result<&'s [u8]> {
        Ok(&self[pos..])
    }
}

/// The bytes `range` of another source, addressed from 0.
pub struct Sub<'a, S: ?Sized> {
    src: &'a S,
    start: usize,
    len: usize,
}

impl<'a, S: ByteSource + ?Sized> Sub<'a, S> {
    /// `range` of `src` (clamped to its length).
    pub fn new(src: &'a S, range: Range<usize>) -> Self {
        let end = range.end.min(src.len());
        let start = range.start.min(end);
        Sub {
            src,
            start,
            len: end - start,
        }
    }
}

impl<S: ByteSource + ?Sized> ByteSource for Sub<'_, S> {
    fn len(&self) -> usize {
        self.len
    }

    #[inline]
    fn read_at(&self, pos: usize, dst: &mut [u8]) -> Result<()> {
        self.src.read_at(self.start + pos, dst)
    }

    fn window<'s>(&'s self, pos: usize, want: usize, scratch: &'s mut Vec<u8>) -> Result<&'s [u8]> {
        let bytes = self.src.window(self.start + pos, want, scratch)?;
        Ok(&bytes[..bytes.len().min(self.len - pos)])
    }
}

/// Bytes a [`ReadSource`] reads at once: small, because the fields a parser wants are spread
/// over the file (one K/V header per layer between megabytes of rows).
const READ_CHUNK: usize = 4096;

/// A `Read + Seek` (a file) as a [`ByteSource`]: reads go through a small buffer, and bytes
/// that nothing asks for (K/V rows a parser steps over) are never read.
pub struct ReadSource<R> {
    inner: RefCell<R>,
    len: usize,
    name: String,
    /// The buffered bytes and the position of their first byte.
    buf: RefCell<(usize, Vec<u8>)>,
    bytes_read: Cell<u64>,
}

impl<R: Read + Seek> ReadSource<R> {
    /// Wraps `inner`, whose length is `len`; `name` (a path) goes into error messages.
    pub fn new(inner: R, len: u64, name: impl fmt::Display) -> Result<Self> {
        let len = usize::try_from(len).map_err(|_| {
            KvError::InvalidArg(format!(
                "{name}: {len} bytes exceed this platform's address space"
            ))
        })?;
        Ok(ReadSource {
            inner: RefCell::new(inner),
            len,
            name: name.to_string(),
            buf: RefCell::new((0, Vec::new())),
            bytes_read: Cell::new(0),
        })
    }

    /// The reader.
    pub fn into_inner(self) -> R {
        self.inner.into_inner()
    }

    /// Bytes read from the underlying reader so far.
    pub fn bytes_read(&self) -> u64 {
        self.bytes_read.get()
    }

    fn fill(&self, pos: usize, want: usize) -> Result<()> {
        let io = |e: std::io::Error| KvError::Io(format!("cannot read {}: {e}", self.name));
        let n = want.max(READ_CHUNK).min(self.len - pos);
        let mut buf = self.buf.borrow_mut();
        let mut inner = self.inner.borrow_mut();
        buf.1.clear();
        buf.1.try_reserve_exact(n).map_err(|_| {
            KvError::Backend(format!("cannot allocate {n} bytes to read {}", self.name))
        })?;
        buf.1.resize(n, 0);
        inner.seek(SeekFrom::Start(pos as u64)).map_err(io)?;
        inner.read_exact(&mut buf.1).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                KvError::Io(format!(
                    "cannot read {}: it shrank while being read",
                    self.name
                ))
            } else {
                io(e)
            }
        })?;
        buf.0 = pos;
        self.bytes_read.set(self.bytes_read.get() + n as u64);
        Ok(())
    }
}

/// What [`read_ahead`] calls on its reading thread: puts piece `i` into the buffer, or says
/// there is none.
pub type PieceReader<'a, E> =
    dyn Fn(usize, &mut Vec<u8>) -> std::result::Result<bool, E> + Sync + 'a;

/// Reads ahead on a second thread: `read(i, buf)` puts piece `i` into `buf` (false: there is
/// no such piece) for `i` in `0..n`, in order, while `visit(i, piece)` works on the piece
/// before it on the calling thread, until it returns false. Two buffers go back and forth, so
/// at most two pieces are in memory, and on two cores the copy out of the page cache overlaps
/// the caller's work on the previous piece. A read error ends the call (the pieces before it
/// were visited). Fewer than two pieces, or no thread to be had from the OS, are read on the
/// calling thread.
pub fn read_ahead<E: Send>(
    n: usize,
    read: &PieceReader<'_, E>,
    visit: &mut dyn FnMut(usize, Option<&[u8]>) -> bool,
) -> std::result::Result<(), E> {
    // one piece after the other on this thread: few pieces, or no thread to be had
    let in_turn = |visit: &mut dyn FnMut(usize, Option<&[u8]>) -> bool| {
        let mut buf = Vec::new();
        for i in 0..n {
            let found = read(i, &mut buf)?;
            if !visit(i, found.then_some(buf.as_slice())) {
                break;
            }
        }
        Ok(())
    };
    if n < 2 {
        return in_turn(visit);
    }
    std::thread::scope(|scope| {
        let (give, empty) = mpsc::sync_channel::<Vec<u8>>(2);
        let (send, filled) = mpsc::sync_channel::<(std::result::Result<bool, E>, Vec<u8>)>(1);
        let reader = std::thread::Builder::new()
            .name("kv-read-ahead".into())
            .spawn_scoped(scope, move || {
                for i in 0..n {
                    let Ok(mut buf) = empty.recv() else { return };
                    let found = read(i, &mut buf);
                    let failed = found.is_err();
                    if send.send((found, buf)).is_err() || failed {
                        return;
                    }
                }
            });
        if reader.is_err() {
            return in_turn(visit);
        }
        for _ in 0..2 {
            // the reader holds the receiver until it is done: a send cannot fail here
            let _ = give.send(Vec::new());
        }
        for i in 0..n {
            let Ok((found, buf)) = filled.recv() else {
                break;
            };
            if !visit(i, found?.then_some(buf.as_slice())) {
                break;
            }
            // the reader may be done (the last pieces are in flight): nothing to give back
            let _ = give.send(buf);
        }
        // returning drops both channels: a reader still waiting for a buffer stops
        Ok(())
    })
}

impl ReadSource<std::fs::File> {
    /// Opens the file at `path`.
    pub fn open(path: &std::path::Path) -> Result<Self> {
        let io = |e: std::io::Error| KvError::Io(format!("cannot read {}: {e}", path.display()));
        let file = std::fs::File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        ReadSource::new(file, len, path.display())
    }
}

impl<R: Read + Seek> ByteSource for ReadSource<R> {
    fn len(&self) -> usize {
        self.len
    }

    fn read_at(&self, pos: usize, dst: &mut [u8]) -> Result<()> {
        let hit = {
            let buf = self.buf.borrow();
            pos >= buf.0 && pos + dst.len() <= buf.0 + buf.1.len()
        };
        if !hit {
            self.fill(pos, dst.len())?;
        }
        let buf = self.buf.borrow();
        let at = pos - buf.0;
        dst.copy_from_slice(&buf.1[at..at + dst.len()]);
        Ok(())
    }
}

/// The error of a payload that ends at byte `pos`, in the field `what` of `n` bytes.
pub(crate) fn truncated(pos: usize, what: impl fmt::Display, n: usize, left: usize) -> KvError {
    KvError::InvalidState(format!(
        "truncated at byte {pos} reading {what} ({n} bytes needed, {left} left)"
    ))
}

/// Little-endian cursor over a [`ByteSource`]; every read names what it was reading. The name is
/// only formatted when a read fails (pass `format_args!` in loops), so the success path does no
/// string work.
pub(crate) struct Cursor<'a, S: ?Sized = [u8]> {
    pub src: &'a S,
    pub pos: usize,
    /// Whether `src` may be only the start of the payload (a streamed load's first bytes):
    /// bounds that need the payload's length are left to the caller.
    pub partial: bool,
    /// Whether a read failed for want of bytes: for a partial source, "wait for more".
    pub ran_out: bool,
}

impl<'a, S: ByteSource + ?Sized> Cursor<'a, S> {
    pub fn new(src: &'a S) -> Self {
        Cursor {
            src,
            pos: 0,
            partial: false,
            ran_out: false,
        }
    }

    /// A cursor over the first bytes of a payload that is still arriving.
    pub fn partial(src: &'a S) -> Self {
        Cursor {
            partial: true,
            ..Cursor::new(src)
        }
    }

    /// Advances over `n` bytes, which must be there; returns where they start.
    fn advance(&mut self, n: usize, what: impl fmt::Display) -> Result<usize> {
        let len = self.src.len();
        let end = self.pos.checked_add(n).filter(|&e| e <= len);
        let Some(end) = end else {
            self.ran_out = true;
            return Err(truncated(self.pos, what, n, len - self.pos));
        };
        let start = self.pos;
        self.pos = end;
        Ok(start)
    }

    /// Steps over `n` bytes without reading them; returns their range.
    pub fn range(&mut self, n: usize, what: impl fmt::Display) -> Result<Range<usize>> {
        let start = self.advance(n, what)?;
        Ok(start..self.pos)
    }

    fn array<const N: usize>(&mut self, what: impl fmt::Display) -> Result<[u8; N]> {
        let start = self.advance(N, what)?;
        let mut a = [0u8; N];
        self.src.read_at(start, &mut a)?;
        Ok(a)
    }

    pub fn u32(&mut self, what: impl fmt::Display) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    pub fn i32(&mut self, what: impl fmt::Display) -> Result<i32> {
        Ok(self.u32(what)? as i32)
    }

    pub fn u64(&mut self, what: impl fmt::Display) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// The next `n` bytes, copied (allocated fallibly: `n` comes from the input).
    pub fn bytes(&mut self, n: usize, what: impl fmt::Display) -> Result<Vec<u8>> {
        let start = self.advance(n, &what)?;
        let mut out = crate::alloc::zeroed(n, "bytes of a state file")?;
        self.src.read_at(start, &mut out)?;
        Ok(out)
    }

    /// The next `u32` without consuming it, if the source has it.
    pub fn peek_u32(&self) -> Option<u32> {
        let mut a = [0u8; 4];
        (self.remaining() >= 4 && self.src.read_at(self.pos, &mut a).is_ok())
            .then(|| u32::from_le_bytes(a))
    }

    pub fn remaining(&self) -> usize {
        self.src.len() - self.pos
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pieces arrive in order, absent ones as `None`; a visitor that stops ends the reads; a
    /// read error ends the call after the pieces before it were visited.
    #[test]
    fn read_ahead_visits_in_order_stops_when_asked_and_returns_a_read_error() {
        let read = |i: usize, buf: &mut Vec<u8>| -> std::result::Result<bool, String> {
            if i == 7 {
                return Err(format!("piece {i} is unreadable"));
            }
            buf.clear();
            buf.extend(std::iter::repeat_n(i as u8, 1000 + i));
            Ok(i % 3 != 1)
        };
        for n in [0, 1, 2, 7] {
            let mut seen = Vec::new();
            read_ahead(n, &read, &mut |i, v| {
                seen.push((i, v.map(|v| (v.len(), v[0]))));
                true
            })
            .unwrap();
            let want: Vec<_> = (0..n)
                .map(|i| (i, (i % 3 != 1).then_some((1000 + i, i as u8))))
                .collect();
            assert_eq!(seen, want, "{n} pieces");
        }
        let mut calls = 0;
        read_ahead(7, &read, &mut |_, _| {
            calls += 1;
            calls < 3
        })
        .unwrap();
        assert_eq!(calls, 3);
        let mut visited = Vec::new();
        let e = read_ahead(10, &read, &mut |i, _| {
            visited.push(i);
            true
        })
        .unwrap_err();
        assert_eq!(e, "piece 7 is unreadable");
        assert_eq!(visited, (0..7).collect::<Vec<_>>());
    }

    #[test]
    fn a_read_source_reads_only_what_the_cursor_asks_for() {
        let data: Vec<u8> = (0..100_000u32).flat_map(|i| i.to_le_bytes()).collect();
        let src = ReadSource::new(std::io::Cursor::new(&data), data.len() as u64, "mem").unwrap();
        let mut c = Cursor::new(&src);
        assert_eq!(c.u32("a").unwrap(), 0);
        c.range(4 * 50_000, "skipped").unwrap();
        assert_eq!(c.u32("b").unwrap(), 50_001);
        assert_eq!(src.bytes_read(), 2 * READ_CHUNK as u64);
    }

    #[test]
    fn windows_of_windows_address_the_same_bytes_as_slices() {
        let data: Vec<u8> = (0..=255).collect();
        let src = ReadSource::new(std::io::Cursor::new(&data), 256, "mem").unwrap();
        let outer = Sub::new(&src, 10..200);
        let w = Sub::new(&outer, 5..190);
        let s = Sub::new(&data[..], 15..200);
        let mut a = [0u8; 8];
        let mut b = [0u8; 8];
        w.read_at(100, &mut a).unwrap();
        s.read_at(100, &mut b).unwrap();
        assert_eq!((a, b.len(), w.len()), (b, 8, 185));
        assert_eq!(a[0], 115);
    }

    #[test]
    fn a_truncated_read_names_the_field_and_the_offset() {
        let data = [1u8, 0, 0];
        let mut c = Cursor::new(&data[..]);
        let e = c.u32("n_stream").unwrap_err().to_string();
        assert!(e.contains("n_stream") && e.contains("byte 0"), "{e}");
    }
}
