//! Conversion and validation of JS numbers and objects into core types. JS numbers arrive as
//! f64 so that NaN, fractions and out-of-range values are refused here, by name, instead of
//! being truncated silently.

use llama_kv_cache::{GgmlType, RopeParams, RopeType, ShiftParams, UBatch};
use napi::bindgen_prelude::*;

use crate::args::Num;
use crate::error::{err, Code, JsResult};
use crate::types::{LayerRope, RopeOptions, UBatchInput, UpdateOptions};

/// An integer in `[min, max]`.
pub fn int(name: impl std::fmt::Display, v: f64, min: i64, max: i64) -> JsResult<i64> {
    if !v.is_finite() || v.fract() != 0.0 {
        return Err(err(
            Code::InvalidArg,
            format!("{name} must be an integer, got {v}"),
        ));
    }
    if v < min as f64 || v > max as f64 {
        return Err(err(
            Code::OutOfRange,
            format!("{name} must be in [{min}, {max}], got {v}"),
        ));
    }
    Ok(v as i64)
}

/// An i32 (positions, seq ids, deltas).
pub fn i32v(name: &str, v: impl Into<f64>) -> JsResult<i32> {
    Ok(int(name, v.into(), i32::MIN as i64, i32::MAX as i64)? as i32)
}

/// A u32 (cell indices, counts).
pub fn u32v(name: impl std::fmt::Display, v: impl Into<f64>) -> JsResult<u32> {
    Ok(int(name, v.into(), 0, u32::MAX as i64)? as u32)
}

/// An i32 whose name is built only when `v` is refused: per-token conversions call this once
/// per value, and formatting every name up front cost more than the conversion.
pub fn i32_named(name: impl FnOnce() -> String, v: f64) -> JsResult<i32> {
    if v.fract() == 0.0 && v >= i32::MIN as f64 && v <= i32::MAX as f64 {
        return Ok(v as i32);
    }
    i32v(&name(), v)
}

/// An optional i32 with a default.
pub fn opt_i32(name: &str, v: Option<Num>, default: i32) -> JsResult<i32> {
    v.map_or(Ok(default), |v| i32v(name, v))
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

/// A JS ubatch.
pub fn ubatch(u: &UBatchInput) -> JsResult<UBatch> {
    let pos: Vec<i32> = match &u.pos {
        Either::A(list) => list
            .iter()
            .enumerate()
            .map(|(i, &p)| i32_named(|| format!("pos[{i}]"), p))
            .collect::<JsResult<_>>()?,
        Either::B(typed) => typed.to_vec(),
    };
    let seq_ids = u
        .seq_ids
        .iter()
        .enumerate()
        .map(|(g, ids)| match ids {
            Either::A(id) => Ok(vec![i32_named(|| format!("seqIds[{g}]"), *id)?]),
            Either::B(list) => list
                .iter()
                .enumerate()
                .map(|(j, &id)| i32_named(|| format!("seqIds[{g}][{j}]"), id))
                .collect(),
        })
        .collect::<JsResult<Vec<Vec<i32>>>>()?;
    let n_seq_tokens = match u.n_seq_tokens {
        Some(n) => u32v("nSeqTokens", n)?,
        None => 1,
    };
    Ok(UBatch {
        pos,
        n_seq_tokens,
        seq_ids,
    })
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
    })
}

fn f32_or(name: impl std::fmt::Display, v: Option<f64>, default: f32) -> JsResult<f32> {
    match v {
        None => Ok(default),
        Some(x) if x.is_finite() => Ok(x as f32),
        Some(x) => Err(err(
            Code::InvalidArg,
            format!("{name} must be a finite number, got {x}"),
        )),
    }
}

/// RoPE options into core parameters (validated again by the core against the cache).
pub fn rope(prefix: &str, r: &RopeOptions) -> JsResult<RopeParams> {
    // names are formatted only when a value is refused: every `update({ rope })` converts these
    let usz = |name: &str, v: f64| -> JsResult<usize> {
        Ok(int(format_args!("{prefix}.{name}"), v, 1, 1 << 20)? as usize)
    };
    let head_dim = usz("headDim", r.head_dim)?;
    let rope_type = match r.rope_type.as_deref() {
        None | Some("norm") => RopeType::Norm,
        Some("neox") => RopeType::Neox,
        Some(other) => {
            return Err(err(
                Code::InvalidArg,
                format!("{prefix}.type must be 'norm' or 'neox', got {other:?}"),
            ))
        }
    };
    let n_dims = match r.n_rot {
        Some(n) => usz("nRot", n)?,
        None => head_dim,
    };
    let mut p = RopeParams::new(n_dims, head_dim, usz("nHead", r.n_head)?, rope_type);
    p.freq_base = f32_or(format_args!("{prefix}.freqBase"), r.freq_base, p.freq_base)?;
    p.freq_scale = f32_or(
        format_args!("{prefix}.freqScale"),
        r.freq_scale,
        p.freq_scale,
    )?;
    p.ext_factor = f32_or(
        format_args!("{prefix}.extFactor"),
        r.ext_factor,
        p.ext_factor,
    )?;
    p.attn_factor = f32_or(
        format_args!("{prefix}.attnFactor"),
        r.attn_factor,
        p.attn_factor,
    )?;
    p.beta_fast = f32_or(format_args!("{prefix}.betaFast"), r.beta_fast, p.beta_fast)?;
    p.beta_slow = f32_or(format_args!("{prefix}.betaSlow"), r.beta_slow, p.beta_slow)?;
    if let Some(n) = r.n_ctx_orig {
        p.n_ctx_orig = u32v(format_args!("{prefix}.nCtxOrig"), n)?;
    }
    p.freq_factors = r
        .freq_factors
        .as_ref()
        .map(|f| f.iter().map(|&x| x as f32).collect());
    p.validate().map_err(|e| {
        let msg = e.to_string();
        let detail = msg.strip_prefix("rope: ").unwrap_or(&msg);
        err(Code::InvalidArg, format!("{prefix}: {detail}"))
    })?;
    Ok(p)
}

/// Core RoPE parameters as the options `update()` takes (every field set, so the JS object
/// says what the shift uses); f32 values widen to f64 exactly and narrow back unchanged.
pub fn rope_to_js(p: &RopeParams) -> RopeOptions {
    RopeOptions {
        head_dim: p.head_dim as f64,
        n_head: p.n_head as f64,
        n_rot: Some(p.n_dims as f64),
        rope_type: Some(
            match p.rope_type {
                RopeType::Norm => "norm",
                RopeType::Neox => "neox",
            }
            .into(),
        ),
        freq_base: Some(p.freq_base.into()),
        freq_scale: Some(p.freq_scale.into()),
        ext_factor: Some(p.ext_factor.into()),
        attn_factor: Some(p.attn_factor.into()),
        beta_fast: Some(p.beta_fast.into()),
        beta_slow: Some(p.beta_slow.into()),
        n_ctx_orig: Some(p.n_ctx_orig.into()),
        freq_factors: p
            .freq_factors
            .as_ref()
            .map(|f| f.iter().map(|&x| x.into()).collect()),
    }
}

/// Per-layer replacements of core shift parameters as `update()`'s `ropeLayers`.
pub fn rope_layers_to_js(s: &ShiftParams) -> Vec<LayerRope> {
    s.per_layer
        .iter()
        .map(|(layer, p)| LayerRope {
            layer: (*layer).into(),
            rope: rope_to_js(p),
        })
        .collect()
}

/// Update options into the shift parameters and the node budget.
pub fn shift(opts: &Option<UpdateOptions>) -> JsResult<(Option<ShiftParams>, Option<u32>)> {
    let Some(o) = opts else {
        return Ok((None, None));
    };
    let shift = match &o.rope {
        None => None,
        Some(r) => {
            let mut per_layer = Vec::new();
            for (i, l) in o.rope_layers.iter().flatten().enumerate() {
                let layer = u32v(format_args!("ropeLayers[{i}].layer"), l.layer)?;
                per_layer.push((layer, rope(&format!("ropeLayers[{i}]"), &l.rope)?));
            }
            Some(ShiftParams {
                rope: rope("rope", r)?,
                per_layer,
            })
        }
    };
    let max_nodes = match o.max_nodes {
        Some(n) => Some(int("maxNodes", n, 1, u32::MAX as i64)? as u32),
        None => None,
    };
    Ok((shift, max_nodes))
}

impl From<Num> for f64 {
    fn from(n: Num) -> f64 {
        n.0
    }
}
