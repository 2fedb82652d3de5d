//! One KV part of a one-sequence state payload in today's layout (`n_stream` 1, the rotation
//! recorded), written in place from verified rows: the bytes the core's transactional
//! `state_read` loads, and the parts of the files `write_file` writes.

use llama_kv_cache::state::cells::{cell_len, put_cell, put_cell_one_id, CellExt};
use llama_kv_cache::state::{cell_count_header, data_header, k_header, n_stream_header, v_header};
use llama_kv_cache::tensors::transpose::{transpose, Shape};
use llama_kv_cache::KvError;

use crate::block::BlockRows;
use crate::error::{StoreError, StoreResult};
use crate::geometry::Geometry;

/// Where the rows of one KV part go inside a payload buffer.
pub struct KvPartWriter<'g> {
    geometry: &'g Geometry,
    /// The extension the part's cells carry (none, or the payload's form of the rows' own).
    ext: CellExt,
    n: usize,
    v_trans: bool,
    /// The sequence every cell holds.
    seq: i32,
    /// Offset of the first cell's metadata (cells of a geometry with an extension get theirs
    /// from the rows put into them).
    cells_at: usize,
    /// Per layer: offsets of the K rows and of the V data.
    k_at: Vec<usize>,
    v_at: Vec<usize>,
}

/// Bytes of a KV part of `n` cells carrying `ext`.
pub fn part_len(geometry: &Geometry, ext: CellExt, n: usize) -> usize {
    // n_stream, cell_count; per cell pos, n_seq_id, its extension if any, seq; v_trans,
    // n_layer, n_rot_k, n_rot_v; per layer the K and V headers (type + row size, or type +
    // element size + channels)
    8 + cell_len(1, ext) * n
        + 16
        + 24 * geometry.layers.len()
        + n * geometry.bytes_per_token() as usize
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

impl<'g> KvPartWriter<'g> {
    /// Appends a part of `positions.len()` cells of sequence `seq` to `out` (headers written,
    /// rows zero and cell extensions llama.cpp's default until [`KvPartWriter::put`] fills
    /// them). The cells carry `ext`: none, or the form the payload's reader expects of the
    /// extensions the rows keep.
    pub fn begin(
        out: &mut Vec<u8>,
        geometry: &'g Geometry,
        ext: CellExt,
        positions: &[i32],
        seq: i32,
        v_trans: bool,
        rot: (u32, u32),
    ) -> StoreResult<Self> {
        let n = positions.len();
        let mut at = out.len();
        grow(out, part_len(geometry, ext, n))?;
        let put = |out: &mut [u8], at: &mut usize, bytes: &[u8]| {
            out[*at..*at + bytes.len()].copy_from_slice(bytes);
            *at += bytes.len();
        };
        put(out, &mut at, &n_stream_header(1));
        put(out, &mut at, &cell_count_header(n as u32));
        let cell = cell_len(1, ext);
        let cells_at = at;
        for (p, dst) in positions
            .iter()
            .zip(out[at..at + cell * n].chunks_exact_mut(cell))
        {
            if ext.is_none() {
                put_cell_one_id(dst.try_into().expect("one-id cells are 12 bytes"), *p, seq);
            } else {
                put_cell(dst, *p, ext, None, std::iter::once(seq));
            }
        }
        at += cell * n;
        let (header, len) = data_header(v_trans, geometry.layers.len() as u32, Some(rot));
        put(out, &mut at, &header[..len]);
        let mut k_at = Vec::with_capacity(geometry.layers.len());
        for l in &geometry.layers {
            put(out, &mut at, &k_header(l.k_type, l.k_row as usize));
            k_at.push(at);
            at += n * l.k_row as usize;
        }
        let mut v_at = Vec::with_capacity(geometry.layers.len());
        for l in &geometry.layers {
            put(out, &mut at, &v_header(l.v_type, l.v_row as usize, v_trans));
            v_at.push(at);
            at += n * l.v_row as usize;
        }
        debug_assert_eq!(at, out.len());
        Ok(KvPartWriter {
            geometry,
            ext,
            n,
            v_trans,
            seq,
            cells_at,
            k_at,
            v_at,
        })
    }

    /// Writes `rows` (of as many tokens as they hold) into cells `first..` of the part.
    pub fn put(&self, out: &mut [u8], first: usize, rows: &BlockRows<'_>) {
        self.put_from(out, first, rows, 0)
    }

    /// Writes the rows of `rows` from its row `skip` on into cells `first..` of the part.
    pub fn put_from(&self, out: &mut [u8], first: usize, rows: &BlockRows<'_>, skip: usize) {
        let m = rows.n_tokens() - skip;
        debug_assert!(first + m <= self.n);
        if !self.ext.is_none() {
            // each cell again, now with its extension (the core's cell writer knows where it
            // goes); its position is the one `begin` wrote
            let cell = cell_len(1, self.ext);
            for k in 0..m {
                let at = self.cells_at + (first + k) * cell;
                let dst = &mut out[at..at + cell];
                let pos = i32::from_le_bytes(dst[..4].try_into().expect("4 bytes"));
                let ext = Some(rows.ext(skip + k));
                put_cell(dst, pos, self.ext, ext, std::iter::once(self.seq));
            }
        }
        for (il, l) in self.geometry.layers.iter().enumerate() {
            let k_row = l.k_row as usize;
            let at = self.k_at[il] + first * k_row;
            out[at..at + m * k_row].copy_from_slice(&rows.k(il)[skip * k_row..]);
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
                    dst_stride: self.n * el,
                };
                transpose(&rows.v(il)[skip * v_row..], &mut out[at..], shape);
            } else {
                let at = self.v_at[il] + first * v_row;
                out[at..at + m * v_row].copy_from_slice(&rows.v(il)[skip * v_row..]);
            }
        }
    }
}
