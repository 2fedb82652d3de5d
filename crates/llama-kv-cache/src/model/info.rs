//! What a GGUF model's header says about its KV cache, computed the way llama.cpp 0.1.103's
//! `llama_model::load_hparams` does: layer count, per-layer K/V heads and widths (`hparams`,
//! `layers`), RoPE (type by architecture as in `llama_model_rope_type`, dims, base, scale, YaRN:
//! `rope`), the sliding window and its layer pattern (`layers`), recurrent state widths (Mamba
//! `ssm_*`, RWKV `wkv`: `recurrent`), the trained context. This file puts them together.
//!
//! From that it builds a cache ([`ModelInfo::cache_params`], in `cache_params`) and the K-shift
//! parameters ([`ModelInfo::shift_params`], in `shift`). A sliding-window or hybrid model has no
//! one unified cache: `cache_params` refuses it, naming the memory it gets instead (iSWA or
//! hybrid, which `memory::plan` builds), and `check_live` refuses, naming why, only the memories
//! this library does not hold live (those with an indexer cache).

use std::path::Path;

use crate::cell_ext::CellExt;
use crate::error::{KvError, Result};
use crate::model::arch::{self, MemoryKind};
use crate::model::gguf::{self, GgufHeader, GgufValue};
use crate::model::hparams::{HeadDims, Hparams, Keys};
use crate::model::layers::{layer_geometry, LayerGeometry, SwaInfo, Windows};
use crate::model::recurrent::{recurrent_info, RecurrentInfo};
use crate::model::rope::{RopeInfo, RopeScaling};

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
        let k = Keys::of(h)?;
        let hp = Hparams::read(&k)?;
        let scaling = RopeScaling::read(&k, hp.n_ctx_train)?;
        let heads = HeadDims::read(&k, &hp)?;
        let rope = scaling.into_rope(&k, heads.n_rot)?;
        let windows = Windows::read(&k, &hp)?;
        let mla = multi_head_latent(&k)?;
        let latent_kv = compressed_kv(&k)?;
        let n_layer_nextn = nextn_layers(&k, hp.n_layer)?;
        let layers = layer_geometry(&k, &hp, &heads, &windows, n_layer_nextn)?;
        let recurrent = recurrent_info(&k, &hp, &heads)?;
        if k.arch == "deepseek2" && k.raw("rope.scaling.yarn_log_multiplier").is_none() {
            return Err(k.missing("rope.scaling.yarn_log_multiplier"));
        }

        let memory = match arch::memory_of(k.arch) {
            MemoryKind::Unified if layers.iter().any(|l| l.swa) => MemoryKind::Iswa,
            kind => kind,
        };
        let name = h
            .get("general.name")
            .and_then(|v| v.as_str())
            .map(String::from);
        let cell_ext = cell_ext(&k, &rope);
        Ok(ModelInfo {
            arch: k.arch.to_string(),
            name,
            n_layer: hp.n_layer,
            n_layer_nextn,
            mla,
            latent_kv,
            n_ctx_train: hp.n_ctx_train,
            n_embd: hp.n_embd,
            n_embd_head_k: heads.n_embd_head_k,
            n_embd_head_v: heads.n_embd_head_v,
            layers,
            rope,
            swa: windows.swa,
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
}

/// Multi-head latent attention (0.1.161's `is_mla()`: both MLA head sizes set): the cache keeps
/// the latent and its rotated part as K, and no V.
fn multi_head_latent(k: &Keys) -> Result<bool> {
    Ok(arch::reads_mla_keys(k.arch)
        && k.u32_opt("attention.key_length_mla")?.unwrap_or(0) != 0
        && k.u32_opt("attention.value_length_mla")?.unwrap_or(0) != 0)
}

/// A compressed KV (`kv_lora_rank`) keeps the rotated dimensions at the end of each K head: the
/// K-shift skips the `n_embd_nope` before them (0.1.161's `n_lora_kv > 0`).
fn compressed_kv(k: &Keys) -> Result<bool> {
    Ok(arch::reads_kv_lora_rank(k.arch) && k.u32_opt("attention.kv_lora_rank")?.unwrap_or(0) != 0)
}

/// The multi-token-prediction layers at the end of the `n_layer` (`nextn_predict_layers`).
fn nextn_layers(k: &Keys, n_layer: u32) -> Result<u32> {
    let n_layer_nextn = k.u32_opt("nextn_predict_layers")?.unwrap_or(0);
    if n_layer_nextn > n_layer {
        return Err(KvError::InvalidModel(format!(
            "{} = {n_layer_nextn} exceeds the {n_layer} layers",
            k.key("nextn_predict_layers")
        )));
    }
    Ok(n_layer_nextn)
}

/// What each cell keeps beside its position (`has_cell_ext()`): the M-RoPE models' and the PLE
/// models' second position.
fn cell_ext(k: &Keys, rope: &RopeInfo) -> CellExt {
    // PLE: qwen4exp with its n-gram hash layers listed (0.1.161 reads the group only then)
    let ple = k.arch == "qwen4exp"
        && matches!(k.raw("ple.layers"), Some((_, GgufValue::Array { len, .. })) if *len > 0);
    if rope.is_mrope() || ple {
        CellExt::Pos2Tok
    } else {
        CellExt::None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ggml_type::GgmlType;
    use crate::model::gguf::{GgufBuilder, GgufType};
    use crate::model::{LayerMemory, RopeKind};

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

    /// Regression (found against llama.cpp 0.1.161's own shift of an f32 K, crates/conformance):
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
