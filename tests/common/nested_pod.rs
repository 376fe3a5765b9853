//! serve's API with a nested pod attached, without QEMU: a `Nested` over
//! a local probe service, as `torpor serve` builds it, in process, and a
//! real `torpor pod serve` process on a unix socket attached as serve
//! attaches its nested pod. The local pod can be made full, so that
//! creates are placed on the nested one.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use torpor_api::nested::Nested;
use torpor_client::{Endpoint, HttpClient};
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
        let mut config = ServiceConfig::new(
            central_dir.0.join("data"),
            PathBuf::from(env!("CARGO_BIN_EXE_torpor-vmm")),
        );
        config.policy_interval_ms = 0;
        let service = Service::open(config).expect("open the local pod");
        let nested = Nested::new(service, Duration::from_secs(60));
        let deadline = Instant::now() + Duration::from_secs(90);
        let token = loop {
            let token = std::fs::read_to_string(&token_file).unwrap_or_default();
            let token = token.trim().to_string();
            if !token.is_empty() && socket.exists() {
                match nested.attach(&address, &token, None) {
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
            Some(token),
            Duration::from_secs(60),
        )
        .unwrap();
        let api = InProcessApi::start(
            nested,
            torpor_api::ApiConfig {
                tokens: vec![admin.into()],
                tenants_file: Some(central_dir.0.join("tenants.json")),
                ..Default::default()
            },
        );
        NestedRig {
            api,
            admin: admin.to_string(),
            pod: client,
            _pod: pod,
            _dirs: (pod_dir, central_dir),
        }
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
