//! The long operations, each a [`Job`] shared by its sync and async entry points.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use llama_kv_cache as core;
use llama_kv_cache::alloc::MAP_MIN;
use llama_kv_cache::staging::{self, Staged};
use llama_kv_cache::{Layout, ReadOptions, ShiftParams, WriteOptions};
use napi::bindgen_prelude::*;
use napi::JsValue;

use crate::error::{err, from_core, Code, JsResult};
use crate::move_list::UpdateReport;
use crate::tasks::Job;
use crate::types::{LoadedFile, ReadResult, SessionOutputs};

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
        m: &mut dyn core::Memory,
        _: &mut dyn FnMut(u64, u64) -> bool,
    ) -> JsResult<Self::Output> {
        m.update(self.shift.as_ref(), self.max_nodes)
            .map_err(from_core)
    }
    fn to_js(o: Self::Output) -> JsResult<Self::Js> {
        Ok(o.into())
    }
}

/// How `stateWrite` frames a state beyond its layout: llama.cpp's `PARTIAL_ONLY` state (a
/// context checkpoint) and the in-memory envelope of `llama_state_seq_get_data`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StateForm {
    pub partial: bool,
    pub envelope: bool,
}

impl StateForm {
    /// Whether it is the plain payload (the fast paths write that).
    pub fn plain(self) -> bool {
        self == StateForm::default()
    }

    /// The state of `seq` in this form.
    pub fn write(
        self,
        m: &dyn core::Memory,
        seq: i32,
        opts: WriteOptions,
    ) -> core::Result<Vec<u8>> {
        let mut out = Vec::new();
        if self.envelope {
            out.extend(core::state::files::seq_data_envelope(seq));
        }
        let body = match self.partial {
            true => m.state_write_partial(seq, opts.layout)?,
            false => m.state_write(seq, &opts, None)?,
        };
        if out.is_empty() {
            return Ok(body);
        }
        out.extend(body);
        Ok(out)
    }
}

/// `stateWrite`: the payload of one sequence or the whole cache.
pub struct StateWriteJob {
    seq: i32,
    opts: WriteOptions,
    form: StateForm,
    /// The plan of a payload lent from staging memory (decided at the call, see [`lends`]).
    lend: Option<core::StateOut>,
    /// The plan and a Buffer of its size from Node's allocator, made at the call when the
    /// cache was idle (so the task finds it unchanged); otherwise the task plans and allocates.
    planned: Option<(core::StateOut, Buffer)>,
    /// The Buffer could not be allocated at the call: the task rejects with this.
    failure: Option<crate::error::JsErr>,
}

impl StateWriteJob {
    /// The job for a call that found the seed's cache idle with `plan` (`None`: another kind, a
    /// framed state, or a busy cache, which the task plans itself): how its payload will
    /// reach JS is decided here, on the JS thread.
    pub fn new(
        env: &Env,
        seq: i32,
        opts: WriteOptions,
        form: StateForm,
        plan: Option<core::StateOut>,
    ) -> StateWriteJob {
        let mut job = StateWriteJob {
            seq,
            opts,
            form,
            lend: None,
            planned: None,
            failure: None,
        };
        match plan {
            Some(plan) if lends(plan.size()) => job.lend = Some(plan),
            Some(plan) if plan.size() >= NODE_BUFFER_FROM => match node_buffer(env, plan.size()) {
                Ok(buf) => job.planned = Some((plan, buf)),
                Err(e) => job.failure = Some(e),
            },
            _ => {}
        }
        job
    }

    /// `stateWriteSync`: the payload made on this thread, by the same choices.
    pub fn run_sync(
        env: &Env,
        m: &dyn core::Memory,
        seq: i32,
        opts: WriteOptions,
        form: StateForm,
    ) -> JsResult<PayloadBuffer> {
        let plan = match (form.plain(), m.seed()) {
            (true, Some(c)) => Some(
                c.state_out(seq, opts.layout, opts.n_stream)
                    .map_err(from_core)?,
            ),
            _ => None,
        };
        StateWriteJob::new(env, seq, opts, form, plan).payload(m, None)
    }

    fn payload(
        &mut self,
        m: &dyn core::Memory,
        p: Option<core::Progress<'_>>,
    ) -> JsResult<PayloadBuffer> {
        if let Some(e) = self.failure.take() {
            return Err(e);
        }
        if !self.form.plain() {
            let framed = self.form.write(m, self.seq, self.opts).map_err(from_core)?;
            return Ok(PayloadBuffer::Buffer(framed.into()));
        }
        // a plan is made only for the seed's cache
        if let Some(plan) = self.lend.take() {
            let c = m.kv_ref("stateWrite").map_err(from_core)?;
            let staged = c.state_out_staged(&plan, p).map_err(from_core)?;
            return Ok(PayloadBuffer::Lent(staged));
        }
        match self.planned.take() {
            Some((plan, mut buf)) => {
                let c = m.kv_ref("stateWrite").map_err(from_core)?;
                c.state_out_all(&plan, buf.as_mut(), p).map_err(from_core)?;
                Ok(PayloadBuffer::Buffer(buf))
            }
            None => Ok(PayloadBuffer::Buffer(
                m.state_write(self.seq, &self.opts, p)
                    .map_err(from_core)?
                    .into(),
            )),
        }
    }
}

impl Job for StateWriteJob {
    type Output = PayloadBuffer;
    type Js = PayloadBuffer;
    fn run(
        &mut self,
        m: &mut dyn core::Memory,
        p: &mut dyn FnMut(u64, u64) -> bool,
    ) -> JsResult<PayloadBuffer> {
        self.payload(m, Some(p))
    }
    fn to_js(o: PayloadBuffer) -> JsResult<PayloadBuffer> {
        Ok(o)
    }
}

/// Payloads lent to JS whose Buffers were not yet collected, by size class (the bit length of
/// their size: one class per doubling).
static ON_LOAN: [AtomicUsize; usize::BITS as usize + 1] =
    [const { AtomicUsize::new(0) }; usize::BITS as usize + 1];

fn on_loan(len: usize) -> &'static AtomicUsize {
    &ON_LOAN[(usize::BITS - len.leading_zeros()) as usize]
}

/// Whether a payload of `len` bytes is lent from staging memory: when kept staging memory fits
/// it, or when no payload of its size class is on loan. Node runs the finalizers of lent
/// Buffers only from its event loop, so the payloads of a loop of calls cannot come back to
/// staging meanwhile: with fresh staging memory for each, a loop of 20 one-sequence gets took
/// 0.82 ms per get instead of 0.31 from `malloc` (which reuses what the collector freed within
/// the loop), and a synchronous loop of 300 held 3.3 GiB. So a loop lends its first payload of
/// each size and the rest take the other routes ([`NODE_BUFFER_FROM`]).
fn lends(len: usize) -> bool {
    len >= MAP_MIN && (on_loan(len).load(Ordering::Relaxed) == 0 || staging::has_spare(len))
}

/// Payloads from this size on that are not lent go into a Buffer from Node's allocator
/// ([`node_buffer`]); smaller ones into a Rust `Vec` handed over as is. Measured at 65,536
/// cells: a 16 MiB payload took 7.3 ms instead of 9-15 ms (fresh pages every call the other
/// way), a 2 MiB one 0.49 ms instead of 0.21 ms (below the allocator's mmap threshold a freed
/// `Vec`'s memory is reused at once, while an allocation V8 counts brings garbage collection
/// work into the call).
const NODE_BUFFER_FROM: usize = 8 << 20;

/// A state payload on its way to JS.
pub enum PayloadBuffer {
    /// In its own memory, lent to JS as an external Buffer. That memory goes back to staging
    /// ([`llama_kv_cache::staging`]) when the garbage collector frees the Buffer, so that the
    /// next payload finds its pages faulted in: a payload in fresh memory pays a page fault per
    /// 4 KiB (4,289 for 16 MiB; a Buffer from Node's allocator the same whenever the collector
    /// has not yet freed an earlier one), fewer and cheaper in staging's huge pages. Where
    /// external buffers are refused (Electron), the bytes are copied into a Buffer of Node's
    /// and the memory goes back at once.
    Lent(Staged),
    /// A Buffer from Node's allocator, or over a Rust `Vec` (napi-rs's own conversion).
    Buffer(Buffer),
}

impl TypeName for PayloadBuffer {
    fn type_name() -> &'static str {
        "Buffer"
    }
    fn value_type() -> ValueType {
        ValueType::Object
    }
}

impl ToNapiValue for PayloadBuffer {
    unsafe fn to_napi_value(env: napi::sys::napi_env, val: Self) -> Result<napi::sys::napi_value> {
        let mut staged = match val {
            PayloadBuffer::Buffer(buf) => return Buffer::to_napi_value(env, buf),
            PayloadBuffer::Lent(staged) => staged,
        };
        let env = Env::from_raw(env);
        // never empty (a lent payload has at least MAP_MIN bytes, see `lends`); its bytes stay
        // where they are when `staged` moves into the finalizer's hint
        let (data, len) = (staged.as_mut_ptr(), staged.len());
        on_loan(len).fetch_add(1, Ordering::Relaxed);
        let returned = move |_: Env, staged: Staged| {
            on_loan(len).fetch_sub(1, Ordering::Relaxed);
            drop(staged);
        };
        // SAFETY: `data..data + len` is owned by `staged`, which the finalizer drops only when
        // the Buffer is collected, and nothing else writes it meanwhile; where the Buffer must
        // be a copy, napi-rs runs the finalizer at once
        let buffer = unsafe { BufferSlice::from_external(&env, data, len, staged, returned) }?;
        Ok(buffer.value().value)
    }
}

/// A Buffer of `len` bytes from Node's own allocator: uninitialized and counted by V8, so the
/// memory of payloads the program dropped is collected and reused by the next one. (A Buffer
/// over a large Rust `Vec` is invisible to V8's heap accounting: every payload then faulted in
/// fresh pages, 4 ms of a 16 MiB state's 5.)
fn node_buffer(env: &Env, len: usize) -> JsResult<Buffer> {
    let mut data = std::ptr::null_mut();
    let mut value = std::ptr::null_mut();
    // SAFETY: on the JS thread of `env`, with out-pointers to locals
    let status = unsafe { napi::sys::napi_create_buffer(env.raw(), len, &mut data, &mut value) };
    if status != napi::sys::Status::napi_ok {
        return Err(err(
            Code::Backend,
            format!(
                "cannot allocate a {len}-byte Buffer (above buffer.constants.MAX_LENGTH, or out \
                 of memory): stream large states with createStateReadStream"
            ),
        ));
    }
    // SAFETY: `value` is the Buffer just created on this thread
    let mut buf = unsafe { Buffer::from_napi_value(env.raw(), value) }
        .map_err(|e| err(Code::Internal, e.reason.clone()))?;
    llama_kv_cache::alloc::advise_huge_pages(buf.as_mut());
    Ok(buf)
}

/// `stateWriteIntoSync`: the payload written into the caller's buffer, without a copy (no JS
/// runs while the buffer is borrowed).
pub struct StateWriteIntoJob<'a> {
    pub out: &'a mut [u8],
    pub seq: i32,
    pub opts: WriteOptions,
    pub form: StateForm,
}

impl Job for StateWriteIntoJob<'_> {
    type Output = usize;
    type Js = f64;
    fn run(
        &mut self,
        m: &mut dyn core::Memory,
        p: &mut dyn FnMut(u64, u64) -> bool,
    ) -> JsResult<usize> {
        if !self.form.plain() {
            // framed states are written whole, then into the caller's buffer
            let payload = self.form.write(m, self.seq, self.opts).map_err(from_core)?;
            let len = self.out.len();
            let into = self
                .out
                .get_mut(..payload.len())
                .ok_or_else(|| too_small(len, payload.len()))?;
            into.copy_from_slice(&payload);
            return Ok(payload.len());
        }
        m.state_write_into(self.out, self.seq, &self.opts, Some(p))
            .map_err(from_core)
    }
    fn to_js(n: usize) -> JsResult<f64> {
        Ok(n as f64)
    }
}

/// `stateWriteInto`: the payload is written into Rust-owned memory on the threadpool and
/// copied into the caller's buffer on the JS thread when the task completes, once the buffer
/// is found still attached and large enough. Writing into the buffer from the threadpool
/// would not be sound: JS can transfer its ArrayBuffer meanwhile (`structuredClone(buf,
/// { transfer })`) and the copy that took the memory can be collected, and Node-API cannot pin
/// a buffer. The cost: the payload's size in memory while the task runs, and one memcpy of it
/// on the JS thread (about 1 ms per 10 MB); `stateWriteIntoSync` stays zero-copy.
pub struct StateWriteIntoCopyJob {
    /// The caller's buffer, held by reference; its memory is looked up again in `complete`.
    pub target: Uint8Array,
    /// Its length at the call: a state larger than this is refused as the sync form does.
    pub len: usize,
    pub seq: i32,
    pub opts: WriteOptions,
    pub form: StateForm,
    /// The payload, between `run` and `complete`.
    pub payload: Vec<u8>,
}

impl Job for StateWriteIntoCopyJob {
    type Output = usize;
    type Js = f64;
    fn run(
        &mut self,
        m: &mut dyn core::Memory,
        p: &mut dyn FnMut(u64, u64) -> bool,
    ) -> JsResult<usize> {
        let seq = self.seq;
        if !self.form.plain() {
            self.payload = self.form.write(m, seq, self.opts).map_err(from_core)?;
            if self.payload.len() > self.len {
                return Err(too_small(self.len, self.payload.len()));
            }
            return Ok(self.payload.len());
        }
        let size = m.state_size(seq, &self.opts).map_err(from_core)?;
        if size > self.len {
            return Err(too_small(self.len, size));
        }
        // the core allocates fallibly: a failure is ERR_KV_BACKEND
        self.payload = m.state_write(seq, &self.opts, Some(p)).map_err(from_core)?;
        Ok(self.payload.len())
    }
    fn to_js(n: usize) -> JsResult<f64> {
        Ok(n as f64)
    }
    fn complete(&mut self, env: &Env, n: usize) -> JsResult<f64> {
        let payload = std::mem::take(&mut self.payload);
        // SAFETY: on the JS thread of `env` (the task's completion); the reference is the one
        // taken at the call, still held
        let value =
            unsafe { <&mut Uint8Array as ToNapiValue>::to_napi_value(env.raw(), &mut self.target) }
                .map_err(|e| err(Code::Internal, e.reason.clone()))?;
        let mut kind = -1;
        let (mut len, mut data, mut buf, mut off) =
            (0usize, std::ptr::null_mut(), std::ptr::null_mut(), 0usize);
        // SAFETY: as above, with out-pointers to locals
        let status = unsafe {
            napi::sys::napi_get_typedarray_info(
                env.raw(),
                value,
                &mut kind,
                &mut len,
                &mut data,
                &mut buf,
                &mut off,
            )
        };
        if status != napi::sys::Status::napi_ok {
            return Err(err(
                Code::Internal,
                "cannot read the buffer of stateWriteInto",
            ));
        }
        if len < n || data.is_null() {
            let why = if len == 0 {
                "was detached (its ArrayBuffer transferred)".to_string()
            } else {
                format!("shrank to {len} bytes")
            };
            return Err(err(
                Code::InvalidArg,
                format!(
                    "buffer {why} before stateWriteInto settled: the {n}-byte state was not \
                     written; do not transfer or resize the buffer until the promise settles"
                ),
            ));
        }
        // SAFETY: `data` holds `len` >= n bytes, looked up just now on the JS thread, and no JS
        // runs during the copy; `payload` is Rust memory, so the two do not overlap
        unsafe { std::ptr::copy_nonoverlapping(payload.as_ptr(), data.cast::<u8>(), n) };
        Ok(n as f64)
    }
}

/// The refusal of a caller's buffer too small for the state.
fn too_small(len: usize, size: usize) -> crate::error::JsErr {
    err(
        Code::InvalidArg,
        format!("a buffer of {len} bytes cannot hold the {size}-byte state"),
    )
}

/// A core read summary for JS.
pub fn read_result(s: core::ReadSummary) -> ReadResult {
    ReadResult {
        layout: s.layout.name().into(),
        cells: s.cells,
        placed: Uint32Array::new(s.placed),
    }
}

/// `stateRead`: restores a payload. The sync form reads the caller's buffer in place (`&[u8]`:
/// no JS runs meanwhile, and a multi-GiB state needs no second copy); the async form reads
/// memory the call owns ([`crate::args::Payload`]: a copy made at the call, or the caller's
/// ArrayBuffer taken with `transfer`), since JS may detach the buffer while the threadpool
/// reads.
pub struct StateReadJob<D> {
    pub data: D,
    pub seq: i32,
    pub opts: ReadOptions,
}

impl<D: AsRef<[u8]> + Send> Job for StateReadJob<D> {
    type Output = core::ReadSummary;
    type Js = ReadResult;
    fn run(
        &mut self,
        m: &mut dyn core::Memory,
        p: &mut dyn FnMut(u64, u64) -> bool,
    ) -> JsResult<Self::Output> {
        m.state_read(self.data.as_ref(), self.seq, self.opts, Some(p))
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
    fn run(
        &mut self,
        m: &mut dyn core::Memory,
        p: &mut dyn FnMut(u64, u64) -> bool,
    ) -> JsResult<()> {
        m.save_file(
            &self.path,
            self.seq,
            &self.tokens,
            &self.arch,
            self.opts,
            Some(p),
        )
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
        m: &mut dyn core::Memory,
        p: &mut dyn FnMut(u64, u64) -> bool,
    ) -> JsResult<Self::Output> {
        m.load_file(&self.path, self.dest, self.opts, Some(p))
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
        Some(other) => Err(err(
            Code::InvalidArg,
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
            _ => Err(err(
                Code::InvalidArg,
                format!("part must be 'base', 'swa', 'attention' or 'recurrent', got {n:?}"),
            )),
        },
    }
}
