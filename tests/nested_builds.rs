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
//!   background, tags; `sdk_template.mjs`: one build and its sandbox);
//! - a guest port of a `base` sandbox reached both ways E2B's SDKs address
//!   one (`tests/e2b/sdk_ports.py`: `E2b-Sandbox-Port` headers and the
//!   `{port}-{id}.{domain}` host name);
//! - a build FROM an OCI image: Debian's `docker-registry` on loopback
//!   (TLS, htpasswd), an image of the Debian tree the nested pod's `base`
//!   was made of (`umoci`, pushed with `skopeo`), pulled with credentials
//!   by serve, made a template in the nested pod, a RUN on it, and a
//!   sandbox of the result started and asked what it is;
//! - the code interpreter (issue 27): `code-interpreter-v1`, which the
//!   nested pod builds after `base` when the interpreter's image is there
//!   (`scripts/setup test` builds it), through the official
//!   e2b-code-interpreter SDKs, Python and JS, with only the E2B
//!   variables set (`tests/e2b/sdk_interp_serve.py`, `.mjs`); left out
//!   with `--skip nested_code_interpreter` (`tests/needs` says when).
//!
//! Needs what tests/nested_pod.rs needs (the nested host, the guest
//! kernel, agent and rootfs: the scripts build them, cached) and the E2B
//! SDKs (`scripts/setup test`); `tests/needs` says what is left out without
//! them.

mod common;
#[path = "../nested/tests/common/linux.rs"]
mod linux;
#[path = "../oci/tests/common/registry.rs"]
mod registry;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::e2b::{run_script, Sdk};
use common::nested_host::StopNestedHost;
use common::nested_serve::{
    cli, code_interpreter_step, interpreter_offered, listening_api, ok, spawn_serve, wait_line,
    ShowLogOnPanic, TOKEN,
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
    // The registry first: serve trusts its CA.
    let reg_dir = data.0.join("registry");
    let registry = registry::start_registry(&reg_dir);
    let ca = reg_dir.join("ca.pem");
    std::fs::write(&ca, registry.ca_pem()).unwrap();
    let log = data.0.join("serve.log");
    let mut serve = spawn_serve(
        &data.0.join("data"),
        &l1,
        &log,
        &[
            "--registry-ca".as_ref(),
            ca.as_os_str(),
            "--registry-allow-private".as_ref(),
            format!("127.0.0.1:{}", registry.port).as_ref(),
        ],
    );
    let serve = &mut serve.0;
    let _show = ShowLogOnPanic(log.clone());
    let api = listening_api(&log, serve);
    let interp = interpreter_offered("nested_builds", &std::fs::read_to_string(&log).unwrap());
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

    // A guest port of a `base` sandbox (`python3 -m http.server`) both
    // ways the SDKs address one: E2B's headers and `{port}-{id}.{domain}`.
    let t = Instant::now();
    run_script(
        Sdk::Python,
        "sdk_ports.py",
        &["/tmp"],
        &api,
        TOKEN,
        &base,
        step,
    );
    eprintln!(
        "nested_builds: sdk_ports.py passed in {:.0}s",
        t.elapsed().as_secs_f64()
    );

    oci_step(&api, &data.0, &registry);
    if interp {
        code_interpreter_step("nested_builds", &api, &log, serve, started);
    }
}

/// The Debian tree `base` was made of (scripts/build-rootfs's cache).
fn debian_tree() -> std::path::PathBuf {
    let out = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/build-rootfs"))
        .arg("--dry-run")
        .output()
        .expect("scripts/build-rootfs --dry-run");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix("base tree: "))
        .unwrap_or_else(|| panic!("no base tree in:\n{text}"));
    let (path, state) = line.rsplit_once(' ').unwrap();
    assert_eq!(
        state, "(cached)",
        "the nested pod built base from it: {line}"
    );
    std::path::PathBuf::from(path)
}

/// An OCI image (layout `dir/debian`, tag bookworm) of the Debian tree,
/// made with umoci; its layout reference.
fn debian_image(dir: &Path) -> String {
    let umoci = registry::tool("umoci");
    let limit = Duration::from_secs(600);
    let layout = dir.join("debian");
    let image = format!("{}:bookworm", layout.display());
    let bundle = dir.join("debian-bundle");
    registry::run(
        Command::new(&umoci)
            .arg("init")
            .arg("--layout")
            .arg(&layout),
        limit,
    );
    registry::run(Command::new(&umoci).args(["new", "--image", &image]), limit);
    registry::run(
        Command::new(&umoci)
            .args(["unpack", "--image", &image])
            .arg(&bundle),
        limit,
    );
    registry::run(
        Command::new("cp")
            .arg("-a")
            .arg(format!("{}/.", debian_tree().display()))
            .arg(bundle.join("rootfs")),
        limit,
    );
    registry::run(
        Command::new(&umoci)
            .args(["repack", "--image", &image])
            .arg(&bundle),
        limit,
    );
    format!("oci:{image}")
}

/// A build FROM the image in the loopback registry, with credentials;
/// a sandbox of it runs and says what it is.
fn oci_step(api: &str, dir: &Path, registry: &registry::Registry) {
    let t = Instant::now();
    let image = debian_image(dir);
    registry.push(dir, &image, "torpor/debian:bookworm");
    eprintln!(
        "nested_builds: the OCI image made and pushed in {:.0}s",
        t.elapsed().as_secs_f64()
    );
    let addr = api.trim_start_matches("http://");
    let body = serde_json::json!({
        "name": "from-oci",
        "from": {
            "type": "image",
            "reference": registry.reference("torpor/debian:bookworm"),
            "username": registry::USER,
            "password": registry::PASSWORD,
        },
        "steps": [{"type": "run", "cmd": "echo built-on-the-image > /home/user/oci.txt"}],
    });
    let t = Instant::now();
    let r = common::http::request(
        addr,
        "POST",
        "/v1/builds",
        Some(TOKEN),
        Some(&body.to_string()),
    );
    assert_eq!(r.status, 202, "{}", r.body);
    let id = r.json()["id"].as_str().unwrap().to_string();
    let deadline = Instant::now() + Duration::from_secs(1500);
    let done = loop {
        let r = common::http::request(addr, "GET", &format!("/v1/builds/{id}"), Some(TOKEN), None);
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        match v["status"].as_str() {
            Some("ready") => break v,
            Some("error" | "cancelled") => panic!("the OCI build failed: {v:#}"),
            _ => {}
        }
        assert!(
            Instant::now() < deadline,
            "the OCI build is still going: {v:#}"
        );
        std::thread::sleep(Duration::from_secs(2));
    };
    let logs: Vec<&str> = done["logs"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["message"].as_str())
        .collect();
    assert!(logs.iter().any(|l| l.contains("pull")), "{logs:#?}");
    println!("NESTED-OCI-BUILD s={:.1}", t.elapsed().as_secs_f64());
    let step = Duration::from_secs(1200);
    let sbx = ok(
        &cli(api, &["sandbox", "create", "--template", "from-oci"], step),
        "sandbox create from the OCI build",
    )
    .trim()
    .to_string();
    let said = cli(
        api,
        &[
            "sandbox",
            "exec",
            &sbx,
            "--",
            "sh",
            "-c",
            "cat /home/user/oci.txt /etc/debian_version; id -un",
        ],
        step,
    );
    let said = ok(&said, "exec in the OCI template's sandbox");
    let lines: Vec<&str> = said.lines().collect();
    assert_eq!(lines.first(), Some(&"built-on-the-image"), "{said}");
    assert!(
        lines.get(1).is_some_and(|v| v.starts_with("12")),
        "bookworm: {said}"
    );
    ok(&cli(api, &["sandbox", "rm", &sbx], step), "sandbox rm");
}
