//! Which calls each kind of VMM thread may make: the one table from a
//! [`ThreadKind`] to the declarations of the mechanisms that run on it.
//!
//! Each mechanism declares the system calls it makes, next to the code
//! that makes them (`devices/worker.rs`'s event loop, `vstate/vcpu.rs`'s
//! KVM_RUN, `snapshot/mod.rs`'s file writes, ...). This table assembles a
//! thread's allow-list from the mechanisms that run on that thread;
//! [`crate::seccomp`] adds the base list every thread gets, compiles the
//! filters and installs them (docs/security.md, "Seccomp"). A mechanism
//! that moves to another thread moves its declaration here, nothing else.
//!
//! Order matters where two declarations add rules for the same call (the
//! ioctl requests, in particular, are tried in the order declared).

use crate::devices::{block, net, vsock, worker};
use crate::seccomp::{Declare, ThreadKind};
use crate::{builder, control, dirty, microvm, restore, snapshot, uffd, vm_state, vstate};

/// The main thread once the VM runs: waits for the end, answers a
/// standby's restore request, stops the vCPUs.
const MAIN: &[Declare] = &[microvm::main_syscalls, vstate::vcpu::kick_syscalls];

/// The control server: its socket, and what it does for a request
/// (snapshots, vCPU kicks, VM state, dirty pages).
const CONTROL: &[Declare] = &[
    control::server::syscalls,
    snapshot::write_syscalls,
    vstate::vcpu::kick_syscalls,
    vm_state::read_syscalls,
    dirty::scan_syscalls,
];

/// A vCPU: the guest's exits are handled on it, so the devices that serve
/// them there (block requests, a vsock driver reset, net offloads) declare
/// what that takes, beside KVM_RUN and the snapshot's state reads.
const VCPU: &[Declare] = &[
    block::vcpu_syscalls,
    vsock::worker::vcpu_syscalls,
    vstate::vcpu::vcpu_syscalls,
    net::vcpu_syscalls,
];

const VSOCK: &[Declare] = &[worker::event_loop_syscalls, vsock::worker::worker_syscalls];

const NET: &[Declare] = &[worker::event_loop_syscalls, net::worker_syscalls];

/// The balloon worker's discards (madvise MADV_DONTNEED) are in the base
/// list: its event loop is all it adds.
const BALLOON: &[Declare] = &[worker::event_loop_syscalls];

const UFFD_PAGES: &[Declare] = &[uffd::server::syscalls];

const WORKING_SET: &[Declare] = &[restore::uffd_backend::working_set_syscalls];

const CONSOLE_OPEN: &[Declare] = &[builder::console_open_syscalls];

/// The declarations that make up `kind`'s allow-list, beyond the base
/// list (a [`crate::seccomp::Needs`], for [`crate::seccomp::init`]).
pub(crate) fn needs(kind: ThreadKind) -> &'static [Declare] {
    match kind {
        ThreadKind::Main => MAIN,
        ThreadKind::Control => CONTROL,
        ThreadKind::Vcpu => VCPU,
        ThreadKind::Vsock => VSOCK,
        ThreadKind::Net => NET,
        ThreadKind::Balloon => BALLOON,
        ThreadKind::UffdPages => UFFD_PAGES,
        ThreadKind::WorkingSet => WORKING_SET,
        ThreadKind::ConsoleOpen => CONSOLE_OPEN,
    }
}
