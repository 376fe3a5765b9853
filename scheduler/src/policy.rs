//! The pod's policy decisions, free of the store, the clock and the VMMs:
//! admission (does a sandbox's memory fit the pod's memory times its
//! oversubscription ratio) and one policy round (delete or hibernate
//! sandboxes past their timeout, hibernate those idle past their
//! keep-alive, then, once the pod's resident memory is above its high
//! mark, ask idle sandboxes' guests to give memory back (a balloon target)
//! and only then hibernate the least recently used, several at once
//! ([`pressure_batch`]), until
//! it is below its low mark) and the pressure gate (past the hard mark,
//! creates and wakes wait: 429 with `Retry-After`).
//!
//! One home for these rules, two drivers: `torpor serve` drives them with
//! the store, the wall clock and real VMMs (`service/policy.rs`,
//! `store/admission.rs`); `torpor plan` drives them with a simulated clock
//! and a simulated pod (`crate::plan`). Neither re-implements them.

use crate::model::{OnTimeout, Pod, Sandbox, Timestamp};
use crate::state::SandboxState;
use torpor_vmm_api::control::BalloonStatus;

/// Why the policy hibernates a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyReason {
    /// Idle past its keep-alive.
    Idle,
    /// The pod is above its high watermark; least recently used first.
    Watermark,
    /// The timeout of a sandbox whose `on_timeout` is hibernate.
    Timeout,
}

/// The pod's pressure marks, fractions of its memory, all from its high
/// watermark `h` (`PATCH /v1/pods/{id}`): reclaim starts above `h` and
/// goes on until resident memory is below `low` ([`LOW_MARK_OF_HIGH`] of
/// `h`); above `hard` (halfway from `h` to all of it) creates and wakes
/// are refused. At the default 0.9: 0.81, 0.9, 0.95.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Marks {
    pub low: f64,
    pub high: f64,
    pub hard: f64,
}

/// Where reclaim stops, as a fraction of the high mark: room for a burst
/// of activity before the next reclaim.
pub const LOW_MARK_OF_HIGH: f64 = 0.9;

/// Most pressure hibernations at once on any pod: their snapshots' writes
/// share the pod's disk, and each holds a blocking thread.
pub const PRESSURE_HIBERNATIONS_AT_ONCE: usize = 4;

/// How long after its create or wake the pressure gate counts a sandbox
/// at least what it expected it to hold when it admitted it (ms): a
/// restored guest's memory comes back as it touches it, so a fresh one
/// measures less than it is about to hold, and creates and wakes admitted
/// meanwhile must not all count on that room.
pub const PRESSURE_SETTLE_MS: u64 = 10_000;

/// Pressure hibernations at once on a pod of `vcpus`: half its cores (at
/// least one, at most [`PRESSURE_HIBERNATIONS_AT_ONCE`]), so that creates
/// and wakes keep the other half meanwhile.
pub fn pressure_batch(vcpus: u32) -> usize {
    (vcpus as usize / 2).clamp(1, PRESSURE_HIBERNATIONS_AT_ONCE)
}

impl Marks {
    /// The marks of a pod whose high watermark is `high`.
    pub fn of(high: f64) -> Self {
        Marks {
            low: high * LOW_MARK_OF_HIGH,
            high,
            hard: high + (1.0 - high).max(0.0) / 2.0,
        }
    }
}

/// How resident memory stands against the marks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pressure {
    /// At or below the high mark.
    Normal,
    /// Above the high mark: reclaim.
    High,
    /// Above the hard mark: reclaim, and refuse creates and wakes.
    Hard,
}

/// Where `resident_bytes` stands on a pod of `memory_bytes` whose high
/// watermark is `high`.
pub fn pressure(memory_bytes: u64, high: f64, resident_bytes: u64) -> Pressure {
    let marks = Marks::of(high);
    let r = resident_bytes as f64;
    let m = memory_bytes as f64;
    if r > m * marks.hard {
        Pressure::Hard
    } else if r > m * marks.high {
        Pressure::High
    } else {
        Pressure::Normal
    }
}

/// A create or wake refused by the pressure gate: resident memory, what
/// the sandbox is expected to hold, and the hard mark, in MiB.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PressureRefusal {
    pub resident_mib: u64,
    pub asked_mib: u64,
    pub hard_mib: u64,
}

/// Whether a create or wake may start with `resident_bytes` resident on a
/// pod of `memory_bytes` whose high watermark is `high`, when the sandbox
/// it starts is expected to hold `expected_bytes` once settled: refused
/// when the two together would pass the hard mark (the API answers 429
/// `rate_limited` with `Retry-After`), so that admitted work alone never
/// takes the pod past it.
pub fn pressure_gate(
    memory_bytes: u64,
    high: f64,
    resident_bytes: u64,
    expected_bytes: u64,
) -> Result<(), PressureRefusal> {
    let after = resident_bytes.saturating_add(expected_bytes);
    if pressure(memory_bytes, high, after) != Pressure::Hard {
        return Ok(());
    }
    Err(PressureRefusal {
        resident_mib: resident_bytes >> 20,
        asked_mib: expected_bytes.div_ceil(1 << 20),
        hard_mib: (memory_bytes as f64 * Marks::of(high).hard) as u64 >> 20,
    })
}

/// A refused admission: what was committed, asked and allowed, in MiB.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Refusal {
    pub committed_mib: u64,
    pub asked_mib: u32,
    pub limit_mib: f64,
}

/// Whether `asked_mib` more fits on a pod of `memory_mib` physical MiB
/// with oversubscription `ratio` when `committed_mib` is committed (the
/// memory of its sandboxes that hold a VMM).
pub fn admit(
    memory_mib: u64,
    ratio: f64,
    committed_mib: u64,
    asked_mib: u32,
) -> Result<(), Refusal> {
    let limit_mib = memory_mib as f64 * ratio;
    if (committed_mib.saturating_add(u64::from(asked_mib))) as f64 <= limit_mib {
        return Ok(());
    }
    Err(Refusal {
        committed_mib,
        asked_mib,
        limit_mib,
    })
}

/// Whether `sandbox` has been idle at least its keep-alive at `now`
/// (saturating: a stored keep-alive past `i64::MAX` never elapses).
pub fn idle_past_keep_alive(sandbox: &Sandbox, now: Timestamp) -> bool {
    let idle = now.0.saturating_sub(sandbox.last_active_at.0);
    idle >= i64::try_from(sandbox.keep_alive_ms).unwrap_or(i64::MAX)
}

/// Memory a shrunk guest keeps beyond what it uses: at least this, or an
/// eighth of its memory if that is more.
pub const SHRINK_HEADROOM_MIB: u64 = 64;
/// A shrink asks for at least this much, or not at all.
pub const SHRINK_MIN_MIB: u64 = 16;

/// The balloon target (MiB) that leaves an idle guest its headroom past
/// what it cannot spare (`MemAvailable` as its balloon driver reported
/// it), and the bytes the host is expected to get back: the new balloon
/// pages, less the guest's free memory if free page reporting returned
/// that already. `None`: no statistics yet, or too little to gain.
pub fn balloon_target(b: &BalloonStatus) -> Option<(u64, u64)> {
    const MIB: u64 = 1 << 20;
    let guest = b.guest.filter(|_| b.active)?;
    let (available, total) = (guest.available_memory?, guest.total_memory?);
    let headroom = (SHRINK_HEADROOM_MIB * MIB).max(total / 8);
    let spare_mib = available.saturating_sub(headroom) / MIB;
    if spare_mib < SHRINK_MIN_MIB {
        return None;
    }
    let target_mib = b.actual_mib.saturating_add(spare_mib);
    let mut expected = spare_mib * MIB;
    if b.free_page_reporting {
        expected = expected.saturating_sub(guest.free_memory.unwrap_or(0));
    }
    Some((target_mib, expected))
}

/// What a policy round acts through: the service (store, VMMs, wall
/// clock) or the planner's simulated pod.
pub trait PolicyDriver {
    /// The clock.
    fn now(&self) -> Timestamp;
    /// The pod the round enforces (its memory and high watermark).
    fn pod(&self) -> Option<Pod>;
    /// The pod's sandboxes in `states`.
    fn sandboxes(&self, states: &[SandboxState]) -> Vec<Sandbox>;
    /// Deletes `s` (its timeout passed).
    fn delete(&mut self, s: &Sandbox);
    /// Hibernates `s` unless it is busy (an operation or a request in
    /// flight) or, for [`PolicyReason::Idle`], was used meanwhile: `None`
    /// when it was left alone, `Some(true)` hibernated, `Some(false)` the
    /// hibernation failed.
    fn hibernate(&mut self, s: &Sandbox, reason: PolicyReason) -> Option<bool>;
    /// Hibernates `batch` for memory pressure, at once (at most
    /// [`pressure_batch`] of the pod's cores): each answer as
    /// [`PolicyDriver::hibernate`]'s, in order.
    fn hibernate_batch(&mut self, batch: &[Sandbox]) -> Vec<Option<bool>>;
    /// Housekeeping of a sandbox the round leaves running (is its VMM
    /// alive, its log rotated).
    fn tend(&mut self, s: &Sandbox);
    /// The memory `s` holds resident now, in bytes (for the service: its
    /// cgroup's working set, `service::resident`).
    fn memory_bytes(&self, s: &Sandbox) -> u64;
    /// Asks the guest of running, idle `s` to give memory back (its
    /// balloon's target), unless it is busy, was asked already since its
    /// last activity, or cannot: returns the bytes the pod expects back
    /// (0 when nothing was asked). The driver gives the memory back to
    /// the guest once it is active again (in `tend`).
    fn shrink(&mut self, s: &Sandbox) -> u64;
}

/// One policy round: timeouts and keep-alives, then the watermark.
pub fn run_round(d: &mut impl PolicyDriver) {
    let now = d.now();
    let sandboxes = d.sandboxes(&[
        SandboxState::Running,
        SandboxState::Paused,
        SandboxState::Hibernated,
    ]);
    for s in &sandboxes {
        if s.expires_at.is_some_and(|t| t.0 <= now.0) {
            match s.on_timeout {
                OnTimeout::Delete => d.delete(s),
                // Hibernated it stays, past its deadline, until woken and
                // given a new one.
                OnTimeout::Hibernate if s.state == SandboxState::Hibernated => {}
                OnTimeout::Hibernate => {
                    d.hibernate(s, PolicyReason::Timeout);
                }
            }
        } else if s.state == SandboxState::Running && idle_past_keep_alive(s, now) {
            d.hibernate(s, PolicyReason::Idle);
        } else if s.state != SandboxState::Hibernated {
            d.tend(s);
        }
    }
    enforce_watermark(d);
}

/// Once the pod's resident memory is above its high mark: first asks idle
/// running sandboxes, least recently used first, to shrink (counting what
/// they are expected to give back), then hibernates least recently used
/// sandboxes, [`pressure_batch`] at a time, until it is
/// below the low mark. A shrink takes effect over seconds; the next round
/// measures it, and hibernates if it was not enough (a sandbox is asked
/// once per idle spell).
pub fn enforce_watermark(d: &mut impl PolicyDriver) {
    let Some(pod) = d.pod() else {
        return;
    };
    let mut live: Vec<(Sandbox, u64)> = d
        .sandboxes(&[SandboxState::Running, SandboxState::Paused])
        .into_iter()
        .map(|s| {
            let m = d.memory_bytes(&s);
            (s, m)
        })
        .collect();
    let mut total: u64 = live.iter().map(|(_, m)| m).sum();
    if pressure(pod.memory_bytes, pod.high_watermark, total) == Pressure::Normal {
        return;
    }
    let low = pod.memory_bytes as f64 * Marks::of(pod.high_watermark).low;
    live.sort_by_key(|(s, _)| s.last_active_at.0);
    let now = d.now();
    for (s, _) in &live {
        if (total as f64) <= low {
            return;
        }
        if s.state == SandboxState::Running && s.last_active_at.0 < now.0 {
            total = total.saturating_sub(d.shrink(s));
        }
    }
    let mut coldest = live.into_iter();
    while (total as f64) > low {
        // As many as it takes to get below the low mark, by what each
        // holds, at most so many at once.
        let mut batch = Vec::new();
        let mut expected = total;
        while (expected as f64) > low && batch.len() < pressure_batch(pod.vcpus) {
            let Some((s, m)) = coldest.next() else {
                break;
            };
            expected = expected.saturating_sub(m);
            batch.push((s, m));
        }
        if batch.is_empty() {
            return;
        }
        let sandboxes: Vec<Sandbox> = batch.iter().map(|(s, _)| s.clone()).collect();
        for ((_, freed), done) in batch.iter().zip(d.hibernate_batch(&sandboxes)) {
            if done == Some(true) {
                total = total.saturating_sub(*freed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{SandboxId, TemplateId};

    #[test]
    fn admission_counts_the_ratio() {
        assert!(admit(1024, 2.0, 1024, 1024).is_ok());
        let r = admit(1024, 2.0, 1024, 1025).unwrap_err();
        assert_eq!(r.committed_mib, 1024);
        assert_eq!(r.limit_mib, 2048.0);
        assert!(admit(1024, 1.0, u64::MAX, 1).is_err());
    }

    /// A pod whose sandboxes can shrink by a fixed amount each.
    struct Pod2 {
        boxes: Vec<(Sandbox, u64)>,
        can_give: u64,
        shrunk: Vec<SandboxId>,
        hibernated: Vec<SandboxId>,
        batches: usize,
    }

    impl PolicyDriver for Pod2 {
        fn now(&self) -> Timestamp {
            Timestamp(100_000)
        }
        fn pod(&self) -> Option<Pod> {
            Some(Pod {
                id: crate::model::PodId::new("p"),
                address: crate::model::PodAddress::Local,
                token_hash: None,
                memory_bytes: 1000,
                vcpus: 4,
                disk_bytes: 0,
                oversubscription_ratio: 1.0,
                high_watermark: 0.5,
                created_at: Timestamp(0),
            })
        }
        fn sandboxes(&self, states: &[SandboxState]) -> Vec<Sandbox> {
            let hibernated = |s: &Sandbox| self.hibernated.contains(&s.id);
            self.boxes
                .iter()
                .map(|(s, _)| s.clone())
                .filter(|s| states.contains(&s.state) && !hibernated(s))
                .collect()
        }
        fn delete(&mut self, _: &Sandbox) {}
        fn hibernate(&mut self, s: &Sandbox, _: PolicyReason) -> Option<bool> {
            self.hibernated.push(s.id.clone());
            Some(true)
        }
        fn hibernate_batch(&mut self, batch: &[Sandbox]) -> Vec<Option<bool>> {
            self.batches += 1;
            batch
                .iter()
                .map(|s| self.hibernate(s, PolicyReason::Watermark))
                .collect()
        }
        fn tend(&mut self, _: &Sandbox) {}
        fn memory_bytes(&self, s: &Sandbox) -> u64 {
            self.boxes
                .iter()
                .find(|(b, _)| b.id == s.id)
                .map_or(0, |b| b.1)
        }
        fn shrink(&mut self, s: &Sandbox) -> u64 {
            self.shrunk.push(s.id.clone());
            self.can_give
        }
    }

    fn pod2(can_give: u64) -> Pod2 {
        // Three running sandboxes of 300 bytes on a pod of 1000 whose high
        // mark is 500 and low mark 450: 450 too many. The most recently
        // used is active now (not asked).
        let boxes = [100_000, 20_000, 30_000]
            .into_iter()
            .map(|active| {
                let mut s = Sandbox::new(TemplateId::generate(), 64, 1, 1_000_000);
                s.state = SandboxState::Running;
                s.last_active_at = Timestamp(active);
                (s, 300)
            })
            .collect();
        Pod2 {
            boxes,
            can_give,
            shrunk: Vec::new(),
            hibernated: Vec::new(),
            batches: 0,
        }
    }

    #[test]
    fn idle_sandboxes_shrink_before_anything_is_hibernated() {
        let mut d = pod2(300);
        enforce_watermark(&mut d);
        let ids: Vec<SandboxId> = d.boxes.iter().map(|(s, _)| s.id.clone()).collect();
        // Idle ones, least recently used first; enough to get below the
        // low mark: nothing hibernated.
        assert_eq!(d.shrunk, vec![ids[1].clone(), ids[2].clone()]);
        assert!(d.hibernated.is_empty());

        // Shrinking gives too little: then the least recently used go, as
        // many as it takes to get below the low mark (not only the high
        // one), in one batch.
        let mut d = pod2(50);
        enforce_watermark(&mut d);
        let ids: Vec<SandboxId> = d.boxes.iter().map(|(s, _)| s.id.clone()).collect();
        assert_eq!(d.shrunk, vec![ids[1].clone(), ids[2].clone()]);
        assert_eq!(d.hibernated, vec![ids[1].clone(), ids[2].clone()]);
        assert_eq!(d.batches, 1);
    }

    #[test]
    fn pressure_hibernations_use_half_the_cores() {
        assert_eq!(
            [1, 2, 3, 4, 8, 64].map(pressure_batch),
            [1, 1, 1, 2, 4, PRESSURE_HIBERNATIONS_AT_ONCE]
        );
    }

    #[test]
    fn nothing_is_reclaimed_at_or_below_the_high_mark() {
        // Two sandboxes of 250: 500, at the high mark (above the low one).
        let mut d = pod2(300);
        d.boxes.truncate(2);
        d.boxes.iter_mut().for_each(|b| b.1 = 250);
        enforce_watermark(&mut d);
        assert!(d.shrunk.is_empty() && d.hibernated.is_empty());
    }

    #[test]
    fn the_marks_follow_the_high_watermark() {
        let m = Marks::of(0.9);
        assert!((m.low - 0.81).abs() < 1e-9 && (m.hard - 0.95).abs() < 1e-9);
        let m = Marks::of(0.05);
        assert!((m.low - 0.045).abs() < 1e-9 && (m.hard - 0.525).abs() < 1e-9);
        assert_eq!(Marks::of(1.0).hard, 1.0);
        const GIB: u64 = 1 << 30;
        assert_eq!(pressure(GIB, 0.9, GIB * 9 / 10), Pressure::Normal);
        assert_eq!(pressure(GIB, 0.9, GIB * 92 / 100), Pressure::High);
        assert_eq!(pressure(GIB, 0.9, GIB * 96 / 100), Pressure::Hard);
        assert!(pressure_gate(GIB, 0.9, GIB * 92 / 100, 0).is_ok());
        let r = pressure_gate(GIB, 0.9, GIB * 96 / 100, 0).unwrap_err();
        assert_eq!((r.resident_mib, r.asked_mib, r.hard_mib), (983, 0, 972));
        // What the sandbox will hold counts: 92 % resident and 4 % asked
        // would pass the hard mark of 95 %, 2 % would not.
        assert!(pressure_gate(GIB, 0.9, GIB * 92 / 100, GIB * 2 / 100).is_ok());
        let r = pressure_gate(GIB, 0.9, GIB * 92 / 100, GIB * 4 / 100).unwrap_err();
        assert_eq!((r.resident_mib, r.asked_mib, r.hard_mib), (942, 41, 972));
    }

    #[test]
    fn the_balloon_target_leaves_headroom() {
        use torpor_vmm_api::control::GuestMemoryStats;
        const MIB: u64 = 1 << 20;
        let mut b = BalloonStatus {
            active: true,
            actual_mib: 10,
            guest: Some(GuestMemoryStats {
                total_memory: Some(1024 * MIB),
                available_memory: Some(800 * MIB),
                free_memory: Some(500 * MIB),
                ..Default::default()
            }),
            ..Default::default()
        };
        // Headroom: an eighth of 1 GiB (128 MiB) beats 64 MiB.
        assert_eq!(balloon_target(&b), Some((10 + 672, 672 * MIB)));
        // Free memory went back by reporting already.
        b.free_page_reporting = true;
        assert_eq!(balloon_target(&b), Some((682, 172 * MIB)));
        // Too little to gain, no statistics, or no driver: nothing asked.
        let mut small = b;
        small.guest.as_mut().unwrap().available_memory = Some(130 * MIB);
        assert_eq!(balloon_target(&small), None);
        let mut none = b;
        none.guest.as_mut().unwrap().available_memory = None;
        assert_eq!(balloon_target(&none), None);
        b.active = false;
        assert_eq!(balloon_target(&b), None);
    }

    #[test]
    fn keep_alive_elapses_without_overflow() {
        let mut s = Sandbox::new(TemplateId::generate(), 64, 1, 1000);
        s.last_active_at = Timestamp(10_000);
        assert!(!idle_past_keep_alive(&s, Timestamp(10_999)));
        assert!(idle_past_keep_alive(&s, Timestamp(11_000)));
        // A clock before the last activity is not idle.
        assert!(!idle_past_keep_alive(&s, Timestamp(0)));
        s.keep_alive_ms = u64::MAX;
        assert!(!idle_past_keep_alive(&s, Timestamp(i64::MAX)));
        s.last_active_at = Timestamp(i64::MIN);
        s.keep_alive_ms = 5;
        assert!(idle_past_keep_alive(&s, Timestamp(i64::MAX)));
    }
}
