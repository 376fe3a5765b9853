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
    let words: Vec<u64> = (0..PS / 8)
        .map(|i| {
            // SAFETY: the callers pass pages of mappings that outlive the
            // reading thread (Mapping leaks on failure); reads may fault
            // into the server.
            unsafe { std::ptr::read_volatile((addr + i * 8) as *const u64) }
        })
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
        write_protect: false,
        install_first: Vec::new(),
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

mod minor_mode;
mod missing_mode;
mod rates;
mod write_protect;

/// The page server thread does its work under its own seccomp filter:
/// missing and minor faults from user and kernel mode, prefetch,
/// write-protected installs, a failure.
#[test]
fn the_page_server_runs_under_its_seccomp_filter() {
    if !crate::seccomp::tests::confined_child() {
        crate::seccomp::tests::run_in_confined_child(
            "uffd::tests::the_page_server_runs_under_its_seccomp_filter",
        );
        return;
    }
    missing_mode::missing_mode_serves_each_page_from_its_layer();
    missing_mode::write_faults_install_the_page_then_the_write();
    missing_mode::prefetch_and_faults_interleave();
    missing_mode::kernel_mode_faults_are_served();
    missing_mode::truncated_base_fails_loudly_and_stops_answering();
    minor_mode::minor_mode_shares_base_pages_and_privatises_the_rest();
    minor_mode::minor_mode_prefetch();
    write_protect::missing_mode_installs_pages_protected();
    write_protect::minor_mode_installs_pages_protected();
}

/// Drops the mapping's pages `pages` (counted from the mapping's start) as
/// the balloon does with pages a guest gave up: `MADV_DONTNEED`.
fn discard_pages(m: &Mapping, pages: &[u64]) {
    for &p in pages {
        let addr = m.addr + p as usize * PS;
        // SAFETY: one page inside a mapping this test owns; MADV_DONTNEED
        // only drops this process's copy of it.
        let rc = unsafe { libc::madvise(addr as *mut libc::c_void, PS, libc::MADV_DONTNEED) };
        assert_eq!(rc, 0, "madvise: {}", std::io::Error::last_os_error());
    }
}

/// What the balloon relies on: a page served, written, then discarded
/// faults again and is served afresh from its layer (the server keeps no
/// "already served" record), in both modes.
fn discarded_pages_are_served_again(mem: &Mapping, server: &PageServer) {
    let first = read_pages(mem, 0, &PROBE_PAGES);
    let addr = mem.addr;
    in_thread(move || {
        for &p in &PROBE_PAGES {
            write_word(addr + p as usize * PS, 0xdead_beef);
        }
    });
    let faults = server.stats().faults;
    discard_pages(mem, &PROBE_PAGES);
    assert_eq!(read_pages(mem, 0, &PROBE_PAGES), first);
    assert_eq!(
        server.stats().faults,
        faults + PROBE_PAGES.len() as u64,
        "every discarded page faulted once more"
    );
}

#[test]
fn missing_mode_serves_a_discarded_page_again() {
    let fx = Fixture::new();
    let mem = Mapping::anonymous(PAGES as usize * PS);
    let (server, failures) = start(vec![mem.region(0)], fx.layers(), missing(vec![], None));
    discarded_pages_are_served_again(&mem, &server);
    assert!(failures.try_recv().is_err());
}

#[test]
fn minor_mode_serves_a_discarded_page_again() {
    let fx = Fixture::new();
    let (base, layers) = minor_mode::minor_layers(&fx);
    let before = std::fs::read(format!("/proc/self/fd/{}", base.as_raw_fd())).unwrap();
    let mem = Mapping::private_file(&base, PAGES as usize * PS, 0);
    let (server, failures) = start(vec![mem.region(0)], layers, minor_mode::minor(vec![]));
    discarded_pages_are_served_again(&mem, &server);
    let after = std::fs::read(format!("/proc/self/fd/{}", base.as_raw_fd())).unwrap();
    assert!(before == after, "the shared template is untouched");
    assert!(failures.try_recv().is_err());
}
