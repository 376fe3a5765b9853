//! Each running sandbox's resource use over time: a bounded history per
//! sandbox ([`MAX_SAMPLES`] samples, one every [`SAMPLE_INTERVAL_MS`] by
//! default: the last two hours), taken by the history thread from what
//! the pod already measures (its VMM's CPU time in `/proc/PID/stat`, the
//! guest's balloon statistics or the VMM's PSS) and, for a Linux guest,
//! its root filesystem's use as its agent's `statfs` says (within
//! [`DISK_LIMIT`], clamped to the disk's size; else the template's rootfs
//! size).
//! Read by `GET /v1/sandboxes/{id}/metrics` and E2B's
//! `GET /sandboxes/{id}/metrics`. In memory only: a restarted service
//! starts every history again, and a deleted sandbox's goes with it.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::guest::{AgentLink, FsStats, VSOCK_FILE};
use super::{vmm, Service, ServiceError};
use crate::model::{Sandbox, SandboxId, TemplateKind, Timestamp, VmmHandle};
use crate::state::SandboxState;
use crate::store::SandboxFilter;
use torpor_sync::Locked;

/// How often the history thread samples every running sandbox, in ms.
pub const SAMPLE_INTERVAL_MS: u64 = 5_000;
/// Samples kept per sandbox (the oldest go first).
pub const MAX_SAMPLES: usize = 1440;
/// Longest a sample waits for the guest's disk use (the agent's `statfs`:
/// connection, greeting and answer), so that a slow or hostile guest
/// cannot hold up the sampling of the others.
pub const DISK_LIMIT: Duration = Duration::from_millis(500);
/// Of [`DISK_LIMIT`], the longest a sample waits for the sandbox's lock
/// (an operation working on it holds it).
const DISK_LOCK_WAIT: Duration = Duration::from_millis(100);
/// A guest's disk use is read at most this often (ms); the samples in
/// between repeat the last reading. Every read is an agent connection that
/// wakes the guest, and a filesystem's use moves slowly: once a minute
/// keeps an idle sandbox idle.
pub const DISK_EVERY_MS: i64 = 60_000;
/// A sandbox's failed disk reads are logged at most this often (ms).
const DISK_WARN_EVERY_MS: i64 = 60_000;
/// After a disk read that failed slowly (it took half of [`DISK_LIMIT`]
/// or more: a guest that does not answer), that sandbox's samples do not
/// ask again for this long (ms), so that such a guest costs the sampler
/// [`DISK_LIMIT`] once in a while, not at every sample.
const DISK_RETRY_MS: i64 = 30_000;

/// One sample of a sandbox's resource use.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct MetricSample {
    /// When it was taken (ms since the epoch).
    #[schema(value_type = i64)]
    pub at: Timestamp,
    /// The sandbox's vCPUs.
    pub cpu_count: u32,
    /// CPU its VMM used since the previous sample (the first: since it
    /// started) ÷ that time ÷ its vCPUs, percent.
    pub cpu_used_pct: f64,
    /// What the guest says it uses (its balloon's statistics), else what
    /// its VMM holds on the host (PSS).
    pub mem_used_bytes: u64,
    /// The sandbox's memory.
    pub mem_total_bytes: u64,
    /// What the guest's root filesystem uses (its agent's `statfs("/")`:
    /// total less free); without an answer (no agent, an agent before
    /// protocol 1.4, a failure or the time limit) the template's rootfs
    /// size, as the total.
    pub disk_used_bytes: u64,
    /// The guest's root filesystem's size (at most the disk's on the
    /// host); without an answer, the template's rootfs size.
    pub disk_total_bytes: u64,
}

/// What one sandbox's history keeps besides its samples: the VMM's CPU
/// time at the last sample, to make the next one a rate.
#[derive(Debug, Default)]
struct Series {
    samples: VecDeque<MetricSample>,
    /// (pid, CPU seconds, when) at the last sample.
    last_cpu: Option<(u32, f64, Timestamp)>,
    /// The VMM (pid) whose agent answered `statfs` with `ENOSYS`: not
    /// asked again while that VMM runs.
    statfs_unsupported: Option<u32>,
    /// When a failed disk read was last logged.
    disk_warned_at: Option<Timestamp>,
    /// No disk read before then (a guest that did not answer in time).
    disk_retry_at: Option<Timestamp>,
    /// The last reading of the guest's disk (used, total) and when.
    disk_read: Option<((u64, u64), Timestamp)>,
}

/// The histories of the pod's sandboxes.
#[derive(Debug)]
pub struct History {
    capacity: usize,
    series: Mutex<HashMap<SandboxId, Series>>,
}

impl Default for History {
    fn default() -> Self {
        Self::new(MAX_SAMPLES)
    }
}

impl History {
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            series: Mutex::default(),
        }
    }

    /// Appends `sample` to `id`'s history (kept in time order: one older
    /// than the newest is dropped), forgetting its oldest past capacity.
    pub fn record(&self, id: &SandboxId, sample: MetricSample) {
        let mut all = self.series.locked();
        let series = all.entry(id.clone()).or_default();
        if series.samples.back().is_some_and(|l| l.at > sample.at) {
            return;
        }
        if series.samples.len() == self.capacity {
            series.samples.pop_front();
        }
        series.samples.push_back(sample);
    }

    /// `id`'s samples taken from `from` to `to` (both included; either
    /// open), oldest first.
    pub fn range(
        &self,
        id: &SandboxId,
        from: Option<Timestamp>,
        to: Option<Timestamp>,
    ) -> Vec<MetricSample> {
        let all = self.series.locked();
        let Some(series) = all.get(id) else {
            return Vec::new();
        };
        series
            .samples
            .iter()
            .filter(|s| from.is_none_or(|f| s.at >= f) && to.is_none_or(|t| s.at <= t))
            .cloned()
            .collect()
    }

    /// When `id`'s newest sample was taken.
    pub fn newest(&self, id: &SandboxId) -> Option<Timestamp> {
        self.series
            .locked()
            .get(id)
            .and_then(|s| s.samples.back().map(|l| l.at))
    }

    /// CPU use since the last sample of the VMM `pid` (which used
    /// `cpu_seconds` in all by `at`), percent of `vcpus`; `None` when there
    /// is no earlier reading of the same VMM. Remembers this reading.
    fn cpu_rate(
        &self,
        id: &SandboxId,
        pid: u32,
        cpu_seconds: f64,
        at: Timestamp,
        vcpus: u32,
    ) -> Option<f64> {
        let mut all = self.series.locked();
        let series = all.entry(id.clone()).or_default();
        let before = series.last_cpu.replace((pid, cpu_seconds, at));
        let (last_pid, last_s, last_at) = before?;
        let wall = (at.0 - last_at.0) as f64 / 1000.0;
        if last_pid != pid || wall <= 0.0 || cpu_seconds < last_s {
            return None;
        }
        Some(((cpu_seconds - last_s) / wall / f64::from(vcpus.max(1)) * 100.0).clamp(0.0, 100.0))
    }

    /// Whether the agent of `id`'s VMM `pid` said it has no `statfs`.
    fn statfs_unsupported(&self, id: &SandboxId, pid: u32) -> bool {
        self.series
            .locked()
            .get(id)
            .is_some_and(|s| s.statfs_unsupported == Some(pid))
    }

    /// Whether `id`'s guest may be asked for its disk use at `now` (not
    /// while it backs off from a read that timed out).
    fn may_read_disk(&self, id: &SandboxId, now: Timestamp) -> bool {
        self.series
            .locked()
            .get(id)
            .and_then(|s| s.disk_retry_at)
            .is_none_or(|at| now.0 >= at.0)
    }

    /// Backs `id`'s disk reads off for [`DISK_RETRY_MS`] from `now`.
    fn back_off_disk(&self, id: &SandboxId, now: Timestamp) {
        self.series
            .locked()
            .entry(id.clone())
            .or_default()
            .disk_retry_at = Some(Timestamp(now.0.saturating_add(DISK_RETRY_MS)));
    }

    /// `id`'s last disk reading, if it is younger than [`DISK_EVERY_MS`]
    /// at `now`.
    fn recent_disk(&self, id: &SandboxId, now: Timestamp) -> Option<(u64, u64)> {
        self.series
            .locked()
            .get(id)
            .and_then(|s| s.disk_read)
            .filter(|(_, at)| now.0.saturating_sub(at.0) < DISK_EVERY_MS)
            .map(|(disk, _)| disk)
    }

    /// Keeps `disk` as `id`'s last reading, taken at `now`.
    fn set_disk_read(&self, id: &SandboxId, disk: (u64, u64), now: Timestamp) {
        self.series
            .locked()
            .entry(id.clone())
            .or_default()
            .disk_read = Some((disk, now));
    }

    /// Remembers that the agent of `id`'s VMM `pid` has no `statfs`.
    fn set_statfs_unsupported(&self, id: &SandboxId, pid: u32) {
        self.series
            .locked()
            .entry(id.clone())
            .or_default()
            .statfs_unsupported = Some(pid);
    }

    /// Whether a failed disk read of `id` may be logged at `now` (at most
    /// once every [`DISK_WARN_EVERY_MS`]); if so, counts it as logged.
    fn may_warn_disk(&self, id: &SandboxId, now: Timestamp) -> bool {
        let mut all = self.series.locked();
        let series = all.entry(id.clone()).or_default();
        if series
            .disk_warned_at
            .is_some_and(|at| now.0.saturating_sub(at.0) < DISK_WARN_EVERY_MS)
        {
            return false;
        }
        series.disk_warned_at = Some(now);
        true
    }

    /// Forgets `id`'s history (a deleted sandbox).
    pub fn forget(&self, id: &SandboxId) {
        self.series.locked().remove(id);
    }

    /// Keeps only the histories of sandboxes `keep` names.
    pub fn retain(&self, keep: impl Fn(&SandboxId) -> bool) {
        self.series.locked().retain(|id, _| keep(id));
    }

    /// How many sandboxes have a history.
    pub fn len(&self) -> usize {
        self.series.locked().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Service {
    /// Samples sandbox `s` now into its history, if its VMM runs here.
    fn sample_history(&self, s: &Sandbox) -> Option<MetricSample> {
        if s.state != SandboxState::Running {
            return None;
        }
        let handle = s.vmm.as_ref()?;
        let now = Timestamp::now();
        let cpu_seconds = vmm::cpu_seconds(handle)?;
        let cpu_used_pct = self
            .history
            .cpu_rate(&s.id, handle.pid, cpu_seconds, now, s.vcpus)
            .or_else(|| vmm::usage(handle, s.vcpus).map(|u| u.cpu_used_pct))
            .unwrap_or(0.0);
        let memory = self.read_memory(s)?;
        let template = self.store.get_template(&s.template).ok();
        // The guest's disk is the template's rootfs (under its overlay).
        let rootfs = template
            .as_ref()
            .and_then(|t| t.rootfs.as_ref())
            .and_then(|p| std::fs::metadata(p).ok())
            .map(|m| m.len());
        let (disk_used_bytes, disk_total_bytes) = template
            .filter(|t| t.kind == TemplateKind::Linux)
            .and_then(|_| self.guest_disk(s, handle, rootfs))
            .unwrap_or((rootfs.unwrap_or(0), rootfs.unwrap_or(0)));
        let sample = MetricSample {
            at: now,
            cpu_count: s.vcpus,
            cpu_used_pct,
            mem_used_bytes: memory.guest_used_bytes.unwrap_or(memory.pss_bytes),
            mem_total_bytes: u64::from(s.mem_mib) << 20,
            disk_used_bytes,
            disk_total_bytes,
        };
        self.history.record(&s.id, sample.clone());
        Some(sample)
    }

    /// The guest's root filesystem (used, total) as its agent's `statfs`
    /// says, within [`DISK_LIMIT`] and clamped ([`clamp_disk`]) to the
    /// disk's size on the host (`disk_bytes`, when known). `None` (the
    /// sample keeps the rootfs size) when the sandbox is no longer
    /// running on VMM `handle`, an operation holds it, its agent is older
    /// than `statfs` (remembered for that VMM) or fails; a failure is
    /// logged at most once a minute per sandbox, and one that took half
    /// the limit or more is not retried for [`DISK_RETRY_MS`]. A reading
    /// younger than [`DISK_EVERY_MS`] is repeated without asking. The call
    /// neither wakes the sandbox nor counts as its activity.
    fn guest_disk(
        &self,
        s: &Sandbox,
        handle: &VmmHandle,
        disk_bytes: Option<u64>,
    ) -> Option<(u64, u64)> {
        if let Some(disk) = self.history.recent_disk(&s.id, Timestamp::now()) {
            return Some(disk);
        }
        if self.history.statfs_unsupported(&s.id, handle.pid)
            || !self.history.may_read_disk(&s.id, Timestamp::now())
        {
            return None;
        }
        let started = std::time::Instant::now();
        {
            // Still running on the same VMM, and no operation (a pause, a
            // hibernation, a delete) working on it right now.
            let _guard = self.locks.lock_within(&s.id, DISK_LOCK_WAIT)?;
            let now = self.store.get_sandbox(&s.id).ok()?;
            if now.state != SandboxState::Running
                || now.vmm.as_ref().map(|h| h.pid) != Some(handle.pid)
            {
                return None;
            }
        }
        let mut link = AgentLink::new(s.id.as_str(), self.sandbox_dir(&s.id).join(VSOCK_FILE));
        link.quiet = true;
        let limit = DISK_LIMIT.saturating_sub(started.elapsed());
        match link.statfs("/", limit) {
            Ok(st) => {
                let disk = clamp_disk(&st, disk_bytes);
                self.history.set_disk_read(&s.id, disk, Timestamp::now());
                Some(disk)
            }
            Err(e) if e.is_unsupported() => {
                tracing::debug!(sandbox = %s.id, "its agent has no statfs: disk use not measured");
                self.history.set_statfs_unsupported(&s.id, handle.pid);
                None
            }
            Err(e) => {
                if started.elapsed() >= DISK_LIMIT / 2 {
                    self.history.back_off_disk(&s.id, Timestamp::now());
                }
                if self.history.may_warn_disk(&s.id, Timestamp::now()) {
                    tracing::warn!(
                        sandbox = %s.id,
                        error = %e,
                        "cannot read the guest's disk use (logged at most once a minute)"
                    );
                }
                None
            }
        }
    }

    /// One round of the history thread: a sample of every running
    /// sandbox on this pod; the histories of sandboxes gone are dropped.
    pub fn sample_histories(&self) {
        let Ok(all) = self.store.list_sandboxes(&SandboxFilter::default()) else {
            return;
        };
        // Only sandboxes whose VMM runs here have a handle to read.
        for s in &all {
            self.sample_history(s);
        }
        let live: std::collections::HashSet<&SandboxId> = all
            .iter()
            .filter(|s| s.state != SandboxState::Deleted)
            .map(|s| &s.id)
            .collect();
        self.history.retain(|id| live.contains(id));
    }

    /// Sandbox `id`'s samples from `from` to `to` (ms, both included),
    /// oldest first. A running sandbox whose newest sample is older than
    /// the sampling interval is sampled now first, so that a sandbox just
    /// made or woken has one. 404 for an unknown or deleted sandbox.
    pub fn metrics_history(
        &self,
        id: &SandboxId,
        from: Option<Timestamp>,
        to: Option<Timestamp>,
    ) -> Result<Vec<MetricSample>, ServiceError> {
        let s = self.store.get_sandbox(id)?;
        if s.state == SandboxState::Deleted {
            return Err(ServiceError::NotFound {
                kind: "sandbox",
                id: id.to_string(),
            });
        }
        let interval = i64::try_from(self.config.history_interval_ms.max(1)).unwrap_or(i64::MAX);
        let stale = self
            .history
            .newest(id)
            .is_none_or(|at| Timestamp::now().0 - at.0 >= interval);
        if stale {
            self.sample_history(&s);
        }
        Ok(self.history.range(id, from, to))
    }

    /// Forgets a deleted sandbox's history.
    pub(super) fn forget_history(&self, id: &SandboxId) {
        self.history.forget(id);
    }
}

/// (used, total) bytes of a guest's filesystem from its `statfs`, which
/// the guest may lie in: the total is at most `disk_bytes` (the disk's
/// size on the host, when known), the used part (total less free) at most
/// the total.
fn clamp_disk(st: &FsStats, disk_bytes: Option<u64>) -> (u64, u64) {
    let total = disk_bytes.map_or(st.total_bytes, |d| st.total_bytes.min(d));
    let used = st.total_bytes.saturating_sub(st.free_bytes).min(total);
    (used, total)
}

/// Starts the history thread (every `history_interval_ms`); it ends when
/// the service is dropped or closed.
pub(super) fn start(service: &Arc<Service>) {
    let weak: Weak<Service> = Arc::downgrade(service);
    let interval = Duration::from_millis(service.config.history_interval_ms);
    let stop = service.stop.clone();
    let spawned = std::thread::Builder::new()
        .name("history".into())
        .spawn(move || loop {
            std::thread::sleep(interval);
            if stop.load(Ordering::SeqCst) {
                return;
            }
            match weak.upgrade() {
                Some(s) => s.sample_histories(),
                None => return,
            }
        });
    if let Err(e) = spawned {
        tracing::warn!("cannot start the history thread: {e}");
    }
}

#[cfg(test)]
#[path = "history_tests.rs"]
mod disk_tests;

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(at: i64) -> MetricSample {
        MetricSample {
            at: Timestamp(at),
            cpu_count: 2,
            cpu_used_pct: 1.5,
            mem_used_bytes: 10 << 20,
            mem_total_bytes: 256 << 20,
            disk_used_bytes: 0,
            disk_total_bytes: 0,
        }
    }

    fn ats(v: &[MetricSample]) -> Vec<i64> {
        v.iter().map(|s| s.at.0).collect()
    }

    #[test]
    fn history_keeps_the_newest_samples_up_to_its_capacity() {
        let h = History::new(3);
        let id = SandboxId::new("sbx_0000000000000001");
        for at in 1..=5 {
            h.record(&id, sample(at * 1000));
        }
        assert_eq!(ats(&h.range(&id, None, None)), vec![3000, 4000, 5000]);
        assert_eq!(h.newest(&id), Some(Timestamp(5000)));
        // Out of order: dropped, the history stays sorted.
        h.record(&id, sample(4500));
        assert_eq!(ats(&h.range(&id, None, None)), vec![3000, 4000, 5000]);
        // The default keeps 1440.
        let big = History::default();
        for at in 0..2000 {
            big.record(&id, sample(at));
        }
        let all = big.range(&id, None, None);
        assert_eq!(all.len(), MAX_SAMPLES);
        assert_eq!(all[0].at, Timestamp(2000 - MAX_SAMPLES as i64));
    }

    #[test]
    fn history_range_includes_both_ends() {
        let h = History::default();
        let id = SandboxId::new("sbx_0000000000000002");
        for at in [1000, 2000, 3000, 4000] {
            h.record(&id, sample(at));
        }
        let r = |from: Option<i64>, to: Option<i64>| {
            ats(&h.range(&id, from.map(Timestamp), to.map(Timestamp)))
        };
        assert_eq!(r(Some(2000), Some(3000)), vec![2000, 3000]);
        assert_eq!(r(Some(2001), None), vec![3000, 4000]);
        assert_eq!(r(None, Some(1999)), vec![1000]);
        assert_eq!(r(Some(5000), None), Vec::<i64>::new());
        assert_eq!(r(Some(3000), Some(2000)), Vec::<i64>::new());
        let other = SandboxId::new("sbx_0000000000000003");
        assert!(h.range(&other, None, None).is_empty());
    }

    #[test]
    fn history_cpu_is_a_rate_between_readings_of_one_vmm() {
        let h = History::default();
        let id = SandboxId::new("sbx_0000000000000004");
        assert_eq!(h.cpu_rate(&id, 7, 10.0, Timestamp(0), 2), None);
        // 1 CPU second over 5 s on 2 vCPUs: 10 %.
        let pct = h.cpu_rate(&id, 7, 11.0, Timestamp(5000), 2).unwrap();
        assert!((pct - 10.0).abs() < 1e-9, "{pct}");
        // Another VMM (woken): no rate until its second reading.
        assert_eq!(h.cpu_rate(&id, 8, 0.5, Timestamp(10_000), 2), None);
        let pct = h.cpu_rate(&id, 8, 100.0, Timestamp(11_000), 1).unwrap();
        assert_eq!(pct, 100.0, "clamped");
    }

    #[test]
    fn history_forgets_deleted_sandboxes() {
        let h = History::default();
        let (a, b) = (
            SandboxId::new("sbx_000000000000000a"),
            SandboxId::new("sbx_000000000000000b"),
        );
        h.record(&a, sample(1));
        h.record(&b, sample(1));
        assert_eq!(h.len(), 2);
        h.forget(&a);
        assert!(h.range(&a, None, None).is_empty());
        h.retain(|id| *id != b);
        assert!(h.is_empty());
    }
}
