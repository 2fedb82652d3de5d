//! State payloads (`stateSize`, `stateWrite*`, `stateRead*`) and llama.cpp's session and
//! sequence files, with their options.

use llama_kv_cache::{Layout, ReadOptions, WriteOptions};
use napi::bindgen_prelude::*;
use napi_derive::napi;

use super::KvCache;
use crate::args::{self, i32v, opt_i32, u32v, Bytes, Num, Obj, Tokens};
use crate::error::{err, from_core, Code, JsResult};
use crate::jobs::{
    self, LoadFileJob, PayloadBuffer, SaveFileJob, StateForm, StateReadJob, StateWriteIntoCopyJob,
    StateWriteIntoJob, StateWriteJob,
};
use crate::queue::JsPromise;
use crate::signal::Signal;
use crate::tasks::ProgressFn;
use crate::types::{LoadedFile, ReadResult};

/// Options of `stateWrite` and the file savers.
#[napi(object, object_to_js = false)]
pub struct SaveOptions {
    /// Payload layout: 'streams' (default), 'seed' (b4944, llama.node 0.3.x) or 'streams-rot'
    /// (llama.cpp 0.1.161: records the rotation; the only layout a rotated cache can write).
    pub layout: Option<String>,
    /// File version: sequence files 2 (default, llama.node), 3 (node-llama-cpp) or 4
    /// (llama.cpp 0.1.161); session files 9 (default), 10 or 11. Versions 4 and 11 write the
    /// 'streams-rot' layout; without a version, 'streams-rot' writes 4 / 11.
    pub version: Option<f64>,
    /// Streams to write with today's layout: 1 (unified context, default) or nSeqMax (one per sequence, as a non-unified context).
    pub n_stream: Option<f64>,
    /// Session files: the model architecture name. Default 'llama'.
    pub arch: Option<String>,
    /// `stateWrite`, `stateWriteInto`, `stateSize`: llama.cpp's `PARTIAL_ONLY` state (what
    /// llama-server keeps as a context checkpoint): an iSWA memory's window cache, a hybrid's
    /// recurrent part (after its window cache in hybrid-iSWA); a 'kv' or 'recurrent' cache
    /// writes its whole state, as llama.cpp does. Default false.
    pub partial: Option<bool>,
    /// `stateWrite`, `stateWriteInto`, `stateSize`: the bytes of `llama_state_seq_get_data`,
    /// the state after its envelope (the magic 0xaf143cd8 and the sequence id), for
    /// `llama_state_seq_set_data`. `stateRead` accepts states with or without it. Default false.
    pub envelope: Option<bool>,
    /// Called with `(doneBytes, totalBytes)` while the state is written.
    #[napi(ts_type = "(done: number, total: number) => void")]
    pub on_progress: Option<ProgressFn>,
    /// Aborts the async operation (also while it runs); the promise rejects with
    /// `ERR_KV_ABORTED` (`name` 'AbortError').
    #[napi(ts_type = "AbortSignal")]
    pub signal: Option<Signal>,
}

crate::args::option_names!(
    SaveOptions:
    "layout", "version", "nStream", "arch", "partial", "envelope", "onProgress", "signal",
);

/// Options of `stateRead` and the file loaders.
#[napi(object, object_to_js = false)]
pub struct LoadOptions {
    /// Force 'seed', 'streams' or 'streams-rot' (session v11 / sequence v4) instead of
    /// detecting the layout.
    pub layout: Option<String>,
    /// Of a payload of several memories, the part to load: 'base' or 'swa' (iSWA: sliding-window
    /// models), 'attention' or 'recurrent' (hybrid models). Files without it load the one part
    /// that fits this cache (ERR_KV_INVALID_STATE naming the parts when none or several do);
    /// `stateRead` without it reads a single memory.
    pub part: Option<String>,
    /// One-sequence restores: use free cells anywhere when no contiguous run is free (today's llama.cpp does). Default false (the seed's rule).
    pub allow_scattered: Option<bool>,
    /// `stateRead`: the payload is llama.cpp's `PARTIAL_ONLY` state (a context checkpoint, as
    /// `stateWrite(seq, { partial: true })` writes it): an iSWA memory's window cache, a
    /// hybrid's recurrent part; the other parts keep what they hold. Default false.
    pub partial: Option<bool>,
    /// Async `stateRead`: the call takes `data` instead of copying it, as a transfer list
    /// does: its ArrayBuffer moves (without a copy) into one only the call holds, so `data`
    /// and every view of that ArrayBuffer are detached (`byteLength` 0) from the call on, and
    /// nothing the program does to them can reach the bytes being read. For a payload the
    /// program drops after the load (read from a file or a socket); it saves the copy, the
    /// async call's cost over `stateReadSync`. `data` must view its whole ArrayBuffer:
    /// otherwise (Node's pooled small Buffers, `subarray`s), or when it cannot be transferred
    /// (a SharedArrayBuffer), it is copied as without the option, and stays usable.
    /// `stateReadSync` reads in place either way. Default false.
    pub transfer: Option<bool>,
    /// Called with `(doneBytes, totalBytes)`.
    #[napi(ts_type = "(done: number, total: number) => void")]
    pub on_progress: Option<ProgressFn>,
    /// Aborts the async operation until data starts being written (after that it completes); the
    /// promise rejects with `ERR_KV_ABORTED` (`name` 'AbortError').
    #[napi(ts_type = "AbortSignal")]
    pub signal: Option<Signal>,
}

crate::args::option_names!(
    LoadOptions:
    "layout", "part", "allowScattered", "partial", "transfer", "onProgress", "signal",
);

#[napi]
impl KvCache {
    /// Bytes `stateWrite(seqId, options)` will produce.
    #[napi]
    pub fn state_size(
        &self,
        #[napi(ts_arg_type = "number")] seq_id: Option<Num>,
        #[napi(ts_arg_type = "SaveOptions")] options: Option<Obj<SaveOptions>>,
    ) -> Result<f64, Code> {
        let seq = opt_i32("seqId", seq_id, -1)?;
        let (opts, form, ..) = state_options(options)?;
        self.with_memory(|c| {
            if !form.plain() {
                return Ok(form.write(c, seq, opts).map_err(from_core)?.len() as f64);
            }
            Ok(c.state_size(seq, &opts).map_err(from_core)? as f64)
        })
    }

    /// The KV state of sequence `seqId` (-1, the default: the whole cache) in llama.cpp's
    /// format (`llama_state_seq_get_data`'s KV part), synchronously.
    #[napi(ts_return_type = "Buffer")]
    pub fn state_write_sync(
        &self,
        env: Env,
        #[napi(ts_arg_type = "number")] seq_id: Option<Num>,
        #[napi(ts_arg_type = "SaveOptions")] options: Option<Obj<SaveOptions>>,
    ) -> Result<PayloadBuffer, Code> {
        let seq = opt_i32("seqId", seq_id, -1)?;
        let (opts, form, ..) = state_options(options)?;
        self.with_memory(|m| StateWriteJob::run_sync(&env, m, seq, opts, form))
    }

    /// The KV state of sequence `seqId` (-1: the whole cache), on the threadpool.
    #[napi(ts_return_type = "Promise<Buffer>")]
    pub fn state_write(
        &self,
        env: Env,
        #[napi(ts_arg_type = "number")] seq_id: Option<Num>,
        #[napi(ts_arg_type = "SaveOptions")] options: Option<Obj<SaveOptions>>,
    ) -> Result<JsPromise, Code> {
        let seq = opt_i32("seqId", seq_id, -1)?;
        let (opts, form, progress, signal) = state_options(options)?;
        // an idle cache is what the task will find (calls from now on queue or are busy), so
        // the route of its payload is decided here; a failed plan is left to the task, which
        // rejects with it
        let plan = match self.shared.queue.is_pending() || !form.plain() {
            true => None,
            false => self.with_memory(|m| {
                Ok(m.kv_ref("stateWrite")
                    .and_then(|c| c.state_out(seq, opts.layout, opts.n_stream))
                    .ok())
            })?,
        };
        let job = StateWriteJob::new(&env, seq, opts, form, plan);
        self.run_async(&env, job, progress, signal)
    }

    /// Writes the KV state of `seqId` (-1, the default: the whole cache) into the front of
    /// `buffer`, without allocating a copy, and returns its size in bytes (`stateSize`). Fails
    /// with ERR_KV_INVALID_ARG, writing nothing, when `buffer` is smaller. Synchronous.
    #[napi]
    pub fn state_write_into_sync(
        &self,
        #[napi(ts_arg_type = "Uint8Array")] buffer: Bytes,
        #[napi(ts_arg_type = "number")] seq_id: Option<Num>,
        #[napi(ts_arg_type = "SaveOptions")] options: Option<Obj<SaveOptions>>,
    ) -> Result<f64, Code> {
        let seq = opt_i32("seqId", seq_id, -1)?;
        let (opts, form, ..) = state_options(options)?;
        let mut buffer = buffer;
        // SAFETY: every argument is converted (the options' getters have run); only the core
        // runs while the buffer is written
        let out = unsafe { buffer.borrow_mut("buffer")? };
        self.run_sync(StateWriteIntoJob {
            out,
            seq,
            opts,
            form,
        })
    }

    /// `stateWriteIntoSync` on the threadpool: the state is written into `buffer` when the promise
    /// settles (rejecting with ERR_KV_INVALID_ARG if `buffer` was detached or shrunk meanwhile).
    #[napi(ts_return_type = "Promise<number>")]
    pub fn state_write_into(
        &self,
        env: Env,
        #[napi(ts_arg_type = "Uint8Array")] buffer: Bytes,
        #[napi(ts_arg_type = "number")] seq_id: Option<Num>,
        #[napi(ts_arg_type = "SaveOptions")] options: Option<Obj<SaveOptions>>,
    ) -> Result<JsPromise, Code> {
        let seq = opt_i32("seqId", seq_id, -1)?;
        let (opts, form, progress, signal) = state_options(options)?;
        // the threadpool writes into Rust memory, copied into `buffer` on this thread when the
        // task completes (see StateWriteIntoCopyJob)
        let (target, len) = buffer.hold("buffer")?;
        let job = StateWriteIntoCopyJob {
            target,
            len,
            seq,
            opts,
            form,
            payload: Vec::new(),
        };
        self.run_async(&env, job, progress, signal)
    }

    /// Restores a state into sequence `seqId` (-1: the whole cache), detecting the layout.
    /// Transactional: on any error the cache is exactly as before.
    #[napi]
    pub fn state_read_sync(
        &self,
        #[napi(ts_arg_type = "Uint8Array")] data: Bytes,
        #[napi(ts_arg_type = "number")] seq_id: Option<Num>,
        #[napi(ts_arg_type = "LoadOptions")] options: Option<Obj<LoadOptions>>,
    ) -> Result<ReadResult, Code> {
        let seq = opt_i32("seqId", seq_id, -1)?;
        let (opts, ..) = load_options(options)?;
        // SAFETY: every argument is converted (the options' getters have run); only the core
        // runs while the payload is read in place
        let data = unsafe { data.borrow("data")? };
        self.run_sync(StateReadJob { data, seq, opts })
    }

    /// Restores a state on the threadpool (transactional). `data` is copied at the call, so it
    /// may be reused or transferred at once; with `{ transfer: true }` the call takes it
    /// instead (detaching it, see `LoadOptions.transfer`).
    #[napi(ts_return_type = "Promise<ReadResult>")]
    pub fn state_read(
        &self,
        env: Env,
        #[napi(ts_arg_type = "Uint8Array")] data: Bytes,
        #[napi(ts_arg_type = "number")] seq_id: Option<Num>,
        #[napi(ts_arg_type = "LoadOptions")] options: Option<Obj<LoadOptions>>,
    ) -> Result<JsPromise, Code> {
        let seq = opt_i32("seqId", seq_id, -1)?;
        let (opts, progress, signal, transfer) = load_options(options)?;
        // JS may detach `data` while the threadpool reads: the task reads memory it owns, a
        // copy (one memcpy of the payload into reused staging memory) or the caller's taken
        let data = match transfer {
            true => data.take("data")?,
            false => data.copy("data")?,
        };
        self.run_async(&env, StateReadJob { data, seq, opts }, progress, signal)
    }

    /// Saves sequence `seqId` with its prompt `tokens` as a llama.cpp sequence file ('ggsq'),
    /// atomically (a failed save leaves the previous file intact), synchronously.
    #[napi]
    pub fn save_sequence_file_sync(
        &self,
        #[napi(ts_arg_type = "string | Uint8Array")] path: Unknown<'_>,
        #[napi(ts_arg_type = "number")] seq_id: Num,
        #[napi(ts_arg_type = "ArrayLike<number> | Int32Array")] tokens: Tokens,
        #[napi(ts_arg_type = "SaveOptions")] options: Option<Obj<SaveOptions>>,
    ) -> Result<(), Code> {
        let seq = i32v("seqId", seq_id)?;
        let (opts, arch, ..) = save_options(options)?;
        self.run_sync(SaveFileJob {
            path: args::path("path", &path)?,
            seq: Some(seq),
            arch,
            tokens: tokens.0,
            opts,
        })
    }

    /// Saves a sequence file on the threadpool.
    #[napi(ts_return_type = "Promise<void>")]
    pub fn save_sequence_file(
        &self,
        env: Env,
        #[napi(ts_arg_type = "string | Uint8Array")] path: Unknown<'_>,
        #[napi(ts_arg_type = "number")] seq_id: Num,
        #[napi(ts_arg_type = "ArrayLike<number> | Int32Array")] tokens: Tokens,
        #[napi(ts_arg_type = "SaveOptions")] options: Option<Obj<SaveOptions>>,
    ) -> Result<JsPromise, Code> {
        let seq = i32v("seqId", seq_id)?;
        let (opts, arch, progress, signal) = save_options(options)?;
        self.run_async(
            &env,
            SaveFileJob {
                path: args::path("path", &path)?,
                seq: Some(seq),
                arch,
                tokens: tokens.0,
                opts,
            },
            progress,
            signal,
        )
    }

    /// Loads a sequence file ('ggsq', any supported version and layout) into `destSeqId` and
    /// returns its tokens. Transactional.
    #[napi]
    pub fn load_sequence_file_sync(
        &self,
        #[napi(ts_arg_type = "string | Uint8Array")] path: Unknown<'_>,
        #[napi(ts_arg_type = "number")] dest_seq_id: Num,
        #[napi(ts_arg_type = "LoadOptions")] options: Option<Obj<LoadOptions>>,
    ) -> Result<LoadedFile, Code> {
        let dest = i32v("destSeqId", dest_seq_id)?;
        let (opts, ..) = file_load_options(options)?;
        self.run_sync(LoadFileJob {
            path: args::path("path", &path)?,
            dest: Some(dest),
            opts,
        })
    }

    /// Loads a sequence file on the threadpool.
    #[napi(ts_return_type = "Promise<LoadedFile>")]
    pub fn load_sequence_file(
        &self,
        env: Env,
        #[napi(ts_arg_type = "string | Uint8Array")] path: Unknown<'_>,
        #[napi(ts_arg_type = "number")] dest_seq_id: Num,
        #[napi(ts_arg_type = "LoadOptions")] options: Option<Obj<LoadOptions>>,
    ) -> Result<JsPromise, Code> {
        let dest = i32v("destSeqId", dest_seq_id)?;
        let (opts, progress, signal) = file_load_options(options)?;
        self.run_async(
            &env,
            LoadFileJob {
                path: args::path("path", &path)?,
                dest: Some(dest),
                opts,
            },
            progress,
            signal,
        )
    }

    /// Saves the whole cache as a llama.cpp session file ('ggsn') with `tokens`, atomically.
    #[napi]
    pub fn save_session_file_sync(
        &self,
        #[napi(ts_arg_type = "string | Uint8Array")] path: Unknown<'_>,
        #[napi(ts_arg_type = "ArrayLike<number> | Int32Array")] tokens: Tokens,
        #[napi(ts_arg_type = "SaveOptions")] options: Option<Obj<SaveOptions>>,
    ) -> Result<(), Code> {
        let (opts, arch, ..) = save_options(options)?;
        self.run_sync(SaveFileJob {
            path: args::path("path", &path)?,
            seq: None,
            arch,
            tokens: tokens.0,
            opts,
        })
    }

    /// Saves a session file on the threadpool.
    #[napi(ts_return_type = "Promise<void>")]
    pub fn save_session_file(
        &self,
        env: Env,
        #[napi(ts_arg_type = "string | Uint8Array")] path: Unknown<'_>,
        #[napi(ts_arg_type = "ArrayLike<number> | Int32Array")] tokens: Tokens,
        #[napi(ts_arg_type = "SaveOptions")] options: Option<Obj<SaveOptions>>,
    ) -> Result<JsPromise, Code> {
        let (opts, arch, progress, signal) = save_options(options)?;
        self.run_async(
            &env,
            SaveFileJob {
                path: args::path("path", &path)?,
                seq: None,
                arch,
                tokens: tokens.0,
                opts,
            },
            progress,
            signal,
        )
    }

    /// Loads a session file ('ggsn', seed era or today's) into the whole cache. Transactional.
    #[napi]
    pub fn load_session_file_sync(
        &self,
        #[napi(ts_arg_type = "string | Uint8Array")] path: Unknown<'_>,
        #[napi(ts_arg_type = "LoadOptions")] options: Option<Obj<LoadOptions>>,
    ) -> Result<LoadedFile, Code> {
        let (opts, ..) = file_load_options(options)?;
        self.run_sync(LoadFileJob {
            path: args::path("path", &path)?,
            dest: None,
            opts,
        })
    }

    /// Loads a session file on the threadpool.
    #[napi(ts_return_type = "Promise<LoadedFile>")]
    pub fn load_session_file(
        &self,
        env: Env,
        #[napi(ts_arg_type = "string | Uint8Array")] path: Unknown<'_>,
        #[napi(ts_arg_type = "LoadOptions")] options: Option<Obj<LoadOptions>>,
    ) -> Result<JsPromise, Code> {
        let (opts, progress, signal) = file_load_options(options)?;
        self.run_async(
            &env,
            LoadFileJob {
                path: args::path("path", &path)?,
                dest: None,
                opts,
            },
            progress,
            signal,
        )
    }
}

type SaveParts = (WriteOptions, String, Option<ProgressFn>, Option<Signal>);

/// The options of the file savers, which write llama.cpp's files: whole states, without the
/// in-memory envelope.
fn save_options(options: Option<Obj<SaveOptions>>) -> JsResult<SaveParts> {
    let (opts, form, arch, progress, signal) = write_options(options)?;
    if !form.plain() {
        return Err(err(
            Code::InvalidArg,
            "partial and envelope are options of stateWrite, stateWriteInto and stateSize: \
             llama.cpp's state files hold the whole state, without the envelope",
        ));
    }
    Ok((opts, arch, progress, signal))
}

type StateParts = (WriteOptions, StateForm, Option<ProgressFn>, Option<Signal>);

/// The options of `stateWrite`, `stateWriteInto` and `stateSize`.
fn state_options(options: Option<Obj<SaveOptions>>) -> JsResult<StateParts> {
    let (opts, form, _, progress, signal) = write_options(options)?;
    Ok((opts, form, progress, signal))
}

type WriteParts = (
    WriteOptions,
    StateForm,
    String,
    Option<ProgressFn>,
    Option<Signal>,
);

fn write_options(options: Option<Obj<SaveOptions>>) -> JsResult<WriteParts> {
    let Some(Obj(o)) = options else {
        return Ok((
            WriteOptions::default(),
            StateForm::default(),
            "llama".into(),
            None,
            None,
        ));
    };
    let opts = WriteOptions {
        version: o.version.map(|v| u32v("version", v)).transpose()?,
        layout: jobs::layout(o.layout.as_deref())?.unwrap_or(Layout::Streams),
        n_stream: o.n_stream.map_or(Ok(1), |n| u32v("nStream", n))?,
    };
    let form = StateForm {
        partial: o.partial.unwrap_or(false),
        envelope: o.envelope.unwrap_or(false),
    };
    Ok((
        opts,
        form,
        o.arch.unwrap_or_else(|| "llama".into()),
        o.on_progress,
        o.signal,
    ))
}

type LoadParts = (ReadOptions, Option<ProgressFn>, Option<Signal>, bool);

/// The options of the file loaders, which read their own bytes: nothing to transfer.
fn file_load_options(
    options: Option<Obj<LoadOptions>>,
) -> JsResult<(ReadOptions, Option<ProgressFn>, Option<Signal>)> {
    let (opts, progress, signal, transfer) = load_options(options)?;
    if transfer {
        return Err(err(
            Code::InvalidArg,
            "transfer is an option of stateRead: the file loaders read the file themselves",
        ));
    }
    Ok((opts, progress, signal))
}

fn load_options(options: Option<Obj<LoadOptions>>) -> JsResult<LoadParts> {
    let Some(Obj(o)) = options else {
        return Ok((ReadOptions::default(), None, None, false));
    };
    let opts = ReadOptions {
        layout: jobs::layout(o.layout.as_deref())?,
        allow_scattered: o.allow_scattered.unwrap_or(false),
        part: jobs::part(o.part.as_deref())?,
        partial: o.partial.unwrap_or(false),
    };
    Ok((opts, o.on_progress, o.signal, o.transfer.unwrap_or(false)))
}
