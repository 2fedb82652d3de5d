//! What the prompt-store tests against llama.cpp 0.1.161 share.

use llama_kv_cache::{FileKind, Layout};
use prompt_store::WriteFileOptions;

/// `write_file` options for a file of today's llama.cpp: `kind` in `version`, the rotation
/// recorded.
pub fn today_file(kind: FileKind, version: u32) -> WriteFileOptions {
    WriteFileOptions {
        kind: Some(kind),
        version: Some(version),
        layout: Some(Layout::StreamsRot),
        ..WriteFileOptions::default()
    }
}
