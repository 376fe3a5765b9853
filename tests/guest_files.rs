//! `torpor vmm files` and `torpor vmm ping` against a real torpor-agent
//! serving this host's filesystem, behind a stand-in for the VMM's hybrid
//! vsock socket (`CONNECT <port>` / `OK <port>`, then the agent protocol).
//! The same commands run against a real guest in nested/tests/nested_linux.rs.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use torpor_agent::proto::MAX_IO_CHUNK;

const TORPOR: &str = env!("CARGO_BIN_EXE_torpor");

/// An agent on `dir/agent.sock`, and the hybrid vsock stand-in on
/// `dir/vsock.sock` that forwards port 52 to it.
fn start(dir: &Path) -> PathBuf {
    torpor_agent::standin::start(dir, |_| {}).unwrap()
}

fn files(vsock: &Path, args: &[&str]) -> Output {
    Command::new(TORPOR)
        .args(["vmm", "files", "--vsock-uds"])
        .arg(vsock)
        .args(["--wait-ms", "5000"])
        .args(args)
        .output()
        .expect("run torpor")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Every byte value, then more than one agent I/O chunk of a sequence that
/// does not repeat at any power-of-two period (a misplaced chunk shows).
fn binary_content() -> Vec<u8> {
    let mut data: Vec<u8> = (0..=255u8).collect();
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    while data.len() < MAX_IO_CHUNK + 123_457 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        data.push((x >> 24) as u8);
    }
    data
}

#[test]
fn files_round_trip_through_the_agent() {
    let tmp = tempfile::tempdir().unwrap();
    let vsock = start(tmp.path());
    let data = binary_content();
    let local = tmp.path().join("blob.bin");
    std::fs::write(&local, &data).unwrap();
    let guest_dir = tmp.path().join("guest/sub");
    let guest_file = guest_dir.join("blob.bin");
    let guest = guest_file.to_str().unwrap();

    let out = files(
        &vsock,
        &[
            "put",
            "--parents",
            "--mode",
            "600",
            local.to_str().unwrap(),
            guest,
        ],
    );
    assert!(out.status.success(), "put: {}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        format!("{guest}: {} bytes\n", data.len())
    );
    assert_eq!(
        std::fs::read(&guest_file).unwrap(),
        data,
        "the file arrived changed"
    );

    let back = tmp.path().join("back.bin");
    let out = files(&vsock, &["get", guest, back.to_str().unwrap()]);
    assert!(out.status.success(), "get: {}", text(&out.stderr));
    assert_eq!(
        std::fs::read(&back).unwrap(),
        data,
        "the file came back changed"
    );

    let out = files(&vsock, &["get", guest, "-"]);
    assert!(out.status.success(), "get -: {}", text(&out.stderr));
    assert_eq!(out.stdout, data, "get to stdout changed the file");

    let out = files(&vsock, &["ls", guest_dir.to_str().unwrap()]);
    assert!(out.status.success(), "ls: {}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        format!("file    0600 {:>12} blob.bin\n", data.len())
    );

    let out = files(&vsock, &["stat", guest]);
    assert!(out.status.success(), "stat: {}", text(&out.stderr));
    let st: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(st["size"], data.len() as u64, "{st}");
    assert_eq!(st["kind"], "file", "{st}");
}

#[test]
fn files_pass_agent_and_local_errors_through() {
    let tmp = tempfile::tempdir().unwrap();
    let vsock = start(tmp.path());
    let missing = tmp.path().join("no/such/file");
    let missing = missing.to_str().unwrap();

    // A missing guest path: the agent's errno name reaches the user, and no
    // local file is left behind.
    let local = tmp.path().join("out.bin");
    let out = files(&vsock, &["get", missing, local.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.contains(&format!("get {missing}: agent error ENOENT")),
        "{err}"
    );
    assert!(!local.exists(), "a failed get left {}", local.display());
    let out = files(&vsock, &["ls", missing]);
    assert!(
        text(&out.stderr).contains("agent error ENOENT"),
        "{}",
        text(&out.stderr)
    );
    // A guest path that is not absolute: refused by the agent.
    let out = files(&vsock, &["stat", "relative/path"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("agent error EINVAL"),
        "{}",
        text(&out.stderr)
    );
    // Without --parents the directory must exist.
    let src = tmp.path().join("small");
    std::fs::write(&src, b"x").unwrap();
    let out = files(&vsock, &["put", src.to_str().unwrap(), missing]);
    assert!(
        text(&out.stderr).contains("agent error ENOENT"),
        "{}",
        text(&out.stderr)
    );

    // A missing local file is named before anything is sent.
    let out = files(&vsock, &["put", "/nonexistent/local", "/tmp/x"]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains("cannot read /nonexistent/local"), "{err}");
    let out = files(
        &vsock,
        &["put", "--mode", "999", src.to_str().unwrap(), "/tmp/x"],
    );
    assert!(
        text(&out.stderr).contains("bad --mode"),
        "{}",
        text(&out.stderr)
    );

    // No agent behind the socket.
    let out = Command::new(TORPOR)
        .args(["vmm", "files", "--vsock-uds"])
        .arg(tmp.path().join("nobody.sock"))
        .args(["--wait-ms", "100", "ls", "/"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("no agent reachable"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn ping_reports_the_agent_version() {
    let tmp = tempfile::tempdir().unwrap();
    let vsock = start(tmp.path());
    let out = Command::new(TORPOR)
        .args(["vmm", "ping", "--vsock-uds"])
        .arg(&vsock)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        format!(
            "torpor-agent {} protocol {}\n",
            torpor_agent::AGENT_VERSION,
            torpor_agent::PROTOCOL_VERSION
        )
    );
}
