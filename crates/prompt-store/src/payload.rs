//! A one-sequence state payload in today's layout (`n_stream` 1), assembled from verified blocks
//! in chain order: the bytes the core's transactional `state_read` loads. The buffer is sized
//! for every block the backend reported present and written in place as blocks arrive; when
//! the chain ends early (a block evicted meanwhile, or corrupt), `finish` compacts it.

use llama_kv_cache::state::cells::put_cell_one_id;
use llama_kv_cache::state::cells::{cell_len, CellExt};
use llama_kv_cache::state::{cell_count_header, data_header, k_header, n_stream_header, v_header};
use llama_kv_cache::tensors::transpose::{transpose, Shape};
use llama_kv_cache::KvError;

use crate::block::BlockRows;
use crate::error::{StoreError, StoreResult};
use crate::geometry::Geometry;

/// Builds the payload of up to `max_blocks` blocks of `bt` tokens for sequence `seq`.
pub struct PayloadBuilder<'g> {
    geometry: &'g Geometry,
    bt: usize,
    max_blocks: usize,
    seq: i32,
    v_trans: bool,
    out: Vec<u8>,
    /// Per layer: offsets of the K rows and of the V data.
    k_at: Vec<usize>,
    v_at: Vec<usize>,
    blocks: usize,
}

impl<'g> PayloadBuilder<'g> {
    /// An empty payload with room for `max_blocks` blocks.
    pub fn new(
        geometry: &'g Geometry,
        bt: usize,
        max_blocks: usize,
        seq: i32,
        v_trans: bool,
    ) -> StoreResult<Self> {
        let n = max_blocks * bt;
        // n_stream, cell_count; per cell pos, n_seq_id, seq; v_trans, n_layer; per layer the K
        // and V headers (type + row size, or type + element size + channels: 12 bytes each)
        let cell = cell_len(1, CellExt::None);
        let total =
            8 + cell * n + 8 + 24 * geometry.layers.len() + n * geometry.bytes_per_token() as usize;
        let mut out = Vec::new();
        out.try_reserve_exact(total).map_err(|_| {
            StoreError::Cache(KvError::Backend(format!(
                "cannot allocate {total} bytes for the restored state"
            )))
        })?;
        out.resize(total, 0);
        let mut at = 0;
        let put = |out: &mut [u8], at: &mut usize, bytes: &[u8]| {
            out[*at..*at + bytes.len()].copy_from_slice(bytes);
            *at += bytes.len();
        };
        put(&mut out, &mut at, &n_stream_header(1));
        put(&mut out, &mut at, &cell_count_header(n as u32));
        for (p, dst) in out[at..at + cell * n].chunks_exact_mut(cell).enumerate() {
            put_cell_one_id(
                dst.try_into().expect("one-id cells are 12 bytes"),
                p as i32,
                seq,
            );
        }
        at += cell * n;
        let (header, len) = data_header(v_trans, geometry.layers.len() as u32, None);
        put(&mut out, &mut at, &header[..len]);
        let mut k_at = Vec::with_capacity(geometry.layers.len());
        for l in &geometry.layers {
            put(&mut out, &mut at, &k_header(l.k_type, l.k_row as usize));
            k_at.push(at);
            at += n * l.k_row as usize;
        }
        let mut v_at = Vec::with_capacity(geometry.layers.len());
        for l in &geometry.layers {
            put(
                &mut out,
                &mut at,
                &v_header(l.v_type, l.v_row as usize, v_trans),
            );
            v_at.push(at);
            at += n * l.v_row as usize;
        }
        debug_assert_eq!(at, total);
        Ok(PayloadBuilder {
            geometry,
            bt,
            max_blocks,
            seq,
            v_trans,
            out,
            k_at,
            v_at,
            blocks: 0,
        })
    }

    /// Blocks added so far.
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// Adds the next block's rows.
    pub fn push(&mut self, rows: &BlockRows<'_>) {
        let (b, bt, n) = (self.blocks, self.bt, self.max_blocks * self.bt);
        for (il, l) in self.geometry.layers.iter().enumerate() {
            let k_row = l.k_row as usize;
            let at = self.k_at[il] + b * bt * k_row;
            self.out[at..at + bt * k_row].copy_from_slice(rows.k(il));
            let v_row = l.v_row as usize;
            if self.v_trans {
                // the block's bt rows of n_embd channels become columns b*bt.. of the n_embd
                // runs of n elements
                let el = l.v_type.type_size();
                let at = self.v_at[il] + b * bt * el;
                let dst = &mut self.out[at..];
                let shape = Shape {
                    rows: bt,
                    cols: v_row / el,
                    el,
                    src_stride: v_row,
                    dst_stride: n * el,
                };
                transpose(rows.v(il), dst, shape);
            } else {
                let at = self.v_at[il] + b * bt * v_row;
                self.out[at..at + bt * v_row].copy_from_slice(rows.v(il));
            }
        }
        self.blocks += 1;
    }

    /// The payload of the blocks added (compacted when fewer than `max_blocks` arrived).
    pub fn finish(self) -> StoreResult<Vec<u8>> {
        if self.blocks == self.max_blocks {
            return Ok(self.out);
        }
        let m = self.blocks;
        let mut small = PayloadBuilder::new(self.geometry, self.bt, m, self.seq, self.v_trans)?;
        let (n_old, n_new) = (self.max_blocks * self.bt, m * self.bt);
        for (il, l) in self.geometry.layers.iter().enumerate() {
            let k = n_new * l.k_row as usize;
            small.out[small.k_at[il]..small.k_at[il] + k]
                .copy_from_slice(&self.out[self.k_at[il]..self.k_at[il] + k]);
            if self.v_trans {
                let el = l.v_type.type_size();
                for j in 0..l.v_row as usize / el {
                    let (from, to) = (
                        self.v_at[il] + j * n_old * el,
                        small.v_at[il] + j * n_new * el,
                    );
                    small.out[to..to + n_new * el]
                        .copy_from_slice(&self.out[from..from + n_new * el]);
                }
            } else {
                let v = n_new * l.v_row as usize;
                small.out[small.v_at[il]..small.v_at[il] + v]
                    .copy_from_slice(&self.out[self.v_at[il]..self.v_at[il] + v]);
            }
        }
        Ok(small.out)
    }
}
