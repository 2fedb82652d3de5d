//! DeepSeek V4's memory (`llama_kv_cache_dsv4`, llama.cpp 0.1.161): a payload of its own,
//! self-describing unlike every other one.
//!
//! ```text
//! u32 magic "DSV4"  u32 version 1  u32 mode (0 full, 1 partial: PARTIAL_ONLY)
//! the raw cache: an iSWA payload of K-only caches, one stream per sequence (full mode: base
//!   then window cache; partial mode: the window cache only, as iSWA writes it then)
//! full mode: three compressed K caches: CSA (ratio 4), HCA (ratio 128), lightning indexer (4)
//!   u32 version (1 or 2)  u32 n_rows  u32 n_stream  u32 n_layer
//!   per layer: u32 il, then a tensor block
//! three compressor states (CSA, HCA, lightning indexer)
//!   u32 version 1  u32 ratio  u32 state_size  u32 n_embd_state  u32 n_stream  u32 n_layer
//!   per layer: u32 il, then two tensor blocks (the pooled rows and their scores)
//! tensor block: i32 type  u64 ne0  u64 rows  u64 row_size, then rows x row_size bytes per
//!   stream (nothing when that is 0)
//! ```
//!
//! A one-sequence save writes one stream of each, and of the compressed caches only the rows its
//! positions filled (`(pos_max + 1) / ratio`); a whole-memory save writes every stream and row.

use std::ops::Range;

use crate::error::{KvError, Result};
use crate::ggml_type::GgmlType;
use crate::state::codec::MAX_LAYERS;
use crate::state::source::{ByteSource, Cursor};

/// `"DSV4"` read as a little-endian `u32`: the first field of a dsv4 payload. No other payload
/// starts with it (as a stream or cell count it would be implausible).
pub const MAGIC: u32 = 0x3456_5344;
/// The one payload version 0.1.161 writes.
pub const VERSION: u32 = 1;
/// Bytes of magic, version and mode.
pub const ENVELOPE: usize = 12;

/// Which compressed cache or compressor a section belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Group {
    /// Compressed sparse attention (every 4 positions pooled into a row).
    Csa,
    /// Heavily compressed attention (every 128 positions pooled into a row).
    Hca,
    /// The lightning indexer's keys over the CSA rows.
    Lid,
}

impl Group {
    /// In payload order.
    pub const ALL: [Group; 3] = [Group::Csa, Group::Hca, Group::Lid];

    /// `"csa"`, `"hca"` or `"lid"`.
    pub fn name(self) -> &'static str {
        match self {
            Group::Csa => "csa",
            Group::Hca => "hca",
            Group::Lid => "lid",
        }
    }

    /// Positions pooled into one row.
    pub fn ratio(self) -> u32 {
        match self {
            Group::Csa | Group::Lid => 4,
            Group::Hca => 128,
        }
    }
}

/// What a section holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SectionKind {
    /// A compressed K cache: `n_rows` rows per stream and layer.
    Compressed {
        /// Its own version (1: every row; 2: the rows in use).
        version: u32,
        /// Rows written per stream.
        n_rows: u32,
    },
    /// A compressor's running state: `state_size` rows of pooled values and scores.
    Compressor {
        /// Positions pooled per row.
        ratio: u32,
        /// Rows per stream.
        state_size: u32,
        /// Width of a row.
        n_embd_state: u32,
    },
}

/// One tensor of a section's layer: every stream's rows, one after the other.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorRows {
    /// The ggml type id.
    pub type_id: i32,
    /// Elements per row.
    pub ne0: u64,
    /// Rows per stream.
    pub rows: u64,
    /// Bytes per row.
    pub row_size: u64,
    /// The rows of every stream, relative to the start of the whole payload.
    pub data: Range<usize>,
}

/// One layer of a section.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SectionLayer {
    /// The model layer.
    pub il: u32,
    /// The compressed K rows (one tensor), or the compressor's pooled rows and scores (two).
    pub tensors: Vec<TensorRows>,
}

/// One compressed cache or compressor state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Section {
    /// Whose.
    pub group: Group,
    /// What.
    pub kind: SectionKind,
    /// Streams written (one for a one-sequence save).
    pub n_stream: u32,
    /// The layers it holds (the layers of its compression ratio).
    pub layers: Vec<SectionLayer>,
    /// Its bytes, relative to the start of the whole payload.
    pub range: Range<usize>,
}

impl Section {
    /// Bytes of rows (not counting the headers).
    pub fn data_bytes(&self) -> usize {
        self.layers
            .iter()
            .flat_map(|l| &l.tensors)
            .map(|t| t.data.len())
            .sum()
    }
}

/// What a dsv4 payload holds besides its raw cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Compressed {
    /// Partial mode (`PARTIAL_ONLY`): the raw window cache and the compressor states only.
    pub partial: bool,
    /// The compressed caches (none in partial mode), then the compressor states, in payload
    /// order.
    pub sections: Vec<Section>,
}

/// The envelope at the start of `bytes`: whether the payload is dsv4's, and then whether it is
/// partial. `Ok(None)`: another memory's payload.
pub(crate) fn envelope<S: ByteSource + ?Sized>(bytes: &S) -> Result<Option<bool>> {
    let mut c = Cursor::new(bytes);
    if c.peek_u32() != Some(MAGIC) {
        return Ok(None);
    }
    c.u32("dsv4 magic")?;
    let version = c.u32("dsv4 version")?;
    if version != VERSION {
        return Err(KvError::InvalidState(format!(
            "dsv4 state version {version}, expected {VERSION}"
        )));
    }
    match c.u32("dsv4 mode")? {
        0 => Ok(Some(false)),
        1 => Ok(Some(true)),
        m => Err(KvError::InvalidState(format!(
            "dsv4 state mode {m}, expected 0 (full) or 1 (partial)"
        ))),
    }
}

fn tensor<S: ByteSource + ?Sized>(
    c: &mut Cursor<'_, S>,
    n_stream: u32,
    what: &str,
) -> Result<TensorRows> {
    let type_id = c.i32(format_args!("{what} type"))?;
    let ne0 = c.u64(format_args!("{what} ne0"))?;
    let rows = c.u64(format_args!("{what} rows"))?;
    let row_size = c.u64(format_args!("{what} row size"))?;
    let ty = GgmlType::from_id(type_id)
        .ok_or_else(|| KvError::InvalidState(format!("{what}: unknown ggml type {type_id}")))?;
    let want = usize::try_from(ne0)
        .ok()
        .and_then(|n| ty.row_size(n).ok())
        .map(|n| n as u64);
    if want != Some(row_size) {
        return Err(KvError::InvalidState(format!(
            "{what}: row size {row_size} is not that of {ne0} {} elements",
            ty.name()
        )));
    }
    let len = rows
        .checked_mul(row_size)
        .and_then(|n| n.checked_mul(u64::from(n_stream)))
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| {
            KvError::InvalidState(format!(
                "{what}: {n_stream} streams of {rows} rows of {row_size} bytes overflow"
            ))
        })?;
    let data = c.range(len, format_args!("{what} rows"))?;
    Ok(TensorRows {
        type_id,
        ne0,
        rows,
        row_size,
        data,
    })
}

fn checked_layers(n: u32, what: &str) -> Result<u32> {
    if n > MAX_LAYERS {
        return Err(KvError::InvalidState(format!(
            "{what}: n_layer {n} is implausible"
        )));
    }
    Ok(n)
}

fn checked_streams(n: u32, what: &str) -> Result<u32> {
    if n == 0 || n > crate::MAX_SEQ as u32 {
        return Err(KvError::InvalidState(format!(
            "{what}: n_stream {n} is implausible"
        )));
    }
    Ok(n)
}

fn layers<S: ByteSource + ?Sized>(
    c: &mut Cursor<'_, S>,
    n_layer: u32,
    n_stream: u32,
    tensors: &[&str],
    check: impl Fn(&TensorRows) -> std::result::Result<(), String>,
    what: &str,
) -> Result<Vec<SectionLayer>> {
    let mut out: Vec<SectionLayer> = Vec::new();
    for _ in 0..n_layer {
        let il = c.u32(format_args!("{what} layer id"))?;
        if out.last().is_some_and(|l| l.il >= il) || il >= MAX_LAYERS {
            return Err(KvError::InvalidState(format!(
                "{what}: layer id {il} out of order"
            )));
        }
        let mut ts = Vec::with_capacity(tensors.len());
        for name in tensors {
            let label = format!("{what} layer {il} {name}");
            let t = tensor(c, n_stream, &label)?;
            check(&t).map_err(|e| KvError::InvalidState(format!("{label}: {e}")))?;
            ts.push(t);
        }
        out.push(SectionLayer { il, tensors: ts });
    }
    Ok(out)
}

fn compressed<S: ByteSource + ?Sized>(c: &mut Cursor<'_, S>, group: Group) -> Result<Section> {
    let what = format!("dsv4 {} cache", group.name());
    let start = c.pos;
    let version = c.u32(format_args!("{what} version"))?;
    if version != 1 && version != 2 {
        return Err(KvError::InvalidState(format!(
            "{what}: version {version}, expected 1 or 2"
        )));
    }
    let n_rows = c.u32(format_args!("{what} rows"))?;
    let n_stream = checked_streams(c.u32(format_args!("{what} n_stream"))?, &what)?;
    let n_layer = checked_layers(c.u32(format_args!("{what} n_layer"))?, &what)?;
    let check = |t: &TensorRows| {
        if t.rows != u64::from(n_rows) {
            return Err(format!("{} rows, the cache writes {n_rows}", t.rows));
        }
        Ok(())
    };
    let layers = layers(c, n_layer, n_stream, &["K"], check, &what)?;
    Ok(Section {
        group,
        kind: SectionKind::Compressed { version, n_rows },
        n_stream,
        layers,
        range: start..c.pos,
    })
}

fn compressor<S: ByteSource + ?Sized>(c: &mut Cursor<'_, S>, group: Group) -> Result<Section> {
    let what = format!("dsv4 {} compressor", group.name());
    let start = c.pos;
    let version = c.u32(format_args!("{what} version"))?;
    if version != 1 {
        return Err(KvError::InvalidState(format!(
            "{what}: version {version}, expected 1"
        )));
    }
    let ratio = c.u32(format_args!("{what} ratio"))?;
    if ratio != group.ratio() {
        return Err(KvError::InvalidState(format!(
            "{what}: ratio {ratio}, expected {}",
            group.ratio()
        )));
    }
    let state_size = c.u32(format_args!("{what} state size"))?;
    let n_embd_state = c.u32(format_args!("{what} state width"))?;
    let n_stream = checked_streams(c.u32(format_args!("{what} n_stream"))?, &what)?;
    let n_layer = checked_layers(c.u32(format_args!("{what} n_layer"))?, &what)?;
    let check = |t: &TensorRows| {
        if t.type_id != GgmlType::F32.id() {
            return Err(format!("type {}, the compressor keeps f32", t.type_id));
        }
        if (t.ne0, t.rows) != (u64::from(n_embd_state), u64::from(state_size)) {
            return Err(format!(
                "{} rows of {}, the state is {state_size} x {n_embd_state}",
                t.rows, t.ne0
            ));
        }
        Ok(())
    };
    let layers = layers(c, n_layer, n_stream, &["kv", "score"], check, &what)?;
    Ok(Section {
        group,
        kind: SectionKind::Compressor {
            ratio,
            state_size,
            n_embd_state,
        },
        n_stream,
        layers,
        range: start..c.pos,
    })
}

/// The sections after the raw cache, from `start` to the end of `bytes` (which they must fill).
pub(crate) fn sections<S: ByteSource + ?Sized>(
    bytes: &S,
    start: usize,
    partial: bool,
) -> Result<Compressed> {
    let mut c = Cursor::new(bytes);
    c.pos = start;
    let mut sections = Vec::with_capacity(6);
    if !partial {
        for g in Group::ALL {
            sections.push(compressed(&mut c, g)?);
        }
    }
    for g in Group::ALL {
        sections.push(compressor(&mut c, g)?);
    }
    let n = sections[0].n_stream;
    if let Some(s) = sections.iter().find(|s| s.n_stream != n) {
        return Err(KvError::InvalidState(format!(
            "dsv4 {} section: {} streams, the {} section {n}",
            s.group.name(),
            s.n_stream,
            sections[0].group.name()
        )));
    }
    if c.remaining() != 0 {
        return Err(KvError::InvalidState(format!(
            "dsv4 state: {} trailing bytes",
            c.remaining()
        )));
    }
    Ok(Compressed { partial, sections })
}

/// A piece of a rewritten payload: bytes of its own, or a range of the input's payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    /// Bytes to write.
    Bytes(Vec<u8>),
    /// Bytes of the input payload to copy.
    Input(Range<usize>),
}

impl Piece {
    /// Bytes it writes.
    pub fn len(&self) -> usize {
        match self {
            Piece::Bytes(b) => b.len(),
            Piece::Input(r) => r.len(),
        }
    }

    /// Whether it writes nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Rows of a compressed cache a one-sequence save writes for a sequence whose last position is
/// `pos_max` (-1: none): the rows its positions filled, at most the cache's (0.1.161's
/// `dsv4_state_n_used_k_rows`).
pub fn used_rows(pos_max: i32, ratio: u32, kv_size: u32) -> u32 {
    if pos_max < 0 {
        return 0;
    }
    ((pos_max as u64 + 1) / u64::from(ratio)).min(u64::from(kv_size)) as u32
}

impl Compressed {
    /// Every section as 0.1.161 writes it when saving sequence `seq` of a whole-memory save
    /// (held in stream `seq`), the sequence's last position being `pos_max`: see
    /// [`Section::one_stream`]. Ranges of the pieces are relative to the payload.
    pub fn one_sequence(&self, seq: i32, pos_max: i32) -> Result<Vec<Piece>> {
        let stream = u32::try_from(seq)
            .map_err(|_| KvError::InvalidArg(format!("seq id {seq} names no stream")))?;
        let mut pieces = Vec::new();
        for s in &self.sections {
            pieces.extend(s.one_stream(stream, pos_max)?);
        }
        Ok(pieces)
    }
}

impl Section {
    /// The section as 0.1.161 writes it when saving one sequence held in stream `stream` of a
    /// whole-memory save, the sequence's last position being `pos_max`: one stream, and of a
    /// compressed cache only the rows in use.
    pub fn one_stream(&self, stream: u32, pos_max: i32) -> Result<Vec<Piece>> {
        if stream >= self.n_stream {
            return Err(KvError::InvalidArg(format!(
                "stream {stream} is not in the dsv4 {} section ({} streams)",
                self.group.name(),
                self.n_stream
            )));
        }
        let mut head = Vec::new();
        let put = |v: &mut Vec<u8>, x: u32| v.extend_from_slice(&x.to_le_bytes());
        let rows = match self.kind {
            SectionKind::Compressed { version, n_rows } => {
                let rows = used_rows(pos_max, self.group.ratio(), n_rows);
                for x in [version, rows, 1, self.layers.len() as u32] {
                    put(&mut head, x);
                }
                Some(rows)
            }
            SectionKind::Compressor {
                ratio,
                state_size,
                n_embd_state,
            } => {
                let n = self.layers.len() as u32;
                for x in [VERSION, ratio, state_size, n_embd_state, 1, n] {
                    put(&mut head, x);
                }
                None
            }
        };
        let mut pieces = Vec::with_capacity(1 + 2 * self.layers.len() * 2);
        for layer in &self.layers {
            put(&mut head, layer.il);
            for t in &layer.tensors {
                let n = rows.map_or(t.rows, u64::from);
                head.extend_from_slice(&t.type_id.to_le_bytes());
                for x in [t.ne0, n, t.row_size] {
                    head.extend_from_slice(&x.to_le_bytes());
                }
                let len = (n * t.row_size) as usize;
                if len > 0 {
                    pieces.push(Piece::Bytes(std::mem::take(&mut head)));
                    let at = t.data.start + (u64::from(stream) * t.rows * t.row_size) as usize;
                    pieces.push(Piece::Input(at..at + len));
                }
            }
        }
        pieces.push(Piece::Bytes(head));
        pieces.retain(|p| !p.is_empty());
        Ok(pieces)
    }
}
