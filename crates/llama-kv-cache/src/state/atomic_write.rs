//! Atomic file replacement that leaves no temporary files behind, even when the writer is killed.
//!
//! A save writes `.NAME.tmp-PID-NANOS` next to the target, syncs it and renames it over the
//! target. The writer holds an exclusive advisory lock (`flock` / `LockFileEx`, through `fs4`)
//! on its temporary file from creation to rename. The OS drops that lock when the process dies,
//! however it dies (`kill -9` included), so a temporary file that can be locked belongs to no
//! live writer: every save first removes such stale files of the same target. A file whose
//! lock is held (another process saving the same path right now) is left alone.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use fs4::fs_std::FileExt;

use crate::error::{KvError, Result};

/// The prefix of the temporary files of `name`.
fn temp_prefix(name: &str) -> String {
    format!(".{name}.tmp-")
}

/// Removes the temporary files of `name` in `dir` that no live writer holds. Best effort: a
/// file that cannot be opened, locked or removed is left for a later save.
pub fn remove_stale_temps(dir: &Path, name: &str) {
    let prefix = temp_prefix(name);
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        if !file_name.to_string_lossy().starts_with(&prefix) {
            continue;
        }
        let path = entry.path();
        let Ok(file) = fs::OpenOptions::new().read(true).open(&path) else {
            continue;
        };
        // locked: a live writer; unlocked: its writer died (or is between creating the file
        // and locking it, which `create_locked` detects and retries)
        if file.try_lock_exclusive().unwrap_or(false) {
            let _ = fs::remove_file(&path);
        }
    }
}

/// Whether `path` still names the open `file` (a cleaner may have removed it before we locked).
fn still_named(path: &Path, file: &fs::File) -> bool {
    let (Ok(on_disk), Ok(open)) = (fs::metadata(path), file.metadata()) else {
        return false;
    };
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        on_disk.dev() == open.dev() && on_disk.ino() == open.ino()
    }
    #[cfg(not(unix))]
    {
        on_disk.len() == open.len()
    }
}

/// Creates a fresh temporary file for `name` in `dir`, locked by this process.
fn create_locked(dir: &Path, name: &str, target: &Path) -> Result<(PathBuf, fs::File)> {
    let io =
        |what: &str, e: std::io::Error| KvError::Io(format!("{what} {}: {e}", target.display()));
    for _ in 0..8 {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let tmp = dir.join(format!(
            "{}{}-{nanos}",
            temp_prefix(name),
            std::process::id()
        ));
        // readable too: a writer may map the file to assemble it in place
        let file = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(|e| io("cannot create a temporary file next to", e))?;
        file.lock_exclusive()
            .map_err(|e| io("cannot lock the temporary file of", e))?;
        if still_named(&tmp, &file) {
            return Ok((tmp, file));
        }
        // a concurrent save took it for a dead writer's file and removed it: try a new name
    }
    Err(KvError::Io(format!(
        "cannot create a temporary file next to {}: removed by concurrent saves each time",
        target.display()
    )))
}

/// Writes `bytes` to `path` atomically: a locked temporary file in the same directory, flushed
/// and synced, then renamed over the target. On any failure the previous file is left intact
/// and the temporary file removed; temporary files of writers that died are removed first.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_replacing(path, Durability::Synced, bytes)
}

/// Whether a file written whole is also flushed to the disk before it replaces the target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durability {
    /// Synced, then renamed, and the directory synced: survives a power loss.
    Synced,
    /// Renamed only: readers never see half a file, but a power loss may lose it. For files a
    /// reader loads at once and removes (a state handed to a peer that takes only paths),
    /// where a sync costs most of the write.
    Unsynced,
}

/// [`write_atomic`] with a choice of [`Durability`].
pub fn write_replacing(path: &Path, durability: Durability, bytes: &[u8]) -> Result<()> {
    write_replacing_file(path, durability, &mut |f| {
        f.write_all(bytes)
            .map_err(|e| KvError::Io(format!("cannot write {}: {e}", path.display())))
    })
}

/// [`write_atomic`] with the content streamed by `fill` into a buffered writer, so a large file
/// never has to be assembled in memory first.
pub fn write_atomic_with(
    path: &Path,
    fill: &mut dyn FnMut(&mut dyn Write) -> Result<()>,
) -> Result<()> {
    write_atomic_file(path, &mut |f| {
        let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
        fill(&mut w)?;
        w.flush()
            .map_err(|e| KvError::Io(format!("cannot write {}: {e}", path.display())))
    })
}

/// [`write_atomic_with`] for a writer that needs the file itself (to write at offsets): `fill`
/// gets the temporary file, positioned at its start, and the file replaces `path` only once
/// `fill` succeeded and the bytes are synced.
pub fn write_atomic_file(
    path: &Path,
    fill: &mut dyn FnMut(&mut fs::File) -> Result<()>,
) -> Result<()> {
    write_replacing_file(path, Durability::Synced, fill)
}

/// [`write_atomic_file`] with a choice of [`Durability`].
pub fn write_replacing_file(
    path: &Path,
    durability: Durability,
    fill: &mut dyn FnMut(&mut fs::File) -> Result<()>,
) -> Result<()> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .ok_or_else(|| KvError::InvalidArg(format!("{} is not a file path", path.display())))?
        .to_string_lossy()
        .into_owned();
    remove_stale_temps(dir, &name);
    let (tmp, mut f) = create_locked(dir, &name, path)?;
    let io = |what: &str, e: std::io::Error| KvError::Io(format!("{what} {}: {e}", path.display()));
    let result = (|| -> Result<()> {
        fill(&mut f)?;
        let synced = durability == Durability::Synced;
        if synced {
            f.sync_all().map_err(|e| io("cannot sync", e))?;
        }
        fs::rename(&tmp, path).map_err(|e| io("cannot replace", e))?;
        if let (true, Ok(d)) = (synced, fs::File::open(dir)) {
            let _ = d.sync_all();
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    // the lock goes with the file handle
    drop(f);
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temps(dir: &Path, name: &str) -> Vec<String> {
        fs::read_dir(dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(&temp_prefix(name)))
            .collect()
    }

    fn scratch(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "kv-atomic-{tag}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn regression_stale_temp_files_of_dead_writers_are_removed_by_the_next_save() {
        let dir = scratch("stale");
        let target = dir.join("s.ggsn");
        // what a writer killed mid-save leaves: an unlocked temp file (an old pid's name)
        fs::write(dir.join(".s.ggsn.tmp-999999-1"), vec![7u8; 1 << 16]).unwrap();
        fs::write(dir.join(".other.ggsn.tmp-999999-1"), b"x").unwrap();
        write_atomic(&target, b"new").unwrap();
        assert_eq!(fs::read(&target).unwrap(), b"new");
        assert!(temps(&dir, "s.ggsn").is_empty());
        assert_eq!(
            temps(&dir, "other.ggsn").len(),
            1,
            "other targets' files are not touched"
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_temp_file_whose_writer_is_alive_is_left_alone() {
        let dir = scratch("live");
        let target = dir.join("s.ggsq");
        let (tmp, live) = create_locked(&dir, "s.ggsq", &target).unwrap();
        write_atomic(&target, b"a").unwrap();
        assert!(tmp.exists(), "a locked temp file belongs to a live writer");
        drop(live);
        write_atomic(&target, b"b").unwrap();
        assert!(!tmp.exists());
        assert_eq!(fs::read(&target).unwrap(), b"b");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_failed_save_keeps_the_old_file_and_leaves_no_temp() {
        let dir = scratch("fail");
        let target = dir.join("t");
        write_atomic(&target, b"old").unwrap();
        // renaming a file over a non-empty directory fails
        let blocked = dir.join("d");
        fs::create_dir_all(blocked.join("x")).unwrap();
        assert!(matches!(
            write_atomic(&blocked, b"new"),
            Err(KvError::Io(_))
        ));
        assert!(temps(&dir, "d").is_empty());
        assert_eq!(fs::read(&target).unwrap(), b"old");
        fs::remove_dir_all(&dir).unwrap();
    }
}
