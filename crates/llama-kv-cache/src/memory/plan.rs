//! What the memory of a model is before it is built: its parts, their cells and the bytes of
//! their tensors, from the same parameters the builders take, so that an app can size a
//! context (and the CLI print its table) without reserving anything. The iSWA and hybrid
//! memories are built from the same part plans.

use crate::error::Result;
use crate::memory::attention::Window;
use crate::memory::hybrid::HybridPlan;
use crate::memory::iswa::{ContextParams, IswaParams};
use crate::memory::part::{planned, PartInfo};
use crate::model::{MemoryKind, ModelInfo};
use crate::state::parts::PartRole;

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
        let (kind, parts) = match model.memory {
            MemoryKind::Iswa => (
                "iswa",
                IswaParams::for_model(model, ctx)?
                    .plans()?
                    .iter()
                    .map(|p| p.info(|il| il))
                    .collect::<Result<Vec<_>>>()?,
            ),
            MemoryKind::Hybrid => ("hybrid", HybridPlan::for_model(model, ctx)?.parts()?),
            memory => {
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
