//! Prompts, caches that evaluated them, and stores on a Redis deployment, for the store tests.

#![allow(dead_code)] // each test binary uses a different part of the harness

use std::sync::Arc;
use std::time::Duration;

use llama_kv_cache::{CacheParams, SeedCache, Tensor, UBatch};
use prompt_store::PromptStore;
use prompt_store_redis::{RedisBackend, RedisOptions};

pub const BT: u32 = 16;
pub const MODEL: &str = "model-under-test";

pub fn params() -> CacheParams {
    let mut p = CacheParams::new(256, 2, 256, 64);
    p.n_seq_max = 4;
    p
}

pub fn store_at(url: &str) -> PromptStore {
    store_with(RedisOptions::new(url).with_timeout(Duration::from_secs(2)))
}

pub fn store_with(options: RedisOptions) -> PromptStore {
    PromptStore::new(Arc::new(RedisBackend::new(options).unwrap()), MODEL, BT).unwrap()
}

/// A token's rows depend on every token up to it (as real KV does), so prompts that share a
/// prefix have equal rows exactly on that prefix.
pub fn row_byte(prefix_hash: u32, il: u32, v: bool) -> u8 {
    (prefix_hash ^ il.wrapping_mul(7) ^ ((v as u32) * 13)) as u8
}

pub fn prefix_hashes(tokens: &[i32]) -> Vec<u32> {
    let mut h = 17u32;
    tokens
        .iter()
        .map(|&t| {
            h = h.wrapping_mul(31).wrapping_add(t as u32);
            h
        })
        .collect()
}

/// A cache whose sequence `seq` holds `tokens` evaluated at positions 0..n.
pub fn evaluated(tokens: &[i32], seq: i32) -> SeedCache {
    let mut cache = SeedCache::new(params()).unwrap();
    let n = tokens.len() as u32;
    if n == 0 {
        return cache;
    }
    let slot = cache
        .find_slot(&UBatch::sequence(seq, 0, n))
        .unwrap()
        .expect("room");
    let hashes = prefix_hashes(tokens);
    for il in 0..cache.n_layer() {
        for (which, v) in [(Tensor::K, false), (Tensor::V, true)] {
            let row = cache.row_size(il, which).unwrap();
            let mut rows = Vec::with_capacity(row * tokens.len());
            for &h in &hashes {
                rows.extend(std::iter::repeat_n(row_byte(h, il, v), row));
            }
            cache.write_rows(il, which, slot.head, &rows).unwrap();
        }
    }
    cache
}

/// Sequence 0's one-sequence state: cells, positions and every row. Restores here go into an
/// empty cache, so they are byte-exact exactly when this equals the state of a cache that
/// evaluated the restored tokens itself.
pub fn seq0_state(cache: &SeedCache) -> Vec<u8> {
    cache
        .state_write(0, llama_kv_cache::Layout::Streams, 1, None)
        .unwrap()
}

/// The state a cold evaluation of `tokens` has.
pub fn cold_state(tokens: &[i32]) -> Vec<u8> {
    seq0_state(&evaluated(tokens, 0))
}

pub fn prompt(shared: usize, unique: usize, salt: i32) -> Vec<i32> {
    (0..shared as i32)
        .chain((0..unique as i32).map(|t| 1000 * (salt + 1) + t))
        .collect()
}

pub fn snapshot(cache: &SeedCache) -> Vec<u8> {
    cache
        .state_write(-1, llama_kv_cache::Layout::Streams, 1, None)
        .unwrap()
}
