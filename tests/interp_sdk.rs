//! The code interpreter server (`guest-image/interpreter/torpor_interp.py`)
//! under the official, pinned `e2b-code-interpreter` Python SDK, on the host:
//! the server runs from the interpreter venv (ipykernel, jupyter_client,
//! bash_kernel, deno, numpy, pandas, matplotlib: `guest-image/interpreter/
//! requirements.txt`) on a loopback port, and `tests/e2b/sdk_interp.py`
//! drives it with `E2B_SANDBOX_URL` pointing there: state across calls,
//! stdout/stderr callbacks, errors by name, a matplotlib PNG, a DataFrame as
//! HTML, env vars, contexts (fresh, restarted, removed), a timeout that
//! interrupts the kernel, bash, the output bound, and JavaScript and
//! TypeScript in Deno's kernel (`language="js"`/`"ts"`: state, stdout, the
//! last value, errors by name, typed code, contexts, env vars, a timeout);
//! and `tests/e2b/sdk_interp.mjs` with the pinned `@e2b/code-interpreter`
//! (a shorter round of the same).
//!
//! The venvs: `$TORPOR_INTERP_VENV` (else what `scripts/setup env` says;
//! `tests/common/interp.rs`) and the E2B one (`tests/common/e2b_sdk.rs`); `scripts/setup test` makes
//! both, and `scripts/test` leaves this test out without them (tests/needs).

mod common;

use std::time::Duration;

use common::e2b::{node_modules, python, run_script, Sdk};
use common::interp::InterpServer;
use common::Scratch;

/// The server's output bound in the test: small, so the check is quick.
const BOUND: usize = 256 * 1024;

/// Runs `script` with `sdk` against a fresh server; returns the script's
/// output and the server's log.
fn run_against_server(name: &str, sdk: Sdk, script: &str, args: &[&str]) -> (String, String) {
    let scratch = Scratch::new(name);
    let server = InterpServer::start(&scratch.0, BOUND);
    let out = run_script(
        sdk,
        script,
        args,
        &server.url,
        "unused-by-the-interpreter",
        &[],
        Duration::from_secs(300),
    );
    drop(server);
    let log = std::fs::read_to_string(scratch.path("server.err")).unwrap();
    // The timed-out execution's connection closed: the kernel was interrupted.
    assert!(
        log.contains("client gone, interrupting the kernel"),
        "the timed-out execution did not interrupt its kernel:\n{log}"
    );
    (out, log)
}

#[test]
fn interp_python_sdk_against_the_server_on_loopback() {
    assert!(
        python().exists(),
        "the e2b venv is missing ({}): run scripts/setup test",
        python().display()
    );
    let (out, _) = run_against_server(
        "interp-sdk-py",
        Sdk::Python,
        "sdk_interp.py",
        &[&BOUND.to_string()],
    );
    let pinned = include_str!("e2b/requirements.txt")
        .lines()
        .find_map(|l| l.trim().strip_prefix("e2b-code-interpreter=="))
        .expect("tests/e2b/requirements.txt pins e2b-code-interpreter");
    assert!(
        out.contains(&format!("sdk-interp: e2b-code-interpreter {pinned}\n")),
        "the script did not run the pinned e2b-code-interpreter {pinned}:\n{out}"
    );
}

#[test]
fn interp_js_sdk_against_the_server_on_loopback() {
    assert!(
        node_modules()
            .join("@e2b/code-interpreter/package.json")
            .exists(),
        "npm @e2b/code-interpreter is missing ({}): run scripts/setup test",
        node_modules().display()
    );
    let (out, _) = run_against_server("interp-sdk-js", Sdk::Js, "sdk_interp.mjs", &[]);
    let pins: serde_json::Value = serde_json::from_str(include_str!("e2b/package.json")).unwrap();
    let pinned = pins["dependencies"]["@e2b/code-interpreter"]
        .as_str()
        .expect("tests/e2b/package.json pins @e2b/code-interpreter");
    assert!(
        out.contains(&format!("sdk-interp-js: @e2b/code-interpreter {pinned}\n")),
        "the script did not run the pinned @e2b/code-interpreter {pinned}:\n{out}"
    );
}
