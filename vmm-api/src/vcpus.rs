//! The answer to the control socket's `vcpu_state` request: where each
//! vCPU of a running VM stands and which interrupts wait for it, read to
//! tell why a guest stopped answering (its interrupts masked, a vector
//! stuck in service, halted with nothing pending, ...). The VMM reads it
//! from KVM; the host service only logs it.

use serde::{Deserialize, Serialize};

/// Every vCPU's state and the IOAPIC's unmasked pins.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VcpuStates {
    pub vcpus: Vec<VcpuReport>,
    /// The IOAPIC's pins that are not masked (a masked pin delivers
    /// nothing, whatever its device raises).
    pub ioapic: Vec<IoapicPin>,
    /// The IOAPIC's interrupt request register: pins raised and not yet
    /// delivered.
    pub ioapic_irr: u32,
}

/// One vCPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VcpuReport {
    pub index: u8,
    pub rip: u64,
    pub rsp: u64,
    pub rflags: u64,
    /// RFLAGS.IF: the guest takes maskable interrupts.
    pub interrupts_enabled: bool,
    /// Privilege level of the code running (CS's DPL).
    pub cpl: u8,
    pub cr0: u64,
    pub cr3: u64,
    pub cr4: u64,
    pub efer: u64,
    /// KVM's multiprocessing state: "runnable", "halted", "uninitialized",
    /// "init_received", "sipi_received" or "other(N)".
    pub mp_state: String,
    /// An interrupt KVM injected and the guest has not taken yet.
    pub injected_interrupt: Option<u8>,
    /// An exception injected or pending, by vector.
    pub exception: Option<u8>,
    /// The instruction after STI or MOV SS: interrupts held off for one
    /// instruction.
    pub interrupt_shadow: bool,
    pub nmi_pending: bool,
    pub nmi_masked: bool,
    pub apic: ApicReport,
}

/// The vCPU's local APIC, from its register page.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApicReport {
    /// Task priority: vectors at or below its class wait.
    pub tpr: u8,
    /// Processor priority (the higher of TPR and the highest vector in
    /// service).
    pub ppr: u8,
    /// Spurious-interrupt vector register (bit 8: the APIC is enabled).
    pub svr: u32,
    /// Vectors in service (delivered, no EOI yet), lowest first.
    pub isr: Vec<u8>,
    /// Vectors requested and not yet delivered, lowest first.
    pub irr: Vec<u8>,
    /// The timer's LVT entry (bit 16: masked; bits 17-18: its mode).
    pub timer_lvt: u32,
    pub timer_initial_count: u32,
    pub timer_current_count: u32,
}

/// One IOAPIC pin as its redirection entry says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct IoapicPin {
    pub pin: u8,
    pub vector: u8,
    /// Level-triggered (the device's line held until acknowledged).
    pub level: bool,
    /// A level-triggered interrupt delivered and not yet acknowledged by
    /// an EOI: the pin delivers nothing more until it is.
    pub remote_irr: bool,
    pub dest: u8,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_round_trips_as_json() {
        let states = VcpuStates {
            vcpus: vec![VcpuReport {
                index: 0,
                rip: 0xffff_ffff_8100_0000,
                rsp: 0x1000,
                rflags: 0x246,
                interrupts_enabled: true,
                cpl: 0,
                cr0: 0x8005_0033,
                cr3: 0x10_0000,
                cr4: 0x20,
                efer: 0xd01,
                mp_state: "halted".into(),
                injected_interrupt: None,
                exception: None,
                interrupt_shadow: false,
                nmi_pending: false,
                nmi_masked: false,
                apic: ApicReport {
                    tpr: 0,
                    ppr: 0,
                    svr: 0x1ff,
                    isr: vec![],
                    irr: vec![0x31],
                    timer_lvt: 0x10000,
                    timer_initial_count: 0,
                    timer_current_count: 0,
                },
            }],
            ioapic: vec![IoapicPin {
                pin: 5,
                vector: 0x31,
                level: false,
                remote_irr: false,
                dest: 0,
            }],
            ioapic_irr: 1 << 5,
        };
        let json = serde_json::to_string(&states).unwrap();
        assert!(json.contains(r#""irr":[49]"#), "{json}");
        assert_eq!(serde_json::from_str::<VcpuStates>(&json).unwrap(), states);
    }
}
