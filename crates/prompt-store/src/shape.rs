//! What a store holds for one model: which memory writes its state (llama.cpp's unified cache,
//! iSWA, hybrid or recurrent memory) and the shape of each part, the fingerprint made of it,
//! and the model record (shape plus the file format of what was ingested) that lets a later
//! process write files without a cache.
//!
//! A restore point P of each memory needs (see the README's table):
//! - `main` (the whole unified cache, iSWA's base, hybrid's attention cache): rows for [0, P),
//!   kept per position in the chain's blocks;
//! - `swa` (iSWA's sliding-window cache): the window before P, or rows for [0, P) when the
//!   state held the whole range (`swa_full`), then kept in blocks of their own;
//! - `recurrent` (recurrent memory, hybrid's recurrent part): the state after exactly P tokens,
//!   kept in a checkpoint;
//! - `window` (dsa-iswa's sliding-window cache, its third KV part after the latent cache in
//!   `main` and the indexer in `swa`): the window before P, kept in a checkpoint;
//! - `dsv4` (DeepSeek V4, whose raw cache's base and window caches are `main` and `swa`): its
//!   compressed caches and compressor states after exactly P tokens, kept whole in a checkpoint
//!   as a recurrent state is.

use llama_kv_cache::model::MemoryKind;
use llama_kv_cache::state::dsv4::{Compressed, SectionKind};
use llama_kv_cache::state::files::FileKind;
use llama_kv_cache::{CellExt, GgmlType, LayerWidths, Layout, PartRole};
use sha2::{Digest, Sha256};

use crate::geometry::{Geometry, FORMAT_VERSION};
use crate::key::Key;

/// Rows of one KV part: the layers' shapes and the Hadamard rotation they are stored in
/// (`n_rot_k`, `n_rot_v`; rotated rows are kept as they are, so the rotation is part of the
/// fingerprint and rotated and unrotated blocks never mix).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvShape {
    /// One entry per layer of the part.
    pub layers: Geometry,
    /// `(n_rot_k, n_rot_v)`.
    pub rot: (u32, u32),
}

/// The parts of one model's memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shape {
    /// Which memory writes the state.
    pub memory: MemoryKind,
    /// The part kept per position for [0, P): absent for a recurrent memory.
    pub main: Option<KvShape>,
    /// iSWA: the sliding-window part; dsa and hybrid-idx: the indexer's key cache, which holds
    /// every position as the attention cache does (so it is kept in blocks of its own, as a
    /// `swa_full` window is).
    pub swa: Option<KvShape>,
    /// Recurrent and hybrid memories: bytes of one sequence's recurrent state.
    pub recurrent: Option<u64>,
    /// dsa-iswa: its sliding-window cache, the third KV part (after the indexer in `swa`),
    /// kept as the window before P in checkpoints.
    pub window: Option<KvShape>,
    /// dsv4: its raw cache's streams and the geometry of its compressed caches and compressor
    /// states (the raw cache's base and window caches are `main` and `swa`).
    pub dsv4: Option<Dsv4Shape>,
}

/// What a dsv4 state holds besides its raw cache's parts. Its compressed caches (a row per 4
/// or 128 positions) and compressor states (the positions not yet pooled) are kept whole, as
/// llama.cpp writes them for one sequence, in the checkpoint of each restore point, as a
/// recurrent state is; their size grows with P, so a checkpoint says it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Dsv4Shape {
    /// Streams of the raw cache (one per sequence of the context, whatever `kv_unified`): a
    /// file loads only into a context of as many.
    pub n_stream: u32,
    /// Canonical bytes of the sections' geometry: per section its group, kind, version or
    /// ratio and state size, layers and each tensor's type, width and row size (not its row
    /// count, which depends on P).
    pub sections: Vec<u8>,
}

impl Dsv4Shape {
    /// The shape of the sections `c` of a state whose raw cache has `n_stream` streams.
    pub fn of(c: &Compressed, n_stream: u32) -> Dsv4Shape {
        let mut b = Vec::new();
        for s in &c.sections {
            b.put_u32(s.group as u32);
            match s.kind {
                SectionKind::Compressed { version, .. } => {
                    b.put_u32(0);
                    b.put_u32(version);
                }
                SectionKind::Compressor {
                    ratio,
                    state_size,
                    n_embd_state,
                } => {
                    b.put_u32(1);
                    for x in [ratio, state_size, n_embd_state] {
                        b.put_u32(x);
                    }
                }
            }
            b.put_u32(s.layers.len() as u32);
            for l in &s.layers {
                b.put_u32(l.il);
                for t in &l.tensors {
                    b.put_u32(t.type_id as u32);
                    b.put_u64(t.ne0);
                    b.put_u64(t.row_size);
                }
            }
        }
        Dsv4Shape {
            n_stream,
            sections: b,
        }
    }
}

impl KvShape {
    /// Each layer's K and V widths in elements.
    fn widths(&self) -> Vec<LayerWidths> {
        let elements = |ty: GgmlType, row: u64| {
            ty.row_width(row)
                .map(u64::from)
                .ok_or_else(|| format!("{row} bytes of type {}", ty.id()))
        };
        self.layers
            .layers
            .iter()
            .map(|l| LayerWidths {
                k: elements(l.k_type, l.k_row),
                v: (!self.layers.no_v).then(|| elements(l.v_type, l.v_row)),
            })
            .collect()
    }
}

impl Shape {
    /// The KV parts with the role each has in the memory's state, and their layers' widths:
    /// what [`check_memory`](llama_kv_cache::check_memory) compares with a model.
    pub fn part_widths(&self) -> Vec<(PartRole, Vec<LayerWidths>)> {
        use MemoryKind::*;
        let hybrid_swa = self.memory == Hybrid && self.swa.is_some();
        let (main, swa) = match self.memory {
            Unified | Recurrent => (PartRole::Whole, PartRole::Swa),
            Iswa | Dsv4 => (PartRole::Base, PartRole::Swa),
            Hybrid if hybrid_swa => (PartRole::Base, PartRole::Swa),
            Hybrid => (PartRole::Attention, PartRole::Swa),
            Dsa | Msa | DsaIswa | HybridIdx => (PartRole::Attention, PartRole::Indexer),
        };
        [
            (main, &self.main),
            (swa, &self.swa),
            (PartRole::Swa, &self.window),
        ]
        .into_iter()
        .filter_map(|(role, part)| part.as_ref().map(|p| (role, p.widths())))
        .collect()
    }
}

/// What the files a store ingested were: the defaults of `write_file`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileFormat {
    /// Session or sequence.
    pub kind: FileKind,
    /// Version.
    pub version: u32,
    /// Payload layout of its KV parts.
    pub layout: Layout,
    /// Whether V was untransposed (flash attention).
    pub flash_attn: bool,
    /// Sessions: the architecture.
    pub arch: Option<String>,
}

fn memory_id(m: MemoryKind) -> u32 {
    match m {
        MemoryKind::Unified => 0,
        MemoryKind::Iswa => 1,
        MemoryKind::Recurrent => 2,
        MemoryKind::Hybrid => 3,
        MemoryKind::Dsa => 4,
        MemoryKind::DsaIswa => 5,
        MemoryKind::Msa => 6,
        MemoryKind::HybridIdx => 7,
        MemoryKind::Dsv4 => 8,
    }
}

fn memory_of(id: u32) -> Option<MemoryKind> {
    [
        MemoryKind::Unified,
        MemoryKind::Iswa,
        MemoryKind::Recurrent,
        MemoryKind::Hybrid,
        MemoryKind::Dsa,
        MemoryKind::DsaIswa,
        MemoryKind::Msa,
        MemoryKind::HybridIdx,
        MemoryKind::Dsv4,
    ]
    .into_iter()
    .find(|&m| memory_id(m) == id)
}

/// Little-endian fields appended to a buffer: the store's values are built of these.
pub(crate) trait PutLe {
    fn put_u32(&mut self, v: u32);
    fn put_u64(&mut self, v: u64);
    fn put_i32s(&mut self, v: &[i32]);
}

impl PutLe for Vec<u8> {
    fn put_u32(&mut self, v: u32) {
        self.extend_from_slice(&v.to_le_bytes());
    }
    fn put_u64(&mut self, v: u64) {
        self.extend_from_slice(&v.to_le_bytes());
    }
    fn put_i32s(&mut self, v: &[i32]) {
        for t in v {
            self.extend_from_slice(&t.to_le_bytes());
        }
    }
}

/// Reads what [`PutLe`] wrote; `None` past the end.
pub(crate) struct Fields<'a> {
    pub bytes: &'a [u8],
    pub at: usize,
}

impl<'a> Fields<'a> {
    pub fn new(bytes: &'a [u8]) -> Self {
        Fields { bytes, at: 0 }
    }
    pub fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let s = self.bytes.get(self.at..self.at.checked_add(n)?)?;
        self.at += n;
        Some(s)
    }
    pub fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    pub fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
    pub fn i32s(&mut self, n: usize) -> Option<Vec<i32>> {
        let b = self.take(n.checked_mul(4)?)?;
        Some(
            b.chunks_exact(4)
                .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        )
    }
}

impl KvShape {
    fn encode(&self, out: &mut Vec<u8>) {
        self.layers.encode(out);
        out.put_u32(self.rot.0);
        out.put_u32(self.rot.1);
    }

    fn decode(f: &mut Fields<'_>) -> Option<KvShape> {
        let (layers, used) = Geometry::decode(&f.bytes[f.at..])?;
        f.at += used;
        Some(KvShape {
            layers,
            rot: (f.u32()?, f.u32()?),
        })
    }

    fn describe(&self) -> String {
        let rot = match self.rot {
            (0, 0) => String::new(),
            (k, v) => format!(", rotated (nRotK {k}, nRotV {v})"),
        };
        format!("{}{rot}", self.layers.describe())
    }
}

impl Shape {
    /// Canonical bytes: memory id, then each part behind a presence flag.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.put_u32(memory_id(self.memory));
        for part in [&self.main, &self.swa] {
            out.put_u32(part.is_some() as u32);
            if let Some(p) = part {
                p.encode(out);
            }
        }
        out.put_u32(self.recurrent.is_some() as u32);
        if let Some(r) = self.recurrent {
            out.put_u64(r);
        }
        // the third KV part exists in dsa-iswa's shape only, the sections in dsv4's: the other
        // shapes' bytes (and so their fingerprints) are those of the stores that came before
        if self.memory == MemoryKind::DsaIswa {
            out.put_u32(self.window.is_some() as u32);
            if let Some(w) = &self.window {
                w.encode(out);
            }
        }
        if self.memory == MemoryKind::Dsv4 {
            out.put_u32(self.dsv4.is_some() as u32);
            if let Some(d) = &self.dsv4 {
                out.put_u32(d.n_stream);
                out.put_u32(d.sections.len() as u32);
                out.extend_from_slice(&d.sections);
            }
        }
    }

    pub(crate) fn decode(f: &mut Fields<'_>) -> Option<Shape> {
        let memory = memory_of(f.u32()?)?;
        let part = |f: &mut Fields<'_>| match f.u32()? {
            0 => Some(None),
            1 => KvShape::decode(f).map(Some),
            _ => None,
        };
        let main = part(f)?;
        let swa = part(f)?;
        let recurrent = match f.u32()? {
            0 => None,
            1 => Some(f.u64()?),
            _ => return None,
        };
        let window = match memory {
            MemoryKind::DsaIswa => part(f)?,
            _ => None,
        };
        let dsv4 = match (memory, memory == MemoryKind::Dsv4 && f.u32()? == 1) {
            (MemoryKind::Dsv4, true) => {
                let n_stream = f.u32()?;
                let n = f.u32()? as usize;
                Some(Dsv4Shape {
                    n_stream,
                    sections: f.take(n)?.to_vec(),
                })
            }
            _ => None,
        };
        Some(Shape {
            memory,
            main,
            swa,
            recurrent,
            window,
            dsv4,
        })
    }

    /// `key_{-1}`: SHA-256 over a domain tag, the format version, the caller's model identity
    /// (e.g. the GGUF file's hash), the namespace (tenant) and this shape. Two namespaces
    /// share no key.
    pub fn fingerprint(&self, model: &str, namespace: &str) -> Key {
        let mut h = Sha256::new();
        h.update(b"llama-kv-cache prompt-store fingerprint\0");
        h.update(FORMAT_VERSION.to_le_bytes());
        for part in [model, namespace] {
            h.update((part.len() as u64).to_le_bytes());
            h.update(part.as_bytes());
        }
        let mut g = Vec::new();
        self.encode(&mut g);
        h.update(&g);
        Key(h.finalize().into())
    }

    /// The cell extension its KV parts keep (M-RoPE / PLE models), if any.
    pub fn cell_ext(&self) -> Option<CellExt> {
        [&self.main, &self.swa, &self.window]
            .into_iter()
            .flatten()
            .map(|kv| kv.layers.ext)
            .find(|e| !e.is_none())
    }

    /// Whether every block boundary of the chain is a restore point by itself: nothing outside
    /// the blocks is needed (no recurrent state, no window kept in checkpoints only; an SWA
    /// part only when kept in blocks too).
    pub fn blocks_restore(&self) -> bool {
        self.recurrent.is_none() && self.window.is_none() && self.dsv4.is_none()
    }

    /// A one-line description for messages.
    pub fn describe(&self) -> String {
        let mut s = self.memory.name().to_string();
        if let Some(m) = &self.main {
            s += &format!(", {}", m.describe());
        }
        if let Some(w) = &self.swa {
            let what = if matches!(
                self.memory,
                MemoryKind::Dsa | MemoryKind::DsaIswa | MemoryKind::HybridIdx
            ) {
                "indexer"
            } else {
                "sliding window"
            };
            s += &format!(", {what}: {}", w.describe());
        }
        if let Some(w) = &self.window {
            s += &format!(", sliding window: {}", w.describe());
        }
        if let Some(r) = self.recurrent {
            s += &format!(", recurrent state of {r} bytes");
        }
        if let Some(d) = &self.dsv4 {
            s += &format!(
                ", {} raw streams, compressed caches and compressor states",
                d.n_stream
            );
        }
        s
    }
}

impl FileFormat {
    pub(crate) fn encode(&self, out: &mut Vec<u8>) {
        out.put_u32(self.kind.magic());
        out.put_u32(self.version);
        out.put_u32(match self.layout {
            Layout::Seed => 0,
            Layout::Streams => 1,
            Layout::StreamsRot => 2,
        });
        out.put_u32(self.flash_attn as u32);
        let arch = self.arch.as_deref().unwrap_or("");
        out.put_u32(arch.len() as u32);
        out.extend_from_slice(arch.as_bytes());
    }

    pub(crate) fn decode(f: &mut Fields<'_>) -> Option<FileFormat> {
        let magic = f.u32()?;
        let kind = [FileKind::Sequence, FileKind::Session]
            .into_iter()
            .find(|k| k.magic() == magic)?;
        let version = f.u32()?;
        let layout = [Layout::Seed, Layout::Streams, Layout::StreamsRot]
            .into_iter()
            .nth(f.u32()? as usize)?;
        let flash_attn = match f.u32()? {
            0 => false,
            1 => true,
            _ => return None,
        };
        let n = f.u32()? as usize;
        let arch = std::str::from_utf8(f.take(n)?).ok()?;
        Some(FileFormat {
            kind,
            version,
            layout,
            flash_attn,
            arch: (!arch.is_empty()).then(|| arch.to_string()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::LayerGeometry;
    use llama_kv_cache::GgmlType;

    fn kv(rows: u64, rot: (u32, u32)) -> KvShape {
        KvShape {
            layers: Geometry {
                layers: vec![
                    LayerGeometry {
                        k_type: GgmlType::F16,
                        k_row: rows,
                        v_type: GgmlType::F16,
                        v_row: rows,
                    };
                    2
                ],
                ext: llama_kv_cache::CellExt::None,
                no_v: false,
            },
            rot,
        }
    }

    #[test]
    fn shapes_round_trip_and_every_part_changes_the_fingerprint() {
        let base = Shape {
            memory: MemoryKind::Iswa,
            main: Some(kv(64, (0, 0))),
            swa: Some(kv(32, (0, 0))),
            recurrent: None,
            window: None,
            dsv4: None,
        };
        let dsa_iswa = Shape {
            memory: MemoryKind::DsaIswa,
            window: Some(kv(48, (0, 0))),
            dsv4: None,
            ..base.clone()
        };
        let variants = [
            Shape {
                main: Some(kv(64, (64, 0))),
                ..base.clone()
            },
            Shape {
                swa: None,
                memory: MemoryKind::Unified,
                ..base.clone()
            },
            Shape {
                recurrent: Some(100),
                memory: MemoryKind::Hybrid,
                swa: None,
                ..base.clone()
            },
            // dsa-iswa's window is part of its shape
            Shape {
                window: Some(kv(16, (0, 0))),
                ..dsa_iswa.clone()
            },
            dsa_iswa,
            // and dsv4's raw streams and sections
            Shape {
                memory: MemoryKind::Dsv4,
                dsv4: Some(Dsv4Shape {
                    n_stream: 2,
                    sections: vec![1, 2, 3],
                }),
                ..base.clone()
            },
            Shape {
                memory: MemoryKind::Dsv4,
                dsv4: Some(Dsv4Shape {
                    n_stream: 1,
                    sections: vec![1, 2, 3],
                }),
                ..base.clone()
            },
        ];
        assert_ne!(base.fingerprint("m", ""), base.fingerprint("m", "tenant"));
        assert_ne!(base.fingerprint("m", "ab"), base.fingerprint("ma", "b"));
        for s in std::iter::once(&base).chain(&variants) {
            let mut b = Vec::new();
            s.encode(&mut b);
            let mut f = Fields::new(&b);
            assert_eq!(Shape::decode(&mut f).as_ref(), Some(s));
            assert_eq!(f.at, b.len());
            if s != &base {
                assert_ne!(s.fingerprint("m", ""), base.fingerprint("m", ""));
            }
        }
    }

    #[test]
    fn file_formats_round_trip() {
        let f = FileFormat {
            kind: FileKind::Session,
            version: 11,
            layout: Layout::StreamsRot,
            flash_attn: true,
            arch: Some("gemma3".into()),
        };
        let mut b = Vec::new();
        f.encode(&mut b);
        assert_eq!(FileFormat::decode(&mut Fields::new(&b)), Some(f));
    }
}
