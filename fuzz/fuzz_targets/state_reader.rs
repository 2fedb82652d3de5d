//! Fuzzes every reader of untrusted bytes: payload detection and restore (whole cache and one
//! sequence), sequence and session files, and inspection. A failed load must leave the cache
//! exactly as it was; a successful one must write back without error.
#![no_main]

use libfuzzer_sys::fuzz_target;
use llama_kv_cache::files::inspect_bytes;
use llama_kv_cache::{CacheParams, GgmlType, KvCache, Layout, ReadOptions, UBatch};

fn cache(flash: bool, ty: GgmlType) -> KvCache {
    let mut p = CacheParams::new(16, 2, 32, 32);
    p.n_seq_max = 4;
    p.flash_attn = flash;
    p.type_k = ty;
    p.type_v = if flash { ty } else { GgmlType::F16 };
    let mut c = KvCache::new(p).unwrap();
    c.find_slot(&UBatch::per_token(vec![0, 1, 2], vec![vec![0, 1], vec![1], vec![2]]))
        .unwrap()
        .unwrap();
    c
}

fuzz_target!(|data: &[u8]| {
    let _ = inspect_bytes(data);
    let (selector, body) = match data.split_first() {
        Some((s, b)) => (*s, b),
        None => return,
    };
    let flash = selector & 1 == 1;
    let ty = if selector & 2 == 2 { GgmlType::Q8_0 } else { GgmlType::F16 };
    let mut c = cache(flash, ty);
    let before = c.state_write(-1, Layout::Seed, 1, None).unwrap();
    let opts = ReadOptions { layout: None, allow_scattered: selector & 4 == 4, part: None };
    let seq = i32::from(selector >> 4 & 3) - 1;
    let result = match selector >> 6 {
        0 => c.state_read(body, seq, opts, None).map(|_| ()),
        1 => c.load_sequence_bytes(body, seq.max(0), opts, None).map(|_| ()),
        _ => c.load_session_bytes(body, opts, None).map(|_| ()),
    };
    match result {
        Err(_) => assert_eq!(c.state_write(-1, Layout::Seed, 1, None).unwrap(), before, "a failed load changed the cache"),
        Ok(()) => {
            c.cells().check_consistency().unwrap();
            c.state_write(-1, Layout::Streams, 1, None).unwrap();
        }
    }
});
