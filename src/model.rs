//! `modelInfo`, `checkState` and `KvCache.fromModel`: the model-aware surface. Converts the
//! core's `ModelInfo` and `Fit` to JS objects; the knowledge of GGUF and llama.cpp's hparams
//! lives in the core (`gguf`, `model`, `fit`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use llama_kv_cache as core;
use llama_kv_cache::model::{gguf, LayerMemory};
use llama_kv_cache::GgmlType;
use napi::bindgen_prelude::*;
use napi_derive::napi;

use crate::args::{self, u32v, Obj};
use crate::error::{err, from_core, guard, Code, JsResult};
use crate::kv_cache::tensors::{rope_layers_to_js, rope_to_js};
use crate::kv_cache::{memory_part, KvCache};
use crate::options;
use crate::tasks::{PoolJob, PoolTask};
use crate::types::{LayerRope, MemoryPlan, RopeOptions};

/// Geometry of one layer of a model.
#[napi(object)]
pub struct ModelLayer {
    /// Query heads.
    pub n_head: u32,
    /// K/V heads (`head_count_kv`, per layer when the model gives an array).
    pub n_head_kv: u32,
    /// K width (`n_embd_k_gqa` = K head size x K/V heads).
    pub n_embd_k_gqa: u32,
    /// V width (`n_embd_v_gqa`).
    pub n_embd_v_gqa: u32,
    /// Whether the layer uses the sliding window.
    pub swa: bool,
    /// Which parts of the model's memory hold the layer: 'attention' | 'recurrent' | 'both'
    /// (Falcon-H1) | 'neither' (Nemotron-H's MLP-only layers, multi-token-prediction layers
    /// of a hybrid).
    pub memory: String,
}

/// RoPE as the model was trained.
#[napi(object)]
pub struct ModelRope {
    /// 'none' | 'norm' | 'neox' | 'mrope' | 'imrope' | 'unknown' (by architecture, as llama.cpp's `llama_model_rope_type`).
    #[napi(js_name = "type")]
    pub rope_type: String,
    /// Rotated dimensions per head (`n_rot`).
    pub n_rot: u32,
    /// Base frequency.
    pub freq_base: f64,
    /// Frequency scale (1 / scaling factor).
    pub freq_scale: f64,
    /// 'none' | 'linear' | 'yarn' | 'longrope'.
    pub scaling_type: String,
    /// YaRN's original context length.
    pub n_ctx_orig_yarn: u32,
    /// `rope.scaling.attn_factor` (default 1).
    pub attn_factor: f64,
    /// `rope.scaling.yarn_log_multiplier` (0 when absent).
    pub yarn_log_mul: f64,
    /// `rope.scaling.finetuned`.
    pub finetuned: bool,
    /// Base frequency of the sliding-window layers.
    pub freq_base_swa: f64,
    /// Frequency scale of the sliding-window layers.
    pub freq_scale_swa: f64,
    /// M-RoPE sections (empty when absent).
    pub sections: Vec<i32>,
    /// Tensors holding per-dimension frequency factors (`rope_freqs.weight`, ...).
    pub factor_tensors: Vec<String>,
}

/// The sliding window.
#[napi(object)]
pub struct ModelSwa {
    /// Window size in tokens.
    pub window: u32,
    /// Every `pattern`-th layer has full attention (1: no layer uses the window's cache).
    pub pattern: u32,
    /// Llama 4's chunked attention.
    pub chunked: bool,
    /// Indices of the sliding-window layers.
    pub layers: Vec<u32>,
}

/// Recurrent state dimensions (Mamba `ssm_*`, RWKV `wkv`).
#[napi(object)]
pub struct ModelRecurrent {
    /// `ssm.conv_kernel`.
    pub ssm_d_conv: u32,
    /// `ssm.inner_size`.
    pub ssm_d_inner: u32,
    /// `ssm.state_size`.
    pub ssm_d_state: u32,
    /// `ssm.time_step_rank`.
    pub ssm_dt_rank: u32,
    /// `ssm.group_count` (Mamba-2 groups of B and C; 0 for Mamba).
    pub ssm_n_group: u32,
    /// RWKV `wkv.head_size`.
    pub wkv_head_size: u32,
    /// RWKV `token_shift_count`.
    pub token_shift_count: u32,
    /// Rolling-state width per layer (`n_embd_k_s`).
    #[napi(js_name = "nEmbdKS")]
    pub n_embd_k_s: u32,
    /// Recurrent-state width per layer (`n_embd_v_s`).
    #[napi(js_name = "nEmbdVS")]
    pub n_embd_v_s: u32,
}

/// What a GGUF model's header says about its KV cache.
#[napi(object)]
pub struct ModelInfo {
    /// `general.architecture`.
    pub arch: String,
    /// `general.name`.
    pub name: Option<String>,
    /// Layers.
    pub n_layer: u32,
    /// Multi-head latent attention (DeepSeek-V2/V3, Kimi K2, GLM-4.7-Flash, ...: both MLA head
    /// sizes set): llama.cpp 0.1.161's cache keeps K only, and so does `fromModel`'s (`noV`).
    pub mla: bool,
    /// Context length the model was trained with.
    pub n_ctx_train: u32,
    /// Embedding width.
    pub n_embd: u32,
    /// K head size.
    pub n_embd_head_k: u32,
    /// V head size.
    pub n_embd_head_v: u32,
    /// Per layer.
    pub layers: Vec<ModelLayer>,
    /// Per layer K widths of the cache (`n_embd_k_gqa + n_embd_k_s`).
    pub n_embd_k_gqa: Vec<u32>,
    /// Per layer V widths of the cache (`n_embd_v_gqa + n_embd_v_s`).
    pub n_embd_v_gqa: Vec<u32>,
    /// RoPE.
    pub rope: ModelRope,
    /// Sliding window; absent when the model has none.
    pub swa: Option<ModelSwa>,
    /// Recurrent dimensions of recurrent and hybrid models.
    pub recurrent: Option<ModelRecurrent>,
    /// 'unified' | 'iswa' | 'recurrent' | 'hybrid', or a sparse-attention memory with an
    /// indexer cache ('dsa', 'dsa-iswa', 'msa', 'hybrid-idx', 'dsv4'): the memory llama.cpp
    /// 0.1.161 builds for the model.
    pub memory: String,
    /// What each cell keeps beside its position: 'pos2-tok' for M-RoPE models (Qwen2-VL,
    /// Qwen2.5-VL, Qwen3-VL, Qwen3.5) and PLE models, 'none' for every other. Their state
    /// files carry it after each cell's seq id count.
    pub cell_ext: String,
    /// Why `KvCache.fromModel` refuses this model (memories with an indexer cache, hybrids
    /// whose layer split is not modeled); absent when it builds its memory.
    pub unsupported: Option<String>,
    /// K+V bytes of one cell (all layers) per KV type name, null where a width is not whole blocks.
    pub bytes_per_cell: HashMap<String, Option<f64>>,
    /// Tensors in the file.
    pub n_tensors: f64,
    /// File size in bytes.
    pub file_size: f64,
    /// Tensor data in bytes.
    pub data_size: f64,
    /// Header and tensor-info table in bytes.
    pub header_size: f64,
    /// 'blake3:<hex>' of header, tensor-info table and data size; 'blake3-file:<hex>' with `hashFile`.
    pub fingerprint: String,
    /// Bytes read from the file.
    pub bytes_read: f64,
    /// The RoPE of this model's K-shift as llama.cpp 0.1.161 applies it (YaRN's attention
    /// factor as 0.1.161 computes it), as `update()`'s options. Absent when the model has no
    /// RoPE a K-shift can apply, or needs frequency-factor tensors (`rope.factorTensors`),
    /// which modelInfo does not read: `KvCache.fromModel` reads them.
    pub shift: Option<ModelShift>,
}

/// A model's K-shift, shaped as the options of `update()`: `await cache.update(info.shift)`.
#[napi(object)]
pub struct ModelShift {
    /// RoPE of every layer without a replacement.
    pub rope: RopeOptions,
    /// Per-layer replacements (e.g. sliding-window layers with their own base frequency).
    pub rope_layers: Vec<LayerRope>,
}

/// Options of `modelInfo`.
#[napi(object, object_to_js = false)]
pub struct ModelInfoOptions {
    /// Hash every byte of the file for the fingerprint (reads the whole file once per file
    /// version: the hash is remembered by path, size and modification time in the user's cache
    /// directory, or `LLAMA_KV_CACHE_DIR`). Default false.
    pub hash_file: Option<bool>,
}

crate::args::option_names!(ModelInfoOptions: "hashFile");

fn to_js(m: &core::ModelInfo) -> ModelInfo {
    let r = &m.rope;
    let bytes_per_cell = GgmlType::ALL
        .iter()
        .map(|t| {
            (
                t.name().to_string(),
                m.kv_bytes(1, *t, *t).map(|b| b as f64),
            )
        })
        .collect();
    ModelInfo {
        arch: m.arch.clone(),
        name: m.name.clone(),
        n_layer: m.n_layer,
        mla: m.mla,
        n_ctx_train: m.n_ctx_train,
        n_embd: m.n_embd,
        n_embd_head_k: m.n_embd_head_k,
        n_embd_head_v: m.n_embd_head_v,
        layers: m
            .layers
            .iter()
            .map(|l| ModelLayer {
                n_head: l.n_head,
                n_head_kv: l.n_head_kv,
                n_embd_k_gqa: l.n_embd_k_gqa,
                n_embd_v_gqa: l.n_embd_v_gqa,
                swa: l.swa,
                memory: match l.memory {
                    LayerMemory::Attention => "attention",
                    LayerMemory::Recurrent => "recurrent",
                    LayerMemory::Both => "both",
                    LayerMemory::Neither => "neither",
                }
                .into(),
            })
            .collect(),
        n_embd_k_gqa: (0..m.layers.len())
            .map(|il| m.cache_k_width(il).min(u32::MAX as u64) as u32)
            .collect(),
        n_embd_v_gqa: (0..m.layers.len())
            .map(|il| m.cache_v_width(il).min(u32::MAX as u64) as u32)
            .collect(),
        rope: ModelRope {
            rope_type: r.kind.name().into(),
            n_rot: r.n_rot,
            freq_base: r.freq_base.into(),
            freq_scale: r.freq_scale.into(),
            scaling_type: r.scaling_type.clone(),
            n_ctx_orig_yarn: r.n_ctx_orig_yarn,
            attn_factor: r.attn_factor.into(),
            yarn_log_mul: r.yarn_log_mul.into(),
            finetuned: r.finetuned,
            freq_base_swa: r.freq_base_swa.into(),
            freq_scale_swa: r.freq_scale_swa.into(),
            sections: r.sections.clone(),
            factor_tensors: r.factor_tensors.clone(),
        },
        swa: m.swa.as_ref().map(|s| ModelSwa {
            window: s.window,
            pattern: s.pattern,
            chunked: s.chunked,
            layers: (0..m.n_layer)
                .filter(|&il| m.layers[il as usize].swa)
                .collect(),
        }),
        recurrent: m.recurrent.as_ref().map(|x| ModelRecurrent {
            ssm_d_conv: x.ssm_d_conv,
            ssm_d_inner: x.ssm_d_inner,
            ssm_d_state: x.ssm_d_state,
            ssm_dt_rank: x.ssm_dt_rank,
            ssm_n_group: x.ssm_n_group,
            wkv_head_size: x.wkv_head_size,
            token_shift_count: x.token_shift_count,
            n_embd_k_s: x.n_embd_k_s,
            n_embd_v_s: x.n_embd_v_s,
        }),
        memory: m.memory.name().into(),
        cell_ext: m.cell_ext.name().into(),
        unsupported: m.check_live().err().map(|e| e.to_string()),
        bytes_per_cell,
        n_tensors: m.n_tensors as f64,
        file_size: m.file_size as f64,
        data_size: m.data_size as f64,
        header_size: m.header_size as f64,
        fingerprint: m.fingerprint.clone(),
        bytes_read: m.bytes_read as f64,
        shift: r
            .factor_tensors
            .is_empty()
            .then(|| m.shift_params(None))
            .flatten()
            .map(|s| ModelShift {
                rope: rope_to_js(&s.rope),
                rope_layers: rope_layers_to_js(&s),
            }),
    }
}

/// The identity a prompt store keys its blocks by: a GGUF file's fingerprint when `model`
/// names one (an existing file that starts with the GGUF magic, or any `*.gguf` path, which
/// must then be readable), with the model's description to check states against; else `model`
/// itself (e.g. a sha256 the caller computed), with nothing to check against.
pub(crate) fn model_identity(model: &str) -> JsResult<(String, Option<core::ModelInfo>)> {
    let path = Path::new(model);
    let names_gguf = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
    let starts_gguf = || {
        let mut magic = [0u8; 4];
        std::fs::File::open(path)
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
            .is_ok_and(|_| &magic == b"GGUF")
    };
    if names_gguf || (path.is_file() && starts_gguf()) {
        // a GGUF file it must be: its header is read (and checked) first
        let info = read_model(path, true)?;
        Ok((info.fingerprint.clone(), Some(info)))
    } else {
        Ok((model.to_string(), None))
    }
}

/// Where the weights' fingerprints are remembered: `LLAMA_KV_CACHE_DIR`, else the user's cache
/// directory (`XDG_CACHE_HOME`, `~/Library/Caches` on macOS, `LOCALAPPDATA` on Windows,
/// `~/.cache`), else the temporary directory.
fn fingerprint_cache_dir() -> PathBuf {
    let var = |name: &str| {
        std::env::var_os(name)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(dir) = var("LLAMA_KV_CACHE_DIR") {
        return dir.join("fingerprints");
    }
    let base = var("XDG_CACHE_HOME")
        .or_else(|| {
            if cfg!(windows) {
                var("LOCALAPPDATA")
            } else if cfg!(target_os = "macos") {
                var("HOME").map(|h| h.join("Library").join("Caches"))
            } else {
                var("HOME").map(|h| h.join(".cache"))
            }
        })
        .unwrap_or_else(std::env::temp_dir);
    base.join("llama-kv-cache").join("fingerprints")
}

/// A model's description; with `hash_file`, its fingerprint covers every byte of the file
/// (remembered per file version, so only the first call reads the weights).
fn read_model(path: &Path, hash_file: bool) -> JsResult<core::ModelInfo> {
    let mut info = core::ModelInfo::from_file(path, false).map_err(from_core)?;
    if hash_file {
        let (fingerprint, read_whole) =
            core::model::fingerprint::cached_hash_file(path, &fingerprint_cache_dir())
                .map_err(from_core)?;
        info.fingerprint = fingerprint;
        if read_whole {
            info.bytes_read += info.file_size;
        }
    }
    Ok(info)
}

/// `modelInfoSync`: describes a GGUF model from its header and tensor-info table alone
/// (tensor data is never read, unless `hashFile` asks for a fingerprint of the whole file), on
/// the calling thread.
#[napi]
pub fn model_info_sync(
    #[napi(ts_arg_type = "string | Uint8Array")] gguf_path: Unknown<'_>,
    #[napi(ts_arg_type = "ModelInfoOptions")] options: Option<Obj<ModelInfoOptions>>,
) -> Result<ModelInfo, Code> {
    guard(|| {
        let job = model_info_job(&gguf_path, options)?;
        Ok(to_js(&read_model(&job.path, job.hash_file)?))
    })
}

/// `modelInfo` on the threadpool.
pub struct ModelInfoJob {
    path: PathBuf,
    hash_file: bool,
}

impl PoolJob for ModelInfoJob {
    type Output = core::ModelInfo;
    type Js = ModelInfo;
    fn run(&mut self, _: &mut dyn FnMut(u64, u64) -> bool) -> JsResult<core::ModelInfo> {
        read_model(&self.path, self.hash_file)
    }
    fn to_js(output: core::ModelInfo) -> JsResult<ModelInfo> {
        Ok(to_js(&output))
    }
}

fn model_info_job(
    gguf_path: &Unknown<'_>,
    options: Option<Obj<ModelInfoOptions>>,
) -> JsResult<ModelInfoJob> {
    Ok(ModelInfoJob {
        path: args::path("ggufPath", gguf_path)?,
        hash_file: options.and_then(|o| o.0.hash_file).unwrap_or(false),
    })
}

/// Describes a GGUF model as `modelInfoSync` does, on the threadpool: with `hashFile`, the
/// first call for a file reads all of it.
#[napi(ts_return_type = "Promise<ModelInfo>")]
pub fn model_info(
    env: Env,
    #[napi(ts_arg_type = "string | Uint8Array")] gguf_path: Unknown<'_>,
    #[napi(ts_arg_type = "ModelInfoOptions")] options: Option<Obj<ModelInfoOptions>>,
) -> Result<AsyncTask<PoolTask<ModelInfoJob>>, Code> {
    let job = guard(|| model_info_job(&gguf_path, options))?;
    Ok(PoolTask::new(&env, job, None, None))
}

/// One reason a state does not fit a model.
#[napi(object)]
pub struct FitReason {
    /// What differs: 'memory', 'parts', 'arch', 'recurrent', 'nLayer', 'layers[N].kWidth', 'layers[N].vWidth'.
    pub field: String,
    /// The state file's value.
    pub state: String,
    /// The model's value.
    pub model: String,
    /// A sentence naming the field and both values.
    pub message: String,
}

/// The verdict of `checkState`.
#[napi(object)]
pub struct FitResult {
    /// True when the state can be loaded into a cache for the model.
    pub fits: bool,
    /// Every difference found (empty when it fits).
    pub reasons: Vec<FitReason>,
}

/// Whether a state file (a path or its bytes) fits a GGUF model: memory kind, architecture
/// (session files), recurrence, layer count and every layer's K and V widths.
#[napi]
pub fn check_state(
    #[napi(ts_arg_type = "string | Uint8Array")] state: Unknown<'_>,
    #[napi(ts_arg_type = "string | Uint8Array")] gguf_path: Unknown<'_>,
) -> Result<FitResult, Code> {
    guard(|| {
        let state = args::source("state", &state)?;
        let model = read_model(&args::path("ggufPath", &gguf_path)?, false)?;
        let ins = crate::inspect::inspect(state)?;
        let fit = core::check_state(&ins, &model);
        Ok(FitResult {
            fits: fit.fits,
            reasons: fit
                .reasons
                .into_iter()
                .map(|r| FitReason {
                    field: r.field,
                    state: r.state,
                    model: r.model,
                    message: r.message,
                })
                .collect(),
        })
    })
}

/// Options of `KvCache.fromModel`.
#[napi(object, object_to_js = false)]
pub struct FromModelOptions {
    /// Context length in cells, padded to 256 as llama.cpp 0.1.161 pads it.
    /// Default: the model's trained context. Ignored for recurrent models (one cell per sequence).
    pub n_ctx: Option<f64>,
    /// Number of sequences. Default 1.
    pub n_seq_max: Option<f64>,
    /// K type. Default 'f16'. A recurrent state is kept in f32 whatever the types say, as
    /// llama.cpp keeps it.
    pub type_k: Option<String>,
    /// V type (quantized V needs `flashAttn`). Default 'f16'.
    pub type_v: Option<String>,
    /// Flash attention. Default false.
    pub flash_attn: Option<bool>,
    /// One stream for all sequences (llama.cpp's `kv_unified`). Otherwise each sequence gets
    /// a stream of `nCtx / nSeqMax` cells (padded to 256), as in llama.cpp 0.1.161, whose
    /// default that is; a unified model then gets 0.1.161's `llama_kv_cache` of those streams
    /// (kind 'kv-streams', without the seed's own calls such as `findSlot`). Default true;
    /// ignored by a recurrent model.
    pub kv_unified: Option<bool>,
    /// Sliding-window models: a window cache as large as the base cache (llama.cpp's
    /// `swa_full`), which keeps every position and allows `seqAdd` / `seqDiv`. Default false.
    pub swa_full: Option<bool>,
    /// Sliding-window models: tokens per ubatch (`n_ubatch`), which the window cache has room
    /// for beyond the window. Default 512.
    pub n_ubatch: Option<f64>,
    /// Where the tensors live, as in `new KvCache`.
    #[napi(ts_type = "string | string[]")]
    pub device: Option<Either<String, Vec<String>>>,
    /// How freed memory goes back to the OS, as in `new KvCache` (every part of the memory).
    #[napi(ts_type = "boolean | 'now'")]
    pub release_memory: Option<Either<bool, String>>,
    /// The decay's delay in milliseconds, as in `new KvCache`.
    pub release_delay_ms: Option<f64>,
}

crate::args::option_names!(
    FromModelOptions:
    "nCtx", "nSeqMax", "typeK", "typeV", "flashAttn", "kvUnified", "swaFull", "nUbatch", "device",
    "releaseMemory", "releaseDelayMs",
);

/// The context `options` describe, as llama.cpp 0.1.161's `llama_context_params`.
fn context_of(o: Option<&FromModelOptions>) -> Result<core::ContextParams, Code> {
    let get = |f: fn(&FromModelOptions) -> Option<f64>| o.and_then(f);
    let ty = |name, v: Option<&String>| options::ggml_type(name, v.cloned(), GgmlType::F16);
    Ok(core::ContextParams {
        n_ctx: get(|o| o.n_ctx).map_or(Ok(0), |n| u32v("nCtx", n))?,
        n_seq_max: get(|o| o.n_seq_max).map_or(Ok(1), |n| u32v("nSeqMax", n))?,
        n_ubatch: get(|o| o.n_ubatch).map_or(Ok(512), |n| u32v("nUbatch", n))?,
        unified: o.and_then(|o| o.kv_unified).unwrap_or(true),
        swa_full: o.and_then(|o| o.swa_full).unwrap_or(false),
        type_k: ty("typeK", o.and_then(|o| o.type_k.as_ref()))?,
        type_v: ty("typeV", o.and_then(|o| o.type_v.as_ref()))?,
        flash_attn: o.and_then(|o| o.flash_attn).unwrap_or(false),
    })
}

#[napi]
impl KvCache {
    /// Creates a cache shaped for a GGUF model (layers, per-layer K/V widths, recurrent state)
    /// that remembers the model's RoPE, so `update()` applies a K-shift without a `rope`
    /// option. A model with sliding-window layers (gemma2/3, gpt-oss, Cohere2, ...) gets
    /// llama.cpp 0.1.161's iSWA memory (kind 'iswa'), a hybrid model (Jamba, Granite 4,
    /// Qwen3-Next, ...) its hybrid memory (kind 'hybrid'), each sized as llama.cpp sizes it
    /// (see `kvUnified`, `swaFull`, `nUbatch`). K/V types a 0.1.161 context refuses for the
    /// model are refused (`ERR_KV_INVALID_ARG`).
    #[napi(factory)]
    pub fn from_model(
        env: Env,
        #[napi(ts_arg_type = "string | Uint8Array")] gguf_path: Unknown<'_>,
        #[napi(ts_arg_type = "FromModelOptions")] options: Option<Obj<FromModelOptions>>,
    ) -> Result<KvCache, Code> {
        guard(|| {
            let path = args::path("ggufPath", &gguf_path)?;
            let o = options.map(|o| o.0);
            let ctx = context_of(o.as_ref())?;
            let release = match &o {
                Some(o) => options::release(o.release_memory.clone(), o.release_delay_ms)?,
                None => None,
            };
            let device = o.and_then(|o| o.device);

            let read = gguf::read_file(&path, false).map_err(from_core)?;
            let model = core::ModelInfo::from_header(&read.header).map_err(from_core)?;
            let blueprint = core::MemoryBlueprint::for_model(&model, &ctx).map_err(from_core)?;
            let factors = |per_seq: u32| match model.factor_tensor(per_seq) {
                Some(name) => gguf::read_f32_tensor(&path, &read.header, name)
                    .map(Some)
                    .map_err(from_core),
                None => Ok(None),
            };
            // the seed's cache, on the devices asked for
            if let Some(params) = blueprint.seed_params() {
                let per_seq = params.size / ctx.n_seq_max.max(1);
                let shift = model.shift_params(factors(per_seq)?);
                let cache = KvCache::from_params(&env, params.clone(), &device, shift)?;
                cache.set_release(release)?;
                return Ok(cache);
            }
            // today's memories: built as llama.cpp 0.1.161 builds them for the context
            if device.is_some() {
                return Err(err(
                    Code::Unsupported,
                    "device: iSWA and hybrid memories, and a cache of a stream per sequence, \
                     live in host memory for now (a unified model's cache with kvUnified: true \
                     can live on a device)",
                ));
            }
            let memory = blueprint.build().map_err(from_core)?;
            let size = ctx.cells_per_stream(model.n_ctx_train).map_err(from_core)?;
            let shift = model.shift_params(factors(size)?);
            let cache = KvCache::from_memory(&env, memory, shift);
            cache.set_release(release)?;
            Ok(cache)
        })
    }

    /// The memory `fromModel` builds for the model and options, without building it: its
    /// kind, its parts (cells, streams, types, window) and the bytes of its tensors, so that an
    /// app can size a context before it reserves anything (the GGUF's header is read, no
    /// tensor). Refused as `fromModel` refuses (`device` plays no part in the sizes).
    #[napi]
    pub fn plan_memory(
        #[napi(ts_arg_type = "string | Uint8Array")] gguf_path: Unknown<'_>,
        #[napi(ts_arg_type = "FromModelOptions")] options: Option<Obj<FromModelOptions>>,
    ) -> Result<MemoryPlan, Code> {
        guard(|| {
            let path = args::path("ggufPath", &gguf_path)?;
            let ctx = context_of(options.as_ref().map(|o| &o.0))?;
            let read = gguf::read_file(&path, false).map_err(from_core)?;
            let model = core::ModelInfo::from_header(&read.header).map_err(from_core)?;
            let plan = core::MemoryPlan::for_model(&model, &ctx).map_err(from_core)?;
            Ok(MemoryPlan {
                kind: plan.kind.into(),
                bytes: plan.bytes() as f64,
                parts: plan.parts.iter().map(memory_part).collect(),
            })
        })
    }
}
