//! A `torpor serve` for the benches that drive it through its API (`api`,
//! `plan`): started on a free loopback port in its own process group with a
//! scratch data directory, stopped (sandboxes deleted, SIGINT, SIGKILL,
//! leftover VMMs killed) on drop.

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::{http, TORPOR};

/// The admin token the benches' serve accepts.
pub const TOKEN: &str = "bench-token-0123456789";
/// Every request but a template build is answered within this.
pub const REQUEST_LIMIT: Duration = Duration::from_secs(120);
/// A template build (boot, snapshot) is answered within this.
pub const BUILD_LIMIT: Duration = Duration::from_secs(600);
/// `torpor serve` listens within this (it builds the built-in probe first).
const START_LIMIT: Duration = Duration::from_secs(180);
/// `torpor serve` exits within this after SIGINT, else SIGKILL.
const STOP_LIMIT: Duration = Duration::from_secs(20);

/// One `torpor serve` in its own process group, its data directory under
/// `dir`; stopped (sandboxes deleted, group killed, leftover VMMs killed)
/// on drop.
pub struct Serve {
    child: Option<Child>,
    addr: String,
    dir: PathBuf,
}

pub enum Started {
    Up(Serve),
    /// It refused its command line (an unknown flag): the line that says so.
    Rejected(String),
    Failed(String),
}

impl Serve {
    pub fn start(dir: &Path, flags: &[String]) -> Started {
        Self::start_exe(Path::new(TORPOR), dir, flags)
    }

    /// [`Serve::start`] of another `torpor` build (its `torpor-vmm` beside
    /// it): A/B comparisons in one run.
    pub fn start_exe(exe: &Path, dir: &Path, flags: &[String]) -> Started {
        let data = dir.join("data");
        if let Err(e) = std::fs::create_dir_all(&data) {
            return Started::Failed(format!("create {}: {e}", data.display()));
        }
        let log = match std::fs::File::create(dir.join("serve.log")) {
            Ok(f) => f,
            Err(e) => return Started::Failed(format!("create serve.log: {e}")),
        };
        let spawned = Command::new(exe)
            .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
            .arg(&data)
            .args(["--token", TOKEN])
            // No policy unless the bench asks for one.
            .args(if flags.iter().any(|f| f == "--policy-interval-ms") {
                &[][..]
            } else {
                &["--policy-interval-ms", "0"][..]
            })
            .args(flags)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .process_group(0)
            .spawn();
        let mut child = match spawned {
            Ok(c) => c,
            Err(e) => return Started::Failed(format!("spawn {} serve: {e}", exe.display())),
        };
        let (tx, rx) = mpsc::channel();
        if let Some(out) = child.stdout.take() {
            std::thread::spawn(move || {
                // Reads to the end so the service never blocks on stdout.
                for line in BufReader::new(out).lines().map_while(Result::ok) {
                    if let Some(rest) = line.split("listening on http://").nth(1) {
                        let _ = tx.send(rest.trim().to_string());
                    }
                }
            });
        }
        let mut serve = Serve {
            child: Some(child),
            addr: String::new(),
            dir: dir.to_path_buf(),
        };
        let addr = match rx.recv_timeout(START_LIMIT) {
            Ok(addr) => addr,
            Err(e) => {
                // Stdout closed (it exited) or it never listened.
                let why = if e == mpsc::RecvTimeoutError::Timeout {
                    format!("did not listen within {START_LIMIT:?}")
                } else {
                    "exited before listening".to_string()
                };
                serve.kill_group();
                let log = serve.log_tail(12);
                if let Some(l) = log.lines().find(|l| l.contains("unexpected argument")) {
                    return Started::Rejected(l.trim().to_string());
                }
                return Started::Failed(format!("torpor serve {why}; its log ends:\n{log}"));
            }
        };
        serve.addr = addr;
        Started::Up(serve)
    }

    /// `host:port` it listens on.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    pub fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    pub fn console(&self, id: &str) -> PathBuf {
        self.data().join("sandboxes").join(id).join("console.log")
    }

    pub fn log_tail(&self, n: usize) -> String {
        let log = std::fs::read_to_string(self.dir.join("serve.log")).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(n).collect();
        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
    }

    /// One request: (status, body text).
    pub fn raw(
        &self,
        method: &str,
        path: &str,
        body: Option<&str>,
        limit: Duration,
    ) -> Result<(u16, String), String> {
        http::request(&self.addr, TOKEN, method, path, body, limit)
            .map_err(|e| format!("{method} {path}: {e}"))
    }

    /// A request that must answer `want`; its JSON (Null when empty).
    pub fn expect(
        &self,
        want: u16,
        method: &str,
        path: &str,
        body: Option<&str>,
    ) -> Result<Value, String> {
        let (status, text) = self.raw(method, path, body, REQUEST_LIMIT)?;
        parse(want, status, &text).map_err(|e| format!("{method} {path}: {e}"))
    }

    /// [`Self::raw`] with a body of any type (`content_type`, bytes).
    pub fn raw_bytes(
        &self,
        method: &str,
        path: &str,
        body: (&str, &[u8]),
        limit: Duration,
    ) -> Result<(u16, String), String> {
        http::request_bytes(&self.addr, TOKEN, method, path, body, limit)
            .map_err(|e| format!("{method} {path}: {e}"))
    }

    /// Asks for a sandbox of `template` until one is made (503 while the
    /// nested host comes up, for the Linux templates), then deletes it; how
    /// long it took.
    pub fn wait_template(&self, template: &str, limit: Duration) -> Result<Duration, String> {
        let started = Instant::now();
        loop {
            let body = format!(r#"{{"template":"{template}"}}"#);
            let (status, text) = self.raw(
                "POST",
                "/v1/sandboxes",
                Some(&body),
                Duration::from_secs(600),
            )?;
            match status {
                201 => {
                    let v: Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
                    self.delete(v["id"].as_str().unwrap_or_default())?;
                    return Ok(started.elapsed());
                }
                503 if started.elapsed() < limit => std::thread::sleep(Duration::from_secs(5)),
                _ => return Err(format!("create {template}: {status} {text}")),
            }
        }
    }

    pub fn delete(&self, id: &str) -> Result<(), String> {
        self.expect(204, "DELETE", &format!("/v1/sandboxes/{id}"), None)
            .map(drop)
    }

    /// Builds a probe template of `mem` MiB (with `cmdline`, if given);
    /// its id once ready.
    pub fn build_template(
        &self,
        name: &str,
        mem: u32,
        cmdline: Option<&str>,
    ) -> Result<String, String> {
        let mut body =
            serde_json::json!({"name": name, "kind": "probe", "mem_mib": mem, "vcpus": 1});
        if let Some(c) = cmdline {
            body["cmdline"] = serde_json::json!(c);
        }
        let (status, text) = self.raw(
            "POST",
            "/v1/templates",
            Some(&body.to_string()),
            BUILD_LIMIT,
        )?;
        let want = if status == 202 { 202 } else { 201 };
        let v = parse(want, status, &text).map_err(|e| format!("template {name}: {e}"))?;
        let id = v["id"].as_str().ok_or(format!("no id in {v}"))?.to_string();
        let deadline = Instant::now() + BUILD_LIMIT;
        let mut t = v;
        loop {
            match t["state"].as_str() {
                Some("ready") => return Ok(id),
                Some("building") if Instant::now() < deadline => {}
                _ => return Err(format!("template {name} did not become ready: {t}")),
            }
            std::thread::sleep(Duration::from_millis(200));
            t = self.expect(200, "GET", &format!("/v1/templates/{id}"), None)?;
        }
    }

    /// Its children that are VMMs (sandboxes' and standby shells).
    pub fn vmm_children(&self) -> Vec<u32> {
        vmm_children(self.pid())
    }

    /// Deletes every sandbox, stops the service (SIGINT to its group, then
    /// SIGKILL), kills VMMs it left and removes its scratch directory.
    /// Returns what it had to force.
    pub fn stop(&mut self) -> Vec<String> {
        if self.child.is_none() {
            return Vec::new();
        }
        let notes = self.stop_keeping_data();
        // The nested host it started outlives it (a restarted serve would
        // re-attach to it): stopped with it.
        drop(super::nested_host::StopNestedHost(self.dir.join("data")));
        if std::env::var_os("TORPOR_KEEP_SCRATCH").is_none() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
        notes
    }

    /// [`Serve::stop`] but for the scratch directory, which stays: a
    /// [`Serve::start`] on it starts the service again on the same data
    /// (its store, templates and snapshots).
    pub fn stop_keeping_data(&mut self) -> Vec<String> {
        let mut notes = Vec::new();
        if self.child.is_none() {
            return notes;
        }
        if !self.addr.is_empty() {
            let list = self.expect(200, "GET", "/v1/sandboxes", None);
            let all = list.map(|l| l["sandboxes"].as_array().cloned().unwrap_or_default());
            for s in all.unwrap_or_default() {
                if let Some(id) = s["id"].as_str() {
                    if let Err(e) = self.delete(id) {
                        notes.push(format!("at stop: {e}"));
                    }
                }
            }
        }
        let vmms = self.vmm_children();
        if !self.kill_group() {
            notes.push(format!(
                "torpor serve ignored SIGINT for {STOP_LIMIT:?}: killed"
            ));
        }
        let left: Vec<u32> = vmms.into_iter().filter(|p| is_vmm(*p)).collect();
        for &pid in &left {
            // SAFETY: a torpor-vmm this bench's serve started (checked by name).
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
        }
        if !left.is_empty() {
            notes.push(format!("{} VMMs outlived torpor serve: killed", left.len()));
        }
        notes
    }

    /// SIGINT to the service's process group, SIGKILL after STOP_LIMIT;
    /// whether it stopped on SIGINT.
    pub fn kill_group(&mut self) -> bool {
        let Some(mut child) = self.child.take() else {
            return true;
        };
        let pgid = child.id() as libc::pid_t;
        // SAFETY: signalling the process group of the serve this bench spawned.
        unsafe { libc::kill(-pgid, libc::SIGINT) };
        let deadline = Instant::now() + STOP_LIMIT;
        while Instant::now() < deadline {
            if child.try_wait().ok().flatten().is_some() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // SAFETY: as above.
        unsafe { libc::kill(-pgid, libc::SIGKILL) };
        let _ = child.wait();
        false
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        for n in self.stop() {
            eprintln!("bench: {n}");
        }
    }
}

/// Checks the status and parses the body (Null when empty).
pub fn parse(want: u16, status: u16, text: &str) -> Result<Value, String> {
    if status != want {
        return Err(format!("HTTP {status} (want {want}): {}", text.trim()));
    }
    if text.trim().is_empty() {
        return Ok(Value::Null);
    }
    serde_json::from_str(text).map_err(|e| format!("not JSON ({e}): {text}"))
}

/// (name, state, parent) of a process, from /proc/PID/stat.
pub fn proc_stat(pid: u32) -> Option<(String, char, u32)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) state ppid ...": comm may hold spaces and parentheses.
    let (head, rest) = stat.rsplit_once(')')?;
    let name = head.split_once('(')?.1.to_string();
    let mut f = rest.split_whitespace();
    let state = f.next()?.chars().next()?;
    let ppid = f.next()?.parse().ok()?;
    Some((name, state, ppid))
}

/// A live (not zombie) torpor-vmm.
pub fn is_vmm(pid: u32) -> bool {
    proc_stat(pid).is_some_and(|(name, state, _)| name == "torpor-vmm" && state != 'Z')
}

/// Live torpor-vmm processes whose parent is `parent`.
pub fn vmm_children(parent: u32) -> Vec<u32> {
    let pids = std::fs::read_dir("/proc").into_iter().flatten().flatten();
    pids.filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| {
            proc_stat(pid).is_some_and(|(name, state, ppid)| {
                ppid == parent && name == "torpor-vmm" && state != 'Z'
            })
        })
        .collect()
}
