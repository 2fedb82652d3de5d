//! The harness itself, without llama.cpp: splits, restore emulation, generator, blob parser.

use conformance::seed::blob::{compare_obs, parse_blob};
use conformance::seed::gen::{generate, GenOptions, Scenario};
use conformance::seed::model::{ModelKind, N_VOCAB};
use conformance::seed::ours::{split_equal, split_simple, Ours};
use conformance::seed::trace::{Config, Obs, Op, Tok};

fn tok(pos: i32, seqs: &[i32]) -> Tok {
    Tok {
        token: 300,
        pos,
        seqs: seqs.to_vec(),
    }
}

#[test]
fn split_simple_keeps_batch_order_in_chunks() {
    let t: Vec<Tok> = (0..5).map(|p| tok(p, &[p % 2])).collect();
    let ubs = split_simple(&t, 2);
    assert_eq!(ubs.len(), 3);
    assert_eq!(ubs[0].pos, vec![0, 1]);
    assert_eq!(ubs[0].seq_ids, vec![vec![0], vec![1]]);
    assert_eq!(ubs[2].pos, vec![4]);
}

#[test]
fn split_equal_takes_shortest_groups_first_with_equal_lengths() {
    // seq 0: 3 tokens, seq 1: 1 token, given out of order
    let t = vec![tok(1, &[0]), tok(0, &[1]), tok(0, &[0]), tok(2, &[0])];
    let ubs = split_equal(&t, 8).unwrap();
    assert_eq!(ubs.len(), 2);
    assert_eq!(
        (ubs[0].n_seq_tokens, ubs[0].seq_ids.clone()),
        (1, vec![vec![1], vec![0]])
    );
    assert_eq!(ubs[0].pos, vec![0, 0]);
    assert_eq!((ubs[1].n_seq_tokens, ubs[1].pos.clone()), (2, vec![1, 2]));
}

#[test]
fn split_equal_gives_shared_prompts_their_own_ubatch() {
    let t = vec![tok(0, &[2]), tok(0, &[0, 1]), tok(1, &[0, 1])];
    let ubs = split_equal(&t, 8).unwrap();
    assert_eq!(ubs[0].seq_ids, vec![vec![0, 1]]);
    assert_eq!(ubs[0].pos, vec![0, 1]);
    assert_eq!(ubs[1].seq_ids, vec![vec![2]]);
}

#[test]
fn split_equal_refuses_ambiguous_duplicates() {
    assert!(split_equal(&[tok(3, &[0]), tok(3, &[0])], 4).is_err());
}

#[test]
fn failed_decode_rolls_back_earlier_ubatches_and_keeps_pending_ranges() {
    let mut o = Ours::new(&Config::llama_h16(32, 2, 512, 8)).unwrap();
    let t: Vec<Tok> = (0..20).map(|p| tok(p, &[0])).collect();
    assert_eq!(o.apply(&Op::Decode(t), None).unwrap().ret, 0);
    // 16 tokens: two ubatches of 8; only 12 cells are free, so the second fails
    let t: Vec<Tok> = (0..16).map(|p| tok(p, &[1])).collect();
    let obs = o.apply(&Op::Decode(t), None).unwrap();
    assert_eq!(obs.ret, 1);
    assert_eq!(obs.used, 20, "the first ubatch's cells are emptied again");
    assert_eq!(
        o.pending,
        vec![(20, 28)],
        "restore() leaves the pending ranges in place"
    );
    assert!(o.limit.is_none());
    assert_eq!(o.cov.failed_later_ubatch, 1);
}

#[test]
fn generator_is_deterministic_and_stays_off_crash_inputs() {
    for seed in 0..60u64 {
        let a = generate(seed, GenOptions::default());
        let b = generate(seed, GenOptions::default());
        assert_eq!(a.ops, b.ops, "seed {seed}");
        assert_eq!(
            a.scenario,
            Scenario::ALL[seed as usize % Scenario::ALL.len()].name()
        );
        for op in &a.ops {
            match op {
                Op::Decode(t) => {
                    assert!(
                        !t.is_empty() && t.len() as u32 <= a.config.eff_n_batch(),
                        "seed {seed}"
                    )
                }
                Op::SeqDiv(_, _, _, d) => assert!(*d > 0, "seed {seed}"),
                _ => {}
            }
            // round trip through the text format
            assert_eq!(&Op::parse(&op.to_string()).unwrap(), op);
        }
    }
}

#[test]
fn blob_parser_reads_our_state_and_the_diff_sees_changes() {
    let mut o = Ours::new(&Config::llama_h16(64, 2, 512, 64)).unwrap();
    o.apply(&Op::Decode(vec![tok(0, &[0, 1]), tok(1, &[1])]), None)
        .unwrap();
    let obs = o.apply(&Op::StateGet { slot: 0 }, None).unwrap();
    let blob = parse_blob(obs.blob.as_ref().unwrap()).unwrap();
    assert_eq!(blob.cells, vec![(0, vec![0, 1]), (1, vec![1])]);
    assert_eq!(blob.k.len(), 2);
    assert_eq!(blob.trailing, 0);
    let (d, _) = compare_obs(&obs, &obs, None);
    assert!(d.is_empty());
    let mut other: Obs = obs.clone();
    other.pos[1] = 7;
    other.used += 1;
    let (d, _) = compare_obs(&obs, &other, None);
    assert_eq!(d.len(), 2, "{d:?}");
}

/// The seed's models come from `interop/make_models.py` with every other model: the shapes
/// the differential derives llama.cpp's numbers from must be the files' own.
#[test]
fn models_come_from_make_models_with_the_shapes_the_differential_assumes() {
    for kind in ModelKind::ALL {
        let path = kind.path().unwrap_or_else(|e| panic!("{e}"));
        let read = llama_kv_cache::model::gguf::read_file(&path, false).unwrap();
        let h = &read.header;
        let name = kind.file_name();
        let arch = h.get("general.architecture").and_then(|v| v.as_str());
        let arch = arch.unwrap_or_else(|| panic!("{name}: no architecture"));
        assert_eq!(
            arch == "mamba",
            kind.recurrent(),
            "{name}: architecture {arch}"
        );
        let layers = h
            .get(&format!("{arch}.block_count"))
            .and_then(|v| v.as_int());
        assert_eq!(layers, Some(i128::from(kind.n_layer())), "{name}: layers");
        assert_eq!(h.tensors.len() as u32, kind.n_tensors(), "{name}: tensors");
        match h.get("tokenizer.ggml.tokens") {
            Some(llama_kv_cache::model::gguf::GgufValue::Array { len, .. }) => {
                assert_eq!(*len as usize, N_VOCAB, "{name}: vocabulary")
            }
            other => panic!("{name}: tokens {other:?}"),
        }
        if !kind.recurrent() {
            let info = llama_kv_cache::ModelInfo::from_file(&path, false).unwrap();
            assert_eq!(
                info.n_embd_head_k as usize,
                kind.head_dim(),
                "{name}: head_dim"
            );
            for layer in &info.layers {
                assert_eq!(layer.n_head_kv as usize, kind.n_head_kv(), "{name}");
                let (k, v) = kind.kv_widths();
                assert_eq!((layer.n_embd_k_gqa, layer.n_embd_v_gqa), (k, v), "{name}");
            }
        }
    }
}
