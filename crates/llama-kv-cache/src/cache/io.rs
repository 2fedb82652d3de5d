//! The unified cache's state I/O on whole payloads: planning and writing a payload of one
//! sequence or of the whole cache, and reading one back transactionally (parse and check
//! everything, place the cells, then write the rows; a failure puts everything back).

use crate::cache::rollback::CellsUndo;
use crate::cache::KvCache;
use crate::cells::ubatch::UBatch;
use crate::cells::SeqSet;
use crate::error::{KvError, Result};
use crate::ggml_type::GgmlType;
use crate::state::cells::{cell_len, put_cell, put_cell_one_id, CellExt, PayloadCells};
use crate::state::codec::recurrent_tails;
use crate::state::parts::PartRole;
use crate::state::rows::{write_columns, write_rows};
use crate::state::sink::{Sink, SliceSink, WriteSink};
use crate::state::source::Cursor;
use crate::state::{
    ambiguous, cell_count_header, check_meta, data_header, k_header, n_stream_header,
    no_layout_fits, parse_payload_form, v_header, Layout, ParsedPayload, VBlock,
};
use crate::tensors::storage::Tensor;

/// Reports progress as `(bytes done, bytes total)`; returning false asks to stop.
pub type Progress<'a> = &'a mut dyn FnMut(u64, u64) -> bool;

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

impl KvCache {
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
    /// [`KvCache::meta_size`] bytes long. Fixed-size cells go out as fixed-size chunks, which
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

    /// [`KvCache::state_write`] into the front of `out`, without allocating the payload; returns
    /// its size. Fails with `InvalidArg`, writing nothing, when `out` is smaller than
    /// [`KvCache::state_size`].
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

    /// [`KvCache::state_write`] streamed to `w` (host tensors are written straight from memory);
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
                let go_on = tick.as_mut().is_none_or(|p| p(done, total as u64));
                if go_on {
                    Ok(())
                } else {
                    Err(KvError::Aborted("state write aborted".into()))
                }
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

    /// Checks a parsed payload's data blocks against this cache's geometry.
    pub(crate) fn check_data(&self, p: &ParsedPayload) -> Result<()> {
        let total: usize = p.streams.iter().map(|s| s.cells.len()).sum();
        if total > self.params.size as usize {
            return Err(KvError::NoSpace(format!(
                "the payload holds {total} cells, the cache only {}",
                self.params.size
            )));
        }
        for (s, stream) in p.streams.iter().enumerate() {
            let Some(v_trans) = stream.v_trans else {
                continue;
            };
            if v_trans != self.v_trans() {
                return Err(KvError::InvalidState(format!(
                    "stream {s}: V is {}transposed in the payload but {}transposed in the cache",
                    if v_trans { "" } else { "not " },
                    if self.v_trans() { "" } else { "not " }
                )));
            }
            match stream.n_rot {
                Some((k, v)) if (k, v) != (self.params.n_rot_k, self.params.n_rot_v) => {
                    return Err(KvError::InvalidState(format!(
                        "stream {s}: rotation is n_rot_k {k} / n_rot_v {v} in the payload, {} / {} in the cache",
                        self.params.n_rot_k, self.params.n_rot_v
                    )));
                }
                None if self.params.n_rot_k != 0 || self.params.n_rot_v != 0 => {
                    return Err(KvError::InvalidState(format!(
                        "stream {s}: the {} layout records no rotation (its K/V are not rotated), the cache rotates K/V (n_rot_k {} / n_rot_v {})",
                        p.layout, self.params.n_rot_k, self.params.n_rot_v
                    )));
                }
                _ => {}
            }
            if stream.layers.len() != self.layers.len() {
                return Err(KvError::InvalidState(format!(
                    "stream {s}: the payload has {} layers, the cache {}",
                    stream.layers.len(),
                    self.layers.len()
                )));
            }
            for (il, (b, l)) in stream.layers.iter().zip(&self.layers).enumerate() {
                let type_name = |id: i32| {
                    GgmlType::from_id(id).map_or(format!("type id {id}"), |t| t.to_string())
                };
                if b.k_type != self.params.type_k.id() {
                    return Err(KvError::InvalidState(format!(
                        "layer {il}: K type is {} in the payload, {} in the cache",
                        type_name(b.k_type),
                        self.params.type_k
                    )));
                }
                if b.k_row_size != l.k_row as u64 {
                    return Err(KvError::InvalidState(format!(
                        "layer {il}: K row size is {} in the payload, {} in the cache",
                        b.k_row_size, l.k_row
                    )));
                }
                let (ty, ok, what) = match &b.v {
                    VBlock::Absent if self.params.no_v => continue,
                    VBlock::Absent => {
                        return Err(KvError::InvalidState(format!(
                            "layer {il}: the payload has no V (a cache without V, as multi-head \
                             latent attention keeps), this cache keeps V"
                        )))
                    }
                    _ if self.params.no_v => {
                        return Err(KvError::InvalidState(format!(
                            "layer {il}: the payload has V, this cache keeps none (noV)"
                        )))
                    }
                    VBlock::Rows { ty, row_size, .. } => (
                        *ty,
                        *row_size == l.v_row as u64,
                        format!("V row size {row_size} (cache {})", l.v_row),
                    ),
                    VBlock::Transposed {
                        ty,
                        el_size,
                        n_embd,
                        ..
                    } => (
                        *ty,
                        *el_size as usize == self.params.type_v.type_size()
                            && *n_embd as usize == l.n_embd_v,
                        format!(
                            "V element size {el_size} x {n_embd} (cache {} x {})",
                            self.params.type_v.type_size(),
                            l.n_embd_v
                        ),
                    ),
                };
                if ty != self.params.type_v.id() {
                    return Err(KvError::InvalidState(format!(
                        "layer {il}: V type is {} in the payload, {} in the cache",
                        type_name(ty),
                        self.params.type_v
                    )));
                }
                if !ok {
                    return Err(KvError::InvalidState(format!(
                        "layer {il}: mismatched {what}"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Validates a payload parsed structurally against this cache: cells (for one sequence
    /// when `seq` is given) and data blocks.
    pub fn check_payload(&self, p: &ParsedPayload, seq: Option<i32>) -> Result<()> {
        check_meta(p, seq, self.params.recurrent, self.params.n_seq_max)?;
        self.check_data(p)
    }

    /// Parses and validates `data` for this cache under every candidate layout; exactly one
    /// must fit.
    pub fn detect_payload(
        &self,
        data: &[u8],
        seq: Option<i32>,
        layout: Option<Layout>,
    ) -> Result<ParsedPayload> {
        let candidates: Vec<Layout> = match layout {
            Some(l) => vec![l],
            None => vec![Layout::Seed, Layout::Streams, Layout::StreamsRot],
        };
        self.detect_payload_among(data, seq, &candidates)
    }

    /// [`KvCache::detect_payload`] among the given layouts (a file's version allows only some).
    pub fn detect_payload_among(
        &self,
        data: &[u8],
        seq: Option<i32>,
        layouts: &[Layout],
    ) -> Result<ParsedPayload> {
        let mut candidates: Vec<Layout> = Vec::new();
        for &l in layouts {
            let l = self.effective_layout(l);
            if !candidates.contains(&l) {
                candidates.push(l);
            }
        }
        // streams first: the layout this cache writes by default; a rotated cache can only
        // read streams-rot, so that goes first there
        let rotated = self.params.n_rot_k != 0 || self.params.n_rot_v != 0;
        candidates.sort_by_key(|l| match (l, rotated) {
            (Layout::StreamsRot, true) | (Layout::Streams, false) => 0,
            (Layout::StreamsRot | Layout::Streams, _) => 1,
            (Layout::Seed, _) => 2,
        });
        let mut fits: Vec<ParsedPayload> = Vec::new();
        let mut errors = Vec::new();
        for l in candidates {
            // the twin of a layout that fits parses the same metadata: its first data header
            // decides it without a second parse of every cell
            if let Some(e) = fits.iter().find_map(|p| self.refute_twin(data, p, l)) {
                errors.push((l, e));
                continue;
            }
            let parse = |no_v| parse_payload_form(data, l, self.params.cell_ext, no_v, true);
            let attempt = parse(self.params.no_v)
                // a payload without V blocks where this cache keeps V (or the other way round)
                // parses only the other way: its check then names the difference
                .or_else(|e| parse(!self.params.no_v).map_err(|_| e))
                .and_then(|p| {
                    check_meta(&p, seq, self.params.recurrent, self.params.n_seq_max)?;
                    self.check_data(&p)?;
                    Ok(p)
                });
            match attempt {
                Ok(p) => fits.push(p),
                Err(e) => errors.push((l, e)),
            }
        }
        // a payload of empty streams has no data header: the streams and streams-rot layouts
        // read it the same, so it is not ambiguous
        if fits.len() == 2 && fits.iter().all(|p| p.has_no_data_header()) {
            fits.retain(|p| p.layout != Layout::StreamsRot);
        }
        match fits.len() {
            1 => Ok(fits.remove(0)),
            0 => Err(no_layout_fits(errors)),
            _ => Err(ambiguous(fits.iter().map(|p| p.layout))),
        }
    }

    /// Whether `twin`, the other of the streams and streams-rot layouts, certainly does not
    /// fit a payload that `fit` (one of them) parsed: both read the same cell metadata, so the
    /// first data header sits at the same offset under both, and `twin` fits only if it reads
    /// there what this cache requires (V layout, layer count, rotation, first K type and row
    /// size). `Some(error)` when refuted.
    fn refute_twin(&self, data: &[u8], fit: &ParsedPayload, twin: Layout) -> Option<KvError> {
        if !fit.layout.has_stream_prefix() || !twin.has_stream_prefix() || fit.layout == twin {
            return None;
        }
        let (s, first) = fit
            .streams
            .iter()
            .enumerate()
            .find(|(_, s)| !s.layers.is_empty())?;
        let header = if fit.layout.records_rotation() { 16 } else { 8 };
        let mut c = Cursor::new(data);
        c.pos = first.layers[0].k_data.start.checked_sub(12 + header)?;
        let mut fits = || -> Result<bool> {
            let v_trans = c.u32("v_trans")?;
            let n_layer = c.u32("n_layer")?;
            let rot = if twin.records_rotation() {
                (c.u32("n_rot_k")?, c.u32("n_rot_v")?)
            } else {
                (0, 0)
            };
            let (k_type, k_row) = (c.i32("k_type")?, c.u64("k_row_size")?);
            Ok(v_trans == self.v_trans() as u32
                && n_layer as usize == self.layers.len()
                && rot == (self.params.n_rot_k, self.params.n_rot_v)
                && k_type == self.params.type_k.id()
                && self.layers.first().is_some_and(|l| k_row == l.k_row as u64))
        };
        match fits() {
            Ok(true) => None,
            _ => Some(KvError::InvalidState(format!(
                "stream {s}: its data header does not fit this cache in the {twin} layout"
            ))),
        }
    }

    /// The seed's `state_read(seq)` (seq -1: the whole cache), transactional: the payload is
    /// parsed and validated completely and room is found before the cache changes; on any
    /// error the cache is exactly as before. `progress` may stop the read until data starts
    /// being written.
    pub fn state_read(
        &mut self,
        data: &[u8],
        seq: i32,
        opts: ReadOptions,
        progress: Option<Progress<'_>>,
    ) -> Result<ReadSummary> {
        if opts.part.is_some() {
            return self.state_read_part(data, seq, opts, progress);
        }
        let dest = self.read_dest(seq)?;
        let parsed = self.detect_payload(data, dest, opts.layout)?;
        self.apply_payload(data, &parsed, dest, opts, progress)
    }

    /// Applies a payload already validated by [`KvCache::detect_payload`] for `dest`.
    pub(crate) fn apply_payload(
        &mut self,
        data: &[u8],
        parsed: &ParsedPayload,
        dest: Option<i32>,
        opts: ReadOptions,
        progress: Option<Progress<'_>>,
    ) -> Result<ReadSummary> {
        self.apply_payload_with(data, parsed, dest, progress, |cache, cells| {
            cache.place_cells(cells, dest, opts.allow_scattered)
        })
    }

    /// [`KvCache::apply_payload`] with the cells placed by `place`, which returns the undo
    /// record that takes them back out and the cells it filled, in payload order (today's
    /// caches place by llama.cpp 0.1.161's rules, the seed's by its own).
    pub(crate) fn apply_payload_with(
        &mut self,
        data: &[u8],
        parsed: &ParsedPayload,
        dest: Option<i32>,
        progress: Option<Progress<'_>>,
        place: impl FnOnce(&mut KvCache, &PayloadCells) -> Result<(CellsUndo, Vec<usize>)>,
    ) -> Result<ReadSummary> {
        if let Some(p) = progress {
            if !p(0, data.len() as u64) {
                return Err(KvError::Aborted("state read aborted".into()));
            }
        }
        let cells = parsed.cells()?;
        let (undo, placed) = place(self, &cells)?;
        let backup = match self.backup_if_device() {
            Ok(b) => b,
            Err(e) => {
                self.roll_back(undo, &placed);
                return Err(e);
            }
        };
        // a whole-cache load leaves the rows past its cells zeroed, as llama.cpp's
        // clear-then-read does (after the backup, so that a failure can put them back)
        let zeroed = match dest {
            None => self.zero_rows_from(placed.len()),
            Some(_) => Ok(()),
        };
        if let Err(e) = zeroed.and_then(|()| self.write_payload_data(data, parsed, &placed)) {
            self.roll_back(undo, &placed);
            if let Some(b) = backup {
                self.restore_backup(b)?;
            }
            return Err(e);
        }
        self.commit(undo);
        Ok(ReadSummary {
            layout: parsed.layout,
            cells: placed.len() as u32,
            placed: placed.iter().map(|&c| c as u32).collect(),
        })
    }

    /// Places a payload's cells into `dest` (`None`: the whole cache) with the undo record
    /// that takes them back out; on failure the cells are as before.
    pub(crate) fn place_cells(
        &mut self,
        cells: &PayloadCells,
        dest: Option<i32>,
        allow_scattered: bool,
    ) -> Result<(CellsUndo, Vec<usize>)> {
        let undo = self.undo_record(dest);
        let placed = match dest {
            Some(d) => self.place_sequence(d, cells, allow_scattered),
            None => self.place_whole(cells),
        };
        match placed {
            Ok(p) => Ok((undo, p)),
            Err(e) => {
                self.roll_back(undo, &[]);
                Err(e)
            }
        }
    }

    pub(crate) fn place_sequence(
        &mut self,
        dest: i32,
        cells: &PayloadCells,
        allow_scattered: bool,
    ) -> Result<Vec<usize>> {
        // the rows stay: a load that fails puts the sequence's cells back
        self.seq_rm_keeping_data(dest, -1, -1)?;
        if cells.is_empty() {
            return Ok(Vec::new());
        }
        let n = cells.len();
        let ub = UBatch {
            pos: cells.positions().iter().map(|&p| p.max(0)).collect(),
            n_seq_tokens: n as u32,
            seq_ids: vec![vec![dest]],
            ext: cells.exts().to_vec(),
        };
        if self.params.recurrent {
            if n != 1 {
                return Err(KvError::InvalidState(format!(
                    "a recurrent sequence state has 1 cell, the payload has {n}"
                )));
            }
            let slot = self.find_slot(&ub)?.ok_or_else(|| {
                KvError::NoSpace(format!("no free state cell for sequence {dest}"))
            })?;
            let cell = slot.head as usize;
            self.cells.set_pos(cell, cells.positions()[0]);
            self.cells.set_src(cell, cell as i32);
            return Ok(vec![cell]);
        }
        if let Some(slot) = self.find_slot(&ub)? {
            return Ok((slot.head as usize..slot.head as usize + n).collect());
        }
        let free: Vec<usize> = (0..self.cells.len())
            .filter(|&i| self.cells.pos(i) < 0)
            .take(n)
            .collect();
        if !allow_scattered || free.len() < n {
            return Err(KvError::NoSpace(format!(
                "no {} run of {n} free cells for sequence {dest} ({} free)",
                if allow_scattered { "set" } else { "contiguous" },
                (0..self.cells.len())
                    .filter(|&i| self.cells.pos(i) < 0)
                    .count()
            )));
        }
        self.assign_cells(dest, cells, &free);
        Ok(free)
    }

    /// Gives the free cells `at` the payload's cells of sequence `dest`, in order.
    pub(crate) fn assign_cells(&mut self, dest: i32, cells: &PayloadCells, at: &[usize]) {
        for (k, &cell) in at.iter().enumerate() {
            self.cells.set_pos(cell, cells.positions()[k]);
            self.cells.insert_seq(cell, dest as usize);
            if let Some(&ext) = cells.exts().get(k) {
                self.cells.set_ext(cell, ext);
            }
        }
        self.cells.used += at.len() as u32;
        self.cells.settle();
    }

    pub(crate) fn place_whole(&mut self, cells: &PayloadCells) -> Result<Vec<usize>> {
        let recurrent = self.params.recurrent;
        let tails = if recurrent {
            recurrent_tails(cells, self.cells.len())?
        } else {
            Vec::new()
        };
        self.cells.reset();
        self.head = 0;
        self.cells
            .fill_free(0, cells.positions(), |k| cells.seq_ids(k));
        for (i, &ext) in cells.exts().iter().enumerate() {
            self.cells.set_ext(i, ext);
        }
        if recurrent {
            for i in 0..cells.len() {
                self.cells.set_src(i, i as i32);
            }
            for (seq, &t) in tails.iter().enumerate() {
                self.cells.set_tail(seq, t);
            }
        }
        self.cells.used = cells.len() as u32;
        self.cells.settle();
        Ok((0..cells.len()).collect())
    }

    /// Zeroes the K/V data of cells `first..` (a whole-cache load then writes cells
    /// `..first`, so the tensors end up as llama.cpp's clear-then-read leaves them, without
    /// writing every byte twice). Device buffers are cleared whole.
    pub(crate) fn zero_rows_from(&mut self, first: usize) -> Result<()> {
        let size = self.params.size as usize;
        let v_trans = self.v_trans();
        let v_el = self.params.type_v.type_size();
        for l in &mut self.layers {
            match l.k.as_host_mut() {
                Some(bytes) => bytes[first * l.k_row..].fill(0),
                None => l.k.fill_zero()?,
            }
            match l.v.as_host_mut() {
                Some(bytes) if v_trans => {
                    for row in bytes.chunks_exact_mut(size * v_el) {
                        row[first * v_el..].fill(0);
                    }
                }
                Some(bytes) => bytes[first * l.v_row..].fill(0),
                None => l.v.fill_zero()?,
            }
        }
        Ok(())
    }

    fn write_payload_data(
        &mut self,
        data: &[u8],
        parsed: &ParsedPayload,
        placed: &[usize],
    ) -> Result<()> {
        let lay = self.layout();
        let mut offset = 0;
        for stream in &parsed.streams {
            let n = stream.cells.len();
            let cells = &placed[offset..offset + n];
            offset += n;
            if n == 0 {
                continue;
            }
            let contiguous = cells.windows(2).all(|w| w[1] == w[0] + 1);
            for (l, b) in self.layers.iter_mut().zip(&stream.layers) {
                let k = &data[b.k_data.clone()];
                write_rows(l.k.as_mut(), l.k_row, cells, contiguous, 0, k)?;
                match &b.v {
                    VBlock::Rows { data: r, .. } => {
                        write_rows(
                            l.v.as_mut(),
                            l.v_row,
                            cells,
                            contiguous,
                            0,
                            &data[r.clone()],
                        )?;
                    }
                    VBlock::Transposed { data: r, .. } => {
                        let v = &data[r.clone()];
                        write_columns(l.v.as_mut(), (lay.v_el, lay.size), cells, contiguous, 0, v)?;
                    }
                    VBlock::Absent => {}
                }
            }
        }
        Ok(())
    }

    fn backup_if_device(&self) -> Result<Option<Vec<TensorBackup>>> {
        let on_device = self
            .layers
            .iter()
            .any(|l| l.k.as_host().is_none() || l.v.as_host().is_none());
        if !on_device {
            return Ok(None);
        }
        let mut out = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            let mut k = crate::alloc::zeroed(l.k.len(), "the K backup")?;
            let mut v = crate::alloc::zeroed(l.v.len(), "the V backup")?;
            l.k.read(0, &mut k)?;
            l.v.read(0, &mut v)?;
            out.push((k, v));
        }
        Ok(Some(out))
    }

    fn restore_backup(&mut self, backup: Vec<TensorBackup>) -> Result<()> {
        for (l, (k, v)) in self.layers.iter_mut().zip(backup) {
            l.k.write(0, &k)?;
            l.v.write(0, &v)?;
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

/// A layer's K and V bytes, kept while a load writes to device memory.
type TensorBackup = (Vec<u8>, Vec<u8>);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::parse_payload;
    use crate::{CacheParams, ReadOptions};

    fn cache(n_rot: u32, type_k: GgmlType) -> KvCache {
        let mut p = CacheParams::new(32, 2, 64, 64);
        p.n_seq_max = 2;
        p.flash_attn = true;
        p.type_k = type_k;
        p.type_v = type_k;
        (p.n_rot_k, p.n_rot_v) = (n_rot, n_rot);
        let mut c = KvCache::new(p).unwrap();
        c.find_slot(&UBatch::sequence(0, 0, 5)).unwrap();
        c.find_slot(&UBatch::sequence(1, 0, 3)).unwrap();
        c
    }

    /// Whether `layout` reads `data` for `c` (the full parse and checks).
    fn reads(c: &KvCache, data: &[u8], layout: Layout) -> bool {
        parse_payload(data, layout, true)
            .and_then(|p| c.check_payload(&p, None))
            .is_ok()
    }

    #[test]
    fn regression_a_sequence_past_the_last_stream_was_written_nowhere() {
        // found by the damaged-dsv4 test: a conversion wrote a sequence file's sequence 3 in a
        // payload of 2 streams, which held no cell at all; a whole state lost sequence 3 alike
        let mut p = CacheParams::new(32, 2, 64, 64);
        p.n_seq_max = 4;
        let mut c = KvCache::new(p).unwrap();
        c.find_slot(&UBatch::sequence(1, 0, 2)).unwrap();
        c.find_slot(&UBatch::sequence(3, 0, 3)).unwrap();
        for seq in [3, -1] {
            let e = c.state_write(seq, Layout::Streams, 2, None).unwrap_err();
            assert!(e.to_string().contains("sequence 3 has no stream"), "{e}");
        }
        assert!(c.state_write(1, Layout::Streams, 2, None).is_ok());
        assert!(c.state_write(-1, Layout::Streams, 4, None).is_ok());
    }

    #[test]
    fn a_twin_layout_is_refuted_only_when_its_full_parse_would_fail() {
        let mut rng = 0x2545_f491u32;
        let mut refuted = 0;
        for (n_rot, ty) in [
            (0, GgmlType::F16),
            (0, GgmlType::Q8_0),
            (64, GgmlType::Q8_0),
        ] {
            let c = cache(n_rot, ty);
            for written in [Layout::Streams, Layout::StreamsRot] {
                let Ok(data) = c.state_write(-1, written, 1, None) else {
                    continue;
                };
                assert_eq!(
                    c.detect_payload(&data, None, None).unwrap().layout,
                    written,
                    "detected as written"
                );
                let fit = parse_payload(&data[..], written, true).unwrap();
                let twin = match written {
                    Layout::Streams => Layout::StreamsRot,
                    _ => Layout::Streams,
                };
                // mutate the first data header: the refutation must agree with a full parse
                let start = fit.streams[0].layers[0].k_data.start;
                for _ in 0..300 {
                    let mut bytes = data.clone();
                    rng ^= rng << 13;
                    rng ^= rng >> 17;
                    rng ^= rng << 5;
                    let at = start - 28 + (rng as usize % 28);
                    bytes[at] = (rng >> 8) as u8 & 0x41;
                    let Ok(fit) = parse_payload(&bytes[..], written, true) else {
                        continue;
                    };
                    if c.refute_twin(&bytes, &fit, twin).is_some() {
                        refuted += 1;
                        assert!(!reads(&c, &bytes, twin), "refuted a twin that reads");
                    }
                }
            }
        }
        assert!(refuted > 100, "{refuted} refutations");
        // a detected whole-cache read still loads what was written
        let mut c = cache(0, GgmlType::F16);
        let data = c.state_write(-1, Layout::Streams, 1, None).unwrap();
        let r = c
            .state_read(&data, -1, ReadOptions::default(), None)
            .unwrap();
        assert_eq!((r.layout, r.cells), (Layout::Streams, 8));
    }
}
