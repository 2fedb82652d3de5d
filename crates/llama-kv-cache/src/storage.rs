//! Where the K and V tensors live: a byte-addressed buffer interface, host memory behind it, and
//! the per-layer tensor geometry (row sizes, the transposed-V layout).

use crate::error::{KvError, Result};
use crate::ggml_type::GgmlType;
use crate::transpose::{transpose, Shape};

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

/// A zero-initialised buffer in host memory.
pub struct HostBuffer {
    bytes: Vec<u8>,
    /// Nothing was written since the buffer was allocated or zeroed: the zero pages the OS
    /// handed out lazily need not be touched to zero them again.
    pristine: bool,
}

impl HostBuffer {
    /// Allocates `len` zero bytes (calloc: the OS maps zero pages on first touch), reporting
    /// allocation failure as an error instead of aborting.
    pub fn new(len: usize) -> Result<HostBuffer> {
        Ok(HostBuffer {
            bytes: crate::alloc::zeroed(len, "a tensor in host memory")?,
            pristine: true,
        })
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

impl KvBuffer for HostBuffer {
    fn len(&self) -> usize {
        self.bytes.len()
    }

    fn device(&self) -> Device {
        Device::Host
    }

    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        check_range("read", offset, dst.len(), self.bytes.len())?;
        dst.copy_from_slice(&self.bytes[offset..offset + dst.len()]);
        Ok(())
    }

    fn write(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        check_range("write", offset, src.len(), self.bytes.len())?;
        self.pristine = false;
        self.bytes[offset..offset + src.len()].copy_from_slice(src);
        Ok(())
    }

    fn copy_within(&mut self, src: usize, dst: usize, len: usize) -> Result<()> {
        check_range("copy source", src, len, self.bytes.len())?;
        check_range("copy destination", dst, len, self.bytes.len())?;
        self.pristine = false;
        self.bytes.copy_within(src..src + len, dst);
        Ok(())
    }

    fn fill_zero(&mut self) -> Result<()> {
        if !self.pristine {
            self.bytes.fill(0);
            self.pristine = true;
        }
        Ok(())
    }

    fn as_host(&self) -> Option<&[u8]> {
        Some(&self.bytes)
    }

    fn as_host_mut(&mut self) -> Option<&mut [u8]> {
        self.pristine = false;
        Some(&mut self.bytes)
    }
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
pub struct Layout {
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
    pub fn read_rows(&self, which: Tensor, lay: Layout, first: usize, n: usize) -> Result<Vec<u8>> {
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
        lay: Layout,
        first: usize,
        rows: &[u8],
    ) -> Result<()> {
        let row = self.row_size(which);
        let n = rows.len() / row;
        if which == Tensor::V && lay.v_trans {
            let el = lay.v_el;
            let mut columns =
                crate::alloc::zeroed(self.n_embd_v * n * el, "the V columns written")?;
            let shape = Shape {
                rows: n,
                cols: self.n_embd_v,
                el,
                src_stride: row,
                dst_stride: n * el,
            };
            transpose(rows, &mut columns, shape);
            self.v
                .write_2d(first * el, n * el, lay.size * el, &columns)?;
            Ok(())
        } else {
            self.buffer_mut(which).write(first * row, rows)
        }
    }

    /// Applies runs of cell moves, in order, to both tensors. In host memory the transposed V
    /// is processed row by row (each row stays in cache while every run moves through it)
    /// instead of run by run over the whole tensor.
    pub fn apply_moves(&mut self, lay: Layout, moves: &[(usize, usize, usize)]) -> Result<()> {
        let (k_row, v_row) = (self.k_row, self.v_row);
        move_rows(self.k.as_mut(), k_row, moves)?;
        if !lay.v_trans {
            return move_rows(self.v.as_mut(), v_row, moves);
        }
        let el = lay.v_el;
        let row_bytes = lay.size * el;
        match self.v.as_host_mut() {
            Some(bytes) => {
                let rows = bytes.chunks_exact_mut(row_bytes).take(self.n_embd_v);
                match el {
                    2 => rows.for_each(|row| move_elements::<2>(row, moves)),
                    4 => rows.for_each(|row| move_elements::<4>(row, moves)),
                    _ => rows.for_each(|row| {
                        for &(src, dst, n) in moves {
                            row.copy_within(src * el..(src + n) * el, dst * el);
                        }
                    }),
                }
                Ok(())
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

/// Runs of this many elements or fewer are moved element by element in a transposed V row: a
/// fragmented cache moves many single cells, and a library call per 2-byte element cost more
/// than the copy.
const SHORT_RUN: usize = 8;

/// Applies the moves (in cells) to one row of a transposed V whose elements are `N` bytes.
/// Each element of a short run is one `N`-byte load and store (the copy is forward, which is
/// right when the run moves down or does not overlap itself; otherwise `copy_within`).
fn move_elements<const N: usize>(row: &mut [u8], moves: &[(usize, usize, usize)]) {
    for &(src, dst, n) in moves {
        if n <= SHORT_RUN && (dst <= src || src + n <= dst) {
            for k in 0..n {
                let s = (src + k) * N;
                let e: [u8; N] = row[s..s + N].try_into().expect("a slice of N bytes");
                let d = (dst + k) * N;
                row[d..d + N].copy_from_slice(&e);
            }
        } else {
            row.copy_within(src * N..(src + n) * N, dst * N);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer(v_trans: bool) -> (LayerTensors, Layout) {
        let lay = Layout {
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

    #[test]
    fn out_of_range_is_an_error() {
        let mut b = HostBuffer::new(8).unwrap();
        assert!(b.write(6, &[0; 4]).is_err());
        assert!(b.copy_within(0, usize::MAX, 2).is_err());
    }
}
