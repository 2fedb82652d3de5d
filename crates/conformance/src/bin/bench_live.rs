//! Same-run benchmark of the live iSWA memory against llama.cpp 0.1.161's own
//! (`llama_kv_cache_iswa` through its C API, `today-driver bench`): sequence operations and a
//! sequence's state set on a memory of 65,536 base cells (8 sequences of 8,192 tokens, the
//! gemma3-like model, f16 with flash attention (llama.cpp's default where it can), `swa_full` so
//! that every operation applies to both parts), in
//! interleaved rounds, medians; plus memcpy of the sequence's bytes as the data baseline, and
//! the same state set at a real model's geometry (gemma3-4b-like: 34 layers, every sixth of
//! full attention, 1,024-wide f16 K/V, a window of 1,024; 4 sequences of 2,048 tokens), where
//! rows outweigh the cell metadata that the tiny model's 128-byte rows leave dominant; and a
//! state set into a hybrid memory at a Qwen3.5-9B-like geometry.
//!
//!   cargo run --release -p conformance --bin bench-live            (npm run bench:live)
//!   BENCH_ROUNDS=21 cargo run --release -p conformance --bin bench-live

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Instant;

use conformance::driver::Driver;
use conformance::models_dir;
use llama_kv_cache::model::gguf::{self, GgufBuilder, GgufValue};
use llama_kv_cache::{
    CacheParams, ContextParams, GgmlType, HybridCache, IswaCache, IswaParams, Layout, Memory,
    ModelInfo, SwaType, Tensor, UBatch, Window,
};

const CTX: u32 = 65_536;
const N_SEQ: u32 = 8;
const UBATCH: u32 = 32;
const OPS: [&str; 9] = [
    "seq_rm_tail",
    "seq_rm_mid",
    "seq_cp",
    "seq_keep",
    "seq_add",
    "seq_div",
    "seq_pos_max",
    "seq_get",
    "seq_set",
];

fn memory() -> IswaCache {
    let info = ModelInfo::from_file(&models_dir().join("gemma3-swa.gguf"), false)
        .unwrap_or_else(|e| panic!("{e} (set-up: node scripts/setup.mjs)"));
    let ctx = ContextParams {
        n_ctx: CTX,
        n_seq_max: N_SEQ,
        n_ubatch: UBATCH,
        unified: true,
        swa_full: true,
        type_k: GgmlType::F16,
        type_v: GgmlType::F16,
        flash_attn: true,
    };
    IswaCache::new(IswaParams::for_model(&info, &ctx).unwrap()).unwrap()
}

/// Our side of one op on the restored memory; returns its time. `memcpy` copies the bytes of
/// sequence 0's state into `out`, after the same restore: the data baseline of `seq_set`, its
/// caches as cold as the op's.
fn time_ours(c: &mut IswaCache, whole: &[u8], seq0: &[u8], op: &str, out: &mut Vec<u8>) -> u128 {
    c.state_read(whole, -1, Layout::StreamsRot).unwrap();
    for k in 0..3 {
        std::hint::black_box(c.seq_pos_max(k % N_SEQ as i32).unwrap());
    }
    let (s, l) = (3, (CTX / N_SEQ) as i32);
    let t0 = Instant::now();
    match op {
        "seq_rm_tail" => drop(c.seq_rm(s, l - 16, -1).unwrap()),
        "seq_rm_mid" => drop(c.seq_rm(s, l / 4, l / 2).unwrap()),
        "seq_cp" => c.seq_cp(s, (s + 1) % N_SEQ as i32, -1, -1).unwrap(),
        "seq_keep" => c.seq_keep(s).unwrap(),
        "seq_add" => c.seq_add(s, l / 2, -1, -(l / 4)).unwrap(),
        "seq_div" => c.seq_div(s, 0, -1, 2).unwrap(),
        "seq_pos_max" => drop(std::hint::black_box(c.seq_pos_max(s).unwrap())),
        "seq_get" => *out = c.state_write(0, Layout::StreamsRot).unwrap(),
        "seq_set" => drop(c.state_read(seq0, 0, Layout::StreamsRot).unwrap()),
        "memcpy" => {
            out.resize(seq0.len(), 0);
            out.copy_from_slice(seq0);
        }
        _ => unreachable!(),
    }
    t0.elapsed().as_nanos()
}

/// Fills every row of both parts of `c` (cells `0..cells`) with a byte pattern.
fn fill_rows(c: &mut IswaCache, n_layer: u32, cells: usize) {
    for il in 0..n_layer {
        let (part, k) = c.route_mut(il).unwrap();
        let stream = part.stream_mut(0).unwrap();
        for which in [Tensor::K, Tensor::V] {
            let row = stream.row_size(k, which).unwrap();
            let bytes: Vec<u8> = (0..row * cells).map(|i| (i % 251) as u8).collect();
            stream.write_rows(k, which, 0, &bytes).unwrap();
        }
    }
}

/// A sequence's state set against a memcpy of its bytes at the gemma3-4b-like geometry,
/// interleaved, each after the whole state is read back (as cold as the tiny model's rows).
fn real_geometry_set(rounds: usize) -> (usize, u128, u128) {
    const LAYERS: u32 = 34;
    const CELLS: u32 = 8192;
    const SEQS: u32 = 4;
    let mut p = CacheParams::new(CELLS, LAYERS, 1024, 1024);
    p.n_seq_max = SEQS;
    p.flash_attn = true;
    let mut c = IswaCache::new(IswaParams {
        params: p,
        swa_layers: (0..LAYERS).map(|il| (il + 1) % 6 != 0).collect(),
        window: Window {
            n_swa: 1024,
            swa_type: SwaType::Standard,
        },
        unified: true,
        swa_full: true,
        n_ubatch: 512,
    })
    .unwrap();
    for s in 0..SEQS as i32 {
        c.place(&[UBatch::sequence(s, 0, CELLS / SEQS)])
            .unwrap()
            .expect("the memory holds every sequence");
    }
    fill_rows(&mut c, LAYERS, CELLS as usize);
    let seq0 = c.state_write(0, Layout::StreamsRot).unwrap();
    let whole = c.state_write(-1, Layout::StreamsRot).unwrap();
    set_against_copy(rounds, &whole, &seq0, |seq, state| {
        drop(c.state_read(state, seq, Layout::StreamsRot).unwrap())
    })
}

/// A Qwen3.5-9B-like model: 32 layers, every fourth gated attention (4 KV heads of 256: 1,024-wide
/// K/V), the others gated delta nets (16 key heads and 32 value heads of 128: a conv state of
/// 24,576 floats and a 2 MiB state per layer and sequence).
fn qwen35_9b_like() -> ModelInfo {
    let mut g = GgufBuilder::new();
    let u = GgufValue::U32;
    g.kv("general.architecture", GgufValue::Str("qwen35".into()))
        .kv("qwen35.context_length", u(262_144))
        .kv("qwen35.embedding_length", u(4096))
        .kv("qwen35.block_count", u(32))
        .kv("qwen35.attention.head_count", u(16))
        .kv("qwen35.attention.head_count_kv", u(4))
        .kv("qwen35.attention.key_length", u(256))
        .kv("qwen35.attention.value_length", u(256))
        .kv("qwen35.ssm.conv_kernel", u(4))
        .kv("qwen35.ssm.inner_size", u(4096))
        .kv("qwen35.ssm.state_size", u(128))
        .kv("qwen35.ssm.time_step_rank", u(32))
        .kv("qwen35.ssm.group_count", u(16))
        .kv("qwen35.full_attention_interval", u(4));
    let header = gguf::parse_bytes(&g.bytes_zero_data()).unwrap();
    ModelInfo::from_header(&header).unwrap()
}

/// A sequence's state set into a hybrid memory at the Qwen3.5-9B-like geometry (4 sequences of
/// 2,048 tokens) against a memcpy of its bytes, interleaved as [`real_geometry_set`].
fn hybrid_geometry_set(rounds: usize) -> (usize, u128, u128) {
    const SEQS: u32 = 4;
    const TOKENS: i32 = 2048;
    let info = qwen35_9b_like();
    let ctx = ContextParams {
        n_ctx: SEQS * TOKENS as u32,
        n_seq_max: SEQS,
        n_ubatch: 512,
        unified: true,
        swa_full: false,
        type_k: GgmlType::F16,
        type_v: GgmlType::F16,
        flash_attn: true,
    };
    let mut c = HybridCache::for_model(&info, &ctx).unwrap();
    for s in 0..SEQS as i32 {
        let group = UBatch {
            pos: (0..TOKENS).collect(),
            n_seq_tokens: TOKENS as u32,
            seq_ids: vec![vec![s]],
            ext: Vec::new(),
        };
        c.place(&[group])
            .unwrap()
            .expect("the memory holds every sequence");
    }
    for il in 0..info.n_layer {
        let (cache, k) = c.route_mut(il, 0).unwrap();
        let cells = cache.params().size as usize;
        for which in [Tensor::K, Tensor::V] {
            let row = cache.row_size(k, which).unwrap();
            let bytes: Vec<u8> = (0..row * cells).map(|i| (i % 251) as u8).collect();
            cache.write_rows(k, which, 0, &bytes).unwrap();
        }
    }
    let seq0 = c.state_write(0, Layout::StreamsRot).unwrap();
    let whole = c.state_write(-1, Layout::StreamsRot).unwrap();
    set_against_copy(rounds, &whole, &seq0, |seq, state| {
        drop(c.state_read(state, seq, Layout::StreamsRot).unwrap())
    })
}

/// `read(seq, state)` of sequence 0's state `seq0` against a memcpy of its bytes, interleaved,
/// each after the whole state `whole` is read back (`read(-1, whole)`: rows as cold as the
/// tiny model's); the state's length and both medians.
fn set_against_copy(
    rounds: usize,
    whole: &[u8],
    seq0: &[u8],
    mut read: impl FnMut(i32, &[u8]),
) -> (usize, u128, u128) {
    let (mut sets, mut copies, mut out) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..rounds {
        for k in 0..2 {
            read(-1, whole);
            let t0 = Instant::now();
            if (r + k) % 2 == 0 {
                read(0, seq0);
                sets.push(t0.elapsed().as_nanos());
            } else {
                out.resize(seq0.len(), 0);
                out.copy_from_slice(seq0);
                copies.push(t0.elapsed().as_nanos());
            }
        }
    }
    (seq0.len(), median(&mut sets), median(&mut copies))
}

fn median(v: &mut [u128]) -> u128 {
    v.sort_unstable();
    v[v.len() / 2]
}

fn main() {
    let rounds: usize = std::env::var("BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(11);
    // the filled memory: 8 sequences of 8,192 tokens, rows of a pattern
    let mut c = memory();
    let len = CTX / N_SEQ;
    for s in 0..N_SEQ as i32 {
        let ub = UBatch::sequence(s, 0, len);
        c.place(&[ub])
            .unwrap()
            .expect("the memory holds every sequence");
    }
    fill_rows(&mut c, 2, CTX as usize);
    let dir = std::env::temp_dir().join(format!("bench-live-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for s in 0..N_SEQ as i32 {
        let blob = c.state_write(s, Layout::StreamsRot).unwrap();
        std::fs::write(dir.join(format!("seq-{s}.bin")), blob).unwrap();
    }
    // ours, filled as the peer is: from the sequence states
    let mut ours = memory();
    for s in 0..N_SEQ as i32 {
        let blob = std::fs::read(dir.join(format!("seq-{s}.bin"))).unwrap();
        ours.state_read(&blob, s, Layout::StreamsRot).unwrap();
    }
    let whole = ours.state_write(-1, Layout::StreamsRot).unwrap();
    let seq0 = std::fs::read(dir.join("seq-0.bin")).unwrap();

    let driver = Driver::Today
        .path()
        .unwrap_or_else(|e| panic!("{e} (set-up: node scripts/setup.mjs)"));
    let mut peer = Command::new(driver)
        .arg("bench")
        .arg(format!(
            "model={}",
            models_dir().join("gemma3-swa.gguf").display()
        ))
        .arg(format!("ctx={CTX}"))
        .arg(format!("seqs={N_SEQ}"))
        .arg(format!("ubatch={UBATCH}"))
        .arg("swa_full=1")
        .arg("fa=1")
        .arg(format!("dir={}", dir.display()))
        .env("GGML_NO_BACKTRACE", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("the 0.1.161 driver starts");
    let mut input = peer.stdin.take().unwrap();
    let mut output = BufReader::new(peer.stdout.take().unwrap());
    let mut line = String::new();
    output.read_line(&mut line).unwrap();
    let head: serde_json::Value = serde_json::from_str(&line).expect("the driver's set-up line");
    assert_eq!(
        head["seq_bytes"].as_u64(),
        Some(seq0.len() as u64),
        "{line}"
    );
    let mut ask = |op: &str| -> u128 {
        writeln!(input, "time {op}").unwrap();
        let mut l = String::new();
        output.read_line(&mut l).unwrap();
        let v: serde_json::Value = serde_json::from_str(&l).unwrap_or_else(|_| panic!("{l}"));
        v["ns"].as_u64().unwrap_or_else(|| panic!("{l}")) as u128
    };

    let mut theirs = vec![Vec::new(); OPS.len()];
    let mut mine = vec![Vec::new(); OPS.len()];
    let mut copies = Vec::new();
    let mut out = Vec::new();
    for r in 0..rounds {
        for (k, op) in OPS.iter().enumerate() {
            // alternate which side goes first
            if (r + k) % 2 == 0 {
                theirs[k].push(ask(op));
                mine[k].push(time_ours(&mut ours, &whole, &seq0, op, &mut out));
            } else {
                mine[k].push(time_ours(&mut ours, &whole, &seq0, op, &mut out));
                theirs[k].push(ask(op));
            }
        }
        copies.push(time_ours(&mut ours, &whole, &seq0, "memcpy", &mut out));
    }
    writeln!(input, "quit").ok();
    peer.wait().ok();
    std::fs::remove_dir_all(&dir).ok();

    let memcpy = median(&mut copies);
    println!(
        "iSWA memory of {CTX} base cells (+ {CTX} window cells, swa_full), {N_SEQ} sequences, \
         f16, flash attention, {rounds} interleaved rounds, medians"
    );
    println!(
        "{:<13} {:>14} {:>12} {:>10}",
        "op", "llama.cpp us", "ours us", "ratio"
    );
    for (k, op) in OPS.iter().enumerate() {
        let (t, m) = (median(&mut theirs[k]), median(&mut mine[k]));
        println!(
            "{op:<13} {:>14.1} {:>12.1} {:>9.1}x",
            t as f64 / 1e3,
            m as f64 / 1e3,
            t as f64 / m.max(1) as f64
        );
    }
    let set = median(&mut mine[OPS.len() - 1]);
    println!(
        "seq_set of {} bytes: {:.2}x memcpy of the same bytes ({:.1} us)",
        seq0.len(),
        memcpy as f64 / set.max(1) as f64,
        memcpy as f64 / 1e3
    );
    let (bytes, set, copy) = real_geometry_set(rounds.min(7));
    println!(
        "seq_set at a gemma3-4b-like geometry (34 layers, 1,024-wide f16 K/V, 2,048 tokens), \
         {bytes} bytes: {:.2}x memcpy of the same bytes ({:.1} ms against {:.1} ms)",
        copy as f64 / set.max(1) as f64,
        set as f64 / 1e6,
        copy as f64 / 1e6
    );
    let (bytes, set, copy) = hybrid_geometry_set(rounds.min(7));
    println!(
        "seq_set into a hybrid memory at a Qwen3.5-9B-like geometry (8 attention layers of \
         1,024-wide f16 K/V, 24 gated delta nets, 2,048 tokens), {bytes} bytes: {:.2}x memcpy \
         of the same bytes ({:.1} ms against {:.1} ms)",
        copy as f64 / set.max(1) as f64,
        set as f64 / 1e6,
        copy as f64 / 1e6
    );
}
