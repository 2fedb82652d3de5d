//! A one-sequence load whose rows arrive in pieces of tokens rather than as a payload: what a
//! prompt-store restore writes, block by block, straight from the values it reads (a file's
//! bytes, a Redis reply) into the tensors, without assembling a state payload first.
//!
//! The cells are placed when the load starts: in the first run of cells free at that moment,
//! or where `state_read` would place a payload of the same positions when there is none; each
//! piece is then written as it is verified. Until [`SequenceLoad::commit`]
//! the load can be abandoned (dropped, or failed): the cells are put back as they were, and
//! the rows of the placed cells that held data before it.

use crate::cache::rollback::PlacedLoad;
use crate::cache::SeedCache;
use crate::cell_ext::CellExtValue;
use crate::cells::Cells;
use crate::error::{KvError, Result};
use crate::state::PayloadCells;
use crate::tensors::storage::Tensor;

/// A load of one sequence in progress; dropping it uncommitted puts the cache back.
pub struct SequenceLoad<'c> {
    cache: &'c mut SeedCache,
    load: Option<PlacedLoad>,
}

impl SeedCache {
    /// Starts loading sequence `seq`, replacing its cells by one cell per position of
    /// `positions` (their rows zero, to be written). Refused for a recurrent cache, whose
    /// state is one cell of its own shape (load it with `state_read`).
    pub fn load_sequence_rows(
        &mut self,
        seq: i32,
        positions: &[i32],
        allow_scattered: bool,
    ) -> Result<SequenceLoad<'_>> {
        if self.params.recurrent {
            return Err(KvError::Unsupported(
                "a recurrent state loads whole, through stateRead".into(),
            ));
        }
        let dest = self.check_seq("a sequence load", seq)? as i32;
        let mut cells = PayloadCells::with_capacity(positions.len())?;
        for &p in positions {
            cells.push(p, &[dest]);
        }
        // cells free now first: a load into them overwrites no live row, so nothing is kept
        // aside for a rollback (a chat restored over the one its sequence holds would copy
        // every old row first); the sequence's own cells are reused only when nothing else fits
        let load = match free_run(&self.cells, positions.len()) {
            Some(first) => self.place_load_at(&cells, dest, first)?,
            None => self.place_load(&cells, Some(dest), allow_scattered)?,
        };
        Ok(SequenceLoad {
            cache: self,
            load: Some(load),
        })
    }
}

/// The first run of `n` (> 0) cells free now, from the start of the cache.
fn free_run(cells: &Cells, n: usize) -> Option<usize> {
    let size = cells.len();
    let mut at = 0;
    while n > 0 && at + n <= size {
        let occupied = cells.next_occupied_before(at, at + n);
        if occupied >= at + n {
            return Some(at);
        }
        at = cells.next_free_before(occupied + 1, size);
    }
    None
}

/// The cells `first..first + n` of a load that placed `placed`, checked.
fn cells_of(placed: &[usize], first: usize, n: usize) -> Result<&[usize]> {
    first
        .checked_add(n)
        .and_then(|end| placed.get(first..end))
        .ok_or_else(|| {
            KvError::OutOfRange(format!(
                "tokens {first}..{} of a load of {} cells",
                first.saturating_add(n),
                placed.len()
            ))
        })
}

impl SequenceLoad<'_> {
    fn open(&self) -> &PlacedLoad {
        self.load
            .as_ref()
            .expect("a load is open until it is consumed")
    }

    /// Cells the load fills.
    pub fn len(&self) -> usize {
        self.open().placed.len()
    }

    /// Whether the load fills no cell.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Writes `rows` (whole rows of `which` in layer `il`, one per token, V untransposed as
    /// blocks keep it) to the cells of tokens `first..` of the load.
    pub fn write(&mut self, il: u32, which: Tensor, first: usize, rows: &[u8]) -> Result<()> {
        let row = self.cache.row_size(il, which)?;
        if !rows.len().is_multiple_of(row) {
            return Err(KvError::InvalidArg(format!(
                "{which} data of layer {il} must be a multiple of the row size {row} bytes, got {} bytes",
                rows.len()
            )));
        }
        let load = self
            .load
            .as_ref()
            .expect("a load is open until it is consumed");
        let cells = cells_of(&load.placed, first, rows.len() / row)?;
        let lay = self.cache.v_geometry();
        let layer = &mut self.cache.layers[il as usize];
        match cells.first() {
            None => Ok(()),
            Some(&c0) if load.contiguous => layer.write_rows(which, lay, c0, rows),
            Some(_) => cells
                .iter()
                .zip(rows.chunks_exact(row))
                .try_for_each(|(&c, r)| layer.write_rows(which, lay, c, r)),
        }
    }

    /// Sets the extensions of the cells of tokens `first..` (nothing in a cache that keeps
    /// none).
    pub fn set_exts(&mut self, first: usize, exts: &[CellExtValue]) -> Result<()> {
        let load = self
            .load
            .as_ref()
            .expect("a load is open until it is consumed");
        for (&c, &e) in cells_of(&load.placed, first, exts.len())?.iter().zip(exts) {
            self.cache.cells.set_ext(c, e);
        }
        Ok(())
    }

    /// Makes the load final; returns the cells it filled, in token order.
    pub fn commit(mut self) -> Vec<u32> {
        let load = self
            .load
            .take()
            .expect("a load is open until it is consumed");
        let placed = self.cache.commit_load(load);
        placed.into_iter().map(|c| c as u32).collect()
    }
}

impl Drop for SequenceLoad<'_> {
    fn drop(&mut self) {
        if let Some(load) = self.load.take() {
            // putting host rows back cannot fail; a device that fails here has failed the
            // load's own writes already, whose error is the one the caller reports
            let _ = self.cache.undo_load(load);
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::state::Layout;
    use crate::{CacheParams, CellExtValue, KvError, ReadOptions, SeedCache, Tensor, UBatch};

    /// 2 layers, 4 sequences, cells holding `held` (seq, first pos, n) in order; every row a
    /// distinct byte pattern (`salt` tells two caches' rows apart).
    fn cache(size: u32, flash_attn: bool, held: &[(i32, i32, u32)], salt: usize) -> SeedCache {
        let mut p = CacheParams::new(size, 2, 8, 12);
        p.n_seq_max = 4;
        p.flash_attn = flash_attn;
        let mut c = SeedCache::new(p).unwrap();
        for &(seq, p0, n) in held {
            c.find_slot(&UBatch::sequence(seq, p0, n)).unwrap().unwrap();
        }
        for il in 0..2u32 {
            for (which, width) in [(Tensor::K, 16), (Tensor::V, 24)] {
                let rows: Vec<u8> = (0..size as usize * width)
                    .map(|i| (i * 7 + il as usize * 13 + width + salt) as u8)
                    .collect();
                c.write_rows(il, which, 0, &rows).unwrap();
            }
        }
        c
    }

    /// Everything a load can change: the cells, head, n and the live rows.
    fn observable(c: &SeedCache) -> (crate::cells::Cells, u32, u32, Vec<u8>) {
        let rows = c.state_write(-1, Layout::Seed, 1, None).unwrap();
        (c.cells().clone(), c.head(), c.n(), rows)
    }

    /// Loads `src`'s sequence 0 (positions 0..n) into `seq` of `c`, `piece` tokens at a time,
    /// each piece's layers K then V, as a store restore writes blocks.
    fn load_rows(
        c: &mut SeedCache,
        src: &SeedCache,
        seq: i32,
        n: u32,
        piece: u32,
        scattered: bool,
    ) {
        let positions: Vec<i32> = (0..n as i32).collect();
        let mut load = c.load_sequence_rows(seq, &positions, scattered).unwrap();
        assert_eq!(load.len(), n as usize);
        for first in (0..n).step_by(piece as usize) {
            let m = piece.min(n - first);
            for il in 0..2 {
                for which in [Tensor::K, Tensor::V] {
                    let rows = src.read_rows(il, which, first, m).unwrap();
                    load.write(il, which, first as usize, &rows).unwrap();
                }
            }
        }
        load.commit();
    }

    /// Each sequence's state: what a load must give the loaded sequence and leave to the
    /// others, wherever their cells are.
    fn by_sequence(c: &SeedCache) -> Vec<Vec<u8>> {
        (0..4)
            .map(|s| c.state_write(s, Layout::StreamsRot, 1, None).unwrap())
            .collect()
    }

    #[test]
    fn rows_loaded_piece_by_piece_equal_a_state_read_of_the_same_sequence() {
        for flash_attn in [false, true] {
            let src = cache(64, flash_attn, &[(0, 0, 10)], 1);
            let payload = src.state_write(0, Layout::StreamsRot, 1, None).unwrap();
            // into sequence 2 (holding cells 0..6) and into a fresh sequence 1
            for seq in [2, 1] {
                let held = [(2, 0, 6), (3, 0, 4)];
                let mut want = cache(64, flash_attn, &held, 2);
                want.state_read(&payload, seq, ReadOptions::default(), None)
                    .unwrap();
                for piece in [1, 3, 10] {
                    let mut c = cache(64, flash_attn, &held, 2);
                    load_rows(&mut c, &src, seq, 10, piece, false);
                    let what =
                        format!("flash attention {flash_attn}, seq {seq}, pieces of {piece}");
                    assert_eq!(by_sequence(&c), by_sequence(&want), "{what}");
                    // the first cells free before the load, not the sequence's own
                    assert_eq!(
                        c.cells().cells_of(seq as usize).collect::<Vec<_>>(),
                        (10..20).collect::<Vec<_>>(),
                        "{what}"
                    );
                    assert_eq!(c.used_cells(), want.used_cells(), "{what}");
                    c.cells().check_consistency().unwrap();
                }
            }
        }
    }

    #[test]
    fn with_no_free_run_the_sequence_reuses_its_own_cells_as_state_read_does() {
        for flash_attn in [false, true] {
            // 16 cells: sequence 3 holds 0..4, sequence 2 4..10, so 10 cells fit only over
            // where sequence 2 was
            let held = [(3, 0, 4), (2, 0, 6)];
            let src = cache(16, flash_attn, &[(0, 0, 10)], 1);
            let payload = src.state_write(0, Layout::StreamsRot, 1, None).unwrap();
            let mut want = cache(16, flash_attn, &held, 2);
            want.state_read(&payload, 2, ReadOptions::default(), None)
                .unwrap();
            let mut c = cache(16, flash_attn, &held, 2);
            load_rows(&mut c, &src, 2, 10, 4, false);
            assert_eq!(
                observable(&c),
                observable(&want),
                "flash attention {flash_attn}"
            );
        }
    }

    #[test]
    fn scattered_cells_get_their_rows_and_columns() {
        for flash_attn in [false, true] {
            // sequence 3 holds every other cell: 5 tokens fit only scattered
            let fragmented = || {
                let mut c = cache(10, flash_attn, &[], 2);
                for cell in (0..10).step_by(2) {
                    c.find_slot(&UBatch::sequence(3, cell, 1)).unwrap();
                    c.find_slot(&UBatch::sequence(2, cell + 1, 1)).unwrap();
                }
                c.seq_rm(2, -1, -1).unwrap();
                c
            };
            let src = cache(16, flash_attn, &[(0, 0, 5)], 1);
            let payload = src.state_write(0, Layout::StreamsRot, 1, None).unwrap();
            let mut want = fragmented();
            let opts = ReadOptions {
                allow_scattered: true,
                ..ReadOptions::default()
            };
            want.state_read(&payload, 1, opts, None).unwrap();
            let mut c = fragmented();
            let e = c
                .load_sequence_rows(1, &[0, 1, 2, 3, 4], false)
                .err()
                .unwrap();
            assert!(matches!(e, KvError::NoSpace(_)), "{e}");
            load_rows(&mut c, &src, 1, 5, 2, true);
            assert_eq!(c.cells().cells_of(1).collect::<Vec<_>>(), [1, 3, 5, 7, 9]);
            assert_eq!(
                observable(&c),
                observable(&want),
                "flash attention {flash_attn}"
            );
        }
    }

    #[test]
    fn a_dropped_load_leaves_cells_and_live_rows_as_they_were() {
        // 64 cells: the load goes to free cells; 16: over sequence 2's own, whose rows were
        // kept aside and come back
        for (size, held) in [(64, [(2, 0, 6), (3, 0, 4)]), (16, [(3, 0, 4), (2, 0, 6)])] {
            for flash_attn in [false, true] {
                let src = cache(64, flash_attn, &[(0, 0, 10)], 1);
                let mut c = cache(size, flash_attn, &held, 2);
                let before = observable(&c);
                {
                    let mut load = c
                        .load_sequence_rows(2, &(0..10).collect::<Vec<_>>(), false)
                        .unwrap();
                    for il in 0..2 {
                        for which in [Tensor::K, Tensor::V] {
                            let rows = src.read_rows(il, which, 0, 10).unwrap();
                            load.write(il, which, 0, &rows).unwrap();
                        }
                    }
                    load.set_exts(0, &[CellExtValue::default(); 10]).unwrap();
                    let rows = src.read_rows(1, Tensor::K, 0, 3).unwrap();
                    let e = load.write(1, Tensor::K, 8, &rows).unwrap_err();
                    assert!(matches!(e, KvError::OutOfRange(_)), "{e}");
                }
                let what = format!("{size} cells, flash attention {flash_attn}");
                assert_eq!(observable(&c), before, "{what}");
                c.cells().check_consistency().unwrap();
            }
        }
    }

    #[test]
    fn a_recurrent_cache_and_a_bad_sequence_are_refused() {
        let mut p = CacheParams::new(4, 1, 8, 8);
        p.recurrent = true;
        let mut r = SeedCache::new(p).unwrap();
        let e = r.load_sequence_rows(0, &[0], false).err().unwrap();
        assert!(matches!(e, KvError::Unsupported(_)), "{e}");
        let mut c = cache(8, true, &[], 0);
        let e = c.load_sequence_rows(4, &[0], false).err().unwrap();
        assert!(matches!(e, KvError::OutOfRange(_)), "{e}");
    }
}
