//! RoPE as a model was trained with it: the rope type of each architecture, as llama.cpp
//! 0.1.103 and 0.1.161 list them, and the header's RoPE keys (base, scale, YaRN, M-RoPE
//! sections, frequency-factor tensors).

use crate::error::{KvError, Result};
use crate::model::gguf::GgufValue;
use crate::model::hparams::Keys;

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

/// The frequency base and scaling of a model, read before its head sizes (as the header was
/// always read, so that a header with several faults is refused for the same one).
pub(super) struct RopeScaling {
    n_ctx_orig_yarn: u32,
    freq_base: f32,
    scaling_type: String,
    freq_scale: f32,
}

impl RopeScaling {
    pub(super) fn read(k: &Keys, n_ctx_train: u32) -> Result<RopeScaling> {
        let n_ctx_orig_yarn = k
            .u32_opt("rope.scaling.original_context_length")?
            .unwrap_or(n_ctx_train);
        let freq_base = k.f32_opt("rope.freq_base")?.unwrap_or(10000.0);
        let scaling_type = k
            .str_opt("rope.scaling.type")?
            .unwrap_or_else(|| "linear".into());
        if !["none", "linear", "yarn", "longrope"].contains(&scaling_type.as_str()) {
            return Err(KvError::InvalidModel(format!(
                "{}.rope.scaling.type = {scaling_type:?}, expected none, linear, yarn or longrope",
                k.arch
            )));
        }
        let factor = match k.f32_opt("rope.scaling.factor")? {
            Some(f) => f,
            None => k.f32_opt("rope.scale_linear")?.unwrap_or(0.0),
        };
        let freq_scale = if factor == 0.0 { 1.0 } else { 1.0 / factor };
        Ok(RopeScaling {
            n_ctx_orig_yarn,
            freq_base,
            scaling_type,
            freq_scale,
        })
    }

    /// The model's RoPE, rotating `n_rot` dimensions per head.
    pub(super) fn into_rope(self, k: &Keys, n_rot: u32) -> Result<RopeInfo> {
        // Gemma 3's sliding-window layers rotate with their own base, unscaled
        let (freq_base_swa, freq_scale_swa) = if k.arch == "gemma3" {
            (10000.0, 1.0)
        } else {
            (self.freq_base, self.freq_scale)
        };
        let mut rope = RopeInfo {
            kind: rope_kind(k.arch),
            n_rot,
            freq_base: self.freq_base,
            freq_scale: self.freq_scale,
            scaling_type: self.scaling_type,
            n_ctx_orig_yarn: self.n_ctx_orig_yarn,
            attn_factor: k.f32_opt("rope.scaling.attn_factor")?.unwrap_or(1.0),
            yarn_log_mul: k
                .f32_opt("rope.scaling.yarn_log_multiplier")?
                .unwrap_or(0.0),
            finetuned: k.bool_opt("rope.scaling.finetuned")?.unwrap_or(false),
            freq_base_swa,
            freq_scale_swa,
            sections: Vec::new(),
            factor_tensors: [
                "rope_freqs.weight",
                "rope_factors_long.weight",
                "rope_factors_short.weight",
            ]
            .into_iter()
            .filter(|n| k.h.tensor(n).is_some())
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
        Ok(rope)
    }
}
