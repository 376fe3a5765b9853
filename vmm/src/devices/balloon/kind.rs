//! virtio-balloon in a VM: slot 3, its own thread, sized to guest memory
//! at boot (the size is saved with it).

use std::sync::{Arc, Mutex};

use vm_memory::{GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

use super::{BalloonDevice, BalloonError, BalloonMmio, BalloonRestoreArgs, BalloonState};
use crate::devices::kind::{
    PathNeeded, Saved, VirtioConfig, VirtioKind, VirtioRestorePaths, VirtioStates,
};
use crate::devices::worker::{DeviceWorker, WorkerError};

/// The VM's memory balloon.
#[derive(Debug, Clone, Copy)]
pub struct BalloonKind;

impl VirtioKind for BalloonKind {
    type Device = BalloonDevice;
    type Error = BalloonError;
    const NAME: &'static str = "virtio-balloon";
    const SLOT: usize = 3;

    fn build(
        config: &VirtioConfig,
        mem: &GuestMemoryMmap,
    ) -> Result<Option<BalloonDevice>, BalloonError> {
        if !config.balloon {
            return Ok(None);
        }
        let mem_bytes = mem.iter().map(|r| r.len()).sum();
        BalloonDevice::new(mem_bytes).map(Some)
    }

    fn restore_args(_paths: &VirtioRestorePaths) -> Result<BalloonRestoreArgs, PathNeeded> {
        Ok(BalloonRestoreArgs)
    }

    fn saved(states: &VirtioStates) -> &Saved<BalloonState> {
        &states.balloon
    }

    fn saved_mut(states: &mut VirtioStates) -> &mut Saved<BalloonState> {
        &mut states.balloon
    }

    fn worker(
        transport: &Arc<Mutex<BalloonMmio>>,
        paused: bool,
    ) -> Option<Result<DeviceWorker, WorkerError>> {
        Some(DeviceWorker::start(transport.clone(), paused))
    }
}
