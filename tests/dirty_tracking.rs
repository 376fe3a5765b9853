//! Diff snapshots with dirty pages from userfaultfd write-protection
//! (`--dirty-tracking uffd-wp`) on this host's KVM: the dirty set matches
//! KVM's dirty log for the same run (`both` reads the two side by side), and
//! a diff built from it restores into the exact probe sequence, with every
//! memory backend and after a cold boot.

mod common;

use common::snap::Vm;
use common::Scratch;
use torpor_vmm::control::SnapshotInfo;

const MIB: u32 = 2;
const PROBE: &str = "probe.mib=2 probe.ticks=5";
/// The probe's 2 MiB workload: every iteration writes all of it.
const WORKLOAD_PAGES: u64 = 512;
/// Pages uffd-wp may report that KVM's log does not (a page the VMM itself
/// wrote, e.g. the identity page after a restore, goes through the host
/// page tables only). Anything beyond a handful is a tracking bug.
const EXTRA_PAGES_BOUND: u64 = 4;

/// Boots (KVM dirty log), runs a few iterations, takes a full snapshot.
fn make_template(dir: &Scratch) -> (std::path::PathBuf, u64) {
    let vm = Vm::boot(dir, "source", &["--mem-mib", "64", "--cmdline", PROBE]);
    vm.wait_iter(4);
    vm.pause();
    let snap = dir.path("template");
    vm.snapshot(&snap, false);
    let last = vm.iterations().last().unwrap().0;
    vm.shutdown();
    (snap, last)
}

/// Checks a `both` diff: uffd-wp saw every page KVM saw, and little more.
fn assert_tracking_agrees(info: &SnapshotInfo) {
    assert_eq!(info.dirty_tracking, "both");
    let c = info
        .dirty_crosscheck
        .unwrap_or_else(|| panic!("no crosscheck in {info:?}"));
    eprintln!("crosscheck: {c:?}, diff pages {}", info.pages);
    // The workload was rewritten since the base: the comparison is not empty.
    assert!(c.kvm_pages >= WORKLOAD_PAGES, "{c:?}");
    assert_eq!(
        c.missed_by_uffd_wp, 0,
        "uffd-wp missed pages KVM saw dirtied: {c:?}"
    );
    assert!(c.only_in_uffd_wp <= EXTRA_PAGES_BOUND, "{c:?}");
    assert!(
        info.pages >= WORKLOAD_PAGES && info.pages < WORKLOAD_PAGES + 200,
        "{info:?}"
    );
}

fn uffd_wp_diffs_restore_exactly(backend: &str) {
    let dir = Scratch::new(&format!("wp-{backend}"));
    let (template, last0) = make_template(&dir);

    // Restore with both sources, run, and take a diff.
    let vm = Vm::restore(
        &dir,
        "gen1",
        &template,
        backend,
        &["--dirty-tracking", "both"],
    );
    assert_eq!(vm.status().dirty_tracking, "both");
    vm.wait_iter(last0 + 3);
    vm.pause();
    let diff1 = dir.path("diff1");
    let info = vm.snapshot(&diff1, true).snapshot.unwrap();
    assert_tracking_agrees(&info);
    let last1 = vm.iterations().last().unwrap().0;
    vm.shutdown();

    // Restore that diff with uffd-wp alone; it must continue exactly, and
    // its own uffd-wp diff must too (a three-layer chain).
    let vm = Vm::restore(
        &dir,
        "gen2",
        &diff1,
        backend,
        &["--dirty-tracking", "uffd-wp"],
    );
    vm.assert_continues(last1, 3, MIB);
    vm.pause();
    let diff2 = dir.path("diff2");
    let info = vm.snapshot(&diff2, true).snapshot.unwrap();
    assert_eq!(info.dirty_tracking, "uffd-wp");
    assert!(info.dirty_crosscheck.is_none());
    assert!(info.pages >= WORKLOAD_PAGES, "{info:?}");
    let last2 = vm.iterations().last().unwrap().0;
    vm.shutdown();

    let vm = Vm::restore(&dir, "gen3", &diff2, backend, &[]);
    vm.assert_continues(last2, 2, MIB);
    assert_eq!(vm.status().generation, 3);
    vm.shutdown();
}

#[test]
fn uffd_wp_diffs_restore_exactly_file_backend() {
    uffd_wp_diffs_restore_exactly("file");
}

#[test]
fn uffd_wp_diffs_restore_exactly_uffd_backend() {
    uffd_wp_diffs_restore_exactly("uffd");
}

#[test]
fn uffd_wp_diffs_restore_exactly_uffd_shared_backend() {
    uffd_wp_diffs_restore_exactly("uffd-shared");
}

/// A cold boot tracked with uffd-wp: full snapshot, run on, diff, and the
/// diff restores exactly. Several diffs in a row agree with KVM each time.
#[test]
fn uffd_wp_after_cold_boot() {
    let dir = Scratch::new("wp-boot");
    let vm = Vm::boot(
        &dir,
        "source",
        &[
            "--mem-mib",
            "64",
            "--cmdline",
            PROBE,
            "--dirty-tracking",
            "both",
        ],
    );
    vm.wait_iter(2);
    vm.pause();
    let base = dir.path("base");
    vm.snapshot(&base, false);
    let mut last_diff = base;
    for round in 0..3 {
        vm.resume();
        let n = vm.iterations().last().unwrap().0;
        vm.wait_iter(n + 2);
        vm.pause();
        let diff = dir.path(&format!("diff{round}"));
        let info = vm.snapshot(&diff, true).snapshot.unwrap();
        assert_tracking_agrees(&info);
        last_diff = diff;
    }
    let last = vm.iterations().last().unwrap().0;
    vm.shutdown();
    let vm = Vm::restore(&dir, "clone", &last_diff, "file", &[]);
    vm.assert_continues(last, 2, MIB);
    vm.shutdown();
}

/// A standby shell made for uffd-wp tracks its restored VM that way.
#[test]
fn standby_shell_keeps_its_dirty_tracking() {
    let dir = Scratch::new("wp-standby");
    let (template, last0) = make_template(&dir);
    let socket = dir.path("standby.sock");
    let console = dir.path("standby.log");
    let vmm = common::Vmm::spawn(&[
        "--standby",
        "--mem-mib",
        "64",
        "--control-socket",
        socket.to_str().unwrap(),
        "--dirty-tracking",
        "both",
    ]);
    let limit = common::snap::LIMIT;
    common::wait_for(limit, || {
        torpor_vmm::control::request(&socket, &torpor_vmm::control::Request::Status, limit).is_ok()
    });
    let request = torpor_vmm::control::Request::Restore {
        restore: torpor_vmm_api::RestoreSpec::new(
            template.clone(),
            torpor_vmm_api::MemoryBackend::Uffd,
        ),
        console: torpor_vmm_api::Console::file(console.clone()),
        paused: false,
    };
    let answer = torpor_vmm::control::call(&socket, &request, limit).unwrap();
    assert!(answer.ok, "{answer:?}");
    let vm = Vm {
        vmm,
        console,
        socket,
    };
    vm.wait_iter(last0 + 3);
    vm.pause();
    let info = vm.snapshot(&dir.path("diff"), true).snapshot.unwrap();
    assert_tracking_agrees(&info);
    vm.shutdown();
}
