//! E2B's volumes through the real, pinned Python SDK (`Volume`;
//! `tests/e2b/sdk_volumes.py`) against `torpor serve` on loopback: create,
//! list, get_info, connect, directories, files (8 MiB, bytes and streamed),
//! listing, metadata, remove, destroy; `..`, `/etc/passwd` and a planted
//! symbolic link stay inside the volume; another tenant's key and another
//! volume's token are refused; `volumeMounts` is 404 for an unknown
//! volume, 400 for a known one into a probe (no agent to mount it). The
//! mount itself: `tests/serve_service.rs`. The same through the JS SDK's `Volume`
//! (`tests/e2b/sdk_volumes.mjs`). `scripts/test` leaves each out without
//! its SDK (tests/needs).

mod common;

use std::time::Duration;

use serde_json::json;

use common::e2b::{node_modules, python, run_script, Sdk};
use common::http::request;
use common::serve::{DataDir, ServeProcess};

const KEY: &str = "e2b-volumes-key-0123456789";

/// Runs `script` with `sdk` against a fresh `torpor serve` with another
/// tenant's key; its output. Every volume it made is destroyed after.
fn run_against_serve(name: &str, sdk: Sdk, script: &str) -> String {
    let data = DataDir::new(name);
    // 64 MiB per volume, 3 per tenant: the scripts reach both limits.
    let serve = ServeProcess::start(
        &data.0,
        &[
            "--token",
            KEY,
            "--volume-max-mib",
            "64",
            "--volumes-per-tenant",
            "3",
        ],
    );
    // Another tenant's key, made by the admin.
    let other = request(
        &serve.addr,
        "POST",
        "/v1/tokens",
        Some(KEY),
        Some(&json!({"tenant": "other"}).to_string()),
    )
    .ok_json("POST", "/v1/tokens")["token"]
        .as_str()
        .expect("a token")
        .to_string();
    // A volume id in a create is the gate's to set (or the server in
    // front of a pod's, with an admin token): a tenant's is refused.
    let forged = request(
        &serve.addr,
        "POST",
        "/v1/sandboxes",
        Some(&other),
        Some(
            &json!({"template": "probe", "volume_mounts": [
                {"name": "x", "path": "/mnt/x", "id": "vol_0123456789ab"}]})
            .to_string(),
        ),
    );
    assert_eq!(forged.status, 403, "{}", forged.body);
    assert!(forged.body.contains("volume mount's id"), "{}", forged.body);
    let volumes = data.0.join("volumes");
    let url = serve.url();
    let out = run_script(
        sdk,
        script,
        &[],
        &url,
        KEY,
        &[
            ("E2B_VOLUME_API_URL", url.as_str()),
            ("E2B_OTHER_KEY", other.as_str()),
            ("TORPOR_VOLUMES_DIR", volumes.to_str().unwrap()),
        ],
        Duration::from_secs(300),
    );
    let left: Vec<_> = std::fs::read_dir(&volumes)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "volumes left behind: {left:?}");
    out
}

#[test]
fn python_sdk_volumes() {
    assert!(
        python().exists(),
        "the e2b venv is missing ({}): run scripts/setup test",
        python().display()
    );
    let out = run_against_serve("e2b-volumes-py", Sdk::Python, "sdk_volumes.py");
    assert!(out.contains("8 MiB write"), "{out}");
}

#[test]
fn js_sdk_volumes() {
    assert!(
        node_modules().join("e2b/package.json").exists(),
        "npm e2b is missing ({}): run scripts/setup test",
        node_modules().display()
    );
    run_against_serve("e2b-volumes-js", Sdk::Js, "sdk_volumes.mjs");
}
