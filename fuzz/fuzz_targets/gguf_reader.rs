//! Arbitrary bytes as a GGUF model: the header reader and the model derivation must return a
//! model or a typed `InvalidModel` error, never panic or allocate past the input.
#![no_main]

use libfuzzer_sys::fuzz_target;
use llama_kv_cache::model::gguf::parse_bytes;
use llama_kv_cache::{KvError, ModelInfo};

fuzz_target!(|data: &[u8]| {
    match parse_bytes(data).and_then(|h| ModelInfo::from_header(&h)) {
        Ok(m) => {
            // everything derived from a parsed model must be computable too
            let _ = m.shift_params(None);
            let _ = m.kv_bytes(1 << 20, llama_kv_cache::GgmlType::F16, llama_kv_cache::GgmlType::Q8_0);
            let _ = m.cache_params(4096, 4, llama_kv_cache::GgmlType::F16, llama_kv_cache::GgmlType::F16, false);
            // the memory fromModel would build, sized without building it: the trained context
            // (any u32 from the file) and a split quantized one
            for (n_ctx, unified, t) in [
                (0, true, llama_kv_cache::GgmlType::F16),
                (65_536, false, llama_kv_cache::GgmlType::Q8_0),
            ] {
                let ctx = llama_kv_cache::ContextParams {
                    n_ctx,
                    n_seq_max: 3,
                    n_ubatch: 512,
                    unified,
                    swa_full: false,
                    type_k: t,
                    type_v: t,
                    flash_attn: true,
                };
                if let Ok(plan) = llama_kv_cache::MemoryPlan::for_model(&m, &ctx) {
                    let _ = plan.bytes();
                }
            }
        }
        Err(KvError::InvalidModel(_)) => {}
        Err(e) => panic!("untyped error: {e:?}"),
    }
});
