//! A `torpor pod serve` for tests (unix socket, TLS or plain loopback
//! TCP), killed on drop, and requests straight to it.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::http::{send, HttpResponse};
use super::TORPOR;

pub struct PodProcess {
    pub child: Child,
    /// As registered: `unix:PATH`, `tls:HOST:PORT` or `tcp:HOST:PORT`.
    pub address: String,
    pub token: String,
    /// The fingerprint a TLS pod printed.
    pub fingerprint: Option<String>,
}

impl PodProcess {
    /// `listen`: `unix:PATH` or `tcp:127.0.0.1:0` (TLS). The token is
    /// written to `data/pod-token` (mode 0600) first.
    pub fn start(data: &Path, listen: &str, token: &str) -> Self {
        Self::start_with(data, listen, token, &[])
    }

    /// On the unix socket `<parent>/<name>.sock`, its data in `<parent>/<name>`.
    pub fn start_unix(parent: &Path, name: &str, token: &str) -> Self {
        let sock = parent.join(format!("{name}.sock"));
        Self::start(
            &parent.join(name),
            &format!("unix:{}", sock.display()),
            token,
        )
    }

    /// Plain TCP on loopback (`--plain-tcp`).
    pub fn start_plain(data: &Path, listen: &str, token: &str) -> Self {
        Self::start_with(data, listen, token, &["--plain-tcp"])
    }

    pub fn start_with(data: &Path, listen: &str, token: &str, extra: &[&str]) -> Self {
        std::fs::create_dir_all(data).unwrap();
        let token_file = data.join("pod-token");
        std::fs::write(&token_file, token).unwrap();
        let mut child = Command::new(TORPOR)
            .args([
                "pod",
                "serve",
                "--listen",
                listen,
                "--policy-interval-ms",
                "0",
            ])
            .arg("--data-dir")
            .arg(data.join("pod"))
            .arg("--token-file")
            .arg(&token_file)
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn torpor pod serve");
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut fingerprint = None;
        let address = loop {
            let line = lines
                .next()
                .expect("torpor pod exited before listening")
                .unwrap();
            if let Some(rest) = line.split("certificate fingerprint ").nth(1) {
                fingerprint = Some(rest.trim().to_string());
            }
            if let Some(rest) = line.split("listening on ").nth(1) {
                break rest.split_whitespace().next().unwrap().to_string();
            }
        };
        std::thread::spawn(move || for _ in lines {});
        PodProcess {
            child,
            address,
            token: token.to_string(),
            fingerprint,
        }
    }

    pub fn token_file(data: &Path) -> std::path::PathBuf {
        data.join("pod-token")
    }

    /// One request straight to the pod with its token.
    pub fn request(&self, method: &str, path: &str, body: Option<&str>) -> HttpResponse {
        let endpoint = torpor_api::client::Endpoint::parse(&self.address).unwrap();
        let pin = self
            .fingerprint
            .as_deref()
            .map(|f| torpor_api::tls::Fingerprint::parse(f).unwrap());
        let client = torpor_api::client::HttpClient::new(
            endpoint,
            Some(self.token.clone()),
            Duration::from_secs(120),
        )
        .unwrap()
        .pinned(pin);
        send(&client, method, path, "application/json", body)
    }

    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for PodProcess {
    fn drop(&mut self) {
        self.kill9();
    }
}
