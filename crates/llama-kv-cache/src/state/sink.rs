//! Where a state payload goes as it is written: a new `Vec`, a caller's buffer (no second copy
//! of a multi-GiB state) or a writer such as a file (no payload in memory at all).

use std::io::Write;

use crate::error::{KvError, Result};
use crate::tensors::storage::KvBuffer;

/// A destination for payload bytes, filled front to back.
pub(crate) trait Sink {
    /// Appends `bytes`.
    fn put(&mut self, bytes: &[u8]) -> Result<()>;
    /// Appends `len` bytes of `buf` starting at byte `offset`.
    fn put_from(&mut self, buf: &dyn KvBuffer, offset: usize, len: usize) -> Result<()>;
    /// Bytes appended so far.
    fn written(&self) -> usize;
    /// Offers to count the next `len` bytes as appended without being given them; returns
    /// whether it did. A sink that keeps only a window of the payload skips what lies outside
    /// it, so the writer need not produce those bytes at all.
    fn skip(&mut self, _len: usize) -> bool {
        false
    }
    /// The next `len` bytes of the destination, to be written in place and counted as
    /// appended, where the sink is memory (so small fields need no staging buffer); `None`
    /// where it is not.
    fn place(&mut self, _len: usize) -> Option<&mut [u8]> {
        None
    }
}

impl Sink for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) -> Result<()> {
        self.extend_from_slice(bytes);
        Ok(())
    }

    fn put_from(&mut self, buf: &dyn KvBuffer, offset: usize, len: usize) -> Result<()> {
        match buf.as_host() {
            Some(bytes) => self.extend_from_slice(&bytes[offset..offset + len]),
            None => {
                let start = self.len();
                self.resize(start + len, 0);
                buf.read(offset, &mut self[start..])?;
            }
        }
        Ok(())
    }

    fn written(&self) -> usize {
        self.len()
    }

    fn place(&mut self, len: usize) -> Option<&mut [u8]> {
        let start = self.len();
        self.resize(start + len, 0);
        Some(&mut self[start..])
    }
}

/// A caller's buffer, already checked to be large enough.
pub(crate) struct SliceSink<'a> {
    out: &'a mut [u8],
    pos: usize,
}

impl<'a> SliceSink<'a> {
    pub fn new(out: &'a mut [u8]) -> Self {
        SliceSink { out, pos: 0 }
    }

    fn next(&mut self, len: usize) -> Result<&mut [u8]> {
        let end = self.pos + len;
        let room = self.out.len();
        let dst = self.out.get_mut(self.pos..end).ok_or_else(|| {
            KvError::InvalidArg(format!("the state does not fit the {room}-byte buffer"))
        })?;
        self.pos = end;
        Ok(dst)
    }
}

impl Sink for SliceSink<'_> {
    fn put(&mut self, bytes: &[u8]) -> Result<()> {
        self.next(bytes.len())?.copy_from_slice(bytes);
        Ok(())
    }

    fn place(&mut self, len: usize) -> Option<&mut [u8]> {
        self.next(len).ok()
    }

    fn put_from(&mut self, buf: &dyn KvBuffer, offset: usize, len: usize) -> Result<()> {
        let dst = self.next(len)?;
        match buf.as_host() {
            Some(bytes) => dst.copy_from_slice(&bytes[offset..offset + len]),
            None => buf.read(offset, dst)?,
        }
        Ok(())
    }

    fn written(&self) -> usize {
        self.pos
    }
}

/// The most bytes [`WriteSink`] stages at once from a buffer that is not in host memory.
const STAGE_BYTES: usize = 4 << 20;

/// A writer (a file): host tensor bytes are written straight from the tensors; device bytes go
/// through a staging buffer.
pub(crate) struct WriteSink<'a> {
    w: &'a mut dyn Write,
    n: usize,
    stage: Vec<u8>,
}

impl<'a> WriteSink<'a> {
    pub fn new(w: &'a mut dyn Write) -> Self {
        WriteSink {
            w,
            n: 0,
            stage: Vec::new(),
        }
    }
}

fn io_error(e: std::io::Error) -> KvError {
    KvError::Io(format!("cannot write the state: {e}"))
}

impl Sink for WriteSink<'_> {
    fn put(&mut self, bytes: &[u8]) -> Result<()> {
        self.w.write_all(bytes).map_err(io_error)?;
        self.n += bytes.len();
        Ok(())
    }

    fn put_from(&mut self, buf: &dyn KvBuffer, offset: usize, len: usize) -> Result<()> {
        match buf.as_host() {
            Some(bytes) => self
                .w
                .write_all(&bytes[offset..offset + len])
                .map_err(io_error)?,
            None => {
                // in pieces: a layer of a device cache (or of a conversion's input) can be
                // gigabytes, and this staging buffer is all the memory a streamed save needs
                let mut done = 0;
                while done < len {
                    let n = (len - done).min(STAGE_BYTES);
                    self.stage.resize(n, 0);
                    buf.read(offset + done, &mut self.stage)?;
                    self.w.write_all(&self.stage).map_err(io_error)?;
                    done += n;
                }
            }
        }
        self.n += len;
        Ok(())
    }

    fn written(&self) -> usize {
        self.n
    }
}

/// Keeps the bytes `[start, start + out.len())` of the payload in `out` and counts the rest
/// without copying it: one chunk of a payload produced piece by piece (a stream).
pub(crate) struct WindowSink<'a> {
    out: &'a mut [u8],
    start: usize,
    seen: usize,
}

impl<'a> WindowSink<'a> {
    pub fn new(out: &'a mut [u8], start: usize) -> Self {
        WindowSink {
            out,
            start,
            seen: 0,
        }
    }

    /// The part of the next `len` payload bytes inside the window: (offset in those bytes,
    /// offset in `out`, length).
    fn overlap(&self, len: usize) -> Option<(usize, usize, usize)> {
        let from = self.seen.max(self.start);
        let to = (self.seen + len).min(self.start + self.out.len());
        (from < to).then(|| (from - self.seen, from - self.start, to - from))
    }
}

impl Sink for WindowSink<'_> {
    fn put(&mut self, bytes: &[u8]) -> Result<()> {
        if let Some((src, dst, n)) = self.overlap(bytes.len()) {
            self.out[dst..dst + n].copy_from_slice(&bytes[src..src + n]);
        }
        self.seen += bytes.len();
        Ok(())
    }

    fn put_from(&mut self, buf: &dyn KvBuffer, offset: usize, len: usize) -> Result<()> {
        if let Some((src, dst, n)) = self.overlap(len) {
            let out = &mut self.out[dst..dst + n];
            match buf.as_host() {
                Some(bytes) => out.copy_from_slice(&bytes[offset + src..offset + src + n]),
                None => buf.read(offset + src, out)?,
            }
        }
        self.seen += len;
        Ok(())
    }

    fn written(&self) -> usize {
        self.seen
    }

    fn skip(&mut self, len: usize) -> bool {
        if self.overlap(len).is_some() {
            return false;
        }
        self.seen += len;
        true
    }
}
