//! The one trait every saved piece of a microVM implements (devices,
//! transports, the serial port): its state as plain serde data, and a
//! constructor from that data. It sits at the bottom of the VMM: devices
//! depend on it, it depends on nothing of theirs.

use serde::{Deserialize, Serialize};

/// Something whose state can be saved to plain data and rebuilt from it.
pub trait Persist: Sized {
    /// The saved state: plain data, encoded by [`super::format`].
    type State: Serialize + for<'de> Deserialize<'de>;
    /// What rebuilding needs beside the state (memory, fds, callbacks).
    type ConstructorArgs;
    /// Why rebuilding failed.
    type Error;
    /// The state as it is now.
    fn save(&self) -> Self::State;
    /// Rebuilds from `state`.
    fn restore(args: Self::ConstructorArgs, state: &Self::State) -> Result<Self, Self::Error>;
}
