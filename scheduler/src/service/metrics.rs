//! The Prometheus metrics of `GET /metrics`: what the operations count
//! (restores, wakes, hibernations, execs and their latency histograms) and
//! what a scrape measures (sandboxes by state, the pods' memory, the VMMs'
//! page faults, the standby pool), encoded by `prometheus-client` in the
//! Prometheus text format 0.0.4.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use prometheus_client::encoding::prometheus_text;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use torpor_sync::Locked;

use super::vmm::{self, PageFaults};
use super::{Service, LOCAL_POD};
use crate::state::SandboxState;
use crate::store::SandboxFilter;

/// Latency histogram bucket bounds, in ms.
const BUCKETS_MS: [f64; 12] = [
    1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0,
];

/// One label and its value.
type Label<V> = [(&'static str, V); 1];
/// Operation counts by `result` (`ok` or `failed`).
type Outcomes = Family<Label<&'static str>, Counter>;
/// A gauge with a `u64` value.
type GaugeU64 = Gauge<u64, std::sync::atomic::AtomicU64>;

/// Page faults of the pod's sandbox VMMs, as counters that never go back:
/// what ended VMMs took stays in `ended`.
#[derive(Default, Debug)]
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

/// What the operations feed the metrics with. The counters and histograms
/// are shared handles: each scrape registers them in its registry.
#[derive(Debug)]
pub struct Metrics {
    /// Restores by (path, backend).
    restores: Family<[(&'static str, String); 2], Counter>,
    restore_vmm: Histogram,
    resume: Histogram,
    hibernate: Histogram,
    exec: Histogram,
    wakes: Outcomes,
    hibernations: Outcomes,
    execs: Outcomes,
    /// Object store (`--object-store`): layers uploaded and fetched by
    /// result, their time, and the bytes they moved.
    uploads: Outcomes,
    fetches: Outcomes,
    upload_ms: Histogram,
    fetch_ms: Histogram,
    sent_bytes: Counter,
    /// Data bytes (not holes) of the layers uploaded, and of those the
    /// content bytes their new chunks added: the store's dedupe ratio is
    /// the first over the second.
    layer_data_bytes: Counter,
    new_bytes: Counter,
    fetched_bytes: Counter,
    /// Bytes lazy wakes fetched after their restore started.
    arrived_bytes: Counter,
    faults: Mutex<FaultBook>,
}

impl Default for Metrics {
    fn default() -> Self {
        let outcomes = || {
            let family = Outcomes::default();
            for result in ["ok", "failed"] {
                drop(family.get_or_create(&[("result", result)]));
            }
            family
        };
        Self {
            restores: Family::default(),
            restore_vmm: Histogram::new(BUCKETS_MS),
            resume: Histogram::new(BUCKETS_MS),
            hibernate: Histogram::new(BUCKETS_MS),
            exec: Histogram::new(BUCKETS_MS),
            wakes: outcomes(),
            hibernations: outcomes(),
            execs: outcomes(),
            uploads: outcomes(),
            fetches: outcomes(),
            upload_ms: Histogram::new(BUCKETS_MS),
            fetch_ms: Histogram::new(BUCKETS_MS),
            sent_bytes: Counter::default(),
            layer_data_bytes: Counter::default(),
            new_bytes: Counter::default(),
            fetched_bytes: Counter::default(),
            arrived_bytes: Counter::default(),
            faults: Mutex::default(),
        }
    }
}

fn result(ok: bool) -> Label<&'static str> {
    [("result", if ok { "ok" } else { "failed" })]
}

impl Metrics {
    /// A create or wake's restore: which path, which backend, how long
    /// the VMM took.
    pub fn observe_restore(&self, r: &crate::model::RestoreReport) {
        self.restores
            .get_or_create(&[
                ("path", r.path.as_str().into()),
                ("backend", r.backend.clone()),
            ])
            .inc();
        self.restore_vmm.observe(r.vmm_ms);
    }

    /// A wake that restored the sandbox, in `ms`.
    pub fn observe_resume(&self, ms: f64) {
        self.resume.observe(ms);
        self.wakes.get_or_create(&result(true)).inc();
    }

    /// A wake that failed (the sandbox went back to hibernated).
    pub fn wake_failed(&self) {
        self.wakes.get_or_create(&result(false)).inc();
    }

    /// A hibernation that completed, in `ms`.
    pub fn observe_hibernate(&self, ms: f64) {
        self.hibernate.observe(ms);
        self.hibernations.get_or_create(&result(true)).inc();
    }

    /// A hibernation that failed (the sandbox was resumed).
    pub fn hibernate_failed(&self) {
        self.hibernations.get_or_create(&result(false)).inc();
    }

    /// An exec the agent was asked to run, its duration, and whether it
    /// answered with an exit (a non-zero exit status is still `ok`).
    pub fn observe_exec(&self, ms: f64, ok: bool) {
        self.exec.observe(ms);
        self.execs.get_or_create(&result(ok)).inc();
    }

    /// A layer upload to the object store: its time and its report, or
    /// None when it failed.
    pub fn observe_upload(&self, ms: f64, report: Option<&torpor_storage::UploadReport>) {
        self.uploads.get_or_create(&result(report.is_some())).inc();
        if let Some(r) = report {
            self.upload_ms.observe(ms);
            self.sent_bytes.inc_by(r.uploaded_bytes);
            self.layer_data_bytes.inc_by(r.data_bytes);
            self.new_bytes.inc_by(r.new_bytes);
        }
    }

    /// A layer fetched whole from the object store: its time and the
    /// (compressed) bytes it read, or None when it failed.
    pub fn observe_fetch(&self, ms: f64, fetched: Option<u64>) {
        self.fetches.get_or_create(&result(fetched.is_some())).inc();
        if let Some(bytes) = fetched {
            self.fetch_ms.observe(ms);
            self.fetched_bytes.inc_by(bytes);
        }
    }

    /// A lazy wake's memory file arrived: the bytes fetched meanwhile.
    pub fn observe_arrival(&self, bytes: u64) {
        self.arrived_bytes.inc_by(bytes);
    }

    /// A sandbox VMM about to be stopped: its page faults stay counted.
    pub fn vmm_ending(&self, pid: u32) {
        self.faults.locked().retire(pid);
    }
}

impl Service {
    /// Prometheus text exposition (format 0.0.4). `prometheus-client`
    /// appends a period to each help text registered.
    pub fn metrics(&self) -> String {
        let mut reg = Registry::default();
        let all = self
            .store
            .list_sandboxes(&SandboxFilter::default())
            .unwrap_or_default();
        let by_state = Family::<Label<String>, GaugeU64>::default();
        for state in SandboxState::ALL
            .iter()
            .filter(|s| **s != SandboxState::Deleted)
        {
            let n = all.iter().filter(|s| s.state == *state).count();
            by_state
                .get_or_create(&[("state", state.to_string())])
                .set(n as u64);
        }
        reg.register("torpor_sandboxes", "Sandboxes by state", by_state);
        if let Ok(pods) = self.list_pods() {
            let pss = Family::<Label<String>, GaugeU64>::default();
            let committed = Family::<Label<String>, GaugeU64>::default();
            let resident = Family::<Label<String>, GaugeU64>::default();
            for p in &pods {
                let pod = [("pod", p.pod.id.to_string())];
                pss.get_or_create(&pod).set((p.pss_mib * 1048576.0) as u64);
                resident
                    .get_or_create(&pod)
                    .set((p.resident_mib * 1048576.0) as u64);
                committed.get_or_create(&pod).set(p.committed_mib << 20);
            }
            reg.register(
                "torpor_pod_pss_bytes",
                "Measured PSS of the pod's VMM processes",
                pss,
            );
            reg.register(
                "torpor_pod_resident_bytes",
                "Resident memory of the pod's sandboxes (their VMM cgroups' usage less inactive page cache), what its pressure marks count",
                resident,
            );
            reg.register(
                "torpor_pod_committed_bytes",
                "Memory of the pod's sandboxes that hold a VMM",
                committed,
            );
        }
        let m = &self.metrics;
        // Both paths appear for the configured backend, restored or not.
        for path in ["standby", "cold"] {
            let backend = self.config.memory_backend.name().to_string();
            drop(
                m.restores
                    .get_or_create(&[("path", path.into()), ("backend", backend)]),
            );
        }
        reg.register(
            "torpor_restores",
            "Restores of creates and wakes, by path (standby shell or cold VMM) and memory backend",
            m.restores.clone(),
        );
        reg.register(
            "torpor_restore_vmm_ms",
            "VMM-side restore time of creates and wakes (shell request to running, or cold spawn to ready), in ms",
            m.restore_vmm.clone(),
        );
        self.register_local_pod(&all, reg.sub_registry_with_label(pod_label()));
        self.network_metrics(&mut reg);
        self.memory_metrics(&mut reg, &all);
        for (name, help, family) in [
            (
                "torpor_wakes",
                "Wakes of hibernated sandboxes by result",
                &m.wakes,
            ),
            (
                "torpor_hibernations",
                "Hibernations by result",
                &m.hibernations,
            ),
            (
                "torpor_execs",
                "Execs through the guest agent by result (failed: no exit status)",
                &m.execs,
            ),
            (
                "torpor_object_store_uploads",
                "Snapshot layers uploaded to the object store by result",
                &m.uploads,
            ),
            (
                "torpor_object_store_fetches",
                "Snapshot layers fetched whole from the object store by result",
                &m.fetches,
            ),
        ] {
            reg.register(name, help, family.clone());
        }
        for (name, help, histogram) in [
            (
                "torpor_resume_ms",
                "Latency of waking a hibernated sandbox, in ms",
                &m.resume,
            ),
            (
                "torpor_hibernate_ms",
                "Latency of hibernating a sandbox, in ms",
                &m.hibernate,
            ),
            (
                "torpor_exec_ms",
                "Duration of execs through the guest agent, in ms",
                &m.exec,
            ),
            (
                "torpor_object_store_upload_ms",
                "Duration of snapshot layer uploads to the object store that succeeded, in ms",
                &m.upload_ms,
            ),
            (
                "torpor_object_store_fetch_ms",
                "Duration of whole snapshot layer fetches from the object store that succeeded, in ms",
                &m.fetch_ms,
            ),
        ] {
            reg.register(name, help, histogram.clone());
        }
        for (name, help, counter) in [
            (
                "torpor_object_store_sent_bytes",
                "Bytes uploads sent to the object store (new chunks, compressed and framed)",
                &m.sent_bytes,
            ),
            (
                "torpor_object_store_layer_data_bytes",
                "Data bytes (not holes) of the snapshot layers uploaded to the object store",
                &m.layer_data_bytes,
            ),
            (
                "torpor_object_store_new_bytes",
                "Content bytes of the chunks uploads added to the object store (uncompressed): layer_data_bytes over this is the dedupe ratio",
                &m.new_bytes,
            ),
            (
                "torpor_object_store_fetched_bytes",
                "Bytes fetched from the object store before a restore (whole layers; a lazy wake's small files and working set), compressed and framed",
                &m.fetched_bytes,
            ),
            (
                "torpor_object_store_arrived_bytes",
                "Bytes lazy wakes fetched from the object store while their guest ran",
                &m.arrived_bytes,
            ),
        ] {
            reg.register(name, help, counter.clone());
        }
        let mut out = String::new();
        // Writing to a `String` cannot fail.
        let _ = prometheus_text::encode(&mut out, &reg);
        out
    }

    /// The metrics of the local pod, the only one whose VMMs this service
    /// can measure: page faults of its VMMs and its standby pool.
    fn register_local_pod(&self, all: &[crate::model::Sandbox], reg: &mut Registry) {
        let pids: HashSet<u32> = all
            .iter()
            .filter_map(|s| s.vmm.as_ref().map(|h| h.pid))
            .collect();
        let faults = self.metrics.faults.locked().sample(&pids);
        for (name, kind, n) in [
            ("torpor_pod_vmm_minor_page_faults", "Minor", faults.minor),
            ("torpor_pod_vmm_major_page_faults", "Major", faults.major),
        ] {
            let help = format!(
                "{kind} page faults of the pod's sandbox VMM processes, ended ones included"
            );
            reg.register(name, help, ConstCounter::new(n));
        }
        let pool = self.pool.stats();
        for (name, help, n) in [
            (
                "torpor_standby_shells",
                "Standby shells ready in the pool",
                pool.ready,
            ),
            (
                "torpor_standby_shells_target",
                "Standby shells the pool aims at now (its minimum per shape, grown by bursts)",
                pool.target,
            ),
            (
                "torpor_standby_shells_making",
                "Standby shells being made now",
                pool.making,
            ),
        ] {
            reg.register(name, help, ConstGauge::new(n as u64));
        }
        for (name, help, n) in [
            (
                "torpor_standby_shells_made",
                "Standby shells made",
                pool.made,
            ),
            (
                "torpor_standby_shells_taken",
                "Creates and wakes that took a standby shell",
                pool.taken,
            ),
            (
                "torpor_standby_shells_missed",
                "Creates and wakes that found no standby shell ready",
                pool.missed,
            ),
            (
                "torpor_standby_shells_shrunk",
                "Standby shells stopped as the pool shrank back after a burst",
                pool.shrunk,
            ),
        ] {
            reg.register(name, help, ConstCounter::new(n));
        }
        self.register_chunk_cache(reg);
    }

    /// The pod's chunk cache (`--chunk-cache-mib`), when it has one.
    fn register_chunk_cache(&self, reg: &mut Registry) {
        let Some(cache) = self.objects.as_ref().and_then(|o| o.storage().cache()) else {
            return;
        };
        let s = cache.stats();
        for (name, help, n) in [
            (
                "torpor_chunk_cache_hits",
                "Chunks of fetched layers read from the pod's chunk cache",
                s.hits,
            ),
            (
                "torpor_chunk_cache_fetches",
                "Chunks the pod's chunk cache fetched from the object store",
                s.fetches,
            ),
            (
                "torpor_chunk_cache_fetched_bytes",
                "Stored bytes the pod's chunk cache fetched from the object store",
                s.fetched_bytes,
            ),
            (
                "torpor_chunk_cache_evictions",
                "Chunks the pod's chunk cache dropped to stay within its bound",
                s.evictions,
            ),
        ] {
            reg.register(name, help, ConstCounter::new(n));
        }
        for (name, help, n) in [
            (
                "torpor_chunk_cache_bytes",
                "Bytes of chunks in the pod's chunk cache",
                s.bytes,
            ),
            (
                "torpor_chunk_cache_limit_bytes",
                "The bound of the pod's chunk cache (--chunk-cache-mib)",
                cache.limit(),
            ),
        ] {
            reg.register(name, help, ConstGauge::new(n));
        }
    }
}

/// The `pod` label of the local pod's series.
fn pod_label() -> (Cow<'static, str>, Cow<'static, str>) {
    (Cow::Borrowed("pod"), Cow::Borrowed(LOCAL_POD))
}
