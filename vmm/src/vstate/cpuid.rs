//! CPUID normalisation: KVM's supported CPUID adjusted per vCPU so that the
//! guest sees a consistent topology and knows it runs under a hypervisor.

use kvm_bindings::CpuId;

const LEAF_FEATURES: u32 = 0x1;
const LEAF_CACHE_PARAMS: u32 = 0x4;
const LEAF_PMU: u32 = 0xa;
const LEAF_TOPOLOGY: u32 = 0xb;
const LEAF_TOPOLOGY_V2: u32 = 0x1f;

const LEAF_KVM_FEATURES: u32 = 0x4000_0001;

const ECX_HYPERVISOR: u32 = 1 << 31;
const EDX_HTT: u32 = 1 << 28;

/// KVM's asynchronous page faults (`KVM_FEATURE_ASYNC_PF`, `_VMEXIT`,
/// `_INT`: bits 4, 10, 14 of leaf 0x4000_0001 EAX). Off: a guest task
/// waiting for a page KVM fetches in the background is woken by a token
/// only the KVM that issued it knows, so a snapshot taken meanwhile wakes
/// in a VMM whose KVM never completes it (Linux guests without `_INT` use
/// none). Cloud Hypervisor turns `_INT` off as well.
const EAX_KVM_ASYNC_PF: u32 = 1 << 4 | 1 << 10 | 1 << 14;

/// Rewrites `cpuid` for vCPU `apic_id` of a VM with `vcpu_count` vCPUs:
/// one socket, one thread per core, one core per vCPU.
pub fn normalize(cpuid: &mut CpuId, apic_id: u8, vcpu_count: u8) {
    for entry in cpuid.as_mut_slice() {
        match entry.function {
            LEAF_FEATURES => {
                // EBX: [31:24] initial APIC id, [23:16] logical CPUs per
                // package, [15:8] CLFLUSH line size in qwords.
                entry.ebx = (u32::from(apic_id) << 24) | (u32::from(vcpu_count) << 16) | (8 << 8);
                entry.ecx |= ECX_HYPERVISOR;
                if vcpu_count > 1 {
                    entry.edx |= EDX_HTT;
                } else {
                    entry.edx &= !EDX_HTT;
                }
            }
            LEAF_CACHE_PARAMS => {
                // EAX[31:26]: cores per package - 1; EAX[25:14]: threads
                // sharing this cache - 1 (caches are per core here).
                entry.eax &= !(0x3f << 26 | 0xfff << 14);
                entry.eax |= (u32::from(vcpu_count.max(1)) - 1) << 26;
            }
            LEAF_KVM_FEATURES => entry.eax &= !EAX_KVM_ASYNC_PF,
            LEAF_PMU => {
                // No virtual PMU: it costs exits and leaks host state.
                entry.eax = 0;
                entry.ebx = 0;
                entry.ecx = 0;
                entry.edx = 0;
            }
            LEAF_TOPOLOGY | LEAF_TOPOLOGY_V2 => {
                entry.edx = u32::from(apic_id);
                match entry.index {
                    // SMT level: one thread per core.
                    0 => {
                        entry.eax = 0;
                        entry.ebx = 1;
                        entry.ecx = 1 << 8;
                    }
                    // Core level: every vCPU is a core of one package.
                    1 => {
                        entry.eax = bits_for(vcpu_count);
                        entry.ebx = u32::from(vcpu_count);
                        entry.ecx = (2 << 8) | 1;
                    }
                    n => {
                        entry.eax = 0;
                        entry.ebx = 0;
                        entry.ecx = n;
                    }
                }
            }
            _ => {}
        }
    }
}

/// Number of APIC-id bits needed to number `count` cores.
fn bits_for(count: u8) -> u32 {
    let count = u32::from(count.max(1));
    32 - (count - 1).leading_zeros()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_bindings::kvm_cpuid_entry2;

    fn entry(function: u32, index: u32) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 {
            function,
            index,
            ..Default::default()
        }
    }

    #[test]
    fn sets_apic_id_topology_and_hypervisor_bit() {
        let mut cpuid = CpuId::from_entries(&[
            entry(1, 0),
            entry(0xb, 0),
            entry(0xb, 1),
            entry(0xa, 0),
            entry(LEAF_KVM_FEATURES, 0),
        ])
        .unwrap();
        cpuid.as_mut_slice()[3].eax = 0x0704_0802;
        // kvmclock (0, 3), async PF (4, 10, 14), steal time (5), PV EOI (6).
        cpuid.as_mut_slice()[4].eax = 0x4479;
        normalize(&mut cpuid, 3, 4);
        let e = cpuid.as_slice();
        assert_eq!(e[4].eax, 0x0069, "only the async PF bits go");
        assert_eq!(e[0].ebx >> 24, 3);
        assert_eq!((e[0].ebx >> 16) & 0xff, 4);
        assert_ne!(e[0].ecx & ECX_HYPERVISOR, 0);
        assert_ne!(e[0].edx & EDX_HTT, 0);
        assert_eq!(e[1].edx, 3);
        assert_eq!(e[2].ebx, 4);
        assert_eq!(e[2].eax, 2);
        assert_eq!(e[3].eax, 0);
    }

    #[test]
    fn apic_bits() {
        assert_eq!(bits_for(1), 0);
        assert_eq!(bits_for(2), 1);
        assert_eq!(bits_for(3), 2);
        assert_eq!(bits_for(4), 2);
        assert_eq!(bits_for(5), 3);
    }
}
