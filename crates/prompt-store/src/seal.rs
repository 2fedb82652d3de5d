//! The trailer of every value the store writes (blocks, checkpoints, index values, the model
//! record):
//!
//! ```text
//! body  [32] BLAKE3(body)  [32] tag = keyed BLAKE3(mac_key, key || BLAKE3(body))
//! ```
//!
//! The checksum catches a value damaged in storage (a flipped byte, a torn write). The tag says
//! who wrote it: `mac_key` is derived from the store's `secret`, or from nothing when it has
//! none, so a value written without the reader's secret (or with another one) fails its tag
//! and is rejected, never loaded. The tag covers the value's own key, so a value copied to
//! another key is rejected too. Since the tag needs only the key and the checksum, a put can
//! check a present value's last 64 bytes and replace one that another writer left, instead of
//! skipping it (so nobody without the secret can pin a prefix to their rows).
//!
//! Keyed BLAKE3 (crate `blake3`, already the checksum) is a MAC by design, as HMAC-SHA-256 is;
//! one crate and one pass over the body serve both.

use crate::key::Key;

/// Bytes of the trailer.
pub const TRAILER: usize = 64;

/// Why a value does not open.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Broken {
    /// The body does not match its checksum (damaged, truncated): a corrupt value.
    Corrupt,
    /// The checksum holds but the tag does not: written by another writer (no secret, another
    /// secret, or copied from another key).
    Rejected,
}

/// Seals and opens values with one store's MAC key.
#[derive(Clone)]
pub struct Sealer {
    mac_key: [u8; 32],
    authenticated: bool,
}

impl Sealer {
    /// A sealer for `secret` (none: the key everyone can derive, which authenticates nothing
    /// but keeps one value format).
    pub fn new(secret: Option<&[u8]>) -> Sealer {
        Sealer {
            mac_key: blake3::derive_key(
                "llama-kv-cache prompt-store 2026-12 value tag",
                secret.unwrap_or(b""),
            ),
            authenticated: secret.is_some(),
        }
    }

    /// Whether the store has a secret (then presence alone never counts: tags are checked).
    pub fn authenticated(&self) -> bool {
        self.authenticated
    }

    fn tag(&self, key: &Key, sum: &[u8; 32]) -> [u8; 32] {
        let mut h = blake3::Hasher::new_keyed(&self.mac_key);
        h.update(&key.0);
        h.update(sum);
        *h.finalize().as_bytes()
    }

    /// Appends the trailer of `value` stored under `key`.
    pub fn seal(&self, key: &Key, value: &mut Vec<u8>) {
        let trailer = self.trailer(key, blake3::hash(value).as_bytes());
        value.extend_from_slice(&trailer);
    }

    /// The trailer [`Sealer::seal`] appends to a value under `key` whose BLAKE3 is `sum`: for
    /// writers that hash a value they never hold whole.
    pub fn trailer(&self, key: &Key, sum: &[u8; 32]) -> [u8; TRAILER] {
        let mut out = [0u8; TRAILER];
        out[..32].copy_from_slice(sum);
        out[32..].copy_from_slice(&self.tag(key, sum));
        out
    }

    /// The body of `value` stored under `key`, if its checksum and tag hold.
    pub fn open<'a>(&self, key: &Key, value: &'a [u8]) -> Result<&'a [u8], Broken> {
        let body_len = value.len().checked_sub(TRAILER).ok_or(Broken::Corrupt)?;
        let (body, trailer) = value.split_at(body_len);
        let sum: [u8; 32] = trailer[..32].try_into().expect("32 bytes");
        if blake3::hash(body).as_bytes() != &sum {
            return Err(Broken::Corrupt);
        }
        if self.tag(key, &sum) != trailer[32..] {
            return Err(Broken::Rejected);
        }
        Ok(body)
    }

    /// Whether the last [`TRAILER`] bytes of a value under `key` carry this store's tag (the
    /// body is not checked: a put's test of whether a present value is its own).
    pub fn tail_is_ours(&self, key: &Key, tail: &[u8]) -> bool {
        tail.len() == TRAILER
            && self.tag(key, tail[..32].try_into().expect("32 bytes")) == tail[32..]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_value_opens_only_under_its_key_and_secret() {
        let (k, other) = (Key([1; 32]), Key([2; 32]));
        let ours = Sealer::new(Some(b"s3cret"));
        let mut v = b"rows".to_vec();
        ours.seal(&k, &mut v);
        assert_eq!(ours.open(&k, &v), Ok(&b"rows"[..]));
        assert!(ours.tail_is_ours(&k, &v[v.len() - TRAILER..]));
        assert_eq!(ours.open(&other, &v), Err(Broken::Rejected));
        assert_eq!(Sealer::new(None).open(&k, &v), Err(Broken::Rejected));
        assert_eq!(
            Sealer::new(Some(b"other")).open(&k, &v),
            Err(Broken::Rejected)
        );
        for i in 0..v.len() {
            let mut w = v.clone();
            w[i] ^= 4;
            assert!(ours.open(&k, &w).is_err(), "flip at {i}");
        }
        assert_eq!(ours.open(&k, &v[..10]), Err(Broken::Corrupt));
        let mut plain = b"rows".to_vec();
        Sealer::new(None).seal(&k, &mut plain);
        assert!(!ours.tail_is_ours(&k, &plain[plain.len() - TRAILER..]));
    }
}
