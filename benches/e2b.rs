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

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::{Duration, Instant};

use comfy_table::{presets::UTF8_FULL_CONDENSED, Table};

mod common;
#[path = "../tests/common/e2b_sdk.rs"]
mod e2b_sdk;

use common::serve::{Serve, Started, TOKEN};
use common::{median, percentile};

/// The nested host's first start builds and boots: well within this.
const READY_LIMIT: Duration = Duration::from_secs(30 * 60);
const TEMPLATE: &str = "base";

/// Asks for a `base` sandbox until one is made (503 while the nested host
/// comes up, honouring Retry-After's order of magnitude); deletes it.
fn wait_ready(serve: &Serve) -> Result<Duration, String> {
    let started = Instant::now();
    loop {
        let body = format!(r#"{{"template":"{TEMPLATE}"}}"#);
        let (status, text) = serve.raw(
            "POST",
            "/v1/sandboxes",
            Some(&body),
            Duration::from_secs(600),
        )?;
        match status {
            201 => {
                let v: serde_json::Value =
                    serde_json::from_str(&text).map_err(|e| e.to_string())?;
                serve.delete(v["id"].as_str().unwrap_or_default())?;
                return Ok(started.elapsed());
            }
            503 if started.elapsed() < READY_LIMIT => std::thread::sleep(Duration::from_secs(5)),
            _ => return Err(format!("create {TEMPLATE}: {status} {text}")),
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if !args.iter().any(|a| a == "--bench") {
        println!("e2b bench: run with `cargo bench --bench e2b` (the nested host takes minutes)");
        return;
    }
    let rounds: usize = args
        .iter()
        .position(|a| a == "--rounds")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    let python = e2b_sdk::python();
    if !python.exists() {
        eprintln!(
            "e2b bench: no SDK venv at {}: run scripts/setup test",
            python.display()
        );
        std::process::exit(1);
    }
    let dir = tempfile::tempdir().unwrap();
    let flags = ["--request-timeout-ms".to_string(), "900000".to_string()];
    let mut serve = match Serve::start(dir.path(), &flags) {
        Started::Up(s) => s,
        Started::Rejected(why) | Started::Failed(why) => {
            eprintln!("e2b bench: torpor serve: {why}");
            std::process::exit(1);
        }
    };
    let ready = match wait_ready(&serve) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("e2b bench: {e}\n{}", serve.log_tail(30));
            serve.stop();
            std::process::exit(1);
        }
    };
    println!(
        "e2b bench: `{TEMPLATE}` ready {:.0}s after the first request; {rounds} rounds",
        ready.as_secs_f64()
    );
    let url = format!("http://{}", serve.addr());
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/e2b_sdk.py");
    let mut child = e2b_sdk::sdk_command(&python, script, &url, TOKEN)
        .args([TEMPLATE, &rounds.to_string()])
        .stderr(Stdio::inherit())
        .spawn()
        .expect("run benches/e2b_sdk.py");
    let mut samples: BTreeMap<(String, String), Vec<f64>> = BTreeMap::new();
    let mut order: Vec<String> = Vec::new();
    let mut done = false;
    for line in BufReader::new(child.stdout.take().unwrap())
        .lines()
        .map_while(Result::ok)
    {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) else {
            continue;
        };
        if v.get("done").is_some() {
            done = true;
            continue;
        }
        let (Some(op), Some(client), Some(ms)) =
            (v["op"].as_str(), v["client"].as_str(), v["ms"].as_f64())
        else {
            continue;
        };
        if !order.iter().any(|o| o == op) {
            order.push(op.to_string());
        }
        samples
            .entry((op.to_string(), client.to_string()))
            .or_default()
            .push(ms);
    }
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
