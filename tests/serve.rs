//! `torpor serve` on loopback with probe templates: lifecycle, illegal
//! transitions, auth, malformed input, idle hibernation and wake-up,
//! watermark order, ratio changes, and recovery after kill -9.

mod common;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::http::{declared_only, request, HttpResponse};
use common::serve::{DataDir, ServeProcess};

const TOKEN: &str = "test-token-0123456789";

/// The service under test, with the requests the tests make of it.
struct Serve(ServeProcess);

impl Serve {
    fn start(data: &Path, extra: &[&str]) -> Self {
        let mut args = vec!["--token", TOKEN, "--policy-interval-ms", "200"];
        args.extend_from_slice(extra);
        Serve(ServeProcess::start(data, &args))
    }

    fn call(&self, method: &str, path: &str, body: Option<&str>) -> HttpResponse {
        request(&self.0.addr, method, path, Some(TOKEN), body)
    }

    fn ok(&self, method: &str, path: &str, body: Option<&str>) -> serde_json::Value {
        self.call(method, path, body).ok_json(method, path)
    }

    fn create(&self, body: &str) -> String {
        let v = self.ok("POST", "/v1/sandboxes", Some(body));
        assert_eq!(v["state"], "running", "{v}");
        v["id"].as_str().unwrap().to_string()
    }

    fn state(&self, id: &str) -> String {
        self.ok("GET", &format!("/v1/sandboxes/{id}"), None)["state"]
            .as_str()
            .unwrap()
            .to_string()
    }

    fn wait_state(&self, id: &str, want: &str, limit: Duration) {
        let deadline = Instant::now() + limit;
        while self.state(id) != want {
            assert!(
                Instant::now() < deadline,
                "{id} never became {want} (is {})",
                self.state(id)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn kill9(self) {
        self.0.kill9();
    }
}

fn data(name: &str) -> DataDir {
    DataDir::new(name)
}

#[test]
fn lifecycle_and_illegal_transitions() {
    let d = data("serve-lifecycle");
    let s = Serve::start(&d.0, &[]);
    assert_eq!(
        request(&s.0.addr, "GET", "/healthz", None, None).status,
        200
    );
    let probe = probe_template(&s);
    assert_eq!(probe["state"], "ready");

    let id = s.create(r#"{"template":"probe","metadata":{"team":"a"}}"#);
    let listed = s.ok("GET", "/v1/sandboxes?metadata.team=a", None);
    assert_eq!(listed["sandboxes"].as_array().unwrap().len(), 1);
    let none = s.ok("GET", "/v1/sandboxes?metadata.team=b", None);
    assert_eq!(none["sandboxes"].as_array().unwrap().len(), 0);

    assert_eq!(
        s.ok("POST", &format!("/v1/sandboxes/{id}/pause"), None)["sandbox"]["state"],
        "paused"
    );
    assert_eq!(
        s.ok("POST", &format!("/v1/sandboxes/{id}/resume"), None)["sandbox"]["state"],
        "running"
    );
    let h = s.ok("POST", &format!("/v1/sandboxes/{id}/hibernate"), None);
    assert_eq!(h["sandbox"]["state"], "hibernated");

    // Pausing a hibernated sandbox is illegal: 409 with the current state.
    let r = s.call("POST", &format!("/v1/sandboxes/{id}/pause"), None);
    assert_eq!(r.status, 409, "{}", r.body);
    assert_eq!(r.json()["error"]["state"], "hibernated", "{}", r.body);

    let w = s.ok("POST", &format!("/v1/sandboxes/{id}/resume"), None);
    assert_eq!(w["sandbox"]["state"], "running");
    assert_eq!(w["resumed"], true);
    assert!(w["resume_ms"].as_f64().unwrap() > 0.0);

    let r = s.call("DELETE", &format!("/v1/sandboxes/{id}"), None);
    assert!(
        r.status == 200 || r.status == 204,
        "{} {}",
        r.status,
        r.body
    );
    let r = s.call("POST", &format!("/v1/sandboxes/{id}/resume"), None);
    assert_eq!(r.status, 409, "{}", r.body);
    assert_eq!(
        s.call("GET", "/v1/sandboxes/sbx_doesnotexist", None).status,
        404
    );
    assert_eq!(
        s.call("POST", "/v1/sandboxes", Some(r#"{"template":"nope"}"#))
            .status,
        404
    );
}

#[test]
fn auth_and_malformed_requests() {
    let d = data("serve-auth");
    let s = Serve::start(&d.0, &[]);
    assert_eq!(
        request(&s.0.addr, "GET", "/v1/sandboxes", None, None).status,
        401
    );
    assert_eq!(
        request(&s.0.addr, "GET", "/v1/sandboxes", Some("wrong"), None).status,
        401
    );
    assert_eq!(
        request(&s.0.addr, "GET", "/metrics", None, None).status,
        401
    );
    assert_eq!(
        request(&s.0.addr, "GET", "/v1/openapi.json", None, None).status,
        200
    );
    let r = s.call("POST", "/v1/sandboxes", Some("{not json"));
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.json()["error"]["code"].is_string());
    // A body past the limit is refused from its Content-Length, before
    // any of it is read.
    let auth = format!("Bearer {TOKEN}");
    let headers = [("Authorization", auth.as_str())];
    let r = declared_only(&s.0.addr, "POST", "/v1/sandboxes", &headers, 2 << 20);
    assert_eq!(r.status, 413, "{}", r.body);
    // A probe template whose workload (4 MiB at 16 MiB, the probe's default
    // without a cmdline) does not fit its memory: 400 as soon as the probe
    // says so, not a 500 after the build's wait (found by scripts/fuzz-api):
    // 422, the request being valid by the schema.
    let r = s.call(
        "POST",
        "/v1/templates",
        Some(r#"{"name":"tiny","kind":"probe","mem_mib":17,"cmdline":""}"#),
    );
    assert_eq!(r.status, 422, "{}", r.body);
    assert!(r.body.contains("probe.mib"), "{}", r.body);
    let m = s.call("GET", "/metrics", None);
    assert_eq!(m.status, 200);
    assert!(
        m.body.contains("torpor_sandboxes{state=\"running\"}"),
        "{}",
        m.body
    );
}

#[test]
fn idle_sandboxes_hibernate_and_wake_on_request() {
    let d = data("serve-idle");
    let s = Serve::start(&d.0, &[]);
    let id = s.create(r#"{"template":"probe","keep_alive_ms":300}"#);
    s.wait_state(&id, "hibernated", Duration::from_secs(30));
    let w = s.ok("POST", &format!("/v1/sandboxes/{id}/resume"), None);
    assert_eq!(w["resumed"], true);
    assert_eq!(s.state(&id), "running");
}

#[test]
fn connect_runs_the_sandbox_whatever_it_was_doing() {
    let d = data("serve-connect");
    let s = Serve::start(&d.0, &[]);
    let id = s.create(r#"{"template":"probe"}"#);
    let connect = format!("/v1/sandboxes/{id}/connect");
    // Running: nothing to wake, it stays running.
    let c = s.ok("POST", &connect, None);
    assert_eq!(c["resumed"], false, "{c}");
    assert_eq!(c["sandbox"]["state"], "running");
    // Paused: resumed, without a wake from hibernation.
    s.ok("POST", &format!("/v1/sandboxes/{id}/pause"), None);
    let c = s.ok("POST", &connect, None);
    assert_eq!(c["resumed"], false, "{c}");
    assert_eq!(s.state(&id), "running");
    // Hibernated: woken from its snapshot, and says how long it took.
    s.ok("POST", &format!("/v1/sandboxes/{id}/hibernate"), None);
    let c = s.ok("POST", &connect, None);
    assert_eq!(c["resumed"], true, "{c}");
    assert!(c["resume_ms"].as_f64().unwrap() > 0.0, "{c}");
    assert_eq!(s.state(&id), "running");
    // Deleted: nothing to connect to.
    let r = s.call("DELETE", &format!("/v1/sandboxes/{id}"), None);
    assert_eq!(r.status, 204, "{}", r.body);
    let r = s.call("POST", &connect, None);
    assert_eq!(r.status, 409, "{}", r.body);
    assert_eq!(r.json()["error"]["state"], "deleted", "{}", r.body);
}

#[test]
fn ratio_changes_gate_admission() {
    let d = data("serve-ratio");
    let s = Serve::start(&d.0, &[]);
    let pods = s.ok("GET", "/v1/pods", None);
    let pod = pods["pods"][0]["id"].as_str().unwrap().to_string();
    let v = s.ok(
        "PATCH",
        &format!("/v1/pods/{pod}"),
        Some(r#"{"oversubscription_ratio":0.000001}"#),
    );
    assert_eq!(v["oversubscription_ratio"], 0.000001);
    let r = s.call("POST", "/v1/sandboxes", Some(r#"{"template":"probe"}"#));
    assert_eq!(r.status, 429, "{}", r.body);
    let bad = s.call(
        "PATCH",
        &format!("/v1/pods/{pod}"),
        Some(r#"{"oversubscription_ratio":-1}"#),
    );
    assert_eq!(bad.status, 400, "{}", bad.body);
    s.ok(
        "PATCH",
        &format!("/v1/pods/{pod}"),
        Some(r#"{"oversubscription_ratio":4}"#),
    );
    s.create(r#"{"template":"probe"}"#);
}

#[test]
fn watermark_hibernates_least_recently_used_first() {
    let d = data("serve-watermark");
    let s = Serve::start(&d.0, &[]);
    let old = s.create(r#"{"template":"probe"}"#);
    let young = s.create(r#"{"template":"probe"}"#);
    // Make `young` the most recently used.
    s.ok("POST", &format!("/v1/sandboxes/{young}/pause"), None);
    s.ok("POST", &format!("/v1/sandboxes/{young}/resume"), None);
    let pod = &s.ok("GET", "/v1/pods", None)["pods"][0];
    let (resident, mem) = (
        pod["resident_mib"].as_f64().unwrap(),
        pod["memory_bytes"].as_f64().unwrap(),
    );
    // A watermark just under the current use: hibernating one clears it
    // (and gets below the low mark, 0.9 of it).
    let mark = (resident * 0.75) * 1048576.0 / mem;
    let id = pod["id"].as_str().unwrap();
    s.ok(
        "PATCH",
        &format!("/v1/pods/{id}"),
        Some(&format!(r#"{{"high_watermark":{mark}}}"#)),
    );
    s.wait_state(&old, "hibernated", Duration::from_secs(30));
    assert_eq!(s.state(&young), "running");
}

#[test]
fn kill_9_of_serve_loses_nothing() {
    let d = data("serve-kill9");
    let s = Serve::start(&d.0, &[]);
    let running = s.create(r#"{"template":"probe"}"#);
    let hibernated = s.create(r#"{"template":"probe"}"#);
    s.ok(
        "POST",
        &format!("/v1/sandboxes/{hibernated}/hibernate"),
        None,
    );
    let pid = s.ok("GET", &format!("/v1/sandboxes/{running}"), None)["vmm"]["pid"].clone();
    s.kill9();

    let s = Serve::start(&d.0, &[]);
    let v = s.ok("GET", &format!("/v1/sandboxes/{running}"), None);
    assert_eq!(v["state"], "running", "{v}");
    assert_eq!(v["vmm"]["pid"], pid, "re-attached to the same VMM");
    assert_eq!(s.state(&hibernated), "hibernated");
    s.ok("POST", &format!("/v1/sandboxes/{running}/pause"), None);
    s.ok("POST", &format!("/v1/sandboxes/{hibernated}/resume"), None);
    assert_eq!(s.state(&hibernated), "running");
}

/// Creates, pauses, resumes and wakes commit without an fsync (what they
/// record is a running or paused VMM, which a power cut ends anyway; see
/// `Store::write_relaxed`), yet each is in the database once it is
/// answered: a kill -9 of serve right after the last answer loses none.
#[test]
fn kill_9_right_after_the_answers_keeps_every_state_change() {
    let d = data("serve-kill9-relaxed");
    let s = Serve::start(&d.0, &[]);
    let ids: Vec<String> = (0..5)
        .map(|_| s.create(r#"{"template":"probe"}"#))
        .collect();
    let op = |id: &str, what: &str| s.ok("POST", &format!("/v1/sandboxes/{id}/{what}"), None);
    op(&ids[0], "pause");
    op(&ids[1], "pause");
    op(&ids[1], "resume");
    op(&ids[2], "hibernate");
    let woken = op(&ids[2], "resume");
    assert_eq!(woken["resumed"], true, "{woken}");
    let pids: Vec<serde_json::Value> = ids
        .iter()
        .map(|id| s.ok("GET", &format!("/v1/sandboxes/{id}"), None)["vmm"]["pid"].clone())
        .collect();
    s.kill9();

    let s = Serve::start(&d.0, &[]);
    let want = ["paused", "running", "running", "running", "running"];
    for ((id, want), pid) in ids.iter().zip(want).zip(&pids) {
        let v = s.ok("GET", &format!("/v1/sandboxes/{id}"), None);
        assert_eq!(v["state"], want, "{v}");
        assert_eq!(&v["vmm"]["pid"], pid, "re-attached to the same VMM: {v}");
    }
}

#[test]
fn kill_9_of_one_vmm_fails_only_its_sandbox() {
    let d = data("serve-vmm-kill");
    let s = Serve::start(&d.0, &[]);
    let victim = s.create(r#"{"template":"probe"}"#);
    let bystander = s.create(r#"{"template":"probe"}"#);
    let pid = s.ok("GET", &format!("/v1/sandboxes/{victim}"), None)["vmm"]["pid"]
        .as_u64()
        .unwrap();
    // SAFETY-free: a plain kill(1) of the VMM process.
    Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap();
    s.wait_state(&victim, "failed", Duration::from_secs(30));
    assert_eq!(s.state(&bystander), "running");
}

/// Pids of the `torpor-vmm` processes whose log (stderr) is under `dir`.
fn vmms_logging_under(dir: &Path) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .is_ok_and(|c| c.trim() == "torpor-vmm")
                && std::fs::read_link(format!("/proc/{pid}/fd/2")).is_ok_and(|t| t.starts_with(dir))
        })
        .collect()
}

/// Whether process `pid` still runs (a zombie does not).
fn runs(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z'))
    })
}

/// Jailed standby shells outlive a kill -9 of serve (a shell's parent is
/// its supervisor, not the pod), and one taken for a restore may have had
/// its socket moved into the sandbox's directory already, its log not: no
/// socket to ask it to shut down, no log where recovery looks. The
/// restarted serve ends every shell of the earlier run, found by its log.
#[test]
fn kill_9_of_serve_leaves_no_standby_shell_behind() {
    let d = data("serve-kill9-shells");
    let s = Serve::start(&d.0, &[]);
    let pool = d.0.canonicalize().unwrap().join("pool");
    let deadline = Instant::now() + Duration::from_secs(30);
    let sockets = loop {
        let sockets: Vec<_> = std::fs::read_dir(&pool)
            .unwrap()
            .flatten()
            .map(|e| e.path().join("ctl.sock"))
            .filter(|p| p.exists())
            .collect();
        if sockets.len() >= 2 {
            break sockets;
        }
        assert!(Instant::now() < deadline, "the pool made no 2 shells");
        std::thread::sleep(Duration::from_millis(50));
    };
    s.kill9();
    // Taken: its socket in a sandbox's directory, its log still here.
    let taken = sockets[0].parent().unwrap().to_path_buf();
    let sandbox = d.0.join("sandboxes").join("taken");
    std::fs::create_dir_all(&sandbox).unwrap();
    std::fs::rename(&sockets[0], sandbox.join("ctl.sock")).unwrap();
    let left = vmms_logging_under(&pool);
    assert!(
        !vmms_logging_under(&taken).is_empty(),
        "the taken shell died with serve (unjailed?): nothing to test"
    );

    let _s = Serve::start(&d.0, &[]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while left.iter().any(|&p| runs(p)) {
        assert!(
            Instant::now() < deadline,
            "shells of the killed serve still run: {:?}",
            left.iter().filter(|&&p| runs(p)).collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(!taken.exists());
}

/// A snapshot's page list `name` (`working-set`, `touched`): little-endian
/// u64 page numbers.
fn pages(dir: &Path, name: &str) -> Vec<u64> {
    let bytes = std::fs::read(dir.join(name))
        .unwrap_or_else(|e| panic!("{}: no {name}: {e}", dir.display()));
    assert_eq!(bytes.len() % 8, 0, "{}", dir.display());
    bytes
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// The built-in probe template as `GET /v1/templates` lists it.
fn probe_template(s: &Serve) -> serde_json::Value {
    let templates = s.ok("GET", "/v1/templates", None);
    templates["templates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "probe")
        .expect("built-in probe template")
        .clone()
}

/// The probe's iteration lines in a sandbox's console, once there are `n`.
fn wait_iterations(data: &Path, id: &str, n: usize) {
    let console = data.join("sandboxes").join(id).join("console.log");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let iters = std::fs::read_to_string(&console)
            .unwrap_or_default()
            .lines()
            .filter_map(torpor_probe::parse_iter_line)
            .count();
        if iters >= n {
            return;
        }
        assert!(Instant::now() < deadline, "{id}: {iters} iterations");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_uffd_sandboxs_hibernation_records_the_pages_its_guest_was_given() {
    // With a uffd backend a sandbox's hibernation layer records the pages
    // its guest was given: every page its page server installed since the
    // restore (the template's prefetched set, then what the guest faulted
    // in), whose chunks a lazy wake from it fetches first; not only what
    // its template touched in its first 300 ms.
    use torpor_vmm_api::lineage::{TOUCHED_FILE, WORKING_SET_FILE};
    let d = data("serve-working-set");
    let s = Serve::start(&d.0, &["--memory-backend", "uffd"]);
    let probe = probe_template(&s);
    let template_dir = PathBuf::from(probe["snapshot_dir"].as_str().expect("snapshot_dir"));
    let template_set = pages(&template_dir, WORKING_SET_FILE);
    assert!(!template_set.is_empty());

    let id = s.create(r#"{"template":"probe"}"#);
    wait_iterations(&d.0, &id, 3);
    let h = s.ok("POST", &format!("/v1/sandboxes/{id}/hibernate"), None);
    assert_eq!(h["sandbox"]["state"], "hibernated", "{h}");
    let layer = PathBuf::from(h["sandbox"]["snapshot"].as_str().expect("snapshot"));
    let set = pages(&layer, TOUCHED_FILE);
    let unique: HashSet<u64> = set.iter().copied().collect();
    let template: HashSet<u64> = template_set.iter().copied().collect();
    let beyond = unique.difference(&template).count();
    println!(
        "template set {} pages, hibernation's {} ({beyond} beyond the template's)",
        template.len(),
        set.len()
    );
    assert_eq!(unique.len(), set.len(), "a page twice in {set:?}");
    assert!(beyond > 0, "no page beyond the template's set");
    // The probe's 1 MiB workload, rewritten every iteration, is in it.
    assert!(beyond >= 256, "{beyond} pages beyond the template's set");
    // Woken (prefetching its template's set only): the guest goes on.
    let w = s.ok("POST", &format!("/v1/sandboxes/{id}/resume"), None);
    assert_eq!(w["sandbox"]["state"], "running", "{w}");
    let woken = std::fs::read_to_string(d.0.join("sandboxes").join(&id).join("console.log"))
        .unwrap_or_default()
        .lines()
        .filter_map(torpor_probe::parse_iter_line)
        .count();
    wait_iterations(&d.0, &id, woken + 2);
    // A snapshot taken by this VMM records the pages it installed since
    // the wake: the workload again.
    let h = s.ok("POST", &format!("/v1/sandboxes/{id}/hibernate"), None);
    let again = PathBuf::from(h["sandbox"]["snapshot"].as_str().expect("snapshot"));
    assert_ne!(again, layer);
    let set2: HashSet<u64> = pages(&again, TOUCHED_FILE).into_iter().collect();
    let beyond2 = set2.difference(&template).count();
    assert!(beyond2 >= 256, "{beyond2} pages beyond the template's set");
}
