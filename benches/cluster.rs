//! Cluster throughput: creates/s and wakes/s through two API replicas and
//! two pods (`scripts/cluster`: PostgreSQL, nats-server, `torpor pod serve
//! --cluster` ×2, `torpor serve --cluster` ×2, on loopback) against the
//! embedded single `torpor serve` on the same machine (both storing their
//! hibernations in a local object store, as `scripts/cluster` has its
//! pods do by default), and the latency the
//! queue adds (p50/p99 of one client's create and wake, cluster minus
//! embedded), as a table.
//!
//! - creates/s: `--threads` clients create the probe template for
//!   `--secs`, alternating replicas; one thread deletes behind them.
//! - wakes/s: `--threads` × 2 sandboxes hibernated, then woken all at once
//!   by the clients; rounds (hibernate untimed, wake timed) until the wake
//!   phases add up to `--secs`. Where those wakes' time went: their p50
//!   through the API and the service's part (`restore.ms`), and the CPU
//!   the machine spent per wake (`/proc/stat`), by process (`/proc/<pid>`:
//!   `torpor serve`, replicas, pods, VMMs, PostgreSQL, nats-server, the
//!   bench's clients).
//! - latency: `--samples` sequential create → hibernate → wake → delete by
//!   one client.
//! - wake on another pod: `--samples` sandboxes hibernated on pod1 (their
//!   snapshots in the pods' shared object store), pod1 killed and lost,
//!   each woken by one client: moved to pod2 (adopt, fetch, restore).
//!
//! `cargo bench --bench cluster [-- --secs S --threads T --samples N]`
//! (defaults 5 s, 4 threads, 20 samples). Needs PostgreSQL and nats-server
//! (`scripts/setup test` installs them); under `cargo test` (no `--bench`) nothing
//! runs. The machine is shared: compare the columns of one run. Every
//! process the bench starts is stopped at its end, also on a panic.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Mutex};
use std::time::{Duration, Instant};

use comfy_table::{presets::UTF8_FULL_CONDENSED, Table};
use serde_json::Value;

mod common;
#[path = "../tests/common/mod.rs"]
mod tests_common;

use common::cpu::{self, CpuSpent};
use common::percentile;
use common::serve::{Serve, Started, TOKEN};
use tests_common::cluster::Cluster;
use tests_common::http::{try_request_with, HttpResponse};

const LIMIT: Duration = Duration::from_secs(120);
const CREATE: &str = r#"{"template":"probe"}"#;

struct Opts {
    secs: f64,
    threads: usize,
    samples: usize,
}

fn opts(args: &[String]) -> Opts {
    let mut o = Opts {
        secs: 5.0,
        threads: 4,
        samples: 20,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = |name: &str| -> f64 {
            it.next()
                .and_then(|v| v.parse::<f64>().ok())
                .filter(|v| *v > 0.0)
                .unwrap_or_else(|| {
                    eprintln!("cluster bench: {name} needs a positive number");
                    std::process::exit(2)
                })
        };
        match a.as_str() {
            "--secs" => o.secs = value("--secs"),
            "--threads" => o.threads = value("--threads") as usize,
            "--samples" => o.samples = value("--samples") as usize,
            _ => {} // --bench and whatever cargo passes
        }
    }
    o.threads = o.threads.max(1);
    o.samples = o.samples.max(1);
    o
}

/// Where the clients send requests: one server, or two replicas.
struct Target {
    addrs: Vec<String>,
    token: String,
}

impl Target {
    /// `METHOD path` on server `i` (modulo how many there are).
    fn call(&self, i: usize, method: &str, path: &str, body: Option<&str>) -> HttpResponse {
        let auth = format!("Bearer {}", self.token);
        let addr = &self.addrs[i % self.addrs.len()];
        try_request_with(addr, method, path, &[("Authorization", &auth)], body, LIMIT)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// A call that must answer `want`; its body.
    fn expect(&self, i: usize, want: u16, method: &str, path: &str, body: Option<&str>) -> Value {
        let r = self.call(i, method, path, body);
        assert_eq!(r.status, want, "{method} {path}: {}", r.body);
        if r.body.trim().is_empty() {
            Value::Null
        } else {
            r.json()
        }
    }

    /// Creates one sandbox, retrying admission refusals (429) for a minute.
    fn create(&self, i: usize) -> String {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let r = self.call(i, "POST", "/v1/sandboxes", Some(CREATE));
            match r.status {
                201 => return r.json()["id"].as_str().unwrap().to_string(),
                429 if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
                _ => panic!("create: {} {}", r.status, r.body),
            }
        }
    }

    fn delete(&self, i: usize, id: &str) {
        self.expect(i, 204, "DELETE", &format!("/v1/sandboxes/{id}"), None);
    }

    fn hibernate(&self, i: usize, id: &str) {
        let path = format!("/v1/sandboxes/{id}/hibernate");
        let v = self.expect(i, 200, "POST", &path, None);
        assert_eq!(v["sandbox"]["state"], "hibernated", "{v}");
    }

    /// Wakes `id`; the service's own time for it (`restore.ms` of the
    /// sandbox answered: the pod's, in a cluster), if it says.
    fn wake(&self, i: usize, id: &str) -> Option<f64> {
        let v = self.expect(i, 200, "POST", &format!("/v1/sandboxes/{id}/connect"), None);
        assert_eq!(v["resumed"], true, "{v}");
        v["restore"]["ms"]
            .as_f64()
            .or_else(|| v["sandbox"]["restore"]["ms"].as_f64())
    }
}

/// What one target measured.
#[derive(Default)]
struct Figures {
    creates_per_s: f64,
    wakes_per_s: f64,
    /// The wakes of `wakes_per_s`: each one's time through the API and
    /// the service's part of it (ms), and the machine's CPU time spent
    /// over their timed phases.
    loaded_wake_ms: Vec<f64>,
    loaded_service_ms: Vec<f64>,
    loaded_cpu: Option<CpuSpent>,
    /// That CPU time by process role (`common::cpu::spent_by_role`), ms.
    loaded_roles: BTreeMap<String, f64>,
    create_ms: Vec<f64>,
    wake_ms: Vec<f64>,
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

/// Creates by `threads` clients for `secs`, one thread deleting behind.
fn creates_per_s(t: &Target, o: &Opts) -> f64 {
    let (tx, rx) = mpsc::channel::<String>();
    let made = AtomicUsize::new(0);
    let started = Instant::now();
    let span = Duration::from_secs_f64(o.secs);
    let elapsed = std::thread::scope(|s| {
        let deleter = s.spawn(move || {
            for (i, id) in rx.iter().enumerate() {
                t.delete(i, &id);
            }
        });
        let clients: Vec<_> = (0..o.threads)
            .map(|c| {
                let tx = tx.clone();
                let made = &made;
                s.spawn(move || {
                    while started.elapsed() < span {
                        tx.send(t.create(c)).unwrap();
                        made.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        drop(tx);
        for c in clients {
            c.join().unwrap();
        }
        let elapsed = started.elapsed();
        deleter.join().unwrap();
        elapsed
    });
    made.load(Ordering::Relaxed) as f64 / elapsed.as_secs_f64()
}

/// Wakes of `threads` × 2 hibernated sandboxes by `threads` clients, in
/// rounds, until the timed wake phases add up to `secs`.
fn wakes_per_s(t: &Target, o: &Opts, f: &mut Figures) {
    let ids: Vec<String> = (0..o.threads * 2).map(|i| t.create(i)).collect();
    let mut woken = 0usize;
    let mut timed = Duration::ZERO;
    let mut cpu = CpuSpent::default();
    let samples = Mutex::new(Vec::new());
    while timed.as_secs_f64() < o.secs {
        for (i, id) in ids.iter().enumerate() {
            t.hibernate(i, id);
        }
        let queue = Mutex::new(ids.clone());
        let processes = cpu::by_process();
        let before = CpuSpent::now();
        let started = Instant::now();
        std::thread::scope(|s| {
            for c in 0..o.threads {
                let (queue, samples) = (&queue, &samples);
                s.spawn(move || loop {
                    let Some(id) = queue.lock().unwrap().pop() else {
                        return;
                    };
                    let at = Instant::now();
                    let service = t.wake(c, &id);
                    samples.lock().unwrap().push((ms(at), service));
                });
            }
        });
        timed += started.elapsed();
        // The machine's figure first: the second reading of every process
        // is the bench's own work, not the wakes'.
        if let Some(spent) = CpuSpent::since(before) {
            cpu.busy_ms += spent.busy_ms;
            cpu.idle_ms += spent.idle_ms;
            cpu.cpus = spent.cpus;
        }
        let spent_by = cpu::spent_by_role(&processes, &cpu::by_process());
        for (role, ms) in spent_by {
            *f.loaded_roles.entry(role).or_insert(0.0) += ms;
        }
        woken += ids.len();
    }
    for (i, id) in ids.iter().enumerate() {
        t.delete(i, id);
    }
    f.wakes_per_s = woken as f64 / timed.as_secs_f64();
    for (api, service) in samples.into_inner().unwrap() {
        f.loaded_wake_ms.push(api);
        f.loaded_service_ms.extend(service);
    }
    f.loaded_cpu = (cpu.cpus > 0).then_some(cpu);
}

/// One client's create and wake latencies, `samples` of each.
fn latencies(t: &Target, o: &Opts, f: &mut Figures) {
    for i in 0..o.samples {
        let started = Instant::now();
        let id = t.create(i);
        f.create_ms.push(ms(started));
        t.hibernate(i + 1, &id);
        let started = Instant::now();
        t.wake(i, &id);
        f.wake_ms.push(ms(started));
        t.delete(i + 1, &id);
    }
}

fn measure(name: &str, t: &Target, o: &Opts) -> Figures {
    let mut f = Figures::default();
    eprintln!("cluster bench: {name}: latency, {} samples", o.samples);
    latencies(t, o, &mut f);
    eprintln!("cluster bench: {name}: creates/s, {} clients", o.threads);
    f.creates_per_s = creates_per_s(t, o);
    eprintln!("cluster bench: {name}: wakes/s, {} clients", o.threads);
    wakes_per_s(t, o, &mut f);
    let left = t.expect(0, 200, "GET", "/v1/sandboxes", None);
    assert_eq!(
        left["sandboxes"].as_array().map(Vec::len),
        Some(0),
        "{left}"
    );
    f
}

fn embedded(o: &Opts) -> Figures {
    let dir = tempfile::tempdir().expect("scratch dir");
    // Its hibernations stored as the cluster's pods store theirs
    // (`scripts/cluster`: a local object store by default): a full
    // snapshot uploaded before the hibernation is acknowledged. Without
    // it the two columns would compare two kinds of hibernation, not the
    // queue.
    let objects = dir.path().join("objects");
    let store = objects.to_str().expect("a UTF-8 scratch dir");
    let flags = ["--object-store".to_string(), store.to_string()];
    let serve = match Serve::start(dir.path(), &flags) {
        Started::Up(s) => s,
        Started::Rejected(why) | Started::Failed(why) => panic!("torpor serve: {why}"),
    };
    let t = Target {
        addrs: vec![serve.addr().to_string()],
        token: TOKEN.to_string(),
    };
    measure("embedded", &t, o)
}

fn cluster(o: &Opts) -> Figures {
    let c = Cluster::up("bench");
    let t = Target {
        addrs: vec![c.api(1), c.api(2)],
        token: c.token.clone(),
    };
    measure("cluster", &t, o)
}

/// The replicas' flags of the cross-pod run: a pod silent 4 s is lost.
const MOVE_API_ARGS: &str = "--cluster-down-after-ms 3000 --cluster-lost-after-ms 4000";

/// Wakes on another pod: `samples` sandboxes created on pod1 and
/// hibernated (stored in the pods' shared object store), pod1 killed and
/// counted lost by the replicas, then each woken by one client: the
/// replica has pod2 adopt it (its layer fetched through pod2's chunk
/// cache), moves its row, and the wake restores there. The ms of each
/// wake through the API.
fn cross_pod(o: &Opts) -> Vec<f64> {
    let c = Cluster::up_with_api("bench-move", tests_common::cluster::POD_ARGS, MOVE_API_ARGS);
    let t = Target {
        addrs: vec![c.api(1), c.api(2)],
        token: c.token.clone(),
    };
    eprintln!(
        "cluster bench: cross-pod wakes: {} sandboxes hibernated on pod1",
        o.samples
    );
    let on_pod1 = r#"{"template":"probe","pod":"pod1"}"#;
    let ids: Vec<String> = (0..o.samples)
        .map(|i| {
            let v = t.expect(i, 201, "POST", "/v1/sandboxes", Some(on_pod1));
            let id = v["id"].as_str().unwrap().to_string();
            t.hibernate(i + 1, &id);
            id
        })
        .collect();
    c.kill("pod1");
    // Lost once silent past the replicas' limit (and their next read).
    std::thread::sleep(Duration::from_millis(5500));
    eprintln!("cluster bench: cross-pod wakes: pod1 lost, waking each on pod2");
    let mut took = Vec::with_capacity(ids.len());
    for (i, id) in ids.iter().enumerate() {
        let started = Instant::now();
        let path = format!("/v1/sandboxes/{id}/connect");
        let v = t.expect(i, 200, "POST", &path, None);
        took.push(ms(started));
        assert_eq!(v["sandbox"]["pod"], "pod2", "{v}");
        assert_eq!(v["resumed"], true, "{v}");
    }
    for (i, id) in ids.iter().enumerate() {
        t.delete(i, id);
    }
    took
}

fn met(ok: bool) -> &'static str {
    if ok {
        "ok"
    } else {
        "MISS"
    }
}

fn p(v: &[f64], q: f64) -> f64 {
    percentile(v, q)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if !args.iter().any(|a| a == "--bench") {
        println!(
            "cluster bench: run with `cargo bench --bench cluster` (it starts PostgreSQL, \
             nats-server, two pods and two replicas)"
        );
        return;
    }
    let o = opts(&args);
    let e = embedded(&o);
    let c = cluster(&o);
    let moved = cross_pod(&o);
    let mut table = Table::new();
    table.load_style(UTF8_FULL_CONDENSED);
    table.set_header(vec![
        "".to_string(),
        "embedded (1 torpor serve)".to_string(),
        "cluster (2 replicas, 2 pods)".to_string(),
        "queue adds".to_string(),
        "target (issue 31)".to_string(),
    ]);
    let rate = |v: f64| format!("{v:.1}");
    // Cluster / embedded, against >= 0.8x.
    let ratio = |c: f64, e: f64| {
        let r = c / e;
        format!("{r:.2}x of embedded, >= 0.8x: {}", met(r >= 0.8))
    };
    table.add_row(vec![
        format!("creates/s ({} clients, {} s)", o.threads, o.secs),
        rate(e.creates_per_s),
        rate(c.creates_per_s),
        String::new(),
        ratio(c.creates_per_s, e.creates_per_s),
    ]);
    table.add_row(vec![
        format!("wakes/s ({} clients)", o.threads),
        rate(e.wakes_per_s),
        rate(c.wakes_per_s),
        String::new(),
        ratio(c.wakes_per_s, e.wakes_per_s),
    ]);
    // Where the loaded wakes' time went: the API's answer, the service's
    // part of it, and the CPU the machine spent per wake.
    let loaded = |v: &[f64]| {
        if v.is_empty() {
            "-".to_string()
        } else {
            format!("{:.1}", p(v, 0.5))
        }
    };
    table.add_row(vec![
        format!("wake under load p50, ms ({} clients): API", o.threads),
        loaded(&e.loaded_wake_ms),
        loaded(&c.loaded_wake_ms),
        String::new(),
        String::new(),
    ]);
    table.add_row(vec![
        "  of which the service's restore (restore.ms)".to_string(),
        loaded(&e.loaded_service_ms),
        loaded(&c.loaded_service_ms),
        String::new(),
        String::new(),
    ]);
    let cpu = |f: &Figures| match f.loaded_cpu {
        Some(c) if !f.loaded_wake_ms.is_empty() => format!(
            "{:.1} ({:.0}% idle)",
            c.busy_ms / f.loaded_wake_ms.len() as f64,
            100.0 * c.idle_ms / (c.busy_ms + c.idle_ms).max(1.0)
        ),
        _ => "-".to_string(),
    };
    table.add_row(vec![
        "  CPU per wake under load, ms (machine idle)".to_string(),
        cpu(&e),
        cpu(&c),
        String::new(),
        String::new(),
    ]);
    // That CPU by process: where the cluster's extra time goes.
    let roles: std::collections::BTreeSet<&String> =
        e.loaded_roles.keys().chain(c.loaded_roles.keys()).collect();
    let per_wake = |f: &Figures, role: &str| match f.loaded_roles.get(role) {
        Some(ms) if !f.loaded_wake_ms.is_empty() => {
            format!("{:.2}", ms / f.loaded_wake_ms.len() as f64)
        }
        _ => "-".to_string(),
    };
    for role in roles {
        table.add_row(vec![
            format!("    of which {role}"),
            per_wake(&e, role),
            per_wake(&c, role),
            String::new(),
            String::new(),
        ]);
    }
    // What no process alive at the phase's end was charged with: processes
    // that ended meanwhile, interrupts, the kernel's own threads.
    let unattributed = |f: &Figures| match f.loaded_cpu {
        Some(c) if !f.loaded_wake_ms.is_empty() => {
            let charged: f64 = f.loaded_roles.values().sum();
            format!(
                "{:.2}",
                (c.busy_ms - charged).max(0.0) / f.loaded_wake_ms.len() as f64
            )
        }
        _ => "-".to_string(),
    };
    table.add_row(vec![
        "    of which no process left (exited, interrupts)".to_string(),
        unattributed(&e),
        unattributed(&c),
        String::new(),
        String::new(),
    ]);
    for (what, ev, cv) in [
        ("create", &e.create_ms, &c.create_ms),
        ("wake", &e.wake_ms, &c.wake_ms),
    ] {
        for (label, q) in [("p50", 0.5), ("p99", 0.99)] {
            let adds = p(cv, q) - p(ev, q);
            table.add_row(vec![
                format!("{what} {label}, ms (1 client)"),
                format!("{:.1}", p(ev, q)),
                format!("{:.1}", p(cv, q)),
                format!("{adds:+.1}"),
                if q == 0.5 {
                    format!("queue adds <= 5 ms: {}", met(adds <= 5.0))
                } else {
                    String::new()
                },
            ]);
        }
    }
    for (label, q) in [("p50", 0.5), ("p99", 0.99)] {
        table.add_row(vec![
            format!("wake on another pod, its own lost {label}, ms (1 client)"),
            "-".to_string(),
            format!("{:.1}", p(&moved, q)),
            String::new(),
            String::new(),
        ]);
    }
    println!("{table}");
    println!(
        "wake on another pod: {} probe sandboxes (64 MiB) hibernated on pod1 with their \
         snapshots stored, pod1 killed and lost (4 s), each woken through a replica: pod2 \
         adopts it (the layer fetched through its chunk cache), the row moves, the wake \
         restores",
        moved.len()
    );
}
