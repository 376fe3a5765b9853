//! Saved state of virtio-net: the tap's name, the guest's MAC and the rate
//! limits. The queues are the transport's (saved with it); the tap is
//! reopened by name on restore (in the restoring VMM's network namespace,
//! where each clone has its own tap of that name). Frames in flight are
//! not saved: one read from the tap but not yet delivered is lost, as on a
//! lossy link, and TCP resends it.

use std::path::PathBuf;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use torpor_vmm_api::launch::{MacAddr, NetSpec, RateLimit};

use super::device::{NetDevice, NetError};
use crate::devices::rate_limiter::{Clock, MonotonicClock};
use crate::snapshot::Persist;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetState {
    pub tap: String,
    pub mac: [u8; 6],
    pub rx: RateLimit,
    pub tx: RateLimit,
    /// The namespace the tap was opened in (`None`: the VMM's own).
    pub netns: Option<PathBuf>,
}

/// What restoring a net device needs besides its state.
#[derive(Clone, Default, Debug)]
pub struct NetRestoreArgs {
    /// The clone's tap and limits; `None` reopens the saved tap name with
    /// the saved limits. A MAC, if given, must be the saved one.
    pub spec: Option<NetSpec>,
    /// The rate limiters' clock; `None` is the host's monotonic clock.
    pub clock: Option<Arc<dyn Clock>>,
}

impl Persist for NetDevice {
    type State = NetState;
    type ConstructorArgs = NetRestoreArgs;
    type Error = NetError;

    fn save(&self) -> NetState {
        NetState {
            tap: self.tap.name().to_string(),
            mac: self.mac.0,
            rx: self.rx_limit.clone(),
            tx: self.tx_limit.clone(),
            netns: self.netns.clone(),
        }
    }

    fn restore(args: NetRestoreArgs, state: &NetState) -> Result<Self, NetError> {
        let saved = MacAddr(state.mac);
        let spec = match args.spec {
            Some(spec) => {
                if let Some(asked) = spec.mac.filter(|m| *m != saved) {
                    return Err(NetError::MacChanged { saved, asked });
                }
                NetSpec {
                    mac: Some(saved),
                    ..spec
                }
            }
            None => NetSpec {
                tap: state.tap.clone(),
                mac: Some(saved),
                rx: state.rx.clone(),
                tx: state.tx.clone(),
                netns: state.netns.clone(),
            },
        };
        let clock = args
            .clock
            .unwrap_or_else(|| Arc::new(MonotonicClock::default()));
        NetDevice::with_clock(&spec, clock)
    }
}
