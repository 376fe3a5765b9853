//! What a device sees of its queues: descriptor chains copied out of guest
//! memory (so a guest that rewrites them mid-request cannot change what the
//! device validated), bounds-checked reads and writes across a chain, and
//! the record of every guest page the VMM wrote.

use std::collections::BTreeSet;

use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

use super::Interrupt;
use crate::snapshot::PageRuns;

const PAGE_SIZE: u64 = 4096;
/// Longest chain accepted, whatever the queue size (indirect tables can be
/// longer than the queue).
pub const MAX_CHAIN_DESCRIPTORS: usize = 1024;

/// Errors while moving bytes between the VMM and a descriptor chain.
#[derive(Debug, thiserror::Error)]
pub enum ChainError {
    #[error("access of {len} bytes at offset {offset} runs past the chain's {available} bytes")]
    PastEnd {
        offset: u64,
        len: usize,
        available: u64,
    },
    #[error("descriptor buffer at {addr:#x}+{len} is outside guest memory")]
    Memory { addr: u64, len: usize },
}

/// One descriptor as the device validated it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Descriptor {
    pub addr: u64,
    pub len: u32,
    /// Device-writable (VIRTQ_DESC_F_WRITE).
    pub writable: bool,
}

/// A descriptor chain taken off the available ring.
#[derive(Debug, Clone)]
pub struct DescChain {
    /// Index of the head descriptor: what goes into the used ring.
    pub head: u16,
    pub descs: Vec<Descriptor>,
    /// The chain had more than `MAX_CHAIN_DESCRIPTORS` descriptors.
    pub truncated: bool,
}

impl DescChain {
    /// Whether every device-readable descriptor comes before every
    /// device-writable one, as the spec requires.
    pub fn is_ordered(&self) -> bool {
        let first_writable = self
            .descs
            .iter()
            .position(|d| d.writable)
            .unwrap_or(self.descs.len());
        self.descs[first_writable..].iter().all(|d| d.writable)
    }

    pub fn readable_len(&self) -> u64 {
        self.sum(false)
    }

    pub fn writable_len(&self) -> u64 {
        self.sum(true)
    }

    fn sum(&self, writable: bool) -> u64 {
        self.descs
            .iter()
            .filter(|d| d.writable == writable)
            .map(|d| u64::from(d.len))
            .sum()
    }

    /// Whether every buffer lies inside guest memory.
    pub fn in_memory(&self, mem: &GuestMemoryMmap) -> bool {
        self.descs.iter().all(|d| {
            d.len == 0 || GuestMemoryBackend::check_range(mem, GuestAddress(d.addr), d.len as usize)
        })
    }

    /// Pieces `(guest address, length)` covering `len` bytes starting at
    /// logical `offset` of the readable (or writable) part of the chain.
    fn pieces(
        &self,
        writable: bool,
        offset: u64,
        len: usize,
    ) -> Result<Vec<(u64, usize)>, ChainError> {
        let available = self.sum(writable);
        if offset.saturating_add(len as u64) > available {
            return Err(ChainError::PastEnd {
                offset,
                len,
                available,
            });
        }
        let mut out = Vec::new();
        let (mut skip, mut left) = (offset, len);
        for d in self.descs.iter().filter(|d| d.writable == writable) {
            if left == 0 {
                break;
            }
            let dlen = u64::from(d.len);
            if skip >= dlen {
                skip -= dlen;
                continue;
            }
            let take = (dlen - skip).min(left as u64) as usize;
            let addr = d
                .addr
                .checked_add(skip)
                .ok_or(ChainError::Memory { addr: d.addr, len })?;
            out.push((addr, take));
            left -= take;
            skip = 0;
        }
        Ok(out)
    }

    /// Copies readable bytes at logical `offset` into `buf`.
    pub fn read(
        &self,
        mem: &GuestMemoryMmap,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<(), ChainError> {
        let mut done = 0;
        for (addr, len) in self.pieces(false, offset, buf.len())? {
            mem.read_slice(&mut buf[done..done + len], GuestAddress(addr))
                .map_err(|_| ChainError::Memory { addr, len })?;
            done += len;
        }
        Ok(())
    }

    /// Copies `data` into the writable part at logical `offset`, recording
    /// the pages written.
    pub fn write(
        &self,
        mem: &GuestMemoryMmap,
        dirty: &mut DirtyPages,
        offset: u64,
        data: &[u8],
    ) -> Result<(), ChainError> {
        let mut done = 0;
        for (addr, len) in self.pieces(true, offset, data.len())? {
            mem.write_slice(&data[done..done + len], GuestAddress(addr))
                .map_err(|_| ChainError::Memory { addr, len })?;
            dirty.mark(addr, len as u64);
            done += len;
        }
        Ok(())
    }
}

/// Guest pages the VMM wrote, by guest-physical frame number. KVM's dirty
/// log sees only the guest's own writes; a diff snapshot must add these.
#[derive(Debug, Default, Clone)]
pub struct DirtyPages {
    frames: BTreeSet<u64>,
}

impl DirtyPages {
    pub fn mark(&mut self, addr: u64, len: u64) {
        if len == 0 {
            return;
        }
        let last = addr.saturating_add(len - 1) / PAGE_SIZE;
        for frame in addr / PAGE_SIZE..=last {
            self.frames.insert(frame);
        }
    }

    pub fn is_empty(&self) -> bool {
        self.frames.is_empty()
    }

    pub fn contains(&self, addr: u64) -> bool {
        self.frames.contains(&(addr / PAGE_SIZE))
    }

    /// Empties the record, returning it as memory-file page numbers (the
    /// regions of `mem` laid end to end, as snapshots number pages).
    pub fn take_file_pages(&mut self, mem: &GuestMemoryMmap) -> PageRuns {
        let mut runs = PageRuns::new();
        let mut first_page = 0u64;
        for region in mem.iter() {
            let start = region.start_addr().0 / PAGE_SIZE;
            let pages = region.len() / PAGE_SIZE;
            for frame in self.frames.range(start..start + pages) {
                runs.push_run(first_page + (frame - start), 1);
            }
            first_page += pages;
        }
        self.frames.clear();
        runs
    }
}

/// Queue `index` if the driver made it ready: a queue that is not has no
/// rings in guest memory to touch.
fn ready_queue(queues: &mut [Queue], index: usize) -> Option<&mut Queue> {
    queues.get_mut(index).filter(|q| q.ready())
}

/// A queue's indices at one moment ([`QueueContext::ring_state`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingState {
    /// The driver's available index (`None`: unreadable).
    pub avail_idx: Option<u16>,
    /// How far the device has taken from the available ring.
    pub next_avail: u16,
    /// The device's used index.
    pub next_used: u16,
    /// EVENT_IDX: the driver wants an interrupt once the used index passes
    /// this (it is the last used entry the driver has seen).
    pub used_event: Option<u16>,
    /// The device's interrupt-status register (1: used buffers, 2: config).
    pub interrupt_status: u32,
}

/// A device's view of its queues while it holds the transport.
#[derive(Debug)]
pub struct QueueContext<'a> {
    pub mem: &'a GuestMemoryMmap,
    queues: &'a mut [Queue],
    interrupt: &'a Interrupt,
    pub dirty: &'a mut DirtyPages,
}

impl<'a> QueueContext<'a> {
    pub(crate) fn new(
        mem: &'a GuestMemoryMmap,
        queues: &'a mut [Queue],
        interrupt: &'a Interrupt,
        dirty: &'a mut DirtyPages,
    ) -> Self {
        Self {
            mem,
            queues,
            interrupt,
            dirty,
        }
    }

    pub fn queue(&self, index: usize) -> Option<&Queue> {
        self.queues.get(index)
    }

    /// Takes the next available chain of queue `index`, if the queue is
    /// ready and the driver offered one.
    pub fn pop(&mut self, index: usize) -> Option<DescChain> {
        let q = ready_queue(self.queues, index)?;
        let chain = q.pop_descriptor_chain(self.mem)?;
        let head = chain.head_index();
        let mut descs = Vec::new();
        let mut truncated = false;
        for d in chain {
            if descs.len() == MAX_CHAIN_DESCRIPTORS {
                truncated = true;
                break;
            }
            descs.push(Descriptor {
                addr: d.addr().0,
                len: d.len(),
                writable: d.is_write_only(),
            });
        }
        Some(DescChain {
            head,
            descs,
            truncated,
        })
    }

    /// Puts the last chain taken from queue `index` back (it was not used).
    pub fn undo_pop(&mut self, index: usize) {
        if let Some(q) = ready_queue(self.queues, index) {
            q.go_to_previous_position();
        }
    }

    fn mark_used_ring(&mut self, index: usize) {
        if let Some(q) = self.queues.get(index).filter(|q| q.ready()) {
            let len = 6 + 8 * u64::from(q.size());
            self.dirty.mark(q.used_ring(), len);
        }
    }

    /// Returns chain `head` to the driver with `len` bytes written.
    pub fn add_used(&mut self, index: usize, head: u16, len: u32) {
        let Some(q) = ready_queue(self.queues, index) else {
            return;
        };
        if let Err(e) = q.add_used(self.mem, head, len) {
            crate::guest_warn!(queue = index, "cannot add to the used ring: {e}");
        }
        self.mark_used_ring(index);
    }

    /// Interrupts the driver if it wants to hear about used buffers now.
    pub fn notify_guest(&mut self, index: usize) {
        let Some(q) = ready_queue(self.queues, index) else {
            return;
        };
        match q.needs_notification(self.mem) {
            Ok(true) => self.interrupt.signal_used_queue(),
            Ok(false) => {}
            Err(e) => {
                crate::guest_warn!(queue = index, "cannot read the used-event index: {e}");
                self.interrupt.signal_used_queue();
            }
        }
    }

    /// Raises the interrupt again with the status bits still pending
    /// (none: nothing to raise).
    pub fn raise_again(&self) {
        let pending = self.interrupt.status();
        if pending != 0 {
            self.interrupt.raise(pending);
        }
    }

    /// Asks the driver to notify on new buffers; true if some arrived
    /// meanwhile (then the caller must look again).
    pub fn enable_notification(&mut self, index: usize) -> bool {
        let Some(q) = ready_queue(self.queues, index) else {
            return false;
        };
        let more = q.enable_notification(self.mem).unwrap_or_else(|e| {
            crate::guest_warn!(queue = index, "cannot enable notifications: {e}");
            false
        });
        self.mark_used_ring(index);
        more
    }

    pub fn disable_notification(&mut self, index: usize) {
        if let Some(q) = ready_queue(self.queues, index) {
            if let Err(e) = q.disable_notification(self.mem) {
                crate::guest_warn!(queue = index, "cannot disable notifications: {e}");
            }
        }
        self.mark_used_ring(index);
    }

    /// Handles every available chain of queue `index` with `f` (which
    /// returns the byte count for the used ring), then notifies the driver.
    pub fn drain<F>(&mut self, index: usize, mut f: F)
    where
        F: FnMut(&mut QueueContext<'a>, &DescChain) -> u32,
    {
        // A driver whose available index runs ahead of the ring makes
        // `enable_notification` say "more" while `pop` finds nothing: two
        // empty passes in a row end the loop instead of spinning.
        let mut empty_passes = 0;
        loop {
            self.disable_notification(index);
            let mut handled = 0;
            while let Some(chain) = self.pop(index) {
                let len = f(self, &chain);
                self.add_used(index, chain.head, len);
                handled += 1;
            }
            if !self.enable_notification(index) {
                break;
            }
            empty_passes = if handled == 0 { empty_passes + 1 } else { 0 };
            if empty_passes >= 2 {
                crate::guest_warn!(queue = index, "available ring index is inconsistent");
                break;
            }
        }
        self.notify_guest(index);
    }

    /// Where queue `index`'s rings stand, for a diagnostic: what the driver
    /// offered and the device took, what the device used, and (with
    /// EVENT_IDX) the used index past which the driver asked to be
    /// interrupted. `None` for a queue that is not ready.
    pub fn ring_state(&self, index: usize) -> Option<RingState> {
        let q = self.queues.get(index).filter(|q| q.ready())?;
        let order = std::sync::atomic::Ordering::Acquire;
        let avail_idx = q.avail_idx(self.mem, order).ok().map(|w| w.0);
        // used_event sits after the available ring's entries.
        let used_event_addr = q
            .avail_ring()
            .checked_add(4 + 2 * u64::from(q.size()))
            .map(GuestAddress);
        let used_event = used_event_addr.and_then(|a| self.mem.read_obj::<u16>(a).ok());
        Some(RingState {
            avail_idx,
            next_avail: q.next_avail(),
            next_used: q.next_used(),
            used_event: q.event_idx_enabled().then_some(used_event).flatten(),
            interrupt_status: self.interrupt.status(),
        })
    }

    /// Takes the next chain; if there is none, asks the driver to notify on
    /// the next one and looks once more (a buffer may have slipped in).
    pub fn pop_or_enable(&mut self, index: usize) -> Option<DescChain> {
        match self.pop(index) {
            Some(chain) => Some(chain),
            None if self.enable_notification(index) => self.pop(index),
            None => None,
        }
    }

    /// `DescChain::write`, recording the pages written.
    pub fn write(&mut self, chain: &DescChain, offset: u64, data: &[u8]) -> Result<(), ChainError> {
        chain.write(self.mem, self.dirty, offset, data)
    }

    /// `DescChain::read`.
    pub fn read(&self, chain: &DescChain, offset: u64, buf: &mut [u8]) -> Result<(), ChainError> {
        chain.read(self.mem, offset, buf)
    }
}
