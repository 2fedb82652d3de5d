//! The model record: the shape a store's model is bound to, kept in the backend beside the
//! blocks so that a process without a cache can look prompts up and write files, and the
//! binding of a put's state to it.

use llama_kv_cache::state::files::FileKind;
use llama_kv_cache::{Layout, SeedCache};

use sha2::{Digest, Sha256};

use super::PromptStore;
use crate::error::{StoreError, StoreResult};
use crate::geometry::FORMAT_VERSION;
use crate::key::Key;
use crate::seal::Broken;
use crate::shape::{Fields, FileFormat, Shape};

/// What the store's model is bound to: its shape, the fingerprint made of it, and the format
/// of the files it ingested.
#[derive(Clone)]
pub(super) struct Bound {
    pub(super) shape: Shape,
    pub(super) fingerprint: Key,
    pub(super) format: FileFormat,
}

const RECORD_MAGIC: [u8; 4] = *b"KVPM";

/// Whether a stored value is a store's model record (which backends with an expiry keep: a
/// process needs it to look up prompts without a cache) rather than a block, checkpoint or
/// index value.
pub fn is_model_record(value: &[u8]) -> bool {
    value.starts_with(&RECORD_MAGIC)
}

/// The format `write_file` defaults to for a store filled by `put` of a live cache: a sequence
/// file that llama.node and node-llama-cpp read (version 2), or today's version 4 when the
/// rows are rotated (only it records the rotation).
pub(super) fn live_format(cache: &SeedCache) -> FileFormat {
    let p = cache.params();
    let rotated = p.n_rot_k != 0 || p.n_rot_v != 0;
    let kind = FileKind::Sequence;
    FileFormat {
        kind,
        version: if rotated {
            kind.rotation_version()
        } else {
            kind.default_version()
        },
        layout: if rotated {
            Layout::StreamsRot
        } else {
            Layout::Streams
        },
        flash_attn: !cache.v_trans(),
        arch: None,
    }
}

impl PromptStore {
    fn record_key(&self) -> Key {
        let mut h = Sha256::new();
        h.update(b"llama-kv-cache prompt-store model record\0");
        h.update(FORMAT_VERSION.to_le_bytes());
        for part in [&self.model, &self.namespace] {
            h.update((part.len() as u64).to_le_bytes());
            h.update(part.as_bytes());
        }
        Key(h.finalize().into())
    }

    fn encode_record(&self, shape: &Shape, format: &FileFormat) -> Vec<u8> {
        let mut out = RECORD_MAGIC.to_vec();
        shape.encode(&mut out);
        format.encode(&mut out);
        self.sealer.seal(&self.record_key(), &mut out);
        out
    }

    fn decode_record(&self, v: &[u8]) -> Result<(Shape, FileFormat), Broken> {
        let body = self.sealer.open(&self.record_key(), v)?;
        let parsed = (|| {
            if body.get(..4)? != RECORD_MAGIC {
                return None;
            }
            let mut f = Fields::new(&body[4..]);
            let shape = Shape::decode(&mut f)?;
            let format = FileFormat::decode(&mut f)?;
            (f.at == f.bytes.len()).then_some((shape, format))
        })();
        parsed.ok_or(Broken::Corrupt)
    }

    /// The recorded shape; a corrupt record is removed and reads as absent.
    fn read_record(&self) -> StoreResult<Option<(Shape, FileFormat)>> {
        let key = self.record_key();
        match self.backend.get_many(&[key])?.pop().flatten() {
            None => Ok(None),
            Some(v) => match self.decode_record(&v) {
                Ok(r) => Ok(Some(r)),
                Err(broken) => {
                    self.count_broken(broken);
                    self.backend.remove(&key)?;
                    Ok(None)
                }
            },
        }
    }

    pub(super) fn bound_to(&self, shape: Shape, format: FileFormat) -> Bound {
        let fingerprint = shape.fingerprint(&self.model, &self.namespace);
        if let Some(hub) = &self.events {
            hub.bind(&fingerprint);
        }
        Bound {
            fingerprint,
            shape,
            format,
        }
    }

    /// The bound shape, from memory or the model record.
    pub(super) fn known(&self) -> StoreResult<Option<Bound>> {
        let mut bound = self.bound.lock().unwrap_or_else(|p| p.into_inner());
        if bound.is_none() {
            *bound = self.read_record()?.map(|(s, f)| self.bound_to(s, f));
        }
        Ok(bound.clone())
    }

    pub(super) fn refuse(&self, bound: &Shape, got: &Shape) -> StoreError {
        StoreError::Geometry(format!(
            "this store holds model {:?} as {}; the state is {}",
            self.model,
            bound.describe(),
            got.describe()
        ))
    }

    /// Binds the store to `shape` (recording it with `format` when the model has no record yet)
    /// or refuses a shape that differs from the bound one.
    pub(super) fn bind(&self, shape: &Shape, format: FileFormat) -> StoreResult<Bound> {
        let mut bound = self.bound.lock().unwrap_or_else(|p| p.into_inner());
        let b = match bound.as_ref() {
            Some(b) => {
                // the record may be gone from a shared tier that lost its data (a Redis
                // restarted without persistence): readers without a cache need it, so every
                // put restores it (a no-op `SET NX` where it is)
                self.backend
                    .put_if_absent(&self.record_key(), &self.encode_record(&b.shape, &b.format))?;
                b.clone()
            }
            None => {
                let recorded = match self.read_record()? {
                    Some(r) => r,
                    None => {
                        self.backend.put_if_absent(
                            &self.record_key(),
                            &self.encode_record(shape, &format),
                        )?;
                        // another process may have recorded first; an instant eviction leaves ours
                        self.read_record()?
                            .unwrap_or_else(|| (shape.clone(), format.clone()))
                    }
                };
                bound.insert(self.bound_to(recorded.0, recorded.1)).clone()
            }
        };
        if &b.shape != shape {
            return Err(self.refuse(&b.shape, shape));
        }
        Ok(b)
    }
}
