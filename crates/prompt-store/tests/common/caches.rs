//! Caches with known rows, shared by the store's tests.
#![allow(dead_code)]

use llama_kv_cache::{CacheParams, GgmlType, SeedCache, Tensor, UBatch};

pub fn params(flash_attn: bool, ty: GgmlType, size: u32) -> CacheParams {
    let mut p = CacheParams::new(size, 2, 64, 32);
    p.type_k = ty;
    p.type_v = if flash_attn { ty } else { GgmlType::F16 };
    p.flash_attn = flash_attn;
    p.n_seq_max = 4;
    p
}

/// Row bytes of a token depend on its position and a salt: rows of different prompts differ.
pub fn row_byte(pos: u32, il: u32, v: bool, salt: u32) -> u8 {
    (pos.wrapping_mul(31) ^ il.wrapping_mul(7) ^ ((v as u32) * 13) ^ salt) as u8
}

/// Evaluates `n` tokens into `seq` starting at cell `first`-free slot: rows as `row_byte`.
pub fn fill(cache: &mut SeedCache, seq: i32, n: u32, salt: u32) {
    let slot = cache
        .find_slot(&UBatch::sequence(seq, 0, n))
        .unwrap()
        .expect("room");
    for il in 0..cache.n_layer() {
        for (which, v) in [(Tensor::K, false), (Tensor::V, true)] {
            let row = cache.row_size(il, which).unwrap();
            let mut rows = Vec::new();
            for p in 0..n {
                rows.extend(std::iter::repeat_n(row_byte(p, il, v, salt), row));
            }
            // quantized rows are opaque bytes here: any bytes are valid block data for the test
            cache.write_rows(il, which, slot.head, &rows).unwrap();
        }
    }
}

pub fn tokens(n: u32, salt: i32) -> Vec<i32> {
    (0..n as i32).map(|t| t * 3 + salt).collect()
}
