//! One sequence's state as the store keeps it: a [`Capture`] of a live cache or of a llama.cpp
//! file, split by memory part. A file's KV parts are each loaded into a cache of their own shape
//! (the core's transactional load, one part at a time), so their rows are read exactly as a
//! load would place them; a recurrent part is kept as llama.cpp's own bytes.

use std::ops::Deref;

use llama_kv_cache::state::files::{inspect_bytes, params_for_payload, FileKind, Inspection};
use llama_kv_cache::state::parts::{Part, PartKind, PartRole};
use llama_kv_cache::{KvCache, KvError, Layout, MemoryKind, ReadOptions};

use crate::error::{StoreError, StoreResult};
use crate::geometry::Geometry;
use crate::shape::{FileFormat, KvShape, Shape};

/// A cache the capture reads: the caller's, or one made for a file's part.
pub(crate) enum CacheRef<'a> {
    Borrowed(&'a KvCache),
    Owned(Box<KvCache>),
}

impl Deref for CacheRef<'_> {
    type Target = KvCache;
    fn deref(&self) -> &KvCache {
        match self {
            CacheRef::Borrowed(c) => c,
            CacheRef::Owned(c) => c,
        }
    }
}

/// The cells of one sequence in a cache, in position order.
pub(crate) struct KvRows<'a> {
    pub cache: CacheRef<'a>,
    /// `cells[i]` holds `positions[i]`; positions ascend.
    pub cells: Vec<u32>,
    pub positions: Vec<i32>,
}

impl KvRows<'_> {
    fn of(cache: CacheRef<'_>, seq: i32) -> StoreResult<KvRows<'_>> {
        let cells = cache.cells();
        let mut found: Vec<(i32, u32)> = (0..cells.len())
            .map(|i| (i, cells.get(i)))
            .filter(|(_, c)| c.seqs.contains(seq as usize))
            .map(|(i, c)| (c.pos, i as u32))
            .collect();
        found.sort_unstable();
        if let Some(w) = found.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(StoreError::NotPrefix(format!(
                "sequence {seq} holds position {} twice",
                w[0].0
            )));
        }
        let (positions, cells) = found.into_iter().unzip();
        Ok(KvRows {
            cache,
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

    fn shape(&self) -> StoreResult<KvShape> {
        let p = self.cache.params();
        Ok(KvShape {
            layers: Geometry::of_cache(&self.cache)?,
            rot: (p.n_rot_k, p.n_rot_v),
        })
    }
}

/// The shape of a live unified cache.
pub(crate) fn unified_shape(cache: &KvCache) -> StoreResult<Shape> {
    let p = cache.params();
    Ok(Shape {
        memory: MemoryKind::Unified,
        main: Some(KvShape {
            layers: Geometry::of_cache(cache)?,
            rot: (p.n_rot_k, p.n_rot_v),
        }),
        swa: None,
        recurrent: None,
    })
}

/// One sequence's state after `len` tokens.
pub(crate) struct Capture<'a> {
    pub shape: Shape,
    /// The part kept per position: rows of positions `0..len`.
    pub main: Option<KvRows<'a>>,
    /// iSWA: the sliding-window rows the state holds.
    pub swa: Option<KvRows<'a>>,
    /// The recurrent part, as llama.cpp writes it for one sequence (no seq ids in its cell).
    pub recurrent: Vec<u8>,
    /// Tokens the state covers.
    pub len: usize,
    /// The recurrent state's position + 1, when there is one: a checkpoint needs it to be
    /// `len` exactly.
    pub recurrent_end: Option<usize>,
}

fn not_prefix(seq: i32, n: usize) -> StoreError {
    StoreError::NotPrefix(format!(
        "sequence {seq}: its {n} cells must hold positions 0..{n} once each"
    ))
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

impl<'a> Capture<'a> {
    /// Sequence `seq` of a live cache (a unified or recurrent one), `tokens` being its prompt.
    pub fn of_cache(cache: &'a KvCache, seq: i32, tokens: usize) -> StoreResult<Capture<'a>> {
        if cache.has_shift() {
            return Err(StoreError::NotPrefix(
                "the cache has a pending K-shift (apply it with update() first): its K rows are not those of positions 0..n"
                    .into(),
            ));
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
                },
                main: None,
                swa: None,
                recurrent,
                len: tokens,
                recurrent_end: Some((pos + 1) as usize),
            });
        }
        let main = KvRows::of(CacheRef::Borrowed(cache), seq)?;
        let n = main.positions.len();
        if !main.is_prefix(n) {
            return Err(not_prefix(seq, n));
        }
        Ok(Capture {
            shape: unified_shape(cache)?,
            main: Some(main),
            swa: None,
            recurrent: Vec::new(),
            len: n.min(tokens),
            recurrent_end: None,
        })
    }

    /// The one sequence of a llama.cpp session or sequence file's bytes: its shape, its state,
    /// its tokens and the file's format. `recurrent` answers what an old sequence file cannot
    /// tell (the store's model is recurrent); without it, a stream-less payload whose one cell
    /// ends the tokens is a recurrent state (a KV prefix holds positions 0..n).
    pub fn of_file(
        bytes: &[u8],
        recurrent: Option<bool>,
    ) -> StoreResult<(Capture<'static>, Vec<i32>, FileFormat)> {
        let ins = inspect_bytes(bytes)?;
        let whole_recurrent = ins.parts.len() == 1
            && ins
                .recurrent()
                .or(recurrent)
                .unwrap_or_else(|| ends_in_one_cell(&ins));
        if let Some(p) = ins.parts.iter().find(|p| !p.payload.ext.is_none()) {
            return Err(StoreError::Cache(KvError::Unsupported(format!(
                "the file's cells carry the '{}' cell extension of M-RoPE / PLE models, which the prompt store does not keep yet",
                p.payload.ext.name()
            ))));
        }
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
        let format = FileFormat {
            kind: ins.header.kind,
            version: ins.header.version,
            layout: kv_layout,
            flash_attn: v_trans == Some(false),
            arch: ins.arch.clone(),
        };
        let tokens = ins.header.tokens.clone();
        let mut loaded: Vec<(PartRole, KvCache)> = Vec::new();
        let mut recurrent_part = None;
        for part in &ins.parts {
            match part.kind {
                PartKind::Kv if !whole_recurrent => {
                    loaded.push((part.role, load_kv_part(bytes, &ins, part)?))
                }
                _ => {
                    let at = ins.payload_offset + part.range.start;
                    recurrent_part = Some(&bytes[at..ins.payload_offset + part.range.end]);
                }
            }
        }
        // the file's one sequence: a sequence file's is loaded as 0; a session's is the only
        // one with cells
        let seq = match ins.header.kind {
            FileKind::Sequence => 0,
            FileKind::Session => session_sequence(&loaded, recurrent_part)?,
        };
        let mut main = None;
        let mut swa = None;
        for (role, cache) in loaded {
            let rows = KvRows::of(CacheRef::Owned(Box::new(cache)), seq)?;
            match role {
                PartRole::Swa => swa = Some(rows),
                _ => main = Some(rows),
            }
        }
        let (recurrent, recurrent_end) = match recurrent_part {
            Some(part) => {
                let id = (ins.header.kind == FileKind::Session).then_some(seq);
                let (r, pos) = recurrent_one_sequence(part, id)?;
                (r, Some((pos + 1) as usize))
            }
            None => (Vec::new(), None),
        };
        let len = match &main {
            Some(m) => {
                let n = m.positions.len();
                if !m.is_prefix(n) {
                    return Err(not_prefix(seq, n));
                }
                n.min(tokens.len())
            }
            None => tokens.len(),
        };
        let shape = Shape {
            memory: if whole_recurrent {
                MemoryKind::Recurrent
            } else {
                ins.memory
            },
            main: main.as_ref().map(KvRows::shape).transpose()?,
            swa: swa.as_ref().map(KvRows::shape).transpose()?,
            recurrent: recurrent_part.map(|_| recurrent.len() as u64),
        };
        let capture = Capture {
            shape,
            main,
            swa,
            recurrent,
            len,
            recurrent_end,
        };
        Ok((capture, tokens, format))
    }
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

/// A cache of one KV part's shape holding that part, loaded as the core loads files.
fn load_kv_part(bytes: &[u8], ins: &Inspection, part: &Part) -> StoreResult<KvCache> {
    let mut params = params_for_payload(&part.payload, false)?;
    params.n_seq_max = params.n_seq_max.max(1);
    let mut cache = KvCache::new(params)?;
    let read = ReadOptions {
        layout: Some(part.payload.layout),
        allow_scattered: true,
        part: (ins.parts.len() > 1).then_some(part.role),
    };
    match ins.header.kind {
        FileKind::Sequence => cache.load_sequence_bytes(bytes, 0, read, None)?,
        FileKind::Session => cache.load_session_bytes(bytes, read, None)?,
    };
    Ok(cache)
}

/// The one sequence of a session that holds a state.
fn session_sequence(loaded: &[(PartRole, KvCache)], recurrent: Option<&[u8]>) -> StoreResult<i32> {
    let mut with_cells: Vec<i32> = Vec::new();
    for (_, cache) in loaded {
        for s in 0..cache.params().n_seq_max as i32 {
            if cache.seq_cell_count(s).unwrap_or(0) > 0 && !with_cells.contains(&s) {
                with_cells.push(s);
            }
        }
    }
    if loaded.is_empty() {
        // a recurrent session: the seq id of its one cell
        let id = recurrent
            .and_then(|r| r.get(12..16))
            .map(|b| i32::from_le_bytes(b.try_into().expect("4 bytes")));
        return Ok(id.unwrap_or(0));
    }
    match with_cells.as_slice() {
        [s] => Ok(*s),
        _ => Err(StoreError::NotPrefix(format!(
            "the session holds sequences {with_cells:?}; the store ingests sessions of exactly one sequence"
        ))),
    }
}
