//! The virtio-balloon device (virtio 1.2, 5.5): inflate and deflate queues,
//! the statistics queue and the free page reporting queue. A device thread
//! (see `devices/worker.rs`) takes the guest's buffers off the queues.
//!
//! Pages the guest puts into the balloon (inflate) and ranges it reports
//! free are discarded on the host with `madvise(MADV_DONTNEED)`. Every
//! memory backend maps guest RAM `MAP_PRIVATE` (anonymous memory, a private
//! mapping of the memory file, private anonymous memory under userfaultfd,
//! a private mapping of the shmem template under uffd-shared), so
//! `MADV_DONTNEED` frees the VM's private copy and never touches a shared
//! file: the next touch reads a zero page (anonymous), the memory file's
//! or template's page (private file mappings), or faults into the page
//! server again (uffd), which serves every fault afresh. The balloon spec
//! leaves the content of such pages undefined, so any of these is right.
//! `MADV_REMOVE` would punch holes into the shared template: never used.
//!
//! Every page number and range the guest hands over is checked against
//! guest memory before anything is discarded; a chain that breaks the rules
//! is counted and returned unused, never trusted.

use std::sync::Arc;
use std::time::Instant;

use torpor_vmm_api::control::{BalloonCounters, BalloonStatus, GuestMemoryStats};
use vm_memory::{
    Address, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion,
    MemoryRegionAddress,
};
use vmm_sys_util::epoll::{Epoll, EpollEvent};
use vmm_sys_util::eventfd::EventFd;

use crate::devices::virtio::{
    DescChain, QueueContext, VirtioDevice, VirtioError, VIRTIO_F_RING_EVENT_IDX, VIRTIO_F_VERSION_1,
};
use crate::devices::worker::{EpollDevice, WorkerError};

pub const TYPE_BALLOON: u32 = 5;
pub const QUEUE_SIZE: u16 = 256;
/// Queues the transport offers: inflate, deflate, statistics, reporting.
pub const QUEUES: usize = 4;
pub const TOKEN_WAKE: u64 = QUEUES as u64;

/// Feature bits (virtio 1.2, 5.5.3).
pub const F_MUST_TELL_HOST: u64 = 1 << 0;
pub const F_STATS_VQ: u64 = 1 << 1;
pub const F_DEFLATE_ON_OOM: u64 = 1 << 2;
pub const F_REPORTING: u64 = 1 << 5;

/// Balloon page numbers count 4 KiB pages whatever the guest's page size.
pub const PAGE_SHIFT: u64 = 12;
pub const PAGE_SIZE: u64 = 1 << PAGE_SHIFT;
pub const PAGES_PER_MIB: u64 = (1 << 20) / PAGE_SIZE;
/// One statistic: `le16 tag; le64 val`, packed.
pub const STAT_LEN: usize = 10;
/// Largest statistics buffer read (Linux sends 10–16 entries).
pub const MAX_STATS: usize = 64;
/// Largest inflate/deflate buffer read (Linux sends at most 256 PFNs).
pub const MAX_PFNS: usize = 4096;

/// Errors of the balloon device.
#[derive(Debug, thiserror::Error)]
pub enum BalloonError {
    #[error("epoll failed: {0}")]
    Epoll(std::io::Error),
    #[error(transparent)]
    Worker(#[from] WorkerError),
    #[error("balloon target of {0} MiB is larger than guest memory")]
    TargetTooLarge(u64),
}

/// What a queue index means once features are negotiated: queues after
/// the deflate queue exist only for the features the driver took, and
/// Linux numbers them densely (virtio 1.2, 5.5.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Inflate,
    Deflate,
    Stats,
    Report,
}

/// Why a chain was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Refusal {
    /// The chain broke the virtio rules (wrong direction, bad length,
    /// outside guest memory).
    Malformed,
    /// A page number or range outside guest memory (skipped; the rest of
    /// the chain is used).
    OutOfRange,
}

/// A virtio-balloon device.
#[derive(Debug)]
pub struct BalloonDevice {
    mem_bytes: u64,
    epoll: Arc<Epoll>,
    queue_evts: [EventFd; QUEUES],
    acked: u64,
    active: bool,
    /// `num_pages` of the configuration space: what the host wants held.
    pub(super) target_pages: u32,
    /// `actual`, written by the driver.
    pub(super) actual_pages: u32,
    /// The statistics buffer the device holds until it wants fresh stats.
    stats_head: Option<u16>,
    /// Fresh statistics were asked for while no buffer was held.
    stats_wanted: bool,
    stats: Option<(GuestMemoryStats, Instant)>,
    counters: BalloonCounters,
}

impl BalloonDevice {
    /// A balloon for a guest of `mem_bytes` of RAM, empty.
    pub fn new(mem_bytes: u64) -> Result<Self, BalloonError> {
        let epoll = Epoll::new().map_err(BalloonError::Epoll)?;
        let queue_evts = crate::devices::worker::queue_eventfds(&epoll)?;
        Ok(Self {
            mem_bytes,
            epoll: Arc::new(epoll),
            queue_evts,
            acked: 0,
            active: false,
            target_pages: 0,
            actual_pages: 0,
            stats_head: None,
            stats_wanted: false,
            stats: None,
            counters: BalloonCounters::default(),
        })
    }

    pub(super) fn save_state(&self) -> super::BalloonState {
        super::BalloonState {
            mem_bytes: self.mem_bytes,
            target_pages: self.target_pages,
            actual_pages: self.actual_pages,
            stats_head: self.stats_head,
            counters: self.counters,
        }
    }

    /// A device as saved; a statistics buffer it held is held again.
    pub(super) fn from_state(state: &super::BalloonState) -> Result<Self, BalloonError> {
        let mut dev = Self::new(state.mem_bytes)?;
        dev.target_pages = state.target_pages;
        dev.actual_pages = state.actual_pages;
        dev.stats_head = state.stats_head.filter(|h| *h < QUEUE_SIZE);
        dev.counters = state.counters;
        Ok(dev)
    }

    /// The notification eventfd of queue `index`, for KVM ioeventfd.
    pub fn queue_evt(&self, index: usize) -> Option<&EventFd> {
        self.queue_evts.get(index)
    }

    pub fn counters(&self) -> BalloonCounters {
        self.counters
    }

    /// Sets the target; the caller signals the configuration change
    /// (`MmioTransport::config_changed` and a config interrupt).
    pub fn set_target_mib(&mut self, mib: u64) -> Result<(), BalloonError> {
        let pages = mib.saturating_mul(PAGES_PER_MIB);
        if pages.saturating_mul(PAGE_SIZE) > self.mem_bytes {
            return Err(BalloonError::TargetTooLarge(mib));
        }
        self.target_pages = u32::try_from(pages).map_err(|_| BalloonError::TargetTooLarge(mib))?;
        Ok(())
    }

    /// What the device knows; asks the guest for fresh statistics (they
    /// arrive asynchronously, see `stats_age_ms`).
    pub fn status(&mut self) -> BalloonStatus {
        self.request_stats();
        BalloonStatus {
            target_mib: u64::from(self.target_pages) / PAGES_PER_MIB,
            actual_mib: u64::from(self.actual_pages) / PAGES_PER_MIB,
            active: self.active,
            free_page_reporting: self.active && self.acked & F_REPORTING != 0,
            counters: self.counters,
            guest: self.stats.map(|(s, _)| s),
            stats_age_ms: self
                .stats
                .map(|(_, at)| at.elapsed().as_millis().min(u128::from(u64::MAX)) as u64),
        }
    }

    /// Makes the device thread return the held statistics buffer, which
    /// asks the driver to refill it.
    pub fn request_stats(&mut self) {
        if self.active && self.acked & F_STATS_VQ != 0 {
            self.stats_wanted = true;
            if let Some(index) = self.queue_of(Role::Stats) {
                crate::devices::worker::kick_queue(&self.queue_evts, index, "balloon");
            }
        }
    }

    fn role_of(&self, index: usize) -> Option<Role> {
        let mut roles = vec![Role::Inflate, Role::Deflate];
        if self.acked & F_STATS_VQ != 0 {
            roles.push(Role::Stats);
        }
        if self.acked & F_REPORTING != 0 {
            roles.push(Role::Report);
        }
        roles.get(index).copied()
    }

    fn queue_of(&self, role: Role) -> Option<usize> {
        (0..QUEUES).find(|&i| self.role_of(i) == Some(role))
    }

    /// Handles what epoll reported, then every queue that may hold work.
    pub fn handle_events(&mut self, events: &[EpollEvent], ctx: Option<&mut QueueContext<'_>>) {
        let mut kicked = [false; QUEUES];
        for ev in events {
            if let Some(evt) = self.queue_evts.get(ev.data() as usize) {
                let _ = evt.read();
                kicked[ev.data() as usize] = true;
            }
        }
        let Some(ctx) = ctx else {
            return;
        };
        for (index, _) in kicked.iter().enumerate().filter(|(_, k)| **k) {
            match self.role_of(index) {
                Some(Role::Inflate) => self.drain_pfns(ctx, index, true),
                Some(Role::Deflate) => self.drain_pfns(ctx, index, false),
                Some(Role::Report) => self.drain_reports(ctx, index),
                Some(Role::Stats) => self.handle_stats(ctx, index),
                None => {}
            }
        }
    }

    fn count(&mut self, r: Refusal, head: u16, queue: &str) {
        crate::guest_warn!(queue, head, "virtio-balloon refused a chain: {r:?}");
        match r {
            Refusal::Malformed => self.counters.malformed_chains += 1,
            Refusal::OutOfRange => self.counters.refused_ranges += 1,
        }
    }

    fn drain_pfns(&mut self, ctx: &mut QueueContext<'_>, index: usize, inflate: bool) {
        let mut refusals = Vec::new();
        let mut pages = 0u64;
        let mut discard_failures = 0u64;
        ctx.drain(index, |ctx, chain| {
            match read_pfns(ctx, chain) {
                Ok(pfns) => {
                    for (first, n) in pfn_runs(&pfns) {
                        let range = first
                            .checked_mul(PAGE_SIZE)
                            .zip(n.checked_mul(PAGE_SIZE))
                            .filter(|&(a, l)| in_memory(ctx.mem, a, l));
                        let Some((addr, len)) = range else {
                            refusals.push((Refusal::OutOfRange, chain.head));
                            continue;
                        };
                        pages += n;
                        if inflate {
                            discard_failures += discard(ctx.mem, addr, len);
                        }
                    }
                }
                Err(r) => refusals.push((r, chain.head)),
            }
            0
        });
        let queue = if inflate { "inflate" } else { "deflate" };
        for (r, head) in refusals {
            self.count(r, head, queue);
        }
        self.counters.discard_failures += discard_failures;
        if inflate {
            self.counters.inflated_pages += pages;
        } else {
            self.counters.deflated_pages += pages;
        }
    }

    fn drain_reports(&mut self, ctx: &mut QueueContext<'_>, index: usize) {
        let mut refusals = Vec::new();
        let mut bytes = 0u64;
        let mut discard_failures = 0u64;
        ctx.drain(index, |ctx, chain| {
            // Linux adds the free ranges as device-writable buffers whose
            // addresses are the free memory itself.
            if chain.truncated || chain.descs.iter().any(|d| !d.writable) {
                refusals.push((Refusal::Malformed, chain.head));
                return 0;
            }
            for d in &chain.descs {
                let len = u64::from(d.len);
                if !d.addr.is_multiple_of(PAGE_SIZE) || !len.is_multiple_of(PAGE_SIZE) {
                    refusals.push((Refusal::Malformed, chain.head));
                    continue;
                }
                if !in_memory(ctx.mem, d.addr, len) {
                    refusals.push((Refusal::OutOfRange, chain.head));
                    continue;
                }
                discard_failures += discard(ctx.mem, d.addr, len);
                bytes += len;
            }
            0
        });
        for (r, head) in refusals {
            self.count(r, head, "reporting");
        }
        self.counters.discard_failures += discard_failures;
        self.counters.reported_bytes += bytes;
    }

    /// Takes a statistics buffer the driver (re)filled, and hands it back
    /// at once if fresh statistics were asked for meanwhile.
    fn handle_stats(&mut self, ctx: &mut QueueContext<'_>, index: usize) {
        while let Some(chain) = ctx.pop_or_enable(index) {
            if let Some(old) = self.stats_head.take() {
                // A driver holds one buffer; a second one means the first
                // is abandoned: give it back.
                ctx.add_used(index, old, 0);
            }
            match parse_stats(ctx, &chain) {
                Ok(stats) => {
                    self.stats = Some((stats, Instant::now()));
                    self.counters.stats_updates += 1;
                }
                Err(r) => self.count(r, chain.head, "stats"),
            }
            self.stats_head = Some(chain.head);
        }
        if self.stats_wanted {
            if let Some(head) = self.stats_head.take() {
                self.stats_wanted = false;
                ctx.add_used(index, head, 0);
            }
        }
        ctx.notify_guest(index);
    }
}

/// The bytes of a device-readable chain of whole `unit`-byte entries, at
/// most `max` of them.
fn read_entries(
    ctx: &QueueContext<'_>,
    chain: &DescChain,
    unit: usize,
    max: usize,
) -> Result<Vec<u8>, Refusal> {
    let len = chain.readable_len();
    if chain.truncated
        || chain.writable_len() != 0
        || !len.is_multiple_of(unit as u64)
        || len > (max * unit) as u64
        || !chain.in_memory(ctx.mem)
    {
        return Err(Refusal::Malformed);
    }
    let mut buf = vec![0u8; len as usize];
    ctx.read(chain, 0, &mut buf)
        .map_err(|_| Refusal::Malformed)?;
    Ok(buf)
}

/// The page numbers of an inflate or deflate buffer (le32 each).
fn read_pfns(ctx: &QueueContext<'_>, chain: &DescChain) -> Result<Vec<u64>, Refusal> {
    Ok(read_entries(ctx, chain, 4, MAX_PFNS)?
        .chunks_exact(4)
        .map(|c| u64::from(u32::from_le_bytes([c[0], c[1], c[2], c[3]])))
        .collect())
}

/// Consecutive page numbers merged into `(first, count)` runs.
pub(super) fn pfn_runs(pfns: &[u64]) -> Vec<(u64, u64)> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for &p in pfns {
        match runs.last_mut() {
            Some((first, n)) if first.checked_add(*n) == Some(p) => *n += 1,
            _ => runs.push((p, 1)),
        }
    }
    runs
}

/// Parses a statistics buffer: packed `(le16 tag, le64 value)` entries.
fn parse_stats(ctx: &QueueContext<'_>, chain: &DescChain) -> Result<GuestMemoryStats, Refusal> {
    Ok(stats_from_bytes(&read_entries(
        ctx, chain, STAT_LEN, MAX_STATS,
    )?))
}

/// Statistics from packed entries; unknown tags are ignored (newer
/// drivers send more).
pub(super) fn stats_from_bytes(buf: &[u8]) -> GuestMemoryStats {
    let mut s = GuestMemoryStats::default();
    for e in buf.chunks_exact(STAT_LEN) {
        let tag = u16::from_le_bytes([e[0], e[1]]);
        let mut v = [0u8; 8];
        v.copy_from_slice(&e[2..]);
        // Tags 0..=11 of virtio 1.2, 5.5.6.3, in order.
        let fields = [
            &mut s.swap_in,
            &mut s.swap_out,
            &mut s.major_faults,
            &mut s.minor_faults,
            &mut s.free_memory,
            &mut s.total_memory,
            &mut s.available_memory,
            &mut s.disk_caches,
            &mut s.hugetlb_allocations,
            &mut s.hugetlb_failures,
            &mut s.oom_kills,
            &mut s.alloc_stalls,
        ];
        if let Some(field) = fields.into_iter().nth(usize::from(tag)) {
            *field = Some(u64::from_le_bytes(v));
        }
    }
    s
}

/// Whether `[addr, addr + len)` lies in guest memory (possibly across
/// regions), with no overflow.
pub(super) fn in_memory(mem: &GuestMemoryMmap, addr: u64, len: u64) -> bool {
    len > 0
        && addr.checked_add(len).is_some()
        && usize::try_from(len).is_ok_and(|l| mem.check_range(GuestAddress(addr), l))
}

/// Discards `[addr, addr + len)` of guest memory (checked with
/// [`in_memory`], page-aligned) region by region; returns how many
/// `madvise` calls failed.
fn discard(mem: &GuestMemoryMmap, addr: u64, len: u64) -> u64 {
    let (mut at, end) = (addr, addr + len);
    let mut failures = 0;
    while at < end {
        let Some(region) = mem.find_region(GuestAddress(at)) else {
            return failures + 1;
        };
        let offset = at - region.start_addr().raw_value();
        let n = (region.len() - offset).min(end - at);
        match region.get_host_address(MemoryRegionAddress(offset)) {
            Ok(host) => {
                // SAFETY: `host..host + n` lies inside one mapping of guest
                // RAM that `mem` keeps alive for the call; MADV_DONTNEED only
                // drops this process's private copies of pages the guest gave
                // up (every backend maps guest RAM MAP_PRIVATE), it cannot
                // unmap anything or reach a shared file's contents.
                let rc = unsafe { libc::madvise(host.cast(), n as usize, libc::MADV_DONTNEED) };
                if rc != 0 {
                    tracing::warn!(
                        "virtio-balloon: madvise at {at:#x}+{n:#x} failed: {}",
                        std::io::Error::last_os_error()
                    );
                    failures += 1;
                }
            }
            Err(_) => failures += 1,
        }
        at += n;
    }
    failures
}

impl VirtioDevice for BalloonDevice {
    fn device_type(&self) -> u32 {
        TYPE_BALLOON
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE; QUEUES]
    }

    fn avail_features(&self) -> u64 {
        VIRTIO_F_VERSION_1 | VIRTIO_F_RING_EVENT_IDX | F_STATS_VQ | F_DEFLATE_ON_OOM | F_REPORTING
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // struct virtio_balloon_config: num_pages, actual (le32 each);
        // free_page_hint_cmd_id and poison_val belong to features not
        // offered and read as 0.
        let mut config = [0u8; 16];
        config[..4].copy_from_slice(&self.target_pages.to_le_bytes());
        config[4..8].copy_from_slice(&self.actual_pages.to_le_bytes());
        crate::devices::virtio::read_config_bytes(&config, offset, data);
    }

    /// The driver writes `actual` (offset 4, le32, as a whole); everything
    /// else is the device's.
    fn write_config(&mut self, offset: u64, data: &[u8]) {
        if let (4, Ok(b)) = (offset, <[u8; 4]>::try_from(data)) {
            let pages = u32::from_le_bytes(b);
            // The guest cannot hold more than its memory.
            self.actual_pages = pages.min((self.mem_bytes / PAGE_SIZE) as u32);
        } else {
            crate::guest_warn!(
                offset,
                len = data.len(),
                "virtio-balloon: config write refused"
            );
        }
    }

    fn activate(&mut self, acked_features: u64) -> Result<(), VirtioError> {
        self.acked = acked_features;
        self.active = true;
        crate::devices::worker::kick_all(&self.queue_evts)
    }

    fn queue_notify(&mut self, index: usize, _ctx: &mut QueueContext<'_>) {
        crate::devices::worker::kick_queue(&self.queue_evts, index, "balloon");
    }

    fn reset(&mut self) {
        // The target stays: a driver that comes up again (a rebooted
        // guest) is asked for the same.
        self.acked = 0;
        self.active = false;
        self.actual_pages = 0;
        self.stats_head = None;
        self.stats_wanted = false;
    }
}

impl EpollDevice for BalloonDevice {
    const THREAD_NAME: &'static str = "balloon";
    const SECCOMP: crate::seccomp::ThreadKind = crate::seccomp::ThreadKind::Balloon;
    const TOKEN_WAKE: u64 = TOKEN_WAKE;

    fn epoll(&self) -> Arc<Epoll> {
        self.epoll.clone()
    }

    fn next_timeout_ms(&self) -> i32 {
        -1
    }

    fn handle_events(&mut self, events: &[EpollEvent], ctx: Option<&mut QueueContext<'_>>) {
        BalloonDevice::handle_events(self, events, ctx)
    }
}
