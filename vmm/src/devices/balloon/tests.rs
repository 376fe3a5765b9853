//! The balloon device against a fake guest driver on mock queues: page
//! lists and free page reports are discarded on the host (checked by what
//! the pages read back as, and by mincore), bad page numbers are refused
//! and counted, statistics are parsed and asked for again, and the state
//! survives a snapshot.

use std::io::Write;
use std::sync::{Arc, Mutex};

use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};
use vmm_sys_util::epoll::Epoll;
use vmm_sys_util::eventfd::EventFd;

use super::device::{in_memory, pfn_runs, stats_from_bytes};
use super::*;
use crate::devices::virtio::testutil::{activate, guest_mem, read32, write32, Driver};
use crate::devices::virtio::{
    MmioRestoreArgs, INT_CONFIG, VIRTIO_F_RING_EVENT_IDX, VIRTIO_F_VERSION_1,
};
use crate::devices::worker::poll_once;
use crate::snapshot::Persist;

const MEM: usize = 16 << 20;
const QSIZE: u16 = 32;
/// Queue rings at 0x1000 + i * 0x1000; buffers the driver hands over at
/// BUFS; the pages the balloon takes from DATA on.
const BUFS: u64 = 0x10_000;
const DATA: u64 = 0x100_000;
const ALL_FEATURES: u64 =
    VIRTIO_F_VERSION_1 | VIRTIO_F_RING_EVENT_IDX | F_STATS_VQ | F_DEFLATE_ON_OOM | F_REPORTING;

struct Rig<'a> {
    mem: &'a GuestMemoryMmap,
    t: Arc<Mutex<BalloonMmio>>,
    epoll: Arc<Epoll>,
    queues: Vec<Driver<'a>>,
    worker: Option<BalloonWorker>,
    next_buf: u64,
}

impl<'a> Rig<'a> {
    fn new(mem: &'a GuestMemoryMmap, features: u64) -> Self {
        let dev = BalloonDevice::new(mem.last_addr().0 + 1).unwrap();
        let t =
            BalloonMmio::new(dev, mem.clone(), EventFd::new(libc::EFD_NONBLOCK).unwrap()).unwrap();
        Self::on(mem, t, features, true)
    }

    /// A rig around transport `t`; `activate` drives the driver's setup.
    fn on(mem: &'a GuestMemoryMmap, t: BalloonMmio, features: u64, setup: bool) -> Self {
        let mut queues_used = 2;
        queues_used += usize::from(features & F_STATS_VQ != 0);
        queues_used += usize::from(features & F_REPORTING != 0);
        let queues: Vec<Driver<'a>> = (0..queues_used)
            .map(|i| Driver::new(mem, 0x1000 * (i as u64 + 1), QSIZE))
            .collect();
        let t = Arc::new(Mutex::new(t));
        if setup {
            let addrs: Vec<&dyn crate::devices::virtio::testutil::QueueAddrs> = queues
                .iter()
                .map(|q| q as &dyn crate::devices::virtio::testutil::QueueAddrs)
                .collect();
            activate(&mut *t.lock().unwrap(), features, &addrs, QSIZE);
        }
        let epoll = t.lock().unwrap().device().epoll_for_tests();
        Self {
            mem,
            t,
            epoll,
            queues,
            worker: None,
            next_buf: BUFS,
        }
    }

    fn start_worker(&mut self) {
        self.worker = Some(BalloonWorker::spawn(self.t.clone()).unwrap());
    }

    /// Places `bytes` in guest memory as one readable buffer; returns it.
    fn buffer(&mut self, bytes: &[u8]) -> (u64, u32, bool) {
        let addr = self.next_buf;
        self.mem.write_slice(bytes, GuestAddress(addr)).unwrap();
        self.next_buf += (bytes.len() as u64).next_multiple_of(64).max(64);
        (addr, bytes.len() as u32, false)
    }

    fn notify(&mut self, queue: usize) {
        write32(&mut *self.t.lock().unwrap(), 0x50, queue as u32);
    }

    /// Offers a chain on `queue`, notifies, and waits until it comes back.
    fn send(&mut self, queue: usize, bufs: &[(u64, u32, bool)]) {
        let head = self.queues[queue].push(bufs);
        self.notify(queue);
        let used = self.wait_used(queue);
        assert_eq!(used, vec![(head, 0)], "queue {queue}");
    }

    /// Runs the device (or lets its thread run) until `queue` has used
    /// entries.
    fn wait_used(&mut self, queue: usize) -> Vec<(u16, u32)> {
        for _ in 0..2000 {
            if self.worker.is_some() {
                std::thread::sleep(std::time::Duration::from_millis(1));
            } else {
                poll_once(&self.t, &self.epoll, Some(5)).unwrap();
            }
            let used = self.queues[queue].take_used();
            if !used.is_empty() {
                return used;
            }
        }
        panic!("queue {queue}: nothing came back");
    }

    fn pfns(&mut self, pfns: &[u32]) -> (u64, u32, bool) {
        let bytes: Vec<u8> = pfns.iter().flat_map(|p| p.to_le_bytes()).collect();
        self.buffer(&bytes)
    }

    fn counters(&self) -> torpor_vmm_api::control::BalloonCounters {
        self.t.lock().unwrap().device().counters()
    }

    fn status(&self) -> torpor_vmm_api::control::BalloonStatus {
        self.t.lock().unwrap().device_mut().status()
    }
}

impl BalloonDevice {
    fn epoll_for_tests(&self) -> Arc<Epoll> {
        crate::devices::worker::EpollDevice::epoll(self)
    }
}

fn fill(mem: &GuestMemoryMmap, addr: u64, len: usize, byte: u8) {
    mem.write_slice(&vec![byte; len], GuestAddress(addr))
        .unwrap();
}

fn page_bytes(mem: &GuestMemoryMmap, addr: u64) -> Vec<u8> {
    let mut b = vec![0u8; PAGE_SIZE as usize];
    mem.read_slice(&mut b, GuestAddress(addr)).unwrap();
    b
}

/// Whether the host page behind guest address `addr` is resident.
fn resident(mem: &GuestMemoryMmap, addr: u64) -> bool {
    let host = mem.get_host_address(GuestAddress(addr)).unwrap();
    let mut vec = [0u8; 1];
    // SAFETY: `host` is a page-aligned address inside guest RAM mapped by
    // `mem`; mincore writes one byte per page into `vec`.
    let rc = unsafe { libc::mincore(host.cast(), PAGE_SIZE as usize, vec.as_mut_ptr()) };
    assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
    vec[0] & 1 != 0
}

fn stat(tag: u16, val: u64) -> Vec<u8> {
    let mut e = tag.to_le_bytes().to_vec();
    e.extend(val.to_le_bytes());
    e
}

#[test]
fn inflating_discards_the_pages_and_deflating_counts_them() {
    let mem = guest_mem(MEM);
    let mut r = Rig::new(&mem, ALL_FEATURES);
    fill(&mem, DATA, 4 * PAGE_SIZE as usize, 0xab);
    assert!(resident(&mem, DATA));
    let first = (DATA / PAGE_SIZE) as u32;
    // Pages 0, 1 and 3 of the four; page 2 stays the guest's.
    let buf = r.pfns(&[first, first + 1, first + 3]);
    r.send(0, &[buf]);
    for (i, kept) in [(0, false), (1, false), (2, true), (3, false)] {
        let addr = DATA + i * PAGE_SIZE;
        assert_eq!(resident(&mem, addr), kept, "page {i}");
        let expect = if kept { 0xab } else { 0 };
        assert!(
            page_bytes(&mem, addr).iter().all(|b| *b == expect),
            "page {i}"
        );
    }
    assert_eq!(r.counters().inflated_pages, 3);

    let buf = r.pfns(&[first, first + 1]);
    r.send(1, &[buf]);
    let c = r.counters();
    assert_eq!((c.inflated_pages, c.deflated_pages), (3, 2));
    assert_eq!((c.refused_ranges, c.malformed_chains), (0, 0));
}

#[test]
fn page_numbers_outside_guest_memory_are_refused_and_counted() {
    let mem = guest_mem(MEM);
    let mut r = Rig::new(&mem, ALL_FEATURES);
    fill(&mem, DATA, PAGE_SIZE as usize, 0x5a);
    let last = (MEM as u64 / PAGE_SIZE) as u32;
    // Past the end, far past it, and one good page in between.
    let buf = r.pfns(&[last, u32::MAX, (DATA / PAGE_SIZE) as u32]);
    r.send(0, &[buf]);
    let c = r.counters();
    assert_eq!((c.refused_ranges, c.inflated_pages), (2, 1));
    assert!(page_bytes(&mem, DATA).iter().all(|b| *b == 0));

    // Malformed: a length that is not whole page numbers, a writable
    // buffer, a buffer outside guest memory.
    let (addr, _, _) = r.pfns(&[1, 2]);
    r.send(0, &[(addr, 7, false)]);
    r.send(0, &[(addr, 8, true)]);
    r.send(0, &[(MEM as u64 - 4, 8, false)]);
    assert_eq!(r.counters().malformed_chains, 3);
    assert_eq!(r.counters().inflated_pages, 1);
}

#[test]
fn reported_free_ranges_are_discarded() {
    let mem = guest_mem(MEM);
    let mut r = Rig::new(&mem, ALL_FEATURES);
    let range = 64 * PAGE_SIZE;
    fill(&mem, DATA, 2 * range as usize, 0xcd);
    // The reporting queue is queue 3 (after stats); ranges are writable
    // buffers over the free memory itself.
    r.send(3, &[(DATA, range as u32, true)]);
    assert!(!resident(&mem, DATA) && !resident(&mem, DATA + range - PAGE_SIZE));
    assert!(resident(&mem, DATA + range));
    assert!(page_bytes(&mem, DATA).iter().all(|b| *b == 0));
    assert!(page_bytes(&mem, DATA + range).iter().all(|b| *b == 0xcd));
    assert_eq!(r.counters().reported_bytes, range);

    // Out of range, unaligned, and readable reports are refused.
    r.send(3, &[(MEM as u64 - PAGE_SIZE, 2 * PAGE_SIZE as u32, true)]);
    r.send(3, &[(DATA + 1, PAGE_SIZE as u32, true)]);
    r.send(3, &[(DATA, PAGE_SIZE as u32, false)]);
    let c = r.counters();
    assert_eq!((c.refused_ranges, c.malformed_chains), (1, 2));
    assert_eq!(c.reported_bytes, range);
}

#[test]
fn without_stats_the_reporting_queue_is_queue_two() {
    let mem = guest_mem(MEM);
    let mut r = Rig::new(&mem, VIRTIO_F_VERSION_1 | F_REPORTING);
    fill(&mem, DATA, PAGE_SIZE as usize, 0x11);
    r.send(2, &[(DATA, PAGE_SIZE as u32, true)]);
    assert!(page_bytes(&mem, DATA).iter().all(|b| *b == 0));
    assert_eq!(r.counters().reported_bytes, PAGE_SIZE);
    assert!(r.status().free_page_reporting);
}

/// The file backend maps the memory file privately: a discarded page
/// reads back as the file's content, and the file is never written.
#[test]
fn on_a_private_file_mapping_discarded_pages_read_the_file_again() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mem");
    let mut f = std::fs::File::create(&path).unwrap();
    f.write_all(&vec![0x77; 8 * PAGE_SIZE as usize]).unwrap();
    drop(f);
    let file = std::fs::File::open(&path).unwrap();
    let mem = guest_mem(MEM);
    let host = mem.get_host_address(GuestAddress(DATA)).unwrap();
    crate::restore::map_fixed_private(host, 8 * PAGE_SIZE as usize, &file, 0, &path).unwrap();
    let mut r = Rig::new(&mem, ALL_FEATURES);
    fill(&mem, DATA, 8 * PAGE_SIZE as usize, 0x01);
    r.send(3, &[(DATA, 4 * PAGE_SIZE as u32, true)]);
    assert!(page_bytes(&mem, DATA).iter().all(|b| *b == 0x77));
    assert!(page_bytes(&mem, DATA + 4 * PAGE_SIZE)
        .iter()
        .all(|b| *b == 0x01));
    let on_disk = std::fs::read(&path).unwrap();
    assert!(on_disk.iter().all(|b| *b == 0x77), "the file is untouched");
}

#[test]
fn statistics_are_parsed_and_asked_for_again() {
    let mem = guest_mem(MEM);
    let mut r = Rig::new(&mem, ALL_FEATURES);
    assert_eq!(r.counters().stats_updates, 0);
    let mut stats = stat(4, 100 << 20);
    stats.extend(stat(5, 512 << 20));
    stats.extend(stat(6, 300 << 20));
    stats.extend(stat(99, 1)); // a tag from a newer driver
    let buf = r.buffer(&stats);
    let head = r.queues[2].push(&[buf]);
    r.notify(2);
    // The device keeps the buffer until it wants fresh statistics.
    for _ in 0..5 {
        poll_once(&r.t, &r.epoll, Some(5)).unwrap();
    }
    assert!(r.queues[2].take_used().is_empty());
    let s = r.status();
    let g = s.guest.unwrap();
    assert_eq!(g.free_memory, Some(100 << 20));
    assert_eq!(g.total_memory, Some(512 << 20));
    assert_eq!(g.available_memory, Some(300 << 20));
    assert_eq!(g.swap_in, None);
    assert!(s.stats_age_ms.is_some());
    // `status` asked for fresh ones: the buffer comes back.
    assert_eq!(r.wait_used(2), vec![(head, 0)]);
    assert_eq!(r.counters().stats_updates, 1);

    // Malformed statistics (not whole entries) are counted.
    let (addr, _, _) = r.buffer(&stats);
    r.queues[2].push(&[(addr, 15, false)]);
    r.notify(2);
    for _ in 0..3 {
        poll_once(&r.t, &r.epoll, Some(5)).unwrap();
    }
    assert_eq!(r.counters().malformed_chains, 1);
}

#[test]
fn stats_entries_parse_and_runs_merge() {
    let mut b = stat(0, 1);
    b.extend(stat(11, 7));
    b.extend([0u8; 3]); // a partial entry is ignored
    let s = stats_from_bytes(&b);
    assert_eq!(
        (s.swap_in, s.alloc_stalls, s.oom_kills),
        (Some(1), Some(7), None)
    );
    assert_eq!(pfn_runs(&[5, 6, 7, 9, 10, 3]), vec![(5, 3), (9, 2), (3, 1)]);
    assert_eq!(pfn_runs(&[u64::MAX, 0]), vec![(u64::MAX, 1), (0, 1)]);
    let mem = guest_mem(MEM);
    assert!(in_memory(&mem, 0, MEM as u64));
    assert!(!in_memory(&mem, 0, MEM as u64 + 1));
    assert!(!in_memory(&mem, u64::MAX - 10, 20));
    assert!(!in_memory(&mem, 0, 0));
}

#[test]
fn the_target_is_config_space_and_actual_is_the_drivers() {
    let mem = guest_mem(MEM);
    let r = Rig::new(&mem, ALL_FEATURES);
    let mut t = r.t.lock().unwrap();
    t.device_mut().set_target_mib(4).unwrap();
    assert!(
        t.device_mut().set_target_mib(17).is_err(),
        "more than guest memory"
    );
    assert_eq!(read32(&mut *t, 0x100), 4 * PAGES_PER_MIB as u32);
    write32(&mut *t, 0x104, 512);
    assert_eq!(read32(&mut *t, 0x104), 512);
    // The driver cannot write the target, nor claim more than memory.
    write32(&mut *t, 0x100, 1);
    assert_eq!(read32(&mut *t, 0x100), 4 * PAGES_PER_MIB as u32);
    write32(&mut *t, 0x104, u32::MAX);
    assert_eq!(read32(&mut *t, 0x104), (MEM as u64 / PAGE_SIZE) as u32);
    drop(t);
    let s = r.status();
    assert_eq!((s.target_mib, s.actual_mib, s.active), (4, 16, true));
}

#[test]
fn set_target_raises_a_config_interrupt() {
    let mem = guest_mem(MEM);
    let r = Rig::new(&mem, ALL_FEATURES);
    let mut t = r.t.lock().unwrap();
    let gen = read32(&mut *t, 0xfc);
    set_target(&mut t, 8).unwrap();
    assert_ne!(read32(&mut *t, 0xfc), gen, "config generation moved");
    assert_ne!(t.interrupt().status() & INT_CONFIG, 0);
}

#[test]
fn snapshot_and_restore_keep_the_state_and_the_held_stats_buffer() {
    let mem = guest_mem(MEM);
    let mut r = Rig::new(&mem, ALL_FEATURES);
    let buf = r.pfns(&[(DATA / PAGE_SIZE) as u32]);
    r.send(0, &[buf]);
    let stats = stat(4, 42);
    let buf = r.buffer(&stats);
    let head = r.queues[2].push(&[buf]);
    r.notify(2);
    for _ in 0..3 {
        poll_once(&r.t, &r.epoll, Some(5)).unwrap();
    }
    {
        let mut t = r.t.lock().unwrap();
        set_target(&mut t, 2).unwrap();
        write32(&mut *t, 0x104, 2 * PAGES_PER_MIB as u32);
    }
    let state = r.t.lock().unwrap().save();
    let json = serde_json::to_string(&state).unwrap();
    let state: crate::devices::virtio::VirtioMmioState<BalloonState> =
        serde_json::from_str(&json).unwrap();
    assert_eq!(state.device.stats_head, Some(head));

    // The clone: same memory content, a new transport from the state.
    let mem2 = guest_mem(MEM);
    let q2 = r.queues[2].resume_on(&mem2);
    crate::devices::virtio::testutil::copy_mem(&mem, &mem2);
    let t2 = BalloonMmio::restore(
        MmioRestoreArgs {
            mem: mem2.clone(),
            irq: EventFd::new(libc::EFD_NONBLOCK).unwrap(),
            device: BalloonRestoreArgs,
        },
        &state,
    )
    .unwrap();
    let mut r2 = Rig::on(&mem2, t2, ALL_FEATURES, false);
    r2.queues[2] = q2;
    let s = r2.status();
    assert_eq!((s.target_mib, s.actual_mib, s.active), (2, 2, true));
    assert_eq!(s.counters.inflated_pages, 1);
    // The restored device still holds the guest's stats buffer and gives
    // it back when it wants fresh statistics (status asked).
    assert_eq!(r2.wait_used(2), vec![(head, 0)]);
}

/// The worker thread does the device's work under its own seccomp filter
/// (madvise included).
#[test]
fn the_worker_thread_runs_under_its_seccomp_filter() {
    if !crate::seccomp::tests::confined_child() {
        crate::seccomp::tests::run_in_confined_child(
            "devices::balloon::tests::the_worker_thread_runs_under_its_seccomp_filter",
        );
        return;
    }
    let mem = guest_mem(MEM);
    let mut r = Rig::new(&mem, ALL_FEATURES);
    r.start_worker();
    fill(&mem, DATA, 8 * PAGE_SIZE as usize, 0x3c);
    let first = (DATA / PAGE_SIZE) as u32;
    let buf = r.pfns(&[first, first + 1, u32::MAX]);
    r.send(0, &[buf]);
    r.send(3, &[(DATA + 4 * PAGE_SIZE, 4 * PAGE_SIZE as u32, true)]);
    let buf = r.pfns(&[first]);
    r.send(1, &[buf]);
    let stats = stat(5, 1 << 30);
    let buf = r.buffer(&stats);
    let head = r.queues[2].push(&[buf]);
    r.notify(2);
    let mut tries = 0;
    while r.counters().stats_updates == 0 {
        tries += 1;
        assert!(tries < 2000, "stats never arrived");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_eq!(r.status().guest.unwrap().total_memory, Some(1 << 30));
    assert_eq!(r.wait_used(2), vec![(head, 0)]);
    let c = r.counters();
    assert_eq!(
        (c.inflated_pages, c.deflated_pages, c.refused_ranges),
        (2, 1, 1)
    );
    assert_eq!(c.reported_bytes, 4 * PAGE_SIZE);
    assert!(page_bytes(&mem, DATA).iter().all(|b| *b == 0));
    assert!(page_bytes(&mem, DATA + 2 * PAGE_SIZE)
        .iter()
        .all(|b| *b == 0x3c));
    assert!(page_bytes(&mem, DATA + 4 * PAGE_SIZE)
        .iter()
        .all(|b| *b == 0));
    use crate::devices::Pausable;
    let w = r.worker.take().unwrap();
    w.pause().unwrap();
    w.stop();
}

/// A range may span two regions (discarded in both); one that runs into a
/// hole between regions is refused.
#[test]
fn reports_across_regions_are_split_and_holes_refused() {
    let half = MEM as u64 / 2;
    let mem = GuestMemoryMmap::from_ranges(&[
        (GuestAddress(0), half as usize),
        (GuestAddress(half), half as usize),
        (GuestAddress(2 * half + 0x10_0000), half as usize),
    ])
    .unwrap();
    let mut r = Rig::new(&mem, ALL_FEATURES);
    let at = half - 2 * PAGE_SIZE;
    fill(&mem, at, 4 * PAGE_SIZE as usize, 0x42);
    r.send(3, &[(at, 4 * PAGE_SIZE as u32, true)]);
    for i in 0..4 {
        assert!(page_bytes(&mem, at + i * PAGE_SIZE).iter().all(|b| *b == 0));
    }
    assert_eq!(r.counters().reported_bytes, 4 * PAGE_SIZE);
    // Into the hole after the second region.
    r.send(3, &[(2 * half - PAGE_SIZE, 2 * PAGE_SIZE as u32, true)]);
    assert_eq!(r.counters().refused_ranges, 1);
    assert_eq!(r.counters().reported_bytes, 4 * PAGE_SIZE);
}
