//! A snapshot's `state` file as the VMM reads it on restore: header,
//! checksums, the bincode payload, and then what restore builds from the
//! decoded state before any vCPU runs: the virtio transports and devices
//! (queue addresses and indexes, the block overlay map, the vsock socket)
//! on guest memory. Paths in the state are redirected into a scratch
//! directory: a fuzzed state must not reach the host's files.
//!
//! Input: see `torpor_fuzz::state_input` (seeds are real snapshots).
#![no_main]

use std::path::Path;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use torpor_fuzz::{guest_mem, notify, scratch, state_input};
use torpor_vmm::devices::block::{BlockMmio, BlockRestoreArgs};
use torpor_vmm::devices::virtio::MmioRestoreArgs;
use torpor_vmm::devices::vsock::{VsockMmio, VsockRestoreArgs};
use torpor_vmm::snapshot::{read_state_bytes, Persist};
use torpor_vmm::vm_state::MicrovmState;
use vmm_sys_util::eventfd::EventFd;

fn base() -> &'static Path {
    static BASE: OnceLock<std::path::PathBuf> = OnceLock::new();
    BASE.get_or_init(|| {
        let path = scratch().join("base.img");
        std::fs::write(&path, vec![0x5au8; 64 << 10]).expect("base image");
        path
    })
}

fuzz_target!(|data: &[u8]| {
    let Ok(mut state) =
        read_state_bytes::<MicrovmState>(Path::new("fuzz/state"), &state_input(data))
    else {
        return;
    };
    let mem = guest_mem(&[]);
    if let Some((_, block)) = &mut state.devices.virtio.block {
        block.device.base_path = base().to_path_buf();
        let saved = scratch().join("saved-overlay.img");
        let _ = std::fs::remove_file(&saved);
        if block.device.overlay_path.is_some() {
            let _ = std::fs::write(&saved, []);
            block.device.overlay_path = Some(saved);
        }
        let args = MmioRestoreArgs {
            mem: mem.clone(),
            irq: EventFd::new(libc::EFD_NONBLOCK).expect("eventfd"),
            device: BlockRestoreArgs {
                overlay_path: Some(scratch().join("own-overlay.img")),
                base_path: None,
            },
        };
        if let Ok(mut t) = BlockMmio::restore(args, block) {
            notify(&mut t, 0);
        }
    }
    if let Some((_, vsock)) = &state.devices.virtio.vsock {
        let uds = scratch().join("v.sock");
        let _ = std::fs::remove_file(&uds);
        let args = MmioRestoreArgs {
            mem: mem.clone(),
            irq: EventFd::new(libc::EFD_NONBLOCK).expect("eventfd"),
            device: VsockRestoreArgs {
                uds_path: Some(uds),
                cid: None,
            },
        };
        if let Ok(mut t) = VsockMmio::restore(args, vsock) {
            notify(&mut t, 1);
        }
    }
});
