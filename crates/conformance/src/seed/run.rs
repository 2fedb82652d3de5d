//! Running a trace on both sides and comparing after every op.

use std::fmt;
use std::path::{Path, PathBuf};

use crate::seed::blob::{blob_cells, compare_obs};
use crate::seed::model::ModelKind;
use crate::seed::oracle::Oracle;
use crate::seed::ours::{Coverage, Ours};
use crate::seed::trace::{Config, Op, Trace};

/// A mismatch (or a crash of either side), with everything needed to reproduce it.
#[derive(Clone, Debug)]
pub struct Failure {
    /// Trace seed.
    pub seed: u64,
    /// Scenario.
    pub scenario: &'static str,
    /// Config line.
    pub config: String,
    /// Index of the op that diverged (`None`: before the first op).
    pub op_index: Option<usize>,
    /// The op.
    pub op: String,
    /// What differed.
    pub diff: Vec<String>,
    /// The trace up to and including the op, replayable with `differential replay FILE`.
    pub trace_file: Option<PathBuf>,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "trace seed {} ({}), op #{}: `{}`",
            self.seed,
            self.scenario,
            self.op_index.map_or("init".into(), |i| i.to_string()),
            self.op
        )?;
        writeln!(f, "  config: {}", self.config)?;
        for d in &self.diff {
            writeln!(f, "  - {d}")?;
        }
        if let Some(p) = &self.trace_file {
            write!(
                f,
                "  trace: {} (replay: scripts/differential.sh replay {})",
                p.display(),
                p.display()
            )?;
        }
        Ok(())
    }
}

fn short_op(op: &str) -> String {
    if op.len() <= 160 {
        return op.to_string();
    }
    let cut = (0..=160)
        .rev()
        .find(|&i| op.is_char_boundary(i))
        .unwrap_or(0);
    format!("{} ... ({} chars)", &op[..cut], op.len())
}

/// Writes the trace (up to op `upto`) as a replayable text file.
pub fn save_trace(dir: &Path, trace: &Trace, upto: usize) -> Option<PathBuf> {
    std::fs::create_dir_all(dir).ok()?;
    let path = dir.join(format!("seed-{}.trace", trace.seed));
    let mut text = format!(
        "# seed {} scenario {}\n# {}\n",
        trace.seed, trace.scenario, trace.config
    );
    text.push_str(&format!("config {}\n", config_line(trace)));
    for op in trace.ops.iter().take(upto + 1) {
        text.push_str(&format!("{op}\n"));
    }
    std::fs::write(&path, text).ok()?;
    Some(path)
}

fn config_line(trace: &Trace) -> String {
    let c = &trace.config;
    format!(
        "{} {} {} {} {} {} {} {} {}",
        c.model.file_name(),
        c.n_ctx,
        c.n_seq_max,
        c.flash_attn as u8,
        c.type_k.id(),
        c.type_v.id(),
        c.n_batch,
        c.n_ubatch,
        c.defrag_thold
    )
}

/// Runs `trace` on llama.cpp and on our cache, comparing after every op; a diverging trace is
/// saved into `failures`.
pub fn run_trace(
    oracle: &mut Oracle,
    failures: &Path,
    trace: &Trace,
) -> Result<Coverage, Box<Failure>> {
    let fail = |i: Option<usize>, op: String, diff: Vec<String>| {
        Box::new(Failure {
            op: short_op(&op),
            seed: trace.seed,
            scenario: trace.scenario,
            config: trace.config.to_string(),
            op_index: i,
            diff,
            trace_file: save_trace(failures, trace, i.unwrap_or(0)),
        })
    };
    let cfg = &trace.config;
    let model = cfg
        .model
        .path()
        .map_err(|e| fail(None, "init".into(), vec![e]))?;
    let info = oracle
        .init(cfg, &model)
        .map_err(|e| fail(None, "init".into(), vec![e]))?;
    let expect = (
        cfg.kv_size(),
        cfg.eff_n_batch(),
        cfg.eff_n_ubatch(),
        cfg.model.n_layer(),
    );
    let got = (info.kv_size, info.n_batch, info.n_ubatch, info.n_layer);
    if expect != got {
        return Err(fail(
            None,
            "init".into(),
            vec![format!(
                "(kv_size, n_batch, n_ubatch, n_layer): llama.cpp {got:?}, derived {expect:?}"
            )],
        ));
    }
    let mut ours = Ours::new(cfg).map_err(|e| fail(None, "init".into(), vec![e]))?;
    ours.cov.traces = 1;
    ours.cov.dropped = trace.dropped.clone();
    for (i, op) in trace.ops.iter().enumerate() {
        let theirs = oracle
            .apply(op)
            .map_err(|e| fail(Some(i), op.to_string(), vec![e]))?;
        let mine = ours.apply(op, Some(&theirs)).map_err(|e| {
            fail(
                Some(i),
                op.to_string(),
                vec![format!("our side failed: {e}")],
            )
        })?;
        if let Some(why) = &ours.limit {
            return Err(fail(
                Some(i),
                op.to_string(),
                vec![format!(
                    "emulation limit (the generator should avoid this op): {why}"
                )],
            ));
        }
        let kv_seq = match op {
            Op::SeqGet { seq, .. } => Some(*seq),
            Op::StateGet { .. } => Some(-1),
            _ => None,
        };
        let cells = kv_seq.map(|s| blob_cells(&mine, s));
        let kv = cells
            .as_deref()
            .map(|c| (c, ours.valid_k.as_slice(), ours.valid_v.as_slice()));
        let (d, rows) = compare_obs(&theirs, &mine, kv);
        ours.cov.kv_rows_compared += rows;
        if !d.is_empty() {
            return Err(fail(Some(i), op.to_string(), d));
        }
    }
    Ok(ours.cov)
}

/// Reads a trace saved by [`save_trace`].
pub fn load_trace(text: &str) -> Result<Trace, String> {
    use llama_kv_cache::GgmlType;
    let mut config = None;
    let mut ops = Vec::new();
    let mut seed = 0;
    for line in text.lines() {
        let line = line.trim();
        if let Some(rest) = line.strip_prefix("# seed ") {
            seed = rest
                .split_whitespace()
                .next()
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
            continue;
        }
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if let Some(rest) = line.strip_prefix("config ") {
            let w: Vec<&str> = rest.split_whitespace().collect();
            if w.len() != 9 {
                return Err(format!("bad config line: {line}"));
            }
            let model = ModelKind::ALL
                .into_iter()
                .find(|m| m.file_name() == w[0])
                .ok_or_else(|| format!("unknown model {}", w[0]))?;
            let num = |i: usize| w[i].parse::<i64>().map_err(|e| format!("{line}: {e}"));
            let ty = |i: usize| -> Result<GgmlType, String> {
                GgmlType::from_id(num(i)? as i32).ok_or_else(|| format!("bad type in {line}"))
            };
            config = Some(Config {
                model,
                n_ctx: num(1)? as u32,
                n_seq_max: num(2)? as u32,
                flash_attn: num(3)? != 0,
                type_k: ty(4)?,
                type_v: ty(5)?,
                n_batch: num(6)? as u32,
                n_ubatch: num(7)? as u32,
                defrag_thold: w[8].parse().map_err(|e| format!("{line}: {e}"))?,
            });
            continue;
        }
        ops.push(Op::parse(line)?);
    }
    Ok(Trace {
        seed,
        scenario: "replay",
        config: config.ok_or("no config line")?,
        ops,
        dropped: Default::default(),
    })
}

/// Where diverging traces are saved: `<target>/differential-failures`.
pub fn failures_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate::models::repo_root().join("target"))
        .join("differential-failures")
}

/// Result of a corpus run.
#[derive(Debug, Default)]
pub struct CorpusReport {
    /// Counters over the traces that passed.
    pub coverage: Coverage,
    /// Traces that diverged, by seed.
    pub failures: Vec<Box<Failure>>,
}

/// Generates and runs the traces of `seeds` on `jobs` threads (one llama.cpp driver each).
pub fn run_corpus(
    seeds: std::ops::Range<u64>,
    jobs: usize,
    opts: crate::seed::gen::GenOptions,
    mut progress: impl FnMut(u64, &Result<Coverage, Box<Failure>>) + Send,
) -> Result<CorpusReport, String> {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Mutex;
    let failures = failures_dir();
    let next = AtomicU64::new(seeds.start);
    let report = Mutex::new(CorpusReport::default());
    let progress = Mutex::new(&mut progress);
    std::thread::scope(|scope| -> Result<(), String> {
        let mut handles = Vec::new();
        for _ in 0..jobs.max(1) {
            handles.push(scope.spawn(|| -> Result<(), String> {
                let mut oracle = Oracle::spawn()?;
                loop {
                    let seed = next.fetch_add(1, Ordering::Relaxed);
                    if seed >= seeds.end {
                        return Ok(());
                    }
                    let trace = crate::seed::gen::generate(seed, opts);
                    let res = run_trace(&mut oracle, &failures, &trace);
                    if let Ok(mut p) = progress.lock() {
                        (*p)(seed, &res);
                    }
                    let mut r = report.lock().map_err(|e| e.to_string())?;
                    match res {
                        Ok(c) => r.coverage.merge(&c),
                        Err(f) => {
                            r.failures.push(f);
                            drop(r);
                            // the driver may have died with llama.cpp: start a new one
                            oracle = Oracle::spawn()?;
                        }
                    }
                }
            }));
        }
        for h in handles {
            h.join()
                .map_err(|_| "a corpus worker panicked".to_string())??;
        }
        Ok(())
    })?;
    let mut r = report.into_inner().map_err(|e| e.to_string())?;
    r.failures.sort_by_key(|f| f.seed);
    Ok(r)
}
