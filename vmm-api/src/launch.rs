//! The [`LaunchSpec`]: everything a VMM process starts from, handed to it
//! as one JSON document on its stdin (never as argv strings), and the one
//! [`LaunchReply`] line it writes on stdout when it serves or cannot.

use std::io::{BufRead, Read};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{ErrorKind, VmError};
use crate::jail::JailSpec;

/// Largest launch spec a VMM reads.
pub const MAX_SPEC_BYTES: u64 = 64 * 1024;
/// Largest launch reply a pod reads.
pub const MAX_REPLY_BYTES: u64 = 16 * 1024;
/// Console bytes a VM may write to its file before the rest is dropped
/// (a guest must not fill the host's disk through its serial port).
pub const DEFAULT_CONSOLE_LIMIT: u64 = 16 << 20;
/// Longest kernel command line.
pub const MAX_CMDLINE: usize = 4096;
/// Exit status of a jailed VMM its cgroup's OOM killer ended (the memory
/// limit of its jail was reached).
pub const EXIT_OOM: i32 = 4;
/// Longest working-set recording window.
pub const MAX_RECORD_WORKING_SET_MS: u64 = 60_000;

/// One VMM process's whole configuration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LaunchSpec {
    /// The control socket the VMM binds (a live one there is an error).
    /// Only people run a VM without one; a standby shell needs one.
    #[serde(default)]
    pub control_socket: Option<PathBuf>,
    pub mode: LaunchMode,
    /// Where the guest console goes.
    #[serde(default)]
    pub console: Console,
    /// Where diff snapshots take their dirty pages from.
    #[serde(default)]
    pub dirty_tracking: DirtyTracking,
    /// The jail the VMM confines itself to before any guest code runs
    /// (None: no jail, for people who pass `--no-jail`). Every path above
    /// must resolve inside it: see [`crate::jail`].
    #[serde(default)]
    pub jail: Option<JailSpec>,
    /// The per-thread seccomp filters (docs/security.md): enforced unless
    /// a person debugging asks otherwise.
    #[serde(default)]
    pub seccomp: SeccompLevel,
}

/// What the VMM's per-thread seccomp filters do with a system call outside
/// a thread's allow-list.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SeccompLevel {
    /// Kill the whole VMM process (SIGSYS), after naming the call and the
    /// thread on stderr. What the service runs.
    #[default]
    Enforce,
    /// Allow the call and have the kernel log it (audit type 1326, in
    /// `dmesg`): for finding what a filter misses. Not a protection.
    Log,
    /// No filters at all: debugging only.
    Off,
}

impl SeccompLevel {
    pub const ALL: [SeccompLevel; 3] = [Self::Enforce, Self::Log, Self::Off];

    pub fn name(self) -> &'static str {
        match self {
            SeccompLevel::Enforce => "enforce",
            SeccompLevel::Log => "log",
            SeccompLevel::Off => "off",
        }
    }
}

impl FromStr for SeccompLevel {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|l| l.name() == s)
            .ok_or_else(|| format!("unknown seccomp level `{s}` (enforce, log, off)"))
    }
}

/// Boot a kernel, restore a snapshot, or wait as a standby shell.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum LaunchMode {
    Boot {
        kernel: KernelSource,
        #[serde(default)]
        initrd: Option<PathBuf>,
        /// None: the VMM's default Linux command line.
        #[serde(default)]
        cmdline: Option<String>,
        mem_mib: u64,
        vcpus: u16,
        #[serde(default)]
        disk: Option<DiskSpec>,
        /// Host side of virtio-vsock (Firecracker's hybrid unix socket).
        #[serde(default)]
        vsock_uds: Option<PathBuf>,
        /// virtio-net on a tap device (boxed: keeps the modes' sizes close).
        #[serde(default)]
        net: Option<Box<NetSpec>>,
        /// virtio-balloon: free page reporting, guest memory statistics and
        /// a target the control socket sets (`set_balloon`). Off unless
        /// asked for: the pod asks for it for every Linux guest; the probe
        /// guest has no driver for it.
        #[serde(default)]
        balloon: bool,
    },
    Restore {
        restore: RestoreSpec,
        /// Restore and stay paused.
        #[serde(default)]
        paused: bool,
        /// Record the pages first touched in this window after the restore
        /// as the snapshot's working set (uffd backends).
        #[serde(default)]
        record_working_set_ms: Option<u64>,
    },
    /// A pre-created VM shell for `mem_mib`/`vcpus` that restores on a
    /// control `restore` request.
    Standby { mem_mib: u64, vcpus: u16 },
}

/// What a restore maps and attaches.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RestoreSpec {
    /// The snapshot directory (the top layer of its chain).
    pub snapshot: PathBuf,
    #[serde(default)]
    pub backend: MemoryBackend,
    /// Install the snapshot's recorded working set eagerly (uffd backends).
    #[serde(default)]
    pub prefetch: bool,
    /// The clone's own disk overlay (snapshots with a disk).
    #[serde(default)]
    pub disk_overlay: Option<PathBuf>,
    /// The clone's own vsock host socket (snapshots with vsock).
    #[serde(default)]
    pub vsock_uds: Option<PathBuf>,
    /// The clone's tap and rate limits (snapshots with virtio-net); `None`
    /// reopens the saved tap name with the saved limits. The MAC is the
    /// snapshot's: a `mac` here must equal it. (Boxed: it keeps the
    /// control protocol's restore request small.)
    #[serde(default)]
    pub net: Option<Box<NetSpec>>,
    /// The snapshot's memory file is still arriving (a cold wake from the
    /// object store): the map file ([`crate::lazy`]) its page server waits
    /// on before it reads a chunk. `uffd` backend only.
    #[serde(default)]
    pub lazy_map: Option<PathBuf>,
}

/// A kernel to boot: a file, or one built into the VMM binary.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KernelSource {
    Path(PathBuf),
    Builtin(String),
}

impl KernelSource {
    /// `builtin:NAME` or a path, as people write it.
    pub fn parse(spec: &str) -> Self {
        match spec.strip_prefix("builtin:") {
            Some(name) => KernelSource::Builtin(name.to_string()),
            None => KernelSource::Path(PathBuf::from(spec)),
        }
    }
}

/// A virtio-blk disk: the image is never written; `overlay` is this VM's
/// copy-on-write layer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskSpec {
    pub image: PathBuf,
    pub overlay: PathBuf,
    #[serde(default)]
    pub read_only: bool,
    /// Reuse `overlay` as it is instead of starting it empty: a sandbox
    /// rebooted from the disk it kept. The chunks it holds are those its
    /// file has data for (its overlay is sparse: only written chunks are
    /// allocated); a filesystem that does not report holes is refused.
    #[serde(default)]
    pub keep_overlay: bool,
}

/// Longest network interface name (IFNAMSIZ - 1).
pub const MAX_IFNAME: usize = 15;

/// virtio-net backed by a tap device, opened by name in the VMM's network
/// namespace (`IFF_TAP | IFF_NO_PI | IFF_VNET_HDR`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetSpec {
    /// The tap's name (created if missing, which needs CAP_NET_ADMIN).
    pub tap: String,
    /// The guest's MAC; default [`MacAddr::DEFAULT_GUEST`].
    #[serde(default)]
    pub mac: Option<MacAddr>,
    /// Host → guest (what the guest receives).
    #[serde(default)]
    pub rx: RateLimit,
    /// Guest → host (what the guest sends).
    #[serde(default)]
    pub tx: RateLimit,
    /// The network namespace to open the tap in (a namespace file such as
    /// `/run/netns/torpor-sbx-3`); default: the VMM's own. Only the tap
    /// comes from there: the VMM process stays where it is.
    #[serde(default)]
    pub netns: Option<PathBuf>,
}

impl NetSpec {
    pub fn new(tap: impl Into<String>) -> Self {
        Self {
            tap: tap.into(),
            mac: None,
            rx: RateLimit::default(),
            tx: RateLimit::default(),
            netns: None,
        }
    }

    pub fn check(&self) -> Result<(), VmError> {
        check_ifname(&self.tap)?;
        if let Some(p) = &self.netns {
            absolute("network namespace", p)?;
        }
        if let Some(mac) = &self.mac {
            mac.check()?;
        }
        self.rx.check("rx")?;
        self.tx.check("tx")
    }

    /// `tap=NAME[,mac=MAC][,netns=PATH]`, as `torpor vmm --net` takes it.
    pub fn parse(text: &str) -> Result<Self, VmError> {
        let mut tap = None;
        let mut mac = None;
        let mut netns = None;
        for part in text.split(',') {
            match part.split_once('=') {
                Some(("tap", v)) => tap = Some(v.to_string()),
                Some(("mac", v)) => mac = Some(v.parse::<MacAddr>()?),
                Some(("netns", v)) => netns = Some(PathBuf::from(v)),
                _ => {
                    return Err(invalid(format!(
                        "unknown --net part `{part}` (tap=NAME[,mac=MAC][,netns=PATH])"
                    )))
                }
            }
        }
        let spec = NetSpec {
            mac,
            netns,
            ..NetSpec::new(tap.ok_or_else(|| invalid("--net needs tap=NAME"))?)
        };
        spec.check()?;
        Ok(spec)
    }
}

fn check_ifname(name: &str) -> Result<(), VmError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_IFNAME
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|b| b.is_ascii_graphic() && b != b'/' && b != b':');
    if ok {
        Ok(())
    } else {
        Err(invalid(format!(
            "`{name}` is not an interface name (1 to {MAX_IFNAME} printable characters, no `/` or `:`)"
        )))
    }
}

/// An Ethernet address, written `52:54:00:12:34:56`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct MacAddr(pub [u8; 6]);

impl MacAddr {
    /// What a guest gets when nobody says: locally administered, unicast.
    /// Every clone of a snapshot keeps its template's.
    pub const DEFAULT_GUEST: MacAddr = MacAddr([0x06, 0x00, 0xac, 0x10, 0x00, 0x02]);

    /// Unicast (a multicast source address is not an address).
    pub fn check(&self) -> Result<(), VmError> {
        if self.0[0] & 1 != 0 {
            return Err(invalid(format!("{self} is a multicast address")));
        }
        Ok(())
    }
}

impl FromStr for MacAddr {
    type Err = VmError;
    fn from_str(s: &str) -> Result<Self, VmError> {
        let bad = || {
            invalid(format!(
                "`{s}` is not a MAC address (like 06:00:ac:10:00:02)"
            ))
        };
        let mut out = [0u8; 6];
        let mut parts = s.split(':');
        for b in &mut out {
            let p = parts.next().filter(|p| p.len() == 2).ok_or_else(bad)?;
            *b = u8::from_str_radix(p, 16).map_err(|_| bad())?;
        }
        if parts.next().is_some() {
            return Err(bad());
        }
        Ok(MacAddr(out))
    }
}

impl std::fmt::Display for MacAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let [a, b, c, d, e, g] = self.0;
        write!(f, "{a:02x}:{b:02x}:{c:02x}:{d:02x}:{e:02x}:{g:02x}")
    }
}

impl TryFrom<String> for MacAddr {
    type Error = VmError;
    fn try_from(s: String) -> Result<Self, VmError> {
        s.parse()
    }
}

impl From<MacAddr> for String {
    fn from(m: MacAddr) -> String {
        m.to_string()
    }
}

/// Limits of one direction: bytes and packets a second, each optional.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimit {
    #[serde(default)]
    pub bytes: Option<TokenRate>,
    #[serde(default)]
    pub packets: Option<TokenRate>,
}

/// A token bucket: `per_sec` tokens a second, at most `burst` saved up
/// (default: one second's worth).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenRate {
    pub per_sec: u64,
    #[serde(default)]
    pub burst: Option<u64>,
}

impl RateLimit {
    pub fn check(&self, direction: &str) -> Result<(), VmError> {
        for (what, rate) in [("bytes", &self.bytes), ("packets", &self.packets)] {
            if let Some(r) = rate {
                if r.per_sec == 0 || r.burst == Some(0) {
                    return Err(invalid(format!(
                        "the {direction} {what} rate and burst must be above 0 (leave it out for no limit)"
                    )));
                }
            }
        }
        Ok(())
    }
}

/// Where the guest console goes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "to", rename_all = "snake_case", deny_unknown_fields)]
pub enum Console {
    Stdout,
    #[default]
    Discard,
    /// A file (truncated at start) that takes at most `max_bytes`; what the
    /// guest writes past that is dropped and counted.
    File {
        path: PathBuf,
        #[serde(default = "default_console_limit")]
        max_bytes: u64,
    },
}

fn default_console_limit() -> u64 {
    DEFAULT_CONSOLE_LIMIT
}

impl Console {
    /// A console file with the default limit.
    pub fn file(path: impl Into<PathBuf>) -> Self {
        Console::File {
            path: path.into(),
            max_bytes: DEFAULT_CONSOLE_LIMIT,
        }
    }
}

/// How restored guest memory is backed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MemoryBackend {
    /// MAP_PRIVATE of the memory files: page-cache sharing, kernel CoW.
    #[default]
    File,
    /// Anonymous memory filled on demand by a userfaultfd page server.
    Uffd,
    /// Template in shmem mapped privately, MINOR faults answered with
    /// UFFDIO_CONTINUE: shared like `File`, observed like `Uffd`.
    UffdShared,
}

impl MemoryBackend {
    pub const ALL: [MemoryBackend; 3] = [Self::File, Self::Uffd, Self::UffdShared];

    pub fn name(self) -> &'static str {
        match self {
            MemoryBackend::File => "file",
            MemoryBackend::Uffd => "uffd",
            MemoryBackend::UffdShared => "uffd-shared",
        }
    }
}

impl FromStr for MemoryBackend {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|b| b.name() == s)
            .ok_or_else(|| format!("unknown memory backend `{s}` (file, uffd, uffd-shared)"))
    }
}

impl std::fmt::Display for MemoryBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Which source a VM's diff snapshots take their dirty pages from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DirtyTracking {
    /// KVM's dirty log.
    #[default]
    Kvm,
    /// userfaultfd asynchronous write-protection, read with PAGEMAP_SCAN.
    UffdWp,
    /// uffd-wp writes the diff; KVM's dirty log is kept too and compared.
    Both,
}

impl DirtyTracking {
    pub fn name(self) -> &'static str {
        match self {
            DirtyTracking::Kvm => "kvm",
            DirtyTracking::UffdWp => "uffd-wp",
            DirtyTracking::Both => "both",
        }
    }

    pub fn parse(name: &str) -> Option<Self> {
        [Self::Kvm, Self::UffdWp, Self::Both]
            .into_iter()
            .find(|t| t.name() == name)
    }

    /// Whether KVM memory slots need `KVM_MEM_LOG_DIRTY_PAGES`.
    pub fn kvm_log(self) -> bool {
        matches!(self, DirtyTracking::Kvm | DirtyTracking::Both)
    }

    /// Whether guest RAM is write-protected through userfaultfd.
    pub fn uffd_wp(self) -> bool {
        matches!(self, DirtyTracking::UffdWp | DirtyTracking::Both)
    }
}

impl LaunchSpec {
    /// Reads a spec of at most [`MAX_SPEC_BYTES`] and checks it.
    pub fn read_from(input: impl Read) -> Result<Self, VmError> {
        let mut text = Vec::new();
        input
            .take(MAX_SPEC_BYTES + 1)
            .read_to_end(&mut text)
            .map_err(|e| {
                VmError::new(ErrorKind::Io, format!("cannot read the launch spec: {e}"))
            })?;
        if text.len() as u64 > MAX_SPEC_BYTES {
            return Err(invalid(format!(
                "the launch spec is longer than {MAX_SPEC_BYTES} bytes"
            )));
        }
        let spec: LaunchSpec = serde_json::from_slice(&text)
            .map_err(|e| invalid(format!("malformed launch spec: {e}")))?;
        spec.check()?;
        Ok(spec)
    }

    /// Bounds a VMM checks before it touches KVM (it checks memory against
    /// the host and vCPUs against KVM itself).
    pub fn check(&self) -> Result<(), VmError> {
        match &self.control_socket {
            Some(p) => absolute("control_socket", p)?,
            None if matches!(self.mode, LaunchMode::Standby { .. }) => {
                return Err(invalid("a standby VMM needs a control socket"))
            }
            None => {}
        }
        if let Console::File { path, .. } = &self.console {
            absolute("console file", path)?;
        }
        match &self.mode {
            LaunchMode::Boot {
                kernel,
                initrd,
                cmdline,
                vcpus,
                disk,
                vsock_uds,
                net,
                ..
            } => {
                if let KernelSource::Path(p) = kernel {
                    absolute("kernel", p)?;
                }
                if let Some(p) = initrd {
                    absolute("initrd", p)?;
                }
                if cmdline.as_ref().is_some_and(|c| c.len() > MAX_CMDLINE) {
                    return Err(invalid(format!(
                        "the command line is longer than {MAX_CMDLINE} bytes"
                    )));
                }
                if *vcpus == 0 {
                    return Err(invalid("a VM needs at least one vCPU"));
                }
                if let Some(d) = disk {
                    absolute("disk image", &d.image)?;
                    absolute("disk overlay", &d.overlay)?;
                }
                if let Some(p) = vsock_uds {
                    absolute("vsock socket", p)?;
                }
                if let Some(n) = net {
                    n.check()?;
                }
            }
            LaunchMode::Restore {
                restore,
                record_working_set_ms,
                ..
            } => {
                restore.check()?;
                if record_working_set_ms.is_some_and(|ms| ms > MAX_RECORD_WORKING_SET_MS) {
                    return Err(invalid(format!(
                        "record_working_set_ms is above {MAX_RECORD_WORKING_SET_MS}"
                    )));
                }
            }
            LaunchMode::Standby { vcpus, .. } => {
                if *vcpus == 0 {
                    return Err(invalid("a VM needs at least one vCPU"));
                }
            }
        }
        if let Some(jail) = &self.jail {
            jail.check()?;
            self.check_jailed(jail)?;
        }
        Ok(())
    }

    /// Every path the VMM opens resolves in its jail (writable where it
    /// writes). A standby shell is handed its paths later, in the restore
    /// request, once the pod exposed them.
    fn check_jailed(&self, jail: &JailSpec) -> Result<(), VmError> {
        if let Some(p) = &self.control_socket {
            jail.check_path("control socket", p, true)?;
        }
        if let Console::File { path, .. } = &self.console {
            jail.check_path("console file", path, true)?;
        }
        match &self.mode {
            LaunchMode::Boot {
                kernel,
                initrd,
                disk,
                vsock_uds,
                ..
            } => {
                if let KernelSource::Path(p) = kernel {
                    jail.check_path("kernel", p, false)?;
                }
                if let Some(p) = initrd {
                    jail.check_path("initrd", p, false)?;
                }
                if let Some(d) = disk {
                    jail.check_path("disk image", &d.image, false)?;
                    jail.check_path("disk overlay", &d.overlay, true)?;
                }
                if let Some(p) = vsock_uds {
                    jail.check_path("vsock socket", p, true)?;
                }
            }
            LaunchMode::Restore { restore, .. } => {
                jail.check_path("snapshot", &restore.snapshot, false)?;
                if let Some(p) = &restore.disk_overlay {
                    jail.check_path("disk overlay", p, true)?;
                }
                if let Some(p) = &restore.vsock_uds {
                    jail.check_path("vsock socket", p, true)?;
                }
            }
            LaunchMode::Standby { .. } => {}
        }
        Ok(())
    }
}

impl RestoreSpec {
    pub fn new(snapshot: impl Into<PathBuf>, backend: MemoryBackend) -> Self {
        Self {
            snapshot: snapshot.into(),
            backend,
            prefetch: false,
            disk_overlay: None,
            vsock_uds: None,
            net: None,
            lazy_map: None,
        }
    }

    pub fn check(&self) -> Result<(), VmError> {
        absolute("snapshot", &self.snapshot)?;
        if let Some(p) = &self.disk_overlay {
            absolute("disk overlay", p)?;
        }
        if let Some(p) = &self.vsock_uds {
            absolute("vsock socket", p)?;
        }
        if let Some(p) = &self.lazy_map {
            absolute("lazy map", p)?;
            if self.backend != MemoryBackend::Uffd {
                return Err(VmError::new(
                    ErrorKind::InvalidRequest,
                    "a lazily fetched memory file needs the uffd backend",
                ));
            }
        }
        if let Some(n) = &self.net {
            n.check()?;
        }
        Ok(())
    }
}

fn invalid(message: impl Into<String>) -> VmError {
    VmError::new(ErrorKind::InvalidRequest, message)
}

/// Paths in a spec are absolute: the VMM may run in another directory (or,
/// jailed, another root) than whoever wrote the spec.
fn absolute(what: &str, path: &Path) -> Result<(), VmError> {
    if path.is_absolute() {
        Ok(())
    } else {
        Err(invalid(format!(
            "the {what} path must be absolute: {}",
            path.display()
        )))
    }
}

/// The one line a VMM writes on stdout: it serves its control socket, or
/// it could not start and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LaunchReply {
    Ready {
        pid: u32,
        /// Microseconds from the process's start to serving.
        start_us: u64,
    },
    Failed(VmError),
}

impl LaunchReply {
    /// The reply as one line.
    pub fn to_line(&self) -> String {
        let mut line = serde_json::to_string(self).unwrap_or_else(|_| "{}".into());
        line.push('\n');
        line
    }

    /// Reads one reply line (bounded); EOF without one is `None`.
    pub fn read_from(input: impl Read) -> Result<Option<Self>, VmError> {
        let mut line = String::new();
        let n = std::io::BufReader::new(input.take(MAX_REPLY_BYTES))
            .read_line(&mut line)
            .map_err(|e| VmError::new(ErrorKind::Io, format!("reading the VMM's reply: {e}")))?;
        if n == 0 {
            return Ok(None);
        }
        serde_json::from_str(&line)
            .map(Some)
            .map_err(|e| VmError::internal(format!("malformed reply from the VMM: {e}")))
    }
}

/// Where a guest's vsock connection to host port `port` goes: the unix
/// socket `<uds_path>_<port>` beside the VMM's hybrid vsock socket
/// `uds_path` (Firecracker's convention), which something on the host
/// listens on.
pub fn guest_target(uds_path: &std::path::Path, port: u32) -> PathBuf {
    let mut name = uds_path.as_os_str().to_owned();
    name.push(format!("_{port}"));
    PathBuf::from(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn restore_spec() -> LaunchSpec {
        LaunchSpec {
            control_socket: Some("/run/s/ctl.sock".into()),
            mode: LaunchMode::Restore {
                restore: RestoreSpec::new("/d/snap", MemoryBackend::UffdShared),
                paused: false,
                record_working_set_ms: Some(200),
            },
            console: Console::file("/run/s/console.log"),
            dirty_tracking: DirtyTracking::Kvm,
            jail: None,
            seccomp: SeccompLevel::Enforce,
        }
    }

    #[test]
    fn a_spec_round_trips_and_is_checked() {
        let spec = restore_spec();
        let json = serde_json::to_string(&spec).unwrap();
        assert!(json.contains(r#""backend":"uffd-shared""#), "{json}");
        assert!(json.contains(r#""kind":"restore""#), "{json}");
        assert_eq!(LaunchSpec::read_from(json.as_bytes()).unwrap(), spec);
    }

    #[test]
    fn bad_specs_are_invalid_requests() {
        let mut relative = restore_spec();
        relative.control_socket = Some("ctl.sock".into());
        let json = serde_json::to_string(&relative).unwrap();
        let e = LaunchSpec::read_from(json.as_bytes()).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidRequest);
        assert!(e.message.contains("absolute"), "{e}");

        let unknown =
            r#"{"control_socket":"/c","mode":{"kind":"standby","mem_mib":1,"vcpus":1},"prison":1}"#;
        let e = LaunchSpec::read_from(unknown.as_bytes()).unwrap_err();
        assert!(e.message.contains("prison"), "{e}");

        let huge = vec![b' '; MAX_SPEC_BYTES as usize + 2];
        let e = LaunchSpec::read_from(&huge[..]).unwrap_err();
        assert!(e.message.contains("longer"), "{e}");

        let zero = r#"{"control_socket":"/c","mode":{"kind":"standby","mem_mib":1,"vcpus":0}}"#;
        assert!(LaunchSpec::read_from(zero.as_bytes()).is_err());
        let blind = r#"{"mode":{"kind":"standby","mem_mib":1,"vcpus":1}}"#;
        assert!(LaunchSpec::read_from(blind.as_bytes()).is_err());

        let mut long = restore_spec();
        long.mode = LaunchMode::Restore {
            restore: RestoreSpec::new("/s", MemoryBackend::File),
            paused: false,
            record_working_set_ms: Some(u64::MAX),
        };
        let json = serde_json::to_string(&long).unwrap();
        assert!(LaunchSpec::read_from(json.as_bytes()).is_err());
    }

    #[test]
    fn jailed_specs_name_only_exposed_paths() {
        let mut spec = restore_spec();
        let mut jail = crate::jail::tests::jail();
        jail.exposes = vec![
            crate::jail::Expose::read_write("/run/s"),
            crate::jail::Expose::read_only("/d/snap"),
        ];
        spec.jail = Some(jail.clone());
        let json = serde_json::to_string(&spec).unwrap();
        assert_eq!(LaunchSpec::read_from(json.as_bytes()).unwrap(), spec);

        jail.exposes.pop();
        spec.jail = Some(jail.clone());
        let e = spec.check().unwrap_err();
        assert!(e.message.contains("snapshot"), "{e}");

        jail.exposes = vec![crate::jail::Expose::read_only("/run/s")];
        jail.exposes.push(crate::jail::Expose::read_only("/d/snap"));
        spec.jail = Some(jail);
        let e = spec.check().unwrap_err();
        assert!(e.message.contains("read-only"), "{e}");
    }

    #[test]
    fn replies_are_one_bounded_line() {
        let ready = LaunchReply::Ready {
            pid: 7,
            start_us: 900,
        };
        let line = ready.to_line();
        assert!(line.ends_with('\n') && line.matches('\n').count() == 1);
        assert_eq!(
            LaunchReply::read_from(line.as_bytes()).unwrap(),
            Some(ready)
        );
        assert_eq!(LaunchReply::read_from(&b""[..]).unwrap(), None);
        let failed = LaunchReply::Failed(VmError::new(ErrorKind::NoSpace, "full"));
        assert_eq!(
            LaunchReply::read_from(failed.to_line().as_bytes()).unwrap(),
            Some(failed)
        );
        let endless = vec![b'x'; MAX_REPLY_BYTES as usize * 2];
        assert!(LaunchReply::read_from(&endless[..]).is_err());
    }

    #[test]
    fn net_specs_parse_and_are_checked() {
        let spec = NetSpec::parse("tap=tap0,mac=06:00:AC:10:00:07,netns=/run/netns/x").unwrap();
        assert_eq!(spec.tap, "tap0");
        assert_eq!(spec.netns.as_deref(), Some(Path::new("/run/netns/x")));
        assert_eq!(spec.mac, Some(MacAddr([6, 0, 0xac, 0x10, 0, 7])));
        let json = serde_json::to_string(&spec).unwrap();
        assert!(json.contains(r#""mac":"06:00:ac:10:00:07""#), "{json}");
        assert_eq!(serde_json::from_str::<NetSpec>(&json).unwrap(), spec);
        for bad in [
            "mac=06:00:ac:10:00:07",
            "tap=",
            "tap=a/b",
            "tap=sixteen-chars-xx",
            "tap=t,mac=01:00:00:00:00:00",
            "tap=t,mac=06:00:ac:10:00",
            "tap=t,mac=06:00:ac:10:00:07:08",
            "tap=t,mac=g6:00:ac:10:00:07",
            "tap=t,speed=10",
            "tap=t,netns=relative/ns",
        ] {
            assert!(NetSpec::parse(bad).is_err(), "{bad}");
        }
        let zero = r#"{"tap":"t","rx":{"bytes":{"per_sec":0}}}"#;
        let spec: NetSpec = serde_json::from_str(zero).unwrap();
        assert_eq!(spec.check().unwrap_err().kind, ErrorKind::InvalidRequest);
        let unknown = r#"{"tap":"t","tx":{"bits":{"per_sec":1}}}"#;
        assert!(serde_json::from_str::<NetSpec>(unknown).is_err());
        // Checked inside a whole launch spec too.
        let boot = r#"{"mode":{"kind":"boot","kernel":{"builtin":"probe"},"mem_mib":64,"vcpus":1,
            "net":{"tap":"way-too-long-a-name"}}}"#;
        assert!(LaunchSpec::read_from(boot.as_bytes()).is_err());
        let boot = boot.replace("way-too-long-a-name", "tap0");
        let spec = LaunchSpec::read_from(boot.as_bytes()).unwrap();
        assert!(matches!(spec.mode, LaunchMode::Boot { net: Some(_), .. }));
    }

    #[test]
    fn names_parse() {
        assert_eq!("uffd".parse::<MemoryBackend>(), Ok(MemoryBackend::Uffd));
        assert!("mmap".parse::<MemoryBackend>().is_err());
        assert_eq!(
            KernelSource::parse("builtin:probe"),
            KernelSource::Builtin("probe".into())
        );
        assert_eq!(DirtyTracking::parse("uffd-wp"), Some(DirtyTracking::UffdWp));
        assert_eq!("off".parse::<SeccompLevel>(), Ok(SeccompLevel::Off));
        assert!("none".parse::<SeccompLevel>().is_err());
    }

    #[test]
    fn seccomp_is_enforced_unless_a_spec_says_otherwise() {
        let plain = r#"{"control_socket":"/c","mode":{"kind":"standby","mem_mib":1,"vcpus":1}}"#;
        let spec = LaunchSpec::read_from(plain.as_bytes()).unwrap();
        assert_eq!(spec.seccomp, SeccompLevel::Enforce);
        let off = r#"{"control_socket":"/c","mode":{"kind":"standby","mem_mib":1,"vcpus":1},"seccomp":"off"}"#;
        assert_eq!(
            LaunchSpec::read_from(off.as_bytes()).unwrap().seccomp,
            SeccompLevel::Off
        );
        let bogus = r#"{"control_socket":"/c","mode":{"kind":"standby","mem_mib":1,"vcpus":1},"seccomp":"lax"}"#;
        assert!(LaunchSpec::read_from(bogus.as_bytes()).is_err());
    }
}
