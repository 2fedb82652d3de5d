//! The clock of the release by decay ([`core::Release::Decay`]): the spans of freed cells a
//! cache remembers are handed back once they stayed free for the delay, by one background
//! thread for the whole process, so that an idle app's memory goes back without a call.
//!
//! A cache is put on the clock's list by the call or task that left something awaiting
//! release, under the cache's lock; the clock takes the lock only when no one holds it (a
//! busy cache is tried again shortly), and a synchronous call that finds the clock holding it
//! waits the moment it takes instead of throwing `ERR_KV_BUSY`. The thread calls no Node-API
//! (what V8 is told the cache costs is brought up to date by the next call), and a process
//! exits as before: Node does not wait for native threads.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use llama_kv_cache as core;

use crate::handle::Handle;

/// How long a cache that was busy waits before the clock tries it again.
const RETRY: Duration = Duration::from_millis(100);

/// The caches awaiting release, each with when its next span is due.
struct Clock {
    due: Mutex<Vec<(Weak<Handle>, Instant)>>,
    wake: Condvar,
}

/// The process's clock, its thread started on first use.
fn clock() -> &'static Arc<Clock> {
    static CLOCK: OnceLock<Arc<Clock>> = OnceLock::new();
    CLOCK.get_or_init(|| {
        let clock = Arc::new(Clock {
            due: Mutex::new(Vec::new()),
            wake: Condvar::new(),
        });
        let ticking = clock.clone();
        // a thread that cannot start leaves freed memory to clear(), releaseUnused() and
        // dispose(), as with releaseMemory: false
        let _ = std::thread::Builder::new()
            .name("kv-cache-release".into())
            .spawn(move || run(&ticking));
        clock
    })
}

/// Called under the cache's lock after a call or task: puts the cache on the clock's list
/// when `memory` has freed cells awaiting release and it is not there yet.
pub fn schedule(handle: &Arc<Handle>, memory: &dyn core::Memory) {
    let Some(due) = memory.next_release() else {
        return;
    };
    if handle.release_scheduled.swap(true, Ordering::SeqCst) {
        return;
    }
    let clock = clock();
    let mut list = clock.due.lock().unwrap_or_else(|p| p.into_inner());
    list.push((Arc::downgrade(handle), due));
    clock.wake.notify_one();
}

/// The clock's thread: hands back what is due, then sleeps until the next span is.
fn run(clock: &Clock) {
    let mut list = clock.due.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        let now = Instant::now();
        let (ready, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut *list)
            .into_iter()
            .partition(|(_, at)| *at <= now);
        *list = waiting;
        drop(list);
        let again: Vec<_> = ready
            .into_iter()
            .filter_map(|(cache, _)| {
                let next = release(cache.upgrade()?.as_ref(), now)?;
                Some((cache, next))
            })
            .collect();
        list = clock.due.lock().unwrap_or_else(|p| p.into_inner());
        list.extend(again);
        list = match list.iter().map(|(_, at)| *at).min() {
            None => clock.wake.wait(list).unwrap_or_else(|p| p.into_inner()),
            Some(at) => {
                let sleep = at.saturating_duration_since(Instant::now());
                let woken = clock.wake.wait_timeout(list, sleep);
                woken.unwrap_or_else(|p| p.into_inner()).0
            }
        };
    }
}

/// Hands back what is due in one cache; when to look at it again (`None`: off the list).
fn release(handle: &Handle, now: Instant) -> Option<Instant> {
    let outcome = handle.try_with_in_background(|memory| {
        // a failed release (the OS refused to take pages back) keeps the pages: nothing is
        // lost, and the next call of the cache tries again
        let next = catch_unwind(AssertUnwindSafe(|| memory.release_due(now)))
            .ok()
            .and_then(Result::ok)
            .flatten();
        if next.is_none() {
            handle.release_scheduled.store(false, Ordering::SeqCst);
        }
        next
    });
    match outcome {
        Ok(next) => next.flatten(),
        Err(()) => Some(now + RETRY),
    }
}
