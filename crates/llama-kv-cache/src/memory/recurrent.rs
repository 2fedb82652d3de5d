//! llama.cpp 0.1.161's recurrent memory (`llama_memory_recurrent`): one state cell per
//! sequence, R and S rows per recurrent layer. The cells, placement and state codec are the
//! seed's recurrent mode of [`SeedCache`], which 0.1.161 kept; what changed is `seq_rm` (and an
//! empty sequence's `seq_pos_max`), which its cache does by 0.1.161's rules
//! ([`RecurrentRules::V0_1_161`], as `KvCache.fromModel` of a recurrent model does too).
//! 0.1.161's per-token rollback snapshots (`n_rs_seq`, off unless a context asks for them) are
//! not kept: a removal of the end of a state is refused, as 0.1.161 refuses it without them.

use crate::cache::convert::patch_declared_layers;
use crate::cache::io::{ReadOptions, ReadSummary};
use crate::cache::SeedCache;
use crate::cell_ext::CellExt;
use crate::cells::ubatch::UBatch;
use crate::error::{KvError, Result};
use crate::params::{CacheParams, RecurrentRules};
use crate::state::codec::ParsedPayload;
use crate::state::parts::recurrent_payload;
use crate::state::Layout;

/// The refusal of rows of a recurrent state for a layer that keeps none.
pub(crate) fn no_recurrent_state(il: u32) -> KvError {
    KvError::OutOfRange(format!(
        "layer {il} keeps no recurrent state in this memory"
    ))
}

/// llama.cpp 0.1.161's `llama_memory_recurrent`.
pub struct RecurrentMemory {
    cache: SeedCache,
    /// The layer count its state declares: the model's, while it holds only the recurrent
    /// layers of a hybrid (0.1.161 declares every layer and writes the recurrent ones).
    declared: u32,
}

impl RecurrentMemory {
    /// A memory of `params.size` state cells (0.1.161: one per sequence, at least 1) whose
    /// state declares `declared` layers (`params.n_layer` for a model of recurrent layers
    /// only).
    pub fn new(params: CacheParams, declared: u32) -> Result<RecurrentMemory> {
        Ok(RecurrentMemory {
            cache: SeedCache::new(RecurrentMemory::params(params))?,
            declared,
        })
    }

    /// The parameters it keeps for a cache of `params`: recurrent, by 0.1.161's rules.
    pub(crate) fn params(mut params: CacheParams) -> CacheParams {
        params.recurrent = true;
        params.recurrent_rules = RecurrentRules::V0_1_161;
        params.can_shift = false;
        // a cell is a sequence's state, not a token: no cell extension (M-RoPE's belongs to a
        // hybrid's attention cells, as Qwen3.5's), and its S rows whatever the attention keeps
        params.cell_ext = CellExt::None;
        params.no_v = false;
        params
    }

    /// The layer count its state declares (the model's `hparams.n_layer()`).
    pub fn declared_layers(&self) -> u32 {
        self.declared
    }

    /// The cells and tensors.
    pub fn cache(&self) -> &SeedCache {
        &self.cache
    }

    /// The cells and tensors, to write rows.
    pub fn cache_mut(&mut self) -> &mut SeedCache {
        &mut self.cache
    }

    /// Places the ubatches of one decode (each sequence's tokens one group, as
    /// `split_equal` makes them): all, or (false) none, with the cells as before.
    pub fn place(&mut self, ubatches: &[UBatch]) -> Result<bool> {
        Ok(self.cache.place(ubatches)?.is_some())
    }

    /// 0.1.161's `seq_rm` (the cache follows its rules, [`RecurrentRules::V0_1_161`]).
    pub fn seq_rm(&mut self, seq: i32, p0: i32, p1: i32) -> Result<bool> {
        self.cache.seq_rm(seq, p0, p1)
    }

    /// `seq_cp`: the destination shares the source's state cell.
    pub fn seq_cp(&mut self, src: i32, dst: i32, p0: i32, p1: i32) -> Result<()> {
        self.cache.seq_cp(src, dst, p0, p1)
    }

    /// `seq_keep`.
    pub fn seq_keep(&mut self, seq: i32) -> Result<()> {
        self.cache.seq_keep(seq)
    }

    /// `seq_add`: moves the state cell's position only.
    pub fn seq_add(&mut self, seq: i32, p0: i32, p1: i32, delta: i32) -> Result<()> {
        self.cache.seq_add(seq, p0, p1, delta)
    }

    /// `seq_div`: divides the state cell's position only.
    pub fn seq_div(&mut self, seq: i32, p0: i32, p1: i32, d: i32) -> Result<()> {
        self.cache.seq_div(seq, p0, p1, d)
    }

    /// Smallest position of the cells holding `seq`, -1 when none does.
    pub fn seq_pos_min(&self, seq: i32) -> Result<i32> {
        let s = self.cache.check_seq("seqPosMin", seq)?;
        Ok(self.cache.cells.seq_pos_min(s).unwrap_or(-1))
    }

    /// Largest position of the cells holding `seq`, -1 when none does; never below -1 (a
    /// state moved below 0 by `seq_add` reads -1, as 0.1.161 starts its maximum there).
    pub fn seq_pos_max(&self, seq: i32) -> Result<i32> {
        self.cache.seq_pos_max(seq)
    }

    /// Frees every cell and zeroes the rows.
    pub fn clear(&mut self) -> Result<()> {
        self.cache.clear()
    }

    /// The state of `seq` (-1: every sequence), in the layout recurrent memories have in
    /// every version (no stream prefix).
    pub fn state_write(&self, seq: i32) -> Result<Vec<u8>> {
        let mut out = self.cache.state_write(seq, Layout::Seed, 1, None)?;
        // 0.1.161 writes the data header, declaring every model layer, even for no cell
        if self.declared != self.cache.n_layer() {
            patch_declared_layers(&mut out, self.declared)?;
        }
        Ok(out)
    }

    /// `data` parsed for this memory's cache: its data header may declare the model's layers
    /// while it holds blocks for the recurrent ones only (a hybrid's), read in place without a
    /// patched copy of the payload; all of `data` must be the state.
    fn parse(&self, data: &[u8], dest: Option<i32>) -> Result<ParsedPayload> {
        let parsed = recurrent_payload(data, Some(self.cache.n_layer()))?;
        if parsed.len != data.len() {
            return Err(KvError::InvalidState(format!(
                "recurrent part: {} trailing bytes",
                data.len() - parsed.len
            )));
        }
        let stream = &parsed.streams[0];
        // a state of no cell has no data header, so it declares nothing
        if stream.v_trans.is_some() {
            let declared = stream.n_layer_declared;
            if declared != self.declared {
                return Err(KvError::InvalidState(format!(
                    "recurrent part: the state declares {declared} layers, the memory's model {}",
                    self.declared
                )));
            }
        }
        self.cache.check_payload(&parsed, dest)?;
        Ok(parsed)
    }

    /// Checks that `data` (all of it) is a state of this memory for `seq`, without a change.
    pub(crate) fn check_read(&self, data: &[u8], seq: i32) -> Result<()> {
        self.parse(data, self.cache.read_dest(seq)?).map(drop)
    }

    /// Reads a state written by [`RecurrentMemory::state_write`] (or by 0.1.161) into `seq`
    /// (-1: the whole memory), transactionally.
    pub fn state_read(&mut self, data: &[u8], seq: i32) -> Result<ReadSummary> {
        let opts = ReadOptions {
            layout: Some(Layout::Seed),
            ..ReadOptions::default()
        };
        let in_part = |e| match e {
            KvError::InvalidState(m) if !m.starts_with("recurrent part") => {
                KvError::InvalidState(format!("recurrent part: {m}"))
            }
            other => other,
        };
        let dest = self.cache.read_dest(seq)?;
        let parsed = self.parse(data, dest).map_err(in_part)?;
        self.cache
            .apply_payload(data, &parsed, dest, opts, None)
            .map_err(in_part)
    }
}
