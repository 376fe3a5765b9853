//! The virtio-vsock packet header: any 44 bytes decode, and encode back
//! to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use torpor_vmm::devices::vsock::{Header, HDR_LEN};

fuzz_target!(|data: &[u8]| {
    let Some(raw) = data.first_chunk::<HDR_LEN>() else {
        return;
    };
    let hdr = Header::from_bytes(raw);
    assert_eq!(&hdr.to_bytes(), raw, "header round trip");
});
