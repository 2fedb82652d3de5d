//! The prompt store on Redis (loopback) against baselines measured in the same run through the
//! same client: `lookup` of a 128-block chain against one `PING`; `put` and `restore` of a
//! 128-block prompt against a raw pipelined `SET` / one `MGET` of the very same block values; and 8
//! restores at once.
//!
//! Run: `cargo bench -p prompt-store-redis` (starts its own redis-server).

#[path = "../tests/common/server.rs"]
mod server;

use std::time::{Duration, Instant};

use std::sync::Arc;

use llama_kv_cache::{CacheParams, Layout, SeedCache, Tensor, UBatch};
use prompt_store::PromptStore;
use prompt_store_redis::{RedisBackend, RedisClient, RedisOptions};
use server::RedisServer;

/// 128 blocks of 16 tokens; 4 layers of 1,024 f16 K and V values: 16 KiB per token, 256 KiB
/// per block, 32 MiB per prompt.
const BLOCKS: usize = 128;
const BLOCK_TOKENS: u32 = 16;
const TOKENS: u32 = BLOCKS as u32 * BLOCK_TOKENS;
const REPS: usize = 9;
const CONCURRENT: usize = 8;

fn params() -> CacheParams {
    CacheParams::new(TOKENS, 4, 1024, 1024)
}

/// The same cache with flash attention (V untransposed, as blocks keep it), the layout of the
/// 8B geometry the long-running-app issue measures.
fn flash_params() -> CacheParams {
    let mut p = params();
    p.flash_attn = true;
    p
}

/// A cache whose sequence 0 holds `tokens`, each row of layer `il` as `row(il, bytes)` gives
/// it (all tokens' rows of that layer and tensor at once).
fn filled(
    params: CacheParams,
    tokens: &[i32],
    row: impl Fn(u32, usize, usize) -> Vec<u8>,
) -> SeedCache {
    let mut cache = SeedCache::new(params).unwrap();
    let slot = cache
        .find_slot(&UBatch::sequence(0, 0, tokens.len() as u32))
        .unwrap()
        .unwrap();
    for il in 0..cache.n_layer() {
        for which in [Tensor::K, Tensor::V] {
            let rows = row(il, cache.row_size(il, which).unwrap(), tokens.len());
            cache.write_rows(il, which, slot.head, &rows).unwrap();
        }
    }
    cache
}

/// Rows of byte ramps.
fn evaluated(params: CacheParams, tokens: &[i32]) -> SeedCache {
    filled(params, tokens, |il, row, n| {
        (0..row * n).map(|i| (i * 7 + il as usize) as u8).collect()
    })
}

/// Puts `source`'s sequence 0 (`tokens`) into an empty database; the Redis keys of its
/// blocks, for the raw baselines.
fn stored(
    backend: &RedisBackend,
    store: &PromptStore,
    source: &SeedCache,
    tokens: &[i32],
) -> Vec<Vec<u8>> {
    flush(backend.client());
    store.put(source, 0, tokens, None).unwrap();
    store
        .keys(tokens)
        .unwrap()
        .unwrap()
        .iter()
        .map(|key| backend.redis_key(key))
        .collect()
}

fn median(mut samples: Vec<f64>) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

fn time(mut op: impl FnMut()) -> f64 {
    op(); // warm: connection set-up and allocator
    median(
        (0..REPS)
            .map(|_| {
                let t = Instant::now();
                op();
                t.elapsed().as_secs_f64()
            })
            .collect(),
    )
}

fn mbps(bytes: usize, seconds: f64) -> f64 {
    bytes as f64 / seconds / 1e6
}

fn flush(client: &RedisClient) {
    client.command(redis::cmd("FLUSHDB")).unwrap();
}

fn main() {
    let server = RedisServer::start();
    let url = server.url();
    let backend = Arc::new(
        RedisBackend::new(RedisOptions::new(url.clone()).with_timeout(Duration::from_secs(60)))
            .unwrap(),
    );
    let client = backend.client().clone();
    let store = PromptStore::new(backend.clone(), "bench-model", BLOCK_TOKENS).unwrap();
    client.ping().unwrap();

    let ping = median(
        (0..1000)
            .map(|_| {
                let t = Instant::now();
                client.ping().unwrap();
                t.elapsed().as_secs_f64()
            })
            .collect(),
    );

    let tokens: Vec<i32> = (0..TOKENS as i32).collect();
    let source = evaluated(params(), &tokens);

    // the values the store writes, for the raw baselines (same bytes, same client)
    let keys = stored(&backend, &store, &source, &tokens);
    let values: Vec<Vec<u8>> = client
        .get_many(&keys)
        .unwrap()
        .into_iter()
        .map(Option::unwrap)
        .collect();
    let total: usize = values.iter().map(Vec::len).sum();
    let raw_keys: Vec<Vec<u8>> = (0..BLOCKS)
        .map(|i| format!("raw:{i}").into_bytes())
        .collect();
    let entries: Vec<(&[u8], &[u8])> = raw_keys
        .iter()
        .zip(&values)
        .map(|(k, v)| (k.as_slice(), v.as_slice()))
        .collect();

    // each repetition times the baseline and the store operation back to back, so a load swing
    // on the machine hits both: the ratios are medians of per-repetition ratios
    let mut restored = None;
    let (mut raw_set, mut put, mut raw_get, mut restore) = (vec![], vec![], vec![], vec![]);
    // `get_many` is one MGET on a server, as a restore reads; `raw_get` is the pipeline of
    // GETs a cluster sends each primary, on the same server
    let mut raw_mget = vec![];
    let (mut put_ratio, mut restore_ratio) = (vec![], vec![]);
    let (mut restore_flash, mut restore_flash_ratio) = (vec![], vec![]);
    for rep in 0..=REPS {
        flush(&client); // both writes go to an empty database (not timed)
        let t = Instant::now();
        client.set_many(&entries, None, false).unwrap();
        let set_time = t.elapsed().as_secs_f64();
        let t = Instant::now();
        assert_eq!(
            store.put(&source, 0, &tokens, None).unwrap().blocks_written,
            BLOCKS as u64
        );
        let put_time = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let gets = client.per_key(&raw_keys, |pipe, i| {
            pipe.cmd("GET").arg(&raw_keys[i]);
        });
        assert_eq!(gets.unwrap().len(), BLOCKS);
        let get_time = t.elapsed().as_secs_f64();
        let t = Instant::now();
        assert_eq!(client.get_many(&raw_keys).unwrap().len(), BLOCKS);
        let mget_time = t.elapsed().as_secs_f64();
        // into a fresh cache (made untimed), as an app restoring a chat does
        let target = restored.insert(SeedCache::new(params()).unwrap());
        let t = Instant::now();
        assert_eq!(
            store.restore(target, 0, &tokens, None).unwrap(),
            TOKENS as u64
        );
        let restore_time = t.elapsed().as_secs_f64();
        let mut flash = SeedCache::new(flash_params()).unwrap();
        let t = Instant::now();
        assert_eq!(
            store.restore(&mut flash, 0, &tokens, None).unwrap(),
            TOKENS as u64
        );
        let restore_flash_time = t.elapsed().as_secs_f64();
        if rep == 0 {
            continue; // warm-up
        }
        raw_set.push(set_time);
        put.push(put_time);
        raw_get.push(get_time);
        raw_mget.push(mget_time);
        restore.push(restore_time);
        put_ratio.push(set_time / put_time);
        restore_ratio.push(mget_time / restore_time);
        restore_flash.push(restore_flash_time);
        restore_flash_ratio.push(mget_time / restore_flash_time);
    }
    let (raw_set, put, raw_get, restore) = (
        median(raw_set),
        median(put),
        median(raw_get),
        median(restore),
    );
    let (put_ratio, restore_ratio) = (median(put_ratio), median(restore_ratio));
    let target = restored.expect("restored at least once");
    assert_eq!(
        target.state_write(0, Layout::Streams, 1, None).unwrap(),
        source.state_write(0, Layout::Streams, 1, None).unwrap()
    );

    let lookup = median(
        (0..200)
            .map(|_| {
                let t = Instant::now();
                assert_eq!(store.lookup(&tokens).unwrap(), TOKENS as u64);
                t.elapsed().as_secs_f64()
            })
            .collect(),
    );

    // the same restore from the in-process memory backend: the store's own share of the time
    let memory = PromptStore::new(
        Arc::new(prompt_store::MemoryBackend::new(None)),
        "bench-model",
        BLOCK_TOKENS,
    )
    .unwrap();
    memory.put(&source, 0, &tokens, None).unwrap();
    // into a fresh cache each time (made untimed), as the restores above
    let memory_restore = median(
        (0..REPS)
            .map(|_| {
                let mut fresh = SeedCache::new(params()).unwrap();
                let t = Instant::now();
                assert_eq!(
                    memory.restore(&mut fresh, 0, &tokens, None).unwrap(),
                    TOKENS as u64
                );
                t.elapsed().as_secs_f64()
            })
            .collect(),
    );

    let mut targets: Vec<SeedCache> = (0..CONCURRENT)
        .map(|_| SeedCache::new(params()).unwrap())
        .collect();
    let concurrent = time(|| {
        std::thread::scope(|scope| {
            for target in targets.iter_mut() {
                let store = &store;
                let tokens = &tokens;
                scope.spawn(move || {
                    assert_eq!(
                        store.restore(target, 0, tokens, None).unwrap(),
                        TOKENS as u64
                    );
                });
            }
        });
    });

    println!(
        "redis loopback: {BLOCKS} blocks x {BLOCK_TOKENS} tokens, {:.1} MiB per prompt",
        total as f64 / (1 << 20) as f64
    );
    println!("| measurement | time | throughput | vs baseline |");
    println!("|---|---|---|---|");
    println!("| PING (median of 1000) | {:.1} us | | |", ping * 1e6);
    println!(
        "| lookup, {BLOCKS}-block chain (median of 200) | {:.1} us | | {:.1}x PING |",
        lookup * 1e6,
        lookup / ping
    );
    println!(
        "| raw pipelined SET of the block values | {:.1} ms | {:.0} MB/s | |",
        raw_set * 1e3,
        mbps(total, raw_set)
    );
    println!(
        "| put (encode + SET NX) | {:.1} ms | {:.0} MB/s | {:.2}x raw SET |",
        put * 1e3,
        mbps(total, put),
        put_ratio
    );
    let raw_mget = median(raw_mget);
    println!(
        "| raw MGET of the block values (one command) | {:.1} ms | {:.0} MB/s | |",
        raw_mget * 1e3,
        mbps(total, raw_mget)
    );
    println!(
        "| raw pipelined GET of the block values (as a cluster reads) | {:.1} ms | {:.0} MB/s | {:.2}x raw MGET |",
        raw_get * 1e3,
        mbps(total, raw_get),
        raw_mget / raw_get
    );
    println!(
        "| restore (EXISTS + MGET + verify + load) | {:.1} ms | {:.0} MB/s | {:.2}x raw MGET |",
        restore * 1e3,
        mbps(total, restore),
        restore_ratio
    );
    let restore_flash = median(restore_flash);
    println!(
        "| restore into a flash-attention cache (V as stored, no transpose) | {:.1} ms | {:.0} MB/s | {:.2}x raw MGET |",
        restore_flash * 1e3,
        mbps(total, restore_flash),
        median(restore_flash_ratio)
    );
    println!(
        "| restore from the memory backend (no network) | {:.1} ms | {:.0} MB/s | |",
        memory_restore * 1e3,
        mbps(total, memory_restore)
    );
    println!(
        "| {CONCURRENT} restores at once | {:.1} ms | {:.0} MB/s total | {:.2}x raw MGET |",
        concurrent * 1e3,
        mbps(total * CONCURRENT, concurrent),
        mbps(total * CONCURRENT, concurrent) / mbps(total, raw_mget)
    );

    eight_b_restore(&backend, &client);
    eight_b_compressed(&backend, &client);
}

/// A restore at the 8B geometry the long-running-app issue measures (32 layers of 1,024-wide
/// f16 K and V, flash attention, 8,192 cells) of a 2,048-token chat (256 MiB in 128 blocks)
/// into a fresh cache, against one raw `MGET` of the same values, back to back in each
/// repetition; the ratio is the median of the per-repetition ratios.
fn eight_b_restore(backend: &Arc<RedisBackend>, client: &RedisClient) {
    let params = || {
        let mut p = CacheParams::new(8192, 32, 1024, 1024);
        p.flash_attn = true;
        p
    };
    let tokens: Vec<i32> = (0..2048).collect();
    let store = PromptStore::new(backend.clone(), "bench-8b", BLOCK_TOKENS).unwrap();
    let keys = stored(backend, &store, &evaluated(params(), &tokens), &tokens);
    let (mut mgets, mut visits, mut restores) = (vec![], vec![], vec![]);
    let (mut ratios, mut visit_ratios) = (vec![], vec![]);
    let mut total = 0;
    for rep in 0..=REPS {
        let t = Instant::now();
        let values = client.get_many(&keys).unwrap();
        let mget = t.elapsed().as_secs_f64();
        total = values.iter().flatten().map(Vec::len).sum();
        drop(values);
        // the same MGET visited off the socket into one reused buffer, touching nothing else
        let t = Instant::now();
        let mut seen = 0;
        client
            .visit_values(&keys, &mut |_, v| {
                seen += v.map_or(0, <[u8]>::len);
                true
            })
            .unwrap();
        let visit = t.elapsed().as_secs_f64();
        assert_eq!(seen, total);
        let mut fresh = SeedCache::new(params()).unwrap();
        let t = Instant::now();
        assert_eq!(store.restore(&mut fresh, 0, &tokens, None).unwrap(), 2048);
        let restore = t.elapsed().as_secs_f64();
        if rep > 0 {
            mgets.push(mget);
            visits.push(visit);
            restores.push(restore);
            ratios.push(mget / restore);
            visit_ratios.push(visit / restore);
        }
    }
    let (mget, visit, restore) = (median(mgets), median(visits), median(restores));
    println!(
        "| 8B geometry (32 layers, flash attention): raw MGET of a 2,048-token chat's {} blocks | {:.1} ms | {:.0} MB/s | |",
        keys.len(),
        mget * 1e3,
        mbps(total, mget)
    );
    println!(
        "| 8B geometry: the same MGET read off the socket into one reused buffer ({} bulk reads) | {:.1} ms | {:.0} MB/s | {:.2}x raw MGET |",
        if client.bulk_reads() > 0 { "the store's" } else { "no" },
        visit * 1e3,
        mbps(total, visit),
        mget / visit
    );
    println!(
        "| 8B geometry: restore of the same chat into a fresh cache | {:.1} ms | {:.0} MB/s | {:.2}x raw MGET, {:.2}x the read off the socket |",
        restore * 1e3,
        mbps(total, restore),
        median(ratios),
        median(visit_ratios)
    );
}

/// Rows of activations-like f16 values (smooth in the token, varied in the channel), so that
/// q8_0 and zstd see what a model's K and V look like rather than byte ramps.
fn activations(params: CacheParams, tokens: &[i32]) -> SeedCache {
    use llama_kv_cache::tensors::quant::quantize_row;
    filled(params, tokens, |il, row, n| {
        let mut rows = vec![0u8; row * n];
        let mut f = vec![0f32; row / 2];
        for (t, out) in rows.chunks_exact_mut(row).enumerate() {
            for (c, x) in f.iter_mut().enumerate() {
                let scale = 1.0 + (c % 64) as f32 / 16.0;
                *x = ((t as f32 * 0.01 + c as f32 * 0.37 + il as f32).sin()) * scale;
            }
            quantize_row(llama_kv_cache::GgmlType::F16, &f, out).unwrap();
        }
        rows
    })
}

/// The 8B restore of [`eight_b_restore`] with the blocks kept as each `compress` mode of a
/// tier keeps them, on f16 activations: bytes on the server and restore time against the
/// uncompressed store's, interleaved per repetition.
fn eight_b_compressed(backend: &Arc<RedisBackend>, client: &RedisClient) {
    use prompt_store::seal::Sealer;
    use prompt_store::{Backend, Compressed, Compression};
    let params = || {
        let mut p = CacheParams::new(8192, 32, 1024, 1024);
        p.flash_attn = true;
        p
    };
    let tokens: Vec<i32> = (0..2048).collect();
    let source = activations(params(), &tokens);
    flush(client);
    let modes = [Compression::None, Compression::Lossless, Compression::Q8_0];
    let stores: Vec<(Compression, PromptStore, usize)> = modes
        .into_iter()
        .map(|mode| {
            let tier: Arc<dyn Backend> =
                Arc::new(Compressed::new(backend.clone(), mode, Sealer::new(None)));
            // one model name per mode: the three stores' blocks live side by side
            let store =
                PromptStore::new(tier, &format!("bench-8b-{mode:?}"), BLOCK_TOKENS).unwrap();
            store.put(&source, 0, &tokens, None).unwrap();
            let keys: Vec<Vec<u8>> = store
                .keys(&tokens)
                .unwrap()
                .unwrap()
                .iter()
                .map(|k| backend.redis_key(k))
                .collect();
            let bytes = client
                .get_many(&keys)
                .unwrap()
                .iter()
                .flatten()
                .map(Vec::len)
                .sum();
            (mode, store, bytes)
        })
        .collect();
    let mut times = vec![Vec::new(); stores.len()];
    for rep in 0..=REPS {
        for (i, (_, store, _)) in stores.iter().enumerate() {
            let mut fresh = SeedCache::new(params()).unwrap();
            let t = Instant::now();
            assert_eq!(store.restore(&mut fresh, 0, &tokens, None).unwrap(), 2048);
            if rep > 0 {
                times[i].push(t.elapsed().as_secs_f64());
            }
        }
    }
    let base = median(times[0].clone());
    let base_bytes = stores[0].2;
    for ((mode, _, bytes), samples) in stores.iter().zip(times) {
        let t = median(samples);
        println!(
            "| 8B geometry, f16 activations, compress {:?}: restore from Redis | {:.1} ms | {:.1} MiB stored ({:.2}x smaller) | {:.2}x uncompressed |",
            mode,
            t * 1e3,
            *bytes as f64 / (1 << 20) as f64,
            base_bytes as f64 / *bytes as f64,
            base / t
        );
    }
}
