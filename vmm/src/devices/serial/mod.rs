//! 16550A UART (COM1) on vm-superio, its interrupt wired to an irqfd.

mod device;

pub use device::{IrqTrigger, SerialDevice, COM1_BASE, COM1_IRQ, COM1_PORTS};
