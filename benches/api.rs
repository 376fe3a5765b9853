//! API benchmark: `torpor serve` measured through its REST API, per
//! configuration: probe template of 256 MiB or 2 GiB × standby pool on
//! (`--standby-pool 2`) or off (`--standby-pool 0`) × memory backend
//! (`--memory-backend file|uffd|uffd-shared`), and the service's defaults
//! (neither flag). Each configuration gets its own `torpor serve` (scratch
//! data directory, `--listen 127.0.0.1:0`, `--policy-interval-ms 0` so
//! nothing hibernates behind the bench's back), stopped at its end.
//!
//! Per configuration: create latency (request -> 201 with the guest
//! running) with the answer's `restore` object (`path`, `backend`, `ms`,
//! `vmm_ms`); wake of a hibernated sandbox (from the resume request's start
//! to its 200, and to the first new probe line in the sandbox's
//! `console.log`); pause, resume and hibernate latency;
//! sustained creates per second (client threads creating, two threads
//! deleting behind them); PSS per paused and per running clone (sum of the
//! clones' VMM processes' PSS / clones). The table marks the issue's
//! targets met or missed. A field the service does not answer (yet) prints
//! as "-"; a configuration whose `serve` rejects a flag is skipped with a
//! note.
//!
//! `cargo bench --bench api [-- --quick --runs N --clones N --secs S
//! --threads T --only pool|nopool|default|file|uffd|uffd-shared|256|2048]`
//! (`--only` repeats and takes comma lists: OR within a dimension, AND
//! across). Defaults: 30 samples, 100 clones, 30 s, 4 threads, 256 MiB and
//! 2 GiB; `--quick`: 10 samples, 20 clones, 5 s, 256 MiB only. Without
//! `--bench` (`cargo test --all-targets`) it makes a smoke run of the
//! default configuration. The machine is shared (2 cores): compare the
//! columns of one run rather than numbers across runs.
//!
//! The templates are built through the API (`POST /v1/templates`, kind
//! probe): one at the service's probe pace (an iteration a second) for
//! creates, pause/resume and PSS, and a fast-paced twin (`probe.ticks=1
//! probe.hz=1000`, a line about every millisecond) for wakes, so "wake ->
//! first line" measures the wake rather than the guest's idle time.

use std::collections::{BTreeMap, HashSet};
use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

mod common;

use common::{http, percentile, pss_kib, TORPOR};

const TOKEN: &str = "api-bench-token-0123456789";
/// Every request but a template build is answered within this.
const REQUEST_LIMIT: Duration = Duration::from_secs(120);
/// A template build (boot, snapshot) is answered within this.
const BUILD_LIMIT: Duration = Duration::from_secs(600);
/// `torpor serve` listens within this (it builds the built-in probe first).
const START_LIMIT: Duration = Duration::from_secs(180);
/// `torpor serve` exits within this after SIGINT, else SIGKILL.
const STOP_LIMIT: Duration = Duration::from_secs(20);
/// A guest prints a new probe line within this.
const LINE_LIMIT: Duration = Duration::from_secs(60);
/// Workload and pace of the wake template: a line about every millisecond.
const FAST_CMDLINE: &str = "probe.mib=1 probe.ticks=1 probe.hz=1000";
/// Threads deleting behind the sustained creates.
const DELETERS: usize = 2;
const BACKENDS: [&str; 3] = ["file", "uffd", "uffd-shared"];
const SIZES: [u32; 2] = [256, 2048];

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

// ---------------------------------------------------------------- options

struct Opts {
    runs: usize,
    clones: usize,
    secs: f64,
    threads: usize,
    quick: bool,
    smoke: bool,
    only: Vec<String>,
}

const ONLY: &[&str] = &[
    "pool",
    "nopool",
    "default",
    "file",
    "uffd",
    "uffd-shared",
    "256",
    "2048",
];

fn usage(msg: &str) -> ! {
    eprintln!("api bench: {msg}");
    eprintln!(
        "usage: cargo bench --bench api [-- --quick --runs N --clones N --secs S --threads T \
         --only {}]",
        ONLY.join("|")
    );
    std::process::exit(2);
}

impl Opts {
    fn parse() -> Opts {
        let args: Vec<String> = std::env::args().skip(1).collect();
        // `cargo test --all-targets` runs benches without `--bench`.
        let smoke = !args.iter().any(|a| a == "--bench");
        let quick = smoke || args.iter().any(|a| a == "--quick");
        let (runs, clones, secs, threads) = match (smoke, quick) {
            (true, _) => (2, 2, 1.0, 2),
            (false, true) => (10, 20, 5.0, 4),
            (false, false) => (30, 100, 30.0, 4),
        };
        let mut o = Opts {
            runs,
            clones,
            secs,
            threads,
            quick,
            smoke,
            only: Vec::new(),
        };
        let mut it = args.iter();
        while let Some(a) = it.next() {
            let mut value = |name: &str| -> f64 {
                let v = it.next().and_then(|v| v.parse::<f64>().ok());
                v.filter(|v| *v > 0.0)
                    .unwrap_or_else(|| usage(&format!("{name} needs a positive number")))
            };
            match a.as_str() {
                "--runs" => o.runs = value("--runs") as usize,
                "--clones" => o.clones = value("--clones") as usize,
                "--secs" => o.secs = value("--secs"),
                "--threads" => o.threads = value("--threads") as usize,
                "--only" => {
                    let v = it.next().unwrap_or_else(|| usage("--only needs a value"));
                    for w in v.split(',').filter(|w| !w.is_empty()) {
                        if !ONLY.contains(&w) {
                            usage(&format!("--only {w}: not one of {}", ONLY.join("|")));
                        }
                        o.only.push(w.to_string());
                    }
                }
                _ => {} // --bench, --quick, and whatever cargo passes
            }
        }
        o.runs = o.runs.max(1);
        o.clones = o.clones.max(1);
        o.threads = o.threads.max(1);
        o
    }

    fn has(&self, w: &str) -> bool {
        self.only.iter().any(|o| o == w)
    }

    /// The configurations to run, in table order, per guest size.
    fn configs(&self) -> Vec<Config> {
        let sized: Vec<u32> = SIZES
            .into_iter()
            .filter(|m| self.has(&m.to_string()))
            .collect();
        let sizes = match (sized.is_empty(), self.quick) {
            (false, _) => sized,
            (true, true) => vec![256],
            (true, false) => SIZES.to_vec(),
        };
        let pools: Vec<bool> = [true, false]
            .into_iter()
            .filter(|p| self.has(if *p { "pool" } else { "nopool" }))
            .collect();
        let backends: Vec<&'static str> = BACKENDS.into_iter().filter(|b| self.has(b)).collect();
        let kinds = !pools.is_empty() || !backends.is_empty();
        let pools = if pools.is_empty() {
            vec![true, false]
        } else {
            pools
        };
        let backends = if backends.is_empty() {
            BACKENDS.to_vec()
        } else {
            backends
        };
        let mut out = Vec::new();
        for mem in sizes {
            let default = Config {
                mem,
                pool: None,
                backend: None,
            };
            if self.smoke && self.only.is_empty() {
                out.push(default);
                continue;
            }
            if self.has("default") || !kinds {
                out.push(default);
            }
            if kinds || !self.has("default") {
                for &pool in &pools {
                    for &backend in &backends {
                        out.push(Config {
                            mem,
                            pool: Some(pool),
                            backend: Some(backend),
                        });
                    }
                }
            }
        }
        out
    }
}

// ---------------------------------------------------------- configuration

#[derive(Clone, Copy)]
struct Config {
    mem: u32,
    /// None: the service's default (no `--standby-pool` flag).
    pool: Option<bool>,
    /// None: the service's default (no `--memory-backend` flag).
    backend: Option<&'static str>,
}

impl Config {
    fn flags(&self) -> Vec<String> {
        let mut f = Vec::new();
        if let Some(p) = self.pool {
            f.extend(["--standby-pool".into(), if p { "2" } else { "0" }.into()]);
        }
        if let Some(b) = self.backend {
            f.extend(["--memory-backend".into(), b.to_string()]);
        }
        f
    }

    fn name(&self) -> String {
        match (self.pool, self.backend) {
            (Some(p), Some(b)) => format!("{} MiB {}/{b}", self.mem, pool_word(p)),
            _ => format!("{} MiB default", self.mem),
        }
    }

    /// Whether the pool-only targets (create latency) apply.
    fn pool_targets(&self) -> bool {
        self.pool != Some(false)
    }
}

fn pool_word(p: bool) -> &'static str {
    if p {
        "pool"
    } else {
        "nopool"
    }
}

// ------------------------------------------------------------------ serve

/// One `torpor serve` in its own process group, its data directory under
/// `dir`; stopped (sandboxes deleted, group killed, leftover VMMs killed)
/// on drop.
struct Serve {
    child: Option<Child>,
    addr: String,
    dir: PathBuf,
}

enum Started {
    Up(Serve),
    /// It refused its command line (an unknown flag): the line that says so.
    Rejected(String),
    Failed(String),
}

impl Serve {
    fn start(dir: &Path, flags: &[String]) -> Started {
        let data = dir.join("data");
        if let Err(e) = std::fs::create_dir_all(&data) {
            return Started::Failed(format!("create {}: {e}", data.display()));
        }
        let log = match std::fs::File::create(dir.join("serve.log")) {
            Ok(f) => f,
            Err(e) => return Started::Failed(format!("create serve.log: {e}")),
        };
        let spawned = Command::new(TORPOR)
            .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
            .arg(&data)
            .args(["--token", TOKEN, "--policy-interval-ms", "0"])
            .args(flags)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .process_group(0)
            .spawn();
        let mut child = match spawned {
            Ok(c) => c,
            Err(e) => return Started::Failed(format!("spawn {TORPOR} serve: {e}")),
        };
        let (tx, rx) = mpsc::channel();
        if let Some(out) = child.stdout.take() {
            std::thread::spawn(move || {
                // Reads to the end so the service never blocks on stdout.
                for line in BufReader::new(out).lines().map_while(Result::ok) {
                    if let Some(rest) = line.split("listening on http://").nth(1) {
                        let _ = tx.send(rest.trim().to_string());
                    }
                }
            });
        }
        let mut serve = Serve {
            child: Some(child),
            addr: String::new(),
            dir: dir.to_path_buf(),
        };
        let addr = match rx.recv_timeout(START_LIMIT) {
            Ok(addr) => addr,
            Err(e) => {
                // Stdout closed (it exited) or it never listened.
                let why = if e == mpsc::RecvTimeoutError::Timeout {
                    format!("did not listen within {START_LIMIT:?}")
                } else {
                    "exited before listening".to_string()
                };
                serve.kill_group();
                let log = serve.log_tail(12);
                if let Some(l) = log.lines().find(|l| l.contains("unexpected argument")) {
                    return Started::Rejected(l.trim().to_string());
                }
                return Started::Failed(format!("torpor serve {why}; its log ends:\n{log}"));
            }
        };
        serve.addr = addr;
        Started::Up(serve)
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    fn console(&self, id: &str) -> PathBuf {
        self.data().join("sandboxes").join(id).join("console.log")
    }

    fn log_tail(&self, n: usize) -> String {
        let log = std::fs::read_to_string(self.dir.join("serve.log")).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(n).collect();
        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
    }

    /// One request: (status, body text).
    fn raw(
        &self,
        method: &str,
        path: &str,
        body: Option<&str>,
        limit: Duration,
    ) -> Result<(u16, String), String> {
        http::request(&self.addr, TOKEN, method, path, body, limit)
            .map_err(|e| format!("{method} {path}: {e}"))
    }

    /// A request that must answer `want`; its JSON (Null when empty).
    fn expect(
        &self,
        want: u16,
        method: &str,
        path: &str,
        body: Option<&str>,
    ) -> Result<Value, String> {
        let (status, text) = self.raw(method, path, body, REQUEST_LIMIT)?;
        parse(want, status, &text).map_err(|e| format!("{method} {path}: {e}"))
    }

    fn delete(&self, id: &str) -> Result<(), String> {
        self.expect(204, "DELETE", &format!("/v1/sandboxes/{id}"), None)
            .map(drop)
    }

    /// Its children that are VMMs (sandboxes' and standby shells).
    fn vmm_children(&self) -> Vec<u32> {
        vmm_children(self.pid())
    }

    /// Deletes every sandbox, stops the service (SIGINT to its group, then
    /// SIGKILL) and kills VMMs it left. Returns what it had to force.
    fn stop(&mut self) -> Vec<String> {
        let mut notes = Vec::new();
        if self.child.is_none() {
            return notes;
        }
        if !self.addr.is_empty() {
            let list = self.expect(200, "GET", "/v1/sandboxes", None);
            let all = list.map(|l| l["sandboxes"].as_array().cloned().unwrap_or_default());
            for s in all.unwrap_or_default() {
                if let Some(id) = s["id"].as_str() {
                    if let Err(e) = self.delete(id) {
                        notes.push(format!("at stop: {e}"));
                    }
                }
            }
        }
        let vmms = self.vmm_children();
        if !self.kill_group() {
            notes.push(format!(
                "torpor serve ignored SIGINT for {STOP_LIMIT:?}: killed"
            ));
        }
        let left: Vec<u32> = vmms.into_iter().filter(|p| is_vmm(*p)).collect();
        for &pid in &left {
            // SAFETY: a torpor-vmm this bench's serve started (checked by name).
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
        }
        if !left.is_empty() {
            notes.push(format!("{} VMMs outlived torpor serve: killed", left.len()));
        }
        if std::env::var_os("TORPOR_KEEP_SCRATCH").is_none() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
        notes
    }

    /// SIGINT to the service's process group, SIGKILL after STOP_LIMIT;
    /// whether it stopped on SIGINT.
    fn kill_group(&mut self) -> bool {
        let Some(mut child) = self.child.take() else {
            return true;
        };
        let pgid = child.id() as libc::pid_t;
        // SAFETY: signalling the process group of the serve this bench spawned.
        unsafe { libc::kill(-pgid, libc::SIGINT) };
        let deadline = Instant::now() + STOP_LIMIT;
        while Instant::now() < deadline {
            if child.try_wait().ok().flatten().is_some() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // SAFETY: as above.
        unsafe { libc::kill(-pgid, libc::SIGKILL) };
        let _ = child.wait();
        false
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        for n in self.stop() {
            eprintln!("api bench: {n}");
        }
    }
}

/// Checks the status and parses the body (Null when empty).
fn parse(want: u16, status: u16, text: &str) -> Result<Value, String> {
    if status != want {
        return Err(format!("HTTP {status} (want {want}): {}", text.trim()));
    }
    if text.trim().is_empty() {
        return Ok(Value::Null);
    }
    serde_json::from_str(text).map_err(|e| format!("not JSON ({e}): {text}"))
}

/// (name, state, parent) of a process, from /proc/PID/stat.
fn proc_stat(pid: u32) -> Option<(String, char, u32)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) state ppid ...": comm may hold spaces and parentheses.
    let (head, rest) = stat.rsplit_once(')')?;
    let name = head.split_once('(')?.1.to_string();
    let mut f = rest.split_whitespace();
    let state = f.next()?.chars().next()?;
    let ppid = f.next()?.parse().ok()?;
    Some((name, state, ppid))
}

/// A live (not zombie) torpor-vmm.
fn is_vmm(pid: u32) -> bool {
    proc_stat(pid).is_some_and(|(name, state, _)| name == "torpor-vmm" && state != 'Z')
}

/// Live torpor-vmm processes whose parent is `parent`.
fn vmm_children(parent: u32) -> Vec<u32> {
    let pids = std::fs::read_dir("/proc").into_iter().flatten().flatten();
    pids.filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| {
            proc_stat(pid).is_some_and(|(name, state, ppid)| {
                ppid == parent && name == "torpor-vmm" && state != 'Z'
            })
        })
        .collect()
}

// ------------------------------------------------------------ measurements

/// The answer's `restore` object (top level, or in `sandbox`); each field
/// None when absent.
#[derive(Clone, Default)]
struct Restore {
    path: Option<String>,
    backend: Option<String>,
    ms: Option<f64>,
    vmm_ms: Option<f64>,
}

fn restore_of(v: &Value) -> Option<Restore> {
    let r = [&v["restore"], &v["sandbox"]["restore"]]
        .into_iter()
        .find(|r| r.is_object())?;
    Some(Restore {
        path: r["path"].as_str().map(str::to_string),
        backend: r["backend"].as_str().map(str::to_string),
        ms: r["ms"].as_f64(),
        vmm_ms: r["vmm_ms"].as_f64(),
    })
}

/// One timed create or wake.
#[derive(Clone)]
struct Sample {
    api_ms: f64,
    restore: Option<Restore>,
}

impl Sample {
    fn vmm_ms(&self) -> Option<f64> {
        self.restore.as_ref()?.vmm_ms
    }
    fn service_ms(&self) -> Option<f64> {
        self.restore.as_ref()?.ms
    }
    fn path(&self) -> Option<&str> {
        self.restore.as_ref()?.path.as_deref()
    }
}

#[derive(Default)]
struct Sustained {
    creates: usize,
    secs: f64,
    lat: Vec<f64>,
    standby: usize,
    with_path: usize,
    errors: Vec<String>,
}

/// Everything measured for one configuration.
#[derive(Default)]
struct Results {
    create: Vec<Sample>,
    /// torpor_restores_total by path over the sequential creates.
    create_metrics: Option<BTreeMap<String, f64>>,
    wake: Vec<Sample>,
    wake_line: Vec<f64>,
    hibernate: Vec<f64>,
    pause: Vec<f64>,
    resume: Vec<f64>,
    sustained: Option<Sustained>,
    pss_paused: Option<f64>,
    pss_running: Option<f64>,
    shells_pss: Option<(usize, f64)>,
    backend_seen: BTreeMap<String, usize>,
    notes: Vec<String>,
    failed: bool,
}

/// POST /v1/sandboxes -> 201 running: (id, answer, ms).
fn create(serve: &Serve, template: &str) -> Result<(String, Value, f64), String> {
    let body = json!({"template": template, "metadata": {"bench": "api"}}).to_string();
    let t = Instant::now();
    let (status, text) = serve.raw("POST", "/v1/sandboxes", Some(&body), REQUEST_LIMIT)?;
    let took = ms(t);
    let v = parse(201, status, &text).map_err(|e| format!("create: {e}"))?;
    if v["state"] != "running" {
        return Err(format!("created sandbox is not running: {v}"));
    }
    let id = v["id"].as_str().ok_or(format!("no id in {v}"))?.to_string();
    Ok((id, v, took))
}

/// POST /v1/sandboxes/{id}/{op} -> 200 with the sandbox in `state`:
/// (answer, ms).
fn lifecycle(serve: &Serve, id: &str, op: &str, state: &str) -> Result<(Value, f64), String> {
    let path = format!("/v1/sandboxes/{id}/{op}");
    let t = Instant::now();
    let (status, text) = serve.raw("POST", &path, None, REQUEST_LIMIT)?;
    let took = ms(t);
    let v = parse(200, status, &text).map_err(|e| format!("{op}: {e}"))?;
    if v["sandbox"]["state"] != state {
        return Err(format!("{op} of {id} did not leave it {state}: {v}"));
    }
    Ok((v, took))
}

/// Builds a probe template of `mem` MiB; its id once ready.
fn build_template(
    serve: &Serve,
    name: &str,
    mem: u32,
    cmdline: Option<&str>,
) -> Result<String, String> {
    let mut body = json!({"name": name, "kind": "probe", "mem_mib": mem, "vcpus": 1});
    if let Some(c) = cmdline {
        body["cmdline"] = json!(c);
    }
    let (status, text) = serve.raw(
        "POST",
        "/v1/templates",
        Some(&body.to_string()),
        BUILD_LIMIT,
    )?;
    let want = if status == 202 { 202 } else { 201 };
    let v = parse(want, status, &text).map_err(|e| format!("template {name}: {e}"))?;
    let id = v["id"].as_str().ok_or(format!("no id in {v}"))?.to_string();
    let deadline = Instant::now() + BUILD_LIMIT;
    let mut t = v;
    loop {
        match t["state"].as_str() {
            Some("ready") => return Ok(id),
            Some("building") if Instant::now() < deadline => {}
            _ => return Err(format!("template {name} did not become ready: {t}")),
        }
        std::thread::sleep(Duration::from_millis(200));
        t = serve.expect(200, "GET", &format!("/v1/templates/{id}"), None)?;
    }
}

/// Raises the pod's oversubscription ratio if `n` sandboxes of `mem` MiB
/// would not be admitted.
fn admit(serve: &Serve, n: usize, mem: u32) -> Result<Option<String>, String> {
    let pods = serve.expect(200, "GET", "/v1/pods", None)?;
    let pod = &pods["pods"][0];
    let id = pod["id"].as_str().unwrap_or("pod_local");
    let pod_mib = pod["memory_bytes"].as_f64().unwrap_or(0.0) / 1048576.0;
    let ratio = pod["oversubscription_ratio"].as_f64().unwrap_or(4.0);
    // Room for the clones and the standard sandboxes next to them.
    let need = (n + 8) as f64 * f64::from(mem);
    if pod_mib <= 0.0 || need <= pod_mib * ratio {
        return Ok(None);
    }
    let new = ((need / pod_mib * 1.05) * 100.0).ceil() / 100.0;
    let body = json!({ "oversubscription_ratio": new }).to_string();
    serve.expect(200, "PATCH", &format!("/v1/pods/{id}"), Some(&body))?;
    Ok(Some(format!(
        "oversubscription ratio raised {ratio} -> {new} for {n} x {mem} MiB clones"
    )))
}

/// torpor_restores_total summed by `path` label (None without the counter).
fn restore_counts(serve: &Serve) -> Option<BTreeMap<String, f64>> {
    let (status, text) = serve.raw("GET", "/metrics", None, REQUEST_LIMIT).ok()?;
    if status != 200 {
        return None;
    }
    let mut out = BTreeMap::new();
    for line in text
        .lines()
        .filter(|l| l.starts_with("torpor_restores_total"))
    {
        let path = line
            .split("path=\"")
            .nth(1)
            .and_then(|r| r.split('"').next())
            .unwrap_or("?");
        let value: f64 = line
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0);
        *out.entry(path.to_string()).or_insert(0.0) += value;
    }
    (!out.is_empty()).then_some(out)
}

/// Complete `TORPOR-PROBE` lines in `text`.
fn probe_lines(text: &[u8]) -> usize {
    let end = text.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
    text[..end]
        .split(|b| *b == b'\n')
        .filter(|l| l.starts_with(b"TORPOR-PROBE "))
        .count()
}

/// Probe lines in `path` that were not there when it held `before`. A
/// restore truncates the console, so a file that no longer begins with
/// `before` is counted from its start.
fn new_lines(path: &Path, before: &[u8]) -> usize {
    let now = std::fs::read(path).unwrap_or_default();
    if now.starts_with(before) {
        probe_lines(&now[before.len()..])
    } else {
        probe_lines(&now)
    }
}

/// Polls (100 µs grain) until `path` has a probe line `before` did not;
/// when, or an error at `deadline`.
fn wait_new_line(path: &Path, before: &[u8], deadline: Instant) -> Result<Instant, String> {
    loop {
        if new_lines(path, before) > 0 {
            return Ok(Instant::now());
        }
        if Instant::now() > deadline {
            return Err(format!("no new probe line in {}", path.display()));
        }
        std::thread::sleep(Duration::from_micros(100));
    }
}

/// Runs `f(0..n)` on `threads` threads; the first error.
fn par_for(
    n: usize,
    threads: usize,
    f: impl Fn(usize) -> Result<(), String> + Sync,
) -> Result<(), String> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let err: Mutex<Option<String>> = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..threads.min(n) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                if i >= n {
                    break;
                }
                if let Err(e) = f(i) {
                    err.lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .get_or_insert(e);
                    break;
                }
            });
        }
    });
    match err.into_inner().unwrap_or_else(|e| e.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Lets the standby pool refill after a burst.
fn settle() {
    std::thread::sleep(Duration::from_millis(1000));
}

/// `runs` sequential creates (each deleted before the next), after one
/// warm-up.
fn measure_creates(serve: &Serve, tpl: &str, runs: usize, r: &mut Results) -> Result<(), String> {
    let (id, _, _) = create(serve, tpl)?;
    serve.delete(&id)?;
    settle();
    let before = restore_counts(serve);
    for _ in 0..runs {
        let (id, v, took) = create(serve, tpl)?;
        r.create.push(Sample {
            api_ms: took,
            restore: restore_of(&v),
        });
        serve.delete(&id)?;
    }
    let after = restore_counts(serve);
    if let (Some(b), Some(a)) = (before, after) {
        let delta = a
            .iter()
            .map(|(k, v)| (k.clone(), v - b.get(k).copied().unwrap_or(0.0)))
            .collect();
        r.create_metrics = Some(delta);
    }
    Ok(())
}

/// Pause and resume of one running sandbox, `runs` times after a warm-up.
fn measure_pause(serve: &Serve, tpl: &str, runs: usize, r: &mut Results) -> Result<(), String> {
    let (id, _, _) = create(serve, tpl)?;
    for i in 0..=runs {
        let (_, p) = lifecycle(serve, &id, "pause", "paused")?;
        let (_, q) = lifecycle(serve, &id, "resume", "running")?;
        if i > 0 {
            r.pause.push(p);
            r.resume.push(q);
        }
    }
    serve.delete(&id)
}

/// Hibernate, then wake (resume -> 200, -> first new console line), of one
/// fast-paced sandbox, `runs` times after a warm-up.
fn measure_wake(serve: &Serve, fast: &str, runs: usize, r: &mut Results) -> Result<(), String> {
    let (id, _, _) = create(serve, fast)?;
    let console = serve.console(&id);
    wait_new_line(&console, b"", Instant::now() + LINE_LIMIT)?;
    for i in 0..=runs {
        let (_, h) = lifecycle(serve, &id, "hibernate", "hibernated")?;
        let before = std::fs::read(&console).unwrap_or_default();
        let path = format!("/v1/sandboxes/{id}/resume");
        let t = Instant::now();
        let (status, text) = serve.raw("POST", &path, None, REQUEST_LIMIT)?;
        let api = ms(t);
        let v = parse(200, status, &text).map_err(|e| format!("wake: {e}"))?;
        if v["resumed"] != true || v["sandbox"]["state"] != "running" {
            return Err(format!("resume of hibernated {id} did not wake it: {v}"));
        }
        let seen = wait_new_line(&console, &before, t + LINE_LIMIT)?;
        if i > 0 {
            r.hibernate.push(h);
            r.wake.push(Sample {
                api_ms: api,
                restore: restore_of(&v),
            });
            r.wake_line.push((seen - t).as_secs_f64() * 1000.0);
        }
    }
    serve.delete(&id)
}

/// Creates from `threads` threads for `secs`, `DELETERS` threads deleting
/// behind them (a bounded queue holds them back if deletes fall behind).
fn measure_sustained(serve: &Serve, tpl: &str, threads: usize, secs: f64) -> Sustained {
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let (tx, rx) = mpsc::sync_channel::<String>(threads * 2);
    let rx = Mutex::new(rx);
    let out = Mutex::new(Sustained::default());
    let start = Instant::now();
    let ends: Mutex<Vec<Instant>> = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        let (rx, out, ends) = (&rx, &out, &ends);
        for _ in 0..DELETERS {
            s.spawn(move || loop {
                let next = rx.lock().unwrap_or_else(|e| e.into_inner()).recv();
                let Ok(id) = next else { break };
                if let Err(e) = serve.delete(&id) {
                    out.lock().unwrap_or_else(|e| e.into_inner()).errors.push(e);
                }
            });
        }
        for _ in 0..threads {
            let tx = tx.clone();
            s.spawn(move || {
                while Instant::now() < deadline {
                    let done = create(serve, tpl);
                    let mut o = out.lock().unwrap_or_else(|e| e.into_inner());
                    match done {
                        Ok((id, v, took)) => {
                            o.creates += 1;
                            o.lat.push(took);
                            let path = restore_of(&v).and_then(|r| r.path);
                            o.with_path += usize::from(path.is_some());
                            o.standby += usize::from(path.as_deref() == Some("standby"));
                            drop(o);
                            if tx.send(id).is_err() {
                                break;
                            }
                        }
                        Err(e) => {
                            o.errors.push(e);
                            if o.errors.len() > 20 {
                                break;
                            }
                            drop(o);
                            std::thread::sleep(Duration::from_millis(20));
                        }
                    }
                }
                ends.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(Instant::now());
            });
        }
        drop(tx);
    });
    let mut o = out.into_inner().unwrap_or_else(|e| e.into_inner());
    let end = ends.into_inner().unwrap_or_default().into_iter().max();
    o.secs = end.map_or(secs, |e| (e - start).as_secs_f64());
    o
}

/// `n` clones: created and paused at once, PSS; resumed until each printed
/// a new line, PSS; deleted. Per clone, MiB.
fn measure_pss(
    serve: &Serve,
    tpl: &str,
    n: usize,
    threads: usize,
    r: &mut Results,
) -> Result<(), String> {
    let clones: Mutex<Vec<(String, u32)>> = Mutex::new(Vec::new());
    let made = par_for(n, threads, |_| {
        let (id, v, _) = create(serve, tpl)?;
        let pid = v["vmm"]["pid"].as_u64();
        clones
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((id.clone(), pid.unwrap_or(0) as u32));
        lifecycle(serve, &id, "pause", "paused").map(drop)?;
        pid.map(drop)
            .ok_or(format!("no vmm.pid in the answer: {v}"))
    });
    let clones = clones.into_inner().unwrap_or_else(|e| e.into_inner());
    let result = made.and_then(|()| pss_phases(serve, &clones, threads, r));
    let deleted = par_for(clones.len(), threads, |i| serve.delete(&clones[i].0));
    result.and(deleted)
}

fn pss_phases(
    serve: &Serve,
    clones: &[(String, u32)],
    threads: usize,
    r: &mut Results,
) -> Result<(), String> {
    let per_clone = |clones: &[(String, u32)]| -> Result<f64, String> {
        let mut sum = 0.0;
        for (id, pid) in clones {
            sum += pss_kib(*pid).ok_or(format!("no PSS for {id}'s VMM (pid {pid})"))?;
        }
        Ok(sum / 1024.0 / clones.len() as f64)
    };
    r.pss_paused = Some(per_clone(clones)?);
    let mine: HashSet<u32> = clones.iter().map(|c| c.1).collect();
    let shells: Vec<u32> = serve
        .vmm_children()
        .into_iter()
        .filter(|p| !mine.contains(p))
        .collect();
    let shells_kib = shells
        .iter()
        .filter_map(|p| pss_kib(*p))
        .fold(0.0, |a, b| a + b);
    r.shells_pss = Some((shells.len(), shells_kib / 1024.0));
    let consoles: Vec<(PathBuf, Vec<u8>)> = clones
        .iter()
        .map(|(id, _)| {
            let c = serve.console(id);
            let before = std::fs::read(&c).unwrap_or_default();
            (c, before)
        })
        .collect();
    par_for(clones.len(), threads, |i| {
        lifecycle(serve, &clones[i].0, "resume", "running").map(drop)
    })?;
    let deadline = Instant::now() + LINE_LIMIT;
    for (c, before) in &consoles {
        wait_new_line(c, before, deadline)?;
    }
    r.pss_running = Some(per_clone(clones)?);
    Ok(())
}

/// Every measurement of one configuration, in order; stops at the first
/// failure (what was measured stays in `r`).
fn measure(serve: &Serve, cfg: &Config, o: &Opts, r: &mut Results) -> Result<(), String> {
    let step = |what: &str| eprintln!("api: [{}] {what}", cfg.name());
    step("building templates");
    let tpl = build_template(serve, &format!("bench-{}", cfg.mem), cfg.mem, None)?;
    let fast = build_template(
        serve,
        &format!("bench-{}-fast", cfg.mem),
        cfg.mem,
        Some(FAST_CMDLINE),
    )?;
    if let Some(note) = admit(serve, o.clones, cfg.mem)? {
        r.notes.push(note);
    }
    settle();
    step(&format!("{} creates", o.runs));
    measure_creates(serve, &tpl, o.runs, r)?;
    step(&format!("{} pause/resume", o.runs));
    measure_pause(serve, &tpl, o.runs, r)?;
    step(&format!("{} hibernate/wake", o.runs));
    measure_wake(serve, &fast, o.runs, r)?;
    settle();
    step(&format!(
        "sustained creates, {} threads, {} s",
        o.threads, o.secs
    ));
    let s = measure_sustained(serve, &tpl, o.threads, o.secs);
    let errors = s.errors.clone();
    r.sustained = Some(s);
    if !errors.is_empty() {
        r.notes.push(format!(
            "sustained: {} errors, first: {}",
            errors.len(),
            errors[0]
        ));
    }
    settle();
    step(&format!("PSS of {} clones", o.clones));
    measure_pss(serve, &tpl, o.clones, o.threads, r)?;
    Ok(())
}

/// Notes about what the answers said: backends, paths, missing fields.
fn check_answers(cfg: &Config, r: &mut Results) {
    for s in r.create.iter().chain(&r.wake) {
        if let Some(b) = s.restore.as_ref().and_then(|r| r.backend.clone()) {
            *r.backend_seen.entry(b).or_insert(0) += 1;
        }
    }
    if let Some(want) = cfg.backend {
        let other: Vec<&String> = r.backend_seen.keys().filter(|b| *b != want).collect();
        if !other.is_empty() {
            r.notes
                .push(format!("restore.backend says {other:?}, configured {want}"));
        }
    }
    if cfg.pool == Some(false) && r.create.iter().any(|s| s.path() == Some("standby")) {
        r.notes
            .push("creates took the standby path with --standby-pool 0".into());
    }
    if !r.create.is_empty() && r.create.iter().all(|s| s.restore.is_none()) {
        r.notes
            .push("answers carry no `restore` object: its columns print -".into());
    }
}

// ------------------------------------------------------------------ table

#[derive(Clone, Copy)]
enum Fmt {
    Ms,
    Pct,
    Rate,
    Mib,
    Count,
}

struct Target {
    text: &'static str,
    /// Applies to pool configurations (and the defaults) only.
    pool_only: bool,
    met: fn(f64) -> bool,
}

struct Row {
    label: String,
    fmt: Fmt,
    target: Option<Target>,
    value: fn(&Results) -> Option<f64>,
}

fn p(v: &[f64], q: f64) -> Option<f64> {
    (!v.is_empty()).then(|| percentile(v, q))
}

fn api_p(v: &[Sample], q: f64) -> Option<f64> {
    p(&v.iter().map(|s| s.api_ms).collect::<Vec<_>>(), q)
}

fn vmm_p50(v: &[Sample]) -> Option<f64> {
    p(
        &v.iter().filter_map(Sample::vmm_ms).collect::<Vec<_>>(),
        0.5,
    )
}

fn service_p50(v: &[Sample]) -> Option<f64> {
    p(
        &v.iter().filter_map(Sample::service_ms).collect::<Vec<_>>(),
        0.5,
    )
}

/// p50 of API time - vmm_ms, per sample.
fn overhead_p50(v: &[Sample]) -> Option<f64> {
    let d: Vec<f64> = v
        .iter()
        .filter_map(|s| s.vmm_ms().map(|m| s.api_ms - m))
        .collect();
    p(&d, 0.5)
}

/// Percent of creates that took the standby path: from the answers, else
/// from the metrics.
fn standby_pct(r: &Results) -> Option<f64> {
    let paths: Vec<&str> = r.create.iter().filter_map(Sample::path).collect();
    if !paths.is_empty() {
        let n = paths.iter().filter(|p| **p == "standby").count();
        return Some(100.0 * n as f64 / paths.len() as f64);
    }
    let m = r.create_metrics.as_ref()?;
    let all: f64 = m.values().sum();
    (all > 0.0).then(|| 100.0 * m.get("standby").copied().unwrap_or(0.0) / all)
}

fn rows(o: &Opts) -> Vec<Row> {
    fn row(label: &str, fmt: Fmt, value: fn(&Results) -> Option<f64>) -> Row {
        Row {
            label: label.to_string(),
            fmt,
            target: None,
            value,
        }
    }
    fn goal(mut r: Row, text: &'static str, pool_only: bool, met: fn(f64) -> bool) -> Row {
        r.target = Some(Target {
            text,
            pool_only,
            met,
        });
        r
    }
    let t = o.threads;
    vec![
        goal(
            row("create p50", Fmt::Ms, |r| api_p(&r.create, 0.5)),
            "<= 3 ms (pool)",
            true,
            |v| v <= 3.0,
        ),
        row("create p90", Fmt::Ms, |r| api_p(&r.create, 0.9)),
        goal(
            row("create p99", Fmt::Ms, |r| api_p(&r.create, 0.99)),
            "<= 15 ms (pool)",
            true,
            |v| v <= 15.0,
        ),
        row("  VMM restore (vmm_ms) p50", Fmt::Ms, |r| {
            vmm_p50(&r.create)
        }),
        row("  service (restore.ms) p50", Fmt::Ms, |r| {
            service_p50(&r.create)
        }),
        goal(
            row("  API overhead p50", Fmt::Ms, |r| overhead_p50(&r.create)),
            "<= 1.5 ms",
            false,
            |v| v <= 1.5,
        ),
        row("  creates via standby", Fmt::Pct, standby_pct),
        goal(
            row("wake p50", Fmt::Ms, |r| api_p(&r.wake, 0.5)),
            "<= 3 ms",
            false,
            |v| v <= 3.0,
        ),
        row("wake p90", Fmt::Ms, |r| api_p(&r.wake, 0.9)),
        goal(
            row("wake p99", Fmt::Ms, |r| api_p(&r.wake, 0.99)),
            "<= 15 ms",
            false,
            |v| v <= 15.0,
        ),
        row("  VMM restore (vmm_ms) p50", Fmt::Ms, |r| vmm_p50(&r.wake)),
        row("  service (restore.ms) p50", Fmt::Ms, |r| {
            service_p50(&r.wake)
        }),
        goal(
            row("  API overhead p50", Fmt::Ms, |r| overhead_p50(&r.wake)),
            "<= 1.5 ms",
            false,
            |v| v <= 1.5,
        ),
        row("  wake -> first new line p50", Fmt::Ms, |r| {
            p(&r.wake_line, 0.5)
        }),
        row("  wake -> first new line p99", Fmt::Ms, |r| {
            p(&r.wake_line, 0.99)
        }),
        row("pause p50", Fmt::Ms, |r| p(&r.pause, 0.5)),
        row("resume (paused) p50", Fmt::Ms, |r| p(&r.resume, 0.5)),
        row("hibernate p50", Fmt::Ms, |r| p(&r.hibernate, 0.5)),
        goal(
            row(&format!("creates/s ({t} threads)"), Fmt::Rate, |r| {
                let s = r.sustained.as_ref()?;
                (s.creates > 0).then(|| s.creates as f64 / s.secs)
            }),
            ">= 200/s",
            false,
            |v| v >= 200.0,
        ),
        row("  create p50 under load", Fmt::Ms, |r| {
            p(&r.sustained.as_ref()?.lat, 0.5)
        }),
        row("  create p99 under load", Fmt::Ms, |r| {
            p(&r.sustained.as_ref()?.lat, 0.99)
        }),
        row("  via standby under load", Fmt::Pct, |r| {
            let s = r.sustained.as_ref()?;
            (s.with_path > 0).then(|| 100.0 * s.standby as f64 / s.with_path as f64)
        }),
        goal(
            row("PSS / paused clone", Fmt::Mib, |r| r.pss_paused),
            "<= 0.8 MiB",
            false,
            |v| v <= 0.8,
        ),
        row("PSS / running clone", Fmt::Mib, |r| r.pss_running),
        row("standby shells (count)", Fmt::Count, |r| {
            r.shells_pss.map(|s| s.0 as f64)
        }),
        row("standby shells PSS, all", Fmt::Mib, |r| {
            r.shells_pss.map(|s| s.1)
        }),
    ]
}

fn cell(v: Option<f64>, fmt: Fmt) -> String {
    match v.filter(|v| v.is_finite()) {
        None => "-".into(),
        Some(v) => match fmt {
            Fmt::Ms => format!("{v:.2}"),
            Fmt::Pct => format!("{v:.0}%"),
            Fmt::Rate => format!("{v:.0}"),
            Fmt::Mib => format!("{v:.2}"),
            Fmt::Count => format!("{v:.0}"),
        },
    }
}

const LABEL_W: usize = 32;
const COL_W: usize = 14;

/// One table for one guest size: a row per measurement, a column per
/// configuration, the target in the last column.
fn print_table(mem: u32, done: &[(Config, Results)], o: &Opts) -> Vec<String> {
    let mut summary = Vec::new();
    println!(
        "\n== probe template {mem} MiB: through the REST API (ms unless said; {} samples per \
         latency, {} clones, {} s sustained)",
        o.runs, o.clones, o.secs
    );
    let head = |last: &str, f: &dyn Fn(&Config, &Results) -> String| {
        let cols: String = done
            .iter()
            .map(|(c, r)| format!("{:>COL_W$}", f(c, r)))
            .collect();
        println!("{:<LABEL_W$}{cols}  {last}", "");
    };
    head("target", &|c, _| match c.pool {
        Some(p) => pool_word(p).to_string(),
        None => "default".into(),
    });
    head("", &|c, r| match c.backend {
        Some(b) => b.to_string(),
        None => match r.backend_seen.keys().next() {
            Some(b) => format!("({b})"),
            None => "(no flags)".into(),
        },
    });
    let mut score: Vec<(usize, usize, Vec<String>)> = vec![(0, 0, Vec::new()); done.len()];
    let mut section = String::new();
    for row in rows(o) {
        if !row.label.starts_with(' ') {
            section = row.label.split(' ').next().unwrap_or_default().to_string();
        }
        let mut line = format!("{:<LABEL_W$}", row.label);
        for (i, (c, r)) in done.iter().enumerate() {
            let v = (row.value)(r).filter(|v| v.is_finite());
            let mut text = cell(v, row.fmt);
            if let (Some(t), Some(v)) = (&row.target, v) {
                if !t.pool_only || c.pool_targets() {
                    let met = (t.met)(v);
                    text.push_str(if met { " ok" } else { " MISS" });
                    score[i].1 += 1;
                    if met {
                        score[i].0 += 1;
                    } else {
                        let what = row.label.trim();
                        score[i].2.push(if row.label.starts_with(' ') {
                            format!("{section} {what}")
                        } else {
                            what.to_string()
                        });
                    }
                }
            }
            line.push_str(&format!("{text:>COL_W$}"));
        }
        if let Some(t) = &row.target {
            line.push_str(&format!("  {}", t.text));
        }
        println!("{line}");
    }
    for ((c, r), (met, of, missed)) in done.iter().zip(&score) {
        let mut line = format!("{}: {met} of {of} targets met", c.name());
        if r.failed {
            line.push_str(" (FAILED part-way: its column holds what was measured)");
        }
        if !missed.is_empty() {
            line.push_str(&format!(" (missed: {})", missed.join(", ")));
        }
        summary.push(line);
    }
    summary
}

/// The configurations of one guest size that ran, and notes on all of it.
#[derive(Default)]
struct Ran {
    done: Vec<(Config, Results)>,
    notes: Vec<String>,
}

fn main() {
    let o = Opts::parse();
    let configs = o.configs();
    if configs.is_empty() {
        usage("--only leaves no configuration");
    }
    if o.smoke {
        eprintln!("api: no --bench argument (cargo test): smoke run of the default configuration");
    }
    let scratch = std::env::temp_dir().join(format!("torpor-bench-api-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    if let Err(e) = std::fs::create_dir_all(&scratch) {
        eprintln!("api bench: create {}: {e}", scratch.display());
        std::process::exit(1);
    }
    let mut failed = false;
    // Per guest size: the configurations that ran, and notes.
    let mut by_size: BTreeMap<u32, Ran> = BTreeMap::new();
    for (i, cfg) in configs.iter().enumerate() {
        let Ran { done, notes } = by_size.entry(cfg.mem).or_default();
        eprintln!(
            "api: [{}] starting torpor serve {}",
            cfg.name(),
            cfg.flags().join(" ")
        );
        let dir = scratch.join(format!("c{i}"));
        let mut serve = match Serve::start(&dir, &cfg.flags()) {
            Started::Up(s) => s,
            Started::Rejected(why) => {
                notes.push(format!(
                    "{}: skipped, torpor serve {}: {why}",
                    cfg.name(),
                    cfg.flags().join(" ")
                ));
                let _ = std::fs::remove_dir_all(&dir);
                continue;
            }
            Started::Failed(why) => {
                failed = true;
                notes.push(format!("{}: FAILED to start: {why}", cfg.name()));
                let _ = std::fs::remove_dir_all(&dir);
                continue;
            }
        };
        let mut r = Results::default();
        if let Err(e) = measure(&serve, cfg, &o, &mut r) {
            failed = true;
            r.failed = true;
            r.notes.push(format!(
                "FAILED: {e}\n      serve log ends:\n{}",
                serve.log_tail(8)
            ));
        }
        r.notes.extend(serve.stop());
        check_answers(cfg, &mut r);
        for n in &r.notes {
            notes.push(format!("{}: {n}", cfg.name()));
        }
        done.push((*cfg, r));
    }
    let _ = std::fs::remove_dir_all(&scratch);

    println!(
        "\ntorpor API benchmark: `torpor serve` per configuration, one client over loopback \
         (HTTP/1.1, a connection per request)"
    );
    println!(
        "p50/p90/p99 are nearest-rank over the samples (with 30 samples p99 is the max); \
         shared 2-core machine: compare columns of one run"
    );
    for (mem, Ran { done, notes }) in &by_size {
        let summary = if done.is_empty() {
            println!("\n== probe template {mem} MiB: no configuration ran");
            Vec::new()
        } else {
            print_table(*mem, done, &o)
        };
        for s in summary.iter().chain(notes) {
            println!("  note: {s}");
        }
    }
    println!(
        "\ntargets (the issue): API create p50 <= 3 ms and p99 <= 15 ms with the pool; wake p50 \
         <= 3 ms, p99 <= 15 ms; >= 200 creates/s sustained; API overhead (API time - vmm_ms, \
         p50 per sample) <= 1.5 ms; PSS per paused clone <= 0.8 MiB. \"ok\"/\"MISS\" mark each \
         cell a target applies to; \"-\": the service did not answer the field."
    );
    if failed {
        std::process::exit(1);
    }
}
