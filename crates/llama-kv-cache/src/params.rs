//! Construction parameters of a cache, with llama.cpp's defaults and its validity rules.

use crate::cell_ext::CellExt;
use crate::error::{KvError, Result};
use crate::ggml_type::GgmlType;

/// The most sequences a cache can track (seq ids `0..MAX_SEQ`).
pub const MAX_SEQ: usize = 256;

/// Hyper-parameters and context parameters that shape a cache (the seed's `hparams` + `cparams`).
#[derive(Clone, Debug, PartialEq)]
pub struct CacheParams {
    /// Number of cells (`kv_size`, the context length).
    pub size: u32,
    /// Number of layers.
    pub n_layer: u32,
    /// K width per layer (`n_embd_k_gqa`): one value for every layer, or one per layer.
    pub n_embd_k_gqa: Vec<u32>,
    /// V width per layer (`n_embd_v_gqa`): one value for every layer, or one per layer.
    pub n_embd_v_gqa: Vec<u32>,
    /// Extra K width of recurrent models (`n_embd_k_s`), added to every layer.
    pub n_embd_k_s: u32,
    /// Extra V width of recurrent models (`n_embd_v_s`), added to every layer.
    pub n_embd_v_s: u32,
    /// Type of K.
    pub type_k: GgmlType,
    /// Type of V.
    pub type_v: GgmlType,
    /// Flash attention: V is stored untransposed and padding is 256.
    pub flash_attn: bool,
    /// Recurrent model (Mamba, RWKV): one cell per sequence state.
    pub recurrent: bool,
    /// Whether K-shift is possible (false for MLA models); always false when recurrent.
    pub can_shift: bool,
    /// Largest number of sequences (seq ids `0..n_seq_max`).
    pub n_seq_max: u32,
    /// Size of the Hadamard blocks K is stored rotated by (llama.cpp 0.1.161's `n_rot_k`: 64 or
    /// more, a power of two, for quantized K with a head dimension that is a multiple of 64);
    /// 0 = K is not rotated. Recorded in the streams-rot layout, and undone and redone around
    /// a K-shift and a re-typing.
    pub n_rot_k: u32,
    /// Size of the Hadamard blocks V is stored rotated by (`n_rot_v`, 64 for quantized V with
    /// a head dimension that is a multiple of 64); 0 = V is not rotated.
    pub n_rot_v: u32,
    /// What each cell keeps beside its position and sequences, and its state payloads carry
    /// after each cell's `n_seq_id` (llama.cpp 0.1.161's `has_cell_ext()`: M-RoPE and PLE
    /// models). Placement records it; `seqCp`, defrag and state I/O keep it.
    pub cell_ext: CellExt,
    /// The model's RoPE is M-RoPE (llama.cpp's `n_pos_per_embd() > 1`): a placed text token's
    /// extension gets its position as `x` and `y`, and positions cannot be shifted or divided
    /// (0.1.161 asserts on `seq_add` and `seq_div` of such a cache).
    pub mrope: bool,
    /// The cache keeps no V (llama.cpp's multi-head latent attention since mid-2025:
    /// DeepSeek-V2/V3, Kimi K2, GLM-4.7-Flash keep only the latent K): every V width is 0 and
    /// its state payloads have no V block at all.
    pub no_v: bool,
    /// Whose rules a recurrent cache's `seq_rm` and `seq_pos_max` follow (ignored by a
    /// transformer cache).
    pub recurrent_rules: RecurrentRules,
}

/// Whose sequence rules a recurrent cache follows. The cells, placement and state format are
/// the same; llama.cpp 0.1.161's `llama_memory_recurrent` changed which removals it accepts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RecurrentRules {
    /// The seed's (b4944): a removal touching the state's position partly is refused, and -1
    /// removes every sequence.
    #[default]
    Seed,
    /// 0.1.161's: only a removal from inside the state to past its end is refused, a range the
    /// state's position is not in removes nothing and succeeds, a sequence id outside
    /// `[0, n_seq_max)` (-1 included) is refused, and `seq_pos_max` of an empty sequence is -1.
    V0_1_161,
}

impl CacheParams {
    /// A transformer cache with f16 K/V, no flash attention, one sequence.
    pub fn new(size: u32, n_layer: u32, n_embd_k_gqa: u32, n_embd_v_gqa: u32) -> CacheParams {
        CacheParams {
            size,
            n_layer,
            n_embd_k_gqa: vec![n_embd_k_gqa],
            n_embd_v_gqa: vec![n_embd_v_gqa],
            n_embd_k_s: 0,
            n_embd_v_s: 0,
            type_k: GgmlType::F16,
            type_v: GgmlType::F16,
            flash_attn: false,
            recurrent: false,
            can_shift: true,
            n_seq_max: 1,
            n_rot_k: 0,
            n_rot_v: 0,
            cell_ext: CellExt::None,
            mrope: false,
            no_v: false,
            recurrent_rules: RecurrentRules::Seed,
        }
    }

    /// V is transposed when flash attention is off and the model is not recurrent.
    pub fn v_trans(&self) -> bool {
        !self.recurrent && !self.flash_attn
    }

    /// The seed's `get_padding`: 256 with flash attention, else 32.
    pub fn padding(&self) -> u32 {
        if self.flash_attn {
            256
        } else {
            32
        }
    }

    /// K width of layer `il` including the recurrent extra.
    pub fn n_embd_k(&self, il: usize) -> usize {
        per_layer(&self.n_embd_k_gqa, il) as usize + self.n_embd_k_s as usize
    }

    /// V width of layer `il` including the recurrent extra.
    pub fn n_embd_v(&self, il: usize) -> usize {
        if self.no_v {
            return 0;
        }
        per_layer(&self.n_embd_v_gqa, il) as usize + self.n_embd_v_s as usize
    }

    /// Bytes of the K and V tensors of one stream of these parameters, as a cache allocates
    /// them (a cache without V keeps none).
    pub fn tensor_bytes(&self) -> Result<u64> {
        let too_big =
            || KvError::OutOfRange(format!("{} cells: the tensors' size overflows", self.size));
        let mut row = 0u64;
        for il in 0..self.n_layer as usize {
            let k = self.type_k.row_size(self.n_embd_k(il))? as u64;
            let v = self.type_v.row_size(self.n_embd_v(il))? as u64;
            row = row.checked_add(k + v).ok_or_else(too_big)?;
        }
        row.checked_mul(u64::from(self.size)).ok_or_else(too_big)
    }

    /// Checks every rule; the error names the offending value.
    pub fn validate(&self) -> Result<()> {
        if self.n_layer == 0 {
            return Err(KvError::InvalidArg(
                "nLayer must be at least 1, got 0".into(),
            ));
        }
        self.validate_part()
    }

    /// [`CacheParams::validate`] of a part of a memory, which may hold no layer (the base
    /// cache of a hybrid-iSWA memory whose attention layers all use the window).
    pub(crate) fn validate_part(&self) -> Result<()> {
        let bad = |m: String| Err(KvError::InvalidArg(m));
        if self.size == 0 {
            return bad("size must be at least 1 cell, got 0".into());
        }
        if self.n_seq_max == 0 || self.n_seq_max as usize > MAX_SEQ {
            return Err(KvError::OutOfRange(format!(
                "nSeqMax must be in [1, {MAX_SEQ}], got {}",
                self.n_seq_max
            )));
        }
        if self.recurrent && !self.cell_ext.is_none() {
            return bad(format!(
                "a recurrent cache keeps no cell extensions, got cellExt '{}'",
                self.cell_ext.name()
            ));
        }
        if self.recurrent && self.n_seq_max > self.size {
            return bad(format!(
                "a recurrent cache needs a cell per sequence: nSeqMax {} > size {}",
                self.n_seq_max, self.size
            ));
        }
        for (name, widths) in [
            ("nEmbdKGqa", &self.n_embd_k_gqa),
            ("nEmbdVGqa", &self.n_embd_v_gqa),
        ] {
            if widths.len() != 1 && widths.len() != self.n_layer as usize {
                return bad(format!(
                    "{name} must hold 1 or nLayer ({}) widths, got {}",
                    self.n_layer,
                    widths.len()
                ));
            }
        }
        if self.no_v && (self.recurrent || self.n_rot_v != 0) {
            return bad(format!(
                "a cache without V (noV) is an attention cache with V unrotated, got recurrent {} \
                 and nRotV {}",
                self.recurrent, self.n_rot_v
            ));
        }
        if self.type_v.is_quantized() && self.v_trans() && !self.no_v {
            return bad(format!(
                "quantized V ({}) needs flash attention (V is transposed without it)",
                self.type_v
            ));
        }
        for (name, n_rot) in [("nRotK", self.n_rot_k), ("nRotV", self.n_rot_v)] {
            if n_rot != 0 && !n_rot.is_power_of_two() {
                return bad(format!("{name} must be 0 or a power of two, got {n_rot}"));
            }
        }
        for il in 0..self.n_layer as usize {
            for (name, n_rot, width) in [
                ("nRotK", self.n_rot_k, self.n_embd_k(il)),
                ("nRotV", self.n_rot_v, self.n_embd_v(il)),
            ] {
                if n_rot != 0 && width % n_rot as usize != 0 {
                    return bad(format!(
                        "layer {il}: {name} {n_rot} does not divide the width {width}"
                    ));
                }
            }
            for (name, width, ty) in [
                ("K", self.n_embd_k(il), self.type_k),
                ("V", self.n_embd_v(il), self.type_v),
            ] {
                // a recurrent state may have no S rows (LFM2's short convolutions keep R
                // only), and a cache without V no V rows
                if width == 0 && !((self.recurrent || self.no_v) && name == "V") {
                    return bad(format!("layer {il}: {name} width is 0"));
                }
                if width % ty.block_size() != 0 {
                    return bad(format!(
                        "layer {il}: {name} width {width} is not a multiple of {ty}'s block size {}",
                        ty.block_size()
                    ));
                }
            }
        }
        Ok(())
    }
}

fn per_layer(widths: &[u32], il: usize) -> u32 {
    if widths.len() == 1 {
        widths[0]
    } else {
        widths[il]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_quantized_v_without_flash_attention() {
        let mut p = CacheParams::new(64, 2, 64, 64);
        p.type_v = GgmlType::Q8_0;
        assert!(p.validate().unwrap_err().to_string().contains("q8_0"));
        p.flash_attn = true;
        assert!(p.validate().is_ok());
    }

    #[test]
    fn rejects_width_not_multiple_of_block() {
        let mut p = CacheParams::new(64, 2, 48, 64);
        p.type_k = GgmlType::Q4_0;
        p.flash_attn = true;
        assert!(p.validate().unwrap_err().to_string().contains("48"));
    }

    #[test]
    fn rejects_zero_size_and_bad_seq_limit() {
        assert!(CacheParams::new(0, 1, 8, 8).validate().is_err());
        let mut p = CacheParams::new(8, 1, 8, 8);
        p.n_seq_max = 257;
        assert!(p.validate().is_err());
        p.n_seq_max = 256;
        assert!(p.validate().is_ok());
        p.n_seq_max = 257;
        assert!(p.validate().is_err());
        p.n_seq_max = 0;
        assert!(p.validate().is_err());
    }

    #[test]
    fn per_layer_widths_must_match_layer_count() {
        let mut p = CacheParams::new(8, 3, 8, 8);
        p.n_embd_k_gqa = vec![8, 16];
        assert!(p.validate().is_err());
        p.n_embd_k_gqa = vec![8, 16, 8];
        assert!(p.validate().is_ok());
        assert_eq!(p.n_embd_k(1), 16);
    }
}
