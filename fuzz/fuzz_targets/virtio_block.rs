//! virtio-blk requests from a hostile driver: request headers, data and
//! status descriptors, all in input-built guest memory, against a small
//! disk with a copy-on-write overlay (read-only if the input says).
//!
//! Input: a mode byte, flags, queue size, ring addresses (see
//! `torpor_fuzz::program`), then the guest memory image.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use torpor_fuzz::{guest_mem, notify, program, scratch, Input};
use torpor_vmm::devices::block::{BlockConfig, BlockDevice, BlockMmio};
use vmm_sys_util::eventfd::EventFd;

/// 64 KiB: 128 sectors, enough for requests that straddle the end.
const DISK: usize = 64 << 10;

fn base() -> &'static std::path::Path {
    static BASE: OnceLock<std::path::PathBuf> = OnceLock::new();
    BASE.get_or_init(|| {
        let path = scratch().join("base.img");
        let bytes: Vec<u8> = (0..DISK).map(|i| ((i / 512) ^ i) as u8).collect();
        std::fs::write(&path, bytes).expect("base image");
        path
    })
}

fuzz_target!(|data: &[u8]| {
    let mut input = Input(data);
    let read_only = input.u8() & 1 == 1;
    let header: Vec<u8> = input.bytes(8).to_vec();
    let overlay = scratch().join("overlay.img");
    let _ = std::fs::remove_file(&overlay);
    let dev = BlockDevice::new(&BlockConfig {
        id: "fuzz".into(),
        base: base().to_path_buf(),
        overlay: (!read_only).then_some(overlay),
        read_only,
        keep_overlay: false,
    })
    .expect("block device");
    let mem = guest_mem(input.rest());
    let irq = EventFd::new(libc::EFD_NONBLOCK).expect("eventfd");
    let mut t = BlockMmio::new(dev, mem, irq).expect("transport");
    program(&mut t, &mut Input(&header), 1);
    notify(&mut t, 0);
    notify(&mut t, 0);
});
