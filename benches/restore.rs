//! Restore benchmark: for 256 MiB and 2 GiB probe guests and every memory
//! backend, restore latency (cold `torpor vmm --restore` and a standby
//! shell), snapshot latency and size (full; diff at ~1/10/50% dirty), and
//! PSS per clone with 20 clones of one template.
//!
//! Under `cargo test` (no `--bench` argument) it makes a one-run smoke pass.
//! `cargo bench --bench restore [-- --runs N --quick --only TABLE --ab DIR]`
//! prints tables of medians. `--only` (repeatable) runs just those tables:
//! start (the VMM process's start), seccomp, restore, jail (its cost),
//! snapshots, pss (per clone). `--ab DIR` runs the start, jail and PSS
//! rows twice, A with DIR's `torpor` and `torpor-vmm` (another build
//! copied aside), B with this tree's. Compare rows of one run; the
//! machine's noise (2 shared cores) moves absolute numbers from run to
//! run. `--compare firecracker=PATH [--samples N --clones N]` runs
//! torpor-vmm side by side with that Firecracker binary instead
//! (`restore/compare.rs`).

use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

mod common;
// Not `benches/compare.rs`: cargo would take that for a bench of its own.
#[path = "restore/compare.rs"]
mod compare;

use torpor_scheduler::service::vmm::pss_kib;
use torpor_vmm_api::jail::CLI_JAIL_UID;

use common::{call, iter_lines, median, shutdown, wait_socket, wait_until, TORPOR, TORPOR_VMM};

/// With `--ab DIR`: the rows that measure the VMM process run twice, A
/// with DIR's `torpor` and `torpor-vmm` (another build, copied aside),
/// B with this tree's, so that one run compares them. None: this tree's.
static SIDE_A: std::sync::Mutex<Option<PathBuf>> = std::sync::Mutex::new(None);

/// The `torpor` (`name` "torpor") or `torpor-vmm` binary of the side
/// being measured.
fn exe(name: &str) -> PathBuf {
    match &*SIDE_A.lock().unwrap() {
        Some(dir) => dir.join(name),
        None if name == "torpor" => PathBuf::from(TORPOR),
        None => PathBuf::from(TORPOR_VMM),
    }
}

/// Runs `f` once per side (A then B with `--ab`), its label prefixed.
fn sides<T>(ab: &Option<PathBuf>, mut f: impl FnMut(&str) -> T) -> Vec<T> {
    let mut out = Vec::new();
    if ab.is_some() {
        *SIDE_A.lock().unwrap() = ab.clone();
        out.push(f("A "));
    }
    *SIDE_A.lock().unwrap() = None;
    out.push(f(if ab.is_some() { "B " } else { "" }));
    out
}

/// `torpor ARGS` of the side being measured.
fn spawn(args: &[&str]) -> Child {
    std::process::Command::new(exe("torpor"))
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn torpor")
}
const BACKENDS: &[&str] = &["file", "uffd", "uffd-shared"];

/// Boots a probe with `mib` MiB of workload, lets it run `iters` iterations,
/// and takes a full snapshot. Returns (snapshot dir, snapshot answer).
fn make_template(dir: &Path, name: &str, mem: u64, mib: u64) -> (PathBuf, serde_json::Value) {
    let sock = dir.join(format!("{name}.sock"));
    let console = dir.join(format!("{name}.log"));
    let child = spawn(&[
        "vmm",
        "--no-jail",
        "--kernel",
        "builtin:probe",
        "--mem-mib",
        &mem.to_string(),
        "--cmdline",
        &format!("probe.mib={mib} probe.ticks=1"),
        "--serial",
        console.to_str().unwrap(),
        "--control-socket",
        sock.to_str().unwrap(),
    ]);
    wait_socket(&sock);
    wait_until(Duration::from_secs(60), || iter_lines(&console) >= 2);
    call(&sock, r#"{"op":"pause"}"#);
    let snap = dir.join(name);
    let v = call(
        &sock,
        &format!(r#"{{"op":"snapshot","path":"{}"}}"#, snap.display()),
    );
    shutdown(&sock, child);
    (snap, v)
}

/// Cold restore: (process start -> first KVM_RUN, process start -> next ITER line), µs.
fn cold_restore(dir: &Path, snap: &Path, backend: &str, prefetch: bool, jail: bool) -> (f64, f64) {
    let sock = dir.join("cold.sock");
    let console = dir.join("cold.log");
    let _ = std::fs::remove_file(&console);
    let t0 = Instant::now();
    let mut args = vec![
        "vmm",
        "--restore",
        snap.to_str().unwrap(),
        "--memory-backend",
        backend,
        "--report",
        "--serial",
        console.to_str().unwrap(),
        "--control-socket",
        sock.to_str().unwrap(),
    ];
    if prefetch {
        args.push("--prefetch");
    }
    if !jail {
        args.push("--no-jail");
    }
    let child = spawn(&args);
    wait_until(Duration::from_secs(60), || iter_lines(&console) >= 1);
    let to_line = t0.elapsed().as_micros() as f64;
    wait_socket(&sock);
    let err = shutdown(&sock, child);
    let report: serde_json::Value = err
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str(l).ok())
        .expect("report");
    (report["first_kvm_run_us"].as_f64().unwrap(), to_line)
}

/// Restores once with working-set recording, so `--prefetch` rows have a
/// recorded set to install.
fn record_working_set(dir: &Path, snap: &Path) {
    let sock = dir.join("record.sock");
    let console = dir.join("record.log");
    let child = spawn(&[
        "vmm",
        "--no-jail",
        "--restore",
        snap.to_str().unwrap(),
        "--memory-backend",
        "uffd",
        "--record-working-set-ms",
        "500",
        "--serial",
        console.to_str().unwrap(),
        "--control-socket",
        sock.to_str().unwrap(),
    ]);
    wait_until(Duration::from_secs(60), || {
        snap.join("working-set").exists()
    });
    shutdown(&sock, child);
}

/// Standby restore: (request -> vCPU running, request -> next ITER line), µs.
fn standby_restore(
    dir: &Path,
    snap: &Path,
    backend: &str,
    mem: u64,
    prefetch: bool,
    jail: bool,
) -> (f64, f64) {
    let extra: &[&str] = if jail { &[] } else { &["--no-jail"] };
    standby_restore_with(dir, snap, backend, mem, prefetch, extra)
}

/// [`standby_restore`] of a shell started with `extra` flags.
fn standby_restore_with(
    dir: &Path,
    snap: &Path,
    backend: &str,
    mem: u64,
    prefetch: bool,
    extra: &[&str],
) -> (f64, f64) {
    let sock = dir.join("standby.sock");
    let console = dir.join("standby.log");
    let _ = std::fs::remove_file(&console);
    let child = spawn_standby(mem, &sock, extra);
    wait_socket(&sock);
    let t0 = Instant::now();
    let v = call(
        &sock,
        &format!(
            r#"{{"op":"restore","snapshot":"{}","backend":"{backend}","console":{{"to":"file","path":"{}"}},"prefetch":{prefetch}}}"#,
            snap.display(),
            console.display()
        ),
    );
    wait_until(Duration::from_secs(60), || iter_lines(&console) >= 1);
    let to_line = t0.elapsed().as_micros() as f64;
    shutdown(&sock, child);
    (
        v["restore"]["request_to_running_us"].as_f64().unwrap(),
        to_line,
    )
}

/// 20 clones of one template: median PSS (MiB) restored paused (never ran),
/// and running (after two iterations of the workload).
/// One clone of [`clone_pss`]: exec'd by `torpor vmm`, or forked by the
/// fork server as a pod starts its VMMs.
enum CloneVm {
    Exec(Child),
    Forked(torpor_scheduler::service::vmm_process::VmmChild),
}

impl CloneVm {
    fn id(&self) -> u32 {
        match self {
            CloneVm::Exec(c) => c.id(),
            CloneVm::Forked(c) => c.id(),
        }
    }

    fn shutdown(self, sock: &Path) {
        match self {
            CloneVm::Exec(c) => {
                shutdown(sock, c);
            }
            CloneVm::Forked(mut c) => {
                call(sock, r#"{"op":"shutdown"}"#);
                assert!(c.wait().unwrap().success());
            }
        }
    }
}

/// A clone of `snap` restored paused by a VMM the fork server forked.
fn forked_clone(snap: &Path, backend: &str, sock: &Path, console: &Path) -> CloneVm {
    use std::io::Write;
    let (spec_in, mut spec_out) = std::io::pipe().unwrap();
    let null = || {
        std::fs::File::options()
            .write(true)
            .open("/dev/null")
            .unwrap()
    };
    let child = torpor_scheduler::service::vmm_process::start(
        &exe("torpor-vmm"),
        spec_in.into(),
        null().into(),
        null().into(),
    )
    .expect("fork torpor-vmm");
    assert!(child.forked(), "not forked");
    let spec = serde_json::json!({
        "control_socket": sock,
        "mode": {"kind": "restore", "paused": true,
                 "restore": {"snapshot": snap, "backend": backend}},
        "console": {"to": "file", "path": console},
    });
    spec_out.write_all(spec.to_string().as_bytes()).unwrap();
    CloneVm::Forked(child)
}

fn clone_pss(dir: &Path, snap: &Path, backend: &str, forked: bool) -> (f64, f64) {
    let clones: Vec<(CloneVm, PathBuf, PathBuf)> = (0..20)
        .map(|i| {
            let sock = dir.join(format!("pss{i}.sock"));
            let console = dir.join(format!("pss{i}.log"));
            let _ = std::fs::remove_file(&sock);
            if forked {
                return (forked_clone(snap, backend, &sock, &console), sock, console);
            }
            let child = spawn(&[
                "vmm",
                "--no-jail",
                "--restore",
                snap.to_str().unwrap(),
                "--memory-backend",
                backend,
                "--paused",
                "--serial",
                console.to_str().unwrap(),
                "--control-socket",
                sock.to_str().unwrap(),
            ]);
            (CloneVm::Exec(child), sock, console)
        })
        .collect();
    let pss = |clones: &[(CloneVm, PathBuf, PathBuf)]| {
        median(
            clones
                .iter()
                .map(|(c, _, _)| pss_kib(c.id()).map_or(f64::NAN, |k| k as f64) / 1024.0)
                .collect(),
        )
    };
    for (_, sock, _) in &clones {
        wait_socket(sock);
        // The socket listens from the start; an answer means the restore
        // is done (and start-up's heap returned).
        call(sock, r#"{"op":"status"}"#);
    }
    let paused = pss(&clones);
    for (_, sock, console) in &clones {
        call(sock, r#"{"op":"resume"}"#);
        wait_until(Duration::from_secs(60), || iter_lines(console) >= 2);
    }
    let running = pss(&clones);
    for (clone, sock, _) in clones {
        clone.shutdown(&sock);
    }
    (paused, running)
}

/// Restores `snap`, lets one full iteration run, pauses and takes a diff.
fn diff_snapshot(dir: &Path, snap: &Path, name: &str) -> serde_json::Value {
    let sock = dir.join("diff.sock");
    let console = dir.join("diff.log");
    let _ = std::fs::remove_file(&console);
    let child = spawn(&[
        "vmm",
        "--no-jail",
        "--restore",
        snap.to_str().unwrap(),
        "--serial",
        console.to_str().unwrap(),
        "--control-socket",
        sock.to_str().unwrap(),
    ]);
    wait_socket(&sock);
    wait_until(Duration::from_secs(120), || iter_lines(&console) >= 2);
    call(&sock, r#"{"op":"pause"}"#);
    let out = dir.join(name);
    let v = call(
        &sock,
        &format!(
            r#"{{"op":"snapshot","path":"{}","diff":true}}"#,
            out.display()
        ),
    );
    shutdown(&sock, child);
    v
}

/// `torpor vmm --standby` for `mem` MiB on `sock`.
fn spawn_standby(mem: u64, sock: &Path, extra: &[&str]) -> Child {
    let mem = mem.to_string();
    let mut args = vec![
        "vmm",
        "--standby",
        "--mem-mib",
        &mem,
        "--control-socket",
        sock.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    spawn(&args)
}

/// `/bin/true` from spawn to its exit, in µs.
fn true_spawn() -> f64 {
    let t0 = Instant::now();
    let status = std::process::Command::new("/bin/true")
        .status()
        .expect("spawn /bin/true");
    assert!(status.success());
    t0.elapsed().as_micros() as f64
}

/// As [`vmm_start`]'s `torpor-vmm` row, the process forked by a fork
/// server (`torpor-vmm --fork-server`, started before: untimed) as a pod
/// starts its VMMs by default.
fn vmm_fork_start(dir: &Path, mem: u64, i: usize) -> (f64, f64) {
    use std::io::{BufRead, Write};
    use torpor_scheduler::service::vmm_process::{self, SpawnMode};
    assert_eq!(vmm_process::spawn_mode(), SpawnMode::Fork);
    let sock = dir.join(format!("fork-{i}.sock"));
    let _ = std::fs::remove_file(&sock);
    let (spec_in, mut spec_out) = std::io::pipe().unwrap();
    let (reply_in, reply_out) = std::io::pipe().unwrap();
    let null = std::fs::File::create("/dev/null").unwrap();
    let t0 = Instant::now();
    let mut child = vmm_process::start(
        &exe("torpor-vmm"),
        spec_in.into(),
        reply_out.into(),
        null.into(),
    )
    .expect("fork torpor-vmm");
    let spec = serde_json::json!({
        "control_socket": sock,
        "mode": {"kind": "standby", "mem_mib": mem, "vcpus": 1}
    });
    spec_out.write_all(spec.to_string().as_bytes()).unwrap();
    drop(spec_out);
    wait_socket(&sock);
    let to_socket = t0.elapsed().as_micros() as f64;
    let mut line = String::new();
    std::io::BufReader::new(reply_in)
        .read_line(&mut line)
        .unwrap();
    assert!(line.contains("ready"), "{line}");
    let to_ready = t0.elapsed().as_micros() as f64;
    assert!(child.forked(), "the fork server did not fork it");
    call(&sock, r#"{"op":"shutdown"}"#);
    assert!(child.wait().unwrap().success());
    (to_socket, to_ready)
}

/// A standby VMM process from spawn: to its control socket accepting, and
/// (for `torpor-vmm`, which answers one) to its `ready` line, in µs.
fn vmm_start(dir: &Path, mem: u64, small: bool, jail: &[&str], i: usize) -> (f64, Option<f64>) {
    use std::io::{BufRead, Write};
    use std::process::{Command, Stdio};
    let sock = dir.join(format!("start-{i}.sock"));
    let _ = std::fs::remove_file(&sock);
    let t0 = Instant::now();
    let mut child = if small {
        let mut c = Command::new(exe("torpor-vmm"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn torpor-vmm");
        let spec = serde_json::json!({
            "control_socket": sock,
            "mode": {"kind": "standby", "mem_mib": mem, "vcpus": 1}
        });
        let mut stdin = c.stdin.take().unwrap();
        stdin.write_all(spec.to_string().as_bytes()).unwrap();
        drop(stdin);
        c
    } else {
        spawn_standby(mem, &sock, jail)
    };
    wait_socket(&sock);
    let to_socket = t0.elapsed().as_micros() as f64;
    let to_ready = child.stdout.take().map(|out| {
        let mut line = String::new();
        std::io::BufReader::new(out).read_line(&mut line).unwrap();
        assert!(line.contains("ready"), "{line}");
        t0.elapsed().as_micros() as f64
    });
    shutdown(&sock, child);
    (to_socket, to_ready)
}

/// Issue 31's targets for a VMM process (this machine, the probe guest).
const SPAWN_TARGET_US: f64 = 800.0;
const JAIL_TARGET_US: f64 = 500.0;
const PSS_TARGET_MIB: f64 = 0.5;

/// "target: ok" or "target: MISS".
fn met(ok: bool, target: &str) -> String {
    format!("{target}: {}", if ok { "ok" } else { "MISS" })
}

/// The start table's targets: `torpor-vmm`'s spawn -> socket, exec'd and
/// forked (as a pod starts it), and what the jail adds to `torpor vmm
/// --standby`'s; beside the floor (a process that does nothing), which no
/// exec'd VMM can start under.
fn start_targets(exec_us: f64, fork_us: f64, jail_us: f64, floor_us: Option<f64>) {
    println!(
        "targets: torpor-vmm spawn -> socket, forked {fork_us:.0} µs, {} (exec'd {exec_us:.0} \
         µs); the jail adds {jail_us:.0} µs, {}",
        met(fork_us <= SPAWN_TARGET_US, "<= 800 µs"),
        met(jail_us <= JAIL_TARGET_US, "<= 500 µs"),
    );
    if let Some(floor) = floor_us {
        println!(
            "  (the floor, /bin/true spawned to its exit, is {floor:.0} µs here: {:.0} % of the \
             spawn target)",
            100.0 * floor / SPAWN_TARGET_US
        );
    }
}

/// The jail's cost at the VMM level, file backend: the same restores
/// without a jail and in `torpor vmm`'s own (cgroup, namespaces,
/// pivot_root, uid; a standby shell is jailed when it starts, so its
/// restore pays nothing more).
fn jail_cost(dir: &Path, snap: &Path, mem: u64, runs: usize, ab: &Option<PathBuf>) {
    // The VMM writes snapshot files 0600; a jailed VMM of another uid
    // reads them once sealed read-only for all, as the pod does.
    for entry in std::fs::read_dir(snap).unwrap().flatten() {
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(entry.path(), std::fs::Permissions::from_mode(0o644));
    }
    println!("\njail cost ({mem} MiB guest, file backend)");
    println!(
        "{:<21} {:>16} {:>16} {:>18} {:>18}",
        "", "cold->running", "cold->next line", "standby->running", "standby->next line"
    );
    for (label, jail) in [("no jail", false), ("jail", true)] {
        sides(ab, |side| {
            let cold: Vec<(f64, f64)> = (0..runs)
                .map(|_| cold_restore(dir, snap, "file", false, jail))
                .collect();
            let warm: Vec<(f64, f64)> = (0..runs)
                .map(|_| standby_restore(dir, snap, "file", mem, false, jail))
                .collect();
            println!(
                "{:<21} {:>13.0} µs {:>13.0} µs {:>15.0} µs {:>15.0} µs",
                format!("{side}{label}"),
                median(cold.iter().map(|x| x.0).collect()),
                median(cold.iter().map(|x| x.1).collect()),
                median(warm.iter().map(|x| x.0).collect()),
                median(warm.iter().map(|x| x.1).collect()),
            );
        });
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(spec) = args.windows(2).find(|w| w[0] == "--compare").map(|w| &w[1]) {
        let other = compare::Other::parse(spec).unwrap_or_else(|e| {
            eprintln!("{e}");
            std::process::exit(2);
        });
        let number = |flag: &str, default: usize| {
            args.windows(2).find(|w| w[0] == flag).map_or(default, |w| {
                w[1].parse().unwrap_or_else(|_| {
                    eprintln!("{flag} {}: expected a number", w[1]);
                    std::process::exit(2);
                })
            })
        };
        compare::run(
            &other,
            number("--samples", 10).max(1),
            number("--clones", 20).max(1),
        );
        return;
    }
    if args.last().is_some_and(|a| a == "--compare") {
        eprintln!("--compare: expected NAME=PATH, e.g. firecracker=PATH");
        std::process::exit(2);
    }
    let runs: usize = args
        .iter()
        .position(|a| a == "--runs")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    // `cargo test --all-targets` runs benches without `--bench`: then one
    // run per cell at 256 MiB only, a smoke test of the harness.
    let smoke = !args.iter().any(|a| a == "--bench");
    let runs = if smoke { 1 } else { runs };
    let quick = smoke || args.iter().any(|a| a == "--quick");
    let only: Vec<&str> = args
        .windows(2)
        .filter(|w| w[0] == "--only")
        .map(|w| w[1].as_str())
        .collect();
    let table = |name: &str| only.is_empty() || only.contains(&name);
    let ab: Option<PathBuf> = args
        .windows(2)
        .find(|w| w[0] == "--ab")
        .map(|w| PathBuf::from(&w[1]));
    let dir = tempfile::tempdir().unwrap();
    let sizes: &[u64] = if quick { &[256] } else { &[256, 2048] };
    println!("torpor restore benchmark ({runs} runs per cell, medians)");
    let mut start_floor = None;
    if table("start") {
        println!(
            "\n== VMM process start, standby 256 MiB ({} runs)",
            runs.max(5)
        );
        println!(
            "{:<26} {:>18} {:>18}",
            "process", "spawn->socket", "spawn->ready"
        );
        // The floor: a process that does nothing, spawn to exit.
        let floor: Vec<f64> = (0..runs.max(5)).map(|_| true_spawn()).collect();
        let floor = median(floor);
        println!(
            "{:<26} {:>15.0} µs {:>18}",
            "/bin/true (to exit)", floor, "-"
        );
        start_floor = Some(floor);
    }
    // Jailed runs are `torpor vmm`'s own jail (uid CLI_JAIL_UID): the
    // directory it writes in must be its.
    std::os::unix::fs::chown(dir.path(), Some(CLI_JAIL_UID), Some(CLI_JAIL_UID)).unwrap();
    // This tree's spawn -> socket medians, by row, for the targets.
    let mut to_socket: Vec<f64> = Vec::new();
    // A pod's jailed VMMs share one empty network namespace: made here as
    // a pod makes it, and named to the jailed row's second run.
    let netns = torpor_scheduler::service::jail::SharedNetns::make();
    let netns_arg = netns.as_ref().and_then(|n| n.path().to_str()).unwrap_or("");
    let pod_jail = ["--jail-netns", netns_arg];
    let mut starts: Vec<(&str, bool, &[&str])> = vec![
        ("torpor-vmm (LaunchSpec)", true, &["--no-jail"]),
        ("torpor vmm --standby", false, &["--no-jail"]),
        ("torpor vmm --standby, jail", false, &[]),
    ];
    // A baseline (`--ab`) may not know the flag.
    if netns.is_some() && ab.is_none() {
        starts.push(("  jail, pod's shared netns", false, &pod_jail));
    }
    for (label, small, jail) in starts.into_iter().filter(|_| table("start")) {
        // A and B alternate run by run, so that both see the same load.
        let mut runs_ab: Vec<Vec<(f64, Option<f64>)>> = Vec::new();
        for i in 0..runs.max(5) {
            let one = sides(&ab, |_| vmm_start(dir.path(), 256, small, jail, i));
            runs_ab.resize(one.len(), Vec::new());
            for (side, r) in one.into_iter().enumerate() {
                runs_ab[side].push(r);
            }
        }
        let names = sides(&ab, |side| side.to_string());
        for (side, starts) in names.iter().zip(runs_ab) {
            let ready: Vec<f64> = starts.iter().filter_map(|s| s.1).collect();
            let socket = median(starts.iter().map(|s| s.0).collect());
            if !side.starts_with('A') {
                to_socket.push(socket);
            }
            println!(
                "{:<26} {:>15.0} µs {:>18}",
                format!("{side}{label}"),
                socket,
                if ready.is_empty() {
                    "-".to_string()
                } else {
                    format!("{:.0} µs", median(ready))
                }
            );
        }
    }
    if table("start") {
        // The first fork starts the fork server: untimed.
        vmm_fork_start(dir.path(), 256, 0);
        // This tree's only (a baseline may not have a fork server).
        let forks: Vec<(f64, f64)> = (1..=runs.max(5))
            .map(|i| vmm_fork_start(dir.path(), 256, i))
            .collect();
        let socket = median(forks.iter().map(|f| f.0).collect());
        println!(
            "{:<26} {:>15.0} µs {:>15.0} µs",
            if ab.is_some() {
                "B torpor-vmm, forked"
            } else {
                "torpor-vmm, forked"
            },
            socket,
            median(forks.iter().map(|f| f.1).collect()),
        );
        to_socket.push(socket);
    }
    match to_socket[..] {
        [exec, plain, jailed, forked] => start_targets(exec, forked, jailed - plain, start_floor),
        [exec, plain, _, pod_jailed, forked] => {
            // The pod's jail (a shared network namespace) is the target's.
            start_targets(exec, forked, pod_jailed - plain, start_floor)
        }
        _ => {}
    }
    if table("seccomp") {
        // What the per-thread seccomp filters cost a standby restore (the main
        // thread installs its filter, one seccomp(2) call, on that path).
        let (snap, _) = make_template(dir.path(), "seccomp", 256, 8);
        println!("\n== seccomp, standby restore 256 MiB, file backend ({runs} runs)");
        println!(
            "{:<21} {:>18} {:>18}",
            "filters", "standby->running", "standby->next line"
        );
        for (label, flags) in [
            ("enforce", &["--seccomp", "enforce", "--no-jail"]),
            ("off", &["--seccomp", "off", "--no-jail"]),
        ] {
            let warm: Vec<(f64, f64)> = (0..runs)
                .map(|_| standby_restore_with(dir.path(), &snap, "file", 256, false, flags))
                .collect();
            println!(
                "{label:<21} {:>15.0} µs {:>15.0} µs",
                median(warm.iter().map(|x| x.0).collect()),
                median(warm.iter().map(|x| x.1).collect()),
            );
        }
        let _ = std::fs::remove_dir_all(&snap);
    }
    for &mem in sizes {
        if !["restore", "jail", "snapshots", "pss"]
            .iter()
            .any(|t| table(t))
        {
            break;
        }
        let (snap, _) = make_template(dir.path(), &format!("t{mem}"), mem, 8);
        if table("restore") {
            println!("\n== guest memory {mem} MiB (probe workload 8 MiB)");
            println!(
                "{:<21} {:>16} {:>16} {:>18} {:>18}",
                "backend",
                "cold->running",
                "cold->next line",
                "standby->running",
                "standby->next line"
            );
            record_working_set(dir.path(), &snap);
            let rows = [
                ("file", false),
                ("uffd", false),
                ("uffd-shared", false),
                ("uffd", true),
                ("uffd-shared", true),
            ];
            for (backend, prefetch) in rows {
                let cold: Vec<(f64, f64)> = (0..runs)
                    .map(|_| cold_restore(dir.path(), &snap, backend, prefetch, false))
                    .collect();
                let warm: Vec<(f64, f64)> = (0..runs)
                    .map(|_| standby_restore(dir.path(), &snap, backend, mem, prefetch, false))
                    .collect();
                let label = if prefetch {
                    format!("{backend}+prefetch")
                } else {
                    backend.to_string()
                };
                println!(
                    "{label:<21} {:>13.0} µs {:>13.0} µs {:>15.0} µs {:>15.0} µs",
                    median(cold.iter().map(|x| x.0).collect()),
                    median(cold.iter().map(|x| x.1).collect()),
                    median(warm.iter().map(|x| x.0).collect()),
                    median(warm.iter().map(|x| x.1).collect()),
                );
            }
        }

        if table("jail") {
            jail_cost(dir.path(), &snap, mem, runs, &ab);
        }

        if table("snapshots") {
            println!("\nsnapshots ({mem} MiB guest)");
            println!(
                "{:<22} {:>12} {:>14} {:>12}",
                "kind", "latency", "on disk", "pages"
            );
            for (label, pct) in [
                ("diff ~1% dirty", 1u64),
                ("diff ~10% dirty", 10),
                ("diff ~50% dirty", 50),
            ] {
                let mib = (mem * pct / 100).max(1);
                let (base, full) = make_template(dir.path(), &format!("d{mem}-{pct}"), mem, mib);
                if pct == 50 {
                    let f = &full["snapshot"];
                    println!(
                        "{:<22} {:>9.1} ms {:>10.1} MiB {:>12}",
                        format!("full ({mib} MiB data)"),
                        f["duration_us"].as_f64().unwrap() / 1000.0,
                        f["memory_allocated_bytes"].as_f64().unwrap() / 1048576.0,
                        f["pages"]
                    );
                }
                let d = &diff_snapshot(dir.path(), &base, &format!("diff{mem}-{pct}"))["snapshot"];
                println!(
                    "{:<22} {:>9.1} ms {:>10.1} MiB {:>12}",
                    format!("{label} ({mib} MiB)"),
                    d["duration_us"].as_f64().unwrap() / 1000.0,
                    d["memory_allocated_bytes"].as_f64().unwrap() / 1048576.0,
                    d["pages"]
                );
                let _ = std::fs::remove_dir_all(&base);
            }
        }

        if mem == 256 && table("pss") {
            let (pss_snap, _) = make_template(dir.path(), "pss", mem, 2);
            println!(
                "\nPSS per clone, 20 clones of one template ({mem} MiB guest, 2 MiB workload)"
            );
            println!(
                "{:<19} {:>14} {:>14} {:>26}",
                "backend", "paused", "running", "running - 2 MiB dirtied"
            );
            let row = |label: String, (paused, running): (f64, f64)| {
                println!(
                    "{label:<19} {paused:>10.2} MiB {running:>10.2} MiB {:>22.2} MiB  {}",
                    running - 2.0,
                    met(
                        paused <= PSS_TARGET_MIB,
                        &format!("paused <= {PSS_TARGET_MIB} MiB")
                    ),
                );
            };
            for backend in BACKENDS {
                sides(&ab, |side| {
                    row(
                        format!("{side}{backend}"),
                        clone_pss(dir.path(), &pss_snap, backend, false),
                    )
                });
            }
            // As a pod starts them: forked by the fork server (this
            // tree's only; a baseline may not have one).
            for backend in BACKENDS {
                row(
                    format!("{backend}, forked"),
                    clone_pss(dir.path(), &pss_snap, backend, true),
                );
            }
        }
    }
}
