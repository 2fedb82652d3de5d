//! llama.cpp's state files: sequence files (`ggsq`, versions 2, 3 and 4) and session files
//! (`ggsn`, versions 9, 10 and 11, with or without the seed era's outputs block), plus atomic
//! saving. Versions 4 and 11 (llama.cpp 0.1.161) record the K/V rotation in each stream's data
//! header; their payloads may hold several memories (iSWA, hybrid: see [`crate::state::parts`]).

use std::fs;
use std::ops::Range;
use std::path::Path;

pub use crate::state::atomic_write::{
    write_atomic, write_atomic_file, write_atomic_with, write_replacing, write_replacing_file,
    Durability,
};

use crate::error::{KvError, Result};
use crate::model::MemoryKind;
use crate::state::cells::CellExt;
use crate::state::dsv4::Compressed;
use crate::state::parts::{
    layouts_for_version, parse_parts, parse_parts_with, Part, PartKind, Parts,
};
use crate::state::source::{ByteSource, ReadSource, Sub};
use crate::state::{params_for_shapes, Cursor, Layout, ParsedPayload};

/// `'ggsn'`: session file magic.
pub const SESSION_MAGIC: u32 = 0x6767_736E;
/// `'ggsq'`: sequence file magic.
pub const SEQUENCE_MAGIC: u32 = 0x6767_7371;

/// The two kinds of llama.cpp state file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileKind {
    /// A whole context (`llama_state_save_file`).
    Session,
    /// One sequence (`llama_state_seq_save_file`).
    Sequence,
}

impl FileKind {
    /// `"session"` or `"sequence"`.
    pub fn name(self) -> &'static str {
        match self {
            FileKind::Session => "session",
            FileKind::Sequence => "sequence",
        }
    }

    /// The magic number.
    pub fn magic(self) -> u32 {
        match self {
            FileKind::Session => SESSION_MAGIC,
            FileKind::Sequence => SEQUENCE_MAGIC,
        }
    }

    /// Versions llama.cpp has written for this kind.
    pub fn versions(self) -> [u32; 3] {
        match self {
            FileKind::Session => [9, 10, 11],
            FileKind::Sequence => [2, 3, 4],
        }
    }

    /// The version llama.cpp 0.1.161 writes (session 11, sequence 4): the first whose KV
    /// payloads record the rotation (the streams-rot layout).
    pub fn rotation_version(self) -> u32 {
        self.versions()[2]
    }

    /// Whether files of this kind and `version` write KV caches in the streams-rot layout.
    pub fn records_rotation(self, version: u32) -> bool {
        version >= self.rotation_version()
    }

    /// The cell extensions a file of `version` may carry (M-RoPE and PLE models only): the
    /// 2D position in the first versions that saved it, position and token since.
    pub fn cell_exts(self, version: u32) -> &'static [CellExt] {
        if version == self.versions()[0] {
            &[CellExt::Pos2]
        } else {
            &[CellExt::Pos2Tok]
        }
    }

    /// The version today's llama.node writes and reads.
    pub fn default_version(self) -> u32 {
        self.versions()[0]
    }
}

/// The seed era's outputs block of a session (after the arch string).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Outputs {
    /// Batch index of each output row.
    pub output_pos: Vec<i32>,
    /// Logits (n_outputs x n_vocab).
    pub logits: Vec<f32>,
    /// Embeddings.
    pub embeddings: Vec<f32>,
}

/// A state file's header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileHeader {
    /// Session or sequence.
    pub kind: FileKind,
    /// Format version.
    pub version: u32,
    /// Prompt tokens stored in the file.
    pub tokens: Vec<i32>,
    /// Offset of the body.
    pub body: usize,
}

/// Parses the magic, version and token list.
pub fn parse_header(bytes: &[u8]) -> Result<FileHeader> {
    parse_header_in(bytes)
}

/// [`parse_header`] of any source.
pub(crate) fn parse_header_in<S: ByteSource + ?Sized>(bytes: &S) -> Result<FileHeader> {
    let mut c = Cursor::new(bytes);
    let magic = c.u32("magic")?;
    let kind = match magic {
        SESSION_MAGIC => FileKind::Session,
        SEQUENCE_MAGIC => FileKind::Sequence,
        m => {
            return Err(KvError::InvalidState(format!(
                "not a llama.cpp state file: magic 0x{m:08x} (expected 'ggsn' 0x{SESSION_MAGIC:08x} or 'ggsq' 0x{SEQUENCE_MAGIC:08x})"
            )))
        }
    };
    let version = c.u32("version")?;
    if !kind.versions().contains(&version) {
        return Err(KvError::InvalidState(format!(
            "unsupported {} file version {version} (supported: {:?})",
            kind.name(),
            kind.versions()
        )));
    }
    let n = c.u32("token count")?;
    if n as usize > c.remaining() / 4 {
        return Err(KvError::InvalidState(format!(
            "token count {n} exceeds the file size"
        )));
    }
    let mut tokens = crate::alloc::with_capacity(n as usize, "the token list")?;
    for i in 0..n {
        tokens.push(c.i32(format_args!("token {i}"))?);
    }
    Ok(FileHeader {
        kind,
        version,
        tokens,
        body: c.pos,
    })
}

/// A session body split into its parts, before the KV payload is validated.
#[derive(Clone, Debug, PartialEq)]
pub struct SessionBody {
    /// Model architecture name.
    pub arch: String,
    /// The seed era's outputs block, if this split assumes one.
    pub outputs: Option<Outputs>,
    /// The KV payload's byte range in the file.
    pub payload: Range<usize>,
}

/// `n` f32 values; with `values` false they are only stepped over (an empty list).
fn read_f32s<S: ByteSource + ?Sized>(
    c: &mut Cursor<'_, S>,
    n: u64,
    what: &str,
    values: bool,
) -> Result<Vec<f32>> {
    let len = (n as usize)
        .checked_mul(4)
        .filter(|&l| l <= c.remaining())
        .ok_or_else(|| KvError::InvalidState(format!("{what} size {n} exceeds the file")))?;
    if !values {
        c.range(len, what)?;
        return Ok(Vec::new());
    }
    Ok(c.bytes(len, what)?
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect())
}

/// llama.cpp's reader refuses output ids outside the batch; a batch holds at most the
/// session's tokens, and its writer maps each output to one distinct batch index.
fn check_output_ids(ids: &[i32], n_tokens: usize) -> Result<()> {
    if ids.len() > n_tokens {
        return Err(KvError::InvalidState(format!(
            "n_outputs {} exceeds the token count {n_tokens}",
            ids.len()
        )));
    }
    let mut seen = std::collections::HashSet::new();
    for (i, &id) in ids.iter().enumerate() {
        if id < 0 || id as usize >= n_tokens || !seen.insert(id) {
            return Err(KvError::InvalidState(format!(
                "output id {i} is {id}: not a distinct index below the token count {n_tokens}"
            )));
        }
    }
    Ok(())
}

/// Logits and embeddings are `n_outputs` rows of one width (vocabulary, embedding size).
fn check_outputs_size(size: u64, n_outputs: u32, what: &str) -> Result<()> {
    let fits = match n_outputs {
        0 => size == 0,
        n => size.is_multiple_of(n as u64),
    };
    if fits {
        return Ok(());
    }
    Err(KvError::InvalidState(format!(
        "{what} size {size} is not a whole number of rows for {n_outputs} outputs"
    )))
}

/// The possible splits of a session body: with and without the outputs block. `n_tokens` is
/// the header's token count, which bounds the outputs block's ids.
pub fn session_splits(bytes: &[u8], body: usize, n_tokens: usize) -> Result<Vec<SessionBody>> {
    session_splits_in(bytes, body, n_tokens, true)
}

/// [`session_splits`] of any source; without `values`, the outputs block's logits and
/// embeddings are checked and stepped over but not read (left empty).
fn session_splits_in<S: ByteSource + ?Sized>(
    bytes: &S,
    body: usize,
    n_tokens: usize,
    values: bool,
) -> Result<Vec<SessionBody>> {
    let mut c = Cursor::new(bytes);
    c.pos = body;
    let len = c.u32("arch length")?;
    if len > 256 {
        return Err(KvError::InvalidState(format!(
            "arch name length {len} is implausible"
        )));
    }
    let arch = String::from_utf8(c.bytes(len as usize, "arch")?)
        .map_err(|_| KvError::InvalidState("arch name is not UTF-8".into()))?;
    let after_arch = c.pos;
    let mut splits = vec![SessionBody {
        arch: arch.clone(),
        outputs: None,
        payload: after_arch..bytes.len(),
    }];
    let with_outputs = (|| -> Result<(Outputs, usize)> {
        let n = c.u32("n_outputs")?;
        if n as usize > c.remaining() / 4 {
            return Err(KvError::InvalidState(format!(
                "n_outputs {n} exceeds the file"
            )));
        }
        let mut output_pos = crate::alloc::with_capacity(n as usize, "the output ids")?;
        for i in 0..n {
            output_pos.push(c.i32(format_args!("output_pos {i}"))?);
        }
        check_output_ids(&output_pos, n_tokens)?;
        let n_logits = c.u64("logits size")?;
        check_outputs_size(n_logits, n, "logits")?;
        let logits = read_f32s(&mut c, n_logits, "logits", values)?;
        let n_embd = c.u64("embeddings size")?;
        check_outputs_size(n_embd, n, "embeddings")?;
        let embeddings = read_f32s(&mut c, n_embd, "embeddings", values)?;
        Ok((
            Outputs {
                output_pos,
                logits,
                embeddings,
            },
            c.pos,
        ))
    })();
    if let Ok((outputs, start)) = with_outputs {
        splits.push(SessionBody {
            arch,
            outputs: Some(outputs),
            payload: start..bytes.len(),
        });
    }
    Ok(splits)
}

/// How to write a state file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteOptions {
    /// File version (default: what today's llama.node reads: ggsq 2, ggsn 9).
    pub version: Option<u32>,
    /// Payload layout (default: today's, with the stream prefix).
    pub layout: Layout,
    /// Streams to write with today's layout: 1 for a unified context (default), `nSeqMax` to
    /// write like a non-unified context (one stream per sequence).
    pub n_stream: u32,
}

impl WriteOptions {
    /// The default options with payload layout `layout`.
    pub fn of_layout(layout: Layout) -> WriteOptions {
        WriteOptions {
            layout,
            ..WriteOptions::default()
        }
    }
}

impl Default for WriteOptions {
    fn default() -> Self {
        WriteOptions {
            version: None,
            layout: Layout::Streams,
            n_stream: 1,
        }
    }
}

/// The version and payload layout a file is written with: versions 11 / 4 write the
/// streams-rot layout, older ones the seed's or the streams layout. Without a version, the
/// streams-rot layout picks 11 / 4 and the others today's llama.node default (9 / 2).
pub fn resolve_version(kind: FileKind, opts: &WriteOptions) -> Result<(u32, Layout)> {
    let version = match opts.version {
        Some(v) => v,
        None if opts.layout == Layout::StreamsRot => kind.rotation_version(),
        None => kind.default_version(),
    };
    if !kind.versions().contains(&version) {
        return Err(KvError::InvalidArg(format!(
            "{} files have versions {:?}, got {version}",
            kind.name(),
            kind.versions()
        )));
    }
    match (kind.records_rotation(version), opts.layout) {
        (true, Layout::Seed) => Err(KvError::InvalidArg(format!(
            "{} version {version} has no seed layout (layout 'seed' needs version {})",
            kind.name(),
            kind.default_version()
        ))),
        (true, _) => Ok((version, Layout::StreamsRot)),
        (false, Layout::StreamsRot) => Err(KvError::InvalidArg(format!(
            "{} version {version} cannot record the rotation (layout 'streams-rot' needs version {})",
            kind.name(),
            kind.rotation_version()
        ))),
        (false, layout) => Ok((version, layout)),
    }
}

/// The magic `llama_state_seq_get_data` (0.1.161) writes before a sequence's state, then the
/// sequence id: its in-memory form (`io_magic`), which files do not have.
pub const SEQ_DATA_MAGIC: u32 = 0xaf14_3cd8;

/// The envelope of `llama_state_seq_get_data` for `seq`: the magic and the sequence id.
pub fn seq_data_envelope(seq: i32) -> [u8; 8] {
    let mut out = [0u8; 8];
    out[..4].copy_from_slice(&SEQ_DATA_MAGIC.to_le_bytes());
    out[4..].copy_from_slice(&seq.to_le_bytes());
    out
}

/// `data` without the envelope of `llama_state_seq_get_data` when it has one (llama.cpp reads
/// the sequence id there and ignores it, as this does). No payload starts with the magic: as
/// an `n_stream` or a cell count it is beyond every cache.
pub fn seq_data_payload(data: &[u8]) -> &[u8] {
    match data.get(..4) {
        Some(m) if m == SEQ_DATA_MAGIC.to_le_bytes() && data.len() >= 8 => &data[8..],
        _ => data,
    }
}

/// A state file's header: magic, version and the token list.
pub fn header_bytes(kind: FileKind, version: u32, tokens: &[i32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(12 + 4 * tokens.len());
    out.extend_from_slice(&kind.magic().to_le_bytes());
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&(tokens.len() as u32).to_le_bytes());
    for t in tokens {
        out.extend_from_slice(&t.to_le_bytes());
    }
    out
}

/// Bytes of a session body's prefix: the arch string and, for the seed layout, the outputs
/// block (empty when `outputs` is None).
pub fn session_prefix(arch: &str, outputs: Option<&Outputs>, layout: Layout) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(arch.len() as u32).to_le_bytes());
    out.extend_from_slice(arch.as_bytes());
    if layout == Layout::Seed {
        let empty = Outputs::default();
        let o = outputs.unwrap_or(&empty);
        out.extend_from_slice(&(o.output_pos.len() as u32).to_le_bytes());
        for p in &o.output_pos {
            out.extend_from_slice(&p.to_le_bytes());
        }
        out.extend_from_slice(&(o.logits.len() as u64).to_le_bytes());
        for x in &o.logits {
            out.extend_from_slice(&x.to_le_bytes());
        }
        out.extend_from_slice(&(o.embeddings.len() as u64).to_le_bytes());
        for x in &o.embeddings {
            out.extend_from_slice(&x.to_le_bytes());
        }
    }
    out
}

/// `head` followed by `tail`, growing `head` fallibly (the state can be gigabytes).
pub(crate) fn concat(mut head: Vec<u8>, tail: &[u8]) -> Result<Vec<u8>> {
    head.try_reserve_exact(tail.len()).map_err(|_| {
        KvError::Backend(format!(
            "cannot allocate {} bytes for the file",
            head.len() + tail.len()
        ))
    })?;
    head.extend_from_slice(tail);
    Ok(head)
}

/// The KV layouts a file's version allows (or the one forced).
pub(crate) fn file_layouts(header: &FileHeader, forced: Option<Layout>) -> Result<Vec<Layout>> {
    let allowed = layouts_for_version(header.kind.records_rotation(header.version));
    match forced {
        None => Ok(allowed.to_vec()),
        Some(l) if allowed.contains(&l) => Ok(vec![l]),
        Some(l) => Err(KvError::InvalidArg(format!(
            "layout '{l}' does not exist in {} version {}",
            header.kind.name(),
            header.version
        ))),
    }
}

/// The possible bodies of a file: a sequence file's one, a session's with and (seed era
/// versions only) without the outputs block.
/// `values`: whether the outputs block's logits and embeddings are read.
pub(crate) fn body_splits<S: ByteSource + ?Sized>(
    bytes: &S,
    header: &FileHeader,
    values: bool,
) -> Result<Vec<SessionBody>> {
    Ok(match header.kind {
        FileKind::Session => {
            let mut splits = session_splits_in(bytes, header.body, header.tokens.len(), values)?;
            if header.kind.records_rotation(header.version) {
                splits.retain(|s| s.outputs.is_none());
            }
            splits
        }
        FileKind::Sequence => vec![SessionBody {
            arch: String::new(),
            outputs: None,
            payload: header.body..bytes.len(),
        }],
    })
}

/// Structure of a file or payload found without a cache: for inspection.
#[derive(Clone, Debug, PartialEq)]
pub struct Inspection {
    /// The file header.
    pub header: FileHeader,
    /// Session: architecture.
    pub arch: Option<String>,
    /// Session: outputs block.
    pub outputs: Option<Outputs>,
    /// The first (for a single memory: the only) part's payload.
    pub payload: ParsedPayload,
    /// Which memory wrote the payload.
    pub memory: MemoryKind,
    /// The memories of the payload in payload order (one for a single memory); their ranges
    /// are relative to `payload_offset`.
    pub parts: Vec<Part>,
    /// dsv4: the compressed caches and compressor states after the raw cache's parts (their
    /// ranges relative to `payload_offset`).
    pub compressed: Option<Compressed>,
    /// Total bytes.
    pub bytes: usize,
    /// Byte offset of the payload.
    pub payload_offset: usize,
}

impl Inspection {
    /// Whether the state is recurrent, as far as the file tells: a payload of several memories
    /// by its first part, a stream-less payload of session 11 / sequence 4 always, a session by
    /// its architecture, a payload with the stream prefix never. `None`: a stream-less payload
    /// of an older sequence file, which a seed-era KV cache and a recurrent memory both wrote.
    pub fn recurrent(&self) -> Option<bool> {
        match (&self.arch, self.payload.layout) {
            _ if self.parts.len() > 1 => Some(self.parts[0].kind == PartKind::Recurrent),
            _ if self.parts[0].kind == PartKind::Recurrent => Some(true),
            (Some(arch), _) => Some(crate::model::arch::is_recurrent(arch)),
            (None, Layout::Streams | Layout::StreamsRot) => Some(false),
            (None, Layout::Seed) => None,
        }
    }
}

/// Whether a part's cells carry the seq ids a one-sequence save of its layout writes.
fn one_sequence_cells(p: &Part) -> bool {
    let want = match (p.kind, p.payload.layout) {
        (PartKind::Recurrent, _) | (_, Layout::Seed) => 0,
        _ => 1,
    };
    p.payload.streams.iter().all(|s| s.cells.all_have_ids(want))
}

/// Inspects a state file's bytes without a cache: every reading its version allows (layouts,
/// memories, outputs block) is tried; more than one is reported as ambiguous.
pub fn inspect_bytes(bytes: &[u8]) -> Result<Inspection> {
    inspect_source(bytes, true)
}

/// [`inspect_bytes`] of the file at `path`, reading only its metadata: the K/V rows (and an
/// outputs block's logits and embeddings, left empty in [`Inspection::outputs`]) are stepped
/// over, so a file of any size costs a few KiB of reads.
pub fn inspect_file(path: &Path) -> Result<Inspection> {
    match open_seekable(path)? {
        Some(src) => inspect_source(&src, false),
        None => inspect_bytes(&read_file(path)?),
    }
}

/// The regular file at `path`, to be read in place; `None` for a pipe or a device
/// (`/dev/stdin`), which cannot seek and is read whole instead.
pub(crate) fn open_seekable(path: &Path) -> Result<Option<ReadSource<fs::File>>> {
    let meta = fs::metadata(path)
        .map_err(|e| KvError::Io(format!("cannot read {}: {e}", path.display())))?;
    if !meta.is_file() {
        return Ok(None);
    }
    ReadSource::open(path).map(Some)
}

/// [`inspect_bytes`] of any source. `values`: whether the outputs block's logits and embeddings
/// are read into [`Inspection::outputs`] (without, they are checked and stepped over).
pub fn inspect_source<S: ByteSource + ?Sized>(bytes: &S, values: bool) -> Result<Inspection> {
    let header = parse_header_in(bytes)?;
    let layouts = file_layouts(&header, None)?;
    let mut fits = Vec::new();
    let mut errors = Vec::new();
    let splits = body_splits(bytes, &header, values)?;
    for split in &splits {
        let (shapes, shape_errors) = parse_parts(&Sub::new(bytes, split.payload.clone()), &layouts);
        let with = if split.outputs.is_some() {
            " with outputs"
        } else {
            ""
        };
        errors.extend(shape_errors.into_iter().map(|e| format!("{e}{with}")));
        fits.extend(shapes.into_iter().map(|p| (split.clone(), p)));
    }
    if fits.is_empty() {
        fits = ext_readings(
            bytes,
            &splits,
            &layouts,
            header.kind.cell_exts(header.version),
        );
    }
    if fits.len() > 1 && header.kind == FileKind::Sequence {
        // the seed layout of a one-sequence save has n_seq_id 0 everywhere, the streams layouts
        // 1: prefer the reading whose cells are consistent with the file kind
        fits.retain(|(_, p)| p.parts.iter().all(one_sequence_cells));
    }
    match fits.len() {
        1 => {
            let (split, shape) = fits.remove(0);
            Ok(Inspection {
                arch: (header.kind == FileKind::Session).then_some(split.arch),
                outputs: split.outputs,
                payload: shape.parts[0].payload.clone(),
                memory: shape.memory,
                parts: shape.parts,
                compressed: shape.compressed,
                bytes: bytes.len(),
                payload_offset: split.payload.start,
                header,
            })
        }
        0 => Err(KvError::InvalidState(format!(
            "the file parses under no layout: {}",
            errors.join("; ")
        ))),
        _ => Err(KvError::InvalidState(format!(
            "the file is ambiguous: it parses as {}",
            fits.iter()
                .map(|(s, p)| format!(
                    "{} ({}){}",
                    p.memory.name(),
                    p.parts
                        .iter()
                        .map(|x| x.payload.layout.name())
                        .collect::<Vec<_>>()
                        .join(" + "),
                    if s.outputs.is_some() {
                        " with outputs"
                    } else {
                        ""
                    }
                ))
                .collect::<Vec<_>>()
                .join(" and ")
        ))),
    }
}

/// When nothing reads plainly, the cells may carry the extension of M-RoPE / PLE models, which
/// no byte announces: the readings of the bodies `splits` under the first of `exts` that reads
/// exactly (none when none does).
pub(crate) fn ext_readings<S: ByteSource + ?Sized>(
    bytes: &S,
    splits: &[SessionBody],
    layouts: &[Layout],
    exts: &[CellExt],
) -> Vec<(SessionBody, Parts)> {
    for &ext in exts {
        let fits: Vec<(SessionBody, Parts)> = splits
            .iter()
            .flat_map(|s| {
                let (shapes, _) =
                    parse_parts_with(&Sub::new(bytes, s.payload.clone()), layouts, ext);
                shapes.into_iter().map(move |p| (s.clone(), p))
            })
            .collect();
        if !fits.is_empty() {
            return fits;
        }
    }
    Vec::new()
}

/// Reads a whole file, with an error naming the path.
pub fn read_file(path: &Path) -> Result<Vec<u8>> {
    use std::io::Read;
    let io = |e: std::io::Error| KvError::Io(format!("cannot read {}: {e}", path.display()));
    let mut file = fs::File::open(path).map_err(io)?;
    let len = file.metadata().map_err(io)?.len();
    // the size comes from the file: allocate it fallibly (fs::read would abort on failure)
    let mut bytes = crate::alloc::with_capacity(
        usize::try_from(len).unwrap_or(usize::MAX),
        &format!("reading {}", path.display()),
    )?;
    file.read_to_end(&mut bytes).map_err(io)?;
    Ok(bytes)
}

/// Parameters of a cache that can hold exactly what an inspected file holds.
pub fn params_for(ins: &Inspection, recurrent: bool) -> Result<crate::params::CacheParams> {
    params_for_payload(&ins.payload, recurrent)
}

/// Bytes a cache derived from a payload may take whatever the payload's size (its row sizes
/// can be declared without data when it holds no cell).
const MAX_DERIVED_CACHE_FLOOR: u64 = 64 << 20;

/// Parameters of a cache that can hold exactly what one memory's payload holds (one part of
/// an iSWA or hybrid payload), rotation included.
pub fn params_for_payload(
    payload: &ParsedPayload,
    recurrent: bool,
) -> Result<crate::params::CacheParams> {
    // a stream with layers gives the shape; a cache of no layer (a hybrid-iSWA memory's base
    // cache when every attention layer uses the window) declares 0 in its data headers
    let stream = payload
        .streams
        .iter()
        .find(|s| !s.layers.is_empty())
        .or_else(|| {
            payload
                .streams
                .iter()
                .find(|s| s.v_trans.is_some() && s.n_layer_declared == 0)
        })
        .ok_or_else(|| {
            KvError::InvalidState(
                "the file holds no cells, so no cache shape can be derived".into(),
            )
        })?;
    let shapes = stream.layer_shapes()?;
    let cells: usize = payload.streams.iter().map(|s| s.cells.len()).sum();
    let max_seq = payload
        .streams
        .iter()
        .flat_map(|s| s.cells.all_ids())
        .copied()
        .max()
        .unwrap_or(0)
        .max(payload.streams.len() as i32 - 1);
    // a seq id comes from the file: i32::MAX must not overflow the count
    let n_seq_max = max_seq.saturating_add(1).clamp(1, crate::MAX_SEQ as i32) as u32;
    let size = if recurrent {
        n_seq_max.max(cells as u32)
    } else {
        (cells as u32).max(1)
    };
    // the cache must not cost more than the payload could fill: a stream without cells still
    // declares row sizes, and those must not make a tiny input allocate gigabytes
    let per_cell: u64 = shapes
        .iter()
        .map(|l| l.k_row.saturating_add(l.v_row))
        .fold(0u64, u64::saturating_add);
    let limit = (payload.len as u64)
        .saturating_mul(4)
        .max(MAX_DERIVED_CACHE_FLOOR);
    if per_cell.saturating_mul(u64::from(size)) > limit {
        return Err(KvError::InvalidState(format!(
            "the payload declares {per_cell} bytes per cell for {size} cells, more than its {} bytes can fill",
            payload.len
        )));
    }
    let mut p = if shapes.is_empty() {
        let mut p = crate::params::CacheParams::new(size, 0, 0, 0);
        (p.n_embd_k_gqa, p.n_embd_v_gqa) = (Vec::new(), Vec::new());
        p
    } else {
        params_for_shapes(&shapes, size)?
    };
    p.flash_attn = stream.v_trans == Some(false);
    p.no_v = payload.no_v();
    p.recurrent = recurrent;
    p.n_seq_max = n_seq_max;
    (p.n_rot_k, p.n_rot_v) = stream.n_rot.unwrap_or((0, 0));
    p.cell_ext = payload.ext;
    Ok(p)
}
