//! State files built from live caches, shared by the store's tests and benches.

use llama_kv_cache::state::files::{header_bytes, FileKind};
use llama_kv_cache::{Layout, SeedCache};

/// A sequence file (today's version 4) of `tokens` whose payload is the parts' states of
/// sequence 0, in llama.cpp's order (a recurrent part stream-less, as llama.cpp writes it).
pub fn sequence_file(tokens: &[i32], parts: &[&SeedCache]) -> Vec<u8> {
    let mut out = header_bytes(FileKind::Sequence, 4, tokens);
    for c in parts {
        let layout = if c.recurrent() {
            Layout::Seed
        } else {
            Layout::StreamsRot
        };
        out.extend(c.state_write(0, layout, 1, None).unwrap());
    }
    out
}
