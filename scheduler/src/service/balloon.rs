//! The pod's side of guest memory ballooning: the policy asks an idle
//! sandbox's guest to give memory back (`crate::policy::balloon_target`
//! decides how much) and gives it back to the guest once the sandbox is
//! active again. VMMs without a balloon (the probe guest, sandboxes booted
//! before it existed) answer `unsupported` and are asked once per idle
//! spell, like the others. Also each running sandbox's memory as the host
//! and its guest see it (`GET /v1/sandboxes/{id}`'s `memory`, `/metrics`).

use std::collections::HashMap;
use std::sync::Mutex;

use torpor_sync::Locked;
use torpor_vmm_api::control::Request;

use super::vmm;
use super::Service;
use crate::model::{Sandbox, SandboxId, SandboxMemory, Timestamp};
use crate::policy::balloon_target;

/// When each sandbox's guest was last asked to shrink (until it is active
/// again), and its VMM's PSS then (kept for `memory`).
#[derive(Default, Debug)]
pub struct Shrunk {
    asked: Mutex<HashMap<SandboxId, Timestamp>>,
    pss_before: Mutex<HashMap<SandboxId, (Timestamp, u64)>>,
}

impl Shrunk {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<SandboxId, Timestamp>> {
        self.asked.locked()
    }

    fn pss_before(&self) -> std::sync::MutexGuard<'_, HashMap<SandboxId, (Timestamp, u64)>> {
        self.pss_before.locked()
    }
}

impl Service {
    /// [`crate::policy::PolicyDriver::shrink`] for the service: reads the
    /// balloon's statistics and sets its target, unless the sandbox is
    /// busy or was asked since its last activity.
    pub(super) fn policy_shrink(&self, s: &Sandbox) -> u64 {
        let Some(handle) = s.vmm.as_ref() else {
            return 0;
        };
        if self
            .shrunk
            .map()
            .get(&s.id)
            .is_some_and(|at| at.0 >= s.last_active_at.0)
        {
            return 0;
        }
        let Some(_guard) = self.locks.try_lock(&s.id) else {
            return 0;
        };
        if self.in_flight.contains(&s.id) {
            return 0;
        }
        let now = Timestamp::now();
        self.shrunk.map().insert(s.id.clone(), now);
        if let Some(kib) = vmm::pss_kib(handle.pid) {
            self.shrunk
                .pss_before()
                .insert(s.id.clone(), (now, kib << 10));
        }
        let Some(balloon) = vmm::peek(handle, &Request::BalloonStats).map(|r| r.balloon) else {
            tracing::debug!(sandbox = %s.id, "no balloon to shrink, or its VMM is busy");
            return 0;
        };
        let Some((target_mib, expected)) = balloon.as_ref().and_then(balloon_target) else {
            return 0;
        };
        match vmm::call(handle, &Request::SetBalloon { target_mib }) {
            Ok(_) => {
                tracing::info!(
                    sandbox = %s.id,
                    target_mib,
                    expected_mib = expected >> 20,
                    "pod above its high watermark; asked an idle guest to shrink"
                );
                expected
            }
            Err(e) => {
                tracing::warn!(sandbox = %s.id, "cannot set the balloon target: {e}");
                0
            }
        }
    }

    /// A shrunk sandbox that was active since it was asked gets its memory
    /// back (balloon target 0); the record goes either way once answered.
    pub(super) fn regrow_if_active(&self, s: &Sandbox) {
        let asked = self.shrunk.map().get(&s.id).copied();
        let Some(at) = asked.filter(|at| at.0 < s.last_active_at.0) else {
            return;
        };
        let Some(handle) = s.vmm.as_ref() else {
            return;
        };
        match vmm::call(handle, &Request::SetBalloon { target_mib: 0 }) {
            Ok(_) => {
                tracing::info!(sandbox = %s.id, "active again; balloon deflated");
                self.forget_shrink(&s.id, at);
            }
            // Nothing to give back on a VMM without a balloon.
            Err(super::ServiceError::Vm(e)) if e.kind == torpor_vmm_api::ErrorKind::Unsupported => {
                self.forget_shrink(&s.id, at)
            }
            Err(e) => tracing::warn!(sandbox = %s.id, "cannot deflate the balloon: {e}"),
        }
    }

    fn forget_shrink(&self, id: &SandboxId, at: Timestamp) {
        let mut map = self.shrunk.map();
        if map.get(id).is_some_and(|t| t.0 == at.0) {
            map.remove(id);
        }
    }
}

impl Service {
    /// A running sandbox's memory: its VMM's PSS, and what its balloon
    /// says (the guest's statistics, refreshed by the asking); `None`
    /// without a VMM, or when the VMM is gone.
    pub(super) fn read_memory(&self, s: &Sandbox) -> Option<SandboxMemory> {
        let handle = s.vmm.as_ref()?;
        let mut m = SandboxMemory {
            pss_bytes: vmm::pss_kib(handle.pid)? << 10,
            resident_bytes: super::resident::resident_bytes(handle),
            ..SandboxMemory::default()
        };
        if let Some((at, before)) = self.shrunk.pss_before().get(&s.id).copied() {
            m.shrunk_at = Some(at);
            m.shrink_pss_before_bytes = Some(before);
        }
        // No balloon (the probe guest) or a VMM busy elsewhere: PSS only.
        if let Some(b) = vmm::peek(handle, &Request::BalloonStats).and_then(|r| r.balloon) {
            m.balloon_target_mib = Some(b.target_mib);
            m.balloon_actual_mib = Some(b.actual_mib);
            m.reported_bytes = Some(b.counters.reported_bytes);
            if let Some(g) = &b.guest {
                m.guest_total_bytes = g.total_memory;
                m.guest_free_bytes = g.free_memory;
                m.guest_available_bytes = g.available_memory;
                m.guest_used_bytes = g
                    .total_memory
                    .zip(g.free_memory)
                    .map(|(t, f)| t.saturating_sub(f));
                m.guest_stats_age_ms = b.stats_age_ms;
            }
        }
        Some(m)
    }

    /// Forgets a deleted sandbox's shrink record.
    pub(super) fn forget_memory(&self, id: &SandboxId) {
        self.shrunk.map().remove(id);
        self.shrunk.pss_before().remove(id);
    }

    /// Per-sandbox memory in the Prometheus text: VMM PSS, the guest's
    /// used and free memory, and its balloon, by `sandbox`.
    pub(super) fn memory_metrics(
        &self,
        reg: &mut prometheus_client::registry::Registry,
        sandboxes: &[Sandbox],
    ) {
        use prometheus_client::metrics::family::Family;
        use prometheus_client::metrics::gauge::Gauge;
        type Pick = fn(&SandboxMemory) -> Option<u64>;
        let series: [(&str, &str, Pick); 7] = [
            (
                "torpor_sandbox_memory_pss_bytes",
                "PSS of the sandbox's VMM process",
                |m| Some(m.pss_bytes),
            ),
            (
                "torpor_sandbox_memory_resident_bytes",
                "Resident memory of the sandbox: its VMM cgroup's usage less inactive page cache (PSS without a cgroup)",
                |m| m.resident_bytes,
            ),
            (
                "torpor_sandbox_guest_memory_used_bytes",
                "Memory the sandbox's guest uses (total less free, as its balloon driver reports)",
                |m| m.guest_used_bytes,
            ),
            (
                "torpor_sandbox_guest_memory_free_bytes",
                "Free memory the sandbox's guest reports",
                |m| m.guest_free_bytes,
            ),
            (
                "torpor_sandbox_guest_memory_available_bytes",
                "Available memory the sandbox's guest reports",
                |m| m.guest_available_bytes,
            ),
            (
                "torpor_sandbox_balloon_bytes",
                "Memory the sandbox's guest holds in its balloon",
                |m| m.balloon_actual_mib.map(|v| v << 20),
            ),
            (
                "torpor_sandbox_memory_reported_bytes",
                "Free memory the sandbox's guest reported to the host since its VMM started",
                |m| m.reported_bytes,
            ),
        ];
        let read: Vec<(&Sandbox, SandboxMemory)> = sandboxes
            .iter()
            .filter_map(|s| self.read_memory(s).map(|m| (s, m)))
            .collect();
        for (name, help, pick) in series {
            let family = Family::<
                [(&'static str, String); 1],
                Gauge<u64, std::sync::atomic::AtomicU64>,
            >::default();
            let mut any = false;
            for (s, m) in &read {
                if let Some(v) = pick(m) {
                    family
                        .get_or_create(&[("sandbox", s.id.to_string())])
                        .set(v);
                    any = true;
                }
            }
            // A family with no sandbox to show is left out (not an empty
            // HELP/TYPE pair).
            if any {
                reg.register(name, help, family);
            }
        }
    }
}
