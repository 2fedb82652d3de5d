//! The unified cache's state files: saving a sequence or session file (atomically) and loading
//! one, or one memory (part) of it, into the cache.

use std::io::{Read, Seek, SeekFrom};
use std::path::Path;
use std::sync::Mutex;

use crate::cache::io::{Progress, ReadOptions, ReadSummary};
use crate::cache::SeedCache;
use crate::error::{KvError, Result};
use crate::model::MemoryKind;
use crate::state::cells::CellExt;
use crate::state::files::{
    body_splits, concat, ext_readings, file_layouts, header_bytes, parse_header, parse_header_in,
    read_file, resolve_version, session_prefix, write_atomic_with, FileHeader, FileKind, Outputs,
    SessionBody, WriteOptions,
};
use crate::state::parts::{parse_parts_with, Part, PartKind, PartRole, Parts};
use crate::state::source::{read_ahead, ByteSource, ReadSource, Sub};
use crate::state::Layout;

/// The pieces a streamed file load reads and writes at a time: large reads, two of them in
/// memory at once.
const FILE_PIECE: usize = 8 << 20;

/// What a file load restored.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadedFile {
    /// The header.
    pub header: FileHeader,
    /// Session files: the architecture.
    pub arch: Option<String>,
    /// Session files of the seed era: the outputs block.
    pub outputs: Option<Outputs>,
    /// What the payload read did.
    pub summary: ReadSummary,
}

impl SeedCache {
    /// A sequence file (`ggsq`) for `seq` with its prompt `tokens`.
    pub fn sequence_file_bytes(
        &self,
        seq: i32,
        tokens: &[i32],
        opts: WriteOptions,
        progress: Option<Progress<'_>>,
    ) -> Result<Vec<u8>> {
        self.check_seq("saveSequenceFile", seq)?;
        let (version, layout) = resolve_version(FileKind::Sequence, &opts)?;
        let out = header_bytes(FileKind::Sequence, version, tokens);
        let state = self.state_write(seq, layout, opts.n_stream, progress)?;
        concat(out, &state)
    }

    /// Saves `seq` with its prompt `tokens` as a sequence file (`ggsq`) at `path`, atomically
    /// (as [`write_atomic`]), streaming the rows from the tensors to the file.
    pub fn save_sequence_file(
        &self,
        path: &Path,
        seq: i32,
        tokens: &[i32],
        opts: WriteOptions,
        progress: Option<Progress<'_>>,
    ) -> Result<()> {
        self.check_seq("saveSequenceFile", seq)?;
        // validated before the file is created
        let (version, layout) = resolve_version(FileKind::Sequence, &opts)?;
        let header = header_bytes(FileKind::Sequence, version, tokens);
        self.state_size(seq, layout, opts.n_stream)?;
        let mut progress = progress;
        write_atomic_with(path, &mut |w| {
            w.write_all(&header)
                .map_err(|e| KvError::Io(format!("cannot write {}: {e}", path.display())))?;
            self.state_write_to(w, seq, layout, opts.n_stream, progress.take())?;
            Ok(())
        })
    }

    /// Saves the whole cache with `tokens` as a session file (`ggsn`) at `path`, atomically,
    /// streaming the rows from the tensors to the file.
    pub fn save_session_file(
        &self,
        path: &Path,
        tokens: &[i32],
        arch: &str,
        outputs: Option<&Outputs>,
        opts: WriteOptions,
        progress: Option<Progress<'_>>,
    ) -> Result<()> {
        let (version, layout) = resolve_version(FileKind::Session, &opts)?;
        let mut head = header_bytes(FileKind::Session, version, tokens);
        head.extend(session_prefix(arch, outputs, layout));
        self.state_size(-1, layout, opts.n_stream)?;
        let mut progress = progress;
        write_atomic_with(path, &mut |w| {
            w.write_all(&head)
                .map_err(|e| KvError::Io(format!("cannot write {}: {e}", path.display())))?;
            self.state_write_to(w, -1, layout, opts.n_stream, progress.take())?;
            Ok(())
        })
    }

    /// A session file (`ggsn`) of the whole cache. The seed layout carries the outputs block
    /// (empty unless given); today's layout has none.
    pub fn session_file_bytes(
        &self,
        tokens: &[i32],
        arch: &str,
        outputs: Option<&Outputs>,
        opts: WriteOptions,
        progress: Option<Progress<'_>>,
    ) -> Result<Vec<u8>> {
        let (version, layout) = resolve_version(FileKind::Session, &opts)?;
        let mut out = header_bytes(FileKind::Session, version, tokens);
        out.extend(session_prefix(arch, outputs, layout));
        let state = self.state_write(-1, layout, opts.n_stream, progress)?;
        concat(out, &state)
    }

    /// Loads a sequence file's bytes into `dest` (transactional, as `state_read`). Of a file
    /// of several memories (iSWA: `base` / `swa`; hybrid: `attention` / `recurrent`) it loads
    /// `opts.part`, or without it the one part that fits this cache; none or several is an
    /// error naming the parts.
    pub fn load_sequence_bytes(
        &mut self,
        bytes: &[u8],
        dest: i32,
        opts: ReadOptions,
        progress: Option<Progress<'_>>,
    ) -> Result<LoadedFile> {
        self.check_seq("loadSequenceFile", dest)?;
        let header = parse_header(bytes)?;
        if header.kind != FileKind::Sequence {
            return Err(KvError::InvalidState(format!(
                "expected a sequence file ('ggsq'), got a {} file",
                header.kind.name()
            )));
        }
        self.load_file_part(bytes, header, Some(dest), opts, progress)
    }

    /// Loads the sequence file at `path` into `dest` (transactional, as
    /// [`SeedCache::load_sequence_bytes`]). A file of one memory is streamed: its payload goes
    /// from the file into the tensors in pieces, read ahead on a second thread, so no buffer of
    /// the file's size is allocated and the reads overlap the copies. Any other file (several
    /// memories, a recurrent cache, a payload the stream refuses) is read whole and loaded as
    /// bytes, which gives the same result and the same errors.
    pub fn load_sequence_file(
        &mut self,
        path: &Path,
        dest: i32,
        opts: ReadOptions,
        mut progress: Option<Progress<'_>>,
    ) -> Result<LoadedFile> {
        self.check_seq("loadSequenceFile", dest)?;
        if let Some(loaded) = self.stream_sequence_file(path, dest, opts, &mut progress)? {
            return Ok(loaded);
        }
        self.load_sequence_bytes(&read_file(path)?, dest, opts, progress)
    }

    /// The streamed load of [`SeedCache::load_sequence_file`]: `None` (the cache unchanged) when
    /// the file is not one it streams or the stream refused it; an error only when `progress`
    /// aborted it.
    fn stream_sequence_file(
        &mut self,
        path: &Path,
        dest: i32,
        opts: ReadOptions,
        progress: &mut Option<Progress<'_>>,
    ) -> Result<Option<LoadedFile>> {
        let Ok(src) = ReadSource::open(path) else {
            return Ok(None);
        };
        let Ok(header) = parse_header_in(&src) else {
            return Ok(None);
        };
        let Ok(layouts) = file_layouts(&header, opts.layout) else {
            return Ok(None);
        };
        if header.kind != FileKind::Sequence || opts.part.is_some() || self.params.recurrent {
            return Ok(None);
        }
        let body = Sub::new(&src, header.body..src.len());
        let (shapes, _) = parse_parts_with(&body, &layouts, self.params.cell_ext);
        let [shape] = shapes.as_slice() else {
            return Ok(None);
        };
        let [part] = shape.parts.as_slice() else {
            return Ok(None);
        };
        if part.role != PartRole::Whole || part.kind == PartKind::Recurrent {
            return Ok(None);
        }
        let (start, len) = ((header.body + part.range.start) as u64, part.range.len());
        let stream_opts = ReadOptions {
            layout: Some(part.payload.layout),
            ..opts
        };
        let Ok(mut load) = self.state_in(dest, stream_opts) else {
            return Ok(None);
        };
        let file = Mutex::new(src.into_inner());
        let read = |i: usize, buf: &mut Vec<u8>| -> std::io::Result<bool> {
            let at = i * FILE_PIECE;
            let n = FILE_PIECE.min(len - at);
            buf.clear();
            buf.try_reserve_exact(n).map_err(std::io::Error::other)?;
            buf.resize(n, 0);
            let mut f = file.lock().unwrap_or_else(|p| p.into_inner());
            f.seek(SeekFrom::Start(start + at as u64))?;
            f.read_exact(buf)?;
            Ok(true)
        };
        let (mut aborted, mut failed) = (false, false);
        let read_result = read_ahead(len.div_ceil(FILE_PIECE), &read, &mut |i, piece| {
            if let Some(p) = progress.as_mut() {
                if !p((i * FILE_PIECE) as u64, len as u64) {
                    aborted = true;
                    return false;
                }
            }
            failed = self
                .state_in_write(&mut load, piece.unwrap_or_default())
                .is_err();
            !failed
        });
        if aborted || failed || read_result.is_err() {
            self.state_in_abort(&mut load)?;
            if aborted {
                return Err(KvError::Aborted("loadSequenceFile aborted".into()));
            }
            return Ok(None);
        }
        Ok(self
            .state_in_finish(&mut load)
            .ok()
            .map(|summary| LoadedFile {
                header,
                arch: None,
                outputs: None,
                summary,
            }))
    }

    /// Loads a session file's bytes into the whole cache (transactional). The body is tried
    /// with and without the seed era's outputs block, under each payload layout and memory its
    /// version allows; exactly one reading must fit (parts as in
    /// [`SeedCache::load_sequence_bytes`]).
    pub fn load_session_bytes(
        &mut self,
        bytes: &[u8],
        opts: ReadOptions,
        progress: Option<Progress<'_>>,
    ) -> Result<LoadedFile> {
        let header = parse_header(bytes)?;
        if header.kind != FileKind::Session {
            return Err(KvError::InvalidState(format!(
                "expected a session file ('ggsn'), got a {} file",
                header.kind.name()
            )));
        }
        self.load_file_part(bytes, header, None, opts, progress)
    }

    fn load_file_part(
        &mut self,
        bytes: &[u8],
        header: FileHeader,
        dest: Option<i32>,
        opts: ReadOptions,
        progress: Option<Progress<'_>>,
    ) -> Result<LoadedFile> {
        let layouts = file_layouts(&header, opts.layout)?;
        let splits = body_splits(bytes, &header, true)?;
        let (split, summary) =
            self.load_body_part(bytes, splits, &layouts, dest, opts, progress)?;
        Ok(LoadedFile {
            arch: (header.kind == FileKind::Session).then_some(split.arch),
            header,
            outputs: split.outputs,
            summary,
        })
    }

    /// `state_read` of `opts.part` of a payload of several memories (see
    /// [`SeedCache::load_sequence_bytes`]) into `seq` (-1: the whole cache).
    pub(crate) fn state_read_part(
        &mut self,
        data: &[u8],
        seq: i32,
        opts: ReadOptions,
        progress: Option<Progress<'_>>,
    ) -> Result<ReadSummary> {
        let dest = self.read_dest(seq)?;
        let all = [Layout::Seed, Layout::Streams, Layout::StreamsRot];
        let layouts: Vec<Layout> = match opts.layout {
            Some(l) => vec![l],
            None => all.to_vec(),
        };
        let whole = SessionBody {
            arch: String::new(),
            outputs: None,
            payload: 0..data.len(),
        };
        let (_, summary) =
            self.load_body_part(data, vec![whole], &layouts, dest, opts, progress)?;
        Ok(summary)
    }

    /// The shapes `body` parses as, its KV cells carrying this cache's extension; a recurrent
    /// cache takes the recurrent part of a hybrid whose attention cells carry any (Qwen3.5's
    /// M-RoPE cells), so the first extension that gives a shape is kept.
    fn parse_shapes(&self, body: &[u8], layouts: &[Layout]) -> (Vec<Parts>, Vec<String>) {
        let own = parse_parts_with(body, layouts, self.params().cell_ext);
        if !own.0.is_empty() || !self.params().recurrent {
            return own;
        }
        [CellExt::Pos2Tok, CellExt::Pos2]
            .into_iter()
            .map(|ext| parse_parts_with(body, layouts, ext))
            .find(|(shapes, _)| !shapes.is_empty())
            .unwrap_or(own)
    }

    /// Finds the one part of the candidate bodies that fits this cache (only `part`'s when
    /// given) and applies it.
    #[allow(clippy::too_many_arguments)]
    fn load_body_part(
        &mut self,
        bytes: &[u8],
        splits: Vec<SessionBody>,
        layouts: &[Layout],
        dest: Option<i32>,
        opts: ReadOptions,
        progress: Option<Progress<'_>>,
    ) -> Result<(SessionBody, ReadSummary)> {
        let part = opts.part;
        let mut fits: Vec<(SessionBody, Part)> = Vec::new();
        let mut errors = Vec::new();
        // a capacity problem is the real answer when the structure itself parsed
        let mut no_space = None;
        let mut parts_seen = Vec::new();
        for split in &splits {
            let body = &bytes[split.payload.clone()];
            let (shapes, shape_errors) = self.parse_shapes(body, layouts);
            errors.extend(shape_errors);
            if shapes.iter().any(|s| s.memory == MemoryKind::Dsv4) {
                return Err(KvError::Unsupported(
                    "the state is DeepSeek V4's (dsv4: a raw window cache, compressed caches and \
                     compressor states), which no live cache here holds; inspect or convert it"
                        .into(),
                ));
            }
            for shape in shapes {
                for p in shape.parts {
                    parts_seen.push(p.role);
                    if part.is_some_and(|want| want != p.role) {
                        continue;
                    }
                    let data = &body[p.range.clone()];
                    let recurrent = self.params().recurrent;
                    let checked = if (p.kind == PartKind::Recurrent) != recurrent
                        && p.role != PartRole::Whole
                    {
                        Err(KvError::InvalidState(format!(
                            "a {} part does not load into a {} cache",
                            p.kind.name(),
                            if recurrent { "recurrent" } else { "KV" }
                        )))
                    } else if p.kind == PartKind::Recurrent || recurrent {
                        self.check_payload(&p.payload, dest)
                    } else {
                        // re-parse under the cache's own view (a recurrent cache reads stream-less)
                        self.detect_payload_among(data, dest, &[p.payload.layout])
                            .map(|_| ())
                    };
                    match checked {
                        Ok(()) => fits.push((split.clone(), p)),
                        Err(e) => {
                            if matches!(e, KvError::NoSpace(_)) {
                                no_space.get_or_insert_with(|| e.clone());
                            }
                            errors.push(format!("{} part: {e}", p.role));
                        }
                    }
                }
            }
        }
        match fits.len() {
            1 => {
                let (split, p) = fits.remove(0);
                let body = &bytes[split.payload.clone()];
                let summary =
                    self.apply_payload(&body[p.range.clone()], &p.payload, dest, opts, progress)?;
                Ok((split, summary))
            }
            0 => {
                if let Some(want) =
                    part.filter(|w| !parts_seen.is_empty() && !parts_seen.contains(w))
                {
                    parts_seen.dedup();
                    return Err(KvError::InvalidState(format!(
                        "part '{want}' is not in this file (it holds {})",
                        parts_seen
                            .iter()
                            .map(|r| r.name())
                            .collect::<Vec<_>>()
                            .join(", ")
                    )));
                }
                if let Some(e) = no_space {
                    return Err(e);
                }
                // the version is not known here (a raw payload has none): every extension
                // this cache does not keep
                let own = self.params().cell_ext;
                let others: Vec<CellExt> = [CellExt::Pos2Tok, CellExt::Pos2, CellExt::None]
                    .into_iter()
                    .filter(|&e| e != own)
                    .collect();
                if let Some((_, p)) = ext_readings(bytes, &splits, layouts, &others).first() {
                    return Err(KvError::Unsupported(format!(
                        "the file's cells carry the '{}' cell extension, and this cache keeps '{}' \
                         (M-RoPE models such as Qwen-VL, and PLE models, keep 'pos2-tok'; \
                         every other model 'none'): build the cache with cellExt '{}'",
                        p.parts[0].payload.ext.name(),
                        own.name(),
                        p.parts[0].payload.ext.name()
                    )));
                }
                Err(KvError::InvalidState(if errors.len() == 1 {
                    errors.remove(0)
                } else {
                    format!("the payload fits no reading: {}", errors.join("; "))
                }))
            }
            _ => Err(KvError::InvalidState(format!(
                "the file is ambiguous for this cache: {} fit; pass the part (or the layout)",
                fits.iter()
                    .map(|(s, p)| format!(
                        "{} part ({}{})",
                        p.role,
                        p.payload.layout,
                        if s.outputs.is_some() {
                            ", with outputs"
                        } else {
                            ""
                        }
                    ))
                    .collect::<Vec<_>>()
                    .join(" and ")
            ))),
        }
    }
}
