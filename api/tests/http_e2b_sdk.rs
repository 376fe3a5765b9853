//! The E2B Python SDK's `commands`, `pty` and `files` code paths
//! (`tests/e2b/sdk_envd.py`) against the API over a real torpor-agent on
//! this host, behind the hybrid vsock stand-in: the SDK's own Connect
//! client reads what envd's RPCs answer. The same SDK against a Linux guest
//! is the nested host's test. Needs the pinned SDK's venv (`.ci/run`);
//! `tests/needs` leaves it out without one.

mod common;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{ScratchDir, Server, TOKEN};

/// The pinned version, from `tests/e2b/requirements.txt`.
fn pinned() -> String {
    let text = include_str!("../../tests/e2b/requirements.txt");
    text.lines()
        .find_map(|l| l.strip_prefix("e2b=="))
        .expect("e2b pinned")
        .trim()
        .to_string()
}

fn python() -> PathBuf {
    let version = pinned();
    let venv = std::env::var_os("TORPOR_E2B_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let cache = std::env::var_os("TORPOR_CACHE").unwrap_or("/var/cache/torpor".into());
            PathBuf::from(cache).join(format!("venv-e2b-{version}"))
        });
    venv.join("bin/python")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_sdk_commands_and_files_through_envd() {
    let python = python();
    assert!(
        python.exists(),
        "the e2b venv is missing ({}): run .ci/run",
        python.display()
    );
    let server = Server::start().await;
    let url = format!("http://{}", server.addr);
    let scratch = ScratchDir::new("sdk");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/e2b/sdk_envd.py");
    let mut cmd = Command::new(python);
    cmd.arg(script)
        .arg(&scratch.0)
        .env("E2B_API_URL", &url)
        .env("E2B_SANDBOX_URL", &url)
        .env("E2B_API_KEY", TOKEN)
        .env_remove("E2B_DEBUG")
        .env_remove("E2B_DOMAIN")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let out = tokio::task::spawn_blocking(move || {
        let mut child = cmd.spawn().expect("run the SDK script");
        // Bounded: the script's requests time out; this is the backstop.
        let deadline = Instant::now() + Duration::from_secs(180);
        while child.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                let _ = child.kill();
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        child.wait_with_output().unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stdout}{stderr}");
    assert!(
        stdout.contains(&format!("sdk-envd: version {}\n", pinned())),
        "the installed e2b is not the pinned one: {stdout}"
    );
    assert!(
        out.status.success(),
        "the SDK script failed: {stdout}{stderr}"
    );
    assert!(stdout.contains(" passed, 0 failed"), "{stdout}");
}
