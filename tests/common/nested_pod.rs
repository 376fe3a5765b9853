//! serve's API with a nested pod attached, without QEMU: a `Nested` over
//! a local probe service, as `torpor serve` builds it, in process, and a
//! real `torpor pod serve` process on a unix socket attached as serve
//! attaches its nested pod. The local pod can be made full, so that
//! creates are placed on the nested one.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use torpor_api::nested::Nested;
use torpor_api::SandboxApi;
use torpor_client::{Endpoint, HttpClient};
use torpor_scheduler::model::PodId;
use torpor_scheduler::service::{Service, ServiceConfig};

use super::http::{request, InProcessApi};
use super::serve::DataDir;
use super::TORPOR;

/// `torpor pod serve` on a unix socket, killed on drop.
struct Pod(Child);

impl Drop for Pod {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The rig; everything stops on drop.
pub struct NestedRig {
    /// serve's API (`host:port`), whose admin token is `admin`.
    pub api: InProcessApi,
    pub admin: String,
    /// The pod's own API, with its token.
    pub pod: HttpClient,
    /// serve's side, as the API serves it.
    pub nested: Arc<Nested<Service>>,
    /// The pod's id at serve.
    pub pod_id: PodId,
    address: String,
    token: String,
    // Dropped after the API and the pod: their data.
    _pod: Pod,
    _dirs: (DataDir, DataDir),
}

impl NestedRig {
    /// Starts the pod, attaches it once it answers (it builds its probe
    /// template first) and serves the API with admin token `admin`.
    pub fn start(name: &str, admin: &str) -> NestedRig {
        let pod_dir = DataDir::new(&format!("{name}-pod"));
        let central_dir = DataDir::new(name);
        let socket = pod_dir.0.join("pod.sock");
        let token_file = pod_dir.0.join("token");
        let address = format!("unix:{}", socket.display());
        let pod = Pod(Command::new(TORPOR)
            .args(["pod", "serve", "--listen", &address, "--data-dir"])
            .arg(pod_dir.0.join("data"))
            .arg("--token-file")
            .arg(&token_file)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn torpor pod serve"));
        let nested = open_serve(&central_dir.0);
        let pod_id = PodId::generate();
        let deadline = Instant::now() + Duration::from_secs(90);
        let token = loop {
            let token = std::fs::read_to_string(&token_file).unwrap_or_default();
            let token = token.trim().to_string();
            if !token.is_empty() && socket.exists() {
                match nested.attach_as(pod_id.clone(), &address, &token, None) {
                    Ok(_) => break token,
                    Err(e) if Instant::now() > deadline => panic!("attach: {e}"),
                    Err(_) => {}
                }
            }
            assert!(Instant::now() < deadline, "the pod did not start");
            std::thread::sleep(Duration::from_millis(200));
        };
        let client = HttpClient::new(
            Endpoint::parse(&address).unwrap(),
            Some(token.clone()),
            Duration::from_secs(60),
        )
        .unwrap();
        let api = serve_api(nested.clone(), &central_dir.0, admin);
        NestedRig {
            api,
            admin: admin.to_string(),
            pod: client,
            nested,
            pod_id,
            address,
            token,
            _pod: pod,
            _dirs: (pod_dir, central_dir),
        }
    }

    /// serve restarted on the same data directory (its store, its
    /// tenants), the pod still running: the new serve re-attaches it under
    /// the same id, as `torpor serve` does its nested host.
    pub fn restart_serve(self) -> NestedRig {
        let NestedRig {
            api,
            admin,
            pod,
            nested,
            pod_id,
            address,
            token,
            _pod,
            _dirs,
        } = self;
        if let Some(service) = nested.service() {
            service.close();
        }
        drop(nested);
        drop(api);
        let nested = open_serve(&_dirs.1 .0);
        nested
            .attach_as(pod_id.clone(), &address, &token, None)
            .expect("attach the pod again");
        // As serve does after re-attaching its nested pod.
        nested.reconcile(&pod_id).expect("reconcile");
        let api = serve_api(nested.clone(), &_dirs.1 .0, &admin);
        NestedRig {
            api,
            admin,
            pod,
            nested,
            pod_id,
            address,
            token,
            _pod,
            _dirs,
        }
    }

    /// The central data directory (serve's).
    pub fn serve_data(&self) -> PathBuf {
        self._dirs.1 .0.join("data")
    }

    /// The pod's data directory.
    pub fn pod_data(&self) -> PathBuf {
        self._dirs.0 .0.join("data")
    }

    /// Makes the local pod full: creates go to the nested pod.
    pub fn fill_local_pod(&self) {
        let body = r#"{"oversubscription_ratio": 0.001}"#;
        let r = request(
            &self.api.addr,
            "PATCH",
            "/v1/pods/pod_local",
            Some(&self.admin),
            Some(body),
        );
        assert_eq!(r.status, 200, "{}", r.body);
    }
}

/// serve's local pod and `Nested` over `dir`'s data, as `torpor serve`
/// opens them (the store lock of a serve just stopped is waited for).
fn open_serve(dir: &Path) -> Arc<Nested<Service>> {
    let mut config = ServiceConfig::new(
        dir.join("data"),
        PathBuf::from(env!("CARGO_BIN_EXE_torpor-vmm")),
    );
    config.policy_interval_ms = 0;
    let deadline = Instant::now() + Duration::from_secs(30);
    let service = loop {
        match Service::open(config.clone()) {
            Ok(service) => break service,
            Err(e) if Instant::now() > deadline => panic!("open the local pod: {e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    };
    Nested::new(service, Duration::from_secs(60))
}

fn serve_api(nested: Arc<Nested<Service>>, dir: &Path, admin: &str) -> InProcessApi {
    InProcessApi::start(
        nested,
        torpor_api::ApiConfig {
            tokens: vec![admin.into()],
            tenants_file: Some(dir.join("tenants.json")),
            ..Default::default()
        },
    )
}
