//! Cells with extensions (llama.cpp 0.1.161's `llama_kv_cell_ext`: x, y, tok after each cell's
//! `n_seq_id`, written for M-RoPE and PLE models): the codec reads them by exact length, and the
//! paths that cannot keep them yet refuse them by name instead of misreading them.

use llama_kv_cache::state::cells::{cell_len, put_cell, CellExt, CellExtValue};
use llama_kv_cache::state::files::inspect_bytes;
use llama_kv_cache::{
    convert_bytes, CacheParams, ConvertOptions, KvCache, KvError, ReadOptions, UBatch, WriteOptions,
};

/// A sequence file of 6 cells written by `version`, its cells rewritten as an M-RoPE model's
/// llama.cpp writes them (each with the extension of `kind`).
fn file_with_ext(version: u32, kind: CellExt) -> (Vec<u8>, Vec<CellExtValue>) {
    let mut c = KvCache::new(CacheParams::new(16, 2, 8, 8)).unwrap();
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
    let mut c = KvCache::new(CacheParams::new(16, 2, 8, 8)).unwrap();
    c.find_slot(&UBatch::sequence(0, 0, 6)).unwrap().unwrap();
    let file = c
        .sequence_file_bytes(0, &[1, 2, 3, 4, 5, 6], WriteOptions::default(), None)
        .unwrap();
    let ins = inspect_bytes(&file).unwrap();
    assert_eq!(ins.payload.ext, CellExt::None);
    assert_eq!(ins.payload.streams[0].cells.get(0).ext, None);
}

#[test]
fn loading_cells_with_extensions_is_refused_by_name_and_leaves_the_cache_as_it_was() {
    let (file, _) = file_with_ext(4, CellExt::Pos2Tok);
    let mut p = CacheParams::new(16, 2, 8, 8);
    p.n_seq_max = 2;
    let mut c = KvCache::new(p).unwrap();
    c.find_slot(&UBatch::sequence(1, 0, 3)).unwrap().unwrap();
    let before = c.view(4);
    let e = c
        .load_sequence_bytes(&file, 0, ReadOptions::default(), None)
        .unwrap_err();
    assert!(matches!(e, KvError::Unsupported(_)), "{e}");
    assert!(e.to_string().contains("'pos2-tok' cell extension"), "{e}");
    assert_eq!(c.view(4), before);
}

#[test]
fn converting_cells_with_extensions_is_refused_by_name() {
    let (file, _) = file_with_ext(4, CellExt::Pos2Tok);
    let e = convert_bytes(&file, &ConvertOptions::default()).unwrap_err();
    assert!(matches!(e, KvError::Unsupported(_)), "{e}");
    assert!(e.to_string().contains("'pos2-tok' cell extension"), "{e}");
}
