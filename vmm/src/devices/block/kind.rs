//! virtio-blk in a VM: slot 0 (so Linux names it /dev/vda), no thread
//! (requests are served on the vCPU thread that notified it), and a
//! snapshot freezes a copy of the overlay beside its state.

use std::path::{Path, PathBuf};

use vm_memory::GuestMemoryMmap;

use super::{BlockConfig, BlockDevice, BlockError, BlockRestoreArgs, BlockState};
use crate::devices::kind::{
    PathNeeded, Saved, VirtioConfig, VirtioKind, VirtioRestorePaths, VirtioStates,
};

/// Name of the frozen disk overlay inside a snapshot directory.
pub const OVERLAY_FILE: &str = "disk0.overlay";

/// A disk: a base image never written, and this VM's own overlay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskConfig {
    pub image: PathBuf,
    pub overlay: PathBuf,
    pub read_only: bool,
    /// Reuse the overlay as it is (see `DiskSpec::keep_overlay`).
    pub keep_overlay: bool,
}

/// The VM's disk.
#[derive(Debug, Clone, Copy)]
pub struct BlockKind;

impl VirtioKind for BlockKind {
    type Device = BlockDevice;
    type Error = BlockError;
    const NAME: &'static str = "virtio-blk";
    const SLOT: usize = 0;

    fn build(
        config: &VirtioConfig,
        _mem: &GuestMemoryMmap,
    ) -> Result<Option<BlockDevice>, BlockError> {
        let Some(disk) = &config.disk else {
            return Ok(None);
        };
        BlockDevice::new(&BlockConfig {
            id: "rootfs".into(),
            base: disk.image.clone(),
            overlay: Some(disk.overlay.clone()),
            read_only: disk.read_only,
            keep_overlay: disk.keep_overlay,
        })
        .map(Some)
    }

    fn restore_args(paths: &VirtioRestorePaths) -> Result<BlockRestoreArgs, PathNeeded> {
        let overlay = paths.disk_overlay.clone().ok_or(PathNeeded(
            "a snapshot with a disk needs --disk-overlay for the clone's own overlay",
        ))?;
        Ok(BlockRestoreArgs {
            overlay_path: Some(overlay),
            base_path: None,
        })
    }

    fn saved(states: &VirtioStates) -> &Saved<BlockState> {
        &states.block
    }

    fn saved_mut(states: &mut VirtioStates) -> &mut Saved<BlockState> {
        &mut states.block
    }

    /// The live overlay keeps changing: the snapshot gets its own copy.
    fn freeze(state: &mut BlockState, dir: &Path) -> Result<(), BlockError> {
        state.copy_overlay_to(&dir.join(OVERLAY_FILE))
    }
}
