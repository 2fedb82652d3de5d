//! Cell metadata, stored column-wise, with exact per-sequence bookkeeping.
//!
//! The seed keeps a `std::set<llama_seq_id>` in every cell. Here a cell's sequences are a 64-bit
//! mask, and the columns (`pos`, `seqs`, ...) are separate vectors, so the whole-cache scans that
//! the seed's operations do touch 12 bytes per cell and no heap nodes. Each sequence's cell count
//! and largest position are kept exact by every mutation, which makes `seq_pos_max` O(1).

/// The most sequences a cache can track (seq ids `0..MAX_SEQ`).
pub const MAX_SEQ: usize = 64;

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
        let mut bits = self.0;
        std::iter::from_fn(move || {
            if bits == 0 {
                return None;
            }
            let seq = bits.trailing_zeros() as usize;
            bits &= bits - 1;
            Some(seq)
        })
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

/// All cells of a cache plus the bookkeeping derived from them.
///
/// Every mutation goes through a method here so that `used`, the per-sequence cell counts and the
/// per-sequence maximum positions never drift from the cells themselves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cells {
    pos: Vec<i32>,
    delta: Vec<i32>,
    src: Vec<i32>,
    tail: Vec<i32>,
    seqs: Vec<SeqSet>,
    /// The seed's `used`: maintained by the operations exactly as the seed does (it counts cells
    /// with `pos >= 0` as they are freed), not recomputed.
    pub used: u32,
    seq_cells: [u32; MAX_SEQ],
    seq_pos_max: [i32; MAX_SEQ],
}

impl Cells {
    /// `size` free cells.
    pub fn new(size: usize) -> Cells {
        Cells {
            pos: vec![-1; size],
            delta: vec![0; size],
            src: vec![-1; size],
            tail: vec![-1; size],
            seqs: vec![SeqSet::EMPTY; size],
            used: 0,
            seq_cells: [0; MAX_SEQ],
            seq_pos_max: [NO_POS; MAX_SEQ],
        }
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

    /// Column views for fast scans.
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

    /// Cells holding `seq`.
    pub fn seq_cell_count(&self, seq: usize) -> u32 {
        self.seq_cells[seq]
    }

    /// Largest position among the cells holding `seq`, `None` when it has none.
    pub fn seq_pos_max(&self, seq: usize) -> Option<i32> {
        (self.seq_cells[seq] > 0).then_some(self.seq_pos_max[seq])
    }

    /// Sum over cells of the number of sequences (the seed's `get_n_tokens`).
    pub fn n_tokens(&self) -> u64 {
        self.seq_cells.iter().map(|&c| c as u64).sum()
    }

    /// Sets the position of cell `i`, keeping the per-sequence maxima exact.
    pub fn set_pos(&mut self, i: usize, pos: i32) {
        let old = self.pos[i];
        self.pos[i] = pos;
        if old == pos {
            return;
        }
        for seq in self.seqs[i].iter() {
            if pos > self.seq_pos_max[seq] {
                self.seq_pos_max[seq] = pos;
            } else if old == self.seq_pos_max[seq] {
                self.recompute_seq(seq);
            }
        }
    }

    /// Sets the accumulated delta of cell `i`.
    pub fn set_delta(&mut self, i: usize, delta: i32) {
        self.delta[i] = delta;
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
        self.seq_cells[seq] += 1;
        if self.seq_cells[seq] == 1 || self.pos[i] > self.seq_pos_max[seq] {
            self.seq_pos_max[seq] = self.pos[i];
        }
    }

    /// Removes `seq` from cell `i`.
    pub fn remove_seq(&mut self, i: usize, seq: usize) {
        if !self.seqs[i].contains(seq) {
            return;
        }
        self.seqs[i].remove(seq);
        self.seq_cells[seq] -= 1;
        if self.seq_cells[seq] == 0 {
            self.seq_pos_max[seq] = NO_POS;
        } else if self.pos[i] == self.seq_pos_max[seq] {
            self.recompute_seq(seq);
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
        self.set_seqs(i, SeqSet::EMPTY);
        self.pos[i] = cell.pos;
        self.delta[i] = cell.delta;
        self.src[i] = cell.src;
        self.tail[i] = cell.tail;
        self.set_seqs(i, cell.seqs);
    }

    /// Applies `f` to every cell holding any sequence of `mask` with `p0 <= pos < p1`, in index
    /// order, then rebuilds the bookkeeping of every sequence once. This is the fast path for the
    /// bulk operations: one linear pass over two columns, no per-cell bookkeeping.
    pub fn bulk_update(
        &mut self,
        mask: SeqSet,
        p0: i32,
        p1: i32,
        mut f: impl FnMut(usize, &mut i32, &mut i32, &mut SeqSet),
    ) {
        for i in 0..self.pos.len() {
            if self.seqs[i].0 & mask.0 != 0 && self.pos[i] >= p0 && self.pos[i] < p1 {
                f(i, &mut self.pos[i], &mut self.delta[i], &mut self.seqs[i]);
            }
        }
        self.rebuild_bookkeeping();
    }

    /// Direct access to every column at once, followed by a rebuild of the bookkeeping.
    pub fn with_columns<R>(&mut self, f: impl FnOnce(&mut Columns<'_>) -> R) -> R {
        let r = f(&mut Columns {
            pos: &mut self.pos,
            delta: &mut self.delta,
            src: &mut self.src,
            tail: &mut self.tail,
            seqs: &mut self.seqs,
        });
        self.rebuild_bookkeeping();
        r
    }

    /// Recounts the per-sequence counts and maxima from the cells.
    pub fn rebuild_bookkeeping(&mut self) {
        let mut counts = [0u32; MAX_SEQ];
        let mut maxima = [NO_POS; MAX_SEQ];
        for (seqs, &pos) in self.seqs.iter().zip(&self.pos) {
            let mut bits = seqs.0;
            while bits != 0 {
                let seq = bits.trailing_zeros() as usize;
                bits &= bits - 1;
                counts[seq] += 1;
                if pos > maxima[seq] {
                    maxima[seq] = pos;
                }
            }
        }
        self.seq_cells = counts;
        self.seq_pos_max = maxima;
    }

    fn recompute_seq(&mut self, seq: usize) {
        let mut max = NO_POS;
        for (seqs, &pos) in self.seqs.iter().zip(&self.pos) {
            if seqs.contains(seq) && pos > max {
                max = pos;
            }
        }
        self.seq_pos_max[seq] = max;
    }

    /// Resets every cell's pos, seqs, src and tail (not delta: the seed's `clear` keeps it).
    pub fn reset(&mut self) {
        self.pos.fill(-1);
        self.src.fill(-1);
        self.tail.fill(-1);
        self.seqs.fill(SeqSet::EMPTY);
        self.used = 0;
        self.seq_cells = [0; MAX_SEQ];
        self.seq_pos_max = [NO_POS; MAX_SEQ];
    }
}

/// Mutable access to the columns, for algorithms that touch many cells at once.
pub struct Columns<'a> {
    pub pos: &'a mut [i32],
    pub delta: &'a mut [i32],
    pub src: &'a mut [i32],
    pub tail: &'a mut [i32],
    pub seqs: &'a mut [SeqSet],
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
        let mut c = Cells::new(4);
        for i in 0..3 {
            c.set_pos(i, i as i32 * 10);
            c.insert_seq(i, 1);
        }
        assert_eq!(c.seq_pos_max(1), Some(20));
        c.remove_seq(2, 1);
        assert_eq!(c.seq_pos_max(1), Some(10));
        assert_eq!(c.seq_cell_count(1), 2);
        c.set_pos(1, 3);
        assert_eq!(c.seq_pos_max(1), Some(3));
        c.set_seqs(0, SeqSet::EMPTY);
        c.set_seqs(1, SeqSet::EMPTY);
        assert_eq!(c.seq_pos_max(1), None);
        assert_eq!(c.n_tokens(), 0);
    }
}
