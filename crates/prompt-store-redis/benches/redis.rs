//! Redis backend on loopback against baselines measured in the same run through the same
//! client: one `PING` (latency), raw pipelined `SET` / `MGET` of the same bytes (throughput).
//!
//! Run: `cargo bench -p prompt-store-redis` (starts its own redis-server).

#[path = "../tests/common/server.rs"]
mod server;

use std::time::{Duration, Instant};

use prompt_store_redis::RedisClient;
use server::RedisServer;

/// Blocks per measured batch and bytes per block (a 256-token block of a small model).
const BLOCKS: usize = 32;
const BLOCK_BYTES: usize = 1 << 20;
const REPS: usize = 7;

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

fn main() {
    let server = RedisServer::start();
    let client = RedisClient::new(&server.url(), Duration::from_secs(30)).unwrap();
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

    let keys: Vec<Vec<u8>> = (0..BLOCKS)
        .map(|i| format!("raw:{i}").into_bytes())
        .collect();
    let values: Vec<Vec<u8>> = (0..BLOCKS).map(|i| vec![i as u8; BLOCK_BYTES]).collect();
    let entries: Vec<(&[u8], &[u8])> = keys
        .iter()
        .zip(&values)
        .map(|(k, v)| (k.as_slice(), v.as_slice()))
        .collect();
    let total = BLOCKS * BLOCK_BYTES;
    let raw_set = time(|| {
        client.set_many(&entries, None, false).unwrap();
    });
    let raw_get = time(|| {
        let got = client.get_many(&keys).unwrap();
        assert_eq!(got.len(), BLOCKS);
    });

    println!(
        "redis loopback, {BLOCKS} blocks x {} KiB",
        BLOCK_BYTES / 1024
    );
    println!("| measurement | time | throughput |");
    println!("|---|---|---|");
    println!("| PING (median of 1000) | {:.1} us | |", ping * 1e6);
    println!(
        "| raw pipelined SET | {:.1} ms | {:.0} MB/s |",
        raw_set * 1e3,
        mbps(total, raw_set)
    );
    println!(
        "| raw MGET | {:.1} ms | {:.0} MB/s |",
        raw_get * 1e3,
        mbps(total, raw_get)
    );
}
