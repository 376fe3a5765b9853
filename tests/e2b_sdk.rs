//! The E2B control plane through the real, pinned E2B SDKs, Python
//! (`tests/e2b/requirements.txt`) and JS (`tests/e2b/package.json`), each
//! installed by `scripts/setup test` outside the repository:
//! `tests/e2b/sdk_control.py` and `tests/e2b/sdk_control.mjs` against
//! `torpor serve` on loopback with the probe template: create, get_info, set_timeout,
//! metrics (history, ranges), list with a metadata filter, newest first,
//! `order="asc"` and paging (tokens bound to their order), pause (hibernation) →
//! 409 on a second pause → connect, snapshot → create from it → delete,
//! fork with a count, kill, and the SDK's not-found and auth errors.
//! (`tests/nested_pod.rs` runs the same scripts against a Linux template.)
//!
//! The venv: `$TORPOR_E2B_VENV`, else
//! `${TORPOR_CACHE:-/var/cache/torpor}/venv-e2b-<version>`; the npm install:
//! `$TORPOR_E2B_NODE`, else `.../node-e2b-<version>`. `scripts/test`
//! leaves a test out without its SDK (tests/needs).

mod common;

use std::time::Duration;

use common::e2b::{node_modules, python, run_script, Sdk};
use common::serve::{DataDir, ServeProcess};

const KEY: &str = "e2b-sdk-key-0123456789";

/// Runs `script` with `sdk` against a fresh `torpor serve`.
fn run_against_serve(name: &str, sdk: Sdk, script: &str) {
    let data = DataDir::new(name);
    let serve = ServeProcess::start(&data.0, &["--token", KEY, "--policy-interval-ms", "200"]);
    // Bounded: the script's own requests time out, this is the backstop.
    run_script(
        sdk,
        script,
        &[],
        &serve.url(),
        KEY,
        &[],
        Duration::from_secs(300),
    );
}

#[test]
fn python_sdk_control_plane() {
    assert!(
        python().exists(),
        "the e2b venv is missing ({}): run scripts/setup test",
        python().display()
    );
    run_against_serve("e2b-sdk-py", Sdk::Python, "sdk_control.py");
}

#[test]
fn js_sdk_control_plane() {
    assert!(
        node_modules().join("e2b/package.json").exists(),
        "npm e2b is missing ({}): run scripts/setup test",
        node_modules().display()
    );
    run_against_serve("e2b-sdk-js", Sdk::Js, "sdk_control.mjs");
}
