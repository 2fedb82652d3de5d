//! Prompt store figures against baselines measured in the same run:
//! - hashing: the chain keys of a 32k-token prompt, in GB/s of token bytes;
//! - warm lookup of a 32k-token prompt (128 blocks of 256) in `dir`, against 128 raw `stat`s;
//! - `put` and `restore` of a 4,096-token sequence (4 layers, n_embd 1024, f16: 64 MiB) in `dir`,
//!   against writing and reading the same bytes as plain files (`fs::write` / `fs::read`, the
//!   bytes read kept in memory as a restore keeps them).
//!
//! Run: `cargo bench -p prompt-store --bench store` (set `TMPDIR` to choose the disk).

use std::fs;
use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use llama_kv_cache::{CacheParams, KvCache, Tensor, UBatch};
use prompt_store::{chain_keys, Backend, DirBackend, Geometry, PromptStore};

const REPS: usize = 7;

/// Median seconds of `REPS` runs of `op` (after one untimed run).
fn time(mut op: impl FnMut()) -> f64 {
    time_with(|| (), |_| op())
}

/// Median seconds of `REPS` runs of `op` on fresh state from `setup` (not timed).
fn time_with<S>(mut setup: impl FnMut() -> S, mut op: impl FnMut(S)) -> f64 {
    op(setup());
    let mut v: Vec<f64> = (0..REPS)
        .map(|_| {
            let s = setup();
            let t = Instant::now();
            op(s);
            t.elapsed().as_secs_f64()
        })
        .collect();
    v.sort_by(f64::total_cmp);
    v[REPS / 2]
}

fn ms(s: f64) -> String {
    format!("{:.3} ms", s * 1e3)
}

fn cache(cells: u32, layers: u32, embd: u32) -> KvCache {
    cache_fa(cells, layers, embd, false)
}

fn cache_fa(cells: u32, layers: u32, embd: u32, flash_attn: bool) -> KvCache {
    let mut p = CacheParams::new(cells, layers, embd, embd);
    p.n_seq_max = 2;
    p.flash_attn = flash_attn;
    let mut c = KvCache::new(p).unwrap();
    c.find_slot(&UBatch::sequence(0, 0, cells))
        .unwrap()
        .unwrap();
    for il in 0..layers {
        for which in [Tensor::K, Tensor::V] {
            let row = c.row_size(il, which).unwrap();
            let rows: Vec<u8> = (0..row * cells as usize)
                .map(|i| (i * 7 + il as usize) as u8)
                .collect();
            c.write_rows(il, which, 0, &rows).unwrap();
        }
    }
    c
}

fn main() {
    let tmp = tempfile::tempdir().unwrap();
    let tokens: Vec<i32> = (0..32768).map(|i| (i * 7919) % 32000).collect();

    // hashing
    let small = cache(16, 1, 8);
    let fp = prompt_store::Shape {
        memory: llama_kv_cache::MemoryKind::Unified,
        main: Some(prompt_store::KvShape {
            layers: Geometry::of_cache(&small).unwrap(),
            rot: (0, 0),
        }),
        swa: None,
        recurrent: None,
    }
    .fingerprint("bench");
    let t_chain = time(|| {
        black_box(chain_keys(&fp, black_box(&tokens), 256));
    });
    let token_bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    let t_flat = time(|| {
        black_box(blake3::hash(black_box(&token_bytes)));
    });
    let gbs = |s: f64| token_bytes.len() as f64 / s / 1e9;
    println!(
        "hashing 32k tokens: chain {} ({:.2} GB/s); one blake3 call over the same bytes {} ({:.2} GB/s); ratio {:.2}",
        ms(t_chain),
        gbs(t_chain),
        ms(t_flat),
        gbs(t_flat),
        t_flat / t_chain
    );

    // warm lookup of 128 blocks in dir (tiny rows: the lookup reads no block)
    let dir = tmp.path().join("lookup");
    let backend = Arc::new(DirBackend::open(&dir, None).unwrap());
    let store = PromptStore::new(backend.clone(), "bench", 256).unwrap();
    let big = cache(32768, 1, 8);
    store.put(&big, 0, &tokens, None).unwrap();
    assert_eq!(store.lookup(&tokens).unwrap(), 32768);
    let t_lookup = time(|| {
        black_box(store.lookup(black_box(&tokens)).unwrap());
    });
    let keys = store.keys(&tokens).unwrap().unwrap();
    let paths: Vec<_> = keys.iter().map(|k| backend.path_of(k)).collect();
    let t_stat = time(|| {
        black_box(paths.iter().filter(|p| p.is_file()).count());
    });
    println!(
        "warm lookup of 32k tokens (128 blocks) in dir: {} (128 raw stats: {}; ratio {:.2}); limit 1 ms",
        ms(t_lookup),
        ms(t_stat),
        t_stat / t_lookup
    );
    drop(big);

    // put and restore against plain file writes and reads of the same bytes
    let toks: Vec<i32> = tokens[..4096].to_vec();
    for flash_attn in [true, false] {
        let src = cache_fa(4096, 4, 1024, flash_attn);
        let put_dir = tmp.path().join("put");
        let mut put_store = None;
        let mut bytes = 0;
        let t_put = time_with(
            || {
                // an empty store each time (the model record written before timing)
                let _ = fs::remove_dir_all(&put_dir);
                let b: Arc<dyn Backend> = Arc::new(DirBackend::open(&put_dir, None).unwrap());
                let s = PromptStore::new(b, "bench", 256).unwrap();
                s.put(&src, 0, &toks[..0], None).unwrap();
                s
            },
            |s| {
                bytes = s.put(&src, 0, &toks, None).unwrap().bytes_written;
                put_store = Some(s);
            },
        );
        let store = put_store.unwrap();
        let raw_dir = tmp.path().join("raw");
        fs::create_dir_all(&raw_dir).unwrap();
        let block = vec![0x5au8; bytes as usize / 16];
        let t_write = time(|| {
            for i in 0..16 {
                fs::write(raw_dir.join(format!("{i}")), &block).unwrap();
            }
        });
        let mut dst = cache_fa(4096, 4, 1024, flash_attn);
        dst.clear().unwrap();
        let t_restore = time(|| {
            assert_eq!(store.restore(&mut dst, 1, &toks, None).unwrap(), 4096);
        });
        // the bytes read are kept, as a restore keeps them (in the cache)
        let t_read = time(|| {
            let all: Vec<Vec<u8>> = (0..16)
                .map(|i| fs::read(raw_dir.join(format!("{i}"))).unwrap())
                .collect();
            black_box(all);
        });
        let mib = bytes as f64 / (1 << 20) as f64;
        let v = if flash_attn {
            "V rows (flash attention)"
        } else {
            "V transposed"
        };
        println!(
            "put of 4096 tokens, {v} ({mib:.1} MiB in 16 blocks) to dir: {} ({:.2} GB/s); raw write {}; ratio {:.2} (goal >= 0.5)",
            ms(t_put),
            bytes as f64 / t_put / 1e9,
            ms(t_write),
            t_write / t_put
        );
        println!(
            "restore of the same: {} ({:.2} GB/s); raw read {}; ratio {:.2} (goal >= 0.5)",
            ms(t_restore),
            bytes as f64 / t_restore / 1e9,
            ms(t_read),
            t_read / t_restore
        );
    }
}
