//! Crash safety of the store: a child process (this test binary again,
//! running only `crash_child`) writes to a store and is killed with SIGKILL
//! mid-way; the parent reopens the store and checks that what was committed
//! is there, what was not is not, and the journal names the interrupted
//! operation. Every wait is bounded.

use std::collections::HashSet;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::json;
use torpor_scheduler::files::{cleanup_orphans, commit_dir, create_temp_dir_for, TEMP_PREFIX};
use torpor_scheduler::store::{OperationKind, OperationStatus, SandboxFilter, StateChange};
use torpor_scheduler::{
    Sandbox, SandboxState, Store, Template, TemplateId, TemplateKind, TemplateState, Timestamp,
};

const CHILD_DIR: &str = "TORPOR_SCHEDULER_CRASH_DIR";
const CHILD_MODE: &str = "TORPOR_SCHEDULER_CRASH_MODE";
const LINE: &str = "CRASH-CHILD ";
const WAIT: Duration = Duration::from_secs(60);

/// Kills the child if the test fails before it does.
struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn template() -> Template {
    Template {
        id: TemplateId::generate(),
        name: "probe".into(),
        kernel: "builtin:probe".into(),
        rootfs: None,
        snapshot_dir: None,
        mem_mib: 64,
        vcpus: 1,
        kind: TemplateKind::Probe,
        created_at: Timestamp::now(),
        state: TemplateState::Ready,
        tenant: None,
        image: None,
        source: None,
        stored_snapshot: None,
    }
}

fn say(what: &str) {
    println!("{LINE}{what}");
}

/// The child's side; a no-op in a normal test run.
#[test]
fn crash_child() {
    let Ok(dir) = std::env::var(CHILD_DIR) else {
        return;
    };
    let dir = PathBuf::from(dir);
    let store = Store::open(&dir).unwrap();
    let t = template();
    store.insert_template(&t).unwrap();
    match std::env::var(CHILD_MODE).as_deref() {
        Ok("hold") => hold(&store, &t, &dir),
        Ok("stream") => stream(&store, &t),
        Ok("group") => std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| stream(&store, &t));
            }
        }),
        other => panic!("unknown mode {other:?}"),
    }
}

/// Commits a sandbox with a started create operation, leaves snapshot
/// debris, then hangs inside an open transaction until killed.
fn hold(store: &Store, t: &Template, dir: &Path) {
    let snapshots = dir.join("snapshots");
    let a = Sandbox::new(t.id.clone(), 64, 1, 1000);
    let recorded = snapshots.join(a.id.as_str()).join("gen0");
    std::fs::create_dir_all(recorded.parent().unwrap()).unwrap();
    let tmp = create_temp_dir_for(&recorded).unwrap();
    std::fs::write(tmp.join("state"), b"complete").unwrap();
    commit_dir(&tmp, &recorded).unwrap();
    store
        .write(|tx| {
            tx.insert_sandbox(&a)?;
            tx.set_sandbox_snapshot(&a.id, Some(&recorded))?;
            tx.begin_operation(
                Some(&a.id),
                OperationKind::Create,
                &json!({"step": 1}),
                None,
            )
        })
        .unwrap();
    say(&format!("committed {}", a.id));
    // Debris: a half-written next layer and a finished, never-recorded one.
    let next = snapshots.join(a.id.as_str()).join("gen1");
    let half = create_temp_dir_for(&next).unwrap();
    std::fs::write(half.join("memory"), b"partial").unwrap();
    let stray = snapshots.join("sbx_never_recorded");
    std::fs::create_dir_all(&stray).unwrap();
    std::fs::write(stray.join("state"), b"s").unwrap();
    let _ = store.write(|tx| {
        let b = Sandbox::new(t.id.clone(), 64, 1, 1000);
        tx.insert_sandbox(&b)?;
        tx.begin_operation(Some(&b.id), OperationKind::Create, &json!({}), None)?;
        tx.update_sandbox_state(
            &a.id,
            SandboxState::Creating,
            SandboxState::Failed,
            Some("x"),
        )?;
        say(&format!("inside {}", b.id));
        std::thread::sleep(WAIT * 2);
        Ok(())
    });
    panic!("not killed in time");
}

/// Creates sandboxes in two transactions each (insert + journal, then state
/// change + finish), reporting each acknowledged one, until killed.
fn stream(store: &Store, t: &Template) {
    for i in 0..100_000 {
        let s = Sandbox::new(t.id.clone(), 64, 1, 1000);
        let op = store
            .write(|tx| {
                tx.insert_sandbox(&s)?;
                tx.begin_operation(Some(&s.id), OperationKind::Create, &json!({ "i": i }), None)
            })
            .unwrap();
        store
            .finish_operation(
                &op.id,
                OperationStatus::Done,
                None,
                Some(&StateChange::new(
                    SandboxState::Creating,
                    SandboxState::Running,
                )),
            )
            .unwrap();
        say(&format!("acked {}", s.id));
    }
    panic!("not killed in time");
}

/// Starts the child in `mode` on `dir`; its `CRASH-CHILD` lines arrive on
/// the returned channel.
fn spawn_child(dir: &Path, mode: &str) -> (ChildGuard, mpsc::Receiver<String>) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "crash_child", "--nocapture", "--test-threads=1"])
        .env(CHILD_DIR, dir)
        .env(CHILD_MODE, mode)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            // libtest may print "test crash_child ... " on the same line.
            if let Some(at) = line.find(LINE) {
                if tx.send(line[at + LINE.len()..].to_string()).is_err() {
                    break;
                }
            }
        }
    });
    (ChildGuard(child), rx)
}

fn next_line(rx: &mpsc::Receiver<String>, deadline: Instant) -> String {
    let left = deadline.saturating_duration_since(Instant::now());
    rx.recv_timeout(left)
        .unwrap_or_else(|e| panic!("child said nothing more ({e:?}); see its stderr above"))
}

fn sigkill(mut child: ChildGuard) {
    child.0.kill().unwrap(); // SIGKILL
    let status = child.0.wait().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
}

#[test]
fn kill_inside_a_transaction_loses_it_and_keeps_what_was_committed() {
    let dir = tempfile::tempdir().unwrap();
    let (child, rx) = spawn_child(dir.path(), "hold");
    let deadline = Instant::now() + WAIT;
    let committed = next_line(&rx, deadline);
    let a = committed.strip_prefix("committed ").unwrap().to_string();
    let inside = next_line(&rx, deadline);
    let b = inside.strip_prefix("inside ").unwrap().to_string();
    sigkill(child);

    let store = Store::open(dir.path()).unwrap();
    assert_eq!(store.list_templates(false).unwrap().len(), 1);
    let sandboxes = store.list_sandboxes(&SandboxFilter::default()).unwrap();
    let ids: Vec<&str> = sandboxes.iter().map(|s| s.id.as_str()).collect();
    assert_eq!(
        ids,
        vec![a.as_str()],
        "committed A is there, uncommitted {b} is not"
    );
    assert_eq!(
        sandboxes[0].state,
        SandboxState::Creating,
        "A's failure was never committed"
    );
    let interrupted = store.interrupted_operations().unwrap();
    assert_eq!(interrupted.len(), 1);
    assert_eq!(
        interrupted[0].sandbox.as_ref().map(|s| s.as_str()),
        Some(a.as_str())
    );
    assert_eq!(interrupted[0].kind, OperationKind::Create);
    assert_eq!(interrupted[0].detail, json!({"step": 1}));

    // Recovery rolls the create back; the snapshot debris goes.
    let op = &interrupted[0];
    store
        .finish_operation(
            &op.id,
            OperationStatus::RolledBack,
            None,
            Some(&StateChange {
                from: SandboxState::Creating,
                to: SandboxState::Failed,
                reason: Some("interrupted by a crash".into()),
            }),
        )
        .unwrap();
    assert!(store.interrupted_operations().unwrap().is_empty());
    let live: HashSet<PathBuf> = store.referenced_paths().unwrap();
    let snapshots = dir.path().join("snapshots");
    let report = cleanup_orphans(&snapshots, &live).unwrap();
    assert_eq!(report.temp.len(), 1, "{report:?}");
    assert!(report.temp[0]
        .file_name()
        .unwrap()
        .to_string_lossy()
        .starts_with(TEMP_PREFIX));
    assert_eq!(report.orphans, vec![snapshots.join("sbx_never_recorded")]);
    let kept = sandboxes[0].snapshot.clone().unwrap();
    assert_eq!(std::fs::read(kept.join("state")).unwrap(), b"complete");
}

#[test]
fn kill_while_writing_loses_nothing_acknowledged() {
    kill_while_writing(1);
}

/// Four threads writing at once: their commits share fsyncs (the group
/// commit), and still nothing acknowledged is lost.
#[test]
fn kill_while_writing_from_four_threads_loses_nothing_acknowledged() {
    kill_while_writing(4);
}

fn kill_while_writing(writers: usize) {
    let dir = tempfile::tempdir().unwrap();
    let mode = if writers == 1 { "stream" } else { "group" };
    let (child, rx) = spawn_child(dir.path(), mode);
    let deadline = Instant::now() + WAIT;
    let mut acked = Vec::new();
    while acked.len() < 25 {
        let line = next_line(&rx, deadline);
        acked.push(line.strip_prefix("acked ").unwrap().to_string());
    }
    sigkill(child); // while it keeps writing
                    // The child is dead: read what it printed up to its end (EOF).
    for line in rx.iter() {
        acked.push(line.strip_prefix("acked ").unwrap().to_string());
    }

    let store = Store::open(dir.path()).unwrap();
    let all = store.list_sandboxes(&SandboxFilter::default()).unwrap();
    for id in &acked {
        let s = all
            .iter()
            .find(|s| s.id.as_str() == id)
            .expect("acknowledged sandbox lost");
        assert_eq!(s.state, SandboxState::Running, "{id}");
    }
    // At most one sandbox per writer past the last acknowledgement, and
    // every sandbox still creating has exactly one interrupted operation
    // naming it.
    assert!(
        all.len() <= acked.len() + writers,
        "{} rows, {} acked",
        all.len(),
        acked.len()
    );
    let interrupted = store.interrupted_operations().unwrap();
    let creating: Vec<_> = all
        .iter()
        .filter(|s| s.state == SandboxState::Creating)
        .collect();
    assert!(creating.len() <= writers);
    assert_eq!(interrupted.len(), creating.len());
    for op in &interrupted {
        assert!(
            creating.iter().any(|s| op.sandbox.as_ref() == Some(&s.id)),
            "{op:?}"
        );
    }
}
