//! The cache view (`llama_kv_cache_view_update`): a snapshot of every cell for debugging and UIs.

use crate::cache::KvCache;

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

impl KvCache {
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
