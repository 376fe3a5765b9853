//! Store unit tests, each on its own data directory: opening, durability,
//! locking and corruption here; the rest in the submodules.

mod admission;
mod catalog;
mod durability;
mod layers;
mod nested;
mod network;
mod sandboxes;
mod secrets;

use std::collections::BTreeMap;

use serde_json::json;

use super::*;
use crate::model::{PodAddress, TemplateKind};
use crate::state::SandboxState::*;

pub(super) fn template(name: &str) -> Template {
    Template {
        id: TemplateId::generate(),
        name: name.into(),
        kernel: "builtin:probe".into(),
        rootfs: None,
        snapshot_dir: Some(format!("/data/templates/{name}").into()),
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

pub(super) fn pod(ratio: f64) -> Pod {
    Pod {
        id: PodId::generate(),
        address: PodAddress::Local,
        token_hash: None,
        memory_bytes: 24 << 30,
        vcpus: 2,
        disk_bytes: 100 << 30,
        oversubscription_ratio: ratio,
        high_watermark: 0.8,
        created_at: Timestamp::now(),
    }
}

/// A store with one ready template.
pub(super) fn setup() -> (tempfile::TempDir, Store, Template) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let t = template("probe");
    store.insert_template(&t).unwrap();
    (dir, store, t)
}

pub(super) fn sandbox_in(store: &Store, t: &Template, state: SandboxState) -> Sandbox {
    let mut s = Sandbox::new(t.id.clone(), 64, 1, 60_000);
    s.state = state;
    s.snapshot = Some(format!("/data/sandboxes/{}/gen1", s.id).into());
    store.insert_sandbox(&s).unwrap();
    s
}

#[test]
fn store_is_shared_between_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Store>();
}

#[test]
fn open_configures_sqlite_and_schema() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    assert_eq!(store.schema_version().unwrap(), schema::CURRENT_VERSION);
    let conn = store.lock();
    let q = |sql: &str| -> String {
        conn.query_row(sql, [], |r| r.get::<_, rusqlite::types::Value>(0))
            .map(|v| format!("{v:?}"))
            .unwrap()
    };
    assert_eq!(q("PRAGMA journal_mode"), "Text(\"wal\")");
    // NORMAL: commits write the WAL, the group commit fsyncs it.
    assert_eq!(q("PRAGMA synchronous"), "Integer(1)");
    assert_eq!(q("PRAGMA foreign_keys"), "Integer(1)");
    assert_eq!(q("PRAGMA busy_timeout"), "Integer(5000)");
    drop(conn);
    assert!(dir.path().join(DB_FILE).exists());
    let mode = fs::metadata(dir.path().join(DB_FILE))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
}

#[test]
fn everything_survives_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let (t, p, s, c, op) = {
        let store = Store::open(dir.path()).unwrap();
        let t = template("probe");
        store.insert_template(&t).unwrap();
        let p = pod(2.5);
        store.insert_pod(&p).unwrap();
        let mut s = Sandbox::new(t.id.clone(), 128, 2, 30_000);
        s.pod = Some(p.id.clone());
        s.metadata = BTreeMap::from([("user".into(), "ada".into()), ("env".into(), "ci".into())]);
        s.expires_at = Some(Timestamp(1_900_000_000_000));
        s.vmm = Some(VmmHandle {
            pid: 4242,
            start_time: Some(123_456),
            control_socket: "/run/torpor/x.sock".into(),
        });
        store.insert_sandbox(&s).unwrap();
        let s = store
            .update_sandbox_state(&s.id, Creating, Running, None)
            .unwrap();
        let c = Checkpoint {
            id: CheckpointId::generate(),
            sandbox: s.id.clone(),
            name: "before-upgrade".into(),
            snapshot_dir: "/data/checkpoints/a".into(),
            parent: None,
            created_at: Timestamp::now(),
        };
        store.insert_checkpoint(&c).unwrap();
        let op = store
            .begin_operation(
                Some(&s.id),
                OperationKind::Hibernate,
                &json!({"dir": "/x"}),
                None,
            )
            .unwrap();
        (t, p, s, c, op)
    };
    let store = Store::open(dir.path()).unwrap();
    assert_eq!(store.get_template(&t.id).unwrap(), t);
    assert_eq!(store.get_pod(&p.id).unwrap(), p);
    let back = store.get_sandbox(&s.id).unwrap();
    assert_eq!(back, s);
    assert_eq!(back.generation, 1);
    assert_eq!(store.list_checkpoints(&s.id).unwrap(), vec![c]);
    assert_eq!(store.interrupted_operations().unwrap(), vec![op]);
}

#[test]
fn second_open_of_a_data_dir_is_refused_while_the_first_lives() {
    let dir = tempfile::tempdir().unwrap();
    let first = Store::open(dir.path()).unwrap();
    assert!(matches!(
        Store::open(dir.path()),
        Err(StoreError::Locked { .. })
    ));
    drop(first);
    Store::open(dir.path()).unwrap();
}

#[test]
fn newer_schema_is_refused_and_garbage_is_corrupt() {
    let dir = tempfile::tempdir().unwrap();
    drop(Store::open(dir.path()).unwrap());
    let conn = Connection::open(dir.path().join(DB_FILE)).unwrap();
    conn.execute("UPDATE schema_version SET version = 99", [])
        .unwrap();
    drop(conn);
    match Store::open(dir.path()) {
        Err(StoreError::TooNew {
            found: 99,
            supported,
        }) => {
            assert_eq!(supported, schema::CURRENT_VERSION)
        }
        other => panic!("expected TooNew, got {:?}", other.map(|_| ())),
    }

    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join(DB_FILE), vec![0x5a; 8192]).unwrap();
    match Store::open(dir.path()) {
        Err(StoreError::Corrupt(_)) => {}
        other => panic!("expected Corrupt, got {:?}", other.map(|_| ())),
    }
}

#[test]
fn a_stored_value_that_does_not_parse_is_corrupt() {
    let (_dir, store, t) = setup();
    let s = sandbox_in(&store, &t, Running);
    // Bypass the CHECK constraint the way a bad migration might.
    {
        let conn = store.lock();
        conn.execute_batch("PRAGMA ignore_check_constraints = ON")
            .unwrap();
        conn.execute(
            "UPDATE sandboxes SET state = 'sleepy' WHERE id = ?1",
            [&s.id],
        )
        .unwrap();
    }
    assert!(matches!(
        store.get_sandbox(&s.id),
        Err(StoreError::Corrupt(_))
    ));
}

#[test]
fn commits_count_committed_writes_only() {
    let (_dir, store, t) = setup();
    let before = store.commits();
    let s = sandbox_in(&store, &t, Running);
    assert_eq!(store.commits(), before + 1);
    store.get_sandbox(&s.id).unwrap();
    store.read(|tx| tx.committed_mib()).unwrap();
    assert!(store
        .update_sandbox_state(&s.id, Paused, Running, None)
        .is_err());
    assert_eq!(
        store.commits(),
        before + 1,
        "reads and refusals commit nothing"
    );
    store
        .write(|tx| {
            tx.update_sandbox_state(&s.id, Running, Paused, None)?;
            tx.touch(&s.id, Timestamp::now())
        })
        .unwrap();
    assert_eq!(store.commits(), before + 2);
}

/// A relaxed write commits like any other (counted, visible, rolled back
/// on an error or a panic) but waits for no fsync; a durable write does.
#[test]
fn a_relaxed_write_commits_without_an_fsync() {
    let (_dir, store, t) = setup();
    let s = sandbox_in(&store, &t, Running);
    let (before, relaxed, syncs) = (store.commits(), store.relaxed_commits(), store.syncs());
    store
        .write_relaxed(|tx| tx.update_sandbox_state(&s.id, Running, Paused, None))
        .unwrap();
    assert_eq!(store.get_sandbox(&s.id).unwrap().state, Paused);
    assert_eq!(store.commits(), before + 1);
    assert_eq!(store.relaxed_commits(), relaxed + 1);
    assert_eq!(store.syncs(), syncs, "no fsync for a relaxed write");

    let refused = store.write_relaxed(|tx| {
        tx.update_sandbox_state(&s.id, Paused, Running, None)?;
        tx.update_sandbox_state(&s.id, Paused, Running, None)
    });
    assert!(refused.is_err());
    assert_eq!(
        store.get_sandbox(&s.id).unwrap().state,
        Paused,
        "rolled back"
    );
    assert_eq!(store.commits(), before + 1);

    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        store.write_relaxed(|tx| -> Result<()> {
            tx.update_sandbox_state(&s.id, Paused, Running, None)?;
            panic!("in the middle of a relaxed write")
        })
    }));
    assert!(panicked.is_err());
    assert_eq!(
        store.get_sandbox(&s.id).unwrap().state,
        Paused,
        "rolled back"
    );
    store
        .write(|tx| tx.update_sandbox_state(&s.id, Paused, Running, None))
        .unwrap();
    assert_eq!(store.syncs(), syncs + 1, "a durable write waits for one");
}
