//! Differential conformance of `llama-kv-cache` against real llama.cpp 0.1.103.
//!
//! - [`oracle`]: llama.cpp 0.1.103 (the source shipped in the crates.io package
//!   `llama-cpp-sys-2` 0.1.103), built by build.rs with cmake into `kv-driver`, which applies
//!   one op per line to a real `llama_context` and prints what the public API shows.
//! - [`ours`]: the same ops on [`llama_kv_cache::SeedCache`], driven through 0.1.103's decode path.
//! - [`gen`]: a seeded generator of realistic traces that never crash 0.1.103.
//! - [`run`] / [`compare`]: both sides after every op, field by field.
//! - [`gguf`]: the tiny models, written from Rust.

pub mod compare;
pub mod gen;
pub mod gguf;
pub mod oracle;
pub mod ours;
pub mod run;
pub mod trace;
