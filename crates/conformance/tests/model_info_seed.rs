//! `ModelInfo` against llama.cpp 0.1.103 itself: for the tiny models (loaded whole) and for
//! metadata-only GGUFs of other architectures and RoPE settings (read by llama.cpp's own
//! `load_arch` + `load_hparams`), every field llama.cpp derives must agree: layers, per-layer
//! heads and K/V widths, the sliding-window layers, RoPE type, dims, base, scale and YaRN
//! parameters, recurrent state widths.

use std::path::{Path, PathBuf};

use conformance::model_path;
use conformance::seed::oracle::Oracle;
use llama_kv_cache::model::gguf::{GgufBuilder, GgufType, GgufValue};
use llama_kv_cache::{MemoryKind, ModelInfo};
use serde_json::Value;

fn u(v: u32) -> GgufValue {
    GgufValue::U32(v)
}
fn f(v: f32) -> GgufValue {
    GgufValue::F32(v)
}
fn s(v: &str) -> GgufValue {
    GgufValue::Str(v.into())
}
fn i32s(v: &[i32]) -> GgufValue {
    GgufValue::Array {
        elem: GgufType::I32,
        len: v.len() as u64,
        values: Some(v.iter().map(|x| GgufValue::I32(*x)).collect()),
    }
}

/// A metadata-only GGUF: `general.architecture` plus `keys` under the architecture's prefix.
fn meta(arch: &str, keys: &[(&str, GgufValue)]) -> GgufBuilder {
    let mut g = GgufBuilder::new();
    g.kv("general.architecture", s(arch));
    for (k, v) in keys {
        g.kv(&format!("{arch}.{k}"), v.clone());
    }
    g
}

/// llama.cpp's common keys of a transformer with `n_layer` layers.
fn base(n_layer: u32, n_embd: u32, n_head: u32) -> Vec<(&'static str, GgufValue)> {
    vec![
        ("context_length", u(4096)),
        ("embedding_length", u(n_embd)),
        ("block_count", u(n_layer)),
        ("attention.head_count", u(n_head)),
        ("attention.layer_norm_rms_epsilon", f(1e-5)),
    ]
}

fn cases() -> Vec<(&'static str, GgufBuilder)> {
    let with = |mut v: Vec<(&'static str, GgufValue)>, more: Vec<(&'static str, GgufValue)>| {
        v.extend(more);
        v
    };
    vec![
        (
            "llama, per-layer KV heads (int32 array)",
            meta(
                "llama",
                &with(
                    base(3, 128, 8),
                    vec![("attention.head_count_kv", i32s(&[1, 2, 8]))],
                ),
            ),
        ),
        (
            "llama, YaRN scaling, explicit head sizes",
            meta(
                "llama",
                &with(
                    base(2, 256, 4),
                    vec![
                        ("attention.head_count_kv", u(2)),
                        ("attention.key_length", u(32)),
                        ("attention.value_length", u(48)),
                        ("rope.dimension_count", u(32)),
                        ("rope.freq_base", f(500000.0)),
                        ("rope.scaling.type", s("yarn")),
                        ("rope.scaling.factor", f(4.0)),
                        ("rope.scaling.original_context_length", u(1024)),
                        ("rope.scaling.attn_factor", f(0.75)),
                        ("rope.scaling.finetuned", GgufValue::Bool(true)),
                    ],
                ),
            ),
        ),
        (
            "llama, linear scaling under the old key",
            meta(
                "llama",
                &with(base(2, 64, 4), vec![("rope.scale_linear", f(2.0))]),
            ),
        ),
        (
            "qwen2 (neox), partial rotation, no scaling",
            meta(
                "qwen2",
                &with(
                    base(2, 128, 4),
                    vec![
                        ("attention.head_count_kv", u(1)),
                        ("rope.dimension_count", u(16)),
                        ("rope.scaling.type", s("none")),
                        ("rope.freq_base", f(1e6)),
                    ],
                ),
            ),
        ),
        (
            "qwen2vl (M-RoPE sections)",
            meta(
                "qwen2vl",
                &with(
                    base(2, 128, 4),
                    vec![
                        ("attention.head_count_kv", u(2)),
                        ("rope.dimension_sections", i32s(&[4, 6, 6, 0])),
                    ],
                ),
            ),
        ),
        (
            "gemma2 (default window 4096, pattern 2)",
            meta(
                "gemma2",
                &with(base(4, 64, 4), vec![("attention.head_count_kv", u(2))]),
            ),
        ),
        (
            "gemma3 (window 512, pattern 6, sliding-window RoPE base)",
            meta(
                "gemma3",
                &with(
                    base(12, 64, 4),
                    vec![
                        ("attention.head_count_kv", u(1)),
                        ("attention.key_length", u(32)),
                        ("attention.value_length", u(32)),
                        ("attention.sliding_window", u(512)),
                        ("rope.freq_base", f(1e6)),
                        ("rope.scaling.type", s("linear")),
                        ("rope.scaling.factor", f(8.0)),
                    ],
                ),
            ),
        ),
        (
            "cohere2 (window, pattern 4)",
            meta(
                "cohere2",
                &[
                    ("context_length", u(8192)),
                    ("embedding_length", u(64)),
                    ("block_count", u(8)),
                    ("attention.head_count", u(4)),
                    ("attention.head_count_kv", u(2)),
                    ("attention.sliding_window", u(4096)),
                    ("logit_scale", f(0.25)),
                    ("attention.layer_norm_epsilon", f(1e-5)),
                ],
            ),
        ),
        (
            "phi3 mini 4k (default window 2047 on every layer)",
            meta(
                "phi3",
                &with(base(32, 96, 4), vec![("attention.head_count_kv", u(4))]),
            ),
        ),
        (
            "mamba (recurrent)",
            meta(
                "mamba",
                &[
                    ("context_length", u(1 << 20)),
                    ("embedding_length", u(96)),
                    ("block_count", u(3)),
                    ("ssm.conv_kernel", u(4)),
                    ("ssm.inner_size", u(192)),
                    ("ssm.state_size", u(16)),
                    ("ssm.time_step_rank", u(6)),
                    ("attention.layer_norm_rms_epsilon", f(1e-5)),
                ],
            ),
        ),
        (
            "rwkv6 (recurrent, token shift)",
            meta(
                "rwkv6",
                &[
                    ("context_length", u(1 << 20)),
                    ("embedding_length", u(64)),
                    ("block_count", u(2)),
                    ("wkv.head_size", u(16)),
                    ("time_mix_extra_dim", u(32)),
                    ("time_decay_extra_dim", u(64)),
                    ("token_shift_count", u(3)),
                    ("attention.layer_norm_epsilon", f(1e-5)),
                ],
            ),
        ),
    ]
}

#[path = "common/hparams.rs"]
mod hparams_check;
use hparams_check::{Diffs, TINY_MODELS};

/// Every field llama.cpp 0.1.103 reports, compared with ours; returns the mismatches.
fn compare(m: &ModelInfo, h: &Value) -> Vec<String> {
    let mut d = Diffs::new("0.1.103", h);
    d.geometry(m);
    d.eq("arch", &m.arch, h["arch"].as_str().unwrap_or(""));
    d.number("n_embd", m.n_embd);
    d.number("n_embd_head_k", m.n_embd_head_k);
    d.number("n_embd_head_v", m.n_embd_head_v);
    d.number("n_rot", m.rope.n_rot);
    d.number("n_swa_pattern", m.swa.as_ref().map_or(1, |s| s.pattern));
    d.layers("n_head", m.layers.iter().map(|l| l.n_head).collect());
    let scaling = ["none", "linear", "yarn", "longrope"]
        .iter()
        .position(|t| *t == m.rope.scaling_type)
        .map_or(-1, |i| i as i32);
    d.number("rope_scaling_type", scaling);
    d.number("rope_finetuned", m.rope.finetuned as u8);
    d.float("rope_freq_base_swa", m.rope.freq_base_swa);
    d.float("rope_freq_scale_swa", m.rope.freq_scale_swa);
    d.float("rope_attn_factor", m.rope.attn_factor);
    d.float("rope_yarn_log_mul", m.rope.yarn_log_mul);
    let r = m.recurrent.clone().unwrap_or_default();
    d.number("ssm_d_conv", r.ssm_d_conv);
    d.number("ssm_d_inner", r.ssm_d_inner);
    d.number("ssm_d_state", r.ssm_d_state);
    d.number("ssm_dt_rank", r.ssm_dt_rank);
    d.number("wkv_head_size", r.wkv_head_size);
    if r.wkv_head_size > 0 {
        d.number("token_shift_count", r.token_shift_count);
    }
    d.number("n_embd_k_s", r.n_embd_k_s);
    d.number("n_embd_v_s", r.n_embd_v_s);
    d.number("recurrent", (m.memory == MemoryKind::Recurrent) as u8);
    d.lines
}

/// A folder of this test's own (the tests run in parallel and each removes its folder).
fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("model-info-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Fields 0.1.103 cannot agree on for a model: `attention.sliding_window_pattern` postdates it
/// (today's llama.cpp, and `ModelInfo`, let it override the architecture's pattern).
fn era_fields(path: &Path) -> &'static [&'static str] {
    let h = llama_kv_cache::model::gguf::read_file(path, false).expect("a readable GGUF");
    let arch = h
        .header
        .get("general.architecture")
        .and_then(|v| v.as_str())
        .unwrap_or("");
    if h.header
        .get(&format!("{arch}.attention.sliding_window_pattern"))
        .is_some()
    {
        &["is_swa", "n_swa_pattern"]
    } else {
        &[]
    }
}

fn check(oracle: &mut Oracle, name: &str, path: &Path, full: bool, failures: &mut Vec<String>) {
    let ours = ModelInfo::from_file(path, false).unwrap_or_else(|e| panic!("{name}: {e}"));
    let theirs = oracle
        .hparams(path, full)
        .unwrap_or_else(|e| panic!("{name}: llama.cpp: {e}"));
    let skip = era_fields(path);
    let bad: Vec<String> = compare(&ours, &theirs)
        .into_iter()
        .filter(|m| !skip.iter().any(|f| m.starts_with(&format!("{f}:"))))
        .collect();
    if !skip.is_empty() {
        eprintln!(
            "{name}: {skip:?} not compared (its sliding_window_pattern key postdates 0.1.103)"
        );
    }
    if bad.is_empty() {
        eprintln!("model info agrees with llama.cpp 0.1.103: {name}");
    } else {
        failures.push(format!("{name}:\n  {}", bad.join("\n  ")));
    }
}

#[test]
fn model_info_agrees_with_llama_cpp_field_by_field() {
    let mut oracle = Oracle::spawn().unwrap_or_else(|e| panic!("{e}"));
    let dir = scratch("agree");
    let mut failures = Vec::new();

    // the tiny models the differential and interop tests run, loaded whole by llama.cpp;
    // jamba came after 0.1.103
    for name in TINY_MODELS.into_iter().filter(|m| *m != "jamba.gguf") {
        let path = model_path(name).unwrap_or_else(|e| panic!("{e}"));
        check(&mut oracle, name, &path, true, &mut failures);
    }

    // other architectures and RoPE settings, through llama.cpp's own load_hparams
    for (i, (name, g)) in cases().into_iter().enumerate() {
        let path = dir.join(format!("case-{i}.gguf"));
        std::fs::write(&path, g.bytes_zero_data()).unwrap();
        check(&mut oracle, name, &path, false, &mut failures);
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        failures.is_empty(),
        "ModelInfo differs from llama.cpp:\n{}",
        failures.join("\n")
    );
}

#[test]
fn models_llama_cpp_refuses_are_refused_too() {
    // what llama.cpp's load_hparams throws on, ModelInfo refuses as InvalidModel
    let mut oracle = Oracle::spawn().unwrap_or_else(|e| panic!("{e}"));
    let dir = scratch("refuse");
    let bad = [
        (
            "llama without block_count",
            meta(
                "llama",
                &[("context_length", u(8)), ("embedding_length", u(8))],
            ),
        ),
        (
            "llama whose n_rot is not the head size",
            meta("llama", &{
                let mut k = base(2, 64, 4);
                k.push(("rope.dimension_count", u(8)));
                k
            }),
        ),
        (
            "gemma3 without sliding_window",
            meta("gemma3", &base(2, 64, 4)),
        ),
        (
            "head_count_kv array of the wrong length",
            meta("llama", &{
                let mut k = base(3, 64, 4);
                k.push(("attention.head_count_kv", i32s(&[1, 2])));
                k
            }),
        ),
        (
            "unknown rope scaling type",
            meta("llama", &{
                let mut k = base(2, 64, 4);
                k.push(("rope.scaling.type", s("spiral")));
                k
            }),
        ),
    ];
    for (i, (name, g)) in bad.into_iter().enumerate() {
        let path = dir.join(format!("bad-{i}.gguf"));
        std::fs::write(&path, g.bytes_zero_data()).unwrap();
        let ours = ModelInfo::from_file(&path, false);
        assert!(
            matches!(ours, Err(llama_kv_cache::KvError::InvalidModel(_))),
            "{name}: ours {ours:?}"
        );
        // llama.cpp throws (answered as an error) or aborts (GGML_ASSERT): either way, no model
        match oracle.hparams(&path, false) {
            Ok(v) => panic!("{name}: llama.cpp accepted it: {v}"),
            Err(e) => {
                // its loader threw ("hparams: ...") or asserted (the driver died): not some
                // other driver error such as an unknown command
                assert!(e.contains("hparams: ") || e.contains("died"), "{name}: {e}");
                eprintln!("{name}: ours {}; llama.cpp {e}", ours.unwrap_err());
                if e.contains("died") {
                    oracle = Oracle::spawn().unwrap();
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
