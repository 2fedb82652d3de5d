//! The cache view (`llama_kv_cache_view_update`): a snapshot of every cell for debugging and UIs.

use crate::alloc;
use crate::cache::SeedCache;
use crate::error::Result;

/// A snapshot of the cells, as llama.cpp's `llama_kv_cache_view`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheView {
    /// Per cell: position plus pending delta (what attention will see after the K-shift).
    pub pos: Vec<i32>,
    /// Per cell: its sequence ids, ascending, at most `n_seq_max` of them.
    pub seqs: Vec<Vec<i32>>,
    /// Cells owned by at least one sequence.
    pub used_cells: u32,
    /// Sum over cells of the number of owning sequences.
    pub token_count: u64,
    /// Length of the largest run of cells owned by no sequence.
    pub max_contiguous: u32,
    /// First cell of that run, -1 when there is none.
    pub max_contiguous_idx: i32,
}

/// Every cell's metadata as columns: one call for a view of any cache size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CellColumns {
    /// Per cell: position, -1 when free.
    pub pos: Vec<i32>,
    /// Per cell: position change pending for the K-shift.
    pub delta: Vec<i32>,
    /// Per cell: recurrent copy source (-1 when none).
    pub src: Vec<i32>,
    /// Per cell: recurrent tail (for cell i, the cell holding sequence i's state; -1 when none).
    pub tail: Vec<i32>,
    /// Sequence sets in compressed-row form: cell i's sequence ids are
    /// `seq_ids[seq_offsets[i]..seq_offsets[i + 1]]`, ascending. `size + 1` entries.
    pub seq_offsets: Vec<u32>,
    /// The sequence ids of every cell, concatenated.
    pub seq_ids: Vec<i32>,
    /// Per cell `x, y, tok` (its extension), in a cache that keeps them; empty otherwise.
    pub ext: Vec<i32>,
}

impl SeedCache {
    /// Copies every cell's metadata into [`CellColumns`].
    pub fn cell_columns(&self) -> Result<CellColumns> {
        let cells = &self.cells;
        let size = cells.len();
        let mut seq_offsets = alloc::with_capacity(size + 1, "the cell columns")?;
        let mut seq_ids = alloc::with_capacity(cells.n_tokens() as usize, "the cell columns")?;
        let mut ext = alloc::with_capacity(3 * cells.ext_column().len(), "the cell columns")?;
        ext.extend(cells.ext_column().iter().flat_map(|e| [e.x, e.y, e.tok]));
        seq_offsets.push(0);
        for i in 0..size {
            seq_ids.extend(cells.seqs(i).iter().map(|s| s as i32));
            seq_offsets.push(seq_ids.len() as u32);
        }
        Ok(CellColumns {
            pos: alloc::copy(cells.pos_column(), "the cell columns")?,
            delta: alloc::copy(cells.delta_column(), "the cell columns")?,
            src: alloc::copy(cells.src_column(), "the cell columns")?,
            tail: alloc::copy(cells.tail_column(), "the cell columns")?,
            seq_offsets,
            seq_ids,
            ext,
        })
    }

    /// Builds the view, listing at most `n_seq_max` sequence ids per cell.
    pub fn view(&self, n_seq_max: usize) -> CacheView {
        let cells = &self.cells;
        let size = cells.len();
        let mut view = CacheView {
            pos: Vec::with_capacity(size),
            seqs: Vec::with_capacity(size),
            used_cells: 0,
            token_count: 0,
            max_contiguous: 0,
            max_contiguous_idx: -1,
        };
        let mut run_start: Option<usize> = None;
        for i in 0..size {
            let seqs = cells.seqs(i);
            view.pos.push(cells.pos(i).wrapping_add(cells.delta(i)));
            view.token_count += seqs.len() as u64;
            if !seqs.is_empty() {
                view.used_cells += 1;
                if let Some(start) = run_start.take() {
                    if (i - start) as u32 > view.max_contiguous {
                        view.max_contiguous = (i - start) as u32;
                        view.max_contiguous_idx = start as i32;
                    }
                }
            } else if run_start.is_none() {
                run_start = Some(i);
            }
            view.seqs
                .push(seqs.iter().take(n_seq_max).map(|s| s as i32).collect());
        }
        if let Some(start) = run_start {
            if (size - start) as u32 > view.max_contiguous {
                view.max_contiguous = (size - start) as u32;
                view.max_contiguous_idx = start as i32;
            }
        }
        view
    }
}
