//! The MMIO bus: guest-physical ranges routed to devices, like
//! `devices::PioBus` for port I/O.

use std::sync::{Arc, Mutex};

use torpor_sync::Locked;

/// A device reached through memory-mapped I/O.
pub trait MmioDevice: Send {
    /// Fills `data` for a read at `offset` from the device's base address.
    fn read(&mut self, offset: u64, data: &mut [u8]);
    /// Handles a write at `offset` from the device's base address.
    fn write(&mut self, offset: u64, data: &[u8]);
}

struct MmioRange {
    base: u64,
    len: u64,
    device: Arc<Mutex<dyn MmioDevice>>,
}

impl std::fmt::Debug for MmioRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The device is a `dyn MmioDevice`: not printable.
        f.debug_struct("MmioRange")
            .field("base", &self.base)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

/// Errors while building the MMIO bus.
#[derive(Debug, thiserror::Error)]
pub enum MmioBusError {
    #[error("MMIO range {base:#x}+{len:#x} is empty, wraps or overlaps a registered device")]
    Overlap { base: u64, len: u64 },
}

/// Guest-physical MMIO space. Unclaimed addresses read as all-ones and
/// ignore writes.
#[derive(Default, Debug)]
pub struct MmioBus {
    ranges: Vec<MmioRange>,
}

impl MmioBus {
    pub fn insert(
        &mut self,
        base: u64,
        len: u64,
        device: Arc<Mutex<dyn MmioDevice>>,
    ) -> Result<(), MmioBusError> {
        let end = base
            .checked_add(len)
            .filter(|_| len > 0)
            .ok_or(MmioBusError::Overlap { base, len })?;
        if self
            .ranges
            .iter()
            .any(|r| base < r.base + r.len && r.base < end)
        {
            return Err(MmioBusError::Overlap { base, len });
        }
        self.ranges.push(MmioRange { base, len, device });
        Ok(())
    }

    fn find(&self, addr: u64, size: usize) -> Option<(&MmioRange, u64)> {
        self.ranges
            .iter()
            .find(|r| addr >= r.base && addr - r.base < r.len)
            // An access straddling the end of a device is not the device's.
            .filter(|r| (addr - r.base).saturating_add(size as u64) <= r.len)
            .map(|r| (r, addr - r.base))
    }

    /// Routes a read; returns whether a device claimed `addr`.
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.find(addr, data.len()) {
            Some((r, offset)) => {
                r.device.locked().read(offset, data);
                true
            }
            None => {
                data.fill(0xff);
                false
            }
        }
    }

    /// Routes a write; returns whether a device claimed `addr`.
    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        match self.find(addr, data.len()) {
            Some((r, offset)) => {
                r.device.locked().write(offset, data);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Reg(u64);
    impl MmioDevice for Reg {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            data.fill(self.0.wrapping_add(offset) as u8);
        }
        fn write(&mut self, _offset: u64, data: &[u8]) {
            self.0 = u64::from(data[0]);
        }
    }

    #[test]
    fn routes_by_range_and_defaults_to_ones() {
        let mut bus = MmioBus::default();
        bus.insert(0x1000, 0x100, Arc::new(Mutex::new(Reg(1))))
            .unwrap();
        let mut b = [0u8; 4];
        assert!(bus.read(0x1002, &mut b));
        assert_eq!(b, [3; 4]);
        assert!(bus.write(0x1000, &[7]));
        assert!(bus.read(0x10ff, &mut b[..1]));
        assert_eq!(b[0], 7u8.wrapping_add(0xff));
        assert!(!bus.read(0x1100, &mut b));
        assert_eq!(b, [0xff; 4]);
        // Straddling the end is unclaimed.
        assert!(!bus.read(0x10fe, &mut b));
        assert!(!bus.write(0x2000, &[1]));
    }

    #[test]
    fn rejects_overlaps_empty_and_wrapping_ranges() {
        let mut bus = MmioBus::default();
        let dev = || Arc::new(Mutex::new(Reg(0)));
        bus.insert(0x1000, 0x1000, dev()).unwrap();
        assert!(bus.insert(0x1fff, 2, dev()).is_err());
        assert!(bus.insert(0x800, 0x801, dev()).is_err());
        assert!(bus.insert(0x2000, 0, dev()).is_err());
        assert!(bus.insert(u64::MAX, 2, dev()).is_err());
        assert!(bus.insert(0x2000, 0x1000, dev()).is_ok());
    }
}
