//! Templates, pods, checkpoints and the operations journal.

use serde_json::json;

use super::super::*;
use super::{pod, sandbox_in, setup, template};
use crate::state::SandboxState::*;

#[test]
fn templates_are_deleted_only_when_unused() {
    let (_dir, store, t) = setup();
    let s = sandbox_in(&store, &t, Running);
    match store.delete_template(&t.id) {
        Err(StoreError::InUse {
            kind: "template",
            users,
            ..
        }) => assert_eq!(users, "1 sandboxes"),
        other => panic!("{:?}", other.map(|t| t.state)),
    }
    assert_eq!(
        store.get_template(&t.id).unwrap().state,
        TemplateState::Ready
    );
    store
        .update_sandbox_state(&s.id, Running, Deleted, None)
        .unwrap();
    assert_eq!(
        store.delete_template(&t.id).unwrap().state,
        TemplateState::Deleted
    );
    assert_eq!(
        store.delete_template(&t.id).unwrap().state,
        TemplateState::Deleted
    );
    assert!(store.list_templates(false).unwrap().is_empty());
    assert_eq!(store.list_templates(true).unwrap().len(), 1);
    // A deleted template takes no sandboxes and stays deleted; its name is free.
    let mut s = Sandbox::new(t.id.clone(), 64, 1, 0);
    assert!(matches!(
        store.insert_sandbox(&s),
        Err(StoreError::TemplateConflict {
            current: TemplateState::Deleted,
            ..
        })
    ));
    assert!(matches!(
        store.set_template_state(&t.id, &TemplateState::Ready),
        Err(StoreError::TemplateConflict { .. })
    ));
    let again = template("probe");
    store.insert_template(&again).unwrap();
    assert!(matches!(
        store.insert_template(&template("probe")),
        Err(StoreError::AlreadyExists {
            kind: "template named",
            ..
        })
    ));
    // Building and failed templates take no sandboxes either.
    store
        .set_template_state(&again.id, &TemplateState::Building)
        .unwrap();
    s.template = again.id.clone();
    assert!(matches!(
        store.insert_sandbox(&s),
        Err(StoreError::TemplateConflict { .. })
    ));
    let failed = store
        .set_template_state(
            &again.id,
            &TemplateState::Failed("agent never ready".into()),
        )
        .unwrap();
    assert_eq!(failed.state.reason(), Some("agent never ready"));
    store
        .set_template_state(&again.id, &TemplateState::Ready)
        .unwrap();
    store.insert_sandbox(&s).unwrap();
    assert!(matches!(
        store.insert_sandbox(&s),
        Err(StoreError::AlreadyExists { .. })
    ));
}

#[test]
fn ratio_is_validated_and_persisted() {
    let (dir, store, _t) = setup();
    let p = pod(1.0);
    store.insert_pod(&p).unwrap();
    for bad in [
        0.0,
        -1.0,
        100.0001,
        f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
    ] {
        assert!(
            matches!(
                store.set_ratio(&p.id, bad),
                Err(StoreError::InvalidRatio(_))
            ),
            "{bad}"
        );
        assert!(matches!(
            store.insert_pod(&pod(bad)),
            Err(StoreError::InvalidRatio(_))
        ));
    }
    assert_eq!(
        store
            .set_ratio(&p.id, 100.0)
            .unwrap()
            .oversubscription_ratio,
        100.0
    );
    assert_eq!(
        store.set_ratio(&p.id, 0.25).unwrap().oversubscription_ratio,
        0.25
    );
    assert!(matches!(
        store.set_ratio(&PodId::generate(), 2.0),
        Err(StoreError::NotFound { kind: "pod", .. })
    ));
    for bad in [0.0, 1.5, f64::NAN] {
        assert!(matches!(
            store.set_high_watermark(&p.id, bad),
            Err(StoreError::Invalid { .. })
        ));
    }
    store.set_high_watermark(&p.id, 0.95).unwrap();
    store.set_pod_capacity(&p.id, 1 << 30, 4, 2 << 30).unwrap();
    drop(store);
    let store = Store::open(dir.path()).unwrap();
    let back = store.get_pod(&p.id).unwrap();
    assert_eq!(
        (
            back.oversubscription_ratio,
            back.high_watermark,
            back.memory_bytes,
            back.vcpus
        ),
        (0.25, 0.95, 1 << 30, 4)
    );
}

#[test]
fn pods_in_use_are_kept() {
    let (_dir, store, t) = setup();
    let p = pod(1.0);
    store.insert_pod(&p).unwrap();
    let s = sandbox_in(&store, &t, Running);
    assert!(matches!(
        store.set_sandbox_pod(&s.id, Some(&PodId::generate())),
        Err(StoreError::NotFound { kind: "pod", .. })
    ));
    store.set_sandbox_pod(&s.id, Some(&p.id)).unwrap();
    assert!(matches!(
        store.delete_pod(&p.id),
        Err(StoreError::InUse { .. })
    ));
    store
        .update_sandbox_state(&s.id, Running, Deleted, None)
        .unwrap();
    store.delete_pod(&p.id).unwrap();
    assert_eq!(store.get_sandbox(&s.id).unwrap().pod, None);
    assert!(store.list_pods().unwrap().is_empty());
}

#[test]
fn checkpoints_and_purge() {
    let (_dir, store, t) = setup();
    let s = sandbox_in(&store, &t, Running);
    let ckp = |name: &str, parent: Option<&CheckpointId>| Checkpoint {
        id: CheckpointId::generate(),
        sandbox: s.id.clone(),
        name: name.into(),
        snapshot_dir: format!("/data/ckp/{name}").into(),
        parent: parent.cloned(),
        created_at: Timestamp::now(),
    };
    let a = ckp("a", None);
    store.insert_checkpoint(&a).unwrap();
    assert!(matches!(
        store.insert_checkpoint(&ckp("a", None)),
        Err(StoreError::AlreadyExists {
            kind: "checkpoint named",
            ..
        })
    ));
    assert!(matches!(
        store.insert_checkpoint(&ckp("b", Some(&CheckpointId::generate()))),
        Err(StoreError::NotFound {
            kind: "checkpoint",
            ..
        })
    ));
    let b = ckp("b", Some(&a.id));
    store.insert_checkpoint(&b).unwrap();
    assert!(matches!(
        store.delete_checkpoint(&a.id),
        Err(StoreError::InUse { .. })
    ));
    let paths = store.referenced_paths().unwrap();
    for p in [
        &a.snapshot_dir,
        &b.snapshot_dir,
        t.snapshot_dir.as_ref().unwrap(),
    ] {
        assert!(paths.contains(p), "{}", p.display());
    }
    assert!(paths.contains(s.snapshot.as_ref().unwrap()));

    assert!(matches!(
        store.purge_sandbox(&s.id),
        Err(StoreError::Conflict { .. })
    ));
    store
        .update_sandbox_state(&s.id, Running, Deleted, None)
        .unwrap();
    assert!(matches!(
        store.insert_checkpoint(&ckp("c", None)),
        Err(StoreError::NotFound {
            kind: "sandbox",
            ..
        })
    ));
    assert!(!store
        .referenced_paths()
        .unwrap()
        .contains(s.snapshot.as_ref().unwrap()));
    store.purge_sandbox(&s.id).unwrap();
    assert!(matches!(
        store.get_checkpoint(&b.id),
        Err(StoreError::NotFound { .. })
    ));
    assert!(matches!(
        store.get_sandbox(&s.id),
        Err(StoreError::NotFound { .. })
    ));
}

#[test]
fn journal_changes_state_atomically() {
    let (_dir, store, t) = setup();
    let s = sandbox_in(&store, &t, Running);
    // A refused state change journals nothing.
    let wrong = StateChange::new(Paused, Hibernating);
    assert!(matches!(
        store.begin_operation(
            Some(&s.id),
            OperationKind::Hibernate,
            &json!({}),
            Some(&wrong)
        ),
        Err(StoreError::Conflict { .. })
    ));
    assert!(store.interrupted_operations().unwrap().is_empty());

    let op = store
        .begin_operation(
            Some(&s.id),
            OperationKind::Hibernate,
            &json!({"tmp": "/data/x"}),
            Some(&StateChange::new(Running, Hibernating)),
        )
        .unwrap();
    assert_eq!(store.get_sandbox(&s.id).unwrap().state, Hibernating);
    assert_eq!(store.interrupted_operations().unwrap(), vec![op.clone()]);

    // A refused finishing change leaves the operation started.
    assert!(store
        .finish_operation(
            &op.id,
            OperationStatus::Done,
            None,
            Some(&StateChange::new(Running, Paused))
        )
        .is_err());
    assert_eq!(
        store.get_operation(&op.id).unwrap().status,
        OperationStatus::Started
    );

    let done = store
        .finish_operation(
            &op.id,
            OperationStatus::Done,
            Some(&json!({"snapshot": "/data/s/2"})),
            Some(&StateChange::new(Hibernating, Hibernated)),
        )
        .unwrap();
    assert_eq!(done.status, OperationStatus::Done);
    assert!(done.finished_at.is_some());
    assert_eq!(done.detail, json!({"snapshot": "/data/s/2"}));
    assert_eq!(store.get_sandbox(&s.id).unwrap().state, Hibernated);
    assert!(store.interrupted_operations().unwrap().is_empty());
    assert!(matches!(
        store.finish_operation(&op.id, OperationStatus::RolledBack, None, None),
        Err(StoreError::OperationFinished {
            status: OperationStatus::Done,
            ..
        })
    ));
    assert!(matches!(
        store.finish_operation(&op.id, OperationStatus::Started, None, None),
        Err(StoreError::Invalid { .. })
    ));
    assert!(matches!(
        store.begin_operation(None, OperationKind::Pause, &json!({}), Some(&wrong)),
        Err(StoreError::Invalid { .. })
    ));

    let build = store
        .begin_operation(
            None,
            OperationKind::BuildTemplate,
            &json!({"template": t.id}),
            None,
        )
        .unwrap();
    assert_eq!(store.prune_operations(Timestamp(i64::MAX)).unwrap(), 1);
    assert!(matches!(
        store.get_operation(&op.id),
        Err(StoreError::NotFound { .. })
    ));
    assert_eq!(store.interrupted_operations().unwrap(), vec![build]);
}
