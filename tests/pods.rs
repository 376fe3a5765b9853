//! Remote pods: `torpor pod serve` on a unix socket and over TLS,
//! registered with a `torpor serve` (probe templates). Placement, routing
//! through the central API, merged lists, a ratio change forwarded to its
//! pod, a pod that dies, a central killed -9 in the middle of a create, and
//! `torpor pod add|list|rm`.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

mod common;

use common::http::{request, HttpResponse};
use common::pod::PodProcess;
use common::serve::{DataDir, ServeProcess};
use common::{succeeded, TORPOR};

const TOKEN: &str = "central-token-0123456789";

struct Central {
    serve: ServeProcess,
}

impl Central {
    fn start(data: &std::path::Path, extra: &[&str], env: &[(&str, &str)]) -> Self {
        let mut args = vec!["--token", TOKEN, "--policy-interval-ms", "0"];
        args.extend_from_slice(extra);
        Central {
            serve: ServeProcess::start_with_env(&data.join("central"), &args, env),
        }
    }

    fn call(&self, method: &str, path: &str, body: Option<Value>) -> HttpResponse {
        let body = body.map(|b| b.to_string());
        request(&self.serve.addr, method, path, Some(TOKEN), body.as_deref())
    }

    fn ok(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        self.call(method, path, body).ok_json(method, path)
    }

    fn register(&self, pod: &PodProcess) -> String {
        let r = self.call(
            "POST",
            "/v1/pods",
            Some(
                json!({"address": pod.address, "token": pod.token, "fingerprint": pod.fingerprint}),
            ),
        );
        assert_eq!(r.status, 201, "{}", r.body);
        let v = r.json();
        assert_eq!(v["reachable"], true);
        v["id"].as_str().unwrap().to_string()
    }
}

fn error_code(r: &HttpResponse) -> String {
    r.json()["error"]["code"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

fn ids_and_pods(list: &Value) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = list["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["id"].as_str().unwrap().into(),
                s["pod"].as_str().unwrap().into(),
            )
        })
        .collect();
    v.sort();
    v
}

#[test]
fn unix_and_tcp_pods_are_placed_on_routed_to_and_listed() {
    let data = DataDir::new("pods-route");
    let unix_pod = PodProcess::start_unix(&data.0, "u", "unix-pod-token");
    let mut tcp_pod = PodProcess::start(&data.0.join("t"), "tcp:127.0.0.1:0", "tcp-pod-token");
    let central = Central::start(&data.0, &[], &[]);

    // Refusals store nothing.
    let wrong = central.call(
        "POST",
        "/v1/pods",
        Some(json!({"address": unix_pod.address, "token": "not-it"})),
    );
    assert_eq!(wrong.status, 400, "{}", wrong.body);
    assert!(wrong.body.contains("refused the token"), "{}", wrong.body);
    let gone = central.call(
        "POST",
        "/v1/pods",
        Some(json!({"address": format!("unix:{}", data.0.join("none.sock").display()), "token": "x"})),
    );
    assert_eq!(gone.status, 404, "{}", gone.body);
    assert_eq!(error_code(&gone), "pod_unreachable");
    let bad = central.call(
        "POST",
        "/v1/pods",
        Some(json!({"address": "http://x:1", "token": "x"})),
    );
    assert_eq!(bad.status, 400, "{}", bad.body);
    assert_eq!(
        central.ok("GET", "/v1/pods", None)["pods"]
            .as_array()
            .unwrap()
            .len(),
        1
    );

    let u = central.register(&unix_pod);
    let t = central.register(&tcp_pod);
    let pods = central.ok("GET", "/v1/pods", None);
    let listed: Vec<&str> = pods["pods"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["id"].as_str().unwrap())
        .collect();
    assert_eq!(listed.len(), 3, "{pods}");
    assert!(
        listed.contains(&"pod_local")
            && listed.contains(&u.as_str())
            && listed.contains(&t.as_str())
    );

    // Templates are per pod, merged with their pod.
    let templates = central.ok("GET", "/v1/templates", None);
    let mut probe_pods: Vec<String> = templates["templates"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["name"] == "probe")
        .map(|t| t["pod"].as_str().unwrap().to_string())
        .collect();
    probe_pods.sort();
    let mut want = vec!["pod_local".to_string(), u.clone(), t.clone()];
    want.sort();
    assert_eq!(probe_pods, want);

    // The local pod admits nothing: placement goes to a remote pod.
    central.ok(
        "PATCH",
        "/v1/pods/pod_local",
        Some(json!({"oversubscription_ratio": 0.000001})),
    );
    let placed = central.ok("POST", "/v1/sandboxes", Some(json!({"template": "probe"})));
    let placed_pod = placed["pod"].as_str().unwrap().to_string();
    assert!(placed_pod == u || placed_pod == t, "{placed}");
    assert!(
        placed["metadata"]["torpor.placement"].is_string(),
        "{placed}"
    );
    let pinned_local = central.call(
        "POST",
        "/v1/sandboxes",
        Some(json!({"template": "probe", "pod": "pod_local"})),
    );
    assert_eq!(pinned_local.status, 429, "{}", pinned_local.body);
    central.ok(
        "PATCH",
        "/v1/pods/pod_local",
        Some(json!({"oversubscription_ratio": 4.0})),
    );
    let on_unix = central.ok(
        "POST",
        "/v1/sandboxes",
        Some(json!({"template": "probe", "pod": u})),
    );
    assert_eq!(on_unix["pod"], u.as_str());
    let on_tcp = central.ok(
        "POST",
        "/v1/sandboxes",
        Some(json!({"template": "probe", "pod": t})),
    );
    assert_eq!(on_tcp["pod"], t.as_str());
    let local = central.ok(
        "POST",
        "/v1/sandboxes",
        Some(json!({"template": "probe", "pod": "pod_local"})),
    );
    assert_eq!(local["pod"], "pod_local");
    let unknown_pod = central.call(
        "POST",
        "/v1/sandboxes",
        Some(json!({"template": "probe", "pod": "pod_nope"})),
    );
    assert_eq!(unknown_pod.status, 404, "{}", unknown_pod.body);

    // The unix pod holds it (as its own pod_local).
    let sid = on_unix["id"].as_str().unwrap().to_string();
    let direct = unix_pod.request("GET", &format!("/v1/sandboxes/{sid}"), None);
    assert_eq!(direct.status, 200, "{}", direct.body);
    assert_eq!(direct.json()["pod"], "pod_local");

    // Lifecycle through the central API.
    let base = format!("/v1/sandboxes/{sid}");
    assert_eq!(
        central.ok("POST", &format!("{base}/pause"), None)["sandbox"]["state"],
        "paused"
    );
    // The pod's own errors pass through.
    let bad_ckpt = central.call("DELETE", &format!("{base}/checkpoints/nope"), None);
    assert_eq!(bad_ckpt.status, 404, "{}", bad_ckpt.body);
    assert!(bad_ckpt.body.contains("nope"), "{}", bad_ckpt.body);
    assert_eq!(
        central.ok("POST", &format!("{base}/resume"), None)["sandbox"]["state"],
        "running"
    );
    let hib = central.ok("POST", &format!("{base}/hibernate"), None);
    assert_eq!(hib["sandbox"]["state"], "hibernated");
    assert_eq!(hib["sandbox"]["pod"], u.as_str());
    let woke = central.ok("POST", &format!("{base}/resume"), None);
    assert_eq!(woke["resumed"], true, "{woke}");
    assert_eq!(woke["sandbox"]["state"], "running");
    let patched = central.ok("PATCH", &base, Some(json!({"keep_alive_ms": 12345})));
    assert_eq!(patched["keep_alive_ms"], 12345);
    let no_agent = central.call(
        "POST",
        &format!("{base}/exec"),
        Some(json!({"argv": ["true"]})),
    );
    assert_eq!(no_agent.status, 422, "{}", no_agent.body);
    assert_eq!(error_code(&no_agent), "no_agent");

    let bad_fork = central.call(
        "POST",
        &format!("{base}/fork"),
        Some(json!({"metadata": "x"})),
    );
    assert_eq!(bad_fork.status, 400, "{}", bad_fork.body);
    // A federation forks a remote sandbox one at a time.
    let counted = central.call("POST", &format!("{base}/fork"), Some(json!({"count": 2})));
    assert_eq!(counted.status, 501, "{}", counted.body);
    // Fork lands on the source's pod.
    let fork = central.ok("POST", &format!("{base}/fork"), Some(json!({})));
    assert_eq!(fork["pod"], u.as_str(), "{fork}");
    let fid = fork["id"].as_str().unwrap().to_string();
    assert_eq!(
        central.ok("GET", &format!("/v1/sandboxes/{fid}"), None)["pod"],
        u.as_str()
    );

    // Lists merge every pod; filters apply.
    let all = ids_and_pods(&central.ok("GET", "/v1/sandboxes", None));
    let mut want = vec![
        (
            placed["id"].as_str().unwrap().to_string(),
            placed_pod.clone(),
        ),
        (sid.clone(), u.clone()),
        (fid.clone(), u.clone()),
        (on_tcp["id"].as_str().unwrap().to_string(), t.clone()),
        (
            local["id"].as_str().unwrap().to_string(),
            "pod_local".to_string(),
        ),
    ];
    want.sort();
    assert_eq!(all, want);
    let only_tcp = ids_and_pods(&central.ok("GET", &format!("/v1/sandboxes?pod={t}"), None));
    assert!(
        only_tcp.iter().all(|(_, p)| *p == t) && !only_tcp.is_empty(),
        "{only_tcp:?}"
    );
    let paused = central.ok("POST", &format!("{base}/pause"), None);
    assert_eq!(paused["sandbox"]["state"], "paused");
    let only_paused = ids_and_pods(&central.ok("GET", "/v1/sandboxes?state=paused", None));
    assert_eq!(only_paused, vec![(sid.clone(), u.clone())]);

    // A ratio change is forwarded to the pod that owns it.
    let set = central.ok(
        "PATCH",
        &format!("/v1/pods/{t}"),
        Some(json!({"oversubscription_ratio": 3.5})),
    );
    assert_eq!(set["id"], t.as_str());
    assert_eq!(set["oversubscription_ratio"], 3.5);
    let on_pod = tcp_pod.request("GET", "/v1/pods", None).json();
    assert_eq!(on_pod["pods"][0]["oversubscription_ratio"], 3.5);

    let bad_ratio = central.call(
        "PATCH",
        &format!("/v1/pods/{t}"),
        Some(json!({"oversubscription_ratio": 1000.0})),
    );
    assert_eq!(bad_ratio.status, 400, "{}", bad_ratio.body);

    // Unregistering a pod with live sandboxes is refused.
    let busy = central.call("DELETE", &format!("/v1/pods/{u}"), None);
    assert_eq!(busy.status, 409, "{}", busy.body);

    // A pod that dies: its sandboxes answer pod_unreachable, the rest work.
    tcp_pod.kill9();
    let tid = on_tcp["id"].as_str().unwrap();
    let dead = central.call("GET", &format!("/v1/sandboxes/{tid}"), None);
    assert_eq!(dead.status, 502, "{}", dead.body);
    assert_eq!(error_code(&dead), "pod_unreachable");
    let dead_pause = central.call("POST", &format!("/v1/sandboxes/{tid}/pause"), None);
    assert_eq!(error_code(&dead_pause), "pod_unreachable");
    let lid = local["id"].as_str().unwrap();
    assert_eq!(
        central.ok("POST", &format!("/v1/sandboxes/{lid}/pause"), None)["sandbox"]["state"],
        "paused"
    );
    assert_eq!(
        central.ok("POST", &format!("{base}/resume"), None)["sandbox"]["state"],
        "running"
    );
    let pods = central.ok("GET", "/v1/pods", None);
    let entry = pods["pods"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["id"] == t.as_str())
        .unwrap()
        .clone();
    assert_eq!(entry["reachable"], false, "{entry}");
    assert!(
        entry["error"].as_str().unwrap().contains("unreachable"),
        "{entry}"
    );
    let listed = ids_and_pods(&central.ok("GET", "/v1/sandboxes", None));
    assert!(listed.iter().all(|(_, p)| *p != t), "{listed:?}");

    // Deleting through the central API, then the pod can go.
    for id in [sid.as_str(), fid.as_str()] {
        assert_eq!(
            central
                .call("DELETE", &format!("/v1/sandboxes/{id}"), None)
                .status,
            204
        );
    }
    if placed_pod == u {
        let pid = placed["id"].as_str().unwrap();
        assert_eq!(
            central
                .call("DELETE", &format!("/v1/sandboxes/{pid}"), None)
                .status,
            204
        );
    }
    assert_eq!(
        unix_pod.request("GET", "/v1/sandboxes", None).json()["sandboxes"],
        json!([])
    );
    assert_eq!(
        central
            .call("DELETE", &format!("/v1/pods/{u}"), None)
            .status,
        204
    );
    assert_eq!(
        central.call("DELETE", "/v1/pods/pod_local", None).status,
        409
    );
    let left: Vec<Value> = central.ok("GET", "/v1/pods", None)["pods"]
        .as_array()
        .unwrap()
        .clone();
    assert!(left.iter().all(|p| p["id"] != u.as_str()), "{left:?}");
    // The dead pod's registration survives a restart of the central.
    let data_central = data.0.join("central");
    drop(central);
    let again = ServeProcess::start(
        &data_central,
        &["--token", TOKEN, "--policy-interval-ms", "0"],
    );
    let pods = request(&again.addr, "GET", "/v1/pods", Some(TOKEN), None).json();
    assert!(
        pods["pods"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["id"] == t.as_str()),
        "{pods}"
    );
}

#[test]
fn central_killed_mid_create_adopts_the_sandbox_on_restart() {
    let data = DataDir::new("pods-crash");
    let pod = PodProcess::start_unix(&data.0, "u", "crash-pod-token");
    let token_file = PodProcess::token_file(&data.0.join("u"));
    let token_file = token_file.to_str().unwrap();
    let flags = [
        "--pod",
        pod.address.as_str(),
        "--pod-token-file",
        token_file,
    ];
    let central = Central::start(&data.0, &flags, &[("TORPOR_STALL_PLACEMENT_MS", "600000")]);
    let pods = central.ok("GET", "/v1/pods", None);
    let pod_id = pods["pods"][1]["id"].as_str().unwrap().to_string();

    let addr = central.serve.addr.clone();
    let body = json!({"template": "probe", "pod": pod_id}).to_string();
    let create = std::thread::spawn(move || {
        // Answered only if the central survives, which it does not.
        std::panic::catch_unwind(|| {
            request(&addr, "POST", "/v1/sandboxes", Some(TOKEN), Some(&body)).status
        })
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    let made = loop {
        let list = pod.request("GET", "/v1/sandboxes", None).json();
        if let Some(s) = list["sandboxes"].as_array().unwrap().first() {
            break s.clone();
        }
        assert!(Instant::now() < deadline, "the pod never made the sandbox");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(made["metadata"]["torpor.placement"].is_string(), "{made}");
    central.serve.kill9();
    let _ = create.join();

    let central = Central::start(&data.0, &flags, &[]);
    let id = made["id"].as_str().unwrap();
    let got = central.ok("GET", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(got["pod"], pod_id.as_str());
    assert_eq!(
        ids_and_pods(&central.ok("GET", "/v1/sandboxes", None)),
        vec![(id.to_string(), pod_id.clone())]
    );
    assert_eq!(
        central.ok("POST", &format!("/v1/sandboxes/{id}/pause"), None)["sandbox"]["state"],
        "paused"
    );
    assert_eq!(
        central
            .call("DELETE", &format!("/v1/sandboxes/{id}"), None)
            .status,
        204
    );
    // Restarting with the same --pod flags registers nothing new.
    assert_eq!(
        central.ok("GET", "/v1/pods", None)["pods"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
}

fn cli(args: &[&str], api: &str) -> (bool, String, String) {
    let out = Command::new(TORPOR)
        .args(args)
        .args(["--api", api, "--token", TOKEN])
        .env_remove("TORPOR_API")
        .env_remove("TORPOR_TOKEN")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn cli_pod_add_list_rm() {
    let data = DataDir::new("pods-cli");
    let pod = PodProcess::start(&data.0.join("t"), "tcp:127.0.0.1:0", "cli-pod-token");
    let central = Central::start(&data.0, &[], &[]);
    let api = central.serve.url();
    let token_file = PodProcess::token_file(&data.0.join("t"));
    let wrong = data.0.join("wrong-token");
    std::fs::write(&wrong, "nope").unwrap();

    let fingerprint = pod.fingerprint.clone().unwrap();
    let (ok, _, err) = cli(
        &[
            "pod",
            "add",
            &pod.address,
            "--fingerprint",
            &fingerprint,
            "--pod-token-file",
            wrong.to_str().unwrap(),
        ],
        &api,
    );
    assert!(!ok);
    assert!(err.contains("refused the token"), "{err}");
    let (ok, out, err) = cli(
        &[
            "pod",
            "add",
            &pod.address,
            "--fingerprint",
            &fingerprint,
            "--pod-token-file",
            token_file.to_str().unwrap(),
        ],
        &api,
    );
    assert!(ok, "{err}");
    let id = out.trim().to_string();
    assert!(id.starts_with("pod_") && id != "pod_local", "{out}");
    let (ok, out, err) = cli(&["pod", "list"], &api);
    assert!(ok, "{err}");
    assert!(out.contains(&id) && out.contains("pod_local"), "{out}");
    let row = out.lines().find(|l| l.starts_with(&id)).unwrap();
    assert!(row.contains(&pod.address), "{out}");
    let (ok, out, err) = cli(&["pod", "set", &id, "--ratio", "2"], &api);
    assert!(ok, "{err}");
    assert!(
        out.contains(&format!("tls:{}", pod.address.trim_start_matches("tls:"))),
        "{out}"
    );
    // Templates show their pod; a sandbox pinned with --pod lands there.
    let (ok, out, err) = cli(&["template", "list"], &api);
    assert!(ok, "{err}");
    assert!(
        out.lines()
            .any(|l| l.contains(" probe ") && l.ends_with(&id)),
        "{out}"
    );
    let (ok, out, err) = cli(
        &["sandbox", "create", "--template", "probe", "--pod", &id],
        &api,
    );
    assert!(ok, "{err}");
    let sandbox = out.trim().to_string();
    let (ok, out, err) = cli(&["sandbox", "get", &sandbox, "--json"], &api);
    assert!(ok, "{err}");
    assert_eq!(
        serde_json::from_str::<Value>(&out).unwrap()["pod"],
        id.as_str()
    );
    let (ok, _, err) = cli(&["pod", "rm", &id], &api);
    assert!(!ok && err.contains("HTTP 409"), "{err}");
    let (ok, _, err) = cli(&["sandbox", "rm", &sandbox], &api);
    assert!(ok, "{err}");
    let (ok, _, err) = cli(&["pod", "rm", &id], &api);
    assert!(ok, "{err}");
    let (_, out, _) = cli(&["pod", "list"], &api);
    assert!(!out.contains(&id), "{out}");
    let (ok, _, err) = cli(&["pod", "rm", &id], &api);
    assert!(!ok && err.contains("HTTP 404"), "{err}");

    // The CLI reaches a pod's API on its unix socket too.
    let unix_pod = PodProcess::start_unix(&data.0, "cli", "unix-cli-token");
    let out = Command::new(TORPOR)
        .args([
            "pod",
            "list",
            "--json",
            "--api",
            &unix_pod.address,
            "--token",
            "unix-cli-token",
        ])
        .output()
        .unwrap();
    let v: Value = serde_json::from_str(&succeeded(&out)).unwrap();
    assert_eq!(v["pods"][0]["id"], "pod_local");
    let refused = Command::new(TORPOR)
        .args([
            "pod",
            "add",
            "unix:/x.sock",
            "--pod-token",
            "t",
            "--api",
            &unix_pod.address,
            "--token",
            "unix-cli-token",
        ])
        .output()
        .unwrap();
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("HTTP 501"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
}
