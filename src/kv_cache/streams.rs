//! `createStateReadStream` / `createStateWriteStream`: the class side of the state streams of
//! [`crate::state_stream`], with their options. The methods here open the native session;
//! `lib/state-stream.js` defines the two public methods around them.

use llama_kv_cache::{Layout, ReadOptions};
use napi::bindgen_prelude::*;
use napi_derive::napi;

use super::KvCache;
use crate::args::{opt_i32, u32v, Num, Obj};
use crate::error::{err, guard, Code, JsResult};
use crate::jobs;
use crate::signal::Signal;
use crate::state_stream::{self, RawValue, Work};

/// Options of `createStateReadStream`.
#[napi(object, object_to_js = false)]
pub struct ReadStreamOptions {
    /// Payload layout, as `stateWrite`'s: 'streams' (default), 'seed' or 'streams-rot'.
    pub layout: Option<String>,
    /// Streams to write with today's layout, as `stateWrite`'s: 1 (default) or nSeqMax.
    pub n_stream: Option<f64>,
    /// Bytes per chunk, and the stream's buffer (highWaterMark). Default 4 MiB.
    pub chunk_size: Option<f64>,
    /// Destroys the stream with an `ERR_KV_ABORTED` error (`name` 'AbortError').
    #[napi(ts_type = "AbortSignal")]
    pub signal: Option<Signal>,
}

crate::args::option_names!(ReadStreamOptions: "layout", "nStream", "chunkSize", "signal");

/// Options of `createStateWriteStream`.
#[napi(object, object_to_js = false)]
pub struct WriteStreamOptions {
    /// Force 'seed', 'streams' or 'streams-rot' instead of detecting the layout from the
    /// payload's header.
    pub layout: Option<String>,
    /// One-sequence loads: use free cells anywhere when no contiguous run is free. Default
    /// false (the seed's rule).
    pub allow_scattered: Option<bool>,
    /// The stream's buffer in bytes (highWaterMark). Default 4 MiB.
    pub chunk_size: Option<f64>,
    /// Destroys the stream with an `ERR_KV_ABORTED` error (`name` 'AbortError'); the cache is
    /// left as it was.
    #[napi(ts_type = "AbortSignal")]
    pub signal: Option<Signal>,
}

crate::args::option_names!(WriteStreamOptions: "layout", "allowScattered", "chunkSize", "signal");

impl KvCache {
    /// Opens a state stream; on an idle cache its state is made now, so that bad arguments
    /// throw here rather than on the stream.
    fn open_stream(
        &self,
        env: &Env,
        mut work: Work,
        chunk: u32,
        signal: Option<&Signal>,
    ) -> JsResult<RawValue> {
        guard(|| {
            if !self.shared.queue.is_pending() {
                let what = match work {
                    Work::Out { .. } => "createStateReadStream",
                    Work::In { .. } => "createStateWriteStream",
                };
                self.with(what, |c| work.start(c))?;
            }
            state_stream::open(env, &self.shared, work, chunk, signal)
        })
    }
}

#[napi]
impl KvCache {
    /// The native half of `createStateReadStream` (declared in index.d.ts, defined by
    /// lib/state-stream.js): checks the arguments and queues the session the stream reads.
    #[napi(js_name = "openStateReadSession", skip_typescript)]
    pub fn open_state_read_session(
        &self,
        env: Env,
        #[napi(ts_arg_type = "number")] seq_id: Option<Num>,
        #[napi(ts_arg_type = "ReadStreamOptions")] options: Option<Obj<ReadStreamOptions>>,
    ) -> Result<RawValue, Code> {
        let seq = opt_i32("seqId", seq_id, -1)?;
        let o = options.map(|o| o.0);
        let layout = jobs::layout(o.as_ref().and_then(|o| o.layout.as_deref()))?;
        let n_stream = o
            .as_ref()
            .and_then(|o| o.n_stream)
            .map_or(Ok(1), |n| u32v("nStream", n))?;
        let chunk = chunk_size(o.as_ref().and_then(|o| o.chunk_size))?;
        let work = Work::Out {
            seq,
            layout: layout.unwrap_or(Layout::Streams),
            n_stream,
            state: None,
        };
        let signal = o.as_ref().and_then(|o| o.signal.as_ref());
        self.open_stream(&env, work, chunk, signal)
    }

    /// The native half of `createStateWriteStream` (declared in index.d.ts, defined by
    /// lib/state-stream.js): checks the arguments and queues the session the stream loads.
    #[napi(js_name = "openStateWriteSession", skip_typescript)]
    pub fn open_state_write_session(
        &self,
        env: Env,
        #[napi(ts_arg_type = "number")] seq_id: Option<Num>,
        #[napi(ts_arg_type = "WriteStreamOptions")] options: Option<Obj<WriteStreamOptions>>,
    ) -> Result<RawValue, Code> {
        let seq = opt_i32("seqId", seq_id, -1)?;
        let o = options.map(|o| o.0);
        let opts = ReadOptions {
            layout: jobs::layout(o.as_ref().and_then(|o| o.layout.as_deref()))?,
            allow_scattered: o.as_ref().and_then(|o| o.allow_scattered).unwrap_or(false),
            part: None,
            partial: false,
        };
        let chunk = chunk_size(o.as_ref().and_then(|o| o.chunk_size))?;
        let work = Work::In {
            seq,
            opts,
            state: None,
        };
        let signal = o.as_ref().and_then(|o| o.signal.as_ref());
        self.open_stream(&env, work, chunk, signal)
    }
}

/// A stream's chunk size option: 1 byte to 1 GiB, default [`state_stream::DEFAULT_CHUNK`].
fn chunk_size(v: Option<f64>) -> JsResult<u32> {
    let Some(v) = v else {
        return Ok(state_stream::DEFAULT_CHUNK);
    };
    let n = u32v("chunkSize", v)?;
    if n == 0 || n > 1 << 30 {
        return Err(err(
            Code::OutOfRange,
            format!("chunkSize must be 1 to 1073741824 bytes, got {n}"),
        ));
    }
    Ok(n)
}
