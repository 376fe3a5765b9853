//! i8042 keyboard controller: only the CPU-reset line, which is how a guest
//! (Linux with `reboot=k`, or the probe) ends the VM.

mod device;

pub use device::{I8042, I8042_COMMAND_PORT, I8042_DATA_PORT};
