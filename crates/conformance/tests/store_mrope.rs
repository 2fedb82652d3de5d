//! The prompt store and an M-RoPE model (a tiny Qwen2-VL) against llama.cpp 0.1.161: every cell
//! of such a model carries its `x, y, tok`, and the store keeps them. It ingests 0.1.161's own
//! session and sequence files (full blocks and the partial last one), writes them back with the
//! peer's cells, extension and all, and the peer continues them with its own next token; a live
//! cache's prompt restores into a fresh cache with every cell's extension.

mod common;

use std::sync::Arc;

use common::today_file;

use conformance::models_dir;
use conformance::today::{spec_named, Spec};
use llama_kv_cache::state::files::inspect_bytes;
use llama_kv_cache::{
    convert_bytes, CellExt, CellExtValue, ConvertOptions, FileKind, GgmlType, ModelInfo, SeedCache,
    UBatch, WriteOptions,
};
use prompt_store::{MemoryBackend, PromptStore};

/// The store's smallest blocks: the 40-token prompt is two full blocks and a tail of 8.
const BLOCK: u32 = 16;
const LEN: i32 = 40;
/// Room for the prompt and the peer's next tokens.
const CTX: u32 = 64;

/// The peer's run: the tiny Qwen2-VL decoding one 40-token prompt.
fn spec() -> Spec {
    Spec {
        name: "qwen2vl-40",
        prompts: vec![(0..LEN).map(|t| 260 + t % 50).collect()],
        ctx: CTX,
        ..spec_named("qwen2vl")
    }
}

fn store() -> PromptStore {
    PromptStore::new(Arc::new(MemoryBackend::new(None)), "qwen2vl", BLOCK).unwrap()
}

/// A one-sequence cache for the tiny Qwen2-VL, as llama.cpp sizes it.
fn model_cache() -> SeedCache {
    let info = ModelInfo::from_file(&models_dir().join("qwen2vl.gguf"), false).unwrap();
    let p = info
        .cache_params(CTX, 1, GgmlType::F16, GgmlType::F16, false)
        .unwrap();
    assert_eq!(p.cell_ext, CellExt::Pos2Tok);
    SeedCache::new(p).unwrap()
}

#[test]
fn the_store_keeps_the_cell_extensions_of_the_peers_files_and_the_peer_continues_them() {
    let spec = spec();
    let prompt = &spec.prompts[0];
    let dir = std::env::temp_dir().join(format!("today-store-mrope-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (session, sequence) = (dir.join("peer.ggsn"), dir.join("peer.ggsq"));
    let sidecar = spec.generate_into(&session, &sequence).unwrap();
    for (input, kind, version) in [
        (session.clone(), FileKind::Session, 11),
        (sequence, FileKind::Sequence, 4),
    ] {
        let store = store();
        let put = store.put_file(&input, None).unwrap();
        assert_eq!(put.tokens, prompt.len() as u64, "{}", input.display());
        assert_eq!(put.blocks_written, 2);
        let out = dir.join(format!("stored-v{version}"));
        let opts = today_file(kind, version);
        assert_eq!(
            store.write_file(prompt, &out, &opts, None).unwrap(),
            prompt.len() as u64
        );
        let (ours, theirs) = (
            inspect_bytes(&std::fs::read(&out).unwrap()).unwrap(),
            inspect_bytes(&std::fs::read(&input).unwrap()).unwrap(),
        );
        assert_eq!(ours.payload.ext, CellExt::Pos2Tok);
        assert_eq!(
            ours.payload.streams[0].cells, theirs.payload.streams[0].cells,
            "v{version}: the peer's cells, extensions and all"
        );
        let dest = (kind == FileKind::Sequence).then_some(0);
        let token = sidecar["next"][0].as_i64().unwrap();
        let got = spec.continue_file(&out, dest, token, prompt.len()).unwrap();
        assert_eq!(
            got,
            sidecar["next2"][0].as_i64().unwrap(),
            "v{version} from the store"
        );
    }

    // a session of the first version that saved extensions keeps only x, y: stored as such
    // (another shape than x, y, tok) and written as today's version, x and y are the peer's
    let store = store();
    let v9 = dir.join("peer-v9.ggsn");
    let bytes = convert_bytes(
        &std::fs::read(&session).unwrap(),
        &ConvertOptions {
            write: WriteOptions {
                version: Some(9),
                ..WriteOptions::default()
            },
            ..ConvertOptions::default()
        },
    )
    .unwrap();
    std::fs::write(&v9, bytes).unwrap();
    assert_eq!(
        store.put_file(&v9, None).unwrap().tokens,
        prompt.len() as u64
    );
    assert_eq!(
        store.shape().unwrap().unwrap().cell_ext(),
        Some(CellExt::Pos2)
    );
    let out = dir.join("from-v9.ggsn");
    let opts = today_file(FileKind::Session, 11);
    store.write_file(prompt, &out, &opts, None).unwrap();
    let (ours, theirs) = (
        inspect_bytes(&std::fs::read(&out).unwrap()).unwrap(),
        inspect_bytes(&std::fs::read(&session).unwrap()).unwrap(),
    );
    let xy = |cells: &llama_kv_cache::state::cells::PayloadCells| {
        cells.exts().iter().map(|e| (e.x, e.y)).collect::<Vec<_>>()
    };
    assert_eq!(ours.payload.ext, CellExt::Pos2Tok);
    assert_eq!(
        xy(&ours.payload.streams[0].cells),
        xy(&theirs.payload.streams[0].cells)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_live_caches_prompt_restores_with_every_cells_extension() {
    // an image's tokens: 2D positions that are not the token's position, no token id
    let tokens: Vec<i32> = (0..LEN).map(|t| 260 + t).collect();
    let ext: Vec<CellExtValue> = (0..LEN)
        .map(|p| match p {
            10..=29 => CellExtValue {
                x: 10 + (p - 10) % 5,
                y: 10 + (p - 10) / 5,
                tok: -1,
            },
            _ => CellExtValue {
                x: p,
                y: p,
                tok: 260 + p,
            },
        })
        .collect();
    let mut c = model_cache();
    let mut ub = UBatch::sequence(0, 0, LEN as u32);
    ub.ext = ext.clone();
    c.find_slot(&ub).unwrap().unwrap();
    let store = store();
    let put = store.put(&c, 0, &tokens, None).unwrap();
    assert_eq!(put.tokens, LEN as u64);

    let mut fresh = model_cache();
    assert_eq!(
        store.restore(&mut fresh, 0, &tokens, None).unwrap(),
        LEN as u64
    );
    for i in 0..LEN as u32 {
        let cell = fresh.cell(i).unwrap();
        assert_eq!(cell.ext, ext[cell.pos as usize], "cell {i}");
    }
    // a prompt that diverges inside the image restores the blocks before it, with theirs
    let mut other = tokens.clone();
    other[20] = 300;
    let mut fresh = model_cache();
    assert_eq!(store.restore(&mut fresh, 0, &other, None).unwrap(), 16);
    for i in 0..16 {
        let cell = fresh.cell(i).unwrap();
        assert_eq!(cell.ext, ext[cell.pos as usize], "cell {i}");
    }
    // a cache without extensions is another shape: nothing of this store is its
    let info = ModelInfo::from_file(&models_dir().join("llama-h16.gguf"), false).unwrap();
    let plain = info
        .cache_params(CTX, 1, GgmlType::F16, GgmlType::F16, false)
        .unwrap();
    let mut plain = SeedCache::new(plain).unwrap();
    assert!(store.restore(&mut plain, 0, &tokens, None).is_err());
}
