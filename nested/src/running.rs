//! A long-running L1: booted once, its script left running (a service),
//! reachable from the host over TCP ports QEMU's user network forwards from
//! 127.0.0.1. The owner holds the QEMU child: dropping it, or the owning
//! process dying, stops L1.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use torpor_sync::Locked;

use crate::{qemu, NestedError, NestedHost, WorkDir};

/// Console lines kept for [`RunningHost::console_tail`].
const KEEP_LINES: usize = 200;

/// A running nested host; see [`NestedHost::start`].
#[derive(Debug)]
pub struct RunningHost {
    child: Child,
    /// (guest port, host port on 127.0.0.1).
    forwards: Vec<(u16, u16)>,
    console: Arc<Mutex<VecDeque<String>>>,
    /// When the last console line came (L1's init prints a heartbeat every
    /// minute while its script runs).
    last_line: Arc<Mutex<Instant>>,
    _work: WorkDir,
}

impl NestedHost {
    /// Boots L1 and leaves it running `script` (a service, say) until the
    /// returned host is dropped or the script ends (L1 then powers off).
    /// Each of `guest_ports` is forwarded from a free port on 127.0.0.1
    /// ([`RunningHost::host_port`]); L1 is 10.0.2.15 on QEMU's user network.
    /// Returns once QEMU runs, long before L1 has booted.
    ///
    /// QEMU gets `PR_SET_PDEATHSIG` (through util-linux `setpriv`, when
    /// installed): it dies with the thread that started it, so start it
    /// from a thread that lives as long as L1 should.
    pub fn start(&self, script: &str, guest_ports: &[u16]) -> Result<RunningHost, NestedError> {
        let mut forwards = Vec::new();
        for &guest in guest_ports {
            forwards.push((guest, free_port()?));
        }
        let work = WorkDir::new()?;
        let launch = self.launch(
            &work,
            script,
            forwards.iter().map(|&(g, h)| (h, g)).collect(),
        )?;
        let setpriv = Path::new("/usr/bin/setpriv");
        let mut cmd = if setpriv.is_file() {
            let mut c = Command::new(setpriv);
            c.args(["--pdeathsig", "KILL", "--"]).arg(&launch.qemu);
            c
        } else {
            Command::new(&launch.qemu)
        };
        let mut child = cmd
            .args(launch.args())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| NestedError::Tool {
                tool: launch.qemu.display().to_string(),
                detail: e.to_string(),
            })?;
        let console = Arc::new(Mutex::new(VecDeque::new()));
        let last_line = Arc::new(Mutex::new(Instant::now()));
        let stdout = child.stdout.take().expect("piped stdout");
        let stderr = child.stderr.take().expect("piped stderr");
        let echo = launch.echo;
        for (stream, prefix) in [
            (Box::new(stdout) as Box<dyn std::io::Read + Send>, "L1| "),
            (Box::new(stderr), "qemu| "),
        ] {
            let console = console.clone();
            let last_line = last_line.clone();
            thread::spawn(move || {
                let mut reader = BufReader::new(stream);
                let mut buf = Vec::new();
                while let Ok(n) = reader.read_until(b'\n', &mut buf) {
                    if n == 0 {
                        break;
                    }
                    let line = String::from_utf8_lossy(&buf)
                        .trim_end_matches(['\r', '\n'])
                        .replace('\r', "");
                    if echo {
                        eprintln!("{prefix}{line}");
                    }
                    *last_line.locked() = Instant::now();
                    let mut c = console.locked();
                    if c.len() == KEEP_LINES {
                        c.pop_front();
                    }
                    c.push_back(format!("{prefix}{line}"));
                    buf.clear();
                }
            });
        }
        Ok(RunningHost {
            child,
            forwards,
            console,
            last_line,
            _work: work,
        })
    }
}

impl RunningHost {
    /// The port on 127.0.0.1 that reaches `guest_port` in L1.
    pub fn host_port(&self, guest_port: u16) -> Option<u16> {
        self.forwards
            .iter()
            .find(|(g, _)| *g == guest_port)
            .map(|(_, h)| *h)
    }

    /// QEMU's exit status once it has exited (L1 powered off or crashed).
    pub fn exited(&mut self) -> Option<String> {
        match self.child.try_wait() {
            Ok(Some(status)) => Some(status.to_string()),
            Ok(None) => None,
            Err(e) => Some(format!("unknown ({e})")),
        }
    }

    /// Waits for QEMU to exit; its status.
    pub fn wait(&mut self) -> String {
        match self.child.wait() {
            Ok(status) => status.to_string(),
            Err(e) => format!("unknown ({e})"),
        }
    }

    /// How long L1's console (or QEMU's stderr) has said nothing: past
    /// [`crate::STALL_LIMIT`], L1 is frozen (seen under multi-threaded
    /// TCG: both vCPUs spinning, no heartbeat, no answer).
    pub fn silent_for(&self) -> Duration {
        self.last_line.locked().elapsed()
    }

    /// The last console lines (L1's console and QEMU's stderr).
    pub fn console_tail(&self) -> String {
        let c = self.console.locked();
        let lines: Vec<String> = c.iter().cloned().collect();
        qemu::tail(&lines)
    }
}

impl Drop for RunningHost {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A port on 127.0.0.1 nothing listens on now (QEMU binds it right after).
fn free_port() -> Result<u16, NestedError> {
    let listener =
        TcpListener::bind("127.0.0.1:0").map_err(|e| crate::io_err(Path::new("127.0.0.1:0"), e))?;
    listener
        .local_addr()
        .map(|a| a.port())
        .map_err(|e| crate::io_err(Path::new("127.0.0.1:0"), e))
}
