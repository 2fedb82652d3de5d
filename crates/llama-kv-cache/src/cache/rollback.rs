//! What a state load puts back when it fails, sized by the cells the load touches.
//!
//! A whole-cache load rewrites every cell, so it keeps a copy of them all. A one-sequence load
//! into a transformer cache touches only the destination's old cells (removed first) and the
//! cells it places the payload in, which were free: keeping the destination's cells and the
//! counters is enough, so a small restore into a large cache no longer copies the whole cell
//! table. Recurrent placement moves tails between cells; recurrent caches have one cell per
//! sequence, so they keep a full copy too.
//!
//! A whole-cache load copies nothing: the live table becomes the record, and the load fills a
//! spare table of the same shape, the one a previous load left behind (reset, with the live
//! deltas, which llama.cpp's clear-then-read keeps). A successful load leaves the record as the
//! next spare; a failed one swaps the tables back.
//!
//! Loads that write rows as their bytes arrive (a streamed payload, a prompt-store restore)
//! place the cells first and write later, so a failure may come after rows were written: they
//! keep a [`PlacedLoad`], which also holds the rows of the placed cells that held data before
//! (nothing for a load into free cells), to put back with the cells.

use crate::cache::SeedCache;
use crate::cells::{Cell, Cells};
use crate::error::Result;
use crate::state::PayloadCells;

/// The undo record of one load.
pub(crate) enum CellsUndo {
    /// Every cell, with `head` and `n`.
    All(Box<Cells>, u32, u32),
    /// The destination sequence's cells before the load, and the counters.
    Sequence {
        old: Vec<(usize, Cell)>,
        used: u32,
        head: u32,
        n: u32,
    },
    /// Nothing: a load that cannot fail once its cells change. A sequence read into a stream
    /// of today's memories is one: their rows are on the host (a device is refused for them)
    /// and the payload's blocks and cells were checked against them before the cells changed.
    /// Recording the cells it touched was a third of a read of 8,192 cells of tiny rows.
    Unrecorded,
}

impl CellsUndo {
    /// Whether cell `i` held data when the record was taken.
    pub(crate) fn held_data(&self, i: usize) -> bool {
        match self {
            CellsUndo::All(cells, ..) => !cells.seqs(i).is_empty(),
            // ascending: `cells_of` walks the sequence's bitmap in order
            CellsUndo::Sequence { old, .. } => old.binary_search_by_key(&i, |(c, _)| *c).is_ok(),
            CellsUndo::Unrecorded => false,
        }
    }
}

/// A load whose cells are placed and whose rows are being written.
pub(crate) struct PlacedLoad {
    /// The cells the load fills, in payload order.
    pub(crate) placed: Vec<usize>,
    /// Whether they are one run of cells.
    pub(crate) contiguous: bool,
    undo: CellsUndo,
    /// Rows of the placed cells that held data before the load.
    saved: Vec<SavedRun>,
}

/// The rows of a run of cells a load overwrites: first cell, cells, and per layer the K rows
/// then the V rows (or, transposed, each channel's elements of the run).
type SavedRun = (usize, usize, Vec<u8>);

impl SeedCache {
    /// Places `cells` into `dest` (`None`: the whole cache) for a load that writes rows
    /// afterwards, keeping the rows it will overwrite. On failure the cache is as before.
    pub(crate) fn place_load(
        &mut self,
        cells: &PayloadCells,
        dest: Option<i32>,
        allow_scattered: bool,
    ) -> Result<PlacedLoad> {
        let (undo, placed) = self.place_cells(cells, dest, allow_scattered)?;
        match self.save_rows(&undo, &placed) {
            Ok(saved) => Ok(PlacedLoad {
                contiguous: placed.windows(2).all(|w| w[1] == w[0] + 1),
                placed,
                undo,
                saved,
            }),
            Err(e) => {
                self.roll_back(undo, &placed);
                Err(e)
            }
        }
    }

    /// Places the one-sequence `cells` of `dest` in the cells `first..`, which must be free now
    /// (the sequence's old cells are removed, not reused: the load overwrites no live row, so
    /// it keeps none aside).
    pub(crate) fn place_load_at(
        &mut self,
        cells: &PayloadCells,
        dest: i32,
        first: usize,
    ) -> Result<PlacedLoad> {
        let undo = self.undo_record(Some(dest));
        if let Err(e) = self.seq_rm_keeping_data(dest, -1, -1) {
            self.roll_back(undo, &[]);
            return Err(e);
        }
        let placed: Vec<usize> = (first..first + cells.len()).collect();
        self.assign_cells(dest, cells, &placed);
        Ok(PlacedLoad {
            placed,
            contiguous: true,
            undo,
            saved: Vec::new(),
        })
    }

    /// Ends a placed load that succeeded; returns the cells it filled.
    pub(crate) fn commit_load(&mut self, load: PlacedLoad) -> Vec<usize> {
        self.commit(load.undo);
        load.placed
    }

    /// Puts back the cells and the saved rows of a placed load that did not finish.
    pub(crate) fn undo_load(&mut self, load: PlacedLoad) -> Result<()> {
        self.roll_back(load.undo, &load.placed);
        let lay = self.v_geometry();
        for (first, n, rows) in &load.saved {
            let mut at = 0;
            for l in &mut self.layers {
                let (k, v) = (n * l.k_row, n * l.v_row);
                l.k.write(first * l.k_row, &rows[at..at + k])?;
                at += k;
                if lay.v_trans {
                    // the run's elements of each channel, as `read_2d` packed them
                    let el = lay.v_el;
                    l.v.write_2d(first * el, n * el, lay.size * el, &rows[at..at + v])?;
                } else {
                    l.v.write(first * l.v_row, &rows[at..at + v])?;
                }
                at += v;
            }
        }
        Ok(())
    }

    /// The K and V data of the placed cells that held data before the load, per run of
    /// consecutive cells: (first cell, cells, each layer's K rows then V rows or columns).
    fn save_rows(&self, undo: &CellsUndo, placed: &[usize]) -> Result<Vec<SavedRun>> {
        let lay = self.v_geometry();
        let mut held: Vec<usize> = placed
            .iter()
            .copied()
            .filter(|&c| undo.held_data(c))
            .collect();
        held.sort_unstable();
        let mut saved = Vec::new();
        for run in held.chunk_by(|a, b| b == &(a + 1)) {
            let (first, n) = (run[0], run.len());
            let bytes = n * self.bytes_per_cell();
            let mut rows = crate::alloc::zeroed::<u8>(bytes, "the rows a load replaces")?;
            let mut at = 0;
            for l in &self.layers {
                let (k, v) = (n * l.k_row, n * l.v_row);
                l.k.read(first * l.k_row, &mut rows[at..at + k])?;
                at += k;
                if lay.v_trans {
                    let el = lay.v_el;
                    l.v.read_2d(first * el, n * el, lay.size * el, &mut rows[at..at + v])?;
                } else {
                    l.v.read(first * l.v_row, &mut rows[at..at + v])?;
                }
                at += v;
            }
            saved.push((first, n, rows));
        }
        Ok(saved)
    }

    /// The undo record for a load into `dest` (`None`: the whole cache), taken before it starts.
    /// For a whole-cache load the live cells move into the record, and the cache gets the
    /// spare table (or a copy, the first time), which the load resets.
    pub(crate) fn undo_record(&mut self, dest: Option<i32>) -> CellsUndo {
        match dest {
            None => {
                let mut fresh = match self.spare_cells.take() {
                    Some(spare) => *spare,
                    None => self.cells.clone(),
                };
                fresh.copy_deltas_from(&self.cells);
                let old = std::mem::replace(&mut self.cells, fresh);
                CellsUndo::All(Box::new(old), self.head, self.n)
            }
            Some(seq) if !self.params.recurrent => CellsUndo::Sequence {
                old: self
                    .cells
                    .cells_of(seq as usize)
                    .map(|i| (i, self.cells.get(i)))
                    .collect(),
                used: self.cells.used,
                head: self.head,
                n: self.n,
            },
            // a recurrent load moves tails between cells in place: a copy of them all
            Some(_) => CellsUndo::All(Box::new(self.cells.clone()), self.head, self.n),
        }
    }

    /// Ends a load that succeeded: a record of every cell becomes the spare table of the next
    /// whole-cache load.
    pub(crate) fn commit(&mut self, undo: CellsUndo) {
        if let CellsUndo::All(cells, ..) = undo {
            self.spare_cells = Some(cells);
        }
    }

    /// Puts the cells back as they were when `undo` was taken; `placed` are the cells the load
    /// filled (free before it, or the destination's own).
    pub(crate) fn roll_back(&mut self, undo: CellsUndo, placed: &[usize]) {
        match undo {
            CellsUndo::All(cells, head, n) => {
                let failed = std::mem::replace(&mut self.cells, *cells);
                self.spare_cells = Some(Box::new(failed));
                self.head = head;
                self.n = n;
            }
            CellsUndo::Unrecorded => {}
            CellsUndo::Sequence { old, used, head, n } => {
                // placement sets only pos and seqs, so delta, src and tail are still the old ones
                for &i in placed {
                    self.cells.clear_seqs(i);
                    self.cells.set_pos(i, -1);
                }
                for (i, cell) in old {
                    self.cells.set_cell(i, cell);
                }
                self.cells.used = used;
                self.head = head;
                self.n = n;
                self.cells.settle();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::state::PayloadCells;
    use crate::{CacheParams, SeedCache, UBatch};

    /// xorshift32, so the cases are reproducible without a dependency.
    struct Rng(u32);

    impl Rng {
        fn below(&mut self, n: u32) -> u32 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 17;
            self.0 ^= self.0 << 5;
            self.0 % n
        }
    }

    /// A cache of 256 cells shaped by random placements, removals and shifts (so free cells
    /// keep stale deltas, and sequences share cells).
    fn random_cache(rng: &mut Rng) -> SeedCache {
        let mut params = CacheParams::new(256, 1, 2, 2);
        params.n_seq_max = 4;
        let mut c = SeedCache::new(params).unwrap();
        let mut next = [0i32; 4];
        for _ in 0..24 {
            let seq = rng.below(4) as i32;
            match rng.below(4) {
                0 | 1 => {
                    let n = 1 + rng.below(16);
                    if c.find_slot(&UBatch::sequence(seq, next[seq as usize], n))
                        .unwrap()
                        .is_some()
                    {
                        next[seq as usize] += n as i32;
                    }
                }
                2 => {
                    let p0 = rng.below(64) as i32;
                    c.seq_rm(seq, p0, p0 + rng.below(16) as i32).unwrap();
                }
                _ => {
                    let dst = rng.below(4) as i32;
                    if dst != seq {
                        c.seq_cp(seq, dst, 0, rng.below(32) as i32).unwrap();
                    }
                    c.seq_add(seq, 0, -1, rng.below(5) as i32 - 2).unwrap();
                }
            }
        }
        c
    }

    #[test]
    fn a_failed_sequence_load_puts_back_exactly_the_cells_it_touched() {
        let mut rng = Rng(0x9e37_79b9);
        let mut placed_somewhere = 0;
        for case in 0..400 {
            let mut c = random_cache(&mut rng);
            let (cells, head, n) = (c.cells.clone(), c.head, c.n);
            let dest = rng.below(4) as i32;
            let mut metas = PayloadCells::new();
            (0..1 + rng.below(40)).for_each(|p| metas.push(p as i32, &[]));
            let undo = c.undo_record(Some(dest));
            let placed = c
                .place_sequence(dest, &metas, rng.below(2) == 0)
                .unwrap_or_default();
            placed_somewhere += !placed.is_empty() as u32;
            c.roll_back(undo, &placed);
            assert_eq!(
                c.cells, cells,
                "case {case}: cells differ after the rollback"
            );
            assert_eq!((c.head, c.n), (head, n), "case {case}: head or n differ");
            c.cells.check_consistency().unwrap();
        }
        assert!(
            placed_somewhere > 100,
            "too few placements: {placed_somewhere}"
        );
    }

    #[test]
    fn whole_cache_loads_through_the_spare_table_give_what_the_first_load_gives() {
        use crate::cache::io::ReadOptions;
        use crate::state::Layout;
        let mut rng = Rng(0x2545_f491);
        let opts = ReadOptions::default();
        for case in 0..60 {
            let seed = rng.0;
            let mut c = random_cache(&mut rng);
            let other = random_cache(&mut rng)
                .state_write(-1, Layout::Streams, 1, None)
                .unwrap();
            let own = c.state_write(-1, Layout::Streams, 1, None).unwrap();
            // the same cache again: its only load takes the first-time path (a copy)
            let mut once = random_cache(&mut Rng(seed));
            once.state_read(&other, -1, opts, None).unwrap();
            // loads alternate the live and the spare table; an abandoned streamed load swaps
            // them back; each load keeps the deltas it finds, as llama.cpp's clear-then-read
            // does (a shift between loads moves them)
            for data in [&other, &own, &other] {
                c.seq_add(rng.below(4) as i32, 0, -1, 1 + rng.below(3) as i32)
                    .unwrap();
                let deltas = c.cells.delta_column().to_vec();
                c.state_read(data, -1, opts, None).unwrap();
                assert_eq!(
                    c.cells.delta_column(),
                    &deltas[..],
                    "case {case}: deltas changed"
                );
                let before = c.cells.clone();
                let mut load = c.state_in(-1, opts).unwrap();
                c.state_in_write(&mut load, &own[..own.len() - 1]).unwrap();
                c.state_in_abort(&mut load).unwrap();
                assert_eq!(
                    c.cells, before,
                    "case {case}: the abandoned load changed the cells"
                );
            }
            let columns = |k: &SeedCache| {
                (
                    k.cells.pos_column().to_vec(),
                    (0..k.cells.len())
                        .map(|i| k.cells.seqs(i))
                        .collect::<Vec<_>>(),
                )
            };
            assert_eq!(
                columns(&c),
                columns(&once),
                "case {case}: cells differ from a single load"
            );
            assert_eq!((c.head, c.n), (once.head, once.n), "case {case}");
            c.cells.check_consistency().unwrap();
        }
    }
}
