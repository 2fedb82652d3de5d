//! Data movement against `memcpy` measured in the same run: defrag (the bytes it reports as
//! copied vs one `copy_from_slice` of as many bytes), K-shift of an f16 cache (vs a copy of all
//! K bytes), and the row quantizers / dequantizers of every KV type (vs a copy of the f32 bytes).
//!
//! Layout: 4,096 cells, 4 layers, n_embd 1024 (8 heads of 128), f16 unless stated. The table the
//! team reads is printed at the end from `Instant` medians; criterion groups run the same work.
//!
//! Run: `cargo bench -p llama-kv-cache --bench data`.

mod common;

use common::{fmt, median, ns};
use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BatchSize, Criterion, Throughput};
use llama_kv_cache::state::files::{read_file, write_atomic};
use llama_kv_cache::tensors::quant::{dequantize_row, quantize_row};
use llama_kv_cache::{
    CacheParams, GgmlType, Layout, ReadOptions, RopeParams, RopeTable, RopeType, SeedCache,
    ShiftParams, Tensor, UBatch, WriteOptions, DEFAULT_MAX_NODES,
};

const CELLS: u32 = 4096;
const LAYERS: u32 = 4;
const HEAD_DIM: usize = 128;
const HEADS: usize = 8;
const EMBD: u32 = (HEAD_DIM * HEADS) as u32;
/// Elements converted per quantizer measurement (4 MiB of f32), in rows of `EMBD`.
const QUANT_ELEMS: usize = 1 << 20;
/// Timed repetitions per measurement (the median is printed).
const REPS: usize = 9;

/// Median of `REPS` timings of `op` on fresh inputs from `setup` (setup not timed).
fn time_with<S, R>(mut setup: impl FnMut() -> S, mut op: impl FnMut(&mut S) -> R) -> f64 {
    let mut samples = Vec::with_capacity(REPS);
    // one untimed run first: page faults and cold caches are not what is compared
    let mut s = setup();
    black_box(op(&mut s));
    for _ in 0..REPS {
        let mut s = setup();
        let t = Instant::now();
        let r = op(&mut s);
        samples.push(ns(t.elapsed()));
        black_box((r, &s));
    }
    median(samples)
}

/// Median time of one `copy_from_slice` of `bytes` bytes between two pre-touched buffers.
fn time_memcpy(bytes: usize) -> f64 {
    let src = vec![0x5au8; bytes];
    let mut dst = vec![0xa5u8; bytes];
    time_with(
        || (),
        |_| {
            dst.copy_from_slice(black_box(&src));
            black_box(dst[bytes / 2])
        },
    )
}

fn params(flash_attn: bool) -> CacheParams {
    let mut p = CacheParams::new(CELLS, LAYERS, EMBD, EMBD);
    p.n_seq_max = 4;
    p.flash_attn = flash_attn;
    p
}

/// Fills every cell: cell `i` gets sequence `owner(i)`, placed by `find_slot` in 512-token
/// per-token ubatches.
fn filled(p: CacheParams, owner: impl Fn(u32) -> i32) -> SeedCache {
    let mut c = SeedCache::new(p).unwrap();
    let mut next = [0i32; 4];
    for b in 0..CELLS / 512 {
        let (mut pos, mut seqs) = (Vec::new(), Vec::new());
        for i in b * 512..(b + 1) * 512 {
            let s = owner(i);
            pos.push(next[s as usize]);
            next[s as usize] += 1;
            seqs.push(vec![s]);
        }
        c.find_slot(&UBatch::per_token(pos, seqs)).unwrap().unwrap();
    }
    c
}

/// A defrag case: how the cache is filled, and which sequence is removed before the defrag.
struct DefragCase {
    name: &'static str,
    flash_attn: bool,
    owner: fn(u32) -> i32,
}

const DEFRAG_CASES: [DefragCase; 3] = [
    DefragCase {
        name: "defrag 2 interleaved seqs, rm 1 (V transposed)",
        flash_attn: false,
        owner: |i| (i % 2) as i32,
    },
    DefragCase {
        name: "defrag 2 interleaved seqs, rm 1 (flash attn)",
        flash_attn: true,
        owner: |i| (i % 2) as i32,
    },
    DefragCase {
        name: "defrag 4 seq blocks, rm 2nd (V transposed)",
        flash_attn: false,
        owner: |i| (i / (CELLS / 4)) as i32,
    },
];

impl DefragCase {
    /// The fragmented cache, ready to defrag. Every K/V row is written first, as decoding
    /// would: a defrag of never-written tensors times the page faults of their first writes
    /// (the zero pages the OS hands out lazily), not the moves.
    fn prepare(&self) -> SeedCache {
        let mut c = filled(params(self.flash_attn), self.owner);
        let rows = vec![0x3cu8; CELLS as usize * EMBD as usize * 2];
        for il in 0..LAYERS {
            for which in [Tensor::K, Tensor::V] {
                c.write_rows(il, which, 0, &rows).unwrap();
            }
        }
        c.seq_rm(1, -1, -1).unwrap();
        c
    }
}

fn shift_params() -> ShiftParams {
    ShiftParams {
        rope: RopeParams::new(HEAD_DIM, HEAD_DIM, HEADS, RopeType::Norm),
        per_layer: vec![],
    }
}

/// Deterministic values shaped like activations (sum of uniforms, a few outliers).
fn values(n: usize) -> Vec<f32> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    (0..n)
        .map(|i| {
            let v = next() + next() + next();
            if i % 997 == 0 {
                v * 20.0
            } else {
                v
            }
        })
        .collect()
}

fn quantize_all(ty: GgmlType, src: &[f32], dst: &mut [u8]) {
    let row = ty.row_size(EMBD as usize).unwrap();
    for (x, q) in src
        .chunks_exact(EMBD as usize)
        .zip(dst.chunks_exact_mut(row))
    {
        quantize_row(ty, x, q).unwrap();
    }
}

fn dequantize_all(ty: GgmlType, src: &[u8], dst: &mut [f32]) {
    let row = ty.row_size(EMBD as usize).unwrap();
    for (q, y) in src
        .chunks_exact(row)
        .zip(dst.chunks_exact_mut(EMBD as usize))
    {
        dequantize_row(ty, q, y).unwrap();
    }
}

fn gbs(bytes: f64, ns: f64) -> String {
    format!("{:.2}", bytes / ns)
}

/// Criterion times for work of about `est_ns` per iteration: about 30 measured iterations.
fn criterion_for(est_ns: f64) -> Criterion {
    let est = Duration::from_nanos(est_ns.max(1000.0) as u64);
    Criterion::default()
        .sample_size(10)
        .warm_up_time((est * 3).min(Duration::from_millis(100)))
        .measurement_time((est * 30).clamp(Duration::from_millis(1), Duration::from_millis(500)))
        .without_plots()
        .configure_from_args()
}

struct Row {
    name: String,
    bytes: f64,
    ours: f64,
    memcpy: f64,
    extra: String,
}

fn main() {
    let wall = Instant::now();
    let mut rows = Vec::new();

    // defrag
    let mut defrag_bytes = Vec::new();
    for case in &DEFRAG_CASES {
        let report = case.prepare().defrag_now(DEFAULT_MAX_NODES).unwrap();
        let bytes = report.bytes_copied as usize;
        assert!(bytes > 0, "{}: nothing moved", case.name);
        let ours = time_with(
            || case.prepare(),
            |c| c.defrag_now(DEFAULT_MAX_NODES).unwrap().bytes_copied,
        );
        rows.push(Row {
            name: case.name.to_string(),
            bytes: bytes as f64,
            ours,
            memcpy: time_memcpy(bytes),
            extra: format!(
                "{} cells in {} runs",
                report.cells_moved,
                report.moves.len()
            ),
        });
        defrag_bytes.push(bytes);
    }

    // K-shift: every cell shifted by one position, all 4 layers rotated
    let mut kcache = filled(params(false), |_| 0);
    let shift = shift_params();
    let k_bytes = kcache.size_k_bytes();
    let kshift = time_with(
        || (),
        |_| {
            kcache.seq_add(0, -1, -1, 1).unwrap();
            kcache.update(Some(&shift), None).unwrap().shifted_cells
        },
    );
    let seq_add_only = {
        let mut c = filled(params(false), |_| 0);
        time_with(|| (), |_| c.seq_add(0, -1, -1, 1).unwrap())
    };
    // the same per-row work outside the cache, split into its parts
    let n_rows = (CELLS * LAYERS) as usize;
    let width = EMBD as usize;
    let mut k_rows = vec![0u8; n_rows * width * 2];
    quantize_all(GgmlType::F16, &values(n_rows * width), &mut k_rows);
    let table = RopeTable::new(&shift.rope, 1);
    let mut row = vec![0f32; width];
    let loop_alone = time_with(
        || (),
        |_| {
            for bytes in k_rows.chunks_exact_mut(width * 2) {
                dequantize_row(GgmlType::F16, bytes, &mut row).unwrap();
                table.rotate(&mut row);
                quantize_row(GgmlType::F16, &row, bytes).unwrap();
            }
        },
    );
    let round_trip = time_with(
        || (),
        |_| {
            for bytes in k_rows.chunks_exact_mut(width * 2) {
                dequantize_row(GgmlType::F16, bytes, &mut row).unwrap();
                quantize_row(GgmlType::F16, &row, bytes).unwrap();
            }
        },
    );
    let rotate_only = time_with(
        || (),
        |_| {
            for _ in 0..n_rows {
                table.rotate(black_box(&mut row));
            }
        },
    );
    rows.push(Row {
        name: "K-shift f16 (seq_add all + update)".into(),
        bytes: k_bytes as f64,
        ours: kshift,
        memcpy: time_memcpy(k_bytes),
        extra: format!(
            "{} rows of {} (seq_add alone {})",
            CELLS * LAYERS,
            EMBD,
            fmt(seq_add_only)
        ),
    });

    // state payloads and files: a whole cache of 4 sequences with real rows
    for flash_attn in [true, false] {
        let mut c = filled(params(flash_attn), |i| (i % 4) as i32);
        let rows_all = values((CELLS as usize) * EMBD as usize);
        for il in 0..LAYERS {
            for which in [llama_kv_cache::Tensor::K, llama_kv_cache::Tensor::V] {
                c.write_rows_f32(il, which, 0, &rows_all).unwrap();
            }
        }
        let v = if flash_attn {
            "flash attn"
        } else {
            "V transposed"
        };
        let blob = c.state_write(-1, Layout::Streams, 1, None).unwrap();
        let bytes = blob.len();
        let write = time_with(
            || (),
            |_| c.state_write(-1, Layout::Streams, 1, None).unwrap().len(),
        );
        rows.push(Row {
            name: format!("stateWrite whole cache ({v})"),
            bytes: bytes as f64,
            ours: write,
            memcpy: time_memcpy(bytes),
            extra: format!("{bytes} bytes"),
        });
        let read = time_with(
            || SeedCache::new(params(flash_attn)).unwrap(),
            |fresh| {
                fresh
                    .state_read(&blob, -1, ReadOptions::default(), None)
                    .unwrap()
                    .cells
            },
        );
        rows.push(Row {
            name: format!("stateRead whole cache ({v})"),
            bytes: bytes as f64,
            ours: read,
            memcpy: time_memcpy(bytes),
            extra: "parse + validate + place + copy".into(),
        });
        // files against plain std::fs of the same bytes (the "memcpy" column here)
        let dir = std::env::temp_dir().join(format!("kv-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (ours_path, plain_path) = (dir.join("ours.ggsn"), dir.join("plain.bin"));
        let file = c
            .session_file_bytes(&[1, 2, 3], "llama", None, WriteOptions::default(), None)
            .unwrap();
        let save = time_with(
            || (),
            |_| {
                let b = c
                    .session_file_bytes(&[1, 2, 3], "llama", None, WriteOptions::default(), None)
                    .unwrap();
                write_atomic(&ours_path, &b).unwrap()
            },
        );
        let plain_save = time_with(|| (), |_| std::fs::write(&plain_path, &file).unwrap());
        rows.push(Row {
            name: format!("save session file ({v}), vs fs::write"),
            bytes: file.len() as f64,
            ours: save,
            memcpy: plain_save,
            extra: "atomic: temp file, fsync, rename".into(),
        });
        let load = time_with(
            || SeedCache::new(params(flash_attn)).unwrap(),
            |fresh| {
                let b = read_file(&ours_path).unwrap();
                fresh
                    .load_session_bytes(&b, ReadOptions::default(), None)
                    .unwrap()
                    .summary
                    .cells
            },
        );
        let plain_load = time_with(|| (), |_| std::fs::read(&plain_path).unwrap().len());
        rows.push(Row {
            name: format!("load session file ({v}), vs fs::read"),
            bytes: file.len() as f64,
            ours: load,
            memcpy: plain_load,
            extra: "read + parse + validate + place + copy".into(),
        });
        let _ = std::fs::remove_dir_all(&dir);
    }

    // quantizers
    let src = values(QUANT_ELEMS);
    let f32_bytes = QUANT_ELEMS * 4;
    let copy_f32 = time_memcpy(f32_bytes);
    let mut quant_rows = Vec::new();
    for ty in GgmlType::ALL {
        let mut q = vec![0u8; ty.row_size(QUANT_ELEMS).unwrap()];
        let mut back = vec![0f32; QUANT_ELEMS];
        let tq = time_with(|| (), |_| quantize_all(ty, &src, &mut q));
        let tdq = time_with(|| (), |_| dequantize_all(ty, &q, &mut back));
        for (dir, t) in [("quantize", tq), ("dequantize", tdq)] {
            rows.push(Row {
                name: format!("{dir} {}", ty.name()),
                bytes: f32_bytes as f64,
                ours: t,
                memcpy: copy_f32,
                extra: format!("{:.0} M elem/s", QUANT_ELEMS as f64 / t * 1e3),
            });
        }
        quant_rows.push((ty, tq, tdq));
    }

    // criterion: the same work
    for (case, row) in DEFRAG_CASES.iter().zip(&rows) {
        let mut c = criterion_for(row.ours);
        let mut g = c.benchmark_group(format!("data/{}", case.name));
        g.throughput(Throughput::Bytes(row.bytes as u64));
        g.bench_function("ours", |b| {
            b.iter_batched(
                || case.prepare(),
                // the cache is returned so that freeing it is not timed
                |mut c| {
                    let r = c.defrag_now(DEFAULT_MAX_NODES).unwrap();
                    (r, c)
                },
                BatchSize::LargeInput,
            )
        });
        let bytes = row.bytes as usize;
        let src = vec![0x5au8; bytes];
        let mut dst = vec![0xa5u8; bytes];
        g.bench_function("memcpy", |b| {
            b.iter(|| dst.copy_from_slice(black_box(&src)))
        });
        g.finish();
    }
    {
        let mut c = criterion_for(kshift);
        let mut g = c.benchmark_group("data/K-shift f16");
        g.throughput(Throughput::Bytes(k_bytes as u64));
        g.bench_function("ours", |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    kcache.seq_add(0, -1, -1, 1).unwrap();
                    let t = Instant::now();
                    black_box(kcache.update(Some(&shift), None).unwrap());
                    total += t.elapsed();
                }
                total
            })
        });
        let src = vec![0x5au8; k_bytes];
        let mut dst = vec![0xa5u8; k_bytes];
        g.bench_function("memcpy", |b| {
            b.iter(|| dst.copy_from_slice(black_box(&src)))
        });
        g.finish();
    }
    for (ty, tq, tdq) in &quant_rows {
        let mut c = criterion_for(tq.max(*tdq));
        let mut g = c.benchmark_group(format!("data/quant {}", ty.name()));
        g.throughput(Throughput::Elements(QUANT_ELEMS as u64));
        let mut q = vec![0u8; ty.row_size(QUANT_ELEMS).unwrap()];
        let mut back = vec![0f32; QUANT_ELEMS];
        g.bench_function("quantize", |b| {
            b.iter(|| quantize_all(*ty, black_box(&src), &mut q))
        });
        g.bench_function("dequantize", |b| {
            b.iter(|| dequantize_all(*ty, black_box(&q), &mut back))
        });
        g.finish();
    }
    {
        let mut c = criterion_for(copy_f32);
        let mut g = c.benchmark_group("data/memcpy f32 4MiB");
        g.throughput(Throughput::Elements(QUANT_ELEMS as u64));
        let mut dst = vec![0f32; QUANT_ELEMS];
        g.bench_function("copy_from_slice", |b| {
            b.iter(|| dst.copy_from_slice(black_box(&src)))
        });
        g.finish();
    }

    println!();
    println!(
        "Data movement vs memcpy: {CELLS} cells, {LAYERS} layers, n_embd {EMBD} ({HEADS} heads x {HEAD_DIM}), f16 K/V; quantizers on {QUANT_ELEMS} f32 values in rows of {EMBD}."
    );
    println!(
        "Median of {REPS} runs. memcpy = one copy_from_slice of the same bytes (defrag: bytes_copied; K-shift: size_k_bytes; quantizers: the f32 bytes)."
    );
    println!();
    println!(
        "| {:<48} | {:>9} | {:>10} | {:>10} | {:>9} | {:>11} | {:>12} | notes",
        "op", "MiB", "ours", "memcpy", "ours GB/s", "memcpy GB/s", "ours/memcpy"
    );
    println!(
        "|{:-<50}|{:-<11}|{:-<12}|{:-<12}|{:-<11}|{:-<13}|{:-<14}|{:-<30}",
        "", "", "", "", "", "", "", ""
    );
    for r in &rows {
        println!(
            "| {:<48} | {:>9.2} | {:>10} | {:>10} | {:>9} | {:>11} | {:>12} | {}",
            r.name,
            r.bytes / (1 << 20) as f64,
            fmt(r.ours),
            fmt(r.memcpy),
            gbs(r.bytes, r.ours),
            gbs(r.bytes, r.memcpy),
            format!("{:.3}", r.memcpy / r.ours),
            r.extra
        );
    }
    println!();
    println!(
        "ours/memcpy = throughput ratio (memcpy time / our time): 1.0 means as fast as a plain copy of the same bytes."
    );
    println!(
        "K-shift breakdown ({n_rows} rows of {width}, outside the cache): f16 -> f32, rotate, f32 -> f16 loop {}; f16 round trip only {}; rotate only (row in L1) {}",
        fmt(loop_alone),
        fmt(round_trip),
        fmt(rotate_only)
    );
    println!(
        "data bench wall time: {:.1} s",
        wall.elapsed().as_secs_f64()
    );
}
