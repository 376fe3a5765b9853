//! virtio-blk over a copy-on-write disk. Requests are served synchronously
//! in `queue_notify`, i.e. on the vCPU thread that wrote QueueNotify.

use std::path::PathBuf;

use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use super::disk::{CowDisk, DiskError, SECTOR_SIZE};
use crate::devices::virtio::{
    DescChain, QueueContext, VirtioDevice, VirtioError, TYPE_BLOCK, VIRTIO_F_RING_EVENT_IDX,
    VIRTIO_F_VERSION_1,
};

/// Feature bits (virtio 1.2, 5.2.3).
pub const VIRTIO_BLK_F_SIZE_MAX: u64 = 1 << 1;
pub const VIRTIO_BLK_F_SEG_MAX: u64 = 1 << 2;
pub const VIRTIO_BLK_F_RO: u64 = 1 << 5;
pub const VIRTIO_BLK_F_FLUSH: u64 = 1 << 9;

/// Request types and status values.
pub const VIRTIO_BLK_T_IN: u32 = 0;
pub const VIRTIO_BLK_T_OUT: u32 = 1;
pub const VIRTIO_BLK_T_FLUSH: u32 = 4;
pub const VIRTIO_BLK_T_GET_ID: u32 = 8;
pub const VIRTIO_BLK_S_OK: u8 = 0;
pub const VIRTIO_BLK_S_IOERR: u8 = 1;
pub const VIRTIO_BLK_S_UNSUPP: u8 = 2;

/// Length of the id GET_ID returns.
pub const VIRTIO_BLK_ID_BYTES: usize = 20;
pub const QUEUE_SIZE: u16 = 256;
/// Data segments per request, and the largest segment: together they keep
/// Linux's requests within `MAX_REQUEST_BYTES`.
pub const SEG_MAX: u32 = 128;
pub const SIZE_MAX: u32 = 8192;
/// Largest data transfer of one request.
pub const MAX_REQUEST_BYTES: u64 = SEG_MAX as u64 * SIZE_MAX as u64;
const HEADER_LEN: u64 = 16;

/// Errors of the block device and its requests.
#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    #[error(transparent)]
    Disk(#[from] DiskError),
    #[error("a writable disk needs an overlay: the base image is never written")]
    NoOverlay,
    #[error("disk id is {0} bytes, at most 20 fit")]
    IdTooLong(usize),
    #[error("descriptor chain has {0} descriptors, too many")]
    TooManySegments(usize),
    #[error("device-readable descriptor after a device-writable one")]
    Order,
    #[error("a buffer lies outside guest memory")]
    OutsideMemory,
    #[error("request header is {0} bytes, 16 needed")]
    ShortHeader(u64),
    #[error("request type {0} carries data in the wrong direction")]
    Direction(u32),
    #[error("data length {0} is not a whole number of sectors")]
    PartialSector(u64),
    #[error("request of {0} bytes is larger than the {MAX_REQUEST_BYTES}-byte limit")]
    TooLarge(u64),
    #[error("sector {sector} + {len} bytes is beyond the end of the disk")]
    OutOfRange { sector: u64, len: u64 },
    #[error("write to a read-only disk")]
    ReadOnly,
    #[error("unsupported request type {0}")]
    Unsupported(u32),
    #[error("guest memory access failed: {0}")]
    Chain(#[from] crate::devices::virtio::queue::ChainError),
}

impl BlockError {
    fn status(&self) -> u8 {
        match self {
            BlockError::Unsupported(_) => VIRTIO_BLK_S_UNSUPP,
            _ => VIRTIO_BLK_S_IOERR,
        }
    }
}

/// How to build a block device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockConfig {
    /// What GET_ID answers (at most 20 bytes; Linux shows it as the serial).
    pub id: String,
    /// The raw disk image, opened read-only and never written.
    pub base: PathBuf,
    /// This VM's overlay file (created fresh). Required unless `read_only`.
    pub overlay: Option<PathBuf>,
    /// Offer VIRTIO_BLK_F_RO and refuse writes; no overlay is used.
    pub read_only: bool,
    /// Reuse the overlay as it is rather than create it fresh
    /// ([`CowDisk::open_kept`]).
    pub keep_overlay: bool,
}

/// A virtio-blk device.
#[derive(Debug)]
pub struct BlockDevice {
    pub(super) disk: CowDisk,
    pub(super) id: String,
    id_bytes: [u8; VIRTIO_BLK_ID_BYTES],
}

fn id_bytes(id: &str) -> Result<[u8; VIRTIO_BLK_ID_BYTES], BlockError> {
    if id.len() > VIRTIO_BLK_ID_BYTES {
        return Err(BlockError::IdTooLong(id.len()));
    }
    let mut out = [0u8; VIRTIO_BLK_ID_BYTES];
    out[..id.len()].copy_from_slice(id.as_bytes());
    Ok(out)
}

impl BlockDevice {
    pub fn new(config: &BlockConfig) -> Result<Self, BlockError> {
        let id_bytes = id_bytes(&config.id)?;
        let overlay = match (&config.overlay, config.read_only) {
            (_, true) => None,
            (Some(path), false) => Some(path.as_path()),
            (None, false) => return Err(BlockError::NoOverlay),
        };
        let disk = match overlay {
            Some(path) if config.keep_overlay => CowDisk::open_kept(&config.base, path)?,
            _ => CowDisk::open(&config.base, overlay)?,
        };
        Ok(Self {
            disk,
            id: config.id.clone(),
            id_bytes,
        })
    }

    pub(super) fn from_disk(disk: CowDisk, id: String) -> Result<Self, BlockError> {
        Ok(Self {
            id_bytes: id_bytes(&id)?,
            disk,
            id,
        })
    }

    pub fn disk(&self) -> &CowDisk {
        &self.disk
    }

    /// Makes every guest write so far durable in the overlay.
    pub fn flush(&self) -> Result<(), BlockError> {
        Ok(self.disk.flush()?)
    }

    fn config_space(&self) -> [u8; 24] {
        let mut c = [0u8; 24];
        c[0..8].copy_from_slice(&(self.disk.size() / SECTOR_SIZE).to_le_bytes());
        c[8..12].copy_from_slice(&SIZE_MAX.to_le_bytes());
        c[12..16].copy_from_slice(&SEG_MAX.to_le_bytes());
        c
    }

    /// Serves one request; returns the number of bytes written into the
    /// chain (data plus status), as the used ring wants it.
    fn process(&mut self, ctx: &mut QueueContext<'_>, chain: &DescChain) -> u32 {
        // The status byte is the last byte of the last descriptor; without a
        // writable one there, nothing can be reported at all.
        let status_addr = match chain.descs.last() {
            Some(d) if d.writable && d.len > 0 => d.addr.checked_add(u64::from(d.len) - 1),
            _ => None,
        };
        let Some(status_addr) =
            status_addr.filter(|&a| GuestMemoryBackend::check_range(ctx.mem, GuestAddress(a), 1))
        else {
            tracing::debug!(
                head = chain.head,
                "virtio-blk request without a status byte"
            );
            return 0;
        };
        let (status, written) = match self.execute(ctx, chain) {
            Ok(n) => (VIRTIO_BLK_S_OK, n),
            Err(e) => {
                tracing::debug!(head = chain.head, "virtio-blk request failed: {e}");
                (e.status(), 0)
            }
        };
        if ctx
            .mem
            .write_obj(status, GuestAddress(status_addr))
            .is_err()
        {
            return 0;
        }
        ctx.dirty.mark(status_addr, 1);
        written + 1
    }

    fn check_data(&self, sector: u64, len: u64) -> Result<u64, BlockError> {
        if !len.is_multiple_of(SECTOR_SIZE) {
            return Err(BlockError::PartialSector(len));
        }
        if len > MAX_REQUEST_BYTES {
            return Err(BlockError::TooLarge(len));
        }
        let offset = sector
            .checked_mul(SECTOR_SIZE)
            .filter(|o| {
                o.checked_add(len)
                    .is_some_and(|end| end <= self.disk.size())
            })
            .ok_or(BlockError::OutOfRange { sector, len })?;
        Ok(offset)
    }

    /// Validates and runs a request; returns the data bytes written.
    fn execute(
        &mut self,
        ctx: &mut QueueContext<'_>,
        chain: &DescChain,
    ) -> Result<u32, BlockError> {
        let count = chain.descs.len();
        if chain.truncated || count > SEG_MAX as usize + 2 {
            return Err(BlockError::TooManySegments(count));
        }
        if !chain.is_ordered() {
            return Err(BlockError::Order);
        }
        if !chain.in_memory(ctx.mem) {
            return Err(BlockError::OutsideMemory);
        }
        let readable = chain.readable_len();
        if readable < HEADER_LEN {
            return Err(BlockError::ShortHeader(readable));
        }
        let mut header = [0u8; HEADER_LEN as usize];
        ctx.read(chain, 0, &mut header)?;
        let kind = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
        let mut sector_bytes = [0u8; 8];
        sector_bytes.copy_from_slice(&header[8..16]);
        let sector = u64::from_le_bytes(sector_bytes);
        // Data the driver sends, and room for data it receives (before the
        // status byte).
        let data_out = readable - HEADER_LEN;
        let data_in = chain.writable_len() - 1;
        match kind {
            VIRTIO_BLK_T_IN => {
                if data_out != 0 {
                    return Err(BlockError::Direction(kind));
                }
                let offset = self.check_data(sector, data_in)?;
                let mut buf = vec![0u8; data_in as usize];
                self.disk.read_at(offset, &mut buf)?;
                ctx.write(chain, 0, &buf)?;
                Ok(data_in as u32)
            }
            VIRTIO_BLK_T_OUT => {
                if self.disk.is_read_only() {
                    return Err(BlockError::ReadOnly);
                }
                if data_in != 0 {
                    return Err(BlockError::Direction(kind));
                }
                let offset = self.check_data(sector, data_out)?;
                let mut buf = vec![0u8; data_out as usize];
                ctx.read(chain, HEADER_LEN, &mut buf)?;
                self.disk.write_at(offset, &buf)?;
                Ok(0)
            }
            VIRTIO_BLK_T_FLUSH => {
                if data_in != 0 || data_out != 0 {
                    return Err(BlockError::Direction(kind));
                }
                self.disk.flush()?;
                Ok(0)
            }
            VIRTIO_BLK_T_GET_ID => {
                if data_out != 0 || data_in == 0 {
                    return Err(BlockError::Direction(kind));
                }
                let n = (data_in as usize).min(VIRTIO_BLK_ID_BYTES);
                ctx.write(chain, 0, &self.id_bytes[..n])?;
                Ok(n as u32)
            }
            other => Err(BlockError::Unsupported(other)),
        }
    }
}

impl VirtioDevice for BlockDevice {
    fn device_type(&self) -> u32 {
        TYPE_BLOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE]
    }

    fn avail_features(&self) -> u64 {
        let ro = if self.disk.is_read_only() {
            VIRTIO_BLK_F_RO
        } else {
            0
        };
        VIRTIO_F_VERSION_1
            | VIRTIO_F_RING_EVENT_IDX
            | VIRTIO_BLK_F_SIZE_MAX
            | VIRTIO_BLK_F_SEG_MAX
            | VIRTIO_BLK_F_FLUSH
            | ro
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let config = self.config_space();
        crate::devices::virtio::read_config_bytes(&config, offset, data);
    }

    fn activate(&mut self, _acked_features: u64) -> Result<(), VirtioError> {
        Ok(())
    }

    fn queue_notify(&mut self, index: usize, ctx: &mut QueueContext<'_>) {
        if index == 0 {
            ctx.drain(0, |ctx, chain| self.process(ctx, chain));
        }
    }

    fn reset(&mut self) {}
}
