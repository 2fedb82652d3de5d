//! Slot search (`find_slot`) for transformer and recurrent caches, and the decode-side steps
//! around it (`prepare_batch`).

use crate::cache::SeedCache;
use crate::cell_ext::CellExtValue;
use crate::cells::ubatch::UBatch;
use crate::cells::SeqSet;
use crate::error::{KvError, Result};

/// Where a micro-batch was placed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    /// First cell of the slot (the cache's `head` right after placement).
    pub head: u32,
    /// Number of tokens placed (transformer) or sequences (recurrent).
    pub len: u32,
    /// Cells the computation should look at after placement (`n`).
    pub n: u32,
}

/// Options of [`SeedCache::prepare_batch`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrepareOptions {
    /// Advance `head` past the slot afterwards, as the seed-era decode did after computing a
    /// ubatch (llama.cpp 0.1.103 leaves it at the slot start).
    pub advance_head: bool,
}

impl Default for PrepareOptions {
    fn default() -> Self {
        PrepareOptions { advance_head: true }
    }
}

/// The refusal of a ubatch with cell extensions by a cache that keeps none (out of line: the
/// placement path stays small).
#[cold]
pub(crate) fn no_cell_ext() -> KvError {
    KvError::InvalidArg(
        "the ubatch carries cell extensions, but this cache keeps none (cellExt 'none'): \
         only M-RoPE and PLE caches record them"
            .into(),
    )
}

fn pad(x: u32, p: u32) -> u32 {
    x.div_ceil(p) * p
}

impl SeedCache {
    /// Places the ubatches of one decode with [`SeedCache::find_slot`], all or none (the `place`
    /// of today's memories, for the seed's cache): the slot of each, or `None` (an ordinary
    /// outcome) with the cells, `head` and `n` as before when one does not fit. Its undo
    /// record is a copy of the cell table, a pass over the cells per call; the seed's own
    /// decode path is `find_slot` per ubatch with its slot restorer.
    pub fn place(&mut self, ubatches: &[UBatch]) -> Result<Option<Vec<Slot>>> {
        let kept = (self.cells.clone(), self.head, self.n);
        let mut slots = Vec::with_capacity(ubatches.len());
        for ub in ubatches {
            match self.find_slot(ub) {
                Ok(Some(slot)) => slots.push(slot),
                other => {
                    (self.cells, self.head, self.n) = kept;
                    return other.map(|_| None);
                }
            }
        }
        Ok(Some(slots))
    }

    /// The seed's `find_slot`: places the ubatch and returns where, or `None` when it does not
    /// fit (an ordinary outcome, not an error). Errors only for malformed ubatches, in which
    /// case the cache is unchanged.
    pub fn find_slot(&mut self, ubatch: &UBatch) -> Result<Option<Slot>> {
        ubatch.validate(self.params.n_seq_max)?;
        if !ubatch.ext.is_empty() && self.params.cell_ext.is_none() {
            return Err(no_cell_ext());
        }
        if self.params.recurrent {
            Ok(self.find_slot_recurrent(ubatch))
        } else {
            Ok(self.find_slot_transformer(ubatch))
        }
    }

    fn find_slot_transformer(&mut self, ubatch: &UBatch) -> Option<Slot> {
        let size = self.params.size;
        let n_tokens = ubatch.n_tokens();
        if n_tokens > size {
            return None;
        }
        let (size, n) = (size as usize, n_tokens as usize);
        let mut head = self.head as usize;
        let mut n_tested = 0usize;
        // the seed's scan, with runs of occupied cells skipped a word at a time; `head` and the
        // failure point come out exactly as the cell-by-cell loop leaves them
        loop {
            if head + n > size {
                n_tested += size - head;
                head = 0;
                continue;
            }
            let first_occupied = self.cells.next_occupied_before(head, head + n);
            if first_occupied >= head + n {
                break;
            }
            n_tested += first_occupied - head + 1;
            head = first_occupied + 1;
            if n_tested >= size {
                self.head = head as u32;
                return None;
            }
            // every window starting on an occupied cell fails at once, one cell at a time
            if head + n <= size {
                let run_end = self.cells.next_free_before(head, size - n + 1);
                if run_end > head {
                    let k = run_end - head;
                    if n_tested + k >= size {
                        self.head = (head + (size - n_tested)) as u32;
                        return None;
                    }
                    n_tested += k;
                    head = run_end;
                }
            }
        }
        let head = head as u32;
        self.head = head;
        // the window is free (the scan above stopped on it)
        let per_group = ubatch.n_seq_tokens as usize;
        self.cells.fill_free(head as usize, &ubatch.pos[..n], |k| {
            &ubatch.seq_ids[k / per_group]
        });
        if self.cells.keeps_ext() {
            self.record_ext(head as usize, ubatch);
        }
        self.cells.used += n_tokens;
        self.cells.settle();
        Some(Slot {
            head,
            len: n_tokens,
            n: self.n,
        })
    }

    /// Gives the cells `first..` that a ubatch was placed in their extensions, as
    /// llama.cpp's `apply_ubatch` does.
    fn record_ext(&mut self, first: usize, ubatch: &UBatch) {
        for k in 0..ubatch.pos.len() {
            let ext = self.ubatch_ext(ubatch, k);
            self.cells.set_ext(first + k, ext);
        }
    }

    /// The extension token `k` of `ubatch` gives its cell: the ubatch's own, or an M-RoPE
    /// text token's (its position as `x` and `y`; PLE caches: 0) with no token id.
    pub(crate) fn ubatch_ext(&self, ubatch: &UBatch, k: usize) -> CellExtValue {
        match ubatch.ext.get(k) {
            Some(&e) => e,
            None if self.params.mrope => CellExtValue {
                x: ubatch.pos[k],
                y: ubatch.pos[k],
                tok: -1,
            },
            None => CellExtValue::default(),
        }
    }

    /// Recurrent placement. Where the seed would hit an assertion (no empty cell left for a
    /// sequence that needs one), the cells are restored and the placement fails instead.
    fn find_slot_recurrent(&mut self, ubatch: &UBatch) -> Option<Slot> {
        let size = self.params.size as usize;
        let snapshot = (self.cells.clone(), self.head, self.n);
        let n_seqs = ubatch.seq_ids.len();
        let first = |g: usize| ubatch.seq_ids[g][0] as usize;

        // ids are < n_seq_max <= size, so the seed's "seq_id >= size" failure cannot happen;
        // sequences that become shared lose their old tail
        for ids in &ubatch.seq_ids {
            for &id in &ids[1..] {
                let seq = id as usize;
                let tail = self.cells.tail(seq);
                if tail >= 0 {
                    let cell = tail as usize;
                    self.cells.remove_seq(cell, seq);
                    self.cells.set_tail(seq, -1);
                    if self.cells.is_empty_cell(cell) {
                        self.cells.set_pos(cell, -1);
                        self.cells.set_src(cell, -1);
                        self.cells.used = self.cells.used.wrapping_sub(1);
                    }
                }
            }
        }

        let next_empty = |cells: &crate::cells::Cells, mut from: usize| -> usize {
            for _ in 0..size {
                if from >= size {
                    from -= size;
                }
                if cells.is_empty_cell(from) {
                    break;
                }
                from += 1;
            }
            from
        };
        let mut next_empty_cell = next_empty(&self.cells, self.head as usize);
        let mut min = size as i32 - 1;
        let mut max = 0i32;
        for s in 0..n_seqs {
            let seq = first(s);
            let tail = self.cells.tail(seq);
            let owns_cell = tail >= 0 && self.cells.seqs(tail as usize).len() == 1;
            if tail >= 0 && !self.cells.seqs(tail as usize).contains(seq) {
                return self.restore_failed(snapshot);
            }
            if !owns_cell {
                if next_empty_cell >= size || !self.cells.is_empty_cell(next_empty_cell) {
                    // the seed asserts here (llama.cpp crashes); fail cleanly instead
                    return self.restore_failed(snapshot);
                }
                if tail >= 0 {
                    let orig = self.cells.get(tail as usize);
                    self.cells.set_pos(next_empty_cell, orig.pos);
                    self.cells.set_src(next_empty_cell, orig.src);
                    self.cells.remove_seq(tail as usize, seq);
                    self.cells.insert_seq(next_empty_cell, seq);
                }
                self.cells.set_tail(seq, next_empty_cell as i32);
                if s + 1 < n_seqs {
                    next_empty_cell = next_empty(&self.cells, next_empty_cell + 1);
                }
            }
            let tail = self.cells.tail(seq);
            min = min.min(tail);
            max = max.max(tail);
        }
        if min < 0 || min as usize + n_seqs > size {
            return self.restore_failed(snapshot);
        }

        // gather the groups' cells into [min, min + n_seqs), in group order
        for s in 0..n_seqs {
            let dst = s + min as usize;
            let src = self.cells.tail(first(s)) as usize;
            if dst != src {
                let a = self.cells.get(dst);
                let b = self.cells.get(src);
                let mut new_dst = a;
                let mut new_src = b;
                (new_dst.pos, new_src.pos) = (b.pos, a.pos);
                (new_dst.src, new_src.src) = (b.src, a.src);
                (new_dst.seqs, new_src.seqs) = (b.seqs, a.seqs);
                self.cells.set_cell(dst, new_dst);
                self.cells.set_cell(src, new_src);
                for seq in new_src.seqs.iter() {
                    self.cells.set_tail(seq, src as i32);
                }
                for seq in new_dst.seqs.iter() {
                    self.cells.set_tail(seq, dst as i32);
                }
            }
        }

        let per_group = ubatch.n_seq_tokens as usize;
        for s in 0..n_seqs {
            let cell = s + min as usize;
            let last_pos = ubatch.pos[per_group * s + per_group - 1];
            self.cells.set_pos(cell, last_pos);
            self.cells.set_seqs(cell, SeqSet::EMPTY);
            for &id in &ubatch.seq_ids[s] {
                self.cells.insert_seq(cell, id as usize);
                self.cells.set_tail(id as usize, cell as i32);
            }
        }

        self.cells.settle();
        self.head = min as u32;
        self.n = (max - min + 1) as u32;
        self.cells.used = (0..size).filter(|&i| !self.cells.is_empty_cell(i)).count() as u32;
        (self.n as usize >= n_seqs).then_some(Slot {
            head: self.head,
            len: n_seqs as u32,
            n: self.n,
        })
    }

    fn restore_failed(&mut self, snapshot: (crate::cells::Cells, u32, u32)) -> Option<Slot> {
        (self.cells, self.head, self.n) = snapshot;
        None
    }

    /// What llama.cpp's decode of the seed's era does around `find_slot` for one ubatch:
    /// restart the search at cell 0 when `head > used + 2 * n_tokens`, place the ubatch, set
    /// `n = min(size, max(padding, roundUp(cell_max, padding)))` for transformers, and (by
    /// default) move `head` past the slot as that decode did after computing it.
    ///
    /// The returned slot's `head` is where the ubatch's K/V rows go.
    pub fn prepare_batch(&mut self, ubatch: &UBatch, opts: PrepareOptions) -> Result<Option<Slot>> {
        ubatch.validate(self.params.n_seq_max)?;
        let n_tokens = ubatch.n_tokens();
        if self.head > self.cells.used.saturating_add(n_tokens.saturating_mul(2)) {
            self.head = 0;
        }
        let Some(mut slot) = self.find_slot(ubatch)? else {
            return Ok(None);
        };
        if !self.params.recurrent {
            let padding = self.params.padding();
            self.n = self
                .params
                .size
                .min(padding.max(pad(self.cell_max(), padding)));
            slot.n = self.n;
        }
        if opts.advance_head {
            self.head += n_tokens;
            if self.head >= self.params.size {
                self.head = 0;
            }
        }
        Ok(Some(slot))
    }
}
