//! Malformed GGUF models: every mutation of a realistic header gives a typed error or a valid
//! model, never a panic or a huge allocation.

use llama_kv_cache::model::gguf::{parse_bytes, GgufBuilder, GgufType, GgufValue};
use llama_kv_cache::{KvError, ModelInfo};
use proptest::prelude::*;

/// A llama-shaped model with a tokenizer, per-layer KV heads and RoPE scaling keys.
fn model() -> Vec<u8> {
    let mut g = GgufBuilder::new();
    g.kv("general.architecture", GgufValue::Str("llama".into()))
        .kv("general.name", GgufValue::Str("mutant".into()))
        .kv("llama.context_length", GgufValue::U32(2048))
        .kv("llama.embedding_length", GgufValue::U32(64))
        .kv("llama.block_count", GgufValue::U32(2))
        .kv("llama.attention.head_count", GgufValue::U32(4))
        .array(
            "llama.attention.head_count_kv",
            GgufType::U32,
            vec![GgufValue::U32(2), GgufValue::U32(4)],
        )
        .kv("llama.rope.freq_base", GgufValue::F32(10000.0))
        .kv("llama.rope.scaling.type", GgufValue::Str("yarn".into()))
        .kv("llama.rope.scaling.factor", GgufValue::F32(2.0))
        .array(
            "tokenizer.ggml.tokens",
            GgufType::Str,
            (0..40).map(|i| GgufValue::Str(format!("tok{i}"))).collect(),
        )
        .array(
            "tokenizer.ggml.scores",
            GgufType::F32,
            (0..40).map(|i| GgufValue::F32(i as f32)).collect(),
        );
    g.tensor("token_embd.weight", &[64, 40], 1);
    g.tensor("rope_freqs.weight", &[8], 0);
    for i in 0..2 {
        g.tensor(&format!("blk.{i}.attn_k.weight"), &[64, 32], 8);
        g.tensor(&format!("blk.{i}.attn_v.weight"), &[64, 32], 2);
    }
    g.bytes_zero_data()
}

/// Parses and derives the model; panics only if the reader misbehaves.
fn check(bytes: &[u8]) {
    let result = parse_bytes(bytes).and_then(|h| ModelInfo::from_header(&h));
    if let Err(e) = result {
        assert!(
            matches!(e, KvError::InvalidModel(_)),
            "untyped error for malformed GGUF: {e:?}"
        );
    }
}

#[test]
fn the_unmutated_model_parses() {
    let bytes = model();
    let m = ModelInfo::from_header(&parse_bytes(&bytes).unwrap()).unwrap();
    assert_eq!(m.layers[1].n_embd_k_gqa, 64);
    assert_eq!(m.rope.factor_tensors, ["rope_freqs.weight"]);
}

#[test]
fn every_truncation_gives_a_typed_error() {
    let bytes = model();
    for n in 0..bytes.len() {
        match parse_bytes(&bytes[..n]) {
            Err(KvError::InvalidModel(_)) => {}
            other => panic!("truncated at {n} of {}: {other:?}", bytes.len()),
        }
    }
}

#[test]
fn a_string_length_past_the_end_names_it() {
    let mut bytes = model();
    // the first key's length field follows the 24-byte preamble
    bytes[24..32].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
    let e = parse_bytes(&bytes).unwrap_err().to_string();
    assert!(e.contains("key 0") && e.contains("past the end"), "{e}");
}

fn header_len() -> usize {
    parse_bytes(&model()).unwrap().header_len as usize
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]

    #[test]
    fn random_byte_mutations_never_panic(
        edits in prop::collection::vec((0usize..4096, any::<u8>()), 1..6)
    ) {
        let mut bytes = model();
        let n = header_len();
        for (at, v) in edits {
            bytes[at % n] = v;
        }
        check(&bytes);
    }

    #[test]
    fn huge_or_wrong_integers_never_panic(
        at in 0usize..4096,
        v in prop_oneof![Just(u64::MAX), Just(1u64 << 63), Just(u32::MAX as u64), 0u64..64, any::<u64>()],
        width in prop_oneof![Just(4usize), Just(8usize)],
    ) {
        let mut bytes = model();
        let n = header_len();
        let at = at % (n - width);
        bytes[at..at + width].copy_from_slice(&v.to_le_bytes()[..width]);
        check(&bytes);
    }

    #[test]
    fn wrong_value_types_never_panic(key in 0usize..12, ty in 0u32..16) {
        // rewrite the type id of one key: the value then parses as something else or fails
        let bytes = model();
        let h = parse_bytes(&bytes).unwrap();
        let key = &h.kv[key % h.kv.len()].0;
        let needle: Vec<u8> = [&(key.len() as u64).to_le_bytes()[..], key.as_bytes()].concat();
        let at = bytes.windows(needle.len()).position(|w| w == needle.as_slice()).unwrap() + needle.len();
        let mut bytes = bytes;
        bytes[at..at + 4].copy_from_slice(&ty.to_le_bytes());
        check(&bytes);
    }
}

#[test]
fn rope_freqs_tensor_is_found_and_read_for_the_k_shift() {
    // a llama 3.1-style model: the K-shift divides each pair's angle by rope_freqs.weight
    let mut g = GgufBuilder::new();
    g.kv("general.architecture", GgufValue::Str("llama".into()))
        .kv("llama.context_length", GgufValue::U32(2048))
        .kv("llama.embedding_length", GgufValue::U32(64))
        .kv("llama.block_count", GgufValue::U32(2))
        .kv("llama.attention.head_count", GgufValue::U32(4));
    g.tensor("token_embd.weight", &[64, 8], 0);
    g.tensor("rope_freqs.weight", &[8], 0);
    let mut bytes = g.header();
    let data_start = bytes.len();
    bytes.resize(data_start + g.data_size() as usize, 0);
    let factors: Vec<f32> = (1..=8).map(|i| i as f32 * 0.5).collect();
    let at = data_start + g.tensors()[1].offset as usize;
    for (i, f) in factors.iter().enumerate() {
        bytes[at + 4 * i..at + 4 * i + 4].copy_from_slice(&f.to_le_bytes());
    }
    let path = std::env::temp_dir().join(format!("kv-rope-freqs-{}.gguf", std::process::id()));
    std::fs::write(&path, &bytes).unwrap();
    let read = llama_kv_cache::model::gguf::read_file(&path, false).unwrap();
    let m = ModelInfo::from_header(&read.header).unwrap();
    assert_eq!(m.factor_tensor(2048), Some("rope_freqs.weight"));
    let got =
        llama_kv_cache::model::gguf::read_f32_tensor(&path, &read.header, "rope_freqs.weight");
    let _ = std::fs::remove_file(&path);
    let got = got.unwrap();
    assert_eq!(got, factors);
    let shift = m.shift_params(Some(got)).unwrap();
    assert_eq!(shift.rope.freq_factors.as_deref(), Some(&factors[..]));
    // a tensor that is not a small f32 vector is refused, not read
    let e =
        llama_kv_cache::model::gguf::read_f32_tensor(&path, &read.header, "missing").unwrap_err();
    assert!(matches!(e, KvError::InvalidModel(_)), "{e}");
}
