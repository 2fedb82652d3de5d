//! The K-shift on the device: the rope kernel run over a layer's K rows.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::ffi::c_void;

use cudarc::driver::result as cu;

use super::buffer::CudaBuffer;
use super::guard::{drv, guarded};
use crate::error::{KvError, Result};
use crate::ggml_type::GgmlType;
use crate::tensors::rope::{RopeParams, RopeTable, RopeType};

/// Threads per block of the rope kernel.
const BLOCK: u32 = 256;

/// A K-shift prepared for the device: the cells to rotate, and one cos/sin table per distinct
/// delta (computed on the host with [`RopeTable`], so the device uses the host's exact values).
/// Build it once per set of [`RopeParams`] and run it on every layer that uses them.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeJob {
    cells: Vec<u32>,
    tabs: Vec<u32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    n_pairs: u32,
    head_dim: u32,
    n_head: u32,
    neox: bool,
    row_len: usize,
    max_cell: usize,
}

/// The pairs `(a, b)` that rope rotates in one head.
fn pair(rope_type: RopeType, n_pairs: usize, i: usize) -> (usize, usize) {
    match rope_type {
        RopeType::Norm => (2 * i, 2 * i + 1),
        RopeType::Neox => (i, i + n_pairs),
    }
}

/// The scaled cos and sin of every pair of `table`, bit for bit, read back through
/// [`RopeTable::rotate`]: rotating `(1, ±0)` gives `(c ∓ 0·s, s ± 0·c)`, which is exactly
/// `(c, s)` except for the sign of a zero; of the two probes one is always exact, and they
/// disagree only when the value is `-0`.
fn table_cos_sin(table: &RopeTable, p: &RopeParams, n_pairs: usize) -> (Vec<f32>, Vec<f32>) {
    let probe = |zero: f32| {
        let mut row = vec![0f32; p.row_len()];
        for i in 0..n_pairs {
            let (a, b) = pair(p.rope_type, n_pairs, i);
            row[a] = 1.0;
            row[b] = zero;
        }
        table.rotate(&mut row);
        row
    };
    let plus = probe(0.0);
    let minus = probe(-0.0);
    let exact = |x: f32, y: f32| if x.to_bits() == y.to_bits() { x } else { -0.0 };
    (0..n_pairs)
        .map(|i| {
            let (a, b) = pair(p.rope_type, n_pairs, i);
            (exact(plus[a], minus[a]), exact(plus[b], minus[b]))
        })
        .unzip()
}

impl RopeJob {
    /// Prepares rotating each cell `c` of `cells` by `deltas[c]` (`deltas` indexed by cell, like
    /// the cache's delta column) with `params`.
    pub fn new(params: &RopeParams, cells: &[usize], deltas: &[i32]) -> Result<RopeJob> {
        params.validate()?;
        let too_big = |what: &str, v: usize| {
            KvError::InvalidArg(format!("rope: {what} {v} is too large for the CUDA kernel"))
        };
        let head_dim =
            u32::try_from(params.head_dim).map_err(|_| too_big("head_dim", params.head_dim))?;
        let n_head = u32::try_from(params.n_head).map_err(|_| too_big("n_head", params.n_head))?;
        let n_pairs = (params.n_dims.min(params.head_dim) & !1) / 2;
        let mut index: HashMap<i32, u32> = HashMap::new();
        let mut job = RopeJob {
            cells: Vec::with_capacity(cells.len()),
            tabs: Vec::with_capacity(cells.len()),
            cos: Vec::new(),
            sin: Vec::new(),
            n_pairs: n_pairs as u32,
            head_dim,
            n_head,
            neox: params.rope_type == RopeType::Neox,
            row_len: params.row_len(),
            max_cell: 0,
        };
        for &c in cells {
            let delta = *deltas.get(c).ok_or_else(|| {
                KvError::OutOfRange(format!(
                    "rope: cell {c} has no delta ({} deltas given)",
                    deltas.len()
                ))
            })?;
            let cell = u32::try_from(c).map_err(|_| too_big("cell", c))?;
            let next = index.len() as u32;
            let t = match index.entry(delta) {
                Entry::Occupied(e) => *e.get(),
                Entry::Vacant(e) => {
                    let (cos, sin) = table_cos_sin(&RopeTable::new(params, delta), params, n_pairs);
                    job.cos.extend(cos);
                    job.sin.extend(sin);
                    *e.insert(next)
                }
            };
            job.cells.push(cell);
            job.tabs.push(t);
            job.max_cell = job.max_cell.max(c);
        }
        Ok(job)
    }

    /// Number of cells to rotate.
    pub fn len(&self) -> usize {
        self.cells.len()
    }

    /// Whether there is no cell to rotate.
    pub fn is_empty(&self) -> bool {
        self.cells.is_empty()
    }

    /// Number of distinct deltas (tables uploaded).
    pub fn n_tables(&self) -> usize {
        self.cos.len() / (self.n_pairs as usize).max(1)
    }

    /// The packed arguments: cells, table indices, cos, sin (all 4-byte values).
    fn packed(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(4 * (2 * self.cells.len() + 2 * self.cos.len()));
        for v in self.cells.iter().chain(&self.tabs) {
            out.extend_from_slice(&v.to_le_bytes());
        }
        for v in self.cos.iter().chain(&self.sin) {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out
    }
}

impl CudaBuffer {
    /// Whether [`CudaBuffer::rope`] handles K of type `ty` (f32, f16, bf16); quantized K must be
    /// staged through the host.
    pub fn rope_supported(ty: GgmlType) -> bool {
        matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16)
    }

    /// Compiles (once per device and process) and loads the kernels; `Err` says why they cannot
    /// be used (e.g. no libnvrtc), in which case the K-shift should stage rows through the
    /// host. Never panics.
    pub fn kernels_available(&self) -> std::result::Result<(), String> {
        guarded("kernels", || self.dev.kernels().map(|_| ())).map_err(|e| e.to_string())
    }

    /// How the kernels were built (`"cubin sm_90"`, `"ptx"`), compiling them if needed.
    pub fn kernels_origin(&self) -> Result<String> {
        guarded("kernels", || self.dev.kernels().map(|k| k.origin.clone()))
    }

    /// Rotates the K rows of `job`'s cells in place on the device: row `c` holds `row_bytes`
    /// bytes of `ty` at `c * row_bytes`. The result is bit-identical to the host's
    /// dequantize -> [`RopeTable::rotate`] -> quantize of each row.
    pub fn rope(&mut self, ty: GgmlType, row_bytes: usize, job: &RopeJob) -> Result<()> {
        let el = match ty {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::Bf16 => 2,
            _ => {
                return Err(KvError::Unsupported(format!(
                    "the CUDA rope kernel handles f32, f16 and bf16 K, not {ty}"
                )))
            }
        };
        if !row_bytes.is_multiple_of(el) || row_bytes / el != job.row_len {
            return Err(KvError::InvalidArg(format!(
                "rope: a {ty} K row of {row_bytes} bytes does not hold head_dim * n_head = {} values",
                job.row_len
            )));
        }
        if job.is_empty() {
            return Ok(());
        }
        let end = (job.max_cell + 1).checked_mul(row_bytes);
        if end.is_none_or(|e| e > self.len_bytes()) {
            return Err(KvError::OutOfRange(format!(
                "rope: cell {} is beyond the {} rows of the buffer",
                job.max_cell,
                self.len_bytes() / row_bytes.max(1)
            )));
        }
        guarded("rope kernel", || {
            let dev = &self.dev;
            dev.bind()?;
            let kernels = dev.kernels()?;
            let func = match ty {
                GgmlType::F32 => &kernels.rope_f32,
                GgmlType::F16 => &kernels.rope_f16,
                _ => &kernels.rope_bf16,
            };
            let args = job.packed();
            let stream = dev.cu_stream();
            // SAFETY: scratch of `args.len()` bytes, freed below after the stream is drained.
            let scratch = drv("rope scratch allocation", unsafe {
                cu::malloc_sync(args.len())
            })?;
            let run = || -> Result<()> {
                // SAFETY: `args` lives until the synchronize below.
                drv("copy host to device", unsafe {
                    cu::memcpy_htod_async(scratch, &args, stream)
                })?;
                let n = job.cells.len() as u64;
                let mut k_ptr = self.ptr;
                let mut row = job.row_len as u64;
                let mut cells_ptr = scratch;
                let mut tabs_ptr = scratch + 4 * n;
                let mut n_cells = job.cells.len() as u32;
                let mut cos_ptr = scratch + 8 * n;
                let mut sin_ptr = cos_ptr + 4 * job.cos.len() as u64;
                let mut n_pairs = job.n_pairs;
                let mut head_dim = job.head_dim;
                let mut n_head = job.n_head;
                let mut neox = i32::from(job.neox);
                let mut params: [*mut c_void; 11] = [
                    &mut k_ptr as *mut _ as *mut c_void,
                    &mut row as *mut _ as *mut c_void,
                    &mut cells_ptr as *mut _ as *mut c_void,
                    &mut tabs_ptr as *mut _ as *mut c_void,
                    &mut n_cells as *mut _ as *mut c_void,
                    &mut cos_ptr as *mut _ as *mut c_void,
                    &mut sin_ptr as *mut _ as *mut c_void,
                    &mut n_pairs as *mut _ as *mut c_void,
                    &mut head_dim as *mut _ as *mut c_void,
                    &mut n_head as *mut _ as *mut c_void,
                    &mut neox as *mut _ as *mut c_void,
                ];
                let total = n * u64::from(job.n_head) * u64::from(job.n_pairs);
                let grid = total.div_ceil(u64::from(BLOCK)).clamp(1, 1 << 20) as u32;
                // SAFETY: the arguments match the kernel's signature in kernels.cu; every
                // pointer is in bounds (cells checked above, tables sized by the job).
                drv("rope kernel launch", unsafe {
                    cu::launch_kernel(
                        func.cu_function(),
                        (grid, 1, 1),
                        (BLOCK, 1, 1),
                        0,
                        stream,
                        &mut params,
                    )
                })?;
                dev.synchronize()
            };
            let r = run();
            let _ = dev.synchronize();
            // SAFETY: nothing queued uses the scratch any more.
            let _ = unsafe { cu::free_sync(scratch) };
            r
        })
    }

    /// [`RopeJob::new`] followed by [`CudaBuffer::rope`].
    pub fn rope_rows(
        &mut self,
        ty: GgmlType,
        row_bytes: usize,
        cells: &[usize],
        deltas: &[i32],
        params: &RopeParams,
    ) -> Result<()> {
        let job = RopeJob::new(params, cells, deltas)?;
        self.rope(ty, row_bytes, &job)
    }

    fn len_bytes(&self) -> usize {
        crate::tensors::storage::KvBuffer::len(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rotate_with(cos: &[f32], sin: &[f32], p: &RopeParams, row: &mut [f32]) {
        let n_pairs = cos.len();
        for head in row.chunks_exact_mut(p.head_dim) {
            for i in 0..n_pairs {
                let (a, b) = pair(p.rope_type, n_pairs, i);
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * cos[i] - x1 * sin[i];
                head[b] = x0 * sin[i] + x1 * cos[i];
            }
        }
    }

    #[test]
    fn extracted_tables_reproduce_the_host_rotation_bit_for_bit() {
        for rope_type in [RopeType::Norm, RopeType::Neox] {
            let mut p = RopeParams::new(32, 48, 3, rope_type);
            for (ext, attn) in [(0.0, 1.0), (1.0, 0.8), (0.0, 0.0)] {
                p.ext_factor = ext;
                p.attn_factor = attn;
                p.freq_scale = if ext != 0.0 { 0.25 } else { 1.0 };
                p.n_ctx_orig = 4096;
                for delta in [-300, -7, -1, 0, 1, 5, 1000] {
                    let table = RopeTable::new(&p, delta);
                    let (cos, sin) = table_cos_sin(&table, &p, 16);
                    let mut seed = 0x2545_f491_u32 ^ delta as u32;
                    let row: Vec<f32> = (0..p.row_len())
                        .map(|_| {
                            seed ^= seed << 13;
                            seed ^= seed >> 17;
                            seed ^= seed << 5;
                            (seed as f32 / u32::MAX as f32) * 4.0 - 2.0
                        })
                        .collect();
                    let mut host = row.clone();
                    table.rotate(&mut host);
                    let mut mine = row.clone();
                    rotate_with(&cos, &sin, &p, &mut mine);
                    let hb: Vec<u32> = host.iter().map(|x| x.to_bits()).collect();
                    let mb: Vec<u32> = mine.iter().map(|x| x.to_bits()).collect();
                    assert_eq!(hb, mb, "{rope_type:?} ext {ext} attn {attn} delta {delta}");
                }
            }
        }
    }

    #[test]
    fn signed_zeros_are_recovered() {
        // attn_factor 0 scales every cos and sin to a zero whose sign is that of the unscaled value
        let mut p = RopeParams::new(8, 8, 1, RopeType::Norm);
        p.attn_factor = 0.0;
        let (cos, sin) = table_cos_sin(&RopeTable::new(&p, -3), &p, 4);
        // angle -3: cos(-3) < 0, sin(-3) < 0
        assert_eq!(cos[0].to_bits(), (-0.0f32).to_bits());
        assert_eq!(sin[0].to_bits(), (-0.0f32).to_bits());
        let (cos, sin) = table_cos_sin(&RopeTable::new(&p, 1), &p, 4);
        assert_eq!(cos[0].to_bits(), 0.0f32.to_bits());
        assert_eq!(sin[0].to_bits(), 0.0f32.to_bits());
    }

    #[test]
    fn job_groups_cells_by_delta() {
        let p = RopeParams::new(8, 8, 2, RopeType::Neox);
        let deltas = [0, 3, 3, -1, 3];
        let job = RopeJob::new(&p, &[1, 2, 3, 4], &deltas).unwrap();
        assert_eq!(job.len(), 4);
        assert_eq!(job.n_tables(), 2);
        assert_eq!(job.tabs, vec![0, 0, 1, 0]);
        assert_eq!(job.packed().len(), 4 * (8 + 2 * 2 * 4));
        assert!(matches!(
            RopeJob::new(&p, &[5], &deltas),
            Err(KvError::OutOfRange(_))
        ));
        let mut bad = p.clone();
        bad.n_dims = 7;
        assert!(matches!(
            RopeJob::new(&bad, &[1], &deltas),
            Err(KvError::InvalidArg(_))
        ));
    }
}
