//! One block as one self-describing value:
//!
//! ```text
//! "KVPB"  u32 version  [32] fingerprint  [32] chain key  u32 block index
//! u32 n_tokens  i32 tokens[n_tokens]
//! geometry: u32 n_layer, per layer i32 k_type, u64 k_row, i32 v_type, u64 v_row
//! per layer: K rows (n_tokens * k_row), then V rows (n_tokens * v_row, untransposed)
//! cell extensions, when the geometry has one: per token i32 x, y, tok
//! trailer: [32] BLAKE3 of everything before, [32] tag (see [`crate::seal`])
//! ```
//!
//! All integers little-endian. The header repeats the block's own chain key, so a value copied
//! to another key (even one with the same tokens at the same index under another prefix) is
//! recognised as foreign.

use crate::error::{StoreError, StoreResult};
use crate::geometry::{ext_at, Geometry, EXT_BYTES, FORMAT_VERSION};
use crate::key::Key;
use crate::seal::{Broken, Sealer, TRAILER};
use llama_kv_cache::CellExtValue;

/// The magic at the start of every block.
pub const MAGIC: [u8; 4] = *b"KVPB";

/// Bytes of a block's header that name it: magic, version, fingerprint, key.
pub const HEAD_BYTES: usize = 72;

/// Where the token count is, after the block index.
const COUNT_AT: usize = 76;

/// Where the tokens start.
const TOKENS_AT: usize = 80;

fn u32_at(value: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([value[at], value[at + 1], value[at + 2], value[at + 3]])
}

/// The fingerprint and key a block's first [`HEAD_BYTES`] name (an evicted value's first bytes
/// are enough); `None` for other values (records, checkpoints, indexes) and shorter bytes.
pub fn named(value: &[u8]) -> Option<(&[u8], Key)> {
    if value.len() < HEAD_BYTES || value[..4] != MAGIC {
        return None;
    }
    Some((&value[8..40], Key(value[40..72].try_into().ok()?)))
}

/// A block's header as its bytes say it, verified against nothing: what the readers of stored
/// values that hold no [`BlockId`] need (KV events, compact blocks), and what [`decode`]
/// compares with the one it expects.
pub struct Head<'a> {
    /// The format version (a compact value flags it, see [`crate::compact`]).
    pub version: u32,
    pub fingerprint: &'a [u8],
    pub key: Key,
    pub index: u32,
    pub n_tokens: usize,
    /// The tokens' bytes; empty when the value stops before their end.
    pub tokens: &'a [u8],
}

impl Head<'_> {
    /// Where the geometry starts (`None` when the count overflows).
    pub fn geometry_at(&self) -> Option<usize> {
        TOKENS_AT.checked_add(self.n_tokens.checked_mul(4)?)
    }
}

/// The header of the block `value`; `None` for other values and bytes that stop before the
/// token count.
pub fn head(value: &[u8]) -> Option<Head<'_>> {
    let (fingerprint, key) = named(value)?;
    if value.len() < TOKENS_AT {
        return None;
    }
    let n_tokens = u32_at(value, COUNT_AT) as usize;
    Some(Head {
        version: u32_at(value, 4),
        fingerprint,
        key,
        index: u32_at(value, HEAD_BYTES),
        n_tokens,
        tokens: n_tokens
            .checked_mul(4)
            .and_then(|len| value.get(TOKENS_AT..TOKENS_AT.checked_add(len)?))
            .unwrap_or(&[]),
    })
}

/// What identifies a block: the fields its header must carry.
#[derive(Clone, Copy, Debug)]
pub struct BlockId<'a> {
    /// The store's fingerprint (model identity + geometry + format version).
    pub fingerprint: &'a Key,
    /// This block's chain key.
    pub key: &'a Key,
    /// Index of the block in its prompt.
    pub index: u32,
    /// The block's tokens.
    pub tokens: &'a [i32],
    /// Shapes of the rows.
    pub geometry: &'a Geometry,
}

fn header_len(id: &BlockId<'_>) -> usize {
    let ext_id = if id.geometry.ext.is_none() { 0 } else { 4 };
    TOKENS_AT + 4 * id.tokens.len() + 4 + 24 * id.geometry.layers.len() + ext_id
}

/// Total encoded size of a block.
pub fn encoded_len(id: &BlockId<'_>) -> usize {
    header_len(id) + id.tokens.len() * id.geometry.stored_bytes_per_token() as usize + TRAILER
}

/// Encodes a block into `out`, replacing its contents (so that a caller can reuse one
/// buffer). `rows(out, layer, is_v)` appends the layer's `n_tokens` K (or V) rows, in token
/// order; then, when the geometry has a cell extension, `exts(out)` appends each token's
/// ([`crate::geometry::put_exts`]). The encoder checks that each appended exactly that many
/// bytes.
pub fn encode_into(
    id: &BlockId<'_>,
    sealer: &Sealer,
    out: &mut Vec<u8>,
    mut rows: impl FnMut(&mut Vec<u8>, usize, bool) -> StoreResult<()>,
    exts: impl FnOnce(&mut Vec<u8>) -> StoreResult<()>,
) -> StoreResult<()> {
    let total = encoded_len(id);
    out.clear();
    out.try_reserve_exact(total).map_err(|_| {
        StoreError::Cache(llama_kv_cache::KvError::Backend(format!(
            "cannot allocate {total} bytes for a block"
        )))
    })?;
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&id.fingerprint.0);
    out.extend_from_slice(&id.key.0);
    out.extend_from_slice(&id.index.to_le_bytes());
    out.extend_from_slice(&(id.tokens.len() as u32).to_le_bytes());
    for t in id.tokens {
        out.extend_from_slice(&t.to_le_bytes());
    }
    id.geometry.encode(out);
    let n = id.tokens.len();
    for (il, l) in id.geometry.layers.iter().enumerate() {
        for (is_v, row) in [(false, l.k_row), (true, l.v_row)] {
            let start = out.len();
            rows(out, il, is_v)?;
            let want = n * row as usize;
            if out.len() - start != want {
                return Err(StoreError::InvalidArg(format!(
                    "layer {il} {}: {} bytes of rows for {n} tokens of {row} bytes",
                    if is_v { "V" } else { "K" },
                    out.len() - start
                )));
            }
        }
    }
    if !id.geometry.ext.is_none() {
        let start = out.len();
        exts(out)?;
        if out.len() - start != n * EXT_BYTES {
            return Err(StoreError::InvalidArg(format!(
                "{} bytes of cell extensions for {n} tokens",
                out.len() - start
            )));
        }
    }
    sealer.seal(id.key, out);
    debug_assert_eq!(out.len(), total);
    Ok(())
}

/// A verified block: its rows, borrowed from the value.
#[derive(Debug)]
pub struct BlockRows<'a> {
    data: &'a [u8],
    geometry: &'a Geometry,
    n_tokens: usize,
}

impl<'a> BlockRows<'a> {
    /// Rows of `n_tokens` tokens laid out as in a block: per layer, K rows then V rows.
    pub(crate) fn new(data: &'a [u8], geometry: &'a Geometry, n_tokens: usize) -> Self {
        BlockRows {
            data,
            geometry,
            n_tokens,
        }
    }

    /// Tokens (rows per layer).
    pub fn n_tokens(&self) -> usize {
        self.n_tokens
    }

    /// K rows of layer `il` (n_tokens rows).
    pub fn k(&self, il: usize) -> &'a [u8] {
        self.part(il, false)
    }

    /// V rows of layer `il` (n_tokens rows, untransposed).
    pub fn v(&self, il: usize) -> &'a [u8] {
        self.part(il, true)
    }

    /// The cell extension of token `k` (the default when the geometry has none).
    pub fn ext(&self, k: usize) -> CellExtValue {
        if self.geometry.ext.is_none() {
            return CellExtValue::default();
        }
        let rows = self.n_tokens * self.geometry.bytes_per_token() as usize;
        ext_at(&self.data[rows..], k)
    }

    fn part(&self, il: usize, is_v: bool) -> &'a [u8] {
        let n = self.n_tokens;
        let mut off = 0;
        for l in &self.geometry.layers[..il] {
            off += n * (l.k_row + l.v_row) as usize;
        }
        let l = &self.geometry.layers[il];
        if is_v {
            off += n * l.k_row as usize;
        }
        let len = n * if is_v { l.v_row } else { l.k_row } as usize;
        &self.data[off..off + len]
    }
}

/// Why a value is not the expected one, and whether it was damaged (`Broken::Corrupt`) or left
/// by another writer (`Broken::Rejected`). Never an error to the caller: a counted miss.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Corrupt(pub String, pub Broken);

impl Corrupt {
    /// A damaged value, for `why`.
    pub fn damaged(why: impl Into<String>) -> Corrupt {
        Corrupt(why.into(), Broken::Corrupt)
    }

    /// The trailer's verdict as a reason.
    pub fn of(b: Broken) -> Corrupt {
        match b {
            Broken::Corrupt => Corrupt::damaged("checksum mismatch"),
            Broken::Rejected => Corrupt(
                "not written with this store's secret under this key".into(),
                Broken::Rejected,
            ),
        }
    }
}

/// Verifies `value` as the block `id` and returns its rows: checksum first (a flipped or
/// truncated value fails here), then every header field against what the caller expects
/// (a foreign value: another model, geometry, key, index or tokens).
pub fn decode<'a>(
    value: &'a [u8],
    id: &BlockId<'a>,
    sealer: &Sealer,
) -> Result<BlockRows<'a>, Corrupt> {
    let bad = |why: String| Err(Corrupt::damaged(why));
    let want = encoded_len(id);
    if value.len() < TRAILER + 8 {
        return bad(format!("{} bytes is too short for a block", value.len()));
    }
    let body = sealer.open(id.key, value).map_err(Corrupt::of)?;
    if body[..4] != MAGIC {
        return bad("bad magic".into());
    }
    let version = u32_at(body, 4);
    if version != FORMAT_VERSION {
        return bad(format!(
            "block format version {version}, expected {FORMAT_VERSION}"
        ));
    }
    if value.len() != want {
        return bad(format!("{} bytes, expected {want}", value.len()));
    }
    // as long as the header of the block expected: every field is there
    let Some(h) = head(body) else {
        return bad("a truncated header".into());
    };
    if h.fingerprint != id.fingerprint.0 {
        return bad("another model or geometry (fingerprint mismatch)".into());
    }
    if h.key != *id.key {
        return bad("stored under another key".into());
    }
    if h.index != id.index {
        return bad(format!("block index {}, expected {}", h.index, id.index));
    }
    let n = h.n_tokens;
    if n != id.tokens.len() {
        return bad(format!("{n} tokens, expected {}", id.tokens.len()));
    }
    let same = h.tokens.len() == 4 * n
        && h.tokens
            .chunks_exact(4)
            .zip(id.tokens)
            .all(|(b, t)| b == t.to_le_bytes());
    if !same {
        return bad("tokens differ".into());
    }
    let geo_at = TOKENS_AT + 4 * n;
    match Geometry::decode(&body[geo_at..]) {
        Some((g, _)) if &g == id.geometry => {}
        _ => return bad("geometry differs".into()),
    }
    Ok(BlockRows::new(&body[header_len(id)..], id.geometry, n))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::LayerGeometry;
    use llama_kv_cache::GgmlType;

    fn geometry() -> Geometry {
        Geometry {
            layers: vec![
                LayerGeometry {
                    k_type: GgmlType::F16,
                    k_row: 8,
                    v_type: GgmlType::F16,
                    v_row: 4,
                };
                2
            ],
            ext: llama_kv_cache::CellExt::None,
            no_v: false,
        }
    }

    fn sample(key: &Key, fp: &Key, g: &Geometry, tokens: &[i32]) -> Vec<u8> {
        let id = BlockId {
            fingerprint: fp,
            key,
            index: 3,
            tokens,
            geometry: g,
        };
        let mut out = Vec::new();
        encode_into(
            &id,
            &Sealer::new(None),
            &mut out,
            |out, il, is_v| {
                let row = if is_v { 4 } else { 8 };
                let fill = (il * 2 + is_v as usize) as u8;
                out.extend(std::iter::repeat_n(fill, row * tokens.len()));
                Ok(())
            },
            |out| {
                let exts = tokens.iter().map(|&t| CellExtValue {
                    x: t,
                    y: -t,
                    tok: t,
                });
                crate::geometry::put_exts(out, exts);
                Ok(())
            },
        )
        .unwrap();
        out
    }

    /// The id of a sample block (index 3).
    fn sample_id<'a>(fp: &'a Key, key: &'a Key, tokens: &'a [i32], g: &'a Geometry) -> BlockId<'a> {
        BlockId {
            fingerprint: fp,
            key,
            index: 3,
            tokens,
            geometry: g,
        }
    }

    /// Rows in place, and in an M-RoPE block each token's `x, y, tok` after them, where a
    /// flipped byte is corrupt like any other; with and without extensions are two geometries.
    #[test]
    fn a_block_round_trips_with_its_rows_in_place_and_its_cell_extensions_after_them() {
        let plain = geometry();
        let mrope = Geometry {
            ext: llama_kv_cache::CellExt::Pos2Tok,
            ..geometry()
        };
        let (fp, key) = (Key([1; 32]), Key([2; 32]));
        let tokens = [5, 6, 7];
        for (g, other) in [(&plain, &mrope), (&mrope, &plain)] {
            let v = sample(&key, &fp, g, &tokens);
            let id = sample_id(&fp, &key, &tokens, g);
            assert_eq!(v.len(), encoded_len(&id));
            let rows = decode(&v, &id, &Sealer::new(None)).unwrap();
            assert_eq!(rows.k(0), &[0; 24]);
            assert_eq!(rows.v(0), &[1; 12]);
            assert_eq!(rows.k(1), &[2; 24]);
            assert_eq!(rows.v(1), &[3; 12]);
            for (k, &t) in tokens.iter().enumerate() {
                let want = match g.ext.is_none() {
                    true => CellExtValue::default(),
                    false => CellExtValue {
                        x: t,
                        y: -t,
                        tok: t,
                    },
                };
                assert_eq!(rows.ext(k), want);
            }
            let mut w = v.clone();
            w[v.len() - TRAILER - 1] ^= 1;
            assert!(decode(&w, &id, &Sealer::new(None)).is_err());
            let other = sample_id(&fp, &key, &tokens, other);
            assert!(decode(&v, &other, &Sealer::new(None)).is_err());
        }
    }

    #[test]
    fn every_flipped_byte_and_every_truncation_is_corrupt() {
        let g = geometry();
        let (fp, key) = (Key([1; 32]), Key([2; 32]));
        let tokens = [5, 6];
        let v = sample(&key, &fp, &g, &tokens);
        let id = sample_id(&fp, &key, &tokens, &g);
        for i in 0..v.len() {
            let mut w = v.clone();
            w[i] ^= 0x40;
            assert!(decode(&w, &id, &Sealer::new(None)).is_err(), "flip at {i}");
            assert!(
                decode(&v[..i], &id, &Sealer::new(None)).is_err(),
                "truncated to {i}"
            );
        }
    }

    #[test]
    fn a_value_under_the_wrong_key_or_with_other_tokens_is_foreign() {
        let g = geometry();
        let (fp, key) = (Key([1; 32]), Key([2; 32]));
        let tokens = [5, 6];
        let v = sample(&key, &fp, &g, &tokens);
        let mut id = BlockId {
            fingerprint: &fp,
            key: &Key([9; 32]),
            index: 3,
            tokens: &tokens,
            geometry: &g,
        };
        // the tag covers the key: a value under another key was not written there
        assert_eq!(
            decode(&v, &id, &Sealer::new(None)).unwrap_err().1,
            Broken::Rejected
        );
        id.key = &key;
        id.tokens = &[5, 7];
        assert_eq!(
            decode(&v, &id, &Sealer::new(None)).unwrap_err().0,
            "tokens differ"
        );
        id.tokens = &tokens;
        id.index = 4;
        assert!(decode(&v, &id, &Sealer::new(None)).is_err());
        let other_fp = Key([3; 32]);
        id.index = 3;
        id.fingerprint = &other_fp;
        assert!(decode(&v, &id, &Sealer::new(None)).is_err());
    }
}
