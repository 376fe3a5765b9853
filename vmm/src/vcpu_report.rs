//! The `vcpu_state` answer made from KVM's structures: what a saved
//! vCPU's registers, events and local APIC page say, and the IOAPIC's
//! redirection table, in the control protocol's terms
//! ([`torpor_vmm_api::vcpus`]). Beside `vm_state`, whose saved vCPU it
//! reads (not in `vstate`: `vm_state` imports from there).

use kvm_bindings::{
    kvm_irqchip, kvm_lapic_state, KVM_MP_STATE_HALTED, KVM_MP_STATE_INIT_RECEIVED,
    KVM_MP_STATE_RUNNABLE, KVM_MP_STATE_SIPI_RECEIVED, KVM_MP_STATE_UNINITIALIZED,
};
use torpor_vmm_api::vcpus::{ApicReport, IoapicPin, VcpuReport};

use crate::vm_state::VcpuState;

/// RFLAGS.IF.
const RFLAGS_IF: u64 = 1 << 9;

// Local APIC register offsets in its 1 KiB page (Intel SDM vol. 3, 11.4.1).
const APIC_TPR: usize = 0x80;
const APIC_PPR: usize = 0xa0;
const APIC_SVR: usize = 0xf0;
const APIC_ISR: usize = 0x100;
const APIC_IRR: usize = 0x200;
const APIC_LVT_TIMER: usize = 0x320;
const APIC_TIMER_INITIAL: usize = 0x380;
const APIC_TIMER_CURRENT: usize = 0x390;

// An IOAPIC redirection entry's fields (82093AA, 3.2.4).
const RTE_LEVEL: u64 = 1 << 15;
const RTE_REMOTE_IRR: u64 = 1 << 14;
const RTE_MASKED: u64 = 1 << 16;

/// What vCPU `index`'s saved state says.
pub fn vcpu(index: u8, s: &VcpuState) -> VcpuReport {
    let ev = &s.vcpu_events;
    VcpuReport {
        index,
        rip: s.regs.rip,
        rsp: s.regs.rsp,
        rflags: s.regs.rflags,
        interrupts_enabled: s.regs.rflags & RFLAGS_IF != 0,
        cpl: s.sregs.cs.dpl,
        cr0: s.sregs.cr0,
        cr3: s.sregs.cr3,
        cr4: s.sregs.cr4,
        efer: s.sregs.efer,
        mp_state: mp_state(s.mp_state.mp_state),
        injected_interrupt: (ev.interrupt.injected != 0).then_some(ev.interrupt.nr),
        exception: (ev.exception.injected != 0 || ev.exception.pending != 0)
            .then_some(ev.exception.nr),
        interrupt_shadow: ev.interrupt.shadow != 0,
        nmi_pending: ev.nmi.pending != 0,
        nmi_masked: ev.nmi.masked != 0,
        apic: apic(&s.lapic),
    }
}

fn mp_state(state: u32) -> String {
    match state {
        KVM_MP_STATE_RUNNABLE => "runnable".into(),
        KVM_MP_STATE_UNINITIALIZED => "uninitialized".into(),
        KVM_MP_STATE_INIT_RECEIVED => "init_received".into(),
        KVM_MP_STATE_HALTED => "halted".into(),
        KVM_MP_STATE_SIPI_RECEIVED => "sipi_received".into(),
        other => format!("other({other})"),
    }
}

/// The 32-bit APIC register at `offset`.
fn reg(lapic: &kvm_lapic_state, offset: usize) -> u32 {
    let b = |i: usize| lapic.regs[offset + i] as u8;
    u32::from_le_bytes([b(0), b(1), b(2), b(3)])
}

/// The vectors set in the 256-bit register starting at `offset` (eight
/// 32-bit words, 16 bytes apart), lowest first.
fn vectors(lapic: &kvm_lapic_state, offset: usize) -> Vec<u8> {
    (0..8u8)
        .flat_map(|word| {
            let bits = reg(lapic, offset + usize::from(word) * 0x10);
            (0..32u8)
                .filter(move |bit| bits & (1 << bit) != 0)
                .map(move |bit| word * 32 + bit)
        })
        .collect()
}

fn apic(lapic: &kvm_lapic_state) -> ApicReport {
    ApicReport {
        tpr: reg(lapic, APIC_TPR) as u8,
        ppr: reg(lapic, APIC_PPR) as u8,
        svr: reg(lapic, APIC_SVR),
        isr: vectors(lapic, APIC_ISR),
        irr: vectors(lapic, APIC_IRR),
        timer_lvt: reg(lapic, APIC_LVT_TIMER),
        timer_initial_count: reg(lapic, APIC_TIMER_INITIAL),
        timer_current_count: reg(lapic, APIC_TIMER_CURRENT),
    }
}

/// The IOAPIC's unmasked pins and its request register, from
/// `KVM_GET_IRQCHIP(KVM_IRQCHIP_IOAPIC)`.
pub fn ioapic(chip: &kvm_irqchip) -> (Vec<IoapicPin>, u32) {
    // SAFETY: KVM filled `chip` for the IOAPIC (the caller asked for that
    // chip id), so its `ioapic` member is the one written; every bit
    // pattern of its plain integers, and of a redirection entry's `bits`,
    // is a valid value.
    let (irr, entries) = unsafe {
        let state = chip.chip.ioapic;
        (state.irr, state.redirtbl.map(|e| e.bits))
    };
    let pins = entries
        .iter()
        .enumerate()
        .filter(|(_, &bits)| bits & RTE_MASKED == 0)
        .map(|(pin, &bits)| IoapicPin {
            pin: pin as u8,
            vector: bits as u8,
            level: bits & RTE_LEVEL != 0,
            remote_irr: bits & RTE_REMOTE_IRR != 0,
            dest: (bits >> 56) as u8,
        })
        .collect();
    (pins, irr)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_bindings::{kvm_ioapic_state, KVM_IRQCHIP_IOAPIC};

    fn set(lapic: &mut kvm_lapic_state, offset: usize, value: u32) {
        for (i, b) in value.to_le_bytes().into_iter().enumerate() {
            lapic.regs[offset + i] = b as _;
        }
    }

    #[test]
    fn the_apic_page_reads_as_vectors_and_registers() {
        let mut lapic = kvm_lapic_state::default();
        set(&mut lapic, APIC_TPR, 0x20);
        set(&mut lapic, APIC_SVR, 0x1ff);
        // Vector 0x31 requested (word 1, bit 17); 0xec in service (word 7,
        // bit 12) and vector 3 (word 0).
        set(&mut lapic, APIC_IRR + 0x10, 1 << 17);
        set(&mut lapic, APIC_ISR, 1 << 3);
        set(&mut lapic, APIC_ISR + 7 * 0x10, 1 << 12);
        set(&mut lapic, APIC_TIMER_INITIAL, 0x1234_5678);
        let a = apic(&lapic);
        assert_eq!((a.tpr, a.svr), (0x20, 0x1ff));
        assert_eq!(a.irr, vec![0x31]);
        assert_eq!(a.isr, vec![3, 0xec]);
        assert_eq!(a.timer_initial_count, 0x1234_5678);
    }

    #[test]
    fn the_ioapic_shows_its_unmasked_pins() {
        let mut state = kvm_ioapic_state {
            irr: 1 << 5,
            ..Default::default()
        };
        for e in state.redirtbl.iter_mut() {
            e.bits = RTE_MASKED;
        }
        state.redirtbl[5].bits = 0x31 | RTE_LEVEL | RTE_REMOTE_IRR | (1 << 56);
        let mut chip = kvm_irqchip {
            chip_id: KVM_IRQCHIP_IOAPIC,
            ..Default::default()
        };
        chip.chip.ioapic = state;
        let (pins, irr) = ioapic(&chip);
        assert_eq!(irr, 1 << 5);
        assert_eq!(
            pins,
            vec![IoapicPin {
                pin: 5,
                vector: 0x31,
                level: true,
                remote_irr: true,
                dest: 1
            }]
        );
    }

    #[test]
    fn mp_states_have_names() {
        assert_eq!(mp_state(KVM_MP_STATE_HALTED), "halted");
        assert_eq!(mp_state(42), "other(42)");
    }
}
