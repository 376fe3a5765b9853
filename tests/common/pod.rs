//! A `torpor pod serve` for tests (unix socket or loopback TCP), killed on
//! drop, and requests straight to it.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::http::{request, HttpResponse};
use super::TORPOR;

pub struct PodProcess {
    pub child: Child,
    /// As registered: `unix:PATH` or `tcp:HOST:PORT`.
    pub address: String,
    pub token: String,
}

impl PodProcess {
    /// `listen`: `unix:PATH` or `tcp:127.0.0.1:0`. The token is written to
    /// `data/pod-token` (mode 0600) first.
    pub fn start(data: &Path, listen: &str, token: &str) -> Self {
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
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn torpor pod serve");
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let address = loop {
            let line = lines
                .next()
                .expect("torpor pod exited before listening")
                .unwrap();
            if let Some(rest) = line.split("listening on ").nth(1) {
                break rest.trim().to_string();
            }
        };
        std::thread::spawn(move || for _ in lines {});
        PodProcess {
            child,
            address,
            token: token.to_string(),
        }
    }

    pub fn token_file(data: &Path) -> std::path::PathBuf {
        data.join("pod-token")
    }

    /// One request straight to the pod with its token.
    pub fn request(&self, method: &str, path: &str, body: Option<&str>) -> HttpResponse {
        if let Some(addr) = self.address.strip_prefix("tcp:") {
            return request(addr, method, path, Some(&self.token), body);
        }
        let socket = self.address.strip_prefix("unix:").unwrap();
        let mut s = UnixStream::connect(socket).unwrap_or_else(|e| panic!("connect {socket}: {e}"));
        s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        let body = body.unwrap_or("");
        let req = format!(
            "{method} {path} HTTP/1.1\r\nHost: pod\r\nConnection: close\r\n\
             Authorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            self.token,
            body.len()
        );
        s.write_all(req.as_bytes()).unwrap();
        let mut raw = String::new();
        let _ = s.read_to_string(&mut raw);
        let (head, rest) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap();
        assert!(
            !head.to_ascii_lowercase().contains("chunked"),
            "chunked answer from the pod"
        );
        HttpResponse {
            status,
            body: rest.to_string(),
            headers: Vec::new(),
        }
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
