//! Compact blocks through real stores: a tier keeps them smaller and gives back the block
//! (lossless: the same bytes; q8_0: within half a step), every store reads every mode, and
//! presence checks, secrets and KV events see compact values as the blocks they are.

#[path = "common/caches.rs"]
mod caches;

use std::fs;
use std::path::Path;
use std::sync::{Arc, Mutex};

use caches::{params, tokens};
use llama_kv_cache::tensors::quant::{dequantize_row, quantize_row};
use llama_kv_cache::{GgmlType, SeedCache, Tensor, UBatch};
use prompt_store::events::{EventHub, KvEvent};
use prompt_store::seal::Sealer;
use prompt_store::{
    Backend, Compressed, Compression, DirBackend, MemoryBackend, PromptStore, TieredBackend,
};

const BT: u32 = 16;
const SECRET: &[u8] = b"0123456789abcdef";

/// A cache whose sequence 0 holds `n` tokens of f16 activations-like rows.
fn activations(n: u32) -> SeedCache {
    let mut c = SeedCache::new(params(false, GgmlType::F16, 256)).unwrap();
    let slot = c.find_slot(&UBatch::sequence(0, 0, n)).unwrap().unwrap();
    for il in 0..c.n_layer() {
        for which in [Tensor::K, Tensor::V] {
            let row = c.row_size(il, which).unwrap();
            let mut rows = vec![0u8; row * n as usize];
            let mut f = vec![0f32; row / 2];
            for (t, out) in rows.chunks_exact_mut(row).enumerate() {
                for (ch, x) in f.iter_mut().enumerate() {
                    *x = (t as f32 * 0.05 + ch as f32 * 0.7 + il as f32).sin()
                        * (1.0 + ch as f32 / 8.0);
                }
                quantize_row(GgmlType::F16, &f, out).unwrap();
            }
            c.write_rows(il, which, slot.head, &rows).unwrap();
        }
    }
    c
}

fn values(c: &SeedCache, n: u32) -> Vec<f32> {
    let mut out = Vec::new();
    for il in 0..c.n_layer() {
        for which in [Tensor::K, Tensor::V] {
            let rows = c.read_rows(il, which, 0, n).unwrap();
            let mut f = vec![0f32; rows.len() / 2];
            dequantize_row(GgmlType::F16, &rows, &mut f).unwrap();
            out.extend(f);
        }
    }
    out
}

fn dir_bytes(dir: &Path) -> u64 {
    let mut total = 0;
    for fan in fs::read_dir(dir.join("blocks")).unwrap().flatten() {
        for f in fs::read_dir(fan.path()).unwrap().flatten() {
            total += f.metadata().unwrap().len();
        }
    }
    total
}

fn tier(b: Arc<dyn Backend>, mode: Compression, secret: Option<&[u8]>) -> Arc<dyn Backend> {
    Arc::new(Compressed::new(b, mode, Sealer::new(secret)))
}

fn dir_store(dir: &Path, mode: Compression, secret: Option<&[u8]>) -> PromptStore {
    let b = tier(Arc::new(DirBackend::open(dir, None).unwrap()), mode, secret);
    let store = PromptStore::new(b, "m", BT).unwrap();
    match secret {
        Some(s) => store.with_secret(s).unwrap(),
        None => store,
    }
}

#[test]
fn a_lossless_dir_tier_behind_memory_is_smaller_and_restores_byte_for_byte() {
    let (plain, packed) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let c = activations(128);
    let toks = tokens(128, 0);
    dir_store(plain.path(), Compression::None, None)
        .put(&c, 0, &toks, None)
        .unwrap();
    let tiers = TieredBackend::new(vec![
        Arc::new(MemoryBackend::new(None)),
        tier(
            Arc::new(DirBackend::open(packed.path(), None).unwrap()),
            Compression::Lossless,
            None,
        ),
    ])
    .unwrap();
    PromptStore::new(Arc::new(tiers), "m", BT)
        .unwrap()
        .put(&c, 0, &toks, None)
        .unwrap();
    let (a, b) = (dir_bytes(plain.path()), dir_bytes(packed.path()));
    assert!(b * 10 < a * 9, "lossless {b} of {a} bytes");
    // a store of another mode reads them: the rows come back exactly
    let reader = dir_store(packed.path(), Compression::Q8_0, None);
    let mut dst = SeedCache::new(params(false, GgmlType::F16, 256)).unwrap();
    assert_eq!(reader.restore(&mut dst, 0, &toks, None).unwrap(), 128);
    for il in 0..c.n_layer() {
        for which in [Tensor::K, Tensor::V] {
            assert_eq!(
                c.read_rows(il, which, 0, 128).unwrap(),
                dst.read_rows(il, which, 0, 128).unwrap()
            );
        }
    }
}

#[test]
fn q8_0_restores_within_half_a_step_and_with_a_secret_a_second_put_finds_its_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let c = activations(128);
    let toks = tokens(128, 0);
    let store = dir_store(dir.path(), Compression::Q8_0, Some(SECRET));
    let first = store.put(&c, 0, &toks, None).unwrap();
    assert_eq!(first.blocks_written, 8);
    // presence reads a compact value's trailer: it is this store's, so nothing is written again
    let again = store.put(&c, 0, &toks, None).unwrap();
    assert_eq!((again.blocks_written, again.blocks_skipped), (0, 8));
    assert!(dir_bytes(dir.path()) * 10 < first.bytes_written * 6);
    for reader in [
        store,
        dir_store(dir.path(), Compression::None, Some(SECRET)),
    ] {
        let mut dst = SeedCache::new(params(false, GgmlType::F16, 256)).unwrap();
        assert_eq!(reader.restore(&mut dst, 0, &toks, None).unwrap(), 128);
        let (want, got) = (values(&c, 128), values(&dst, 128));
        let mut worst = 0f32;
        for (x, y) in want.chunks(32).zip(got.chunks(32)) {
            let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (u, w) in x.iter().zip(y) {
                let err = (u - w).abs();
                assert!(err <= amax / 254.0 * 1.0001 + w.abs() / 1024.0, "{u} {w}");
                worst = worst.max(err);
            }
        }
        assert!(worst > 0.0, "q8_0 is lossy");
    }
    // without the secret, the compact values are another writer's: never loaded
    let stranger = dir_store(dir.path(), Compression::None, None);
    let mut dst = SeedCache::new(params(false, GgmlType::F16, 256)).unwrap();
    assert_eq!(stranger.restore(&mut dst, 0, &toks, None).unwrap(), 0);
}

#[test]
fn kv_events_name_compact_blocks_a_budget_evicts() {
    let dir = tempfile::tempdir().unwrap();
    let budget = 6 * 16 * 2 * 2 * 70; // about six q8_0 blocks
    let b = tier(
        Arc::new(DirBackend::open(dir.path(), Some(budget)).unwrap()),
        Compression::Q8_0,
        None,
    );
    let hub = EventHub::new();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let sink = seen.clone();
    hub.subscribe(Arc::new(move |e: &[KvEvent]| {
        sink.lock().unwrap().extend_from_slice(e)
    }));
    let store = PromptStore::new(b, "m", BT).unwrap().with_events(hub);
    let toks = tokens(256, 0);
    store.put(&activations(256), 0, &toks, None).unwrap();
    let keys = store.keys(&toks).unwrap().unwrap();
    let events = seen.lock().unwrap().clone();
    let removed: Vec<_> = events
        .iter()
        .flat_map(|e| match e {
            KvEvent::BlockRemoved { block_hashes, .. } => block_hashes.clone(),
            _ => Vec::new(),
        })
        .collect();
    assert!(!removed.is_empty() && removed.iter().all(|k| keys.contains(k)));
    let held = store.backend().contains_many(&keys).unwrap();
    for (k, h) in keys.iter().zip(held) {
        assert_eq!(h, !removed.contains(k));
    }
}
