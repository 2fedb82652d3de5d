//! The one list of architectures whose memory is not a plain attention cache: what the model
//! reader, the state files and the fit of a state to a model agree on. An architecture not
//! listed keeps its K/V in attention caches: one unified cache, or an iSWA pair when some of
//! its layers use a sliding window (which only the model's hyperparameters tell).

/// Architectures whose whole memory is a recurrent state (`llama_model_is_recurrent`).
const RECURRENT: &[&str] = &["mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"];
/// Architectures that mix attention layers with recurrent ones (`llm_arch_is_hybrid` of
/// 0.1.161, less the indexer memories, which [`indexer_memory`] names first).
const HYBRID: &[&str] = &[
    "jamba",
    "falcon-h1",
    "plamo2",
    "granitehybrid",
    "lfm2",
    "lfm2moe",
    "nemotron_h",
    "nemotron_h_moe",
    "qwen3next",
    "kimi-linear",
    "bailingmoe3",
    "kimi-k3",
    "qwen35",
    "qwen35moe",
    "minimax-01",
];

/// How a hybrid architecture tells its recurrent layers (0.1.161's `is_recr`) and which
/// layers each part of its memory takes (the layer filters of `llama_model::create_memory`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HybridSplit {
    /// Recurrent: the layers without KV heads; the attention cache takes the others.
    ByKvHeads,
    /// The layers `attention.recurrent_layers` flags, else all but every
    /// `full_attention_interval`-th (default given); multi-token-prediction layers are in
    /// neither part.
    Interval(u32),
    /// Nemotron-H: recurrent layers have neither KV heads nor a feed-forward block, attention
    /// layers have KV heads, and MLP-only layers are in neither part.
    MlpOnlyApart,
    /// Falcon-H1: every layer is in both parts (attention and SSM side by side).
    Everywhere,
}

/// The layer split of a hybrid (or hybrid indexer) architecture; `None` for the others.
pub fn hybrid_split(arch: &str) -> Option<HybridSplit> {
    match arch {
        "qwen3next" | "qwen35" | "qwen35moe" | "qwen4exp" => Some(HybridSplit::Interval(4)),
        "minimax-01" => Some(HybridSplit::Interval(8)),
        "nemotron_h" | "nemotron_h_moe" => Some(HybridSplit::MlpOnlyApart),
        "falcon-h1" => Some(HybridSplit::Everywhere),
        "glm5-next" => Some(HybridSplit::ByKvHeads),
        a if HYBRID.contains(&a) => Some(HybridSplit::ByKvHeads),
        _ => None,
    }
}

/// Whether the architecture reads `attention.key_length_mla` / `value_length_mla` (0.1.161):
/// with both set, its attention is multi-head latent attention and its cache keeps no V.
pub fn reads_mla_keys(arch: &str) -> bool {
    matches!(
        arch,
        "deepseek2"
            | "deepseek32"
            | "glm-dsa"
            | "kimi-linear"
            | "bailingmoe3"
            | "kimi-k3"
            | "dots3note"
            | "glm5-next"
            | "hy_v4"
    )
}

/// Whether the architecture reads `attention.kv_lora_rank` (0.1.161's `n_lora_kv`): with it
/// set, each K head ends with its rotated dimensions.
pub fn reads_kv_lora_rank(arch: &str) -> bool {
    reads_mla_keys(arch) || matches!(arch, "minicpm3" | "plm")
}

/// The memory 0.1.161 gives an architecture that keeps an indexer cache beside K and V
/// (sparse-attention models): `msa`, `dsa`, `dsa-iswa`, `dsv4` or `hybrid-idx`.
pub fn indexer_memory(arch: &str) -> Option<MemoryKind> {
    match arch {
        "minimax-m3" => Some(MemoryKind::Msa),
        "glm-dsa" | "deepseek32" | "hy_v4" => Some(MemoryKind::Dsa),
        "dots3note" => Some(MemoryKind::DsaIswa),
        "deepseek4" => Some(MemoryKind::Dsv4),
        "glm5-next" | "qwen4exp" => Some(MemoryKind::HybridIdx),
        _ => None,
    }
}

/// Which memory llama.cpp gives the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryKind {
    /// One unified KV cache (what this library models).
    Unified,
    /// A full cache plus a sliding-window cache (llama.cpp since mid-2025).
    Iswa,
    /// One recurrent state per sequence (Mamba, RWKV).
    Recurrent,
    /// Attention layers in a KV cache plus recurrent layers.
    Hybrid,
    /// DeepSeek's sparse attention (`llama_kv_cache_dsa`): the latent KV cache, then the
    /// lightning indexer's key cache (both without V).
    Dsa,
    /// `dsa` plus a sliding-window cache (`llama_kv_cache_dsa_iswa`): latent, indexer, window.
    DsaIswa,
    /// MiniMax's sparse attention (`llama_kv_cache_msa`): the KV cache, then the indexer's
    /// (both with V). Its files read as two KV parts, as an iSWA memory's do: only the model
    /// tells them apart.
    Msa,
    /// A hybrid with an indexer cache (`llama_memory_hybrid_idx`): attention, recurrent, then
    /// the indexer's key cache.
    HybridIdx,
    /// DeepSeek V4's compressed caches (`llama_kv_cache_dsv4`), whose files this library does
    /// not read.
    Dsv4,
}

impl MemoryKind {
    /// `"unified"`, `"iswa"`, `"recurrent"`, `"hybrid"`, or an indexer memory's name as
    /// llama.cpp calls it (`"dsa"`, `"dsa-iswa"`, `"msa"`, `"hybrid-idx"`, `"dsv4"`).
    pub fn name(self) -> &'static str {
        match self {
            MemoryKind::Unified => "unified",
            MemoryKind::Iswa => "iswa",
            MemoryKind::Recurrent => "recurrent",
            MemoryKind::Hybrid => "hybrid",
            MemoryKind::Dsa => "dsa",
            MemoryKind::DsaIswa => "dsa-iswa",
            MemoryKind::Msa => "msa",
            MemoryKind::HybridIdx => "hybrid-idx",
            MemoryKind::Dsv4 => "dsv4",
        }
    }

    /// Whether it keeps an indexer cache beside K and V (a sparse-attention memory).
    pub fn has_indexer(self) -> bool {
        matches!(
            self,
            MemoryKind::Dsa
                | MemoryKind::DsaIswa
                | MemoryKind::Msa
                | MemoryKind::HybridIdx
                | MemoryKind::Dsv4
        )
    }
}

/// Whether the architecture's whole memory is a recurrent state (one cell per sequence, no
/// stream prefix in its state).
pub fn is_recurrent(arch: &str) -> bool {
    RECURRENT.contains(&arch)
}

/// Whether the architecture's recurrent state is RWKV's (token shift and WKV state) rather than
/// a state-space model's (convolution and SSM state).
pub fn is_rwkv(arch: &str) -> bool {
    matches!(arch, "rwkv6" | "rwkv6qwen2" | "rwkv7" | "arwkv7")
}

/// Whether the architecture mixes attention layers with recurrent ones.
pub fn is_hybrid(arch: &str) -> bool {
    HYBRID.contains(&arch)
}

/// The memory of an architecture as far as its name tells: recurrent, hybrid, or unified
/// (attention; a model with sliding-window layers gets [`MemoryKind::Iswa`] from its
/// hyperparameters instead).
pub fn memory_of(arch: &str) -> MemoryKind {
    if let Some(kind) = indexer_memory(arch) {
        kind
    } else if is_hybrid(arch) {
        MemoryKind::Hybrid
    } else if is_recurrent(arch) {
        MemoryKind::Recurrent
    } else {
        MemoryKind::Unified
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regression_jamba_is_hybrid_for_every_reader() {
        assert_eq!(memory_of("jamba"), MemoryKind::Hybrid);
        assert!(!is_recurrent("jamba"));
        assert_eq!(memory_of("mamba"), MemoryKind::Recurrent);
        assert_eq!(memory_of("llama"), MemoryKind::Unified);
    }
}
