//! Snapshot and restore of the probe guest on this host's KVM: the restored
//! guest continues the exact checksum sequence, with every memory backend,
//! from full and diff snapshots, for many clones at once and several vCPUs.

mod common;

use common::snap::{assert_exact_sequence, Vm};
use common::Scratch;

const MIB: u32 = 2;
const PROBE: &str = "probe.mib=2 probe.ticks=5";

fn probe_args(mem: &'static str) -> Vec<&'static str> {
    vec!["--mem-mib", mem, "--cmdline", PROBE]
}

/// Boots, runs a few iterations, pauses and takes a full snapshot. Returns
/// the last iteration the source printed.
fn make_template(dir: &Scratch, extra: &[&str]) -> (std::path::PathBuf, u64) {
    let mut args = probe_args("64");
    args.extend_from_slice(extra);
    let vm = Vm::boot(dir, "source", &args);
    vm.wait_iter(4);
    vm.pause();
    let snap = dir.path("template");
    let r = vm.snapshot(&snap, false);
    assert!(!r.snapshot.unwrap().diff);
    let seen = vm.iterations();
    assert_exact_sequence(&seen, MIB);
    vm.shutdown();
    (snap, seen.last().unwrap().0)
}

fn restore_continues(backend: &str) {
    let dir = Scratch::new(&format!("restore-{backend}"));
    let (snap, last) = make_template(&dir, &[]);
    let vm = Vm::restore(&dir, "clone", &snap, backend, &[]);
    vm.wait_iter(last + 4);
    let seen = vm.iterations();
    assert_eq!(
        seen[0].0,
        last + 1,
        "restore did not continue where the snapshot stopped"
    );
    assert_exact_sequence(&seen, MIB);
    let console = vm.console();
    let id = console
        .lines()
        .find_map(torpor_probe::parse_identity_line)
        .expect("identity line after restore");
    assert_eq!(id.gen, Some(1), "{console}");
    let status = vm.status();
    assert_eq!(status.generation, 1);
    assert_eq!(status.memory_backend, backend);
    vm.shutdown();
}

#[test]
fn restore_continues_exact_sequence_file_backend() {
    restore_continues("file");
}

#[test]
fn restore_continues_exact_sequence_uffd_backend() {
    restore_continues("uffd");
}

#[test]
fn restore_continues_exact_sequence_uffd_shared_backend() {
    restore_continues("uffd-shared");
}

fn diff_chain(backend: &str) {
    let dir = Scratch::new(&format!("diff-{backend}"));
    let (template, template_last) = make_template(&dir, &[]);
    // Restore, run on, and hibernate to a diff on the template.
    let vm = Vm::restore(&dir, "gen1", &template, backend, &[]);
    vm.wait_iter(template_last + 3);
    vm.pause();
    let diff1 = dir.path("diff1");
    let info = vm.snapshot(&diff1, true).snapshot.unwrap();
    assert!(info.diff);
    // The probe dirties its 2 MiB workload (512 pages) plus a few pages of
    // stack and data: the diff holds about that, not the 64 MiB guest.
    assert!(
        info.pages >= 512 && info.pages < 700,
        "diff pages {}",
        info.pages
    );
    assert!(
        info.memory_allocated_bytes < 4 << 20,
        "diff size {}",
        info.memory_allocated_bytes
    );
    let last1 = vm.iterations().last().unwrap().0;
    vm.shutdown();

    // Restore the diff (template + diff1), run, and diff again on diff1.
    let vm = Vm::restore(&dir, "gen2", &diff1, backend, &[]);
    vm.assert_continues(last1, 3, MIB);
    assert_eq!(vm.status().generation, 2);
    vm.pause();
    let diff2 = dir.path("diff2");
    vm.snapshot(&diff2, true);
    let last2 = vm.iterations().last().unwrap().0;
    vm.shutdown();

    // A three-layer chain: template ← diff1 ← diff2.
    let vm = Vm::restore(&dir, "gen3", &diff2, backend, &[]);
    vm.assert_continues(last2, 2, MIB);
    assert_eq!(vm.status().generation, 3);
    vm.shutdown();
}

#[test]
fn diff_chain_restores_exactly_file_backend() {
    diff_chain("file");
}

#[test]
fn diff_chain_restores_exactly_uffd_backend() {
    diff_chain("uffd");
}

#[test]
fn diff_chain_restores_exactly_uffd_shared_backend() {
    diff_chain("uffd-shared");
}

fn twenty_clones(backend: &str) {
    let dir = Scratch::new(&format!("clones-{backend}"));
    let (template, last) = make_template(&dir, &[]);
    let clones: Vec<Vm> = (0..20)
        .map(|i| Vm::restore(&dir, &format!("clone{i}"), &template, backend, &[]))
        .collect();
    let mut seeds = std::collections::HashSet::new();
    for vm in &clones {
        vm.assert_continues(last, 2, MIB);
        let id = vm
            .console()
            .lines()
            .find_map(torpor_probe::parse_identity_line)
            .expect("identity line");
        assert_eq!(id.gen, Some(1));
        seeds.insert(id.seed);
        // `torpor vmm` became the small per-VM binary a pod starts, not a
        // VMM inside the CLI.
        let pid = vm.vmm.0.as_ref().unwrap().id();
        let exe = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap();
        assert_eq!(exe.file_name().unwrap(), "torpor-vmm", "{}", exe.display());
    }
    assert_eq!(seeds.len(), 20, "clones must get distinct identity seeds");
    for vm in clones {
        vm.shutdown();
    }
}

#[test]
fn twenty_clones_from_one_template_file_backend() {
    twenty_clones("file");
}

#[test]
fn twenty_clones_from_one_template_uffd_backend() {
    twenty_clones("uffd");
}

#[test]
fn snapshot_and_restore_with_four_vcpus() {
    let dir = Scratch::new("four-vcpus");
    let (template, last) = make_template(&dir, &["--vcpus", "4"]);
    let vm = Vm::restore(&dir, "clone", &template, "file", &[]);
    assert_eq!(vm.status().vcpus, 4);
    vm.assert_continues(last, 3, MIB);
    vm.shutdown();
}

#[test]
fn guest_clock_does_not_run_backwards_after_restore() {
    let dir = Scratch::new("clock");
    let vm = Vm::boot(&dir, "source", &probe_args("64"));
    vm.wait_iter(3);
    vm.pause();
    let at_snapshot = vm.status().guest_clock_ns.expect("guest clock");
    let snap = dir.path("snap");
    vm.snapshot(&snap, false);
    vm.shutdown();
    let clone = Vm::restore(&dir, "clone", &snap, "file", &["--paused"]);
    let after = clone.status().guest_clock_ns.expect("guest clock");
    assert!(
        after >= at_snapshot,
        "guest clock went from {at_snapshot} back to {after}"
    );
    clone.resume();
    clone.wait_iter(5);
    clone.shutdown();
}

#[test]
fn paused_restore_waits_for_resume() {
    let dir = Scratch::new("paused-restore");
    let (template, last) = make_template(&dir, &[]);
    let vm = Vm::restore(&dir, "clone", &template, "file", &["--paused"]);
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(vm.iterations().is_empty(), "ran while paused");
    assert_eq!(vm.status().state, torpor_vmm::control::VmState::Paused);
    vm.resume();
    vm.wait_iter(last + 2);
    vm.shutdown();
}

#[test]
fn twenty_clones_from_one_template_uffd_shared_backend() {
    twenty_clones("uffd-shared");
}

#[test]
fn working_set_is_recorded_and_prefetched() {
    let dir = Scratch::new("working-set");
    let (template, last) = make_template(&dir, &[]);
    let recorder = Vm::restore(
        &dir,
        "recorder",
        &template,
        "uffd",
        &["--record-working-set-ms", "300"],
    );
    recorder.wait_iter(last + 2);
    let ws = template.join("working-set");
    common::wait_for(std::time::Duration::from_secs(10), || ws.exists());
    recorder.shutdown();
    let pages = std::fs::metadata(&ws).unwrap().len() / 8;
    // The probe touches its 2 MiB workload (512 pages) and a few more.
    assert!((512..1024).contains(&pages), "working set of {pages} pages");
    for backend in ["uffd", "uffd-shared"] {
        let vm = Vm::restore(
            &dir,
            &format!("prefetch-{backend}"),
            &template,
            backend,
            &["--prefetch"],
        );
        vm.assert_continues(last, 3, MIB);
        vm.shutdown();
    }
}

#[test]
fn a_failed_page_server_stops_the_vm_with_a_clear_error() {
    let dir = Scratch::new("page-server-failure");
    let (template, _) = make_template(&dir, &[]);
    let vm = Vm::restore(&dir, "victim", &template, "uffd", &["--paused"]);
    // Pages not yet served can no longer be read: the server must fail
    // loudly and the VM must stop, not hang on the fault.
    std::fs::OpenOptions::new()
        .write(true)
        .open(template.join("memory"))
        .unwrap()
        .set_len(0)
        .unwrap();
    vm.resume();
    let out = vm.vmm.wait(std::time::Duration::from_secs(30));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(err.contains("page server failed"), "{err}");
}

#[test]
fn virtio_devices_survive_snapshot_and_restore() {
    // The probe does not drive virtio, but the VMM must build, save and
    // restore the devices around it: a disk with a private overlay per
    // clone, and a vsock socket per clone.
    let dir = Scratch::new("virtio-devices");
    let image = dir.path("disk.img");
    std::fs::write(&image, vec![0xabu8; 1 << 20]).unwrap();
    let (disk, overlay, uds) = (
        image.to_str().unwrap(),
        dir.path("src.overlay"),
        dir.path("src.vsock"),
    );
    let (template, last) = make_template(
        &dir,
        &[
            "--disk",
            disk,
            "--disk-overlay",
            overlay.to_str().unwrap(),
            "--vsock-uds",
            uds.to_str().unwrap(),
        ],
    );
    assert!(
        template.join("disk0.overlay").exists(),
        "the snapshot froze the overlay"
    );
    // A clone needs its own overlay: refused without one.
    let out = common::torpor(
        &[
            "vmm",
            "--no-jail",
            "--restore",
            template.to_str().unwrap(),
            "--no-serial",
        ],
        std::time::Duration::from_secs(30),
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(
        common::stderr(&out).contains("--disk-overlay"),
        "{}",
        common::stderr(&out)
    );
    let (c_overlay, c_uds) = (dir.path("clone.overlay"), dir.path("clone.vsock"));
    let vm = Vm::restore(
        &dir,
        "clone",
        &template,
        "file",
        &[
            "--disk-overlay",
            c_overlay.to_str().unwrap(),
            "--vsock-uds",
            c_uds.to_str().unwrap(),
        ],
    );
    vm.wait_iter(last + 2);
    assert_exact_sequence(&vm.iterations(), MIB);
    assert!(c_overlay.exists(), "the clone got its own overlay");
    assert!(
        std::os::unix::net::UnixStream::connect(&c_uds).is_ok(),
        "the clone's vsock socket answers"
    );
    assert_eq!(
        std::fs::read(&image).unwrap(),
        vec![0xabu8; 1 << 20],
        "the base image is untouched"
    );
    vm.shutdown();
}
