//! Page servers that install pages write-protected (uffd-wp dirty
//! tracking): pages served for reads, prefetched or holes are not reported
//! as written; pages written (including those a write fault asked for) are,
//! exactly once.

use super::minor_mode::{minor, minor_layers};
use super::*;
use crate::dirty::WpTracker;

fn written(tracker: &WpTracker) -> Vec<u64> {
    tracker.take_written().unwrap().iter_pages().collect()
}

/// Reads every probe page, writes three read pages (data, hole, data) and
/// one untouched hole (a write fault: installed writable), then checks the
/// tracker's view and the contents.
fn reports_only_written_pages(mem: &Mapping, server: &PageServer) {
    let tracker = WpTracker::attach(vec![(mem.addr, mem.len, 0)]).unwrap();
    let got = read_pages(mem, 0, &PROBE_PAGES);
    for (&p, v) in PROBE_PAGES.iter().zip(&got) {
        assert_eq!(*v, Some(Fixture::expected(p)), "page {p}");
    }
    assert_eq!(written(&tracker), Vec::<u64>::new(), "reads only");
    let addr = mem.addr;
    in_thread(move || {
        for p in [1usize, 7, 300, 1500] {
            write_word(addr + p * PS, 0xfeed);
        }
    });
    assert_eq!(written(&tracker), vec![1, 7, 300, 1500]);
    assert_eq!(written(&tracker), Vec::<u64>::new(), "protected again");
    // The written words landed on the served contents.
    let after = in_thread(move || {
        // SAFETY: inside `mem`, which outlives this thread.
        unsafe { std::ptr::read_volatile((addr + 1500 * PS + 8) as *const u64) }
    });
    assert_eq!(after, Fixture::expected(1500));
    assert_eq!(server.stats().failures, 0);
}

/// Then the pages the balloon would discard (MADV_DONTNEED), written ones
/// included: read back, they are served again from their layers and
/// clean; written, they are reported once, as any page.
fn discarded_pages_stay_tracked(mem: &Mapping, server: &PageServer) {
    let tracker = WpTracker::attach(vec![(mem.addr, mem.len, 0)]).unwrap();
    discard_pages(mem, &PROBE_PAGES);
    let got = read_pages(mem, 0, &PROBE_PAGES);
    for (&p, v) in PROBE_PAGES.iter().zip(&got) {
        assert_eq!(*v, Some(Fixture::expected(p)), "page {p}");
    }
    assert_eq!(written(&tracker), Vec::<u64>::new(), "reads only");
    let addr = mem.addr;
    in_thread(move || write_word(addr + 3 * PS, 0xfeed));
    assert_eq!(written(&tracker), vec![3]);
    assert_eq!(server.stats().failures, 0);
}

#[test]
pub(super) fn missing_mode_installs_pages_protected() {
    let fx = Fixture::new();
    let mem = Mapping::anonymous(PAGES as usize * PS);
    let mut opts = missing(vec![], None);
    opts.write_protect = true;
    let (server, failures) = start(vec![mem.region(0)], fx.layers(), opts);
    reports_only_written_pages(&mem, &server);
    discarded_pages_stay_tracked(&mem, &server);
    assert!(failures.try_recv().is_err());
}

#[test]
pub(super) fn minor_mode_installs_pages_protected() {
    let fx = Fixture::new();
    let (base, layers) = minor_layers(&fx);
    let mem = Mapping::private_file(&base, PAGES as usize * PS, 0);
    let mut opts = minor(vec![]);
    opts.write_protect = true;
    let (server, failures) = start(vec![mem.region(0)], layers, opts);
    reports_only_written_pages(&mem, &server);
    discarded_pages_stay_tracked(&mem, &server);
    assert!(failures.try_recv().is_err());
}

#[test]
fn prefetched_pages_are_not_written() {
    let fx = Fixture::new();
    let mem = Mapping::anonymous(PAGES as usize * PS);
    let mut opts = missing((0..64).collect(), None);
    opts.write_protect = true;
    let (server, _failures) = start(vec![mem.region(0)], fx.layers(), opts);
    stats_when(&server, |s| s.prefetch_done);
    let tracker = WpTracker::attach(vec![(mem.addr, mem.len, 0)]).unwrap();
    assert!(server.stats().prefetched >= 64);
    assert_eq!(written(&tracker), Vec::<u64>::new());
    let addr = mem.addr;
    in_thread(move || write_word(addr + 5 * PS, 1));
    assert_eq!(written(&tracker), vec![5]);
}
