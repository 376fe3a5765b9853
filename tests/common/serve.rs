//! A `torpor serve` on loopback for tests, and a data directory whose
//! processes (serve and its VMMs) are killed when the test ends.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use super::{Scratch, TORPOR};

/// `torpor serve --listen 127.0.0.1:0 --data-dir DATA ARGS`, killed on drop.
pub struct ServeProcess {
    pub child: Child,
    /// `host:port` it listens on.
    pub addr: String,
    /// What it printed up to "listening on".
    pub banner: Vec<String>,
}

impl ServeProcess {
    pub fn start(data: &Path, args: &[&str]) -> Self {
        Self::start_with_env(data, args, &[])
    }

    /// [`Self::start`] with extra environment variables (test hooks).
    pub fn start_with_env(data: &Path, args: &[&str], env: &[(&str, &str)]) -> Self {
        let mut child = Command::new(TORPOR)
            .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
            .arg(data)
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn torpor serve");
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut banner = Vec::new();
        let addr = loop {
            let line = lines
                .next()
                .expect("torpor serve exited before listening")
                .unwrap();
            let rest = line
                .split("listening on http://")
                .nth(1)
                .or_else(|| line.split("listening on https://").nth(1))
                .map(|r| r.trim().to_string());
            banner.push(line);
            if let Some(rest) = rest {
                break rest;
            }
        };
        // Keep draining stdout so the service never blocks on it.
        std::thread::spawn(move || for _ in lines {});
        ServeProcess {
            child,
            addr,
            banner,
        }
    }

    /// The rest of the first line it printed before listening that holds
    /// `after`.
    #[allow(dead_code)]
    /// The admin token a first start (no `--token`) printed once.
    pub fn first_admin_token(&self) -> String {
        self.banner
            .iter()
            .find_map(|l| l.split("admin token: ").nth(1))
            .unwrap_or_else(|| panic!("no admin token printed: {:?}", self.banner))
            .trim()
            .to_string()
    }

    pub fn stdout_line(&self, after: &str) -> Option<String> {
        self.banner
            .iter()
            .find_map(|l| l.split(after).nth(1))
            .map(|r| r.trim().to_string())
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Ends the service the hard way (its VMMs live on).
    pub fn kill9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ServeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A scratch data directory (`.0`); on drop every process still running
/// from it (serve and its VMMs) is killed, then it goes as a [`Scratch`].
pub struct DataDir(pub PathBuf, Scratch);

impl DataDir {
    pub fn new(name: &str) -> Self {
        let scratch = Scratch::new(name);
        DataDir(scratch.0.clone(), scratch)
    }
}

impl Drop for DataDir {
    fn drop(&mut self) {
        let _ = Command::new("pkill")
            .args(["-9", "-f", &self.0.to_string_lossy()])
            .output();
        // VMMs get their spec on stdin, so their command lines name no
        // path: find them by their stderr, a log inside the directory.
        for pid in processes_logging_under(&self.0) {
            // SAFETY: SIGKILL to a process of this test's data directory.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

/// Pids whose stderr is a file under `dir` (or under its canonical path).
fn processes_logging_under(dir: &std::path::Path) -> Vec<i32> {
    let roots = [dir.to_path_buf(), dir.canonicalize().unwrap_or_default()];
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read_link(format!("/proc/{pid}/fd/2"))
                .is_ok_and(|target| roots.iter().any(|r| target.starts_with(r)))
        })
        .collect()
}
