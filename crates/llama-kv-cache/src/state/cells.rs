//! The cell metadata of a state payload, as columns: its parser and its writer.
//!
//! A payload holds each cell as `pos: i32, n_seq_id: u32, [ext], seq_id: i32 × n_seq_id`, where
//! `ext` is llama.cpp's `llama_kv_cell_ext`, present only in the files of models whose cells
//! carry more than a position (M-RoPE: Qwen2-VL, Qwen2.5-VL, Qwen3-VL; PLE models). Nothing in
//! the payload says whether it is there: a reader knows the model or decides by exact length,
//! as for layouts ([`CellExt`]). The parser
//! keeps them as three columns (positions; every cell's seq ids in one flat list; where each
//! cell's ids end) instead of a vector of per-cell structs with a small vector each: building
//! and moving one such struct per cell cost 8 to 12 ns, most of the metadata time of a
//! 65,536-cell load, where three scalar columns are written at about a nanosecond per cell and
//! can be handed to the cell table as slices.
//!
//! One parser serves every reader: a payload in memory is parsed in one piece, a file in chunks,
//! and a stream as its bytes arrive ([`CellParser::feed`] takes whole cells and stops at the
//! first one that is cut).

pub use crate::cell_ext::{CellExt, CellExtValue};
use crate::cells::SeqSet;
use crate::error::{KvError, Result};
use crate::state::source::{truncated, ByteSource, Cursor};

/// Most sequences a payload may name: the bound on a cell's `n_seq_id` and on `n_stream`
/// (llama.cpp's `LLAMA_MAX_SEQ`, also the most this cache tracks).
pub(crate) const MAX_PAYLOAD_SEQS: u32 = crate::MAX_SEQ as u32;

/// Most bytes a file is read in at once while parsing its cells.
const CHUNK: usize = 64 * 1024;

/// Bytes of the largest plausible cell: a read of this many always makes progress.
const MAX_CELL_BYTES: usize = 8 + 12 + 4 * MAX_PAYLOAD_SEQS as usize;

/// The cells of one stream of a payload, in payload order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PayloadCells {
    pos: Vec<i32>,
    ids: Vec<i32>,
    /// `ends[i]`: the end of cell `i`'s ids in `ids` (cell `i` starts where cell `i - 1` ends).
    ends: Vec<u32>,
    /// Which extension the cells carried, and each cell's (empty for [`CellExt::None`]).
    ext_kind: CellExt,
    ext: Vec<CellExtValue>,
}

/// One cell of a payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CellMeta<'a> {
    /// Position.
    pub pos: i32,
    /// Seq ids as written (empty for the seed's single-sequence cells).
    pub seq_ids: &'a [i32],
    /// The cell's extension, when the payload carries them.
    pub ext: Option<CellExtValue>,
}

impl PayloadCells {
    /// No cells.
    pub fn new() -> Self {
        Self::default()
    }

    /// Room for `n` cells of one seq id each, allocated fallibly (`n` comes from the input).
    pub fn with_capacity(n: usize) -> Result<Self> {
        let what = "the cells of a state";
        Ok(PayloadCells {
            pos: crate::alloc::with_capacity(n, what)?,
            ids: crate::alloc::with_capacity(n, what)?,
            ends: crate::alloc::with_capacity(n, what)?,
            ext_kind: CellExt::None,
            ext: Vec::new(),
        })
    }

    /// Room for `n` cells carrying the extension `ext`.
    pub fn with_ext(n: usize, ext: CellExt) -> Result<Self> {
        let mut cells = Self::with_capacity(n)?;
        if !ext.is_none() {
            cells.ext = crate::alloc::with_capacity(n, "the cell extensions of a state")?;
        }
        cells.ext_kind = ext;
        Ok(cells)
    }

    /// Appends a cell with its extension (payloads of [`CellExt`] other than none).
    /// The cells must have been made [`PayloadCells::with_ext`].
    pub fn push_with_ext(&mut self, pos: i32, seq_ids: &[i32], ext: CellExtValue) {
        debug_assert!(!self.ext_kind.is_none());
        self.push(pos, seq_ids);
        self.ext.push(ext);
    }

    /// Which extension the cells carry.
    pub fn ext_kind(&self) -> CellExt {
        self.ext_kind
    }

    /// Every cell's extension, in payload order (empty when the cells carry none).
    pub fn exts(&self) -> &[CellExtValue] {
        &self.ext
    }

    /// Appends a cell.
    pub fn push(&mut self, pos: i32, seq_ids: &[i32]) {
        self.pos.push(pos);
        self.ids.extend_from_slice(seq_ids);
        self.ends.push(self.ids.len() as u32);
    }

    /// The cells of several streams, one after the other.
    pub fn concat<'a>(parts: impl IntoIterator<Item = &'a PayloadCells>) -> Result<Self> {
        let parts: Vec<&PayloadCells> = parts.into_iter().collect();
        let n = parts.iter().map(|p| p.len()).sum();
        let ext = parts.first().map_or(CellExt::None, |p| p.ext_kind);
        let mut out = PayloadCells::with_ext(n, ext)?;
        for p in parts {
            for cell in p.iter() {
                out.push(cell.pos, cell.seq_ids);
                out.ext.extend(cell.ext);
            }
        }
        Ok(out)
    }

    /// Number of cells.
    pub fn len(&self) -> usize {
        self.pos.len()
    }

    /// Whether there are no cells.
    pub fn is_empty(&self) -> bool {
        self.pos.is_empty()
    }

    /// Every cell's position, in payload order.
    pub fn positions(&self) -> &[i32] {
        &self.pos
    }

    /// Cell `i`'s seq ids.
    #[inline]
    pub fn seq_ids(&self, i: usize) -> &[i32] {
        let start = if i == 0 { 0 } else { self.ends[i - 1] as usize };
        &self.ids[start..self.ends[i] as usize]
    }

    /// Cell `i`'s seq ids as a set (each id in `0..MAX_SEQ`, validated by the caller).
    #[inline]
    pub fn seq_set(&self, i: usize) -> SeqSet {
        SeqSet::of(self.seq_ids(i))
    }

    /// Cell `i`.
    pub fn get(&self, i: usize) -> CellMeta<'_> {
        CellMeta {
            pos: self.pos[i],
            seq_ids: self.seq_ids(i),
            ext: self.ext.get(i).copied(),
        }
    }

    /// The cells in payload order.
    pub fn iter(&self) -> impl Iterator<Item = CellMeta<'_>> + '_ {
        (0..self.len()).map(|i| self.get(i))
    }

    /// Whether every cell declares exactly `n` seq ids.
    pub fn all_have_ids(&self, n: usize) -> bool {
        self.ids.len() == n * self.len()
            && self.ends.iter().zip(1..).all(|(&e, k)| e as usize == n * k)
    }

    /// Every cell's seq ids, flat, in payload order.
    pub fn all_ids(&self) -> &[i32] {
        &self.ids
    }
}

/// Parses `count` cells from the bytes it is fed.
pub(crate) struct CellParser {
    cells: PayloadCells,
    count: usize,
    ext: usize,
}

impl CellParser {
    /// A parser for `count` cells carrying `ext` (room allocated fallibly).
    pub fn new(count: u32, ext: CellExt) -> Result<Self> {
        Ok(CellParser {
            cells: PayloadCells::with_ext(count as usize, ext)?,
            count: count as usize,
            ext: ext.bytes(),
        })
    }

    /// Whether every cell has been parsed.
    pub fn done(&self) -> bool {
        self.cells.len() == self.count
    }

    /// Cells not parsed yet.
    pub fn left(&self) -> usize {
        self.count - self.cells.len()
    }

    /// Parses whole cells from the front of `bytes` until all are parsed or the next one is
    /// cut; returns the bytes consumed. An implausible `n_seq_id` is an error at once.
    pub fn feed(&mut self, bytes: &[u8]) -> Result<usize> {
        let cells = &mut self.cells;
        let mut at = 0;
        while cells.pos.len() < self.count {
            if self.ext == 0 {
                at += take_single_id_run(cells, &bytes[at..], self.count);
                if cells.pos.len() == self.count {
                    break;
                }
            }
            let Some(head) = bytes.get(at..at + 8) else {
                break;
            };
            let pos = i32::from_le_bytes([head[0], head[1], head[2], head[3]]);
            let n = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
            if n > MAX_PAYLOAD_SEQS {
                return Err(KvError::InvalidState(format!(
                    "cell {}: n_seq_id {n} is implausible",
                    cells.pos.len()
                )));
            }
            let end = at + 8 + self.ext + 4 * n as usize;
            let Some(ids) = bytes.get(at + 8 + self.ext..end) else {
                break;
            };
            let id = |b: &[u8]| i32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            if self.ext > 0 {
                let e = &bytes[at + 8..at + 8 + self.ext];
                cells.ext.push(CellExtValue {
                    x: id(&e[0..4]),
                    y: id(&e[4..8]),
                    tok: if self.ext == 12 { id(&e[8..12]) } else { -1 },
                });
            }
            cells.pos.push(pos);
            // one id is the common case: a push, where an extend is a call per cell
            match ids.len() {
                0 => {}
                4 => cells.ids.push(id(ids)),
                _ => cells.ids.extend(ids.chunks_exact(4).map(id)),
            }
            cells.ends.push(cells.ids.len() as u32);
            at = end;
        }
        Ok(at)
    }

    /// The error of a payload that ends in the next cell: `rest` are its bytes left after what
    /// [`CellParser::feed`] consumed, which start at byte `offset` of the payload.
    pub fn truncation(&self, rest: &[u8], offset: usize) -> KvError {
        let i = self.cells.len();
        match rest.len() {
            n @ 0..4 => truncated(offset, format_args!("cell {i} pos"), 4, n),
            n @ 4..8 => truncated(offset + 4, format_args!("cell {i} n_seq_id"), 4, n - 4),
            n if n < 8 + self.ext => {
                truncated(offset + 8, format_args!("cell {i} ext"), self.ext, n - 8)
            }
            n => {
                let j = (n - 8 - self.ext) / 4;
                let at = offset + 8 + self.ext + 4 * j;
                let left = n - 8 - self.ext - 4 * j;
                truncated(at, format_args!("cell {i} seq_id {j}"), 4, left)
            }
        }
    }

    /// The parsed cells.
    pub fn finish(self) -> PayloadCells {
        self.cells
    }
}

/// Takes the run of whole cells of one seq id and no extension (12 bytes each, a sequence's
/// cells) at the front of `bytes` into `cells`, up to `count` cells in all; returns the bytes
/// taken. Column by column: a cell at a time, three pushes, was a tenth of a sequence read.
fn take_single_id_run(cells: &mut PayloadCells, bytes: &[u8], count: usize) -> usize {
    let word = |c: &[u8], at: usize| [c[at], c[at + 1], c[at + 2], c[at + 3]];
    let room = (count - cells.pos.len()).min(bytes.len() / 12);
    let run = bytes[..12 * room]
        .chunks_exact(12)
        .take_while(|c| u32::from_le_bytes(word(c, 4)) == 1)
        .count();
    let run_bytes = &bytes[..12 * run];
    let cell = || run_bytes.chunks_exact(12);
    cells
        .pos
        .extend(cell().map(|c| i32::from_le_bytes(word(c, 0))));
    let first_end = cells.ids.len() as u32 + 1;
    cells
        .ids
        .extend(cell().map(|c| i32::from_le_bytes(word(c, 8))));
    cells.ends.extend(first_end..first_end + run as u32);
    12 * run
}

/// Bytes of one cell with `n_ids` seq ids in a payload whose cells carry `ext`.
#[inline]
pub fn cell_len(n_ids: usize, ext: CellExt) -> usize {
    8 + ext.bytes() + 4 * n_ids
}

/// Writes one cell into `dst`, exactly [`cell_len`] bytes, which say how many seq ids `ids`
/// yields: the one encoder of the cell format. `ext` is written when `kind` has one (the
/// default extension when it is `None`).
#[inline]
pub fn put_cell(
    dst: &mut [u8],
    pos: i32,
    kind: CellExt,
    ext: Option<CellExtValue>,
    ids: impl Iterator<Item = i32>,
) {
    let e = kind.bytes();
    let n_ids = (dst.len() - 8 - e) / 4;
    dst[..4].copy_from_slice(&pos.to_le_bytes());
    dst[4..8].copy_from_slice(&(n_ids as u32).to_le_bytes());
    if e > 0 {
        let v = ext.unwrap_or_default();
        dst[8..12].copy_from_slice(&v.x.to_le_bytes());
        dst[12..16].copy_from_slice(&v.y.to_le_bytes());
        if e == 12 {
            dst[16..20].copy_from_slice(&v.tok.to_le_bytes());
        }
    }
    for (slot, id) in dst[8 + e..].chunks_exact_mut(4).zip(ids) {
        slot.copy_from_slice(&id.to_le_bytes());
    }
}

/// [`put_cell`] of a cell without extension and with exactly one seq id, the common case of
/// every one-sequence save since mid-2025: a fixed-size write that compiles to plain stores.
#[inline]
pub fn put_cell_one_id(dst: &mut [u8; 12], pos: i32, id: i32) {
    dst[..4].copy_from_slice(&pos.to_le_bytes());
    dst[4..8].copy_from_slice(&1u32.to_le_bytes());
    dst[8..].copy_from_slice(&id.to_le_bytes());
}

/// Parses `count` cells at the cursor and steps past them: in one piece from memory, in chunks
/// from a file.
pub(crate) fn parse_cells<S: ByteSource + ?Sized>(
    c: &mut Cursor<'_, S>,
    count: u32,
    ext: CellExt,
) -> Result<PayloadCells> {
    let mut parser = CellParser::new(count, ext)?;
    let mut scratch = Vec::new();
    while !parser.done() {
        let left = c.remaining();
        // about what the cells left need (a file of 16 cells reads a few hundred bytes)
        let want = (12 * parser.left()).clamp(MAX_CELL_BYTES, CHUNK).min(left);
        let bytes = c.src.window(c.pos, want, &mut scratch)?;
        let used = parser.feed(bytes)?;
        let whole = bytes.len() == left;
        if !parser.done() && whole {
            c.ran_out = true;
            return Err(parser.truncation(&bytes[used..], c.pos + used));
        }
        c.pos += used;
    }
    Ok(parser.finish())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::source::ReadSource;

    fn encode(cells: &[(i32, Vec<i32>)]) -> Vec<u8> {
        let mut out = Vec::new();
        for (pos, ids) in cells {
            out.extend(pos.to_le_bytes());
            out.extend((ids.len() as u32).to_le_bytes());
            for id in ids {
                out.extend(id.to_le_bytes());
            }
        }
        out
    }

    fn sample() -> Vec<(i32, Vec<i32>)> {
        (0..20_000)
            .map(|i| (i, (0..i % 4).map(|k| (i + k) % 64).collect()))
            .collect()
    }

    #[test]
    fn memory_and_file_parse_the_same_cells_and_stop_at_the_same_byte() {
        let cells = sample();
        let mut bytes = encode(&cells);
        bytes.extend([7u8; 5]);
        let file = ReadSource::new(std::io::Cursor::new(&bytes), bytes.len() as u64, "f").unwrap();
        let mut a = Cursor::new(&bytes[..]);
        let mut b = Cursor::new(&file);
        let (pa, pb) = (
            parse_cells(&mut a, cells.len() as u32, CellExt::None).unwrap(),
            parse_cells(&mut b, cells.len() as u32, CellExt::None).unwrap(),
        );
        assert_eq!(pa, pb);
        assert_eq!((a.pos, b.pos), (bytes.len() - 5, bytes.len() - 5));
        let back: Vec<(i32, Vec<i32>)> = pa.iter().map(|c| (c.pos, c.seq_ids.to_vec())).collect();
        assert_eq!(back, cells);
    }

    #[test]
    fn a_cut_cell_names_its_field_and_offset_from_memory_and_from_a_file() {
        let cells = sample();
        let bytes = encode(&cells);
        // cut in the pos, the n_seq_id and the second seq id of cell 3 (3 ids, 20 bytes)
        let start3: usize = 8 * 3 + 4 * 3;
        for (cut, want) in [
            (
                start3 + 2,
                "truncated at byte 36 reading cell 3 pos (4 bytes needed, 2 left)",
            ),
            (
                start3 + 5,
                "truncated at byte 40 reading cell 3 n_seq_id (4 bytes needed, 1 left)",
            ),
            (
                start3 + 14,
                "truncated at byte 48 reading cell 3 seq_id 1 (4 bytes needed, 2 left)",
            ),
        ] {
            let cut = &bytes[..cut];
            let e = parse_cells(&mut Cursor::new(cut), 5, CellExt::None)
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{e}");
            let file = ReadSource::new(std::io::Cursor::new(cut), cut.len() as u64, "f").unwrap();
            let e = parse_cells(&mut Cursor::new(&file), 5, CellExt::None)
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{e}");
        }
    }

    #[test]
    fn feeding_in_pieces_gives_the_cells_of_one_feed() {
        let cells = sample();
        let bytes = encode(&cells);
        let mut whole = CellParser::new(cells.len() as u32, CellExt::None).unwrap();
        assert_eq!(whole.feed(&bytes).unwrap(), bytes.len());
        let mut pieces = CellParser::new(cells.len() as u32, CellExt::None).unwrap();
        let mut at = 0;
        for step in [1usize, 7, 13, 4096].into_iter().cycle() {
            if pieces.done() {
                break;
            }
            let end = (at + step).min(bytes.len());
            at += pieces.feed(&bytes[at..end]).unwrap();
        }
        assert_eq!(whole.finish(), pieces.finish());
    }

    #[test]
    fn an_implausible_seq_id_count_is_refused_before_its_ids_arrive() {
        let mut p = CellParser::new(2, CellExt::None).unwrap();
        let mut bytes = encode(&[(0, vec![1])]);
        bytes.extend(5i32.to_le_bytes());
        bytes.extend(257u32.to_le_bytes());
        let e = p.feed(&bytes).unwrap_err().to_string();
        assert!(e.contains("cell 1: n_seq_id 257 is implausible"), "{e}");
    }

    #[test]
    fn columns_answer_per_cell_questions() {
        let mut c = PayloadCells::new();
        c.push(4, &[1]);
        c.push(5, &[2, 3]);
        c.push(6, &[]);
        assert_eq!(c.seq_ids(1), &[2, 3]);
        assert_eq!(c.seq_set(1), SeqSet::of(&[2, 3]));
        assert_eq!(c.positions(), &[4, 5, 6]);
        assert!(!c.all_have_ids(1));
        let joined = PayloadCells::concat([&c, &c]).unwrap();
        assert_eq!((joined.len(), joined.get(4).seq_ids), (6, &[2, 3][..]));
        let mut one = PayloadCells::new();
        (0..3).for_each(|p| one.push(p, &[0]));
        assert!(one.all_have_ids(1) && !one.all_have_ids(0));
    }

    /// A cell as llama.cpp 0.1.161 writes it for an M-RoPE model: pos, n_seq_id, x, y, tok, ids.
    fn encode_ext(cells: &[(i32, Vec<i32>, CellExtValue)], kind: CellExt) -> Vec<u8> {
        let mut out = Vec::new();
        for (pos, ids, ext) in cells {
            let at = out.len();
            out.resize(at + cell_len(ids.len(), kind), 0);
            put_cell(&mut out[at..], *pos, kind, Some(*ext), ids.iter().copied());
        }
        out
    }

    #[test]
    fn cells_with_extensions_round_trip_through_the_one_writer_and_parser() {
        let cells: Vec<(i32, Vec<i32>, CellExtValue)> = (0..300)
            .map(|i| {
                let ext = CellExtValue {
                    x: i % 7,
                    y: i / 7,
                    tok: 1000 + i,
                };
                (i / 3, (0..1 + i % 2).collect(), ext)
            })
            .collect();
        for kind in [CellExt::Pos2, CellExt::Pos2Tok] {
            let bytes = encode_ext(&cells, kind);
            let mut c = Cursor::new(&bytes[..]);
            let parsed = parse_cells(&mut c, cells.len() as u32, kind).unwrap();
            assert_eq!((c.pos, parsed.ext_kind()), (bytes.len(), kind));
            for (i, (pos, ids, ext)) in cells.iter().enumerate() {
                let got = parsed.get(i);
                let want_tok = if kind == CellExt::Pos2Tok {
                    ext.tok
                } else {
                    -1
                };
                assert_eq!((got.pos, got.seq_ids), (*pos, &ids[..]));
                assert_eq!(
                    got.ext,
                    Some(CellExtValue {
                        tok: want_tok,
                        ..*ext
                    })
                );
            }
            // the same bytes read without the extension do not come out as these cells
            let plain = parse_cells(
                &mut Cursor::new(&bytes[..]),
                cells.len() as u32,
                CellExt::None,
            );
            assert!(plain.map_or(true, |p| p.positions() != parsed.positions()));
        }
    }

    #[test]
    fn a_cut_extension_names_its_field() {
        let ext = CellExtValue { x: 1, y: 2, tok: 3 };
        let bytes = encode_ext(&[(0, vec![0], ext)], CellExt::Pos2Tok);
        let e = parse_cells(&mut Cursor::new(&bytes[..14]), 1, CellExt::Pos2Tok)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("reading cell 0 ext (12 bytes needed, 6 left)"),
            "{e}"
        );
    }

    #[test]
    fn the_fixed_size_writer_writes_what_the_general_one_does() {
        let mut a = [0u8; 12];
        put_cell_one_id(&mut a, 41, 7);
        let mut b = [0u8; 12];
        put_cell(&mut b, 41, CellExt::None, None, [7].into_iter());
        assert_eq!(a, b);
    }
}
