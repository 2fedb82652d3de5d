//! Payloads of several memories, written one after the other with nothing between them:
//! llama.cpp's iSWA memory (`llama_kv_cache_iswa`: the base cache, then the sliding-window
//! cache, two unified-cache payloads), its hybrid memory (`llama_memory_hybrid`: the
//! attention cache, then the recurrent memory) and its hybrid-iSWA memory
//! (`llama_memory_hybrid_iswa`: base, sliding-window, recurrent; a hybrid whose parts say so). Nothing in the bytes says which memory wrote
//! them, so a payload is parsed under every shape its file version allows; exactly one must
//! consume it exactly.

use std::fmt;
use std::ops::Range;

use crate::error::{KvError, Result};
use crate::model::MemoryKind;
use crate::state::cells::CellExt;
use crate::state::codec::parse_layerless_payload;
use crate::state::dsv4::{self, Compressed};
use crate::state::source::{ByteSource, Sub};
use crate::state::{
    parse_payload_form, parse_stream_head, parse_stream_with, row_block_ends, Cursor, Layout,
    ParsedPayload, StreamFormat,
};

/// What kind of memory a part is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PartKind {
    /// A unified KV cache (cells with positions and K/V rows).
    Kv,
    /// A recurrent memory (one state cell per sequence, R and S rows).
    Recurrent,
}

impl PartKind {
    /// `"kv"` or `"recurrent"`.
    pub fn name(self) -> &'static str {
        match self {
            PartKind::Kv => "kv",
            PartKind::Recurrent => "recurrent",
        }
    }
}

/// The role of a part in its memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PartRole {
    /// The payload's only memory.
    Whole,
    /// iSWA: the cache of the full-attention layers (written first).
    Base,
    /// iSWA: the cache of the sliding-window layers (written second).
    Swa,
    /// Hybrid: the attention cache (written first).
    Attention,
    /// Hybrid: the recurrent memory (written second).
    Recurrent,
    /// Sparse attention (`dsa`, `msa`, `hybrid-idx`): the indexer's key cache, written after
    /// the attention cache (after the recurrent memory in `hybrid-idx`).
    Indexer,
}

impl PartRole {
    /// `"whole"`, `"base"`, `"swa"`, `"attention"`, `"recurrent"` or `"indexer"`.
    pub fn name(self) -> &'static str {
        match self {
            PartRole::Whole => "whole",
            PartRole::Base => "base",
            PartRole::Swa => "swa",
            PartRole::Attention => "attention",
            PartRole::Recurrent => "recurrent",
            PartRole::Indexer => "indexer",
        }
    }

    /// Parses a role name.
    pub fn from_name(name: &str) -> Option<PartRole> {
        [
            PartRole::Whole,
            PartRole::Base,
            PartRole::Swa,
            PartRole::Attention,
            PartRole::Recurrent,
            PartRole::Indexer,
        ]
        .into_iter()
        .find(|r| r.name() == name)
    }
}

impl fmt::Display for PartRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One memory's payload inside a payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Part {
    /// KV or recurrent.
    pub kind: PartKind,
    /// Its role.
    pub role: PartRole,
    /// Its bytes, relative to the start of the whole payload.
    pub range: Range<usize>,
    /// The part parsed structurally; its data ranges are relative to `range.start`.
    pub payload: ParsedPayload,
}

/// A payload split into its memories.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Parts {
    /// Which memory wrote it: unified or recurrent (one part), iSWA, hybrid or dsa (two),
    /// hybrid-iSWA (`Hybrid` with base, SWA and recurrent parts), dsa-iswa or hybrid-idx
    /// (three).
    pub memory: MemoryKind,
    /// The parts in payload order.
    pub parts: Vec<Part>,
    /// dsv4: the compressed caches and compressor states after the raw cache's parts.
    pub compressed: Option<Compressed>,
}

/// How a payload's KV parts are written: the layout, the extension its cells carry, and
/// whether its layers have no V block (a cache without V).
type KvFormat = (Layout, CellExt, bool);

fn kv_part<S: ByteSource + ?Sized>(
    bytes: &S,
    start: usize,
    (layout, ext, no_v): KvFormat,
    role: PartRole,
    exact: bool,
) -> Result<Part> {
    let sub = &Sub::new(bytes, start..bytes.len());
    let payload = parse_payload_form(sub, layout, ext, no_v, exact)?;
    Ok(kv_part_at(start, role, payload))
}

/// [`kv_part`] of a cache that may hold no layer: the base cache of a hybrid-iSWA memory
/// whose attention layers all use the window (LFM2 with a window), whose data headers
/// declare 0 layers.
fn layerless_kv_part<S: ByteSource + ?Sized>(
    bytes: &S,
    start: usize,
    (layout, ext, _): KvFormat,
    role: PartRole,
) -> Result<Part> {
    let payload =
        parse_layerless_payload(&Sub::new(bytes, start..bytes.len()), layout, ext, false)?;
    Ok(kv_part_at(start, role, payload))
}

fn kv_part_at(start: usize, role: PartRole, payload: ParsedPayload) -> Part {
    Part {
        kind: PartKind::Kv,
        role,
        range: start..start + payload.len,
        payload,
    }
}

/// The recurrent memory's payload at the start of `body` (the seed's layout, no extension),
/// with `blocks` data blocks where its header declares more layers (a hybrid's recurrent part
/// declares every model layer and writes its own).
pub(crate) fn recurrent_payload<S: ByteSource + ?Sized>(
    body: &S,
    blocks: Option<u32>,
) -> Result<ParsedPayload> {
    let mut c = Cursor::new(body);
    let stream = parse_stream_with(&mut c, 0, StreamFormat::recurrent(), blocks)?;
    Ok(ParsedPayload {
        layout: Layout::Seed,
        streams: vec![stream],
        len: c.pos,
        ext: CellExt::None,
    })
}

/// The recurrent memory of a hybrid at `start`, and what `then` makes of the bytes after it.
/// Its data header declares every model layer but it writes blocks only for the recurrent
/// ones, so the block count is the one after which `then` succeeds (largest first). Its cells
/// are parsed once: each count only walks the block headers (a damaged header declaring
/// thousands of layers must not parse thousands of cells thousands of times).
fn recurrent_then<S: ByteSource + ?Sized, T>(
    bytes: &S,
    start: usize,
    then: impl Fn(usize) -> Result<T>,
) -> Result<(Part, T)> {
    let body = &Sub::new(bytes, start..bytes.len());
    let f = StreamFormat::recurrent();
    let mut c = Cursor::new(body);
    let head = parse_stream_head(&mut c, 0, f)?;
    let data_at = c.pos;
    let Some(data) = head.data else {
        return Err(KvError::InvalidState(
            "recurrent part: n_layer 0 declares no layer".into(),
        ));
    };
    // llama.cpp never transposes a recurrent state's S rows (0.1.161 refuses s_trans 1)
    if data.v_trans {
        return Err(KvError::InvalidState(
            "recurrent part: s_trans 1 (a recurrent state's S rows are never transposed)".into(),
        ));
    }
    // the chain of row blocks after the data header, walked once: K and (untransposed) S
    // blocks alike, so the blocks of `b` layers end where its 2b-th block does
    let n = head.cells.len();
    let mut chain = Cursor::new(body);
    chain.pos = data_at;
    let (ends, mut last_err) = row_block_ends(&mut chain, n, 2 * data.n_layer as usize);
    for blocks in (1..=data.n_layer).rev() {
        let Some(&end) = ends.get(2 * blocks as usize - 1) else {
            continue;
        };
        let end = start + end;
        match then(end) {
            Ok(rest) => {
                // the one count that fits, parsed whole
                let payload = recurrent_payload(body, Some(blocks))?;
                debug_assert_eq!(start + payload.len, end);
                let part = Part {
                    kind: PartKind::Recurrent,
                    role: PartRole::Recurrent,
                    range: start..end,
                    payload,
                };
                return Ok((part, rest));
            }
            Err(e) => last_err = Some(e),
        }
    }
    Err(last_err.unwrap_or_else(|| {
        KvError::InvalidState("recurrent part: n_layer 0 declares no layer".into())
    }))
}

/// The recurrent memory of a hybrid, which must end the payload.
fn recurrent_tail<S: ByteSource + ?Sized>(bytes: &S, start: usize) -> Result<Part> {
    let ends = |end: usize| match bytes.len() - end {
        0 => Ok(()),
        n => Err(KvError::InvalidState(format!(
            "recurrent part: {n} trailing bytes"
        ))),
    };
    Ok(recurrent_then(bytes, start, ends)?.0)
}

/// The recurrent memory of a hybrid with an indexer (`hybrid-idx`), followed by the indexer's
/// KV cache, which ends the payload.
fn recurrent_then_indexer<S: ByteSource + ?Sized>(
    bytes: &S,
    start: usize,
    format: KvFormat,
) -> Result<[Part; 2]> {
    let indexer = |end| kv_part(bytes, end, format, PartRole::Indexer, true);
    let (recurrent, indexer) = recurrent_then(bytes, start, indexer)?;
    Ok([recurrent, indexer])
}

/// Every way `bytes` parses as the payload of one memory under `layouts` (the layouts a file
/// version allows for KV caches). Single memories come first; iSWA and hybrid shapes are tried
/// only for layouts with a stream prefix (the seed era wrote neither). Errors of shapes that do
/// not fit are returned with their names.
pub fn parse_parts<S: ByteSource + ?Sized>(
    bytes: &S,
    layouts: &[Layout],
) -> (Vec<Parts>, Vec<String>) {
    parse_parts_with(bytes, layouts, CellExt::None)
}

/// [`parse_parts`] of a payload whose KV cells carry the extension `ext` (in layouts with a
/// stream prefix; the seed's layout and recurrent memories never carry one).
pub fn parse_parts_with<S: ByteSource + ?Sized>(
    bytes: &S,
    layouts: &[Layout],
    ext: CellExt,
) -> (Vec<Parts>, Vec<String>) {
    let mut fits = Vec::new();
    let mut errors = Vec::new();
    // DeepSeek V4's payload says what it is: nothing else is tried
    match dsv4::envelope(bytes) {
        Ok(None) => {}
        Ok(Some(partial)) => {
            for &layout in layouts.iter().filter(|l| l.has_stream_prefix()) {
                match dsv4_parts(bytes, (layout, ext, true), partial) {
                    Ok(p) => fits.push(p),
                    Err(e) => errors.push(format!("dsv4 ({layout}): {e}")),
                }
            }
            return (fits, errors);
        }
        Err(e) => return (fits, vec![e.to_string()]),
    }
    // a stream-less payload is a recurrent memory once the version's KV caches all have the
    // stream prefix; before, it may also be a seed-era KV cache (the caller decides)
    let streams_only = !layouts.contains(&Layout::Streams);
    // KV caches without V (multi-head latent attention) exist in today's layouts only, and
    // are tried when no reading with V fits (a reading without V that found no layer is the
    // reading with V again)
    let forms = layouts
        .iter()
        .map(|&l| (l, false))
        .chain(layouts.iter().map(|&l| (l, true)))
        .filter(|&(l, no_v)| !no_v || l.has_stream_prefix());
    for (layout, no_v) in forms {
        if no_v && !fits.is_empty() {
            break;
        }
        if !ext.is_none() && !layout.has_stream_prefix() {
            continue;
        }
        let mut note = |what: String, r: Result<Parts>| match r {
            Ok(p) if no_v && !p.parts.iter().any(|x| x.payload.no_v()) => {}
            Ok(p) => fits.push(p),
            Err(e) if no_v => errors.push(format!("{what} without V: {e}")),
            Err(e) => errors.push(format!("{what}: {e}")),
        };
        let format = (layout, ext, no_v);
        note(
            format!("{layout}"),
            kv_part(bytes, 0, format, PartRole::Whole, true).map(|mut p| {
                if streams_only && !layout.has_stream_prefix() {
                    p.kind = PartKind::Recurrent;
                }
                Parts {
                    memory: if p.kind == PartKind::Recurrent {
                        MemoryKind::Recurrent
                    } else {
                        MemoryKind::Unified
                    },
                    parts: vec![p],
                    compressed: None,
                }
            }),
        );
        if !layout.has_stream_prefix() {
            continue;
        }
        // every shape of several memories starts with a KV cache: parsed once, given each
        // shape's role (the base cache of a hybrid-iSWA memory may hold no layer)
        let lead = kv_part(bytes, 0, format, PartRole::Attention, false);
        let lead_as = |role: PartRole| {
            lead.clone().map(|mut p| {
                p.role = role;
                p
            })
        };
        // two KV caches: iSWA's base and window caches, or without V (latent attention) a
        // dsa memory's latent and indexer caches (an msa memory's read as iSWA: the bytes
        // do not tell them apart)
        let (first, second, two) = if no_v {
            (PartRole::Attention, PartRole::Indexer, MemoryKind::Dsa)
        } else {
            (PartRole::Base, PartRole::Swa, MemoryKind::Iswa)
        };
        note(
            format!("{} ({layout})", two.name()),
            lead_as(first).and_then(|a| {
                let b = kv_part(bytes, a.range.end, format, second, true)?;
                Ok(Parts {
                    memory: two,
                    parts: vec![a, b],
                    compressed: None,
                })
            }),
        );
        if no_v {
            note(
                format!("dsa-iswa ({layout})"),
                lead_as(PartRole::Attention).and_then(|a| {
                    let b = kv_part(bytes, a.range.end, format, PartRole::Indexer, false)?;
                    let swa = kv_part(bytes, b.range.end, format, PartRole::Swa, true)?;
                    Ok(Parts {
                        memory: MemoryKind::DsaIswa,
                        parts: vec![a, b, swa],
                        compressed: None,
                    })
                }),
            );
        }
        note(
            format!("hybrid ({layout})"),
            lead_as(PartRole::Attention).and_then(|attn| {
                let recr = recurrent_tail(bytes, attn.range.end)?;
                Ok(Parts {
                    memory: MemoryKind::Hybrid,
                    parts: vec![attn, recr],
                    compressed: None,
                })
            }),
        );
        note(
            format!("hybrid-idx ({layout})"),
            lead_as(PartRole::Attention).and_then(|attn| {
                let [recr, idx] = recurrent_then_indexer(bytes, attn.range.end, format)?;
                Ok(Parts {
                    memory: MemoryKind::HybridIdx,
                    parts: vec![attn, recr, idx],
                    compressed: None,
                })
            }),
        );
        note(
            format!("hybrid-iswa ({layout})"),
            lead_as(PartRole::Base)
                .or_else(|_| layerless_kv_part(bytes, 0, format, PartRole::Base))
                .and_then(|base| {
                    let swa = kv_part(bytes, base.range.end, format, PartRole::Swa, false)?;
                    let recr = recurrent_tail(bytes, swa.range.end)?;
                    Ok(Parts {
                        memory: MemoryKind::Hybrid,
                        parts: vec![base, swa, recr],
                        compressed: None,
                    })
                }),
        );
    }
    // empty streams read the same with and without the rotation fields: keep one reading
    if layouts.contains(&Layout::Streams) {
        let empty_rot = |p: &Parts| {
            p.parts
                .iter()
                .all(|x| x.payload.layout == Layout::StreamsRot && x.payload.has_no_data_header())
        };
        fits.retain(|p| !empty_rot(p));
    }
    (fits, errors)
}

/// A dsv4 payload (see [`dsv4`]): its raw cache's parts (base, then window; the window only
/// in partial mode), K-only caches with one stream per sequence, then its sections.
fn dsv4_parts<S: ByteSource + ?Sized>(bytes: &S, format: KvFormat, partial: bool) -> Result<Parts> {
    let mut parts = Vec::with_capacity(2);
    let mut at = dsv4::ENVELOPE;
    if !partial {
        // the base cache holds no layer (every dsv4 layer uses the window), unless a model
        // says otherwise
        let base = kv_part(bytes, at, format, PartRole::Base, false)
            .or_else(|_| layerless_kv_part(bytes, at, format, PartRole::Base))?;
        at = base.range.end;
        parts.push(base);
    }
    let swa = kv_part(bytes, at, format, PartRole::Swa, false)?;
    let compressed = dsv4::sections(bytes, swa.range.end, partial)?;
    parts.push(swa);
    Ok(Parts {
        memory: MemoryKind::Dsv4,
        parts,
        compressed: Some(compressed),
    })
}

/// The layouts a file version writes its KV caches in: session 11 / sequence 4 (llama.cpp
/// 0.1.161) record the rotation; 9, 10 / 2, 3 are the seed's layout or the streams layout.
/// Recurrent memories have no stream prefix in any version: their payload parses as the
/// seed's layout.
pub fn layouts_for_version(rotation_recorded: bool) -> &'static [Layout] {
    if rotation_recorded {
        &[Layout::StreamsRot, Layout::Seed]
    } else {
        &[Layout::Seed, Layout::Streams]
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;
    use crate::state::files::inspect_bytes;

    /// Bytes that count what the parsers read of them.
    struct Counted<'a> {
        bytes: &'a [u8],
        read: Cell<usize>,
    }

    impl ByteSource for Counted<'_> {
        fn len(&self) -> usize {
            self.bytes.len()
        }
        fn read_at(&self, pos: usize, dst: &mut [u8]) -> Result<()> {
            self.read.set(self.read.get() + dst.len());
            dst.copy_from_slice(&self.bytes[pos..pos + dst.len()]);
            Ok(())
        }
    }

    #[test]
    fn regression_a_recurrent_part_declaring_thousands_of_layers_was_parsed_again_for_each_count() {
        // found by the state_reader fuzz target: a hybrid's recurrent part whose data header
        // declares 4,096 layers, followed by 2,001 empty blocks (an odd count: no layer count
        // ends there), was parsed once per block count (its cells and every block before the
        // count): seconds for a 24 KiB state
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../__test__/fixtures/t161/t161-jamba.ggsq"
        );
        let file = std::fs::read(path).unwrap();
        let ins = inspect_bytes(&file).unwrap();
        let payload = &file[ins.payload_offset..];
        // s_trans 0, and 1 (which llama.cpp never writes: its S blocks were walked per count)
        for s_trans in [0u32, 1] {
            let mut damaged = payload[ins.parts[0].range.clone()].to_vec();
            // one state cell at position 9 with no seq id, then s_trans and 4,096 layers
            for x in [1u32, 9, 0, s_trans, 4096] {
                damaged.extend_from_slice(&x.to_le_bytes());
            }
            for _ in 0..2001 {
                damaged.extend_from_slice(&[0; 12]);
            }
            let counted = Counted {
                bytes: &damaged,
                read: Cell::new(0),
            };
            let (fits, errors) = parse_parts(&counted, layouts_for_version(true));
            assert!(
                fits.iter().all(|p| p.memory != MemoryKind::Hybrid),
                "{errors:?}"
            );
            if s_trans == 1 {
                assert!(errors.iter().any(|e| e.contains("s_trans 1")), "{errors:?}");
            }
            // every shape that starts with this attention part walks the recurrent blocks once
            let read = counted.read.get();
            assert!(
                read < 20 * damaged.len(),
                "s_trans {s_trans}: {read} bytes read of a {}-byte state",
                damaged.len()
            );
        }
    }
}
