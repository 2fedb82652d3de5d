//! Tensor data: defrag moves every row with its cell, K-shift on quantized K stays within the
//! quantizer's error, and the quantizers reproduce rows written by llama.cpp.

use std::path::PathBuf;

use llama_kv_cache::state::files::inspect_bytes;
use llama_kv_cache::tensors::quant::{dequantize_row, quantize_row};
use llama_kv_cache::{
    CacheParams, GgmlType, RopeParams, RopeTable, RopeType, SeedCache, ShiftParams, Tensor, UBatch,
};
use proptest::prelude::*;

fn rows_by_seq_pos(c: &SeedCache) -> Vec<(usize, i32, Vec<u8>, Vec<u8>)> {
    let mut out = Vec::new();
    for i in 0..c.size() {
        let cell = c.cell(i).unwrap();
        for seq in cell.seqs.iter() {
            let mut k = Vec::new();
            let mut v = Vec::new();
            for il in 0..c.n_layer() {
                k.extend(c.read_rows(il, Tensor::K, i, 1).unwrap());
                v.extend(c.read_rows(il, Tensor::V, i, 1).unwrap());
            }
            out.push((seq, cell.pos, k, v));
        }
    }
    out.sort();
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Random fragmentation: after the defrag every sequence's rows (K and V, transposed or
    /// not) hold exactly the bytes they held before, at their new cells.
    #[test]
    fn defrag_keeps_every_row_with_its_sequence_and_position(
        v_trans in any::<bool>(),
        removals in prop::collection::vec((0..3i32, 0..40i32, 1..6i32), 1..12),
        max_nodes in prop::sample::select(vec![16u32, 40, 65536]),
    ) {
        let mut p = CacheParams::new(48, 2, 8, 16);
        p.n_seq_max = 3;
        p.flash_attn = !v_trans;
        let mut c = SeedCache::new(p).unwrap();
        for t in 0..40 {
            let ub = UBatch::per_token(vec![t / 3], vec![vec![t % 3]]);
            c.find_slot(&ub).unwrap().unwrap();
            let bytes: Vec<u8> = (0..16).map(|j| (t * 7 + j) as u8).collect();
            for il in 0..2 {
                c.write_rows(il, Tensor::K, t as u32, &bytes).unwrap();
                let vb: Vec<u8> = (0..32).map(|j| (t * 11 + j + il as i32) as u8).collect();
                c.write_rows(il, Tensor::V, t as u32, &vb).unwrap();
            }
        }
        for (seq, p0, len) in removals {
            c.seq_rm(seq, p0, p0 + len).unwrap();
        }
        let before = rows_by_seq_pos(&c);
        let used = c.used_cells();
        let report = c.defrag_now(max_nodes).unwrap();
        prop_assert_eq!(rows_by_seq_pos(&c), before);
        prop_assert_eq!(c.used_cells(), used);
        let max_moves = (max_nodes - 4) / 12;
        prop_assert!(report.moves.len() as u32 <= max_moves, "runs {} for cap {}", report.moves.len(), max_moves);
        if max_nodes == 65536 {
            prop_assert_eq!(c.cell_max(), used, "an uncapped defrag leaves no holes");
        }
    }
}

#[test]
fn quantized_k_shift_stays_within_the_quantizer_error() {
    for ty in [
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q5_1,
        GgmlType::Iq4Nl,
    ] {
        let mut p = CacheParams::new(8, 1, 64, 64);
        p.type_k = ty;
        p.flash_attn = true;
        let mut c = SeedCache::new(p).unwrap();
        c.find_slot(&UBatch::sequence(0, 20, 1)).unwrap().unwrap();
        let k: Vec<f32> = (0..64)
            .map(|i| ((i * 29 % 17) as f32 - 8.0) / 4.0)
            .collect();
        c.write_rows_f32(0, Tensor::K, 0, &k).unwrap();
        let stored = c.read_rows_f32(0, Tensor::K, 0, 1).unwrap();
        c.seq_add(0, -1, -1, -5).unwrap();
        let rope = RopeParams::new(32, 32, 2, RopeType::Neox);
        c.update(
            Some(&ShiftParams {
                rope: rope.clone(),
                per_layer: vec![],
            }),
            None,
        )
        .unwrap();
        let mut want = stored.clone();
        RopeTable::new(&rope, -5).rotate(&mut want);
        let got = c.read_rows_f32(0, Tensor::K, 0, 1).unwrap();
        let amax = want.iter().fold(0f32, |m, x| m.max(x.abs()));
        let step = match ty {
            GgmlType::Q8_0 => amax / 127.0,
            _ => amax / 7.0,
        };
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= step, "{ty}: {g} vs {w} (step {step})");
        }
    }
}

#[test]
fn per_layer_rope_overrides_apply_to_their_layer() {
    let mut p = CacheParams::new(4, 2, 32, 32);
    p.type_k = GgmlType::F32;
    let mut c = SeedCache::new(p).unwrap();
    c.find_slot(&UBatch::sequence(0, 10, 1)).unwrap().unwrap();
    let k: Vec<f32> = (0..32).map(|i| i as f32 / 8.0 - 2.0).collect();
    for il in 0..2 {
        c.write_rows_f32(il, Tensor::K, 0, &k).unwrap();
    }
    c.seq_add(0, -1, -1, -3).unwrap();
    let base = RopeParams::new(16, 16, 2, RopeType::Norm);
    let mut swa = base.clone();
    swa.freq_base = 500.0;
    c.update(
        Some(&ShiftParams {
            rope: base.clone(),
            per_layer: vec![(1, swa.clone())],
        }),
        None,
    )
    .unwrap();
    for (il, rope) in [(0, base), (1, swa)] {
        let mut want = k.clone();
        RopeTable::new(&rope, -3).rotate(&mut want);
        assert_eq!(
            c.read_rows_f32(il, Tensor::K, 0, 1).unwrap(),
            want,
            "layer {il}"
        );
    }
}

#[test]
fn quantizers_reproduce_rows_written_by_llama_cpp() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../__test__/fixtures");
    let mut checked = 0;
    for name in [
        "ln-h32-q8_0-fa.ggsn",
        "ln-h32-q4_0-fa.ggsn",
        "nlc-h32-q8_0-fa.ggsq",
        "nlc-h32-q4_0-fa.ggsq",
    ] {
        let bytes = std::fs::read(dir.join(name)).unwrap();
        let ins = inspect_bytes(&bytes).unwrap();
        let payload = &bytes[ins.payload_offset..];
        for stream in &ins.payload.streams {
            for l in &stream.layers {
                let ty = GgmlType::from_id(l.k_type).unwrap();
                let row = l.k_row_size as usize;
                let width = row / ty.type_size() * ty.block_size();
                for chunk in payload[l.k_data.clone()].chunks_exact(row) {
                    let mut f = vec![0f32; width];
                    dequantize_row(ty, chunk, &mut f).unwrap();
                    let mut again = vec![0u8; row];
                    quantize_row(ty, &f, &mut again).unwrap();
                    assert_eq!(
                        again, chunk,
                        "{name}: a {ty} row does not requantize to itself"
                    );
                    checked += 1;
                }
            }
        }
    }
    assert!(checked > 50, "only {checked} rows checked");
}
