//! Fuzzes the readers of today's live memories, as `KvCache.fromModel` builds them for the tiny
//! models of `interop/make_models.py` (`node scripts/setup.mjs` writes them): the iSWA memory
//! (gemma3), the hybrid memories (Jamba, LFM2, Qwen3.5 with M-RoPE cells, Nemotron-H,
//! Falcon-H1), the hybrid-iSWA one (LFM2 with a window: three parts, the first of no layer) and
//! a llama's cache of a stream per sequence (`kvUnified: false`).
//! The first byte picks the memory (bits 0-1 and 6), the layout
//! (bit 2), the sequence read into (bits 3-4: every one, 0, or 2, which holds nothing) and a
//! partial read (bit 5: llama.cpp's `PARTIAL_ONLY` state, a context checkpoint); the rest is
//! the payload, with or without `llama_state_seq_get_data`'s envelope. A failed read must leave the memory byte for byte as it was; a
//! successful one must write back without error.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use llama_kv_cache::{ContextParams, GgmlType, Layout, memory_for_model, Memory, ModelInfo, ReadOptions, UBatch};

const MODELS: [&str; 8] = [
    "gemma3-swa.gguf",
    "jamba.gguf",
    "lfm2.gguf",
    "lfm2-swa.gguf",
    "qwen35.gguf",
    "nemotron-h.gguf",
    "falcon-h1.gguf",
    // its context has a stream per sequence
    "llama-h16.gguf",
];

fn model(k: usize) -> &'static ModelInfo {
    static INFOS: OnceLock<Vec<ModelInfo>> = OnceLock::new();
    &INFOS.get_or_init(|| {
        MODELS
            .iter()
            .map(|name| {
                let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("../interop/models")
                    .join(name);
                ModelInfo::from_file(&path, false)
                    .unwrap_or_else(|e| panic!("{e} (set-up: node scripts/setup.mjs)"))
            })
            .collect()
    })[k]
}

/// Memory `k` (256 cells, 3 sequences) with sequences 0 and 1 placed: 6 and 3 tokens, each
/// sequence's tokens one group (a hybrid's recurrent part takes a group's last token).
fn memory(k: usize) -> Box<dyn Memory> {
    let ctx = ContextParams {
        n_ctx: 256,
        n_seq_max: 3,
        n_ubatch: 16,
        unified: MODELS[k] != "llama-h16.gguf",
        swa_full: false,
        type_k: GgmlType::F16,
        type_v: GgmlType::F16,
        flash_attn: false,
    };
    let mut m = memory_for_model(model(k), &ctx).unwrap();
    let group = |seq: i32, n: i32| UBatch {
        pos: (0..n).collect(),
        n_seq_tokens: n as u32,
        seq_ids: vec![vec![seq]],
        ext: Vec::new(),
    };
    for (seq, n) in [(0, 6), (1, 3)] {
        // a hybrid's recurrent part takes each sequence's tokens as one group
        let ub = match m.kind() {
            "hybrid" => group(seq, n),
            _ => UBatch::sequence(seq, 0, n as u32),
        };
        let placed = m.place(&[ub]).unwrap().is_some();
        assert!(placed);
    }
    m
}

fuzz_target!(|data: &[u8]| {
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    let k = usize::from(selector & 3 | (selector >> 4 & 4)) % MODELS.len();
    let mut m = memory(k);
    let layout = if selector & 4 == 0 {
        Layout::StreamsRot
    } else {
        Layout::Streams
    };
    let seq = [-1, 0, 2, -1][usize::from(selector >> 3 & 3)];
    let before = m.state_write(-1, Layout::StreamsRot).unwrap();
    let opts = ReadOptions {
        layout: Some(layout),
        partial: selector & 0x20 != 0,
        ..ReadOptions::default()
    };
    match m.state_read(body, seq, opts, None) {
        Err(_) => assert!(
            m.state_write(-1, Layout::StreamsRot).unwrap() == before,
            "a failed read changed the memory"
        ),
        Ok(_) => {
            m.state_write(-1, Layout::StreamsRot).unwrap();
        }
    }
});
