//! State payloads and files of today's memories, written part by part (iSWA: base and window
//! caches; hybrid: attention cache and recurrent memory; a unified model's cache of a stream
//! per sequence: one part): reading a payload whose layout is not given, and llama.cpp's
//! session and sequence files. A read checks every part before any changes, so trying a
//! layout that does not fit changes nothing.

use std::path::Path;

use crate::cache::files::LoadedFile;
use crate::cache::io::{ReadOptions, ReadSummary};
use crate::error::{KvError, Result};
use crate::memory::attention::AttentionCache;
use crate::memory::hybrid::HybridCache;
use crate::memory::iswa::IswaCache;
use crate::state::files::{
    body_splits, file_layouts, header_bytes, parse_header, read_file, resolve_version,
    session_prefix, write_atomic_with, FileKind, WriteOptions,
};
use crate::state::Layout;

/// A memory whose payload is written part by part, and read whole.
pub trait PartsPayload {
    /// What it is, for messages: `"iSWA"`, `"hybrid"` or `"per-sequence-stream"`.
    const NAME: &'static str;
    /// The payload of `seq` (-1: everything) in `layout`.
    fn write_parts(&self, seq: i32, layout: Layout) -> Result<Vec<u8>>;
    /// Reads a payload into `seq` (-1: everything), every part checked before any changes;
    /// what the parts read, together.
    fn read_parts(&mut self, data: &[u8], seq: i32, layout: Layout) -> Result<ReadSummary>;
}

impl PartsPayload for IswaCache {
    const NAME: &'static str = "iSWA";
    fn write_parts(&self, seq: i32, layout: Layout) -> Result<Vec<u8>> {
        self.state_write(seq, layout)
    }
    fn read_parts(&mut self, data: &[u8], seq: i32, layout: Layout) -> Result<ReadSummary> {
        self.state_read(data, seq, layout)
            .map(ReadSummary::together)
    }
}

impl PartsPayload for HybridCache {
    const NAME: &'static str = "hybrid";
    fn write_parts(&self, seq: i32, layout: Layout) -> Result<Vec<u8>> {
        self.state_write(seq, layout)
    }
    fn read_parts(&mut self, data: &[u8], seq: i32, layout: Layout) -> Result<ReadSummary> {
        self.state_read(data, seq, layout)
            .map(ReadSummary::together)
    }
}

impl PartsPayload for AttentionCache {
    const NAME: &'static str = "per-sequence-stream";
    fn write_parts(&self, seq: i32, layout: Layout) -> Result<Vec<u8>> {
        self.state_write(seq, layout)
    }
    fn read_parts(&mut self, data: &[u8], seq: i32, layout: Layout) -> Result<ReadSummary> {
        self.state_read(data, seq, layout)
    }
}

/// Reads `data` into `seq` under each of `layouts` in turn (0.1.161's first), keeping the
/// first that fits; a read that finds no room stops there (room does not depend on the
/// layout). The reasons of the others name them.
pub fn read_any<M: PartsPayload>(
    m: &mut M,
    data: &[u8],
    seq: i32,
    layouts: &[Layout],
) -> Result<ReadSummary> {
    let mut why = Vec::new();
    for &layout in layouts {
        match m.read_parts(data, seq, layout) {
            Ok(summary) => return Ok(summary),
            Err(e @ KvError::NoSpace(_)) => return Err(e),
            Err(e) => why.push(format!("{layout}: {e}")),
        }
    }
    Err(KvError::InvalidState(format!(
        "not a state of this {} memory ({})",
        M::NAME,
        why.join("; ")
    )))
}

/// The layouts a payload of today's memories is tried in: the one given, else 0.1.161's and
/// then the streams layout of the versions before it.
pub fn payload_layouts(forced: Option<Layout>) -> Vec<Layout> {
    match forced {
        Some(l) => vec![l],
        None => vec![Layout::StreamsRot, Layout::Streams],
    }
}

/// Saves `seq` (`None`: every sequence, as a session file with `arch`) with its prompt
/// `tokens` at `path`, atomically: the payload is written before the file is created, so a
/// refusal leaves nothing behind.
pub fn save_file<M: PartsPayload>(
    m: &M,
    path: &Path,
    seq: Option<i32>,
    tokens: &[i32],
    arch: &str,
    opts: WriteOptions,
) -> Result<()> {
    let kind = match seq {
        Some(_) => FileKind::Sequence,
        None => FileKind::Session,
    };
    let (version, layout) = resolve_version(kind, &opts)?;
    let mut head = header_bytes(kind, version, tokens);
    if kind == FileKind::Session {
        head.extend(session_prefix(arch, None, layout));
    }
    let payload = m.write_parts(seq.unwrap_or(-1), layout)?;
    write_atomic_with(path, &mut |w| {
        w.write_all(&head)
            .and_then(|()| w.write_all(&payload))
            .map_err(|e| KvError::Io(format!("cannot write {}: {e}", path.display())))
    })
}

/// Loads the file at `path`: a sequence file into `dest`, a session file (`dest` `None`)
/// into the whole memory. Each body and layout the file's version allows is tried, as
/// [`read_any`] does.
pub fn load_file<M: PartsPayload>(
    m: &mut M,
    path: &Path,
    dest: Option<i32>,
    opts: ReadOptions,
) -> Result<LoadedFile> {
    if opts.part.is_some() {
        return Err(KvError::InvalidArg(format!(
            "part: this {} memory reads every part of its file",
            M::NAME
        )));
    }
    let bytes = read_file(path)?;
    let header = parse_header(&bytes)?;
    let want = match dest {
        Some(_) => FileKind::Sequence,
        None => FileKind::Session,
    };
    if header.kind != want {
        return Err(KvError::InvalidState(format!(
            "expected a {} file, got a {} file",
            want.name(),
            header.kind.name()
        )));
    }
    let layouts = file_layouts(&header, opts.layout)?;
    let mut last = None;
    for split in body_splits(&bytes[..], &header, true)? {
        match read_any(
            m,
            &bytes[split.payload.clone()],
            dest.unwrap_or(-1),
            &layouts,
        ) {
            Ok(summary) => {
                return Ok(LoadedFile {
                    arch: (header.kind == FileKind::Session).then_some(split.arch),
                    outputs: split.outputs,
                    header,
                    summary,
                })
            }
            Err(e @ KvError::NoSpace(_)) => return Err(e),
            Err(e) => last = Some(e),
        }
    }
    Err(match last {
        Some(KvError::InvalidState(m)) => KvError::InvalidState(format!("{}: {m}", path.display())),
        Some(e) => e,
        None => KvError::InvalidState(format!("{} has no payload", path.display())),
    })
}
