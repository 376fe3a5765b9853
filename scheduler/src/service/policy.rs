//! The policy thread: hibernate sandboxes idle past their keep-alive, then,
//! while the pod's measured PSS is above its high watermark, hibernate the
//! least recently used running sandboxes; delete sandboxes past their
//! timeout; notice VMMs that died. The policy never hibernates a sandbox
//! with an operation or a guest request (exec, files) in flight. And the
//! Prometheus metrics.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use super::vmm::{self, PageFaults};
use super::{Outcome, Service, ServiceError, LOCAL_POD};
use crate::model::{Pod, PodId, Sandbox, SandboxId, Timestamp};
use crate::policy::{idle_past_keep_alive, PolicyDriver, PolicyReason};
use crate::state::SandboxState;
use crate::store::SandboxFilter;

/// Latency histogram bucket bounds, in ms.
const BUCKETS_MS: &[f64] = &[
    1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0,
];

#[derive(Default)]
struct Histogram {
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn observe(&mut self, v: f64) {
        if self.counts.is_empty() {
            self.counts = vec![0; BUCKETS_MS.len()];
        }
        for (i, b) in BUCKETS_MS.iter().enumerate() {
            if v <= *b {
                self.counts[i] += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }

    fn render(&self, name: &str, help: &str, out: &mut String) {
        header(out, name, help, "histogram");
        for (i, b) in BUCKETS_MS.iter().enumerate() {
            let c = self.counts.get(i).copied().unwrap_or(0);
            out.push_str(&format!("{name}_bucket{{le=\"{b}\"}} {c}\n"));
        }
        out.push_str(&format!("{name}_bucket{{le=\"+Inf\"}} {}\n", self.count));
        out.push_str(&format!(
            "{name}_sum {}\n{name}_count {}\n",
            self.sum, self.count
        ));
    }
}

/// The `# HELP` and `# TYPE` lines of a metric family.
fn header(out: &mut String, name: &str, help: &str, kind: &str) {
    out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
}

/// Operation counts by outcome.
#[derive(Default, Clone, Copy)]
struct Outcomes {
    ok: u64,
    failed: u64,
}

impl Outcomes {
    fn count(&mut self, ok: bool) {
        if ok {
            self.ok += 1;
        } else {
            self.failed += 1;
        }
    }

    fn render(&self, name: &str, help: &str, out: &mut String) {
        header(out, name, help, "counter");
        out.push_str(&format!("{name}{{result=\"ok\"}} {}\n", self.ok));
        out.push_str(&format!("{name}{{result=\"failed\"}} {}\n", self.failed));
    }
}

/// Page faults of the pod's sandbox VMMs, as counters that never go back:
/// what ended VMMs took stays in `ended`.
#[derive(Default)]
struct FaultBook {
    /// Totals of VMMs that have ended.
    ended: PageFaults,
    /// Last reading of each live VMM, by pid.
    live: HashMap<u32, PageFaults>,
    /// VMMs already moved to `ended` whose pid the store may still name
    /// for a moment (a stop in progress): not sampled again.
    retired: HashSet<u32>,
}

impl FaultBook {
    /// A VMM about to end: its final reading moves to `ended`.
    fn retire(&mut self, pid: u32) {
        if !self.retired.insert(pid) {
            return;
        }
        let last = self.live.remove(&pid).unwrap_or_default();
        let now = vmm::page_faults(pid).unwrap_or_default();
        self.ended.add(last.max(now));
    }

    /// Samples the VMMs the store names now; VMMs no longer named ended
    /// unnoticed (they died): their last reading moves to `ended`.
    fn sample(&mut self, pids: &HashSet<u32>) -> PageFaults {
        let gone: Vec<u32> = self
            .live
            .keys()
            .filter(|p| !pids.contains(p))
            .copied()
            .collect();
        for pid in gone {
            if let Some(last) = self.live.remove(&pid) {
                self.ended.add(last);
            }
        }
        self.retired.retain(|p| pids.contains(p));
        let mut total = self.ended;
        for &pid in pids.iter().filter(|p| !self.retired.contains(p)) {
            let last = self.live.get(&pid).copied().unwrap_or_default();
            let now = vmm::page_faults(pid).map_or(last, |f| f.max(last));
            self.live.insert(pid, now);
            total.add(now);
        }
        total
    }
}

/// What the operations feed the metrics with.
#[derive(Default)]
pub struct Metrics {
    /// Restores by (path, backend): count, and the VMM-side ms histogram.
    restores: Mutex<std::collections::BTreeMap<(&'static str, String), u64>>,
    restore_vmm: Mutex<Histogram>,
    resume: Mutex<Histogram>,
    hibernate: Mutex<Histogram>,
    exec: Mutex<Histogram>,
    wakes: Mutex<Outcomes>,
    hibernations: Mutex<Outcomes>,
    execs: Mutex<Outcomes>,
    faults: Mutex<FaultBook>,
}

fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Metrics {
    /// A create or wake's restore: which path, which backend, how long
    /// the VMM took.
    pub fn observe_restore(&self, r: &crate::model::RestoreReport) {
        *locked(&self.restores)
            .entry((r.path.as_str(), r.backend.clone()))
            .or_default() += 1;
        locked(&self.restore_vmm).observe(r.vmm_ms);
    }

    /// A wake that restored the sandbox, in `ms`.
    pub fn observe_resume(&self, ms: f64) {
        locked(&self.resume).observe(ms);
        locked(&self.wakes).count(true);
    }

    /// A wake that failed (the sandbox went back to hibernated).
    pub fn wake_failed(&self) {
        locked(&self.wakes).count(false);
    }

    /// A hibernation that completed, in `ms`.
    pub fn observe_hibernate(&self, ms: f64) {
        locked(&self.hibernate).observe(ms);
        locked(&self.hibernations).count(true);
    }

    /// A hibernation that failed (the sandbox was resumed).
    pub fn hibernate_failed(&self) {
        locked(&self.hibernations).count(false);
    }

    /// An exec the agent was asked to run, its duration, and whether it
    /// answered with an exit (a non-zero exit status is still `ok`).
    pub fn observe_exec(&self, ms: f64, ok: bool) {
        locked(&self.exec).observe(ms);
        locked(&self.execs).count(ok);
    }

    /// A sandbox VMM about to be stopped: its page faults stay counted.
    pub fn vmm_ending(&self, pid: u32) {
        locked(&self.faults).retire(pid);
    }
}

/// Sandboxes with a guest request in flight, with how many.
#[derive(Default)]
pub struct InFlight(Mutex<HashMap<SandboxId, usize>>);

/// Marks one request in flight until dropped.
pub struct InFlightGuard<'a> {
    set: &'a InFlight,
    id: SandboxId,
}

impl InFlight {
    pub fn enter(&self, id: &SandboxId) -> InFlightGuard<'_> {
        *locked(&self.0).entry(id.clone()).or_default() += 1;
        InFlightGuard {
            set: self,
            id: id.clone(),
        }
    }

    pub fn contains(&self, id: &SandboxId) -> bool {
        locked(&self.0).contains_key(id)
    }
}

impl Drop for InFlightGuard<'_> {
    fn drop(&mut self) {
        let mut map = locked(&self.set.0);
        if let Some(n) = map.get_mut(&self.id) {
            *n -= 1;
            if *n == 0 {
                map.remove(&self.id);
            }
        }
    }
}

impl Service {
    /// Prometheus text exposition.
    pub fn metrics(&self) -> String {
        let mut out = String::new();
        let all = self
            .store
            .list_sandboxes(&SandboxFilter::default())
            .unwrap_or_default();
        header(&mut out, "torpor_sandboxes", "Sandboxes by state.", "gauge");
        for state in SandboxState::ALL
            .iter()
            .filter(|s| **s != SandboxState::Deleted)
        {
            let n = all.iter().filter(|s| s.state == *state).count();
            out.push_str(&format!("torpor_sandboxes{{state=\"{state}\"}} {n}\n"));
        }
        if let Ok(pods) = self.list_pods() {
            header(
                &mut out,
                "torpor_pod_pss_bytes",
                "Measured PSS of the pod's VMM processes.",
                "gauge",
            );
            for p in &pods {
                out.push_str(&format!(
                    "torpor_pod_pss_bytes{{pod=\"{}\"}} {}\n",
                    p.pod.id,
                    (p.pss_mib * 1048576.0) as u64
                ));
            }
            header(
                &mut out,
                "torpor_pod_committed_bytes",
                "Memory of the pod's sandboxes that hold a VMM.",
                "gauge",
            );
            for p in &pods {
                out.push_str(&format!(
                    "torpor_pod_committed_bytes{{pod=\"{}\"}} {}\n",
                    p.pod.id,
                    p.committed_mib << 20
                ));
            }
        }
        // Only the local pod runs VMMs this service can measure.
        let pids: HashSet<u32> = all
            .iter()
            .filter_map(|s| s.vmm.as_ref().map(|h| h.pid))
            .collect();
        let faults = locked(&self.metrics.faults).sample(&pids);
        for (name, help, n) in [
            (
                "torpor_pod_vmm_minor_page_faults_total",
                "Minor page faults of the pod's sandbox VMM processes, ended ones included.",
                faults.minor,
            ),
            (
                "torpor_pod_vmm_major_page_faults_total",
                "Major page faults of the pod's sandbox VMM processes, ended ones included.",
                faults.major,
            ),
        ] {
            header(&mut out, name, help, "counter");
            out.push_str(&format!("{name}{{pod=\"{LOCAL_POD}\"}} {n}\n"));
        }
        let m = &self.metrics;
        header(
            &mut out,
            "torpor_restores_total",
            "Restores of creates and wakes, by path (standby shell or cold VMM) and memory backend.",
            "counter",
        );
        let mut restores = locked(&m.restores).clone();
        for path in ["standby", "cold"] {
            let backend = self.config.memory_backend.name().to_string();
            restores.entry((path, backend)).or_default();
        }
        for ((path, backend), n) in restores.iter() {
            out.push_str(&format!(
                "torpor_restores_total{{path=\"{path}\",backend=\"{backend}\"}} {n}\n"
            ));
        }
        locked(&m.restore_vmm).render(
            "torpor_restore_vmm_ms",
            "VMM-side restore time of creates and wakes (shell request to running, or cold spawn to ready), in ms.",
            &mut out,
        );
        let pool = self.pool.stats();
        for (name, help, kind, n) in [
            (
                "torpor_standby_shells",
                "Standby shells ready in the pool.",
                "gauge",
                pool.ready as u64,
            ),
            (
                "torpor_standby_shells_made_total",
                "Standby shells made.",
                "counter",
                pool.made,
            ),
            (
                "torpor_standby_shells_taken_total",
                "Creates and wakes that took a standby shell.",
                "counter",
                pool.taken,
            ),
            (
                "torpor_standby_shells_missed_total",
                "Creates and wakes that found no standby shell ready.",
                "counter",
                pool.missed,
            ),
        ] {
            header(&mut out, name, help, kind);
            out.push_str(&format!("{name}{{pod=\"{LOCAL_POD}\"}} {n}\n"));
        }
        locked(&m.wakes).render(
            "torpor_wakes_total",
            "Wakes of hibernated sandboxes by result.",
            &mut out,
        );
        locked(&m.hibernations).render(
            "torpor_hibernations_total",
            "Hibernations by result.",
            &mut out,
        );
        locked(&m.execs).render(
            "torpor_execs_total",
            "Execs through the guest agent by result (failed: no exit status).",
            &mut out,
        );
        locked(&m.resume).render(
            "torpor_resume_ms",
            "Latency of waking a hibernated sandbox, in ms.",
            &mut out,
        );
        locked(&m.hibernate).render(
            "torpor_hibernate_ms",
            "Latency of hibernating a sandbox, in ms.",
            &mut out,
        );
        locked(&m.exec).render(
            "torpor_exec_ms",
            "Duration of execs through the guest agent, in ms.",
            &mut out,
        );
        out
    }

    /// Whether sandbox `id` has a guest request in flight.
    pub fn has_request_in_flight(&self, id: &SandboxId) -> bool {
        self.in_flight.contains(id)
    }

    /// Hibernates `id` for the policy, unless an operation holds it (its
    /// lock is taken) or a guest request is in flight, or, for idleness,
    /// it was used meanwhile. `None` when it was left alone. The in-flight
    /// check runs under the sandbox's lock, and guest requests mark
    /// themselves before they take it, so one cannot slip in between.
    fn policy_hibernate(
        &self,
        id: &SandboxId,
        reason: PolicyReason,
    ) -> Option<Result<Outcome, ServiceError>> {
        let _guard = self.locks.try_lock(id)?;
        if self.in_flight.contains(id) {
            tracing::debug!(sandbox = %id, "a guest request is in flight; not hibernating");
            return None;
        }
        if reason == PolicyReason::Idle {
            let s = self.store.get_sandbox(id).ok()?;
            if !idle_past_keep_alive(&s, Timestamp::now()) {
                return None;
            }
        }
        tracing::info!(sandbox = %id, ?reason, "hibernating by policy");
        Some(self.hibernate_locked(id))
    }

    /// One policy round: the rules of [`crate::policy::run_round`] on the
    /// local pod, with the wall clock and the VMMs' measured PSS.
    pub fn run_policy(&self) {
        let now = Timestamp::now();
        crate::policy::run_round(&mut ServiceDriver(self));
        self.prune_deleted(now);
    }

    /// Removes the rows of sandboxes deleted more than the retention ago.
    fn prune_deleted(&self, now: Timestamp) {
        let retention = i64::try_from(self.config.deleted_retention_ms).unwrap_or(i64::MAX);
        let cutoff = Timestamp(now.0.saturating_sub(retention));
        let Ok(old) = self.store.deleted_before(cutoff) else {
            return;
        };
        for id in old.into_iter().take(256) {
            match self.store.purge_sandbox(&id) {
                Ok(()) => tracing::debug!(sandbox = %id, "pruned a deleted sandbox's row"),
                // Checkpoints of other sandboxes still chain to it: kept.
                Err(e) => tracing::debug!(sandbox = %id, "deleted sandbox kept: {e}"),
            }
        }
    }

    /// A VMM that exited without being asked marks only its sandbox failed.
    fn check_vmm_alive(&self, s: &crate::model::Sandbox) {
        let exited = {
            let mut children = self.children.lock().unwrap_or_else(|e| e.into_inner());
            match children.get_mut(&s.id) {
                Some(c) => c.try_wait().ok().flatten(),
                None => None,
            }
        };
        let gone = exited.is_some() || s.vmm.as_ref().is_some_and(|h| !vmm::alive(h));
        if !gone {
            return;
        }
        let _guard = self.locks.lock(&s.id);
        let Ok(current) = self.store.get_sandbox(&s.id) else {
            return;
        };
        if current.state != s.state || current.vmm != s.vmm {
            return; // an operation changed it meanwhile
        }
        self.children
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&s.id);
        let reason = match exited {
            Some(status) if status.code() == Some(torpor_vmm_api::launch::EXIT_OOM) => format!(
                "its VMM was killed by the OOM killer: the sandbox went over its memory limit \
                 (guest memory + {} MiB of VMM overhead)",
                torpor_vmm_api::jail::VMM_OVERHEAD_MIB
            ),
            Some(status) => vmm::exit_reason(status),
            None => "its VMM process disappeared".into(),
        };
        tracing::warn!(sandbox = %s.id, "{reason}");
        let _ = self.store.set_sandbox_vmm(&s.id, None);
        self.drop_sandbox_net(&s.id);
        let _ =
            self.store
                .update_sandbox_state(&s.id, s.state, SandboxState::Failed, Some(&reason));
    }
}

/// The service as the policy's driver: the store's sandboxes and pod,
/// the wall clock, real hibernations and the VMMs' measured PSS.
struct ServiceDriver<'a>(&'a Service);

impl PolicyDriver for ServiceDriver<'_> {
    fn now(&self) -> Timestamp {
        Timestamp::now()
    }

    fn pod(&self) -> Option<Pod> {
        self.0.store.get_pod(&PodId::new(LOCAL_POD)).ok()
    }

    fn sandboxes(&self, states: &[SandboxState]) -> Vec<Sandbox> {
        let filter = SandboxFilter {
            states: states.to_vec(),
            ..Default::default()
        };
        self.0.store.list_sandboxes(&filter).unwrap_or_default()
    }

    fn delete(&mut self, s: &Sandbox) {
        tracing::info!(sandbox = %s.id, "timeout reached; deleting");
        let _ = self.0.delete_sandbox(&s.id);
    }

    fn hibernate(&mut self, s: &Sandbox, reason: PolicyReason) -> Option<bool> {
        match self.0.policy_hibernate(&s.id, reason)? {
            Ok(_) => {
                if reason == PolicyReason::Watermark {
                    tracing::info!(sandbox = %s.id, "pod above its high watermark; hibernated the least recently used");
                }
                Some(true)
            }
            Err(e) => {
                tracing::warn!(sandbox = %s.id, ?reason, "policy hibernation failed: {e}");
                Some(false)
            }
        }
    }

    fn tend(&mut self, s: &Sandbox) {
        self.0.check_vmm_alive(s);
        self.0.regrow_if_active(s);
        let log = vmm::VmmFiles::in_dir(&self.0.sandbox_dir(&s.id)).log;
        if let Err(e) = vmm::cap_log(&log, vmm::MAX_LOG_BYTES) {
            tracing::warn!(sandbox = %s.id, "cannot rotate {}: {e}", log.display());
        }
    }

    fn shrink(&mut self, s: &Sandbox) -> u64 {
        self.0.policy_shrink(s)
    }

    fn memory_bytes(&self, s: &Sandbox) -> u64 {
        s.vmm
            .as_ref()
            .map_or(0, |h| vmm::pss_kib(h.pid).unwrap_or(0))
            * 1024
    }
}

/// Starts the policy thread; it ends when the service is dropped or closed.
pub(super) fn start(service: &Arc<Service>) {
    let weak: Weak<Service> = Arc::downgrade(service);
    let interval = Duration::from_millis(service.config.policy_interval_ms);
    let stop = service.stop.clone();
    let spawned = std::thread::Builder::new()
        .name("policy".into())
        .spawn(move || loop {
            std::thread::sleep(interval);
            if stop.load(Ordering::SeqCst) {
                return;
            }
            match weak.upgrade() {
                Some(s) => s.run_policy(),
                None => return,
            }
        });
    if let Err(e) = spawned {
        tracing::warn!("cannot start the policy thread: {e}");
    }
}
