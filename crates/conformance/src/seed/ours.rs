//! Our side: `llama_kv_cache::SeedCache` driven through llama.cpp 0.1.103's decode path.
//!
//! What the caller (llama.cpp's `llama_context`) does around the cache is emulated here:
//! `kv_self_update` before the ubatch loop, `split_simple` / `split_equal`, the head-reset
//! heuristic before every `find_slot` (0.1.103 has it inside `find_slot`, so it also runs for a
//! sequence-state restore), no head advance after a ubatch, `n` from `cell_max`, the pending
//! ranges with `restore()` on a failed decode and `commit()` on success or a sequence restore.
//! Where our public API cannot reproduce what 0.1.103 does to the cells, the op is flagged as
//! an emulation limit ([`Ours::limit`]); the generator never emits such ops.

use std::collections::{BTreeMap, HashMap};

use llama_kv_cache::{
    CacheParams, KvError, Layout, PrepareOptions, ReadOptions, RopeParams, RopeType, SeedCache,
    ShiftParams, UBatch,
};

use crate::seed::trace::{Config, Obs, Op, Tok};

/// Branch and op counters, summed over a corpus.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Coverage {
    /// Traces run.
    pub traces: u64,
    /// Ops run.
    pub ops: u64,
    /// Ops per kind.
    pub op_counts: BTreeMap<&'static str, u64>,
    /// Ubatches placed.
    pub ubatches: u64,
    /// Decodes split into several ubatches.
    pub multi_ubatch_decodes: u64,
    /// Transformer slots found after the search wrapped around to cell 0.
    pub wraparound: u64,
    /// Head-reset heuristic fired (head > used + 2 * n_tokens).
    pub head_resets: u64,
    /// Decodes that found no slot (return 1).
    pub failed_decodes: u64,
    /// Failed decodes whose ubatch was not the first (earlier ubatches rolled back).
    pub failed_later_ubatch: u64,
    /// `restore()` calls that cleared cells of an earlier failed decode again (stale ranges).
    pub stale_restores: u64,
    /// Sequence restores that found no contiguous block.
    pub failed_seq_restores: u64,
    /// K-shifts applied.
    pub kshifts: u64,
    /// Defrags that moved cells.
    pub defrags: u64,
    /// Defrags stopped by the move cap with holes left below `used`.
    pub defrag_cap_hits: u64,
    /// Defrags scheduled by `defrag_thold` after a decode.
    pub auto_defrags: u64,
    /// Recurrent: sequences whose shared tail was copied into a new cell.
    pub tail_copies: u64,
    /// Recurrent: ubatches whose cells were swapped into place.
    pub gathers: u64,
    /// Recurrent: seq ids that left their old tail because a token made them shared.
    pub shared_tail_cleanups: u64,
    /// Sequence states restored (set after get).
    pub seq_roundtrips: u64,
    /// Whole states restored.
    pub whole_roundtrips: u64,
    /// K/V rows compared byte for byte.
    pub kv_rows_compared: u64,
    /// Candidate ops the generator dropped, by reason.
    pub dropped: BTreeMap<&'static str, u64>,
}

impl Coverage {
    /// Adds `other` into `self`.
    pub fn merge(&mut self, o: &Coverage) {
        self.traces += o.traces;
        self.ops += o.ops;
        for (k, v) in &o.op_counts {
            *self.op_counts.entry(k).or_default() += v;
        }
        self.ubatches += o.ubatches;
        self.multi_ubatch_decodes += o.multi_ubatch_decodes;
        self.wraparound += o.wraparound;
        self.head_resets += o.head_resets;
        self.failed_decodes += o.failed_decodes;
        self.failed_later_ubatch += o.failed_later_ubatch;
        self.stale_restores += o.stale_restores;
        self.failed_seq_restores += o.failed_seq_restores;
        self.kshifts += o.kshifts;
        self.defrags += o.defrags;
        self.defrag_cap_hits += o.defrag_cap_hits;
        self.auto_defrags += o.auto_defrags;
        self.tail_copies += o.tail_copies;
        self.gathers += o.gathers;
        self.shared_tail_cleanups += o.shared_tail_cleanups;
        self.seq_roundtrips += o.seq_roundtrips;
        self.whole_roundtrips += o.whole_roundtrips;
        self.kv_rows_compared += o.kv_rows_compared;
        for (k, v) in &o.dropped {
            *self.dropped.entry(k).or_default() += v;
        }
    }
}

impl std::fmt::Display for Coverage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "traces {}, ops {}", self.traces, self.ops)?;
        let ops: Vec<String> = self
            .op_counts
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        writeln!(f, "  ops: {}", ops.join(", "))?;
        writeln!(
            f,
            "  placement: ubatches {}, multi-ubatch decodes {}, wrap-arounds {}, head resets {}, failed decodes {} (later ubatch {}, stale-range restores {}), failed seq restores {}",
            self.ubatches,
            self.multi_ubatch_decodes,
            self.wraparound,
            self.head_resets,
            self.failed_decodes,
            self.failed_later_ubatch,
            self.stale_restores,
            self.failed_seq_restores
        )?;
        writeln!(
            f,
            "  update: K-shifts {}, defrags {} (cap hit {}, scheduled by threshold {})",
            self.kshifts, self.defrags, self.defrag_cap_hits, self.auto_defrags
        )?;
        writeln!(
            f,
            "  recurrent: tail copies {}, gathers {}, shared-tail clean-ups {}",
            self.tail_copies, self.gathers, self.shared_tail_cleanups
        )?;
        write!(
            f,
            "  state: seq round trips {}, whole round trips {}, K/V rows compared {}",
            self.seq_roundtrips, self.whole_roundtrips, self.kv_rows_compared
        )?;
        if !self.dropped.is_empty() {
            write!(f, "\n  generator dropped:")?;
            for (k, v) in &self.dropped {
                write!(f, "\n    {v:>6}  {k}")?;
            }
        }
        Ok(())
    }
}

/// Our cache plus the caller-side state of llama.cpp's context.
pub struct Ours {
    /// The configuration.
    pub cfg: Config,
    /// The cache under test.
    pub cache: SeedCache,
    /// 0.1.103's `pending.ranges`: cell ranges placed since the last commit.
    pub pending: Vec<(u32, u32)>,
    /// Per cell: our K rows equal llama.cpp's (data came from llama.cpp, moved with the cell).
    pub valid_k: Vec<bool>,
    /// Per cell: our V rows equal llama.cpp's.
    pub valid_v: Vec<bool>,
    /// Counters.
    pub cov: Coverage,
    /// Set when the last op could not be emulated exactly through our public API.
    pub limit: Option<String>,
    shift: Option<ShiftParams>,
    max_nodes: u32,
    slots: HashMap<u32, Vec<u8>>,
    /// Ranges of the failed decode that `pending` still holds.
    stale: usize,
}

fn cache_params(cfg: &Config, lite: bool) -> CacheParams {
    let (k, v) = if lite { (2, 2) } else { cfg.model.kv_widths() };
    // a lite cache has one layer: the defrag plan depends on the layer count only through the
    // move cap, which `Ours::max_nodes` keeps equal
    let n_layer = if lite { 1 } else { cfg.model.n_layer() };
    let mut p = CacheParams::new(cfg.kv_size(), n_layer, k, v);
    if cfg.model.recurrent() {
        p.n_embd_k_gqa = vec![0];
        p.n_embd_v_gqa = vec![0];
        p.n_embd_k_s = k;
        p.n_embd_v_s = v;
        p.recurrent = true;
    }
    p.type_k = cfg.eff_type_k();
    p.type_v = cfg.eff_type_v();
    if lite {
        p.type_k = llama_kv_cache::GgmlType::F16;
        p.type_v = llama_kv_cache::GgmlType::F16;
    }
    p.flash_attn = cfg.flash_attn;
    p.n_seq_max = cfg.n_seq_max;
    p
}

/// Splits a batch as 0.1.103's `split_simple` (transformers): `n_ubatch` tokens at a time, in
/// batch order, one group per token.
pub fn split_simple(toks: &[Tok], n_ubatch: u32) -> Vec<UBatch> {
    toks.chunks(n_ubatch as usize)
        .map(|c| {
            UBatch::per_token(
                c.iter().map(|t| t.pos).collect(),
                c.iter().map(|t| t.seqs.clone()).collect(),
            )
        })
        .collect()
}

/// Splits a batch as 0.1.103's `from_batch` + `split_equal` (recurrent models). Errors where
/// llama.cpp would assert or where its unstable sort could order ties differently.
pub fn split_equal(toks: &[Tok], n_ubatch: u32) -> Result<Vec<UBatch>, String> {
    let mut ids: Vec<usize> = (0..toks.len()).collect();
    ids.sort_by(|&a, &b| {
        let (sa, sb) = (&toks[a].seqs, &toks[b].seqs);
        if sa.len() == sb.len() {
            sa.cmp(sb).then(toks[a].pos.cmp(&toks[b].pos))
        } else {
            sb.len().cmp(&sa.len())
        }
    });
    for w in ids.windows(2) {
        if toks[w[0]].seqs == toks[w[1]].seqs && toks[w[0]].pos == toks[w[1]].pos {
            return Err(
                "two tokens with the same seq ids and position (sort order unspecified)".into(),
            );
        }
    }
    struct Group {
        seqs: Vec<i32>,
        offset: usize,
        length: usize,
    }
    let mut groups: Vec<Group> = Vec::new();
    for (i, &bi) in ids.iter().enumerate() {
        match groups.last_mut() {
            Some(g) if g.seqs == toks[bi].seqs => g.length += 1,
            _ => groups.push(Group {
                seqs: toks[bi].seqs.clone(),
                offset: i,
                length: 1,
            }),
        }
    }
    if groups.len() > 16 {
        return Err("more than 16 groups: std::sort is not stable there".into());
    }
    // std::sort with <= 16 elements is an insertion sort, hence stable
    groups.sort_by(|a, b| {
        if a.seqs.len() == b.seqs.len() {
            b.length.cmp(&a.length)
        } else {
            a.seqs.len().cmp(&b.seqs.len())
        }
    });
    let mut remaining = toks.len();
    let mut out = Vec::new();
    while remaining > 0 {
        while groups.last().is_some_and(|g| g.length == 0) {
            groups.pop();
        }
        let nub = remaining.min(n_ubatch as usize);
        let (mut length, mut in_ub) = (0usize, 0usize);
        let (mut pos, mut seq_ids) = (Vec::new(), Vec::new());
        for g in groups.iter_mut().rev() {
            if g.length == 0 {
                return Err("GGML_ASSERT(s.length > 0) in split_equal".into());
            }
            if length == 0 {
                length = g.length.min(nub);
            }
            if length > g.length {
                return Err("GGML_ASSERT(length <= seq.length) in add_seq_to_ubatch".into());
            }
            pos.extend((0..length).map(|k| toks[ids[g.offset + k]].pos));
            seq_ids.push(g.seqs.clone());
            g.offset += length;
            g.length -= length;
            remaining -= length;
            in_ub += length;
            if g.seqs.len() > 1 || length + in_ub > nub {
                break;
            }
        }
        out.push(UBatch {
            pos,
            n_seq_tokens: length as u32,
            seq_ids,
            ext: Vec::new(),
        });
    }
    Ok(out)
}

impl Ours {
    /// A fresh context.
    pub fn new(cfg: &Config) -> Result<Ours, String> {
        Ours::with_tensors(cfg, false)
    }

    /// A fresh context for simulation only: the cell metadata is exact, the K/V tensors are 2
    /// values wide (state blobs then differ from llama.cpp's in their data, never in their cells).
    pub fn lite(cfg: &Config) -> Result<Ours, String> {
        Ours::with_tensors(cfg, true)
    }

    fn with_tensors(cfg: &Config, lite: bool) -> Result<Ours, String> {
        let cache = SeedCache::new(cache_params(cfg, lite)).map_err(|e| e.to_string())?;
        let size = cfg.kv_size() as usize;
        let (dim, heads) = if lite {
            (2, 1)
        } else {
            (cfg.model.head_dim(), cfg.model.n_head_kv())
        };
        let shift = (!cfg.model.recurrent()).then(|| ShiftParams {
            rope: RopeParams::new(dim, dim, heads, RopeType::Norm),
            per_layer: Vec::new(),
        });
        let max_nodes = if lite {
            // (max_nodes - 2) / 6 == the model's (max_nodes - 2 n_layer) / (6 n_layer)
            6 * cfg.max_moves() + 2
        } else {
            cfg.max_nodes()
        };
        Ok(Ours {
            cfg: cfg.clone(),
            cache,
            max_nodes,
            pending: Vec::new(),
            valid_k: vec![true; size],
            valid_v: vec![true; size],
            cov: Coverage::default(),
            limit: None,
            shift,
            slots: HashMap::new(),
            stale: 0,
        })
    }

    /// A copy for dry runs (tensors retyped to the same types: data is not compared there).
    pub fn fork(&self) -> Result<Ours, String> {
        let cache = self
            .cache
            .retyped(self.cache.type_k(), self.cache.type_v())
            .map_err(|e| e.to_string())?;
        Ok(Ours {
            cfg: self.cfg.clone(),
            cache,
            pending: self.pending.clone(),
            valid_k: self.valid_k.clone(),
            valid_v: self.valid_v.clone(),
            cov: Coverage::default(),
            limit: None,
            shift: self.shift.clone(),
            max_nodes: self.max_nodes,
            slots: self.slots.clone(),
            stale: self.stale,
        })
    }

    /// The stored blob of a slot.
    pub fn slot(&self, slot: u32) -> Option<&Vec<u8>> {
        self.slots.get(&slot)
    }

    /// Applies `op`. `theirs` is llama.cpp's answer to the same op when running against the
    /// oracle: state reads then keep llama.cpp's blob for later restores, so that our reader
    /// loads real llama.cpp bytes. Errors are failures of our API where llama.cpp succeeded.
    pub fn apply(&mut self, op: &Op, theirs: Option<&Obs>) -> Result<Obs, String> {
        self.limit = None;
        self.cov.ops += 1;
        *self.cov.op_counts.entry(op.name()).or_default() += 1;
        let e = |x: KvError| x.to_string();
        let mut blob = None;
        let ret: i64 = match op {
            Op::Decode(toks) => self.decode(toks)? as i64,
            Op::SeqRm(s, p0, p1) => self.cache.seq_rm(*s, *p0, *p1).map_err(e)? as i64,
            Op::SeqCp(a, b, p0, p1) => {
                self.cache.seq_cp(*a, *b, *p0, *p1).map_err(e)?;
                0
            }
            Op::SeqKeep(s) => {
                self.cache.seq_keep(*s).map_err(e)?;
                0
            }
            Op::SeqAdd(s, p0, p1, d) => {
                self.cache.seq_add(*s, *p0, *p1, *d).map_err(e)?;
                0
            }
            Op::SeqDiv(s, p0, p1, d) => {
                self.cache.seq_div(*s, *p0, *p1, *d).map_err(e)?;
                0
            }
            Op::Update => {
                self.kv_self_update()?;
                0
            }
            Op::Defrag => {
                self.cache.defrag();
                0
            }
            Op::Clear => {
                self.cache.clear().map_err(e)?;
                self.valid_k.fill(true);
                self.valid_v.fill(true);
                0
            }
            Op::SeqGet { seq, slot } => {
                let b = self
                    .cache
                    .state_write(*seq, Layout::Seed, 1, None)
                    .map_err(e)?;
                let keep = theirs.and_then(|t| t.blob.clone()).unwrap_or(b.clone());
                self.slots.insert(*slot, keep);
                let n = b.len() as i64;
                blob = Some(b);
                n
            }
            Op::StateGet { slot } => {
                let b = self
                    .cache
                    .state_write(-1, Layout::Seed, 1, None)
                    .map_err(e)?;
                let keep = theirs.and_then(|t| t.blob.clone()).unwrap_or(b.clone());
                self.slots.insert(*slot, keep);
                let n = b.len() as i64;
                blob = Some(b);
                n
            }
            Op::SeqSet { slot, dst } => self.seq_set(*slot, *dst)?,
            Op::StateSet { slot } => {
                let data = self.slots.get(slot).cloned().unwrap_or_default();
                let opts = ReadOptions {
                    layout: Some(Layout::Seed),
                    allow_scattered: false,
                    part: None,
                    partial: false,
                };
                self.cache.state_read(&data, -1, opts, None).map_err(e)?;
                // 0.1.103 does not commit here: stale pending ranges survive a whole restore
                self.valid_k.fill(true);
                self.valid_v.fill(true);
                self.cov.whole_roundtrips += 1;
                data.len() as i64
            }
        };
        let mut obs = self.observe();
        obs.ret = ret;
        obs.blob = blob;
        Ok(obs)
    }

    /// What the public API shows now (ret and blob left empty).
    pub fn observe(&self) -> Obs {
        let c = &self.cache;
        let n_seq = self.cfg.n_seq_max as i32;
        let view = c.view(n_seq as usize);
        Obs {
            ret: 0,
            n_tokens: c.n_tokens() as i64,
            used: c.used_cells() as i64,
            pos_max: (0..n_seq)
                .map(|s| c.seq_pos_max(s).unwrap_or(i32::MIN))
                .collect(),
            view_used: view.used_cells as i64,
            token_count: view.token_count as i64,
            max_contig: view.max_contiguous as i64,
            max_contig_idx: view.max_contiguous_idx as i64,
            pos: view.pos,
            seqs: view.seqs,
            blob: None,
        }
    }

    /// `llama_context::kv_self_update`: pending K-shift, then pending defrag.
    fn kv_self_update(&mut self) -> Result<(), String> {
        let had_shift = self.cache.has_shift();
        let deltas: Vec<i32> = self.cache.cells().delta_column().to_vec();
        let report = self
            .cache
            .update(self.shift.as_ref(), Some(self.max_nodes))
            .map_err(|e| e.to_string())?;
        if had_shift {
            self.cov.kshifts += 1;
            let quantized = self.cache.type_k().is_quantized();
            for (i, d) in deltas.iter().enumerate() {
                // both sides rotate; bit-equal results are not claimed
                if *d != 0 || quantized {
                    self.valid_k[i] = false;
                }
            }
        }
        if let Some(d) = report.defrag {
            if !d.moves.is_empty() {
                self.cov.defrags += 1;
                for m in &d.moves {
                    for k in 0..m.len as usize {
                        let (s, t) = (m.src as usize + k, m.dst as usize + k);
                        self.valid_k[t] = self.valid_k[s];
                        self.valid_v[t] = self.valid_v[s];
                    }
                }
                let used = self.cache.used_cells() as usize;
                let cells = self.cache.cells();
                if (0..used.min(cells.len())).any(|i| cells.is_empty_cell(i)) {
                    self.cov.defrag_cap_hits += 1;
                }
            }
        }
        Ok(())
    }

    /// `llama_context::decode`.
    fn decode(&mut self, toks: &[Tok]) -> Result<i32, String> {
        if toks.is_empty() {
            return Ok(-1);
        }
        if toks.len() as u32 > self.cfg.eff_n_batch() {
            return Err(format!(
                "batch of {} tokens > n_batch {}: llama.cpp aborts",
                toks.len(),
                self.cfg.eff_n_batch()
            ));
        }
        self.kv_self_update()?;
        let recurrent = self.cfg.model.recurrent();
        let ubatches = if recurrent {
            split_equal(toks, self.cfg.eff_n_ubatch())?
        } else {
            split_simple(toks, self.cfg.eff_n_ubatch())
        };
        if ubatches.len() > 1 {
            self.cov.multi_ubatch_decodes += 1;
        }
        for (k, ub) in ubatches.iter().enumerate() {
            let n_tokens = ub.n_tokens();
            if self.cache.head() > self.cache.used_cells() + 2 * n_tokens {
                self.cov.head_resets += 1;
            }
            let start = if self.cache.head() > self.cache.used_cells() + 2 * n_tokens {
                0
            } else {
                self.cache.head()
            };
            let pre_tails: Vec<(i32, bool)> = if recurrent {
                self.recurrent_pre(ub)
            } else {
                Vec::new()
            };
            let slot = self
                .cache
                .prepare_batch(
                    ub,
                    PrepareOptions {
                        advance_head: false,
                    },
                )
                .map_err(|e| e.to_string())?;
            let Some(slot) = slot else {
                if recurrent {
                    // our find_slot fails only where llama.cpp asserts or overruns the cells
                    return Err(format!(
                        "recurrent find_slot failed for ubatch {k}: llama.cpp 0.1.103 would crash here"
                    ));
                }
                self.cov.failed_decodes += 1;
                if k > 0 {
                    self.cov.failed_later_ubatch += 1;
                }
                self.restore()?;
                return Ok(1);
            };
            self.cov.ubatches += 1;
            if recurrent {
                for (s, &(tail, owned)) in pre_tails.iter().enumerate() {
                    if tail >= 0 && !owned {
                        self.cov.tail_copies += 1;
                    }
                    if owned && tail != (slot.head + s as u32) as i32 {
                        self.cov.gathers += 1;
                        break;
                    }
                }
                // states are computed in place and copied between cells: data no longer known
                self.valid_k.fill(false);
                self.valid_v.fill(false);
            } else {
                if slot.head < start {
                    self.cov.wraparound += 1;
                }
                self.pending.push((slot.head, slot.head + slot.len));
                for i in slot.head..slot.head + slot.len {
                    self.valid_k[i as usize] = false;
                    self.valid_v[i as usize] = false;
                }
            }
        }
        // commit()
        self.pending.clear();
        self.stale = 0;
        if self.cfg.defrag_thold > 0.0 && self.cache.schedule_defrag(self.cfg.defrag_thold) {
            self.cov.auto_defrags += 1;
        }
        Ok(0)
    }

    fn recurrent_pre(&mut self, ub: &UBatch) -> Vec<(i32, bool)> {
        let cells = self.cache.cells();
        for ids in &ub.seq_ids {
            for &id in &ids[1..] {
                if cells.tail(id as usize) >= 0 {
                    self.cov.shared_tail_cleanups += 1;
                }
            }
        }
        ub.seq_ids
            .iter()
            .map(|ids| {
                let tail = cells.tail(ids[0] as usize);
                let owned = tail >= 0 && cells.seqs(tail as usize).len() == 1;
                (tail, owned)
            })
            .collect()
    }

    /// Whether `restore()` of the current pending ranges can be reproduced with `seq_rm`:
    /// every (seq, pos) of a cell to clear must be unique to cells being cleared, and the first
    /// cleared non-empty cell must be the lowest range start (or not below head).
    pub fn restore_limit(&self) -> Option<String> {
        let cells = self.cache.cells();
        let size = cells.len();
        let mut clear = vec![false; size];
        for &(c0, c1) in &self.pending {
            for i in c0..c1 {
                clear[i as usize] = true;
            }
        }
        for i in (0..size).filter(|&i| clear[i] && !cells.is_empty_cell(i)) {
            let p = cells.pos(i);
            if p < 0 {
                return Some(format!("cell {i} has sequences but no position"));
            }
            for (j, &cleared) in clear.iter().enumerate() {
                if !cleared && cells.pos(j) == p && cells.seqs(j).intersects(cells.seqs(i)) {
                    return Some(format!(
                        "cell {j} shares (seq, pos {p}) with cell {i} being restored"
                    ));
                }
            }
        }
        let head = self.cache.head();
        let true_head = self
            .pending
            .iter()
            .map(|r| r.0)
            .min()
            .map_or(head, |c| c.min(head));
        let freed = (0..size).find(|&i| clear[i] && !cells.is_empty_cell(i));
        let emulated = freed.map_or(head, |i| (i as u32).min(head));
        if true_head != emulated {
            return Some(format!(
                "restore() sets head {true_head}; clearing the cells with seq_rm would give {emulated}"
            ));
        }
        None
    }

    /// 0.1.103's `restore()`: empties every cell of every pending range; pending stays.
    fn restore(&mut self) -> Result<(), String> {
        if self.stale > 0 {
            self.cov.stale_restores += 1;
        }
        if let Some(why) = self.restore_limit() {
            self.limit = Some(why);
        }
        let cells = self.cache.cells().clone();
        let mut targets: Vec<(i32, i32)> = Vec::new();
        for &(c0, c1) in &self.pending {
            for i in c0 as usize..c1 as usize {
                let p = cells.pos(i);
                for s in cells.seqs(i).iter() {
                    if p >= 0 {
                        targets.push((s as i32, p));
                    }
                }
            }
        }
        for (s, p) in targets {
            self.cache.seq_rm(s, p, p + 1).map_err(|e| e.to_string())?;
        }
        self.stale = self.pending.len();
        Ok(())
    }

    /// Moves our head to 0 without touching any cell (a `seq_add` that matches nothing).
    fn reset_head(&mut self) -> Result<(), String> {
        self.cache
            .seq_add(0, i32::MAX - 1, i32::MAX, 1)
            .map_err(|e| e.to_string())
    }

    /// `llama_state_seq_set_data` as 0.1.103 runs it: `seq_rm(dst)`, the head heuristic inside
    /// `find_slot`, one contiguous block, `commit()`; on failure `seq_rm(dst)` and 0.
    fn seq_set(&mut self, slot: u32, dst: i32) -> Result<i64, String> {
        let data = self.slots.get(&slot).cloned().unwrap_or_default();
        if data.len() < 4 {
            return Err("seq_set from an empty slot".into());
        }
        let cell_count = u32::from_le_bytes([data[0], data[1], data[2], data[3]]);
        self.cache.seq_rm(dst, -1, -1).map_err(|e| e.to_string())?;
        let head = self.cache.head();
        let reset = head > self.cache.used_cells() + 2 * cell_count;
        if reset {
            if self.cfg.model.recurrent() {
                // no public op moves a recurrent head without placing: only equal outcomes pass
                let cells = self.cache.cells();
                let size = cells.len();
                let from = |h: usize| {
                    (0..size)
                        .map(|k| (h + k) % size)
                        .find(|&i| cells.is_empty_cell(i))
                };
                if from(head as usize) != from(0) {
                    self.limit = Some("recurrent seq restore after a head reset".into());
                }
            } else {
                self.reset_head()?;
            }
        }
        let opts = ReadOptions {
            layout: Some(Layout::Seed),
            allow_scattered: false,
            part: None,
            partial: false,
        };
        match self.cache.state_read(&data, dst, opts, None) {
            Ok(summary) => {
                self.pending.clear();
                self.stale = 0;
                for &c in &summary.placed {
                    self.valid_k[c as usize] = true;
                    self.valid_v[c as usize] = true;
                }
                self.cov.seq_roundtrips += 1;
                Ok(data.len() as i64)
            }
            Err(KvError::NoSpace(_)) if !self.cfg.model.recurrent() => {
                // llama.cpp's failed scan leaves head where it stopped: run the same scan
                let ub = UBatch {
                    pos: vec![0; cell_count as usize],
                    n_seq_tokens: cell_count,
                    seq_ids: vec![vec![dst]],
                    ext: Vec::new(),
                };
                if self
                    .cache
                    .find_slot(&ub)
                    .map_err(|e| e.to_string())?
                    .is_some()
                {
                    return Err(
                        "the repeated slot search succeeded after the restore failed".into(),
                    );
                }
                self.cov.failed_seq_restores += 1;
                Ok(0)
            }
            Err(e) => Err(e.to_string()),
        }
    }
}
