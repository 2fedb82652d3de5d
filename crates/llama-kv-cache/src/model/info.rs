//! What a GGUF model's header says about its KV cache, computed the way llama.cpp 0.1.103's
//! `llama_model::load_hparams` does: layer count, per-layer K/V heads and widths, RoPE (type by
//! architecture as in `llama_model_rope_type`, dims, base, scale, YaRN), the sliding window and
//! its layer pattern, recurrent state widths (Mamba `ssm_*`, RWKV `wkv`), the trained context.
//!
//! From that it builds a cache ([`ModelInfo::cache_params`]) and the K-shift parameters
//! ([`ModelInfo::shift_params`]), and refuses, naming what is missing, the memories this
//! library does not model (a second sliding-window cache, hybrid attention + recurrent).

use std::path::Path;

use crate::cell_ext::CellExt;
use crate::error::{KvError, Result};
use crate::ggml_type::GgmlType;
use crate::model::arch::{self, HybridSplit, MemoryKind};
use crate::model::gguf::{self, GgufHeader, GgufValue};
use crate::params::CacheParams;
use crate::tensors::rope::ShiftParams;
use crate::tensors::rope::{RopeParams, RopeType};

/// llama.cpp's `LLAMA_MAX_LAYERS`.
pub const MAX_LAYERS: u32 = 512;

/// `llama_rope_type`: how RoPE pairs the dimensions of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeKind {
    /// The architecture applies no RoPE.
    None,
    /// Adjacent dimensions (LLaMA).
    Norm,
    /// First half with second half (GPT-NeoX, Qwen, Gemma, Phi).
    Neox,
    /// Multi-section RoPE (Qwen2-VL).
    Mrope,
    /// Interleaved multi-section RoPE (Qwen3-VL; llama.cpp since late 2025).
    Imrope,
    /// An architecture llama.cpp 0.1.103 does not list.
    Unknown,
}

impl RopeKind {
    /// `"none"`, `"norm"`, `"neox"`, `"mrope"` or `"unknown"`.
    pub fn name(self) -> &'static str {
        match self {
            RopeKind::None => "none",
            RopeKind::Norm => "norm",
            RopeKind::Neox => "neox",
            RopeKind::Mrope => "mrope",
            RopeKind::Imrope => "imrope",
            RopeKind::Unknown => "unknown",
        }
    }

    /// llama.cpp's `enum llama_rope_type` value (-1 none, 0 norm, 2 neox, 8 mrope, 40 imrope);
    /// `None` when unknown.
    pub fn llama_value(self) -> Option<i32> {
        match self {
            RopeKind::None => Some(-1),
            RopeKind::Norm => Some(0),
            RopeKind::Neox => Some(2),
            RopeKind::Mrope => Some(8),
            RopeKind::Imrope => Some(40),
            RopeKind::Unknown => None,
        }
    }
}

/// The rope type of an architecture, as `llama_model_rope_type` lists it: llama.cpp 0.1.103's
/// answer for the architectures it knows (the differential tests pin it), 0.1.161's for the
/// ones added since.
pub fn rope_kind(arch: &str) -> RopeKind {
    match rope_kind_0_1_103(arch) {
        RopeKind::Unknown => rope_kind_0_1_161(arch),
        known => known,
    }
}

/// Architectures llama.cpp added after 0.1.103, as 0.1.161's `llama_model_rope_type` lists them.
fn rope_kind_0_1_161(arch: &str) -> RopeKind {
    match arch {
        "clip" | "glm4moe" | "glm5-next" | "hunyuan_vl" | "jamba" | "kimi-k3" | "kimi-linear"
        | "mamba2" | "nemotron_h" | "nemotron_h_moe" => RopeKind::None,
        "arcee" | "bailingmoe3" | "cohere2moe" | "deepseek2-ocr" | "deepseek32" | "deepseek4"
        | "dots3note" | "eagle3" | "ernie4_5" | "ernie4_5-moe" | "glm-dsa" | "granite_swa"
        | "granitehybrid" | "graniteswitch" | "hy_v4" | "llada" | "llama-embed" | "maincoder"
        | "mistral3" | "mistral4" | "muse-glimmer" | "nanbeige" | "neo-bert" | "pockettts"
        | "smollm3" => RopeKind::Norm,
        "afmoe" | "apertus" | "bailingmoe2" | "cogvlm" | "dots1" | "dream" | "eurobert"
        | "exaone-moe" | "exaone4" | "falcon-h1" | "gemma-embedding" | "gemma3n" | "gemma4"
        | "gemma4-assistant" | "gpt-oss" | "grovemoe" | "hrm_text" | "hunyuan-dense"
        | "hunyuan-moe" | "hy_v3" | "jais2" | "jina-bert-v3" | "laguna" | "lfm2" | "lfm2moe"
        | "llada-moe" | "maple" | "mellum" | "mimo2" | "minimax-01" | "minimax-m2"
        | "minimax-m3" | "modern-bert" | "pangu-embedded" | "plamo2" | "plamo3" | "qwen3next"
        | "rnd1" | "seed_oss" | "smallthinker" | "spark2_5" | "step35" | "talkie" => RopeKind::Neox,
        "dflash" | "paddleocr" => RopeKind::Mrope,
        "clef" | "qwen35" | "qwen35moe" | "qwen3tts" | "qwen3vl" | "qwen3vlmoe" | "qwen4exp" => {
            RopeKind::Imrope
        }
        _ => RopeKind::Unknown,
    }
}

fn rope_kind_0_1_103(arch: &str) -> RopeKind {
    match arch {
        "gpt2" | "gptj" | "mpt" | "refact" | "bloom" | "mamba" | "jina-bert-v2" | "t5"
        | "t5encoder" | "jais" | "rwkv6" | "rwkv6qwen2" | "rwkv7" | "arwkv7"
        | "wavtokenizer-dec" => RopeKind::None,
        "llama" | "llama4" | "deci" | "baichuan" | "starcoder" | "plamo" | "orion"
        | "internlm2" | "minicpm" | "xverse" | "command-r" | "cohere2" | "olmo" | "arctic"
        | "deepseek" | "deepseek2" | "plm" | "chatglm" | "glm4" | "granite" | "granitemoe"
        | "chameleon" | "bailingmoe" => RopeKind::Norm,
        "falcon" | "grok" | "dbrx" | "bert" | "nomic-bert" | "nomic-bert-moe" | "stablelm"
        | "bitnet" | "qwen" | "qwen2" | "qwen2moe" | "qwen3" | "qwen3moe" | "olmo2" | "olmoe"
        | "phi2" | "phi3" | "phimoe" | "gemma" | "gemma2" | "gemma3" | "starcoder2" | "openelm"
        | "gptneox" | "codeshell" | "nemotron" | "exaone" | "minicpm3" => RopeKind::Neox,
        "qwen2vl" => RopeKind::Mrope,
        _ => RopeKind::Unknown,
    }
}

/// Geometry of one layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerGeometry {
    /// Query heads.
    pub n_head: u32,
    /// K/V heads.
    pub n_head_kv: u32,
    /// K width: `n_embd_head_k * n_head_kv` (`n_embd_k_gqa(il)`).
    pub n_embd_k_gqa: u32,
    /// V width: `n_embd_head_v * n_head_kv` (`n_embd_v_gqa(il)`).
    pub n_embd_v_gqa: u32,
    /// Whether the layer uses the sliding window (`is_swa(il)`).
    pub swa: bool,
    /// Which parts of the model's memory hold the layer.
    pub memory: LayerMemory,
}

/// Which parts of a model's memory hold one layer: K/V in an attention cache, a recurrent
/// state, both (Falcon-H1), or neither (Nemotron-H's MLP-only layers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerMemory {
    /// K/V rows in an attention cache (every layer of an attention-only model).
    Attention,
    /// A recurrent state (0.1.161's `is_recr(il)`; every layer of a recurrent model).
    Recurrent,
    /// Both: the attention cache and the recurrent memory each keep the layer.
    Both,
    /// Neither: the layer keeps nothing between tokens.
    Neither,
}

impl LayerMemory {
    /// Whether an attention cache holds the layer.
    pub fn attends(self) -> bool {
        matches!(self, LayerMemory::Attention | LayerMemory::Both)
    }

    /// Whether the recurrent memory holds the layer (0.1.161's `is_recr(il)`).
    pub fn recurrent(self) -> bool {
        matches!(self, LayerMemory::Recurrent | LayerMemory::Both)
    }
}

/// RoPE as trained.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeInfo {
    /// Pairing of dimensions, by architecture.
    pub kind: RopeKind,
    /// Rotated dimensions per head (`n_rot`).
    pub n_rot: u32,
    /// Base frequency (`rope_freq_base_train`, default 10000).
    pub freq_base: f32,
    /// Frequency scale (`1 / rope.scaling.factor`, 1 without scaling).
    pub freq_scale: f32,
    /// `"none"`, `"linear"`, `"yarn"` or `"longrope"` (`rope.scaling.type`, default linear).
    pub scaling_type: String,
    /// YaRN's original context (`rope.scaling.original_context_length`, default `n_ctx_train`).
    pub n_ctx_orig_yarn: u32,
    /// `rope.scaling.attn_factor` (default 1).
    pub attn_factor: f32,
    /// `rope.scaling.yarn_log_multiplier` (DeepSeek-2; 0 when absent).
    pub yarn_log_mul: f32,
    /// `rope.scaling.finetuned`.
    pub finetuned: bool,
    /// Base of the sliding-window layers (`rope_freq_base_train_swa`).
    pub freq_base_swa: f32,
    /// Scale of the sliding-window layers (`rope_freq_scale_train_swa`).
    pub freq_scale_swa: f32,
    /// M-RoPE sections (`rope.dimension_sections`), empty when absent.
    pub sections: Vec<i32>,
    /// Tensors that hold per-dimension frequency factors (`rope_freqs.weight`, or Phi-3's
    /// `rope_factors_long.weight` / `rope_factors_short.weight`), empty when none.
    pub factor_tensors: Vec<String>,
}

impl RopeInfo {
    /// Whether positions are M-RoPE's (four per token: llama.cpp's `n_pos_per_embd() > 1`).
    pub fn is_mrope(&self) -> bool {
        matches!(self.kind, RopeKind::Mrope | RopeKind::Imrope)
    }
}

/// The sliding window.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SwaInfo {
    /// Window size in tokens (`n_swa`).
    pub window: u32,
    /// Every `pattern`-th layer is a full-attention layer (`n_swa_pattern`; 1: none is SWA);
    /// 0 when the model lists its sliding-window layers one by one.
    pub pattern: u32,
    /// Llama 4's chunked attention (its "window" is a chunk of 8192 tokens).
    pub chunked: bool,
}

/// Recurrent state dimensions.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct RecurrentInfo {
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
    /// RWKV `token_shift_count` (default 2).
    pub token_shift_count: u32,
    /// Rolling-state width per layer (`n_embd_k_s`).
    pub n_embd_k_s: u32,
    /// Recurrent-state width per layer (`n_embd_v_s`).
    pub n_embd_v_s: u32,
}

/// Everything the KV cache needs to know about a model.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelInfo {
    /// `general.architecture`.
    pub arch: String,
    /// `general.name`, when present.
    pub name: Option<String>,
    /// Layers (`block_count`).
    pub n_layer: u32,
    /// Multi-token-prediction layers at the end of them (`nextn_predict_layers`), which
    /// llama.cpp's `hparams.n_layer()` leaves out.
    pub n_layer_nextn: u32,
    /// Multi-head latent attention (both `attention.key_length_mla` and `value_length_mla`
    /// set, for an architecture that reads them): llama.cpp 0.1.161's cache keeps no V.
    pub mla: bool,
    /// A compressed KV (`attention.kv_lora_rank` set, for an architecture that reads it): each
    /// K head ends with its rotated dimensions, which the K-shift rotates (0.1.161).
    pub latent_kv: bool,
    /// Trained context length.
    pub n_ctx_train: u32,
    /// Embedding width.
    pub n_embd: u32,
    /// Dimensions per K head.
    pub n_embd_head_k: u32,
    /// Dimensions per V head.
    pub n_embd_head_v: u32,
    /// Per layer.
    pub layers: Vec<LayerGeometry>,
    /// RoPE.
    pub rope: RopeInfo,
    /// The sliding window, when the model has one.
    pub swa: Option<SwaInfo>,
    /// Recurrent dimensions of recurrent and hybrid models.
    pub recurrent: Option<RecurrentInfo>,
    /// Which memory llama.cpp builds for it.
    pub memory: MemoryKind,
    /// What llama.cpp 0.1.161 keeps per cell beside its position (`has_cell_ext()`):
    /// `pos2-tok` for M-RoPE models (`n_pos_per_embd() > 1`) and PLE models (`ple_n_heads >
    /// 0`), none for every other.
    pub cell_ext: CellExt,
    /// Tensors in the file.
    pub n_tensors: u64,
    /// File size.
    pub file_size: u64,
    /// Bytes of tensor data.
    pub data_size: u64,
    /// Bytes of header and tensor-info table.
    pub header_size: u64,
    /// `"blake3:<hex>"` of the header, tensor-info table and data size (or of the whole file).
    pub fingerprint: String,
    /// Bytes read from the file to produce this.
    pub bytes_read: u64,
}

/// Reads metadata under the architecture's prefix with llama.cpp's defaults and type rules.
struct Keys<'a> {
    h: &'a GgufHeader,
    arch: &'a str,
}

impl Keys<'_> {
    fn key(&self, suffix: &str) -> String {
        format!("{}.{suffix}", self.arch)
    }

    fn raw(&self, suffix: &str) -> Option<(String, &GgufValue)> {
        let k = self.key(suffix);
        self.h.get(&k).map(|v| (k, v))
    }

    fn u32_opt(&self, suffix: &str) -> Result<Option<u32>> {
        let Some((k, v)) = self.raw(suffix) else {
            return Ok(None);
        };
        let n = v.as_int().ok_or_else(|| wrong_type(&k, "an integer", v))?;
        u32::try_from(n)
            .map(Some)
            .map_err(|_| KvError::InvalidModel(format!("{k} = {n} is not a uint32")))
    }

    fn u32_req(&self, suffix: &str) -> Result<u32> {
        self.u32_opt(suffix)?.ok_or_else(|| self.missing(suffix))
    }

    fn f32_opt(&self, suffix: &str) -> Result<Option<f32>> {
        let Some((k, v)) = self.raw(suffix) else {
            return Ok(None);
        };
        v.as_float()
            .map(|f| Some(f as f32))
            .ok_or_else(|| wrong_type(&k, "a float", v))
    }

    fn bool_opt(&self, suffix: &str) -> Result<Option<bool>> {
        let Some((k, v)) = self.raw(suffix) else {
            return Ok(None);
        };
        v.as_bool()
            .map(Some)
            .ok_or_else(|| wrong_type(&k, "a bool", v))
    }

    fn str_opt(&self, suffix: &str) -> Result<Option<String>> {
        let Some((k, v)) = self.raw(suffix) else {
            return Ok(None);
        };
        v.as_str()
            .map(|s| Some(s.to_string()))
            .ok_or_else(|| wrong_type(&k, "a string", v))
    }

    /// `get_key_or_arr`: one value for every layer, or an array of exactly `n_layer` integers.
    fn per_layer(&self, suffix: &str, n_layer: u32) -> Result<Option<Vec<u32>>> {
        let Some((k, v)) = self.raw(suffix) else {
            return Ok(None);
        };
        if let GgufValue::Array { len, values, .. } = v {
            if *len != n_layer as u64 {
                return Err(KvError::InvalidModel(format!(
                    "{k} has {len} values, expected one per layer ({n_layer})"
                )));
            }
            let values = values
                .as_ref()
                .ok_or_else(|| KvError::InvalidModel(format!("{k} is too long ({len} values)")))?;
            return values
                .iter()
                .enumerate()
                .map(|(i, x)| {
                    x.as_int()
                        .and_then(|n| u32::try_from(n).ok())
                        .ok_or_else(|| wrong_type(&format!("{k}[{i}]"), "a uint32", x))
                })
                .collect::<Result<Vec<u32>>>()
                .map(Some);
        }
        Ok(Some(vec![self.u32_req(suffix)?; n_layer as usize]))
    }

    /// One flag per layer: an array of exactly `n_layer` bools or integers (non-zero: set), or
    /// one value for every layer.
    fn flags_per_layer(&self, suffix: &str, n_layer: u32) -> Result<Option<Vec<bool>>> {
        let Some((key, v)) = self.raw(suffix) else {
            return Ok(None);
        };
        let flag = |key: &str, v: &GgufValue| {
            v.as_bool()
                .or_else(|| v.as_int().map(|n| n != 0))
                .ok_or_else(|| wrong_type(key, "bools or integers", v))
        };
        match v {
            GgufValue::Array { len, values, .. } => {
                if *len != n_layer as u64 {
                    return Err(KvError::InvalidModel(format!(
                        "{key} has {len} values, expected one per layer ({n_layer})"
                    )));
                }
                let values = values.as_ref().ok_or_else(|| {
                    KvError::InvalidModel(format!("{key} is too long ({len} values)"))
                })?;
                values
                    .iter()
                    .map(|v| flag(&key, v))
                    .collect::<Result<_>>()
                    .map(Some)
            }
            v => Ok(Some(vec![flag(&key, v)?; n_layer as usize])),
        }
    }

    fn missing(&self, suffix: &str) -> KvError {
        KvError::InvalidModel(format!(
            "the model lacks {} (needed for architecture {:?})",
            self.key(suffix),
            self.arch
        ))
    }
}

/// A product of two header values that must fit a `u32`, as llama.cpp's widths do.
fn mul(a: u32, b: u32, what: &str) -> Result<u32> {
    a.checked_mul(b)
        .ok_or_else(|| KvError::InvalidModel(format!("{what} {a} x {b} overflows a uint32")))
}

fn wrong_type(key: &str, want: &str, got: &GgufValue) -> KvError {
    KvError::InvalidModel(format!(
        "{key} must be {want}, got a {} value",
        got.ty().name()
    ))
}

/// Which parts of the memory hold each layer, as 0.1.161 sets `is_recr` and filters the
/// layers of a hybrid memory (`llama_model::create_memory`).
fn layer_memories(
    k: &Keys,
    arch: &str,
    n_layer: u32,
    n_layer_nextn: u32,
    n_head_kv: &[u32],
) -> Result<Vec<LayerMemory>> {
    let n = n_layer as usize;
    let every = |m| vec![m; n];
    let Some(split) = arch::hybrid_split(arch) else {
        return Ok(every(if arch::is_recurrent(arch) {
            LayerMemory::Recurrent
        } else {
            LayerMemory::Attention
        }));
    };
    let by_flags = |recurrent: &dyn Fn(usize) -> bool| {
        (0..n)
            .map(|il| {
                if recurrent(il) {
                    LayerMemory::Recurrent
                } else {
                    LayerMemory::Attention
                }
            })
            .collect()
    };
    Ok(match split {
        HybridSplit::ByKvHeads => by_flags(&|il| n_head_kv[il] == 0),
        HybridSplit::Everywhere => every(LayerMemory::Both),
        HybridSplit::MlpOnlyApart => {
            let n_ff = k
                .per_layer("feed_forward_length", n_layer)?
                .unwrap_or(vec![0; n]);
            (0..n)
                .map(|il| match (n_head_kv[il], n_ff[il]) {
                    (0, 0) => LayerMemory::Recurrent,
                    (_, 0) => LayerMemory::Attention,
                    _ => LayerMemory::Neither,
                })
                .collect()
        }
        HybridSplit::Interval(default) => {
            // the multi-token-prediction layers at the end are in neither part
            let n_main = (n_layer - n_layer_nextn) as usize;
            let flags = match k.flags_per_layer("attention.recurrent_layers", n_layer)? {
                Some(flags) => flags,
                None => {
                    let interval = k.u32_opt("full_attention_interval")?.unwrap_or(default);
                    if interval == 0 {
                        return Err(KvError::InvalidModel(format!(
                            "{} = 0, expected a period of at least 1",
                            k.key("full_attention_interval")
                        )));
                    }
                    (0..n).map(|il| (il + 1) % interval as usize != 0).collect()
                }
            };
            (0..n)
                .map(|il| match (il < n_main, flags[il]) {
                    (false, _) => LayerMemory::Neither,
                    (true, true) => LayerMemory::Recurrent,
                    (true, false) => LayerMemory::Attention,
                })
                .collect()
        }
    })
}

impl ModelInfo {
    /// Reads the model at `path`: its header and tensor-info table only (plus every byte when
    /// `hash_file`, for a fingerprint of the whole file).
    pub fn from_file(path: &Path, hash_file: bool) -> Result<ModelInfo> {
        let read = gguf::read_file(path, hash_file)?;
        let mut info = ModelInfo::from_header(&read.header).map_err(|e| match e {
            KvError::InvalidModel(m) => KvError::InvalidModel(format!("{}: {m}", path.display())),
            other => other,
        })?;
        info.fingerprint = read.fingerprint;
        info.bytes_read = read.stats.bytes_read;
        Ok(info)
    }

    /// The model described by a parsed header (`fingerprint` and `bytes_read` left empty).
    pub fn from_header(h: &GgufHeader) -> Result<ModelInfo> {
        let arch = h
            .get("general.architecture")
            .ok_or_else(|| KvError::InvalidModel("the model lacks general.architecture".into()))?
            .as_str()
            .ok_or_else(|| KvError::InvalidModel("general.architecture must be a string".into()))?
            .to_string();
        let k = Keys { h, arch: &arch };
        let n_ctx_train = k.u32_req("context_length")?;
        let n_embd = k.u32_req("embedding_length")?;
        let n_layer = k.u32_req("block_count")?;
        if n_layer == 0 || n_layer > MAX_LAYERS {
            return Err(KvError::InvalidModel(format!(
                "{arch}.block_count = {n_layer}, expected 1..={MAX_LAYERS}"
            )));
        }
        let zeros = vec![0; n_layer as usize];
        let n_head = k
            .per_layer("attention.head_count", n_layer)?
            .unwrap_or(zeros);
        let n_head_kv = k
            .per_layer("attention.head_count_kv", n_layer)?
            .unwrap_or_else(|| n_head.clone());

        let n_ctx_orig_yarn = k
            .u32_opt("rope.scaling.original_context_length")?
            .unwrap_or(n_ctx_train);
        let freq_base = k.f32_opt("rope.freq_base")?.unwrap_or(10000.0);
        let scaling_type = k
            .str_opt("rope.scaling.type")?
            .unwrap_or_else(|| "linear".into());
        if !["none", "linear", "yarn", "longrope"].contains(&scaling_type.as_str()) {
            return Err(KvError::InvalidModel(format!(
                "{arch}.rope.scaling.type = {scaling_type:?}, expected none, linear, yarn or longrope"
            )));
        }
        let factor = match k.f32_opt("rope.scaling.factor")? {
            Some(f) => f,
            None => k.f32_opt("rope.scale_linear")?.unwrap_or(0.0),
        };
        let freq_scale = if factor == 0.0 { 1.0 } else { 1.0 / factor };

        // models without attention heads (Mamba, RWKV) have no head sizes and no RoPE dims
        let (mut n_embd_head_k, mut n_embd_head_v, mut n_rot) = (0, 0, 0);
        if let Some(head) = n_embd.checked_div(n_head[0]) {
            n_embd_head_k = k.u32_opt("attention.key_length")?.unwrap_or(head);
            n_embd_head_v = k.u32_opt("attention.value_length")?.unwrap_or(head);
            n_rot = k.u32_opt("rope.dimension_count")?.unwrap_or(n_embd_head_k);
            if matches!(arch.as_str(), "llama" | "deci" | "falcon") && n_rot != n_embd_head_k {
                return Err(KvError::InvalidModel(format!(
                    "invalid n_rot: {arch}.rope.dimension_count = {n_rot}, expected the head size {n_embd_head_k}"
                )));
            }
        }

        let mut rope = RopeInfo {
            kind: rope_kind(&arch),
            n_rot,
            freq_base,
            freq_scale,
            scaling_type,
            n_ctx_orig_yarn,
            attn_factor: k.f32_opt("rope.scaling.attn_factor")?.unwrap_or(1.0),
            yarn_log_mul: k
                .f32_opt("rope.scaling.yarn_log_multiplier")?
                .unwrap_or(0.0),
            finetuned: k.bool_opt("rope.scaling.finetuned")?.unwrap_or(false),
            freq_base_swa: freq_base,
            freq_scale_swa: freq_scale,
            sections: Vec::new(),
            factor_tensors: [
                "rope_freqs.weight",
                "rope_factors_long.weight",
                "rope_factors_short.weight",
            ]
            .into_iter()
            .filter(|n| h.tensor(n).is_some())
            .map(String::from)
            .collect(),
        };
        if let Some((
            key,
            GgufValue::Array {
                values: Some(v), ..
            },
        )) = k.raw("rope.dimension_sections")
        {
            rope.sections = v
                .iter()
                .map(|x| x.as_int().and_then(|n| i32::try_from(n).ok()))
                .collect::<Option<Vec<i32>>>()
                .ok_or_else(|| KvError::InvalidModel(format!("{key} must hold int32 values")))?;
        }

        // the sliding window, per architecture as load_hparams sets it
        let window = k.u32_opt("attention.sliding_window")?;
        let swa = match arch.as_str() {
            "gemma2" => Some((window.unwrap_or(4096), 2, false)),
            "gemma3" => {
                rope.freq_base_swa = 10000.0;
                rope.freq_scale_swa = 1.0;
                Some((
                    window.ok_or_else(|| k.missing("attention.sliding_window"))?,
                    6,
                    false,
                ))
            }
            "cohere2" => Some((
                window.ok_or_else(|| k.missing("attention.sliding_window"))?,
                4,
                false,
            )),
            "llama4" => Some((8192, 4, true)),
            // DeepSeek V4: every layer's raw cache uses the window (set_swa_pattern(0))
            "deepseek4" => Some((
                window.ok_or_else(|| k.missing("attention.sliding_window"))?,
                0,
                false,
            )),
            // Phi-3 masks with a window on every layer of one cache (pattern 1: no SWA layer)
            "phi3" => window
                .or(phi3_default_window(n_layer, n_ctx_train, &n_head_kv))
                .map(|w| (w, 1, false)),
            _ => window.map(|w| (w, 1, false)),
        };
        // today's llama.cpp lets `attention.sliding_window_pattern` override the architecture's
        // pattern: a period, or one flag per layer (0.1.103 predates the key)
        let mut explicit: Option<Vec<bool>> = None;
        let swa = match swa {
            Some((window, mut pattern, chunked)) => {
                match k.raw("attention.sliding_window_pattern") {
                    None => {}
                    Some((_, GgufValue::Array { .. })) => {
                        explicit =
                            k.flags_per_layer("attention.sliding_window_pattern", n_layer)?;
                        pattern = 0;
                    }
                    Some(_) => pattern = k.u32_req("attention.sliding_window_pattern")?,
                }
                Some(SwaInfo {
                    window,
                    pattern,
                    chunked,
                })
            }
            None => None,
        };
        // LFM2: every attention layer uses the window (0.1.161: `is_swa = !is_recr`)
        if arch == "lfm2" && swa.as_ref().is_some_and(|s| s.window > 0) {
            explicit = Some(n_head_kv.iter().map(|&h| h > 0).collect());
        }
        let is_swa = |il: u32| match (&swa, &explicit) {
            (Some(s), _) if s.window == 0 => false,
            (Some(_), Some(flags)) => flags[il as usize],
            // set_swa_pattern: every `pattern`-th layer is dense (a pattern of 0: all are SWA)
            (Some(s), None) => s.pattern == 0 || il % s.pattern < s.pattern - 1,
            (None, _) => false,
        };
        // multi-head latent attention (0.1.161's `is_mla()`: both MLA head sizes set): the
        // cache keeps the latent and its rotated part as K, and no V
        let mla = arch::reads_mla_keys(&arch)
            && k.u32_opt("attention.key_length_mla")?.unwrap_or(0) != 0
            && k.u32_opt("attention.value_length_mla")?.unwrap_or(0) != 0;
        // a compressed KV (`kv_lora_rank`) keeps the rotated dimensions at the end of each K
        // head: the K-shift skips the `n_embd_nope` before them (0.1.161's `n_lora_kv > 0`)
        let latent_kv = arch::reads_kv_lora_rank(&arch)
            && k.u32_opt("attention.kv_lora_rank")?.unwrap_or(0) != 0;
        let n_layer_nextn = k.u32_opt("nextn_predict_layers")?.unwrap_or(0);
        if n_layer_nextn > n_layer {
            return Err(KvError::InvalidModel(format!(
                "{} = {n_layer_nextn} exceeds the {n_layer} layers",
                k.key("nextn_predict_layers")
            )));
        }
        let memory_of_layer = layer_memories(&k, &arch, n_layer, n_layer_nextn, &n_head_kv)?;
        let layers = (0..n_layer)
            .map(|il| {
                let hk = n_head_kv[il as usize];
                Ok(LayerGeometry {
                    n_head: n_head[il as usize],
                    n_head_kv: hk,
                    n_embd_k_gqa: mul(n_embd_head_k, hk, "layer K width")?,
                    n_embd_v_gqa: mul(n_embd_head_v, hk, "layer V width")?,
                    swa: is_swa(il),
                    memory: memory_of_layer[il as usize],
                })
            })
            .collect::<Result<Vec<LayerGeometry>>>()?;

        let recurrent = if arch::is_rwkv(&arch) {
            let wkv = k.u32_req("wkv.head_size")?;
            let shift = k.u32_opt("token_shift_count")?.unwrap_or(2);
            Some(RecurrentInfo {
                wkv_head_size: wkv,
                token_shift_count: shift,
                n_embd_k_s: mul(shift, n_embd, "RWKV token-shift width")?,
                n_embd_v_s: mul(n_embd, wkv, "RWKV wkv state width")?,
                ..Default::default()
            })
        } else if arch::is_recurrent(&arch) || arch::is_hybrid(&arch) {
            let get = |s: &str| -> Result<u32> {
                if arch::is_recurrent(&arch) {
                    k.u32_req(s)
                } else {
                    Ok(k.u32_opt(s)?.unwrap_or(0))
                }
            };
            let (d_conv, d_inner, d_state) = (
                get("ssm.conv_kernel")?,
                get("ssm.inner_size")?,
                get("ssm.state_size")?,
            );
            let n_group = k.u32_opt("ssm.group_count")?.unwrap_or(0);
            let n_head0 = n_head[0];
            // Kimi's delta attention: the Q, K and V convolutions and one head_dim^2 state per head
            let kda = k.u32_opt("kda.head_dim")?.filter(|&d| d > 0);
            // MiniMax-01's lightning attention keeps one head_dim^2 state per head
            let la = (arch == "minimax-01").then_some(n_embd_head_k);
            let n_embd_k_s = match (k.u32_opt("shortconv.l_cache")?.filter(|&l| l > 0), kda) {
                // LFM2's short convolutions keep the last `l_cache - 1` inputs
                (Some(l_cache), _) => mul(l_cache - 1, n_embd, "short-convolution state width")?,
                (None, Some(kda)) => {
                    let taps = if d_conv > 0 { d_conv - 1 } else { 3 };
                    mul(
                        mul(3 * taps, n_head0, "KDA conv state width")?,
                        kda,
                        "KDA conv state width",
                    )?
                }
                // Mamba-2 groups convolve B and C beside x
                (None, None) => {
                    let bc = mul(2 * n_group, d_state, "SSM conv channels")?;
                    let channels = d_inner.checked_add(bc).ok_or_else(|| {
                        KvError::InvalidModel("SSM conv channels overflow a uint32".into())
                    })?;
                    mul(d_conv.saturating_sub(1), channels, "SSM conv state width")?
                }
            };
            let n_embd_v_s = match kda.or(la) {
                Some(head) => mul(mul(head, head, "head state width")?, n_head0, "state width")?,
                None => mul(d_state, d_inner, "SSM state width")?,
            };
            Some(RecurrentInfo {
                ssm_d_conv: d_conv,
                ssm_d_inner: d_inner,
                ssm_d_state: d_state,
                ssm_dt_rank: get("ssm.time_step_rank")?,
                ssm_n_group: n_group,
                token_shift_count: 0,
                n_embd_k_s,
                n_embd_v_s,
                ..Default::default()
            })
        } else {
            None
        };
        if arch == "deepseek2" && k.raw("rope.scaling.yarn_log_multiplier").is_none() {
            return Err(k.missing("rope.scaling.yarn_log_multiplier"));
        }

        let memory = match arch::memory_of(&arch) {
            MemoryKind::Unified if layers.iter().any(|l| l.swa) => MemoryKind::Iswa,
            kind => kind,
        };
        let name = h
            .get("general.name")
            .and_then(|v| v.as_str())
            .map(String::from);
        // PLE: qwen4exp with its n-gram hash layers listed (0.1.161 reads the group only then)
        let ple = arch == "qwen4exp"
            && matches!(k.raw("ple.layers"), Some((_, GgufValue::Array { len, .. })) if *len > 0);
        let cell_ext = if rope.is_mrope() || ple {
            CellExt::Pos2Tok
        } else {
            CellExt::None
        };
        Ok(ModelInfo {
            arch,
            name,
            n_layer,
            n_layer_nextn,
            mla,
            latent_kv,
            n_ctx_train,
            n_embd,
            n_embd_head_k,
            n_embd_head_v,
            layers,
            rope,
            swa,
            recurrent,
            memory,
            cell_ext,
            n_tensors: h.tensors.len() as u64,
            file_size: h.file_size,
            data_size: h.data_size,
            header_size: h.header_len,
            fingerprint: String::new(),
            bytes_read: 0,
        })
    }

    /// The recurrent widths that the cache adds to every layer: only a recurrent model's
    /// cache holds them (a hybrid model keeps them in a memory of their own).
    fn state_widths(&self) -> (u64, u64) {
        match (&self.recurrent, self.memory) {
            (Some(r), MemoryKind::Recurrent) => (r.n_embd_k_s as u64, r.n_embd_v_s as u64),
            _ => (0, 0),
        }
    }

    /// K width of layer `il` in the cache: `n_embd_k_gqa(il)`, plus `n_embd_k_s` when recurrent.
    pub fn cache_k_width(&self, il: usize) -> u64 {
        self.layers[il].n_embd_k_gqa as u64 + self.state_widths().0
    }

    /// V width of layer `il` in the cache: `n_embd_v_gqa(il)`, plus `n_embd_v_s` when recurrent.
    pub fn cache_v_width(&self, il: usize) -> u64 {
        self.layers[il].n_embd_v_gqa as u64 + self.state_widths().1
    }

    /// Refuses the models whose live memory this library does not build, naming why: the
    /// memories with an indexer cache (their state files still inspect and convert).
    pub fn check_live(&self) -> Result<()> {
        if self.memory.has_indexer() {
            let what = match self.memory {
                MemoryKind::Dsv4 => {
                    "compressed caches and compressor states beside a raw window cache"
                }
                _ => "an indexer cache beside K and V",
            };
            return Err(KvError::Unsupported(format!(
                "{} ({}): llama.cpp 0.1.161 gives it a '{}' memory ({what}), which this library \
                 does not hold live (its state files inspect, convert and go into the prompt store)",
                self.display_name(),
                self.arch,
                self.memory.name()
            )));
        }
        Ok(())
    }

    /// Refuses the K/V types a context of llama.cpp 0.1.161 refuses for this model
    /// (`llama_init_from_model`): K and V of different types for multi-head latent attention
    /// and DeepSeek V4, quantized V without flash attention, and with flash attention a
    /// quantized type whose block does not divide the head size.
    pub fn check_cache_types(
        &self,
        type_k: GgmlType,
        type_v: GgmlType,
        flash_attn: bool,
    ) -> Result<()> {
        let refuse = |m: String| {
            Err(KvError::InvalidArg(format!(
                "{} ({}): {m}",
                self.display_name(),
                self.arch
            )))
        };
        if (self.mla || self.memory == MemoryKind::Dsv4) && type_k != type_v {
            return refuse(format!(
                "K and V must be of one type, as llama.cpp 0.1.161 keeps them for this model, \
                 got typeK {type_k} and typeV {type_v}"
            ));
        }
        if type_v.is_quantized() && !flash_attn {
            return refuse(format!(
                "quantized V ({type_v}) needs flash attention (V is transposed without it)"
            ));
        }
        for (name, t, head) in [
            ("typeK", type_k, self.n_embd_head_k),
            ("typeV", type_v, self.n_embd_head_v),
        ] {
            if flash_attn && t.is_quantized() && !(head as usize).is_multiple_of(t.block_size()) {
                return refuse(format!(
                    "{name} {t} with flash attention needs a head size its block of {} divides, \
                     got {head}",
                    t.block_size()
                ));
            }
        }
        Ok(())
    }

    fn display_name(&self) -> &str {
        self.name.as_deref().unwrap_or("the model")
    }

    /// Parameters of a cache for this model, as llama.cpp 0.1.161 builds it for `n_ctx`
    /// (padded to 256; 0 = the trained context) and `n_seq_max`; a recurrent
    /// model gets one cell per sequence, of f32 rows whatever `type_k` and `type_v` say. The
    /// types are refused where a 0.1.161 context refuses them ([`ModelInfo::check_cache_types`]).
    pub fn cache_params(
        &self,
        n_ctx: u32,
        n_seq_max: u32,
        type_k: GgmlType,
        type_v: GgmlType,
        flash_attn: bool,
    ) -> Result<CacheParams> {
        if self.memory == MemoryKind::Hybrid {
            return Err(KvError::Unsupported(format!(
                "{} ({}) is a hybrid model (attention layers plus recurrent layers): its \
                 memory is an attention cache and a recurrent memory side by side \
                 (HybridCache::for_model), not one unified cache",
                self.display_name(),
                self.arch
            )));
        }
        if self.memory == MemoryKind::Iswa {
            let n = self.layers.iter().filter(|l| l.swa).count();
            let s = self.swa.as_ref().map_or((0, 0), |s| (s.window, s.pattern));
            return Err(KvError::Unsupported(format!(
                "{} ({}) uses sliding-window attention on {n} of {} layers (window {}, pattern \
                 {}): llama.cpp keeps those layers in a second cache, so its memory is an iSWA \
                 memory (IswaParams::for_model), not one unified cache",
                self.display_name(),
                self.arch,
                self.n_layer,
                s.0,
                s.1
            )));
        }
        self.check_cache_types(type_k, type_v, flash_attn)?;
        let recurrent = self.memory == MemoryKind::Recurrent;
        let mut p = self.params_of_layers(1, n_seq_max, type_k, type_v, flash_attn);
        let n_ctx = if n_ctx == 0 { self.n_ctx_train } else { n_ctx };
        // 0.1.161 pads every context to 256 cells (the seed padded to 32 without flash
        // attention)
        p.size = if recurrent {
            n_seq_max.max(1)
        } else {
            n_ctx
                .checked_next_multiple_of(256)
                .ok_or_else(|| KvError::OutOfRange(format!("nCtx {n_ctx} is too large")))?
        };
        if recurrent {
            // today's llama.cpp builds `llama_memory_recurrent`, whose removals differ from
            // the seed's, and whose R and S rows are f32 whatever the context's K/V types
            p.recurrent_rules = crate::params::RecurrentRules::V0_1_161;
            (p.type_k, p.type_v) = (GgmlType::F32, GgmlType::F32);
        }
        (p.n_rot_k, p.n_rot_v) = self.rotation(p.type_k, p.type_v);
        p.validate()?;
        Ok(p)
    }

    /// Parameters of a cache of `size` cells holding every layer of this model, whatever
    /// memory llama.cpp builds for it (a memory of several parts takes its layers from it).
    pub fn layer_params(
        &self,
        size: u32,
        n_seq_max: u32,
        type_k: GgmlType,
        type_v: GgmlType,
        flash_attn: bool,
    ) -> Result<CacheParams> {
        let p = self.params_of_layers(size, n_seq_max, type_k, type_v, flash_attn);
        p.validate()?;
        Ok(p)
    }

    /// The Hadamard rotation llama.cpp 0.1.161 gives quantized K and V of this model
    /// (`n_rot_k`, `n_rot_v`; 0: none): 64 for a head size that 64 divides, and for K doubled
    /// while the head size allows.
    pub fn rotation(&self, type_k: GgmlType, type_v: GgmlType) -> (u32, u32) {
        let (hk, hv) = (self.n_embd_head_k, self.n_embd_head_v);
        let mut n_rot_k = 0;
        if type_k.is_quantized() && hk > 0 && hk % 64 == 0 {
            n_rot_k = 64;
            while hk % (2 * n_rot_k) == 0 {
                n_rot_k *= 2;
            }
        }
        // a cache without V (latent attention) rotates none
        let n_rot_v = if type_v.is_quantized() && !self.mla && hv > 0 && hv % 64 == 0 {
            64
        } else {
            0
        };
        (n_rot_k, n_rot_v)
    }

    /// [`ModelInfo::layer_params`], not yet validated.
    pub(crate) fn params_of_layers(
        &self,
        size: u32,
        n_seq_max: u32,
        type_k: GgmlType,
        type_v: GgmlType,
        flash_attn: bool,
    ) -> CacheParams {
        let recurrent = self.memory == MemoryKind::Recurrent;
        let mut p = CacheParams::new(size, self.n_layer, 0, 0);
        p.n_embd_k_gqa = self.layers.iter().map(|l| l.n_embd_k_gqa).collect();
        p.n_embd_v_gqa = self.layers.iter().map(|l| l.n_embd_v_gqa).collect();
        if let Some(r) = &self.recurrent {
            p.n_embd_k_s = r.n_embd_k_s;
            p.n_embd_v_s = r.n_embd_v_s;
        }
        p.type_k = type_k;
        p.type_v = type_v;
        p.flash_attn = flash_attn;
        p.recurrent = recurrent;
        // an M-RoPE cache cannot shift: 0.1.161 asserts on seq_add / seq_div of one
        p.mrope = self.rope.is_mrope();
        p.can_shift = !recurrent && !p.mrope;
        p.cell_ext = self.cell_ext;
        p.no_v = self.mla;
        p.n_seq_max = n_seq_max;
        p
    }

    /// The K-shift parameters llama.cpp's `build_kv_self_shift` uses for this model with the
    /// context's defaults (no RoPE overrides); `freq_factors` are the values of the model's
    /// factor tensor, when it has one. `None` when the model has no RoPE this library can apply.
    pub fn shift_params(&self, freq_factors: Option<Vec<f32>>) -> Option<ShiftParams> {
        let rope_type = match self.rope.kind {
            RopeKind::Norm => RopeType::Norm,
            RopeKind::Neox => RopeType::Neox,
            _ => return None,
        };
        if self.n_rot() == 0 || self.memory == MemoryKind::Recurrent {
            return None;
        }
        let yarn = self.rope.scaling_type == "yarn";
        let freq_scale = if self.rope.scaling_type == "none" {
            1.0
        } else {
            self.rope.freq_scale
        };
        let attn_factor = self.shift_attn_factor(freq_scale, yarn);
        let layer = |il: usize| -> RopeParams {
            let swa = self.layers[il].swa;
            let (base, scale) = if swa {
                (self.rope.freq_base_swa, self.rope.freq_scale_swa)
            } else {
                (self.rope.freq_base, freq_scale)
            };
            let mut p = RopeParams::new(
                self.n_rot() as usize,
                self.n_embd_head_k as usize,
                self.layers[il].n_head_kv as usize,
                rope_type,
            );
            p.freq_base = base;
            p.freq_scale = scale;
            p.ext_factor = if yarn { 1.0 } else { 0.0 };
            p.attn_factor = attn_factor;
            p.n_ctx_orig = self.rope.n_ctx_orig_yarn;
            p.freq_factors = freq_factors.clone();
            if self.latent_kv {
                p.dims_offset = p.head_dim.saturating_sub(p.n_dims);
            }
            p
        };
        let rope = layer(0);
        let per_layer = (1..self.n_layer as usize)
            .map(|il| (il as u32, layer(il)))
            .filter(|(_, p)| *p != rope)
            .collect();
        Some(ShiftParams { rope, per_layer })
    }

    fn n_rot(&self) -> u32 {
        self.rope.n_rot
    }

    /// The magnitude factor llama.cpp 0.1.161 gives its K-shift (`cparams.yarn_attn_factor`,
    /// set in `llama_context`'s constructor from the context's frequency scale). With YaRN on,
    /// ggml's `rope_yarn` multiplies cos and sin by `1 + 0.1 ln(factor)`; 0.1.161 cancels that
    /// with `1 / (1 + 0.1 ln(factor))` and puts back `get_mscale(factor, 1)` (with a
    /// `yarn_log_multiplier`, a ratio of two such scales), all in f32, so the product is not
    /// always 1: for a factor of 12 it is 1 - 2^-24, which an f32 K shows in every row (below
    /// 1, `get_mscale` is 1 and the cancelled magnitude is not put back). 0.1.103 passed
    /// `rope.scaling.attn_factor` unchanged (and `1 / (1 + 0.1 ln(1 / scale))` for DeepSeek 2).
    fn shift_attn_factor(&self, freq_scale: f32, yarn: bool) -> f32 {
        if !yarn {
            return self.rope.attn_factor;
        }
        let get_mscale = |scale: f32, mscale: f32| {
            if scale <= 1.0 {
                1.0
            } else {
                0.1 * mscale * scale.ln() + 1.0
            }
        };
        let factor = 1.0 / freq_scale;
        // `hparams.rope_yarn_log_mul`: DeepSeek 2 / 3.2 store the key divided by 0.1 (their
        // converter multiplies it by 0.1), Mistral 3 as it is; other architectures never read it
        let log_mul = match self.arch.as_str() {
            "deepseek2" | "deepseek32" => self.rope.yarn_log_mul / 0.1,
            "mistral3" => self.rope.yarn_log_mul,
            _ => 0.0,
        };
        let mut attn = if log_mul != 0.0 {
            let mscale = if self.arch == "deepseek2" && log_mul != 1.0 {
                log_mul
            } else {
                1.0
            };
            get_mscale(factor, mscale) / get_mscale(factor, log_mul)
        } else {
            get_mscale(factor, 1.0)
        };
        attn *= 1.0 / (1.0 + 0.1 * factor.ln());
        attn * self.rope.attn_factor
    }

    /// The factor tensor llama.cpp uses for RoPE with `n_ctx_per_seq` tokens per sequence:
    /// `rope_freqs`, or Phi-3's long factors past the original context and short ones below.
    pub fn factor_tensor(&self, n_ctx_per_seq: u32) -> Option<&str> {
        let has = |n: &str| self.rope.factor_tensors.iter().any(|t| t == n);
        if has("rope_freqs.weight") {
            Some("rope_freqs.weight")
        } else if has("rope_factors_long.weight") && n_ctx_per_seq > self.rope.n_ctx_orig_yarn {
            Some("rope_factors_long.weight")
        } else if has("rope_factors_short.weight") {
            Some("rope_factors_short.weight")
        } else {
            None
        }
    }

    /// Bytes of K and V for `cells` cells with the given types, over every layer, as this
    /// model's caches keep them (no V for multi-head latent attention, the state widths for a
    /// recurrent model): `None` when a width is not a whole number of the type's blocks.
    pub fn kv_bytes(&self, cells: u64, type_k: GgmlType, type_v: GgmlType) -> Option<u64> {
        let one_cell = self.params_of_layers(1, 1, type_k, type_v, true);
        one_cell.tensor_bytes().ok()?.checked_mul(cells)
    }
}

/// Phi-3's window when the file names none (load_hparams' backward-compatibility defaults).
fn phi3_default_window(n_layer: u32, n_ctx_train: u32, n_head_kv: &[u32]) -> Option<u32> {
    match (n_layer, n_ctx_train) {
        (32 | 40, 4096) => Some(2047),
        (32, 131072) if n_head_kv[0] == 32 => Some(262144),
        (40, 131072) => Some(131072),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::gguf::{GgufBuilder, GgufType};

    fn llama(kv_heads: GgufValue) -> GgufBuilder {
        let mut g = GgufBuilder::new();
        g.kv("general.architecture", GgufValue::Str("llama".into()))
            .kv("llama.context_length", GgufValue::U32(4096))
            .kv("llama.embedding_length", GgufValue::U32(64))
            .kv("llama.block_count", GgufValue::U32(3))
            .kv("llama.attention.head_count", GgufValue::U32(4))
            .kv("llama.attention.head_count_kv", kv_heads)
            .kv("llama.rope.freq_base", GgufValue::F32(500000.0));
        g
    }

    fn info(g: &GgufBuilder) -> Result<ModelInfo> {
        ModelInfo::from_header(&gguf::parse_bytes(&g.bytes_zero_data())?)
    }

    /// A header of `arch` with llama's keys under that architecture's prefix.
    fn named(arch: &str, kv_heads: GgufValue) -> GgufBuilder {
        named_layers(arch, kv_heads, 3)
    }

    /// [`named`] with `n_layer` layers.
    fn named_layers(arch: &str, kv_heads: GgufValue, n_layer: u32) -> GgufBuilder {
        let mut g = GgufBuilder::new();
        g.kv("general.architecture", GgufValue::Str(arch.into()))
            .kv(&format!("{arch}.context_length"), GgufValue::U32(4096))
            .kv(&format!("{arch}.embedding_length"), GgufValue::U32(64))
            .kv(&format!("{arch}.block_count"), GgufValue::U32(n_layer))
            .kv(&format!("{arch}.attention.head_count"), GgufValue::U32(4))
            .kv(&format!("{arch}.attention.head_count_kv"), kv_heads);
        g
    }

    #[test]
    fn live_memories_are_refused_by_the_kind_or_rule_not_modeled() {
        let kinds = [
            ("deepseek4", "'dsv4'"),
            ("minimax-m3", "'msa'"),
            ("qwen4exp", "'hybrid-idx'"),
        ];
        for (arch, kind) in kinds {
            let mut g = named(arch, GgufValue::U32(2));
            if arch == "deepseek4" {
                // required, as 0.1.161 requires it: every layer's raw cache uses the window
                g.kv("deepseek4.attention.sliding_window", GgufValue::U32(128));
            }
            let m = info(&g).unwrap();
            let e = m.check_live().unwrap_err().to_string();
            assert!(e.contains(kind) && e.contains(arch), "{e}");
        }
        assert!(info(&llama(GgufValue::U32(2)))
            .unwrap()
            .check_live()
            .is_ok());
    }

    #[test]
    fn llama_geometry_and_rope() {
        let m = info(&llama(GgufValue::U32(2))).unwrap();
        assert_eq!((m.n_layer, m.n_embd_head_k, m.rope.n_rot), (3, 16, 16));
        assert!(m.layers.iter().all(|l| l.n_embd_k_gqa == 32 && !l.swa));
        assert_eq!(m.rope.kind, RopeKind::Norm);
        assert_eq!((m.rope.freq_base, m.rope.freq_scale), (500000.0, 1.0));
        assert_eq!(m.memory, MemoryKind::Unified);
        let s = m.shift_params(None).unwrap();
        assert_eq!((s.rope.n_head, s.rope.freq_base), (2, 500000.0));
        assert!(s.per_layer.is_empty());
    }

    #[test]
    fn per_layer_kv_heads_give_per_layer_widths_and_shift_heads() {
        let heads = vec![GgufValue::U32(1), GgufValue::U32(2), GgufValue::U32(4)];
        let g = llama(GgufValue::Array {
            elem: GgufType::U32,
            len: 3,
            values: Some(heads),
        });
        let m = info(&g).unwrap();
        let w: Vec<u32> = m.layers.iter().map(|l| l.n_embd_v_gqa).collect();
        assert_eq!(w, [16, 32, 64]);
        let s = m.shift_params(None).unwrap();
        assert_eq!(s.per_layer.len(), 2);
        assert_eq!(s.per_layer[1].1.n_head, 4);
        let p = m
            .cache_params(100, 2, GgmlType::F16, GgmlType::F16, false)
            .unwrap();
        assert_eq!((p.size, p.n_embd_k_gqa.clone()), (256, vec![16, 32, 64]));
    }

    #[test]
    fn kv_head_array_of_the_wrong_length_is_refused() {
        let g = llama(GgufValue::Array {
            elem: GgufType::U32,
            len: 2,
            values: Some(vec![GgufValue::U32(1); 2]),
        });
        let e = info(&g).unwrap_err().to_string();
        assert!(
            e.contains("head_count_kv has 2 values, expected one per layer (3)"),
            "{e}"
        );
    }

    #[test]
    fn missing_and_mistyped_keys_name_the_key() {
        let mut g = GgufBuilder::new();
        g.kv("general.architecture", GgufValue::Str("llama".into()));
        let e = info(&g).unwrap_err().to_string();
        assert!(e.contains("llama.context_length"), "{e}");
        let mut g = llama(GgufValue::U32(2));
        g.kv("llama.rope.dimension_count", GgufValue::Str("16".into()));
        let e = info(&g).unwrap_err().to_string();
        assert!(
            e.contains("llama.rope.dimension_count must be an integer"),
            "{e}"
        );
    }

    /// A Gemma 3 header with `n_layer` layers, a window of `window` and `more` keys.
    fn gemma3(n_layer: u32, window: u32, more: &[(&str, GgufValue)]) -> GgufBuilder {
        let mut g = GgufBuilder::new();
        g.kv("general.architecture", GgufValue::Str("gemma3".into()))
            .kv("gemma3.context_length", GgufValue::U32(8192))
            .kv("gemma3.embedding_length", GgufValue::U32(64))
            .kv("gemma3.block_count", GgufValue::U32(n_layer))
            .kv("gemma3.attention.head_count", GgufValue::U32(4))
            .kv("gemma3.attention.sliding_window", GgufValue::U32(window));
        for (k, v) in more {
            g.kv(&format!("gemma3.{k}"), v.clone());
        }
        g
    }

    #[test]
    fn gemma3_is_iswa_and_refused_with_what_is_missing() {
        let g = gemma3(
            12,
            512,
            &[
                ("attention.head_count_kv", GgufValue::U32(1)),
                ("rope.freq_base", GgufValue::F32(1e6)),
            ],
        );
        let m = info(&g).unwrap();
        let swa: Vec<bool> = m.layers.iter().map(|l| l.swa).collect();
        assert_eq!(swa.iter().filter(|s| !**s).count(), 2);
        assert!(!swa[5] && !swa[11] && swa[0]);
        assert_eq!(m.memory, MemoryKind::Iswa);
        assert_eq!(m.rope.kind, RopeKind::Neox);
        assert_eq!(m.rope.freq_base_swa, 10000.0);
        let e = m
            .cache_params(512, 1, GgmlType::F16, GgmlType::F16, false)
            .unwrap_err();
        assert!(
            matches!(&e, KvError::Unsupported(m) if m.contains("iSWA") && m.contains("10 of 12")),
            "{e}"
        );
    }

    #[test]
    fn sliding_window_pattern_key_overrides_the_architecture_default() {
        let g = |pattern: GgufValue| {
            info(&gemma3(
                4,
                8,
                &[("attention.sliding_window_pattern", pattern)],
            ))
        };
        let swa = |m: ModelInfo| m.layers.iter().map(|l| l.swa).collect::<Vec<bool>>();
        assert_eq!(
            swa(g(GgufValue::U32(2)).unwrap()),
            [true, false, true, false]
        );
        let flags = [true, true, false, true].map(GgufValue::Bool).to_vec();
        let arr = GgufValue::Array {
            elem: GgufType::Bool,
            len: 4,
            values: Some(flags),
        };
        assert_eq!(swa(g(arr).unwrap()), [true, true, false, true]);
        let short = GgufValue::Array {
            elem: GgufType::Bool,
            len: 1,
            values: Some(vec![GgufValue::Bool(true)]),
        };
        assert!(g(short)
            .unwrap_err()
            .to_string()
            .contains("one per layer (4)"));
    }

    #[test]
    fn mamba_is_recurrent_with_state_widths() {
        let mut g = GgufBuilder::new();
        g.kv("general.architecture", GgufValue::Str("mamba".into()))
            .kv("mamba.context_length", GgufValue::U32(4096))
            .kv("mamba.embedding_length", GgufValue::U32(64))
            .kv("mamba.block_count", GgufValue::U32(2))
            .kv("mamba.ssm.conv_kernel", GgufValue::U32(4))
            .kv("mamba.ssm.inner_size", GgufValue::U32(128))
            .kv("mamba.ssm.state_size", GgufValue::U32(16))
            .kv("mamba.ssm.time_step_rank", GgufValue::U32(4));
        let m = info(&g).unwrap();
        let r = m.recurrent.as_ref().unwrap();
        assert_eq!((r.n_embd_k_s, r.n_embd_v_s), (384, 2048));
        assert_eq!(m.memory, MemoryKind::Recurrent);
        assert!(m.shift_params(None).is_none());
        let p = m
            .cache_params(4096, 3, GgmlType::F32, GgmlType::F32, false)
            .unwrap();
        assert_eq!((p.size, p.recurrent, p.n_embd_k(0)), (3, true, 384));
    }

    #[test]
    fn yarn_scaling_sets_ext_factor_and_orig_ctx() {
        let mut g = llama(GgufValue::U32(2));
        g.kv("llama.rope.scaling.type", GgufValue::Str("yarn".into()))
            .kv("llama.rope.scaling.factor", GgufValue::F32(4.0))
            .kv(
                "llama.rope.scaling.original_context_length",
                GgufValue::U32(1024),
            );
        let m = info(&g).unwrap();
        let s = m.shift_params(None).unwrap();
        assert_eq!(
            (s.rope.ext_factor, s.rope.freq_scale, s.rope.n_ctx_orig),
            (1.0, 0.25, 1024)
        );
    }

    fn yarn(factor: f32, attn_factor: Option<f32>) -> ModelInfo {
        let mut g = llama(GgufValue::U32(2));
        g.kv("llama.rope.scaling.type", GgufValue::Str("yarn".into()))
            .kv("llama.rope.scaling.factor", GgufValue::F32(factor));
        if let Some(a) = attn_factor {
            g.kv("llama.rope.scaling.attn_factor", GgufValue::F32(a));
        }
        info(&g).unwrap()
    }

    fn shift_attn(m: &ModelInfo) -> f32 {
        m.shift_params(None).unwrap().rope.attn_factor
    }

    /// Regression (found against llama.cpp 0.1.161's own shift of an f32 K, crates/today):
    /// the YaRN attention factor was `rope.scaling.attn_factor` as 0.1.103 passes it; 0.1.161
    /// computes `get_mscale(f, 1) * (1 / (1 + 0.1 ln f)) * attn_factor` in f32.
    #[test]
    fn regression_yarn_attention_factor_is_computed_as_llama_cpp_0_1_161_does() {
        // factor 12: 1 - 2^-24 (the peer's f32 K agrees bit for bit); factor 4: exactly 1
        assert_eq!(shift_attn(&yarn(12.0, None)).to_bits(), 0x3f7f_ffff);
        assert_eq!(shift_attn(&yarn(4.0, None)), 1.0);
        assert_eq!(shift_attn(&yarn(4.0, Some(0.5))), 0.5);
        // below 1, get_mscale is 1: the cancelled magnitude is not put back
        let below = shift_attn(&yarn(0.5, None));
        assert_eq!(below, 1.0 / (1.0 + 0.1 * 0.5f32.ln()));
        assert!(below > 1.07);
        // without YaRN the metadata value passes unchanged
        let mut g = llama(GgufValue::U32(2));
        g.kv("llama.rope.scaling.factor", GgufValue::F32(12.0))
            .kv("llama.rope.scaling.attn_factor", GgufValue::F32(0.75));
        let linear = info(&g).unwrap();
        assert_eq!(linear.rope.scaling_type, "linear");
        assert_eq!(shift_attn(&linear), 0.75);
    }

    #[test]
    fn yarn_log_multiplier_gives_the_ratio_of_two_mscales_where_llama_cpp_reads_it() {
        let cancel = 1.0 / (1.0 + 0.1 * 40f32.ln());
        // DeepSeek 2: the key (0.1 * mscale_all_dim) is divided by 0.1 again; with mscale ==
        // mscale_all_dim the ratio is 1, leaving 0.1.103's 1 / (1 + 0.1 ln f)
        let mut m = yarn(40.0, None);
        m.arch = "deepseek2".into();
        m.rope.yarn_log_mul = 0.1 * 0.707;
        assert_eq!(shift_attn(&m), cancel);
        // Mistral 3 reads the key as it is, with mscale 1
        m.arch = "mistral3".into();
        m.rope.yarn_log_mul = 0.5;
        let get = |mscale: f32| 0.1 * mscale * 40f32.ln() + 1.0;
        assert_eq!(shift_attn(&m), get(1.0) / get(0.5) * cancel);
        // a llama never reads it
        m.arch = "llama".into();
        assert_eq!(shift_attn(&m), get(1.0) * cancel);
    }

    #[test]
    fn kv_bytes_follow_row_sizes() {
        let m = info(&llama(GgufValue::U32(2))).unwrap();
        // 3 layers x (32 + 32) f16 = 384 bytes per cell
        assert_eq!(m.kv_bytes(10, GgmlType::F16, GgmlType::F16), Some(3840));
        assert_eq!(
            m.kv_bytes(1, GgmlType::Q8_0, GgmlType::Q8_0),
            Some(3 * 2 * 34)
        );
        // 16-wide rows are not whole q4_0 blocks... but 32 are
        assert!(m.kv_bytes(1, GgmlType::Q4_0, GgmlType::Q4_0).is_some());
    }

    fn memories(m: &ModelInfo) -> Vec<LayerMemory> {
        m.layers.iter().map(|l| l.memory).collect()
    }

    #[test]
    fn a_qwen35_hybrid_takes_its_recurrent_layers_from_the_interval_or_the_explicit_flags() {
        use LayerMemory::{Attention as A, Neither as N, Recurrent as R};
        let qwen35 = |keys: &[(&str, GgufValue)]| {
            let mut g = named_layers("qwen35", GgufValue::U32(2), 8);
            for (k, v) in keys {
                g.kv(&format!("qwen35.{k}"), v.clone());
            }
            info(&g)
        };
        // the default interval of 4: every fourth layer attends
        assert_eq!(memories(&qwen35(&[]).unwrap()), [R, R, R, A, R, R, R, A]);
        let every_2nd = ("full_attention_interval", GgufValue::U32(2));
        assert_eq!(
            memories(&qwen35(std::slice::from_ref(&every_2nd)).unwrap()),
            [R, A, R, A, R, A, R, A]
        );
        // a multi-token-prediction layer at the end is in neither part
        let mtp = ("nextn_predict_layers", GgufValue::U32(1));
        let m = qwen35(&[every_2nd.clone(), mtp.clone()]).unwrap();
        assert_eq!((memories(&m)[7], m.n_layer_nextn), (N, 1));
        // the explicit flags win over the interval
        let flags = GgufValue::Array {
            elem: GgufType::U32,
            len: 8,
            values: Some([1u32, 1, 0, 0, 1, 1, 0, 0].map(GgufValue::U32).to_vec()),
        };
        let explicit = ("attention.recurrent_layers", flags);
        assert_eq!(
            memories(&qwen35(&[every_2nd, mtp, explicit]).unwrap()),
            [R, R, A, A, R, R, A, N]
        );
        let wrong = ("attention.recurrent_layers", GgufValue::Str("x".into()));
        let e = qwen35(&[wrong]).unwrap_err().to_string();
        assert!(
            e.contains("qwen35.attention.recurrent_layers must be bools or integers"),
            "{e}"
        );
    }

    #[test]
    fn a_zero_attention_interval_or_too_many_nextn_layers_are_refused_by_name() {
        let mut g = named("qwen3next", GgufValue::U32(2));
        g.kv("qwen3next.full_attention_interval", GgufValue::U32(0));
        let e = info(&g).unwrap_err().to_string();
        assert!(e.contains("qwen3next.full_attention_interval = 0"), "{e}");
        let mut g = named("qwen3next", GgufValue::U32(2));
        g.kv("qwen3next.nextn_predict_layers", GgufValue::U32(4));
        let e = info(&g).unwrap_err().to_string();
        assert!(
            e.contains("qwen3next.nextn_predict_layers = 4 exceeds the 3 layers"),
            "{e}"
        );
    }

    #[test]
    fn falcon_h1_keeps_every_layer_in_both_parts() {
        let m = info(&named("falcon-h1", GgufValue::U32(2))).unwrap();
        assert_eq!(memories(&m), [LayerMemory::Both; 3]);
        assert!(m
            .layers
            .iter()
            .all(|l| l.memory.attends() && l.memory.recurrent()));
        assert!(m.check_live().is_ok());
    }

    #[test]
    fn kimi_delta_attention_and_minimax_lightning_attention_state_widths_are_0_1_161s() {
        // Kimi Linear: 3 x (d_conv - 1) x n_head x head_dim conv state, head_dim^2 x n_head
        let mut g = named(
            "kimi-linear",
            GgufValue::Array {
                elem: GgufType::U32,
                len: 3,
                values: Some([0u32, 2, 0].map(GgufValue::U32).to_vec()),
            },
        );
        g.kv("kimi-linear.kda.head_dim", GgufValue::U32(8))
            .kv("kimi-linear.ssm.conv_kernel", GgufValue::U32(4));
        let m = info(&g).unwrap();
        let r = m.recurrent.clone().unwrap();
        assert_eq!((r.n_embd_k_s, r.n_embd_v_s), (3 * 3 * 4 * 8, 8 * 8 * 4));
        use LayerMemory::{Attention as A, Recurrent as R};
        assert_eq!(memories(&m), [R, A, R]);
        // MiniMax-01: one (n_embd / n_head)^2 state per head, every eighth layer attends
        let m = info(&named("minimax-01", GgufValue::U32(4))).unwrap();
        let r = m.recurrent.clone().unwrap();
        assert_eq!((r.n_embd_k_s, r.n_embd_v_s), (0, 16 * 16 * 4));
        assert_eq!(memories(&m), [R, R, R]);
    }
}
