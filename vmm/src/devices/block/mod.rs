//! virtio-blk backed by a raw disk image with a per-VM copy-on-write
//! overlay, so clones of one template never write the template's disk.

mod device;
mod disk;
mod kind;
mod persist;
#[cfg(test)]
mod tests;

pub use device::{
    BlockConfig, BlockDevice, BlockError, MAX_REQUEST_BYTES, QUEUE_SIZE, SEG_MAX, SIZE_MAX,
    VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_F_SIZE_MAX,
    VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_FLUSH,
    VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
};
pub use disk::{copy_overlay, CowDisk, DiskError, OverlayMap, CHUNK_SIZE, SECTOR_SIZE};
pub use kind::{BlockKind, DiskConfig, OVERLAY_FILE};
pub use persist::{BlockRestoreArgs, BlockState};

use crate::devices::virtio::MmioTransport;
use crate::seccomp::{Rules, SeccompError};

/// A block device on its virtio-mmio transport: what goes on the MMIO bus.
pub type BlockMmio = MmioTransport<BlockDevice>;

/// What the block device needs on a vCPU (its requests are served on the
/// vCPU that notified the queue): data at an offset of the image and
/// overlay, which are already open, and flushes.
pub(crate) fn vcpu_syscalls(r: &mut Rules) -> Result<(), SeccompError> {
    r.allow(&[
        libc::SYS_pread64,
        libc::SYS_pwrite64,
        libc::SYS_fdatasync,
        libc::SYS_fsync,
    ]);
    Ok(())
}
