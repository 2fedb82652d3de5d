//! What the memory of a model is before it is built: its parts, their cells and the bytes of
//! their tensors, from the same parameters the builders take, so that an app can size a
//! context (and the CLI print its table) without reserving anything. The iSWA and hybrid
//! memories are built from the same part plans.

use crate::cache::SeedCache;
use crate::error::Result;
use crate::memory::hybrid::HybridPlan;
use crate::memory::interface::Memory;
use crate::memory::iswa::{ContextParams, IswaCache, IswaParams};
use crate::memory::part::{planned, PartInfo, PartPlan};
use crate::memory::placement::Window;
use crate::model::{MemoryKind, ModelInfo};
use crate::params::CacheParams;
use crate::state::parts::PartRole;

/// Which memory a model gets in a context, before anything is built: the one decision that
/// [`memory_for_model`] builds from and [`MemoryPlan`] sizes.
pub struct MemoryBlueprint(pub(crate) Blueprint);

/// The memories a model can get, with what each is built from.
pub(crate) enum Blueprint {
    /// The seed's cache of a unified or recurrent model.
    Seed(CacheParams),
    /// llama.cpp 0.1.161's `llama_kv_cache` of a unified model in a context with a stream per
    /// sequence (`kv_unified` false and more than one sequence), `n_ctx / n_seq_max` cells each.
    Streams(PartPlan),
    /// 0.1.161's sliding-window memory.
    Iswa(IswaParams),
    /// 0.1.161's hybrid memory.
    Hybrid(HybridPlan),
}

/// The memory `KvCache.fromModel` builds in host memory for `model` in `ctx`: llama.cpp
/// 0.1.161's iSWA or hybrid memory (a hybrid's attention part iSWA where its layers use a
/// window), for a unified model in a context of a stream per sequence 0.1.161's
/// `llama_kv_cache` of those streams, and otherwise for a unified or recurrent model the
/// seed's cache of [`ModelInfo::cache_params`]. Refused for the memories with an indexer
/// cache.
pub fn memory_for_model(model: &ModelInfo, ctx: &ContextParams) -> Result<Box<dyn Memory>> {
    MemoryBlueprint::for_model(model, ctx)?.build()
}

impl MemoryBlueprint {
    /// Builds the memory in host memory.
    pub fn build(self) -> Result<Box<dyn Memory>> {
        Ok(match self.0 {
            Blueprint::Seed(p) => Box::new(SeedCache::new(p)?),
            Blueprint::Streams(p) => Box::new(p.build()?),
            Blueprint::Iswa(p) => Box::new(IswaCache::new(p)?),
            Blueprint::Hybrid(p) => Box::new(p.build()?),
        })
    }

    /// The memory `KvCache.fromModel` builds for `model` in `ctx`, refused where building it
    /// is (an indexer memory, K/V types the context refuses, a bad context).
    pub fn for_model(model: &ModelInfo, ctx: &ContextParams) -> Result<MemoryBlueprint> {
        model.check_live()?;
        let seed = || {
            model.cache_params(
                ctx.n_ctx,
                ctx.n_seq_max,
                ctx.type_k,
                ctx.type_v,
                ctx.flash_attn,
            )
        };
        Ok(MemoryBlueprint(match model.memory {
            MemoryKind::Iswa => Blueprint::Iswa(IswaParams::for_model(model, ctx)?),
            MemoryKind::Hybrid => Blueprint::Hybrid(HybridPlan::for_model(model, ctx)?),
            MemoryKind::Unified if !ctx.unified && ctx.n_seq_max > 1 => {
                let mut params = seed()?;
                params.size = ctx.cells_per_stream(model.n_ctx_train)?;
                Blueprint::Streams(PartPlan {
                    role: PartRole::Whole,
                    layers: (0..params.n_layer).collect(),
                    params,
                    unified: false,
                    window: Window::FULL,
                })
            }
            _ => Blueprint::Seed(seed()?),
        }))
    }

    /// The seed cache's parameters when the memory is the seed's cache, which can also be
    /// built on a device (`SeedCache::with_allocator`).
    pub fn seed_params(&self) -> Option<&CacheParams> {
        match &self.0 {
            Blueprint::Seed(p) => Some(p),
            _ => None,
        }
    }

    /// The memory it builds, sized.
    pub fn plan(&self) -> Result<MemoryPlan> {
        let (kind, parts) = match &self.0 {
            Blueprint::Streams(p) => ("kv-streams", vec![p.info(|il| il)?]),
            Blueprint::Iswa(p) => (
                "iswa",
                p.plans()?
                    .iter()
                    .map(|p| p.info(|il| il))
                    .collect::<Result<Vec<_>>>()?,
            ),
            Blueprint::Hybrid(p) => ("hybrid", p.parts()?),
            Blueprint::Seed(p) => {
                let kind = if p.recurrent { "recurrent" } else { "kv" };
                let layers = (0..p.n_layer).collect();
                (
                    kind,
                    vec![planned(PartRole::Whole, layers, p, 1, Window::FULL)?],
                )
            }
        };
        Ok(MemoryPlan { kind, parts })
    }
}

/// The memory llama.cpp 0.1.161 gives a model in a context, before it is built.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryPlan {
    /// The kind the live memory reports: `"kv"`, `"recurrent"`, `"kv-streams"`, `"iswa"` or
    /// `"hybrid"`.
    pub kind: &'static str,
    /// Its parts, in state order, with no cell used.
    pub parts: Vec<PartInfo>,
}

impl MemoryPlan {
    /// What [`memory_for_model`] builds for `model` in `ctx`,
    /// refused where building it is (an indexer memory, a bad context).
    pub fn for_model(model: &ModelInfo, ctx: &ContextParams) -> Result<MemoryPlan> {
        MemoryBlueprint::for_model(model, ctx)?.plan()
    }

    /// Bytes of every tensor of every part.
    pub fn bytes(&self) -> u64 {
        self.parts.iter().map(|p| p.bytes).sum()
    }
}
