//! The signals the VMM's own threads send each other. Declared at the
//! bottom: the threads that send or handle one and the seccomp filters
//! that allow sending it all name it here, none of them the others.

use vmm_sys_util::signal::SIGRTMIN;

/// Kicks a vCPU thread out of `KVM_RUN` (its handler sets the thread's
/// `immediate_exit`; see `vstate::vcpu`). Sent with `tgkill` by the
/// control thread and by the thread that pauses the vCPUs.
pub(crate) fn vcpu_kick() -> i32 {
    SIGRTMIN()
}
