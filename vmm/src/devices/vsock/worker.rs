//! The vsock device thread is a [`DeviceWorker`]: it waits on the device's
//! epoll set (queue notification eventfds, the host listener, every host
//! connection). See `devices/worker.rs`.

use std::sync::Arc;

use vmm_sys_util::epoll::{Epoll, EpollEvent};

use super::device::{VsockDevice, TOKEN_WAKE};
use crate::devices::virtio::QueueContext;
use crate::devices::worker::EpollDevice;
use crate::seccomp::{allow_fd_flags, ioctls, Arg, Rules, SeccompError};

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

/// The vsock worker's calls (Firecracker's hybrid vsock): accepts on the
/// host socket, connects to `<uds>_PORT` for guest-initiated connections,
/// moves bytes, and removes its host socket file when it ends, if the
/// file is still the one it bound (the thread holding the last reference
/// drops it). Unix sockets only: no path to the host's network.
pub(crate) fn worker_syscalls(r: &mut Rules) -> Result<(), SeccompError> {
    r.allow(&[
        libc::SYS_accept4,
        libc::SYS_connect,
        libc::SYS_recvfrom,
        libc::SYS_sendto,
        libc::SYS_shutdown,
        libc::SYS_getsockopt,
        libc::SYS_setsockopt,
        libc::SYS_statx,
        libc::SYS_newfstatat,
        libc::SYS_unlink,
    ]);
    allow_fd_flags(r)?;
    r.allow_if(libc::SYS_socket, &[Arg::Eq(0, libc::AF_UNIX as u64)])?;
    r.allow_values(libc::SYS_ioctl, 1, &[ioctls::fionbio()])?;
    Ok(())
}

/// What vsock needs on a vCPU: a driver reset (Linux resets every virtio
/// device when it probes it) is handled on the vCPU that wrote the status
/// register, and drops the host connections, taking their sockets out of
/// the worker's epoll set. Removal only; adding is the worker's own job.
pub(crate) fn vcpu_syscalls(r: &mut Rules) -> Result<(), SeccompError> {
    r.allow_if(
        libc::SYS_epoll_ctl,
        &[Arg::Eq(1, libc::EPOLL_CTL_DEL as u64)],
    )?;
    Ok(())
}
