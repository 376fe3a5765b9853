//! Saved state of virtio-balloon: the target, the size the guest reported,
//! the statistics buffer the device holds (the driver waits for it back,
//! so a restored device must still hold it) and the counters. Discarded
//! pages need nothing: their content is undefined to the guest, and a
//! snapshot stores whatever they read as.

use serde::{Deserialize, Serialize};
use torpor_vmm_api::control::BalloonCounters;

use super::device::{BalloonDevice, BalloonError};
use crate::snapshot::Persist;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BalloonState {
    pub mem_bytes: u64,
    pub target_pages: u32,
    pub actual_pages: u32,
    pub stats_head: Option<u16>,
    pub counters: BalloonCounters,
}

/// What restoring a balloon needs besides its state: nothing (the guest's
/// memory size is saved with it).
#[derive(Debug, Clone, Copy, Default)]
pub struct BalloonRestoreArgs;

impl Persist for BalloonDevice {
    type State = BalloonState;
    type ConstructorArgs = BalloonRestoreArgs;
    type Error = BalloonError;

    fn save(&self) -> BalloonState {
        self.save_state()
    }

    fn restore(_args: BalloonRestoreArgs, state: &BalloonState) -> Result<Self, BalloonError> {
        BalloonDevice::from_state(state)
    }
}
