//! virtio-vsock with Firecracker's hybrid unix-socket host side: host
//! clients connect to `uds_path` and send `CONNECT <port>\n`; guest
//! connections to host port P go to `<uds_path>_P`. One device thread per
//! device ([`VsockWorker`]) moves the data.

mod conn;
mod device;
mod guest;
mod kind;
mod packet;
mod persist;
#[cfg(test)]
mod testrig;
#[cfg(test)]
mod tests;
mod unix;
pub(crate) mod worker;

pub use conn::{ConnError, ConnKey, CONN_BUF_ALLOC, CREDIT_UPDATE_THRESHOLD};
pub use device::{
    VsockConfig, VsockDevice, VsockError, EVQ, MAX_CONNECTIONS, QUEUE_SIZE, RXQ, TOKEN_WAKE, TXQ,
};
pub use kind::VsockKind;
pub use packet::*;
pub use persist::{VsockRestoreArgs, VsockState};
pub use unix::{guest_target, UnixError};
pub use worker::{poll_once, VsockWorker};

use crate::devices::virtio::MmioTransport;

/// A vsock device on its virtio-mmio transport: what goes on the MMIO bus
/// and what its thread locks.
pub type VsockMmio = MmioTransport<VsockDevice>;
