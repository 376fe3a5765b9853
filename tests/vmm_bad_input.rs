//! Every bad input to `torpor vmm` ends with a clear message and exit
//! status 1 (2 for usage errors), never a panic or a hang.

mod common;

use std::time::Duration;

use common::{stderr, torpor, Scratch};

const LIMIT: Duration = Duration::from_secs(20);

/// Runs `torpor vmm ARGS`, expecting failure with `status` and `needle` in stderr.
fn expect_error(args: &[&str], status: i32, needle: &str) {
    let mut full = vec!["vmm", "--no-jail"];
    full.extend_from_slice(args);
    let out = torpor(&full, LIMIT);
    let err = stderr(&out);
    assert_eq!(
        out.status.code(),
        Some(status),
        "args {args:?}, stderr:\n{err}"
    );
    assert!(
        err.contains(needle),
        "args {args:?}: expected `{needle}` in stderr:\n{err}"
    );
    assert!(!err.contains("panicked"), "panic on {args:?}:\n{err}");
}

fn probe_elf(dir: &Scratch) -> String {
    let path = dir.path("probe.elf");
    let out = torpor(&["probe-image", "--out", path.to_str().unwrap()], LIMIT);
    assert!(out.status.success(), "{}", stderr(&out));
    path.to_str().unwrap().to_string()
}

#[test]
fn kernel_or_restore_is_required() {
    expect_error(
        &[],
        2,
        "required arguments were not provided:\n  --kernel <KERNEL>",
    );
}

#[test]
fn restore_and_kernel_conflict() {
    expect_error(
        &["--restore", "/tmp/x", "--kernel", "builtin:probe"],
        2,
        "'--restore <RESTORE>' cannot be used with '--kernel <KERNEL>'",
    );
}

#[test]
fn snapshot_backends_need_restore() {
    expect_error(
        &["--kernel", "builtin:probe", "--memory-backend", "uffd"],
        2,
        "use it with --restore",
    );
}

#[test]
fn missing_kernel() {
    expect_error(
        &["--kernel", "/nonexistent/vmlinux"],
        1,
        "cannot open kernel /nonexistent/vmlinux",
    );
}

#[test]
fn empty_kernel() {
    let dir = Scratch::new("empty-kernel");
    let k = dir.path("empty");
    std::fs::write(&k, b"").unwrap();
    expect_error(&["--kernel", k.to_str().unwrap()], 1, "is empty");
}

#[test]
fn kernel_that_is_not_elf_or_bzimage() {
    let dir = Scratch::new("foreign-kernel");
    let k = dir.path("notakernel");
    std::fs::write(&k, vec![0x5a; 64 * 1024]).unwrap();
    expect_error(
        &["--kernel", k.to_str().unwrap()],
        1,
        "neither an ELF vmlinux nor a bzImage",
    );
}

#[test]
fn truncated_kernel() {
    let dir = Scratch::new("truncated-kernel");
    let full = std::fs::read(probe_elf(&dir)).unwrap();
    let k = dir.path("truncated.elf");
    // Keep the ELF and program headers, cut the loadable contents.
    std::fs::write(&k, &full[..full.len().min(600)]).unwrap();
    expect_error(
        &["--kernel", k.to_str().unwrap()],
        1,
        "truncated or corrupt",
    );
}

#[test]
fn unknown_builtin_kernel() {
    expect_error(
        &["--kernel", "builtin:nope"],
        1,
        "unknown built-in kernel `nope`",
    );
}

#[test]
fn zero_memory() {
    expect_error(
        &["--kernel", "builtin:probe", "--mem-mib", "0"],
        1,
        "at least 16 MiB, got 0 MiB",
    );
}

#[test]
fn memory_larger_than_host() {
    expect_error(
        &["--kernel", "builtin:probe", "--mem-mib", "100000000"],
        1,
        "larger than this host's",
    );
}

#[test]
fn zero_vcpus() {
    expect_error(
        &["--kernel", "builtin:probe", "--vcpus", "0"],
        1,
        "at least one vCPU",
    );
}

#[test]
fn more_vcpus_than_kvm_allows() {
    expect_error(
        &["--kernel", "builtin:probe", "--vcpus", "5000"],
        1,
        "5000 vCPUs requested but at most",
    );
}

#[test]
fn non_numeric_memory_is_a_usage_error() {
    expect_error(
        &["--kernel", "builtin:probe", "--mem-mib", "lots"],
        2,
        "invalid value 'lots'",
    );
}

#[test]
fn unreadable_initrd() {
    expect_error(
        &[
            "--kernel",
            "builtin:probe",
            "--initrd",
            "/nonexistent/initrd.img",
        ],
        1,
        "cannot read initrd /nonexistent/initrd.img",
    );
}

#[test]
fn command_line_too_long() {
    let long = "x".repeat(5000);
    expect_error(
        &["--kernel", "builtin:probe", "--cmdline", &long],
        1,
        // The launch spec's own bound, checked by `torpor-vmm` as for a
        // pod's VMMs.
        "the command line is longer than 4096 bytes",
    );
}

#[test]
fn control_socket_in_use() {
    let dir = Scratch::new("socket-in-use");
    let sock = dir.path("ctl.sock");
    let _held = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    expect_error(
        &[
            "--kernel",
            "builtin:probe",
            "--control-socket",
            sock.to_str().unwrap(),
        ],
        1,
        "is already in use",
    );
}

#[test]
fn control_request_to_a_missing_socket() {
    let out = torpor(
        &["vmm", "status", "--socket", "/nonexistent/ctl.sock"],
        LIMIT,
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("cannot connect to control socket /nonexistent/ctl.sock"));
}
