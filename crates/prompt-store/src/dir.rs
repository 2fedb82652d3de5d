//! `dir`: a directory of content-addressed block files, shared safely by several processes.
//!
//! ```text
//! DIR/blocks/ab/ab12…ef.kvb    one file per value, named by its key
//! DIR/tmp/                     values being written (renamed into blocks/ when whole)
//! DIR/usage                    bytes, blocks and evictions of the whole directory
//! DIR/lock                     an advisory lock (fs4) around publishing and eviction
//! ```
//!
//! Readers take no lock: a value appears by `rename`, which is atomic, and a value evicted while
//! being read stays readable through the open handle (or is simply a miss). Writers write the
//! file under `tmp/`, then take the lock to check the key is still absent, rename, update the
//! shared usage counter and, over the budget, evict the least recently used files (by
//! modification time, which every read refreshes) down to 90% of the budget so that eviction
//! scans are rare. Files are not fsynced: a block torn by a crash fails its checksum and is a
//! counted miss that the store removes, and the rename is still atomic.

use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

use fs4::fs_std::FileExt;

use llama_kv_cache::state::source::read_ahead;

use crate::backend::{Backend, Usage};
use crate::block::HEAD_BYTES;
use crate::error::{io_error, StoreError, StoreResult};
use crate::events::{EventHub, TierEvents};
use crate::key::Key;

/// Leftover temporary files older than this are removed by [`Backend::gc`] (a writer that
/// crashed mid-write).
const STALE_TMP: Duration = Duration::from_secs(3600);

/// A directory backend with an LRU byte budget.
pub struct DirBackend {
    root: PathBuf,
    max_bytes: Option<u64>,
    tmp_seq: AtomicU64,
    /// Where this process's evictions are reported, once someone observes this tier.
    events: OnceLock<Arc<TierEvents>>,
}

/// The shared counters in `DIR/usage`.
#[derive(Clone, Copy, Default)]
struct Counters {
    bytes: u64,
    blocks: u64,
    evictions: u64,
}

impl Counters {
    fn encode(&self) -> [u8; 24] {
        let mut b = [0u8; 24];
        b[..8].copy_from_slice(&self.bytes.to_le_bytes());
        b[8..16].copy_from_slice(&self.blocks.to_le_bytes());
        b[16..].copy_from_slice(&self.evictions.to_le_bytes());
        b
    }

    fn decode(b: &[u8]) -> Option<Counters> {
        if b.len() != 24 {
            return None;
        }
        let at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or([0; 8]));
        Some(Counters {
            bytes: at(0),
            blocks: at(8),
            evictions: at(16),
        })
    }
}

/// The lock on `DIR/lock`, held while publishing a value or evicting; released on drop.
struct DirLock(File);

impl Drop for DirLock {
    fn drop(&mut self) {
        let _ = FileExt::unlock(&self.0);
    }
}

impl DirBackend {
    /// Opens (creating it and its parents if needed) the store directory at `root`.
    pub fn open(root: impl Into<PathBuf>, max_bytes: Option<u64>) -> StoreResult<DirBackend> {
        let root = root.into();
        for d in [root.join("blocks"), root.join("tmp")] {
            fs::create_dir_all(&d).map_err(|e| {
                io_error(
                    format!("cannot create the store directory {}", d.display()),
                    &e,
                )
            })?;
        }
        let b = DirBackend {
            root,
            max_bytes,
            tmp_seq: AtomicU64::new(0),
            events: OnceLock::new(),
        };
        // make sure the lock file can be created now, rather than at the first put
        drop(b.lock()?);
        Ok(b)
    }

    /// The store directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The file that holds (or would hold) the value of `key`.
    pub fn path_of(&self, key: &Key) -> PathBuf {
        let hex = key.hex();
        self.root
            .join("blocks")
            .join(&hex[..2])
            .join(format!("{hex}.kvb"))
    }

    fn lock(&self) -> StoreResult<DirLock> {
        let path = self.root.join("lock");
        let f = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| io_error(format!("cannot open the lock file {}", path.display()), &e))?;
        f.lock_exclusive()
            .map_err(|e| io_error(format!("cannot lock {}", path.display()), &e))?;
        Ok(DirLock(f))
    }

    /// Reads the shared counters; a missing or torn file is recounted from the blocks.
    fn counters(&self) -> StoreResult<Counters> {
        let path = self.root.join("usage");
        match fs::read(&path) {
            Ok(b) => match Counters::decode(&b) {
                Some(c) => Ok(c),
                None => self.recount(0),
            },
            Err(e) if e.kind() == ErrorKind::NotFound => self.recount(0),
            Err(e) => Err(io_error(format!("cannot read {}", path.display()), &e)),
        }
    }

    fn save_counters(&self, c: &Counters) -> StoreResult<()> {
        let path = self.root.join("usage");
        let mut f = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| io_error(format!("cannot open {}", path.display()), &e))?;
        f.seek(SeekFrom::Start(0))
            .and_then(|_| f.write_all(&c.encode()))
            .and_then(|_| f.set_len(24))
            .map_err(|e| io_error(format!("cannot write {}", path.display()), &e))
    }

    /// Every block file with its size and last use, oldest first.
    fn scan(&self) -> StoreResult<Vec<(SystemTime, u64, PathBuf)>> {
        let blocks = self.root.join("blocks");
        let list = |d: &Path| {
            fs::read_dir(d).map_err(|e| io_error(format!("cannot list {}", d.display()), &e))
        };
        let mut files = Vec::new();
        for fan in list(&blocks)?.flatten() {
            let Ok(entries) = fs::read_dir(fan.path()) else {
                continue;
            };
            for e in entries.flatten() {
                // a file evicted by another process meanwhile is simply skipped
                if let Ok(m) = e.metadata() {
                    if m.is_file() {
                        let used = m.modified().unwrap_or(SystemTime::UNIX_EPOCH);
                        files.push((used, m.len(), e.path()));
                    }
                }
            }
        }
        files.sort();
        Ok(files)
    }

    /// Recounts from the files (under the lock, or when the counter file is unreadable).
    fn recount(&self, evictions: u64) -> StoreResult<Counters> {
        let files = self.scan()?;
        Ok(Counters {
            bytes: files.iter().map(|f| f.1).sum(),
            blocks: files.len() as u64,
            evictions,
        })
    }

    /// Evicts least recently used files until the store is at 90% of `max`. Called under the
    /// lock.
    fn evict(&self, max: u64, evictions: u64) -> StoreResult<Counters> {
        let files = self.scan()?;
        let mut c = Counters {
            bytes: files.iter().map(|f| f.1).sum(),
            blocks: files.len() as u64,
            evictions,
        };
        let target = max - max / 10;
        let events = self.events.get().filter(|e| e.wanted());
        for (_, len, path) in files {
            if c.bytes <= target {
                break;
            }
            if let Some(events) = events {
                report_eviction(events, &path);
            }
            match fs::remove_file(&path) {
                Ok(()) => {
                    c.bytes -= len;
                    c.blocks -= 1;
                    c.evictions += 1;
                }
                Err(e) if e.kind() == ErrorKind::NotFound => {}
                Err(e) => return Err(io_error(format!("cannot evict {}", path.display()), &e)),
            }
        }
        Ok(c)
    }

    /// Reads the value of `key` into `buf` (replacing its contents); false when absent.
    fn read_into(&self, key: &Key, buf: &mut Vec<u8>) -> StoreResult<bool> {
        let path = self.path_of(key);
        let mut f = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(io_error(format!("cannot open {}", path.display()), &e)),
        };
        buf.clear();
        f.read_to_end(buf)
            .map_err(|e| io_error(format!("cannot read {}", path.display()), &e))?;
        // a read is a use: the LRU order is the files' modification times (best effort: a
        // store shared by several users may not let us touch every file)
        let _ = f.set_modified(SystemTime::now());
        Ok(true)
    }

    fn write_tmp(&self, key: &Key, value: &[u8]) -> StoreResult<PathBuf> {
        let tmp = self.root.join("tmp").join(format!(
            "{}.{}.{}",
            key.hex(),
            std::process::id(),
            self.tmp_seq.fetch_add(1, Ordering::Relaxed)
        ));
        let result = File::create(&tmp).and_then(|mut f| f.write_all(value));
        if let Err(e) = result {
            let _ = fs::remove_file(&tmp);
            return Err(io_error(
                format!("cannot write a block to {}", self.root.display()),
                &e,
            ));
        }
        Ok(tmp)
    }

    fn publish(&self, key: &Key, tmp: &Path, len: u64) -> StoreResult<bool> {
        let target = self.path_of(key);
        let _lock = self.lock()?;
        if target.exists() {
            return Ok(false);
        }
        // counted before the rename: a missing counter file is recounted without this value
        let mut c = self.counters()?;
        if let Some(parent) = target.parent() {
            fs::create_dir_all(parent)
                .map_err(|e| io_error(format!("cannot create {}", parent.display()), &e))?;
        }
        fs::rename(tmp, &target)
            .map_err(|e| io_error(format!("cannot publish {}", target.display()), &e))?;
        c.bytes += len;
        c.blocks += 1;
        if let Some(max) = self.max_bytes.filter(|&m| c.bytes > m) {
            c = self.evict(max, c.evictions)?;
        }
        self.save_counters(&c)?;
        Ok(true)
    }
}

/// Reports the block file at `path` as evicted: its key from its name, its fingerprint from
/// its first bytes (a file another process removed meanwhile reads short and is not named).
fn report_eviction(events: &TierEvents, path: &Path) {
    let key = path
        .file_stem()
        .and_then(|s| s.to_str())
        .and_then(Key::from_hex);
    let mut head = [0u8; HEAD_BYTES];
    let read = File::open(path).and_then(|mut f| f.read_exact(&mut head));
    if let (Some(key), Ok(())) = (key, read) {
        events.evicted(&key, &head);
    }
}

impl Backend for DirBackend {
    fn name(&self) -> &'static str {
        "dir"
    }

    fn get_many(&self, keys: &[Key]) -> StoreResult<Vec<Option<Vec<u8>>>> {
        keys.iter()
            .map(|k| {
                let mut value = Vec::new();
                Ok(self.read_into(k, &mut value)?.then_some(value))
            })
            .collect()
    }

    /// Reads value `i + 1` on a second thread while `visit` uses value `i` (the core's
    /// `read_ahead`): the copy out of the page cache overlaps with the caller's work on the
    /// previous value (a restore's checksum and its copy into the cache), so on two cores a
    /// restore costs about what the reads alone cost, with two values in memory at most.
    fn visit_many(
        &self,
        keys: &[Key],
        visit: &mut dyn FnMut(usize, Option<&[u8]>) -> bool,
    ) -> StoreResult<()> {
        read_ahead(keys.len(), &|i, buf| self.read_into(&keys[i], buf), visit)
    }

    fn get_tails(&self, keys: &[Key], n: usize) -> StoreResult<Vec<Option<Vec<u8>>>> {
        keys.iter()
            .map(|k| {
                let path = self.path_of(k);
                let mut f = match File::open(&path) {
                    Ok(f) => f,
                    Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
                    Err(e) => return Err(io_error(format!("cannot open {}", path.display()), &e)),
                };
                let read = |f: &mut File| -> std::io::Result<Option<Vec<u8>>> {
                    if f.metadata()?.len() < n as u64 {
                        return Ok(None);
                    }
                    f.seek(SeekFrom::End(-(n as i64)))?;
                    let mut tail = vec![0; n];
                    f.read_exact(&mut tail)?;
                    Ok(Some(tail))
                };
                read(&mut f).map_err(|e| io_error(format!("cannot read {}", path.display()), &e))
            })
            .collect()
    }

    fn contains_many(&self, keys: &[Key]) -> StoreResult<Vec<bool>> {
        Ok(keys.iter().map(|k| self.path_of(k).is_file()).collect())
    }

    fn present_prefix(&self, keys: &[Key]) -> StoreResult<usize> {
        Ok(keys
            .iter()
            .take_while(|k| self.path_of(k).is_file())
            .count())
    }

    fn put_if_absent(&self, key: &Key, value: &[u8]) -> StoreResult<bool> {
        if self.path_of(key).is_file() {
            return Ok(false);
        }
        let tmp = self.write_tmp(key, value)?;
        let result = self.publish(key, &tmp, value.len() as u64);
        if !matches!(result, Ok(true)) {
            let _ = fs::remove_file(&tmp);
        }
        result
    }

    fn observe(&self, hub: &Arc<EventHub>) {
        let _ = self.events.set(hub.tier(self.name()));
    }

    fn remove(&self, key: &Key) -> StoreResult<()> {
        let path = self.path_of(key);
        let _lock = self.lock()?;
        let len = match fs::metadata(&path) {
            Ok(m) => m.len(),
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(io_error(format!("cannot stat {}", path.display()), &e)),
        };
        match fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(io_error(format!("cannot remove {}", path.display()), &e)),
        }
        let mut c = self.counters()?;
        c.bytes = c.bytes.saturating_sub(len);
        c.blocks = c.blocks.saturating_sub(1);
        self.save_counters(&c)
    }

    fn usage(&self) -> StoreResult<Usage> {
        let c = self.counters()?;
        Ok(Usage {
            blocks: c.blocks,
            bytes: c.bytes,
            evictions: c.evictions,
            max_bytes: self.max_bytes,
        })
    }

    fn gc(&self) -> StoreResult<Usage> {
        let _lock = self.lock()?;
        let tmp = self.root.join("tmp");
        let now = SystemTime::now();
        if let Ok(entries) = fs::read_dir(&tmp) {
            for e in entries.flatten() {
                let stale = e
                    .metadata()
                    .and_then(|m| m.modified())
                    .is_ok_and(|t| now.duration_since(t).unwrap_or_default() > STALE_TMP);
                if stale {
                    let _ = fs::remove_file(e.path());
                }
            }
        }
        let evictions = self.counters().map_or(0, |c| c.evictions);
        let c = match self.max_bytes {
            Some(max) => self.evict(max, evictions)?,
            None => self.recount(evictions)?,
        };
        self.save_counters(&c)?;
        Ok(Usage {
            blocks: c.blocks,
            bytes: c.bytes,
            evictions: c.evictions,
            max_bytes: self.max_bytes,
        })
    }
}

impl From<std::io::Error> for StoreError {
    fn from(e: std::io::Error) -> StoreError {
        io_error("store I/O".into(), &e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u8) -> Key {
        Key([i; 32])
    }

    /// `visit_many` reads ahead on a second thread: values arrive in order, absent ones as
    /// `None`, a visitor that stops early stops the reader, and a read error is returned.
    #[test]
    fn visit_many_reads_ahead_in_order_and_stops_or_fails_cleanly() {
        let d = tempfile::tempdir().unwrap();
        let b = DirBackend::open(d.path(), None).unwrap();
        for i in [0u8, 1, 3, 4] {
            b.put_if_absent(&key(i), &vec![i; 1000 + i as usize])
                .unwrap();
        }
        let keys: Vec<Key> = (0..5).map(key).collect();
        let mut seen = Vec::new();
        b.visit_many(&keys, &mut |i, v| {
            seen.push((i, v.map(|v| (v.len(), v[0]))));
            true
        })
        .unwrap();
        let want: Vec<_> = [0u8, 1, 2, 3, 4]
            .iter()
            .map(|&i| (i as usize, (i != 2).then_some((1000 + i as usize, i))))
            .collect();
        assert_eq!(seen, want);
        let mut calls = 0;
        b.visit_many(&keys, &mut |_, _| {
            calls += 1;
            calls < 2
        })
        .unwrap();
        assert_eq!(calls, 2, "stops when the visitor says so");
        // a directory where a value file should be: reading it fails
        let bad = b.path_of(&key(9));
        fs::create_dir_all(&bad).unwrap();
        let keys = [key(0), key(9), key(1)];
        let mut visited = Vec::new();
        let e = b
            .visit_many(&keys, &mut |i, _| {
                visited.push(i);
                true
            })
            .unwrap_err();
        assert!(matches!(e, StoreError::Io(_)), "{e}");
        assert_eq!(visited, [0]);
    }

    #[test]
    fn values_survive_reopening_and_are_stored_once() {
        let d = tempfile::tempdir().unwrap();
        let b = DirBackend::open(d.path(), None).unwrap();
        assert!(b.put_if_absent(&key(1), b"hello").unwrap());
        assert!(!b.put_if_absent(&key(1), b"other").unwrap());
        drop(b);
        let b = DirBackend::open(d.path(), None).unwrap();
        assert_eq!(
            b.get_many(&[key(1), key(2)]).unwrap(),
            [Some(b"hello".to_vec()), None]
        );
        let u = b.usage().unwrap();
        assert_eq!((u.blocks, u.bytes), (1, 5));
        assert_eq!(fs::read_dir(d.path().join("tmp")).unwrap().count(), 0);
    }

    #[test]
    fn the_budget_evicts_least_recently_read_files_first() {
        let d = tempfile::tempdir().unwrap();
        let b = DirBackend::open(d.path(), Some(100)).unwrap();
        let old = SystemTime::now() - Duration::from_secs(1000);
        for i in 0..4 {
            b.put_if_absent(&key(i), &[i; 25]).unwrap();
            // distinct, increasing use times without sleeping
            let f = File::options()
                .write(true)
                .open(b.path_of(&key(i)))
                .unwrap();
            f.set_modified(old + Duration::from_secs(i as u64)).unwrap();
        }
        b.get_many(&[key(0)]).unwrap(); // key 0 becomes the most recent
        b.put_if_absent(&key(9), &[9; 25]).unwrap(); // 125 > 100: evict down to <= 90
        let present = b
            .contains_many(&[key(0), key(1), key(2), key(3), key(9)])
            .unwrap();
        assert_eq!(present, [true, false, false, true, true]);
        let u = b.usage().unwrap();
        assert_eq!((u.blocks, u.bytes, u.evictions), (3, 75, 2));
        assert!(u.bytes <= 100);
    }

    #[test]
    fn remove_and_gc_keep_the_counters_exact() {
        let d = tempfile::tempdir().unwrap();
        let b = DirBackend::open(d.path(), None).unwrap();
        b.put_if_absent(&key(1), &[0; 10]).unwrap();
        b.put_if_absent(&key(2), &[0; 20]).unwrap();
        b.remove(&key(1)).unwrap();
        b.remove(&key(1)).unwrap();
        assert_eq!(b.usage().unwrap().bytes, 20);
        fs::write(d.path().join("usage"), b"torn").unwrap();
        assert_eq!(b.usage().unwrap().bytes, 20);
        fs::write(d.path().join("tmp").join("stale"), b"x").unwrap();
        let f = File::options()
            .write(true)
            .open(d.path().join("tmp").join("stale"))
            .unwrap();
        f.set_modified(SystemTime::now() - 2 * STALE_TMP).unwrap();
        let u = b.gc().unwrap();
        assert_eq!((u.blocks, u.bytes), (1, 20));
        assert_eq!(fs::read_dir(d.path().join("tmp")).unwrap().count(), 0);
    }

    #[test]
    fn a_missing_directory_is_a_typed_error_on_put() {
        let d = tempfile::tempdir().unwrap();
        let b = DirBackend::open(d.path().join("store"), None).unwrap();
        fs::remove_dir_all(d.path().join("store")).unwrap();
        let e = b.put_if_absent(&key(1), b"x").unwrap_err();
        assert!(matches!(e, StoreError::Io(_)), "{e:?}");
        assert_eq!(b.get_many(&[key(1)]).unwrap(), [None]);
    }

    #[test]
    fn threads_racing_on_one_key_store_one_whole_value() {
        let d = tempfile::tempdir().unwrap();
        let b = std::sync::Arc::new(DirBackend::open(d.path(), None).unwrap());
        let stored: usize = (0..8u8)
            .map(|i| {
                let b = b.clone();
                std::thread::spawn(move || b.put_if_absent(&key(7), &[i; 4096]).unwrap())
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().unwrap() as usize)
            .sum();
        assert_eq!(stored, 1);
        let v = b.get_many(&[key(7)]).unwrap().remove(0).unwrap();
        assert!(v.len() == 4096 && v.iter().all(|&x| x == v[0]));
        assert_eq!(b.usage().unwrap().blocks, 1);
    }
}
