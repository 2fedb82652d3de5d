//! The core memory behind a `KvCache` (any kind): its lock, its disposal, and what V8 is told
//! it costs.
//! Which call may take the lock when (the FIFO of async work, the `ERR_KV_BUSY` refusal of
//! synchronous calls meanwhile) is [`crate::queue`]'s.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, TryLockError};

use llama_kv_cache as core;
use napi::bindgen_prelude::Env;

use crate::error::{err, guard, Code, JsErr, JsResult};

/// The core cache, locked by each call that uses it, and the host bytes V8 was told about.
pub struct Handle {
    cache: Mutex<Option<Box<dyn core::Memory>>>,
    /// The env of the JS thread that made the cache.
    env: JsEnv,
    /// Host tensor bytes V8 was told about.
    external: AtomicI64,
    /// The release clock ([`crate::decay`]) holds, or is about to take, the lock: a
    /// synchronous call that finds the lock held waits for it (the release is brief) instead
    /// of throwing `ERR_KV_BUSY`.
    releasing: AtomicBool,
    /// How many times the release clock was done with the lock: a synchronous call that found
    /// the lock held and `releasing` already false sees by this count whether the clock held it
    /// meanwhile (it let go between the call's two looks) and tries again.
    released: AtomicU64,
    /// The cache is on the release clock's list; set and cleared under the lock.
    pub release_scheduled: AtomicBool,
}

/// The lock of a cache, held.
type CacheGuard<'a> = MutexGuard<'a, Option<Box<dyn core::Memory>>>;

/// A JS thread's env.
struct JsEnv(napi::sys::napi_env);

// SAFETY: the env is only handed to Node-API on the JS thread that created the cache (its
// synchronous calls and its tasks' completions run there); other threads only carry it
unsafe impl Send for JsEnv {}
// SAFETY: as above
unsafe impl Sync for JsEnv {}

impl Handle {
    /// The handle of `cache`, made on the JS thread of `env` (V8 is told about the host
    /// memory it holds now, and later as it gets written).
    pub fn new(env: &Env, cache: Box<dyn core::Memory>) -> Self {
        let handle = Handle {
            cache: Mutex::new(None),
            env: JsEnv(env.raw()),
            external: AtomicI64::new(0),
            releasing: AtomicBool::new(false),
            released: AtomicU64::new(0),
            release_scheduled: AtomicBool::new(false),
        };
        handle.account(cache.as_ref());
        *handle.cache.lock().unwrap_or_else(|p| p.into_inner()) = Some(cache);
        handle
    }

    /// Tells V8 how many host tensor bytes the cache holds in memory, so that the GC weighs an
    /// undisposed cache by what it costs. Tensors are zeroed lazily, so only written ones
    /// count: reporting a new cache's whole size made V8 run a full collection inside every
    /// `new KvCache` of a few GiB ("external memory pressure"), 3-70 ms of a creation that
    /// otherwise takes microseconds. Call on the JS thread.
    pub fn account(&self, cache: &dyn core::Memory) {
        self.report(cache.host_resident_bytes() as i64);
    }

    /// [`Handle::account`] from a call that holds the unified cache inside the memory.
    pub fn account_kv(&self, cache: &core::SeedCache) {
        self.report(cache.host_resident_bytes() as i64);
    }

    /// [`Handle::account`] when the cache is not locked (after a task or a stream).
    pub fn account_if_free(&self) {
        if let Ok(lock) = self.cache.try_lock() {
            if let Some(cache) = lock.as_ref() {
                self.account(cache.as_ref());
            }
        }
    }

    /// Reports `bytes` in place of the amount reported before.
    pub fn report(&self, bytes: i64) {
        let before = self.external.swap(bytes, Ordering::SeqCst);
        if bytes != before {
            let mut total = 0;
            // SAFETY: on the JS thread of the env (see JsEnv); a failure only leaves V8's
            // estimate stale
            unsafe {
                napi::sys::napi_adjust_external_memory(self.env.0, bytes - before, &mut total)
            };
        }
    }

    /// Runs `f` on the cache if no one holds it (`ERR_KV_BUSY` otherwise) and it was not
    /// disposed. The caller has checked that no async work is queued.
    pub fn try_with<T>(&self, f: impl FnOnce(&mut dyn core::Memory) -> JsResult<T>) -> JsResult<T> {
        guard(|| {
            let mut lock = match self.lock_unless_busy() {
                Ok(lock) => lock,
                Err(TryLockError::WouldBlock) => {
                    return Err(err(Code::Busy, "the cache is busy with an async operation"))
                }
                Err(TryLockError::Poisoned(_)) => return Err(poisoned()),
            };
            let cache = lock
                .as_mut()
                .ok_or_else(|| err(Code::Disposed, "the cache was disposed"))?;
            f(cache.as_mut())
        })
    }

    /// The lock, unless an async operation or a stream holds it; while the release clock
    /// holds it, waits for it.
    fn lock_unless_busy(&self) -> Result<CacheGuard<'_>, TryLockError<CacheGuard<'_>>> {
        loop {
            let done = self.released.load(Ordering::SeqCst);
            match self.cache.try_lock() {
                Err(TryLockError::WouldBlock)
                    if self.releasing.load(Ordering::SeqCst)
                        || self.released.load(Ordering::SeqCst) != done =>
                {
                    std::thread::yield_now()
                }
                other => return other,
            }
        }
    }

    /// Runs `f` on the cache from the release clock's thread, if no one holds it: `Ok(None)`
    /// when the cache was disposed, `Err(())` when it is busy. Synchronous calls meanwhile
    /// wait instead of failing ([`Handle::try_with`]).
    pub fn try_with_in_background<T>(
        &self,
        f: impl FnOnce(&mut dyn core::Memory) -> T,
    ) -> Result<Option<T>, ()> {
        self.releasing.store(true, Ordering::SeqCst);
        let out = match self.cache.try_lock() {
            Ok(mut lock) => Ok(lock.as_mut().map(|c| f(c.as_mut()))),
            // a poisoned cache is refused by every call: nothing to release for it
            Err(TryLockError::Poisoned(_)) => Ok(None),
            Err(TryLockError::WouldBlock) => Err(()),
        };
        // counted before `releasing` is cleared, so that a call which saw the lock held by the
        // clock sees one or the other
        self.released.fetch_add(1, Ordering::SeqCst);
        self.releasing.store(false, Ordering::SeqCst);
        out
    }

    /// Locks the cache for a task on the threadpool or a stream (tasks queue behind each
    /// other, so this waits only for a synchronous call that got in first).
    pub fn lock_for_task(&self) -> JsResult<MutexGuard<'_, Option<Box<dyn core::Memory>>>> {
        self.cache.lock().map_err(|_| poisoned())
    }

    /// Takes the cache out for `dispose()`, also after an internal error poisoned it.
    pub fn take_for_dispose(&self) -> JsResult<Option<Box<dyn core::Memory>>> {
        match self.lock_unless_busy() {
            Ok(mut lock) => Ok(lock.take()),
            Err(TryLockError::WouldBlock) => Err(err(
                Code::Busy,
                "cannot dispose while an async operation runs",
            )),
            Err(TryLockError::Poisoned(p)) => {
                let cache = p.into_inner().take();
                self.cache.clear_poison();
                Ok(cache)
            }
        }
    }

    /// Whether the cache was taken out by `dispose()` (false while someone holds it).
    pub fn is_disposed(&self) -> bool {
        match self.cache.try_lock() {
            Ok(g) => g.is_none(),
            Err(TryLockError::Poisoned(p)) => p.into_inner().is_none(),
            Err(TryLockError::WouldBlock) => false,
        }
    }
}

/// The error every call gets after an earlier one panicked while holding the cache (a bug caught
/// as `ERR_KV_INTERNAL`): the cells and tensors may be half-updated, so the cache refuses further
/// use instead of guessing, and `dispose()` still frees it.
fn poisoned() -> JsErr {
    err(
        Code::Internal,
        "an earlier call on this cache failed with an internal error, so its contents may be \
         inconsistent; dispose() it and rebuild it (for example from a saved state)",
    )
}
