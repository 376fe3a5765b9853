//! Every bad snapshot input is refused with a clear error before anything
//! is mapped or run; snapshot requests a VM cannot honour are refused too.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::snap::Vm;
use common::{stderr, torpor, Scratch};
use torpor_vmm::control::{call, Request};

const LIMIT: Duration = Duration::from_secs(30);

/// A valid full snapshot of a small probe guest, shared by the cases.
fn template(dir: &Scratch) -> PathBuf {
    let vm = Vm::boot(
        dir,
        "source",
        &["--mem-mib", "32", "--cmdline", "probe.mib=1 probe.ticks=5"],
    );
    vm.wait_iter(2);
    vm.pause();
    let snap = dir.path("template");
    vm.snapshot(&snap, false);
    vm.shutdown();
    snap
}

/// Copies a snapshot directory so each case can damage its own.
fn copy_snapshot(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for f in ["state", "memory"] {
        std::fs::copy(src.join(f), dst.join(f)).unwrap();
    }
}

/// Restoring `snap` must fail with status 1, `needle` in the message, and
/// no console file (the guest never ran).
fn expect_refused(dir: &Scratch, snap: &Path, needle: &str) {
    let console = dir.path("refused.log");
    let _ = std::fs::remove_file(&console);
    let out = torpor(
        &[
            "vmm",
            "--no-jail",
            "--restore",
            snap.to_str().unwrap(),
            "--serial",
            console.to_str().unwrap(),
        ],
        LIMIT,
    );
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{snap:?}: {err}");
    assert!(err.contains(needle), "expected `{needle}` in:\n{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(!console.exists(), "the guest ran from a bad snapshot");
}

fn patch(path: &Path, f: impl FnOnce(&mut Vec<u8>)) {
    let mut bytes = std::fs::read(path).unwrap();
    f(&mut bytes);
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn bad_snapshots_are_refused_with_clear_errors() {
    let dir = Scratch::new("bad-snapshots");
    let good = template(&dir);
    let case = |name: &str| {
        let p = dir.path(name);
        copy_snapshot(&good, &p);
        p
    };

    expect_refused(&dir, &dir.path("does-not-exist"), "does-not-exist/state");

    let s = case("truncated");
    patch(&s.join("state"), |b| b.truncate(b.len() / 2));
    expect_refused(&dir, &s, "is truncated");

    let s = case("tiny");
    patch(&s.join("state"), |b| b.truncate(10));
    expect_refused(&dir, &s, "is truncated");

    let s = case("magic");
    patch(&s.join("state"), |b| b[0] = b'X');
    expect_refused(&dir, &s, "is not a torpor snapshot state file");

    let s = case("payload-crc");
    patch(&s.join("state"), |b| {
        let last = b.len() - 1;
        b[last] ^= 0xff;
    });
    expect_refused(&dir, &s, "payload CRC32");

    let s = case("header-crc");
    patch(&s.join("state"), |b| b[20] ^= 0x01);
    expect_refused(&dir, &s, "corrupt header");

    let s = case("newer-major");
    let newer = torpor_vmm::snapshot::FORMAT_MAJOR + 1;
    patch(&s.join("state"), |b| {
        b[8..10].copy_from_slice(&newer.to_le_bytes());
        let crc = crc32fast::hash(&b[..28]);
        b[28..32].copy_from_slice(&crc.to_le_bytes());
    });
    expect_refused(&dir, &s, &format!("format version {newer}.0"));

    let s = case("memory-short");
    patch(&s.join("memory"), |b| b.truncate(b.len() - 4096));
    expect_refused(&dir, &s, "but the snapshot's guest memory is");

    let s = case("memory-missing");
    std::fs::remove_file(s.join("memory")).unwrap();
    expect_refused(&dir, &s, "memory file");
}

#[test]
fn diff_with_a_missing_parent_is_refused() {
    let dir = Scratch::new("orphan-diff");
    let template = template(&dir);
    let vm = Vm::restore(&dir, "gen1", &template, "file", &[]);
    vm.wait_iter(4);
    vm.pause();
    let diff = dir.path("diff");
    vm.snapshot(&diff, true);
    vm.shutdown();
    std::fs::rename(&template, dir.path("moved")).unwrap();
    expect_refused(&dir, &diff, "template/state");
}

#[test]
fn snapshot_requests_the_vm_cannot_honour() {
    let dir = Scratch::new("snapshot-refusals");
    let vm = Vm::boot(&dir, "vm", &["--mem-mib", "32", "--cmdline", "probe.mib=1"]);
    let t = Duration::from_secs(30);
    let snap = |diff| Request::Snapshot {
        path: dir.path("s"),
        diff,
    };
    let err = call(&vm.socket, &snap(false), t).unwrap_err().to_string();
    assert!(err.contains("must be paused"), "{err}");
    vm.pause();
    let err = call(&vm.socket, &snap(true), t).unwrap_err().to_string();
    assert!(err.contains("needs a base"), "{err}");
    vm.snapshot(&dir.path("full"), false);
    // After a full snapshot, a diff on it is fine.
    let r = call(&vm.socket, &snap(true), t).unwrap();
    assert!(r.snapshot.unwrap().diff);
    vm.shutdown();
}

#[test]
fn snapshot_cli_reports_what_it_wrote() {
    let dir = Scratch::new("snapshot-cli");
    let vm = Vm::boot(&dir, "vm", &["--mem-mib", "32", "--cmdline", "probe.mib=1"]);
    let sock = vm.socket.to_str().unwrap().to_string();
    let out = torpor(&["vmm", "pause", "--socket", &sock], LIMIT);
    assert!(out.status.success());
    let snap = dir.path("cli-snap");
    let out = torpor(
        &[
            "vmm",
            "snapshot",
            "--socket",
            &sock,
            "--out",
            snap.to_str().unwrap(),
        ],
        LIMIT,
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["snapshot"]["diff"], false);
    assert!(v["snapshot"]["pages"].as_u64().unwrap() > 0);
    assert!(snap.join("state").exists() && snap.join("memory").exists());
    vm.shutdown();
}
