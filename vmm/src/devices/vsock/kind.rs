//! virtio-vsock in a VM: slot 1, its own thread; a clone binds its own
//! host socket.

use std::sync::{Arc, Mutex};

use vm_memory::GuestMemoryMmap;

use super::{VsockConfig, VsockDevice, VsockError, VsockMmio, VsockRestoreArgs, VsockState};
use crate::devices::kind::{
    PathNeeded, Saved, VirtioConfig, VirtioKind, VirtioRestorePaths, VirtioStates,
};
use crate::devices::worker::{DeviceWorker, WorkerError};

/// The VM's vsock device.
#[derive(Debug, Clone, Copy)]
pub struct VsockKind;

impl VirtioKind for VsockKind {
    type Device = VsockDevice;
    type Error = VsockError;
    const NAME: &'static str = "virtio-vsock";
    const SLOT: usize = 1;

    fn build(
        config: &VirtioConfig,
        _mem: &GuestMemoryMmap,
    ) -> Result<Option<VsockDevice>, VsockError> {
        config
            .vsock_uds
            .as_ref()
            .map(|uds| VsockDevice::new(&VsockConfig::new(uds.clone())))
            .transpose()
    }

    fn restore_args(paths: &VirtioRestorePaths) -> Result<VsockRestoreArgs, PathNeeded> {
        Ok(VsockRestoreArgs {
            uds_path: paths.vsock_uds.clone(),
            cid: None,
        })
    }

    fn saved(states: &VirtioStates) -> &Saved<VsockState> {
        &states.vsock
    }

    fn saved_mut(states: &mut VirtioStates) -> &mut Saved<VsockState> {
        &mut states.vsock
    }

    fn worker(
        transport: &Arc<Mutex<VsockMmio>>,
        paused: bool,
    ) -> Option<Result<DeviceWorker, WorkerError>> {
        Some(DeviceWorker::start(transport.clone(), paused))
    }
}
