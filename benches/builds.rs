//! Template builds through the API (issue 28), on `base`, the Linux
//! template `torpor serve` offers (on this PVM host: in the nested host,
//! QEMU/TCG, started on the first request; absolute times are the nested
//! host's, the ratios carry over):
//!
//! - the time of each step kind (ENV, RUN, WORKDIR, COPY, USER, the start
//!   command with its ready check), each with its cache layer's snapshot,
//!   read from the build's own log; the whole build cold, cached (the same
//!   spec again) and with its last RUN changed;
//! - create → first answer of the start command's server: from the built
//!   template (the server snapshotted running) against starting the same
//!   server in a fresh sandbox of `base` and polling it; p50 over the rounds
//!   and the ratio.
//!
//! `cargo bench --bench builds [-- --rounds N]` (default 3); under `cargo
//! test` (no `--bench`) nothing runs: the nested host's start-up is minutes.

use std::time::{Duration, Instant};

use comfy_table::{presets::UTF8_FULL_CONDENSED, Table};
use serde_json::{json, Value};

mod common;

use common::median;
use common::serve::{Serve, Started};

const READY_LIMIT: Duration = Duration::from_secs(30 * 60);
const BUILD_LIMIT: Duration = Duration::from_secs(30 * 60);
const EXEC_LIMIT: Duration = Duration::from_secs(600);

/// One try at the page, within 2 s; exit 0 when it answers.
const FETCH: &str = "import urllib.request; \
     urllib.request.urlopen('http://127.0.0.1:8000/index.html', timeout=2).read()";

fn spec(name: &str, hash: &str, last_run: &str) -> Value {
    json!({
        "name": name,
        "from": {"type": "template", "name": "base"},
        "steps": [
            {"type": "env", "vars": {"SITE": "/home/user/site"}},
            {"type": "run", "cmd": "mkdir -p $SITE && echo '<p>bench</p>' > $SITE/index.html"},
            {"type": "workdir", "path": "/home/user/site"},
            {"type": "copy", "src": "data.txt", "dest": "data.txt", "files_hash": hash},
            {"type": "user", "name": "user"},
            {"type": "run", "cmd": last_run},
        ],
        "start": {"cmd": "python3 -m http.server 8000", "ready": {"type": "port", "port": 8000}},
    })
}

/// Starts a build and follows it to its end: its record.
fn build(serve: &Serve, body: &Value) -> Result<Value, String> {
    let v = serve.expect(202, "POST", "/v1/builds", Some(&body.to_string()))?;
    let id = v["id"].as_str().ok_or("no build id")?.to_string();
    let deadline = Instant::now() + BUILD_LIMIT;
    loop {
        let r = serve.expect(200, "GET", &format!("/v1/builds/{id}"), None)?;
        match r["status"].as_str() {
            Some("ready") => return Ok(r),
            Some("error" | "cancelled") => return Err(format!("build failed: {}", r["failure"])),
            _ if Instant::now() > deadline => return Err(format!("build {id} too slow")),
            _ => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}

fn seconds(r: &Value) -> f64 {
    let ms = r["finished_at"].as_i64().unwrap_or(0) - r["created_at"].as_i64().unwrap_or(0);
    ms as f64 / 1000.0
}

/// Each step's time from its log: from its `[i/n]` line to the next
/// one's (or the end), by label.
fn step_times(r: &Value) -> Vec<(String, f64)> {
    let logs = r["logs"].as_array().cloned().unwrap_or_default();
    let starts: Vec<(String, i64)> = logs
        .iter()
        .filter_map(|e| {
            let m = e["message"].as_str()?;
            let rest = m.strip_prefix('[')?;
            let (_, label) = rest.split_once("] ")?;
            Some((label.to_string(), e["at"].as_i64()?))
        })
        .collect();
    let end = r["finished_at"].as_i64().unwrap_or(0);
    starts
        .iter()
        .enumerate()
        .map(|(i, (label, at))| {
            let next = starts.get(i + 1).map_or(end, |(_, t)| *t);
            (label.clone(), (next - at) as f64 / 1000.0)
        })
        .collect()
}

fn exec(serve: &Serve, id: &str, argv: &[&str]) -> Result<Value, String> {
    let body = json!({ "argv": argv }).to_string();
    let (status, text) = serve.raw(
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        Some(&body),
        EXEC_LIMIT,
    )?;
    common::serve::parse(200, status, &text)
}

/// Create → the page answers, from `template`; with `start`, the server
/// is started first and polled until it answers.
fn first_answer(serve: &Serve, template: &str, start: bool) -> Result<f64, String> {
    let t = Instant::now();
    let body = json!({ "template": template }).to_string();
    let v = serve.expect(201, "POST", "/v1/sandboxes", Some(&body))?;
    let id = v["id"].as_str().ok_or("no id")?.to_string();
    let out = (|| {
        if start {
            exec(
                serve,
                &id,
                &[
                    "sh",
                    "-c",
                    "mkdir -p /tmp/site && echo '<p>bench</p>' > /tmp/site/index.html && cd /tmp/site \
                     && setsid python3 -m http.server 8000 >/dev/null 2>&1 </dev/null &",
                ],
            )?;
        }
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let r = exec(serve, &id, &["python3", "-c", FETCH])?;
            if r["exit_code"] == 0 {
                return Ok(t.elapsed().as_secs_f64());
            }
            if Instant::now() > deadline {
                return Err(format!("no answer from {template}'s server: {r}"));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    })();
    serve.delete(&id)?;
    out
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if !args.iter().any(|a| a == "--bench") {
        return;
    }
    let rounds = args
        .iter()
        .position(|a| a == "--rounds")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(3usize);
    let dir = tempfile::tempdir().unwrap();
    let flags = ["--request-timeout-ms".to_string(), "900000".to_string()];
    let mut serve = match Serve::start(dir.path(), &flags) {
        Started::Up(s) => s,
        Started::Rejected(why) | Started::Failed(why) => {
            eprintln!("builds bench: torpor serve: {why}");
            std::process::exit(1);
        }
    };
    let result = run(&serve, dir.path(), rounds);
    if let Err(e) = result {
        eprintln!("builds bench: {e}\n{}", serve.log_tail(40));
        serve.stop();
        std::process::exit(1);
    }
    serve.stop();
}

fn run(serve: &Serve, dir: &std::path::Path, rounds: usize) -> Result<(), String> {
    let ready = serve.wait_template("base", READY_LIMIT)?;
    println!("builds bench: base ready in {:.0}s", ready.as_secs_f64());
    let context = dir.join("context");
    std::fs::create_dir_all(&context).map_err(|e| e.to_string())?;
    std::fs::write(context.join("data.txt"), vec![b'x'; 1 << 20]).map_err(|e| e.to_string())?;
    let packed = torpor_build::context::pack(&context, "data.txt").map_err(|e| e.to_string())?;
    let (status, text) = serve.raw_bytes(
        "PUT",
        &format!("/v1/build-files/{}", packed.sha256),
        ("application/octet-stream", &packed.archive),
        Duration::from_secs(120),
    )?;
    common::serve::parse(201, status, &text)?;

    let cold = build(
        serve,
        &spec("bench-web", &packed.sha256, "echo one > run.txt"),
    )?;
    let cached = build(
        serve,
        &spec("bench-web", &packed.sha256, "echo one > run.txt"),
    )?;
    let changed = build(
        serve,
        &spec("bench-web", &packed.sha256, "echo two > run.txt"),
    )?;

    // Per step of the cold build (a cached one's steps are skipped at
    // once; its whole time is below).
    let mut steps = Table::new();
    steps
        .load_style(UTF8_FULL_CONDENSED)
        .set_header(["step (with its layer's snapshot), cold", "s"]);
    for (label, s) in step_times(&cold) {
        steps.add_row([label, format!("{s:.2}")]);
    }
    println!("builds bench: per step\n{steps}");

    let mut whole = Table::new();
    whole.load_style(UTF8_FULL_CONDENSED).set_header([
        "build",
        "steps cached / run",
        "s",
        "ratio to cold",
    ]);
    for (what, r) in [
        ("cold", &cold),
        ("cached", &cached),
        ("last RUN changed", &changed),
    ] {
        whole.add_row([
            what.to_string(),
            format!("{} / {}", r["cached_steps"], r["run_steps"]),
            format!("{:.1}", seconds(r)),
            format!("{:.3}", seconds(r) / seconds(&cold)),
        ]);
    }
    println!("builds bench: whole builds\n{whole}");

    let mut snapshotted = Vec::new();
    let mut fresh = Vec::new();
    for _ in 0..rounds {
        snapshotted.push(first_answer(serve, "bench-web", false)?);
        fresh.push(first_answer(serve, "base", true)?);
    }
    let (a, b) = (median(snapshotted), median(fresh));
    let mut first = Table::new();
    first.load_style(UTF8_FULL_CONDENSED).set_header([
        "create -> first answer of the server",
        "p50 s",
        "rounds",
    ]);
    first.add_row([
        "template with the server snapshotted running".to_string(),
        format!("{a:.2}"),
        rounds.to_string(),
    ]);
    first.add_row([
        "base, server started after create".to_string(),
        format!("{b:.2}"),
        rounds.to_string(),
    ]);
    println!(
        "builds bench: start command snapshotted\n{first}\nratio snapshotted / started: {:.3}",
        a / b
    );
    Ok(())
}
