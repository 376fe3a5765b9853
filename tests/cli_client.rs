//! `torpor sandbox|template|pod` as clients: against a real `torpor serve`
//! on loopback (probe templates), against a dead address, and against a
//! canned HTTP server (chunked bodies, 100 Continue, error bodies, what the
//! client sends).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

mod common;

use common::serve::{DataDir, ServeProcess};

use common::TORPOR;
const TOKEN: &str = "cli-test-token-0123456789";

/// A `torpor serve` for the client to talk to.
struct Serve {
    _process: ServeProcess,
    url: String,
}

impl Serve {
    fn start(data: &Path) -> Self {
        let process = ServeProcess::start(data, &["--token", TOKEN, "--policy-interval-ms", "0"]);
        let url = process.url();
        Serve {
            _process: process,
            url,
        }
    }
}

/// Runs `torpor ARGS` with the given environment (and none of the client's
/// variables inherited), within a minute.
fn torpor_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(TORPOR);
    cmd.args(args)
        .env_remove("TORPOR_API")
        .env_remove("TORPOR_TOKEN")
        .env_remove("TORPOR_DATA_DIR")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("spawn torpor");
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("torpor {args:?} did not exit within a minute");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    child.wait_with_output().unwrap()
}

fn out(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn err(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The client against one server, with its URL and token.
struct Cli<'a>(&'a Serve);

impl Cli<'_> {
    /// `torpor GROUP --api URL --token T REST...` (the flags are global to
    /// the group; after `exec ID --` they would be the command's).
    fn run(&self, args: &[&str]) -> Output {
        let mut all = vec![args[0], "--api", &self.0.url, "--token", TOKEN];
        all.extend(&args[1..]);
        torpor_env(&all, &[])
    }

    /// Runs it, expects success, gives stdout.
    fn ok(&self, args: &[&str]) -> String {
        let o = self.run(args);
        assert!(
            o.status.success(),
            "torpor {args:?}: {:?}\nstdout:\n{}\nstderr:\n{}",
            o.status,
            out(&o),
            err(&o)
        );
        out(&o)
    }

    fn json(&self, args: &[&str]) -> Value {
        let mut all = args.to_vec();
        all.push("--json");
        let text = self.ok(&all);
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
    }

    /// Runs it, expects exit status 1, gives stderr.
    fn fails(&self, args: &[&str]) -> String {
        let o = self.run(args);
        assert_eq!(o.status.code(), Some(1), "torpor {args:?}: {}", out(&o));
        err(&o)
    }

    fn state(&self, id: &str) -> String {
        self.json(&["sandbox", "get", id])["state"]
            .as_str()
            .unwrap()
            .to_string()
    }
}

/// The table row whose first column is `id`.
fn row<'a>(table: &'a str, id: &str) -> &'a str {
    table
        .lines()
        .find(|l| l.split_whitespace().next() == Some(id))
        .unwrap_or_else(|| panic!("no row {id} in:\n{table}"))
}

#[test]
fn sandboxes_templates_and_pods_through_the_api() {
    let d = DataDir::new("cli-client");
    let s = Serve::start(&d.0.join("data"));
    let c = Cli(&s);

    let templates = c.ok(&["template", "list"]);
    assert!(templates.starts_with("ID "), "{templates}");
    let header: Vec<&str> = templates
        .lines()
        .next()
        .unwrap()
        .split_whitespace()
        .collect();
    assert_eq!(header, ["ID", "NAME", "KIND", "STATE", "MEM", "POD"]);
    let probe = templates.lines().find(|l| l.contains(" probe ")).unwrap();
    assert!(probe.contains("ready"), "{templates}");
    let listed = c.json(&["template", "list"]);
    assert_eq!(listed["templates"][0]["state"], "ready", "{listed}");

    // The URL and token from the environment, and from the token file of
    // the default data directory.
    let env = torpor_env(
        &["template", "get", "probe"],
        &[("TORPOR_API", &s.url), ("TORPOR_TOKEN", TOKEN)],
    );
    assert!(env.status.success(), "{}", err(&env));
    assert!(out(&env).contains("state:"), "{}", out(&env));
    std::fs::write(d.0.join("token"), format!("{TOKEN}\n")).unwrap();
    let dir = d.0.to_str().unwrap();
    let file = torpor_env(
        &["pod", "list"],
        &[("TORPOR_API", &s.url), ("TORPOR_DATA_DIR", dir)],
    );
    assert!(file.status.success(), "{}", err(&file));

    let id = c.ok(&[
        "sandbox",
        "create",
        "--template",
        "probe",
        "--meta",
        "team=cli",
    ]);
    let id = id.trim();
    assert!(id.starts_with("sbx_") && !id.contains('\n'), "{id:?}");
    let table = c.ok(&["sandbox", "list"]);
    assert!(table.starts_with("ID "), "{table}");
    assert!(table.contains("LAST ACTIVE"), "{table}");
    let line = row(&table, id);
    assert!(line.contains("running") && line.contains("probe"), "{line}");
    assert!(line.contains("team=cli"), "{line}");
    let listed = c.json(&["sandbox", "list"]);
    let mine = listed["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["id"] == id)
        .expect("created sandbox in --json list");
    assert_eq!(mine["state"], "running");
    let filtered = c.json(&[
        "sandbox",
        "list",
        "--state",
        "running",
        "--template",
        "probe",
    ]);
    assert_eq!(filtered["sandboxes"].as_array().unwrap().len(), 1);
    let none = c.json(&["sandbox", "list", "--meta", "team=other"]);
    assert_eq!(none["sandboxes"].as_array().unwrap().len(), 0);
    assert!(c.ok(&["sandbox", "get", id]).contains("team=cli"));

    assert!(c.ok(&["sandbox", "pause", id]).contains("paused"));
    assert_eq!(c.state(id), "paused");
    let resumed = c.ok(&["sandbox", "resume", id]);
    assert!(resumed.contains("running") && resumed.contains("not hibernated"));
    assert!(c.ok(&["sandbox", "hibernate", id]).contains("hibernated"));
    assert_eq!(c.state(id), "hibernated");
    let woke = c.ok(&["sandbox", "resume", id]);
    assert!(woke.contains("woke it from hibernation in"), "{woke}");
    assert!(woke.trim_end().ends_with(" ms)"), "{woke}");
    assert_eq!(c.state(id), "running");
    c.ok(&["sandbox", "hibernate", id]);
    let woke = c.json(&["sandbox", "resume", id]);
    assert_eq!(woke["resumed"], true, "{woke}");
    assert!(woke["resume_ms"].as_f64().unwrap() > 0.0, "{woke}");

    let exec = c.fails(&["sandbox", "exec", id, "--", "echo", "hi"]);
    assert!(exec.starts_with("torpor: error: "), "{exec}");
    assert!(exec.contains("(HTTP 422 no_agent)"), "{exec}");
    let stream = c.fails(&["sandbox", "exec", id, "--stream", "--", "echo", "hi"]);
    assert!(stream.contains("(HTTP 422 no_agent)"), "{stream}");
    let get = c.fails(&["sandbox", "files", "get", id, "/etc/hostname"]);
    assert!(get.contains("(HTTP 422 no_agent)"), "{get}");

    let missing = c.fails(&["sandbox", "resume", "sbx_doesnotexist"]);
    assert!(missing.contains("(HTTP 404 not_found)"), "{missing}");
    assert!(c.ok(&["sandbox", "rm", id]).contains("deleted"));
    let running = c.json(&["sandbox", "list", "--state", "running"]);
    assert_eq!(running["sandboxes"].as_array().unwrap().len(), 0);

    let pods = c.ok(&["pod", "list"]);
    let header: Vec<&str> = pods.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        [
            "ID",
            "ADDRESS",
            "MEMORY",
            "RATIO",
            "WATERMARK",
            "COMMITTED",
            "PSS",
            "RESIDENT",
            "SANDBOXES"
        ]
    );
    let pod = c.json(&["pod", "list"])["pods"][0]["id"]
        .as_str()
        .unwrap()
        .to_string();
    let set = c.ok(&["pod", "set", &pod, "--ratio", "2.5"]);
    assert!(set
        .lines()
        .any(|l| l.starts_with("ratio:") && l.ends_with("2.5")));
    let pods = c.json(&["pod", "list"]);
    assert_eq!(pods["pods"][0]["oversubscription_ratio"], 2.5, "{pods}");

    let bad = torpor_env(
        &["sandbox", "list", "--api", &s.url, "--token", "wrong"],
        &[],
    );
    assert_eq!(bad.status.code(), Some(1));
    assert!(
        err(&bad).contains("(HTTP 401 unauthorized)"),
        "{}",
        err(&bad)
    );
    assert!(err(&bad).contains("refused the token"), "{}", err(&bad));
}

#[test]
fn dead_api_and_bad_urls() {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}");
    let o = torpor_env(&["sandbox", "list", "--api", &url, "--token", "t"], &[]);
    assert_eq!(o.status.code(), Some(1));
    let text = err(&o);
    assert!(text.contains(&format!("cannot connect to the torpor API at {url}")));
    assert!(text.contains("connection refused") && text.contains("torpor serve"));
    let o = torpor_env(&["pod", "list"], &[("TORPOR_API", "https://x:1")]);
    assert_eq!(o.status.code(), Some(1));
    assert!(err(&o).contains("needs its certificate"), "{}", err(&o));
    let o = torpor_env(
        &["pod", "list", "--api-fingerprint", "nope"],
        &[("TORPOR_API", "https://x:1")],
    );
    assert_eq!(o.status.code(), Some(1));
    assert!(err(&o).contains("not a SHA-256 fingerprint"), "{}", err(&o));
}

/// Serves one canned answer per connection; gives the requests it read.
fn canned(answers: Vec<String>) -> (String, std::thread::JoinHandle<Vec<String>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let server = std::thread::spawn(move || {
        let mut seen = Vec::new();
        for answer in answers {
            let (s, _) = listener.accept().unwrap();
            let mut r = BufReader::new(s);
            let mut request = String::new();
            while !request.ends_with("\r\n\r\n") && r.read_line(&mut request).unwrap() > 0 {}
            let length = request
                .lines()
                .find_map(|l| l.strip_prefix("Content-Length: "))
                .map_or(0, |n| n.trim().parse().unwrap());
            let mut body = vec![0u8; length];
            r.read_exact(&mut body).unwrap();
            request.push_str(&String::from_utf8(body).unwrap());
            seen.push(request);
            r.get_mut().write_all(answer.as_bytes()).unwrap();
        }
        seen
    });
    (addr, server)
}

#[test]
fn http_framing_and_error_bodies() {
    let pods = r#"{"pods":[{"id":"pod_x","memory_bytes":1073741824,"oversubscription_ratio":2.0,"high_watermark":0.5,"committed_mib":64,"pss_mib":8.5,"resident_mib":7.5,"sandboxes":{"running":1}}]}"#;
    let chunked = format!(
        "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\
         Transfer-Encoding: chunked\r\n\r\n10;ext=1\r\n{}\r\n{:x}\r\n{}\r\n0\r\n\r\n",
        &pods[..16],
        pods.len() - 16,
        &pods[16..]
    );
    let body = r#"{"error":{"code":"conflict","message":"no can do","state":"paused"}}"#;
    let error = format!(
        "HTTP/1.1 409 Conflict\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let (addr, server) = canned(vec![chunked.clone(), chunked, error]);
    let api = format!("http://{addr}/prefix/");
    let base = ["--api", api.as_str(), "--token", "tok"];
    let o = torpor_env(&[&["pod", "list"][..], &base].concat(), &[]);
    assert!(o.status.success(), "{}", err(&o));
    let line = row(&out(&o), "pod_x").to_string();
    for cell in [
        "1024MiB",
        "2.0",
        "0.5",
        "64MiB",
        "8.5MiB",
        "7.5MiB",
        "1 running",
    ] {
        assert!(line.contains(cell), "{cell} in {line}");
    }
    let o = torpor_env(&[&["pod", "list", "--json"][..], &base].concat(), &[]);
    let v: Value = serde_json::from_str(&out(&o)).unwrap();
    assert_eq!(v, serde_json::from_str::<Value>(pods).unwrap());
    let o = torpor_env(
        &[&["pod", "set", "pod_x", "--ratio", "3"][..], &base].concat(),
        &[],
    );
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(err(&o), "torpor: error: no can do (HTTP 409 conflict)\n");
    let seen = server.join().unwrap();
    assert!(
        seen[0].starts_with("GET /prefix/v1/pods HTTP/1.1\r\n"),
        "{}",
        seen[0]
    );
    assert!(
        seen[0].contains("Authorization: Bearer tok\r\n"),
        "{}",
        seen[0]
    );
    assert!(seen[2].starts_with("PATCH /prefix/v1/pods/pod_x HTTP/1.1\r\n"));
    assert!(seen[2].contains("Content-Type: application/json\r\n"));
    assert!(
        seen[2].ends_with(r#"{"oversubscription_ratio":3.0}"#),
        "{}",
        seen[2]
    );
}
