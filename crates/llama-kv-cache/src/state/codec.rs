//! The codec of llama.cpp's KV state payload, byte for byte: the seed's layout (b4944), the
//! streams layout (an `n_stream` prefix, one seq id per cell in single-sequence saves) and
//! llama.cpp 0.1.161's (the streams layout whose data header also records the K/V rotation),
//! with or without cell extensions ([`CellExt`]).
//!
//! This module is the one place that knows the header fields: each check has one bound and one
//! message ([`checked_n_stream`], [`checked_cell_count`], [`checked_v_trans`],
//! [`checked_n_layer`]), one parser reads a stream's head whether the payload is whole or still
//! arriving ([`parse_stream_head`]), and one set of encoders writes the data and layer headers
//! ([`data_header`], [`k_header`], [`v_header`]). Cells are in [`crate::state::cells`], rows in
//! `crate::state::rows`.

use std::fmt;
use std::ops::Range;

use crate::error::{KvError, Result};
use crate::ggml_type::GgmlType;
use crate::params::CacheParams;
use crate::state::cells::{cell_len, parse_cells, CellExt, MAX_PAYLOAD_SEQS};
pub use crate::state::cells::{CellExtValue, CellMeta, PayloadCells};
use crate::state::source::ByteSource;
pub(crate) use crate::state::source::Cursor;

/// Which llama.cpp era's layout a payload uses (see [`Era`](crate::state::era::Era)).
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
    /// No V block: a cache without V (multi-head latent attention since llama.cpp keeps only
    /// the latent K, as 0.1.161 writes it).
    Absent,
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
    /// The extension its cells carry.
    pub ext: CellExt,
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

/// A stream's `n_layer`, refused when no model has that many layers, and 0 unless `layerless`
/// (a cache of cells without rows: the base cache of a hybrid-iSWA memory whose attention
/// layers all use the window, LFM2 with one; read only by a cache of no layer, so that no
/// other payload gains a reading).
pub(crate) fn checked_n_layer(n: u32, layerless: bool) -> Result<u32> {
    if (n == 0 && !layerless) || n > MAX_LAYERS {
        return Err(KvError::InvalidState(format!("n_layer {n} is implausible")));
    }
    Ok(n)
}

/// Most cells one stream may declare: far above any context llama.cpp runs, low enough that a
/// count read from garbage is refused before anything is allocated for it.
pub(crate) const MAX_CELLS: u32 = 1 << 24;

/// A stream's `cell_count`, refused when no context has that many cells, or when the payload
/// (known whole) is too short to hold them.
pub(crate) fn checked_cell_count<S: ByteSource + ?Sized>(
    c: &Cursor<'_, S>,
    s: usize,
    count: u32,
    ext: CellExt,
) -> Result<u32> {
    let least = cell_len(0, ext);
    if !c.partial && count as usize > c.remaining() / least {
        return Err(KvError::InvalidState(format!(
            "stream {s}: cell_count {count} exceeds what the remaining {} bytes can hold",
            c.remaining()
        )));
    }
    if count > MAX_CELLS {
        return Err(KvError::InvalidState(format!(
            "stream {s}: cell_count {count} is implausible"
        )));
    }
    Ok(count)
}

/// How the streams of a payload are written: what its layout and cell extension decide.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct StreamFormat {
    /// Whether the data header follows a stream without cells (the seed's layout and the
    /// stream-less recurrent one); a stream of today's layout ends after a 0 `cell_count`.
    pub header_when_empty: bool,
    /// Whether the data header records `n_rot_k`, `n_rot_v`.
    pub rot: bool,
    /// The extension each cell carries.
    pub ext: CellExt,
    /// Whether a data header may declare no layer (see [`checked_n_layer`]).
    pub layerless: bool,
    /// Whether the layers have no V blocks (a cache without V).
    pub no_v: bool,
}

impl StreamFormat {
    /// The streams of a payload in `layout` whose cells carry `ext`.
    pub fn of(layout: Layout, ext: CellExt) -> Self {
        StreamFormat {
            header_when_empty: !layout.has_stream_prefix(),
            rot: layout.records_rotation(),
            ext,
            layerless: false,
            no_v: false,
        }
    }

    /// The one stream of a recurrent memory's payload (no stream prefix in any era).
    pub fn recurrent() -> Self {
        StreamFormat {
            header_when_empty: true,
            rot: false,
            ext: CellExt::None,
            layerless: false,
            no_v: false,
        }
    }
}

/// A stream's data header: what follows its cells when it has a data block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DataHeader {
    pub v_trans: bool,
    pub n_layer: u32,
    pub n_rot: Option<(u32, u32)>,
}

/// The start of one stream: its cells and data header, up to its first layer's K header.
pub(crate) struct StreamHead {
    pub cells: PayloadCells,
    /// `None` for a stream that ends after its 0 `cell_count`.
    pub data: Option<DataHeader>,
}

/// Parses the start of stream `s`: the one reader of cell counts, cells and data headers, for
/// whole payloads, files and (through a [`Cursor::partial`]) payloads still arriving.
pub(crate) fn parse_stream_head<S: ByteSource + ?Sized>(
    c: &mut Cursor<'_, S>,
    s: usize,
    f: StreamFormat,
) -> Result<StreamHead> {
    let count = c.u32(format_args!("stream {s} cell_count"))?;
    let count = checked_cell_count(c, s, count, f.ext)?;
    let cells = parse_cells(c, count, f.ext)?;
    if count == 0 && !f.header_when_empty {
        return Ok(StreamHead { cells, data: None });
    }
    let v_trans = checked_v_trans(c.u32("v_trans")?)?;
    let n_layer = checked_n_layer(c.u32("n_layer")?, f.layerless)?;
    let n_rot = if f.rot {
        Some((c.u32("n_rot_k")?, c.u32("n_rot_v")?))
    } else {
        None
    };
    Ok(StreamHead {
        cells,
        data: Some(DataHeader {
            v_trans,
            n_layer,
            n_rot,
        }),
    })
}

/// Reads layer `il`'s K header: type id and row size.
pub(crate) fn read_k_header<S: ByteSource + ?Sized>(
    c: &mut Cursor<'_, S>,
    il: u32,
) -> Result<(i32, u64)> {
    Ok((
        c.i32(format_args!("layer {il} k_type"))?,
        c.u64(format_args!("layer {il} k_row_size"))?,
    ))
}

/// `len` bytes of `what` in layer `il`: `per_cell` bytes for each of `n` cells.
fn block_len(per_cell: u64, n: usize, il: u32, what: &str) -> Result<usize> {
    usize::try_from(per_cell)
        .ok()
        .and_then(|r| r.checked_mul(n))
        .ok_or_else(|| KvError::InvalidState(format!("layer {il}: {what} size overflows")))
}

/// Parses one stream. With `blocks`, that many layer blocks follow instead of the declared
/// `n_layer` (the recurrent part of a hybrid memory declares every model layer).
pub(crate) fn parse_stream_with<S: ByteSource + ?Sized>(
    c: &mut Cursor<'_, S>,
    s: usize,
    f: StreamFormat,
    blocks: Option<u32>,
) -> Result<StreamBlock> {
    let StreamHead { cells, data } = parse_stream_head(c, s, f)?;
    let Some(data) = data else {
        return Ok(StreamBlock {
            cells,
            v_trans: None,
            layers: Vec::new(),
            n_rot: None,
            n_layer_declared: 0,
        });
    };
    let layers = parse_layer_blocks(c, cells.len(), &data, f, blocks)?;
    Ok(StreamBlock {
        cells,
        v_trans: Some(data.v_trans),
        layers,
        n_rot: data.n_rot,
        n_layer_declared: data.n_layer,
    })
}

/// Where each of up to `max` consecutive row blocks of `n` cells ends, from the cursor: a K
/// block and an untransposed V block are both a type, a row size and the rows, so one walk
/// gives every layer count's end. Stops at the first block that does not parse (its error).
pub(crate) fn row_block_ends<S: ByteSource + ?Sized>(
    c: &mut Cursor<'_, S>,
    n: usize,
    max: usize,
) -> (Vec<usize>, Option<KvError>) {
    let mut ends = Vec::new();
    while ends.len() < max {
        let il = (ends.len() / 2) as u32;
        let block = read_k_header(c, il)
            .and_then(|(_, row)| block_len(row, n, il, "rows"))
            .and_then(|len| c.range(len, format_args!("layer {il} rows")));
        match block {
            Ok(_) => ends.push(c.pos),
            Err(e) => return (ends, Some(e)),
        }
    }
    (ends, None)
}

/// The layer blocks after a stream's data header `data`, for `n` cells: `blocks` of them
/// (default: the `n_layer` it declares). Reads only the block headers and steps over the rows.
fn parse_layer_blocks<S: ByteSource + ?Sized>(
    c: &mut Cursor<'_, S>,
    n: usize,
    data: &DataHeader,
    f: StreamFormat,
    blocks: Option<u32>,
) -> Result<Vec<LayerBlock>> {
    let DataHeader {
        v_trans, n_layer, ..
    } = *data;
    let n_blocks = match blocks {
        Some(b) if b <= n_layer => b,
        Some(b) => {
            return Err(KvError::InvalidState(format!(
                "{b} layer blocks exceed the declared n_layer {n_layer}"
            )))
        }
        None => n_layer,
    };
    let mut k_blocks = Vec::with_capacity(n_blocks as usize);
    for il in 0..n_blocks {
        let (ty, row) = read_k_header(c, il)?;
        let len = block_len(row, n, il, "K")?;
        let data = c.range(len, format_args!("layer {il} K rows"))?;
        k_blocks.push((ty, row, data));
    }
    let mut layers = Vec::with_capacity(n_blocks as usize);
    for (il, (k_type, k_row_size, k_data)) in (0..).zip(k_blocks) {
        if f.no_v {
            layers.push(LayerBlock {
                k_type,
                k_row_size,
                k_data,
                v: VBlock::Absent,
            });
            continue;
        }
        let ty = c.i32(format_args!("layer {il} v_type"))?;
        let v = if v_trans {
            let el_size = c.u32(format_args!("layer {il} v_size_el"))?;
            let n_embd = c.u32(format_args!("layer {il} n_embd_v_gqa"))?;
            let len = block_len(u64::from(el_size) * u64::from(n_embd), n, il, "V")?;
            VBlock::Transposed {
                ty,
                el_size,
                n_embd,
                data: c.range(len, format_args!("layer {il} V"))?,
            }
        } else {
            let row_size = c.u64(format_args!("layer {il} v_row_size"))?;
            let len = block_len(row_size, n, il, "V")?;
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
    Ok(layers)
}

/// The payload's `n_stream` prefix as written (layouts with [`Layout::has_stream_prefix`]).
pub fn n_stream_header(n_stream: u32) -> [u8; 4] {
    n_stream.to_le_bytes()
}

/// A stream's `cell_count` as written (0: a stream that ends there in today's layouts).
pub fn cell_count_header(count: u32) -> [u8; 4] {
    count.to_le_bytes()
}

/// A stream's data header as written: `v_trans`, `n_layer` and, in the streams-rot layout,
/// `n_rot_k`, `n_rot_v` (8 or 16 bytes; the second value is the length).
pub fn data_header(v_trans: bool, n_layer: u32, n_rot: Option<(u32, u32)>) -> ([u8; 16], usize) {
    let mut out = [0u8; 16];
    out[..4].copy_from_slice(&u32::from(v_trans).to_le_bytes());
    out[4..8].copy_from_slice(&n_layer.to_le_bytes());
    match n_rot {
        Some((k, v)) => {
            out[8..12].copy_from_slice(&k.to_le_bytes());
            out[12..].copy_from_slice(&v.to_le_bytes());
            (out, 16)
        }
        None => (out, 8),
    }
}

/// A layer's K header as written: type id and row size.
pub fn k_header(ty: GgmlType, row: usize) -> [u8; 12] {
    let mut out = [0u8; 12];
    out[..4].copy_from_slice(&ty.id().to_le_bytes());
    out[4..].copy_from_slice(&(row as u64).to_le_bytes());
    out
}

/// A layer's V header as written: type id and row size, or, transposed, type id, element size
/// and channel count (12 bytes either way).
pub fn v_header(ty: GgmlType, row: usize, transposed: bool) -> [u8; 12] {
    if !transposed {
        return k_header(ty, row);
    }
    let el = ty.type_size();
    let mut out = [0u8; 12];
    out[..4].copy_from_slice(&ty.id().to_le_bytes());
    out[4..8].copy_from_slice(&(el as u32).to_le_bytes());
    out[8..].copy_from_slice(&((row / el) as u32).to_le_bytes());
    out
}

/// One layer's K and V as bytes per cell, whatever V's layout in the payload (a transposed V
/// block's channels are one row's elements): the shape a cache of this payload needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerShape {
    /// K type.
    pub k_type: GgmlType,
    /// Bytes of one K row (one cell).
    pub k_row: u64,
    /// V type.
    pub v_type: GgmlType,
    /// Bytes of one V row (one cell), untransposed.
    pub v_row: u64,
}

impl StreamBlock {
    /// The shape of each layer of a stream that holds data.
    pub fn layer_shapes(&self) -> Result<Vec<LayerShape>> {
        let ty = |id: i32| {
            GgmlType::from_id(id)
                .ok_or_else(|| KvError::InvalidState(format!("type id {id} is not a KV type")))
        };
        self.layers
            .iter()
            .map(|l| {
                let (v_type, v_row) = match &l.v {
                    VBlock::Rows {
                        ty: t, row_size, ..
                    } => (ty(*t)?, *row_size),
                    VBlock::Transposed {
                        ty: t,
                        el_size,
                        n_embd,
                        ..
                    } => (ty(*t)?, u64::from(*el_size) * u64::from(*n_embd)),
                    // no V: the K type stands in, with rows of no bytes
                    VBlock::Absent => (ty(l.k_type)?, 0),
                };
                Ok(LayerShape {
                    k_type: ty(l.k_type)?,
                    k_row: l.k_row_size,
                    v_type,
                    v_row,
                })
            })
            .collect()
    }
}

/// Parameters of a cache of `size` cells whose layers have `shapes` (every layer of one K type
/// and one V type, as a cache has): the one place row sizes become widths.
pub fn params_for_shapes(shapes: &[LayerShape], size: u32) -> Result<CacheParams> {
    let first = shapes.first().ok_or_else(|| {
        KvError::InvalidState("a payload without layers has no cache shape".into())
    })?;
    let width = |t: GgmlType, row: u64| -> Result<u32> {
        t.row_width(row)
            .ok_or_else(|| KvError::InvalidState(format!("row size {row} is not whole {t} blocks")))
    };
    let mut p = CacheParams::new(size.max(1), shapes.len() as u32, 0, 0);
    (p.type_k, p.type_v) = (first.k_type, first.v_type);
    p.n_embd_k_gqa = Vec::with_capacity(shapes.len());
    p.n_embd_v_gqa = Vec::with_capacity(shapes.len());
    for l in shapes {
        if (l.k_type, l.v_type) != (first.k_type, first.v_type) {
            return Err(KvError::InvalidState(
                "layers with different K/V types cannot form one cache".into(),
            ));
        }
        p.n_embd_k_gqa.push(width(l.k_type, l.k_row)?);
        p.n_embd_v_gqa.push(width(l.v_type, l.v_row)?);
    }
    Ok(p)
}

impl ParsedPayload {
    /// Whether its layers have no V blocks (a cache without V).
    pub fn no_v(&self) -> bool {
        self.streams
            .iter()
            .flat_map(|s| &s.layers)
            .any(|l| l.v == VBlock::Absent)
    }

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
/// file through [`crate::state::source::ReadSource`]: only the metadata is read, K/V rows are
/// stepped over). With `exact`, trailing bytes are an error.
pub fn parse_payload<S: ByteSource + ?Sized>(
    bytes: &S,
    layout: Layout,
    exact: bool,
) -> Result<ParsedPayload> {
    parse_payload_with(bytes, layout, CellExt::None, exact)
}

/// [`parse_payload`] of a payload whose cells carry the extension `ext`.
pub fn parse_payload_with<S: ByteSource + ?Sized>(
    bytes: &S,
    layout: Layout,
    ext: CellExt,
    exact: bool,
) -> Result<ParsedPayload> {
    parse_payload_as(bytes, StreamFormat::of(layout, ext), layout, exact)
}

/// [`parse_payload_with`] of a payload written by a cache of no layer (its data headers
/// declare 0).
pub(crate) fn parse_layerless_payload<S: ByteSource + ?Sized>(
    bytes: &S,
    layout: Layout,
    ext: CellExt,
    exact: bool,
) -> Result<ParsedPayload> {
    let f = StreamFormat {
        layerless: true,
        ..StreamFormat::of(layout, ext)
    };
    parse_payload_as(bytes, f, layout, exact)
}

/// [`parse_payload_with`] of a payload whose layers have V blocks (`no_v` false) or none (a
/// cache without V).
pub fn parse_payload_form<S: ByteSource + ?Sized>(
    bytes: &S,
    layout: Layout,
    ext: CellExt,
    no_v: bool,
    exact: bool,
) -> Result<ParsedPayload> {
    let f = StreamFormat {
        no_v,
        ..StreamFormat::of(layout, ext)
    };
    parse_payload_as(bytes, f, layout, exact)
}

fn parse_payload_as<S: ByteSource + ?Sized>(
    bytes: &S,
    f: StreamFormat,
    layout: Layout,
    exact: bool,
) -> Result<ParsedPayload> {
    let ext = f.ext;
    let mut c = Cursor::new(bytes);
    let streams = match layout {
        Layout::Seed => vec![parse_stream_with(&mut c, 0, f, None)?],
        Layout::Streams | Layout::StreamsRot => {
            let n_stream = checked_n_stream(c.u32("n_stream")?)?;
            (0..n_stream as usize)
                .map(|s| parse_stream_with(&mut c, s, f, None))
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
        ext,
    })
}

/// The one rule that finds a payload's layout when none is given, for every memory: each
/// candidate is tried in the order given (`attempt` parses and checks the payload against the
/// memory without changing it; it sees the fits found so far, so a twin layout can be refuted
/// from one of them) and exactly one must fit. Two that fit but read alike (`alike`: a payload
/// of empty streams has no data header, so the streams and streams-rot layouts read it the
/// same) count once, as the older layout. A payload two layouts read differently is refused as
/// ambiguous, naming both: reading it either way could be wrong, and the caller can say which.
/// A check that finds no room ends the search (room does not depend on the layout); `no_fit`
/// makes the error of a payload no candidate reads, from each one's reason.
pub fn detect_layout<T>(
    candidates: &[Layout],
    mut attempt: impl FnMut(Layout, &[T]) -> Result<T>,
    layout_of: impl Fn(&T) -> Layout,
    alike: impl Fn(&T, &T) -> bool,
    no_fit: impl FnOnce(Vec<(Layout, KvError)>) -> KvError,
) -> Result<T> {
    let mut fits: Vec<T> = Vec::new();
    let mut errors = Vec::new();
    for &l in candidates {
        match attempt(l, &fits) {
            Ok(fit) => fits.push(fit),
            Err(e @ KvError::NoSpace(_)) => return Err(e),
            Err(e) => errors.push((l, e)),
        }
    }
    if let [a, b] = fits.as_slice() {
        if alike(a, b) {
            let newer = if layout_of(a).era() > layout_of(b).era() {
                0
            } else {
                1
            };
            fits.remove(newer);
        }
    }
    match fits.len() {
        1 => Ok(fits.remove(0)),
        0 => Err(no_fit(errors)),
        _ => Err(ambiguous(fits.iter().map(layout_of))),
    }
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
/// The cell holding each sequence's state in a recurrent payload (`-1`: none), for a memory of
/// `n_cells` state cells. A sequence named by two cells, or with no state cell, is refused:
/// each sequence has exactly one state.
pub(crate) fn recurrent_tails(cells: &PayloadCells, n_cells: usize) -> Result<Vec<i32>> {
    let mut tails = vec![-1i32; n_cells];
    for (i, c) in cells.iter().enumerate() {
        for &id in c.seq_ids {
            let t = usize::try_from(id)
                .ok()
                .and_then(|id| tails.get_mut(id))
                .ok_or_else(|| {
                    KvError::InvalidState(format!(
                        "seq id {id} has no state cell in a cache of {n_cells} cells"
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
    Ok(tails)
}

pub(crate) fn check_meta(
    p: &ParsedPayload,
    seq: Option<i32>,
    recurrent: bool,
    n_seq_max: u32,
) -> Result<()> {
    // a whole recurrent state names each sequence in one cell: checked here, before a load
    // changes anything (a hybrid memory checks both parts before either changes)
    if recurrent && seq.is_none() {
        for stream in &p.streams {
            recurrent_tails(&stream.cells, n_seq_max as usize)?;
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A candidate's reading in the tests: its layout and what it read.
    type Reading = (Layout, &'static str);

    /// [`detect_layout`] over `candidates`, each read as `reads` says (`None`: it does not
    /// fit, `Some("")`: no room), two readings alike when they read the same thing.
    fn detect(candidates: &[Layout], reads: &[Option<&'static str>]) -> Result<Reading> {
        detect_layout(
            candidates,
            |l, _| match reads[candidates.iter().position(|&c| c == l).unwrap()] {
                None => Err(KvError::InvalidState(format!("not {l}"))),
                Some("") => Err(KvError::NoSpace("full".into())),
                Some(what) => Ok((l, what)),
            },
            |r: &Reading| r.0,
            |a, b| a.1 == b.1,
            no_layout_fits,
        )
    }

    #[test]
    fn detect_layout_takes_the_one_layout_that_reads_a_payload() {
        let all = [Layout::StreamsRot, Layout::Streams, Layout::Seed];
        let got = detect(&all, &[None, Some("cells"), None]).unwrap();
        assert_eq!(got, (Layout::Streams, "cells"));
    }

    #[test]
    fn detect_layout_refuses_a_payload_two_layouts_read_differently() {
        let all = [Layout::Streams, Layout::Seed];
        let e = detect(&all, &[Some("one way"), Some("another way")]).unwrap_err();
        assert!(
            e.to_string()
                .contains("ambiguous: it parses as streams and seed"),
            "{e}"
        );
    }

    #[test]
    fn detect_layout_counts_two_alike_readings_once_as_the_older_layout() {
        let twins = [Layout::StreamsRot, Layout::Streams];
        let got = detect(&twins, &[Some("empty"), Some("empty")]).unwrap();
        assert_eq!(got.0, Layout::Streams);
    }

    #[test]
    fn detect_layout_stops_at_no_room_and_names_every_reason_otherwise() {
        let all = [Layout::StreamsRot, Layout::Streams, Layout::Seed];
        let e = detect(&all, &[Some(""), Some("cells"), None]).unwrap_err();
        assert!(matches!(e, KvError::NoSpace(_)), "{e}");
        let e = detect(&all, &[None, None, None]).unwrap_err().to_string();
        for l in all {
            assert!(e.contains(&format!("as {l}: not {l}")), "{e}");
        }
    }
}
