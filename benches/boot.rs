//! Boot benchmark: `torpor vmm` process start to the probe guest's ready
//! line and to the first KVM_RUN, with the VMM's own build phases.
//!
//! `cargo bench --bench boot [-- --runs N]` prints one table of medians (and
//! p90) per guest memory size. Run it on an idle machine; compare rows of one
//! run with each other rather than with numbers from another day.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Instant;

const TORPOR: &str = env!("CARGO_BIN_EXE_torpor");
const PHASES: &[&str] = &[
    "kvm_open_us",
    "vm_create_us",
    "memory_us",
    "irqchip_us",
    "load_us",
    "devices_us",
    "vcpu_setup_us",
    "vcpu_threads_us",
    "first_kvm_run_us",
];

struct Sample {
    ready_us: u64,
    phases: Vec<u64>,
}

fn one_boot(mem_mib: u64) -> Sample {
    let started = Instant::now();
    let mut child = Command::new(TORPOR)
        .args([
            "vmm",
            "--no-jail",
            "--kernel",
            "builtin:probe",
            "--mem-mib",
            &mem_mib.to_string(),
            "--cmdline",
            "probe.iters=1 probe.mib=1",
            "--report",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn torpor");
    let mut ready_us = None;
    for line in BufReader::new(child.stdout.take().unwrap()).lines() {
        let line = line.expect("read console");
        if ready_us.is_none() && line.starts_with("TORPOR-PROBE READY") {
            ready_us = Some(started.elapsed().as_micros() as u64);
        }
    }
    let out = child.wait_with_output().expect("wait torpor");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    let report: serde_json::Value = stderr
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str(l).ok())
        .expect("the VMM printed no report");
    let phases = PHASES
        .iter()
        .map(|p| {
            report["timings"][p]
                .as_u64()
                .or_else(|| report[p].as_u64())
                .unwrap_or_else(|| panic!("report lacks {p}: {report}"))
        })
        .collect();
    Sample {
        ready_us: ready_us.expect("the probe printed no READY line"),
        phases,
    }
}

fn percentile(values: &mut [u64], p: f64) -> u64 {
    values.sort_unstable();
    let idx = ((values.len() as f64 - 1.0) * p).round() as usize;
    values[idx]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let runs = args
        .iter()
        .position(|a| a == "--runs")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(30usize);
    // `cargo test --all-targets` runs benches without `--bench`: smoke size.
    let runs = if args.iter().any(|a| a == "--bench") {
        runs
    } else {
        2
    };
    println!("torpor boot benchmark: {runs} boots of the probe guest per row (µs)");
    for mem_mib in [256u64, 2048] {
        one_boot(mem_mib); // warm the page cache and KVM
        let samples: Vec<Sample> = (0..runs).map(|_| one_boot(mem_mib)).collect();
        println!("\nguest memory {mem_mib} MiB");
        println!("{:<34} {:>10} {:>10}", "phase", "median", "p90");
        let row = |name: &str, mut v: Vec<u64>| {
            let (m, p) = (percentile(&mut v, 0.5), percentile(&mut v, 0.9));
            println!("{name:<34} {m:>10} {p:>10}");
        };
        for (i, p) in PHASES.iter().enumerate() {
            let label = if *p == "first_kvm_run_us" {
                "vmm start -> first KVM_RUN".to_string()
            } else {
                format!("  {}", p.trim_end_matches("_us"))
            };
            row(&label, samples.iter().map(|s| s.phases[i]).collect());
        }
        row(
            "process start -> probe READY line",
            samples.iter().map(|s| s.ready_us).collect(),
        );
    }
}
