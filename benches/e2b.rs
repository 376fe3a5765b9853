//! The E2B translation's cost, as a column: through the E2B Python SDK (the
//! slowest client path) and through `/v1` with a plain HTTP client from the
//! same Python process, against one `torpor serve`: create -> first
//! `commands.run("echo")` -> kill, and pause -> connect -> first command;
//! p50/p99 and the SDK/v1 ratio per operation.
//!
//! The template is `base`, the Linux template `torpor serve` offers out of
//! the box: on this PVM host it runs in the nested host (QEMU/TCG), started
//! on the first request, so absolute times are the nested host's and only
//! the ratios carry over (both columns pay the same TCG cost). Needs the
//! pinned SDK's venv (`scripts/setup test` makes it).
//!
//! `cargo bench --bench e2b [-- --rounds N]` (default 5); under `cargo
//! test` (no `--bench`) nothing runs: the nested host's start-up is minutes.
//!
//! `cargo bench --bench e2b -- --soak [--cycles N] [--sandboxes M]` runs
//! the pause → connect soak instead (`tests/e2b/sdk_soak.py`, which
//! tests/nested_pod.rs runs bounded): one sandbox, then five side by side
//! (only M at once with `--sandboxes M`), N cycles each (default 200), every cycle checking a background process, a held open
//! file, a PTY shell's variable, the environment and every file written
//! before; a table of hibernate / wake / check p50 and p99 per run, and
//! any failure with its cause.
//!
//! `cargo bench --bench e2b -- --interp [--rounds N] [--calls M]` measures
//! the code interpreter instead (`benches/interp_serve.py`, the official
//! e2b-code-interpreter SDK through serve, `code-interpreter-v1` in the
//! nested pod, which serve offers when the interpreter's tree is cached:
//! `scripts/setup test` with `TORPOR_NESTED_POD=1`): create -> first
//! `run_code` result (N rounds, default 5), `run_code("1+1")` round trips,
//! a guest port's round trip through the port router (the interpreter's
//! `/health`) and envd's own (`files.read`), M each (default 50).

use std::collections::BTreeMap;
use std::process::Stdio;
use std::time::{Duration, Instant};

use comfy_table::{presets::UTF8_FULL_CONDENSED, Table};

mod common;
#[path = "../tests/common/e2b_sdk.rs"]
mod e2b_sdk;

use common::samples::Samples;
use common::serve::{Serve, Started, TOKEN};
use common::{median, percentile};

/// The nested host's first start builds and boots: well within this.
const READY_LIMIT: Duration = Duration::from_secs(30 * 60);
const TEMPLATE: &str = "base";
/// The code interpreter's template (the SDKs' default).
const INTERP_TEMPLATE: &str = "code-interpreter-v1";

/// The number after `name` in `args`.
fn flag(args: &[String], name: &str) -> Option<usize> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
}

/// The soak, each of `runs` sandboxes at once (one, then five by
/// default), `cycles` each: prints a table and every failure; true when
/// any run failed.
fn soak(python: &std::path::Path, url: &str, cycles: usize, runs: &[usize]) -> bool {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/e2b/sdk_soak.py");
    let mut table = Table::new();
    table.load_style(UTF8_FULL_CONDENSED).set_header([
        "sandboxes",
        "cycles ok",
        "hibernate p50",
        "hibernate p99",
        "wake p50",
        "wake p99",
        "check p50",
        "check p99",
    ]);
    let mut failed = false;
    for &sandboxes in runs {
        let started = Instant::now();
        let out = e2b_sdk::sdk_command(python, script, url, TOKEN)
            .args([TEMPLATE, &cycles.to_string(), &sandboxes.to_string()])
            .output()
            .expect("run tests/e2b/sdk_soak.py");
        let mut ms: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
                continue;
            };
            for key in ["hibernate_ms", "wake_ms", "check_ms"] {
                if let Some(x) = v[key].as_f64() {
                    ms.entry(key).or_default().push(x);
                }
            }
        }
        let stderr = String::from_utf8_lossy(&out.stderr);
        for line in stderr.lines().filter(|l| l.contains("soak: FAILED")) {
            println!("e2b bench: {sandboxes} at once: {line}");
        }
        if !out.status.success() {
            failed = true;
            println!(
                "e2b bench: soak with {sandboxes} at once failed ({})",
                out.status
            );
        }
        let done = ms.get("wake_ms").map_or(0, Vec::len);
        let cell = |key: &str, p: f64| {
            ms.get(key)
                .filter(|v| !v.is_empty())
                .map_or("-".to_string(), |v| format!("{:.0}", percentile(v, p)))
        };
        table.add_row([
            sandboxes.to_string(),
            format!("{done} / {}", cycles * sandboxes),
            cell("hibernate_ms", 0.5),
            cell("hibernate_ms", 0.99),
            cell("wake_ms", 0.5),
            cell("wake_ms", 0.99),
            cell("check_ms", 0.5),
            cell("check_ms", 0.99),
        ]);
        println!(
            "e2b bench: soak of {sandboxes} sandbox(es) took {:.0}s",
            started.elapsed().as_secs_f64()
        );
    }
    println!("soak (ms; cycles alternate E2B pause + connect and /v1 hibernate + an envd call that wakes)\n{table}");
    failed
}

/// The code interpreter through serve (`benches/interp_serve.py`): prints
/// a table per (operation, client); true when the driver failed.
fn interp(python: &std::path::Path, url: &str, rounds: usize, calls: usize) -> bool {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/interp_serve.py");
    let mut child = e2b_sdk::sdk_command(python, script, url, TOKEN)
        .args([rounds.to_string(), calls.to_string()])
        .stderr(Stdio::inherit())
        .spawn()
        .expect("run benches/interp_serve.py");
    let read = Samples::read(child.stdout.take().unwrap());
    let status = child.wait().expect("wait for the SDK driver");
    let table = read.table();
    println!("code interpreter through torpor serve ({INTERP_TEMPLATE}, nested pod)\n{table}");
    let failed = !status.success() || !read.done;
    if failed {
        println!("e2b bench: the interpreter driver failed ({status})");
    }
    failed
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if !args.iter().any(|a| a == "--bench") {
        println!("e2b bench: run with `cargo bench --bench e2b` (the nested host takes minutes)");
        return;
    }
    let rounds = flag(&args, "--rounds").unwrap_or(5);
    let python = e2b_sdk::python();
    if !python.exists() {
        eprintln!(
            "e2b bench: no SDK venv at {}: run scripts/setup test",
            python.display()
        );
        std::process::exit(1);
    }
    let dir = tempfile::tempdir().unwrap();
    let interp_mode = args.iter().any(|a| a == "--interp");
    let mut flags = vec!["--request-timeout-ms".to_string(), "900000".to_string()];
    if !interp_mode {
        // `base` only: the interpreter's template building beside the
        // measured sandboxes (about 14 minutes of L1's one vCPU) would
        // measure that build, not them.
        flags.push("--no-nested-interpreter".to_string());
    }
    let mut serve = match Serve::start(dir.path(), &flags) {
        Started::Up(s) => s,
        Started::Rejected(why) | Started::Failed(why) => {
            eprintln!("e2b bench: torpor serve: {why}");
            std::process::exit(1);
        }
    };
    let template = if interp_mode {
        INTERP_TEMPLATE
    } else {
        TEMPLATE
    };
    let ready = match serve.wait_template(template, READY_LIMIT) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("e2b bench: {e}\n{}", serve.log_tail(30));
            serve.stop();
            std::process::exit(1);
        }
    };
    println!(
        "e2b bench: `{template}` ready {:.0}s after the first request; {rounds} rounds",
        ready.as_secs_f64()
    );
    let url = format!("http://{}", serve.addr());
    if interp_mode {
        let calls = flag(&args, "--calls").unwrap_or(50);
        let failed = interp(&python, &url, rounds, calls);
        let notes = serve.stop();
        if !notes.is_empty() {
            println!("e2b bench: at stop: {notes:?}");
        }
        std::process::exit(i32::from(failed));
    }
    if args.iter().any(|a| a == "--soak") {
        let cycles = flag(&args, "--cycles").unwrap_or(200);
        let runs = flag(&args, "--sandboxes").map_or(vec![1, 5], |m| vec![m.max(1)]);
        let failed = soak(&python, &url, cycles, &runs);
        if failed {
            // The nested host's console has the pod's log (each failure's
            // VMM log and guest console), gone with the host at the stop:
            // a copy is kept for whoever looks next.
            // The console of a host that died and was replaced too.
            let work = dir.path().join("data/nested-host");
            let consoles = [
                (work.join("console.log"), "console"),
                (torpor_nested::previous_console(&work), "previous-console"),
            ];
            for (i, (console, name)) in consoles.iter().enumerate() {
                if i > 0 && !console.exists() {
                    continue;
                }
                let kept = std::env::temp_dir()
                    .join(format!("torpor-soak-{}-{name}.log", std::process::id()));
                match std::fs::copy(console, &kept) {
                    Ok(_) => println!(
                        "e2b bench: the nested host's {name} (the pod's log) is kept at {}",
                        kept.display()
                    ),
                    Err(e) => println!("e2b bench: {}: {e}", console.display()),
                }
            }
        }
        let notes = serve.stop();
        if !notes.is_empty() {
            println!("e2b bench: at stop: {notes:?}");
        }
        std::process::exit(i32::from(failed));
    }
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/e2b_sdk.py");
    let mut child = e2b_sdk::sdk_command(&python, script, &url, TOKEN)
        .args([TEMPLATE, &rounds.to_string()])
        .stderr(Stdio::inherit())
        .spawn()
        .expect("run benches/e2b_sdk.py");
    let read = Samples::read(child.stdout.take().unwrap());
    let (order, done, samples) = (read.ops(), read.done, read.by_key);
    let status = child.wait().expect("wait for the SDK driver");
    let notes = serve.stop();
    if !status.success() || !done {
        eprintln!("e2b bench: the SDK driver failed ({status}); {notes:?}");
        std::process::exit(1);
    }
    let mut table = Table::new();
    table.load_style(UTF8_FULL_CONDENSED).set_header([
        "operation (ms)",
        "SDK p50",
        "SDK p99",
        "/v1 p50",
        "/v1 p99",
        "SDK / v1 (p50)",
    ]);
    for op in &order {
        let get = |client: &str| samples.get(&(op.clone(), client.to_string()));
        let (Some(sdk), Some(v1)) = (get("sdk"), get("v1")) else {
            continue;
        };
        let (s50, v50) = (median(sdk.clone()), median(v1.clone()));
        table.add_row([
            op.clone(),
            format!("{s50:.1}"),
            format!("{:.1}", percentile(sdk, 0.99)),
            format!("{v50:.1}"),
            format!("{:.1}", percentile(v1, 0.99)),
            format!("{:.2}", s50 / v50),
        ]);
    }
    println!("{table}");
    if !notes.is_empty() {
        println!("e2b bench: at stop: {notes:?}");
    }
}
