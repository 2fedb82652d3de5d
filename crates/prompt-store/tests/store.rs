//! The prompt store against real caches: round trips, prefixes, refusals, corruption,
//! deduplication, budgets and concurrent writers.

#[path = "common/caches.rs"]
mod caches;
#[path = "common/files.rs"]
mod files;

use std::fs;
use std::path::Path;
use std::sync::Arc;

use caches::{fill, params, row_byte, tokens};
use files::sequence_file;
use llama_kv_cache::state::files::inspect_bytes;
use llama_kv_cache::{CacheParams, FileKind, GgmlType, Layout, SeedCache, Tensor, UBatch};
use prompt_store::{
    checkpoint_key, Backend, DirBackend, MemoryBackend, PromptStore, StoreError, WriteFileOptions,
};

const BT: u32 = 16;

/// Every row of `seq`, by position (for byte-exact comparisons across caches).
fn rows_by_position(cache: &SeedCache, seq: i32) -> Vec<Vec<u8>> {
    let mut cells: Vec<(i32, u32)> = (0..cache.size())
        .filter_map(|i| {
            let c = cache.cells().get(i as usize);
            c.seqs.contains(seq as usize).then_some((c.pos, i))
        })
        .collect();
    cells.sort();
    cells
        .iter()
        .map(|&(_, i)| {
            let mut out = Vec::new();
            for il in 0..cache.n_layer() {
                out.extend(cache.read_rows(il, Tensor::K, i, 1).unwrap());
                out.extend(cache.read_rows(il, Tensor::V, i, 1).unwrap());
            }
            out
        })
        .collect()
}

/// A cache whose sequence 0 holds `n` tokens (positions 0..n), and those tokens.
fn prompt(n: u32) -> (SeedCache, Vec<i32>) {
    let mut c = SeedCache::new(params(false, GgmlType::F16, 128)).unwrap();
    fill(&mut c, 0, n, 0);
    (c, tokens(n, 0))
}

fn memory_store() -> PromptStore {
    PromptStore::new(Arc::new(MemoryBackend::new(None)), "model-a", BT).unwrap()
}

#[test]
fn put_then_restore_is_byte_exact_for_every_v_layout_and_type() {
    for (fa, ty) in [
        (false, GgmlType::F16),
        (true, GgmlType::F16),
        (true, GgmlType::Q8_0),
        (false, GgmlType::F32),
    ] {
        let store = memory_store();
        let mut src = SeedCache::new(params(fa, ty, 128)).unwrap();
        fill(&mut src, 1, 40, 0);
        let toks = tokens(40, 0);
        let r = store.put(&src, 1, &toks, None).unwrap();
        // two full blocks, and the partial last one as a checkpoint
        assert_eq!(
            (
                r.tokens,
                r.blocks_written,
                r.blocks_skipped,
                r.checkpoints_written
            ),
            (40, 2, 0, 1)
        );
        let mut dst = SeedCache::new(params(fa, ty, 128)).unwrap();
        fill(&mut dst, 0, 10, 99); // another sequence stays untouched
        let before = rows_by_position(&dst, 0);
        assert_eq!(store.restore(&mut dst, 2, &toks, None).unwrap(), 40);
        assert_eq!(rows_by_position(&dst, 2), rows_by_position(&src, 1));
        assert_eq!(rows_by_position(&dst, 0), before);
        assert_eq!(dst.seq_pos_max(2).unwrap(), 39);
        // a prompt that goes on past the checkpoint restores it; one that diverges inside the
        // partial block restores the full blocks only
        let longer = [toks.as_slice(), &[7, 8, 9]].concat();
        assert_eq!(store.lookup(&longer).unwrap(), 40);
        let mut diverged = toks.clone();
        diverged[35] = -1;
        assert_eq!(store.lookup(&diverged).unwrap(), 32);
        assert_eq!(store.lookup(&toks[..39]).unwrap(), 32);
    }
}

#[test]
fn a_restore_of_a_prompts_first_n_tokens_loads_its_longest_restore_point_up_to_n() {
    // what `maxLoadTokens` asks for: blocks to 96 and checkpoints at 40 and 100
    let store = memory_store();
    let (turn, _) = prompt(40);
    let (src, toks) = prompt(100);
    store.put(&turn, 0, &toks[..40], None).unwrap();
    store.put(&src, 0, &toks, None).unwrap();
    for (max, point) in [(100, 100), (99, 96), (50, 48), (47, 40), (39, 32), (15, 0)] {
        let mut dst = SeedCache::new(params(false, GgmlType::F16, 128)).unwrap();
        let loaded = store.restore(&mut dst, 0, &toks[..max], None).unwrap();
        assert_eq!(loaded, point, "at most {max}");
        assert_eq!(store.lookup(&toks[..max]).unwrap(), point);
        assert_eq!(
            rows_by_position(&dst, 0),
            rows_by_position(&src, 0)[..point as usize]
        );
        if point > 0 {
            assert_eq!(dst.seq_pos_max(0).unwrap(), point as i32 - 1);
        }
    }
}

#[test]
fn a_corrupt_checkpoint_is_a_counted_miss_and_the_restore_falls_back_to_the_blocks() {
    let store = memory_store();
    let mut src = SeedCache::new(params(false, GgmlType::F16, 128)).unwrap();
    fill(&mut src, 0, 40, 0);
    let toks = tokens(40, 0);
    store.put(&src, 0, &toks, None).unwrap();
    // the checkpoint of the 8 tokens after the second block
    let backend = store.backend().clone();
    let keys = store.keys(&toks).unwrap().unwrap();
    let ckpt = checkpoint_key(&keys[1], &toks[32..]);
    let mut v = backend.get_many(&[ckpt]).unwrap().pop().flatten().unwrap();
    let at = v.len() / 2;
    v[at] ^= 0x10;
    backend.remove(&ckpt).unwrap();
    backend.put_if_absent(&ckpt, &v).unwrap();
    // the lookup sees a present checkpoint; the restore reads it, rejects it and falls back
    assert_eq!(store.lookup(&toks).unwrap(), 40);
    let mut dst = SeedCache::new(params(false, GgmlType::F16, 128)).unwrap();
    assert_eq!(store.restore(&mut dst, 0, &toks, None).unwrap(), 32);
    assert_eq!(rows_by_position(&dst, 0), rows_by_position(&src, 0)[..32]);
    assert_eq!(store.stats().unwrap().corrupt, 1);
    // the corrupt value was removed: the next lookup is honest, and a put repairs it
    assert_eq!(store.lookup(&toks).unwrap(), 32);
    store.put(&src, 0, &toks, None).unwrap();
    let mut again = SeedCache::new(params(false, GgmlType::F16, 128)).unwrap();
    assert_eq!(store.restore(&mut again, 0, &toks, None).unwrap(), 40);
}

#[test]
fn put_of_a_scattered_sequence_stores_rows_by_position() {
    // seq 0 interleaved with seq 1 cell by cell: the payload order is not the position order
    let store = memory_store();
    let mut src = SeedCache::new(params(false, GgmlType::F16, 128)).unwrap();
    for p in 0..32 {
        for s in [0, 1] {
            let slot = src.find_slot(&UBatch::sequence(s, p, 1)).unwrap().unwrap();
            for il in 0..2 {
                for (w, v) in [(Tensor::K, false), (Tensor::V, true)] {
                    let row = src.row_size(il, w).unwrap();
                    let b = row_byte(p as u32, il, v, s as u32 * 50);
                    src.write_rows(il, w, slot.head, &vec![b; row]).unwrap();
                }
            }
        }
    }
    store.put(&src, 1, &tokens(32, 0), None).unwrap();
    let mut dst = SeedCache::new(params(false, GgmlType::F16, 128)).unwrap();
    store.restore(&mut dst, 0, &tokens(32, 0), None).unwrap();
    assert_eq!(rows_by_position(&dst, 0), rows_by_position(&src, 1));
}

#[test]
fn lookup_returns_the_shared_prefix_and_put_skips_stored_blocks() {
    let store = memory_store();
    let (a, ta) = prompt(64);
    store.put(&a, 0, &ta, None).unwrap();
    let mut tb = ta.clone();
    tb[40] = -1; // diverges in block 2
    assert_eq!(store.lookup(&ta).unwrap(), 64);
    assert_eq!(store.lookup(&tb).unwrap(), 32);
    assert_eq!(store.lookup(&ta[..20]).unwrap(), 16);
    let r = store.put(&a, 0, &ta, None).unwrap();
    assert_eq!((r.blocks_written, r.blocks_skipped), (0, 4));
    let s = store.stats().unwrap();
    assert_eq!((s.hits, s.misses), (4 + 2 + 1, 1));
}

#[test]
fn a_sequence_that_is_not_positions_0_to_n_is_refused_with_not_prefix() {
    let store = memory_store();
    let mut c = SeedCache::new(params(false, GgmlType::F16, 128)).unwrap();
    fill(&mut c, 0, 32, 0);
    c.seq_rm(0, 0, 4).unwrap(); // positions 4..32 remain
    let e = store.put(&c, 0, &tokens(32, 0), None).unwrap_err();
    assert!(matches!(e, StoreError::NotPrefix(_)), "{e:?}");
    let mut c = SeedCache::new(params(false, GgmlType::F16, 128)).unwrap();
    fill(&mut c, 0, 32, 0);
    c.seq_add(0, 0, -1, 2).unwrap(); // pending K-shift
    let e = store.put(&c, 0, &tokens(32, 0), None).unwrap_err();
    assert!(matches!(e, StoreError::NotPrefix(_)), "{e:?}");
    assert_eq!(store.stats().unwrap().blocks, 0);
}

#[test]
fn a_cache_of_another_geometry_is_refused_also_by_a_later_process() {
    let dir = tempfile::tempdir().unwrap();
    let open = || {
        PromptStore::new(
            Arc::new(DirBackend::open(dir.path(), None).unwrap()),
            "m",
            BT,
        )
        .unwrap()
    };
    let store = open();
    let mut f16 = SeedCache::new(params(false, GgmlType::F16, 64)).unwrap();
    fill(&mut f16, 0, 32, 0);
    store.put(&f16, 0, &tokens(32, 0), None).unwrap();
    let mut q8 = SeedCache::new(params(true, GgmlType::Q8_0, 64)).unwrap();
    fill(&mut q8, 0, 32, 0);
    let again = open(); // a fresh process reads the model record
    for s in [&store, &again] {
        let e = s.put(&q8, 0, &tokens(32, 0), None).unwrap_err();
        assert!(matches!(e, StoreError::Geometry(_)), "{e:?}");
        let e = s.restore(&mut q8, 1, &tokens(32, 0), None).unwrap_err();
        assert!(matches!(e, StoreError::Geometry(_)), "{e:?}");
    }
    assert_eq!(again.lookup(&tokens(32, 0)).unwrap(), 32);
}

#[test]
fn nothing_stored_restores_nothing_and_leaves_the_cache_unchanged() {
    let store = memory_store();
    let mut c = SeedCache::new(params(false, GgmlType::F16, 64)).unwrap();
    fill(&mut c, 0, 20, 0);
    let before = rows_by_position(&c, 0);
    assert_eq!(store.restore(&mut c, 0, &tokens(32, 0), None).unwrap(), 0);
    assert_eq!(rows_by_position(&c, 0), before);
    assert_eq!(store.lookup(&tokens(32, 0)).unwrap(), 0);
}

/// Writes a prompt of 4 blocks into a dir store and returns the block files in chain order.
fn dir_with_blocks(
    dir: &Path,
    flash_attn: bool,
) -> (PromptStore, SeedCache, Vec<i32>, Vec<std::path::PathBuf>) {
    let backend = Arc::new(DirBackend::open(dir, None).unwrap());
    let store = PromptStore::new(backend.clone(), "m", BT).unwrap();
    let mut c = SeedCache::new(params(flash_attn, GgmlType::F16, 128)).unwrap();
    fill(&mut c, 0, 64, 0);
    let toks = tokens(64, 0);
    store.put(&c, 0, &toks, None).unwrap();
    let keys = store.keys(&toks).unwrap().unwrap();
    let files = keys.iter().map(|k| backend.path_of(k)).collect();
    (store, c, toks, files)
}

#[test]
fn flipped_truncated_and_swapped_blocks_are_counted_misses_never_loaded() {
    type Damage = fn(&[std::path::PathBuf]);
    let cases: [(&str, Damage); 3] = [
        ("flip", |f| {
            let mut b = fs::read(&f[2]).unwrap();
            let at = b.len() / 2;
            b[at] ^= 1;
            fs::write(&f[2], b).unwrap();
        }),
        ("truncate", |f| {
            let b = fs::read(&f[2]).unwrap();
            fs::write(&f[2], &b[..b.len() - 7]).unwrap();
        }),
        ("swap", |f| {
            let (a, b) = (fs::read(&f[2]).unwrap(), fs::read(&f[3]).unwrap());
            fs::write(&f[2], b).unwrap();
            fs::write(&f[3], a).unwrap();
        }),
    ];
    // both V layouts: the restored payload is compacted from 4 blocks to the 2 that verify
    for (fa, (name, damage)) in [false, true]
        .into_iter()
        .flat_map(|fa| cases.map(|c| (fa, c)))
    {
        let dir = tempfile::tempdir().unwrap();
        let (store, src, toks, files) = dir_with_blocks(dir.path(), fa);
        damage(&files);
        let mut dst = SeedCache::new(params(fa, GgmlType::F16, 128)).unwrap();
        assert_eq!(
            store.restore(&mut dst, 0, &toks, None).unwrap(),
            32,
            "{name}"
        );
        assert_eq!(
            rows_by_position(&dst, 0),
            rows_by_position(&src, 0)[..32],
            "{name}"
        );
        let s = store.stats().unwrap();
        // a damaged value is corrupt; a whole value under another key is another writer's
        let want = if name == "swap" { (0, 1) } else { (1, 0) };
        assert_eq!(
            (s.corrupt, s.rejected, s.misses),
            (want.0, want.1, 1),
            "{name}"
        );
        // the bad block was dropped, so the same prompt can be stored whole again
        assert!(!files[2].exists(), "{name}");
        let r = store.put(&src, 0, &toks, None).unwrap();
        assert_eq!(r.blocks_written, 1, "{name}");
        let mut again = SeedCache::new(params(fa, GgmlType::F16, 128)).unwrap();
        let restored = store.restore(&mut again, 0, &toks, None).unwrap();
        // swap: block 3 still holds block 2's value and is foreign, so the prefix ends there
        assert_eq!(restored, if name == "swap" { 48 } else { 64 }, "{name}");
        assert_eq!(
            rows_by_position(&again, 0),
            rows_by_position(&src, 0)[..restored as usize]
        );
    }
}

/// A restore writes each block into the cache as it verifies it, so a failure can come after
/// rows were written, over cells the sequence held before: they must come back.
#[test]
fn a_restore_that_fails_after_writing_rows_puts_the_sequence_back_as_it_was() {
    for fa in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let (store, src, toks, files) = dir_with_blocks(dir.path(), fa);
        let held = |c: &SeedCache| {
            let cells: Vec<_> = (0..c.size()).map(|i| c.cells().get(i as usize)).collect();
            (cells, rows_by_position(c, 0), rows_by_position(c, 1))
        };
        let fresh = || {
            let mut c = SeedCache::new(params(fa, GgmlType::F16, 128)).unwrap();
            fill(&mut c, 0, 64, 99);
            fill(&mut c, 1, 20, 7);
            c
        };
        // aborted after two blocks were written into sequence 0's own cells
        let mut dst = fresh();
        let before = held(&dst);
        let mut calls = 0;
        let mut stop_at_third = |_: u64, _: u64| {
            calls += 1;
            calls < 3
        };
        let e = store
            .restore(&mut dst, 0, &toks, Some(&mut stop_at_third))
            .unwrap_err();
        assert!(
            matches!(e, StoreError::Cache(llama_kv_cache::KvError::Aborted(_))),
            "{e}"
        );
        assert_eq!(held(&dst), before, "aborted, flash attention {fa}");
        dst.cells().check_consistency().unwrap();
        // the last block turns out corrupt after three were written: the shorter prefix
        let mut b = fs::read(&files[3]).unwrap();
        b[100] ^= 1;
        fs::write(&files[3], b).unwrap();
        assert_eq!(store.restore(&mut dst, 0, &toks, None).unwrap(), 48);
        assert_eq!(rows_by_position(&dst, 0), rows_by_position(&src, 0)[..48]);
        assert_eq!(rows_by_position(&dst, 1), before.2);
        assert_eq!(dst.seq_pos_max(0).unwrap(), 47);
        dst.cells().check_consistency().unwrap();
    }
}

#[test]
fn a_hundred_conversations_sharing_a_4096_token_prefix_store_it_once() {
    let bt = 256;
    let store = PromptStore::new(Arc::new(MemoryBackend::new(None)), "m", bt).unwrap();
    let mut p = CacheParams::new(4096 + 512, 2, 32, 32);
    p.flash_attn = true;
    let mut c = SeedCache::new(p).unwrap();
    fill(&mut c, 0, 4096 + 512, 0);
    let prefix = tokens(4096, 0);
    let mut unique_tokens = 0u64;
    for conv in 0..100i32 {
        let unique = 256 + 256 * (conv as u32 % 2); // 1 or 2 unique blocks
        let mut t = prefix.clone();
        t.extend((0..unique as i32).map(|k| 1_000_000 + conv * 1000 + k));
        store.put(&c, 0, &t, None).unwrap();
        unique_tokens += unique as u64;
    }
    let per_token = 2 * (64 + 64);
    let ideal = (4096 + unique_tokens) * per_token;
    let stored = store.stats().unwrap().bytes;
    let ratio = stored as f64 / ideal as f64;
    assert!(
        (1.0..1.05).contains(&ratio),
        "stored {stored} bytes, ideal {ideal}: {ratio}"
    );
}

#[test]
fn a_small_budget_evicts_and_lookups_stop_at_the_first_evicted_block() {
    for backend in ["memory", "dir"] {
        let dir = tempfile::tempdir().unwrap();
        let max = 3 * 16 * 2 * 192 + 2000; // about three blocks
        let b: Arc<dyn Backend> = match backend {
            "memory" => Arc::new(MemoryBackend::new(Some(max))),
            _ => Arc::new(DirBackend::open(dir.path(), Some(max)).unwrap()),
        };
        let store = PromptStore::new(b, "m", BT).unwrap();
        let mut c = SeedCache::new(params(false, GgmlType::F16, 128)).unwrap();
        fill(&mut c, 0, 128, 0);
        let toks = tokens(128, 0);
        store.put(&c, 0, &toks, None).unwrap();
        let s = store.stats().unwrap();
        assert!(s.bytes <= max && s.evictions > 0, "{backend}: {s:?}");
        // the oldest blocks went first, so the prefix is gone and nothing fails
        assert_eq!(store.lookup(&toks).unwrap(), 0, "{backend}");
        let mut dst = SeedCache::new(params(false, GgmlType::F16, 128)).unwrap();
        assert_eq!(
            store.restore(&mut dst, 0, &toks, None).unwrap(),
            0,
            "{backend}"
        );
        // a short prompt fits again
        store.put(&c, 0, &toks[..32], None).unwrap();
        assert_eq!(store.lookup(&toks).unwrap(), 32, "{backend}");
        assert!(store.stats().unwrap().bytes <= max);
    }
}

#[test]
fn writers_in_parallel_on_one_dir_restore_every_prompt_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_path_buf();
    let threads: Vec<_> = (0..4u32)
        .map(|w| {
            let root = root.clone();
            std::thread::spawn(move || {
                // each worker opens its own backend, as a separate process would
                let store =
                    PromptStore::new(Arc::new(DirBackend::open(&root, None).unwrap()), "m", BT)
                        .unwrap();
                let mut c = SeedCache::new(params(false, GgmlType::F16, 128)).unwrap();
                fill(&mut c, 0, 64, 0);
                // all share 2 blocks; then their own
                let mut t = tokens(64, 0);
                for x in &mut t[32..] {
                    *x += w as i32 * 1000;
                }
                for _ in 0..5 {
                    store.put(&c, 0, &t, None).unwrap();
                }
                (c, t)
            })
        })
        .collect();
    let results: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let store =
        PromptStore::new(Arc::new(DirBackend::open(&root, None).unwrap()), "m", BT).unwrap();
    for (c, t) in &results {
        let mut dst = SeedCache::new(params(false, GgmlType::F16, 128)).unwrap();
        assert_eq!(store.restore(&mut dst, 0, t, None).unwrap(), 64);
        assert_eq!(rows_by_position(&dst, 0), rows_by_position(c, 0));
    }
    let s = store.stats().unwrap();
    assert_eq!((s.blocks, s.corrupt), (2 + 4 * 2 + 1, 0)); // + the model record
    assert_eq!(fs::read_dir(root.join("tmp")).unwrap().count(), 0);
}

#[test]
fn write_file_gives_a_llama_cpp_file_of_the_prefix_and_put_bytes_reads_it_back() {
    let store = memory_store();
    let (c, toks) = prompt(50);
    store.put(&c, 0, &toks, None).unwrap();
    for (kind, version, layout) in [
        (FileKind::Sequence, 2, Layout::Streams),
        (FileKind::Sequence, 3, Layout::Streams),
        (FileKind::Session, 9, Layout::Streams),
        (FileKind::Session, 9, Layout::Seed),
    ] {
        let opts = WriteFileOptions {
            kind: Some(kind),
            version: Some(version),
            layout: Some(layout),
            ..Default::default()
        };
        let (n, bytes) = store.file_bytes(&toks, &opts, None).unwrap().unwrap();
        assert_eq!(n, 50);
        let ins = inspect_bytes(&bytes).unwrap();
        assert_eq!((ins.header.kind, ins.header.version), (kind, version));
        assert_eq!(ins.header.tokens, toks);
        let mut dst = SeedCache::new(params(false, GgmlType::F16, 128)).unwrap();
        match kind {
            FileKind::Sequence => {
                dst.load_sequence_bytes(&bytes, 3, Default::default(), None)
                    .unwrap();
                assert_eq!(rows_by_position(&dst, 3), rows_by_position(&c, 0));
            }
            FileKind::Session => {
                dst.load_session_bytes(&bytes, Default::default(), None)
                    .unwrap();
                assert_eq!(rows_by_position(&dst, 0), rows_by_position(&c, 0));
            }
        }
        // ingesting the file into a fresh store gives the same blocks
        let other = memory_store();
        let r = other.put_bytes(&bytes, None).unwrap();
        assert_eq!(
            (r.tokens, r.blocks_written, r.checkpoints_written),
            (50, 3, 1)
        );
        assert_eq!(other.lookup(&toks).unwrap(), 50);
    }
    assert!(memory_store()
        .file_bytes(&toks, &Default::default(), None)
        .unwrap()
        .is_none());
}

#[test]
fn progress_reports_blocks_and_can_abort_a_put() {
    let store = memory_store();
    let mut c = SeedCache::new(params(false, GgmlType::F16, 256)).unwrap();
    fill(&mut c, 0, 256, 0);
    let toks = tokens(256, 0);
    let mut seen = Vec::new();
    let mut record = |d: u64, t: u64| {
        seen.push((d, t));
        true
    };
    store.put(&c, 0, &toks, Some(&mut record)).unwrap();
    assert_eq!(seen.first(), Some(&(0, 16)));
    assert_eq!(seen.last(), Some(&(16, 16)));
    let other = memory_store();
    let mut stop = |_: u64, _: u64| false;
    let e = other.put(&c, 0, &toks, Some(&mut stop)).unwrap_err();
    assert!(matches!(
        e,
        StoreError::Cache(llama_kv_cache::KvError::Aborted(_))
    ));
}

#[test]
fn block_size_and_model_are_validated() {
    let b: Arc<dyn Backend> = Arc::new(MemoryBackend::new(None));
    for bt in [0, 15, 4097] {
        assert!(matches!(
            PromptStore::new(b.clone(), "m", bt),
            Err(StoreError::InvalidArg(_))
        ));
    }
    assert!(matches!(
        PromptStore::new(b, "", 16),
        Err(StoreError::InvalidArg(_))
    ));
}

/// A recurrent cache (Mamba's one state per sequence) whose sequence 0 holds the state after
/// `n` tokens: rows as `row_byte` of a salt that stands for the state's content.
fn recurrent_state(n: u32, salt: u32) -> SeedCache {
    let mut p = CacheParams::new(4, 2, 64, 32);
    p.recurrent = true;
    p.n_seq_max = 4;
    let mut c = SeedCache::new(p).unwrap();
    // a recurrent memory takes a sequence's tokens as one group and keeps one cell for them
    let ub = UBatch {
        pos: (0..n as i32).collect(),
        n_seq_tokens: n,
        seq_ids: vec![vec![0]],
        ext: Vec::new(),
    };
    let slot = c.find_slot(&ub).unwrap().expect("room");
    for il in 0..c.n_layer() {
        for (which, v) in [(Tensor::K, false), (Tensor::V, true)] {
            let row = c.row_size(il, which).unwrap();
            let state = vec![row_byte(n, il, v, salt); row];
            c.write_rows(il, which, slot.head, &state).unwrap();
        }
    }
    c
}

#[test]
fn a_recurrent_cache_is_stored_as_checkpoints_and_restores_the_turn_a_prompt_diverges_after() {
    let store = memory_store();
    let conversation = tokens(70, 5);
    // saved after each turn: the state after 20 tokens (inside block 1), then after 48 (a block
    // boundary, which a recurrent memory still needs a checkpoint for)
    for (n, salt) in [(20, 1), (48, 2)] {
        let cache = recurrent_state(n, salt);
        let r = store
            .put(&cache, 0, &conversation[..n as usize], None)
            .unwrap();
        assert_eq!(
            (r.tokens, r.blocks_written, r.checkpoints_written),
            (n as u64, 0, 1)
        );
    }
    let mut diverged = conversation.clone();
    diverged[30] = -7;
    assert_eq!(store.lookup(&conversation).unwrap(), 48);
    assert_eq!(store.lookup(&diverged).unwrap(), 20);
    // never a prefix whose state is missing: 19 tokens end inside the first turn
    assert_eq!(store.lookup(&conversation[..19]).unwrap(), 0);
    for (prompt, n, salt) in [(&conversation, 48, 2), (&diverged, 20, 1)] {
        let mut dst = recurrent_state(1, 9);
        assert_eq!(store.restore(&mut dst, 2, prompt, None).unwrap(), n);
        assert_eq!(dst.seq_pos_max(2).unwrap(), n as i32 - 1);
        assert_eq!(
            rows_by_position(&dst, 2),
            rows_by_position(&recurrent_state(n as u32, salt), 0)
        );
        // the other sequence is untouched
        assert_eq!(
            rows_by_position(&dst, 0),
            rows_by_position(&recurrent_state(1, 9), 0)
        );
    }
    // a corrupt checkpoint is a counted miss, and the restore falls back to the longest prefix
    // that is still correct: the first turn's state
    let keys = store.keys(&conversation).unwrap().unwrap();
    let latest = checkpoint_key(&keys[2], &[]);
    let mut v = store.backend().get_many(&[latest]).unwrap()[0]
        .clone()
        .unwrap();
    let at = v.len() - 40;
    v[at] ^= 1;
    store.backend().remove(&latest).unwrap();
    store.backend().put_if_absent(&latest, &v).unwrap();
    let mut dst = recurrent_state(1, 9);
    assert_eq!(store.restore(&mut dst, 1, &conversation, None).unwrap(), 20);
    assert_eq!(
        rows_by_position(&dst, 1),
        rows_by_position(&recurrent_state(20, 1), 0)
    );
    assert_eq!(store.stats().unwrap().corrupt, 1);
    // a transformer cache cannot restore a recurrent store's states
    let (mut kv, _) = prompt(4);
    assert!(matches!(
        store.restore(&mut kv, 1, &conversation, None),
        Err(StoreError::Geometry(_))
    ));
}

#[test]
fn rotated_rows_are_stored_with_their_rotation_and_never_restored_into_an_unrotated_cache() {
    let rotated = |rot: u32| {
        let mut p = CacheParams::new(128, 2, 64, 64);
        (p.type_k, p.type_v, p.flash_attn) = (GgmlType::Q8_0, GgmlType::Q8_0, true);
        (p.n_rot_k, p.n_rot_v) = (rot, rot);
        p.n_seq_max = 4;
        p
    };
    let store = memory_store();
    let mut src = SeedCache::new(rotated(64)).unwrap();
    fill(&mut src, 0, 40, 3);
    let toks = tokens(40, 3);
    assert_eq!(store.put(&src, 0, &toks, None).unwrap().tokens, 40);
    let shape = store.shape().unwrap().unwrap();
    assert_eq!(shape.main.unwrap().rot, (64, 64));
    let mut dst = SeedCache::new(rotated(64)).unwrap();
    assert_eq!(store.restore(&mut dst, 1, &toks, None).unwrap(), 40);
    assert_eq!(rows_by_position(&dst, 1), rows_by_position(&src, 0));
    // the same bytes in an unrotated cache would mean other K/V: refused, cache unchanged
    let mut plain = SeedCache::new(rotated(0)).unwrap();
    let e = store.restore(&mut plain, 1, &toks, None).unwrap_err();
    assert!(matches!(e, StoreError::Geometry(_)), "{e}");
    assert!(e.to_string().contains("nRotK 64"), "{e}");
    assert_eq!(plain.seq_cell_count(1).unwrap(), 0);
    // and a file written from it records the rotation
    let (_, bytes) = store
        .file_bytes(&toks, &WriteFileOptions::default(), None)
        .unwrap()
        .unwrap();
    let ins = inspect_bytes(&bytes).unwrap();
    assert_eq!(
        (ins.header.version, ins.payload.streams[0].n_rot),
        (4, Some((64, 64)))
    );
}

const SECRET: &[u8] = b"the store's secret, 32 bytes ok!";

#[test]
fn two_namespaces_on_one_directory_share_nothing_and_cannot_touch_each_other() {
    let dir = tempfile::tempdir().unwrap();
    let tenant = |ns: &str| {
        PromptStore::new(
            Arc::new(DirBackend::open(dir.path(), None).unwrap()),
            "m",
            BT,
        )
        .unwrap()
        .with_namespace(ns)
    };
    let (a, b) = (tenant("a"), tenant("b"));
    let (src, toks) = prompt(40);
    a.put(&src, 0, &toks, None).unwrap();
    // B sees nothing of A's prompt, and its put of other rows under A's tokens stores its own
    // blocks (no skip counts that would tell A's prompt is there)
    assert_eq!(b.lookup(&toks).unwrap(), 0);
    let mut garbage = SeedCache::new(params(false, GgmlType::F16, 128)).unwrap();
    fill(&mut garbage, 0, 40, 77);
    let r = b.put(&garbage, 0, &toks, None).unwrap();
    assert_eq!((r.blocks_written, r.blocks_skipped), (2, 0));
    let mut dst = SeedCache::new(params(false, GgmlType::F16, 128)).unwrap();
    assert_eq!(a.restore(&mut dst, 0, &toks, None).unwrap(), 40);
    assert_eq!(rows_by_position(&dst, 0), rows_by_position(&src, 0));
    // the default namespace is a third one
    assert_eq!(tenant("").lookup(&toks).unwrap(), 0);
}

#[test]
fn with_a_secret_values_of_other_writers_are_rejected_never_loaded_and_replaced() {
    let (src, toks) = prompt(40);
    let mut garbage = SeedCache::new(params(false, GgmlType::F16, 128)).unwrap();
    fill(&mut garbage, 0, 40, 77);
    let open = |backend: &Arc<DirBackend>, secret: Option<&[u8]>| {
        let s = PromptStore::new(backend.clone(), "m", BT).unwrap();
        match secret {
            Some(k) => s.with_secret(k).unwrap(),
            None => s,
        }
    };
    for attacker in [None, Some(&b"another secret of 32 bytes, too!"[..])] {
        let dir = tempfile::tempdir().unwrap();
        let backend = Arc::new(DirBackend::open(dir.path(), None).unwrap());
        // the attacker writes first, at the very keys the honest store uses
        open(&backend, attacker)
            .put(&garbage, 0, &toks, None)
            .unwrap();
        let honest = open(&backend, Some(SECRET));
        assert_eq!(
            honest.lookup(&toks).unwrap(),
            0,
            "foreign values count as absent"
        );
        let mut dst = SeedCache::new(params(false, GgmlType::F16, 128)).unwrap();
        assert_eq!(honest.restore(&mut dst, 0, &toks, None).unwrap(), 0);
        assert_eq!(
            dst.seq_cell_count(0).unwrap(),
            0,
            "nothing of theirs loaded"
        );
        // the honest put replaces them: two blocks and the checkpoint (and its index)
        let r = honest.put(&src, 0, &toks, None).unwrap();
        assert_eq!(
            (r.blocks_written, r.blocks_skipped, r.checkpoints_written),
            (2, 0, 1)
        );
        assert!(honest.stats().unwrap().rejected >= 3);
        assert_eq!(honest.restore(&mut dst, 0, &toks, None).unwrap(), 40);
        assert_eq!(rows_by_position(&dst, 0), rows_by_position(&src, 0));
    }
    let dir = tempfile::tempdir().unwrap();
    let backend = Arc::new(DirBackend::open(dir.path(), None).unwrap());
    let honest = open(&backend, Some(SECRET));
    honest.put(&src, 0, &toks, None).unwrap();
    // bytes flipped on disk are never loaded either
    let keys = honest.keys(&toks).unwrap().unwrap();
    let file = backend.path_of(&keys[1]);
    let mut b = std::fs::read(&file).unwrap();
    let at = b.len() - 100;
    b[at] ^= 1;
    std::fs::write(&file, b).unwrap();
    let mut dst = SeedCache::new(params(false, GgmlType::F16, 128)).unwrap();
    assert_eq!(honest.restore(&mut dst, 0, &toks, None).unwrap(), 16);
    assert_eq!(honest.stats().unwrap().corrupt, 1);
    // and a secret shorter than 16 bytes is refused
    assert!(matches!(
        PromptStore::new(backend.clone(), "m", BT)
            .unwrap()
            .with_secret(b"short"),
        Err(StoreError::InvalidArg(_))
    ));
}

/// A flash-attention cache whose sequence 0 holds positions `p0..p0 + n` (rows by position).
fn window_cache(size: u32, p0: u32, n: u32) -> SeedCache {
    let mut c = SeedCache::new(params(true, GgmlType::F16, size)).unwrap();
    let slot = c
        .find_slot(&UBatch::sequence(0, p0 as i32, n))
        .unwrap()
        .expect("room");
    for il in 0..c.n_layer() {
        for (which, v) in [(Tensor::K, false), (Tensor::V, true)] {
            let row = c.row_size(il, which).unwrap();
            let rows: Vec<u8> = (p0..p0 + n)
                .flat_map(|p| std::iter::repeat_n(row_byte(p, il, v, 3), row))
                .collect();
            c.write_rows(il, which, slot.head, &rows).unwrap();
        }
    }
    c
}

/// `write_file` writes the store's own form with V rows straight from the blocks at their
/// offsets in the file: byte for byte what `file_bytes` assembles in memory, for every memory
/// kind; it writes no file when nothing is stored, falls back to a shorter prefix when a block
/// turns out corrupt, and a failure or an abort keeps the old file and leaves no temporary one.
#[test]
fn write_file_from_the_blocks_equals_the_bytes_assembled_in_memory_for_every_memory_kind() {
    let n = 100u32;
    let toks = tokens(n, 0);
    let full = || window_cache(128, 0, n);
    let kinds: [(&str, Vec<u8>); 5] = [
        ("unified", sequence_file(&toks, &[&full()])),
        (
            "iswa window",
            sequence_file(&toks, &[&full(), &window_cache(32, n - 24, 24)]),
        ),
        ("iswa whole", sequence_file(&toks, &[&full(), &full()])),
        (
            "hybrid",
            sequence_file(&toks, &[&full(), &recurrent_state(n, 1)]),
        ),
        ("recurrent", sequence_file(&toks, &[&recurrent_state(n, 2)])),
    ];
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.ggsq");
    let temps = || {
        fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().contains(".tmp-"))
            .count()
    };
    for (name, file) in kinds {
        let blocks = tempfile::tempdir().unwrap();
        let backend = Arc::new(DirBackend::open(blocks.path(), None).unwrap());
        let store = PromptStore::new(backend.clone(), "m", BT).unwrap();
        store.put_bytes(&file, None).unwrap();
        let opts = WriteFileOptions::default();
        let (len, want) = store.file_bytes(&toks, &opts, None).unwrap().unwrap();
        // V rows in today's sequence version: the form written from the blocks
        let ins = inspect_bytes(&want).unwrap();
        assert_eq!(ins.header.version, 4, "{name}");
        if !ins.payload.streams.is_empty() && name != "recurrent" {
            assert_eq!(ins.payload.streams[0].v_trans, Some(false), "{name}");
        }
        // an abort at the end keeps the file there before and leaves no temporary file
        fs::write(&out, b"the old file").unwrap();
        let mut stop = |_: u64, _: u64| false;
        let e = store
            .write_file(&toks, &out, &opts, Some(&mut stop))
            .unwrap_err();
        assert!(
            matches!(e, StoreError::Cache(llama_kv_cache::KvError::Aborted(_))),
            "{name}: {e}"
        );
        assert_eq!(fs::read(&out).unwrap(), b"the old file", "{name}: aborted");
        assert_eq!(temps(), 0, "{name}");
        assert_eq!(
            store.write_file(&toks, &out, &opts, None).unwrap(),
            len,
            "{name}"
        );
        assert_eq!(fs::read(&out).unwrap(), want, "{name}");
        // nothing stored for other tokens: no file
        let none = dir.path().join("none.ggsq");
        assert_eq!(
            store
                .write_file(&tokens(40, 9), &none, &opts, None)
                .unwrap(),
            0
        );
        assert!(!none.exists(), "{name}");
        // a directory that does not exist is an error, not "nothing stored"
        let e = store
            .write_file(&toks, &dir.path().join("missing/out.ggsq"), &opts, None)
            .unwrap_err();
        assert!(
            matches!(e, StoreError::Cache(llama_kv_cache::KvError::Io(_))),
            "{name}: {e}"
        );
        if name == "unified" {
            // the fourth block corrupt: the file holds the three before it, as in memory
            let keys = store.keys(&toks).unwrap().unwrap();
            let path = backend.path_of(&keys[3]);
            let mut b = fs::read(&path).unwrap();
            b[200] ^= 1;
            fs::write(&path, b).unwrap();
            let written = store.write_file(&toks, &out, &opts, None).unwrap();
            assert_eq!(written, 48);
            let (_, shorter) = store.file_bytes(&toks, &opts, None).unwrap().unwrap();
            assert_eq!(fs::read(&out).unwrap(), shorter);
        }
        assert_eq!(temps(), 0, "{name}");
    }
}
