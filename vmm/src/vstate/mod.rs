//! KVM state owned by one microVM: the KVM handle, the VM, its vCPUs and
//! guest memory.

pub mod cpuid;
pub mod kvm;
pub mod memory;
pub mod regs;
pub mod vcpu;
pub mod vm;
