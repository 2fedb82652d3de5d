//! Behaviour of the cache's operations, one concept per test, plus llama.node-style scenarios.

use llama_kv_cache::{
    CacheParams, GgmlType, KvError, PrepareOptions, RopeParams, RopeType, SeedCache, ShiftParams,
    Tensor, UBatch,
};

fn cache(size: u32, n_seq: u32) -> SeedCache {
    let mut p = CacheParams::new(size, 2, 8, 8);
    p.n_seq_max = n_seq;
    SeedCache::new(p).unwrap()
}

fn recurrent_cache(size: u32, n_seq: u32) -> SeedCache {
    let mut p = CacheParams::new(size, 1, 8, 8);
    p.recurrent = true;
    p.n_seq_max = n_seq;
    SeedCache::new(p).unwrap()
}

fn place(c: &mut SeedCache, seq: i32, p0: i32, n: u32) -> u32 {
    c.find_slot(&UBatch::sequence(seq, p0, n))
        .unwrap()
        .unwrap()
        .head
}

#[test]
fn find_slot_places_contiguously_from_head_and_wraps() {
    let mut c = cache(8, 2);
    assert_eq!(place(&mut c, 0, 0, 3), 0);
    assert_eq!(c.head(), 0, "the seed leaves head at the slot start");
    assert_eq!(place(&mut c, 0, 3, 3), 3);
    c.seq_rm(0, 0, 2).unwrap();
    assert_eq!(c.head(), 0);
    // cells 6,7 are free but too short for 3 tokens: the search wraps to 0
    c.seq_rm(0, 0, 1).unwrap();
    assert_eq!(place(&mut c, 1, 0, 2), 0);
}

#[test]
fn find_slot_fails_without_a_contiguous_run_and_leaves_cells_alone() {
    let mut c = cache(8, 2);
    place(&mut c, 0, 0, 8);
    c.seq_rm(0, 1, 2).unwrap();
    c.seq_rm(0, 5, 6).unwrap();
    let before: Vec<_> = (0..8).map(|i| c.cell(i).unwrap()).collect();
    assert!(c.find_slot(&UBatch::sequence(1, 0, 2)).unwrap().is_none());
    let after: Vec<_> = (0..8).map(|i| c.cell(i).unwrap()).collect();
    assert_eq!(before, after);
    assert_eq!(c.used_cells(), 6);
    assert!(c.find_slot(&UBatch::sequence(1, 0, 9)).unwrap().is_none());
}

#[test]
fn place_is_find_slot_for_each_ubatch_all_or_none() {
    let ubs = [
        UBatch::sequence(0, 0, 3),
        UBatch::sequence(1, 0, 2),
        UBatch::sequence(0, 3, 2),
    ];
    // the slots find_slot gives one after the other
    let mut one_by_one = cache(8, 2);
    let slots: Vec<_> = ubs
        .iter()
        .map(|ub| one_by_one.find_slot(ub).unwrap().unwrap())
        .collect();
    let mut c = cache(8, 2);
    assert_eq!(c.place(&ubs).unwrap(), Some(slots));
    assert_eq!(c.cells(), one_by_one.cells());
    assert_eq!((c.head(), c.n()), (one_by_one.head(), one_by_one.n()));
    // a decode whose last ubatch does not fit places nothing, and neither does a malformed one
    let before = (c.cells().clone(), c.head(), c.n());
    let too_long = [UBatch::sequence(1, 2, 2), UBatch::sequence(1, 4, 4)];
    assert_eq!(c.place(&too_long).unwrap(), None);
    assert_eq!((c.cells().clone(), c.head(), c.n()), before);
    let malformed = [UBatch::sequence(1, 2, 1), UBatch::sequence(7, 0, 1)];
    assert!(matches!(c.place(&malformed), Err(KvError::OutOfRange(_))));
    assert_eq!((c.cells().clone(), c.head(), c.n()), before);
    // a recurrent cache: each sequence's tokens as one group, in its state cell
    let group = |seq: i32, n: i32| UBatch {
        pos: (0..n).collect(),
        n_seq_tokens: n as u32,
        seq_ids: vec![vec![seq]],
        ext: Vec::new(),
    };
    let mut r = recurrent_cache(2, 2);
    let placed = r.place(&[group(0, 4), group(1, 2)]);
    assert_eq!(placed.unwrap().map(|s| s.len()), Some(2));
    assert_eq!(
        (r.seq_pos_max(0).unwrap(), r.seq_pos_max(1).unwrap()),
        (3, 1)
    );
}

#[test]
fn a_token_can_belong_to_several_sequences() {
    let mut c = cache(8, 3);
    let ub = UBatch::per_token(vec![0, 1], vec![vec![0, 2], vec![1]]);
    c.find_slot(&ub).unwrap().unwrap();
    assert_eq!(c.n_tokens(), 3);
    assert_eq!(c.used_cells(), 2);
    assert_eq!(
        c.cell(0).unwrap().seqs.iter().collect::<Vec<_>>(),
        vec![0, 2]
    );
}

#[test]
fn malformed_ubatches_are_errors_and_change_nothing() {
    let mut c = cache(8, 2);
    let bad = [
        UBatch::per_token(vec![0, 1], vec![vec![0]]),
        UBatch::per_token(vec![-1], vec![vec![0]]),
        UBatch::per_token(vec![0], vec![vec![2]]),
        UBatch::per_token(vec![0], vec![vec![]]),
        UBatch::per_token(vec![], vec![]),
    ];
    for ub in &bad {
        assert!(c.find_slot(ub).is_err(), "{ub:?}");
    }
    assert_eq!(c.used_cells(), 0);
}

#[test]
fn seq_rm_with_negative_seq_clears_the_range_for_everyone() {
    let mut c = cache(8, 2);
    place(&mut c, 0, 0, 4);
    c.seq_cp(0, 1, -1, -1).unwrap();
    assert!(c.seq_rm(-1, 2, -1).unwrap());
    assert_eq!(c.used_cells(), 2);
    assert_eq!(c.seq_pos_max(1).unwrap(), 1);
}

#[test]
fn seq_rm_lowers_head_to_the_first_freed_cell() {
    let mut c = cache(16, 1);
    place(&mut c, 0, 0, 8);
    c.prepare_batch(&UBatch::sequence(0, 8, 2), PrepareOptions::default())
        .unwrap();
    assert_eq!(c.head(), 10);
    c.seq_rm(0, 3, 5).unwrap();
    assert_eq!(c.head(), 3);
}

#[test]
fn seq_ids_out_of_range_are_errors() {
    let mut c = cache(8, 2);
    assert!(matches!(c.seq_rm(2, 0, 1), Err(KvError::OutOfRange(_))));
    assert!(matches!(c.seq_rm(-2, 0, 1), Err(KvError::OutOfRange(_))));
    assert!(c.seq_cp(0, 5, 0, 1).is_err());
    assert!(c.seq_keep(-1).is_err());
    assert!(c.seq_add(7, 0, 1, 1).is_err());
    assert!(c.seq_pos_max(9).is_err());
    assert!(matches!(c.seq_div(0, 0, 1, 0), Err(KvError::InvalidArg(_))));
    assert!(c.seq_div(0, 0, 1, -2).is_err());
}

#[test]
fn seq_pos_max_of_an_empty_sequence_is_zero_as_in_the_seed() {
    let mut c = cache(8, 2);
    assert_eq!(c.seq_pos_max(1).unwrap(), 0);
    assert_eq!(c.seq_cell_count(1).unwrap(), 0);
    place(&mut c, 1, 5, 2);
    assert_eq!(c.seq_pos_max(1).unwrap(), 6);
}

#[test]
fn seq_add_frees_cells_pushed_below_zero_and_moves_head() {
    let mut c = cache(8, 1);
    place(&mut c, 0, 0, 6);
    c.seq_add(0, 0, 3, -2).unwrap();
    assert_eq!(c.used_cells(), 4);
    assert_eq!(c.head(), 0);
    assert_eq!(c.cell(2).unwrap().pos, 0);
    assert_eq!(c.cell(2).unwrap().delta, -2);
    assert!(c.has_shift());
    // nothing matched: head still goes to 0
    c.prepare_batch(&UBatch::sequence(0, 10, 1), PrepareOptions::default())
        .unwrap();
    assert_ne!(c.head(), 0);
    c.seq_add(0, 100, 200, 5).unwrap();
    assert_eq!(c.head(), 0);
}

#[test]
fn regression_seq_add_and_seq_div_of_seq_minus_one_match_no_cell_and_seq_add_resets_head() {
    // issue 10.9: they threw OutOfRange; llama.cpp's recorded traces call them with -1
    let mut c = cache(8, 2);
    place(&mut c, 0, 0, 3);
    place(&mut c, 1, 0, 2);
    let head = c.head();
    assert_ne!(head, 0);
    let before: Vec<_> = (0..8).map(|i| c.cell(i).unwrap()).collect();
    c.seq_div(-1, 0, -1, 2).unwrap();
    assert_eq!(c.head(), head, "the seed's seq_div never moves the head");
    c.seq_add(-1, 0, -1, 0).unwrap();
    assert_eq!(c.head(), head, "delta 0 returns before the scan");
    c.seq_add(-1, 0, -1, -4).unwrap();
    assert_eq!(c.head(), 0, "the scan matched nothing: head goes to 0");
    let after: Vec<_> = (0..8).map(|i| c.cell(i).unwrap()).collect();
    assert_eq!(before, after);
    assert!(!c.has_shift());
    assert_eq!(c.used_cells(), 5);
    assert!(c.seq_div(-1, 0, 1, 0).is_err(), "d <= 0 stays an error");
    assert!(
        c.seq_add(-2, 0, 1, 1).is_err(),
        "other negative ids stay out of range"
    );
    // a recurrent cache returns before touching anything, head included
    let mut r = recurrent_cache(4, 4);
    r.find_slot(&UBatch::sequence(0, 0, 1)).unwrap().unwrap();
    let recurrent_head = r.head();
    r.seq_add(-1, 0, -1, 3).unwrap();
    r.seq_div(-1, 0, -1, 2).unwrap();
    assert_eq!(r.head(), recurrent_head);
    assert_eq!(r.cell(0).unwrap().pos, 0);
}

#[test]
fn slot_restorer_rolls_back_every_slot_of_a_failed_decode() {
    let mut c = cache(16, 2);
    place(&mut c, 0, 0, 4);
    let (head, n) = (c.head(), c.n());
    let mut r = c.slot_restorer();
    // a decode of two ubatches: the first is placed, the second finds no room
    let first = c
        .prepare_batch(&UBatch::sequence(0, 4, 4), PrepareOptions::default())
        .unwrap();
    r.save(first.as_ref());
    let second = c
        .prepare_batch(&UBatch::sequence(0, 8, 9), PrepareOptions::default())
        .unwrap();
    assert!(second.is_none());
    r.save(second.as_ref());
    assert_eq!(r.boundaries(), &[(4, 8)]);
    assert_eq!(c.used_cells(), 8);
    c.restore_slots(&r).unwrap();
    assert_eq!(c.used_cells(), 4);
    assert_eq!(c.seq_pos_max(0).unwrap(), 3);
    assert_eq!((c.head(), c.n()), (head, n));
    // nothing saved: nothing restored
    let idle = c.slot_restorer();
    place(&mut c, 1, 0, 2);
    c.restore_slots(&idle).unwrap();
    assert_eq!(c.seq_cell_count(1).unwrap(), 2);
}

#[test]
fn slot_restorer_passes_cell_indices_as_positions_like_the_seed() {
    // seq 0 holds positions 100..104 in cells 0..4; a decode places seq 1 at positions 0..3 in
    // cells 4..7 and rolls back: the seed calls seq_rm(-1, 4, 7), which matches positions 4..6
    // (none here), so the placed cells stay
    let mut c = cache(16, 2);
    place(&mut c, 0, 100, 4);
    let mut r = c.slot_restorer();
    let slot = c.find_slot(&UBatch::sequence(1, 0, 3)).unwrap();
    assert_eq!(slot.map(|s| s.head), Some(4));
    r.save(slot.as_ref());
    c.restore_slots(&r).unwrap();
    assert_eq!(c.seq_cell_count(1).unwrap(), 3);
    // and a cell outside the slot whose position falls in the range is removed: seq 0 at
    // position 8 in cell 7, then a slot at cell 8 rolled back with seq_rm(-1, 8, 9)
    assert_eq!(place(&mut c, 0, 8, 1), 7);
    let mut r = c.slot_restorer();
    let slot = c.find_slot(&UBatch::sequence(1, 9, 1)).unwrap();
    assert_eq!(slot.map(|s| s.head), Some(8));
    r.save(slot.as_ref());
    c.restore_slots(&r).unwrap();
    assert_eq!(c.cell(7).unwrap().pos, -1);
    assert_eq!(c.cell(8).unwrap().pos, 9);
    assert_eq!(c.seq_pos_max(0).unwrap(), 103);
}

#[test]
fn slot_restorer_clears_a_recurrent_cache_like_the_seed() {
    let mut c = recurrent_cache(4, 4);
    c.find_slot(&UBatch::sequence(0, 0, 1)).unwrap().unwrap();
    let mut r = c.slot_restorer();
    let ub = UBatch {
        pos: vec![0, 1],
        n_seq_tokens: 2,
        seq_ids: vec![vec![1]],
        ext: Vec::new(),
    };
    let slot = c.find_slot(&ub).unwrap();
    r.save(slot.as_ref());
    assert!(r.armed());
    assert!(r.boundaries().is_empty());
    c.restore_slots(&r).unwrap();
    assert_eq!(
        c.used_cells(),
        0,
        "a recurrent state cannot be partly erased: all cleared"
    );
}

#[test]
fn seq_add_refuses_position_overflow() {
    let mut c = cache(8, 1);
    place(&mut c, 0, i32::MAX - 2, 2);
    assert!(c.seq_add(0, -1, -1, 10).is_err());
    assert_eq!(c.seq_pos_max(0).unwrap(), i32::MAX - 1);
}

#[test]
fn seq_div_records_the_delta_with_the_seed_sign() {
    let mut c = cache(8, 1);
    place(&mut c, 0, 0, 8);
    c.seq_div(0, 4, 8, 2).unwrap();
    assert_eq!(c.cell(7).unwrap().pos, 3);
    assert_eq!(c.cell(7).unwrap().delta, -4);
    // the view shows pos + delta; with the seed's sign that is 3 + (-4), not the old position
    assert_eq!(c.view(4).pos[7], -1);
}

#[test]
fn seq_keep_drops_every_other_sequence() {
    let mut c = cache(8, 3);
    place(&mut c, 0, 0, 2);
    c.seq_cp(0, 1, -1, -1).unwrap();
    place(&mut c, 2, 0, 2);
    c.seq_keep(1).unwrap();
    assert_eq!(c.used_cells(), 2);
    assert_eq!(c.n_tokens(), 2);
    assert_eq!(c.seq_cell_count(0).unwrap(), 0);
    assert_eq!(
        c.head(),
        2,
        "head only moves down, and the first freed cell is the old head"
    );
}

#[test]
fn clear_zeroes_data_and_keeps_deltas_like_the_seed() {
    let mut c = cache(8, 1);
    place(&mut c, 0, 0, 2);
    c.write_rows(0, Tensor::K, 0, &[7u8; 32]).unwrap();
    c.seq_add(0, 0, -1, 3).unwrap();
    c.clear().unwrap();
    assert_eq!(c.used_cells(), 0);
    assert_eq!(c.read_rows(0, Tensor::K, 0, 2).unwrap(), vec![0u8; 32]);
    assert_eq!(c.cell(0).unwrap().delta, 3);
    assert!(c.has_shift());
}

#[test]
fn cell_max_and_pos_max() {
    let mut c = cache(8, 1);
    assert_eq!((c.cell_max(), c.pos_max()), (0, -1));
    place(&mut c, 0, 10, 3);
    assert_eq!((c.cell_max(), c.pos_max()), (3, 12));
}

#[test]
fn prepare_batch_resets_head_sets_n_and_advances() {
    let mut c = cache(300, 1);
    let slot = c
        .prepare_batch(&UBatch::sequence(0, 0, 40), PrepareOptions::default())
        .unwrap()
        .unwrap();
    assert_eq!((slot.head, slot.n), (0, 64));
    assert_eq!(c.head(), 40);
    c.seq_rm(0, 10, -1).unwrap();
    // head 10 > used 10 + 2*... no: 10 > 10 + 2 is false, so no reset
    let slot = c
        .prepare_batch(&UBatch::sequence(0, 10, 1), PrepareOptions::default())
        .unwrap()
        .unwrap();
    assert_eq!(slot.head, 10);
    // far head with few used cells restarts at 0
    let mut c = cache(300, 1);
    place(&mut c, 0, 0, 200);
    c.seq_rm(0, 0, 190).unwrap();
    c.prepare_batch(
        &UBatch::sequence(0, 200, 2),
        PrepareOptions {
            advance_head: false,
        },
    )
    .unwrap();
    assert_eq!(c.head(), 0);
    assert_eq!(c.n(), 224);
}

#[test]
fn llama_node_context_shift_scenario() {
    // llama.node shifts sequence 0 when the context is full: keep n_keep + 1 tokens, discard
    // n_discard after them, slide the rest down
    let (n_ctx, n_keep, n_discard) = (64u32, 4i32, 30i32);
    let mut c = cache(n_ctx, 1);
    place(&mut c, 0, 0, n_ctx);
    let n_cur = n_ctx as i32;
    c.seq_rm(0, n_keep + 1, n_keep + n_discard + 1).unwrap();
    c.seq_add(0, n_keep + 1 + n_discard, n_cur, -n_discard)
        .unwrap();
    assert_eq!(c.used_cells(), n_ctx - n_discard as u32);
    assert_eq!(c.seq_pos_max(0).unwrap(), n_cur - n_discard - 1);
    // positions stay unique and contiguous
    let mut pos: Vec<i32> = (0..n_ctx)
        .map(|i| c.cell(i).unwrap().pos)
        .filter(|&p| p >= 0)
        .collect();
    pos.sort();
    assert_eq!(pos, (0..n_cur - n_discard).collect::<Vec<_>>());
    // the freed run takes the next tokens
    let slot = c
        .prepare_batch(
            &UBatch::sequence(0, n_cur - n_discard, 8),
            PrepareOptions::default(),
        )
        .unwrap()
        .unwrap();
    assert_eq!(slot.head, (n_keep + 1) as u32);
}

#[test]
fn parallel_decoding_scenario() {
    let mut c = cache(256, 4);
    // shared prompt on seq 0, copied to 1..4
    place(&mut c, 0, 0, 20);
    for s in 1..4 {
        c.seq_cp(0, s, -1, -1).unwrap();
    }
    assert_eq!((c.used_cells(), c.n_tokens()), (20, 80));
    // each sequence diverges with its own tokens, one ubatch of 4 per step
    for step in 0..10 {
        let ub = UBatch::per_token(vec![20 + step; 4], (0..4).map(|s| vec![s]).collect());
        c.prepare_batch(&ub, PrepareOptions::default())
            .unwrap()
            .unwrap();
    }
    assert_eq!(c.used_cells(), 60);
    for s in 0..4 {
        assert_eq!(c.seq_pos_max(s).unwrap(), 29);
        assert_eq!(c.seq_cell_count(s).unwrap(), 30);
    }
    // sequence 2 wins: keep it
    c.seq_keep(2).unwrap();
    assert_eq!((c.used_cells(), c.n_tokens()), (30, 30));
    let v = c.view(4);
    assert_eq!(v.used_cells, 30);
    assert!(v.max_contiguous >= 256 - 60);
}

#[test]
fn view_reports_the_largest_empty_run() {
    let mut c = cache(16, 2);
    place(&mut c, 0, 0, 16);
    c.seq_rm(0, 2, 4).unwrap();
    c.seq_rm(0, 8, 13).unwrap();
    let v = c.view(1);
    assert_eq!((v.max_contiguous, v.max_contiguous_idx), (5, 8));
    assert_eq!(v.used_cells, 9);
    assert_eq!(v.seqs[0], vec![0]);
    assert!(v.seqs[2].is_empty());
}

#[test]
fn recurrent_seq_rm_refuses_partial_ranges() {
    let mut c = recurrent_cache(4, 4);
    let ub = UBatch {
        pos: vec![0, 1, 2],
        n_seq_tokens: 3,
        seq_ids: vec![vec![1]],
        ext: Vec::new(),
    };
    c.find_slot(&ub).unwrap().unwrap();
    assert!(!c.seq_rm(1, 1, -1).unwrap());
    assert!(c.seq_rm(1, -1, -1).unwrap());
    assert_eq!(
        c.used_cells(),
        0,
        "the seed frees the cell (0.1.103 would keep it)"
    );
}

#[test]
fn recurrent_placement_fails_cleanly_where_llama_cpp_asserts() {
    // crash 4 of the reference: more new sequences than empty cells
    let mut c = recurrent_cache(3, 3);
    let one_each = UBatch {
        pos: vec![0, 0, 0],
        n_seq_tokens: 1,
        seq_ids: vec![vec![0], vec![1], vec![2]],
        ext: Vec::new(),
    };
    c.find_slot(&one_each).unwrap().unwrap();
    c.seq_cp(0, 2, -1, -1).unwrap(); // seq 2 now shares cell of seq 0; cell of 2 freed
    place_shared_then_fill(&mut c);
}

fn place_shared_then_fill(c: &mut SeedCache) {
    let before: Vec<_> = (0..3).map(|i| c.cell(i).unwrap()).collect();
    // seq 0 and seq 2 both need their own cell, only one is empty
    let ub = UBatch {
        pos: vec![1, 1],
        n_seq_tokens: 1,
        seq_ids: vec![vec![0], vec![2]],
        ext: Vec::new(),
    };
    let _ = c.find_slot(&ub).unwrap();
    let ub = UBatch {
        pos: vec![2, 2, 2],
        n_seq_tokens: 1,
        seq_ids: vec![vec![0], vec![1], vec![2]],
        ext: Vec::new(),
    };
    let r = c.find_slot(&ub).unwrap();
    // either it placed all three in distinct cells, or it failed and restored the cells
    match r {
        Some(_) => {
            let tails: std::collections::BTreeSet<i32> =
                (0..3).map(|s| c.cell(s).unwrap().tail).collect();
            assert_eq!(tails.len(), 3);
        }
        None => assert!(
            (0..3).all(|i| c.cell(i).unwrap().seqs.len() <= 3),
            "{before:?}"
        ),
    }
}

#[test]
fn rows_round_trip_for_every_type_as_raw_bytes() {
    for ty in GgmlType::ALL {
        let mut p = CacheParams::new(8, 2, 64, 64);
        p.type_k = ty;
        p.type_v = ty;
        p.flash_attn = true;
        let mut c = SeedCache::new(p).unwrap();
        let row = c.row_size(1, Tensor::K).unwrap();
        let data: Vec<u8> = (0..row * 3).map(|i| (i * 7 % 251) as u8).collect();
        c.write_rows(1, Tensor::K, 5, &data).unwrap();
        c.write_rows(1, Tensor::V, 2, &data).unwrap();
        assert_eq!(c.read_rows(1, Tensor::K, 5, 3).unwrap(), data, "{ty}");
        assert_eq!(c.read_rows(1, Tensor::V, 2, 3).unwrap(), data, "{ty}");
        assert!(
            c.write_rows(1, Tensor::K, 6, &data).is_err(),
            "past the end"
        );
        assert!(c.write_rows(2, Tensor::K, 0, &data).is_err(), "bad layer");
        assert!(
            c.write_rows(0, Tensor::K, 0, &data[1..]).is_err(),
            "partial row"
        );
    }
}

#[test]
fn f32_rows_round_trip_through_f16_and_transposed_v() {
    let mut c = cache(8, 1);
    let vals: Vec<f32> = (0..16).map(|i| i as f32 * 0.5 - 3.0).collect();
    c.write_rows_f32(0, Tensor::V, 6, &vals).unwrap();
    assert_eq!(c.read_rows_f32(0, Tensor::V, 6, 2).unwrap(), vals);
    assert!(c.write_rows_f32(0, Tensor::V, 0, &vals[..5]).is_err());
}

fn filled_cache(v_trans: bool) -> SeedCache {
    let mut p = CacheParams::new(16, 2, 8, 8);
    p.n_seq_max = 3;
    p.flash_attn = !v_trans;
    let mut c = SeedCache::new(p).unwrap();
    for i in 0..16u32 {
        let seq = (i % 3) as i32;
        c.find_slot(&UBatch::sequence(seq, i as i32, 1))
            .unwrap()
            .unwrap();
        for il in 0..2 {
            let k: Vec<f32> = (0..8).map(|j| (i * 100 + il * 10 + j) as f32).collect();
            let v: Vec<f32> = k.iter().map(|x| -x).collect();
            c.write_rows_f32(il, Tensor::K, i, &k).unwrap();
            c.write_rows_f32(il, Tensor::V, i, &v).unwrap();
        }
    }
    c
}

fn rows_by_pos(c: &SeedCache) -> Vec<(i32, Vec<f32>, Vec<f32>)> {
    let mut out = Vec::new();
    for i in 0..c.size() {
        let cell = c.cell(i).unwrap();
        if cell.seqs.is_empty() {
            continue;
        }
        for il in 0..2 {
            out.push((
                cell.pos * 10 + il as i32,
                c.read_rows_f32(il, Tensor::K, i, 1).unwrap(),
                c.read_rows_f32(il, Tensor::V, i, 1).unwrap(),
            ));
        }
    }
    out.sort_by_key(|r| r.0);
    out
}

#[test]
fn defrag_moves_every_row_with_its_cell() {
    for v_trans in [true, false] {
        let mut c = filled_cache(v_trans);
        c.seq_rm(1, -1, -1).unwrap();
        let before = rows_by_pos(&c);
        c.defrag();
        let report = c.update(None, None).unwrap().defrag.unwrap();
        assert!(report.cells_moved > 0);
        assert_eq!(c.cell_max(), c.used_cells(), "no holes left");
        assert_eq!(rows_by_pos(&c), before, "v_trans {v_trans}");
        assert!(!c.defrag_pending());
    }
}

#[test]
fn defrag_plan_matches_the_seed_for_a_hand_made_case() {
    // cells: A _ _ B C _ D E  (used 5): hole [1,3) gets E, D (last two, moved in index order
    // D->1, E->2 as one run); hole at 5 is beyond used, so the plan stops
    let mut c = cache(8, 1);
    place(&mut c, 0, 0, 8);
    c.seq_rm(0, 1, 3).unwrap();
    c.seq_rm(0, 5, 6).unwrap();
    let moves = c.defrag_plan(65536);
    assert_eq!(
        moves,
        vec![llama_kv_cache::CellMove {
            src: 6,
            dst: 1,
            len: 2
        }]
    );
    assert_eq!(c.head(), 5);
    let pos: Vec<i32> = (0..8).map(|i| c.cell(i).unwrap().pos).collect();
    assert_eq!(pos, vec![0, 6, 7, 3, 4, -1, -1, -1]);
}

#[test]
fn defrag_honours_max_moves() {
    // 2 layers: max_moves = (n - 4) / 12; n = 16 gives 1 run
    let mut c = cache(16, 1);
    place(&mut c, 0, 0, 16);
    for p in [1, 3, 5] {
        c.seq_rm(0, p, p + 1).unwrap();
    }
    let moves = c.defrag_plan(16);
    assert_eq!(moves.len(), 1);
}

#[test]
fn k_shift_rotates_by_the_delta_and_composes() {
    let mut p = CacheParams::new(4, 1, 32, 32);
    p.type_k = GgmlType::F32;
    let rope = ShiftParams {
        rope: RopeParams::new(16, 16, 2, RopeType::Neox),
        per_layer: vec![],
    };
    let k: Vec<f32> = (0..32).map(|i| ((i * 37 % 11) as f32) - 5.0).collect();
    let shifted = |deltas: &[i32]| {
        let mut c = SeedCache::new(p.clone()).unwrap();
        c.find_slot(&UBatch::sequence(0, 10, 1)).unwrap().unwrap();
        c.write_rows_f32(0, Tensor::K, 0, &k).unwrap();
        for &d in deltas {
            c.seq_add(0, -1, -1, d).unwrap();
            c.update(Some(&rope), None).unwrap();
        }
        assert!(!c.has_shift());
        assert_eq!(c.cell(0).unwrap().delta, 0);
        c.read_rows_f32(0, Tensor::K, 0, 1).unwrap()
    };
    let a = shifted(&[-3, -4]);
    let b = shifted(&[-7]);
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() < 1e-4, "{x} vs {y}");
    }
    assert_ne!(a, k);
}

#[test]
fn k_shift_is_refused_by_caches_that_cannot_shift() {
    let mut p = CacheParams::new(4, 1, 32, 32);
    p.can_shift = false;
    let mut c = SeedCache::new(p).unwrap();
    c.find_slot(&UBatch::sequence(0, 10, 1)).unwrap().unwrap();
    c.seq_add(0, -1, -1, -2).unwrap();
    let rope = ShiftParams {
        rope: RopeParams::new(16, 16, 2, RopeType::Norm),
        per_layer: vec![],
    };
    assert!(matches!(
        c.update(Some(&rope), None),
        Err(KvError::Unsupported(_))
    ));
    assert!(c.has_shift(), "still pending after the refusal");
    let report = c.update(None, None).unwrap();
    assert!(report.shift_pending);
}

#[test]
fn k_shift_checks_the_rope_geometry() {
    let mut c = cache(4, 1);
    c.find_slot(&UBatch::sequence(0, 10, 1)).unwrap().unwrap();
    c.seq_add(0, -1, -1, -2).unwrap();
    let rope = ShiftParams {
        rope: RopeParams::new(16, 16, 2, RopeType::Norm),
        per_layer: vec![],
    };
    let err = c.update(Some(&rope), None).unwrap_err();
    assert!(err.to_string().contains("does not match"), "{err}");
}

#[test]
fn regression_reading_zero_rows_of_transposed_v_is_empty_not_a_panic() {
    // the element loop before the tiled transpose took chunks of `n * el` bytes and panicked
    // on n = 0 (readV(layer, cell, 0) reached JS as ERR_KV_INTERNAL)
    let c = SeedCache::new(CacheParams::new(16, 1, 8, 8)).unwrap();
    assert!(c.v_trans());
    assert!(c.read_rows(0, Tensor::V, 0, 0).unwrap().is_empty());
    assert!(c.read_rows(0, Tensor::K, 3, 0).unwrap().is_empty());
}

/// A recurrent cache of 256 sequences (one state cell each, as llama.cpp's `LLAMA_MAX_SEQ`
/// allows): sequences in every word of a cell's set get their own cell, share one through
/// `seq_cp`, and free it only when the last owner leaves.
#[test]
fn a_recurrent_cache_of_256_sequences_keeps_a_state_cell_per_sequence() {
    let mut c = recurrent_cache(256, 256);
    let every: Vec<Vec<i32>> = (0..256).map(|s| vec![s]).collect();
    let ub = UBatch {
        pos: vec![0; 256],
        n_seq_tokens: 1,
        seq_ids: every,
        ext: Vec::new(),
    };
    c.find_slot(&ub).unwrap().unwrap();
    assert_eq!(c.used_cells(), 256);
    // 255 takes the state of 70: its own cell is freed, 70's is shared
    c.seq_cp(70, 255, -1, -1).unwrap();
    assert_eq!(c.used_cells(), 255);
    let shared = (0..256)
        .map(|i| c.cell(i).unwrap())
        .find(|cell| cell.seqs.contains(255))
        .unwrap();
    assert_eq!(shared.seqs.iter().collect::<Vec<_>>(), vec![70, 255]);
    assert!(c.seq_rm(70, -1, -1).unwrap());
    assert_eq!(c.used_cells(), 255, "255 still owns the cell");
    assert!(c.seq_rm(255, -1, -1).unwrap());
    assert_eq!(c.used_cells(), 254);
    assert_eq!(c.cells().check_consistency(), Ok(()));
}
