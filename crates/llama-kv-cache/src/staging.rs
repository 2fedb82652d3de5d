//! Staging memory for copies of payloads that must outlive their owner's buffer (the Node
//! binding's async `stateRead` copies the caller's bytes at the call). A large copy into fresh
//! memory pays a page fault (or a populate) per page and an unmap afterwards, as much as the
//! memcpy itself: at 500 MiB the copy took 236 ms where a memcpy into pages already faulted in
//! takes 50-70. So the mapping of the last copy is kept, faulted in, and the next copy of no
//! more bytes reuses it. Like jemalloc's decay, memory the program stopped using goes back to
//! the OS: a mapping unused for [`IDLE`] is released by a background thread.

use std::ops::Deref;
use std::sync::{Condvar, Mutex, MutexGuard, Once};
use std::time::{Duration, Instant};

use memmap2::MmapMut;

use crate::alloc::{copy_bytes, map_zeroed, populate, OwnedBytes, MAP_MIN};
use crate::error::Result;

/// How long a kept mapping waits for its next copy before it is released.
pub const IDLE: Duration = Duration::from_secs(5);

/// Copies above this get a mapping of their own, released when the copy is dropped: the kept
/// mapping must not hold many GiB of a rare huge payload for [`IDLE`].
pub const MAX: usize = 2 << 30;

/// The kept mapping and when it was handed back.
type Spare = Option<(MmapMut, Instant)>;

static SPARE: Mutex<Spare> = Mutex::new(None);

/// Wakes the releasing thread when a mapping is handed back.
static RETURNED: Condvar = Condvar::new();

static RELEASER: Once = Once::new();

/// Whether the releasing thread runs: without it a kept mapping would never be released, so
/// copies are not kept then.
static RELEASING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn spare() -> MutexGuard<'static, Spare> {
    // a panic while the lock was held left a valid `Spare` (it is written in one step)
    SPARE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Starts the thread that releases a mapping left unused for [`IDLE`], once per process.
fn start_releaser() -> bool {
    RELEASER.call_once(|| {
        let spawned = std::thread::Builder::new()
            .name("kv-staging-release".into())
            .spawn(|| {
                let mut s = spare();
                loop {
                    let idle = s.as_ref().map(|(_, since)| since.elapsed());
                    match idle {
                        None => s = RETURNED.wait(s).unwrap_or_else(|e| e.into_inner()),
                        Some(idle) if idle >= IDLE => {
                            let map = s.take();
                            // unmapped without the lock: a copy meanwhile maps its own memory
                            drop(s);
                            drop(map);
                            s = spare();
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

/// A copy of a payload, in staging memory handed back for the next copy when dropped.
pub struct Staged {
    bytes: OwnedBytes,
    len: usize,
    /// Whether `bytes` is a staging mapping to hand back (not a small or huge copy).
    kept: bool,
}

impl Deref for Staged {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

impl AsRef<[u8]> for Staged {
    fn as_ref(&self) -> &[u8] {
        self
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
        let mut s = spare();
        // two copies ran at once: the larger mapping is kept, the other unmapped
        let unused = match s.take() {
            Some((kept, _)) if kept.len() >= map.len() => {
                *s = Some((kept, Instant::now()));
                Some(map)
            }
            smaller => {
                *s = Some((map, Instant::now()));
                smaller.map(|(m, _)| m)
            }
        };
        drop(s);
        RETURNED.notify_one();
        drop(unused);
    }
}

/// A copy of `data` in staging memory: the kept mapping when it is large enough, else a new
/// one, faulted in with one call (see [`populate`]) before the copy. Copies below
/// [`MAP_MIN`] stay on the heap and copies above [`MAX`] get memory of their own, as
/// [`copy_bytes`] makes them. An allocation failure is [`crate::KvError::Backend`].
pub fn stage_bytes(data: &[u8], what: &str) -> Result<Staged> {
    let len = data.len();
    if !(MAP_MIN..=MAX).contains(&len) || !start_releaser() {
        return Ok(Staged {
            bytes: copy_bytes(data, what)?,
            len,
            kept: false,
        });
    }
    let kept = spare().take();
    let mut map = match kept {
        Some((map, _)) if map.len() >= len => map,
        smaller => {
            drop(smaller);
            let map = map_zeroed(len, what)?;
            populate(&map, 0, len);
            map
        }
    };
    map[..len].copy_from_slice(data);
    Ok(Staged {
        bytes: OwnedBytes::Map(map),
        len,
        kept: true,
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
    fn the_next_copy_of_no_more_bytes_reuses_the_mapping_and_sees_only_its_own_bytes() {
        let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let big = payload(4 << 20, 1);
        let first = stage_bytes(&big, "x").unwrap();
        let at = first.as_ptr();
        drop(first);
        let small = payload(2 << 20, 2);
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
    fn an_unused_mapping_is_released_after_the_idle_time() {
        let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        drop(stage_bytes(&payload(2 << 20, 3), "x").unwrap());
        assert!(spare().is_some(), "kept after the copy");
        let deadline = Instant::now() + IDLE * 4;
        while spare().is_some() {
            assert!(Instant::now() < deadline, "still kept after {:?}", IDLE * 4);
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}
