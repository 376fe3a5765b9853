//! A loopback cluster for the tests, started by `scripts/cluster` (the one
//! way a cluster is started) in a scratch directory with its own ports:
//! PostgreSQL, nats-server, pods `pod1` and `pod2`, replicas `api1` and
//! `api2`. Stopped (`scripts/cluster down`) on drop.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::http::{request, HttpResponse};
use super::TORPOR;

pub struct Cluster {
    pub dir: PathBuf,
    pub port: u16,
    pub token: String,
}

fn script(dir: &Path, port: u16, args: &[&str]) -> Output {
    let out = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/cluster"))
        .args(args)
        .env("TORPOR_CLUSTER_DIR", dir)
        .env("TORPOR_CLUSTER_PORT", port.to_string())
        .env("TORPOR_BIN", TORPOR)
        // Both pods keep an idle sandbox running: the test decides.
        .env("TORPOR_CLUSTER_POD_ARGS", "--policy-interval-ms 0")
        .env("TORPOR_CLUSTER_API_ARGS", "--cluster-down-after-ms 3000")
        .output()
        .expect("run scripts/cluster");
    assert!(
        out.status.success(),
        "scripts/cluster {args:?}: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

impl Cluster {
    /// `name` makes the directory; the six ports start at a base drawn
    /// from the process id.
    pub fn up(name: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("torpor-cluster-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let port = 20_000 + (std::process::id() % 5_000) as u16 * 6;
        let out = script(&dir, port, &["up"]);
        let token = std::fs::read_to_string(dir.join("admin-token")).unwrap();
        println!("{}", String::from_utf8_lossy(&out.stdout));
        let c = Cluster { dir, port, token };
        c.wait_pods(2);
        c
    }

    /// `http` address of replica 1 or 2.
    pub fn api(&self, n: u16) -> String {
        format!("127.0.0.1:{}", self.port + 3 + n)
    }

    pub fn call(&self, n: u16, method: &str, path: &str, body: Option<&str>) -> HttpResponse {
        request(&self.api(n), method, path, Some(&self.token), body)
    }

    /// `METHOD path` on replica `n` with these headers too.
    pub fn call_with(
        &self,
        n: u16,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<&str>,
    ) -> HttpResponse {
        let auth = format!("Bearer {}", self.token);
        let mut all = vec![("Authorization", auth.as_str())];
        all.extend_from_slice(headers);
        super::http::request_with(&self.api(n), method, path, &all, body)
    }

    /// One SQL query's rows (psql, unaligned, `|`-separated).
    pub fn sql(&self, query: &str) -> String {
        let psql = std::fs::read_dir("/usr/lib/postgresql")
            .unwrap()
            .map(|e| e.unwrap().path().join("bin/psql"))
            .find(|p| p.is_file())
            .expect("psql");
        let out = Command::new(psql)
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-U",
                "torpor",
                "-d",
                "torpor",
                "-tAc",
                query,
            ])
            .output()
            .unwrap();
        super::succeeded(&out).trim().to_string()
    }

    pub fn kill(&self, part: &str) {
        script(&self.dir, self.port, &["kill", part]);
    }

    pub fn start(&self, part: &str) {
        script(&self.dir, self.port, &["start", part]);
    }

    /// `GET /v1/pods` through replica 1.
    pub fn pods(&self) -> Vec<Value> {
        let r = self.call(1, "GET", "/v1/pods", None);
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()["pods"].as_array().unwrap().clone()
    }

    /// Waits (30 s at most) until `n` pods are up.
    pub fn wait_pods(&self, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let up = self
                .pods()
                .iter()
                .filter(|p| p["reachable"] == true)
                .count();
            if up == n {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{up} pods up, not {n}: {:?}",
                self.pods()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Polls `GET path` on replica `n` until it answers `status` (30 s).
    pub fn wait_status(&self, n: u16, path: &str, status: u16) -> HttpResponse {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let r = self.call(n, "GET", path, None);
            if r.status == status {
                return r;
            }
            assert!(
                Instant::now() < deadline,
                "GET {path}: {} {}",
                r.status,
                r.body
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if std::env::var_os("TORPOR_KEEP_SCRATCH").is_some() {
            return;
        }
        let _ = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/cluster"))
            .arg("down")
            .env("TORPOR_CLUSTER_DIR", &self.dir)
            .env("TORPOR_CLUSTER_PORT", self.port.to_string())
            .output();
    }
}
