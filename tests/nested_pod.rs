//! The README's `torpor serve` on this host (PVM: no Linux guests of its
//! own) offers the Linux template `base` on demand: serve starts at once,
//! the first request for `base` starts the nested host and answers 503
//! with `Retry-After` and the step it is at, serve builds what is missing
//! with this checkout's scripts (the kernel, agent and rootfs; cached) and
//! logs its progress, then the nested pod is attached with a ready template
//! `base`, and a sandbox from it is created, runs `echo` and `python3`,
//! serves the E2B SDKs (Python and JS: commands, files, lifecycle),
//! hibernates, wakes and is deleted, all through the central API (the
//! `torpor sandbox` CLI is the client). kill -9 of serve leaves the nested
//! host running: the next serve re-attaches to it, and a tenant's running
//! and hibernated sandboxes answer with their files, environment and envd
//! token; `--no-nested-pod` stops it and never starts one.
//!
//! The code interpreter step (with the interpreter's image, which
//! `scripts/setup test` builds): serve offers `code-interpreter-v1` too
//! (503 while it comes), the nested pod builds it after `base`, and the
//! real code interpreter SDKs run through serve with only the E2B URLs and
//! the key set (`tests/e2b/sdk_interp_serve.py`: state, callbacks, errors,
//! a PNG, a DataFrame, bash, a timeout, pause -> connect, kill; and
//! `sdk_interp_serve.mjs`: create -> runCode -> kill). `scripts/test` leaves
//! it out (`--skip nested_code_interpreter`, from `tests/needs`) when
//! the image or the SDKs are missing; run directly, it fails saying what is
//! missing.
//!
//! Needs the nested host (`scripts/nested-host prepare`), the guest kernel,
//! the agent and the rootfs (the scripts build or find them); fails saying
//! what is missing; `TORPOR_SKIP_NESTED=1 scripts/test` leaves it out
//! (the test itself never skips).

mod common;
#[path = "../nested/tests/common/linux.rs"]
mod linux;

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::nested_host::StopNestedHost;
use common::nested_serve::{
    cli, code_interpreter_step, interpreter_offered, listening_api, ok, serve_command, spawn_serve,
    wait_line, KillOnDrop, ShowLogOnPanic, TOKEN,
};
use common::serve::DataDir;
use common::{stderr, stdout};
#[test]
fn nested_serve_runs_linux_templates_in_a_nested_pod() {
    let l1 = linux::script_path("nested-host", &["prepare"]);
    let data = DataDir::new("nested-pod");
    let _stop_l1 = StopNestedHost(data.0.join("data"));
    let log = data.0.join("serve.log");
    let started = Instant::now();
    let mut first = spawn_serve(&data.0.join("data"), &l1, &log, &[]);
    let serve = &mut first.0;
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
    let interp = interpreter_offered("nested_pod", &text);
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
    if interp {
        // The interpreter comes with the same nested host: 503 too.
        let early = common::http::request_with(
            &addr,
            "POST",
            "/sandboxes",
            &[("X-API-KEY", TOKEN)],
            Some(r#"{"templateID":"code-interpreter-v1"}"#),
        );
        assert_eq!(early.status, 503, "{}", early.body);
        assert!(
            early
                .body
                .contains("template code-interpreter-v1 is not available yet"),
            "{}",
            early.body
        );
    }
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
    // A volume mounted in a Linux sandbox of the nested pod: served by
    // this server's volume gateway through the pod's relay.
    for (sdk, script) in [
        (Sdk::Python, "sdk_volume_mounts.py"),
        (Sdk::Js, "sdk_volume_mounts.mjs"),
    ] {
        let started_mounts = Instant::now();
        run_script(
            sdk,
            script,
            &[],
            &api,
            TOKEN,
            &[("E2B_TEST_TEMPLATE", "base"), ("E2B_VOLUME_API_URL", &api)],
            Duration::from_secs(1200),
        );
        eprintln!(
            "nested_pod: {script} passed in {:.0}s",
            started_mounts.elapsed().as_secs_f64()
        );
    }
    for (sdk, script, args) in [
        (Sdk::Python, "sdk_envd.py", &["/home/user/sdk-py"][..]),
        (Sdk::Js, "sdk_envd.mjs", &["/home/user/sdk-js"][..]),
        (Sdk::Python, "sdk_control.py", &[][..]),
        (Sdk::Js, "sdk_control.mjs", &[][..]),
        // A guest port (`python3 -m http.server` in the sandbox) both ways
        // the SDKs address one: E2B's headers and `{port}-{id}.{domain}`.
        (Sdk::Python, "sdk_ports.py", &["/tmp"][..]),
        // The pause -> connect soak, bounded (`cargo bench --bench e2b --
        // --soak` runs it full length, 200 cycles of one sandbox and of
        // five at once): 4 cycles of one, then 2 of two side by side (where
        // a wake's first agent connection was reset with the snapshot's
        // before the vsock device held rx for the transport reset).
        (Sdk::Python, "sdk_soak.py", &["base", "4", "1"][..]),
        (Sdk::Python, "sdk_soak.py", &["base", "2", "2"][..]),
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

    if interp {
        code_interpreter_step("nested_pod", &api, &log, serve, started);
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

    // A restart of serve (kill -9) keeps the nested host and its
    // sandboxes, running and hibernated, with their tenant, envd token and
    // environment.
    drop(_show);
    let (mut second, api, log) = restart_keeps_the_nested_pod(first, &api, &data.0, &pod);
    let _show = ShowLogOnPanic(log);
    let serve = &mut second.0;

    ok(&cli(&api, &["sandbox", "rm", &sbx], step), "sandbox rm");
    let gone = ok(&cli(&api, &["sandbox", "get", &sbx], step), "get");
    assert!(
        gone.lines()
            .any(|l| l.starts_with("state") && l.contains("deleted")),
        "{gone}"
    );

    // kill -9 of serve leaves the nested host running (above); serve with
    // --no-nested-pod stops it: its forwarded port closes.
    let text = std::fs::read_to_string(&_show.0).unwrap();
    // The first line naming it is "re-attaching ... at tls:127.0.0.1:PORT)":
    // the port is the digits only.
    let port: u16 = text
        .lines()
        .find_map(|l| l.split(" at tls:127.0.0.1:").nth(1))
        .map(|r| {
            r.chars()
                .take_while(char::is_ascii_digit)
                .collect::<String>()
        })
        .and_then(|digits| digits.parse().ok())
        .unwrap_or_else(|| panic!("no nested pod address in:\n{text}"));
    let _ = serve.kill();
    let _ = serve.wait();
    assert!(
        std::net::TcpStream::connect(format!("127.0.0.1:{port}")).is_ok(),
        "the nested host died with torpor serve (port {port} closed)"
    );

    // The next serve on the same data directory with --no-nested-pod stops
    // that nested host and never starts one; its pod is gone.
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
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(format!("127.0.0.1:{port}")).is_ok() {
        assert!(
            Instant::now() < deadline,
            "serve --no-nested-pod left the nested host running (port {port} still open)"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
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

/// kill -9 of serve with a running and a hibernated Linux sandbox of a
/// tenant (a file written, an env var set at create, an envd token); serve
/// started again on the same data directory re-attaches to the same
/// nested host and pod, and both sandboxes answer with all of it: the
/// file (through envd, with the same token), the env var, the tenant's
/// ownership (another tenant gets 404). The new serve, its API and log.
fn restart_keeps_the_nested_pod(
    mut serve: KillOnDrop,
    api: &str,
    dir: &Path,
    pod: &str,
) -> (KillOnDrop, String, std::path::PathBuf) {
    use common::http::{request, request_with};
    let addr = api.trim_start_matches("http://").to_string();
    let tenant = |name: &str| {
        let r = request(
            &addr,
            "POST",
            "/v1/tokens",
            Some(TOKEN),
            Some(&format!(r#"{{"tenant":"{name}"}}"#)),
        );
        assert_eq!(r.status, 201, "{}", r.body);
        r.json()["token"].as_str().unwrap().to_string()
    };
    let (acme, bravo) = (tenant("acme"), tenant("bravo"));
    let step = Duration::from_secs(600);
    let mut made = Vec::new();
    for n in 0..2 {
        let body = r#"{"templateID":"base","secure":true,"envVars":{"GREETING":"hello-restart"}}"#;
        let r = request_with(
            &addr,
            "POST",
            "/sandboxes",
            &[("X-API-KEY", &acme)],
            Some(body),
        );
        assert_eq!(r.status, 201, "{}", r.body);
        let id = r.json()["sandboxID"].as_str().unwrap().to_string();
        let envd = r.json()["envdAccessToken"].as_str().unwrap().to_string();
        let write = format!("echo kept-{n} > /home/user/kept");
        ok(
            &cli(
                api,
                &["sandbox", "exec", &id, "--", "sh", "-c", &write],
                step,
            ),
            "write a file",
        );
        made.push((id, envd, format!("kept-{n}\n")));
    }
    ok(
        &cli(api, &["sandbox", "hibernate", &made[1].0], step),
        "hibernate",
    );

    let _ = serve.0.kill();
    let _ = serve.0.wait();
    let log = dir.join("serve-restarted.log");
    let log_file = std::fs::File::create(&log).unwrap();
    let mut serve = KillOnDrop(
        serve_command(&dir.join("data"))
            .args(["--request-timeout-ms", "900000"])
            .env("TORPOR_NESTED_ECHO", "1")
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().unwrap())
            .stderr(log_file)
            .spawn()
            .expect("spawn torpor serve again"),
    );
    let _show = ShowLogOnPanic(log.clone());
    let api = listening_api(&log, &mut serve.0);
    let addr = api.trim_start_matches("http://").to_string();
    wait_line(&log, &mut serve.0, Duration::from_secs(60), |l| {
        l.contains("re-attaching to the nested host")
    });
    let ready = wait_line(&log, &mut serve.0, Duration::from_secs(300), |l| {
        l.contains("Linux templates run in the nested host (pod ")
    });
    assert!(ready.contains(pod), "another pod: {ready}");

    for (id, envd, content) in &made {
        // The file through envd, with the token issued before the restart
        // (the hibernated sandbox wakes for it).
        let file = "/files?path=/home/user/kept";
        let r = request_with(
            &addr,
            "GET",
            file,
            &[("E2b-Sandbox-Id", id), ("X-Access-Token", envd)],
            None,
        );
        assert_eq!((r.status, r.body.as_str()), (200, content.as_str()), "{id}");
        let wrong = request_with(
            &addr,
            "GET",
            file,
            &[("E2b-Sandbox-Id", id), ("X-Access-Token", "not-the-token")],
            None,
        );
        assert_eq!(wrong.status, 401, "{}", wrong.body);
        let env = cli(
            &api,
            &["sandbox", "exec", id, "--", "sh", "-c", "echo $GREETING"],
            step,
        );
        assert_eq!(ok(&env, "exec echo $GREETING"), "hello-restart\n");
        // Still acme's: bravo does not see it.
        let path = format!("/sandboxes/{id}");
        let mine = request_with(&addr, "GET", &path, &[("X-API-KEY", &acme)], None);
        assert_eq!(mine.status, 200, "{}", mine.body);
        let theirs = request_with(&addr, "GET", &path, &[("X-API-KEY", &bravo)], None);
        assert_eq!(theirs.status, 404, "{}", theirs.body);
        ok(&cli(&api, &["sandbox", "rm", id], step), "sandbox rm");
    }
    (serve, api, log)
}
