//! llama.cpp 0.1.161's in-memory sequence states and context checkpoints, both ways: the
//! driver saves a sequence with `llama_state_seq_get_data` (magic and sequence id before the
//! payload) and with `PARTIAL_ONLY` (what llama-server keeps as a checkpoint: the window cache
//! of an iSWA memory, the recurrent part of a hybrid); our live memory reads the first, writes
//! the second byte for byte, and 0.1.161 reads our partial state into a memory of its own with
//! the same cells as ours.

use conformance::models_dir;
use conformance::today::trace::{Oracle, TraceConfig};
use llama_kv_cache::state::files::seq_data_envelope;
use llama_kv_cache::{memory_for_model, Layout, Memory, ModelInfo, ReadOptions, WriteOptions};

fn config(model: &str) -> TraceConfig {
    TraceConfig {
        model: model.into(),
        ctx: 256,
        n_seq: 2,
        n_ubatch: 16,
        unified: true,
        swa_full: false,
    }
}

fn memory(cfg: &TraceConfig) -> Box<dyn Memory> {
    let info = ModelInfo::from_file(&models_dir().join(&cfg.model), false)
        .unwrap_or_else(|e| panic!("{e} (set-up: node scripts/setup.mjs)"));
    memory_for_model(&info, &cfg.context()).unwrap()
}

fn ok(oracle: &mut Oracle, line: &str) -> conformance::today::trace::Shown {
    let shown = oracle.send(line).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(shown.ret, 1, "`{line}` failed in 0.1.161");
    shown
}

#[test]
fn sequence_states_and_checkpoints_of_0_1_161_read_and_write_byte_for_byte() {
    let dir = std::env::temp_dir().join(format!("today-checkpoints-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for model in ["gemma3-swa.gguf", "jamba.gguf", "lfm2-swa.gguf"] {
        let cfg = config(model);
        let mut oracle = Oracle::start(&cfg, &models_dir()).unwrap();
        // 40 tokens of sequence 0 (the window of 4 leaves most of them masked), then its state
        // in both forms
        for p0 in (0..40).step_by(8) {
            let shown = oracle.send(&format!("decode 0:{p0}:8")).unwrap();
            assert_eq!(shown.ret, 0, "{model}: decode at {p0}");
        }
        let (whole, partial) = (dir.join("whole.bin"), dir.join("partial.bin"));
        ok(&mut oracle, "save 0");
        ok(&mut oracle, &format!("dump {}", whole.display()));
        ok(&mut oracle, "savep 0");
        ok(&mut oracle, &format!("dump {}", partial.display()));
        let (whole, partial) = (
            std::fs::read(whole).unwrap(),
            std::fs::read(partial).unwrap(),
        );

        // the envelope is read past, and the partial state we write is 0.1.161's
        let mut ours = memory(&cfg);
        ours.state_read(&whole, 0, ReadOptions::default(), None)
            .unwrap_or_else(|e| panic!("{model}: {e}"));
        let mut again = seq_data_envelope(0).to_vec();
        again.extend(
            ours.state_write(0, &WriteOptions::of_layout(Layout::StreamsRot), None)
                .unwrap(),
        );
        assert!(again == whole, "{model}: the whole state differs");
        let mut ours_partial = seq_data_envelope(0).to_vec();
        ours_partial.extend(ours.state_write_partial(0, Layout::StreamsRot).unwrap());
        assert!(
            ours_partial == partial,
            "{model}: the partial state differs"
        );

        // our partial state into both sides' fresh memories: the same cells
        ok(&mut oracle, "clear");
        let mine = dir.join("mine.bin");
        std::fs::write(&mine, &ours_partial).unwrap();
        ok(&mut oracle, &format!("undump {}", mine.display()));
        let theirs = ok(&mut oracle, "loadp 1");
        let mut fresh = memory(&cfg);
        let opts = ReadOptions {
            partial: true,
            ..ReadOptions::default()
        };
        fresh
            .state_read(&ours_partial, 1, opts, None)
            .unwrap_or_else(|e| panic!("{model}: {e}"));
        let pos = |s: i32| {
            (
                fresh.seq_pos_min(s).unwrap() as i64,
                fresh.seq_pos_max(s).unwrap() as i64,
            )
        };
        assert_eq!(
            theirs.pos,
            vec![pos(0), pos(1)],
            "{model}: positions after the partial read"
        );
        let used: Vec<u32> = fresh.parts().iter().map(|p| p.used_cells).collect();
        eprintln!("{model}: partial read placed {used:?} cells per part, as 0.1.161");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A hybrid's recurrent part declares every model layer even when the sequence holds nothing
/// (0.1.161 always writes its data header); ours declared only its own layers then, so an
/// empty sequence's state differed from 0.1.161's, and 0.1.161's did not read back.
#[test]
fn regression_an_empty_sequence_state_of_a_hybrid_declared_the_recurrent_layers_only() {
    let dir = std::env::temp_dir().join(format!("today-empty-state-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for model in [
        "jamba.gguf",
        "lfm2-swa.gguf",
        "qwen35.gguf",
        "nemotron-h.gguf",
        "falcon-h1.gguf",
    ] {
        let cfg = config(model);
        let mut oracle = Oracle::start(&cfg, &models_dir()).unwrap();
        let theirs = dir.join("empty.bin");
        ok(&mut oracle, "save 1");
        ok(&mut oracle, &format!("dump {}", theirs.display()));
        let theirs = std::fs::read(theirs).unwrap();
        let mut ours = memory(&cfg);
        let mut written = seq_data_envelope(1).to_vec();
        written.extend(
            ours.state_write(1, &WriteOptions::of_layout(Layout::StreamsRot), None)
                .unwrap(),
        );
        assert!(written == theirs, "{model}: the empty state differs");
        ours.state_read(&theirs, 1, ReadOptions::default(), None)
            .unwrap_or_else(|e| panic!("{model}: {e}"));
    }
    let _ = std::fs::remove_dir_all(&dir);
}
