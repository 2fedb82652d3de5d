//! llama.cpp's KV state payload, byte for byte: the seed's layout (b4944), the streams layout
//! (an `n_stream` prefix, one seq id per cell in single-sequence saves) and llama.cpp 0.1.161's
//! (the streams layout whose data header also records the K/V rotation). Reading parses the
//! whole input and validates it against the cache before anything is touched, so a failed load
//! leaves cells and tensors exactly as they were.

use std::fmt;
use std::ops::Range;

use crate::cache::KvCache;
use crate::error::{KvError, Result};
use crate::ggml_type::GgmlType;
use crate::payload_cells::{parse_cells, MAX_PAYLOAD_SEQS};
pub use crate::payload_cells::{CellMeta, PayloadCells};
use crate::sink::{Sink, SliceSink, WriteSink};
use crate::source::ByteSource;
pub(crate) use crate::source::Cursor;
use crate::storage::{KvBuffer, Tensor};
use crate::ubatch::UBatch;

/// Which llama.cpp era's layout a payload uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// llama.cpp b4944 (llama.node 0.3.16): `cell_count` first; single-sequence cells carry no
    /// seq ids.
    Seed,
    /// llama.cpp since mid-2025 (llama.node 1.x, node-llama-cpp 3.x): `n_stream` first, one
    /// block per stream; single-sequence cells carry `n_seq_id = 1` and the id. Recurrent
    /// caches have no stream prefix in either era.
    Streams,
    /// llama.cpp 0.1.161 (session v11, sequence v4): the streams layout, plus `n_rot_k` and
    /// `n_rot_v` after `v_trans` and `n_layer` in each stream's data header (the Hadamard
    /// rotation of quantized K/V; 0 = not rotated).
    StreamsRot,
}

impl Layout {
    /// Name used in messages and options.
    pub fn name(self) -> &'static str {
        match self {
            Layout::Seed => "seed",
            Layout::Streams => "streams",
            Layout::StreamsRot => "streams-rot",
        }
    }

    /// Whether the payload starts with `n_stream`.
    pub fn has_stream_prefix(self) -> bool {
        self != Layout::Seed
    }

    /// Whether each stream's data header records `n_rot_k` / `n_rot_v`.
    pub fn records_rotation(self) -> bool {
        self == Layout::StreamsRot
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

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
    pub part: Option<crate::parts::PartRole>,
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

/// The V block of one layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VBlock {
    /// One row per cell.
    Rows {
        ty: i32,
        row_size: u64,
        data: Range<usize>,
    },
    /// Transposed: `n_embd` rows of `cell_count` elements of `el_size` bytes.
    Transposed {
        ty: i32,
        el_size: u32,
        n_embd: u32,
        data: Range<usize>,
    },
}

/// K and V of one layer in a payload (data as byte ranges of the input).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerBlock {
    /// K type id.
    pub k_type: i32,
    /// K row size.
    pub k_row_size: u64,
    /// K rows.
    pub k_data: Range<usize>,
    /// V block.
    pub v: VBlock,
}

/// One stream (the whole payload in the seed's layout).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamBlock {
    /// Cells in payload order.
    pub cells: PayloadCells,
    /// Whether V is transposed (absent for an empty stream).
    pub v_trans: Option<bool>,
    /// Layers (empty for an empty stream).
    pub layers: Vec<LayerBlock>,
    /// `(n_rot_k, n_rot_v)` from the data header of the streams-rot layout.
    pub n_rot: Option<(u32, u32)>,
    /// The `n_layer` the data header declares. It equals `layers.len()` except in the
    /// recurrent part of a hybrid memory, which declares every model layer but writes only the
    /// recurrent ones.
    pub n_layer_declared: u32,
}

/// A payload parsed structurally, without a cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParsedPayload {
    /// Layout it was parsed as.
    pub layout: Layout,
    /// Streams (one for the seed layout).
    pub streams: Vec<StreamBlock>,
    /// Bytes consumed.
    pub len: usize,
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

pub(crate) const MAX_LAYERS: u32 = 4096;

/// A payload's `n_stream`, refused when no context has that many streams.
pub(crate) fn checked_n_stream(n: u32) -> Result<u32> {
    if n == 0 || n > MAX_PAYLOAD_SEQS {
        return Err(KvError::InvalidState(format!(
            "n_stream {n} is implausible"
        )));
    }
    Ok(n)
}

/// A stream's `v_trans` flag, 0 or 1.
pub(crate) fn checked_v_trans(x: u32) -> Result<bool> {
    match x {
        0 => Ok(false),
        1 => Ok(true),
        x => Err(KvError::InvalidState(format!(
            "v_trans must be 0 or 1, got {x}"
        ))),
    }
}

/// A stream's `n_layer`, refused when no model has that many layers.
pub(crate) fn checked_n_layer(n: u32) -> Result<u32> {
    if n == 0 || n > MAX_LAYERS {
        return Err(KvError::InvalidState(format!("n_layer {n} is implausible")));
    }
    Ok(n)
}

/// Parses one stream. In the seed's layout (and the stream-less recurrent one) the data header
/// (V layout, layer count, per-layer types and row sizes) follows even when no cell does; a
/// stream of today's layout ends after a 0 `cell_count`.
fn parse_stream<S: ByteSource + ?Sized>(
    c: &mut Cursor<'_, S>,
    s: usize,
    header_when_empty: bool,
    rot: bool,
) -> Result<StreamBlock> {
    parse_stream_with(c, s, header_when_empty, rot, None)
}

/// [`parse_stream`], with `blocks` layer blocks instead of the declared `n_layer` when given.
pub(crate) fn parse_stream_with<S: ByteSource + ?Sized>(
    c: &mut Cursor<'_, S>,
    s: usize,
    header_when_empty: bool,
    rot: bool,
    blocks: Option<u32>,
) -> Result<StreamBlock> {
    let cell_count = c.u32(format_args!("stream {s} cell_count"))?;
    // each cell takes at least 8 bytes: refuse absurd counts before allocating
    if cell_count as usize > c.remaining() / 8 {
        return Err(KvError::InvalidState(format!(
            "stream {s}: cell_count {cell_count} exceeds what the remaining {} bytes can hold",
            c.remaining()
        )));
    }
    let cells = parse_cells(c, cell_count)?;
    if cell_count == 0 && !header_when_empty {
        return Ok(StreamBlock {
            cells,
            v_trans: None,
            layers: Vec::new(),
            n_rot: None,
            n_layer_declared: 0,
        });
    }
    let v_trans = checked_v_trans(c.u32("v_trans")?)?;
    let n_layer = checked_n_layer(c.u32("n_layer")?)?;
    let n_rot = if rot {
        Some((c.u32("n_rot_k")?, c.u32("n_rot_v")?))
    } else {
        None
    };
    let n_blocks = match blocks {
        Some(b) if b <= n_layer => b,
        Some(b) => {
            return Err(KvError::InvalidState(format!(
                "{b} layer blocks exceed the declared n_layer {n_layer}"
            )))
        }
        None => n_layer,
    };
    let n = cell_count as usize;
    let mut k_blocks = Vec::with_capacity(n_blocks as usize);
    for il in 0..n_blocks {
        let ty = c.i32(format_args!("layer {il} k_type"))?;
        let row = c.u64(format_args!("layer {il} k_row_size"))?;
        let len = (row as usize)
            .checked_mul(n)
            .ok_or_else(|| KvError::InvalidState(format!("layer {il}: K size overflows")))?;
        let data = c.range(len, format_args!("layer {il} K rows"))?;
        k_blocks.push((ty, row, data));
    }
    let mut layers = Vec::with_capacity(n_blocks as usize);
    for (il, (k_type, k_row_size, k_data)) in k_blocks.into_iter().enumerate() {
        let ty = c.i32(format_args!("layer {il} v_type"))?;
        let v = if v_trans {
            let el_size = c.u32(format_args!("layer {il} v_size_el"))?;
            let n_embd = c.u32(format_args!("layer {il} n_embd_v_gqa"))?;
            let len = (el_size as usize)
                .checked_mul(n_embd as usize)
                .and_then(|x| x.checked_mul(n))
                .ok_or_else(|| KvError::InvalidState(format!("layer {il}: V size overflows")))?;
            VBlock::Transposed {
                ty,
                el_size,
                n_embd,
                data: c.range(len, format_args!("layer {il} V"))?,
            }
        } else {
            let row_size = c.u64(format_args!("layer {il} v_row_size"))?;
            let len = (row_size as usize)
                .checked_mul(n)
                .ok_or_else(|| KvError::InvalidState(format!("layer {il}: V size overflows")))?;
            VBlock::Rows {
                ty,
                row_size,
                data: c.range(len, format_args!("layer {il} V rows"))?,
            }
        };
        layers.push(LayerBlock {
            k_type,
            k_row_size,
            k_data,
            v,
        });
    }
    Ok(StreamBlock {
        cells,
        v_trans: Some(v_trans),
        layers,
        n_rot,
        n_layer_declared: n_layer,
    })
}

impl ParsedPayload {
    /// Whether no stream has a data header (every stream is empty in a layout with a stream
    /// prefix): such a payload reads the same under the streams and streams-rot layouts.
    pub fn has_no_data_header(&self) -> bool {
        self.layout.has_stream_prefix() && self.streams.iter().all(|s| s.v_trans.is_none())
    }

    /// Every stream's cells, in payload order: the one stream's own, or several joined.
    pub fn cells(&self) -> Result<std::borrow::Cow<'_, PayloadCells>> {
        Ok(match self.streams.as_slice() {
            [one] => std::borrow::Cow::Borrowed(&one.cells),
            many => std::borrow::Cow::Owned(PayloadCells::concat(many.iter().map(|s| &s.cells))?),
        })
    }
}

/// Parses a payload structurally under `layout`, consuming it from `bytes[0..]` (a slice, or a
/// file through [`crate::source::ReadSource`]: only the metadata is read, K/V rows are stepped
/// over). With `exact`, trailing bytes are an error.
pub fn parse_payload<S: ByteSource + ?Sized>(
    bytes: &S,
    layout: Layout,
    exact: bool,
) -> Result<ParsedPayload> {
    let mut c = Cursor::new(bytes);
    let streams = match layout {
        Layout::Seed => vec![parse_stream(&mut c, 0, true, false)?],
        Layout::Streams | Layout::StreamsRot => {
            let n_stream = checked_n_stream(c.u32("n_stream")?)?;
            (0..n_stream as usize)
                .map(|s| parse_stream(&mut c, s, false, layout.records_rotation()))
                .collect::<Result<_>>()?
        }
    };
    if exact && c.remaining() != 0 {
        return Err(KvError::InvalidState(format!(
            "{} trailing bytes after the payload",
            c.remaining()
        )));
    }
    Ok(ParsedPayload {
        layout,
        streams,
        len: c.pos,
    })
}

/// The error of a payload that fits none of the candidate layouts, from each one's error.
pub(crate) fn no_layout_fits(mut errors: Vec<(Layout, KvError)>) -> KvError {
    if errors.len() == 1 {
        return errors.remove(0).1;
    }
    // a capacity problem is the real answer when the structure itself parsed
    if let Some((_, e)) = errors
        .iter()
        .find(|(_, e)| matches!(e, KvError::NoSpace(_)))
    {
        return e.clone();
    }
    KvError::InvalidState(format!(
        "the payload fits no layout: {}",
        errors
            .iter()
            .map(|(l, e)| format!("as {l}: {e}"))
            .collect::<Vec<_>>()
            .join("; ")
    ))
}

/// The error of a payload that several layouts read.
pub(crate) fn ambiguous(layouts: impl Iterator<Item = Layout>) -> KvError {
    KvError::InvalidState(format!(
        "the payload is ambiguous: it parses as {}; pass the layout explicitly",
        layouts.map(|l| l.name()).collect::<Vec<_>>().join(" and ")
    ))
}

/// Checks the cells of a payload for one sequence (`Some(seq)`) or the whole cache of a cache
/// tracking `n_seq_max` sequences.
pub(crate) fn check_meta(
    p: &ParsedPayload,
    seq: Option<i32>,
    recurrent: bool,
    n_seq_max: u32,
) -> Result<()> {
    let single_ids = match (seq, p.layout, recurrent) {
        (None, _, _) => None,
        (Some(_), Layout::Seed, _) | (Some(_), _, true) => Some(0),
        (Some(_), Layout::Streams | Layout::StreamsRot, false) => Some(1),
    };
    for (s, stream) in p.streams.iter().enumerate() {
        let cells = &stream.cells;
        // whole columns first (vectorizable passes); the cell loop runs only to name a culprit
        let fine = match single_ids {
            Some(n) => cells.all_have_ids(n),
            None => cells
                .all_ids()
                .iter()
                .all(|&id| id >= 0 && (id as u32) < n_seq_max),
        } && (recurrent || cells.positions().iter().all(|&p| p >= 0));
        if fine {
            continue;
        }
        for (i, cell) in cells.iter().enumerate() {
            if let Some(n) = single_ids {
                if cell.seq_ids.len() != n {
                    return Err(KvError::InvalidState(format!(
                        "stream {s} cell {i}: a one-sequence payload in the {} layout has {n} seq ids per cell, found {}",
                        p.layout,
                        cell.seq_ids.len()
                    )));
                }
            } else if let Some(&id) = cell
                .seq_ids
                .iter()
                .find(|&&id| id < 0 || id as u32 >= n_seq_max)
            {
                return Err(KvError::InvalidState(format!(
                    "stream {s} cell {i}: seq id {id} is out of range [0, {n_seq_max}) of this cache"
                )));
            }
            if cell.pos < 0 && !recurrent {
                return Err(KvError::InvalidState(format!(
                    "stream {s} cell {i}: negative position {}",
                    cell.pos
                )));
            }
        }
    }
    Ok(())
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
    /// the rotation, so only the streams-rot layout may carry them.
    fn write_layout(&self, layout: Layout) -> Result<Layout> {
        let layout = self.effective_layout(layout);
        let (k, v) = (self.params.n_rot_k, self.params.n_rot_v);
        if (k != 0 || v != 0) && !layout.records_rotation() && !self.params.recurrent {
            return Err(KvError::Unsupported(format!(
                "the cache's K/V are rotated (nRotK {k}, nRotV {v}); the {layout} layout cannot record that: write 'streams-rot' (session v11 / sequence v4), or re-type to an unrotated cache first"
            )));
        }
        Ok(layout)
    }

    /// Bytes of a stream's cell count and cell metadata: per cell its position and seq id
    /// count, and its seq ids: all of its sequences in a whole-cache save; in a one-sequence
    /// save none (seed) or the saved one (today's layouts).
    fn meta_size(&self, ranges: &[(usize, usize)], seq: i32, layout: Layout) -> usize {
        let cells: usize = ranges.iter().map(|r| r.1 - r.0).sum();
        let ids = match (seq, layout) {
            (-1, _) => {
                let seqs = self.cells.seqs_column();
                ranges
                    .iter()
                    .map(|&(a, b)| seqs[a..b].iter().map(|s| s.len()).sum::<usize>())
                    .sum()
            }
            (_, Layout::Seed) => 0,
            (_, Layout::Streams | Layout::StreamsRot) => cells,
        };
        4 + 8 * cells + 4 * ids
    }

    /// Writes the cell count and the metadata of the cells `ranges` into `out`, which is
    /// [`KvCache::meta_size`] bytes long. Fixed-size cells go out as fixed-size chunks, which
    /// compile to plain stores (a cursor over the slice cost 3.5 ns per cell).
    fn put_cells_meta(&self, out: &mut [u8], ranges: &[(usize, usize)], seq: i32, layout: Layout) {
        let (pos, seqs) = (self.cells.pos_column(), self.cells.seqs_column());
        let n: usize = ranges.iter().map(|r| r.1 - r.0).sum();
        let (count, out) = out.split_at_mut(4);
        count.copy_from_slice(&(n as u32).to_le_bytes());
        let cells = ranges.iter().flat_map(|&(a, b)| a..b);
        match (seq, layout) {
            (-1, _) => {
                let mut at = 0;
                for i in cells {
                    let set = seqs[i];
                    // a cell of one sequence, the common case: one fixed-size write
                    if set.0.is_power_of_two() {
                        let id = set.0.trailing_zeros() as i32;
                        let dst: &mut [u8; 12] = (&mut out[at..at + 12]).try_into().unwrap();
                        dst[..4].copy_from_slice(&pos[i].to_le_bytes());
                        dst[4..8].copy_from_slice(&1u32.to_le_bytes());
                        dst[8..].copy_from_slice(&id.to_le_bytes());
                        at += 12;
                        continue;
                    }
                    let dst = &mut out[at..at + 8 + 4 * set.len()];
                    dst[..4].copy_from_slice(&pos[i].to_le_bytes());
                    dst[4..8].copy_from_slice(&(set.len() as u32).to_le_bytes());
                    for (id, f) in dst[8..].chunks_exact_mut(4).zip(set.iter()) {
                        id.copy_from_slice(&(f as i32).to_le_bytes());
                    }
                    at += dst.len();
                }
            }
            (_, Layout::Seed) => {
                for (dst, i) in out.chunks_exact_mut(8).zip(cells) {
                    dst[..4].copy_from_slice(&pos[i].to_le_bytes());
                    dst[4..].copy_from_slice(&0u32.to_le_bytes());
                }
            }
            (s, Layout::Streams | Layout::StreamsRot) => {
                for (dst, i) in out.chunks_exact_mut(12).zip(cells) {
                    dst[..4].copy_from_slice(&pos[i].to_le_bytes());
                    dst[4..8].copy_from_slice(&1u32.to_le_bytes());
                    dst[8..].copy_from_slice(&s.to_le_bytes());
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
            for l in &self.layers {
                size += 12 + n * l.k_row + 12 + n * l.v_row;
            }
        }
        size
    }

    /// The plan of `state_write(seq, layout, n_stream)`.
    pub(crate) fn write_plan(&self, seq: i32, layout: Layout, n_stream: u32) -> Result<WritePlan> {
        let layout = self.write_layout(layout)?;
        let streams = self.stream_plan(seq, layout, n_stream)?;
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
            out.put(&(plan.streams.len() as u32).to_le_bytes())?;
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
        let put32 = |out: &mut dyn Sink, v: u32| out.put(&v.to_le_bytes());
        put32(out, self.v_trans() as u32)?;
        put32(out, self.params.n_layer)?;
        if layout.records_rotation() {
            put32(out, self.params.n_rot_k)?;
            put32(out, self.params.n_rot_v)?;
        }
        for l in &self.layers {
            out.put(&self.params.type_k.id().to_le_bytes())?;
            out.put(&(l.k_row as u64).to_le_bytes())?;
            if !out.skip(n * l.k_row) {
                for &(a, b) in ranges {
                    out.put_from(l.k.as_ref(), a * l.k_row, (b - a) * l.k_row)?;
                }
            }
            report(out.written())?;
        }
        let size = self.params.size as usize;
        for l in &self.layers {
            out.put(&self.params.type_v.id().to_le_bytes())?;
            if self.v_trans() {
                let el = self.params.type_v.type_size();
                put32(out, el as u32)?;
                put32(out, l.n_embd_v as u32)?;
                if !out.skip(n * el * l.n_embd_v) {
                    for j in 0..l.n_embd_v {
                        for &(a, b) in ranges {
                            out.put_from(l.v.as_ref(), (a + j * size) * el, (b - a) * el)?;
                        }
                    }
                }
            } else {
                out.put(&(l.v_row as u64).to_le_bytes())?;
                if !out.skip(n * l.v_row) {
                    for &(a, b) in ranges {
                        out.put_from(l.v.as_ref(), a * l.v_row, (b - a) * l.v_row)?;
                    }
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
            let attempt = parse_payload(data, l, true).and_then(|p| {
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
                && k_row == self.layers[0].k_row as u64)
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
        if let Some(p) = progress {
            if !p(0, data.len() as u64) {
                return Err(KvError::Aborted("state read aborted".into()));
            }
        }
        let cells = parsed.cells()?;
        let (undo, placed) = self.place_cells(&cells, dest, opts.allow_scattered)?;
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
    ) -> Result<(crate::rollback::CellsUndo, Vec<usize>)> {
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
        self.seq_rm(dest, -1, -1)?;
        if cells.is_empty() {
            return Ok(Vec::new());
        }
        let n = cells.len();
        let ub = UBatch {
            pos: cells.positions().iter().map(|&p| p.max(0)).collect(),
            n_seq_tokens: n as u32,
            seq_ids: vec![vec![dest]],
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
        for (k, &cell) in free.iter().enumerate() {
            self.cells.set_pos(cell, cells.positions()[k]);
            self.cells.insert_seq(cell, dest as usize);
        }
        self.cells.used += n as u32;
        self.cells.settle();
        Ok(free)
    }

    pub(crate) fn place_whole(&mut self, cells: &PayloadCells) -> Result<Vec<usize>> {
        let recurrent = self.params.recurrent;
        let mut tails = Vec::new();
        if recurrent {
            tails = vec![-1i32; self.cells.len()];
            for (i, c) in cells.iter().enumerate() {
                for &id in c.seq_ids {
                    let t = tails.get_mut(id as usize).ok_or_else(|| {
                        KvError::InvalidState(format!(
                            "seq id {id} has no state cell in a cache of {} cells",
                            self.cells.len()
                        ))
                    })?;
                    if *t != -1 {
                        return Err(KvError::InvalidState(format!(
                            "duplicate tail for seq id {id} in cells {} and {i}",
                            *t
                        )));
                    }
                    *t = i as i32;
                }
            }
        }
        self.cells.reset();
        self.head = 0;
        self.cells
            .fill_free(0, cells.positions(), |k| cells.seq_set(k));
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
                write_rows_at(l.k.as_mut(), l.k_row, cells, contiguous, k)?;
                match &b.v {
                    VBlock::Rows { data: r, .. } => {
                        write_rows_at(l.v.as_mut(), l.v_row, cells, contiguous, &data[r.clone()])?;
                    }
                    VBlock::Transposed { data: r, .. } => {
                        // the payload holds V as n_embd_v runs of n elements: exactly the
                        // strided layout of a contiguous cell range (one 2D copy on a device)
                        let v = &data[r.clone()];
                        let (el, pitch) = (lay.v_el, lay.size * lay.v_el);
                        if contiguous {
                            l.v.write_2d(cells[0] * el, n * el, pitch, v)?;
                        } else {
                            for (j, column) in v.chunks_exact(n * el).enumerate() {
                                for (k, &c) in cells.iter().enumerate() {
                                    l.v.write(c * el + j * pitch, &column[k * el..(k + 1) * el])?;
                                }
                            }
                        }
                    }
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
}

/// A layer's K and V bytes, kept while a load writes to device memory.
type TensorBackup = (Vec<u8>, Vec<u8>);

fn write_rows_at(
    buf: &mut dyn KvBuffer,
    row: usize,
    cells: &[usize],
    contiguous: bool,
    rows: &[u8],
) -> Result<()> {
    if contiguous {
        return buf.write(cells[0] * row, rows);
    }
    for (k, &c) in cells.iter().enumerate() {
        buf.write(c * row, &rows[k * row..(k + 1) * row])?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
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
