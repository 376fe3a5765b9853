//! Tests of the simulation: deterministic, and the real policy at work.

use super::*;

fn trace(lines: &[String]) -> Trace {
    Trace::read(lines.join("\n").as_bytes()).unwrap()
}

fn create(t: f64, id: &str, mem: u32) -> String {
    format!(r#"{{"t":{t},"sandbox":"{id}","event":"create","mem_mib":{mem}}}"#)
}

fn request(t: f64, id: &str, dur: u64, mem: u32) -> String {
    format!(r#"{{"t":{t},"sandbox":"{id}","event":"request","duration_ms":{dur},"mem_mib":{mem}}}"#)
}

const POD: PodShape = PodShape {
    memory_mib: 1024,
    cores: 2,
    policy_interval_ms: 1000,
};

fn setting(ratio: f64, keep_alive_ms: u64) -> Setting {
    Setting {
        ratio,
        keep_alive_ms,
        high_watermark: 0.9,
    }
}

#[test]
fn admission_is_the_services() {
    // Four 512 MiB sandboxes on 1 GiB: ratio 1 admits two, ratio 2 four.
    let t = trace(
        &(0..4)
            .map(|i| create(i as f64, &format!("s{i}"), 512))
            .collect::<Vec<_>>(),
    );
    let cal = Calibration::builtin();
    let one = simulate(&t, POD, setting(1.0, 600_000), &cal);
    assert_eq!((one.creates_admitted, one.creates_rejected), (2, 2));
    let two = simulate(&t, POD, setting(2.0, 600_000), &cal);
    assert_eq!((two.creates_admitted, two.creates_rejected), (4, 0));
    assert_eq!(two.committed_peak_mib, 2048);
}

#[test]
fn idle_sandboxes_hibernate_and_requests_wake_them() {
    let t = trace(&[
        create(0.0, "a", 256),
        request(1.0, "a", 500, 100),
        // Idle past a 5 s keep-alive: hibernated, then woken here.
        request(20.0, "a", 0, 0),
        request(21.0, "a", 0, 0),
    ]);
    let cal = Calibration::builtin();
    let o = simulate(&t, POD, setting(4.0, 5_000), &cal);
    assert_eq!(o.hibernations_idle, 1);
    assert_eq!(o.wakes, 1);
    assert_eq!(o.wake_p99_ms, cal.wake_ms.ceil());
    // The snapshot holds what was dirtied.
    assert_eq!(o.disk_end_bytes, cal.snapshot_bytes(100.0));
    // A keep-alive longer than the gap: nothing hibernates.
    let o = simulate(&t, POD, setting(4.0, 60_000), &cal);
    assert_eq!((o.hibernations, o.wakes), (0, 0));
}

#[test]
fn a_thundering_herd_queues_behind_the_pods_work() {
    let mut lines: Vec<String> = (0..20).map(|i| create(0.0, &format!("s{i}"), 64)).collect();
    lines.extend((0..20).map(|i| request(30.0, &format!("s{i}"), 10, 0)));
    let t = trace(&lines);
    let cal = Calibration::builtin();
    let o = simulate(&t, POD, setting(4.0, 5_000), &cal);
    assert_eq!(o.wakes, 20);
    // 20 wakes on 2 lanes: the last waits for 9 before it.
    assert!(o.wake_max_ms >= 10.0 * cal.wake_ms, "{o:?}");
    assert!(o.wake_p50_ms < o.wake_max_ms);
}

#[test]
fn the_watermark_hibernates_least_recently_used_first() {
    // Three 512 MiB sandboxes that each dirty 400 MiB: 1.2 GiB resident on
    // a 1 GiB pod with a 0.9 watermark; keep-alive never elapses.
    let mut lines: Vec<String> = (0..3).map(|i| create(0.0, &format!("s{i}"), 512)).collect();
    lines.extend((0..3).map(|i| request(1.0 + i as f64, &format!("s{i}"), 0, 400)));
    lines.push(request(10.0, "s0", 0, 0));
    let t = trace(&lines);
    let o = simulate(&t, POD, setting(2.0, 3_600_000), &Calibration::builtin());
    assert_eq!(o.hibernations_watermark, 1, "{o:?}");
    assert_eq!(o.hibernations_idle, 0);
    // s0 was the least recently used: the last request asks to wake it,
    // and the pressure gate refuses (at the 400 MiB its peers hold, the
    // pod would pass its hard mark).
    assert_eq!((o.wakes, o.wakes_rejected), (0, 1), "{o:?}");
    assert_eq!(o.pressure_refusals, 1, "{o:?}");
    assert!(o.mem_peak_mib > 900.0);
}

#[test]
fn simulation_is_deterministic_and_the_plan_recommends() {
    let mut lines = Vec::new();
    for i in 0..30 {
        let id = format!("s{i}");
        lines.push(create(i as f64, &id, 256));
        for k in 0..5 {
            lines.push(request(i as f64 + 0.5 + 40.0 * k as f64, &id, 200, 20));
        }
    }
    lines.sort_by(|a, b| {
        let t = |s: &String| {
            serde_json::from_str::<serde_json::Value>(s).unwrap()["t"]
                .as_f64()
                .unwrap()
        };
        t(a).total_cmp(&t(b))
    });
    let t = trace(&lines);
    let settings: Vec<Setting> = [1.0, 2.0, 4.0, 8.0]
        .iter()
        .map(|&r| setting(r, 10_000))
        .collect();
    let target = Target {
        wake_p99_ms: 1000.0,
        max_reject_pct: 0.0,
    };
    let a = plan(&t, POD, &settings, target, Calibration::builtin());
    let b = plan(&t, POD, &settings, target, Calibration::builtin());
    assert_eq!(a, b);
    // 30 x 256 MiB on 1 GiB: ratio 1 and 2 reject, 8 admits all.
    assert!(a.outcomes[0].creates_rejected > 0);
    assert_eq!(a.outcomes[3].creates_rejected, 0);
    let r = a.recommended.expect("a setting meets the target");
    assert_eq!(a.outcomes[r].reject_pct(), 0.0);
    // It fits the pod's RAM at every ratio: nothing is infeasible.
    assert!(a.outcomes.iter().all(|o| o.infeasible.is_none()), "{a:?}");
    // Nothing meets an impossible target.
    let none = plan(
        &t,
        POD,
        &settings[..1],
        Target {
            wake_p99_ms: 0.0,
            max_reject_pct: 0.0,
        },
        Calibration::builtin(),
    );
    assert_eq!(none.recommended, None);
    assert!(none.reason.contains("no setting meets"));
    let svg = svg::render(&a);
    assert!(svg.contains("oversubscription ratio") && svg.contains("wake p99 (ms)"));
}

#[test]
fn a_sandbox_used_before_the_policy_gets_to_it_is_left_alone() {
    // Slow hibernations: the policy takes a and b in turn; b is used
    // while a's is written, so b is not hibernated and its request does
    // not wait.
    let mut cal = Calibration::builtin();
    cal.hibernate_ms = 500.0;
    let t = trace(&[
        create(0.0, "a", 64),
        create(0.0, "b", 64),
        request(0.1, "a", 0, 0),
        request(0.1, "b", 0, 0),
        request(6.2, "b", 0, 0),
        request(9.0, "a", 0, 0),
    ]);
    let o = simulate(&t, POD, setting(4.0, 5_000), &cal);
    // a hibernated at the 6 s round; b left alone (and not idle again
    // long enough before the trace ends); a woken at 9 s.
    assert_eq!(o.hibernations, 1, "{o:?}");
    assert_eq!(o.wakes, 1, "{o:?}");
    assert_eq!(o.wake_p99_ms, cal.wake_ms.ceil(), "{o:?}");
}

/// Four 512 MiB sandboxes that each dirty 400 MiB in the same moment:
/// 1.6 GiB resident on a 1 GiB pod at ratio 4 (all four admitted), 0.8
/// GiB at ratio 1 (two admitted). No policy can react between them.
fn overflowing() -> Trace {
    let mut lines: Vec<String> = (0..4).map(|i| create(0.0, &format!("s{i}"), 512)).collect();
    lines.extend((0..4).map(|i| request(1.5, &format!("s{i}"), 0, 400)));
    trace(&lines)
}

#[test]
fn a_trace_that_overflows_ram_at_ratio_4_is_infeasible_there() {
    let t = overflowing();
    let cal = Calibration::builtin();
    let four = simulate(&t, POD, setting(4.0, 3_600_000), &cal);
    assert_eq!(four.creates_admitted, 4);
    assert!(four.resident_peak_mib > 1600.0, "{four:?}");
    let why = four.infeasible.as_deref().expect("ratio 4 overflows");
    assert!(why.contains("past the pod's 1024 MiB of RAM"), "{why}");
    let one = simulate(&t, POD, setting(1.0, 3_600_000), &cal);
    assert_eq!(one.creates_admitted, 2);
    assert!(one.infeasible.is_none(), "{one:?}");
    assert!(one.resident_peak_mib <= 1024.0, "{one:?}");

    // Ratio 4 admits more, yet is never recommended...
    let settings = [setting(1.0, 3_600_000), setting(4.0, 3_600_000)];
    let lax = Target {
        wake_p99_ms: 1e9,
        max_reject_pct: 100.0,
    };
    let p = plan(&t, POD, &settings, lax, Calibration::builtin());
    assert_eq!(p.recommended, Some(0), "{}", p.reason);
    // ... nor named the closest when nothing meets the target (ratio 1
    // rejects half the creates, ratio 4 none) ...
    let strict = Target {
        wake_p99_ms: 1e9,
        max_reject_pct: 0.0,
    };
    let p = plan(&t, POD, &settings, strict, Calibration::builtin());
    assert_eq!(p.recommended, None);
    assert!(p.reason.contains("the closest is ratio 1 "), "{}", p.reason);
    // ... and alone it is reported as such.
    let p = plan(&t, POD, &settings[1..], lax, Calibration::builtin());
    assert_eq!(p.recommended, None);
    assert!(p.reason.contains("every one is infeasible"), "{}", p.reason);
}

#[test]
fn creates_past_the_hard_mark_are_refused_and_reclaim_goes_to_the_low_mark() {
    // Three sandboxes dirty 330 MiB each: 993 MiB resident on a 1 GiB pod
    // (within its RAM, past its hard mark: 0.95, 973 MiB). A create then
    // is refused; the next round hibernates the coldest, one being enough
    // to get below the low mark (0.81, 829 MiB); a later create fits.
    let mut lines: Vec<String> = (0..3).map(|i| create(0.0, &format!("s{i}"), 512)).collect();
    lines.extend((0..3).map(|i| request(1.1 + 0.1 * i as f64, &format!("s{i}"), 0, 330)));
    lines.push(create(1.5, "late", 64));
    lines.push(create(2.9, "later", 64));
    let t = trace(&lines);
    let o = simulate(&t, POD, setting(4.0, 3_600_000), &Calibration::builtin());
    assert_eq!(o.pressure_refusals, 1, "{o:?}");
    assert_eq!((o.creates_admitted, o.creates_rejected), (4, 1), "{o:?}");
    assert_eq!(o.hibernations_watermark, 1, "{o:?}");
    assert!(o.infeasible.is_none(), "{o:?}");
    assert!(o.resident_peak_mib > 973.0 && o.resident_peak_mib < 1024.0);
}

#[test]
fn writes_under_way_share_the_disk() {
    use super::sim::shared_writes;
    // 1000 bytes/ms. Alone: bytes / bandwidth.
    assert_eq!(shared_writes(1000.0, &[(5.0, 2000.0)]), [7.0]);
    // Two together: each at half, the smaller done first.
    assert_eq!(
        shared_writes(1000.0, &[(0.0, 4000.0), (0.0, 2000.0)]),
        [6.0, 4.0]
    );
    // Staggered: the second shares from its start.
    assert_eq!(
        shared_writes(1000.0, &[(0.0, 3000.0), (1.0, 1000.0)]),
        [4.0, 3.0]
    );
    // Apart: no sharing.
    assert_eq!(
        shared_writes(1000.0, &[(10.0, 1000.0), (0.0, 1000.0)]),
        [11.0, 1.0]
    );
    assert!(shared_writes(1000.0, &[]).is_empty());
}

/// Four 128 MiB sandboxes that each dirty 100 MiB, then go idle together
/// past a 5 s keep-alive: the round hibernates all four, 400 MiB of
/// snapshots to write.
fn idle_together() -> Trace {
    let mut lines: Vec<String> = (0..4).map(|i| create(0.0, &format!("s{i}"), 128)).collect();
    lines.extend((0..4).map(|i| request(0.5, &format!("s{i}"), 0, 100)));
    lines.push(request(12.0, "s1", 0, 0));
    trace(&lines)
}

#[test]
fn a_trace_feasible_with_a_fast_disk_is_infeasible_with_a_slow_one() {
    let t = idle_together();
    let s = setting(4.0, 5_000);
    let mut fast = Calibration::builtin();
    fast.disk_write_mib_s = 1000.0;
    let o = simulate(&t, POD, s, &fast);
    assert_eq!(o.hibernations_idle, 4, "{o:?}");
    // 400 MiB within 10 intervals of 1 s: 40 MiB/s needed.
    let backlog_mib = o.write_backlog_peak_bytes / 1048576.0;
    assert!((backlog_mib - 400.25).abs() < 0.01, "{o:?}");
    assert!((o.disk_needed_mib_s - 40.025).abs() < 0.01, "{o:?}");
    assert_eq!(o.disk_write_mib_s, 1000.0);
    assert!(o.infeasible.is_none() && o.exceeds.is_empty(), "{o:?}");
    assert_eq!(o.snapshot_written_bytes, 4.0 * fast.snapshot_bytes(100.0));
    assert_eq!(o.wake_max_ms, fast.wake_ms.ceil(), "{o:?}");

    let mut slow = fast.clone();
    slow.disk_write_mib_s = 20.0;
    let o = simulate(&t, POD, s, &slow);
    assert_eq!(o.exceeds, [Limit::Disk], "{o:?}");
    let why = o
        .infeasible
        .as_deref()
        .expect("a 20 MiB/s disk cannot keep up");
    assert!(
        why.starts_with("hibernation writes need 40 MiB/s, past the disk's 20 MiB/s"),
        "{why}"
    );
    assert!(why.contains("in 10 policy intervals (10 s)"), "{why}");
    assert_eq!(o.hibernations_idle, 4, "{o:?}");
    // Each hibernation writes 100 MiB alone, 5 s at 20 MiB/s, one after
    // the other from the 6 s round: s1's runs from 11 s to 16 s, and a
    // request to it at 12 s waits for it, then for its wake.
    assert!(o.wake_max_ms >= 4_000.0, "{o:?}");

    // The plan recommends neither, and says why when it is alone.
    let lax = Target {
        wake_p99_ms: 1e9,
        max_reject_pct: 100.0,
    };
    let p = plan(&t, POD, &[s], lax, slow);
    assert_eq!(p.recommended, None);
    assert!(
        p.reason
            .contains("hibernation writes within its disk's bandwidth")
            && p.reason.contains("every one is infeasible"),
        "{}",
        p.reason
    );
    let p = plan(&t, POD, &[s], lax, fast);
    assert_eq!(p.recommended, Some(0), "{}", p.reason);
}

#[test]
fn memory_is_freed_when_the_snapshot_is_written() {
    // Three sandboxes dirty 330 MiB each: 993 MiB on a 1 GiB pod, past
    // the hard mark. The 2 s round hibernates the coldest; at 2.5 s
    // another dirties 100 MiB more. With a fast disk s0's 330 MiB are
    // written (and freed) by then; at 100 MiB/s its write takes 3.3 s,
    // s0 still holds its memory, and the pod passes its RAM.
    let mut lines: Vec<String> = (0..3).map(|i| create(0.0, &format!("s{i}"), 512)).collect();
    lines.extend((0..3).map(|i| request(1.1 + 0.1 * i as f64, &format!("s{i}"), 0, 330)));
    lines.push(request(2.5, "s2", 0, 100));
    let t = trace(&lines);
    let s = setting(4.0, 3_600_000);
    let fast = Calibration::builtin();
    let o = simulate(&t, POD, s, &fast);
    assert_eq!(o.hibernations_watermark, 1, "{o:?}");
    assert!(o.infeasible.is_none(), "{o:?}");
    let mut slow = fast.clone();
    slow.disk_write_mib_s = 100.0;
    let o = simulate(&t, POD, s, &slow);
    assert_eq!(o.hibernations_watermark, 1, "{o:?}");
    assert_eq!(o.exceeds, [Limit::Ram], "{o:?}");
    assert!(o.resident_peak_mib > 1024.0, "{o:?}");
    // 330 MiB left to write is within 10 s of the disk.
    assert!(o.disk_needed_mib_s < 100.0, "{o:?}");
}

#[test]
fn a_pressure_batch_shares_the_disk() {
    // An 8-core pod hibernates 4 at once under pressure. Twenty 64 MiB
    // sandboxes dirty 49 MiB each: 1000 MiB on 1 GiB, past the high mark;
    // the 2 s round hibernates the 4 coldest, one batch, down to 800 MiB.
    // Their writes share a 100 MiB/s disk: each gets a quarter and all
    // four end at about 3.96 s, and only then is their memory free. A
    // request at 3 s to the fourth coldest waits for it (written one at a
    // time, the first would be done by 2.5 s, the fourth by 4 s; freed
    // together, the three before it make room for its wake).
    let pod = PodShape { cores: 8, ..POD };
    let mut lines: Vec<String> = (0..20).map(|i| create(0.0, &format!("s{i}"), 64)).collect();
    lines.extend((0..20).map(|i| request(1.1 + 0.01 * i as f64, &format!("s{i}"), 0, 49)));
    lines.push(request(3.0, "s3", 0, 0));
    let t = trace(&lines);
    let mut cal = Calibration::builtin();
    cal.disk_write_mib_s = 100.0;
    let o = simulate(&t, pod, setting(4.0, 3_600_000), &cal);
    assert_eq!(o.hibernations_watermark, 4, "{o:?}");
    let written_mib = o.snapshot_written_bytes / 1048576.0;
    assert!((written_mib - 4.0 * 49.0).abs() < 1.0, "{o:?}");
    let shared_end_ms = 2000.0 + 4.0 * cal.snapshot_bytes(49.0) / cal.disk_bytes_per_ms();
    assert_eq!(o.wakes, 1, "{o:?}");
    let waited = o.wake_max_ms;
    assert!(
        waited >= shared_end_ms - 3000.0 && waited <= shared_end_ms - 3000.0 + 10.0,
        "{waited} ms: {o:?}"
    );
    assert!(o.infeasible.is_none(), "{o:?}");
}

#[test]
fn wakes_admitted_together_count_on_the_room_once() {
    // s0 and s1 dirty 400 MiB and hibernate once idle (s2 too, unused);
    // s2, woken at 12 s, then holds 401 MiB, running. s0 and s1 are
    // asked for at once at 20 s: the gate admits s0
    // (401 + 401 <= 973 MiB, the hard mark), then counts it at 401 MiB
    // while it settles, though its restore holds nothing yet, and refuses
    // s1 (401 + 401 + 401), as the service does.
    let t = trace(&[
        create(0.0, "s0", 512),
        create(0.0, "s1", 512),
        create(0.0, "s2", 512),
        request(0.5, "s0", 0, 400),
        request(0.5, "s1", 0, 400),
        request(12.0, "s2", 30_000, 400),
        request(20.0, "s0", 0, 0),
        request(20.0, "s1", 0, 0),
    ]);
    let o = simulate(&t, POD, setting(4.0, 5_000), &Calibration::builtin());
    assert_eq!(o.hibernations_idle, 3, "{o:?}");
    assert_eq!((o.wakes, o.wakes_rejected), (2, 1), "{o:?}");
    assert_eq!(o.pressure_refusals, 1, "{o:?}");
}

#[test]
fn a_restored_guest_holds_its_memory_once_it_has_touched_it() {
    // Three 512 MiB sandboxes that settle at 300 MiB each: with a touch
    // time of 1 s they hold 10 MiB each until then, so a trace that ends
    // at 0.5 s peaks at 30 MiB; one that goes on to 2 s at 900 MiB. With
    // no touch time (a probe's calibration) they hold 300 MiB at once.
    let mut cal = Calibration::builtin();
    cal.fresh_pss_mib = 300.0;
    cal.restored_pss_mib = 10.0;
    cal.touch_ms = 1000.0;
    let mut lines: Vec<String> = (0..3).map(|i| create(0.0, &format!("s{i}"), 512)).collect();
    lines.push(request(0.5, "s0", 0, 0));
    let short = trace(&lines);
    let o = simulate(&short, POD, setting(4.0, 3_600_000), &cal);
    assert!((o.resident_peak_mib - 30.0).abs() < 1.0, "{o:?}");
    lines.push(request(2.0, "s0", 0, 0));
    let long = trace(&lines);
    let o = simulate(&long, POD, setting(4.0, 3_600_000), &cal);
    assert!((o.resident_peak_mib - 900.0).abs() < 1.0, "{o:?}");
    cal.touch_ms = 0.0;
    let o = simulate(&short, POD, setting(4.0, 3_600_000), &cal);
    assert!((o.resident_peak_mib - 900.0).abs() < 1.0, "{o:?}");
}
