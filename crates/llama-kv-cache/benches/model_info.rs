//! `ModelInfo::from_file` on a Llama-2-7B-shaped GGUF (32 layers, a 32,000-token vocabulary,
//! Q4_K/Q6_K tensors: 3.8 GiB of tensor data, written as a sparse file), against the baseline of
//! opening the file and reading just its header bytes in the same run. Fails when a read takes
//! 5 ms or more, or pulls 1 MiB or more from the file.

mod common;

use std::fs::File;
use std::io::{Read, Write};
use std::time::Instant;

use common::{fmt, median, ns};
use llama_kv_cache::model::gguf::{GgufBuilder, GgufType, GgufValue};
use llama_kv_cache::ModelInfo;

const Q4_K: u32 = 12;
const Q6_K: u32 = 14;
const F32: u32 = 0;

fn llama2_7b_like() -> GgufBuilder {
    let (n_embd, n_ff, n_layer, n_vocab) = (4096u64, 11008u64, 32u32, 32000usize);
    let mut g = GgufBuilder::new();
    let u = GgufValue::U32;
    g.kv("general.architecture", GgufValue::Str("llama".into()))
        .kv("general.name", GgufValue::Str("sparse llama-2-7b".into()))
        .kv("llama.context_length", u(4096))
        .kv("llama.embedding_length", u(n_embd as u32))
        .kv("llama.block_count", u(n_layer))
        .kv("llama.feed_forward_length", u(n_ff as u32))
        .kv("llama.attention.head_count", u(32))
        .kv("llama.attention.head_count_kv", u(32))
        .kv("llama.rope.dimension_count", u(128))
        .kv(
            "llama.attention.layer_norm_rms_epsilon",
            GgufValue::F32(1e-5),
        )
        .kv("general.file_type", u(15))
        .kv("tokenizer.ggml.model", GgufValue::Str("llama".into()))
        .array(
            "tokenizer.ggml.tokens",
            GgufType::Str,
            (0..n_vocab)
                .map(|i| GgufValue::Str(format!("\u{2581}tok{i}")))
                .collect(),
        )
        .array(
            "tokenizer.ggml.scores",
            GgufType::F32,
            (0..n_vocab).map(|i| GgufValue::F32(-(i as f32))).collect(),
        )
        .array(
            "tokenizer.ggml.token_type",
            GgufType::I32,
            vec![GgufValue::I32(1); n_vocab],
        );
    g.tensor("token_embd.weight", &[n_embd, n_vocab as u64], Q4_K);
    for i in 0..n_layer {
        let p = format!("blk.{i}.");
        g.tensor(&format!("{p}attn_norm.weight"), &[n_embd], F32);
        for t in ["attn_q", "attn_k", "attn_v", "attn_output"] {
            g.tensor(&format!("{p}{t}.weight"), &[n_embd, n_embd], Q4_K);
        }
        g.tensor(&format!("{p}ffn_norm.weight"), &[n_embd], F32);
        g.tensor(&format!("{p}ffn_gate.weight"), &[n_embd, n_ff], Q4_K);
        g.tensor(&format!("{p}ffn_up.weight"), &[n_embd, n_ff], Q4_K);
        g.tensor(&format!("{p}ffn_down.weight"), &[n_ff, n_embd], Q6_K);
    }
    g.tensor("output_norm.weight", &[n_embd], F32);
    g.tensor("output.weight", &[n_embd, n_vocab as u64], Q6_K);
    g
}

fn main() {
    let g = llama2_7b_like();
    let header = g.header();
    let path = std::env::temp_dir().join(format!("kv-bench-sparse-{}.gguf", std::process::id()));
    {
        let mut f = File::create(&path).expect("create the sparse model");
        f.write_all(&header).expect("write the header");
        // the tensor data: a hole, so the file takes a few hundred KiB of disk
        f.set_len(header.len() as u64 + g.data_size())
            .expect("extend the sparse model");
    }
    const RUNS: usize = 50;
    let (mut ours, mut base) = (Vec::new(), Vec::new());
    let mut info = None;
    for _ in 0..RUNS {
        let t = Instant::now();
        let m = ModelInfo::from_file(&path, false).expect("modelInfo of the sparse model");
        ours.push(ns(t.elapsed()));
        info = Some(m);
        let t = Instant::now();
        let mut buf = vec![0u8; header.len()];
        File::open(&path)
            .and_then(|mut f| f.read_exact(&mut buf))
            .expect("read the header");
        base.push(ns(t.elapsed()));
    }
    let _ = std::fs::remove_file(&path);
    let m = info.expect("at least one run");
    let (ours, base) = (median(ours), median(base));
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    println!(
        "modelInfo, {} ({} tensors, {:.2} GiB of tensor data, header {} KiB)",
        m.name.as_deref().unwrap_or("?"),
        m.n_tensors,
        gib(m.data_size),
        m.header_size / 1024
    );
    println!(
        "  modelInfo           {:>10}   read {} KiB of the file",
        fmt(ours),
        m.bytes_read / 1024
    );
    println!(
        "  read header bytes   {:>10}   (baseline: open + read_exact of the header)",
        fmt(base)
    );
    println!("  ratio               {:>10.2}x the baseline", ours / base);
    let ok = ours < 5e6 && m.bytes_read < 1 << 20 && m.data_size > 3 << 30;
    if !ok {
        eprintln!(
            "FAILED: modelInfo must take < 5 ms and read < 1 MiB of a model with > 3 GiB of data"
        );
        std::process::exit(1);
    }
}
