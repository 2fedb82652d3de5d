//! The caches of a model: the parameters of its cache as llama.cpp 0.1.161 builds it, the
//! memories and K/V types a context refuses for it, the Hadamard rotation of quantized K and V,
//! and the bytes K and V take.

use crate::error::{KvError, Result};
use crate::ggml_type::GgmlType;
use crate::model::arch::MemoryKind;
use crate::model::info::ModelInfo;
use crate::params::CacheParams;

impl ModelInfo {
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

    /// Bytes of K and V for `cells` cells with the given types, over every layer, as this
    /// model's caches keep them (no V for multi-head latent attention, the state widths for a
    /// recurrent model): `None` when a width is not a whole number of the type's blocks.
    pub fn kv_bytes(&self, cells: u64, type_k: GgmlType, type_v: GgmlType) -> Option<u64> {
        let one_cell = self.params_of_layers(1, 1, type_k, type_v, true);
        one_cell.tensor_bytes().ok()?.checked_mul(cells)
    }
}
