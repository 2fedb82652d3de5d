//! One face for every live memory: the seed's unified cache (`kv`, or `recurrent` for a
//! Mamba-style model), llama.cpp 0.1.161's cache of a stream per sequence (`kv` too) and
//! today's sliding-window and hybrid memories (`iswa`, `hybrid`). Sequence operations, state
//! I/O and K/V rows addressed by the model's layer index work on every kind; what only one
//! kind has is reached through [`Memory::kv`] or the kind's own type.

use std::path::Path;

use crate::cache::files::LoadedFile;
use crate::cache::io::{Progress, ReadOptions, ReadSummary};
use crate::cache::kshift::UpdateReport;
use crate::cache::KvCache;
use crate::error::{KvError, Result};
use crate::memory::attention::{AttentionCache, Window};
use crate::memory::files::{load_file, payload_layouts, read_any, save_file};
use crate::memory::hybrid::HybridCache;
use crate::memory::iswa::{ContextParams, IswaCache};
use crate::memory::part::PartInfo;
use crate::memory::plan::{Blueprint, MemoryBlueprint};
use crate::memory::recurrent::no_recurrent_state;
use crate::model::ModelInfo;
use crate::state::files::{seq_data_payload, WriteOptions};
use crate::state::parts::PartRole;
use crate::state::Layout;
use crate::tensors::rope::ShiftParams;
use crate::tensors::storage::Tensor;

/// A live memory of any kind.
pub enum Memory {
    /// The seed's unified cache (also its recurrent mode), boxed: it is five times the size
    /// of the iSWA memory's handle.
    Kv(Box<KvCache>),
    /// llama.cpp 0.1.161's sliding-window memory.
    Iswa(IswaCache),
    /// llama.cpp 0.1.161's hybrid memory (attention and recurrent layers), boxed as `Kv` is.
    Hybrid(Box<HybridCache>),
    /// llama.cpp 0.1.161's `llama_kv_cache` of a unified model with a stream per sequence
    /// (`kv_unified` false), kind `kv` as the seed's one-stream cache.
    Streams(AttentionCache),
}

fn attention_part(role: PartRole, layers: &[u32], c: &AttentionCache) -> PartInfo {
    PartInfo::of(
        role,
        layers.to_vec(),
        c.params(),
        c.n_stream(),
        c.window(),
        c.used_cells(),
        c.total_size() as u64,
    )
}

/// The one part of the seed's cache.
fn whole_part(c: &KvCache) -> PartInfo {
    let p = c.params();
    PartInfo::of(
        PartRole::Whole,
        (0..p.n_layer).collect(),
        p,
        1,
        Window::FULL,
        c.used_cells(),
        c.total_size() as u64,
    )
}

/// The stream of `part` that holds `seq`, with the part's role and window.
fn stream_holding(
    role: PartRole,
    part: &AttentionCache,
    seq: i32,
) -> Result<(PartRole, Window, &KvCache)> {
    let stream = part.stream(part.stream_of("seq", seq)? as u32)?;
    Ok((role, part.window(), stream))
}

impl Memory {
    /// The memory `KvCache.fromModel` builds in host memory for `model` in `ctx`: llama.cpp
    /// 0.1.161's iSWA or hybrid memory (a hybrid's attention part iSWA where its layers use a
    /// window), for a unified model in a context of a stream per sequence 0.1.161's
    /// `llama_kv_cache` of those streams, and otherwise for a unified or recurrent model the
    /// seed's cache of [`ModelInfo::cache_params`]. Refused for the memories with an indexer
    /// cache.
    pub fn for_model(model: &ModelInfo, ctx: &ContextParams) -> Result<Memory> {
        Memory::build(MemoryBlueprint::for_model(model, ctx)?)
    }

    /// Builds the memory of `blueprint` in host memory.
    pub fn build(blueprint: MemoryBlueprint) -> Result<Memory> {
        Ok(match blueprint.0 {
            Blueprint::Seed(p) => Memory::Kv(Box::new(KvCache::new(p)?)),
            Blueprint::Streams(p) => Memory::Streams(p.build()?),
            Blueprint::Iswa(p) => Memory::Iswa(IswaCache::new(p)?),
            Blueprint::Hybrid(p) => Memory::Hybrid(Box::new(p.build()?)),
        })
    }

    /// `"kv"`, `"recurrent"`, `"iswa"`, `"hybrid"` or `"kv-streams"` (a stream per sequence:
    /// not the seed's one-stream cache, so the seed's own calls refuse it).
    pub fn kind(&self) -> &'static str {
        match self {
            Memory::Kv(c) if c.recurrent() => "recurrent",
            Memory::Kv(_) => "kv",
            Memory::Streams(_) => "kv-streams",
            Memory::Iswa(_) => "iswa",
            Memory::Hybrid(_) => "hybrid",
        }
    }

    /// The unified cache, or why this kind has none (`what` names the operation).
    pub fn kv(&mut self, what: &str) -> Result<&mut KvCache> {
        match self {
            Memory::Kv(c) => Ok(c.as_mut()),
            other => Err(other.not_kv(what)),
        }
    }

    /// [`Memory::kv`], to read.
    pub fn kv_ref(&self, what: &str) -> Result<&KvCache> {
        match self {
            Memory::Kv(c) => Ok(c.as_ref()),
            other => Err(other.not_kv(what)),
        }
    }

    fn not_kv(&self, what: &str) -> KvError {
        let kind = match self {
            Memory::Streams(c) => format!(
                "llama.cpp 0.1.161's cache of a stream per sequence ({} streams, kvUnified \
                 false)",
                c.n_stream()
            ),
            other => format!("of kind '{}'", other.kind()),
        };
        KvError::Unsupported(format!(
            "{what} is an operation of the seed's one-stream cache; this cache is {kind} \
             (sequence operations, place, readRows/writeRows, state I/O and update work on \
             every kind)"
        ))
    }

    /// Its parts, in state order.
    pub fn parts(&self) -> Vec<PartInfo> {
        match self {
            Memory::Kv(c) => vec![whole_part(c)],
            Memory::Streams(c) => {
                let layers: Vec<u32> = (0..c.params().n_layer).collect();
                vec![attention_part(PartRole::Whole, &layers, c)]
            }
            Memory::Iswa(c) => vec![
                attention_part(PartRole::Base, &c.base().layers, &c.base().cache),
                attention_part(PartRole::Swa, &c.swa().layers, &c.swa().cache),
            ],
            Memory::Hybrid(c) => {
                let (attn, r) = (c.attention(), c.recurrent());
                let cache = r.memory.cache();
                let mut parts: Vec<PartInfo> = attn
                    .cache
                    .caches()
                    .into_iter()
                    .map(|(role, part, own)| {
                        let layers: Vec<u32> =
                            own.iter().map(|&k| attn.layers[k as usize]).collect();
                        attention_part(role, &layers, part)
                    })
                    .collect();
                parts.push(PartInfo::of(
                    PartRole::Recurrent,
                    r.layers.clone(),
                    cache.params(),
                    1,
                    Window::FULL,
                    cache.used_cells(),
                    cache.total_size() as u64,
                ));
                parts
            }
        }
    }

    /// The attention caches, in state order, with their roles and windows, each as the stream
    /// that holds `seq` (every stream of a part has one shape): where a sequence's K/V rows
    /// are. A recurrent memory has none.
    pub fn attention_streams(&self, seq: i32) -> Result<Vec<(PartRole, Window, &KvCache)>> {
        match self {
            Memory::Kv(c) if c.recurrent() => Ok(Vec::new()),
            Memory::Kv(c) => Ok(vec![(PartRole::Whole, Window::FULL, c.as_ref())]),
            Memory::Streams(c) => Ok(vec![stream_holding(PartRole::Whole, c, seq)?]),
            Memory::Iswa(c) => [
                (PartRole::Base, &c.base().cache),
                (PartRole::Swa, &c.swa().cache),
            ]
            .into_iter()
            .map(|(role, part)| stream_holding(role, part, seq))
            .collect(),
            Memory::Hybrid(c) => c
                .attention()
                .cache
                .caches()
                .into_iter()
                .map(|(role, part, _)| stream_holding(role, part, seq))
                .collect(),
        }
    }

    /// Whether positions can be shifted (`seqAdd`, `seqDiv` and the K-shift).
    pub fn can_shift(&self) -> bool {
        match self {
            Memory::Kv(c) => c.can_shift(),
            Memory::Iswa(c) => c.can_shift(),
            Memory::Hybrid(c) => c.attention().cache.can_shift(),
            Memory::Streams(c) => c.can_shift(),
        }
    }

    /// Whether a K-shift is pending.
    pub fn has_shift(&self) -> bool {
        match self {
            Memory::Kv(c) => c.has_shift(),
            Memory::Iswa(c) => c.base().cache.has_shift() || c.swa().cache.has_shift(),
            Memory::Hybrid(c) => c.attention().cache.has_shift(),
            Memory::Streams(c) => c.has_shift(),
        }
    }

    /// Sequences.
    pub fn n_seq_max(&self) -> u32 {
        match self {
            Memory::Kv(c) => c.params().n_seq_max,
            Memory::Iswa(c) => c.base().cache.params().n_seq_max,
            Memory::Hybrid(c) => c.attention().cache.caches()[0].1.params().n_seq_max,
            Memory::Streams(c) => c.params().n_seq_max,
        }
    }

    /// The model's layers, over all parts.
    pub fn n_layer(&self) -> u32 {
        self.parts().iter().map(|p| p.layers.len() as u32).sum()
    }

    /// Every cache of the memory: each stream of each attention part, and a hybrid's
    /// recurrent memory.
    fn caches(&self) -> Vec<&KvCache> {
        fn streams(c: &AttentionCache) -> Vec<&KvCache> {
            (0..c.n_stream()).filter_map(|s| c.stream(s).ok()).collect()
        }
        match self {
            Memory::Kv(c) => vec![c.as_ref()],
            Memory::Iswa(c) => [streams(&c.base().cache), streams(&c.swa().cache)].concat(),
            Memory::Hybrid(c) => {
                let mut all: Vec<&KvCache> = (c.attention().cache.caches().into_iter())
                    .flat_map(|(_, part, _)| streams(part))
                    .collect();
                all.push(c.recurrent().memory.cache());
                all
            }
            Memory::Streams(c) => streams(c),
        }
    }

    /// Host tensor bytes in memory.
    pub fn host_resident_bytes(&self) -> usize {
        self.caches()
            .into_iter()
            .map(KvCache::host_resident_bytes)
            .sum()
    }

    /// Bytes of all K tensors (a recurrent part's R), over every part.
    pub fn size_k_bytes(&self) -> usize {
        self.caches().into_iter().map(KvCache::size_k_bytes).sum()
    }

    /// Bytes of all V tensors (a recurrent part's S), over every part.
    pub fn size_v_bytes(&self) -> usize {
        self.caches().into_iter().map(KvCache::size_v_bytes).sum()
    }

    /// Bytes of all tensors, over every part.
    pub fn total_size(&self) -> usize {
        self.size_k_bytes() + self.size_v_bytes()
    }

    /// `seq_rm`: false when a recurrent cache refuses a partial removal.
    pub fn seq_rm(&mut self, seq: i32, p0: i32, p1: i32) -> Result<bool> {
        match self {
            Memory::Kv(c) => c.seq_rm(seq, p0, p1),
            Memory::Iswa(c) => c.seq_rm(seq, p0, p1),
            Memory::Hybrid(c) => c.seq_rm(seq, p0, p1),
            Memory::Streams(c) => c.seq_rm(seq, p0, p1),
        }
    }

    /// `seq_cp`.
    pub fn seq_cp(&mut self, src: i32, dst: i32, p0: i32, p1: i32) -> Result<()> {
        match self {
            Memory::Kv(c) => c.seq_cp(src, dst, p0, p1),
            Memory::Iswa(c) => c.seq_cp(src, dst, p0, p1),
            Memory::Hybrid(c) => c.seq_cp(src, dst, p0, p1),
            Memory::Streams(c) => c.seq_cp(src, dst, p0, p1),
        }
    }

    /// `seq_keep`.
    pub fn seq_keep(&mut self, seq: i32) -> Result<()> {
        match self {
            Memory::Kv(c) => c.seq_keep(seq),
            Memory::Iswa(c) => c.seq_keep(seq),
            Memory::Hybrid(c) => c.seq_keep(seq),
            Memory::Streams(c) => c.seq_keep(seq),
        }
    }

    /// `seq_add`.
    pub fn seq_add(&mut self, seq: i32, p0: i32, p1: i32, delta: i32) -> Result<()> {
        match self {
            Memory::Kv(c) => c.seq_add(seq, p0, p1, delta),
            Memory::Iswa(c) => c.seq_add(seq, p0, p1, delta),
            Memory::Hybrid(c) => c.seq_add(seq, p0, p1, delta),
            Memory::Streams(c) => c.seq_add(seq, p0, p1, delta),
        }
    }

    /// `seq_div`.
    pub fn seq_div(&mut self, seq: i32, p0: i32, p1: i32, d: i32) -> Result<()> {
        match self {
            Memory::Kv(c) => c.seq_div(seq, p0, p1, d),
            Memory::Iswa(c) => c.seq_div(seq, p0, p1, d),
            Memory::Hybrid(c) => c.seq_div(seq, p0, p1, d),
            Memory::Streams(c) => c.seq_div(seq, p0, p1, d),
        }
    }

    /// Smallest position of `seq`, -1 when it has no cell.
    pub fn seq_pos_min(&self, seq: i32) -> Result<i32> {
        match self {
            Memory::Kv(c) => {
                let s = c.check_seq("seqPosMin", seq)?;
                Ok(c.cells().seq_pos_min(s).unwrap_or(-1))
            }
            Memory::Iswa(c) => c.seq_pos_min(seq),
            Memory::Hybrid(c) => c.seq_pos_min(seq),
            Memory::Streams(c) => c.seq_pos_min(seq),
        }
    }

    /// Largest position of `seq`: the seed's (0 for a sequence without cells) for `kv`, -1 for
    /// one without cells in today's memories.
    pub fn seq_pos_max(&self, seq: i32) -> Result<i32> {
        match self {
            Memory::Kv(c) => c.seq_pos_max(seq),
            Memory::Iswa(c) => c.seq_pos_max(seq),
            Memory::Hybrid(c) => c.seq_pos_max(seq),
            Memory::Streams(c) => c.seq_pos_max(seq),
        }
    }

    /// Frees every cell.
    pub fn clear(&mut self) -> Result<()> {
        match self {
            Memory::Kv(c) => c.clear(),
            Memory::Iswa(c) => c.clear(),
            Memory::Hybrid(c) => c.clear(),
            Memory::Streams(c) => c.clear(),
        }
    }

    /// The part holding `rows` of model layer `il`, its layer index there, and the stream
    /// `stream` of it.
    fn stream_of_layer(&self, il: u32, rows: LayerRows, stream: u32) -> Result<(&KvCache, u32)> {
        match (self, rows) {
            (Memory::Kv(c), LayerRows::State(_)) if !c.recurrent() => Err(no_recurrent_state(il)),
            (Memory::Kv(c), _) => {
                if stream != 0 {
                    return Err(no_stream(stream, 1));
                }
                Ok((c.as_ref(), il))
            }
            (Memory::Iswa(_), LayerRows::State(_)) => Err(no_recurrent_state(il)),
            (Memory::Iswa(c), LayerRows::Own(_)) => {
                let (part, k) = c.route(il)?;
                Ok((part.stream(stream)?, k))
            }
            (Memory::Hybrid(c), LayerRows::Own(_)) => c.route(il, stream),
            (Memory::Streams(_), LayerRows::State(_)) => Err(no_recurrent_state(il)),
            (Memory::Streams(c), LayerRows::Own(_)) => Ok((c.stream(stream)?, il)),
            (Memory::Hybrid(c), LayerRows::State(_)) => {
                if stream != 0 {
                    return Err(no_stream(stream, 1));
                }
                c.route_recurrent(il)
            }
        }
    }

    /// Rows `rows` of model layer `il` for `cells` of stream `stream`, packed.
    pub fn read_rows_at(
        &self,
        il: u32,
        rows: LayerRows,
        stream: u32,
        cells: &[u32],
    ) -> Result<Vec<u8>> {
        let (cache, k) = self.stream_of_layer(il, rows, stream)?;
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
        let (cache, k) = match (&mut *self, rows) {
            (Memory::Kv(c), LayerRows::State(_)) if !c.recurrent() => {
                return Err(no_recurrent_state(il))
            }
            (Memory::Kv(c), _) => {
                if stream != 0 {
                    return Err(no_stream(stream, 1));
                }
                (c.as_mut(), il)
            }
            (Memory::Iswa(_), LayerRows::State(_)) => return Err(no_recurrent_state(il)),
            (Memory::Iswa(c), LayerRows::Own(_)) => {
                let (part, k) = c.route_mut(il)?;
                (part.stream_mut(stream)?, k)
            }
            (Memory::Hybrid(c), LayerRows::Own(_)) => c.route_mut(il, stream)?,
            (Memory::Streams(_), LayerRows::State(_)) => return Err(no_recurrent_state(il)),
            (Memory::Streams(c), LayerRows::Own(_)) => (c.stream_mut(stream)?, il),
            (Memory::Hybrid(c), LayerRows::State(_)) => {
                if stream != 0 {
                    return Err(no_stream(stream, 1));
                }
                c.route_recurrent_mut(il)?
            }
        };
        cache.write_rows_of_cells(k, rows.tensor(), cells, data)
    }

    /// The state of `seq` (-1: everything) in `layout` (llama.cpp 0.1.161's for `iswa`).
    pub fn state_write(&self, seq: i32, layout: Layout) -> Result<Vec<u8>> {
        match self {
            Memory::Kv(c) => c.state_write(seq, layout, 1, None),
            Memory::Iswa(c) => c.state_write(seq, layout),
            Memory::Hybrid(c) => c.state_write(seq, layout),
            Memory::Streams(c) => c.state_write(seq, layout),
        }
    }

    /// llama.cpp's `PARTIAL_ONLY` state of `seq` (what llama-server keeps as a context
    /// checkpoint): an iSWA memory's window cache, a hybrid's recurrent part (after its window
    /// cache in hybrid-iSWA). A unified or recurrent cache writes its whole state, as
    /// llama.cpp does.
    pub fn state_write_partial(&self, seq: i32, layout: Layout) -> Result<Vec<u8>> {
        match self {
            Memory::Kv(_) | Memory::Streams(_) => self.state_write(seq, layout),
            Memory::Iswa(c) => c.state_write_partial(seq, layout),
            Memory::Hybrid(c) => c.state_write_partial(seq, layout),
        }
    }

    /// Bytes of the state of `seq` (-1: everything) in `layout` (`n_stream`: a `kv` cache's
    /// option of writing one stream per sequence).
    pub fn state_size(&self, seq: i32, layout: Layout, n_stream: u32) -> Result<usize> {
        match self {
            Memory::Kv(c) => c.state_size(seq, layout, n_stream),
            Memory::Iswa(c) => c.state_size(seq, layout),
            Memory::Hybrid(c) => c.state_size(seq, layout),
            Memory::Streams(c) => c.state_size(seq, layout),
        }
    }

    /// Reads a payload into `seq` (-1: everything) in `layout`, or in whichever layout
    /// fits; transactional. A `kv` cache reads as `state_read` does (with its options).
    pub fn state_read(
        &mut self,
        data: &[u8],
        seq: i32,
        opts: ReadOptions,
        progress: Option<Progress<'_>>,
    ) -> Result<ReadSummary> {
        // the in-memory form of llama_state_seq_get_data reads as its payload
        let data = seq_data_payload(data);
        let layouts = payload_layouts(opts.layout);
        if opts.partial && !matches!(self, Memory::Kv(_) | Memory::Streams(_)) {
            if progress.is_some_and(|p| !p(0, data.len() as u64)) {
                return Err(KvError::Aborted("state read aborted".into()));
            }
            return self.read_partial(data, seq, &layouts);
        }
        match self {
            Memory::Kv(c) => c.state_read(data, seq, opts, progress),
            other => {
                if opts.part.is_some() {
                    return Err(KvError::InvalidArg(format!(
                        "part: a memory of kind '{}' reads all its parts at once",
                        other.kind()
                    )));
                }
                if progress.is_some_and(|p| !p(0, data.len() as u64)) {
                    return Err(KvError::Aborted("state read aborted".into()));
                }
                match other {
                    Memory::Iswa(c) => read_any(c, data, seq, &layouts),
                    Memory::Hybrid(c) => read_any(c.as_mut(), data, seq, &layouts),
                    Memory::Streams(c) => read_any(c, data, seq, &layouts),
                    Memory::Kv(_) => unreachable!("matched above"),
                }
            }
        }
    }

    /// Reads a `PARTIAL_ONLY` state (see [`Memory::state_write_partial`]) under the first of
    /// `layouts` that fits; the other parts keep what they hold.
    fn read_partial(&mut self, data: &[u8], seq: i32, layouts: &[Layout]) -> Result<ReadSummary> {
        let mut why = Vec::new();
        for &layout in layouts {
            let read = match self {
                Memory::Iswa(c) => c.state_read_partial(data, seq, layout),
                Memory::Hybrid(c) => c.state_read_partial(data, seq, layout),
                Memory::Kv(_) | Memory::Streams(_) => {
                    unreachable!("a unified cache reads its whole state")
                }
            };
            match read {
                Ok(r) => return Ok(r),
                Err(e @ KvError::NoSpace(_)) => return Err(e),
                Err(e) => why.push(format!("{layout}: {e}")),
            }
        }
        Err(KvError::InvalidState(format!(
            "not a partial state of this '{}' memory ({})",
            self.kind(),
            why.join("; ")
        )))
    }

    /// Saves a file of a memory of two parts (see [`save_file`]); a `kv` cache saves its
    /// own (streamed) files instead.
    pub fn save_parts_file(
        &self,
        path: &Path,
        seq: Option<i32>,
        tokens: &[i32],
        arch: &str,
        opts: WriteOptions,
    ) -> Result<()> {
        match self {
            Memory::Iswa(c) => save_file(c, path, seq, tokens, arch, opts),
            Memory::Hybrid(c) => save_file(c.as_ref(), path, seq, tokens, arch, opts),
            Memory::Streams(c) => save_file(c, path, seq, tokens, arch, opts),
            Memory::Kv(_) => Err(self.not_parts("save_parts_file")),
        }
    }

    /// Loads a file into a memory of two parts (see [`load_file`]).
    pub fn load_parts_file(
        &mut self,
        path: &Path,
        dest: Option<i32>,
        opts: ReadOptions,
    ) -> Result<LoadedFile> {
        match self {
            Memory::Iswa(c) => load_file(c, path, dest, opts),
            Memory::Hybrid(c) => load_file(c.as_mut(), path, dest, opts),
            Memory::Streams(c) => load_file(c, path, dest, opts),
            Memory::Kv(_) => Err(self.not_parts("load_parts_file")),
        }
    }

    fn not_parts(&self, what: &str) -> KvError {
        KvError::Unsupported(format!(
            "{what} is for memories of two parts; this one is of kind '{}'",
            self.kind()
        ))
    }

    /// Applies a pending K-shift; `shift` gives the rotation per model layer (a `kv` cache
    /// also runs its pending defrag, bounded by `max_nodes`).
    pub fn update(
        &mut self,
        shift: Option<&ShiftParams>,
        max_nodes: Option<u32>,
    ) -> Result<UpdateReport> {
        match self {
            Memory::Kv(c) => c.update(shift, max_nodes),
            Memory::Iswa(c) => c.update(shift),
            Memory::Hybrid(c) => c.update(shift),
            Memory::Streams(c) => c.update(shift),
        }
    }
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

fn no_stream(stream: u32, n: u32) -> KvError {
    KvError::OutOfRange(format!("stream {stream} is out of range [0, {n})"))
}
