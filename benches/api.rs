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
//! deleting behind them) with the standby pool's refills per second (the
//! service's `torpor_standby_shells_made` over the same time); a burst of
//! 50 creates fired at once (all answered? p50/p95/max, the shells ready
//! when it was fired, and the pool's refill rate: shells made from the
//! burst until the pool holds as many again, its sandboxes deleted); PSS per paused and per running clone (sum of the
//! clones' VMM processes' PSS / clones). The table marks the issue's
//! targets met or missed. A field the service does not answer (yet) prints
//! as "-"; a configuration whose `serve` rejects a flag is skipped with a
//! note.
//!
//! Every VMM runs jailed, as under `torpor serve`'s defaults; the default
//! configuration runs a second time with `--no-jail` (row "... no jail") so
//! one run shows what the jail costs each operation (as root only: without
//! root the service cannot jail, and every row runs unjailed, noted).
//!
//! The object store (issue 29, `api/store.rs`): `torpor serve
//! --object-store` on a directory and on SeaweedFS's S3 (when `weed` is
//! installed), a 256 MiB probe hibernated with its upload, woken warm
//! (its snapshot on the pod's disk) and cold (removed first: downloaded),
//! the cold wake split into download and restore; its own table, run with
//! the others or alone (`--only store`; not in the smoke run).
//!
//! `cargo bench --bench api [-- --quick --runs N --clones N --secs S
//! --threads T --only pool|nopool|default|file|uffd|uffd-shared|256|2048|jail|nojail|store
//! --ab PATH --flame DIR]`
//! (`--only` repeats and takes comma lists: OR within a dimension, AND
//! across). Defaults: 30 samples, 100 clones, 30 s, 4 threads, 256 MiB and
//! 2 GiB; `--quick`: 10 samples, 20 clones, 5 s, 256 MiB only. Without
//! `--bench` (`cargo test --all-targets`) it makes a smoke run of the
//! default configuration. The machine is shared (2 cores): compare the
//! columns of one run rather than numbers across runs. `--ab PATH` runs
//! every configuration twice, first with the `torpor` at PATH (another
//! build, its `torpor-vmm` beside it: column "A") then with this one ("B"),
//! `--rounds N` times over, so a change is measured against its baseline
//! on the same machine at nearly the same time.
//!
//! `--flame DIR` (with `--bench`; `api/flame.rs`): a flame graph of the
//! create requests and one of the wake requests per configuration column,
//! from `perf record -a -e cpu-clock --call-graph dwarf` enabled around
//! each sample's request, kept for `torpor serve` and the processes it
//! started (its VMMs), folded and drawn with inferno:
//! `DIR/NAME-create.svg` and `DIR/NAME-wake.svg` (NAME the configuration,
//! e.g. `256-mib-default`) beside their `.folded` stacks. The bench prints
//! each graph's path, its CPU time by process, its top 5 functions by self
//! time and its top 5 torpor functions with the library and kernel frames
//! under them. perf runs only over those two phases, stopped by SIGINT
//! (also when a phase fails); without perf, or if it refuses, the bench
//! says why and runs without graphs. Sampling slows the requests it
//! samples: their times in that run are not comparable with others.
//!
//! The templates are built through the API (`POST /v1/templates`, kind
//! probe): one at the service's probe pace (an iteration a second) for
//! creates, pause/resume and PSS, and a fast-paced twin (`probe.ticks=1
//! probe.hz=1000`, a line about every millisecond) for wakes, so "wake ->
//! first line" measures the wake rather than the guest's idle time.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

mod common;

use common::cpu::CpuSpent;
use common::percentile;
use common::serve::{parse, Serve, Started, REQUEST_LIMIT};
use torpor_scheduler::service::vmm::pss_kib;

/// A guest prints a new probe line within this.
const LINE_LIMIT: Duration = Duration::from_secs(60);
/// Workload and pace of the wake template: a line about every millisecond.
const FAST_CMDLINE: &str = "probe.mib=1 probe.ticks=1 probe.hz=1000";
/// Threads deleting behind the sustained creates.
const DELETERS: usize = 2;
/// Creates fired at once in the burst (the 50).
const BURST: usize = 50;
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
    /// `--ab`: the baseline `torpor` each configuration also runs with.
    ab: Option<PathBuf>,
    /// `--rounds`: how often the A/B pairs repeat.
    rounds: usize,
    /// `--flame`: where the flame graphs of creates and wakes go.
    flame: Option<PathBuf>,
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
    "jail",
    "nojail",
    "store",
];

fn usage(msg: &str) -> ! {
    eprintln!("api bench: {msg}");
    eprintln!(
        "usage: cargo bench --bench api [-- --quick --runs N --clones N --secs S --threads T \
         --only {} --ab PATH --rounds N --flame DIR]",
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
            ab: None,
            rounds: 1,
            flame: None,
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
                "--rounds" => o.rounds = value("--rounds") as usize,
                "--ab" => {
                    let v = it
                        .next()
                        .unwrap_or_else(|| usage("--ab needs a torpor binary"));
                    let exe = PathBuf::from(v);
                    if !exe.is_file() || !exe.with_file_name("torpor-vmm").is_file() {
                        usage(&format!("--ab {v}: not a torpor with torpor-vmm beside it"));
                    }
                    o.ab = Some(exe);
                }
                "--flame" => {
                    let v = it
                        .next()
                        .unwrap_or_else(|| usage("--flame needs a directory"));
                    o.flame = Some(PathBuf::from(v));
                }
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
        o.rounds = o.rounds.max(1);
        o
    }

    fn has(&self, w: &str) -> bool {
        self.only.iter().any(|o| o == w)
    }

    /// Whether the object-store table runs (`--only store`, or every
    /// table but the smoke run's).
    fn store(&self) -> bool {
        self.has("store") || (self.only.is_empty() && !self.smoke)
    }

    /// The configurations to run, in table order, per guest size.
    fn configs(&self) -> Vec<Config> {
        if !self.only.is_empty() && self.only.iter().all(|w| w == "store") {
            return Vec::new();
        }
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
        let root = is_root();
        let jails: (bool, bool) = match (self.has("jail"), self.has("nojail")) {
            _ if !root => (false, true),
            (false, false) => (true, false),
            picked => picked,
        };
        let mut out = Vec::new();
        for mem in sizes {
            let default = Config {
                mem,
                pool: None,
                backend: None,
                jail: jails.0,
                baseline: false,
            };
            if self.smoke && self.only.is_empty() {
                out.push(default);
                continue;
            }
            if self.has("default") || !kinds {
                if jails.0 {
                    out.push(default);
                }
                // The jail's cost: the same defaults unjailed, next row
                // (asked for, or by default as root).
                if jails.1 || (root && !self.has("jail")) {
                    out.push(Config {
                        jail: false,
                        ..default
                    });
                }
            }
            if kinds || !self.has("default") {
                for &pool in &pools {
                    for &backend in &backends {
                        out.push(Config {
                            mem,
                            pool: Some(pool),
                            backend: Some(backend),
                            jail: jails.0,
                            baseline: false,
                        });
                    }
                }
            }
        }
        if self.ab.is_none() {
            return out;
        }
        // Each configuration with the baseline, then with this build,
        // side by side; the pairs repeated `rounds` times.
        let pairs: Vec<Config> = out
            .iter()
            .flat_map(|c| {
                [
                    Config {
                        baseline: true,
                        ..*c
                    },
                    *c,
                ]
            })
            .collect();
        (0..self.rounds).flat_map(|_| pairs.clone()).collect()
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
    /// false: `--no-jail`.
    jail: bool,
    /// Runs the `--ab` baseline build ("A") instead of this one.
    baseline: bool,
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
        if !self.jail {
            f.push("--no-jail".into());
        }
        f
    }

    fn name(&self) -> String {
        let name = match (self.pool, self.backend) {
            (Some(p), Some(b)) => format!("{} MiB {}/{b}", self.mem, pool_word(p)),
            _ => format!("{} MiB default", self.mem),
        };
        let name = if self.jail || !is_root() {
            name
        } else {
            format!("{name} no jail")
        };
        if self.baseline {
            format!("{name} [A: baseline]")
        } else {
            name
        }
    }

    /// Whether the pool-only targets (create latency) apply.
    fn pool_targets(&self) -> bool {
        self.pool != Some(false)
    }
}

/// Whether this bench runs as root (the service jails VMMs only then).
fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

fn pool_word(p: bool) -> &'static str {
    if p {
        "pool"
    } else {
        "nopool"
    }
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
    /// The service's phases (`admit`, `prepare`, `vmm`, `record`, `hook`,
    /// `commit`), ms.
    phases: BTreeMap<String, f64>,
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
        phases: r["phases"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| Some((p[0].as_str()?.to_string(), p[1].as_f64()?)))
            .collect(),
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
    /// Deletes behind the creates (they hold the creates back when slow).
    delete_lat: Vec<f64>,
    standby: usize,
    with_path: usize,
    errors: Vec<String>,
    /// Standby shells the service made meanwhile
    /// (`torpor_standby_shells_made`), None without the counter.
    refills: Option<f64>,
    /// The machine's CPU time (every process, ms) spent meanwhile, and its
    /// idle time: `/proc/stat` before and after.
    cpu: Option<CpuSpent>,
}

/// Creates fired at once (`BURST` threads released together).
#[derive(Default)]
struct Burst {
    fired: usize,
    /// Latency of each answered (201) create.
    lat: Vec<f64>,
    standby: usize,
    errors: Vec<String>,
    /// Shells ready when it was fired (`torpor_standby_shells`).
    ready_before: Option<f64>,
    /// Shells made from its start until the pool held as many again (its
    /// sandboxes deleted), and the seconds that took.
    refill: Option<(f64, f64)>,
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
    /// Each hibernation's memory layer on disk, % of the guest's memory.
    hibernate_dirty_pct: Vec<f64>,
    /// The hibernations' phases (`hibernation.phases`), ms, by name.
    hibernate_phases: BTreeMap<String, Vec<f64>>,
    /// The VMM's own pause + snapshot (`hibernation.vmm_ms`).
    hibernate_vmm: Vec<f64>,
    pause: Vec<f64>,
    resume: Vec<f64>,
    sustained: Option<Sustained>,
    burst: Option<Burst>,
    pss_paused: Option<f64>,
    pss_running: Option<f64>,
    shells_pss: Option<(usize, f64)>,
    /// `--flame`: each graph written, and its top functions by self time.
    flame: Vec<String>,
    backend_seen: BTreeMap<String, usize>,
    notes: Vec<String>,
    failed: bool,
}

#[path = "api/flame.rs"]
mod flame;
#[path = "api/measure.rs"]
mod measure;
#[path = "api/store.rs"]
mod store;
#[path = "api/table.rs"]
mod table;

use measure::{check_answers, measure};
use table::print_table;

/// The configurations of one guest size that ran, and notes on all of it.
#[derive(Default)]
struct Ran {
    done: Vec<(Config, Results)>,
    notes: Vec<String>,
}

fn main() {
    let o = Opts::parse();
    let configs = o.configs();
    if configs.is_empty() && !o.store() {
        usage("--only leaves no configuration");
    }
    if o.smoke {
        eprintln!("api: no --bench argument (cargo test): smoke run of the default configuration");
    }
    // Flame graphs, if asked for and perf records here (never in the
    // smoke run).
    let mut flame_off = None;
    let mut flame = match &o.flame {
        Some(_) if o.smoke => {
            flame_off = Some("ignored without --bench (the smoke run)".to_string());
            None
        }
        Some(dir) => flame::Flame::new(dir).map_err(|e| flame_off = Some(e)).ok(),
        None => None,
    };
    if let (Some(dir), Some(why)) = (&o.flame, &flame_off) {
        eprintln!("api: --flame {}: no flame graphs: {why}", dir.display());
    }
    let scratch = tempfile::tempdir().unwrap_or_else(|e| {
        eprintln!("api bench: a scratch directory: {e}");
        std::process::exit(1);
    });
    let mut failed = false;
    // Per guest size: the configurations that ran, and notes.
    let mut by_size: BTreeMap<u32, Ran> = BTreeMap::new();
    for (i, cfg) in configs.iter().enumerate() {
        let Ran { done, notes } = by_size.entry(cfg.mem).or_default();
        if notes.is_empty() && !is_root() {
            notes.push(
                "not root: the service cannot jail VMMs here, every row runs --no-jail".into(),
            );
        }
        eprintln!(
            "api: [{}] starting torpor serve {}",
            cfg.name(),
            cfg.flags().join(" ")
        );
        let dir = scratch.path().join(format!("c{i}"));
        let started = match (&o.ab, cfg.baseline) {
            (Some(exe), true) => Serve::start_exe(exe, &dir, &cfg.flags()),
            _ => Serve::start(&dir, &cfg.flags()),
        };
        let mut serve = match started {
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
        if let Err(e) = measure(&serve, cfg, &o, flame.as_mut(), &mut r) {
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
    // The object store's table, printed as it ends.
    if o.store() && !store::run(&o, scratch.path()) {
        failed = true;
    }
    drop(scratch);
    if configs.is_empty() {
        // `--only store`: its table is all.
        std::process::exit(i32::from(failed));
    }

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
        if let Some(dir) = &o.flame {
            println!(
                "\n== probe template {mem} MiB: flame graphs of the create and wake requests \
                 (--flame {}; top {} functions by self time)",
                dir.display(),
                flame::TOP
            );
            match &flame_off {
                Some(why) => println!("  none: {why}"),
                None => {
                    let lines: Vec<&String> = done.iter().flat_map(|(_, r)| &r.flame).collect();
                    if lines.is_empty() {
                        println!("  none written (see the notes)");
                    }
                    lines.iter().for_each(|l| println!("  {l}"));
                }
            }
        }
    }
    println!(
        "\ntargets (issue 31): API create p50 <= 2 ms and p99 <= 10 ms with the pool; wake p50 \
         <= 2 ms and p99 <= 10 ms; API overhead over the VMM restore (API time - vmm_ms, p50 per \
         sample) <= 1 ms; hibernate of an idle probe p50 <= 5 ms (about 1 % dirty; the row \
         below it gives the diff's share here); {BURST} creates fired at once all answered, p95 \
         <= 25 ms; >= 300 creates/s sustained from one template (30 s; --quick runs shorter); \
         PSS per paused clone <= 0.5 MiB. \
         \"ok\"/\"MISS\" mark each cell a target applies to; \"-\": the service did not answer \
         the field."
    );
    if failed {
        std::process::exit(1);
    }
}
