//! The policy thread: hibernate sandboxes idle past their keep-alive, then,
//! while the pod's measured PSS is above its high watermark, hibernate the
//! least recently used running sandboxes; delete sandboxes past their
//! timeout; notice VMMs that died. And the Prometheus metrics.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use super::vmm;
use super::{Service, LOCAL_POD};
use crate::model::{PodId, Timestamp};
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

    fn render(&self, name: &str, out: &mut String) {
        out.push_str(&format!("# TYPE {name} histogram\n"));
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

/// Latency histograms the operations feed.
#[derive(Default)]
pub struct Metrics {
    resume: Mutex<Histogram>,
    hibernate: Mutex<Histogram>,
}

impl Metrics {
    pub fn observe_resume(&self, ms: f64) {
        self.resume
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .observe(ms);
    }

    pub fn observe_hibernate(&self, ms: f64) {
        self.hibernate
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .observe(ms);
    }
}

impl Service {
    /// Prometheus text exposition.
    pub fn metrics(&self) -> String {
        let mut out = String::new();
        out.push_str("# TYPE torpor_sandboxes gauge\n");
        let all = self
            .store
            .list_sandboxes(&SandboxFilter::default())
            .unwrap_or_default();
        for state in SandboxState::ALL
            .iter()
            .filter(|s| **s != SandboxState::Deleted)
        {
            let n = all.iter().filter(|s| s.state == *state).count();
            out.push_str(&format!("torpor_sandboxes{{state=\"{state}\"}} {n}\n"));
        }
        if let Ok(pods) = self.list_pods() {
            out.push_str("# TYPE torpor_pod_pss_bytes gauge\n");
            for p in &pods {
                out.push_str(&format!(
                    "torpor_pod_pss_bytes{{pod=\"{}\"}} {}\n",
                    p.pod.id,
                    (p.pss_mib * 1048576.0) as u64
                ));
            }
            out.push_str("# TYPE torpor_pod_committed_bytes gauge\n");
            for p in &pods {
                out.push_str(&format!(
                    "torpor_pod_committed_bytes{{pod=\"{}\"}} {}\n",
                    p.pod.id,
                    p.committed_mib << 20
                ));
            }
        }
        self.metrics
            .resume
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .render("torpor_resume_ms", &mut out);
        self.metrics
            .hibernate
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .render("torpor_hibernate_ms", &mut out);
        out
    }

    /// One policy round.
    pub fn run_policy(&self) {
        let now = Timestamp::now();
        let filter = SandboxFilter {
            states: vec![
                SandboxState::Running,
                SandboxState::Paused,
                SandboxState::Hibernated,
            ],
            ..Default::default()
        };
        let Ok(sandboxes) = self.store.list_sandboxes(&filter) else {
            return;
        };
        for s in &sandboxes {
            if s.expires_at.is_some_and(|t| t.0 <= now.0) {
                tracing::info!(sandbox = %s.id, "timeout reached; deleting");
                let _ = self.delete_sandbox(&s.id);
            } else if s.state == SandboxState::Running
                && now.0 - s.last_active_at.0 >= s.keep_alive_ms as i64
            {
                tracing::info!(sandbox = %s.id, "idle past its keep-alive; hibernating");
                if let Err(e) = self.hibernate(&s.id) {
                    tracing::warn!(sandbox = %s.id, "idle hibernation failed: {e}");
                }
            } else if s.state != SandboxState::Hibernated {
                self.check_vmm_alive(s);
            }
        }
        self.enforce_watermark();
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
        let gone = exited.is_some() || s.vmm.as_ref().is_some_and(|h| !vmm::alive(h.pid));
        if !gone {
            return;
        }
        let lock = self.lock_for(&s.id);
        let _guard = lock.lock().unwrap_or_else(|e| e.into_inner());
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
            Some(status) => format!("its VMM exited unexpectedly ({status})"),
            None => "its VMM process disappeared".into(),
        };
        tracing::warn!(sandbox = %s.id, "{reason}");
        let _ = self.store.set_sandbox_vmm(&s.id, None);
        let _ =
            self.store
                .update_sandbox_state(&s.id, s.state, SandboxState::Failed, Some(&reason));
    }

    /// Hibernates least recently used running sandboxes while the pod's
    /// PSS is above its high watermark.
    fn enforce_watermark(&self) {
        let Ok(pod) = self.store.get_pod(&PodId::new(LOCAL_POD)) else {
            return;
        };
        let limit = pod.memory_bytes as f64 * pod.high_watermark;
        let filter = SandboxFilter {
            states: vec![SandboxState::Running, SandboxState::Paused],
            ..Default::default()
        };
        let Ok(mut live) = self.store.list_sandboxes(&filter) else {
            return;
        };
        let pss =
            |s: &crate::model::Sandbox| s.vmm.as_ref().map_or(0, |h| vmm::pss_kib(h.pid)) * 1024;
        let mut total: u64 = live.iter().map(pss).sum();
        live.sort_by_key(|s| s.last_active_at.0);
        for s in live {
            if (total as f64) <= limit {
                break;
            }
            let freed = pss(&s);
            tracing::info!(sandbox = %s.id, "pod above its high watermark; hibernating the least recently used");
            if self.hibernate(&s.id).is_ok() {
                total = total.saturating_sub(freed);
            }
        }
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
