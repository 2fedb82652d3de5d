//! llama.cpp 0.1.161's `llama_kv_cache` of a unified model in a context of a stream per
//! sequence (`kv_unified` false), kind `kv-streams`: an [`AttentionCache`] of one part as a
//! [`Memory`], and what every memory with attention parts asks of those parts.

use crate::cache::io::ReadSummary;
use crate::cache::kshift::UpdateReport;
use crate::cache::SeedCache;
use crate::cells::ubatch::UBatch;
use crate::error::Result;
use crate::memory::attention::{AttentionCache, CheckedRead};
use crate::memory::interface::{stream_placement, LayerRows, Memory, Placements};
use crate::memory::part::PartInfo;
use crate::memory::parts_payload::{parts_payload_io, PartsPayload};
use crate::memory::placement::Window;
use crate::memory::recurrent::no_recurrent_state;
use crate::model::MemoryKind;
use crate::state::files::WriteOptions;
use crate::state::parts::PartRole;
use crate::state::Layout;
use crate::tensors::rope::ShiftParams;

impl AttentionCache {
    /// This cache as the part `role` of a memory, holding model layers `layers`.
    pub(crate) fn part_info(&self, role: PartRole, layers: &[u32]) -> PartInfo {
        PartInfo::of(
            role,
            layers.to_vec(),
            self.params(),
            self.n_stream(),
            self.window(),
            self.used_cells(),
            self.total_size() as u64,
        )
    }

    /// The stream that holds `seq`, with the part's role and window.
    pub(crate) fn holding(
        &self,
        role: PartRole,
        seq: i32,
    ) -> Result<(PartRole, Window, &SeedCache)> {
        let stream = self.stream(self.stream_of("seq", seq)? as u32)?;
        Ok((role, self.window(), stream))
    }

    /// Every stream.
    pub(crate) fn streams(&self) -> Vec<&SeedCache> {
        (0..self.n_stream())
            .filter_map(|s| self.stream(s).ok())
            .collect()
    }
}

impl PartsPayload for AttentionCache {
    const NAME: &'static str = "per-sequence-stream";
    type Checked = CheckedRead;
    fn write_parts(&self, seq: i32, layout: Layout) -> Result<Vec<u8>> {
        AttentionCache::state_write(self, seq, layout)
    }
    fn check_payload(&self, data: &[u8], seq: i32, layout: Layout, _: bool) -> Result<CheckedRead> {
        self.check_read(data, seq, layout, true)
    }
    fn apply_payload(
        &mut self,
        data: &[u8],
        checked: CheckedRead,
        seq: i32,
    ) -> Result<ReadSummary> {
        self.apply_read(data, checked, seq)
    }
}

impl Memory for AttentionCache {
    parts_payload_io!();

    fn kind(&self) -> &'static str {
        "kv-streams"
    }

    fn state_kind(&self) -> MemoryKind {
        MemoryKind::Unified
    }

    fn parts(&self) -> Vec<PartInfo> {
        let layers: Vec<u32> = (0..self.params().n_layer).collect();
        vec![self.part_info(PartRole::Whole, &layers)]
    }

    fn attention_streams(&self, seq: i32) -> Result<Vec<(PartRole, Window, &SeedCache)>> {
        Ok(vec![self.holding(PartRole::Whole, seq)?])
    }

    fn caches(&self) -> Vec<&SeedCache> {
        self.streams()
    }

    fn caches_mut(&mut self) -> Vec<&mut SeedCache> {
        self.streams_mut()
    }

    fn n_seq_max(&self) -> u32 {
        self.params().n_seq_max
    }

    fn can_shift(&self) -> bool {
        AttentionCache::can_shift(self)
    }

    fn has_shift(&self) -> bool {
        AttentionCache::has_shift(self)
    }

    fn seq_rm(&mut self, seq: i32, p0: i32, p1: i32) -> Result<bool> {
        AttentionCache::seq_rm(self, seq, p0, p1)
    }

    fn seq_cp(&mut self, src: i32, dst: i32, p0: i32, p1: i32) -> Result<()> {
        AttentionCache::seq_cp(self, src, dst, p0, p1)
    }

    fn seq_keep(&mut self, seq: i32) -> Result<()> {
        AttentionCache::seq_keep(self, seq)
    }

    fn seq_add(&mut self, seq: i32, p0: i32, p1: i32, delta: i32) -> Result<()> {
        AttentionCache::seq_add(self, seq, p0, p1, delta)
    }

    fn seq_div(&mut self, seq: i32, p0: i32, p1: i32, d: i32) -> Result<()> {
        AttentionCache::seq_div(self, seq, p0, p1, d)
    }

    fn seq_pos_min(&self, seq: i32) -> Result<i32> {
        AttentionCache::seq_pos_min(self, seq)
    }

    fn seq_pos_max(&self, seq: i32) -> Result<i32> {
        AttentionCache::seq_pos_max(self, seq)
    }

    fn clear(&mut self) -> Result<()> {
        AttentionCache::clear(self)
    }

    fn place(&mut self, ubatches: &[UBatch]) -> Result<Option<Placements>> {
        let placed = AttentionCache::place(self, ubatches)?;
        Ok(placed.map(|all| {
            all.into_iter()
                .map(|slots| {
                    (slots.into_iter())
                        .map(|s| stream_placement(PartRole::Whole, s))
                        .collect()
                })
                .collect()
        }))
    }

    fn layer_cache(&self, il: u32, rows: LayerRows, stream: u32) -> Result<(&SeedCache, u32)> {
        match rows {
            LayerRows::State(_) => Err(no_recurrent_state(il)),
            LayerRows::Own(_) => Ok((self.stream(stream)?, il)),
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
            LayerRows::Own(_) => Ok((self.stream_mut(stream)?, il)),
        }
    }

    fn state_size(&self, seq: i32, opts: &WriteOptions) -> Result<usize> {
        AttentionCache::state_size(self, seq, opts.layout)
    }

    fn update(&mut self, shift: Option<&ShiftParams>, _: Option<u32>) -> Result<UpdateReport> {
        AttentionCache::update(self, shift)
    }
}
