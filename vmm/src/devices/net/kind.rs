//! virtio-net in a VM: slot 2 (eth0), its own thread; a clone opens its
//! own tap, or the saved tap name again.

use std::sync::{Arc, Mutex};

use vm_memory::GuestMemoryMmap;

use super::{NetDevice, NetError, NetMmio, NetRestoreArgs, NetState};
use crate::devices::kind::{
    PathNeeded, Saved, VirtioConfig, VirtioKind, VirtioRestorePaths, VirtioStates,
};
use crate::devices::worker::{DeviceWorker, WorkerError};

/// The VM's network card.
#[derive(Debug, Clone, Copy)]
pub struct NetKind;

impl VirtioKind for NetKind {
    type Device = NetDevice;
    type Error = NetError;
    const NAME: &'static str = "virtio-net";
    const SLOT: usize = 2;

    fn build(config: &VirtioConfig, _mem: &GuestMemoryMmap) -> Result<Option<NetDevice>, NetError> {
        config.net.as_ref().map(NetDevice::new).transpose()
    }

    fn restore_args(paths: &VirtioRestorePaths) -> Result<NetRestoreArgs, PathNeeded> {
        Ok(NetRestoreArgs {
            spec: paths.net.clone(),
            clock: None,
        })
    }

    fn saved(states: &VirtioStates) -> &Saved<NetState> {
        &states.net
    }

    fn saved_mut(states: &mut VirtioStates) -> &mut Saved<NetState> {
        &mut states.net
    }

    fn worker(
        transport: &Arc<Mutex<NetMmio>>,
        paused: bool,
    ) -> Option<Result<DeviceWorker, WorkerError>> {
        Some(DeviceWorker::start(transport.clone(), paused))
    }
}
