//! llama.cpp's state files: sequence files (`ggsq`, versions 2 and 3) and session files
//! (`ggsn`, versions 9 and 10, with or without the seed era's outputs block), plus atomic
//! saving.

use std::fs;
use std::ops::Range;
use std::path::Path;

pub use crate::atomic_write::write_atomic;

use crate::cache::KvCache;
use crate::error::{KvError, Result};
use crate::state::{
    parse_payload, Cursor, Layout, ParsedPayload, Progress, ReadOptions, ReadSummary,
};

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
    pub fn versions(self) -> [u32; 2] {
        match self {
            FileKind::Session => [9, 10],
            FileKind::Sequence => [2, 3],
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
    let mut tokens = Vec::with_capacity(n as usize);
    for i in 0..n {
        tokens.push(c.i32(&format!("token {i}"))?);
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

fn read_f32s(c: &mut Cursor<'_>, n: u64, what: &str) -> Result<Vec<f32>> {
    let len = (n as usize)
        .checked_mul(4)
        .filter(|&l| l <= c.remaining())
        .ok_or_else(|| KvError::InvalidState(format!("{what} size {n} exceeds the file")))?;
    Ok(c.take(len, what)?
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
    let mut c = Cursor::new(bytes);
    c.pos = body;
    let len = c.u32("arch length")?;
    if len > 256 {
        return Err(KvError::InvalidState(format!(
            "arch name length {len} is implausible"
        )));
    }
    let arch = String::from_utf8(c.take(len as usize, "arch")?.to_vec())
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
        let mut output_pos = Vec::with_capacity(n as usize);
        for i in 0..n {
            output_pos.push(c.i32(&format!("output_pos {i}"))?);
        }
        check_output_ids(&output_pos, n_tokens)?;
        let n_logits = c.u64("logits size")?;
        check_outputs_size(n_logits, n, "logits")?;
        let logits = read_f32s(&mut c, n_logits, "logits")?;
        let n_embd = c.u64("embeddings size")?;
        check_outputs_size(n_embd, n, "embeddings")?;
        let embeddings = read_f32s(&mut c, n_embd, "embeddings")?;
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

/// What a file load restored.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadedFile {
    /// The header.
    pub header: FileHeader,
    /// Session files: the architecture.
    pub arch: Option<String>,
    /// Session files of the seed era: the outputs block.
    pub outputs: Option<Outputs>,
    /// What the payload read did.
    pub summary: ReadSummary,
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

impl Default for WriteOptions {
    fn default() -> Self {
        WriteOptions {
            version: None,
            layout: Layout::Streams,
            n_stream: 1,
        }
    }
}

fn header_bytes(kind: FileKind, version: Option<u32>, tokens: &[i32]) -> Result<Vec<u8>> {
    let version = version.unwrap_or(kind.default_version());
    if !kind.versions().contains(&version) {
        return Err(KvError::InvalidArg(format!(
            "{} files have versions {:?}, got {version}",
            kind.name(),
            kind.versions()
        )));
    }
    let mut out = Vec::with_capacity(12 + 4 * tokens.len());
    out.extend_from_slice(&kind.magic().to_le_bytes());
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&(tokens.len() as u32).to_le_bytes());
    for t in tokens {
        out.extend_from_slice(&t.to_le_bytes());
    }
    Ok(out)
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

impl KvCache {
    /// A sequence file (`ggsq`) for `seq` with its prompt `tokens`.
    pub fn sequence_file_bytes(
        &self,
        seq: i32,
        tokens: &[i32],
        opts: WriteOptions,
        progress: Option<Progress<'_>>,
    ) -> Result<Vec<u8>> {
        self.check_seq("saveSequenceFile", seq)?;
        let mut out = header_bytes(FileKind::Sequence, opts.version, tokens)?;
        out.extend(self.state_write(seq, opts.layout, opts.n_stream, progress)?);
        Ok(out)
    }

    /// A session file (`ggsn`) of the whole cache. The seed layout carries the outputs block
    /// (empty unless given); today's layout has none.
    pub fn session_file_bytes(
        &self,
        tokens: &[i32],
        arch: &str,
        outputs: Option<&Outputs>,
        opts: WriteOptions,
        progress: Option<Progress<'_>>,
    ) -> Result<Vec<u8>> {
        let mut out = header_bytes(FileKind::Session, opts.version, tokens)?;
        out.extend(session_prefix(arch, outputs, opts.layout));
        out.extend(self.state_write(-1, opts.layout, opts.n_stream, progress)?);
        Ok(out)
    }

    /// Loads a sequence file's bytes into `dest` (transactional, as `state_read`).
    pub fn load_sequence_bytes(
        &mut self,
        bytes: &[u8],
        dest: i32,
        opts: ReadOptions,
        progress: Option<Progress<'_>>,
    ) -> Result<LoadedFile> {
        self.check_seq("loadSequenceFile", dest)?;
        let header = parse_header(bytes)?;
        if header.kind != FileKind::Sequence {
            return Err(KvError::InvalidState(format!(
                "expected a sequence file ('ggsq'), got a {} file",
                header.kind.name()
            )));
        }
        let summary = self.state_read(&bytes[header.body..], dest, opts, progress)?;
        Ok(LoadedFile {
            header,
            arch: None,
            outputs: None,
            summary,
        })
    }

    /// Loads a session file's bytes into the whole cache (transactional). The body is tried
    /// with and without the seed era's outputs block and under each payload layout; exactly
    /// one reading must fit.
    pub fn load_session_bytes(
        &mut self,
        bytes: &[u8],
        opts: ReadOptions,
        progress: Option<Progress<'_>>,
    ) -> Result<LoadedFile> {
        let header = parse_header(bytes)?;
        if header.kind != FileKind::Session {
            return Err(KvError::InvalidState(format!(
                "expected a session file ('ggsn'), got a {} file",
                header.kind.name()
            )));
        }
        let mut fits: Vec<(SessionBody, ParsedPayload)> = Vec::new();
        let mut errors = Vec::new();
        for split in session_splits(bytes, header.body, header.tokens.len())? {
            match self.detect_payload(&bytes[split.payload.clone()], None, opts.layout) {
                Ok(p) => fits.push((split, p)),
                Err(e) => errors.push(e),
            }
        }
        match fits.len() {
            1 => {
                let (split, parsed) = fits.remove(0);
                let summary = self.apply_payload(
                    &bytes[split.payload.clone()],
                    &parsed,
                    None,
                    opts,
                    progress,
                )?;
                Ok(LoadedFile {
                    header,
                    arch: Some(split.arch),
                    outputs: split.outputs,
                    summary,
                })
            }
            0 => Err(errors.into_iter().next().unwrap_or_else(|| {
                KvError::InvalidState("the session body does not parse".into())
            })),
            _ => Err(KvError::InvalidState(
                "the session body is ambiguous: it parses both with and without an outputs block"
                    .into(),
            )),
        }
    }
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
    /// The payload parsed structurally.
    pub payload: ParsedPayload,
    /// Total bytes.
    pub bytes: usize,
    /// Byte offset of the payload.
    pub payload_offset: usize,
}

/// Inspects a state file's bytes without a cache: every layout that parses exactly is tried;
/// more than one is reported as ambiguous.
pub fn inspect_bytes(bytes: &[u8]) -> Result<Inspection> {
    let header = parse_header(bytes)?;
    let splits = match header.kind {
        FileKind::Session => session_splits(bytes, header.body, header.tokens.len())?,
        FileKind::Sequence => vec![SessionBody {
            arch: String::new(),
            outputs: None,
            payload: header.body..bytes.len(),
        }],
    };
    let mut fits = Vec::new();
    let mut errors = Vec::new();
    for split in splits {
        for layout in [Layout::Seed, Layout::Streams] {
            match parse_payload(&bytes[split.payload.clone()], layout, true) {
                Ok(p) => fits.push((split.clone(), p)),
                Err(e) => errors.push(format!(
                    "{layout}{}: {e}",
                    if split.outputs.is_some() {
                        " with outputs"
                    } else {
                        ""
                    }
                )),
            }
        }
    }
    if fits.len() > 1 {
        // the seed layout of a one-sequence save has n_seq_id 0 everywhere, the streams layout 1:
        // prefer the reading whose cells are consistent with the file kind
        let seq_ok = |p: &ParsedPayload| {
            header.kind == FileKind::Session
                || p.streams
                    .iter()
                    .flat_map(|s| &s.cells)
                    .all(|c| match p.layout {
                        Layout::Seed => c.seq_ids.is_empty(),
                        Layout::Streams => c.seq_ids.len() == 1,
                    })
        };
        fits.retain(|(_, p)| seq_ok(p));
    }
    match fits.len() {
        1 => {
            let (split, payload) = fits.remove(0);
            Ok(Inspection {
                arch: (header.kind == FileKind::Session).then_some(split.arch),
                outputs: split.outputs,
                payload,
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
                    "{}{}",
                    p.layout,
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

/// Reads a whole file, with an error naming the path.
pub fn read_file(path: &Path) -> Result<Vec<u8>> {
    fs::read(path).map_err(|e| KvError::Io(format!("cannot read {}: {e}", path.display())))
}

/// Architectures whose state is recurrent (one cell per sequence, no stream prefix).
const RECURRENT_ARCHS: [&str; 7] = [
    "mamba",
    "mamba2",
    "rwkv6",
    "rwkv6qwen2",
    "rwkv7",
    "arwkv7",
    "jamba",
];

/// Whether a session's architecture keeps a recurrent state.
pub fn is_recurrent_arch(arch: &str) -> bool {
    RECURRENT_ARCHS.contains(&arch)
}

/// Parameters of a cache that can hold exactly what an inspected file holds.
pub fn params_for(ins: &Inspection, recurrent: bool) -> Result<crate::CacheParams> {
    use crate::state::VBlock;
    use crate::GgmlType;
    let stream = ins
        .payload
        .streams
        .iter()
        .find(|s| !s.layers.is_empty())
        .ok_or_else(|| {
            KvError::InvalidState(
                "the file holds no cells, so no cache shape can be derived".into(),
            )
        })?;
    let ty = |id: i32| {
        GgmlType::from_id(id)
            .ok_or_else(|| KvError::InvalidState(format!("type id {id} is not a KV type")))
    };
    let width = |t: GgmlType, row: u64| -> Result<u32> {
        let w = row as usize / t.type_size() * t.block_size();
        if t.row_size(w)? as u64 != row {
            return Err(KvError::InvalidState(format!(
                "row size {row} is not whole {t} blocks"
            )));
        }
        Ok(w as u32)
    };
    let mut k_widths = Vec::new();
    let mut v_widths = Vec::new();
    let type_k = ty(stream.layers[0].k_type)?;
    let mut type_v = type_k;
    for l in &stream.layers {
        k_widths.push(width(ty(l.k_type)?, l.k_row_size)?);
        match &l.v {
            VBlock::Rows {
                ty: t, row_size, ..
            } => {
                type_v = ty(*t)?;
                v_widths.push(width(type_v, *row_size)?);
            }
            VBlock::Transposed { ty: t, n_embd, .. } => {
                type_v = ty(*t)?;
                v_widths.push(*n_embd);
            }
        }
    }
    let cells: usize = ins.payload.streams.iter().map(|s| s.cells.len()).sum();
    let max_seq = ins
        .payload
        .streams
        .iter()
        .flat_map(|s| s.cells.iter().flat_map(|c| c.seq_ids.iter()))
        .copied()
        .max()
        .unwrap_or(0)
        .max(ins.payload.streams.len() as i32 - 1);
    let n_seq_max = (max_seq + 1).clamp(1, crate::MAX_SEQ as i32) as u32;
    let size = if recurrent {
        n_seq_max.max(cells as u32)
    } else {
        (cells as u32).max(1)
    };
    let mut p = crate::CacheParams::new(size, stream.layers.len() as u32, 0, 0);
    p.n_embd_k_gqa = k_widths;
    p.n_embd_v_gqa = v_widths;
    p.type_k = type_k;
    p.type_v = type_v;
    p.flash_attn = stream.v_trans == Some(false);
    p.recurrent = recurrent;
    p.n_seq_max = n_seq_max;
    Ok(p)
}

/// What `convert` does to a file.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ConvertOptions {
    /// Output format options (layout, version, streams).
    pub write: WriteOptions,
    /// Output kind; default: the input's kind, or a sequence file when `extract_seq` is set.
    pub to: Option<FileKind>,
    /// The sequence to write into a sequence file (from a session or a sequence file).
    pub extract_seq: Option<i32>,
    /// Rename the written sequence to this id (e.g. to target a slot of a non-unified context).
    pub as_seq: Option<i32>,
    /// Session output: the architecture name when the input has none (default "llama").
    pub arch: Option<String>,
    /// Re-type K (f32 <-> f16, or any KV type).
    pub type_k: Option<crate::GgmlType>,
    /// Re-type V.
    pub type_v: Option<crate::GgmlType>,
    /// Whether the state is recurrent. Sessions tell by their architecture; a stream-less
    /// sequence file is either a seed-era transformer state or a recurrent one, and converting
    /// it to today's layout needs this answered.
    pub recurrent: Option<bool>,
}

/// Converts a state file: layout or version change, session <-> sequence, sequence renaming,
/// K/V re-typing.
pub fn convert_bytes(bytes: &[u8], opts: &ConvertOptions) -> Result<Vec<u8>> {
    let ins = inspect_bytes(bytes)?;
    let recurrent = match (opts.recurrent, ins.arch.as_deref()) {
        (Some(r), _) => r,
        (None, Some(arch)) => is_recurrent_arch(arch),
        (None, None) if ins.payload.layout == Layout::Streams => false,
        (None, None) if opts.write.layout == Layout::Seed => false,
        (None, None) => {
            return Err(KvError::InvalidArg(
                "this sequence file has no stream prefix: it is either a seed-era transformer state or a recurrent (Mamba/RWKV) state; say which (recurrent: true or false) to write today's layout".into(),
            ))
        }
    };
    let mut params = params_for(&ins, recurrent)?;
    let wanted = opts
        .write
        .n_stream
        .max(opts.as_seq.map_or(0, |s| s.max(0) as u32 + 1))
        .max(opts.extract_seq.map_or(0, |s| s.max(0) as u32 + 1));
    if wanted > params.n_seq_max {
        params.n_seq_max = wanted.min(crate::MAX_SEQ as u32);
        if recurrent {
            params.size = params.size.max(params.n_seq_max);
        }
    }
    let mut cache = KvCache::new(params)?;
    let read = ReadOptions {
        layout: Some(ins.payload.layout),
        allow_scattered: false,
    };
    let seq_in_file = ins
        .payload
        .streams
        .iter()
        .position(|s| !s.cells.is_empty())
        .map(|s| {
            ins.payload.streams[s].cells[0]
                .seq_ids
                .first()
                .copied()
                .unwrap_or(s as i32)
        })
        .unwrap_or(0);
    let loaded = match ins.header.kind {
        FileKind::Session => cache.load_session_bytes(bytes, read, None)?,
        FileKind::Sequence => cache.load_sequence_bytes(bytes, seq_in_file, read, None)?,
    };
    if opts.type_k.is_some() || opts.type_v.is_some() {
        cache = cache.retyped(
            opts.type_k.unwrap_or(cache.type_k()),
            opts.type_v.unwrap_or(cache.type_v()),
        )?;
    }
    let mut seq = opts.extract_seq.unwrap_or(seq_in_file);
    if let Some(target) = opts.as_seq {
        if target != seq {
            cache.seq_cp(seq, target, -1, -1)?;
            cache.seq_rm(seq, -1, -1)?;
            seq = target;
        }
    }
    let tokens = &loaded.header.tokens;
    let to = opts
        .to
        .unwrap_or(match (ins.header.kind, opts.extract_seq) {
            (_, Some(_)) => FileKind::Sequence,
            (kind, None) => kind,
        });
    match to {
        FileKind::Session => {
            let arch = loaded
                .arch
                .as_deref()
                .or(opts.arch.as_deref())
                .unwrap_or("llama");
            cache.session_file_bytes(tokens, arch, loaded.outputs.as_ref(), opts.write, None)
        }
        FileKind::Sequence => cache.sequence_file_bytes(seq, tokens, opts.write, None),
    }
}
