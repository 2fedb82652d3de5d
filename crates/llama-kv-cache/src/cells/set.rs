//! A set of cells (the cells of one sequence, or every occupied cell) that finds its members
//! with positions in a range without visiting the others.
//!
//! Members are bits, 64 cells to a word. Every non-empty word carries bounds `[lo, hi]` holding
//! the position of each member in it, and every group of 64 words (4,096 cells) carries a bitmap
//! of its non-empty words and bounds over theirs. A range query walks the groups whose bounds
//! meet the range, then their words whose bounds meet it: it costs one check per 4,096 cells
//! plus the words that hold positions in the range. `find_slot` places a sequence's tokens in
//! increasing cells as their positions increase, so a sequence's positions are clustered by
//! word and a short range touches a handful of words, however long the sequence.
//!
//! This is a zone map rather than a sorted index: bounds may be loose (wider than the members
//! need). Removing a member or moving its position only widens them, which costs nothing;
//! operations that read every member of a word set its exact bounds again. Loose bounds only make
//! a query look at a word it could have skipped, so a sequence whose positions are scattered
//! over its cells at random costs what a walk over its cells costs, never more. Memory: 16 bytes
//! per 64 cells per set (the bitmap word and its bounds) plus 24 bytes per 4,096 cells.

use crate::alloc::{filled, zeroed};
use crate::error::Result;

/// Words per group (the bits of one `u64`).
const GROUP: usize = 64;

/// Bounds of an empty range: the identity of `min`/`max`.
pub(crate) const NO_LO: i32 = i32::MAX;
pub(crate) const NO_HI: i32 = i32::MIN;

/// The set bit indices of `word`, ascending.
#[inline(always)]
pub(crate) fn bits(mut word: u64) -> impl Iterator<Item = usize> {
    std::iter::from_fn(move || {
        if word == 0 {
            return None;
        }
        let b = word.trailing_zeros() as usize;
        word &= word - 1;
        Some(b)
    })
}

/// The first cell in `[from, end)` whose bit in `words` is `set`, or `end` (`end` within
/// the words).
pub(crate) fn next_bit(words: &[u64], from: usize, end: usize, set: bool) -> usize {
    if from >= end {
        return end;
    }
    let flip = if set { 0 } else { u64::MAX };
    let mut w = from / 64;
    let mut word = (words[w] ^ flip) & (u64::MAX << (from % 64));
    loop {
        if word != 0 {
            return (w * 64 + word.trailing_zeros() as usize).min(end);
        }
        w += 1;
        if w * 64 >= end {
            return end;
        }
        word = words[w] ^ flip;
    }
}

/// The set bits of `words` (64 cells to a word) as runs `start..end` of consecutive cells,
/// ascending, found a word at a time (a full word extends a run in one step).
pub(crate) fn runs_of_words(words: &[u64]) -> Vec<(usize, usize)> {
    let end = words.len() * 64;
    let mut out = Vec::new();
    let mut at = 0;
    loop {
        let start = next_bit(words, at, end, true);
        if start == end {
            return out;
        }
        at = next_bit(words, start, end, false);
        out.push((start, at));
    }
}

/// A set of cells with position bounds per word and per group of words.
#[derive(Clone, Debug)]
pub(crate) struct CellSet {
    bits: Vec<u64>,
    lo: Vec<i32>,
    hi: Vec<i32>,
    /// Per group, bit `w % 64` set when word `w` has members.
    groups: Vec<u64>,
    glo: Vec<i32>,
    ghi: Vec<i32>,
    count: u32,
}

impl CellSet {
    /// An empty set over `words` words of cells.
    pub fn new(words: usize, what: &str) -> Result<CellSet> {
        let n_groups = words.div_ceil(GROUP);
        Ok(CellSet {
            bits: zeroed(words, what)?,
            lo: filled(words, NO_LO, what)?,
            hi: filled(words, NO_HI, what)?,
            groups: zeroed(n_groups, what)?,
            glo: filled(n_groups, NO_LO, what)?,
            ghi: filled(n_groups, NO_HI, what)?,
            count: 0,
        })
    }

    /// Number of members.
    #[inline]
    pub fn count(&self) -> u32 {
        self.count
    }

    /// The member bits of every word.
    #[inline]
    pub fn words(&self) -> &[u64] {
        &self.bits
    }

    /// The member bits of word `w`.
    #[inline]
    pub fn word(&self, w: usize) -> u64 {
        self.bits[w]
    }

    /// The position bounds of word `w` (meaningful when it has members).
    #[inline]
    pub fn bounds(&self, w: usize) -> (i32, i32) {
        (self.lo[w], self.hi[w])
    }

    /// The members as runs `start..end` of consecutive cells, ascending.
    pub fn runs(&self) -> Vec<(usize, usize)> {
        runs_of_words(&self.bits)
    }

    /// Whether cell `i` is a member.
    #[inline]
    pub fn contains(&self, i: usize) -> bool {
        self.bits[i / 64] >> (i % 64) & 1 == 1
    }

    /// Adds cell `i` at position `pos` (or records its new position when it is a member).
    #[inline]
    pub fn insert(&mut self, i: usize, pos: i32) {
        let w = i / 64;
        let bit = 1u64 << (i % 64);
        if self.bits[w] & bit == 0 {
            self.count += 1;
        }
        self.widen(w, self.bits[w] | bit, pos, pos);
    }

    /// Records that member `i` moved to `pos`; the bounds widen to include it.
    #[inline]
    pub fn moved(&mut self, i: usize, pos: i32) {
        let w = i / 64;
        self.widen(w, self.bits[w], pos, pos);
    }

    /// Removes cell `i` (no-op when it is not a member).
    #[inline]
    pub fn remove(&mut self, i: usize) {
        self.remove_bits(i / 64, 1u64 << (i % 64));
    }

    /// Removes the cells of `mask` from word `w`; the bounds of what is left stay valid.
    #[inline]
    pub fn remove_bits(&mut self, w: usize, mask: u64) {
        let gone = self.bits[w] & mask;
        if gone == 0 {
            return;
        }
        self.count -= gone.count_ones();
        self.bits[w] &= !gone;
        if self.bits[w] == 0 {
            self.groups[w / GROUP] &= !(1u64 << (w % GROUP));
        }
    }

    /// Adds the cells of `mask` to word `w`, their positions within `[lo, hi]`.
    #[inline]
    pub fn add_bits(&mut self, w: usize, mask: u64, lo: i32, hi: i32) {
        if mask == 0 {
            return;
        }
        self.count += (mask & !self.bits[w]).count_ones();
        self.widen(w, self.bits[w] | mask, lo, hi);
    }

    /// Widens the bounds of word `w` (when it has members) to include `[lo, hi]`: some of its
    /// members moved there.
    #[inline]
    pub fn moved_within(&mut self, w: usize, lo: i32, hi: i32) {
        if self.bits[w] != 0 {
            self.widen(w, self.bits[w], lo, hi);
        }
    }

    /// Replaces word `w` with the members `word`, whose positions lie exactly within
    /// `[lo, hi]` (the caller read them all): the word's bounds become exact again.
    #[inline(always)]
    pub fn set_word(&mut self, w: usize, word: u64, lo: i32, hi: i32) {
        let old = self.bits[w];
        self.count = self.count - old.count_ones() + word.count_ones();
        self.bits[w] = word;
        let g = w / GROUP;
        if word == 0 {
            self.groups[g] &= !(1u64 << (w % GROUP));
            return;
        }
        self.lo[w] = lo;
        self.hi[w] = hi;
        self.widen_group(g, w, lo, hi);
    }

    /// Sets the members of word `w` to `word` (now non-empty) with positions widened by
    /// `[lo, hi]`; an empty word before takes `[lo, hi]` as its bounds.
    #[inline(always)]
    fn widen(&mut self, w: usize, word: u64, lo: i32, hi: i32) {
        merge(&mut self.lo[w], &mut self.hi[w], self.bits[w] == 0, lo, hi);
        self.bits[w] = word;
        self.widen_group(w / GROUP, w, lo, hi);
    }

    #[inline(always)]
    fn widen_group(&mut self, g: usize, w: usize, lo: i32, hi: i32) {
        merge(
            &mut self.glo[g],
            &mut self.ghi[g],
            self.groups[g] == 0,
            lo,
            hi,
        );
        self.groups[g] |= 1u64 << (w % GROUP);
    }

    /// Sets the bounds of groups `first..=last` to exactly those of their words.
    pub fn tighten_groups(&mut self, first: usize, last: usize) {
        for g in first..=last.min(self.groups.len().saturating_sub(1)) {
            let (mut lo, mut hi) = (NO_LO, NO_HI);
            for b in bits(self.groups[g]) {
                let w = g * GROUP + b;
                lo = lo.min(self.lo[w]);
                hi = hi.max(self.hi[w]);
            }
            self.glo[g] = lo;
            self.ghi[g] = hi;
        }
    }

    /// Whether any of the cells `first..first + len` is a member.
    pub fn any_in(&self, first: usize, len: usize) -> bool {
        spans(first, first, len).any(|(w, b, _, _, mask)| self.bits[w] >> b & mask != 0)
    }

    /// Moves the members among cells `src..src + len` to the same offsets from `dst`, whose
    /// cells must not be members. Each destination word takes the bounds of the source word its
    /// members came from: valid, though looser than exact when only part of it moved.
    pub fn move_members(&mut self, src: usize, dst: usize, len: usize) {
        for (sw, sb, dw, db, mask) in spans(src, dst, len) {
            let moving = self.bits[sw] >> sb & mask;
            if moving == 0 {
                continue;
            }
            let (lo, hi) = (self.lo[sw], self.hi[sw]);
            self.remove_bits(sw, moving << sb);
            self.add_bits(dw, moving << db, lo, hi);
        }
    }

    /// Removes every member.
    pub fn clear(&mut self) {
        self.bits.fill(0);
        self.groups.fill(0);
        self.count = 0;
    }

    /// Visits the words whose bounds meet `[p0, p1)`, ascending.
    pub fn cursor(&self, p0: i32, p1: i32) -> Cursor {
        Cursor {
            p0,
            p1,
            next_group: 0,
            pending: 0,
            group: 0,
            first_group: usize::MAX,
        }
    }

    /// Largest position among the members (`pos` is the cache's position column), `None` for
    /// an empty set. Looks at the words from the last one down and skips any whose bounds
    /// cannot beat the best found so far, so with clustered positions it reads one word.
    pub fn max_pos(&self, pos: &[i32]) -> Option<i32> {
        if self.count == 0 {
            return None;
        }
        let mut best = NO_HI;
        let mut found = false;
        for g in (0..self.groups.len()).rev() {
            if self.groups[g] == 0 || (found && self.ghi[g] <= best) {
                continue;
            }
            let mut words = self.groups[g];
            while words != 0 {
                let b = 63 - words.leading_zeros() as usize;
                words &= !(1u64 << b);
                let w = g * GROUP + b;
                if found && self.hi[w] <= best {
                    continue;
                }
                for c in bits(self.bits[w]) {
                    best = best.max(pos[w * 64 + c]);
                }
                found = true;
            }
        }
        Some(best)
    }

    /// Checks the members against `member(i)`, the bounds against `pos`, the group bits and
    /// the count (tests and debug builds).
    pub fn check(
        &self,
        name: &str,
        pos: &[i32],
        member: impl Fn(usize) -> bool,
    ) -> std::result::Result<(), String> {
        let mut count = 0u32;
        for (i, &p) in pos.iter().enumerate() {
            let w = i / 64;
            if self.contains(i) != member(i) {
                return Err(format!(
                    "{name}: cell {i} membership bit {} disagrees with the cell",
                    self.contains(i)
                ));
            }
            if self.contains(i) {
                count += 1;
                let g = w / GROUP;
                if p < self.lo[w] || p > self.hi[w] {
                    return Err(format!(
                        "{name}: cell {i} at position {p} outside its word's bounds [{}, {}]",
                        self.lo[w], self.hi[w]
                    ));
                }
                if self.lo[w] < self.glo[g] || self.hi[w] > self.ghi[g] {
                    return Err(format!(
                        "{name}: word {w}'s bounds [{}, {}] outside its group's [{}, {}]",
                        self.lo[w], self.hi[w], self.glo[g], self.ghi[g]
                    ));
                }
            }
        }
        for (w, &word) in self.bits.iter().enumerate() {
            let listed = self.groups[w / GROUP] >> (w % GROUP) & 1 == 1;
            if listed != (word != 0) {
                return Err(format!(
                    "{name}: group bit of word {w} is {listed} for word {word:#x}"
                ));
            }
        }
        if count != self.count {
            return Err(format!("{name}: count {} but {count} members", self.count));
        }
        Ok(())
    }
}

/// The words of a [`CellSet`] whose bounds meet a position range, ascending. It holds no
/// borrow, so the caller can change the cells (and this set's words already visited) between
/// steps; each step takes the set again.
pub(crate) struct Cursor {
    p0: i32,
    p1: i32,
    next_group: usize,
    /// Words of the current group still to visit.
    pending: u64,
    group: usize,
    first_group: usize,
}

impl Cursor {
    /// The next word `w` whose bounds meet the range, and whether they lie inside it (every
    /// member of the word is then in the range).
    #[inline(always)]
    pub fn next(&mut self, set: &CellSet) -> Option<(usize, bool)> {
        loop {
            while self.pending != 0 {
                let b = self.pending.trailing_zeros() as usize;
                self.pending &= self.pending - 1;
                let w = self.group * GROUP + b;
                let (lo, hi) = (set.lo[w], set.hi[w]);
                if set.bits[w] != 0 && lo < self.p1 && hi >= self.p0 {
                    return Some((w, lo >= self.p0 && hi < self.p1));
                }
            }
            let g = self.next_group;
            if g >= set.groups.len() {
                return None;
            }
            self.next_group += 1;
            if set.groups[g] != 0 && set.glo[g] < self.p1 && set.ghi[g] >= self.p0 {
                self.group = g;
                self.pending = set.groups[g];
                self.first_group = self.first_group.min(g);
            }
        }
    }

    /// The groups visited, as `(first, last)`, to tighten after the operation; `None` when the
    /// range met no group.
    pub fn visited(&self) -> Option<(usize, usize)> {
        (self.first_group != usize::MAX).then_some((self.first_group, self.group))
    }
}

/// Cells `src..src + len` and `dst..dst + len` cut where either crosses a word boundary: per
/// piece, the source word and bit, the destination word and bit, and the mask of its length
/// (at the low bits). At most two pieces per 64 cells.
fn spans(
    src: usize,
    dst: usize,
    len: usize,
) -> impl Iterator<Item = (usize, usize, usize, usize, u64)> {
    let mut k = 0;
    std::iter::from_fn(move || {
        if k >= len {
            return None;
        }
        let (s, d) = (src + k, dst + k);
        let n = (64 - s % 64).min(64 - d % 64).min(len - k);
        k += n;
        let mask = u64::MAX >> (64 - n);
        Some((s / 64, s % 64, d / 64, d % 64, mask))
    })
}

/// Bounds `[lo, hi]` widened to include `[l, h]`, or set to it when they bounded nothing.
#[inline(always)]
fn merge(lo: &mut i32, hi: &mut i32, empty: bool, l: i32, h: i32) {
    if empty {
        (*lo, *hi) = (l, h);
    } else {
        (*lo, *hi) = ((*lo).min(l), (*hi).max(h));
    }
}

/// The members of word `w` (bits `word`) with positions in `[p0, p1)` and the exact bounds of
/// the others: all of them, and no others, when the cursor said the word lies `inside`.
#[inline(always)]
pub(crate) fn select(
    pos: &[i32],
    word: u64,
    w: usize,
    inside: bool,
    p0: i32,
    p1: i32,
) -> (u64, i32, i32) {
    if inside {
        (word, NO_LO, NO_HI)
    } else {
        split(pos, word, w, p0, p1)
    }
}

/// The members of `word` (cells `64 w ..`) with positions in `[p0, p1)`, and the exact bounds
/// of the other members.
#[inline(always)]
pub(crate) fn split(pos: &[i32], word: u64, w: usize, p0: i32, p1: i32) -> (u64, i32, i32) {
    let mut hits = 0u64;
    let (mut lo, mut hi) = (NO_LO, NO_HI);
    let cells = &pos[w * 64..(w * 64 + 64).min(pos.len())];
    for b in bits(word) {
        let p = cells[b];
        if p >= p0 && p < p1 {
            hits |= 1 << b;
        } else {
            lo = lo.min(p);
            hi = hi.max(p);
        }
    }
    (hits, lo, hi)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_range_visits_only_the_words_holding_it() {
        let n = 3 * 4096;
        let pos: Vec<i32> = (0..n as i32).collect();
        let mut s = CellSet::new(n / 64, "test").unwrap();
        for (i, &p) in pos.iter().enumerate() {
            s.insert(i, p);
        }
        let mut cur = s.cursor(5000, 5016);
        let mut seen = Vec::new();
        while let Some(x) = cur.next(&s) {
            seen.push(x);
        }
        assert_eq!(seen, vec![(78, false)]);
        assert_eq!(cur.visited(), Some((1, 1)));
        let mut cur = s.cursor(64, 192);
        assert_eq!(cur.next(&s), Some((1, true)));
        assert_eq!(cur.next(&s), Some((2, true)));
        assert_eq!(cur.next(&s), None);
        assert_eq!(s.max_pos(&pos), Some(n as i32 - 1));
        s.check("test", &pos, |_| true).unwrap();
    }

    #[test]
    fn removing_members_keeps_bounds_valid_and_groups_exact() {
        let pos: Vec<i32> = (0..8192).map(|i| 8191 - i).collect();
        let mut s = CellSet::new(128, "test").unwrap();
        for i in (0..8192).step_by(3) {
            s.insert(i, pos[i]);
        }
        for i in 0..4096 {
            s.remove(i);
        }
        s.check("test", &pos, |i| i >= 4096 && i % 3 == 0).unwrap();
        assert_eq!(s.max_pos(&pos), Some(8191 - 4098));
        assert_eq!(s.groups[0], 0);
        s.tighten_groups(0, 1);
        let mut cur = s.cursor(0, 10);
        assert_eq!(cur.next(&s), Some((127, false)));
        assert_eq!(cur.next(&s), None);
        s.clear();
        assert_eq!((s.count(), s.max_pos(&pos)), (0, None));
    }

    #[test]
    fn moved_members_widen_the_bounds() {
        let mut pos = vec![10, 11, 12];
        let mut s = CellSet::new(1, "test").unwrap();
        for (i, &p) in pos.iter().enumerate() {
            s.insert(i, p);
        }
        pos[1] = 500;
        s.moved(1, 500);
        s.check("test", &pos, |_| true).unwrap();
        let mut cur = s.cursor(400, 600);
        assert_eq!(cur.next(&s), Some((0, false)));
        assert_eq!(split(&pos, s.word(0), 0, 400, 600), (0b010, 10, 12));
    }
}
