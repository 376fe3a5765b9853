//! Per-sandbox operation locks. Only held locks take memory: the set holds
//! the ids of the sandboxes an operation is working on, and a guard takes
//! its id out again when dropped (even by a panic), so neither requests on
//! ids that name nothing nor deleted sandboxes leave entries behind.
//!
//! A delete does not queue behind a long operation: it marks the sandbox
//! doomed ([`SandboxLocks::doom`]), and an operation holding the lock
//! while it waits on the guest (a wake's agent wait) gives up at its next
//! check ([`SandboxLocks::is_doomed`]); the delete waits a bounded time
//! ([`SandboxLocks::lock_within`]).

use std::collections::HashSet;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use torpor_sync::{Locked, Waited};

use crate::model::SandboxId;

/// The sandboxes whose lock is held, and a condition variable that wakes
/// waiters when one is released.
#[derive(Default)]
pub(super) struct SandboxLocks {
    held: Mutex<HashSet<SandboxId>>,
    released: Condvar,
    /// Sandboxes a delete waits for.
    doomed: Mutex<HashSet<SandboxId>>,
    /// Tests: run once by the next release of a lock, right after it.
    #[cfg(test)]
    on_release: Mutex<Option<ReleaseHook>>,
}

#[cfg(test)]
type ReleaseHook = Box<dyn FnOnce(&SandboxId) + Send>;

impl std::fmt::Debug for SandboxLocks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The tests' release hook is a closure: not printed.
        f.debug_struct("SandboxLocks")
            .field("held", &self.held)
            .finish_non_exhaustive()
    }
}

/// A sandbox marked doomed while a delete waits for it; unmarked when
/// dropped.
pub(super) struct Doomed<'a> {
    locks: &'a SandboxLocks,
    id: SandboxId,
}

impl Drop for Doomed<'_> {
    fn drop(&mut self) {
        self.locks.doomed().remove(&self.id);
    }
}

/// One held sandbox lock; released when dropped.
pub(super) struct SandboxGuard<'a> {
    locks: &'a SandboxLocks,
    id: SandboxId,
}

impl SandboxLocks {
    fn held(&self) -> MutexGuard<'_, HashSet<SandboxId>> {
        // The set is only changed by insert and remove, which cannot leave
        // it half-done: a poisoned lock still guards a sound set.
        self.held.locked()
    }

    /// Waits until no one else holds `id`'s lock, and takes it.
    pub(super) fn lock(&self, id: &SandboxId) -> SandboxGuard<'_> {
        let mut held = self.held();
        while held.contains(id) {
            held = self.released.wait_locked(held);
        }
        held.insert(id.clone());
        SandboxGuard {
            locks: self,
            id: id.clone(),
        }
    }

    fn doomed(&self) -> MutexGuard<'_, HashSet<SandboxId>> {
        // Insert and remove only, as `held`.
        self.doomed.locked()
    }

    /// [`SandboxLocks::lock`], waiting at most `limit`: None if `id` is
    /// still held then.
    pub(super) fn lock_within(&self, id: &SandboxId, limit: Duration) -> Option<SandboxGuard<'_>> {
        let deadline = Instant::now() + limit;
        let mut held = self.held();
        while held.contains(id) {
            let left = deadline.checked_duration_since(Instant::now())?;
            held = self.released.wait_timeout_locked(held, left).0;
        }
        held.insert(id.clone());
        Some(SandboxGuard {
            locks: self,
            id: id.clone(),
        })
    }

    /// Marks `id` doomed until the returned mark is dropped: whoever holds
    /// its lock and waits on its guest gives up.
    pub(super) fn doom(&self, id: &SandboxId) -> Doomed<'_> {
        self.doomed().insert(id.clone());
        Doomed {
            locks: self,
            id: id.clone(),
        }
    }

    /// Whether a delete waits for `id`.
    pub(super) fn is_doomed(&self, id: &SandboxId) -> bool {
        self.doomed().contains(id)
    }

    /// Takes `id`'s lock if no one holds it.
    pub(super) fn try_lock(&self, id: &SandboxId) -> Option<SandboxGuard<'_>> {
        self.held().insert(id.clone()).then(|| SandboxGuard {
            locks: self,
            id: id.clone(),
        })
    }

    /// How many locks are held.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.held().len()
    }

    /// Runs `hook` once, right after the next release of any lock: what
    /// another request waiting for the lock would do first.
    #[cfg(test)]
    pub(super) fn on_next_release(&self, hook: impl FnOnce(&SandboxId) + Send + 'static) {
        *self.on_release.locked() = Some(Box::new(hook));
    }
}

impl Drop for SandboxGuard<'_> {
    fn drop(&mut self) {
        self.locks.held().remove(&self.id);
        self.locks.released.notify_all();
        #[cfg(test)]
        {
            let hook = self.locks.on_release.locked().take();
            if let Some(hook) = hook {
                hook(&self.id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn one_holder_per_sandbox_and_nothing_kept_after() {
        let locks = SandboxLocks::default();
        let (a, b) = (SandboxId::generate(), SandboxId::generate());
        let held_a = locks.lock(&a);
        assert!(locks.try_lock(&a).is_none());
        let held_b = locks.try_lock(&b).expect("another sandbox's lock is free");
        assert_eq!(locks.len(), 2);
        drop(held_a);
        drop(held_b);
        assert_eq!(locks.len(), 0);
        assert!(locks.try_lock(&a).is_some());
        assert_eq!(locks.len(), 0);
    }

    #[test]
    fn a_bounded_wait_gives_up_and_a_doom_mark_is_dropped() {
        let locks = SandboxLocks::default();
        let a = SandboxId::generate();
        let held = locks.lock(&a);
        assert!(locks.lock_within(&a, Duration::from_millis(20)).is_none());
        {
            let _mark = locks.doom(&a);
            assert!(locks.is_doomed(&a));
        }
        assert!(!locks.is_doomed(&a));
        drop(held);
        assert!(locks.lock_within(&a, Duration::from_millis(20)).is_some());
        assert_eq!(locks.len(), 0);
    }

    #[test]
    fn waiters_take_turns() {
        let locks = SandboxLocks::default();
        let id = SandboxId::generate();
        let inside = AtomicUsize::new(0);
        let most = AtomicUsize::new(0);
        std::thread::scope(|scope| {
            for _ in 0..8 {
                scope.spawn(|| {
                    for _ in 0..200 {
                        let _guard = locks.lock(&id);
                        let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(now, Ordering::SeqCst);
                        std::thread::yield_now();
                        inside.fetch_sub(1, Ordering::SeqCst);
                    }
                });
            }
        });
        assert_eq!(most.load(Ordering::SeqCst), 1);
        assert_eq!(locks.len(), 0);
    }
}
