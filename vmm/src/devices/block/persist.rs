//! Saved state of virtio-blk: which files make up the disk and which
//! overlay chunks hold data. The overlay's contents live in the overlay
//! file, kept by path; a snapshot must freeze a copy of it
//! ([`BlockState::copy_overlay_to`]) because the live overlay keeps
//! changing while its VM runs.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::device::{BlockDevice, BlockError};
use super::disk::{check_base, copy_overlay, CowDisk, OverlayMap, CHUNK_SIZE};
use crate::snapshot::Persist;

/// Plain-data state of a block device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockState {
    pub id: String,
    pub base_path: PathBuf,
    /// Disk size in bytes; the base image must still have it on restore.
    pub disk_size: u64,
    /// `None` for a read-only disk.
    pub overlay_path: Option<PathBuf>,
    pub chunk_size: u64,
    /// Overlay chunks holding data, as sorted `(first, count)` runs.
    pub overlay_chunks: Vec<(u64, u64)>,
}

impl BlockState {
    fn map(&self) -> Result<OverlayMap, BlockError> {
        Ok(OverlayMap::from_runs(
            self.disk_size.div_ceil(CHUNK_SIZE),
            &self.overlay_chunks,
        )?)
    }

    /// Copies the overlay's data chunks to a new sparse file `dst` and points
    /// this state at it. At snapshot time (VM paused, after `save`), this
    /// freezes the overlay that goes with the snapshot.
    pub fn copy_overlay_to(&mut self, dst: &Path) -> Result<(), BlockError> {
        let Some(src) = &self.overlay_path else {
            return Ok(());
        };
        copy_overlay(src, dst, self.disk_size, &self.map()?)?;
        self.overlay_path = Some(dst.to_path_buf());
        Ok(())
    }
}

/// What restoring a block device needs besides its state.
#[derive(Debug, Clone, Default)]
pub struct BlockRestoreArgs {
    /// This VM's own overlay. When set (and different from the saved
    /// path), the saved overlay is copied there first and left untouched:
    /// how clones of one snapshot get private disks. `None` reuses the
    /// saved overlay in place.
    pub overlay_path: Option<PathBuf>,
    /// Where the base image is now, if it moved.
    pub base_path: Option<PathBuf>,
}

impl Persist for BlockDevice {
    type State = BlockState;
    type ConstructorArgs = BlockRestoreArgs;
    type Error = BlockError;

    /// Flushes the overlay (so a copy made right after sees every write)
    /// and records the map.
    fn save(&self) -> BlockState {
        if let Err(e) = self.disk.flush() {
            tracing::warn!("cannot flush the disk overlay before saving: {e}");
        }
        BlockState {
            id: self.id.clone(),
            base_path: self.disk.base_path().to_path_buf(),
            disk_size: self.disk.size(),
            overlay_path: self.disk.overlay_path().map(Path::to_path_buf),
            chunk_size: CHUNK_SIZE,
            overlay_chunks: self.disk.map().to_runs(),
        }
    }

    fn restore(args: BlockRestoreArgs, state: &BlockState) -> Result<Self, BlockError> {
        if state.chunk_size != CHUNK_SIZE {
            return Err(super::disk::DiskError::BadMap(format!(
                "chunk size {} (this VMM uses {CHUNK_SIZE})",
                state.chunk_size
            ))
            .into());
        }
        let base = args.base_path.as_ref().unwrap_or(&state.base_path);
        // The saved size sizes the overlay map: check it first.
        check_base(base, state.disk_size)?;
        let map = state.map()?;
        let overlay = match (&state.overlay_path, args.overlay_path) {
            (None, _) => None,
            (Some(saved), Some(own)) if own != *saved => {
                copy_overlay(saved, &own, state.disk_size, &map)?;
                Some(own)
            }
            (Some(saved), _) => Some(saved.clone()),
        };
        let disk = CowDisk::reopen(base, overlay.as_deref(), state.disk_size, map)?;
        BlockDevice::from_disk(disk, state.id.clone())
    }
}
