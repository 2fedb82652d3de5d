//! The inputs that crash llama.cpp 0.1.103 (and that the generator therefore never sends to
//! it), applied to our cache: each is handled cleanly, with an error or a defined result.

use conformance::seed::model::ModelKind;
use conformance::seed::ours::Ours;
use conformance::seed::trace::{Config, Op, Tok};
use llama_kv_cache::{
    CacheParams, GgmlType, KvError, Layout, ReadOptions, RopeParams, RopeType, SeedCache,
    ShiftParams, UBatch,
};

fn mamba(n_seq_max: u32) -> Config {
    Config {
        model: ModelKind::Mamba,
        type_k: GgmlType::F32,
        type_v: GgmlType::F32,
        ..Config::llama_h16(256, n_seq_max, 512, 64)
    }
}

fn tokens(seq: i32, p0: i32, n: i32) -> Vec<Tok> {
    (p0..p0 + n)
        .map(|pos| Tok {
            token: 300,
            pos,
            seqs: vec![seq],
        })
        .collect()
}

fn apply(o: &mut Ours, op: Op) -> i64 {
    o.apply(&op, None).expect("our cache handles it").ret
}

fn shift() -> ShiftParams {
    ShiftParams {
        rope: RopeParams::new(16, 16, 2, RopeType::Norm),
        per_layer: Vec::new(),
    }
}

#[test]
fn crash1_zero_cell_sequence_restore_is_a_clean_no_op() {
    let mut o = Ours::new(&Config::llama_h16(64, 2, 512, 64)).unwrap();
    apply(&mut o, Op::Decode(tokens(0, 0, 5)));
    // the state of the empty sequence 1, restored into sequence 0 (llama.cpp: SIGSEGV)
    apply(&mut o, Op::SeqGet { seq: 1, slot: 0 });
    let blob = o.slot(0).unwrap().clone();
    assert_eq!(&blob[..4], &[0, 0, 0, 0]);
    let summary = o
        .cache
        .state_read(&blob, 0, ReadOptions::default(), None)
        .unwrap();
    assert_eq!(summary.cells, 0);
    assert_eq!(
        o.cache.seq_cell_count(0).unwrap(),
        0,
        "the target is emptied"
    );
    assert_eq!(o.cache.used_cells(), 0);
}

#[test]
fn crash1_llama_cpp_zero_cell_blob_does_not_touch_the_cache() {
    // what llama.cpp 0.1.103 writes for an empty sequence: cell_count 0 and the data headers
    let mut blob = Vec::new();
    blob.extend(0u32.to_le_bytes());
    blob.extend(1u32.to_le_bytes());
    blob.extend(2u32.to_le_bytes());
    for _ in 0..2 {
        blob.extend(1i32.to_le_bytes());
        blob.extend(64u64.to_le_bytes());
    }
    for _ in 0..2 {
        blob.extend(1i32.to_le_bytes());
        blob.extend(2u32.to_le_bytes());
        blob.extend(32u32.to_le_bytes());
    }
    let mut o = Ours::new(&Config::llama_h16(64, 2, 512, 64)).unwrap();
    apply(&mut o, Op::Decode(tokens(0, 0, 5)));
    let before = o.observe();
    let opts = ReadOptions {
        layout: Some(Layout::Seed),
        allow_scattered: false,
        part: None,
        partial: false,
    };
    // accepted (empties seq 0) or refused (divergence D1): either way no crash, and a refusal
    // changes nothing
    match o.cache.state_read(&blob, 0, opts, None) {
        Ok(s) => assert_eq!(s.cells, 0),
        Err(_) => assert_eq!(o.observe(), before),
    }
}

#[test]
fn crash2_kshift_with_head_near_the_end_applies() {
    // kv 64, n_ubatch 64: llama.cpp aborts in the reserve after any K-shift with head > 0
    let mut o = Ours::new(&Config::llama_h16(64, 1, 512, 64)).unwrap();
    apply(&mut o, Op::Decode(tokens(0, 0, 40)));
    apply(&mut o, Op::Decode(tokens(0, 40, 20)));
    assert_eq!(o.cache.head(), 40);
    // seq_div leaves head alone: 0.1.103 then reserves 64 rows at cell 40 of 64 and aborts
    apply(&mut o, Op::SeqDiv(0, 0, 40, 2));
    assert!(o.cache.has_shift());
    assert_eq!(o.cache.head(), 40);
    apply(&mut o, Op::Update);
    assert!(!o.cache.has_shift());
    assert_eq!(o.observe().pos[39], 19, "positions divided, deltas applied");
    assert_eq!(o.cache.seq_pos_max(0).unwrap(), 59);
}

#[test]
fn crash2_defrag_that_moves_head_past_the_reserve_applies() {
    // the reference's example: kv 64, n_ubatch 64, a defrag that sets head = n_used = 2
    let mut o = Ours::new(&Config::llama_h16(64, 2, 512, 64)).unwrap();
    apply(&mut o, Op::Decode(tokens(0, 0, 30)));
    apply(&mut o, Op::Decode(tokens(1, 0, 2)));
    apply(&mut o, Op::SeqRm(0, -1, -1));
    apply(&mut o, Op::Defrag);
    apply(&mut o, Op::Update);
    assert_eq!(o.cache.head(), 2);
    let v = o.observe();
    assert_eq!(v.seqs[0], vec![1]);
    assert_eq!(v.seqs[1], vec![1]);
    assert_eq!(o.cache.used_cells(), 2);
    // and the next decode goes on from there
    assert_eq!(apply(&mut o, Op::Decode(tokens(1, 2, 8))), 0);
}

#[test]
fn crash3_recurrent_restore_into_a_live_sequence_with_every_cell_used() {
    let mut o = Ours::new(&mamba(2)).unwrap();
    let mut t = tokens(0, 0, 1);
    t.extend(tokens(1, 0, 1));
    apply(&mut o, Op::Decode(t));
    apply(&mut o, Op::SeqGet { seq: 0, slot: 0 });
    assert_eq!(o.cache.used_cells(), 2);
    // llama.cpp: seq_rm keeps the cell, find_slot asserts on a non-empty "empty" cell
    let ret = apply(&mut o, Op::SeqSet { slot: 0, dst: 1 });
    assert!(ret > 0);
    let v = o.observe();
    assert_eq!(v.token_count, 2, "seq 1 holds exactly one state cell");
    assert_eq!(o.cache.seq_cell_count(1).unwrap(), 1);
}

#[test]
fn crash3_recurrent_decode_after_seq_rm_with_every_cell_used() {
    let mut o = Ours::new(&mamba(2)).unwrap();
    let mut t = tokens(0, 0, 1);
    t.extend(tokens(1, 0, 1));
    apply(&mut o, Op::Decode(t));
    assert_eq!(apply(&mut o, Op::SeqRm(1, -1, -1)), 1);
    assert_eq!(
        o.cache.used_cells(),
        1,
        "the seed frees the removed state's cell"
    );
    assert_eq!(apply(&mut o, Op::Decode(tokens(1, 0, 3))), 0);
    assert_eq!(o.cache.used_cells(), 2);
}

#[test]
fn crash4_more_new_sequences_than_empty_cells() {
    // the reference's example: 3-seq cache, seq 2 removed, then one token each for 0, 1, 2
    let mut o = Ours::new(&mamba(3)).unwrap();
    let step = |p: i32| -> Vec<Tok> { (0..3).flat_map(|s| tokens(s, p, 1)).collect() };
    apply(&mut o, Op::Decode(step(0)));
    apply(&mut o, Op::SeqRm(2, -1, -1));
    assert_eq!(apply(&mut o, Op::Decode(step(1))), 0);
    let v = o.observe();
    assert_eq!(v.view_used, 3);
    for s in 0..3 {
        assert_eq!(o.cache.seq_cell_count(s).unwrap(), 1);
    }
}

#[test]
fn recurrent_find_slot_without_a_free_cell_fails_without_changes() {
    let mut p = CacheParams::new(2, 1, 0, 0);
    p.n_embd_k_s = 4;
    p.n_embd_v_s = 4;
    p.recurrent = true;
    p.n_seq_max = 2;
    p.type_k = GgmlType::F32;
    p.type_v = GgmlType::F32;
    let mut c = SeedCache::new(p).unwrap();
    let ub = UBatch {
        pos: vec![0, 0],
        n_seq_tokens: 1,
        seq_ids: vec![vec![0], vec![1]],
        ext: Vec::new(),
    };
    c.find_slot(&ub).unwrap().unwrap();
    c.seq_cp(0, 1, -1, -1).unwrap();
    // both sequences share cell 0; cell 1 is free; a third state cannot exist
    let before: Vec<_> = (0..2).map(|i| c.cell(i).unwrap()).collect();
    let ub = UBatch {
        pos: vec![1, 1],
        n_seq_tokens: 1,
        seq_ids: vec![vec![0], vec![1]],
        ext: Vec::new(),
    };
    if c.find_slot(&ub).unwrap().is_none() {
        let after: Vec<_> = (0..2).map(|i| c.cell(i).unwrap()).collect();
        assert_eq!(before, after);
    }
}

#[test]
fn seq_div_by_zero_or_negative_is_refused_and_changes_nothing() {
    let mut o = Ours::new(&Config::llama_h16(64, 1, 512, 64)).unwrap();
    apply(&mut o, Op::Decode(tokens(0, 0, 10)));
    let before = o.observe();
    for d in [0, -2] {
        let err = o.cache.seq_div(0, 0, -1, d).unwrap_err();
        assert!(matches!(err, KvError::InvalidArg(_)), "{err}");
        assert!(o.apply(&Op::SeqDiv(0, 0, -1, d), None).is_err());
    }
    assert_eq!(o.observe(), before);
    assert!(!o.cache.has_shift());
}

#[test]
fn batches_larger_than_n_batch_or_the_cache_are_refused() {
    let cfg = Config::llama_h16(32, 1, 512, 64);
    let mut o = Ours::new(&cfg).unwrap();
    // n_batch is 64 (raised to GGML_KQ_MASK_PAD): 65 tokens abort llama.cpp
    assert!(o.apply(&Op::Decode(tokens(0, 0, 65)), None).is_err());
    // 64 tokens in one ubatch do not fit 32 cells: an ordinary failure
    assert_eq!(apply(&mut o, Op::Decode(tokens(0, 0, 64))), 1);
    assert_eq!(o.cache.used_cells(), 0);
    let mut c = SeedCache::new(CacheParams::new(8, 1, 8, 8)).unwrap();
    assert!(c.find_slot(&UBatch::sequence(0, 0, 9)).unwrap().is_none());
    assert_eq!(c.used_cells(), 0);
}

#[test]
fn kshift_on_a_recurrent_cache_is_an_error_not_an_abort() {
    let o = Ours::new(&mamba(2)).unwrap();
    let mut c = o.cache;
    assert!(!c.can_shift());
    assert!(c.apply_shift(&shift()).is_err());
}

#[test]
fn recurrent_state_lost_by_the_gather_is_refused_not_crashed() {
    // traces/mamba-gather-loses-a-state.trace: both sides lose seq 4's state in op 4; a further
    // decode of seq 4 aborts llama.cpp 0.1.103 (GGML_ASSERT(cell.has_seq_id(seq_id)))
    let text = include_str!("../traces/mamba-gather-loses-a-state.trace");
    let trace = conformance::seed::run::load_trace(text).unwrap();
    let mut o = Ours::new(&trace.config).unwrap();
    for op in &trace.ops {
        o.apply(op, None).unwrap();
    }
    assert_eq!(o.cache.seq_cell_count(4).unwrap(), 0);
    let before = o.observe();
    let slot = o.cache.find_slot(&UBatch::sequence(4, 4, 1)).unwrap();
    assert!(slot.is_none(), "the stale tail makes the placement fail");
    assert_eq!(o.observe(), before, "a failed placement changes nothing");
    // removing the sequence clears the stale tail; it can then start again
    o.cache.seq_rm(4, -1, -1).unwrap();
    assert!(o
        .cache
        .find_slot(&UBatch::sequence(4, 0, 1))
        .unwrap()
        .is_some());
}
