//! The seed's cache (llama.cpp b4944's unified cache, or its recurrent mode) as a
//! [`Memory`]: one part of one stream, its own streamed files and in-place state writes.

use std::path::Path;
use std::time::Instant;

use crate::cache::io::{Progress, ReadOptions, ReadSummary};
use crate::cache::kshift::UpdateReport;
use crate::cache::save_load::LoadedFile;
use crate::cache::SeedCache;
use crate::cells::ubatch::UBatch;
use crate::error::Result;
use crate::memory::interface::{
    no_stream, recurrent_placement, LayerRows, Memory, Placement, Placements,
};
use crate::memory::part::PartInfo;
use crate::memory::placement::Window;
use crate::memory::recurrent::no_recurrent_state;
use crate::model::MemoryKind;
use crate::state::files::{read_file, seq_data_payload, WriteOptions};
use crate::state::parts::PartRole;
use crate::tensors::rope::ShiftParams;

impl Memory for SeedCache {
    fn kind(&self) -> &'static str {
        if self.recurrent() {
            "recurrent"
        } else {
            "kv"
        }
    }

    fn state_kind(&self) -> MemoryKind {
        MemoryKind::Unified
    }

    fn parts(&self) -> Vec<PartInfo> {
        let p = self.params();
        vec![PartInfo::of(
            PartRole::Whole,
            (0..p.n_layer).collect(),
            p,
            1,
            Window::FULL,
            self.used_cells(),
            self.total_size() as u64,
        )]
    }

    fn attention_streams(&self, _seq: i32) -> Result<Vec<(PartRole, Window, &SeedCache)>> {
        Ok(if self.recurrent() {
            Vec::new()
        } else {
            vec![(PartRole::Whole, Window::FULL, self)]
        })
    }

    fn caches(&self) -> Vec<&SeedCache> {
        vec![self]
    }

    fn caches_mut(&mut self) -> Vec<&mut SeedCache> {
        vec![self]
    }

    fn n_seq_max(&self) -> u32 {
        self.params().n_seq_max
    }

    fn can_shift(&self) -> bool {
        SeedCache::can_shift(self)
    }

    fn has_shift(&self) -> bool {
        SeedCache::has_shift(self)
    }

    fn seq_rm(&mut self, seq: i32, p0: i32, p1: i32) -> Result<bool> {
        SeedCache::seq_rm(self, seq, p0, p1)
    }

    fn seq_cp(&mut self, src: i32, dst: i32, p0: i32, p1: i32) -> Result<()> {
        SeedCache::seq_cp(self, src, dst, p0, p1)
    }

    fn seq_keep(&mut self, seq: i32) -> Result<()> {
        SeedCache::seq_keep(self, seq)
    }

    fn seq_add(&mut self, seq: i32, p0: i32, p1: i32, delta: i32) -> Result<()> {
        SeedCache::seq_add(self, seq, p0, p1, delta)
    }

    fn seq_div(&mut self, seq: i32, p0: i32, p1: i32, d: i32) -> Result<()> {
        SeedCache::seq_div(self, seq, p0, p1, d)
    }

    fn seq_pos_min(&self, seq: i32) -> Result<i32> {
        let s = self.check_seq("seqPosMin", seq)?;
        Ok(self.cells().seq_pos_min(s).unwrap_or(-1))
    }

    fn seq_pos_max(&self, seq: i32) -> Result<i32> {
        SeedCache::seq_pos_max(self, seq)
    }

    fn clear(&mut self) -> Result<()> {
        SeedCache::clear(self)
    }

    /// A ubatch's tokens in a run of cells from the slot's head, or a recurrent ubatch's
    /// groups in their sequences' state cells.
    fn place(&mut self, ubatches: &[UBatch]) -> Result<Option<Placements>> {
        let Some(slots) = SeedCache::place(self, ubatches)? else {
            return Ok(None);
        };
        let placed = slots.iter().zip(ubatches).map(|(slot, ub)| {
            vec![if self.recurrent() {
                recurrent_placement(PartRole::Whole, self.cells(), ub)
            } else {
                Placement {
                    role: PartRole::Whole,
                    stream: 0,
                    cells: (slot.head..slot.head + slot.len).collect(),
                    tokens: (0..slot.len).collect(),
                }
            }]
        });
        Ok(Some(placed.collect()))
    }

    fn layer_cache(&self, il: u32, rows: LayerRows, stream: u32) -> Result<(&SeedCache, u32)> {
        self.check_layer_rows(il, rows, stream)?;
        Ok((self, il))
    }

    fn layer_cache_mut(
        &mut self,
        il: u32,
        rows: LayerRows,
        stream: u32,
    ) -> Result<(&mut SeedCache, u32)> {
        self.check_layer_rows(il, rows, stream)?;
        Ok((self, il))
    }

    fn state_size(&self, seq: i32, opts: &WriteOptions) -> Result<usize> {
        SeedCache::state_size(self, seq, opts.layout, opts.n_stream)
    }

    fn state_write(
        &self,
        seq: i32,
        opts: &WriteOptions,
        progress: Option<Progress<'_>>,
    ) -> Result<Vec<u8>> {
        SeedCache::state_write(self, seq, opts.layout, opts.n_stream, progress)
    }

    fn state_write_into(
        &self,
        out: &mut [u8],
        seq: i32,
        opts: &WriteOptions,
        progress: Option<Progress<'_>>,
    ) -> Result<usize> {
        SeedCache::state_write_into(self, out, seq, opts.layout, opts.n_stream, progress)
    }

    fn state_read(
        &mut self,
        data: &[u8],
        seq: i32,
        opts: ReadOptions,
        progress: Option<Progress<'_>>,
    ) -> Result<ReadSummary> {
        // the in-memory form of llama_state_seq_get_data reads as its payload
        SeedCache::state_read(self, seq_data_payload(data), seq, opts, progress)
    }

    fn save_file(
        &self,
        path: &Path,
        seq: Option<i32>,
        tokens: &[i32],
        arch: &str,
        opts: WriteOptions,
        progress: Option<Progress<'_>>,
    ) -> Result<()> {
        match seq {
            Some(seq) => self.save_sequence_file(path, seq, tokens, opts, progress),
            None => self.save_session_file(path, tokens, arch, None, opts, progress),
        }
    }

    fn load_file(
        &mut self,
        path: &Path,
        dest: Option<i32>,
        opts: ReadOptions,
        progress: Option<Progress<'_>>,
    ) -> Result<LoadedFile> {
        match dest {
            // streamed from the file where it holds one memory
            Some(dest) => self.load_sequence_file(path, dest, opts, progress),
            None => self.load_session_bytes(&read_file(path)?, opts, progress),
        }
    }

    fn update(
        &mut self,
        shift: Option<&ShiftParams>,
        max_nodes: Option<u32>,
    ) -> Result<UpdateReport> {
        SeedCache::update(self, shift, max_nodes)
    }

    fn next_release(&self) -> Option<Instant> {
        SeedCache::next_release(self)
    }

    fn seed(&self) -> Option<&SeedCache> {
        Some(self)
    }

    fn seed_mut(&mut self) -> Option<&mut SeedCache> {
        Some(self)
    }
}

impl SeedCache {
    /// Refuses rows of layer `il` this cache does not hold: a recurrent state in an attention
    /// cache, or a stream other than its one.
    fn check_layer_rows(&self, il: u32, rows: LayerRows, stream: u32) -> Result<()> {
        if matches!(rows, LayerRows::State(_)) && !self.recurrent() {
            return Err(no_recurrent_state(il));
        }
        if stream != 0 {
            return Err(no_stream(stream, 1));
        }
        Ok(())
    }
}
