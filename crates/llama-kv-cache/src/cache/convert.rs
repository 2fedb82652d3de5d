//! `convert`: a state file rewritten in another layout, version, kind or K/V type, streamed layer
//! by layer. Each memory (part) of the input gets a cache of its shape that holds only cells:
//! the cells are placed exactly as a load would place them, renamed as asked, and the cache's
//! own state writer writes the output. Its tensors are views of the input file (`convert_input`):
//! when the writer asks for a layer's rows, they are read from the input, converted (re-typed,
//! rotated) and handed over, a few MiB at a time. So memory holds the cell metadata and a few
//! MiB of rows whatever the file's size, and the bytes are the writer's, as in a load + save.

use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Mutex};

use crate::cache::convert_input::{view_cache, Input, Views};
use crate::cache::io::Progress;
use crate::cache::SeedCache;
use crate::cell_ext::CellExt;
use crate::error::{KvError, Result};
use crate::ggml_type::GgmlType;
use crate::state::dsv4::{self, Compressed, Piece};
use crate::state::files::{
    header_bytes, inspect_bytes, inspect_source, open_seekable, params_for_payload, read_file,
    resolve_version, session_prefix, write_atomic_with, FileKind, Inspection, WriteOptions,
};
use crate::state::parts::{Part, PartKind, PartRole};
use crate::state::source::Cursor;
use crate::state::Layout;
use crate::state::{parse_stream_head, StreamFormat};

/// What `convert` does to a file.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ConvertOptions {
    /// Output format options (layout, version, streams).
    pub write: WriteOptions,
    /// Output kind; default: the input's kind, or a sequence file when `extract_seq` is set.
    pub to: Option<FileKind>,
    /// Write only this part of an iSWA or hybrid payload (e.g. the base cache, or the
    /// attention cache), as a file of a single memory. Default: every part.
    pub part: Option<PartRole>,
    /// The sequence to write into a sequence file (from a session or a sequence file).
    pub extract_seq: Option<i32>,
    /// Rename the written sequence to this id (e.g. to target a slot of a non-unified context).
    pub as_seq: Option<i32>,
    /// Session output: the architecture name when the input has none (default "llama").
    pub arch: Option<String>,
    /// Re-type K (f32 <-> f16, or any KV type).
    pub type_k: Option<GgmlType>,
    /// Re-type V.
    pub type_v: Option<GgmlType>,
    /// The K rotation after re-typing (default: kept into a quantized type, none into a float
    /// type). llama.cpp 0.1.161 rotates quantized K by the largest power of two >= 64 dividing
    /// the head dimension, which a file does not record.
    pub n_rot_k: Option<u32>,
    /// The V rotation after re-typing (llama.cpp 0.1.161: 64 for quantized V with a head
    /// dimension that is a multiple of 64).
    pub n_rot_v: Option<u32>,
    /// A sequence file's window cache (iSWA's, hybrid-iSWA's, dsv4's raw one) as llama.cpp
    /// 0.1.161 saves one: only the cells its next token sees through a standard window of this
    /// many tokens (the last `swa_window` positions). A file does not record the window; without
    /// it the window cache keeps every cell of the sequence the input has, which loads alike.
    pub swa_window: Option<u32>,
    /// Whether the state is recurrent. Sessions tell by their architecture; a stream-less
    /// sequence file is either a seed-era transformer state or a recurrent one, and converting
    /// it to today's layout needs this answered.
    pub recurrent: Option<bool>,
}

/// Converts a state file's bytes: layout or version change, session <-> sequence, sequence
/// renaming, K/V re-typing, and (payloads of several memories) extraction of one part. The
/// parts are written in their order, so an iSWA or hybrid file stays one.
pub fn convert_bytes(bytes: &[u8], opts: &ConvertOptions) -> Result<Vec<u8>> {
    let ins = inspect_bytes(bytes)?;
    // the views outlive this borrow inside the caches' tensors: they share a copy
    let mut copy = crate::alloc::zeroed(bytes.len(), "a copy of the state file")?;
    copy.copy_from_slice(bytes);
    let plan = Plan::new(&ins, Arc::new(Input::Bytes(copy)), opts)?;
    let mut out = Vec::new();
    out.try_reserve_exact(plan.total()).map_err(|_| {
        KvError::Backend(format!(
            "cannot allocate {} bytes for the file",
            plan.total()
        ))
    })?;
    plan.write(&mut out, None)?;
    Ok(out)
}

/// [`convert_bytes`] of the file at `input`, streamed layer by layer into `output`, which is
/// replaced atomically: memory holds the cell metadata and a few MiB of rows whatever the file's
/// size, and a failed conversion leaves no file behind (and an existing `output` intact).
/// `progress` gets `(bytes written, bytes the output will have)` after each layer's K and V;
/// returning false stops the conversion (`Aborted`).
pub fn convert_file(
    input: &Path,
    output: &Path,
    opts: &ConvertOptions,
    progress: Option<Progress<'_>>,
) -> Result<()> {
    let (ins, input) = match open_seekable(input)? {
        Some(src) => {
            let ins = inspect_source(&src, false)?;
            let file = Input::File {
                file: Mutex::new(src.into_inner()),
                name: input.display().to_string(),
            };
            (ins, file)
        }
        // a pipe or a device cannot seek: read it whole
        None => {
            let bytes = read_file(input)?;
            (inspect_bytes(&bytes)?, Input::Bytes(bytes))
        }
    };
    let plan = Plan::new(&ins, Arc::new(input), opts)?;
    let mut progress = progress;
    write_atomic_with(output, &mut |w| plan.write(w, progress.take()))
}

/// One part of the input, ready to be written: a cache of its cells whose tensors are views of
/// the input.
struct PartPlan {
    cache: SeedCache,
    /// The sequence to write (-1: the whole cache).
    seq: i32,
    /// A hybrid's recurrent memory: the `n_layer` its data header declares.
    declared_layers: Option<u32>,
    size: usize,
}

/// Everything `convert` writes, decided (and validated) before the first byte is.
struct Plan {
    input: Arc<Input>,
    head: Vec<u8>,
    /// The input's outputs block (seed-era sessions), copied as is when the output keeps it.
    outputs: Option<(u64, u64)>,
    parts: Vec<PartPlan>,
    /// What follows the parts: a dsv4 state's compressed caches and compressor states, as
    /// bytes of the plan's own and ranges of the input file.
    tail: Vec<Piece>,
    layout: Layout,
    n_stream: u32,
}

impl Plan {
    fn new(ins: &Inspection, input: Arc<Input>, opts: &ConvertOptions) -> Result<Plan> {
        // a dsv4 state converts whole (the raw cache's parts, then its sections) unless one
        // part of the raw cache is asked for
        let dsv4 = ins.compressed.as_ref().filter(|_| opts.part.is_none());
        let to = opts
            .to
            .unwrap_or(match (ins.header.kind, opts.extract_seq) {
                (_, Some(_)) => FileKind::Sequence,
                (kind, None) => kind,
            });
        let adjusted;
        let opts = match dsv4 {
            Some(_) => {
                adjusted = dsv4_options(ins, opts, to)?;
                &adjusted
            }
            None => opts,
        };
        let parts: Vec<&Part> = match opts.part {
            None => ins.parts.iter().collect(),
            Some(want) => vec![ins.parts.iter().find(|p| p.role == want).ok_or_else(|| {
                KvError::InvalidArg(format!(
                    "part '{want}' is not in this file (it holds {})",
                    ins.parts
                        .iter()
                        .map(|p| p.role.name())
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            })?],
        };
        // a cache of no layer (the base cache of LFM2 with a window, of DeepSeek V4) is only
        // cells: alone in a file it would hold no rows, and no reader takes a payload of none
        if let (Some(want), [part]) = (opts.part, parts.as_slice()) {
            let streams = &part.payload.streams;
            if streams.iter().all(|s| s.layers.is_empty())
                && streams.iter().any(|s| s.v_trans.is_some())
            {
                return Err(KvError::InvalidArg(format!(
                    "part '{want}' holds no layer (every attention layer of this model is in \
                     another part): a file of it alone would hold no rows"
                )));
            }
        }
        let (version, layout) = resolve_version(to, &opts.write)?;
        // the sequence a sequence file holds: from the first part whose cells name it
        let seq_in_file = parts
            .iter()
            .flat_map(|p| p.payload.streams.iter().enumerate())
            .find(|(_, s)| !s.cells.is_empty())
            .map(|(i, s)| s.cells.seq_ids(0).first().copied().unwrap_or(i as i32))
            .unwrap_or(0);
        // the id comes from the file: one outside the cache's range would index past its sequences
        if !(0..crate::MAX_SEQ as i32).contains(&seq_in_file) {
            return Err(KvError::InvalidState(format!(
                "the file's first cell names seq_id {seq_in_file}, outside [0, {})",
                crate::MAX_SEQ
            )));
        }
        let seq = opts.as_seq.or(opts.extract_seq).unwrap_or(seq_in_file);
        let mut planned = Vec::with_capacity(parts.len());
        for part in &parts {
            let recurrent = match (part.kind, opts.recurrent, ins.arch.as_deref()) {
                (PartKind::Recurrent, _, _) => true,
                _ if part.role != PartRole::Whole => false,
                (_, Some(r), _) => r,
                (_, None, Some(arch)) => crate::model::arch::is_recurrent(arch),
                (_, None, None) if part.payload.layout.has_stream_prefix() => false,
                (_, None, None) if layout == Layout::Seed => false,
                (_, None, None) => {
                    return Err(KvError::InvalidArg(
                        "this sequence file has no stream prefix: it is either a seed-era transformer state or a recurrent (Mamba/RWKV) state; say which (recurrent: true or false) to write today's layout".into(),
                    ))
                }
            };
            let job = PartJob {
                ins,
                part,
                recurrent,
                seq_in_file,
                seq,
                kinds: (ins.header.kind, to),
                layout,
                // M-RoPE / PLE cells keep their extension in the form the output's version
                // writes (x, y only in the first versions that saved it)
                ext: to.cell_exts(version)[0],
                opts,
            };
            planned.push(job.plan(&input)?);
        }
        let mut head = header_bytes(to, version, &ins.header.tokens);
        let mut outputs = None;
        let tail = match dsv4 {
            Some(c) => dsv4_tail(ins, c, to, opts.extract_seq.unwrap_or(seq_in_file))?,
            None => Vec::new(),
        };
        if to == FileKind::Session {
            let arch = ins
                .arch
                .as_deref()
                .or(opts.arch.as_deref())
                .unwrap_or("llama");
            match (&ins.outputs, layout) {
                // the block is written as it was read: copy its bytes (its logits may be large)
                (Some(_), Layout::Seed) => {
                    head.extend(session_prefix(arch, None, Layout::Streams));
                    let start = (ins.header.body + 4 + arch.len()) as u64;
                    outputs = Some((start, ins.payload_offset as u64 - start));
                }
                _ => head.extend(session_prefix(arch, None, layout)),
            }
        }
        if let Some(c) = dsv4 {
            for x in [dsv4::MAGIC, dsv4::VERSION, c.partial as u32] {
                head.extend_from_slice(&x.to_le_bytes());
            }
        }
        Ok(Plan {
            input,
            head,
            outputs,
            parts: planned,
            tail,
            layout,
            n_stream: opts.write.n_stream,
        })
    }

    fn total(&self) -> usize {
        self.head.len()
            + self.outputs.map_or(0, |o| o.1 as usize)
            + self.parts.iter().map(|p| p.size).sum::<usize>()
            + self.tail.iter().map(Piece::len).sum::<usize>()
    }

    fn write(&self, w: &mut dyn Write, progress: Option<Progress<'_>>) -> Result<()> {
        let io = |e: std::io::Error| KvError::Io(format!("cannot write the converted file: {e}"));
        let total = self.total() as u64;
        w.write_all(&self.head).map_err(io)?;
        let mut done = self.head.len() as u64;
        if let Some((pos, len)) = self.outputs {
            self.input.copy_to(pos, len, w)?;
            done += len;
        }
        let mut progress = progress;
        for part in &self.parts {
            let base = done;
            let mut tick = |d: u64, _: u64| progress.as_mut().is_none_or(|p| p(base + d, total));
            let (seq, layout, n_stream) = (part.seq, self.layout, self.n_stream);
            match part.declared_layers {
                Some(n) => {
                    let mut patched = DeclaredLayers::new(&mut *w, n);
                    part.cache.state_write_to(
                        &mut patched,
                        seq,
                        layout,
                        n_stream,
                        Some(&mut tick),
                    )?;
                    if patched.held.is_some() {
                        return Err(KvError::InvalidState(
                            "the recurrent part ended before its data header".into(),
                        ));
                    }
                }
                None => {
                    part.cache
                        .state_write_to(w, seq, layout, n_stream, Some(&mut tick))?;
                }
            }
            done += part.size as u64;
        }
        for piece in &self.tail {
            match piece {
                Piece::Bytes(b) => w.write_all(b).map_err(io)?,
                Piece::Input(r) => self.input.copy_to(r.start as u64, r.len() as u64, w)?,
            }
        }
        if let (Some(p), false) = (progress.as_mut(), self.tail.is_empty()) {
            // everything is written: a stop asked for now changes nothing
            p(total, total);
        }
        Ok(())
    }
}

/// The options of a whole dsv4 state's conversion: version 11 / 4 (the only ones that have
/// it) unless another is asked for, which is refused; the raw cache's streams as the input has
/// them (one per sequence whatever the context); no re-typing (the compressed caches would need
/// it too).
fn dsv4_options(ins: &Inspection, opts: &ConvertOptions, to: FileKind) -> Result<ConvertOptions> {
    let refuse = |what: &str| {
        Err(KvError::Unsupported(format!(
            "{what} of a dsv4 state (DeepSeek V4's compressed caches) is not supported; \
             convert one part of its raw cache with part 'base' or 'swa'"
        )))
    };
    if [opts.type_k, opts.type_v].iter().any(Option::is_some)
        || [opts.n_rot_k, opts.n_rot_v].iter().any(Option::is_some)
    {
        return refuse("re-typing or rotating");
    }
    if ins.header.kind == FileKind::Sequence && opts.to == Some(FileKind::Session) {
        return refuse("a session made of a sequence file");
    }
    // a session keeps each sequence's sections in that sequence's stream
    if to == FileKind::Session && opts.as_seq.is_some() {
        return refuse("renaming a sequence in a session");
    }
    let mut out = opts.clone();
    let today = [FileKind::Session, FileKind::Sequence].map(FileKind::rotation_version);
    match out.write.version {
        None if out.write.layout != Layout::Seed => out.write.layout = Layout::StreamsRot,
        Some(v) if today.contains(&v) => {}
        _ => {
            return Err(KvError::InvalidArg(format!(
                "a dsv4 state exists in session version {} / sequence version {} only",
                today[0], today[1]
            )))
        }
    }
    out.write.n_stream = ins.parts[0].payload.streams.len() as u32;
    Ok(out)
}

/// The sections of a dsv4 state as the output holds them, their input ranges in the file: as
/// they are, or (a sequence taken out of a whole-memory save) the stream of `seq` with the
/// compressed rows its positions filled, as 0.1.161 saves one sequence.
fn dsv4_tail(ins: &Inspection, c: &Compressed, to: FileKind, seq: i32) -> Result<Vec<Piece>> {
    let at = ins.payload_offset;
    let in_file = |p: Piece| match p {
        Piece::Input(r) => Piece::Input(at + r.start..at + r.end),
        bytes => bytes,
    };
    if ins.header.kind == to {
        return Ok(c
            .sections
            .iter()
            .map(|s| in_file(Piece::Input(s.range.clone())))
            .collect());
    }
    // 0.1.161 takes the last position from the raw window cache
    let window = &ins.parts[ins.parts.len() - 1].payload;
    let pos_max = window
        .streams
        .iter()
        .flat_map(|s| s.cells.iter())
        .filter(|c| c.seq_ids.contains(&seq))
        .map(|c| c.pos)
        .max()
        .unwrap_or(-1);
    Ok(c.one_sequence(seq, pos_max)?
        .into_iter()
        .map(in_file)
        .collect())
}

/// One part of the input and what to make of it.
struct PartJob<'a> {
    ins: &'a Inspection,
    part: &'a Part,
    recurrent: bool,
    seq_in_file: i32,
    seq: i32,
    kinds: (FileKind, FileKind),
    layout: Layout,
    /// The extension the output's cells carry when the input's carry one.
    ext: CellExt,
    opts: &'a ConvertOptions,
}

impl PartJob<'_> {
    /// Places the part's cells as a load would (in a cache with no tensor data), then builds the
    /// output cache: the same cells, tensors that are views of the input in the output's types.
    fn plan(&self, input: &Arc<Input>) -> Result<PartPlan> {
        let (part, opts, seq, seq_in_file) = (self.part, self.opts, self.seq, self.seq_in_file);
        let mut params = params_for_payload(&part.payload, self.recurrent)?;
        let wanted = opts
            .write
            .n_stream
            .max(seq.max(0) as u32 + 1)
            .max(seq_in_file.max(0) as u32 + 1);
        if wanted > params.n_seq_max {
            params.n_seq_max = wanted.min(crate::MAX_SEQ as u32);
        }
        if self.recurrent {
            params.size = params.size.max(params.n_seq_max);
        }
        // a cache only to place the cells in: its tensors have no data
        let mut cells = view_cache(params.clone(), input, None)?;
        let metas = part.payload.cells()?;
        let loaded_seq = if self.kinds.0 == FileKind::Session {
            cells.check_payload(&part.payload, None)?;
            cells.place_whole(&metas)?;
            None
        } else {
            cells.check_payload(&part.payload, Some(seq_in_file))?;
            Some(seq_in_file)
        };
        let placed = match loaded_seq {
            Some(s) => cells.place_sequence(s, &metas, false)?,
            None => (0..metas.len()).collect(),
        };
        let retype = [opts.type_k.is_some(), opts.type_v.is_some()];
        let rotate = [opts.n_rot_k.is_some(), opts.n_rot_v.is_some()];
        let convert = retype.contains(&true) || rotate.contains(&true);
        let mut out_params = params.clone();
        if !params.cell_ext.is_none() {
            out_params.cell_ext = self.ext;
        }
        if convert {
            let (tk, tv) = (
                opts.type_k.unwrap_or(params.type_k),
                opts.type_v.unwrap_or(params.type_v),
            );
            let keep = |n_rot: u32, ty: GgmlType| if ty.is_quantized() { n_rot } else { 0 };
            out_params.type_k = tk;
            out_params.type_v = tv;
            out_params.n_rot_k = opts.n_rot_k.unwrap_or(keep(params.n_rot_k, tk));
            out_params.n_rot_v = opts.n_rot_v.unwrap_or(keep(params.n_rot_v, tv));
        }
        let views = Views::new(self.ins, part, &params, &out_params, &placed, convert)?;
        let mut cache = view_cache(out_params, input, Some(Arc::new(views)))?;
        cache.take_cells_of(cells);
        let source = opts.extract_seq.or(loaded_seq).unwrap_or(seq_in_file);
        if source != seq {
            // the renamed sequence replaces whatever the input held under its new id
            cache.seq_rm(seq, -1, -1)?;
            cache.seq_cp(source, seq, -1, -1)?;
            cache.seq_rm(source, -1, -1)?;
        }
        let write_seq = match self.kinds.1 {
            FileKind::Session => -1,
            FileKind::Sequence => seq,
        };
        if let (Some(n), PartRole::Swa, FileKind::Sequence) =
            (opts.swa_window, part.role, self.kinds.1)
        {
            // 0.1.161 writes no cell that is masked for the sequence's next token
            let last_masked = cache.seq_pos_max(seq)? - n as i32;
            if last_masked >= 0 {
                cache.seq_rm(seq, 0, last_masked + 1)?;
            }
        }
        let size = cache.state_size(write_seq, self.layout, opts.write.n_stream)?;
        let declared_layers = (part.kind == PartKind::Recurrent
            && part.role == PartRole::Recurrent)
            .then(|| part.payload.streams[0].n_layer_declared);
        Ok(PartPlan {
            cache,
            seq: write_seq,
            declared_layers,
            size,
        })
    }
}

impl SeedCache {
    /// Takes over the cells (and placement state) of `other`, a cache of the same size.
    fn take_cells_of(&mut self, other: SeedCache) {
        self.cells = other.cells;
        self.head = other.head;
        self.n = other.n;
    }
}

/// A hybrid's recurrent memory declares every model layer in its data header but writes only
/// the recurrent ones; a cache of those layers writes their count: this writer puts the
/// declared count back as the bytes pass (it holds them until the data header has passed).
struct DeclaredLayers<'w> {
    inner: &'w mut dyn Write,
    declared: u32,
    held: Option<Vec<u8>>,
}

impl<'w> DeclaredLayers<'w> {
    fn new(inner: &'w mut dyn Write, declared: u32) -> Self {
        DeclaredLayers {
            inner,
            declared,
            held: Some(Vec::new()),
        }
    }
}

impl Write for DeclaredLayers<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let Some(held) = self.held.as_mut() else {
            return self.inner.write(buf);
        };
        held.extend_from_slice(buf);
        if patch_declared_layers(held, self.declared).is_ok() {
            self.inner.write_all(held)?;
            self.held = None;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Writes `declared` over the `n_layer` of a recurrent payload's data header; fails while the
/// bytes end before it.
pub(crate) fn patch_declared_layers(payload: &mut [u8], declared: u32) -> Result<()> {
    let mut c = Cursor::partial(&payload[..]);
    parse_stream_head(&mut c, 0, StreamFormat::recurrent())?;
    // the head ends with the recurrent data header: s_trans, n_layer
    let end = c.pos;
    payload[end - 4..end].copy_from_slice(&declared.to_le_bytes());
    Ok(())
}
