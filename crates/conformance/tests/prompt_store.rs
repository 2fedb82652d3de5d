//! The prompt store and llama.cpp 0.1.161's files: `put_file` ingests a session v11 / sequence v4
//! file, `write_file` writes the stored prompt as one, and 0.1.161 continues it with its own
//! tokens. A rotated file is stored with its rotation (part of the store's fingerprint) and
//! written back rotated.

use std::sync::Arc;

mod common;

use common::today_file;
use conformance::today::specs;
use llama_kv_cache::FileKind;
use prompt_store::{MemoryBackend, PromptStore};

/// Ingests both fixture files of `spec` into fresh stores, writes each back as the same kind
/// of today's version, and checks that 0.1.161 continues it with its own tokens: the store
/// keeps the whole prompt (its full 16-token blocks and the partial last one), so decoding the
/// peer's `next` after it gives the peer's `next2`.
fn round_trip_through_the_store(spec_name: &str, model: &str) -> Vec<prompt_store::Shape> {
    let dir = std::env::temp_dir().join(format!("today-store-{}-{spec_name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let spec = specs().into_iter().find(|s| s.name == spec_name).unwrap();
    let sidecar = spec.sidecar().unwrap();
    let prompt = &spec.prompts[0];
    let mut shapes = Vec::new();
    for (input, kind, version) in [
        (spec.session_path(), FileKind::Session, 11),
        (spec.sequence_path(), FileKind::Sequence, 4),
    ] {
        let store = PromptStore::new(Arc::new(MemoryBackend::new(None)), model, 16).unwrap();
        let put = store.put_file(&input, None).unwrap();
        assert_eq!(put.tokens, prompt.len() as u64, "{}", input.display());
        let out = dir.join(format!("stored-v{version}"));
        let opts = today_file(kind, version);
        let n = store.write_file(prompt, &out, &opts, None).unwrap();
        assert_eq!(n, prompt.len() as u64);
        let ins =
            llama_kv_cache::state::files::inspect_bytes(&std::fs::read(&out).unwrap()).unwrap();
        assert_eq!(ins.header.version, version);
        assert_eq!(
            (ins.payload.streams[0].n_rot, spec.n_rot),
            (Some(spec.n_rot), spec.n_rot),
            "the rotation is kept and recorded"
        );
        let dest = (kind == FileKind::Sequence).then_some(0);
        let got = spec
            .continue_file(
                &out,
                dest,
                sidecar["next"][0].as_i64().unwrap(),
                prompt.len(),
            )
            .unwrap();
        assert_eq!(
            got,
            sidecar["next2"][0].as_i64().unwrap(),
            "v{version} from the store"
        );
        shapes.push(store.shape().unwrap().unwrap());
    }
    let _ = std::fs::remove_dir_all(&dir);
    shapes
}

#[test]
fn the_prompt_store_ingests_v11_and_v4_files_and_writes_them_for_llama_cpp_0_1_161() {
    for shape in round_trip_through_the_store("h16-f16-long", "llama-h16") {
        assert_eq!(shape.main.unwrap().rot, (0, 0));
    }
}

#[test]
fn a_rotated_v11_file_is_stored_with_its_rotation_and_written_back_rotated() {
    for shape in round_trip_through_the_store("h64-q8_0-fa", "llama-h64") {
        assert_eq!(shape.main.unwrap().rot, (64, 64));
    }
}
