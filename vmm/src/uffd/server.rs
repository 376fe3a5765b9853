//! The page server: a userfaultfd over the guest RAM regions and the thread
//! that answers its faults and runs the prefetch.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use torpor_sync::Locked;
use userfaultfd::{Event, EventBuffer, FaultKind, FeatureFlags, RegisterMode, Uffd, UffdBuilder};
use vmm_sys_util::eventfd::EventFd;

use super::layers::{is_zero, LayerFile, PageBuf};
use super::regions::RegionTable;
use super::{
    FailureHandler, Layers, Mode, Region, ServerOptions, Source, UffdError, PAGE_SIZE,
    PREFETCH_BATCH,
};
use torpor_vmm_api::lineage::MAX_WORKING_SET_PAGES;

// The userfaultfd crate creates the descriptor, registers ranges and reads
// events; the fill ioctls are issued directly because the crate loses the
// byte count of a partial UFFDIO_ZEROPAGE and reports errnos through three
// different error variants.
use crate::uffd_abi::{
    ioctl_bit, uffdio_continue, uffdio_copy, uffdio_range, uffdio_zeropage, _UFFDIO_CONTINUE,
    _UFFDIO_COPY, _UFFDIO_WAKE, _UFFDIO_WRITEPROTECT, _UFFDIO_ZEROPAGE, UFFDIO_CONTINUE,
    UFFDIO_CONTINUE_MODE_WP, UFFDIO_COPY, UFFDIO_COPY_MODE_WP, UFFDIO_REGISTER_MODE_WP,
    UFFDIO_WAKE, UFFDIO_ZEROPAGE, UFFD_FEATURE_MINOR_SHMEM, UFFD_FEATURE_MISSING_SHMEM,
};

/// The source of the zeroed `UFFDIO_COPY` that answers a write fault on a
/// zero page, and of zero runs installed write-protected (UFFDIO_ZEROPAGE
/// has no write-protect mode).
#[repr(C, align(4096))]
struct ZeroPages([u8; PAGE_SIZE * PREFETCH_BATCH]);
static ZERO_PAGES: ZeroPages = ZeroPages([0; PAGE_SIZE * PREFETCH_BATCH]);

fn is_zero_source(src: usize) -> bool {
    let start = ZERO_PAGES.0.as_ptr() as usize;
    (start..start + ZERO_PAGES.0.len()).contains(&src)
}

/// Fault events read from the userfaultfd at once.
const EVENT_BATCH: usize = 16;
/// How often a fill that keeps failing with EAGAIN is retried before the
/// server gives up. EAGAIN means the address space is changing under the
/// ioctl; without event features it practically never happens.
const EAGAIN_RETRIES: usize = 10_000;

/// Counters of a running page server. `faults` (and the working set) are
/// updated before a fault is answered; the install counters right after the
/// ioctl that already woke the faulting thread, so they may trail what that
/// thread has seen by a moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Stats {
    /// Page-fault events answered (two vCPUs faulting on one page count twice).
    pub faults: u64,
    /// Pages installed as zeros (holes and all-zero pages), by faults or prefetch.
    pub zero_pages: u64,
    /// Pages installed with `UFFDIO_COPY` of data, by faults or prefetch.
    pub copies: u64,
    /// Pages mapped from the shared page cache with `UFFDIO_CONTINUE`.
    pub continues: u64,
    /// Pages installed by the prefetch (also counted in the three above).
    pub prefetched: u64,
    /// Installs that found the page already there (a fault racing the
    /// prefetch, or two vCPUs faulting on one page).
    pub already_present: u64,
    /// 1 once the server has failed and stopped answering.
    pub failures: u64,
    /// Whether the prefetch list has been worked through.
    pub prefetch_done: bool,
}

/// State the server thread shares with the [`PageServer`] handle.
#[derive(Default)]
struct Shared {
    faults: AtomicU64,
    zero_pages: AtomicU64,
    copies: AtomicU64,
    continues: AtomicU64,
    prefetched: AtomicU64,
    already_present: AtomicU64,
    failures: AtomicU64,
    prefetch_done: AtomicBool,
    working_set: Mutex<Vec<u64>>,
    /// Every page installed since start, by a fault or the prefetch, once
    /// each, in that order, at most [`MAX_WORKING_SET_PAGES`].
    installed: Mutex<Vec<u64>>,
}

/// A running page server. Dropping it stops the server thread and closes the
/// userfaultfd (see the module documentation for what happens to faults
/// after that: stop the vCPUs first).
pub struct PageServer {
    shared: Arc<Shared>,
    stop: EventFd,
    thread: Option<JoinHandle<()>>,
    mode: Mode,
}

impl std::fmt::Debug for PageServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PageServer")
            .field("mode", &self.mode)
            .field("stats", &self.stats())
            .finish()
    }
}

impl PageServer {
    /// Registers the regions with a new userfaultfd and starts the server
    /// thread. Work here is O(regions + diffs + host mappings): nothing is
    /// proportional to guest memory or to the prefetch list.
    ///
    /// # Safety
    ///
    /// Each region must be a live mapping of `len` bytes at `host_addr` that
    /// holds guest RAM and nothing else, and must stay mapped until the
    /// returned `PageServer` is dropped: the server installs page contents in
    /// it wherever a page is not yet populated. In [`Mode::Missing`] it must
    /// be private anonymous memory, in [`Mode::Minor`] a `MAP_PRIVATE`
    /// mapping of the base file at offset `first_page * PAGE_SIZE`; in both
    /// modes not yet touched.
    pub unsafe fn start(
        regions: Vec<Region>,
        layers: Layers,
        opts: ServerOptions,
        on_failure: FailureHandler,
    ) -> Result<PageServer, UffdError> {
        let started = Instant::now();
        let mode = opts.mode;
        let regions = RegionTable::new(regions)?;
        let ends: Vec<(usize, u64)> = regions.iter().map(|(i, r)| (i, r.end_page())).collect();
        layers.check_lengths(&ends)?;
        if mode == Mode::Minor {
            check_shmem(layers.base())?;
        }
        regions.check_mappings(mode, &layers.base().file, &layers.base().name)?;

        let uffd = create_uffd(mode, opts.write_protect)?;
        for (index, r) in regions.iter() {
            register(&uffd, mode, opts.write_protect, index, r)?;
        }
        if opts.write_protect {
            // Pages the server installs come protected, but PAGEMAP_SCAN
            // reports a never-populated page without a uffd-wp marker as
            // written (seen on 6.18): protect the whole range once, which
            // installs markers (page tables and an entry per page).
            let spans: Vec<_> = regions
                .iter()
                .map(|(_, r)| (r.host_addr, r.len, r.first_page))
                .collect();
            crate::dirty::protect(&uffd, &spans).map_err(UffdError::WriteProtect)?;
        }

        let stop =
            EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC).map_err(UffdError::StopEvent)?;
        let thread_stop = stop.try_clone().map_err(UffdError::StopEvent)?;
        let shared = Arc::new(Shared::default());
        shared
            .prefetch_done
            .store(opts.prefetch.is_empty(), Ordering::Release);
        let registered = Instant::now();
        let mut worker = Worker {
            uffd,
            mode,
            write_protect: opts.write_protect,
            regions,
            layers,
            prefetch: opts.install_first,
            next_prefetch: 0,
            prefetch_skipped: 0,
            prefetch_unarrived: 0,
            skip_unarrived: false,
            record_until: opts.record_for.and_then(|d| registered.checked_add(d)),
            seen: PageSet::new(ends.iter().map(|&(_, end)| end).max().unwrap_or(0)),
            shared: Arc::clone(&shared),
            buf: PageBuf::new_boxed(),
            pending: Vec::with_capacity(EVENT_BATCH),
        };
        // Pages the caller is about to touch, installed on this thread: no
        // fault round trip through a server thread that may not be running.
        while worker.next_prefetch < worker.prefetch.len() {
            worker.prefetch_step().map_err(UffdError::InstallFirst)?;
        }
        shared
            .prefetch_done
            .store(opts.prefetch.is_empty(), Ordering::Release);
        worker.prefetch = opts.prefetch;
        (worker.next_prefetch, worker.prefetch_skipped) = (0, 0);
        // The prefetch proper does not wait for a memory file still
        // arriving: a fault waiting behind it would wait for a chunk the
        // guest may not need yet. Pages not arrived fault in instead.
        worker.skip_unarrived = true;
        let thread = std::thread::Builder::new()
            .name("uffd-pages".into())
            .spawn(move || {
                crate::seccomp::enter(crate::seccomp::ThreadKind::UffdPages);
                supervise(worker, thread_stop, on_failure)
            })
            .map_err(UffdError::Spawn)?;
        tracing::debug!(
            mode = mode.name(),
            us = started.elapsed().as_micros() as u64,
            "userfaultfd page server started"
        );
        Ok(PageServer {
            shared,
            stop,
            thread: Some(thread),
            mode,
        })
    }

    /// The counters so far.
    pub fn stats(&self) -> Stats {
        let s = &self.shared;
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Stats {
            faults: get(&s.faults),
            zero_pages: get(&s.zero_pages),
            copies: get(&s.copies),
            continues: get(&s.continues),
            prefetched: get(&s.prefetched),
            already_present: get(&s.already_present),
            failures: get(&s.failures),
            prefetch_done: s.prefetch_done.load(Ordering::Acquire),
        }
    }

    /// Pages (memory-file indexes) that faulted within `record_for` after
    /// start, ascending and without duplicates. Prefetched pages do not fault
    /// and so are not in it.
    pub fn working_set(&self) -> Vec<u64> {
        let mut pages = self.shared.working_set.locked().clone();
        pages.sort_unstable();
        pages.dedup();
        pages
    }

    /// Every page installed since start, by a fault or by the prefetch
    /// (the pages `install_first` named among them), each once, in the
    /// order first installed: what a snapshot of this VM records as its
    /// working set. At most [`MAX_WORKING_SET_PAGES`]: the first ones.
    /// A page the guest discards and touches again keeps its first place.
    pub fn installed(&self) -> Vec<u64> {
        self.shared.installed.locked().clone()
    }

    /// The mode the server was started in.
    pub fn mode(&self) -> Mode {
        self.mode
    }
}

impl Drop for PageServer {
    fn drop(&mut self) {
        if let Err(e) = self.stop.write(1) {
            tracing::error!("cannot signal the page server thread to stop: {e}");
            return;
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn check_shmem(base: &LayerFile) -> Result<(), UffdError> {
    let fs_type = crate::fsmagic::of_fd(&base.file).map_err(|source| UffdError::Inspect {
        file: base.name.clone(),
        source,
    })?;
    if fs_type != crate::fsmagic::TMPFS_MAGIC {
        return Err(UffdError::BaseNotShmem {
            file: base.name.clone(),
            fs_type,
        });
    }
    Ok(())
}

fn create_uffd(mode: Mode, write_protect: bool) -> Result<Uffd, UffdError> {
    let mut builder = UffdBuilder::new();
    builder
        .close_on_exec(true)
        .non_blocking(true)
        // KVM (get_user_pages) and system calls fault on guest memory in
        // kernel mode; a user-mode-only userfaultfd would SIGBUS them.
        .user_mode_only(false);
    if mode == Mode::Minor {
        builder.require_features(FeatureFlags::from_bits_retain(
            UFFD_FEATURE_MINOR_SHMEM | UFFD_FEATURE_MISSING_SHMEM,
        ));
    }
    if write_protect {
        use crate::uffd_abi::{
            UFFD_FEATURE_WP_ASYNC, UFFD_FEATURE_WP_HUGETLBFS_SHMEM, UFFD_FEATURE_WP_UNPOPULATED,
        };
        let offered = crate::dirty::check_wp_async().map_err(|e| UffdError::Create {
            mode: mode.name(),
            reason: e.to_string(),
        })?;
        let mut wp = UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_UNPOPULATED;
        if mode == Mode::Minor {
            // Write-protection of shmem-backed ranges.
            wp |= UFFD_FEATURE_WP_HUGETLBFS_SHMEM & offered;
        }
        builder.require_features(FeatureFlags::from_bits_retain(wp));
    }
    builder.create().map_err(|e| UffdError::Create {
        mode: mode.name(),
        reason: error_chain(&e),
    })
}

/// An error and its sources in one line: the userfaultfd crate puts the
/// errno only in the source ("System error" / "EINVAL: Invalid argument").
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

fn register(
    uffd: &Uffd,
    mode: Mode,
    write_protect: bool,
    index: usize,
    r: &Region,
) -> Result<(), UffdError> {
    let (mut reg_mode, hint, mut need) = match mode {
        Mode::Missing => (
            RegisterMode::MISSING,
            " (missing mode needs private anonymous memory)",
            vec![("UFFDIO_COPY", ioctl_bit(_UFFDIO_COPY))],
        ),
        Mode::Minor => (
            RegisterMode::MISSING | RegisterMode::MINOR,
            " (minor mode needs a MAP_PRIVATE mapping of the base shmem file)",
            vec![
                ("UFFDIO_COPY", ioctl_bit(_UFFDIO_COPY)),
                ("UFFDIO_CONTINUE", ioctl_bit(_UFFDIO_CONTINUE)),
            ],
        ),
    };
    need.push(("UFFDIO_ZEROPAGE", ioctl_bit(_UFFDIO_ZEROPAGE)));
    need.push(("UFFDIO_WAKE", ioctl_bit(_UFFDIO_WAKE)));
    if write_protect {
        reg_mode |= RegisterMode::from_bits_retain(UFFDIO_REGISTER_MODE_WP);
        need.push(("UFFDIO_WRITEPROTECT", ioctl_bit(_UFFDIO_WRITEPROTECT)));
    }
    let offered = uffd
        .register_with_mode(r.host_addr as *mut libc::c_void, r.len, reg_mode)
        .map_err(|e| UffdError::Register {
            index,
            addr: r.host_addr,
            len: r.len,
            mode: mode.name(),
            hint,
            reason: error_chain(&e),
        })?
        .bits();
    if let Some(&(missing, _)) = need.iter().find(|(_, bit)| offered & bit == 0) {
        return Err(UffdError::MissingIoctl {
            index,
            mode: mode.name(),
            missing,
            offered,
        });
    }
    Ok(())
}

/// Runs the worker; on failure reports it once and then holds the
/// userfaultfd open, answering nothing, until the handle is dropped.
fn supervise(mut worker: Worker, stop: EventFd, on_failure: FailureHandler) {
    let shared = Arc::clone(&worker.shared);
    let failed = run_supervised(|| worker.run(&stop), &shared, &on_failure);
    if failed {
        wait_readable(stop.as_raw_fd());
    }
    drop(worker);
}

/// Runs `body`, catching a panic; an error or a panic is counted and passed
/// to `on_failure` (itself guarded against panics). Returns whether it failed.
fn run_supervised(
    body: impl FnOnce() -> Result<(), String>,
    shared: &Shared,
    on_failure: &FailureHandler,
) -> bool {
    let message = match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => return false,
        Ok(Err(message)) => message,
        Err(payload) => format!(
            "userfaultfd page server thread panicked: {}",
            panic_message(payload.as_ref())
        ),
    };
    shared.failures.fetch_add(1, Ordering::Relaxed);
    tracing::error!("{message}; the page server stops answering faults");
    if catch_unwind(AssertUnwindSafe(|| on_failure(message))).is_err() {
        tracing::error!("the page server's failure handler panicked");
    }
    true
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(no message)".to_string()
    }
}

/// Blocks until `fd` is readable (or polling it fails).
fn wait_readable(fd: RawFd) {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    loop {
        // SAFETY: `pfd` is one valid pollfd that outlives the call.
        let n = unsafe { libc::poll(&mut pfd, 1, -1) };
        if n > 0 || (n < 0 && io::Error::last_os_error().kind() != io::ErrorKind::Interrupted) {
            return;
        }
    }
}

/// A fill ioctl and its arguments other than the destination.
#[derive(Clone, Copy, Debug)]
enum Fill {
    /// `UFFDIO_COPY` from this source address.
    Copy(usize),
    Zero,
    Continue,
}

impl Fill {
    fn name(self) -> &'static str {
        match self {
            Fill::Copy(_) => "UFFDIO_COPY",
            Fill::Zero => "UFFDIO_ZEROPAGE",
            Fill::Continue => "UFFDIO_CONTINUE",
        }
    }

    /// The same fill `bytes` further on.
    fn advance(self, bytes: usize) -> Fill {
        match self {
            Fill::Copy(src) => Fill::Copy(src + bytes),
            other => other,
        }
    }
}

/// Issues one fill ioctl for `len` bytes at `dst`. Returns the bytes filled
/// and, if it stopped short, the errno. With `protect`, the pages are
/// installed write-protected (uffd-wp dirty tracking: not yet written); zero
/// runs then become copies of zeros, at most `PREFETCH_BATCH` pages.
fn fill(uffd: RawFd, op: Fill, dst: usize, len: usize, protect: bool) -> (usize, Option<i32>) {
    let op = match op {
        Fill::Zero if protect => Fill::Copy(ZERO_PAGES.0.as_ptr() as usize),
        other => other,
    };
    let (ret, done) = match op {
        Fill::Copy(src) => {
            debug_assert!(!is_zero_source(src) || len <= ZERO_PAGES.0.len());
            let mut arg = uffdio_copy {
                dst: dst as u64,
                src: src as u64,
                len: len as u64,
                mode: if protect { UFFDIO_COPY_MODE_WP } else { 0 },
                copy: 0,
            };
            // SAFETY: UFFDIO_COPY reads and writes one `struct uffdio_copy`
            // (`arg`, live for the call). The kernel reads `len` bytes at
            // `src`, which is the server's page buffer or ZERO_PAGES (both at
            // least `len` long), and writes only into unpopulated pages of a
            // registered range, which `start`'s contract reserves for guest RAM.
            let ret = unsafe { libc::ioctl(uffd, UFFDIO_COPY as _, &mut arg as *mut uffdio_copy) };
            (ret, arg.copy)
        }
        Fill::Zero => {
            let mut arg = uffdio_zeropage {
                range: uffdio_range {
                    start: dst as u64,
                    len: len as u64,
                },
                mode: 0,
                zeropage: 0,
            };
            // SAFETY: UFFDIO_ZEROPAGE reads and writes one `struct
            // uffdio_zeropage` (`arg`, live for the call) and maps zero pages
            // only where a registered range (guest RAM) has none.
            let ret = unsafe {
                libc::ioctl(uffd, UFFDIO_ZEROPAGE as _, &mut arg as *mut uffdio_zeropage)
            };
            (ret, arg.zeropage)
        }
        Fill::Continue => {
            let mut arg = uffdio_continue {
                range: uffdio_range {
                    start: dst as u64,
                    len: len as u64,
                },
                mode: if protect { UFFDIO_CONTINUE_MODE_WP } else { 0 },
                mapped: 0,
            };
            // SAFETY: UFFDIO_CONTINUE reads and writes one `struct
            // uffdio_continue` (`arg`, live for the call) and maps the file's
            // existing page-cache pages where a registered range has none.
            let ret = unsafe {
                libc::ioctl(uffd, UFFDIO_CONTINUE as _, &mut arg as *mut uffdio_continue)
            };
            (ret, arg.mapped)
        }
    };
    if ret == 0 {
        return (len, None);
    }
    let errno = io::Error::last_os_error().raw_os_error().unwrap_or(0);
    (done.max(0) as usize, Some(errno))
}

fn wake(uffd: RawFd, dst: usize, len: usize) -> Result<(), i32> {
    let mut range = uffdio_range {
        start: dst as u64,
        len: len as u64,
    };
    // SAFETY: UFFDIO_WAKE reads one `struct uffdio_range` (`range`, live for
    // the call) and only wakes threads waiting on faults in it.
    let ret = unsafe { libc::ioctl(uffd, UFFDIO_WAKE as _, &mut range as *mut uffdio_range) };
    if ret == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error().raw_os_error().unwrap_or(0))
    }
}

fn errno_text(errno: i32) -> String {
    io::Error::from_raw_os_error(errno).to_string()
}

enum PageFill {
    Installed,
    /// The page was already there (EEXIST); waiters on it were woken.
    Present,
}

/// A failed fill inside a run: page offset in the run, ioctl, errno.
type RunError = (usize, &'static str, i32);

/// Everything the server thread owns.
struct Worker {
    uffd: Uffd,
    mode: Mode,
    /// Install pages write-protected unless a write fault asked for them.
    write_protect: bool,
    regions: RegionTable,
    layers: Layers,
    prefetch: Vec<u64>,
    next_prefetch: usize,
    prefetch_skipped: u64,
    /// Prefetch pages left out because their chunk had not arrived.
    prefetch_unarrived: u64,
    /// Leave out prefetch pages whose chunk has not arrived (after the
    /// `install_first` pages, which wait for theirs).
    skip_unarrived: bool,
    record_until: Option<Instant>,
    /// The pages in `shared.installed` (or past its cap).
    seen: PageSet,
    shared: Arc<Shared>,
    buf: Box<PageBuf>,
    pending: Vec<(bool, bool, usize)>,
}

impl Worker {
    fn run(&mut self, stop: &EventFd) -> Result<(), String> {
        let mut events = EventBuffer::new(EVENT_BATCH);
        loop {
            let prefetching = self.next_prefetch < self.prefetch.len();
            let (faults, stopping) =
                self.poll(stop.as_raw_fd(), if prefetching { 0 } else { -1 })?;
            if stopping {
                return Ok(());
            }
            if faults {
                self.serve_pending(&mut events)?;
            } else if prefetching {
                self.prefetch_step()?;
            }
        }
    }

    /// Polls the userfaultfd and the stop eventfd: (faults pending, stop).
    fn poll(&self, stop: RawFd, timeout_ms: i32) -> Result<(bool, bool), String> {
        let mut fds = [
            libc::pollfd {
                fd: self.uffd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: stop,
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        loop {
            // SAFETY: `fds` is an array of two valid pollfds that outlives
            // the call, and the length passed is its length.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
            if n >= 0 {
                break;
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(format!("cannot poll the userfaultfd: {e}"));
            }
        }
        if fds[0].revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0 {
            return Err(format!(
                "the userfaultfd reports an error condition (poll revents {:#x})",
                fds[0].revents
            ));
        }
        Ok((fds[0].revents & libc::POLLIN != 0, fds[1].revents != 0))
    }

    fn serve_pending(&mut self, events: &mut EventBuffer) -> Result<(), String> {
        self.pending.clear();
        let read = self
            .uffd
            .read_events(events)
            .map_err(|e| format!("cannot read userfaultfd events: {e}"))?;
        for event in read {
            match event {
                Ok(Event::Pagefault { kind, rw, addr, .. }) => self.pending.push((
                    matches!(kind, FaultKind::Minor),
                    rw == userfaultfd::ReadWrite::Write,
                    addr as usize,
                )),
                Ok(other) => return Err(format!("unexpected userfaultfd event {other:?}")),
                Err(e) => return Err(format!("cannot decode a userfaultfd event: {e}")),
            }
        }
        for i in 0..self.pending.len() {
            let (minor, write, addr) = self.pending[i];
            self.serve_fault(minor, write, addr)?;
        }
        Ok(())
    }

    /// Notes `page` as installed: the first time only, one push under the
    /// lock (a page is installed once unless the guest discards it).
    fn note_installed(&mut self, page: u64) {
        if self.seen.insert(page) {
            let mut installed = self.shared.installed.locked();
            if (installed.len() as u64) < MAX_WORKING_SET_PAGES {
                installed.push(page);
            }
        }
    }

    fn record(&mut self, page: u64) {
        self.note_installed(page);
        if let Some(until) = self.record_until {
            if Instant::now() < until {
                self.shared.working_set.locked().push(page);
            } else {
                self.record_until = None;
            }
        }
    }

    fn count(&self, op: Fill, pages: u64) {
        let counter = match op {
            Fill::Copy(src) if is_zero_source(src) => &self.shared.zero_pages,
            Fill::Copy(_) => &self.shared.copies,
            Fill::Zero => &self.shared.zero_pages,
            Fill::Continue => &self.shared.continues,
        };
        counter.fetch_add(pages, Ordering::Relaxed);
    }

    /// Fills one page, retrying on EAGAIN and waking waiters on EEXIST.
    fn fill_page(&self, op: Fill, dst: usize, protect: bool) -> Result<PageFill, i32> {
        let fd = self.uffd.as_raw_fd();
        for _ in 0..EAGAIN_RETRIES {
            match fill(fd, op, dst, PAGE_SIZE, protect) {
                (_, None) => return Ok(PageFill::Installed),
                (n, Some(libc::EAGAIN)) if n == PAGE_SIZE => return Ok(PageFill::Installed),
                (_, Some(libc::EAGAIN)) => std::thread::yield_now(),
                (_, Some(libc::EEXIST)) => {
                    // A failed fill wakes nobody; a thread may be waiting on
                    // this page (its fault raced the install).
                    wake(fd, dst, PAGE_SIZE)?;
                    self.shared.already_present.fetch_add(1, Ordering::Relaxed);
                    return Ok(PageFill::Present);
                }
                (_, Some(errno)) => return Err(errno),
            }
        }
        Err(libc::EAGAIN)
    }

    /// Fills `pages` consecutive pages at `dst` with one ioctl, finishing page
    /// by page if it stops short. With `hole_as_zero`, a `UFFDIO_CONTINUE`
    /// that finds no page in the file (EFAULT: a hole) maps a zero page
    /// instead. Returns the pages installed.
    fn fill_run(
        &self,
        op: Fill,
        dst: usize,
        pages: usize,
        hole_as_zero: bool,
    ) -> Result<u64, RunError> {
        let protect = self.write_protect;
        let (bytes, errno) = fill(self.uffd.as_raw_fd(), op, dst, pages * PAGE_SIZE, protect);
        let mut k = bytes / PAGE_SIZE;
        self.count(op, k as u64);
        let mut installed = k as u64;
        if errno.is_none() {
            return Ok(installed);
        }
        while k < pages {
            let (page_op, addr) = (op.advance(k * PAGE_SIZE), dst + k * PAGE_SIZE);
            let result = match self.fill_page(page_op, addr, protect) {
                Err(libc::EFAULT) if hole_as_zero && matches!(op, Fill::Continue) => self
                    .fill_page(Fill::Zero, addr, protect)
                    .map(|r| (r, Fill::Zero)),
                other => other.map(|r| (r, page_op)),
            };
            match result {
                Ok((PageFill::Installed, done_op)) => {
                    self.count(done_op, 1);
                    installed += 1;
                }
                Ok((PageFill::Present, _)) => {}
                Err(errno) => return Err((k, page_op.name(), errno)),
            }
            k += 1;
        }
        Ok(installed)
    }

    fn serve_fault(&mut self, minor: bool, write: bool, addr: usize) -> Result<(), String> {
        let dst = addr & !(PAGE_SIZE - 1);
        let page = self.regions.page_at(dst).ok_or_else(|| {
            format!("userfaultfd reported a fault at host address {addr:#x}, outside every registered memory region")
        })?;
        self.shared.faults.fetch_add(1, Ordering::Relaxed);
        self.record(page);
        let source = self.layers.source(page);
        let op = match (self.mode, minor, source) {
            // A base page present in the shared file: map it.
            (Mode::Minor, true, Source::Base) => Fill::Continue,
            // A hole of the shmem base (the kernel found no page): zeros.
            (Mode::Minor, false, Source::Base) => zero_fill(write),
            // Missing mode, and diff pages in either mode: a private copy.
            _ => {
                let buf = &mut self.buf.0[..PAGE_SIZE];
                self.layers.read_pages(source, page, buf)?;
                if is_zero(buf) {
                    zero_fill(write)
                } else {
                    Fill::Copy(buf.as_ptr() as usize)
                }
            }
        };
        // A page a write asked for is dirty: install it writable.
        match self.fill_page(op, dst, self.write_protect && !write) {
            Ok(PageFill::Installed) => {
                self.count(op, 1);
                Ok(())
            }
            Ok(PageFill::Present) => Ok(()),
            Err(errno) => Err(format!(
                "{} of page {page} from {} at host address {dst:#x} failed: {}",
                op.name(),
                self.layers.describe(source),
                errno_text(errno)
            )),
        }
    }

    /// Installs the next run of up to PREFETCH_BATCH consecutive prefetch
    /// pages that share a region and a layer.
    fn prefetch_step(&mut self) -> Result<(), String> {
        let first = self.prefetch[self.next_prefetch];
        let Some(region) = self.regions.region_of_page(first).copied() else {
            self.next_prefetch += 1;
            self.prefetch_skipped += 1;
            self.finish_prefetch_if_done();
            return Ok(());
        };
        let source = self.layers.source(first);
        let mut n = 1;
        while n < PREFETCH_BATCH {
            match self.prefetch.get(self.next_prefetch + n) {
                Some(&p)
                    if p == first + n as u64
                        && p < region.end_page()
                        && self.layers.source(p) == source =>
                {
                    n += 1
                }
                _ => break,
            }
        }
        self.next_prefetch += n;
        if self.skip_unarrived && !self.layers.arrived(source, first, n as u64) {
            self.prefetch_unarrived += n as u64;
            self.finish_prefetch_if_done();
            return Ok(());
        }
        let dst = region.host_addr + (first - region.first_page) as usize * PAGE_SIZE;

        let installed = if self.mode == Mode::Minor && source == Source::Base {
            self.fill_run(Fill::Continue, dst, n, true)
                .map_err(|e| self.prefetch_error(e, first, source, dst))?
        } else {
            let bytes = n * PAGE_SIZE;
            self.layers
                .read_pages(source, first, &mut self.buf.0[..bytes])?;
            // Split into runs of all-zero and of data pages.
            let mut installed = 0;
            let mut i = 0;
            while i < n {
                let zero = is_zero(self.page(i));
                let mut j = i + 1;
                while j < n && is_zero(self.page(j)) == zero {
                    j += 1;
                }
                let op = if zero {
                    Fill::Zero
                } else {
                    Fill::Copy(self.page(i).as_ptr() as usize)
                };
                let at = dst + i * PAGE_SIZE;
                installed += self
                    .fill_run(op, at, j - i, false)
                    .map_err(|(k, name, errno)| {
                        self.prefetch_error((i + k, name, errno), first, source, dst)
                    })?;
                i = j;
            }
            installed
        };
        self.shared
            .prefetched
            .fetch_add(installed, Ordering::Relaxed);
        for p in first..first + n as u64 {
            self.note_installed(p);
        }
        self.finish_prefetch_if_done();
        Ok(())
    }

    fn page(&self, i: usize) -> &[u8] {
        &self.buf.0[i * PAGE_SIZE..(i + 1) * PAGE_SIZE]
    }

    fn prefetch_error(
        &self,
        (k, name, errno): RunError,
        first: u64,
        source: Source,
        dst: usize,
    ) -> String {
        format!(
            "prefetch: {name} of page {} from {} at host address {:#x} failed: {}",
            first + k as u64,
            self.layers.describe(source),
            dst + k * PAGE_SIZE,
            errno_text(errno)
        )
    }

    fn finish_prefetch_if_done(&mut self) {
        if self.next_prefetch < self.prefetch.len() {
            return;
        }
        if self.prefetch_skipped > 0 {
            tracing::warn!(
                skipped = self.prefetch_skipped,
                "prefetch pages outside every memory region were skipped"
            );
        }
        tracing::debug!(
            pages = self.prefetch.len(),
            installed = self.shared.prefetched.load(Ordering::Relaxed),
            not_arrived = self.prefetch_unarrived,
            "prefetch done"
        );
        self.shared.prefetch_done.store(true, Ordering::Release);
        self.prefetch = Vec::new();
        self.next_prefetch = 0;
    }
}

/// A set of page numbers below a bound, one bit each (allocated zeroed,
/// so the kernel backs only the words written).
struct PageSet(Vec<u64>);

impl PageSet {
    fn new(pages: u64) -> PageSet {
        PageSet(vec![0; pages.div_ceil(64) as usize])
    }

    /// Adds `page`; whether it was new (a page past the bound never is).
    fn insert(&mut self, page: u64) -> bool {
        let Some(word) = self.0.get_mut((page / 64) as usize) else {
            return false;
        };
        let bit = 1u64 << (page % 64);
        let new = *word & bit == 0;
        *word |= bit;
        new
    }
}

/// The zero fill for a fault: a read maps the shared zero page; a write gets
/// a zeroed private page at once, saving the copy-on-write fault that a zero
/// page mapping would take next.
fn zero_fill(write: bool) -> Fill {
    if write {
        Fill::Copy(ZERO_PAGES.0.as_ptr() as usize)
    } else {
        Fill::Zero
    }
}

/// The page server's thread: reads fault events, fills pages from the
/// snapshot's memory files (pread) with UFFDIO_COPY/CONTINUE.
pub(crate) fn syscalls(r: &mut crate::seccomp::Rules) -> Result<(), crate::seccomp::SeccompError> {
    r.allow(&[
        libc::SYS_read,
        libc::SYS_poll,
        libc::SYS_ppoll,
        libc::SYS_pread64,
    ]);
    crate::seccomp::allow_fd_flags(r)?;
    r.allow_values(libc::SYS_ioctl, 1, &crate::seccomp::ioctls::uffd_serve())?;
    Ok(())
}

#[cfg(test)]
pub(super) mod test_hooks {
    //! Access to the failure path for tests.
    use super::*;

    /// Runs `body` as the server thread runs its loop; returns (failed,
    /// failures counted).
    pub(crate) fn supervised(
        body: impl FnOnce() -> Result<(), String>,
        on_failure: FailureHandler,
    ) -> (bool, u64) {
        let shared = Shared::default();
        let failed = run_supervised(body, &shared, &on_failure);
        (failed, shared.failures.load(Ordering::Relaxed))
    }
}
