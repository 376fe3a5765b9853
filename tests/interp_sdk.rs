//! The code interpreter server (`guest-image/interpreter/torpor_interp.py`)
//! under the official, pinned `e2b-code-interpreter` Python SDK, on the host:
//! the server runs from the interpreter venv (ipykernel, jupyter_client,
//! bash_kernel, numpy, pandas, matplotlib: `guest-image/interpreter/
//! requirements.txt`) on a loopback port, and `tests/e2b/sdk_interp.py`
//! drives it with `E2B_SANDBOX_URL` pointing there: state across calls,
//! stdout/stderr callbacks, errors by name, a matplotlib PNG, a DataFrame as
//! HTML, env vars, contexts (fresh, restarted, removed), a timeout that
//! interrupts the kernel, bash, and the output bound; and
//! `tests/e2b/sdk_interp.mjs` with the pinned `@e2b/code-interpreter`
//! (a shorter round of the same).
//!
//! The venvs: `$TORPOR_INTERP_VENV` (else what `scripts/setup env` says)
//! and the E2B one (`tests/common/e2b_sdk.rs`); `scripts/setup test` makes
//! both, and `scripts/test` leaves this test out without them (tests/needs).

mod common;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::e2b::{node_modules, python, run_script, Sdk};
use common::Scratch;

const REPO: &str = env!("CARGO_MANIFEST_DIR");
/// The server's output bound in the test: small, so the check is quick.
const BOUND: usize = 256 * 1024;

/// The interpreter venv's python: `$TORPOR_INTERP_VENV`, else the path
/// `scripts/setup env` computes (keyed by the requirements' hash).
fn interp_python() -> PathBuf {
    let venv = match std::env::var_os("TORPOR_INTERP_VENV") {
        Some(v) => PathBuf::from(v),
        None => {
            let out = Command::new(format!("{REPO}/scripts/setup"))
                .arg("env")
                .output()
                .expect("run scripts/setup env");
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            let line = text
                .lines()
                .find_map(|l| l.strip_prefix("export TORPOR_INTERP_VENV="))
                .unwrap_or_else(|| panic!("scripts/setup env names no interpreter venv:\n{text}"));
            PathBuf::from(line.trim_matches('\''))
        }
    };
    venv.join("bin/python")
}

/// The server process, stopped with SIGTERM (it shuts its kernels down).
struct Server {
    child: Child,
    url: String,
}

impl Server {
    fn start(scratch: &Scratch) -> Self {
        let py = interp_python();
        assert!(
            py.exists(),
            "the interpreter venv is missing ({}): run scripts/setup test",
            py.display()
        );
        let log = scratch.path("server.log");
        let home = scratch.path("home");
        std::fs::create_dir_all(&home).unwrap();
        let child = Command::new(&py)
            .arg(format!("{REPO}/guest-image/interpreter/torpor_interp.py"))
            .args(["--listen", "127.0.0.1:0", "--max-output-bytes"])
            .arg(BOUND.to_string())
            .arg("--home")
            .arg(&home)
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(std::fs::File::create(scratch.path("server.err")).unwrap())
            .spawn()
            .unwrap_or_else(|e| panic!("start the interpreter with {}: {e}", py.display()));
        let line = common::wait_for_line(&log, Duration::from_secs(120), |l| {
            l.contains("listening on ")
        });
        let addr = line.rsplit("listening on ").next().unwrap().trim();
        Self {
            child,
            url: format!("http://{addr}"),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child's pid; no memory is involved.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        for _ in 0..100 {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `script` with `sdk` against a fresh server; returns the script's
/// output and the server's log.
fn run_against_server(name: &str, sdk: Sdk, script: &str, args: &[&str]) -> (String, String) {
    let scratch = Scratch::new(name);
    let server = Server::start(&scratch);
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
