//! The pinned E2B SDKs the tests drive (`tests/e2b/`; `.ci/run` installs
//! them outside the repository).

use std::path::PathBuf;

/// The SDK scripts and pins.
pub const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/e2b");

/// The pinned Python `e2b` version, from `tests/e2b/requirements.txt`.
pub fn pinned_python() -> String {
    let text = std::fs::read_to_string(format!("{DIR}/requirements.txt")).unwrap();
    text.lines()
        .find_map(|l| l.trim().strip_prefix("e2b=="))
        .expect("requirements.txt pins e2b==VERSION")
        .trim()
        .to_string()
}

/// The pinned npm `e2b` version, from `tests/e2b/package.json`.
pub fn pinned_js() -> String {
    let text = std::fs::read_to_string(format!("{DIR}/package.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["dependencies"]["e2b"]
        .as_str()
        .expect("package.json pins e2b")
        .to_string()
}

/// `$var`, else `${TORPOR_CACHE:-/var/cache/torpor}/<name>`.
pub fn install_dir(var: &str, name: String) -> PathBuf {
    if let Some(v) = std::env::var_os(var) {
        return v.into();
    }
    let cache = std::env::var_os("TORPOR_CACHE").unwrap_or_else(|| "/var/cache/torpor".into());
    PathBuf::from(cache).join(name)
}

/// The venv's python with the pinned Python SDK.
pub fn python() -> PathBuf {
    install_dir("TORPOR_E2B_VENV", format!("venv-e2b-{}", pinned_python())).join("bin/python")
}
