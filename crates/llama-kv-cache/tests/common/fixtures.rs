//! The peer state files of `__test__/fixtures` (llama.node, node-llama-cpp) and its `t161/`
//! (llama.cpp 0.1.161).

use std::path::PathBuf;

/// The fixtures directory.
pub fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../__test__/fixtures")
}

/// Every session and sequence file of every peer, sorted.
pub fn all_fixtures() -> Vec<PathBuf> {
    let mut out = Vec::new();
    for dir in [fixture_dir(), fixture_dir().join("t161")] {
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if matches!(
                p.extension().and_then(|e| e.to_str()),
                Some("ggsn" | "ggsq")
            ) {
                out.push(p);
            }
        }
    }
    out.sort();
    assert!(
        out.len() >= 40,
        "fixtures missing in {}",
        fixture_dir().display()
    );
    out
}
