//! 256 sequences, llama.cpp's `LLAMA_MAX_SEQ`, against llama.cpp 0.1.161: the peer decodes two
//! tokens into each of 256 sequences in one batch. Placing that batch gives the cells of the
//! peer's session; the peer's files load cell for cell and its sequence file of sequence 255
//! (the last word of a cell's sequence set) writes back byte for byte; and a session we write
//! after copying sequence 200 into 255 continues in the peer, from sequence 255, with the token
//! the peer itself predicted for 200.

use conformance::models_dir;
use conformance::today::{spec_named, Spec};
use llama_kv_cache::state::files::inspect_bytes;
use llama_kv_cache::{GgmlType, ModelInfo, ReadOptions, SeedCache, UBatch, WriteOptions};

const N_SEQ: usize = 256;
/// Two tokens per sequence, then the peer's next token for each (`next2`), and room to spare.
const CTX: u32 = 4 * N_SEQ as u32;
const MODEL: &str = "llama-h16.gguf";

/// Two tokens for sequence `s`, different for every sequence (the vocabulary has 320).
fn prompts() -> Vec<Vec<i32>> {
    (0..N_SEQ as i32)
        .map(|s| vec![3 + s % 300, 5 + (s * 7) % 300])
        .collect()
}

/// The peer's run: f16 K/V, no flash attention, one unified stream, sequence 255 saved.
fn spec() -> Spec {
    Spec {
        name: "seqs256",
        model: MODEL,
        prompts: prompts(),
        ctx: CTX,
        seq: 255,
        ..spec_named("h16-f16")
    }
}

/// Our cache for the model, as llama.cpp sizes it for this context.
fn model_cache() -> SeedCache {
    let info = ModelInfo::from_file(&models_dir().join(MODEL), false).unwrap();
    let p = info
        .cache_params(CTX, N_SEQ as u32, GgmlType::F16, GgmlType::F16, false)
        .unwrap();
    SeedCache::new(p).unwrap()
}

fn v(version: u32) -> WriteOptions {
    WriteOptions {
        version: Some(version),
        ..WriteOptions::default()
    }
}

/// A temporary folder of this test process.
fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("today-seqs256-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn two_hundred_fifty_six_sequences_round_trip_with_the_peer() {
    let dir = temp_dir("peer");
    let (session, sequence) = (dir.join("peer.ggsn"), dir.join("peer-255.ggsq"));
    let spec = spec();
    let prompts = &spec.prompts;
    let peer = spec.generate_into(&session, &sequence).unwrap();
    let (session_bytes, sequence_bytes) = (
        std::fs::read(&session).unwrap(),
        std::fs::read(&sequence).unwrap(),
    );

    // the peer's batch, placed here: the cells of its session
    let mut placed = model_cache();
    let (mut pos, mut ids) = (Vec::new(), Vec::new());
    for s in 0..N_SEQ as i32 {
        pos.extend([0, 1]);
        ids.extend([vec![s], vec![s]]);
    }
    placed
        .find_slot(&UBatch::per_token(pos, ids))
        .unwrap()
        .unwrap();
    let ours = placed
        .session_file_bytes(&prompts.concat(), "llama", None, v(11), None)
        .unwrap();
    let (ours, theirs) = (
        inspect_bytes(&ours).unwrap(),
        inspect_bytes(&session_bytes).unwrap(),
    );
    assert_eq!(
        ours.payload.streams[0].cells, theirs.payload.streams[0].cells,
        "cell metadata of 256 sequences"
    );

    // the peer's session loads with every sequence's two cells
    let mut c = model_cache();
    c.load_session_bytes(&session_bytes, ReadOptions::default(), None)
        .unwrap();
    for s in 0..N_SEQ as i32 {
        assert_eq!(c.seq_cell_count(s).unwrap(), 2, "seq {s}");
        assert_eq!(c.seq_pos_max(s).unwrap(), 1, "seq {s}");
    }

    // its sequence file of the last sequence writes back byte for byte
    let mut last = model_cache();
    last.load_sequence_bytes(&sequence_bytes, 255, ReadOptions::default(), None)
        .unwrap();
    let back = last
        .sequence_file_bytes(255, &prompts[255], v(4), None)
        .unwrap();
    assert!(back == sequence_bytes, "not the peer's own sequence file");

    // sequence 200 copied into 255: the peer continues 255 as it continued 200
    c.seq_rm(255, -1, -1).unwrap();
    c.seq_cp(200, 255, -1, -1).unwrap();
    let written = dir.join("ours.ggsn");
    let bytes = c
        .session_file_bytes(&prompts.concat(), "llama", None, v(11), None)
        .unwrap();
    std::fs::write(&written, bytes).unwrap();
    let mut args = spec.context_args();
    args.extend([
        format!("session={}", written.display()),
        "dest=255".into(),
        format!("token={}", peer["next"][200]),
        "pos=2".into(),
    ]);
    let cont = conformance::today::run("cont", &args).unwrap();
    assert_eq!(cont["pos_max"], 1, "{cont}");
    assert_eq!(cont["next"], peer["next2"][200], "{cont}");
    let _ = std::fs::remove_dir_all(&dir);
}
