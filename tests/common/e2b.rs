//! The pinned E2B SDKs the tests drive (`tests/e2b/`; `scripts/setup test` installs
//! them outside the repository).

pub use super::e2b_sdk::{node, node_modules, pinned_js, pinned_python, python};

/// The SDK scripts and pins.
pub const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/e2b");

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
    let mut cmd = super::e2b_sdk::sdk_command(&program, &format!("{DIR}/{script}"), url, key);
    cmd.args(args);
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
