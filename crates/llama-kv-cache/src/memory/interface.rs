//! One interface for every live memory, as llama.cpp's `llama_memory_i`: the seed's cache
//! (`kv`, or `recurrent` for a Mamba-style model), llama.cpp 0.1.161's cache of a stream per
//! sequence (`kv-streams`) and today's sliding-window and hybrid memories (`iswa`, `hybrid`)
//! implement [`Memory`] with one signature per operation, so the binding and the prompt store
//! never ask which kind they hold. What only the seed's cache has (slots, tensors, defrag,
//! views) is reached through [`Memory::seed`].

use std::path::Path;
use std::time::Instant;

use crate::cache::io::{Progress, ReadOptions, ReadSummary};
use crate::cache::kshift::UpdateReport;
use crate::cache::release_policy::Release;
use crate::cache::save_load::LoadedFile;
use crate::cache::SeedCache;
use crate::cells::ubatch::UBatch;
use crate::cells::Cells;
use crate::error::{KvError, Result};
use crate::memory::part::PartInfo;
use crate::memory::placement::{StreamSlot, Window};
use crate::model::MemoryKind;
use crate::state::files::WriteOptions;
use crate::state::parts::PartRole;
use crate::state::{Era, Layout};
use crate::tensors::rope::ShiftParams;
use crate::tensors::storage::Tensor;

/// Where one ubatch's tokens went in one stream of one part: `cells[i]` holds the token at
/// `tokens[i]` of the ubatch. A recurrent part lists each sequence group's state cell with the
/// group's first token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    pub role: PartRole,
    pub stream: u32,
    pub tokens: Vec<u32>,
    pub cells: Vec<u32>,
}

/// Per ubatch of one decode, its placements in every part and stream.
pub type Placements = Vec<Vec<Placement>>;

/// A live memory of any kind.
pub trait Memory: Send {
    /// `"kv"`, `"recurrent"`, `"kv-streams"`, `"iswa"` or `"hybrid"`.
    fn kind(&self) -> &'static str;

    /// The memory kind its state files name (the seed's and a stream-per-sequence cache are
    /// both `Unified`).
    fn state_kind(&self) -> MemoryKind;

    /// Its parts, in state order.
    fn parts(&self) -> Vec<PartInfo>;

    /// The attention caches, in state order, with their roles and windows, each as the stream
    /// that holds `seq` (every stream of a part has one shape): where a sequence's K/V rows
    /// are. A recurrent memory has none.
    fn attention_streams(&self, seq: i32) -> Result<Vec<(PartRole, Window, &SeedCache)>>;

    /// Every cache of the memory: each stream of each attention part, and a recurrent part.
    fn caches(&self) -> Vec<&SeedCache>;

    /// [`Memory::caches`], to change.
    fn caches_mut(&mut self) -> Vec<&mut SeedCache>;

    /// Sequences.
    fn n_seq_max(&self) -> u32;

    /// Whether positions can be shifted (`seq_add`, `seq_div` and the K-shift).
    fn can_shift(&self) -> bool;

    /// Whether a K-shift is pending.
    fn has_shift(&self) -> bool;

    /// `seq_rm`: false when a recurrent part refuses a partial removal (nothing changes).
    fn seq_rm(&mut self, seq: i32, p0: i32, p1: i32) -> Result<bool>;

    /// `seq_cp`.
    fn seq_cp(&mut self, src: i32, dst: i32, p0: i32, p1: i32) -> Result<()>;

    /// `seq_keep`.
    fn seq_keep(&mut self, seq: i32) -> Result<()>;

    /// `seq_add`.
    fn seq_add(&mut self, seq: i32, p0: i32, p1: i32, delta: i32) -> Result<()>;

    /// `seq_div`.
    fn seq_div(&mut self, seq: i32, p0: i32, p1: i32, d: i32) -> Result<()>;

    /// Smallest position of `seq`, -1 when it has no cell.
    fn seq_pos_min(&self, seq: i32) -> Result<i32>;

    /// Largest position of `seq`: the seed's 0 for a sequence without cells in its cache, -1
    /// in today's memories.
    fn seq_pos_max(&self, seq: i32) -> Result<i32>;

    /// Frees every cell.
    fn clear(&mut self) -> Result<()>;

    /// Places the ubatches of one decode in every part, all or (`None`) none with the memory
    /// unchanged.
    fn place(&mut self, ubatches: &[UBatch]) -> Result<Option<Placements>>;

    /// The cache holding `rows` of model layer `il` in stream `stream`, and the layer's index
    /// there.
    fn layer_cache(&self, il: u32, rows: LayerRows, stream: u32) -> Result<(&SeedCache, u32)>;

    /// [`Memory::layer_cache`], to write.
    fn layer_cache_mut(
        &mut self,
        il: u32,
        rows: LayerRows,
        stream: u32,
    ) -> Result<(&mut SeedCache, u32)>;

    /// Bytes of the state of `seq` (-1: everything) written with `opts`.
    fn state_size(&self, seq: i32, opts: &WriteOptions) -> Result<usize>;

    /// The state of `seq` (-1: everything) in `opts.layout` (`opts.n_stream`: the seed's
    /// option of writing a stream per sequence).
    fn state_write(
        &self,
        seq: i32,
        opts: &WriteOptions,
        progress: Option<Progress<'_>>,
    ) -> Result<Vec<u8>>;

    /// [`Memory::state_write`] into `out`; its length. Today's memories write whole, then
    /// copy; the seed's cache writes in place.
    fn state_write_into(
        &self,
        out: &mut [u8],
        seq: i32,
        opts: &WriteOptions,
        progress: Option<Progress<'_>>,
    ) -> Result<usize> {
        let payload = self.state_write(seq, opts, progress)?;
        copy_into(out, &payload)
    }

    /// llama.cpp's `PARTIAL_ONLY` state of `seq` (what llama-server keeps as a context
    /// checkpoint): an iSWA memory's window cache, a hybrid's recurrent part (after its window
    /// cache in hybrid-iSWA). A memory of one part writes its whole state, as llama.cpp does.
    fn state_write_partial(&self, seq: i32, layout: Layout) -> Result<Vec<u8>> {
        self.state_write(seq, &WriteOptions::of_layout(layout), None)
    }

    /// Reads a payload (or the in-memory form of `llama_state_seq_get_data`) into `seq` (-1:
    /// everything) in `opts.layout`, or in whichever layout fits; transactional.
    fn state_read(
        &mut self,
        data: &[u8],
        seq: i32,
        opts: ReadOptions,
        progress: Option<Progress<'_>>,
    ) -> Result<ReadSummary>;

    /// Saves `seq` (`None`: every sequence, as a session file of `arch`) with its prompt
    /// `tokens` at `path`, atomically.
    fn save_file(
        &self,
        path: &Path,
        seq: Option<i32>,
        tokens: &[i32],
        arch: &str,
        opts: WriteOptions,
        progress: Option<Progress<'_>>,
    ) -> Result<()>;

    /// Loads the file at `path`: a sequence file into `dest`, a session file (`dest` `None`)
    /// into the whole memory; transactional.
    fn load_file(
        &mut self,
        path: &Path,
        dest: Option<i32>,
        opts: ReadOptions,
        progress: Option<Progress<'_>>,
    ) -> Result<LoadedFile>;

    /// Applies a pending K-shift; `shift` gives the rotation per model layer (the seed's cache
    /// also runs its pending defrag, bounded by `max_nodes`).
    fn update(
        &mut self,
        shift: Option<&ShiftParams>,
        max_nodes: Option<u32>,
    ) -> Result<UpdateReport>;

    /// The state of `seq` in a recurrent part beside attention (a hybrid memory's), as
    /// llama.cpp writes it for one sequence; `None` for a memory without one.
    fn recurrent_part_state(&self, _seq: i32) -> Result<Option<Vec<u8>>> {
        Ok(None)
    }

    /// When the next span of freed cells awaiting release by decay is due, in any cache.
    fn next_release(&self) -> Option<Instant> {
        (self.caches().into_iter())
            .filter_map(SeedCache::next_release)
            .min()
    }

    /// The seed's cache, when this memory is one.
    fn seed(&self) -> Option<&SeedCache> {
        None
    }

    /// [`Memory::seed`], to change.
    fn seed_mut(&mut self) -> Option<&mut SeedCache> {
        None
    }
}

impl dyn Memory + '_ {
    /// The seed's cache, or why this memory has none (`what` names the operation).
    pub fn kv(&mut self, what: &str) -> Result<&mut SeedCache> {
        let why = self.not_seed(what);
        self.seed_mut().ok_or(why)
    }

    /// [`Memory::kv`](dyn Memory::kv), to read.
    pub fn kv_ref(&self, what: &str) -> Result<&SeedCache> {
        self.seed().ok_or_else(|| self.not_seed(what))
    }

    fn not_seed(&self, what: &str) -> KvError {
        let kind = match self.kind() {
            "kv-streams" => format!(
                "{}'s cache of a stream per sequence ({} streams, kvUnified false)",
                Era::Today,
                self.parts().first().map_or(0, |p| p.n_stream)
            ),
            kind => format!("of kind '{kind}'"),
        };
        KvError::Unsupported(format!(
            "{what} is an operation of the seed's one-stream cache; this cache is {kind} \
             (sequence operations, place, readRows/writeRows, state I/O and update work on \
             every kind)"
        ))
    }

    /// The model's layers, over all parts.
    pub fn n_layer(&self) -> u32 {
        self.parts().iter().map(|p| p.layers.len() as u32).sum()
    }

    /// Host tensor bytes in memory.
    pub fn host_resident_bytes(&self) -> usize {
        self.caches()
            .into_iter()
            .map(SeedCache::host_resident_bytes)
            .sum()
    }

    /// Sets how every cache of the memory hands freed memory back ([`Release`]).
    pub fn set_release(&mut self, release: Release) -> Result<()> {
        (self.caches_mut().into_iter()).try_for_each(|c| c.set_release(release))
    }

    /// How the memory hands freed memory back (every cache alike).
    pub fn release(&self) -> Release {
        self.caches()
            .first()
            .map_or(Release::default(), |c| c.release())
    }

    /// Hands back what has stayed free for the delay by `now` in every cache
    /// ([`SeedCache::release_due`]); when the next is due.
    pub fn release_due(&mut self, now: Instant) -> Result<Option<Instant>> {
        let mut next: Option<Instant> = None;
        for c in self.caches_mut() {
            if let Some(due) = c.release_due(now)? {
                next = Some(next.map_or(due, |n| n.min(due)));
            }
        }
        Ok(next)
    }

    /// Hands back now the pages of every free cell of every cache.
    pub fn release_unused(&mut self) -> Result<()> {
        (self.caches_mut().into_iter()).try_for_each(SeedCache::release_unused)
    }

    /// Bytes of all K tensors (a recurrent part's R), over every part.
    pub fn size_k_bytes(&self) -> usize {
        self.caches().into_iter().map(SeedCache::size_k_bytes).sum()
    }

    /// Bytes of all V tensors (a recurrent part's S), over every part.
    pub fn size_v_bytes(&self) -> usize {
        self.caches().into_iter().map(SeedCache::size_v_bytes).sum()
    }

    /// Bytes of all tensors, over every part.
    pub fn total_size(&self) -> usize {
        self.size_k_bytes() + self.size_v_bytes()
    }

    /// Rows `rows` of model layer `il` for `cells` of stream `stream`, packed.
    pub fn read_rows_at(
        &self,
        il: u32,
        rows: LayerRows,
        stream: u32,
        cells: &[u32],
    ) -> Result<Vec<u8>> {
        let (cache, k) = self.layer_cache(il, rows, stream)?;
        cache.rows_of_cells(k, rows.tensor(), cells)
    }

    /// Writes one row per cell of `cells` (of stream `stream`) into `rows` of model layer
    /// `il`; checks every cell and the length before writing any.
    pub fn write_rows_at(
        &mut self,
        il: u32,
        rows: LayerRows,
        stream: u32,
        cells: &[u32],
        data: &[u8],
    ) -> Result<()> {
        let (cache, k) = self.layer_cache_mut(il, rows, stream)?;
        cache.write_rows_of_cells(k, rows.tensor(), cells, data)
    }
}

/// Copies a payload written whole into the caller's buffer.
fn copy_into(out: &mut [u8], payload: &[u8]) -> Result<usize> {
    let len = out.len();
    let into = out.get_mut(..payload.len()).ok_or_else(|| {
        KvError::InvalidArg(format!(
            "a buffer of {len} bytes cannot hold the {}-byte state",
            payload.len()
        ))
    })?;
    into.copy_from_slice(payload);
    Ok(payload.len())
}

/// Which rows of a model layer: K or V of the part that holds the layer (`Own`: its attention
/// cache, or for a layer with a recurrent state only, that state's R and S), or the R (K) and
/// S (V) rows of its recurrent state (`State`: Falcon-H1's layers keep both).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerRows {
    /// The layer's own part.
    Own(Tensor),
    /// The layer's recurrent state: `Tensor::K` for R, `Tensor::V` for S.
    State(Tensor),
}

impl LayerRows {
    fn tensor(self) -> Tensor {
        match self {
            LayerRows::Own(t) | LayerRows::State(t) => t,
        }
    }
}

/// The refusal of a stream a memory part does not have.
pub fn no_stream(stream: u32, n: u32) -> KvError {
    KvError::OutOfRange(format!("stream {stream} is out of range [0, {n})"))
}

/// Where a recurrent part placed one ubatch: each sequence group's state cell (the tail of
/// its first sequence), with the group's first token.
pub(crate) fn recurrent_placement(role: PartRole, cells: &Cells, ub: &UBatch) -> Placement {
    Placement {
        role,
        stream: 0,
        cells: ub
            .seq_ids
            .iter()
            .map(|ids| cells.tail(ids[0] as usize) as u32)
            .collect(),
        tokens: (0..ub.seq_ids.len() as u32)
            .map(|g| g * ub.n_seq_tokens)
            .collect(),
    }
}

/// Where an attention part placed one ubatch in one of its streams.
pub(crate) fn stream_placement(role: PartRole, slot: StreamSlot) -> Placement {
    Placement {
        role,
        stream: slot.stream,
        tokens: slot.tokens().iter().map(|&t| t as u32).collect(),
        cells: slot.cells,
    }
}
