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

/// A net device on its virtio-mmio transport: what goes on the MMIO bus
/// and what its thread locks.
pub type NetMmio = MmioTransport<NetDevice>;

/// The net device thread; stopped and joined on drop.
pub type NetWorker = crate::devices::worker::DeviceWorker;
