//! Where the K and V tensors live: a byte-addressed buffer interface, host memory behind it, and
//! the per-layer tensor geometry (row sizes, the transposed-V layout).

use memmap2::MmapMut;

use crate::alloc::{populate, zeroed_bytes, OwnedBytes};
use crate::error::{KvError, Result};
use crate::ggml_type::GgmlType;
use crate::tensors::bulk_copy::copy_rows;
use crate::tensors::transpose::{transpose, Shape};

/// Where a buffer's bytes live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    /// Host memory.
    Host,
    /// CUDA device memory on the given ordinal.
    Cuda(usize),
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Host => f.write_str("host"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// One tensor's bytes. Offsets and lengths are in bytes; callers check bounds first, and
/// implementations return an error rather than panic if they are wrong anyway.
pub trait KvBuffer: Send + Sync {
    /// Size in bytes.
    fn len(&self) -> usize;
    /// Whether the buffer holds no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Where the bytes live.
    fn device(&self) -> Device;
    /// Copies `dst.len()` bytes starting at `offset` into `dst`.
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()>;
    /// Copies `src` into the buffer at `offset`.
    fn write(&mut self, offset: usize, src: &[u8]) -> Result<()>;
    /// Copies `len` bytes from `src` to `dst` inside the buffer (ranges may overlap).
    fn copy_within(&mut self, src: usize, dst: usize, len: usize) -> Result<()>;
    /// Sets every byte to zero.
    fn fill_zero(&mut self) -> Result<()>;
    /// Sets every byte to zero and hands the memory back to the OS where the backend can (the
    /// next writes fault it in again). Backends that cannot just zero.
    fn release(&mut self) -> Result<()> {
        self.fill_zero()
    }
    /// Hands the memory of the whole pages inside `offset..offset + len` back to the OS, where
    /// the backend can; their bytes read as zeros afterwards. Bytes of partial pages at either
    /// end are left as they are. A backend that cannot does nothing (the bytes are garbage the
    /// caller no longer reads, so they need not be zeroed).
    fn release_range(&mut self, offset: usize, len: usize) -> Result<()> {
        let _ = (offset, len);
        Ok(())
    }
    /// Bytes this buffer keeps in memory: all of them, except for the pages of a host buffer
    /// never written since it was created or since they were handed back (the OS has not
    /// committed them).
    fn resident_bytes(&self) -> usize {
        self.len()
    }
    /// `rows` strided copies inside the buffer: row `r` copies `width` bytes from
    /// `src + r * pitch` to `dst + r * pitch`. Transposed V moves are this shape; a device backend
    /// can do it as one 2D copy.
    fn copy_within_2d(
        &mut self,
        src: usize,
        dst: usize,
        width: usize,
        pitch: usize,
        rows: usize,
    ) -> Result<()> {
        for r in 0..rows {
            self.copy_within(src + r * pitch, dst + r * pitch, width)?;
        }
        Ok(())
    }
    /// Reads `rows` strided pieces of `width` bytes (`offset + r * pitch`) into `dst`, packed.
    fn read_2d(&self, offset: usize, width: usize, pitch: usize, dst: &mut [u8]) -> Result<()> {
        for (r, chunk) in dst.chunks_exact_mut(width.max(1)).enumerate() {
            self.read(offset + r * pitch, chunk)?;
        }
        Ok(())
    }
    /// Writes packed `src` as strided pieces of `width` bytes at `offset + r * pitch`.
    fn write_2d(&mut self, offset: usize, width: usize, pitch: usize, src: &[u8]) -> Result<()> {
        for (r, chunk) in src.chunks_exact(width.max(1)).enumerate() {
            self.write(offset + r * pitch, chunk)?;
        }
        Ok(())
    }
    /// The host bytes of `rows` strided pieces of `width` bytes at `offset + r * pitch`, as one
    /// span from `offset` to write in place (the pieces count as written), when the buffer is
    /// in host memory; the caller writes only inside the pieces.
    fn host_strided_mut(
        &mut self,
        offset: usize,
        width: usize,
        pitch: usize,
        rows: usize,
    ) -> Result<Option<&mut [u8]>> {
        let _ = (offset, width, pitch, rows);
        Ok(None)
    }
    /// The bytes, when they are in host memory (fast paths skip the copy through `read`).
    fn as_host(&self) -> Option<&[u8]> {
        None
    }
    /// Mutable host bytes, when they are in host memory.
    fn as_host_mut(&mut self) -> Option<&mut [u8]> {
        None
    }
    /// The concrete buffer, for backends with fast paths of their own (the CUDA K-shift).
    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        None
    }
}

/// A zero-initialised buffer in host memory. A tensor of [`MAP_MIN`](crate::alloc::MAP_MIN) bytes or more is an
/// anonymous mapping of its own, straight from the OS (`mmap` / `VirtualAlloc`, through
/// `memmap2`): creating one commits no page whatever the allocator did before (heap memory from
/// an earlier, freed cache would have to be memset), dropping it returns every page at once,
/// and [`KvBuffer::release`] hands its pages back. Smaller tensors come from the heap.
pub struct HostBuffer {
    bytes: OwnedBytes,
    /// Nothing was written since the buffer was allocated or zeroed: it holds only the zero
    /// pages the OS hands out lazily.
    zero: bool,
    /// Something was written since the buffer was allocated or zeroed: the OS committed its
    /// pages.
    committed: bool,
    /// For a mapping: the pages written since they were last handed back, so that
    /// `resident_bytes` stays exact when parts of the buffer are released.
    pages: Option<PageMap>,
}

impl HostBuffer {
    /// Allocates `len` zero bytes, reporting a refused allocation or mapping (no memory,
    /// `ulimit -v`) as an error instead of aborting.
    pub fn new(len: usize) -> Result<HostBuffer> {
        let bytes = zeroed_bytes(len, "a tensor in host memory")?;
        let pages = match bytes.map() {
            Some(_) => Some(PageMap::new(len)?),
            None => None,
        };
        Ok(HostBuffer {
            bytes,
            zero: true,
            committed: false,
            pages,
        })
    }

    fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.bytes
    }
}

fn check_range(what: &str, offset: usize, len: usize, size: usize) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(KvError::OutOfRange(format!(
            "{what} of {len} bytes at offset {offset} exceeds the buffer size {size}"
        ))),
    }
}

impl HostBuffer {
    /// Marks `offset..offset + len` written.
    fn touch(&mut self, offset: usize, len: usize) {
        self.zero = false;
        self.committed = true;
        if let Some(p) = &mut self.pages {
            p.set(offset, offset + len, true);
        }
    }

    /// Faults in the pages of `offset..offset + len` with one call when some were never
    /// written since they were mapped or handed back (the page map knows which): one call
    /// instead of one fault per page.
    fn populate_unwritten(&self, offset: usize, len: usize) {
        if let (Some(map), Some(pages)) = (self.bytes.map(), &self.pages) {
            if !pages.all_set(offset, offset + len) {
                populate(map, offset, len);
            }
        }
    }

    /// Marks the whole buffer written.
    fn touch_all(&mut self) {
        self.touch(0, self.len());
    }
}

impl KvBuffer for HostBuffer {
    fn len(&self) -> usize {
        self.bytes().len()
    }

    fn device(&self) -> Device {
        Device::Host
    }

    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        let bytes = self.bytes();
        check_range("read", offset, dst.len(), bytes.len())?;
        dst.copy_from_slice(&bytes[offset..offset + dst.len()]);
        Ok(())
    }

    fn write(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        check_range("write", offset, src.len(), self.len())?;
        if src.len() >= POPULATE_MIN {
            self.populate_unwritten(offset, src.len());
        }
        self.touch(offset, src.len());
        copy_rows(&mut self.bytes_mut()[offset..offset + src.len()], src);
        Ok(())
    }

    fn copy_within(&mut self, src: usize, dst: usize, len: usize) -> Result<()> {
        check_range("copy source", src, len, self.len())?;
        check_range("copy destination", dst, len, self.len())?;
        self.touch(dst, len);
        self.bytes_mut().copy_within(src..src + len, dst);
        Ok(())
    }

    fn fill_zero(&mut self) -> Result<()> {
        if !self.zero {
            self.touch_all();
            self.bytes_mut().fill(0);
            self.zero = true;
        }
        Ok(())
    }

    fn release(&mut self) -> Result<()> {
        if !self.committed {
            return self.fill_zero();
        }
        if self
            .bytes
            .map_mut()
            .is_some_and(|m| release_pages(m, 0, m.len()))
        {
            (self.zero, self.committed) = (true, false);
            if let Some(p) = &mut self.pages {
                p.clear();
            }
            return Ok(());
        }
        self.fill_zero()
    }

    fn release_range(&mut self, offset: usize, len: usize) -> Result<()> {
        check_range("release", offset, len, self.len())?;
        let page = page_size();
        let (start, end) = (offset.next_multiple_of(page), (offset + len) / page * page);
        let (Some(map), Some(pages)) = (self.bytes.map_mut(), &mut self.pages) else {
            return Ok(());
        };
        if start < end && release_pages(map, start, end - start) {
            pages.set(start, end, false);
            if pages.count == 0 {
                (self.zero, self.committed) = (true, false);
            }
        }
        Ok(())
    }

    fn resident_bytes(&self) -> usize {
        match &self.pages {
            Some(p) => (p.count * page_size()).min(self.len()),
            None if self.committed => self.len(),
            None => 0,
        }
    }

    fn write_2d(&mut self, offset: usize, width: usize, pitch: usize, src: &[u8]) -> Result<()> {
        let rows = src.len() / width.max(1);
        if let Some(span) = self.host_strided_mut(offset, width, pitch, rows)? {
            for (r, piece) in src.chunks_exact(width).enumerate() {
                span[r * pitch..r * pitch + width].copy_from_slice(piece);
            }
        }
        Ok(())
    }

    fn host_strided_mut(
        &mut self,
        offset: usize,
        width: usize,
        pitch: usize,
        rows: usize,
    ) -> Result<Option<&mut [u8]>> {
        if rows == 0 || width == 0 {
            return Ok(Some(&mut []));
        }
        let span = (rows - 1)
            .checked_mul(pitch)
            .and_then(|s| s.checked_add(width))
            .unwrap_or(usize::MAX);
        check_range("write", offset, span, self.len())?;
        // pieces at most a page apart touch every page of the span: one update of the page
        // map instead of one per piece (a transposed V row has thousands)
        if pitch <= page_size() {
            self.touch(offset, span);
        } else {
            for r in 0..rows {
                self.touch(offset + r * pitch, width);
            }
        }
        Ok(Some(&mut self.bytes_mut()[offset..offset + span]))
    }

    fn as_host(&self) -> Option<&[u8]> {
        Some(self.bytes())
    }

    fn as_host_mut(&mut self) -> Option<&mut [u8]> {
        self.touch_all();
        Some(self.bytes_mut())
    }
}

/// The pages of a mapping that were written since they were last handed back: a bit per page
/// and their count, so that `resident_bytes` is O(1) and exact after partial releases.
struct PageMap {
    bits: Vec<u64>,
    count: usize,
}

impl PageMap {
    fn new(len: usize) -> Result<PageMap> {
        let pages = len.div_ceil(page_size());
        Ok(PageMap {
            bits: crate::alloc::zeroed(pages.div_ceil(64), "the page map of a tensor")?,
            count: 0,
        })
    }

    /// No page written.
    fn clear(&mut self) {
        self.bits.fill(0);
        self.count = 0;
    }

    /// The words of the bit map that bytes `start..end` touch, each with the mask of its bits
    /// for those pages.
    fn masks(start: usize, end: usize) -> impl Iterator<Item = (usize, u64)> {
        let page = page_size();
        let (first, last) = (start / page, end.saturating_sub(1) / page);
        let words = if start < end {
            first / 64..last / 64 + 1
        } else {
            0..0
        };
        words.map(move |w| {
            let lo = if w == first / 64 { first % 64 } else { 0 };
            let hi = if w == last / 64 { last % 64 } else { 63 };
            (w, (u64::MAX >> (63 - hi)) & (u64::MAX << lo))
        })
    }

    /// Whether every page that bytes `start..end` touch is written.
    fn all_set(&self, start: usize, end: usize) -> bool {
        Self::masks(start, end).all(|(w, mask)| self.bits[w] & mask == mask)
    }

    /// Sets the pages that bytes `start..end` touch to `on`: a word at a time.
    fn set(&mut self, start: usize, end: usize, on: bool) {
        for (w, mask) in Self::masks(start, end) {
            let word = &mut self.bits[w];
            let before = word.count_ones() as usize;
            if on {
                *word |= mask;
            } else {
                *word &= !mask;
            }
            self.count = self.count + word.count_ones() as usize - before;
        }
    }
}

/// The OS's page size (4 KiB where it cannot tell).
fn page_size() -> usize {
    static PAGE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *PAGE.get_or_init(|| {
        #[cfg(unix)]
        {
            // SAFETY: sysconf has no preconditions
            let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
            if n > 0 {
                return n as usize;
            }
        }
        4096
    })
}

/// Writes at least this large into pages never written fault them in with one call first.
const POPULATE_MIN: usize = 1 << 20;

/// Zeroes `offset..offset + len` (whole pages) of a private anonymous mapping by handing its
/// pages back to the OS (`MADV_DONTNEED`: the next access of each page gets a fresh zero
/// page), which costs no write per byte and returns the memory. `false` where the OS offers no
/// such call (the caller writes zeros, or keeps the bytes).
#[cfg(unix)]
fn release_pages(map: &mut MmapMut, offset: usize, len: usize) -> bool {
    debug_assert!(
        offset.is_multiple_of(page_size())
            && (len.is_multiple_of(page_size()) || offset + len == map.len())
    );
    // SAFETY: the mapping is private and anonymous (`map_anon`), so MADV_DONTNEED discards the
    // contents of the range and later reads see zero pages, which is the zeroing asked for;
    // the range is whole pages (memmap2 would widen a misaligned start down to its page, and
    // the kernel a length up to one), so no byte outside it is lost; `&mut` proves nothing
    // borrows the bytes meanwhile.
    unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, offset, len) }.is_ok()
}

#[cfg(not(unix))]
fn release_pages(_: &mut MmapMut, _: usize, _: usize) -> bool {
    false
}

/// Allocates the buffer of one tensor: `(layer, is_v, bytes) -> buffer`. Lets a cache put layers
/// on different devices.
pub type Allocator<'a> = dyn FnMut(usize, bool, usize) -> Result<Box<dyn KvBuffer>> + 'a;

/// The host allocator.
pub fn host_allocator(_layer: usize, _is_v: bool, len: usize) -> Result<Box<dyn KvBuffer>> {
    Ok(Box::new(HostBuffer::new(len)?))
}

/// The K and V tensors of one layer and their geometry.
pub struct LayerTensors {
    /// K: one row of `k_row` bytes per cell.
    pub k: Box<dyn KvBuffer>,
    /// V: one row per cell, or transposed (`n_embd_v` rows of `size` elements).
    pub v: Box<dyn KvBuffer>,
    /// K width in elements (`n_embd_k_gqa + n_embd_k_s`).
    pub n_embd_k: usize,
    /// V width in elements (`n_embd_v_gqa + n_embd_v_s`).
    pub n_embd_v: usize,
    /// Bytes of one K row.
    pub k_row: usize,
    /// Bytes of one V row (untransposed).
    pub v_row: usize,
}

/// Which of a layer's two tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tensor {
    /// Keys.
    K,
    /// Values.
    V,
}

impl std::fmt::Display for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Tensor::K => "K",
            Tensor::V => "V",
        })
    }
}

/// Geometry shared by all layers of a cache, needed to address V.
#[derive(Clone, Copy, Debug)]
pub struct VGeometry {
    /// Cells in the cache.
    pub size: usize,
    /// V stored transposed.
    pub v_trans: bool,
    /// Element size of V (the type size; transposed V is never quantized).
    pub v_el: usize,
}

impl LayerTensors {
    /// Allocates the tensors of layer `il`.
    pub fn allocate(
        il: usize,
        n_embd_k: usize,
        n_embd_v: usize,
        type_k: GgmlType,
        type_v: GgmlType,
        size: usize,
        alloc: &mut Allocator<'_>,
    ) -> Result<LayerTensors> {
        let k_row = type_k.row_size(n_embd_k)?;
        let v_row = type_v.row_size(n_embd_v)?;
        let too_big = || KvError::InvalidArg(format!("layer {il}: tensor size overflows"));
        let k = alloc(il, false, k_row.checked_mul(size).ok_or_else(too_big)?)?;
        let v = alloc(il, true, v_row.checked_mul(size).ok_or_else(too_big)?)?;
        Ok(LayerTensors {
            k,
            v,
            n_embd_k,
            n_embd_v,
            k_row,
            v_row,
        })
    }

    /// Row size in bytes of `which`.
    pub fn row_size(&self, which: Tensor) -> usize {
        match which {
            Tensor::K => self.k_row,
            Tensor::V => self.v_row,
        }
    }

    /// Reads the rows of cells `[first, first + n)` of `which`, one packed row per cell
    /// (transposed V is gathered back into rows).
    pub fn read_rows(
        &self,
        which: Tensor,
        lay: VGeometry,
        first: usize,
        n: usize,
    ) -> Result<Vec<u8>> {
        let row = self.row_size(which);
        let mut out = crate::alloc::zeroed(row * n, "the rows read")?;
        if which == Tensor::V && lay.v_trans && n > 0 {
            // one strided read of the n_embd_v element runs (one 2D copy on a device), then a
            // transpose into rows on the host
            let el = lay.v_el;
            let mut columns = crate::alloc::zeroed(self.n_embd_v * n * el, "the V columns read")?;
            self.v
                .read_2d(first * el, n * el, lay.size * el, &mut columns)?;
            let shape = Shape {
                rows: self.n_embd_v,
                cols: n,
                el,
                src_stride: n * el,
                dst_stride: row,
            };
            transpose(&columns, &mut out, shape);
        } else {
            self.buffer(which).read(first * row, &mut out)?;
        }
        Ok(out)
    }

    /// Writes packed rows (one per cell) to cells `[first, first + rows.len() / row)`.
    pub fn write_rows(
        &mut self,
        which: Tensor,
        lay: VGeometry,
        first: usize,
        rows: &[u8],
    ) -> Result<()> {
        let row = self.row_size(which);
        let n = rows.len() / row;
        if which == Tensor::V && lay.v_trans {
            let (el, cols) = (lay.v_el, self.n_embd_v);
            let pitch = lay.size * el;
            let shape = |dst_stride| Shape {
                rows: n,
                cols,
                el,
                src_stride: row,
                dst_stride,
            };
            // in host memory the rows become columns in place, in one pass
            if let Some(dst) = self.v.host_strided_mut(first * el, n * el, pitch, cols)? {
                transpose(rows, dst, shape(pitch));
                return Ok(());
            }
            // elsewhere (a device) through packed columns, one 2D copy
            let mut columns = crate::alloc::zeroed(cols * n * el, "the V columns written")?;
            transpose(rows, &mut columns, shape(n * el));
            self.v.write_2d(first * el, n * el, pitch, &columns)?;
            Ok(())
        } else {
            self.buffer_mut(which).write(first * row, rows)
        }
    }

    /// Applies runs of cell moves, in order, to both tensors. In host memory the transposed V
    /// is processed row by row (each row stays in cache while every run moves through it)
    /// instead of run by run over the whole tensor.
    pub fn apply_moves(&mut self, lay: VGeometry, moves: &[(usize, usize, usize)]) -> Result<()> {
        let (k_row, v_row) = (self.k_row, self.v_row);
        move_rows(self.k.as_mut(), k_row, moves)?;
        if !lay.v_trans {
            return move_rows(self.v.as_mut(), v_row, moves);
        }
        let el = lay.v_el;
        let row_bytes = lay.size * el;
        match self.v.as_host_mut() {
            Some(bytes) => {
                let (len, want) = (bytes.len(), row_bytes * self.n_embd_v);
                let rows = bytes.get_mut(..want).ok_or_else(|| {
                    KvError::OutOfRange(format!(
                        "transposed V of {len} bytes is shorter than {} rows of {row_bytes}",
                        self.n_embd_v
                    ))
                })?;
                match el {
                    2 => move_transposed::<2>(rows, row_bytes, moves),
                    4 => move_transposed::<4>(rows, row_bytes, moves),
                    _ => {
                        for row in rows.chunks_exact_mut(row_bytes) {
                            for &(src, dst, n) in moves {
                                row.copy_within(src * el..(src + n) * el, dst * el);
                            }
                        }
                        Ok(())
                    }
                }
            }
            None => {
                for &(src, dst, n) in moves {
                    self.v
                        .copy_within_2d(src * el, dst * el, n * el, row_bytes, self.n_embd_v)?;
                }
                Ok(())
            }
        }
    }

    /// The buffer of `which`.
    pub fn buffer(&self, which: Tensor) -> &dyn KvBuffer {
        match which {
            Tensor::K => self.k.as_ref(),
            Tensor::V => self.v.as_ref(),
        }
    }

    /// The buffer of `which`, mutable.
    pub fn buffer_mut(&mut self, which: Tensor) -> &mut dyn KvBuffer {
        match which {
            Tensor::K => self.k.as_mut(),
            Tensor::V => self.v.as_mut(),
        }
    }
}

/// Moves runs of whole rows inside one buffer.
fn move_rows(buf: &mut dyn KvBuffer, row: usize, moves: &[(usize, usize, usize)]) -> Result<()> {
    if let Some(bytes) = buf.as_host_mut() {
        for &(src, dst, n) in moves {
            bytes.copy_within(src * row..(src + n) * row, dst * row);
        }
        return Ok(());
    }
    for &(src, dst, n) in moves {
        buf.copy_within(src * row, dst * row, n * row)?;
    }
    Ok(())
}

/// Runs of this many cells or fewer are moved element by element in a transposed V: a
/// fragmented cache moves many single cells, and a `memmove` call per 2-byte element costs far
/// more than the copy.
const SHORT_RUN: usize = 8;

/// Rows of a transposed V moved together: each element move of the plan is applied to all of
/// them before the next, so the plan is read once per group instead of once per row.
const ROWS_PER_PASS: usize = 4;

/// One step of a transposed-V move plan, the same for every row.
enum VStep {
    /// Element copies `pairs[range]`, each `(source byte, destination byte)` of an `N`-byte
    /// element.
    Elements(std::ops::Range<usize>),
    /// `copy_within(src..src + len, dst)`, in bytes: a long run, or one that overlaps itself
    /// moving up.
    Span(usize, usize, usize),
}

/// Applies `moves` (in cells, in order) to every row of a transposed V whose elements are `N`
/// bytes (`rows`: whole rows of `row_bytes`). The moves are checked against the row once and
/// turned into one plan of byte offsets; then rows are processed [`ROWS_PER_PASS`] at a time,
/// every step of the plan on each row of the group, in plan order, so each row sees exactly
/// the copies, in the order, of applying the moves to it alone.
fn move_transposed<const N: usize>(
    rows: &mut [u8],
    row_bytes: usize,
    moves: &[(usize, usize, usize)],
) -> Result<()> {
    let size = row_bytes / N;
    let mut pairs: Vec<(usize, usize)> = Vec::new();
    let mut steps: Vec<VStep> = Vec::new();
    for &(src, dst, n) in moves {
        let fits = |at: usize| at.checked_add(n).is_some_and(|end| end <= size);
        if !fits(src) || !fits(dst) {
            return Err(KvError::OutOfRange(format!(
                "move of {n} cells from {src} to {dst} exceeds the {size} cells of a V row"
            )));
        }
        if n <= SHORT_RUN && (dst <= src || src + n <= dst) {
            let first = pairs.len();
            pairs.extend((0..n).map(|k| ((src + k) * N, (dst + k) * N)));
            match steps.last_mut() {
                Some(VStep::Elements(range)) => range.end = pairs.len(),
                _ => steps.push(VStep::Elements(first..pairs.len())),
            }
        } else {
            steps.push(VStep::Span(src * N, dst * N, n * N));
        }
    }
    for group in rows.chunks_mut(ROWS_PER_PASS * row_bytes) {
        let n_rows = group.len() / row_bytes;
        for step in &steps {
            match step {
                VStep::Span(src, dst, len) => {
                    for row in group.chunks_exact_mut(row_bytes) {
                        row.copy_within(*src..*src + *len, *dst);
                    }
                }
                // SAFETY: every pair's source and destination element lies inside a row
                // (checked above: both runs end within `size` elements of `N` bytes, so
                // offset + N <= row_bytes), and row r < n_rows of the group starts at
                // r * row_bytes inside `group`; reads and writes are unaligned-safe.
                VStep::Elements(range) => unsafe {
                    copy_elements::<N>(group.as_mut_ptr(), row_bytes, n_rows, &pairs[range.clone()])
                },
            }
        }
    }
    Ok(())
}

/// Copies each `(source, destination)` element of `pairs` in `n_rows` rows at `base`,
/// `row_bytes` apart: pair by pair, all rows of the group for each pair.
///
/// # Safety
/// `base` is valid for reads and writes of `n_rows * row_bytes` bytes, and every offset in
/// `pairs` plus `N` is at most `row_bytes`.
#[inline]
unsafe fn copy_elements<const N: usize>(
    base: *mut u8,
    row_bytes: usize,
    n_rows: usize,
    pairs: &[(usize, usize)],
) {
    if n_rows == ROWS_PER_PASS {
        // a full group: the row loop has a constant count, so it unrolls
        for &(src, dst) in pairs {
            for r in 0..ROWS_PER_PASS {
                unsafe {
                    let row = base.add(r * row_bytes);
                    let e = std::ptr::read_unaligned(row.add(src).cast::<[u8; N]>());
                    std::ptr::write_unaligned(row.add(dst).cast::<[u8; N]>(), e);
                }
            }
        }
        return;
    }
    for r in 0..n_rows {
        for &(src, dst) in pairs {
            unsafe {
                let row = base.add(r * row_bytes);
                let e = std::ptr::read_unaligned(row.add(src).cast::<[u8; N]>());
                std::ptr::write_unaligned(row.add(dst).cast::<[u8; N]>(), e);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::MAP_MIN;

    fn layer(v_trans: bool) -> (LayerTensors, VGeometry) {
        let lay = VGeometry {
            size: 4,
            v_trans,
            v_el: 2,
        };
        let l = LayerTensors::allocate(
            0,
            2,
            3,
            GgmlType::F16,
            GgmlType::F16,
            4,
            &mut host_allocator,
        )
        .unwrap();
        (l, lay)
    }

    #[test]
    fn transposed_v_round_trips_rows_and_lays_columns_out() {
        let (mut l, lay) = layer(true);
        let rows: Vec<u8> = (1..=12).collect(); // 2 cells x 3 elements x 2 bytes
        l.write_rows(Tensor::V, lay, 1, &rows).unwrap();
        assert_eq!(l.read_rows(Tensor::V, lay, 1, 2).unwrap(), rows);
        let raw = l.v.as_host().unwrap();
        // element j of cell c sits at (c + j * size) * el
        assert_eq!(&raw[2..4], &[1, 2]); // cell 1, j 0
        assert_eq!(&raw[4..6], &[7, 8]); // cell 2, j 0
        assert_eq!(&raw[(1 + 4) * 2..(1 + 4) * 2 + 2], &[3, 4]); // cell 1, j 1
    }

    #[test]
    fn regression_reading_zero_transposed_v_rows_is_empty_not_a_panic() {
        // readV(layer, first, 0) panicked in the column split (a zero chunk size) and reached JS
        // as ERR_KV_INTERNAL
        let (l, lay) = layer(true);
        assert_eq!(l.read_rows(Tensor::V, lay, 2, 0).unwrap(), Vec::<u8>::new());
    }

    #[test]
    fn move_cells_moves_both_layouts() {
        for v_trans in [false, true] {
            let (mut l, lay) = layer(v_trans);
            let rows: Vec<u8> = (1..=6).collect();
            l.write_rows(Tensor::V, lay, 3, &rows).unwrap();
            l.write_rows(Tensor::K, lay, 3, &[9, 9, 9, 9]).unwrap();
            l.apply_moves(lay, &[(3, 0, 1)]).unwrap();
            assert_eq!(l.read_rows(Tensor::V, lay, 0, 1).unwrap(), rows);
            assert_eq!(l.read_rows(Tensor::K, lay, 0, 1).unwrap(), vec![9, 9, 9, 9]);
        }
    }

    /// The plain definition of a transposed-V move: every row, every move in order, one
    /// `copy_within` each.
    fn move_row_by_row(
        rows: &mut [u8],
        row_bytes: usize,
        el: usize,
        moves: &[(usize, usize, usize)],
    ) {
        for row in rows.chunks_exact_mut(row_bytes) {
            for &(src, dst, n) in moves {
                row.copy_within(src * el..(src + n) * el, dst * el);
            }
        }
    }

    proptest::proptest! {
        /// Any moves (short and long runs, up and down, self-overlapping, chained: a later move
        /// reading what an earlier one wrote), rows not a multiple of a group: the grouped
        /// element plan leaves every row as applying the moves to it one by one does.
        #[test]
        fn transposed_moves_match_moving_row_by_row(
            size in 1usize..300,
            n_rows in 1usize..11,
            el4 in proptest::bool::ANY,
            raw in proptest::collection::vec((0usize..1000, 0usize..1000, 1usize..40), 0..60),
        ) {
            let el = if el4 { 4 } else { 2 };
            let moves: Vec<(usize, usize, usize)> = raw
                .into_iter()
                .map(|(s, d, n)| {
                    let n = if n > 12 { n % 12 + 1 } else { n }.min(size);
                    (s % (size - n + 1), d % (size - n + 1), n)
                })
                .collect();
            let row_bytes = size * el;
            let mut want: Vec<u8> = (0..n_rows * row_bytes).map(|i| (i * 7 + i / 251) as u8).collect();
            let mut got = want.clone();
            move_row_by_row(&mut want, row_bytes, el, &moves);
            if el4 {
                move_transposed::<4>(&mut got, row_bytes, &moves).unwrap();
            } else {
                move_transposed::<2>(&mut got, row_bytes, &moves).unwrap();
            }
            proptest::prop_assert_eq!(got, want);
        }
    }

    #[test]
    fn a_transposed_move_past_the_row_is_an_error_not_a_panic() {
        let mut rows = vec![0u8; 2 * 8 * 2];
        for moves in [
            [(7, 0, 2)],
            [(0, 7, 2)],
            [(usize::MAX, 0, 1)],
            [(0, 0, usize::MAX)],
        ] {
            let err = move_transposed::<2>(&mut rows, 16, &moves).unwrap_err();
            assert!(matches!(err, KvError::OutOfRange(_)), "{moves:?}: {err}");
        }
    }

    #[test]
    fn a_buffer_is_resident_as_its_pages_are_written_and_gives_them_back_when_released() {
        let page = page_size();
        let mut b = HostBuffer::new(MAP_MIN).unwrap();
        assert_eq!(b.resident_bytes(), 0, "mapped pages are not committed");
        b.fill_zero().unwrap();
        assert_eq!(b.resident_bytes(), 0);
        b.write(100, &[1, 2]).unwrap();
        assert_eq!(b.resident_bytes(), page, "one page written");
        b.write(page - 1, &[1, 2]).unwrap();
        assert_eq!(
            b.resident_bytes(),
            2 * page,
            "a write across a page boundary"
        );
        b.copy_within(0, 5 * page, 3 * page).unwrap();
        assert_eq!(b.resident_bytes(), 5 * page);
        b.as_host_mut().unwrap();
        assert_eq!(b.resident_bytes(), MAP_MIN, "raw access counts every page");
        b.fill_zero().unwrap();
        assert_eq!(b.resident_bytes(), MAP_MIN, "zeroed in place, pages kept");
        assert!(b.as_host().unwrap().iter().all(|&x| x == 0));
        b.write(100, &[1, 2]).unwrap();
        b.release().unwrap();
        let kept = if cfg!(unix) { 0 } else { MAP_MIN };
        assert_eq!(b.resident_bytes(), kept, "zeroed by handing the pages back");
        assert!(b.as_host().unwrap().iter().all(|&x| x == 0));
        b.write(7, &[9]).unwrap();
        assert_eq!(
            b.as_host().unwrap()[7],
            9,
            "released pages are usable again"
        );
    }

    /// A strided write lands its pieces, counts exactly the pages they touch, and refuses a
    /// span past the end before writing anything.
    #[test]
    fn a_strided_write_lands_its_pieces_and_counts_the_pages_they_touch() {
        let page = page_size();
        for pitch in [page / 2, 3 * page] {
            let mut b = HostBuffer::new(MAP_MIN).unwrap();
            let src: Vec<u8> = (1..=40).collect();
            b.write_2d(8, 4, pitch, &src).unwrap();
            let bytes = b.as_host().unwrap();
            for (r, piece) in src.chunks(4).enumerate() {
                assert_eq!(
                    &bytes[8 + r * pitch..8 + r * pitch + 4],
                    piece,
                    "pitch {pitch}"
                );
            }
            let pages = if pitch < page { 10 * pitch / page } else { 10 };
            assert_eq!(b.resident_bytes(), pages * page, "pitch {pitch}");
            let e = b.write_2d(MAP_MIN - pitch, 4, pitch, &src).unwrap_err();
            assert!(matches!(e, KvError::OutOfRange(_)), "{e}");
        }
    }

    /// Whether a write is populated first is decided by the pages it touches, not by whether
    /// anything was written before: a cache whose first block went in already still has
    /// fresh pages for every later one.
    #[test]
    fn the_page_map_tells_which_ranges_hold_only_written_pages() {
        let page = page_size();
        let mut m = PageMap::new(200 * page).unwrap();
        assert!(m.all_set(0, 0), "an empty range");
        assert!(!m.all_set(0, 1));
        m.set(page, 70 * page, true);
        assert!(m.all_set(page, 70 * page));
        assert!(m.all_set(page + 5, 70 * page - 1));
        assert!(
            !m.all_set(page - 1, 2 * page),
            "one byte on an unwritten page"
        );
        assert!(
            !m.all_set(69 * page, 70 * page + 1),
            "across a word into an unwritten page"
        );
        m.set(3 * page, 4 * page, false);
        assert!(!m.all_set(page, 70 * page));
        assert_eq!(m.count, 68);
    }

    /// A range hands back only its whole pages: the bytes of partial pages at either end stay,
    /// and the page count follows.
    #[test]
    fn releasing_a_range_hands_back_its_whole_pages_only() {
        let page = page_size();
        let mut b = HostBuffer::new(MAP_MIN).unwrap();
        b.write(0, &vec![7; MAP_MIN]).unwrap();
        assert_eq!(b.resident_bytes(), MAP_MIN);
        // from the middle of page 1 to the middle of page 5: pages 2, 3, 4 go
        b.release_range(page + page / 2, 4 * page).unwrap();
        let bytes = b.as_host().unwrap();
        if cfg!(unix) {
            assert_eq!(b.resident_bytes(), MAP_MIN - 3 * page);
            assert!(bytes[2 * page..5 * page].iter().all(|&x| x == 0));
        }
        assert!(
            bytes[page..2 * page].iter().all(|&x| x == 7),
            "a partial page stays"
        );
        assert!(
            bytes[5 * page..6 * page].iter().all(|&x| x == 7),
            "a partial page stays"
        );
        assert!(b.release_range(MAP_MIN - 1, 2).is_err(), "out of range");
        b.release_range(0, MAP_MIN).unwrap();
        if cfg!(unix) {
            assert_eq!(b.resident_bytes(), 0);
            assert!(b.zero, "a buffer handed back whole is zero again");
        }
    }

    #[test]
    fn a_small_buffer_is_zeroed_in_place_when_released() {
        let mut b = HostBuffer::new(1 << 16).unwrap();
        b.write(0, &[5]).unwrap();
        b.release().unwrap();
        assert_eq!(b.resident_bytes(), 1 << 16);
        assert_eq!(b.as_host().unwrap()[0], 0);
    }

    #[test]
    fn an_empty_buffer_maps_nothing_and_reads_nothing() {
        let mut b = HostBuffer::new(0).unwrap();
        assert_eq!((b.len(), b.resident_bytes()), (0, 0));
        b.fill_zero().unwrap();
        assert!(b.write(0, &[1]).is_err());
        assert_eq!(b.as_host().unwrap(), &[] as &[u8]);
    }

    #[test]
    fn out_of_range_is_an_error() {
        let mut b = HostBuffer::new(8).unwrap();
        assert!(b.write(6, &[0; 4]).is_err());
        assert!(b.copy_within(0, usize::MAX, 2).is_err());
    }
}
