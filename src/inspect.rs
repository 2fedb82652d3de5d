//! `inspectState`: the structure of a llama.cpp state file, for the CLI and for apps.

use std::collections::HashMap;

use llama_kv_cache::state::dsv4::{self, Compressed, SectionKind};
use llama_kv_cache::state::files::{inspect_bytes, inspect_file};
use llama_kv_cache::state::parts::Part;
use llama_kv_cache::state::{ParsedPayload, VBlock};
use llama_kv_cache::GgmlType;
use napi::bindgen_prelude::*;
use napi_derive::napi;

use crate::args::{self, Source};
use crate::error::{from_core, guard, Code, JsResult};
use crate::signal::Signal;
use crate::tasks::{PoolJob, PoolTask, ProgressFn};

/// Cells of one sequence in a stream.
#[napi(object)]
pub struct SeqStat {
    /// Cells holding the sequence.
    pub cells: u32,
    /// Smallest position.
    pub pos_min: i32,
    /// Largest position.
    pub pos_max: i32,
}

/// One stream of the payload.
#[napi(object)]
pub struct StreamInfo {
    /// Cells in the stream.
    pub cell_count: u32,
    /// Per sequence id. One-sequence files of the seed layout record no id: their cells are listed under "-1".
    pub seqs: HashMap<String, SeqStat>,
}

/// Types and row sizes of one layer.
#[napi(object)]
pub struct LayerInfo {
    /// K type name.
    pub k_type: String,
    /// Bytes per K row.
    pub k_row_size: f64,
    /// V type name ('none' for a cache without V: multi-head latent attention keeps the
    /// latent K only).
    pub v_type: String,
    /// Bytes per V row (element size x width when transposed; 0 without V).
    pub v_row_size: f64,
}

/// Byte accounting of a file.
#[napi(object)]
pub struct ByteInfo {
    /// File size.
    pub total: f64,
    /// Header and token list.
    pub header: f64,
    /// Session prefix (arch, outputs block).
    pub session: f64,
    /// Cell metadata.
    pub meta: f64,
    /// K rows.
    pub k: f64,
    /// V rows.
    pub v: f64,
    /// dsv4: the envelope, compressed caches and compressor states (absent for other memories).
    pub compressed: Option<f64>,
}

/// One compressed cache or compressor state of a dsv4 state (DeepSeek V4).
#[napi(object)]
pub struct CompressedSection {
    /// 'csa' (compressed sparse attention), 'hca' (heavily compressed attention) or 'lid' (the
    /// lightning indexer).
    pub group: String,
    /// 'cache' (compressed K rows) or 'compressor' (the running state that pools the next rows).
    pub kind: String,
    /// Positions pooled into one row (4 or 128).
    pub ratio: u32,
    /// Streams written (one per sequence for a whole state, one for a sequence's).
    pub n_stream: u32,
    /// Rows per stream and layer: a cache's rows in use (a sequence's) or all of them (a whole
    /// state); a compressor's state rows.
    pub n_rows: u32,
    /// Elements per row.
    pub row_width: f64,
    /// The rows' type ('f32' for a compressor).
    pub row_type: String,
    /// The model layers it holds.
    pub layers: Vec<u32>,
    /// Bytes of the section.
    pub bytes: f64,
}

/// What a dsv4 state holds after its raw cache's parts.
#[napi(object)]
pub struct CompressedInfo {
    /// Partial (`PARTIAL_ONLY`, llama-server's checkpoints): the raw window cache and the
    /// compressor states only.
    pub partial: bool,
    /// In payload order: the compressed caches (none when partial), then the compressors.
    pub sections: Vec<CompressedSection>,
}

fn compressed_info(c: &Compressed) -> CompressedInfo {
    let sections = c
        .sections
        .iter()
        .map(|s| {
            let first = s.layers.first().and_then(|l| l.tensors.first());
            let (kind, ratio, n_rows) = match s.kind {
                SectionKind::Compressed { n_rows, .. } => ("cache", s.group.ratio(), n_rows),
                SectionKind::Compressor {
                    ratio, state_size, ..
                } => ("compressor", ratio, state_size),
            };
            CompressedSection {
                group: s.group.name().into(),
                kind: kind.into(),
                ratio,
                n_stream: s.n_stream,
                n_rows,
                row_width: first.map_or(0.0, |t| t.ne0 as f64),
                row_type: first.map_or_else(String::new, |t| type_name(t.type_id)),
                layers: s.layers.iter().map(|l| l.il).collect(),
                bytes: s.range.len() as f64,
            }
        })
        .collect();
    CompressedInfo {
        partial: c.partial,
        sections,
    }
}

/// One memory of a payload of several (iSWA: base then SWA; hybrid: attention then
/// recurrent).
#[napi(object)]
pub struct PartInfo {
    /// 'kv' (a unified KV cache) or 'recurrent'.
    pub kind: String,
    /// 'base' or 'swa' (iSWA), 'attention' or 'recurrent' (hybrid), 'indexer' (the key cache
    /// of a sparse-attention memory's indexer: 'dsa', 'dsa-iswa', 'hybrid-idx').
    pub role: String,
    /// The streams (a recurrent part has one).
    pub streams: Vec<StreamInfo>,
    /// Layers written (0 when every stream is empty). A hybrid's recurrent part writes only its
    /// recurrent layers.
    pub n_layer: u32,
    /// Whether V is transposed (null when every stream is empty).
    pub v_trans: Option<bool>,
    /// Per-layer types and row sizes (a recurrent part: R as K, S as V).
    pub layers: Vec<LayerInfo>,
    /// KV parts of session v11 / sequence v4: the K rotation block size (0: not rotated).
    pub n_rot_k: Option<u32>,
    /// KV parts of session v11 / sequence v4: the V rotation block size.
    pub n_rot_v: Option<u32>,
    /// Payload bytes of this part.
    pub bytes: f64,
}

/// The structure of a llama.cpp state file.
#[napi(object)]
pub struct Inspection {
    /// 'session' or 'sequence'.
    pub format: String,
    /// 'ggsn' or 'ggsq'.
    pub magic: String,
    /// File version.
    pub version: u32,
    /// Tokens stored.
    pub n_tokens: u32,
    /// The tokens.
    pub tokens: Vec<i32>,
    /// Session: architecture.
    pub arch: Option<String>,
    /// 'seed' (b4944) or 'streams' (today's llama.cpp). Recurrent payloads have no stream
    /// prefix in either era: a recurrent session is 'seed' when it has the outputs block.
    pub layout: String,
    /// Whether the state is recurrent: from the architecture of a session, false for a payload
    /// with a stream prefix, null when a sequence file cannot tell.
    pub recurrent: Option<bool>,
    /// Seed-era sessions: whether the outputs block is present.
    pub has_outputs: bool,
    /// The streams.
    pub streams: Vec<StreamInfo>,
    /// Layers (0 when every stream is empty).
    pub n_layer: u32,
    /// Whether V is transposed (null when every stream is empty).
    pub v_trans: Option<bool>,
    /// Per-layer types and row sizes.
    pub layers: Vec<LayerInfo>,
    /// Session v11 / sequence v4: the K rotation block size (0: not rotated); null for layouts
    /// that do not record it.
    pub n_rot_k: Option<u32>,
    /// Session v11 / sequence v4: the V rotation block size.
    pub n_rot_v: Option<u32>,
    /// The memory that wrote the payload: 'unified', 'recurrent' (a stream-less payload of a
    /// version whose KV caches all have a stream prefix), 'iswa', 'hybrid' (also hybrid-iSWA:
    /// base, swa, recurrent), with an indexer cache 'dsa', 'dsa-iswa' or 'hybrid-idx', or 'dsv4'
    /// (DeepSeek V4: a raw cache, then `compressed`) (an
    /// 'msa' state reads as 'iswa': its bytes do not tell them apart).
    pub memory: String,
    /// What each cell carries after its seq id count: 'none', or 'pos2' / 'pos2-tok' for the
    /// files of M-RoPE (Qwen-VL) and PLE models. No byte says so: decided by exact length.
    pub cell_ext: String,
    /// Payloads of several memories (iSWA, hybrid): each part in payload order. The top-level
    /// `streams`, `layers`, `nLayer`, `vTrans` and rotation describe the first part. Absent for
    /// a single memory.
    pub parts: Option<Vec<PartInfo>>,
    /// dsv4 (DeepSeek V4): its compressed caches and compressor states, after the raw cache's
    /// parts ('base', 'swa'; 'swa' only when partial).
    pub compressed: Option<CompressedInfo>,
    /// File size in bytes.
    pub bytes: f64,
    /// Where the bytes go.
    pub byte_accounting: ByteInfo,
}

fn type_name(id: i32) -> String {
    GgmlType::from_id(id).map_or(format!("type {id}"), |t| t.name().to_string())
}

/// Per sequence id: cells, smallest and largest position.
type SeqStats = HashMap<String, (u32, i32, i32)>;

/// What inspection shows of one memory's payload.
struct Described {
    streams: Vec<(u32, SeqStats)>,
    layers: Vec<(i32, f64, Option<i32>, f64)>,
    v_trans: Option<bool>,
    n_rot: Option<(u32, u32)>,
    meta: usize,
    k: usize,
    v: usize,
}

impl Described {
    fn streams(&self) -> Vec<StreamInfo> {
        self.streams
            .iter()
            .map(|(cell_count, seqs)| StreamInfo {
                cell_count: *cell_count,
                seqs: seqs
                    .iter()
                    .map(|(id, &(cells, pos_min, pos_max))| {
                        (
                            id.clone(),
                            SeqStat {
                                cells,
                                pos_min,
                                pos_max,
                            },
                        )
                    })
                    .collect(),
            })
            .collect()
    }

    fn layers(&self) -> Vec<LayerInfo> {
        self.layers
            .iter()
            .map(|&(k, k_row_size, v, v_row_size)| LayerInfo {
                k_type: type_name(k),
                k_row_size,
                v_type: v.map_or_else(|| "none".to_string(), type_name),
                v_row_size,
            })
            .collect()
    }
}

fn describe(payload: &ParsedPayload) -> Described {
    let (mut meta, mut k, mut v) = (0usize, 0usize, 0usize);
    let mut streams = Vec::new();
    for s in &payload.streams {
        let mut seqs = SeqStats::new();
        for c in s.cells.iter() {
            meta += 8 + 4 * c.seq_ids.len();
            let ids: Vec<i32> = if c.seq_ids.is_empty() {
                vec![-1]
            } else {
                c.seq_ids.to_vec()
            };
            for id in ids {
                let e = seqs
                    .entry(id.to_string())
                    .or_insert((0, i32::MAX, i32::MIN));
                e.0 += 1;
                e.1 = e.1.min(c.pos);
                e.2 = e.2.max(c.pos);
            }
        }
        for l in &s.layers {
            k += l.k_data.len();
            v += match &l.v {
                VBlock::Rows { data, .. } | VBlock::Transposed { data, .. } => data.len(),
                VBlock::Absent => 0,
            };
        }
        streams.push((s.cells.len() as u32, seqs));
    }
    // the first stream with a data header (a part of no layer has one, with no layer)
    let first = payload
        .streams
        .iter()
        .find(|s| !s.layers.is_empty())
        .or_else(|| payload.streams.iter().find(|s| s.v_trans.is_some()));
    let layers = first.map_or_else(Vec::new, |s| {
        s.layers
            .iter()
            .map(|l| {
                let (v_type, v_row_size) = match &l.v {
                    VBlock::Rows { ty, row_size, .. } => (Some(*ty), *row_size as f64),
                    VBlock::Transposed {
                        ty,
                        el_size,
                        n_embd,
                        ..
                    } => (Some(*ty), (*el_size as f64) * (*n_embd as f64)),
                    VBlock::Absent => (None, 0.0),
                };
                (l.k_type, l.k_row_size as f64, v_type, v_row_size)
            })
            .collect()
    });
    Described {
        streams,
        layers,
        v_trans: first.and_then(|s| s.v_trans),
        n_rot: first.and_then(|s| s.n_rot),
        meta,
        k,
        v,
    }
}

/// The structure of a state file: of a path, read from its metadata only (K/V rows are never
/// read); of bytes, parsed in place.
pub(crate) fn inspect(source: Source) -> Result<llama_kv_cache::state::files::Inspection, Code> {
    match source {
        Source::Path(path) => inspect_file(&path),
        Source::Bytes(bytes) => inspect_bytes(&bytes),
    }
    .map_err(from_core)
}

/// Parses a state file (a path or its bytes) without a cache and describes it. A path is read
/// only where its metadata is: milliseconds and a few KiB whatever the file's size.
#[napi]
pub fn inspect_state(
    #[napi(ts_arg_type = "string | Uint8Array")] source: Unknown<'_>,
) -> Result<Inspection, Code> {
    guard(|| {
        let ins = inspect(args::source("source", &source)?)?;
        let recurrent = ins.recurrent();
        let header = ins.header.clone();
        let described: Vec<(&Part, Described)> = ins
            .parts
            .iter()
            .map(|p| (p, describe(&p.payload)))
            .collect();
        let (meta, k, v) = described.iter().fold((0, 0, 0), |acc, (_, d)| {
            (acc.0 + d.meta, acc.1 + d.k, acc.2 + d.v)
        });
        let parts = (ins.parts.len() > 1 || ins.compressed.is_some()).then(|| {
            described
                .iter()
                .map(|(p, d)| PartInfo {
                    kind: p.kind.name().into(),
                    role: p.role.name().into(),
                    streams: d.streams(),
                    n_layer: d.layers.len() as u32,
                    v_trans: d.v_trans,
                    layers: d.layers(),
                    n_rot_k: d.n_rot.map(|r| r.0),
                    n_rot_v: d.n_rot.map(|r| r.1),
                    bytes: p.range.len() as f64,
                })
                .collect()
        });
        let first = &described[0].1;
        let (streams, layers) = (first.streams(), first.layers());
        Ok(Inspection {
            format: header.kind.name().into(),
            magic: if header.kind.name() == "session" {
                "ggsn"
            } else {
                "ggsq"
            }
            .into(),
            version: header.version,
            n_tokens: header.tokens.len() as u32,
            arch: ins.arch,
            layout: match &recurrent {
                Some(true) if ins.outputs.is_none() => {
                    // the era of the version: recurrent payloads have no layout of their own
                    if header.kind.records_rotation(header.version) {
                        "streams-rot".into()
                    } else {
                        "streams".into()
                    }
                }
                _ => ins.payload.layout.name().into(),
            },
            recurrent,
            has_outputs: ins.outputs.is_some(),
            n_layer: layers.len() as u32,
            v_trans: first.v_trans,
            n_rot_k: first.n_rot.map(|r| r.0),
            n_rot_v: first.n_rot.map(|r| r.1),
            memory: ins.memory.name().into(),
            cell_ext: ins.payload.ext.name().into(),
            parts,
            compressed: ins.compressed.as_ref().map(compressed_info),
            layers,
            streams,
            bytes: ins.bytes as f64,
            byte_accounting: ByteInfo {
                total: ins.bytes as f64,
                header: header.body as f64,
                session: (ins.payload_offset - header.body) as f64,
                meta: meta as f64,
                k: k as f64,
                v: v as f64,
                compressed: ins.compressed.as_ref().map(|c| {
                    (dsv4::ENVELOPE + c.sections.iter().map(|s| s.range.len()).sum::<usize>())
                        as f64
                }),
            },
            tokens: header.tokens,
        })
    })
}

/// Options of `convertStateFile`.
#[napi(object, object_to_js = false)]
pub struct ConvertFileOptions<'a> {
    /// Output payload layout: 'streams' (default), 'seed' or 'streams-rot' (versions 11 / 4).
    pub layout: Option<String>,
    /// Output file version (default: ggsq 2 / ggsn 9, what today's llama.node reads; 'streams-rot':
    /// ggsq 4 / ggsn 11, llama.cpp 0.1.161).
    pub version: Option<f64>,
    /// Streams to write (today's layout): 1 (default) or one per sequence. A DeepSeek V4
    /// state keeps the streams its raw cache has (one per sequence of its context).
    pub n_stream: Option<f64>,
    /// Extract this sequence into a sequence file.
    pub seq_id: Option<f64>,
    /// Re-type K, e.g. 'f32' or 'f16'.
    pub type_k: Option<String>,
    /// Re-type V.
    pub type_v: Option<String>,
    /// The K rotation after re-typing (default: kept into a quantized type, none into a float
    /// type): llama.cpp 0.1.161 rotates quantized K by the largest power of two >= 64 dividing
    /// the head dimension (64 for head_dim 64), which a file does not record.
    pub n_rot_k: Option<f64>,
    /// The V rotation after re-typing (llama.cpp 0.1.161: 64 for quantized V when the head
    /// dimension is a multiple of 64).
    pub n_rot_v: Option<f64>,
    /// Whether the state is recurrent (Mamba/RWKV). Sessions tell by their architecture; a
    /// sequence file without a stream prefix needs it to be written in today's layout.
    pub recurrent: Option<bool>,
    /// Output kind: 'session' or 'sequence'. Default: the input's kind ('sequence' with `seqId`).
    pub to: Option<String>,
    /// Rename the written sequence to this id.
    pub as_seq_id: Option<f64>,
    /// Session output: the architecture when the input has none. Default 'llama'.
    pub arch: Option<String>,
    /// A sequence file's window cache (iSWA, hybrid-iSWA, dsv4) as llama.cpp 0.1.161 saves one:
    /// only its last `swaWindow` positions, the cells its next token sees through the model's
    /// sliding window (which a file does not record). Default: every cell the input has.
    pub swa_window: Option<f64>,
    /// Of an iSWA or hybrid file, write only this part ('base', 'swa', 'attention',
    /// 'recurrent') as a file of a single memory. Default: every part.
    pub part: Option<String>,
    /// Called with `(doneBytes, totalBytes)` of the output after each layer's K and V rows
    /// (`convertStateFileSync`: synchronously, and an exception it throws stops the conversion,
    /// nothing written, with `ERR_KV_ABORTED`).
    #[napi(ts_type = "(done: number, total: number) => void")]
    pub on_progress: Option<Unknown<'a>>,
    /// `convertStateFile`: aborts the conversion between layers; the promise rejects with
    /// `ERR_KV_ABORTED` (`name` 'AbortError') and no file is left behind.
    #[napi(ts_type = "AbortSignal")]
    pub signal: Option<Signal>,
}

crate::args::option_names!(
    ConvertFileOptions<'_>:
    "layout", "version", "nStream", "seqId", "typeK", "typeV", "nRotK", "nRotV", "recurrent", "to",
    "asSeqId", "arch", "swaWindow", "part", "onProgress", "signal",
);

/// A JS progress callback, called on this thread.
type SyncProgress<'a> = Function<'a, FnArgs<(f64, f64)>, Unknown<'a>>;

/// `onProgress`: a function (anything else is refused by name, not called and found wanting).
fn progress_fn<'a>(v: Option<Unknown<'a>>) -> Result<Option<SyncProgress<'a>>, Code> {
    let Some(v) = v else { return Ok(None) };
    let ty = v
        .get_type()
        .map_err(|e| crate::error::err(Code::InvalidArg, e.reason))?;
    match ty {
        ValueType::Undefined => Ok(None),
        // SAFETY: the value is a function, which is what `Function` wraps
        ValueType::Function => unsafe { v.cast() }
            .map(Some)
            .map_err(|e| crate::error::err(Code::InvalidArg, e.reason)),
        other => Err(crate::error::err(
            Code::InvalidArg,
            format!("onProgress must be a function, got {other}"),
        )),
    }
}

/// The conversion `options` ask for, and their progress callback.
fn convert_options<'a>(
    options: Option<crate::args::Obj<ConvertFileOptions<'a>>>,
) -> JsResult<(
    llama_kv_cache::ConvertOptions,
    Option<Unknown<'a>>,
    Option<Signal>,
)> {
    use crate::args::{i32v, u32v};
    use crate::options::ggml_type_opt;
    let mut opts = llama_kv_cache::ConvertOptions::default();
    let Some(crate::args::Obj(o)) = options else {
        return Ok((opts, None, None));
    };
    opts.write.layout =
        crate::jobs::layout(o.layout.as_deref())?.unwrap_or(llama_kv_cache::Layout::Streams);
    opts.write.version = o.version.map(|v| u32v("version", v)).transpose()?;
    if let Some(n) = o.n_stream {
        opts.write.n_stream = u32v("nStream", n)?;
    }
    opts.extract_seq = o.seq_id.map(|s| i32v("seqId", s)).transpose()?;
    opts.type_k = ggml_type_opt("typeK", o.type_k)?;
    opts.type_v = ggml_type_opt("typeV", o.type_v)?;
    opts.n_rot_k = o.n_rot_k.map(|n| u32v("nRotK", n)).transpose()?;
    opts.n_rot_v = o.n_rot_v.map(|n| u32v("nRotV", n)).transpose()?;
    opts.recurrent = o.recurrent;
    opts.as_seq = o.as_seq_id.map(|s| i32v("asSeqId", s)).transpose()?;
    opts.swa_window = o.swa_window.map(|n| u32v("swaWindow", n)).transpose()?;
    opts.part = crate::jobs::part(o.part.as_deref())?;
    opts.arch = o.arch;
    opts.to = match o.to.as_deref() {
        None => None,
        Some("session") => Some(llama_kv_cache::FileKind::Session),
        Some("sequence") => Some(llama_kv_cache::FileKind::Sequence),
        Some(other) => {
            return Err(crate::error::err(
                Code::InvalidArg,
                format!("to must be 'session' or 'sequence', got {other:?}"),
            ))
        }
    };
    Ok((opts, o.on_progress, o.signal))
}

/// `convertStateFileSync`: converts a state file (layout or version change, sequence
/// extraction, K/V re-typing) and writes the result atomically to `output`, on the calling
/// thread. The input is read layer by layer and the output written as it is converted: memory
/// holds a few MiB of rows whatever the file's size, and a failed conversion leaves no file
/// behind. `onProgress` is called synchronously; `signal` is for the async twin only.
#[napi]
pub fn convert_state_file_sync(
    #[napi(ts_arg_type = "string | Uint8Array")] input: Unknown<'_>,
    #[napi(ts_arg_type = "string | Uint8Array")] output: Unknown<'_>,
    #[napi(ts_arg_type = "ConvertFileOptions")] options: Option<
        crate::args::Obj<ConvertFileOptions<'_>>,
    >,
) -> Result<(), Code> {
    guard(|| {
        let (input, output) = (args::path("input", &input)?, args::path("output", &output)?);
        let (opts, on_progress, _) = convert_options(options)?;
        let on_progress = progress_fn(on_progress)?;
        // the callback's failure, kept to name it in the error (the conversion stops at once)
        let mut thrown = None;
        let mut report = |done: u64, total: u64| match &on_progress {
            None => true,
            Some(f) => match f.call(FnArgs::from((done as f64, total as f64))) {
                Ok(_) => true,
                Err(e) => {
                    thrown = Some(e.reason);
                    false
                }
            },
        };
        let result = llama_kv_cache::convert_file(&input, &output, &opts, Some(&mut report));
        if let Some(reason) = thrown {
            return Err(crate::error::err(
                Code::Aborted,
                format!("convertStateFile: onProgress threw: {reason}"),
            ));
        }
        result.map_err(from_core)
    })
}

/// `convertStateFile` on the threadpool.
pub struct ConvertJob {
    input: std::path::PathBuf,
    output: std::path::PathBuf,
    opts: llama_kv_cache::ConvertOptions,
}

impl PoolJob for ConvertJob {
    type Output = ();
    type Js = ();
    fn run(&mut self, progress: &mut dyn FnMut(u64, u64) -> bool) -> JsResult<()> {
        llama_kv_cache::convert_file(&self.input, &self.output, &self.opts, Some(progress))
            .map_err(from_core)
    }
    fn to_js(_: ()) -> JsResult<()> {
        Ok(())
    }
}

/// Converts a state file as `convertStateFileSync` does, on the threadpool. `onProgress` is
/// called on this thread after the layers it reports; `signal` aborts between layers (the
/// promise rejects with `ERR_KV_ABORTED` and no file is left behind).
#[napi(ts_return_type = "Promise<void>")]
pub fn convert_state_file(
    env: Env,
    #[napi(ts_arg_type = "string | Uint8Array")] input: Unknown<'_>,
    #[napi(ts_arg_type = "string | Uint8Array")] output: Unknown<'_>,
    #[napi(ts_arg_type = "ConvertFileOptions")] options: Option<
        crate::args::Obj<ConvertFileOptions<'_>>,
    >,
) -> Result<AsyncTask<PoolTask<ConvertJob>>, Code> {
    guard(|| {
        let (input, output) = (args::path("input", &input)?, args::path("output", &output)?);
        let (opts, on_progress, signal) = convert_options(options)?;
        let progress = match progress_fn(on_progress)? {
            // SAFETY: a function of this call's env, on its thread
            Some(f) => Some(
                unsafe { ProgressFn::from_napi_value(env.raw(), f.raw()) }.map_err(|e| {
                    crate::error::err(Code::InvalidArg, format!("onProgress: {}", e.reason))
                })?,
            ),
            None => None,
        };
        let job = ConvertJob {
            input,
            output,
            opts,
        };
        Ok(PoolTask::new(&env, job, progress, signal.as_ref()))
    })
}
