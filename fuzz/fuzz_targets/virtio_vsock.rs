//! virtio-vsock from a hostile driver: packets on the tx queue (headers,
//! payloads, any operation, any ports), rx buffers of any shape and the
//! event queue, in input-built guest memory; the device runs a few epoll
//! rounds as its thread would.
//!
//! Input: flags, queue size, three ring triples (rx, tx, event; see
//! `torpor_fuzz::program`), then the guest memory image.
#![no_main]

use std::sync::Mutex;

use libfuzzer_sys::fuzz_target;
use torpor_fuzz::{guest_mem, notify, program, scratch, Input};
use torpor_vmm::devices::vsock::{poll_once, VsockConfig, VsockDevice, VsockMmio};
use vmm_sys_util::eventfd::EventFd;

fuzz_target!(|data: &[u8]| {
    let mut input = Input(data);
    let header: Vec<u8> = input.bytes(2 + 3 * 6).to_vec();
    let uds = scratch().join("v.sock");
    let _ = std::fs::remove_file(&uds);
    let dev = VsockDevice::new(&VsockConfig::new(uds)).expect("vsock device");
    let mem = guest_mem(input.rest());
    let irq = EventFd::new(libc::EFD_NONBLOCK).expect("eventfd");
    let mut t = VsockMmio::new(dev, mem, irq).expect("transport");
    program(&mut t, &mut Input(&header), 3);
    let epoll = t.device().epoll();
    let t = Mutex::new(t);
    for queue in [1, 0, 2, 1] {
        notify(&mut *t.lock().unwrap(), queue);
        let _ = poll_once(&t, &epoll, Some(0));
    }
});
