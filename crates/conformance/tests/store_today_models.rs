//! The prompt store with today's memories, proven by llama.cpp 0.1.161 itself: a 300-token
//! conversation saved after each turn (as llama.node's `save_state_path` and node-llama-cpp's
//! `saveStateToFile` do) is ingested; the store then writes a file for the same conversation
//! plus 40 new tokens, and for one that diverges at token 200. 0.1.161 loads each file,
//! evaluates only the tokens after it, and its logits equal a cold run's. Cases: plain f16,
//! rotated q8_0, gemma3 with the window only and with `swa_full`, jamba, LFM2, Qwen3.5 and
//! Falcon-H1 (hybrid; Qwen3.5's attention cells carry M-RoPE's extension, Falcon-H1 keeps every
//! layer in both parts),
//! LFM2 with a window (hybrid-iSWA), mamba, deepseek2 (latent attention: no V), deepseek32
//! (dsa: latent and indexer caches). A live
//! memory of the same conversation goes through the store the same way (`put_memory`,
//! `restore_memory`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use conformance::models_dir;
use conformance::today::run;
use llama_kv_cache::state::files::inspect_file;
use llama_kv_cache::{
    memory_for_model, ContextParams, FileKind, GgmlType, Layout, Memory, ModelInfo, ReadOptions,
    WriteOptions,
};
use prompt_store::{MemoryBackend, PromptStore, WriteFileOptions};
use serde_json::Value;

const BT: u32 = 64;
const TURNS: [usize; 2] = [200, 300];

struct Case {
    name: &'static str,
    model: &'static str,
    fa: bool,
    types: (i32, i32),
    swa_full: bool,
    /// The micro-batch (a small one lets the window-only SWA cache prune, as in an app).
    ubatch: u32,
    /// Whether every block boundary of a session restores by itself (no checkpoint needed).
    /// Sequence files of a `swa_full` context carry only the window: 0.1.161 writes a
    /// sequence's SWA cells that are not masked, its sessions every cell.
    blocks_restore: bool,
}

fn cases() -> Vec<Case> {
    let base = Case {
        name: "",
        model: "llama-h16.gguf",
        fa: false,
        types: (1, 1),
        swa_full: false,
        ubatch: 512,
        blocks_restore: true,
    };
    vec![
        Case {
            name: "f16",
            ..base
        },
        Case {
            name: "rotated-q8_0",
            model: "llama-h64.gguf",
            fa: true,
            types: (8, 8),
            ..base
        },
        Case {
            name: "gemma3-window",
            model: "gemma3-swa.gguf",
            ubatch: 32,
            blocks_restore: false,
            ..base
        },
        Case {
            name: "gemma3-swa-full",
            model: "gemma3-swa.gguf",
            swa_full: true,
            ..base
        },
        Case {
            name: "jamba",
            model: "jamba.gguf",
            blocks_restore: false,
            ..base
        },
        Case {
            name: "mamba",
            model: "mamba.gguf",
            blocks_restore: false,
            ..base
        },
        // multi-head latent attention: K only, no V block
        Case {
            name: "deepseek2-mla",
            model: "deepseek2-mla.gguf",
            ..base
        },
        // DeepSeek-V3.2's sparse attention: the latent cache and the indexer's, both every
        // position, so every block boundary restores
        Case {
            name: "deepseek32-dsa",
            model: "deepseek32-dsa.gguf",
            ..base
        },
        Case {
            name: "lfm2",
            model: "lfm2.gguf",
            blocks_restore: false,
            ..base
        },
        // Qwen3.5: gated delta nets beside gated attention whose cells carry M-RoPE's
        // extension
        Case {
            name: "qwen35",
            model: "qwen35.gguf",
            blocks_restore: false,
            ..base
        },
        // Falcon-H1: every layer in both parts
        Case {
            name: "falcon-h1",
            model: "falcon-h1.gguf",
            blocks_restore: false,
            ..base
        },
        // hybrid-iSWA: a base cache of no layer, the window cache, the convolution state
        Case {
            name: "lfm2-swa",
            model: "lfm2-swa.gguf",
            ubatch: 32,
            blocks_restore: false,
            ..base
        },
    ]
}

impl Case {
    fn args(&self) -> Vec<String> {
        vec![
            format!("model={}", models_dir().join(self.model).display()),
            "ctx=512".into(),
            format!("ubatch={}", self.ubatch),
            format!("fa={}", self.fa as u8),
            format!("type_k={}", self.types.0),
            format!("type_v={}", self.types.1),
            format!("swa_full={}", self.swa_full as u8),
        ]
    }

    /// Has 0.1.161 evaluate `tokens` as a conversation and save its state after each of
    /// `turns` tokens: `<prefix>-<turn>.ggsn` and `.ggsq`.
    fn turns(&self, tokens: &[i32], turns: &[usize], prefix: &Path) {
        let turns: Vec<i32> = turns.iter().map(|&t| t as i32).collect();
        self.run(
            "turns",
            &[
                format!("tokens={}", list(tokens)),
                format!("turns={}", list(&turns)),
                format!("out={}", prefix.display()),
            ],
        );
    }

    fn run(&self, action: &str, extra: &[String]) -> Value {
        let mut args = self.args();
        args.extend_from_slice(extra);
        run(action, &args).unwrap_or_else(|e| panic!("{}: {e}", self.name))
    }
}

fn list(tokens: &[i32]) -> String {
    tokens
        .iter()
        .map(|t| t.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// Deterministic tokens of the tiny models' 320-token vocabulary (no control tokens).
fn conversation(n: usize, seed: u32) -> Vec<i32> {
    let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            3 + (x % 317) as i32
        })
        .collect()
}

fn logits(v: &Value) -> Vec<f64> {
    v["logits"]
        .as_array()
        .expect("logits")
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

fn assert_close(case: &str, what: &str, got: &[f64], cold: &[f64]) {
    assert_eq!(got.len(), cold.len());
    let worst = got
        .iter()
        .zip(cold)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    // the same K/V rows; only the order of the peer's own sums may differ between one batch
    // and two
    assert!(
        worst < 1e-3,
        "{case} {what}: logits differ from a cold run by {worst}"
    );
    eprintln!("{case}: {what} within {worst:.2e} of a cold run");
}

/// Loads `file` into 0.1.161, evaluates the rest of `tokens`, and checks what it evaluated
/// and that its logits equal a cold run's.
fn resume_matches_cold(case: &Case, kind: FileKind, file: &Path, tokens: &[i32], restored: u64) {
    let which = match kind {
        FileKind::Session => "session",
        FileKind::Sequence => "seq_file",
    };
    let warm = case.run(
        "resume",
        &[
            format!("{which}={}", file.display()),
            format!("tokens={}", list(tokens)),
        ],
    );
    let label = format!(
        "{} {}: loaded {restored}, evaluated {}",
        case.name,
        kind.name(),
        warm["evaluated"]
    );
    assert_eq!(warm["loaded"].as_u64(), Some(restored), "{label}: {warm}");
    assert_eq!(
        warm["evaluated"].as_u64(),
        Some(tokens.len() as u64 - restored),
        "{label}"
    );
    assert_eq!(
        warm["pos_max"].as_i64(),
        Some(restored as i64 - 1),
        "{label}"
    );
    let cold = case.run("resume", &[format!("tokens={}", list(tokens))]);
    assert_close(&label, "logits", &logits(&warm), &logits(&cold));
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("today-store-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn the_store_restores_todays_memories_and_0_1_161_continues_them_exactly() {
    let a = conversation(300, 1);
    let plus = [a.as_slice(), &conversation(40, 2)].concat();
    let diverged = [&a[..200], &conversation(140, 3)[..]].concat();
    for case in cases() {
        let dir = scratch(case.name);
        let prefix = dir.join("turn");
        case.turns(&a, &TURNS, &prefix);
        for kind in [FileKind::Session, FileKind::Sequence] {
            let ext = match kind {
                FileKind::Session => "ggsn",
                FileKind::Sequence => "ggsq",
            };
            let store =
                PromptStore::new(Arc::new(MemoryBackend::new(None)), case.name, BT).unwrap();
            for turn in TURNS {
                let file = PathBuf::from(format!("{}-{turn}.{ext}", prefix.display()));
                let r = store
                    .put_file(&file, None)
                    .unwrap_or_else(|e| panic!("{} {}: {e}", case.name, file.display()));
                assert_eq!(r.tokens, turn as u64, "{} {}", case.name, file.display());
            }
            // a block boundary restores by itself only where nothing outside the blocks is
            // needed; elsewhere the longest correct prefix is the 200-token turn's checkpoint
            let at_boundary = store.lookup(&a[..256]).unwrap();
            let whole_range = case.blocks_restore && (kind == FileKind::Session || !case.swa_full);
            let want = if whole_range { 256 } else { 200 };
            assert_eq!(at_boundary, want, "{} {}", case.name, kind.name());
            for (what, tokens, restored) in [("plus 40", &plus, 300), ("diverged", &diverged, 200)]
            {
                assert_eq!(
                    store.lookup(tokens).unwrap(),
                    restored,
                    "{} {what}",
                    case.name
                );
                let out = dir.join(format!("stored-{what}.{ext}"));
                let n = store
                    .write_file(tokens, &out, &WriteFileOptions::default(), None)
                    .unwrap();
                assert_eq!(n, restored, "{} {} {what}", case.name, kind.name());
                // the file is of the kind and version that was ingested
                let ins = inspect_file(&out).unwrap();
                assert_eq!(ins.header.kind, kind);
                assert_eq!(
                    ins.header.version,
                    kind.rotation_version(),
                    "{} {what}",
                    case.name
                );
                resume_matches_cold(&case, kind, &out, tokens, restored);
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Issue 37: a gemma3 state that holds every cell (`swa_full`), ingested alone, served a
/// prompt diverging inside it only at its own end (0 tokens). Its rows restore any block
/// boundary, as a plain cache's do: a prompt sharing its first 200 tokens gets 192 (blocks of
/// 16), and 0.1.161 continues the written file like a cold run.
#[test]
fn a_swa_full_state_serves_the_last_block_boundary_before_a_divergence() {
    // a whole batch, and an app's micro-batches (which let a window-only cache prune)
    for ubatch in [512, 32] {
        swa_full_boundary(Case {
            name: "gemma3-swa-full-boundary",
            model: "gemma3-swa.gguf",
            swa_full: true,
            ubatch,
            ..cases().remove(0)
        });
    }
}

fn swa_full_boundary(case: Case) {
    let dir = scratch(case.name);
    let prefix = dir.join("turn");
    let a = conversation(300, 21);
    case.turns(&a, &[300], &prefix);
    let diverged = [&a[..200], &conversation(40, 22)[..]].concat();
    for kind in [FileKind::Session, FileKind::Sequence] {
        let ext = match kind {
            FileKind::Session => "ggsn",
            FileKind::Sequence => "ggsq",
        };
        let file = PathBuf::from(format!("{}-300.{ext}", prefix.display()));
        let ins = inspect_file(&file).unwrap();
        let swa_cells = ins.parts[1].payload.streams[0].cells.len();
        let store = PromptStore::new(Arc::new(MemoryBackend::new(None)), case.name, 16).unwrap();
        assert_eq!(store.put_file(&file, None).unwrap().tokens, 300);
        if kind == FileKind::Sequence {
            // 0.1.161 writes a sequence's unmasked window cells only, even with `swa_full`:
            // the rows before the window are not in the file, so only its own end restores
            assert!(swa_cells < 300, "{swa_cells} window cells");
            assert_eq!(store.lookup(&diverged).unwrap(), 0);
            continue;
        }
        assert_eq!(swa_cells, 300, "a session keeps every window cell");
        assert_eq!(store.lookup(&diverged).unwrap(), 192);
        let out = dir.join(format!("boundary.{ext}"));
        let n = store
            .write_file(&diverged, &out, &WriteFileOptions::default(), None)
            .unwrap();
        assert_eq!(n, 192);
        resume_matches_cold(&case, kind, &out, &diverged, 192);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn fifty_conversations_sharing_a_2048_token_prefix_on_an_iswa_model_store_it_once() {
    // gemma3 with swa_full, so that removing one conversation's tail leaves the next one's
    // window exact; its sessions keep every SWA position, which the store keeps in blocks too
    let case = Case {
        name: "gemma3-dedup",
        model: "gemma3-swa.gguf",
        swa_full: true,
        ..cases().remove(0)
    };
    let dir = scratch(case.name);
    let prefix = conversation(2048, 11);
    let tails: Vec<Vec<i32>> = (0..50).map(|k| conversation(32, 100 + k)).collect();
    let mut args = case.args();
    args[1] = "ctx=2304".into();
    args.extend([
        format!("tokens={}", list(&prefix)),
        format!(
            "tails={}",
            tails.iter().map(|t| list(t)).collect::<Vec<_>>().join(";")
        ),
        format!("out={}", dir.join("conv").display()),
    ]);
    run("branches", &args).unwrap();
    let files: Vec<PathBuf> = (0..50)
        .map(|k| dir.join(format!("conv-{k}.ggsn")))
        .collect();
    let one = PromptStore::new(Arc::new(MemoryBackend::new(None)), "g", BT).unwrap();
    one.put_file(&files[0], None).unwrap();
    let one_conversation = one.stats().unwrap().bytes;
    let all = PromptStore::new(Arc::new(MemoryBackend::new(None)), "g", BT).unwrap();
    let mut skipped = 0;
    for f in &files {
        let r = all.put_file(f, None).unwrap();
        assert_eq!(r.tokens, 2080);
        skipped += r.blocks_skipped;
    }
    // the 32 shared blocks of each part were stored once
    assert_eq!(skipped, 49 * 2 * 32);
    // the irreducible rest: each further conversation's tail rows (both parts)
    let shape = all.shape().unwrap().unwrap();
    let per_token: u64 = [&shape.main, &shape.swa]
        .iter()
        .filter_map(|p| p.as_ref())
        .map(|p| p.layers.bytes_per_token())
        .sum();
    let tails_bytes = 49 * 32 * per_token;
    let total = all.stats().unwrap().bytes;
    let budget = (one_conversation + tails_bytes) as f64 * 1.10;
    eprintln!(
        "50 conversations: {total} bytes; one conversation {one_conversation} + 49 tails {tails_bytes} = {} (ratio {:.3})",
        one_conversation + tails_bytes,
        total as f64 / (one_conversation + tails_bytes) as f64
    );
    assert!(total as f64 <= budget, "{total} > {budget}");
    // each conversation restores whole
    for (k, tail) in tails.iter().enumerate().step_by(7) {
        let tokens = [prefix.as_slice(), tail].concat();
        assert_eq!(all.lookup(&tokens).unwrap(), 2080, "conversation {k}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The memory 0.1.161 builds for `case` (one sequence, unified).
fn live_memory(case: &Case) -> Box<dyn Memory> {
    let info = ModelInfo::from_file(&models_dir().join(case.model), false)
        .unwrap_or_else(|e| panic!("{e} (set-up: node scripts/setup.mjs)"));
    let ctx = ContextParams {
        n_ctx: 512,
        n_seq_max: 1,
        n_ubatch: case.ubatch,
        unified: true,
        swa_full: case.swa_full,
        type_k: GgmlType::from_id(case.types.0).unwrap(),
        type_v: GgmlType::from_id(case.types.1).unwrap(),
        flash_attn: case.fa,
    };
    memory_for_model(&info, &ctx).unwrap_or_else(|e| panic!("{}: {e}", case.name))
}

#[test]
fn a_live_memory_put_into_the_store_restores_into_a_fresh_one_that_0_1_161_continues_exactly() {
    let a = conversation(300, 1);
    let plus = [a.as_slice(), &conversation(40, 2)].concat();
    let live_cases = cases().into_iter().filter(|c| {
        matches!(
            c.name,
            "gemma3-window"
                | "gemma3-swa-full"
                | "jamba"
                | "lfm2"
                | "lfm2-swa"
                | "qwen35"
                | "falcon-h1"
        )
    });
    for case in live_cases {
        let dir = scratch(&format!("live-{}", case.name));
        let prefix = dir.join("turn");
        case.turns(&a, &[300], &prefix);
        // the conversation as the app's live memory holds it after the turn
        let mut memory = live_memory(&case);
        let turn = PathBuf::from(format!("{}-300.ggsq", prefix.display()));
        memory
            .load_file(&turn, Some(0), ReadOptions::default(), None)
            .unwrap_or_else(|e| panic!("{}: {e}", case.name));
        let store = PromptStore::new(Arc::new(MemoryBackend::new(None)), case.name, BT).unwrap();
        let put = store.put_memory(&*memory, 0, &a, None).unwrap();
        assert_eq!(put.tokens, 300, "{}", case.name);

        // a new session of the app: a fresh memory, restored from the store for a longer prompt
        let mut fresh = live_memory(&case);
        let restored = store.restore_memory(&mut *fresh, 0, &plus, None).unwrap();
        assert_eq!(restored, 300, "{}", case.name);
        let out = dir.join("restored.ggsq");
        let opts = WriteOptions {
            version: Some(FileKind::Sequence.rotation_version()),
            layout: Layout::StreamsRot,
            n_stream: 1,
        };
        fresh
            .save_file(&out, Some(0), &plus[..300], "", opts, None)
            .unwrap();
        resume_matches_cold(&case, FileKind::Sequence, &out, &plus, restored);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// A hybrid with an indexer (`hybrid-idx`: attention, recurrent state, then the indexer's key
/// cache) has no tiny 0.1.161 model; its files are built of Jamba's real turns with Jamba's
/// attention part again as the indexer. The store keeps the indexer in blocks of its own, as
/// dsa's: a file it writes for a stored turn is that turn's file byte for byte, and a block
/// boundary past the first turn restores only from that turn's checkpoint.
#[test]
fn hybrid_idx_turns_go_through_the_store_and_come_back_byte_for_byte() {
    use llama_kv_cache::state::files::{header_bytes, inspect_bytes};
    let case = cases().into_iter().find(|c| c.name == "jamba").unwrap();
    let a = conversation(300, 1);
    let dir = scratch("hybrid-idx");
    let prefix = dir.join("turn");
    case.turns(&a, &TURNS, &prefix);
    let store = PromptStore::new(Arc::new(MemoryBackend::new(None)), "hybrid-idx", BT).unwrap();
    let mut files = Vec::new();
    for turn in TURNS {
        let jamba = std::fs::read(format!("{}-{turn}.ggsq", prefix.display())).unwrap();
        let ins = inspect_bytes(&jamba).unwrap();
        let payload = &jamba[ins.payload_offset..];
        let attention = &payload[ins.parts[0].range.clone()];
        let file = [
            header_bytes(FileKind::Sequence, 4, &a[..turn]),
            payload.to_vec(),
            attention.to_vec(),
        ]
        .concat();
        assert_eq!(inspect_bytes(&file).unwrap().memory.name(), "hybrid-idx");
        let r = store.put_bytes(&file, None).unwrap();
        assert_eq!(r.tokens, turn as u64);
        files.push(file);
    }
    // 256 tokens end a block, but the recurrent state there is kept only at 200
    stored_turns_come_back(&store, &dir, &a, &files, "hybrid-idx");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Has `store` write a file for each turn of `a` (`TURNS`) and checks it is that turn's
/// ingested file (`files`) byte for byte, and that the block boundary at 256 tokens restores
/// only from the first turn's checkpoint (what the store keeps outside its blocks is there).
fn stored_turns_come_back(
    store: &PromptStore,
    dir: &Path,
    a: &[i32],
    files: &[Vec<u8>],
    name: &str,
) {
    for (turn, file) in TURNS.iter().zip(files) {
        let out = dir.join(format!("stored-{turn}.ggsq"));
        let n = store
            .write_file(&a[..*turn], &out, &WriteFileOptions::default(), None)
            .unwrap();
        assert_eq!(n, *turn as u64, "{name}");
        assert!(
            std::fs::read(&out).unwrap() == *file,
            "{name} turn {turn}: the store wrote another file"
        );
    }
    assert_eq!(store.lookup(&a[..256]).unwrap(), 200, "{name}");
}

/// A sparse-attention memory with a window (`dsa-iswa`: latent cache, indexer, window cache)
/// has no tiny 0.1.161 model either; its files are built of deepseek32's real turns (latent and
/// indexer caches) with deepseek2's latent cache of the same conversation as the window, cut to
/// its last 4 positions as 0.1.161 saves a sequence's window cache. The store keeps the latent
/// and indexer caches in blocks and the window in each turn's checkpoint: a file it writes for a
/// stored turn is that turn's file byte for byte, and a block boundary restores only where a
/// turn's checkpoint holds the window.
#[test]
fn dsa_iswa_turns_go_through_the_store_and_come_back_byte_for_byte() {
    use llama_kv_cache::state::files::{header_bytes, inspect_bytes};
    use llama_kv_cache::{convert_bytes, ConvertOptions};
    let named = |name: &str| cases().into_iter().find(|c| c.name == name).unwrap();
    let a = conversation(300, 3);
    let dir = scratch("dsa-iswa");
    let (dsa, window) = (dir.join("dsa"), dir.join("window"));
    named("deepseek32-dsa").turns(&a, &TURNS, &dsa);
    named("deepseek2-mla").turns(&a, &TURNS, &window);
    let store = PromptStore::new(Arc::new(MemoryBackend::new(None)), "dsa-iswa", BT).unwrap();
    let mut files = Vec::new();
    for turn in TURNS {
        let payload = |prefix: &Path| {
            let bytes = std::fs::read(format!("{}-{turn}.ggsq", prefix.display())).unwrap();
            let at = inspect_bytes(&bytes).unwrap().payload_offset;
            bytes[at..].to_vec()
        };
        let whole = [
            header_bytes(FileKind::Sequence, 4, &a[..turn]),
            payload(&dsa),
            payload(&window),
        ]
        .concat();
        let mut cut = ConvertOptions {
            swa_window: Some(4),
            ..ConvertOptions::default()
        };
        cut.write.version = Some(4);
        let file = convert_bytes(&whole, &cut).unwrap();
        let ins = inspect_bytes(&file).unwrap();
        assert_eq!(ins.memory.name(), "dsa-iswa");
        let last = turn as i32 - 1;
        assert_eq!(
            ins.parts[2].payload.streams[0].cells.positions(),
            [last - 3, last - 2, last - 1, last]
        );
        let r = store.put_bytes(&file, None).unwrap();
        assert_eq!(r.tokens, turn as u64);
        files.push(file);
    }
    // 256 tokens end a block of both caches, but the window there is kept only at 200
    stored_turns_come_back(&store, &dir, &a, &files, "dsa-iswa");
    let _ = std::fs::remove_dir_all(&dir);
}

/// DeepSeek V4 (`dsv4`): the raw cache's base and window caches go through the store as
/// iSWA's do, its compressed caches and compressor states (a row per 4 or 128 positions, and
/// the positions not yet pooled) whole in each turn's checkpoint. The store writes sequence
/// files: for a stored turn, that turn's file byte for byte; for a conversation that goes on
/// (or diverges after the first turn), a file 0.1.161 loads, evaluating only the tokens after
/// it, with a cold run's logits. Sessions of the same turns go in alike.
#[test]
fn deepseek4_turns_go_through_the_store_and_0_1_161_continues_them_exactly() {
    let case = Case {
        name: "deepseek4",
        model: "deepseek4.gguf",
        fa: false,
        types: (1, 1),
        swa_full: false,
        ubatch: 512,
        blocks_restore: false,
    };
    let a = conversation(300, 4);
    let plus = [a.as_slice(), &conversation(40, 5)].concat();
    let diverged = [&a[..200], &conversation(140, 6)[..]].concat();
    let dir = scratch("deepseek4");
    let prefix = dir.join("turn");
    case.turns(&a, &TURNS, &prefix);
    for ext in ["ggsq", "ggsn"] {
        let store = PromptStore::new(Arc::new(MemoryBackend::new(None)), "dsv4", BT).unwrap();
        for turn in TURNS {
            let file = PathBuf::from(format!("{}-{turn}.{ext}", prefix.display()));
            let r = store.put_file(&file, None).unwrap();
            assert_eq!(r.tokens, turn as u64, "{}", file.display());
        }
        // no block boundary restores by itself: the compressors' state is in checkpoints
        if ext == "ggsq" {
            let own: Vec<Vec<u8>> = TURNS
                .iter()
                .map(|t| std::fs::read(format!("{}-{t}.ggsq", prefix.display())).unwrap())
                .collect();
            stored_turns_come_back(&store, &dir, &a, &own, "deepseek4");
        } else {
            assert_eq!(store.lookup(&a[..256]).unwrap(), 200, "{ext}");
        }
        for (what, tokens, restored) in [("plus 40", &plus, 300), ("diverged", &diverged, 200)] {
            let out = dir.join(format!("stored-{what}-{ext}.ggsq"));
            let n = store
                .write_file(tokens, &out, &WriteFileOptions::default(), None)
                .unwrap();
            assert_eq!(n, restored, "{ext} {what}");
            assert_eq!(inspect_file(&out).unwrap().memory.name(), "dsv4");
            resume_matches_cold(&case, FileKind::Sequence, &out, tokens, restored);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
