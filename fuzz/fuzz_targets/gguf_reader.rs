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
        }
        Err(KvError::InvalidModel(_)) => {}
        Err(e) => panic!("untyped error: {e:?}"),
    }
});
