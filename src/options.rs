//! Conversion and validation of checked JS values into core types: KV type names, widths,
//! packed ubatches, finite floats. The option objects that hold them are converted by the
//! class methods that take them.

use std::time::Duration;

use llama_kv_cache::{CellExt, CellExtValue, GgmlType, Release, UBatch};
use napi::bindgen_prelude::*;

use crate::args::{u32v, Num};
use crate::error::{err, Code, JsResult};

/// The longest decay delay: a day, far past any use, and a bound that keeps the deadline
/// arithmetic of the release clock finite.
const DELAY_MAX_MS: f64 = 86_400_000.0;

/// The `releaseMemory` and `releaseDelayMs` options (`None`: the default, decay after a
/// second).
pub fn release(
    mode: Option<Either<bool, String>>,
    delay_ms: Option<f64>,
) -> JsResult<Option<Release>> {
    let delay = delay_ms
        .map(|ms| match ms.is_finite() && (0.0..=DELAY_MAX_MS).contains(&ms) {
            true => Ok(Duration::from_secs_f64(ms / 1000.0)),
            false => Err(err(
                Code::InvalidArg,
                format!("releaseDelayMs must be a number of milliseconds in [0, {DELAY_MAX_MS}], got {ms}"),
            )),
        })
        .transpose()?;
    let decay = |delay: Option<Duration>| match (Release::DECAY, delay) {
        (Release::Decay { watermark, .. }, Some(delay)) => Release::Decay { delay, watermark },
        (default, _) => default,
    };
    let release = match mode {
        None if delay.is_none() => return Ok(None),
        None | Some(Either::A(true)) => decay(delay),
        Some(Either::A(false)) => Release::Off,
        Some(Either::B(now)) if now == "now" => Release::Now,
        Some(Either::B(other)) => {
            return Err(err(
                Code::InvalidArg,
                format!("releaseMemory must be true, false or 'now', got {other:?}"),
            ))
        }
    };
    if delay.is_some() && !matches!(release, Release::Decay { .. }) {
        return Err(err(
            Code::InvalidArg,
            "releaseDelayMs is the delay of releaseMemory: true; with false or 'now' there is none",
        ));
    }
    Ok(Some(release))
}

/// The `releaseMemory` value of `release`.
pub fn release_name(release: Release) -> Either<bool, &'static str> {
    match release {
        Release::Decay { .. } => Either::A(true),
        Release::Now => Either::B("now"),
        Release::Off => Either::A(false),
    }
}

/// A KV type name.
pub fn ggml_type(name: &str, v: Option<String>, default: GgmlType) -> JsResult<GgmlType> {
    match v {
        None => Ok(default),
        Some(s) => s
            .parse()
            .map_err(|e: llama_kv_cache::KvError| err(Code::InvalidArg, format!("{name}: {e}"))),
    }
}

/// An optional KV type name.
pub fn ggml_type_opt(name: &str, v: Option<String>) -> JsResult<Option<GgmlType>> {
    v.map(|s| ggml_type(name, Some(s), GgmlType::F16))
        .transpose()
}

/// A cell extension name ('none', 'pos2', 'pos2-tok').
pub fn cell_ext(name: &str, v: Option<String>) -> JsResult<CellExt> {
    match v {
        None => Ok(CellExt::None),
        Some(s) => CellExt::from_name(&s).ok_or_else(|| {
            err(
                Code::InvalidArg,
                format!("{name} must be 'none', 'pos2' or 'pos2-tok', got {s:?}"),
            )
        }),
    }
}

/// Cell extensions packed as `x, y, tok` per token.
pub fn cell_exts(flat: &[i32]) -> JsResult<Vec<CellExtValue>> {
    if !flat.len().is_multiple_of(3) {
        return Err(err(
            Code::InvalidArg,
            format!(
                "ext holds {} numbers: give three (x, y, tok) per token",
                flat.len()
            ),
        ));
    }
    Ok(flat
        .chunks_exact(3)
        .map(|e| CellExtValue {
            x: e[0],
            y: e[1],
            tok: e[2],
        })
        .collect())
}

/// A width or per-layer widths.
pub fn widths(name: &str, v: &Either<f64, Vec<f64>>) -> JsResult<Vec<u32>> {
    match v {
        Either::A(n) => Ok(vec![u32v(name, *n)?]),
        Either::B(list) => list
            .iter()
            .enumerate()
            .map(|(i, &n)| u32v(format_args!("{name}[{i}]"), n))
            .collect(),
    }
}

/// A ubatch in llama_batch's packed form: `pos` per token; per group either one id
/// (`n_seq_ids` absent) or `n_seq_ids[g]` ids, all groups' ids concatenated in `seq_ids`.
/// The shape against `pos` and the ids themselves are checked by the core.
pub fn packed_ubatch(
    pos: &[i32],
    seq_ids: &[i32],
    n_seq_ids: Option<&[i32]>,
    n_seq_tokens: Option<Num>,
) -> JsResult<UBatch> {
    let n_seq_tokens = match n_seq_tokens {
        Some(n) => u32v("nSeqTokens", n)?,
        None => 1,
    };
    let seq_ids = match n_seq_ids {
        None => seq_ids.iter().map(|&id| vec![id]).collect(),
        Some(counts) => {
            let mut groups = Vec::with_capacity(counts.len());
            let mut at = 0usize;
            for (g, &n) in counts.iter().enumerate() {
                if n < 1 {
                    return Err(err(
                        Code::InvalidArg,
                        format!("nSeqIds[{g}] must be at least 1, got {n}"),
                    ));
                }
                let ids = seq_ids.get(at..at + n as usize).ok_or_else(|| {
                    err(
                        Code::InvalidArg,
                        format!(
                            "nSeqIds asks for more seq ids than seqIds holds ({}) at group {g}",
                            seq_ids.len()
                        ),
                    )
                })?;
                groups.push(ids.to_vec());
                at += n as usize;
            }
            if at != seq_ids.len() {
                return Err(err(
                    Code::InvalidArg,
                    format!(
                        "nSeqIds sums to {at} but seqIds holds {} seq ids",
                        seq_ids.len()
                    ),
                ));
            }
            groups
        }
    };
    Ok(UBatch {
        pos: pos.to_vec(),
        n_seq_tokens,
        seq_ids,
        ext: Vec::new(),
    })
}

/// An optional finite number as f32, `default` when absent.
pub fn f32_or(name: impl std::fmt::Display, v: Option<f64>, default: f32) -> JsResult<f32> {
    match v {
        None => Ok(default),
        Some(x) if x.is_finite() => Ok(x as f32),
        Some(x) => Err(err(
            Code::InvalidArg,
            format!("{name} must be a finite number, got {x}"),
        )),
    }
}
