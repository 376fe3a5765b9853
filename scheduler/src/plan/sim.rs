//! The simulated pod: a trace replayed against the real policy
//! ([`crate::policy`]: admission and the policy round) with a simulated
//! clock, each event costed by a [`Calibration`].
//!
//! The model:
//! - The pod's lifecycle work (creates, wakes, hibernations) runs on
//!   `cores` lanes, first come first served: work queues behind work, and
//!   a request's wake latency includes that wait.
//! - The policy runs every `policy_interval_ms` and, as in `torpor serve`,
//!   hibernates idle sandboxes one after the other, and under memory
//!   pressure [`policy::pressure_batch`] of its cores at once: the
//!   next round starts an interval after the last hibernation of this one
//!   ends; a sandbox used before the policy gets to it is left alone (the
//!   service re-checks idleness under the sandbox's lock).
//! - A sandbox's resident memory (what the pressure marks measure) is
//!   `fresh_pss_mib` after a create or wake (with a calibrated `touch_ms`:
//!   `restored_pss_mib` until its guest has touched its memory again, as
//!   a restored guest gets it back), plus what its requests dirty, at most
//!   its size; its peak is followed at every change, not only at policy
//!   rounds. Admission counts sizes, as the service does.
//! - A request to a hibernated sandbox wakes it (a wake the pod cannot
//!   admit is refused, as the service answers 429; so is a create or wake
//!   whose sandbox, at what a running one of its size holds, would take
//!   resident memory past the hard mark, [`policy::pressure_gate`]; as in
//!   the service, a sandbox the gate admitted counts at least that for
//!   [`policy::PRESSURE_SETTLE_MS`], from its admission, in the gate's
//!   measure, so wakes admitted together do not all count on the same
//!   room; where the service, having measured no sandbox of a template,
//!   expects its size, the planner expects a fresh one's memory);
//!   requests that arrive while a sandbox is being created, woken or
//!   hibernated wait for it.
//! - A setting whose resident memory would exceed the pod's RAM is
//!   infeasible (a real pod would swap or OOM-kill): [`Outcome::infeasible`]
//!   says why ([`Outcome::exceeds`]: which limit), and the plan never
//!   recommends or names it.
//! - A wake costs the calibration's `wake_ms`, or across its measured
//!   spread of wakes when it has one (in a fixed order: deterministic).
//! - A hibernation writes a snapshot of what was dirtied since the last
//!   one; a hibernated sandbox's disk is the sum of its layers. Its work
//!   on a lane costs the calibration's hibernation time (measured one at
//!   a time, its write included); its snapshot write, started with it,
//!   goes through the pod's disk (`disk_write_mib_s`), which the writes
//!   under way share equally (a write alone takes bytes / bandwidth). It
//!   ends, and its sandbox's memory is freed, when both are done; the
//!   policy thread waits for it. Only the policy hibernates, one step at
//!   a time (an idle or timeout hibernation, or a pressure batch), so the
//!   writes sharing the disk are one step's: their ends are known when
//!   the step starts ([`shared_writes`]).
//! - A setting needs more hibernation bandwidth than the disk gives when
//!   its **write backlog** (the snapshot bytes of hibernations the policy
//!   has started or queued and not yet finished) ever holds more than the
//!   disk writes in [`DISK_BACKLOG_INTERVALS`] policy intervals: the
//!   policy would be that many rounds behind (keep-alives overrun,
//!   pressure held above the high mark), and a trace that asks more of
//!   the disk than it gives makes each round's backlog larger than the
//!   last. Such a setting is infeasible too, its reason naming the rate
//!   the backlog needs (its peak over that window) against the disk's.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use serde::Serialize;

use super::calibration::Calibration;
use super::trace::{EventKind, Trace};
use crate::model::{Pod, PodAddress, PodId, Sandbox, SandboxId, TemplateId, Timestamp};
use crate::policy::{self, PolicyDriver, PolicyReason};
use crate::state::SandboxState;
use crate::store::admission::HOLDING_VMM;

/// One candidate setting of the pod.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Setting {
    pub ratio: f64,
    pub keep_alive_ms: u64,
    pub high_watermark: f64,
}

/// The pod the trace is played on.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PodShape {
    pub memory_mib: u64,
    /// Lanes the pod's lifecycle work runs on.
    pub cores: u32,
    pub policy_interval_ms: u64,
}

/// How many policy intervals of the disk's writing a setting's write
/// backlog may hold before it is infeasible (see the module doc).
pub const DISK_BACKLOG_INTERVALS: u64 = 10;

/// A limit of the pod an infeasible setting exceeds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Limit {
    /// Resident memory past its RAM.
    Ram,
    /// Hibernation writes past its disk's bandwidth.
    Disk,
}

/// What one setting did with the trace.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Outcome {
    pub setting: Setting,
    pub creates_admitted: u64,
    pub creates_rejected: u64,
    /// Requests to a sandbox whose create was rejected.
    pub requests_dropped: u64,
    pub requests: u64,
    /// Wakes done.
    pub wakes: u64,
    /// Wakes refused: the pod was full.
    pub wakes_rejected: u64,
    /// Requests that waited for a wake, by how long (ms), queueing included.
    pub wake_p50_ms: f64,
    pub wake_p99_ms: f64,
    pub wake_max_ms: f64,
    pub hibernations: u64,
    pub hibernations_idle: u64,
    /// Hibernations under memory pressure (above the high mark).
    pub hibernations_watermark: u64,
    pub hibernations_timeout: u64,
    /// Creates and wakes refused because resident memory was past the
    /// hard mark (429 `rate_limited`; also counted in `creates_rejected`
    /// and `wakes_rejected`).
    pub pressure_refusals: u64,
    /// Highest resident memory at any moment, against the pod's RAM.
    pub resident_peak_mib: f64,
    /// Why the setting cannot run on the pod (resident memory past its
    /// RAM, hibernation writes past its disk's bandwidth); `None` when it
    /// can.
    pub infeasible: Option<String>,
    /// The limits it exceeds (empty when feasible).
    pub exceeds: Vec<Limit>,
    /// Peak and p99 of the per-round samples of resident memory.
    pub mem_peak_mib: f64,
    pub mem_p99_mib: f64,
    pub committed_peak_mib: u64,
    pub disk_peak_bytes: f64,
    pub disk_end_bytes: f64,
    /// Snapshot bytes hibernations wrote.
    pub snapshot_written_bytes: f64,
    /// Most snapshot bytes the policy's hibernations had left to write
    /// at once (started or queued, not finished).
    pub write_backlog_peak_bytes: f64,
    /// The write rate that backlog needs (MiB/s): its peak written within
    /// [`DISK_BACKLOG_INTERVALS`] policy intervals.
    pub disk_needed_mib_s: f64,
    /// The disk's write bandwidth it was played with (MiB/s).
    pub disk_write_mib_s: f64,
    /// Core time of the pod's creates, wakes and hibernations.
    pub core_seconds: f64,
    /// (seconds, memory MiB) samples, at most [`MAX_SERIES`].
    pub memory_series: Vec<(f64, f64)>,
}

impl Outcome {
    /// Rejected creates and wakes, in % of those asked.
    pub fn reject_pct(&self) -> f64 {
        let asked =
            self.creates_admitted + self.creates_rejected + self.wakes + self.wakes_rejected;
        if asked == 0 {
            return 0.0;
        }
        100.0 * (self.creates_rejected + self.wakes_rejected) as f64 / asked as f64
    }
}

/// Most points kept of the memory series.
pub const MAX_SERIES: usize = 600;

/// Work in progress on a sandbox.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Work {
    Create,
    Wake,
    Hibernate(PolicyReason),
}

/// A request waiting for a sandbox: when it arrived, how long it runs,
/// what it dirties, whether it waits for a wake.
#[derive(Debug, Clone, Copy)]
struct Waiting {
    arrived_ms: i64,
    duration_ms: u64,
    mem_mib: u32,
}

struct SimBox {
    sandbox: Sandbox,
    /// Exists on the pod (created, not deleted, create admitted).
    live: bool,
    /// Work in progress and when it ends.
    work: Option<(Work, i64)>,
    /// When that work starts on its lane, and its cost (ms).
    work_start: i64,
    work_ms: f64,
    /// Latest end of a request (the sandbox is active until then).
    active_until: i64,
    resident_mib: f64,
    dirty_mib: f64,
    disk_bytes: f64,
    /// Snapshot bytes of the hibernation under way.
    write_bytes: f64,
    /// Until when the pressure gate counts it at least `settle_mib`, what
    /// it expected it to hold when it admitted it.
    settle_until: i64,
    settle_mib: f64,
    /// When its guest has touched its memory again after its create or
    /// wake, and what that adds to what it holds
    /// ([`Calibration::touch_ms`]).
    touch_at: i64,
    touch_mib: f64,
    waiting: Vec<Waiting>,
    delete_pending: bool,
}

/// The simulated pod: the policy's driver.
struct SimPod<'a> {
    cal: &'a Calibration,
    shape: PodShape,
    setting: Setting,
    now: i64,
    boxes: Vec<SimBox>,
    lanes: Vec<i64>,
    /// When the policy thread is done with its current round's work.
    policy_busy_until: i64,
    done: BinaryHeap<Reverse<(i64, usize)>>,
    /// Sandboxes whose guests touch their memory again, by when.
    touches: BinaryHeap<Reverse<(i64, usize)>>,
    /// Per sandbox size, what the pressure gate last knew one to hold.
    known_mib: std::collections::HashMap<u32, f64>,
    wake_waits: Vec<f64>,
    out: Outcome,
    disk_now: f64,
    /// Snapshot bytes of hibernations started or queued, not finished.
    backlog_now: f64,
    /// Resident memory of the live sandboxes now (MiB).
    resident_now: f64,
    /// Wakes started so far (which part of the calibration's spread the
    /// next one costs).
    wakes_started: u64,
}

fn ts(ms: i64) -> Timestamp {
    Timestamp(ms)
}

impl SimPod<'_> {
    /// Starts `ms` of work on the first free lane no earlier than `at`;
    /// returns when it ends.
    fn run_on_lane(&mut self, at: i64, ms: f64) -> i64 {
        let (i, free) = self
            .lanes
            .iter()
            .copied()
            .enumerate()
            .min_by_key(|&(_, f)| f)
            .unwrap_or((0, at));
        let start = at.max(free);
        let end = start + ms.ceil() as i64;
        if let Some(l) = self.lanes.get_mut(i) {
            *l = end;
        }
        self.out.core_seconds += ms / 1000.0;
        end
    }

    fn committed_mib(&self) -> u64 {
        self.boxes
            .iter()
            .filter(|b| b.live && HOLDING_VMM.contains(&b.sandbox.state))
            .map(|b| u64::from(b.sandbox.mem_mib))
            .sum()
    }

    /// Sets sandbox `i`'s resident memory, following the pod's total and
    /// its peak.
    fn set_resident(&mut self, i: usize, mib: f64) {
        let b = &mut self.boxes[i];
        self.resident_now += mib - b.resident_mib;
        b.resident_mib = mib;
        self.out.resident_peak_mib = self.out.resident_peak_mib.max(self.resident_now);
    }

    /// Whether a create or wake of sandbox `i` of `mem_mib` may start: the
    /// pressure gate, then admission, as the service checks them.
    fn admit(&mut self, i: usize, mem_mib: u32) -> bool {
        // What the new sandbox will hold, as the service expects it: the
        // most a settled running one of its template holds (a trace names
        // no template: one of its size); while none has settled, the most
        // of what was known and what settling ones hold; never measured,
        // what a settled one holds by the calibration.
        let now = self.now;
        let held = |settled: bool| {
            self.boxes
                .iter()
                .filter(|b| b.live && HOLDING_VMM.contains(&b.sandbox.state))
                // One being created or woken has no VMM to measure yet.
                .filter(|b| {
                    !matches!(
                        b.sandbox.state,
                        SandboxState::Creating | SandboxState::Resuming
                    )
                })
                .filter(|b| b.sandbox.mem_mib == mem_mib && (now >= b.settle_until) == settled)
                .map(|b| b.resident_mib)
                .reduce(f64::max)
        };
        let (settled, settling) = (held(true), held(false));
        let known = self.known_mib.get(&mem_mib).copied();
        let expected_mib = settled
            .or_else(|| settling.into_iter().chain(known).reduce(f64::max))
            .unwrap_or(self.cal.fresh_pss_mib.min(f64::from(mem_mib)));
        if settled.is_some() || settling.is_some() {
            self.known_mib.insert(mem_mib, expected_mib);
        }
        // The pod's resident memory as the gate measures it: each sandbox
        // admitted within the settle time at least what it was expected
        // to hold.
        let measured: f64 = self
            .boxes
            .iter()
            .filter(|b| b.live && HOLDING_VMM.contains(&b.sandbox.state))
            .map(|b| {
                if now < b.settle_until {
                    b.resident_mib.max(b.settle_mib)
                } else {
                    b.resident_mib
                }
            })
            .sum();
        let gate = policy::pressure_gate(
            self.shape.memory_mib << 20,
            self.setting.high_watermark,
            (measured.max(0.0) * 1048576.0) as u64,
            (expected_mib.max(0.0) * 1048576.0) as u64,
        );
        if gate.is_err() {
            self.out.pressure_refusals += 1;
            return false;
        }
        let admitted = policy::admit(
            self.shape.memory_mib,
            self.setting.ratio,
            self.committed_mib(),
            mem_mib,
        )
        .is_ok();
        if admitted {
            let b = &mut self.boxes[i];
            b.settle_until = now.saturating_add(policy::PRESSURE_SETTLE_MS as i64);
            b.settle_mib = expected_mib;
        }
        admitted
    }

    fn start_work(&mut self, i: usize, work: Work, at: i64, ms: f64) {
        let end = self.run_on_lane(at, ms);
        let b = &mut self.boxes[i];
        b.work_start = end - ms.ceil() as i64;
        b.work_ms = ms;
        b.sandbox.state = match work {
            Work::Create => SandboxState::Creating,
            Work::Wake => SandboxState::Resuming,
            Work::Hibernate(_) => SandboxState::Hibernating,
        };
        b.work = Some((work, end));
        self.done.push(Reverse((end, i)));
        self.out.committed_peak_mib = self.out.committed_peak_mib.max(self.committed_mib());
    }

    /// A request reaches sandbox `i` at `now` (or, having waited, when
    /// its sandbox became ready).
    fn request(&mut self, i: usize, r: Waiting) {
        let now = self.now;
        let b = &mut self.boxes[i];
        if !b.live {
            self.out.requests_dropped += 1;
            return;
        }
        // The policy hibernates one sandbox after the other, re-checking
        // each under its lock when it gets to it: one used before then is
        // no longer idle and is left alone.
        if matches!(b.work, Some((Work::Hibernate(PolicyReason::Idle), _))) && now < b.work_start {
            b.work = None;
            b.sandbox.state = SandboxState::Running;
            self.out.core_seconds -= b.work_ms / 1000.0;
            self.backlog_now -= b.write_bytes;
            b.write_bytes = 0.0;
        }
        if b.work.is_some() {
            b.waiting.push(r);
            return;
        }
        if b.sandbox.state == SandboxState::Hibernated {
            let mem = b.sandbox.mem_mib;
            if !self.admit(i, mem) {
                self.out.wakes_rejected += 1;
                return;
            }
            self.boxes[i].waiting.push(r);
            let ms = self.cal.wake_cost_ms(self.wakes_started);
            self.wakes_started += 1;
            self.start_work(i, Work::Wake, now, ms);
            return;
        }
        let b = &mut self.boxes[i];
        let size = f64::from(b.sandbox.mem_mib);
        b.active_until = b.active_until.max(now + r.duration_ms as i64);
        b.dirty_mib = (b.dirty_mib + f64::from(r.mem_mib)).min(size);
        let resident = (b.resident_mib + f64::from(r.mem_mib)).min(size);
        self.set_resident(i, resident);
    }

    /// Work on sandbox `i` ended at `now`.
    fn work_done(&mut self, i: usize) {
        let now = self.now;
        let Some((work, _)) = self.boxes[i].work.take() else {
            return;
        };
        let b = &mut self.boxes[i];
        let size = f64::from(b.sandbox.mem_mib);
        match work {
            Work::Create | Work::Wake => {
                b.sandbox.state = SandboxState::Running;
                b.active_until = b.active_until.max(now);
                let fresh = self.cal.fresh_pss_mib.min(size);
                let held = if self.cal.touch_ms > 0.0 {
                    // A restored guest's memory comes back as it touches it.
                    let held = self.cal.restored_pss_mib.min(fresh);
                    b.touch_at = now + self.cal.touch_ms.ceil() as i64;
                    b.touch_mib = fresh - held;
                    self.touches.push(Reverse((b.touch_at, i)));
                    held
                } else {
                    fresh
                };
                self.set_resident(i, held);
                if work == Work::Wake {
                    self.out.wakes += 1;
                }
            }
            Work::Hibernate(reason) => {
                b.sandbox.state = SandboxState::Hibernated;
                let bytes = std::mem::take(&mut b.write_bytes);
                b.disk_bytes += bytes;
                self.disk_now += bytes;
                self.backlog_now -= bytes;
                self.out.snapshot_written_bytes += bytes;
                b.dirty_mib = 0.0;
                self.set_resident(i, 0.0);
                self.out.hibernations += 1;
                match reason {
                    PolicyReason::Idle => self.out.hibernations_idle += 1,
                    PolicyReason::Watermark => self.out.hibernations_watermark += 1,
                    PolicyReason::Timeout => self.out.hibernations_timeout += 1,
                }
            }
        }
        if self.boxes[i].delete_pending {
            self.delete(i);
            return;
        }
        let waiting = std::mem::take(&mut self.boxes[i].waiting);
        for r in waiting {
            if work == Work::Wake {
                self.wake_waits.push((now - r.arrived_ms) as f64);
            }
            self.request(i, r);
        }
    }

    /// Sandbox `i`'s guest has touched its memory again (`at`): it holds
    /// what a settled one holds. Stale entries (hibernated, deleted or
    /// woken again since) change nothing.
    fn touched(&mut self, i: usize, at: i64) {
        let b = &self.boxes[i];
        if !b.live || b.touch_at != at || b.sandbox.state == SandboxState::Hibernated {
            return;
        }
        let size = f64::from(b.sandbox.mem_mib);
        let held = (b.resident_mib + b.touch_mib).min(size);
        self.boxes[i].touch_mib = 0.0;
        self.set_resident(i, held);
    }

    fn delete(&mut self, i: usize) {
        let b = &mut self.boxes[i];
        if b.work.is_some() {
            b.delete_pending = true;
            return;
        }
        if b.live {
            self.disk_now -= b.disk_bytes;
            self.resident_now -= b.resident_mib;
        }
        b.live = false;
        b.sandbox.state = SandboxState::Deleted;
        let dropped = b.waiting.len() as u64;
        b.waiting.clear();
        self.out.requests_dropped += dropped;
    }

    /// One step of the policy thread: hibernates `step` together, once
    /// its previous step is done, each on the first free lane, their
    /// snapshot writes sharing the disk; the thread is busy until the
    /// last ends. A busy sandbox (an operation holds it, or a request is
    /// in flight) is left alone (`None`).
    fn hibernate_step(&mut self, step: &[Sandbox], reason: PolicyReason) -> Vec<Option<bool>> {
        let at = self.policy_busy_until.max(self.now);
        let mut started = Vec::new();
        let answers = step
            .iter()
            .map(|s| {
                let i = index_of(&s.id)?;
                let b = self.boxes.get(i)?;
                if b.work.is_some() || b.active_until > self.now || !b.live {
                    return None;
                }
                let (ms, bytes) = (
                    self.cal.hibernate_cost_ms(b.dirty_mib),
                    self.cal.snapshot_bytes(b.dirty_mib),
                );
                self.start_work(i, Work::Hibernate(reason), at, ms);
                self.boxes[i].write_bytes = bytes;
                self.backlog_now += bytes;
                started.push((i, bytes));
                Some(true)
            })
            .collect();
        self.out.write_backlog_peak_bytes = self.out.write_backlog_peak_bytes.max(self.backlog_now);
        let writes: Vec<(f64, f64)> = started
            .iter()
            .map(|&(i, bytes)| (self.boxes[i].work_start as f64, bytes))
            .collect();
        let mut ends = at;
        for ((i, _), written) in started
            .into_iter()
            .zip(shared_writes(self.cal.disk_bytes_per_ms(), &writes))
        {
            let b = &mut self.boxes[i];
            if let Some((work, lane_end)) = b.work {
                let end = lane_end.max(written.ceil() as i64);
                if end > lane_end {
                    // The lane's entry is left stale (skipped).
                    b.work = Some((work, end));
                    self.done.push(Reverse((end, i)));
                }
                ends = ends.max(end);
            }
        }
        self.policy_busy_until = ends;
        answers
    }

    fn sample(&mut self, series: &mut Vec<(f64, f64)>) {
        let mem = self.resident_now.max(0.0);
        series.push((self.now as f64 / 1000.0, mem));
        self.out.committed_peak_mib = self.out.committed_peak_mib.max(self.committed_mib());
        self.out.disk_peak_bytes = self.out.disk_peak_bytes.max(self.disk_now);
    }
}

impl PolicyDriver for SimPod<'_> {
    fn now(&self) -> Timestamp {
        ts(self.now)
    }

    fn pod(&self) -> Option<Pod> {
        Some(Pod {
            id: PodId::new(crate::service::LOCAL_POD),
            address: PodAddress::Local,
            token_hash: None,
            memory_bytes: self.shape.memory_mib << 20,
            vcpus: self.shape.cores,
            disk_bytes: u64::MAX,
            oversubscription_ratio: self.setting.ratio,
            high_watermark: self.setting.high_watermark,
            created_at: ts(0),
        })
    }

    fn sandboxes(&self, states: &[SandboxState]) -> Vec<Sandbox> {
        self.boxes
            .iter()
            .filter(|b| b.live && states.contains(&b.sandbox.state))
            .map(|b| {
                let mut s = b.sandbox.clone();
                s.last_active_at = ts(b.active_until.min(self.now));
                s
            })
            .collect()
    }

    fn delete(&mut self, s: &Sandbox) {
        if let Some(i) = index_of(&s.id) {
            SimPod::delete(self, i);
        }
    }

    /// The simulated guests have nothing to give back: a sandbox's memory
    /// is what its requests dirtied (the trace's `mem_mib`), all in use.
    fn shrink(&mut self, _: &Sandbox) -> u64 {
        0
    }

    fn hibernate(&mut self, s: &Sandbox, reason: PolicyReason) -> Option<bool> {
        // The policy thread hibernates one sandbox after the other.
        self.hibernate_step(std::slice::from_ref(s), reason)
            .pop()
            .flatten()
    }

    /// Pressure hibernations start together, each on a lane of its own
    /// while lanes are free; the round ends when the last one does.
    fn hibernate_batch(&mut self, batch: &[Sandbox]) -> Vec<Option<bool>> {
        self.hibernate_step(batch, PolicyReason::Watermark)
    }

    fn tend(&mut self, _s: &Sandbox) {}

    fn memory_bytes(&self, s: &Sandbox) -> u64 {
        index_of(&s.id)
            .and_then(|i| self.boxes.get(i))
            .map_or(0, |b| (b.resident_mib * 1048576.0) as u64)
    }
}

/// Simulated sandboxes are named by their number in the trace.
fn sim_id(i: usize) -> SandboxId {
    SandboxId::new(format!("sb_sim{i}"))
}

fn index_of(id: &SandboxId) -> Option<usize> {
    id.as_str().strip_prefix("sb_sim")?.parse().ok()
}

/// The `q` quantile (0..=1) of `v` by nearest rank; 0 when empty.
pub fn quantile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

/// When each of `writes` (start ms, bytes) ends on a disk that writes
/// `bytes_per_ms`, shared equally by the writes under way (a write alone
/// takes bytes / bandwidth; two together each get half).
pub fn shared_writes(bytes_per_ms: f64, writes: &[(f64, f64)]) -> Vec<f64> {
    let mut end = vec![0.0; writes.len()];
    let mut left: Vec<f64> = writes.iter().map(|w| w.1.max(0.0)).collect();
    let mut order: Vec<usize> = (0..writes.len()).collect();
    order.sort_by(|&a, &b| writes[a].0.total_cmp(&writes[b].0));
    let mut arrivals = order.into_iter().peekable();
    let mut active: Vec<usize> = Vec::new();
    let mut t = f64::NEG_INFINITY;
    if !(bytes_per_ms.is_finite() && bytes_per_ms > 0.0) {
        // No disk figure: writes take no time (validation refuses this).
        return writes.iter().map(|w| w.0).collect();
    }
    loop {
        if active.is_empty() {
            match arrivals.peek() {
                Some(&i) => t = t.max(writes[i].0),
                None => return end,
            }
        }
        while let Some(&i) = arrivals.peek() {
            if writes[i].0 > t {
                break;
            }
            active.push(i);
            arrivals.next();
        }
        let rate = bytes_per_ms / active.len() as f64;
        let first_done = active
            .iter()
            .map(|&i| left[i])
            .fold(f64::INFINITY, f64::min);
        let next_start = arrivals.peek().map_or(f64::INFINITY, |&i| writes[i].0);
        let next = (t + first_done / rate).min(next_start);
        let written = (next - t) * rate;
        t = next;
        active.retain(|&i| {
            left[i] -= written;
            // What rounding leaves of a finished write.
            if left[i] <= 1e-9 * writes[i].1.max(1.0) {
                end[i] = t;
                false
            } else {
                true
            }
        });
    }
}

/// Plays `trace` on a pod of `shape` with `setting`, charging `cal`.
/// Deterministic: the same inputs give the same outcome.
pub fn simulate(trace: &Trace, shape: PodShape, setting: Setting, cal: &Calibration) -> Outcome {
    let template = TemplateId::new("tpl_plan");
    let boxes = (0..trace.sandboxes.len())
        .map(|i| {
            let mut sandbox = Sandbox::new(template.clone(), 1, 1, setting.keep_alive_ms);
            sandbox.id = sim_id(i);
            sandbox.created_at = ts(0);
            sandbox.last_active_at = ts(0);
            SimBox {
                sandbox,
                live: false,
                work: None,
                work_start: 0,
                work_ms: 0.0,
                active_until: 0,
                resident_mib: 0.0,
                dirty_mib: 0.0,
                disk_bytes: 0.0,
                write_bytes: 0.0,
                settle_until: 0,
                settle_mib: 0.0,
                touch_at: 0,
                touch_mib: 0.0,
                waiting: Vec::new(),
                delete_pending: false,
            }
        })
        .collect();
    let mut pod = SimPod {
        cal,
        shape,
        setting,
        now: 0,
        boxes,
        lanes: vec![0; shape.cores.max(1) as usize],
        policy_busy_until: 0,
        done: BinaryHeap::new(),
        touches: BinaryHeap::new(),
        known_mib: std::collections::HashMap::new(),
        wake_waits: Vec::new(),
        out: Outcome {
            setting,
            creates_admitted: 0,
            creates_rejected: 0,
            requests_dropped: 0,
            requests: 0,
            wakes: 0,
            wakes_rejected: 0,
            wake_p50_ms: 0.0,
            wake_p99_ms: 0.0,
            wake_max_ms: 0.0,
            hibernations: 0,
            hibernations_idle: 0,
            hibernations_watermark: 0,
            hibernations_timeout: 0,
            pressure_refusals: 0,
            resident_peak_mib: 0.0,
            infeasible: None,
            exceeds: Vec::new(),
            mem_peak_mib: 0.0,
            mem_p99_mib: 0.0,
            committed_peak_mib: 0,
            disk_peak_bytes: 0.0,
            disk_end_bytes: 0.0,
            snapshot_written_bytes: 0.0,
            write_backlog_peak_bytes: 0.0,
            disk_needed_mib_s: 0.0,
            disk_write_mib_s: cal.disk_write_mib_s,
            core_seconds: 0.0,
            memory_series: Vec::new(),
        },
        disk_now: 0.0,
        backlog_now: 0.0,
        resident_now: 0.0,
        wakes_started: 0,
    };
    let interval = shape.policy_interval_ms.max(1) as i64;
    let mut next_tick = interval;
    let mut series = Vec::new();
    let end = trace.end_ms();
    let mut events = trace.events.iter().peekable();
    loop {
        let next_event = events.peek().map(|e| e.t_ms);
        let next_done = pod.done.peek().map(|Reverse((t, _))| *t);
        // Internal work first at equal times: what ended is seen by what
        // arrives at the same millisecond.
        let next_touch = pod.touches.peek().map(|Reverse((t, _))| *t);
        let internal = [next_done, next_touch]
            .into_iter()
            .flatten()
            .fold(next_tick, i64::min);
        if next_event.is_none_or(|t| internal <= t) {
            if next_event.is_none() && next_done.is_none() && internal > end {
                break;
            }
            pod.now = internal;
            if next_done == Some(internal) {
                if let Some(Reverse((_, i))) = pod.done.pop() {
                    // Stale entries (work replaced) are skipped.
                    if pod.boxes[i].work.is_some_and(|(_, e)| e == internal) {
                        pod.work_done(i);
                    }
                }
            } else if next_touch == Some(internal) {
                if let Some(Reverse((_, i))) = pod.touches.pop() {
                    pod.touched(i, internal);
                }
            } else {
                policy::run_round(&mut pod);
                pod.sample(&mut series);
                next_tick = pod.policy_busy_until.max(pod.now) + interval;
            }
            continue;
        }
        let Some(e) = events.next() else {
            break;
        };
        pod.now = e.t_ms;
        match e.kind {
            EventKind::Create => {
                if pod.admit(e.sandbox, e.mem_mib) {
                    pod.out.creates_admitted += 1;
                    let b = &mut pod.boxes[e.sandbox];
                    b.live = true;
                    b.sandbox.mem_mib = e.mem_mib;
                    let ms = cal.create_ms;
                    pod.start_work(e.sandbox, Work::Create, e.t_ms, ms);
                } else {
                    pod.out.creates_rejected += 1;
                }
            }
            EventKind::Request => {
                pod.out.requests += 1;
                pod.request(
                    e.sandbox,
                    Waiting {
                        arrived_ms: e.t_ms,
                        duration_ms: e.duration_ms,
                        mem_mib: e.mem_mib,
                    },
                );
            }
            EventKind::Delete => pod.delete(e.sandbox),
        }
    }
    let mut out = pod.out;
    let mut mem: Vec<f64> = series.iter().map(|&(_, m)| m).collect();
    out.mem_peak_mib = mem.iter().copied().fold(0.0, f64::max);
    out.mem_p99_mib = quantile(&mut mem, 0.99);
    out.wake_p50_ms = quantile(&mut pod.wake_waits, 0.5);
    out.wake_p99_ms = quantile(&mut pod.wake_waits, 0.99);
    out.wake_max_ms = pod.wake_waits.last().copied().unwrap_or(0.0);
    out.disk_end_bytes = pod.disk_now;
    out.memory_series = downsample(&series, MAX_SERIES);
    let mut why = Vec::new();
    if out.resident_peak_mib > shape.memory_mib as f64 {
        out.exceeds.push(Limit::Ram);
        why.push(format!(
            "resident memory peaks at {:.0} MiB, past the pod's {} MiB of RAM: \
             a real pod would swap or OOM-kill; lower the ratio or add memory",
            out.resident_peak_mib, shape.memory_mib
        ));
    }
    let window_s = (DISK_BACKLOG_INTERVALS * shape.policy_interval_ms.max(1)) as f64 / 1000.0;
    out.disk_needed_mib_s = out.write_backlog_peak_bytes / 1048576.0 / window_s;
    if out.disk_needed_mib_s > cal.disk_write_mib_s {
        out.exceeds.push(Limit::Disk);
        why.push(format!(
            "hibernation writes need {:.0} MiB/s, past the disk's {:.0} MiB/s: \
             {:.0} MiB of snapshots left to write at once, more than the disk writes \
             in {DISK_BACKLOG_INTERVALS} policy intervals ({window_s} s), so the policy \
             falls behind; hibernate fewer at once (a lower ratio, a longer keep-alive) \
             or use a faster disk",
            out.disk_needed_mib_s,
            cal.disk_write_mib_s,
            out.write_backlog_peak_bytes / 1048576.0
        ));
    }
    if !why.is_empty() {
        out.infeasible = Some(why.join("; "));
    }
    out
}

/// At most `n` points of `series`, keeping each bucket's peak.
fn downsample(series: &[(f64, f64)], n: usize) -> Vec<(f64, f64)> {
    if series.len() <= n {
        return series.to_vec();
    }
    let per = series.len().div_ceil(n);
    series
        .chunks(per)
        .map(|c| {
            c.iter()
                .copied()
                .fold((c[0].0, 0.0), |acc, (_, m)| (acc.0, f64::max(acc.1, m)))
        })
        .collect()
}
