//! Pausing devices that work off the vCPU threads (in the style of Cloud
//! Hypervisor's `vm_migration::Pausable`).
//!
//! A device with a worker thread keeps writing guest memory (used rings,
//! received data) and raising interrupts while the vCPUs are paused. A
//! snapshot needs it to stop: memory copied while the thread writes may
//! disagree with the queue indexes saved, and pages it writes after the
//! dirty set is read are missing from a diff. So the `Controller` pauses
//! the vCPUs, then every [`Pausable`] device, before it takes a snapshot.
//!
//! [`PauseGate`] is the handshake between the one who pauses and the
//! worker thread: the worker calls [`PauseGate::park_if_paused`] between
//! two batches of work, never inside one, so a batch is always finished
//! (nothing half-written, no host data read and not delivered), and what
//! arrives while it is parked waits in the host sockets.

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use torpor_sync::{Locked, Waited};

/// A device whose work can be stopped and started again.
///
/// `pause` returns once the device has stopped: no guest-memory write and
/// no interrupt until `resume`. Both are idempotent.
pub trait Pausable {
    type Error: std::error::Error + Send + Sync + 'static;
    fn pause(&self) -> Result<(), Self::Error>;
    fn resume(&self) -> Result<(), Self::Error>;
}

/// Why a device could not be paused.
#[derive(Debug, thiserror::Error)]
pub enum PauseError {
    #[error("the {thread} thread did not stop within {waited:?} (still running)")]
    Timeout {
        thread: &'static str,
        waited: Duration,
    },
    #[error("the {thread} thread was resumed before it stopped")]
    Resumed { thread: &'static str },
}

/// What the worker thread is asked to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    Run,
    Pause,
    Stop,
}

#[derive(Debug)]
struct GateState {
    target: Target,
    /// The worker waits in `park_if_paused`.
    parked: bool,
    /// The worker has left its loop (stopped or failed): as good as parked.
    finished: bool,
}

/// Pause/resume/stop handshake with one worker thread. The caller wakes
/// the worker (an eventfd in its epoll set, say) after `request_pause`
/// and `request_stop`, so a worker asleep waiting for work gets to its
/// next `park_if_paused` at once.
#[derive(Debug)]
pub struct PauseGate {
    state: Mutex<GateState>,
    changed: Condvar,
}

impl PauseGate {
    /// A gate for a worker that starts running, or parked (`paused`).
    pub fn new(paused: bool) -> Self {
        Self {
            state: Mutex::new(GateState {
                target: if paused { Target::Pause } else { Target::Run },
                parked: false,
                finished: false,
            }),
            changed: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, GateState> {
        self.state.locked()
    }

    /// Worker side, between two batches: waits while paused. Returns false
    /// when the worker must stop.
    pub fn park_if_paused(&self) -> bool {
        let mut s = self.lock();
        while s.target == Target::Pause {
            if !s.parked {
                s.parked = true;
                self.changed.notify_all();
            }
            s = self.changed.wait_locked(s);
        }
        if s.parked {
            s.parked = false;
            self.changed.notify_all();
        }
        s.target != Target::Stop
    }

    /// Worker side: the thread left its loop, for whatever reason.
    pub fn finished(&self) {
        let mut s = self.lock();
        s.finished = true;
        s.parked = false;
        self.changed.notify_all();
    }

    /// Asks the worker to park; returns false if it has stopped or is
    /// stopping (nothing to wait for). Wake the worker, then `wait_parked`.
    pub fn request_pause(&self) -> bool {
        let mut s = self.lock();
        if s.finished || s.target == Target::Stop {
            return false;
        }
        s.target = Target::Pause;
        true
    }

    /// Waits until the worker has parked (or finished), at most `limit`.
    /// On time-out the request is withdrawn: the worker runs on, and the
    /// caller must not count it as paused.
    pub fn wait_parked(&self, thread: &'static str, limit: Duration) -> Result<(), PauseError> {
        let deadline = Instant::now() + limit;
        let mut s = self.lock();
        loop {
            if s.finished || s.target == Target::Stop {
                return Ok(());
            }
            if s.target != Target::Pause {
                // Resumed meanwhile by someone else: not paused any more.
                return Err(PauseError::Resumed { thread });
            }
            if s.parked {
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                s.target = Target::Run;
                self.changed.notify_all();
                return Err(PauseError::Timeout {
                    thread,
                    waited: limit,
                });
            }
            s = self.changed.wait_timeout_locked(s, deadline - now).0;
        }
    }

    /// Lets a paused worker run again.
    pub fn resume(&self) {
        let mut s = self.lock();
        if s.target == Target::Pause {
            s.target = Target::Run;
            self.changed.notify_all();
        }
    }

    /// Asks the worker to stop (it also leaves a pause). Wake it afterwards.
    pub fn request_stop(&self) {
        let mut s = self.lock();
        s.target = Target::Stop;
        self.changed.notify_all();
    }

    /// True while the worker is parked, or has stopped: it touches nothing.
    pub fn is_paused(&self) -> bool {
        let s = self.lock();
        s.finished || (s.target == Target::Pause && s.parked)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    /// A worker that counts its batches; no eventfd: it never sleeps long.
    fn spawn_counter(gate: Arc<PauseGate>, count: Arc<AtomicU64>) -> std::thread::JoinHandle<()> {
        std::thread::spawn(move || {
            while gate.park_if_paused() {
                count.fetch_add(1, Ordering::SeqCst);
                std::thread::sleep(Duration::from_micros(200));
            }
            gate.finished();
        })
    }

    #[test]
    fn a_parked_worker_does_nothing_until_resumed() {
        let gate = Arc::new(PauseGate::new(false));
        let count = Arc::new(AtomicU64::new(0));
        let worker = spawn_counter(gate.clone(), count.clone());
        for _ in 0..5 {
            assert!(gate.request_pause());
            gate.wait_parked("test", Duration::from_secs(5)).unwrap();
            assert!(gate.is_paused());
            let before = count.load(Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(5));
            assert_eq!(count.load(Ordering::SeqCst), before, "worked while parked");
            gate.resume();
            assert!(!gate.is_paused());
            let deadline = Instant::now() + Duration::from_secs(5);
            while count.load(Ordering::SeqCst) == before {
                assert!(Instant::now() < deadline, "did not run after resume");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        // Stopping leaves a pause too.
        assert!(gate.request_pause());
        gate.wait_parked("test", Duration::from_secs(5)).unwrap();
        gate.request_stop();
        worker.join().unwrap();
        assert!(gate.is_paused(), "a finished worker counts as paused");
        assert!(!gate.request_pause());
        gate.wait_parked("test", Duration::from_secs(1)).unwrap();
    }

    #[test]
    fn a_worker_can_start_parked() {
        let gate = Arc::new(PauseGate::new(true));
        let count = Arc::new(AtomicU64::new(0));
        let worker = spawn_counter(gate.clone(), count.clone());
        gate.wait_parked("test", Duration::from_secs(5)).unwrap();
        assert_eq!(count.load(Ordering::SeqCst), 0);
        gate.request_stop();
        worker.join().unwrap();
        assert_eq!(count.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_worker_that_never_parks_times_out_and_keeps_running() {
        let gate = PauseGate::new(false);
        assert!(gate.request_pause());
        let err = gate
            .wait_parked("stuck", Duration::from_millis(10))
            .unwrap_err();
        assert!(err.to_string().contains("stuck"), "{err}");
        assert!(!gate.is_paused());
        // The request was withdrawn: a worker arriving now does not park.
        assert!(gate.park_if_paused());
    }
}
