//! The federation over the fake service: a "remote pod" (the API over one
//! fake, on loopback) registered with a central API (a federation over
//! another fake). Exec streams, raw file bodies and their headers, and error
//! answers are relayed through the central API as the pod gave them.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{Fake, Server, TOKEN};
use serde_json::{json, Value};
use torpor_api::federation::Federation;

struct Pair {
    pod: Server,
    central: Server,
    pod_id: String,
    _dir: tempfile::TempDir,
}

async fn pair() -> Pair {
    pair_with(Duration::from_secs(20)).await
}

/// `io_timeout`: how long the central waits for the pod.
async fn pair_with(io_timeout: Duration) -> Pair {
    let dir = tempfile::tempdir().unwrap();
    let pod = Server::start().await;
    let local = Arc::new(Fake::new());
    let federation = Federation::open(Arc::clone(&local), dir.path(), io_timeout).unwrap();
    let central = Server::start_over(federation, local, Server::config()).await;
    let r = central
        .call(
            "POST",
            "/v1/pods",
            Some(json!({"address": format!("tcp:{}", pod.addr), "token": TOKEN})),
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    let pod_id = r.json()["id"].as_str().unwrap().to_string();
    Pair {
        pod,
        central,
        pod_id,
        _dir: dir,
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_alone_refuses_registration() {
    let server = Server::start().await;
    server
        .call(
            "POST",
            "/v1/pods",
            Some(json!({"address": "unix:/x.sock", "token": "t"})),
        )
        .await
        .assert_error(501, "unsupported");
    server
        .call("DELETE", "/v1/pods/pod_x", None)
        .await
        .assert_error(501, "unsupported");
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

/// A template marked as coming (the nested pod's `linux` while it boots)
/// answers 503 `unavailable` with the reason; once marked there, placement
/// goes on as usual (here: no pod has it, 404).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coming_template_answers_503_until_it_is_there() {
    let dir = tempfile::tempdir().unwrap();
    let local = Arc::new(Fake::new());
    let federation =
        Federation::open(Arc::clone(&local), dir.path(), Duration::from_secs(20)).unwrap();
    federation.template_coming("linux", Some("the nested host is still booting".into()));
    let central = Server::start_over(Arc::clone(&federation), local, Server::config()).await;
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
    federation.template_coming("linux", None);
    let r = central.call("POST", "/v1/sandboxes", Some(create)).await;
    assert_eq!(r.status, 404, "{}", r.text());
}
