//! The main API over TLS: `torpor serve --tls` serves a self-signed
//! certificate whose fingerprint it prints, a CLI that pins it gets
//! answers, one that pins another refuses the server, and plain HTTP to the
//! TLS listener gets no answer. (Pods over TLS: the nested pod in
//! `api/tests/http_nested.rs`, a cluster's in `tests/cluster_templates.rs`.)

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;

mod common;

use common::serve::{DataDir, ServeProcess};
use common::{succeeded, TORPOR};

const TOKEN: &str = "central-tls-token-0123456789";

#[test]
fn the_api_serves_tls_to_a_client_that_pins_it() {
    let data = DataDir::new("api-tls");
    let serve = ServeProcess::start(
        &data.0.join("central"),
        &["--token", TOKEN, "--policy-interval-ms", "0", "--tls"],
    );
    let fingerprint = serve
        .stdout_line("certificate fingerprint ")
        .expect("serve --tls printed no fingerprint");
    let api = format!("https://{}", serve.addr);
    let cli = |pin: &str| {
        Command::new(TORPOR)
            .args([
                "template", "list", "--json", "--api", &api, "--token", TOKEN,
            ])
            .args(["--api-fingerprint", pin])
            .env_remove("TORPOR_API")
            .env_remove("TORPOR_TOKEN")
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    let ok = cli(&fingerprint);
    let v: Value = serde_json::from_str(&succeeded(&ok)).unwrap();
    assert!(v["templates"].as_array().is_some(), "{v}");
    let wrong = cli(&"ab".repeat(32));
    assert!(!wrong.status.success());
    let err = String::from_utf8_lossy(&wrong.stderr);
    assert!(err.contains("not the pinned"), "{err}");
    // Plain HTTP to the TLS listener gets no API answer.
    let mut s = TcpStream::connect(&serve.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut back = Vec::new();
    let _ = s.read_to_end(&mut back);
    assert!(!String::from_utf8_lossy(&back).contains("200 OK"));
}

/// `serve --proxy-listen --proxy-tls`: guest ports on a listener of their
/// own, over TLS with a self-signed `*.DOMAIN` certificate whose
/// fingerprint is printed; `{port}-{id}.DOMAIN` is routed there (a probe
/// sandbox has no agent: its ports are not open; an unknown id is not
/// found), and create answers carry the domain.
#[test]
fn guest_ports_listen_over_tls_for_their_domain() {
    let data = DataDir::new("proxy-tls");
    let serve = ServeProcess::start(
        &data.0.join("central"),
        &[
            "--token",
            TOKEN,
            "--policy-interval-ms",
            "0",
            "--proxy-domain",
            "sbx.test",
            "--proxy-listen",
            "127.0.0.1:0",
            "--proxy-tls",
        ],
    );
    let fingerprint = serve
        .stdout_line("guest ports: TLS certificate fingerprint ")
        .expect("no fingerprint printed for the guest ports");
    let proxy = serve
        .stdout_line("guest ports on https://")
        .expect("no guest-port listener printed");
    let proxy = proxy.split_whitespace().next().unwrap().to_string();
    let pin = torpor_client::pin::Fingerprint::parse(&fingerprint).unwrap();
    let created = common::http::request_with(
        &serve.addr,
        "POST",
        "/v2/sandboxes",
        &[("X-API-KEY", TOKEN), ("Content-Type", "application/json")],
        Some(r#"{"templateID":"probe"}"#),
    );
    assert_eq!(created.status, 201, "{}", created.body);
    let created: Value = serde_json::from_str(&created.body).unwrap();
    assert_eq!(created["domain"], "sbx.test", "{created}");
    let id = created["sandboxID"].as_str().unwrap();
    let get = |host: &str| {
        let endpoint = torpor_client::Endpoint::parse(&format!("https://{proxy}")).unwrap();
        let client = torpor_client::HttpClient::new(endpoint, None, Duration::from_secs(30))
            .unwrap()
            .pinned(Some(pin))
            .with_headers(&[("Host", host), ("X-API-KEY", TOKEN)]);
        let answer = client.request("GET", "/", None, None).unwrap();
        let v: Value = serde_json::from_slice(&answer.body).unwrap();
        (answer.status, v)
    };
    let (status, v) = get(&format!("8000-{id}.sbx.test"));
    assert_eq!(status, 502, "{v}");
    assert_eq!(v["message"], "The sandbox is running but port is not open");
    let (status, v) = get("8000-sbx_0123456789abcdef.sbx.test");
    assert_eq!(status, 502, "{v}");
    assert_eq!(v["message"], "The sandbox was not found");
}
