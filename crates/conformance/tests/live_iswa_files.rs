//! llama.cpp 0.1.161's own iSWA files and our live iSWA cache: the peer's session and sequence
//! files (gemma3-like model, f16 and rotated q8_0 with flash attention) load into a live
//! `IswaCache` built from the model as 0.1.161 builds its memory, and write back byte for byte;
//! a session edited live (its last token removed from both parts) continues in the peer with
//! the token the peer itself predicted after the whole prompt.

use conformance::models_dir;
use conformance::today::{spec_named, Spec};
use llama_kv_cache::state::files::{header_bytes, inspect_bytes, session_prefix, FileKind};
use llama_kv_cache::{IswaCache, IswaParams, Layout, Memory, ModelInfo};

fn cache_for(spec: &Spec) -> IswaCache {
    let info = ModelInfo::from_file(&models_dir().join(spec.model), false)
        .unwrap_or_else(|e| panic!("{e} (set-up: node scripts/setup.mjs)"));
    let p = IswaParams::for_model(&info, &spec.context_params()).unwrap();
    assert_eq!(
        (p.params.n_rot_k, p.params.n_rot_v),
        spec.n_rot,
        "t161-{}",
        spec.name
    );
    IswaCache::new(p).unwrap()
}

fn payload(path: &std::path::Path) -> (Vec<u8>, usize) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let ins = inspect_bytes(&bytes).unwrap();
    (bytes, ins.payload_offset)
}

const SPECS: [&str; 2] = ["gemma3-swa", "gemma3-swa-q8_0-fa"];

#[test]
fn the_peers_iswa_files_load_live_and_write_back_byte_for_byte() {
    for name in SPECS {
        let spec = spec_named(name);
        let (session, at) = payload(&spec.session_path());
        let mut cache = cache_for(&spec);
        cache
            .state_read(&session[at..], -1, Layout::StreamsRot)
            .unwrap();
        let again = cache.state_write(-1, Layout::StreamsRot).unwrap();
        assert!(
            again == session[at..],
            "t161-{name}: the session payload differs"
        );

        let (seq_file, at) = payload(&spec.sequence_path());
        let mut fresh = cache_for(&spec);
        fresh
            .state_read(&seq_file[at..], spec.seq, Layout::StreamsRot)
            .unwrap();
        let again = fresh.state_write(spec.seq, Layout::StreamsRot).unwrap();
        assert!(
            again == seq_file[at..],
            "t161-{name}: the sequence payload differs"
        );
    }
}

#[test]
fn a_session_edited_live_continues_in_the_peer() {
    let dir = std::env::temp_dir().join(format!("live-iswa-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for name in SPECS {
        let spec = spec_named(name);
        let (session, at) = payload(&spec.session_path());
        let mut cache = cache_for(&spec);
        cache
            .state_read(&session[at..], -1, Layout::StreamsRot)
            .unwrap();
        let prompt = &spec.prompts[0];
        let last = prompt.len() as i32 - 1;
        cache.seq_rm(0, last, -1).unwrap();
        assert_eq!(cache.seq_pos_max(0).unwrap(), last - 1);
        let ins = inspect_bytes(&session).unwrap();
        let tokens = &prompt[..last as usize];
        let mut file = header_bytes(FileKind::Session, ins.header.version, tokens);
        file.extend(session_prefix("gemma3", None, Layout::StreamsRot));
        file.extend(cache.state_write(-1, Layout::StreamsRot).unwrap());
        let path = dir.join(format!("{name}.ggsn"));
        std::fs::write(&path, &file).unwrap();
        let sidecar: serde_json::Value = serde_json::from_slice(
            &std::fs::read(spec.session_path().with_extension("json")).unwrap(),
        )
        .unwrap();
        let next = spec
            .continue_file(&path, None, i64::from(prompt[last as usize]), last as usize)
            .unwrap_or_else(|e| panic!("t161-{name}: {e}"));
        assert_eq!(next, sidecar["next"][0].as_i64().unwrap(), "t161-{name}");
    }
    std::fs::remove_dir_all(&dir).ok();
}
