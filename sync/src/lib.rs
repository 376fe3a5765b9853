//! Poison-tolerant locking of the `std::sync` primitives, in one place.
//!
//! A `std::sync` lock is poisoned when a thread panics while holding it;
//! every later `lock()` then returns `Err`. torpor does not let that
//! spread: a panicking holder (a request handler, a device worker, a vCPU
//! thread's helper) must not take the whole service or VMM down with it by
//! making every other user of the lock panic in turn. What these locks
//! guard stays consistent per operation — each holder changes it with
//! whole inserts, removes and assignments, or guards nothing but a turn —
//! so the data behind a poisoned lock is still sound and is used as is.
//!
//! The traits here are that rule, once: [`Locked`] for [`Mutex`],
//! [`RwLocked`] for [`RwLock`], [`Waited`] for [`Condvar`]. Each method is
//! the std call and `PoisonError::into_inner`, nothing else (no other lock
//! implementation, no new syscalls: the VMM's seccomp filters allow exactly
//! what std's locks do).

use std::sync::{
    Condvar, Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard,
    WaitTimeoutResult,
};
use std::time::Duration;

/// [`Mutex`] locked whether or not a holder panicked.
pub trait Locked<T: ?Sized> {
    /// [`Mutex::lock`], taking the guard of a poisoned mutex too.
    fn locked(&self) -> MutexGuard<'_, T>;

    /// [`Mutex::into_inner`], taking the value of a poisoned mutex too.
    fn into_inner_locked(self) -> T
    where
        Self: Sized,
        T: Sized;
}

impl<T: ?Sized> Locked<T> for Mutex<T> {
    #[inline]
    fn locked(&self) -> MutexGuard<'_, T> {
        self.lock().unwrap_or_else(PoisonError::into_inner)
    }

    #[inline]
    fn into_inner_locked(self) -> T
    where
        T: Sized,
    {
        self.into_inner().unwrap_or_else(PoisonError::into_inner)
    }
}

/// [`RwLock`] read or written whether or not a holder panicked.
pub trait RwLocked<T: ?Sized> {
    /// [`RwLock::read`], taking the guard of a poisoned lock too.
    fn read_locked(&self) -> RwLockReadGuard<'_, T>;

    /// [`RwLock::write`], taking the guard of a poisoned lock too.
    fn write_locked(&self) -> RwLockWriteGuard<'_, T>;
}

impl<T: ?Sized> RwLocked<T> for RwLock<T> {
    #[inline]
    fn read_locked(&self) -> RwLockReadGuard<'_, T> {
        self.read().unwrap_or_else(PoisonError::into_inner)
    }

    #[inline]
    fn write_locked(&self) -> RwLockWriteGuard<'_, T> {
        self.write().unwrap_or_else(PoisonError::into_inner)
    }
}

/// [`Condvar`] waits that give the guard back even if the mutex was
/// poisoned meanwhile.
pub trait Waited {
    /// [`Condvar::wait`], taking the guard of a poisoned mutex too.
    fn wait_locked<'a, T>(&self, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T>;

    /// [`Condvar::wait_timeout`], taking the guard of a poisoned mutex too.
    fn wait_timeout_locked<'a, T>(
        &self,
        guard: MutexGuard<'a, T>,
        timeout: Duration,
    ) -> (MutexGuard<'a, T>, WaitTimeoutResult);
}

impl Waited for Condvar {
    #[inline]
    fn wait_locked<'a, T>(&self, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
        self.wait(guard).unwrap_or_else(PoisonError::into_inner)
    }

    #[inline]
    fn wait_timeout_locked<'a, T>(
        &self,
        guard: MutexGuard<'a, T>,
        timeout: Duration,
    ) -> (MutexGuard<'a, T>, WaitTimeoutResult) {
        self.wait_timeout(guard, timeout)
            .unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::thread;

    /// Panics while holding `m`'s lock, so that `m` is poisoned.
    fn poison<T: Send + 'static>(m: &Arc<Mutex<T>>) {
        let held = Arc::clone(m);
        let r = thread::spawn(move || {
            let _g = held.lock().unwrap();
            panic!("a holder panics");
        })
        .join();
        assert!(r.is_err());
        assert!(m.is_poisoned());
    }

    #[test]
    fn a_poisoned_mutex_is_still_usable() {
        let m = Arc::new(Mutex::new(vec![1]));
        poison(&m);
        assert!(m.lock().is_err());
        m.locked().push(2);
        assert_eq!(*m.locked(), [1, 2]);
        let m = Arc::try_unwrap(m).unwrap();
        assert_eq!(m.into_inner_locked(), [1, 2]);
    }

    #[test]
    fn an_unpoisoned_mutex_locks_as_std_does() {
        let m = Mutex::new(1);
        *m.locked() += 1;
        assert!(!m.is_poisoned());
        assert_eq!(m.into_inner_locked(), 2);
    }

    #[test]
    fn a_poisoned_rwlock_is_still_usable() {
        let l = Arc::new(RwLock::new(1));
        let held = Arc::clone(&l);
        let r = thread::spawn(move || {
            let _g = held.write().unwrap();
            panic!("a writer panics");
        })
        .join();
        assert!(r.is_err());
        assert!(l.is_poisoned());
        assert!(l.read().is_err());
        *l.write_locked() = 2;
        assert_eq!(*l.read_locked(), 2);
    }

    #[test]
    fn a_condvar_wait_on_a_poisoned_mutex_gives_the_guard_back() {
        let pair = Arc::new((Mutex::new(false), Condvar::new()));
        // The waiter's mutex is poisoned by the holder that sets the flag,
        // notifies and panics: the waiter wakes up to a poisoned mutex.
        let other = Arc::clone(&pair);
        let mut g = pair.0.locked();
        let setter = thread::spawn(move || {
            let mut done = other.0.lock().unwrap();
            *done = true;
            other.1.notify_all();
            panic!("the notifier panics while holding the lock");
        });
        while !*g {
            g = pair.1.wait_locked(g);
        }
        drop(g);
        assert!(setter.join().is_err());
        assert!(pair.0.is_poisoned());
        let (g, timeout) = pair.1.wait_timeout_locked(pair.0.locked(), Duration::ZERO);
        assert!(*g);
        assert!(timeout.timed_out());
    }
}
