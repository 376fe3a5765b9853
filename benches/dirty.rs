//! Dirty-tracking benchmark: KVM's dirty log against userfaultfd
//! asynchronous write-protection (`--dirty-tracking kvm|uffd-wp`), for
//! 256 MiB and 2 GiB probe guests dirtying ~1/10/50% of their memory.
//!
//! Per cell:
//! - **collect**: time to read and reset the dirty set inside a diff
//!   snapshot (`dirty_collect_us`: KVM_GET_DIRTY_LOG of every slot, or
//!   PAGEMAP_SCAN with PM_SCAN_WP_MATCHING);
//! - **diff**: diff snapshot latency, bytes on disk and pages;
//! - **guest cost**: how much longer the guest takes to rewrite its workload
//!   right after tracking was re-armed (every workload page takes one
//!   tracking fault) than after a plain pause/resume (no re-arm). Measured
//!   from the host as resume → second ITER line, so it covers the rest of
//!   the interrupted iteration plus one full one: every page written once.
//!   Also per dirtied page.
//! - **restore**: cold `torpor vmm --restore` (file backend) to first
//!   KVM_RUN with each source, since uffd-wp registers and write-protects
//!   all of guest memory at restore.
//!
//! Under `cargo test` (no `--bench` argument) it makes a one-run smoke pass
//! on a 64 MiB guest. `cargo bench --bench dirty [-- --runs N --quick]`
//! prints tables of medians.

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

mod common;

use common::{call, iter_lines, median, shutdown, spawn, wait_until};
const SOURCES: &[&str] = &["kvm", "uffd-wp"];
const LIMIT: Duration = Duration::from_secs(300);

/// A running probe VM with a console and a control socket.
struct Probe {
    sock: PathBuf,
    console: PathBuf,
    child: Child,
}

impl Probe {
    fn boot(dir: &Path, mem: u64, mib: u64, source: &str) -> Probe {
        let sock = dir.join("probe.sock");
        let console = dir.join("probe.log");
        let _ = std::fs::remove_file(&console);
        let child = spawn(&[
            "vmm",
            "--no-jail",
            "--kernel",
            "builtin:probe",
            "--mem-mib",
            &mem.to_string(),
            // A 1 ms halt between iterations: the guest mostly rewrites.
            "--cmdline",
            &format!("probe.mib={mib} probe.hz=1000 probe.ticks=1"),
            "--dirty-tracking",
            source,
            "--serial",
            console.to_str().unwrap(),
            "--control-socket",
            sock.to_str().unwrap(),
        ]);
        wait_until(LIMIT, || UnixStream::connect(&sock).is_ok());
        Probe {
            sock,
            console,
            child,
        }
    }

    fn lines(&self) -> usize {
        iter_lines(&self.console)
    }

    /// Waits for the next ITER line, then pauses at once: the guest is
    /// early in an iteration.
    fn pause_after_next_line(&self) {
        let n = self.lines();
        wait_until(LIMIT, || self.lines() > n);
        call(&self.sock, r#"{"op":"pause"}"#);
    }

    /// Resumes and times until two more ITER lines: the rest of the
    /// interrupted iteration and one full one, so every workload page has
    /// been written once. µs.
    fn resume_and_time_rewrite(&self) -> f64 {
        let n = self.lines();
        let t0 = Instant::now();
        call(&self.sock, r#"{"op":"resume"}"#);
        wait_until(LIMIT, || self.lines() >= n + 2);
        t0.elapsed().as_micros() as f64
    }

    fn snapshot(&self, path: &Path, diff: bool) -> serde_json::Value {
        call(
            &self.sock,
            &format!(
                r#"{{"op":"snapshot","path":"{}","diff":{diff}}}"#,
                path.display()
            ),
        )["snapshot"]
            .clone()
    }
}

struct Cell {
    collect_us: Vec<f64>,
    diff_ms: Vec<f64>,
    diff_mib: Vec<f64>,
    pages: Vec<f64>,
    rearmed_us: Vec<f64>,
    plain_us: Vec<f64>,
    restore_us: Vec<f64>,
}

fn measure(dir: &Path, mem: u64, mib: u64, source: &str, runs: usize) -> Cell {
    let vm = Probe::boot(dir, mem, mib, source);
    wait_until(LIMIT, || vm.lines() >= 2);
    call(&vm.sock, r#"{"op":"pause"}"#);
    let base = dir.join("base");
    vm.snapshot(&base, false);
    call(&vm.sock, r#"{"op":"resume"}"#);
    let mut cell = Cell {
        collect_us: vec![],
        diff_ms: vec![],
        diff_mib: vec![],
        pages: vec![],
        rearmed_us: vec![],
        plain_us: vec![],
        restore_us: vec![],
    };
    let mut previous: Option<PathBuf> = None;
    for run in 0..runs {
        // Re-armed: the diff snapshot resets (re-protects) the dirty set.
        vm.pause_after_next_line();
        let diff = dir.join(format!("diff{run}"));
        let d = vm.snapshot(&diff, true);
        cell.collect_us
            .push(d["dirty_collect_us"].as_f64().unwrap());
        cell.diff_ms
            .push(d["duration_us"].as_f64().unwrap() / 1000.0);
        cell.diff_mib
            .push(d["memory_allocated_bytes"].as_f64().unwrap() / 1048576.0);
        cell.pages.push(d["pages"].as_f64().unwrap());
        cell.rearmed_us.push(vm.resume_and_time_rewrite());
        // Plain: pause and resume only, nothing re-armed.
        vm.pause_after_next_line();
        cell.plain_us.push(vm.resume_and_time_rewrite());
        // Only the newest layer's path matters to the VM; keep disk use flat.
        if let Some(p) = previous.replace(diff) {
            let _ = std::fs::remove_dir_all(p);
        }
    }
    shutdown(&vm.sock, vm.child);
    if let Some(p) = previous {
        let _ = std::fs::remove_dir_all(p);
    }
    for _ in 0..runs {
        cell.restore_us.push(cold_restore(dir, &base, source));
    }
    let _ = std::fs::remove_dir_all(&base);
    cell
}

/// Cold restore (file backend) to first KVM_RUN, µs.
fn cold_restore(dir: &Path, snap: &Path, source: &str) -> f64 {
    let sock = dir.join("cold.sock");
    let console = dir.join("cold.log");
    let _ = std::fs::remove_file(&console);
    let child = spawn(&[
        "vmm",
        "--no-jail",
        "--restore",
        snap.to_str().unwrap(),
        "--dirty-tracking",
        source,
        "--report",
        "--serial",
        console.to_str().unwrap(),
        "--control-socket",
        sock.to_str().unwrap(),
    ]);
    // The guest has run once it prints; only then is there a first KVM_RUN.
    wait_until(LIMIT, || iter_lines(&console) >= 1);
    wait_until(LIMIT, || UnixStream::connect(&sock).is_ok());
    let err = shutdown(&sock, child);
    let report: serde_json::Value = err
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str(l).ok())
        .expect("report");
    report["first_kvm_run_us"].as_f64().unwrap()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let runs: usize = args
        .iter()
        .position(|a| a == "--runs")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    let smoke = !args.iter().any(|a| a == "--bench");
    let runs = if smoke { 1 } else { runs };
    let quick = args.iter().any(|a| a == "--quick");
    let dir = tempfile::tempdir().unwrap();
    // (guest MiB, dirty %, probe workload MiB)
    let cells: Vec<(u64, u64, u64)> = if smoke {
        vec![(64, 3, 2)]
    } else {
        let sizes: &[u64] = if quick { &[256] } else { &[256, 2048] };
        sizes
            .iter()
            .flat_map(|&mem| [1u64, 10, 50].map(|pct| (mem, pct, (mem * pct / 100).max(1))))
            .collect()
    };
    println!("torpor dirty-tracking benchmark ({runs} runs per cell, medians)");
    println!(
        "{:<9} {:>5} {:<8} {:>10} {:>10} {:>10} {:>8} {:>12} {:>12} {:>11} {:>11} {:>11}",
        "guest",
        "dirty",
        "source",
        "collect",
        "diff",
        "on disk",
        "pages",
        "rewrite+arm",
        "rewrite",
        "guest cost",
        "per page",
        "restore"
    );
    for (mem, pct, mib) in cells {
        for source in SOURCES {
            let c = measure(dir.path(), mem, mib, source, runs);
            let (rearmed, plain) = (median(c.rearmed_us), median(c.plain_us));
            let pages = median(c.pages);
            let cost = rearmed - plain;
            println!(
                "{:<9} {:>5} {:<8} {:>7.0} µs {:>7.1} ms {:>6.1} MiB {:>8.0} {:>9.1} ms {:>9.1} ms {:>8.1} ms {:>8.2} µs {:>8.2} ms",
                format!("{mem} MiB"),
                format!("{pct}%"),
                source,
                median(c.collect_us),
                median(c.diff_ms),
                median(c.diff_mib),
                pages,
                rearmed / 1000.0,
                plain / 1000.0,
                cost / 1000.0,
                cost / pages,
                median(c.restore_us) / 1000.0,
            );
        }
    }
}
