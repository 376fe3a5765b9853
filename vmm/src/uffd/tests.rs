//! Page server tests: real userfaultfds over anonymous memory and memfd
//! mappings, touched from other threads. No KVM needed.

use std::fs::{File, OpenOptions};
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::server::test_hooks;
use super::*;
use crate::snapshot::PageRuns;

const PS: usize = PAGE_SIZE;
/// Pages in the test memory files (8 MiB).
const PAGES: u64 = 2048;
/// Longest any single step may take before the test calls it a hang.
const TIMEOUT: Duration = Duration::from_secs(20);

/// The word every 8 bytes of page `page` of layer `layer` hold (0 = base).
fn tag(layer: u64, page: u64) -> u64 {
    0xA000_0000_0000_0000 | (layer << 40) | page
}

fn page_bytes(word: u64) -> Vec<u8> {
    word.to_ne_bytes().repeat(PS / 8)
}

/// A file in the temp dir, removed on drop.
struct TempFile {
    path: PathBuf,
    file: File,
}

impl TempFile {
    fn new(tag: &str, len: u64) -> TempFile {
        Self::new_in(std::env::temp_dir(), tag, len)
    }

    fn new_in(dir: PathBuf, tag: &str, len: u64) -> TempFile {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!("torpor-uffd-{tag}-{}-{n}", std::process::id()));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        file.set_len(len).unwrap();
        TempFile { path, file }
    }

    fn handle(&self) -> File {
        self.file.try_clone().unwrap()
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn write_page(file: &File, page: u64, word: u64) {
    file.write_all_at(&page_bytes(word), page * PS as u64)
        .unwrap();
}

/// A memfd of `PAGES` pages, sealed against writes and size changes once
/// `init` has filled it.
fn memfd(init: impl FnOnce(&File)) -> File {
    let name = c"torpor-uffd-test";
    // SAFETY: `name` is NUL-terminated; memfd_create takes no other pointer.
    let fd =
        unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: the descriptor was just created and nothing else owns it.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(PAGES * PS as u64).unwrap();
    init(&file);
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE;
    // SAFETY: F_ADD_SEALS takes an integer argument on a descriptor we own.
    let ret = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) };
    assert_eq!(ret, 0, "seal: {}", std::io::Error::last_os_error());
    file
}

fn allocated_blocks(file: &File) -> u64 {
    use std::os::unix::fs::MetadataExt;
    file.metadata().unwrap().blocks()
}

/// A host mapping, unmapped on drop (leaked if the test is failing, since a
/// thread may still be blocked in a fault on it).
struct Mapping {
    addr: usize,
    len: usize,
}

impl Mapping {
    fn anonymous(len: usize) -> Mapping {
        Self::map(
            len,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    }

    fn private_file(file: &File, len: usize, first_page: u64) -> Mapping {
        Self::map(
            len,
            libc::MAP_PRIVATE,
            file.as_raw_fd(),
            first_page * PS as u64,
        )
    }

    /// Read-only: the test template is sealed against writes.
    fn shared_file_read_only(file: &File, len: usize) -> Mapping {
        Self::map_prot(len, libc::PROT_READ, libc::MAP_SHARED, file.as_raw_fd(), 0)
    }

    fn map(len: usize, flags: i32, fd: i32, offset: u64) -> Mapping {
        Self::map_prot(len, libc::PROT_READ | libc::PROT_WRITE, flags, fd, offset)
    }

    fn map_prot(len: usize, prot: i32, flags: i32, fd: i32, offset: u64) -> Mapping {
        // SAFETY: a fresh mapping chosen by the kernel; it overlaps nothing.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                flags,
                fd,
                offset as libc::off_t,
            )
        };
        assert_ne!(
            p,
            libc::MAP_FAILED,
            "mmap: {}",
            std::io::Error::last_os_error()
        );
        Mapping {
            addr: p as usize,
            len,
        }
    }

    fn region(&self, first_page: u64) -> Region {
        Region {
            host_addr: self.addr,
            len: self.len,
            first_page,
        }
    }

    /// Which of the mapping's pages are resident (mincore).
    fn resident(&self) -> Vec<bool> {
        let mut v = vec![0u8; self.len / PS];
        // SAFETY: the range is our live mapping and `v` has one byte per page.
        let ret =
            unsafe { libc::mincore(self.addr as *mut libc::c_void, self.len, v.as_mut_ptr()) };
        assert_eq!(ret, 0);
        v.into_iter().map(|b| b & 1 != 0).collect()
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if std::thread::panicking() {
            return;
        }
        // SAFETY: the mapping is ours and no thread uses it any more.
        unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len) };
    }
}

/// Runs `f` on another thread; fails the test if it takes longer than
/// TIMEOUT (a fault nobody answers).
fn in_thread<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(TIMEOUT)
        .expect("the touching thread did not finish: a fault was not answered")
}

/// The value of a page whose words are all equal, or None.
fn read_page(addr: usize) -> Option<u64> {
    // SAFETY: the callers pass pages of mappings that outlive the reading
    // thread (Mapping leaks on failure); reads may fault into the server.
    let words: Vec<u64> = (0..PS / 8)
        .map(|i| unsafe { std::ptr::read_volatile((addr + i * 8) as *const u64) })
        .collect();
    words.iter().all(|&w| w == words[0]).then_some(words[0])
}

/// Reads `pages` (memory-file indexes) of a mapping of `first_page..` from
/// another thread.
fn read_pages(m: &Mapping, first_page: u64, pages: &[u64]) -> Vec<Option<u64>> {
    let (addr, pages) = (m.addr, pages.to_vec());
    in_thread(move || {
        pages
            .iter()
            .map(|&p| read_page(addr + (p - first_page) as usize * PS))
            .collect()
    })
}

fn write_word(addr: usize, value: u64) {
    // SAFETY: as in read_page.
    unsafe { std::ptr::write_volatile(addr as *mut u64, value) };
}

/// Starts a server whose failures land in the returned channel.
fn start(
    regions: Vec<Region>,
    layers: Layers,
    opts: ServerOptions,
) -> (PageServer, mpsc::Receiver<String>) {
    let (tx, rx) = mpsc::channel();
    let on_failure: FailureHandler = Box::new(move |m| {
        let _ = tx.send(m);
    });
    // SAFETY: every test region is a fresh mapping that outlives the server
    // (declared before it, so dropped after it) and holds nothing else.
    let server = unsafe { PageServer::start(regions, layers, opts, on_failure) }.unwrap();
    (server, rx)
}

fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(t0.elapsed() < TIMEOUT, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The stats once `settled` holds (or after a timeout, for the assertion
/// that follows to report): install counters are bumped just after the ioctl
/// that already woke the touching thread, so they may lag it briefly.
fn stats_when(server: &PageServer, settled: impl Fn(&Stats) -> bool) -> Stats {
    let t0 = Instant::now();
    loop {
        let s = server.stats();
        if settled(&s) || t0.elapsed() > Duration::from_secs(2) {
            return s;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn installed(s: &Stats) -> u64 {
    s.copies + s.zero_pages + s.continues
}

fn missing(prefetch: Vec<u64>, record_for: Option<Duration>) -> ServerOptions {
    ServerOptions {
        mode: Mode::Missing,
        prefetch,
        record_for,
    }
}

/// The standard test layers:
/// - base: data at pages 0, 1, 2, 3, 10, 100, 1500; page 5 written with
///   zeros (a zero page that is not a hole); every other page a hole;
/// - diff 0: pages 2, 3, 50, 51 (data) and 10 (zeros over base data);
/// - diff 1: pages 3 and 51.
struct Fixture {
    base: TempFile,
    diff0: TempFile,
    diff1: TempFile,
}

impl Fixture {
    fn new() -> Fixture {
        let base = TempFile::new("base", PAGES * PS as u64);
        for p in [0, 1, 2, 3, 10, 100, 1500] {
            write_page(&base.file, p, tag(0, p));
        }
        write_page(&base.file, 5, 0);
        let diff0 = TempFile::new("diff0", PAGES * PS as u64);
        for p in [2, 3, 50, 51] {
            write_page(&diff0.file, p, tag(1, p));
        }
        write_page(&diff0.file, 10, 0);
        let diff1 = TempFile::new("diff1", PAGES * PS as u64);
        for p in [3, 51] {
            write_page(&diff1.file, p, tag(2, p));
        }
        Fixture { base, diff0, diff1 }
    }

    fn layers(&self) -> Layers {
        Layers::new(
            self.base.handle(),
            vec![
                (
                    self.diff0.handle(),
                    PageRuns::from_sorted_pages([2, 3, 10, 50, 51]),
                ),
                (self.diff1.handle(), PageRuns::from_sorted_pages([3, 51])),
            ],
        )
    }

    /// What each page must read as.
    fn expected(page: u64) -> u64 {
        match page {
            0 | 1 | 100 | 1500 => tag(0, page),
            2 | 50 => tag(1, page),
            3 | 51 => tag(2, page),
            _ => 0,
        }
    }
}

/// Pages of the fixture worth reading: every kind of source.
const PROBE_PAGES: [u64; 12] = [0, 1, 2, 3, 5, 7, 10, 50, 51, 100, 1500, 2047];

#[test]
fn newest_diff_wins() {
    let null = || File::open("/dev/null").unwrap();
    let layers = Layers::new(
        null(),
        vec![
            (null(), PageRuns::from_sorted_pages(1..=5)),
            (null(), PageRuns::from_sorted_pages([3, 4])),
            (null(), PageRuns::from_sorted_pages([4, 9])),
        ],
    );
    assert_eq!(layers.diff_count(), 3);
    let got: Vec<Source> = (0..11).map(|p| layers.source(p)).collect();
    use Source::*;
    assert_eq!(
        got,
        vec![
            Base,
            Diff(0),
            Diff(0),
            Diff(1),
            Diff(2),
            Diff(0),
            Base,
            Base,
            Base,
            Diff(2),
            Base
        ]
    );
}

#[test]
fn missing_mode_serves_each_page_from_its_layer() {
    let fx = Fixture::new();
    let mem = Mapping::anonymous(PAGES as usize * PS);
    let (server, failures) = start(vec![mem.region(0)], fx.layers(), missing(vec![], None));

    let got = read_pages(&mem, 0, &PROBE_PAGES);
    for (&p, v) in PROBE_PAGES.iter().zip(&got) {
        assert_eq!(*v, Some(Fixture::expected(p)), "page {p}");
    }
    let s = stats_when(&server, |s| installed(s) == 12);
    assert_eq!(s.faults, PROBE_PAGES.len() as u64);
    assert_eq!(s.copies, 8, "{s:?}"); // 0 1 2 3 50 51 100 1500
    assert_eq!(s.zero_pages, 4, "{s:?}"); // 5 (zero data) 7 (hole) 10 (zero diff) 2047
    assert_eq!((s.continues, s.prefetched, s.failures), (0, 0, 0));
    assert!(s.prefetch_done);
    // Touching again costs nothing.
    read_pages(&mem, 0, &PROBE_PAGES);
    assert_eq!(server.stats().faults, PROBE_PAGES.len() as u64);
    assert!(failures.try_recv().is_err());
}

#[test]
fn write_faults_install_the_page_then_the_write() {
    let fx = Fixture::new();
    let mem = Mapping::anonymous(PAGES as usize * PS);
    let (server, _failures) = start(vec![mem.region(0)], fx.layers(), missing(vec![], None));
    let addr = mem.addr;
    let (data, hole) = in_thread(move || {
        write_word(addr, 7); // page 0: base data
        write_word(addr + 7 * PS + 8, 9); // page 7: hole
                                          // SAFETY: as in read_page.
        let read = |a: usize| unsafe { std::ptr::read_volatile(a as *const u64) };
        (
            [read(addr), read(addr + 8), read(addr + PS - 8)],
            [
                read(addr + 7 * PS),
                read(addr + 7 * PS + 8),
                read(addr + 8 * PS - 8),
            ],
        )
    });
    assert_eq!(data, [7, tag(0, 0), tag(0, 0)]);
    assert_eq!(hole, [0, 9, 0]);
    let s = stats_when(&server, |s| installed(s) == 2);
    assert_eq!((s.faults, s.copies, s.zero_pages), (2, 1, 1), "{s:?}");
}

#[test]
fn regions_map_their_own_page_ranges() {
    let fx = Fixture::new();
    let low = Mapping::anonymous(64 * PS); // pages 0..64
    let high = Mapping::anonymous((PAGES as usize - 1000) * PS); // pages 1000..2048
    let (server, _failures) = start(
        vec![high.region(1000), low.region(0)],
        fx.layers(),
        missing(vec![], None),
    );
    assert_eq!(
        read_pages(&low, 0, &[0, 3, 51]),
        vec![Some(tag(0, 0)), Some(tag(2, 3)), Some(tag(2, 51))]
    );
    assert_eq!(
        read_pages(&high, 1000, &[1000, 1500, 2047]),
        vec![Some(0), Some(tag(0, 1500)), Some(0)]
    );
    assert_eq!(server.stats().faults, 6);
}

#[test]
fn prefetched_pages_need_no_fault() {
    let fx = Fixture::new();
    let mem = Mapping::anonymous(PAGES as usize * PS);
    // 99999 is outside guest memory (a stale list): skipped.
    let prefetch = vec![0, 1, 2, 3, 50, 51, 7, 10, 99_999, 100];
    let (server, _failures) = start(vec![mem.region(0)], fx.layers(), missing(prefetch, None));
    wait_until("the prefetch", || server.stats().prefetch_done);
    let s = server.stats();
    assert_eq!((s.prefetched, s.faults), (9, 0), "{s:?}");
    assert_eq!((s.copies, s.zero_pages), (7, 2), "{s:?}");
    let resident = mem.resident();
    for p in [0, 1, 2, 3, 50, 51, 7, 10, 100] {
        assert!(resident[p], "page {p} should be resident after prefetch");
    }
    assert!(!resident[1500] && !resident[4]);

    let pages = [0, 1, 2, 3, 50, 51, 7, 10, 100];
    let got = read_pages(&mem, 0, &pages);
    for (&p, v) in pages.iter().zip(&got) {
        assert_eq!(*v, Some(Fixture::expected(p)), "page {p}");
    }
    assert_eq!(server.stats().faults, 0, "prefetched pages faulted");
    assert_eq!(read_pages(&mem, 0, &[1500]), vec![Some(tag(0, 1500))]);
    assert_eq!(server.stats().faults, 1);
}

#[test]
fn prefetch_and_faults_interleave() {
    // Every page prefetched in ascending order while another thread reads
    // them in descending order: each page is installed exactly once, by
    // whichever gets there first, and every read is right.
    let fx = Fixture::new();
    let mem = Mapping::anonymous(PAGES as usize * PS);
    let (server, failures) = start(
        vec![mem.region(0)],
        fx.layers(),
        missing((0..PAGES).collect(), None),
    );
    let pages: Vec<u64> = (0..PAGES).rev().collect();
    let got = read_pages(&mem, 0, &pages);
    for (&p, v) in pages.iter().zip(&got) {
        assert_eq!(*v, Some(Fixture::expected(p)), "page {p}");
    }
    wait_until("the prefetch", || server.stats().prefetch_done);
    let s = stats_when(&server, |s| installed(s) == PAGES);
    assert_eq!(s.copies + s.zero_pages, PAGES, "{s:?}");
    assert_eq!(s.copies, 8, "{s:?}");
    assert!(
        s.prefetched <= PAGES && s.prefetched + s.faults >= PAGES,
        "{s:?}"
    );
    assert!(failures.try_recv().is_err());
}

#[test]
fn working_set_is_the_pages_touched_in_the_window() {
    let fx = Fixture::new();
    let mem = Mapping::anonymous(PAGES as usize * PS);
    let (server, _f) = start(
        vec![mem.region(0)],
        fx.layers(),
        missing(vec![], Some(Duration::from_secs(60))),
    );
    read_pages(&mem, 0, &[9, 3, 7, 3, 1000, 0]);
    assert_eq!(server.working_set(), vec![0, 3, 7, 9, 1000]);
    drop(server);

    let mem = Mapping::anonymous(PAGES as usize * PS);
    let (server, _f) = start(
        vec![mem.region(0)],
        fx.layers(),
        missing(vec![], Some(Duration::from_millis(200))),
    );
    read_pages(&mem, 0, &[5, 1]);
    std::thread::sleep(Duration::from_millis(400));
    read_pages(&mem, 0, &[2]);
    assert_eq!(server.working_set(), vec![1, 5]);
    assert_eq!(server.stats().faults, 3);
}

#[test]
fn no_recording_without_a_window() {
    let fx = Fixture::new();
    let mem = Mapping::anonymous(PAGES as usize * PS);
    let (server, _f) = start(vec![mem.region(0)], fx.layers(), missing(vec![], None));
    read_pages(&mem, 0, &[1, 2]);
    assert!(server.working_set().is_empty());
}

#[test]
fn truncated_base_fails_loudly_and_stops_answering() {
    let fx = Fixture::new();
    let mem = Mapping::anonymous(PAGES as usize * PS);
    let (server, failures) = start(vec![mem.region(0)], fx.layers(), missing(vec![], None));
    assert_eq!(read_pages(&mem, 0, &[0]), vec![Some(tag(0, 0))]);

    fx.base.file.set_len(1 << 20).unwrap(); // pages 256.. are gone
    let addr = mem.addr;
    let (tx, touched) = mpsc::channel();
    let tx2 = tx.clone();
    std::thread::spawn(move || {
        let _ = tx.send(("page 1024", read_page(addr + 1024 * PS)));
    });
    let message = failures
        .recv_timeout(TIMEOUT)
        .expect("on_failure was not called");
    assert!(message.contains("page 1024"), "{message}");
    assert!(
        message.contains(&fx.base.path.display().to_string()),
        "{message}"
    );
    assert!(message.contains("short read"), "{message}");
    assert_eq!(server.stats().failures, 1);

    // The server answers nothing more, not even a page that is still fine.
    std::thread::spawn(move || {
        let _ = tx2.send(("page 1", read_page(addr + PS)));
    });
    assert!(touched.recv_timeout(Duration::from_millis(300)).is_err());

    // Dropping the server closes the userfaultfd: the blocked threads wake
    // and the kernel resolves their faults as plain anonymous memory.
    let t0 = Instant::now();
    drop(server);
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "drop took {:?}",
        t0.elapsed()
    );
    let mut woken: Vec<_> = (0..2)
        .map(|_| touched.recv_timeout(TIMEOUT).unwrap())
        .collect();
    woken.sort();
    assert_eq!(woken, vec![("page 1", Some(0)), ("page 1024", Some(0))]);
    assert!(failures.try_recv().is_err(), "on_failure called twice");
}

#[test]
fn panics_and_errors_reach_on_failure_once() {
    let (tx, rx) = mpsc::channel();
    let handler = |tx: mpsc::Sender<String>| -> FailureHandler {
        Box::new(move |m| {
            let _ = tx.send(m);
        })
    };
    assert_eq!(
        test_hooks::supervised(|| panic!("boom at page 42"), handler(tx.clone())),
        (true, 1)
    );
    let m = rx.try_recv().unwrap();
    assert!(
        m.contains("panicked") && m.contains("boom at page 42"),
        "{m}"
    );

    assert_eq!(
        test_hooks::supervised(|| Err("short read of page 7".into()), handler(tx.clone())),
        (true, 1)
    );
    assert_eq!(rx.try_recv().unwrap(), "short read of page 7");

    assert_eq!(test_hooks::supervised(|| Ok(()), handler(tx)), (false, 0));
    assert!(rx.try_recv().is_err());

    // A panicking failure handler is contained too.
    let (failed, _) = test_hooks::supervised(|| Err("x".into()), Box::new(|_| panic!("handler")));
    assert!(failed);
}

#[test]
fn kernel_mode_faults_are_served() {
    // KVM reaches guest memory through get_user_pages and devices through
    // system calls: both fault in kernel mode.
    let fx = Fixture::new();
    let mem = Mapping::anonymous(PAGES as usize * PS);
    let (server, _f) = start(vec![mem.region(0)], fx.layers(), missing(vec![], None));
    let addr = mem.addr;
    let (gup, syscall) = in_thread(move || {
        // process_vm_readv on ourselves: a remote get_user_pages, like KVM's.
        let mut out = [0u64; 1];
        let local = libc::iovec {
            iov_base: out.as_mut_ptr() as *mut libc::c_void,
            iov_len: 8,
        };
        let remote = libc::iovec {
            iov_base: (addr + 3 * PS) as *mut libc::c_void,
            iov_len: 8,
        };
        // SAFETY: both iovecs describe 8 valid bytes; `out` outlives the call.
        let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
        assert_eq!(
            n,
            8,
            "process_vm_readv: {}",
            std::io::Error::last_os_error()
        );

        // write(2) from guest memory: copy_from_user.
        let mut fds = [0; 2];
        // SAFETY: `fds` has room for the two descriptors.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: the source is 8 bytes of our mapping; fds[1] is the pipe.
        let w = unsafe { libc::write(fds[1], (addr + 50 * PS) as *const libc::c_void, 8) };
        assert_eq!(w, 8);
        let mut back = [0u64; 1];
        // SAFETY: `back` has room for the 8 bytes read.
        unsafe { libc::read(fds[0], back.as_mut_ptr() as *mut libc::c_void, 8) };
        for fd in fds {
            // SAFETY: closing a pipe descriptor we created and use no more.
            unsafe { libc::close(fd) };
        }
        (out[0], back[0])
    });
    assert_eq!((gup, syscall), (tag(2, 3), tag(1, 50)));
    assert_eq!(server.stats().faults, 2);
}

#[test]
fn start_rejects_bad_input() {
    let fx = Fixture::new();
    let mem = Mapping::anonymous(PAGES as usize * PS);
    let try_start = |regions: Vec<Region>, layers: Layers, mode: Mode| {
        let opts = ServerOptions {
            mode,
            ..Default::default()
        };
        // SAFETY: the regions are `mem` (fresh, held for the whole test) or
        // invalid ones that start rejects before registering anything.
        unsafe { PageServer::start(regions, layers, opts, Box::new(|_| {})) }.unwrap_err()
    };
    let e = try_start(vec![], fx.layers(), Mode::Missing);
    assert!(matches!(e, UffdError::NoRegions), "{e}");
    let mut r = mem.region(0);
    r.host_addr += 8;
    let e = try_start(vec![r], fx.layers(), Mode::Missing);
    assert!(matches!(e, UffdError::InvalidRegion { .. }), "{e}");
    let e = try_start(
        vec![
            mem.region(0),
            Region {
                len: PS,
                ..mem.region(0)
            },
        ],
        fx.layers(),
        Mode::Missing,
    );
    assert!(matches!(e, UffdError::OverlappingRegions { .. }), "{e}");
    // The region reaches page 2048 + 10: past the end of the base.
    let e = try_start(vec![mem.region(10)], fx.layers(), Mode::Missing);
    assert!(
        matches!(e, UffdError::BaseTooShort { end_page: 2058, .. }),
        "{e}"
    );
    assert!(
        e.to_string().contains(&fx.base.path.display().to_string()),
        "{e}"
    );
    // A diff that claims a page beyond its file.
    let short = TempFile::new("short", 16 * PS as u64);
    let layers = Layers::new(
        fx.base.handle(),
        vec![(short.handle(), PageRuns::from_sorted_pages([100]))],
    );
    let e = try_start(vec![mem.region(0)], layers, Mode::Missing);
    assert!(
        matches!(
            e,
            UffdError::DiffTooShort {
                index: 0,
                end_page: 101,
                ..
            }
        ),
        "{e}"
    );
    // Minor mode: a base that is not on shmem.
    let e = try_start(vec![mem.region(0)], fx.layers(), Mode::Minor);
    assert!(matches!(e, UffdError::BaseNotShmem { .. }), "{e}");
}

#[test]
fn start_checks_what_each_region_maps() {
    let fx = Fixture::new();
    let shm = memfd(|_| {});
    let try_start = |region: Region, base: &File, mode: Mode| {
        let opts = ServerOptions {
            mode,
            ..Default::default()
        };
        let layers = Layers::new(base.try_clone().unwrap(), vec![]);
        // SAFETY: every region is a fresh test mapping held for the whole
        // test; start rejects each before registering it.
        let e =
            unsafe { PageServer::start(vec![region], layers, opts, Box::new(|_| {})) }.unwrap_err();
        assert!(matches!(e, UffdError::WrongMapping { .. }), "{e}");
        e.to_string()
    };
    let len = PAGES as usize * PS;

    // Minor mode needs the base file, privately, at the right offset.
    let anon = Mapping::anonymous(len);
    let e = try_start(anon.region(0), &shm, Mode::Minor);
    assert!(e.contains("does not map the base memory file"), "{e}");
    let other = memfd(|_| {});
    let wrong_file = Mapping::private_file(&other, len, 0);
    let e = try_start(wrong_file.region(0), &shm, Mode::Minor);
    assert!(e.contains("does not map the base memory file"), "{e}");
    let shifted = Mapping::private_file(&shm, len - PS, 0);
    let e = try_start(shifted.region(1), &shm, Mode::Minor);
    assert!(
        e.contains("maps offset 0x0 of the base file, expected 0x1000"),
        "{e}"
    );
    let shared = Mapping::shared_file_read_only(&shm, len);
    let e = try_start(shared.region(0), &shm, Mode::Minor);
    assert!(e.contains("MAP_PRIVATE"), "{e}");

    // Missing mode needs private anonymous memory, all of it mapped.
    let e = try_start(
        Mapping::private_file(&shm, len, 0).region(0),
        &fx.base.file,
        Mode::Missing,
    );
    assert!(e.contains("maps a file"), "{e}");
    let holed = Mapping::anonymous(4 * PS);
    // SAFETY: unmapping the last page of our own fresh mapping.
    unsafe { libc::munmap((holed.addr + 3 * PS) as *mut libc::c_void, PS) };
    let e = try_start(holed.region(0), &fx.base.file, Mode::Missing);
    assert!(
        e.contains(&format!("nothing is mapped at {:#x}", holed.addr + 3 * PS)),
        "{e}"
    );
}

#[test]
fn drop_stops_the_server_and_unregisters() {
    let fx = Fixture::new();
    let mem = Mapping::anonymous(PAGES as usize * PS);
    let (server, _f) = start(vec![mem.region(0)], fx.layers(), missing(vec![], None));
    let t0 = Instant::now();
    drop(server);
    assert!(t0.elapsed() < Duration::from_secs(2));
    // Plain anonymous memory again: zeros, no server needed.
    assert_eq!(read_pages(&mem, 0, &[0]), vec![Some(0)]);
}

// ---- Minor mode ------------------------------------------------------------

/// A shmem template with the fixture's base content, and the fixture's diffs.
fn minor_layers(fx: &Fixture) -> (File, Layers) {
    let base = memfd(|f| {
        for p in [0, 1, 2, 3, 10, 100, 1500] {
            write_page(f, p, tag(0, p));
        }
        write_page(f, 5, 0);
    });
    let layers = Layers::new(
        base.try_clone().unwrap(),
        vec![
            (
                fx.diff0.handle(),
                PageRuns::from_sorted_pages([2, 3, 10, 50, 51]),
            ),
            (fx.diff1.handle(), PageRuns::from_sorted_pages([3, 51])),
        ],
    );
    (base, layers)
}

fn minor(prefetch: Vec<u64>) -> ServerOptions {
    ServerOptions {
        mode: Mode::Minor,
        prefetch,
        record_for: None,
    }
}

/// Physical frame behind a virtual address (/proc/self/pagemap; needs root),
/// or None when it is not present or the kernel hides frame numbers.
fn pfn(addr: usize) -> Option<u64> {
    let pagemap = File::open("/proc/self/pagemap").ok()?;
    let mut entry = [0u8; 8];
    pagemap
        .read_exact_at(&mut entry, (addr / PS) as u64 * 8)
        .ok()?;
    let e = u64::from_ne_bytes(entry);
    let pfn = e & ((1 << 55) - 1);
    (e >> 63 == 1 && pfn != 0).then_some(pfn)
}

#[test]
fn minor_mode_shares_base_pages_and_privatises_the_rest() {
    let fx = Fixture::new();
    let (base, layers) = minor_layers(&fx);
    let blocks_before = allocated_blocks(&base);
    let mem = Mapping::private_file(&base, PAGES as usize * PS, 0);
    let (server, failures) = start(vec![mem.region(0)], layers, minor(vec![]));

    let got = read_pages(&mem, 0, &PROBE_PAGES);
    for (&p, v) in PROBE_PAGES.iter().zip(&got) {
        assert_eq!(*v, Some(Fixture::expected(p)), "page {p}");
    }
    let s = stats_when(&server, |s| installed(s) == 12);
    assert_eq!(s.faults, PROBE_PAGES.len() as u64, "{s:?}");
    // Base pages in the file (0 1 5 100 1500) are mapped, not copied.
    assert_eq!(s.continues, 5, "{s:?}");
    // Diff pages with data (2 3 50 51) are private copies.
    assert_eq!(s.copies, 4, "{s:?}");
    // Holes (7 2047) and the zero diff page (10) are zero pages.
    assert_eq!(s.zero_pages, 3, "{s:?}");

    // Writes: to a shared base page (copy-on-write), to a hole.
    let addr = mem.addr;
    in_thread(move || {
        write_word(addr + PS, 11); // page 1, mapped shared above
        write_word(addr + 9 * PS, 12); // page 9, a hole never touched
        write_word(addr + 7 * PS, 13); // page 7, a hole read above
    });
    assert_eq!(read_pages(&mem, 0, &[9]), vec![None]);
    let mut word = [0u8; 8];
    base.read_exact_at(&mut word, PS as u64).unwrap();
    assert_eq!(u64::from_ne_bytes(word), tag(0, 1), "the template changed");
    assert_eq!(
        allocated_blocks(&base),
        blocks_before,
        "the clone allocated pages in the shared template"
    );

    // Sharing, seen through physical frames: page 0 (read only) is the
    // template's page-cache page; page 1 (written) and page 2 (diff) are not.
    let shared = Mapping::shared_file_read_only(&base, PAGES as usize * PS);
    for p in [0, 1, 2] {
        read_page(shared.addr + p * PS);
    }
    if let Some(template0) = pfn(shared.addr) {
        assert_eq!(pfn(mem.addr), Some(template0), "page 0 is not shared");
        assert_ne!(
            pfn(mem.addr + PS),
            pfn(shared.addr + PS),
            "page 1 was not copied on write"
        );
        assert_ne!(
            pfn(mem.addr + 2 * PS),
            pfn(shared.addr + 2 * PS),
            "diff page 2 maps the template"
        );
    } else {
        eprintln!("/proc/self/pagemap hides frame numbers (not root): sharing not checked");
    }
    assert!(failures.try_recv().is_err());
}

#[test]
fn minor_mode_prefetch() {
    let fx = Fixture::new();
    let (base, layers) = minor_layers(&fx);
    let blocks_before = allocated_blocks(&base);
    let mem = Mapping::private_file(&base, PAGES as usize * PS, 0);
    // Base run 0..2, diff run 2..4, hole 7, diff over a hole 50, zero diff 10,
    // base zero page 5, a base run with a hole inside (99 100 101).
    let prefetch = vec![0, 1, 2, 3, 7, 50, 10, 5, 99, 100, 101];
    let (server, _f) = start(vec![mem.region(0)], layers, minor(prefetch.clone()));
    wait_until("the prefetch", || server.stats().prefetch_done);
    let s = server.stats();
    assert_eq!((s.prefetched, s.faults), (11, 0), "{s:?}");
    assert_eq!((s.continues, s.copies, s.zero_pages), (4, 3, 4), "{s:?}");
    let got = read_pages(&mem, 0, &prefetch);
    for (&p, v) in prefetch.iter().zip(&got) {
        assert_eq!(*v, Some(Fixture::expected(p)), "page {p}");
    }
    assert_eq!(server.stats().faults, 0, "prefetched pages faulted");
    assert_eq!(allocated_blocks(&base), blocks_before);
}

#[test]
fn minor_mode_on_a_tmpfs_file_and_two_regions() {
    let shm_dir = PathBuf::from("/dev/shm");
    if !shm_dir.is_dir() {
        eprintln!("no /dev/shm: skipped");
        return;
    }
    let base = TempFile::new_in(shm_dir, "tmpfs-base", PAGES * PS as u64);
    write_page(&base.file, 0, tag(0, 0));
    write_page(&base.file, 1200, tag(0, 1200));
    let low = Mapping::private_file(&base.file, 1024 * PS, 0);
    let high = Mapping::private_file(&base.file, 1024 * PS, 1024);
    let (server, _f) = start(
        vec![low.region(0), high.region(1024)],
        Layers::new(base.handle(), vec![]),
        minor(vec![]),
    );
    assert_eq!(read_pages(&low, 0, &[0, 1]), vec![Some(tag(0, 0)), Some(0)]);
    assert_eq!(
        read_pages(&high, 1024, &[1200, 2000]),
        vec![Some(tag(0, 1200)), Some(0)]
    );
    let s = stats_when(&server, |s| installed(s) == 4);
    assert_eq!((s.continues, s.zero_pages), (2, 2), "{s:?}");
}

// ---- Measurement (cargo test --release -p torpor-vmm uffd -- --ignored --nocapture)

/// Pins the calling thread to `cpu` (threads it spawns inherit the mask).
fn pin_to(cpu: usize) {
    // SAFETY: cpu_set_t is a plain bit array; all-zero is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `cpu` is below CPU_SETSIZE (callers pass 0 or 1) and `set` is valid.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: `set` is a valid cpu_set_t of the size passed; pid 0 is this thread.
    let ret = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    assert_eq!(
        ret,
        0,
        "sched_setaffinity: {}",
        std::io::Error::last_os_error()
    );
}

/// Touches every page of `mem` once from a thread pinned to `cpu`; returns
/// pages/s.
fn touch_all(mem: &Mapping, cpu: usize) -> f64 {
    let (addr, pages) = (mem.addr, mem.len / PS);
    let elapsed = in_thread(move || {
        pin_to(cpu);
        let t0 = Instant::now();
        for i in 0..pages {
            // SAFETY: as in read_page.
            unsafe { std::ptr::read_volatile((addr + i * PS) as *const u8) };
        }
        t0.elapsed()
    });
    pages as f64 / elapsed.as_secs_f64()
}

fn report(what: &str, pages_per_s: f64) {
    println!(
        "{what:<58} {pages_per_s:>9.0} pages/s {:>7.2} us/page",
        1e6 / pages_per_s
    );
}

#[test]
#[ignore = "measurement; run with --release --ignored --nocapture"]
fn measure_fault_rates() {
    const MIB: usize = 64;
    let pages = (MIB << 20) / PS;
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    // The server thread inherits this thread's CPU 0 pin; the toucher runs on
    // CPU 0 too (a wake-up is a context switch) or on CPU 1 (a cross-CPU
    // wake-up, as between a vCPU thread and the server).
    pin_to(0);
    let placements: Vec<(&str, usize)> = if cpus > 1 {
        vec![("same CPU", 0), ("other CPU", 1)]
    } else {
        vec![("same CPU", 0)]
    };

    // Every page holds data, so each fault is a copy (or a continue).
    let data = TempFile::new("rate", (MIB << 20) as u64);
    let chunk: Vec<u8> = (0..256).flat_map(|p| page_bytes(tag(0, p))).collect();
    for off in (0..MIB << 20).step_by(chunk.len()) {
        data.file.write_all_at(&chunk, off as u64).unwrap();
    }
    let holes = TempFile::new("rate-holes", (MIB << 20) as u64);
    let shm = memfd(|f| {
        for off in (0..MIB << 20).step_by(chunk.len()) {
            f.write_all_at(&chunk, off as u64).unwrap();
        }
    });

    for &(place, cpu) in &placements {
        let mem = Mapping::anonymous(MIB << 20);
        let (server, _f) = start(
            vec![mem.region(0)],
            Layers::new(data.handle(), vec![]),
            missing(vec![], None),
        );
        report(
            &format!("missing, data (pread + UFFDIO_COPY), {place}"),
            touch_all(&mem, cpu),
        );
        assert_eq!(server.stats().faults, pages as u64);
        drop(server);

        let mem = Mapping::anonymous(MIB << 20);
        let (server, _f) = start(
            vec![mem.region(0)],
            Layers::new(holes.handle(), vec![]),
            missing(vec![], None),
        );
        report(
            &format!("missing, holes (pread + UFFDIO_ZEROPAGE), {place}"),
            touch_all(&mem, cpu),
        );
        drop(server);

        let mem = Mapping::private_file(&shm, MIB << 20, 0);
        let (server, _f) = start(
            vec![mem.region(0)],
            Layers::new(shm.try_clone().unwrap(), vec![]),
            minor(vec![]),
        );
        report(
            &format!("minor, template pages (UFFDIO_CONTINUE), {place}"),
            touch_all(&mem, cpu),
        );
        assert_eq!(server.stats().faults, pages as u64);
        drop(server);
    }

    let mem = Mapping::anonymous(MIB << 20);
    let t0 = Instant::now();
    let (server, _f) = start(
        vec![mem.region(0)],
        Layers::new(data.handle(), vec![]),
        missing((0..pages as u64).collect(), None),
    );
    wait_until("the prefetch", || server.stats().prefetch_done);
    report(
        "missing, prefetch of every page (batches of 32)",
        pages as f64 / t0.elapsed().as_secs_f64(),
    );
    drop(server);

    let mem = Mapping::private_file(&shm, MIB << 20, 0);
    let t0 = Instant::now();
    let (server, _f) = start(
        vec![mem.region(0)],
        Layers::new(shm.try_clone().unwrap(), vec![]),
        minor((0..pages as u64).collect()),
    );
    wait_until("the prefetch", || server.stats().prefetch_done);
    report(
        "minor, prefetch of every page (batches of 32)",
        pages as f64 / t0.elapsed().as_secs_f64(),
    );
    drop(server);

    // Start latency (checks, /proc/self/maps, registration, thread spawn)
    // for a 2 GiB region: nothing in it depends on the size.
    let big = Mapping::anonymous(2 << 30);
    let big_base = TempFile::new("big", 2 << 30);
    let mut times: Vec<Duration> = (0..9)
        .map(|_| {
            let t0 = Instant::now();
            let (server, _f) = start(
                vec![big.region(0)],
                Layers::new(big_base.handle(), vec![]),
                missing(vec![], None),
            );
            let t = t0.elapsed();
            drop(server);
            t
        })
        .collect();
    times.sort();
    println!("start() over a 2 GiB region, median of 9: {:?}", times[4]);

    // For scale: the kernel alone, no userfaultfd.
    let mem = Mapping::private_file(&shm, MIB << 20, 0);
    report(
        "no userfaultfd: MAP_PRIVATE memfd read faults",
        touch_all(&mem, 0),
    );
    let mem = Mapping::anonymous(MIB << 20);
    report("no userfaultfd: anonymous read faults", touch_all(&mem, 0));
}
