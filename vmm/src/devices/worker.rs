//! The thread of a virtio device that works off the vCPU threads (vsock,
//! net): it waits on the device's epoll set (queue notification eventfds,
//! host sockets or the tap, a wake eventfd) and handles what is ready while
//! holding the transport lock, so guest memory is only touched under that
//! lock.
//!
//! The thread can be paused ([`Pausable`]): it parks between two epoll
//! rounds, never inside one, so a round of work is always finished. While
//! it is parked nothing is read from the host side: what arrives stays in
//! the host sockets or the tap's queue (edge-triggered readiness stays
//! queued in the epoll set) and is handled after `resume`.

use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use torpor_sync::Locked;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use crate::devices::pausable::{Pausable, PauseError, PauseGate};
use crate::devices::virtio::{MmioTransport, QueueContext, VirtioDevice};
use crate::seccomp::{Rules, SeccompError};

const MAX_EVENTS: usize = 64;
/// A round of work takes microseconds; this only catches a thread stuck
/// on something (a guest page nobody serves).
const PAUSE_LIMIT: Duration = Duration::from_secs(5);

/// A device served by a [`DeviceWorker`].
pub trait EpollDevice: VirtioDevice + 'static {
    /// The thread's name (what seccomp profiles and `ps` see).
    const THREAD_NAME: &'static str;
    /// The seccomp allow-list the thread confines itself to first.
    const SECCOMP: crate::seccomp::ThreadKind;
    /// The epoll token the worker's wake eventfd uses; the device must
    /// register nothing else under it and ignore it in `handle_events`.
    const TOKEN_WAKE: u64;
    /// The epoll set the thread waits on.
    fn epoll(&self) -> Arc<Epoll>;
    /// How long the thread may sleep before a deadline passes (-1: none).
    fn next_timeout_ms(&self) -> i32;
    /// Handles what epoll reported (possibly nothing: a deadline passed);
    /// `ctx` is `None` while the driver has not activated the device.
    fn handle_events(&mut self, events: &[EpollEvent], ctx: Option<&mut QueueContext<'_>>);
}

/// Errors starting a device thread.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("epoll failed: {0}")]
    Epoll(std::io::Error),
    #[error("cannot create an eventfd: {0}")]
    EventFd(std::io::Error),
    #[error("cannot start the device thread: {0}")]
    Thread(std::io::Error),
}

/// `N` queue-notification eventfds, registered in `epoll` under tokens
/// `0..N` (the queue indexes).
pub fn queue_eventfds<const N: usize>(epoll: &Epoll) -> Result<[EventFd; N], WorkerError> {
    let mut evts = Vec::with_capacity(N);
    for token in 0..N {
        let evt =
            EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC).map_err(WorkerError::EventFd)?;
        epoll
            .ctl(
                ControlOperation::Add,
                evt.as_raw_fd(),
                EpollEvent::new(EventSet::IN, token as u64),
            )
            .map_err(WorkerError::Epoll)?;
        evts.push(evt);
    }
    match evts.try_into() {
        Ok(evts) => Ok(evts),
        Err(_) => unreachable!("exactly N eventfds were made"),
    }
}

/// `VirtioDevice::queue_notify` of a threaded device: wakes its thread.
pub fn kick_queue(evts: &[EventFd], index: usize, thread: &str) {
    if let Some(evt) = evts.get(index) {
        if let Err(e) = evt.write(1) {
            tracing::warn!("cannot wake the {thread} thread: {e}");
        }
    }
}

/// Wakes the thread for every queue (activation, restore: notifications
/// from before a snapshot are lost).
pub fn kick_all(evts: &[EventFd]) -> Result<(), crate::devices::virtio::VirtioError> {
    for evt in evts {
        evt.write(1)
            .map_err(crate::devices::virtio::VirtioError::Signal)?;
    }
    Ok(())
}

/// Waits once for the device's file descriptors (at most `max_wait_ms`
/// if given, else until the next deadline or event) and handles them.
/// Returns true when the device thread's wake eventfd fired.
pub fn poll_once<D: EpollDevice>(
    transport: &Mutex<MmioTransport<D>>,
    epoll: &Epoll,
    max_wait_ms: Option<i32>,
) -> std::io::Result<bool> {
    let mut timeout = transport.locked().device().next_timeout_ms();
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
    transport
        .locked()
        .with_device(|dev, ctx| dev.handle_events(ready, ctx));
    Ok(ready.iter().any(|e| e.data() == D::TOKEN_WAKE))
}

/// A running device thread; stopped and joined on drop.
#[derive(Debug)]
pub struct DeviceWorker {
    name: &'static str,
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

impl DeviceWorker {
    /// Starts the thread for `transport` (one per device). Start it only
    /// once guest memory can be accessed (after the page server).
    pub fn spawn<D: EpollDevice>(
        transport: Arc<Mutex<MmioTransport<D>>>,
    ) -> Result<Self, WorkerError> {
        Self::start(transport, false)
    }

    /// Starts the thread parked: it touches nothing before `resume`.
    pub fn spawn_paused<D: EpollDevice>(
        transport: Arc<Mutex<MmioTransport<D>>>,
    ) -> Result<Self, WorkerError> {
        Self::start(transport, true)
    }

    /// Starts the thread, parked if `paused`: [`spawn`](Self::spawn) or
    /// [`spawn_paused`](Self::spawn_paused).
    pub fn start<D: EpollDevice>(
        transport: Arc<Mutex<MmioTransport<D>>>,
        paused: bool,
    ) -> Result<Self, WorkerError> {
        let epoll = transport.locked().device().epoll();
        let wake =
            EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC).map_err(WorkerError::EventFd)?;
        epoll
            .ctl(
                ControlOperation::Add,
                wake.as_raw_fd(),
                EpollEvent::new(EventSet::IN, D::TOKEN_WAKE),
            )
            .map_err(WorkerError::Epoll)?;
        let thread_wake = wake.try_clone().map_err(WorkerError::EventFd)?;
        let gate = Arc::new(PauseGate::new(paused));
        let finished = Finished(gate.clone());
        let thread = std::thread::Builder::new()
            .name(D::THREAD_NAME.into())
            .spawn(move || {
                crate::seccomp::enter(D::SECCOMP);
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
                            tracing::error!("{} thread stopped: {e}", D::THREAD_NAME);
                            break;
                        }
                    }
                }
                drop(finished);
            })
            .map_err(WorkerError::Thread)?;
        Ok(Self {
            name: D::THREAD_NAME,
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
            tracing::warn!("cannot wake the {} thread: {e}", self.name);
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

impl Pausable for DeviceWorker {
    type Error = PauseError;

    /// Returns once the thread has finished its current round and parked.
    fn pause(&self) -> Result<(), PauseError> {
        if self.gate.request_pause() {
            self.kick();
        }
        self.gate.wait_parked(self.name, PAUSE_LIMIT)
    }

    fn resume(&self) -> Result<(), PauseError> {
        self.gate.resume();
        Ok(())
    }
}

impl Drop for DeviceWorker {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// What every device worker's thread needs beyond the base list: the
/// epoll loop (wait, its eventfds read, the set changed); interrupts are
/// eventfd writes (in the base list).
pub(crate) fn event_loop_syscalls(r: &mut Rules) -> Result<(), SeccompError> {
    r.allow(&[
        libc::SYS_epoll_wait,
        libc::SYS_epoll_pwait,
        libc::SYS_epoll_ctl,
        libc::SYS_read,
    ]);
    Ok(())
}
