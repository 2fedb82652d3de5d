//! What the memory of a model is before it is built: its parts, their cells and the bytes of
//! their tensors, from the same parameters the builders take, so that an app can size a
//! context (and the CLI print its table) without reserving anything. The iSWA and hybrid
//! memories are built from the same part plans.

use crate::error::Result;
use crate::memory::attention::Window;
use crate::memory::hybrid::HybridPlan;
use crate::memory::iswa::{ContextParams, IswaParams};
use crate::memory::part::{planned, PartInfo, PartPlan};
use crate::model::{MemoryKind, ModelInfo};
use crate::params::CacheParams;
use crate::state::parts::PartRole;

/// Which memory a model gets in a context, before anything is built: the one decision that
/// [`Memory::for_model`](crate::Memory::for_model) builds from and [`MemoryPlan`] sizes.
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

impl MemoryBlueprint {
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
    /// built on a device (`KvCache::with_allocator`).
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
    /// The kind the live memory reports: `"kv"`, `"recurrent"`, `"iswa"`, `"hybrid"` or
    /// `"kv-streams"`.
    pub kind: &'static str,
    /// Its parts, in state order, with no cell used.
    pub parts: Vec<PartInfo>,
}

impl MemoryPlan {
    /// What [`Memory::for_model`](crate::Memory::for_model) builds for `model` in `ctx`,
    /// refused where building it is (an indexer memory, a bad context).
    pub fn for_model(model: &ModelInfo, ctx: &ContextParams) -> Result<MemoryPlan> {
        MemoryBlueprint::for_model(model, ctx)?.plan()
    }

    /// Bytes of every tensor of every part.
    pub fn bytes(&self) -> u64 {
        self.parts.iter().map(|p| p.bytes).sum()
    }
}
