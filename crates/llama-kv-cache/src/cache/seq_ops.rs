//! The seed's sequence operations: `seq_rm`, `seq_cp`, `seq_keep`, `seq_add`, `seq_div`,
//! `seq_pos_max`, each with its transformer and recurrent branch.
//!
//! Position ranges are `[p0, p1)`; a negative `p0` means 0 and a negative `p1` means "to the end".
//! Sequence ids are validated up front, so a refused call leaves the cache untouched.

use crate::cache::SeedCache;
use crate::cells::{Cell, Freed, SeqSet};
use crate::error::{KvError, Result};
use crate::params::RecurrentRules;

fn open_range(p0: i32, p1: i32) -> (i32, i32) {
    (p0.max(0), if p1 < 0 { i32::MAX } else { p1 })
}

impl SeedCache {
    /// Removes `seq` (or every sequence, with -1) from the cells with positions in `[p0, p1)`,
    /// freeing cells left without a sequence, and hands the pages of freed cells back to the OS
    /// when that is worth it (`release`). Returns false, changing nothing, when a recurrent
    /// cache is asked to erase part of a sequence's state.
    pub fn seq_rm(&mut self, seq: i32, p0: i32, p1: i32) -> Result<bool> {
        if self.params.recurrent && self.params.recurrent_rules == RecurrentRules::V0_1_161 {
            return Ok(self.seq_rm_recurrent_0_1_161(seq, p0, p1));
        }
        let Some(freed) = self.seq_rm_keeping_data(seq, p0, p1)? else {
            return Ok(false);
        };
        if let (Some(first), Some(last)) = (freed.first, freed.last) {
            self.release_freed(first..last + 1, freed.with_pos as usize)?;
        }
        Ok(true)
    }

    /// 0.1.161's `llama_memory_recurrent::seq_rm`: false, changing nothing, for a removal that
    /// would cut a state (from inside a sequence to its end: the rollback snapshots that would
    /// allow it are not kept), for a sequence id out of range, and for -1 (0.1.161 compares the
    /// id unsigned with the sequence count, so every negative id is out of range).
    fn seq_rm_recurrent_0_1_161(&mut self, seq: i32, p0: i32, p1: i32) -> bool {
        let (p0, p1) = open_range(p0, p1);
        if seq < 0 || seq as u32 >= self.params.n_seq_max || seq as u32 >= self.params.size {
            return false;
        }
        let s = seq as usize;
        let tail = self.cells.tail(s);
        if tail >= 0 {
            let pos = self.cells.pos(tail as usize);
            if 0 < p0 && p0 <= pos && p1 > pos {
                return false;
            }
            if p0 <= pos && pos < p1 {
                self.cells.set_tail(s, -1);
            }
        }
        let size = self.cells.len();
        let mut new_head = size;
        for i in 0..size {
            let pos = self.cells.pos(i);
            if pos < p0 || pos >= p1 || !self.cells.seqs(i).contains(s) {
                continue;
            }
            self.cells.remove_seq(i, s);
            if self.cells.is_empty_cell(i) {
                self.cells.used = self.cells.used.wrapping_sub(1);
                self.cells.set_pos(i, -1);
                self.cells.set_src(i, -1);
                new_head = new_head.min(i);
            }
        }
        self.cells.settle();
        if new_head != size && (new_head as u32) < self.head {
            self.head = new_head as u32;
        }
        true
    }

    /// [`SeedCache::seq_rm`] that leaves the freed cells' rows in memory, for a caller that may
    /// put the cells back (a load that fails restores the sequence it replaced). `None` when a
    /// recurrent cache refuses.
    pub(crate) fn seq_rm_keeping_data(
        &mut self,
        seq: i32,
        p0: i32,
        p1: i32,
    ) -> Result<Option<Freed>> {
        if seq != -1 {
            self.check_seq("seqRm", seq)?;
        }
        let (p0, p1) = open_range(p0, p1);
        if self.params.recurrent {
            if seq >= 0 {
                let tail = self.cells.tail(seq as usize);
                if tail >= 0 {
                    let pos = self.cells.pos(tail as usize);
                    // a partial intersection would leave half a state
                    if (0 < p0 && p0 <= pos) || (0 < p1 && p1 <= pos) {
                        return Ok(None);
                    }
                    if p0 <= pos && pos < p1 {
                        self.cells.set_tail(seq as usize, -1);
                    }
                }
            } else if p0 != p1 && (p0 != 0 || p1 != i32::MAX) {
                return Ok(None);
            }
        }
        let freed = if seq < 0 {
            // p0 >= 0, so only cells with a position can be in range
            self.cells.free_range(p0, p1)
        } else {
            self.cells.remove_seq_in_range(seq as usize, p0, p1)
        };
        self.cells.used = self.cells.used.wrapping_sub(freed.with_pos);
        self.cells.settle();
        if let Some(first) = freed.first {
            self.head = self.head.min(first as u32);
        }
        Ok(Some(freed))
    }

    /// Adds `dst` to every cell of `src` with a position in `[p0, p1)`. Recurrent caches share
    /// the source's state cell instead (the range is ignored, as in the seed).
    pub fn seq_cp(&mut self, src: i32, dst: i32, p0: i32, p1: i32) -> Result<()> {
        let s = self.check_seq("seqCp source", src)?;
        let d = self.check_seq("seqCp destination", dst)?;
        if s == d {
            return Ok(());
        }
        let (p0, p1) = open_range(p0, p1);
        if self.params.recurrent {
            let dst_tail = self.cells.tail(d);
            if dst_tail >= 0 {
                let cell = dst_tail as usize;
                self.cells.remove_seq(cell, d);
                self.cells.set_tail(d, -1);
                if self.cells.is_empty_cell(cell) {
                    self.cells.set_pos(cell, -1);
                    // the seed writes -1 into delta here (not 0); kept for fidelity
                    self.cells.set_delta(cell, -1);
                    self.cells.set_src(cell, -1);
                    self.cells.used = self.cells.used.wrapping_sub(1);
                }
            }
            let src_tail = self.cells.tail(s);
            if src_tail >= 0 {
                self.cells.insert_seq(src_tail as usize, d);
                self.cells.set_tail(d, src_tail);
            }
            return Ok(());
        }
        self.head = 0;
        self.cells.copy_seq_in_range(s, d, p0, p1);
        self.cells.settle();
        Ok(())
    }

    /// Frees every cell that does not hold `seq` and removes all other sequences from the rest.
    pub fn seq_keep(&mut self, seq: i32) -> Result<()> {
        let keep = self.check_seq("seqKeep", seq)?;
        let size = self.params.size as usize;
        let mut used = self.cells.used;
        let new_head;
        if self.params.recurrent {
            // recurrent caches have one cell per sequence: the seed's loop as is
            let mut first = size;
            for i in 0..size {
                if i != keep {
                    self.cells.set_tail(i, -1);
                }
                if !self.cells.seqs(i).contains(keep) {
                    if self.cells.pos(i) >= 0 {
                        used = used.wrapping_sub(1);
                    }
                    self.cells.clear_seqs(i);
                    self.cells.set_pos(i, -1);
                    self.cells.set_src(i, -1);
                    first = first.min(i);
                } else {
                    self.cells.set_seqs(i, SeqSet::single(keep));
                }
            }
            new_head = first;
        } else {
            // free cells of a transformer cache hold no sequence, so only occupied cells change;
            // the first cell without `keep` is where the seed's loop sets new_head
            new_head = self.cells.first_without(keep).unwrap_or(size);
            let freed = self.cells.keep_only(keep);
            used = used.wrapping_sub(freed);
            self.release_freed(0..size, freed as usize)?;
        }
        self.cells.used = used;
        self.cells.settle();
        if new_head != size && (new_head as u32) < self.head {
            self.head = new_head as u32;
        }
        Ok(())
    }

    /// Adds `delta` to the positions of `seq` in `[p0, p1)` and records it for the K-shift;
    /// cells pushed below position 0 are freed. The search head moves to the first freed cell,
    /// or to 0. `seq` -1 matches no cell, as in the seed (whose cells never hold -1), but
    /// still moves the head to 0 in a non-recurrent cache.
    pub fn seq_add(&mut self, seq: i32, p0: i32, p1: i32, delta: i32) -> Result<()> {
        let s = if seq == -1 {
            None
        } else {
            Some(self.check_seq("seqAdd", seq)?)
        };
        self.check_shiftable_positions("seqAdd")?;
        if delta == 0 {
            return Ok(());
        }
        let (p0, p1) = open_range(p0, p1);
        if p0 == p1 {
            return Ok(());
        }
        let Some(s) = s else {
            // the seed's recurrent branch checks `0 <= seq_id` and returns; the other scans
            // every cell, matches none and resets the head
            if !self.params.recurrent {
                self.head = 0;
            }
            return Ok(());
        };
        if self.params.recurrent {
            let tail = self.cells.tail(s);
            if tail >= 0 {
                let cell = tail as usize;
                let pos = self.cells.pos(cell);
                if self.cells.seqs(cell).contains(s) && p0 <= pos && pos < p1 {
                    let new = pos
                        .checked_add(delta)
                        .ok_or_else(|| overflow(seq, pos, delta))?;
                    self.cells.set_pos(cell, new);
                }
            }
            return Ok(());
        }
        if let Some(max) = self.cells.seq_pos_max(s) {
            if delta > 0 && max.checked_add(delta).is_none() {
                return Err(overflow(seq, max, delta));
            }
        }
        let (shifted, freed) = self.cells.shift_seq_in_range(s, p0, p1, |pos| pos + delta);
        self.cells.settle();
        self.has_shift |= shifted;
        self.cells.used = self.cells.used.wrapping_sub(freed.with_pos);
        self.head = freed.first.map_or(0, |f| f as u32);
        Ok(())
    }

    /// Divides the positions of `seq` in `[p0, p1)` by `d` (integer division, as self-extend
    /// does) and records the change for the K-shift. `d` must be positive. `seq` -1 matches
    /// no cell and changes nothing, as in the seed (whose `seq_div` never moves the head).
    pub fn seq_div(&mut self, seq: i32, p0: i32, p1: i32, d: i32) -> Result<()> {
        let s = if seq == -1 {
            None
        } else {
            Some(self.check_seq("seqDiv", seq)?)
        };
        self.check_shiftable_positions("seqDiv")?;
        if d <= 0 {
            return Err(KvError::InvalidArg(format!(
                "seqDiv: divisor must be a positive integer, got {d}"
            )));
        }
        let Some(s) = s else {
            return Ok(());
        };
        if d == 1 {
            return Ok(());
        }
        let (p0, p1) = open_range(p0, p1);
        if p0 == p1 {
            return Ok(());
        }
        if self.params.recurrent {
            let tail = self.cells.tail(s);
            if tail >= 0 {
                let cell = tail as usize;
                let pos = self.cells.pos(cell);
                if self.cells.seqs(cell).contains(s) && p0 <= pos && pos < p1 {
                    self.cells.set_pos(cell, pos / d);
                }
            }
            return Ok(());
        }
        let div = Divisor::new(d);
        let (shifted, _) = self.cells.shift_seq_in_range(s, p0, p1, |pos| div.of(pos));
        self.cells.settle();
        self.has_shift |= shifted;
        Ok(())
    }

    /// Refuses to move the positions of an M-RoPE cache, whatever the amount: each cell's K
    /// is rotated by four position sections, of which a shift knows one (llama.cpp 0.1.161
    /// asserts `n_pos_per_embd() == 1` in `seq_add` and `seq_div`).
    fn check_shiftable_positions(&self, op: &str) -> Result<()> {
        if self.params.mrope {
            return Err(KvError::Unsupported(format!(
                "{op}: the cache holds M-RoPE positions (Qwen-VL and the like), which cannot be \
                 shifted or divided (llama.cpp refuses too); remove and re-evaluate instead"
            )));
        }
        Ok(())
    }

    /// Largest position of `seq`. As in the seed, a sequence with no cells gives 0, not -1
    /// (use [`SeedCache::seq_cell_count`] to tell an empty sequence apart). O(1).
    pub fn seq_pos_max(&self, seq: i32) -> Result<i32> {
        let s = self.check_seq("seqPosMax", seq)?;
        let max = self.cells.seq_pos_max(s);
        if self.params.recurrent && self.params.recurrent_rules == RecurrentRules::V0_1_161 {
            // 0.1.161 starts its maximum at -1: an empty sequence, or a state moved below 0
            return Ok(max.unwrap_or(-1).max(-1));
        }
        Ok(max.unwrap_or(0).max(0))
    }

    /// Number of cells holding `seq`. O(1).
    pub fn seq_cell_count(&self, seq: i32) -> Result<u32> {
        let s = self.check_seq("seqCellCount", seq)?;
        Ok(self.cells.seq_cell_count(s))
    }

    /// Schedules a defrag for the next `update` (ignored by recurrent caches, as in the seed).
    pub fn defrag(&mut self) {
        if !self.params.recurrent {
            self.do_defrag = true;
        }
    }

    /// A copy of cell `i`.
    pub fn cell(&self, i: u32) -> Result<Cell> {
        if i >= self.params.size {
            return Err(KvError::OutOfRange(format!(
                "cell {i} is out of range [0, {})",
                self.params.size
            )));
        }
        Ok(self.cells.get(i as usize))
    }
}

/// Division of non-negative positions by a divisor fixed for a whole `seq_div`, as one
/// multiplication: a hardware division per cell was most of that operation's time.
///
/// With `m = ceil(2^64 / d)`, `n / d == (m * n) >> 64` for every 32-bit `n` and every `d >= 2`
/// (Lemire, Kaser and Kurz, "Faster remainder by direct computation", 2019, for 32-bit
/// numerators and a 64-bit `m`).
#[derive(Clone, Copy)]
struct Divisor {
    m: u64,
}

impl Divisor {
    /// `d` must be at least 2 (`seq_div` returns early for 1).
    fn new(d: i32) -> Divisor {
        debug_assert!(d >= 2);
        Divisor {
            m: u64::MAX / d as u64 + 1,
        }
    }

    /// `pos / d` for `pos >= 0` (range positions are never negative): `(m * n) >> 64` as two
    /// 32 x 32 -> 64-bit products, which vector units have (a 64 x 64 -> 128 one they lack).
    /// Exact: `m * n = m_hi * n * 2^32 + m_lo * n`, and dropping the low 32 bits of `m_lo * n`
    /// before the second shift cannot change the floor; `m_hi * n < 2^63` leaves no overflow.
    #[inline(always)]
    fn of(self, pos: i32) -> i32 {
        let n = pos as u32 as u64;
        let (m_hi, m_lo) = (self.m >> 32, self.m & 0xffff_ffff);
        ((m_hi * n + ((m_lo * n) >> 32)) >> 32) as i32
    }
}

fn overflow(seq: i32, pos: i32, delta: i32) -> KvError {
    KvError::OutOfRange(format!(
        "seqAdd: position {pos} of seq {seq} plus delta {delta} overflows a 32-bit position"
    ))
}

#[cfg(test)]
mod tests {
    use super::Divisor;

    #[test]
    fn divisor_matches_integer_division() {
        let ds = [
            2,
            3,
            5,
            7,
            10,
            64,
            100,
            1000,
            65_537,
            1 << 30,
            i32::MAX - 1,
            i32::MAX,
        ];
        let ns = [0, 1, 2, 3, 63, 64, 65, 999, 1 << 20, i32::MAX - 1, i32::MAX];
        for &d in &ds {
            let div = Divisor::new(d);
            for &n in &ns {
                assert_eq!(div.of(n), n / d, "{n} / {d}");
            }
        }
        // xorshift32 over many more pairs
        let mut x = 0x2545_f491u32;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x
        };
        for _ in 0..200_000 {
            let d = (next() >> (next() % 31)).max(2) as i32 & i32::MAX;
            let n = (next() >> 1) as i32;
            if d >= 2 {
                assert_eq!(Divisor::new(d).of(n), n / d, "{n} / {d}");
            }
        }
    }
}
