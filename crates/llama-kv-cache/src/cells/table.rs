//! Cell metadata, stored column-wise, with exact per-sequence bookkeeping.
//!
//! The seed keeps a `std::set<llama_seq_id>` in every cell and answers every question with a
//! scan of all cells. Here a cell's sequences are a bitmask ([`crate::cells::seqs`]: one word per
//! 64 sequences the cache allows), and two kinds of cell sets
//! ([`crate::cells::set`]: a bitmap with position bounds per 64-cell word and per 4,096 cells)
//! index the cells: one of occupied cells (`pos >= 0`, what slot search looks at) and one per
//! sequence (the cells it owns). An operation on a range of one sequence's positions visits only
//! the words holding positions in that range, slot search skips 64 occupied cells per word, and
//! each sequence's cell count and largest position are kept exact, so `seq_pos_max` is O(1).
//!
//! The operations on a sequence's range of positions (remove, copy, shift, keep) are in
//! `table/seq_ops.rs`, a child module so that they keep the columns private to the table.

pub use crate::params::MAX_SEQ;

use crate::cell_ext::CellExtValue;
use crate::cells::seqs::{SeqColumn, SeqSet};
use crate::cells::set::{bits, next_bit, runs_of_words, select, CellSet, Cursor, NO_HI, NO_LO};
use crate::error::Result;

mod seq_ops;

/// Marker for "no position" in the per-sequence maximum.
const NO_POS: i32 = i32::MIN;

/// No member cells, with the identities of `min` and `max` as bounds.
const NO_MEMBERS: (u64, i32, i32) = (0, NO_LO, NO_HI);

/// Cells freed by a bulk operation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Freed {
    /// The lowest freed cell.
    pub first: Option<usize>,
    /// The highest freed cell.
    pub last: Option<usize>,
    /// Freed cells that had a position (what the seed subtracts from `used`).
    pub with_pos: u32,
}

impl Freed {
    /// Notes the 64 cells of word `w`, every one with a position.
    fn note_word(&mut self, w: usize) {
        self.note(w * 64, 0);
        self.last = Some(w * 64 + 63);
        self.with_pos += 63;
    }

    /// Notes freed cell `i`. The operations free cells in ascending order (their cursors walk
    /// the words upward), so the first noted is the lowest and the last the highest.
    #[inline(always)]
    fn note(&mut self, i: usize, pos: i32) {
        debug_assert!(
            self.last.is_none_or(|l| l <= i),
            "cell {i} after {:?}",
            self.last
        );
        self.first.get_or_insert(i);
        self.last = Some(i);
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
    /// The cell's extension (M-RoPE / PLE caches; the default elsewhere).
    pub ext: CellExtValue,
}

impl Default for Cell {
    fn default() -> Self {
        Cell {
            pos: -1,
            delta: 0,
            src: -1,
            tail: -1,
            seqs: SeqSet::EMPTY,
            ext: CellExtValue::default(),
        }
    }
}

/// All cells of a cache plus the indexes derived from them.
///
/// Every mutation goes through a method here, so `used`-independent bookkeeping (occupied
/// set, per-sequence sets, counts and maxima) never drifts from the cells. `used` is the
/// seed's own counter and is maintained by the operations exactly as the seed does.
#[derive(Clone, Debug)]
pub struct Cells {
    pos: Vec<i32>,
    delta: Vec<i32>,
    src: Vec<i32>,
    tail: Vec<i32>,
    seqs: SeqColumn,
    /// Each cell's extension, in a cache that keeps them ([`Cells::keep_ext`]); empty in any
    /// other, so that the tables of every other model pay nothing for it.
    ext: Vec<CellExtValue>,
    /// The cells with `pos >= 0`.
    occupied: CellSet,
    /// Per sequence, the cells that hold it.
    seq: Vec<CellSet>,
    seq_pos_max: Vec<i32>,
    /// Scratch of [`Cells::fill_cell_by_cell`], per sequence: `NO_MEMBERS` between calls.
    members: Vec<(u64, i32, i32)>,
    /// Sequences whose maximum must be recomputed (a cell at the maximum lost it).
    dirty: SeqSet,
    /// The seed's `used` counter.
    pub used: u32,
}

/// Two cell tables are equal when their cells and `used` are: the indexes are derived from
/// the cells, and their position bounds may differ in how loose they are. A free cell's
/// extension is never read (placement sets it), so only occupied cells' count.
impl PartialEq for Cells {
    fn eq(&self, other: &Cells) -> bool {
        self.pos == other.pos
            && self.delta == other.delta
            && self.src == other.src
            && self.tail == other.tail
            && self.seqs == other.seqs
            && self.used == other.used
            && self.ext.len() == other.ext.len()
            && (0..self.ext.len()).all(|i| self.pos[i] < 0 || self.ext[i] == other.ext[i])
    }
}

impl Eq for Cells {}

/// The groups of a set an operation visited, tightened once it is done.
fn tighten(set: &mut CellSet, cursor: &Cursor) {
    if let Some((first, last)) = cursor.visited() {
        set.tighten_groups(first, last);
    }
}

impl Cells {
    /// `size` free cells for sequences `0..n_seq`; an error (not an abort) when the columns
    /// cannot be allocated.
    pub fn new(size: usize, n_seq: usize) -> Result<Cells> {
        use crate::alloc::{filled, zeroed};
        let words = size.div_ceil(64);
        let what = "the cell columns";
        let mut seq = crate::alloc::with_capacity(n_seq, what)?;
        for _ in 0..n_seq {
            seq.push(CellSet::new(words, what)?);
        }
        Ok(Cells {
            pos: filled(size, -1, what)?,
            delta: zeroed(size, what)?,
            src: filled(size, -1, what)?,
            tail: filled(size, -1, what)?,
            seqs: SeqColumn::new(size, n_seq, what)?,
            ext: Vec::new(),
            occupied: CellSet::new(words, what)?,
            seq,
            seq_pos_max: vec![NO_POS; n_seq],
            members: vec![NO_MEMBERS; n_seq],
            dirty: SeqSet::EMPTY,
            used: 0,
        })
    }

    /// Keeps an extension per cell from now on (a cache whose parameters name one), all at
    /// llama.cpp's default until placement sets them.
    pub fn keep_ext(&mut self) -> Result<()> {
        self.ext = crate::alloc::filled(
            self.pos.len(),
            CellExtValue::default(),
            "the cell extensions",
        )?;
        Ok(())
    }

    /// Whether the table keeps an extension per cell.
    pub fn keeps_ext(&self) -> bool {
        !self.ext.is_empty()
    }

    /// Cell `i`'s extension (the default in a table that keeps none).
    pub fn ext(&self, i: usize) -> CellExtValue {
        self.ext.get(i).copied().unwrap_or_default()
    }

    /// Sets cell `i`'s extension; nothing in a table that keeps none.
    pub fn set_ext(&mut self, i: usize, ext: CellExtValue) {
        if let Some(e) = self.ext.get_mut(i) {
            *e = ext;
        }
    }

    /// Every cell's extension (empty in a table that keeps none).
    pub fn ext_column(&self) -> &[CellExtValue] {
        &self.ext
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
            seqs: self.seqs.get(i),
            ext: self.ext(i),
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
        self.seqs.get(i)
    }

    /// The one sequence cell `i` holds, if it holds exactly one (without copying its set).
    #[inline]
    pub fn only_seq(&self, i: usize) -> Option<usize> {
        self.seqs.only(i)
    }

    /// Whether cell `i` holds `seq` and no other sequence.
    #[inline]
    pub fn holds_only(&self, i: usize, seq: usize) -> bool {
        self.seqs.holds_only(i, seq)
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
        self.seqs.is_empty(i)
    }

    /// Column of positions.
    pub fn pos_column(&self) -> &[i32] {
        &self.pos
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
        self.seq.len()
    }

    /// The cells holding `seq` as runs `start..end` of consecutive cells, ascending.
    pub fn runs_of(&self, seq: usize) -> Vec<(usize, usize)> {
        self.seq[seq].runs()
    }

    /// The cells held by any sequence as runs `start..end` of consecutive cells, ascending.
    pub fn nonempty_runs(&self) -> Vec<(usize, usize)> {
        runs_of_words(&self.nonempty_words())
    }

    /// Cells holding `seq`.
    pub fn seq_cell_count(&self, seq: usize) -> u32 {
        self.seq[seq].count()
    }

    /// Largest position among the cells holding `seq`, `None` when it has none.
    pub fn seq_pos_max(&self, seq: usize) -> Option<i32> {
        if self.seq[seq].count() == 0 {
            return None;
        }
        if self.dirty.contains(seq) {
            return self.seq[seq].max_pos(&self.pos);
        }
        Some(self.seq_pos_max[seq])
    }

    /// Smallest position among the cells holding `seq`, `None` when it has none.
    pub fn seq_pos_min(&self, seq: usize) -> Option<i32> {
        self.cells_of(seq).map(|i| self.pos[i]).min()
    }

    /// Cells with a position: what llama.cpp 0.1.161 counts as used (the seed's own counter,
    /// [`Cells::used`], follows the seed's operations instead).
    pub fn occupied_count(&self) -> u32 {
        self.occupied.count()
    }

    /// Sum over cells of the number of sequences (the seed's `get_n_tokens`).
    pub fn n_tokens(&self) -> u64 {
        self.seq.iter().map(|s| s.count() as u64).sum()
    }

    /// The cells holding `seq`, ascending; walks only the sequence's bitmap.
    pub fn cells_of(&self, seq: usize) -> impl Iterator<Item = usize> + '_ {
        self.seq[seq]
            .words()
            .iter()
            .enumerate()
            .filter(|(_, &word)| word != 0)
            .flat_map(|(w, &word)| bits(word).map(move |b| w * 64 + b))
    }

    /// The first cell not holding `seq`, if any.
    pub fn first_without(&self, seq: usize) -> Option<usize> {
        let n = self.pos.len();
        self.seq[seq]
            .words()
            .iter()
            .enumerate()
            .find(|(_, &w)| w != u64::MAX)
            .map(|(w, &word)| w * 64 + (!word).trailing_zeros() as usize)
            .filter(|&i| i < n)
    }

    /// The first cell `>= from` with `pos >= 0` (slot search), or `len()`.
    pub fn next_occupied(&self, from: usize) -> usize {
        self.next_with(from, self.pos.len(), false)
    }

    /// The first cell `>= from` with `pos < 0`, or `len()`.
    pub fn next_free(&self, from: usize) -> usize {
        self.next_with(from, self.pos.len(), true)
    }

    /// The first cell in `[from, end)` with `pos >= 0`, or `end` when there is none: slot
    /// search only asks whether a window is free, and the search stops at the window's end
    /// instead of walking the free cells after it (up to the whole cache).
    pub fn next_occupied_before(&self, from: usize, end: usize) -> usize {
        self.next_with(from, end.min(self.pos.len()), false)
    }

    /// The first cell in `[from, end)` with `pos < 0`, or `end` when there is none.
    pub fn next_free_before(&self, from: usize, end: usize) -> usize {
        self.next_with(from, end.min(self.pos.len()), true)
    }

    /// The first cell in `[from, end)` (`end <= len()`) that is free (`free`) or occupied,
    /// else `end`.
    fn next_with(&self, from: usize, end: usize, free: bool) -> usize {
        next_bit(self.occupied.words(), from, end, !free)
    }

    /// The cells of word `w` (cells `64 * w..64 * w + 64`, each a bit) that are free, or held
    /// by `seq` alone; bits past the last cell are set.
    pub fn free_or_only_word(&self, w: usize, seq: Option<usize>) -> u64 {
        let occupied = self.occupied.words()[w];
        let mut out = !occupied;
        if let Some(s) = seq {
            out |= self
                .seqs
                .holding_only(w, s, self.seq[s].words()[w] & occupied);
        }
        out
    }

    /// Sets, in `marks` (a bit per cell), the cells holding `seq` at positions in `[p0, p1)`,
    /// and returns the first and last word it set bits in: only the words whose position
    /// bounds meet the range are read.
    pub fn mark_cells_in(
        &self,
        seq: usize,
        p0: i32,
        p1: i32,
        marks: &mut [u64],
    ) -> Option<(usize, usize)> {
        let set = &self.seq[seq];
        let mut cur = set.cursor(p0, p1);
        let mut span: Option<(usize, usize)> = None;
        while let Some((w, inside)) = cur.next(set) {
            let hits = select(&self.pos, set.word(w), w, inside, p0, p1).0;
            if hits != 0 {
                marks[w] |= hits;
                span = Some(span.map_or((w, w), |(a, _)| (a, w)));
            }
        }
        span
    }

    /// How many cells hold `seq` and no other sequence, a word of cells at a time.
    pub fn count_held_only(&self, seq: usize) -> usize {
        let words = self.seq[seq].words().iter().enumerate();
        words
            .filter(|(_, &word)| word != 0)
            .map(|(w, &word)| self.seqs.holding_only(w, seq, word).count_ones() as usize)
            .sum()
    }

    /// Sets the deltas of `cells` to 0.
    pub fn zero_deltas(&mut self, cells: std::ops::Range<usize>) {
        self.delta[cells].fill(0);
    }

    /// The maximal runs `start..end` of free cells (`pos < 0`) that meet `span` and hold at
    /// least `min` cells, ascending. One pass over the occupied bitmap: a whole word costs a
    /// compare, a run a few bit operations (a cache of interleaved sequences has thousands).
    pub fn free_runs(&self, span: std::ops::Range<usize>, min: usize) -> Vec<(usize, usize)> {
        let n = self.pos.len();
        let mut out = Vec::new();
        let mut keep = |s: usize, e: usize| {
            if e - s >= min.max(1) && e > span.start && s < span.end {
                out.push((s, e));
            }
        };
        let mut open: Option<usize> = None;
        for (w, &word) in self.occupied.words().iter().enumerate() {
            let base = w * 64;
            if base >= n {
                break;
            }
            // free cells of the word; cells past the end count as occupied
            let mut free = !word;
            if n - base < 64 {
                free &= (1u64 << (n - base)) - 1;
            }
            match (open, free) {
                (None, 0) | (Some(_), u64::MAX) => continue,
                _ => {}
            }
            if min >= 64 && free != u64::MAX {
                // a run inside a word that is not all free is too short: only the runs across
                // its edges can count (one of interleaved sequences' thousands of holes each)
                if let Some(s) = open.take() {
                    keep(s, base + (!free).trailing_zeros() as usize);
                }
                let top = (!free).leading_zeros() as usize;
                if top > 0 {
                    open = Some(base + 64 - top);
                }
                continue;
            }
            let mut bit = 0u32;
            while bit < 64 {
                match open {
                    None => {
                        let rest = free >> bit;
                        if rest == 0 {
                            break;
                        }
                        bit += rest.trailing_zeros();
                        open = Some(base + bit as usize);
                    }
                    Some(s) => {
                        let rest = !free >> bit;
                        if rest == 0 {
                            break;
                        }
                        bit += rest.trailing_zeros();
                        keep(s, base + bit as usize);
                        open = None;
                    }
                }
            }
        }
        if let Some(s) = open {
            keep(s, n);
        }
        out
    }

    /// Sets the position of cell `i`.
    pub fn set_pos(&mut self, i: usize, pos: i32) {
        let old = self.pos[i];
        if old == pos {
            return;
        }
        self.pos[i] = pos;
        if pos >= 0 {
            self.occupied.insert(i, pos);
        } else {
            self.occupied.remove(i);
        }
        for seq in self.seqs.get(i).iter() {
            self.seq[seq].moved(i, pos);
            if pos > self.seq_pos_max[seq] {
                self.seq_pos_max[seq] = pos;
            } else if old == self.seq_pos_max[seq] {
                self.dirty.insert(seq);
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
        if self.seqs.contains(i, seq) {
            return;
        }
        self.seqs.insert(i, seq);
        self.seq[seq].insert(i, self.pos[i]);
        if self.seq[seq].count() == 1 {
            self.seq_pos_max[seq] = self.pos[i];
            self.dirty.remove(seq);
        } else if self.pos[i] > self.seq_pos_max[seq] {
            self.seq_pos_max[seq] = self.pos[i];
        }
    }

    /// Removes `seq` from cell `i`.
    pub fn remove_seq(&mut self, i: usize, seq: usize) {
        if !self.seqs.contains(i, seq) {
            return;
        }
        self.seqs.remove(i, seq);
        self.seq[seq].remove(i);
        if self.seq[seq].count() == 0 {
            self.seq_pos_max[seq] = NO_POS;
            self.dirty.remove(seq);
        } else if self.pos[i] == self.seq_pos_max[seq] {
            self.dirty.insert(seq);
        }
    }

    /// Removes every sequence from cell `i`.
    pub fn clear_seqs(&mut self, i: usize) {
        for seq in self.seqs.get(i).iter() {
            self.remove_seq(i, seq);
        }
    }

    /// Replaces the sequence set of cell `i`.
    pub fn set_seqs(&mut self, i: usize, seqs: SeqSet) {
        let old = self.seqs.get(i);
        for seq in old.minus(seqs).iter() {
            self.remove_seq(i, seq);
        }
        for seq in seqs.minus(old).iter() {
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
        self.set_ext(i, cell.ext);
    }

    /// Defrag's move of cell `src` into the free cell `dst`: afterwards `dst` is what `src` was
    /// and `src` is a default (free) cell, exactly as `set_cell(dst, get(src))` then
    /// `set_cell(src, Cell::default())`. When `dst` is free (no position, no sequence), as
    /// every defrag destination is, each sequence keeps the same positions, so its count and
    /// maximum stay as they are and only the set bits move: no removal marks a maximum stale.
    pub fn move_cell(&mut self, src: usize, dst: usize) {
        if src == dst || self.pos[dst] >= 0 || !self.seqs.is_empty(dst) {
            let moved = self.get(src);
            self.set_cell(dst, moved);
            self.set_cell(src, Cell::default());
            return;
        }
        let (pos, seqs) = (self.pos[src], self.seqs.get(src));
        self.pos[dst] = pos;
        self.delta[dst] = self.delta[src];
        self.src[dst] = self.src[src];
        self.tail[dst] = self.tail[src];
        self.seqs.set(dst, seqs);
        if let Some(&ext) = self.ext.get(src) {
            self.ext[dst] = ext;
        }
        if pos >= 0 {
            self.occupied.remove(src);
            self.occupied.insert(dst, pos);
        }
        for seq in seqs.iter() {
            self.seq[seq].remove(src);
            self.seq[seq].insert(dst, pos);
        }
        let free = Cell::default();
        self.pos[src] = free.pos;
        self.delta[src] = free.delta;
        self.src[src] = free.src;
        self.tail[src] = free.tail;
        self.seqs.set(src, free.seqs);
    }

    /// Recomputes the maxima marked stale; called at the end of every mutating operation so
    /// that `seq_pos_max` stays O(1).
    pub fn settle(&mut self) {
        while let Some(seq) = self.dirty.pop_first() {
            self.seq_pos_max[seq] = self.seq[seq].max_pos(&self.pos).unwrap_or(NO_POS);
        }
    }

    /// Fills the free cells `first..first + pos.len()` (no position, no sequence) with the
    /// positions `pos` and the sequences `seqs(k)` of the `k`-th, as `set_pos` then an
    /// `insert_seq` per sequence of each cell would, but gives every index one update per 64
    /// cells instead of one per cell: slot placement of a long ubatch and whole-cache loads
    /// (65,536 cells spent more time in per-cell index updates than in copying their rows). The
    /// cells of a word that share one set of sequences, as a sequence's cells almost always do,
    /// take column copies and a min/max pass instead of a loop over each cell's sequences.
    ///
    /// `seqs(k)` gives the `k`-th cell's sequence ids (each below the table's sequence count),
    /// as a ubatch or a payload holds them: a cell of one sequence, the common case, never
    /// builds a set.
    pub fn fill_free<'s>(&mut self, first: usize, pos: &[i32], seqs: impl Fn(usize) -> &'s [i32]) {
        self.fill_free_with(first, pos, &seqs, false);
    }

    /// [`Cells::fill_free`] with the same sequence ids `ids` for every cell (a sequence's
    /// tokens): no cell's ids are compared with the others'.
    pub fn fill_free_all(&mut self, first: usize, pos: &[i32], ids: &[i32]) {
        self.fill_free_with(first, pos, &|_| ids, true);
    }

    fn fill_free_with<'s>(
        &mut self,
        first: usize,
        pos: &[i32],
        seqs: &impl Fn(usize) -> &'s [i32],
        uniform: bool,
    ) {
        let end = first + pos.len();
        let mut at = first;
        while at < end {
            let w = at / 64;
            let stop = (w * 64 + 64).min(end);
            let (new_pos, cells) = (&pos[at - first..stop - first], at..stop);
            debug_assert!(
                cells
                    .clone()
                    .all(|i| self.pos[i] < 0 && self.seqs.is_empty(i)),
                "cells {cells:?} are not all free"
            );
            let ids = seqs(at - first);
            let (lo, hi) = new_pos
                .iter()
                .fold((i32::MAX, i32::MIN), |(lo, hi), &p| (lo.min(p), hi.max(p)));
            // compared element by element: a slice `==` calls memcmp, which costs more than
            // the one id a cell almost always has
            let same = |other: &[i32]| {
                other.len() == ids.len() && other.iter().zip(ids).all(|(a, b)| a == b)
            };
            if lo >= 0 && (uniform || (at + 1..stop).all(|i| same(seqs(i - first)))) {
                let set = SeqSet::of(ids);
                let bits = (u64::MAX >> (64 - (stop - at))) << (at % 64);
                self.pos[cells.clone()].copy_from_slice(new_pos);
                self.seqs.fill(cells, set);
                self.occupied.add_bits(w, bits, lo, hi);
                for seq in set.iter() {
                    self.seq[seq].add_bits(w, bits, lo, hi);
                    self.seq_pos_max[seq] = self.seq_pos_max[seq].max(hi);
                }
            } else {
                self.fill_cell_by_cell(at, at - first, new_pos, seqs);
            }
            at = stop;
        }
    }

    /// [`Cells::fill_free`] of the cells `at..at + pos.len()`, all in one word, one cell at a
    /// time: the `k`-th gets `pos[k]` and the sequences `seqs(offset + k)`.
    fn fill_cell_by_cell<'s>(
        &mut self,
        at: usize,
        offset: usize,
        pos: &[i32],
        seqs: &impl Fn(usize) -> &'s [i32],
    ) {
        // per sequence: its members among the word's new cells and their position bounds (a
        // table kept between calls: initialising one for 256 sequences here cost more than
        // placing a token)
        let members = &mut self.members;
        let mut word = (0u64, i32::MAX, i32::MIN);
        let mut present = SeqSet::EMPTY;
        let w = at / 64;
        for (k, &p) in pos.iter().enumerate() {
            let (i, ids) = (at + k, seqs(offset + k));
            let bit = 1u64 << (i % 64);
            self.pos[i] = p;
            if p >= 0 {
                word = (word.0 | bit, word.1.min(p), word.2.max(p));
            }
            let set = match ids {
                &[one] => {
                    self.seqs.set_single(i, one as usize);
                    let m = &mut members[one as usize];
                    *m = (m.0 | bit, m.1.min(p), m.2.max(p));
                    present.insert(one as usize);
                    continue;
                }
                _ => SeqSet::of(ids),
            };
            self.seqs.set(i, set);
            for seq in set.iter() {
                let m = &mut members[seq];
                *m = (m.0 | bit, m.1.min(p), m.2.max(p));
            }
            present = present.union(set);
        }
        self.occupied.add_bits(w, word.0, word.1, word.2);
        for seq in present.iter() {
            let (bits, lo, hi) = std::mem::replace(&mut members[seq], NO_MEMBERS);
            self.seq[seq].add_bits(w, bits, lo, hi);
            // a sequence without cells has the maximum NO_POS, below any position
            self.seq_pos_max[seq] = self.seq_pos_max[seq].max(hi);
        }
    }

    /// Takes the deltas of `other`, a table of the same size.
    pub fn copy_deltas_from(&mut self, other: &Cells) {
        self.delta.copy_from_slice(&other.delta);
    }

    /// Resets every cell's pos, seqs, src and tail (not delta: the seed's `clear` keeps it).
    pub fn reset(&mut self) {
        self.pos.fill(-1);
        self.src.fill(-1);
        self.tail.fill(-1);
        self.seqs.clear();
        self.ext.fill(CellExtValue::default());
        self.occupied.clear();
        for s in &mut self.seq {
            s.clear();
        }
        self.seq_pos_max.fill(NO_POS);
        self.dirty = SeqSet::EMPTY;
        self.used = 0;
    }

    /// Checks every index against the columns (tests and debug builds).
    pub fn check_consistency(&self) -> Result<(), String> {
        self.occupied
            .check("occupied", &self.pos, |i| self.pos[i] >= 0)?;
        for seq in 0..self.n_seq() {
            self.seq[seq].check(&format!("seq {seq}"), &self.pos, |i| {
                self.seqs.contains(i, seq)
            })?;
            if (self.seq_pos_max[seq] == NO_POS) != (self.seq[seq].count() == 0) {
                return Err(format!(
                    "seq {seq}: stored maximum {} with {} cells",
                    self.seq_pos_max[seq],
                    self.seq[seq].count()
                ));
            }
            let max = (0..self.pos.len())
                .filter(|&i| self.seqs.contains(i, seq))
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

/// Defrag's word-at-a-time view and moves of the cells.
impl Cells {
    /// The sequences holding at least one cell, from the sets' counts.
    fn present(&self) -> SeqSet {
        let mut present = SeqSet::EMPTY;
        for (s, set) in self.seq.iter().enumerate() {
            if set.count() > 0 {
                present.insert(s);
            }
        }
        present
    }

    /// The non-empty cells (held by a sequence: the seed's `!is_empty()`), one bit per cell,
    /// 64 to a word: the union of the sequences' bitmaps, a word per sequence for 64 cells.
    pub fn nonempty_words(&self) -> Vec<u64> {
        let mut words = vec![0u64; self.occupied.words().len()];
        for s in self.present().iter() {
            for (out, &w) in words.iter_mut().zip(self.seq[s].words()) {
                *out |= w;
            }
        }
        words
    }

    /// The seed's `cell_max`: one past the last cell with a position and a sequence, or 0.
    /// Reads the bitmaps from the last word down instead of every cell from the end.
    pub fn cell_max(&self) -> usize {
        let present = self.present();
        let occupied = self.occupied.words();
        for w in (0..occupied.len()).rev() {
            if occupied[w] == 0 {
                continue;
            }
            let held = present.iter().fold(0, |held, s| held | self.seq[s].word(w));
            let both = occupied[w] & held;
            if both != 0 {
                return w * 64 + 64 - both.leading_zeros() as usize;
            }
        }
        0
    }

    /// Moves cells `src..src + len` to `dst..dst + len` as `move_cell(src + k, dst + k)` for
    /// `k` ascending would, but with column copies and an index update per 64 cells instead of
    /// per cell and sequence: a defrag moves tens of thousands of cells in a few runs.
    ///
    /// The fast path needs what every defrag run has: the two ranges apart and every
    /// destination cell free (no position, no sequence); the moved cells keep their positions,
    /// so counts and maxima stay, and each set's bits move with the source word's position
    /// bounds (valid, if perhaps looser than the moved cells need). Anything else, or a range
    /// past the end, takes the cell-by-cell path (which panics out of range, as `move_cell`).
    pub fn move_run(&mut self, src: usize, dst: usize, len: usize) {
        let n = self.pos.len();
        let apart = src.checked_add(len).is_some_and(|e| e <= dst.min(n))
            || dst.checked_add(len).is_some_and(|e| e <= src.min(n));
        let fits = src.max(dst).checked_add(len).is_some_and(|e| e <= n);
        // a short run costs less cell by cell than the fixed cost of the bitmap moves below
        // (a fragmented cache moves thousands of single cells)
        if len <= SHORT_RUN || !apart || !fits || !self.all_free(dst, len) {
            for k in 0..len {
                self.move_cell(src + k, dst + k);
            }
            return;
        }
        let present = self.seqs.union_of(src..src + len);
        self.seqs.move_cells(src, dst, len);
        move_column(&mut self.pos, src, dst, len, -1);
        move_column(&mut self.delta, src, dst, len, 0);
        move_column(&mut self.src, src, dst, len, -1);
        move_column(&mut self.tail, src, dst, len, -1);
        if self.keeps_ext() {
            move_column(&mut self.ext, src, dst, len, CellExtValue::default());
        }
        self.occupied.move_members(src, dst, len);
        for s in present.iter() {
            self.seq[s].move_members(src, dst, len);
        }
    }

    /// Whether cells `first..first + len` (inside the cache) have no position and no sequence,
    /// read from the bitmaps.
    fn all_free(&self, first: usize, len: usize) -> bool {
        let mut sets =
            std::iter::once(&self.occupied).chain(self.present().iter().map(|s| &self.seq[s]));
        !sets.any(|set| set.any_in(first, len))
    }
}

/// Copies `col[src..src + len]` to `dst` (apart from it) and fills the source with `free`
/// (the sequence column has its own, [`SeqColumn::move_cells`]).
fn move_column<T: Copy>(col: &mut [T], src: usize, dst: usize, len: usize, free: T) {
    col.copy_within(src..src + len, dst);
    col[src..src + len].fill(free);
}

/// Runs of at most this many cells move cell by cell (`Cells::move_run`).
const SHORT_RUN: usize = 4;

#[cfg(test)]
mod tests {
    use super::*;

    /// The set of sequence ids `k * spread` for each bit `k` of `bits`: with a spread of 1 the
    /// bits themselves; a spread of 63 puts the ids of a few bits in every word of a 256-sequence
    /// table.
    fn spread_ids(bits: u64, spread: usize) -> SeqSet {
        let mut set = SeqSet::EMPTY;
        for k in super::bits(bits) {
            set.insert(k * spread);
        }
        set
    }

    /// `got` has the cells of `want`, consistent indexes, and the same counts and maxima.
    fn same_tables(got: &Cells, want: &Cells) -> Result<(), proptest::test_runner::TestCaseError> {
        proptest::prop_assert!(got == want);
        proptest::prop_assert_eq!(got.check_consistency(), Ok(()));
        for seq in 0..want.n_seq() {
            proptest::prop_assert_eq!(got.seq_pos_max(seq), want.seq_pos_max(seq));
            proptest::prop_assert_eq!(got.seq_cell_count(seq), want.seq_cell_count(seq));
        }
        Ok(())
    }

    proptest::proptest! {
        #[test]
        fn runs_of_a_sequence_are_its_cells_in_order(
            cells in proptest::collection::vec(0u64..8, 1..400),
        ) {
            // runs across word boundaries, full words, lone cells and the cache's last cell
            let mut t = Cells::new(cells.len(), 3).unwrap();
            for (i, &seqs) in cells.iter().enumerate() {
                if seqs != 0 {
                    t.set_pos(i, i as i32);
                    t.set_seqs(i, spread_ids(seqs, 1));
                }
            }
            for seq in 0..3 {
                let flat: Vec<usize> = t.runs_of(seq).iter().flat_map(|&(a, b)| a..b).collect();
                let want: Vec<usize> = (0..cells.len()).filter(|&i| cells[i] >> seq & 1 == 1).collect();
                proptest::prop_assert_eq!(flat, want);
                let runs = t.runs_of(seq);
                proptest::prop_assert!(runs.windows(2).all(|w| w[0].1 < w[1].0), "runs touch: {:?}", runs);
            }
        }

        #[test]
        fn filling_free_cells_matches_setting_each_cell(
            before in proptest::collection::vec((-1i32..200, 0u64..16), 0..200),
            cells in proptest::collection::vec((-1i32..200, 0u64..16), 0..300),
            size_extra in 0usize..70,
            one_set in proptest::option::of(1u64..16),
            spread in proptest::sample::select(vec![1usize, 63]),
        ) {
            // cells `before.len()..` filled at once equal cell-by-cell updates: same columns,
            // consistent indexes, same counts and maxima, also where the run starts inside a
            // word that already has members; `one_set` gives every new cell the same sequences
            // (whole words of one set take the column path)
            let as_cell = |(pos, seqs): (i32, u64)| (pos, if pos < 0 { SeqSet::EMPTY } else { spread_ids(seqs, spread) });
            let before: Vec<(i32, SeqSet)> = before.into_iter().map(as_cell).collect();
            let cells: Vec<(i32, SeqSet)> = match one_set {
                Some(set) => cells.into_iter().map(|(p, _)| (p.max(0), spread_ids(set, spread))).collect(),
                None => cells.into_iter().map(as_cell).collect(),
            };
            let size = before.len() + cells.len() + size_extra;
            let mut one_by_one = Cells::new(size, 4 * spread).unwrap();
            let mut filled = Cells::new(size, 4 * spread).unwrap();
            for t in [&mut one_by_one, &mut filled] {
                for (i, &(pos, seqs)) in before.iter().enumerate() {
                    t.set_pos(i, pos);
                    t.set_seqs(i, seqs);
                }
                // a stale maximum to carry over
                if let Some(i) = (0..before.len()).rev().find(|&i| t.seqs.contains(i, spread)) {
                    t.remove_seq(i, spread);
                    if t.seqs.is_empty(i) {
                        t.set_pos(i, -1);
                    }
                }
            }
            let first = before.len();
            for (k, &(pos, seqs)) in cells.iter().enumerate() {
                one_by_one.set_pos(first + k, pos);
                for seq in seqs.iter() {
                    one_by_one.insert_seq(first + k, seq);
                }
            }
            one_by_one.settle();
            let pos: Vec<i32> = cells.iter().map(|c| c.0).collect();
            let ids: Vec<Vec<i32>> = cells.iter().map(|c| c.1.iter().map(|s| s as i32).collect()).collect();
            // the same sequences for every cell may also come as one list (fill_free_all)
            let mut filled_all = (one_set.is_some() && !ids.is_empty()).then(|| filled.clone());
            filled.fill_free(first, &pos, |k| &ids[k]);
            filled.settle();
            same_tables(&filled, &one_by_one)?;
            if let Some(t) = filled_all.as_mut() {
                t.fill_free_all(first, &pos, &ids[0]);
                t.settle();
                same_tables(t, &one_by_one)?;
            }
        }
    }

    proptest::proptest! {
        #[test]
        fn moving_a_run_matches_moving_each_cell(
            cells in proptest::collection::vec((-1i32..300, 0u64..32), 1..300),
            src in 0usize..300,
            dst in 0usize..300,
            len in 0usize..200,
            free_dst in proptest::bool::ANY,
            spread in proptest::sample::select(vec![1usize, 63]),
        ) {
            // cells of five sequences (some with a position and no sequence) filling words
            // partly; a run anywhere, its destination freed first or not (the fast path or
            // the cell-by-cell one); afterwards the same cells, consistent indexes, and the
            // same counts and maxima as `move_cell` for each cell in turn
            let size = cells.len();
            let (src, dst) = (src % size, dst % size);
            let len = len.min(size - src.max(dst));
            let mut one_by_one = Cells::new(size, 4 * spread + 1).unwrap();
            for (i, &(pos, seqs)) in cells.iter().enumerate() {
                one_by_one.set_pos(i, pos);
                if pos >= 0 {
                    one_by_one.set_seqs(i, spread_ids(seqs, spread));
                }
            }
            if free_dst {
                for i in dst..dst + len {
                    one_by_one.set_cell(i, Cell::default());
                }
            }
            one_by_one.settle();
            let mut by_run = one_by_one.clone();
            for k in 0..len {
                one_by_one.move_cell(src + k, dst + k);
            }
            one_by_one.settle();
            by_run.move_run(src, dst, len);
            by_run.settle();
            same_tables(&by_run, &one_by_one)?;
            proptest::prop_assert_eq!(by_run.cell_max(), one_by_one.cell_max());
            // the moved bounds still find every member: a range removal agrees too
            let seq = 2 * spread;
            let (a, b) = (by_run.remove_seq_in_range(seq, 50, 150), one_by_one.remove_seq_in_range(seq, 50, 150));
            proptest::prop_assert_eq!(a, b);
            proptest::prop_assert!(by_run == one_by_one);
        }

        #[test]
        fn cell_max_from_the_bitmaps_is_the_seeds(
            cells in proptest::collection::vec((-1i32..50, 0u64..8), 0..300),
            size_extra in 1usize..70,
        ) {
            let size = cells.len() + size_extra;
            let mut c = Cells::new(size, 3).unwrap();
            for (i, &(pos, seqs)) in cells.iter().enumerate() {
                c.set_pos(i, pos);
                c.set_seqs(i, spread_ids(seqs, 1));
            }
            // the seed's loop: the last cell with a position and a sequence
            let want = (0..size)
                .rev()
                .find(|&i| c.pos(i) >= 0 && !c.seqs(i).is_empty())
                .map_or(0, |i| i + 1);
            proptest::prop_assert_eq!(c.cell_max(), want);
        }
    }

    proptest::proptest! {
        #[test]
        fn free_runs_are_the_naive_runs_of_free_cells(
            occupied in proptest::collection::vec(proptest::bool::ANY, 1..300),
            dense in proptest::bool::ANY,
            span in (0usize..300, 0usize..300),
            min in 1usize..140,
        ) {
            // sparse or dense occupancy (long runs cross words, short ones end inside them)
            let mut c = Cells::new(occupied.len(), 1).unwrap();
            for (i, &o) in occupied.iter().enumerate() {
                if o != dense && i % 3 != 0 {
                    c.set_pos(i, i as i32);
                }
            }
            let n = occupied.len();
            let span = span.0.min(span.1)..span.0.max(span.1);
            let mut want = Vec::new();
            let mut i = 0;
            while i < n {
                if c.pos(i) >= 0 {
                    i += 1;
                    continue;
                }
                let s = i;
                while i < n && c.pos(i) < 0 {
                    i += 1;
                }
                if i - s >= min && i > span.start && s < span.end {
                    want.push((s, i));
                }
            }
            proptest::prop_assert_eq!(c.free_runs(span, min), want);
        }
    }

    #[test]
    fn a_free_range_of_every_set_is_detected_across_words() {
        let mut c = Cells::new(200, 2).unwrap();
        c.set_pos(130, 7);
        c.set_seqs(70, SeqSet::single(1));
        assert!(c.all_free(0, 70));
        assert!(!c.all_free(0, 71));
        assert!(c.all_free(71, 59));
        assert!(!c.all_free(71, 60));
        assert!(c.all_free(131, 69));
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
        assert_eq!(c.next_occupied_before(131, 150), 150);
        assert_eq!(c.next_occupied_before(131, 151), 150);
        assert_eq!(c.next_occupied_before(151, 199), 199);
        assert_eq!(c.next_free_before(0, 64), 64);
        assert_eq!(c.next_free_before(0, 131), 130);
        assert_eq!(c.next_free_before(5, 5), 5);
        assert_eq!(c.next_occupied_before(190, 900), 200);
        c.insert_seq(3, 0);
        assert_eq!(c.first_without(0), Some(0));
    }
}
