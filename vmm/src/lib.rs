//! torpor's VMM: one process per microVM on the rust-vmm crates.
//!
//! Boot order (see docs/vmm.md, "Boot order"): [`vstate::kvm`] opens KVM,
//! [`vstate::vm`] creates the VM, [`vstate::memory`] maps guest RAM,
//! [`boot`] loads the kernel, [`devices`] wires serial and i8042,
//! [`vstate::vcpu`] configures and runs the vCPUs, [`control`] serves the
//! per-VM socket, and [`microvm`] ties them together until the VM exits.

pub mod boot;
pub mod builder;
mod confine;
pub mod control;
pub mod devices;
pub mod dirty;
pub mod doctor;
pub mod exit;
pub mod fork_server;
pub mod fsmagic;
pub mod identity;
pub mod jail;
pub mod launch;
pub mod layout;
pub mod logging;
pub mod microvm;
pub mod mptable;
pub mod restore;
pub mod seccomp;
pub mod signals;
pub mod snapshot;
pub mod standby;
pub mod uffd;
pub mod uffd_abi;
pub mod vcpu_report;
pub mod virtio_devices;
pub mod vm_state;
pub mod vstate;

pub use builder::{SerialOutput, VmConfig, DEFAULT_CMDLINE};
pub use exit::ExitReason;
pub use microvm::{boot, restore, RunError, RunReport};
pub use standby::standby;
