//! The README's `torpor serve` on this host (PVM: no Linux guests of its
//! own) offers the Linux template `base` on demand: serve starts at once,
//! the first request for `base` starts the nested host and answers 503
//! with `Retry-After` and the step it is at, serve builds what is missing
//! with this checkout's scripts (the kernel, agent and rootfs; cached) and
//! logs its progress, then the nested pod is attached with a ready template
//! `base`, and a sandbox from it is created, runs `echo` and `python3`,
//! serves the E2B SDKs (Python and JS: commands, files, lifecycle),
//! hibernates, wakes and is deleted, all through the central API (the
//! `torpor sandbox` CLI is the client). Killing serve stops the nested
//! host; `--no-nested-pod` never starts it.
//!
//! Needs the nested host (`scripts/nested-host prepare`), the guest kernel,
//! the agent and the rootfs (the scripts build or find them); fails saying
//! what is missing; `TORPOR_SKIP_NESTED=1 scripts/test` leaves it out
//! (the test itself never skips).

mod common;
#[path = "../nested/tests/common/linux.rs"]
mod linux;

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::serve::DataDir;
use common::{complete_lines, stderr, stdout, torpor_with_env, TORPOR};

const TOKEN: &str = "nested-pod-token";

/// `torpor ARGS` against the serve at `api`.
fn cli(api: &str, args: &[&str], limit: Duration) -> Output {
    torpor_with_env(args, &[("TORPOR_API", api), ("TORPOR_TOKEN", TOKEN)], limit)
}

fn ok(out: &Output, what: &str) -> String {
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
fn wait_line(
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
            !text.contains("Linux templates are unavailable"),
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
fn serve_command(data: &Path) -> Command {
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

/// The API address `torpor serve` logs to `log` once it listens.
fn listening_api(log: &Path, serve: &mut std::process::Child) -> String {
    let listening = wait_line(log, serve, Duration::from_secs(60), |l| {
        l.contains("listening on http://")
    });
    let addr = listening.split("listening on http://").nth(1).unwrap();
    format!("http://{}", addr.trim())
}

#[test]
fn nested_serve_runs_linux_templates_in_a_nested_pod() {
    let l1 = linux::script_path("nested-host", &["prepare"]);
    let data = DataDir::new("nested-pod");
    let log = data.0.join("serve.log");
    let log_file = std::fs::File::create(&log).unwrap();
    let started = Instant::now();
    let mut serve = KillOnDrop(
        serve_command(&data.0.join("data"))
            .args(["--request-timeout-ms", "900000"])
            // The L1 this checkout prepared (with the network modules), not
            // whichever another checkout pointed the cache's `l1` link at.
            .env("TORPOR_NESTED_L1", &l1)
            // The pod's own log (L1's console) into serve's, which a
            // failure shows (`ShowLogOnPanic`).
            .env("TORPOR_NESTED_ECHO", "1")
            .stdin(Stdio::null())
            // Both streams: the nested pod's failure is said on stderr,
            // and wait_line stops on it.
            .stdout(log_file.try_clone().unwrap())
            .stderr(log_file)
            .spawn()
            .expect("spawn torpor serve"),
    );
    let serve = &mut serve.0;
    let _show = ShowLogOnPanic(log.clone());

    let api = listening_api(&log, serve);
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains(
            "the Linux template `base` runs in a nested host started on its first request"
        ),
        "{text}"
    );
    assert!(!text.contains("starting the nested host"), "{text}");
    // The first request for `base` starts it and is a clear 503 saying
    // what it waits for, with Retry-After.
    let addr = api.trim_start_matches("http://").to_string();
    let early = common::http::request(
        &addr,
        "POST",
        "/v1/sandboxes",
        Some(TOKEN),
        Some(r#"{"template":"base"}"#),
    );
    assert_eq!(early.status, 503, "{}", early.body);
    assert_eq!(
        early.json()["error"]["code"],
        "unavailable",
        "{}",
        early.body
    );
    let why = early.json()["error"]["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(why.contains("template base is not available yet"), "{why}");
    assert!(why.contains("step "), "no progress in: {why}");
    let retry: u64 = early
        .header("retry-after")
        .unwrap_or_else(|| panic!("no Retry-After: {}", early.head))
        .parse()
        .unwrap();
    assert!((1..=120).contains(&retry), "Retry-After {retry}");
    // The E2B route says the same (E2B's error body, same header).
    let e2b = common::http::request_with(
        &addr,
        "POST",
        "/sandboxes",
        &[("X-API-KEY", TOKEN)],
        Some(r#"{"templateID":"base"}"#),
    );
    assert_eq!(e2b.status, 503, "{}", e2b.body);
    assert!(e2b.header("retry-after").is_some(), "{}", e2b.head);
    // The template is being prepared: progress is in the log.
    wait_line(&log, serve, Duration::from_secs(120), |l| {
        l.contains("`base` was asked for: starting the nested host")
    });
    wait_line(&log, serve, Duration::from_secs(20 * 60), |l| {
        l.contains("`base`: building the Debian root filesystem (")
    });

    let ready = wait_line(&log, serve, Duration::from_secs(20 * 60), |l| {
        l.contains("Linux templates run in the nested host (pod ")
    });
    eprintln!(
        "nested_pod: {ready} (test saw it after {:.0}s)",
        started.elapsed().as_secs_f64()
    );
    let pod = ready
        .split("(pod ")
        .nth(1)
        .and_then(|r| r.split(')').next())
        .unwrap()
        .to_string();
    let pods = ok(
        &cli(&api, &["pod", "list"], Duration::from_secs(60)),
        "pod list",
    );
    assert!(pods.contains(&pod), "{pods}");

    let step = Duration::from_secs(600);
    let sbx = ok(
        &cli(&api, &["sandbox", "create", "--template", "base"], step),
        "sandbox create",
    )
    .trim()
    .to_string();
    assert!(sbx.starts_with("sbx_"), "{sbx}");
    let got = ok(&cli(&api, &["sandbox", "get", &sbx], step), "sandbox get");
    assert!(
        got.contains(&pod),
        "the sandbox is not on the nested pod:\n{got}"
    );

    let echo = cli(
        &api,
        &["sandbox", "exec", &sbx, "--", "echo", "hello-nested-pod"],
        step,
    );
    assert_eq!(ok(&echo, "exec echo"), "hello-nested-pod\n");
    let py = cli(
        &api,
        &[
            "sandbox",
            "exec",
            &sbx,
            "--",
            "python3",
            "-c",
            "print('py', 6 * 7)",
        ],
        step,
    );
    assert_eq!(ok(&py, "exec python3"), "py 42\n");

    // The E2B SDKs against Linux sandboxes of the nested pod, unchanged
    // agents' code with only the URLs and the key set: lifecycle through
    // the typed calls of serve to the pod (create, info, timeouts,
    // list and paging, pause -> connect, snapshot -> create, fork, kill,
    // the SDK's errors), commands, PTY and files through envd and the
    // agent tunnel, processes and files kept across pause -> connect.
    use common::e2b::{run_script, Sdk};
    let base = [("E2B_TEST_TEMPLATE", "base")];
    for (sdk, script, args) in [
        (Sdk::Python, "sdk_envd.py", &["/home/user/sdk-py"][..]),
        (Sdk::Js, "sdk_envd.mjs", &["/home/user/sdk-js"][..]),
        (Sdk::Python, "sdk_control.py", &[][..]),
        (Sdk::Js, "sdk_control.mjs", &[][..]),
        // The pause -> connect soak, bounded here (`cargo bench --bench e2b
        // -- --soak` runs it full length): one sandbox, then five at once.
        (Sdk::Python, "sdk_soak.py", &["base", "17", "1"][..]),
        (Sdk::Python, "sdk_soak.py", &["base", "4", "5"][..]),
    ] {
        let started = Instant::now();
        run_script(
            sdk,
            script,
            args,
            &api,
            TOKEN,
            &base,
            Duration::from_secs(1200),
        );
        eprintln!(
            "nested_pod: {script} passed in {:.0}s",
            started.elapsed().as_secs_f64()
        );
    }

    ok(
        &cli(&api, &["sandbox", "hibernate", &sbx], step),
        "hibernate",
    );
    let state = ok(&cli(&api, &["sandbox", "get", &sbx], step), "get");
    assert!(
        state
            .lines()
            .any(|l| l.starts_with("state") && l.contains("hibernated")),
        "{state}"
    );
    // The next exec wakes it (the hostname is set again after a restore).
    // A wake takes seconds here; a guest that stopped answering after its
    // restore fails the run in 5 minutes, not 10.
    let wake_step = Duration::from_secs(300);
    let wrote = cli(
        &api,
        &[
            "sandbox",
            "exec",
            &sbx,
            "--",
            "sh",
            "-c",
            "cat /proc/sys/kernel/hostname",
        ],
        wake_step,
    );
    assert_eq!(
        ok(&wrote, "exec after hibernate"),
        format!("{}\n", sbx.replace('_', "-"))
    );
    let state = ok(&cli(&api, &["sandbox", "get", &sbx], step), "get");
    assert!(
        state
            .lines()
            .any(|l| l.starts_with("state") && l.contains("running")),
        "{state}"
    );

    ok(&cli(&api, &["sandbox", "rm", &sbx], step), "sandbox rm");
    let gone = ok(&cli(&api, &["sandbox", "get", &sbx], step), "get");
    assert!(
        gone.lines()
            .any(|l| l.starts_with("state") && l.contains("deleted")),
        "{gone}"
    );

    // kill -9 of serve takes the nested host along: its forwarded port closes.
    let text = std::fs::read_to_string(&log).unwrap();
    let port = text
        .lines()
        .find_map(|l| l.split(" at tls:127.0.0.1:").nth(1))
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| panic!("no nested pod address in:\n{text}"))
        .to_string();
    let _ = serve.kill();
    let _ = serve.wait();
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(format!("127.0.0.1:{port}")).is_ok() {
        assert!(
            Instant::now() < deadline,
            "the nested host outlived torpor serve (port {port} still open)"
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // The next serve on the same data directory knows nothing of that pod
    // (its L1 and sandboxes died with the first serve: nothing of them was
    // stored); with --no-nested-pod it never starts one.
    let again = data.0.join("serve-again.log");
    let mut serve = KillOnDrop(
        serve_command(&data.0.join("data"))
            .arg("--no-nested-pod")
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&again).unwrap())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn torpor serve"),
    );
    let api = listening_api(&again, &mut serve.0);
    let text = std::fs::read_to_string(&again).unwrap();
    assert!(
        text.contains("Linux templates need the nested host, which --no-nested-pod turns off"),
        "{text}"
    );
    let refused = cli(
        &api,
        &["sandbox", "create", "--template", "base"],
        Duration::from_secs(60),
    );
    assert!(!refused.status.success(), "{}", stdout(&refused));
    assert!(!stderr(&refused).contains("503"), "{}", stderr(&refused));
    let pods = ok(
        &cli(&api, &["pod", "list"], Duration::from_secs(60)),
        "pod list",
    );
    assert!(!pods.contains(&pod), "{pods}");
}

/// Kills `torpor serve` when the test ends (its nested host dies with it).
struct KillOnDrop(std::process::Child);

/// On a failure, the tail of serve's log (with the nested pod's: its
/// sandboxes' errors and VMM exits), before the data directory goes.
struct ShowLogOnPanic(std::path::PathBuf);

impl Drop for ShowLogOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let text = std::fs::read_to_string(&self.0).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let tail = lines[lines.len().saturating_sub(300)..].join("\n");
            eprintln!("--- the last 300 lines of {} ---\n{tail}", self.0.display());
        }
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
