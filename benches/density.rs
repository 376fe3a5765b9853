//! Density benchmark (issue 5): `torpor serve` with probe sandboxes, N on
//! the pod of which M stay active and the rest hibernated. Measures create
//! and hibernate throughput, memory per idle sandbox (PSS of the VMMs and of
//! the service, disk of hibernated snapshots) and wake latency through the
//! API (p50/p99 of the API's `resume_ms` and of the client round trip).
//!
//! `cargo bench --bench density [-- --total N --active M --wakes W --batch B
//! --quick]` (defaults 1000/100/200/100; `--quick` is 100/10/30). Sandboxes
//! are created B at a time, those beyond the first M hibernated after each
//! batch, so at most M + B run at once: idle probe guests tick at 100 Hz and
//! cost ~0.01 core each here, so 1,000 running at once saturate 2 cores
//! (`--batch 1000` creates all first). Everything goes through the REST API
//! over loopback with 4 client threads; the machine is shared, so absolute
//! numbers move from run to run. Without `--bench` (as `cargo test
//! --all-targets` runs it) it makes a smoke run with 4 sandboxes.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, Once, OnceLock};
use std::time::{Duration, Instant};

use serde_json::Value;
use torpor_sync::Locked;

mod common;

use common::{percentile as pct, TORPOR};
use torpor_scheduler::service::vmm::rollup_kib;
use torpor_vmm_api::host::kib_field;

const TOKEN: &str = "density-bench-token";
const THREADS: usize = 4;
/// Every request must be answered within this.
const REQUEST_LIMIT: Duration = Duration::from_secs(120);
const MIB: f64 = 1048576.0;
const CREATE: &str = r#"{"template":"probe","metadata":{"bench":"density"}}"#;

/// What `die` cleans up: the scratch directory and the serve process.
static SCRATCH: OnceLock<PathBuf> = OnceLock::new();
static SERVE: Mutex<Option<Child>> = Mutex::new(None);
static ADDR: OnceLock<String> = OnceLock::new();

fn scratch() -> &'static Path {
    SCRATCH.get().expect("scratch dir")
}

fn data_dir() -> PathBuf {
    scratch().join("data")
}

/// Kills the service and every process still running from our data
/// directory (its VMMs), by pid; removes the scratch directory. Returns how
/// many leftover VMMs it had to kill.
fn cleanup(sig: libc::c_int) -> usize {
    static ONCE: Once = Once::new();
    let mut killed = 0;
    ONCE.call_once(|| {
        let serve = SERVE.locked().take();
        if let Some(mut child) = serve {
            // SAFETY: signalling the serve process this bench spawned.
            unsafe { libc::kill(child.id() as libc::pid_t, sig) };
            let deadline = Instant::now() + Duration::from_secs(15);
            while child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        killed = kill_vmms();
        if std::env::var_os("TORPOR_KEEP_SCRATCH").is_none() {
            let _ = std::fs::remove_dir_all(scratch());
        }
    });
    killed
}

/// SIGKILLs processes whose command line names our (unique) data directory.
fn kill_vmms() -> usize {
    let needle = data_dir().to_string_lossy().into_owned();
    let me = std::process::id();
    let mut n = 0;
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let pid = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok());
        let pid = pid.unwrap_or(me);
        let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        if pid != me && String::from_utf8_lossy(&cmd).contains(&needle) {
            // SAFETY: a VMM started (through torpor serve) by this bench.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            n += 1;
        }
    }
    n
}

/// Aborts the benchmark: message, the service log's tail, cleanup, exit 1.
fn die(msg: &str) -> ! {
    static DYING: AtomicBool = AtomicBool::new(false);
    if DYING.swap(true, Ordering::SeqCst) {
        // Another thread is already reporting and cleaning up; it exits.
        loop {
            std::thread::park();
        }
    }
    eprintln!("\ndensity bench FAILED: {msg}");
    let log = std::fs::read_to_string(scratch().join("serve.log")).unwrap_or_default();
    let tail: Vec<&str> = log.lines().rev().take(15).collect();
    if !tail.is_empty() {
        eprintln!("-- last lines of torpor serve's log:");
        tail.iter().rev().for_each(|l| eprintln!("   {l}"));
    }
    cleanup(libc::SIGKILL);
    std::process::exit(1);
}

/// One request to the service (the benches' shared client).
fn http(method: &str, path: &str, body: Option<&str>) -> Result<(u16, String), String> {
    let addr = ADDR.get().expect("serve address");
    common::http::request(addr, TOKEN, method, path, body, REQUEST_LIMIT)
}

/// A request that must succeed (2xx); its JSON body (Null when empty).
fn api(method: &str, path: &str, body: Option<&str>) -> Value {
    match http(method, path, body) {
        Ok((status, text)) if (200..300).contains(&status) => {
            if text.trim().is_empty() {
                Value::Null
            } else {
                serde_json::from_str(&text)
                    .unwrap_or_else(|e| die(&format!("{method} {path}: not JSON ({e}): {text}")))
            }
        }
        Ok((status, text)) => die(&format!("{method} {path} -> HTTP {status}: {text}")),
        Err(e) => die(&format!("{method} {path}: {e}")),
    }
}

/// Runs `f(0..n)` on `THREADS` threads; progress to stderr every 100 (of
/// `of` in all, `base` done before).
fn par_map<T: Send>(n: usize, what: (&str, usize, usize), f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let (next, done) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let out: Mutex<Vec<Option<T>>> = Mutex::new((0..n).map(|_| None).collect());
    std::thread::scope(|s| {
        for _ in 0..THREADS {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= n {
                    break;
                }
                let v = f(i);
                out.lock().unwrap()[i] = Some(v);
                let d = done.fetch_add(1, Ordering::SeqCst) + 1;
                if (what.1 + d).is_multiple_of(100) {
                    eprintln!("  {}: {}/{}", what.0, what.1 + d, what.2);
                }
            });
        }
    });
    out.into_inner().unwrap().into_iter().flatten().collect()
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

/// (PSS, RSS) of a process, bytes (0 if gone).
fn pss_rss(pid: u64) -> (f64, f64) {
    let bytes = |key| rollup_kib(pid as u32, key).unwrap_or(0) as f64 * 1024.0;
    (bytes("Pss"), bytes("Rss"))
}

/// A /proc/meminfo field, bytes (0 if missing).
fn meminfo(name: &str) -> f64 {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    kib_field(&text, name).unwrap_or(0) as f64 * 1024.0
}

/// Kernel memory that is not reclaimable (where KVM's per-VM state goes);
/// host-wide, so other tenants of a shared machine move it too.
fn kernel_mem() -> f64 {
    let fields = "SUnreclaim KernelStack PageTables SecPageTables VmallocUsed";
    fields.split(' ').map(meminfo).sum()
}

/// utime + stime of a process, clock ticks.
fn cpu_ticks(pid: u64) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after_comm = stat.rsplit_once(')').map_or("", |r| r.1);
    let f: Vec<&str> = after_comm.split_whitespace().collect();
    let get = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    get(11) + get(12)
}

/// CPU cores the processes used over `window`.
fn cpu_cores(pids: &[u64], window: Duration) -> f64 {
    let ticks = || pids.iter().map(|p| cpu_ticks(*p)).sum::<f64>();
    let (t0, c0) = (Instant::now(), ticks());
    std::thread::sleep(window);
    let hz = torpor_scheduler::service::vmm::clock_ticks_per_second();
    (ticks() - c0) / hz / t0.elapsed().as_secs_f64()
}

fn arg(args: &[String], name: &str, default: usize) -> usize {
    let Some(i) = args.iter().position(|a| a == name) else {
        return default;
    };
    let v = args.get(i + 1).and_then(|v| v.parse().ok());
    v.unwrap_or_else(|| panic!("{name} needs a number"))
}

/// Starts `torpor serve` on a free port; returns once it listens.
fn start_serve() {
    let log = std::fs::File::create(scratch().join("serve.log")).expect("serve log");
    let mut child = Command::new(TORPOR)
        .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(data_dir())
        .args(["--token", TOKEN, "--policy-interval-ms", "0"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| die(&format!("spawn {TORPOR} serve: {e}")));
    let out = child.stdout.take().expect("stdout");
    *SERVE.lock().unwrap() = Some(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if let Some(rest) = line.split("listening on http://").nth(1) {
                let _ = tx.send(rest.trim().to_string());
            }
        }
    });
    let addr = rx
        .recv_timeout(Duration::from_secs(180))
        .unwrap_or_else(|_| die("torpor serve did not start listening within 180 s"));
    ADDR.set(addr).expect("one serve");
}

/// (id, VMM pid) of the listed sandboxes.
fn ids(list: &Value) -> Vec<(String, u64)> {
    let all = list["sandboxes"].as_array().cloned().unwrap_or_default();
    let pid = |s: &Value| s["vmm"]["pid"].as_u64().unwrap_or(0);
    all.iter()
        .map(|s| (s["id"].as_str().unwrap_or_default().to_string(), pid(s)))
        .collect()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    // `cargo test --all-targets` runs benches without `--bench`: smoke size.
    let smoke = !args.iter().any(|a| a == "--bench");
    let d =
        [[1000, 100, 200], [100, 10, 30], [4, 1, 2]][if smoke { 2 } else { usize::from(quick) }];
    let total = arg(&args, "--total", d[0]);
    let active = arg(&args, "--active", d[1]).min(total);
    let wakes = arg(&args, "--wakes", d[2]);
    let batch = arg(&args, "--batch", 100).max(1);
    if smoke {
        eprintln!("density: no --bench argument (cargo test): smoke run with 4 sandboxes");
    }
    let sleeping = total - active;
    // Kept past drop: `cleanup` removes it, on every way out (signals too).
    let dir = tempfile::tempdir().expect("scratch dir").keep();
    SCRATCH.set(dir).expect("once");
    let host_ram = meminfo("MemTotal");
    let kern0 = kernel_mem();
    eprintln!("density: starting torpor serve in {}", scratch().display());
    let t = Instant::now();
    start_serve();
    let serve_start_ms = ms(t);
    let serve_pid = SERVE
        .lock()
        .unwrap()
        .as_ref()
        .map_or(0, |c| u64::from(c.id()));

    // Admission: the pod must allow `total` sandboxes to hold a VMM at once.
    let tmpl = api("GET", "/v1/templates", None)["templates"]
        .as_array()
        .and_then(|a| a.iter().find(|t| t["name"] == "probe").cloned())
        .unwrap_or_else(|| die("no built-in probe template"));
    let mem_mib = tmpl["mem_mib"].as_f64().unwrap_or(64.0);
    let pod = &api("GET", "/v1/pods", None)["pods"][0];
    let pod_id = pod["id"].as_str().unwrap_or("pod_local").to_string();
    let pod_mib = pod["memory_bytes"].as_f64().unwrap_or(host_ram) / MIB;
    let mut ratio = pod["oversubscription_ratio"].as_f64().unwrap_or(4.0);
    let mut ratio_note = format!("{ratio} (default)");
    let need = total as f64 * mem_mib;
    if need > pod_mib * ratio {
        let old = ratio;
        ratio = (need / pod_mib * 1.05 * 100.0).ceil() / 100.0;
        let body = format!(r#"{{"oversubscription_ratio":{ratio}}}"#);
        api("PATCH", &format!("/v1/pods/{pod_id}"), Some(&body));
        ratio_note = format!(
            "{ratio} (raised from {old}: {total} x {mem_mib} MiB > {old} x {pod_mib:.0} MiB)"
        );
        eprintln!("density: admission would refuse; oversubscription ratio raised to {ratio}");
    }

    // 1-2. Create in batches of `batch`; hibernate the batch's sandboxes
    // beyond the first `active` right after it (peak active + batch running).
    eprintln!(
        "density: creating {total} probe sandboxes, hibernating {sleeping}, batches of {batch}"
    );
    let (mut created, mut hib_lat) = (Vec::new(), Vec::new());
    let (mut create_s, mut hib_s, mut peak) = (0.0, 0.0, (0, 0.0, 0.0, 0.0));
    while created.len() < total {
        let (start, n) = (created.len(), batch.min(total - created.len()));
        let t = Instant::now();
        created.extend(par_map(n, ("created", start, total), |_| {
            let t = Instant::now();
            let v = api("POST", "/v1/sandboxes", Some(CREATE));
            if v["state"] != "running" {
                die(&format!("created sandbox is not running: {v}"));
            }
            let pid = v["vmm"]["pid"].as_u64().unwrap_or(0);
            (v["id"].as_str().unwrap_or_default().to_string(), ms(t), pid)
        }));
        create_s += t.elapsed().as_secs_f64();
        let running = created.len() - hib_lat.len();
        if running > peak.0 {
            let asleep = active..active + hib_lat.len();
            let on = created
                .iter()
                .enumerate()
                .filter(|(i, _)| !asleep.contains(i));
            let pids: Vec<u64> = on.map(|(_, c)| c.2).collect();
            let cpu = cpu_cores(&pids, Duration::from_secs(3));
            let pss = api("GET", "/v1/pods", None)["pods"][0]["pss_mib"].as_f64();
            peak = (running, cpu, pss.unwrap_or(f64::NAN), kernel_mem());
        }
        let (from, base) = (start.max(active), hib_lat.len());
        let t = Instant::now();
        hib_lat.extend(par_map(
            created.len().saturating_sub(from),
            ("hibernated", base, sleeping),
            |i| {
                let t = Instant::now();
                let id = &created[from + i].0;
                let v = api("POST", &format!("/v1/sandboxes/{id}/hibernate"), None);
                if v["sandbox"]["state"] != "hibernated" {
                    die(&format!("hibernate did not hibernate: {v}"));
                }
                ms(t)
            },
        ));
        hib_s += t.elapsed().as_secs_f64();
    }
    let create_lat: Vec<f64> = created.iter().map(|c| c.1).collect();
    let (peak_n, cpu_all, pss_all, kern_all) = peak;

    // 3. Memory with `active` running and the rest hibernated.
    let running = ids(&api("GET", "/v1/sandboxes?state=running", None));
    let hibernated = ids(&api("GET", "/v1/sandboxes?state=hibernated", None));
    if running.len() != active || hibernated.len() != sleeping {
        die(&format!(
            "expected {active} running and {sleeping} hibernated, the API lists {} and {}",
            running.len(),
            hibernated.len()
        ));
    }
    let pids: Vec<u64> = running.iter().map(|r| r.1).collect();
    let cpu_active = cpu_cores(&pids, Duration::from_secs(3));
    let pod = api("GET", "/v1/pods", None)["pods"][0].clone();
    let api_pss = pod["pss_mib"].as_f64().unwrap_or(f64::NAN) * MIB;
    let (vmm_pss, vmm_rss) = running
        .iter()
        .map(|(_, pid)| pss_rss(*pid))
        .fold((0.0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1));
    let (serve_pss, serve_rss) = pss_rss(serve_pid);
    let kern_now = kernel_mem();
    let sbx_dir = data_dir().join("sandboxes");
    let hib_disk: u64 = hibernated
        .iter()
        .map(|(id, _)| torpor_storage::allocated_bytes(&sbx_dir.join(id)))
        .sum();
    let run_disk: u64 = running
        .iter()
        .map(|(id, _)| torpor_storage::allocated_bytes(&sbx_dir.join(id)))
        .sum();
    let tmpl_disk = torpor_storage::allocated_bytes(&data_dir().join("templates"));
    let ram_total = vmm_pss + serve_pss;

    // 4. Wake random hibernated sandboxes, hibernating each again after.
    eprintln!("density: {wakes} wakes of random hibernated sandboxes (one client)");
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    let mut rng = now.map_or(1, |d| d.as_nanos() as u64 | 1);
    let (mut api_ms, mut rtt_ms, mut rehib_ms) = (Vec::new(), Vec::new(), Vec::new());
    let wakes = if sleeping == 0 { 0 } else { wakes };
    for k in 0..wakes {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let id = &hibernated[(rng % hibernated.len() as u64) as usize].0;
        let t = Instant::now();
        let v = api("POST", &format!("/v1/sandboxes/{id}/resume"), None);
        rtt_ms.push(ms(t));
        if v["resumed"] != true || v["sandbox"]["state"] != "running" {
            die(&format!("resume of hibernated {id} did not wake it: {v}"));
        }
        api_ms.push(v["resume_ms"].as_f64().unwrap_or(f64::NAN));
        let t = Instant::now();
        api("POST", &format!("/v1/sandboxes/{id}/hibernate"), None);
        rehib_ms.push(ms(t));
        if (k + 1).is_multiple_of(100) {
            eprintln!("  woken: {}/{wakes}", k + 1);
        }
    }

    // 5. Delete everything, stop the service, kill what is left.
    eprintln!("density: deleting {total} sandboxes");
    let t = Instant::now();
    par_map(total, ("deleted", 0, total), |i| {
        api("DELETE", &format!("/v1/sandboxes/{}", created[i].0), None);
    });
    let delete_s = t.elapsed().as_secs_f64();
    let leftovers = cleanup(libc::SIGINT);

    // The report.
    let gib = |b: f64| b / (1024.0 * MIB);
    let mib = |b: f64| b / MIB;
    let per = |x: f64, n: usize| if n == 0 { f64::NAN } else { x / n as f64 };
    let lat = |v: &[f64]| {
        let (p50, p99, max) = (pct(v, 0.5), pct(v, 0.99), pct(v, 1.0));
        format!("p50 {p50:.1} / p99 {p99:.1} / max {max:.1} ms")
    };
    println!("\ntorpor density benchmark (probe template, {mem_mib} MiB per sandbox, policy off)");
    println!("shared 2-core machine: absolute numbers are noisy from run to run\n");
    let rate = |n: usize, s: f64| format!("{n} in {s:.1} s = {:.1}/s", n as f64 / s);
    let (hib_disk, run_disk, tmpl_disk) = (hib_disk as f64, run_disk as f64, tmpl_disk as f64);
    #[rustfmt::skip]
    let rows = vec![
        ("sandboxes total / active / hibernated", format!("{total} / {active} / {sleeping}")),
        ("host RAM (pod memory)", format!("{:.1} GiB ({pod_mib:.0} MiB)", gib(host_ram))),
        ("oversubscription ratio", ratio_note),
        ("serve start (builds probe template)", format!("{:.1} s", serve_start_ms / 1000.0)),
        ("create (4 client threads)", format!("{} (batches of {batch})", rate(total, create_s))),
        ("  create latency", lat(&create_lat)),
        ("  peak running: count; CPU of the VMMs", format!("{peak_n}; {cpu_all:.2} cores")),
        ("  peak running: pod PSS; kernel growth", format!("{pss_all:.0} MiB; {:.0} MiB (host-wide)",
            mib(kern_all - kern0))),
        ("hibernate (4 client threads)", rate(sleeping, hib_s)),
        ("  hibernate latency", lat(&hib_lat)),
        ("PSS of active VMMs (ours / pod pss_mib)",
            format!("{:.1} / {:.1} MiB", mib(vmm_pss), mib(api_pss))),
        ("  PSS (RSS) per active sandbox",
            format!("{:.2} MiB ({:.2} MiB)", mib(per(vmm_pss, active)), mib(per(vmm_rss, active)))),
        ("  CPU of the active (idle) VMMs", format!("{cpu_active:.2} cores")),
        ("torpor serve PSS / RSS", format!("{:.1} MiB / {:.1} MiB", mib(serve_pss), mib(serve_rss))),
        ("memory per idle sandbox",
            format!("{:.2} MiB = (VMMs + serve PSS) / {total}", mib(per(ram_total, total)))),
        ("  kernel memory growth (host-wide)", format!("{:.0} MiB = {:.2} MiB each",
            mib(kern_now - kern0), mib(per(kern_now - kern0, total)))),
        ("disk per hibernated sandbox (du)",
            format!("{:.2} MiB ({:.1} MiB in all)", mib(per(hib_disk, sleeping)), mib(hib_disk))),
        ("disk per active sandbox / template",
            format!("{:.2} MiB / {:.1} MiB", mib(per(run_disk, active)), mib(tmpl_disk))),
        ("wake (API resume_ms)", lat(&api_ms)),
        ("wake (client round trip)", lat(&rtt_ms)),
        ("  re-hibernate after wake", lat(&rehib_ms)),
        ("delete (4 client threads)", rate(total, delete_s)),
        ("leftover VMMs killed after stop", leftovers.to_string()),
    ];
    for (k, v) in rows {
        println!("{k:<42} {v}");
    }
    let used = ram_total + (kern_now - kern0).max(0.0);
    println!(
        "\n=> {total} sandboxes with {active} active {} on this pod: {:.2} GiB RAM ({:.2} GiB VMM + serve PSS, + kernel growth; {:.1}% of {:.1} GiB), {:.2} MiB per sandbox; {:.1} MiB of hibernated snapshots on disk",
        if used < host_ram { "fit" } else { "do NOT fit" },
        gib(used),
        gib(ram_total),
        100.0 * used / host_ram,
        gib(host_ram),
        mib(per(used, total)),
        mib(hib_disk),
    );
    if (total, active) != (1000, 100) && !smoke {
        let est = 100.0 * per(vmm_pss + kern_now - kern0, active) + serve_pss;
        println!(
            "   (extrapolated to 1,000 with 100 active: ~{:.2} GiB RAM, ~{:.1} MiB disk; run without --quick to measure)",
            gib(est),
            mib(900.0 * per(hib_disk, sleeping))
        );
    }
}
