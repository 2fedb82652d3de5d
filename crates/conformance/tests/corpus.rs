//! The bounded differential corpus: generated traces run on llama.cpp 0.1.103 and on our cache,
//! compared after every op. Fails on the first mismatch of any trace (seed, op index, diff), or
//! when llama.cpp could not be built (the message names the install command).
//!
//! `DIFFERENTIAL_TRACES` (default 300), `DIFFERENTIAL_START` (first seed, default 0) and
//! `DIFFERENTIAL_JOBS` (default 2) size the run; scripts/differential.sh runs longer campaigns.

use std::process::ExitCode;

use conformance::seed::gen::GenOptions;
use conformance::seed::oracle::Oracle;
use conformance::seed::run::{failures_dir, load_trace, run_corpus, run_trace};

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--list") {
        println!("corpus: test");
        return ExitCode::SUCCESS;
    }
    // a libtest-style name filter that does not select this test
    if let Some(filter) = args.iter().find(|a| !a.starts_with('-')) {
        if !"corpus".contains(filter.as_str()) {
            println!("corpus: 0 passed, 0 failed");
            return ExitCode::SUCCESS;
        }
    }
    let n = env_u64("DIFFERENTIAL_TRACES", 300);
    let start = env_u64("DIFFERENTIAL_START", 0);
    let jobs = env_u64("DIFFERENTIAL_JOBS", 2) as usize;
    let t0 = std::time::Instant::now();
    let report = match run_corpus(start..start + n, jobs, GenOptions::default(), |_, _| {}) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("differential corpus cannot run: {e}");
            println!("corpus: 0 passed, 1 failed");
            return ExitCode::FAILURE;
        }
    };
    println!(
        "differential corpus, seeds {start}..{} against llama.cpp 0.1.103 ({:.1?}):",
        start + n,
        t0.elapsed()
    );
    println!("{}", report.coverage);
    for f in &report.failures {
        println!("MISMATCH {f}");
    }
    // hand-written regression traces in traces/
    let mut fixture_failures = 0u64;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("traces");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    files.sort();
    let failures = failures_dir();
    let fixtures = files.len() as u64;
    if let Ok(mut oracle) = Oracle::spawn() {
        for path in files {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            let res = load_trace(&text)
                .map_err(|e| e.to_string())
                .and_then(|t| run_trace(&mut oracle, &failures, &t).map_err(|f| f.to_string()));
            if let Err(e) = res {
                fixture_failures += 1;
                println!("MISMATCH in {}: {e}", path.display());
            }
        }
    }
    // the corpus must keep reaching these branches
    let c = &report.coverage;
    let mut missing = Vec::new();
    for (name, count) in [
        ("find_slot wrap-around", c.wraparound),
        ("failed placement", c.failed_decodes),
        ("failure in a later ubatch", c.failed_later_ubatch),
        ("stale pending ranges restored", c.stale_restores),
        ("defrag move cap hit", c.defrag_cap_hits),
        ("K-shift", c.kshifts),
        ("recurrent tail copy", c.tail_copies),
        ("recurrent gather", c.gathers),
        ("sequence state round trip", c.seq_roundtrips),
        ("whole state round trip", c.whole_roundtrips),
        ("K/V rows compared", c.kv_rows_compared),
    ] {
        if count == 0 && report.failures.is_empty() && n >= 200 {
            missing.push(name);
        }
    }
    if !missing.is_empty() {
        println!("coverage lost: no trace reached {}", missing.join(", "));
    }
    let failed = report.failures.len() as u64 + u64::from(!missing.is_empty()) + fixture_failures;
    println!(
        "corpus: {} passed, {} failed",
        n + fixtures - report.failures.len() as u64 - fixture_failures,
        failed
    );
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
