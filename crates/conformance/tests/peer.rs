//! Files we write, run through llama.cpp 0.1.161 itself: every fixture converted by us (each
//! memory part through a cache of its own) loads into the peer, and its next greedy token is
//! the one the peer produced when it wrote the fixture (`next2` in the sidecar).

use conformance::today::specs;
use llama_kv_cache::convert_bytes;
use llama_kv_cache::{ConvertOptions, FileKind, WriteOptions};

fn temp_dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("today-peer-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn sidecar_token(v: &serde_json::Value, key: &str, seq: i32) -> i64 {
    v[key][seq as usize].as_i64().unwrap()
}

/// Converts `input` with `opts`, writes the result to `dir/name`, and returns its path.
fn convert_to(
    dir: &std::path::Path,
    name: &str,
    input: &[u8],
    opts: ConvertOptions,
) -> (Vec<u8>, std::path::PathBuf) {
    let out = convert_bytes(input, &opts).unwrap_or_else(|e| panic!("{name}: {e}"));
    let path = dir.join(name);
    std::fs::write(&path, &out).unwrap();
    (out, path)
}

#[test]
fn the_peer_continues_files_we_write_with_its_own_next_token() {
    let dir = temp_dir();
    for spec in specs() {
        let sidecar = spec.sidecar().unwrap();
        let session = std::fs::read(spec.session_path()).unwrap();
        let sequence = std::fs::read(spec.sequence_path()).unwrap();
        // a context that is not kv_unified writes one stream per sequence
        let n_stream = if spec.unified {
            1
        } else {
            spec.prompts.len() as u32
        };
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
        let (ours, path) = convert_to(
            &dir,
            &format!("{}.ggsn", spec.name),
            &session,
            ConvertOptions {
                write: v11,
                ..Default::default()
            },
        );
        assert!(ours == session, "t161-{}: our session differs", spec.name);
        let pos = spec.prompts[0].len();
        let next = spec
            .continue_file(&path, None, sidecar_token(&sidecar, "next", 0), pos)
            .unwrap_or_else(|e| panic!("t161-{} session: {e}", spec.name));
        assert_eq!(
            next,
            sidecar_token(&sidecar, "next2", 0),
            "t161-{} session",
            spec.name
        );

        // a sequence file we extract from the session (every part, cells of that sequence)
        let (_, path) = convert_to(
            &dir,
            &format!("{}.ggsq", spec.name),
            &session,
            ConvertOptions {
                write: v4,
                extract_seq: Some(spec.seq),
                to: Some(FileKind::Sequence),
                ..Default::default()
            },
        );
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
        let (rewritten, _) = convert_to(
            &dir,
            &format!("{}-again.ggsq", spec.name),
            &sequence,
            ConvertOptions {
                write: v4,
                ..Default::default()
            },
        );
        assert!(
            rewritten == sequence,
            "t161-{}: our sequence file differs",
            spec.name
        );
        let next = spec
            .continue_file(&spec.sequence_path(), Some(spec.seq), token, pos)
            .unwrap_or_else(|e| panic!("t161-{} sequence fixture: {e}", spec.name));
        assert_eq!(
            next,
            sidecar_token(&sidecar, "next2", spec.seq),
            "t161-{} sequence",
            spec.name
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
