//! The virtio-mmio transport, version 2 (virtio 1.2, 4.2.2): the register
//! window the guest driver programs, the device-status state machine, and
//! queue notifications handed to the device model.

use virtio_queue::{Queue, QueueState, QueueT};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use super::bus::MmioDevice;
use super::persist::{MmioRestoreArgs, MmioTransportState, VirtioMmioState};
use super::queue::{DirtyPages, QueueContext};
use super::{
    status, Interrupt, VirtioDevice, VirtioError, VIRTIO_F_RING_EVENT_IDX, VIRTIO_F_VERSION_1,
};
use crate::snapshot::PageRuns;
use crate::snapshot::Persist;

/// Register offsets.
mod reg {
    pub const MAGIC_VALUE: u64 = 0x000;
    pub const VERSION: u64 = 0x004;
    pub const DEVICE_ID: u64 = 0x008;
    pub const VENDOR_ID: u64 = 0x00c;
    pub const DEVICE_FEATURES: u64 = 0x010;
    pub const DEVICE_FEATURES_SEL: u64 = 0x014;
    pub const DRIVER_FEATURES: u64 = 0x020;
    pub const DRIVER_FEATURES_SEL: u64 = 0x024;
    pub const QUEUE_SEL: u64 = 0x030;
    pub const QUEUE_NUM_MAX: u64 = 0x034;
    pub const QUEUE_NUM: u64 = 0x038;
    pub const QUEUE_READY: u64 = 0x044;
    pub const QUEUE_NOTIFY: u64 = 0x050;
    pub const INTERRUPT_STATUS: u64 = 0x060;
    pub const INTERRUPT_ACK: u64 = 0x064;
    pub const STATUS: u64 = 0x070;
    pub const QUEUE_DESC_LOW: u64 = 0x080;
    pub const QUEUE_DESC_HIGH: u64 = 0x084;
    pub const QUEUE_DRIVER_LOW: u64 = 0x090;
    pub const QUEUE_DRIVER_HIGH: u64 = 0x094;
    pub const QUEUE_DEVICE_LOW: u64 = 0x0a0;
    pub const QUEUE_DEVICE_HIGH: u64 = 0x0a4;
    pub const SHM_LEN_LOW: u64 = 0x0b0;
    pub const SHM_LEN_HIGH: u64 = 0x0b4;
    pub const SHM_BASE_LOW: u64 = 0x0b8;
    pub const SHM_BASE_HIGH: u64 = 0x0bc;
    pub const CONFIG_GENERATION: u64 = 0x0fc;
    pub const CONFIG: u64 = 0x100;
}

/// "virt" in little-endian.
pub const MMIO_MAGIC: u32 = 0x7472_6976;
pub const MMIO_VERSION: u32 = 2;
pub const VENDOR_ID: u32 = 0;

/// A virtio device behind its MMIO register window.
#[derive(Debug)]
pub struct MmioTransport<D: VirtioDevice> {
    device: D,
    mem: GuestMemoryMmap,
    interrupt: Interrupt,
    queues: Vec<Queue>,
    dirty: DirtyPages,
    status: u32,
    device_features_select: u32,
    driver_features_select: u32,
    acked_features: u64,
    queue_select: u32,
    config_generation: u32,
}

fn new_queues(sizes: &[u16]) -> Result<Vec<Queue>, VirtioError> {
    sizes
        .iter()
        .map(|&size| Queue::new(size).map_err(|source| VirtioError::QueueCreate { size, source }))
        .collect()
}

impl<D: VirtioDevice> MmioTransport<D> {
    /// `irq` is the eventfd registered as irqfd for the device's IRQ.
    pub fn new(device: D, mem: GuestMemoryMmap, irq: EventFd) -> Result<Self, VirtioError> {
        let queues = new_queues(device.queue_max_sizes())?;
        Ok(Self {
            device,
            mem,
            interrupt: Interrupt::new(irq),
            queues,
            dirty: DirtyPages::default(),
            status: 0,
            device_features_select: 0,
            driver_features_select: 0,
            acked_features: 0,
            queue_select: 0,
            config_generation: 0,
        })
    }

    pub fn device(&self) -> &D {
        &self.device
    }

    pub fn device_mut(&mut self) -> &mut D {
        &mut self.device
    }

    pub fn interrupt(&self) -> &Interrupt {
        &self.interrupt
    }

    pub fn status(&self) -> u32 {
        self.status
    }

    pub fn acked_features(&self) -> u64 {
        self.acked_features
    }

    pub fn queues(&self) -> &[Queue] {
        &self.queues
    }

    /// The driver finished setting up and nothing has failed since.
    pub fn is_activated(&self) -> bool {
        self.status & status::DRIVER_OK != 0
            && self.status & (status::DEVICE_NEEDS_RESET | status::FAILED) == 0
    }

    /// Runs `f` on the device with its queues, if the device is activated
    /// (`None` otherwise): how a device thread gets at the queues.
    pub fn with_device<R>(
        &mut self,
        f: impl FnOnce(&mut D, Option<&mut QueueContext<'_>>) -> R,
    ) -> R {
        if self.is_activated() {
            let mut ctx = QueueContext::new(
                &self.mem,
                &mut self.queues,
                &self.interrupt,
                &mut self.dirty,
            );
            f(&mut self.device, Some(&mut ctx))
        } else {
            f(&mut self.device, None)
        }
    }

    /// Guest pages the VMM wrote since the last call, as memory-file page
    /// numbers, for the next diff snapshot. The used rings of ready queues
    /// are always included.
    pub fn take_dirty_pages(&mut self) -> PageRuns {
        for q in self.queues.iter().filter(|q| q.ready()) {
            self.dirty.mark(q.used_ring(), 6 + 8 * u64::from(q.size()));
        }
        self.dirty.take_file_pages(&self.mem)
    }

    /// The device changed its configuration space: bump the generation and
    /// tell the driver.
    pub fn config_changed(&mut self) {
        self.config_generation = self.config_generation.wrapping_add(1);
        self.interrupt.signal_config_change();
    }

    fn reset(&mut self) {
        self.device.reset();
        for q in &mut self.queues {
            q.reset();
        }
        self.status = 0;
        self.device_features_select = 0;
        self.driver_features_select = 0;
        self.acked_features = 0;
        self.queue_select = 0;
        self.interrupt.set_status(0);
    }

    fn selected_queue(&mut self) -> Option<&mut Queue> {
        self.queues.get_mut(self.queue_select as usize)
    }

    /// Queue registers may be written after FEATURES_OK and before
    /// DRIVER_OK, and (except ready) only while the queue is not ready.
    fn queue_config_allowed(&self) -> bool {
        self.status & status::FEATURES_OK != 0 && self.status & status::DRIVER_OK == 0
    }

    fn features_acceptable(&self) -> bool {
        self.acked_features & VIRTIO_F_VERSION_1 != 0
            && self.acked_features & !self.device.avail_features() == 0
    }

    fn activate(&mut self) -> Result<(), VirtioError> {
        for (index, q) in self.queues.iter().enumerate() {
            if q.ready() && !q.is_valid(&self.mem) {
                return Err(VirtioError::QueueOutsideMemory(index));
            }
        }
        self.device.activate(self.acked_features)
    }

    fn set_status(&mut self, new: u32) {
        if new == 0 {
            self.reset();
            return;
        }
        let old = self.status;
        if new & old != old {
            crate::guest_warn!(
                old,
                new,
                "virtio driver cleared status bits without a reset"
            );
            return;
        }
        let added = new & !old;
        let needs = |bit: u32, prerequisite: u32| added & bit != 0 && new & prerequisite == 0;
        if needs(status::DRIVER, status::ACKNOWLEDGE)
            || needs(status::FEATURES_OK, status::DRIVER)
            || needs(status::DRIVER_OK, status::FEATURES_OK)
        {
            crate::guest_warn!(old, new, "virtio driver skipped a status step");
            return;
        }
        let mut new = new;
        if added & status::FEATURES_OK != 0 {
            if self.features_acceptable() {
                let event_idx = self.acked_features & VIRTIO_F_RING_EVENT_IDX != 0;
                for q in &mut self.queues {
                    q.set_event_idx(event_idx);
                }
            } else {
                // The driver reads the status back and gives up.
                new &= !status::FEATURES_OK;
            }
        }
        self.status = new;
        if added & status::DRIVER_OK != 0 {
            if let Err(e) = self.activate() {
                crate::guest_warn!(device = self.device.device_type(), "activation failed: {e}");
                self.status |= status::DEVICE_NEEDS_RESET;
                self.interrupt.signal_config_change();
            }
        }
    }

    fn read_reg(&self, offset: u64) -> u32 {
        let q = self.queues.get(self.queue_select as usize);
        match offset {
            reg::MAGIC_VALUE => MMIO_MAGIC,
            reg::VERSION => MMIO_VERSION,
            reg::DEVICE_ID => self.device.device_type(),
            reg::VENDOR_ID => VENDOR_ID,
            reg::DEVICE_FEATURES => match self.device_features_select {
                0 => self.device.avail_features() as u32,
                1 => (self.device.avail_features() >> 32) as u32,
                _ => 0,
            },
            reg::QUEUE_NUM_MAX => q.map_or(0, |q| u32::from(q.max_size())),
            reg::QUEUE_READY => q.map_or(0, |q| u32::from(q.ready())),
            reg::INTERRUPT_STATUS => self.interrupt.status(),
            reg::STATUS => self.status,
            // No shared-memory regions: their length reads as -1.
            reg::SHM_LEN_LOW | reg::SHM_LEN_HIGH => u32::MAX,
            reg::CONFIG_GENERATION => self.config_generation,
            _ => 0,
        }
    }

    fn write_driver_features(&mut self, value: u32) {
        if self.status & status::DRIVER == 0 || self.status & status::FEATURES_OK != 0 {
            crate::guest_warn!("virtio driver wrote features outside feature negotiation");
            return;
        }
        let shift = match self.driver_features_select {
            0 => 0,
            1 => 32,
            _ => return,
        };
        let mask = 0xffff_ffffu64 << shift;
        self.acked_features = (self.acked_features & !mask) | (u64::from(value) << shift);
    }

    fn write_queue_reg(&mut self, offset: u64, value: u32) {
        if !self.queue_config_allowed() {
            crate::guest_warn!(offset, "virtio queue register written outside setup");
            return;
        }
        let Some(q) = self.selected_queue() else {
            return;
        };
        if offset == reg::QUEUE_READY {
            q.set_ready(value == 1);
            return;
        }
        if q.ready() {
            crate::guest_warn!(
                offset,
                "virtio queue register written while the queue is ready"
            );
            return;
        }
        match offset {
            reg::QUEUE_NUM => match u16::try_from(value) {
                Ok(size) => q.set_size(size),
                Err(_) => crate::guest_warn!(value, "virtio queue size too large"),
            },
            reg::QUEUE_DESC_LOW => q.set_desc_table_address(Some(value), None),
            reg::QUEUE_DESC_HIGH => q.set_desc_table_address(None, Some(value)),
            reg::QUEUE_DRIVER_LOW => q.set_avail_ring_address(Some(value), None),
            reg::QUEUE_DRIVER_HIGH => q.set_avail_ring_address(None, Some(value)),
            reg::QUEUE_DEVICE_LOW => q.set_used_ring_address(Some(value), None),
            reg::QUEUE_DEVICE_HIGH => q.set_used_ring_address(None, Some(value)),
            _ => {}
        }
    }

    fn notify(&mut self, index: u32) {
        let index = index as usize;
        if !self.is_activated() || index >= self.queues.len() {
            return;
        }
        let mut ctx = QueueContext::new(
            &self.mem,
            &mut self.queues,
            &self.interrupt,
            &mut self.dirty,
        );
        self.device.queue_notify(index, &mut ctx);
    }

    fn write_reg(&mut self, offset: u64, value: u32) {
        match offset {
            reg::DEVICE_FEATURES_SEL => self.device_features_select = value,
            reg::DRIVER_FEATURES => self.write_driver_features(value),
            reg::DRIVER_FEATURES_SEL => self.driver_features_select = value,
            reg::QUEUE_SEL => self.queue_select = value,
            reg::QUEUE_NUM
            | reg::QUEUE_READY
            | reg::QUEUE_DESC_LOW
            | reg::QUEUE_DESC_HIGH
            | reg::QUEUE_DRIVER_LOW
            | reg::QUEUE_DRIVER_HIGH
            | reg::QUEUE_DEVICE_LOW
            | reg::QUEUE_DEVICE_HIGH => self.write_queue_reg(offset, value),
            reg::QUEUE_NOTIFY => self.notify(value),
            reg::INTERRUPT_ACK => self.interrupt.ack(value),
            reg::STATUS => self.set_status(value),
            reg::SHM_BASE_LOW | reg::SHM_BASE_HIGH => {}
            _ => tracing::debug!(offset, "write to unknown virtio-mmio register"),
        }
    }
}

impl<D: VirtioDevice> MmioDevice for MmioTransport<D> {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset >= reg::CONFIG {
            data.fill(0);
            self.device.read_config(offset - reg::CONFIG, data);
        } else if data.len() == 4 && offset.is_multiple_of(4) {
            data.copy_from_slice(&self.read_reg(offset).to_le_bytes());
        } else {
            tracing::debug!(offset, len = data.len(), "odd virtio-mmio register read");
            data.fill(0);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= reg::CONFIG {
            self.device.write_config(offset - reg::CONFIG, data);
        } else if let (Ok(bytes), true) = (<[u8; 4]>::try_from(data), offset.is_multiple_of(4)) {
            self.write_reg(offset, u32::from_le_bytes(bytes));
        } else {
            tracing::debug!(offset, len = data.len(), "odd virtio-mmio register write");
        }
    }
}

impl<D> Persist for MmioTransport<D>
where
    D: VirtioDevice + Persist,
    D::Error: std::error::Error + Send + Sync + 'static,
{
    type State = VirtioMmioState<D::State>;
    type ConstructorArgs = MmioRestoreArgs<D::ConstructorArgs>;
    type Error = VirtioError;

    fn save(&self) -> Self::State {
        VirtioMmioState {
            transport: MmioTransportState {
                device_type: self.device.device_type(),
                status: self.status,
                device_features_select: self.device_features_select,
                driver_features_select: self.driver_features_select,
                acked_features: self.acked_features,
                queue_select: self.queue_select,
                interrupt_status: self.interrupt.status(),
                config_generation: self.config_generation,
                queues: self.queues.iter().map(|q| q.state().into()).collect(),
            },
            device: self.device.save(),
        }
    }

    /// Rebuilds the transport exactly as saved. An activated device is
    /// activated again (without touching guest memory); the interrupt is
    /// not re-raised: the in-kernel IOAPIC state carries any pending one.
    fn restore(args: Self::ConstructorArgs, state: &Self::State) -> Result<Self, Self::Error> {
        let device =
            D::restore(args.device, &state.device).map_err(|e| VirtioError::Device(Box::new(e)))?;
        let t = &state.transport;
        if t.device_type != device.device_type() {
            return Err(VirtioError::DeviceType {
                saved: t.device_type,
                device: device.device_type(),
            });
        }
        let sizes = device.queue_max_sizes();
        if t.queues.len() != sizes.len() {
            return Err(VirtioError::QueueCount {
                saved: t.queues.len(),
                device: sizes.len(),
            });
        }
        let mut queues = Vec::with_capacity(sizes.len());
        for (index, (saved, &max)) in t.queues.iter().zip(sizes).enumerate() {
            if saved.max_size != max {
                return Err(VirtioError::QueueState {
                    index,
                    source: virtio_queue::Error::InvalidMaxSize,
                });
            }
            let q = Queue::try_from(QueueState::from(saved))
                .map_err(|source| VirtioError::QueueState { index, source })?;
            queues.push(q);
        }
        let mut transport = Self {
            device,
            mem: args.mem,
            interrupt: Interrupt::new(args.irq),
            queues,
            dirty: DirtyPages::default(),
            status: t.status,
            device_features_select: t.device_features_select,
            driver_features_select: t.driver_features_select,
            acked_features: t.acked_features,
            queue_select: t.queue_select,
            config_generation: t.config_generation,
        };
        transport.interrupt.set_status(t.interrupt_status);
        if transport.is_activated() {
            transport.activate()?;
        }
        Ok(transport)
    }
}
