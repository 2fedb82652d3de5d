//! State payloads and files of today's memories, written part by part (iSWA: base and window
//! caches; hybrid: attention cache and recurrent memory; a unified model's cache of a stream
//! per sequence: one part): reading a payload whose layout is not given, and llama.cpp's
//! session and sequence files. A read checks every part before any changes, so every layout
//! can be tried without changing anything, and the one rule of every memory's payloads picks
//! the layout (`detect_layout`: exactly one must read it).

use std::path::Path;

use crate::cache::io::{check_progress, Progress, ReadOptions, ReadSummary};
use crate::cache::save_load::LoadedFile;
use crate::error::{KvError, Result};
use crate::state::files::{
    body_splits, file_layouts, header_bytes, parse_header, read_file, resolve_version,
    seq_data_payload, session_prefix, write_atomic_with, FileKind, WriteOptions,
};
use crate::state::{detect_layout, Layout};

/// A memory whose payload is written part by part, and read whole: checked in every part it
/// reads first, then applied, so that a layout can be tried without changing anything.
pub(crate) trait PartsPayload {
    /// What it is, for messages: `"iSWA"`, `"hybrid"` or `"per-sequence-stream"`.
    const NAME: &'static str;
    /// A payload parsed and checked against every part it reads, nothing changed yet.
    type Checked: CheckedPayload;
    /// The payload of `seq` (-1: everything) in `layout`.
    fn write_parts(&self, seq: i32, layout: Layout) -> Result<Vec<u8>>;
    /// Parses and checks a payload of `seq` (-1: everything) in `layout` against every part it
    /// reads, room included, changing nothing. `partial`: llama.cpp's `PARTIAL_ONLY` state (a
    /// context checkpoint), whose other parts keep what they hold; a memory of one part writes
    /// and reads its whole state there, as llama.cpp does.
    fn check_payload(
        &self,
        data: &[u8],
        seq: i32,
        layout: Layout,
        partial: bool,
    ) -> Result<Self::Checked>;
    /// Applies a read [`PartsPayload::check_payload`] accepted, the memory unchanged since;
    /// what the parts read, together.
    fn apply_payload(
        &mut self,
        data: &[u8],
        checked: Self::Checked,
        seq: i32,
    ) -> Result<ReadSummary>;
}

/// What the check of a payload found, as [`detect_layout`] compares two of them.
pub(crate) trait CheckedPayload {
    /// The layout it was read in.
    fn layout(&self) -> Layout;
    /// Whether no attention part has a data header: every layout with a stream prefix reads
    /// it alike.
    fn has_no_data_header(&self) -> bool;
}

/// Checks and applies a payload of `seq` (`partial`: a `PARTIAL_ONLY` state) in one of
/// `layouts` ([`payload_layouts`]), found by the rule every memory's payloads follow
/// ([`detect_layout`]): exactly one layout must read it.
pub(crate) fn read_any<M: PartsPayload>(
    m: &mut M,
    data: &[u8],
    seq: i32,
    layouts: &[Layout],
    partial: bool,
) -> Result<ReadSummary> {
    let what = if partial {
        "a partial state"
    } else {
        "a state"
    };
    let checked = detect_layout(
        layouts,
        |layout, _| m.check_payload(data, seq, layout, partial),
        |c| c.layout(),
        |a, b| a.has_no_data_header() && b.has_no_data_header(),
        |why| {
            let why: Vec<String> = why.iter().map(|(l, e)| format!("{l}: {e}")).collect();
            KvError::InvalidState(format!(
                "not {what} of this {} memory ({})",
                M::NAME,
                why.join("; ")
            ))
        },
    )?;
    m.apply_payload(data, checked, seq)
}

/// [`Memory::state_read`](crate::Memory::state_read) of a memory written part by part: the
/// payload (or the in-memory form of `llama_state_seq_get_data`) in the layout given, or in
/// whichever fits.
pub(crate) fn read_state<M: PartsPayload>(
    m: &mut M,
    data: &[u8],
    seq: i32,
    opts: ReadOptions,
    mut progress: Option<Progress<'_>>,
) -> Result<ReadSummary> {
    if opts.part.is_some() {
        return Err(KvError::InvalidArg(format!(
            "part: this {} memory reads all its parts at once",
            M::NAME
        )));
    }
    let data = seq_data_payload(data);
    check_progress(&mut progress, 0, data.len() as u64, "state read")?;
    read_any(m, data, seq, &payload_layouts(opts.layout), opts.partial)
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
pub(crate) fn save_file<M: PartsPayload>(
    m: &M,
    path: &Path,
    seq: Option<i32>,
    tokens: &[i32],
    arch: &str,
    opts: WriteOptions,
    mut progress: Option<Progress<'_>>,
) -> Result<()> {
    check_progress(&mut progress, 0, 1, "saving a state file")?;
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
pub(crate) fn load_file<M: PartsPayload>(
    m: &mut M,
    path: &Path,
    dest: Option<i32>,
    opts: ReadOptions,
    mut progress: Option<Progress<'_>>,
) -> Result<LoadedFile> {
    check_progress(&mut progress, 0, 1, "loading a state file")?;
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
            false,
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

/// The state write, read and files of a [`Memory`](crate::Memory) written part by part, the
/// same for every such memory: [`PartsPayload::write_parts`], [`read_state`], [`save_file`]
/// and [`load_file`] of itself. Expands inside its `impl Memory`.
macro_rules! parts_payload_io {
    () => {
        fn state_write(
            &self,
            seq: i32,
            opts: &$crate::state::files::WriteOptions,
            mut progress: Option<$crate::cache::io::Progress<'_>>,
        ) -> $crate::error::Result<Vec<u8>> {
            $crate::cache::io::check_progress(&mut progress, 0, 1, "state write")?;
            $crate::memory::parts_payload::PartsPayload::write_parts(self, seq, opts.layout)
        }

        fn state_read(
            &mut self,
            data: &[u8],
            seq: i32,
            opts: $crate::cache::io::ReadOptions,
            progress: Option<$crate::cache::io::Progress<'_>>,
        ) -> $crate::error::Result<$crate::cache::io::ReadSummary> {
            $crate::memory::parts_payload::read_state(self, data, seq, opts, progress)
        }

        fn save_file(
            &self,
            path: &std::path::Path,
            seq: Option<i32>,
            tokens: &[i32],
            arch: &str,
            opts: $crate::state::files::WriteOptions,
            progress: Option<$crate::cache::io::Progress<'_>>,
        ) -> $crate::error::Result<()> {
            $crate::memory::parts_payload::save_file(self, path, seq, tokens, arch, opts, progress)
        }

        fn load_file(
            &mut self,
            path: &std::path::Path,
            dest: Option<i32>,
            opts: $crate::cache::io::ReadOptions,
            progress: Option<$crate::cache::io::Progress<'_>>,
        ) -> $crate::error::Result<$crate::cache::save_load::LoadedFile> {
            $crate::memory::parts_payload::load_file(self, path, dest, opts, progress)
        }
    };
}
pub(crate) use parts_payload_io;
