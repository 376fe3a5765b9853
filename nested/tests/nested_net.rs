//! Sandbox networking end to end with real Linux guests,
//! under `torpor serve --sandbox-network` inside the nested host (one L1
//! boot for every scenario):
//!
//! - the guest fetches a file from an HTTP server the test runs beyond
//!   L1 (busybox httpd on 192.0.2.1, in a namespace of L1 routed through
//!   a veth: L1's own addresses are closed to guests) and the hash
//!   matches, and `pip download`s a package from a tiny package index
//!   served the same way;
//! - `allow_internet: false` blocks it; an `allow_out` CIDR re-opens
//!   exactly that address (its neighbour 192.0.2.2 stays closed);
//! - a guest HTTP server on an exposed port answers from L1, and a
//!   hibernated sandbox is woken by traffic to that port;
//! - three clones of one template, created at once, each reach a server
//!   on L1 itself opened with `serve --host-allow`, which tells them apart
//!   by their host-side addresses;
//! - the walls (issue 24): a clone whose policy allows the internet
//!   reaches neither a service of L1's on every address (a
//!   PostgreSQL-like port, on L1's outside address, its veth's host end,
//!   or the `--host-allow` address on another port), nor the API, nor
//!   another clone's address, nor 169.254.169.254 routed beyond L1, while
//!   the internet answers it;
//! - after `kill -9` of the service (and of one VMM) and a restart, and
//!   after the sandboxes are deleted, no namespaces, veths, nft rules or
//!   sets are left (counted).
//!
//! Needs the guest kernel, the agent and the rootfs like `nested_linux.rs`
//! (`scripts/setup test` builds them), the L1 kernel's netfilter modules
//! (`scripts/nested-host prepare`), and this host's `ip`, `nft`, `curl`
//! and `python3` (carried into L1 or making the test's package);
//! `TORPOR_SKIP_NESTED=1 scripts/test` leaves it out (the test itself never
//! skips).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::linux::{binary_content, field, host_tool, linux_host_with, run_logged};

/// The test's package in its index.
const WHEEL: &str = "tinypkg-1.0-py3-none-any.whl";

/// Builds the test's wheel with the host's python3 (a module with a token
/// of this run, so its hash is its own).
fn wheel(dir: &Path) -> PathBuf {
    let path = dir.join(WHEEL);
    let token = format!("{}-{:?}", std::process::id(), std::time::SystemTime::now());
    let script = r#"
import sys, zipfile, hashlib, base64
path, token = sys.argv[1], sys.argv[2]
files = {
    "tinypkg/__init__.py": f"TOKEN = {token!r}\n",
    "tinypkg-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n",
    "tinypkg-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: torpor-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
record = ""
for name, text in files.items():
    digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
    record += f"{name},sha256={digest},{len(text.encode())}\n"
record += "tinypkg-1.0.dist-info/RECORD,,\n"
files["tinypkg-1.0.dist-info/RECORD"] = record
with zipfile.ZipFile(path, "w") as z:
    for name, text in files.items():
        z.writestr(name, text)
"#;
    let out = Command::new("python3")
        .args(["-c", script])
        .arg(&path)
        .arg(token)
        .output()
        .expect("python3 makes the test's wheel");
    assert!(
        out.status.success(),
        "making the wheel failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    path
}

fn tool(name: &str) -> PathBuf {
    host_tool(name, "nftables iproute2 curl")
}

const SCRIPT: &str = include_str!("nested_net.sh");

fn num(out: &str, tag: &str, key: &str) -> u64 {
    field(out, tag, key)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no number {tag} {key}= in:\n{out}"))
}

#[test]
fn nested_sandbox_network_through_the_service() {
    let files = tempfile::tempdir().unwrap();
    let blob = files.path().join("blob.bin");
    std::fs::write(&blob, binary_content(3 << 20)).unwrap();
    let wheel = wheel(files.path());
    let (host, _scratch) = linux_host_with(
        "net",
        &[
            (tool("ip"), "/usr/local/sbin/ip"),
            (tool("nft"), "/usr/local/sbin/nft"),
            (tool("curl"), "/usr/local/bin/curl"),
            (blob, "/opt/torpor/blob.bin"),
            (wheel, "/opt/torpor/tinypkg-1.0-py3-none-any.whl"),
        ],
        4096,
        None,
    );
    // About 150 s when well; a wedged nested host fails (and is run again
    // by scripts/test) within 15 min, not an hour.
    let run = run_logged(&host, "nested_net", SCRIPT, Duration::from_secs(900));
    let o = &run.stdout;
    eprintln!("{o}");
    assert_ne!(run.exit_code, 97, "{o}");
    check_network(o);
    check_leftovers(o);
}

fn check_network(o: &str) {
    assert_eq!(field(o, "template", "rc"), Some("0"), "template:\n{o}");
    // allow_internet: false: the host's server is out of reach.
    assert_eq!(field(o, "closed", "ok"), Some("no"), "{o}");
    // allow_out 192.0.2.1/32: exactly that address opens, with the file
    // intact; its neighbour stays closed.
    let want = field(o, "blob", "sha").unwrap_or_else(|| panic!("{o}"));
    assert_eq!(want.len(), 64, "{o}");
    assert_eq!(field(o, "opened", "sha"), Some(want), "{o}");
    assert_eq!(field(o, "neighbour", "ok"), Some("no"), "{o}");
    // pip download from the test's index, hash checked by pip (the index
    // link carries it) and again here.
    assert_eq!(field(o, "pip", "rc"), Some("0"), "{o}");
    assert_eq!(field(o, "pip", "sha"), field(o, "wheel", "sha"), "{o}");
    // The policy's drops were counted.
    assert!(num(o, "drops", "n") > 0, "{o}");

    // An exposed port answers from L1, and wakes the hibernated sandbox.
    assert_eq!(
        field(o, "port-running", "body"),
        Some("served-by-the-guest"),
        "{o}"
    );
    assert!(
        o.contains("port-hibernated state=hibernated"),
        "the sandbox did not hibernate:\n{o}"
    );
    assert_eq!(
        field(o, "port-woken", "body"),
        Some("served-by-the-guest"),
        "{o}"
    );
    assert_eq!(field(o, "port-after", "state"), Some("running"), "{o}");
    eprintln!(
        "nested_net: a request to the hibernated sandbox's port answered after {} s \
         (wake included, curl's time to first byte)",
        field(o, "port-woken", "ttfb").unwrap_or("?")
    );

    // Three clones at once: each reached the server, which saw each one's
    // own host-side address (the one the API gives).
    let mut seen = std::collections::HashSet::new();
    for i in 1..=3 {
        let tag = format!("clone-{i}");
        let api = field(o, &tag, "api").unwrap_or_else(|| panic!("{o}"));
        let server = field(o, &tag, "seen").unwrap_or_else(|| panic!("{o}"));
        assert!(api.starts_with("10.200."), "{tag}: {api}\n{o}");
        assert_eq!(api, server, "{tag}: the server saw another address:\n{o}");
        seen.insert(server.to_string());
    }
    assert_eq!(seen.len(), 3, "clones share a host-side address:\n{o}");
    // The walls (issue 24, attack 8): a guest whose policy allows the
    // internet fetches from it (the control) and from nothing of L1's
    // own but what --host-allow opens, no other sandbox, no link-local.
    assert_eq!(field(o, "wall-control", "got"), Some("ok"), "{o}");
    for wall in [
        "wall-l1-service",
        "wall-l1-hostend",
        "wall-l1-allowed-addr-other-port",
        "wall-l1-api",
        "wall-metadata",
        "wall-other-sandbox",
    ] {
        assert_eq!(field(o, wall, "got"), Some("no"), "{wall}:\n{o}");
    }
}

fn check_leftovers(o: &str) {
    let count = |tag: &str, key: &str| num(o, &format!("leftovers-{tag}"), key);
    // Before the crash every running sandbox has its network.
    let before = count("before-kill", "netns");
    assert!(before >= 2, "{o}");
    // One VMM was killed with the service: its network is gone after the
    // restart, the others' are kept (the networks of live VMMs only).
    assert!(num(o, "victim", "pid") > 1, "{o}");
    assert_eq!(field(o, "victim-gone", "ok"), Some("yes"), "{o}");
    let live = num(o, "live", "n");
    assert_eq!(
        live,
        before - 1,
        "the killed VMM's sandbox is not running:\n{o}"
    );
    for key in ["netns", "veths"] {
        assert_eq!(count("after-restart", key), live, "{key}:\n{o}");
    }
    assert_eq!(
        field(o, "port-after-restart", "body"),
        Some("served-by-the-guest"),
        "{o}"
    );
    for tag in ["after-delete", "after-stop"] {
        for key in ["netns", "veths", "rules", "sets"] {
            assert_eq!(count(tag, key), 0, "{tag} {key} leaked:\n{o}");
        }
    }
}
