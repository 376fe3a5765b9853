use vm_superio::{I8042Device, Trigger};

use crate::devices::PioDevice;
use crate::exit::{ExitReason, ExitSignal};

pub const I8042_DATA_PORT: u16 = 0x60;
pub const I8042_COMMAND_PORT: u16 = 0x64;

/// Ends the VM with `GuestShutdown` when the guest pulls the reset line.
#[derive(Debug)]
pub struct ResetTrigger(ExitSignal);

impl Trigger for ResetTrigger {
    type E = std::convert::Infallible;
    fn trigger(&self) -> Result<(), Self::E> {
        tracing::info!("the guest reset the machine (i8042 reset line)");
        self.0.exit(ExitReason::GuestShutdown);
        Ok(())
    }
}

/// Registered at port 0x60 with length 5, so offset 4 is the command port.
#[derive(Debug)]
pub struct I8042(I8042Device<ResetTrigger>);

impl I8042 {
    pub fn new(exit: ExitSignal) -> Self {
        Self(I8042Device::new(ResetTrigger(exit)))
    }
}

impl PioDevice for I8042 {
    fn read(&mut self, offset: u16, data: &mut [u8]) {
        let value = u8::try_from(offset).map(|o| self.0.read(o)).unwrap_or(0xff);
        data.fill(value);
    }

    fn write(&mut self, offset: u16, data: &[u8]) {
        if let (Some(&value), Ok(offset)) = (data.first(), u8::try_from(offset)) {
            let _ = self.0.write(offset, value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reset_command_ends_the_vm() {
        let exit = ExitSignal::new().unwrap();
        let mut dev = I8042::new(exit.clone());
        dev.write(4, &[0x01]);
        assert_eq!(exit.reason(), None);
        dev.write(4, &[0xfe]);
        assert_eq!(exit.reason(), Some(ExitReason::GuestShutdown));
    }
}
