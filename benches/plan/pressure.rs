//! The plan bench's pressure mode (`cargo bench --bench plan --
//! --pressure`): the planner against a live `torpor serve` under memory
//! pressure, as ratios plan/live.
//!
//! The guests hold memory: a probe template whose guests rewrite
//! [`WORKLOAD_MIB`] of their memory every second (`probe.mib`, as
//! tests/memory_pressure.rs's hogs), so every running sandbox holds it
//! resident and every hibernation writes it. The run:
//!
//! 1. `torpor serve` with the replay's policy interval and a keep-alive
//!    longer than the trace (only pressure hibernates), the pod at the
//!    host's memory; `torpor plan calibrate` against it (the disk's write
//!    bandwidth, creates), then the hog template measured through the API
//!    (a warm-up and [`HOG_SAMPLES`] cycles of create, its guest's memory
//!    settled, hibernate, wake, delete): what a running hog holds
//!    resident (the calibration's fresh memory), its hibernation time and
//!    snapshot bytes (every hibernation writes its workload), its creates
//!    and wakes.
//! 2. The service stopped, the pod given a memory budget of
//!    [`BUDGET_HOGS`] hogs in the store (`set_pod_capacity`: the API
//!    cannot shrink a pod), the service started again on the same data;
//!    ratio [`RATIO`] (admission never refuses), high watermark
//!    [`HIGH_WATERMARK`].
//! 3. A seeded trace replayed live (`POST .../connect` wakes a hibernated
//!    one): a hog used throughout, alone for its first 10.5 s ([`ALONE_S`]),
//!    then `--sandboxes` hog sessions (a create, requests every 0.4-1.5 s
//!    for 6-12 s, a delete; starts spread over 15 s, so more run at once
//!    than the budget holds), while `GET /v1/pods` is polled
//!    for resident memory every [`POLL`], and played through the planner
//!    with the same pod (budget, cores, policy interval), setting and
//!    calibration.
//!
//! Compared, plan against live: resident memory's peak; pressure
//! hibernations (live: every hibernation, since none idles out);
//! creates and wakes refused by the pressure gate (429 under memory
//! pressure); wake p50 and p99. Printed with the ratio plan/live, not
//! enforced: the bench fails on errors, or if the live run met no
//! pressure (nothing compared). `--timeline` adds resident memory second
//! by second, plan and live. Needs root (the jail's cgroups, which
//! resident memory is read from). About a minute.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use torpor_scheduler::model::PodId;
use torpor_scheduler::plan::{self, sim::quantile, Calibration, PodShape, Setting, Trace};
use torpor_scheduler::service::LOCAL_POD;
use torpor_scheduler::store::Store;

use super::{calibrate, errors_summary, hibernations_ok, r3, replay, Opts, Rng, POLICY_MS};
use crate::common::serve::{Serve, Started, REQUEST_LIMIT};

/// Sessions of the trace unless `--sandboxes` says otherwise.
pub const SANDBOXES: usize = 12;
/// The hog template: its guests' memory, and what each rewrites every
/// second (MiB).
const HOG_MEM_MIB: u32 = 128;
const WORKLOAD_MIB: u64 = 64;
/// Cycles of the hog's calibration (after one warm-up).
const HOG_SAMPLES: usize = 3;
/// The pod's memory budget, in settled hogs, and its high watermark:
/// marks at 0.495, 0.55 and 0.775 of it, about 2.2, 2.5 and 3.5 hogs,
/// each half a hog or more from a whole number of them. Two hogs run
/// below the high mark; a third, which the gate admits (3 <= 3.5), takes
/// the pod past it, and the policy hibernates one to get below the low
/// mark; a fourth is refused (4 > 3.5) until it has. So every admission
/// while two run costs a pressure hibernation, whatever the hogs' few
/// MiB of spread.
const BUDGET_HOGS: f64 = 4.5;
const HIGH_WATERMARK: f64 = 0.55;
const RATIO: f64 = 10.0;
/// Longer than the trace: only pressure hibernates.
const KEEP_ALIVE_MS: u64 = 600_000;
/// How often the live pod's resident memory is read.
const POLL: Duration = Duration::from_millis(50);
/// How long a guest may take to touch its workload.
const TOUCH_LIMIT: Duration = Duration::from_secs(30);
const MIB: f64 = 1048576.0;

/// Seconds the trace's first hog runs alone: past the gate's 10 s of a
/// restore settling, so that both the service and the planner count the
/// others at what a settled one holds.
const ALONE_S: f64 = 10.5;

/// The trace: a hog created first and used every 0.5-1 s to the end,
/// then, after [`ALONE_S`], `o.sandboxes` hog sessions starting over 15 s,
/// each a create, requests every 0.4-1.5 s for 6-12 s, a delete.
fn trace(o: &Opts) -> String {
    let mut rng = Rng(o.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut events: Vec<(f64, usize, String)> = Vec::new();
    let mut session = |i: usize, start: f64, end: f64, gap: (f64, f64), rng: &mut Rng| {
        let name = format!("h{i}");
        let mut seq = 0;
        let mut push = |t: f64, line: Value| {
            events.push((t, i * 1000 + seq, line.to_string()));
            seq += 1;
        };
        push(
            start,
            json!({"t": r3(start), "sandbox": name, "event": "create", "mem_mib": HOG_MEM_MIB}),
        );
        let mut t = start + 0.3;
        while t < end {
            push(
                t,
                json!({"t": r3(t), "sandbox": name, "event": "request", "duration_ms": 0, "mem_mib": 0}),
            );
            t += rng.between(gap.0, gap.1);
        }
        push(
            end,
            json!({"t": r3(end), "sandbox": name, "event": "delete"}),
        );
    };
    let mut last = ALONE_S;
    for i in 1..=o.sandboxes {
        let start = rng.between(ALONE_S, ALONE_S + 15.0);
        let end = start + rng.between(6.0, 12.0);
        last = last.max(end);
        session(i, start, end, (0.4, 1.5), &mut rng);
    }
    session(0, 0.0, last + 0.5, (0.5, 1.0), &mut rng);
    events.sort_by(|a, b| r3(a.0).total_cmp(&r3(b.0)).then(a.1.cmp(&b.1)));
    events.into_iter().map(|e| e.2 + "\n").collect()
}

fn cmdline() -> String {
    format!("probe.mib={WORKLOAD_MIB} probe.ticks=100 probe.hz=100")
}

fn flags() -> Vec<String> {
    [
        "--policy-interval-ms".to_string(),
        POLICY_MS.to_string(),
        "--keep-alive-ms".to_string(),
        KEEP_ALIVE_MS.to_string(),
    ]
    .to_vec()
}

fn resident_mib(serve: &Serve, id: &str) -> Result<f64, String> {
    let s = serve.expect(200, "GET", &format!("/v1/sandboxes/{id}"), None)?;
    Ok(s["memory"]["resident_bytes"].as_f64().unwrap_or(0.0) / MIB)
}

/// Waits until sandbox `id`'s guest holds its workload, then a guest
/// iteration more: what it holds settled (MiB).
fn settled_mib(serve: &Serve, id: &str) -> Result<f64, String> {
    let deadline = Instant::now() + TOUCH_LIMIT;
    while resident_mib(serve, id)? < WORKLOAD_MIB as f64 {
        if Instant::now() > deadline {
            return Err(format!("{id} did not touch {WORKLOAD_MIB} MiB"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(1200));
    resident_mib(serve, id)
}

fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

/// The calibration `torpor plan calibrate` measured, with the hog's own
/// figures where the trace's sandboxes are hogs: creates, wakes (their
/// spread), hibernation time and snapshot bytes (the trace dirties
/// nothing, so the planner charges each hibernation the flat figures),
/// what a running one holds. Also what one holds, for the budget.
fn hog_calibration(serve: &Serve, tpl: &str, base: Calibration) -> Result<Calibration, String> {
    let (mut create, mut wake, mut hibernate, mut snapshot, mut held) =
        (vec![], vec![], vec![], vec![], vec![]);
    let (mut restored, mut touch) = (vec![], vec![]);
    for cycle in 0..=HOG_SAMPLES {
        let t = Instant::now();
        let body = json!({"template": tpl}).to_string();
        let s = serve.expect(201, "POST", "/v1/sandboxes", Some(&body))?;
        let create_ms = ms_since(t);
        let id = s["id"].as_str().ok_or(format!("no id in {s}"))?.to_string();
        let result = (|| {
            let mib = settled_mib(serve, &id)?;
            let t = Instant::now();
            let h = serve.expect(200, "POST", &format!("/v1/sandboxes/{id}/hibernate"), None)?;
            let hibernate_ms = ms_since(t);
            // The newest snapshot directory (named after the generation
            // the hibernation started from, plus one).
            let generation = h["sandbox"]["generation"].as_u64().unwrap_or(0);
            let dir = serve.data().join("sandboxes").join(&id);
            let bytes = (0..=generation + 1)
                .rev()
                .map(|g| dir.join(format!("snap-{g}")))
                .find(|d| d.is_dir())
                .map_or(0, |d| torpor_storage::allocated_bytes(&d));
            let t = Instant::now();
            serve.expect(200, "POST", &format!("/v1/sandboxes/{id}/resume"), None)?;
            let wake_ms = ms_since(t);
            // What the woken guest holds at once, and how long it takes
            // to hold nine tenths of its settled memory again.
            let restored = resident_mib(serve, &id)?;
            let t = Instant::now();
            while resident_mib(serve, &id)? < 0.9 * mib {
                if t.elapsed() > TOUCH_LIMIT {
                    return Err(format!("{id} did not touch its memory again"));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let touch = (restored, ms_since(t));
            Ok::<_, String>((mib, hibernate_ms, bytes as f64, wake_ms, touch))
        })();
        serve.delete(&id)?;
        let (mib, hibernate_ms, bytes, wake_ms, (restored_mib, touch_ms)) = result?;
        // The first cycle warms the pool's shells of this shape up.
        if cycle > 0 {
            create.push(create_ms);
            held.push(mib);
            hibernate.push(hibernate_ms);
            snapshot.push(bytes);
            wake.push(wake_ms);
            restored.push(restored_mib);
            touch.push(touch_ms);
        }
    }
    let p50 = |v: &mut Vec<f64>| quantile(v, 0.5);
    let snapshot_bytes = p50(&mut snapshot);
    if snapshot_bytes < (WORKLOAD_MIB as f64 / 2.0) * MIB {
        return Err(format!(
            "a hog's snapshot holds {:.1} MiB, less than half its workload: not found under {}",
            snapshot_bytes / MIB,
            serve.data().display()
        ));
    }
    let cal = Calibration {
        source: "measured".into(),
        description: format!(
            "plan bench --pressure: torpor plan calibrate (disk writes {:.0} MiB/s), with \
             {HOG_SAMPLES} cycles of the hog template's creates, wakes, hibernations, \
             snapshots, settled resident memory and the time a woken one takes to touch it",
            base.disk_write_mib_s
        ),
        create_ms: p50(&mut create),
        wake_ms: p50(&mut wake),
        // p50 sorted it.
        wake_ms_spread: wake,
        hibernate_ms: p50(&mut hibernate),
        hibernate_ms_per_dirty_mib: 0.0,
        snapshot_base_bytes: snapshot_bytes,
        snapshot_bytes_per_dirty_mib: base.snapshot_bytes_per_dirty_mib,
        fresh_pss_mib: p50(&mut held),
        restored_pss_mib: p50(&mut restored),
        touch_ms: p50(&mut touch),
        ..base
    };
    cal.validate()?;
    Ok(cal)
}

/// Gives the local pod of the (stopped) service whose data directory is
/// `data` `memory_mib` of memory.
fn set_budget(data: &Path, memory_mib: u64) -> Result<(), String> {
    let store = Store::open(data).map_err(|e| format!("open the store: {e}"))?;
    let pod = PodId::new(LOCAL_POD);
    let p = store.get_pod(&pod).map_err(|e| e.to_string())?;
    store
        .set_pod_capacity(&pod, memory_mib << 20, p.vcpus, p.disk_bytes)
        .map_err(|e| e.to_string())?;
    Ok(())
}

fn start(dir: &Path) -> Result<Serve, String> {
    match Serve::start(dir, &flags()) {
        Started::Up(s) => Ok(s),
        Started::Rejected(why) | Started::Failed(why) => {
            Err(format!("torpor serve did not start: {why}"))
        }
    }
}

/// The live pod's resident memory (MiB) now.
fn pod_resident_mib(serve: &Serve) -> Option<f64> {
    let (status, text) = serve.raw("GET", "/v1/pods", None, REQUEST_LIMIT).ok()?;
    let v: Value = serde_json::from_str(&text).ok().filter(|_| status == 200)?;
    v["pods"]
        .as_array()?
        .iter()
        .find(|p| p["id"] == LOCAL_POD)?["resident_mib"]
        .as_f64()
}

/// The bench's `--pressure` run: its exit code.
pub fn run(o: &Opts) -> i32 {
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path().join("serve");
    let started = Instant::now();
    let mut serve = None;
    let result = compare(&mut serve, o, &dir);
    println!(
        "\npressure run took {:.0} s",
        started.elapsed().as_secs_f64()
    );
    let code = match result {
        Ok(()) => 0,
        Err(e) => {
            let log = serve.as_ref().map(|s| s.log_tail(10)).unwrap_or_default();
            eprintln!("plan bench --pressure: FAILED: {e}\nserve log ends:\n{log}");
            1
        }
    };
    drop(serve);
    drop(scratch);
    code
}

/// Calibrates, sets the budget, replays; `slot` holds the service
/// running (for its log, should this fail).
fn compare(slot: &mut Option<Serve>, o: &Opts, dir: &Path) -> Result<(), String> {
    let serve = slot.insert(start(dir)?);
    let base = calibrate(serve, dir)?;
    let tpl = serve.build_template("plan-hog", HOG_MEM_MIB, Some(&cmdline()))?;
    let cal = hog_calibration(serve, &tpl, base)?;
    let budget_mib = (cal.fresh_pss_mib * BUDGET_HOGS).ceil() as u64;
    if (o.sandboxes + 1) as f64 * f64::from(HOG_MEM_MIB) > budget_mib as f64 * RATIO {
        return Err(format!(
            "{} sandboxes of {HOG_MEM_MIB} MiB pass ratio {RATIO} of {budget_mib} MiB: \
             admission would refuse some (give fewer --sandboxes)",
            o.sandboxes + 1
        ));
    }
    for note in serve.stop_keeping_data() {
        eprintln!("plan bench: {note}");
    }
    set_budget(&serve.data(), budget_mib)?;
    let serve = slot.insert(start(dir)?);
    serve.expect(
        200,
        "PATCH",
        "/v1/pods/pod_local",
        Some(
            &json!({"oversubscription_ratio": RATIO, "high_watermark": HIGH_WATERMARK}).to_string(),
        ),
    )?;
    let pods = serve.expect(200, "GET", "/v1/pods", None)?;
    let pod = pods["pods"]
        .as_array()
        .and_then(|p| p.iter().find(|p| p["id"] == LOCAL_POD))
        .ok_or("no local pod")?;
    if pod["memory_bytes"].as_u64() != Some(budget_mib << 20) {
        return Err(format!("the pod did not take its budget: {pod}"));
    }
    let cores = pod["vcpus"].as_u64().unwrap_or(2) as u32;

    let text = trace(o);
    let trace = Trace::read(text.as_bytes()).map_err(|e| e.to_string())?;
    let p = simulate(&trace, budget_mib, cores, &cal);

    let serve = &*serve;
    let before = hibernations_ok(serve);
    // (seconds into the replay, resident MiB) of the live pod.
    let series = Mutex::new(Vec::new());
    let done = AtomicBool::new(false);
    let t0 = Instant::now() + Duration::from_millis(200);
    let mut live = std::thread::scope(|scope| {
        scope.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                if let Some(mib) = pod_resident_mib(serve) {
                    let t = Instant::now().saturating_duration_since(t0).as_secs_f64();
                    series.lock().unwrap().push((t, mib));
                }
                std::thread::sleep(POLL);
            }
        });
        let live = replay(serve, &trace, &tpl);
        done.store(true, Ordering::Relaxed);
        live
    });
    let series = series.into_inner().unwrap();
    let live_peak = series.iter().map(|s| s.1).fold(0.0, f64::max);
    let live_hibernations = hibernations_ok(serve).saturating_sub(before);
    println!(
        "plan vs live under memory pressure: 1 + {} hog sessions ({HOG_MEM_MIB} MiB guests \
         rewriting {WORKLOAD_MIB} MiB/s), seed {}, {} events over {:.1} s; pod {budget_mib} MiB \
         ({BUDGET_HOGS} hogs of {:.1} MiB), {cores} cores, ratio {RATIO}, watermark \
         {HIGH_WATERMARK}, keep-alive {KEEP_ALIVE_MS} ms, policy every {POLICY_MS} ms\n\
         calibration: create {:.1} ms, wake {:.1} ms (max {:.1}), hibernate {:.1} ms, \
         snapshot {:.1} MiB, disk writes {:.0} MiB/s, a woken one holds {:.1} MiB and \
         its {:.1} MiB again after {:.0} ms",
        o.sandboxes,
        o.seed,
        trace.events.len(),
        trace.end_ms() as f64 / 1000.0,
        cal.fresh_pss_mib,
        cal.create_ms,
        cal.wake_ms,
        cal.wake_ms_spread.last().copied().unwrap_or(cal.wake_ms),
        cal.hibernate_ms,
        cal.snapshot_base_bytes / MIB,
        cal.disk_write_mib_s,
        cal.restored_pss_mib,
        cal.fresh_pss_mib,
        cal.touch_ms,
    );
    let live_pressure_429 = live.rejected_pressure + live.wakes_refused_pressure;
    let (live_p50, live_p99) = (
        quantile(&mut live.wake_ms, 0.5),
        quantile(&mut live.wake_ms, 0.99),
    );
    // Admission refuses nothing at this ratio (checked above): the
    // planner's refused creates and wakes are its pressure gate's.
    let rows = [
        ("resident peak (MiB)", p.resident_peak_mib, live_peak),
        (
            "pressure hibernations",
            p.hibernations_watermark as f64,
            live_hibernations as f64,
        ),
        (
            "pressure 429s",
            p.pressure_refusals as f64,
            live_pressure_429 as f64,
        ),
        (
            "  of creates",
            p.creates_rejected as f64,
            live.rejected_pressure as f64,
        ),
        (
            "  of wakes",
            p.wakes_rejected as f64,
            live.wakes_refused_pressure as f64,
        ),
        (
            "creates admitted",
            p.creates_admitted as f64,
            live.admitted as f64,
        ),
        ("wakes", p.wakes as f64, live.wakes as f64),
        ("wake p50 (ms)", p.wake_p50_ms, live_p50),
        ("wake p99 (ms)", p.wake_p99_ms, live_p99),
    ];
    println!("\n| | plan | live | plan/live |\n|---|---:|---:|---:|");
    for (name, a, b) in rows {
        let ratio = if b > 0.0 {
            format!("{:.2}", a / b)
        } else if a == 0.0 {
            "(both 0)".into()
        } else {
            "(live 0)".into()
        };
        println!("| {name} | {a:.1} | {b:.1} | {ratio} |");
    }
    println!(
        "\nplan: hibernations written {:.0} MiB, write backlog peak {:.0} MiB, disk needed \
         {:.1} of {:.0} MiB/s; {}",
        p.snapshot_written_bytes / MIB,
        p.write_backlog_peak_bytes / MIB,
        p.disk_needed_mib_s,
        p.disk_write_mib_s,
        p.infeasible.as_deref().unwrap_or("feasible")
    );
    for r in &live.refusals {
        println!("live refusal: {r}");
    }
    if o.timeline {
        print_timeline(
            &p.memory_series,
            &series,
            budget_mib as f64 * HIGH_WATERMARK,
        );
    }
    if !live.errors.is_empty() {
        return Err(errors_summary(&live.errors));
    }
    if live_hibernations == 0 {
        return Err("the live run met no memory pressure: nothing was compared".into());
    }
    Ok(())
}

/// Resident memory over the replay, plan and live, the most of each
/// second (`--timeline`).
fn print_timeline(plan: &[(f64, f64)], live: &[(f64, f64)], high_mib: f64) {
    let end = plan.iter().chain(live).map(|s| s.0).fold(0.0, f64::max);
    let most = |v: &[(f64, f64)], s: f64| {
        v.iter()
            .filter(|p| p.0 >= s && p.0 < s + 1.0)
            .map(|p| p.1)
            .fold(f64::NAN, f64::max)
    };
    println!("\nresident MiB, the most of each second (high mark {high_mib:.0}):");
    println!("| s | plan | live |\n|---:|---:|---:|");
    for s in 0..=end as usize {
        let s = s as f64;
        println!("| {s:.0} | {:.0} | {:.0} |", most(plan, s), most(live, s));
    }
}

/// The smoke run's part (`cargo test`, no `--bench`): the pressure trace
/// played on the planner alone, with a hog's figures from the built-in
/// calibration (no live replay: that takes minutes). Its exit code.
pub fn plan_only(o: &Opts) -> i32 {
    let o = Opts {
        sandboxes: SANDBOXES,
        ..*o
    };
    let trace = match Trace::read(trace(&o).as_bytes()) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("plan bench: the pressure trace does not read: {e}");
            return 1;
        }
    };
    let hog_mib = WORKLOAD_MIB as f64 + 8.0;
    let cal = Calibration {
        fresh_pss_mib: hog_mib,
        snapshot_base_bytes: WORKLOAD_MIB as f64 * MIB,
        ..Calibration::builtin()
    };
    let memory_mib = (hog_mib * BUDGET_HOGS).ceil() as u64;
    let p = simulate(&trace, memory_mib, 2, &cal);
    println!(
        "\npressure trace on the planner alone: {} sandboxes, resident peak {:.0} of {} MiB, \
         {} pressure hibernations, {} pressure 429s, wake p99 {:.1} ms",
        o.sandboxes,
        p.resident_peak_mib,
        memory_mib,
        p.hibernations_watermark,
        p.pressure_refusals,
        p.wake_p99_ms
    );
    if p.hibernations_watermark == 0 || p.pressure_refusals == 0 || p.infeasible.is_some() {
        eprintln!("plan bench: the pressure trace meets no pressure on the planner: {p:?}");
        return 1;
    }
    0
}

/// The trace played by the planner on a pod of `memory_mib` and `cores`
/// at the replay's setting.
fn simulate(trace: &Trace, memory_mib: u64, cores: u32, cal: &Calibration) -> plan::Outcome {
    let shape = PodShape {
        memory_mib,
        cores,
        policy_interval_ms: POLICY_MS,
    };
    let setting = Setting {
        ratio: RATIO,
        keep_alive_ms: KEEP_ALIVE_MS,
        high_watermark: HIGH_WATERMARK,
    };
    plan::simulate(trace, shape, setting, cal)
}
