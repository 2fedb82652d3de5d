//! The drivers build.rs builds against real llama.cpp, found by one lookup ([`Driver::path`]),
//! and one way to talk to a running one ([`Session`]): a line on its stdin, one JSON line
//! back.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

/// A program build.rs builds against real llama.cpp.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Driver {
    /// `kv-driver`: llama.cpp 0.1.103 applying one op per line (the seed's oracle).
    Seed,
    /// `kv-bench`: llama.cpp 0.1.103's cache operations timed through its C API.
    SeedBench,
    /// `today-driver`: llama.cpp 0.1.161 as a peer.
    Today,
}

impl Driver {
    /// What the driver is, for messages.
    pub fn what(self) -> &'static str {
        match self {
            Driver::Seed => "the llama.cpp 0.1.103 oracle",
            Driver::SeedBench => "llama.cpp 0.1.103's kv-bench",
            Driver::Today => "the llama.cpp 0.1.161 peer",
        }
    }

    /// The driver's path: the env var of its name at run time (`SEED_DRIVER`, `SEED_BENCH`,
    /// `TODAY_DRIVER`: another build of it), else what build.rs built, else why it did not.
    pub fn path(self) -> Result<PathBuf, String> {
        let (var, built, error) = match self {
            Driver::Seed => (
                "SEED_DRIVER",
                option_env!("SEED_DRIVER"),
                option_env!("SEED_DRIVER_ERROR"),
            ),
            Driver::SeedBench => (
                "SEED_BENCH",
                option_env!("SEED_BENCH"),
                option_env!("SEED_DRIVER_ERROR"),
            ),
            Driver::Today => (
                "TODAY_DRIVER",
                option_env!("TODAY_DRIVER"),
                option_env!("TODAY_DRIVER_ERROR"),
            ),
        };
        if let Some(p) = std::env::var_os(var) {
            return Ok(PathBuf::from(p));
        }
        match (built, error) {
            (Some(p), _) => Ok(PathBuf::from(p)),
            (None, Some(e)) => Err(format!("{} is not available: {e}", self.what())),
            (None, None) => Err(format!("{} was not built", self.what())),
        }
    }

    /// Runs the driver once with `args`; its JSON answer, or its error.
    pub fn run(self, args: &[String]) -> Result<Value, String> {
        let path = self.path()?;
        let out = Command::new(&path)
            .args(args)
            .output()
            .map_err(|e| format!("{}: {e}", path.display()))?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        let action = args.first().map_or("", String::as_str);
        let v: Value = serde_json::from_str(stdout.trim()).map_err(|e| {
            format!(
                "{} {action} answered {stdout:?} ({e}); stderr: {}",
                self.what(),
                String::from_utf8_lossy(&out.stderr)
            )
        })?;
        if let Some(e) = v.get("error") {
            return Err(format!(
                "{} {action}: {e}; stderr: {}",
                self.what(),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        Ok(v)
    }
}

/// Lines of stderr a [`Session`] keeps for its crash reports.
const STDERR_LINES: usize = 64;

/// A running driver: one line in, one JSON line out. Its stderr is read as it comes (a driver
/// that logs much never blocks on a full pipe), and its last lines explain a crash.
pub struct Session {
    what: &'static str,
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    stderr: Arc<Mutex<VecDeque<String>>>,
    line: String,
}

impl Session {
    /// Starts `driver` with `args`.
    pub fn spawn(driver: Driver, args: &[String]) -> Result<Session, String> {
        let path = driver.path()?;
        let mut child = Command::new(&path)
            .args(args)
            // an abort would otherwise attach gdb, which prints to stdout
            .env("GGML_NO_BACKTRACE", "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", path.display()))?;
        let stdin = child.stdin.take().ok_or("no stdin")?;
        let stdout = BufReader::new(child.stdout.take().ok_or("no stdout")?);
        let err = child.stderr.take().ok_or("no stderr")?;
        let stderr = Arc::new(Mutex::new(VecDeque::new()));
        let kept = Arc::clone(&stderr);
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                if let Ok(mut lines) = kept.lock() {
                    if lines.len() == STDERR_LINES {
                        lines.pop_front();
                    }
                    lines.push_back(line);
                }
            }
        });
        Ok(Session {
            what: driver.what(),
            child,
            stdin,
            stdout,
            stderr,
            line: String::new(),
        })
    }

    /// Sends one line and reads the answer; a driver that died, answered no JSON or answered
    /// `{"error": ...}` is an error that says so.
    pub fn roundtrip(&mut self, line: &str) -> Result<Value, String> {
        let sent = writeln!(self.stdin, "{line}").and_then(|_| self.stdin.flush());
        self.line.clear();
        let got = self.stdout.read_line(&mut self.line);
        if sent.is_err() || !matches!(got, Ok(n) if n > 0) || !self.line.starts_with('{') {
            let report = self.crash_report();
            return Err(format!("{} died on `{}`: {report}", self.what, short(line)));
        }
        let v: Value = serde_json::from_str(&self.line)
            .map_err(|e| format!("bad driver output {:?}: {e}", short(&self.line)))?;
        if let Some(e) = v.get("error") {
            return Err(format!("driver error on `{}`: {e}", short(line)));
        }
        Ok(v)
    }

    /// The driver's last words: its assertion or error lines and its exit status.
    fn crash_report(&mut self) -> String {
        // an aborting llama.cpp may still be printing its backtrace
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(5) {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let status = self.child.wait().ok();
        // the reader thread ends with the pipe; give it a moment to take the last lines
        std::thread::sleep(Duration::from_millis(50));
        let lines = self.stderr.lock().map(|l| l.clone()).unwrap_or_default();
        let lines: Vec<&String> = lines
            .iter()
            .filter(|l| l.contains("GGML_ASSERT") || l.contains("error") || l.contains("abort"))
            .collect();
        let last: Vec<&str> = lines[lines.len().saturating_sub(4)..]
            .iter()
            .map(|l| l.as_str())
            .collect();
        format!(
            "{} (exit: {})",
            last.join(" | "),
            status.map_or("?".into(), |s| s.to_string())
        )
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn short(s: &str) -> String {
    let s = s.trim_end();
    match s.char_indices().nth(120) {
        Some((cut, _)) => format!("{}...", &s[..cut]),
        None => s.to_string(),
    }
}
