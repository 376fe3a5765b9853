//! virtio-balloon with free page reporting and the statistics queue:
//! memory a running guest gives up goes back to the host. One device
//! thread per device (a [`BalloonWorker`]) takes the guest's buffers.

mod device;
mod kind;
mod persist;
#[cfg(test)]
mod tests;

pub use device::{
    BalloonDevice, BalloonError, F_DEFLATE_ON_OOM, F_MUST_TELL_HOST, F_REPORTING, F_STATS_VQ,
    PAGES_PER_MIB, PAGE_SIZE, QUEUES, QUEUE_SIZE, STAT_LEN, TOKEN_WAKE, TYPE_BALLOON,
};
pub use kind::BalloonKind;
pub use persist::{BalloonRestoreArgs, BalloonState};

use crate::devices::virtio::MmioTransport;

/// A balloon on its virtio-mmio transport: what goes on the MMIO bus and
/// what its thread locks.
pub type BalloonMmio = MmioTransport<BalloonDevice>;

/// The balloon device thread; stopped and joined on drop.
pub type BalloonWorker = crate::devices::worker::DeviceWorker;

/// Sets the balloon's target and tells the driver (a configuration
/// change: new generation, config interrupt).
pub fn set_target(t: &mut BalloonMmio, mib: u64) -> Result<(), BalloonError> {
    t.device_mut().set_target_mib(mib)?;
    t.config_changed();
    Ok(())
}
