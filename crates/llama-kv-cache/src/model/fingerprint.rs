//! The identity of a model's weights: BLAKE3 over every byte of the GGUF file
//! (`"blake3-file:<hex>"`, what `modelInfo(path, { hashFile: true })` reports), computed once
//! per file version and remembered in a cache directory keyed by the file's path and the
//! metadata a rewrite changes (size, modification and change times, device, inode). Two
//! fine-tunes of one base model differ in their tensor data only, so a fingerprint of the
//! header alone would give them one identity.

use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::error::{KvError, Result};

/// Bytes read (and hashed) at a time: large enough for BLAKE3's SIMD over many chunks.
const READ: usize = 1 << 20;

/// Version of the cache entries' format.
const ENTRY: &str = "llama-kv-cache fingerprint v2";

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

/// One version of a file: its canonical path, the metadata any rewrite changes, and when it
/// last changed (ns since the epoch). Size and modification time alone are not enough: a file
/// rewritten in place with the same size and its old mtime put back (`touch -r`) keeps both,
/// but the kernel moves its change time (ctime), which no user can set, and a file replaced by
/// a rename has another inode.
#[derive(PartialEq, Eq)]
struct Version {
    canonical: PathBuf,
    metadata: String,
    changed_ns: i128,
}

fn version_of(path: &Path) -> Result<Version> {
    let io = |e: std::io::Error| KvError::Io(format!("cannot stat {}: {e}", path.display()));
    let canonical = fs::canonicalize(path).map_err(io)?;
    let meta = fs::metadata(&canonical).map_err(io)?;
    let nanos = |t: std::io::Result<SystemTime>| {
        t.ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos() as i128)
    };
    let mtime = nanos(meta.modified());
    let mut metadata = format!("size {}\nmtime {mtime}\n", meta.len());
    #[cfg(unix)]
    let changed_ns = {
        use std::os::unix::fs::MetadataExt;
        let ctime = meta.ctime() as i128 * 1_000_000_000 + meta.ctime_nsec() as i128;
        metadata += &format!("dev {}\ninode {}\nctime {ctime}\n", meta.dev(), meta.ino());
        ctime.max(mtime)
    };
    #[cfg(not(unix))]
    let changed_ns = {
        // std exposes no change time here; the creation time moves when a file is replaced
        let created = nanos(meta.created());
        metadata += &format!("created {created}\n");
        created.max(mtime)
    };
    Ok(Version {
        canonical,
        metadata,
        changed_ns,
    })
}

/// How long after its last change a file's version is trusted to identify its content.
/// Filesystems stamp times from a coarse clock (one scheduler tick, 1 to 10 ms), so a file
/// rewritten within one tick of a hash can keep every stamp; as git does with its "racily
/// clean" entries, a file changed this recently is hashed but not remembered.
pub const SETTLED: Duration = Duration::from_millis(100);

/// [`hash_file`], remembered in `cache_dir` (created if missing) per file version (path,
/// size, modification and change times, device and inode): a file is read whole once per
/// version, and later calls cost a `stat` and a small read. A cache that cannot be read or
/// written only costs the hash again. Returns the fingerprint and whether this call read the
/// file.
pub fn cached_hash_file(path: &Path, cache_dir: &Path) -> Result<(String, bool)> {
    remembered_hash(path, cache_dir, SETTLED)
}

/// [`cached_hash_file`], remembering only versions older than `settled` when the hash starts.
fn remembered_hash(path: &Path, cache_dir: &Path, settled: Duration) -> Result<(String, bool)> {
    let version = version_of(path)?;
    let entry_path = cache_dir.join(format!(
        "{}.txt",
        &blake3::hash(version.canonical.as_os_str().as_encoded_bytes()).to_hex()[..32]
    ));
    let want = format!(
        "{ENTRY}\n{}\n{}",
        version.canonical.display(),
        version.metadata
    );
    if let Ok(text) = fs::read_to_string(&entry_path) {
        if let Some(fingerprint) = text.strip_prefix(&want) {
            let fingerprint = fingerprint.trim_end();
            if fingerprint.starts_with("blake3-file:") {
                return Ok((fingerprint.to_string(), false));
            }
        }
    }
    let started = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i128);
    let fingerprint = hash_file(&version.canonical)?;
    let settled_before = started - settled.as_nanos() as i128;
    // a file changed while it was hashed, or too recently to tell a rewrite from it: do not
    // remember a hash that a later version could be taken for
    if version.changed_ns < settled_before && version_of(path)? == version {
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

    /// A fresh scratch folder for one test, with the paths of its model file and hash cache.
    fn scratch(name: &str) -> (PathBuf, PathBuf, PathBuf) {
        let dir =
            std::env::temp_dir().join(format!("kv-fingerprint-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let (file, cache) = (dir.join("m.gguf"), dir.join("cache"));
        (dir, file, cache)
    }

    #[test]
    fn a_cached_hash_is_reused_for_one_version_and_recomputed_for_the_next() {
        let (dir, file, cache) = scratch("reuse");
        fs::write(&file, vec![7u8; 3 << 20]).unwrap();
        let (first, read) = remembered_hash(&file, &cache, Duration::ZERO).unwrap();
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
            remembered_hash(&file, &cache, Duration::ZERO).unwrap(),
            ("blake3-file:planted".to_string(), false)
        );
        // one weight byte changed (and with it size or mtime): hashed again
        let mut bytes = fs::read(&file).unwrap();
        bytes[2 << 20] ^= 1;
        bytes.push(0);
        fs::write(&file, bytes).unwrap();
        let (second, _) = remembered_hash(&file, &cache, Duration::ZERO).unwrap();
        assert_eq!(second, hash_file(&file).unwrap());
        assert_ne!(second, first);
        // an unwritable cache costs only the hash
        let blocked = dir.join("blocked");
        fs::write(&blocked, b"a file, not a directory").unwrap();
        assert_eq!(
            remembered_hash(&file, &blocked, Duration::ZERO).unwrap().0,
            second
        );
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_model_rewritten_in_place_with_its_old_size_and_mtime_is_hashed_again() {
        let (dir, file, cache) = scratch("swap");
        fs::write(&file, vec![1u8; 64 << 10]).unwrap();
        let (old, _) = remembered_hash(&file, &cache, Duration::ZERO).unwrap();
        let first = version_of(&file).unwrap();
        let mtime = fs::metadata(&file).unwrap().modified().unwrap();
        // what `cp other.gguf m.gguf && touch -r backup m.gguf` does: same inode, same size,
        // the old mtime put back; written again until the coarse clock stamps another ctime
        loop {
            let mut f = fs::OpenOptions::new().write(true).open(&file).unwrap();
            f.write_all(&vec![2u8; 64 << 10]).unwrap();
            f.set_modified(mtime).unwrap();
            drop(f);
            if version_of(&file).unwrap().changed_ns != first.changed_ns {
                break;
            }
        }
        let meta = fs::metadata(&file).unwrap();
        assert_eq!((meta.len(), meta.modified().unwrap()), (64 << 10, mtime));
        let (new, read) = remembered_hash(&file, &cache, Duration::ZERO).unwrap();
        assert!(read, "the remembered hash of the old weights was served");
        assert_ne!(new, old);
        assert_eq!(new, hash_file(&file).unwrap());
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_file_changed_too_recently_to_tell_from_a_rewrite_is_hashed_but_not_remembered() {
        let (dir, file, cache) = scratch("racy");
        fs::write(&file, vec![3u8; 4096]).unwrap();
        let (fingerprint, read) = cached_hash_file(&file, &cache).unwrap();
        assert!(read);
        assert_eq!(fingerprint, hash_file(&file).unwrap());
        assert!(fs::read_dir(&cache).map_or(true, |d| d.count() == 0));
        let _ = fs::remove_dir_all(&dir);
    }
}
