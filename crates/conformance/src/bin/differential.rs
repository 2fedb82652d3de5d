//! `differential`: longer campaigns against llama.cpp 0.1.103 (see scripts/differential.sh).
//!
//! ```text
//! differential run [N] [--start SEED] [--jobs J] [--known-divergences]
//! differential replay FILE      # a trace saved under target/differential-failures/
//! differential print SEED       # the generated trace, in the replay format
//! ```

use std::process::ExitCode;

use conformance::seed::gen::{generate, GenOptions};
use conformance::seed::oracle::Oracle;
use conformance::seed::run::{failures_dir, load_trace, run_corpus, run_trace, save_trace};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |name: &str| -> Option<String> {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let known = args.iter().any(|a| a == "--known-divergences");
    let positional: Vec<&String> = {
        let mut out = Vec::new();
        let mut skip = false;
        for a in &args {
            if skip {
                skip = false;
                continue;
            }
            if a == "--start" || a == "--jobs" {
                skip = true;
                continue;
            }
            if !a.starts_with("--") {
                out.push(a);
            }
        }
        out
    };
    let result = match positional.first().map(|s| s.as_str()) {
        Some("run") | None => {
            let n: u64 = positional
                .get(1)
                .and_then(|s| s.parse().ok())
                .unwrap_or(1000);
            let start: u64 = flag("--start").and_then(|s| s.parse().ok()).unwrap_or(0);
            let jobs: usize = flag("--jobs").and_then(|s| s.parse().ok()).unwrap_or(2);
            campaign(
                start,
                n,
                jobs,
                GenOptions {
                    known_divergences: known,
                },
            )
        }
        Some("replay") => match positional.get(1) {
            Some(file) => replay(file),
            None => Err("replay needs a trace file".into()),
        },
        Some("print") => {
            let seed = positional.get(1).and_then(|s| s.parse().ok()).unwrap_or(0);
            let trace = generate(
                seed,
                GenOptions {
                    known_divergences: known,
                },
            );
            let dir = std::env::temp_dir();
            match save_trace(&dir, &trace, trace.ops.len().saturating_sub(1)) {
                Some(p) => {
                    print!("{}", std::fs::read_to_string(p).unwrap_or_default());
                    Ok(())
                }
                None => Err("cannot write the trace".into()),
            }
        }
        Some(other) => Err(format!(
            "unknown command {other}: run, replay FILE, print SEED"
        )),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{e}");
            ExitCode::FAILURE
        }
    }
}

fn campaign(start: u64, n: u64, jobs: usize, opts: GenOptions) -> Result<(), String> {
    let t0 = std::time::Instant::now();
    let mut done = 0u64;
    let report = run_corpus(start..start + n, jobs, opts, |seed, res| {
        done += 1;
        if let Err(f) = res {
            eprintln!("MISMATCH {f}");
        } else if done.is_multiple_of(100) {
            eprintln!("{done}/{n} traces (last seed {seed}), {:.0?}", t0.elapsed());
        }
    })?;
    println!("{}", report.coverage);
    println!(
        "{} traces in {:.1?}: {} passed, {} failed",
        n,
        t0.elapsed(),
        n - report.failures.len() as u64,
        report.failures.len()
    );
    if report.failures.is_empty() {
        Ok(())
    } else {
        let seeds: Vec<String> = report.failures.iter().map(|f| f.seed.to_string()).collect();
        Err(format!("diverging seeds: {}", seeds.join(" ")))
    }
}

fn replay(file: &str) -> Result<(), String> {
    let text = std::fs::read_to_string(file).map_err(|e| format!("{file}: {e}"))?;
    let trace = load_trace(&text)?;
    let mut oracle = Oracle::spawn()?;
    match run_trace(&mut oracle, &failures_dir(), &trace) {
        Ok(c) => {
            println!("{} ops agree\n{c}", trace.ops.len());
            Ok(())
        }
        Err(f) => Err(format!("MISMATCH {f}")),
    }
}
