//! The E2B Python SDK's `commands`, `pty` and `files` code paths
//! (`tests/e2b/sdk_envd.py`) against the API over a real torpor-agent on
//! this host, behind the hybrid vsock stand-in: the SDK's own Connect
//! client reads what envd's RPCs answer. The same SDK against a Linux guest
//! is the nested host's test. Needs the pinned SDK's venv (`scripts/setup test`);
//! `tests/needs` leaves it out without one.

mod common;
#[path = "../../tests/common/e2b_sdk.rs"]
mod e2b_sdk;

use std::time::{Duration, Instant};

use common::{Server, TOKEN};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_sdk_commands_and_files_through_envd() {
    let python = e2b_sdk::python();
    assert!(
        python.exists(),
        "the e2b venv is missing ({}): run scripts/setup test",
        python.display()
    );
    let server = Server::start().await;
    let url = format!("http://{}", server.addr);
    let scratch = tempfile::tempdir().unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/e2b/sdk_envd.py");
    let mut cmd = e2b_sdk::sdk_command(&python, script, &url, TOKEN);
    cmd.arg(scratch.path());
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
        stdout.contains(&format!("sdk-envd: version {}\n", e2b_sdk::pinned_python())),
        "the installed e2b is not the pinned one: {stdout}"
    );
    assert!(
        out.status.success(),
        "the SDK script failed: {stdout}{stderr}"
    );
    assert!(stdout.contains(" passed, 0 failed"), "{stdout}");
}
