//! One KV part of a one-sequence state payload in today's layout (`n_stream` 1, or one stream
//! per sequence of which only the sequence's has cells; the rotation recorded), written in
//! place from verified rows: the bytes the core's transactional `state_read` loads, and the
//! parts of the files `write_file` writes. A payload is built in a [`PayloadSink`]: a buffer
//! in memory, or the file being written, at offsets ([`FileSink`]), so that a file needs no
//! buffer of its size.

use std::fs::File;
use std::io::{Seek, SeekFrom, Write};

use memmap2::{MmapMut, MmapOptions};

use llama_kv_cache::state::cells::{cell_len, put_cell, put_cell_one_id, CellExt};
use llama_kv_cache::state::{cell_count_header, data_header, k_header, n_stream_header, v_header};
use llama_kv_cache::tensors::transpose::{transpose, Shape};
use llama_kv_cache::KvError;

use crate::block::BlockRows;
use crate::error::{StoreError, StoreResult};
use crate::geometry::Geometry;

/// Which sequence a part's cells hold, in which of how many streams: a unified context's one
/// stream, or (a context with one stream per sequence) stream `seq` of `n_stream`, the others
/// empty, as llama.cpp writes one sequence of such a context.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamAt {
    /// The sequence every cell holds.
    pub seq: i32,
    /// Streams of the payload (1: unified).
    pub n_stream: u32,
}

impl StreamAt {
    /// The empty streams before and after the sequence's.
    fn empty_around(self) -> StoreResult<(u32, u32)> {
        if self.n_stream <= 1 {
            return Ok((0, 0));
        }
        let at = u32::try_from(self.seq)
            .ok()
            .filter(|&s| s < self.n_stream)
            .ok_or_else(|| {
                StoreError::InvalidArg(format!(
                    "sequence {} has no stream of its own among {}",
                    self.seq, self.n_stream
                ))
            })?;
        Ok((at, self.n_stream - at - 1))
    }
}

/// Where the rows of one KV part go inside a payload buffer.
pub struct KvPartWriter<'g> {
    geometry: &'g Geometry,
    /// The extension the part's cells carry (none, or the payload's form of the rows' own).
    ext: CellExt,
    /// Each cell's position.
    positions: Vec<i32>,
    v_trans: bool,
    /// The sequence every cell holds.
    seq: i32,
    /// Offset of the first cell's metadata in the payload (cells of a geometry with an
    /// extension get theirs from the rows put into them).
    cells_at: usize,
    /// Per layer: offsets of the K rows and of the V data.
    k_at: Vec<usize>,
    v_at: Vec<usize>,
}

/// Grows `out` by `extra` zero bytes, failing cleanly when the memory is not there.
pub fn grow(out: &mut Vec<u8>, extra: usize) -> StoreResult<()> {
    out.try_reserve_exact(extra).map_err(|_| {
        StoreError::Cache(KvError::Backend(format!(
            "cannot allocate {extra} bytes for the restored state"
        )))
    })?;
    out.resize(out.len() + extra, 0);
    Ok(())
}

/// Where a payload is assembled: appended piece by piece, with gaps for rows that are written
/// later at their offsets.
pub trait PayloadSink {
    /// Bytes appended or reserved so far.
    fn len(&self) -> usize;
    /// Appends `bytes`.
    fn append(&mut self, bytes: &[u8]) -> StoreResult<()>;
    /// Appends `n` bytes to be written later with [`PayloadSink::write_at`].
    fn reserve(&mut self, n: usize) -> StoreResult<()>;
    /// Writes `bytes` at `at`, inside what was appended or reserved.
    fn write_at(&mut self, at: usize, bytes: &[u8]) -> StoreResult<()>;
    /// The bytes in memory, for writes that are not one run (a transposed V); `None` for a
    /// file.
    fn bytes_mut(&mut self) -> Option<&mut [u8]>;
    /// Drops everything (a restore point that turned out broken is assembled again).
    fn restart(&mut self) -> StoreResult<()>;
}

impl PayloadSink for Vec<u8> {
    fn len(&self) -> usize {
        Vec::len(self)
    }

    fn append(&mut self, bytes: &[u8]) -> StoreResult<()> {
        grow(self, bytes.len())?;
        let at = Vec::len(self) - bytes.len();
        self[at..].copy_from_slice(bytes);
        Ok(())
    }

    fn reserve(&mut self, n: usize) -> StoreResult<()> {
        grow(self, n)
    }

    fn write_at(&mut self, at: usize, bytes: &[u8]) -> StoreResult<()> {
        self[at..at + bytes.len()].copy_from_slice(bytes);
        Ok(())
    }

    fn bytes_mut(&mut self) -> Option<&mut [u8]> {
        Some(self)
    }

    fn restart(&mut self) -> StoreResult<()> {
        self.clear();
        Ok(())
    }
}

/// A payload assembled in the file's own pages, mapped: for a transposed V, whose rows land in
/// every channel's run and so need the bytes in memory, without a buffer of the file's size
/// beside the file, nor a copy of it into the file. The file grows as the payload does (the
/// mapping is made again, never its bytes copied) and is cut to the payload's length at the end.
pub struct MappedFileSink<'f> {
    file: &'f File,
    map: Option<MmapMut>,
    len: usize,
}

/// The least a mapped file grows by (it doubles beyond that).
const MAPPED_GROWTH: usize = 1 << 20;

impl<'f> MappedFileSink<'f> {
    /// A sink assembling `file` (empty, private to the writer: a temporary file no other
    /// process writes) from its start.
    pub fn new(file: &'f File) -> Self {
        MappedFileSink {
            file,
            map: None,
            len: 0,
        }
    }

    /// Sets the file's length to what was appended and reserved, writing nothing more.
    pub fn finish(mut self) -> StoreResult<()> {
        if let Some(map) = self.map.take() {
            map.flush_async().map_err(io)?;
        }
        self.file.set_len(self.len as u64).map_err(io)
    }

    /// Makes room for `n` more bytes (zeros, as a file extended by `set_len` reads).
    fn extend(&mut self, n: usize) -> StoreResult<()> {
        let need = self.len.checked_add(n).ok_or_else(|| {
            StoreError::InvalidArg(format!("a payload of {} + {n} bytes", self.len))
        })?;
        let cap = self.map.as_ref().map_or(0, |m| m.len());
        if need > cap {
            let cap = need.max(cap.saturating_mul(2)).max(MAPPED_GROWTH);
            // unmapped before the file changes size: Windows cannot resize a mapped file
            self.map = None;
            self.file.set_len(cap as u64).map_err(io)?;
            // SAFETY: the file is the writer's own temporary file (created exclusively and
            // locked by `write_replacing_file`, removed or renamed only after this sink is
            // done), so no other process truncates or writes it while it is mapped, and this
            // sink is its only user in this process
            let map = unsafe { MmapOptions::new().len(cap).map_mut(self.file) }.map_err(io)?;
            self.map = Some(map);
        }
        self.len = need;
        Ok(())
    }

    fn bytes(&mut self) -> &mut [u8] {
        let len = self.len;
        self.map.as_mut().map_or(&mut [][..], |m| &mut m[..len])
    }
}

impl PayloadSink for MappedFileSink<'_> {
    fn len(&self) -> usize {
        self.len
    }

    fn append(&mut self, bytes: &[u8]) -> StoreResult<()> {
        let at = self.len;
        self.extend(bytes.len())?;
        self.bytes()[at..].copy_from_slice(bytes);
        Ok(())
    }

    fn reserve(&mut self, n: usize) -> StoreResult<()> {
        self.extend(n)
    }

    fn write_at(&mut self, at: usize, bytes: &[u8]) -> StoreResult<()> {
        self.bytes()[at..at + bytes.len()].copy_from_slice(bytes);
        Ok(())
    }

    fn bytes_mut(&mut self) -> Option<&mut [u8]> {
        Some(self.bytes())
    }

    fn restart(&mut self) -> StoreResult<()> {
        // reserved bytes read as zeros again, as in a fresh file
        self.bytes().fill(0);
        self.len = 0;
        Ok(())
    }
}

/// A payload written straight into a file at its offsets: reserved bytes are a hole until
/// their rows arrive.
pub struct FileSink<'f> {
    file: &'f mut File,
    len: usize,
}

impl<'f> FileSink<'f> {
    /// A sink writing `file` from its start.
    pub fn new(file: &'f mut File) -> Self {
        FileSink { file, len: 0 }
    }

    /// Sets the file's length to what was appended and reserved.
    pub fn finish(self) -> StoreResult<()> {
        self.file.set_len(self.len as u64).map_err(io)
    }
}

fn io(e: std::io::Error) -> StoreError {
    StoreError::Io(format!("cannot write the file: {e}"))
}

impl PayloadSink for FileSink<'_> {
    fn len(&self) -> usize {
        self.len
    }

    fn append(&mut self, bytes: &[u8]) -> StoreResult<()> {
        self.write_at(self.len, bytes)?;
        self.len += bytes.len();
        Ok(())
    }

    fn reserve(&mut self, n: usize) -> StoreResult<()> {
        self.len += n;
        Ok(())
    }

    fn write_at(&mut self, at: usize, bytes: &[u8]) -> StoreResult<()> {
        self.file.seek(SeekFrom::Start(at as u64)).map_err(io)?;
        self.file.write_all(bytes).map_err(io)
    }

    fn bytes_mut(&mut self) -> Option<&mut [u8]> {
        None
    }

    fn restart(&mut self) -> StoreResult<()> {
        self.len = 0;
        self.file.set_len(0).map_err(io)
    }
}

impl<'g> KvPartWriter<'g> {
    /// Appends a part of `positions.len()` cells of sequence `at.seq` to `out` (headers written,
    /// rows to come and cell extensions llama.cpp's default until [`KvPartWriter::put`] fills
    /// them). The cells carry `ext`: none, or the form the payload's reader expects of the
    /// extensions the rows keep.
    pub fn begin(
        out: &mut dyn PayloadSink,
        geometry: &'g Geometry,
        ext: CellExt,
        positions: &[i32],
        at: StreamAt,
        v_trans: bool,
        rot: Option<(u32, u32)>,
    ) -> StoreResult<Self> {
        let (seq, n) = (at.seq, positions.len());
        let (before, after) = at.empty_around()?;
        let cell = cell_len(1, ext);
        let mut head = n_stream_header(at.n_stream).to_vec();
        // an empty stream is its cell count 0
        for _ in 0..before {
            head.extend_from_slice(&cell_count_header(0));
        }
        let cells_from = head.len() + 4;
        grow(&mut head, 4 + cell * n)?;
        head[cells_from - 4..cells_from].copy_from_slice(&cell_count_header(n as u32));
        for (p, dst) in positions
            .iter()
            .zip(head[cells_from..].chunks_exact_mut(cell))
        {
            if ext.is_none() {
                put_cell_one_id(dst.try_into().expect("one-id cells are 12 bytes"), *p, seq);
            } else {
                put_cell(dst, *p, ext, None, std::iter::once(seq));
            }
        }
        let cells_at = out.len() + cells_from;
        out.append(&head)?;
        let (header, len) = data_header(v_trans, geometry.layers.len() as u32, rot);
        out.append(&header[..len])?;
        let mut k_at = Vec::with_capacity(geometry.layers.len());
        for l in &geometry.layers {
            out.append(&k_header(l.k_type, l.k_row as usize))?;
            k_at.push(out.len());
            out.reserve(n * l.k_row as usize)?;
        }
        let mut v_at = Vec::with_capacity(geometry.layers.len());
        for l in &geometry.layers {
            // a part without V has no V blocks (its rows are of no bytes: nothing to write)
            if !geometry.no_v {
                out.append(&v_header(l.v_type, l.v_row as usize, v_trans))?;
            }
            v_at.push(out.len());
            out.reserve(n * l.v_row as usize)?;
        }
        for _ in 0..after {
            out.append(&cell_count_header(0))?;
        }
        Ok(KvPartWriter {
            geometry,
            ext,
            positions: positions.to_vec(),
            v_trans,
            seq,
            cells_at,
            k_at,
            v_at,
        })
    }

    /// Writes `rows` (of as many tokens as they hold) into cells `first..` of the part.
    pub fn put(
        &self,
        out: &mut dyn PayloadSink,
        first: usize,
        rows: &BlockRows<'_>,
    ) -> StoreResult<()> {
        self.put_from(out, first, rows, 0)
    }

    /// Writes the rows of `rows` from its row `skip` on into cells `first..` of the part.
    pub fn put_from(
        &self,
        out: &mut dyn PayloadSink,
        first: usize,
        rows: &BlockRows<'_>,
        skip: usize,
    ) -> StoreResult<()> {
        let m = rows.n_tokens() - skip;
        let n = self.positions.len();
        debug_assert!(first + m <= n);
        if !self.ext.is_none() {
            // the cells again, now with their extensions
            let cell = cell_len(1, self.ext);
            let mut cells = Vec::new();
            grow(&mut cells, m * cell)?;
            for (k, dst) in cells.chunks_exact_mut(cell).enumerate() {
                let (pos, ext) = (self.positions[first + k], Some(rows.ext(skip + k)));
                put_cell(dst, pos, self.ext, ext, std::iter::once(self.seq));
            }
            out.write_at(self.cells_at + first * cell, &cells)?;
        }
        for (il, l) in self.geometry.layers.iter().enumerate() {
            let k_row = l.k_row as usize;
            out.write_at(self.k_at[il] + first * k_row, &rows.k(il)[skip * k_row..])?;
            if self.geometry.no_v {
                continue;
            }
            let v_row = l.v_row as usize;
            if self.v_trans {
                // the m rows of n_embd channels become columns first.. of the n_embd runs of
                // n elements
                let el = l.v_type.type_size();
                let at = self.v_at[il] + first * el;
                let shape = Shape {
                    rows: m,
                    cols: v_row / el,
                    el,
                    src_stride: v_row,
                    dst_stride: n * el,
                };
                let bytes = out.bytes_mut().ok_or_else(|| {
                    StoreError::InvalidArg("a transposed V is assembled in memory".into())
                })?;
                transpose(&rows.v(il)[skip * v_row..], &mut bytes[at..], shape);
            } else {
                out.write_at(self.v_at[il] + first * v_row, &rows.v(il)[skip * v_row..])?;
            }
        }
        Ok(())
    }
}
