//! Tiny random-weight GGUF models that llama.cpp loads on CPU, written from Rust so the oracle
//! needs no Python. Same shapes and tokenizer as `interop/make_models.py` (weights differ: only
//! the cache bookkeeping is compared, never logits).

use std::io::Write;
use std::path::{Path, PathBuf};

use llama_kv_cache::model::gguf::{GgufBuilder, GgufType, GgufValue};

/// A model the differential runs can load.
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

const CTX: u32 = 4096;
const MAMBA_D_INNER: u32 = 128;
const MAMBA_D_STATE: u32 = 16;
const MAMBA_D_CONV: u32 = 4;
const MAMBA_DT_RANK: u32 = 4;
const N_SPECIAL: usize = 3 + 256;
const WORDS: [&str; 16] = [
    "the", "cat", "sat", "on", "mat", "a", "dog", "ran", "to", "big", "red", "and", "is", "it",
    "in", "of",
];

/// Number of tokens in the shared vocabulary.
pub fn n_vocab() -> usize {
    vocab().0.len()
}

fn vocab() -> (Vec<String>, Vec<f32>, Vec<i32>) {
    let (mut toks, mut scores, mut types) = (Vec::new(), Vec::new(), Vec::new());
    let mut add = |t: String, s: f32, ty: i32| {
        toks.push(t);
        scores.push(s);
        types.push(ty);
    };
    // token types: 1 normal, 2 unknown, 3 control, 6 byte
    add("<unk>".into(), 0.0, 2);
    add("<s>".into(), 0.0, 3);
    add("</s>".into(), 0.0, 3);
    for b in 0..256 {
        add(format!("<0x{b:02X}>"), 0.0, 6);
    }
    let mut pieces: Vec<String> = Vec::new();
    for w in WORDS {
        let full: Vec<char> = format!("\u{2581}{w}").chars().collect();
        for n in 2..=full.len() {
            let p: String = full[..n].iter().collect();
            if !pieces.contains(&p) {
                pieces.push(p);
            }
        }
    }
    for (i, p) in pieces.into_iter().enumerate() {
        add(p, -1.0 - 0.01 * i as f32, 1);
    }
    let letters = "abcdefghijklmnopqrstuvwxyz\u{2581}";
    for (i, c) in letters.chars().enumerate() {
        add(c.to_string(), -10.0 - 0.01 * i as f32, 1);
    }
    (toks, scores, types)
}

/// Metadata and f32 tensors of a tiny model, encoded by the core's GGUF writer (the same codec
/// that `modelInfo` reads with).
struct Writer {
    kv: Vec<(String, GgufValue)>,
    tensors: Vec<(String, Vec<u64>, Vec<f32>)>,
    rng: u64,
}

impl Writer {
    fn new(seed: u64) -> Writer {
        Writer {
            kv: Vec::new(),
            tensors: Vec::new(),
            rng: seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1,
        }
    }

    fn kv(&mut self, k: &str, v: GgufValue) {
        self.kv.push((k.to_string(), v));
    }

    /// A uniform value in (-1, 1) scaled to roughly `std` (deterministic).
    fn rnd(&mut self, std: f32) -> f32 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let u = (self.rng >> 11) as f64 / (1u64 << 53) as f64;
        ((u * 2.0 - 1.0) * 1.732) as f32 * std
    }

    /// `ne` in ggml order (ne[0] = row length).
    fn tensor(&mut self, name: &str, ne: &[u64], std: f32) {
        let n: u64 = ne.iter().product();
        let data = (0..n).map(|_| self.rnd(std)).collect();
        self.tensors.push((name.into(), ne.to_vec(), data));
    }

    fn tensor_data(&mut self, name: &str, ne: &[u64], data: Vec<f32>) {
        self.tensors.push((name.into(), ne.to_vec(), data));
    }

    fn tokenizer(&mut self) {
        let (toks, scores, types) = vocab();
        self.kv("tokenizer.ggml.model", GgufValue::Str("llama".into()));
        self.kv("tokenizer.ggml.pre", GgufValue::Str("default".into()));
        let array = |elem, values: Vec<GgufValue>| GgufValue::Array {
            elem,
            len: values.len() as u64,
            values: Some(values),
        };
        let toks = toks.into_iter().map(GgufValue::Str).collect();
        let scores = scores.into_iter().map(GgufValue::F32).collect();
        let types = types.into_iter().map(GgufValue::I32).collect();
        self.kv("tokenizer.ggml.tokens", array(GgufType::Str, toks));
        self.kv("tokenizer.ggml.scores", array(GgufType::F32, scores));
        self.kv("tokenizer.ggml.token_type", array(GgufType::I32, types));
        self.kv("tokenizer.ggml.unknown_token_id", GgufValue::U32(0));
        self.kv("tokenizer.ggml.bos_token_id", GgufValue::U32(1));
        self.kv("tokenizer.ggml.eos_token_id", GgufValue::U32(2));
        self.kv("tokenizer.ggml.add_bos_token", GgufValue::Bool(true));
        self.kv("tokenizer.ggml.add_eos_token", GgufValue::Bool(false));
        self.kv("tokenizer.ggml.add_space_prefix", GgufValue::Bool(true));
    }

    fn write(&self, path: &Path) -> std::io::Result<()> {
        let mut g = GgufBuilder::new();
        for (k, v) in &self.kv {
            g.kv(k, v.clone());
        }
        for (name, ne, _) in &self.tensors {
            g.tensor(name, ne, 0); // f32
        }
        let mut b = g.header();
        for ((_, _, data), info) in self.tensors.iter().zip(g.tensors()) {
            let start = b.len();
            for x in data {
                b.extend(x.to_le_bytes());
            }
            // each tensor is padded to the alignment, as its offset says
            b.resize(start + info.size.next_multiple_of(32) as usize, 0);
        }
        static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = path.with_extension(format!("tmp.{}.{n}", std::process::id()));
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&b)?;
        f.sync_all()?;
        std::fs::rename(tmp, path)
    }
}

fn write_llama(kind: ModelKind, path: &Path) -> std::io::Result<()> {
    let (n_embd, n_head, n_head_kv, n_ff) = kind.llama_shape();
    let head_dim = n_embd / n_head;
    let n_gqa = (head_dim * n_head_kv) as u64;
    let (e, ff) = (n_embd as u64, n_ff as u64);
    let mut w = Writer::new(kind as u64 + 16);
    w.kv("general.architecture", GgufValue::Str("llama".into()));
    w.kv("general.name", GgufValue::Str(kind.file_name().into()));
    w.kv("llama.context_length", GgufValue::U32(CTX));
    w.kv("llama.embedding_length", GgufValue::U32(n_embd as u32));
    w.kv("llama.block_count", GgufValue::U32(kind.n_layer()));
    w.kv("llama.feed_forward_length", GgufValue::U32(n_ff as u32));
    w.kv("llama.attention.head_count", GgufValue::U32(n_head as u32));
    w.kv(
        "llama.attention.head_count_kv",
        GgufValue::U32(n_head_kv as u32),
    );
    w.kv(
        "llama.rope.dimension_count",
        GgufValue::U32(head_dim as u32),
    );
    w.kv("llama.rope.freq_base", GgufValue::F32(10000.0));
    w.kv(
        "llama.attention.layer_norm_rms_epsilon",
        GgufValue::F32(1e-5),
    );
    w.kv("general.file_type", GgufValue::U32(0));
    w.tokenizer();
    let nv = n_vocab() as u64;
    w.kv("llama.vocab_size", GgufValue::U32(nv as u32));
    w.tensor("token_embd.weight", &[e, nv], 0.5);
    w.tensor_data("output_norm.weight", &[e], vec![1.0; n_embd]);
    w.tensor("output.weight", &[e, nv], 0.5);
    // special and byte tokens never win greedy sampling
    if let Some(t) = w.tensors.last_mut() {
        t.2[..N_SPECIAL * n_embd].fill(0.0);
    }
    for i in 0..kind.n_layer() {
        let p = format!("blk.{i}.");
        w.tensor_data(&format!("{p}attn_norm.weight"), &[e], vec![1.0; n_embd]);
        w.tensor(&format!("{p}attn_q.weight"), &[e, e], 0.2);
        w.tensor(&format!("{p}attn_k.weight"), &[e, n_gqa], 0.2);
        w.tensor(&format!("{p}attn_v.weight"), &[e, n_gqa], 0.2);
        w.tensor(&format!("{p}attn_output.weight"), &[e, e], 0.1);
        w.tensor_data(&format!("{p}ffn_norm.weight"), &[e], vec![1.0; n_embd]);
        w.tensor(&format!("{p}ffn_gate.weight"), &[e, ff], 0.1);
        w.tensor(&format!("{p}ffn_up.weight"), &[e, ff], 0.1);
        w.tensor(&format!("{p}ffn_down.weight"), &[ff, e], 0.1);
    }
    w.write(path)
}

fn write_mamba(path: &Path) -> std::io::Result<()> {
    let (n_embd, d_inner, d_state, d_conv, dt_rank) = (
        64u64,
        MAMBA_D_INNER as u64,
        MAMBA_D_STATE as u64,
        MAMBA_D_CONV as u64,
        MAMBA_DT_RANK as u64,
    );
    let mut w = Writer::new(64);
    w.kv("general.architecture", GgufValue::Str("mamba".into()));
    w.kv("general.name", GgufValue::Str("mamba".into()));
    w.kv("mamba.context_length", GgufValue::U32(CTX));
    w.kv("mamba.embedding_length", GgufValue::U32(n_embd as u32));
    w.kv("mamba.block_count", GgufValue::U32(2));
    w.kv("mamba.feed_forward_length", GgufValue::U32(0));
    w.kv("mamba.attention.head_count", GgufValue::U32(0));
    w.kv("mamba.ssm.conv_kernel", GgufValue::U32(d_conv as u32));
    w.kv("mamba.ssm.inner_size", GgufValue::U32(d_inner as u32));
    w.kv("mamba.ssm.state_size", GgufValue::U32(d_state as u32));
    w.kv("mamba.ssm.time_step_rank", GgufValue::U32(dt_rank as u32));
    w.kv(
        "mamba.attention.layer_norm_rms_epsilon",
        GgufValue::F32(1e-5),
    );
    w.kv("general.file_type", GgufValue::U32(0));
    w.tokenizer();
    let nv = n_vocab() as u64;
    w.kv("mamba.vocab_size", GgufValue::U32(nv as u32));
    w.tensor("token_embd.weight", &[n_embd, nv], 0.5);
    w.tensor_data("output_norm.weight", &[n_embd], vec![1.0; n_embd as usize]);
    w.tensor("output.weight", &[n_embd, nv], 0.5);
    for i in 0..2 {
        let p = format!("blk.{i}.");
        w.tensor_data(
            &format!("{p}attn_norm.weight"),
            &[n_embd],
            vec![1.0; n_embd as usize],
        );
        w.tensor(&format!("{p}ssm_in.weight"), &[n_embd, 2 * d_inner], 0.1);
        w.tensor(&format!("{p}ssm_conv1d.weight"), &[d_conv, d_inner], 0.3);
        w.tensor(&format!("{p}ssm_conv1d.bias"), &[d_inner], 0.05);
        w.tensor(
            &format!("{p}ssm_x.weight"),
            &[d_inner, dt_rank + 2 * d_state],
            0.1,
        );
        w.tensor(&format!("{p}ssm_dt.weight"), &[dt_rank, d_inner], 0.3);
        let bias: Vec<f32> = (0..d_inner).map(|_| w.rnd(0.1) - 2.0).collect();
        w.tensor_data(&format!("{p}ssm_dt.bias"), &[d_inner], bias);
        let a: Vec<f32> = (0..d_inner)
            .flat_map(|_| (1..=d_state).map(|s| -(s as f32)))
            .collect();
        w.tensor_data(&format!("{p}ssm_a"), &[d_state, d_inner], a);
        w.tensor_data(
            &format!("{p}ssm_d"),
            &[d_inner],
            vec![1.0; d_inner as usize],
        );
        w.tensor(&format!("{p}ssm_out.weight"), &[d_inner, n_embd], 0.1);
    }
    w.write(path)
}

/// Writes `kind` into `dir` unless it is already there; returns its path.
pub fn ensure_model(dir: &Path, kind: ModelKind) -> std::io::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join(kind.file_name());
    if !path.exists() {
        match kind {
            ModelKind::Mamba => write_mamba(&path)?,
            _ => write_llama(kind, &path)?,
        }
    }
    Ok(path)
}
