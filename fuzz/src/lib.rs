//! Shared pieces of torpor's fuzz targets: a reader over the fuzzer's
//! bytes, guest memory built from them, and the driver's register
//! sequence for a virtio-mmio device whose rings sit wherever the input
//! says.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use torpor_vmm::devices::virtio::driver::{negotiate, write32};
use torpor_vmm::devices::virtio::{
    status, MmioDevice, VIRTIO_F_RING_EVENT_IDX, VIRTIO_F_VERSION_1,
};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

/// Guest RAM of every device target: small, so that fuzzed addresses often
/// land inside it, and cheap to build per input.
pub const MEM_SIZE: usize = 64 << 10;

/// Reads little-endian numbers off the front of the input; zeros once it
/// runs out.
pub struct Input<'a>(pub &'a [u8]);

impl<'a> Input<'a> {
    pub fn bytes(&mut self, n: usize) -> &'a [u8] {
        let n = n.min(self.0.len());
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        head
    }

    pub fn u8(&mut self) -> u8 {
        self.bytes(1).first().copied().unwrap_or(0)
    }

    pub fn u16(&mut self) -> u16 {
        u16::from(self.u8()) | u16::from(self.u8()) << 8
    }

    pub fn u32(&mut self) -> u32 {
        u32::from(self.u16()) | u32::from(self.u16()) << 16
    }

    pub fn rest(&mut self) -> &'a [u8] {
        self.bytes(self.0.len())
    }
}

/// `MEM_SIZE` bytes of guest RAM at 0 holding `image` (the rest zero).
pub fn guest_mem(image: &[u8]) -> GuestMemoryMmap {
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).expect("guest memory");
    let n = image.len().min(MEM_SIZE);
    mem.write_slice(&image[..n], GuestAddress(0))
        .expect("fill guest memory");
    mem
}

/// A queue address from 16 fuzzed bits: usually inside guest memory
/// (8-byte steps), sometimes just past or far outside it.
pub fn queue_addr(raw: u16) -> u64 {
    match raw >> 14 {
        3 if raw & 1 == 1 => u64::MAX - u64::from(raw & 0xff),
        3 => MEM_SIZE as u64 + u64::from(raw & 0xfff),
        _ => (u64::from(raw) * 8) % MEM_SIZE as u64,
    }
}

/// Programs a device the way a (possibly hostile) driver would: features
/// (VERSION_1, plus EVENT_IDX if the input says), `queues` ring triples
/// read from the input, a queue size from the input, then DRIVER_OK.
pub fn program(dev: &mut dyn MmioDevice, input: &mut Input<'_>, queues: usize) {
    let flags = input.u8();
    let mut features = VIRTIO_F_VERSION_1;
    if flags & 1 == 1 {
        features |= VIRTIO_F_RING_EVENT_IDX;
    }
    // Sizes 1..=256, mostly powers of two (the others must be refused).
    let size = match input.u8() {
        s @ 0..=7 => 1u16 << s,
        8 => 256,
        s => u16::from(s),
    };
    let rings: Vec<(u64, u64, u64)> = (0..queues)
        .map(|_| {
            (
                queue_addr(input.u16()),
                queue_addr(input.u16()),
                queue_addr(input.u16()),
            )
        })
        .collect();
    let refs: Vec<&dyn torpor_vmm::devices::virtio::driver::QueueAddrs> =
        rings.iter().map(|r| r as _).collect();
    negotiate(dev, features, &refs, size);
    let s = status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK;
    write32(dev, 0x70, s);
}

/// Notifies queue `index` (the QueueNotify register).
pub fn notify(dev: &mut dyn MmioDevice, index: u32) {
    write32(dev, 0x50, index);
}

/// A scratch directory of this fuzz process, made once. libFuzzer ends
/// the process without unwinding, so the directories of fuzz processes
/// that are gone are removed here instead.
pub fn scratch() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let tmp = std::env::temp_dir();
        for entry in std::fs::read_dir(&tmp).into_iter().flatten().flatten() {
            let name = entry.file_name();
            let pid = name.to_str().and_then(|n| n.strip_prefix("torpor-fuzz-"));
            if pid.is_some_and(|p| !Path::new("/proc").join(p).exists()) {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
        let dir = tmp.join(format!("torpor-fuzz-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch directory");
        dir
    })
}

/// A state file around `payload` with a valid header (magic, current
/// version, lengths and both checksums), so that mutations reach the
/// decoder instead of dying at the checksum.
pub fn state_file(payload: &[u8]) -> Vec<u8> {
    use torpor_vmm::snapshot::{FORMAT_MAJOR, FORMAT_MINOR, HEADER_LEN, MAGIC};
    let mut h = vec![0u8; HEADER_LEN];
    h[0..8].copy_from_slice(&MAGIC);
    h[8..10].copy_from_slice(&FORMAT_MAJOR.to_le_bytes());
    h[10..12].copy_from_slice(&FORMAT_MINOR.to_le_bytes());
    h[16..24].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    h[24..28].copy_from_slice(&crc32fast::hash(payload).to_le_bytes());
    let crc = crc32fast::hash(&h[0..28]);
    h[28..32].copy_from_slice(&crc.to_le_bytes());
    h.extend_from_slice(payload);
    h
}

/// The state file an input describes: its first byte says whether the rest
/// is a whole file (odd) or a payload to wrap in a valid header (even).
pub fn state_input(data: &[u8]) -> Vec<u8> {
    match data.split_first() {
        Some((mode, rest)) if mode & 1 == 1 => rest.to_vec(),
        Some((_, rest)) => state_file(rest),
        None => Vec::new(),
    }
}
