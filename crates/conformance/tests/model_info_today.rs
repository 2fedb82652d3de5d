//! `ModelInfo` against llama.cpp 0.1.161 (the driver's `hparams` action, after a full model
//! load): for every tiny model of `interop/make_models.py`, the per-layer K/V heads and widths,
//! the sliding-window and recurrent layers, RoPE type, dims and base, the window, the recurrent
//! state widths and the memory kind agree. This is today's llama.cpp: Gemma 3's
//! `sliding_window_pattern` key and Jamba's hybrid memory are read as 0.1.161 reads them, and
//! Qwen2-VL's M-RoPE gives its cells the extension 0.1.161 saves (`has_cell_ext()`).

use conformance::models_dir;
use conformance::today::run;
use llama_kv_cache::{MemoryKind, ModelInfo};
use serde_json::Value;

#[path = "common/hparams.rs"]
mod hparams_check;
use hparams_check::{u32s, Diffs, TINY_MODELS};

/// Every field both report, ours against 0.1.161's; the differences.
fn compare(m: &ModelInfo, h: &Value) -> Vec<String> {
    let mut d = Diffs::new("0.1.161", h);
    d.geometry(m);
    let recurrent_layers = m
        .layers
        .iter()
        .map(|l| l.memory.recurrent() as u32)
        .collect();
    d.layers("is_recr", recurrent_layers);
    // head sizes and RoPE dims only mean something on attention layers
    for (field, ours) in [
        ("n_embd_head_k", m.n_embd_head_k),
        ("n_embd_head_v", m.n_embd_head_v),
        ("n_rot", m.rope.n_rot),
    ] {
        let theirs = u32s(h, field);
        for il in (0..m.layers.len()).filter(|&il| m.layers[il].n_head_kv > 0) {
            d.eq(&format!("{field}[{il}]"), ours, theirs[il]);
        }
    }
    let r = m.recurrent.clone().unwrap_or_default();
    d.number("n_embd_r", r.n_embd_k_s);
    d.number("n_embd_s", r.n_embd_v_s);
    d.number("recurrent", (m.memory == MemoryKind::Recurrent) as u8);
    // llama_model_is_hybrid: the hybrid memories, with or without an indexer, and DeepSeek V4's
    // (compressor states beside its caches)
    let hybrid = matches!(
        m.memory,
        MemoryKind::Hybrid | MemoryKind::HybridIdx | MemoryKind::Dsv4
    );
    d.number("hybrid", hybrid as u8);
    // llama_kv_cache::has_cell_ext(): the cells of M-RoPE and PLE models carry an extension
    let has_cell_ext =
        h["n_pos_per_embd"].as_u64() > Some(1) || h["ple_n_heads"].as_u64() > Some(0);
    d.eq("has_cell_ext", !m.cell_ext.is_none(), has_cell_ext);
    d.lines
}

#[test]
fn model_info_agrees_with_llama_cpp_0_1_161_for_every_tiny_model() {
    let mut failures = Vec::new();
    // and the models the seed-era peer of the shared list does not read alike: M-RoPE, LFM2,
    // Llama 4, Qwen3.5 (recurrent layers by `full_attention_interval`, Mamba-2 style widths)
    for name in TINY_MODELS.into_iter().chain([
        "qwen2vl.gguf",
        "lfm2.gguf",
        "llama4-chunked.gguf",
        "qwen35.gguf",
        "nemotron-h.gguf",
        "falcon-h1.gguf",
        "granite-hybrid.gguf",
        "deepseek4.gguf",
    ]) {
        let path = models_dir().join(name);
        let ours = ModelInfo::from_file(&path, false).unwrap_or_else(|e| panic!("{name}: {e}"));
        let theirs = run("hparams", &[format!("model={}", path.display())])
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let bad = compare(&ours, &theirs);
        if bad.is_empty() {
            eprintln!("model info agrees with llama.cpp 0.1.161: {name}");
        } else {
            failures.push(format!("{name}:\n  {}", bad.join("\n  ")));
        }
    }
    assert!(
        failures.is_empty(),
        "ModelInfo differs from llama.cpp 0.1.161:\n{}",
        failures.join("\n")
    );
}
