//! Template builds in real Linux guests (issue 28): the README's `torpor
//! serve` on this host with its nested pod (the Linux template `base` in
//! QEMU/TCG with hardware virtualization inside), and through its API:
//!
//! - `torpor template build -f Dockerfile` (FROM base, ENV, RUN, WORKDIR,
//!   COPY of a context file, CMD `python3 -m http.server` with its EXPOSEd
//!   port as the ready check): a sandbox of the template answers on that
//!   port at once (the server was snapshotted running), with the RUN's
//!   and the COPY's files; the same build again is served from the cache
//!   (the ratio is printed); a Dockerfile whose RUN exits 7 fails naming
//!   the step and the exit code;
//! - E2B's template builder, unchanged (`tests/e2b/sdk_template.py`: build,
//!   logs, exists, a sandbox answering on its start command's port, the
//!   cached rebuild, a failing step with its call site, build in the
//!   background, tags; `sdk_template.mjs`: one build and its sandbox).
//!
//! Needs what tests/nested_pod.rs needs (the nested host, the guest
//! kernel, agent and rootfs: the scripts build them, cached) and the E2B
//! SDKs (`scripts/setup test`); `tests/needs` says what is left out without
//! them.

mod common;
#[path = "../nested/tests/common/linux.rs"]
mod linux;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::e2b::{run_script, Sdk};
use common::nested_serve::{
    cli, listening_api, ok, serve_command, wait_line, KillOnDrop, ShowLogOnPanic, StopNestedHost,
    TOKEN,
};
use common::serve::DataDir;
use common::{stderr, stdout};

const DOCKERFILE: &str = r#"# A web server snapshotted running.
FROM base
ENV GREETING=hello-from-the-build
RUN echo "$GREETING" > /home/user/greeting.txt
WORKDIR /home/user/site
COPY page.html ./
CMD ["python3", "-m", "http.server", "8000"]
EXPOSE 8000
"#;

const FAILING: &str = "FROM base\nRUN echo about to fail && exit 7\n";

/// Fetches the page from inside the sandbox, once, within 2 s.
const FETCH: &str = "import urllib.request; \
     print(urllib.request.urlopen('http://127.0.0.1:8000/page.html', timeout=2).read().decode(), end='')";

#[test]
fn nested_template_builds_from_a_dockerfile_and_the_e2b_sdks() {
    let l1 = linux::script_path("nested-host", &["prepare"]);
    let data = DataDir::new("nested-builds");
    let _stop_l1 = StopNestedHost(data.0.join("data"));
    let log = data.0.join("serve.log");
    let log_file = std::fs::File::create(&log).unwrap();
    let mut serve = KillOnDrop(
        serve_command(&data.0.join("data"))
            .args(["--request-timeout-ms", "900000"])
            .env("TORPOR_NESTED_L1", &l1)
            .env("TORPOR_NESTED_ECHO", "1")
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().unwrap())
            .stderr(log_file)
            .spawn()
            .expect("spawn torpor serve"),
    );
    let serve = &mut serve.0;
    let _show = ShowLogOnPanic(log.clone());
    let api = listening_api(&log, serve);
    let started = Instant::now();
    // The first request for `base` starts the nested pod (503 meanwhile).
    let early = cli(&api, &["template", "get", "base"], Duration::from_secs(60));
    assert!(!early.status.success(), "{}", stdout(&early));
    wait_line(&log, serve, Duration::from_secs(25 * 60), |l| {
        l.contains("Linux templates run in the nested host (pod ")
    });
    eprintln!(
        "nested_builds: base ready after {:.0}s",
        started.elapsed().as_secs_f64()
    );

    let step = Duration::from_secs(1200);
    let context = data.0.join("context");
    std::fs::create_dir_all(&context).unwrap();
    std::fs::write(context.join("Dockerfile"), DOCKERFILE).unwrap();
    std::fs::write(context.join("page.html"), "<p>built by torpor</p>\n").unwrap();
    let ctx = context.to_str().unwrap();
    let build = |name: &str, file: &str| {
        let t = Instant::now();
        let out = cli(
            &api,
            &["template", "build", "-f", file, "--name", name, ctx],
            step,
        );
        (out, t.elapsed().as_secs_f64())
    };
    let dockerfile = format!("{ctx}/Dockerfile");
    let (cold, cold_s) = build("web", &dockerfile);
    let cold_out = ok(&cold, "template build");
    assert!(cold_out.contains("template web (tpl_"), "{cold_out}");

    let sbx = ok(
        &cli(&api, &["sandbox", "create", "--template", "web"], step),
        "sandbox create",
    )
    .trim()
    .to_string();
    let page = cli(
        &api,
        &["sandbox", "exec", &sbx, "--", "python3", "-c", FETCH],
        step,
    );
    assert_eq!(
        ok(&page, "fetch from the start command's server"),
        "<p>built by torpor</p>\n",
        "the start command was not running in the snapshot"
    );
    let greeting = cli(
        &api,
        &[
            "sandbox",
            "exec",
            &sbx,
            "--",
            "cat",
            "/home/user/greeting.txt",
        ],
        step,
    );
    assert_eq!(ok(&greeting, "the RUN's file"), "hello-from-the-build\n");
    ok(&cli(&api, &["sandbox", "rm", &sbx], step), "sandbox rm");

    // The same build again: every layer from the cache.
    let (cached, cached_s) = build("web", &dockerfile);
    let cached_out = ok(&cached, "cached template build");
    assert!(
        cached_out.contains("CACHED RUN echo") && cached_out.contains(" 0 run"),
        "{cached_out}"
    );
    println!(
        "NESTED-BUILD cold_s={cold_s:.1} cached_s={cached_s:.1} ratio={:.3}",
        cached_s / cold_s
    );

    // A failing step: its number, instruction and exit code.
    let failing = format!("{ctx}/Failing.Dockerfile");
    std::fs::write(&failing, FAILING).unwrap();
    let (failed, _) = build("broken", &failing);
    assert!(!failed.status.success(), "{}", stdout(&failed));
    let said = format!("{}{}", stdout(&failed), stderr(&failed));
    assert!(said.contains("exit status 7"), "{said}");
    assert!(said.contains("step 3: RUN echo about to fail"), "{said}");
    assert!(said.contains("exit code 7"), "{said}");

    // E2B's template builder, Python then JS.
    let base = [("E2B_TEST_TEMPLATE", "base")];
    for (sdk, script) in [
        (Sdk::Python, "sdk_template.py"),
        (Sdk::Js, "sdk_template.mjs"),
    ] {
        let t = Instant::now();
        let out = run_script(sdk, script, &[], &api, TOKEN, &base, step);
        if let Some(line) = out.lines().find(|l| l.starts_with("TEMPLATE-CACHE")) {
            println!("nested_builds: {line}");
        }
        eprintln!(
            "nested_builds: {script} passed in {:.0}s",
            t.elapsed().as_secs_f64()
        );
    }
}
