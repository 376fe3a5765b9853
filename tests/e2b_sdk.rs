//! The E2B control plane through the real, pinned E2B SDKs, Python
//! (`tests/e2b/requirements.txt`) and JS (`tests/e2b/package.json`), each
//! installed by `.ci/run` outside the repository:
//! `tests/e2b/sdk_control.py` and `tests/e2b/sdk_control.mjs` against
//! `torpor serve` on loopback with the probe template: create, get_info, set_timeout,
//! metrics, list with a metadata filter and paging, pause (hibernation) →
//! 409 on a second pause → connect, snapshot → create from it → delete,
//! fork with a count, kill, and the SDK's not-found and auth errors.
//!
//! The venv: `$TORPOR_E2B_VENV`, else
//! `${TORPOR_CACHE:-/var/cache/torpor}/venv-e2b-<version>`; the npm install:
//! `$TORPOR_E2B_NODE`, else `.../node-e2b-<version>`. Without one, its test
//! skips loudly.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::e2b::{install_dir, pinned_js, pinned_python, DIR};
use common::serve::{DataDir, ServeProcess};

const KEY: &str = "e2b-sdk-key-0123456789";
/// Runs `program args` against a fresh `torpor serve` with the E2B
/// variables set (and `extra_env`); its stdout, after asserting success,
/// the pinned version and the closing line (`<tag>: N passed, 0 failed`).
fn run_sdk_script(
    name: &str,
    program: &Path,
    script: &str,
    extra_env: &[(&str, &Path)],
    tag: &str,
    version: &str,
) {
    let data = DataDir::new(name);
    let serve = ServeProcess::start(&data.0, &["--token", KEY, "--policy-interval-ms", "200"]);
    let url = serve.url();
    let mut cmd = Command::new(program);
    cmd.arg(format!("{DIR}/{script}"))
        .env("E2B_API_URL", &url)
        .env("E2B_SANDBOX_URL", &url)
        .env("E2B_API_KEY", KEY)
        .env_remove("E2B_DEBUG")
        .env_remove("E2B_DOMAIN")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in extra_env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("run the SDK script");
    // Bounded: the script's own requests time out, this is the backstop.
    let deadline = Instant::now() + Duration::from_secs(300);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stdout}{stderr}");
    assert!(out.status.success(), "the SDK script failed: {stderr}");
    assert!(
        stdout.contains(&format!("{tag}: version {version}\n")),
        "the installed e2b is not the pinned {version}: {stdout}"
    );
    let closing = format!("{tag}: ");
    assert!(
        stdout.lines().any(|l| l
            .strip_prefix(&closing)
            .is_some_and(|r| r.ends_with(" passed, 0 failed"))),
        "{stdout}"
    );
}

#[test]
fn python_sdk_control_plane() {
    let version = pinned_python();
    let python = install_dir("TORPOR_E2B_VENV", format!("venv-e2b-{version}")).join("bin/python");
    // scripts/test leaves this out without the venv (tests/needs).
    assert!(
        python.exists(),
        "the e2b venv is missing ({}): run .ci/run",
        python.display()
    );
    run_sdk_script(
        "e2b-sdk-py",
        &python,
        "sdk_control.py",
        &[],
        "e2b-sdk",
        &version,
    );
}

#[test]
fn js_sdk_control_plane() {
    let version = pinned_js();
    let modules =
        install_dir("TORPOR_E2B_NODE", format!("node-e2b-{version}")).join("node_modules");
    // scripts/test leaves this out without node or the npm package
    // (tests/needs).
    assert!(
        modules.join("e2b/package.json").exists(),
        "npm e2b is missing ({}): run .ci/run",
        modules.display()
    );
    let node = which("node").expect("node is not installed: run .ci/run");
    run_sdk_script(
        "e2b-sdk-js",
        &node,
        "sdk_control.mjs",
        &[("NODE_PATH", &modules)],
        "e2b-sdk-js",
        &version,
    );
}

/// The first `name` on `PATH`.
fn which(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}
