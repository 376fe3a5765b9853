//! The vsock device thread: waits on the device's epoll set (queue
//! notification eventfds, the host listener, every host connection) and
//! handles what is ready while holding the transport lock, so guest memory
//! is only touched under that lock.
//!
//! The thread can be paused ([`Pausable`]): it parks between two epoll
//! rounds, never inside one, so a round of work is always finished. While
//! it is parked nothing is read from the host sockets: what the host sends
//! stays in them (edge-triggered readiness stays queued in the epoll set)
//! and is delivered after `resume`.

use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use super::device::{VsockError, TOKEN_WAKE};
use super::VsockMmio;
use crate::devices::pausable::{Pausable, PauseError, PauseGate};

const MAX_EVENTS: usize = 64;
/// A round of work takes microseconds; this only catches a thread stuck
/// on something (a guest page nobody serves).
const PAUSE_LIMIT: Duration = Duration::from_secs(5);

fn lock(t: &Mutex<VsockMmio>) -> MutexGuard<'_, VsockMmio> {
    t.lock().unwrap_or_else(|e| e.into_inner())
}

/// Waits once for the device's file descriptors (at most `max_wait_ms`
/// if given, else until the next deadline or event) and handles them.
/// Returns true when the device thread's wake eventfd fired.
pub fn poll_once(
    transport: &Mutex<VsockMmio>,
    epoll: &Epoll,
    max_wait_ms: Option<i32>,
) -> std::io::Result<bool> {
    let mut timeout = lock(transport).device().next_timeout_ms();
    if let Some(max) = max_wait_ms {
        if timeout < 0 || timeout > max {
            timeout = max;
        }
    }
    let mut events = [EpollEvent::default(); MAX_EVENTS];
    let n = match epoll.wait(timeout, &mut events) {
        Ok(n) => n,
        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => 0,
        Err(e) => return Err(e),
    };
    let ready = &events[..n];
    lock(transport).with_device(|dev, ctx| dev.handle_events(ready, ctx));
    Ok(ready.iter().any(|e| e.data() == TOKEN_WAKE))
}

/// A running vsock device thread; stopped and joined on drop.
pub struct VsockWorker {
    /// Wakes the thread out of epoll to look at `gate`.
    wake: EventFd,
    gate: Arc<PauseGate>,
    thread: Option<JoinHandle<()>>,
}

/// Marks the gate finished however the thread ends (a panic included), so
/// a pauser never waits for a thread that is gone.
struct Finished(Arc<PauseGate>);

impl Drop for Finished {
    fn drop(&mut self) {
        self.0.finished();
    }
}

impl VsockWorker {
    /// Starts the thread for `transport` (one per vsock device). Start it
    /// only once guest memory can be accessed (after the page server).
    pub fn spawn(transport: Arc<Mutex<VsockMmio>>) -> Result<Self, VsockError> {
        Self::start(transport, false)
    }

    /// Starts the thread parked: it touches nothing before `resume`.
    pub fn spawn_paused(transport: Arc<Mutex<VsockMmio>>) -> Result<Self, VsockError> {
        Self::start(transport, true)
    }

    fn start(transport: Arc<Mutex<VsockMmio>>, paused: bool) -> Result<Self, VsockError> {
        let epoll = lock(&transport).device().epoll();
        let wake =
            EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC).map_err(VsockError::EventFd)?;
        epoll
            .ctl(
                ControlOperation::Add,
                wake.as_raw_fd(),
                EpollEvent::new(EventSet::IN, TOKEN_WAKE),
            )
            .map_err(VsockError::Epoll)?;
        let thread_wake = wake.try_clone().map_err(VsockError::EventFd)?;
        let gate = Arc::new(PauseGate::new(paused));
        let finished = Finished(gate.clone());
        let thread = std::thread::Builder::new()
            .name("vsock".into())
            .spawn(move || {
                crate::seccomp::enter(crate::seccomp::ThreadKind::Vsock);
                let gate = finished.0.clone();
                while gate.park_if_paused() {
                    match poll_once(&transport, &epoll, None) {
                        Ok(true) => {
                            // Level-triggered: drain it or epoll keeps
                            // reporting it.
                            let _ = thread_wake.read();
                        }
                        Ok(false) => {}
                        Err(e) => {
                            tracing::error!("vsock thread stopped: {e}");
                            break;
                        }
                    }
                }
                drop(finished);
            })
            .map_err(VsockError::Thread)?;
        Ok(Self {
            wake,
            gate,
            thread: Some(thread),
        })
    }

    /// True while the thread is parked (or has ended): it touches neither
    /// guest memory nor the interrupt.
    pub fn is_paused(&self) -> bool {
        self.gate.is_paused()
    }

    fn kick(&self) {
        if let Err(e) = self.wake.write(1) {
            tracing::warn!("cannot wake the vsock thread: {e}");
        }
    }

    /// Stops the thread and waits for it.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        if let Some(thread) = self.thread.take() {
            self.gate.request_stop();
            self.kick();
            let _ = thread.join();
        }
    }
}

impl Pausable for VsockWorker {
    type Error = PauseError;

    /// Returns once the thread has finished its current round and parked.
    fn pause(&self) -> Result<(), PauseError> {
        if self.gate.request_pause() {
            self.kick();
        }
        self.gate.wait_parked("vsock", PAUSE_LIMIT)
    }

    fn resume(&self) -> Result<(), PauseError> {
        self.gate.resume();
        Ok(())
    }
}

impl Drop for VsockWorker {
    fn drop(&mut self) {
        self.shutdown();
    }
}
