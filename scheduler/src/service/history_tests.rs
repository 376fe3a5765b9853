//! A sample's disk use comes from the guest agent's `statfs("/")`: against
//! the real agent (behind the hybrid vsock stand-in of `guest_tests`), and
//! against stand-ins that lack the operation, lie, or never answer, where
//! the sample keeps the template's rootfs size and is not held up past
//! [`DISK_LIMIT`]. The sandboxes have a stand-in VMM (`lifecycle_tests`).

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use torpor_agent::frame::{encode_frame, read_message, MAX_FRAME};
use torpor_agent::proto::{Op, Request};
use torpor_agent::FakeOps;

use super::super::guest::tests::{vsock_agent, Behaviour};
use super::super::lifecycle_tests::{service_with, with_vmm, FakeVmm};
use super::*;
use crate::model::{Template, TemplateId};

/// Slack for a loaded machine when checking that a sample ended on time.
const LATE: Duration = Duration::from_secs(2);
/// The rootfs size of the stand-in templates.
const ROOTFS: u64 = 3 << 20;

/// A service without the history thread (the tests sample by hand), a
/// Linux template whose rootfs is `rootfs` (or none), and a running
/// sandbox of it with a stand-in VMM.
fn running_linux(rootfs: Option<PathBuf>) -> (tempfile::TempDir, Arc<Service>, FakeVmm, Sandbox) {
    let (dir, service, probe) = service_with(|c| c.history_interval_ms = 0);
    let linux = Template {
        id: TemplateId::generate(),
        name: "linux".into(),
        kind: TemplateKind::Linux,
        kernel: "/nonexistent/vmlinux".into(),
        rootfs,
        ..probe
    };
    service.store().insert_template(&linux).unwrap();
    let vmm = FakeVmm::start(dir.path());
    let s = with_vmm(&service, &linux, &vmm, SandboxState::Running);
    std::fs::create_dir_all(service.sandbox_dir(&s.id)).unwrap();
    (dir, service, vmm, s)
}

/// A sparse rootfs of [`ROOTFS`] bytes in `dir`.
fn rootfs(dir: &Path) -> PathBuf {
    let path = dir.join("rootfs.ext4");
    std::fs::File::create(&path)
        .unwrap()
        .set_len(ROOTFS)
        .unwrap();
    path
}

/// `statvfs("/")` on this host: (total, free) bytes.
fn host_root() -> (u64, u64) {
    // SAFETY: `struct statvfs` is plain integers: all-zero is a valid value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a writable statvfs that outlives
    // the call.
    assert_eq!(unsafe { libc::statvfs(c"/".as_ptr(), &mut st) }, 0);
    let unit = if st.f_frsize > 0 {
        st.f_frsize as u64
    } else {
        st.f_bsize as u64
    };
    (st.f_blocks as u64 * unit, st.f_bfree as u64 * unit)
}

/// What a stand-in agent does.
#[derive(Clone, Copy, Debug)]
enum Guest {
    /// Answers `statfs` with these numbers.
    Answer(FsStats),
    /// An agent before protocol 1.4: `ENOSYS`.
    Old,
    /// Greets, then never answers `statfs`.
    SilentAfterHello,
    /// Accepts the vsock connection, then never greets.
    SilentHello,
    /// Never accepts the vsock connection (no `OK`).
    NoAccept,
    /// Hangs up at once (the agent died).
    HangUp,
}

/// What a stand-in saw.
#[derive(Default)]
struct Seen {
    connections: AtomicUsize,
    statfs: AtomicUsize,
}

/// Waits until the client hangs up (so a silent stand-in's thread ends
/// with the connection).
fn until_closed(conn: &mut UnixStream) {
    let mut buf = [0u8; 256];
    while conn.read(&mut buf).is_ok_and(|n| n > 0) {}
}

fn serve(mut conn: UnixStream, how: Guest, seen: &Seen) -> std::io::Result<()> {
    seen.connections.fetch_add(1, Ordering::SeqCst);
    if matches!(how, Guest::HangUp) {
        return Ok(());
    }
    let mut b = [0u8; 1];
    while conn.read(&mut b)? == 1 && b[0] != b'\n' {}
    if matches!(how, Guest::NoAccept) {
        until_closed(&mut conn);
        return Ok(());
    }
    conn.write_all(b"OK 1073741824\n")?;
    let Ok(Some(hello)) = read_message::<Request>(&mut conn, MAX_FRAME) else {
        return Ok(());
    };
    if matches!(how, Guest::SilentHello) {
        until_closed(&mut conn);
        return Ok(());
    }
    let send = |conn: &mut UnixStream, reply: serde_json::Value| {
        conn.write_all(&encode_frame(&reply, MAX_FRAME).expect("frame"))
    };
    let version = match how {
        Guest::Old => 3,
        _ => 4,
    };
    send(
        &mut conn,
        serde_json::json!({"id": hello.id, "type": "hello",
            "protocol": {"major": 1, "minor": version}, "agent_version": "stand-in"}),
    )?;
    let Ok(Some(req)) = read_message::<Request>(&mut conn, MAX_FRAME) else {
        return Ok(());
    };
    if matches!(req.op, Op::Statfs(_)) {
        seen.statfs.fetch_add(1, Ordering::SeqCst);
    }
    let id = req.id;
    match how {
        Guest::Answer(st) => send(
            &mut conn,
            serde_json::json!({"id": id, "type": "statfs", "block_size": st.block_size,
                "total_bytes": st.total_bytes, "free_bytes": st.free_bytes,
                "available_bytes": st.available_bytes}),
        ),
        Guest::Old => send(
            &mut conn,
            serde_json::json!({"id": id, "type": "error", "code": "ENOSYS", "errno": 38,
                "message": "unknown op \"statfs\""}),
        ),
        _ => {
            until_closed(&mut conn);
            Ok(())
        }
    }
}

/// A stand-in agent behind `s`'s vsock socket.
fn stand_in(service: &Service, s: &Sandbox, how: Guest) -> Arc<Seen> {
    let listener = UnixListener::bind(service.sandbox_dir(&s.id).join(VSOCK_FILE)).unwrap();
    let seen = Arc::new(Seen::default());
    let for_thread = Arc::clone(&seen);
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { return };
            let seen = Arc::clone(&for_thread);
            std::thread::spawn(move || serve(conn, how, &seen));
        }
    });
    seen
}

fn disk(sample: &MetricSample) -> (u64, u64) {
    (sample.disk_used_bytes, sample.disk_total_bytes)
}

/// With the real agent: the size of the guest's root filesystem (here,
/// this host's) and what it uses, not the rootfs file's size.
#[test]
fn the_disk_use_is_the_guests_root_filesystem_from_its_agent() {
    let (_dir, service, _vmm, s) = running_linux(None);
    let _agent = vsock_agent(
        &service.sandbox_dir(&s.id),
        Arc::new(FakeOps::new()),
        Behaviour::Agent,
    );
    let before = host_root();
    let sample = service.sample_history(&s).expect("a sample");
    let after = host_root();
    assert_eq!(sample.disk_total_bytes, before.0, "{sample:?}");
    // Others write on this machine meanwhile: used moves a little.
    const SLACK: u64 = 256 << 20;
    let (lo, hi) = (
        (before.0 - before.1).min(after.0 - after.1),
        (before.0 - before.1).max(after.0 - after.1),
    );
    assert!(
        sample.disk_used_bytes + SLACK >= lo && sample.disk_used_bytes <= hi + SLACK,
        "{sample:?} {before:?} {after:?}"
    );
    assert!(sample.disk_used_bytes <= sample.disk_total_bytes);
    // The history holds it, and the API's read answers it.
    let history = service.metrics_history(&s.id, None, None).unwrap();
    assert_eq!(history.first().map(disk), Some(disk(&sample)));
}

/// A reading is repeated for a minute without asking the guest again
/// (each read wakes it); an older one is read afresh.
#[test]
fn the_guest_is_asked_at_most_once_a_minute() {
    let dir = tempfile::tempdir().unwrap();
    let (_d, service, _vmm, s) = running_linux(Some(rootfs(dir.path())));
    let honest = FsStats {
        block_size: 4096,
        total_bytes: ROOTFS,
        free_bytes: ROOTFS / 2,
        available_bytes: ROOTFS / 2,
    };
    let seen = stand_in(&service, &s, Guest::Answer(honest));
    let first = service.sample_history(&s).expect("a sample");
    let second = service.sample_history(&s).expect("a sample");
    assert_eq!(disk(&first), (ROOTFS / 2, ROOTFS));
    assert_eq!(disk(&first), disk(&second));
    assert_eq!(seen.statfs.load(Ordering::SeqCst), 1);
    // A minute later (the reading aged), the guest is asked again.
    service
        .history
        .series
        .locked()
        .get_mut(&s.id)
        .unwrap()
        .disk_read
        .as_mut()
        .unwrap()
        .1
         .0 -= DISK_EVERY_MS;
    service.sample_history(&s).expect("a sample");
    assert_eq!(seen.statfs.load(Ordering::SeqCst), 2);
}

/// The guest's numbers are clamped: its filesystem is no larger than its
/// disk on the host, and it uses no more than it has.
#[test]
fn the_guests_numbers_are_clamped_to_its_disk() {
    let dir = tempfile::tempdir().unwrap();
    let (_d, service, _vmm, s) = running_linux(Some(rootfs(dir.path())));
    let lie = FsStats {
        block_size: 4096,
        total_bytes: 1 << 40,
        free_bytes: 0,
        available_bytes: 0,
    };
    let seen = stand_in(&service, &s, Guest::Answer(lie));
    let sample = service.sample_history(&s).expect("a sample");
    assert_eq!(disk(&sample), (ROOTFS, ROOTFS));
    assert_eq!(seen.statfs.load(Ordering::SeqCst), 1);

    let st = |total, free| FsStats {
        block_size: 4096,
        total_bytes: total,
        free_bytes: free,
        available_bytes: 0,
    };
    assert_eq!(clamp_disk(&st(100, 30), Some(1000)), (70, 100));
    assert_eq!(clamp_disk(&st(100, 30), None), (70, 100));
    assert_eq!(clamp_disk(&st(100, 500), Some(1000)), (0, 100));
    assert_eq!(clamp_disk(&st(u64::MAX, 0), Some(1000)), (1000, 1000));
}

/// An agent before protocol 1.4 answers `ENOSYS`: the sample keeps the
/// rootfs size, and that VMM's agent is not asked again.
#[test]
fn an_agent_without_statfs_leaves_the_rootfs_size_and_is_asked_once() {
    let dir = tempfile::tempdir().unwrap();
    let (_d, service, vmm, s) = running_linux(Some(rootfs(dir.path())));
    let seen = stand_in(&service, &s, Guest::Old);
    for _ in 0..3 {
        let sample = service.sample_history(&s).expect("a sample");
        assert_eq!(disk(&sample), (ROOTFS, ROOTFS));
    }
    assert_eq!(seen.statfs.load(Ordering::SeqCst), 1);
    assert!(service.history.statfs_unsupported(&s.id, vmm.handle.pid));
    // Another VMM (the sandbox woke elsewhere) is asked again.
    assert!(!service
        .history
        .statfs_unsupported(&s.id, vmm.handle.pid + 1));
}

/// A guest that does not answer (no accept, no greeting, no `statfs`
/// answer) costs a sample at most [`DISK_LIMIT`]; the sample keeps the
/// rootfs size, nothing is left locked, and the next samples do not ask
/// it again for a while.
#[test]
fn a_guest_that_does_not_answer_holds_a_sample_up_at_most_the_limit() {
    for how in [Guest::SilentAfterHello, Guest::SilentHello, Guest::NoAccept] {
        let dir = tempfile::tempdir().unwrap();
        let (_d, service, _vmm, s) = running_linux(Some(rootfs(dir.path())));
        let seen = stand_in(&service, &s, how);
        let started = Instant::now();
        let sample = service.sample_history(&s).expect("a sample");
        let took = started.elapsed();
        assert!(took < DISK_LIMIT + LATE, "{how:?}: {took:?}");
        assert_eq!(disk(&sample), (ROOTFS, ROOTFS), "{how:?}");
        assert_eq!(seen.connections.load(Ordering::SeqCst), 1, "{how:?}");
        assert_eq!(service.lock_entries(), 0, "{how:?}");
        // Backed off: the next sample does not wait on it again.
        let started = Instant::now();
        let sample = service.sample_history(&s).expect("a sample");
        assert!(started.elapsed() < DISK_LIMIT, "{how:?}");
        assert_eq!(disk(&sample), (ROOTFS, ROOTFS), "{how:?}");
        assert_eq!(seen.connections.load(Ordering::SeqCst), 1, "{how:?}");
        // Until the back-off ends.
        let later = Timestamp(Timestamp::now().0 + DISK_RETRY_MS);
        assert!(service.history.may_read_disk(&s.id, later), "{how:?}");
    }
}

/// A guest that fails at once (its agent died) is not backed off from,
/// and not remembered as lacking `statfs`: the next sample asks again.
#[test]
fn a_quick_failure_is_asked_again_at_the_next_sample() {
    let dir = tempfile::tempdir().unwrap();
    let (_d, service, vmm, s) = running_linux(Some(rootfs(dir.path())));
    let seen = stand_in(&service, &s, Guest::HangUp);
    for n in 1..=2 {
        let sample = service.sample_history(&s).expect("a sample");
        assert_eq!(disk(&sample), (ROOTFS, ROOTFS));
        assert_eq!(seen.connections.load(Ordering::SeqCst), n);
    }
    assert!(!service.history.statfs_unsupported(&s.id, vmm.handle.pid));
}

/// The agent of a sandbox that stopped running since it was listed, of a
/// sandbox an operation holds, or of a probe guest is not called.
#[test]
fn only_a_running_linux_guest_is_asked() {
    let dir = tempfile::tempdir().unwrap();
    let (_d, service, _vmm, s) = running_linux(Some(rootfs(dir.path())));
    let seen = stand_in(&service, &s, Guest::Old);
    // Paused since the listing that gave `s`.
    service
        .store()
        .write(|tx| {
            tx.update_sandbox_state(&s.id, SandboxState::Running, SandboxState::Paused, None)
        })
        .unwrap();
    let sample = service.sample_history(&s).expect("a sample");
    assert_eq!(disk(&sample), (ROOTFS, ROOTFS));
    // Paused in the listing itself: not sampled at all.
    let paused = service.store().get_sandbox(&s.id).unwrap();
    assert_eq!(service.sample_history(&paused), None);
    service
        .store()
        .write(|tx| {
            tx.update_sandbox_state(&s.id, SandboxState::Paused, SandboxState::Running, None)
        })
        .unwrap();
    // An operation holds it (longer than the sample waits).
    {
        let _held = service.locks.lock(&s.id);
        let started = Instant::now();
        let sample = service.sample_history(&s).expect("a sample");
        assert_eq!(disk(&sample), (ROOTFS, ROOTFS));
        assert!(started.elapsed() < DISK_LIMIT + LATE);
    }
    assert_eq!(seen.connections.load(Ordering::SeqCst), 0);

    // A probe template's sandbox has no agent to ask.
    let (dir2, probe_service, probe) = service_with(|c| c.history_interval_ms = 0);
    let vmm = FakeVmm::start(dir2.path());
    let p = with_vmm(&probe_service, &probe, &vmm, SandboxState::Running);
    std::fs::create_dir_all(probe_service.sandbox_dir(&p.id)).unwrap();
    let seen = stand_in(&probe_service, &p, Guest::Old);
    let sample = probe_service.sample_history(&p).expect("a sample");
    assert_eq!(disk(&sample), (0, 0));
    assert_eq!(seen.connections.load(Ordering::SeqCst), 0);
}

/// A sandbox's failed disk reads are logged at most once a minute.
#[test]
fn failed_disk_reads_are_logged_once_a_minute_per_sandbox() {
    let h = History::default();
    let (a, b) = (
        SandboxId::new("sbx_00000000000000aa"),
        SandboxId::new("sbx_00000000000000bb"),
    );
    assert!(h.may_warn_disk(&a, Timestamp(1_000)));
    assert!(!h.may_warn_disk(&a, Timestamp(1_000 + 59_999)));
    assert!(h.may_warn_disk(&b, Timestamp(2_000)), "another sandbox");
    assert!(h.may_warn_disk(&a, Timestamp(1_000 + 60_000)));
    assert!(!h.may_warn_disk(&a, Timestamp(1_000 + 60_001)));
}
