//! A long-running L1: booted once, its script left running (a service),
//! reachable from the host over TCP ports QEMU's user network forwards from
//! 127.0.0.1. QEMU's console (its stdout and stderr) goes to `console.log`
//! in the host's work directory, read back line by line.
//!
//! Owned ([`NestedHost::start`]): QEMU dies with the thread that started it
//! and with the returned host. Detached ([`NestedHost::start_detached`]):
//! QEMU runs in a process group of its own and outlives its starter (kill
//! -9 included); [`RunningHost::record`] says how to find it again and
//! [`RunningHost::adopt`] re-attaches to it, if it is still that QEMU.

use std::collections::VecDeque;
use std::fs::{self, File, OpenOptions};
use std::io::{BufRead, BufReader, Seek, SeekFrom};
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use torpor_sync::Locked;

use crate::process::{NotThatProcess, ProcessIdentity};
use crate::{qemu, NestedError, NestedHost, WorkDir};

/// Where [`NestedHost::start_detached`] keeps the console of the host that
/// ran in `work_dir` before: `<work_dir>.previous-console.log`.
pub fn previous_console(work_dir: &Path) -> std::path::PathBuf {
    let mut name = work_dir.file_name().unwrap_or_default().to_os_string();
    name.push(".previous-console.log");
    work_dir.with_file_name(name)
}

/// Moves the console of the host that ran in `work_dir` (if any) to
/// [`previous_console`], replacing the one kept there before.
fn keep_previous_console(work_dir: &Path) -> Result<(), NestedError> {
    let console = work_dir.join(CONSOLE_FILE);
    if !console.is_file() {
        return Ok(());
    }
    let kept = previous_console(work_dir);
    fs::rename(&console, &kept).map_err(|e| crate::io_err(&kept, e))
}

/// Console lines kept for [`RunningHost::console_tail`].
const KEEP_LINES: usize = 200;
/// QEMU's console, in the work directory.
pub const CONSOLE_FILE: &str = "console.log";

/// How to find a detached nested host again: the QEMU process, its
/// forwarded ports and its work directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostRecord {
    pub process: ProcessIdentity,
    /// (guest port, host port on 127.0.0.1).
    pub forwards: Vec<(u16, u16)>,
    pub work_dir: PathBuf,
}

#[derive(Debug)]
enum Qemu {
    /// This process's child.
    Child(Child),
    /// Another process's child (a previous owner's), known by its
    /// identity: its exit status cannot be had, only that it ended.
    Adopted,
}

/// A running nested host; see [`NestedHost::start`].
#[derive(Debug)]
pub struct RunningHost {
    qemu: Qemu,
    /// Detached hosts' QEMU (the one it re-attaches to).
    identity: Option<ProcessIdentity>,
    /// Dropping the host leaves QEMU running (detached).
    keep: bool,
    /// (guest port, host port on 127.0.0.1).
    forwards: Vec<(u16, u16)>,
    console: Arc<Mutex<VecDeque<String>>>,
    /// When the last console line came (L1's init prints a heartbeat every
    /// minute while its script runs).
    last_line: Arc<Mutex<Instant>>,
    /// Ends the console reader.
    stop: Arc<AtomicBool>,
    work: WorkDir,
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
        self.spawn(script, guest_ports, WorkDir::new()?, false)
    }

    /// [`NestedHost::start`], but QEMU outlives this process: no death
    /// signal, a process group of its own (a terminal's ctrl-c is not
    /// its), dropping the host leaves it running, and its images and
    /// console stay in `work_dir` (emptied first; the console of the host
    /// that was there is kept beside it, [`previous_console`]: why it
    /// ended). [`RunningHost::record`] and [`RunningHost::adopt`] find it
    /// again; [`RunningHost::kill`] stops it.
    pub fn start_detached(
        &self,
        script: &str,
        guest_ports: &[u16],
        work_dir: &Path,
    ) -> Result<RunningHost, NestedError> {
        if work_dir.exists() {
            keep_previous_console(work_dir)?;
            fs::remove_dir_all(work_dir).map_err(|e| crate::io_err(work_dir, e))?;
        }
        self.spawn(script, guest_ports, WorkDir::kept(work_dir)?, true)
    }

    fn spawn(
        &self,
        script: &str,
        guest_ports: &[u16],
        work: WorkDir,
        detached: bool,
    ) -> Result<RunningHost, NestedError> {
        let mut forwards = Vec::new();
        for &guest in guest_ports {
            forwards.push((guest, free_port()?));
        }
        let launch = self.launch(
            &work,
            script,
            forwards.iter().map(|&(g, h)| (h, g)).collect(),
        )?;
        let setpriv = Path::new("/usr/bin/setpriv");
        let mut cmd = if setpriv.is_file() && !detached {
            let mut c = Command::new(setpriv);
            c.args(["--pdeathsig", "KILL", "--"]).arg(&launch.qemu);
            c
        } else {
            Command::new(&launch.qemu)
        };
        if detached {
            cmd.process_group(0);
        }
        let console_path = work.path().join(CONSOLE_FILE);
        let console_file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&console_path)
            .map_err(|e| crate::io_err(&console_path, e))?;
        let errors = console_file
            .try_clone()
            .map_err(|e| crate::io_err(&console_path, e))?;
        let child = cmd
            .args(launch.args())
            .stdin(Stdio::null())
            .stdout(console_file)
            .stderr(errors)
            .spawn()
            .map_err(|e| NestedError::Tool {
                tool: launch.qemu.display().to_string(),
                detail: e.to_string(),
            })?;
        // spawn returns once QEMU is exec'd (no setpriv in between when
        // detached): /proc shows QEMU's own command line.
        let identity = if detached {
            Some(ProcessIdentity::of(child.id())?)
        } else {
            None
        };
        RunningHost::new(
            Qemu::Child(child),
            identity,
            detached,
            forwards,
            work,
            launch.echo,
            false,
        )
    }
}

impl RunningHost {
    fn new(
        qemu: Qemu,
        identity: Option<ProcessIdentity>,
        keep: bool,
        forwards: Vec<(u16, u16)>,
        work: WorkDir,
        echo: bool,
        echo_past: bool,
    ) -> Result<RunningHost, NestedError> {
        let console = Arc::new(Mutex::new(VecDeque::new()));
        let last_line = Arc::new(Mutex::new(Instant::now()));
        let stop = Arc::new(AtomicBool::new(false));
        let path = work.path().join(CONSOLE_FILE);
        let file = File::open(&path).map_err(|e| crate::io_err(&path, e))?;
        let reader = ConsoleReader {
            console: console.clone(),
            last_line: last_line.clone(),
            stop: stop.clone(),
            echo,
        };
        thread::Builder::new()
            .name("nested-console".into())
            .spawn(move || reader.follow(file, echo_past))
            .map_err(|e| crate::io_err(&path, e))?;
        Ok(RunningHost {
            qemu,
            identity,
            keep,
            forwards,
            console,
            last_line,
            stop,
            work,
        })
    }

    /// How to find this (detached) host again; `None` for an owned one.
    pub fn record(&self) -> Option<HostRecord> {
        Some(HostRecord {
            process: self.identity.clone()?,
            forwards: self.forwards.clone(),
            work_dir: self.work.path().to_path_buf(),
        })
    }

    /// Re-attaches to the detached host `record` names, if its QEMU is
    /// still that process (pid, start time, boot, command line): its
    /// console is read again from its work directory (the earlier lines
    /// too; echoed from now on only), and dropping it leaves it running.
    pub fn adopt(record: &HostRecord, echo: bool) -> Result<RunningHost, AdoptError> {
        record.process.check()?;
        let host = RunningHost::new(
            Qemu::Adopted,
            Some(record.process.clone()),
            true,
            record.forwards.clone(),
            WorkDir::kept(&record.work_dir)?,
            echo,
            false,
        )?;
        Ok(host)
    }

    /// The port on 127.0.0.1 that reaches `guest_port` in L1.
    pub fn host_port(&self, guest_port: u16) -> Option<u16> {
        self.forwards
            .iter()
            .find(|(g, _)| *g == guest_port)
            .map(|(_, h)| *h)
    }

    /// QEMU's exit status once it has exited (L1 powered off or crashed).
    pub fn exited(&mut self) -> Option<String> {
        match &mut self.qemu {
            Qemu::Child(child) => match child.try_wait() {
                Ok(Some(status)) => Some(status.to_string()),
                Ok(None) => None,
                Err(e) => Some(format!("unknown ({e})")),
            },
            Qemu::Adopted => {
                let id = self.identity.as_ref()?;
                id.check().err().map(|e| format!("{e}"))
            }
        }
    }

    /// Waits for QEMU to exit; its status.
    pub fn wait(&mut self) -> String {
        if let Qemu::Child(child) = &mut self.qemu {
            return match child.wait() {
                Ok(status) => status.to_string(),
                Err(e) => format!("unknown ({e})"),
            };
        }
        loop {
            if let Some(status) = self.exited() {
                return status;
            }
            thread::sleep(Duration::from_millis(500));
        }
    }

    /// Stops QEMU (owned or adopted) and waits until it is gone (an
    /// adopted one: at most 10 s, then it is said to be gone anyway).
    pub fn kill(&mut self) {
        match &mut self.qemu {
            Qemu::Child(child) => {
                let _ = child.kill();
                let _ = child.wait();
            }
            Qemu::Adopted => {
                let Some(id) = &self.identity else { return };
                id.kill();
                let deadline = Instant::now() + Duration::from_secs(10);
                while id.check().is_ok() && Instant::now() < deadline {
                    thread::sleep(Duration::from_millis(50));
                }
            }
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
        self.stop.store(true, Ordering::Relaxed);
        if !self.keep {
            self.kill();
        }
    }
}

/// Why [`RunningHost::adopt`] did not re-attach.
#[derive(Debug, thiserror::Error)]
pub enum AdoptError {
    #[error("the recorded nested host is not running: {0}")]
    NotRunning(#[from] NotThatProcess),
    #[error(transparent)]
    Nested(#[from] NestedError),
}

/// Follows the console file as QEMU appends to it.
struct ConsoleReader {
    console: Arc<Mutex<VecDeque<String>>>,
    last_line: Arc<Mutex<Instant>>,
    stop: Arc<AtomicBool>,
    echo: bool,
}

impl ConsoleReader {
    /// Reads every line from the start, then what comes, until stopped.
    /// Lines already there are echoed only if `echo_past`.
    fn follow(self, mut file: File, echo_past: bool) {
        let past = file.seek(SeekFrom::End(0)).unwrap_or(0);
        if file.seek(SeekFrom::Start(0)).is_err() {
            return;
        }
        let mut reader = BufReader::new(file);
        let mut read = 0u64;
        let mut buf = Vec::new();
        while !self.stop.load(Ordering::Relaxed) {
            match reader.read_until(b'\n', &mut buf) {
                Ok(n) => read += n as u64,
                Err(_) => return,
            }
            if !buf.ends_with(b"\n") {
                // The end for now (a partial line stays in buf).
                thread::sleep(Duration::from_millis(100));
                continue;
            }
            let line = String::from_utf8_lossy(&buf)
                .trim_end_matches(['\r', '\n'])
                .replace('\r', "");
            buf.clear();
            if self.echo && (echo_past || read > past) {
                eprintln!("L1| {line}");
            }
            *self.last_line.locked() = Instant::now();
            let mut c = self.console.locked();
            if c.len() == KEEP_LINES {
                c.pop_front();
            }
            c.push_back(format!("L1| {line}"));
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A "QEMU" that is `sh` printing to the console file of `dir`,
    /// started as the detached host's is.
    fn detached_shell(dir: &Path) -> RunningHost {
        let work = WorkDir::kept(dir).unwrap();
        let console = File::create(dir.join(CONSOLE_FILE)).unwrap();
        let child = Command::new("sh")
            .args([
                "-c",
                "echo booted; sleep 0.3; echo second; while :; do sleep 1; done",
            ])
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(console)
            .spawn()
            .unwrap();
        thread::sleep(Duration::from_millis(100));
        let identity = ProcessIdentity::of(child.id()).unwrap();
        RunningHost::new(
            Qemu::Child(child),
            Some(identity),
            true,
            vec![(7801, 40000)],
            work,
            false,
            false,
        )
        .unwrap()
    }

    fn wait_for(host: &RunningHost, text: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !host.console_tail().contains(text) {
            assert!(Instant::now() < deadline, "{:?}", host.console_tail());
            thread::sleep(Duration::from_millis(20));
        }
    }

    #[test]
    fn a_detached_host_outlives_its_owner_and_is_adopted_from_its_record() {
        let dir = tempfile::tempdir().unwrap();
        let work = dir.path().join("l1");
        let first = detached_shell(&work);
        wait_for(&first, "second");
        let record = first.record().expect("a detached host has a record");
        assert_eq!(record.forwards, [(7801, 40000)]);
        // The record goes through JSON (it is kept in a file).
        let record: HostRecord =
            serde_json::from_str(&serde_json::to_string(&record).unwrap()).unwrap();
        drop(first);
        assert_eq!(record.process.check(), Ok(()), "dropping it stopped it");
        assert!(work.join(CONSOLE_FILE).exists(), "its work dir went");

        let mut again = RunningHost::adopt(&record, false).unwrap();
        assert_eq!(again.host_port(7801), Some(40000));
        // The console from its start.
        wait_for(&again, "L1| booted");
        assert_eq!(again.exited(), None);
        again.kill();
        let status = again.exited().expect("killed");
        assert!(
            status.contains("is gone") || status.contains("exited"),
            "{status}"
        );
        drop(again);
        assert!(matches!(
            RunningHost::adopt(&record, false),
            Err(AdoptError::NotRunning(_))
        ));
    }

    #[test]
    fn the_console_of_the_host_before_is_kept_beside_the_work_dir() {
        let dir = tempfile::tempdir().unwrap();
        let work = dir.path().join("nested-host");
        fs::create_dir(&work).unwrap();
        keep_previous_console(&work).unwrap();
        let kept = previous_console(&work);
        assert_eq!(kept, dir.path().join("nested-host.previous-console.log"));
        assert!(!kept.exists(), "no console, nothing kept");
        fs::write(work.join(CONSOLE_FILE), "Kernel panic\n").unwrap();
        keep_previous_console(&work).unwrap();
        assert_eq!(fs::read_to_string(&kept).unwrap(), "Kernel panic\n");
        assert!(!work.join(CONSOLE_FILE).exists());
        // The next host's replaces it.
        fs::write(work.join(CONSOLE_FILE), "second\n").unwrap();
        keep_previous_console(&work).unwrap();
        assert_eq!(fs::read_to_string(&kept).unwrap(), "second\n");
    }

    #[test]
    fn another_process_at_the_recorded_pid_is_not_adopted() {
        let dir = tempfile::tempdir().unwrap();
        let mut host = detached_shell(&dir.path().join("l1"));
        let mut record = host.record().unwrap();
        record.process.cmdline = vec!["qemu-system-x86_64".into(), "-m".into()];
        assert!(matches!(
            RunningHost::adopt(&record, false),
            Err(AdoptError::NotRunning(NotThatProcess::OtherCommand { .. }))
        ));
        host.kill();
    }
}
