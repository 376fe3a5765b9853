//! The code interpreter server (`guest-image/interpreter/torpor_interp.py`)
//! on a loopback port, run from the interpreter venv (`scripts/setup test`
//! makes it): self-contained, so `benches/interp.rs` takes it by `#[path]`.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const REPO: &str = env!("CARGO_MANIFEST_DIR");
/// A kernel starts in seconds; this bounds a broken venv.
const START_LIMIT: Duration = Duration::from_secs(120);

/// The interpreter venv's python: `$TORPOR_INTERP_VENV`, else the path
/// `scripts/setup env` computes (keyed by the requirements' hash).
pub fn interp_python() -> PathBuf {
    let venv = match std::env::var_os("TORPOR_INTERP_VENV") {
        Some(v) => PathBuf::from(v),
        None => {
            let out = Command::new(format!("{REPO}/scripts/setup"))
                .arg("env")
                .output()
                .expect("run scripts/setup env");
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            let line = text
                .lines()
                .find_map(|l| l.strip_prefix("export TORPOR_INTERP_VENV="))
                .unwrap_or_else(|| panic!("scripts/setup env names no interpreter venv:\n{text}"));
            PathBuf::from(line.trim_matches('\''))
        }
    };
    venv.join("bin/python")
}

/// The server process, stopped with SIGTERM on drop (it shuts its kernels
/// down); its log (stderr) is `dir/server.err`.
pub struct InterpServer {
    child: Child,
    pub url: String,
    /// From spawning the server to its listening line: the default Python
    /// kernel is up by then.
    pub ready_in: Duration,
}

impl InterpServer {
    /// Starts the server with its contexts' home in `dir/home`, Deno's
    /// caches in `dir/deno` and the output bound `max_output` bytes.
    pub fn start(dir: &Path, max_output: usize) -> Self {
        let py = interp_python();
        assert!(
            py.exists(),
            "the interpreter venv is missing ({}): run scripts/setup test",
            py.display()
        );
        let home = dir.join("home");
        std::fs::create_dir_all(&home).unwrap();
        let started = Instant::now();
        // stdout to a file, not a pipe: the kernels inherit it, and nothing
        // would read a pipe after the first line.
        let out = dir.join("server.out");
        // Deno's kernel keeps its caches in DENO_DIR (else under $HOME):
        // the scratch directory's.
        let mut child = Command::new(&py)
            .env("DENO_DIR", dir.join("deno"))
            .arg(format!("{REPO}/guest-image/interpreter/torpor_interp.py"))
            .args(["--listen", "127.0.0.1:0", "--max-output-bytes"])
            .arg(max_output.to_string())
            .arg("--home")
            .arg(&home)
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(std::fs::File::create(dir.join("server.err")).unwrap())
            .spawn()
            .unwrap_or_else(|e| panic!("start the interpreter with {}: {e}", py.display()));
        // Its listening line comes once the default Python kernel is up.
        let line = loop {
            let text = std::fs::read_to_string(&out).unwrap_or_default();
            if let Some(l) = text.lines().find(|l| l.contains("listening on ")) {
                break l.to_string();
            }
            let exited = matches!(child.try_wait(), Ok(Some(_)));
            if exited || started.elapsed() > START_LIMIT {
                let _ = child.kill();
                let _ = child.wait();
                let log = std::fs::read_to_string(dir.join("server.err")).unwrap_or_default();
                panic!("the interpreter did not listen within {START_LIMIT:?}:\n{log}");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let addr = line.rsplit("listening on ").next().unwrap().trim();
        Self {
            child,
            url: format!("http://{addr}"),
            ready_in: started.elapsed(),
        }
    }
}

impl Drop for InterpServer {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child's pid; no memory is involved.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        for _ in 0..100 {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
