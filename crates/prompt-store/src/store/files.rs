//! `file_bytes` and `write_file`: the longest stored prefix of a prompt as a llama.cpp session
//! or sequence file of the asked kind, version and layout, written straight from the blocks
//! where the store's own form (or an older sequence file's) allows, converted otherwise.

use std::path::Path;

use llama_kv_cache::cache::io::Progress;
use llama_kv_cache::state::files::{
    header_bytes, write_replacing, write_replacing_file, Durability, FileKind,
};
use llama_kv_cache::{
    convert_bytes, CellExt, ConvertOptions, KvError, Layout, MemoryKind, WriteOptions,
};

use super::assemble::Target;
use super::record::Bound;
use super::{tick, PromptStore};
use crate::error::StoreResult;
use crate::payload::{FileSink, MappedFileSink, PayloadSink};

/// How `write_file` writes a llama.cpp file. Every field left `None` is what the store's first
/// ingested file was (a store filled by `put` of a live cache: a sequence file of today's
/// version, V transposed).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WriteFileOptions {
    /// Session (`ggsn`) or sequence (`ggsq`) file.
    pub kind: Option<FileKind>,
    /// File version.
    pub version: Option<u32>,
    /// Payload layout of the KV parts.
    pub layout: Option<Layout>,
    /// Whether the reader runs with flash attention (V untransposed).
    pub flash_attn: Option<bool>,
    /// Session files: the architecture name.
    pub arch: Option<String>,
    /// iSWA states kept whole (`swa_full`): write only the last `swa_window` positions of the
    /// sliding-window part, for a reader whose context keeps only the window.
    pub swa_window: Option<u32>,
    /// Streams of the reader's context (`None`: 1): a context of a stream per sequence
    /// (llama.cpp's `kv_unified` off, as node-llama-cpp's contexts of several sequences) reads
    /// only files of as many streams.
    pub n_stream: Option<u32>,
    /// Whether the file is synced to the disk before it replaces `path` (`None`: synced). A
    /// file handed to a peer that loads it at once and removes it needs no sync, which costs
    /// most of the write.
    pub durability: Option<Durability>,
}

impl PromptStore {
    /// How `file_bytes` and `write_file` write a file for `opts`: the payload for the `target`
    /// reader, the file version of its header, and the conversion that gives the asked kind,
    /// version and layout (`None`: the payload is written as it is). The store's own form (a
    /// sequence file of today's version) and the sequence files of the versions before it
    /// (llama.node's 2, node-llama-cpp's 3: the `streams` layout, no rotation recorded) are
    /// written straight from the blocks; any other form is converted from the store's own.
    fn file_form(
        &self,
        bound: &Bound,
        opts: &WriteFileOptions,
    ) -> (Target, u32, Option<ConvertOptions>) {
        let d = &bound.format;
        let shape = &bound.shape;
        let flash_attn = opts.flash_attn.unwrap_or(d.flash_attn);
        let canonical_version = FileKind::Sequence.rotation_version();
        let mut target = Target {
            seq: 0,
            n_stream: 1,
            v_trans: !flash_attn,
            swa_window: opts.swa_window,
            ext: shape.cell_ext().map_or(CellExt::None, |_| {
                FileKind::Sequence.cell_exts(canonical_version)[0]
            }),
            rot_recorded: true,
        };
        // a dsv4 store writes sequence files: a session holds every row of every sequence's
        // compressed caches, which no stored sequence has
        let kind = opts.kind.unwrap_or(match shape.dsv4 {
            Some(_) => FileKind::Sequence,
            None => d.kind,
        });
        let version = opts.version.or((kind == d.kind).then_some(d.version));
        let rotation = version.is_none_or(|v| kind.records_rotation(v));
        let layout = match opts.layout {
            Some(l) => l,
            None if !rotation && d.layout == Layout::StreamsRot => Layout::Streams,
            None => d.layout,
        };
        let n_stream = opts.n_stream.unwrap_or(1);
        let sequence_of_one_stream = kind == FileKind::Sequence && n_stream == 1;
        if sequence_of_one_stream
            && version.unwrap_or(canonical_version) == canonical_version
            && layout != Layout::Seed
        {
            return (target, canonical_version, None);
        }
        // an older sequence file differs from the store's own form only in its header's
        // version and the rotation its KV parts do not record: where nothing is rotated, and
        // no part is of a kind whose bytes changed between the versions (cell extensions,
        // recurrent states, dsv4's sections), it is written as directly
        let unrotated = [&shape.main, &shape.swa, &shape.window]
            .iter()
            .all(|p| p.as_ref().is_none_or(|p| p.rot == (0, 0)));
        match version {
            Some(v)
                if sequence_of_one_stream
                    && layout == Layout::Streams
                    && !kind.records_rotation(v)
                    && unrotated
                    && shape.cell_ext().is_none()
                    && shape.recurrent.is_none()
                    && shape.dsv4.is_none() =>
            {
                target.rot_recorded = false;
                (target, v, None)
            }
            _ => {
                let convert = ConvertOptions {
                    write: WriteOptions {
                        version,
                        layout,
                        n_stream,
                    },
                    to: Some(kind),
                    arch: opts.arch.clone().or_else(|| d.arch.clone()),
                    recurrent: Some(shape.memory == MemoryKind::Recurrent),
                    ..ConvertOptions::default()
                };
                (target, canonical_version, Some(convert))
            }
        }
    }

    /// The header of a sequence file of `version` of `tokens`.
    fn file_head(version: u32, tokens: &[i32]) -> Vec<u8> {
        header_bytes(FileKind::Sequence, version, tokens)
    }

    /// The longest stored prefix of `tokens` as a llama.cpp file's bytes, with that prefix as
    /// the file's tokens, or `None` when nothing is stored.
    pub fn file_bytes(
        &self,
        tokens: &[i32],
        opts: &WriteFileOptions,
        progress: Option<Progress<'_>>,
    ) -> StoreResult<Option<(u64, Vec<u8>)>> {
        let _timer = self.latency.restore.start();
        let Some(bound) = self.known()? else {
            return Ok(None);
        };
        let (target, version, convert) = self.file_form(&bound, opts);
        self.assembled_file(&bound, tokens, target, version, convert, progress)
    }

    /// [`PromptStore::file_bytes`] once the form is decided: the store's own form assembled
    /// in memory, then converted if asked.
    fn assembled_file(
        &self,
        bound: &Bound,
        tokens: &[i32],
        target: Target,
        version: u32,
        convert: Option<ConvertOptions>,
        mut progress: Option<Progress<'_>>,
    ) -> StoreResult<Option<(u64, Vec<u8>)>> {
        let mut file = Vec::new();
        let head = |len: usize| Self::file_head(version, &tokens[..len]);
        let Some(len) = self.load(bound, tokens, target, &head, &mut file)? else {
            return Ok(None);
        };
        let bytes = match convert {
            None => file,
            Some(convert) => convert_bytes(&file, &convert)?,
        };
        let n = bytes.len() as u64;
        tick(&mut progress, n, n)?;
        Ok(Some((len as u64, bytes)))
    }

    /// Writes the longest stored prefix of `tokens` to `path` as a llama.cpp file (atomically)
    /// and returns its length in tokens. When nothing is stored, writes nothing and returns 0.
    /// A sequence file the blocks give directly (the store's own form, or llama.node's and
    /// node-llama-cpp's versions of it) is written straight from the blocks into the file, with
    /// no copy of it in memory: V rows (the form of files from flash-attention contexts) at
    /// their offsets, a transposed V in the file's mapped pages. Any other form is assembled in
    /// memory and converted.
    pub fn write_file(
        &self,
        tokens: &[i32],
        path: &Path,
        opts: &WriteFileOptions,
        mut progress: Option<Progress<'_>>,
    ) -> StoreResult<u64> {
        let _timer = self.latency.restore.start();
        let Some(bound) = self.known()? else {
            return Ok(0);
        };
        let (target, version, convert) = self.file_form(&bound, opts);
        let durability = opts.durability.unwrap_or(Durability::Synced);
        if convert.is_some() {
            return match self.assembled_file(&bound, tokens, target, version, convert, progress)? {
                Some((n, bytes)) => {
                    write_replacing(path, durability, &bytes)?;
                    Ok(n)
                }
                None => Ok(0),
            };
        }
        // nothing stored: no file; a store error: the temporary file goes, the old file stays
        let (mut written, mut nothing, mut failed) = (0, false, None);
        let head = |len: usize| Self::file_head(version, &tokens[..len]);
        let result = write_replacing_file(path, durability, &mut |file| {
            // V rows go to their offsets in the file; a transposed V puts each row in every
            // channel's run, so it is assembled in the file's own pages, mapped
            let loaded = if target.v_trans {
                let mut sink = MappedFileSink::new(file);
                let len = self.load(&bound, tokens, target, &head, &mut sink);
                len.and_then(|len| Ok((len, sink.len(), sink.finish()?)))
            } else {
                let mut sink = FileSink::new(file);
                let len = self.load(&bound, tokens, target, &head, &mut sink);
                len.and_then(|len| Ok((len, sink.len(), sink.finish()?)))
            };
            let loaded = loaded.and_then(|(len, n, ())| {
                if len.is_some() {
                    tick(&mut progress, n as u64, n as u64)?;
                }
                Ok(len)
            });
            match loaded {
                Ok(Some(len)) => {
                    written = len as u64;
                    Ok(())
                }
                Ok(None) => {
                    nothing = true;
                    Err(KvError::Aborted("nothing stored for these tokens".into()))
                }
                Err(e) => {
                    failed = Some(e);
                    Err(KvError::Aborted("the store failed while writing".into()))
                }
            }
        });
        if let Some(e) = failed {
            return Err(e);
        }
        if nothing {
            return Ok(0);
        }
        result?;
        Ok(written)
    }
}
