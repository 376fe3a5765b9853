//! A hostile pod behind `torpor serve` (its nested pod's place): a pod of
//! our own making, attached like the nested pod, that answers creates with
//! another pod's sandbox id or garbage. Nothing it claims is recorded; a
//! tenant's sandbox placed on it is routed there for that tenant only; a
//! body past the limit to a relayed route is refused without being
//! buffered and never reaches the pod. Alone in its test binary: it
//! measures this process's peak memory.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{Fake, Server, TOKEN};
use serde_json::{json, Value};
use torpor_api::auth::tokens::TenantsFile;
use torpor_api::auth::Scope;
use torpor_api::nested::Nested;
use torpor_api::ApiConfig;

const ACME: &str = "acme-token-0123456789abcdef";
const BRAVO: &str = "bravo-token-0123456789abcdef";

/// Answers like `torpor pod serve` with unlimited headroom and the `probe`
/// template; a create answers `sandbox_id`. Records each request line.
struct RoguePod {
    addr: String,
    sandbox_id: Arc<Mutex<String>>,
    seen: Arc<Mutex<Vec<String>>>,
}

fn sandbox_json(id: &str) -> Value {
    json!({"id": id, "template": "tpl_0123456789abcdef", "pod": "pod_local", "mem_mib": 64,
           "vcpus": 1, "keep_alive_ms": 1000, "expires_at": null, "metadata": {},
           "state": "running", "failure_reason": null, "created_at": 1, "last_active_at": 1,
           "snapshot": null, "vmm": null, "generation": 1})
}

impl RoguePod {
    fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let sandbox_id = Arc::new(Mutex::new(String::new()));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (id, log) = (Arc::clone(&sandbox_id), Arc::clone(&seen));
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let (id, log) = (Arc::clone(&id), Arc::clone(&log));
                std::thread::spawn(move || serve_rogue(stream, &id, &log));
            }
        });
        RoguePod {
            addr,
            sandbox_id,
            seen,
        }
    }

    fn claim(&self, id: &str) {
        *self.sandbox_id.lock().unwrap() = id.to_string();
    }

    fn seen(&self) -> Vec<String> {
        self.seen.lock().unwrap().clone()
    }
}

fn serve_rogue(stream: TcpStream, id: &Mutex<String>, seen: &Mutex<Vec<String>>) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let mut parts = line.split_whitespace();
        let method = parts.next().unwrap_or_default().to_string();
        let path = parts.next().unwrap_or_default().to_string();
        let mut length = 0usize;
        loop {
            let mut h = String::new();
            if reader.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            if h == "\r\n" {
                break;
            }
            if let Some((n, v)) = h.split_once(':') {
                if n.eq_ignore_ascii_case("content-length") {
                    length = v.trim().parse().unwrap_or(0);
                }
            }
        }
        let mut body = vec![0u8; length.min(1 << 20)];
        let _ = reader.read_exact(&mut body);
        seen.lock().unwrap().push(format!("{method} {path}"));
        let now = id.lock().unwrap().clone();
        let answer = match (method.as_str(), path.split('?').next().unwrap_or_default()) {
            ("GET", "/v1/pods") => {
                json!({"pods": [{"id": "pod_local", "address": {"kind": "local"},
                "memory_bytes": 1u64 << 50, "vcpus": 64, "disk_bytes": 0,
                "oversubscription_ratio": 100.0, "high_watermark": 0.9, "created_at": 1,
                "committed_mib": 0, "pss_mib": 0.0, "sandboxes": {}}]})
            }
            ("GET", "/v1/templates") => json!({"templates": [{"id": "tpl_0123456789abcdef",
                "name": "probe", "kernel": "builtin:probe", "mem_mib": 64, "vcpus": 1,
                "kind": "probe", "created_at": 1, "state": "ready"}]}),
            ("GET", "/v1/sandboxes") => json!({"sandboxes": []}),
            ("POST", "/v1/sandboxes") | ("GET", _) => sandbox_json(&now),
            _ => json!({"error": {"code": "invalid_request", "message": "rogue pod"}}),
        };
        let status = if method == "POST" {
            "201 Created"
        } else {
            "200 OK"
        };
        let text = answer.to_string();
        let reply = format!(
            "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{text}",
            text.len()
        );
        if (&stream).write_all(reply.as_bytes()).is_err() {
            return;
        }
    }
}

/// This process's peak resident memory, KiB.
fn hwm_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    torpor_vmm_api::host::kib_field(&status, "VmHWM").unwrap()
}

/// `PUT path` with a chunked body of `total` bytes, written by a thread
/// while the answer is read; the answer's status and how much was sent.
fn chunked_put(addr: &str, token: &str, path: &str, total: usize) -> (u16, usize) {
    let stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    stream
        .set_write_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut writer = stream.try_clone().unwrap();
    let head = format!(
        "PUT {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\n\
         Content-Type: application/octet-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    );
    writer.write_all(head.as_bytes()).unwrap();
    let sender = std::thread::spawn(move || {
        let chunk = vec![b'x'; 1 << 20];
        let mut sent = 0;
        while sent < total {
            let frame = [format!("{:x}\r\n", chunk.len()).as_bytes(), &chunk, b"\r\n"].concat();
            if writer.write_all(&frame).is_err() {
                break;
            }
            sent += chunk.len();
        }
        let _ = writer.write_all(b"0\r\n\r\n");
        sent
    });
    let mut reader = BufReader::new(stream);
    let mut status_line = String::new();
    reader.read_line(&mut status_line).unwrap();
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status: {status_line:?}"));
    drop(reader);
    (status, sender.join().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rogue_pod_claims_nothing_and_gets_no_oversized_body() {
    let scratch = tempfile::tempdir().unwrap();
    let tenants = scratch.path().join("tenants.json");
    let mut file = TenantsFile::default();
    file.import("acme", Scope::Tenant, ACME).unwrap();
    file.import("bravo", Scope::Tenant, BRAVO).unwrap();
    file.save(&tenants).unwrap();
    let local = Arc::new(Fake::new());
    let nested = Nested::new(Arc::clone(&local), Duration::from_secs(20));
    let config = ApiConfig {
        tenants_file: Some(tenants),
        ..Server::config()
    };
    let s = Server::start_over(Arc::clone(&nested), local, config).await;
    let call = |token: &'static str, method: &'static str, path: String, body: Option<Value>| {
        let headers = vec![
            ("Authorization", format!("Bearer {token}")),
            ("Content-Type", "application/json".to_string()),
        ];
        let body = body.map(|b| b.to_string());
        let s = &s;
        async move {
            let body = body.as_deref().map(str::as_bytes);
            s.request(method, &path, &headers, body).await
        }
    };
    // A sandbox of the local pod, the only one so far.
    let any = || Some(json!({"template": "probe"}));
    let r = call(ACME, "POST", "/v1/sandboxes".into(), any()).await;
    assert_eq!(r.status, 201, "{}", r.text());
    let local_id = r.json()["id"].as_str().unwrap().to_string();
    let rogue = RoguePod::start();
    let address = format!("tcp:{}", rogue.addr);
    let entry = tokio::task::spawn_blocking(move || nested.attach(&address, "t", None))
        .await
        .unwrap()
        .unwrap();
    let pod_id = entry["id"].as_str().unwrap().to_string();

    // The pod answers creates with an existing sandbox's id, or garbage:
    // refused, never recorded; the local sandbox stays the local pod's.
    for claimed in [local_id.as_str(), "../../etc/passwd", "sbx_XYZ"] {
        rogue.claim(claimed);
        let pinned = Some(json!({"template": "probe", "pod": pod_id}));
        let r = call(TOKEN, "POST", "/v1/sandboxes".into(), pinned).await;
        assert_eq!(r.status, 502, "{claimed}: {}", r.text());
        assert!(!r.text().contains("passwd"), "{}", r.text());
        let got = call(ACME, "GET", format!("/v1/sandboxes/{local_id}"), None).await;
        let got = got.json();
        assert_eq!(
            (got["pod"].as_str(), got["state"].as_str()),
            (Some("pod_local"), Some("running")),
            "{got}"
        );
    }
    // Only admins pin pods.
    let pinned = Some(json!({"template": "probe", "pod": pod_id}));
    let r = call(ACME, "POST", "/v1/sandboxes".into(), pinned).await;
    assert_eq!(r.status, 403, "{}", r.text());

    // A tenant's sandbox placed on the pod (it claims the most headroom):
    // routed there for its tenant, 404 for another.
    let fresh = "sbx_00000000000000ff";
    rogue.claim(fresh);
    let placed = call(ACME, "POST", "/v1/sandboxes".into(), any())
        .await
        .json();
    assert_eq!(
        (placed["id"].as_str(), placed["pod"].as_str()),
        (Some(fresh), Some(pod_id.as_str())),
        "{placed}"
    );
    let path = format!("/v1/sandboxes/{fresh}");
    assert_eq!(call(BRAVO, "GET", path.clone(), None).await.status, 404);
    assert_eq!(call(ACME, "GET", path, None).await.json()["id"], fresh);
    let listed = call(BRAVO, "GET", "/v1/sandboxes".into(), None)
        .await
        .json();
    assert_eq!(listed["sandboxes"], json!([]), "{listed}");

    // 64 MiB chunked to a relayed route: 413 once past the limit, not
    // buffered (this process's peak memory does not grow by the body),
    // never forwarded.
    let before = hwm_kib();
    let (addr, path) = (
        s.addr.to_string(),
        format!("/v1/sandboxes/{fresh}/files?path=/big"),
    );
    let (status, sent) =
        tokio::task::spawn_blocking(move || chunked_put(&addr, ACME, &path, 64 << 20))
            .await
            .unwrap();
    assert_eq!(status, 413);
    let grown = hwm_kib().saturating_sub(before);
    assert!(
        grown < 24 << 10,
        "peak RSS grew by {grown} KiB (sent {sent} bytes)"
    );
    let seen = rogue.seen();
    assert!(!seen.iter().any(|r| r.starts_with("PUT")), "{seen:?}");
}
