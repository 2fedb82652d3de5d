// Shared by the `model_info` tests of both eras (`model_info_seed.rs`: llama.cpp 0.1.103,
// `model_info_today.rs`: 0.1.161), included with `#[path]`: reads a driver's `hparams` JSON
// and collects the fields where `ModelInfo` differs from it.

use llama_kv_cache::ModelInfo;
use serde_json::Value;

/// The tiny models of `interop/make_models.py`.
pub const TINY_MODELS: [&str; 10] = [
    "llama-h16.gguf",
    "llama-h32.gguf",
    "llama-l64.gguf",
    "llama-h64.gguf",
    "mamba.gguf",
    "gemma3-swa.gguf",
    "jamba.gguf",
    "qwen2-h64.gguf",
    "qwen2-h64-yarn.gguf",
    "llama-h64-yarn.gguf",
];

/// A per-layer array of the driver's answer.
pub fn u32s(v: &Value, key: &str) -> Vec<u32> {
    v[key]
        .as_array()
        .unwrap_or_else(|| panic!("no {key} in {v}"))
        .iter()
        .map(|x| x.as_u64().unwrap_or(u64::MAX) as u32)
        .collect()
}

/// A number of the driver's answer.
pub fn num(v: &Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or_else(|| panic!("no {key} in {v}"))
}

/// The differences between `ModelInfo` and one llama.cpp version's answer `h`.
pub struct Diffs<'a> {
    pub version: &'static str,
    pub h: &'a Value,
    pub lines: Vec<String>,
}

impl<'a> Diffs<'a> {
    pub fn new(version: &'static str, h: &'a Value) -> Self {
        Diffs {
            version,
            h,
            lines: Vec::new(),
        }
    }

    /// `field` must read the same.
    pub fn eq(&mut self, field: &str, ours: impl ToString, theirs: impl ToString) {
        let (ours, theirs) = (ours.to_string(), theirs.to_string());
        if ours != theirs {
            let version = self.version;
            self.lines.push(format!(
                "{field}: ours {ours}, llama.cpp {version} {theirs}"
            ));
        }
    }

    /// The driver's number `field` must equal `ours`.
    pub fn number(&mut self, field: &str, ours: impl Into<f64>) {
        let theirs = num(self.h, field);
        self.eq(field, ours.into(), theirs);
    }

    /// The driver's float `field` must equal `ours` to f32 precision (it prints 9 digits).
    pub fn float(&mut self, field: &str, ours: f32) {
        let theirs = num(self.h, field);
        let close = (ours as f64 - theirs).abs() <= 1e-6 * theirs.abs().max(1.0);
        if !close {
            self.eq(field, ours, theirs);
        }
    }

    /// The driver's per-layer array `field` must equal `ours`.
    pub fn layers(&mut self, field: &str, ours: Vec<u32>) {
        let theirs = u32s(self.h, field);
        self.eq(field, format!("{ours:?}"), format!("{theirs:?}"));
    }

    /// The per-layer fields every driver reports: K/V heads and widths, sliding-window layers.
    pub fn geometry(&mut self, m: &ModelInfo) {
        let per_layer = |f: fn(&llama_kv_cache::model::LayerGeometry) -> u32| -> Vec<u32> {
            m.layers.iter().map(f).collect()
        };
        self.layers("n_head_kv", per_layer(|l| l.n_head_kv));
        self.layers("n_embd_k_gqa", per_layer(|l| l.n_embd_k_gqa));
        self.layers("n_embd_v_gqa", per_layer(|l| l.n_embd_v_gqa));
        self.layers("is_swa", per_layer(|l| l.swa as u32));
        self.number("n_layer", m.n_layer);
        self.number("n_ctx_train", m.n_ctx_train);
        self.number("n_ctx_orig_yarn", m.rope.n_ctx_orig_yarn);
        self.number("n_swa", m.swa.as_ref().map_or(0, |s| s.window));
        let rope_type = m.rope.kind.llama_value().map_or(-99, |v| v);
        self.number("rope_type", rope_type);
        self.float("rope_freq_base", m.rope.freq_base);
        self.float("rope_freq_scale", m.rope.freq_scale);
    }
}
