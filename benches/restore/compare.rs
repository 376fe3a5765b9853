//! `cargo bench --bench restore -- --compare firecracker=PATH [--samples N]
//! [--clones N]`: torpor-vmm side by side with another VMM binary on the
//! probe guest (issue 31), so that the ratios can be reproduced by anyone
//! with such a binary. One table of medians for 256 MiB and 1 GiB guests:
//! spawn to the control/API socket, boot to the probe's READY line, full
//! snapshot (pause + create), restore to the guest's next ITER line and
//! PSS per paused clone; and torpor-vmm forked by its fork server (as a pod
//! starts it) against the other's exec'd spawn and PSS.
//!
//! Both sides run the same way: no jail (no `jailer` for Firecracker),
//! one vCPU, the probe's 8 MiB workload at one tick, the `file` memory
//! backend (Firecracker's `File`: both map the memory file privately), the
//! guest console in a file. torpor-vmm gets a `LaunchSpec` on stdin, as a
//! pod starts it; Firecracker its API socket, over which every request is
//! sent with the project's HTTP client (`torpor_client`). The two sides
//! alternate sample by sample so that both see the same load.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use comfy_table::{presets::ASCII_MARKDOWN, Table};
use torpor_client::{Endpoint, HttpClient};
use torpor_scheduler::service::vmm::pss_kib;

use crate::common::{call, iter_lines, median, shutdown, wait_socket, wait_until, TORPOR_VMM};

/// The probe's command line on both sides.
const CMDLINE: &str = "probe.mib=8 probe.ticks=1";
/// Guest sizes, MiB.
const SIZES: [u64; 2] = [256, 1024];
/// How long a guest may take to reach a console line.
const LINE_LIMIT: Duration = Duration::from_secs(60);

/// The other VMM: its kind (which API it speaks) and binary.
#[derive(Debug)]
pub struct Other {
    kind: Kind,
    path: PathBuf,
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    Firecracker,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Firecracker => "firecracker",
        }
    }
}

impl Other {
    /// `NAME=PATH` of `--compare`; an error names what is wrong.
    pub fn parse(spec: &str) -> Result<Other, String> {
        let (name, path) = spec.split_once('=').ok_or_else(|| {
            format!("--compare {spec}: expected NAME=PATH, e.g. firecracker=PATH")
        })?;
        let kind = match name {
            "firecracker" => Kind::Firecracker,
            _ => {
                return Err(format!(
                    "--compare {spec}: unknown VMM `{name}` (known: firecracker)"
                ))
            }
        };
        let path = PathBuf::from(path);
        let meta = std::fs::metadata(&path)
            .map_err(|e| format!("--compare {spec}: {}: {e}", path.display()))?;
        use std::os::unix::fs::PermissionsExt;
        if !meta.is_file() || meta.permissions().mode() & 0o111 == 0 {
            return Err(format!(
                "--compare {spec}: {} is not an executable file",
                path.display()
            ));
        }
        let path = path.canonicalize().map_err(|e| e.to_string())?;
        Ok(Other { kind, path })
    }
}

/// One VMM process and where its guest writes its console.
struct Vm {
    child: Child,
    sock: PathBuf,
    console: PathBuf,
}

/// The first complete console line starting with `prefix`, if any yet.
fn has_line(console: &Path, prefix: &str) -> bool {
    let text = std::fs::read_to_string(console).unwrap_or_default();
    let end = text.rfind('\n').map_or(0, |i| i + 1);
    text[..end].lines().any(|l| l.starts_with(prefix))
}

/// A fresh socket and console path for `name` in `dir`.
fn paths(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
    let sock = dir.join(format!("{name}.sock"));
    let console = dir.join(format!("{name}.log"));
    let _ = std::fs::remove_file(&sock);
    let _ = std::fs::remove_file(&console);
    (sock, console)
}

// ---- torpor-vmm -------------------------------------------------------

/// `torpor-vmm` with `mode` (a `LaunchMode` as JSON) on stdin.
fn torpor_spawn(sock: &Path, console: &Path, mode: serde_json::Value) -> Child {
    let spec = serde_json::json!({
        "control_socket": sock,
        "mode": mode,
        "console": {"to": "file", "path": console},
    });
    let mut child = Command::new(TORPOR_VMM)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn torpor-vmm");
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(spec.to_string().as_bytes()).unwrap();
    drop(stdin);
    child
}

/// Boots the probe: (spawn -> socket, spawn -> READY line), µs.
fn torpor_boot(dir: &Path, name: &str, mem: u64) -> (Vm, f64, f64) {
    let (sock, console) = paths(dir, name);
    let t0 = Instant::now();
    let child = torpor_spawn(
        &sock,
        &console,
        serde_json::json!({
            "kind": "boot",
            "kernel": {"builtin": "probe"},
            "cmdline": CMDLINE,
            "mem_mib": mem,
            "vcpus": 1,
        }),
    );
    wait_socket(&sock);
    let to_socket = t0.elapsed().as_micros() as f64;
    wait_until(LINE_LIMIT, || has_line(&console, "TORPOR-PROBE READY"));
    let to_ready = t0.elapsed().as_micros() as f64;
    (
        Vm {
            child,
            sock,
            console,
        },
        to_socket,
        to_ready,
    )
}

/// Pause + full snapshot into `out`, µs.
fn torpor_snapshot(vm: &Vm, out: &Path) -> f64 {
    let t0 = Instant::now();
    call(&vm.sock, r#"{"op":"pause"}"#);
    call(
        &vm.sock,
        &format!(r#"{{"op":"snapshot","path":"{}"}}"#, out.display()),
    );
    t0.elapsed().as_micros() as f64
}

/// A restore of `snap` in a new process (paused or not).
fn torpor_restore_spawn(dir: &Path, name: &str, snap: &Path, paused: bool) -> Vm {
    let (sock, console) = paths(dir, name);
    let child = torpor_spawn(
        &sock,
        &console,
        serde_json::json!({
            "kind": "restore",
            "restore": {"snapshot": snap, "backend": "file"},
            "paused": paused,
        }),
    );
    Vm {
        child,
        sock,
        console,
    }
}

/// Cold restore: spawn -> the guest's next ITER line, µs.
fn torpor_cold(dir: &Path, snap: &Path) -> f64 {
    let t0 = Instant::now();
    let vm = torpor_restore_spawn(dir, "t-cold", snap, false);
    wait_until(LINE_LIMIT, || iter_lines(&vm.console) >= 1);
    let us = t0.elapsed().as_micros() as f64;
    wait_socket(&vm.sock);
    shutdown(&vm.sock, vm.child);
    us
}

/// Standby shell (started untimed): (restore request, request -> next
/// ITER line), µs.
fn torpor_standby(dir: &Path, snap: &Path, mem: u64) -> (f64, f64) {
    let (sock, console) = paths(dir, "t-standby");
    let child = torpor_spawn(
        &sock,
        &console,
        serde_json::json!({"kind": "standby", "mem_mib": mem, "vcpus": 1}),
    );
    wait_socket(&sock);
    let t0 = Instant::now();
    call(
        &sock,
        &format!(
            r#"{{"op":"restore","snapshot":"{}","backend":"file","console":{{"to":"file","path":"{}"}}}}"#,
            snap.display(),
            console.display()
        ),
    );
    let request = t0.elapsed().as_micros() as f64;
    wait_until(LINE_LIMIT, || iter_lines(&console) >= 1);
    let to_line = t0.elapsed().as_micros() as f64;
    shutdown(&sock, child);
    (request, to_line)
}

/// `clones` paused restores of `snap`: median PSS, MiB.
fn torpor_pss(dir: &Path, snap: &Path, clones: usize) -> f64 {
    let vms: Vec<Vm> = (0..clones)
        .map(|i| torpor_restore_spawn(dir, &format!("t-pss{i}"), snap, true))
        .collect();
    for vm in &vms {
        wait_socket(&vm.sock);
        // An answer means the restore is done (start-up's heap returned).
        call(&vm.sock, r#"{"op":"status"}"#);
    }
    let pss = median(vms.iter().map(|vm| pss_mib(vm.child.id())).collect());
    for vm in vms {
        shutdown(&vm.sock, vm.child);
    }
    pss
}

/// As [`torpor_pss`], each clone forked by the fork server.
fn torpor_pss_forked(dir: &Path, snap: &Path, clones: usize) -> f64 {
    let vms: Vec<(super::CloneVm, PathBuf)> = (0..clones)
        .map(|i| {
            let (sock, console) = paths(dir, &format!("t-fpss{i}"));
            (super::forked_clone(snap, "file", &sock, &console), sock)
        })
        .collect();
    for (_, sock) in &vms {
        wait_socket(sock);
        call(sock, r#"{"op":"status"}"#);
    }
    let pss = median(vms.iter().map(|(c, _)| pss_mib(c.id())).collect());
    for (clone, sock) in vms {
        clone.shutdown(&sock);
    }
    pss
}

fn pss_mib(pid: u32) -> f64 {
    pss_kib(pid).map_or(f64::NAN, |k| k as f64 / 1024.0)
}

// ---- Firecracker ------------------------------------------------------

/// One request on Firecracker's API socket; panics unless it is a 2xx.
fn fc_request(sock: &Path, method: &str, path: &str, body: serde_json::Value) {
    let endpoint = Endpoint::Unix { path: sock.into() };
    let client = HttpClient::new(endpoint, None, Duration::from_secs(120)).expect("client");
    let body = body.to_string();
    let answer = client
        .request(
            method,
            path,
            Some(("application/json", body.as_bytes())),
            None,
        )
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
    assert!(
        answer.is_success(),
        "{method} {path} {body} -> {}: {}",
        answer.status,
        String::from_utf8_lossy(&answer.body)
    );
}

/// `PATH --api-sock SOCK`, the guest's serial console (its stdout) in
/// `console`, its log beside it.
fn fc_spawn(bin: &Path, sock: &Path, console: &Path) -> Child {
    let out = std::fs::File::create(console).expect("console file");
    Command::new(bin)
        .arg("--api-sock")
        .arg(sock)
        .arg("--log-path")
        .arg(console.with_extension("fc-log"))
        .arg("--level")
        .arg("Warning")
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {}: {e}", bin.display()))
}

fn fc_stop(mut vm: Vm) {
    // Firecracker has no shutdown request for a guest without ACPI
    // power-off: its process is the VM.
    let _ = vm.child.kill();
    let _ = vm.child.wait();
    let _ = std::fs::remove_file(&vm.sock);
}

/// Boots the probe: (spawn -> socket, spawn -> READY line), µs; the
/// second includes the configuration requests, Firecracker's way to boot.
fn fc_boot(bin: &Path, dir: &Path, name: &str, kernel: &Path, mem: u64) -> (Vm, f64, f64) {
    let (sock, console) = paths(dir, name);
    let t0 = Instant::now();
    let child = fc_spawn(bin, &sock, &console);
    wait_socket(&sock);
    let to_socket = t0.elapsed().as_micros() as f64;
    fc_request(
        &sock,
        "PUT",
        "/boot-source",
        serde_json::json!({"kernel_image_path": kernel, "boot_args": CMDLINE}),
    );
    fc_request(
        &sock,
        "PUT",
        "/machine-config",
        serde_json::json!({"vcpu_count": 1, "mem_size_mib": mem}),
    );
    fc_request(
        &sock,
        "PUT",
        "/actions",
        serde_json::json!({"action_type": "InstanceStart"}),
    );
    wait_until(LINE_LIMIT, || has_line(&console, "TORPOR-PROBE READY"));
    let to_ready = t0.elapsed().as_micros() as f64;
    (
        Vm {
            child,
            sock,
            console,
        },
        to_socket,
        to_ready,
    )
}

/// Pause + full snapshot into `out` (`vmstate`, `mem`), µs.
fn fc_snapshot(vm: &Vm, out: &Path) -> f64 {
    std::fs::create_dir_all(out).unwrap();
    let t0 = Instant::now();
    fc_request(
        &vm.sock,
        "PATCH",
        "/vm",
        serde_json::json!({"state": "Paused"}),
    );
    fc_request(
        &vm.sock,
        "PUT",
        "/snapshot/create",
        serde_json::json!({
            "snapshot_type": "Full",
            "snapshot_path": out.join("vmstate"),
            "mem_file_path": out.join("mem"),
        }),
    );
    t0.elapsed().as_micros() as f64
}

/// A new process loading `snap`: the process, when it was spawned, when
/// the load request was sent and how long it took (µs).
fn fc_load(
    bin: &Path,
    dir: &Path,
    name: &str,
    snap: &Path,
    resume: bool,
) -> (Vm, Instant, Instant, f64) {
    let (sock, console) = paths(dir, name);
    let t0 = Instant::now();
    let child = fc_spawn(bin, &sock, &console);
    wait_socket(&sock);
    let t1 = Instant::now();
    fc_request(
        &sock,
        "PUT",
        "/snapshot/load",
        serde_json::json!({
            "snapshot_path": snap.join("vmstate"),
            "mem_backend": {"backend_type": "File", "backend_path": snap.join("mem")},
            "resume_vm": resume,
        }),
    );
    let request = t1.elapsed().as_micros() as f64;
    (
        Vm {
            child,
            sock,
            console,
        },
        t0,
        t1,
        request,
    )
}

/// (load request, spawn -> next ITER line, load request -> next ITER
/// line), µs.
fn fc_restore(bin: &Path, dir: &Path, snap: &Path) -> (f64, f64, f64) {
    let (vm, t0, t1, request) = fc_load(bin, dir, "f-restore", snap, true);
    wait_until(LINE_LIMIT, || iter_lines(&vm.console) >= 1);
    let (cold, warm) = (
        t0.elapsed().as_micros() as f64,
        t1.elapsed().as_micros() as f64,
    );
    fc_stop(vm);
    (request, cold, warm)
}

/// `clones` paused loads of `snap`: median PSS, MiB.
fn fc_pss(bin: &Path, dir: &Path, snap: &Path, clones: usize) -> f64 {
    let vms: Vec<Vm> = (0..clones)
        .map(|i| fc_load(bin, dir, &format!("f-pss{i}"), snap, false).0)
        .collect();
    let pss = median(vms.iter().map(|vm| pss_mib(vm.child.id())).collect());
    for vm in vms {
        fc_stop(vm);
    }
    pss
}

// ---- the table --------------------------------------------------------

/// The medians of one guest size: torpor's and the other's, per row.
struct Column {
    rows: Vec<(f64, f64)>,
}

const ROWS: [(&str, &str); 9] = [
    ("spawn -> API/control socket", "ms"),
    ("boot: spawn -> probe READY", "ms"),
    ("full snapshot (pause + create)", "ms"),
    ("restore, new process -> next ITER", "ms"),
    ("restore request (standby / load)", "ms"),
    ("restore request -> next ITER", "ms"),
    ("PSS per paused clone", "MiB"),
    // torpor-vmm forked by its fork server, as a pod starts it, against
    // the other's exec'd figure of the row above (it has no such server).
    ("spawn -> control socket, forked / exec'd", "ms"),
    ("PSS per paused clone, forked / exec'd", "MiB"),
];

fn one_size(
    other: &Other,
    dir: &Path,
    kernel: &Path,
    mem: u64,
    samples: usize,
    clones: usize,
) -> Column {
    let bin = &other.path;
    let mut t: Vec<Vec<f64>> = vec![Vec::new(); ROWS.len()];
    let mut f: Vec<Vec<f64>> = vec![Vec::new(); ROWS.len()];
    let t_snap = dir.join(format!("t{mem}"));
    let f_snap = dir.join(format!("f{mem}"));
    // Boots and full snapshots; the first snapshot of each is the template.
    for i in 0..samples {
        let out = |p: &Path| {
            if i == 0 {
                p.to_path_buf()
            } else {
                dir.join(format!("{}-{i}", p.file_name().unwrap().to_string_lossy()))
            }
        };
        let (vm, socket, ready) = torpor_boot(dir, "t-boot", mem);
        wait_until(LINE_LIMIT, || iter_lines(&vm.console) >= 2);
        let snap = torpor_snapshot(&vm, &out(&t_snap));
        shutdown(&vm.sock, vm.child);
        t[0].push(socket);
        t[1].push(ready);
        t[2].push(snap);
        let (vm, socket, ready) = fc_boot(bin, dir, "f-boot", kernel, mem);
        wait_until(LINE_LIMIT, || iter_lines(&vm.console) >= 2);
        let snap = fc_snapshot(&vm, &out(&f_snap));
        fc_stop(vm);
        f[0].push(socket);
        f[1].push(ready);
        f[2].push(snap);
        if i > 0 {
            let _ = std::fs::remove_dir_all(out(&t_snap));
            let _ = std::fs::remove_dir_all(out(&f_snap));
        }
    }
    for _ in 0..samples {
        t[3].push(torpor_cold(dir, &t_snap));
        let (request, to_line) = torpor_standby(dir, &t_snap, mem);
        t[4].push(request);
        t[5].push(to_line);
        let (request, cold, warm) = fc_restore(bin, dir, &f_snap);
        f[3].push(cold);
        f[4].push(request);
        f[5].push(warm);
    }
    t[6].push(torpor_pss(dir, &t_snap, clones));
    f[6].push(fc_pss(bin, dir, &f_snap, clones));
    // The first fork starts the fork server: untimed.
    super::vmm_fork_start(dir, mem, 0);
    for i in 1..=samples {
        t[7].push(super::vmm_fork_start(dir, mem, i).0);
    }
    f[7] = f[0].clone();
    t[8].push(torpor_pss_forked(dir, &t_snap, clones));
    f[8] = f[6].clone();
    let _ = std::fs::remove_dir_all(&t_snap);
    let _ = std::fs::remove_dir_all(&f_snap);
    let ms = |v: &Vec<f64>, unit: &str| {
        if unit == "ms" {
            median(v.clone()) / 1000.0
        } else {
            median(v.clone())
        }
    };
    Column {
        rows: ROWS
            .iter()
            .enumerate()
            .map(|(r, (_, unit))| (ms(&t[r], unit), ms(&f[r], unit)))
            .collect(),
    }
}

/// Runs the comparison and prints its table.
pub fn run(other: &Other, samples: usize, clones: usize) {
    let dir = tempfile::tempdir().unwrap();
    let kernel = dir.path().join("probe.elf");
    std::fs::write(&kernel, torpor_probe::PROBE_ELF).unwrap();
    let name = other.kind.name();
    println!(
        "torpor-vmm against {name} ({}), probe guest, medians of {samples} \
         (PSS: median of {clones} clones)",
        other.path.display()
    );
    let columns: Vec<(u64, Column)> = SIZES
        .iter()
        .map(|&mem| {
            let c = one_size(other, dir.path(), &kernel, mem, samples, clones);
            (mem, c)
        })
        .collect();
    let mut table = Table::new();
    let mut header = vec!["".to_string()];
    for (mem, _) in &columns {
        let size = if *mem >= 1024 {
            format!("{} GiB", mem / 1024)
        } else {
            format!("{mem} MiB")
        };
        header.push(format!("{size} torpor-vmm"));
        header.push(format!("{size} {name}"));
        header.push(format!("{size} ratio"));
    }
    table.load_style(ASCII_MARKDOWN).set_header(header);
    for (r, (label, unit)) in ROWS.iter().enumerate() {
        let mut row = vec![format!("{label} ({unit})")];
        for (_, c) in &columns {
            let (t, o) = c.rows[r];
            let prec = if *unit == "MiB" || t < 10.0 { 2 } else { 1 };
            row.push(format!("{t:.prec$}"));
            row.push(format!("{o:.prec$}"));
            row.push(format!("{:.2}", t / o));
        }
        table.add_row(row);
    }
    println!("{table}");
    println!("ratio: torpor-vmm / {name} (below 1: torpor-vmm faster or smaller)");
}
