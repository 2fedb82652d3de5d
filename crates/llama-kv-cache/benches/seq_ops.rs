//! Sequence operations and slot search on a 65,536-cell cache shared by 8 sequences, against the
//! seed's data structure (`tests/common/reference.rs`: one `BTreeSet` of sequence ids per cell,
//! every operation a loop over all cells) measured in the same run.
//!
//! Every measured call starts from the same state for both models: each state is described once
//! (the ubatches that fill it plus a few preparation steps) and built from that description for
//! both. Building is never timed. `SeedCache` is not `Clone`, so it is rebuilt for every
//! iteration (about a millisecond); the baseline is built once and cloned.
//!
//! The criterion groups come first; the table the team reads is printed at the end, from its own
//! `Instant` measurements (median of several fresh states per op).
//!
//! Run: `cargo bench -p llama-kv-cache --bench seq_ops`.

#[path = "../tests/common/reference.rs"]
mod reference;

mod common;

use common::{fmt, median, ns};
use std::hint::black_box;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use criterion::{BatchSize, Criterion};
use llama_kv_cache::{CacheParams, SeedCache, UBatch};
use reference::RefCache;

const SIZE: u32 = 65_536;
const N_SEQ: u32 = 8;
/// Tokens per ubatch when filling a cache (llama.cpp's default n_ubatch).
const UBATCH: usize = 512;
/// Fresh states timed per op for the summary table (the median is printed).
const REPS: usize = 15;

/// The operations both models implement, with the seed's signatures.
trait Model {
    fn seq_rm(&mut self, seq: i32, p0: i32, p1: i32);
    fn seq_cp(&mut self, src: i32, dst: i32, p0: i32, p1: i32);
    fn seq_keep(&mut self, seq: i32);
    fn seq_add(&mut self, seq: i32, p0: i32, p1: i32, delta: i32);
    fn seq_div(&mut self, seq: i32, p0: i32, p1: i32, d: i32);
    fn seq_pos_max(&self, seq: i32) -> i32;
    /// The slot head, or -1 when the ubatch does not fit.
    fn find_slot(&mut self, ub: &UBatch) -> i64;
    fn used(&self) -> u32;
    fn n_tokens(&self) -> u64;
}

impl Model for SeedCache {
    fn seq_rm(&mut self, seq: i32, p0: i32, p1: i32) {
        SeedCache::seq_rm(self, seq, p0, p1).unwrap();
    }
    fn seq_cp(&mut self, src: i32, dst: i32, p0: i32, p1: i32) {
        SeedCache::seq_cp(self, src, dst, p0, p1).unwrap();
    }
    fn seq_keep(&mut self, seq: i32) {
        SeedCache::seq_keep(self, seq).unwrap();
    }
    fn seq_add(&mut self, seq: i32, p0: i32, p1: i32, delta: i32) {
        SeedCache::seq_add(self, seq, p0, p1, delta).unwrap();
    }
    fn seq_div(&mut self, seq: i32, p0: i32, p1: i32, d: i32) {
        SeedCache::seq_div(self, seq, p0, p1, d).unwrap();
    }
    fn seq_pos_max(&self, seq: i32) -> i32 {
        SeedCache::seq_pos_max(self, seq).unwrap()
    }
    fn find_slot(&mut self, ub: &UBatch) -> i64 {
        SeedCache::find_slot(self, ub)
            .unwrap()
            .map_or(-1, |s| i64::from(s.head))
    }
    fn used(&self) -> u32 {
        self.used_cells()
    }
    fn n_tokens(&self) -> u64 {
        SeedCache::n_tokens(self)
    }
}

impl Model for RefCache {
    fn seq_rm(&mut self, seq: i32, p0: i32, p1: i32) {
        RefCache::seq_rm(self, seq, p0, p1);
    }
    fn seq_cp(&mut self, src: i32, dst: i32, p0: i32, p1: i32) {
        RefCache::seq_cp(self, src, dst, p0, p1);
    }
    fn seq_keep(&mut self, seq: i32) {
        RefCache::seq_keep(self, seq);
    }
    fn seq_add(&mut self, seq: i32, p0: i32, p1: i32, delta: i32) {
        RefCache::seq_add(self, seq, p0, p1, delta);
    }
    fn seq_div(&mut self, seq: i32, p0: i32, p1: i32, d: i32) {
        RefCache::seq_div(self, seq, p0, p1, d);
    }
    fn seq_pos_max(&self, seq: i32) -> i32 {
        RefCache::seq_pos_max(self, seq)
    }
    fn find_slot(&mut self, ub: &UBatch) -> i64 {
        RefCache::find_slot(self, &ub.pos, &ub.seq_ids, ub.n_seq_tokens as usize)
            .map_or(-1, i64::from)
    }
    fn used(&self) -> u32 {
        self.used
    }
    fn n_tokens(&self) -> u64 {
        RefCache::n_tokens(self)
    }
}

/// A preparation step applied after the fill.
#[derive(Clone, Copy)]
enum Step {
    Rm(i32, i32, i32),
    /// `seq_add` over a position range no cell has: changes nothing but moves `head` to 0 (as
    /// any `seq_add` / `seq_cp` does), so a following slot search starts at cell 0.
    ResetHead,
}

/// A cache state: ubatches placed one after the other, then preparation steps.
struct Scenario {
    size: u32,
    fill: Vec<UBatch>,
    steps: Vec<Step>,
}

impl Scenario {
    /// Fills every cell: cell `i` gets sequence `owner(i)` at that sequence's next position,
    /// placed by `find_slot` in per-token ubatches of 512 tokens (llama.cpp's simple split of a
    /// continuous-batching decode), so each sequence is spread over the whole cache.
    fn new(size: u32, owner: impl Fn(u32) -> i32, steps: Vec<Step>) -> Scenario {
        let mut next = [0i32; 64];
        let mut fill = Vec::new();
        let (mut pos, mut seqs) = (Vec::new(), Vec::new());
        for i in 0..size {
            let s = owner(i);
            pos.push(next[s as usize]);
            seqs.push(vec![s]);
            next[s as usize] += 1;
            if pos.len() == UBATCH || i + 1 == size {
                fill.push(UBatch::per_token(
                    std::mem::take(&mut pos),
                    std::mem::take(&mut seqs),
                ));
            }
        }
        Scenario { size, fill, steps }
    }

    fn apply(&self, m: &mut dyn Model) {
        for ub in &self.fill {
            assert!(m.find_slot(ub) >= 0, "fill must fit");
        }
        for step in &self.steps {
            match *step {
                Step::Rm(s, p0, p1) => m.seq_rm(s, p0, p1),
                Step::ResetHead => m.seq_add(0, 1 << 30, (1 << 30) + 1, 1),
            }
        }
    }

    fn ours(&self) -> SeedCache {
        let mut p = CacheParams::new(self.size, 1, 8, 8);
        p.n_seq_max = N_SEQ;
        let mut c = SeedCache::new(p).unwrap();
        self.apply(&mut c);
        c
    }

    fn baseline(&self) -> RefCache {
        let mut r = RefCache::new(self.size, false);
        self.apply(&mut r);
        r
    }
}

/// Index of each scenario in [`scenarios`].
const FULL: usize = 0;
const FULL_SEQ7_EMPTY: usize = 1;
const HOLES: usize = 2;
const LAST_FREE: usize = 3;

fn scenarios(size: u32) -> Vec<Scenario> {
    vec![
        // 8 sequences interleaved token by token: 8,192 positions each, every cell used
        Scenario::new(size, |i| (i % 8) as i32, vec![]),
        // the same with sequence 7 removed (the empty destination of seq_cp)
        Scenario::new(size, |i| (i % 8) as i32, vec![Step::Rm(7, -1, -1)]),
        // 7 sequences; one free cell every 128 (511 scattered holes) plus a run of 32 free
        // cells at the end; search starting at cell 0
        Scenario::new(
            size,
            |i| {
                if i % 128 == 127 || i >= size - 32 {
                    7
                } else {
                    (i % 7) as i32
                }
            },
            vec![Step::Rm(7, -1, -1), Step::ResetHead],
        ),
        // 7 sequences, only the last cell free; search starting at cell 0
        Scenario::new(
            size,
            |i| if i == size - 1 { 7 } else { (i % 7) as i32 },
            vec![Step::Rm(7, -1, -1), Step::ResetHead],
        ),
    ]
}

/// The ubatch of `n` tokens of sequence 0 that the find_slot ops place, built once so that its
/// allocation is not part of the measured call.
fn tokens(n: u32) -> &'static UBatch {
    static ONE: OnceLock<UBatch> = OnceLock::new();
    static RUN: OnceLock<UBatch> = OnceLock::new();
    let cell = if n == 1 { &ONE } else { &RUN };
    cell.get_or_init(|| UBatch::sequence(0, 100_000, n))
}

/// One measured call: a name, the state it starts from, and the call.
struct Op {
    name: &'static str,
    scenario: usize,
    run: fn(&mut dyn Model) -> i64,
}

fn ops() -> Vec<Op> {
    vec![
        Op {
            name: "seq_rm tail (seq 3, last 1024 pos)",
            scenario: FULL,
            run: |m| {
                m.seq_rm(3, 8192 - 1024, -1);
                0
            },
        },
        Op {
            name: "seq_rm whole seq 3",
            scenario: FULL,
            run: |m| {
                m.seq_rm(3, -1, -1);
                0
            },
        },
        Op {
            name: "seq_cp 0 -> 7 (whole, 7 empty)",
            scenario: FULL_SEQ7_EMPTY,
            run: |m| {
                m.seq_cp(0, 7, -1, -1);
                0
            },
        },
        Op {
            name: "seq_keep 2",
            scenario: FULL,
            run: |m| {
                m.seq_keep(2);
                0
            },
        },
        Op {
            name: "seq_add seq 1 [4096,end) +1024",
            scenario: FULL,
            run: |m| {
                m.seq_add(1, 4096, -1, 1024);
                0
            },
        },
        Op {
            name: "seq_div seq 1 [4096,end) /2",
            scenario: FULL,
            run: |m| {
                m.seq_div(1, 4096, -1, 2);
                0
            },
        },
        Op {
            name: "find_slot 1 tok (511 holes)",
            scenario: HOLES,
            run: |m| m.find_slot(tokens(1)),
        },
        Op {
            name: "find_slot 32 tok (run at end)",
            scenario: HOLES,
            run: |m| m.find_slot(tokens(32)),
        },
        Op {
            name: "find_slot 1 tok (last cell free)",
            scenario: LAST_FREE,
            run: |m| m.find_slot(tokens(1)),
        },
    ]
}

/// What both models must agree on after an op.
fn fingerprint(m: &dyn Model, result: i64) -> (i64, u32, u64, Vec<i32>) {
    (
        result,
        m.used(),
        m.n_tokens(),
        (0..N_SEQ as i32).map(|s| m.seq_pos_max(s)).collect(),
    )
}

/// Median over `REPS` fresh states of one call of `op`, in ns.
fn time_fresh<M: Model>(make: impl Fn() -> M, op: fn(&mut dyn Model) -> i64) -> f64 {
    let mut samples = Vec::with_capacity(REPS);
    for _ in 0..REPS {
        let mut m = make();
        let t = Instant::now();
        let r = op(&mut m);
        samples.push(ns(t.elapsed()));
        black_box((r, &m));
    }
    median(samples)
}

/// Median over `REPS` loops of the per-call time of `f`, in ns.
fn time_calls(calls: u32, mut f: impl FnMut(u32) -> i64) -> f64 {
    let mut samples = Vec::with_capacity(REPS);
    for _ in 0..REPS {
        let t = Instant::now();
        let mut acc = 0i64;
        for k in 0..calls {
            acc = acc.wrapping_add(f(black_box(k)));
        }
        samples.push(ns(t.elapsed()) / f64::from(calls));
        black_box(acc);
    }
    median(samples)
}

/// Per-call time of `seq_pos_max`, read-only, so it is repeated on one state.
fn time_pos_max<M: Model>(m: &M, calls: u32) -> f64 {
    time_calls(calls, |k| i64::from(m.seq_pos_max((k % N_SEQ) as i32)))
}

struct Row {
    name: String,
    /// ns
    ours: f64,
    /// ns
    baseline: f64,
}

/// Criterion times for an op whose own cost is about `est`: about 150 measured iterations,
/// because every iteration also pays for a fresh state (setup is not timed, but takes wall time).
fn criterion_for(est_ns: f64) -> Criterion {
    let est = Duration::from_nanos(est_ns.max(50.0) as u64);
    Criterion::default()
        .sample_size(10)
        .warm_up_time((est * 20).min(Duration::from_millis(100)))
        .measurement_time((est * 150).clamp(Duration::from_micros(10), Duration::from_millis(400)))
        .without_plots()
        .configure_from_args()
}

fn main() {
    let wall = Instant::now();
    let scen = scenarios(SIZE);
    let bases: Vec<RefCache> = scen.iter().map(Scenario::baseline).collect();

    // setup costs, reported for context (never part of a measured time)
    let t = Instant::now();
    black_box(scen[FULL].ours());
    let ours_build = ns(t.elapsed());
    let t = Instant::now();
    black_box(bases[FULL].clone());
    let base_clone = ns(t.elapsed());

    // both models must start equal and end equal after every op
    for (s, b) in scen.iter().zip(&bases) {
        assert_eq!(fingerprint(&s.ours(), 0), fingerprint(b, 0));
    }
    let mut rows = Vec::new();
    for op in ops() {
        let mut a = scen[op.scenario].ours();
        let mut b = bases[op.scenario].clone();
        let (ra, rb) = ((op.run)(&mut a), (op.run)(&mut b));
        assert_eq!(
            fingerprint(&a, ra),
            fingerprint(&b, rb),
            "{}: models disagree",
            op.name
        );
        let s = &scen[op.scenario];
        let base = &bases[op.scenario];
        rows.push(Row {
            name: op.name.to_string(),
            ours: time_fresh(|| s.ours(), op.run),
            baseline: time_fresh(|| base.clone(), op.run),
        });
    }
    let ours_full = scen[FULL].ours();
    let small = Scenario::new(4096, |i| (i % 8) as i32, vec![]);
    let (ours_small, base_small) = (small.ours(), small.baseline());
    let pm = [
        (
            "seq_pos_max (65,536 cells)",
            time_pos_max(&ours_full, 1_000_000),
            time_pos_max(&bases[FULL], 20),
        ),
        (
            "seq_pos_max (4,096 cells)",
            time_pos_max(&ours_small, 1_000_000),
            time_pos_max(&base_small, 200),
        ),
    ];
    for (name, ours, baseline) in pm {
        rows.push(Row {
            name: name.to_string(),
            ours,
            baseline,
        });
    }

    // criterion: the same ops, iter_batched over fresh states
    for (op, row) in ops().iter().zip(&rows) {
        let s = &scen[op.scenario];
        let base = &bases[op.scenario];
        let run = op.run;
        let mut c = criterion_for(row.ours);
        let mut g = c.benchmark_group(format!("seq_ops/{}", op.name));
        g.bench_function("ours", |bch| {
            bch.iter_batched(
                || s.ours(),
                |mut m| {
                    let r = run(&mut m);
                    (r, m)
                },
                BatchSize::LargeInput,
            )
        });
        g.finish();
        let mut c = criterion_for(row.baseline);
        let mut g = c.benchmark_group(format!("seq_ops/{}", op.name));
        g.bench_function("baseline", |bch| {
            bch.iter_batched(
                || base.clone(),
                |mut m| {
                    let r = run(&mut m);
                    (r, m)
                },
                BatchSize::LargeInput,
            )
        });
        g.finish();
    }
    for (label, cells, ours, base) in [
        ("65536", SIZE, &ours_full, &bases[FULL]),
        ("4096", 4096, &ours_small, &base_small),
    ] {
        let name = format!("seq_ops/seq_pos_max {label} cells");
        let mut c = criterion_for(20e3);
        let mut g = c.benchmark_group(name);
        g.bench_function("ours", |bch| {
            bch.iter(|| Model::seq_pos_max(ours, black_box(5)))
        });
        let mut c2 = criterion_for(f64::from(cells) * 20.0);
        g.finish();
        let mut g = c2.benchmark_group(format!("seq_ops/seq_pos_max {label} cells"));
        g.bench_function("baseline", |bch| {
            bch.iter(|| Model::seq_pos_max(base, black_box(5)))
        });
        g.finish();
    }

    println!();
    println!(
        "Sequence ops, {SIZE} cells, {N_SEQ} sequences interleaved token by token (continuous batching)."
    );
    println!(
        "Median of {REPS} fresh states per op; seq_pos_max: median per-call time of {REPS} loops."
    );
    println!(
        "Setup, not timed: rebuild of our cache {}, clone of the baseline {}.",
        fmt(ours_build),
        fmt(base_clone)
    );
    println!();
    println!(
        "| {:<36} | {:>10} | {:>10} | {:>26} |",
        "op", "ours", "baseline", "speedup (baseline/ours)"
    );
    println!("|{:-<38}|{:-<12}|{:-<12}|{:-<28}|", "", "", "", "");
    for r in &rows {
        let speedup = r.baseline / r.ours;
        let flag = if speedup < 10.0 { "  (< 10x)" } else { "" };
        println!(
            "| {:<36} | {:>10} | {:>10} | {:>26} |",
            r.name,
            fmt(r.ours),
            fmt(r.baseline),
            format!("{speedup:.1}x{flag}")
        );
    }
    println!();

    let (big, small) = (&rows[rows.len() - 2], &rows[rows.len() - 1]);
    println!();
    println!(
        "seq_pos_max vs cache size: ours {} at 4,096 cells, {} at 65,536 cells (ratio {:.2}); baseline {} -> {} (ratio {:.1})",
        fmt(small.ours),
        fmt(big.ours),
        big.ours / small.ours,
        fmt(small.baseline),
        fmt(big.baseline),
        big.baseline / small.baseline,
    );
    println!(
        "seq_ops bench wall time: {:.1} s",
        wall.elapsed().as_secs_f64()
    );
}
