//! `torpor serve` as the README runs it, with its nested pod (QEMU/TCG
//! with hardware virtualization inside): started over a data directory on
//! a loopback port, its log followed, the CLI as its client, and what
//! stops it all when a test ends (tests/nested_pod.rs,
//! tests/nested_builds.rs).

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use super::{complete_lines, stderr, stdout, torpor_with_env, TORPOR};

/// The admin token the tests' serve is started with.
pub const TOKEN: &str = "nested-pod-token";

/// `torpor ARGS` against the serve at `api`.
pub fn cli(api: &str, args: &[&str], limit: Duration) -> Output {
    torpor_with_env(args, &[("TORPOR_API", api), ("TORPOR_TOKEN", TOKEN)], limit)
}

pub fn ok(out: &Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what} failed: {}{}",
        stdout(out),
        stderr(out)
    );
    stdout(out)
}

/// Waits for a line of `log` matching `pred`; fails on `torpor serve`'s
/// nested-pod error or when serve exits.
pub fn wait_line(
    log: &Path,
    serve: &mut std::process::Child,
    limit: Duration,
    pred: impl Fn(&str) -> bool,
) -> String {
    let deadline = Instant::now() + limit;
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if let Some(l) = complete_lines(&text).find(|l| pred(l)) {
            return l.to_string();
        }
        assert!(
            !text.contains("Linux templates are unavailable")
                && !text.contains("the nested pod could not build"),
            "the nested pod failed:\n{text}"
        );
        if let Ok(Some(status)) = serve.try_wait() {
            panic!("torpor serve exited ({status}):\n{text}");
        }
        assert!(
            Instant::now() < deadline,
            "no matching line within {limit:?} in:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `torpor serve` on a loopback port over `data`, with the test's token.
pub fn serve_command(data: &Path) -> Command {
    let mut cmd = Command::new(TORPOR);
    cmd.args([
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--token",
        TOKEN,
        "--data-dir",
    ])
    .arg(data);
    cmd
}

/// `torpor serve` over `data` (with `extra` flags) as the nested tests
/// start it: 15-minute requests, the nested host of L1 directory `l1`
/// (the one this checkout prepared, with the network modules, not
/// whichever another checkout pointed the cache's `l1` link at), the
/// pod's own log (L1's console) and both of serve's streams into `log`
/// (the nested pod's failure is said on stderr, and [`wait_line`] stops
/// on it); killed on drop.
pub fn spawn_serve(data: &Path, l1: &Path, log: &Path, extra: &[&std::ffi::OsStr]) -> KillOnDrop {
    let log_file = std::fs::File::create(log).unwrap();
    let mut serve = serve_command(data);
    serve.args(["--request-timeout-ms", "900000"]);
    // The code interpreter step left out: nothing builds its template
    // beside the test's own guests either.
    if interpreter_step_left_out() {
        serve.arg("--no-nested-interpreter");
    }
    KillOnDrop(
        serve
            .args(extra)
            .env("TORPOR_NESTED_L1", l1)
            .env("TORPOR_NESTED_ECHO", "1")
            .stdin(std::process::Stdio::null())
            .stdout(log_file.try_clone().unwrap())
            .stderr(log_file)
            .spawn()
            .expect("spawn torpor serve"),
    )
}

/// The API address `torpor serve` logs to `log` once it listens.
pub fn listening_api(log: &Path, serve: &mut std::process::Child) -> String {
    let listening = wait_line(log, serve, Duration::from_secs(60), |l| {
        l.contains("listening on http://")
    });
    let addr = listening.split("listening on http://").nth(1).unwrap();
    format!("http://{}", addr.trim())
}

/// Kills `torpor serve` when the test ends.
pub struct KillOnDrop(pub std::process::Child);

/// On a failure, the tail of serve's log (with the nested pod's: its
/// sandboxes' errors and VMM exits), before the data directory goes.
pub struct ShowLogOnPanic(pub std::path::PathBuf);

impl Drop for ShowLogOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let text = std::fs::read_to_string(&self.0).unwrap_or_default();
            eprintln!(
                "--- the last 300 lines of {} (of L1's kernel lines, {KERNEL_LINES} in a \
                 row at most) ---\n{}",
                self.0.display(),
                log_tail(&text, 300)
            );
        }
    }
}

/// How many of L1's kernel lines (`L1| [ 12.3] ...`) in a row
/// [`log_tail`] keeps.
const KERNEL_LINES: usize = 60;

/// The last `n` lines of serve's log, of each run of L1's kernel lines
/// only the first [`KERNEL_LINES`]: a crashing L1 kernel repeats its dump
/// for hundreds of lines, which would push out everything that led to it.
fn log_tail(text: &str, n: usize) -> String {
    let mut run = 0;
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| {
            let is_kernel = l
                .strip_prefix("L1| ")
                .is_some_and(|rest| rest.trim_start().starts_with('['));
            run = if is_kernel { run + 1 } else { 0 };
            run <= KERNEL_LINES
        })
        .collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The code interpreter step's name for `--skip` (no test has it: the
/// step is left out when this run was given `--skip` with a filter it
/// contains, as `scripts/test` does from `tests/needs`).
pub const INTERP_STEP: &str = "nested_code_interpreter";

/// Whether this run leaves the code interpreter step out: libtest's
/// `--skip FILTER` (or `--skip=FILTER`) arguments, as it matches them
/// against test names.
fn interpreter_step_left_out() -> bool {
    let args: Vec<String> = std::env::args().collect();
    let mut skips = Vec::new();
    for (i, arg) in args.iter().enumerate() {
        if arg == "--skip" {
            skips.extend(args.get(i + 1).cloned());
        } else if let Some(filter) = arg.strip_prefix("--skip=") {
            skips.push(filter.to_string());
        }
    }
    skips.iter().any(|f| INTERP_STEP.contains(f.as_str()))
}

/// Whether test `who` runs the code interpreter step: unless it is left
/// out, serve's log (`text`, from its start) must say it offers
/// `code-interpreter-v1`.
pub fn interpreter_offered(who: &str, text: &str) -> bool {
    if interpreter_step_left_out() {
        eprintln!("{who}: the code interpreter step is left out (--skip {INTERP_STEP})");
        return false;
    }
    assert!(
        text.contains("`code-interpreter-v1` (the code interpreter) is offered too"),
        "serve does not offer the code interpreter: its image is missing (scripts/setup \
         test builds it; `--skip {INTERP_STEP}` leaves this step out):\n{text}"
    );
    true
}

/// `code-interpreter-v1`, built after `base` for the nested pod: once it
/// is ready, the real code interpreter SDKs (Python: the long round, JS:
/// create -> runCode -> kill) through serve at `api`, each call bounded
/// by 120 s (TCG); the timings they measured are printed.
pub fn code_interpreter_step(
    who: &str,
    api: &str,
    log: &Path,
    serve: &mut std::process::Child,
    started: Instant,
) {
    use super::e2b::{run_script, Sdk};
    let ready = wait_line(log, serve, Duration::from_secs(30 * 60), |l| {
        l.contains("template `code-interpreter-v1` ready in the nested host")
    });
    eprintln!(
        "{who}: {ready} (test saw it after {:.0}s)",
        started.elapsed().as_secs_f64()
    );
    for (sdk, script, limit) in [
        (Sdk::Python, "sdk_interp_serve.py", 1800),
        (Sdk::Js, "sdk_interp_serve.mjs", 600),
    ] {
        let began = Instant::now();
        let out = run_script(
            sdk,
            script,
            &["120"],
            api,
            TOKEN,
            &[],
            Duration::from_secs(limit),
        );
        for line in out.lines().filter(|l| l.starts_with("timing: ")) {
            eprintln!("{who}: {script} {line}");
        }
        eprintln!(
            "{who}: {script} passed in {:.0}s",
            began.elapsed().as_secs_f64()
        );
    }
}
