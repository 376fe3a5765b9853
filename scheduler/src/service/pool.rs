//! The pod's pool of standby VMM shells: VMs made ahead of time (KVM VM,
//! vCPUs, memory slots: the costly part of a restore here) per (memory,
//! vCPUs) shape its templates use, refilled in the background. A create
//! or a wake takes a shell when one is there and hands it the snapshot in
//! one control request; else it pays for a cold `torpor-vmm` restore.
//!
//! Sized to bursts: each shape keeps [`PoolConfig::min`] shells, and as
//! many as the most creates and wakes of that shape that asked within one
//! second ([`Demand`]) up to [`PoolConfig::max`], for [`PoolConfig::idle`]
//! after that peak; then it shrinks back to `min` (the shells beyond are
//! stopped). Growth past `min` never exceeds what the pod could still
//! admit of that shape (its memory x oversubscription ratio less what is
//! committed) and stops while its resident memory is above the high mark
//! ([`super::Service::standby_room`]). Refills run on
//! [`PoolConfig::refill_threads`] threads at once (one per core by
//! default), never held off by restores in progress.
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

use super::vmm_process::VmmChild;
use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use torpor_sync::{Locked, Waited};
use torpor_vmm_api::control::{self, Request};
use torpor_vmm_api::jail::Expose;
use torpor_vmm_api::launch::{
    Console, DirtyTracking, LaunchMode, LaunchSpec, MemoryBackend, RestoreSpec,
};

use super::jail::Jails;
use super::vmm::{self, VmmFiles};
use super::{Service, ServiceError, LOCAL_POD};
use crate::model::{PodId, VmmHandle};

/// A guest shape: memory MiB and vCPUs.
pub type Shape = (u32, u32);

/// Most shells per shape unless configured.
pub const DEFAULT_MAX: usize = 64;
/// How long a burst keeps the pool grown unless configured.
pub const DEFAULT_IDLE_MS: u64 = 60_000;
/// Demand is counted over this window: the burst a pool sizes itself to.
pub const DEMAND_WINDOW: Duration = Duration::from_secs(1);
/// How long the pod's room for growth is reused before it is asked again.
const ROOM_REUSE: Duration = Duration::from_millis(100);

/// How the pool sizes and refills itself (`serve --standby-pool`,
/// `--standby-pool-max`, `--standby-pool-idle-ms`,
/// `--standby-refill-threads`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolConfig {
    /// Shells kept per shape when idle; 0 turns the pool off.
    pub min: usize,
    /// Most shells per shape a burst grows it to (at least `min`).
    pub max: usize,
    /// How long after its largest burst a shape keeps room for one as
    /// large; then it shrinks back to `min`.
    pub idle: Duration,
    /// Shells made at once (0: one per core).
    pub refill_threads: usize,
}

impl PoolConfig {
    /// A pool of `min` shells per shape, growing to [`DEFAULT_MAX`].
    pub fn new(min: usize) -> Self {
        Self {
            min,
            max: DEFAULT_MAX,
            idle: Duration::from_millis(DEFAULT_IDLE_MS),
            refill_threads: 0,
        }
    }

    /// Refill threads: as configured, else one per core (at most 8).
    fn threads(&self) -> usize {
        match self.refill_threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get().min(8)),
            n => n,
        }
    }

    /// The shells a shape keeps: `min`, grown to what `wanted` (its
    /// demand) asks up to `max` and to `room` (what the pod could admit).
    pub fn target(&self, wanted: usize, room: usize) -> usize {
        if self.min == 0 {
            return 0;
        }
        self.min.max(wanted.min(self.max).min(room))
    }
}

/// Creates and wakes of one shape asking for shells: how many asked
/// within the last [`DEMAND_WINDOW`], and the most that did (the peak),
/// remembered for `idle` after it was last reached.
#[derive(Debug, Default, Clone)]
pub struct Demand {
    recent: VecDeque<Instant>,
    peak: usize,
    peak_at: Option<Instant>,
}

impl Demand {
    /// One create or wake asked at `now`.
    pub fn ask(&mut self, now: Instant) {
        self.trim(now);
        self.recent.push_back(now);
        if self.recent.len() >= self.peak {
            self.peak = self.recent.len();
            self.peak_at = Some(now);
        }
    }

    /// The shells the demand asks for at `now`: the peak, or once it is
    /// older than `idle`, what asked within the window.
    pub fn wanted(&mut self, now: Instant, idle: Duration) -> usize {
        self.trim(now);
        if self
            .peak_at
            .is_some_and(|at| now.saturating_duration_since(at) > idle)
        {
            self.peak = self.recent.len();
            self.peak_at = (self.peak > 0).then_some(now);
        }
        self.peak
    }

    fn trim(&mut self, now: Instant) {
        while self
            .recent
            .front()
            .is_some_and(|t| now.saturating_duration_since(*t) > DEMAND_WINDOW)
        {
            self.recent.pop_front();
        }
    }
}

/// A shell waiting for a restore.
#[derive(Debug)]
pub struct Shell {
    pub child: VmmChild,
    pub handle: VmmHandle,
    pub log: PathBuf,
    /// The jail's uid (None: unjailed).
    pub uid: Option<u32>,
}

impl Shell {
    /// Hands a standby shell the sandbox's files and snapshot: its socket and
    /// log move into the sandbox's directory (the open files follow), then one
    /// `restore` request. A shell that refuses is stopped.
    pub(super) fn restore_into(
        self,
        files: &VmmFiles,
        restore: &RestoreSpec,
    ) -> Result<(VmmChild, VmmHandle, u64), ServiceError> {
        let Shell {
            child,
            handle: shell_handle,
            log,
            uid: _,
        } = self;
        let moved = std::fs::rename(&shell_handle.control_socket, &files.socket)
            .and_then(|()| std::fs::rename(&log, &files.log));
        if let Some(shell_dir) = shell_handle.control_socket.parent() {
            // Empty now; in the shell's jail the mount goes with it.
            let _ = std::fs::remove_dir(shell_dir);
        }
        let handle = VmmHandle {
            pid: shell_handle.pid,
            start_time: shell_handle.start_time,
            control_socket: files.socket.clone(),
        };
        if let Err(e) = moved {
            vmm::stop(&shell_handle, Some(child));
            let _ = std::fs::remove_file(&files.socket);
            return Err(ServiceError::Internal(format!(
                "move the shell's files: {e}"
            )));
        }
        let req = Request::Restore {
            restore: restore.clone(),
            console: Console::file(&files.console),
            paused: false,
        };
        match vmm::call(&handle, &req) {
            Ok(answer) => {
                let us = answer.restore.map_or(0, |r| r.request_to_running_us);
                Ok((child, handle, us))
            }
            Err(e) => {
                vmm::stop(&handle, Some(child));
                Err(e)
            }
        }
    }
}

/// How many more sandboxes of a shape the pod has room for (its
/// admission and memory pressure), installed by the service.
type Room = Box<dyn Fn(Shape) -> usize + Send + Sync>;

/// The pool; see the module documentation.
pub struct StandbyPool {
    dir: PathBuf,
    exe: PathBuf,
    config: PoolConfig,
    /// Shells are made for one dirty-tracking source (their KVM slots log
    /// or not), the pod's.
    dirty_tracking: DirtyTracking,
    /// The pod's jails and memory backend (`uffd-shared` shells see
    /// `/dev/shm`).
    jail: Option<(Arc<Jails>, MemoryBackend)>,
    room: OnceLock<Room>,
    next: AtomicU64,
    state: Mutex<PoolState>,
    /// Wakes the refill threads: a shell was taken, a shape is wanted, or
    /// the pool stops.
    changed: Condvar,
}

impl std::fmt::Debug for StandbyPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StandbyPool")
            .field("dir", &self.dir)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

#[derive(Default, Debug)]
struct PoolState {
    shells: HashMap<Shape, Vec<Shell>>,
    wanted: Vec<Shape>,
    demand: HashMap<Shape, Demand>,
    /// Shells being made, per shape.
    making: HashMap<Shape, usize>,
    /// The pod's room per shape, and when it was asked.
    room: HashMap<Shape, usize>,
    room_at: Option<Instant>,
    stopped: bool,
    /// Shells made, taken, missed and stopped as surplus, for metrics.
    made: u64,
    taken: u64,
    missed: u64,
    shrunk: u64,
    /// The sum of the shapes' targets when last computed.
    target: usize,
}

impl PoolState {
    fn ready(&self, shape: &Shape) -> usize {
        self.shells.get(shape).map_or(0, Vec::len)
    }

    /// The target of `shape` now.
    fn target(&mut self, shape: Shape, config: &PoolConfig, now: Instant) -> usize {
        let wanted = self
            .demand
            .get_mut(&shape)
            .map_or(0, |d| d.wanted(now, config.idle));
        let room = self.room.get(&shape).copied().unwrap_or(0);
        config.target(wanted, room)
    }
}

/// Counts for metrics.
#[derive(Debug, Clone, Copy, Default)]
pub struct PoolStats {
    pub ready: usize,
    /// Shells the pool aims at now, all shapes.
    pub target: usize,
    /// Shells being made now.
    pub making: usize,
    pub made: u64,
    pub taken: u64,
    pub missed: u64,
    /// Shells stopped as the pool shrank.
    pub shrunk: u64,
}

/// What a refill thread does next.
enum Next {
    Make(Shape),
    Shrink(Shell),
}

impl StandbyPool {
    /// A pool configured by `config` in `dir`, its shells started with
    /// `exe`. Shells left by an earlier run of the service are stopped
    /// first.
    pub fn new(
        dir: PathBuf,
        exe: PathBuf,
        mut config: PoolConfig,
        dirty_tracking: DirtyTracking,
        jail: Option<(Arc<Jails>, MemoryBackend)>,
    ) -> Result<Arc<Self>, ServiceError> {
        std::fs::create_dir_all(&dir)
            .map_err(|e| ServiceError::Internal(format!("create the standby pool dir: {e}")))?;
        clear_stale(&dir);
        config.max = config.max.max(config.min);
        Ok(Arc::new(Self {
            dir,
            exe,
            config,
            dirty_tracking,
            jail,
            room: OnceLock::new(),
            next: AtomicU64::new(0),
            state: Mutex::new(PoolState::default()),
            changed: Condvar::new(),
        }))
    }

    pub fn enabled(&self) -> bool {
        self.config.min > 0
    }

    /// Installs how the pool learns the pod's room for growth (none: it
    /// never grows past `min`).
    pub fn set_room(&self, room: Room) {
        let _ = self.room.set(room);
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

    /// A live shell of `shape`, if one is ready. Hit or miss, the ask
    /// counts in the shape's demand.
    pub fn take(&self, shape: Shape) -> Option<Shell> {
        if !self.enabled() {
            return None;
        }
        let mut st = self.state();
        st.demand.entry(shape).or_default().ask(Instant::now());
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
        } else {
            st.missed += 1;
        }
        self.changed.notify_all();
        shell
    }

    pub fn stats(&self) -> PoolStats {
        let st = self.state();
        PoolStats {
            ready: st.shells.values().map(Vec::len).sum(),
            target: st.target,
            making: st.making.values().sum(),
            made: st.made,
            taken: st.taken,
            missed: st.missed,
            shrunk: st.shrunk,
        }
    }

    /// Starts the refill threads (none when the pool is off).
    pub fn start(self: &Arc<Self>) {
        if !self.enabled() {
            return;
        }
        for i in 0..self.config.threads() {
            let pool = self.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("standby-pool-{i}"))
                .spawn(move || pool.refill_loop());
            if let Err(e) = spawned {
                tracing::error!("cannot start a standby pool thread: {e}");
            }
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
            end_shell(s);
        }
    }

    /// Asks the pod for its room per wanted shape, at most every
    /// [`ROOM_REUSE`] (outside the pool's lock: it reads the store).
    fn refresh_room(&self) {
        let shapes = {
            let st = self.state();
            if st.room_at.is_some_and(|at| at.elapsed() < ROOM_REUSE) {
                return;
            }
            st.wanted.clone()
        };
        let rooms: HashMap<Shape, usize> = match self.room.get() {
            Some(room) => shapes.iter().map(|s| (*s, room(*s))).collect(),
            None => HashMap::new(),
        };
        let mut st = self.state();
        st.room = rooms;
        st.room_at = Some(Instant::now());
    }

    /// The next thing to do, waiting until there is one; None once the
    /// pool stops. An empty shape first, then any below its target; a
    /// shell above its shape's target is stopped.
    fn next(&self) -> Option<Next> {
        loop {
            self.refresh_room();
            let mut st = self.state();
            if st.stopped {
                return None;
            }
            let now = Instant::now();
            let shapes = st.wanted.clone();
            let mut short = None;
            let mut total = 0;
            for shape in shapes {
                let target = st.target(shape, &self.config, now);
                total += target;
                let ready = st.ready(&shape);
                let have = ready + st.making.get(&shape).copied().unwrap_or(0);
                if ready > target {
                    if let Some(s) = st.shells.get_mut(&shape).and_then(|v| v.pop()) {
                        st.shrunk += 1;
                        return Some(Next::Shrink(s));
                    }
                }
                if have < target && short.is_none_or(|(_, h)| have < h) {
                    short = Some((shape, have));
                }
            }
            st.target = total;
            if let Some((shape, _)) = short {
                *st.making.entry(shape).or_default() += 1;
                return Some(Next::Make(shape));
            }
            // Woken by a take, a new shape or the stop; and every so often
            // for the demand to age (the shrink).
            let _ = self.changed.wait_timeout_locked(
                st,
                ROOM_REUSE
                    .max(self.config.idle / 10)
                    .min(Duration::from_secs(5)),
            );
        }
    }

    fn refill_loop(&self) {
        let mut failures = 0u32;
        while let Some(next) = self.next() {
            let need = match next {
                Next::Shrink(shell) => {
                    end_shell(shell);
                    continue;
                }
                Next::Make(shape) => shape,
            };
            let made = self.make(need);
            let mut st = self.state();
            if let Some(n) = st.making.get_mut(&need) {
                *n = n.saturating_sub(1);
            }
            match made {
                Ok(shell) => {
                    failures = 0;
                    if st.stopped {
                        drop(st);
                        end_shell(shell);
                        return;
                    }
                    st.made += 1;
                    st.shells.entry(need).or_default().push(shell);
                }
                Err(e) => {
                    drop(st);
                    // A host that cannot make shells (out of memory, no
                    // KVM, no uid left) must not be hammered: back off,
                    // creates go cold.
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

impl Drop for StandbyPool {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Stops a shell and removes its directory.
fn end_shell(s: Shell) {
    vmm::stop(&s.handle, Some(s.child));
    remove_shell_dir(&s.handle);
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
/// (see [`Shell::restore_into`]) has no socket here to be asked to shut down
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

impl Service {
    /// How many more sandboxes of `shape` the local pod has room for: what
    /// admission would still let in (memory x oversubscription ratio less
    /// what is committed), none while its resident memory (as the
    /// pressure gate last measured it) is above the high mark. What the
    /// standby pool may grow to past its minimum.
    pub(super) fn standby_room(&self, (mem_mib, _): Shape) -> usize {
        let Ok(pod) = self.store.get_pod(&PodId::new(LOCAL_POD)) else {
            return 0;
        };
        if let Some(resident) = self.last_resident_bytes() {
            if crate::policy::pressure(pod.memory_bytes, pod.high_watermark, resident)
                != crate::policy::Pressure::Normal
            {
                return 0;
            }
        }
        let Ok(committed) = self.store.committed_mib() else {
            return 0;
        };
        let limit = (pod.memory_bytes >> 20) as f64 * pod.oversubscription_ratio;
        let free = (limit - committed as f64).max(0.0);
        (free / f64::from(mem_mib.max(1))) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// A burst of 50 grows the target to 50 (within `max` and the room),
    /// it stays while the burst is recent, and falls back to `min` once
    /// the pool has been idle for `idle`.
    #[test]
    fn the_target_grows_with_a_burst_and_shrinks_when_idle() {
        let config = PoolConfig {
            min: 4,
            max: 64,
            idle: Duration::from_secs(10),
            refill_threads: 0,
        };
        let t0 = Instant::now();
        let mut d = Demand::default();
        assert_eq!(config.target(d.wanted(t0, config.idle), 1000), 4);
        for i in 0..50 {
            d.ask(t0 + i * MS);
        }
        let t1 = t0 + 50 * MS;
        assert_eq!(config.target(d.wanted(t1, config.idle), 1000), 50);
        // Quiet, within `idle`: the pool stays ready for another.
        assert_eq!(d.wanted(t1 + Duration::from_secs(9), config.idle), 50);
        // Idle past it: back to the minimum.
        let t2 = t1 + Duration::from_secs(11);
        assert_eq!(config.target(d.wanted(t2, config.idle), 1000), 4);
        // A steady trickle (one every 300 ms) asks for no more than 4.
        for i in 0..20 {
            d.ask(t2 + i * 300 * MS);
        }
        assert!(d.wanted(t2 + 20 * 300 * MS, config.idle) <= 4);
    }

    /// Growth stops at `max` and at the pod's room; `min` is kept even
    /// without room; a pool of 0 stays off.
    #[test]
    fn the_target_stays_within_max_and_the_pods_room() {
        let config = PoolConfig {
            min: 2,
            max: 16,
            idle: Duration::from_secs(60),
            refill_threads: 0,
        };
        assert_eq!(config.target(100, 1000), 16);
        assert_eq!(config.target(100, 10), 10);
        assert_eq!(config.target(100, 0), 2);
        assert_eq!(config.target(1, 1000), 2);
        let off = PoolConfig { min: 0, ..config };
        assert_eq!(off.target(100, 1000), 0);
    }
}
