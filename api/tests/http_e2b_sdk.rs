//! The E2B SDKs' `commands`, `pty` and `files` code paths
//! (`tests/e2b/sdk_envd.py` and `tests/e2b/sdk_envd.mjs`) against the API
//! over a real torpor-agent on this host, behind the hybrid vsock
//! stand-in: the SDKs' own Connect clients read what envd's RPCs answer.
//! The same scripts against a Linux guest are the nested host's test.
//! Need the pinned SDKs' installs (`scripts/setup test`); `tests/needs`
//! leaves a test out without its SDK.

mod common;
#[path = "../../tests/common/e2b_sdk.rs"]
mod e2b_sdk;

use std::path::PathBuf;
use std::process::Output;
use std::time::{Duration, Instant};

use common::{Server, TOKEN};
use torpor_api::ApiConfig;

/// Runs `script` with `program` against a fresh server; its output.
async fn run_sdk(program: PathBuf, script: &str, env: Vec<(&'static str, PathBuf)>) -> String {
    run_sdk_on(Server::start().await, program, script, env).await
}

/// [`run_sdk`] against `server`.
async fn run_sdk_on(
    server: Server,
    program: PathBuf,
    script: &str,
    env: Vec<(&'static str, PathBuf)>,
) -> String {
    let url = format!("http://{}", server.addr);
    let scratch = tempfile::tempdir().unwrap();
    let script = format!("{}/../tests/e2b/{script}", env!("CARGO_MANIFEST_DIR"));
    let mut cmd = e2b_sdk::sdk_command(&program, &script, &url, TOKEN);
    cmd.arg(scratch.path());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out: Output = tokio::task::spawn_blocking(move || {
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
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stdout}{stderr}");
    assert!(
        out.status.success(),
        "the SDK script failed: {stdout}{stderr}"
    );
    assert!(stdout.contains(" passed, 0 failed"), "{stdout}");
    stdout
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_sdk_commands_and_files_through_envd() {
    let python = e2b_sdk::python();
    assert!(
        python.exists(),
        "the e2b venv is missing ({}): run scripts/setup test",
        python.display()
    );
    let stdout = run_sdk(python, "sdk_envd.py", Vec::new()).await;
    assert!(
        stdout.contains(&format!("sdk-envd: version {}\n", e2b_sdk::pinned_python())),
        "the installed e2b is not the pinned one: {stdout}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn js_sdk_commands_and_files_through_envd() {
    let modules = e2b_sdk::node_modules();
    assert!(
        modules.join("e2b/package.json").exists(),
        "npm e2b is missing ({}): run scripts/setup test",
        modules.display()
    );
    let stdout = run_sdk(
        e2b_sdk::node(),
        "sdk_envd.mjs",
        vec![("NODE_PATH", modules)],
    )
    .await;
    assert!(
        stdout.contains(&format!("sdk-envd-js: version {}\n", e2b_sdk::pinned_js())),
        "the installed e2b is not the pinned one: {stdout}"
    );
}

/// A guest port through the Python SDK (`tests/e2b/sdk_ports.py`): an
/// `http.server` the SDK starts, fetched by E2B's headers and by
/// `get_host(port)`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_sdk_reaches_a_guest_port() {
    let python = e2b_sdk::python();
    assert!(
        python.exists(),
        "the e2b venv is missing ({}): run scripts/setup test",
        python.display()
    );
    let server = Server::start_with(ApiConfig {
        proxy_domain: Some("localhost".into()),
        ..Server::config()
    })
    .await;
    run_sdk_on(server, python, "sdk_ports.py", Vec::new()).await;
}
