//! The unified cache's state I/O on whole payloads: planning and writing a payload of one
//! sequence or of the whole cache, and reading one back transactionally (parse and check
//! everything, place the cells, then write the rows; a failure puts everything back), which is
//! `io/read.rs`.

use crate::cache::SeedCache;
use crate::cells::SeqSet;
use crate::error::{KvError, Result};
use crate::state::cells::{cell_len, put_cell, put_cell_one_id, CellExt};
use crate::state::parts::PartRole;
use crate::state::sink::{Sink, SliceSink, WriteSink};
use crate::state::{cell_count_header, data_header, k_header, n_stream_header, v_header, Layout};
use crate::tensors::storage::Tensor;

mod read;

/// Reports progress as `(bytes done, bytes total)`; returning false asks to stop.
pub type Progress<'a> = &'a mut dyn FnMut(u64, u64) -> bool;

/// Stops a long operation when its `progress` callback says so: called with the work done and
/// the whole, it returns [`KvError::Aborted`] naming `what` when the callback returns false.
pub fn check_progress(
    progress: &mut Option<Progress<'_>>,
    done: u64,
    total: u64,
    what: &str,
) -> Result<()> {
    match progress.as_mut().is_some_and(|p| !p(done, total)) {
        true => Err(KvError::Aborted(format!("{what} aborted"))),
        false => Ok(()),
    }
}

/// Options for reading a payload into a cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReadOptions {
    /// Force a layout instead of detecting it.
    pub layout: Option<Layout>,
    /// For a one-sequence restore, use free cells anywhere when no contiguous run is free
    /// (today's llama.cpp does; the seed requires a contiguous run).
    pub allow_scattered: bool,
    /// Of a payload of several memories (iSWA, hybrid), load this part. Without it, files
    /// load the one part that fits the cache, and `state_read` reads a single memory.
    pub part: Option<PartRole>,
    /// The payload is llama.cpp's `PARTIAL_ONLY` state (what llama-server keeps as a context
    /// checkpoint): an iSWA memory's window cache, a hybrid's recurrent part (after its
    /// window cache in hybrid-iSWA); the other parts keep what they hold. A unified cache
    /// writes its whole state either way.
    pub partial: bool,
}

/// What a read did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadSummary {
    /// The layout that was read.
    pub layout: Layout,
    /// Cells restored.
    pub cells: u32,
    /// Cells that received the data, in payload order.
    pub placed: Vec<u32>,
}

impl ReadSummary {
    /// The reads of the parts of one payload as one: the first part's layout, every cell.
    pub(crate) fn together(parts: [ReadSummary; 2]) -> ReadSummary {
        let [a, b] = parts;
        let mut placed = a.placed;
        placed.extend(b.placed);
        ReadSummary {
            layout: a.layout,
            cells: a.cells + b.cells,
            placed,
        }
    }
}

/// What a state write carries, fixed before its first byte: the layout, each stream's cell
/// ranges and sizes. Valid while the cache does not change.
pub(crate) struct WritePlan {
    pub seq: i32,
    pub layout: Layout,
    pub streams: Vec<Vec<(usize, usize)>>,
    /// Bytes of each stream's cell count and metadata.
    pub meta_len: Vec<usize>,
    /// Bytes of the whole payload.
    pub total: usize,
}

impl SeedCache {
    /// The cells a write of `seq` (-1: every cell with a sequence) carries, as runs, read from
    /// the sequences' bitmaps a word at a time.
    fn cell_ranges(&self, seq: i32) -> Vec<(usize, usize)> {
        if seq >= 0 {
            self.cells.runs_of(seq as usize)
        } else {
            self.cells.nonempty_runs()
        }
    }

    /// Cell ranges per stream: one stream, or (today's non-unified contexts) one per sequence,
    /// stream `s` holding the cells of sequence `s`.
    fn stream_plan(
        &self,
        seq: i32,
        layout: Layout,
        n_stream: u32,
    ) -> Result<Vec<Vec<(usize, usize)>>> {
        if seq != -1 {
            self.check_seq("stateWrite", seq)?;
        }
        if layout == Layout::Seed || n_stream <= 1 {
            return Ok(vec![self.cell_ranges(seq)]);
        }
        if n_stream > self.params.n_seq_max {
            return Err(KvError::InvalidArg(format!(
                "nStream {n_stream} exceeds nSeqMax {}",
                self.params.n_seq_max
            )));
        }
        if seq == -1 {
            if let Some(i) = (0..self.cells.len()).find(|&i| self.cells.seqs(i).len() > 1) {
                return Err(KvError::InvalidArg(format!(
                    "cell {i} is shared by several sequences and cannot be split into per-sequence streams"
                )));
            }
        }
        // stream s holds sequence s: a sequence past the last stream would be written nowhere
        let beyond = match seq {
            -1 => (n_stream as usize..self.params.n_seq_max as usize)
                .find(|&s| self.cells.seq_pos_max(s).is_some()),
            s => (s as u32 >= n_stream).then_some(s as usize),
        };
        if let Some(s) = beyond {
            return Err(KvError::InvalidArg(format!(
                "sequence {s} has no stream of its own among nStream {n_stream}: its cells would \
                 be written nowhere"
            )));
        }
        Ok((0..n_stream as i32)
            .map(|s| {
                if seq == -1 || seq == s {
                    self.cell_ranges(s)
                } else {
                    Vec::new()
                }
            })
            .collect())
    }

    pub(crate) fn effective_layout(&self, layout: Layout) -> Layout {
        if self.params.recurrent {
            Layout::Seed
        } else {
            layout
        }
    }

    /// The layout to write: a rotated cache's K/V mean nothing to a reader that does not know
    /// the rotation, so only the streams-rot layout may carry them; a cache without V writes
    /// a layout with a stream prefix.
    fn write_layout(&self, layout: Layout) -> Result<Layout> {
        let layout = self.effective_layout(layout);
        let (k, v) = (self.params.n_rot_k, self.params.n_rot_v);
        if (k != 0 || v != 0) && !layout.records_rotation() && !self.params.recurrent {
            return Err(KvError::Unsupported(format!(
                "the cache's K/V are rotated (nRotK {k}, nRotV {v}); the {layout} layout cannot record that: write 'streams-rot' (session v11 / sequence v4), or re-type to an unrotated cache first"
            )));
        }
        if self.params.no_v && !layout.has_stream_prefix() {
            return Err(KvError::Unsupported(
                "the cache keeps no V (noV); the seed layout has a V block in every layer (llama.cpp of that era kept V for latent attention): write 'streams' or 'streams-rot'"
                    .into(),
            ));
        }
        Ok(layout)
    }

    /// Bytes of a stream's cell count and cell metadata: per cell its position and seq id
    /// count, and its seq ids: all of its sequences in a whole-cache save; in a one-sequence
    /// save none (seed) or the saved one (today's layouts).
    fn meta_size(&self, ranges: &[(usize, usize)], seq: i32, layout: Layout) -> usize {
        let cells: usize = ranges.iter().map(|r| r.1 - r.0).sum();
        let ids = match (seq, layout) {
            (-1, _) => ranges
                .iter()
                .flat_map(|&(a, b)| a..b)
                .map(|i| self.cells.seqs(i).len())
                .sum(),
            (_, Layout::Seed) => 0,
            (_, Layout::Streams | Layout::StreamsRot) => cells,
        };
        4 + cells * cell_len(0, self.params.cell_ext) + 4 * ids
    }

    /// Writes the cell count and the metadata of the cells `ranges` into `out`, which is
    /// [`SeedCache::meta_size`] bytes long. Fixed-size cells go out as fixed-size chunks, which
    /// compile to plain stores (a cursor over the slice cost 3.5 ns per cell).
    fn put_cells_meta(&self, out: &mut [u8], ranges: &[(usize, usize)], seq: i32, layout: Layout) {
        let pos = self.cells.pos_column();
        let n: usize = ranges.iter().map(|r| r.1 - r.0).sum();
        let (count, out) = out.split_at_mut(4);
        count.copy_from_slice(&cell_count_header(n as u32));
        let cells = ranges.iter().flat_map(|&(a, b)| a..b);
        let kind = self.params.cell_ext;
        if !kind.is_none() {
            // M-RoPE / PLE caches: every cell with its extension after its seq id count
            let mut at = 0;
            for i in cells {
                let ids = match (seq, layout) {
                    (-1, _) => self.cells.seqs(i),
                    (_, Layout::Seed) => SeqSet::EMPTY,
                    (s, _) => SeqSet::single(s as usize),
                };
                let len = cell_len(ids.len(), kind);
                let ext = Some(self.cells.ext(i));
                let ids = ids.iter().map(|f| f as i32);
                put_cell(&mut out[at..at + len], pos[i], kind, ext, ids);
                at += len;
            }
            return;
        }
        match (seq, layout) {
            (-1, _) => {
                let mut at = 0;
                for i in cells {
                    let set = self.cells.seqs(i);
                    // a cell of one sequence, the common case: one fixed-size write
                    if let Some(id) = set.only() {
                        let id = id as i32;
                        let dst: &mut [u8; 12] = (&mut out[at..at + 12]).try_into().unwrap();
                        put_cell_one_id(dst, pos[i], id);
                        at += 12;
                        continue;
                    }
                    let len = cell_len(set.len(), CellExt::None);
                    let ids = set.iter().map(|f| f as i32);
                    put_cell(&mut out[at..at + len], pos[i], CellExt::None, None, ids);
                    at += len;
                }
            }
            (_, Layout::Seed) => {
                for (dst, i) in out.chunks_exact_mut(8).zip(cells) {
                    put_cell(dst, pos[i], CellExt::None, None, std::iter::empty());
                }
            }
            (s, Layout::Streams | Layout::StreamsRot) => {
                for (dst, i) in out.chunks_exact_mut(12).zip(cells) {
                    put_cell_one_id(dst.try_into().unwrap(), pos[i], s);
                }
            }
        }
    }

    /// Bytes of a stream's data (its header and rows), after its metadata.
    fn data_size(&self, ranges: &[(usize, usize)], layout: Layout) -> usize {
        let n: usize = ranges.iter().map(|r| r.1 - r.0).sum();
        let mut size = 0;
        if n > 0 || layout == Layout::Seed {
            size += if layout.records_rotation() { 16 } else { 8 };
            // a cache without V writes no V blocks (its V rows are of no bytes)
            let v_header = if self.params.no_v { 0 } else { 12 };
            for l in &self.layers {
                size += 12 + n * l.k_row + v_header + n * l.v_row;
            }
        }
        size
    }

    /// The plan of `state_write(seq, layout, n_stream)`.
    pub(crate) fn write_plan(&self, seq: i32, layout: Layout, n_stream: u32) -> Result<WritePlan> {
        let streams = self.stream_plan(seq, self.write_layout(layout)?, n_stream)?;
        self.plan_of_ranges(seq, layout, streams)
    }

    /// The plan of a payload of `streams` (each a list of cell runs) holding `seq` (-1: every
    /// sequence of each cell), for a caller that chose the cells itself.
    pub(crate) fn plan_of_ranges(
        &self,
        seq: i32,
        layout: Layout,
        streams: Vec<Vec<(usize, usize)>>,
    ) -> Result<WritePlan> {
        let layout = self.write_layout(layout)?;
        let meta_len: Vec<usize> = streams
            .iter()
            .map(|r| self.meta_size(r, seq, layout))
            .collect();
        let prefix = if layout.has_stream_prefix() { 4 } else { 0 };
        let total = prefix
            + meta_len.iter().sum::<usize>()
            + streams
                .iter()
                .map(|r| self.data_size(r, layout))
                .sum::<usize>();
        Ok(WritePlan {
            seq,
            layout,
            streams,
            meta_len,
            total,
        })
    }

    /// Size in bytes of `state_write(seq, layout, n_stream)`.
    pub fn state_size(&self, seq: i32, layout: Layout, n_stream: u32) -> Result<usize> {
        Ok(self.write_plan(seq, layout, n_stream)?.total)
    }

    /// The seed's `state_write(seq)` (seq -1: the whole cache) in `layout`. With the streams
    /// layout, `n_stream > 1` writes one stream per sequence, as today's llama.cpp does for
    /// non-unified contexts. Recurrent caches always use the stream-less layout, as llama.cpp
    /// does in both eras.
    pub fn state_write(
        &self,
        seq: i32,
        layout: Layout,
        n_stream: u32,
        progress: Option<Progress<'_>>,
    ) -> Result<Vec<u8>> {
        let plan = self.write_plan(seq, layout, n_stream)?;
        let total = plan.total;
        let mut out = Vec::new();
        out.try_reserve_exact(total).map_err(|_| {
            KvError::Backend(format!("cannot allocate {total} bytes for the state"))
        })?;
        self.write_planned(&mut out, &plan, progress)?;
        Ok(out)
    }

    /// [`SeedCache::state_write`] into the front of `out`, without allocating the payload; returns
    /// its size. Fails with `InvalidArg`, writing nothing, when `out` is smaller than
    /// [`SeedCache::state_size`].
    pub fn state_write_into(
        &self,
        out: &mut [u8],
        seq: i32,
        layout: Layout,
        n_stream: u32,
        progress: Option<Progress<'_>>,
    ) -> Result<usize> {
        let plan = self.write_plan(seq, layout, n_stream)?;
        let total = plan.total;
        if out.len() < total {
            return Err(KvError::InvalidArg(format!(
                "a buffer of {} bytes cannot hold the {total}-byte state",
                out.len()
            )));
        }
        self.write_planned(&mut SliceSink::new(out), &plan, progress)
    }

    /// [`SeedCache::state_write`] streamed to `w` (host tensors are written straight from memory);
    /// returns the payload's size.
    pub fn state_write_to(
        &self,
        w: &mut dyn std::io::Write,
        seq: i32,
        layout: Layout,
        n_stream: u32,
        progress: Option<Progress<'_>>,
    ) -> Result<usize> {
        let plan = self.write_plan(seq, layout, n_stream)?;
        self.write_planned(&mut WriteSink::new(w), &plan, progress)
    }

    /// Writes the payload `plan` describes; the cache must not have changed since the plan
    /// was made.
    pub(crate) fn write_planned(
        &self,
        out: &mut dyn Sink,
        plan: &WritePlan,
        progress: Option<Progress<'_>>,
    ) -> Result<usize> {
        let total = plan.total;
        let start = out.written();
        if plan.layout.has_stream_prefix() {
            out.put(&n_stream_header(plan.streams.len() as u32))?;
        }
        let mut tick = progress;
        for (ranges, &meta_len) in plan.streams.iter().zip(&plan.meta_len) {
            self.write_stream(out, ranges, meta_len, plan, &mut |done| {
                let done = (done - start) as u64;
                check_progress(&mut tick, done, total as u64, "state write")
            })?;
        }
        debug_assert_eq!(out.written() - start, total);
        Ok(total)
    }

    fn write_stream(
        &self,
        out: &mut dyn Sink,
        ranges: &[(usize, usize)],
        meta_len: usize,
        plan: &WritePlan,
        report: &mut dyn FnMut(usize) -> Result<()>,
    ) -> Result<()> {
        let (seq, layout) = (plan.seq, plan.layout);
        let n: usize = ranges.iter().map(|r| r.1 - r.0).sum();
        // the cell metadata is small next to the rows: written in place where the payload is
        // in memory, else gathered and written at once
        if !out.skip(meta_len) {
            match out.place(meta_len) {
                Some(dst) => self.put_cells_meta(dst, ranges, seq, layout),
                None => {
                    let mut meta = vec![0u8; meta_len];
                    self.put_cells_meta(&mut meta, ranges, seq, layout);
                    out.put(&meta)?;
                }
            }
        }
        if n == 0 && layout != Layout::Seed {
            return Ok(());
        }
        let rot = layout
            .records_rotation()
            .then_some((self.params.n_rot_k, self.params.n_rot_v));
        let (header, len) = data_header(self.v_trans(), self.params.n_layer, rot);
        out.put(&header[..len])?;
        for l in &self.layers {
            out.put(&k_header(self.params.type_k, l.k_row))?;
            if !out.skip(n * l.k_row) {
                for &(a, b) in ranges {
                    out.put_from(l.k.as_ref(), a * l.k_row, (b - a) * l.k_row)?;
                }
            }
            report(out.written())?;
        }
        let size = self.params.size as usize;
        // a cache without V writes no V blocks
        let v_layers = if self.params.no_v {
            &[][..]
        } else {
            &self.layers[..]
        };
        for l in v_layers {
            out.put(&v_header(self.params.type_v, l.v_row, self.v_trans()))?;
            if self.v_trans() {
                let el = self.params.type_v.type_size();
                if !out.skip(n * el * l.n_embd_v) {
                    for j in 0..l.n_embd_v {
                        for &(a, b) in ranges {
                            out.put_from(l.v.as_ref(), (a + j * size) * el, (b - a) * el)?;
                        }
                    }
                }
            } else if !out.skip(n * l.v_row) {
                for &(a, b) in ranges {
                    out.put_from(l.v.as_ref(), a * l.v_row, (b - a) * l.v_row)?;
                }
            }
            report(out.written())?;
        }
        Ok(())
    }

    /// Rows of `which` in layer `il` for the given cells, packed (for tests and inspection).
    pub fn rows_of_cells(&self, il: u32, which: Tensor, cells: &[u32]) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        for &c in cells {
            out.extend(self.read_rows(il, which, c, 1)?);
        }
        Ok(out)
    }

    /// Writes one row per cell of `cells` (which need not be consecutive: today's caches
    /// place tokens cell by cell) into `which` of layer `il`. Every cell and the length are
    /// checked before a row is written.
    pub fn write_rows_of_cells(
        &mut self,
        il: u32,
        which: Tensor,
        cells: &[u32],
        rows: &[u8],
    ) -> Result<()> {
        let row = self.row_size(il, which)?;
        if rows.len() as u64 != cells.len() as u64 * row as u64 {
            return Err(KvError::InvalidArg(format!(
                "{which} data of layer {il}: {} bytes for {} cells of {row}-byte rows",
                rows.len(),
                cells.len()
            )));
        }
        for &c in cells {
            self.check_cells(c, 1)?;
        }
        for (&c, bytes) in cells.iter().zip(rows.chunks_exact(row)) {
            self.write_rows(il, which, c, bytes)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cells::ubatch::UBatch;
    use crate::CacheParams;

    #[test]
    fn regression_a_sequence_past_the_last_stream_was_written_nowhere() {
        // found by the damaged-dsv4 test: a conversion wrote a sequence file's sequence 3 in a
        // payload of 2 streams, which held no cell at all; a whole state lost sequence 3 alike
        let mut p = CacheParams::new(32, 2, 64, 64);
        p.n_seq_max = 4;
        let mut c = SeedCache::new(p).unwrap();
        c.find_slot(&UBatch::sequence(1, 0, 2)).unwrap();
        c.find_slot(&UBatch::sequence(3, 0, 3)).unwrap();
        for seq in [3, -1] {
            let e = c.state_write(seq, Layout::Streams, 2, None).unwrap_err();
            assert!(e.to_string().contains("sequence 3 has no stream"), "{e}");
        }
        assert!(c.state_write(1, Layout::Streams, 2, None).is_ok());
        assert!(c.state_write(-1, Layout::Streams, 4, None).is_ok());
    }
}
