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
        .expect("node is not installed: run .ci/run")
}

/// Which SDK runs a script: the Python venv's or node with the npm install.
#[derive(Clone, Copy)]
pub enum Sdk {
    Python,
    Js,
}

/// Runs `tests/e2b/SCRIPT ARGS` with `sdk` against the API at `url` (the
/// E2B variables set, plus `env`), bounded by `limit`; asserts it ran the
/// pinned version (its `<tag>: version X` line) and ended with
/// `<tag>: N passed, 0 failed`. Returns its output.
pub fn run_script(
    sdk: Sdk,
    script: &str,
    args: &[&str],
    url: &str,
    key: &str,
    env: &[(&str, &str)],
    limit: std::time::Duration,
) -> String {
    let (program, version) = match sdk {
        Sdk::Python => (python(), pinned_python()),
        Sdk::Js => (node(), pinned_js()),
    };
    let mut cmd = std::process::Command::new(&program);
    cmd.arg(format!("{DIR}/{script}"))
        .args(args)
        .env("E2B_API_URL", url)
        .env("E2B_SANDBOX_URL", url)
        .env("E2B_API_KEY", key)
        .env_remove("E2B_DEBUG")
        .env_remove("E2B_DOMAIN")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    if let Sdk::Js = sdk {
        cmd.env("NODE_PATH", node_modules());
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("run {script} with {}: {e}", program.display()));
    let out = super::wait_output(child, limit);
    let stdout = super::stdout(&out);
    let text = format!("{stdout}{}", super::stderr(&out));
    eprintln!("{script}:\n{text}");
    let tag = stdout
        .lines()
        .find_map(|l| l.split_once(": version "))
        .map(|(tag, _)| tag.to_string())
        .unwrap_or_else(|| panic!("{script} printed no version line:\n{text}"));
    assert!(
        stdout.contains(&format!("{tag}: version {version}\n")),
        "{script} did not run the pinned e2b {version}:\n{text}"
    );
    assert!(
        out.status.success()
            && stdout.lines().any(|l| l
                .strip_prefix(&format!("{tag}: "))
                .is_some_and(|r| r.ends_with(" passed, 0 failed"))),
        "{script} failed:\n{text}"
    );
    text
}
