//! The host's KVM: opening /dev/kvm and checking what the VMM relies on.

use kvm_bindings::{CpuId, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::{Cap, Kvm};

/// Capabilities without which the VMM cannot run a guest.
pub const REQUIRED_CAPS: &[(Cap, &str)] = &[
    (Cap::Irqchip, "Irqchip"),
    (Cap::UserMemory, "UserMemory"),
    (Cap::SetTssAddr, "SetTssAddr"),
    (Cap::Pit2, "Pit2"),
    (Cap::PitState2, "PitState2"),
    (Cap::ImmediateExit, "ImmediateExit"),
    (Cap::AdjustClock, "AdjustClock"),
    (Cap::VcpuEvents, "VcpuEvents"),
    (Cap::Xcrs, "Xcrs"),
    (Cap::Xsave, "Xsave"),
    (Cap::Irqfd, "Irqfd"),
];

/// Errors while opening or interrogating KVM.
#[derive(Debug, thiserror::Error)]
pub enum KvmError {
    #[error("cannot open /dev/kvm: {0} (is KVM loaded and are you allowed to use it?)")]
    Open(kvm_ioctls::Error),
    #[error("KVM API version {0} is not supported (need 12)")]
    ApiVersion(i32),
    #[error("KVM lacks the required capability {0}")]
    MissingCap(&'static str),
    #[error("cannot read the CPUID KVM supports: {0}")]
    SupportedCpuid(kvm_ioctls::Error),
}

/// An open /dev/kvm whose capabilities have been checked.
#[derive(Debug)]
pub struct KvmContext {
    pub kvm: Kvm,
    pub max_vcpus: usize,
}

impl KvmContext {
    /// Opens /dev/kvm and checks the API version and every required capability.
    pub fn open() -> Result<Self, KvmError> {
        let kvm = Kvm::new().map_err(KvmError::Open)?;
        let version = kvm.get_api_version();
        if version != 12 {
            return Err(KvmError::ApiVersion(version));
        }
        for (cap, name) in REQUIRED_CAPS {
            if !kvm.check_extension(*cap) {
                return Err(KvmError::MissingCap(name));
            }
        }
        let max_vcpus = kvm.get_max_vcpus();
        Ok(Self { kvm, max_vcpus })
    }

    /// The CPUID leaves KVM can expose, before per-vCPU normalisation.
    pub fn supported_cpuid(&self) -> Result<CpuId, KvmError> {
        self.kvm
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(KvmError::SupportedCpuid)
    }
}
