//! Cells with extensions (llama.cpp 0.1.161's `llama_kv_cell_ext`: x, y, tok after each cell's
//! `n_seq_id`, written for M-RoPE and PLE models): the codec reads them by exact length, a
//! cache built with the extension keeps it per cell through placement, `seqCp`, defrag, failed
//! loads and state I/O, `convert` rewrites it in the output version's form, and a cache without
//! it refuses such files by name instead of misreading them.

use llama_kv_cache::state::cells::{cell_len, put_cell, CellExt, CellExtValue};
use llama_kv_cache::state::files::inspect_bytes;
use llama_kv_cache::{
    convert_bytes, CacheParams, ConvertOptions, FileKind, KvError, Layout, ReadOptions, SeedCache,
    UBatch, WriteOptions,
};
use proptest::prelude::*;

/// A sequence file of 6 cells written by `version`, its cells rewritten as an M-RoPE model's
/// llama.cpp writes them (each with the extension of `kind`).
fn file_with_ext(version: u32, kind: CellExt) -> (Vec<u8>, Vec<CellExtValue>) {
    let mut c = SeedCache::new(CacheParams::new(16, 2, 8, 8)).unwrap();
    c.find_slot(&UBatch::sequence(0, 0, 6)).unwrap().unwrap();
    let opts = WriteOptions {
        version: Some(version),
        ..WriteOptions::default()
    };
    let tokens: Vec<i32> = (100..106).collect();
    let plain = c.sequence_file_bytes(0, &tokens, opts, None).unwrap();
    let ins = inspect_bytes(&plain).unwrap();
    let n = ins.payload.streams[0].cells.len();
    // payload: n_stream, cell_count, then n cells of 12 bytes (pos, n_seq_id 1, seq id)
    let cells_at = ins.payload_offset + 8;
    let exts: Vec<CellExtValue> = (0..n as i32)
        .map(|i| CellExtValue {
            x: i % 3,
            y: i / 3,
            tok: 100 + i,
        })
        .collect();
    let mut out = plain[..cells_at].to_vec();
    for (i, ext) in exts.iter().enumerate() {
        let at = out.len();
        out.resize(at + cell_len(1, kind), 0);
        put_cell(&mut out[at..], i as i32, kind, Some(*ext), [0].into_iter());
    }
    out.extend_from_slice(&plain[cells_at + 12 * n..]);
    (out, exts)
}

#[test]
fn a_file_whose_cells_carry_extensions_is_read_by_its_exact_length() {
    for (version, kind) in [
        (4, CellExt::Pos2Tok),
        (3, CellExt::Pos2Tok),
        (2, CellExt::Pos2),
    ] {
        let (file, exts) = file_with_ext(version, kind);
        let ins = inspect_bytes(&file).unwrap_or_else(|e| panic!("v{version}: {e}"));
        assert_eq!(ins.payload.ext, kind, "v{version}");
        let cells = &ins.payload.streams[0].cells;
        assert_eq!(cells.positions(), &[0, 1, 2, 3, 4, 5]);
        for (i, want) in exts.iter().enumerate() {
            let tok = if kind == CellExt::Pos2Tok {
                want.tok
            } else {
                -1
            };
            assert_eq!(cells.get(i).ext, Some(CellExtValue { tok, ..*want }));
            assert_eq!(cells.get(i).seq_ids, &[0]);
        }
    }
}

#[test]
fn plain_files_are_still_read_without_extensions() {
    let mut c = SeedCache::new(CacheParams::new(16, 2, 8, 8)).unwrap();
    c.find_slot(&UBatch::sequence(0, 0, 6)).unwrap().unwrap();
    let file = c
        .sequence_file_bytes(0, &[1, 2, 3, 4, 5, 6], WriteOptions::default(), None)
        .unwrap();
    let ins = inspect_bytes(&file).unwrap();
    assert_eq!(ins.payload.ext, CellExt::None);
    assert_eq!(ins.payload.streams[0].cells.get(0).ext, None);
}

fn ext_params(ext: CellExt, n_seq_max: u32) -> CacheParams {
    let mut p = CacheParams::new(16, 2, 8, 8);
    p.n_seq_max = n_seq_max;
    p.cell_ext = ext;
    p.mrope = true;
    p
}

fn ext_of(c: &SeedCache, cell: u32) -> CellExtValue {
    c.cell(cell).unwrap().ext
}

#[test]
fn a_cache_with_the_extension_loads_it_and_writes_the_file_back_byte_for_byte() {
    for (version, kind) in [
        (4, CellExt::Pos2Tok),
        (3, CellExt::Pos2Tok),
        (2, CellExt::Pos2),
    ] {
        let (file, exts) = file_with_ext(version, kind);
        let mut c = SeedCache::new(ext_params(kind, 2)).unwrap();
        let loaded = c
            .load_sequence_bytes(&file, 1, ReadOptions::default(), None)
            .unwrap_or_else(|e| panic!("v{version}: {e}"));
        for (k, &cell) in loaded.summary.placed.iter().enumerate() {
            let want = exts[k];
            let tok = if kind == CellExt::Pos2 { -1 } else { want.tok };
            assert_eq!(ext_of(&c, cell), CellExtValue { tok, ..want }, "v{version}");
        }
        let opts = WriteOptions {
            version: Some(version),
            ..WriteOptions::default()
        };
        let tokens: Vec<i32> = (100..106).collect();
        let back = c.sequence_file_bytes(1, &tokens, opts, None).unwrap();
        let again = inspect_bytes(&back).unwrap();
        assert_eq!(again.payload.ext, kind, "v{version}");
        // the file names sequence 0; ours names 1: the same bytes but for those ids
        let renamed = convert_bytes(
            &back,
            &ConvertOptions {
                as_seq: Some(0),
                write: opts,
                ..ConvertOptions::default()
            },
        )
        .unwrap();
        assert!(renamed == file, "v{version}: written back differently");
    }
}

#[test]
fn loading_cells_with_extensions_into_a_cache_without_them_is_refused_by_name_and_changes_nothing()
{
    let (file, _) = file_with_ext(4, CellExt::Pos2Tok);
    let mut p = CacheParams::new(16, 2, 8, 8);
    p.n_seq_max = 2;
    let mut c = SeedCache::new(p).unwrap();
    c.find_slot(&UBatch::sequence(1, 0, 3)).unwrap().unwrap();
    let before = c.view(4);
    let e = c
        .load_sequence_bytes(&file, 0, ReadOptions::default(), None)
        .unwrap_err();
    assert!(matches!(e, KvError::Unsupported(_)), "{e}");
    assert!(e.to_string().contains("'pos2-tok' cell extension"), "{e}");
    assert!(e.to_string().contains("keeps 'none'"), "{e}");
    assert_eq!(c.view(4), before);
}

#[test]
fn a_plain_file_into_a_cache_with_the_extension_is_refused_by_name_and_changes_nothing() {
    let mut plain = SeedCache::new(CacheParams::new(16, 2, 8, 8)).unwrap();
    plain
        .find_slot(&UBatch::sequence(0, 0, 6))
        .unwrap()
        .unwrap();
    let file = plain
        .sequence_file_bytes(0, &[1, 2, 3, 4, 5, 6], WriteOptions::default(), None)
        .unwrap();
    let mut c = SeedCache::new(ext_params(CellExt::Pos2Tok, 2)).unwrap();
    c.find_slot(&UBatch::sequence(1, 0, 3)).unwrap().unwrap();
    let before = c.cell_columns().unwrap();
    let e = c
        .load_sequence_bytes(&file, 0, ReadOptions::default(), None)
        .unwrap_err();
    assert!(matches!(e, KvError::Unsupported(_)), "{e}");
    assert!(e.to_string().contains("the 'none' cell extension"), "{e}");
    assert_eq!(c.cell_columns().unwrap(), before);
}

#[test]
fn convert_keeps_the_extension_in_the_form_of_the_output_version() {
    let (v4, exts) = file_with_ext(4, CellExt::Pos2Tok);
    let to = |file: &[u8], version: u32, kind: FileKind| {
        convert_bytes(
            file,
            &ConvertOptions {
                to: Some(kind),
                write: WriteOptions {
                    version: Some(version),
                    ..WriteOptions::default()
                },
                ..ConvertOptions::default()
            },
        )
        .unwrap_or_else(|e| panic!("to v{version}: {e}"))
    };
    // the same version: the same bytes
    assert!(to(&v4, 4, FileKind::Sequence) == v4);
    // the first version that saved it keeps x and y only, and back gives no token (-1)
    let v2 = to(&v4, 2, FileKind::Sequence);
    let ins = inspect_bytes(&v2).unwrap();
    assert_eq!(ins.payload.ext, CellExt::Pos2);
    let back = inspect_bytes(&to(&v2, 4, FileKind::Sequence)).unwrap();
    assert_eq!(back.payload.ext, CellExt::Pos2Tok);
    for (i, want) in exts.iter().enumerate() {
        let got = back.payload.streams[0].cells.get(i).ext.unwrap();
        assert_eq!(got, CellExtValue { tok: -1, ..*want });
    }
    // to a session of today's version: every cell with its whole extension
    let session = inspect_bytes(&to(&v4, 11, FileKind::Session)).unwrap();
    assert_eq!(session.payload.ext, CellExt::Pos2Tok);
    for (i, want) in exts.iter().enumerate() {
        assert_eq!(session.payload.streams[0].cells.get(i).ext, Some(*want));
    }
}

#[test]
fn placement_records_the_ubatch_extension_or_an_mrope_text_position() {
    let mut c = SeedCache::new(ext_params(CellExt::Pos2Tok, 2)).unwrap();
    let mut ub = UBatch::sequence(0, 0, 3);
    ub.ext = vec![
        CellExtValue {
            x: 7,
            y: 8,
            tok: -1,
        },
        CellExtValue {
            x: 9,
            y: 8,
            tok: -1,
        },
        CellExtValue {
            x: 2,
            y: 2,
            tok: 300,
        },
    ];
    let slot = c.find_slot(&ub).unwrap().unwrap();
    for k in 0..3 {
        assert_eq!(ext_of(&c, slot.head + k), ub.ext[k as usize]);
    }
    let slot = c.find_slot(&UBatch::sequence(1, 5, 2)).unwrap().unwrap();
    for k in 0..2 {
        let pos = 5 + k as i32;
        assert_eq!(
            ext_of(&c, slot.head + k),
            CellExtValue {
                x: pos,
                y: pos,
                tok: -1
            }
        );
    }
    // one extension per token, or none
    let mut short = UBatch::sequence(0, 3, 2);
    short.ext = vec![CellExtValue::default()];
    let e = c.find_slot(&short).unwrap_err();
    assert!(
        e.to_string().contains("1 cell extensions for 2 tokens"),
        "{e}"
    );
    // a cache without extensions refuses them rather than dropping them
    let mut plain = SeedCache::new(CacheParams::new(16, 2, 8, 8)).unwrap();
    let e = plain.find_slot(&ub).unwrap_err();
    assert!(matches!(e, KvError::InvalidArg(_)), "{e}");
    assert!(e.to_string().contains("cellExt 'none'"), "{e}");
}

#[test]
fn an_mrope_cache_refuses_to_shift_or_divide_positions_and_changes_nothing() {
    let mut c = SeedCache::new(ext_params(CellExt::Pos2Tok, 1)).unwrap();
    c.find_slot(&UBatch::sequence(0, 0, 4)).unwrap().unwrap();
    let before = c.cell_columns().unwrap();
    for e in [
        c.seq_add(0, 0, -1, 2).unwrap_err(),
        c.seq_div(0, 0, -1, 2).unwrap_err(),
    ] {
        assert!(matches!(e, KvError::Unsupported(_)), "{e}");
        assert!(e.to_string().contains("M-RoPE positions"), "{e}");
    }
    assert_eq!(c.cell_columns().unwrap(), before);
    assert!(!c.has_shift());
}

/// A cell as the model knows it: position, extension, sequences (ascending).
type ModelCell = (i32, (i32, i32, i32), Vec<i32>);

/// Every occupied cell of the cache, sorted (where each sits is the cache's business).
fn occupied(c: &SeedCache) -> Vec<ModelCell> {
    let mut out: Vec<ModelCell> = (0..c.size())
        .map(|i| c.cell(i).unwrap())
        .filter(|cell| cell.pos >= 0 && !cell.seqs.is_empty())
        .map(|cell| {
            let e = cell.ext;
            (
                cell.pos,
                (e.x, e.y, e.tok),
                cell.seqs.iter().map(|s| s as i32).collect(),
            )
        })
        .collect();
    out.sort();
    out
}

#[derive(Clone, Debug)]
enum Op {
    Place { seq: i32, n: u32, seed: i32 },
    Rm { seq: i32, p0: i32, p1: i32 },
    Cp { src: i32, dst: i32 },
    Defrag,
    ReloadWhole,
    ReloadSequence { seq: i32 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0..3i32, 1..5u32, any::<i32>()).prop_map(|(seq, n, seed)| Op::Place { seq, n, seed }),
        (0..3i32, 0..8i32, 0..10i32).prop_map(|(seq, p0, p1)| Op::Rm { seq, p0, p1 }),
        (0..3i32, 0..3i32).prop_map(|(src, dst)| Op::Cp { src, dst }),
        Just(Op::Defrag),
        Just(Op::ReloadWhole),
        (0..3i32).prop_map(|seq| Op::ReloadSequence { seq }),
    ]
}

proptest! {
    /// Against a simple model (a multiset of cells: position, extension, sequences):
    /// placement, `seqRm`, `seqCp`, defrag and state round trips of the whole cache and of one
    /// sequence keep every cell's extension with it.
    #[test]
    fn extensions_follow_their_cells_through_every_operation(ops in prop::collection::vec(op(), 1..40)) {
        let mut p = ext_params(CellExt::Pos2Tok, 3);
        p.size = 32;
        let mut c = SeedCache::new(p).unwrap();
        let mut model: Vec<ModelCell> = Vec::new();
        let mut next_pos = [0i32; 3];
        for op in ops {
            match op {
                Op::Place { seq, n, seed } => {
                    let s = seq as usize;
                    let mut ub = UBatch::sequence(seq, next_pos[s], n);
                    ub.ext = (0..n as i32)
                        .map(|k| CellExtValue { x: seed.wrapping_add(k), y: k, tok: seed ^ k })
                        .collect();
                    if c.find_slot(&ub).unwrap().is_some() {
                        for (k, &pos) in ub.pos.iter().enumerate() {
                            let e = ub.ext[k];
                            model.push((pos, (e.x, e.y, e.tok), vec![seq]));
                        }
                        next_pos[s] += n as i32;
                    }
                }
                Op::Rm { seq, p0, p1 } => {
                    c.seq_rm(seq, p0, p1).unwrap();
                    for cell in model.iter_mut().filter(|m| m.0 >= p0 && m.0 < p1) {
                        cell.2.retain(|&s| s != seq);
                    }
                    model.retain(|m| !m.2.is_empty());
                }
                Op::Cp { src, dst } => {
                    c.seq_cp(src, dst, -1, -1).unwrap();
                    for cell in model.iter_mut().filter(|m| m.2.contains(&src)) {
                        if !cell.2.contains(&dst) {
                            cell.2.push(dst);
                            cell.2.sort();
                        }
                    }
                    next_pos[dst as usize] = next_pos[dst as usize].max(next_pos[src as usize]);
                }
                Op::Defrag => {
                    c.defrag_now(llama_kv_cache::DEFAULT_MAX_NODES).unwrap();
                }
                Op::ReloadWhole => {
                    let bytes = c.state_write(-1, Layout::StreamsRot, 1, None).unwrap();
                    let mut fresh = SeedCache::new(c.params().clone()).unwrap();
                    fresh.state_read(&bytes, -1, ReadOptions::default(), None).unwrap();
                    c = fresh;
                }
                Op::ReloadSequence { seq } => {
                    let bytes = c.state_write(seq, Layout::StreamsRot, 1, None).unwrap();
                    // the sequence's cells come back as cells of its own
                    if c.state_read(&bytes, seq, ReadOptions::default(), None).is_err() {
                        continue;
                    }
                    let mut own = Vec::new();
                    for cell in model.iter_mut().filter(|m| m.2.contains(&seq)) {
                        cell.2.retain(|&s| s != seq);
                        own.push((cell.0, cell.1, vec![seq]));
                    }
                    model.retain(|m| !m.2.is_empty());
                    model.extend(own);
                }
            }
            model.sort();
            prop_assert_eq!(occupied(&c), model.clone());
        }
    }
}

#[test]
fn streamed_state_keeps_the_extension_both_ways() {
    let mut c = SeedCache::new(ext_params(CellExt::Pos2Tok, 2)).unwrap();
    let mut ub = UBatch::sequence(1, 0, 5);
    ub.ext = (0..5)
        .map(|k| CellExtValue {
            x: k * 2,
            y: 9,
            tok: 40 + k,
        })
        .collect();
    c.find_slot(&ub).unwrap().unwrap();
    let whole = c.state_write(1, Layout::StreamsRot, 1, None).unwrap();
    // out in chunks of 7 bytes: the bytes of the one-piece writer
    let mut out = c.state_out(1, Layout::StreamsRot, 1).unwrap();
    let mut streamed = Vec::new();
    let mut buf = [0u8; 7];
    loop {
        let n = c.state_out_chunk(&mut out, &mut buf).unwrap();
        if n == 0 {
            break;
        }
        streamed.extend_from_slice(&buf[..n]);
    }
    assert!(streamed == whole);
    // in, fed in 5-byte pieces into another sequence
    let mut load = c.state_in(0, ReadOptions::default()).unwrap();
    for piece in whole.chunks(5) {
        c.state_in_write(&mut load, piece).unwrap();
    }
    let summary = c.state_in_finish(&mut load).unwrap();
    for (k, &cell) in summary.placed.iter().enumerate() {
        assert_eq!(ext_of(&c, cell), ub.ext[k]);
    }
}
