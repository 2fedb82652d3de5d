//! The one tokio runtime of the Redis backend, created on first use.
//!
//! Store calls arrive on the caller's threads (libuv's threadpool under Node) and block on
//! their request; the runtime only drives the sockets. Two worker threads are enough for
//! that: Redis itself answers from one thread, and the bytes are copied by the callers.

use std::sync::OnceLock;

use tokio::runtime::{Builder, Runtime};

const WORKER_THREADS: usize = 2;

/// The shared runtime, or why it could not be created (no threads left).
pub(crate) fn runtime() -> Result<&'static Runtime, String> {
    static RUNTIME: OnceLock<Result<Runtime, String>> = OnceLock::new();
    RUNTIME
        .get_or_init(|| {
            Builder::new_multi_thread()
                .worker_threads(WORKER_THREADS)
                .thread_name("kv-store-redis")
                .enable_io()
                .enable_time()
                .build()
                .map_err(|err| format!("cannot start the Redis client's runtime: {err}"))
        })
        .as_ref()
        .map_err(Clone::clone)
}
