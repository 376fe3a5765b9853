//! What the Linux-guest tests and the Linux benchmark share: the built
//! guest pieces (kernel, agent, a fresh rootfs) and a nested host carrying
//! them with the torpor binary. Included by path from `tests/` and
//! `benches/`, and by the root crate's nested pod test.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use torpor_nested::{NestedHost, RunOutput};
use torpor_sync::Locked;

/// The checkout: the nearest directory above the including crate's
/// manifest that holds `scripts/`.
pub fn repo() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest
        .ancestors()
        .find(|d| d.join("scripts/nested-host").is_file())
        .expect("the checkout's scripts/ above the crate")
        .to_path_buf()
}

/// Runs a repository script that prints a path last (instant when cached);
/// that path, which must exist.
pub fn script_path(script: &str, args: &[&str]) -> PathBuf {
    let out = Command::new(repo().join("scripts").join(script))
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run scripts/{script}: {e}"));
    assert!(
        out.status.success(),
        "scripts/{script} failed; run it by hand to see why:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let path = String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .unwrap_or("")
        .trim()
        .to_string();
    let path = PathBuf::from(path);
    assert!(
        path.exists(),
        "scripts/{script} printed no path: {}",
        path.display()
    );
    path
}

/// Runs a build script that prints the path of the file it built.
pub fn built(script: &str, args: &[&str]) -> PathBuf {
    let path = script_path(script, args);
    assert!(
        path.is_file(),
        "scripts/{script} printed no file: {}",
        path.display()
    );
    path
}

/// `TORPOR_BIN`, else the torpor binary cargo built beside this test or
/// bench (they live in target/<profile>/deps/, the binary in
/// target/<profile>/).
pub fn torpor_binary() -> PathBuf {
    if let Some(bin) = std::env::var_os("TORPOR_BIN") {
        return PathBuf::from(bin);
    }
    let exe = std::env::current_exe().expect("current_exe");
    exe.parent()
        .and_then(|d| d.parent())
        .expect("target/<profile>/deps")
        .join("torpor")
}

/// `torpor-vmm` beside `torpor` (the per-VM process: `torpor serve`
/// starts it and `torpor vmm` execs it), on the host.
pub fn torpor_vmm_binary() -> PathBuf {
    torpor_binary().with_file_name("torpor-vmm")
}

/// The nested host carrying torpor (`/opt/torpor/torpor`, `torpor-vmm`
/// beside it), the guest kernel
/// (`/opt/torpor/vmlinux`), a fresh rootfs (`/opt/torpor/rootfs.ext4`) and
/// `extra` files (host path, L1 path).
pub fn linux_host(tag: &str, extra: &[(PathBuf, &str)]) -> (NestedHost, tempfile::TempDir) {
    linux_host_with(tag, extra, 3072, None)
}

/// [`linux_host`] with `memory_mib` of L1 memory and, given `overlay`, a
/// rootfs with that directory copied over it (`build-rootfs --overlay`).
pub fn linux_host_with(
    tag: &str,
    extra: &[(PathBuf, &str)],
    memory_mib: u32,
    overlay: Option<&Path>,
) -> (NestedHost, tempfile::TempDir) {
    let torpor = torpor_binary();
    assert!(
        torpor.is_file(),
        "the torpor binary is missing at {} (build it, or set TORPOR_BIN)",
        torpor.display()
    );
    let kernel = built("build-guest-kernel", &[]);
    let agent = built("build-agent", &[]);
    let scratch = tempfile::Builder::new()
        .prefix(&format!("torpor-nested-{tag}-"))
        .tempdir()
        .unwrap();
    let rootfs = scratch.path().join("rootfs.ext4");
    let mut build = Command::new(repo().join("scripts/build-rootfs"));
    build.args([
        "--agent",
        agent.to_str().unwrap(),
        "--out",
        rootfs.to_str().unwrap(),
    ]);
    if let Some(dir) = overlay {
        build.arg("--overlay").arg(dir);
    }
    let out = build.output().expect("run scripts/build-rootfs");
    assert!(
        out.status.success(),
        "scripts/build-rootfs failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let mut builder = NestedHost::builder()
        .memory_mib(memory_mib)
        .file(&torpor, "/opt/torpor/torpor")
        .file(torpor_vmm_binary(), "/opt/torpor/torpor-vmm")
        .file(&kernel, "/opt/torpor/vmlinux")
        .file(&rootfs, "/opt/torpor/rootfs.ext4");
    for (host, guest) in extra {
        builder = builder.file(host, *guest);
    }
    let host = builder.build().unwrap_or_else(|e| {
        panic!("the nested hardware-virtualization host is not available: {e}")
    });
    (host, scratch)
}

/// One L1 at a time in a test binary: each is QEMU/TCG with two busy vCPU
/// threads, and two of them on a 2-core host starve each other's kernels
/// into soft lockups (the harness then boots a fresh L1: slower than
/// waiting).
static ONE_L1: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Runs `script` in the nested host (boot included, within `timeout`) and
/// logs how long each part took.
pub fn run_logged(host: &NestedHost, what: &str, script: &str, timeout: Duration) -> RunOutput {
    let _one = ONE_L1.locked();
    let out = host
        .run(script, timeout)
        .unwrap_or_else(|e| panic!("nested run failed: {e}"));
    eprintln!(
        "{what}: L1 boot {:.1}s, script {:.1}s, total {:.1}s",
        out.boot.as_secs_f64(),
        out.script.as_secs_f64(),
        out.total.as_secs_f64()
    );
    out
}

/// Every byte value, then pseudo-random bytes up to `len` (no short period,
/// so a chunk put in the wrong place shows).
pub fn binary_content(len: usize) -> Vec<u8> {
    let mut data: Vec<u8> = (0..=255u8).collect();
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    while data.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        data.push((x >> 24) as u8);
    }
    data
}

/// The value after `key=` on the first line starting with `tag `.
pub fn field<'a>(out: &'a str, tag: &str, key: &str) -> Option<&'a str> {
    out.lines()
        .find(|l| l.starts_with(&format!("{tag} ")))?
        .split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{key}=")))
}

/// A tool of this host to carry into L1 (dynamically linked: its libraries
/// come along); `packages` names what installs it.
pub fn host_tool(name: &str, packages: &str) -> PathBuf {
    for dir in ["/usr/sbin", "/usr/bin", "/sbin", "/bin"] {
        let p = Path::new(dir).join(name);
        if p.is_file() {
            // The file itself: a symlink carried into L1 would point at
            // L1's own (busybox) file of that name.
            return std::fs::canonicalize(&p).unwrap_or(p);
        }
    }
    panic!("{name} is not installed on this host (apt-get install {packages})")
}
