//! Emulated devices and the port-I/O bus that routes guest accesses to them.
//! One folder per device.

pub mod balloon;
pub mod block;
pub mod i8042;
pub mod kind;
pub mod net;
pub mod pausable;
pub mod rate_limiter;
pub mod serial;
pub mod virtio;
pub mod vsock;
pub mod worker;

use std::sync::{Arc, Mutex};

use torpor_sync::Locked;

pub use pausable::{Pausable, PauseError, PauseGate};

/// A device reached through x86 port I/O.
pub trait PioDevice: Send {
    /// Fills `data` for a read at `offset` from the device's base port.
    fn read(&mut self, offset: u16, data: &mut [u8]);
    /// Handles a write at `offset` from the device's base port.
    fn write(&mut self, offset: u16, data: &[u8]);
}

struct PioRange {
    base: u16,
    len: u16,
    device: Arc<Mutex<dyn PioDevice>>,
}

impl std::fmt::Debug for PioRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The device is a `dyn PioDevice`: not printable.
        f.debug_struct("PioRange")
            .field("base", &self.base)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

/// Port-I/O address space. Unclaimed ports read as all-ones and ignore
/// writes, as on a PC with nothing decoding them.
#[derive(Default, Debug)]
pub struct PioBus {
    ranges: Vec<PioRange>,
}

/// Errors while building the bus.
#[derive(Debug, thiserror::Error)]
pub enum BusError {
    #[error("port range {base:#x}+{len} overlaps a registered device")]
    Overlap { base: u16, len: u16 },
}

impl PioBus {
    pub fn insert(
        &mut self,
        base: u16,
        len: u16,
        device: Arc<Mutex<dyn PioDevice>>,
    ) -> Result<(), BusError> {
        let end = u32::from(base) + u32::from(len);
        let overlaps = self.ranges.iter().any(|r| {
            u32::from(base) < u32::from(r.base) + u32::from(r.len) && u32::from(r.base) < end
        });
        if overlaps || len == 0 {
            return Err(BusError::Overlap { base, len });
        }
        self.ranges.push(PioRange { base, len, device });
        Ok(())
    }

    fn find(&self, port: u16) -> Option<(&PioRange, u16)> {
        self.ranges
            .iter()
            .find(|r| port >= r.base && u32::from(port) < u32::from(r.base) + u32::from(r.len))
            .map(|r| (r, port - r.base))
    }

    pub fn read(&self, port: u16, data: &mut [u8]) {
        match self.find(port) {
            Some((r, offset)) => r.device.locked().read(offset, data),
            None => data.fill(0xff),
        }
    }

    pub fn write(&self, port: u16, data: &[u8]) {
        if let Some((r, offset)) = self.find(port) {
            r.device.locked().write(offset, data);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Echo(u8);
    impl PioDevice for Echo {
        fn read(&mut self, offset: u16, data: &mut [u8]) {
            data.fill(self.0 + offset as u8);
        }
        fn write(&mut self, _offset: u16, data: &[u8]) {
            self.0 = data[0];
        }
    }

    #[test]
    fn routes_by_range_and_defaults_to_ones() {
        let mut bus = PioBus::default();
        bus.insert(0x10, 4, Arc::new(Mutex::new(Echo(1)))).unwrap();
        let mut b = [0u8; 1];
        bus.read(0x12, &mut b);
        assert_eq!(b[0], 3);
        bus.write(0x10, &[7]);
        bus.read(0x13, &mut b);
        assert_eq!(b[0], 10);
        bus.read(0x14, &mut b);
        assert_eq!(b[0], 0xff);
    }

    #[test]
    fn rejects_overlaps() {
        let mut bus = PioBus::default();
        bus.insert(0x10, 4, Arc::new(Mutex::new(Echo(0)))).unwrap();
        assert!(bus.insert(0x13, 2, Arc::new(Mutex::new(Echo(0)))).is_err());
        assert!(bus.insert(0x14, 2, Arc::new(Mutex::new(Echo(0)))).is_ok());
    }
}
