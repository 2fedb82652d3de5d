//! The long operations, each a [`Job`] shared by its sync and async entry points.

use std::path::PathBuf;

use llama_kv_cache as core;
use llama_kv_cache::files::read_file;
use llama_kv_cache::{Layout, ReadOptions, ShiftParams, WriteOptions};
use napi::bindgen_prelude::*;

use crate::error::{from_core, JsResult};
use crate::tasks::Job;
use crate::types::{LoadedFile, ReadResult, SessionOutputs, UpdateReport};

/// `update`: pending K-shift and defrag.
pub struct UpdateJob {
    pub shift: Option<ShiftParams>,
    pub max_nodes: Option<u32>,
}

impl Job for UpdateJob {
    type Output = core::UpdateReport;
    type Js = UpdateReport;
    fn run(
        &mut self,
        c: &mut core::KvCache,
        _: &mut dyn FnMut(u64, u64) -> bool,
    ) -> JsResult<Self::Output> {
        c.update(self.shift.as_ref(), self.max_nodes)
            .map_err(from_core)
    }
    fn to_js(o: Self::Output) -> JsResult<Self::Js> {
        Ok(o.into())
    }
}

/// `stateWrite`: the payload of one sequence or the whole cache.
pub struct StateWriteJob {
    pub seq: i32,
    pub opts: WriteOptions,
}

impl Job for StateWriteJob {
    type Output = Vec<u8>;
    type Js = Buffer;
    fn run(
        &mut self,
        c: &mut core::KvCache,
        p: &mut dyn FnMut(u64, u64) -> bool,
    ) -> JsResult<Vec<u8>> {
        c.state_write(self.seq, self.opts.layout, self.opts.n_stream, Some(p))
            .map_err(from_core)
    }
    fn to_js(o: Vec<u8>) -> JsResult<Buffer> {
        Ok(o.into())
    }
}

/// `stateWriteInto`: the payload written into the caller's buffer, without a copy.
pub struct StateWriteIntoJob {
    pub out: Uint8Array,
    pub seq: i32,
    pub opts: WriteOptions,
}

impl Job for StateWriteIntoJob {
    type Output = usize;
    type Js = f64;
    fn run(
        &mut self,
        c: &mut core::KvCache,
        p: &mut dyn FnMut(u64, u64) -> bool,
    ) -> JsResult<usize> {
        let (seq, layout, n_stream) = (self.seq, self.opts.layout, self.opts.n_stream);
        // SAFETY: the job holds a reference to the typed array, so its memory stays alive while
        // it runs. The sync form runs while no JS can; the async form is documented as
        // `fs.read`'s buffer is: the caller must not touch the buffer until the promise settles.
        let out = unsafe { self.out.as_mut() };
        c.state_write_into(out, seq, layout, n_stream, Some(p))
            .map_err(from_core)
    }
    fn to_js(n: usize) -> JsResult<f64> {
        Ok(n as f64)
    }
}

/// A core read summary for JS.
pub fn read_result(s: core::ReadSummary) -> ReadResult {
    ReadResult {
        layout: s.layout.name().into(),
        cells: s.cells,
        placed: Uint32Array::new(s.placed),
    }
}

/// `stateRead`: restores a payload, read in place from the caller's buffer (no copy: a
/// multi-GiB state never needs a second copy in memory).
pub struct StateReadJob {
    pub data: Uint8Array,
    pub seq: i32,
    pub opts: ReadOptions,
}

impl Job for StateReadJob {
    type Output = core::ReadSummary;
    type Js = ReadResult;
    fn run(
        &mut self,
        c: &mut core::KvCache,
        p: &mut dyn FnMut(u64, u64) -> bool,
    ) -> JsResult<Self::Output> {
        c.state_read(&self.data, self.seq, self.opts, Some(p))
            .map_err(from_core)
    }
    fn to_js(o: Self::Output) -> JsResult<ReadResult> {
        Ok(read_result(o))
    }
}

/// `saveSequenceFile` / `saveSessionFile`: writes the file atomically.
pub struct SaveFileJob {
    pub path: PathBuf,
    /// `Some(seq)`: a sequence file; `None`: a session file with `arch`.
    pub seq: Option<i32>,
    pub arch: String,
    pub tokens: Vec<i32>,
    pub opts: WriteOptions,
}

impl Job for SaveFileJob {
    type Output = ();
    type Js = ();
    fn run(&mut self, c: &mut core::KvCache, p: &mut dyn FnMut(u64, u64) -> bool) -> JsResult<()> {
        match self.seq {
            Some(seq) => c.save_sequence_file(&self.path, seq, &self.tokens, self.opts, Some(p)),
            None => c.save_session_file(
                &self.path,
                &self.tokens,
                &self.arch,
                None,
                self.opts,
                Some(p),
            ),
        }
        .map_err(from_core)
    }
    fn to_js(_: ()) -> JsResult<()> {
        Ok(())
    }
}

/// `loadSequenceFile` / `loadSessionFile`.
pub struct LoadFileJob {
    pub path: PathBuf,
    /// `Some(dest)`: a sequence file into `dest`; `None`: a session file.
    pub dest: Option<i32>,
    pub opts: ReadOptions,
}

impl Job for LoadFileJob {
    type Output = core::LoadedFile;
    type Js = LoadedFile;
    fn run(
        &mut self,
        c: &mut core::KvCache,
        p: &mut dyn FnMut(u64, u64) -> bool,
    ) -> JsResult<Self::Output> {
        let bytes = read_file(&self.path).map_err(from_core)?;
        match self.dest {
            Some(dest) => c.load_sequence_bytes(&bytes, dest, self.opts, Some(p)),
            None => c.load_session_bytes(&bytes, self.opts, Some(p)),
        }
        .map_err(from_core)
    }
    fn to_js(o: Self::Output) -> JsResult<LoadedFile> {
        Ok(LoadedFile {
            format: o.header.kind.name().into(),
            version: o.header.version,
            tokens: o.header.tokens,
            arch: o.arch,
            outputs: o.outputs.map(|out| SessionOutputs {
                output_pos: out.output_pos,
                logits: Float32Array::new(out.logits),
                embeddings: Float32Array::new(out.embeddings),
            }),
            layout: o.summary.layout.name().into(),
            cells: o.summary.cells,
        })
    }
}

/// Parses a layout name.
pub fn layout(name: Option<&str>) -> JsResult<Option<Layout>> {
    match name {
        None => Ok(None),
        Some("seed") => Ok(Some(Layout::Seed)),
        Some("streams") => Ok(Some(Layout::Streams)),
        Some("streams-rot") => Ok(Some(Layout::StreamsRot)),
        Some(other) => Err(crate::error::err(
            crate::error::Code::InvalidArg,
            format!("layout must be 'seed', 'streams' or 'streams-rot', got {other:?}"),
        )),
    }
}

/// Parses a part name (a memory of an iSWA or hybrid payload).
pub fn part(name: Option<&str>) -> JsResult<Option<core::PartRole>> {
    match name {
        None => Ok(None),
        Some(n) => match core::PartRole::from_name(n) {
            Some(r) if r != core::PartRole::Whole => Ok(Some(r)),
            _ => Err(crate::error::err(
                crate::error::Code::InvalidArg,
                format!("part must be 'base', 'swa', 'attention' or 'recurrent', got {n:?}"),
            )),
        },
    }
}
