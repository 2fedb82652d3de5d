//! The prompt store and llama.cpp 0.1.161's files: `put_file` ingests a session v11 / sequence v4
//! file, `write_file` writes the stored prefix as one, and 0.1.161 continues it with its own next
//! token. A rotated file is refused with a typed error (the store's blocks do not record the
//! rotation), never stored as if it were not rotated.

use std::sync::Arc;

use llama_kv_cache::{FileKind, Layout};
use prompt_store::{MemoryBackend, PromptStore, StoreError, WriteFileOptions};
use today_peer::specs;

#[test]
fn the_prompt_store_ingests_v11_and_v4_files_and_writes_them_for_llama_cpp_0_1_161() {
    let dir = std::env::temp_dir().join(format!("today-store-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let spec = specs()
        .into_iter()
        .find(|s| s.name == "h16-f16-long")
        .unwrap();
    let sidecar = spec.sidecar().unwrap();
    for (input, kind, version) in [
        (spec.session_path(), FileKind::Session, 11),
        (spec.sequence_path(), FileKind::Sequence, 4),
    ] {
        // blocks of 16 tokens: the 17-token prompt is one full block
        let store = PromptStore::new(Arc::new(MemoryBackend::new(None)), "llama-h16", 16).unwrap();
        let put = store.put_file(&input, None).unwrap();
        assert_eq!(put.tokens, 16, "{}", input.display());
        let out = dir.join(format!("stored-v{version}"));
        let opts = WriteFileOptions {
            kind,
            version: Some(version),
            layout: Layout::StreamsRot,
            ..WriteFileOptions::default()
        };
        let n = store
            .write_file(&spec.prompts[0], &out, &opts, None)
            .unwrap();
        assert_eq!(n, 16);
        let ins =
            llama_kv_cache::state::files::inspect_bytes(&std::fs::read(&out).unwrap()).unwrap();
        assert_eq!(ins.header.version, version);
        // the stored prefix is the prompt's first 16 tokens: continuing with the 17th gives
        // the peer's own next token
        let dest = (kind == FileKind::Sequence).then_some(0);
        let got = spec
            .continue_file(&out, dest, spec.prompts[0][16].into(), 16)
            .unwrap();
        assert_eq!(
            got,
            sidecar["next"][0].as_i64().unwrap(),
            "v{version} from the store"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_rotated_v11_file_is_refused_by_the_prompt_store_not_stored_unrotated() {
    let spec = specs()
        .into_iter()
        .find(|s| s.name == "h64-q8_0-fa")
        .unwrap();
    let store = PromptStore::new(Arc::new(MemoryBackend::new(None)), "llama-h64", 16).unwrap();
    let e = store.put_file(&spec.session_path(), None).unwrap_err();
    assert!(
        matches!(
            e,
            StoreError::Cache(llama_kv_cache::KvError::Unsupported(_))
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("nRotK 64"), "{e}");
    assert_eq!(store.lookup(&spec.prompts[0]).unwrap(), 0);
}
