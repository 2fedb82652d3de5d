//! Whether a state file fits a model: the checks llama.cpp makes (or should make) before it
//! copies a state into a context, done without loading either. Multi-part states (iSWA, hybrid)
//! are compared part by part with the model's layers of that part.

use crate::ggml_type::GgmlType;
use crate::model::{MemoryKind, ModelInfo};
use crate::state::files::Inspection;
use crate::state::parts::{Part, PartKind, PartRole};
use crate::state::Layout;
use crate::state::VBlock;

/// One reason a state does not fit: the field and both values.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mismatch {
    /// What differs (`"arch"`, `"nLayer"`, `"layers[3].kWidth"`, ...).
    pub field: String,
    /// The state file's value.
    pub state: String,
    /// The model's value.
    pub model: String,
    /// A sentence for people.
    pub message: String,
}

/// The verdict of [`check_state`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fit {
    /// True when nothing differs.
    pub fits: bool,
    /// Every difference found.
    pub reasons: Vec<Mismatch>,
}

/// Per-layer mismatches reported one by one before they are summarised.
const MAX_LAYER_REASONS: usize = 8;

fn mismatch(field: &str, state: impl ToString, model: impl ToString, why: &str) -> Mismatch {
    let (state, model) = (state.to_string(), model.to_string());
    Mismatch {
        message: format!("{field}: the state has {state}, the model has {model} ({why})"),
        field: field.into(),
        state,
        model,
    }
}

/// Width in elements of rows of `row_size` bytes of type id `ty`.
fn width(ty: i32, row_size: u64) -> Option<u64> {
    let t = GgmlType::from_id(ty)?;
    Some(row_size / t.type_size() as u64 * t.block_size() as u64)
}

/// The model layers a part of a state holds, in order: every layer for a single memory, the
/// full-attention or sliding-window layers for an iSWA memory's base or SWA cache, the
/// attention or recurrent layers for a hybrid memory's parts (0.1.161's layer filters).
fn layers_of(model: &ModelInfo, role: PartRole) -> Vec<usize> {
    let keep = |l: &crate::model::LayerGeometry| match role {
        PartRole::Whole => true,
        // a hybrid-iSWA memory's base and window caches hold attention layers only
        PartRole::Base => !l.swa && l.memory.attends(),
        PartRole::Swa => l.swa && l.memory.attends(),
        PartRole::Attention | PartRole::Indexer => l.memory.attends(),
        PartRole::Recurrent => l.memory.recurrent(),
    };
    (0..model.layers.len())
        .filter(|&il| keep(&model.layers[il]))
        .collect()
}

/// The K and V widths (R and S for a recurrent part) the model gives layer `il` in a part.
fn widths_of(model: &ModelInfo, kind: PartKind, il: usize) -> (u64, u64) {
    match (kind, &model.recurrent) {
        (PartKind::Recurrent, Some(r)) => (r.n_embd_k_s as u64, r.n_embd_v_s as u64),
        _ => (model.cache_k_width(il), model.cache_v_width(il)),
    }
}

/// Compares the layers of one part of the state with the model's.
fn check_part(part: &Part, model: &ModelInfo, reasons: &mut Vec<Mismatch>) {
    let prefix = match part.role {
        PartRole::Whole => String::new(),
        role => format!("{role}."),
    };
    // the indexer's keys are rotated over its own head (the model's indexer head size, which
    // the model info does not read), whatever their type: only its layer count is compared
    let own_heads = part.role != PartRole::Indexer;
    for stream in part.payload.streams.iter().filter(|_| own_heads) {
        if let Some((k, v)) = stream.n_rot {
            // a rotated quantized cache is rotated over whole heads
            for (field, rot, head) in [
                ("nRotK", k, model.n_embd_head_k),
                ("nRotV", v, model.n_embd_head_v),
            ] {
                if rot != 0 && rot != head {
                    reasons.push(mismatch(
                        &format!("{prefix}{field}"),
                        rot,
                        head,
                        "the state was rotated over another head size",
                    ));
                }
            }
        }
    }
    let Some(stream) = part.payload.streams.iter().find(|s| !s.layers.is_empty()) else {
        return; // no cells: no geometry to compare
    };
    let layers = layers_of(model, part.role);
    if stream.layers.len() != layers.len() {
        reasons.push(mismatch(
            &format!("{prefix}nLayer"),
            stream.layers.len(),
            layers.len(),
            "layer counts differ",
        ));
    }
    if !own_heads {
        return;
    }
    let widths: Vec<LayerWidths> = stream
        .layers
        .iter()
        .map(|l| LayerWidths {
            k: width(l.k_type, l.k_row_size)
                .ok_or_else(|| format!("{} bytes of type {}", l.k_row_size, l.k_type)),
            v: match &l.v {
                VBlock::Rows { ty, row_size, .. } => {
                    Some(width(*ty, *row_size).ok_or_else(|| "an unknown width".into()))
                }
                VBlock::Transposed { n_embd, .. } => Some(Ok(*n_embd as u64)),
                // a cache without V (multi-head latent attention) keeps the latent K only
                VBlock::Absent => None,
            },
        })
        .collect();
    check_widths(&prefix, part.kind, &widths, &layers, model, reasons);
}

/// One layer's K and V widths in elements (R and S for a recurrent part), or what the bytes
/// say where they name no known type; V is `None` for a cache without V.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerWidths {
    /// K's width, or a description of its row.
    pub k: std::result::Result<u64, String>,
    /// V's width, or a description of its row; `None`: the part keeps no V.
    pub v: Option<std::result::Result<u64, String>>,
}

/// Compares each layer's widths of a part with the model's layers `layers` of that part.
fn check_widths(
    prefix: &str,
    kind: PartKind,
    widths: &[LayerWidths],
    layers: &[usize],
    model: &ModelInfo,
    reasons: &mut Vec<Mismatch>,
) {
    let mut layer_reasons = Vec::new();
    for (l, &il) in widths.iter().zip(layers) {
        let (want_k, want_v) = widths_of(model, kind, il);
        if l.k != Ok(want_k) {
            layer_reasons.push(mismatch(
                &format!("{prefix}layers[{il}].kWidth"),
                l.k.clone().map_or_else(|d| d, |w| w.to_string()),
                want_k,
                "K row widths differ",
            ));
        }
        match &l.v {
            Some(v) if *v != Ok(want_v) => layer_reasons.push(mismatch(
                &format!("{prefix}layers[{il}].vWidth"),
                v.clone().map_or_else(|d| d, |w| w.to_string()),
                want_v,
                "V row widths differ",
            )),
            _ => {}
        }
    }
    if layer_reasons.len() > MAX_LAYER_REASONS {
        let more = layer_reasons.len() - MAX_LAYER_REASONS;
        layer_reasons.truncate(MAX_LAYER_REASONS);
        layer_reasons.push(Mismatch {
            field: format!("{prefix}layers"),
            state: format!("{more} more"),
            model: String::new(),
            message: format!("{more} more per-layer width differences"),
        });
    }
    reasons.extend(layer_reasons);
}

/// Compares a live memory with a model: its kind, and for each of its KV parts (with the role
/// it has in the state) the layer count and every layer's K and V widths. Recurrent parts are
/// compared by kind and role only: a live memory's recurrent rows carry no per-layer geometry.
pub fn check_memory(
    memory: MemoryKind,
    parts: &[(PartRole, Vec<LayerWidths>)],
    model: &ModelInfo,
) -> Fit {
    let mut reasons = Vec::new();
    // the seed's one unified cache also held sliding-window layers and recurrent states
    let one_cache = memory == MemoryKind::Unified
        && matches!(model.memory, MemoryKind::Iswa | MemoryKind::Recurrent);
    if memory != model.memory && !one_cache {
        reasons.push(mismatch(
            "memory",
            memory.name(),
            model.memory.name(),
            "the cache is another kind of memory",
        ));
    }
    for (role, widths) in parts {
        let prefix = match role {
            PartRole::Whole => String::new(),
            role => format!("{role}."),
        };
        let layers = layers_of(model, *role);
        if widths.len() != layers.len() {
            reasons.push(mismatch(
                &format!("{prefix}nLayer"),
                widths.len(),
                layers.len(),
                "layer counts differ",
            ));
        }
        if *role != PartRole::Indexer {
            check_widths(&prefix, PartKind::Kv, widths, &layers, model, &mut reasons);
        }
    }
    Fit {
        fits: reasons.is_empty(),
        reasons,
    }
}

/// The parts of the memory llama.cpp 0.1.161 builds for `model`, in state order: a hybrid
/// whose attention layers use a window has a base and a window cache (hybrid-iSWA).
fn part_roles(model: &ModelInfo) -> Vec<PartRole> {
    match model.memory {
        MemoryKind::Iswa => vec![PartRole::Base, PartRole::Swa],
        MemoryKind::Hybrid if model.layers.iter().any(|l| l.swa) => {
            vec![PartRole::Base, PartRole::Swa, PartRole::Recurrent]
        }
        MemoryKind::Hybrid => vec![PartRole::Attention, PartRole::Recurrent],
        MemoryKind::Dsa | MemoryKind::Msa => vec![PartRole::Attention, PartRole::Indexer],
        MemoryKind::DsaIswa => vec![PartRole::Attention, PartRole::Indexer, PartRole::Swa],
        MemoryKind::HybridIdx => vec![PartRole::Attention, PartRole::Recurrent, PartRole::Indexer],
        // the raw cache's parts (the compressed caches and compressors follow them)
        MemoryKind::Dsv4 => vec![PartRole::Base, PartRole::Swa],
        MemoryKind::Unified | MemoryKind::Recurrent => vec![PartRole::Whole],
    }
}

/// Compares an inspected state file with a model: the memory that wrote it (unified,
/// recurrent, iSWA, hybrid), the architecture (session files), and for each of its parts the
/// layer count, each layer's K and V widths (from the row sizes and types) and the head size a
/// rotated quantized cache was rotated over.
pub fn check_state(ins: &Inspection, model: &ModelInfo) -> Fit {
    let mut reasons = Vec::new();
    // a stream-less payload (the seed layout) is what llama.cpp wrote before it had iSWA and
    // recurrent memories of their own: its one unified cache also held sliding-window layers
    // and recurrent states, so such a state can fit an iSWA or recurrent model whole
    let one_cache_era = ins.payload.layout == Layout::Seed
        && ins.memory == MemoryKind::Unified
        && matches!(model.memory, MemoryKind::Iswa | MemoryKind::Recurrent);
    // an msa memory's two KV caches read as an iSWA memory's: the model names them
    let msa = ins.memory == MemoryKind::Iswa && model.memory == MemoryKind::Msa;
    let parts: Vec<Part> = ins
        .parts
        .iter()
        .cloned()
        .zip([PartRole::Attention, PartRole::Indexer])
        .map(|(mut p, role)| {
            if msa {
                p.role = role;
            }
            p
        })
        .chain(ins.parts.iter().skip(2).cloned())
        .collect();
    let state_memory = if msa { MemoryKind::Msa } else { ins.memory };
    if state_memory != model.memory && !one_cache_era {
        reasons.push(mismatch(
            "memory",
            ins.memory.name(),
            model.memory.name(),
            "the state was written by another kind of memory",
        ));
    }
    if let Some(arch) = ins.arch.as_deref() {
        if arch != model.arch {
            reasons.push(mismatch(
                "arch",
                arch,
                &model.arch,
                "the session was saved from another architecture",
            ));
        }
    }
    let roles = |r: &[PartRole]| r.iter().map(|r| r.name()).collect::<Vec<_>>().join(" + ");
    let (state_roles, mut model_roles) = (
        parts.iter().map(|p| p.role).collect::<Vec<_>>(),
        part_roles(model),
    );
    // a partial dsv4 state holds the raw window cache only
    if ins.compressed.as_ref().is_some_and(|c| c.partial) {
        model_roles.retain(|&r| r != PartRole::Base);
    }
    if state_memory == model.memory && state_roles != model_roles {
        reasons.push(mismatch(
            "parts",
            roles(&state_roles),
            roles(&model_roles),
            "the memory is made of other parts",
        ));
    }
    for part in &parts {
        check_part(part, model, &mut reasons);
    }
    Fit {
        fits: reasons.is_empty(),
        reasons,
    }
}
