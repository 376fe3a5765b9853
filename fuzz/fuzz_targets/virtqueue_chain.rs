//! Descriptor chains as a guest lays them out: a queue whose descriptor
//! table, rings and buffers all come from the input, taken off the
//! available ring by the transport and read and written through
//! `DescChain` by a device that does what every real one does.
//!
//! Input: flags, queue size, ring addresses (see `torpor_fuzz::program`),
//! then offsets for the device's accesses, then the guest memory image.
#![no_main]

use libfuzzer_sys::fuzz_target;
use torpor_fuzz::{guest_mem, notify, program, Input};
use torpor_vmm::devices::virtio::{
    MmioTransport, QueueContext, VirtioDevice, VirtioError, VIRTIO_F_RING_EVENT_IDX,
    VIRTIO_F_VERSION_1,
};
use vmm_sys_util::eventfd::EventFd;

/// A device that reads what each chain offers and writes back into its
/// writable part at input-chosen offsets.
struct Echo {
    read_at: u64,
    write_at: u64,
}

impl VirtioDevice for Echo {
    fn device_type(&self) -> u32 {
        // Any id the transport accepts; the type plays no part here.
        torpor_vmm::devices::virtio::TYPE_BLOCK
    }
    fn queue_max_sizes(&self) -> &[u16] {
        &[256]
    }
    fn avail_features(&self) -> u64 {
        VIRTIO_F_VERSION_1 | VIRTIO_F_RING_EVENT_IDX
    }
    fn read_config(&self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }
    fn activate(&mut self, _acked: u64) -> Result<(), VirtioError> {
        Ok(())
    }
    fn queue_notify(&mut self, index: usize, ctx: &mut QueueContext<'_>) {
        let (read_at, write_at) = (self.read_at, self.write_at);
        ctx.drain(index, |ctx, chain| {
            let mem = ctx.mem;
            let _ = chain.is_ordered();
            let _ = chain.in_memory(mem);
            let readable = chain.readable_len().min(64 << 10);
            let mut buf = vec![0u8; (readable.saturating_sub(read_at)) as usize];
            let _ = ctx.read(chain, read_at, &mut buf);
            let writable = chain.writable_len().min(64 << 10);
            let out = vec![0xa5u8; (writable.saturating_sub(write_at)) as usize];
            match ctx.write(chain, write_at, &out) {
                Ok(()) => out.len() as u32,
                Err(_) => 0,
            }
        });
    }
    fn reset(&mut self) {}
}

fuzz_target!(|data: &[u8]| {
    let mut input = Input(data);
    let header: Vec<u8> = input.bytes(8).to_vec();
    let dev = Echo {
        read_at: u64::from(input.u16()),
        write_at: u64::from(input.u16()),
    };
    let mem = guest_mem(input.rest());
    let irq = EventFd::new(libc::EFD_NONBLOCK).expect("eventfd");
    let Ok(mut t) = MmioTransport::new(dev, mem, irq) else {
        return;
    };
    program(&mut t, &mut Input(&header), 1);
    // Twice: the second pass sees the indexes the first one left.
    notify(&mut t, 0);
    notify(&mut t, 0);
});
