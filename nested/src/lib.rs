//! torpor-nested: a nested hardware-virtualization host for end-to-end tests
//! that need a real Linux guest.
//!
//! On PVM hosts a stock Linux guest cannot boot under torpor's VMM. This crate
//! boots QEMU with TCG and `-cpu max` (an emulated AMD CPU with SVM and NPT),
//! runs Debian's cloud kernel in it with `kvm_amd` loaded, so a real
//! `/dev/kvm` exists inside ("L1"), carries files in, runs a shell script
//! there and hands back its exit code and output ([`NestedHost::run`]), or
//! leaves it running as a service reachable over forwarded TCP ports
//! ([`NestedHost::start`], used by `torpor serve --nested-pod`).
//!
//! ```no_run
//! use std::time::Duration;
//! use torpor_nested::NestedHost;
//!
//! let out = NestedHost::builder()
//!     .file("target/debug/torpor", "/opt/torpor/torpor")
//!     // `torpor vmm` execs the per-VM binary beside it.
//!     .file("target/debug/torpor-vmm", "/opt/torpor/torpor-vmm")
//!     .run("/opt/torpor/torpor vmm --kernel builtin:probe --cmdline probe.iters=3",
//!          Duration::from_secs(600))?;
//! assert_eq!(out.exit_code, 0);
//! print!("{}", out.stdout);
//! # Ok::<(), torpor_nested::NestedError>(())
//! ```
//!
//! The L1 kernel, its modules and busybox come from `scripts/nested-host
//! prepare` (see [`assets`]); QEMU from Debian's `qemu-system-x86`.

pub mod assets;
mod cpio;
pub mod image;
pub mod process;
mod qemu;
mod running;

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use torpor_sync::Locked;

pub use assets::{find_qemu, L1Assets};
use image::Carried;
pub use process::{NotThatProcess, ProcessIdentity};
pub use qemu::STALL_LIMIT;
pub use running::{previous_console, AdoptError, HostRecord, RunningHost, CONSOLE_FILE};

/// Whether an L1 console line is its kernel saying it is wedged: a soft
/// lockup, an RCU stall, a lost timer, or a panic. Under TCG these do not
/// pass (seen: ten minutes of RCU stalls after CPU 0's timer stopped; a
/// vCPU thread's kernel stack overflowing in `error_entry` while its L2
/// guest touched memory fast, then a panic). Only kernel lines count
/// (`[  12.345678] ...`), not a script's output that quotes an L2 guest's
/// console.
pub fn l1_wedged(line: &str) -> bool {
    line.trim_start().starts_with('[')
        && [
            "BUG: soft lockup",
            "detected stalls on CPUs",
            "timer wakeup didn't happen",
            "stack guard page was hit",
            "Kernel panic - not syncing",
        ]
        .iter()
        .any(|m| line.contains(m))
}

/// Whether L1's console is echoed to stderr (`TORPOR_NESTED_ECHO=1`).
pub fn echo_from_env() -> bool {
    std::env::var_os("TORPOR_NESTED_ECHO").is_some_and(|v| v == "1")
}

/// A shell function for L1 scripts that build a Linux template through
/// the API (`$T` is the `torpor` binary): `tpl_create OUT NAME ARGS...`
/// runs `$T template create --name NAME ARGS...` with its output in OUT,
/// and once more if it fails, after saying why and deleting what the first
/// try left. Under TCG, L1's KVM now and then lets a guest's secondary vCPU
/// triple-fault while the guest brings it up (`KVM_EXIT_SHUTDOWN` on vCPU 1
/// with an empty console, in about one build of three), which no host with
/// real virtualization has shown; one more boot goes through.
pub const TEMPLATE_CREATE_SH: &str = r#"
tpl_create() {
  out=$1; name=$2; shift 2
  for try in 1 2; do
    $T template create --name "$name" "$@" >"$out" 2>&1 && return 0
    [ $try = 2 ] && return 1
    echo "torpor-nested: building template $name failed, trying once more: $(tr '\n' ' ' <"$out")"
    $T template delete "$name" >/dev/null 2>&1
  done
}
"#;

/// Why a nested run could not give a result.
#[derive(Debug, thiserror::Error)]
pub enum NestedError {
    #[error(
        "QEMU is missing: looked for {searched}; install Debian's qemu-system-x86 \
         (scripts/nested-host prepare does)"
    )]
    QemuMissing { searched: String },
    #[error("{what} of the nested host is missing at {path}: run scripts/nested-host prepare")]
    L1Missing { what: String, path: PathBuf },
    #[error("file to carry into L1 is missing: {path}")]
    FileMissing { path: PathBuf },
    #[error("bad guest path {path:?}: {why}")]
    BadGuestPath { path: String, why: String },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{tool} failed: {detail}")]
    Tool { tool: String, detail: String },
    #[error(
        "nested host timed out after {after:?} during {phase}; last console lines:\n{console_tail}"
    )]
    Timeout {
        after: Duration,
        phase: &'static str,
        console_tail: String,
    },
    #[error(
        "the nested host froze: its console (heartbeat included) was silent for {silent:?} \
         during the script; last console lines:\n{console_tail}"
    )]
    Stalled {
        silent: Duration,
        console_tail: String,
    },
    #[error("the nested host's kernel is wedged ({line}); last console lines:\n{console_tail}")]
    Wedged { line: String, console_tail: String },
    #[error(
        "nested host gave no result ({reached}); QEMU exit: {status}; QEMU stderr: {qemu_stderr}\n\
         last console lines:\n{console_tail}"
    )]
    NoResult {
        status: String,
        reached: &'static str,
        qemu_stderr: String,
        console_tail: String,
    },
}

pub(crate) fn io_err(path: &Path, source: std::io::Error) -> NestedError {
    NestedError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// What one run in L1 produced.
#[derive(Debug, Clone)]
pub struct RunOutput {
    /// The script's exit status inside L1.
    pub exit_code: i32,
    /// What the script wrote (stdout and stderr interleaved, as on a
    /// console; kernel warnings printed meanwhile may appear too).
    pub stdout: String,
    /// The whole L1 console, kernel messages included.
    pub console: String,
    /// QEMU start to the L1 init's first line.
    pub kernel_to_init: Option<Duration>,
    /// QEMU start to the script's start (modules loaded, disk mounted).
    pub boot: Duration,
    /// The script's own run time.
    pub script: Duration,
    /// QEMU start to QEMU exit.
    pub total: Duration,
}

/// Configures a nested host; see [`NestedHost::builder`].
#[derive(Debug, Clone)]
pub struct NestedHostBuilder {
    files: Vec<(PathBuf, String)>,
    memory_mib: u32,
    cpus: u32,
    echo: bool,
    l1_dir: Option<PathBuf>,
    qemu: Option<PathBuf>,
    extra_cmdline: String,
    spare_mib: u64,
    guest_commands: Vec<(String, String)>,
}

impl Default for NestedHostBuilder {
    fn default() -> Self {
        Self {
            files: Vec::new(),
            memory_mib: 3072,
            cpus: 2,
            echo: echo_from_env(),
            l1_dir: None,
            qemu: None,
            extra_cmdline: String::new(),
            spare_mib: 0,
            guest_commands: Vec::new(),
        }
    }
}

impl NestedHostBuilder {
    /// Carries a host file into L1 at `guest_path` (absolute). Dynamically
    /// linked executables bring their loader and libraries along.
    pub fn file(mut self, host_path: impl Into<PathBuf>, guest_path: impl Into<String>) -> Self {
        self.files.push((host_path.into(), guest_path.into()));
        self
    }

    /// L1 memory (default 3072 MiB).
    pub fn memory_mib(mut self, mib: u32) -> Self {
        self.memory_mib = mib;
        self
    }

    /// L1 vCPUs (default 2).
    pub fn cpus(mut self, n: u32) -> Self {
        self.cpus = n;
        self
    }

    /// Copies every L1 console line to stderr as it arrives (default: only
    /// when `TORPOR_NESTED_ECHO=1`).
    pub fn echo(mut self, on: bool) -> Self {
        self.echo = on;
        self
    }

    /// Uses L1 assets from `dir` instead of the cache.
    pub fn l1_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.l1_dir = Some(dir.into());
        self
    }

    /// Uses this QEMU binary.
    pub fn qemu(mut self, path: impl Into<PathBuf>) -> Self {
        self.qemu = Some(path.into());
        self
    }

    /// Free space on the payload disk for what the script writes there
    /// (`/payload`, beside the carried files), in MiB (default 0: a little
    /// room only). The image is sparse and mounted with discard: the host's
    /// disk holds what L1 has written and not deleted, not this size. L1's
    /// own `/tmp` is a tmpfs in its RAM.
    pub fn spare_mib(mut self, mib: u64) -> Self {
        self.spare_mib = mib;
        self
    }

    /// L1's TCP connections to `addr` (`IP:PORT` in QEMU's user network,
    /// e.g. `10.0.2.100:2049`) each start `argv` on the host, its stdin
    /// and stdout the connection (QEMU's `guestfwd=...-cmd:`). Only for
    /// a host with a network (forwarded ports); no argument may hold
    /// white space, a quote, a backslash or a comma.
    pub fn guest_command(mut self, addr: impl Into<String>, argv: &[&str]) -> Self {
        self.guest_commands.push((addr.into(), argv.join(" ")));
        self
    }

    /// Appends to the L1 kernel command line.
    pub fn cmdline(mut self, extra: impl Into<String>) -> Self {
        self.extra_cmdline = extra.into();
        self
    }

    /// Checks that QEMU, the L1 assets and every carried file exist.
    pub fn build(self) -> Result<NestedHost, NestedError> {
        let qemu = match self.qemu {
            Some(q) if q.is_file() => q,
            Some(q) => {
                return Err(NestedError::QemuMissing {
                    searched: q.display().to_string(),
                })
            }
            None => find_qemu()?,
        };
        let assets = match &self.l1_dir {
            Some(dir) => L1Assets::from_dir(dir)?,
            None => L1Assets::locate()?,
        };
        for (addr, cmd) in &self.guest_commands {
            let plain = |s: &str| {
                !s.is_empty()
                    && !s
                        .chars()
                        .any(|c| c.is_whitespace() || matches!(c, '\'' | '"' | '\\' | ','))
            };
            if !plain(addr) || !cmd.split(' ').all(plain) {
                return Err(NestedError::BadGuestPath {
                    path: format!("{addr} {cmd}"),
                    why: "a guest command's address and words are plain (no white space, \
                          quotes, backslashes or commas)"
                        .into(),
                });
            }
        }
        let mut carried = Vec::new();
        for (host, guest) in self.files {
            if !host.is_file() {
                return Err(NestedError::FileMissing { path: host });
            }
            image::check_guest_path(&guest)?;
            carried.push(Carried { host, guest });
        }
        Ok(NestedHost {
            qemu,
            assets,
            carried,
            memory_mib: self.memory_mib,
            cpus: self.cpus,
            echo: self.echo,
            extra_cmdline: self.extra_cmdline,
            spare_mib: self.spare_mib,
            guest_commands: self.guest_commands,
        })
    }

    /// Builds the host and runs `script` in it (see [`NestedHost::run`]).
    pub fn run(self, script: &str, timeout: Duration) -> Result<RunOutput, NestedError> {
        self.build()?.run(script, timeout)
    }
}

/// A configured nested host; every [`run`](Self::run) boots a fresh L1.
#[derive(Debug, Clone)]
pub struct NestedHost {
    qemu: PathBuf,
    assets: L1Assets,
    carried: Vec<Carried>,
    memory_mib: u32,
    cpus: u32,
    echo: bool,
    extra_cmdline: String,
    spare_mib: u64,
    guest_commands: Vec<(String, String)>,
}

impl NestedHost {
    pub fn builder() -> NestedHostBuilder {
        NestedHostBuilder::default()
    }

    /// The L1 assets in use.
    pub fn assets(&self) -> &L1Assets {
        &self.assets
    }

    /// Boots L1, runs `script` with busybox `sh` (PATH has busybox; carried
    /// files are in place; `/dev/kvm` is there when the emulated CPU allows),
    /// and returns its exit code and output. The whole run, boot included,
    /// must end within `timeout`. Runs from one process take turns.
    pub fn run(&self, script: &str, timeout: Duration) -> Result<RunOutput, NestedError> {
        // One L1 at a time per process: tests run on parallel threads, and
        // two TCG hosts sharing the CPUs only make both slower (and their
        // timeouts likelier). A panicked holder leaves nothing to repair.
        static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
        let _turn = ONE_AT_A_TIME.locked();
        let started = std::time::Instant::now();
        let run = |cpus: u32| {
            let work = WorkDir::new()?;
            let mut launch = self.launch(&work, script, Vec::new())?;
            launch.cpus = cpus;
            qemu::run(&launch, timeout.saturating_sub(started.elapsed()))
        };
        match run(self.cpus) {
            // Seen on 2 shared cores: L1 under multi-threaded TCG froze with
            // both vCPUs spinning (twice in a row in one CI run, both times
            // while three L2 clones ran), or its kernel lost CPU 0's timer
            // and printed RCU stalls for ten minutes; a 1-vCPU L1 ran the
            // same scripts through. A wedged L1 says nothing about the code
            // under test: boot a fresh one once, with one vCPU, and say so.
            Err(e @ (NestedError::Stalled { .. } | NestedError::Wedged { .. })) => {
                eprintln!(
                    "torpor-nested: {e}\ntorpor-nested: booting a fresh L1 once more, with 1 vCPU"
                );
                run(1)
            }
            other => other,
        }
    }

    /// The images for one boot in `work` and how QEMU starts with them.
    fn launch(
        &self,
        work: &WorkDir,
        script: &str,
        forwards: Vec<(u16, u16)>,
    ) -> Result<qemu::Launch, NestedError> {
        let payload = !self.carried.is_empty();
        let net = !forwards.is_empty();
        if net
            && !self
                .assets
                .modules
                .iter()
                .any(|m| m.ends_with("virtio_net.ko"))
        {
            return Err(NestedError::L1Missing {
                what: "virtio_net.ko (the network of a long-running L1)".into(),
                path: self.assets.dir.join("modules"),
            });
        }
        let initrd = work.path().join("initrd.cpio");
        let cpio = image::initramfs(&self.assets, script, &self.carried, payload, net)?;
        fs::write(&initrd, cpio).map_err(|e| io_err(&initrd, e))?;
        let disk = if payload {
            Some(image::payload_disk(
                work.path(),
                &self.carried,
                self.spare_mib << 20,
            )?)
        } else {
            None
        };
        let mut cmdline =
            "console=ttyS0 panic=-1 quiet mitigations=off rdinit=/init tsc=unstable".to_string();
        if !self.extra_cmdline.is_empty() {
            cmdline.push(' ');
            cmdline.push_str(&self.extra_cmdline);
        }
        Ok(qemu::Launch {
            qemu: self.qemu.clone(),
            kernel: self.assets.kernel.clone(),
            initrd,
            disk,
            memory_mib: self.memory_mib,
            cpus: self.cpus,
            cmdline,
            echo: self.echo,
            guest_commands: if net {
                self.guest_commands.clone()
            } else {
                Vec::new()
            },
            forwards,
        })
    }
}

/// A scratch directory for one run's images, removed afterwards (kept when
/// `TORPOR_NESTED_KEEP=1`, for debugging), or a detached host's, kept.
#[derive(Debug)]
pub(crate) struct WorkDir {
    path: PathBuf,
    keep: bool,
}

impl WorkDir {
    pub(crate) fn new() -> Result<Self, NestedError> {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let dir = std::env::temp_dir().join(format!(
            "torpor-nested-{}-{}-{nanos}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        fs::create_dir_all(&dir).map_err(|e| io_err(&dir, e))?;
        Ok(Self {
            path: dir,
            keep: false,
        })
    }

    /// `dir` (made if missing), never removed here.
    pub(crate) fn kept(dir: &Path) -> Result<Self, NestedError> {
        fs::create_dir_all(dir).map_err(|e| io_err(dir, e))?;
        Ok(Self {
            path: dir.to_path_buf(),
            keep: true,
        })
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        if self.keep {
            return;
        }
        if std::env::var_os("TORPOR_NESTED_KEEP").is_some_and(|v| v == "1") {
            eprintln!("torpor-nested: kept {}", self.path.display());
        } else {
            let _ = fs::remove_dir_all(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wedged_kernels_are_told_from_scripts_quoting_one() {
        for line in [
            "[  534.910408] rcu: INFO: rcu_preempt detected stalls on CPUs/tasks:",
            "[  534.912677] rcu: rcu_preempt kthread timer wakeup didn't happen for 131291 jiffies!",
            "[   88.1] watchdog: BUG: soft lockup - CPU#1 stuck for 22s! [kworker/1:1:40]",
            "[  254.453022] BUG: TASK stack guard page was hit at 00000000b039a3e6",
            "[  254.778558] Kernel panic - not syncing: corrupted stack end detected inside scheduler",
        ] {
            assert!(l1_wedged(line), "{line}");
        }
        for line in [
            "[  484.690803] INFO: task khugepaged:36 blocked for more than 362 seconds.",
            "serve-log [  12.0] rcu: INFO: rcu_preempt detected stalls on CPUs/tasks:",
            "template-ready",
        ] {
            assert!(!l1_wedged(line), "{line}");
        }
    }

    #[test]
    fn missing_files_are_named_before_booting() {
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path().to_path_buf();
        fs::create_dir_all(dir.join("modules")).unwrap();
        for f in ["vmlinuz", "busybox", "modules/kvm.ko", "modules/kvm-amd.ko"] {
            fs::write(dir.join(f), b"x").unwrap();
        }
        fs::write(dir.join("modules/load-order"), "kvm.ko\nkvm-amd.ko\n").unwrap();
        let err = NestedHost::builder()
            .l1_dir(&dir)
            .qemu("/bin/sh")
            .file("/nonexistent/torpor", "/opt/torpor")
            .build()
            .unwrap_err();
        assert!(err.to_string().contains("/nonexistent/torpor"), "{err}");
    }

    #[test]
    fn a_missing_qemu_is_named() {
        let err = NestedHost::builder()
            .qemu("/nonexistent/qemu")
            .build()
            .unwrap_err();
        assert!(err.to_string().contains("qemu-system-x86"), "{err}");
    }
}
