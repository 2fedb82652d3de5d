//! What shapes a block's bytes (layer count, per-layer K/V types and row sizes), the
//! chain keys rooted in a [fingerprint](crate::Shape::fingerprint), and the keys derived from
//! them (sliding-window rows, checkpoints and their index).

use llama_kv_cache::{CellExt, CellExtValue, GgmlType, SeedCache, Tensor};

use sha2::{Digest, Sha256};

use crate::error::StoreResult;
use crate::key::Key;

/// Version of the block format and of the key derivation. Part of every fingerprint, so a
/// format change starts a fresh chain instead of misreading old blocks.
pub const FORMAT_VERSION: u32 = 2;

/// One layer's K and V as stored in a block (V always as rows: untransposed): the core
/// codec's [`LayerShape`].
pub use llama_kv_cache::state::LayerShape as LayerGeometry;

/// The per-layer shapes of a cache: everything besides the tokens that changes a block's bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// One entry per layer.
    pub layers: Vec<LayerGeometry>,
    /// The extension every cell carries (M-RoPE / PLE models): a block keeps each token's
    /// `x, y, tok` after its rows, so that a restore gives an image's tokens their 2D positions.
    pub ext: CellExt,
    /// The part keeps no V (multi-head latent attention): its V rows are of no bytes (each
    /// layer's V type is its K type) and its payloads have no V blocks.
    pub no_v: bool,
}

/// Bytes a block keeps per token for a cell extension: `x, y, tok` as i32 LE, whatever the kind
/// (the kind, in the geometry, says which of them a file carries).
pub const EXT_BYTES: usize = 12;

/// Flag on the encoded layer count: a cell extension id follows the layers. Geometries without
/// one encode as they always did, so their fingerprints and blocks stay valid.
const HAS_EXT: u32 = 1 << 31;

/// Flag on the encoded layer count: the part keeps no V (see [`Geometry::no_v`]).
const NO_V: u32 = 1 << 30;

/// The id of a cell extension in an encoded geometry.
fn ext_id(ext: CellExt) -> u32 {
    match ext {
        CellExt::None => 0,
        CellExt::Pos2 => 1,
        CellExt::Pos2Tok => 2,
    }
}

/// Appends `x, y, tok` of each extension (LE), as blocks keep them.
pub fn put_exts(out: &mut Vec<u8>, exts: impl Iterator<Item = CellExtValue>) {
    for e in exts {
        for v in [e.x, e.y, e.tok] {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
}

/// The extension at `bytes[12k..]` of what [`put_exts`] wrote.
pub fn ext_at(bytes: &[u8], k: usize) -> CellExtValue {
    let at = |i: usize| {
        let o = EXT_BYTES * k + 4 * i;
        i32::from_le_bytes(bytes[o..o + 4].try_into().expect("4 bytes"))
    };
    CellExtValue {
        x: at(0),
        y: at(1),
        tok: at(2),
    }
}

impl Geometry {
    /// The per-layer shapes of a cache.
    pub fn of_cache(cache: &SeedCache) -> StoreResult<Geometry> {
        let no_v = cache.params().no_v;
        let layers = (0..cache.n_layer())
            .map(|il| {
                Ok(LayerGeometry {
                    k_type: cache.type_k(),
                    k_row: cache.row_size(il, Tensor::K)? as u64,
                    // without V, the K type stands in (as a payload's layer shapes give it)
                    v_type: if no_v { cache.type_k() } else { cache.type_v() },
                    v_row: cache.row_size(il, Tensor::V)? as u64,
                })
            })
            .collect::<StoreResult<_>>()?;
        Ok(Geometry {
            layers,
            ext: cache.params().cell_ext,
            no_v,
        })
    }

    /// Bytes of K and V of one token over all layers.
    pub fn bytes_per_token(&self) -> u64 {
        self.layers.iter().map(|l| l.k_row + l.v_row).sum()
    }

    /// Bytes a block or checkpoint keeps per token: the rows, then the cell extension if any.
    pub fn stored_bytes_per_token(&self) -> u64 {
        self.bytes_per_token() + self.ext_bytes() as u64
    }

    /// Bytes kept per token for the cell extension (0 without one).
    pub fn ext_bytes(&self) -> usize {
        if self.ext.is_none() {
            0
        } else {
            EXT_BYTES
        }
    }

    /// Canonical bytes: `u32 n_layer` (bit 31 set when a cell extension follows, bit 30 when
    /// the part keeps no V), then per
    /// layer `i32 k_type, u64 k_row, i32 v_type, u64 v_row`, then `u32` the extension's id
    /// (1 x, y; 2 x, y, tok) if any (little-endian). Used in fingerprints, block headers and
    /// model records.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let flag = if self.ext.is_none() { 0 } else { HAS_EXT } | if self.no_v { NO_V } else { 0 };
        out.extend_from_slice(&(self.layers.len() as u32 | flag).to_le_bytes());
        for l in &self.layers {
            out.extend_from_slice(&l.k_type.id().to_le_bytes());
            out.extend_from_slice(&l.k_row.to_le_bytes());
            out.extend_from_slice(&l.v_type.id().to_le_bytes());
            out.extend_from_slice(&l.v_row.to_le_bytes());
        }
        if !self.ext.is_none() {
            out.extend_from_slice(&ext_id(self.ext).to_le_bytes());
        }
    }

    /// Reads what [`Geometry::encode`] wrote at the start of `bytes`; returns it and the bytes
    /// consumed, or `None` when malformed.
    pub fn decode(bytes: &[u8]) -> Option<(Geometry, usize)> {
        let word = u32::from_le_bytes(bytes.get(..4)?.try_into().ok()?);
        // 0 layers: a part of no layer (a hybrid-iSWA memory's base cache when every attention
        // layer uses the window), whose blocks keep the tokens only
        let no_v = word & NO_V != 0;
        let n = (word & !(HAS_EXT | NO_V)) as usize;
        if n > 4096 {
            return None;
        }
        let len = 4 + n * 24;
        let body = bytes.get(4..len)?;
        let layers = body
            .chunks_exact(24)
            .map(|c| {
                Some(LayerGeometry {
                    k_type: GgmlType::from_id(i32::from_le_bytes(c[0..4].try_into().ok()?))?,
                    k_row: u64::from_le_bytes(c[4..12].try_into().ok()?),
                    v_type: GgmlType::from_id(i32::from_le_bytes(c[12..16].try_into().ok()?))?,
                    v_row: u64::from_le_bytes(c[16..24].try_into().ok()?),
                })
            })
            .collect::<Option<Vec<_>>>()?;
        if word & HAS_EXT == 0 {
            return Some((
                Geometry {
                    layers,
                    ext: CellExt::None,
                    no_v,
                },
                len,
            ));
        }
        let id = u32::from_le_bytes(bytes.get(len..len + 4)?.try_into().ok()?);
        let ext = [CellExt::Pos2, CellExt::Pos2Tok]
            .into_iter()
            .find(|&e| ext_id(e) == id)?;
        Some((Geometry { layers, ext, no_v }, len + 4))
    }

    /// A one-line description for messages.
    pub fn describe(&self) -> String {
        let first = self.layers.first();
        format!(
            "{} layers, K {} / V {}, {} bytes per token",
            self.layers.len(),
            first.map_or("?".into(), |l| l.k_type.to_string()),
            first.map_or("?".into(), |l| l.v_type.to_string()),
            self.bytes_per_token()
        )
    }
}

/// The chain keys of the full blocks of `tokens`: `key_i = SHA-256(key_{i-1} || tokens of
/// block i as i32 LE)`, `key_{-1} = fingerprint`. A trailing partial block has no key.
///
/// SHA-256 rather than BLAKE3 here: a chain step hashes one block's tokens (1 KiB at 256
/// tokens), too little for BLAKE3's SIMD across chunks, while the SHA extensions of current x86
/// and ARM CPUs (used by `sha2` when present) hash it about twice as fast (1.9 vs 0.8 GB/s
/// measured on the CI machine). Both are cryptographic.
pub fn chain_keys(fingerprint: &Key, tokens: &[i32], block_tokens: usize) -> Vec<Key> {
    let mut keys = Vec::with_capacity(tokens.len() / block_tokens.max(1));
    let mut prev = *fingerprint;
    let mut buf = Vec::with_capacity(4 * block_tokens);
    for block in tokens.chunks_exact(block_tokens.max(1)) {
        buf.clear();
        for t in block {
            buf.extend_from_slice(&t.to_le_bytes());
        }
        let mut h = Sha256::new();
        h.update(prev.0);
        h.update(&buf);
        prev = Key(h.finalize().into());
        keys.push(prev);
    }
    keys
}

/// The chain key a restore point at `i` full blocks extends: the fingerprint for `i == 0`,
/// else the key of block `i - 1`.
pub fn chain_at(fingerprint: &Key, keys: &[Key], i: usize) -> Key {
    if i == 0 {
        *fingerprint
    } else {
        keys[i - 1]
    }
}

fn derived(domain: &[u8], base: &Key, tokens: &[i32]) -> Key {
    let mut h = Sha256::new();
    h.update(domain);
    h.update(base.0);
    h.update((tokens.len() as u32).to_le_bytes());
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    Key(h.finalize().into())
}

/// The key of the sliding-window rows of the block whose chain key is `key` (iSWA states that
/// held the whole range).
pub fn swa_key(key: &Key) -> Key {
    derived(b"llama-kv-cache prompt-store swa rows\0", key, &[])
}

/// The key of the checkpoint at the prefix that extends chain key `at` by `tail` tokens: the
/// exact token prefix it ends, as every chain key.
pub fn checkpoint_key(at: &Key, tail: &[i32]) -> Key {
    derived(b"llama-kv-cache prompt-store checkpoint\0", at, tail)
}

/// The key of the list of checkpoint offsets after chain key `at`.
pub fn index_key(at: &Key) -> Key {
    derived(b"llama-kv-cache prompt-store checkpoint index\0", at, &[])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geo(k: GgmlType, rows: u64) -> Geometry {
        Geometry {
            layers: vec![
                LayerGeometry {
                    k_type: k,
                    k_row: rows,
                    v_type: GgmlType::F16,
                    v_row: 64,
                };
                2
            ],
            ext: CellExt::None,
            no_v: false,
        }
    }

    const FP: Key = Key([7; 32]);

    #[test]
    fn chain_keys_of_a_shared_prefix_are_shared_and_diverge_after_it() {
        let fp = FP;
        let a: Vec<i32> = (0..64).collect();
        let mut b = a.clone();
        b[40] = -5;
        let (ka, kb) = (chain_keys(&fp, &a, 16), chain_keys(&fp, &b, 16));
        assert_eq!(ka.len(), 4);
        assert_eq!(ka[..2], kb[..2]);
        // block 2 differs, and so does every later block even though its tokens are equal
        assert_ne!(ka[2], kb[2]);
        assert_ne!(ka[3], kb[3]);
    }

    #[test]
    fn a_partial_block_has_no_key() {
        let fp = FP;
        assert_eq!(chain_keys(&fp, &[1; 31], 16).len(), 1);
        assert!(chain_keys(&fp, &[1; 15], 16).is_empty());
    }

    #[test]
    fn checkpoint_keys_cover_the_tail_and_its_length() {
        let a = checkpoint_key(&FP, &[1, 2]);
        assert_ne!(a, checkpoint_key(&FP, &[1, 2, 0]));
        assert_ne!(a, checkpoint_key(&FP, &[1, 3]));
        assert_ne!(checkpoint_key(&FP, &[]), index_key(&FP));
        assert_ne!(swa_key(&FP), index_key(&FP));
    }

    #[test]
    fn geometry_encoding_round_trips_and_rejects_garbage() {
        let g = geo(GgmlType::Q8_0, 68);
        let mut bytes = Vec::new();
        g.encode(&mut bytes);
        assert_eq!(Geometry::decode(&bytes), Some((g, bytes.len())));
        assert_eq!(Geometry::decode(&bytes[..bytes.len() - 1]), None);
        assert_eq!(Geometry::decode(&[0x01, 0x10, 0, 0]), None, "4097 layers");
        // a part of no layer (LFM2's base cache) and a part without V encode and decode
        let none = Geometry {
            layers: Vec::new(),
            ..geo(GgmlType::F16, 64)
        };
        let no_v = Geometry {
            no_v: true,
            ..geo(GgmlType::F16, 64)
        };
        for g in [none, no_v] {
            let mut bytes = Vec::new();
            g.encode(&mut bytes);
            assert_eq!(Geometry::decode(&bytes), Some((g, bytes.len())));
        }
    }

    /// A geometry without a cell extension encodes as before extensions existed (the stores'
    /// fingerprints and blocks stay valid); one with an extension encodes it and differs.
    #[test]
    fn a_cell_extension_is_part_of_the_geometry() {
        let plain = geo(GgmlType::F16, 64);
        let mut bytes = Vec::new();
        plain.encode(&mut bytes);
        assert_eq!(bytes.len(), 4 + 2 * 24);
        assert_eq!(bytes[..4], 2u32.to_le_bytes());
        for ext in [CellExt::Pos2, CellExt::Pos2Tok] {
            let g = Geometry {
                ext,
                ..plain.clone()
            };
            let mut with = Vec::new();
            g.encode(&mut with);
            assert_eq!(with.len(), bytes.len() + 4);
            assert_ne!(with[..4], bytes[..4]);
            assert_eq!(Geometry::decode(&with), Some((g.clone(), with.len())));
            assert_eq!(g.stored_bytes_per_token(), plain.bytes_per_token() + 12);
        }
        let mut bad = bytes.clone();
        bad[3] |= 0x80;
        bad.extend_from_slice(&9u32.to_le_bytes());
        assert_eq!(Geometry::decode(&bad), None, "an unknown extension id");
    }

    #[test]
    fn extensions_round_trip_as_blocks_keep_them() {
        let exts = [
            CellExtValue {
                x: 3,
                y: 4,
                tok: -1,
            },
            CellExtValue {
                x: -7,
                y: 9,
                tok: 42,
            },
        ];
        let mut bytes = Vec::new();
        put_exts(&mut bytes, exts.into_iter());
        assert_eq!(bytes.len(), 2 * EXT_BYTES);
        assert_eq!([ext_at(&bytes, 0), ext_at(&bytes, 1)], exts);
    }

    #[test]
    fn key_hex_round_trips() {
        let k = checkpoint_key(&FP, &[1]);
        assert_eq!(Key::from_hex(&k.hex()), Some(k));
        assert_eq!(Key::from_hex("zz"), None);
    }
}
