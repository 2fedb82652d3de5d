//! The state readers of today's live memories against damaged input: thousands of mutations
//! (flipped bytes, cut payloads, spliced and zeroed spans, swapped counts) of real iSWA and
//! hybrid payloads, each read into a filled memory as a whole state and as a sequence, in both
//! layouts. Every read either succeeds or fails with the memory exactly as it was (its whole
//! state byte for byte), and never panics. A seeded property test, not a fuzzer: it runs in
//! `cargo test` every time; `LIVE_READER_ROUNDS=N` runs N rounds per memory (default 20,000).

use conformance::models_dir;
use conformance::today::trace::{damaged, Rng};
use llama_kv_cache::{
    ContextParams, GgmlType, HybridCache, IswaCache, IswaParams, Layout, Memory as _, ModelInfo,
    Result, UBatch,
};

fn context(n_seq: u32) -> ContextParams {
    ContextParams {
        n_ctx: 256,
        n_seq_max: n_seq,
        n_ubatch: 16,
        unified: true,
        swa_full: false,
        type_k: GgmlType::F16,
        type_v: GgmlType::F16,
        flash_attn: false,
    }
}

fn model(name: &str) -> ModelInfo {
    ModelInfo::from_file(&models_dir().join(name), false)
        .unwrap_or_else(|e| panic!("{e} (set-up: node scripts/setup.mjs)"))
}

/// A memory of either kind, as the readers see it.
trait Reads {
    fn write(&self, seq: i32, layout: Layout) -> Result<Vec<u8>>;
    fn read(&mut self, data: &[u8], seq: i32, layout: Layout) -> Result<()>;
}

impl Reads for IswaCache {
    fn write(&self, seq: i32, layout: Layout) -> Result<Vec<u8>> {
        self.state_write(seq, layout)
    }
    fn read(&mut self, data: &[u8], seq: i32, layout: Layout) -> Result<()> {
        self.state_read(data, seq, layout).map(drop)
    }
}

impl Reads for HybridCache {
    fn write(&self, seq: i32, layout: Layout) -> Result<Vec<u8>> {
        self.state_write(seq, layout)
    }
    fn read(&mut self, data: &[u8], seq: i32, layout: Layout) -> Result<()> {
        self.state_read(data, seq, layout).map(drop)
    }
}

fn hammer<M: Reads>(what: &str, m: &mut M, seqs: &[i32], rounds: u32, seed: u64) -> (u32, u32) {
    let mut rng = Rng::new(seed);
    let layouts = [Layout::StreamsRot, Layout::Streams];
    let baseline = m.write(-1, Layout::StreamsRot).unwrap();
    let mut good = Vec::new();
    for &layout in &layouts {
        good.push((m.write(-1, layout).unwrap(), -1));
        for &s in seqs {
            good.push((m.write(s, layout).unwrap(), s));
        }
    }
    let (mut refused, mut read) = (0, 0);
    for round in 0..rounds {
        let (payload, seq) = &good[rng.below(good.len() as u32) as usize];
        let bad = damaged(&mut rng, payload);
        let dest = if *seq == -1 {
            -1
        } else {
            seqs[rng.below(seqs.len() as u32) as usize]
        };
        let layout = layouts[rng.below(2) as usize];
        let before = m.write(-1, Layout::StreamsRot).unwrap();
        match m.read(&bad, dest, layout) {
            Err(_) => {
                refused += 1;
                let after = m.write(-1, Layout::StreamsRot).unwrap();
                assert!(
                    after == before,
                    "{what} round {round}: a refused read changed the memory ({} bytes, dest {dest}, {layout})",
                    bad.len()
                );
            }
            Ok(()) => {
                read += 1;
                // whatever it read writes back, and the memory goes back to its filled state
                m.write(-1, Layout::StreamsRot).unwrap();
                m.read(&baseline, -1, Layout::StreamsRot).unwrap();
            }
        }
    }
    (refused, read)
}

fn rounds() -> u32 {
    std::env::var("LIVE_READER_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000)
}

fn filled_iswa() -> IswaCache {
    let mut c =
        IswaCache::new(IswaParams::for_model(&model("gemma3-swa.gguf"), &context(3)).unwrap())
            .unwrap();
    c.place(&[UBatch::sequence(0, 0, 12), UBatch::sequence(1, 0, 5)])
        .unwrap()
        .unwrap();
    c.seq_cp(1, 2, -1, -1).unwrap();
    c
}

fn filled_hybrid() -> HybridCache {
    hybrid_with("jamba.gguf", 2, &[(0, 7), (1, 3)])
}

/// The hybrid memory of `model` for `n_seq` sequences, each `(seq, n)` placed as one group of
/// `n` tokens.
fn hybrid_with(model_file: &str, n_seq: u32, groups: &[(i32, i32)]) -> HybridCache {
    let mut c = HybridCache::for_model(&model(model_file), &context(n_seq)).unwrap();
    for &(s, n) in groups {
        let ub = UBatch {
            pos: (0..n).collect(),
            n_seq_tokens: n as u32,
            seq_ids: vec![vec![s]],
            ext: Vec::new(),
        };
        c.place(&[ub]).unwrap().unwrap();
    }
    c
}

#[test]
fn damaged_iswa_states_are_read_or_refused_with_the_memory_unchanged() {
    let (refused, read) = hammer("iswa", &mut filled_iswa(), &[0, 1, 2], rounds(), 77);
    eprintln!("iswa: {refused} refused, {read} read");
    assert!(
        refused > rounds() / 3 && read > 0,
        "{refused} refused, {read} read"
    );
}

#[test]
fn damaged_hybrid_states_are_read_or_refused_with_the_memory_unchanged() {
    let (refused, read) = hammer("hybrid", &mut filled_hybrid(), &[0, 1], rounds(), 78);
    eprintln!("hybrid: {refused} refused, {read} read");
    assert!(
        refused > rounds() / 3 && read > 0,
        "{refused} refused, {read} read"
    );
}

/// LFM2 with a window: llama_memory_hybrid_iswa (a base cache of no layer, the window cache,
/// the convolution state), as the `live_reader` fuzz target builds it.
fn filled_hybrid_iswa() -> HybridCache {
    hybrid_with("lfm2-swa.gguf", 3, &[(0, 6), (1, 3)])
}

#[test]
fn damaged_hybrid_iswa_states_are_read_or_refused_with_the_memory_unchanged() {
    let (refused, read) = hammer(
        "hybrid-iswa",
        &mut filled_hybrid_iswa(),
        &[0, 1, 2],
        rounds(),
        79,
    );
    eprintln!("hybrid-iswa: {refused} refused, {read} read");
    assert!(
        refused > rounds() / 3 && read > 0,
        "{refused} refused, {read} read"
    );
}

#[test]
fn regression_a_failed_whole_read_of_a_hybrid_iswa_memory_left_it_changed() {
    // found by the live_reader fuzz target: a whole-memory payload of the streams layout
    let input = include_bytes!("fuzz-findings/hybrid-iswa-failed-read-changed-memory.bin");
    let payload = &input[1..];
    let mut m = filled_hybrid_iswa();
    let before = m.state_write(-1, Layout::StreamsRot).unwrap();
    // its recurrent part names sequence 1 twice in one cell: refused by the check of both
    // parts, before the attention part changed (it used to be refused only when placed)
    let e = m.state_read(payload, -1, Layout::Streams).unwrap_err();
    assert!(e.to_string().contains("duplicate tail"), "{e}");
    assert!(
        m.state_write(-1, Layout::StreamsRot).unwrap() == before,
        "a failed read ({e}) changed the memory"
    );
}

/// Qwen3.5: gated delta nets beside attention cells that carry M-RoPE's extension (the
/// recurrent part's cells carry none); Nemotron-H, whose MLP-only layer is in neither part;
/// Falcon-H1, whose layers are in both.
#[test]
fn damaged_states_of_todays_hybrid_layer_splits_are_read_or_refused_with_the_memory_unchanged() {
    for (name, seed) in [
        ("qwen35.gguf", 80),
        ("nemotron-h.gguf", 81),
        ("falcon-h1.gguf", 82),
    ] {
        let mut m = hybrid_with(name, 3, &[(0, 6), (1, 3)]);
        let (refused, read) = hammer(name, &mut m, &[0, 1, 2], rounds(), seed);
        eprintln!("{name}: {refused} refused, {read} read");
        assert!(
            refused > rounds() / 3 && read > 0,
            "{name}: {refused} refused, {read} read"
        );
    }
}
