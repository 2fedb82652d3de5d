//! K/V rows (`readK`, `writeKF32`, ...), row sizes, defrag scheduling and `update` (the
//! K-shift and the defrag), with the conversion of its RoPE options.

use llama_kv_cache as core;
use llama_kv_cache::{LayerRows, RopeParams, RopeType, ShiftParams, Tensor};
use napi::bindgen_prelude::*;
use napi_derive::napi;

use super::KvCache;
use crate::args::{self, int, u32v, Bytes, Floats, Num, Obj};
use crate::error::{err, from_core, Code, JsResult};
use crate::jobs::UpdateJob;
use crate::move_list::UpdateReport;
use crate::options::f32_or;
use crate::queue::JsPromise;
use crate::signal::Signal;
use crate::types::{LayerRope, RopeOptions};

/// Options of `update` / `updateSync`.
#[napi(object, object_to_js = false)]
pub struct UpdateOptions {
    /// RoPE parameters: needed to apply a pending K-shift; without them the shift stays pending.
    pub rope: Option<RopeOptions>,
    /// Per-layer RoPE replacements (e.g. sliding-window layers with another base).
    pub rope_layers: Option<Vec<LayerRope>>,
    /// Graph node budget that bounds defrag moves, as llama.cpp's `graph_max_nodes()`. Default 65536.
    pub max_nodes: Option<f64>,
    /// Aborts the async `update` while it is queued; the promise rejects with `ERR_KV_ABORTED`
    /// (`name` 'AbortError').
    #[napi(ts_type = "AbortSignal")]
    pub signal: Option<Signal>,
}

crate::args::option_names!(UpdateOptions: "rope", "ropeLayers", "maxNodes", "signal");

/// The JS name of a K/V rows method (`readK`, `writeVF32`, ...), for its refusals.
fn rows_method(verb: &str, v: bool, suffix: &str) -> String {
    format!("{verb}{}{suffix}", if v { "V" } else { "K" })
}

impl KvCache {
    fn read(&self, layer: Num, v: bool, first: Num, n: Num) -> Result<Buffer, Code> {
        let what = rows_method("read", v, "");
        let (il, which) = layer_and_tensor(layer, v)?;
        let (first, n) = (u32v("firstCell", first)?, u32v("nCells", n)?);
        self.with(&what, |c| {
            Ok(c.read_rows(il, which, first, n).map_err(from_core)?.into())
        })
    }

    fn write(&self, layer: Num, v: bool, first: Num, data: &Bytes) -> Result<(), Code> {
        let what = rows_method("write", v, "");
        let (il, which) = layer_and_tensor(layer, v)?;
        let first = u32v("firstCell", first)?;
        // SAFETY: every argument is converted; only the core runs while the rows are read
        let data = unsafe { data.borrow("data")? };
        self.with(&what, |c| {
            let written = c.write_rows(il, which, first, data).map_err(from_core);
            self.shared.handle.account_kv(c);
            written
        })
    }

    fn read_f32(&self, layer: Num, v: bool, first: Num, n: Num) -> Result<Float32Array, Code> {
        let what = rows_method("read", v, "F32");
        let (il, which) = layer_and_tensor(layer, v)?;
        let (first, n) = (u32v("firstCell", first)?, u32v("nCells", n)?);
        self.with(&what, |c| {
            Ok(Float32Array::new(
                c.read_rows_f32(il, which, first, n).map_err(from_core)?,
            ))
        })
    }

    fn write_f32(&self, layer: Num, v: bool, first: Num, values: &Floats) -> Result<(), Code> {
        let what = rows_method("write", v, "F32");
        let (il, which) = layer_and_tensor(layer, v)?;
        let first = u32v("firstCell", first)?;
        // SAFETY: every argument is converted; only the core runs while the values are read
        let values = unsafe { values.borrow("values")? };
        self.with(&what, |c| {
            let written = c
                .write_rows_f32(il, which, first, values)
                .map_err(from_core);
            self.shared.handle.account_kv(c);
            written
        })
    }
}

/// Cell indices from JS: numbers or a Uint32Array (as `place` returns them).
fn cell_list(cells: Either<Vec<f64>, Uint32Array>) -> JsResult<Vec<u32>> {
    match cells {
        Either::A(v) => v
            .into_iter()
            .enumerate()
            .map(|(k, c)| u32v(format_args!("cells[{k}]"), c))
            .collect(),
        Either::B(a) => Ok(a.to_vec()),
    }
}

/// `'k'` or `'v'` of the part that holds a layer, `'r'` or `'s'` of its recurrent state.
fn rows_named(name: &str) -> JsResult<LayerRows> {
    match name {
        "k" => Ok(LayerRows::Own(Tensor::K)),
        "v" => Ok(LayerRows::Own(Tensor::V)),
        "r" => Ok(LayerRows::State(Tensor::K)),
        "s" => Ok(LayerRows::State(Tensor::V)),
        other => Err(err(
            Code::InvalidArg,
            format!("tensor must be 'k', 'v', 'r' or 's', got {other:?}"),
        )),
    }
}

#[napi]
impl KvCache {
    /// Raw rows of `tensor` ('k' or 'v', V untransposed) of model layer `layer` for `cells`
    /// of stream `stream` (default 0), packed: the layer is routed to the part that holds
    /// it (see `parts`), so the cells are that part's, as `place` returns them. Every kind.
    /// A layer with a recurrent state only gives its R rows as 'k' and its S rows as 'v';
    /// 'r' and 's' name those rows of any layer with a recurrent state (Falcon-H1's layers
    /// keep K/V and a state).
    #[napi]
    pub fn read_rows(
        &self,
        #[napi(ts_arg_type = "number")] layer: Num,
        #[napi(ts_arg_type = "'k' | 'v' | 'r' | 's'")] tensor: String,
        #[napi(ts_arg_type = "Array<number> | Uint32Array")] cells: Either<Vec<f64>, Uint32Array>,
        #[napi(ts_arg_type = "number")] stream: Option<Num>,
    ) -> Result<Buffer, Code> {
        let (il, which) = (u32v("layer", layer)?, rows_named(&tensor)?);
        let cells = cell_list(cells)?;
        let stream = stream.map_or(Ok(0), |s| u32v("stream", s))?;
        self.with_memory(|c| {
            Ok(c.read_rows_at(il, which, stream, &cells)
                .map_err(from_core)?
                .into())
        })
    }

    /// Writes one raw row per cell of `cells` (of stream `stream`, default 0) into `tensor` of
    /// model layer `layer`, routed as `readRows`; all cells and the length are checked before
    /// any row is written. Every kind.
    #[napi]
    pub fn write_rows(
        &self,
        #[napi(ts_arg_type = "number")] layer: Num,
        #[napi(ts_arg_type = "'k' | 'v' | 'r' | 's'")] tensor: String,
        #[napi(ts_arg_type = "Array<number> | Uint32Array")] cells: Either<Vec<f64>, Uint32Array>,
        #[napi(ts_arg_type = "Uint8Array")] data: Bytes,
        #[napi(ts_arg_type = "number")] stream: Option<Num>,
    ) -> Result<(), Code> {
        let (il, which) = (u32v("layer", layer)?, rows_named(&tensor)?);
        let cells = cell_list(cells)?;
        let stream = stream.map_or(Ok(0), |s| u32v("stream", s))?;
        // SAFETY: every argument is converted; only the core runs while the rows are read
        let data = unsafe { data.borrow("data")? };
        self.with_memory(|c| {
            let written = c
                .write_rows_at(il, which, stream, &cells, data)
                .map_err(from_core);
            self.shared.handle.account(c);
            written
        })
    }

    /// Bytes of one row (one cell) of K or V in `layer`.
    #[napi]
    pub fn row_size(
        &self,
        #[napi(ts_arg_type = "number")] layer: Num,
        #[napi(ts_arg_type = "'k' | 'v'")] tensor: Unknown<'_>,
    ) -> Result<u32, Code> {
        let which = match args::string("tensor", &tensor)?.as_str() {
            "k" | "K" => Tensor::K,
            "v" | "V" => Tensor::V,
            other => {
                return Err(err(
                    Code::InvalidArg,
                    format!("tensor must be 'k' or 'v', got {other:?}"),
                ))
            }
        };
        let il = u32v("layer", layer)?;
        self.with("rowSize", |c| {
            Ok(c.row_size(il, which).map_err(from_core)? as u32)
        })
    }

    /// Raw K rows of cells `[firstCell, firstCell + nCells)` in the cache's type.
    #[napi]
    pub fn read_k(
        &self,
        #[napi(ts_arg_type = "number")] layer: Num,
        #[napi(ts_arg_type = "number")] first_cell: Num,
        #[napi(ts_arg_type = "number")] n_cells: Num,
    ) -> Result<Buffer, Code> {
        self.read(layer, false, first_cell, n_cells)
    }

    /// Raw V rows (one row per cell, untransposed whatever the layout).
    #[napi]
    pub fn read_v(
        &self,
        #[napi(ts_arg_type = "number")] layer: Num,
        #[napi(ts_arg_type = "number")] first_cell: Num,
        #[napi(ts_arg_type = "number")] n_cells: Num,
    ) -> Result<Buffer, Code> {
        self.read(layer, true, first_cell, n_cells)
    }

    /// Writes raw K rows from `firstCell` (length: a multiple of the row size).
    #[napi]
    pub fn write_k(
        &self,
        #[napi(ts_arg_type = "number")] layer: Num,
        #[napi(ts_arg_type = "number")] first_cell: Num,
        #[napi(ts_arg_type = "Uint8Array")] data: Bytes,
    ) -> Result<(), Code> {
        self.write(layer, false, first_cell, &data)
    }

    /// Writes raw V rows (one row per cell; transposed on the way in when needed).
    #[napi]
    pub fn write_v(
        &self,
        #[napi(ts_arg_type = "number")] layer: Num,
        #[napi(ts_arg_type = "number")] first_cell: Num,
        #[napi(ts_arg_type = "Uint8Array")] data: Bytes,
    ) -> Result<(), Code> {
        self.write(layer, true, first_cell, &data)
    }

    /// K rows as f32 (dequantized).
    #[napi(js_name = "readKF32")]
    pub fn read_k_f32(
        &self,
        #[napi(ts_arg_type = "number")] layer: Num,
        #[napi(ts_arg_type = "number")] first_cell: Num,
        #[napi(ts_arg_type = "number")] n_cells: Num,
    ) -> Result<Float32Array, Code> {
        self.read_f32(layer, false, first_cell, n_cells)
    }

    /// V rows as f32 (dequantized).
    #[napi(js_name = "readVF32")]
    pub fn read_v_f32(
        &self,
        #[napi(ts_arg_type = "number")] layer: Num,
        #[napi(ts_arg_type = "number")] first_cell: Num,
        #[napi(ts_arg_type = "number")] n_cells: Num,
    ) -> Result<Float32Array, Code> {
        self.read_f32(layer, true, first_cell, n_cells)
    }

    /// Writes f32 K rows, converted to the cache's type.
    #[napi(js_name = "writeKF32")]
    pub fn write_k_f32(
        &self,
        #[napi(ts_arg_type = "number")] layer: Num,
        #[napi(ts_arg_type = "number")] first_cell: Num,
        #[napi(ts_arg_type = "Float32Array")] values: Floats,
    ) -> Result<(), Code> {
        self.write_f32(layer, false, first_cell, &values)
    }

    /// Writes f32 V rows, converted to the cache's type.
    #[napi(js_name = "writeVF32")]
    pub fn write_v_f32(
        &self,
        #[napi(ts_arg_type = "number")] layer: Num,
        #[napi(ts_arg_type = "number")] first_cell: Num,
        #[napi(ts_arg_type = "Float32Array")] values: Floats,
    ) -> Result<(), Code> {
        self.write_f32(layer, true, first_cell, &values)
    }

    /// Schedules a defrag for the next `update`.
    #[napi]
    pub fn defrag(&self) -> Result<(), Code> {
        self.with("defrag", |c| {
            c.defrag();
            Ok(())
        })
    }

    /// Fragmentation as llama.cpp measures it (0 when n < 2048).
    #[napi]
    pub fn fragmentation(&self) -> Result<f64, Code> {
        self.with("fragmentation", |c| Ok(c.fragmentation() as f64))
    }

    /// Schedules a defrag when fragmentation exceeds `threshold`; returns whether it did.
    #[napi]
    pub fn schedule_defrag(
        &self,
        #[napi(ts_arg_type = "number")] threshold: Num,
    ) -> Result<bool, Code> {
        let threshold = threshold.0;
        if !threshold.is_finite() {
            return Err(err(
                Code::InvalidArg,
                format!("threshold must be a finite number, got {threshold}"),
            ));
        }
        self.with(
            "scheduleDefrag",
            |c| Ok(c.schedule_defrag(threshold as f32)),
        )
    }

    /// Applies a pending K-shift (given `rope`, or the model's RoPE for a cache made by
    /// `fromModel`) and a pending defrag, synchronously.
    #[napi]
    pub fn update_sync(
        &self,
        #[napi(ts_arg_type = "UpdateOptions")] options: Option<Obj<UpdateOptions>>,
    ) -> Result<UpdateReport, Code> {
        let (job, _) = update_job(options, &self.model_shift)?;
        self.run_sync(job)
    }

    /// Applies a pending K-shift (given `rope`, or the model's RoPE for a cache made by
    /// `fromModel`) and a pending defrag on the threadpool.
    #[napi(ts_return_type = "Promise<UpdateReport>")]
    pub fn update(
        &self,
        env: Env,
        #[napi(ts_arg_type = "UpdateOptions")] options: Option<Obj<UpdateOptions>>,
    ) -> Result<JsPromise, Code> {
        let (job, signal) = update_job(options, &self.model_shift)?;
        self.run_async(&env, job, None, signal)
    }
}

fn layer_and_tensor(layer: Num, v: bool) -> Result<(u32, Tensor), Code> {
    Ok((u32v("layer", layer)?, if v { Tensor::V } else { Tensor::K }))
}

fn update_job(
    options: Option<Obj<UpdateOptions>>,
    model_shift: &Option<core::ShiftParams>,
) -> JsResult<(UpdateJob, Option<Signal>)> {
    let mut options = options.map(|o| o.0);
    let signal = options.as_mut().and_then(|o| o.signal.take());
    let (shift, max_nodes) = shift(&options)?;
    // a cache made by fromModel knows its model's RoPE; an explicit `rope` still wins
    let shift = shift.or_else(|| model_shift.clone());
    Ok((UpdateJob { shift, max_nodes }, signal))
}

/// RoPE options into core parameters (validated again by the core against the cache).
fn rope(prefix: &str, r: &RopeOptions) -> JsResult<RopeParams> {
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
    if let Some(n) = r.dims_offset {
        p.dims_offset = int(format_args!("{prefix}.dimsOffset"), n, 0, 1 << 20)? as usize;
    }
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
        dims_offset: Some(p.dims_offset as f64),
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
fn shift(opts: &Option<UpdateOptions>) -> JsResult<(Option<ShiftParams>, Option<u32>)> {
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
