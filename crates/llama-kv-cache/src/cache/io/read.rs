//! Reading a payload back into the unified cache, transactionally: parse and check everything
//! (detecting the layout when none is forced, refuting a twin layout that also parses), place
//! the cells, then write the rows; a failure puts the cells and, on a device, the rows back.

use crate::cache::io::{check_progress, Progress, ReadOptions, ReadSummary};
use crate::cache::rollback::CellsUndo;
use crate::cache::SeedCache;
use crate::cells::ubatch::UBatch;
use crate::error::{KvError, Result};
use crate::ggml_type::GgmlType;
use crate::state::cells::PayloadCells;
use crate::state::codec::recurrent_tails;
use crate::state::rows::{write_columns, write_rows};
use crate::state::source::Cursor;
use crate::state::{
    check_meta, detect_layout, no_layout_fits, parse_payload_form, Layout, ParsedPayload, VBlock,
};

impl SeedCache {
    /// Checks a parsed payload's data blocks against this cache's geometry.
    pub(crate) fn check_data(&self, p: &ParsedPayload) -> Result<()> {
        let total: usize = p.streams.iter().map(|s| s.cells.len()).sum();
        if total > self.params.size as usize {
            return Err(KvError::NoSpace(format!(
                "the payload holds {total} cells, the cache only {}",
                self.params.size
            )));
        }
        for (s, stream) in p.streams.iter().enumerate() {
            let Some(v_trans) = stream.v_trans else {
                continue;
            };
            if v_trans != self.v_trans() {
                return Err(KvError::InvalidState(format!(
                    "stream {s}: V is {}transposed in the payload but {}transposed in the cache",
                    if v_trans { "" } else { "not " },
                    if self.v_trans() { "" } else { "not " }
                )));
            }
            match stream.n_rot {
                Some((k, v)) if (k, v) != (self.params.n_rot_k, self.params.n_rot_v) => {
                    return Err(KvError::InvalidState(format!(
                        "stream {s}: rotation is n_rot_k {k} / n_rot_v {v} in the payload, {} / {} in the cache",
                        self.params.n_rot_k, self.params.n_rot_v
                    )));
                }
                None if self.params.n_rot_k != 0 || self.params.n_rot_v != 0 => {
                    return Err(KvError::InvalidState(format!(
                        "stream {s}: the {} layout records no rotation (its K/V are not rotated), the cache rotates K/V (n_rot_k {} / n_rot_v {})",
                        p.layout, self.params.n_rot_k, self.params.n_rot_v
                    )));
                }
                _ => {}
            }
            if stream.layers.len() != self.layers.len() {
                return Err(KvError::InvalidState(format!(
                    "stream {s}: the payload has {} layers, the cache {}",
                    stream.layers.len(),
                    self.layers.len()
                )));
            }
            for (il, (b, l)) in stream.layers.iter().zip(&self.layers).enumerate() {
                let type_name = |id: i32| {
                    GgmlType::from_id(id).map_or(format!("type id {id}"), |t| t.to_string())
                };
                if b.k_type != self.params.type_k.id() {
                    return Err(KvError::InvalidState(format!(
                        "layer {il}: K type is {} in the payload, {} in the cache",
                        type_name(b.k_type),
                        self.params.type_k
                    )));
                }
                if b.k_row_size != l.k_row as u64 {
                    return Err(KvError::InvalidState(format!(
                        "layer {il}: K row size is {} in the payload, {} in the cache",
                        b.k_row_size, l.k_row
                    )));
                }
                let (ty, ok, what) = match &b.v {
                    VBlock::Absent if self.params.no_v => continue,
                    VBlock::Absent => {
                        return Err(KvError::InvalidState(format!(
                            "layer {il}: the payload has no V (a cache without V, as multi-head \
                             latent attention keeps), this cache keeps V"
                        )))
                    }
                    _ if self.params.no_v => {
                        return Err(KvError::InvalidState(format!(
                            "layer {il}: the payload has V, this cache keeps none (noV)"
                        )))
                    }
                    VBlock::Rows { ty, row_size, .. } => (
                        *ty,
                        *row_size == l.v_row as u64,
                        format!("V row size {row_size} (cache {})", l.v_row),
                    ),
                    VBlock::Transposed {
                        ty,
                        el_size,
                        n_embd,
                        ..
                    } => (
                        *ty,
                        *el_size as usize == self.params.type_v.type_size()
                            && *n_embd as usize == l.n_embd_v,
                        format!(
                            "V element size {el_size} x {n_embd} (cache {} x {})",
                            self.params.type_v.type_size(),
                            l.n_embd_v
                        ),
                    ),
                };
                if ty != self.params.type_v.id() {
                    return Err(KvError::InvalidState(format!(
                        "layer {il}: V type is {} in the payload, {} in the cache",
                        type_name(ty),
                        self.params.type_v
                    )));
                }
                if !ok {
                    return Err(KvError::InvalidState(format!(
                        "layer {il}: mismatched {what}"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Validates a payload parsed structurally against this cache: cells (for one sequence
    /// when `seq` is given) and data blocks.
    pub fn check_payload(&self, p: &ParsedPayload, seq: Option<i32>) -> Result<()> {
        check_meta(p, seq, self.params.recurrent, self.params.n_seq_max)?;
        self.check_data(p)
    }

    /// Parses and validates `data` for this cache under every candidate layout; exactly one
    /// must fit.
    pub fn detect_payload(
        &self,
        data: &[u8],
        seq: Option<i32>,
        layout: Option<Layout>,
    ) -> Result<ParsedPayload> {
        let candidates: Vec<Layout> = match layout {
            Some(l) => vec![l],
            None => vec![Layout::Seed, Layout::Streams, Layout::StreamsRot],
        };
        self.detect_payload_among(data, seq, &candidates)
    }

    /// [`SeedCache::detect_payload`] among the given layouts (a file's version allows only some).
    pub fn detect_payload_among(
        &self,
        data: &[u8],
        seq: Option<i32>,
        layouts: &[Layout],
    ) -> Result<ParsedPayload> {
        let mut candidates: Vec<Layout> = Vec::new();
        for &l in layouts {
            let l = self.effective_layout(l);
            if !candidates.contains(&l) {
                candidates.push(l);
            }
        }
        // streams first: the layout this cache writes by default; a rotated cache can only
        // read streams-rot, so that goes first there
        let rotated = self.params.n_rot_k != 0 || self.params.n_rot_v != 0;
        candidates.sort_by_key(|l| match (l, rotated) {
            (Layout::StreamsRot, true) | (Layout::Streams, false) => 0,
            (Layout::StreamsRot | Layout::Streams, _) => 1,
            (Layout::Seed, _) => 2,
        });
        detect_layout(
            &candidates,
            |l, fits: &[ParsedPayload]| {
                // the twin of a layout that fits parses the same metadata: its first data
                // header decides it without a second parse of every cell
                if let Some(e) = fits.iter().find_map(|p| self.refute_twin(data, p, l)) {
                    return Err(e);
                }
                let parse = |no_v| parse_payload_form(data, l, self.params.cell_ext, no_v, true);
                parse(self.params.no_v)
                    // a payload without V blocks where this cache keeps V (or the other way
                    // round) parses only the other way: its check then names the difference
                    .or_else(|e| parse(!self.params.no_v).map_err(|_| e))
                    .and_then(|p| {
                        check_meta(&p, seq, self.params.recurrent, self.params.n_seq_max)?;
                        self.check_data(&p)?;
                        Ok(p)
                    })
            },
            |p| p.layout,
            |a, b| a.has_no_data_header() && b.has_no_data_header(),
            no_layout_fits,
        )
    }

    /// Whether `twin`, the other of the streams and streams-rot layouts, certainly does not
    /// fit a payload that `fit` (one of them) parsed: both read the same cell metadata, so the
    /// first data header sits at the same offset under both, and `twin` fits only if it reads
    /// there what this cache requires (V layout, layer count, rotation, first K type and row
    /// size). `Some(error)` when refuted.
    fn refute_twin(&self, data: &[u8], fit: &ParsedPayload, twin: Layout) -> Option<KvError> {
        if !fit.layout.has_stream_prefix() || !twin.has_stream_prefix() || fit.layout == twin {
            return None;
        }
        let (s, first) = fit
            .streams
            .iter()
            .enumerate()
            .find(|(_, s)| !s.layers.is_empty())?;
        let header = if fit.layout.records_rotation() { 16 } else { 8 };
        let mut c = Cursor::new(data);
        c.pos = first.layers[0].k_data.start.checked_sub(12 + header)?;
        let mut fits = || -> Result<bool> {
            let v_trans = c.u32("v_trans")?;
            let n_layer = c.u32("n_layer")?;
            let rot = if twin.records_rotation() {
                (c.u32("n_rot_k")?, c.u32("n_rot_v")?)
            } else {
                (0, 0)
            };
            let (k_type, k_row) = (c.i32("k_type")?, c.u64("k_row_size")?);
            Ok(v_trans == self.v_trans() as u32
                && n_layer as usize == self.layers.len()
                && rot == (self.params.n_rot_k, self.params.n_rot_v)
                && k_type == self.params.type_k.id()
                && self.layers.first().is_some_and(|l| k_row == l.k_row as u64))
        };
        match fits() {
            Ok(true) => None,
            _ => Some(KvError::InvalidState(format!(
                "stream {s}: its data header does not fit this cache in the {twin} layout"
            ))),
        }
    }

    /// The seed's `state_read(seq)` (seq -1: the whole cache), transactional: the payload is
    /// parsed and validated completely and room is found before the cache changes; on any
    /// error the cache is exactly as before. `progress` may stop the read until data starts
    /// being written.
    pub fn state_read(
        &mut self,
        data: &[u8],
        seq: i32,
        opts: ReadOptions,
        progress: Option<Progress<'_>>,
    ) -> Result<ReadSummary> {
        if opts.part.is_some() {
            return self.state_read_part(data, seq, opts, progress);
        }
        let dest = self.read_dest(seq)?;
        let parsed = self.detect_payload(data, dest, opts.layout)?;
        self.apply_payload(data, &parsed, dest, opts, progress)
    }

    /// Applies a payload already validated by [`SeedCache::detect_payload`] for `dest`.
    pub(crate) fn apply_payload(
        &mut self,
        data: &[u8],
        parsed: &ParsedPayload,
        dest: Option<i32>,
        opts: ReadOptions,
        progress: Option<Progress<'_>>,
    ) -> Result<ReadSummary> {
        self.apply_payload_with(data, parsed, dest, progress, |cache, cells| {
            cache.place_cells(cells, dest, opts.allow_scattered)
        })
    }

    /// [`SeedCache::apply_payload`] with the cells placed by `place`, which returns the undo
    /// record that takes them back out and the cells it filled, in payload order (today's
    /// caches place by llama.cpp 0.1.161's rules, the seed's by its own).
    pub(crate) fn apply_payload_with(
        &mut self,
        data: &[u8],
        parsed: &ParsedPayload,
        dest: Option<i32>,
        mut progress: Option<Progress<'_>>,
        place: impl FnOnce(&mut SeedCache, &PayloadCells) -> Result<(CellsUndo, Vec<usize>)>,
    ) -> Result<ReadSummary> {
        check_progress(&mut progress, 0, data.len() as u64, "state read")?;
        let cells = parsed.cells()?;
        let (undo, placed) = place(self, &cells)?;
        let backup = match self.backup_if_device() {
            Ok(b) => b,
            Err(e) => {
                self.roll_back(undo, &placed);
                return Err(e);
            }
        };
        // a whole-cache load leaves the rows past its cells zeroed, as llama.cpp's
        // clear-then-read does (after the backup, so that a failure can put them back)
        let zeroed = match dest {
            None => self.zero_rows_from(placed.len()),
            Some(_) => Ok(()),
        };
        if let Err(e) = zeroed.and_then(|()| self.write_payload_data(data, parsed, &placed)) {
            self.roll_back(undo, &placed);
            if let Some(b) = backup {
                self.restore_backup(b)?;
            }
            return Err(e);
        }
        self.commit(undo);
        Ok(ReadSummary {
            layout: parsed.layout,
            cells: placed.len() as u32,
            placed: placed.iter().map(|&c| c as u32).collect(),
        })
    }

    /// Places a payload's cells into `dest` (`None`: the whole cache) with the undo record
    /// that takes them back out; on failure the cells are as before.
    pub(crate) fn place_cells(
        &mut self,
        cells: &PayloadCells,
        dest: Option<i32>,
        allow_scattered: bool,
    ) -> Result<(CellsUndo, Vec<usize>)> {
        let undo = self.undo_record(dest);
        let placed = match dest {
            Some(d) => self.place_sequence(d, cells, allow_scattered),
            None => self.place_whole(cells),
        };
        match placed {
            Ok(p) => Ok((undo, p)),
            Err(e) => {
                self.roll_back(undo, &[]);
                Err(e)
            }
        }
    }

    pub(crate) fn place_sequence(
        &mut self,
        dest: i32,
        cells: &PayloadCells,
        allow_scattered: bool,
    ) -> Result<Vec<usize>> {
        // the rows stay: a load that fails puts the sequence's cells back
        self.seq_rm_keeping_data(dest, -1, -1)?;
        if cells.is_empty() {
            return Ok(Vec::new());
        }
        let n = cells.len();
        let ub = UBatch {
            pos: cells.positions().iter().map(|&p| p.max(0)).collect(),
            n_seq_tokens: n as u32,
            seq_ids: vec![vec![dest]],
            ext: cells.exts().to_vec(),
        };
        if self.params.recurrent {
            if n != 1 {
                return Err(KvError::InvalidState(format!(
                    "a recurrent sequence state has 1 cell, the payload has {n}"
                )));
            }
            let slot = self.find_slot(&ub)?.ok_or_else(|| {
                KvError::NoSpace(format!("no free state cell for sequence {dest}"))
            })?;
            let cell = slot.head as usize;
            self.cells.set_pos(cell, cells.positions()[0]);
            self.cells.set_src(cell, cell as i32);
            return Ok(vec![cell]);
        }
        if let Some(slot) = self.find_slot(&ub)? {
            return Ok((slot.head as usize..slot.head as usize + n).collect());
        }
        let free: Vec<usize> = (0..self.cells.len())
            .filter(|&i| self.cells.pos(i) < 0)
            .take(n)
            .collect();
        if !allow_scattered || free.len() < n {
            return Err(KvError::NoSpace(format!(
                "no {} run of {n} free cells for sequence {dest} ({} free)",
                if allow_scattered { "set" } else { "contiguous" },
                (0..self.cells.len())
                    .filter(|&i| self.cells.pos(i) < 0)
                    .count()
            )));
        }
        self.assign_cells(dest, cells, &free);
        Ok(free)
    }

    /// Gives the free cells `at` the payload's cells of sequence `dest`, in order.
    pub(crate) fn assign_cells(&mut self, dest: i32, cells: &PayloadCells, at: &[usize]) {
        for (k, &cell) in at.iter().enumerate() {
            self.cells.set_pos(cell, cells.positions()[k]);
            self.cells.insert_seq(cell, dest as usize);
            if let Some(&ext) = cells.exts().get(k) {
                self.cells.set_ext(cell, ext);
            }
        }
        self.cells.used += at.len() as u32;
        self.cells.settle();
    }

    pub(crate) fn place_whole(&mut self, cells: &PayloadCells) -> Result<Vec<usize>> {
        let recurrent = self.params.recurrent;
        let tails = if recurrent {
            recurrent_tails(cells, self.cells.len())?
        } else {
            Vec::new()
        };
        self.cells.reset();
        self.head = 0;
        self.cells
            .fill_free(0, cells.positions(), |k| cells.seq_ids(k));
        for (i, &ext) in cells.exts().iter().enumerate() {
            self.cells.set_ext(i, ext);
        }
        if recurrent {
            for i in 0..cells.len() {
                self.cells.set_src(i, i as i32);
            }
            for (seq, &t) in tails.iter().enumerate() {
                self.cells.set_tail(seq, t);
            }
        }
        self.cells.used = cells.len() as u32;
        self.cells.settle();
        Ok((0..cells.len()).collect())
    }

    /// Zeroes the K/V data of cells `first..` (a whole-cache load then writes cells
    /// `..first`, so the tensors end up as llama.cpp's clear-then-read leaves them, without
    /// writing every byte twice). Device buffers are cleared whole.
    pub(crate) fn zero_rows_from(&mut self, first: usize) -> Result<()> {
        let size = self.params.size as usize;
        let v_trans = self.v_trans();
        let v_el = self.params.type_v.type_size();
        for l in &mut self.layers {
            match l.k.as_host_mut() {
                Some(bytes) => bytes[first * l.k_row..].fill(0),
                None => l.k.fill_zero()?,
            }
            match l.v.as_host_mut() {
                Some(bytes) if v_trans => {
                    for row in bytes.chunks_exact_mut(size * v_el) {
                        row[first * v_el..].fill(0);
                    }
                }
                Some(bytes) => bytes[first * l.v_row..].fill(0),
                None => l.v.fill_zero()?,
            }
        }
        Ok(())
    }

    fn write_payload_data(
        &mut self,
        data: &[u8],
        parsed: &ParsedPayload,
        placed: &[usize],
    ) -> Result<()> {
        let lay = self.v_geometry();
        let mut offset = 0;
        for stream in &parsed.streams {
            let n = stream.cells.len();
            let cells = &placed[offset..offset + n];
            offset += n;
            if n == 0 {
                continue;
            }
            let contiguous = cells.windows(2).all(|w| w[1] == w[0] + 1);
            for (l, b) in self.layers.iter_mut().zip(&stream.layers) {
                let k = &data[b.k_data.clone()];
                write_rows(l.k.as_mut(), l.k_row, cells, contiguous, 0, k)?;
                match &b.v {
                    VBlock::Rows { data: r, .. } => {
                        write_rows(
                            l.v.as_mut(),
                            l.v_row,
                            cells,
                            contiguous,
                            0,
                            &data[r.clone()],
                        )?;
                    }
                    VBlock::Transposed { data: r, .. } => {
                        let v = &data[r.clone()];
                        write_columns(l.v.as_mut(), (lay.v_el, lay.size), cells, contiguous, 0, v)?;
                    }
                    VBlock::Absent => {}
                }
            }
        }
        Ok(())
    }

    fn backup_if_device(&self) -> Result<Option<Vec<TensorBackup>>> {
        let on_device = self
            .layers
            .iter()
            .any(|l| l.k.as_host().is_none() || l.v.as_host().is_none());
        if !on_device {
            return Ok(None);
        }
        let mut out = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            let mut k = crate::alloc::zeroed(l.k.len(), "the K backup")?;
            let mut v = crate::alloc::zeroed(l.v.len(), "the V backup")?;
            l.k.read(0, &mut k)?;
            l.v.read(0, &mut v)?;
            out.push((k, v));
        }
        Ok(Some(out))
    }

    fn restore_backup(&mut self, backup: Vec<TensorBackup>) -> Result<()> {
        for (l, (k, v)) in self.layers.iter_mut().zip(backup) {
            l.k.write(0, &k)?;
            l.v.write(0, &v)?;
        }
        Ok(())
    }
}

/// A layer's K and V bytes, kept while a load writes to device memory.
type TensorBackup = (Vec<u8>, Vec<u8>);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::parse_payload;
    use crate::CacheParams;

    fn cache(n_rot: u32, type_k: GgmlType) -> SeedCache {
        let mut p = CacheParams::new(32, 2, 64, 64);
        p.n_seq_max = 2;
        p.flash_attn = true;
        p.type_k = type_k;
        p.type_v = type_k;
        (p.n_rot_k, p.n_rot_v) = (n_rot, n_rot);
        let mut c = SeedCache::new(p).unwrap();
        c.find_slot(&UBatch::sequence(0, 0, 5)).unwrap();
        c.find_slot(&UBatch::sequence(1, 0, 3)).unwrap();
        c
    }

    /// Whether `layout` reads `data` for `c` (the full parse and checks).
    fn reads(c: &SeedCache, data: &[u8], layout: Layout) -> bool {
        parse_payload(data, layout, true)
            .and_then(|p| c.check_payload(&p, None))
            .is_ok()
    }

    #[test]
    fn a_twin_layout_is_refuted_only_when_its_full_parse_would_fail() {
        let mut rng = 0x2545_f491u32;
        let mut refuted = 0;
        for (n_rot, ty) in [
            (0, GgmlType::F16),
            (0, GgmlType::Q8_0),
            (64, GgmlType::Q8_0),
        ] {
            let c = cache(n_rot, ty);
            for written in [Layout::Streams, Layout::StreamsRot] {
                let Ok(data) = c.state_write(-1, written, 1, None) else {
                    continue;
                };
                assert_eq!(
                    c.detect_payload(&data, None, None).unwrap().layout,
                    written,
                    "detected as written"
                );
                let fit = parse_payload(&data[..], written, true).unwrap();
                let twin = match written {
                    Layout::Streams => Layout::StreamsRot,
                    _ => Layout::Streams,
                };
                // mutate the first data header: the refutation must agree with a full parse
                let start = fit.streams[0].layers[0].k_data.start;
                for _ in 0..300 {
                    let mut bytes = data.clone();
                    rng ^= rng << 13;
                    rng ^= rng >> 17;
                    rng ^= rng << 5;
                    let at = start - 28 + (rng as usize % 28);
                    bytes[at] = (rng >> 8) as u8 & 0x41;
                    let Ok(fit) = parse_payload(&bytes[..], written, true) else {
                        continue;
                    };
                    if c.refute_twin(&bytes, &fit, twin).is_some() {
                        refuted += 1;
                        assert!(!reads(&c, &bytes, twin), "refuted a twin that reads");
                    }
                }
            }
        }
        assert!(refuted > 100, "{refuted} refutations");
        // a detected whole-cache read still loads what was written
        let mut c = cache(0, GgmlType::F16);
        let data = c.state_write(-1, Layout::Streams, 1, None).unwrap();
        let r = c
            .state_read(&data, -1, ReadOptions::default(), None)
            .unwrap();
        assert_eq!((r.layout, r.cells), (Layout::Streams, 8));
    }
}
