//! The identity of a model's weights: BLAKE3 over every byte of the GGUF file
//! (`"blake3-file:<hex>"`, what `modelInfo(path, { hashFile: true })` reports), computed once
//! per file version and remembered in a cache directory keyed by the file's path, size and
//! modification time. Two fine-tunes of one base model differ in their tensor data only, so a
//! fingerprint of the header alone would give them one identity.

use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use crate::error::{KvError, Result};

/// Bytes read (and hashed) at a time: large enough for BLAKE3's SIMD over many chunks.
const READ: usize = 1 << 20;

/// Version of the cache entries' format.
const ENTRY: &str = "llama-kv-cache fingerprint v1";

/// BLAKE3 of every byte of the file at `path`, as `"blake3-file:<hex>"`.
pub fn hash_file(path: &Path) -> Result<String> {
    let io = |e: std::io::Error| KvError::Io(format!("cannot read {}: {e}", path.display()));
    let mut f = File::open(path).map_err(io)?;
    let mut hasher = blake3::Hasher::new();
    let mut buf = crate::alloc::zeroed(READ, "a read buffer")?;
    loop {
        let n = f.read(&mut buf).map_err(io)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(format!("blake3-file:{}", hasher.finalize().to_hex()))
}

/// What identifies one version of a file: canonical path, size, modification time (ns).
fn version_of(path: &Path) -> Result<(PathBuf, u64, u128)> {
    let io = |e: std::io::Error| KvError::Io(format!("cannot stat {}: {e}", path.display()));
    let canonical = fs::canonicalize(path).map_err(io)?;
    let meta = fs::metadata(&canonical).map_err(io)?;
    let mtime = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    Ok((canonical, meta.len(), mtime))
}

/// [`hash_file`], remembered in `cache_dir` (created if missing) per path, size and
/// modification time: a file is read whole once per version, and later calls cost a `stat`
/// and a small read. A cache that cannot be read or written only costs the hash again.
/// Returns the fingerprint and whether this call read the file.
pub fn cached_hash_file(path: &Path, cache_dir: &Path) -> Result<(String, bool)> {
    let (canonical, len, mtime) = version_of(path)?;
    let entry_path = cache_dir.join(format!(
        "{}.txt",
        &blake3::hash(canonical.as_os_str().as_encoded_bytes()).to_hex()[..32]
    ));
    let want = format!("{ENTRY}\n{}\n{len}\n{mtime}\n", canonical.display());
    if let Ok(text) = fs::read_to_string(&entry_path) {
        if let Some(fingerprint) = text.strip_prefix(&want) {
            let fingerprint = fingerprint.trim_end();
            if fingerprint.starts_with("blake3-file:") {
                return Ok((fingerprint.to_string(), false));
            }
        }
    }
    let fingerprint = hash_file(&canonical)?;
    // the file changed while it was hashed: do not remember a hash of a mix of versions
    if version_of(path)? == (canonical, len, mtime) {
        let _ = remember(cache_dir, &entry_path, &format!("{want}{fingerprint}\n"));
    }
    Ok((fingerprint, true))
}

/// Writes a cache entry whole (a temporary file renamed over it), so a reader never sees half.
fn remember(dir: &Path, entry: &Path, text: &str) -> std::io::Result<()> {
    fs::create_dir_all(dir)?;
    let tmp = entry.with_extension(format!("tmp.{}", std::process::id()));
    let result = File::create(&tmp)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .and_then(|_| fs::rename(&tmp, entry));
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cached_hash_is_reused_for_one_version_and_recomputed_for_the_next() {
        let dir = std::env::temp_dir().join(format!("kv-fingerprint-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let (file, cache) = (dir.join("m.gguf"), dir.join("cache"));
        fs::write(&file, vec![7u8; 3 << 20]).unwrap();
        let (first, read) = cached_hash_file(&file, &cache).unwrap();
        assert!(read);
        assert_eq!(first, hash_file(&file).unwrap());
        assert_eq!(fs::read_dir(&cache).unwrap().count(), 1);
        // a planted entry for this very version is what the next call returns: no re-hash
        let entry = fs::read_dir(&cache)
            .unwrap()
            .next()
            .unwrap()
            .unwrap()
            .path();
        let text = fs::read_to_string(&entry).unwrap();
        let planted = text.replace(&first, "blake3-file:planted");
        fs::write(&entry, planted).unwrap();
        assert_eq!(
            cached_hash_file(&file, &cache).unwrap(),
            ("blake3-file:planted".to_string(), false)
        );
        // one weight byte changed (and with it size or mtime): hashed again
        let mut bytes = fs::read(&file).unwrap();
        bytes[2 << 20] ^= 1;
        bytes.push(0);
        fs::write(&file, bytes).unwrap();
        let (second, _) = cached_hash_file(&file, &cache).unwrap();
        assert_eq!(second, hash_file(&file).unwrap());
        assert_ne!(second, first);
        // an unwritable cache costs only the hash
        let blocked = dir.join("blocked");
        fs::write(&blocked, b"a file, not a directory").unwrap();
        assert_eq!(cached_hash_file(&file, &blocked).unwrap().0, second);
        let _ = fs::remove_dir_all(&dir);
    }
}
