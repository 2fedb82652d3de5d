//! Fuzzes every reader of untrusted bytes: payload detection and restore (whole cache and one
//! sequence, one part of a payload of several memories), sequence and session files of every
//! version (v11 / v4 with the rotation, iSWA and hybrid parts, cells with extensions),
//! inspection and conversion (the readers of today's live memories have a target of their own,
//! `live_reader`). A failed load must leave the cache exactly as it was; a successful one must
//! write back without error.
#![no_main]

use libfuzzer_sys::fuzz_target;
use llama_kv_cache::convert_bytes;
use llama_kv_cache::state::files::inspect_bytes;

use llama_kv_cache::{
    CacheParams, CellExt, ConvertOptions, GgmlType, SeedCache, Layout, PartRole, ReadOptions,
    ReadSummary, UBatch,
};

fn cache(flash: bool, ty: GgmlType, rotated: bool, ext: bool) -> SeedCache {
    // the rotated cache is shaped like the t161 h64 fixtures (head_dim 64, one KV head)
    let width = if rotated { 64 } else { 32 };
    let mut p = CacheParams::new(16, 2, width, width);
    p.n_seq_max = 4;
    p.flash_attn = flash;
    p.type_k = ty;
    p.type_v = if flash { ty } else { GgmlType::F16 };
    if rotated {
        p.n_rot_k = 64;
        p.n_rot_v = if flash { 64 } else { 0 };
    }
    // an M-RoPE cache: every cell carries x, y, tok (llama.cpp 0.1.161's cell extension)
    if ext {
        p.cell_ext = CellExt::Pos2Tok;
        p.mrope = true;
    }
    let mut c = SeedCache::new(p).unwrap();
    c.find_slot(&UBatch::per_token(
        vec![0, 1, 2],
        vec![vec![0, 1], vec![1], vec![2]],
    ))
    .unwrap()
    .unwrap();
    c
}

const PARTS: [Option<PartRole>; 4] = [
    None,
    Some(PartRole::Base),
    Some(PartRole::Swa),
    Some(PartRole::Attention),
];

fuzz_target!(|data: &[u8]| {
    let _ = inspect_bytes(data);
    let (selector, body) = match data.split_first() {
        Some((s, b)) => (*s, b),
        None => return,
    };
    if selector == 0xff {
        let _ = convert_bytes(body, &ConvertOptions::default());
        return;
    }
    let flash = selector & 1 == 1;
    let quantized = selector & 2 == 2;
    let ty = if quantized {
        GgmlType::Q8_0
    } else {
        GgmlType::F16
    };
    // bit 3: rotated K/V when quantized, cell extensions when not
    let rotated = quantized && selector & 8 == 8;
    let ext = !quantized && selector & 8 == 8;
    let new_cache = || cache(flash, ty, rotated, ext);
    let mut c = new_cache();
    let layout = if c.params().n_rot_k != 0 {
        Layout::StreamsRot
    } else {
        Layout::Seed
    };
    let before = c.state_write(-1, layout, 1, None).unwrap();
    let opts = ReadOptions {
        layout: None,
        allow_scattered: selector & 4 == 4,
        part: PARTS[usize::from(selector >> 4 & 3)],
        partial: false,
    };
    let seq = i32::from(selector >> 4 & 3) - 1;
    if selector >> 6 == 3 {
        let chunk = 1 + usize::from(selector >> 4 & 3) * 1000;
        return streamed_matches_whole(body, &new_cache, seq, chunk, opts, (&before, layout));
    }
    let result = match selector >> 6 {
        0 => c.state_read(body, seq, opts, None).map(|_| ()),
        1 => c
            .load_sequence_bytes(body, seq.max(0), opts, None)
            .map(|_| ()),
        _ => c.load_session_bytes(body, opts, None).map(|_| ()),
    };
    match result {
        Err(_) => assert_eq!(
            c.state_write(-1, layout, 1, None).unwrap(),
            before,
            "a failed load changed the cache"
        ),
        Ok(()) => {
            c.cells().check_consistency().unwrap();
            c.state_write(
                -1,
                if layout == Layout::Seed {
                    Layout::Streams
                } else {
                    layout
                },
                1,
                None,
            )
            .unwrap();
        }
    }
});

/// The streamed reader (`state_in`, bytes in chunks of `chunk`) against `state_read` of the
/// whole buffer: the same outcome, the same cache after a success, and the cache as it was
/// after a failure.
fn streamed_matches_whole(
    body: &[u8],
    new_cache: &dyn Fn() -> SeedCache,
    seq: i32,
    chunk: usize,
    opts: ReadOptions,
    (before, before_layout): (&[u8], Layout),
) {
    let opts = ReadOptions { part: None, ..opts };
    // a success is compared in a layout that records the cells of every sequence
    let layout = if before_layout == Layout::StreamsRot {
        Layout::StreamsRot
    } else {
        Layout::Streams
    };
    let mut whole = new_cache();
    let whole_result = whole.state_read(body, seq, opts, None);
    let mut streamed = new_cache();
    let streamed_result: Result<ReadSummary, _> = (|| {
        let mut load = streamed.state_in(seq, opts)?;
        for piece in body.chunks(chunk) {
            streamed.state_in_write(&mut load, piece)?;
        }
        streamed.state_in_finish(&mut load)
    })();
    match (&whole_result, &streamed_result) {
        (Ok(w), Ok(s)) => {
            assert_eq!(
                w.placed, s.placed,
                "the readers placed the cells differently"
            );
            assert_eq!(
                whole.state_write(-1, layout, 1, None).unwrap(),
                streamed.state_write(-1, layout, 1, None).unwrap(),
                "the readers loaded different caches"
            );
        }
        (Err(_), Err(_)) => {}
        (w, s) => panic!("state_read: {w:?}; streamed: {s:?}"),
    }
    if streamed_result.is_err() {
        assert_eq!(
            streamed.state_write(-1, before_layout, 1, None).unwrap(),
            before,
            "a failed streamed load changed the cache"
        );
    }
}
