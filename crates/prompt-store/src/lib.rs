//! A prompt store: the KV rows of llama.cpp prompts kept in blocks of `block_tokens` tokens,
//! deduplicated by prefix and kept across restarts.
//!
//! Block `i` of a prompt is stored under a chain key
//! `key_i = SHA-256(key_{i-1} || tokens of block i)` whose root `key_{-1}` is the
//! [fingerprint](Shape::fingerprint) of the model and its memory's shape, so two prompts share
//! exactly the blocks of their common prefix, and a key says everything that shaped its bytes.
//! What a restore point needs beyond full blocks (a partial last block, a sliding window, a
//! recurrent state) is a [checkpoint] keyed by the exact prefix it ends.
//! Each value is one self-describing [block](block) (header, K and V rows of every layer,
//! checksum), so a backend that evicts values can never leave half a block behind.
//!
//! The store uses the core's state format rather than the cache's internals: a block's rows
//! come from [`llama_kv_cache::SeedCache::state_write`] of one sequence, and a restore assembles a
//! one-sequence payload and loads it with the transactional
//! [`llama_kv_cache::SeedCache::state_read`].
//!
//! Storage is behind the [`Backend`] trait: [`MemoryBackend`] (in-process, byte budget, LRU or S3-FIFO eviction) and
//! [`DirBackend`] (content-addressed files shared by processes, LRU byte budget);
//! [`TieredBackend`] puts several in front of each other (the Redis backend lives in the
//! `prompt-store-redis` crate).

mod backend;
pub mod block;
mod capture;
pub mod checkpoint;
pub mod compact;
mod dir;
mod error;
pub mod events;
mod geometry;
mod key;
mod memory;
pub mod metrics;
mod payload;
pub mod seal;
mod shape;
mod store;
mod tiered;

pub use backend::{visit_each, Backend, TierHealth, TierMetrics, Usage};
pub use compact::{Compressed, Compression};
pub use dir::DirBackend;
pub use error::{StoreError, StoreResult};
pub use geometry::{
    chain_at, chain_keys, checkpoint_key, index_key, swa_key, Geometry, LayerGeometry,
    FORMAT_VERSION,
};
pub use key::Key;
pub use memory::{EvictionPolicy, MemoryBackend};
pub use shape::{FileFormat, KvShape, Shape};
pub use store::{
    is_model_record, LookupDetail, LookupReason, PromptStore, PutReport, StoreStats,
    WriteFileOptions, DEFAULT_BLOCK_TOKENS, MAX_BLOCK_TOKENS, MIN_BLOCK_TOKENS,
};
pub use tiered::TieredBackend;
