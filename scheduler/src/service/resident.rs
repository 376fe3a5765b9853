//! Resident memory of a sandbox, measured from its VMM's own cgroup (the
//! jail's `torpor/...`, on cgroup v1 or v2): what the kernel charges it
//! (guest pages, the VMM's own, shmem) less the page cache it could drop
//! at once (`inactive_file`), the "working set" the kernel's OOM killer and
//! reclaim see. A VMM without a cgroup of its own (`serve --no-jail`) is
//! measured by its PSS instead. The one reader of resident memory: the
//! pressure policy, the pressure gate of creates and wakes, the metrics
//! and `GET /v1/pods`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use torpor_sync::Locked;

use super::{vmm, Service, ServiceError, LOCAL_POD};
use crate::model::{PodId, Sandbox, SandboxId, TemplateId, VmmHandle};
use crate::store::admission::HOLDING_VMM;
use crate::store::SandboxFilter;

/// How long the pressure gate reuses a measurement of the pod's resident
/// memory (a burst of creates reads the cgroups once); what the gate
/// admits meanwhile is added to it.
const MEASURE_REUSE: Duration = Duration::from_millis(100);

/// How long after its create or wake a sandbox counts at least what its
/// template's sandboxes hold ([`crate::policy::PRESSURE_SETTLE_MS`]).
const SETTLE: Duration = Duration::from_millis(crate::policy::PRESSURE_SETTLE_MS);

/// What a create, wake or build asks of the pressure gate.
#[derive(Debug, Clone, Copy)]
pub(super) struct Ask<'a> {
    /// The sandbox it starts (none for a template build).
    pub sandbox: Option<&'a SandboxId>,
    /// Its template, whose settled sandboxes say what it will hold.
    pub template: Option<&'a TemplateId>,
    /// Its memory size: what admission counts.
    pub mem_mib: u32,
}

impl<'a> Ask<'a> {
    /// A create or wake of `sandbox`.
    pub fn sandbox(sandbox: &'a Sandbox) -> Self {
        Ask {
            sandbox: Some(&sandbox.id),
            template: Some(&sandbox.template),
            mem_mib: sandbox.mem_mib,
        }
    }

    /// A template build of `mem_mib` (its guest is measured as no
    /// sandbox's).
    pub fn build(mem_mib: u32) -> Self {
        Ask {
            sandbox: None,
            template: None,
            mem_mib,
        }
    }
}

/// The pod's resident memory, measured: the total, and per template what
/// its sandboxes hold (the most a settled one holds).
#[derive(Debug, Clone, Default)]
struct Measure {
    at: Option<Instant>,
    /// A VMM ended since it was taken ([`LastMeasure::forget`]): it
    /// counts memory already free, so it may admit but not refuse.
    stale: bool,
    total: u64,
    most_by_template: HashMap<TemplateId, u64>,
}

/// The pressure gate's memory: the last measure, and the sandboxes it
/// admitted within [`SETTLE`] with what each was expected to hold.
#[derive(Debug, Default)]
pub struct LastMeasure(Mutex<Gate>);

#[derive(Debug, Default)]
struct Gate {
    measure: Measure,
    /// Per template, the most one of its sandboxes held when one was last
    /// measured (kept while none runs: a wake of the last one hibernated).
    known: HashMap<TemplateId, u64>,
    admitted: HashMap<SandboxId, (Instant, u64)>,
}

impl LastMeasure {
    /// A VMM ended and its memory went back: the measure still counts
    /// it, so the next gate measures again before it refuses (a wake
    /// right after a hibernation would be refused for memory already
    /// free); what the over-count admits anyway it admits without a
    /// new measure, so a create after each delete does not list and read
    /// every VMM's cgroup again.
    pub fn forget(&self) {
        self.0.locked().measure.stale = true;
    }
}

impl Gate {
    /// What a sandbox of `ask` is expected to hold once settled: the most
    /// one of its template's holds; nothing more than it will measure
    /// when none has been measured yet (a template build's guest, a
    /// template's first sandboxes: no guess better than a size, which
    /// would refuse a pod at ratio 1 before it is full).
    fn expected(&self, ask: &Ask<'_>) -> u64 {
        ask.template
            .and_then(|t| self.known.get(t).copied())
            .unwrap_or(0)
    }

    /// Takes a new measure, and what it says of templates.
    fn remeasure(&mut self, service: &Service) {
        self.admitted.retain(|_, (at, _)| at.elapsed() < SETTLE);
        self.measure = service.measure_resident(&self.admitted, &self.known);
        for (t, most) in &self.measure.most_by_template {
            self.known.insert(t.clone(), *most);
        }
    }
}

impl Service {
    /// The local pod's resident memory as the pressure gate last measured
    /// it (None before its first measure), without measuring.
    pub(super) fn last_resident_bytes(&self) -> Option<u64> {
        let gate = self.last_resident.0.locked();
        gate.measure.at.map(|_| gate.measure.total)
    }

    /// The local pod's resident memory now: the sum over its sandboxes
    /// that hold a VMM.
    pub fn pod_resident_bytes(&self) -> u64 {
        self.measure_resident(&HashMap::new(), &HashMap::new())
            .total
    }

    /// The local pod's resident memory per sandbox holding a VMM, each
    /// counted at least at what its template's hold (measured now, else
    /// `known`, else what it was `admitted` to hold) while it settles.
    fn measure_resident(
        &self,
        admitted: &HashMap<SandboxId, (Instant, u64)>,
        known: &HashMap<TemplateId, u64>,
    ) -> Measure {
        let filter = SandboxFilter {
            states: HOLDING_VMM.to_vec(),
            ..Default::default()
        };
        // This process's mount table once for the whole pod, not per VMM.
        let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
        let mut measure = Measure {
            at: Some(Instant::now()),
            ..Default::default()
        };
        let measured: Vec<(Sandbox, Option<u64>)> = self
            .store
            .list_sandboxes(&filter)
            .unwrap_or_default()
            .into_iter()
            .map(|s| {
                // One being started may have no VMM to measure yet.
                let bytes = s.vmm.as_ref().and_then(|h| resident_bytes_in(h, &mounts));
                (s, bytes)
            })
            .collect();
        let settling = |id: &SandboxId| {
            admitted
                .get(id)
                .filter(|(at, _)| at.elapsed() < SETTLE)
                .map(|(_, expected)| *expected)
        };
        // What a template's sandboxes hold: the most a settled one holds;
        // while all settle, the most of what was known and what they hold.
        let mut settled: HashMap<&TemplateId, u64> = HashMap::new();
        let mut fresh: HashMap<&TemplateId, u64> = HashMap::new();
        for (s, bytes) in &measured {
            let Some(bytes) = *bytes else { continue };
            let most = match settling(&s.id) {
                None => settled.entry(&s.template).or_default(),
                Some(_) => fresh.entry(&s.template).or_default(),
            };
            *most = (*most).max(bytes);
        }
        for (t, most) in fresh {
            if !settled.contains_key(t) {
                let known = known.get(t).copied().unwrap_or(0);
                measure.most_by_template.insert(t.clone(), most.max(known));
            }
        }
        for (t, most) in settled {
            measure.most_by_template.insert(t.clone(), most);
        }
        for (s, bytes) in &measured {
            // While it settles, at least what its template's hold (or
            // what it was admitted to hold).
            let floor = settling(&s.id).map_or(0, |expected| {
                let most = measure.most_by_template.get(&s.template);
                most.or(known.get(&s.template)).copied().unwrap_or(expected)
            });
            measure.total += bytes.unwrap_or(0).max(floor);
        }
        measure
    }

    /// The pressure gate of a create or wake ([`crate::policy::pressure_gate`]):
    /// refused when the local pod's resident memory and what `ask` is
    /// expected to hold would pass its hard mark. With `count`, one that
    /// passes adds what it expects to the measure the next ones reuse,
    /// and its sandbox counts at least that while it settles.
    pub(super) fn pressure_gate(&self, ask: &Ask<'_>, count: bool) -> Result<(), ServiceError> {
        let Ok(pod) = self.store.get_pod(&PodId::new(LOCAL_POD)) else {
            return Ok(());
        };
        let mut gate = self.last_resident.0.locked();
        if gate
            .measure
            .at
            .is_none_or(|at| at.elapsed() >= MEASURE_REUSE)
        {
            gate.remeasure(self);
        }
        let expected = gate.expected(ask);
        let check = |resident| {
            crate::policy::pressure_gate(pod.memory_bytes, pod.high_watermark, resident, expected)
        };
        let mut verdict = check(gate.measure.total);
        if verdict.is_err() && gate.measure.stale {
            // It counts a VMM that ended: refuse only on a fresh measure.
            gate.remeasure(self);
            verdict = check(gate.measure.total);
        }
        match verdict {
            Ok(()) => {
                if count {
                    gate.measure.total += expected;
                    if let Some(id) = ask.sandbox {
                        gate.admitted.insert(id.clone(), (Instant::now(), expected));
                    }
                }
                Ok(())
            }
            Err(r) => Err(ServiceError::Pressure {
                resident_mib: r.resident_mib,
                asked_mib: r.asked_mib,
                hard_mib: r.hard_mib,
                retry_after_s: self.config.policy_interval_ms.div_ceil(1000).max(1),
            }),
        }
    }
}

/// The directory every jail's cgroup is made in (`torpor/<name>`).
const JAIL_PARENT: &str = "torpor";

/// The cgroup files resident memory is read from, by version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Version {
    /// `memory.usage_in_bytes`, `memory.stat`'s `total_inactive_file`.
    V1,
    /// `memory.current`, `memory.stat`'s `inactive_file`.
    V2,
}

impl Version {
    fn files(self) -> (&'static str, &'static str) {
        match self {
            Version::V1 => ("memory.usage_in_bytes", "total_inactive_file"),
            Version::V2 => ("memory.current", "inactive_file"),
        }
    }
}

/// The bytes `handle`'s VMM holds resident: its cgroup's working set, or
/// its PSS when it has no cgroup of its own; `None` when it is gone.
pub fn resident_bytes(handle: &VmmHandle) -> Option<u64> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    resident_bytes_in(handle, &mounts)
}

/// [`resident_bytes`] with this process's mount table already read.
fn resident_bytes_in(handle: &VmmHandle, mounts: &str) -> Option<u64> {
    cgroup_resident_bytes_in(handle.pid, mounts)
        .or_else(|| vmm::pss_kib(handle.pid).map(|k| k << 10))
}

/// The working set of the memory cgroup `pid` is in, when that cgroup is
/// a jail's (`torpor/<name>`); `None` otherwise or when unreadable.
pub fn cgroup_resident_bytes(pid: u32) -> Option<u64> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    cgroup_resident_bytes_in(pid, &mounts)
}

/// [`cgroup_resident_bytes`] with this process's mount table (`mounts`).
fn cgroup_resident_bytes_in(pid: u32, mounts: &str) -> Option<u64> {
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    let (dir, version) = memory_cgroup_dir(&cgroups, mounts)?;
    let (usage_file, inactive_key) = version.files();
    let usage = read_number(&dir.join(usage_file))?;
    let stat = std::fs::read_to_string(dir.join("memory.stat")).ok()?;
    Some(working_set(usage, &stat, inactive_key))
}

fn read_number(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// `usage` less the `inactive_key` line of a `memory.stat` (`key value`
/// lines), never below zero.
fn working_set(usage: u64, stat: &str, inactive_key: &str) -> u64 {
    let inactive = stat
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(' ')?;
            (k == inactive_key).then(|| v.trim().parse::<u64>().ok())?
        })
        .unwrap_or(0);
    usage.saturating_sub(inactive)
}

/// The directory of a process's jail memory cgroup from its
/// `/proc/PID/cgroup` and this process's `/proc/self/mounts`: the v1
/// memory hierarchy's line (`N:...memory...:/torpor/x`) or the unified
/// one's (`0::/torpor/x`), whichever names a jail's cgroup, under the
/// mount of that hierarchy.
fn memory_cgroup_dir(cgroups: &str, mounts: &str) -> Option<(PathBuf, Version)> {
    let jailed = |path: &str| {
        let parent = Path::new(path).parent()?;
        (parent.file_name()? == JAIL_PARENT).then(|| path.trim_start_matches('/').to_string())
    };
    let mount_of = |fstype: &str, option: Option<&str>| {
        mounts.lines().find_map(|l| {
            let mut f = l.split_whitespace();
            let (_, dir, fs, opts) = (f.next()?, f.next()?, f.next()?, f.next()?);
            let fits = fs == fstype && option.is_none_or(|o| opts.split(',').any(|x| x == o));
            fits.then(|| PathBuf::from(dir))
        })
    };
    cgroups.lines().find_map(|line| {
        let mut f = line.splitn(3, ':');
        let (_, controllers, path) = (f.next()?, f.next()?, f.next()?);
        let rel = jailed(path)?;
        if controllers.split(',').any(|c| c == "memory") {
            Some((mount_of("cgroup", Some("memory"))?.join(rel), Version::V1))
        } else if controllers.is_empty() {
            Some((mount_of("cgroup2", None)?.join(rel), Version::V2))
        } else {
            None
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTS: &str = "tmpfs /sys/fs/cgroup tmpfs rw 0 0\n\
        cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0\n\
        cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0\n\
        cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0\n";

    #[test]
    fn a_jail_is_found_under_its_hierarchys_mount() {
        let cases = [
            // v1: the memory controller's line, under its mount.
            (
                "4:memory:/torpor/12-0-1-200001\n1:cpu:/torpor/12-0-1-200001\n0::/\n",
                MOUNTS,
                "/sys/fs/cgroup/memory/torpor/12-0-1-200001",
                Version::V1,
            ),
            // v2: the unified line (the v1 memory line is the service's).
            (
                "4:memory:/process_api/x\n0::/torpor/12-0-1-200001\n",
                "cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n",
                "/sys/fs/cgroup/torpor/12-0-1-200001",
                Version::V2,
            ),
        ];
        for (cgroups, mounts, dir, version) in cases {
            let found = memory_cgroup_dir(cgroups, mounts);
            assert_eq!(found, Some((PathBuf::from(dir), version)), "{cgroups}");
        }
    }

    #[test]
    fn a_process_outside_a_jail_has_no_cgroup_of_its_own() {
        // The service's own cgroup (no jail): PSS is used instead.
        let cgroups = "4:memory:/process_api/x\n0::/\n";
        assert_eq!(memory_cgroup_dir(cgroups, MOUNTS), None);
        // A jail on a hierarchy this process cannot see.
        assert_eq!(
            memory_cgroup_dir("0::/torpor/a\n", MOUNTS.lines().next().unwrap()),
            None
        );
    }

    #[test]
    fn the_working_set_leaves_out_inactive_page_cache() {
        let v1 = "cache 400\ntotal_cache 400\ninactive_file 10\ntotal_inactive_file 300\n";
        assert_eq!(working_set(1000, v1, Version::V1.files().1), 700);
        let v2 = "anon 600\nfile 400\ninactive_file 300\n";
        assert_eq!(working_set(1000, v2, Version::V2.files().1), 700);
        // Never below zero, and no stat line: all of the usage.
        assert_eq!(working_set(100, v2, "inactive_file"), 0);
        assert_eq!(working_set(100, "", "inactive_file"), 100);
    }
}
