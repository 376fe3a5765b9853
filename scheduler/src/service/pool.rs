//! The pod's pool of standby VMM shells: VMs made ahead of time (KVM VM,
//! vCPUs, memory slots: the costly part of a restore here) per (memory,
//! vCPUs) shape its templates use, refilled in the background. A create
//! or a wake takes a shell when one is there and hands it the snapshot in
//! one control request; else it pays for a cold `torpor-vmm` restore.
//!
//! Shells are named by a counter that is never reused (`shell-P-N/`, its
//! control socket and log inside): a shell's VMM removes the socket path
//! it was started with when it ends, and must not remove a later shell's.
//!
//! Jailed, a shell is jailed generically when it is made (its uid, cgroup
//! sized for its shape, namespaces, devices, its own directory as the only
//! path it sees), which is the costly part; when it is taken, the pod
//! mounts the sandbox's directory and snapshot layers into its jail (see
//! `jail::inject`), then sends the restore.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use torpor_sync::{Locked, Waited};
use torpor_vmm_api::control::{self, Request};
use torpor_vmm_api::jail::Expose;
use torpor_vmm_api::launch::{DirtyTracking, LaunchMode, LaunchSpec, MemoryBackend};

use super::jail::Jails;
use super::vmm;
use super::ServiceError;
use crate::model::VmmHandle;

/// A guest shape: memory MiB and vCPUs.
pub type Shape = (u32, u32);

/// A shell waiting for a restore.
#[derive(Debug)]
pub struct Shell {
    pub child: Child,
    pub handle: VmmHandle,
    pub log: PathBuf,
    /// The jail's uid (None: unjailed).
    pub uid: Option<u32>,
}

/// The pool; `target` shells per wanted shape (0: no pool).
#[derive(Debug)]
pub struct StandbyPool {
    dir: PathBuf,
    exe: PathBuf,
    target: usize,
    /// Shells are made for one dirty-tracking source (their KVM slots log
    /// or not), the pod's.
    dirty_tracking: DirtyTracking,
    /// The pod's jails and memory backend (`uffd-shared` shells see
    /// `/dev/shm`).
    jail: Option<(Arc<Jails>, MemoryBackend)>,
    next: AtomicU64,
    state: Mutex<PoolState>,
    /// Wakes the refill thread: a shell was taken, a shape is wanted, or
    /// the pool stops.
    changed: Condvar,
}

#[derive(Default, Debug)]
struct PoolState {
    shells: HashMap<Shape, Vec<Shell>>,
    wanted: Vec<Shape>,
    stopped: bool,
    /// Restores into shells in progress ([`StandbyPool::restoring`]): a
    /// shape that still has a shell is refilled once they are done, so
    /// making a shell (fork, exec, a KVM VM) does not take the CPU the
    /// restore it was taken for needs.
    restoring: usize,
    /// Shells made and taken, for metrics.
    made: u64,
    taken: u64,
    missed: u64,
}

/// Counts for metrics.
#[derive(Debug, Clone, Copy, Default)]
pub struct PoolStats {
    pub ready: usize,
    pub made: u64,
    pub taken: u64,
    pub missed: u64,
}

impl StandbyPool {
    /// A pool of `target` shells per shape in `dir`, started with `exe`.
    /// Shells left by an earlier run of the service are stopped first.
    pub fn new(
        dir: PathBuf,
        exe: PathBuf,
        target: usize,
        dirty_tracking: DirtyTracking,
        jail: Option<(Arc<Jails>, MemoryBackend)>,
    ) -> Result<Arc<Self>, ServiceError> {
        std::fs::create_dir_all(&dir)
            .map_err(|e| ServiceError::Internal(format!("create the standby pool dir: {e}")))?;
        clear_stale(&dir);
        Ok(Arc::new(Self {
            dir,
            exe,
            target,
            dirty_tracking,
            jail,
            next: AtomicU64::new(0),
            state: Mutex::new(PoolState::default()),
            changed: Condvar::new(),
        }))
    }

    pub fn enabled(&self) -> bool {
        self.target > 0
    }

    fn state(&self) -> std::sync::MutexGuard<'_, PoolState> {
        self.state.locked()
    }

    /// Keeps shells of `shape` from now on.
    pub fn want(&self, shape: Shape) {
        if !self.enabled() {
            return;
        }
        let mut st = self.state();
        if !st.wanted.contains(&shape) {
            st.wanted.push(shape);
            self.changed.notify_all();
        }
    }

    /// A live shell of `shape`, if one is ready, with a guard that holds
    /// back the refill of shapes that still have shells until it drops
    /// (when the restore into the shell is done).
    pub fn take(&self, shape: Shape) -> Option<(Shell, Restoring<'_>)> {
        if !self.enabled() {
            return None;
        }
        let mut st = self.state();
        let shell = loop {
            match st.shells.get_mut(&shape).and_then(Vec::pop) {
                // One that died meanwhile is dropped (reaped) and skipped.
                Some(mut s) => {
                    if matches!(s.child.try_wait(), Ok(None)) {
                        break Some(s);
                    }
                    remove_shell_dir(&s.handle);
                }
                None => break None,
            }
        };
        if shell.is_some() {
            st.taken += 1;
            st.restoring += 1;
        } else {
            st.missed += 1;
        }
        self.changed.notify_all();
        shell.map(|s| (s, Restoring(self)))
    }

    pub fn stats(&self) -> PoolStats {
        let st = self.state();
        PoolStats {
            ready: st.shells.values().map(Vec::len).sum(),
            made: st.made,
            taken: st.taken,
            missed: st.missed,
        }
    }

    /// Starts the refill thread (nothing when the pool is off).
    pub fn start(self: &Arc<Self>) {
        if !self.enabled() {
            return;
        }
        let pool = self.clone();
        let spawned = std::thread::Builder::new()
            .name("standby-pool".into())
            .spawn(move || pool.refill_loop());
        if let Err(e) = spawned {
            tracing::error!("cannot start the standby pool: {e}");
        }
    }

    /// Stops refilling and ends every waiting shell.
    pub fn stop(&self) {
        let shells: Vec<Shell> = {
            let mut st = self.state();
            st.stopped = true;
            self.changed.notify_all();
            st.shells.drain().flat_map(|(_, v)| v).collect()
        };
        for s in shells {
            vmm::stop(&s.handle, Some(s.child));
            remove_shell_dir(&s.handle);
        }
    }

    fn refill_loop(&self) {
        let mut failures = 0u32;
        loop {
            let need = {
                let mut st = self.state();
                loop {
                    if st.stopped {
                        return;
                    }
                    // An empty shape at once (its next restore would be
                    // cold); one that still has a shell once no restore
                    // into a shell is in progress.
                    let ready = |s: &Shape| st.shells.get(s).map_or(0, Vec::len);
                    let short = st
                        .wanted
                        .iter()
                        .copied()
                        .filter(|s| ready(s) < self.target)
                        .find(|s| ready(s) == 0 || st.restoring == 0);
                    match short {
                        Some(shape) => break shape,
                        None => {
                            st = self
                                .changed
                                .wait_timeout_locked(st, Duration::from_secs(5))
                                .0
                        }
                    }
                }
            };
            match self.make(need) {
                Ok(shell) => {
                    failures = 0;
                    let mut st = self.state();
                    if st.stopped {
                        drop(st);
                        vmm::stop(&shell.handle, Some(shell.child));
                        return;
                    }
                    st.made += 1;
                    st.shells.entry(need).or_default().push(shell);
                }
                Err(e) => {
                    // A host that cannot make shells (out of memory, no
                    // KVM) must not be hammered: back off, creates go cold.
                    failures += 1;
                    tracing::warn!(shape = ?need, "cannot make a standby shell: {e}");
                    std::thread::sleep(Duration::from_millis(100 << failures.min(6)));
                }
            }
        }
    }

    fn make(&self, (mem_mib, vcpus): Shape) -> Result<Shell, ServiceError> {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let dir = self.dir.join(format!("shell-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir)
            .map_err(|e| ServiceError::Internal(format!("create {}: {e}", dir.display())))?;
        let socket = dir.join("ctl.sock");
        let log = dir.join("vmm.log");
        let spec = LaunchSpec {
            control_socket: Some(socket),
            mode: LaunchMode::Standby {
                mem_mib: u64::from(mem_mib),
                vcpus: u16::try_from(vcpus).unwrap_or(u16::MAX),
            },
            console: Default::default(),
            dirty_tracking: self.dirty_tracking,
            jail: None,
            seccomp: torpor_vmm_api::SeccompLevel::Enforce,
        };
        let extra = match &self.jail {
            Some((_, MemoryBackend::UffdShared)) => {
                vec![Expose::read_only(torpor_vmm_api::shmem::SHM_DIR)]
            }
            _ => Vec::new(),
        };
        let spawned = super::jail::spawn(
            self.jail.as_ref().map(|(j, _)| j.as_ref()),
            &self.exe,
            spec,
            &log,
            (u64::from(mem_mib), u64::from(vcpus)),
            &extra,
            None,
        );
        let (spawned, uid) = match spawned {
            Ok(s) => s,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(e);
            }
        };
        Ok(Shell {
            child: spawned.child,
            handle: spawned.handle,
            log,
            uid,
        })
    }
}

/// A restore into a shell from [`StandbyPool::take`] in progress.
#[derive(Debug)]
pub struct Restoring<'a>(&'a StandbyPool);

impl Drop for Restoring<'_> {
    fn drop(&mut self) {
        let mut st = self.0.state();
        st.restoring = st.restoring.saturating_sub(1);
        self.0.changed.notify_all();
    }
}

impl Drop for StandbyPool {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A shell's own directory, once it is gone.
fn remove_shell_dir(handle: &VmmHandle) {
    if let Some(dir) = handle.control_socket.parent() {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// Ends shells an earlier run left (they wait for a restore that will not
/// come) and removes their files. An unjailed shell dies with the pod
/// that made it until a restore reaches it, a jailed one does not (its
/// parent is its supervisor, which lives on); and one taken for a restore whose pod died
/// between moving its socket and its log into the sandbox's directory
/// (see `restore_into_shell`) has no socket here to be asked to shut down
/// and no log where recovery looks (`sandboxes/`). So each is found by its
/// log here, as recovery finds strays, and killed; then the request to
/// shut down, for any the search missed.
fn clear_stale(dir: &Path) {
    for p in vmm::logging_under(dir) {
        tracing::warn!(pid = p.pid, log = %p.log.display(), "a standby shell of an earlier run: ending it");
        if !vmm::kill_and_wait(p.pid, p.start_time, Duration::from_secs(5)) {
            tracing::warn!(pid = p.pid, "the standby shell did not exit within 5 s");
        }
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let socket = path.join("ctl.sock");
        if socket.exists() {
            let _ = control::request(&socket, &Request::Shutdown, Duration::from_secs(1));
        }
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            let _ = std::fs::remove_dir_all(&path);
        } else {
            let _ = std::fs::remove_file(&path);
        }
    }
}
