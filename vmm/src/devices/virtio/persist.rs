//! Saved state of a virtio-mmio transport: registers, negotiated features
//! and every queue, as plain serde data.

use serde::{Deserialize, Serialize};
use virtio_queue::QueueState;
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

/// One queue, mirroring virtio-queue's `QueueState`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueuePersistState {
    pub max_size: u16,
    pub size: u16,
    pub ready: bool,
    pub desc_table: u64,
    pub avail_ring: u64,
    pub used_ring: u64,
    pub next_avail: u16,
    pub next_used: u16,
    pub event_idx: bool,
}

impl From<QueueState> for QueuePersistState {
    fn from(s: QueueState) -> Self {
        Self {
            max_size: s.max_size,
            size: s.size,
            ready: s.ready,
            desc_table: s.desc_table,
            avail_ring: s.avail_ring,
            used_ring: s.used_ring,
            next_avail: s.next_avail,
            next_used: s.next_used,
            event_idx: s.event_idx_enabled,
        }
    }
}

impl From<&QueuePersistState> for QueueState {
    fn from(s: &QueuePersistState) -> Self {
        Self {
            max_size: s.max_size,
            next_avail: s.next_avail,
            next_used: s.next_used,
            event_idx_enabled: s.event_idx,
            size: s.size,
            ready: s.ready,
            desc_table: s.desc_table,
            avail_ring: s.avail_ring,
            used_ring: s.used_ring,
        }
    }
}

/// The transport's registers and queues.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MmioTransportState {
    pub device_type: u32,
    pub status: u32,
    pub device_features_select: u32,
    pub driver_features_select: u32,
    /// Features the driver acknowledged.
    pub acked_features: u64,
    pub queue_select: u32,
    pub interrupt_status: u32,
    pub config_generation: u32,
    pub queues: Vec<QueuePersistState>,
}

/// A whole virtio-mmio device: transport plus the device model's own state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VirtioMmioState<S> {
    pub transport: MmioTransportState,
    pub device: S,
}

/// What restoring a transport needs besides its saved state.
#[derive(Debug)]
pub struct MmioRestoreArgs<A> {
    pub mem: GuestMemoryMmap,
    /// The new interrupt eventfd (register it as irqfd for the same IRQ).
    pub irq: EventFd,
    /// The device model's own constructor arguments.
    pub device: A,
}
