//! The K-shift of a model: the RoPE parameters llama.cpp's `build_kv_self_shift` rotates each
//! layer's K with, and the tensor of frequency factors it uses.

use crate::model::arch::MemoryKind;
use crate::model::info::ModelInfo;
use crate::model::rope::RopeKind;
use crate::tensors::rope::{RopeParams, RopeType, ShiftParams};

impl ModelInfo {
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
}
