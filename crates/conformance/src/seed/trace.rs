//! Traces: a context configuration plus a list of operations, in the driver's line format.

use std::fmt;

use llama_kv_cache::GgmlType;

use crate::seed::model::ModelKind;

/// `GGML_KQ_MASK_PAD`: llama.cpp raises `n_batch` to at least this.
pub const KQ_MASK_PAD: u32 = 64;

/// The context a trace runs on (what `llama_context_params` asks for).
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// The model.
    pub model: ModelKind,
    /// Requested context size.
    pub n_ctx: u32,
    /// Sequences.
    pub n_seq_max: u32,
    /// Flash attention (V not transposed, padding 256).
    pub flash_attn: bool,
    /// K type (forced to f32 for recurrent models).
    pub type_k: GgmlType,
    /// V type (forced to f32 for recurrent models).
    pub type_v: GgmlType,
    /// Requested logical batch size.
    pub n_batch: u32,
    /// Requested micro-batch size.
    pub n_ubatch: u32,
    /// Defrag threshold (`< 0` disables the automatic scheduling).
    pub defrag_thold: f32,
}

impl Config {
    /// The head-dim-16 llama with f16 K/V, no flash attention and no threshold defrag.
    pub fn llama_h16(n_ctx: u32, n_seq_max: u32, n_batch: u32, n_ubatch: u32) -> Config {
        Config {
            model: ModelKind::LlamaH16,
            n_ctx,
            n_seq_max,
            flash_attn: false,
            type_k: GgmlType::F16,
            type_v: GgmlType::F16,
            n_batch,
            n_ubatch,
            defrag_thold: -1.0,
        }
    }

    /// Padding of `n_ctx` and of `n` (256 with flash attention, else 32).
    pub fn padding(&self) -> u32 {
        if self.flash_attn {
            256
        } else {
            32
        }
    }

    /// `cparams.n_ctx` after padding.
    pub fn n_ctx_padded(&self) -> u32 {
        self.n_ctx.div_ceil(self.padding()) * self.padding()
    }

    /// Cells of the cache.
    pub fn kv_size(&self) -> u32 {
        if self.model.recurrent() {
            self.n_seq_max.max(1)
        } else {
            self.n_ctx_padded()
        }
    }

    /// Effective `n_batch`: `min(n_ctx, n_batch)` (unpadded n_ctx), at least 64.
    pub fn eff_n_batch(&self) -> u32 {
        self.n_ctx.min(self.n_batch).max(KQ_MASK_PAD)
    }

    /// Effective `n_ubatch`.
    pub fn eff_n_ubatch(&self) -> u32 {
        self.eff_n_batch().min(self.n_ubatch)
    }

    /// K type the cache really uses.
    pub fn eff_type_k(&self) -> GgmlType {
        if self.model.recurrent() {
            GgmlType::F32
        } else {
            self.type_k
        }
    }

    /// V type the cache really uses.
    pub fn eff_type_v(&self) -> GgmlType {
        if self.model.recurrent() {
            GgmlType::F32
        } else {
            self.type_v
        }
    }

    /// Rows the worst-case reserve after a K-shift or defrag stores at `head`.
    pub fn reserve_tokens(&self) -> u32 {
        self.n_ctx_padded().min(self.eff_n_ubatch())
    }

    /// `graph_max_nodes()` of the context.
    pub fn max_nodes(&self) -> u32 {
        65536u32.max(5 * self.model.n_tensors())
    }

    /// Defrag moves per update: `(max_nodes - 2 n_layer) / (6 n_layer)`.
    pub fn max_moves(&self) -> u32 {
        let l = self.model.n_layer();
        (self.max_nodes() - 2 * l) / (6 * l)
    }

    /// The driver's `init` line, with the model at `model_path`.
    pub fn init_line(&self, model_path: &str) -> String {
        format!(
            "init {model_path} {} {} {} {} {} {} {} {}",
            self.n_ctx,
            self.n_seq_max,
            self.flash_attn as u8,
            self.type_k.id(),
            self.type_v.id(),
            self.n_batch,
            self.n_ubatch,
            self.defrag_thold
        )
    }
}

impl fmt::Display for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} n_ctx={} (kv {}) n_seq_max={} fa={} k={} v={} n_batch={} n_ubatch={} defrag_thold={}",
            self.model.file_name(),
            self.n_ctx,
            self.kv_size(),
            self.n_seq_max,
            self.flash_attn,
            self.eff_type_k(),
            self.eff_type_v(),
            self.eff_n_batch(),
            self.eff_n_ubatch(),
            self.defrag_thold
        )
    }
}

/// One token of a decode batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tok {
    /// Token id.
    pub token: i32,
    /// Position.
    pub pos: i32,
    /// Sequence ids, in batch order.
    pub seqs: Vec<i32>,
}

/// One operation of a trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// `llama_decode` of a batch (logits on the last token).
    Decode(Vec<Tok>),
    /// `llama_kv_self_seq_rm(seq, p0, p1)`.
    SeqRm(i32, i32, i32),
    /// `llama_kv_self_seq_cp(src, dst, p0, p1)`.
    SeqCp(i32, i32, i32, i32),
    /// `llama_kv_self_seq_keep(seq)`.
    SeqKeep(i32),
    /// `llama_kv_self_seq_add(seq, p0, p1, delta)`.
    SeqAdd(i32, i32, i32, i32),
    /// `llama_kv_self_seq_div(seq, p0, p1, d)`.
    SeqDiv(i32, i32, i32, i32),
    /// `llama_kv_self_update`: pending K-shift, then pending defrag.
    Update,
    /// `llama_kv_self_defrag`: schedules a defrag.
    Defrag,
    /// `llama_kv_self_clear`.
    Clear,
    /// `llama_state_seq_get_data(seq)` into a buffer slot.
    SeqGet { seq: i32, slot: u32 },
    /// `llama_state_seq_set_data(slot's buffer, dst)`.
    SeqSet { slot: u32, dst: i32 },
    /// `llama_state_get_data` (whole context) into a buffer slot.
    StateGet { slot: u32 },
    /// `llama_state_set_data(slot's buffer)`.
    StateSet { slot: u32 },
}

impl Op {
    /// Short name, for counters.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Decode(_) => "decode",
            Op::SeqRm(..) => "seq_rm",
            Op::SeqCp(..) => "seq_cp",
            Op::SeqKeep(..) => "seq_keep",
            Op::SeqAdd(..) => "seq_add",
            Op::SeqDiv(..) => "seq_div",
            Op::Update => "update",
            Op::Defrag => "defrag",
            Op::Clear => "clear",
            Op::SeqGet { .. } => "seq_get",
            Op::SeqSet { .. } => "seq_set",
            Op::StateGet { .. } => "state_get",
            Op::StateSet { .. } => "state_set",
        }
    }

    /// Parses a line written by `Display`.
    pub fn parse(line: &str) -> Result<Op, String> {
        let mut it = line.split_whitespace();
        let name = it.next().ok_or("empty line")?;
        let nums: Vec<i64> = it
            .map(|w| w.parse::<i64>().map_err(|e| format!("{line}: {e}")))
            .collect::<Result<_, _>>()?;
        let n = |i: usize| -> Result<i32, String> {
            nums.get(i)
                .map(|&v| v as i32)
                .ok_or_else(|| format!("{line}: missing argument {i}"))
        };
        Ok(match name {
            "decode" => {
                let count = n(0)? as usize;
                let mut toks = Vec::with_capacity(count);
                let mut k = 1;
                for _ in 0..count {
                    let (token, pos, ns) = (n(k)?, n(k + 1)?, n(k + 2)? as usize);
                    let seqs = (0..ns).map(|j| n(k + 3 + j)).collect::<Result<_, _>>()?;
                    toks.push(Tok { token, pos, seqs });
                    k += 3 + ns;
                }
                Op::Decode(toks)
            }
            "seq_rm" => Op::SeqRm(n(0)?, n(1)?, n(2)?),
            "seq_cp" => Op::SeqCp(n(0)?, n(1)?, n(2)?, n(3)?),
            "seq_keep" => Op::SeqKeep(n(0)?),
            "seq_add" => Op::SeqAdd(n(0)?, n(1)?, n(2)?, n(3)?),
            "seq_div" => Op::SeqDiv(n(0)?, n(1)?, n(2)?, n(3)?),
            "update" => Op::Update,
            "defrag" => Op::Defrag,
            "clear" => Op::Clear,
            "seq_get" => Op::SeqGet {
                seq: n(0)?,
                slot: n(1)? as u32,
            },
            "seq_set" => Op::SeqSet {
                slot: n(0)? as u32,
                dst: n(1)?,
            },
            "state_get" => Op::StateGet { slot: n(0)? as u32 },
            "state_set" => Op::StateSet { slot: n(0)? as u32 },
            other => return Err(format!("unknown op {other}")),
        })
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Op::Decode(toks) => {
                write!(f, "decode {}", toks.len())?;
                for t in toks {
                    write!(f, " {} {} {}", t.token, t.pos, t.seqs.len())?;
                    for s in &t.seqs {
                        write!(f, " {s}")?;
                    }
                }
                Ok(())
            }
            Op::SeqRm(s, a, b) => write!(f, "seq_rm {s} {a} {b}"),
            Op::SeqCp(s, d, a, b) => write!(f, "seq_cp {s} {d} {a} {b}"),
            Op::SeqKeep(s) => write!(f, "seq_keep {s}"),
            Op::SeqAdd(s, a, b, d) => write!(f, "seq_add {s} {a} {b} {d}"),
            Op::SeqDiv(s, a, b, d) => write!(f, "seq_div {s} {a} {b} {d}"),
            Op::Update => write!(f, "update"),
            Op::Defrag => write!(f, "defrag"),
            Op::Clear => write!(f, "clear"),
            Op::SeqGet { seq, slot } => write!(f, "seq_get {seq} {slot}"),
            Op::SeqSet { slot, dst } => write!(f, "seq_set {slot} {dst}"),
            Op::StateGet { slot } => write!(f, "state_get {slot}"),
            Op::StateSet { slot } => write!(f, "state_set {slot}"),
        }
    }
}

/// A generated trace.
#[derive(Clone, Debug)]
pub struct Trace {
    /// Seed it was generated from.
    pub seed: u64,
    /// Scenario name.
    pub scenario: &'static str,
    /// Context.
    pub config: Config,
    /// Operations.
    pub ops: Vec<Op>,
    /// Candidate ops the generator dropped, by reason.
    pub dropped: std::collections::BTreeMap<&'static str, u64>,
}

/// What one side shows after an operation.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Obs {
    /// The operation's return value.
    pub ret: i64,
    /// `llama_kv_self_n_tokens`.
    pub n_tokens: i64,
    /// `llama_kv_self_used_cells`.
    pub used: i64,
    /// `llama_kv_self_seq_pos_max` of every sequence.
    pub pos_max: Vec<i32>,
    /// View: cells with at least one sequence.
    pub view_used: i64,
    /// View: sum of sequence counts.
    pub token_count: i64,
    /// View: largest free run.
    pub max_contig: i64,
    /// View: its first cell.
    pub max_contig_idx: i64,
    /// View: pos + delta of every cell.
    pub pos: Vec<i32>,
    /// View: sequences of every cell, ascending.
    pub seqs: Vec<Vec<i32>>,
    /// KV state bytes for state reads.
    pub blob: Option<Vec<u8>>,
}
