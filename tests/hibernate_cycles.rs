//! Sandboxes cycling hibernate → wake for a long time, side by side, with
//! their snapshots on a small tmpfs (issue 26: two sandboxes doing this
//! both died at their 32nd hibernation, "killed by its seccomp filter").
//!
//! Every 16th hibernation of a sandbox is a full snapshot that replaces its
//! chain of diffs. It reads all of guest RAM, holes of the layers' memory
//! files included, and on a tmpfs reading a hole allocates a page: on a
//! full tmpfs that read was a SIGBUS, which Rust std's fault handler turned
//! into a seccomp kill (SIGSYS) and the sandbox was lost. Now the snapshot
//! fails with `no_space` (507 in the API), the sandbox runs on, and once
//! space is freed the next hibernation succeeds. A diff hibernation of a
//! paused sandbox that fails for want of space must not lose the pages
//! dirtied before it either: the probe guest's checksums, checked after
//! every wake, see any page that came back stale.
//!
//! Runs the service in process with real, jailed VMMs (probe guests);
//! needs root (the tmpfs, the jail): see tests/needs.

mod common;

use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use common::disk::SmallDisk;
use common::serve::DataDir;
use torpor_scheduler::model::SandboxId;
use torpor_scheduler::service::{CreateSandbox, Service, ServiceError};
use torpor_scheduler::SandboxState;
use torpor_vmm_api::control::{Request, VmState};
use torpor_vmm_api::lineage::Lineage;
use torpor_vmm_api::ErrorKind;

/// The probe's workload, MiB (rewritten every iteration).
const MIB: u32 = 1;
/// A sandbox's hibernations number `FULL_EVERY`, `2 * FULL_EVERY`, ... are
/// full snapshots (the scheduler's `MAX_DIFF_DEPTH`: the chain under a
/// sandbox created from a template starts one layer deep). The test checks
/// that they are.
const FULL_EVERY: u64 = 16;
/// The hibernation that fails as a diff, on a paused sandbox.
const PAUSED_DIFF: u64 = 10;
/// The tmpfs under `DATA/sandboxes`: room for both sandboxes' layers,
/// filled up on purpose before the hibernations that must fail.
const DISK_KIB: u64 = 256 * 1024;
const WAIT: Duration = Duration::from_secs(30);

/// A service whose sandboxes' directories are on a small tmpfs (its store
/// and templates are not); its sandboxes are deleted when the test ends.
struct Pod {
    service: Arc<Service>,
    sandboxes: PathBuf,
    // Dropped in this order: the tmpfs, then the data directory.
    _disk: SmallDisk,
    _data: DataDir,
}

impl Pod {
    fn new(name: &str) -> Self {
        let data = DataDir::new(name);
        let sandboxes = data.0.join("sandboxes");
        let disk = SmallDisk::mount(&sandboxes, DISK_KIB, std::process::id());
        let service = common::service_with_probe(
            &data.0,
            |_| {},
            "fast",
            64,
            &format!("probe.mib={MIB} probe.ticks=1 probe.hz=100"),
        );
        Pod {
            service,
            sandboxes,
            _disk: disk,
            _data: data,
        }
    }

    fn create(&self) -> SandboxId {
        self.service
            .create_sandbox(CreateSandbox {
                template: "fast".into(),
                ..Default::default()
            })
            .expect("create")
            .id
    }

    /// The ITER lines of the sandbox's console (its current VMM's run).
    fn iterations(&self, id: &SandboxId) -> Vec<(u64, u64)> {
        std::fs::read_to_string(self.sandboxes.join(id.as_str()).join("console.log"))
            .unwrap_or_default()
            .lines()
            .filter_map(torpor_probe::parse_iter_line)
            .collect()
    }

    /// Waits until the guest has printed two iterations in this run (so it
    /// ran one whole iteration, rewriting its workload, since it was
    /// restored) and checks that each read what the one before it wrote.
    fn guest_iterates(&self, id: &SandboxId, when: &str) {
        let deadline = Instant::now() + WAIT;
        let iters = loop {
            let iters = self.iterations(id);
            if iters.len() >= 2 {
                break iters;
            }
            assert!(
                Instant::now() < deadline,
                "{id} {when}: the guest printed {iters:?} in {WAIT:?}"
            );
            std::thread::sleep(Duration::from_millis(5));
        };
        for (i, &(n, sum)) in iters.iter().enumerate() {
            assert_eq!(n, iters[0].0 + i as u64, "{id} {when}: {iters:?}");
            assert_eq!(
                sum,
                torpor_probe::iteration_checksum(MIB, n),
                "{id} {when}: iteration {n} read memory that is not what iteration {} wrote",
                n - 1
            );
        }
    }

    /// How many layers the chain of the sandbox's snapshot has.
    fn depth(&self, id: &SandboxId) -> usize {
        let snapshot = self.service.get_sandbox(id).unwrap().snapshot;
        Lineage::read(&snapshot.expect("a hibernated sandbox's snapshot"))
            .expect("its lineage")
            .depth()
    }

    /// Asserts that the sandbox is `state` and its VMM answers so.
    fn still_there(&self, id: &SandboxId, state: SandboxState, vm_state: VmState) {
        let sandbox = self.service.get_sandbox(id).unwrap();
        assert_eq!(sandbox.state, state, "{id}: {:?}", sandbox.failure_reason);
        let status = torpor_vmm_api::control::request(
            &sandbox.vmm.expect("its VMM").control_socket,
            &Request::Status,
            WAIT,
        )
        .expect("its VMM answers");
        assert_eq!(status.state, vm_state, "{id}");
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        common::end_service(&self.service);
    }
}

/// Where the two cycling threads meet: the last to arrive acts for both
/// (fills or frees the disk). A thread that does not come within [`WAIT`]
/// (it failed) fails the other too, rather than leaving it waiting.
struct Meeting {
    state: Mutex<(usize, u64)>,
    arrived: Condvar,
    ballast: PathBuf,
}

impl Meeting {
    fn meet(&self, act: impl FnOnce()) {
        let mut state = self.state.lock().unwrap();
        let round = state.1;
        state.0 += 1;
        if state.0 == 2 {
            act();
            *state = (0, round + 1);
            self.arrived.notify_all();
            return;
        }
        let (_state, waited) = self
            .arrived
            .wait_timeout_while(state, WAIT, |s| s.1 == round)
            .unwrap();
        assert!(!waited.timed_out(), "the other sandbox's thread never came");
    }

    /// Fills the tmpfs to its last page.
    fn fill(&self) {
        self.meet(|| {
            let mut file = std::fs::File::create(&self.ballast).unwrap();
            for chunk in [vec![0xa5u8; 1 << 20], vec![0xa5u8; 4096]] {
                let full = loop {
                    if let Err(e) = file.write_all(&chunk) {
                        break e;
                    }
                };
                assert_eq!(
                    full.raw_os_error(),
                    Some(libc::ENOSPC),
                    "filling the tmpfs: {full}"
                );
            }
        });
        self.meet(|| {});
    }

    fn free(&self) {
        self.meet(|| std::fs::remove_file(&self.ballast).unwrap());
        self.meet(|| {});
    }
}

/// One hibernation with the disk full: 507 (`no_space`), the sandbox and
/// its VMM still there in the state it was in; then, with the disk freed,
/// the same hibernation succeeds.
fn no_space_then_retry(pod: &Pod, meeting: &Meeting, id: &SandboxId, paused: bool) {
    meeting.fill();
    let err = pod
        .service
        .hibernate(id)
        .expect_err("a hibernation on a full disk");
    assert!(
        matches!(&err, ServiceError::Vm(e) if e.kind == ErrorKind::NoSpace),
        "{id}: a hibernation on a full disk must fail with no_space (507): {err:?}; \
         sandbox: {:?}",
        pod.service
            .get_sandbox(id)
            .map(|s| (s.state, s.failure_reason))
    );
    eprintln!("{id}: on a full disk: {err}");
    if paused {
        pod.still_there(id, SandboxState::Paused, VmState::Paused);
    } else {
        pod.still_there(id, SandboxState::Running, VmState::Running);
    }
    meeting.free();
    pod.service
        .hibernate(id)
        .expect("the hibernation once space is freed");
}

/// `2 * FULL_EVERY` hibernations of one sandbox, each followed by a wake.
fn cycle(pod: &Pod, meeting: &Meeting, id: &SandboxId) {
    for n in 1..=2 * FULL_EVERY {
        let when = format!("before hibernation {n}");
        pod.guest_iterates(id, &when);
        if n == PAUSED_DIFF {
            pod.service.pause(id).expect("pause");
            no_space_then_retry(pod, meeting, id, true);
        } else if n % FULL_EVERY == 0 {
            no_space_then_retry(pod, meeting, id, false);
        } else {
            pod.service.hibernate(id).expect(&when);
        }
        let depth = pod.depth(id);
        if n % FULL_EVERY == 0 {
            assert_eq!(depth, 1, "{id}: hibernation {n} was to be a full snapshot");
        } else {
            assert!(depth > 1, "{id}: hibernation {n} was to be a diff");
        }
        let woken = pod.service.connect(id).expect("wake");
        assert!(woken.resumed, "{id}: wake after hibernation {n}");
        assert_eq!(woken.sandbox.state, SandboxState::Running);
    }
    pod.guest_iterates(id, "after the last wake");
}

#[test]
fn two_sandboxes_cycle_side_by_side_past_two_consolidations_on_a_tmpfs() {
    let started = Instant::now();
    let pod = Pod::new("hibernate-cycles");
    let meeting = Meeting {
        state: Mutex::new((0, 0)),
        arrived: Condvar::new(),
        ballast: pod.sandboxes.join("ballast"),
    };
    let ids = [pod.create(), pod.create()];
    std::thread::scope(|scope| {
        for id in &ids {
            let (pod, meeting) = (&pod, &meeting);
            scope.spawn(move || cycle(pod, meeting, id));
        }
    });
    for id in &ids {
        pod.still_there(id, SandboxState::Running, VmState::Running);
    }
    eprintln!(
        "2 sandboxes × {} hibernations and wakes in {:?}",
        2 * FULL_EVERY,
        started.elapsed()
    );
}
