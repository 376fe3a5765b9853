//! Helpers shared by the benches: run `torpor vmm`, talk to its control
//! socket, watch the probe's console (`restore`, `dirty`); talk HTTP to
//! `torpor serve` (`http`: `density`, `api`; `serve`: start and stop one); and
//! percentiles (`stats`, which the API crate's `ports` bench shares); an SDK
//! driver's samples (`samples`).
#![allow(dead_code)]

pub mod cpu;
pub mod http;
// Shared with the tests; a bench that also includes tests/common (the
// cluster's) loads this file twice, which is harmless here.
#[allow(clippy::duplicate_mod)]
#[path = "../../tests/common/nested_host.rs"]
pub mod nested_host;
pub mod samples;
pub mod serve;
mod stats;

// Not every bench takes both.
#[allow(unused_imports)]
pub use stats::{median, percentile};

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const TORPOR: &str = env!("CARGO_BIN_EXE_torpor");
/// The per-VM process a pod starts (VMM crates only).
pub const TORPOR_VMM: &str = env!("CARGO_BIN_EXE_torpor-vmm");

pub fn spawn(args: &[&str]) -> Child {
    Command::new(TORPOR)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn torpor")
}

/// One control request; panics unless the VMM answers `ok`.
pub fn call(sock: &Path, req: &str) -> serde_json::Value {
    let mut s =
        UnixStream::connect(sock).unwrap_or_else(|e| panic!("connect {}: {e}", sock.display()));
    s.write_all(format!("{req}\n").as_bytes()).unwrap();
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line).unwrap();
    let v: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert_eq!(v["ok"], true, "{req} -> {v}");
    v
}

/// Polls `f` every 100 µs (timings want a fine grain) until it holds.
pub fn wait_until(limit: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !f() {
        assert!(Instant::now() < deadline, "timed out");
        std::thread::sleep(Duration::from_micros(100));
    }
}

pub fn wait_socket(sock: &Path) {
    wait_until(Duration::from_secs(30), || {
        UnixStream::connect(sock).is_ok()
    });
}

/// Complete `TORPOR-PROBE ITER` lines on the console so far.
pub fn iter_lines(console: &Path) -> usize {
    let text = std::fs::read_to_string(console).unwrap_or_default();
    let end = text.rfind('\n').map_or(0, |i| i + 1);
    text[..end]
        .lines()
        .filter(|l| l.starts_with("TORPOR-PROBE ITER"))
        .count()
}

/// Shuts the VMM down and returns its stderr; panics if it failed.
pub fn shutdown(sock: &Path, mut child: Child) -> String {
    call(sock, r#"{"op":"shutdown"}"#);
    let out = std::mem::take(&mut child.stderr);
    let status = child.wait().unwrap();
    let mut err = String::new();
    if let Some(mut e) = out {
        let _ = std::io::Read::read_to_string(&mut e, &mut err);
    }
    assert!(status.success(), "{err}");
    err
}
