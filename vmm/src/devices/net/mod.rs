//! virtio-net on a tap device (`IFF_TAP | IFF_NO_PI | IFF_VNET_HDR`), with
//! checksum and TSO/UFO offloads passed through to the tap and a token-
//! bucket rate limiter per direction. One device thread per device (a
//! [`NetWorker`]) moves the frames.

mod device;
mod kind;
mod persist;
mod tap;
#[cfg(test)]
mod testrig;
#[cfg(test)]
mod tests;

pub use device::{
    NetDevice, NetError, NetMetrics, MAX_FRAME, MAX_FRAME_DESCRIPTORS, OFFLOAD_FEATURES,
    QUEUE_SIZE, RXQ, TOKEN_WAKE, TXQ, TYPE_NET,
};
pub use kind::NetKind;
pub use persist::{NetRestoreArgs, NetState};
pub use tap::{Tap, TapError, VNET_HDR_LEN};

use crate::devices::virtio::MmioTransport;
use crate::seccomp::{ioctls, Rules, SeccompError};

/// A net device on its virtio-mmio transport: what goes on the MMIO bus
/// and what its thread locks.
pub type NetMmio = MmioTransport<NetDevice>;

/// The net device thread; stopped and joined on drop.
pub type NetWorker = crate::devices::worker::DeviceWorker;

/// The net worker's calls beyond its event loop: the tap's frames in and
/// out (readv/writev on the tap descriptor opened before the guest ran).
pub(crate) fn worker_syscalls(r: &mut Rules) -> Result<(), SeccompError> {
    r.allow(&[libc::SYS_readv, libc::SYS_writev]);
    Ok(())
}

/// What net needs on a vCPU: the tap's offloads follow what the guest
/// negotiated, set when it writes DRIVER_OK (or resets) on that thread.
pub(crate) fn vcpu_syscalls(r: &mut Rules) -> Result<(), SeccompError> {
    r.allow_values(libc::SYS_ioctl, 1, &[ioctls::tun_set_offload()])?;
    Ok(())
}
