//! 16550A UART (COM1) on vm-superio, its interrupt wired to an irqfd.

mod device;
mod persist;

pub use device::{IrqTrigger, SerialDevice, SerialError, COM1_BASE, COM1_IRQ, COM1_PORTS};
pub use persist::SerialPersistState;
