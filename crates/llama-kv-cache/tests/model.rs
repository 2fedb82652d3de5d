//! Property tests: random operation sequences applied to the cache and to a deliberately simple
//! model of the seed (`common/reference.rs`), compared after every step.

mod common;

use common::reference::RefCache;
use llama_kv_cache::{CacheParams, SeedCache, UBatch};
use proptest::prelude::*;

const N_SEQ: i32 = 4;

#[derive(Clone, Debug)]
enum Op {
    Place {
        pos: Vec<i32>,
        seqs: Vec<Vec<i32>>,
        n_seq_tokens: usize,
    },
    Rm(i32, i32, i32),
    Cp(i32, i32, i32, i32),
    Keep(i32),
    Add(i32, i32, i32, i32),
    Div(i32, i32, i32, i32),
    Clear,
    /// A decode: a restorer taken, ubatches placed and saved, then rolled back or kept.
    Decode(Vec<Op>, bool),
}

fn seq_list() -> impl Strategy<Value = Vec<i32>> {
    prop::collection::btree_set(0..N_SEQ, 1..=2).prop_map(|s| s.into_iter().collect())
}

fn transformer_op() -> impl Strategy<Value = Op> {
    let range = (-1..40i32, -1..48i32);
    prop_oneof![
        4 => place_op(48),
        2 => (-1..N_SEQ, range.clone()).prop_map(|(s, (a, b))| Op::Rm(s, a, b)),
        1 => (0..N_SEQ, 0..N_SEQ, range.clone()).prop_map(|(s, d, (a, b))| Op::Cp(s, d, a, b)),
        1 => (0..N_SEQ).prop_map(Op::Keep),
        2 => (-1..N_SEQ, range.clone(), -20..20i32).prop_map(|(s, (a, b), d)| Op::Add(s, a, b, d)),
        1 => (-1..N_SEQ, range, 1..4i32).prop_map(|(s, (a, b), d)| Op::Div(s, a, b, d)),
        1 => Just(Op::Clear),
        2 => (prop::collection::vec(place_op(48), 1..4), any::<bool>()).prop_map(|(p, r)| Op::Decode(p, r)),
    ]
}

fn place_op(max_pos: i32) -> impl Strategy<Value = Op> {
    prop::collection::vec((0..max_pos, seq_list()), 1..6).prop_map(|toks| {
        let (pos, seqs) = toks.into_iter().unzip();
        Op::Place {
            pos,
            seqs,
            n_seq_tokens: 1,
        }
    })
}

fn big_transformer_op() -> impl Strategy<Value = Op> {
    let range = (-1..150i32, -1..160i32);
    prop_oneof![
        5 => (prop::collection::vec((0..160i32, seq_list()), 1..40)).prop_map(|toks| {
            let (pos, seqs) = toks.into_iter().unzip();
            Op::Place { pos, seqs, n_seq_tokens: 1 }
        }),
        3 => (-1..N_SEQ, range.clone()).prop_map(|(s, (a, b))| Op::Rm(s, a, b)),
        1 => (0..N_SEQ, 0..N_SEQ, range.clone()).prop_map(|(s, d, (a, b))| Op::Cp(s, d, a, b)),
        1 => (0..N_SEQ).prop_map(Op::Keep),
        2 => (0..N_SEQ, range.clone(), -60..60i32).prop_map(|(s, (a, b), d)| Op::Add(s, a, b, d)),
        1 => (0..N_SEQ, range, 1..4i32).prop_map(|(s, (a, b), d)| Op::Div(s, a, b, d)),
    ]
}

/// Long runs of one sequence (as prompts are placed) mixed with scattered tokens, in caches of
/// several 4,096-cell groups: exercises the per-word and per-group position bounds that range
/// operations use to skip cells, loose bounds included.
fn group_spanning_op() -> impl Strategy<Value = Op> {
    let range = (-1..3000i32, -1..3200i32);
    prop_oneof![
        4 => (seq_list(), 0..3000i32, 1..700i32).prop_map(|(seqs, p0, n)| Op::Place {
            pos: (p0..p0 + n).collect(),
            seqs: vec![seqs; n as usize],
            n_seq_tokens: 1,
        }),
        2 => (prop::collection::vec((0..3000i32, seq_list()), 1..40)).prop_map(|toks| {
            let (pos, seqs) = toks.into_iter().unzip();
            Op::Place { pos, seqs, n_seq_tokens: 1 }
        }),
        3 => (-1..N_SEQ, range.clone()).prop_map(|(s, (a, b))| Op::Rm(s, a, b)),
        2 => (0..N_SEQ, 0..N_SEQ, range.clone()).prop_map(|(s, d, (a, b))| Op::Cp(s, d, a, b)),
        1 => (0..N_SEQ).prop_map(Op::Keep),
        3 => (0..N_SEQ, range.clone(), -1500..1500i32).prop_map(|(s, (a, b), d)| Op::Add(s, a, b, d)),
        2 => (0..N_SEQ, range, 1..5i32).prop_map(|(s, (a, b), d)| Op::Div(s, a, b, d)),
    ]
}

fn recurrent_place() -> impl Strategy<Value = Op> {
    (
        prop::collection::btree_set(0..N_SEQ, 1..=3),
        1..4usize,
        0..30i32,
        prop::option::of(0..N_SEQ),
    )
        .prop_map(|(firsts, len, p0, extra)| {
            let firsts: Vec<i32> = firsts.into_iter().collect();
            let seqs: Vec<Vec<i32>> = firsts
                .iter()
                .enumerate()
                .map(|(g, &s)| {
                    match extra {
                        // a group shared with another sequence (not a first id of another group)
                        Some(e) if g == 0 && !firsts.contains(&e) => vec![s, e],
                        _ => vec![s],
                    }
                })
                .collect();
            let pos = seqs
                .iter()
                .flat_map(|_| (0..len as i32).map(move |k| p0 + k))
                .collect();
            Op::Place {
                pos,
                seqs,
                n_seq_tokens: len,
            }
        })
}

fn recurrent_op() -> impl Strategy<Value = Op> {
    let range = (-1..40i32, -1..48i32);
    prop_oneof![
        4 => recurrent_place(),
        2 => (prop::collection::vec(recurrent_place(), 1..3), any::<bool>()).prop_map(|(p, r)| Op::Decode(p, r)),
        2 => (-1..N_SEQ, range.clone()).prop_map(|(s, (a, b))| Op::Rm(s, a, b)),
        1 => (0..N_SEQ, 0..N_SEQ).prop_map(|(s, d)| Op::Cp(s, d, -1, -1)),
        1 => (0..N_SEQ).prop_map(Op::Keep),
        1 => (-1..N_SEQ, range.clone(), -5..5i32).prop_map(|(s, (a, b), d)| Op::Add(s, a, b, d)),
        1 => (-1..N_SEQ, range, 1..4i32).prop_map(|(s, (a, b), d)| Op::Div(s, a, b, d)),
        1 => Just(Op::Clear),
    ]
}

fn apply(cache: &mut SeedCache, model: &mut RefCache, op: &Op) {
    match op {
        Op::Place {
            pos,
            seqs,
            n_seq_tokens,
        } => {
            let ub = UBatch {
                pos: pos.clone(),
                n_seq_tokens: *n_seq_tokens as u32,
                seq_ids: seqs.clone(),
                ext: Vec::new(),
            };
            let got = cache.find_slot(&ub).unwrap().map(|s| s.head);
            let want = model.find_slot(pos, seqs, *n_seq_tokens);
            assert_eq!(got, want, "find_slot result");
        }
        Op::Rm(s, a, b) => assert_eq!(cache.seq_rm(*s, *a, *b).unwrap(), model.seq_rm(*s, *a, *b)),
        Op::Cp(s, d, a, b) => {
            cache.seq_cp(*s, *d, *a, *b).unwrap();
            model.seq_cp(*s, *d, *a, *b);
        }
        Op::Keep(s) => {
            cache.seq_keep(*s).unwrap();
            model.seq_keep(*s);
        }
        Op::Add(s, a, b, d) => {
            cache.seq_add(*s, *a, *b, *d).unwrap();
            model.seq_add(*s, *a, *b, *d);
        }
        Op::Div(s, a, b, d) => {
            cache.seq_div(*s, *a, *b, *d).unwrap();
            model.seq_div(*s, *a, *b, *d);
        }
        Op::Clear => {
            cache.clear().unwrap();
            model.clear();
        }
        Op::Decode(ubatches, rollback) => {
            let mut restorer = cache.slot_restorer();
            let mut reference = model.restorer();
            for ub in ubatches {
                let Op::Place {
                    pos,
                    seqs,
                    n_seq_tokens,
                } = ub
                else {
                    unreachable!("decodes hold placements")
                };
                let ubatch = UBatch {
                    pos: pos.clone(),
                    n_seq_tokens: *n_seq_tokens as u32,
                    seq_ids: seqs.clone(),
                    ext: Vec::new(),
                };
                let slot = cache.find_slot(&ubatch).unwrap();
                let head = model.find_slot(pos, seqs, *n_seq_tokens);
                assert_eq!(slot.map(|s| s.head), head, "find_slot result");
                restorer.save(slot.as_ref());
                let bounds = match (model.recurrent, head) {
                    (false, Some(h)) => (h, h + pos.len() as u32),
                    _ => (0, 0),
                };
                reference.save(head.is_some(), bounds);
                if slot.is_none() {
                    break;
                }
            }
            if *rollback {
                cache.restore_slots(&restorer).unwrap();
                model.restore(&reference);
                assert_eq!(cache.n(), model.n, "n restored");
            }
        }
    }
}

fn compare(cache: &SeedCache, model: &RefCache, step: usize) {
    cache
        .cells()
        .check_consistency()
        .unwrap_or_else(|e| panic!("indexes after step {step}: {e}"));
    for (i, m) in model.cells.iter().enumerate() {
        let c = cache.cell(i as u32).unwrap();
        let seqs: Vec<i32> = c.seqs.iter().map(|s| s as i32).collect();
        let want: Vec<i32> = m.seq.iter().copied().collect();
        assert_eq!(
            (c.pos, c.delta, c.src, c.tail, seqs),
            (m.pos, m.delta, m.src, m.tail, want),
            "cell {i} after step {step}"
        );
    }
    assert_eq!(cache.used_cells(), model.used, "used after step {step}");
    assert_eq!(cache.head(), model.head, "head after step {step}");
    assert_eq!(
        cache.n_tokens(),
        model.n_tokens(),
        "n_tokens after step {step}"
    );
    assert_eq!(
        cache.cell_max(),
        model.cell_max(),
        "cell_max after step {step}"
    );
    assert_eq!(
        cache.has_shift(),
        model.has_shift,
        "has_shift after step {step}"
    );
    for s in 0..N_SEQ {
        assert_eq!(
            cache.seq_pos_max(s).unwrap(),
            model.seq_pos_max(s),
            "seq_pos_max({s}) after step {step}"
        );
    }
    if model.recurrent {
        assert_eq!(cache.n(), model.n, "n after step {step}");
    }
}

fn run(size: u32, recurrent: bool, ops: &[Op]) {
    let mut params = CacheParams::new(size, 1, 8, 8);
    params.n_seq_max = N_SEQ as u32;
    params.recurrent = recurrent;
    let mut cache = SeedCache::new(params).unwrap();
    let mut model = RefCache::new(size, recurrent);
    for (step, op) in ops.iter().enumerate() {
        apply(&mut cache, &mut model, op);
        compare(&cache, &model, step);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn transformer_matches_the_seed_model(size in 8u32..40, ops in prop::collection::vec(transformer_op(), 1..40)) {
        run(size, false, &ops);
    }

    /// Caches spanning several 64-cell bitmap words, with bigger batches: exercises the
    /// word-at-a-time slot search against the seed's cell-by-cell scan.
    #[test]
    fn multi_word_caches_match_the_seed_model(size in 60u32..200, ops in prop::collection::vec(big_transformer_op(), 1..40)) {
        run(size, false, &ops);
    }

    #[test]
    fn recurrent_matches_the_seed_model(size in 4u32..8, ops in prop::collection::vec(recurrent_op(), 1..40)) {
        run(size, true, &ops);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Caches of two and more 4,096-cell index groups, with long runs and shifts of thousands
    /// of positions: range operations that skip words and groups by their position bounds must
    /// still match the seed's scan of every cell.
    #[test]
    fn group_spanning_caches_match_the_seed_model(size in 4100u32..9000, ops in prop::collection::vec(group_spanning_op(), 1..25)) {
        run(size, false, &ops);
    }
}

/// Whole 64-cell words of one sequence take the vectorized paths of `seq_rm`, `seq_cp`,
/// `seq_add` and `seq_div`; a fixed script makes sure each of them runs, with shared cells
/// and cells pushed below 0 sending some words down the cell-by-cell path.
#[test]
fn whole_word_fast_paths_match_the_seed_model() {
    let run_of = |seq: i32, p0: i32, n: i32| Op::Place {
        pos: (p0..p0 + n).collect(),
        seqs: vec![vec![seq]; n as usize],
        n_seq_tokens: 1,
    };
    let ops = [
        run_of(0, 0, 1000),
        run_of(2, 0, 300),
        Op::Cp(0, 1, 64, 900),
        Op::Cp(0, 3, -1, -1),
        Op::Add(2, 0, -1, 7),
        Op::Div(2, -1, -1, 3),
        Op::Rm(3, 128, 640),
        Op::Add(0, 900, -1, -200),
        Op::Add(3, 0, -1, -100),
        Op::Div(0, 0, 512, 2),
        Op::Rm(2, -1, -1),
        run_of(2, 5000, 700),
        Op::Rm(0, 0, 700),
        Op::Cp(2, 0, 5100, 5600),
        Op::Add(2, 5000, 5700, -5000),
        Op::Div(2, 0, -1, 64),
        Op::Keep(1),
    ];
    run(4200, false, &ops);
}

/// A word's position bounds can be loose (a cell at a far position came and went); the whole
/// word paths use bounds instead of reading positions, and must still leave every
/// `seq_pos_max` exact.
#[test]
fn loose_word_bounds_never_leak_into_seq_pos_max() {
    let run_of = |seq: i32, p0: i32, n: i32| Op::Place {
        pos: (p0..p0 + n).collect(),
        seqs: vec![vec![seq]; n as usize],
        n_seq_tokens: 1,
    };
    let ops = [
        run_of(0, 0, 63),
        run_of(0, 5000, 1),
        // freeing by position (seq -1) drops the cell from its sequences without narrowing
        // their bounds
        Op::Rm(-1, 5000, 5001),
        run_of(0, 63, 1),
        // the source word's bounds say up to 5000, its cells stop at 63
        Op::Cp(0, 1, -1, -1),
        run_of(2, 100, 128),
        // a whole word moved above the sequence's old maximum, whose word stays put
        Op::Add(2, 100, 164, 1000),
        Op::Div(2, 1100, 1164, 2),
        Op::Add(1, -1, -1, 9),
    ];
    run(256, false, &ops);
}
