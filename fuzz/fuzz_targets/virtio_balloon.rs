//! virtio-balloon from a hostile driver: page lists on the inflate and
//! deflate queues, free page reports and statistics buffers of any shape,
//! in input-built guest memory; the device runs a few epoll rounds as its
//! thread would (discarding whatever in-range pages the input names).
//!
//! Input: flags (bit 0 EVENT_IDX, bit 1 STATS_VQ, bit 2 REPORTING), queue
//! size, four ring triples (see `torpor_fuzz::queue_addr`), then the guest
//! memory image.
#![no_main]

use std::sync::Mutex;

use libfuzzer_sys::fuzz_target;
use torpor_fuzz::{guest_mem, notify, queue_addr, Input, MEM_SIZE};
use torpor_vmm::devices::balloon::{BalloonDevice, BalloonMmio, F_REPORTING, F_STATS_VQ};
use torpor_vmm::devices::virtio::driver::{negotiate, write32, QueueAddrs};
use torpor_vmm::devices::virtio::{status, VIRTIO_F_RING_EVENT_IDX, VIRTIO_F_VERSION_1};
use torpor_vmm::devices::worker::{poll_once, EpollDevice};
use vmm_sys_util::eventfd::EventFd;

fuzz_target!(|data: &[u8]| {
    let mut input = Input(data);
    let flags = input.u8();
    let size = match input.u8() {
        s @ 0..=7 => 1u16 << s,
        8 => 256,
        s => u16::from(s),
    };
    let rings: Vec<(u64, u64, u64)> = (0..4)
        .map(|_| {
            (
                queue_addr(input.u16()),
                queue_addr(input.u16()),
                queue_addr(input.u16()),
            )
        })
        .collect();
    let mut features = VIRTIO_F_VERSION_1;
    for (bit, feature) in [
        (1, VIRTIO_F_RING_EVENT_IDX),
        (2, F_STATS_VQ),
        (4, F_REPORTING),
    ] {
        if flags & bit != 0 {
            features |= feature;
        }
    }
    let dev = BalloonDevice::new(MEM_SIZE as u64).expect("balloon device");
    let mem = guest_mem(input.rest());
    let irq = EventFd::new(libc::EFD_NONBLOCK).expect("eventfd");
    let mut t = BalloonMmio::new(dev, mem, irq).expect("transport");
    let refs: Vec<&dyn QueueAddrs> = rings.iter().map(|r| r as _).collect();
    negotiate(&mut t, features, &refs, size);
    let s = status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK;
    write32(&mut t, 0x70, s);
    // The driver reports its size (any value).
    write32(&mut t, 0x104, u32::from(flags) << 12);
    let epoll = t.device().epoll();
    let t = Mutex::new(t);
    for queue in [2, 0, 1, 3, 2] {
        notify(&mut *t.lock().unwrap(), queue);
        let _ = poll_once(&t, &epoll, Some(0));
    }
    // Ask for fresh statistics: a held buffer goes back.
    let _ = t.lock().unwrap().device_mut().status();
    let _ = poll_once(&t, &epoll, Some(0));
});
