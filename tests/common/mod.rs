//! Helpers shared by the integration tests: run `torpor`, watch a serial
//! console file, and clean up after ourselves.
#![allow(dead_code)]

pub mod chaos;
pub mod cluster;
pub mod cut;
pub mod disk;
pub mod e2b;
pub mod e2b_http;
pub mod e2b_sdk;
pub mod http;
pub mod interp;
pub mod nested_host;
pub mod nested_pod;
pub mod nested_serve;
pub mod netns;
pub mod seaweedfs;
pub mod serve;
pub mod snap;
pub mod store;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

pub const TORPOR: &str = env!("CARGO_BIN_EXE_torpor");

/// A scratch directory (`.0`), removed on drop unless
/// TORPOR_KEEP_SCRATCH is set (to keep consoles and snapshots for a look).
pub struct Scratch(pub PathBuf, tempfile::TempDir);

impl Scratch {
    pub fn new(name: &str) -> Self {
        let dir = tempfile::Builder::new()
            .prefix(&format!("torpor-test-{name}-"))
            .disable_cleanup(std::env::var_os("TORPOR_KEEP_SCRATCH").is_some())
            .tempdir()
            .unwrap();
        Self(dir.path().to_path_buf(), dir)
    }
    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

/// Closes an in-process service and deletes every sandbox it has (ending
/// their VMMs): a test's teardown.
pub fn end_service(service: &torpor_scheduler::service::Service) {
    service.close();
    for s in service
        .list_sandboxes(torpor_scheduler::store::SandboxFilter::default())
        .unwrap_or_default()
    {
        let _ = service.delete_sandbox(&s.id);
    }
}

/// An in-process service on `data` running real `torpor-vmm`s, its policy
/// thread off (the test runs rounds itself), `config` changing the rest;
/// with a probe template `name` of `mem_mib` whose guest runs `cmdline`.
pub fn service_with_probe(
    data: &Path,
    config: impl FnOnce(&mut torpor_scheduler::service::ServiceConfig),
    name: &str,
    mem_mib: u32,
    cmdline: &str,
) -> std::sync::Arc<torpor_scheduler::service::Service> {
    use torpor_scheduler::service::{CreateTemplate, Service, ServiceConfig};
    let mut c = ServiceConfig::new(
        data.to_path_buf(),
        PathBuf::from(env!("CARGO_BIN_EXE_torpor-vmm")),
    );
    c.policy_interval_ms = 0;
    config(&mut c);
    let service = Service::open(c).expect("open the service");
    service
        .create_template(CreateTemplate {
            name: name.into(),
            kind: torpor_scheduler::model::TemplateKind::Probe,
            image: None,
            owner: None,
            mem_mib,
            vcpus: 1,
            cmdline: Some(cmdline.into()),
            pod: None,
        })
        .expect("build the probe template");
    service
}

/// Runs `torpor` to completion with a time limit; kills it if it overstays.
pub fn torpor(args: &[&str], limit: Duration) -> Output {
    torpor_with_env(args, &[], limit)
}

/// [`torpor`] with these environment variables set.
pub fn torpor_with_env(args: &[&str], env: &[(&str, &str)], limit: Duration) -> Output {
    let child = Command::new(TORPOR)
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn torpor");
    wait_output(child, limit)
}

/// Waits for a child to exit within `limit`, killing it otherwise.
pub fn wait_output(mut child: Child, limit: Duration) -> Output {
    let deadline = Instant::now() + limit;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "torpor did not exit within {limit:?}\nstdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    child.wait_with_output().unwrap()
}

pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

pub fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Asserts that a command exited 0 (its stderr in the message if not);
/// its stdout.
pub fn succeeded(out: &Output) -> String {
    assert!(out.status.success(), "{}", stderr(out));
    stdout(out)
}

/// The complete lines of a console: the UART writes byte by byte, so the
/// last line may still be in progress (or cut by a pause or snapshot).
pub fn complete_lines(text: &str) -> impl Iterator<Item = &str> {
    let end = text.rfind('\n').map_or(0, |i| i + 1);
    text[..end].lines()
}

/// Waits until `path` holds a complete line for which `pred` holds.
pub fn wait_for_line(path: &Path, limit: Duration, pred: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + limit;
    loop {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        if let Some(l) = complete_lines(&text).find(|l| pred(l)) {
            return l.to_string();
        }
        if Instant::now() > deadline {
            panic!(
                "no matching line in {} within {limit:?}; it holds:\n{text}",
                path.display()
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Polls `cond` until it holds, failing the test after `limit`.
pub fn wait_for(limit: Duration, cond: impl Fn() -> bool) {
    let deadline = Instant::now() + limit;
    while !cond() {
        assert!(
            Instant::now() < deadline,
            "condition not met within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A VMM process killed on drop, so a failing test leaves nothing behind.
pub struct Vmm(pub Option<Child>);

impl Vmm {
    pub fn spawn(args: &[&str]) -> Self {
        let child = Command::new(TORPOR)
            .args(["vmm", "--no-jail"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn torpor vmm");
        Self(Some(child))
    }

    pub fn wait(mut self, limit: Duration) -> Output {
        wait_output(self.0.take().unwrap(), limit)
    }

    pub fn try_status(&mut self) -> Option<ExitStatus> {
        self.0.as_mut().unwrap().try_wait().unwrap()
    }
}

impl Drop for Vmm {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Parses `TORPOR-PROBE ITER n=<n> sum=<hex>` lines into (n, sum).
pub fn probe_iterations(console: &str) -> Vec<(u64, u64)> {
    complete_lines(console)
        .filter_map(|l| {
            let rest = l.strip_prefix("TORPOR-PROBE ITER n=")?;
            let (n, sum) = rest.split_once(" sum=")?;
            Some((n.parse().ok()?, u64::from_str_radix(sum.trim(), 16).ok()?))
        })
        .collect()
}
