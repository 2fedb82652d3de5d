//! Compact blocks: a tier may keep its blocks smaller than the cache's rows, and hands them back
//! whole. [`Compressed`] wraps one tier's backend: puts encode blocks by the tier's
//! [`Compression`], reads decode every compact value whatever the reader's own setting (so
//! processes sharing a directory or a Redis may choose differently). Other values (model
//! records, checkpoints, indexes) are kept as they are.
//!
//! A compact value keeps the block's header as it is, but for the version field (the block's
//! version with [`COMPACT_FLAG`] set) and a mode byte after it, so a value's key and fingerprint
//! stay where KV events and presence checks read them:
//!
//! ```text
//! header (version | COMPACT_FLAG)  u8 mode
//! lossless: u64 raw length, zstd frame (level 3) of the rows and cell extensions, f16/bf16/f32
//!           rows split into byte planes; then the block's own trailer (checksum and tag)
//! q8_0:     rows, f16/f32 ones as q8_0 (34 bytes per 32 values), then cell extensions; then the
//!           trailer of the block they decode to
//! ```
//!
//! - `lossless` decodes to the block byte for byte: the block's own checksum verifies it.
//! - `q8_0` decodes to the rows dequantized to their type. At the put, the wrapper works out that
//!   lossy block (decoding is deterministic) and seals it with the store's sealer, so a read
//!   only dequantizes: the store's one verification then checks the very bytes it loads, and a
//!   damaged or foreign compact value fails it as any block would (corrupt or rejected). Each
//!   value differs from the cache's by at most half its block's step (`max |x| / 254` over each
//!   32 values) plus the rounding of the result to the row's type (f16: 1/2048 of it).

use std::sync::Arc;

use llama_kv_cache::tensors::quant::{dequantize_row, quantize_row};
use llama_kv_cache::GgmlType;

use crate::backend::{pass_on, Backend, TierHealth, TierMetrics, Usage};
use crate::block::head;
use crate::error::StoreResult;
use crate::events::EventHub;
use crate::geometry::{Geometry, FORMAT_VERSION};
use crate::key::Key;
use crate::seal::{Sealer, TRAILER};

/// How a tier keeps its blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Compression {
    /// As the cache's rows.
    #[default]
    None,
    /// Byte planes and zstd: the same bytes back.
    Lossless,
    /// f16 and f32 rows as q8_0 (1.9x smaller for f16), dequantized on restore.
    Q8_0,
}

impl Compression {
    /// The mode named `name` as the options spell it: `"none"`, `"lossless"` or `"q8_0"`.
    pub fn parse(name: &str) -> Option<Compression> {
        match name {
            "none" => Some(Compression::None),
            "lossless" => Some(Compression::Lossless),
            "q8_0" => Some(Compression::Q8_0),
            _ => None,
        }
    }

    fn byte(self) -> u8 {
        match self {
            Compression::None => 0,
            Compression::Lossless => 1,
            Compression::Q8_0 => 2,
        }
    }
}

/// Set in a compact value's version field.
pub const COMPACT_FLAG: u32 = 1 << 31;

/// The most a lossless value may grow when decoded: a damaged header that claims more is not
/// allocated for (K/V planes shrink a few times, not thousands).
const MAX_EXPANSION: usize = 4096;

/// zstd's level for lossless blocks: its default. On K/V node-llama-cpp computed, byte planes
/// came out 1.19x smaller at level 1, 1.21x at 3 and 1.13x at 9 (its longer matches do not pay
/// on mantissa noise); channel-major orders, XOR with the previous token and sign/exponent
/// splits all did worse than plain planes.
const ZSTD_LEVEL: i32 = 3;

/// Where a block's parts lie.
struct Layout {
    /// The header's version field (flagged in a compact value).
    version: u32,
    /// The header's length: the rows start here.
    rows_at: usize,
    n_tokens: usize,
    geometry: Geometry,
    /// Bytes of all rows (checked: no part's size overflows).
    rows_len: usize,
}

impl Layout {
    /// The layout of the block (or compact value) `value`, from its header; `None` for values
    /// of another kind or a malformed header.
    fn of(value: &[u8]) -> Option<Layout> {
        let h = head(value)?;
        let n_tokens = h.n_tokens;
        let geo_at = h.geometry_at()?;
        let (geometry, geo_len) = Geometry::decode(value.get(geo_at..)?)?;
        let mut rows_len = 0usize;
        for l in &geometry.layers {
            for row in [l.k_row, l.v_row] {
                let part = usize::try_from(row).ok()?.checked_mul(n_tokens)?;
                rows_len = rows_len.checked_add(part)?;
            }
        }
        rows_len.checked_add(n_tokens.checked_mul(geometry.ext_bytes())?)?;
        Some(Layout {
            version: h.version,
            rows_at: geo_at + geo_len,
            n_tokens,
            geometry,
            rows_len,
        })
    }

    /// Each layer's K then V rows as (type, bytes of all its rows) in block order.
    fn parts(&self) -> impl Iterator<Item = (GgmlType, usize)> + '_ {
        self.geometry.layers.iter().flat_map(move |l| {
            [(l.k_type, l.k_row), (l.v_type, l.v_row)]
                .map(|(ty, row)| (ty, row as usize * self.n_tokens))
        })
    }

    fn tail_len(&self) -> usize {
        self.n_tokens * self.geometry.ext_bytes()
    }

    /// The length of this block's q8_0 compact value.
    fn compact_q8_len(&self) -> Option<usize> {
        let mut len = self.rows_at + 1 + self.tail_len() + TRAILER;
        for (ty, bytes) in self.parts() {
            len = len.checked_add(match self.q8_row(ty, bytes) {
                Some((_, elems)) => elems / 32 * 34 * self.n_tokens,
                None => bytes,
            })?;
        }
        Some(len)
    }

    /// The width of the values a part's rows hold, for byte planes (1: none).
    fn width(ty: GgmlType) -> usize {
        match ty {
            GgmlType::F16 | GgmlType::Bf16 => 2,
            GgmlType::F32 => 4,
            _ => 1,
        }
    }

    /// The row length of a part (bytes), and whether its rows go to q8_0.
    fn q8_row(&self, ty: GgmlType, bytes: usize) -> Option<(usize, usize)> {
        let width = match ty {
            GgmlType::F16 => 2,
            GgmlType::F32 => 4,
            _ => return None,
        };
        let row = bytes.checked_div(self.n_tokens)?;
        let elems = row / width;
        (elems > 0 && elems % 32 == 0).then_some((row, elems))
    }
}

/// Appends `src` split into `width` byte planes: all first bytes, then all second bytes, ...
fn split_planes(src: &[u8], width: usize, out: &mut Vec<u8>) {
    if width == 1 {
        return out.extend_from_slice(src);
    }
    for p in 0..width {
        out.extend(src.chunks_exact(width).map(|v| v[p]));
    }
}

/// The inverse of [`split_planes`].
fn join_planes(src: &[u8], width: usize, out: &mut Vec<u8>) {
    if width == 1 {
        return out.extend_from_slice(src);
    }
    let n = src.len() / width;
    let start = out.len();
    out.resize(start + src.len(), 0);
    for (p, plane) in src.chunks_exact(n).enumerate() {
        for (i, &b) in plane.iter().enumerate() {
            out[start + i * width + p] = b;
        }
    }
}

/// The header of `value` with its version field set to `version`, and the mode byte.
fn header(value: &[u8], at: usize, version: u32, mode: Option<Compression>) -> Vec<u8> {
    let mut out = Vec::with_capacity(value.len());
    out.extend_from_slice(&value[..at]);
    out[4..8].copy_from_slice(&version.to_le_bytes());
    out.extend(mode.map(Compression::byte));
    out
}

/// `value` as `mode` keeps it under `key`: `None` when it stays as it is (another kind of
/// value, a block of rows `mode` cannot shrink, or `Compression::None`).
pub fn encode(mode: Compression, key: &Key, value: &[u8], sealer: &Sealer) -> Option<Vec<u8>> {
    if mode == Compression::None {
        return None;
    }
    let l = Layout::of(value).filter(|l| l.version == FORMAT_VERSION)?;
    let rows_end = l.rows_at + l.rows_len;
    if value.len() != rows_end + l.tail_len() + TRAILER {
        return None;
    }
    let mut out = header(value, l.rows_at, FORMAT_VERSION | COMPACT_FLAG, Some(mode));
    let mut at = l.rows_at;
    match mode {
        Compression::None => unreachable!("returned above"),
        Compression::Lossless => {
            let mut planes = Vec::with_capacity(value.len());
            for (ty, bytes) in l.parts() {
                split_planes(&value[at..at + bytes], Layout::width(ty), &mut planes);
                at += bytes;
            }
            planes.extend_from_slice(&value[rows_end..value.len() - TRAILER]);
            let packed = zstd::bulk::compress(&planes, ZSTD_LEVEL).ok()?;
            out.extend_from_slice(&(planes.len() as u64).to_le_bytes());
            out.extend_from_slice(&packed);
            out.extend_from_slice(&value[value.len() - TRAILER..]);
        }
        Compression::Q8_0 => {
            // the block a read will give back is hashed as it is made, for its trailer
            let mut lossy = blake3::Hasher::new();
            lossy.update(&header(value, l.rows_at, FORMAT_VERSION, None));
            let mut shrunk = false;
            let (mut f, mut back) = (Vec::new(), Vec::new());
            for (ty, bytes) in l.parts() {
                let src = &value[at..at + bytes];
                at += bytes;
                let Some((row, elems)) = l.q8_row(ty, bytes) else {
                    out.extend_from_slice(src);
                    lossy.update(src);
                    continue;
                };
                shrunk = true;
                f.resize(elems, 0.0);
                back.resize(row, 0);
                let q_row = elems / 32 * 34;
                for r in src.chunks_exact(row) {
                    dequantize_row(ty, r, &mut f).ok()?;
                    let start = out.len();
                    out.resize(start + q_row, 0);
                    quantize_row(GgmlType::Q8_0, &f, &mut out[start..]).ok()?;
                    dequantize_row(GgmlType::Q8_0, &out[start..], &mut f).ok()?;
                    quantize_row(ty, &f, &mut back).ok()?;
                    lossy.update(&back);
                }
            }
            if !shrunk {
                return None;
            }
            let ext = &value[rows_end..value.len() - TRAILER];
            out.extend_from_slice(ext);
            lossy.update(ext);
            out.extend_from_slice(&sealer.trailer(key, lossy.finalize().as_bytes()));
        }
    }
    Some(out)
}

/// The block a compact `value` holds; a value that is not compact is handed back as it is, and
/// so is one that does not decode (the store's verification then refuses it). A decoded block
/// is written into `buf` (its old contents replaced), which a reader of many values reuses.
pub fn decode<'a>(value: &'a [u8], buf: &'a mut Vec<u8>) -> &'a [u8] {
    if is_compact(value) && decode_into(value, buf).is_some() {
        return buf;
    }
    value
}

/// Whether `value` is a compact block.
fn is_compact(value: &[u8]) -> bool {
    head(value).is_some_and(|h| h.version == FORMAT_VERSION | COMPACT_FLAG)
}

fn decode_into(value: &[u8], out: &mut Vec<u8>) -> Option<()> {
    let l = Layout::of(value)?;
    let rows_len = l.rows_len;
    let mode = *value.get(l.rows_at)?;
    let trailer_at = value.len().checked_sub(TRAILER)?;
    let total = (l.rows_at + TRAILER).checked_add(rows_len + l.tail_len())?;
    // sizes come from the value's header: checked against its length before anything is
    // allocated, and allocated fallibly
    let fits = match mode {
        m if m == Compression::Q8_0.byte() => l.compact_q8_len() == Some(value.len()),
        _ => total <= value.len().saturating_mul(MAX_EXPANSION),
    };
    if !fits {
        return None;
    }
    out.clear();
    out.try_reserve_exact(total).ok()?;
    out.extend_from_slice(&value[..l.rows_at]);
    out[4..8].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    let body_at = l.rows_at + 1;
    if mode == Compression::Lossless.byte() {
        let raw = u64::from_le_bytes(value.get(body_at..body_at + 8)?.try_into().ok()?) as usize;
        if raw != rows_len + l.tail_len() {
            return None;
        }
        let mut planes = Vec::new();
        planes.try_reserve_exact(raw).ok()?;
        zstd::bulk::Decompressor::new()
            .ok()?
            .decompress_to_buffer(value.get(body_at + 8..trailer_at)?, &mut planes)
            .ok()?;
        if planes.len() != raw {
            return None;
        }
        let mut at = 0;
        for (ty, bytes) in l.parts() {
            join_planes(&planes[at..at + bytes], Layout::width(ty), out);
            at += bytes;
        }
        out.extend_from_slice(&planes[at..]);
    } else if mode == Compression::Q8_0.byte() {
        let body = value.get(..trailer_at)?;
        let mut at = body_at;
        let mut f = Vec::new();
        for (ty, bytes) in l.parts() {
            let Some((row, elems)) = l.q8_row(ty, bytes) else {
                out.extend_from_slice(body.get(at..at + bytes)?);
                at += bytes;
                continue;
            };
            let q_row = elems / 32 * 34;
            let src = body.get(at..at + q_row * l.n_tokens)?;
            at += q_row * l.n_tokens;
            f.resize(elems, 0.0);
            for q in src.chunks_exact(q_row) {
                dequantize_row(GgmlType::Q8_0, q, &mut f).ok()?;
                let start = out.len();
                out.resize(start + row, 0);
                quantize_row(ty, &f, &mut out[start..]).ok()?;
            }
        }
        if body.len().checked_sub(at)? != l.tail_len() {
            return None;
        }
        out.extend_from_slice(&body[at..]);
    } else {
        return None;
    }
    out.extend_from_slice(&value[trailer_at..]);
    Some(())
}

/// One tier whose blocks are kept as `mode` says (see the module docs). Every call but the
/// puts and reads goes to the tier as it is.
pub struct Compressed {
    inner: Arc<dyn Backend>,
    mode: Compression,
    sealer: Sealer,
}

impl Compressed {
    /// `inner` keeping its blocks as `mode` says; `sealer` is the store's (its secret, if any):
    /// the lossy blocks q8_0 values decode to are sealed with it.
    pub fn new(inner: Arc<dyn Backend>, mode: Compression, sealer: Sealer) -> Compressed {
        Compressed {
            inner,
            mode,
            sealer,
        }
    }
}

impl Backend for Compressed {
    // a compact value ends with a trailer of ours too (the block's), so presence checks pass
    // on as they are
    pass_on!(
        name,
        presence,
        put_if_absent,
        remove,
        usage,
        health,
        tier_metrics,
        observe,
        gc
    );

    fn get_many(&self, keys: &[Key]) -> StoreResult<Vec<Option<Vec<u8>>>> {
        let mut values = self.inner.get_many(keys)?;
        let mut buf = Vec::new();
        for v in values.iter_mut().flatten() {
            if is_compact(v) && decode_into(v, &mut buf).is_some() {
                std::mem::swap(v, &mut buf);
            }
        }
        Ok(values)
    }

    /// Decodes each value into one reused buffer as the reader visits it.
    fn visit_many(
        &self,
        keys: &[Key],
        visit: &mut dyn FnMut(usize, Option<&[u8]>) -> bool,
    ) -> StoreResult<()> {
        let mut buf = Vec::new();
        self.inner.visit_many(keys, &mut |i, value| match value {
            Some(v) => visit(i, Some(decode(v, &mut buf))),
            None => visit(i, None),
        })
    }

    fn put_many(&self, entries: &[(Key, &[u8])]) -> StoreResult<Vec<bool>> {
        let compact: Vec<Option<Vec<u8>>> = entries
            .iter()
            .map(|(k, v)| encode(self.mode, k, v, &self.sealer))
            .collect();
        let kept: Vec<(Key, &[u8])> = entries
            .iter()
            .zip(&compact)
            .map(|((k, v), c)| (*k, c.as_deref().unwrap_or(v)))
            .collect();
        self.inner.put_many(&kept)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::{self, BlockId};
    use crate::geometry::LayerGeometry;
    use crate::seal::Broken;
    use llama_kv_cache::{CellExt, CellExtValue};

    const TOKENS: [i32; 16] = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3];

    /// f16 K (64 values), f32 V (32 values), a q8_0 layer left alone, and M-RoPE extensions.
    fn geometry() -> Geometry {
        let layer = |k_type: GgmlType, k_row, v_type: GgmlType, v_row| LayerGeometry {
            k_type,
            k_row,
            v_type,
            v_row,
        };
        Geometry {
            layers: vec![
                layer(GgmlType::F16, 128, GgmlType::F32, 128),
                layer(GgmlType::Q8_0, 68, GgmlType::F16, 64),
            ],
            ext: CellExt::Pos2Tok,
            no_v: false,
        }
    }

    /// Activations-like values: smooth in the token, varied in the channel.
    fn value(t: usize, c: usize, il: usize) -> f32 {
        ((t as f32 * 0.37 + c as f32 * 1.3 + il as f32).sin() * (1.0 + c as f32 / 7.0)) * 0.25
    }

    fn block(sealer: &Sealer) -> (Vec<u8>, Geometry) {
        let g = geometry();
        let (fp, key) = (Key([7; 32]), Key([9; 32]));
        let id = BlockId {
            fingerprint: &fp,
            key: &key,
            index: 2,
            tokens: &TOKENS,
            geometry: &g,
        };
        let mut out = Vec::new();
        block::encode_into(
            &id,
            sealer,
            &mut out,
            |out, il, is_v| {
                let l = &g.layers[il];
                let (ty, row) = if is_v {
                    (l.v_type, l.v_row)
                } else {
                    (l.k_type, l.k_row)
                };
                let elems = row as usize * ty.block_size() / ty.type_size();
                for t in 0..TOKENS.len() {
                    let f: Vec<f32> = (0..elems)
                        .map(|c| value(t, c, il * 2 + is_v as usize))
                        .collect();
                    let start = out.len();
                    out.resize(start + row as usize, 0);
                    quantize_row(ty, &f, &mut out[start..]).unwrap();
                }
                Ok(())
            },
            |out| {
                let exts = TOKENS.iter().map(|&t| CellExtValue {
                    x: t,
                    y: 2 * t,
                    tok: -t,
                });
                crate::geometry::put_exts(out, exts);
                Ok(())
            },
        )
        .unwrap();
        (out, g)
    }

    fn verify<'a>(
        v: &'a [u8],
        g: &'a Geometry,
        sealer: &Sealer,
    ) -> Result<block::BlockRows<'a>, block::Corrupt> {
        let (fp, key) = (&Key([7; 32]), &Key([9; 32]));
        let id = BlockId {
            fingerprint: fp,
            key,
            index: 2,
            tokens: &TOKENS,
            geometry: g,
        };
        block::decode(v, &id, sealer)
    }

    #[test]
    fn lossless_gives_the_block_back_byte_for_byte_and_smaller() {
        let sealer = Sealer::new(None);
        let (b, _) = block(&sealer);
        let key = Key([9; 32]);
        let c = encode(Compression::Lossless, &key, &b, &sealer).unwrap();
        assert!(c.len() < b.len(), "{} of {}", c.len(), b.len());
        // the key, fingerprint and trailer stay where events and presence checks read them
        assert_eq!(c[..4], b[..4]);
        assert_eq!(c[8..72], b[8..72]);
        assert_eq!(c[c.len() - TRAILER..], b[b.len() - TRAILER..]);
        assert_eq!(decode(&c, &mut Vec::new()), b);
        // values that are not blocks, and plain blocks, pass through
        assert_eq!(decode(&b, &mut Vec::new()), b);
        assert!(encode(Compression::Lossless, &key, b"KVPM record", &sealer).is_none());
        assert!(encode(Compression::None, &key, &b, &sealer).is_none());
    }

    #[test]
    fn q8_0_restores_each_value_within_half_a_step_and_verifies() {
        for secret in [None, Some(&b"0123456789abcdef"[..])] {
            let sealer = Sealer::new(secret);
            let (b, g) = block(&sealer);
            let key = Key([9; 32]);
            let c = encode(Compression::Q8_0, &key, &b, &sealer).unwrap();
            assert!(c.len() * 10 < b.len() * 7, "{} of {}", c.len(), b.len());
            let back = decode(&c, &mut Vec::new()).to_vec();
            let (orig, got) = (
                verify(&b, &g, &sealer).unwrap(),
                verify(&back, &g, &sealer).unwrap(),
            );
            for il in 0..2 {
                for is_v in [false, true] {
                    let l = &g.layers[il];
                    let ty = if is_v { l.v_type } else { l.k_type };
                    let (a, z) = if is_v {
                        (orig.v(il), got.v(il))
                    } else {
                        (orig.k(il), got.k(il))
                    };
                    if ty == GgmlType::Q8_0 {
                        assert_eq!(a, z, "a quantized layer is kept as it is");
                        continue;
                    }
                    let n = a.len() / ty.type_size();
                    let (mut fa, mut fz) = (vec![0.0; n], vec![0.0; n]);
                    dequantize_row(ty, a, &mut fa).unwrap();
                    dequantize_row(ty, z, &mut fz).unwrap();
                    for (x, y) in fa.chunks(32).zip(fz.chunks(32)) {
                        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
                        for (u, w) in x.iter().zip(y) {
                            // half a q8_0 step, and the f16 rounding of the result
                            assert!(
                                (u - w).abs() <= amax / 254.0 * 1.0001 + w.abs() / 1024.0,
                                "{u} {w}"
                            );
                        }
                    }
                    assert_ne!(a, z, "layer {il} v {is_v} was quantized");
                }
                assert_eq!(
                    (0..16).map(|k| got.ext(k)).collect::<Vec<_>>(),
                    (0..16).map(|k| orig.ext(k)).collect::<Vec<_>>()
                );
            }
        }
    }

    /// Every flipped byte of a compact value decodes to nothing a store accepts, and a value of
    /// a writer with another secret is rejected.
    #[test]
    fn a_damaged_or_foreign_compact_value_never_verifies() {
        let ours = Sealer::new(Some(b"0123456789abcdef"));
        let (b, g) = block(&ours);
        let key = Key([9; 32]);
        for mode in [Compression::Lossless, Compression::Q8_0] {
            let c = encode(mode, &key, &b, &ours).unwrap();
            for i in (0..c.len()).step_by(7) {
                let mut d = c.clone();
                d[i] ^= 0x10;
                let mut buf = Vec::new();
                let back = decode(&d, &mut buf);
                assert!(verify(back, &g, &ours).is_err(), "{mode:?} flip at {i}");
            }
            let theirs = Sealer::new(Some(b"fedcba9876543210"));
            let (tb, _) = block(&theirs);
            let tc = encode(mode, &key, &tb, &theirs).unwrap();
            let mut buf = Vec::new();
            let back = decode(&tc, &mut buf);
            assert_eq!(
                verify(back, &g, &ours).unwrap_err().1,
                Broken::Rejected,
                "{mode:?}"
            );
        }
    }

    #[test]
    fn byte_planes_round_trip() {
        let src: Vec<u8> = (0..64u8).collect();
        for width in [1, 2, 4] {
            let (mut planes, mut back) = (Vec::new(), Vec::new());
            split_planes(&src, width, &mut planes);
            join_planes(&planes, width, &mut back);
            assert_eq!(back, src);
        }
        let mut planes = Vec::new();
        split_planes(&[1, 2, 3, 4], 2, &mut planes);
        assert_eq!(planes, [1, 3, 2, 4]);
    }
}
