//! envd's Connect RPCs (`process.Process`, `filesystem.Filesystem`) over
//! HTTP against a real torpor-agent (this host's processes and files)
//! behind the hybrid vsock stand-in: the JSON shapes the E2B SDKs read,
//! unary and server-streaming envelopes, background processes that are
//! reconnected, fed and signalled, PTYs, watches, and what is refused
//! (malformed envelopes, wrong lengths, unknown methods, tokens, another
//! tenant's sandbox).

mod common;

use std::time::Duration;

use common::{Server, TOKEN};
use serde_json::{json, Value};
use torpor_api::auth::tokens::TenantsFile;
use torpor_api::auth::Scope;
use torpor_api::e2b::envd::envelope::{decode_all, Envelope, FLAG_COMPRESSED};
use torpor_api::ApiConfig;

const STREAM: &str = "application/connect+json";

type Headers = Vec<(&'static str, String)>;

/// A sandbox with the real agent, made through E2B's create: its id and
/// envd access token.
async fn sandbox(server: &Server, key: &str) -> (String, String) {
    let body = json!({"templateID": "probe", "metadata": {"agent": "real"},
                      "envVars": {"FROM_SANDBOX": "yes", "SHADOWED": "sandbox"}});
    let h: Headers = vec![
        ("X-API-KEY", key.to_string()),
        ("Content-Type", "application/json".to_string()),
    ];
    let text = body.to_string();
    let r = server
        .request("POST", "/v2/sandboxes", &h, Some(text.as_bytes()))
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    let v = r.json();
    (
        v["sandboxID"].as_str().unwrap().to_string(),
        v["envdAccessToken"].as_str().unwrap().to_string(),
    )
}

struct Envd<'a> {
    server: &'a Server,
    id: String,
    token: String,
}

impl<'a> Envd<'a> {
    async fn new(server: &'a Server) -> Envd<'a> {
        let (id, token) = sandbox(server, TOKEN).await;
        Envd { server, id, token }
    }

    fn headers(&self, content_type: &str, extra: &[(&'static str, &str)]) -> Headers {
        let mut h: Headers = vec![
            ("E2b-Sandbox-Id", self.id.clone()),
            ("X-Access-Token", self.token.clone()),
            ("Content-Type", content_type.to_string()),
            ("Connect-Protocol-Version", "1".to_string()),
        ];
        h.extend(extra.iter().map(|(k, v)| (*k, v.to_string())));
        h
    }

    /// A unary call: status and JSON body.
    async fn unary(&self, method: &str, message: Value) -> (u16, Value) {
        self.unary_with(method, message, &[]).await
    }

    async fn unary_with(
        &self,
        method: &str,
        message: Value,
        extra: &[(&'static str, &str)],
    ) -> (u16, Value) {
        let h = self.headers("application/json", extra);
        let text = message.to_string();
        let r = self
            .server
            .request("POST", &format!("/{method}"), &h, Some(text.as_bytes()))
            .await;
        (
            r.status,
            serde_json::from_slice(&r.body).unwrap_or(Value::Null),
        )
    }

    async fn ok(&self, method: &str, message: Value) -> Value {
        let (status, v) = self.unary(method, message).await;
        assert_eq!(status, 200, "{method}: {v}");
        v
    }

    /// A server-streaming call with raw request bytes: its messages and
    /// the end-of-stream message.
    async fn stream_raw(
        &self,
        method: &str,
        body: &[u8],
        extra: &[(&'static str, &str)],
    ) -> (Vec<Value>, Value) {
        let h = self.headers(STREAM, extra);
        let r = self
            .server
            .request("POST", &format!("/{method}"), &h, Some(body))
            .await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("content-type"), Some(STREAM));
        let envs = decode_all(&r.body, 1 << 24).expect("well-formed envelopes");
        let (last, messages) = envs.split_last().expect("an end-of-stream envelope");
        assert!(last.is_end_stream(), "the stream ends with end-of-stream");
        let messages = messages
            .iter()
            .map(|e| {
                assert!(!e.is_end_stream());
                serde_json::from_slice(&e.payload).unwrap()
            })
            .collect();
        (messages, serde_json::from_slice(&last.payload).unwrap())
    }

    async fn stream(
        &self,
        method: &str,
        message: Value,
        extra: &[(&'static str, &str)],
    ) -> (Vec<Value>, Value) {
        let body = Envelope::message(message.to_string().into_bytes()).encode();
        self.stream_raw(method, &body, extra).await
    }
}

fn b64(data: &[u8]) -> String {
    torpor_agent::b64::encode(data)
}

/// The bytes of the stream's data events of `kind` (stdout, stderr, pty).
fn output(events: &[Value], kind: &str) -> String {
    let mut out = Vec::new();
    for e in events {
        if let Some(d) = e["event"]["data"][kind].as_str() {
            out.extend(torpor_agent::b64::decode(d).unwrap());
        }
    }
    String::from_utf8(out).unwrap()
}

fn end(events: &[Value]) -> &Value {
    &events.last().unwrap()["event"]["end"]
}

fn bash(cmd: &str) -> Value {
    // Not a login shell (the SDKs use `-l`): a host profile (pyenv's rehash
    // lock, say) must not decide how long a test takes.
    json!({"process": {"cmd": "/bin/bash", "args": ["-c", cmd]}, "stdin": false})
}

fn pid_of(events: &[Value]) -> u64 {
    events[0]["event"]["start"]["pid"]
        .as_u64()
        .unwrap_or_else(|| panic!("a start event first: {events:?}"))
}

#[tokio::test]
async fn commands_run_with_exit_codes_output_env_and_cwd() {
    let server = Server::start().await;
    let envd = Envd::new(&server).await;
    let dir = tempfile::tempdir().unwrap();
    let mut req = bash("echo out; echo err >&2; echo $FROM_SANDBOX $SHADOWED $MINE; pwd; exit 3");
    req["process"]["envs"] = json!({"SHADOWED": "request", "MINE": "1"});
    req["process"]["cwd"] = json!(dir.path().to_str().unwrap());
    let (events, end_stream) = envd.stream("process.Process/Start", req, &[]).await;
    assert_eq!(end_stream, json!({}));
    assert!(pid_of(&events) > 1);
    assert_eq!(
        output(&events, "stdout"),
        format!("out\nyes request 1\n{}\n", dir.path().display())
    );
    assert_eq!(output(&events, "stderr"), "err\n");
    assert_eq!(
        *end(&events),
        json!({"exitCode": 3, "exited": true, "status": "exit status 3"})
    );
    // A missing program: the stream's error, in Connect's shape.
    let missing = json!({"process": {"cmd": "/no/such/program"}});
    let (events, end_stream) = envd.stream("process.Process/Start", missing, &[]).await;
    assert!(events.is_empty(), "{events:?}");
    assert_eq!(end_stream["error"]["code"], "not_found", "{end_stream}");
    // An empty command is the caller's mistake.
    let empty = json!({"process": {"cmd": ""}});
    let (_, end_stream) = envd.stream("process.Process/Start", empty, &[]).await;
    assert_eq!(end_stream["error"]["code"], "invalid_argument");
}

#[tokio::test]
async fn a_background_process_is_listed_reconnected_fed_and_signalled() {
    let server = Server::start().await;
    let envd = Envd::new(&server).await;
    // Start, and let the stream end at its timeout: the process goes on.
    let mut req = bash("echo ready; read line; echo \"got $line\"; cat; echo bye");
    req["stdin"] = json!(true);
    req["tag"] = json!("bg");
    let short = [
        ("Connect-Timeout-Ms", "800"),
        ("Keepalive-Ping-Interval", "1"),
    ];
    let (events, end_stream) = envd.stream("process.Process/Start", req, &short).await;
    assert_eq!(
        end_stream["error"]["code"], "deadline_exceeded",
        "{end_stream}"
    );
    let pid = pid_of(&events);
    assert_eq!(output(&events, "stdout"), "ready\n");
    let listed = envd.ok("process.Process/List", json!({})).await;
    let me = listed["processes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pid"] == pid)
        .expect("still running")
        .clone();
    assert_eq!(me["tag"], "bg");
    assert_eq!(me["config"]["cmd"], "/bin/bash");
    assert_eq!(me["config"]["args"][0], "-c");

    // Reconnect by tag while input arrives and stdin closes.
    let follow = envd.stream(
        "process.Process/Connect",
        json!({"process": {"tag": "bg"}}),
        &[("Keepalive-Ping-Interval", "1")],
    );
    let feed = async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let sel = json!({"pid": pid});
        let input = |data: &[u8]| json!({"process": sel, "input": {"stdin": b64(data)}});
        envd.ok("process.Process/SendInput", input(b"hello\n"))
            .await;
        envd.ok("process.Process/SendInput", input(b"tail")).await;
        envd.ok("process.Process/CloseStdin", json!({"process": sel}))
            .await;
    };
    let ((events, end_stream), ()) = tokio::join!(follow, feed);
    assert_eq!(end_stream, json!({}));
    assert_eq!(pid_of(&events), pid);
    assert_eq!(output(&events, "stdout"), "got hello\ntailbye\n");
    assert_eq!(end(&events)["exitCode"], 0);
    let (status, v) = envd
        .unary("process.Process/Connect", json!({"process": {"pid": pid}}))
        .await;
    assert_eq!(status, 400, "a streaming method called unary: {v}");

    // Signals: SIGKILL ends a sleeper; then it is not found.
    let short = [
        ("Connect-Timeout-Ms", "300"),
        ("Keepalive-Ping-Interval", "1"),
    ];
    let (events, _) = envd
        .stream("process.Process/Start", bash("sleep 30"), &short)
        .await;
    let sleeper = pid_of(&events);
    let kill = json!({"process": {"pid": sleeper}, "signal": "SIGNAL_SIGKILL"});
    envd.ok("process.Process/SendSignal", kill.clone()).await;
    let mut status = 200;
    for _ in 0..50 {
        status = envd
            .unary("process.Process/SendSignal", kill.clone())
            .await
            .0;
        if status == 404 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(status, 404, "the killed process is gone");
    let bad = json!({"process": {"pid": 1}, "signal": "SIGNAL_UNSPECIFIED"});
    assert_eq!(envd.unary("process.Process/SendSignal", bad).await.0, 400);
    let untagged = json!({"process": {"tag": "nope"}, "input": {"stdin": ""}});
    let (status, v) = envd.unary("process.Process/SendInput", untagged).await;
    assert_eq!(
        (status, v["code"].as_str()),
        (404, Some("not_found")),
        "{v}"
    );
}

/// A client stream's body: each message enveloped, in order.
fn client_stream(messages: &[Value]) -> Vec<u8> {
    messages
        .iter()
        .flat_map(|m| Envelope::message(m.to_string().into_bytes()).encode())
        .collect()
}

#[tokio::test]
async fn stream_input_feeds_stdin_in_order_and_answers_once() {
    let server = Server::start().await;
    let envd = Envd::new(&server).await;
    let mut req = bash("read a; read b; echo \"got $a $b\"");
    req["stdin"] = json!(true);
    req["tag"] = json!("reader");
    let short = [("Connect-Timeout-Ms", "800")];
    let (events, _) = envd.stream("process.Process/Start", req, &short).await;
    let pid = pid_of(&events);
    let start = json!({"start": {"process": {"pid": pid}}});
    let data = |d: &[u8]| json!({"data": {"input": {"stdin": b64(d)}}});
    let body = client_stream(&[
        start.clone(),
        data(b"one\n"),
        json!({"keepalive": {}}),
        data(b"two"),
        data(b"\n"),
    ]);
    // Followed (by tag) while the input stream feeds it.
    let follow = envd.stream(
        "process.Process/Connect",
        json!({"process": {"tag": "reader"}}),
        &[("Keepalive-Ping-Interval", "1")],
    );
    let feed = async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        envd.stream_raw("process.Process/StreamInput", &body, &[])
            .await
    };
    let ((events, _), (messages, end_stream)) = tokio::join!(follow, feed);
    assert_eq!((messages, end_stream), (vec![json!({})], json!({})));
    assert_eq!(output(&events, "stdout"), "got one two\n");
    assert_eq!(end(&events)["exitCode"], 0, "{events:?}");

    // What the stream refuses, each answered in its end-of-stream message.
    let refused = |body: Vec<u8>, code: &'static str| {
        let envd = &envd;
        async move {
            let (messages, end_stream) = envd
                .stream_raw("process.Process/StreamInput", &body, &[])
                .await;
            assert!(messages.is_empty(), "{messages:?}");
            assert_eq!(end_stream["error"]["code"], code, "{end_stream}");
        }
    };
    refused(client_stream(&[data(b"x")]), "invalid_argument").await;
    refused(client_stream(&[]), "invalid_argument").await;
    let mut cut = client_stream(&[start]);
    cut.truncate(cut.len() - 2);
    refused(cut, "invalid_argument").await;
    let missing = json!({"start": {"process": {"pid": 2_147_483_646u32}}});
    refused(client_stream(&[missing]), "not_found").await;
    // A second `start` once the first named a running process.
    let (events, _) = envd
        .stream("process.Process/Start", bash("sleep 30"), &short)
        .await;
    let sleeper = json!({"start": {"process": {"pid": pid_of(&events)}}});
    refused(
        client_stream(&[sleeper.clone(), sleeper.clone()]),
        "invalid_argument",
    )
    .await;
    let kill = json!({"process": sleeper["start"]["process"], "signal": "SIGNAL_SIGKILL"});
    envd.ok("process.Process/SendSignal", kill).await;
}

#[tokio::test]
async fn a_pty_process_takes_input_and_resizes() {
    let server = Server::start().await;
    let envd = Envd::new(&server).await;
    let script = "stty size; read x; stty size; echo \"x=$x\"";
    let req = json!({"process": {"cmd": "/bin/sh", "args": ["-c", script]},
                     "pty": {"size": {"cols": 100, "rows": 30}}});
    let run = envd.stream(
        "process.Process/Start",
        req,
        &[("Keepalive-Ping-Interval", "1")],
    );
    let drive = async {
        // Find the pid, resize, then answer the read.
        let pid = loop {
            let l = envd.ok("process.Process/List", json!({})).await;
            let found = l["processes"]
                .as_array()
                .unwrap()
                .iter()
                .find(|p| p["config"]["cmd"] == "/bin/sh")
                .map(|p| p["pid"].clone());
            if let Some(pid) = found {
                break pid;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        let size = json!({"process": {"pid": pid}, "pty": {"size": {"cols": 132, "rows": 43}}});
        envd.ok("process.Process/Update", size).await;
        let input = json!({"process": {"pid": pid}, "input": {"pty": b64(b"go\n")}});
        envd.ok("process.Process/SendInput", input).await;
    };
    let ((events, end_stream), ()) = tokio::join!(run, drive);
    assert_eq!(end_stream, json!({}));
    let text = output(&events, "pty");
    assert!(text.contains("30 100"), "{text:?}");
    assert!(text.contains("43 132"), "{text:?}");
    assert!(text.contains("x=go"), "{text:?}");
    assert!(output(&events, "stdout").is_empty());
    assert_eq!(end(&events)["exitCode"], 0);
}

fn names(list: &Value, field: &str) -> Vec<String> {
    list["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e[field].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test]
async fn filesystem_rpcs_answer_envds_entries() {
    let server = Server::start().await;
    let envd = Envd::new(&server).await;
    let dir = tempfile::tempdir().unwrap();
    let p = |rel: &str| format!("{}/{rel}", dir.path().display());
    let fs = |m: &str| format!("filesystem.Filesystem/{m}");

    let made = envd.ok(&fs("MakeDir"), json!({"path": p("a/b")})).await;
    assert_eq!(made["entry"]["type"], "FILE_TYPE_DIRECTORY");
    assert_eq!(made["entry"]["name"], "b");
    assert_eq!(made["entry"]["path"], p("a/b"));
    assert_eq!(made["entry"]["permissions"], "drwxr-xr-x");
    let (status, v) = envd.unary(&fs("MakeDir"), json!({"path": p("a/b")})).await;
    assert_eq!(
        (status, v["code"].as_str()),
        (409, Some("already_exists")),
        "{v}"
    );

    std::fs::write(dir.path().join("a/f.txt"), b"hello").unwrap();
    std::os::unix::fs::symlink("f.txt", dir.path().join("a/l")).unwrap();
    let st = envd.ok(&fs("Stat"), json!({"path": p("a/f.txt")})).await;
    let e = &st["entry"];
    assert_eq!(e["type"], "FILE_TYPE_FILE");
    assert_eq!(e["size"], "5");
    assert_eq!(e["isSymlink"], false);
    assert!(e["owner"].as_str().is_some_and(|o| !o.is_empty()), "{e}");
    assert!(e["modifiedTime"].as_str().unwrap().ends_with('Z'), "{e}");
    let l = envd.ok(&fs("Stat"), json!({"path": p("a/l")})).await;
    assert_eq!(l["entry"]["isSymlink"], true);
    assert_eq!(l["entry"]["type"], "FILE_TYPE_FILE");
    // The target resolved, as envd's `filepath.EvalSymlinks`.
    let real = std::fs::canonicalize(dir.path().join("a/f.txt")).unwrap();
    assert_eq!(l["entry"]["symlinkTarget"], real.to_str().unwrap());
    assert_eq!(l["entry"]["permissions"], "Lrwxrwxrwx");

    let one = envd.ok(&fs("ListDir"), json!({"path": p("a")})).await;
    assert_eq!(names(&one, "name"), ["b", "f.txt", "l"]);
    std::fs::write(dir.path().join("a/b/deep"), b"").unwrap();
    let two = envd
        .ok(&fs("ListDir"), json!({"path": p("a"), "depth": 2}))
        .await;
    assert!(names(&two, "path").contains(&p("a/b/deep")), "{two}");

    let mv = json!({"source": p("a/f.txt"), "destination": p("a/g.txt")});
    let moved = envd.ok(&fs("Move"), mv).await;
    assert_eq!(moved["entry"]["name"], "g.txt");
    envd.ok(&fs("Remove"), json!({"path": p("a")})).await;
    let (status, v) = envd.unary(&fs("Stat"), json!({"path": p("a")})).await;
    assert_eq!(
        (status, v["code"].as_str()),
        (404, Some("not_found")),
        "{v}"
    );
    // Nothing there is no error (envd's `os.RemoveAll`).
    envd.ok(&fs("Remove"), json!({"path": p("a")})).await;
    let deep = json!({"path": p("x"), "depth": 99});
    assert_eq!(envd.unary(&fs("ListDir"), deep).await.0, 400);

    // As a named user (`Authorization: Basic base64("nobody:")`): the
    // directories made belong to that user, the existing parent does not.
    // SAFETY: no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if root && torpor_agent::users::by_name("nobody").is_ok() {
        let auth = format!("Basic {}", b64(b"nobody:"));
        let req = json!({"path": p("n1/n2")});
        let (status, v) = envd
            .unary_with(&fs("MakeDir"), req, &[("Authorization", &auth)])
            .await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["entry"]["owner"], "nobody", "{v}");
        let n1 = envd.ok(&fs("Stat"), json!({"path": p("n1")})).await;
        assert_eq!(n1["entry"]["owner"], "nobody", "{n1}");
        let top = envd.ok(&fs("Stat"), json!({"path": p("")})).await;
        assert_ne!(top["entry"]["owner"], "nobody", "{top}");
        let (status, _) = envd
            .unary_with(
                &fs("MakeDir"),
                json!({"path": p("u")}),
                &[("Authorization", "Basic !")],
            )
            .await;
        assert_eq!(status, 400);
        let ghost = format!("Basic {}", b64(b"no-such-user-torpor:"));
        let (status, v) = envd
            .unary_with(
                &fs("MakeDir"),
                json!({"path": p("g")}),
                &[("Authorization", &ghost)],
            )
            .await;
        assert_eq!(
            (status, v["code"].as_str()),
            (404, Some("not_found")),
            "{v}"
        );
        assert!(
            !dir.path().join("g").exists(),
            "nothing made for an unknown user"
        );
    }
}

#[tokio::test]
async fn watchers_poll_and_stream_changes() {
    let server = Server::start().await;
    let envd = Envd::new(&server).await;
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_str().unwrap().to_string();
    let fs = |m: &str| format!("filesystem.Filesystem/{m}");
    let w = envd
        .ok(
            &fs("CreateWatcher"),
            json!({"path": root, "recursive": true}),
        )
        .await;
    let wid = w["watcherId"].as_str().unwrap().to_string();
    std::fs::write(dir.path().join("new.txt"), b"x").unwrap();
    let mut seen = Vec::new();
    for _ in 0..50 {
        let got = envd
            .ok(&fs("GetWatcherEvents"), json!({"watcherId": wid}))
            .await;
        seen.extend(got["events"].as_array().unwrap().clone());
        if seen.iter().any(|e| e["type"] == "EVENT_TYPE_WRITE") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let created = |e: &Value| e["name"] == "new.txt" && e["type"] == "EVENT_TYPE_CREATE";
    assert!(seen.iter().any(created), "{seen:?}");
    envd.ok(&fs("RemoveWatcher"), json!({"watcherId": wid}))
        .await;
    let gone = envd
        .unary(&fs("GetWatcherEvents"), json!({"watcherId": wid}))
        .await;
    assert_eq!(gone.0, 404);

    // WatchDir streams until its timeout.
    let method = fs("WatchDir");
    let watch = envd.stream(
        &method,
        json!({"path": root, "includeEntry": true}),
        &[("Connect-Timeout-Ms", "1500")],
    );
    let touch = async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        std::fs::write(dir.path().join("later.txt"), b"y").unwrap();
    };
    let ((events, end_stream), ()) = tokio::join!(watch, touch);
    assert_eq!(end_stream["error"]["code"], "deadline_exceeded");
    // WatchDirResponse's oneof is the message's own: no `event` field.
    assert_eq!(events[0], json!({"start": {}}));
    let later = events
        .iter()
        .find(|e| e["filesystem"]["name"] == "later.txt")
        .unwrap_or_else(|| panic!("{events:?}"));
    assert_eq!(later["filesystem"]["type"], "EVENT_TYPE_CREATE");
    assert_eq!(later["filesystem"]["entry"]["type"], "FILE_TYPE_FILE");
}

/// One envelope with any flags and declared length.
fn raw_envelope(flags: u8, len: u32, body: &[u8]) -> Vec<u8> {
    let mut v = vec![flags];
    v.extend_from_slice(&len.to_be_bytes());
    v.extend_from_slice(body);
    v
}

#[tokio::test]
async fn malformed_calls_are_connect_errors() {
    let server = Server::start().await;
    let envd = Envd::new(&server).await;
    // Unknown method, a client-streaming one not offered.
    let (status, v) = envd.unary("process.Process/Nope", json!({})).await;
    assert_eq!(
        (status, v["code"].as_str()),
        (501, Some("unimplemented")),
        "{v}"
    );
    // The client-streaming one called unary.
    let (status, v) = envd.unary("process.Process/StreamInput", json!({})).await;
    assert_eq!(
        (status, v["code"].as_str()),
        (400, Some("invalid_argument")),
        "{v}"
    );
    // Bad JSON, wrong field types.
    let h = envd.headers("application/json", &[]);
    let r = server
        .request("POST", "/process.Process/List", &h, Some(b"{nope"))
        .await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["code"], "invalid_argument");
    let typed = envd
        .unary("filesystem.Filesystem/Stat", json!({"path": 3}))
        .await;
    assert_eq!(typed.0, 400);
    // A streaming method called unary, and the other way round.
    assert_eq!(
        envd.unary("process.Process/Start", bash("true")).await.0,
        400
    );
    let (_, end_stream) = envd.stream("process.Process/List", json!({}), &[]).await;
    assert_eq!(end_stream["error"]["code"], "invalid_argument");
    // Neither JSON nor Connect's streaming JSON.
    let h = envd.headers("application/proto", &[]);
    let r = server
        .request("POST", "/process.Process/List", &h, Some(b""))
        .await;
    assert_eq!(r.status, 415);

    // Envelopes: shorter than declared, a cut header, longer than
    // declared, compressed, unknown flags, two messages, none, over the
    // limit.
    let two = [raw_envelope(0, 2, b"{}"), raw_envelope(0, 2, b"{}")].concat();
    for body in [
        raw_envelope(0, 10, b"{}"),
        vec![0, 0, 0],
        raw_envelope(0, 1, b"{}"),
        raw_envelope(FLAG_COMPRESSED, 2, b"{}"),
        raw_envelope(0x40, 2, b"{}"),
        two,
        Vec::new(),
        raw_envelope(0, u32::MAX, b"{}"),
    ] {
        let (events, end_stream) = envd.stream_raw("process.Process/Start", &body, &[]).await;
        assert!(events.is_empty());
        assert_eq!(
            end_stream["error"]["code"], "invalid_argument",
            "{body:?}: {end_stream}"
        );
    }
    // A bad timeout header.
    let (_, end_stream) = envd
        .stream(
            "process.Process/Start",
            bash("true"),
            &[("Connect-Timeout-Ms", "soon")],
        )
        .await;
    assert_eq!(end_stream["error"]["code"], "invalid_argument");
}

const ACME: &str = "acme-key-0123456789";
const UMBRELLA: &str = "umbrella-key-0123456789";

#[tokio::test]
async fn tokens_and_tenants_guard_the_rpcs() {
    let scratch = tempfile::tempdir().unwrap();
    let path = scratch.path().join("tenants.json");
    let mut file = TenantsFile::default();
    file.import("acme", Scope::Tenant, ACME).unwrap();
    file.import("umbrella", Scope::Tenant, UMBRELLA).unwrap();
    file.save(&path).unwrap();
    let server = Server::start_with(ApiConfig {
        tenants_file: Some(path),
        ..Server::config()
    })
    .await;
    let (id, token) = sandbox(&server, ACME).await;
    let list = |extra: Headers, id: &str| {
        let mut h: Headers = vec![("Content-Type", "application/json".to_string())];
        if !id.is_empty() {
            h.push(("E2b-Sandbox-Id", id.to_string()));
        }
        h.extend(extra);
        let server = &server;
        async move {
            let r = server
                .request("POST", "/process.Process/List", &h, Some(b"{}"))
                .await;
            let v = serde_json::from_slice::<Value>(&r.body).unwrap_or(Value::Null);
            (r.status, v["code"].as_str().unwrap_or_default().to_string())
        }
    };
    let with = |k: &'static str, v: &str| vec![(k, v.to_string())];
    assert_eq!(list(with("X-Access-Token", &token), &id).await.0, 200);
    assert_eq!(list(with("X-API-KEY", ACME), &id).await.0, 200);
    // No token, a wrong one: 401 unauthenticated.
    let none = list(Vec::new(), &id).await;
    assert_eq!(none, (401, "unauthenticated".to_string()));
    let wrong = "0".repeat(token.len());
    assert_eq!(list(with("X-Access-Token", &wrong), &id).await.0, 401);
    // Another tenant's key: no such sandbox, as for an unknown id.
    let other = list(with("X-API-KEY", UMBRELLA), &id).await;
    assert_eq!(other, (404, "not_found".to_string()));
    let unknown = list(with("X-Access-Token", &token), "sbx_00000000000000ff").await;
    assert_eq!(unknown, (404, "not_found".to_string()));
    // No sandbox header.
    assert_eq!(list(with("X-Access-Token", &token), "").await.0, 400);
    // A streaming call is refused inside the stream.
    let h: Headers = vec![
        ("E2b-Sandbox-Id", id.clone()),
        ("Content-Type", STREAM.to_string()),
    ];
    let body = Envelope::message(bash("true").to_string().into_bytes()).encode();
    let r = server
        .request("POST", "/process.Process/Start", &h, Some(&body))
        .await;
    assert_eq!(r.status, 200);
    let envs = decode_all(&r.body, 1 << 20).unwrap();
    let end: Value = serde_json::from_slice(&envs[0].payload).unwrap();
    assert_eq!(end["error"]["code"], "unauthenticated", "{end}");
}
