//! Which layers hold what: the geometry of each layer, the sliding window and the layers that
//! use it, and how a hybrid model splits its layers between its attention cache and its
//! recurrent memory.

use crate::error::{KvError, Result};
use crate::model::arch::{self, HybridSplit};
use crate::model::gguf::GgufValue;
use crate::model::hparams::{mul, HeadDims, Hparams, Keys};

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

/// The sliding window of a model, and which layers use it.
pub(super) struct Windows {
    /// The window, when the model has one.
    pub(super) swa: Option<SwaInfo>,
    /// One flag per layer, where the model lists its sliding-window layers one by one.
    explicit: Option<Vec<bool>>,
}

impl Windows {
    /// The sliding window, per architecture as `load_hparams` sets it.
    pub(super) fn read(k: &Keys, hp: &Hparams) -> Result<Windows> {
        let window = k.u32_opt("attention.sliding_window")?;
        let swa = match k.arch {
            "gemma2" => Some((window.unwrap_or(4096), 2, false)),
            "gemma3" => Some((
                window.ok_or_else(|| k.missing("attention.sliding_window"))?,
                6,
                false,
            )),
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
                .or(phi3_default_window(
                    hp.n_layer,
                    hp.n_ctx_train,
                    &hp.n_head_kv,
                ))
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
                            k.flags_per_layer("attention.sliding_window_pattern", hp.n_layer)?;
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
        if k.arch == "lfm2" && swa.as_ref().is_some_and(|s| s.window > 0) {
            explicit = Some(hp.n_head_kv.iter().map(|&h| h > 0).collect());
        }
        Ok(Windows { swa, explicit })
    }

    /// Whether layer `il` uses the window (`is_swa(il)`).
    fn is_swa(&self, il: u32) -> bool {
        match (&self.swa, &self.explicit) {
            (Some(s), _) if s.window == 0 => false,
            (Some(_), Some(flags)) => flags[il as usize],
            // set_swa_pattern: every `pattern`-th layer is dense (a pattern of 0: all are SWA)
            (Some(s), None) => s.pattern == 0 || il % s.pattern < s.pattern - 1,
            (None, _) => false,
        }
    }
}

/// The geometry of every layer: its heads, K/V widths, window and memory; `n_layer_nextn`
/// multi-token-prediction layers at the end.
pub(super) fn layer_geometry(
    k: &Keys,
    hp: &Hparams,
    heads: &HeadDims,
    windows: &Windows,
    n_layer_nextn: u32,
) -> Result<Vec<LayerGeometry>> {
    let memory_of_layer = layer_memories(k, hp.n_layer, n_layer_nextn, &hp.n_head_kv)?;
    (0..hp.n_layer)
        .map(|il| {
            let hk = hp.n_head_kv[il as usize];
            Ok(LayerGeometry {
                n_head: hp.n_head[il as usize],
                n_head_kv: hk,
                n_embd_k_gqa: mul(heads.n_embd_head_k, hk, "layer K width")?,
                n_embd_v_gqa: mul(heads.n_embd_head_v, hk, "layer V width")?,
                swa: windows.is_swa(il),
                memory: memory_of_layer[il as usize],
            })
        })
        .collect()
}

/// Which parts of the memory hold each layer, as 0.1.161 sets `is_recr` and filters the
/// layers of a hybrid memory (`llama_model::create_memory`).
fn layer_memories(
    k: &Keys,
    n_layer: u32,
    n_layer_nextn: u32,
    n_head_kv: &[u32],
) -> Result<Vec<LayerMemory>> {
    let (arch, n) = (k.arch, n_layer as usize);
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

/// Phi-3's window when the file names none (load_hparams' backward-compatibility defaults).
fn phi3_default_window(n_layer: u32, n_ctx_train: u32, n_head_kv: &[u32]) -> Option<u32> {
    match (n_layer, n_ctx_train) {
        (32 | 40, 4096) => Some(2047),
        (32, 131072) if n_head_kv[0] == 32 => Some(262144),
        (40, 131072) => Some(131072),
        _ => None,
    }
}
