//! Boots the probe guest under the real KVM of this host (PVM included) and
//! checks its console: ready line, exact checksum sequence, timer-driven
//! idling, pause/resume through the control socket, and several vCPUs.

mod common;

use std::time::Duration;

use common::{probe_iterations, stderr, stdout, wait_for_line, Scratch, Vmm};
use torpor_vmm::control::{call, request, Request, VmState};

const BOOT_LIMIT: Duration = Duration::from_secs(30);

fn run_probe(extra: &[&str], cmdline: &str) -> (String, std::process::Output) {
    let mut args = vec![
        "--kernel",
        "builtin:probe",
        "--mem-mib",
        "64",
        "--cmdline",
        cmdline,
    ];
    args.extend_from_slice(extra);
    let out = Vmm::spawn(&args).wait(BOOT_LIMIT);
    (stdout(&out), out)
}

#[test]
fn probe_boots_prints_exact_sequence_and_exits_cleanly() {
    let (console, out) = run_probe(&[], "probe.iters=5 probe.mib=2 probe.ticks=1");
    assert_eq!(out.status.code(), Some(0), "stderr:\n{}", stderr(&out));
    assert!(
        console.contains("TORPOR-PROBE READY mib=2 iters=5 ticks=1 hz=100 ram_mib="),
        "console:\n{console}"
    );
    let iters = probe_iterations(&console);
    let expected: Vec<(u64, u64)> = torpor_probe::expected_checksums(2, 5)
        .into_iter()
        .enumerate()
        .map(|(i, s)| (i as u64 + 1, s))
        .collect();
    assert_eq!(iters, expected, "console:\n{console}");
    assert!(
        console.contains("TORPOR-PROBE DONE n=5"),
        "console:\n{console}"
    );
}

#[test]
fn two_runs_print_the_same_sequence() {
    let cmdline = "probe.iters=4 probe.mib=3";
    let (a, out_a) = run_probe(&[], cmdline);
    let (b, out_b) = run_probe(&[], cmdline);
    assert!(out_a.status.success() && out_b.status.success());
    let filter = |s: &str| -> Vec<String> {
        s.lines()
            // Identity lines carry a fresh random seed and clock every boot.
            .filter(|l| {
                l.starts_with("TORPOR-PROBE") && !l.starts_with(torpor_probe::IDENTITY_PREFIX)
            })
            .map(String::from)
            .collect()
    };
    assert_eq!(filter(&a), filter(&b));
    assert_eq!(probe_iterations(&a).len(), 4);
}

#[test]
fn probe_reports_a_workload_that_does_not_fit() {
    let (console, out) = run_probe(&[], "probe.iters=1 probe.mib=100");
    assert_eq!(out.status.code(), Some(0), "stderr:\n{}", stderr(&out));
    assert!(
        console.contains("TORPOR-PROBE ERROR workload does not fit in RAM"),
        "{console}"
    );
}

#[test]
fn probe_boots_with_several_vcpus() {
    let (console, out) = run_probe(&["--vcpus", "4"], "probe.iters=2");
    assert_eq!(out.status.code(), Some(0), "stderr:\n{}", stderr(&out));
    assert_eq!(probe_iterations(&console).len(), 2, "{console}");
}

#[test]
fn timer_paces_the_idle_loop() {
    // 5 iterations idling 20 ticks each at 100 Hz: at least ~0.8 s of
    // timer-driven HLT, so the guest really took timer interrupts.
    let started = std::time::Instant::now();
    let (console, out) = run_probe(&[], "probe.iters=5 probe.ticks=20 probe.hz=100 probe.mib=1");
    assert!(out.status.success(), "stderr:\n{}", stderr(&out));
    assert_eq!(probe_iterations(&console).len(), 5);
    assert!(
        started.elapsed() >= Duration::from_millis(800),
        "{:?}",
        started.elapsed()
    );
}

/// A probe VM of `vcpus` ticking at 100 Hz, its console in a file and a
/// control socket (in the returned scratch directory), past its 3rd
/// iteration.
fn probe_with_control(
    name: &str,
    vcpus: u8,
) -> (Scratch, std::path::PathBuf, std::path::PathBuf, Vmm) {
    let dir = Scratch::new(name);
    let serial = dir.path("console.log");
    let sock = dir.path("ctl.sock");
    let vcpus = vcpus.to_string();
    let vmm = Vmm::spawn(&[
        "--kernel",
        "builtin:probe",
        "--mem-mib",
        "64",
        "--vcpus",
        &vcpus,
        "--cmdline",
        "probe.mib=1 probe.ticks=2 probe.hz=100",
        "--serial",
        serial.to_str().unwrap(),
        "--control-socket",
        sock.to_str().unwrap(),
    ]);
    wait_for_line(&serial, BOOT_LIMIT, |l| {
        l.starts_with("TORPOR-PROBE ITER n=3 ")
    });
    (dir, serial, sock, vmm)
}

#[test]
fn pause_stops_the_counter_and_resume_continues_it() {
    let (_dir, serial, sock, mut vmm) = probe_with_control("pause-resume", 1);
    let t = Duration::from_secs(10);
    assert_eq!(
        request(&sock, &Request::Status, t).unwrap().state,
        VmState::Running
    );

    let paused = request(&sock, &Request::Pause, t).unwrap();
    assert_eq!(paused.state, VmState::Paused);
    let count = |p: &std::path::Path| probe_iterations(&std::fs::read_to_string(p).unwrap()).len();
    let at_pause = count(&serial);
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(count(&serial), at_pause, "the counter moved while paused");
    assert_eq!(
        request(&sock, &Request::Status, t).unwrap().state,
        VmState::Paused
    );

    assert_eq!(
        request(&sock, &Request::Resume, t).unwrap().state,
        VmState::Running
    );
    let want = at_pause as u64 + 3;
    wait_for_line(&serial, BOOT_LIMIT, |l| {
        l.starts_with(&format!("TORPOR-PROBE ITER n={want} "))
    });
    assert!(vmm.try_status().is_none(), "VMM exited early");

    // The sequence across the pause is the one an uninterrupted run prints.
    let seen = probe_iterations(&std::fs::read_to_string(&serial).unwrap());
    let expected = torpor_probe::expected_checksums(1, seen.len() as u64);
    assert_eq!(seen.iter().map(|x| x.1).collect::<Vec<_>>(), expected);

    request(&sock, &Request::Shutdown, t).unwrap();
    let out = vmm.wait(BOOT_LIMIT);
    assert_eq!(out.status.code(), Some(0), "stderr:\n{}", stderr(&out));
    assert!(!sock.exists(), "control socket left behind");
}

#[test]
fn vcpu_state_reads_a_running_guest_and_lets_it_run_on() {
    let (_dir, serial, sock, vmm) = probe_with_control("vcpu-state", 2);
    let t = Duration::from_secs(10);
    let answer = call(&sock, &Request::VcpuState, t).unwrap();
    assert_eq!(answer.status.unwrap().state, VmState::Running);
    let states = answer.vcpus.expect("vcpu_state answers the vCPUs");
    assert_eq!(
        states.vcpus.iter().map(|v| v.index).collect::<Vec<_>>(),
        [0, 1]
    );
    let boot = &states.vcpus[0];
    // The probe runs in long mode under the VMM's paging, its LAPIC timer
    // periodic on vector 0x20 at 1e9 / hz counts, the APIC enabled.
    assert_ne!(boot.efer & (1 << 10), 0, "EFER.LMA: {boot:?}");
    assert_ne!(boot.cr0 & (1 << 31), 0, "CR0.PG: {boot:?}");
    assert_eq!(boot.apic.timer_lvt & 0xff, 0x20, "{boot:?}");
    assert_eq!(boot.apic.timer_initial_count, 10_000_000, "{boot:?}");
    assert_ne!(boot.apic.svr & 0x100, 0, "APIC software-enabled: {boot:?}");

    // Read, then let run: the counter goes on with the exact sequence.
    let count = |p: &std::path::Path| probe_iterations(&std::fs::read_to_string(p).unwrap()).len();
    let want = count(&serial) as u64 + 3;
    wait_for_line(&serial, BOOT_LIMIT, |l| {
        l.starts_with(&format!("TORPOR-PROBE ITER n={want} "))
    });
    let seen = probe_iterations(&std::fs::read_to_string(&serial).unwrap());
    let expected = torpor_probe::expected_checksums(1, seen.len() as u64);
    assert_eq!(seen.iter().map(|x| x.1).collect::<Vec<_>>(), expected);

    // A paused VM is read as it is and stays paused.
    request(&sock, &Request::Pause, t).unwrap();
    let answer = call(&sock, &Request::VcpuState, t).unwrap();
    assert_eq!(answer.status.unwrap().state, VmState::Paused);
    assert_eq!(answer.vcpus.unwrap().vcpus.len(), 2);
    assert_eq!(
        request(&sock, &Request::Status, t).unwrap().state,
        VmState::Paused
    );
    request(&sock, &Request::Shutdown, t).unwrap();
    let out = vmm.wait(BOOT_LIMIT);
    assert_eq!(out.status.code(), Some(0), "stderr:\n{}", stderr(&out));
}
