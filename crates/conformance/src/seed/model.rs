//! The seed's models: what the differential needs to know of each (layers, widths, tensors),
//! and where it is. The files come from `interop/make_models.py` with every other model
//! (`crate::models`); `tests/harness.rs` checks that the files agree with these shapes.

use std::path::PathBuf;

/// Tokens in the vocabulary every tiny model shares (3 special, 256 bytes, 61 pieces).
pub const N_VOCAB: usize = 320;
const MAMBA_D_INNER: u32 = 128;
const MAMBA_D_STATE: u32 = 16;
const MAMBA_D_CONV: u32 = 4;

/// A model the seed's differential runs load.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ModelKind {
    /// llama, 2 layers, n_embd 64, 4 heads, 2 KV heads (head_dim 16, K/V width 32).
    LlamaH16,
    /// llama, 2 layers, n_embd 128, 4 heads, 2 KV heads (head_dim 32, K/V width 64): quantized K/V.
    LlamaH32,
    /// llama, 64 layers, n_embd 64, head_dim 16: the defrag move cap is 170 runs.
    LlamaL64,
    /// mamba, 2 layers, n_embd 64, d_inner 128, d_state 16, d_conv 4 (recurrent).
    Mamba,
}

impl ModelKind {
    /// File name under the models folder.
    pub fn file_name(self) -> &'static str {
        match self {
            ModelKind::LlamaH16 => "llama-h16.gguf",
            ModelKind::LlamaH32 => "llama-h32.gguf",
            ModelKind::LlamaL64 => "llama-l64.gguf",
            ModelKind::Mamba => "mamba.gguf",
        }
    }

    /// Every model, in the order traces name them.
    pub const ALL: [ModelKind; 4] = [
        ModelKind::LlamaH16,
        ModelKind::LlamaH32,
        ModelKind::LlamaL64,
        ModelKind::Mamba,
    ];

    /// The model file (`interop/models/`), or why it is missing.
    pub fn path(self) -> Result<PathBuf, String> {
        crate::models::model_path(self.file_name())
    }

    /// Whether the model is recurrent.
    pub fn recurrent(self) -> bool {
        self == ModelKind::Mamba
    }

    /// Number of layers.
    pub fn n_layer(self) -> u32 {
        match self {
            ModelKind::LlamaL64 => 64,
            _ => 2,
        }
    }

    /// (n_embd, n_head, n_head_kv, n_ff) of the llama models.
    fn llama_shape(self) -> (usize, usize, usize, usize) {
        match self {
            ModelKind::LlamaH16 => (64, 4, 2, 128),
            ModelKind::LlamaH32 => (128, 4, 2, 128),
            ModelKind::LlamaL64 => (64, 4, 2, 32),
            ModelKind::Mamba => (64, 0, 0, 0),
        }
    }

    /// Head dimension (RoPE n_rot) of the llama models.
    pub fn head_dim(self) -> usize {
        let (e, h, _, _) = self.llama_shape();
        e.checked_div(h).unwrap_or(0)
    }

    /// K heads per cell row of the llama models.
    pub fn n_head_kv(self) -> usize {
        self.llama_shape().2
    }

    /// K and V width per layer (n_embd_k_gqa + n_embd_k_s, n_embd_v_gqa + n_embd_v_s).
    pub fn kv_widths(self) -> (u32, u32) {
        match self {
            // (d_conv - 1) * d_inner, d_state * d_inner
            ModelKind::Mamba => (
                (MAMBA_D_CONV - 1) * MAMBA_D_INNER,
                MAMBA_D_STATE * MAMBA_D_INNER,
            ),
            _ => {
                let w = (self.head_dim() * self.n_head_kv()) as u32;
                (w, w)
            }
        }
    }

    /// Tensors in the model file (for `graph_max_nodes = max(65536, 5 * n_tensors)`).
    pub fn n_tensors(self) -> u32 {
        match self {
            ModelKind::Mamba => 3 + 10 * self.n_layer(),
            _ => 3 + 9 * self.n_layer(),
        }
    }
}
