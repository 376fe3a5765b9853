//! The vsock device thread is a [`DeviceWorker`]: it waits on the device's
//! epoll set (queue notification eventfds, the host listener, every host
//! connection). See `devices/worker.rs`.

use std::sync::Arc;

use vmm_sys_util::epoll::{Epoll, EpollEvent};

use super::device::{VsockDevice, TOKEN_WAKE};
use crate::devices::virtio::QueueContext;
use crate::devices::worker::EpollDevice;

pub use crate::devices::worker::poll_once;

/// The vsock device thread; stopped and joined on drop.
pub type VsockWorker = crate::devices::worker::DeviceWorker;

impl EpollDevice for VsockDevice {
    const THREAD_NAME: &'static str = "vsock";
    const SECCOMP: crate::seccomp::ThreadKind = crate::seccomp::ThreadKind::Vsock;
    const TOKEN_WAKE: u64 = TOKEN_WAKE;

    fn epoll(&self) -> Arc<Epoll> {
        VsockDevice::epoll(self)
    }

    fn next_timeout_ms(&self) -> i32 {
        VsockDevice::next_timeout_ms(self)
    }

    fn handle_events(&mut self, events: &[EpollEvent], ctx: Option<&mut QueueContext<'_>>) {
        VsockDevice::handle_events(self, events, ctx)
    }
}
