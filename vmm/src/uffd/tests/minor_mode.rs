//! Minor mode ("uffd-shared"): shared template pages, private diffs.

use super::*;

/// A shmem template with the fixture's base content, and the fixture's diffs.
pub(super) fn minor_layers(fx: &Fixture) -> (File, Layers) {
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

pub(super) fn minor(prefetch: Vec<u64>) -> ServerOptions {
    ServerOptions {
        mode: Mode::Minor,
        prefetch,
        record_for: None,
        write_protect: false,
        install_first: Vec::new(),
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
pub(super) fn minor_mode_shares_base_pages_and_privatises_the_rest() {
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
pub(super) fn minor_mode_prefetch() {
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
    // scripts/test leaves this out on a host without /dev/shm.
    let shm_dir = PathBuf::from("/dev/shm");
    assert!(shm_dir.is_dir(), "no /dev/shm (a tmpfs) on this host");
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
