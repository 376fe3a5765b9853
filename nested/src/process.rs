//! Who a process is, as /proc tells: its pid, when it started (clock ticks
//! since boot, with the boot's id) and its command line. A pid alone is
//! reused; all of these together name one process for as long as the
//! machine runs, so a recorded nested host is re-attached (or killed) only
//! if it is still that very QEMU.

use std::fs;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::NestedError;

/// One process, as recorded when it started.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessIdentity {
    pub pid: u32,
    /// `starttime` of /proc/PID/stat: clock ticks after boot.
    pub start_ticks: u64,
    /// /proc/sys/kernel/random/boot_id: ticks count from this boot.
    pub boot_id: String,
    /// /proc/PID/cmdline, one entry per argument.
    pub cmdline: Vec<String>,
}

/// Why a recorded process is not (or no longer) the one recorded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotThatProcess {
    #[error("process {pid} is gone")]
    Gone { pid: u32 },
    #[error("process {pid} has exited (a zombie, or on its way out)")]
    Exited { pid: u32 },
    #[error("the machine rebooted since process {pid} was recorded")]
    Rebooted { pid: u32 },
    #[error("pid {pid} is another process now (started at tick {found}, not {recorded})")]
    Reused { pid: u32, found: u64, recorded: u64 },
    #[error("pid {pid} runs another command line ({found:?})")]
    OtherCommand { pid: u32, found: String },
}

fn proc_path(pid: u32, what: &str) -> PathBuf {
    PathBuf::from(format!("/proc/{pid}/{what}"))
}

/// This boot's id.
pub(crate) fn boot_id() -> Result<String, NestedError> {
    let path = PathBuf::from("/proc/sys/kernel/random/boot_id");
    fs::read_to_string(&path)
        .map(|s| s.trim().to_string())
        .map_err(|e| crate::io_err(&path, e))
}

/// (state, starttime) from /proc/PID/stat; `None` if there is no such
/// process. The command name (field 2) is in parentheses and may hold
/// spaces and parentheses: fields are counted after its last `)`.
fn stat(pid: u32) -> Option<(char, u64)> {
    let text = fs::read_to_string(proc_path(pid, "stat")).ok()?;
    parse_stat(&text)
}

fn parse_stat(text: &str) -> Option<(char, u64)> {
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state); starttime is field 22.
    let state = fields.first()?.chars().next()?;
    let start = fields.get(22 - 3)?.parse().ok()?;
    Some((state, start))
}

/// How many milliseconds [`ProcessIdentity::of`] waits for a command line
/// that reads empty (a child still inside execve).
const EXEC_WAIT_TRIES: u32 = 1000;

fn cmdline(pid: u32) -> Option<Vec<String>> {
    let raw = fs::read(proc_path(pid, "cmdline")).ok()?;
    Some(
        raw.split(|b| *b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect(),
    )
}

impl ProcessIdentity {
    /// The identity of the running process `pid`.
    pub fn of(pid: u32) -> Result<ProcessIdentity, NestedError> {
        let gone = || NestedError::Tool {
            tool: "/proc".into(),
            detail: format!("process {pid} is gone"),
        };
        let (_, start_ticks) = stat(pid).ok_or_else(gone)?;
        // A child just spawned may still be inside execve: its parent
        // resumes once the old memory is released, before the new image's
        // arguments are set up, and until then its command line reads
        // empty. Wait for it (briefly), or the record would never match.
        let mut cmdline = cmdline(pid).ok_or_else(gone)?;
        for _ in 0..EXEC_WAIT_TRIES {
            if !cmdline.is_empty() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
            cmdline = self::cmdline(pid).ok_or_else(gone)?;
        }
        Ok(ProcessIdentity {
            pid,
            start_ticks,
            boot_id: boot_id()?,
            cmdline,
        })
    }

    /// Whether `pid` is still this process (running, not a zombie).
    pub fn check(&self) -> Result<(), NotThatProcess> {
        let pid = self.pid;
        if boot_id().ok().as_deref() != Some(self.boot_id.as_str()) {
            return Err(NotThatProcess::Rebooted { pid });
        }
        let (state, found) = stat(pid).ok_or(NotThatProcess::Gone { pid })?;
        if found != self.start_ticks {
            return Err(NotThatProcess::Reused {
                pid,
                found,
                recorded: self.start_ticks,
            });
        }
        if state == 'Z' || state == 'X' {
            return Err(NotThatProcess::Exited { pid });
        }
        let args = cmdline(pid).ok_or(NotThatProcess::Gone { pid })?;
        // An empty command line of the recorded process (same start): it is
        // exiting, its memory already gone, before it shows as a zombie.
        if args.is_empty() && !self.cmdline.is_empty() {
            return Err(NotThatProcess::Exited { pid });
        }
        if args != self.cmdline {
            return Err(NotThatProcess::OtherCommand {
                pid,
                found: args.join(" ").chars().take(200).collect(),
            });
        }
        Ok(())
    }

    /// Sends SIGKILL if `pid` is still this process; whether it was.
    pub fn kill(&self) -> bool {
        if self.check().is_err() {
            return false;
        }
        let Ok(pid) = libc::pid_t::try_from(self.pid) else {
            return false;
        };
        // SAFETY: kill(2) on a pid just checked to be the recorded process;
        // no memory is involved.
        unsafe { libc::kill(pid, libc::SIGKILL) == 0 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Command, Stdio};

    #[test]
    fn stat_fields_are_counted_after_the_command_name() {
        let line =
            "4242 (qemu (x) y) S 1 4242 4242 0 -1 4194560 100 0 0 0 5 6 0 0 20 0 3 0 987654 1 2";
        assert_eq!(parse_stat(line), Some(('S', 987654)));
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn a_recorded_process_is_recognised_until_it_ends() {
        let mut child = Command::new("sleep")
            .arg("30")
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        let id = ProcessIdentity::of(child.id()).unwrap();
        assert_eq!(id.cmdline, ["sleep", "30"]);
        assert_eq!(id.check(), Ok(()));

        // Another start time or command line is another process.
        let mut other = id.clone();
        other.start_ticks += 1;
        assert!(matches!(other.check(), Err(NotThatProcess::Reused { .. })));
        assert!(
            !other.kill(),
            "killed a process that is not the recorded one"
        );
        let mut other = id.clone();
        other.cmdline = vec!["qemu-system-x86_64".into()];
        assert!(matches!(
            other.check(),
            Err(NotThatProcess::OtherCommand { .. })
        ));
        let mut other = id.clone();
        other.boot_id = "another-boot".into();
        assert!(matches!(
            other.check(),
            Err(NotThatProcess::Rebooted { .. })
        ));

        assert!(id.kill());
        let _ = child.wait();
        assert_eq!(id.check(), Err(NotThatProcess::Gone { pid: id.pid }));
        assert!(!id.kill());
    }

    #[test]
    fn a_zombie_counts_as_exited() {
        let mut child = Command::new("true").spawn().unwrap();
        // Not reaped until `wait`: /proc keeps it, a zombie, meanwhile.
        std::thread::sleep(std::time::Duration::from_millis(300));
        let id = ProcessIdentity::of(child.id()).unwrap();
        assert_eq!(id.check(), Err(NotThatProcess::Exited { pid: id.pid }));
        let _ = child.wait();
    }
}
