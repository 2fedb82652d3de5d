//! Layer 4, the unified KV cache (`llama_kv_cache_unified`): the memory kind built on the
//! layers below. [`SeedCache`] holds cells and tensors; each concern extends it in a module of
//! its own: sequence operations ([`seq_ops`]), slot search ([`slot`], [`restorer`]), defrag
//! ([`defrag`]), the K-shift ([`kshift`]), views ([`view`]), state I/O on whole payloads
//! ([`io`]), on streamed payloads ([`stream`]), row block by row block ([`sequence_load`]) and
//! in files ([`files`]), load rollback (`rollback`) and file conversion ([`convert`]).
//!
//! May import every layer below (`cells`, `tensors`, `model`, `state` and the base modules).

pub mod convert;
mod convert_input;
pub mod defrag;
pub mod io;
pub mod kshift;
mod release;
pub mod release_policy;
pub mod restorer;
pub(crate) mod rollback;
pub mod save_load;
pub mod seq_ops;
pub mod sequence_load;
pub mod slot;
pub mod stream;
pub mod view;

use crate::cache::release_policy::{Pending, Release};
use crate::cells::{Cells, MAX_SEQ};
use crate::error::{KvError, Result};
use crate::ggml_type::GgmlType;
use crate::params::CacheParams;
use crate::tensors::quant;
use crate::tensors::storage::{host_allocator, Allocator, Device, LayerTensors, Tensor, VGeometry};

/// llama.cpp's `llama_kv_cache_unified`: cells, their bookkeeping, and the K/V tensors.
pub struct SeedCache {
    pub(crate) params: CacheParams,
    pub(crate) cells: Cells,
    /// A cell table of the same shape, kept between whole-cache loads: a load fills it and
    /// keeps the live one as its undo record, instead of copying the live one first.
    pub(crate) spare_cells: Option<Box<Cells>>,
    pub(crate) head: u32,
    pub(crate) n: u32,
    pub(crate) has_shift: bool,
    pub(crate) do_defrag: bool,
    pub(crate) layers: Vec<LayerTensors>,
    /// How `clear` and the operations that free cells hand the tensors' memory back to the OS
    /// ([`SeedCache::set_release`]).
    pub(crate) release: Release,
    /// Freed cells awaiting release by decay.
    pub(crate) pending: Pending,
}

impl SeedCache {
    /// A cache in host memory, zero-initialised.
    pub fn new(params: CacheParams) -> Result<SeedCache> {
        SeedCache::with_allocator(params, &mut host_allocator)
    }

    /// A cache whose tensors come from `alloc` (one call per layer and tensor), e.g. to place
    /// layers on a device.
    pub fn with_allocator(params: CacheParams, alloc: &mut Allocator<'_>) -> Result<SeedCache> {
        params.validate()?;
        SeedCache::build(params, alloc)
    }

    /// A cache in host memory that is a part of a memory: it may hold no layer (cells only).
    pub(crate) fn new_part(params: CacheParams) -> Result<SeedCache> {
        SeedCache::part_with_allocator(params, &mut host_allocator)
    }

    /// [`SeedCache::new_part`] with tensors from `alloc`.
    pub(crate) fn part_with_allocator(
        params: CacheParams,
        alloc: &mut Allocator<'_>,
    ) -> Result<SeedCache> {
        params.validate_part()?;
        SeedCache::build(params, alloc)
    }

    fn build(params: CacheParams, alloc: &mut Allocator<'_>) -> Result<SeedCache> {
        let size = params.size as usize;
        let mut layers = crate::alloc::with_capacity(params.n_layer as usize, "the layers")?;
        for il in 0..params.n_layer as usize {
            let mut layer = LayerTensors::allocate(
                il,
                params.n_embd_k(il),
                params.n_embd_v(il),
                params.type_k,
                params.type_v,
                size,
                alloc,
            )?;
            // device memory does not start zeroed; the seed clears every buffer to avoid NaNs
            layer.k.fill_zero()?;
            layer.v.fill_zero()?;
            layers.push(layer);
        }
        // after the tensors: those are lazily zeroed, the cell columns are written now (-1), so
        // an impossible size fails on the tensors before any page is touched
        let mut cells = Cells::new(size, params.n_seq_max as usize)?;
        if !params.cell_ext.is_none() {
            cells.keep_ext()?;
        }
        Ok(SeedCache {
            cells,
            spare_cells: None,
            head: 0,
            // a worst-case graph reserve leaves n = size before the first decode
            n: params.size,
            has_shift: false,
            do_defrag: false,
            layers,
            release: Release::default(),
            pending: Pending::default(),
            params,
        })
    }

    /// The parameters the cache was built with.
    pub fn params(&self) -> &CacheParams {
        &self.params
    }

    /// Number of cells.
    pub fn size(&self) -> u32 {
        self.params.size
    }

    /// Number of layers.
    pub fn n_layer(&self) -> u32 {
        self.params.n_layer
    }

    /// Where the next slot search starts.
    pub fn head(&self) -> u32 {
        self.head
    }

    /// Cells the attention computation looks at (set by `find_slot` for recurrent models and
    /// by `prepare_batch` for transformers).
    pub fn n(&self) -> u32 {
        self.n
    }

    /// The seed's `used` counter.
    pub fn used_cells(&self) -> u32 {
        self.cells.used
    }

    /// Sum over cells of the number of sequences owning each (a cell shared by 3 sequences
    /// counts 3), as the seed's `get_n_tokens`.
    pub fn n_tokens(&self) -> u64 {
        self.cells.n_tokens()
    }

    /// Largest cell position, -1 when every cell is free.
    pub fn pos_max(&self) -> i32 {
        self.cells
            .pos_column()
            .iter()
            .copied()
            .max()
            .unwrap_or(-1)
            .max(-1)
    }

    /// One past the last cell that holds a position and a sequence (0 when none does).
    pub fn cell_max(&self) -> u32 {
        self.cells.cell_max() as u32
    }

    /// Whether the cache can apply a K-shift (not recurrent, not disabled).
    pub fn can_shift(&self) -> bool {
        self.params.can_shift && !self.params.recurrent
    }

    /// Whether sequence positions changed since the last K-shift.
    pub fn has_shift(&self) -> bool {
        self.has_shift
    }

    /// Whether a defrag is pending.
    pub fn defrag_pending(&self) -> bool {
        self.do_defrag
    }

    /// Whether V is stored transposed.
    pub fn v_trans(&self) -> bool {
        self.params.v_trans()
    }

    /// Whether the cache is recurrent.
    pub fn recurrent(&self) -> bool {
        self.params.recurrent
    }

    /// Padding of `n` (256 with flash attention, else 32).
    pub fn padding(&self) -> u32 {
        self.params.padding()
    }

    /// Type of K.
    pub fn type_k(&self) -> GgmlType {
        self.params.type_k
    }

    /// Type of V.
    pub fn type_v(&self) -> GgmlType {
        self.params.type_v
    }

    /// The cell metadata.
    pub fn cells(&self) -> &Cells {
        &self.cells
    }

    /// Bytes of all K tensors.
    pub fn size_k_bytes(&self) -> usize {
        self.layers.iter().map(|l| l.k.len()).sum()
    }

    /// Bytes of all V tensors.
    pub fn size_v_bytes(&self) -> usize {
        self.layers.iter().map(|l| l.v.len()).sum()
    }

    /// Bytes of all tensors.
    pub fn total_size(&self) -> usize {
        self.size_k_bytes() + self.size_v_bytes()
    }

    /// Bytes of one cell's K and V rows over all layers.
    pub(crate) fn bytes_per_cell(&self) -> usize {
        self.layers.iter().map(|l| l.k_row + l.v_row).sum()
    }

    /// Host tensor bytes in memory now: tensors are zeroed lazily, so a page counts once it
    /// was written, and no longer once it was handed back (`clear`, and the operations of
    /// `release` that free cells).
    pub fn host_resident_bytes(&self) -> usize {
        self.layers
            .iter()
            .flat_map(|l| [l.k.as_ref(), l.v.as_ref()])
            .filter(|b| b.device() == Device::Host)
            .map(|b| b.resident_bytes())
            .sum()
    }

    /// Bytes of tensors per device.
    pub fn bytes_per_device(&self) -> Vec<(Device, usize)> {
        let mut out: Vec<(Device, usize)> = Vec::new();
        for buf in self
            .layers
            .iter()
            .flat_map(|l| [l.k.as_ref(), l.v.as_ref()])
        {
            match out.iter_mut().find(|(d, _)| *d == buf.device()) {
                Some((_, n)) => *n += buf.len(),
                None => out.push((buf.device(), buf.len())),
            }
        }
        out
    }

    /// Frees every cell and zeroes the tensors, handing the memory of host tensors (of 1 MiB or
    /// more) back to the OS at once unless [`Release::Off`]. As in the seed, deltas and the
    /// pending shift/defrag flags are left alone.
    pub fn clear(&mut self) -> Result<()> {
        self.cells.reset();
        self.head = 0;
        self.pending = Pending::default();
        for l in &mut self.layers {
            if self.release != Release::Off {
                l.k.release()?;
                l.v.release()?;
            } else {
                l.k.fill_zero()?;
                l.v.fill_zero()?;
            }
        }
        Ok(())
    }

    /// Where V of a cell is: the geometry every layer shares.
    pub(crate) fn v_geometry(&self) -> VGeometry {
        VGeometry {
            size: self.params.size as usize,
            v_trans: self.params.v_trans(),
            v_el: self.params.type_v.type_size(),
        }
    }

    /// The tensors of layer `il`.
    pub fn layer(&self, il: u32) -> Result<&LayerTensors> {
        self.layers.get(il as usize).ok_or_else(|| {
            KvError::OutOfRange(format!(
                "layer {il} is out of range [0, {})",
                self.params.n_layer
            ))
        })
    }

    /// Row size in bytes of `which` in layer `il`.
    pub fn row_size(&self, il: u32, which: Tensor) -> Result<usize> {
        Ok(self.layer(il)?.row_size(which))
    }

    fn check_cells(&self, first: u32, n: u64) -> Result<()> {
        if u64::from(first) + n > u64::from(self.params.size) {
            return Err(KvError::OutOfRange(format!(
                "cells [{first}, {}) exceed the cache size {}",
                u64::from(first) + n,
                self.params.size
            )));
        }
        Ok(())
    }

    /// Writes raw rows in the cache's type for cells `[first, first + n)`, one row per cell
    /// (`rows.len()` must be a multiple of the row size). V is transposed as the layout requires.
    pub fn write_rows(&mut self, il: u32, which: Tensor, first: u32, rows: &[u8]) -> Result<()> {
        let row = self.row_size(il, which)?;
        if rows.is_empty() || !rows.len().is_multiple_of(row) {
            return Err(KvError::InvalidArg(format!(
                "{which} data of layer {il} must be a non-empty multiple of the row size {row} bytes, got {} bytes",
                rows.len()
            )));
        }
        self.check_cells(first, (rows.len() / row) as u64)?;
        let lay = self.v_geometry();
        self.layers[il as usize].write_rows(which, lay, first as usize, rows)
    }

    /// Reads raw rows of cells `[first, first + n)`.
    pub fn read_rows(&self, il: u32, which: Tensor, first: u32, n: u32) -> Result<Vec<u8>> {
        let layer = self.layer(il)?;
        self.check_cells(first, u64::from(n))?;
        layer.read_rows(which, self.v_geometry(), first as usize, n as usize)
    }

    /// Writes f32 rows, converted (quantized) to the cache's type.
    pub fn write_rows_f32(
        &mut self,
        il: u32,
        which: Tensor,
        first: u32,
        values: &[f32],
    ) -> Result<()> {
        let layer = self.layer(il)?;
        let width = match which {
            Tensor::K => layer.n_embd_k,
            Tensor::V => layer.n_embd_v,
        };
        if values.is_empty() || !values.len().is_multiple_of(width) {
            return Err(KvError::InvalidArg(format!(
                "{which} values of layer {il} must be a non-empty multiple of the width {width}, got {}",
                values.len()
            )));
        }
        let ty = self.tensor_type(which);
        let row = layer.row_size(which);
        let mut bytes = crate::alloc::zeroed(values.len() / width * row, "the rows written")?;
        for (src, dst) in values.chunks_exact(width).zip(bytes.chunks_exact_mut(row)) {
            quant::quantize_row(ty, src, dst)?;
        }
        self.write_rows(il, which, first, &bytes)
    }

    /// Reads rows of cells `[first, first + n)` as f32.
    pub fn read_rows_f32(&self, il: u32, which: Tensor, first: u32, n: u32) -> Result<Vec<f32>> {
        let bytes = self.read_rows(il, which, first, n)?;
        let layer = self.layer(il)?;
        let (width, row) = match which {
            Tensor::K => (layer.n_embd_k, layer.k_row),
            Tensor::V => (layer.n_embd_v, layer.v_row),
        };
        let mut out = crate::alloc::zeroed(n as usize * width, "the f32 rows read")?;
        let ty = self.tensor_type(which);
        for (src, dst) in bytes.chunks_exact(row).zip(out.chunks_exact_mut(width)) {
            quant::dequantize_row(ty, src, dst)?;
        }
        Ok(out)
    }

    /// The ggml type of `which`.
    pub fn tensor_type(&self, which: Tensor) -> GgmlType {
        match which {
            Tensor::K => self.params.type_k,
            Tensor::V => self.params.type_v,
        }
    }

    /// A copy of this cache with K and V in other types: every row is converted through f32
    /// (dequantized and requantized with the reference quantizers as needed). Cell metadata is
    /// copied as is. A rotated K or V keeps its rotation into another quantized type and loses
    /// it into a float type, as llama.cpp 0.1.161 rotates quantized types only; see
    /// [`SeedCache::retyped_rotated`] to choose.
    pub fn retyped(&self, type_k: GgmlType, type_v: GgmlType) -> Result<SeedCache> {
        let keep = |n_rot: u32, ty: GgmlType| if ty.is_quantized() { n_rot } else { 0 };
        self.retyped_rotated(
            type_k,
            type_v,
            keep(self.params.n_rot_k, type_k),
            keep(self.params.n_rot_v, type_v),
        )
    }

    /// [`SeedCache::retyped`] to the rotations `n_rot_k` / `n_rot_v` (0: none): each row is
    /// dequantized, rotated back by its current rotation, rotated by the new one, and quantized,
    /// as llama.cpp 0.1.161 would have stored the same values.
    pub fn retyped_rotated(
        &self,
        type_k: GgmlType,
        type_v: GgmlType,
        n_rot_k: u32,
        n_rot_v: u32,
    ) -> Result<SeedCache> {
        let mut params = self.params.clone();
        params.type_k = type_k;
        params.type_v = type_v;
        params.n_rot_k = n_rot_k;
        params.n_rot_v = n_rot_v;
        let mut out = SeedCache::new(params)?;
        let size = self.params.size;
        for il in 0..self.params.n_layer {
            for (which, from, to) in [
                (Tensor::K, self.params.n_rot_k, n_rot_k),
                (Tensor::V, self.params.n_rot_v, n_rot_v),
            ] {
                let mut values = self.read_rows_f32(il, which, 0, size)?;
                if from != to {
                    for n in [from, to].into_iter().filter(|&n| n != 0) {
                        crate::tensors::hadamard::rotate_blocks(&mut values, n as usize);
                    }
                }
                out.write_rows_f32(il, which, 0, &values)?;
            }
        }
        out.cells = self.cells.clone();
        out.head = self.head;
        out.n = self.n;
        out.has_shift = self.has_shift;
        out.do_defrag = self.do_defrag;
        Ok(out)
    }

    /// Where a state read goes: `None` for -1 (the whole cache), else the checked sequence.
    pub(crate) fn read_dest(&self, seq: i32) -> Result<Option<i32>> {
        match seq {
            -1 => Ok(None),
            seq => Ok(Some(self.check_seq("stateRead", seq)? as i32)),
        }
    }

    /// Validates a sequence id for operations on one sequence.
    pub(crate) fn check_seq(&self, what: &str, seq: i32) -> Result<usize> {
        if seq < 0 || seq as u32 >= self.params.n_seq_max {
            return Err(KvError::OutOfRange(format!(
                "{what}: seq id {seq} is out of range [0, {})",
                self.params.n_seq_max
            )));
        }
        debug_assert!((seq as usize) < MAX_SEQ);
        Ok(seq as usize)
    }
}
