//! The code interpreter server's own costs, on loopback with the host's
//! kernels (the interpreter venv), through the official
//! `e2b-code-interpreter` Python SDK: server start to ready (the default
//! Python kernel up), `run_code("1+1")` through the SDK and through a bare
//! HTTP client, a bash echo, a matplotlib figure, a DataFrame, and a
//! context's create + remove (a kernel start); p50/p99 per operation. No
//! VM, no proxy: the floor under what `torpor serve` adds (the port router,
//! the guest) for the same calls.
//!
//! `cargo bench --bench interp [-- --rounds N]` (default 50); under `cargo
//! test` (no `--bench`) nothing runs. Needs the interpreter and E2B venvs
//! (`scripts/setup test`).

use std::process::Stdio;

mod common;
#[path = "../tests/common/e2b_sdk.rs"]
mod e2b_sdk;
#[path = "../tests/common/interp.rs"]
mod interp;

use common::samples::Samples;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if !args.iter().any(|a| a == "--bench") {
        println!("interp bench: run with `cargo bench --bench interp`");
        return;
    }
    let rounds: usize = args
        .iter()
        .position(|a| a == "--rounds")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(50);
    let python = e2b_sdk::python();
    if !python.exists() || !interp::interp_python().exists() {
        eprintln!(
            "interp bench: the E2B or the interpreter venv is missing: run scripts/setup test"
        );
        std::process::exit(1);
    }
    let dir = tempfile::tempdir().unwrap();
    let server = interp::InterpServer::start(dir.path(), 4 << 20);
    println!(
        "interp bench: server ready (default Python kernel up) {:.0} ms after spawn; {rounds} rounds",
        server.ready_in.as_secs_f64() * 1000.0
    );
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/interp_sdk.py");
    let mut child = e2b_sdk::sdk_command(&python, script, &server.url, "unused")
        .arg(rounds.to_string())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("run benches/interp_sdk.py");
    let read = Samples::read(child.stdout.take().unwrap());
    let status = child.wait().expect("wait for the SDK driver");
    drop(server);
    if !status.success() || !read.done {
        eprintln!("interp bench: the SDK driver failed ({status})");
        std::process::exit(1);
    }
    println!("{}", read.table());
}
