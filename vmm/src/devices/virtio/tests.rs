//! Transport tests: registers, the status state machine, notifications,
//! interrupts, save/restore and dirty-page tracking, on a toy device.

use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use virtio_queue::QueueT;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

use super::testutil::{activate, guest_mem, negotiate, read32, write32, Driver};
use super::*;
use crate::snapshot::Persist;

const FEATURES: u64 = VIRTIO_F_VERSION_1 | VIRTIO_F_RING_EVENT_IDX | 0b101;

/// Fills every writable buffer with `fill` and reports what it saw.
#[derive(Default)]
struct Toy {
    fill: u8,
    log: Arc<Mutex<Vec<String>>>,
}

#[derive(Clone, Serialize, Deserialize)]
struct ToyState {
    fill: u8,
}

impl VirtioDevice for Toy {
    fn device_type(&self) -> u32 {
        42
    }
    fn queue_max_sizes(&self) -> &[u16] {
        &[64, 32]
    }
    fn avail_features(&self) -> u64 {
        FEATURES
    }
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let config = [1u8, 2, 3, 4, 5, 6, 7, self.fill];
        for (i, b) in data.iter_mut().enumerate() {
            *b = config.get(offset as usize + i).copied().unwrap_or(0);
        }
    }
    fn write_config(&mut self, offset: u64, data: &[u8]) {
        if offset == 7 {
            self.fill = data[0];
        }
    }
    fn activate(&mut self, acked: u64) -> Result<(), VirtioError> {
        self.log
            .lock()
            .unwrap()
            .push(format!("activate {acked:#x}"));
        Ok(())
    }
    fn queue_notify(&mut self, index: usize, ctx: &mut QueueContext<'_>) {
        let fill = self.fill;
        self.log.lock().unwrap().push(format!("notify {index}"));
        ctx.drain(index, |ctx, chain| {
            let data = vec![fill; chain.writable_len() as usize];
            ctx.write(chain, 0, &data).map_or(0, |_| data.len() as u32)
        });
    }
    fn reset(&mut self) {
        self.log.lock().unwrap().push("reset".into());
    }
}

impl Persist for Toy {
    type State = ToyState;
    type ConstructorArgs = ();
    type Error = std::io::Error;
    fn save(&self) -> ToyState {
        ToyState { fill: self.fill }
    }
    fn restore((): (), s: &ToyState) -> Result<Self, std::io::Error> {
        Ok(Toy {
            fill: s.fill,
            ..Default::default()
        })
    }
}

fn transport(mem: &GuestMemoryMmap) -> (MmioTransport<Toy>, EventFd, Arc<Mutex<Vec<String>>>) {
    let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
    let toy = Toy {
        fill: 0xab,
        ..Default::default()
    };
    let log = toy.log.clone();
    let t = MmioTransport::new(toy, mem.clone(), irq.try_clone().unwrap()).unwrap();
    (t, irq, log)
}

#[test]
fn identity_registers_and_config_space() {
    let mem = guest_mem(1 << 20);
    let (mut t, _, _) = transport(&mem);
    assert_eq!(read32(&mut t, 0x00), 0x7472_6976);
    assert_eq!(read32(&mut t, 0x04), 2);
    assert_eq!(read32(&mut t, 0x08), 42);
    assert_eq!(read32(&mut t, 0x0c), 0);
    write32(&mut t, 0x14, 0);
    assert_eq!(read32(&mut t, 0x10), FEATURES as u32);
    write32(&mut t, 0x14, 1);
    assert_eq!(read32(&mut t, 0x10), 1);
    write32(&mut t, 0x14, 2);
    assert_eq!(read32(&mut t, 0x10), 0);
    write32(&mut t, 0x30, 1);
    assert_eq!(read32(&mut t, 0x34), 32);
    write32(&mut t, 0x30, 2);
    assert_eq!(read32(&mut t, 0x34), 0, "no third queue");
    assert_eq!(read32(&mut t, 0xb0), u32::MAX, "no shared memory");
    assert_eq!(read32(&mut t, 0x100), 0x0403_0201);
    let mut w = [0u8; 2];
    t.read(0x106, &mut w);
    assert_eq!(w, [7, 0xab]);
    let mut b = [0u8; 1];
    t.read(0x200, &mut b);
    assert_eq!(b, [0], "past the config space");
    // Registers need aligned 32-bit accesses.
    t.read(0x00, &mut w);
    assert_eq!(w, [0, 0]);
    t.write(0x70, &[1]);
    assert_eq!(read32(&mut t, 0x70), 0);
}

#[test]
fn status_steps_must_come_in_order() {
    let mem = guest_mem(1 << 20);
    let (mut t, _, log) = transport(&mem);
    write32(&mut t, 0x70, status::DRIVER);
    assert_eq!(read32(&mut t, 0x70), 0, "DRIVER before ACKNOWLEDGE");
    write32(&mut t, 0x70, status::ACKNOWLEDGE);
    // Features cannot be written before DRIVER.
    write32(&mut t, 0x20, 0xffff_ffff);
    assert_eq!(t.acked_features(), 0);
    write32(&mut t, 0x70, status::ACKNOWLEDGE | status::DRIVER_OK);
    assert_eq!(read32(&mut t, 0x70), status::ACKNOWLEDGE);
    write32(&mut t, 0x70, status::ACKNOWLEDGE | status::DRIVER);
    // Without VERSION_1 the device refuses FEATURES_OK.
    write32(&mut t, 0x24, 0);
    write32(&mut t, 0x20, 1);
    let s = status::ACKNOWLEDGE | status::DRIVER;
    write32(&mut t, 0x70, s | status::FEATURES_OK);
    assert_eq!(read32(&mut t, 0x70), s);
    // Queue registers are closed before FEATURES_OK.
    write32(&mut t, 0x30, 0);
    write32(&mut t, 0x44, 1);
    assert_eq!(read32(&mut t, 0x44), 0);
    // Unoffered features are refused too.
    write32(&mut t, 0x24, 1);
    write32(&mut t, 0x20, 0b11);
    write32(&mut t, 0x70, s | status::FEATURES_OK);
    assert_eq!(read32(&mut t, 0x70), s);
    write32(&mut t, 0x20, 1);
    write32(&mut t, 0x70, s | status::FEATURES_OK);
    assert_eq!(read32(&mut t, 0x70), s | status::FEATURES_OK);
    // Features are frozen after FEATURES_OK; bits cannot be cleared.
    write32(&mut t, 0x20, 0);
    assert_eq!(t.acked_features(), VIRTIO_F_VERSION_1 | 1);
    write32(&mut t, 0x70, status::ACKNOWLEDGE);
    assert_eq!(read32(&mut t, 0x70), s | status::FEATURES_OK);
    assert!(log.lock().unwrap().is_empty());
}

#[test]
fn activation_notify_interrupt_and_reset() {
    let mem = guest_mem(1 << 20);
    let (mut t, irq, log) = transport(&mem);
    let mut q0 = Driver::new(&mem, 0x1000, 16);
    let q1 = Driver::new(&mem, 0x2000, 16);
    activate(&mut t, VIRTIO_F_VERSION_1, &[&q0, &q1], 16);
    assert!(t.is_activated());
    assert_eq!(
        log.lock().unwrap().as_slice(),
        ["reset", "activate 0x100000000"]
    );
    // Queue registers are closed once the device runs.
    write32(&mut t, 0x30, 0);
    write32(&mut t, 0x38, 8);
    assert_eq!(t.queues()[0].size(), 16);

    let head = q0.push(&[(0x10000, 8, true), (0x10100, 4, true)]);
    write32(&mut t, 0x50, 0);
    assert_eq!(q0.take_used(), [(head, 12)]);
    let mut buf = [0u8; 8];
    mem.read_slice(&mut buf, GuestAddress(0x10000)).unwrap();
    assert_eq!(buf, [0xab; 8]);
    assert_eq!(read32(&mut t, 0x60), INT_VRING);
    assert_eq!(irq.read().unwrap(), 1);
    write32(&mut t, 0x64, INT_VRING);
    assert_eq!(read32(&mut t, 0x60), 0);
    // Notifying a queue that does not exist does nothing.
    write32(&mut t, 0x50, 7);

    write32(&mut t, 0x70, 0);
    assert_eq!(read32(&mut t, 0x70), 0);
    assert_eq!(t.acked_features(), 0);
    assert!(t.queues().iter().all(|q| !q.ready() && q.next_avail() == 0));
    assert_eq!(log.lock().unwrap().last().unwrap(), "reset");
    // After reset notifications are ignored.
    q0.push(&[(0x10000, 8, true)]);
    write32(&mut t, 0x50, 0);
    assert!(q0.take_used().is_empty());
}

#[test]
fn activation_fails_when_a_queue_lies_outside_memory() {
    let mem = guest_mem(1 << 20);
    let (mut t, irq, log) = transport(&mem);
    let q0 = Driver::new(&mem, 0x1000, 16);
    negotiate(&mut t, VIRTIO_F_VERSION_1, &[&q0], 16);
    write32(&mut t, 0x30, 1);
    write32(&mut t, 0x38, 16);
    write32(&mut t, 0xa0, 0x4000_0000); // used ring far past RAM
    write32(&mut t, 0x44, 1);
    write32(&mut t, 0x70, 0xf);
    assert_eq!(read32(&mut t, 0x70), 0xf | status::DEVICE_NEEDS_RESET);
    assert!(!t.is_activated());
    assert_eq!(read32(&mut t, 0x60), INT_CONFIG);
    assert_eq!(irq.read().unwrap(), 1);
    assert!(!log
        .lock()
        .unwrap()
        .iter()
        .any(|l| l.starts_with("activate")));
}

#[test]
fn event_idx_is_applied_to_the_queues() {
    let mem = guest_mem(1 << 20);
    let (mut t, _, _) = transport(&mem);
    let mut q0 = Driver::new(&mem, 0x1000, 16);
    let q1 = Driver::new(&mem, 0x2000, 16);
    activate(
        &mut t,
        VIRTIO_F_VERSION_1 | VIRTIO_F_RING_EVENT_IDX,
        &[&q0, &q1],
        16,
    );
    assert!(t.queues().iter().all(|q| q.event_idx_enabled()));
    let head = q0.push(&[(0x10000, 8, true)]);
    write32(&mut t, 0x50, 0);
    assert_eq!(q0.take_used(), [(head, 8)]);
    // The device asked to be told about the next buffer (avail_event).
    let avail_event = mem
        .read_obj::<u16>(GuestAddress(q0.used_addr + 4 + 8 * 16))
        .unwrap();
    assert_eq!(avail_event, 1);
}

#[test]
fn save_restore_continues_where_it_stopped() {
    let mem = guest_mem(1 << 20);
    let (mut t, _, _) = transport(&mem);
    let mut q0 = Driver::new(&mem, 0x1000, 16);
    let q1 = Driver::new(&mem, 0x2000, 16);
    activate(&mut t, FEATURES & !0b100, &[&q0, &q1], 16);
    t.write(0x107, &[0x5a]);
    q0.push(&[(0x10000, 8, true)]);
    write32(&mut t, 0x50, 0);
    assert_eq!(q0.take_used().len(), 1);

    let state = t.save();
    let bytes = bincode::serialize(&state).unwrap();
    let state: VirtioMmioState<ToyState> = bincode::deserialize(&bytes).unwrap();
    assert_eq!(state.transport.queues[0].next_avail, 1);
    assert!(state.transport.queues[0].event_idx);
    let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
    let args = MmioRestoreArgs {
        mem: mem.clone(),
        irq,
        device: (),
    };
    let mut back = MmioTransport::<Toy>::restore(args, &state).unwrap();
    assert!(back.is_activated());
    assert_eq!(back.save().transport, state.transport);
    let head = q0.push(&[(0x11000, 4, true)]);
    write32(&mut back, 0x50, 0);
    assert_eq!(q0.take_used(), [(head, 4)]);
    assert_eq!(mem.read_obj::<u8>(GuestAddress(0x11000)).unwrap(), 0x5a);

    let mut bad = state.clone();
    bad.transport.queues.pop();
    let args = MmioRestoreArgs {
        mem: mem.clone(),
        irq: EventFd::new(0).unwrap(),
        device: (),
    };
    assert!(matches!(
        MmioTransport::<Toy>::restore(args, &bad),
        Err(VirtioError::QueueCount { .. })
    ));
    let mut bad = state;
    bad.transport.queues[0].desc_table = 0x1001;
    let args = MmioRestoreArgs {
        mem,
        irq: EventFd::new(0).unwrap(),
        device: (),
    };
    assert!(matches!(
        MmioTransport::<Toy>::restore(args, &bad),
        Err(VirtioError::QueueState { index: 0, .. })
    ));
}

#[test]
fn dirty_pages_are_reported_as_memory_file_pages() {
    let mem = GuestMemoryMmap::from_ranges(&[
        (GuestAddress(0), 0x10_0000),
        (GuestAddress(0x1_0000_0000), 0x10_0000),
    ])
    .unwrap();
    let (mut t, _, _) = transport(&mem);
    let mut q0 = Driver::new(&mem, 0x1000, 16);
    let q1 = Driver::new(&mem, 0x2000, 16);
    activate(&mut t, VIRTIO_F_VERSION_1, &[&q0, &q1], 16);
    q0.push(&[(0x1_0000_2ffe, 4, true)]);
    write32(&mut t, 0x50, 0);
    let pages = t.take_dirty_pages();
    // RAM pages 0x100.. are the second region; 0x1_0000_2ffe spans 2 and 3.
    for page in [0x100 + 2, 0x100 + 3, 1, 2] {
        assert!(pages.contains(page), "page {page:#x} in {pages:?}");
    }
    assert!(!pages.contains(0x100 + 4));
    // Only the used rings remain dirty after a take.
    let again = t.take_dirty_pages();
    assert!(!again.contains(0x102) && again.contains(1) && again.contains(2));
}

#[test]
fn slots_and_cmdline() {
    let s = MmioSlot::nth(0).unwrap();
    assert_eq!(s.cmdline(), "virtio_mmio.device=4K@0xd0000000:5");
    let s = MmioSlot::nth(1).unwrap();
    assert_eq!((s.base, s.irq), (0xd000_1000, 6));
    assert!(matches!(MmioSlot::nth(6), Err(VirtioError::NoSlot(6))));
}

#[test]
fn a_corrupt_available_index_does_not_hang_the_device() {
    let mem = guest_mem(1 << 20);
    let (mut t, _, log) = transport(&mem);
    let q0 = Driver::new(&mem, 0x1000, 16);
    let q1 = Driver::new(&mem, 0x2000, 16);
    activate(&mut t, VIRTIO_F_VERSION_1, &[&q0, &q1], 16);
    // 1000 chains "available" in a ring of 16.
    mem.write_obj(1000u16, GuestAddress(q0.avail_addr + 2))
        .unwrap();
    write32(&mut t, 0x50, 0);
    assert_eq!(log.lock().unwrap().last().unwrap(), "notify 0");
    assert_eq!(t.queues()[0].next_avail(), 0);
}
