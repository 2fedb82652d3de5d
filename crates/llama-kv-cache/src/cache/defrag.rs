//! Defragmentation: the seed's `defrag_prepare` plan, and the data moves that llama.cpp leaves
//! to a compute graph, done here on every layer's K and V.

use crate::cache::SeedCache;
use crate::cells::set::next_bit;
use crate::error::{KvError, Result};

/// llama.cpp's default graph node budget (`graph_max_nodes()` is at least 65536).
pub const DEFAULT_MAX_NODES: u32 = 65536;

/// A run of consecutive cells moved to consecutive destinations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CellMove {
    /// First source cell.
    pub src: u32,
    /// First destination cell.
    pub dst: u32,
    /// Number of cells.
    pub len: u32,
}

/// What a defrag did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DefragReport {
    /// Runs moved, in the order they were applied.
    pub moves: Vec<CellMove>,
    /// Cells moved.
    pub cells_moved: u32,
    /// Bytes copied across all layers.
    pub bytes_copied: u64,
}

impl SeedCache {
    /// The seed's `defrag_prepare(n_max_nodes)`: fills holes below `used` with the last
    /// non-empty cells, moving the cell metadata at once, and returns the data moves still to
    /// do (as runs ordered by source cell), or an empty list when nothing moved. At most
    /// `(n_max_nodes - 2 * n_layer) / (6 * n_layer)` runs are planned.
    ///
    /// The seed walks cells one by one through an `n_kv` map of destinations. The same plan
    /// follows from a bitmap of the non-empty cells, 64 to a word: every cell from `top` (where
    /// the last hole's sources began) up is empty or already moved, and every cell between the
    /// current hole and `top` is as it was, so a hole's sources are the `nh` highest set bits
    /// below `top` and its runs are their runs of consecutive bits. Each run moves its metadata
    /// at once ([`Cells::move_run`](crate::cells::Cells::move_run)).
    pub fn defrag_plan(&mut self, n_max_nodes: u32) -> Vec<CellMove> {
        let n_layer = self.params.n_layer;
        let n_kv = self.cells.cell_max();
        let n_used = self.cells.used as usize;
        let max_moves = n_max_nodes.saturating_sub(2 * n_layer) / (6 * n_layer);
        // non-empty and not moved: a run's source bits are cleared as it moves (its
        // destinations, below the holes still to fill, are never looked at again)
        let mut live = self.cells.nonempty_words();
        let end = live.len() * 64;
        let mut moves = Vec::new();
        // where each hole's runs begin in `moves`: holes take ever lower sources
        let mut holes = Vec::new();
        let mut n_moves = 0u32;
        let mut i0 = 0usize;
        let mut top = n_kv;
        let limit = n_used.min(n_kv);
        loop {
            i0 = next_bit(&live, i0, limit, false);
            if i0 >= limit {
                break;
            }
            // the hole ends at the next non-empty cell or at `used` (the seed's scan stops
            // there, also past `n_kv`)
            let nh = next_bit(&live, i0, n_used.min(end), true) - i0;
            let Some(is) = nth_bit_down(&live, top, i0 + 1, nh) else {
                // `used` overstates the occupied cells (possible after some seed operations);
                // the seed asserts here, we stop planning instead
                break;
            };
            holes.push(moves.len());
            let (mut nf, mut at, mut stop) = (0, is, false);
            while nf < nh {
                // the first run starts at `is`, a source
                let first = if nf == 0 {
                    at
                } else {
                    next_bit(&live, at, top, true)
                };
                if nf > 0 && n_moves == max_moves {
                    // the seed stops at the gap before a run it may not start
                    stop = true;
                    break;
                }
                // [at, top) holds exactly the nh - nf sources still to move
                let len = (next_bit(&live, first, top, false) - first).min(nh - nf);
                debug_assert!(len > 0, "hole at {i0}: a source run below {top} is missing");
                self.cells.move_run(first, i0 + nf, len);
                clear_bits(&mut live, first, len);
                moves.push(CellMove {
                    src: first as u32,
                    dst: (i0 + nf) as u32,
                    len: len as u32,
                });
                n_moves += 1;
                nf += len;
                at = first + len;
            }
            if stop || n_moves == max_moves {
                break;
            }
            top = is;
            i0 += nh;
        }
        self.cells.settle();
        if moves.is_empty() {
            return moves;
        }
        self.head = n_used as u32;
        // by source cell, as the seed's graph builder lists them: holes in reverse, each
        // hole's runs ascending
        let mut ordered = Vec::with_capacity(moves.len());
        let mut until = moves.len();
        for &from in holes.iter().rev() {
            ordered.extend_from_slice(&moves[from..until]);
            until = from;
        }
        ordered
    }

    /// Applies planned moves to every layer's K and V, in plan order.
    pub fn apply_moves(&mut self, moves: &[CellMove]) -> Result<DefragReport> {
        let lay = self.v_geometry();
        // checked before any tensor is touched, so a bad list changes nothing
        for m in moves {
            let fits = |at: u32| {
                at.checked_add(m.len)
                    .is_some_and(|end| end <= self.params.size)
            };
            if !fits(m.src) || !fits(m.dst) {
                return Err(KvError::OutOfRange(format!(
                    "move of {} cells from {} to {}: out of range [0, {})",
                    m.len, m.src, m.dst, self.params.size
                )));
            }
        }
        let mut report = DefragReport {
            moves: moves.to_vec(),
            ..DefragReport::default()
        };
        let runs: Vec<(usize, usize, usize)> = moves
            .iter()
            .map(|m| (m.src as usize, m.dst as usize, m.len as usize))
            .collect();
        let cells: u64 = moves.iter().map(|m| m.len as u64).sum();
        report.cells_moved = cells as u32;
        for layer in &mut self.layers {
            layer.apply_moves(lay, &runs)?;
            report.bytes_copied += cells * (layer.k_row + layer.v_row) as u64;
        }
        // the moved cells' sources are free now, at the end of the cache
        self.release_freed(0..self.params.size as usize, cells as usize)?;
        Ok(report)
    }

    /// Plans and applies a defrag now, whether or not one is pending; clears the pending flag.
    pub fn defrag_now(&mut self, n_max_nodes: u32) -> Result<DefragReport> {
        self.do_defrag = false;
        let moves = self.defrag_plan(n_max_nodes);
        self.apply_moves(&moves)
    }

    /// llama.cpp's scheduling rule: with `threshold > 0`, a defrag is due when `n >= 2048` and
    /// `1 - (used + padding) / n > threshold`. Returns the fragmentation measured.
    pub fn fragmentation(&self) -> f32 {
        let n = self.n as f32;
        if self.n < 2048 {
            return 0.0;
        }
        (1.0 - (self.cells.used as f32 + self.params.padding() as f32) / n).max(0.0)
    }

    /// Schedules a defrag when [`SeedCache::fragmentation`] exceeds `threshold` (> 0); returns
    /// whether it did.
    pub fn schedule_defrag(&mut self, threshold: f32) -> bool {
        if threshold > 0.0 && self.fragmentation() > threshold {
            self.defrag();
            return self.do_defrag;
        }
        false
    }
}

/// Counting set bits of `words` down from `top - 1` to `low`, the cell of the `n`-th
/// (`n >= 1`), or `None` when fewer are set.
fn nth_bit_down(words: &[u64], top: usize, low: usize, n: usize) -> Option<usize> {
    if top <= low {
        return None;
    }
    let mut left = n;
    let mut w = (top - 1) / 64;
    let mut word = words[w] & (u64::MAX >> (63 - (top - 1) % 64));
    loop {
        if w == low / 64 {
            word &= u64::MAX << (low % 64);
        }
        let ones = word.count_ones() as usize;
        if ones >= left {
            // drop the highest `left - 1` bits; the highest left is the one
            for _ in 1..left {
                word &= !(1u64 << (63 - word.leading_zeros()));
            }
            return Some(w * 64 + 63 - word.leading_zeros() as usize);
        }
        left -= ones;
        if w == low / 64 {
            return None;
        }
        w -= 1;
        word = words[w];
    }
}

/// Clears the bits of cells `first..first + len`.
fn clear_bits(words: &mut [u64], first: usize, len: usize) {
    let mut k = first;
    while k < first + len {
        let n = (64 - k % 64).min(first + len - k);
        words[k / 64] &= !(u64::MAX >> (64 - n) << (k % 64));
        k += n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CacheParams, UBatch};

    /// The seed's graph builder: turns the `ids` map (cell -> destination, `ids.len()` = not moved) into runs, as the graph
    /// builder does: consecutive sources going to consecutive destinations form one run.
    fn runs(ids: &[usize]) -> Vec<CellMove> {
        let absent = ids.len();
        let mut out = Vec::new();
        let mut i = 0;
        while i < ids.len() {
            let id = ids[i];
            if id == i || id == absent {
                i += 1;
                continue;
            }
            let mut nm = 1;
            while i + nm < ids.len() && ids[i + nm] == id + nm {
                nm += 1;
            }
            out.push(CellMove {
                src: i as u32,
                dst: id as u32,
                len: nm as u32,
            });
            i += nm;
        }
        out
    }

    /// A set of sequences below 64 as the bitmask the seed's plan below moves.
    fn mask(set: crate::cells::SeqSet) -> u64 {
        set.iter().fold(0, |m, s| m | 1 << s)
    }

    /// The seed's `defrag_prepare`, literally (a rescan from the top for every hole), over a
    /// cell map (`pos[i] < 0`: empty): the moves, with `pos` updated as the seed's cells.
    fn seed_plan(
        pos: &mut [i32],
        seqs: &mut [u64],
        n_used: usize,
        n_layer: u32,
        n_max_nodes: u32,
    ) -> Vec<CellMove> {
        let n_kv = pos.iter().rposition(|&p| p >= 0).map_or(0, |i| i + 1);
        let max_moves = n_max_nodes.saturating_sub(2 * n_layer) / (6 * n_layer);
        let mut ids = vec![n_kv; n_kv];
        let mut n_moves = 0;
        let mut i0 = 0;
        while i0 < n_used.min(n_kv) {
            if pos[i0] >= 0 {
                ids[i0] = i0;
                i0 += 1;
                continue;
            }
            let mut nh = 1;
            while i0 + nh < n_used && pos[i0 + nh] < 0 {
                nh += 1;
            }
            let (mut nf, mut is) = (0, n_kv - 1);
            while is > i0 {
                if pos[is] >= 0 && ids[is] == n_kv {
                    nf += 1;
                    if nf == nh {
                        break;
                    }
                }
                is -= 1;
            }
            if nf != nh {
                break;
            }
            let (mut nf, mut cont, mut stop, mut i1) = (0, false, false, is);
            while i1 < n_kv {
                if pos[i1] < 0 || ids[i1] != n_kv {
                    if n_moves == max_moves {
                        stop = true;
                        break;
                    }
                    cont = false;
                    i1 += 1;
                    continue;
                }
                ids[i1] = i0 + nf;
                pos[i0 + nf] = pos[i1];
                pos[i1] = -1;
                seqs[i0 + nf] = seqs[i1];
                seqs[i1] = 0;
                if !cont {
                    n_moves += 1;
                    cont = true;
                }
                nf += 1;
                if nf == nh {
                    break;
                }
                i1 += 1;
            }
            if stop || n_moves == max_moves {
                break;
            }
            i0 += nh;
        }
        if n_moves == 0 {
            return Vec::new();
        }
        runs(&ids)
    }

    proptest::proptest! {
        /// The plan with the scan cursor is the seed's rescanning plan, move for move and cell
        /// for cell, on any fragmentation and move cap.
        #[test]
        fn the_plan_is_the_seeds(
            size in 1u32..400,
            shared in 0u32..400,
            holes in proptest::collection::vec((0u32..400, 0i32..3), 0..240),
            n_max_nodes in proptest::prop_oneof![proptest::strategy::Just(65536u32), 4u32..80],
        ) {
            // sequence 0 fills the cache, sequence 1 shares a prefix of it; holes drop one
            // sequence of a cell (the cell stays while the other holds it) or both
            let mut p = CacheParams::new(size, 2, 8, 8);
            p.n_seq_max = 2;
            let mut c = SeedCache::new(p).unwrap();
            c.find_slot(&UBatch::sequence(0, 0, size)).unwrap().unwrap();
            c.seq_cp(0, 1, 0, (shared % size) as i32).unwrap();
            for (h, seq) in holes {
                let h = (h % size) as i32;
                c.seq_rm(if seq == 2 { -1 } else { seq }, h, h + 1).unwrap();
            }
            let n = size as usize;
            let mut pos: Vec<i32> = (0..n).map(|i| c.cells.pos(i)).collect();
            let mut seqs: Vec<u64> = (0..n).map(|i| mask(c.cells.seqs(i))).collect();
            let want = seed_plan(&mut pos, &mut seqs, c.cells.used as usize, 2, n_max_nodes);
            let got = c.defrag_plan(n_max_nodes);
            proptest::prop_assert_eq!(got, want);
            let after: Vec<i32> = (0..n).map(|i| c.cells.pos(i)).collect();
            proptest::prop_assert_eq!(after, pos);
            let after: Vec<u64> = (0..n).map(|i| mask(c.cells.seqs(i))).collect();
            proptest::prop_assert_eq!(after, seqs);
            // the indexes (occupied set, per-sequence sets, counts, maxima) followed the moves
            proptest::prop_assert_eq!(c.cells.check_consistency(), Ok(()));
        }
    }

    #[test]
    fn moves_out_of_the_cache_are_refused_before_any_tensor_changes() {
        let mut c = SeedCache::new(CacheParams::new(8, 2, 8, 8)).unwrap();
        c.find_slot(&UBatch::sequence(0, 0, 8)).unwrap().unwrap();
        let rows: Vec<u8> = (0..8 * 16).map(|i| i as u8).collect();
        c.write_rows(0, crate::Tensor::K, 0, &rows).unwrap();
        let bad = [
            CellMove {
                src: 0,
                dst: 1,
                len: 2,
            },
            CellMove {
                src: 7,
                dst: 0,
                len: 2,
            },
        ];
        assert!(matches!(c.apply_moves(&bad), Err(KvError::OutOfRange(_))));
        assert_eq!(c.read_rows(0, crate::Tensor::K, 0, 8).unwrap(), rows);
        let overflow = [CellMove {
            src: u32::MAX,
            dst: 0,
            len: 2,
        }];
        assert!(matches!(
            c.apply_moves(&overflow),
            Err(KvError::OutOfRange(_))
        ));
    }
}
