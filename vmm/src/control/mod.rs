//! The per-VM control socket. The protocol's types and its client live in
//! the contract crate (`torpor_vmm_api::control`), shared with the pod;
//! this module serves it.

pub mod server;

pub use server::{bind, ControlServer, SpareControl, VmController};
pub use torpor_vmm_api::control::*;
