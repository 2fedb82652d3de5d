//! The oracle: llama.cpp 0.1.103 in the `kv-driver` process (driver/driver.cpp), one op per
//! line on its stdin, one JSON line back per op.
//!
//! Protocol: `hparams <model> <full 0|1>` answers the model's hyper-parameters (see
//! [`Oracle::hparams`]); `init <model> <n_ctx> <n_seq_max> <flash_attn> <type_k> <type_v> <n_batch>
//! <n_ubatch> <defrag_thold>` answers `{kv_size, n_ctx, n_batch, n_ubatch, n_layer}`; every other
//! op (see [`crate::seed::trace::Op`]'s `Display`) answers `{ret, n_tokens, used, pos_max, view_used,
//! token_count, max_contig, max_contig_idx, pos, seqs[, blob]}`. `blob` is the hex of the KV
//! bytes of a state (the seq state, or the KV part of the whole-context state). A crash of
//! llama.cpp ends the process: the next read fails with the driver's stderr.

use std::path::Path;

use serde_json::Value;

use crate::driver::{Driver, Session};
use crate::seed::trace::{Config, Obs, Op};

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
    session: Session,
}

impl Oracle {
    /// Starts the driver.
    pub fn spawn() -> Result<Oracle, String> {
        Ok(Oracle {
            session: Session::spawn(Driver::Seed, &[])?,
        })
    }

    /// Creates a fresh context (and loads the model when it changed).
    pub fn init(&mut self, cfg: &Config, model: &Path) -> Result<InitInfo, String> {
        let v = self
            .session
            .roundtrip(&cfg.init_line(&model.display().to_string()))?;
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
        self.session
            .roundtrip(&format!("hparams {} {}", model.display(), full as u8))
    }

    /// Applies one op.
    pub fn apply(&mut self, op: &Op) -> Result<Obs, String> {
        let v = self.session.roundtrip(&op.to_string())?;
        parse_obs(&v)
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
