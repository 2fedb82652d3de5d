//! llama.cpp 0.1.103, the seed: differential conformance of [`llama_kv_cache::SeedCache`].
//!
//! - [`oracle`]: llama.cpp 0.1.103 in the `kv-driver` process, which applies one op per line to
//!   a real `llama_context` and prints what the public API shows.
//! - [`ours`]: the same ops on our cache, driven through 0.1.103's decode path.
//! - [`gen`]: a seeded generator of realistic traces that never crash 0.1.103.
//! - [`run`] / [`blob`]: both sides after every op, field by field ([`crate::compare`]), state
//!   blobs down to their K and V rows.
//! - [`model`]: the models the traces run on.

pub mod blob;
pub mod gen;
pub mod model;
pub mod oracle;
pub mod ours;
pub mod run;
pub mod trace;
