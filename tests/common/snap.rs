//! Helpers for snapshot tests: boot a probe with a control socket, snapshot
//! it, restore it, and read its console.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use torpor_vmm::control::{call, request, Request, Response, VmStatus};

use super::{probe_iterations, wait_for_line, Scratch, Vmm};

pub const LIMIT: Duration = Duration::from_secs(60);
const CTL: Duration = Duration::from_secs(60);

/// A VMM with a console file and a control socket.
pub struct Vm {
    pub vmm: Vmm,
    pub console: PathBuf,
    pub socket: PathBuf,
}

impl Vm {
    pub fn boot(dir: &Scratch, name: &str, extra: &[&str]) -> Self {
        Self::spawn(dir, name, &["--kernel", "builtin:probe"], extra)
    }

    pub fn restore(
        dir: &Scratch,
        name: &str,
        snapshot: &Path,
        backend: &str,
        extra: &[&str],
    ) -> Self {
        let snapshot = snapshot.to_str().unwrap();
        let head = ["--restore", snapshot, "--memory-backend", backend];
        Self::spawn(dir, name, &head, extra)
    }

    /// Starts `torpor vmm HEAD --serial NAME.log --control-socket NAME.sock
    /// EXTRA` and waits for its control socket.
    fn spawn(dir: &Scratch, name: &str, head: &[&str], extra: &[&str]) -> Self {
        let console = dir.path(&format!("{name}.log"));
        let socket = dir.path(&format!("{name}.sock"));
        let mut args = head.to_vec();
        args.extend_from_slice(&[
            "--serial",
            console.to_str().unwrap(),
            "--control-socket",
            socket.to_str().unwrap(),
        ]);
        args.extend_from_slice(extra);
        let vm = Self {
            vmm: Vmm::spawn(&args),
            console,
            socket,
        };
        vm.wait_ready();
        vm
    }

    /// Waits until the control socket answers.
    fn wait_ready(&self) {
        let deadline = std::time::Instant::now() + LIMIT;
        while request(&self.socket, &Request::Status, CTL).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "VMM never answered on {}",
                self.socket.display()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    pub fn status(&self) -> VmStatus {
        request(&self.socket, &Request::Status, CTL).unwrap()
    }

    pub fn pause(&self) {
        request(&self.socket, &Request::Pause, CTL).unwrap();
    }

    pub fn resume(&self) {
        request(&self.socket, &Request::Resume, CTL).unwrap();
    }

    pub fn snapshot(&self, out: &Path, diff: bool) -> Response {
        call(
            &self.socket,
            &Request::Snapshot {
                path: out.to_path_buf(),
                diff,
            },
            CTL,
        )
        .unwrap_or_else(|e| panic!("snapshot to {} failed: {e}", out.display()))
    }

    pub fn console(&self) -> String {
        std::fs::read_to_string(&self.console).unwrap_or_default()
    }

    /// (n, sum) of every ITER line so far.
    pub fn iterations(&self) -> Vec<(u64, u64)> {
        probe_iterations(&self.console())
    }

    pub fn wait_iter(&self, n: u64) {
        let prefix = format!("TORPOR-PROBE ITER n={n} ");
        wait_for_line(&self.console, LIMIT, |l| l.starts_with(&prefix));
    }

    /// Waits until `more` iterations past `last` ran, then checks the VM
    /// took up exactly where the snapshot left off (iteration `last` + 1)
    /// and runs the exact sequence of a `mib` MiB workload.
    pub fn assert_continues(&self, last: u64, more: u64, mib: u32) -> Vec<(u64, u64)> {
        self.wait_iter(last + more);
        let seen = self.iterations();
        assert_eq!(seen[0].0, last + 1);
        assert_exact_sequence(&seen, mib);
        seen
    }

    pub fn shutdown(self) -> std::process::Output {
        request(&self.socket, &Request::Shutdown, CTL).unwrap();
        let out = self.vmm.wait(LIMIT);
        assert_eq!(
            out.status.code(),
            Some(0),
            "stderr:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }
}

/// Asserts that `seen` is the probe's exact sequence: consecutive counters,
/// and the model's checksum for the first few and the last iterations (the
/// model costs a pass over the workload per iteration, so not all of them).
pub fn assert_exact_sequence(seen: &[(u64, u64)], mib: u32) {
    assert!(!seen.is_empty(), "no iterations");
    for pair in seen.windows(2) {
        assert_eq!(
            pair[1].0,
            pair[0].0 + 1,
            "iterations skipped or repeated near {pair:?}"
        );
    }
    let checked = seen.iter().take(4).chain(seen.last());
    for (n, sum) in checked {
        assert_eq!(
            *sum,
            torpor_probe::iteration_checksum(mib, *n),
            "iteration {n} has the wrong checksum"
        );
    }
}
