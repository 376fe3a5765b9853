//! A loopback cluster for the tests, started by `scripts/cluster` (the one
//! way a cluster is started) in a scratch directory with its own ports:
//! PostgreSQL, nats-server, pods `pod1` and `pod2` (and more with
//! [`Cluster::up_pods`]), replicas `api1` and `api2`. Stopped
//! (`scripts/cluster down`) on drop.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::http::{request, HttpResponse};
use super::TORPOR;

pub struct Cluster {
    pub dir: PathBuf,
    pub port: u16,
    pub token: String,
    /// The pods' flags.
    pub pod_args: String,
    /// Whether the pods serve TLS (`TORPOR_CLUSTER_POD_TLS`) rather than
    /// plain TCP on loopback.
    pub pod_tls: bool,
    /// The replicas' flags, also when a fault restarts one.
    pub api_args: String,
    /// How many pods (`TORPOR_CLUSTER_PODS`).
    pub pods: u16,
}

/// A VMM of the cluster: its process, the pod whose data directory it
/// runs in, and the sandbox (`standby` for a shell).
#[derive(Debug, Clone)]
pub struct Vmm {
    pub pid: u32,
    pub ppid: u32,
    pub pod: u16,
    pub sandbox: String,
}

/// The pods' flags unless the cluster is started with others: both pods
/// keep an idle sandbox running (the test decides).
pub const POD_ARGS: &str = "--policy-interval-ms 0";

/// The replicas' flags unless a restart names others.
pub const API_ARGS: &str = "--cluster-down-after-ms 3000";

/// Clusters started by this process so far (each gets its own ports).
static STARTED: AtomicU16 = AtomicU16::new(0);

/// `scripts/cluster ARGS`, the pods and replicas it starts given these
/// flags (and the pods serving TLS if `pod_tls`).
fn script_with(
    dir: &Path,
    port: u16,
    args: &[&str],
    (pod_args, pod_tls, pods): (&str, bool, u16),
    api_args: &str,
) -> Output {
    let out = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/cluster"))
        .args(args)
        .env("TORPOR_CLUSTER_PODS", pods.to_string())
        .env("TORPOR_CLUSTER_POD_TLS", if pod_tls { "1" } else { "" })
        .env("TORPOR_CLUSTER_DIR", dir)
        .env("TORPOR_CLUSTER_PORT", port.to_string())
        .env("TORPOR_BIN", TORPOR)
        .env("TORPOR_CLUSTER_POD_ARGS", pod_args)
        .env("TORPOR_CLUSTER_API_ARGS", api_args)
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

/// Nine consecutive loopback ports nobody holds ([`PORTS`]), below the kernel's
/// ephemeral range (20000-32767), where no client connection of another
/// test can take one between this check and the servers' binds. The
/// search starts from the process id and how many clusters it started
/// before, so test binaries running side by side start apart.
fn free_ports() -> u16 {
    const FIRST: u16 = 20_000;
    const SLOTS: u16 = (32_768 - FIRST) / PORTS;
    let start = (std::process::id() % u32::from(SLOTS)) as u16
        + STARTED.fetch_add(1, Ordering::Relaxed) * 7;
    (0..SLOTS)
        .map(|i| FIRST + (start + i) % SLOTS * PORTS)
        .find(|&base| {
            (base..base + PORTS).all(|p| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok())
        })
        .expect("nine free loopback ports below 32768")
}

/// The ports of one cluster (`scripts/cluster`): postgres, nats, pod1,
/// pod2, api1, api2, then pod3 to pod5.
const PORTS: u16 = 9;

impl Cluster {
    /// `name` makes the directory; the ports are [`free_ports`].
    pub fn up(name: &str) -> Self {
        Self::up_with(name, POD_ARGS)
    }

    /// [`Cluster::up`] with pods that serve TLS: the replicas pin the
    /// certificate each pod announces in its heartbeats.
    pub fn up_tls(name: &str) -> Self {
        Self::up_as(name, POD_ARGS, true)
    }

    /// [`Cluster::up`] with these `pod serve` flags.
    pub fn up_with(name: &str, pod_args: &str) -> Self {
        Self::up_as(name, pod_args, false)
    }

    /// [`Cluster::up_with`] with these replica flags too.
    pub fn up_with_api(name: &str, pod_args: &str, api_args: &str) -> Self {
        Self::up_full(name, (pod_args, false, 2), api_args)
    }

    /// [`Cluster::up_with_api`] with `pods` pods (2 to 5).
    pub fn up_pods(name: &str, pods: u16, pod_args: &str, api_args: &str) -> Self {
        Self::up_full(name, (pod_args, false, pods), api_args)
    }

    fn up_as(name: &str, pod_args: &str, pod_tls: bool) -> Self {
        Self::up_full(name, (pod_args, pod_tls, 2), API_ARGS)
    }

    fn up_full(name: &str, (pod_args, pod_tls, pods): (&str, bool, u16), api_args: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("torpor-cluster-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let port = free_ports();
        // Dropped (stopped) if `up` or the wait for the pods fails.
        let mut c = Cluster {
            dir,
            port,
            token: String::new(),
            pod_args: pod_args.to_string(),
            pod_tls,
            api_args: api_args.to_string(),
            pods,
        };
        let out = c.script(&["up"]);
        c.token = std::fs::read_to_string(c.dir.join("admin-token")).unwrap();
        println!("{}", String::from_utf8_lossy(&out.stdout));
        c.wait_pods(usize::from(pods));
        c
    }

    /// `host:port` of PostgreSQL and of nats-server.
    pub fn postgres(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn nats(&self) -> String {
        format!("127.0.0.1:{}", self.port + 1)
    }

    /// `http` address of replica 1 or 2.
    pub fn api(&self, n: u16) -> String {
        format!("127.0.0.1:{}", self.port + 3 + n)
    }

    /// `http` address of pod `n`'s own API (its token: `pod_token`).
    pub fn pod_api(&self, n: u16) -> String {
        // pod1 and pod2 sit between nats and the replicas, the others after.
        let port = if n <= 2 {
            self.port + 1 + n
        } else {
            self.port + 3 + n
        };
        format!("127.0.0.1:{port}")
    }

    /// Pod 1 or 2's own admin token.
    pub fn pod_token(&self, n: u16) -> String {
        let token = std::fs::read_to_string(self.dir.join(format!("pod{n}/token"))).unwrap();
        token.trim().to_string()
    }

    pub fn call(&self, n: u16, method: &str, path: &str, body: Option<&str>) -> HttpResponse {
        request(&self.api(n), method, path, Some(&self.token), body)
    }

    /// Sets `tenant`'s quota (JSON) through replica `n`; it must answer 200.
    pub fn set_quota(&self, n: u16, tenant: &str, quota: &str) {
        let r = self.call(
            n,
            "PUT",
            &format!("/v1/tenants/{tenant}/quota"),
            Some(quota),
        );
        assert_eq!(r.status, 200, "{}", r.body);
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
        self.try_call(n, method, path, headers, body, Duration::from_secs(120))
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// `METHOD path` on replica `n` with these headers (the bearer token
    /// added), within `limit`; a replica that does not answer is an error.
    pub fn try_call(
        &self,
        n: u16,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<&str>,
        limit: Duration,
    ) -> Result<HttpResponse, String> {
        let auth = format!("Bearer {}", self.token);
        let mut all = vec![("Authorization", auth.as_str())];
        all.extend_from_slice(headers);
        super::http::try_request_with(&self.api(n), method, path, &all, body, limit)
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

    fn script(&self, args: &[&str]) -> Output {
        let pods = (self.pod_args.as_str(), self.pod_tls, self.pods);
        script_with(&self.dir, self.port, args, pods, &self.api_args)
    }

    /// `kill -9` of one part (`postgres`, `nats`, `pod1`, `pod2`, `api1`,
    /// `api2`).
    pub fn kill(&self, part: &str) {
        self.script(&["kill", part]);
    }

    /// SIGSTOP (`true`) or SIGCONT (`false`) to one part, by its pid file:
    /// a part that hangs rather than dies.
    pub fn freeze(&self, part: &str, frozen: bool) {
        let pid = std::fs::read_to_string(self.dir.join(format!("{part}.pid"))).unwrap();
        let signal = if frozen { "-STOP" } else { "-CONT" };
        let st = std::process::Command::new("kill")
            .args([signal, pid.trim()])
            .status()
            .unwrap();
        assert!(st.success(), "kill {signal} {part}");
    }

    /// A clean stop of one part (PostgreSQL: `pg_ctl stop -m fast`).
    pub fn stop(&self, part: &str) {
        self.script(&["stop", part]);
    }

    pub fn start(&self, part: &str) {
        self.script(&["start", part]);
    }

    /// (Re)starts replica `api1` or `api2` with these flags.
    pub fn start_api(&self, part: &str, api_args: &str) {
        let pods = (self.pod_args.as_str(), self.pod_tls, self.pods);
        script_with(&self.dir, self.port, &["start", part], pods, api_args);
    }

    /// `scripts/cluster status`: `NAME up (pid N)` or `NAME down` lines.
    pub fn status(&self) -> String {
        String::from_utf8_lossy(&self.script(&["status"]).stdout).into_owned()
    }

    /// Pod `n`'s own sandboxes (its API, its token), as it holds them;
    /// retried for 30 s while it restarts.
    pub fn pod_sandboxes(&self, n: u16) -> Vec<Value> {
        let addr = self.pod_api(n);
        let token = std::fs::read_to_string(self.dir.join(format!("pod{n}/token"))).unwrap();
        let auth = format!("Bearer {}", token.trim());
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let r = super::http::try_request_with(
                &addr,
                "GET",
                "/v1/sandboxes",
                &[("Authorization", &auth)],
                None,
                Duration::from_secs(30),
            );
            match r {
                Ok(r) if r.status == 200 => {
                    return r.json()["sandboxes"].as_array().unwrap().clone();
                }
                other => assert!(
                    Instant::now() < deadline,
                    "pod{n}'s sandboxes: {:?}",
                    other.map(|r| format!("{} {}", r.status, r.body))
                ),
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The VMM processes running in the pods' data directories (a VMM's
    /// stderr is its log there: `podN/data/sandboxes/ID/...`).
    pub fn vmms(&self) -> Vec<Vmm> {
        let mut found = Vec::new();
        let pids = std::fs::read_dir("/proc").into_iter().flatten().flatten();
        for pid in pids.filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok()) {
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            let Some((head, rest)) = stat.rsplit_once(')') else {
                continue;
            };
            let mut f = rest.split_whitespace();
            let (state, ppid) = (f.next(), f.next().and_then(|p| p.parse().ok()));
            if !head.ends_with("(torpor-vmm") || state == Some("Z") {
                continue;
            }
            let Ok(log) = std::fs::read_link(format!("/proc/{pid}/fd/2")) else {
                continue;
            };
            let Ok(inside) = log.strip_prefix(&self.dir) else {
                continue;
            };
            let parts: Vec<String> = inside
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            let pod = match parts.first().map(String::as_str) {
                Some("pod1") => 1,
                Some("pod2") => 2,
                _ => continue,
            };
            let sandbox = match parts.iter().position(|p| p == "sandboxes") {
                Some(i) => parts.get(i + 1).cloned().unwrap_or_default(),
                None => "standby".to_string(),
            };
            found.push(Vmm {
                pid,
                ppid: ppid.unwrap_or(0),
                pod,
                sandbox,
            });
        }
        found
    }

    /// JetStream messages not acked yet once the cluster is quiet: polled
    /// for `limit` until both streams and their consumers are empty (the
    /// pods' heartbeats keep coming); what was left at the last look.
    pub fn unacked_messages(&self, limit: Duration) -> Vec<String> {
        self.unacked_messages_but(limit, &[])
    }

    /// [`Cluster::unacked_messages`] but for the consumers named `skip`
    /// (a pod lost for good keeps what it was sent).
    pub fn unacked_messages_but(&self, limit: Duration, skip: &[&str]) -> Vec<String> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let url = format!("nats://{}", self.nats());
        let deadline = Instant::now() + limit;
        loop {
            let look = rt.block_on(async {
                let look = torpor_cluster::wire::backlog_at(&url);
                tokio::time::timeout(Duration::from_secs(10), look)
                    .await
                    .map_err(|_| "NATS: no answer in 10 s".to_string())?
                    .map_err(|e| e.to_string())
            });
            let left: Vec<String> = match look {
                Ok(mut all) => all
                    .iter_mut()
                    .map(|b| {
                        b.consumers.retain(|c| !skip.contains(&c.0.as_str()));
                        &*b
                    })
                    .filter(|b| !b.is_empty())
                    .map(|b| format!("{b:?}"))
                    .collect(),
                Err(e) => vec![e],
            };
            if left.is_empty() || Instant::now() >= deadline {
                return left;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
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
        self.wait_status_as(n, &self.token, path, status, Duration::from_secs(30))
    }

    /// Polls `GET path` on replica `n` with `token` until it answers
    /// `status`, for at most `within`.
    pub fn wait_status_as(
        &self,
        n: u16,
        token: &str,
        path: &str,
        status: u16,
        within: Duration,
    ) -> HttpResponse {
        let deadline = Instant::now() + within;
        loop {
            let r = request(&self.api(n), "GET", path, Some(token), None);
            if r.status == status {
                return r;
            }
            assert!(
                Instant::now() < deadline,
                "GET {path} on replica {n}: {} {} (not {status} within {within:?})",
                r.status,
                r.body
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if std::env::var_os("TORPOR_KEEP_SCRATCH").is_some() {
            return;
        }
        // `down` ends the pods' VMMs too (they outlive a stopped pod).
        let _ = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/cluster"))
            .arg("down")
            .env("TORPOR_CLUSTER_DIR", &self.dir)
            .env("TORPOR_CLUSTER_PORT", self.port.to_string())
            .output();
    }
}

// Helpers of the cluster tests (tests/cluster.rs, tests/cluster_fork.rs,
// tests/cluster_templates.rs).

/// Polls `GET location` on replica `n` until the operation is no longer
/// pending (30 s); the operation.
pub fn finished(c: &Cluster, n: u16, location: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = c.call(n, "GET", location, None);
        assert_eq!(r.status, 200, "{}", r.body);
        let op = r.json();
        if op["status"] != "pending" {
            return op;
        }
        assert!(Instant::now() < deadline, "{location} still pending: {op}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// How long a change made through one replica may take to hold at the
/// other: `torpor_api::auth::SHARED_REFRESH` (1 s), with room for a loaded
/// machine.
pub const SHARED_WITHIN: Duration = Duration::from_secs(5);

/// `METHOD path` on replica `n` with `token`.
pub fn as_token(
    c: &Cluster,
    n: u16,
    token: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> HttpResponse {
    request(&c.api(n), method, path, Some(token), body)
}

/// Polls `GET path` on replica `n` with `token` until it answers `status`
/// (within [`SHARED_WITHIN`]).
pub fn wait_token_status(
    c: &Cluster,
    n: u16,
    token: &str,
    path: &str,
    status: u16,
) -> HttpResponse {
    c.wait_status_as(n, token, path, status, SHARED_WITHIN)
}

/// Makes a tenant's token through replica `made`: it is accepted there at
/// once and at the other replica within the refresh; the token and its
/// id.
pub fn tenant_token(c: &Cluster, made: u16, tenant: &str) -> (String, String) {
    let body = format!(r#"{{"tenant":"{tenant}"}}"#);
    let r = c.call(made, "POST", "/v1/tokens", Some(&body));
    assert_eq!(r.status, 201, "{}", r.body);
    let v = r.json();
    let token = v["token"].as_str().unwrap().to_string();
    let id = v["id"].as_str().unwrap().to_string();
    assert_eq!(v["tenant"], tenant);
    assert_eq!(v["scope"], "tenant");
    let r = as_token(c, made, &token, "GET", "/v1/sandboxes", None);
    assert_eq!(r.status, 200, "at once where it was made: {}", r.body);
    wait_token_status(c, 3 - made, &token, "/v1/sandboxes", 200);
    (token, id)
}

/// Sandboxes of `tenant` in PostgreSQL (tombstones left out).
pub fn stored_sandboxes(c: &Cluster, tenant: &str) -> String {
    c.sql(&format!(
        "SELECT count(*) FROM sandboxes WHERE tenant = '{tenant}' AND state <> 'deleted'"
    ))
}
