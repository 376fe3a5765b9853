//! TLS between servers, as attacks: a pod registered with the wrong
//! certificate fingerprint (or none) is refused; plain TCP is refused off
//! loopback on both sides; a sniffer on the link between `torpor serve`
//! and its pod (a relay this test controls) sees the pod's token and a
//! sandbox's data over plain TCP, and neither over TLS; the main API
//! serves TLS to a CLI that pins its fingerprint.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};

mod common;

use common::http::{request, HttpResponse};
use common::pod::PodProcess;
use common::serve::{DataDir, ServeProcess};
use common::{succeeded, TORPOR};

const TOKEN: &str = "central-tls-token-0123456789";
const POD_TOKEN: &str = "pod-secret-token-4f1e2d3c";
const MARKER: &str = "sandbox-secret-marker-7a6b5c";

fn call(serve: &ServeProcess, method: &str, path: &str, body: Option<Value>) -> HttpResponse {
    let body = body.map(|b| b.to_string());
    request(&serve.addr, method, path, Some(TOKEN), body.as_deref())
}

fn central(data: &std::path::Path) -> ServeProcess {
    ServeProcess::start(
        &data.join("central"),
        &["--token", TOKEN, "--policy-interval-ms", "0"],
    )
}

/// A TCP relay to `target` that records every byte both ways; stops when
/// dropped.
struct Sniffer {
    port: u16,
    seen: Arc<Mutex<Vec<u8>>>,
    stop: Arc<AtomicBool>,
}

impl Sniffer {
    fn new(target: &str) -> Sniffer {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (target, s, st) = (target.to_string(), seen.clone(), stop.clone());
        std::thread::spawn(move || {
            while !st.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((client, _)) => {
                        client.set_nonblocking(false).unwrap();
                        let server = TcpStream::connect(&target).unwrap();
                        pipe(client.try_clone().unwrap(), server.try_clone().unwrap(), &s);
                        pipe(server, client, &s);
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        });
        Sniffer { port, seen, stop }
    }

    fn saw(&self, what: &str) -> bool {
        let seen = self.seen.lock().unwrap();
        seen.windows(what.len()).any(|w| w == what.as_bytes())
    }

    fn bytes(&self) -> usize {
        self.seen.lock().unwrap().len()
    }
}

impl Drop for Sniffer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn pipe(mut from: TcpStream, mut to: TcpStream, seen: &Arc<Mutex<Vec<u8>>>) {
    let seen = seen.clone();
    std::thread::spawn(move || {
        let _ = from.set_read_timeout(Some(Duration::from_secs(120)));
        let mut buf = [0u8; 16 << 10];
        while let Ok(n) = from.read(&mut buf) {
            if n == 0 || to.write_all(&buf[..n]).is_err() {
                break;
            }
            seen.lock().unwrap().extend_from_slice(&buf[..n]);
        }
        let _ = to.shutdown(std::net::Shutdown::Write);
    });
}

/// Registers `pod` through a sniffer and makes a sandbox on it with a
/// marker in its metadata; what the sniffer saw.
fn through_sniffer(serve: &ServeProcess, pod: &PodProcess) -> Sniffer {
    let (scheme, port) = pod.address.split_once(":127.0.0.1:").unwrap();
    let sniffer = Sniffer::new(&format!("127.0.0.1:{port}"));
    let address = format!("{scheme}:127.0.0.1:{}", sniffer.port);
    let r = call(
        serve,
        "POST",
        "/v1/pods",
        Some(json!({"address": address, "token": pod.token, "fingerprint": pod.fingerprint})),
    );
    assert_eq!(r.status, 201, "{}", r.body);
    let id = r.json()["id"].as_str().unwrap().to_string();
    let r = call(
        serve,
        "POST",
        "/v1/sandboxes",
        Some(json!({"template": "probe", "pod": id, "metadata": {"m": MARKER}})),
    );
    assert_eq!(r.status, 201, "{}", r.body);
    let sandbox = r.json()["id"].as_str().unwrap().to_string();
    let r = call(serve, "DELETE", &format!("/v1/sandboxes/{sandbox}"), None);
    assert!(r.status < 300, "{}", r.body);
    sniffer
}

#[test]
fn a_sniffer_sees_the_token_over_plain_tcp_and_nothing_over_tls() {
    let data = DataDir::new("pod-tls-sniff");
    let serve = central(&data.0);
    // The control: plain TCP on loopback shows the token and the data, so
    // the sniffer works and the next half can fail.
    let plain = PodProcess::start_plain(&data.0.join("p"), "tcp:127.0.0.1:0", POD_TOKEN);
    assert!(plain.address.starts_with("tcp:"), "{}", plain.address);
    let sniffer = through_sniffer(&serve, &plain);
    assert!(sniffer.saw(POD_TOKEN), "the relay saw no token in clear");
    assert!(sniffer.saw(MARKER));

    let tls = PodProcess::start(&data.0.join("t"), "tcp:127.0.0.1:0", POD_TOKEN);
    assert!(tls.address.starts_with("tls:"), "{}", tls.address);
    assert!(tls.fingerprint.is_some());
    let sniffer = through_sniffer(&serve, &tls);
    assert!(sniffer.bytes() > 1000, "the TLS pod was not reached");
    assert!(!sniffer.saw(POD_TOKEN), "the pod token crossed in clear");
    assert!(
        !sniffer.saw(MARKER),
        "the sandbox's metadata crossed in clear"
    );
    assert!(!sniffer.saw("HTTP/1.1"), "HTTP crossed in clear");
}

#[test]
fn a_pod_with_another_certificate_or_none_is_refused() {
    let data = DataDir::new("pod-tls-pin");
    let serve = central(&data.0);
    let pod = PodProcess::start(&data.0.join("t"), "tcp:127.0.0.1:0", POD_TOKEN);
    let register = |fingerprint: Value| {
        call(
            &serve,
            "POST",
            "/v1/pods",
            Some(json!({"address": pod.address, "token": POD_TOKEN, "fingerprint": fingerprint})),
        )
    };
    // Another pod's identity (a man in the middle would have one).
    let other = PodProcess::start(&data.0.join("o"), "tcp:127.0.0.1:0", "other");
    let wrong = register(json!(other.fingerprint));
    assert_eq!(wrong.status, 400, "{}", wrong.body);
    assert!(wrong.body.contains("TLS verification"), "{}", wrong.body);
    assert!(!wrong.body.contains(POD_TOKEN));
    let none = register(Value::Null);
    assert_eq!(none.status, 400, "{}", none.body);
    assert!(none.body.contains("fingerprint"), "{}", none.body);
    let garbage = register(json!("not-a-fingerprint"));
    assert_eq!(garbage.status, 400, "{}", garbage.body);
    let pods = call(&serve, "GET", "/v1/pods", None).json();
    assert_eq!(pods["pods"].as_array().unwrap().len(), 1, "{pods}");

    let right = register(json!(pod.fingerprint));
    assert_eq!(right.status, 201, "{}", right.body);
    assert_eq!(right.json()["reachable"], true);
}

#[test]
fn plain_tcp_is_refused_off_loopback() {
    let data = DataDir::new("pod-tls-plain");
    let out = Command::new(TORPOR)
        .args(["pod", "serve", "--listen", "tcp:0.0.0.0:0", "--plain-tcp"])
        .arg("--data-dir")
        .arg(data.0.join("pod"))
        .arg("--token-file")
        .arg(data.0.join("token"))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("loopback"), "{err}");

    let serve = central(&data.0);
    let r = call(
        &serve,
        "POST",
        "/v1/pods",
        Some(json!({"address": "tcp:192.0.2.1:7701", "token": "x"})),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("loopback"), "{}", r.body);
}

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
