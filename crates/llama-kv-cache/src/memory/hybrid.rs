//! llama.cpp 0.1.161's hybrid memory (`llama_memory_hybrid`, and `llama_memory_hybrid_iswa`
//! when the attention layers use a sliding window): an attention cache (or a base and a window
//! cache) for the attention layers and a recurrent memory for the others (Jamba, Granite 4,
//! PLaMo 2, LFM2), fed the same ubatches, with 0.1.161's rules for what each accepts.

use crate::cache::io::ReadSummary;
use crate::cache::kshift::UpdateReport;
use crate::cache::SeedCache;
use crate::cells::ubatch::UBatch;
use crate::error::{KvError, Result};
use crate::ggml_type::GgmlType;
use crate::memory::attention::{AttentionCache, CheckedRead, Snapshot};
use crate::memory::interface::{
    no_stream, recurrent_placement, stream_placement, LayerRows, Memory, Placement, Placements,
};
use crate::memory::iswa::{ContextParams, IswaCache, IswaChecked, IswaParams};
use crate::memory::part::{planned, PartInfo, PartPlan};
use crate::memory::parts_payload::{parts_payload_io, CheckedPayload, PartsPayload};
use crate::memory::placement::{StreamSlot, Window};
use crate::memory::recurrent::{no_recurrent_state, RecurrentMemory};
use crate::model::{LayerMemory, MemoryKind, ModelInfo, RopeKind};
use crate::params::CacheParams;
use crate::state::files::WriteOptions;
use crate::state::parts::PartRole;
use crate::state::Layout;
use crate::tensors::rope::ShiftParams;

/// The attention part of a hybrid memory.
pub struct HybridAttention {
    /// The model layers it holds, ascending.
    pub layers: Vec<u32>,
    /// The cache: one attention cache, or (hybrid-iSWA) a base and a window cache.
    pub cache: AttentionPart,
}

/// The attention layers' memory in a hybrid: `llama_kv_cache`, or `llama_kv_cache_iswa` when
/// the attention layers use a window (0.1.161's `llama_memory_hybrid_iswa`). Its layer
/// indices are the attention part's own (0 for its first layer).
pub enum AttentionPart {
    /// Full attention.
    Full(AttentionCache),
    /// A base and a window cache.
    Window(IswaCache),
}

/// A read of the attention part, checked.
pub(crate) enum AttentionChecked {
    Full(CheckedRead),
    Window(IswaChecked),
}

impl AttentionChecked {
    fn len(&self) -> usize {
        match self {
            AttentionChecked::Full(c) => c.len(),
            AttentionChecked::Window(c) => c.len(),
        }
    }
}

/// Runs `$body` on the attention part's cache, whichever it is, bound to `$c`.
macro_rules! either {
    ($part:expr, $c:ident => $body:expr) => {
        match $part {
            AttentionPart::Full($c) => $body,
            AttentionPart::Window($c) => $body,
        }
    };
}

impl AttentionPart {
    /// The caches, in state order, with their roles and the part's layers each holds.
    pub fn caches(&self) -> Vec<(PartRole, &AttentionCache, Vec<u32>)> {
        match self {
            AttentionPart::Full(c) => {
                let n = c.params().n_layer;
                vec![(PartRole::Attention, c, (0..n).collect())]
            }
            AttentionPart::Window(c) => vec![
                (PartRole::Base, &c.base().cache, c.base().layers.clone()),
                (PartRole::Swa, &c.swa().cache, c.swa().layers.clone()),
            ],
        }
    }

    /// The cache holding the part's layer `k`, and the layer's index there.
    fn route(&self, k: u32) -> Result<(&AttentionCache, u32)> {
        match self {
            AttentionPart::Full(c) => Ok((c, k)),
            AttentionPart::Window(c) => c.route(k),
        }
    }

    fn route_mut(&mut self, k: u32) -> Result<(&mut AttentionCache, u32)> {
        match self {
            AttentionPart::Full(c) => Ok((c, k)),
            AttentionPart::Window(c) => c.route_mut(k),
        }
    }

    /// Checks a sequence id as every cache of the part does.
    fn check_seq(&self, what: &str, seq: i32) -> Result<()> {
        self.caches()[0].1.stream_of(what, seq).map(drop)
    }

    /// Places the ubatches (all or none), each slot with the role of its cache.
    #[allow(clippy::type_complexity)]
    fn place(&mut self, ubatches: &[UBatch]) -> Result<Option<Vec<Vec<(PartRole, StreamSlot)>>>> {
        let tag =
            |role: PartRole, slots: Vec<StreamSlot>| slots.into_iter().map(move |s| (role, s));
        match self {
            AttentionPart::Full(c) => {
                let mut undo = Snapshot::default();
                match c.place_each(ubatches, &mut undo) {
                    Ok(Some(all)) => Ok(Some(
                        all.into_iter()
                            .map(|s| tag(PartRole::Attention, s).collect())
                            .collect(),
                    )),
                    other => {
                        c.restore(undo);
                        other.map(|_| None)
                    }
                }
            }
            AttentionPart::Window(c) => Ok(c.place(ubatches)?.map(|(base, swa)| {
                base.into_iter()
                    .zip(swa)
                    .map(|(b, s)| {
                        tag(PartRole::Base, b)
                            .chain(tag(PartRole::Swa, s))
                            .collect()
                    })
                    .collect()
            })),
        }
    }

    /// Whether positions can be shifted.
    pub fn can_shift(&self) -> bool {
        either!(self, c => c.can_shift())
    }

    /// Whether a K-shift is pending.
    pub fn has_shift(&self) -> bool {
        self.caches().iter().any(|(_, c, _)| c.has_shift())
    }

    fn check_read(&self, data: &[u8], seq: i32, layout: Layout) -> Result<AttentionChecked> {
        Ok(match self {
            AttentionPart::Full(c) => {
                AttentionChecked::Full(c.check_read(data, seq, layout, false)?)
            }
            AttentionPart::Window(c) => {
                AttentionChecked::Window(c.check_parts(data, seq, layout, false)?)
            }
        })
    }

    fn apply_read(
        &mut self,
        data: &[u8],
        checked: AttentionChecked,
        seq: i32,
    ) -> Result<ReadSummary> {
        match (self, checked) {
            (AttentionPart::Full(c), AttentionChecked::Full(k)) => c.apply_read(data, k, seq),
            (AttentionPart::Window(c), AttentionChecked::Window(k)) => {
                c.apply_parts(data, k, seq).map(ReadSummary::together)
            }
            _ => unreachable!("a read is applied to the part that checked it"),
        }
    }
}

/// The recurrent part of a hybrid memory.
pub struct HybridRecurrent {
    /// The model layers it holds, ascending.
    pub layers: Vec<u32>,
    /// The memory.
    pub memory: RecurrentMemory,
}

/// llama.cpp 0.1.161's `llama_memory_hybrid`.
pub struct HybridCache {
    attn: HybridAttention,
    recr: HybridRecurrent,
    /// Whether the model rotates K by position (Jamba does not).
    rope: bool,
}

/// A hybrid memory before it is built: what 0.1.161 makes of a hybrid model in a context.
pub(crate) struct HybridPlan {
    attn_layers: Vec<u32>,
    attn: AttentionPlan,
    recr_layers: Vec<u32>,
    /// The recurrent memory's parameters, as it keeps them.
    recr: CacheParams,
    /// The layer count its state declares (`hparams.n_layer()`: without the MTP layers).
    declared: u32,
    rope: bool,
}

/// The attention part of a [`HybridPlan`].
enum AttentionPlan {
    Full(PartPlan),
    Window(IswaParams),
}

impl HybridPlan {
    /// The memory 0.1.161 builds for a hybrid `model` in `ctx`: an attention cache of
    /// `n_ctx_seq` cells per stream, and one state cell per sequence.
    pub(crate) fn for_model(model: &ModelInfo, ctx: &ContextParams) -> Result<HybridPlan> {
        if model.memory != MemoryKind::Hybrid {
            return Err(KvError::Unsupported(format!(
                "the model ({}) is not a hybrid model: its memory is {}",
                model.arch,
                model.memory.name()
            )));
        }
        model.check_live()?;
        model.check_cache_types(ctx.type_k, ctx.type_v, ctx.flash_attn)?;
        let r = model.recurrent.clone().unwrap_or_default();
        // 0.1.161's layer filters: a layer may be in neither part (Nemotron-H's MLP layers)
        let pick = |holds: fn(LayerMemory) -> bool| -> Vec<u32> {
            (0..model.n_layer)
                .filter(|&il| holds(model.layers[il as usize].memory))
                .collect()
        };
        let (attn_layers, recr_layers) = (pick(LayerMemory::attends), pick(LayerMemory::recurrent));
        let size = ctx.cells_per_stream(model.n_ctx_train)?;
        // a template of every layer, not a cache of its own: each part is checked when built
        // (LFM2's convolution layers have no K/V and no S rows, which no one cache could hold)
        let mut all =
            model.params_of_layers(size, ctx.n_seq_max, ctx.type_k, ctx.type_v, ctx.flash_attn);
        (all.n_rot_k, all.n_rot_v) = model.rotation(ctx.type_k, ctx.type_v);
        // the model's widths without the recurrent state, which only the recurrent part keeps
        let attn = part_params(&all, &attn_layers, size, |il| {
            (all.n_embd_k_gqa[il], all.n_embd_v_gqa[il])
        });
        // recurrent layers keep R (conv) and S (ssm) rows, in f32, one cell per sequence
        let mut recr = part_params(&all, &recr_layers, ctx.n_seq_max.max(1), |_| {
            (r.n_embd_k_s, r.n_embd_v_s)
        });
        recr.type_k = GgmlType::F32;
        recr.type_v = GgmlType::F32;
        (recr.n_rot_k, recr.n_rot_v) = (0, 0);
        let windowed: Vec<bool> = attn_layers
            .iter()
            .map(|&il| model.layers[il as usize].swa)
            .collect();
        let attn = match &model.swa {
            Some(swa) if windowed.iter().any(|&w| w) => {
                AttentionPlan::Window(IswaParams::in_context(attn, windowed, swa, ctx))
            }
            _ => AttentionPlan::Full(PartPlan {
                role: PartRole::Attention,
                layers: (0..attn.n_layer).collect(),
                params: attn,
                unified: ctx.unified,
                window: Window::FULL,
            }),
        };
        Ok(HybridPlan {
            attn_layers,
            attn,
            recr_layers,
            recr: RecurrentMemory::params(recr),
            // its state declares `hparams.n_layer()`: the model's layers less the MTP ones
            declared: model.n_layer - model.n_layer_nextn,
            rope: model.rope.kind != RopeKind::None,
        })
    }

    /// Its parts, in state order, as [`Memory::parts`](crate::Memory::parts) will list them.
    pub(crate) fn parts(&self) -> Result<Vec<PartInfo>> {
        let model_layer = |k: u32| self.attn_layers[k as usize];
        let mut parts = match &self.attn {
            AttentionPlan::Full(p) => vec![p.info(model_layer)?],
            AttentionPlan::Window(p) => p
                .plans()?
                .iter()
                .map(|p| p.info(model_layer))
                .collect::<Result<_>>()?,
        };
        self.recr.validate()?;
        parts.push(planned(
            PartRole::Recurrent,
            self.recr_layers.clone(),
            &self.recr,
            1,
            Window::FULL,
        )?);
        Ok(parts)
    }

    /// Builds the memory.
    pub(crate) fn build(self) -> Result<HybridCache> {
        let cache = match self.attn {
            AttentionPlan::Window(p) => AttentionPart::Window(IswaCache::new(p)?),
            AttentionPlan::Full(p) => AttentionPart::Full(p.build()?),
        };
        Ok(HybridCache {
            attn: HybridAttention {
                layers: self.attn_layers,
                cache,
            },
            recr: HybridRecurrent {
                layers: self.recr_layers,
                memory: RecurrentMemory::new(self.recr, self.declared)?,
            },
            rope: self.rope,
        })
    }
}

impl HybridCache {
    /// The memory 0.1.161 builds for a hybrid `model` in `ctx`: an attention cache of
    /// `n_ctx_seq` cells per stream, and one state cell per sequence.
    pub fn for_model(model: &ModelInfo, ctx: &ContextParams) -> Result<HybridCache> {
        HybridPlan::for_model(model, ctx)?.build()
    }

    /// The attention part.
    pub fn attention(&self) -> &HybridAttention {
        &self.attn
    }

    /// The recurrent part.
    pub fn recurrent(&self) -> &HybridRecurrent {
        &self.recr
    }

    /// The cache holding model layer `il` (stream `stream` of the attention part, or the
    /// recurrent memory, whose one stream is 0) and its layer index there.
    pub fn route(&self, il: u32, stream: u32) -> Result<(&SeedCache, u32)> {
        if let Ok(k) = self.attn.layers.binary_search(&il) {
            let (cache, k) = self.attn.cache.route(k as u32)?;
            return Ok((cache.stream(stream)?, k));
        }
        match self.recr.layers.binary_search(&il) {
            Ok(k) if stream == 0 => Ok((self.recr.memory.cache(), k as u32)),
            Ok(_) => Err(KvError::OutOfRange(format!(
                "stream {stream} is out of range [0, 1) for recurrent layer {il}"
            ))),
            Err(_) => Err(self.no_layer(il)),
        }
    }

    /// [`HybridCache::route`], to write rows.
    pub fn route_mut(&mut self, il: u32, stream: u32) -> Result<(&mut SeedCache, u32)> {
        let err = self.no_layer(il);
        if let Ok(k) = self.attn.layers.binary_search(&il) {
            let (cache, k) = self.attn.cache.route_mut(k as u32)?;
            return Ok((cache.stream_mut(stream)?, k));
        }
        match self.recr.layers.binary_search(&il) {
            Ok(k) if stream == 0 => Ok((self.recr.memory.cache_mut(), k as u32)),
            Ok(_) => Err(KvError::OutOfRange(format!(
                "stream {stream} is out of range [0, 1) for recurrent layer {il}"
            ))),
            Err(_) => Err(err),
        }
    }

    /// The recurrent memory's cache and the index of model layer `il` there, for a layer that
    /// keeps a recurrent state (a Falcon-H1 layer keeps K/V too, which [`HybridCache::route`]
    /// finds).
    pub fn route_recurrent(&self, il: u32) -> Result<(&SeedCache, u32)> {
        let k = self.recurrent_index(il)?;
        Ok((self.recr.memory.cache(), k))
    }

    /// [`HybridCache::route_recurrent`], to write rows.
    pub fn route_recurrent_mut(&mut self, il: u32) -> Result<(&mut SeedCache, u32)> {
        let k = self.recurrent_index(il)?;
        Ok((self.recr.memory.cache_mut(), k))
    }

    fn recurrent_index(&self, il: u32) -> Result<u32> {
        match self.recr.layers.binary_search(&il) {
            Ok(k) => Ok(k as u32),
            Err(_) if il < self.recr.memory.declared_layers() => Err(no_recurrent_state(il)),
            Err(_) => Err(self.no_layer(il)),
        }
    }

    fn no_layer(&self, il: u32) -> KvError {
        let n_layer = self.recr.memory.declared_layers();
        if il < n_layer {
            KvError::OutOfRange(format!(
                "layer {il} keeps nothing in this memory: it is neither an attention layer nor \
                 a recurrent one (an MLP-only or multi-token-prediction layer)"
            ))
        } else {
            KvError::OutOfRange(format!("layer {il} is out of range [0, {n_layer})"))
        }
    }

    /// Places the ubatches of one decode in both parts (recurrent first, as 0.1.161
    /// prepares it), or (`None`) in neither; per ubatch, where its tokens went in each cache
    /// of the attention part.
    #[allow(clippy::type_complexity)]
    pub fn place(
        &mut self,
        ubatches: &[UBatch],
    ) -> Result<Option<Vec<Vec<(PartRole, StreamSlot)>>>> {
        let kept = (
            self.recr.memory.cache().cells.clone(),
            self.recr.memory.cache().head,
            self.recr.memory.cache().n,
        );
        if !self.recr.memory.place(ubatches)? {
            return Ok(None);
        }
        match self.attn.cache.place(ubatches) {
            Ok(Some(slots)) => Ok(Some(slots)),
            other => {
                let c = self.recr.memory.cache_mut();
                (c.cells, c.head, c.n) = kept;
                other
            }
        }
    }

    /// Applies a pending K-shift of the attention part (the recurrent part keeps no
    /// rotated rows); `shift` gives the rotation per model layer. A model without RoPE needs
    /// none: its pending shift is done at once.
    pub fn update(&mut self, shift: Option<&ShiftParams>) -> Result<UpdateReport> {
        if !self.rope {
            either!(&mut self.attn.cache, c => c.drop_shift());
            return Ok(UpdateReport::default());
        }
        let params = shift.map(|s| s.for_layers(&self.attn.layers));
        either!(&mut self.attn.cache, c => c.update(params.as_ref()))
    }

    /// The state of `seq` (-1: everything) as 0.1.161 writes it: the attention part in
    /// `layout`, then the recurrent part.
    pub fn state_write(&self, seq: i32, layout: Layout) -> Result<Vec<u8>> {
        let mut out = either!(&self.attn.cache, c => c.state_write(seq, layout))?;
        out.extend(self.recr.memory.state_write(seq)?);
        Ok(out)
    }

    /// llama.cpp's `PARTIAL_ONLY` state of `seq` (a context checkpoint): the recurrent part,
    /// after the window cache when the attention part is iSWA (hybrid-iSWA).
    pub fn state_write_partial(&self, seq: i32, layout: Layout) -> Result<Vec<u8>> {
        let mut out = match &self.attn.cache {
            AttentionPart::Full(_) => Vec::new(),
            AttentionPart::Window(c) => c.state_write_partial(seq, layout)?,
        };
        out.extend(self.recr.memory.state_write(seq)?);
        Ok(out)
    }

    /// Bytes of [`HybridCache::state_write`]`(seq, layout)`.
    pub fn state_size(&self, seq: i32, layout: Layout) -> Result<usize> {
        let recr = self.recr.memory.cache().state_size(seq, Layout::Seed, 1)?;
        Ok(either!(&self.attn.cache, c => c.state_size(seq, layout))? + recr)
    }

    /// Reads a payload of both parts into `seq` (-1: everything); both are parsed and
    /// checked before either changes.
    pub fn state_read(&mut self, data: &[u8], seq: i32, layout: Layout) -> Result<ReadSummary> {
        let checked = self.check_payload(data, seq, layout, false)?;
        self.apply_payload(data, checked, seq)
    }
}

/// The parameters of a part holding `layers` of a model whose every layer `all` describes,
/// with `size` cells and the K/V widths `widths(il)` per model layer.
fn part_params(
    all: &CacheParams,
    layers: &[u32],
    size: u32,
    widths: impl Fn(usize) -> (u32, u32),
) -> CacheParams {
    let mut p = all.clone();
    p.size = size;
    p.n_layer = layers.len() as u32;
    (p.n_embd_k_gqa, p.n_embd_v_gqa) = layers.iter().map(|&il| widths(il as usize)).unzip();
    (p.n_embd_k_s, p.n_embd_v_s) = (0, 0);
    p.recurrent = false;
    p
}

/// A read of a hybrid memory's payload, checked in every part it reads; the recurrent state
/// follows the attention part's bytes.
pub(crate) enum HybridRead {
    /// Both parts.
    Both(AttentionChecked),
    /// A partial state of a hybrid-iSWA memory: its window cache, then the recurrent state.
    Window(CheckedRead),
    /// A partial state of the recurrent part alone, which every layout reads alike.
    Recurrent(Layout),
}

impl HybridRead {
    /// Bytes of the attention part's read.
    fn attention_len(&self) -> usize {
        match self {
            HybridRead::Both(a) => a.len(),
            HybridRead::Window(c) => c.len(),
            HybridRead::Recurrent(_) => 0,
        }
    }
}

impl CheckedPayload for HybridRead {
    fn layout(&self) -> Layout {
        match self {
            HybridRead::Both(AttentionChecked::Full(c)) | HybridRead::Window(c) => c.layout(),
            HybridRead::Both(AttentionChecked::Window(c)) => c.layout(),
            HybridRead::Recurrent(layout) => *layout,
        }
    }

    fn has_no_data_header(&self) -> bool {
        match self {
            HybridRead::Both(AttentionChecked::Full(c)) | HybridRead::Window(c) => {
                c.has_no_data_header()
            }
            HybridRead::Both(AttentionChecked::Window(c)) => c.has_no_data_header(),
            HybridRead::Recurrent(_) => true,
        }
    }
}

impl PartsPayload for HybridCache {
    const NAME: &'static str = "hybrid";
    type Checked = HybridRead;
    fn write_parts(&self, seq: i32, layout: Layout) -> Result<Vec<u8>> {
        HybridCache::state_write(self, seq, layout)
    }
    /// A partial state is the recurrent part's, after the window cache's in hybrid-iSWA; the
    /// attention cache keeps what it holds, as in llama.cpp.
    fn check_payload(
        &self,
        data: &[u8],
        seq: i32,
        layout: Layout,
        partial: bool,
    ) -> Result<HybridRead> {
        let read = match (partial, &self.attn.cache) {
            (false, part) => HybridRead::Both(part.check_read(data, seq, layout)?),
            (true, AttentionPart::Window(c)) => HybridRead::Window(c.check_swa(data, seq, layout)?),
            (true, AttentionPart::Full(_)) => HybridRead::Recurrent(layout),
        };
        self.recr
            .memory
            .check_read(&data[read.attention_len()..], seq)?;
        Ok(read)
    }
    fn apply_payload(&mut self, data: &[u8], checked: HybridRead, seq: i32) -> Result<ReadSummary> {
        let (first, second) = data.split_at(checked.attention_len());
        let attention = match (checked, &mut self.attn.cache) {
            (HybridRead::Both(a), part) => Some(part.apply_read(first, a, seq)?),
            (HybridRead::Window(c), AttentionPart::Window(iswa)) => {
                Some(iswa.apply_swa(first, c, seq)?)
            }
            (HybridRead::Recurrent(_), _) => None,
            (HybridRead::Window(_), AttentionPart::Full(_)) => {
                unreachable!("a window cache's read is applied to the window cache that checked it")
            }
        };
        let recurrent = self.recr.memory.state_read(second, seq)?;
        Ok(match attention {
            Some(a) => ReadSummary::together([a, recurrent]),
            None => recurrent,
        })
    }
}

impl Memory for HybridCache {
    parts_payload_io!();

    fn kind(&self) -> &'static str {
        "hybrid"
    }

    fn state_kind(&self) -> MemoryKind {
        MemoryKind::Hybrid
    }

    fn parts(&self) -> Vec<PartInfo> {
        let cache = self.recr.memory.cache();
        let mut parts: Vec<PartInfo> = (self.attn.cache.caches().into_iter())
            .map(|(role, part, own)| {
                let layers: Vec<u32> = own.iter().map(|&k| self.attn.layers[k as usize]).collect();
                part.part_info(role, &layers)
            })
            .collect();
        parts.push(PartInfo::of(
            PartRole::Recurrent,
            self.recr.layers.clone(),
            cache.params(),
            1,
            Window::FULL,
            cache.used_cells(),
            cache.total_size() as u64,
        ));
        parts
    }

    fn attention_streams(&self, seq: i32) -> Result<Vec<(PartRole, Window, &SeedCache)>> {
        (self.attn.cache.caches().into_iter())
            .map(|(role, part, _)| part.holding(role, seq))
            .collect()
    }

    fn caches(&self) -> Vec<&SeedCache> {
        let mut all: Vec<&SeedCache> = (self.attn.cache.caches().into_iter())
            .flat_map(|(_, part, _)| part.streams())
            .collect();
        all.push(self.recr.memory.cache());
        all
    }

    fn caches_mut(&mut self) -> Vec<&mut SeedCache> {
        let mut all = match &mut self.attn.cache {
            AttentionPart::Full(c) => c.streams_mut(),
            AttentionPart::Window(c) => c.caches_mut(),
        };
        all.push(self.recr.memory.cache_mut());
        all
    }

    fn n_seq_max(&self) -> u32 {
        self.recr.memory.cache().params().n_seq_max
    }

    fn can_shift(&self) -> bool {
        self.attn.cache.can_shift()
    }

    fn has_shift(&self) -> bool {
        self.attn.cache.has_shift()
    }

    /// `seq_rm`: the recurrent part first, which may refuse (then nothing changes).
    fn seq_rm(&mut self, seq: i32, p0: i32, p1: i32) -> Result<bool> {
        if seq != -1 {
            self.attn.cache.check_seq("seqRm", seq)?;
        }
        if !self.recr.memory.seq_rm(seq, p0, p1)? {
            return Ok(false);
        }
        either!(&mut self.attn.cache, c => c.seq_rm(seq, p0, p1))
    }

    /// `seq_cp` in both parts (the recurrent part shares the source's state cell).
    fn seq_cp(&mut self, src: i32, dst: i32, p0: i32, p1: i32) -> Result<()> {
        self.attn.cache.check_seq("seqCp source", src)?;
        self.attn.cache.check_seq("seqCp destination", dst)?;
        either!(&mut self.attn.cache, c => c.seq_cp(src, dst, p0, p1))?;
        self.recr.memory.seq_cp(src, dst, p0, p1)
    }

    /// `seq_keep` in both parts.
    fn seq_keep(&mut self, seq: i32) -> Result<()> {
        self.attn.cache.check_seq("seqKeep", seq)?;
        either!(&mut self.attn.cache, c => c.seq_keep(seq))?;
        self.recr.memory.seq_keep(seq)
    }

    /// `seq_add` in both parts.
    fn seq_add(&mut self, seq: i32, p0: i32, p1: i32, delta: i32) -> Result<()> {
        self.attn.cache.check_seq("seqAdd", seq)?;
        either!(&mut self.attn.cache, c => c.seq_add(seq, p0, p1, delta))?;
        self.recr.memory.seq_add(seq, p0, p1, delta)
    }

    /// `seq_div` in both parts.
    fn seq_div(&mut self, seq: i32, p0: i32, p1: i32, d: i32) -> Result<()> {
        self.attn.cache.check_seq("seqDiv", seq)?;
        either!(&mut self.attn.cache, c => c.seq_div(seq, p0, p1, d))?;
        self.recr.memory.seq_div(seq, p0, p1, d)
    }

    /// Smallest position both parts hold of `seq` (0.1.161: the larger of their minima).
    fn seq_pos_min(&self, seq: i32) -> Result<i32> {
        let attn = either!(&self.attn.cache, c => c.seq_pos_min(seq))?;
        Ok(attn.max(self.recr.memory.seq_pos_min(seq)?))
    }

    /// Largest position both parts hold of `seq` (0.1.161: the smaller of their maxima).
    fn seq_pos_max(&self, seq: i32) -> Result<i32> {
        let attn = either!(&self.attn.cache, c => c.seq_pos_max(seq))?;
        Ok(attn.min(self.recr.memory.seq_pos_max(seq)?))
    }

    /// Frees every cell of both parts.
    fn clear(&mut self) -> Result<()> {
        either!(&mut self.attn.cache, c => c.clear())?;
        self.recr.memory.clear()
    }

    /// The attention part's placements, then each group's state cell in the recurrent part.
    fn place(&mut self, ubatches: &[UBatch]) -> Result<Option<Placements>> {
        let Some(attn) = HybridCache::place(self, ubatches)? else {
            return Ok(None);
        };
        let cells = self.recr.memory.cache().cells();
        let placed = attn.into_iter().zip(ubatches).map(|(a, ub)| {
            let mut v: Vec<Placement> = (a.into_iter())
                .map(|(role, s)| stream_placement(role, s))
                .collect();
            v.push(recurrent_placement(PartRole::Recurrent, cells, ub));
            v
        });
        Ok(Some(placed.collect()))
    }

    fn layer_cache(&self, il: u32, rows: LayerRows, stream: u32) -> Result<(&SeedCache, u32)> {
        match rows {
            LayerRows::Own(_) => self.route(il, stream),
            LayerRows::State(_) if stream != 0 => Err(no_stream(stream, 1)),
            LayerRows::State(_) => self.route_recurrent(il),
        }
    }

    fn layer_cache_mut(
        &mut self,
        il: u32,
        rows: LayerRows,
        stream: u32,
    ) -> Result<(&mut SeedCache, u32)> {
        match rows {
            LayerRows::Own(_) => self.route_mut(il, stream),
            LayerRows::State(_) if stream != 0 => Err(no_stream(stream, 1)),
            LayerRows::State(_) => self.route_recurrent_mut(il),
        }
    }

    fn state_size(&self, seq: i32, opts: &WriteOptions) -> Result<usize> {
        HybridCache::state_size(self, seq, opts.layout)
    }

    fn state_write_partial(&self, seq: i32, layout: Layout) -> Result<Vec<u8>> {
        HybridCache::state_write_partial(self, seq, layout)
    }

    fn update(&mut self, shift: Option<&ShiftParams>, _: Option<u32>) -> Result<UpdateReport> {
        HybridCache::update(self, shift)
    }

    fn recurrent_part_state(&self, seq: i32) -> Result<Option<Vec<u8>>> {
        Ok(Some(self.recr.memory.state_write(seq)?))
    }
}
