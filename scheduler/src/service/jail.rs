//! The pod's side of VMM jails: which uid each VMM runs as (one per VMM
//! from the configured range), the [`JailSpec`] it is started with (what
//! it sees, its devices, its cgroup's limits), the ownership of the files
//! it writes and reads, and the paths a standby shell is given when it is
//! taken (mounted into its jail: the shell was jailed when it was made).
//! See docs/vmm.md, "The jail".

use std::collections::HashMap;
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;

use torpor_sync::Locked;
use torpor_vmm_api::jail::{self, Expose, JailSpec};
use torpor_vmm_api::{LaunchMode, LaunchSpec, MemoryBackend, RestoreSpec};

pub use super::inject::inject;
use super::{vmm, ServiceError};

/// The range of uids jailed VMMs run as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JailConfig {
    pub uid_base: u32,
    /// How many uids: at most this many VMMs (shells included) at once.
    pub uids: u32,
    /// The memory limit of a sandbox's VMM (standby shells included)
    /// instead of its guest memory + [`jail::VMM_OVERHEAD_MIB`]: lower to
    /// oversubscribe (a guest that touches more is OOM-killed alone).
    /// Template builds keep guest memory + overhead.
    pub sandbox_memory_max_mib: Option<u64>,
}

impl Default for JailConfig {
    fn default() -> Self {
        Self {
            uid_base: jail::DEFAULT_JAIL_UID_BASE,
            uids: jail::DEFAULT_JAIL_UIDS,
            sandbox_memory_max_mib: None,
        }
    }
}

/// Uids taken: by a VMM starting (None) or running (its pid and start
/// time, so a recycled pid does not hold a uid).
type Slots = HashMap<u32, Option<(u32, Option<u64>)>>;

/// The pod's jails.
#[derive(Debug)]
pub struct Jails {
    config: JailConfig,
    data_dir: PathBuf,
    /// The empty directory every jail's root tmpfs is mounted on.
    root: PathBuf,
    /// uid → the pid of the VMM that has it (None: being started).
    slots: Mutex<Slots>,
    cursor: AtomicU32,
    /// Names cgroups uniquely per VMM.
    started: AtomicU64,
    instance: u64,
    /// The network namespace jailed VMMs without a sandbox network join
    /// ([`SharedNetns`]); None: each makes its own.
    netns: Option<SharedNetns>,
}

/// One empty network namespace (a loopback interface, down; no route, no
/// other interface) that the pod's jailed VMMs without a sandbox network
/// join instead of each making its own: making a network namespace was
/// the largest single cost of a jailed VMM's start (`copy_net_ns`, 12 %
/// of the CPU spent over the API bench's creates, plus its teardown in a
/// kernel worker at every exit). Held open by the pod (the namespace ends
/// with it) and named to VMMs as `/proc/<pod pid>/fd/<fd>`, which a VMM
/// opens as root before it enters its jail. What sharing gives up and why
/// it is kept small: docs/security.md ("The jail").
/// (The restore bench makes one the same way for its pod-like row.)
#[derive(Debug)]
pub struct SharedNetns {
    _fd: OwnedFd,
    path: PathBuf,
}

impl SharedNetns {
    /// Made on a thread of its own, which leaves the namespace when it
    /// ends; None where a namespace cannot be made (not root).
    pub fn make() -> Option<Self> {
        let made = std::thread::spawn(|| -> std::io::Result<OwnedFd> {
            // SAFETY: unshare takes a flag; it moves only this thread,
            // which ends right after, into a new network namespace.
            if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
            std::fs::File::open("/proc/thread-self/ns/net").map(OwnedFd::from)
        })
        .join();
        match made {
            Ok(Ok(fd)) => {
                let path = PathBuf::from(format!(
                    "/proc/{}/fd/{}",
                    std::process::id(),
                    fd.as_raw_fd()
                ));
                Some(Self { _fd: fd, path })
            }
            Ok(Err(e)) => {
                tracing::warn!(
                    "no shared network namespace for jailed VMMs (each makes its own): {e}"
                );
                None
            }
            Err(_) => None,
        }
    }

    /// The path that names it to a VMM (`/proc/<pid>/fd/<fd>`), valid
    /// while this is held.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Pods opened by this process so far.
static INSTANCES: AtomicU64 = AtomicU64::new(0);

/// A uid taken for a VMM about to start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    pub uid: u32,
}

impl Jails {
    pub fn new(data_dir: &Path, config: JailConfig) -> Result<Self, ServiceError> {
        if config.uid_base == 0
            || config.uids == 0
            || config.uid_base.checked_add(config.uids).is_none()
        {
            return Err(ServiceError::Invalid(format!(
                "bad jail uid range {} + {}",
                config.uid_base, config.uids
            )));
        }
        sweep_stale_cgroups();
        let root = data_dir.join("jail-root");
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&root)
            .map_err(|e| internal(&format!("create {}", root.display()), e))?;
        Ok(Self {
            config,
            data_dir: data_dir.to_path_buf(),
            root,
            slots: Mutex::new(HashMap::new()),
            cursor: AtomicU32::new(0),
            started: AtomicU64::new(0),
            instance: INSTANCES.fetch_add(1, Ordering::Relaxed),
            netns: SharedNetns::make(),
        })
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, Slots> {
        self.slots.locked()
    }

    /// A uid no live VMM of this pod has. A slot is free again once its
    /// VMM's process is gone: nothing needs to give it back.
    pub fn reserve(&self) -> Result<Slot, ServiceError> {
        let mut slots = self.slots();
        let n = self.config.uids;
        let start = self.cursor.fetch_add(1, Ordering::Relaxed);
        for i in 0..n {
            let uid = self.config.uid_base + (start.wrapping_add(i) % n);
            let free = match slots.get(&uid) {
                None => true,
                Some(None) => false,
                Some(Some((pid, start))) => !vmm::is_process(*pid, *start),
            };
            if free {
                slots.insert(uid, None);
                return Ok(Slot { uid });
            }
        }
        Err(ServiceError::Admission {
            message: format!("all {n} jail uids are in use by running VMMs"),
        })
    }

    /// The VMM started with `slot` has host pid `pid`.
    pub fn assign(&self, slot: Slot, pid: u32) {
        let start = vmm::start_time(pid);
        self.slots().insert(slot.uid, Some((pid, start)));
    }

    /// The VMM of `slot` did not start.
    pub fn release(&self, slot: Slot) {
        self.slots().remove(&slot.uid);
    }

    /// A VMM an earlier run of the service started keeps its uid.
    pub fn note_running(&self, pid: u32) {
        if let Some(uid) = process_uid(pid) {
            let range = self.config.uid_base..self.config.uid_base + self.config.uids;
            if range.contains(&uid) {
                self.slots().insert(uid, Some((pid, vmm::start_time(pid))));
            }
        }
    }

    /// The jail of a VMM of `spec` (a guest of `mem_mib` and `vcpus`),
    /// with `extra` paths beyond those the spec names.
    pub fn spec_for(
        &self,
        slot: Slot,
        spec: &LaunchSpec,
        mem_mib: u64,
        vcpus: u64,
        extra: &[Expose],
        layers: Option<&[PathBuf]>,
    ) -> JailSpec {
        let mut exposes = torpor_vmm_api::exposes::exposes_for_chain(spec, layers);
        exposes.extend_from_slice(extra);
        // The largest file it writes: a snapshot's memory (guest memory) or
        // a disk overlay (its image's size), plus room; a runaway log or
        // console stops there.
        let largest_image = exposes
            .iter()
            .filter_map(|e| std::fs::metadata(&e.path).ok())
            .filter(|m| m.is_file())
            .map(|m| m.len())
            .max()
            .unwrap_or(0);
        let fsize = (mem_mib << 20).max(largest_image) + (1 << 30);
        // Unique on the host: this process, this pod (a process may run
        // several, tests do), this VMM.
        let n = self.started.fetch_add(1, Ordering::Relaxed);
        let name = format!(
            "torpor/{}-{}-{n}-{}",
            std::process::id(),
            self.instance,
            slot.uid
        );
        let mut cgroup = jail::cgroup_for(name, mem_mib, vcpus);
        let sandbox = matches!(
            spec.mode,
            LaunchMode::Standby { .. }
                | LaunchMode::Restore {
                    record_working_set_ms: None,
                    ..
                }
        );
        if let (true, Some(max)) = (sandbox, self.config.sandbox_memory_max_mib) {
            cgroup.memory_max_bytes = Some(max << 20);
        }
        JailSpec {
            uid: slot.uid,
            gid: slot.uid,
            root: self.root.clone(),
            exposes,
            devices: torpor_vmm_api::exposes::devices_for(spec),
            cgroup: Some(cgroup),
            rlimits: jail::Rlimits {
                fsize: Some(fsize),
                ..Default::default()
            },
            namespaces: jail::Namespaces {
                // A VMM with a sandbox network joins that one instead
                // (`torpor_vmm::launch`).
                join_net: self.netns.as_ref().map(|n| n.path.clone()),
                ..Default::default()
            },
        }
    }

    /// Makes `exposes` usable by `uid` and nothing more: directories it
    /// writes in (under the data directory) become its own, mode 0700,
    /// with the files directly in them; what it only reads there (snapshot
    /// layers, which the caller took from a checked chain) is sealed
    /// (root's, 0755/0644), so no VMM can change a layer. Only inside
    /// `own`, the directory of the VMM's sandbox, template or shell: a
    /// read-only expose outside it (another sandbox's layer a fork sits
    /// on, a template's snapshot, an image) was sealed when it became
    /// shared ([`Jails::seal_shared`]), and is only checked here: one that
    /// is not sealed fails the start with `bad_snapshot` naming it, and
    /// nothing outside `own` changes owner or mode. Nothing is reached
    /// through a symbolic link or a `..`: such a path is refused.
    pub fn prepare(
        &self,
        uid: u32,
        own: Option<&Path>,
        exposes: &[Expose],
    ) -> Result<(), ServiceError> {
        for e in exposes {
            if !e.path.starts_with(&self.data_dir) {
                continue; // host paths (/dev/shm, a rootfs image) stay as they are
            }
            let inside = own.is_some_and(|o| e.path.starts_with(o));
            if e.read_only && inside {
                walk(&self.data_dir, &e.path, Walk::Seal)?;
            } else if e.read_only {
                walk(&self.data_dir, &e.path, Walk::Check)?;
            } else if inside {
                super::layer_gate::real_dir(&self.data_dir, &e.path)
                    .map_err(|r| internal("expose writable", r))?;
                own_dir(&e.path, uid)?;
            } else {
                return Err(ServiceError::Internal(format!(
                    "{} is exposed writable outside the VMM's own directory",
                    e.path.display()
                )));
            }
        }
        Ok(())
    }

    /// Seals `paths` (layers, an image's files) at the moment they become
    /// shared: a checkpoint or snapshot forked from, a snapshot made a
    /// template, a template built (its snapshot, its image). Paths outside
    /// the data directory are left alone; the layers come from a checked
    /// chain. See [`Jails::prepare`] for why a start does not.
    pub fn seal_shared(&self, paths: &[PathBuf]) -> Result<(), ServiceError> {
        for p in paths.iter().filter(|p| p.starts_with(&self.data_dir)) {
            walk(&self.data_dir, p, Walk::Seal)?;
        }
        Ok(())
    }
}

/// Removes the cgroups of VMMs whose supervisor was killed before it could
/// (`torpor/<starter pid>-...`, `torpor/cli-<pid>`: the starter is gone
/// and the cgroup empty; a cgroup with processes cannot be removed).
fn sweep_stale_cgroups() {
    let mut parents = vec![PathBuf::from("/sys/fs/cgroup/torpor")];
    if let Ok(entries) = std::fs::read_dir("/sys/fs/cgroup") {
        parents.extend(entries.flatten().map(|e| e.path().join("torpor")));
    }
    for parent in parents {
        let Ok(entries) = std::fs::read_dir(&parent) else {
            continue;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let starter = name
                .trim_start_matches("cli-")
                .trim_start_matches("doctor-")
                .split('-')
                .next()
                .and_then(|p| p.parse::<u32>().ok());
            // A cgroup with processes in it cannot be removed anyway.
            if starter.is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists()) {
                let _ = std::fs::remove_dir(entry.path());
            }
        }
    }
}

pub(super) fn internal(what: &str, e: impl std::fmt::Display) -> ServiceError {
    ServiceError::Internal(format!("{what}: {e}"))
}

/// The real uid of a process, from `/proc/PID/status`.
fn process_uid(pid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn lchown(path: &Path, uid: u32) -> Result<(), ServiceError> {
    std::os::unix::fs::lchown(path, Some(uid), Some(uid))
        .map_err(|e| internal(&format!("chown {}", path.display()), e))
}

/// `dir` and the files directly in it belong to `uid` (never following a
/// link); its subdirectories (layers) are left alone.
fn own_dir(dir: &Path, uid: u32) -> Result<(), ServiceError> {
    let meta = std::fs::symlink_metadata(dir).map_err(|e| internal("stat", e))?;
    if !meta.is_dir() {
        return Err(ServiceError::Internal(format!(
            "{} is exposed writable but is not a directory",
            dir.display()
        )));
    }
    if meta.uid() != uid {
        lchown(dir, uid)?;
    }
    if meta.mode() & 0o777 != 0o700 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| internal("chmod", e))?;
    }
    let entries = std::fs::read_dir(dir).map_err(|e| internal("list", e))?;
    for entry in entries.flatten() {
        let Ok(m) = entry.metadata() else { continue };
        if !m.is_dir() && m.uid() != uid {
            lchown(&entry.path(), uid)?;
        }
    }
    Ok(())
}

/// Deepest directory [`seal`] descends into below a layer.
const SEAL_DEPTH: usize = 4;

/// What [`walk`] does to each file and directory of a read-only expose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Walk {
    /// Make it sealed: root's, directories 0755, files 0644.
    Seal,
    /// Only check that it is sealed: root's, writable by nobody else,
    /// readable (directories searchable) by all; a change of owner or mode
    /// is the caller's to refuse.
    Check,
}

/// A read-only expose under `data_dir` (a layer, a template's file),
/// sealed or checked ([`Walk`]), what is in a directory too (once: a sealed
/// layer is left as it is). Never through a symbolic link, never outside
/// `data_dir`: the path is opened beneath the data directory with
/// `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`, each entry below it
/// relative to its directory with `O_NOFOLLOW`, and every change goes
/// through the descriptor (a link swapped in meanwhile is refused, not
/// followed). Anything but files and directories is refused.
fn walk(data_dir: &Path, path: &Path, how: Walk) -> Result<(), ServiceError> {
    let rel = path
        .strip_prefix(data_dir)
        .ok()
        .filter(|r| {
            r.components()
                .all(|c| matches!(c, std::path::Component::Normal(_)))
        })
        .filter(|r| !r.as_os_str().is_empty())
        .ok_or_else(|| refused(path, "not a plain path under the data directory"))?;
    let base = open_at(None, data_dir, libc::O_DIRECTORY)
        .map_err(|e| internal(&format!("open {}", data_dir.display()), e))?;
    let fd = open_beneath(&base, rel).map_err(|e| match e.raw_os_error() {
        Some(libc::ELOOP | libc::EXDEV) => refused(path, "reached through a symbolic link"),
        _ => internal(&format!("open {}", path.display()), e),
    })?;
    walk_fd(&fd, path, 0, how)
}

fn refused(path: &Path, why: &str) -> ServiceError {
    ServiceError::Vm(
        torpor_vmm_api::VmError::new(
            torpor_vmm_api::ErrorKind::BadSnapshot,
            format!("{} is refused: {why}", path.display()),
        )
        .with_layer(path),
    )
}

const OPEN_FLAGS: libc::c_int =
    libc::O_RDONLY | libc::O_CLOEXEC | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY;

/// `openat(dir or the cwd, path, OPEN_FLAGS | extra)`.
fn open_at(dir: Option<&OwnedFd>, path: &Path, extra: libc::c_int) -> std::io::Result<OwnedFd> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    let at = dir.map_or(libc::AT_FDCWD, |d| d.as_raw_fd());
    // SAFETY: a NUL-terminated path alive for the call; the descriptor
    // returned is owned below.
    let fd = unsafe { libc::openat(at, c.as_ptr(), OPEN_FLAGS | extra) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a descriptor the kernel just returned, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `rel` opened beneath `base`, no component a symbolic link or `..` out.
fn open_beneath(base: &OwnedFd, rel: &Path) -> std::io::Result<OwnedFd> {
    let c = CString::new(rel.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: open_how is plain data; zeroed is a valid value.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = OPEN_FLAGS as u64;
    how.resolve = libc::RESOLVE_BENEATH | libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_MAGICLINKS;
    // SAFETY: a descriptor we own, a NUL-terminated path and an open_how
    // of the size passed, alive for the call.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            base.as_raw_fd(),
            c.as_ptr(),
            &how as *const libc::open_how,
            std::mem::size_of::<libc::open_how>(),
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a descriptor the kernel just returned, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

fn walk_fd(fd: &OwnedFd, shown: &Path, depth: usize, how: Walk) -> Result<(), ServiceError> {
    let sys = |ret: libc::c_int, what: &str| {
        if ret < 0 {
            Err(internal(
                &format!("{what} {}", shown.display()),
                std::io::Error::last_os_error(),
            ))
        } else {
            Ok(())
        }
    };
    // SAFETY: stat is plain data; fstat fills it from a descriptor we own.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    sys(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) }, "stat")?;
    let is_dir = match st.st_mode & libc::S_IFMT {
        libc::S_IFDIR => true,
        libc::S_IFREG => false,
        _ => return Err(refused(shown, "neither a file nor a directory")),
    };
    let want = if is_dir { 0o755 } else { 0o644 };
    match how {
        Walk::Check => {
            // Readable by all (searchable, for a directory), writable by
            // root alone, no set-id bits.
            let reads = if is_dir { 0o005 } else { 0o004 };
            let mode = st.st_mode & 0o7777;
            if st.st_uid != 0 || mode & 0o7022 != 0 || mode & reads != reads {
                return Err(refused(
                    shown,
                    &format!(
                        "shared but not sealed (owner {}, mode {mode:04o}): a layer \
                         outside the VMM's own directory is sealed when it is shared, \
                         never when a VMM starts",
                        st.st_uid
                    ),
                ));
            }
        }
        Walk::Seal => {
            if st.st_uid != 0 || st.st_gid != 0 {
                // SAFETY: a descriptor we own and plain ids.
                sys(unsafe { libc::fchown(fd.as_raw_fd(), 0, 0) }, "chown")?;
            }
            if st.st_mode & 0o7777 != want {
                // SAFETY: a descriptor we own and a mode.
                sys(unsafe { libc::fchmod(fd.as_raw_fd(), want) }, "chmod")?;
            }
        }
    }
    if !is_dir {
        return Ok(());
    }
    if depth >= SEAL_DEPTH {
        return Err(refused(shown, "directories nested too deep for a layer"));
    }
    // The directory this descriptor is, whatever its path is now.
    let listed = std::fs::read_dir(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .map_err(|e| internal(&format!("list {}", shown.display()), e))?;
    for entry in listed {
        let entry = entry.map_err(|e| internal(&format!("list {}", shown.display()), e))?;
        let name = entry.file_name();
        let child_shown = shown.join(&name);
        let child = open_at(Some(fd), Path::new(&name), 0).map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => refused(&child_shown, "a symbolic link"),
            Some(libc::ENXIO) => refused(&child_shown, "neither a file nor a directory"),
            _ => internal(&format!("open {}", child_shown.display()), e),
        })?;
        walk_fd(&child, &child_shown, depth + 1, how)?;
    }
    Ok(())
}

pub(super) fn cstring(path: &Path) -> Result<CString, ServiceError> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| ServiceError::Internal(format!("path with NUL: {}", path.display())))
}

/// For `uffd-shared`: the shmem copy of the snapshot's base memory file,
/// made by the pod (root-owned, read-only to VMMs) before a jailed VMM
/// maps it.
/// `layers` is the restore's checked chain (base first): the pod copies
/// what the base names, so never from a chain the VMM merely reported.
pub fn ensure_shared_copy(restore: &RestoreSpec, layers: &[PathBuf]) -> Result<(), ServiceError> {
    if restore.backend != MemoryBackend::UffdShared {
        return Ok(());
    }
    let base = layers.first().unwrap_or(&restore.snapshot);
    // The VMM reports a snapshot without memory as such.
    let memory = base.join("memory");
    if !memory.exists() {
        return Ok(());
    }
    torpor_vmm_api::shmem::ensure(&memory)
        .map(drop)
        .map_err(|e| internal(&format!("make the shmem copy of {}", memory.display()), e))
}

/// Starts a VMM of `spec` (a guest of `mem_mib` and `vcpus`), in its own
/// jail when the pod jails (`extra`: paths beyond those the spec names).
/// A restore comes with its snapshot's chain as the service checked it
/// (`layers`, base first: [`super::Service::checked_chain`]), never read
/// again from what the VMM wrote.
pub fn spawn(
    jails: Option<&Jails>,
    exe: &Path,
    mut spec: LaunchSpec,
    log: &Path,
    (mem_mib, vcpus): (u64, u64),
    extra: &[Expose],
    layers: Option<&[PathBuf]>,
) -> Result<(vmm::Spawned, Option<u32>), ServiceError> {
    let Some(jails) = jails else {
        return vmm::spawn(exe, &spec, log).map(|s| (s, None));
    };
    if let LaunchMode::Restore { restore, .. } = &spec.mode {
        let layers = layers.ok_or_else(|| {
            ServiceError::Internal("a jailed restore without its checked chain".into())
        })?;
        ensure_shared_copy(restore, layers)?;
    }
    let slot = jails.reserve()?;
    let jail = jails.spec_for(slot, &spec, mem_mib, vcpus, extra, layers);
    // Its own directory: where its control socket is (a sandbox's, a
    // template's, a shell's).
    let own = spec.control_socket.as_deref().and_then(Path::parent);
    let started = jails.prepare(slot.uid, own, &jail.exposes).and_then(|()| {
        spec.jail = Some(jail);
        vmm::spawn(exe, &spec, log)
    });
    match started {
        Ok(s) => {
            jails.assign(slot, s.handle.pid);
            Ok((s, Some(slot.uid)))
        }
        Err(e) => {
            jails.release(slot);
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uids_are_taken_once_and_freed_with_their_vmm() {
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path().join("dir");
        let jails = Jails::new(
            &dir,
            JailConfig {
                uid_base: 300_000,
                uids: 2,
                sandbox_memory_max_mib: None,
            },
        )
        .unwrap();
        let a = jails.reserve().unwrap();
        let b = jails.reserve().unwrap();
        assert_ne!(a, b);
        assert!(jails.reserve().is_err(), "only two uids");
        jails.release(a);
        let c = jails.reserve().unwrap();
        assert_eq!(c, a);
        // A slot whose VMM is gone is free; a live one is not.
        jails.assign(c, u32::MAX - 1);
        jails.assign(b, std::process::id());
        assert_eq!(jails.reserve().unwrap(), c);
        assert!(jails.reserve().is_err());
        // SAFETY: getuid cannot fail.
        let uid = unsafe { libc::getuid() };
        assert_eq!(process_uid(std::process::id()), Some(uid));
    }

    /// Sealing makes a layer root's, 0755/0644, and never reaches through
    /// a link or a `..`: what the link points at keeps its owner and mode.
    /// Needs root (it chowns); tests/needs.
    #[test]
    fn sealing_follows_no_link_and_stays_beneath_the_data_directory() {
        // SAFETY: geteuid cannot fail.
        assert_eq!(unsafe { libc::geteuid() }, 0, "sealing chowns: needs root");
        let scratch = tempfile::tempdir().unwrap();
        let data = std::fs::canonicalize(scratch.path()).unwrap();
        let mine = data.join("sandboxes/mine");
        let victim = data.join("sandboxes/victim/snap-1");
        let layer = mine.join("snap-1");
        for d in [&layer, &victim] {
            std::fs::create_dir_all(d).unwrap();
            std::fs::write(d.join("state"), b"s").unwrap();
        }
        let mode = |p: &Path| std::fs::symlink_metadata(p).unwrap().mode() & 0o7777;
        let set = |p: &Path, m: u32| {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap()
        };
        set(&victim, 0o700);
        set(&victim.join("state"), 0o600);
        std::os::unix::fs::lchown(&victim, Some(4242), Some(4242)).unwrap();
        set(&layer, 0o700);
        set(&layer.join("state"), 0o600);
        walk(&data, &layer, Walk::Seal).unwrap();
        assert_eq!((mode(&layer), mode(&layer.join("state"))), (0o755, 0o644));

        let untouched = |what: &str| {
            let m = std::fs::symlink_metadata(&victim).unwrap();
            assert_eq!((m.uid(), m.mode() & 0o7777), (4242, 0o700), "{what}");
            assert_eq!(mode(&victim.join("state")), 0o600, "{what}");
        };
        // A link as the layer, on the way to it, or inside it.
        std::os::unix::fs::symlink(&victim, mine.join("link")).unwrap();
        let e = walk(&data, &mine.join("link"), Walk::Seal).unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");
        untouched("a linked layer");
        std::os::unix::fs::symlink(data.join("sandboxes/victim"), mine.join("sub")).unwrap();
        assert!(walk(&data, &mine.join("sub/snap-1"), Walk::Seal).is_err());
        untouched("a link on the way");
        std::os::unix::fs::symlink(victim.join("state"), layer.join("memory")).unwrap();
        let e = walk(&data, &layer, Walk::Seal).unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");
        untouched("a link inside the layer");
        // `..`, or a path outside the data directory.
        let dotted = PathBuf::from(format!("{}/../victim/snap-1", mine.display()));
        assert!(walk(&data, &dotted, Walk::Seal).is_err());
        untouched("a dotted path");
        assert!(walk(&data, Path::new("/etc"), Walk::Seal).is_err());
        assert!(walk(&data, &data, Walk::Seal).is_err());
    }

    /// A start seals only inside its VMM's own directory: a read-only
    /// expose outside it is checked and left exactly as it is (owner,
    /// mode, change time), one that is not sealed fails the start naming
    /// it, and nothing outside is made writable; [`Jails::seal_shared`] is
    /// what seals a layer as it becomes shared. Needs root (it chowns).
    #[test]
    fn a_start_changes_nothing_outside_its_own_directory() {
        // SAFETY: geteuid cannot fail.
        assert_eq!(unsafe { libc::geteuid() }, 0, "sealing chowns: needs root");
        let scratch = tempfile::tempdir().unwrap();
        let data = std::fs::canonicalize(scratch.path()).unwrap();
        let config = JailConfig {
            uid_base: 300_000,
            uids: 2,
            sandbox_memory_max_mib: None,
        };
        let jails = Jails::new(&data, config).unwrap();
        let own = data.join("sandboxes/fork");
        let mine = own.join("snap-1");
        let shared = data.join("sandboxes/source/ckpt-a");
        let set = |p: &Path, m: u32| {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap()
        };
        for d in [&mine, &shared] {
            std::fs::create_dir_all(d).unwrap();
            std::fs::write(d.join("state"), b"s").unwrap();
            set(d, 0o700);
            set(&d.join("state"), 0o600);
        }
        std::os::unix::fs::lchown(&mine, Some(4242), Some(4242)).unwrap();
        let stamp = |p: &Path| {
            let m = std::fs::symlink_metadata(p).unwrap();
            let mode = m.mode() & 0o7777;
            (m.uid(), m.gid(), mode, m.ctime(), m.ctime_nsec())
        };
        let stamps = || [&shared, &shared.join("state")].map(|p| stamp(p));
        let exposes = [
            Expose::read_write(&own),
            Expose::read_only(&mine),
            Expose::read_only(&shared),
        ];
        // Not sealed yet: refused, untouched.
        let before = stamps();
        let e = jails.prepare(300_001, Some(&own), &exposes).unwrap_err();
        assert!(e.to_string().contains("not sealed"), "{e}");
        assert_eq!(stamps(), before);
        // Sealed as it is shared; then sealed differently (read-only to
        // all): a start changes nothing of it.
        jails.seal_shared(std::slice::from_ref(&shared)).unwrap();
        assert_eq!(stamp(&shared).2, 0o755);
        assert_eq!(stamp(&shared.join("state")).2, 0o644);
        set(&shared, 0o555);
        set(&shared.join("state"), 0o444);
        let before = stamps();
        jails.prepare(300_001, Some(&own), &exposes).unwrap();
        assert_eq!(stamps(), before);
        // Its own layer is sealed, its own directory its uid's.
        assert_eq!((stamp(&mine).0, stamp(&mine).2), (0, 0o755));
        assert_eq!(stamp(&mine.join("state")).2, 0o644);
        assert_eq!((stamp(&own).0, stamp(&own).2), (300_001, 0o700));
        // Another owner, or writable by others: refused, untouched.
        type Unseal = fn(&Path);
        let unseals: [(&str, Unseal); 3] = [
            ("owner", |p| {
                std::os::unix::fs::lchown(p.join("state"), Some(4242), None).unwrap()
            }),
            ("file mode", |p| {
                std::fs::set_permissions(p.join("state"), std::fs::Permissions::from_mode(0o666))
                    .unwrap()
            }),
            ("directory mode", |p| {
                std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o777)).unwrap()
            }),
        ];
        for (what, unseal) in unseals {
            jails.seal_shared(std::slice::from_ref(&shared)).unwrap();
            unseal(&shared);
            let before = stamps();
            let e = jails.prepare(300_001, Some(&own), &exposes).unwrap_err();
            let ServiceError::Vm(vm) = &e else {
                panic!("{what}: {e:?}")
            };
            assert_eq!(vm.kind, torpor_vmm_api::ErrorKind::BadSnapshot, "{what}");
            assert!(vm.layer.as_deref().is_some_and(|l| l.starts_with(&shared)));
            assert_eq!(stamps(), before, "{what}");
        }
        // Nothing outside its own directory is made writable for it.
        jails.seal_shared(std::slice::from_ref(&shared)).unwrap();
        let before = stamps();
        let writable = [Expose::read_write(&shared)];
        assert!(jails.prepare(300_001, Some(&own), &writable).is_err());
        assert_eq!(stamps(), before);
    }
}
