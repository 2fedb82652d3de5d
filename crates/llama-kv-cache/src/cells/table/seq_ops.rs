//! The sequence operations of the cell table, the cells' half of llama.cpp's `seq_rm`,
//! `seq_cp`, `seq_add` / `seq_div` and `seq_keep`: each visits only the 64-cell words that hold
//! positions in its range, and frees or moves a word that one sequence holds alone with column
//! fills instead of cell by cell. Every index stays exact, as the table's other mutations keep
//! it.

use crate::cells::seqs::SeqSet;
use crate::cells::set::{bits, select, NO_HI, NO_LO};
use crate::cells::table::{tighten, Cells, Freed, NO_POS};

impl Cells {
    /// Frees cell `i` of word `w`, whose sequences the caller has already dropped from their
    /// sets (the occupied set is the caller's too).
    #[inline(always)]
    fn free_cell(&mut self, i: usize) {
        self.seqs.set(i, SeqSet::EMPTY);
        self.pos[i] = -1;
        self.src[i] = -1;
    }

    /// The sequences other than `seq` that hold any cell.
    /// Read from the maxima, a few cache lines, rather than from each set's count: between
    /// operations a sequence's maximum is `NO_POS` exactly when it has no cell
    /// (`check_consistency` checks it), and this runs at the start of one.
    fn others(&self, seq: usize) -> SeqSet {
        let mut active = SeqSet::EMPTY;
        for (s, &max) in self.seq_pos_max.iter().enumerate() {
            if max != NO_POS && s != seq {
                active.insert(s);
            }
        }
        active
    }

    /// Whether no sequence of `others` holds a cell of word `w` (a whole word inside the
    /// cache), read from their bitmaps: a word per sequence instead of the 512 bytes of the
    /// word's sequence masks.
    #[inline(always)]
    fn word_alone(&self, w: usize, others: SeqSet) -> bool {
        w * 64 + 64 <= self.pos.len() && others.iter().all(|s| self.seq[s].word(w) == 0)
    }

    /// Frees the 64 cells of word `w` with column fills (the caller updates the sets).
    fn free_word(&mut self, w: usize) {
        let cells = w * 64..w * 64 + 64;
        self.seqs.fill(cells.clone(), SeqSet::EMPTY);
        self.pos[cells.clone()].fill(-1);
        // transformer caches rarely set `src`: skip the write when nothing changes
        if self.src[cells.clone()].iter().any(|&s| s != -1) {
            self.src[cells].fill(-1);
        }
    }

    /// Moves the 64 cells of word `w` to `new_pos(pos)` in one vectorizable pass, when no
    /// sequence of `others` holds any of them and `old` (bounds on their positions) maps to
    /// non-negative positions. `new_pos` does not decrease, so the image of `old` bounds the new
    /// positions without reading them; returns it, or `None` (changing nothing).
    #[inline(always)]
    fn shift_word_alone(
        &mut self,
        w: usize,
        others: SeqSet,
        old: (i32, i32),
        new_pos: &impl Fn(i32) -> i32,
    ) -> Option<(i32, i32)> {
        let (lo, hi) = (new_pos(old.0), new_pos(old.1));
        if lo < 0 || !self.word_alone(w, others) {
            return None;
        }
        let cells = w * 64..w * 64 + 64;
        let pos = <&mut [i32; 64]>::try_from(&mut self.pos[cells.clone()]).ok()?;
        let delta = <&mut [i32; 64]>::try_from(&mut self.delta[cells]).ok()?;
        for (p, d) in pos.iter_mut().zip(delta.iter_mut()) {
            let new = new_pos(*p);
            *d = d.wrapping_add(new.wrapping_sub(*p));
            *p = new;
        }
        Some((lo, hi))
    }

    /// Removes `seq` from its cells with `p0 <= pos < p1`; cells left without a sequence are
    /// freed (pos -1, src -1). Visits only the words holding positions in the range.
    pub fn remove_seq_in_range(&mut self, seq: usize, p0: i32, p1: i32) -> Freed {
        let others = self.others(seq);
        let max = self.seq_pos_max[seq];
        let mut out = Freed::default();
        let mut cur = self.seq[seq].cursor(p0, p1);
        while let Some((w, inside)) = cur.next(&self.seq[seq]) {
            let word = self.seq[seq].word(w);
            let (hits, lo, hi) = select(&self.pos, word, w, inside, p0, p1);
            if hits == u64::MAX && self.word_alone(w, others) {
                // 64 cells of this sequence alone, all in the range: free them with fills
                let (wlo, whi) = self.seq[seq].bounds(w);
                if (wlo..=whi).contains(&max) {
                    self.dirty.insert(seq);
                }
                self.free_word(w);
                out.note_word(w);
                self.seq[seq].set_word(w, 0, NO_LO, NO_HI);
                self.occupied.remove_bits(w, u64::MAX);
                continue;
            }
            let mut emptied = 0u64;
            for b in bits(hits) {
                let i = w * 64 + b;
                let pos = self.pos[i];
                if pos == max {
                    self.dirty.insert(seq);
                }
                if self.seqs.remove(i, seq) {
                    emptied |= 1 << b;
                    out.note(i, pos);
                    self.free_cell(i);
                }
            }
            self.seq[seq].set_word(w, word & !hits, lo, hi);
            self.occupied.remove_bits(w, emptied);
        }
        tighten(&mut self.seq[seq], &cur);
        self.fix_empty(seq);
        out
    }

    /// Frees every cell with `p0 <= pos < p1`, whatever its sequences (`seq_rm(-1, ..)`).
    pub fn free_range(&mut self, p0: i32, p1: i32) -> Freed {
        let mut out = Freed::default();
        let mut cur = self.occupied.cursor(p0, p1);
        while let Some((w, inside)) = cur.next(&self.occupied) {
            let word = self.occupied.word(w);
            let (hits, lo, hi) = select(&self.pos, word, w, inside, p0, p1);
            for b in bits(hits) {
                let i = w * 64 + b;
                let pos = self.pos[i];
                for seq in self.seqs.get(i).iter() {
                    self.seq[seq].remove(i);
                    if pos == self.seq_pos_max[seq] {
                        self.dirty.insert(seq);
                    }
                }
                out.note(i, pos);
                self.free_cell(i);
            }
            self.occupied.set_word(w, word & !hits, lo, hi);
        }
        tighten(&mut self.occupied, &cur);
        for seq in 0..self.n_seq() {
            self.fix_empty(seq);
        }
        out
    }

    /// Adds `dst` to the cells of `src` with `p0 <= pos < p1`.
    pub fn copy_seq_in_range(&mut self, src: usize, dst: usize, p0: i32, p1: i32) {
        let mut cur = self.seq[src].cursor(p0, p1);
        while let Some((w, inside)) = cur.next(&self.seq[src]) {
            let word = self.seq[src].word(w);
            let (hits, mut lo, mut hi) = select(&self.pos, word, w, inside, p0, p1);
            let added = hits & !self.seq[dst].word(w);
            if added == u64::MAX && w * 64 + 64 <= self.pos.len() {
                // 64 cells, all in the range and new to `dst`: one vectorizable pass; the source
                // word's bounds, clamped to the range, bound their positions
                self.seqs.add_to_all(w * 64..w * 64 + 64, dst);
                let (wlo, whi) = self.seq[src].bounds(w);
                let (lo, hi) = (wlo.max(p0), whi.min(p1 - 1));
                if self.seq[dst].count() == 0 || hi >= self.seq_pos_max[dst] {
                    // a bound, not the exact maximum: `settle` finds it
                    self.seq_pos_max[dst] = hi;
                    self.dirty.insert(dst);
                }
                self.seq[dst].add_bits(w, added, lo, hi);
                continue;
            }
            let (mut added_lo, mut added_hi) = (NO_LO, NO_HI);
            for b in bits(hits) {
                let i = w * 64 + b;
                let pos = self.pos[i];
                lo = lo.min(pos);
                hi = hi.max(pos);
                if added >> b & 1 == 1 {
                    self.seqs.insert(i, dst);
                    added_lo = added_lo.min(pos);
                    added_hi = added_hi.max(pos);
                }
            }
            if added != 0 {
                if self.seq[dst].count() == 0 || added_hi > self.seq_pos_max[dst] {
                    self.seq_pos_max[dst] = added_hi;
                }
                self.seq[dst].add_bits(w, added, added_lo, added_hi);
            }
            // every member of the source word was read: its bounds are exact again
            self.seq[src].set_word(w, word, lo, hi);
        }
        tighten(&mut self.seq[src], &cur);
    }

    /// Moves the cells of `seq` with `p0 <= pos < p1` to `new_pos(pos)`, adding the change to
    /// their delta; cells pushed below 0 are freed with all their sequences. `new_pos` must not
    /// decrease when `pos` increases (adding a constant or dividing does not). Returns whether
    /// any cell matched and what was freed.
    pub fn shift_seq_in_range(
        &mut self,
        seq: usize,
        p0: i32,
        p1: i32,
        new_pos: impl Fn(i32) -> i32,
    ) -> (bool, Freed) {
        let others = self.others(seq);
        let max = self.seq_pos_max(seq).unwrap_or(NO_POS);
        let mut matched = false;
        let mut out = Freed::default();
        let mut cur = self.seq[seq].cursor(p0, p1);
        while let Some((w, inside)) = cur.next(&self.seq[seq]) {
            let word = self.seq[seq].word(w);
            let (hits, mut lo, mut hi) = select(&self.pos, word, w, inside, p0, p1);
            matched |= hits != 0;
            if hits == u64::MAX {
                // every cell is in the range and at most `max`: clamped, the word's bounds
                // bound them, and `new_pos` maps them to bounds of the new positions
                let (wlo, whi) = self.seq[seq].bounds(w);
                let old = (wlo.max(p0), whi.min(p1 - 1).min(max));
                if let Some((new_lo, new_hi)) = self.shift_word_alone(w, others, old, &new_pos) {
                    // bounds, not the exact values: `settle` finds the new maximum
                    if old.1 == max || new_hi >= self.seq_pos_max[seq] {
                        self.dirty.insert(seq);
                    }
                    self.seq[seq].set_word(w, word, new_lo, new_hi);
                    self.occupied.moved_within(w, new_lo, new_hi);
                    continue;
                }
            }
            let mut emptied = 0u64;
            let (mut moved_lo, mut moved_hi) = (NO_LO, NO_HI);
            for b in bits(hits) {
                let i = w * 64 + b;
                let old = self.pos[i];
                let new = new_pos(old);
                self.delta[i] = self.delta[i].wrapping_add(new.wrapping_sub(old));
                if old == max {
                    self.dirty.insert(seq);
                }
                // most cells hold one sequence: only a shared cell reads its set
                let others = if self.seqs.holds_only(i, seq) {
                    None
                } else {
                    Some(self.seqs.get(i).minus(SeqSet::single(seq)))
                };
                if new < 0 {
                    out.note(i, 0);
                    emptied |= 1 << b;
                    if let Some(others) = others {
                        for s in others.iter() {
                            self.seq[s].remove(i);
                            if old == self.seq_pos_max[s] {
                                self.dirty.insert(s);
                            }
                        }
                    }
                    self.seqs.set(i, SeqSet::EMPTY);
                    self.pos[i] = -1;
                    continue;
                }
                self.pos[i] = new;
                moved_lo = moved_lo.min(new);
                moved_hi = moved_hi.max(new);
                if let Some(others) = others {
                    for s in others.iter() {
                        self.seq[s].moved(i, new);
                        if new > self.seq_pos_max[s] {
                            self.seq_pos_max[s] = new;
                        } else if old == self.seq_pos_max[s] {
                            self.dirty.insert(s);
                        }
                    }
                }
            }
            if moved_hi > self.seq_pos_max[seq] {
                self.seq_pos_max[seq] = moved_hi;
            }
            lo = lo.min(moved_lo);
            hi = hi.max(moved_hi);
            self.seq[seq].set_word(w, word & !emptied, lo, hi);
            self.occupied.remove_bits(w, emptied);
            if moved_lo <= moved_hi {
                self.occupied.moved_within(w, moved_lo, moved_hi);
            }
        }
        tighten(&mut self.seq[seq], &cur);
        // only a freed cell changes counts
        if out.first.is_some() {
            for s in 0..self.n_seq() {
                self.fix_empty(s);
            }
        }
        (matched, out)
    }

    /// Transformer `seq_keep`: frees every occupied cell without `seq` and leaves `seq` alone
    /// in the others. Returns how many cells were freed.
    pub fn keep_only(&mut self, seq: usize) -> u32 {
        let mut freed = 0;
        let n = self.pos.len();
        for w in 0..self.occupied.words().len() {
            let keep = self.seq[seq].word(w);
            let drop = self.occupied.word(w) & !keep;
            freed += drop.count_ones();
            if drop == u64::MAX && w * 64 + 64 <= n {
                // a whole word of cells to free: column fills the compiler vectorizes
                self.free_word(w);
            } else {
                for b in bits(drop) {
                    self.free_cell(w * 64 + b);
                }
            }
            for b in bits(keep) {
                let i = w * 64 + b;
                if !self.seqs.holds_only(i, seq) {
                    self.seqs.set_single(i, seq);
                }
            }
            self.occupied.remove_bits(w, drop);
        }
        for s in (0..self.n_seq()).filter(|&s| s != seq) {
            self.seq[s].clear();
            self.seq_pos_max[s] = NO_POS;
        }
        let still_dirty = self.dirty.contains(seq);
        self.dirty = if still_dirty {
            SeqSet::single(seq)
        } else {
            SeqSet::EMPTY
        };
        freed
    }

    fn fix_empty(&mut self, seq: usize) {
        if self.seq[seq].count() == 0 {
            self.seq_pos_max[seq] = NO_POS;
            self.dirty.remove(seq);
        }
    }
}
