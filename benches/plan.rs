//! Validation of `torpor plan` against a live `torpor serve`: one trace,
//! played through the planner (the service's admission and policy code on
//! a simulated pod) and against the API with probe sandboxes at a
//! compressed time scale; plan and live side by side.
//!
//! The trace: `--sandboxes N` sessions of a 256 MiB probe template, each a
//! create, bursts of requests (`POST .../connect`: wakes a hibernated
//! sandbox, marks a running one active) separated by idle gaps some of
//! which pass the keep-alive, then a delete; seeded (`--seed`). It is
//! generated already compressed: the planner replays exactly what the
//! live service sees. Requests last 0 ms and dirty nothing (a probe
//! guest cannot be told to through the API), so the comparison is of
//! admission, hibernation and wake counts and wake latency.
//!
//! The pod: the live one (its physical memory as the service measured
//! it), with a ratio chosen so that `--sandboxes x 256 MiB` is
//! oversubscribed: `--ratio-fraction` of the sessions fit at once. The
//! calibration: measured first with `torpor plan calibrate` against the
//! same serve (a few samples), so plan and live use the host's costs.
//!
//! Tolerances checked: admitted and rejected creates within 10% of the
//! creates, wakes and refused wakes within 10% of the wake attempts,
//! hibernations within 10% (never less than 2 each); wake p99 within 2x.
//! The bench exits 1 when one is missed.
//!
//! `cargo bench --bench plan [-- --sandboxes N --seed S]`; under
//! `cargo test` (no `--bench`) a smoke run of 8 sandboxes whose
//! tolerances are reported but not enforced (8 sessions give too few
//! events for a percentage; errors still fail it), then the pressure
//! mode's trace played on the planner alone (no live replay).
//!
//! `cargo bench --bench plan -- --pressure [--sandboxes N --seed S]`:
//! the same comparison under memory pressure, with guests that hold
//! memory, on a pod given a small memory budget: resident peak, pressure
//! hibernations, pressure 429s and wake latency, plan against live, as
//! ratios (`pressure.rs`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use torpor_scheduler::plan::{self, Calibration, PodShape, Setting, Trace};

mod common;
#[path = "plan/pressure.rs"]
mod pressure;

use common::serve::{Serve, Started, REQUEST_LIMIT, TOKEN};
use common::TORPOR;

/// Keep-alive of the replay (serve's default for the sandboxes).
const KEEP_ALIVE_MS: u64 = 1500;
/// Policy interval of the replay.
const POLICY_MS: u64 = 250;
const MEM_MIB: u32 = 256;

#[derive(Clone, Copy)]
struct Opts {
    /// No `--bench` (cargo test): a small run whose tolerances are
    /// reported, not enforced (errors still fail it).
    smoke: bool,
    sandboxes: usize,
    seed: u64,
    /// Fraction of the sessions the admission limit holds at once.
    fit: f64,
    /// `--pressure`: the memory-pressure comparison (`pressure.rs`).
    pressure: bool,
    /// `--timeline`: with `--pressure`, resident memory second by second.
    timeline: bool,
}

fn opts() -> Opts {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let smoke = !args.iter().any(|a| a == "--bench");
    let pressure = args.iter().any(|a| a == "--pressure");
    let mut o = Opts {
        smoke,
        sandboxes: match (pressure, smoke) {
            (true, _) => pressure::SANDBOXES,
            (false, true) => 8,
            (false, false) => 24,
        },
        seed: 1,
        fit: 0.5,
        pressure,
        timeline: args.iter().any(|a| a == "--timeline"),
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || it.next().cloned().unwrap_or_default();
        match a.as_str() {
            "--sandboxes" => o.sandboxes = val().parse().unwrap_or(o.sandboxes).clamp(2, 200),
            "--seed" => o.seed = val().parse().unwrap_or(1),
            "--ratio-fraction" => o.fit = val().parse().unwrap_or(0.5_f64).clamp(0.1, 1.0),
            _ => {}
        }
    }
    o
}

/// A small seeded generator (xorshift): no dependency for a trace.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }

    fn between(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.next()
    }
}

/// The trace as JSON lines: sessions starting over the first 4 s, each
/// 2-4 bursts of 1-3 requests, gaps of 0.2-0.6 s within a burst and
/// 0.3-1 s or 2.5-4 s between bursts (the keep-alive is 1.5 s, the policy
/// runs every 0.25 s), a delete at the end.
fn trace(o: &Opts) -> String {
    let mut rng = Rng(o.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut events: Vec<(f64, usize, String)> = Vec::new();
    for i in 0..o.sandboxes {
        let name = format!("s{i}");
        let mut t = rng.between(0.0, 4.0);
        let mut seq = 0;
        let mut push = |t: f64, line: String| {
            events.push((t, i * 1000 + seq, line));
            seq += 1;
        };
        push(
            t,
            json!({"t": r3(t), "sandbox": name, "event": "create", "mem_mib": MEM_MIB}).to_string(),
        );
        t += 0.3;
        for _ in 0..(2 + (rng.next() * 3.0) as usize) {
            for _ in 0..(1 + (rng.next() * 3.0) as usize) {
                push(t, json!({"t": r3(t), "sandbox": name, "event": "request", "duration_ms": 0, "mem_mib": 0}).to_string());
                t += rng.between(0.2, 0.6);
            }
            // Clearly short of the keep-alive, or clearly past it and the
            // policy rounds after it: what the policy's phase decides is
            // not what this compares.
            t += if rng.next() < 0.5 {
                rng.between(0.3, 1.0)
            } else {
                rng.between(2.5, 4.0)
            };
        }
        push(
            t,
            json!({"t": r3(t), "sandbox": name, "event": "delete"}).to_string(),
        );
    }
    events.sort_by(|a, b| r3(a.0).total_cmp(&r3(b.0)).then(a.1.cmp(&b.1)));
    events.into_iter().map(|e| e.2 + "\n").collect()
}

fn r3(t: f64) -> f64 {
    (t * 1000.0).round() / 1000.0
}

/// What the live replay saw.
#[derive(Default)]
struct Live {
    admitted: u64,
    rejected: u64,
    /// Of `rejected`: refused by the pressure gate (429 under memory
    /// pressure), not by admission.
    rejected_pressure: u64,
    wakes: u64,
    wakes_refused: u64,
    /// Of `wakes_refused`: by the pressure gate.
    wakes_refused_pressure: u64,
    wake_ms: Vec<f64>,
    /// The first pressure refusals' messages, with when (ms into the replay).
    refusals: Vec<String>,
    errors: Vec<String>,
}

impl Live {
    /// Keeps the first few pressure refusals: `what` at `start` + when.
    fn refused(&mut self, start: Instant, what: &str, body: &str) {
        if self.refusals.len() < 4 {
            let ms = Instant::now().saturating_duration_since(start).as_millis();
            self.refusals
                .push(format!("{what} at {ms} ms: {}", body.trim()));
        }
    }
}

/// A 429 of the pressure gate (the service's `Pressure` error), not of
/// admission.
fn is_pressure_429(body: &str) -> bool {
    body.contains("under memory pressure")
}

fn hibernations_ok(serve: &Serve) -> u64 {
    let Ok((_, text)) = serve.raw("GET", "/metrics", None, REQUEST_LIMIT) else {
        return 0;
    };
    text.lines()
        .find(|l| l.starts_with("torpor_hibernations_total{result=\"ok\"}"))
        .and_then(|l| l.split_whitespace().last()?.parse().ok())
        .unwrap_or(0)
}

/// Plays `trace` against `serve`: one thread per sandbox, each event at
/// its time from the start.
fn replay(serve: &Serve, trace: &Trace, template: &str) -> Live {
    let live = Mutex::new(Live::default());
    let ids: Arc<Mutex<HashMap<usize, String>>> = Arc::default();
    let start = Instant::now() + Duration::from_millis(200);
    std::thread::scope(|scope| {
        for sb in 0..trace.sandboxes.len() {
            let events: Vec<_> = trace
                .events
                .iter()
                .filter(|e| e.sandbox == sb)
                .copied()
                .collect();
            let (live, ids) = (&live, ids.clone());
            scope.spawn(move || {
                for e in events {
                    let at = start + Duration::from_millis(e.t_ms as u64);
                    std::thread::sleep(at.saturating_duration_since(Instant::now()));
                    let id = ids.lock().unwrap().get(&sb).cloned();
                    let l = |f: &mut dyn FnMut(&mut Live)| f(&mut live.lock().unwrap());
                    match (e.kind, id) {
                        (plan::trace::EventKind::Create, _) => {
                            let body = json!({"template": template}).to_string();
                            match serve.raw("POST", "/v1/sandboxes", Some(&body), REQUEST_LIMIT) {
                                Ok((201, text)) => {
                                    let v: Value = serde_json::from_str(&text).unwrap_or_default();
                                    let id = v["id"].as_str().unwrap_or_default().to_string();
                                    ids.lock().unwrap().insert(sb, id);
                                    l(&mut |x| x.admitted += 1);
                                }
                                Ok((429, text)) => l(&mut |x| {
                                    x.rejected += 1;
                                    if is_pressure_429(&text) {
                                        x.rejected_pressure += 1;
                                        x.refused(start, "create", &text);
                                    }
                                }),
                                other => l(&mut |x| x.errors.push(format!("create: {other:?}"))),
                            }
                        }
                        (_, None) => {} // its create was refused
                        (plan::trace::EventKind::Request, Some(id)) => {
                            let t = Instant::now();
                            let path = format!("/v1/sandboxes/{id}/connect");
                            let mut answer = serve.raw("POST", &path, None, REQUEST_LIMIT);
                            // A sandbox in an operation (a hibernation) may
                            // answer 409: the request waits for it, as the
                            // planner's do.
                            while matches!(answer, Ok((409, _))) && t.elapsed() < REQUEST_LIMIT {
                                std::thread::sleep(Duration::from_millis(10));
                                answer = serve.raw("POST", &path, None, REQUEST_LIMIT);
                            }
                            match answer {
                                Ok((200, text)) => {
                                    let ms = t.elapsed().as_secs_f64() * 1000.0;
                                    let v: Value = serde_json::from_str(&text).unwrap_or_default();
                                    if v["resumed"] == true {
                                        l(&mut |x| {
                                            x.wakes += 1;
                                            x.wake_ms.push(ms);
                                        });
                                    }
                                }
                                Ok((429, text)) => l(&mut |x| {
                                    x.wakes_refused += 1;
                                    if is_pressure_429(&text) {
                                        x.wakes_refused_pressure += 1;
                                        x.refused(start, "wake", &text);
                                    }
                                }),
                                other => l(&mut |x| x.errors.push(format!("resume: {other:?}"))),
                            }
                        }
                        (plan::trace::EventKind::Delete, Some(id)) => {
                            if let Err(e) = serve.delete(&id) {
                                l(&mut |x| x.errors.push(e.clone()));
                            }
                        }
                    }
                }
            });
        }
    });
    live.into_inner().unwrap()
}

fn calibrate(serve: &Serve, dir: &std::path::Path) -> Result<Calibration, String> {
    let out = dir.join("calibration.json");
    let url = format!("http://{}", serve.addr());
    let o = std::process::Command::new(TORPOR)
        .args(["plan", "calibrate", "--api", &url, "--token", TOKEN])
        .args([
            "--samples",
            "3",
            "--mem-mib",
            "256",
            "--dirty-mib",
            "16",
            "--data-dir",
        ])
        .arg(serve.data())
        .arg("--out")
        .arg(&out)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| format!("run torpor plan calibrate: {e}"))?;
    if !o.status.success() {
        return Err(format!(
            "torpor plan calibrate failed: {}",
            String::from_utf8_lossy(&o.stderr)
        ));
    }
    Calibration::load(&out).map_err(|e| e.to_string())
}

/// Within tolerance: `|a - b|` at most 10% of `of` (the events of that
/// kind: creates for admitted and rejected, wake attempts for wakes and
/// refusals, hibernations for hibernations), and never less than 2.
/// The live replay's errors: how many, and the first five.
fn errors_summary(errors: &[String]) -> String {
    let first: Vec<&str> = errors.iter().take(5).map(String::as_str).collect();
    format!("live errors ({}): {}", errors.len(), first.join("; "))
}

fn close(a: u64, b: u64, of: u64) -> bool {
    a.abs_diff(b) as f64 <= (0.1 * of as f64).max(2.0)
}

fn main() {
    let o = opts();
    if o.pressure {
        std::process::exit(pressure::run(&o));
    }
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path().join("data");
    let flags: Vec<String> = [
        "--policy-interval-ms",
        &POLICY_MS.to_string(),
        "--keep-alive-ms",
        &KEEP_ALIVE_MS.to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let serve = match Serve::start(&dir, &flags) {
        Started::Up(s) => s,
        Started::Rejected(why) | Started::Failed(why) => {
            eprintln!("plan bench: torpor serve did not start: {why}");
            std::process::exit(1);
        }
    };
    let code = match run(&serve, &o, &dir) {
        Ok(true) => 0,
        Ok(false) => 1,
        Err(e) => {
            eprintln!(
                "plan bench: FAILED: {e}\nserve log ends:\n{}",
                serve.log_tail(10)
            );
            1
        }
    };
    drop(serve);
    drop(scratch);
    // Smoke: the pressure mode's trace on the planner alone.
    let code = if o.smoke && code == 0 {
        pressure::plan_only(&o)
    } else {
        code
    };
    std::process::exit(code);
}

fn run(serve: &Serve, o: &Opts, dir: &std::path::Path) -> Result<bool, String> {
    let cal = calibrate(serve, dir)?;
    let pods = serve.expect(200, "GET", "/v1/pods", None)?;
    let pod = pods["pods"]
        .as_array()
        .and_then(|p| p.iter().find(|p| p["id"] == "pod_local"))
        .ok_or("no local pod")?;
    let memory_mib = pod["memory_bytes"].as_u64().ok_or("no memory_bytes")? >> 20;
    // Room for `fit` of the sessions at once.
    let fit_mib = (o.sandboxes as f64 * o.fit).ceil() * f64::from(MEM_MIB);
    let ratio = ((fit_mib + 1.0) / memory_mib as f64 * 10000.0).ceil() / 10000.0;
    serve.expect(
        200,
        "PATCH",
        "/v1/pods/pod_local",
        Some(&json!({"oversubscription_ratio": ratio, "high_watermark": 0.9}).to_string()),
    )?;
    let tpl_id = serve.build_template("plan-bench", MEM_MIB, None)?;
    let text = trace(o);
    let trace = Trace::read(text.as_bytes()).map_err(|e| e.to_string())?;
    let shape = PodShape {
        memory_mib,
        cores: std::thread::available_parallelism().map_or(2, |n| n.get() as u32),
        policy_interval_ms: POLICY_MS,
    };
    let setting = Setting {
        ratio,
        keep_alive_ms: KEEP_ALIVE_MS,
        high_watermark: 0.9,
    };
    let p = plan::simulate(&trace, shape, setting, &cal);
    let before = hibernations_ok(serve);
    let mut live = replay(serve, &trace, &tpl_id);
    let hibernations = hibernations_ok(serve).saturating_sub(before);
    let live_p99 = plan::sim::quantile(&mut live.wake_ms, 0.99);
    let live_p50 = plan::sim::quantile(&mut live.wake_ms, 0.5);
    let live_max = plan::sim::quantile(&mut live.wake_ms, 1.0);
    println!(
        "plan vs live: {} sandboxes x {MEM_MIB} MiB, seed {}, {} events over {:.1} s; pod {} MiB \
         at ratio {ratio} ({} MiB admitted at once), keep-alive {KEEP_ALIVE_MS} ms, policy every \
         {POLICY_MS} ms; calibration: create {:.1} ms, wake {:.1} ms, hibernate {:.1} ms",
        o.sandboxes,
        o.seed,
        trace.events.len(),
        trace.end_ms() as f64 / 1000.0,
        memory_mib,
        fit_mib,
        cal.create_ms,
        cal.wake_ms,
        cal.hibernate_ms
    );
    let wake_ok = p.wake_p99_ms == 0.0 && live_p99 == 0.0
        || (live_p99 <= 2.0 * p.wake_p99_ms && p.wake_p99_ms <= 2.0 * live_p99);
    let creates = (p.creates_admitted + p.creates_rejected).max(live.admitted + live.rejected);
    let wakes = (p.wakes + p.wakes_rejected).max(live.wakes + live.wakes_refused);
    let hib = p.hibernations.max(hibernations);
    let tol = "10% of the kind's events, or 2";
    let count = |name, a: u64, b: u64, of| (name, a as f64, b as f64, close(a, b, of), tol);
    let rows = [
        count(
            "creates admitted",
            p.creates_admitted,
            live.admitted,
            creates,
        ),
        count(
            "creates rejected",
            p.creates_rejected,
            live.rejected,
            creates,
        ),
        count("hibernations", p.hibernations, hibernations, hib),
        count("wakes", p.wakes, live.wakes, wakes),
        count("wakes refused", p.wakes_rejected, live.wakes_refused, wakes),
        ("wake p99 ms", p.wake_p99_ms, live_p99, wake_ok, "2x"),
        (
            "wake p50 ms (not checked)",
            p.wake_p50_ms,
            live_p50,
            true,
            "-",
        ),
        (
            "wake max ms (not checked)",
            p.wake_max_ms,
            live_max,
            true,
            "-",
        ),
    ];
    println!("\n| | plan | live | tolerance | within |\n|---|---:|---:|---|---|");
    let mut all = true;
    for (name, a, b, ok, tol) in rows {
        all &= ok;
        println!(
            "| {name} | {a:.1} | {b:.1} | {tol} | {} |",
            if ok { "yes" } else { "NO" }
        );
    }
    if !live.errors.is_empty() {
        println!("\n{}", errors_summary(&live.errors));
    }
    if o.smoke && !all {
        println!("\nsmoke run (no --bench): tolerances reported, not enforced");
    }
    Ok((all || o.smoke) && live.errors.is_empty())
}
