//! Whether a state file fits a model: the checks llama.cpp makes (or should make) before it
//! copies a state into a context, done without loading either.

use crate::files::{is_recurrent_arch, Inspection};
use crate::model::{MemoryKind, ModelInfo};
use crate::state::VBlock;
use crate::GgmlType;

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

/// Compares an inspected state file with a model: memory kind, architecture (session files),
/// recurrence, layer count and each layer's K and V widths (from the row sizes and types).
pub fn check_state(ins: &Inspection, model: &ModelInfo) -> Fit {
    let mut reasons = Vec::new();
    let model_recurrent = model.memory == MemoryKind::Recurrent;
    if matches!(model.memory, MemoryKind::Iswa | MemoryKind::Hybrid) {
        reasons.push(mismatch(
            "memory",
            if ins.arch.as_deref().is_some_and(is_recurrent_arch) {
                "recurrent"
            } else {
                "unified"
            },
            model.memory.name(),
            "this library reads one unified or recurrent cache; the model needs another memory",
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
        if is_recurrent_arch(arch) != model_recurrent {
            reasons.push(mismatch(
                "recurrent",
                is_recurrent_arch(arch),
                model_recurrent,
                "a recurrent state and a KV cache do not mix",
            ));
        }
    } else if ins.payload.layout == crate::Layout::Streams && model_recurrent {
        reasons.push(mismatch(
            "recurrent",
            false,
            true,
            "the payload has a stream prefix, which recurrent states never have",
        ));
    }
    let Some(stream) = ins.payload.streams.iter().find(|s| !s.layers.is_empty()) else {
        // no cells: no geometry to compare
        return Fit {
            fits: reasons.is_empty(),
            reasons,
        };
    };
    if stream.layers.len() != model.n_layer as usize {
        reasons.push(mismatch(
            "nLayer",
            stream.layers.len(),
            model.n_layer,
            "layer counts differ",
        ));
    }
    let mut layer_reasons = Vec::new();
    for (il, l) in stream
        .layers
        .iter()
        .enumerate()
        .take(model.n_layer as usize)
    {
        let k = width(l.k_type, l.k_row_size);
        let want_k = model.cache_k_width(il);
        if k != Some(want_k) {
            layer_reasons.push(mismatch(
                &format!("layers[{il}].kWidth"),
                k.map_or(
                    format!("{} bytes of type {}", l.k_row_size, l.k_type),
                    |w| w.to_string(),
                ),
                want_k,
                "K row widths differ",
            ));
        }
        let v = match &l.v {
            VBlock::Rows { ty, row_size, .. } => width(*ty, *row_size),
            VBlock::Transposed { n_embd, .. } => Some(*n_embd as u64),
        };
        let want_v = model.cache_v_width(il);
        if v != Some(want_v) {
            layer_reasons.push(mismatch(
                &format!("layers[{il}].vWidth"),
                v.map_or("an unknown width".into(), |w| w.to_string()),
                want_v,
                "V row widths differ",
            ));
        }
    }
    if layer_reasons.len() > MAX_LAYER_REASONS {
        let more = layer_reasons.len() - MAX_LAYER_REASONS;
        layer_reasons.truncate(MAX_LAYER_REASONS);
        layer_reasons.push(Mismatch {
            field: "layers".into(),
            state: format!("{more} more"),
            model: String::new(),
            message: format!("{more} more per-layer width differences"),
        });
    }
    reasons.extend(layer_reasons);
    Fit {
        fits: reasons.is_empty(),
        reasons,
    }
}
