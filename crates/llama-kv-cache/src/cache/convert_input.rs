//! The input of a conversion and the tensors that view it: the input's bytes (in memory or a
//! file, read at positions), and [`InputView`], a tensor of the output cache whose rows are
//! read from the input and converted (re-typed, re-rotated) when the state writer asks for
//! them, a few MiB at a time.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::sync::{Arc, Mutex};

use crate::cache::SeedCache;
use crate::error::{KvError, Result};
use crate::ggml_type::GgmlType;
use crate::params::CacheParams;
use crate::state::files::Inspection;
use crate::state::parts::Part;
use crate::state::VBlock;
use crate::tensors::storage::{Device, KvBuffer};

/// The input's bytes, read at positions by the views of every layer.
pub(super) enum Input {
    Bytes(Vec<u8>),
    File { file: Mutex<File>, name: String },
}

impl Input {
    fn read_at(&self, pos: u64, dst: &mut [u8]) -> Result<()> {
        match self {
            Input::Bytes(b) => {
                let at = usize::try_from(pos).ok();
                let src = at.and_then(|a| b.get(a..a.checked_add(dst.len())?));
                let src = src.ok_or_else(|| {
                    KvError::InvalidState(format!("a read at {pos} passes the end of the input"))
                })?;
                dst.copy_from_slice(src);
                Ok(())
            }
            Input::File { file, name } => {
                let io = |e: std::io::Error| KvError::Io(format!("cannot read {name}: {e}"));
                let mut f = file
                    .lock()
                    .map_err(|_| KvError::Io(format!("cannot read {name}: a reader panicked")))?;
                f.seek(SeekFrom::Start(pos)).map_err(io)?;
                f.read_exact(dst).map_err(io)
            }
        }
    }

    /// Copies `len` bytes at `pos` to `w`, a MiB at a time.
    pub(super) fn copy_to(&self, pos: u64, len: u64, w: &mut dyn Write) -> Result<()> {
        let mut buf = crate::alloc::zeroed(len.min(CHUNK as u64) as usize, "a copy buffer")?;
        let mut done = 0;
        while done < len {
            let n = (len - done).min(buf.len() as u64) as usize;
            self.read_at(pos + done, &mut buf[..n])?;
            w.write_all(&buf[..n])
                .map_err(|e| KvError::Io(format!("cannot write the converted file: {e}")))?;
            done += n as u64;
        }
        Ok(())
    }
}

/// Input bytes a view reads at once: large enough for few reads, small enough to be nothing
/// next to a file.
const CHUNK: usize = 1 << 20;

/// A cache whose tensors are [`InputView`]s.
pub(super) fn view_cache(
    params: CacheParams,
    input: &Arc<Input>,
    views: Option<Arc<Views>>,
) -> Result<SeedCache> {
    // a part of a memory may hold no layer (cells only)
    SeedCache::part_with_allocator(params, &mut |il, is_v, len| {
        Ok(Box::new(InputView {
            views: views.clone(),
            input: input.clone(),
            il,
            is_v,
            len,
        }) as Box<dyn KvBuffer>)
    })
}

/// Where one stream's block of one layer and tensor starts in the input.
#[derive(Clone, Copy)]
struct Block {
    /// Absolute offset of the rows (K, V rows, or transposed V) in the input.
    at: u64,
    /// Rows of the stream (the pitch of transposed V).
    n: usize,
}

/// One tensor kind (K or V) of every layer: types, rotations, geometry.
struct Side {
    from: GgmlType,
    to: GgmlType,
    rot: (u32, u32),
    /// Per layer: width in elements.
    widths: Vec<usize>,
    /// Per layer, per stream: where its rows are (None: an empty stream).
    blocks: Vec<Vec<Option<Block>>>,
}

/// What every view shares: the cell map and the input's geometry.
pub(super) struct Views {
    /// Per cache cell: (stream, row in the stream), or `u32::MAX` when no input row lands there.
    map: Vec<(u32, u32)>,
    k: Side,
    v: Side,
    v_trans: bool,
    size: usize,
    /// Convert through f32 (re-typing or rotating was asked): every row, as a re-typed load does.
    convert: bool,
    /// Transposed V whose rotation changes needs whole rows: the converted V of one layer,
    /// made on its first read (the writer reads layer by layer).
    v_rows: Mutex<Option<(usize, Vec<u8>)>>,
}

impl Views {
    pub(super) fn new(
        ins: &Inspection,
        part: &Part,
        from: &CacheParams,
        to: &CacheParams,
        placed: &[usize],
        convert: bool,
    ) -> Result<Views> {
        let size = from.size as usize;
        let mut map = crate::alloc::with_capacity(size, "the cell map of a conversion")?;
        map.resize(size, (u32::MAX, 0));
        let mut k = 0;
        for (s, stream) in part.payload.streams.iter().enumerate() {
            for r in 0..stream.cells.len() {
                map[placed[k]] = (s as u32, r as u32);
                k += 1;
            }
        }
        let base = (ins.payload_offset + part.range.start) as u64;
        let n_layer = from.n_layer as usize;
        let mut kb = vec![Vec::new(); n_layer];
        let mut vb = vec![Vec::new(); n_layer];
        for stream in &part.payload.streams {
            let n = stream.cells.len();
            for il in 0..n_layer {
                let l = stream.layers.get(il);
                kb[il].push(l.map(|l| Block {
                    at: base + l.k_data.start as u64,
                    n,
                }));
                // no V block (a cache without V): V has no rows to view
                vb[il].push(l.and_then(|l| match &l.v {
                    VBlock::Rows { data, .. } | VBlock::Transposed { data, .. } => Some(Block {
                        at: base + data.start as u64,
                        n,
                    }),
                    VBlock::Absent => None,
                }));
            }
        }
        let [k, v] = [
            (
                from.type_k,
                to.type_k,
                (from.n_rot_k, to.n_rot_k),
                kb,
                false,
            ),
            (from.type_v, to.type_v, (from.n_rot_v, to.n_rot_v), vb, true),
        ]
        .map(|(from_ty, to_ty, rot, blocks, is_v)| Side {
            from: from_ty,
            to: to_ty,
            rot,
            widths: (0..n_layer)
                .map(|il| {
                    if is_v {
                        from.n_embd_v(il)
                    } else {
                        from.n_embd_k(il)
                    }
                })
                .collect(),
            blocks,
        });
        Ok(Views {
            map,
            k,
            v,
            v_trans: from.v_trans(),
            size,
            convert,
            v_rows: Mutex::new(None),
        })
    }
}

/// One tensor of the output cache: its bytes are the input's rows, converted on demand (or,
/// without `views`, a tensor of no data, for the cache that only places cells).
struct InputView {
    views: Option<Arc<Views>>,
    input: Arc<Input>,
    il: usize,
    is_v: bool,
    len: usize,
}

/// Re-types and re-rotates one row as a re-typed load does (`SeedCache::retyped_rotated`).
fn convert_row(side: &Side, src: &[u8], dst: &mut [u8], values: &mut [f32]) -> Result<()> {
    crate::tensors::quant::dequantize_row(side.from, src, values)?;
    let (from, to) = side.rot;
    if from != to {
        for n in [from, to].into_iter().filter(|&n| n != 0) {
            crate::tensors::hadamard::rotate_blocks(values, n as usize);
        }
    }
    crate::tensors::quant::quantize_row(side.to, values, dst)
}

impl InputView {
    fn v(&self) -> &Views {
        self.views
            .as_deref()
            .expect("only views with data are read")
    }

    /// Where stream `s`'s rows of this layer are.
    fn block(&self, side: &Side, s: u32) -> Result<Block> {
        side.blocks[self.il][s as usize]
            .ok_or_else(|| KvError::InvalidState("a cell maps to a stream without data".into()))
    }

    fn side(&self) -> &Side {
        let views = self.v();
        if self.is_v {
            &views.v
        } else {
            &views.k
        }
    }

    /// Cells `first..` whose input rows follow each other in one stream (or that have none),
    /// at most `max`.
    fn run(&self, first: usize, max: usize) -> usize {
        let map = &self.v().map;
        let (s, r) = map[first];
        let mut k = 1;
        while k < max && first + k < map.len() {
            let next = map[first + k];
            let follows = if s == u32::MAX {
                next.0 == u32::MAX
            } else {
                next == (s, r + k as u32)
            };
            if !follows {
                break;
            }
            k += 1;
        }
        k
    }

    /// Reads `n` input rows of `row` bytes for cells `first..first + n` (one run) into `dst`;
    /// cells without an input row read as zeros, as in a cache that was cleared.
    fn read_rows(&self, first: usize, n: usize, row: usize, dst: &mut [u8]) -> Result<()> {
        let (s, r) = self.v().map[first];
        if s == u32::MAX {
            dst.fill(0);
            return Ok(());
        }
        let block = self.side().blocks[self.il][s as usize]
            .ok_or_else(|| KvError::InvalidState("a cell maps to a stream without data".into()))?;
        debug_assert!(r as usize + n <= block.n);
        self.input
            .read_at(block.at + r as u64 * row as u64, &mut dst[..n * row])
    }

    /// Rows layout (K, untransposed V): `dst` is the output bytes at `offset`.
    fn read_row_layout(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        let side = self.side();
        let width = side.widths[self.il];
        let row_in = side.from.row_size(width)?;
        let row_out = side.to.row_size(width)?;
        let mut cell = offset / row_out;
        let mut skip = offset % row_out;
        let mut out = dst;
        let batch = (CHUNK / row_in.max(1)).max(1);
        let mut rows_in = Vec::new();
        let mut values = Vec::new();
        let mut one = Vec::new();
        while !out.is_empty() {
            let wanted = (skip + out.len()).div_ceil(row_out);
            let n = self.run(cell, wanted.min(batch));
            rows_in.resize(n * row_in, 0);
            self.read_rows(cell, n, row_in, &mut rows_in)?;
            for src in rows_in.chunks_exact(row_in) {
                let take = (row_out - skip).min(out.len());
                if !self.v().convert {
                    out[..take].copy_from_slice(&src[skip..skip + take]);
                } else {
                    values.resize(width, 0.0);
                    one.resize(row_out, 0);
                    convert_row(side, src, &mut one, &mut values)?;
                    out[..take].copy_from_slice(&one[skip..skip + take]);
                }
                out = &mut out[take..];
                skip = 0;
            }
            cell += n;
        }
        Ok(())
    }

    /// Transposed V: `n_embd` runs of `size` elements; `dst` is the output bytes at `offset`.
    fn read_transposed(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        let side = &self.v().v;
        let (el_in, el_out) = (side.from.type_size(), side.to.type_size());
        let size = self.v().size;
        if !offset.is_multiple_of(el_out) || !dst.len().is_multiple_of(el_out) {
            return Err(KvError::InvalidArg(format!(
                "a read of transposed V at {offset} ({} bytes) splits an element",
                dst.len()
            )));
        }
        if self.v().convert && side.rot.0 != side.rot.1 {
            return self.read_transposed_rotated(offset, dst);
        }
        let mut at = offset / el_out;
        let mut out = dst;
        let mut src = Vec::new();
        let mut values = Vec::new();
        while !out.is_empty() {
            let (j, cell) = (at / size, at % size);
            let n = self.run(
                cell,
                (size - cell).min(out.len() / el_out).min(CHUNK / el_in),
            );
            src.resize(n * el_in, 0);
            let (s, r) = self.v().map[cell];
            if s == u32::MAX {
                src.fill(0);
            } else {
                let block = self.block(side, s)?;
                let pos = block.at + ((j * block.n + r as usize) * el_in) as u64;
                self.input.read_at(pos, &mut src)?;
            }
            let dst = &mut out[..n * el_out];
            if self.v().convert {
                // float types only (quantized V is never transposed): element by element
                values.resize(n, 0.0);
                crate::tensors::quant::dequantize_row(side.from, &src, &mut values)?;
                crate::tensors::quant::quantize_row(side.to, &values, dst)?;
            } else {
                dst.copy_from_slice(&src);
            }
            out = &mut out[n * el_out..];
            at += n;
        }
        Ok(())
    }

    /// Transposed V whose rotation changes: the rotation mixes a row's elements, so the layer's
    /// V is converted row by row once (into the output's transposed layout) and served from
    /// there.
    fn read_transposed_rotated(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        let mut slot = self
            .v()
            .v_rows
            .lock()
            .map_err(|_| KvError::Backend("a conversion thread panicked".into()))?;
        if slot.as_ref().is_none_or(|(il, _)| *il != self.il) {
            *slot = None;
            *slot = Some((self.il, self.transposed_layer()?));
        }
        let (_, bytes) = slot.as_ref().expect("made above");
        dst.copy_from_slice(&bytes[offset..offset + dst.len()]);
        Ok(())
    }

    fn transposed_layer(&self) -> Result<Vec<u8>> {
        let side = &self.v().v;
        let width = side.widths[self.il];
        let (el_in, el_out) = (side.from.type_size(), side.to.type_size());
        let size = self.v().size;
        let mut out = crate::alloc::zeroed(self.len, "a layer of transposed V")?;
        let mut column = vec![0u8; width * el_in];
        let mut row = vec![0u8; width * el_out];
        let mut values = vec![0f32; width];
        // each stream's block of this layer, read at once (one layer of V, like `out`)
        let mut blocks: Vec<Option<(Block, Vec<u8>)>> = Vec::new();
        for b in &side.blocks[self.il] {
            blocks.push(match b {
                None => None,
                Some(b) => {
                    let mut bytes = crate::alloc::zeroed(b.n * width * el_in, "a block of V")?;
                    self.input.read_at(b.at, &mut bytes)?;
                    Some((*b, bytes))
                }
            });
        }
        for cell in 0..size {
            let (s, r) = self.v().map[cell];
            match blocks.get(s as usize).and_then(|b| b.as_ref()) {
                None if s == u32::MAX => column.fill(0),
                None => {
                    return Err(KvError::InvalidState(
                        "a cell maps to a stream without data".into(),
                    ))
                }
                Some((block, bytes)) => {
                    for j in 0..width {
                        let at = (j * block.n + r as usize) * el_in;
                        column[j * el_in..(j + 1) * el_in].copy_from_slice(&bytes[at..at + el_in]);
                    }
                }
            }
            convert_row(side, &column, &mut row, &mut values)?;
            for j in 0..width {
                let at = (cell + j * size) * el_out;
                out[at..at + el_out].copy_from_slice(&row[j * el_out..(j + 1) * el_out]);
            }
        }
        Ok(out)
    }
}

impl KvBuffer for InputView {
    fn len(&self) -> usize {
        self.len
    }

    fn device(&self) -> Device {
        Device::Host
    }

    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        match offset.checked_add(dst.len()) {
            Some(end) if end <= self.len => {}
            _ => {
                return Err(KvError::OutOfRange(format!(
                    "read of {} bytes at offset {offset} exceeds the view size {}",
                    dst.len(),
                    self.len
                )))
            }
        }
        match &self.views {
            // the placement cache: zeros, as in a cache that was cleared (never written out)
            None => {
                dst.fill(0);
                Ok(())
            }
            Some(v) if self.is_v && v.v_trans => self.read_transposed(offset, dst),
            Some(_) => self.read_row_layout(offset, dst),
        }
    }

    fn write(&mut self, _: usize, _: &[u8]) -> Result<()> {
        Err(KvError::Unsupported(
            "a conversion's tensors are views of its input: read-only".into(),
        ))
    }

    fn copy_within(&mut self, _: usize, _: usize, _: usize) -> Result<()> {
        self.write(0, &[])
    }

    fn fill_zero(&mut self) -> Result<()> {
        // creation zeroes every buffer; the views show the input (and zeros where it has none)
        Ok(())
    }
}
