//! The [`JailSpec`]: how a VMM process confines itself, as root, before any
//! guest code runs (the `jail` field of a [`crate::LaunchSpec`]).
//!
//! Paths: the jail's root is a private tmpfs mounted on [`JailSpec::root`]
//! inside the VMM's own mount namespace, and every [`Expose`] is
//! bind-mounted there **at its own absolute path**. So every path of the
//! launch spec (control socket, console, snapshot, overlays, sockets) and
//! every path a snapshot records (its lineage's layers) resolves inside the
//! jail unchanged, and the pod keeps using the same paths from outside:
//! nothing is translated. What is not exposed does not exist in the jail.

use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{ErrorKind, VmError};

/// Most exposed paths a jail takes (a chain of [`crate::lineage::MAX_CHAIN_DEPTH`]
/// layers, the sandbox's directory, a disk image).
pub const MAX_EXPOSES: usize = 96;
/// First uid of the pod's range of per-VMM uids (`serve --jail-uid-base`).
pub const DEFAULT_JAIL_UID_BASE: u32 = 200_000;
/// Uids in that range (`serve --jail-uids`).
pub const DEFAULT_JAIL_UIDS: u32 = 65_536;
/// The uid `torpor vmm` jails itself as unless told (outside the pod's
/// range).
pub const CLI_JAIL_UID: u32 = DEFAULT_JAIL_UID_BASE - 1;
/// Memory a jailed VMM may use beyond its guest's (its own heap, page
/// tables, device buffers, page cache it writes snapshots through): the
/// cgroup limit is guest memory plus this.
pub const VMM_OVERHEAD_MIB: u64 = 96;
/// Tasks in a jailed VMM's cgroup besides its vCPU threads: its
/// supervisor, main, control and device threads, the page server; far
/// fewer than this. [`cgroup_for`] adds one per vCPU.
pub const DEFAULT_PIDS_MAX: u64 = 64;
/// Longest cgroup name.
pub const MAX_CGROUP_NAME: usize = 200;

/// One VMM's jail.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JailSpec {
    /// The unprivileged uid the VMM runs as (never 0).
    pub uid: u32,
    /// Its gid (never 0); supplementary groups are dropped.
    pub gid: u32,
    /// An existing empty directory the jail's root tmpfs is mounted on (in
    /// the VMM's mount namespace only: outside, it stays empty).
    pub root: PathBuf,
    /// Host files and directories visible inside the jail, each at its own
    /// path.
    #[serde(default)]
    pub exposes: Vec<Expose>,
    /// Device nodes made in the jail's `/dev`, owned by `uid`, mode 0600.
    #[serde(default)]
    pub devices: Vec<Device>,
    /// The cgroup the VMM joins (None: it stays in its starter's).
    #[serde(default)]
    pub cgroup: Option<CgroupSpec>,
    #[serde(default)]
    pub rlimits: Rlimits,
    #[serde(default)]
    pub namespaces: Namespaces,
}

/// A host path bind-mounted into the jail at the same path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Expose {
    pub path: PathBuf,
    /// Mounted read-only (templates, shared snapshot layers, disk images).
    #[serde(default)]
    pub read_only: bool,
}

impl Expose {
    pub fn read_write(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            read_only: false,
        }
    }

    pub fn read_only(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            read_only: true,
        }
    }
}

/// A device the VMM needs, made with the host node's numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Device {
    /// `/dev/kvm`.
    Kvm,
    /// `/dev/userfaultfd` (uffd memory backends, uffd-wp dirty tracking:
    /// an unprivileged process gets kernel-mode faults only through it).
    Userfaultfd,
    /// `/dev/net/tun` (networking).
    NetTun,
}

impl Device {
    pub const ALL: [Device; 3] = [Device::Kvm, Device::Userfaultfd, Device::NetTun];

    /// The node's path, on the host and in the jail.
    pub fn path(self) -> &'static str {
        match self {
            Device::Kvm => "/dev/kvm",
            Device::Userfaultfd => "/dev/userfaultfd",
            Device::NetTun => "/dev/net/tun",
        }
    }
}

/// Which cgroup hierarchy the host has.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CgroupVersion {
    /// Detected when the jail is set up (v2 when the unified hierarchy has
    /// the controllers, else v1).
    #[default]
    Auto,
    V1,
    V2,
}

/// The VMM's cgroup and its limits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CgroupSpec {
    #[serde(default)]
    pub version: CgroupVersion,
    /// Relative path under each hierarchy's root (`torpor/vmm-200001`):
    /// components of `[A-Za-z0-9_.-]`, no `..`.
    pub name: String,
    /// Memory limit (v1 `memory.limit_in_bytes`, v2 `memory.max`).
    #[serde(default)]
    pub memory_max_bytes: Option<u64>,
    /// Tasks limit (`pids.max`).
    #[serde(default)]
    pub pids_max: Option<u64>,
    /// CPU bandwidth.
    #[serde(default)]
    pub cpu: Option<CpuQuota>,
}

/// `quota_us` of CPU time per `period_us` (2 vCPUs flat out: 2 × period).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CpuQuota {
    pub quota_us: u64,
    pub period_us: u64,
}

/// Resource limits; `RLIMIT_CORE` is always 0 (a crashed VMM must not dump
/// guest memory to disk).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rlimits {
    /// `RLIMIT_NOFILE`.
    #[serde(default = "default_nofile")]
    pub nofile: u64,
    /// `RLIMIT_FSIZE`: the largest file the VMM may write (its snapshot
    /// memory files, its disk overlay, its console). None: unlimited.
    #[serde(default)]
    pub fsize: Option<u64>,
}

fn default_nofile() -> u64 {
    4096
}

impl Default for Rlimits {
    fn default() -> Self {
        Self {
            nofile: default_nofile(),
            fsize: None,
        }
    }
}

/// Namespaces the VMM gets of its own. The mount namespace is required
/// (the jail's root lives in it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Namespaces {
    #[serde(default = "yes")]
    pub pid: bool,
    #[serde(default = "yes")]
    pub ipc: bool,
    #[serde(default = "yes")]
    pub uts: bool,
    #[serde(default = "yes")]
    pub net: bool,
    /// Join this network namespace (`/run/netns/NAME`, the sandbox's,
    /// holding its tap) instead of making a new one.
    #[serde(default)]
    pub join_net: Option<PathBuf>,
}

fn yes() -> bool {
    true
}

impl Default for Namespaces {
    fn default() -> Self {
        Self {
            pid: true,
            ipc: true,
            uts: true,
            net: true,
            join_net: None,
        }
    }
}

impl JailSpec {
    /// Checks the jail alone; [`JailSpec::check_path`] checks a spec's path
    /// against it.
    pub fn check(&self) -> Result<(), VmError> {
        if self.uid == 0 || self.gid == 0 {
            return Err(invalid("a jail's uid and gid must not be 0"));
        }
        clean_absolute("jail root", &self.root)?;
        if self.exposes.len() > MAX_EXPOSES {
            return Err(invalid(format!(
                "a jail exposes at most {MAX_EXPOSES} paths"
            )));
        }
        for e in &self.exposes {
            clean_absolute("exposed", &e.path)?;
            let dev = e.path.starts_with("/dev") && !e.path.starts_with("/dev/shm");
            if e.path == Path::new("/") || dev || e.path.starts_with("/proc") {
                return Err(invalid(format!(
                    "the jail cannot expose {}",
                    e.path.display()
                )));
            }
        }
        if let Some(c) = &self.cgroup {
            let ok_component = |s: &str| {
                !s.is_empty()
                    && s != "."
                    && s != ".."
                    && s.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b))
            };
            if c.name.len() > MAX_CGROUP_NAME || !c.name.split('/').all(ok_component) {
                return Err(invalid(format!("bad cgroup name `{}`", c.name)));
            }
            if c.cpu
                .is_some_and(|q| q.period_us < 1000 || q.quota_us < 1000)
            {
                return Err(invalid("cpu quota and period are at least 1000 µs"));
            }
            if c.memory_max_bytes.is_some_and(|m| m < 16 << 20) {
                return Err(invalid("a jail's memory limit is at least 16 MiB"));
            }
            if c.pids_max == Some(0) {
                return Err(invalid("a jail's pids limit is at least 1"));
            }
        }
        if self.rlimits.nofile < 64 {
            return Err(invalid("a jail's nofile limit is at least 64"));
        }
        Ok(())
    }

    /// Whether `path` resolves inside the jail (under an exposed path), and
    /// writably when `write`.
    pub fn check_path(&self, what: &str, path: &Path, write: bool) -> Result<(), VmError> {
        let inside = self
            .exposes
            .iter()
            .filter(|e| path.starts_with(&e.path))
            .max_by_key(|e| e.path.components().count());
        match inside {
            Some(e) if write && e.read_only => Err(invalid(format!(
                "the {what} {} is read-only in the jail",
                path.display()
            ))),
            Some(_) => Ok(()),
            None => Err(invalid(format!(
                "the {what} {} is not exposed in the jail",
                path.display()
            ))),
        }
    }
}

/// The cgroup limits of a VMM with `mem_mib` of guest memory and `vcpus`:
/// memory plus [`VMM_OVERHEAD_MIB`], [`DEFAULT_PIDS_MAX`] tasks plus one
/// per vCPU, and the CPU time of its vCPUs plus half a core for its own
/// threads.
pub fn cgroup_for(name: String, mem_mib: u64, vcpus: u64) -> CgroupSpec {
    const PERIOD_US: u64 = 100_000;
    CgroupSpec {
        version: CgroupVersion::Auto,
        name,
        memory_max_bytes: Some((mem_mib + VMM_OVERHEAD_MIB) << 20),
        pids_max: Some(DEFAULT_PIDS_MAX + vcpus),
        cpu: Some(CpuQuota {
            quota_us: vcpus.max(1) * PERIOD_US + PERIOD_US / 2,
            period_us: PERIOD_US,
        }),
    }
}

fn invalid(message: impl Into<String>) -> VmError {
    VmError::new(ErrorKind::InvalidRequest, message)
}

/// Absolute, with no `.` or `..` (a bind target must not climb out).
fn clean_absolute(what: &str, path: &Path) -> Result<(), VmError> {
    let clean = path.is_absolute()
        && path
            .components()
            .all(|c| matches!(c, Component::RootDir | Component::Normal(_)));
    if clean {
        Ok(())
    } else {
        Err(invalid(format!(
            "the {what} path must be absolute, without `.` or `..`: {}",
            path.display()
        )))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn jail() -> JailSpec {
        JailSpec {
            uid: 200_001,
            gid: 200_001,
            root: "/d/jail".into(),
            exposes: vec![
                Expose::read_write("/d/sandboxes/s1"),
                Expose::read_only("/d/templates/t1/snapshot"),
            ],
            devices: vec![Device::Kvm],
            cgroup: Some(CgroupSpec {
                version: CgroupVersion::Auto,
                name: "torpor/vmm-200001".into(),
                memory_max_bytes: Some(256 << 20),
                pids_max: Some(64),
                cpu: None,
            }),
            rlimits: Rlimits::default(),
            namespaces: Namespaces::default(),
        }
    }

    #[test]
    fn jails_are_checked() {
        let j = jail();
        j.check().unwrap();
        let json = serde_json::to_string(&j).unwrap();
        assert_eq!(serde_json::from_str::<JailSpec>(&json).unwrap(), j);

        let mut root = j.clone();
        root.uid = 0;
        assert!(root.check().is_err());
        let mut climb = j.clone();
        climb
            .exposes
            .push(Expose::read_only("/d/sandboxes/s1/../s2"));
        assert!(climb.check().unwrap_err().message.contains(".."));
        let mut dev = j.clone();
        dev.exposes.push(Expose::read_write("/dev"));
        assert!(dev.check().is_err());
        let mut cg = j.clone();
        cg.cgroup.as_mut().unwrap().name = "torpor/../../x".into();
        assert!(cg.check().is_err());
        let unknown = json.replace("\"uid\"", "\"euid\"");
        assert!(serde_json::from_str::<JailSpec>(&unknown).is_err());
    }

    #[test]
    fn paths_resolve_under_exposes() {
        let j = jail();
        j.check_path("console", Path::new("/d/sandboxes/s1/console.log"), true)
            .unwrap();
        j.check_path("snapshot", Path::new("/d/templates/t1/snapshot"), false)
            .unwrap();
        let e = j
            .check_path("overlay", Path::new("/d/templates/t1/snapshot/x"), true)
            .unwrap_err();
        assert!(e.message.contains("read-only"), "{e}");
        let e = j
            .check_path("snapshot", Path::new("/d/sandboxes/s2/snap"), false)
            .unwrap_err();
        assert!(e.message.contains("not exposed"), "{e}");
    }
}
