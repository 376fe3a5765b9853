//! virtio over MMIO (transport version 2, "modern"), on virtio-queue's
//! split `Queue`.
//!
//! A device implements [`VirtioDevice`]; [`MmioTransport`] owns it together
//! with its queues, its interrupt and guest memory, and is what the guest
//! reaches through the [`MmioBus`]. Devices get at their queues only through
//! a [`QueueContext`] handed to them by the transport, so every guest-memory
//! write a device makes is recorded for diff snapshots (KVM's dirty log does
//! not see writes made by the VMM). See `INTEGRATION.md` beside this file
//! for how the VMM wires a device in.

pub mod bus;
#[cfg(any(test, fuzzing))]
pub mod driver;
pub mod mmio;
pub mod persist;
pub mod queue;
#[cfg(test)]
mod tests;
#[cfg(test)]
pub(crate) mod testutil;

use std::sync::atomic::{AtomicU32, Ordering};

use vmm_sys_util::eventfd::EventFd;

pub use bus::{MmioBus, MmioBusError, MmioDevice};
pub use mmio::MmioTransport;
pub use persist::{MmioRestoreArgs, MmioTransportState, QueuePersistState, VirtioMmioState};
pub use queue::{DescChain, Descriptor, DirtyPages, QueueContext};

/// virtio feature bits shared by every device type.
pub const VIRTIO_F_RING_EVENT_IDX: u64 = 1 << 29;
pub const VIRTIO_F_VERSION_1: u64 = 1 << 32;

/// Device status bits (virtio 1.2, 2.1).
pub mod status {
    pub const ACKNOWLEDGE: u32 = 1;
    pub const DRIVER: u32 = 2;
    pub const DRIVER_OK: u32 = 4;
    pub const FEATURES_OK: u32 = 8;
    pub const DEVICE_NEEDS_RESET: u32 = 0x40;
    pub const FAILED: u32 = 0x80;
}

/// Interrupt-status bits: used buffers, configuration change.
pub const INT_VRING: u32 = 1;
pub const INT_CONFIG: u32 = 2;

/// virtio device ids.
pub const TYPE_BLOCK: u32 = 2;
pub const TYPE_VSOCK: u32 = 19;

/// Where virtio-mmio devices go: the first page-sized slot is at
/// `MMIO_BASE`, inside the 3–4 GiB gap that holds no RAM, well below the
/// IOAPIC (0xfec0_0000) and the KVM TSS (0xfffb_d000).
pub const MMIO_BASE: u64 = 0xd000_0000;
/// Every device gets one 4 KiB window (registers 0x000..0x100, config after).
pub const MMIO_SLOT_SIZE: u64 = 0x1000;
/// Legacy IRQs free for virtio devices: the MP table routes only IRQ 0–15,
/// and 0–4, 8, 12–15 belong to the timer, keyboard, cascade, COM ports,
/// RTC, mouse and IDE.
pub const VIRTIO_IRQS: [u32; 6] = [5, 6, 7, 9, 10, 11];

/// Errors of the virtio transport and its saved state.
#[derive(Debug, thiserror::Error)]
pub enum VirtioError {
    #[error("saved queue {index} is invalid: {source}")]
    QueueState {
        index: usize,
        source: virtio_queue::Error,
    },
    #[error("cannot create a queue of maximum size {size}: {source}")]
    QueueCreate {
        size: u16,
        source: virtio_queue::Error,
    },
    #[error("saved state has {saved} queues, the device has {device}")]
    QueueCount { saved: usize, device: usize },
    #[error("saved state is for virtio device type {saved}, not {device}")]
    DeviceType { saved: u32, device: u32 },
    #[error("queue {0} is ready but lies outside guest memory")]
    QueueOutsideMemory(usize),
    #[error("device activation failed: {0}")]
    Activate(String),
    #[error("cannot restore the device: {0}")]
    Device(Box<dyn std::error::Error + Send + Sync>),
    #[error("no virtio-mmio slot left: at most {0} devices")]
    NoSlot(usize),
    #[error("cannot signal the guest: {0}")]
    Signal(std::io::Error),
}

/// Fills `data` from a device's configuration space `config` at `offset`;
/// bytes past its end read as 0.
pub fn read_config_bytes(config: &[u8], offset: u64, data: &mut [u8]) {
    for (i, b) in data.iter_mut().enumerate() {
        *b = usize::try_from(offset)
            .ok()
            .and_then(|o| config.get(o.checked_add(i)?))
            .copied()
            .unwrap_or(0);
    }
}

/// A virtio device model; the transport drives it.
pub trait VirtioDevice: Send {
    /// virtio device id (`TYPE_*`).
    fn device_type(&self) -> u32;
    /// Maximum size of each queue; the length is the number of queues.
    fn queue_max_sizes(&self) -> &[u16];
    /// Features offered to the driver (must include `VIRTIO_F_VERSION_1`).
    fn avail_features(&self) -> u64;
    /// Reads device-specific configuration space at `offset`.
    fn read_config(&self, offset: u64, data: &mut [u8]);
    /// Writes device-specific configuration space (ignored by default).
    fn write_config(&mut self, _offset: u64, _data: &[u8]) {}
    /// The driver set DRIVER_OK, or a saved device that had been activated
    /// is being restored. Must not touch guest memory: on restore it runs
    /// before guest memory may be servable (userfaultfd); threaded devices
    /// kick their thread instead.
    fn activate(&mut self, acked_features: u64) -> Result<(), VirtioError>;
    /// The driver notified queue `index` (always < the number of queues).
    fn queue_notify(&mut self, index: usize, ctx: &mut QueueContext<'_>);
    /// The driver reset the device: drop all in-flight work.
    fn reset(&mut self);
}

/// The device's interrupt: the interrupt-status register plus the eventfd
/// that KVM turns into a guest interrupt (irqfd).
#[derive(Debug)]
pub struct Interrupt {
    status: AtomicU32,
    evt: EventFd,
}

impl Interrupt {
    pub fn new(evt: EventFd) -> Self {
        Self {
            status: AtomicU32::new(0),
            evt,
        }
    }

    /// Sets `bits` in the interrupt status and raises the interrupt.
    pub fn raise(&self, bits: u32) {
        self.status.fetch_or(bits, Ordering::SeqCst);
        if let Err(e) = self.evt.write(1) {
            tracing::warn!("cannot raise a virtio interrupt: {e}");
        }
    }

    pub fn signal_used_queue(&self) {
        self.raise(INT_VRING);
    }

    pub fn signal_config_change(&self) {
        self.raise(INT_CONFIG);
    }

    pub fn status(&self) -> u32 {
        self.status.load(Ordering::SeqCst)
    }

    /// The driver acknowledged `bits`.
    pub fn ack(&self, bits: u32) {
        self.status.fetch_and(!bits, Ordering::SeqCst);
    }

    pub(crate) fn set_status(&self, bits: u32) {
        self.status.store(bits, Ordering::SeqCst);
    }

    /// The eventfd, to register as irqfd.
    pub fn eventfd(&self) -> &EventFd {
        &self.evt
    }
}

/// One virtio-mmio window: where the device lives and which IRQ it raises.
/// Saved with the device: a restored guest expects it at the same place.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MmioSlot {
    pub base: u64,
    pub size: u64,
    pub irq: u32,
}

impl MmioSlot {
    /// Slot `index` (0-based) of the fixed layout.
    pub fn nth(index: usize) -> Result<Self, VirtioError> {
        let irq = *VIRTIO_IRQS
            .get(index)
            .ok_or(VirtioError::NoSlot(VIRTIO_IRQS.len()))?;
        Ok(Self {
            base: MMIO_BASE + index as u64 * MMIO_SLOT_SIZE,
            size: MMIO_SLOT_SIZE,
            irq,
        })
    }

    /// The kernel command-line parameter that makes Linux probe this
    /// device (`CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES`).
    pub fn cmdline(&self) -> String {
        format!(
            "virtio_mmio.device={}K@{:#x}:{}",
            self.size / 1024,
            self.base,
            self.irq
        )
    }
}
