//! Seeded generator of realistic traces.
//!
//! Each trace picks a scenario (server slots with continuous batching and context shift,
//! shared prompts, fragmentation and defrag, self-extend, speculative rollback, state round
//! trips, near-full caches, mixed, recurrent) and a configuration, then emits ops one at a time
//! while simulating them on our cache ([`Ours`]). Every candidate op is first dry-run on a copy:
//! ops that would crash llama.cpp 0.1.103 (see `/work/shared/reference/llama-decode-path.md`),
//! ops our public API cannot drive exactly like 0.1.103 ([`Ours::limit`]) and ops that hit a
//! documented divergence (DIVERGENCES.md) are dropped. The same seed always gives the same trace.

use llama_kv_cache::GgmlType;

use crate::seed::model::{ModelKind, N_VOCAB};
use crate::seed::ours::Ours;
use crate::seed::trace::{Config, Op, Tok, Trace};

/// splitmix64.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x5DEE_CE66_D1CE_4E5B)
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, n)` (0 when n is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next_u64() % n
        }
    }

    /// Uniform in `[a, b]`.
    pub fn range(&mut self, a: i64, b: i64) -> i64 {
        if b <= a {
            a
        } else {
            a + self.below((b - a + 1) as u64) as i64
        }
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 > 1.0 - p
    }

    /// One element.
    pub fn pick<T: Clone>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len() as u64) as usize].clone()
    }

    /// Shuffles in place.
    pub fn shuffle<T>(&mut self, xs: &mut [T]) {
        for i in (1..xs.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            xs.swap(i, j);
        }
    }
}

/// Scenarios, each with its own configuration ranges and op mix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scenario {
    /// llama-server-style slots: continuous batching, prompt chunks, context shift, reuse.
    Server,
    /// A prompt shared through `seq_cp` or through tokens owned by several sequences.
    SharedPrompt,
    /// Interleaved sequences, holes, defrag (with the 64-layer model: the move cap).
    Fragment,
    /// Self-extend: `seq_add` / `seq_div` / `seq_add` groups.
    SelfExtend,
    /// Speculative decoding: draft tokens, rollback with `seq_rm`.
    Speculative,
    /// Sequence and whole-cache state round trips.
    State,
    /// Small caches filled until placement fails.
    NearFull,
    /// Everything at random, all transformer configurations.
    Mixed,
    /// Mamba: equal-length splits, tails, copies, gathers.
    Recurrent,
}

impl Scenario {
    /// Every scenario, in the order seeds cycle through them.
    pub const ALL: [Scenario; 9] = [
        Scenario::Server,
        Scenario::SharedPrompt,
        Scenario::Fragment,
        Scenario::SelfExtend,
        Scenario::Speculative,
        Scenario::State,
        Scenario::NearFull,
        Scenario::Mixed,
        Scenario::Recurrent,
    ];

    /// Name.
    pub fn name(self) -> &'static str {
        match self {
            Scenario::Server => "server",
            Scenario::SharedPrompt => "shared-prompt",
            Scenario::Fragment => "fragment",
            Scenario::SelfExtend => "self-extend",
            Scenario::Speculative => "speculative",
            Scenario::State => "state",
            Scenario::NearFull => "near-full",
            Scenario::Mixed => "mixed",
            Scenario::Recurrent => "recurrent",
        }
    }
}

/// Generation options.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GenOptions {
    /// Also emit ops that hit the divergences listed in DIVERGENCES.md (they fail by design).
    pub known_divergences: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SlotState {
    Idle,
    Prompt(u32),
    Gen(u32),
}

struct Gen {
    rng: Rng,
    cfg: Config,
    sim: Ours,
    ops: Vec<Op>,
    opts: GenOptions,
    /// State buffers written so far: (slot, seq or -1).
    blobs: Vec<(u32, i32)>,
    next_slot: u32,
    server: Vec<SlotState>,
    dropped: std::collections::BTreeMap<&'static str, u64>,
}

fn config_for(s: Scenario, rng: &mut Rng) -> Config {
    let mut c = Config::llama_h16(64, 1, 64, 64);
    c.n_ubatch = rng.pick(&[4, 8, 16, 32, 64, 512]);
    c.n_batch = rng.pick(&[64, 128, 256, 512]);
    match s {
        Scenario::Server => {
            c.n_ctx = rng.pick(&[64, 96, 128, 160, 256]);
            c.n_seq_max = rng.range(2, 4) as u32;
        }
        Scenario::SharedPrompt => {
            c.n_ctx = rng.pick(&[64, 128, 256]);
            c.n_seq_max = rng.range(2, 6) as u32;
        }
        Scenario::Fragment => {
            if rng.chance(0.25) {
                c.model = ModelKind::LlamaL64;
                c.n_ctx = rng.pick(&[1024, 2048, 2304]);
                c.n_batch = 512;
                c.n_ubatch = rng.pick(&[64, 256, 512]);
                if c.n_ctx >= 2048 && rng.chance(0.5) {
                    c.defrag_thold = 0.1;
                }
            } else {
                c.n_ctx = rng.pick(&[64, 128, 192, 256]);
            }
            c.n_seq_max = rng.range(2, 4) as u32;
        }
        Scenario::SelfExtend => {
            c.n_ctx = rng.pick(&[64, 128, 256]);
            c.n_seq_max = rng.range(1, 2) as u32;
        }
        Scenario::Speculative => {
            c.n_ctx = rng.pick(&[64, 128, 256]);
            c.n_seq_max = rng.range(1, 3) as u32;
        }
        Scenario::State => {
            c.n_ctx = rng.pick(&[32, 64, 128, 256]);
            c.n_seq_max = rng.range(1, 4) as u32;
            if rng.chance(0.3) {
                c.flash_attn = true;
                c.n_ctx = 256;
            }
        }
        Scenario::NearFull => {
            c.n_ctx = rng.pick(&[32, 40, 64, 96]);
            c.n_seq_max = rng.range(1, 4) as u32;
            c.n_ubatch = rng.pick(&[4, 8, 16, 32, 64]);
        }
        Scenario::Mixed => {
            c.n_seq_max = rng.range(1, 6) as u32;
            match rng.below(4) {
                0 => {
                    c.flash_attn = true;
                    c.n_ctx = rng.pick(&[256, 512]);
                }
                1 => {
                    c.model = ModelKind::LlamaH32;
                    c.flash_attn = true;
                    c.n_ctx = 256;
                    let ty = [
                        GgmlType::F16,
                        GgmlType::Q8_0,
                        GgmlType::Q4_0,
                        GgmlType::Q5_1,
                    ];
                    c.type_k = rng.pick(&ty);
                    c.type_v = rng.pick(&ty);
                }
                _ => c.n_ctx = rng.pick(&[32, 64, 96, 128, 256]),
            }
        }
        Scenario::Recurrent => {
            c.model = ModelKind::Mamba;
            c.n_ctx = 256;
            c.n_seq_max = rng.range(1, 6) as u32;
            c.type_k = GgmlType::F32;
            c.type_v = GgmlType::F32;
            c.n_ubatch = rng.pick(&[1, 2, 4, 8, 16, 64]);
        }
    }
    c
}

/// Generates the trace of `seed`.
pub fn generate(seed: u64, opts: GenOptions) -> Trace {
    let mut rng = Rng::new(seed);
    let scenario = Scenario::ALL[(seed % Scenario::ALL.len() as u64) as usize];
    let cfg = config_for(scenario, &mut rng);
    let sim = Ours::lite(&cfg).expect("generator configurations are valid");
    let mut g = Gen {
        rng,
        server: vec![SlotState::Idle; cfg.n_seq_max as usize],
        cfg,
        sim,
        ops: Vec::new(),
        opts,
        blobs: Vec::new(),
        next_slot: 0,
        dropped: Default::default(),
    };
    let target = match scenario {
        Scenario::Fragment if g.cfg.model == ModelKind::LlamaL64 => g.rng.range(20, 40),
        _ => g.rng.range(30, 110),
    } as usize;
    let mut idle = 0;
    while g.ops.len() < target && idle < 40 {
        let before = g.ops.len();
        match scenario {
            Scenario::Server => g.server_step(),
            Scenario::SharedPrompt => g.shared_step(),
            Scenario::Fragment => g.fragment_step(),
            Scenario::SelfExtend => g.self_extend_step(),
            Scenario::Speculative => g.speculative_step(),
            Scenario::State => g.state_step(),
            Scenario::NearFull => g.near_full_step(),
            Scenario::Mixed => g.mixed_step(),
            Scenario::Recurrent => g.recurrent_step(),
        }
        idle = if g.ops.len() == before { idle + 1 } else { 0 };
    }
    Trace {
        seed,
        scenario: scenario.name(),
        config: g.cfg,
        ops: g.ops,
        dropped: g.dropped,
    }
}

impl Gen {
    fn n_seq(&self) -> i32 {
        self.cfg.n_seq_max as i32
    }

    fn active(&self, s: i32) -> bool {
        self.sim.cache.seq_cell_count(s).unwrap_or(0) > 0
    }

    fn next_pos(&self, s: i32) -> i32 {
        if self.active(s) {
            self.sim.cache.seq_pos_max(s).unwrap_or(0) + 1
        } else {
            0
        }
    }

    fn token(&mut self) -> i32 {
        259 + self.rng.below(N_VOCAB as u64 - 259) as i32
    }

    fn rand_seq(&mut self) -> i32 {
        self.rng.below(self.cfg.n_seq_max as u64) as i32
    }

    fn active_seqs(&self) -> Vec<i32> {
        (0..self.n_seq()).filter(|&s| self.active(s)).collect()
    }

    fn n_batch(&self) -> usize {
        self.cfg.eff_n_batch() as usize
    }

    /// Dry-runs `op`; applies and records it when llama.cpp survives it and we can follow.
    fn push(&mut self, op: Op) -> Option<i64> {
        if let Err(why) = self.admissible(&op) {
            *self.dropped.entry(why).or_default() += 1;
            return None;
        }
        match self.sim.apply(&op, None) {
            Ok(obs) if self.sim.limit.is_none() => {
                match &op {
                    Op::SeqGet { seq, slot } => self.blobs.push((*slot, *seq)),
                    Op::StateGet { slot } => self.blobs.push((*slot, -1)),
                    _ => {}
                }
                self.ops.push(op);
                Some(obs.ret)
            }
            _ => None,
        }
    }

    /// Why `op` must not be emitted now, if it must not.
    fn admissible(&self, op: &Op) -> Result<(), &'static str> {
        let recurrent = self.cfg.model.recurrent();
        let known = self.opts.known_divergences;
        let cache = &self.sim.cache;
        match op {
            Op::Decode(t) if t.is_empty() || t.len() > self.n_batch() => {
                return Err("batch larger than n_batch (GGML_ASSERT)")
            }
            Op::SeqDiv(_, _, _, d) if *d <= 0 => return Err("seq_div with d <= 0 (crash)"),
            Op::SeqSet { slot, dst } => {
                let Some(blob) = self.sim.slot(*slot) else {
                    return Err("restore from an unused buffer");
                };
                if blob.len() < 4 || blob[..4] == [0, 0, 0, 0] {
                    return Err("0-cell sequence restore (crash 1: SIGSEGV)");
                }
                if recurrent && self.active(*dst) && !known {
                    return Err("recurrent restore into a live sequence (divergence D3)");
                }
            }
            // llama.cpp 0.1.103 can abort saving the whole state of an emptied context:
            // GGML_ASSERT(n_outputs == out_ids.size()) in llama-context.cpp:1551 (its outputs
            // bookkeeping, not the cache); one-sequence states of empty sequences are generated
            Op::StateGet { .. } if cache.n_tokens() == 0 => {
                return Err("whole state of an empty context (crash 6: outputs assert)")
            }
            _ => {}
        }
        if !recurrent && matches!(op, Op::Update | Op::Decode(_)) {
            let had_shift = cache.has_shift();
            if had_shift || cache.defrag_pending() {
                let mut f = self.sim.fork().map_err(|_| "fork failed")?;
                f.apply(&Op::Update, None)
                    .map_err(|_| "update refused by our cache")?;
                let moved = f.cov.defrags > 0;
                if (had_shift || moved)
                    && f.cache.head() + self.cfg.reserve_tokens() > self.cfg.kv_size()
                {
                    return Err("K-shift/defrag then reserve past the cache end (crash 2)");
                }
            }
        }
        let mut f = self.sim.fork().map_err(|_| "fork failed")?;
        let before = f.observe();
        let after = f
            .apply(op, None)
            .map_err(|_| "our cache refuses it (recurrent crash 3/4 or split_equal assert)")?;
        if f.limit.is_some() {
            return Err("restore() not reproducible through the public API (emulation limit)");
        }
        if recurrent {
            match op {
                Op::SeqRm(..)
                    if !known && (before.pos != after.pos || before.seqs != after.seqs) =>
                {
                    return Err("recurrent seq_rm that frees a cell (divergence D2)")
                }
                Op::SeqAdd(..) | Op::SeqDiv(..)
                    if after
                        .pos
                        .iter()
                        .zip(&after.seqs)
                        .any(|(p, s)| *p < 0 && !s.is_empty()) =>
                {
                    return Err("negative recurrent position")
                }
                _ => {}
            }
        }
        Ok(())
    }

    // ---- op builders -------------------------------------------------------------------

    fn gen_batch(&mut self, seqs: &[i32]) -> Vec<Tok> {
        seqs.iter()
            .map(|&s| Tok {
                token: self.token(),
                pos: self.next_pos(s),
                seqs: vec![s],
            })
            .collect()
    }

    fn prompt(&mut self, s: i32, n: usize) -> Vec<Tok> {
        let p0 = self.next_pos(s);
        (0..n as i32)
            .map(|k| Tok {
                token: self.token(),
                pos: p0 + k,
                seqs: vec![s],
            })
            .collect()
    }

    fn batch_len(&mut self) -> usize {
        let nb = self.n_batch();
        let nub = self.cfg.eff_n_ubatch() as usize;
        match self.rng.below(4) {
            0 => 1,
            1 => self.rng.range(2, nub.max(2) as i64) as usize,
            2 => self.rng.range(nub as i64, (2 * nub).min(nb) as i64) as usize,
            _ => self.rng.range(1, nb as i64) as usize,
        }
        .clamp(1, nb)
    }

    fn decode(&mut self, toks: Vec<Tok>) -> Option<i64> {
        self.push(Op::Decode(toks))
    }

    fn decode_prompt(&mut self, s: i32) -> Option<i64> {
        let n = self.batch_len();
        let t = self.prompt(s, n);
        self.decode(t)
    }

    /// One token for each active sequence (or a random one), in a shuffled order.
    fn decode_step(&mut self) -> Option<i64> {
        let mut seqs = self.active_seqs();
        if seqs.is_empty() {
            seqs.push(self.rand_seq());
        }
        self.rng.shuffle(&mut seqs);
        let k = self.rng.range(1, seqs.len() as i64) as usize;
        let t = self.gen_batch(&seqs[..k]);
        self.decode(t)
    }

    /// Prompt chunk for one sequence plus one token for others, interleaved at random.
    fn decode_mixed(&mut self) -> Option<i64> {
        let s = self.rand_seq();
        let n = self.batch_len().min(self.n_batch() - 1).max(1);
        let mut t = self.prompt(s, n);
        let others: Vec<i32> = self.active_seqs().into_iter().filter(|&x| x != s).collect();
        let mut g = self.gen_batch(&others);
        if self.rng.chance(0.5) {
            t.append(&mut g);
        } else {
            g.append(&mut t);
            t = g;
        }
        t.truncate(self.n_batch());
        self.decode(t)
    }

    /// A prompt whose tokens belong to several sequences at once (all starting at 0).
    fn decode_shared(&mut self) -> Option<i64> {
        let mut seqs: Vec<i32> = (0..self.n_seq()).filter(|&s| !self.active(s)).collect();
        if seqs.len() < 2 {
            seqs = (0..self.n_seq()).collect();
        }
        self.rng.shuffle(&mut seqs);
        let k = self.rng.range(2.min(seqs.len() as i64), seqs.len() as i64) as usize;
        let ids = seqs[..k].to_vec();
        let p0 = ids.iter().map(|&s| self.next_pos(s)).max().unwrap_or(0);
        let n = self.batch_len();
        let t = (0..n as i32)
            .map(|i| Tok {
                token: self.token(),
                pos: p0 + i,
                seqs: ids.clone(),
            })
            .collect();
        self.decode(t)
    }

    /// Several sequences' tokens interleaved one by one (fragmentation once one is removed).
    fn decode_interleaved(&mut self) -> Option<i64> {
        let n_seq = self.n_seq();
        let mut next: Vec<i32> = (0..n_seq).map(|s| self.next_pos(s)).collect();
        let n = self.batch_len().max(n_seq as usize);
        let mut t = Vec::with_capacity(n);
        for i in 0..n {
            let s = i as i32 % n_seq;
            t.push(Tok {
                token: self.token(),
                pos: next[s as usize],
                seqs: vec![s],
            });
            next[s as usize] += 1;
        }
        t.truncate(self.n_batch());
        self.decode(t)
    }

    fn rand_range(&mut self, s: i32) -> (i32, i32) {
        let hi = self.next_pos(s) + 2;
        let p0 = if self.rng.chance(0.15) {
            -1
        } else {
            self.rng.range(0, hi as i64) as i32
        };
        let p1 = if self.rng.chance(0.3) {
            -1
        } else {
            self.rng.range(p0.max(0) as i64, hi as i64 + 2) as i32
        };
        (p0, p1)
    }

    fn seq_rm_random(&mut self) -> Option<i64> {
        let s = if self.rng.chance(0.1) {
            -1
        } else {
            self.rand_seq()
        };
        let (p0, p1) = self.rand_range(s.max(0));
        self.push(Op::SeqRm(s, p0, p1))
    }

    fn seq_add_random(&mut self) -> Option<i64> {
        let s = self.rand_seq();
        let (p0, p1) = self.rand_range(s);
        let d = self.rng.pick(&[-8, -3, -1, 1, 2, 5, 16]);
        self.push(Op::SeqAdd(s, p0, p1, d))
    }

    fn seq_div_random(&mut self) -> Option<i64> {
        let s = self.rand_seq();
        let (p0, p1) = self.rand_range(s);
        let d = self.rng.pick(&[1, 2, 3, 4]);
        self.push(Op::SeqDiv(s, p0, p1, d))
    }

    fn seq_cp_random(&mut self) -> Option<i64> {
        let a = self.rand_seq();
        let b = self.rand_seq();
        let (p0, p1) = if self.rng.chance(0.6) {
            (-1, -1)
        } else {
            self.rand_range(a)
        };
        self.push(Op::SeqCp(a, b, p0, p1))
    }

    /// llama-server's context shift: keep `n_keep + 1`, drop half of the rest.
    fn context_shift(&mut self, s: i32) {
        let n_past = self.next_pos(s);
        let n_keep = self.rng.range(0, 8).min(n_past as i64 / 4) as i32;
        let n_left = n_past - n_keep - 1;
        let n_discard = n_left / 2;
        if n_discard <= 0 {
            return;
        }
        if self
            .push(Op::SeqRm(s, n_keep + 1, n_keep + n_discard + 1))
            .is_some()
        {
            self.push(Op::SeqAdd(s, n_keep + 1 + n_discard, n_past, -n_discard));
        }
    }

    fn seq_state_get(&mut self) {
        let mut seqs = self.active_seqs();
        if seqs.is_empty() || self.opts.known_divergences && self.rng.chance(0.1) {
            seqs.push(self.rand_seq());
        }
        let s = self.rng.pick(&seqs);
        let slot = self.next_slot;
        if self.push(Op::SeqGet { seq: s, slot }).is_some() {
            self.next_slot += 1;
        }
    }

    fn seq_state_set(&mut self) {
        let seq_blobs: Vec<(u32, i32)> = self.blobs.iter().copied().filter(|b| b.1 >= 0).collect();
        if seq_blobs.is_empty() {
            return self.seq_state_get();
        }
        let (slot, from) = self.rng.pick(&seq_blobs);
        let dst = if self.rng.chance(0.5) {
            from
        } else {
            self.rand_seq()
        };
        if self.rng.chance(0.3) && !self.cfg.model.recurrent() {
            self.push(Op::SeqRm(dst, -1, -1));
        }
        self.push(Op::SeqSet { slot, dst });
    }

    fn whole_state(&mut self) {
        let whole: Vec<u32> = self.blobs.iter().filter(|b| b.1 < 0).map(|b| b.0).collect();
        if whole.is_empty() || self.rng.chance(0.4) {
            let slot = self.next_slot;
            if self.push(Op::StateGet { slot }).is_some() {
                self.next_slot += 1;
            }
        } else {
            let slot = self.rng.pick(&whole);
            self.push(Op::StateSet { slot });
        }
    }

    fn defrag_update(&mut self) {
        self.push(Op::Defrag);
        if self.rng.chance(0.7) {
            self.push(Op::Update);
        }
    }

    // ---- scenarios ---------------------------------------------------------------------

    fn server_step(&mut self) {
        let n_slots = self.server.len();
        let per_slot = (self.cfg.kv_size() as usize / n_slots).max(8) as i32;
        for s in 0..n_slots {
            if self.server[s] == SlotState::Idle && self.rng.chance(0.3) {
                // reuse a common prefix of the cached prompt, drop the rest
                let keep = self.rng.range(0, self.next_pos(s as i32) as i64) as i32;
                self.push(Op::SeqRm(s as i32, keep, -1));
                self.server[s] = SlotState::Prompt(self.rng.range(4, 48) as u32);
            }
        }
        // context shift for slots about to run out of their share
        for s in 0..n_slots {
            if self.server[s] != SlotState::Idle && self.next_pos(s as i32) + 2 >= per_slot {
                self.context_shift(s as i32);
            }
        }
        let mut batch = Vec::new();
        let cap = self.n_batch();
        let mut order: Vec<usize> = (0..n_slots).collect();
        self.rng.shuffle(&mut order);
        let mut took = vec![0u32; n_slots];
        for &s in &order {
            let room = cap - batch.len();
            let n = match self.server[s] {
                SlotState::Gen(_) => 1.min(room),
                SlotState::Prompt(left) => (left as usize).min(room),
                SlotState::Idle => 0,
            };
            let mut t = self.prompt(s as i32, n);
            batch.append(&mut t);
            took[s] = n as u32;
        }
        if batch.is_empty() {
            if self.rng.chance(0.2) {
                self.seq_state_get();
            }
            return;
        }
        match self.decode(batch) {
            Some(0) => {
                for (s, &took) in took.iter().enumerate() {
                    self.server[s] = match self.server[s] {
                        SlotState::Prompt(left) if left > took => SlotState::Prompt(left - took),
                        SlotState::Prompt(_) => SlotState::Gen(self.rng.range(2, 30) as u32),
                        SlotState::Gen(1) => SlotState::Idle,
                        SlotState::Gen(n) => SlotState::Gen(n - 1),
                        SlotState::Idle => SlotState::Idle,
                    };
                }
            }
            Some(_) => {
                // no room: release a slot, as the server does when it gives up on a request
                let s = self.rng.below(n_slots as u64) as usize;
                self.push(Op::SeqRm(s as i32, -1, -1));
                self.server[s] = SlotState::Idle;
            }
            None => {
                let s = self.rng.below(n_slots as u64) as usize;
                self.server[s] = SlotState::Idle;
            }
        }
        if self.rng.chance(0.05) {
            self.defrag_update();
        }
    }

    fn shared_step(&mut self) {
        match self.rng.below(10) {
            0 => {
                // prompt in seq 0, copied to the others
                self.push(Op::SeqRm(-1, -1, -1));
                self.decode_prompt(0);
                for d in 1..self.n_seq() {
                    if self.rng.chance(0.8) {
                        self.push(Op::SeqCp(0, d, -1, -1));
                    }
                }
            }
            1 => {
                self.decode_shared();
            }
            2 => {
                let s = self.rand_seq();
                self.push(Op::SeqKeep(s));
            }
            3 => {
                self.seq_cp_random();
            }
            4 => {
                let s = self.rand_seq();
                let (p0, _) = self.rand_range(s);
                self.push(Op::SeqRm(s, p0, -1));
            }
            _ => {
                self.decode_step();
            }
        }
    }

    fn fragment_step(&mut self) {
        match self.rng.below(10) {
            0..=3 => {
                self.decode_interleaved();
            }
            4 | 5 => {
                let s = self.rand_seq();
                if self.rng.chance(0.5) {
                    self.push(Op::SeqRm(s, -1, -1));
                } else {
                    let (p0, p1) = self.rand_range(s);
                    self.push(Op::SeqRm(s, p0, p1));
                }
            }
            6 | 7 => self.defrag_update(),
            8 => {
                self.decode_step();
            }
            _ => {
                let s = self.rand_seq();
                self.decode_prompt(s);
            }
        }
    }

    fn self_extend_step(&mut self) {
        let s = self.rand_seq();
        match self.rng.below(6) {
            0 | 1 => {
                self.decode_prompt(s);
            }
            2 => {
                self.decode_step();
            }
            3 => {
                let n_past = self.next_pos(s);
                let ga_n = self.rng.pick(&[2, 4]);
                let ga_w = ga_n * self.rng.pick(&[2, 4, 8]);
                if n_past < ga_w + 1 {
                    self.decode_prompt(s);
                    return;
                }
                let ga_i = self.rng.range(0, (n_past - ga_w) as i64) as i32;
                let ib = (ga_n * ga_i) / ga_w;
                let bd = (ga_w / ga_n) * (ga_n - 1);
                let dd = (ga_w / ga_n) - ib * bd - ga_w;
                if self.push(Op::SeqAdd(s, ga_i, n_past, ib * bd)).is_some()
                    && self
                        .push(Op::SeqDiv(s, ga_i + ib * bd, ga_i + ib * bd + ga_w, ga_n))
                        .is_some()
                {
                    self.push(Op::SeqAdd(s, ga_i + ib * bd + ga_w, n_past + ib * bd, dd));
                }
            }
            4 => {
                self.push(Op::Update);
            }
            _ => {
                self.seq_div_random();
            }
        }
    }

    fn speculative_step(&mut self) {
        let s = self.rand_seq();
        match self.rng.below(5) {
            0 => {
                self.decode_prompt(s);
            }
            1..=3 => {
                // target verifies 1 + draft tokens, keeps the accepted prefix
                let p = self.next_pos(s);
                let k = self.rng.range(1, 8).min(self.n_batch() as i64) as usize;
                let t = self.prompt(s, k);
                if self.decode(t) == Some(0) {
                    let accepted = self.rng.range(0, k as i64) as i32;
                    self.push(Op::SeqRm(s, p + accepted + 1, -1));
                }
                if self.cfg.n_seq_max > 1 && self.rng.chance(0.3) {
                    // draft model's sequence follows the target
                    let d = (s + 1) % self.n_seq();
                    self.push(Op::SeqRm(d, -1, -1));
                    self.push(Op::SeqCp(s, d, -1, -1));
                }
            }
            _ => self.context_shift(s),
        }
    }

    fn state_step(&mut self) {
        match self.rng.below(9) {
            0 | 1 => {
                self.seq_state_get();
            }
            2 | 3 => self.seq_state_set(),
            4 => self.whole_state(),
            5 => {
                self.seq_rm_random();
            }
            6 => {
                let s = self.rand_seq();
                self.decode_prompt(s);
            }
            7 => {
                self.push(Op::Clear);
            }
            _ => {
                self.decode_step();
            }
        }
    }

    fn near_full_step(&mut self) {
        match self.rng.below(8) {
            0..=3 => {
                self.decode_mixed();
            }
            4 => {
                self.decode_interleaved();
            }
            5 => {
                self.seq_rm_random();
            }
            6 => {
                self.seq_state_set();
            }
            _ => {
                if self.rng.chance(0.5) {
                    self.seq_state_get();
                } else {
                    self.defrag_update();
                }
            }
        }
    }

    fn mixed_step(&mut self) {
        match self.rng.below(20) {
            0..=2 => {
                self.decode_step();
            }
            3 | 4 => {
                self.decode_mixed();
            }
            5 => {
                self.decode_shared();
            }
            6 => {
                self.decode_interleaved();
            }
            7 | 8 => {
                self.seq_rm_random();
            }
            9 => {
                self.seq_cp_random();
            }
            10 => {
                let s = self.rand_seq();
                self.push(Op::SeqKeep(s));
            }
            11 => {
                self.seq_add_random();
            }
            12 => {
                self.seq_div_random();
            }
            13 => self.defrag_update(),
            14 => {
                self.push(Op::Update);
            }
            15 => {
                self.seq_state_get();
            }
            16 => self.seq_state_set(),
            17 => self.whole_state(),
            18 => {
                let s = self.rand_seq();
                self.context_shift(s);
            }
            _ => {
                if self.rng.chance(0.3) {
                    self.push(Op::Clear);
                } else {
                    self.decode_step();
                }
            }
        }
    }

    fn recurrent_step(&mut self) {
        match self.rng.below(16) {
            0..=3 => {
                self.decode_step();
            }
            4 | 5 => {
                // unequal prompt lengths for several sequences in one batch
                let mut seqs: Vec<i32> = (0..self.n_seq()).collect();
                self.rng.shuffle(&mut seqs);
                let k = self.rng.range(1, seqs.len() as i64) as usize;
                let mut t = Vec::new();
                for &s in &seqs[..k] {
                    let n = self.rng.range(1, 6) as usize;
                    t.append(&mut self.prompt(s, n));
                }
                if self.rng.chance(0.5) {
                    self.rng.shuffle(&mut t);
                }
                t.truncate(self.n_batch());
                self.decode(t);
            }
            6 => {
                self.decode_shared();
            }
            7 | 8 => {
                self.seq_cp_random();
            }
            9 => {
                let s = self.rand_seq();
                self.push(Op::SeqKeep(s));
            }
            10 => {
                self.seq_rm_random();
            }
            11 => {
                if self.rng.chance(0.5) {
                    self.seq_add_random();
                } else {
                    self.seq_div_random();
                }
            }
            12 => {
                self.seq_state_get();
            }
            13 => self.seq_state_set(),
            14 => self.whole_state(),
            _ => {
                self.push(Op::Clear);
            }
        }
    }
}
