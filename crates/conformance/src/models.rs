//! The tiny models every suite of this crate loads, for both eras: written in one place,
//! `interop/make_models.py` (run by `node scripts/setup.mjs`, `npm test`'s set-up), into
//! `interop/models/`. Why there and not in Rust: the crate's README.

use std::path::{Path, PathBuf};

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Where `interop/make_models.py` writes the tiny models.
pub fn models_dir() -> PathBuf {
    repo_root().join("interop/models")
}

/// The path of the model `file`, or why it is not there.
pub fn model_path(file: &str) -> Result<PathBuf, String> {
    let path = models_dir().join(file);
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!(
            "{} is missing: interop/make_models.py writes it (`node scripts/setup.mjs`, which \
             `npm test` runs first)",
            path.display()
        ))
    }
}
