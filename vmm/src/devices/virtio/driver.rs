//! The driver side of virtio-mmio registers, as Linux's virtio-mmio
//! driver programs them: shared by the device tests and the fuzz targets
//! (`fuzz/`), which build queues anywhere in guest memory.

use super::bus::MmioDevice;
use super::status;

/// Where one queue's rings are, for [`negotiate`].
pub trait QueueAddrs {
    fn addrs(&self) -> (u64, u64, u64);
}

/// `(descriptor table, available ring, used ring)`.
impl QueueAddrs for (u64, u64, u64) {
    fn addrs(&self) -> (u64, u64, u64) {
        *self
    }
}

pub fn write32(dev: &mut dyn MmioDevice, offset: u64, value: u32) {
    dev.write(offset, &value.to_le_bytes());
}

pub fn read32(dev: &mut dyn MmioDevice, offset: u64) -> u32 {
    let mut b = [0u8; 4];
    dev.read(offset, &mut b);
    u32::from_le_bytes(b)
}

/// Negotiates `features` and sets up one queue per entry of `queues`, as Linux's
/// virtio-mmio driver does, up to (not including) DRIVER_OK.
pub fn negotiate(dev: &mut dyn MmioDevice, features: u64, queues: &[&dyn QueueAddrs], size: u16) {
    write32(dev, 0x70, 0);
    write32(dev, 0x70, status::ACKNOWLEDGE);
    write32(dev, 0x70, status::ACKNOWLEDGE | status::DRIVER);
    for (sel, half) in [(0u32, features as u32), (1, (features >> 32) as u32)] {
        write32(dev, 0x24, sel);
        write32(dev, 0x20, half);
    }
    let s = status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK;
    write32(dev, 0x70, s);
    assert_eq!(read32(dev, 0x70), s, "features accepted");
    for (i, q) in queues.iter().enumerate() {
        write32(dev, 0x30, i as u32);
        write32(dev, 0x38, u32::from(size));
        let (desc, avail, used) = q.addrs();
        for (lo, addr) in [(0x80, desc), (0x90, avail), (0xa0, used)] {
            write32(dev, lo, addr as u32);
            write32(dev, lo + 4, (addr >> 32) as u32);
        }
        write32(dev, 0x44, 1);
    }
}

/// `negotiate`, then DRIVER_OK.
pub fn activate(dev: &mut dyn MmioDevice, features: u64, queues: &[&dyn QueueAddrs], size: u16) {
    negotiate(dev, features, queues, size);
    let s = status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK;
    write32(dev, 0x70, s);
    assert_eq!(read32(dev, 0x70), s, "device activated");
}
