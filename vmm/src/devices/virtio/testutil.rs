//! Test helpers shared by the virtio devices: guest memory, a driver that programs the transport through its registers, and
//! descriptor chains built with virtio-queue's mock helpers (its
//! descriptor table and rings; not `MockSplitQueue::create`, whose layout
//! puts the used ring inside the available ring for queues of more than a
//! few entries: `SplitQueueRing::end` counts elements, not bytes).

use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
use virtio_queue::mock::{AvailRing, DescriptorTable, UsedRing};
use vm_memory::{GuestAddress, GuestMemoryMmap};

pub use super::driver::{activate, negotiate, read32, write32, QueueAddrs};

pub const F_NEXT: u16 = 1;
pub const F_WRITE: u16 = 2;

/// Guest RAM from 0.
pub fn guest_mem(size: usize) -> GuestMemoryMmap {
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), size)]).unwrap()
}

/// Copies all of `src` into `dst` (same layout): a memory snapshot.
pub fn copy_mem(src: &GuestMemoryMmap, dst: &GuestMemoryMmap) {
    use vm_memory::{Bytes, GuestMemoryBackend, GuestMemoryRegion};
    for region in src.iter() {
        let mut buf = vec![0u8; region.len() as usize];
        src.read_slice(&mut buf, region.start_addr()).unwrap();
        dst.write_slice(&buf, region.start_addr()).unwrap();
    }
}

/// Driver side of one queue: places chains at increasing descriptor
/// indexes (wrapping at the queue size) and reads the used ring.
pub struct Driver<'a> {
    desc: DescriptorTable<'a, GuestMemoryMmap>,
    avail: AvailRing<'a, GuestMemoryMmap>,
    used: UsedRing<'a, GuestMemoryMmap>,
    pub desc_addr: u64,
    pub avail_addr: u64,
    pub used_addr: u64,
    size: u16,
    next_desc: u16,
    seen_used: u16,
}

impl<'a> Driver<'a> {
    /// A queue of `size` entries at `base`: descriptor table, then the
    /// available ring, then the used ring (4-aligned). Zeroes the rings.
    pub fn new(mem: &'a GuestMemoryMmap, base: u64, size: u16) -> Self {
        let desc_addr = base;
        let avail_addr = desc_addr + 16 * u64::from(size);
        let used_addr = (avail_addr + 6 + 2 * u64::from(size) + 3) & !3;
        Self {
            desc: DescriptorTable::new(mem, GuestAddress(desc_addr), size),
            avail: AvailRing::new(mem, GuestAddress(avail_addr), size),
            used: UsedRing::new(mem, GuestAddress(used_addr), size),
            desc_addr,
            avail_addr,
            used_addr,
            size,
            next_desc: 0,
            seen_used: 0,
        }
    }

    /// Offers a chain of `(addr, len, device_writable)` buffers; returns its
    /// head index.
    pub fn push(&mut self, bufs: &[(u64, u32, bool)]) -> u16 {
        assert!(!bufs.is_empty() && bufs.len() <= usize::from(self.size));
        if usize::from(self.next_desc) + bufs.len() > usize::from(self.size) {
            self.next_desc = 0;
        }
        let head = self.next_desc;
        for (i, &(addr, len, writable)) in bufs.iter().enumerate() {
            let last = i + 1 == bufs.len();
            let mut flags = if writable { F_WRITE } else { 0 };
            if !last {
                flags |= F_NEXT;
            }
            let next = if last { 0 } else { head + i as u16 + 1 };
            let d = RawDescriptor::from(SplitDescriptor::new(addr, len, flags, next));
            self.desc.store(head + i as u16, d).unwrap();
        }
        let idx = self.avail.idx().load();
        let slot = usize::from(idx % self.size);
        self.avail.ring().ref_at(slot).unwrap().store(head);
        self.avail.idx().store(idx.wrapping_add(1));
        self.next_desc = head + bufs.len() as u16;
        head
    }

    /// The same driver on another guest memory (a restored copy): call
    /// before copying the memory over, which holds the rings.
    pub fn resume_on<'b>(&self, mem: &'b GuestMemoryMmap) -> Driver<'b> {
        Driver {
            next_desc: self.next_desc,
            seen_used: self.seen_used,
            ..Driver::new(mem, self.desc_addr, self.size)
        }
    }

    /// Used entries `(head, len)` published since the last call.
    pub fn take_used(&mut self) -> Vec<(u16, u32)> {
        let idx = self.used.idx().load();
        let mut out = Vec::new();
        while self.seen_used != idx {
            let slot = usize::from(self.seen_used % self.size);
            let e = self.used.ring().ref_at(slot).unwrap().load();
            out.push((e.id() as u16, e.len()));
            self.seen_used = self.seen_used.wrapping_add(1);
        }
        out
    }
}

impl QueueAddrs for Driver<'_> {
    fn addrs(&self) -> (u64, u64, u64) {
        (self.desc_addr, self.avail_addr, self.used_addr)
    }
}
