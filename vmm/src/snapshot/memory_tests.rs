//! Tests of memory files: sparseness, diff layers, layout, errors.

use super::*;
use crate::snapshot::TestDir;

const MIB: usize = 1 << 20;

/// Fills page `p` of `buf` with a pattern that depends on `p` (never zero).
fn fill_page(buf: &mut [u8], p: usize) {
    for (i, b) in buf[p * PAGE..(p + 1) * PAGE].iter_mut().enumerate() {
        *b = (p as u8).wrapping_mul(31) ^ (i as u8) | 1;
    }
}

fn concat(regions: &[&[u8]]) -> Vec<u8> {
    regions.concat()
}

#[test]
fn is_zero_sees_any_single_non_zero_byte() {
    let mut page = vec![0u8; PAGE + 7]; // odd length exercises the remainder
    assert!(is_zero(&page));
    for i in 0..page.len() {
        page[i] = 0x80;
        assert!(!is_zero(&page), "byte {i}");
        page[i] = 0;
    }
    assert!(is_zero(&[]));
}

#[test]
fn full_memory_is_sparse_and_round_trips() {
    let dir = TestDir::new("mem-full");
    let path = dir.path("memory");
    // 64 MiB as two regions, 3 non-zero pages (one on each side of the
    // region boundary, one in the middle).
    let mut low = vec![0u8; 48 * MIB];
    let mut high = vec![0u8; 16 * MIB];
    let last_low = low.len() / PAGE - 1;
    fill_page(&mut low, 1234);
    fill_page(&mut low, last_low);
    fill_page(&mut high, 0);
    let regions: [&[u8]; 2] = [&low, &high];
    let info = write_full_memory(&path, &regions).unwrap();

    assert_eq!(info.len_bytes, 64 * MIB as u64);
    assert_eq!(info.data_pages, 3);
    assert_eq!(info.written_bytes, 3 * PAGE_SIZE);
    // Adjacent in the file but in different regions: two writes, not one.
    assert_eq!(info.write_calls, 3);
    assert!(info.allocated_bytes >= 3 * PAGE_SIZE, "{info:?}");
    assert!(info.allocated_bytes < MIB as u64, "{info:?}");
    assert_eq!(std::fs::read(&path).unwrap(), concat(&regions));
    assert_eq!(dir.entries(), vec!["memory".to_string()]);

    let file = check_memory_file(&path, info.len_bytes).unwrap();
    let mut page = [0u8; PAGE];
    read_page(&file, 1234, &mut page).unwrap();
    assert_eq!(&page[..], &low[1234 * PAGE..1235 * PAGE]);
    read_page(&file, 5, &mut page).unwrap();
    assert!(is_zero(&page));
    let boundary = last_low as u64;
    let mut two = vec![0u8; 2 * PAGE];
    read_pages(&file, boundary, &mut two).unwrap();
    assert_eq!(&two[..PAGE], &low[last_low * PAGE..]);
    assert_eq!(&two[PAGE..], &high[..PAGE]);
    let past_end = info.len_bytes / PAGE_SIZE;
    assert!(read_page(&file, past_end, &mut page).is_err());
    assert!(read_pages(&file, 0, &mut [0u8; 100]).is_err());
}

#[test]
fn adjacent_data_pages_are_one_write() {
    let dir = TestDir::new("mem-coalesce");
    let path = dir.path("memory");
    let mut ram = vec![0u8; 64 * PAGE];
    for p in [3, 4, 5, 6, 10, 63] {
        fill_page(&mut ram, p);
    }
    let info = write_full_memory(&path, &[&ram]).unwrap();
    assert_eq!((info.data_pages, info.write_calls), (6, 3));
    assert_eq!(std::fs::read(&path).unwrap(), ram);
}

#[test]
fn diff_layer_holds_only_listed_pages() {
    let dir = TestDir::new("mem-diff");
    let path = dir.path("memory");
    let pages_total = 64 * MIB / PAGE;
    // Every page has data, so anything written beyond the list would show.
    let mut ram = vec![0u8; 64 * MIB];
    for p in 0..pages_total {
        fill_page(&mut ram, p);
    }
    // 1% of pages: every 100th, plus a run of 8 adjacent pages.
    let listed: Vec<u64> = (0..pages_total as u64)
        .step_by(100)
        .chain(5000..5008)
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    // One listed page that is all zero: listed, but left a hole.
    let zero_page = 300usize;
    ram[zero_page * PAGE..(zero_page + 1) * PAGE].fill(0);
    let runs = PageRuns::from_sorted_pages(listed.iter().copied());
    let (low, high) = ram.split_at(32 * MIB);
    let info = write_memory_pages(&path, &[low, high], &runs).unwrap();

    let n = runs.page_count();
    assert_eq!(info.len_bytes, 64 * MIB as u64);
    assert_eq!(info.data_pages, n - 1);
    assert_eq!(info.written_bytes, (n - 1) * PAGE_SIZE);
    let data = info.written_bytes;
    assert!(
        info.allocated_bytes >= data && info.allocated_bytes <= data + data / 4 + 64 * 1024,
        "{n} pages listed, {info:?}"
    );

    let file = check_memory_file(&path, 64 * MIB as u64).unwrap();
    let mut page = [0u8; PAGE];
    for p in 0..pages_total as u64 {
        read_page(&file, p, &mut page).unwrap();
        let src = &ram[p as usize * PAGE..(p as usize + 1) * PAGE];
        if runs.contains(p) {
            assert_eq!(&page[..], src, "listed page {p}");
        } else {
            assert!(is_zero(&page), "unlisted page {p} was written");
        }
    }
}

#[test]
fn diff_pages_beyond_guest_memory_are_refused() {
    let dir = TestDir::new("mem-range");
    let path = dir.path("memory");
    let ram = vec![1u8; 16 * PAGE];
    for runs in [
        PageRuns::from_sorted_pages([2, 16]),
        PageRuns::from_sorted_pages([u64::MAX - 1]),
    ] {
        let err = write_memory_pages(&path, &[&ram], &runs).unwrap_err();
        assert!(
            matches!(
                err,
                SnapshotError::PageOutOfRange {
                    total_pages: 16,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("memory"), "{err}");
    }
    assert!(dir.entries().is_empty(), "{:?}", dir.entries());
    // The last page itself is fine.
    let runs = PageRuns::from_sorted_pages([15]);
    let info = write_memory_pages(&path, &[&ram], &runs).unwrap();
    assert_eq!(info.data_pages, 1);
}

#[test]
fn unaligned_region_is_refused() {
    let dir = TestDir::new("mem-unaligned");
    let path = dir.path("memory");
    let a = vec![0u8; PAGE];
    let b = vec![0u8; PAGE + 1];
    let err = write_full_memory(&path, &[&a, &b]).unwrap_err();
    assert!(
        matches!(err, SnapshotError::UnalignedRegion { index: 1, len, .. } if len == PAGE as u64 + 1),
        "{err}"
    );
    assert!(dir.entries().is_empty());
}

#[test]
fn rewrite_replaces_the_file_and_leaves_no_temp() {
    let dir = TestDir::new("mem-rewrite");
    let path = dir.path("memory");
    let mut ram = vec![0u8; 8 * PAGE];
    fill_page(&mut ram, 1);
    write_full_memory(&path, &[&ram]).unwrap();
    ram.fill(0);
    fill_page(&mut ram, 6);
    let info = write_full_memory(&path, &[&ram]).unwrap();
    assert_eq!(info.data_pages, 1);
    // Page 1 from the first write must not survive: a fresh file, not an
    // overwrite in place.
    assert_eq!(std::fs::read(&path).unwrap(), ram);
    assert_eq!(dir.entries(), vec!["memory".to_string()]);
}

#[test]
fn empty_guest_gives_empty_file() {
    let dir = TestDir::new("mem-empty");
    let path = dir.path("memory");
    let info = write_full_memory(&path, &[]).unwrap();
    assert_eq!(info.len_bytes, 0);
    check_memory_file(&path, 0).unwrap();
}

#[test]
fn check_memory_file_errors() {
    let dir = TestDir::new("mem-check");
    let path = dir.path("memory");
    let err = check_memory_file(&path, 4096).unwrap_err();
    assert!(
        matches!(err, SnapshotError::MemoryFileMissing { .. }),
        "{err}"
    );
    assert!(err.to_string().contains(&*path.to_string_lossy()), "{err}");

    std::fs::write(&path, vec![0u8; 8192]).unwrap();
    let err = check_memory_file(&path, 4096).unwrap_err();
    let SnapshotError::MemoryFileSize {
        expected, actual, ..
    } = err
    else {
        panic!("{err}");
    };
    assert_eq!((expected, actual), (4096, 8192));
    assert!(check_memory_file(&path, 8192).is_ok());
}

/// Timing, not a check: run with
/// `cargo test --release -p torpor-vmm snapshot::memory::tests::timing -- --ignored --nocapture`.
#[test]
#[ignore]
fn timing_full_memory_1gib_10_percent() {
    let dir = TestDir::new("mem-timing");
    let path = dir.path("memory");
    let pages = (1usize << 30) / PAGE;
    let mut ram = vec![0u8; 1 << 30];
    // Touch every page so zero pages are real RAM, not the shared zero page.
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for p in 0..pages {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        if x.is_multiple_of(10) {
            fill_page(&mut ram, p);
        } else {
            std::hint::black_box(&mut ram[p * PAGE..(p + 1) * PAGE]).fill(0);
        }
    }
    let t = std::time::Instant::now();
    let zero = ram.chunks_exact(PAGE).filter(|p| is_zero(p)).count();
    let scan = t.elapsed();
    let t = std::time::Instant::now();
    let info = write_full_memory(&path, &[&ram]).unwrap();
    let total = t.elapsed();
    eprintln!(
        "1 GiB, {} data pages ({:.1}%): zero scan alone {:?} ({:.1} GiB/s); \
         write_full_memory {:?} ({} writes, {} MiB allocated)",
        info.data_pages,
        info.data_pages as f64 * 100.0 / pages as f64,
        scan,
        1.0 / scan.as_secs_f64(),
        total,
        info.write_calls,
        info.allocated_bytes >> 20
    );
    assert_eq!(zero as u64 + info.data_pages, pages as u64);

    // Where the time goes: scan + pwrite into the page cache, then fsync.
    let raw = dir.path("raw");
    let file = std::fs::File::create_new(&raw).unwrap();
    let regions: [&[u8]; 1] = [&ram];
    let layout = Layout::new(&raw, &regions).unwrap();
    let t = std::time::Instant::now();
    file.set_len(1 << 30).unwrap();
    let mut raw_info = MemoryFileInfo::default();
    layout
        .write_range(&file, 0, pages as u64, &mut raw_info)
        .unwrap();
    let written = t.elapsed();
    let t = std::time::Instant::now();
    file.sync_all().unwrap();
    eprintln!(
        "breakdown: scan + pwrite {:?}, fsync {:?}",
        written,
        t.elapsed()
    );
}

/// A full snapshot reads every page of guest RAM. A page that cannot be
/// read (here past the end of the file it maps; in a pod a hole of a
/// memory file on a full tmpfs) used to fault with SIGBUS on the control
/// thread, and the VMM died (of SIGSYS, as std's fault handler broke the
/// thread's filter). The pages are read in first: the snapshot fails with
/// a `no_space` error (507 in the API), under the control thread's own
/// filter, and leaves no file behind.
#[test]
fn an_unreadable_page_fails_a_full_snapshot_under_the_control_filter() {
    use crate::seccomp::tests::{confined_child, run_in_confined_child};
    if !confined_child() {
        run_in_confined_child(
            "snapshot::memory::tests::an_unreadable_page_fails_a_full_snapshot_under_the_control_filter",
        );
        return;
    }
    const PAGES: usize = 16;
    let dir = TestDir::new("mem-unreadable");
    // 16 pages of data, then the file is cut to 8: the mapping's last 8
    // pages are past its end.
    let backing = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(dir.path("guest-ram"))
        .unwrap();
    let mut data = vec![0u8; PAGES * PAGE];
    for p in 0..PAGES {
        fill_page(&mut data, p);
    }
    backing.write_all_at(&data, 0).unwrap();
    use std::os::fd::AsRawFd;
    // SAFETY: a new private read-only mapping of the file's 16 pages,
    // unmapped below; nothing else maps it.
    let ram = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            PAGES * PAGE,
            libc::PROT_READ,
            libc::MAP_PRIVATE,
            backing.as_raw_fd(),
            0,
        )
    };
    assert_ne!(ram, libc::MAP_FAILED);
    backing.set_len((PAGES / 2 * PAGE) as u64).unwrap();
    let path = dir.path("memory");
    let address = ram as usize;
    let result = std::thread::spawn({
        let path = path.clone();
        move || {
            crate::seccomp::enter(crate::seccomp::ThreadKind::Control);
            // SAFETY: the mapping lives until after this thread is joined.
            let region = unsafe { std::slice::from_raw_parts(address as *const u8, PAGES * PAGE) };
            write_full_memory(&path, &[region]).map_err(|e| (e.vm_error(), e.to_string()))
        }
    })
    .join()
    .expect("the snapshot thread ended without a fault");
    // SAFETY: the mapping made above; no slice of it is alive.
    unsafe { libc::munmap(ram, PAGES * PAGE) };
    let (error, message) = result.expect_err("a full snapshot of unreadable memory must fail");
    assert_eq!(error.kind, torpor_vmm_api::ErrorKind::NoSpace, "{message}");
    assert!(message.contains("cannot be read"), "{message}");
    assert_eq!(dir.entries(), vec!["guest-ram".to_string()]);
}
