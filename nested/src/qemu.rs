//! Runs QEMU with a deadline and reads the L1 console line by line.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use crate::image::{HEARTBEAT_SECS, MARK_ALIVE, MARK_BEGIN, MARK_END, MARK_INIT};

/// Console silence (several missed heartbeats) after which L1 counts as
/// frozen.
pub const STALL_LIMIT: Duration = Duration::from_secs(HEARTBEAT_SECS * 4);
use crate::{NestedError, RunOutput};

/// Everything QEMU is started with.
#[derive(Debug, Clone)]
pub struct Launch {
    pub qemu: PathBuf,
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    pub disk: Option<PathBuf>,
    pub memory_mib: u32,
    pub cpus: u32,
    pub cmdline: String,
    pub echo: bool,
    /// TCP forwards from 127.0.0.1:host to L1's guest port, (host, guest),
    /// over QEMU's user network; none: L1 has no network card.
    pub forwards: Vec<(u16, u16)>,
    /// L1's connections to an address of the user network that start a
    /// command on the host, (`IP:PORT`, command line); only with forwards.
    pub guest_commands: Vec<(String, String)>,
}

/// The firmware and option ROM directory of a QEMU unpacked outside
/// `/usr` (`.../usr/bin/qemu-system-x86_64` beside `.../usr/share/qemu`,
/// as `scripts/nested-host prepare` leaves bookworm-backports' in the
/// cache): Debian's QEMU is not relocatable, and without `-L` it would
/// load the system QEMU's ROMs. None for the system's own.
fn data_dir_of(qemu: &Path) -> Option<PathBuf> {
    let bin = qemu.parent()?;
    if bin == Path::new("/usr/bin") || bin.file_name()? != "bin" {
        return None;
    }
    let dir = bin.parent()?.join("share").join("qemu");
    dir.is_dir().then_some(dir)
}

impl Launch {
    /// The QEMU arguments: TCG with `-cpu max` (AMD SVM + NPT emulated).
    pub fn args(&self) -> Vec<String> {
        let mut a: Vec<String> = [
            "-accel",
            "tcg,thread=multi",
            "-cpu",
            "max",
            "-nographic",
            "-no-reboot",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if let Some(dir) = data_dir_of(&self.qemu) {
            a.push("-L".into());
            a.push(dir.display().to_string());
        }
        a.push("-nic".into());
        if self.forwards.is_empty() {
            a.push("none".into());
        } else {
            let fwd: String = self
                .forwards
                .iter()
                .map(|(host, guest)| format!(",hostfwd=tcp:127.0.0.1:{host}-:{guest}"))
                .chain(
                    self.guest_commands
                        .iter()
                        .map(|(addr, cmd)| format!(",guestfwd=tcp:{addr}-cmd:{cmd}")),
                )
                .collect();
            a.push(format!("user,model=virtio-net-pci{fwd}"));
        }
        a.extend([
            "-m".into(),
            format!("{}M", self.memory_mib),
            "-smp".into(),
            self.cpus.to_string(),
            "-kernel".into(),
            self.kernel.display().to_string(),
            "-initrd".into(),
            self.initrd.display().to_string(),
            "-append".into(),
            self.cmdline.clone(),
        ]);
        if let Some(disk) = &self.disk {
            a.push("-drive".into());
            a.push(format!(
                "file={},if=virtio,format=raw,cache=unsafe,discard=unmap",
                disk.display()
            ));
        }
        a
    }
}

/// Kills QEMU if the caller goes away early (panic, error).
struct Reaper(Child);

impl Drop for Reaper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Boots L1 and waits for the script's end marker, QEMU's exit or the deadline.
pub fn run(launch: &Launch, timeout: Duration) -> Result<RunOutput, NestedError> {
    let start = Instant::now();
    let mut child = Command::new(&launch.qemu)
        .args(launch.args())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| NestedError::Tool {
            tool: launch.qemu.display().to_string(),
            detail: e.to_string(),
        })?;
    let stdout = child.stdout.take().expect("piped stdout");
    let mut stderr = child.stderr.take().expect("piped stderr");
    let mut reaper = Reaper(child);

    let (tx, rx) = mpsc::channel::<(String, Instant)>();
    thread::spawn(move || {
        let mut reader = BufReader::new(stdout);
        let mut buf = Vec::new();
        while let Ok(n) = reader.read_until(b'\n', &mut buf) {
            if n == 0 {
                break;
            }
            let line = String::from_utf8_lossy(&buf)
                .trim_end_matches(['\r', '\n'])
                .replace('\r', "");
            if tx.send((line, Instant::now())).is_err() {
                break;
            }
            buf.clear();
        }
    });
    let err_thread = thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });

    let deadline = start + timeout;
    let mut console = Vec::<String>::new();
    let mut script_out = Vec::<String>::new();
    let (mut init_at, mut begin_at, mut end) = (None, None, None);
    let mut last_line = Instant::now();
    loop {
        let now = Instant::now();
        // Once the script has reported, QEMU gets a short grace to power off.
        let limit = match end {
            Some((_, at)) => deadline.min(at + Duration::from_secs(20)),
            None => deadline,
        };
        if now >= limit && end.is_some() {
            break;
        }
        if begin_at.is_some() && end.is_none() && now >= last_line + STALL_LIMIT {
            return Err(NestedError::Stalled {
                silent: now - last_line,
                console_tail: tail(&console),
            });
        }
        if now >= limit {
            return Err(NestedError::Timeout {
                after: timeout,
                phase: if begin_at.is_none() { "boot" } else { "script" },
                console_tail: tail(&console),
            });
        }
        let wake = if begin_at.is_some() && end.is_none() {
            limit.min(last_line + STALL_LIMIT)
        } else {
            limit
        };
        match rx.recv_timeout(wake.saturating_duration_since(now)) {
            Ok((line, at)) => {
                last_line = at;
                if line.contains(MARK_ALIVE) {
                    continue;
                }
                if launch.echo {
                    eprintln!("L1| {line}");
                }
                if end.is_none() && crate::l1_wedged(&line) {
                    console.push(line.clone());
                    return Err(NestedError::Wedged {
                        line,
                        console_tail: tail(&console),
                    });
                }
                if end.is_some() {
                    // After the end marker only the power-off follows.
                } else if begin_at.is_some() {
                    // The console may put escape sequences before a marker.
                    match line.find(MARK_END) {
                        Some(i) => {
                            let rc = line[i + MARK_END.len()..].trim();
                            end = Some((rc.parse::<i32>().unwrap_or(-1), at));
                        }
                        None => script_out.push(line.clone()),
                    }
                } else if line.trim_end().ends_with(MARK_BEGIN) {
                    begin_at = Some(at);
                } else if line.contains(MARK_INIT) {
                    init_at = Some(at);
                }
                console.push(line);
            }
            Err(mpsc::RecvTimeoutError::Timeout) => continue,
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    // QEMU closed its console: it has powered off (or died). Give it a moment.
    let status = wait_with_deadline(&mut reaper.0, Duration::from_secs(10));
    let qemu_stderr = err_thread.join().unwrap_or_default();
    let total = start.elapsed();
    let Some((exit_code, end_at)) = end else {
        return Err(NestedError::NoResult {
            status,
            reached: if begin_at.is_some() {
                "the script started but its end marker never came"
            } else if init_at.is_some() {
                "the L1 init started but the script never began"
            } else {
                "the L1 kernel never reached its init"
            },
            qemu_stderr: qemu_stderr.trim().to_string(),
            console_tail: tail(&console),
        });
    };
    let begin_at = begin_at.expect("end implies begin");
    let mut stdout = script_out.join("\n");
    if !stdout.is_empty() {
        stdout.push('\n');
    }
    Ok(RunOutput {
        exit_code,
        stdout,
        console: console.join("\n"),
        kernel_to_init: init_at.map(|t| t - start),
        boot: begin_at - start,
        script: end_at - begin_at,
        total,
    })
}

fn wait_with_deadline(child: &mut Child, limit: Duration) -> String {
    let until = Instant::now() + limit;
    loop {
        match child.try_wait() {
            Ok(Some(s)) => return s.to_string(),
            Ok(None) if Instant::now() < until => thread::sleep(Duration::from_millis(20)),
            Ok(None) => return "still running (killed)".into(),
            Err(e) => return format!("unknown ({e})"),
        }
    }
}

pub(crate) fn tail(lines: &[String]) -> String {
    let from = lines.len().saturating_sub(60);
    lines[from..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args_use_tcg_max_and_the_disk() {
        let l = Launch {
            qemu: "qemu".into(),
            kernel: "/k".into(),
            initrd: "/i".into(),
            disk: Some("/d.ext4".into()),
            memory_mib: 3072,
            cpus: 2,
            cmdline: "console=ttyS0".into(),
            echo: false,
            forwards: Vec::new(),
            guest_commands: Vec::new(),
        };
        let a = l.args().join(" ");
        assert!(a.contains("-accel tcg,thread=multi -cpu max"), "{a}");
        assert!(a.contains("-m 3072M -smp 2"), "{a}");
        assert!(a.contains("-no-reboot"), "{a}");
        assert!(a.contains("file=/d.ext4,if=virtio,format=raw"), "{a}");
        assert!(a.contains("-nic none"), "{a}");
    }

    #[test]
    fn a_qemu_unpacked_outside_usr_gets_its_own_firmware_directory() {
        let root = tempfile::tempdir().unwrap();
        let bin = root.path().join("usr/bin");
        let share = root.path().join("usr/share/qemu");
        std::fs::create_dir_all(&bin).unwrap();
        std::fs::create_dir_all(&share).unwrap();
        let unpacked = bin.join("qemu-system-x86_64");
        assert_eq!(data_dir_of(&unpacked), Some(share.clone()));
        let l = Launch {
            qemu: unpacked,
            kernel: "/k".into(),
            initrd: "/i".into(),
            disk: None,
            memory_mib: 512,
            cpus: 1,
            cmdline: String::new(),
            echo: false,
            forwards: Vec::new(),
            guest_commands: Vec::new(),
        };
        let a = l.args().join(" ");
        assert!(a.contains(&format!("-L {}", share.display())), "{a}");
        // The system's own, or one without a data directory: nothing.
        assert_eq!(data_dir_of(Path::new("/usr/bin/qemu-system-x86_64")), None);
        assert_eq!(data_dir_of(&root.path().join("qemu")), None);
        assert_eq!(data_dir_of(Path::new("qemu")), None);
    }

    #[test]
    fn forwards_give_l1_a_user_network() {
        let l = Launch {
            qemu: "qemu".into(),
            kernel: "/k".into(),
            initrd: "/i".into(),
            disk: None,
            memory_mib: 1024,
            cpus: 1,
            cmdline: String::new(),
            echo: false,
            forwards: vec![(40123, 7801)],
            guest_commands: vec![("10.0.2.100:2049".into(), "/bin/torpor pipe /s".into())],
        };
        let a = l.args().join(" ");
        assert!(
            a.contains(
                "-nic user,model=virtio-net-pci,hostfwd=tcp:127.0.0.1:40123-:7801,\
                 guestfwd=tcp:10.0.2.100:2049-cmd:/bin/torpor pipe /s"
            ),
            "{a}"
        );
    }

    #[test]
    fn tail_keeps_the_last_lines() {
        let lines: Vec<String> = (0..100).map(|i| i.to_string()).collect();
        let t = tail(&lines);
        assert!(t.starts_with("40\n") && t.ends_with("99"));
    }
}
