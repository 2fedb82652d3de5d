//! The differential of today's live caches against llama.cpp 0.1.161: random traces of
//! decodes, sequence operations and sequence state round trips, applied op by op to the
//! peer's memory (`today-driver trace`, which prints every cell of every stream of every part)
//! and to ours ([`IswaCache`] or [`AttentionCache`]), compared after every op
//! ([`crate::compare`], field by field).

use std::path::Path;

use llama_kv_cache::{
    memory_for_model, AttentionCache, ContextParams, GgmlType, HybridCache, IswaCache, IswaParams,
    Layout, Memory, MemoryKind, ModelInfo, RecurrentMemory, SeedCache, ShiftParams, UBatch,
};
use serde_json::Value;

use crate::compare::{diff, Diff, Observation};
use crate::driver::{Driver, Session};

/// How the lines of a comparison name llama.cpp.
pub const PEER: &str = "llama.cpp 0.1.161";

/// A context to run traces in.
#[derive(Clone, Debug)]
pub struct TraceConfig {
    /// Model file.
    pub model: String,
    /// Context size.
    pub ctx: u32,
    /// Sequences.
    pub n_seq: u32,
    /// Tokens per ubatch (and per batch).
    pub n_ubatch: u32,
    /// One stream for all sequences.
    pub unified: bool,
    /// The window cache as large as the base cache.
    pub swa_full: bool,
}

impl TraceConfig {
    /// The context the driver makes, as our memory's parameters.
    pub fn context(&self) -> ContextParams {
        ContextParams {
            n_ctx: self.ctx,
            n_seq_max: self.n_seq,
            n_ubatch: self.n_ubatch,
            unified: self.unified,
            swa_full: self.swa_full,
            type_k: GgmlType::F16,
            type_v: GgmlType::F16,
            flash_attn: false,
        }
    }
}

/// One operation of a trace, as the driver reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// A batch: `(seq, first position, tokens)` per group.
    Decode(Vec<(i32, i32, u32)>),
    /// `seq_rm`.
    Rm(i32, i32, i32),
    /// `seq_cp`.
    Cp(i32, i32, i32, i32),
    /// `seq_keep`.
    Keep(i32),
    /// `seq_add`.
    Add(i32, i32, i32, i32),
    /// `seq_div`.
    Div(i32, i32, i32, i32),
    /// The state of one sequence into the buffer.
    Save(i32),
    /// The buffer into one sequence.
    Load(i32),
    /// Clear the memory.
    Clear,
}

impl Op {
    /// The driver's line.
    pub fn line(&self) -> String {
        match self {
            Op::Decode(groups) => {
                let g: Vec<String> = groups
                    .iter()
                    .map(|(s, p, n)| format!("{s}:{p}:{n}"))
                    .collect();
                format!("decode {}", g.join(","))
            }
            Op::Rm(s, a, b) => format!("rm {s} {a} {b}"),
            Op::Cp(s, d, a, b) => format!("cp {s} {d} {a} {b}"),
            Op::Keep(s) => format!("keep {s}"),
            Op::Add(s, a, b, d) => format!("add {s} {a} {b} {d}"),
            Op::Div(s, a, b, d) => format!("div {s} {a} {b} {d}"),
            Op::Save(s) => format!("save {s}"),
            Op::Load(s) => format!("load {s}"),
            Op::Clear => "clear".into(),
        }
    }
}

/// A recurrent memory as both sides show it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Recurrent {
    /// State cells.
    pub size: u64,
    /// Where the next placement searches from.
    pub head: u64,
    /// The `used` counter.
    pub used: u64,
    /// Non-empty cells as `i:pos:seqs`.
    pub cells: String,
    /// Each sequence's tail cell.
    pub tails: String,
}

/// What both sides show after an op: the result and every part's cells.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shown {
    /// The op's result (decode: 0 placed, 1 no room; others 1).
    pub ret: i64,
    /// Per part: size and, per stream, its non-empty cells as `i:pos:shift:seqs`.
    pub parts: Vec<(u64, Vec<String>)>,
    /// The recurrent memory, alone or in a hybrid.
    pub recr: Option<Recurrent>,
    /// `(seq_pos_min, seq_pos_max)` per sequence.
    pub pos: Vec<(i64, i64)>,
}

impl Observation for Shown {
    fn compare(&self, ours: &Shown, d: &mut Diff) {
        d.field("ret", &self.ret, &ours.ret);
        d.field("parts", &self.parts.len(), &ours.parts.len());
        for (i, ((size, streams), (our_size, our_streams))) in
            self.parts.iter().zip(&ours.parts).enumerate()
        {
            d.field(&format!("part {i} size"), size, our_size);
            d.items(
                |s| format!("part {i} stream {s} cells (i:pos:shift:seqs)"),
                &format!("part {i} streams"),
                streams,
                our_streams,
            );
        }
        match (&self.recr, &ours.recr) {
            (Some(r), Some(o)) => {
                d.field("recurrent size", &r.size, &o.size);
                d.field("recurrent head", &r.head, &o.head);
                d.field("recurrent used", &r.used, &o.used);
                d.field("recurrent cells (i:pos:seqs)", &r.cells, &o.cells);
                d.field("recurrent tails", &r.tails, &o.tails);
            }
            (r, o) => d.field("recurrent memory", &r.is_some(), &o.is_some()),
        }
        d.items(
            |s| format!("seq {s} (pos_min, pos_max)"),
            "sequences",
            &self.pos,
            &ours.pos,
        );
    }
}

fn shown_from_json(v: &Value) -> Result<Shown, String> {
    let err = || format!("unexpected driver output {v}");
    let parts = v["parts"]
        .as_array()
        .ok_or_else(err)?
        .iter()
        .map(|p| {
            let streams = p["streams"]
                .as_array()
                .map(|a| a.iter().map(|s| s.as_str().unwrap_or("?").to_string()))
                .ok_or_else(err)?
                .collect();
            Ok((p["size"].as_u64().ok_or_else(err)?, streams))
        })
        .collect::<Result<_, String>>()?;
    let recr = match v.get("recr") {
        Some(r) => Some(Recurrent {
            size: r["size"].as_u64().ok_or_else(err)?,
            head: r["head"].as_u64().ok_or_else(err)?,
            used: r["used"].as_u64().ok_or_else(err)?,
            cells: r["cells"].as_str().ok_or_else(err)?.to_string(),
            tails: r["tails"].as_str().ok_or_else(err)?.to_string(),
        }),
        None => None,
    };
    let pos = v["pos"]
        .as_array()
        .ok_or_else(err)?
        .iter()
        .map(|p| (p[0].as_i64().unwrap_or(-9), p[1].as_i64().unwrap_or(-9)))
        .collect();
    Ok(Shown {
        ret: v["ret"].as_i64().ok_or_else(err)?,
        parts,
        recr,
        pos,
    })
}

/// The peer: one `today-driver trace` process.
pub struct Oracle {
    session: Session,
}

impl Oracle {
    /// Starts the driver for `cfg`.
    pub fn start(cfg: &TraceConfig, models: &Path) -> Result<Oracle, String> {
        let args = [
            "trace".to_string(),
            format!("model={}", models.join(&cfg.model).display()),
            format!("ctx={}", cfg.ctx),
            format!("seqs={}", cfg.n_seq),
            format!("ubatch={}", cfg.n_ubatch),
            format!("unified={}", u8::from(cfg.unified)),
            format!("swa_full={}", u8::from(cfg.swa_full)),
        ];
        Ok(Oracle {
            session: Session::spawn(Driver::Today, &args)?,
        })
    }

    /// Applies `op` and reads what the memory shows.
    pub fn apply(&mut self, op: &Op) -> Result<Shown, String> {
        self.send(&op.line())
    }

    /// Sends one line of the trace protocol (also its state ops: `save`/`load` of the
    /// in-memory sequence state, `savep`/`loadp` of its `PARTIAL_ONLY` form, `dump PATH` /
    /// `undump PATH` of the saved bytes) and reads what the memory shows.
    pub fn send(&mut self, op: &str) -> Result<Shown, String> {
        shown_from_json(&self.session.roundtrip(op)?)
    }
}

/// Our memory of the same kind.
pub enum Ours {
    /// The model has sliding-window layers.
    Iswa(IswaCache),
    /// Full attention only.
    Attention(AttentionCache),
    /// Attention and recurrent layers.
    Hybrid(HybridCache),
    /// Recurrent layers only.
    Recurrent(RecurrentMemory),
}

/// Runs `$body` on whichever memory `$m` holds, bound to `$c`.
macro_rules! each {
    ($m:expr, $c:ident => $body:expr) => {
        match $m {
            Ours::Iswa($c) => $body,
            Ours::Attention($c) => $body,
            Ours::Hybrid($c) => $body,
            Ours::Recurrent($c) => $body,
        }
    };
}

/// Our side of a trace.
pub struct OurSide {
    memory: Ours,
    n_seq: u32,
    n_ubatch: u32,
    shift: Option<ShiftParams>,
    saved: Vec<u8>,
}

/// A recurrent memory's state layout is the stream-less one in every version; the others'
/// state goes in 0.1.161's layout.
trait TraceMemory {
    fn place_all(&mut self, ubatches: &[UBatch]) -> llama_kv_cache::Result<bool>;
    fn update_shift(&mut self, shift: Option<&ShiftParams>) -> llama_kv_cache::Result<()>;
    fn write(&self, seq: i32) -> llama_kv_cache::Result<Vec<u8>>;
    fn read(&mut self, data: &[u8], seq: i32) -> llama_kv_cache::Result<()>;
}

/// Today's attention-bearing memories: placement, shift and state as their own calls.
macro_rules! attention_memory {
    ($($t:ty),*) => {$(
        impl TraceMemory for $t {
            fn place_all(&mut self, ubatches: &[UBatch]) -> llama_kv_cache::Result<bool> {
                Ok(self.place(ubatches)?.is_some())
            }
            fn update_shift(&mut self, shift: Option<&ShiftParams>) -> llama_kv_cache::Result<()> {
                self.update(shift).map(drop)
            }
            fn write(&self, seq: i32) -> llama_kv_cache::Result<Vec<u8>> {
                self.state_write(seq, Layout::StreamsRot)
            }
            fn read(&mut self, data: &[u8], seq: i32) -> llama_kv_cache::Result<()> {
                self.state_read(data, seq, Layout::StreamsRot).map(drop)
            }
        }
    )*};
}

attention_memory!(IswaCache, AttentionCache, HybridCache);

impl TraceMemory for RecurrentMemory {
    fn place_all(&mut self, ubatches: &[UBatch]) -> llama_kv_cache::Result<bool> {
        self.place(ubatches)
    }
    fn update_shift(&mut self, _: Option<&ShiftParams>) -> llama_kv_cache::Result<()> {
        Ok(())
    }
    fn write(&self, seq: i32) -> llama_kv_cache::Result<Vec<u8>> {
        self.state_write(seq)
    }
    fn read(&mut self, data: &[u8], seq: i32) -> llama_kv_cache::Result<()> {
        self.state_read(data, seq).map(drop)
    }
}

impl OurSide {
    /// The memory 0.1.161 builds for `cfg`'s model and context.
    pub fn new(cfg: &TraceConfig, models: &Path) -> Result<OurSide, String> {
        let err = |e: llama_kv_cache::KvError| e.to_string();
        let info = ModelInfo::from_file(&models.join(&cfg.model), false).map_err(err)?;
        let ctx = cfg.context();
        let memory = match info.memory {
            MemoryKind::Iswa => Ours::Iswa(
                IswaCache::new(IswaParams::for_model(&info, &ctx).map_err(err)?).map_err(err)?,
            ),
            MemoryKind::Hybrid => Ours::Hybrid(HybridCache::for_model(&info, &ctx).map_err(err)?),
            MemoryKind::Recurrent => {
                let mut p = info
                    .layer_params(
                        cfg.n_seq.max(1),
                        cfg.n_seq,
                        GgmlType::F32,
                        GgmlType::F32,
                        false,
                    )
                    .map_err(err)?;
                p.recurrent = true;
                Ours::Recurrent(RecurrentMemory::new(p, info.n_layer).map_err(err)?)
            }
            // 0.1.161's cache itself: of one stream (fromModel gives the seed's cache there),
            // or of a stream per sequence, the memory fromModel builds for that context
            MemoryKind::Unified => {
                let size = ctx.cells_per_stream(info.n_ctx_train).map_err(err)?;
                let p = info
                    .layer_params(size, cfg.n_seq, ctx.type_k, ctx.type_v, ctx.flash_attn)
                    .map_err(err)?;
                let cache = AttentionCache::new(p, cfg.unified, Default::default()).map_err(err)?;
                if !cfg.unified && cfg.n_seq > 1 {
                    let built = memory_for_model(&info, &ctx).map_err(err)?;
                    if built.kind() != "kv-streams" || built.parts() != cache.parts() {
                        return Err(format!(
                            "{}: fromModel built a '{}' memory, not this one of a stream per \
                             sequence",
                            cfg.model,
                            built.kind()
                        ));
                    }
                }
                Ours::Attention(cache)
            }
            indexed => {
                return Err(format!(
                    "{}: no live '{}' memory to trace",
                    cfg.model,
                    indexed.name()
                ))
            }
        };
        Ok(OurSide {
            memory,
            n_seq: cfg.n_seq,
            n_ubatch: cfg.n_ubatch,
            shift: info.shift_params(None),
            saved: Vec::new(),
        })
    }

    /// Whether the memory keeps a recurrent state, whose ubatches hold each sequence's tokens
    /// as one group (`split_equal`); traces of such memories decode one sequence per batch.
    pub fn equal_split(&self) -> bool {
        matches!(self.memory, Ours::Hybrid(_) | Ours::Recurrent(_))
    }

    /// Whether positions may be shifted.
    fn can_shift(&self) -> bool {
        match &self.memory {
            Ours::Iswa(c) => c.can_shift(),
            Ours::Attention(c) => c.can_shift(),
            // 0.1.161 aborts on the K-shift of a cache without layers (an LFM2-with-window
            // memory's base cache: `GGML_ASSERT(buffer)`), so traces do not shift those
            Ours::Hybrid(c) => {
                let attn = &c.attention().cache;
                attn.can_shift() && attn.caches().iter().all(|(_, p, _)| p.params().n_layer > 0)
            }
            Ours::Recurrent(_) => true,
        }
    }

    fn parts(&self) -> Vec<&AttentionCache> {
        match &self.memory {
            Ours::Iswa(c) => vec![&c.base().cache, &c.swa().cache],
            Ours::Attention(c) => vec![c],
            Ours::Hybrid(c) => c
                .attention()
                .cache
                .caches()
                .into_iter()
                .map(|p| p.1)
                .collect(),
            Ours::Recurrent(_) => Vec::new(),
        }
    }

    fn recurrent(&self) -> Option<&RecurrentMemory> {
        match &self.memory {
            Ours::Hybrid(c) => Some(&c.recurrent().memory),
            Ours::Recurrent(c) => Some(c),
            _ => None,
        }
    }

    /// The ubatches 0.1.161 splits a batch into: `split_simple` (unified) or, one sequence
    /// per batch, `split_equal`; both cut it into pieces of `n_ubatch` tokens in order, and a
    /// memory with a recurrent state takes each piece as one group of its sequence.
    fn ubatches(&self, groups: &[(i32, i32, u32)]) -> Vec<UBatch> {
        let tokens: Vec<(i32, i32)> = groups
            .iter()
            .flat_map(|&(s, p, n)| (0..n as i32).map(move |k| (s, p + k)))
            .collect();
        tokens
            .chunks(self.n_ubatch as usize)
            .map(|c| {
                let pos: Vec<i32> = c.iter().map(|t| t.1).collect();
                if self.equal_split() {
                    UBatch {
                        n_seq_tokens: pos.len() as u32,
                        pos,
                        seq_ids: vec![vec![c[0].0]],
                        ext: Vec::new(),
                    }
                } else {
                    UBatch::per_token(pos, c.iter().map(|t| vec![t.0]).collect())
                }
            })
            .collect()
    }

    /// Applies `op` and shows the memory; an error is a refusal 0.1.161 would not make.
    pub fn apply(&mut self, op: &Op) -> Result<Shown, String> {
        let e = |e: llama_kv_cache::KvError| format!("{op:?}: {e}");
        let mut ret = 1;
        match *op {
            Op::Decode(ref groups) => {
                let ubatches = self.ubatches(groups);
                let shift = self.shift.as_ref();
                let placed = each!(&mut self.memory, c => {
                    c.update_shift(shift).map_err(e)?;
                    c.place_all(&ubatches).map_err(e)?
                });
                ret = if placed { 0 } else { 1 };
            }
            Op::Rm(s, a, b) => {
                ret = i64::from(each!(&mut self.memory, c => c.seq_rm(s, a, b)).map_err(e)?);
            }
            Op::Cp(s, d, a, b) => each!(&mut self.memory, c => c.seq_cp(s, d, a, b)).map_err(e)?,
            Op::Keep(s) => each!(&mut self.memory, c => c.seq_keep(s)).map_err(e)?,
            Op::Add(s, a, b, d) => {
                each!(&mut self.memory, c => c.seq_add(s, a, b, d)).map_err(e)?
            }
            Op::Div(s, a, b, d) => {
                each!(&mut self.memory, c => c.seq_div(s, a, b, d)).map_err(e)?
            }
            Op::Save(s) => self.saved = each!(&self.memory, c => c.write(s)).map_err(e)?,
            Op::Load(s) => {
                let saved = &self.saved;
                // 0.1.161 reports a load that finds no room as a failure, and so does this
                ret = i64::from(each!(&mut self.memory, c => c.read(saved, s)).is_ok());
            }
            Op::Clear => each!(&mut self.memory, c => c.clear()).map_err(e)?,
        }
        Ok(self.show(ret))
    }

    fn show(&self, ret: i64) -> Shown {
        let parts = self
            .parts()
            .into_iter()
            .map(|p| {
                let streams = (0..p.n_stream())
                    .map(|s| stream_cells(p.stream(s).expect("in range"), self.n_seq))
                    .collect();
                (u64::from(p.size()), streams)
            })
            .collect();
        let recr = self.recurrent().map(|r| recurrent_cells(r.cache()));
        let pos = (0..self.n_seq as i32)
            .map(|s| {
                let (lo, hi) = each!(&self.memory, c => (c.seq_pos_min(s), c.seq_pos_max(s)));
                (i64::from(lo.unwrap_or(-9)), i64::from(hi.unwrap_or(-9)))
            })
            .collect();
        Shown {
            ret,
            parts,
            recr,
            pos,
        }
    }
}

/// A recurrent memory as the driver prints it.
fn recurrent_cells(cache: &SeedCache) -> Recurrent {
    let cells = cache.cells();
    let mut out = Vec::new();
    for i in 0..cells.len() {
        let seqs = cells.seqs(i);
        if seqs.is_empty() {
            continue;
        }
        let ids: Vec<String> = seqs.iter().map(|q| q.to_string()).collect();
        out.push(format!("{i}:{}:{}", cells.pos(i), ids.join(".")));
    }
    let tails: Vec<String> = (0..cells.len())
        .map(|i| cells.tail(i).to_string())
        .collect();
    Recurrent {
        size: u64::from(cache.size()),
        head: u64::from(cache.head()),
        used: u64::from(cells.used),
        cells: out.join(" "),
        tails: tails.join(","),
    }
}

/// A stream's non-empty cells as the driver prints them.
fn stream_cells(cache: &SeedCache, n_seq: u32) -> String {
    let cells = cache.cells();
    let mut out = Vec::new();
    for i in 0..cells.len() {
        let pos = cells.pos(i);
        if pos < 0 {
            continue;
        }
        let seqs: Vec<String> = cells
            .seqs(i)
            .iter()
            .filter(|&q| q < n_seq as usize)
            .map(|q| q.to_string())
            .collect();
        out.push(format!("{i}:{pos}:{}:{}", cells.delta(i), seqs.join(".")));
    }
    out.join(" ")
}

/// A small deterministic generator (xorshift).
pub struct Rng(u64);

impl Rng {
    /// Seeded.
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// A value in `0..n` (n > 0).
    pub fn below(&mut self, n: u32) -> u32 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        ((x >> 32) % u64::from(n.max(1))) as u32
    }
}

/// One damaged copy of `good`, as the robustness tests make them: bits flipped, cut short, a
/// field near the front (counts, headers) set to an extreme, a span zeroed, a span repeated, or
/// bytes appended.
pub fn damaged(rng: &mut Rng, good: &[u8]) -> Vec<u8> {
    let mut bad = good.to_vec();
    let n = bad.len().max(1) as u32;
    match rng.below(6) {
        0 => {
            for _ in 0..1 + rng.below(4) {
                let i = rng.below(n) as usize % bad.len().max(1);
                if let Some(b) = bad.get_mut(i) {
                    *b ^= 1 << rng.below(8);
                }
            }
        }
        1 => bad.truncate(rng.below(n) as usize),
        2 => {
            // a field near the front (counts, headers) set to an extreme
            let at = (rng.below(64) as usize * 4).min(bad.len().saturating_sub(4));
            let v = [0u32, 1, 0xffff_ffff, 0x7fff_ffff, 256, 65_536][rng.below(6) as usize];
            if bad.len() >= 4 {
                bad[at..at + 4].copy_from_slice(&v.to_le_bytes());
            }
        }
        3 => {
            let (a, b) = (rng.below(n) as usize, rng.below(n) as usize);
            let (a, b) = (a.min(b), a.max(b).min(bad.len()));
            bad[a..b].fill(0);
        }
        4 => {
            let cut = rng.below(n) as usize;
            let tail = bad.split_off(cut.min(bad.len()));
            bad.extend_from_slice(&tail[..tail.len() / 2]);
            bad.extend_from_slice(&tail);
        }
        _ => bad.extend((0..rng.below(64)).map(|k| k as u8)),
    }
    bad
}

/// The next op of a trace, given what the memory shows now (positions per sequence), for a
/// context of `cfg`. Decodes continue every sequence at its next position, as 0.1.161
/// requires; shifts only where the memory can shift; copies across streams only whole;
/// batches of one sequence for a memory with a recurrent state (`side`).
fn next_op(rng: &mut Rng, cfg: &TraceConfig, shown: &Shown, side: &OurSide, saved: bool) -> Op {
    let can_shift = side.can_shift();
    let n_seq = cfg.n_seq;
    let seq = |rng: &mut Rng| rng.below(n_seq) as i32;
    let next_pos = |s: i32| (shown.pos[s as usize].1 + 1) as i32;
    let max_pos = |s: i32| shown.pos[s as usize].1.max(0) as i32;
    let range = |rng: &mut Rng, s: i32| {
        let top = max_pos(s) + 2;
        let a = rng.below(top as u32) as i32 - 1;
        let b = if rng.below(3) == 0 {
            -1
        } else {
            a.max(0) + rng.below(8) as i32
        };
        (a, b)
    };
    match rng.below(20) {
        0..=9 => {
            let groups = if cfg.unified && n_seq > 1 && !side.equal_split() {
                1 + rng.below(3)
            } else {
                1
            };
            let per = (cfg.n_ubatch / groups).max(1);
            let mut seqs: Vec<i32> = Vec::new();
            for _ in 0..groups {
                let s = seq(rng);
                if !seqs.contains(&s) {
                    seqs.push(s);
                }
            }
            Op::Decode(
                seqs.into_iter()
                    .map(|s| (s, next_pos(s), 1 + rng.below(per)))
                    .collect(),
            )
        }
        10 | 11 => {
            let s = if rng.below(8) == 0 { -1 } else { seq(rng) };
            let (a, b) = range(rng, s.max(0));
            Op::Rm(s, a, b)
        }
        12 => {
            let (s, d) = (seq(rng), seq(rng));
            let (a, b) = if cfg.unified { range(rng, s) } else { (-1, -1) };
            Op::Cp(s, d, a, b)
        }
        13 => Op::Keep(seq(rng)),
        14 | 15 if can_shift => {
            let s = seq(rng);
            let (a, b) = range(rng, s);
            if rng.below(2) == 0 {
                Op::Add(s, a, b, rng.below(9) as i32 - 6)
            } else {
                Op::Div(s, a, b, 2 + rng.below(2) as i32)
            }
        }
        16 | 17 => Op::Save(seq(rng)),
        18 if saved => Op::Load(seq(rng)),
        19 if rng.below(4) == 0 => Op::Clear,
        _ => {
            let s = seq(rng);
            Op::Decode(vec![(s, next_pos(s), 1 + rng.below(cfg.n_ubatch))])
        }
    }
}

/// Runs `n_traces` traces of `n_ops` ops each (a `clear` between them) through one driver,
/// comparing after every op; the first difference is the error, with the trace so far.
pub fn run_traces(
    cfg: &TraceConfig,
    models: &Path,
    seed: u64,
    n_traces: u32,
    n_ops: u32,
) -> Result<TraceStats, String> {
    let mut oracle = Oracle::start(cfg, models)?;
    let mut ours = OurSide::new(cfg, models)?;
    let mut stats = TraceStats::default();
    for t in 0..n_traces {
        let mut rng = Rng::new(seed + u64::from(t));
        let mut ops: Vec<Op> = vec![Op::Clear];
        let mut shown = compare(&mut oracle, &mut ours, &Op::Clear, &ops)?;
        let mut saved = false;
        for _ in 0..n_ops {
            let op = next_op(&mut rng, cfg, &shown, &ours, saved);
            saved |= matches!(op, Op::Save(_));
            ops.push(op.clone());
            let Op::Load(s) = op else {
                shown = compare(&mut oracle, &mut ours, &op, &ops)?;
                stats.count(&op, &shown);
                continue;
            };
            let (theirs, mine) = (oracle.apply(&op)?, ours.apply(&op)?);
            if theirs.ret != 0 || mine.ret != 0 {
                check_same(&theirs, &mine, &op, &ops)?;
                shown = theirs;
                stats.loads += 1;
            } else {
                // 0.1.161 drops the sequence when a load finds no room; ours keeps it as it
                // was (a failed load changes nothing): drop it on both sides to go on
                if (&mine.parts, &mine.pos) != (&shown.parts, &shown.pos) {
                    return Err(format!(
                        "a failed load changed our cache\n{}",
                        listing(&ops)
                    ));
                }
                let rm = Op::Rm(s, -1, -1);
                ops.push(rm.clone());
                shown = compare(&mut oracle, &mut ours, &rm, &ops)?;
                stats.failed_loads += 1;
            }
        }
        stats.traces += 1;
    }
    Ok(stats)
}

/// Runs the given ops through one driver and ours, comparing after every op (a trace written
/// for what random traces cannot reach, such as a window of 8,192 positions); what both showed
/// after each op.
pub fn run_ops(cfg: &TraceConfig, models: &Path, script: &[Op]) -> Result<Vec<Shown>, String> {
    let mut oracle = Oracle::start(cfg, models)?;
    let mut ours = OurSide::new(cfg, models)?;
    let mut ops = Vec::new();
    let mut shown = Vec::new();
    for op in script {
        ops.push(op.clone());
        shown.push(compare(&mut oracle, &mut ours, op, &ops)?);
    }
    Ok(shown)
}

fn compare(oracle: &mut Oracle, ours: &mut OurSide, op: &Op, ops: &[Op]) -> Result<Shown, String> {
    let theirs = oracle
        .apply(op)
        .map_err(|e| format!("{e}\n{}", listing(ops)))?;
    let mine = ours
        .apply(op)
        .map_err(|e| format!("{e}\n{}", listing(ops)))?;
    check_same(&theirs, &mine, op, ops)?;
    Ok(theirs)
}

fn check_same(theirs: &Shown, mine: &Shown, op: &Op, ops: &[Op]) -> Result<(), String> {
    let d = diff(PEER, theirs, mine);
    if !d.is_empty() {
        return Err(format!(
            "after op {} `{}`:\n  - {}\n{}",
            ops.len() - 1,
            op.line(),
            d.join("\n  - "),
            listing(ops)
        ));
    }
    Ok(())
}

fn listing(ops: &[Op]) -> String {
    let lines: Vec<String> = ops.iter().map(Op::line).collect();
    format!("trace:\n{}", lines.join("\n"))
}

/// What the traces exercised.
#[derive(Clone, Debug, Default)]
pub struct TraceStats {
    /// Traces run.
    pub traces: u32,
    /// Ops compared.
    pub ops: u32,
    /// Decodes that found no room (on both sides).
    pub full: u32,
    /// Decodes placed.
    pub decodes: u32,
    /// Sequence loads.
    pub loads: u32,
    /// Loads that found no room (on both sides).
    pub failed_loads: u32,
}

impl TraceStats {
    fn count(&mut self, op: &Op, shown: &Shown) {
        self.ops += 1;
        match op {
            Op::Decode(_) if shown.ret == 0 => self.decodes += 1,
            Op::Decode(_) => self.full += 1,
            _ => {}
        }
    }
}
