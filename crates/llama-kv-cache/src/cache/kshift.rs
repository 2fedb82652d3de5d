//! K-shift: rotating every cell's K by its accumulated position delta, as llama.cpp's shift
//! graph does, followed by clearing the deltas. Also `update`, which applies a pending shift
//! and a pending defrag in llama.cpp's order.

use std::collections::HashMap;

use crate::cache::defrag::{DefragReport, DEFAULT_MAX_NODES};
use crate::cache::SeedCache;
use crate::error::{KvError, Result};
use crate::ggml_type::GgmlType;
use crate::tensors::f16_simd::{self, F16Rope};
use crate::tensors::quant;
use crate::tensors::rope::{RopeParams, RopeTable, ShiftParams};
use crate::tensors::storage::KvBuffer;

/// What `update` did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct UpdateReport {
    /// Cells whose K rows were rotated (0 when no shift was applied).
    pub shifted_cells: u32,
    /// Whether a shift is still pending (positions changed but no RoPE parameters were given).
    pub shift_pending: bool,
    /// The defrag applied, if one was pending.
    pub defrag: Option<DefragReport>,
}

/// Cells processed per staging chunk when a buffer is not in host memory.
const STAGE_CELLS: usize = 256;

/// Runs `f(cell, row_bytes)` on the rows of `cells` (ascending) of a row-per-cell buffer,
/// directly on host memory or through a staging copy elsewhere.
pub(crate) fn for_each_row(
    buf: &mut dyn KvBuffer,
    row: usize,
    cells: &[usize],
    mut f: impl FnMut(usize, &mut [u8]) -> Result<()>,
) -> Result<()> {
    if let Some(bytes) = buf.as_host_mut() {
        for &c in cells {
            f(c, &mut bytes[c * row..(c + 1) * row])?;
        }
        return Ok(());
    }
    let mut stage = Vec::new();
    for chunk in cells.chunk_by(|a, b| b - a == 1) {
        for part in chunk.chunks(STAGE_CELLS) {
            stage.resize(part.len() * row, 0);
            buf.read(part[0] * row, &mut stage)?;
            for (k, &c) in part.iter().enumerate() {
                f(c, &mut stage[k * row..(k + 1) * row])?;
            }
            buf.write(part[0] * row, &stage)?;
        }
    }
    Ok(())
}

/// f32 values converted per step of the generic host K-shift (64 KiB of scratch).
const SHIFT_CHUNK_VALUES: usize = 16 * 1024;

/// A run of adjacent cells with the same delta: `(first cell, cells, delta)`.
type ShiftRun = (usize, usize, i32);

/// The runs of adjacent cells with equal deltas that a shift rotates, in cell order: every cell,
/// or only those with a nonzero delta when a rotation by 0 changes nothing.
fn shift_runs(deltas: &[i32], skip_zero: bool) -> Vec<ShiftRun> {
    let mut runs = Vec::new();
    let mut first = 0;
    for run in deltas.chunk_by(|a, b| a == b) {
        if !(skip_zero && run[0] == 0) {
            runs.push((first, run.len(), run[0]));
        }
        first += run.len();
    }
    runs
}

/// The host K-shift, a run of equal deltas at a time. f16 K on a CPU with F16C goes through
/// the fused kernel ([`F16Rope`]: widen, rotate, narrow 8 values at a time, straight on the
/// tensor); other types are converted to f32 a chunk of rows at a time (one conversion call per
/// chunk instead of per short row), rotated row by row with one table per run, and converted
/// back. Each element's arithmetic is the same as row by row, so the result is bit-identical.
fn rotate_host_runs(
    bytes: &mut [u8],
    ty: GgmlType,
    row: usize,
    p: &RopeParams,
    runs: &[ShiftRun],
    tables: &mut HashMap<i32, RopeTable>,
) -> Result<()> {
    let fused = ty == GgmlType::F16 && f16_simd::available();
    let mut kernels: HashMap<i32, F16Rope> = HashMap::new();
    let row_len = p.row_len();
    let rows_per_chunk = (SHIFT_CHUNK_VALUES / row_len.max(1)).max(1);
    let mut values = Vec::new();
    for &(first, len, delta) in runs {
        let table = tables
            .entry(delta)
            .or_insert_with(|| RopeTable::new(p, delta));
        let data = &mut bytes[first * row..(first + len) * row];
        if fused {
            if let std::collections::hash_map::Entry::Vacant(e) = kernels.entry(delta) {
                if let Some(k) = F16Rope::new(table) {
                    e.insert(k);
                }
            }
            if let Some(kernel) = kernels.get(&delta) {
                kernel.rotate_rows(data);
                continue;
            }
        }
        values.resize(rows_per_chunk * row_len, 0f32);
        for part in data.chunks_mut(rows_per_chunk * row) {
            let vals = &mut values[..part.len() / row * row_len];
            quant::dequantize_row(ty, part, vals)?;
            for r in vals.chunks_exact_mut(row_len) {
                table.rotate(r);
            }
            quant::quantize_row(ty, vals, part)?;
        }
    }
    Ok(())
}

/// Rotates K rows in place on the device when the buffer is CUDA memory, the type is a float
/// type and the kernels compile; returns false when the host path must do it.
#[cfg(feature = "cuda")]
fn rotate_on_device(
    buf: &mut dyn KvBuffer,
    ty: GgmlType,
    row: usize,
    params: &RopeParams,
    cells: &[usize],
    deltas: &[i32],
) -> Result<bool> {
    use crate::tensors::cuda::{CudaBuffer, RopeJob};
    // the kernel rotates each head's leading dimensions: a latent K row's rotated part (behind
    // `dims_offset` values) takes the host path
    if !CudaBuffer::rope_supported(ty) || params.dims_offset != 0 {
        return Ok(false);
    }
    let Some(cuda) = buf
        .as_any_mut()
        .and_then(|a| a.downcast_mut::<CudaBuffer>())
    else {
        return Ok(false);
    };
    if cuda.kernels_available().is_err() {
        return Ok(false);
    }
    let job = RopeJob::new(params, cells, deltas)?;
    cuda.rope(ty, row, &job)?;
    Ok(true)
}

impl SeedCache {
    /// Rotates every cell's K by its delta and clears the deltas and the pending-shift flag.
    /// Fails, changing nothing, when the cache cannot shift or the parameters do not fit.
    pub fn apply_shift(&mut self, params: &ShiftParams) -> Result<u32> {
        if !self.can_shift() {
            return Err(KvError::Unsupported(if self.params.recurrent {
                "K-shift is not possible on a recurrent cache".into()
            } else {
                "K-shift is disabled for this cache (canShift: false)".into()
            }));
        }
        for il in 0..self.params.n_layer {
            let p = params.for_layer(il);
            p.validate()?;
            let width = self.layers[il as usize].n_embd_k;
            if p.row_len() != width {
                return Err(KvError::InvalidArg(format!(
                    "rope geometry headDim {} x nHead {} = {} does not match layer {il}'s K width {width}",
                    p.head_dim,
                    p.n_head,
                    p.row_len()
                )));
            }
        }
        for &(il, _) in &params.per_layer {
            if il >= self.params.n_layer {
                return Err(KvError::OutOfRange(format!(
                    "rope override for layer {il}: out of range [0, {})",
                    self.params.n_layer
                )));
            }
        }

        let ty = self.params.type_k;
        let hadamard =
            (self.params.n_rot_k != 0 && ty.is_quantized()).then_some(self.params.n_rot_k as usize);
        let size = self.params.size as usize;
        let deltas: Vec<i32> = self.cells.delta_column().to_vec();
        let mut shifted = 0u32;
        for il in 0..self.params.n_layer {
            let p = params.for_layer(il);
            let zero = RopeTable::new(p, 0);
            // llama.cpp rotates all cells; a rotation by 0 is the identity only when it does
            // not scale (YaRN's mscale) and the type round-trips f32 exactly
            let zero_is_identity = !ty.is_quantized() && zero.is_identity();
            let layer = &mut self.layers[il as usize];
            let row = layer.k_row;
            let mut tables: HashMap<i32, RopeTable> = HashMap::new();
            // (a rotated quantized K takes the row path below, which adds the Hadamard steps)
            if let (None, Some(bytes)) = (hadamard, layer.k.as_host_mut()) {
                let runs = shift_runs(&deltas, zero_is_identity);
                rotate_host_runs(bytes, ty, row, p, &runs, &mut tables)?;
                let cells: usize = runs.iter().map(|r| r.1).sum();
                shifted = shifted.max(cells as u32);
                continue;
            }
            let cells: Vec<usize> = (0..size)
                .filter(|&c| deltas[c] != 0 || !zero_is_identity)
                .collect();
            #[cfg(feature = "cuda")]
            if rotate_on_device(layer.k.as_mut(), ty, row, p, &cells, &deltas)? {
                shifted = shifted.max(cells.len() as u32);
                continue;
            }
            let mut values = vec![0f32; p.row_len()];
            for_each_row(layer.k.as_mut(), row, &cells, |c, bytes| {
                let table = tables
                    .entry(deltas[c])
                    .or_insert_with(|| RopeTable::new(p, deltas[c]));
                quant::dequantize_row(ty, bytes, &mut values)?;
                // llama.cpp 0.1.161's shift of a rotated quantized K: rotate back, RoPE,
                // rotate forward (its float branch has no rotation)
                if let Some(n) = hadamard {
                    crate::tensors::hadamard::rotate_blocks(&mut values, n);
                }
                table.rotate(&mut values);
                if let Some(n) = hadamard {
                    crate::tensors::hadamard::rotate_blocks(&mut values, n);
                }
                quant::quantize_row(ty, &values, bytes)
            })?;
            shifted = shifted.max(cells.len() as u32);
        }
        self.cells.clear_deltas();
        self.has_shift = false;
        Ok(shifted)
    }

    /// llama.cpp's `kv_self_update`: applies a pending K-shift (when `shift` is given) and
    /// then a pending defrag planned with `n_max_nodes` (default 65536).
    pub fn update(
        &mut self,
        shift: Option<&ShiftParams>,
        n_max_nodes: Option<u32>,
    ) -> Result<UpdateReport> {
        let mut report = UpdateReport::default();
        if self.has_shift {
            match shift {
                Some(params) => report.shifted_cells = self.apply_shift(params)?,
                None => report.shift_pending = true,
            }
        }
        if self.do_defrag {
            report.defrag = Some(self.defrag_now(n_max_nodes.unwrap_or(DEFAULT_MAX_NODES))?);
        }
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensors::rope::RopeType;

    /// The row-by-row reference the run kernel replaces.
    fn rotate_row_by_row(
        bytes: &mut [u8],
        ty: GgmlType,
        row: usize,
        p: &RopeParams,
        cells: &[usize],
        deltas: &[i32],
    ) {
        let mut values = vec![0f32; p.row_len()];
        for &c in cells {
            let r = &mut bytes[c * row..(c + 1) * row];
            quant::dequantize_row(ty, r, &mut values).unwrap();
            RopeTable::new(p, deltas[c]).rotate(&mut values);
            quant::quantize_row(ty, &values, r).unwrap();
        }
    }

    #[test]
    fn the_run_kernel_is_bit_identical_to_rotating_row_by_row() {
        let mut x = 0x1234_5678u32;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x
        };
        for ty in [
            GgmlType::F16,
            GgmlType::Bf16,
            GgmlType::F32,
            GgmlType::Q8_0,
            GgmlType::Q4_0,
        ] {
            for (head_dim, n_head, rope_type) in [
                (16, 2, RopeType::Norm),
                (64, 4, RopeType::Neox),
                (32, 8, RopeType::Norm),
            ] {
                let p = RopeParams::new(head_dim, head_dim, n_head, rope_type);
                let row = ty.row_size(p.row_len()).unwrap();
                let size = 700;
                let values: Vec<f32> = (0..size * p.row_len())
                    .map(|_| (next() >> 8) as f32 / (1u32 << 23) as f32 - 1.0)
                    .collect();
                let mut bytes = vec![0u8; size * row];
                quant::quantize_row(ty, &values, &mut bytes).unwrap();
                // runs of equal deltas of every length, gaps, and a run longer than a chunk
                let deltas: Vec<i32> = (0..size)
                    .map(|c| {
                        if c > 150 && c < 600 {
                            3
                        } else {
                            (next() % 5) as i32 - 2
                        }
                    })
                    .collect();
                for skip_zero in [false, true] {
                    let runs = shift_runs(&deltas, skip_zero);
                    let cells: Vec<usize> = runs
                        .iter()
                        .flat_map(|&(first, len, _)| first..first + len)
                        .collect();
                    let want: Vec<usize> = (0..size)
                        .filter(|&c| deltas[c] != 0 || !skip_zero)
                        .collect();
                    assert_eq!(cells, want, "the runs cover exactly the rotated cells");
                    let mut expected = bytes.clone();
                    rotate_row_by_row(&mut expected, ty, row, &p, &cells, &deltas);
                    let mut got = bytes.clone();
                    let mut tables = HashMap::new();
                    rotate_host_runs(&mut got, ty, row, &p, &runs, &mut tables).unwrap();
                    assert!(
                        got == expected,
                        "{ty} head_dim {head_dim} x {n_head}, skip_zero {skip_zero}: rows differ"
                    );
                }
            }
        }
    }
}
