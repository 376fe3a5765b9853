//! `torpor doctor`: what this host can run, and why.
//!
//! Probes `/dev/kvm` and the capabilities the VMM relies on, the kind of
//! virtualization behind it (VMX/SVM hardware or the PVM software module),
//! userfaultfd, huge pages, cgroups and the host's size, and folds that into
//! one verdict. No probe panics: a missing file or a denied access is recorded
//! in the report as absent, with the error text.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::fmt;
use std::fs;
use std::io::Error as IoError;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;

use kvm_bindings::{KVM_CAP_DIRTY_LOG_RING, KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2};
use kvm_ioctls::{Cap, Kvm};
use libc::{c_long, c_ulong};
use serde::Serialize;
use torpor_vmm_api::host::kib_field;

/// Why a probe failed; the report keeps the rendered text.
#[derive(Debug, thiserror::Error)]
pub enum DoctorError {
    /// A file could not be read or opened.
    #[error("{0}: {1}")]
    Open(String, #[source] IoError),
    /// A syscall or ioctl failed.
    #[error("{0}: {1}")]
    Os(&'static str, #[source] IoError),
}

/// A probe's answer, or the text of the error that kept it from one (in JSON,
/// `{"Ok": value}` or `{"Err": "text"}`).
pub type Probe<T> = Result<T, String>;

/// The KVM API version every supported kernel reports (KVM_GET_API_VERSION).
const KVM_API_VERSION: i32 = 12;

/// Capabilities asked with KVM_CHECK_EXTENSION: (name, number, required).
#[rustfmt::skip]
const KVM_CAPS: [(&str, c_ulong, bool); 15] = [
    ("Irqchip", Cap::Irqchip as _, true),         ("UserMemory", Cap::UserMemory as _, true),
    ("SetTssAddr", Cap::SetTssAddr as _, true),   ("Pit2", Cap::Pit2 as _, true),
    ("PitState2", Cap::PitState2 as _, true),     ("ImmediateExit", Cap::ImmediateExit as _, true),
    ("AdjustClock", Cap::AdjustClock as _, true), ("VcpuEvents", Cap::VcpuEvents as _, true),
    ("Xcrs", Cap::Xcrs as _, true),               ("Xsave", Cap::Xsave as _, true),
    ("ManualDirtyLogProtect2", KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2 as _, false),
    ("DirtyLogRing", KVM_CAP_DIRTY_LOG_RING as _, false),
    ("TscControl", Cap::TscControl as _, false),  ("GetTscKhz", Cap::GetTscKhz as _, false),
    ("SplitIrqchip", Cap::SplitIrqchip as _, false),
];

use crate::uffd_abi::{
    new_userfaultfd, offered_features, UFFD_FEATURE_EVENT_REMOVE, UFFD_FEATURE_MINOR_HUGETLBFS,
    UFFD_FEATURE_MINOR_SHMEM, UFFD_FEATURE_MISSING_SHMEM, UFFD_FEATURE_MOVE,
    UFFD_FEATURE_PAGEFAULT_FLAG_WP, UFFD_FEATURE_POISON, UFFD_FEATURE_WP_ASYNC,
    UFFD_FEATURE_WP_HUGETLBFS_SHMEM, UFFD_FEATURE_WP_UNPOPULATED, UFFD_USER_MODE_ONLY,
    USERFAULTFD_IOC_NEW,
};

/// The `UFFD_FEATURE_*` bits worth reporting. MISSING mode has no bit: every
/// userfaultfd that completes the UFFDIO_API handshake supports it.
#[rustfmt::skip]
const UFFD_FEATURES: [(&str, u64); 10] = [
    ("PAGEFAULT_FLAG_WP", UFFD_FEATURE_PAGEFAULT_FLAG_WP), ("EVENT_REMOVE", UFFD_FEATURE_EVENT_REMOVE),
    ("MISSING_SHMEM", UFFD_FEATURE_MISSING_SHMEM), ("MINOR_HUGETLBFS", UFFD_FEATURE_MINOR_HUGETLBFS),
    ("MINOR_SHMEM", UFFD_FEATURE_MINOR_SHMEM), ("WP_HUGETLBFS_SHMEM", UFFD_FEATURE_WP_HUGETLBFS_SHMEM),
    ("WP_UNPOPULATED", UFFD_FEATURE_WP_UNPOPULATED), ("POISON", UFFD_FEATURE_POISON),
    ("WP_ASYNC", UFFD_FEATURE_WP_ASYNC), ("MOVE", UFFD_FEATURE_MOVE),
];

use crate::fsmagic::{self, CGROUP2_SUPER_MAGIC, CGROUP_SUPER_MAGIC, TMPFS_MAGIC};

/// Which guests this host can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Hardware virtualization: Linux guests and probe guests.
    LinuxAndProbe,
    /// KVM works but is not known to be hardware-backed (PVM): probe guests only.
    ProbeOnly,
    /// KVM is unusable: no guests at all.
    None,
}

impl Verdict {
    /// 0 = Linux and probe guests, 10 = probe guests only, 1 = none.
    pub fn exit_code(self) -> i32 {
        match self {
            Verdict::LinuxAndProbe => 0,
            Verdict::ProbeOnly => 10,
            Verdict::None => 1,
        }
    }
}

/// One KVM capability and what KVM_CHECK_EXTENSION answered for it.
#[derive(Debug, Clone, Serialize)]
pub struct Capability {
    pub name: String,
    pub required: bool,
    pub present: bool,
    /// The raw answer: > 0 means present (some caps answer a size or a mask).
    pub value: i32,
}

#[derive(Debug, Clone, Serialize)]
pub struct KvmReport {
    pub exists: bool,
    /// Opening /dev/kvm read-write.
    pub open: Probe<()>,
    pub api_version: Probe<i32>,
    /// KVM_CREATE_VM (the VM is dropped at once).
    pub create_vm: Probe<()>,
    /// KVM_CAP_MAX_VCPUS.
    pub max_vcpus: Option<u32>,
    pub capabilities: Vec<Capability>,
}

impl KvmReport {
    /// Why KVM cannot be used, or `None` when it can.
    pub fn unusable_reason(&self) -> Option<String> {
        let missing: Vec<&str> = (self.capabilities.iter())
            .filter(|c| c.required && !c.present)
            .map(|c| c.name.as_str())
            .collect();
        match (&self.open, &self.api_version) {
            (Err(e), _) => Some(format!("/dev/kvm: {e}")),
            (Ok(()), Err(e)) => Some(e.clone()),
            (Ok(()), Ok(KVM_API_VERSION)) if missing.is_empty() => {
                (self.create_vm.as_ref().err()).map(|e| format!("KVM_CREATE_VM: {e}"))
            }
            (Ok(()), Ok(KVM_API_VERSION)) => Some(format!("missing {}", missing.join(", "))),
            (Ok(()), Ok(v)) => Some(format!("API version {v}, need {KVM_API_VERSION}")),
        }
    }
}

/// The kind of virtualization behind /dev/kvm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum VirtKind {
    /// VMX or SVM in cpuinfo, with kvm_intel or kvm_amd loaded.
    Hardware,
    /// The kvm_pvm software module is loaded.
    Pvm,
    /// Neither could be confirmed (emulated CPU, no module, unreadable cpuinfo).
    Unknown,
}

#[derive(Debug, Clone, Serialize)]
pub struct Virtualization {
    pub kind: VirtKind,
    /// "vmx" or "svm" when /proc/cpuinfo lists it.
    pub cpu_flag: Option<String>,
    /// cpuinfo lists `hypervisor`: this host is itself a guest.
    pub hypervisor_flag: bool,
    /// Loaded KVM vendor modules among kvm_intel, kvm_amd, kvm_pvm.
    pub modules: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct UffdReport {
    /// userfaultfd(2) without UFFD_USER_MODE_ONLY: the mode that also sees
    /// faults raised inside the kernel, such as KVM's accesses to guest memory.
    pub syscall: Probe<()>,
    pub syscall_user_mode_only: Probe<()>,
    /// /dev/userfaultfd opened and USERFAULTFD_IOC_NEW.
    pub dev_userfaultfd: Probe<()>,
    /// /proc/sys/vm/unprivileged_userfaultfd.
    pub unprivileged_sysctl: Probe<String>,
    /// Feature bitmask from the UFFDIO_API handshake, on the first descriptor
    /// made (syscall, then user-mode-only syscall, then /dev/userfaultfd).
    pub features: Probe<u64>,
    /// Named features (empty when the handshake failed).
    pub named_features: BTreeMap<&'static str, bool>,
}

#[derive(Debug, Clone, Serialize)]
pub struct HugePages {
    /// The selected mode of /sys/kernel/mm/transparent_hugepage/enabled.
    pub thp_enabled: Probe<String>,
    pub thp_shmem_enabled: Probe<String>,
    pub hugetlb_total: Option<u64>,
    pub hugetlb_free: Option<u64>,
    pub hugetlb_page_kib: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CgroupMode {
    /// /sys/fs/cgroup is cgroup2.
    V2,
    /// v1 controllers, with cgroup2 at /sys/fs/cgroup/unified.
    Hybrid,
    /// v1 controllers only.
    V1,
}

/// What the jail would use, and a trial jail set up in a child process.
#[derive(Debug, Clone, Serialize)]
pub struct JailReport {
    /// The cgroup version jails use here (`v1`, `v2`), or why none works.
    pub cgroup_version: Probe<String>,
    /// A jail like a VMM's (cgroup, namespaces, pivot_root, devices, uid,
    /// no capabilities) set up by a child of `torpor doctor`.
    pub trial: Probe<()>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Host {
    pub kernel: Probe<String>,
    pub cpus: Probe<usize>,
    pub cpu_model: Option<String>,
    pub mem_total_kib: Probe<u64>,
}

/// Everything `torpor doctor` found: serializes for `--json`, `Display`
/// prints the readable report.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub host: Host,
    pub kvm: KvmReport,
    pub virtualization: Virtualization,
    pub userfaultfd: UffdReport,
    pub huge_pages: HugePages,
    pub cgroup: Probe<CgroupMode>,
    /// Whether VMMs can be jailed here (see [`crate::jail`]).
    pub jail: JailReport,
    /// Worked out from `kvm` and `virtualization` when the report was built.
    pub verdict: Verdict,
    /// The verdict as one line of text.
    pub summary: String,
}

impl Report {
    pub fn verdict(&self) -> Verdict {
        self.verdict
    }

    /// The exit code of `torpor doctor`: 0 = Linux and probe guests can run,
    /// 10 = probe guests only, 1 = no guests (KVM unusable).
    pub fn exit_code(&self) -> i32 {
        self.verdict.exit_code()
    }
}

/// Probes this host.
pub fn run() -> Report {
    let cpuinfo = read("/proc/cpuinfo");
    let meminfo = read("/proc/meminfo");
    let modules: Vec<&str> = ["kvm_intel", "kvm_amd", "kvm_pvm"]
        .into_iter()
        .filter(|m| Path::new("/sys/module").join(m).exists())
        .collect();
    let kvm = probe_kvm();
    let virtualization = classify_virt(cpuinfo.as_deref().unwrap_or(""), &modules);
    let (verdict, summary) = assess(&kvm, virtualization.kind);
    let unified = fs_magic("/sys/fs/cgroup/unified").ok();
    let mem = |key| meminfo.as_deref().ok().and_then(|m| kib_field(m, key));
    let mem_total = match &meminfo {
        Ok(_) => mem("MemTotal").ok_or_else(|| "no MemTotal in /proc/meminfo".into()),
        Err(e) => Err(e.clone()),
    };
    let thp = "/sys/kernel/mm/transparent_hugepage";
    Report {
        host: Host {
            kernel: read("/proc/sys/kernel/osrelease").map(|s| s.trim().into()),
            cpus: cpuinfo.clone().map(|c| count_processors(&c)),
            cpu_model: cpuinfo.as_deref().ok().and_then(cpu_model),
            mem_total_kib: mem_total,
        },
        kvm,
        virtualization,
        userfaultfd: probe_uffd(),
        huge_pages: HugePages {
            thp_enabled: thp_mode(&format!("{thp}/enabled")),
            thp_shmem_enabled: thp_mode(&format!("{thp}/shmem_enabled")),
            hugetlb_total: mem("HugePages_Total"),
            hugetlb_free: mem("HugePages_Free"),
            hugetlb_page_kib: mem("Hugepagesize"),
        },
        cgroup: classify_cgroup(fs_magic("/sys/fs/cgroup"), unified),
        jail: probe_jail(),
        verdict,
        summary,
    }
}

/// The jail's cgroup version, and a trial jail in a forked child.
fn probe_jail() -> JailReport {
    use torpor_vmm_api::jail::{self as spec, CgroupVersion, JailSpec};
    let cgroup_version = crate::jail::cgroup::detect(CgroupVersion::Auto)
        .map(|h| match h.version() {
            CgroupVersion::V2 => "v2".to_string(),
            _ => "v1".to_string(),
        })
        .map_err(|e| e.to_string());
    let root = std::path::PathBuf::from("/run/torpor/jail-root");
    let trial = std::fs::create_dir_all(&root)
        .map_err(|e| format!("create {}: {e}", root.display()))
        .and_then(|()| {
            trial_jail(&JailSpec {
                uid: spec::CLI_JAIL_UID,
                gid: spec::CLI_JAIL_UID,
                root,
                exposes: Vec::new(),
                devices: vec![spec::Device::Kvm],
                cgroup: Some(spec::cgroup_for(
                    format!("torpor/doctor-{}", std::process::id()),
                    16,
                    1,
                )),
                rlimits: Default::default(),
                namespaces: Default::default(),
            })
        });
    JailReport {
        cgroup_version,
        trial,
    }
}

/// Sets up `jail` in a forked child, which reports its error (if any) on a
/// pipe and exits.
fn trial_jail(jail: &torpor_vmm_api::JailSpec) -> Probe<()> {
    let mut fds = [0i32; 2];
    // SAFETY: pipe2 writes two descriptors into the array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(format!("pipe: {}", IoError::last_os_error()));
    }
    // SAFETY: `torpor doctor` is single-threaded when it probes.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(format!("fork: {}", IoError::last_os_error()));
    }
    if pid == 0 {
        let status = match crate::jail::enter(jail) {
            Ok(_) => 0,
            Err(e) => {
                let text = e.to_string();
                // SAFETY: writes `text` to the pipe's write end.
                unsafe { libc::write(fds[1], text.as_ptr().cast(), text.len()) };
                1
            }
        };
        // SAFETY: ends the child without running the parent's atexit work.
        unsafe { libc::_exit(status) };
    }
    // SAFETY: closes our copy of the write end.
    unsafe { libc::close(fds[1]) };
    // SAFETY: the read end is ours; the File owns it from here.
    let mut reader = unsafe { std::fs::File::from_raw_fd(fds[0]) };
    let mut text = String::new();
    let _ = std::io::Read::read_to_string(&mut reader, &mut text);
    let mut status = 0;
    // SAFETY: waits for our own child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    match (
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        text,
    ) {
        (true, t) if t.is_empty() => Ok(()),
        (_, t) if !t.is_empty() => Err(t),
        _ => Err(format!(
            "the trial jail's process ended with status {status:#x}"
        )),
    }
}

fn read(path: &str) -> Probe<String> {
    fs::read_to_string(path).map_err(|e| DoctorError::Open(path.into(), e).to_string())
}

/// A syscall's return value, or the errno text when it is negative.
fn os_ret(ret: c_long, what: &'static str) -> Probe<c_long> {
    match ret {
        0.. => Ok(ret),
        _ => Err(DoctorError::Os(what, IoError::last_os_error()).to_string()),
    }
}

/// A syscall's return value as the new descriptor it is.
fn owned_fd(ret: c_long, what: &'static str) -> Probe<OwnedFd> {
    let fd = os_ret(ret, what)?;
    // SAFETY: the kernel just created this descriptor and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

fn probe_kvm() -> KvmReport {
    let exists = Path::new("/dev/kvm").exists();
    let opened = match exists {
        true => Kvm::new().map_err(|e| format!("open read-write: {e}")),
        false => Err("does not exist".to_string()),
    };
    let kvm = opened.as_ref().ok();
    let check =
        |k: &Kvm| KVM_CAPS.map(|(n, cap, req)| capability(n, req, k.check_extension_raw(cap)));
    let create_vm = kvm.map(|k| k.create_vm().map(drop).map_err(|e| e.to_string()));
    KvmReport {
        exists,
        api_version: kvm.map_or_else(|| Err("not tried".into()), api_version),
        create_vm: create_vm.unwrap_or_else(|| Err("not tried".into())),
        max_vcpus: kvm.and_then(|k| u32::try_from(k.check_extension_int(Cap::MaxVcpus)).ok()),
        capabilities: kvm.map(|k| check(k).into()).unwrap_or_default(),
        open: opened.map(drop),
    }
}

fn api_version(kvm: &Kvm) -> Probe<i32> {
    let version = kvm.get_api_version();
    os_ret(version.into(), "KVM_GET_API_VERSION").map(|_| version)
}

fn capability(name: &str, required: bool, value: i32) -> Capability {
    let (name, present) = (name.into(), value > 0);
    Capability {
        name,
        required,
        present,
        value,
    }
}

fn new_uffd(flags: libc::c_int) -> Probe<OwnedFd> {
    new_userfaultfd(libc::O_CLOEXEC | libc::O_NONBLOCK | flags)
        .map_err(|e| format!("userfaultfd(2): {e}"))
}

fn new_uffd_from_dev() -> Probe<OwnedFd> {
    let path = "/dev/userfaultfd";
    let dev = (fs::OpenOptions::new().read(true).write(true).open(path))
        .map_err(|e| DoctorError::Open(path.into(), e).to_string())?;
    let flags = libc::O_CLOEXEC | libc::O_NONBLOCK;
    // SAFETY: USERFAULTFD_IOC_NEW takes the new descriptor's flags as an
    // integer argument and returns a new descriptor or -1.
    let ret = unsafe { libc::ioctl(dev.as_raw_fd(), USERFAULTFD_IOC_NEW as _, flags) };
    owned_fd(ret.into(), "USERFAULTFD_IOC_NEW")
}

/// The UFFDIO_API handshake, asking for no feature: the kernel then answers
/// with every feature it supports.
fn uffd_features(fd: &OwnedFd) -> Probe<u64> {
    offered_features(std::os::fd::AsFd::as_fd(fd)).map_err(|e| format!("UFFDIO_API: {e}"))
}

fn probe_uffd() -> UffdReport {
    let user_mode = new_uffd(UFFD_USER_MODE_ONLY);
    let full = new_uffd(0);
    let dev = new_uffd_from_dev();
    let fd = [&full, &user_mode, &dev]
        .into_iter()
        .find_map(|r| r.as_ref().ok());
    let features = fd.map_or_else(|| Err("no userfaultfd could be made".into()), uffd_features);
    let named = features.as_ref().map(|&f| uffd_named(f));
    UffdReport {
        named_features: named.unwrap_or_default(),
        syscall: full.map(drop),
        syscall_user_mode_only: user_mode.map(drop),
        dev_userfaultfd: dev.map(drop),
        unprivileged_sysctl: read("/proc/sys/vm/unprivileged_userfaultfd").map(|s| s.trim().into()),
        features,
    }
}

fn uffd_named(features: u64) -> BTreeMap<&'static str, bool> {
    let named = UFFD_FEATURES.map(|(name, bit)| (name, features & bit != 0));
    std::iter::once(("MISSING", true)).chain(named).collect()
}

fn thp_mode(path: &str) -> Probe<String> {
    let text = read(path)?;
    let mode = bracketed(&text).map(str::to_string);
    mode.ok_or_else(|| format!("{path}: no [selected] mode in {:?}", text.trim()))
}

fn fs_magic(path: &str) -> Probe<i64> {
    let c_path = CString::new(path).map_err(|e| e.to_string())?;
    fsmagic::of_path(&c_path).map_err(|e| format!("statfs {path}: {e}"))
}

/// The value of the first `key : value` line of /proc/cpuinfo.
fn cpuinfo_field<'a>(cpuinfo: &'a str, key: &str) -> Option<&'a str> {
    let mut fields = cpuinfo.lines().filter_map(|l| l.split_once(':'));
    fields.find(|(k, _)| k.trim() == key).map(|(_, v)| v.trim())
}

fn cpu_flags(cpuinfo: &str) -> Vec<&str> {
    let flags = cpuinfo_field(cpuinfo, "flags");
    let words = flags.map(|f| f.split_whitespace().collect());
    words.unwrap_or_default()
}

fn cpu_model(cpuinfo: &str) -> Option<String> {
    cpuinfo_field(cpuinfo, "model name").map(str::to_string)
}

fn count_processors(cpuinfo: &str) -> usize {
    let keys = cpuinfo.lines().filter_map(|l| l.split_once(':'));
    keys.filter(|(k, _)| k.trim() == "processor").count()
}

/// The `[selected]` word of a sysfs mode file such as "always [madvise] never".
fn bracketed(text: &str) -> Option<&str> {
    let mut words = text.split_whitespace();
    words.find_map(|w| w.strip_prefix('[')?.strip_suffix(']'))
}

fn classify_virt(cpuinfo: &str, modules: &[&str]) -> Virtualization {
    let flags = cpu_flags(cpuinfo);
    let cpu_flag = ["vmx", "svm"].into_iter().find(|f| flags.contains(f));
    let hw_module = modules.contains(&"kvm_intel") || modules.contains(&"kvm_amd");
    // With kvm_pvm loaded we cannot tell which module backs /dev/kvm, so
    // assume the weaker one.
    let pvm = modules.contains(&"kvm_pvm");
    let kind = match (pvm, cpu_flag.is_some() && hw_module) {
        (true, _) => VirtKind::Pvm,
        (false, true) => VirtKind::Hardware,
        (false, false) => VirtKind::Unknown,
    };
    Virtualization {
        kind,
        cpu_flag: cpu_flag.map(str::to_string),
        hypervisor_flag: flags.contains(&"hypervisor"),
        modules: modules.iter().map(|m| m.to_string()).collect(),
    }
}

fn classify_cgroup(root: Probe<i64>, unified: Option<i64>) -> Probe<CgroupMode> {
    match root? {
        CGROUP2_SUPER_MAGIC => Ok(CgroupMode::V2),
        _ if unified == Some(CGROUP2_SUPER_MAGIC) => Ok(CgroupMode::Hybrid),
        TMPFS_MAGIC | CGROUP_SUPER_MAGIC => Ok(CgroupMode::V1),
        m => Err(format!(
            "/sys/fs/cgroup: not a cgroup filesystem (magic {m:#x})"
        )),
    }
}

fn assess(kvm: &KvmReport, virt: VirtKind) -> (Verdict, String) {
    match (kvm.unusable_reason(), virt) {
        (Some(why), _) => (Verdict::None, format!("no guests (KVM unusable: {why})")),
        (None, VirtKind::Hardware) => (
            Verdict::LinuxAndProbe,
            "Linux and probe guests (hardware virtualization)".into(),
        ),
        (None, VirtKind::Pvm | VirtKind::Unknown) => (
            Verdict::ProbeOnly,
            "probe guests only (Linux needs hardware virtualization or the nested host)".into(),
        ),
    }
}

fn ok(r: &Probe<()>) -> String {
    match r {
        Ok(()) => "ok".into(),
        Err(e) => format!("no: {e}"),
    }
}

fn show<T: fmt::Display, E: fmt::Display>(r: &Result<T, E>) -> String {
    let value = r.as_ref().map(T::to_string);
    value.unwrap_or_else(|e| format!("unknown: {e}"))
}

fn opt<T: fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "?".into(), |v| v.to_string())
}

fn presence(present: bool) -> &'static str {
    ["absent", "present"][usize::from(present)]
}

fn row(f: &mut fmt::Formatter<'_>, key: &str, value: impl fmt::Display) -> fmt::Result {
    writeln!(f, "  {key:<26} {value}")
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (h, k, u) = (&self.host, &self.kvm, &self.userfaultfd);
        let (hp, v) = (&self.huge_pages, &self.virtualization);
        writeln!(f, "host")?;
        row(f, "kernel", show(&h.kernel))?;
        let model = h.cpu_model.as_ref().map(|m| format!(" ({m})"));
        row(f, "CPUs", show(&h.cpus) + &model.unwrap_or_default())?;
        let gib = h.mem_total_kib.as_ref().map(|k| *k as f64 / 1048576.0);
        row(f, "memory", show(&gib.map(|g| format!("{g:.1} GiB"))))?;
        writeln!(f, "kvm")?;
        row(f, "/dev/kvm", ok(&k.open))?;
        let wrong_api = matches!(k.api_version, Ok(v) if v != KVM_API_VERSION);
        let api_note = ["", " (need 12)"][usize::from(wrong_api)];
        row(f, "API version", show(&k.api_version) + api_note)?;
        row(f, "create VM", ok(&k.create_vm))?;
        row(f, "max vCPUs", opt(k.max_vcpus))?;
        for c in &k.capabilities {
            let need = ["optional", "required"][usize::from(c.required)];
            row(f, &c.name, format!("{:<8} {need}", presence(c.present)))?;
        }
        writeln!(f, "virtualization")?;
        let kind = match v.kind {
            VirtKind::Hardware => "hardware (VMX/SVM)",
            VirtKind::Pvm => "PVM (software, kvm_pvm)",
            VirtKind::Unknown => "unknown or emulated",
        };
        row(f, "kind", kind)?;
        let modules = v.modules.join(", ");
        row(
            f,
            "vendor modules",
            [modules.as_str(), "none"][usize::from(modules.is_empty())],
        )?;
        row(
            f,
            "cpuinfo vmx/svm",
            v.cpu_flag.as_deref().unwrap_or("none"),
        )?;
        row(f, "cpuinfo hypervisor flag", v.hypervisor_flag)?;
        writeln!(f, "userfaultfd")?;
        row(f, "syscall", ok(&u.syscall))?;
        row(f, "syscall, user mode only", ok(&u.syscall_user_mode_only))?;
        row(f, "/dev/userfaultfd", ok(&u.dev_userfaultfd))?;
        row(f, "unprivileged_userfaultfd", show(&u.unprivileged_sysctl))?;
        let features = u.features.as_ref().map(|x| format!("{x:#x}"));
        row(f, "features", show(&features))?;
        for (name, on) in &u.named_features {
            row(f, &format!("  {name}"), presence(*on))?;
        }
        writeln!(f, "huge pages")?;
        row(f, "THP enabled", show(&hp.thp_enabled))?;
        row(f, "THP shmem_enabled", show(&hp.thp_shmem_enabled))?;
        let (total, free) = (opt(hp.hugetlb_total), opt(hp.hugetlb_free));
        row(f, "hugetlb pages", format!("{total} total, {free} free"))?;
        row(
            f,
            "hugetlb page size",
            format!("{} kB", opt(hp.hugetlb_page_kib)),
        )?;
        writeln!(f, "cgroup")?;
        let cgroup = self.cgroup.as_ref().map(|m| match m {
            CgroupMode::V2 => "v2 (/sys/fs/cgroup is cgroup2)",
            CgroupMode::Hybrid => "hybrid (v1 controllers, cgroup2 at /sys/fs/cgroup/unified)",
            CgroupMode::V1 => "v1 only",
        });
        row(f, "mode", show(&cgroup))?;
        writeln!(f, "jail")?;
        row(f, "cgroup version", show(&self.jail.cgroup_version))?;
        let trial = match &self.jail.trial {
            Ok(()) => "ok: VMMs are jailed".to_string(),
            Err(e) => format!("CANNOT set up jails: {e} (VMMs only run with --no-jail)"),
        };
        row(f, "trial jail", trial)?;
        if self.verdict == Verdict::ProbeOnly {
            // Hosts without VMX/SVM still run Linux guests one level down.
            writeln!(f, "nested host")?;
            row(
                f,
                "Linux guests",
                "run them in the nested host: QEMU/TCG with SVM+NPT and kvm_amd \
                 (scripts/nested-host check; tests: nested/tests/)",
            )?;
        }
        writeln!(f, "\nverdict: {}", self.summary)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PVM_CPUINFO: &str = "processor\t: 0\nmodel name\t: AMD EPYC\n\
        flags\t\t: fpu pae apic sse2 xsave avx hypervisor lahf_lm\n\n\
        processor\t: 1\nmodel name\t: AMD EPYC\n\
        flags\t\t: fpu pae apic sse2 xsave avx hypervisor lahf_lm\n";
    const VMX_CPUINFO: &str = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Gold 6338\n\
        flags\t\t: fpu vme de pse tsc msr pae mce vmx smx est\n";
    const MEMINFO: &str = "MemTotal:       24684096 kB\nMemFree:        20000000 kB\n\
        HugePages_Total:       4\nHugePages_Free:        3\nHugepagesize:       2048 kB\n";
    const LINUX: &str = "Linux and probe guests (hardware virtualization)";
    const PROBE: &str =
        "probe guests only (Linux needs hardware virtualization or the nested host)";

    /// A working /dev/kvm where every capability but `absent` is present.
    fn kvm(absent: &[&str]) -> KvmReport {
        let caps = KVM_CAPS.map(|(n, _, req)| capability(n, req, (!absent.contains(&n)).into()));
        KvmReport {
            exists: true,
            open: Ok(()),
            api_version: Ok(12),
            create_vm: Ok(()),
            max_vcpus: Some(1024),
            capabilities: caps.into(),
        }
    }

    /// The verdict, its exit code and its text.
    fn verdict(kvm: &KvmReport, virt: VirtKind) -> (Verdict, i32, String) {
        let (verdict, text) = assess(kvm, virt);
        (verdict, verdict.exit_code(), text)
    }

    #[test]
    fn parses_proc_and_sys_text() {
        let flags = cpu_flags(PVM_CPUINFO);
        assert!(flags.contains(&"hypervisor") && !flags.contains(&"vmx"));
        assert!(cpu_flags("").is_empty());
        assert_eq!(count_processors(PVM_CPUINFO), 2);
        assert_eq!(
            cpu_model(VMX_CPUINFO).unwrap(),
            "Intel(R) Xeon(R) Gold 6338"
        );
        let keys = [
            "MemTotal",
            "HugePages_Total",
            "HugePages_Free",
            "Hugepagesize",
        ];
        let values = keys.map(|key| kib_field(MEMINFO, key).unwrap());
        assert_eq!(values, [24684096, 4, 3, 2048]);
        assert_eq!(kib_field(MEMINFO, "Mem"), None);
        assert_eq!(bracketed("always [madvise] never\n"), Some("madvise"));
        let shmem = "always within_size advise [never] deny force";
        assert_eq!(bracketed(shmem), Some("never"));
        assert_eq!(bracketed("always madvise never"), None);
    }

    #[test]
    fn names_uffd_features() {
        let named = uffd_named((1 << 10) | (1 << 16));
        let on: Vec<&str> = named.iter().filter(|f| *f.1).map(|f| *f.0).collect();
        assert_eq!(on, ["MINOR_SHMEM", "MISSING", "MOVE"]);
        assert_eq!(named.len(), UFFD_FEATURES.len() + 1);
    }

    #[test]
    fn classifies_cgroups() {
        let v2 = classify_cgroup(Ok(CGROUP2_SUPER_MAGIC), None);
        let hybrid = classify_cgroup(Ok(TMPFS_MAGIC), Some(CGROUP2_SUPER_MAGIC));
        let v1 = classify_cgroup(Ok(TMPFS_MAGIC), None);
        let modes = [CgroupMode::V2, CgroupMode::Hybrid, CgroupMode::V1];
        assert_eq!([v2, hybrid, v1], modes.map(Ok));
        assert!(classify_cgroup(Ok(0x6265_6572), None).is_err()); // sysfs
        assert!(classify_cgroup(Err("denied".into()), None).is_err());
    }

    #[test]
    fn pvm_host_runs_probe_guests_only() {
        let virt = classify_virt(PVM_CPUINFO, &["kvm_pvm"]);
        assert_eq!(virt.kind, VirtKind::Pvm);
        assert!(virt.hypervisor_flag && virt.cpu_flag.is_none());
        let expected = (Verdict::ProbeOnly, 10, PROBE.into());
        assert_eq!(verdict(&kvm(&[]), virt.kind), expected);
    }

    #[test]
    fn vmx_host_runs_linux() {
        let virt = classify_virt(VMX_CPUINFO, &["kvm_intel"]);
        assert_eq!(virt.kind, VirtKind::Hardware);
        assert_eq!(virt.cpu_flag.as_deref(), Some("vmx"));
        let optional_missing = kvm(&["DirtyLogRing", "TscControl"]);
        let expected = (Verdict::LinuxAndProbe, 0, LINUX.into());
        assert_eq!(verdict(&optional_missing, virt.kind), expected);
        // The flag without its module, or the module without the flag, proves nothing.
        assert_eq!(classify_virt(VMX_CPUINFO, &[]).kind, VirtKind::Unknown);
        let amd_module_only = classify_virt(PVM_CPUINFO, &["kvm_amd"]);
        assert_eq!(amd_module_only.kind, VirtKind::Unknown);
        assert_eq!(verdict(&kvm(&[]), VirtKind::Unknown).2, PROBE);
    }

    #[test]
    fn no_kvm_runs_nothing() {
        let mut missing = kvm(&[]);
        (missing.exists, missing.open) = (false, Err("does not exist".into()));
        let why = "no guests (KVM unusable: /dev/kvm: does not exist)";
        assert_eq!(
            verdict(&missing, VirtKind::Hardware),
            (Verdict::None, 1, why.into())
        );
        let mut old = kvm(&[]);
        old.api_version = Ok(11);
        let why = "no guests (KVM unusable: API version 11, need 12)";
        assert_eq!(
            verdict(&old, VirtKind::Hardware),
            (Verdict::None, 1, why.into())
        );
        let no_xsave = kvm(&["Xcrs", "Xsave", "TscControl"]);
        let why = "no guests (KVM unusable: missing Xcrs, Xsave)";
        assert_eq!(
            verdict(&no_xsave, VirtKind::Pvm),
            (Verdict::None, 1, why.into())
        );
    }

    #[test]
    fn run_never_panics_and_serializes() {
        let report = run();
        let text = report.to_string();
        assert!(text.ends_with(&format!("verdict: {}\n", report.summary)));
        let json = serde_json::to_value(&report).unwrap();
        assert!(json["verdict"].is_string() && json["kvm"]["capabilities"].is_array());
        assert_eq!(report.exit_code(), report.verdict().exit_code());
    }
}
