//! The virtio-net device: one rx and one tx queue over a tap. A device
//! thread (see `devices/worker.rs`) waits on the queue eventfds and the tap
//! and moves whole frames, each behind its 12-byte `virtio_net_hdr_v1`,
//! which passes between guest and tap unchanged: the offloads the guest
//! negotiates (checksum, TSO, UFO) are the tap's offloads. With
//! `VIRTIO_NET_F_MRG_RXBUF` a frame from the tap may fill several rx
//! buffers (the header's `num_buffers` says how many), so the driver posts
//! page-sized buffers instead of 64 KiB ones for TSO frames.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use virtio_bindings::virtio_net::{
    VIRTIO_NET_F_CSUM, VIRTIO_NET_F_GUEST_CSUM, VIRTIO_NET_F_GUEST_TSO4, VIRTIO_NET_F_GUEST_TSO6,
    VIRTIO_NET_F_GUEST_UFO, VIRTIO_NET_F_HOST_TSO4, VIRTIO_NET_F_HOST_TSO6, VIRTIO_NET_F_HOST_UFO,
    VIRTIO_NET_F_MAC, VIRTIO_NET_F_MRG_RXBUF, VIRTIO_NET_HDR_F_NEEDS_CSUM, VIRTIO_NET_HDR_GSO_ECN,
    VIRTIO_NET_HDR_GSO_NONE, VIRTIO_NET_HDR_GSO_TCPV4, VIRTIO_NET_HDR_GSO_TCPV6,
    VIRTIO_NET_HDR_GSO_UDP,
};
use virtio_queue::QueueT;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use super::tap::{Tap, TapError, VNET_HDR_LEN};
use crate::devices::rate_limiter::{Clock, MonotonicClock, RateLimit, RateLimiter};
use crate::devices::virtio::queue::ChainError;
use crate::devices::virtio::{
    DescChain, QueueContext, VirtioDevice, VirtioError, VIRTIO_F_RING_EVENT_IDX, VIRTIO_F_VERSION_1,
};
use crate::devices::worker::EpollDevice;
use torpor_vmm_api::launch::{MacAddr, NetSpec};

pub const TYPE_NET: u32 = 1;
pub const RXQ: usize = 0;
pub const TXQ: usize = 1;
pub const QUEUE_SIZE: u16 = 256;
/// Largest Ethernet frame with GSO: 64 KiB of IP plus the MAC header.
pub const MAX_FRAME: usize = 65_550;
/// Longest chain a frame may come in (Linux uses at most MAX_SKB_FRAGS + 2).
pub const MAX_FRAME_DESCRIPTORS: usize = 64;

/// Epoll tokens: the queue eventfds are 0 and 1.
const TOKEN_TAP: u64 = 2;
pub const TOKEN_WAKE: u64 = 3;

const fn bit(n: u32) -> u64 {
    1 << n
}

/// The offloads: what the guest may send (HOST_*) and receive (GUEST_*).
pub const OFFLOAD_FEATURES: u64 = bit(VIRTIO_NET_F_CSUM)
    | bit(VIRTIO_NET_F_GUEST_CSUM)
    | bit(VIRTIO_NET_F_GUEST_TSO4)
    | bit(VIRTIO_NET_F_GUEST_TSO6)
    | bit(VIRTIO_NET_F_GUEST_UFO)
    | bit(VIRTIO_NET_F_HOST_TSO4)
    | bit(VIRTIO_NET_F_HOST_TSO6)
    | bit(VIRTIO_NET_F_HOST_UFO);

/// Errors of the net device and of the frames it moves.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error(transparent)]
    Tap(#[from] TapError),
    #[error("epoll failed: {0}")]
    Epoll(std::io::Error),
    #[error(transparent)]
    Worker(#[from] crate::devices::worker::WorkerError),
    #[error("the snapshot's guest MAC is {saved}; a clone keeps it (asked for {asked})")]
    MacChanged { saved: MacAddr, asked: MacAddr },
    #[error("descriptor chain has more than {MAX_FRAME_DESCRIPTORS} descriptors")]
    TooManyDescriptors,
    #[error("a tx chain has a device-writable descriptor")]
    WritableTx,
    #[error("an rx chain has a device-readable descriptor")]
    ReadableRx,
    #[error("a buffer lies outside guest memory")]
    OutsideMemory,
    #[error("frame of {0} bytes is shorter than the {VNET_HDR_LEN}-byte header")]
    ShortFrame(u64),
    #[error("frame of {0} bytes is longer than {MAX_FRAME} bytes plus the header")]
    FrameTooLarge(u64),
    #[error("the header asks for an offload the driver did not negotiate ({0})")]
    OffloadNotNegotiated(&'static str),
    #[error("rx buffers of {buffer} bytes cannot hold a {frame}-byte frame")]
    BufferTooSmall { buffer: u64, frame: usize },
    #[error("the first rx buffer ({0} bytes) cannot hold the {VNET_HDR_LEN}-byte header")]
    HeaderSplit(u64),
    #[error("guest memory access failed: {0}")]
    Chain(#[from] ChainError),
    #[error("writing to the tap failed: {0}")]
    TapWrite(std::io::Error),
}

impl NetError {
    /// The chain itself broke the rules (as opposed to the host side
    /// failing, or a frame not fitting).
    fn is_malformed(&self) -> bool {
        !matches!(
            self,
            NetError::TapWrite(_) | NetError::BufferTooSmall { .. } | NetError::Tap(_)
        )
    }
}

/// Counters, as the pod reads them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetMetrics {
    /// Frames and their bytes (without the header) the guest received.
    pub rx_packets: u64,
    pub rx_bytes: u64,
    /// Frames the guest sent that reached the tap.
    pub tx_packets: u64,
    pub tx_bytes: u64,
    /// Frames from the tap dropped (no room in the guest's buffer).
    pub rx_dropped: u64,
    /// Frames from the guest the tap refused.
    pub tx_dropped: u64,
    /// Chains that broke the virtio rules, returned unused.
    pub malformed_chains: u64,
    /// Times a direction waited for its rate limiter.
    pub rx_throttled: u64,
    pub tx_throttled: u64,
}

/// A virtio-net device on a tap.
#[derive(Debug)]
pub struct NetDevice {
    pub(super) tap: Tap,
    pub(super) mac: MacAddr,
    pub(super) rx_limit: RateLimit,
    pub(super) tx_limit: RateLimit,
    pub(super) netns: Option<std::path::PathBuf>,
    rx_limiter: RateLimiter,
    tx_limiter: RateLimiter,
    clock: Arc<dyn Clock>,
    epoll: Arc<Epoll>,
    queue_evts: [EventFd; 2],
    acked: u64,
    /// A frame read from the tap, waiting for an rx buffer or tokens.
    rx_frame: Vec<u8>,
    rx_len: usize,
    /// The tap may hold more frames (it is watched edge-triggered).
    tap_readable: bool,
    /// Clock time (ns) a throttled direction may go on.
    rx_wait_until: Option<u64>,
    tx_wait_until: Option<u64>,
    tx_buf: Vec<u8>,
    metrics: NetMetrics,
}

/// `TUN_F_*` offloads for what the guest takes (GUEST_* features); TSO
/// and UFO need checksum offload (the kernel refuses them without it).
fn tun_offloads(acked: u64) -> libc::c_uint {
    if acked & bit(VIRTIO_NET_F_GUEST_CSUM) == 0 {
        return 0;
    }
    let mut flags = libc::TUN_F_CSUM;
    for (feature, flag) in [
        (VIRTIO_NET_F_GUEST_TSO4, libc::TUN_F_TSO4),
        (VIRTIO_NET_F_GUEST_TSO6, libc::TUN_F_TSO6),
        (VIRTIO_NET_F_GUEST_UFO, libc::TUN_F_UFO),
    ] {
        if acked & bit(feature) != 0 {
            flags |= flag;
        }
    }
    flags
}

impl NetDevice {
    /// Opens the tap and sets up the epoll set, with the host's clock.
    pub fn new(spec: &NetSpec) -> Result<Self, NetError> {
        Self::with_clock(spec, Arc::new(MonotonicClock::default()))
    }

    /// `new` with the rate limiters on `clock`.
    pub fn with_clock(spec: &NetSpec, clock: Arc<dyn Clock>) -> Result<Self, NetError> {
        let tap = Tap::open_in(&spec.tap, spec.netns.as_deref())?;
        let epoll = Epoll::new().map_err(NetError::Epoll)?;
        let queue_evts = crate::devices::worker::queue_eventfds(&epoll)?;
        epoll
            .ctl(
                ControlOperation::Add,
                tap.fd(),
                EpollEvent::new(EventSet::IN | EventSet::EDGE_TRIGGERED, TOKEN_TAP),
            )
            .map_err(NetError::Epoll)?;
        Ok(Self {
            mac: spec.mac.unwrap_or(MacAddr::DEFAULT_GUEST),
            rx_limiter: RateLimiter::new(&spec.rx, clock.clone()),
            tx_limiter: RateLimiter::new(&spec.tx, clock.clone()),
            rx_limit: spec.rx.clone(),
            tx_limit: spec.tx.clone(),
            netns: spec.netns.clone(),
            clock,
            tap,
            epoll: Arc::new(epoll),
            queue_evts,
            acked: 0,
            rx_frame: vec![0; VNET_HDR_LEN + MAX_FRAME],
            rx_len: 0,
            tap_readable: true,
            rx_wait_until: None,
            tx_wait_until: None,
            tx_buf: vec![0; VNET_HDR_LEN + MAX_FRAME],
            metrics: NetMetrics::default(),
        })
    }

    pub fn tap_name(&self) -> &str {
        self.tap.name()
    }

    pub fn mac(&self) -> MacAddr {
        self.mac
    }

    pub fn metrics(&self) -> NetMetrics {
        self.metrics
    }

    /// Tokens left in the rx and tx limiters: `(bytes, packets)` each.
    pub fn tokens(&self) -> [(Option<u64>, Option<u64>); 2] {
        [self.rx_limiter.tokens(), self.tx_limiter.tokens()]
    }

    /// The notification eventfd of queue `index` (rx 0, tx 1), for KVM
    /// ioeventfd registration.
    pub fn queue_evt(&self, index: usize) -> Option<&EventFd> {
        self.queue_evts.get(index)
    }

    fn wait_until(&mut self, wait_ns: u64) -> Option<u64> {
        Some(self.clock.now_ns().saturating_add(wait_ns))
    }

    /// Handles what epoll reported, then moves frames both ways if the
    /// driver has activated the device.
    pub fn handle_events(&mut self, events: &[EpollEvent], ctx: Option<&mut QueueContext<'_>>) {
        let mut kick_tx = false;
        for ev in events {
            match ev.data() {
                t @ 0..=1 => {
                    let _ = self.queue_evts[t as usize].read();
                    kick_tx |= t as usize == TXQ;
                }
                TOKEN_TAP => self.tap_readable = true,
                _ => {}
            }
        }
        if let Some(ctx) = ctx {
            if kick_tx || self.tx_wait_until.is_some() {
                self.process_tx(ctx);
            }
            self.process_rx(ctx);
        }
    }

    fn process_tx(&mut self, ctx: &mut QueueContext<'_>) {
        self.tx_wait_until = None;
        let mut used = false;
        while let Some(chain) = ctx.pop_or_enable(TXQ) {
            if let Err(wait) = self.tx_limiter.check(frame_bytes(chain.readable_len())) {
                ctx.undo_pop(TXQ);
                self.tx_wait_until = self.wait_until(wait);
                self.metrics.tx_throttled += 1;
                break;
            }
            match self.transmit(ctx, &chain) {
                Ok(len) => {
                    self.tx_limiter.consume(len);
                    self.metrics.tx_packets += 1;
                    self.metrics.tx_bytes += len;
                }
                Err(e) => self.count_error("tx", chain.head, &e),
            }
            ctx.add_used(TXQ, chain.head, 0);
            used = true;
        }
        if used {
            ctx.notify_guest(TXQ);
        }
    }

    fn count_error(&mut self, queue: &str, head: u16, e: &NetError) {
        tracing::debug!(queue, head, "virtio-net: {e}");
        if e.is_malformed() {
            self.metrics.malformed_chains += 1;
        } else if queue == "tx" {
            self.metrics.tx_dropped += 1;
        } else {
            self.metrics.rx_dropped += 1;
        }
    }

    fn check_chain(&self, ctx: &QueueContext<'_>, chain: &DescChain) -> Result<(), NetError> {
        if chain.truncated || chain.descs.len() > MAX_FRAME_DESCRIPTORS {
            return Err(NetError::TooManyDescriptors);
        }
        if !chain.in_memory(ctx.mem) {
            return Err(NetError::OutsideMemory);
        }
        Ok(())
    }

    /// Checks a header from the guest against what was negotiated.
    fn check_tx_header(&self, hdr: &[u8]) -> Result<(), NetError> {
        let has = |f: u32| self.acked & bit(f) != 0;
        if u32::from(hdr[0]) & VIRTIO_NET_HDR_F_NEEDS_CSUM != 0 && !has(VIRTIO_NET_F_CSUM) {
            return Err(NetError::OffloadNotNegotiated("checksum"));
        }
        let (needed, what) = match u32::from(hdr[1]) & !VIRTIO_NET_HDR_GSO_ECN {
            VIRTIO_NET_HDR_GSO_NONE => return Ok(()),
            VIRTIO_NET_HDR_GSO_TCPV4 => (VIRTIO_NET_F_HOST_TSO4, "TSO4"),
            VIRTIO_NET_HDR_GSO_TCPV6 => (VIRTIO_NET_F_HOST_TSO6, "TSO6"),
            VIRTIO_NET_HDR_GSO_UDP => (VIRTIO_NET_F_HOST_UFO, "UFO"),
            _ => return Err(NetError::OffloadNotNegotiated("unknown GSO type")),
        };
        if has(needed) {
            Ok(())
        } else {
            Err(NetError::OffloadNotNegotiated(what))
        }
    }

    /// Sends one frame to the tap; returns its length without the header.
    fn transmit(&mut self, ctx: &QueueContext<'_>, chain: &DescChain) -> Result<u64, NetError> {
        self.check_chain(ctx, chain)?;
        if chain.descs.iter().any(|d| d.writable) {
            return Err(NetError::WritableTx);
        }
        let len = chain.readable_len();
        if len < VNET_HDR_LEN as u64 {
            return Err(NetError::ShortFrame(len));
        }
        if len > (VNET_HDR_LEN + MAX_FRAME) as u64 {
            return Err(NetError::FrameTooLarge(len));
        }
        let frame = &mut self.tx_buf[..len as usize];
        ctx.read(chain, 0, frame)?;
        // num_buffers means nothing on tx; the tap ignores it.
        self.check_tx_header(&self.tx_buf[..VNET_HDR_LEN])?;
        match self.tap.write(&self.tx_buf[..len as usize]) {
            Ok(_) => Ok(len - VNET_HDR_LEN as u64),
            Err(e) => Err(NetError::TapWrite(e)),
        }
    }

    /// Reads the next frame from the tap into `rx_frame` unless one waits
    /// already; false when there is none.
    fn fill_rx_frame(&mut self) -> bool {
        while self.rx_len == 0 {
            if !self.tap_readable {
                return false;
            }
            match self.tap.read(&mut self.rx_frame) {
                Ok(n) if n > VNET_HDR_LEN => self.rx_len = n,
                Ok(_) => self.metrics.rx_dropped += 1,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    if e.kind() != std::io::ErrorKind::WouldBlock {
                        tracing::warn!(tap = self.tap.name(), "tap read failed: {e}");
                    }
                    self.tap_readable = false;
                }
            }
        }
        true
    }

    fn process_rx(&mut self, ctx: &mut QueueContext<'_>) {
        self.rx_wait_until = None;
        let mut used = false;
        while self.fill_rx_frame() {
            let bytes = (self.rx_len - VNET_HDR_LEN) as u64;
            if let Err(wait) = self.rx_limiter.check(bytes) {
                self.rx_wait_until = self.wait_until(wait);
                self.metrics.rx_throttled += 1;
                break;
            }
            // Not enough buffers: the frame waits (and the tap's queue
            // behind it) for the driver's next rx notification.
            let Some(chains) = self.take_rx_buffers(ctx) else {
                break;
            };
            match self.receive(ctx, &chains) {
                Ok(()) => {
                    self.rx_limiter.consume(bytes);
                    self.metrics.rx_packets += 1;
                    self.metrics.rx_bytes += bytes;
                }
                Err(e) => {
                    self.count_error("rx", chains[0].head, &e);
                    for chain in &chains {
                        ctx.add_used(RXQ, chain.head, 0);
                    }
                }
            }
            self.rx_len = 0;
            used = true;
        }
        if used {
            ctx.notify_guest(RXQ);
        }
    }

    /// The rx chains the waiting frame goes into: one, or with mergeable
    /// buffers as many as it needs (at most the queue's size: a frame that
    /// the whole ring cannot hold is dropped by `receive`). None, with
    /// every chain taken put back, while the driver has offered too few.
    fn take_rx_buffers(&self, ctx: &mut QueueContext<'_>) -> Option<Vec<DescChain>> {
        let mergeable = self.acked & bit(VIRTIO_NET_F_MRG_RXBUF) != 0;
        let most = if mergeable {
            ctx.queue(RXQ)
                .map_or(1, |q| usize::from(QueueT::size(q)).max(1))
        } else {
            1
        };
        let mut chains = Vec::new();
        let mut room = 0u64;
        while room < self.rx_len as u64 && chains.len() < most {
            let Some(chain) = ctx.pop_or_enable(RXQ) else {
                for _ in &chains {
                    ctx.undo_pop(RXQ);
                }
                return None;
            };
            room += chain.writable_len();
            chains.push(chain);
        }
        Some(chains)
    }

    /// Copies the waiting frame into `chains` (the header into the first,
    /// `num_buffers` set to their count) and returns each to the driver
    /// with what it holds.
    fn receive(
        &mut self,
        ctx: &mut QueueContext<'_>,
        chains: &[DescChain],
    ) -> Result<(), NetError> {
        for chain in chains {
            self.check_chain(ctx, chain)?;
            if chain.descs.iter().any(|d| !d.writable) {
                return Err(NetError::ReadableRx);
            }
        }
        let frame = &mut self.rx_frame[..self.rx_len];
        let room: u64 = chains.iter().map(DescChain::writable_len).sum();
        if room < frame.len() as u64 {
            return Err(NetError::BufferTooSmall {
                buffer: room,
                frame: frame.len(),
            });
        }
        let first = chains[0].writable_len();
        if first < VNET_HDR_LEN as u64 {
            return Err(NetError::HeaderSplit(first));
        }
        // At most the queue's size (u16), and 1 without MRG_RXBUF.
        let count = u16::try_from(chains.len()).unwrap_or(u16::MAX);
        frame[10..12].copy_from_slice(&count.to_le_bytes());
        // Every chain is written before any is used: on an error the
        // caller returns them all empty.
        let total = frame.len();
        let mut at = 0;
        for chain in chains {
            let n = share(total - at, chain);
            ctx.write(chain, 0, &frame[at..at + n])?;
            at += n;
        }
        let mut at = 0;
        for chain in chains {
            let n = share(total - at, chain);
            ctx.add_used(RXQ, chain.head, n as u32);
            at += n;
        }
        Ok(())
    }

    fn ms_until(&self, deadline: Option<u64>) -> Option<i32> {
        let left = deadline?.saturating_sub(self.clock.now_ns());
        Some(left.div_ceil(1_000_000).min(i32::MAX as u64) as i32)
    }
}

/// The bytes of a frame with `left` bytes still to place that `chain`
/// takes.
fn share(left: usize, chain: &DescChain) -> usize {
    left.min(usize::try_from(chain.writable_len()).unwrap_or(usize::MAX))
}

/// Frame bytes (without the header) of a chain of `len` readable bytes.
fn frame_bytes(len: u64) -> u64 {
    len.saturating_sub(VNET_HDR_LEN as u64)
}

impl VirtioDevice for NetDevice {
    fn device_type(&self) -> u32 {
        TYPE_NET
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE; 2]
    }

    fn avail_features(&self) -> u64 {
        VIRTIO_F_VERSION_1
            | VIRTIO_F_RING_EVENT_IDX
            | bit(VIRTIO_NET_F_MAC)
            | bit(VIRTIO_NET_F_MRG_RXBUF)
            | OFFLOAD_FEATURES
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // struct virtio_net_config: mac[6], then fields of features not
        // offered (status, queue pairs, mtu) that read as 0.
        let config = self.mac.0;
        crate::devices::virtio::read_config_bytes(&config, offset, data);
    }

    /// Sets the tap's offloads to what the guest takes and wakes the
    /// device thread to look at both queues and the tap (after a restore,
    /// notifications from before the snapshot are lost).
    fn activate(&mut self, acked_features: u64) -> Result<(), VirtioError> {
        self.tap
            .set_offload(tun_offloads(acked_features))
            .map_err(|e| VirtioError::Activate(e.to_string()))?;
        self.acked = acked_features;
        self.tap_readable = true;
        crate::devices::worker::kick_all(&self.queue_evts)
    }

    fn queue_notify(&mut self, index: usize, _ctx: &mut QueueContext<'_>) {
        crate::devices::worker::kick_queue(&self.queue_evts, index, "net");
    }

    fn reset(&mut self) {
        self.acked = 0;
        self.rx_len = 0;
        self.rx_wait_until = None;
        self.tx_wait_until = None;
        if let Err(e) = self.tap.set_offload(0) {
            tracing::warn!("cannot clear the tap's offloads: {e}");
        }
    }
}

impl EpollDevice for NetDevice {
    const THREAD_NAME: &'static str = "net";
    const SECCOMP: crate::seccomp::ThreadKind = crate::seccomp::ThreadKind::Net;
    const TOKEN_WAKE: u64 = TOKEN_WAKE;

    fn epoll(&self) -> Arc<Epoll> {
        self.epoll.clone()
    }

    fn next_timeout_ms(&self) -> i32 {
        [self.rx_wait_until, self.tx_wait_until]
            .into_iter()
            .filter_map(|d| self.ms_until(d))
            .min()
            .unwrap_or(-1)
    }

    fn handle_events(&mut self, events: &[EpollEvent], ctx: Option<&mut QueueContext<'_>>) {
        NetDevice::handle_events(self, events, ctx)
    }
}
