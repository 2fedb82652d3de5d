//! Files we write, run through llama.cpp 0.1.161 itself: every fixture converted by us (each
//! memory part through a cache of its own) loads into the peer, and its next greedy token is
//! the one the peer produced when it wrote the fixture (`next2` in the sidecar).

use llama_kv_cache::files::convert_bytes;
use llama_kv_cache::{ConvertOptions, FileKind, WriteOptions};
use today_peer::specs;

fn temp_dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("today-peer-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn sidecar_token(v: &serde_json::Value, key: &str, seq: i32) -> i64 {
    v[key][seq as usize].as_i64().unwrap()
}

#[test]
fn the_peer_continues_files_we_write_with_its_own_next_token() {
    let dir = temp_dir();
    for spec in specs() {
        let sidecar = spec.sidecar().unwrap();
        let session = std::fs::read(spec.session_path()).unwrap();
        let sequence = std::fs::read(spec.sequence_path()).unwrap();
        // a context that is not kv_unified writes one stream per sequence
        let n_stream = if spec.unified { 1 } else { spec.prompts.len() as u32 };
        let v11 = WriteOptions {
            version: Some(11),
            n_stream,
            ..WriteOptions::default()
        };
        let v4 = WriteOptions {
            version: Some(4),
            n_stream,
            ..WriteOptions::default()
        };

        // the session, every part loaded into our caches and written back: the same bytes
        let ours = convert_bytes(
            &session,
            &ConvertOptions {
                write: v11,
                ..Default::default()
            },
        )
        .unwrap_or_else(|e| panic!("t161-{}: {e}", spec.name));
        assert!(ours == session, "t161-{}: our session differs", spec.name);
        let path = dir.join(format!("{}.ggsn", spec.name));
        std::fs::write(&path, &ours).unwrap();
        let pos = spec.prompts[0].len();
        let next = spec
            .continue_file(&path, None, sidecar_token(&sidecar, "next", 0), pos)
            .unwrap_or_else(|e| panic!("t161-{} session: {e}", spec.name));
        assert_eq!(next, sidecar_token(&sidecar, "next2", 0), "t161-{} session", spec.name);

        // a sequence file we extract from the session (every part, cells of that sequence)
        let extracted = convert_bytes(
            &session,
            &ConvertOptions {
                write: v4,
                extract_seq: Some(spec.seq),
                to: Some(FileKind::Sequence),
                ..Default::default()
            },
        )
        .unwrap_or_else(|e| panic!("t161-{} extract: {e}", spec.name));
        let path = dir.join(format!("{}.ggsq", spec.name));
        std::fs::write(&path, &extracted).unwrap();
        let pos = spec.prompts[spec.seq as usize].len();
        let token = sidecar_token(&sidecar, "next", spec.seq);
        let next = spec
            .continue_file(&path, Some(spec.seq), token, pos)
            .unwrap_or_else(|e| panic!("t161-{} extracted sequence: {e}", spec.name));
        assert_eq!(
            next,
            sidecar_token(&sidecar, "next2", spec.seq),
            "t161-{} extracted sequence",
            spec.name
        );

        // the peer's own sequence file, rewritten by us: the same bytes, and it continues
        let rewritten = convert_bytes(
            &sequence,
            &ConvertOptions {
                write: v4,
                ..Default::default()
            },
        )
        .unwrap_or_else(|e| panic!("t161-{} sequence: {e}", spec.name));
        assert!(rewritten == sequence, "t161-{}: our sequence file differs", spec.name);
        let next = spec
            .continue_file(&spec.sequence_path(), Some(spec.seq), token, pos)
            .unwrap_or_else(|e| panic!("t161-{} sequence fixture: {e}", spec.name));
        assert_eq!(next, sidecar_token(&sidecar, "next2", spec.seq), "t161-{} sequence", spec.name);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
