//! Sets of sequence ids: [`SeqSet`], a value of up to [`MAX_SEQ`] (256, today's
//! `LLAMA_MAX_SEQ`) ids, and [`SeqColumn`], every cell's set stored in as few words as the
//! cache's `n_seq_max` needs.
//!
//! The column is why this module exists: a cache of at most 64 sequences (almost every cache)
//! keeps one `u64` per cell, exactly as when 64 was the limit, so its scans and fills move no
//! more memory than they did; only a cache of more sequences pays a word per 64 of them.

use std::ops::Range;

use crate::error::Result;
use crate::params::MAX_SEQ;

/// Words of a full set.
const WORDS: usize = MAX_SEQ / 64;

/// A set of sequence ids in `0..MAX_SEQ`.
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct SeqSet([u64; WORDS]);

impl std::fmt::Debug for SeqSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.iter()).finish()
    }
}

impl SeqSet {
    /// The empty set.
    pub const EMPTY: SeqSet = SeqSet([0; WORDS]);

    /// The set holding only `seq`.
    pub fn single(seq: usize) -> SeqSet {
        let mut set = SeqSet::EMPTY;
        set.insert(seq);
        set
    }

    /// The set of `ids` (each in `0..MAX_SEQ`, validated by the caller).
    pub fn of(ids: &[i32]) -> SeqSet {
        let mut set = SeqSet::EMPTY;
        for &id in ids {
            set.insert(id as usize);
        }
        set
    }

    /// Whether `seq` is in the set.
    #[inline(always)]
    pub fn contains(self, seq: usize) -> bool {
        seq < MAX_SEQ && self.0[seq / 64] >> (seq % 64) & 1 != 0
    }

    /// Whether the set is empty.
    #[inline(always)]
    pub fn is_empty(self) -> bool {
        self.0.iter().all(|&w| w == 0)
    }

    /// Number of ids in the set.
    pub fn len(self) -> usize {
        self.0.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// Adds `seq` (in `0..MAX_SEQ`).
    #[inline(always)]
    pub fn insert(&mut self, seq: usize) {
        self.0[seq / 64] |= 1u64 << (seq % 64);
    }

    /// Removes `seq` (in `0..MAX_SEQ`).
    #[inline(always)]
    pub fn remove(&mut self, seq: usize) {
        self.0[seq / 64] &= !(1u64 << (seq % 64));
    }

    /// The ids in either set.
    #[inline(always)]
    pub fn union(self, other: SeqSet) -> SeqSet {
        SeqSet(std::array::from_fn(|w| self.0[w] | other.0[w]))
    }

    /// The ids of `self` not in `other`.
    #[inline(always)]
    pub fn minus(self, other: SeqSet) -> SeqSet {
        SeqSet(std::array::from_fn(|w| self.0[w] & !other.0[w]))
    }

    /// Whether the sets share an id.
    #[inline(always)]
    pub fn intersects(self, other: SeqSet) -> bool {
        (0..WORDS).any(|w| self.0[w] & other.0[w] != 0)
    }

    /// The id of a set of exactly one.
    #[inline(always)]
    pub fn only(self) -> Option<usize> {
        let mut nonzero = (0..WORDS).filter(|&w| self.0[w] != 0);
        match (nonzero.next(), nonzero.next()) {
            (Some(w), None) if self.0[w].is_power_of_two() => {
                Some(w * 64 + self.0[w].trailing_zeros() as usize)
            }
            _ => None,
        }
    }

    /// Removes and returns the smallest id, if any.
    pub fn pop_first(&mut self) -> Option<usize> {
        let w = self.0.iter().position(|&w| w != 0)?;
        let b = self.0[w].trailing_zeros() as usize;
        self.0[w] &= self.0[w] - 1;
        Some(w * 64 + b)
    }

    /// The ids, ascending (the order of the seed's `std::set`).
    #[inline(always)]
    pub fn iter(self) -> SeqIter {
        // a set of ids below 64, almost every set, ends with its first word
        let high = self.0[1..].iter().fold(0, |acc, &w| acc | w);
        SeqIter {
            cur: self.0[0],
            words: self.0,
            at: 0,
            end: if high == 0 { 1 } else { WORDS },
        }
    }
}

/// The ids of a [`SeqSet`], ascending. A loop of its own rather than adapters over the words,
/// and one that stops after the first word when the others are empty: the cell table walks
/// the sequences of each cell and of each 64-cell word, and a walk over all four words made
/// the sequence operations and slot placement 1.5x the instructions of one-word masks.
pub struct SeqIter {
    words: [u64; WORDS],
    cur: u64,
    at: usize,
    end: usize,
}

impl Iterator for SeqIter {
    type Item = usize;

    #[inline(always)]
    fn next(&mut self) -> Option<usize> {
        loop {
            if self.cur != 0 {
                let b = self.cur.trailing_zeros() as usize;
                self.cur &= self.cur - 1;
                return Some(self.at * 64 + b);
            }
            self.at += 1;
            if self.at >= self.end {
                return None;
            }
            self.cur = self.words[self.at];
        }
    }
}

/// Every cell's sequence set, `stride` words per cell: `n_seq_max.div_ceil(64)`, so one word
/// per cell for the caches of up to 64 sequences.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeqColumn {
    words: Vec<u64>,
    stride: usize,
}

impl SeqColumn {
    /// `len` empty cells for sequences `0..n_seq`; an error (not an abort) when the column
    /// cannot be allocated.
    pub fn new(len: usize, n_seq: usize, what: &str) -> Result<SeqColumn> {
        let stride = n_seq.div_ceil(64).clamp(1, WORDS);
        // cell counts are u32s: no overflow on a 64-bit target
        Ok(SeqColumn {
            words: crate::alloc::zeroed(len * stride, what)?,
            stride,
        })
    }

    /// Cell `i`'s words.
    #[inline(always)]
    fn cell(&self, i: usize) -> &[u64] {
        &self.words[i * self.stride..(i + 1) * self.stride]
    }

    /// Cell `i`'s set.
    #[inline(always)]
    pub fn get(&self, i: usize) -> SeqSet {
        if self.stride == 1 {
            let mut set = SeqSet::EMPTY;
            set.0[0] = self.words[i];
            return set;
        }
        let mut set = SeqSet::EMPTY;
        set.0[..self.stride].copy_from_slice(self.cell(i));
        set
    }

    /// Sets cell `i`'s set (of ids below the column's sequence count).
    #[inline(always)]
    pub fn set(&mut self, i: usize, set: SeqSet) {
        debug_assert!(set.0[self.stride..].iter().all(|&w| w == 0), "{set:?}");
        let s = self.stride;
        if s == 1 {
            self.words[i] = set.0[0];
        } else {
            self.words[i * s..(i + 1) * s].copy_from_slice(&set.0[..s]);
        }
    }

    /// Whether cell `i` holds `seq`.
    #[inline(always)]
    pub fn contains(&self, i: usize, seq: usize) -> bool {
        seq / 64 < self.stride && self.words[i * self.stride + seq / 64] >> (seq % 64) & 1 != 0
    }

    /// Sets cell `i`'s set to `seq` alone (below the column's sequence count).
    #[inline(always)]
    pub fn set_single(&mut self, i: usize, seq: usize) {
        if self.stride == 1 {
            self.words[i] = 1 << seq;
        } else {
            self.set(i, SeqSet::single(seq));
        }
    }

    /// Whether cell `i` holds `seq` and no other sequence.
    #[inline(always)]
    pub fn holds_only(&self, i: usize, seq: usize) -> bool {
        if self.stride == 1 {
            return seq < 64 && self.words[i] == 1 << seq;
        }
        self.get(i) == SeqSet::single(seq)
    }

    /// The one sequence cell `i` holds, if it holds exactly one.
    #[inline(always)]
    pub fn only(&self, i: usize) -> Option<usize> {
        if self.stride == 1 {
            let w = self.words[i];
            return w.is_power_of_two().then(|| w.trailing_zeros() as usize);
        }
        self.get(i).only()
    }

    /// Of the cells of word `w` (cells `64 * w..`, each a bit) in `candidates`, those that
    /// hold `seq` alone.
    pub fn holding_only(&self, w: usize, seq: usize, candidates: u64) -> u64 {
        if self.stride == 1 && seq < 64 {
            // compared cell by cell without a branch, which the compiler vectorizes
            let first = w * 64;
            let cells = &self.words[first..(first + 64).min(self.words.len())];
            let mut out = 0u64;
            for (b, &set) in cells.iter().enumerate() {
                out |= u64::from(set == 1 << seq) << b;
            }
            return out & candidates;
        }
        let mut out = 0u64;
        let mut rest = candidates;
        while rest != 0 {
            let b = rest.trailing_zeros() as usize;
            if self.holds_only(w * 64 + b, seq) {
                out |= 1 << b;
            }
            rest &= rest - 1;
        }
        out
    }

    /// Whether cell `i` holds no sequence.
    #[inline(always)]
    pub fn is_empty(&self, i: usize) -> bool {
        if self.stride == 1 {
            return self.words[i] == 0;
        }
        self.cell(i).iter().all(|&w| w == 0)
    }

    /// Adds `seq` (below the column's sequence count) to cell `i`.
    #[inline(always)]
    pub fn insert(&mut self, i: usize, seq: usize) {
        self.words[i * self.stride + seq / 64] |= 1u64 << (seq % 64);
    }

    /// Removes `seq` from cell `i`; whether the cell holds no sequence afterwards.
    #[inline(always)]
    pub fn remove(&mut self, i: usize, seq: usize) -> bool {
        if self.stride == 1 {
            let w = &mut self.words[i];
            *w &= !(1u64 << seq);
            return *w == 0;
        }
        self.words[i * self.stride + seq / 64] &= !(1u64 << (seq % 64));
        self.is_empty(i)
    }

    /// Sets every cell of `cells` to `set`.
    pub fn fill(&mut self, cells: Range<usize>, set: SeqSet) {
        let s = self.stride;
        let words = &mut self.words[cells.start * s..cells.end * s];
        if s == 1 {
            words.fill(set.0[0]);
        } else {
            for cell in words.chunks_exact_mut(s) {
                cell.copy_from_slice(&set.0[..s]);
            }
        }
    }

    /// Adds `seq` to every cell of `cells`.
    pub fn add_to_all(&mut self, cells: Range<usize>, seq: usize) {
        let (s, bit) = (self.stride, 1u64 << (seq % 64));
        let words = &mut self.words[cells.start * s..cells.end * s];
        if s == 1 {
            words.iter_mut().for_each(|w| *w |= bit);
        } else {
            words
                .iter_mut()
                .skip(seq / 64)
                .step_by(s)
                .for_each(|w| *w |= bit);
        }
    }

    /// The sequences of any cell of `cells`.
    pub fn union_of(&self, cells: Range<usize>) -> SeqSet {
        let s = self.stride;
        let mut set = SeqSet::EMPTY;
        for (k, &w) in self.words[cells.start * s..cells.end * s]
            .iter()
            .enumerate()
        {
            set.0[k % s] |= w;
        }
        set
    }

    /// Copies cells `src..src + len` to `dst` (apart from them) and empties the source.
    pub fn move_cells(&mut self, src: usize, dst: usize, len: usize) {
        let s = self.stride;
        self.words.copy_within(src * s..(src + len) * s, dst * s);
        self.words[src * s..(src + len) * s].fill(0);
    }

    /// Empties every cell.
    pub fn clear(&mut self) {
        self.words.fill(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seq_set_iterates_ascending_across_words() {
        let mut s = SeqSet::EMPTY;
        for seq in [255, 5, 0, 63, 64, 200] {
            s.insert(seq);
        }
        assert_eq!(s.iter().collect::<Vec<_>>(), vec![0, 5, 63, 64, 200, 255]);
        assert_eq!(s.len(), 6);
        s.remove(5);
        assert!(!s.contains(5) && s.contains(64) && !s.contains(256));
        assert_eq!(s.only(), None);
        assert_eq!(SeqSet::single(130).only(), Some(130));
        assert_eq!(SeqSet::EMPTY.only(), None);
        assert_eq!(s.pop_first(), Some(0));
        assert_eq!(s.pop_first(), Some(63));
        assert_eq!(format!("{s:?}"), "{64, 200, 255}");
    }

    #[test]
    fn set_algebra() {
        let (a, b) = (SeqSet::of(&[1, 70, 130]), SeqSet::of(&[70, 250]));
        assert_eq!(a.union(b), SeqSet::of(&[1, 70, 130, 250]));
        assert_eq!(a.minus(b), SeqSet::of(&[1, 130]));
        assert!(a.intersects(b) && !a.intersects(SeqSet::of(&[2])));
    }

    /// One word per cell up to 64 sequences, four at 256: the same sets either way.
    #[test]
    fn column_strides_keep_each_cells_set() {
        for n_seq in [2, 64, 65, 256] {
            let mut col = SeqColumn::new(10, n_seq, "test").unwrap();
            assert_eq!(col.stride, n_seq.div_ceil(64));
            let top = n_seq - 1;
            col.insert(3, top);
            col.insert(3, 0);
            assert_eq!(col.get(3), SeqSet::of(&[0, top as i32]));
            assert!(col.contains(3, top) && !col.contains(2, top) && !col.contains(3, 300));
            assert!(!col.remove(3, 0));
            assert!(col.remove(3, top));
            col.fill(2..5, SeqSet::single(top));
            col.add_to_all(4..7, 0);
            assert_eq!(col.get(4), SeqSet::of(&[0, top as i32]));
            assert_eq!(col.get(6), SeqSet::single(0));
            assert_eq!(col.union_of(0..10), SeqSet::of(&[0, top as i32]));
            col.move_cells(2, 7, 3);
            assert!((2..5).all(|i| col.is_empty(i)));
            assert_eq!(col.get(7), SeqSet::single(top));
            col.clear();
            assert!((0..10).all(|i| col.is_empty(i)));
        }
    }
}
