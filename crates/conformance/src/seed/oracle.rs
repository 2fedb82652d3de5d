//! The oracle: llama.cpp 0.1.103 in the `kv-driver` process (driver/driver.cpp), one op per
//! line on its stdin, one JSON line back per op.
//!
//! Protocol: `hparams <model> <full 0|1>` answers the model's hyper-parameters (see
//! [`Oracle::hparams`]); `init <model> <n_ctx> <n_seq_max> <flash_attn> <type_k> <type_v> <n_batch>
//! <n_ubatch> <defrag_thold>` answers `{kv_size, n_ctx, n_batch, n_ubatch, n_layer}`; every other
//! op (see [`crate::trace::Op`]'s `Display`) answers `{ret, n_tokens, used, pos_max, view_used,
//! token_count, max_contig, max_contig_idx, pos, seqs[, blob]}`. `blob` is the hex of the KV
//! bytes of a state (the seq state, or the KV part of the whole-context state). A crash of
//! llama.cpp ends the process: the next read fails with the driver's stderr.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use serde_json::Value;

use crate::trace::{Config, Obs, Op};

/// Path of the driver built by build.rs, or why there is none.
pub fn driver_path() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("DIFFERENTIAL_DRIVER") {
        return Ok(PathBuf::from(p));
    }
    match (
        option_env!("DIFFERENTIAL_DRIVER"),
        option_env!("DIFFERENTIAL_DRIVER_ERROR"),
    ) {
        (Some(p), _) => Ok(PathBuf::from(p)),
        (None, Some(e)) => Err(format!("the llama.cpp oracle is not available: {e}")),
        (None, None) => Err("the llama.cpp oracle was not built".into()),
    }
}

/// What `init` reported.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InitInfo {
    /// Cells.
    pub kv_size: u32,
    /// Padded context.
    pub n_ctx: u32,
    /// Effective batch size.
    pub n_batch: u32,
    /// Effective micro-batch size.
    pub n_ubatch: u32,
    /// Model layers.
    pub n_layer: u32,
}

/// A running driver.
pub struct Oracle {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    line: String,
}

impl Oracle {
    /// Starts the driver.
    pub fn spawn(driver: &Path) -> Result<Oracle, String> {
        let mut child = Command::new(driver)
            // an abort would otherwise attach gdb, which prints to stdout
            .env("GGML_NO_BACKTRACE", "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", driver.display()))?;
        let stdin = child.stdin.take().ok_or("no stdin")?;
        let stdout = BufReader::new(child.stdout.take().ok_or("no stdout")?);
        Ok(Oracle {
            child,
            stdin,
            stdout,
            line: String::new(),
        })
    }

    fn roundtrip(&mut self, line: &str) -> Result<Value, String> {
        let sent = writeln!(self.stdin, "{line}").and_then(|_| self.stdin.flush());
        self.line.clear();
        let got = self.stdout.read_line(&mut self.line);
        if sent.is_err() || !matches!(got, Ok(n) if n > 0) || !self.line.starts_with('{') {
            return Err(format!(
                "llama.cpp died on `{}`: {}",
                short(line),
                self.stderr()
            ));
        }
        let v: Value = serde_json::from_str(&self.line)
            .map_err(|e| format!("bad driver output {:?}: {e}", short(&self.line)))?;
        if let Some(e) = v.get("error") {
            return Err(format!("driver error on `{}`: {e}", short(line)));
        }
        Ok(v)
    }

    fn stderr(&mut self) -> String {
        // an aborting llama.cpp may still be printing its backtrace
        let t0 = std::time::Instant::now();
        while t0.elapsed() < std::time::Duration::from_secs(5) {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let mut err = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            let _ = e.read_to_string(&mut err);
        }
        let lines: Vec<&str> = err
            .lines()
            .filter(|l| l.contains("GGML_ASSERT") || l.contains("error") || l.contains("abort"))
            .collect();
        let status = self.child.try_wait().ok().flatten();
        format!(
            "{} (exit: {})",
            lines[lines.len().saturating_sub(4)..].join(" | "),
            status.map_or("?".into(), |s| s.to_string())
        )
    }

    /// Creates a fresh context (and loads the model when it changed).
    pub fn init(&mut self, cfg: &Config, model: &Path) -> Result<InitInfo, String> {
        let v = self.roundtrip(&cfg.init_line(&model.display().to_string()))?;
        let g = |k: &str| v.get(k).and_then(Value::as_u64).unwrap_or(0) as u32;
        Ok(InitInfo {
            kv_size: g("kv_size"),
            n_ctx: g("n_ctx"),
            n_batch: g("n_batch"),
            n_ubatch: g("n_ubatch"),
            n_layer: g("n_layer"),
        })
    }

    /// The hyper-parameters llama.cpp derives from the GGUF at `model`: after a full load
    /// (`full`) or from `load_arch` + `load_hparams` alone (a GGUF with metadata only is enough).
    /// Needs no context.
    pub fn hparams(&mut self, model: &Path, full: bool) -> Result<Value, String> {
        self.roundtrip(&format!("hparams {} {}", model.display(), full as u8))
    }

    /// Applies one op.
    pub fn apply(&mut self, op: &Op) -> Result<Obs, String> {
        let v = self.roundtrip(&op.to_string())?;
        parse_obs(&v)
    }
}

impl Drop for Oracle {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.stdin.flush();
        let _ = self.child.wait();
    }
}

fn short(s: &str) -> String {
    let s = s.trim_end();
    if s.len() > 120 {
        format!("{}...", &s[..120])
    } else {
        s.to_string()
    }
}

fn parse_obs(v: &Value) -> Result<Obs, String> {
    let int = |k: &str| -> Result<i64, String> {
        v.get(k)
            .and_then(Value::as_i64)
            .ok_or_else(|| format!("driver output lacks {k}"))
    };
    let ints = |x: &Value| -> Vec<i32> {
        x.as_array()
            .map(|a| {
                a.iter()
                    .map(|y| y.as_i64().unwrap_or(i64::MIN) as i32)
                    .collect()
            })
            .unwrap_or_default()
    };
    let blob = match v.get("blob").and_then(Value::as_str) {
        Some(h) => Some(unhex(h)?),
        None => None,
    };
    Ok(Obs {
        ret: int("ret")?,
        n_tokens: int("n_tokens")?,
        used: int("used")?,
        pos_max: v.get("pos_max").map(ints).unwrap_or_default(),
        view_used: int("view_used")?,
        token_count: int("token_count")?,
        max_contig: int("max_contig")?,
        max_contig_idx: int("max_contig_idx")?,
        pos: v.get("pos").map(ints).unwrap_or_default(),
        seqs: v
            .get("seqs")
            .and_then(Value::as_array)
            .map(|a| a.iter().map(ints).collect())
            .unwrap_or_default(),
        blob,
    })
}

fn unhex(h: &str) -> Result<Vec<u8>, String> {
    let b = h.as_bytes();
    if !b.len().is_multiple_of(2) {
        return Err("odd hex length".into());
    }
    let d = |c: u8| -> Result<u8, String> {
        (c as char)
            .to_digit(16)
            .map(|x| x as u8)
            .ok_or_else(|| "bad hex digit".to_string())
    };
    b.chunks_exact(2)
        .map(|p| Ok(d(p[0])? << 4 | d(p[1])?))
        .collect()
}
