//! The E2B control plane through the real, pinned E2B Python SDK
//! (`tests/e2b/requirements.txt`, installed by `.ci/run` into a venv outside
//! the repository): `tests/e2b/sdk_control.py` against `torpor serve` on
//! loopback with the probe template: create, get_info, set_timeout,
//! metrics, list with a metadata filter and paging, pause (hibernation) →
//! 409 on a second pause → connect, snapshot → create from it → delete,
//! fork with a count, kill, and the SDK's not-found and auth errors.
//!
//! The venv: `$TORPOR_E2B_VENV`, else
//! `${TORPOR_CACHE:-/var/cache/torpor}/venv-e2b-<version>`; without one the
//! test skips loudly.

mod common;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::serve::{DataDir, ServeProcess};

const KEY: &str = "e2b-sdk-key-0123456789";
const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/e2b");

/// The pinned `e2b` version, from `tests/e2b/requirements.txt`.
fn pinned_version() -> String {
    let text = std::fs::read_to_string(format!("{DIR}/requirements.txt")).unwrap();
    text.lines()
        .find_map(|l| l.trim().strip_prefix("e2b=="))
        .expect("requirements.txt pins e2b==VERSION")
        .trim()
        .to_string()
}

fn venv(version: &str) -> PathBuf {
    if let Some(v) = std::env::var_os("TORPOR_E2B_VENV") {
        return v.into();
    }
    let cache = std::env::var_os("TORPOR_CACHE").unwrap_or_else(|| "/var/cache/torpor".into());
    PathBuf::from(cache).join(format!("venv-e2b-{version}"))
}

#[test]
fn python_sdk_control_plane() {
    let version = pinned_version();
    let python = venv(&version).join("bin/python");
    if !python.exists() {
        eprintln!(
            "SKIP e2b_sdk: venv missing ({}): run .ci/run",
            python.display()
        );
        return;
    }
    let data = DataDir::new("e2b-sdk");
    let serve = ServeProcess::start(&data.0, &["--token", KEY, "--policy-interval-ms", "200"]);
    let url = serve.url();
    let mut child = Command::new(&python)
        .arg(format!("{DIR}/sdk_control.py"))
        .env("E2B_API_URL", &url)
        .env("E2B_SANDBOX_URL", &url)
        .env("E2B_API_KEY", KEY)
        .env_remove("E2B_DEBUG")
        .env_remove("E2B_DOMAIN")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run the SDK script");
    let out = {
        // Bounded: the script's own requests time out, this is the backstop.
        let deadline = std::time::Instant::now() + Duration::from_secs(300);
        while child.try_wait().unwrap().is_none() {
            if std::time::Instant::now() > deadline {
                let _ = child.kill();
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        child.wait_with_output().unwrap()
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stdout}{stderr}");
    assert!(out.status.success(), "the SDK script failed: {stderr}");
    assert!(
        stdout.contains(&format!("e2b-sdk: version {version}")),
        "the venv's e2b is not the pinned {version}: {stdout}"
    );
    assert!(stdout.contains("passed, 0 failed"), "{stdout}");
}
