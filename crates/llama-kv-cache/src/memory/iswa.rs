//! llama.cpp 0.1.161's sliding-window memory (`llama_kv_cache_iswa`): a base cache for the
//! full-attention layers and a window cache for the sliding-window layers, each an
//! [`AttentionCache`], fed the same ubatches and the same sequence operations.

use crate::cache::io::ReadSummary;
use crate::cache::kshift::UpdateReport;
use crate::cache::SeedCache;
use crate::cells::ubatch::UBatch;
use crate::error::{KvError, Result};
use crate::ggml_type::GgmlType;
use crate::memory::attention::{AttentionCache, CheckedRead, Snapshot};
use crate::memory::interface::{stream_placement, LayerRows, Memory, Placements};
use crate::memory::part::{PartInfo, PartPlan};
use crate::memory::parts_payload::{parts_payload_io, CheckedPayload, PartsPayload};
use crate::memory::placement::{StreamSlot, Window};
use crate::memory::recurrent::no_recurrent_state;
use crate::memory::SwaType;
use crate::model::{MemoryKind, ModelInfo, SwaInfo};
use crate::params::CacheParams;
use crate::state::files::WriteOptions;
use crate::state::parts::PartRole;
use crate::state::Layout;
use crate::tensors::rope::ShiftParams;

/// What an iSWA memory is built from: the model's layers and window, and the context.
#[derive(Clone, Debug)]
pub struct IswaParams {
    /// Parameters of a cache of every model layer, `size` the context's cells (the base
    /// cache's size); each part takes its own layers from it.
    pub params: CacheParams,
    /// Which model layers use the window (`is_swa(il)`).
    pub swa_layers: Vec<bool>,
    /// The window.
    pub window: Window,
    /// One stream for all sequences.
    pub unified: bool,
    /// The window cache as large as the base cache (`swa_full`).
    pub swa_full: bool,
    /// Tokens per ubatch (`n_ubatch`), which the window cache has room for beyond the window.
    pub n_ubatch: u32,
}

/// A context as llama.cpp 0.1.161's `llama_context_params` describes it, for the memories of
/// today's models.
#[derive(Clone, Debug)]
pub struct ContextParams {
    /// Context size in tokens (0: the model's trained context), padded to 256.
    pub n_ctx: u32,
    /// Sequences.
    pub n_seq_max: u32,
    /// Tokens per ubatch.
    pub n_ubatch: u32,
    /// One stream for all sequences (`kv_unified`); otherwise each sequence gets a stream
    /// of `n_ctx / n_seq_max` cells (padded to 256).
    pub unified: bool,
    /// The window cache as large as the base cache.
    pub swa_full: bool,
    /// K type.
    pub type_k: GgmlType,
    /// V type.
    pub type_v: GgmlType,
    /// Flash attention (V rows instead of transposed V).
    pub flash_attn: bool,
}

impl ContextParams {
    /// Cells per stream (`n_ctx_seq`), as 0.1.161's context computes them.
    pub fn cells_per_stream(&self, n_ctx_train: u32) -> Result<u32> {
        let pad = |x: u32| {
            x.checked_next_multiple_of(256)
                .ok_or_else(|| KvError::OutOfRange(format!("nCtx {x} is too large")))
        };
        if self.n_seq_max == 0 {
            return Err(KvError::InvalidArg("nSeqMax must be at least 1".into()));
        }
        let n_ctx = pad(if self.n_ctx == 0 {
            n_ctx_train
        } else {
            self.n_ctx
        })?;
        if self.unified {
            Ok(n_ctx)
        } else {
            pad(n_ctx / self.n_seq_max)
        }
    }
}

impl IswaParams {
    /// The iSWA memory 0.1.161 builds for `model` in `ctx`; refused for a model that has no
    /// sliding-window layers.
    pub fn for_model(model: &ModelInfo, ctx: &ContextParams) -> Result<IswaParams> {
        let Some(swa) = model
            .swa
            .as_ref()
            .filter(|_| model.memory == MemoryKind::Iswa)
        else {
            return Err(KvError::Unsupported(format!(
                "the model ({}) has no sliding-window layers: its memory is {}",
                model.arch,
                model.memory.name()
            )));
        };
        model.check_cache_types(ctx.type_k, ctx.type_v, ctx.flash_attn)?;
        let size = ctx.cells_per_stream(model.n_ctx_train)?;
        let mut params =
            model.layer_params(size, ctx.n_seq_max, ctx.type_k, ctx.type_v, ctx.flash_attn)?;
        (params.n_rot_k, params.n_rot_v) = model.rotation(ctx.type_k, ctx.type_v);
        let swa_layers = model.layers.iter().map(|l| l.swa).collect();
        Ok(IswaParams::in_context(params, swa_layers, swa, ctx))
    }

    /// The memory of the layers of `params`, those flagged in `swa_layers` in the model's
    /// window `swa`, in `ctx` (also a hybrid's attention layers).
    pub(crate) fn in_context(
        params: CacheParams,
        swa_layers: Vec<bool>,
        swa: &SwaInfo,
        ctx: &ContextParams,
    ) -> IswaParams {
        IswaParams {
            params,
            swa_layers,
            window: Window {
                n_swa: swa.window,
                swa_type: if swa.chunked {
                    SwaType::Chunked
                } else {
                    SwaType::Standard
                },
            },
            unified: ctx.unified,
            swa_full: ctx.swa_full,
            n_ubatch: ctx.n_ubatch,
        }
    }

    /// The base cache of the layers without the window, then the window cache, before they
    /// are built.
    pub(crate) fn plans(&self) -> Result<[PartPlan; 2]> {
        if self.swa_layers.len() != self.params.n_layer as usize {
            return Err(KvError::InvalidArg(format!(
                "swa layers: {} flags for {} layers",
                self.swa_layers.len(),
                self.params.n_layer
            )));
        }
        let plan = |role, swa: bool, size, window| {
            let layers: Vec<u32> = (0..self.params.n_layer)
                .filter(|&il| self.swa_layers[il as usize] == swa)
                .collect();
            PartPlan {
                role,
                params: part_params(&self.params, &layers, size),
                layers,
                unified: self.unified,
                window,
            }
        };
        Ok([
            plan(PartRole::Base, false, self.params.size, Window::FULL),
            plan(PartRole::Swa, true, self.swa_size(), self.window),
        ])
    }

    /// Cells of the window cache, as 0.1.161 sizes it: the window (per sequence when
    /// unified) plus a ubatch, padded to 256, never more than the base cache; the base
    /// cache's size with `swa_full`.
    pub fn swa_size(&self) -> u32 {
        let base = self.params.size;
        if self.swa_full {
            return base;
        }
        let per = if self.unified {
            u64::from(self.params.n_seq_max)
        } else {
            1
        };
        let want = u64::from(self.window.n_swa) * per + u64::from(self.n_ubatch);
        let min = want.min(u64::from(base));
        (min.div_ceil(256) * 256) as u32
    }
}

/// A payload of both caches, checked (`IswaCache::check_parts`).
pub(crate) struct IswaChecked {
    base: CheckedRead,
    swa: CheckedRead,
}

impl IswaChecked {
    /// Bytes of both parts.
    pub(crate) fn len(&self) -> usize {
        self.base.len() + self.swa.len()
    }
}

/// One part of an iSWA memory.
pub struct IswaPart {
    /// The model layers it holds, ascending; its layer `k` is model layer `layers[k]`.
    pub layers: Vec<u32>,
    /// The cache.
    pub cache: AttentionCache,
}

/// llama.cpp 0.1.161's `llama_kv_cache_iswa`.
pub struct IswaCache {
    base: IswaPart,
    swa: IswaPart,
}

fn part_params(all: &CacheParams, layers: &[u32], size: u32) -> CacheParams {
    let mut p = all.clone();
    p.size = size;
    p.n_layer = layers.len() as u32;
    p.n_embd_k_gqa = layers
        .iter()
        .map(|&il| all.n_embd_k(il as usize) as u32)
        .collect();
    p.n_embd_v_gqa = layers
        .iter()
        .map(|&il| all.n_embd_v(il as usize) as u32)
        .collect();
    p
}

impl IswaCache {
    /// Builds both caches.
    pub fn new(p: IswaParams) -> Result<IswaCache> {
        let [base, swa] = p.plans()?;
        let part = |plan: PartPlan| -> Result<IswaPart> {
            Ok(IswaPart {
                cache: plan.build()?,
                layers: plan.layers,
            })
        };
        Ok(IswaCache {
            base: part(base)?,
            swa: part(swa)?,
        })
    }

    /// The full-attention part.
    pub fn base(&self) -> &IswaPart {
        &self.base
    }

    /// The sliding-window part.
    pub fn swa(&self) -> &IswaPart {
        &self.swa
    }

    /// The part holding model layer `il` and its index there.
    pub fn route(&self, il: u32) -> Result<(&AttentionCache, u32)> {
        for part in [&self.base, &self.swa] {
            if let Ok(k) = part.layers.binary_search(&il) {
                return Ok((&part.cache, k as u32));
            }
        }
        Err(self.no_layer(il))
    }

    /// [`IswaCache::route`], to write rows.
    pub fn route_mut(&mut self, il: u32) -> Result<(&mut AttentionCache, u32)> {
        let err = self.no_layer(il);
        for part in [&mut self.base, &mut self.swa] {
            if let Ok(k) = part.layers.binary_search(&il) {
                return Ok((&mut part.cache, k as u32));
            }
        }
        Err(err)
    }

    fn no_layer(&self, il: u32) -> KvError {
        KvError::OutOfRange(format!(
            "layer {il} is out of range [0, {})",
            self.base.layers.len() + self.swa.layers.len()
        ))
    }

    fn both(&mut self) -> [&mut AttentionCache; 2] {
        [&mut self.base.cache, &mut self.swa.cache]
    }

    /// Places the ubatches of one decode in both caches, or (`None`) in neither.
    #[allow(clippy::type_complexity)]
    pub fn place(
        &mut self,
        ubatches: &[UBatch],
    ) -> Result<Option<(Vec<Vec<StreamSlot>>, Vec<Vec<StreamSlot>>)>> {
        let (mut kb, mut ks) = (Snapshot::default(), Snapshot::default());
        let base = self.base.cache.place_each(ubatches, &mut kb);
        let swa = match base {
            Ok(Some(_)) => self.swa.cache.place_each(ubatches, &mut ks),
            _ => Ok(None),
        };
        match (base, swa) {
            (Ok(Some(b)), Ok(Some(s))) => Ok(Some((b, s))),
            (b, s) => {
                self.base.cache.restore(kb);
                self.swa.cache.restore(ks);
                b.and(s).map(|_| None)
            }
        }
    }

    fn check_seq(&self, what: &str, seq: i32, any: bool) -> Result<()> {
        if any && seq == -1 {
            return Ok(());
        }
        self.swa.cache.stream_of(what, seq).map(|_| ())
    }

    /// Whether the positions can be shifted: only with a window cache as large as the base
    /// cache (`swa_full`), as in 0.1.161, whose window cache may already have dropped what a
    /// shift would move.
    pub fn can_shift(&self) -> bool {
        self.base.cache.can_shift()
            && self.swa.cache.can_shift()
            && self.base.cache.size() == self.swa.cache.size()
    }

    /// Refuses to move positions when [`IswaCache::can_shift`] does not hold, before anything
    /// changes.
    fn check_shift(&self, what: &str) -> Result<()> {
        if self.can_shift() {
            return Ok(());
        }
        Err(KvError::Unsupported(format!(
            "{what}: the positions of an iSWA cache can move only when its window cache is as \
             large as its base cache ({} < {} cells; llama.cpp 0.1.161's can_shift says no as \
             well): create it with swaFull",
            self.swa.cache.size(),
            self.base.cache.size()
        )))
    }

    /// Applies a pending K-shift to both caches; `shift` gives the rotation per model layer.
    pub fn update(&mut self, shift: Option<&ShiftParams>) -> Result<UpdateReport> {
        let mut report = UpdateReport::default();
        for part in [&mut self.base, &mut self.swa] {
            let params = shift.map(|s| s.for_layers(&part.layers));
            let r = part.cache.update(params.as_ref())?;
            report.shifted_cells = report.shifted_cells.max(r.shifted_cells);
            report.shift_pending |= r.shift_pending;
        }
        Ok(report)
    }

    /// The state of `seq` (-1: everything) as 0.1.161 writes it: the base cache, then the
    /// window cache.
    pub fn state_write(&self, seq: i32, layout: Layout) -> Result<Vec<u8>> {
        let mut out = self.base.cache.state_write(seq, layout)?;
        out.extend(self.swa.cache.state_write(seq, layout)?);
        Ok(out)
    }

    /// llama.cpp's `PARTIAL_ONLY` state of `seq` (what llama-server keeps as a context
    /// checkpoint): the window cache only.
    pub fn state_write_partial(&self, seq: i32, layout: Layout) -> Result<Vec<u8>> {
        self.swa.cache.state_write(seq, layout)
    }

    /// Reads a `PARTIAL_ONLY` state into the window cache (checked before it changes); the
    /// base cache keeps what it holds, as in llama.cpp.
    pub fn state_read_partial(
        &mut self,
        data: &[u8],
        seq: i32,
        layout: Layout,
    ) -> Result<ReadSummary> {
        self.swa.cache.state_read(data, seq, layout)
    }

    /// Checks the window cache's part at the start of `data` (a hybrid-iSWA memory's partial
    /// state goes on with its recurrent part).
    pub(crate) fn check_swa(&self, data: &[u8], seq: i32, layout: Layout) -> Result<CheckedRead> {
        self.swa.cache.check_read(data, seq, layout, false)
    }

    /// Applies a read [`IswaCache::check_swa`] accepted.
    pub(crate) fn apply_swa(
        &mut self,
        data: &[u8],
        checked: CheckedRead,
        seq: i32,
    ) -> Result<ReadSummary> {
        self.swa.cache.apply_read(data, checked, seq)
    }

    /// Bytes of [`IswaCache::state_write`]`(seq, layout)`.
    pub fn state_size(&self, seq: i32, layout: Layout) -> Result<usize> {
        Ok(self.base.cache.state_size(seq, layout)? + self.swa.cache.state_size(seq, layout)?)
    }

    /// Reads a payload of both caches into `seq` (-1: everything). Both parts are parsed
    /// and checked (room included) before either changes.
    pub fn state_read(
        &mut self,
        data: &[u8],
        seq: i32,
        layout: Layout,
    ) -> Result<[ReadSummary; 2]> {
        let checked = self.check_parts(data, seq, layout, true)?;
        self.apply_parts(data, checked, seq)
    }

    /// Parses and checks a payload of both caches (`exact`: as the whole of `data`; a
    /// hybrid-iSWA payload goes on with its recurrent part) without changing either.
    pub(crate) fn check_parts(
        &self,
        data: &[u8],
        seq: i32,
        layout: Layout,
        exact: bool,
    ) -> Result<IswaChecked> {
        let base = self.base.cache.check_read(data, seq, layout, false)?;
        let swa = self
            .swa
            .cache
            .check_read(&data[base.len()..], seq, layout, exact)?;
        Ok(IswaChecked { base, swa })
    }

    /// Applies a read [`IswaCache::check_parts`] accepted.
    pub(crate) fn apply_parts(
        &mut self,
        data: &[u8],
        checked: IswaChecked,
        seq: i32,
    ) -> Result<[ReadSummary; 2]> {
        let IswaChecked { base, swa } = checked;
        let (first, rest) = data.split_at(base.len());
        let second = &rest[..swa.len()];
        let base = self.base.cache.apply_read(first, base, seq)?;
        let swa = self.swa.cache.apply_read(second, swa, seq)?;
        Ok([base, swa])
    }

    /// Marks a pending K-shift done without rotating (a model without RoPE).
    pub(crate) fn drop_shift(&mut self) {
        self.base.cache.drop_shift();
        self.swa.cache.drop_shift();
    }
}

/// A read of an iSWA memory's payload, checked: both caches', or in a partial state the
/// window cache's.
pub(crate) enum IswaRead {
    Both(IswaChecked),
    Window(CheckedRead),
}

impl CheckedPayload for IswaChecked {
    fn layout(&self) -> Layout {
        self.base.layout()
    }

    fn has_no_data_header(&self) -> bool {
        self.base.has_no_data_header() && self.swa.has_no_data_header()
    }
}

impl CheckedPayload for IswaRead {
    fn layout(&self) -> Layout {
        match self {
            IswaRead::Both(c) => c.layout(),
            IswaRead::Window(c) => c.layout(),
        }
    }

    fn has_no_data_header(&self) -> bool {
        match self {
            IswaRead::Both(c) => c.has_no_data_header(),
            IswaRead::Window(c) => c.has_no_data_header(),
        }
    }
}

impl PartsPayload for IswaCache {
    const NAME: &'static str = "iSWA";
    type Checked = IswaRead;
    fn write_parts(&self, seq: i32, layout: Layout) -> Result<Vec<u8>> {
        IswaCache::state_write(self, seq, layout)
    }
    /// A partial state is the window cache's.
    fn check_payload(
        &self,
        data: &[u8],
        seq: i32,
        layout: Layout,
        partial: bool,
    ) -> Result<IswaRead> {
        Ok(match partial {
            true => IswaRead::Window(self.swa.cache.check_read(data, seq, layout, true)?),
            false => IswaRead::Both(self.check_parts(data, seq, layout, true)?),
        })
    }
    fn apply_payload(&mut self, data: &[u8], checked: IswaRead, seq: i32) -> Result<ReadSummary> {
        match checked {
            IswaRead::Both(c) => self.apply_parts(data, c, seq).map(ReadSummary::together),
            IswaRead::Window(c) => self.swa.cache.apply_read(data, c, seq),
        }
    }
}

impl Memory for IswaCache {
    parts_payload_io!();

    fn kind(&self) -> &'static str {
        "iswa"
    }

    fn state_kind(&self) -> MemoryKind {
        MemoryKind::Iswa
    }

    fn parts(&self) -> Vec<PartInfo> {
        vec![
            self.base.cache.part_info(PartRole::Base, &self.base.layers),
            self.swa.cache.part_info(PartRole::Swa, &self.swa.layers),
        ]
    }

    fn attention_streams(&self, seq: i32) -> Result<Vec<(PartRole, Window, &SeedCache)>> {
        Ok(vec![
            self.base.cache.holding(PartRole::Base, seq)?,
            self.swa.cache.holding(PartRole::Swa, seq)?,
        ])
    }

    fn caches(&self) -> Vec<&SeedCache> {
        [self.base.cache.streams(), self.swa.cache.streams()].concat()
    }

    fn caches_mut(&mut self) -> Vec<&mut SeedCache> {
        let mut all = self.base.cache.streams_mut();
        all.extend(self.swa.cache.streams_mut());
        all
    }

    fn n_seq_max(&self) -> u32 {
        self.base.cache.params().n_seq_max
    }

    fn can_shift(&self) -> bool {
        IswaCache::can_shift(self)
    }

    fn has_shift(&self) -> bool {
        self.base.cache.has_shift() || self.swa.cache.has_shift()
    }

    /// `seq_rm` in both caches.
    fn seq_rm(&mut self, seq: i32, p0: i32, p1: i32) -> Result<bool> {
        self.check_seq("seqRm", seq, true)?;
        for c in self.both() {
            c.seq_rm(seq, p0, p1)?;
        }
        Ok(true)
    }

    /// `seq_cp` in both caches.
    fn seq_cp(&mut self, src: i32, dst: i32, p0: i32, p1: i32) -> Result<()> {
        // checked in the window cache first so that a refusal changes neither
        self.check_seq("seqCp source", src, false)?;
        self.check_seq("seqCp destination", dst, false)?;
        for c in self.both() {
            c.seq_cp(src, dst, p0, p1)?;
        }
        Ok(())
    }

    /// `seq_keep` in both caches.
    fn seq_keep(&mut self, seq: i32) -> Result<()> {
        self.check_seq("seqKeep", seq, false)?;
        for c in self.both() {
            c.seq_keep(seq)?;
        }
        Ok(())
    }

    /// `seq_add` in both caches.
    fn seq_add(&mut self, seq: i32, p0: i32, p1: i32, delta: i32) -> Result<()> {
        self.check_seq("seqAdd", seq, false)?;
        self.check_shift("seqAdd")?;
        for c in self.both() {
            c.seq_add(seq, p0, p1, delta)?;
        }
        Ok(())
    }

    /// `seq_div` in both caches.
    fn seq_div(&mut self, seq: i32, p0: i32, p1: i32, d: i32) -> Result<()> {
        self.check_seq("seqDiv", seq, false)?;
        self.check_shift("seqDiv")?;
        for c in self.both() {
            c.seq_div(seq, p0, p1, d)?;
        }
        Ok(())
    }

    /// Smallest position of `seq`, from the window cache (the base cache holds a superset).
    fn seq_pos_min(&self, seq: i32) -> Result<i32> {
        self.swa.cache.seq_pos_min(seq)
    }

    /// Largest position of `seq`.
    fn seq_pos_max(&self, seq: i32) -> Result<i32> {
        self.swa.cache.seq_pos_max(seq)
    }

    /// Frees every cell of both caches.
    fn clear(&mut self) -> Result<()> {
        for c in self.both() {
            c.clear()?;
        }
        Ok(())
    }

    fn place(&mut self, ubatches: &[UBatch]) -> Result<Option<Placements>> {
        let Some((base, swa)) = IswaCache::place(self, ubatches)? else {
            return Ok(None);
        };
        let placed = base.into_iter().zip(swa).map(|(b, s)| {
            let base = b.into_iter().map(|s| stream_placement(PartRole::Base, s));
            let swa = s.into_iter().map(|s| stream_placement(PartRole::Swa, s));
            base.chain(swa).collect()
        });
        Ok(Some(placed.collect()))
    }

    fn layer_cache(&self, il: u32, rows: LayerRows, stream: u32) -> Result<(&SeedCache, u32)> {
        match rows {
            LayerRows::State(_) => Err(no_recurrent_state(il)),
            LayerRows::Own(_) => {
                let (part, k) = self.route(il)?;
                Ok((part.stream(stream)?, k))
            }
        }
    }

    fn layer_cache_mut(
        &mut self,
        il: u32,
        rows: LayerRows,
        stream: u32,
    ) -> Result<(&mut SeedCache, u32)> {
        match rows {
            LayerRows::State(_) => Err(no_recurrent_state(il)),
            LayerRows::Own(_) => {
                let (part, k) = self.route_mut(il)?;
                Ok((part.stream_mut(stream)?, k))
            }
        }
    }

    fn state_size(&self, seq: i32, opts: &WriteOptions) -> Result<usize> {
        IswaCache::state_size(self, seq, opts.layout)
    }

    fn state_write_partial(&self, seq: i32, layout: Layout) -> Result<Vec<u8>> {
        IswaCache::state_write_partial(self, seq, layout)
    }

    fn update(&mut self, shift: Option<&ShiftParams>, _: Option<u32>) -> Result<UpdateReport> {
        IswaCache::update(self, shift)
    }
}
