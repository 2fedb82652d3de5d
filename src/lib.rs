//! Node.js binding of the `llama-kv-cache` core: converts JS values, schedules tasks on the
//! libuv threadpool and maps errors to stable codes. No cache logic lives here.

#![deny(clippy::all)]

mod args;
mod convert;
mod device;
mod error;
mod inspect;
mod jobs;
mod kv_cache;
mod tasks;
mod types;
