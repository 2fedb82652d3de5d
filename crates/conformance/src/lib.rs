//! Conformance of `llama-kv-cache` against real llama.cpp of both eras, built from the source
//! shipped in the crates.io package `llama-cpp-sys-2` by build.rs (one cmake helper,
//! `build/llama_cmake.rs`, for both):
//!
//! - [`seed`]: llama.cpp 0.1.103, the seed this crate rebuilt: random traces applied op by op
//!   to a real `llama_context` (`kv-driver`) and to [`llama_kv_cache::SeedCache`], compared
//!   after every op.
//! - [`today`]: llama.cpp 0.1.161 as a peer (`today-driver`): fixtures it writes, files we write
//!   that it must load, and random traces of today's memories compared after every op.
//! - [`driver`]: where each driver is ([`driver::Driver::path`], the one lookup) and how to
//!   talk to a running one.
//! - [`compare`]: the one comparer of both eras' traces, field by field.
//! - [`models`]: the tiny models both eras load, all written by `interop/make_models.py`.

pub mod compare;
pub mod driver;
pub mod models;
pub mod seed;
pub mod today;

pub use models::{model_path, models_dir, repo_root};
