//! llama.cpp 0.1.161's attention cache (`llama_kv_cache`): the seed's cells and tensors, one
//! [`SeedCache`] per stream, placed and managed by today's rules.
//!
//! What differs from the seed:
//! - **Placement** takes cells one by one from the stream's head (`find_slot` with
//!   `cont = false`), not a contiguous run; a cell of a sliding-window cache is also free for
//!   the taking when the window of its sequence's next token no longer sees it.
//! - **Purge**: a placement that overwrites such a cell removes every older position of that
//!   sequence too, so that each sequence's positions stay one unbroken range.
//! - **Streams**: a context that is not unified gives every sequence a stream of its own
//!   (cells, head and tensors); a `seqCp` across streams copies the whole stream.
//! - **Heads and flags**: a `seqCp` within a stream leaves the head where it is, `clear`
//!   forgets pending shifts, positions of a sequence without cells read -1, and there is no
//!   defrag (0.1.161 removed it: placement does not need contiguous runs).

use std::borrow::Cow;

use crate::cache::io::{ReadOptions, ReadSummary, WritePlan};
use crate::cache::kshift::UpdateReport;
use crate::cache::rollback::CellsUndo;
use crate::cache::slot::no_cell_ext;
use crate::cache::SeedCache;
use crate::cells::ubatch::UBatch;
use crate::cells::Cell;
use crate::error::{KvError, Result};
use crate::memory::parts_payload::CheckedPayload;
use crate::memory::placement::{
    find_cells, head_after_rm, put_tokens, touched_by, StreamSlot, Window,
};
use crate::memory::SwaType;
use crate::params::CacheParams;
use crate::state::codec::parse_layerless_payload;
use crate::state::{n_stream_header, parse_payload_form, Layout, ParsedPayload};
use crate::tensors::rope::ShiftParams;
use crate::tensors::storage::Tensor;

/// A payload parsed and checked against the cache (`AttentionCache::check_read`).
pub(crate) struct CheckedRead {
    parsed: ParsedPayload,
    /// Of a sequence read whose payload holds cells in one stream: the cells they take.
    found: Option<Vec<u32>>,
}

impl CheckedRead {
    /// Bytes of the payload.
    pub(crate) fn len(&self) -> usize {
        self.parsed.len
    }
}

impl CheckedPayload for CheckedRead {
    fn layout(&self) -> Layout {
        self.parsed.layout
    }

    fn has_no_data_header(&self) -> bool {
        self.parsed.has_no_data_header()
    }
}

/// Stream `k` of `parsed` as a payload of its own.
fn one_stream(parsed: &ParsedPayload, k: usize) -> Cow<'_, ParsedPayload> {
    // a payload of one stream is its own (a copy of its cell columns was a tenth of a read)
    if parsed.streams.len() == 1 {
        return Cow::Borrowed(parsed);
    }
    Cow::Owned(ParsedPayload {
        layout: parsed.layout,
        streams: vec![parsed.streams[k].clone()],
        len: parsed.len,
        ext: parsed.ext,
    })
}

/// The cells a placement changed, as they were (per slot: stream, head, `used`, cells), to put
/// back when a later ubatch of the same decode does not fit.
#[derive(Default)]
pub(crate) struct Snapshot(Vec<SlotUndo>);

/// One slot's record in a [`Snapshot`].
struct SlotUndo {
    stream: usize,
    head: u32,
    used: u32,
    cells: Vec<(usize, Cell)>,
}

/// llama.cpp 0.1.161's `llama_kv_cache`.
pub struct AttentionCache {
    streams: Vec<SeedCache>,
    window: Window,
}

impl AttentionCache {
    /// A cache of `params.size` cells per stream: one stream when `unified`, else one per
    /// sequence (`params.n_seq_max`).
    pub fn new(params: CacheParams, unified: bool, window: Window) -> Result<AttentionCache> {
        if params.recurrent {
            return Err(KvError::InvalidArg(
                "an attention cache cannot be recurrent (a recurrent memory is its own kind)"
                    .into(),
            ));
        }
        let n_stream = stream_count(&params, unified);
        let mut streams = crate::alloc::with_capacity(n_stream as usize, "the streams")?;
        for _ in 0..n_stream {
            streams.push(SeedCache::new_part(params.clone())?);
        }
        Ok(AttentionCache { streams, window })
    }

    /// The parameters of every stream.
    pub fn params(&self) -> &CacheParams {
        self.streams[0].params()
    }

    /// Cells per stream.
    pub fn size(&self) -> u32 {
        self.params().size
    }

    /// Number of streams (1 when unified).
    pub fn n_stream(&self) -> u32 {
        self.streams.len() as u32
    }

    /// The window.
    pub fn window(&self) -> Window {
        self.window
    }

    /// Stream `s`.
    pub fn stream(&self, s: u32) -> Result<&SeedCache> {
        self.streams.get(s as usize).ok_or_else(|| {
            KvError::OutOfRange(format!(
                "stream {s} is out of range [0, {})",
                self.streams.len()
            ))
        })
    }

    /// Stream `s`, to write its rows.
    pub fn stream_mut(&mut self, s: u32) -> Result<&mut SeedCache> {
        let n = self.streams.len();
        self.streams
            .get_mut(s as usize)
            .ok_or_else(|| KvError::OutOfRange(format!("stream {s} is out of range [0, {n})")))
    }

    /// Every stream, to change.
    pub(crate) fn streams_mut(&mut self) -> Vec<&mut SeedCache> {
        self.streams.iter_mut().collect()
    }

    /// The stream of sequence `seq`, checked.
    pub fn stream_of(&self, what: &str, seq: i32) -> Result<usize> {
        let s = self.streams[0].check_seq(what, seq)?;
        Ok(if self.streams.len() == 1 { 0 } else { s })
    }

    /// Cells with a position, over all streams.
    pub fn used_cells(&self) -> u32 {
        self.streams.iter().map(|s| s.cells.occupied_count()).sum()
    }

    /// Bytes of the K and V tensors of every stream.
    pub fn total_size(&self) -> usize {
        self.streams.iter().map(SeedCache::total_size).sum()
    }

    /// Whether a K-shift is pending in some stream.
    pub fn has_shift(&self) -> bool {
        self.streams.iter().any(|s| s.has_shift)
    }

    /// Whether the positions can be shifted (not for M-RoPE caches).
    pub fn can_shift(&self) -> bool {
        self.streams[0].can_shift()
    }

    /// The tokens of `ub` per stream, in 0.1.161's ubatch order: all of them in one stream,
    /// or (one stream per sequence) the same number of tokens for each sequence, each token
    /// of exactly one sequence, as `split_equal` makes them.
    fn groups(&self, ub: &UBatch) -> Result<Vec<(usize, Vec<usize>)>> {
        ub.validate(self.params().n_seq_max)?;
        if !ub.ext.is_empty() && self.params().cell_ext.is_none() {
            return Err(no_cell_ext());
        }
        let n = ub.pos.len();
        if self.streams.len() == 1 {
            return Ok(vec![(0, (0..n).collect())]);
        }
        let mut groups: Vec<(usize, Vec<usize>)> = Vec::new();
        for k in 0..n {
            let ids = &ub.seq_ids[k / ub.n_seq_tokens as usize];
            let &[seq] = ids.as_slice() else {
                return Err(KvError::InvalidArg(format!(
                    "token {k} of the ubatch belongs to {} sequences; a cache of one stream per \
                     sequence takes tokens of one sequence each",
                    ids.len()
                )));
            };
            match groups.iter_mut().find(|(s, _)| *s == seq as usize) {
                Some((_, tokens)) => tokens.push(k),
                None => groups.push((seq as usize, vec![k])),
            }
        }
        if groups.iter().any(|(_, t)| t.len() != groups[0].1.len()) {
            return Err(KvError::InvalidArg(
                "a cache of one stream per sequence takes ubatches with the same number of \
                 tokens for each sequence (split_equal)"
                    .into(),
            ));
        }
        Ok(groups)
    }

    /// 0.1.161's `find_slot(ubatch, cont = false)`: the cells the tokens of `ub` would take,
    /// or `None` when some stream has too few; the cache is not changed.
    pub fn find_slot(&self, ub: &UBatch) -> Result<Option<Vec<StreamSlot>>> {
        let mut out = Vec::new();
        for (stream, tokens) in self.groups(ub)? {
            let cache = &self.streams[stream];
            let Some(cells) = find_cells(&cache.cells, cache.head, tokens.len(), self.window, None)
            else {
                return Ok(None);
            };
            out.push(StreamSlot {
                stream: stream as u32,
                cells,
                tokens,
            });
        }
        Ok(Some(out))
    }

    /// Places the ubatches of one decode, one after the other, as 0.1.161's `prepare` and
    /// the context's `apply` do: all of them, or (`None`, an ordinary outcome) none, with the
    /// cells as before.
    pub fn place(&mut self, ubatches: &[UBatch]) -> Result<Option<Vec<Vec<StreamSlot>>>> {
        let mut undo = Snapshot::default();
        let placed = self.place_each(ubatches, &mut undo);
        if !matches!(placed, Ok(Some(_))) {
            self.restore(undo);
        }
        placed
    }

    /// Puts back the cells a [`Snapshot`] recorded, newest first.
    pub(crate) fn restore(&mut self, snapshot: Snapshot) {
        for undo in snapshot.0.into_iter().rev() {
            let cache = &mut self.streams[undo.stream];
            for (i, cell) in undo.cells {
                cache.cells.set_cell(i, cell);
            }
            cache.cells.used = undo.used;
            cache.cells.settle();
            cache.head = undo.head;
        }
    }

    /// Finds and applies each ubatch in turn, recording in `undo` every cell it changes (as
    /// 0.1.161's `prepare` keeps the cells of each slot: a copy of the whole table per decode
    /// cost more than placing a token); stops at the first that does not fit (`None`), leaving
    /// the ones before it placed.
    pub(crate) fn place_each(
        &mut self,
        ubatches: &[UBatch],
        undo: &mut Snapshot,
    ) -> Result<Option<Vec<Vec<StreamSlot>>>> {
        let mut out = Vec::with_capacity(ubatches.len());
        for ub in ubatches {
            let Some(slots) = self.find_slot(ub)? else {
                return Ok(None);
            };
            for slot in &slots {
                let cache = &self.streams[slot.stream as usize];
                let touched = touched_by(&cache.cells, &slot.cells);
                undo.0.push(SlotUndo {
                    stream: slot.stream as usize,
                    head: cache.head,
                    used: cache.cells.used,
                    cells: touched
                        .into_iter()
                        .map(|i| (i, cache.cells.get(i)))
                        .collect(),
                });
            }
            self.apply(&slots, ub)?;
            out.push(slots);
        }
        Ok(Some(out))
    }

    /// 0.1.161's `apply_ubatch`: writes the tokens into their cells, purges the older
    /// positions of every sequence whose cells it overwrote, and moves each stream's head
    /// past its last cell.
    fn apply(&mut self, slots: &[StreamSlot], ub: &UBatch) -> Result<()> {
        for slot in slots {
            let cache = &mut self.streams[slot.stream as usize];
            let overwritten = put_tokens(cache, slot, ub);
            for (seq, max) in overwritten {
                if let Some(min) = cache.cells.seq_pos_min(seq) {
                    if min <= max {
                        // keeping the rows: a failed decode puts these cells back
                        cache.seq_rm_keeping_data(seq as i32, min, max + 1)?;
                    }
                }
            }
        }
        for slot in slots {
            if let Some(&last) = slot.cells.last() {
                self.streams[slot.stream as usize].head = last + 1;
            }
        }
        Ok(())
    }

    /// Removes `seq` (-1: every sequence) from positions `[p0, p1)`.
    pub fn seq_rm(&mut self, seq: i32, p0: i32, p1: i32) -> Result<bool> {
        if seq == -1 {
            for s in &mut self.streams {
                s.seq_rm(-1, p0, p1)?;
            }
        } else {
            let s = self.stream_of("seqRm", seq)?;
            self.streams[s].seq_rm(seq, p0, p1)?;
        }
        Ok(true)
    }

    /// Adds `dst` to the cells of `src` in `[p0, p1)`. Across streams only whole sequences
    /// copy, as in 0.1.161: the destination stream becomes a copy of the source's cells of
    /// `src` (renamed `dst`) and of its rows (0.1.161 copies the rows at its next update;
    /// this copies them at once).
    pub fn seq_cp(&mut self, src: i32, dst: i32, p0: i32, p1: i32) -> Result<()> {
        let s0 = self.stream_of("seqCp source", src)?;
        let s1 = self.stream_of("seqCp destination", dst)?;
        if s0 == s1 {
            let cache = &mut self.streams[s0];
            let head = cache.head;
            cache.seq_cp(src, dst, p0, p1)?;
            cache.head = head;
            return Ok(());
        }
        let size = self.size() as i32;
        let partial = |p: i32| p > 0 && p + 1 < size;
        if partial(p0) || partial(p1) {
            return Err(KvError::Unsupported(format!(
                "seqCp [{p0}, {p1}) between sequences of different streams: only whole \
                 sequences copy across streams (llama.cpp 0.1.161 too)"
            )));
        }
        self.copy_stream(s0, s1, src as usize, dst as usize)
    }

    fn copy_stream(&mut self, s0: usize, s1: usize, src: usize, dst: usize) -> Result<()> {
        let from = &self.streams[s0];
        let cells: Vec<usize> = from.cells.cells_of(src).collect();
        let meta: Vec<_> = cells
            .iter()
            .map(|&i| (i, from.cells.pos(i), from.cells.delta(i), from.cells.ext(i)))
            .collect();
        let head = from.head;
        let size = from.size();
        let mut rows = Vec::new();
        for il in 0..from.n_layer() {
            for which in [Tensor::K, Tensor::V] {
                rows.push((il, which, from.read_rows(il, which, 0, size)?));
            }
        }
        let keeps_ext = from.cells.keeps_ext();
        let to = &mut self.streams[s1];
        for (il, which, bytes) in rows {
            to.write_rows(il, which, 0, &bytes)?;
        }
        to.cells.reset();
        to.cells.clear_deltas();
        to.has_shift = false;
        for (i, pos, delta, ext) in meta {
            to.cells.set_pos(i, pos);
            to.cells.insert_seq(i, dst);
            if delta != 0 {
                to.cells.set_delta(i, delta);
                to.has_shift = true;
            }
            if keeps_ext {
                to.cells.set_ext(i, ext);
            }
        }
        to.cells.used = cells.len() as u32;
        to.cells.settle();
        to.head = head;
        Ok(())
    }

    /// Frees every cell of `seq`'s stream that does not hold `seq`, and removes the other
    /// sequences from the rest (other streams are left alone, as in 0.1.161).
    pub fn seq_keep(&mut self, seq: i32) -> Result<()> {
        let s = self.stream_of("seqKeep", seq)?;
        let cache = &mut self.streams[s];
        // the head goes back only to the first cell this frees (the seed's: to the first
        // cell without `seq`, free ones included)
        let first_freed = (0..cache.cells.len()).find(|&i| {
            let seqs = cache.cells.seqs(i);
            !seqs.is_empty() && !seqs.contains(seq as usize)
        });
        let head = cache.head;
        cache.seq_keep(seq)?;
        cache.head = first_freed.map_or(head, |f| head.min(f as u32));
        Ok(())
    }

    /// Adds `delta` to the positions of `seq` in `[p0, p1)`, for the next K-shift.
    pub fn seq_add(&mut self, seq: i32, p0: i32, p1: i32, delta: i32) -> Result<()> {
        let s = self.stream_of("seqAdd", seq)?;
        self.streams[s].seq_add(seq, p0, p1, delta)
    }

    /// Divides the positions of `seq` in `[p0, p1)` by `d`, for the next K-shift. 0.1.161
    /// records the change with the opposite sign of the seed's and of `seq_add` (old minus
    /// new position); the K-shift rotates by what is recorded, so this records it the same.
    pub fn seq_div(&mut self, seq: i32, p0: i32, p1: i32, d: i32) -> Result<()> {
        let s = self.stream_of("seqDiv", seq)?;
        let cache = &mut self.streams[s];
        let before: Vec<(usize, i32, i32)> = cache
            .cells
            .cells_of(seq as usize)
            .map(|i| (i, cache.cells.pos(i), cache.cells.delta(i)))
            .collect();
        cache.seq_div(seq, p0, p1, d)?;
        for (i, pos, delta) in before {
            let now = cache.cells.pos(i);
            if now != pos {
                cache.cells.set_delta(i, delta + (pos - now));
            }
        }
        Ok(())
    }

    /// Smallest position of `seq`, -1 when it has no cell.
    pub fn seq_pos_min(&self, seq: i32) -> Result<i32> {
        let s = self.stream_of("seqPosMin", seq)?;
        Ok(self.streams[s]
            .cells
            .seq_pos_min(seq as usize)
            .unwrap_or(-1))
    }

    /// Largest position of `seq`, -1 when it has no cell.
    pub fn seq_pos_max(&self, seq: i32) -> Result<i32> {
        let s = self.stream_of("seqPosMax", seq)?;
        Ok(self.streams[s]
            .cells
            .seq_pos_max(seq as usize)
            .unwrap_or(-1))
    }

    /// Frees every cell of every stream, zeroes the tensors and forgets pending shifts.
    pub fn clear(&mut self) -> Result<()> {
        for s in &mut self.streams {
            s.clear()?;
            s.cells.clear_deltas();
            s.has_shift = false;
        }
        Ok(())
    }

    /// Marks a pending K-shift done without rotating anything: for a model whose K carries
    /// no position (no RoPE), which 0.1.161 "shifts" by clearing the recorded shifts.
    pub(crate) fn drop_shift(&mut self) {
        for s in &mut self.streams {
            s.cells.clear_deltas();
            s.has_shift = false;
        }
    }

    /// Applies a pending K-shift of every stream (`shift` `None`: reports it pending).
    pub fn update(&mut self, shift: Option<&ShiftParams>) -> Result<UpdateReport> {
        let mut report = UpdateReport::default();
        for s in &mut self.streams {
            let r = s.update(shift, None)?;
            report.shifted_cells = report.shifted_cells.max(r.shifted_cells);
            report.shift_pending |= r.shift_pending;
        }
        Ok(report)
    }

    /// The state of `seq` (-1: every sequence) as 0.1.161 writes it in `layout`: the stream
    /// count, then each stream's cells and rows (a stream without cells of `seq`: its count,
    /// 0). A sequence's cells that its window no longer sees stay out.
    pub fn state_write(&self, seq: i32, layout: Layout) -> Result<Vec<u8>> {
        let plans = self.stream_plans(seq, layout)?;
        let mut out = n_stream_header(self.streams.len() as u32).to_vec();
        for (cache, plan) in self.streams.iter().zip(&plans) {
            let mut body = Vec::new();
            cache.write_planned(&mut body, plan, None)?;
            // each stream's own payload starts with its stream count, 1
            out.extend_from_slice(&body[n_stream_header(1).len()..]);
        }
        Ok(out)
    }

    /// Bytes of [`AttentionCache::state_write`]`(seq, layout)`, without writing them.
    pub fn state_size(&self, seq: i32, layout: Layout) -> Result<usize> {
        let header = n_stream_header(1).len();
        let plans = self.stream_plans(seq, layout)?;
        Ok(header + plans.iter().map(|p| p.total - header).sum::<usize>())
    }

    /// Each stream's plan of a write of `seq` (-1: every sequence): its cells, or none.
    fn stream_plans(&self, seq: i32, layout: Layout) -> Result<Vec<WritePlan>> {
        let own = match seq {
            -1 => None,
            seq => Some(self.stream_of("stateWrite", seq)?),
        };
        self.streams
            .iter()
            .enumerate()
            .map(|(s, cache)| {
                let runs = match own {
                    None => cache.cells.nonempty_runs(),
                    Some(o) if o == s => self.visible_runs(cache, seq as usize),
                    Some(_) => Vec::new(),
                };
                cache.plan_of_ranges(seq, layout, vec![runs])
            })
            .collect()
    }

    /// The runs of cells (`begin..end`) of `seq` that its window still sees from its last
    /// position.
    fn visible_runs(&self, cache: &SeedCache, seq: usize) -> Vec<(usize, usize)> {
        let runs = cache.cells.runs_of(seq);
        if self.window.swa_type == SwaType::None {
            return runs;
        }
        let last = cache.cells.seq_pos_max(seq).unwrap_or(0);
        let mut out: Vec<(usize, usize)> = Vec::new();
        for (begin, end) in runs {
            for i in begin..end {
                if self.window.masks(cache.cells.pos(i), last) {
                    continue;
                }
                match out.last_mut() {
                    Some((_, e)) if *e == i => *e += 1,
                    _ => out.push((i, i + 1)),
                }
            }
        }
        out
    }

    /// Reads a payload written by [`AttentionCache::state_write`] (or by 0.1.161) into `seq`
    /// (-1: every stream), checking all of it before the cache changes. A sequence payload
    /// goes to the sequence's stream, whichever of its streams holds the cells.
    pub fn state_read(&mut self, data: &[u8], seq: i32, layout: Layout) -> Result<ReadSummary> {
        let checked = self.check_read(data, seq, layout, true)?;
        self.apply_read(data, checked, seq)
    }

    /// Applies a read [`AttentionCache::check_read`] accepted, the cache unchanged since.
    pub(crate) fn apply_read(
        &mut self,
        data: &[u8],
        checked: CheckedRead,
        seq: i32,
    ) -> Result<ReadSummary> {
        let CheckedRead { parsed, mut found } = checked;
        if seq == -1 {
            return self.read_whole(data, &parsed);
        }
        let s = self.stream_of("stateRead", seq)?;
        let mut summary = ReadSummary {
            layout: parsed.layout,
            cells: 0,
            placed: Vec::new(),
        };
        for k in 0..parsed.streams.len() {
            let one = one_stream(&parsed, k);
            let r = read_sequence(
                &mut self.streams[s],
                data,
                &one,
                seq,
                self.window,
                found.take(),
            )?;
            summary.cells += r.cells;
            match summary.placed.is_empty() {
                true => summary.placed = r.placed,
                false => summary.placed.extend(r.placed),
            }
        }
        Ok(summary)
    }

    /// Parses `data` (`exact`: as the whole of it) and checks it against every stream it goes
    /// to, room included, without changing the cache.
    pub(crate) fn check_read(
        &self,
        data: &[u8],
        seq: i32,
        layout: Layout,
        exact: bool,
    ) -> Result<CheckedRead> {
        let ext = self.params().cell_ext;
        // a cache of no layer reads only payloads of no layer (0.1.161 writes them so)
        let parsed = if self.params().n_layer == 0 {
            parse_layerless_payload(data, layout, ext, exact)?
        } else {
            parse_payload_form(data, layout, ext, self.params().no_v, exact)?
        };
        let want = self.streams.len();
        if parsed.streams.len() != want {
            return Err(KvError::InvalidState(format!(
                "the payload has {} streams, this cache reads {want} (n_stream mismatch)",
                parsed.streams.len()
            )));
        }
        let holding = parsed
            .streams
            .iter()
            .filter(|s| !s.cells.is_empty())
            .count();
        let mut found = None;
        for (k, stream) in parsed.streams.iter().enumerate() {
            if seq != -1 && stream.cells.is_empty() {
                continue;
            }
            let s = if seq == -1 {
                k
            } else {
                self.stream_of("stateRead", seq)?
            };
            let dest = (seq != -1).then_some(seq);
            self.streams[s].check_payload(&one_stream(&parsed, k), dest)?;
            if stream.cells.len() > self.size() as usize {
                return Err(KvError::NoSpace(format!(
                    "stream {k} of the payload has {} cells, the cache {}",
                    stream.cells.len(),
                    self.size()
                )));
            }
            if seq != -1 {
                let cells = self.room_for(s, seq, stream.cells.len()).ok_or_else(|| {
                    KvError::NoSpace(format!(
                        "no {} free cells for sequence {seq} (stream {s})",
                        stream.cells.len()
                    ))
                })?;
                // the one stream with cells is placed where found now; with several, each
                // is found as it is read
                if holding == 1 {
                    found = Some(cells);
                }
            }
        }
        Ok(CheckedRead { parsed, found })
    }

    /// The cells `n` cells of sequence `seq` take in stream `s` once the sequence's own are
    /// freed, as a sequence read places them, found without changing the cache, so that a read
    /// that would not fit is refused before anything changes (0.1.161 would have removed the
    /// sequence by then).
    fn room_for(&self, s: usize, seq: i32, n: usize) -> Option<Vec<u32>> {
        let cache = &self.streams[s];
        let gone = seq as usize;
        find_cells(
            &cache.cells,
            head_after_rm(cache, gone),
            n,
            self.window,
            Some(gone),
        )
    }

    /// A whole-cache read: every stream cleared, then given its cells from cell 0.
    fn read_whole(&mut self, data: &[u8], parsed: &ParsedPayload) -> Result<ReadSummary> {
        let mut placed = Vec::new();
        for s in 0..parsed.streams.len() {
            let one = one_stream(parsed, s);
            let cache = &mut self.streams[s];
            let r = cache.apply_payload(data, &one, None, ReadOptions::default(), None)?;
            cache.cells.clear_deltas();
            cache.has_shift = false;
            placed.extend(r.placed);
        }
        Ok(ReadSummary {
            layout: parsed.layout,
            cells: placed.len() as u32,
            placed,
        })
    }
}

/// A sequence read into one stream, placed as 0.1.161's `state_read_meta` does: the
/// sequence removed, then its cells found and applied as a ubatch (window and purge
/// included). A payload without cells changes nothing, as in 0.1.161.
fn read_sequence(
    cache: &mut SeedCache,
    data: &[u8],
    parsed: &ParsedPayload,
    seq: i32,
    window: Window,
    found: Option<Vec<u32>>,
) -> Result<ReadSummary> {
    if parsed.streams[0].cells.is_empty() {
        return Ok(ReadSummary {
            layout: parsed.layout,
            cells: 0,
            placed: Vec::new(),
        });
    }
    cache.apply_payload_with(data, parsed, Some(seq), None, |cache, cells| {
        let ub = UBatch {
            pos: cells.positions().to_vec(),
            n_seq_tokens: cells.len() as u32,
            seq_ids: vec![vec![seq]],
            ext: cells.exts().to_vec(),
        };
        // the cells the read will take, found as if the sequence were already removed, before
        // anything changes; nothing fails after they change, so no undo record is kept (see
        // `CellsUndo::Unrecorded`)
        let gone = seq as usize;
        let found = match found {
            Some(found) => found,
            None => find_cells(
                &cache.cells,
                head_after_rm(cache, gone),
                cells.len(),
                window,
                Some(gone),
            )
            .ok_or_else(|| {
                KvError::NoSpace(format!("no {} free cells for sequence {seq}", cells.len()))
            })?,
        };
        cache.seq_rm_keeping_data(seq, -1, -1)?;
        let slot = StreamSlot {
            stream: 0,
            cells: found,
            tokens: (0..cells.len()).collect(),
        };
        for (s, max) in put_tokens(cache, &slot, &ub) {
            if let Some(min) = cache.cells.seq_pos_min(s) {
                if min <= max {
                    cache.seq_rm_keeping_data(s as i32, min, max + 1)?;
                }
            }
        }
        cache.head = slot.cells.last().map_or(cache.head, |&c| c + 1);
        let placed = slot.cells.iter().map(|&c| c as usize).collect();
        Ok((CellsUndo::Unrecorded, placed))
    })
}

/// Streams of an attention cache of `params`: one when unified, else one per sequence.
pub(crate) fn stream_count(params: &CacheParams, unified: bool) -> u32 {
    if unified {
        1
    } else {
        params.n_seq_max
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cells::Cells;
    use crate::memory::placement::free_run;

    fn cache(size: u32, n_seq: u32, unified: bool, window: Window) -> AttentionCache {
        let mut p = CacheParams::new(size, 1, 8, 8);
        p.n_seq_max = n_seq;
        AttentionCache::new(p, unified, window).unwrap()
    }

    fn standard(n: u32) -> Window {
        Window {
            n_swa: n,
            swa_type: SwaType::Standard,
        }
    }

    #[test]
    fn a_window_cache_reuses_the_cells_its_sequence_can_no_longer_see() {
        let mut c = cache(8, 1, true, standard(4));
        c.place(&[UBatch::sequence(0, 0, 8)]).unwrap().unwrap();
        // the cache is full; token 8 sees positions 5..8, so cells of 0..4 are reusable
        let slots = c.place(&[UBatch::sequence(0, 8, 2)]).unwrap().unwrap();
        assert_eq!(slots[0][0].cells, vec![0, 1]);
        // the purge removed every position below the overwritten ones
        assert_eq!(c.seq_pos_min(0).unwrap(), 2);
        assert_eq!(c.seq_pos_max(0).unwrap(), 9);
        assert_eq!(c.used_cells(), 8);
    }

    #[test]
    fn a_full_attention_cache_refuses_what_does_not_fit_and_changes_nothing() {
        let mut c = cache(8, 2, true, Window::FULL);
        c.place(&[UBatch::sequence(0, 0, 6)]).unwrap().unwrap();
        let before = c.stream(0).unwrap().cells.clone();
        let none = c
            .place(&[UBatch::sequence(1, 0, 1), UBatch::sequence(1, 1, 4)])
            .unwrap();
        assert!(none.is_none());
        assert_eq!(c.stream(0).unwrap().cells, before);
        assert_eq!(c.stream(0).unwrap().head, 6);
    }

    #[test]
    fn a_sequence_read_that_cannot_succeed_fails_before_any_cell_changes() {
        // nothing is recorded to undo a sequence read (`CellsUndo::Unrecorded`): every way it
        // can fail must come before the first cell changes
        let mut c = cache(16, 3, true, Window::FULL);
        c.place(&[UBatch::sequence(0, 0, 6), UBatch::sequence(1, 0, 6)])
            .unwrap()
            .unwrap();
        c.place(&[UBatch::sequence(2, 0, 4)]).unwrap().unwrap();
        let payload = c.state_write(0, Layout::StreamsRot).unwrap();
        let before = c.stream(0).unwrap().cells.clone();
        let head = c.stream(0).unwrap().head;
        // 6 cells cannot take the place of sequence 2's 4 in a full cache
        let full = c.state_read(&payload, 2, Layout::StreamsRot).unwrap_err();
        assert!(matches!(full, KvError::NoSpace(_)), "{full}");
        // nor can a payload cut short, nor one of another layout
        let cut = c.state_read(&payload[..payload.len() - 1], 1, Layout::StreamsRot);
        assert!(cut.is_err());
        assert!(c.state_read(&payload, 1, Layout::Seed).is_err());
        assert_eq!(c.stream(0).unwrap().cells, before);
        assert_eq!(c.stream(0).unwrap().head, head);
        // the same payload fits in place of sequence 1's 6 cells
        c.state_read(&payload, 1, Layout::StreamsRot).unwrap();
        assert_eq!(c.seq_pos_max(1).unwrap(), 5);
    }

    #[test]
    fn sequences_of_separate_streams_do_not_share_cells() {
        let mut c = cache(4, 2, false, Window::FULL);
        c.place(&[UBatch::sequence(0, 0, 4)]).unwrap().unwrap();
        c.place(&[UBatch::sequence(1, 0, 4)]).unwrap().unwrap();
        assert_eq!(c.used_cells(), 8);
        c.seq_cp(0, 1, -1, -1).unwrap();
        assert_eq!(c.stream(1).unwrap().cells.seqs(0).only(), Some(1));
        assert!(c.seq_cp(0, 1, 1, 2).is_err());
        let bytes = c.state_write(-1, Layout::StreamsRot).unwrap();
        let mut d = cache(4, 2, false, Window::FULL);
        d.state_read(&bytes, -1, Layout::StreamsRot).unwrap();
        assert_eq!(d.state_write(-1, Layout::StreamsRot).unwrap(), bytes);
    }

    /// The cells 0.1.161's search finds, tested one cell at a time from first principles: the
    /// model `find_cells` (which takes whole words of free cells, or of the removed sequence's
    /// own, at once) must agree with.
    fn find_cells_one_by_one(
        cells: &Cells,
        head: u32,
        n: usize,
        window: Window,
        gone: Option<usize>,
    ) -> Option<Vec<u32>> {
        let size = cells.len();
        if n > size {
            return None;
        }
        let freed = gone.map_or(0, |g| {
            cells
                .cells_of(g)
                .filter(|&i| cells.seqs(i).len() == 1)
                .count()
        });
        let used = (cells.occupied_count() as usize).saturating_sub(freed);
        let mut head = head as usize;
        if head > used + 2 * n {
            head = 0;
        }
        let usable = |i: usize| {
            let pos = cells.pos(i);
            if pos < 0 {
                return true;
            }
            let mut seqs = cells.seqs(i);
            if let Some(g) = gone {
                seqs.remove(g);
                if seqs.is_empty() {
                    return true;
                }
            }
            match (window.swa_type, seqs.only()) {
                (SwaType::None, _) | (_, None) => false,
                (_, Some(seq)) => window.masks(pos, cells.seq_pos_max(seq).map_or(0, |m| m + 1)),
            }
        };
        let mut out = Vec::new();
        for tested in 1..=size {
            if head >= size {
                head = 0;
            }
            if usable(head) {
                out.push(head as u32);
            }
            head += 1;
            if out.len() == n {
                return Some(out);
            }
            if tested == size {
                break;
            }
        }
        None
    }

    /// A table of cells of 4 sequences for property tests: `table` gives each cell a position
    /// (negative: free) and a sequence, `runs` overwrite runs of cells (across whole words) with
    /// one sequence at ascending positions (odd lengths) or free cells (even ones), and the
    /// cells of `shared` gain a second sequence.
    fn random_table(table: &[(i32, u64)], shared: &[usize], runs: &[(usize, usize)]) -> Cells {
        let size = table.len();
        let mut cells = Cells::new(size, 4).unwrap();
        for (i, &(pos, seq)) in table.iter().enumerate() {
            if pos >= 0 {
                cells.set_pos(i, pos);
                cells.insert_seq(i, seq as usize % 4);
            }
        }
        for &(start, len) in runs {
            for i in (start..start + len).filter(|&i| i < size) {
                cells.clear_seqs(i);
                cells.set_pos(i, if len % 2 == 0 { -1 } else { i as i32 });
                if len % 2 == 1 {
                    cells.insert_seq(i, len % 4);
                }
            }
        }
        for &i in shared.iter().filter(|&&i| i < size) {
            if cells.pos(i) >= 0 {
                cells.insert_seq(i, (i + 1) % 4);
            }
        }
        cells.settle();
        cells
    }

    proptest::proptest! {
        #[test]
        fn the_cells_a_placement_touches_are_those_and_the_purged_ones_counted_one_by_one(
            table in proptest::collection::vec((-1i32..40, 0u64..16), 1..400),
            shared in proptest::collection::vec(0usize..400, 0..8),
            runs in proptest::collection::vec((0usize..400, 1usize..130), 0..4),
            at in proptest::collection::btree_set(0usize..400, 0..40),
        ) {
            let cells = random_table(&table, &shared, &runs);
            let at: Vec<u32> = at.into_iter().filter(|&i| i < table.len()).map(|i| i as u32).collect();
            // every placed cell; for each sequence alone in one of them, its cells up to the
            // largest position overwritten
            let mut want: Vec<usize> = at.iter().map(|&c| c as usize).collect();
            for &c in &at {
                let i = c as usize;
                if let (true, Some(seq)) = (cells.pos(i) >= 0, cells.seqs(i).only()) {
                    let max = at
                        .iter()
                        .map(|&d| d as usize)
                        .filter(|&d| cells.pos(d) >= 0 && cells.seqs(d).only() == Some(seq))
                        .map(|d| cells.pos(d))
                        .max()
                        .unwrap();
                    want.extend(cells.cells_of(seq).filter(|&j| cells.pos(j) <= max));
                }
            }
            want.sort_unstable();
            want.dedup();
            proptest::prop_assert_eq!(touched_by(&cells, &at), want);
        }

        #[test]
        fn finding_cells_a_word_at_a_time_matches_testing_each_cell(
            table in proptest::collection::vec((-1i32..40, 0u64..16), 1..400),
            shared in proptest::collection::vec(0usize..400, 0..8),
            head in 0u32..450,
            n in 1usize..300,
            swa in 0usize..4,
            n_swa in 1u32..12,
            gone in proptest::option::of(0usize..4),
            runs in proptest::collection::vec((0usize..400, 1usize..130), 0..4),
        ) {
            // a head anywhere (past the used cells too: the reset), every window rule, with and
            // without a sequence removed first
            let cells = random_table(&table, &shared, &runs);
            let swa_type = [SwaType::None, SwaType::Standard, SwaType::Chunked, SwaType::Symmetric][swa];
            let window = Window { n_swa, swa_type };
            proptest::prop_assert_eq!(
                find_cells(&cells, head, n, window, gone),
                find_cells_one_by_one(&cells, head, n, window, gone)
            );
        }

        #[test]
        fn a_free_run_is_the_consecutive_free_cells_counted_one_by_one(
            occupied in proptest::collection::vec(proptest::bool::weighted(0.2), 1..300),
            start in 0usize..300,
            gaps in proptest::collection::vec(proptest::bool::weighted(0.05), 1..200),
        ) {
            // a slot's cells from `start`, ascending, mostly consecutive (a gap now and then),
            // over cells mostly free
            let size = occupied.len();
            let mut cells = Cells::new(size, 1).unwrap();
            for (i, _) in occupied.iter().enumerate().filter(|(_, &o)| o) {
                cells.set_pos(i, 0);
                cells.insert_seq(i, 0);
            }
            cells.settle();
            let mut list = Vec::new();
            let mut at = start % size;
            for &gap in &gaps {
                at += 1 + usize::from(gap);
                if at >= size {
                    break;
                }
                list.push(at as u32);
            }
            proptest::prop_assume!(!list.is_empty());
            let one_by_one = (0..list.len())
                .take_while(|&k| {
                    cells.pos(list[k] as usize) < 0 && (k == 0 || list[k] == list[k - 1] + 1)
                })
                .count();
            proptest::prop_assert_eq!(free_run(&cells, &list), one_by_one);
        }
    }
}
