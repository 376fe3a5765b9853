use std::io::Write;

use vm_superio::{serial::NoEvents, Serial, Trigger};
use vmm_sys_util::eventfd::EventFd;

use super::persist::SerialPersistState;
use crate::devices::PioDevice;
use crate::snapshot::Persist;

pub const COM1_BASE: u16 = 0x3f8;
pub const COM1_PORTS: u16 = 8;
pub const COM1_IRQ: u32 = 4;

/// Raises a guest interrupt by writing the irqfd KVM listens on.
#[derive(Debug)]
pub struct IrqTrigger(pub EventFd);

impl Trigger for IrqTrigger {
    type E = std::io::Error;
    fn trigger(&self) -> std::io::Result<()> {
        self.0.write(1)
    }
}

/// Console output that survives its reader going away: the first write
/// error is logged and later output is dropped, so a closed pipe never
/// stalls or floods the VMM.
pub struct ConsoleSink {
    out: Box<dyn Write + Send>,
    broken: bool,
}

impl std::fmt::Debug for ConsoleSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The output is a `dyn Write`: not printable.
        f.debug_struct("ConsoleSink")
            .field("broken", &self.broken)
            .finish_non_exhaustive()
    }
}

impl Write for ConsoleSink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if !self.broken {
            if let Err(e) = self.out.write_all(buf) {
                tracing::warn!("guest console output stopped: {e}");
                self.broken = true;
            }
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if !self.broken && self.out.flush().is_err() {
            self.broken = true;
        }
        Ok(())
    }
}

/// The guest console. Output goes wherever `out` writes (a file, stdout).
#[derive(Debug)]
pub struct SerialDevice {
    uart: Serial<IrqTrigger, NoEvents, ConsoleSink>,
}

/// Errors while restoring the serial device.
#[derive(Debug, thiserror::Error)]
pub enum SerialError {
    #[error("saved serial state is invalid: {0:?}")]
    InvalidState(vm_superio::serial::Error<std::io::Error>),
}

impl SerialDevice {
    pub fn new(irq: EventFd, out: Box<dyn Write + Send>) -> Self {
        let sink = ConsoleSink { out, broken: false };
        Self {
            uart: Serial::new(IrqTrigger(irq), sink),
        }
    }
}

impl Persist for SerialDevice {
    type State = SerialPersistState;
    type ConstructorArgs = (EventFd, Box<dyn Write + Send>);
    type Error = SerialError;

    fn save(&self) -> Self::State {
        SerialPersistState::from(&self.uart.state())
    }

    fn restore(
        (irq, out): Self::ConstructorArgs,
        state: &Self::State,
    ) -> Result<Self, Self::Error> {
        let sink = ConsoleSink { out, broken: false };
        let uart = Serial::from_state(&state.into(), IrqTrigger(irq), NoEvents, sink)
            .map_err(SerialError::InvalidState)?;
        Ok(Self { uart })
    }
}

impl PioDevice for SerialDevice {
    fn read(&mut self, offset: u16, data: &mut [u8]) {
        if let (Some(first), Ok(offset)) = (data.first_mut(), u8::try_from(offset)) {
            *first = self.uart.read(offset);
        }
    }

    fn write(&mut self, offset: u16, data: &[u8]) {
        if let (Some(&value), Ok(offset)) = (data.first(), u8::try_from(offset)) {
            if let Err(e) = self.uart.write(offset, value) {
                tracing::warn!("serial write failed: {e}");
            }
            // Line-buffered so a reader of the console file sees whole lines.
            if value == b'\n' {
                let _ = self.uart.writer_mut().flush();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<u8>>>);
    impl Write for Sink {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn transmits_bytes_and_raises_interrupt() {
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let sink = Sink::default();
        let mut dev = SerialDevice::new(irq.try_clone().unwrap(), Box::new(sink.clone()));
        dev.write(1, &[0x02]); // IER: THR-empty interrupt on
        for b in b"hi\n" {
            dev.write(0, &[*b]);
        }
        assert_eq!(&*sink.0.lock().unwrap(), b"hi\n");
        assert!(irq.read().unwrap() >= 1);
        let mut lsr = [0u8];
        dev.read(5, &mut lsr);
        assert_ne!(lsr[0] & 0x20, 0, "THR empty");
    }

    #[test]
    fn state_round_trips() {
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let mut dev = SerialDevice::new(irq.try_clone().unwrap(), Box::new(std::io::sink()));
        dev.write(3, &[0x83]); // LCR with DLAB
        dev.write(7, &[0x5a]); // scratch
        let state = dev.save();
        let mut back = SerialDevice::restore((irq, Box::new(std::io::sink())), &state).unwrap();
        assert_eq!(back.save(), state);
        let mut b = [0u8];
        back.read(7, &mut b);
        assert_eq!(b[0], 0x5a);
    }
}
