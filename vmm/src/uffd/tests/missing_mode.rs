//! Missing mode: layers, prefetch, working sets, failures, start checks.

use super::*;

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
pub(super) fn missing_mode_serves_each_page_from_its_layer() {
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
pub(super) fn write_faults_install_the_page_then_the_write() {
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
pub(super) fn prefetch_and_faults_interleave() {
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
fn installed_pages_are_recorded_for_the_whole_run_once_each_in_order() {
    // Outside any record window (none, or one that has ended): every page
    // installed, the first time only, in the order first installed.
    let fx = Fixture::new();
    let mem = Mapping::anonymous(PAGES as usize * PS);
    let (server, _f) = start(vec![mem.region(0)], fx.layers(), missing(vec![], None));
    read_pages(&mem, 0, &[9, 3, 7, 3, 1000, 0, 9]);
    assert_eq!(server.installed(), vec![9, 3, 7, 1000, 0]);
    assert!(server.working_set().is_empty());
    drop(server);

    let mem = Mapping::anonymous(PAGES as usize * PS);
    let (server, _f) = start(
        vec![mem.region(0)],
        fx.layers(),
        missing(vec![], Some(Duration::from_millis(50))),
    );
    read_pages(&mem, 0, &[5, 1]);
    std::thread::sleep(Duration::from_millis(100));
    read_pages(&mem, 0, &[2, 5, 1500]);
    assert_eq!(server.working_set(), vec![1, 5]);
    assert_eq!(server.installed(), vec![5, 1, 2, 1500]);
    // A page the guest discards is served again, but keeps its place.
    discard_pages(&mem, &[1]);
    read_pages(&mem, 0, &[1, 4]);
    assert_eq!(server.installed(), vec![5, 1, 2, 1500, 4]);
    drop(server);

    // Pages the server installs itself (first, then the prefetch) are in
    // it too, in the order installed; a fault's page before them.
    let mem = Mapping::anonymous(PAGES as usize * PS);
    let mut opts = missing(vec![100, 101, 50], None);
    opts.install_first = vec![7];
    let (server, _f) = start(vec![mem.region(0)], fx.layers(), opts);
    wait_until("the prefetch", || server.stats().prefetch_done);
    read_pages(&mem, 0, &[3, 100]);
    assert_eq!(server.installed(), vec![7, 100, 101, 50, 3]);
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
pub(super) fn truncated_base_fails_loudly_and_stops_answering() {
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
pub(super) fn kernel_mode_faults_are_served() {
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

#[test]
fn pages_installed_by_start_need_no_fault() {
    let fx = Fixture::new();
    let mem = Mapping::anonymous(PAGES as usize * PS);
    let mut opts = missing(vec![], None);
    opts.install_first = vec![3, 7, 1_000_000];
    let (server, failures) = start(vec![mem.region(0)], fx.layers(), opts);
    // Installed before start returned: present now, and read without a fault.
    assert_eq!(mem.resident()[3..8], [true, false, false, false, true]);
    let s = server.stats();
    assert_eq!((s.prefetched, s.faults), (2, 0), "{s:?}");
    assert!(s.prefetch_done);
    assert_eq!(
        read_pages(&mem, 0, &[3, 7]),
        vec![Some(Fixture::expected(3)), Some(0)]
    );
    assert_eq!(server.stats().faults, 0);
    assert!(failures.try_recv().is_err());
}

#[test]
fn the_prefetch_leaves_out_chunks_not_arrived_and_faults_wait_for_them() {
    // A base still arriving in 16 KiB chunks, chunks 0 (pages 0-3) and 25
    // (pages 100-103) there: the prefetch installs their pages and leaves
    // page 50 (chunk 12) to fault in, rather than wait for it with faults
    // queued behind it; `install_first` pages wait for theirs.
    let fx = Fixture::new();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(torpor_vmm_api::lazy::LAZY_MAP_FILE);
    let len = PAGES * PS as u64;
    let deadline = Duration::from_secs(20);
    let mut pod =
        torpor_vmm_api::lazy::PodMap::create(&path, 4 * PS as u64, len, deadline).unwrap();
    pod.mark_present(0).unwrap();
    pod.mark_present(25).unwrap();
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    let map = torpor_vmm_api::lazy::VmmMap::open(&f, "map", len).unwrap();
    let layers = Layers::new(fx.base.handle(), vec![]).with_lazy_base(map);
    let mem = Mapping::anonymous(PAGES as usize * PS);
    let mut opts = missing(vec![0, 1, 2, 50, 100], None);
    opts.install_first = vec![1];
    let (server, failures) = start(vec![mem.region(0)], layers, opts);
    wait_until("the prefetch", || server.stats().prefetch_done);
    let resident = mem.resident();
    assert!(resident[0] && resident[1] && resident[2] && resident[100]);
    assert!(
        !resident[50],
        "a page whose chunk has not arrived was prefetched"
    );
    assert_eq!(server.installed(), vec![1, 0, 2, 100]);
    // Its fault waits for the chunk, then is served.
    let reader = std::thread::spawn({
        let addr = mem.addr + 50 * PS;
        move || read_page(addr)
    });
    std::thread::sleep(Duration::from_millis(50));
    assert!(!reader.is_finished());
    pod.mark_present(12).unwrap();
    assert_eq!(reader.join().unwrap(), Some(0));
    assert_eq!(server.installed(), vec![1, 0, 2, 100, 50]);
    assert!(failures.try_recv().is_err());
}
