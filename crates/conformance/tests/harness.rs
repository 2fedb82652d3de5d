//! The harness itself, without llama.cpp: splits, restore emulation, generator, blob parser.

use differential::compare::{diff, parse_blob};
use differential::gen::{generate, GenOptions, Scenario};
use differential::gguf::{ensure_model, ModelKind};
use differential::ours::{split_equal, split_simple, Ours};
use differential::trace::{Config, Obs, Op, Tok};

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
    let (d, _) = diff(&obs, &obs, None);
    assert!(d.is_empty());
    let mut other: Obs = obs.clone();
    other.pos[1] = 7;
    other.used += 1;
    let (d, _) = diff(&obs, &other, None);
    assert_eq!(d.len(), 2, "{d:?}");
}

#[test]
fn models_are_written_once_and_look_like_gguf() {
    let dir = std::env::temp_dir().join(format!("differential-models-{}", std::process::id()));
    for kind in [ModelKind::LlamaH16, ModelKind::Mamba] {
        let p = ensure_model(&dir, kind).unwrap();
        let bytes = std::fs::read(&p).unwrap();
        assert_eq!(&bytes[..4], b"GGUF");
        assert_eq!(
            u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]),
            3
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}
