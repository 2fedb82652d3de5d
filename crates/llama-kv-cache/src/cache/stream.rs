//! State payloads piece by piece, for states too large to hold in memory twice (a long chat of
//! an 8B model is gigabytes; above 4 GiB it does not even fit one JS `Buffer`).
//!
//! [`StateOut`] produces the bytes of `state_write` chunk by chunk, copying each chunk straight
//! from the tensors. [`StateIn`] loads a payload as its bytes arrive: it keeps the header and
//! the cell metadata until it can decide the layout and place the cells, then writes every
//! further byte straight into the tensors. A load that fails, or is abandoned before
//! [`SeedCache::state_in_finish`], puts the cells back as they were, and the rows of the cells
//! that held data before it (kept aside when the cells are placed: nothing for a load into
//! free cells). Rows of cells that were free may keep bytes of the abandoned payload; they
//! are not part of any state.
//!
//! Both hold a plan made from the cache when they start: the cache must not change between
//! their calls (the Node binding holds the cache busy while a stream is open).

use crate::cache::io::{ReadOptions, ReadSummary, WritePlan};
use crate::cache::rollback::PlacedLoad;
use crate::cache::SeedCache;
use crate::error::{KvError, Result};
use crate::staging::{stage_with, Staged};
use crate::state::cells::{PayloadCells, MAX_PAYLOAD_SEQS};
use crate::state::rows::{write_columns, write_rows};
use crate::state::sink::WindowSink;
use crate::state::{
    ambiguous, cell_count_header, check_meta, checked_cell_count, checked_n_stream, k_header,
    no_layout_fits, parse_stream_head, read_k_header, v_header, Cursor, LayerBlock, Layout,
    ParsedPayload, StreamBlock, StreamFormat, StreamHead, VBlock,
};

/// The bytes of one `state_write`, handed out chunk by chunk.
pub struct StateOut {
    plan: WritePlan,
    pos: usize,
}

impl StateOut {
    /// Size of the whole payload in bytes.
    pub fn size(&self) -> usize {
        self.plan.total
    }

    /// Bytes handed out so far.
    pub fn position(&self) -> usize {
        self.pos
    }
}

impl SeedCache {
    /// Starts producing `state_write(seq, layout, n_stream)` piece by piece.
    pub fn state_out(&self, seq: i32, layout: Layout, n_stream: u32) -> Result<StateOut> {
        Ok(StateOut {
            plan: self.write_plan(seq, layout, n_stream)?,
            pos: 0,
        })
    }

    /// Writes the whole payload of `out` into the front of `buf` (at least [`StateOut::size`]
    /// bytes: a buffer sized by the caller from the plan, such as a JS Buffer from Node's
    /// allocator), reporting progress between layers; returns its size.
    pub fn state_out_all(
        &self,
        out: &StateOut,
        buf: &mut [u8],
        progress: Option<crate::cache::io::Progress<'_>>,
    ) -> Result<usize> {
        let total = out.plan.total;
        let Some(dst) = buf.get_mut(..total) else {
            return Err(KvError::InvalidArg(format!(
                "a buffer of {} bytes cannot hold the {total}-byte state",
                buf.len()
            )));
        };
        self.write_planned(
            &mut crate::state::sink::SliceSink::new(dst),
            &out.plan,
            progress,
        )
    }

    /// The whole payload of `out` in staging memory ([`crate::staging`]).
    pub fn state_out_staged(
        &self,
        out: &StateOut,
        progress: Option<crate::cache::io::Progress<'_>>,
    ) -> Result<Staged> {
        // the plan's writer puts every byte of its size (kept staging memory holds an earlier
        // payload's): the same guarantee `state_out_all` gives a caller's buffer
        stage_with(out.size(), "the state", |into| {
            self.state_out_all(out, into, progress).map(drop)
        })
    }

    /// Copies the next bytes of the payload into `buf` and returns how many (0 at the end).
    /// Each call skips the tensor blocks before its window, so a chunk costs its own bytes,
    /// not the bytes before it.
    pub fn state_out_chunk(&self, out: &mut StateOut, buf: &mut [u8]) -> Result<usize> {
        let n = buf.len().min(out.plan.total - out.pos);
        if n == 0 {
            return Ok(0);
        }
        let mut sink = WindowSink::new(&mut buf[..n], out.pos);
        self.write_planned(&mut sink, &out.plan, None)?;
        out.pos += n;
        Ok(n)
    }
}

/// A payload being loaded as its bytes arrive.
pub struct StateIn {
    dest: Option<i32>,
    opts: ReadOptions,
    phase: Phase,
}

enum Phase {
    /// Collecting the header and cell metadata; `next_try` is the buffer length at which the
    /// header is parsed again (doubling, so the parses cost linear time in all).
    Head { buf: Vec<u8>, next_try: usize },
    /// Cells placed; the rest of the bytes go to the tensors.
    Data(Box<DataPhase>),
    /// Finished or abandoned.
    Closed,
}

/// What the header parse of one candidate layout found.
enum HeadParse {
    /// The buffer ends inside the header.
    NeedMore,
    /// Every stream is empty: the payload carries no data header (nothing to stream).
    NoData,
    /// The stream with cells, up to its first layer's K header.
    Data(Head),
}

struct Head {
    layout: Layout,
    n_stream: u32,
    /// Index of the stream with cells.
    stream: u32,
    cells: PayloadCells,
    /// Bytes before the first layer's K header.
    len: usize,
}

/// A fixed header that the payload must repeat, named for messages.
#[derive(Clone, Copy)]
enum Expected {
    K(usize),
    V(usize),
    EmptyStream(u32),
}

/// A piece of the payload after its cell metadata.
enum Segment {
    /// Bytes the payload must hold exactly (the cache's own layer headers).
    Fixed { bytes: Vec<u8>, what: Expected },
    /// Layer `il`'s K rows.
    K(usize),
    /// Layer `il`'s V rows.
    V(usize),
    /// Layer `il`'s transposed V: one run of the placed cells' elements per V channel.
    VColumns(usize),
}

struct DataPhase {
    layout: Layout,
    load: PlacedLoad,
    segments: Vec<Segment>,
    seg: usize,
    off: usize,
    received: u64,
    expected: u64,
}

impl SeedCache {
    /// Starts loading a payload into sequence `seq` (-1: the whole cache) from bytes that
    /// arrive in pieces. `opts.part` is not supported (payloads of several memories load
    /// through [`SeedCache::state_read`]).
    pub fn state_in(&self, seq: i32, opts: ReadOptions) -> Result<StateIn> {
        if opts.part.is_some() {
            return Err(KvError::Unsupported(
                "a streamed load reads a single memory: load parts of a payload with stateRead"
                    .into(),
            ));
        }
        let dest = self.read_dest(seq)?;
        Ok(StateIn {
            dest,
            opts,
            phase: Phase::Head {
                buf: Vec::new(),
                next_try: 0,
            },
        })
    }

    /// Takes the next bytes of the payload. Until the cells are placed they are kept; after,
    /// they go straight to the tensors. On an error the load is over and the cache is as it
    /// was before it.
    pub fn state_in_write(&mut self, load: &mut StateIn, bytes: &[u8]) -> Result<()> {
        let fed = match &mut load.phase {
            Phase::Closed => {
                return Err(KvError::InvalidArg(
                    "the streamed load is already finished or failed".into(),
                ))
            }
            Phase::Data(data) => self.feed(data, bytes),
            Phase::Head { buf, next_try } => {
                let cap = self.head_cap();
                if buf.try_reserve(bytes.len()).is_err() {
                    return Err(KvError::Backend(format!(
                        "cannot allocate {} bytes for a state header",
                        buf.len() + bytes.len()
                    )));
                }
                buf.extend_from_slice(bytes);
                if buf.len() < *next_try {
                    return Ok(());
                }
                match self.decide_head(buf, load.dest, load.opts.layout, cap) {
                    Ok(None) => {
                        *next_try = (buf.len() * 2).clamp(1, cap);
                        return Ok(());
                    }
                    Err(e) => {
                        load.phase = Phase::Closed;
                        return Err(e);
                    }
                    Ok(Some(head)) => {
                        let rest = std::mem::take(buf);
                        match self.begin_data(&head, load.dest, load.opts) {
                            Err(e) => {
                                load.phase = Phase::Closed;
                                return Err(e);
                            }
                            Ok(mut data) => {
                                let fed = self.feed(&mut data, &rest[head.len..]);
                                load.phase = Phase::Data(data);
                                fed
                            }
                        }
                    }
                }
            }
        };
        if fed.is_err() {
            self.abandon(load);
        }
        fed
    }

    /// Ends the load: checks that the whole payload arrived and commits it. On an error the
    /// cache is as it was before the load.
    pub fn state_in_finish(&mut self, load: &mut StateIn) -> Result<ReadSummary> {
        match std::mem::replace(&mut load.phase, Phase::Closed) {
            Phase::Closed => Err(KvError::InvalidArg(
                "the streamed load is already finished or failed".into(),
            )),
            // the payload ended within its header (no cells, or truncated): it is small, read
            // it whole
            Phase::Head { buf, .. } => {
                self.state_read(&buf, load.dest.unwrap_or(-1), load.opts, None)
            }
            Phase::Data(data) if data.received < data.expected => {
                let e = KvError::InvalidState(format!(
                    "truncated: the payload ended after {} of its {} data bytes",
                    data.received, data.expected
                ));
                self.undo_load(data.load)?;
                Err(e)
            }
            Phase::Data(data) => {
                if load.dest.is_none() {
                    // rows past the loaded cells end up zeroed, as after llama.cpp's
                    // clear-then-read (deferred to here so an abandoned load keeps them)
                    if let Err(e) = self.zero_rows_from(data.load.placed.len()) {
                        self.undo_load(data.load)?;
                        return Err(e);
                    }
                }
                let placed = self.commit_load(data.load);
                Ok(ReadSummary {
                    layout: data.layout,
                    cells: placed.len() as u32,
                    placed: placed.iter().map(|&c| c as u32).collect(),
                })
            }
        }
    }

    /// Abandons the load (an aborted or destroyed stream): the cache is put back as it was.
    pub fn state_in_abort(&mut self, load: &mut StateIn) -> Result<()> {
        match std::mem::replace(&mut load.phase, Phase::Closed) {
            Phase::Data(data) => self.undo_load(data.load),
            _ => Ok(()),
        }
    }

    fn abandon(&mut self, load: &mut StateIn) {
        // the original error is the one to report; putting host rows back cannot fail
        let _ = self.state_in_abort(load);
    }

    /// The most header bytes a payload for this cache can have before its first layer's rows:
    /// the stream prefix, every cell with every seq id, the data header.
    fn head_cap(&self) -> usize {
        let ids = self.params.n_seq_max.max(1) as usize;
        4 + 4 * MAX_PAYLOAD_SEQS as usize + self.params.size as usize * (8 + 4 * ids) + 64
    }

    /// Parses the buffered header under each candidate layout. `Ok(None)`: not decided yet.
    fn decide_head(
        &self,
        buf: &[u8],
        dest: Option<i32>,
        layout: Option<Layout>,
        cap: usize,
    ) -> Result<Option<Head>> {
        let candidates: Vec<Layout> = match layout {
            Some(l) => vec![self.effective_layout(l)],
            None if self.params.recurrent => vec![Layout::Seed],
            None => vec![Layout::Seed, Layout::Streams, Layout::StreamsRot],
        };
        let (mut fits, mut errors, mut waiting) = (Vec::new(), Vec::new(), false);
        for l in candidates {
            match self.parse_head(buf, l, dest) {
                Ok(HeadParse::Data(h)) => fits.push(h),
                Ok(HeadParse::NeedMore | HeadParse::NoData) if buf.len() < cap => waiting = true,
                Ok(HeadParse::NeedMore | HeadParse::NoData) => errors.push((
                    l,
                    KvError::InvalidState(format!(
                        "no state header fits this cache in the first {cap} bytes"
                    )),
                )),
                Err(e) => errors.push((l, e)),
            }
        }
        match fits.len() {
            0 if waiting => Ok(None),
            0 => Err(no_layout_fits(errors)),
            1 => Ok(fits.pop()),
            // a header that fits two layouts (crafted bytes): only the payload's length can
            // decide, as stateRead decides; a payload that ends within the header buffer is
            // read whole by state_in_finish
            _ if buf.len() < cap => Ok(None),
            _ => Err(ambiguous(fits.iter().map(|h| h.layout))),
        }
    }

    /// Parses the header of a payload under `layout` as far as the first layer's K header and
    /// checks it against this cache. The buffer may end anywhere: a parse that runs out of
    /// bytes waits for more.
    fn parse_head(&self, buf: &[u8], layout: Layout, dest: Option<i32>) -> Result<HeadParse> {
        let mut c = Cursor::partial(buf);
        match self.parse_head_in(&mut c, layout, dest) {
            Err(_) if c.ran_out => Ok(HeadParse::NeedMore),
            done => done,
        }
    }

    fn parse_head_in(
        &self,
        c: &mut Cursor<'_>,
        layout: Layout,
        dest: Option<i32>,
    ) -> Result<HeadParse> {
        let n_stream = if layout.has_stream_prefix() {
            checked_n_stream(c.u32("n_stream")?)?
        } else {
            1
        };
        let f = StreamFormat {
            no_v: self.params.no_v,
            ..StreamFormat::of(layout, self.params.cell_ext)
        };
        for s in 0..n_stream {
            // a count this cache cannot hold is refused before its cells arrive
            if let Some(count) = c.peek_u32() {
                checked_cell_count(c, s as usize, count, f.ext)?;
                if count > self.params.size {
                    return Err(KvError::NoSpace(format!(
                        "the payload holds {count} cells, the cache only {}",
                        self.params.size
                    )));
                }
            }
            let StreamHead { cells, data } = parse_stream_head(c, s as usize, f)?;
            let Some(data) = data else {
                continue;
            };
            let len = c.pos;
            let (k_type, k_row_size) = read_k_header(c, 0)?;
            // the checks of a whole payload, on the layers the cache expects and the first
            // layer's K header as the payload has it
            let layers = (0..data.n_layer as usize)
                .map(|il| {
                    let mut b = self.expected_layer(il.min(self.layers.len() - 1));
                    if il == 0 {
                        (b.k_type, b.k_row_size) = (k_type, k_row_size);
                    }
                    b
                })
                .collect();
            let parsed = ParsedPayload {
                layout,
                streams: vec![StreamBlock {
                    cells,
                    v_trans: Some(data.v_trans),
                    layers,
                    n_rot: data.n_rot,
                    n_layer_declared: data.n_layer,
                }],
                len,
                ext: f.ext,
            };
            check_meta(&parsed, dest, self.params.recurrent, self.params.n_seq_max)?;
            self.check_data(&parsed)?;
            let cells = parsed.streams.into_iter().next().map(|s| s.cells);
            return Ok(HeadParse::Data(Head {
                layout,
                n_stream,
                stream: s,
                cells: cells.unwrap_or_default(),
                len,
            }));
        }
        Ok(HeadParse::NoData)
    }

    /// The K/V block headers this cache writes for layer `il` (data ranges empty).
    fn expected_layer(&self, il: usize) -> LayerBlock {
        let l = &self.layers[il];
        let v = if self.v_trans() {
            VBlock::Transposed {
                ty: self.params.type_v.id(),
                el_size: self.params.type_v.type_size() as u32,
                n_embd: l.n_embd_v as u32,
                data: 0..0,
            }
        } else {
            VBlock::Rows {
                ty: self.params.type_v.id(),
                row_size: l.v_row as u64,
                data: 0..0,
            }
        };
        LayerBlock {
            k_type: self.params.type_k.id(),
            k_row_size: l.k_row as u64,
            k_data: 0..0,
            v,
        }
    }

    /// Places the cells of a decided header, keeps the rows it will overwrite that held data,
    /// and lays out the rest of the payload.
    fn begin_data(
        &mut self,
        head: &Head,
        dest: Option<i32>,
        opts: ReadOptions,
    ) -> Result<Box<DataPhase>> {
        let load = self.place_load(&head.cells, dest, opts.allow_scattered)?;
        let segments = self.data_segments(head);
        let expected = segments
            .iter()
            .map(|s| self.segment_len(s, load.placed.len()) as u64)
            .sum();
        Ok(Box::new(DataPhase {
            layout: head.layout,
            load,
            segments,
            seg: 0,
            off: 0,
            received: 0,
            expected,
        }))
    }

    /// The pieces after the first stream's data header: per layer the K header and rows, per
    /// layer the V header and data, then the remaining (empty) streams.
    fn data_segments(&self, head: &Head) -> Vec<Segment> {
        let mut segs = Vec::with_capacity(4 * self.layers.len() + head.n_stream as usize);
        for (il, l) in self.layers.iter().enumerate() {
            segs.push(Segment::Fixed {
                bytes: k_header(self.params.type_k, l.k_row).to_vec(),
                what: Expected::K(il),
            });
            segs.push(Segment::K(il));
        }
        // a cache without V reads no V blocks
        let v_layers = if self.params.no_v {
            &[][..]
        } else {
            &self.layers[..]
        };
        for (il, l) in v_layers.iter().enumerate() {
            segs.push(Segment::Fixed {
                bytes: v_header(self.params.type_v, l.v_row, self.v_trans()).to_vec(),
                what: Expected::V(il),
            });
            segs.push(if self.v_trans() {
                Segment::VColumns(il)
            } else {
                Segment::V(il)
            });
        }
        for s in head.stream + 1..head.n_stream {
            segs.push(Segment::Fixed {
                bytes: cell_count_header(0).to_vec(),
                what: Expected::EmptyStream(s),
            });
        }
        segs
    }

    fn segment_len(&self, seg: &Segment, n: usize) -> usize {
        match seg {
            Segment::Fixed { bytes, .. } => bytes.len(),
            Segment::K(il) => n * self.layers[*il].k_row,
            Segment::V(il) => n * self.layers[*il].v_row,
            Segment::VColumns(il) => n * self.params.type_v.type_size() * self.layers[*il].n_embd_v,
        }
    }

    /// Writes the next payload bytes where they belong.
    fn feed(&mut self, d: &mut DataPhase, mut bytes: &[u8]) -> Result<()> {
        if d.received + bytes.len() as u64 > d.expected {
            return Err(KvError::InvalidState(format!(
                "{} trailing bytes after the payload",
                d.received + bytes.len() as u64 - d.expected
            )));
        }
        d.received += bytes.len() as u64;
        let (size, el) = (self.params.size as usize, self.params.type_v.type_size());
        let (placed, contiguous) = (&d.load.placed, d.load.contiguous);
        let n = placed.len();
        while !bytes.is_empty() {
            let seg = &d.segments[d.seg];
            let len = self.segment_len(seg, n);
            let take = (len - d.off).min(bytes.len());
            let (part, rest) = bytes.split_at(take);
            match seg {
                Segment::Fixed { bytes: want, what } => {
                    if want[d.off..d.off + take] != *part {
                        return Err(self.header_mismatch(*what, d.layout));
                    }
                }
                Segment::K(il) => {
                    let l = &mut self.layers[*il];
                    write_rows(l.k.as_mut(), l.k_row, placed, contiguous, d.off, part)?;
                }
                Segment::V(il) => {
                    let l = &mut self.layers[*il];
                    write_rows(l.v.as_mut(), l.v_row, placed, contiguous, d.off, part)?;
                }
                Segment::VColumns(il) => {
                    let v = self.layers[*il].v.as_mut();
                    write_columns(v, (el, size), placed, contiguous, d.off, part)?;
                }
            }
            d.off += take;
            if d.off == len {
                d.seg += 1;
                d.off = 0;
            }
            bytes = rest;
        }
        Ok(())
    }

    fn header_mismatch(&self, what: Expected, layout: Layout) -> KvError {
        match what {
            Expected::K(il) => KvError::InvalidState(format!(
                "layer {il}: the K header differs from this cache's ({} rows of {} bytes)",
                self.params.type_k, self.layers[il].k_row
            )),
            Expected::V(il) => KvError::InvalidState(format!(
                "layer {il}: the V header differs from this cache's ({}, {} bytes per cell{})",
                self.params.type_v,
                self.layers[il].v_row,
                if self.v_trans() { ", transposed" } else { "" }
            )),
            Expected::EmptyStream(s) => KvError::Unsupported(format!(
                "stream {s} of the {layout} payload has cells too: a streamed load reads \
                 payloads whose cells are all in one stream (load a whole non-unified cache \
                 with stateRead)"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::cache::io::ReadOptions;
    use crate::state::Layout;
    use crate::{CacheParams, KvError, SeedCache, Tensor, UBatch};

    /// A cache of 64 cells, 2 layers, 4 sequences: sequence 0 in cells 0..10 (shared with 1
    /// for the first 3), sequence 2 in 20..26; every row a distinct byte pattern.
    fn filled(flash_attn: bool) -> SeedCache {
        let mut p = CacheParams::new(64, 2, 8, 12);
        p.n_seq_max = 4;
        p.flash_attn = flash_attn;
        let mut c = SeedCache::new(p).unwrap();
        c.find_slot(&UBatch {
            pos: vec![0, 1, 2],
            n_seq_tokens: 3,
            seq_ids: vec![vec![0, 1]],
            ext: Vec::new(),
        })
        .unwrap();
        c.find_slot(&UBatch::sequence(0, 3, 7)).unwrap();
        c.find_slot(&UBatch::sequence(3, 0, 10)).unwrap();
        c.find_slot(&UBatch::sequence(2, 0, 6)).unwrap();
        c.seq_rm(3, -1, -1).unwrap();
        for il in 0..2 {
            for (which, width) in [(Tensor::K, 16), (Tensor::V, 24)] {
                let rows: Vec<u8> = (0..64 * width)
                    .map(|i| (i * 7 + il * 13 + width) as u8)
                    .collect();
                c.write_rows(il as u32, which, 0, &rows).unwrap();
            }
        }
        c
    }

    fn streamed_out(c: &SeedCache, seq: i32, layout: Layout, chunk: usize) -> Vec<u8> {
        let mut out = c.state_out(seq, layout, 1).unwrap();
        let mut all = Vec::new();
        let mut buf = vec![0u8; chunk];
        loop {
            let n = c.state_out_chunk(&mut out, &mut buf).unwrap();
            if n == 0 {
                break;
            }
            all.extend_from_slice(&buf[..n]);
        }
        assert_eq!(out.position(), out.size());
        all
    }

    fn streamed_in(
        c: &mut SeedCache,
        seq: i32,
        data: &[u8],
        chunk: usize,
    ) -> crate::Result<crate::ReadSummary> {
        let mut load = c.state_in(seq, ReadOptions::default())?;
        for piece in data.chunks(chunk) {
            c.state_in_write(&mut load, piece)?;
        }
        c.state_in_finish(&mut load)
    }

    /// Everything a state can observe: the cells, head, n and the live rows.
    fn observable(c: &SeedCache) -> (crate::cells::Cells, u32, u32, Vec<u8>) {
        (
            c.cells().clone(),
            c.head(),
            c.n(),
            c.state_write(-1, Layout::Seed, 1, None).unwrap(),
        )
    }

    #[test]
    fn chunks_concatenate_to_the_whole_payload_at_any_chunk_size() {
        for flash_attn in [false, true] {
            let c = filled(flash_attn);
            for seq in [-1, 0, 2, 3] {
                for layout in [Layout::Seed, Layout::Streams, Layout::StreamsRot] {
                    let whole = c.state_write(seq, layout, 1, None).unwrap();
                    for chunk in [1, 3, 16, 100, 1 << 20] {
                        assert_eq!(
                            streamed_out(&c, seq, layout, chunk),
                            whole,
                            "seq {seq}, {layout}, chunks of {chunk}, flash attention {flash_attn}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn the_whole_planned_payload_is_state_write_and_a_small_buffer_is_refused() {
        let c = filled(false);
        let out = c.state_out(-1, Layout::Streams, 1).unwrap();
        let mut buf = vec![0u8; out.size() + 1];
        assert_eq!(c.state_out_all(&out, &mut buf, None).unwrap(), out.size());
        assert_eq!(
            buf[..out.size()],
            c.state_write(-1, Layout::Streams, 1, None).unwrap()[..]
        );
        let e = c.state_out_all(&out, &mut buf[..10], None).unwrap_err();
        assert!(matches!(e, KvError::InvalidArg(_)), "{e}");
    }

    #[test]
    fn a_streamed_load_matches_state_read_at_any_chunk_size() {
        for flash_attn in [false, true] {
            let src = filled(flash_attn);
            for (seq, dest) in [(-1, -1), (0, 3), (2, 1)] {
                for layout in [Layout::Seed, Layout::Streams] {
                    let data = src.state_write(seq, layout, 1, None).unwrap();
                    let mut want = filled(flash_attn);
                    want.seq_rm(1, -1, -1).unwrap();
                    let expected = want
                        .state_read(&data, dest, ReadOptions::default(), None)
                        .unwrap();
                    for chunk in [1, 5, 64, 1 << 20] {
                        let mut c = filled(flash_attn);
                        c.seq_rm(1, -1, -1).unwrap();
                        let r = streamed_in(&mut c, dest, &data, chunk).unwrap();
                        assert_eq!(
                            r, expected,
                            "seq {seq} -> {dest}, {layout}, chunks of {chunk}"
                        );
                        assert_eq!(observable(&c), observable(&want));
                    }
                }
            }
        }
    }

    #[test]
    fn regression_a_header_fitting_two_layouts_is_decided_by_the_payload_length_as_state_read_does()
    {
        // found by the fuzzer: a small payload whose header parses both as the seed layout and
        // as the streams layout was refused as ambiguous by the streamed load, while state_read
        // (which sees where the payload ends) loads it as seed
        let data = std::fs::read(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fuzz-findings/stream-header-fits-seed-and-streams.bin"
        ))
        .unwrap();
        let cache = || {
            let mut p = CacheParams::new(16, 2, 32, 32);
            p.n_seq_max = 4;
            p.flash_attn = true;
            p.type_k = crate::GgmlType::Q8_0;
            p.type_v = crate::GgmlType::Q8_0;
            let mut c = SeedCache::new(p).unwrap();
            c.find_slot(&UBatch::per_token(
                vec![0, 1, 2],
                vec![vec![0, 1], vec![1], vec![2]],
            ))
            .unwrap()
            .unwrap();
            c
        };
        let mut whole = cache();
        let expected = whole
            .state_read(&data, 0, ReadOptions::default(), None)
            .unwrap();
        assert_eq!(expected.layout, Layout::Seed);
        for chunk in [1, 64, 1001, 1 << 20] {
            let mut c = cache();
            let r = streamed_in(&mut c, 0, &data, chunk).unwrap();
            assert_eq!(r, expected, "chunks of {chunk}");
            assert_eq!(observable(&c), observable(&whole), "chunks of {chunk}");
        }
    }

    #[test]
    fn regression_streaming_a_state_without_cells_in_the_seed_layout_is_not_a_panic() {
        // found by the fuzzer: the seed layout writes the layer headers of an empty cache, and
        // their empty row blocks indexed the first placed cell of none
        for flash_attn in [false, true] {
            let empty = SeedCache::new(filled(flash_attn).params().clone()).unwrap();
            for layout in [Layout::Seed, Layout::Streams] {
                let data = empty.state_write(-1, layout, 1, None).unwrap();
                for chunk in [1, 7, 1 << 20] {
                    let mut c = filled(flash_attn);
                    let r = streamed_in(&mut c, -1, &data, chunk).unwrap();
                    assert_eq!(r.cells, 0, "{layout}, chunks of {chunk}");
                    assert_eq!(observable(&c), observable(&empty));
                }
            }
        }
    }

    #[test]
    fn scattered_placement_streams_rows_and_columns_to_the_right_cells() {
        for flash_attn in [false, true] {
            let src = filled(flash_attn);
            let data = src.state_write(0, Layout::Streams, 1, None).unwrap();
            let fragmented = || {
                let mut c = filled(flash_attn);
                // every free cell taken, then every third one freed: no run of 10 is free
                for p in 0..48 {
                    c.find_slot(&UBatch::sequence(3, p, 1)).unwrap().unwrap();
                }
                for p in (0..48).step_by(3) {
                    c.seq_rm(3, p, p + 1).unwrap();
                }
                c
            };
            let opts = ReadOptions {
                allow_scattered: true,
                ..Default::default()
            };
            let mut want = fragmented();
            let expected = want.state_read(&data, 1, opts, None).unwrap();
            let mut c = fragmented();
            let mut load = c.state_in(1, opts).unwrap();
            for piece in data.chunks(3) {
                c.state_in_write(&mut load, piece).unwrap();
            }
            assert_eq!(c.state_in_finish(&mut load).unwrap(), expected);
            assert!(expected.placed.windows(2).any(|w| w[1] != w[0] + 1));
            assert_eq!(observable(&c), observable(&want));
        }
    }

    #[test]
    fn an_abandoned_or_failed_load_leaves_cells_and_live_rows_as_they_were() {
        for flash_attn in [false, true] {
            // the same cells with other rows: loaded into sequence 2 (whose cells the load
            // frees and reuses) or the whole cache, they overwrite live rows that must come back
            let mut src = filled(flash_attn);
            for il in 0..2 {
                src.write_rows(il, Tensor::K, 0, &[0xa5; 64 * 16]).unwrap();
                src.write_rows(il, Tensor::V, 0, &[0x5a; 64 * 24]).unwrap();
            }
            let data = src.state_write(2, Layout::Streams, 1, None).unwrap();
            let whole = src.state_write(-1, Layout::Streams, 1, None).unwrap();
            let mut corrupt = data.clone();
            let last = corrupt.len() - 10;
            corrupt[last] ^= 0xff; // inside the last layer's V data: still loads
            let header_at = data.len() - 6 * 24 - 12; // last layer's V header (rows of 24 B)
            let mut bad_header = data.clone();
            bad_header[header_at + 4] ^= 1;
            type Case<'a> = (&'a str, i32, &'a [u8], bool);
            let cases: [Case; 5] = [
                ("abandoned mid-data", 2, &data[..data.len() - 7], false),
                ("truncated", 2, &data[..data.len() - 1], true),
                ("trailing bytes", 2, &[&data[..], &[0u8][..]].concat(), true),
                (
                    "whole cache, abandoned",
                    -1,
                    &whole[..whole.len() / 2],
                    false,
                ),
                (
                    "bad V header",
                    2,
                    if flash_attn { &bad_header } else { &data[..9] },
                    true,
                ),
            ];
            for (name, dest, bytes, finish) in cases {
                let mut c = filled(flash_attn);
                let before = observable(&c);
                let mut load = c.state_in(dest, ReadOptions::default()).unwrap();
                let mut failed = false;
                for piece in bytes.chunks(5) {
                    failed |= c.state_in_write(&mut load, piece).is_err();
                }
                if finish {
                    failed |= c.state_in_finish(&mut load).is_err();
                } else {
                    c.state_in_abort(&mut load).unwrap();
                }
                assert!(failed || !finish, "{name}: the load should fail");
                assert_eq!(
                    observable(&c),
                    before,
                    "{name}, flash attention {flash_attn}"
                );
                c.cells().check_consistency().unwrap();
            }
            // and the corrupted-data payload is loaded (data bytes are not checked)
            let mut c = filled(flash_attn);
            streamed_in(&mut c, 2, &corrupt, 4).unwrap();
        }
    }

    #[test]
    fn header_errors_are_typed_and_name_the_problem() {
        let src = filled(true);
        let data = src.state_write(0, Layout::Streams, 1, None).unwrap();
        let mut small = SeedCache::new({
            let mut p = CacheParams::new(4, 2, 8, 12);
            p.flash_attn = true;
            p
        })
        .unwrap();
        let e = streamed_in(&mut small, 0, &data, 7).unwrap_err();
        assert!(matches!(e, KvError::NoSpace(_)), "{e}");
        let mut other = SeedCache::new(CacheParams::new(64, 3, 8, 12)).unwrap();
        let e = streamed_in(&mut other, -1, &data, 1 << 20).unwrap_err();
        assert!(
            matches!(e, KvError::InvalidState(ref m) if m.contains("layers") || m.contains("transposed")),
            "{e}"
        );
        let mut c = filled(true);
        let mut load = c.state_in(0, ReadOptions::default()).unwrap();
        c.state_in_write(&mut load, &data).unwrap();
        c.state_in_finish(&mut load).unwrap();
        let e = c.state_in_write(&mut load, &data).unwrap_err();
        assert!(matches!(e, KvError::InvalidArg(_)), "{e}");
        let e = c.state_in(9, ReadOptions::default()).err().unwrap();
        assert!(matches!(e, KvError::OutOfRange(_)), "{e}");
    }
}
