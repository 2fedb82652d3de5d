//! The prompt store: `put`, `lookup`, `restore`, `put_file`, `write_file`, `stats` over any
//! [`Backend`], for every memory llama.cpp 0.1.161 writes (unified, iSWA, hybrid, recurrent,
//! with rotated K/V or not).
//!
//! A restore point P is served by the chain's full blocks for [0, bt * floor(P / bt)) plus,
//! where the memory needs more (a partial last block, a sliding window, a recurrent state), a
//! checkpoint keyed by the exact prefix P ends (see [`crate::checkpoint`]). A lookup returns the
//! longest P for which everything is stored; a restore reads and verifies it, and falls back to
//! the next longest when a value turns out corrupt.

use std::sync::{Arc, Mutex};

use llama_kv_cache::cache::io::Progress;
use llama_kv_cache::{KvError, ModelInfo};

use crate::backend::Backend;
use crate::error::{StoreError, StoreResult};
use crate::events::EventHub;
use crate::geometry::chain_keys;
use crate::key::Key;
use crate::metrics::{Latencies, Metered};
use crate::seal::Sealer;
use crate::shape::Shape;

mod assemble;
mod files;
mod live;
mod plan;
mod presence;
mod put;
mod record;
mod restore;
mod stats;

pub use files::WriteFileOptions;
pub use plan::{LookupDetail, LookupReason};
pub use put::PutReport;
pub use record::is_model_record;
pub use stats::StoreStats;

use record::Bound;
use stats::Counters;

// `live` reaches these through its parent
use assemble::Target;
use restore::read_whole;

/// Tokens per block unless configured (LMCache's chunk size).
pub const DEFAULT_BLOCK_TOKENS: u32 = 256;
/// Smallest block size.
pub const MIN_BLOCK_TOKENS: u32 = 16;
/// Largest block size.
pub const MAX_BLOCK_TOKENS: u32 = 4096;

/// Index entries: the offset, plus this bit when the checkpoint needs the SWA blocks too
/// (`put` writes them, a plan reads them).
const NEEDS_SWA_BLOCKS: u32 = 1 << 31;

/// A prompt store for one model. The model's shape is fixed by the first cache or file it sees
/// and recorded in the backend (a small model record beside the blocks), so a later process
/// can `lookup` and `write_file` without a cache; a cache of another shape is refused with
/// [`StoreError::Geometry`] (use another `model` string for it).
pub struct PromptStore {
    backend: Arc<dyn Backend>,
    model: String,
    namespace: String,
    sealer: Sealer,
    block_tokens: usize,
    bound: Mutex<Option<Bound>>,
    counters: Counters,
    latency: Latencies,
    /// The backend is one store, not tiers (its evictions are asked for directly).
    single_backend: bool,
    /// The model file's description, when the store was opened for one: every state put is
    /// checked against it before it can bind the store or add a block.
    model_info: Option<(ModelInfo, String)>,
    /// Where the store's KV events go, once someone listens.
    events: Option<Arc<EventHub>>,
}

fn aborted() -> StoreError {
    StoreError::Cache(KvError::Aborted(
        "the prompt store operation was aborted".into(),
    ))
}

fn tick(progress: &mut Option<Progress<'_>>, done: u64, total: u64) -> StoreResult<()> {
    match progress {
        Some(p) => {
            if p(done, total) {
                Ok(())
            } else {
                Err(aborted())
            }
        }
        None => Ok(()),
    }
}

impl PromptStore {
    /// A store for `model` (the caller's identity of the weights, e.g. the GGUF file's sha256)
    /// with blocks of `block_tokens` tokens (16 to 4096).
    pub fn new(
        backend: Arc<dyn Backend>,
        model: &str,
        block_tokens: u32,
    ) -> StoreResult<PromptStore> {
        if !(MIN_BLOCK_TOKENS..=MAX_BLOCK_TOKENS).contains(&block_tokens) {
            return Err(StoreError::InvalidArg(format!(
                "blockTokens must be between {MIN_BLOCK_TOKENS} and {MAX_BLOCK_TOKENS}, got {block_tokens}"
            )));
        }
        if model.is_empty() {
            return Err(StoreError::InvalidArg(
                "model must be a non-empty identity of the weights (e.g. the GGUF file's sha256)"
                    .into(),
            ));
        }
        // a single backend is counted here; a tiered one counts each of its tiers
        let single_backend = backend.tier_metrics().is_empty();
        let backend = match single_backend {
            true => Arc::new(Metered::new(backend)),
            false => backend,
        };
        Ok(PromptStore {
            backend,
            single_backend,
            latency: Latencies::default(),
            model: model.into(),
            namespace: String::new(),
            sealer: Sealer::new(None),
            block_tokens: block_tokens as usize,
            bound: Mutex::new(None),
            counters: Counters::default(),
            model_info: None,
            events: None,
        })
    }

    /// The store checked against the model `info` describes (its GGUF file): a state put by
    /// `put`, `put_memory`, `put_file` or `put_bytes` whose memory kind, parts, layer counts,
    /// widths or (files) architecture or rotation differ from the model's is refused with
    /// [`StoreError::Geometry`] naming the first difference, whether or not the store holds
    /// anything yet. A state of the same shape from another model of the same architecture
    /// cannot be told apart by its shape: that takes knowing which model wrote it (the
    /// adapters take the store's model from the peer that writes the states).
    /// `name` names the model in messages (its path).
    pub fn with_model(mut self, info: ModelInfo, name: &str) -> PromptStore {
        self.model_info = Some((info, name.into()));
        self
    }

    /// The store in namespace `namespace` (a tenant): mixed into the root of every key, so two
    /// namespaces share no value and nothing one does shows in the other. The default, `""`,
    /// is shared by every store that names none.
    pub fn with_namespace(mut self, namespace: &str) -> PromptStore {
        self.namespace = namespace.into();
        self
    }

    /// The store with a `secret` (at least 16 bytes): every value it writes carries a keyed
    /// BLAKE3 tag, and a value without this tag (written without the secret, with another one,
    /// or copied from another key) is rejected on read and replaced on put.
    pub fn with_secret(mut self, secret: &[u8]) -> StoreResult<PromptStore> {
        if secret.len() < 16 {
            return Err(StoreError::InvalidArg(format!(
                "secret must be at least 16 bytes, got {}",
                secret.len()
            )));
        }
        self.sealer = Sealer::new(Some(secret));
        Ok(self)
    }

    /// The store reporting its KV events to `hub` (see [`crate::events`]): what each tier
    /// stores, evicts and drops, and the blocks found corrupt.
    pub fn with_events(mut self, hub: Arc<EventHub>) -> PromptStore {
        self.backend.observe(&hub);
        self.events = Some(hub);
        self
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// Tokens per block.
    pub fn block_tokens(&self) -> u32 {
        self.block_tokens as u32
    }

    /// The chain keys of the full blocks of `tokens` under the store's fingerprint, if the
    /// model's shape is known.
    pub fn keys(&self, tokens: &[i32]) -> StoreResult<Option<Vec<Key>>> {
        Ok(self
            .known()?
            .map(|b| chain_keys(&b.fingerprint, tokens, self.block_tokens)))
    }

    /// The shape the store is bound to, if known.
    pub fn shape(&self) -> StoreResult<Option<Shape>> {
        Ok(self.known()?.map(|b| b.shape))
    }
}
