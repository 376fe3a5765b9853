//! `torpor serve --nested-pod` on this host (PVM: no Linux guests of its
//! own): serve starts at once, a sandbox from `linux` answers 503 while the
//! nested host boots, then the nested pod registers with a ready template
//! `linux`, and a sandbox from it is created, runs `echo` and `python3`,
//! hibernates, wakes and is deleted, all through the central API (the
//! `torpor sandbox` CLI is the client). Killing serve stops the nested host.
//!
//! Needs the nested host (`scripts/nested-host prepare`), the guest kernel,
//! the agent and the rootfs (the scripts build or find them); fails saying
//! what is missing; `TORPOR_SKIP_NESTED=1 scripts/test` leaves it out
//! (the test itself never skips).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::serve::DataDir;
use common::{complete_lines, stderr, stdout, wait_output, TORPOR};

const TOKEN: &str = "nested-pod-token";

/// Runs a repository script that prints a path last; that path.
fn script_path(script: &str, args: &[&str]) -> PathBuf {
    let out = Command::new(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("scripts")
            .join(script),
    )
    .args(args)
    .output()
    .unwrap_or_else(|e| panic!("cannot run scripts/{script}: {e}"));
    assert!(
        out.status.success(),
        "scripts/{script} failed; run it by hand to see why:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let path = PathBuf::from(stdout(&out).lines().last().unwrap_or("").trim());
    assert!(
        path.exists(),
        "scripts/{script} printed no path: {}",
        path.display()
    );
    path
}

/// `torpor ARGS` against the serve at `api`.
fn cli(api: &str, args: &[&str], limit: Duration) -> Output {
    let child = Command::new(TORPOR)
        .args(args)
        .env("TORPOR_API", api)
        .env("TORPOR_TOKEN", TOKEN)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn torpor");
    wait_output(child, limit)
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

#[test]
fn nested_serve_runs_linux_templates_in_a_nested_pod() {
    let l1 = script_path("nested-host", &["prepare"]);
    let kernel = script_path("build-guest-kernel", &[]);
    let agent = script_path("build-agent", &[]);
    let data = DataDir::new("nested-pod");
    let rootfs = data.0.join("rootfs.ext4");
    script_path(
        "build-rootfs",
        &[
            "--agent",
            agent.to_str().unwrap(),
            "--out",
            rootfs.to_str().unwrap(),
        ],
    );
    let log = data.0.join("serve.log");
    let log_file = std::fs::File::create(&log).unwrap();
    let started = Instant::now();
    let mut serve = KillOnDrop(
        Command::new(TORPOR)
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--token",
                TOKEN,
                "--data-dir",
            ])
            .arg(data.0.join("data"))
            .arg("--nested-pod")
            .arg("--nested-kernel")
            .arg(&kernel)
            .arg("--nested-rootfs")
            .arg(&rootfs)
            .args(["--request-timeout-ms", "900000"])
            // The L1 this checkout prepared (with the network modules), not
            // whichever another checkout pointed the cache's `l1` link at.
            .env("TORPOR_NESTED_L1", &l1)
            .stdin(Stdio::null())
            // Both streams: the nested pod's failure is said on stderr,
            // and wait_line stops on it.
            .stdout(log_file.try_clone().unwrap())
            .stderr(log_file)
            .spawn()
            .expect("spawn torpor serve"),
    );
    let serve = &mut serve.0;

    let listening = wait_line(&log, serve, Duration::from_secs(60), |l| {
        l.contains("listening on http://")
    });
    let api = format!(
        "http://{}",
        listening
            .split("listening on http://")
            .nth(1)
            .unwrap()
            .trim()
    );
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains("starting the nested host for Linux templates"),
        "{text}"
    );
    // Start-up did not wait for L1; a Linux sandbox meanwhile is a clear 503.
    let early = cli(
        &api,
        &["sandbox", "create", "--template", "linux"],
        Duration::from_secs(60),
    );
    assert!(!early.status.success(), "{}", stdout(&early));
    let why = stderr(&early);
    assert!(
        why.contains("template linux is not available yet") && why.contains("503"),
        "{why}"
    );

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
        &cli(&api, &["sandbox", "create", "--template", "linux"], step),
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

    // The E2B Python SDK against a Linux sandbox of the nested pod:
    // lifecycle through the federation's typed calls to the pod, commands,
    // PTY and files through envd and the agent tunnel.
    let sdk = Command::new(common::e2b::python())
        .arg(format!("{}/sdk_envd.py", common::e2b::DIR))
        .arg("/root/sdk")
        .env("E2B_API_URL", &api)
        .env("E2B_SANDBOX_URL", &api)
        .env("E2B_API_KEY", TOKEN)
        .env("E2B_TEST_TEMPLATE", "linux")
        .env_remove("E2B_DEBUG")
        .env_remove("E2B_DOMAIN")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run the E2B SDK script (the venv .ci/run makes)");
    let sdk = wait_output(sdk, step);
    let sdk_out = format!("{}{}", stdout(&sdk), stderr(&sdk));
    eprintln!("nested_pod: E2B SDK:\n{sdk_out}");
    assert!(
        sdk.status.success() && sdk_out.contains(" passed, 0 failed"),
        "the E2B SDK against the nested pod's Linux sandbox:\n{sdk_out}"
    );
    assert!(
        sdk_out.contains(&format!(
            "sdk-envd: version {}\n",
            common::e2b::pinned_python()
        )),
        "{sdk_out}"
    );

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
        step,
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

    // The next serve on the same data directory forgets that pod (its L1
    // and sandboxes are gone) and, without --nested-pod, says how to get
    // Linux templates.
    let again = data.0.join("serve-again.log");
    let mut serve = KillOnDrop(
        Command::new(TORPOR)
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--token",
                TOKEN,
                "--data-dir",
            ])
            .arg(data.0.join("data"))
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&again).unwrap())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn torpor serve"),
    );
    let listening = wait_line(&again, &mut serve.0, Duration::from_secs(60), |l| {
        l.contains("listening on http://")
    });
    let api = format!(
        "http://{}",
        listening
            .split("listening on http://")
            .nth(1)
            .unwrap()
            .trim()
    );
    let text = std::fs::read_to_string(&again).unwrap();
    assert!(
        text.contains(&format!(
            "unregistered {pod}, the nested pod of an earlier run"
        )),
        "{text}"
    );
    assert!(
        text.contains("to run Linux templates, start with --nested-pod"),
        "{text}"
    );
    let pods = ok(
        &cli(&api, &["pod", "list"], Duration::from_secs(60)),
        "pod list",
    );
    assert!(!pods.contains(&pod), "{pods}");
}

/// Kills `torpor serve` when the test ends (its nested host dies with it).
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
