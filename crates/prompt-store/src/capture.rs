//! One sequence's state as the store keeps it: a [`Capture`] of a live cache or of a llama.cpp
//! file, split by memory part. A file's KV rows are read in place from its bytes (the core's
//! structural parse gives every layer's data range), so ingesting a file copies each row once,
//! into its block; a recurrent part is kept as llama.cpp's own bytes.

use llama_kv_cache::state::dsv4::{Compressed, Piece};
use llama_kv_cache::state::files::{FileKind, Inspection};
use llama_kv_cache::state::parts::{Part, PartKind, PartRole};
use llama_kv_cache::state::{StreamBlock, VBlock};
use llama_kv_cache::tensors::transpose::{transpose, Shape as TransposeShape};
use llama_kv_cache::{KvError, Layout, Memory, MemoryKind, SeedCache, Tensor, Window};

use crate::error::{StoreError, StoreResult};
use crate::geometry::{put_exts, Geometry};
use crate::shape::{Dsv4Shape, FileFormat, KvShape, Shape};

/// Where a capture's rows are: a live cache, or one KV part of a file's bytes.
pub(crate) enum RowSource<'a> {
    Cache(&'a SeedCache),
    Part {
        /// The whole file.
        bytes: &'a [u8],
        /// Offset of the part's data ranges in `bytes`.
        base: usize,
        stream: &'a StreamBlock,
        geometry: Geometry,
    },
}

impl RowSource<'_> {
    /// The per-layer shapes of the rows.
    pub fn geometry(&self) -> StoreResult<Geometry> {
        match self {
            RowSource::Cache(c) => Geometry::of_cache(c),
            RowSource::Part { geometry, .. } => Ok(geometry.clone()),
        }
    }

    /// Appends the K (or V, as rows) of layer `il` for `cells`, in order: one read for a run
    /// of consecutive cells (the usual case), else one per cell.
    pub fn append(
        &self,
        il: usize,
        is_v: bool,
        cells: &[u32],
        out: &mut Vec<u8>,
    ) -> StoreResult<()> {
        let contiguous = cells.windows(2).all(|w| w[1] == w[0] + 1);
        let runs: Vec<(u32, usize)> = if contiguous {
            cells
                .first()
                .map(|&c| (c, cells.len()))
                .into_iter()
                .collect()
        } else {
            cells.iter().map(|&c| (c, 1)).collect()
        };
        for (first, n) in runs {
            match self {
                RowSource::Cache(c) => {
                    let which = if is_v { Tensor::V } else { Tensor::K };
                    out.extend_from_slice(&c.read_rows(il as u32, which, first, n as u32)?);
                }
                RowSource::Part {
                    bytes,
                    base,
                    stream,
                    geometry,
                } => {
                    let layer = &stream.layers[il];
                    let first = first as usize;
                    let at = |r: &std::ops::Range<usize>, row: usize| {
                        &bytes[base + r.start + first * row..base + r.start + (first + n) * row]
                    };
                    match (&layer.v, is_v) {
                        (_, false) => {
                            out.extend_from_slice(at(&layer.k_data, layer.k_row_size as usize))
                        }
                        (VBlock::Rows { data, row_size, .. }, true) => {
                            out.extend_from_slice(at(data, *row_size as usize))
                        }
                        // a part without V: its V rows are of no bytes
                        (VBlock::Absent, true) => {}
                        (
                            VBlock::Transposed {
                                data,
                                el_size,
                                n_embd,
                                ..
                            },
                            true,
                        ) => {
                            // n_embd runs of cell_count elements: the cells' columns become rows
                            let (el, channels) = (*el_size as usize, *n_embd as usize);
                            let count = stream.cells.len();
                            let start = out.len();
                            crate::payload::grow(out, n * geometry.layers[il].v_row as usize)?;
                            let shape = TransposeShape {
                                rows: channels,
                                cols: n,
                                el,
                                src_stride: count * el,
                                dst_stride: channels * el,
                            };
                            let src = &bytes[base + data.start + first * el..base + data.end];
                            transpose(src, &mut out[start..], shape);
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

impl RowSource<'_> {
    /// Appends the cell extension of each of `cells` as blocks keep them (nothing when the
    /// rows' cells carry none).
    pub fn append_exts(&self, cells: &[u32], out: &mut Vec<u8>) {
        match self {
            RowSource::Cache(c) => {
                let table = c.cells();
                put_exts(out, cells.iter().map(|&i| table.ext(i as usize)));
            }
            RowSource::Part { stream, .. } => {
                let exts = stream.cells.exts();
                if !exts.is_empty() {
                    put_exts(out, cells.iter().map(|&i| exts[i as usize]));
                }
            }
        }
    }
}

/// The cells of one sequence, in position order.
pub(crate) struct KvRows<'a> {
    pub source: RowSource<'a>,
    /// `cells[i]` holds `positions[i]`; positions ascend.
    pub cells: Vec<u32>,
    pub positions: Vec<i32>,
}

impl<'a> KvRows<'a> {
    /// Sequence `seq` of a live cache.
    fn of_cache(cache: &'a SeedCache, seq: i32) -> StoreResult<KvRows<'a>> {
        let cells = cache.cells();
        let found: Vec<(i32, u32)> = (0..cells.len())
            .map(|i| (i, cells.get(i)))
            .filter(|(_, c)| c.seqs.contains(seq as usize))
            .map(|(i, c)| (c.pos, i as u32))
            .collect();
        Self::sorted(RowSource::Cache(cache), found, seq)
    }

    /// The cells of a file's KV part that belong to `seq` (every cell when `seq` is `None`:
    /// a sequence file's one sequence).
    fn of_part(
        bytes: &'a [u8],
        base: usize,
        part: &'a Part,
        seq: Option<i32>,
    ) -> StoreResult<KvRows<'a>> {
        let with_cells: Vec<&StreamBlock> = part
            .payload
            .streams
            .iter()
            .filter(|s| !s.cells.is_empty())
            .collect();
        let stream = match with_cells.as_slice() {
            [s] => *s,
            _ => {
                return Err(StoreError::NotPrefix(format!(
                    "the {} part holds {} streams with cells; the store ingests one sequence",
                    part.role,
                    with_cells.len()
                )))
            }
        };
        let geometry = Geometry {
            layers: stream.layer_shapes()?,
            ext: stream.cells.ext_kind(),
            no_v: part.payload.no_v(),
        };
        let found: Vec<(i32, u32)> = stream
            .cells
            .iter()
            .enumerate()
            .filter(|(i, _)| seq.is_none_or(|s| stream.cells.seq_ids(*i).contains(&s)))
            .map(|(i, c)| (c.pos, i as u32))
            .collect();
        let source = RowSource::Part {
            bytes,
            base,
            stream,
            geometry,
        };
        Self::sorted(source, found, seq.unwrap_or(0))
    }

    fn sorted(
        source: RowSource<'a>,
        mut found: Vec<(i32, u32)>,
        seq: i32,
    ) -> StoreResult<KvRows<'a>> {
        found.sort_unstable();
        if let Some(w) = found.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(StoreError::NotPrefix(format!(
                "sequence {seq} holds position {} twice",
                w[0].0
            )));
        }
        let (positions, cells) = found.into_iter().unzip();
        Ok(KvRows {
            source,
            cells,
            positions,
        })
    }

    /// Whether the rows are exactly positions `0..n`.
    pub fn is_prefix(&self, n: usize) -> bool {
        self.positions.len() == n
            && self
                .positions
                .iter()
                .enumerate()
                .all(|(i, &p)| p == i as i32)
    }

    /// The rows a token after the last one still sees through `window` (llama.cpp leaves the
    /// others out of a sequence's state).
    fn seen_by(self, window: Window) -> KvRows<'a> {
        let Some(&last) = self.positions.last() else {
            return self;
        };
        let (cells, positions) = self
            .cells
            .iter()
            .zip(&self.positions)
            .filter(|(_, &p)| !window.masks(p, last))
            .map(|(&c, &p)| (c, p))
            .unzip();
        KvRows {
            source: self.source,
            cells,
            positions,
        }
    }

    /// The number of cells, which must hold positions `0..n` (sequence `seq`, for messages).
    fn prefix_len(&self, seq: i32) -> StoreResult<usize> {
        let n = self.positions.len();
        if self.is_prefix(n) {
            Ok(n)
        } else {
            Err(StoreError::NotPrefix(format!(
                "sequence {seq}: its {n} cells must hold positions 0..{n} once each"
            )))
        }
    }

    fn shape(&self) -> StoreResult<KvShape> {
        let rot = match &self.source {
            RowSource::Cache(c) => (c.params().n_rot_k, c.params().n_rot_v),
            RowSource::Part { stream, .. } => stream.n_rot.unwrap_or((0, 0)),
        };
        Ok(KvShape {
            layers: self.source.geometry()?,
            rot,
        })
    }
}

/// The shape of a live unified cache.
pub(crate) fn unified_shape(cache: &SeedCache) -> StoreResult<Shape> {
    let p = cache.params();
    Ok(Shape {
        memory: MemoryKind::Unified,
        main: Some(KvShape {
            layers: Geometry::of_cache(cache)?,
            rot: (p.n_rot_k, p.n_rot_v),
        }),
        swa: None,
        recurrent: None,
        window: None,
        dsv4: None,
    })
}

/// One sequence's state after `len` tokens.
pub(crate) struct Capture<'a> {
    pub shape: Shape,
    /// The part kept per position: rows of positions `0..len`.
    pub main: Option<KvRows<'a>>,
    /// iSWA: the sliding-window rows the state holds; dsa, hybrid-idx: the indexer's rows.
    pub swa: Option<KvRows<'a>>,
    /// dsa-iswa: the sliding-window rows the state holds (its indexer's are in `swa`).
    pub window: Option<KvRows<'a>>,
    /// The recurrent part, as llama.cpp writes it for one sequence (no seq ids in its cell).
    pub recurrent: Vec<u8>,
    /// Tokens the state covers.
    pub len: usize,
    /// The recurrent state's position + 1, when there is one: a checkpoint needs it to be
    /// `len` exactly.
    pub recurrent_end: Option<usize>,
}

/// The cell of a one-sequence recurrent part, rewritten without seq ids (as llama.cpp writes a
/// sequence's state): `cell_count 1, pos, n_seq_id 0`, then the rest unchanged. Returns it and
/// the cell's position.
fn recurrent_one_sequence(part: &[u8], seq: Option<i32>) -> StoreResult<(Vec<u8>, i32)> {
    let bad = |why: String| StoreError::Cache(KvError::InvalidState(why));
    let u32_at = |at: usize| -> StoreResult<u32> {
        part.get(at..at + 4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
            .ok_or_else(|| bad("the recurrent part is truncated".into()))
    };
    let count = u32_at(0)?;
    if count != 1 {
        return Err(StoreError::NotPrefix(format!(
            "the recurrent part holds {count} states; the store ingests the state of exactly one sequence"
        )));
    }
    let pos = u32_at(4)? as i32;
    let n_ids = u32_at(8)? as usize;
    if n_ids > 1 || (n_ids == 1 && seq.is_some_and(|s| u32_at(12).ok() != Some(s as u32))) {
        return Err(StoreError::NotPrefix(format!(
            "the recurrent state belongs to {n_ids} sequences; the store ingests one"
        )));
    }
    let rest = 12 + 4 * n_ids;
    let mut out = Vec::new();
    crate::payload::grow(&mut out, part.len() - 4 * n_ids)?;
    out[..4].copy_from_slice(&1u32.to_le_bytes());
    out[4..8].copy_from_slice(&pos.to_le_bytes());
    out[12..].copy_from_slice(&part[rest..]);
    Ok((out, pos))
}

fn pending_shift() -> StoreError {
    StoreError::NotPrefix(
        "the cache has a pending K-shift (apply it with update() first): its K rows are not those of positions 0..n"
            .into(),
    )
}

impl<'a> Capture<'a> {
    /// Sequence `seq` of a live cache (a unified or recurrent one), `tokens` being its prompt.
    pub fn of_cache(cache: &'a SeedCache, seq: i32, tokens: usize) -> StoreResult<Capture<'a>> {
        if cache.has_shift() {
            return Err(pending_shift());
        }
        if cache.recurrent() {
            let bytes = cache.state_write(seq, Layout::Seed, 1, None)?;
            let (recurrent, pos) = recurrent_one_sequence(&bytes, None)?;
            return Ok(Capture {
                shape: Shape {
                    memory: MemoryKind::Recurrent,
                    main: None,
                    swa: None,
                    recurrent: Some(recurrent.len() as u64),
                    window: None,
                    dsv4: None,
                },
                main: None,
                swa: None,
                window: None,
                recurrent,
                len: tokens,
                recurrent_end: Some((pos + 1) as usize),
            });
        }
        let main = KvRows::of_cache(cache, seq)?;
        let n = main.prefix_len(seq)?;
        Ok(Capture {
            shape: unified_shape(cache)?,
            main: Some(main),
            swa: None,
            window: None,
            recurrent: Vec::new(),
            len: n.min(tokens),
            recurrent_end: None,
        })
    }

    /// Sequence `seq` of a live memory of today's kinds (iSWA, hybrid), `tokens` being its
    /// prompt: each attention part's rows straight from the stream that holds the sequence (a
    /// window cache's whole range when it holds it, as with `swa_full`, else the cells its
    /// window still sees, as llama.cpp writes them) and a hybrid's recurrent state as
    /// llama.cpp writes it for one sequence.
    pub fn of_memory(memory: &'a dyn Memory, seq: i32, tokens: usize) -> StoreResult<Capture<'a>> {
        if memory.has_shift() {
            return Err(pending_shift());
        }
        let mut main = None;
        let mut swa = None;
        for (role, window, cache) in memory.attention_streams(seq)? {
            let rows = KvRows::of_cache(cache, seq)?;
            match role {
                PartRole::Swa => swa = Some((rows, window)),
                _ => main = Some(rows),
            }
        }
        let (recurrent, recurrent_end) = match memory.recurrent_part_state(seq)? {
            Some(state) => {
                let (r, pos) = recurrent_one_sequence(&state, None)?;
                (r, Some((pos + 1) as usize))
            }
            None => (Vec::new(), None),
        };
        let len = match &main {
            Some(m) => m.prefix_len(seq)?.min(tokens),
            None => tokens,
        };
        let swa = swa.map(|(rows, window)| {
            if rows.is_prefix(len) {
                rows
            } else {
                rows.seen_by(window)
            }
        });
        Capture::of_parts(
            memory.state_kind(),
            [main, swa, None],
            (recurrent, recurrent_end),
            len,
        )
    }

    /// A capture of these parts (`recurrent`: its state and end, when the memory has one),
    /// with the shape they make.
    fn of_parts(
        memory: MemoryKind,
        [main, swa, window]: [Option<KvRows<'a>>; 3],
        (recurrent, recurrent_end): (Vec<u8>, Option<usize>),
        len: usize,
    ) -> StoreResult<Capture<'a>> {
        let shape_of = |rows: &Option<KvRows<'a>>| rows.as_ref().map(KvRows::shape).transpose();
        let shape = Shape {
            memory,
            main: shape_of(&main)?,
            swa: shape_of(&swa)?,
            recurrent: recurrent_end.map(|_| recurrent.len() as u64),
            window: shape_of(&window)?,
            dsv4: None,
        };
        Ok(Capture {
            shape,
            main,
            swa,
            window,
            recurrent,
            len,
            recurrent_end,
        })
    }

    /// The one sequence of a llama.cpp session or sequence file's bytes: its shape, its state,
    /// its tokens and the file's format. `recurrent` answers what an old sequence file cannot
    /// tell (the store's model is recurrent); without it, a stream-less payload whose one cell
    /// ends the tokens is a recurrent state (a KV prefix holds positions 0..n).
    pub fn of_file(
        bytes: &'a [u8],
        ins: &'a Inspection,
        recurrent: Option<bool>,
    ) -> StoreResult<(Capture<'a>, FileFormat)> {
        let whole_recurrent = ins.parts.len() == 1
            && ins
                .recurrent()
                .or(recurrent)
                .unwrap_or_else(|| ends_in_one_cell(ins));
        let kv_layout = match ins.parts.iter().find(|p| p.kind == PartKind::Kv) {
            Some(p) if !whole_recurrent => p.payload.layout,
            // a recurrent memory has no layout of its own: the era of the file decides (the
            // seed's sessions carry the outputs block)
            _ if ins.header.kind.records_rotation(ins.header.version) => Layout::StreamsRot,
            _ if ins.outputs.is_some() => Layout::Seed,
            _ => Layout::Streams,
        };
        let v_trans = ins
            .parts
            .iter()
            .filter(|p| p.kind == PartKind::Kv)
            .flat_map(|p| p.payload.streams.iter())
            .find_map(|s| s.v_trans);
        let tokens = &ins.header.tokens;
        let format = FileFormat {
            kind: ins.header.kind,
            version: ins.header.version,
            layout: kv_layout,
            flash_attn: v_trans == Some(false),
            arch: ins.arch.clone(),
        };
        // a partial dsv4 state (llama-server's checkpoint) lacks the compressed caches
        if ins.compressed.as_ref().is_some_and(|c| c.partial) {
            return Err(StoreError::Cache(KvError::Unsupported(
                "a partial dsv4 state holds no compressed caches: the store ingests whole states"
                    .into(),
            )));
        }
        let kv_parts: Vec<&Part> = ins
            .parts
            .iter()
            .filter(|p| p.kind == PartKind::Kv && !whole_recurrent)
            .collect();
        let recurrent_part = ins
            .parts
            .iter()
            .find(|p| whole_recurrent || p.kind == PartKind::Recurrent)
            .map(|p| &bytes[ins.payload_offset + p.range.start..ins.payload_offset + p.range.end]);
        // the file's one sequence: a sequence file's cells are all its own; a session's is the
        // only one with cells
        let seq = match ins.header.kind {
            FileKind::Sequence => None,
            FileKind::Session => Some(session_sequence(&kv_parts, recurrent_part)?),
        };
        let mut main = None;
        let mut swa = None;
        let mut window = None;
        for part in kv_parts {
            let base = ins.payload_offset + part.range.start;
            let rows = KvRows::of_part(bytes, base, part, seq)?;
            match part.role {
                // dsa-iswa's window, after its indexer
                PartRole::Swa if ins.memory == MemoryKind::DsaIswa => window = Some(rows),
                // the second KV part: a window, or a dsa memory's indexer
                PartRole::Swa | PartRole::Indexer => swa = Some(rows),
                _ => main = Some(rows),
            }
        }
        let (recurrent, recurrent_end) = match (&ins.compressed, recurrent_part) {
            (Some(c), _) => {
                let last = swa.as_ref().and_then(|s| s.positions.last()).copied();
                let (r, pos) = dsv4_one_sequence(bytes, ins, c, seq, last.unwrap_or(-1))?;
                (r, Some((pos + 1) as usize))
            }
            (None, Some(part)) => {
                let (r, pos) = recurrent_one_sequence(part, seq)?;
                (r, Some((pos + 1) as usize))
            }
            (None, None) => (Vec::new(), None),
        };
        let len = match &main {
            Some(m) => m.prefix_len(seq.unwrap_or(0))?.min(tokens.len()),
            None => tokens.len(),
        };
        let memory = if whole_recurrent {
            MemoryKind::Recurrent
        } else {
            ins.memory
        };
        let mut capture =
            Capture::of_parts(memory, [main, swa, window], (recurrent, recurrent_end), len)?;
        if let Some(c) = &ins.compressed {
            // its sections grow with P: kept whole per checkpoint, their geometry in the shape
            capture.shape.recurrent = None;
            let n_stream = ins.parts[0].payload.streams.len() as u32;
            capture.shape.dsv4 = Some(Dsv4Shape::of(c, n_stream));
        }
        Ok((capture, format))
    }
}

/// A dsv4 state's compressed caches and compressor states of its one sequence (`seq` of a
/// session, whose stream holds it; a sequence file's are one stream already), as llama.cpp
/// writes them for one sequence whose last position is `last` (its window cache's). Returns
/// them and that position.
fn dsv4_one_sequence(
    bytes: &[u8],
    ins: &Inspection,
    c: &Compressed,
    seq: Option<i32>,
    last: i32,
) -> StoreResult<(Vec<u8>, i32)> {
    let at = ins.payload_offset;
    let pieces: Vec<Piece> = match seq {
        None => {
            let (first, end) = (
                &c.sections[0].range,
                &c.sections[c.sections.len() - 1].range,
            );
            vec![Piece::Input(first.start..end.end)]
        }
        Some(s) => c.one_sequence(s, last)?,
    };
    let mut out = Vec::new();
    crate::payload::grow(&mut out, pieces.iter().map(Piece::len).sum())?;
    let mut o = 0;
    for p in &pieces {
        let src = match p {
            Piece::Bytes(b) => &b[..],
            Piece::Input(r) => &bytes[at + r.start..at + r.end],
        };
        out[o..o + src.len()].copy_from_slice(src);
        o += src.len();
    }
    Ok((out, last))
}

/// Whether a single stream-less payload holds one cell at the last token's position: a
/// recurrent state, since a KV cache of those tokens holds every position.
fn ends_in_one_cell(ins: &Inspection) -> bool {
    let n = ins.header.tokens.len();
    let streams = &ins.parts[0].payload.streams;
    n > 1
        && ins.parts[0].payload.layout == Layout::Seed
        && streams.len() == 1
        && streams[0].cells.positions() == [n as i32 - 1]
}

/// The one sequence of a session that holds a state: the seq id of every KV cell, or of the
/// recurrent state's cell.
fn session_sequence(kv_parts: &[&Part], recurrent: Option<&[u8]>) -> StoreResult<i32> {
    let mut ids: Vec<i32> = kv_parts
        .iter()
        .flat_map(|p| p.payload.streams.iter())
        .flat_map(|s| s.cells.all_ids().iter().copied())
        .collect();
    if kv_parts.is_empty() {
        // a recurrent session: the seq id of its one cell
        let id = recurrent
            .and_then(|r| r.get(12..16))
            .map(|b| i32::from_le_bytes(b.try_into().expect("4 bytes")));
        ids.extend(id);
    }
    ids.sort_unstable();
    ids.dedup();
    match ids.as_slice() {
        [s] => Ok(*s),
        [] => Ok(0),
        _ => Err(StoreError::NotPrefix(format!(
            "the session holds sequences {ids:?}; the store ingests sessions of exactly one sequence"
        ))),
    }
}
