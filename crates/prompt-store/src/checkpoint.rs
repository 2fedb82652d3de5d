//! Checkpoints: what a restore point P needs beyond the chain's full blocks, as one
//! self-describing value keyed by the exact token prefix it ends
//! ([`checkpoint_key`](crate::geometry::checkpoint_key)):
//!
//! ```text
//! "KVPC"  u32 version  [32] fingerprint  [32] key  u32 P  u32 n_tail  i32 tail[n_tail]
//! u32 swa_mode (0 none, 1 tail rows, 2 window)  u32 n_win  i32 window positions[n_win]
//! u64 n_recurrent
//! dsa-iswa only: u32 n_win3  i32 window positions[n_win3] (its window cache's)
//! main rows: per layer K rows then V rows of the tail (n_tail rows, untransposed), then the
//!   tail's cell extensions when the geometry has one (as in a block)
//! swa rows: the same for the SWA layers, n_tail rows (mode 1) or n_win rows (mode 2)
//! dsa-iswa only: window rows, n_win3 rows of its window cache's layers
//! recurrent: n_recurrent bytes, the recurrent part of a one-sequence state (llama.cpp's bytes;
//!   dsv4: its compressed caches and compressor states of that sequence)
//! trailer (see [`crate::seal`])
//! ```
//!
//! The tail is the partial block after the last full block (tokens [bt * floor(P / bt), P)), so
//! a conversation that continues a saved one restores all of it.
//!
//! A chain position's checkpoints are listed in an index value (`"KVPI"`, the offsets after
//! that position's chain key), so a lookup asks for one small value per block instead of
//! probing every offset. Index values are replaced whole when a checkpoint is added; two
//! writers racing may drop each other's entry, which costs a miss, never a wrong prefix, since
//! every checkpoint is verified when read.

use crate::block::{BlockRows, Corrupt};
use crate::error::{StoreError, StoreResult};
use crate::geometry::{Geometry, FORMAT_VERSION};
use crate::key::Key;
use crate::seal::{Sealer, TRAILER};
use crate::shape::{Fields, PutLe, Shape};

const MAGIC: [u8; 4] = *b"KVPC";
const INDEX_MAGIC: [u8; 4] = *b"KVPI";

/// What identifies a checkpoint.
#[derive(Clone, Copy, Debug)]
pub struct CheckpointId<'a> {
    /// The store's fingerprint.
    pub fingerprint: &'a Key,
    /// The checkpoint's key.
    pub key: &'a Key,
    /// The restore point: tokens the state covers.
    pub len: u32,
    /// The tokens after the last full block.
    pub tail: &'a [i32],
}

/// The sliding-window rows a checkpoint carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SwaRows {
    /// Not an iSWA memory.
    None,
    /// The rows of the tail: the other positions are in the SWA blocks.
    Tail,
    /// The window the state kept, at these positions (ascending).
    Window(Vec<i32>),
}

impl SwaRows {
    fn mode(&self) -> u32 {
        match self {
            SwaRows::None => 0,
            SwaRows::Tail => 1,
            SwaRows::Window(_) => 2,
        }
    }
}

/// Which rows of a checkpoint: the main tail, the SWA (or indexer) rows, dsa-iswa's window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot {
    /// The main part's tail rows.
    Main,
    /// The SWA part's rows (tail or window), or the indexer's tail.
    Swa,
    /// dsa-iswa's window cache rows.
    Window,
}

impl Slot {
    fn name(self) -> &'static str {
        match self {
            Slot::Main => "main",
            Slot::Swa => "SWA",
            Slot::Window => "window",
        }
    }
}

/// A verified checkpoint, borrowed from its value.
pub struct CheckpointView<'a> {
    /// Tail rows of the main part.
    pub main: Option<BlockRows<'a>>,
    /// Which SWA rows it carries.
    pub swa_mode: SwaRows,
    /// The SWA rows (tail or window).
    pub swa: Option<BlockRows<'a>>,
    /// dsa-iswa: its window cache's positions and rows.
    pub window: Option<(Vec<i32>, BlockRows<'a>)>,
    /// The recurrent part's bytes (empty when the memory has none).
    pub recurrent: &'a [u8],
}

fn rows_len(g: Option<&Geometry>, n: usize) -> usize {
    g.map_or(0, |g| n * g.stored_bytes_per_token() as usize)
}

/// Encodes a checkpoint. `rows(out, slot)` appends the main tail rows, then the SWA rows, then
/// (dsa-iswa, whose window cache is at `window`) the window rows, laid out as in a block; the
/// encoder checks their lengths.
pub fn encode(
    id: &CheckpointId<'_>,
    sealer: &Sealer,
    shape: &Shape,
    (swa, window): (&SwaRows, &[i32]),
    recurrent: &[u8],
    mut rows: impl FnMut(&mut Vec<u8>, Slot) -> StoreResult<()>,
) -> StoreResult<Vec<u8>> {
    let main_g = shape.main.as_ref().map(|m| &m.layers);
    let swa_g = shape.swa.as_ref().map(|m| &m.layers);
    let window_g = shape.window.as_ref().map(|m| &m.layers);
    if window_g.is_none() && !window.is_empty() {
        return Err(StoreError::InvalidArg(
            "checkpoint: window rows for a memory without a window cache".into(),
        ));
    }
    let n_tail = id.tail.len();
    let n_swa = match swa {
        SwaRows::None => 0,
        SwaRows::Tail => n_tail,
        SwaRows::Window(p) => p.len(),
    };
    let swa_window: &[i32] = match swa {
        SwaRows::Window(p) => p,
        _ => &[],
    };
    let window_header = window_g.map_or(0, |_| 4 + 4 * window.len());
    let total = 4
        + 4
        + 32
        + 32
        + 4
        + 4
        + 4 * n_tail
        + 8
        + 4 * swa_window.len()
        + 8
        + window_header
        + rows_len(main_g, n_tail)
        + rows_len(swa_g, n_swa)
        + rows_len(window_g, window.len())
        + recurrent.len()
        + TRAILER;
    let mut out = Vec::new();
    out.try_reserve_exact(total).map_err(|_| {
        StoreError::Cache(llama_kv_cache::KvError::Backend(format!(
            "cannot allocate {total} bytes for a checkpoint"
        )))
    })?;
    out.extend_from_slice(&MAGIC);
    out.put_u32(FORMAT_VERSION);
    out.extend_from_slice(&id.fingerprint.0);
    out.extend_from_slice(&id.key.0);
    out.put_u32(id.len);
    out.put_u32(n_tail as u32);
    out.put_i32s(id.tail);
    out.put_u32(swa.mode());
    out.put_u32(swa_window.len() as u32);
    out.put_i32s(swa_window);
    out.put_u64(recurrent.len() as u64);
    if window_g.is_some() {
        out.put_u32(window.len() as u32);
        out.put_i32s(window);
    }
    for (slot, want) in [
        (Slot::Main, rows_len(main_g, n_tail)),
        (Slot::Swa, rows_len(swa_g, n_swa)),
        (Slot::Window, rows_len(window_g, window.len())),
    ] {
        let start = out.len();
        if want > 0 {
            rows(&mut out, slot)?;
        }
        if out.len() - start != want {
            return Err(StoreError::InvalidArg(format!(
                "checkpoint {} rows: {} bytes, expected {want}",
                slot.name(),
                out.len() - start
            )));
        }
    }
    out.extend_from_slice(recurrent);
    sealer.seal(id.key, &mut out);
    debug_assert_eq!(out.len(), total);
    Ok(out)
}

/// Verifies `value` as the checkpoint `id` of a store of `shape`: checksum, then every header
/// field against what the caller expects, then the lengths the shape implies.
pub fn decode<'a>(
    value: &'a [u8],
    id: &CheckpointId<'a>,
    sealer: &Sealer,
    shape: &'a Shape,
) -> Result<CheckpointView<'a>, Corrupt> {
    let bad = |why: &str| Err(Corrupt::damaged(why));
    let body = sealer.open(id.key, value).map_err(Corrupt::of)?;
    let mut f = Fields::new(body);
    let parsed = (|| {
        let magic = f.take(4)?;
        let version = f.u32()?;
        let fp = f.take(32)?;
        let key = f.take(32)?;
        let len = f.u32()?;
        let n_tail = f.u32()? as usize;
        let tail = f.i32s(n_tail)?;
        let mode = f.u32()?;
        let n_win = f.u32()? as usize;
        let window = f.i32s(n_win)?;
        let n_rec = usize::try_from(f.u64()?).ok()?;
        Some((magic, version, fp, key, len, tail, mode, window, n_rec))
    })();
    let Some((magic, version, fp, key, len, tail, mode, window, n_rec)) = parsed else {
        return bad("truncated header");
    };
    let window_g = shape.window.as_ref().map(|m| &m.layers);
    let third = match window_g {
        Some(_) => match f.u32().and_then(|n| f.i32s(n as usize)) {
            Some(p) => p,
            None => return bad("truncated header"),
        },
        None => Vec::new(),
    };
    if magic != MAGIC || version != FORMAT_VERSION {
        return bad("not a checkpoint of this format");
    }
    if fp != id.fingerprint.0 {
        return bad("another model or geometry (fingerprint mismatch)");
    }
    if key != id.key.0 || len != id.len || tail != id.tail {
        return bad("another prefix (key, length or tokens differ)");
    }
    let swa_mode = match (mode, shape.swa.is_some()) {
        (0, false) => SwaRows::None,
        (1, true) if window.is_empty() => SwaRows::Tail,
        (2, true) => SwaRows::Window(window),
        _ => return bad("SWA rows that do not fit the memory"),
    };
    // a recurrent state has the size of the shape's; dsv4's sections grow with P
    if (n_rec > 0) != (shape.recurrent.is_some() || shape.dsv4.is_some())
        || shape.recurrent.is_some_and(|r| r != n_rec as u64)
    {
        return bad("recurrent state that does not fit the memory");
    }
    let main_g = shape.main.as_ref().map(|m| &m.layers);
    let swa_g = shape.swa.as_ref().map(|m| &m.layers);
    let n_swa = match &swa_mode {
        SwaRows::None => 0,
        SwaRows::Tail => tail.len(),
        SwaRows::Window(p) => p.len(),
    };
    let (main_len, swa_len) = (rows_len(main_g, tail.len()), rows_len(swa_g, n_swa));
    let window_len = rows_len(window_g, third.len());
    if f.bytes.len() - f.at != main_len + swa_len + window_len + n_rec {
        return bad("rows of the wrong length");
    }
    let at = f.at;
    let main = main_g.map(|g| BlockRows::new(&body[at..at + main_len], g, tail.len()));
    let swa =
        swa_g.map(|g| BlockRows::new(&body[at + main_len..at + main_len + swa_len], g, n_swa));
    let at_window = at + main_len + swa_len;
    let n_third = third.len();
    let window = window_g.map(|g| {
        let rows = BlockRows::new(&body[at_window..at_window + window_len], g, n_third);
        (third, rows)
    });
    Ok(CheckpointView {
        main,
        swa_mode,
        swa,
        window,
        recurrent: &body[at_window + window_len..],
    })
}

/// An index value under `key`: the sorted offsets of the checkpoints after one chain position.
pub fn encode_index(key: &Key, sealer: &Sealer, offsets: &[u32]) -> Vec<u8> {
    let mut out = INDEX_MAGIC.to_vec();
    out.put_u32(FORMAT_VERSION);
    out.put_u32(offsets.len() as u32);
    for o in offsets {
        out.put_u32(*o);
    }
    sealer.seal(key, &mut out);
    out
}

/// The offsets of an index value under `key`, or `None` when it is not one of this store's
/// (then it reads as empty: the checkpoints it lists are verified when read anyway).
pub fn decode_index(key: &Key, sealer: &Sealer, value: &[u8]) -> Option<Vec<u32>> {
    let body = sealer.open(key, value).ok()?;
    let mut f = Fields::new(body);
    if f.take(4)? != INDEX_MAGIC || f.u32()? != FORMAT_VERSION {
        return None;
    }
    let n = f.u32()? as usize;
    let offsets = (0..n).map(|_| f.u32()).collect::<Option<Vec<_>>>()?;
    (f.at == body.len()).then_some(offsets)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::LayerGeometry;
    use crate::shape::KvShape;
    use llama_kv_cache::model::MemoryKind;
    use llama_kv_cache::GgmlType;

    fn shape() -> Shape {
        let g = Geometry {
            layers: vec![LayerGeometry {
                k_type: GgmlType::F16,
                k_row: 4,
                v_type: GgmlType::F16,
                v_row: 2,
            }],
            ext: llama_kv_cache::CellExt::None,
            no_v: false,
        };
        Shape {
            memory: MemoryKind::Iswa,
            main: Some(KvShape {
                layers: g.clone(),
                rot: (0, 0),
            }),
            swa: Some(KvShape {
                layers: g,
                rot: (0, 0),
            }),
            recurrent: None,
            window: None,
            dsv4: None,
        }
    }

    const FP: Key = Key([1; 32]);
    const KEY: Key = Key([2; 32]);

    /// A checkpoint of 18 tokens whose last block holds 2.
    fn id() -> CheckpointId<'static> {
        CheckpointId {
            fingerprint: &FP,
            key: &KEY,
            len: 18,
            tail: &[7, 8],
        }
    }

    #[test]
    fn a_checkpoint_round_trips_and_every_flip_is_corrupt() {
        let s = shape();
        let id = id();
        let swa = SwaRows::Window(vec![15, 16, 17]);
        let sealer = Sealer::new(Some(b"k"));
        let v = encode(&id, &sealer, &s, (&swa, &[]), &[], |out, slot| {
            let n = if slot == Slot::Swa { 3 } else { 2 };
            out.extend(std::iter::repeat_n((slot == Slot::Swa) as u8 + 1, n * 6));
            Ok(())
        })
        .unwrap();
        let got = decode(&v, &id, &sealer, &s).unwrap();
        assert_eq!(got.swa_mode, swa);
        assert_eq!(got.main.as_ref().unwrap().k(0), &[1; 8]);
        assert_eq!(got.swa.as_ref().unwrap().v(0), &[2; 6]);
        for i in 0..v.len() {
            let mut w = v.clone();
            w[i] ^= 1;
            assert!(decode(&w, &id, &sealer, &s).is_err(), "flip at {i}");
        }
        let other = CheckpointId { len: 19, ..id };
        assert!(decode(&v, &other, &sealer, &s).is_err());
    }

    #[test]
    fn a_dsa_iswa_checkpoint_carries_its_window_cache_after_the_indexer_tail() {
        let s = Shape {
            memory: MemoryKind::DsaIswa,
            window: shape().main,
            ..shape()
        };
        let id = id();
        let sealer = Sealer::new(None);
        let v = encode(
            &id,
            &sealer,
            &s,
            (&SwaRows::Tail, &[14, 16, 17]),
            &[],
            |out, slot| {
                let n = if slot == Slot::Window { 3 } else { 2 };
                out.extend(std::iter::repeat_n(slot as u8 + 1, n * 6));
                Ok(())
            },
        )
        .unwrap();
        let got = decode(&v, &id, &sealer, &s).unwrap();
        assert_eq!(got.swa_mode, SwaRows::Tail);
        assert_eq!(got.swa.as_ref().unwrap().k(0), &[2; 8]);
        let (positions, rows) = got.window.as_ref().unwrap();
        assert_eq!(positions, &[14, 16, 17]);
        assert_eq!(rows.k(0), &[3; 12]);
        // a window for a memory without one is refused before anything is written
        let e = encode(
            &id,
            &sealer,
            &shape(),
            (&SwaRows::Tail, &[1]),
            &[],
            |_, _| Ok(()),
        );
        assert!(e.is_err());
        // and the shape decides whether the window header is there
        assert!(decode(&v, &id, &sealer, &shape()).is_err());
    }

    #[test]
    fn index_values_round_trip_and_garbage_reads_as_none() {
        let (k, sealer) = (Key([3; 32]), Sealer::new(None));
        let v = encode_index(&k, &sealer, &[0, 3, 9]);
        assert_eq!(decode_index(&k, &sealer, &v), Some(vec![0, 3, 9]));
        assert_eq!(decode_index(&k, &sealer, &v[1..]), None);
        assert_eq!(decode_index(&Key([4; 32]), &sealer, &v), None);
        assert_eq!(decode_index(&k, &sealer, b"x"), None);
    }
}
