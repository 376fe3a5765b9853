//! Exec, files and Linux templates against a real `torpor serve` on this
//! host: a probe sandbox has no agent (422 `no_agent`, and a hibernated one
//! is not woken for nothing), bad exec bodies and exec timeouts past
//! `--exec-timeout-ms` are 400, and Linux templates
//! are refused where doctor says the host has no VMX/SVM (PVM) — or, on a
//! host with them, get as far as checking their paths. The real guest path
//! runs in the nested host (`nested/tests/nested_service.rs`).

mod common;

use common::http::{request, HttpResponse};
use common::serve::{DataDir, ServeProcess};
use serde_json::Value;
use torpor_vmm::doctor::{self, Verdict, VirtKind};

const TOKEN: &str = "guest-test-token";

fn call(s: &ServeProcess, method: &str, path: &str, body: Option<&str>) -> HttpResponse {
    request(&s.addr, method, path, Some(TOKEN), body)
}

/// The error body of a response that must have `status` and `code`.
fn error(r: &HttpResponse, status: u16, code: &str) -> Value {
    assert_eq!(r.status, status, "{}", r.body);
    let v = r.json();
    assert_eq!(v["error"]["code"], code, "{v}");
    v["error"].clone()
}

fn start(name: &str) -> (DataDir, ServeProcess) {
    let data = DataDir::new(name);
    let serve = ServeProcess::start(&data.0, &["--token", TOKEN, "--policy-interval-ms", "0"]);
    (data, serve)
}

fn probe_sandbox(s: &ServeProcess) -> String {
    let r = call(s, "POST", "/v1/sandboxes", Some(r#"{"template":"probe"}"#));
    assert_eq!(r.status, 201, "{}", r.body);
    r.json()["id"].as_str().unwrap().to_string()
}

#[test]
fn probe_sandboxes_have_no_agent() {
    let (_data, s) = start("guest-noagent");
    let id = probe_sandbox(&s);
    let exec = format!("/v1/sandboxes/{id}/exec");
    let body = Some(r#"{"argv":["echo","hi"]}"#);
    for (method, path, body) in [
        ("POST", exec.clone(), body),
        ("POST", format!("{exec}/stream"), body),
        (
            "GET",
            format!("/v1/sandboxes/{id}/files?path=/etc/hostname"),
            None,
        ),
        ("GET", format!("/v1/sandboxes/{id}/files/list?path=/"), None),
    ] {
        let e = error(&call(&s, method, &path, body), 422, "no_agent");
        let message = e["message"].as_str().unwrap();
        assert!(
            message.contains(&id) && message.contains("probe") && message.contains("Linux"),
            "{message}"
        );
    }
    // A hibernated probe sandbox is not woken only to be refused.
    let r = call(&s, "POST", &format!("/v1/sandboxes/{id}/hibernate"), None);
    assert_eq!(r.status, 200, "{}", r.body);
    error(&call(&s, "POST", &exec, body), 422, "no_agent");
    let r = call(&s, "GET", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(r.json()["state"], "hibernated");
    // Unknown sandboxes are 404 before anything else.
    error(
        &call(&s, "POST", "/v1/sandboxes/sbx_0000000000000000/exec", body),
        404,
        "not_found",
    );
}

#[test]
fn bad_exec_bodies_and_paths_are_400() {
    let (_data, s) = start("guest-bad");
    let id = probe_sandbox(&s);
    for path in [
        format!("/v1/sandboxes/{id}/exec"),
        format!("/v1/sandboxes/{id}/exec/stream"),
    ] {
        for bad in [
            r#"{"argv":[]}"#,
            r#"{"argv":[""]}"#,
            r#"{"argv":["cat"],"stdin_base64":"***"}"#,
            r#"{"argv":["cat"],"stdin":"a","stdin_base64":"YQ=="}"#,
            r#"{"argv":["cat"],"max_output_bytes":999999999}"#,
            r#"{"argv":"echo hi"}"#,
            r#"{"cmd":["true"]}"#,
        ] {
            let e = error(&call(&s, "POST", &path, Some(bad)), 400, "invalid_request");
            assert!(!e["message"].as_str().unwrap().is_empty(), "{bad}");
        }
    }
    for query in ["", "?path=etc/hostname", "?path=/x&mode=1234567"] {
        let r = call(&s, "GET", &format!("/v1/sandboxes/{id}/files{query}"), None);
        error(&r, 400, "invalid_request");
    }
}

/// `--exec-timeout-ms` bounds what an exec may ask for (checked before
/// the sandbox's kind, so a probe sandbox shows it); the default run of the
/// limit on a real agent is in `serve_service.rs`.
#[test]
fn exec_timeouts_past_the_services_limit_are_400() {
    let data = DataDir::new("guest-exec-limit");
    let s = ServeProcess::start(
        &data.0,
        &[
            "--token",
            TOKEN,
            "--policy-interval-ms",
            "0",
            "--exec-timeout-ms",
            "1500",
        ],
    );
    let id = probe_sandbox(&s);
    for path in [
        format!("/v1/sandboxes/{id}/exec"),
        format!("/v1/sandboxes/{id}/exec/stream"),
    ] {
        let body = Some(r#"{"argv":["true"],"timeout_ms":1501}"#);
        let e = error(&call(&s, "POST", &path, body), 400, "invalid_request");
        let message = e["message"].as_str().unwrap();
        assert!(message.contains("1500 ms"), "{message}");
        // Within the limit the request goes on (to the missing agent).
        let body = Some(r#"{"argv":["true"],"timeout_ms":1500}"#);
        error(&call(&s, "POST", &path, body), 422, "no_agent");
    }
}

#[test]
fn linux_templates_need_hardware_virtualization() {
    let report = doctor::run();
    let (data, s) = start("guest-linux");
    let body = r#"{"name":"deb","kind":"linux","image":"deb","mem_mib":512}"#;
    if report.verdict() == Verdict::ProbeOnly {
        // An installed image (never booted here): the refusal is the host's.
        let image = data.0.join("images/deb");
        std::fs::create_dir_all(&image).unwrap();
        std::fs::write(image.join("vmlinux"), b"not booted").unwrap();
        std::fs::write(image.join("rootfs.ext4"), b"not booted").unwrap();
    }
    let r = call(&s, "POST", "/v1/templates", Some(body));
    match report.verdict() {
        Verdict::ProbeOnly => {
            let e = error(&r, 422, "host_unsupported");
            let message = e["message"].as_str().unwrap();
            assert!(message.contains("VMX/SVM"), "{message}");
            assert!(message.contains("scripts/nested-host"), "{message}");
            if report.virtualization.kind == VirtKind::Pvm {
                assert!(message.contains("PVM"), "{message}");
            }
        }
        // With VMX/SVM the refusal must not happen: the request gets as far
        // as checking the image (not installed).
        Verdict::LinuxAndProbe => {
            let e = error(&r, 400, "invalid_request");
            assert!(e["message"].as_str().unwrap().contains("image deb"), "{e}");
        }
        Verdict::None => panic!("KVM is unusable here: {}", report.summary),
    }
    // Nothing was registered either way.
    let list = call(&s, "GET", "/v1/templates", None).json();
    let names: Vec<&str> = list["templates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["probe"]);
}
