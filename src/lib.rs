//! Node.js binding of the `llama-kv-cache` core: converts JS values, schedules tasks on the
//! libuv threadpool and maps errors to stable codes. No cache logic lives here.

#![deny(clippy::all)]
// napi registers the exports only outside `cfg(test)`, so a test build sees them as unused
#![cfg_attr(test, allow(dead_code))]

mod args;
mod decay;
mod device;
mod error;
mod handle;
mod inspect;
mod jobs;
mod kv_cache;
mod model;
mod move_list;
mod options;
mod prompt_store;
mod queue;
mod signal;
mod state_stream;
mod store_backend;
mod store_events;
mod tasks;
mod types;
