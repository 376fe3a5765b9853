//! What a virtio device tells the VMM to take part in a VM: its
//! [`VirtioKind`], implemented in the device's own folder
//! (`devices/<name>/kind.rs`) and listed once in `virtio_devices.rs`'s
//! `KINDS`. Beside it, the VM-wide inputs and outputs each kind takes its
//! part of: the boot configuration ([`VirtioConfig`]), a clone's paths
//! ([`VirtioRestorePaths`]) and the saved states ([`VirtioStates`]).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use torpor_vmm_api::launch::NetSpec;
use vm_memory::GuestMemoryMmap;

use crate::devices::balloon::BalloonState;
use crate::devices::block::{BlockState, DiskConfig};
use crate::devices::net::NetState;
use crate::devices::virtio::{MmioSlot, MmioTransport, VirtioDevice, VirtioMmioState};
use crate::devices::vsock::VsockState;
use crate::devices::worker::{DeviceWorker, WorkerError};
use crate::snapshot::Persist;

/// Which virtio devices a cold boot gets.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VirtioConfig {
    pub disk: Option<DiskConfig>,
    /// Host unix socket of the vsock device (Firecracker's hybrid vsock).
    pub vsock_uds: Option<PathBuf>,
    /// virtio-net on a tap.
    pub net: Option<NetSpec>,
    /// virtio-balloon (free page reporting, statistics, a target).
    pub balloon: bool,
}

/// Where a clone's devices keep their host-side files.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VirtioRestorePaths {
    pub disk_overlay: Option<PathBuf>,
    pub vsock_uds: Option<PathBuf>,
    /// The clone's tap (by name, in its network namespace) and limits;
    /// `None` reopens the saved tap name.
    pub net: Option<NetSpec>,
}

/// Saved virtio state, part of `DeviceStates`: one field per kind (its
/// [`VirtioKind::saved`]). bincode is not self-describing: a new field is a
/// new snapshot format version (`docs/snapshot-format.md`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct VirtioStates {
    pub block: Saved<BlockState>,
    pub vsock: Saved<VsockState>,
    pub net: Saved<NetState>,
    pub balloon: Saved<BalloonState>,
}

/// One device's saved state: where it was and its transport with the
/// device model's own state; `None` when the VM had none.
pub type Saved<S> = Option<(MmioSlot, VirtioMmioState<S>)>;

/// The saved state of kind `K`'s device model.
pub type StateOf<K> = <<K as VirtioKind>::Device as Persist>::State;

/// A path a clone must be given to restore a saved device.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct PathNeeded(pub &'static str);

/// One kind of virtio device, as the VMM builds, starts, saves and
/// restores it. The generic code in `virtio_devices.rs` does the rest: the
/// slot's interrupt, the MMIO bus, the kernel command line, the transport,
/// the device thread, the pages the device wrote.
pub trait VirtioKind: 'static {
    /// The device model; the transport around it is generic.
    type Device: VirtioDevice + Persist<Error = Self::Error> + 'static;
    /// Why building, restoring or saving the device failed.
    type Error: std::error::Error + Send + Sync + 'static;
    /// Its name in errors (`virtio-blk`).
    const NAME: &'static str;
    /// Its fixed virtio-mmio slot ([`MmioSlot::nth`]); no two kinds share
    /// one. Slots are probed in order: slot 0's disk is Linux's /dev/vda.
    const SLOT: usize;

    /// Its device for a cold boot, if `config` asks for one.
    fn build(
        config: &VirtioConfig,
        mem: &GuestMemoryMmap,
    ) -> Result<Option<Self::Device>, Self::Error>;

    /// What rebuilding its saved device needs, from the clone's paths.
    fn restore_args(
        paths: &VirtioRestorePaths,
    ) -> Result<<Self::Device as Persist>::ConstructorArgs, PathNeeded>;

    /// Its own field of the saved states.
    fn saved(states: &VirtioStates) -> &Saved<StateOf<Self>>;

    /// Its own field of the saved states, to fill.
    fn saved_mut(states: &mut VirtioStates) -> &mut Saved<StateOf<Self>>;

    /// Completes a state just saved (vCPUs and device threads paused) with
    /// what lives beside the state in the snapshot directory `dir`.
    fn freeze(_state: &mut StateOf<Self>, _dir: &Path) -> Result<(), Self::Error> {
        Ok(())
    }

    /// Starts the device's thread (parked if `paused`), if it has one;
    /// a device without one works on the vCPU thread that notified it.
    fn worker(
        _transport: &Arc<Mutex<MmioTransport<Self::Device>>>,
        _paused: bool,
    ) -> Option<Result<DeviceWorker, WorkerError>> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::{MmioTransportState, QueuePersistState};

    /// `VirtioStates` as snapshot formats 4 and earlier wrote it.
    #[derive(Serialize)]
    struct OldVirtioStates {
        block: Option<(MmioSlot, VirtioMmioState<BlockState>)>,
        vsock: Option<(MmioSlot, VirtioMmioState<VsockState>)>,
        net: Option<(MmioSlot, VirtioMmioState<NetState>)>,
        balloon: Option<(MmioSlot, VirtioMmioState<BalloonState>)>,
    }

    fn transport(device_type: u32) -> MmioTransportState {
        MmioTransportState {
            device_type,
            status: 15,
            acked_features: 1 << 32,
            queues: vec![QueuePersistState {
                max_size: 256,
                size: 128,
                ready: true,
                desc_table: 0x1000,
                avail_ring: 0x2000,
                used_ring: 0x3000,
                next_avail: 3,
                next_used: 2,
                event_idx: true,
            }],
            ..Default::default()
        }
    }

    fn vsock() -> (MmioSlot, VirtioMmioState<VsockState>) {
        let state = VsockState {
            cid: 3,
            uds_path: "/v.sock".into(),
        };
        let slot = MmioSlot::nth(1).unwrap();
        (
            slot,
            VirtioMmioState {
                transport: transport(19),
                device: state,
            },
        )
    }

    fn balloon() -> (MmioSlot, VirtioMmioState<BalloonState>) {
        let state = BalloonState {
            mem_bytes: 1 << 20,
            target_pages: 7,
            actual_pages: 5,
            stats_head: Some(2),
            counters: Default::default(),
        };
        let slot = MmioSlot::nth(3).unwrap();
        (
            slot,
            VirtioMmioState {
                transport: transport(5),
                device: state,
            },
        )
    }

    /// The bytes the VMM wrote for [`vsock`] and [`balloon`] before the
    /// kinds existed (virtio_devices.rs with a field per device).
    const GOLDEN: &[u8] = &[
        0, 1, 0, 16, 0, 208, 0, 0, 0, 0, 0, 16, 0, 0, 0, 0, 0, 0, 6, 0, 0, 0, 19, 0, 0, 0, 15, 0,
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 128, 0, 1, 0, 16, 0, 0, 0, 0, 0, 0, 0, 32, 0, 0, 0, 0, 0, 0,
        0, 48, 0, 0, 0, 0, 0, 0, 3, 0, 2, 0, 1, 3, 0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0, 0, 47,
        118, 46, 115, 111, 99, 107, 0, 1, 0, 48, 0, 208, 0, 0, 0, 0, 0, 16, 0, 0, 0, 0, 0, 0, 9, 0,
        0, 0, 5, 0, 0, 0, 15, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0,
        0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 128, 0, 1, 0, 16, 0, 0, 0, 0, 0, 0,
        0, 32, 0, 0, 0, 0, 0, 0, 0, 48, 0, 0, 0, 0, 0, 0, 3, 0, 2, 0, 1, 0, 0, 16, 0, 0, 0, 0, 0,
        7, 0, 0, 0, 5, 0, 0, 0, 1, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        0, 0, 0, 0, 0, 0, 0,
    ];

    #[test]
    fn states_decode_and_encode_as_before_the_kinds() {
        let old = OldVirtioStates {
            block: None,
            vsock: Some(vsock()),
            net: None,
            balloon: Some(balloon()),
        };
        let old_bytes = bincode::serialize(&old).unwrap();
        assert_eq!(old_bytes, GOLDEN);
        let states: VirtioStates = bincode::deserialize(GOLDEN).unwrap();
        assert!(states.block.is_none() && states.net.is_none());
        assert_eq!(states.vsock, Some(vsock()));
        assert_eq!(states.balloon, Some(balloon()));
        assert_eq!(bincode::serialize(&states).unwrap(), GOLDEN);
    }
}
