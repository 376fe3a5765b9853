//! Checkpoints, restore and fork through `torpor serve` on loopback, with a
//! probe template whose guest prints `TORPOR-PROBE ITER n=K sum=...` ten
//! times a second: a restored or forked guest must go on from the
//! checkpoint's iteration with the checksums an uninterrupted run prints
//! (the sum of iteration n reads what iteration n-1 wrote, so it is right
//! only if memory came back intact). Also shared layers outliving their
//! source, illegal requests, and kill -9 of the service mid-checkpoint.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::http::{request, HttpResponse};
use common::serve::{DataDir, ServeProcess};
use serde_json::Value;

const TOKEN: &str = "test-token-ckpt-0123456789";
const STALL_ENV: &str = "TORPOR_TEST_STALL_AT";
/// The probe's workload size in the test template.
const MIB: u32 = 1;
const WAIT: Duration = Duration::from_secs(60);

struct Serve {
    process: ServeProcess,
    data: PathBuf,
}

impl Serve {
    fn start(data: &Path, env: &[(&str, &str)]) -> Self {
        let args = ["--token", TOKEN, "--policy-interval-ms", "200"];
        Serve {
            process: ServeProcess::start_with_env(data, &args, env),
            data: data.to_path_buf(),
        }
    }

    fn call(&self, method: &str, path: &str, body: Option<&str>) -> HttpResponse {
        request(&self.process.addr, method, path, Some(TOKEN), body)
    }

    fn ok(&self, method: &str, path: &str, body: Option<&str>) -> Value {
        self.call(method, path, body).ok_json(method, path)
    }

    /// Asserts an error answer and returns its `error` object.
    fn refused(&self, method: &str, path: &str, body: Option<&str>, status: u16) -> Value {
        let r = self.call(method, path, body);
        assert_eq!(r.status, status, "{method} {path}: {}", r.body);
        r.json()["error"].clone()
    }

    /// A template whose probe iterates every 100 ms; its id.
    fn fast_template(&self, name: &str) -> String {
        let body = format!(
            r#"{{"name":"{name}","kind":"probe","mem_mib":64,"cmdline":"probe.mib={MIB} probe.ticks=10 probe.hz=100"}}"#
        );
        let t = self.ok("POST", "/v1/templates", Some(&body));
        let id = t["id"].as_str().unwrap().to_string();
        let deadline = Instant::now() + WAIT;
        while self.ok("GET", &format!("/v1/templates/{id}"), None)["state"] != "ready" {
            assert!(
                Instant::now() < deadline,
                "template {id} never became ready"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        id
    }

    fn create(&self, template: &str) -> String {
        let v = self.ok(
            "POST",
            "/v1/sandboxes",
            Some(&format!(r#"{{"template":"{template}"}}"#)),
        );
        assert_eq!(v["state"], "running", "{v}");
        v["id"].as_str().unwrap().to_string()
    }

    fn sandbox(&self, id: &str) -> Value {
        self.ok("GET", &format!("/v1/sandboxes/{id}"), None)
    }

    fn checkpoint(&self, id: &str, name: &str) -> Value {
        let r = self.call(
            "POST",
            &format!("/v1/sandboxes/{id}/checkpoints"),
            Some(&format!(r#"{{"name":"{name}"}}"#)),
        );
        assert_eq!(r.status, 201, "{}", r.body);
        r.json()
    }

    fn checkpoint_names(&self, id: &str) -> Vec<String> {
        self.ok("GET", &format!("/v1/sandboxes/{id}/checkpoints"), None)["checkpoints"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["name"].as_str().unwrap().to_string())
            .collect()
    }

    fn sandbox_dir(&self, id: &str) -> PathBuf {
        self.data.join("sandboxes").join(id)
    }

    /// The ITER lines of the sandbox's console (its current VMM's run).
    fn iterations(&self, id: &str) -> Vec<(u64, u64)> {
        let text =
            std::fs::read_to_string(self.sandbox_dir(id).join("console.log")).unwrap_or_default();
        text.lines()
            .filter_map(torpor_probe::parse_iter_line)
            .collect()
    }

    fn last_iteration(&self, id: &str) -> u64 {
        self.iterations(id).last().map_or(0, |x| x.0)
    }

    /// Waits until the console shows iteration `n` or later.
    fn wait_iteration(&self, id: &str, n: u64) {
        let deadline = Instant::now() + WAIT;
        while self.last_iteration(id) < n {
            assert!(
                Instant::now() < deadline,
                "{id} never reached iteration {n} (at {})",
                self.last_iteration(id)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn kill9(self) {
        self.process.kill9();
    }
}

/// A restored console starts at the iteration after the last one printed
/// before the snapshot, or one later when the snapshot caught the guest
/// mid-line (that line's tail comes first and does not parse).
///
/// The console's iterations are consecutive and carry the checksums of an
/// uninterrupted run; returns the first iteration.
fn assert_continuous(iters: &[(u64, u64)]) -> u64 {
    assert!(!iters.is_empty(), "no iterations");
    for (i, &(n, sum)) in iters.iter().enumerate() {
        assert_eq!(n, iters[0].0 + i as u64, "not consecutive: {iters:?}");
        assert_eq!(
            sum,
            torpor_probe::iteration_checksum(MIB, n),
            "iteration {n} read memory that is not what iteration {} wrote",
            n - 1
        );
    }
    iters[0].0
}

/// Every directory under `dir`, recursively (for "what is left on disk").
fn dirs_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                out.push(e.path());
                out.extend(dirs_under(&e.path()));
            }
        }
    }
    out.sort();
    out
}

/// Names in the sandbox's directory that are snapshot layers or temp files.
fn snapshot_entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("ckpt-") || n.starts_with("snap-") || n.starts_with('.'))
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

#[test]
fn checkpoint_restore_and_fork_continue_from_the_checkpoint() {
    let d = DataDir::new("ckpt-restore-fork");
    let s = Serve::start(&d.0, &[]);
    let template = s.fast_template("fast");
    let src = s.create(&template);
    s.wait_iteration(&src, 5);

    // Checkpoint while running: the guest stops only for the snapshot.
    let before = s.last_iteration(&src);
    let c1 = s.checkpoint(&src, "c1");
    let after = s.last_iteration(&src);
    assert_eq!(c1["name"], "c1");
    assert_eq!(c1["sandbox"], src.as_str());
    assert!(c1["id"].as_str().unwrap().starts_with("ckp_"), "{c1}");
    assert!(Path::new(c1["snapshot_dir"].as_str().unwrap())
        .join("state")
        .exists());
    assert_eq!(s.sandbox(&src)["state"], "running");
    // The source runs on well past the checkpoint.
    s.wait_iteration(&src, after + 10);
    assert_continuous(&s.iterations(&src));

    // Fork from c1: a new sandbox going on from the checkpoint's iteration.
    let r = s.call(
        "POST",
        &format!("/v1/sandboxes/{src}/fork"),
        Some(r#"{"checkpoint":"c1","metadata":{"role":"fork"}}"#),
    );
    assert_eq!(r.status, 201, "{}", r.body);
    let fork = r.json();
    let fork_id = fork["id"].as_str().unwrap().to_string();
    assert_eq!(fork["state"], "running");
    assert_eq!(fork["metadata"]["role"], "fork");
    assert_eq!(fork["template"], template.as_str());
    s.wait_iteration(&fork_id, 1);
    let fork_first = s.iterations(&fork_id)[0].0;
    assert!(
        (before + 1..=after + 2).contains(&fork_first),
        "fork starts at {fork_first}, checkpoint was taken between {before} and {after}"
    );
    s.wait_iteration(&fork_id, fork_first + 5);
    assert_continuous(&s.iterations(&fork_id));
    // The source went on independently meanwhile.
    let src_now = s.last_iteration(&src);
    assert!(src_now > fork_first + 10, "source at {src_now}");
    assert_eq!(s.sandbox(&src)["state"], "running");

    // Restore the source from c1: its console starts again at the same
    // iteration as the fork's, with the same checksums.
    let old_first = s.iterations(&src)[0].0;
    let out = s.ok(
        "POST",
        &format!("/v1/sandboxes/{src}/restore"),
        Some(r#"{"checkpoint":"c1"}"#),
    );
    assert_eq!(out["sandbox"]["state"], "running", "{out}");
    assert_eq!(out["resumed"], false);
    // The new run's console replaces the old one: until it does, the old
    // run's lines already pass the wait (CI read them once).
    let deadline = Instant::now() + WAIT;
    while s.iterations(&src).first().map(|i| i.0) == Some(old_first) {
        assert!(
            Instant::now() < deadline,
            "the restored run's console never replaced the old one"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    s.wait_iteration(&src, fork_first + 3);
    let restored = s.iterations(&src);
    assert_eq!(assert_continuous(&restored), fork_first, "{restored:?}");
    assert!(restored[0].0 < src_now, "the restore went back in time");

    // A checkpoint of a paused sandbox leaves it paused.
    s.ok("POST", &format!("/v1/sandboxes/{src}/pause"), None);
    s.checkpoint(&src, "while-paused");
    assert_eq!(s.sandbox(&src)["state"], "paused");
    // Restore is legal from paused and leaves it running.
    let out = s.ok(
        "POST",
        &format!("/v1/sandboxes/{src}/restore"),
        Some(r#"{"checkpoint":"while-paused"}"#),
    );
    assert_eq!(out["sandbox"]["state"], "running");

    // A hibernated sandbox's checkpoint references its hibernation
    // snapshot: no copy; restoring from it wakes it.
    s.ok("POST", &format!("/v1/sandboxes/{fork_id}/hibernate"), None);
    let hib = s.sandbox(&fork_id);
    assert_eq!(hib["state"], "hibernated");
    let h1 = s.checkpoint(&fork_id, "h1");
    assert_eq!(h1["snapshot_dir"], hib["snapshot"], "{h1} {hib}");
    assert_eq!(s.sandbox(&fork_id)["state"], "hibernated");
    let at_hibernation = s.last_iteration(&fork_id);
    let out = s.ok(
        "POST",
        &format!("/v1/sandboxes/{fork_id}/restore"),
        Some(r#"{"checkpoint":"h1"}"#),
    );
    assert_eq!(out["sandbox"]["state"], "running");
    assert_eq!(out["resumed"], true);
    s.wait_iteration(&fork_id, at_hibernation + 3);
    let woken = s.iterations(&fork_id);
    assert!(
        (at_hibernation + 1..=at_hibernation + 2).contains(&assert_continuous(&woken)),
        "{woken:?} after hibernating at {at_hibernation}"
    );

    // Fork without a name: a fresh snapshot of the current state.
    let r = s.call("POST", &format!("/v1/sandboxes/{src}/fork"), Some("{}"));
    assert_eq!(r.status, 201, "{}", r.body);
    let fresh = r.json()["id"].as_str().unwrap().to_string();
    s.wait_iteration(&fresh, 1);
    let fresh_first = assert_continuous(&s.iterations(&fresh));
    assert!(fresh_first > fork_first, "{fresh_first} vs {fork_first}");

    assert_eq!(s.checkpoint_names(&src), ["c1", "while-paused"]);
    assert_eq!(s.checkpoint_names(&fork_id), ["h1"]);
}

#[test]
fn illegal_checkpoint_requests() {
    let d = DataDir::new("ckpt-illegal");
    let s = Serve::start(&d.0, &[]);
    let template = s.fast_template("fast");
    let id = s.create(&template);
    let at = |rest: &str| format!("/v1/sandboxes/{id}/{rest}");

    s.checkpoint(&id, "one");
    let e = s.refused("POST", &at("checkpoints"), Some(r#"{"name":"one"}"#), 409);
    assert!(e["message"].as_str().unwrap().contains("already"), "{e}");
    for bad in ["", "has space", "-dash", "a/b", &"x".repeat(65)] {
        let body = serde_json::json!({ "name": bad }).to_string();
        s.refused("POST", &at("checkpoints"), Some(&body), 400);
    }
    s.refused("POST", &at("checkpoints"), Some(r#"{"nom":"x"}"#), 400);
    s.refused(
        "POST",
        &at("restore"),
        Some(r#"{"checkpoint":"nope"}"#),
        404,
    );
    s.refused("POST", &at("fork"), Some(r#"{"checkpoint":"nope"}"#), 404);
    s.refused("DELETE", &at("checkpoints/nope"), None, 404);
    s.refused(
        "POST",
        "/v1/sandboxes/sbx_0000000000000000/checkpoints",
        Some(r#"{"name":"x"}"#),
        404,
    );

    // The template is in use: 409, not 400.
    let e = s.refused("DELETE", &format!("/v1/templates/{template}"), None, 409);
    assert!(e["message"].as_str().unwrap().contains("in use"), "{e}");

    // A failed sandbox (its VMM killed) can be neither checkpointed nor
    // restored nor forked without a checkpoint.
    let pid = s.sandbox(&id)["vmm"]["pid"].as_u64().unwrap();
    Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap();
    let deadline = Instant::now() + WAIT;
    while s.sandbox(&id)["state"] != "failed" {
        assert!(Instant::now() < deadline, "never failed");
        std::thread::sleep(Duration::from_millis(50));
    }
    let e = s.refused("POST", &at("checkpoints"), Some(r#"{"name":"two"}"#), 409);
    assert_eq!(e["state"], "failed");
    let e = s.refused("POST", &at("restore"), Some(r#"{"checkpoint":"one"}"#), 409);
    assert_eq!(e["state"], "failed");
    let e = s.refused("POST", &at("fork"), Some("{}"), 409);
    assert_eq!(e["state"], "failed");

    s.ok("DELETE", &format!("/v1/sandboxes/{id}"), None);
    let e = s.refused("POST", &at("checkpoints"), Some(r#"{"name":"two"}"#), 409);
    assert_eq!(e["state"], "deleted");
    let e = s.refused("POST", &at("fork"), Some(r#"{"checkpoint":"one"}"#), 409);
    assert_eq!(e["state"], "deleted");
    assert_eq!(s.checkpoint_names(&id), Vec::<String>::new());
    // Nothing of it is left on disk, and the template can go now.
    assert!(!s.sandbox_dir(&id).exists());
    s.ok("DELETE", &format!("/v1/templates/{template}"), None);
}

#[test]
fn shared_layers_outlive_their_source_and_go_with_the_last_user() {
    let d = DataDir::new("ckpt-layers");
    let s = Serve::start(&d.0, &[]);
    let template = s.fast_template("fast");
    let src = s.create(&template);
    s.wait_iteration(&src, 3);
    s.checkpoint(&src, "base");
    let r = s.call(
        "POST",
        &format!("/v1/sandboxes/{src}/fork"),
        Some(r#"{"checkpoint":"base"}"#),
    );
    assert_eq!(r.status, 201, "{}", r.body);
    let fork = r.json()["id"].as_str().unwrap().to_string();
    s.wait_iteration(&fork, 1);
    let first = s.iterations(&fork)[0].0;
    s.wait_iteration(&fork, first + 3);
    // The fork's hibernation diff sits on the source's checkpoint layer.
    s.ok("POST", &format!("/v1/sandboxes/{fork}/hibernate"), None);
    let at_hibernation = s.last_iteration(&fork);
    let checkpoint_layers = snapshot_entries(&s.sandbox_dir(&src));
    assert!(
        checkpoint_layers.iter().any(|n| n.starts_with("ckpt-")),
        "{checkpoint_layers:?}"
    );

    // Deleting the source keeps only the layers the fork needs.
    s.ok("DELETE", &format!("/v1/sandboxes/{src}"), None);
    let kept = snapshot_entries(&s.sandbox_dir(&src));
    assert_eq!(kept, checkpoint_layers, "the source's needed layers went");
    assert!(!s.sandbox_dir(&src).join("console.log").exists());
    // So does the orphan sweep of a restart.
    s.kill9();
    let s = Serve::start(&d.0, &[]);
    assert_eq!(snapshot_entries(&s.sandbox_dir(&src)), checkpoint_layers);

    // The fork still wakes, its memory intact across the hibernation.
    let w = s.ok("POST", &format!("/v1/sandboxes/{fork}/resume"), None);
    assert_eq!(w["resumed"], true);
    s.wait_iteration(&fork, at_hibernation + 3);
    let woken = s.iterations(&fork);
    assert!(
        (at_hibernation + 1..=at_hibernation + 2).contains(&assert_continuous(&woken)),
        "{woken:?}"
    );

    // The last user goes: no snapshot of either sandbox is left.
    s.ok("DELETE", &format!("/v1/sandboxes/{fork}"), None);
    assert_eq!(dirs_under(&d.0.join("sandboxes")), Vec::<PathBuf>::new());
    s.ok("DELETE", &format!("/v1/templates/{template}"), None);
    assert!(!d.0.join("templates").join(&template).exists());
    // Gone from the API too (its row stays for the sandboxes that named it).
    let e = s.refused("GET", &format!("/v1/templates/{template}"), None, 404);
    assert_eq!(e["code"], "not_found", "{e}");
    let list = s.ok("GET", "/v1/templates", None);
    assert!(!list.to_string().contains(&template), "{list}");
}

/// Starts a checkpoint on a service stalled at `point`, and kills the
/// service there with SIGKILL. Returns the data dir and the sandbox.
fn kill_mid_checkpoint(name: &str, point: &str) -> (DataDir, String, String) {
    let d = DataDir::new(name);
    let s = Serve::start(&d.0, &[(STALL_ENV, point)]);
    let template = s.fast_template("fast");
    let id = s.create(&template);
    s.wait_iteration(&id, 3);
    let addr = s.process.addr.clone();
    let path = format!("/v1/sandboxes/{id}/checkpoints");
    let caller = std::thread::spawn(move || {
        request(&addr, "POST", &path, Some(TOKEN), Some(r#"{"name":"c1"}"#))
    });
    let marker = d.0.join(format!("stalled-{point}"));
    let deadline = Instant::now() + WAIT;
    while !marker.exists() {
        assert!(Instant::now() < deadline, "never stalled at {point}");
        std::thread::sleep(Duration::from_millis(20));
    }
    s.kill9();
    let _ = caller.join();
    (d, id, template)
}

#[test]
fn kill_9_before_the_snapshot_leaves_no_checkpoint() {
    let (d, id, _) = kill_mid_checkpoint("ckpt-kill-paused", "checkpoint-paused");
    let s = Serve::start(&d.0, &[]);
    assert_eq!(s.checkpoint_names(&id), Vec::<String>::new());
    assert_eq!(snapshot_entries(&s.sandbox_dir(&id)), Vec::<String>::new());
    // The VMM the crash left paused runs again.
    assert_eq!(s.sandbox(&id)["state"], "running");
    let now = s.last_iteration(&id);
    s.wait_iteration(&id, now + 3);
    assert_continuous(&s.iterations(&id));
    // And the name is free.
    s.checkpoint(&id, "c1");
}

#[test]
fn kill_9_after_the_snapshot_keeps_a_whole_checkpoint() {
    let (d, id, _) = kill_mid_checkpoint("ckpt-kill-written", "checkpoint-written");
    let s = Serve::start(&d.0, &[]);
    // The snapshot was complete (and the VMM diffs against it): recovery
    // lists it, whole; nothing half-written is left.
    let listed = s.ok("GET", &format!("/v1/sandboxes/{id}/checkpoints"), None);
    let checkpoints = listed["checkpoints"].as_array().unwrap();
    assert_eq!(checkpoints.len(), 1, "{listed}");
    let dir = PathBuf::from(checkpoints[0]["snapshot_dir"].as_str().unwrap());
    assert!(dir.join("state").exists() && dir.join("memory").exists());
    let entries = snapshot_entries(&s.sandbox_dir(&id));
    assert_eq!(entries.len(), 1, "{entries:?}");
    assert!(entries[0].starts_with("ckpt-"), "{entries:?}");
    assert_eq!(s.sandbox(&id)["state"], "running");
    let now = s.last_iteration(&id);
    s.wait_iteration(&id, now + 3);
    // It restores.
    s.ok(
        "POST",
        &format!("/v1/sandboxes/{id}/restore"),
        Some(r#"{"checkpoint":"c1"}"#),
    );
    s.wait_iteration(&id, 3);
    assert!(assert_continuous(&s.iterations(&id)) <= now + 2);
}

/// `torpor sandbox ...` against this service; stdout, asserting success.
fn cli(s: &Serve, args: &[&str]) -> String {
    let url = s.process.url();
    let out = Command::new(common::TORPOR)
        .arg("sandbox")
        .args(["--api", &url, "--token", TOKEN])
        .args(args)
        .env_remove("TORPOR_API")
        .env_remove("TORPOR_TOKEN")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "torpor sandbox {args:?}: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn cli_checkpoint_restore_fork() {
    let d = DataDir::new("ckpt-cli");
    let s = Serve::start(&d.0, &[]);
    let template = s.fast_template("fast");
    let id = s.create(&template);
    s.wait_iteration(&id, 2);

    let said = cli(&s, &["checkpoint", &id, "first"]);
    assert!(said.contains("checkpoint first (ckp_"), "{said}");
    let v: Value =
        serde_json::from_str(&cli(&s, &["checkpoint", &id, "second", "--json"])).unwrap();
    assert_eq!(v["name"], "second");

    let table = cli(&s, &["checkpoints", &id]);
    let lines: Vec<&str> = table.lines().collect();
    assert!(lines[0].starts_with("NAME "), "{table}");
    assert!(lines[1].starts_with("first "), "{table}");
    // `second` sits on `first`'s layer: its parent, by name.
    assert!(
        lines[2].starts_with("second ") && lines[2].contains(" first "),
        "{table}"
    );
    let v: Value = serde_json::from_str(&cli(&s, &["checkpoints", &id, "--json"])).unwrap();
    assert_eq!(v["checkpoints"].as_array().unwrap().len(), 2);

    let said = cli(&s, &["restore", &id, "first"]);
    assert!(
        said.contains(": running (restored from checkpoint first in "),
        "{said}"
    );

    let fork = cli(&s, &["fork", &id, "second", "--meta", "k=v"]);
    let fork = fork.trim();
    assert!(fork.starts_with("sbx_"), "{fork}");
    assert_eq!(s.sandbox(fork)["metadata"]["k"], "v");
    let fresh = cli(&s, &["fork", &id]);
    assert_eq!(s.sandbox(fresh.trim())["state"], "running");

    let said = cli(&s, &["rm-checkpoint", &id, "first"]);
    assert!(said.contains("checkpoint first deleted"), "{said}");
    assert_eq!(s.checkpoint_names(&id), ["second"]);
}

#[test]
fn kill_9_mid_restore_is_finished_at_restart() {
    let d = DataDir::new("ckpt-kill-restore");
    let s = Serve::start(&d.0, &[(STALL_ENV, "restore-stopped")]);
    let template = s.fast_template("fast");
    let id = s.create(&template);
    s.wait_iteration(&id, 3);
    let before = s.last_iteration(&id);
    s.checkpoint(&id, "c1");
    let after = s.last_iteration(&id);
    s.wait_iteration(&id, after + 10);
    let addr = s.process.addr.clone();
    let path = format!("/v1/sandboxes/{id}/restore");
    let caller = std::thread::spawn(move || {
        request(
            &addr,
            "POST",
            &path,
            Some(TOKEN),
            Some(r#"{"checkpoint":"c1"}"#),
        )
    });
    let marker = d.0.join("stalled-restore-stopped");
    let deadline = Instant::now() + WAIT;
    while !marker.exists() {
        assert!(Instant::now() < deadline, "never stalled");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The old VMM is gone, the new one not started.
    assert_eq!(s.sandbox(&id)["state"], "resuming");
    s.kill9();
    let _ = caller.join();

    let s = Serve::start(&d.0, &[]);
    let v = s.sandbox(&id);
    assert_eq!(v["state"], "running", "{v}");
    s.wait_iteration(&id, 1);
    let first = s.iterations(&id)[0].0;
    assert!(
        (before + 1..=after + 2).contains(&first),
        "restored at {first}, checkpoint taken between {before} and {after}"
    );
    s.wait_iteration(&id, first + 3);
    assert_continuous(&s.iterations(&id));
}
