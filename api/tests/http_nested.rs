//! `torpor serve` over its local pod and a nested pod, with fakes: the
//! nested pod (the API over one fake, on loopback) attached to a central
//! API (a [`Nested`] over another fake). Exec streams, raw file bodies and
//! their headers, and error answers are relayed through the central API as
//! the pod gave them; a pod is attached only with its token and, over TLS,
//! its certificate.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{Fake, Server, TOKEN};
use serde_json::{json, Value};
use torpor_api::nested::Nested;
use torpor_api::tls::{self, Identity};

struct Pair {
    pod: Server,
    central: Server,
    pod_id: String,
    nested: Arc<Nested<common::Fake>>,
}

async fn pair() -> Pair {
    pair_with(Duration::from_secs(20)).await
}

/// `io_timeout`: how long the central waits for the pod.
async fn pair_with(io_timeout: Duration) -> Pair {
    let pod = Server::start().await;
    let local = Arc::new(Fake::new());
    let nested = Nested::new(Arc::clone(&local), io_timeout);
    let address = format!("tcp:{}", pod.addr);
    // The client blocks: off the runtime's threads.
    let attach = || {
        let (nested, address) = (Arc::clone(&nested), address.clone());
        tokio::task::spawn_blocking(move || nested.attach(&address, TOKEN, None))
    };
    let entry = attach().await.unwrap().unwrap();
    assert_eq!(entry["reachable"], true, "{entry}");
    // Once only.
    let again = attach().await.unwrap().unwrap_err();
    assert!(again.to_string().contains("already attached"), "{again}");
    let central = Server::start_over(Arc::clone(&nested), local, Server::config()).await;
    Pair {
        pod,
        central,
        pod_id: entry["id"].as_str().unwrap().to_string(),
        nested,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_stream_and_files_are_relayed_from_the_pod() {
    let p = pair().await;
    let r = p
        .central
        .call(
            "POST",
            "/v1/sandboxes",
            Some(json!({"template": "probe", "pod": p.pod_id, "metadata": {"agent": "fake"}})),
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    let sandbox = r.json();
    assert_eq!(sandbox["pod"], p.pod_id.as_str());
    let id = sandbox["id"].as_str().unwrap().to_string();
    // It is the pod's, not the central's local pod's.
    assert_eq!(p.pod.fake.state.lock().unwrap().sandboxes.len(), 1);
    assert!(p.central.fake.state.lock().unwrap().sandboxes.is_empty());

    let r = p
        .central
        .call(
            "POST",
            &format!("/v1/sandboxes/{id}/exec/stream"),
            Some(json!({"argv": ["echo", "a", "b"]})),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("content-type"), Some("application/x-ndjson"));
    let lines: Vec<Value> = r
        .text()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let types: Vec<&str> = lines.iter().map(|l| l["type"].as_str().unwrap()).collect();
    assert_eq!(
        types,
        ["start", "stdout", "stdout", "stderr", "exit"],
        "{lines:?}"
    );
    assert_eq!(lines[1]["data"], "YQo=");
    assert_eq!(lines[4]["exit_code"], 3);
    p.central
        .call(
            "POST",
            &format!("/v1/sandboxes/{id}/exec/stream"),
            Some(json!({"argv": ["nope"]})),
        )
        .await
        .assert_error(404, "not_found");

    let auth = vec![("Authorization", format!("Bearer {TOKEN}"))];
    let data: Vec<u8> = (0..=255u8).collect();
    let r = p
        .central
        .request(
            "PUT",
            &format!("/v1/sandboxes/{id}/files?path=/work/a.bin&mode=600"),
            &auth,
            Some(&data),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["size"], 256);
    let r = p
        .central
        .call(
            "GET",
            &format!("/v1/sandboxes/{id}/files?path=%2Fwork%2Fa.bin"),
            None,
        )
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.body, data);
    assert_eq!(r.header("content-type"), Some("application/octet-stream"));
    assert_eq!(r.header("x-torpor-resumed"), Some("false"));
    let r = p
        .central
        .call(
            "POST",
            &format!("/v1/sandboxes/{id}/exec"),
            Some(json!({"argv": ["echo", "x"]})),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    // Without the central's token nothing is forwarded.
    let r = p
        .central
        .request("GET", &format!("/v1/sandboxes/{id}"), &[], None)
        .await;
    r.assert_error(401, "unauthorized");

    // Templates merge with their pod; lists merge too.
    let t = p.central.call("GET", "/v1/templates", None).await.json();
    let pods: Vec<&str> = t["templates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["pod"].as_str().unwrap())
        .collect();
    assert_eq!(pods, ["pod_local", p.pod_id.as_str()]);
    let l = p.central.call("GET", "/v1/sandboxes", None).await.json();
    assert_eq!(l["sandboxes"][0]["id"], id.as_str());
    assert_eq!(l["sandboxes"][0]["pod"], p.pod_id.as_str());

    // The pod goes away: 502 pod_unreachable for its sandbox.
    p.pod.shutdown().await.unwrap();
    p.central
        .call("GET", &format!("/v1/sandboxes/{id}"), None)
        .await
        .assert_error(502, "pod_unreachable");
    p.central
        .call(
            "POST",
            &format!("/v1/sandboxes/{id}/exec/stream"),
            Some(json!({"argv": ["echo"]})),
        )
        .await
        .assert_error(502, "pod_unreachable");
}

/// Placement moves on to the nested pod when the local one refuses and
/// answers 429 when every pod does; a nested pod's settings and lists go
/// to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placement_moves_on_to_the_nested_pod_and_its_settings_are_relayed() {
    let p = pair().await;
    let ratio = |r: f64| Some(json!({"oversubscription_ratio": r}));
    let r = p
        .central
        .call("PATCH", "/v1/pods/pod_local", ratio(0.001))
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let create = json!({"template": "probe"});
    let r = p
        .central
        .call("POST", "/v1/sandboxes", Some(create.clone()))
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(r.json()["pod"], p.pod_id.as_str());
    let id = r.json()["id"].as_str().unwrap().to_string();
    let path = format!("/v1/pods/{}", p.pod_id);
    let r = p.central.call("PATCH", &path, ratio(3.5)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["id"], p.pod_id.as_str());
    assert_eq!(
        p.pod.fake.state.lock().unwrap().pod.oversubscription_ratio,
        3.5
    );
    p.central
        .call("PATCH", &path, ratio(-1.0))
        .await
        .assert_error(400, "invalid_request");
    let listed = |r: common::Reply| -> Vec<String> {
        let v = r.json();
        let all = v["sandboxes"].as_array().unwrap().iter();
        all.map(|s| s["id"].as_str().unwrap().to_string()).collect()
    };
    let here = p
        .central
        .call("GET", "/v1/sandboxes?pod=pod_local", None)
        .await;
    assert!(listed(here).is_empty());
    let there = format!("/v1/sandboxes?pod={}", p.pod_id);
    assert_eq!(listed(p.central.call("GET", &there, None).await), [id]);
    p.central.call("PATCH", &path, ratio(0.001)).await;
    let r = p.central.call("POST", "/v1/sandboxes", Some(create)).await;
    r.assert_error(429, "admission_refused");
    assert!(r.text().contains("every pod refused"), "{}", r.text());
}

/// A pod is attached with its token only, over TLS with the certificate
/// it was pinned to only (another pod's certificate is what a man in the
/// middle would have), and over plain TCP on loopback only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_is_attached_with_its_token_and_pinned_certificate_only() {
    let dir = tempfile::tempdir().unwrap();
    let names = tls::default_names();
    let (identity, _) = Identity::load_or_create(&dir.path().join("pod"), &names).unwrap();
    let (other, _) = Identity::load_or_create(&dir.path().join("other"), &names).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let fake = Arc::new(Fake::new());
    let app = torpor_api::Api::new(fake, Server::config()).router();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(async move {
        torpor_api::serve_tls_app(listener, &identity, app, async {
            let _ = stopped.await;
        })
        .await
    });
    let pin = Identity::load_or_create(&dir.path().join("pod"), &names)
        .unwrap()
        .0
        .fingerprint();
    let nested = Nested::new(Arc::new(Fake::new()), Duration::from_secs(10));
    let address = format!("tls:127.0.0.1:{}", addr.port());
    let attach = |token: &'static str, pin| {
        let (nested, address) = (Arc::clone(&nested), address.clone());
        tokio::task::spawn_blocking(move || nested.attach(&address, token, pin))
    };
    let wrong = attach(TOKEN, Some(other.fingerprint())).await.unwrap();
    let e = wrong.unwrap_err().to_string();
    assert!(e.contains("TLS verification"), "{e}");
    assert!(!e.contains(TOKEN), "{e}");
    let none = attach(TOKEN, None).await.unwrap().unwrap_err().to_string();
    assert!(none.contains("fingerprint"), "{none}");
    let bad_token = attach("not-the-token", Some(pin)).await.unwrap();
    let e = bad_token.unwrap_err().to_string();
    assert!(e.contains("refused the token"), "{e}");
    let off_loopback = nested.attach("tcp:192.0.2.1:7701", TOKEN, None);
    let e = off_loopback.unwrap_err().to_string();
    assert!(e.contains("loopback"), "{e}");
    let entry = attach(TOKEN, Some(pin)).await.unwrap().unwrap();
    assert_eq!(entry["reachable"], true, "{entry}");
    let _ = stop.send(());
    served.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_pod_is_listed_unreachable_without_failing_the_lists() {
    let p = pair_with(Duration::from_secs(2)).await;
    let r = p
        .central
        .call(
            "POST",
            "/v1/sandboxes",
            Some(json!({"template": "probe", "pod": "pod_local"})),
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    let addr = p.pod.addr;
    p.pod.shutdown().await.unwrap();
    // Accepts connections (the kernel's backlog) and never answers.
    let _hung = std::net::TcpListener::bind(addr).unwrap();
    let pods = p.central.call("GET", "/v1/pods", None).await;
    assert_eq!(pods.status, 200, "{}", pods.text());
    let v = pods.json();
    assert_eq!(v["pods"][0]["reachable"], true);
    assert_eq!(v["pods"][1]["id"], p.pod_id.as_str());
    assert_eq!(v["pods"][1]["reachable"], false);
    assert!(
        v["pods"][1]["error"]
            .as_str()
            .unwrap()
            .contains("did not answer"),
        "{v}"
    );
    let list = p.central.call("GET", "/v1/sandboxes", None).await;
    assert_eq!(list.status, 200, "{}", list.text());
    assert_eq!(list.json()["sandboxes"].as_array().unwrap().len(), 1);
}

/// The nested host's supervisor asks whether its pod is alive
/// (`Nested::pod_answers`): a pod whose service is busy (here its state
/// held, as a long store write holds a pod's store) still answers, so its
/// host is not taken for dead and restarted; a pod that answers nothing
/// does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_pod_answers_the_supervisor_a_hung_one_does_not() {
    let p = pair_with(Duration::from_secs(2)).await;
    let pod = torpor_scheduler::model::PodId::new(p.pod_id.clone());
    // `busy`: the pod's service state held while asking.
    let ask = |busy: Option<Arc<common::Fake>>| {
        let (nested, pod) = (Arc::clone(&p.nested), pod.clone());
        tokio::task::spawn_blocking(move || {
            let _held = busy.as_ref().map(|f| f.state.lock().unwrap());
            let started = std::time::Instant::now();
            (nested.pod_answers(&pod), started.elapsed())
        })
    };
    let (answer, took) = ask(Some(Arc::clone(&p.pod.fake))).await.unwrap();
    assert!(answer.is_ok(), "{answer:?}");
    assert!(took < Duration::from_secs(5), "{took:?}");
    let addr = p.pod.addr;
    p.pod.shutdown().await.unwrap();
    // Accepts connections (the kernel's backlog) and never answers.
    let _hung = std::net::TcpListener::bind(addr).unwrap();
    let (answer, _) = ask(None).await.unwrap();
    let e = answer.unwrap_err().to_string();
    assert!(e.contains("did not answer"), "{e}");
}

/// A template marked as coming (the nested pod's `linux` while it boots)
/// answers 503 `unavailable` with the reason; once marked there, placement
/// goes on as usual (here: no pod has it, 404).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coming_template_answers_503_until_it_is_there() {
    let local = Arc::new(Fake::new());
    let nested = Nested::new(Arc::clone(&local), Duration::from_secs(20));
    nested.template_coming("linux", Some("the nested host is still booting".into()));
    let central = Server::start_over(Arc::clone(&nested), local, Server::config()).await;
    let create = json!({"template": "linux"});
    let r = central
        .call("POST", "/v1/sandboxes", Some(create.clone()))
        .await;
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "unavailable");
    let message = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(
        message.contains("template linux is not available yet")
            && message.contains("the nested host is still booting"),
        "{message}"
    );
    nested.template_coming("linux", None);
    let r = central.call("POST", "/v1/sandboxes", Some(create)).await;
    assert_eq!(r.status, 404, "{}", r.text());
}
