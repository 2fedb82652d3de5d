//! Staging memory for payloads that must outlive their owner's buffer (the Node binding's
//! async `stateRead` copies the caller's bytes at the call) or that leave for an owner that
//! frees them late (a `stateWrite` payload handed to JS, collected when the garbage collector
//! gets to it). Fresh memory pays a page fault (or a populate) per page and an unmap
//! afterwards, as much as the memcpy itself: at 500 MiB a copy took 236 ms where a memcpy into
//! pages already faulted in takes 50-70, and a 2 MiB `stateWrite` into fresh 4 KiB pages cost
//! 3x its copy. So:
//! - mappings handed back are kept, faulted in, for the next payload of about their size (a
//!   few of them, see [`KEEP`]), as allocators keep dirty pages;
//! - like jemalloc's decay, memory the program stopped using goes back to the OS: a mapping
//!   unused for [`IDLE`] is released by a background thread;
//! - a fresh mapping is sized in whole huge pages and advised for them, so the kernel faults
//!   in (and zeroes) 2 MiB at a time: a fresh 2 MiB payload took 214 us instead of 697 (the
//!   copy into warm pages: 145).

use std::ops::{Deref, DerefMut};
use std::sync::{Condvar, Mutex, MutexGuard, Once};
use std::time::{Duration, Instant};

use memmap2::MmapMut;

use crate::alloc::{
    advise_huge_pages, copy_bytes, map_zeroed, populate, zeroed, OwnedBytes, MAP_MIN,
};
use crate::error::Result;

/// How long a kept mapping waits for its next payload before it is released.
pub const IDLE: Duration = Duration::from_secs(5);

/// Payloads above this get a mapping of their own, released when the payload is dropped, and
/// the kept mappings hold no more than this in all: they must not hold many GiB of a rare huge
/// payload for [`IDLE`].
pub const MAX: usize = 2 << 30;

/// How many mappings are kept at most (an app that alternates a whole cache's state and a
/// sequence's finds both).
pub const KEEP: usize = 4;

/// A fresh mapping's size is a multiple of this (the x86-64 and arm64 huge page), so that the
/// kernel places it on a huge page boundary and can back it with huge pages.
const HUGE_PAGE: usize = 2 << 20;

/// A kept mapping and when it was handed back.
type Spare = (MmapMut, Instant);

static SPARES: Mutex<Vec<Spare>> = Mutex::new(Vec::new());

/// Wakes the releasing thread when a mapping is handed back.
static RETURNED: Condvar = Condvar::new();

static RELEASER: Once = Once::new();

/// Whether the releasing thread runs: without it a kept mapping would never be released, so
/// mappings are not kept then.
static RELEASING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn spares() -> MutexGuard<'static, Vec<Spare>> {
    // a panic while the lock was held left a valid list (each change is one push or removal)
    SPARES.lock().unwrap_or_else(|e| e.into_inner())
}

/// Starts the thread that releases mappings left unused for [`IDLE`], once per process.
fn start_releaser() -> bool {
    RELEASER.call_once(|| {
        let spawned = std::thread::Builder::new()
            .name("kv-staging-release".into())
            .spawn(|| {
                let mut s = spares();
                loop {
                    let longest = s.iter().map(|(_, since)| since.elapsed()).max();
                    match longest {
                        None => s = RETURNED.wait(s).unwrap_or_else(|e| e.into_inner()),
                        Some(idle) if idle >= IDLE => {
                            let (idle, kept) = std::mem::take(&mut *s)
                                .into_iter()
                                .partition::<Vec<_>, _>(|(_, since)| since.elapsed() >= IDLE);
                            *s = kept;
                            // unmapped without the lock: a payload meanwhile maps its own memory
                            drop(s);
                            drop(idle);
                            s = spares();
                        }
                        Some(idle) => {
                            s = RETURNED
                                .wait_timeout(s, IDLE - idle)
                                .unwrap_or_else(|e| e.into_inner())
                                .0
                        }
                    }
                }
            });
        RELEASING.store(spawned.is_ok(), std::sync::atomic::Ordering::Release);
    });
    RELEASING.load(std::sync::atomic::Ordering::Acquire)
}

/// Whether a kept mapping would take a payload of `len` bytes now.
pub fn has_spare(len: usize) -> bool {
    spares().iter().any(|(map, _)| fits(map, len))
}

/// Whether `map` may take a payload of `len` bytes (see [`take_spare`]).
fn fits(map: &MmapMut, len: usize) -> bool {
    (len..=2 * len.next_multiple_of(HUGE_PAGE)).contains(&map.len())
}

/// A kept mapping for `len` bytes: the smallest that holds them, unless even that one is more
/// than twice the size a fresh mapping would have (a small payload does not hold a large
/// mapping while its owner keeps it).
fn take_spare(len: usize) -> Option<MmapMut> {
    let mut s = spares();
    let (at, _) = s
        .iter()
        .enumerate()
        .filter(|(_, (map, _))| fits(map, len))
        .min_by_key(|(_, (map, _))| map.len())?;
    Some(s.swap_remove(at).0)
}

/// Keeps `map` for the next payload, releasing the least recently kept mappings beyond
/// [`KEEP`] or [`MAX`] bytes.
fn give_back(map: MmapMut) {
    let mut s = spares();
    s.push((map, Instant::now()));
    let mut released = Vec::new();
    while s.len() > KEEP || s.iter().map(|(m, _)| m.len()).sum::<usize>() > MAX {
        let oldest = (0..s.len()).min_by_key(|&i| s[i].1).unwrap_or(0);
        released.push(s.swap_remove(oldest));
    }
    drop(s);
    RETURNED.notify_one();
    drop(released);
}

/// A fresh mapping for `len` bytes, in whole huge pages, its first `len` bytes faulted in.
fn fresh_mapping(len: usize, what: &str) -> Result<MmapMut> {
    let mut map = map_zeroed(len.next_multiple_of(HUGE_PAGE), what)?;
    advise_huge_pages(&mut map);
    populate(&map, 0, len);
    Ok(map)
}

/// A payload in staging memory, handed back for the next payload when dropped.
pub struct Staged {
    bytes: OwnedBytes,
    len: usize,
    /// Whether `bytes` is a staging mapping to hand back (not a small or huge payload).
    kept: bool,
}

impl Deref for Staged {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

impl DerefMut for Staged {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.bytes[..self.len]
    }
}

impl AsRef<[u8]> for Staged {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

/// A payload already in memory of its own (today's memories write theirs into a `Vec`).
impl From<Vec<u8>> for Staged {
    fn from(bytes: Vec<u8>) -> Staged {
        Staged {
            len: bytes.len(),
            bytes: OwnedBytes::Heap(bytes),
            kept: false,
        }
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if !self.kept {
            return;
        }
        let OwnedBytes::Map(map) = std::mem::replace(&mut self.bytes, OwnedBytes::Heap(Vec::new()))
        else {
            return;
        };
        give_back(map);
    }
}

/// `len` bytes of staging memory written by `fill`, which must write every one of them: a kept
/// mapping holds an earlier payload's bytes. A kept mapping is reused when one fits, else a
/// fresh one is made (see [`fresh_mapping`]). Payloads below [`MAP_MIN`] stay on the heap and
/// payloads above [`MAX`] get memory of their own, released with them. An allocation failure
/// is [`crate::KvError::Backend`]; a failure of `fill` is returned, the memory kept for the next one.
pub fn stage_with(
    len: usize,
    what: &str,
    fill: impl FnOnce(&mut [u8]) -> Result<()>,
) -> Result<Staged> {
    let kept = (MAP_MIN..=MAX).contains(&len) && start_releaser();
    let mut staged = Staged {
        bytes: match (kept, len < MAP_MIN) {
            (_, true) => OwnedBytes::Heap(zeroed(len, what)?),
            (false, false) => OwnedBytes::Map(fresh_mapping(len, what)?),
            (true, false) => match take_spare(len) {
                Some(map) => OwnedBytes::Map(map),
                None => OwnedBytes::Map(fresh_mapping(len, what)?),
            },
        },
        len,
        kept,
    };
    fill(&mut staged)?;
    Ok(staged)
}

/// A copy of `data` in staging memory (see [`stage_with`]).
pub fn stage_bytes(data: &[u8], what: &str) -> Result<Staged> {
    if data.len() < MAP_MIN {
        return Ok(Staged {
            len: data.len(),
            bytes: copy_bytes(data, what)?,
            kept: false,
        });
    }
    stage_with(data.len(), what, |into| {
        into.copy_from_slice(data);
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The staging mapping is process-wide: the tests that look at it take turns.
    static SERIAL: Mutex<()> = Mutex::new(());

    fn payload(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31) ^ seed)
            .collect()
    }

    #[test]
    fn a_copy_holds_the_bytes_whatever_its_size() {
        let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        for len in [0, 10, MAP_MIN - 1, MAP_MIN, 3 << 20] {
            let data = payload(len, 7);
            assert_eq!(&stage_bytes(&data, "x").unwrap()[..], &data[..]);
        }
    }

    #[test]
    fn the_next_copy_of_no_more_bytes_reuses_a_kept_mapping_and_sees_only_its_own_bytes() {
        let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let big = payload(4 << 20, 1);
        let first = stage_bytes(&big, "x").unwrap();
        let at = first.as_ptr();
        drop(first);
        let small = payload(3 << 20, 2);
        let second = stage_bytes(&small, "x").unwrap();
        assert_eq!(second.as_ptr(), at, "the kept mapping was reused");
        assert_eq!(
            &second[..],
            &small[..],
            "only the new copy's bytes, not the old tail"
        );
        // a copy while the mapping is lent out gets memory of its own
        let third = stage_bytes(&big, "x").unwrap();
        assert_ne!(third.as_ptr(), at);
        assert_eq!(&third[..], &big[..]);
    }

    #[test]
    fn a_small_payload_does_not_take_a_much_larger_kept_mapping() {
        let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        spares().clear();
        let large = stage_bytes(&payload(16 << 20, 4), "x").unwrap();
        let (large_at, small_data) = (large.as_ptr(), payload(MAP_MIN + 1, 5));
        drop(large);
        let small = stage_bytes(&small_data, "x").unwrap();
        assert_ne!(
            small.as_ptr(),
            large_at,
            "a 1 MiB payload took a 16 MiB mapping"
        );
        let small_at = small.as_ptr();
        drop(small);
        // both are kept now, and each payload finds its own
        let again = stage_bytes(&small_data, "x").unwrap();
        assert_eq!(again.as_ptr(), small_at);
        let large = stage_bytes(&payload(15 << 20, 6), "x").unwrap();
        assert_eq!(large.as_ptr(), large_at);
    }

    #[test]
    fn no_more_than_keep_mappings_are_kept_the_least_recent_released_first() {
        let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        spares().clear();
        let held: Vec<_> = (0..KEEP + 2)
            .map(|i| stage_bytes(&payload(2 << 20, i as u8), "x").unwrap())
            .collect();
        let first_two: Vec<_> = held[..2].iter().map(|s| s.as_ptr()).collect();
        drop(held);
        let kept: Vec<_> = spares().iter().map(|(m, _)| m.as_ptr()).collect();
        assert_eq!(kept.len(), KEEP);
        assert!(
            first_two.iter().all(|p| !kept.contains(p)),
            "the oldest went"
        );
    }

    #[test]
    fn a_failed_fill_keeps_the_memory_and_returns_its_error() {
        let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        spares().clear();
        let e = stage_with(2 << 20, "x", |_| {
            Err(crate::KvError::Aborted("stop".into()))
        });
        assert!(matches!(e, Err(crate::KvError::Aborted(_))));
        assert_eq!(
            spares().len(),
            1,
            "the mapping is kept for the next payload"
        );
    }

    #[test]
    fn a_fresh_mapping_is_in_whole_huge_pages() {
        let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        spares().clear();
        drop(stage_bytes(&payload(MAP_MIN + 7, 8), "x").unwrap());
        assert_eq!(spares()[0].0.len(), HUGE_PAGE);
    }

    #[test]
    fn an_unused_mapping_is_released_after_the_idle_time() {
        let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        drop(stage_bytes(&payload(2 << 20, 3), "x").unwrap());
        assert!(!spares().is_empty(), "kept after the copy");
        let deadline = Instant::now() + IDLE * 4;
        while !spares().is_empty() {
            assert!(Instant::now() < deadline, "still kept after {:?}", IDLE * 4);
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}
