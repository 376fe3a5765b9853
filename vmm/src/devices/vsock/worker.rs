//! The vsock device thread: waits on the device's epoll set (queue
//! notification eventfds, the host listener, every host connection) and
//! handles what is ready while holding the transport lock, so guest memory
//! is only touched under that lock.

use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use super::device::{VsockError, TOKEN_STOP};
use super::VsockMmio;

const MAX_EVENTS: usize = 64;

fn lock(t: &Mutex<VsockMmio>) -> MutexGuard<'_, VsockMmio> {
    t.lock().unwrap_or_else(|e| e.into_inner())
}

/// Waits once for the device's file descriptors (at most `max_wait_ms`
/// if given, else until the next deadline or event) and handles them.
/// Returns true when the stop eventfd fired.
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
    Ok(ready.iter().any(|e| e.data() == TOKEN_STOP))
}

/// A running vsock device thread; stopped and joined on drop.
pub struct VsockWorker {
    stop: EventFd,
    thread: Option<JoinHandle<()>>,
}

impl VsockWorker {
    /// Starts the thread for `transport` (one per vsock device). Start it
    /// only once guest memory can be accessed (after the page server).
    pub fn spawn(transport: Arc<Mutex<VsockMmio>>) -> Result<Self, VsockError> {
        let epoll = lock(&transport).device().epoll();
        let stop =
            EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC).map_err(VsockError::EventFd)?;
        epoll
            .ctl(
                ControlOperation::Add,
                stop.as_raw_fd(),
                EpollEvent::new(EventSet::IN, TOKEN_STOP),
            )
            .map_err(VsockError::Epoll)?;
        let thread = std::thread::Builder::new()
            .name("vsock".into())
            .spawn(move || loop {
                match poll_once(&transport, &epoll, None) {
                    Ok(false) => {}
                    Ok(true) => break,
                    Err(e) => {
                        tracing::error!("vsock thread stopped: {e}");
                        break;
                    }
                }
            })
            .map_err(VsockError::Thread)?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }

    /// Stops the thread and waits for it.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        if let Some(thread) = self.thread.take() {
            let _ = self.stop.write(1);
            let _ = thread.join();
        }
    }
}

impl Drop for VsockWorker {
    fn drop(&mut self) {
        self.shutdown();
    }
}
