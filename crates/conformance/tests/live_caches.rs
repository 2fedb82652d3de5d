//! Today's live caches against llama.cpp 0.1.161, op by op: random traces of decodes,
//! sequence operations and sequence state round trips on a gemma3-like iSWA model (window 4,
//! every second layer full), a full-attention llama, a Jamba-like hybrid (a Mamba layer and an
//! attention layer), LFM2, Qwen3.5, Nemotron-H, Falcon-H1, Granite 4 and Mamba, with 1, 3 and 256 sequences, unified and one stream per
//! sequence. After every op both sides show every cell of every stream of every part
//! (position, pending shift, sequences), the recurrent state cells (position, sequences,
//! tails, head, used) and each sequence's position range.

use conformance::models_dir;
use conformance::today::trace::{run_ops, run_traces, Op, TraceConfig};

fn config(model: &str, ctx: u32, n_seq: u32, unified: bool, swa_full: bool) -> TraceConfig {
    TraceConfig {
        model: model.into(),
        ctx,
        n_seq,
        // small ubatches keep the window caches small (window + ubatch, padded to 256); a
        // context needs a batch of at least one token per sequence
        n_ubatch: n_seq.max(16),
        unified,
        swa_full,
    }
}

fn run(cfg: TraceConfig, seed: u64, traces: u32, ops: u32) {
    match run_traces(&cfg, &models_dir(), seed, traces, ops) {
        Ok(stats) => {
            eprintln!("{cfg:?}: {stats:?}");
            assert!(stats.decodes > 0, "no decode was placed: {stats:?}");
        }
        Err(e) => panic!("{cfg:?} seed {seed}:\n{e}\n(set-up: node scripts/setup.mjs)"),
    }
}

#[test]
fn iswa_one_sequence_matches_0_1_161() {
    run(
        config("gemma3-swa.gguf", 512, 1, true, false),
        1_000,
        60,
        120,
    );
}

#[test]
fn iswa_three_sequences_unified_matches_0_1_161() {
    run(
        config("gemma3-swa.gguf", 512, 3, true, false),
        2_000,
        60,
        120,
    );
}

#[test]
fn iswa_three_streams_matches_0_1_161() {
    run(
        config("gemma3-swa.gguf", 768, 3, false, false),
        3_000,
        40,
        60,
    );
}

#[test]
fn iswa_swa_full_shifts_as_0_1_161() {
    run(config("gemma3-swa.gguf", 256, 3, true, true), 4_000, 40, 60);
}

#[test]
fn attention_cache_matches_0_1_161() {
    run(config("llama-h16.gguf", 256, 3, true, false), 5_000, 30, 60);
    // a stream per sequence: the cache fromModel builds with kvUnified false
    run(
        config("llama-h16.gguf", 768, 3, false, false),
        6_000,
        200,
        60,
    );
}

#[test]
fn iswa_256_sequences_match_0_1_161() {
    run(
        config("gemma3-swa.gguf", 1024, 256, true, false),
        7_000,
        10,
        60,
    );
    // one stream of 256 cells per sequence
    run(
        config("gemma3-swa.gguf", 65_536, 256, false, false),
        8_000,
        4,
        40,
    );
}

#[test]
fn hybrid_memory_matches_0_1_161() {
    run(config("jamba.gguf", 256, 1, true, false), 9_000, 80, 60);
    run(config("jamba.gguf", 512, 3, true, false), 10_000, 80, 60);
    run(config("jamba.gguf", 768, 3, false, false), 11_000, 40, 60);
}

#[test]
fn lfm2_hybrid_memory_matches_0_1_161() {
    // short convolutions: a recurrent state of R rows only, beside the attention layers
    run(config("lfm2.gguf", 256, 1, true, false), 14_000, 40, 60);
    run(config("lfm2.gguf", 512, 3, true, false), 15_000, 40, 60);
}

#[test]
fn qwen35_hybrid_memory_matches_0_1_161() {
    // gated delta nets on layers 0 and 2, gated attention with interleaved M-RoPE on 1 and 3:
    // the split comes from `full_attention_interval`, every layer has KV heads
    run(config("qwen35.gguf", 256, 1, true, false), 19_000, 60, 60);
    run(config("qwen35.gguf", 512, 3, true, false), 20_000, 60, 60);
    run(config("qwen35.gguf", 768, 3, false, false), 21_000, 40, 60);
}

#[test]
fn nemotron_h_hybrid_memory_matches_0_1_161() {
    // a Mamba-2 layer, an attention layer and an MLP-only layer that neither part holds
    run(
        config("nemotron-h.gguf", 256, 1, true, false),
        22_000,
        60,
        60,
    );
    run(
        config("nemotron-h.gguf", 512, 3, true, false),
        23_000,
        60,
        60,
    );
    run(
        config("nemotron-h.gguf", 768, 3, false, false),
        24_000,
        40,
        60,
    );
}

#[test]
fn granite_hybrid_memory_matches_0_1_161() {
    // Granite 4: a Mamba-2 layer (its conv state widened by the B and C groups) and attention
    run(
        config("granite-hybrid.gguf", 256, 1, true, false),
        28_000,
        40,
        60,
    );
    run(
        config("granite-hybrid.gguf", 512, 3, true, false),
        29_000,
        40,
        60,
    );
}

#[test]
fn falcon_h1_hybrid_memory_matches_0_1_161() {
    // every layer in both parts: attention and a Mamba-2 mixer side by side
    run(
        config("falcon-h1.gguf", 256, 1, true, false),
        25_000,
        60,
        60,
    );
    run(
        config("falcon-h1.gguf", 512, 3, true, false),
        26_000,
        60,
        60,
    );
    run(
        config("falcon-h1.gguf", 768, 3, false, false),
        27_000,
        40,
        60,
    );
}

#[test]
fn hybrid_iswa_memory_matches_0_1_161() {
    // LFM2 with a window of 4 on every attention layer: a window cache (and a base cache with
    // no layer) beside the recurrent memory
    run(config("lfm2-swa.gguf", 256, 1, true, false), 16_000, 60, 60);
    run(config("lfm2-swa.gguf", 512, 3, true, false), 17_000, 60, 60);
    run(
        config("lfm2-swa.gguf", 768, 3, false, false),
        18_000,
        40,
        60,
    );
}

#[test]
fn recurrent_memory_matches_0_1_161() {
    run(config("mamba.gguf", 256, 1, true, false), 12_000, 100, 60);
    run(config("mamba.gguf", 256, 3, true, false), 13_000, 100, 60);
}

/// Llama 4's chunked window (chunks of 8,192 positions) through a sequence long enough for the
/// window cache (8,704 cells) to reuse the cells of the chunk before: random traces never get
/// there, so this one is written out.
#[test]
fn chunked_window_matches_0_1_161() {
    let cfg = TraceConfig {
        model: "llama4-chunked.gguf".into(),
        ctx: 16_384,
        n_seq: 1,
        n_ubatch: 512,
        unified: true,
        swa_full: false,
    };
    let decode = |p: i32, n: u32| Op::Decode(vec![(0, p, n)]);
    let mut ops: Vec<Op> = (0..19).map(|k| decode(k * 512, 512)).collect();
    ops.extend([
        Op::Rm(0, 9_500, -1),
        decode(9_500, 300),
        Op::Save(0),
        Op::Load(0),
        decode(9_800, 512),
        Op::Rm(0, 0, 4_096),
        decode(10_312, 200),
        Op::Keep(0),
        decode(10_512, 100),
    ]);
    let shown = run_ops(&cfg, &models_dir(), &ops)
        .unwrap_or_else(|e| panic!("{e}\n(set-up: node scripts/setup.mjs)"));
    for (op, s) in ops.iter().zip(&shown) {
        assert!(
            !matches!(op, Op::Decode(_)) || s.ret == 0,
            "{op:?} found no room"
        );
    }
    // the window cache (8,704 cells) is full after 17 decodes; the 18th and 19th reuse the
    // cells of the chunk before position 8,192, purging the sequence's oldest positions
    assert_eq!(shown[16].pos[0], (0, 8_703));
    assert!(
        shown[18].pos[0].0 > 0,
        "no cell was reused: {:?}",
        shown[18].pos
    );
}
