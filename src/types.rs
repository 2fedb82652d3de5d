//! The JS-facing option and result objects (`#[napi(object)]`), documented for index.d.ts:
//! plain data only. Option objects that carry a callback (an `AbortSignal`, a progress
//! function) live with the methods that take them, result objects built by a callback module
//! (a defrag's moves) with that module.

use napi::bindgen_prelude::*;
use napi_derive::napi;

use crate::args::I32Copy;

/// Options of `new KvCache(options)`. Defaults follow llama.cpp's.
#[napi(object)]
pub struct KvCacheOptions {
    /// Number of cells (the context length, `n_ctx`).
    pub size: f64,
    /// Number of layers.
    pub n_layer: f64,
    /// K width (`n_embd_k_gqa` = head_dim * n_head_kv): one number for all layers, or one per layer.
    pub n_embd_k_gqa: Either<f64, Vec<f64>>,
    /// V width (`n_embd_v_gqa`). Default: `nEmbdKGqa`.
    pub n_embd_v_gqa: Option<Either<f64, Vec<f64>>>,
    /// Extra K width of recurrent models (`n_embd_k_s`, Mamba's conv state). Default 0.
    #[napi(js_name = "nEmbdKS")]
    pub n_embd_k_s: Option<f64>,
    /// Extra V width of recurrent models (`n_embd_v_s`, Mamba's ssm state). Default 0.
    #[napi(js_name = "nEmbdVS")]
    pub n_embd_v_s: Option<f64>,
    /// K type: 'f32' | 'f16' | 'bf16' | 'q8_0' | 'q4_0' | 'q4_1' | 'q5_0' | 'q5_1' | 'iq4_nl'. Default 'f16'.
    pub type_k: Option<String>,
    /// V type (quantized V needs `flashAttn`). Default 'f16'.
    pub type_v: Option<String>,
    /// Flash attention: V stored untransposed, padding 256. Default false.
    pub flash_attn: Option<bool>,
    /// Recurrent model (Mamba, RWKV): one state cell per sequence. Default false.
    pub recurrent: Option<bool>,
    /// Whether K-shift is allowed (false for MLA models). Default true.
    pub can_shift: Option<bool>,
    /// Number of sequences (seq ids 0..nSeqMax-1), at most 256 (llama.cpp's `LLAMA_MAX_SEQ`). Default 1.
    pub n_seq_max: Option<f64>,
    /// What each cell keeps beside its position, as llama.cpp 0.1.161 saves it after each
    /// cell's seq id count: 'none', 'pos2' (x, y) or 'pos2-tok' (x, y, token: M-RoPE models
    /// such as Qwen2-VL / Qwen2.5-VL / Qwen3-VL, and PLE models). Default 'none'.
    pub cell_ext: Option<String>,
    /// The model's RoPE is M-RoPE: placed text tokens get `x = y = pos`, and seqAdd / seqDiv
    /// throw ERR_KV_UNSUPPORTED (llama.cpp cannot shift such a cache either). Default false.
    pub mrope: Option<bool>,
    /// The cache keeps no V: llama.cpp's multi-head latent attention since mid-2025
    /// (DeepSeek-V2/V3, Kimi K2, GLM-4.7-Flash) keeps the latent K only, and its state files
    /// have no V blocks. V widths are then 0. Default false.
    pub no_v: Option<bool>,
    /// Hadamard rotation of K, as llama.cpp 0.1.161 stores quantized K (its `n_rot_k`: 0, or
    /// a power of two dividing the K width; llama.cpp uses the largest power of two >= 64 that
    /// divides the head dimension). Recorded in session v11 / sequence v4 files and checked
    /// on load; a K-shift and a re-typing undo and redo it. Default 0 (not rotated).
    pub n_rot_k: Option<f64>,
    /// Hadamard rotation of V (llama.cpp 0.1.161's `n_rot_v`: 64 for quantized V when the
    /// head dimension is a multiple of 64). Default 0.
    pub n_rot_v: Option<f64>,
    /// Where the tensors live: 'cpu' (default), 'cuda' or 'cuda:N' for every layer, or one entry
    /// per layer (llama.cpp's per-layer offload). CUDA needs an NVIDIA driver at run time;
    /// without one, construction fails with ERR_KV_CUDA_UNAVAILABLE.
    #[napi(ts_type = "string | string[]")]
    pub device: Option<Either<String, Vec<String>>>,
    /// How the memory of host tensors goes back to the OS. `true` (the default): clear()
    /// hands it back at once, and the pages of the cells seqRm, seqKeep and defrag free (1 MiB
    /// or more) once they stayed free for `releaseDelayMs`, as allocators purge, so a decode
    /// loop that refills cells soon pays nothing; more than 256 MiB awaiting release goes
    /// back at once. `'now'`: inside the operation that frees them. `false`: never (clear()
    /// zeroes in place), for a cache cleared and refilled in a tight loop.
    #[napi(ts_type = "boolean | 'now'")]
    pub release_memory: Option<Either<bool, String>>,
    /// How long freed cells stay resident before their pages go back, in milliseconds, with
    /// `releaseMemory: true`. Default 1000.
    pub release_delay_ms: Option<f64>,
}

crate::args::option_names!(
    KvCacheOptions:
    "size", "nLayer", "nEmbdKGqa", "nEmbdVGqa", "nEmbdKS", "nEmbdVS", "typeK", "typeV", "flashAttn",
    "recurrent", "canShift", "nSeqMax", "cellExt", "mrope", "noV", "nRotK", "nRotV", "device",
    "releaseMemory", "releaseDelayMs",
);

/// A CUDA device.
#[napi(object)]
pub struct CudaDevice {
    /// Device ordinal (the N of 'cuda:N').
    pub ordinal: u32,
    /// Device name.
    pub name: String,
    /// Total memory in bytes.
    pub total_memory: f64,
}

/// Whether CUDA can be used here.
#[napi(object)]
pub struct CudaStatus {
    /// True when a driver loaded and a device is visible.
    pub available: bool,
    /// Why not, when unavailable.
    pub reason: Option<String>,
}

/// One part of a memory (`KvCache.parts`).
#[napi(object)]
pub struct MemoryPart {
    /// 'whole' (a memory of one part), 'base' / 'swa' (iSWA: the full-attention / the
    /// sliding-window layers) or 'attention' / 'recurrent' (hybrid).
    pub role: String,
    /// The model layers it holds, ascending: the layer indices `readRows` and `writeRows` take.
    pub layers: Vec<u32>,
    /// Cells per stream.
    pub size: u32,
    /// Streams: 1 when unified, else one per sequence.
    pub n_stream: u32,
    /// Cells with a position, over all streams.
    pub used_cells: u32,
    /// Window size in tokens (0: full attention).
    pub n_swa: u32,
    /// The window rule: 'none', 'standard', 'chunked' or 'symmetric'.
    pub swa_type: String,
    /// K type.
    pub type_k: String,
    /// V type; 'none' for a cache that keeps no V (multi-head latent attention).
    pub type_v: String,
    /// Hadamard rotation of quantized K (0: none).
    pub n_rot_k: u32,
    /// Hadamard rotation of quantized V (0: none).
    pub n_rot_v: u32,
    /// Bytes of its K and V tensors, over all streams.
    pub bytes: f64,
}

/// The memory `KvCache.fromModel` builds for a model and options, before it is built
/// (`KvCache.planMemory`).
#[napi(object)]
pub struct MemoryPlan {
    /// The kind the cache will report: 'kv', 'recurrent', 'iswa', 'hybrid' or 'kv-streams'.
    #[napi(ts_type = "'kv' | 'recurrent' | 'iswa' | 'hybrid' | 'kv-streams'")]
    pub kind: String,
    /// Bytes of every K and V tensor of every part: what the cache's `totalBytes` will be.
    pub bytes: f64,
    /// Its parts, as the cache's `parts` will list them (no cell used yet).
    pub parts: Vec<MemoryPart>,
}

/// Tensor bytes on one device.
#[napi(object)]
pub struct DeviceBytes {
    /// 'cpu' or 'cuda:N'.
    pub device: String,
    /// Bytes of K and V there.
    pub bytes: f64,
}

/// A micro-batch to place: positions and, per group, the owning sequences.
#[napi(object, object_to_js = false)]
pub struct UBatchInput {
    /// Position of every token (group after group).
    #[napi(ts_type = "Array<number> | Int32Array")]
    pub pos: Either<Vec<f64>, I32Copy>,
    /// Per group: one seq id, or several when the tokens are shared by sequences.
    pub seq_ids: Vec<Either<f64, Vec<f64>>>,
    /// Tokens per group (1 for llama.cpp's simple split; equal groups for recurrent models). Default 1.
    pub n_seq_tokens: Option<f64>,
    /// Each token's cell extension, three numbers per token: `x, y, tok` (its 2D position and
    /// token id; tok -1 for an embedding), for a cache with `cellExt` 'pos2' or 'pos2-tok'
    /// (M-RoPE and PLE models). Default: an M-RoPE text token's (`x = y = pos`, tok -1).
    #[napi(ts_type = "Array<number> | Int32Array")]
    pub ext: Option<Either<Vec<f64>, I32Copy>>,
}

crate::args::option_names!(UBatchInput: "pos", "seqIds", "nSeqTokens", "ext");

/// Where a ubatch was placed.
#[napi(object)]
pub struct Slot {
    /// First cell: write the ubatch's K/V rows from here.
    pub head: u32,
    /// Tokens (transformer) or sequences (recurrent) placed.
    pub len: u32,
    /// Cells the attention should look at.
    pub n: u32,
}

/// Where the tokens of a ubatch went in one stream of one part of a memory (`place`).
#[napi(object)]
pub struct PlacedCells {
    /// The part: 'base' or 'swa' (iSWA), 'attention' or 'recurrent' (hybrid).
    pub part: String,
    /// The stream (the sequence's own when the memory is not unified, else 0).
    pub stream: u32,
    /// One cell per token, in ubatch order (per stream, that stream's tokens): write each
    /// token's K/V rows there with `writeRows`.
    pub cells: Uint32Array,
    /// The ubatch tokens these cells are for.
    pub tokens: Uint32Array,
}

/// A slot handed back to `SlotRestorer.save` (as `prepareBatch` / `findSlot` return it).
#[napi(object, object_to_js = false)]
pub struct SlotInput {
    /// First cell of the slot.
    pub head: f64,
    /// Tokens (transformer) or sequences (recurrent) placed.
    pub len: f64,
    /// Cells the attention looks at (not used by the restorer).
    pub n: Option<f64>,
}

crate::args::option_names!(SlotInput: "head", "len", "n");

/// Options of `prepareBatch`.
#[napi(object)]
pub struct PrepareBatchOptions {
    /// Move `head` past the slot afterwards, as llama.cpp's decode of the seed's era did. Default true.
    pub advance_head: Option<bool>,
}

crate::args::option_names!(PrepareBatchOptions: "advanceHead");

/// One cell's metadata.
#[napi(object)]
pub struct CellInfo {
    /// Position, -1 when free.
    pub pos: i32,
    /// Position change pending for the K-shift.
    pub delta: i32,
    /// Recurrent: cell this one copies its state from.
    pub src: i32,
    /// Recurrent: for cell i, the cell holding sequence i's state.
    pub tail: i32,
    /// Owning sequences, ascending.
    pub seq_ids: Vec<i32>,
}

/// Every cell's metadata as typed arrays, indexed by cell: one call for a cache of any size.
#[napi(object)]
pub struct CellColumns {
    /// Position, -1 when free.
    pub pos: Int32Array,
    /// Position change pending for the K-shift.
    pub delta: Int32Array,
    /// Recurrent: cell this one copies its state from (-1: none).
    pub src: Int32Array,
    /// Recurrent: for cell i, the cell holding sequence i's state (-1: none).
    pub tail: Int32Array,
    /// `size + 1` offsets into `seqIds`: cell i's sequences are
    /// `seqIds.subarray(seqOffsets[i], seqOffsets[i + 1])`.
    pub seq_offsets: Uint32Array,
    /// Every cell's sequence ids, ascending per cell, concatenated.
    pub seq_ids: Int32Array,
    /// Per cell `x, y, tok` (three numbers) in a cache with a `cellExt`; empty otherwise.
    pub ext: Int32Array,
}

/// A snapshot of every cell (llama.cpp's `llama_kv_cache_view`).
#[napi(object)]
pub struct CacheView {
    /// Per cell: position + pending delta (-1 + delta for free cells, as llama.cpp).
    pub pos: Int32Array,
    /// Per cell: owning sequences, at most `nSeqMax` of them.
    pub seq_ids: Vec<Vec<i32>>,
    /// Cells owned by a sequence.
    pub used_cells: u32,
    /// Sum over cells of the number of owning sequences.
    pub token_count: f64,
    /// Length of the largest run of free cells.
    pub max_contiguous: u32,
    /// Start of that run, -1 when there is none.
    pub max_contiguous_idx: i32,
}

/// RoPE parameters of the model, for the K-shift.
#[napi(object)]
pub struct RopeOptions {
    /// Dimension of one head.
    pub head_dim: f64,
    /// Number of KV heads (head_dim * nHead = the layer's K width).
    pub n_head: f64,
    /// Rotated dimensions (`n_rot`). Default: headDim.
    pub n_rot: Option<f64>,
    /// 'norm' (llama) or 'neox'. Default 'norm'.
    #[napi(js_name = "type")]
    pub rope_type: Option<String>,
    /// Base frequency. Default 10000.
    pub freq_base: Option<f64>,
    /// Frequency scale (1 / linear scaling factor). Default 1.
    pub freq_scale: Option<f64>,
    /// YaRN extrapolation mix factor. Default 0 (no YaRN).
    pub ext_factor: Option<f64>,
    /// YaRN magnitude factor. Default 1.
    pub attn_factor: Option<f64>,
    /// YaRN low correction dim. Default 32.
    pub beta_fast: Option<f64>,
    /// YaRN high correction dim. Default 1.
    pub beta_slow: Option<f64>,
    /// Training context length, for YaRN. Default 0.
    pub n_ctx_orig: Option<f64>,
    /// Leading dimensions of each head before the rotated ones (latent attention: the K head
    /// is the latent, then its `nRot` rotated dimensions, which llama.cpp 0.1.161's K-shift
    /// rotates). Default 0.
    pub dims_offset: Option<f64>,
    /// Per-dimension frequency factors (nRot / 2 values), e.g. llama 3.1's rope_freqs.
    pub freq_factors: Option<Vec<f64>>,
}

/// A per-layer RoPE replacement.
#[napi(object)]
pub struct LayerRope {
    /// Layer index.
    pub layer: f64,
    /// Its parameters.
    pub rope: RopeOptions,
}

/// A run of cells moved by a defrag.
#[napi(object)]
pub struct CellMove {
    /// First source cell.
    pub src: u32,
    /// First destination cell.
    pub dst: u32,
    /// Cells in the run.
    pub len: u32,
}

/// What a state read did.
#[napi(object)]
pub struct ReadResult {
    /// The layout detected: 'seed', 'streams' or 'streams-rot'.
    pub layout: String,
    /// Cells restored.
    pub cells: u32,
    /// The cells that received the data, in payload order (a typed array: a whole-cache read
    /// of 65,536 cells hands over its list without building a JS array).
    pub placed: Uint32Array,
}

/// The seed era's outputs block of a session file.
#[napi(object)]
pub struct SessionOutputs {
    /// Batch index of each output.
    pub output_pos: Vec<i32>,
    /// Logits.
    pub logits: Float32Array,
    /// Embeddings.
    pub embeddings: Float32Array,
}

/// What a file load restored.
#[napi(object)]
pub struct LoadedFile {
    /// 'session' or 'sequence'.
    pub format: String,
    /// File version.
    pub version: u32,
    /// Prompt tokens stored in the file (may be fewer than the cells).
    pub tokens: Vec<i32>,
    /// Session files: model architecture.
    pub arch: Option<String>,
    /// Seed-era session files: the outputs block.
    pub outputs: Option<SessionOutputs>,
    /// Payload layout detected.
    pub layout: String,
    /// Cells restored.
    pub cells: u32,
}
