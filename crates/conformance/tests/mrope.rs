//! An M-RoPE model (a tiny Qwen2-VL) against llama.cpp 0.1.161: a cache built from the model
//! keeps each cell's extension as 0.1.161 does. Placing the prompts the peer decoded gives the
//! cells of the peer's own session, extension and all; the peer's files load with every cell's
//! `x, y, tok`; what we write after `seqCp` and defrag continues in the peer with its next
//! token; and positions cannot be shifted, as in the peer.

use conformance::models_dir;
use conformance::today::{specs, Spec, CTX};
use llama_kv_cache::state::files::inspect_bytes;
use llama_kv_cache::{
    CellExt, CellExtValue, ConvertOptions, FileKind, KvError, ModelInfo, ReadOptions, SeedCache,
    UBatch, WriteOptions,
};

fn spec(name: &str) -> Spec {
    specs().into_iter().find(|s| s.name == name).unwrap()
}

/// A cache for the spec's model as llama.cpp sizes it.
fn model_cache(spec: &Spec) -> SeedCache {
    let info = ModelInfo::from_file(&models_dir().join(spec.model), false).unwrap();
    assert_eq!(info.cell_ext, CellExt::Pos2Tok, "{}", spec.model);
    let (tk, tv) = (
        llama_kv_cache::GgmlType::from_id(spec.types.0).unwrap(),
        llama_kv_cache::GgmlType::from_id(spec.types.1).unwrap(),
    );
    let p = info
        .cache_params(CTX, spec.prompts.len() as u32, tk, tv, spec.fa)
        .unwrap();
    assert!(p.mrope && !p.can_shift);
    SeedCache::new(p).unwrap()
}

/// Today's files: session 11, sequence 4.
fn v(version: u32) -> WriteOptions {
    WriteOptions {
        version: Some(version),
        ..WriteOptions::default()
    }
}

/// 0.1.161's extension of a text token: its position as x and y, and the token.
fn text_ext(pos: i32, tok: i32) -> CellExtValue {
    CellExtValue {
        x: pos,
        y: pos,
        tok,
    }
}

#[test]
fn placing_the_peers_batch_gives_the_cells_of_its_session_extensions_and_all() {
    let spec = spec("qwen2vl-par2");
    let mut c = model_cache(&spec);
    // the driver decodes every prompt in one batch, sequence after sequence
    let (mut pos, mut ids, mut ext) = (Vec::new(), Vec::new(), Vec::new());
    for (s, prompt) in spec.prompts.iter().enumerate() {
        for (p, &tok) in prompt.iter().enumerate() {
            pos.push(p as i32);
            ids.push(vec![s as i32]);
            ext.push(text_ext(p as i32, tok));
        }
    }
    let mut ub = UBatch::per_token(pos, ids);
    ub.ext = ext;
    c.find_slot(&ub).unwrap().unwrap();
    let ours = c
        .session_file_bytes(&spec.prompts.concat(), "qwen2vl", None, v(11), None)
        .unwrap();
    let theirs = std::fs::read(spec.session_path()).unwrap();
    let (ours, theirs) = (
        inspect_bytes(&ours).unwrap(),
        inspect_bytes(&theirs).unwrap(),
    );
    assert_eq!(theirs.payload.ext, CellExt::Pos2Tok);
    assert_eq!(ours.payload.ext, CellExt::Pos2Tok);
    assert_eq!(
        ours.payload.streams[0].cells, theirs.payload.streams[0].cells,
        "cell metadata (positions, sequences, extensions)"
    );
}

#[test]
fn the_peers_files_load_with_every_cells_extension() {
    let spec = spec("qwen2vl-par2");
    let session = std::fs::read(spec.session_path()).unwrap();
    let mut c = model_cache(&spec);
    c.load_session_bytes(&session, ReadOptions::default(), None)
        .unwrap();
    let mut seen = 0;
    for i in 0..c.size() {
        let cell = c.cell(i).unwrap();
        if cell.seqs.is_empty() {
            continue;
        }
        let seq = cell.seqs.iter().next().unwrap();
        let tok = spec.prompts[seq][cell.pos as usize];
        assert_eq!(cell.ext, text_ext(cell.pos, tok), "cell {i}");
        seen += 1;
    }
    assert_eq!(seen, spec.prompts.concat().len());

    // the sequence file into the other slot: its cells, its extensions
    let sequence = std::fs::read(spec.sequence_path()).unwrap();
    let loaded = c
        .load_sequence_bytes(&sequence, 0, ReadOptions::default(), None)
        .unwrap();
    let prompt = &spec.prompts[spec.seq as usize];
    for (k, &cell) in loaded.summary.placed.iter().enumerate() {
        let cell = c.cell(cell).unwrap();
        assert_eq!(cell.ext, text_ext(k as i32, prompt[k]));
        assert!(cell.seqs.contains(0));
    }

    // positions cannot move, as 0.1.161 asserts; nothing changes
    let before = c.cell_columns().unwrap();
    let e = c.seq_add(0, 0, -1, -2).unwrap_err();
    assert!(matches!(e, KvError::Unsupported(_)), "{e}");
    assert_eq!(c.cell_columns().unwrap(), before);
}

#[test]
fn what_we_write_after_seq_cp_and_defrag_continues_in_the_peer() {
    let spec = spec("qwen2vl-par2");
    let sidecar = spec.sidecar().unwrap();
    let mut c = model_cache(&spec);
    let session = std::fs::read(spec.session_path()).unwrap();
    c.load_session_bytes(&session, ReadOptions::default(), None)
        .unwrap();
    // sequence 1 copied into a scratch spot and back, with a hole before it compacted away
    let seq = spec.seq;
    let other = 1 - seq;
    c.seq_rm(other, -1, -1).unwrap();
    c.defrag_now(llama_kv_cache::DEFAULT_MAX_NODES).unwrap();
    c.seq_cp(seq, other, -1, -1).unwrap();
    c.seq_rm(seq, -1, -1).unwrap();
    let prompt = &spec.prompts[seq as usize];
    let file = c.sequence_file_bytes(other, prompt, v(4), None).unwrap();
    // the peer restores it into the sequence it came from
    let file = llama_kv_cache::convert_bytes(
        &file,
        &ConvertOptions {
            as_seq: Some(seq),
            to: Some(FileKind::Sequence),
            write: v(4),
            ..ConvertOptions::default()
        },
    )
    .unwrap();
    assert!(
        file == std::fs::read(spec.sequence_path()).unwrap(),
        "not the peer's own sequence file"
    );
    let dir = std::env::temp_dir().join(format!("today-mrope-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("moved.ggsq");
    std::fs::write(&path, &file).unwrap();
    let token = sidecar["next"][seq as usize].as_i64().unwrap();
    let next = spec
        .continue_file(&path, Some(seq), token, prompt.len())
        .unwrap();
    assert_eq!(next, sidecar["next2"][seq as usize].as_i64().unwrap());
    let _ = std::fs::remove_dir_all(&dir);
}
