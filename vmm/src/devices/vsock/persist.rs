//! Saved state of virtio-vsock: only the guest CID and the host socket
//! path. Connections are not saved: their host ends belong to the process
//! that took the snapshot. A restored device owes the guest a
//! VIRTIO_VSOCK_EVENT_TRANSPORT_RESET, upon which Linux resets every
//! connected socket (listening sockets stay) and re-reads the CID, holds
//! its rx queue back until the driver has handled that event
//! ([`super::device::ResetHold`]), and hands out host ports the
//! snapshot's connections did not use.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::device::{VsockConfig, VsockDevice, VsockError};
use crate::snapshot::Persist;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VsockState {
    pub cid: u64,
    pub uds_path: PathBuf,
}

/// What restoring a vsock device needs besides its state.
#[derive(Debug, Clone, Default)]
pub struct VsockRestoreArgs {
    /// This VMM's host socket (each clone needs its own); `None` binds the
    /// saved path again.
    pub uds_path: Option<PathBuf>,
    /// A different guest CID; the guest reads it on the transport reset.
    pub cid: Option<u64>,
}

impl Persist for VsockDevice {
    type State = VsockState;
    type ConstructorArgs = VsockRestoreArgs;
    type Error = VsockError;

    fn save(&self) -> VsockState {
        VsockState {
            cid: self.cid,
            uds_path: self.uds_path.clone(),
        }
    }

    fn restore(args: VsockRestoreArgs, state: &VsockState) -> Result<Self, VsockError> {
        let mut dev = VsockDevice::new(&VsockConfig {
            cid: args.cid.unwrap_or(state.cid),
            uds_path: args.uds_path.unwrap_or_else(|| state.uds_path.clone()),
        })?;
        dev.pending_reset_event = true;
        dev.reset_hold = Some(super::device::ResetHold {
            delivered_at: None,
            until: None,
        });
        dev.scatter_host_ports()?;
        Ok(dev)
    }
}
