//! Recovery after a kill -9 of the service, without guests: stand-in
//! `torpor-vmm` processes (a copy of `sleep` under that name) whose stderr
//! is a sandbox's or a standby shell's log, as a real VMM's is.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::lifecycle_tests::service_with;
use super::*;
use crate::model::{Sandbox, VmmHandle};
use crate::store::OperationKind;

/// A `torpor-vmm` process (a copy of `sleep`) logging to `log`.
struct Stand {
    child: Child,
}

impl Stand {
    fn start(exe: &Path, log: &Path) -> Self {
        std::fs::create_dir_all(log.parent().unwrap()).unwrap();
        let log = std::fs::File::create(log).unwrap();
        let child = Command::new(exe)
            .arg("600")
            .stdin(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        Stand { child }
    }

    /// Whether it exits within `limit`.
    fn exits_within(&mut self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if self.child.try_wait().unwrap().is_some() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }
}

impl Drop for Stand {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A copy of `sleep` named `torpor-vmm` under `root`.
fn stand_in_exe(root: &Path) -> PathBuf {
    let exe = root.join("bin").join("torpor-vmm");
    std::fs::create_dir_all(exe.parent().unwrap()).unwrap();
    std::fs::copy("/usr/bin/sleep", &exe)
        .or_else(|_| std::fs::copy("/bin/sleep", &exe))
        .unwrap();
    exe
}

/// Reopens the service on `root` after a kill -9 (no pool, no policy).
fn restart(root: &Path) -> Arc<Service> {
    let mut config = ServiceConfig::new(root.to_path_buf(), PathBuf::from("/nonexistent/torpor"));
    config.policy_interval_ms = 0;
    config.standby_pool = 0;
    Service::open(config).unwrap()
}

/// Waits until `n` stand-ins log under `root` (started and named).
fn wait_logging(root: &Path, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while vmm::logging_under(root).len() < n {
        assert!(Instant::now() < deadline, "{:?}", vmm::logging_under(root));
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A control socket that answers every request with a running VM's status.
fn answering_socket(path: PathBuf, pid: u32) {
    let listener = UnixListener::bind(&path).unwrap();
    let status = serde_json::json!({"ok": true, "status": {
        "protocol": 1, "state": "running", "pid": pid, "vcpus": 1, "mem_mib": 64,
        "kernel": "probe", "uptime_ms": 1, "generation": 1, "memory_backend": "anonymous"
    }});
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            let mut line = String::new();
            if BufReader::new(&conn).read_line(&mut line).is_ok() {
                let _ = writeln!(conn, "{status}");
            }
        }
    });
}

/// A kill -9 of the service between a create's VMM start and the record
/// of its handle left the VMM running while the restarted service marked
/// the sandbox failed (the chaos run's "unaccounted VMM"). Recovery now
/// ends it, found by its log in the sandbox's directory; a re-attached
/// sandbox's VMM and a VMM logging elsewhere are left alone.
#[test]
fn recovery_ends_a_vmm_no_sandbox_keeps() {
    let (dir, service, template) = service_with(|_| {});
    let root = dir.path().to_path_buf();
    let exe = stand_in_exe(&root);
    let sandbox_log = |id: &SandboxId| root.join("sandboxes").join(id.as_str()).join("vmm.log");

    // A create interrupted after the spawn: the row creating, its
    // operation open, no handle recorded, the VMM up.
    let mut creating = Sandbox::new(template.id.clone(), 64, 1, 60_000);
    creating.pod = Some(PodId::new(LOCAL_POD));
    service
        .store()
        .write(|tx| {
            tx.insert_sandbox(&creating)?;
            tx.begin_operation(
                Some(&creating.id),
                OperationKind::Create,
                &serde_json::json!({}),
                None,
            )
        })
        .unwrap();
    let mut stray = Stand::start(&exe, &sandbox_log(&creating.id));

    // A running sandbox whose VMM answers: re-attached, kept.
    let mut live = Sandbox::new(template.id.clone(), 64, 1, 60_000);
    live.pod = Some(PodId::new(LOCAL_POD));
    live.state = SandboxState::Running;
    let mut kept = Stand::start(&exe, &sandbox_log(&live.id));
    let socket = root
        .join("sandboxes")
        .join(live.id.as_str())
        .join("ctl.sock");
    answering_socket(socket.clone(), kept.child.id());
    live.vmm = Some(VmmHandle {
        pid: kept.child.id(),
        start_time: vmm::start_time(kept.child.id()),
        control_socket: socket,
    });
    service.store().insert_sandbox(&live).unwrap();

    // A VMM whose log is not a sandbox's.
    let mut other = Stand::start(&exe, &root.join("elsewhere").join("vmm.log"));

    // The processes are up and named before the restart looks for them.
    wait_logging(&root, 3);
    drop(service);
    let service = restart(&root);

    let failed = service.get_sandbox(&creating.id).unwrap();
    assert_eq!(failed.state, SandboxState::Failed);
    assert!(
        stray.exits_within(Duration::from_secs(5)),
        "the VMM of the failed create still runs"
    );
    assert_eq!(
        service.get_sandbox(&live.id).unwrap().state,
        SandboxState::Running
    );
    assert!(!kept.exits_within(Duration::from_millis(300)));
    assert!(!other.exits_within(Duration::from_millis(100)));
}

/// A standby shell of the earlier run, taken for a restore and stopped
/// between the move of its socket into the sandbox's directory and the
/// move of its log: no socket left in its `pool/` directory to ask it to
/// shut down, no log in a sandbox's directory for recovery to find. A
/// jailed shell does not die with its pod (its parent is its supervisor),
/// so it waited on, unaccounted for; the pool's clean-up now ends it, found
/// by its log. A VMM logging outside the pool is left alone.
#[test]
fn a_shell_left_in_the_pool_without_its_socket_is_ended() {
    let (dir, service, _) = service_with(|_| {});
    let root = dir.path().to_path_buf();
    let exe = stand_in_exe(&root);
    let shell = root.join("pool").join("shell-1-0");
    let mut taken = Stand::start(&exe, &shell.join("vmm.log"));
    let mut other = Stand::start(&exe, &root.join("elsewhere").join("vmm.log"));
    wait_logging(&root, 2);
    assert!(!shell.join("ctl.sock").exists());
    drop(service);
    let _service = restart(&root);
    assert!(
        taken.exits_within(Duration::from_secs(5)),
        "the taken shell still runs"
    );
    assert!(!shell.exists());
    assert!(!other.exits_within(Duration::from_millis(100)));
}

/// Start-up's orphan sweep keeps the layers the store records, never what
/// a VMM's `lineage.json` says: a forged record naming a directory
/// elsewhere (here an orphan another sandbox left) keeps nothing alive.
#[test]
fn a_forged_lineage_keeps_no_orphan() {
    let (dir, service, template) = service_with(|_| {});
    let root = std::fs::canonicalize(dir.path()).unwrap();
    let mut hibernated = Sandbox::new(template.id.clone(), 64, 1, 60_000);
    hibernated.pod = Some(PodId::new(LOCAL_POD));
    hibernated.state = SandboxState::Hibernated;
    let snap = root
        .join("sandboxes")
        .join(hibernated.id.as_str())
        .join("snap-1");
    hibernated.snapshot = Some(snap.clone());
    service.store().insert_sandbox(&hibernated).unwrap();
    drop(service);
    let orphan = root.join("sandboxes").join("sb_gone").join("old");
    std::fs::create_dir_all(&orphan).unwrap();
    std::fs::write(orphan.join("memory"), b"m").unwrap();
    std::fs::create_dir_all(&snap).unwrap();
    std::fs::write(snap.join("state"), b"s").unwrap();
    let forged = serde_json::json!({ "version": 1, "layers": [orphan, snap] });
    std::fs::write(snap.join("lineage.json"), forged.to_string()).unwrap();

    let _service = restart(&root);
    assert!(!orphan.exists(), "a forged lineage kept an orphan");
    assert!(snap.exists(), "the sandbox's own snapshot went");
}
