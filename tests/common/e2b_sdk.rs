//! Where the pinned E2B SDKs are and how a script of theirs is pointed at
//! torpor: self-contained, so the API crate's tests and the E2B bench
//! take it by `#[path]` too (`scripts/setup test` installs the SDKs outside the
//! repository).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The pinned Python `e2b` version, from `tests/e2b/requirements.txt`.
pub fn pinned_python() -> String {
    let text = include_str!("../e2b/requirements.txt");
    text.lines()
        .find_map(|l| l.trim().strip_prefix("e2b=="))
        .expect("requirements.txt pins e2b==VERSION")
        .trim()
        .to_string()
}

/// The pinned npm `e2b` version, from `tests/e2b/package.json`.
pub fn pinned_js() -> String {
    let text = include_str!("../e2b/package.json");
    let v: serde_json::Value = serde_json::from_str(text).unwrap();
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

/// The npm install's `node_modules` with the pinned JS SDK.
pub fn node_modules() -> PathBuf {
    install_dir("TORPOR_E2B_NODE", format!("node-e2b-{}", pinned_js())).join("node_modules")
}

/// `node` on `PATH`.
pub fn node() -> PathBuf {
    std::env::var_os("PATH")
        .and_then(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join("node"))
                .find(|p| p.is_file())
        })
        .expect("node is not installed: run scripts/setup test")
}

/// `program SCRIPT` with the E2B variables set for the API at `url` (both
/// the API and the sandboxes' envd, with `key`), the SDK's debug and
/// domain variables cleared; stdin null, stdout and stderr piped.
pub fn sdk_command(program: &Path, script: &str, url: &str, key: &str) -> Command {
    let mut cmd = Command::new(program);
    cmd.arg(script)
        .env("E2B_API_URL", url)
        .env("E2B_SANDBOX_URL", url)
        .env("E2B_API_KEY", key)
        .env_remove("E2B_DEBUG")
        .env_remove("E2B_DOMAIN")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}
