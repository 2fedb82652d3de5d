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
use crate::state::parts::PartRole;

/// The cache of a unified model in a context with a stream per sequence (`kv_unified` false
/// and more than one sequence): llama.cpp 0.1.161's `llama_kv_cache` of `n_ctx / n_seq_max`
/// cells per stream, where the memory is otherwise the seed's one-stream cache. `None` for
/// every other model and context.
pub(crate) fn streams_plan(model: &ModelInfo, ctx: &ContextParams) -> Result<Option<PartPlan>> {
    if model.memory != MemoryKind::Unified || ctx.unified || ctx.n_seq_max <= 1 {
        return Ok(None);
    }
    let mut params = model.cache_params(
        ctx.n_ctx,
        ctx.n_seq_max,
        ctx.type_k,
        ctx.type_v,
        ctx.flash_attn,
    )?;
    params.size = ctx.cells_per_stream(model.n_ctx_train)?;
    Ok(Some(PartPlan {
        role: PartRole::Whole,
        layers: (0..params.n_layer).collect(),
        params,
        unified: false,
        window: Window::FULL,
    }))
}

/// The memory llama.cpp 0.1.161 gives a model in a context, before it is built.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryPlan {
    /// The kind the live memory reports: `"kv"`, `"recurrent"`, `"iswa"` or `"hybrid"`.
    pub kind: &'static str,
    /// Its parts, in state order, with no cell used.
    pub parts: Vec<PartInfo>,
}

impl MemoryPlan {
    /// What [`Memory::for_model`](crate::Memory::for_model) builds for `model` in `ctx`,
    /// refused where building it is (an indexer memory, a bad context).
    pub fn for_model(model: &ModelInfo, ctx: &ContextParams) -> Result<MemoryPlan> {
        model.check_live()?;
        let (kind, parts) = match (model.memory, streams_plan(model, ctx)?) {
            (_, Some(streams)) => ("kv", vec![streams.info(|il| il)?]),
            (MemoryKind::Iswa, None) => (
                "iswa",
                IswaParams::for_model(model, ctx)?
                    .plans()?
                    .iter()
                    .map(|p| p.info(|il| il))
                    .collect::<Result<Vec<_>>>()?,
            ),
            (MemoryKind::Hybrid, None) => ("hybrid", HybridPlan::for_model(model, ctx)?.parts()?),
            (memory, None) => {
                let p = model.cache_params(
                    ctx.n_ctx,
                    ctx.n_seq_max,
                    ctx.type_k,
                    ctx.type_v,
                    ctx.flash_attn,
                )?;
                let kind = match memory {
                    MemoryKind::Recurrent => "recurrent",
                    _ => "kv",
                };
                let layers = (0..p.n_layer).collect();
                (
                    kind,
                    vec![planned(PartRole::Whole, layers, &p, 1, Window::FULL)?],
                )
            }
        };
        Ok(MemoryPlan { kind, parts })
    }

    /// Bytes of every tensor of every part.
    pub fn bytes(&self) -> u64 {
        self.parts.iter().map(|p| p.bytes).sum()
    }
}
