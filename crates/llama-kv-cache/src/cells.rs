//! Cell metadata, stored column-wise, with exact per-sequence bookkeeping.
//!
//! The seed keeps a `std::set<llama_seq_id>` in every cell and answers every question with a
//! scan of all cells. Here a cell's sequences are a 64-bit mask, and two kinds of bitmaps index
//! the cells: one of occupied cells (`pos >= 0`, what slot search looks at) and one per sequence
//! (the cells it owns). Operations on one sequence walk only that sequence's cells, slot search
//! skips 64 occupied cells per word, and each sequence's cell count and largest position are kept
//! exact, so `seq_pos_max` is O(1).

/// The most sequences a cache can track (seq ids `0..MAX_SEQ`).
pub const MAX_SEQ: usize = 64;

use crate::error::Result;

/// Marker for "no position" in the per-sequence maximum.
const NO_POS: i32 = i32::MIN;

/// A set of sequence ids in `0..MAX_SEQ`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SeqSet(pub u64);

impl SeqSet {
    /// The empty set.
    pub const EMPTY: SeqSet = SeqSet(0);

    /// The set holding only `seq`.
    pub fn single(seq: usize) -> SeqSet {
        SeqSet(1u64 << seq)
    }

    /// Whether `seq` is in the set.
    pub fn contains(self, seq: usize) -> bool {
        seq < MAX_SEQ && self.0 & (1u64 << seq) != 0
    }

    /// Whether the set is empty.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// Number of ids in the set.
    pub fn len(self) -> usize {
        self.0.count_ones() as usize
    }

    /// Adds `seq`.
    pub fn insert(&mut self, seq: usize) {
        self.0 |= 1u64 << seq;
    }

    /// Removes `seq`.
    pub fn remove(&mut self, seq: usize) {
        self.0 &= !(1u64 << seq);
    }

    /// The ids, ascending (the order of the seed's `std::set`).
    pub fn iter(self) -> impl Iterator<Item = usize> {
        bits(self.0)
    }
}

/// The set bit indices of `word`, ascending.
#[inline(always)]
fn bits(mut word: u64) -> impl Iterator<Item = usize> {
    std::iter::from_fn(move || {
        if word == 0 {
            return None;
        }
        let b = word.trailing_zeros() as usize;
        word &= word - 1;
        Some(b)
    })
}

/// Cells freed by a bulk operation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Freed {
    /// The lowest freed cell.
    pub first: Option<usize>,
    /// Freed cells that had a position (what the seed subtracts from `used`).
    pub with_pos: u32,
}

impl Freed {
    fn note(&mut self, i: usize, pos: i32) {
        if self.first.is_none() {
            self.first = Some(i);
        }
        if pos >= 0 {
            self.with_pos += 1;
        }
    }
}

/// One cell's metadata, as the seed's `llama_kv_cell`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cell {
    /// Token position, -1 when free.
    pub pos: i32,
    /// Position change accumulated since the last K-shift.
    pub delta: i32,
    /// Recurrent models: the cell whose state this one copies from.
    pub src: i32,
    /// Recurrent models: for cell `i`, the cell holding sequence `i`'s state.
    pub tail: i32,
    /// Sequences that own the cell.
    pub seqs: SeqSet,
}

impl Default for Cell {
    fn default() -> Self {
        Cell {
            pos: -1,
            delta: 0,
            src: -1,
            tail: -1,
            seqs: SeqSet::EMPTY,
        }
    }
}

/// All cells of a cache plus the indexes derived from them.
///
/// Every mutation goes through a method here, so `used`-independent bookkeeping (occupied
/// bitmap, per-sequence bitmaps, counts and maxima) never drifts from the cells. `used` is the
/// seed's own counter and is maintained by the operations exactly as the seed does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cells {
    pos: Vec<i32>,
    delta: Vec<i32>,
    src: Vec<i32>,
    tail: Vec<i32>,
    seqs: Vec<SeqSet>,
    /// Bit i set when `pos[i] >= 0`.
    occupied: Vec<u64>,
    /// Per sequence, bit i set when cell i holds it.
    seq_bits: Vec<Vec<u64>>,
    seq_cells: Vec<u32>,
    seq_pos_max: Vec<i32>,
    /// Sequences whose maximum must be recomputed (a cell at the maximum lost it).
    dirty: u64,
    /// The seed's `used` counter.
    pub used: u32,
}

impl Cells {
    /// `size` free cells for sequences `0..n_seq`; an error (not an abort) when the columns
    /// cannot be allocated.
    pub fn new(size: usize, n_seq: usize) -> Result<Cells> {
        use crate::alloc::{filled, zeroed};
        let words = size.div_ceil(64);
        let what = "the cell columns";
        let mut seq_bits = crate::alloc::with_capacity(n_seq, what)?;
        for _ in 0..n_seq {
            seq_bits.push(zeroed(words, what)?);
        }
        Ok(Cells {
            pos: filled(size, -1, what)?,
            delta: zeroed(size, what)?,
            src: filled(size, -1, what)?,
            tail: filled(size, -1, what)?,
            seqs: filled(size, SeqSet::EMPTY, what)?,
            occupied: zeroed(words, what)?,
            seq_bits,
            seq_cells: vec![0; n_seq],
            seq_pos_max: vec![NO_POS; n_seq],
            dirty: 0,
            used: 0,
        })
    }

    /// Number of cells.
    pub fn len(&self) -> usize {
        self.pos.len()
    }

    /// Whether the cache has no cells (never true for a constructed cache).
    pub fn is_empty(&self) -> bool {
        self.pos.is_empty()
    }

    /// A copy of cell `i`.
    pub fn get(&self, i: usize) -> Cell {
        Cell {
            pos: self.pos[i],
            delta: self.delta[i],
            src: self.src[i],
            tail: self.tail[i],
            seqs: self.seqs[i],
        }
    }

    /// Position of cell `i`.
    pub fn pos(&self, i: usize) -> i32 {
        self.pos[i]
    }

    /// Accumulated shift of cell `i`.
    pub fn delta(&self, i: usize) -> i32 {
        self.delta[i]
    }

    /// Sequences of cell `i`.
    pub fn seqs(&self, i: usize) -> SeqSet {
        self.seqs[i]
    }

    /// Recurrent tail of cell `i`.
    pub fn tail(&self, i: usize) -> i32 {
        self.tail[i]
    }

    /// Recurrent copy source of cell `i`.
    pub fn src(&self, i: usize) -> i32 {
        self.src[i]
    }

    /// The seed's `is_empty`: no sequence owns the cell.
    pub fn is_empty_cell(&self, i: usize) -> bool {
        self.seqs[i].is_empty()
    }

    /// Column of positions.
    pub fn pos_column(&self) -> &[i32] {
        &self.pos
    }

    /// Column of sequence sets.
    pub fn seqs_column(&self) -> &[SeqSet] {
        &self.seqs
    }

    /// Column of deltas.
    pub fn delta_column(&self) -> &[i32] {
        &self.delta
    }

    /// Column of recurrent copy sources.
    pub fn src_column(&self) -> &[i32] {
        &self.src
    }

    /// Column of recurrent tails.
    pub fn tail_column(&self) -> &[i32] {
        &self.tail
    }

    /// Number of sequences tracked.
    pub fn n_seq(&self) -> usize {
        self.seq_cells.len()
    }

    /// Cells holding `seq`.
    pub fn seq_cell_count(&self, seq: usize) -> u32 {
        self.seq_cells[seq]
    }

    /// Largest position among the cells holding `seq`, `None` when it has none.
    pub fn seq_pos_max(&self, seq: usize) -> Option<i32> {
        if self.seq_cells[seq] == 0 {
            return None;
        }
        if self.dirty & (1 << seq) != 0 {
            return Some(self.compute_max(seq));
        }
        Some(self.seq_pos_max[seq])
    }

    /// Sum over cells of the number of sequences (the seed's `get_n_tokens`).
    pub fn n_tokens(&self) -> u64 {
        self.seq_cells.iter().map(|&c| c as u64).sum()
    }

    /// The cells holding `seq`, ascending; walks only the sequence's bitmap.
    pub fn cells_of(&self, seq: usize) -> impl Iterator<Item = usize> + '_ {
        self.seq_bits[seq]
            .iter()
            .enumerate()
            .flat_map(|(w, &word)| bits(word).map(move |b| w * 64 + b))
    }

    /// The first cell not holding `seq`, if any.
    pub fn first_without(&self, seq: usize) -> Option<usize> {
        let n = self.pos.len();
        self.seq_bits[seq]
            .iter()
            .enumerate()
            .find(|(_, &w)| w != u64::MAX)
            .map(|(w, &word)| w * 64 + (!word).trailing_zeros() as usize)
            .filter(|&i| i < n)
    }

    /// The first cell `>= from` with `pos >= 0` (slot search), or `len()`.
    pub fn next_occupied(&self, from: usize) -> usize {
        self.next_with(from, false)
    }

    /// The first cell `>= from` with `pos < 0`, or `len()`.
    pub fn next_free(&self, from: usize) -> usize {
        self.next_with(from, true)
    }

    fn next_with(&self, from: usize, free: bool) -> usize {
        let n = self.pos.len();
        if from >= n {
            return n;
        }
        let mut w = from / 64;
        let flip = if free { u64::MAX } else { 0 };
        let mut word = (self.occupied[w] ^ flip) & (u64::MAX << (from % 64));
        loop {
            if word != 0 {
                return (w * 64 + word.trailing_zeros() as usize).min(n);
            }
            w += 1;
            if w >= self.occupied.len() {
                return n;
            }
            word = self.occupied[w] ^ flip;
        }
    }

    /// Sets the position of cell `i`.
    pub fn set_pos(&mut self, i: usize, pos: i32) {
        let old = self.pos[i];
        if old == pos {
            return;
        }
        self.pos[i] = pos;
        let bit = 1u64 << (i % 64);
        if pos >= 0 {
            self.occupied[i / 64] |= bit;
        } else {
            self.occupied[i / 64] &= !bit;
        }
        for seq in self.seqs[i].iter() {
            if pos > self.seq_pos_max[seq] {
                self.seq_pos_max[seq] = pos;
            } else if old == self.seq_pos_max[seq] {
                self.dirty |= 1 << seq;
            }
        }
    }

    /// Sets the accumulated delta of cell `i`.
    pub fn set_delta(&mut self, i: usize, delta: i32) {
        self.delta[i] = delta;
    }

    /// Sets every delta to 0 (after a K-shift).
    pub fn clear_deltas(&mut self) {
        self.delta.fill(0);
    }

    /// Sets the recurrent copy source of cell `i`.
    pub fn set_src(&mut self, i: usize, src: i32) {
        self.src[i] = src;
    }

    /// Sets the recurrent tail of cell `i`.
    pub fn set_tail(&mut self, i: usize, tail: i32) {
        self.tail[i] = tail;
    }

    /// Adds `seq` to cell `i`.
    pub fn insert_seq(&mut self, i: usize, seq: usize) {
        if self.seqs[i].contains(seq) {
            return;
        }
        self.seqs[i].insert(seq);
        self.seq_bits[seq][i / 64] |= 1u64 << (i % 64);
        self.seq_cells[seq] += 1;
        if self.seq_cells[seq] == 1 {
            self.seq_pos_max[seq] = self.pos[i];
            self.dirty &= !(1 << seq);
        } else if self.pos[i] > self.seq_pos_max[seq] {
            self.seq_pos_max[seq] = self.pos[i];
        }
    }

    /// Removes `seq` from cell `i`.
    pub fn remove_seq(&mut self, i: usize, seq: usize) {
        if !self.seqs[i].contains(seq) {
            return;
        }
        self.seqs[i].remove(seq);
        self.seq_bits[seq][i / 64] &= !(1u64 << (i % 64));
        self.seq_cells[seq] -= 1;
        if self.seq_cells[seq] == 0 {
            self.seq_pos_max[seq] = NO_POS;
            self.dirty &= !(1 << seq);
        } else if self.pos[i] == self.seq_pos_max[seq] {
            self.dirty |= 1 << seq;
        }
    }

    /// Removes every sequence from cell `i`.
    pub fn clear_seqs(&mut self, i: usize) {
        for seq in self.seqs[i].iter() {
            self.remove_seq(i, seq);
        }
    }

    /// Replaces the sequence set of cell `i`.
    pub fn set_seqs(&mut self, i: usize, seqs: SeqSet) {
        let old = self.seqs[i];
        for seq in SeqSet(old.0 & !seqs.0).iter() {
            self.remove_seq(i, seq);
        }
        for seq in SeqSet(seqs.0 & !old.0).iter() {
            self.insert_seq(i, seq);
        }
    }

    /// Replaces the whole cell `i` (used by defrag and recurrent swaps).
    pub fn set_cell(&mut self, i: usize, cell: Cell) {
        self.clear_seqs(i);
        self.set_pos(i, cell.pos);
        self.delta[i] = cell.delta;
        self.src[i] = cell.src;
        self.tail[i] = cell.tail;
        self.set_seqs(i, cell.seqs);
    }

    /// Removes `seq` from its cells with `p0 <= pos < p1`; cells left without a sequence are
    /// freed (pos -1, src -1). Walks only the sequence's cells.
    pub fn remove_seq_in_range(&mut self, seq: usize, p0: i32, p1: i32) -> Freed {
        let m = 1u64 << seq;
        let max = self.seq_pos_max[seq];
        let mut out = Freed::default();
        for w in 0..self.occupied.len() {
            let cleared = self.in_range(self.seq_bits[seq][w], w, p0, p1);
            let mut emptied = 0u64;
            for b in bits(cleared) {
                let i = w * 64 + b;
                let pos = self.pos[i];
                if pos == max {
                    self.dirty |= m;
                }
                self.seqs[i].0 &= !m;
                if self.seqs[i].0 == 0 {
                    emptied |= 1 << b;
                    out.note(i, pos);
                    self.pos[i] = -1;
                    self.src[i] = -1;
                }
            }
            self.seq_bits[seq][w] &= !cleared;
            self.occupied[w] &= !emptied;
            self.seq_cells[seq] -= cleared.count_ones();
        }
        self.fix_empty(seq);
        out
    }

    /// Frees every cell with `p0 <= pos < p1`, whatever its sequences (`seq_rm(-1, ..)`).
    pub fn free_range(&mut self, p0: i32, p1: i32) -> Freed {
        let mut out = Freed::default();
        for w in 0..self.occupied.len() {
            let emptied = self.in_range(self.occupied[w], w, p0, p1);
            for b in bits(emptied) {
                let i = w * 64 + b;
                let pos = self.pos[i];
                for seq in bits(self.seqs[i].0) {
                    self.seq_bits[seq][w] &= !(1 << b);
                    self.seq_cells[seq] -= 1;
                    if pos == self.seq_pos_max[seq] {
                        self.dirty |= 1 << seq;
                    }
                }
                self.seqs[i] = SeqSet::EMPTY;
                out.note(i, pos);
                self.pos[i] = -1;
                self.src[i] = -1;
            }
            self.occupied[w] &= !emptied;
        }
        for seq in 0..self.n_seq() {
            self.fix_empty(seq);
        }
        out
    }

    /// Adds `dst` to the cells of `src` with `p0 <= pos < p1`.
    pub fn copy_seq_in_range(&mut self, src: usize, dst: usize, p0: i32, p1: i32) {
        let m = 1u64 << dst;
        for w in 0..self.occupied.len() {
            let added = self.in_range(self.seq_bits[src][w] & !self.seq_bits[dst][w], w, p0, p1);
            for b in bits(added) {
                let i = w * 64 + b;
                let pos = self.pos[i];
                self.seqs[i].0 |= m;
                if self.seq_cells[dst] == 0 || pos > self.seq_pos_max[dst] {
                    self.seq_pos_max[dst] = pos;
                }
                self.seq_cells[dst] += 1;
            }
            self.seq_bits[dst][w] |= added;
        }
    }

    /// Moves the cells of `seq` with `p0 <= pos < p1` to `new_pos(pos)`, adding the change to
    /// their delta; cells pushed below 0 are freed with all their sequences. Returns whether any
    /// cell matched and what was freed.
    pub fn shift_seq_in_range(
        &mut self,
        seq: usize,
        p0: i32,
        p1: i32,
        new_pos: impl Fn(i32) -> i32,
    ) -> (bool, Freed) {
        let mut matched = false;
        let mut out = Freed::default();
        for w in 0..self.occupied.len() {
            let hits = self.in_range(self.seq_bits[seq][w], w, p0, p1);
            matched |= hits != 0;
            for b in bits(hits) {
                let i = w * 64 + b;
                let old = self.pos[i];
                let new = new_pos(old);
                self.delta[i] = self.delta[i].wrapping_add(new.wrapping_sub(old));
                if new < 0 {
                    out.note(i, 0);
                    for s in bits(self.seqs[i].0) {
                        self.seq_bits[s][w] &= !(1 << b);
                        self.seq_cells[s] -= 1;
                        if old == self.seq_pos_max[s] {
                            self.dirty |= 1 << s;
                        }
                    }
                    self.seqs[i] = SeqSet::EMPTY;
                    self.pos[i] = -1;
                    self.occupied[w] &= !(1 << b);
                    continue;
                }
                self.pos[i] = new;
                for s in bits(self.seqs[i].0) {
                    if new > self.seq_pos_max[s] {
                        self.seq_pos_max[s] = new;
                    } else if old == self.seq_pos_max[s] {
                        self.dirty |= 1 << s;
                    }
                }
            }
        }
        for s in 0..self.n_seq() {
            self.fix_empty(s);
        }
        (matched, out)
    }

    /// Transformer `seq_keep`: frees every occupied cell without `seq` and leaves `seq` alone
    /// in the others. Returns how many cells were freed.
    pub fn keep_only(&mut self, seq: usize) -> u32 {
        let single = SeqSet::single(seq);
        let mut freed = 0;
        for w in 0..self.occupied.len() {
            let keep = self.seq_bits[seq][w];
            let drop = self.occupied[w] & !keep;
            freed += drop.count_ones();
            for b in bits(drop) {
                let i = w * 64 + b;
                self.seqs[i] = SeqSet::EMPTY;
                self.pos[i] = -1;
                self.src[i] = -1;
            }
            for b in bits(keep) {
                self.seqs[w * 64 + b] = single;
            }
            self.occupied[w] &= keep;
        }
        for s in (0..self.n_seq()).filter(|&s| s != seq) {
            self.seq_bits[s].fill(0);
            self.seq_cells[s] = 0;
            self.seq_pos_max[s] = NO_POS;
        }
        self.dirty &= 1 << seq;
        freed
    }

    /// The cells of `word` (cells `64 w ..`) whose position is in `[p0, p1)`.
    #[inline(always)]
    fn in_range(&self, word: u64, w: usize, p0: i32, p1: i32) -> u64 {
        let mut hits = 0u64;
        for b in bits(word) {
            let pos = self.pos[w * 64 + b];
            if pos >= p0 && pos < p1 {
                hits |= 1 << b;
            }
        }
        hits
    }

    fn fix_empty(&mut self, seq: usize) {
        if self.seq_cells[seq] == 0 {
            self.seq_pos_max[seq] = NO_POS;
            self.dirty &= !(1 << seq);
        }
    }

    fn compute_max(&self, seq: usize) -> i32 {
        let mut max = NO_POS;
        for (w, &word) in self.seq_bits[seq].iter().enumerate() {
            for b in bits(word) {
                max = max.max(self.pos[w * 64 + b]);
            }
        }
        max
    }

    /// Recomputes the maxima marked stale; called at the end of every mutating operation so
    /// that `seq_pos_max` stays O(1).
    pub fn settle(&mut self) {
        while self.dirty != 0 {
            let seq = self.dirty.trailing_zeros() as usize;
            self.dirty &= self.dirty - 1;
            self.seq_pos_max[seq] = self.compute_max(seq);
        }
    }

    /// Resets every cell's pos, seqs, src and tail (not delta: the seed's `clear` keeps it).
    pub fn reset(&mut self) {
        self.pos.fill(-1);
        self.src.fill(-1);
        self.tail.fill(-1);
        self.seqs.fill(SeqSet::EMPTY);
        self.occupied.fill(0);
        for b in &mut self.seq_bits {
            b.fill(0);
        }
        self.seq_cells.fill(0);
        self.seq_pos_max.fill(NO_POS);
        self.dirty = 0;
        self.used = 0;
    }

    /// Checks every index against the columns (tests and debug builds).
    pub fn check_consistency(&self) -> Result<(), String> {
        for i in 0..self.pos.len() {
            let occ = self.occupied[i / 64] >> (i % 64) & 1 == 1;
            if occ != (self.pos[i] >= 0) {
                return Err(format!(
                    "cell {i}: occupied bit {occ} but pos {}",
                    self.pos[i]
                ));
            }
            for seq in 0..self.n_seq() {
                let bit = self.seq_bits[seq][i / 64] >> (i % 64) & 1 == 1;
                if bit != self.seqs[i].contains(seq) {
                    return Err(format!(
                        "cell {i}: seq {seq} bitmap {bit} disagrees with the mask"
                    ));
                }
            }
        }
        for seq in 0..self.n_seq() {
            let count = self.seqs.iter().filter(|s| s.contains(seq)).count() as u32;
            if count != self.seq_cells[seq] {
                return Err(format!(
                    "seq {seq}: count {} but {count} cells",
                    self.seq_cells[seq]
                ));
            }
            let max = (0..self.pos.len())
                .filter(|&i| self.seqs[i].contains(seq))
                .map(|i| self.pos[i])
                .max();
            if max != self.seq_pos_max(seq) {
                return Err(format!(
                    "seq {seq}: max {:?} but cells say {max:?}",
                    self.seq_pos_max(seq)
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seq_set_iterates_ascending() {
        let mut s = SeqSet::EMPTY;
        s.insert(5);
        s.insert(0);
        s.insert(63);
        assert_eq!(s.iter().collect::<Vec<_>>(), vec![0, 5, 63]);
        assert_eq!(s.len(), 3);
        s.remove(5);
        assert!(!s.contains(5));
    }

    #[test]
    fn bookkeeping_follows_removals() {
        let mut c = Cells::new(4, 2).unwrap();
        for i in 0..3 {
            c.set_pos(i, i as i32 * 10);
            c.insert_seq(i, 1);
        }
        assert_eq!(c.seq_pos_max(1), Some(20));
        c.remove_seq(2, 1);
        assert_eq!(c.seq_pos_max(1), Some(10));
        assert_eq!(c.seq_cell_count(1), 2);
        c.set_pos(1, 3);
        c.settle();
        assert_eq!(c.seq_pos_max(1), Some(3));
        c.set_seqs(0, SeqSet::EMPTY);
        c.set_seqs(1, SeqSet::EMPTY);
        assert_eq!(c.seq_pos_max(1), None);
        assert_eq!(c.n_tokens(), 0);
        c.check_consistency().unwrap();
    }

    #[test]
    fn bitmap_searches_cross_words() {
        let mut c = Cells::new(200, 1).unwrap();
        for i in 0..130 {
            c.set_pos(i, 0);
        }
        assert_eq!(c.next_free(0), 130);
        assert_eq!(c.next_occupied(130), 200);
        c.set_pos(150, 1);
        assert_eq!(c.next_occupied(131), 150);
        assert_eq!(c.next_free(150), 151);
        c.insert_seq(3, 0);
        assert_eq!(c.first_without(0), Some(0));
    }
}
