//! Sandbox rows: the transition table through the store, compare-and-set,
//! filters, setters, and transactions that fail.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use serde_json::json;

use super::super::*;
use super::{pod, sandbox_in, setup, template};
use crate::state::{transition, SandboxState::*};

#[test]
fn every_transition_through_the_store_follows_the_table() {
    let (_dir, store, t) = setup();
    // `lost` is a cluster replica's state, never a pod's: its store
    // refuses it (below).
    let pod_states = || SandboxState::ALL.iter().copied().filter(|&s| s != Lost);
    for from in pod_states() {
        let s = sandbox_in(&store, &t, from);
        if transition(from, Lost).is_ok() {
            assert!(
                store.update_sandbox_state(&s.id, from, Lost, None).is_err(),
                "{from} -> lost in a pod's store"
            );
        }
        for to in pod_states() {
            let s = sandbox_in(&store, &t, from);
            let got = store.update_sandbox_state(&s.id, from, to, Some("boom"));
            match transition(from, to) {
                Ok(()) => {
                    let s = got.unwrap_or_else(|e| panic!("{from} -> {to}: {e}"));
                    assert_eq!((s.state, s.generation), (to, 1), "{from} -> {to}");
                }
                Err(illegal) => {
                    match got {
                        Err(StoreError::IllegalTransition(e)) => assert_eq!(e, illegal),
                        other => panic!("{from} -> {to}: {:?}", other.map(|s| s.state)),
                    }
                    let s = store.get_sandbox(&s.id).unwrap();
                    assert_eq!(
                        (s.state, s.generation),
                        (from, 0),
                        "{from} -> {to} unchanged"
                    );
                }
            }
        }
    }
}

#[test]
fn compare_and_set_reports_the_current_state() {
    let (_dir, store, t) = setup();
    let s = sandbox_in(&store, &t, Running);
    store
        .update_sandbox_state(&s.id, Running, Paused, None)
        .unwrap();
    match store.update_sandbox_state(&s.id, Running, Hibernating, None) {
        Err(StoreError::Conflict {
            expected: Running,
            current: Paused,
            ..
        }) => {}
        other => panic!("{:?}", other.map(|s| s.state)),
    }
    assert!(matches!(
        store.update_sandbox_state(&SandboxId::generate(), Running, Paused, None),
        Err(StoreError::NotFound {
            kind: "sandbox",
            ..
        })
    ));
}

#[test]
fn concurrent_compare_and_set_has_one_winner() {
    let (_dir, store, t) = setup();
    let store = Arc::new(store);
    let s = sandbox_in(&store, &t, Running);
    let winners: usize = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..8)
            .map(|_| {
                let (store, id) = (store.clone(), s.id.clone());
                scope.spawn(move || store.update_sandbox_state(&id, Running, Hibernating, None))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| match h.join().unwrap() {
                Ok(_) => 1,
                Err(StoreError::Conflict {
                    current: Hibernating,
                    ..
                }) => 0,
                Err(e) => panic!("{e}"),
            })
            .sum()
    });
    assert_eq!(winners, 1);
    assert_eq!(store.get_sandbox(&s.id).unwrap().generation, 1);
}

#[test]
fn failure_reason_and_snapshot_rules() {
    let (_dir, store, t) = setup();
    let s = sandbox_in(&store, &t, Running);
    let f = store
        .update_sandbox_state(&s.id, Running, Failed, Some("vmm killed"))
        .unwrap();
    assert_eq!(f.failure_reason.as_deref(), Some("vmm killed"));
    let r = store
        .update_sandbox_state(&s.id, Failed, Resuming, None)
        .unwrap();
    assert_eq!(r.failure_reason, None);
    let f = store
        .update_sandbox_state(&s.id, Resuming, Failed, None)
        .unwrap();
    assert_eq!(f.failure_reason.as_deref(), Some("unknown"));
    let d = store
        .update_sandbox_state(&s.id, Failed, Deleted, None)
        .unwrap();
    assert_eq!(
        d.failure_reason.as_deref(),
        Some("unknown"),
        "kept as a record"
    );

    let mut bare = Sandbox::new(t.id.clone(), 64, 1, 0);
    bare.state = Hibernated;
    store.insert_sandbox(&bare).unwrap();
    assert!(matches!(
        store.update_sandbox_state(&bare.id, Hibernated, Resuming, None),
        Err(StoreError::NoSnapshot { .. })
    ));
    store
        .set_sandbox_snapshot(&bare.id, Some(Path::new("/data/s/1")))
        .unwrap();
    store
        .update_sandbox_state(&bare.id, Hibernated, Resuming, None)
        .unwrap();
}

#[test]
fn list_filters() {
    let (_dir, store, t) = setup();
    let t2 = template("linux");
    store.insert_template(&t2).unwrap();
    let p = pod(1.0);
    store.insert_pod(&p).unwrap();
    let mk = |t: &Template, state, meta: &[(&str, &str)], placed: bool| {
        let mut s = Sandbox::new(t.id.clone(), 64, 1, 1000);
        s.state = state;
        s.pod = placed.then(|| p.id.clone());
        s.metadata = meta
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        store.insert_sandbox(&s).unwrap();
        s.id
    };
    let a = mk(&t, Running, &[("user", "ada"), ("env", "ci")], true);
    let b = mk(&t, Hibernated, &[("user", "ada")], true);
    let c = mk(&t2, Running, &[("user", "bob"), ("env", "ci")], false);
    let d = mk(&t, Deleted, &[("user", "ada")], true);
    let ids = |f: SandboxFilter| -> Vec<SandboxId> {
        let mut v: Vec<_> = store
            .list_sandboxes(&f)
            .unwrap()
            .into_iter()
            .map(|s| s.id)
            .collect();
        v.sort();
        v
    };
    let sorted = |mut v: Vec<SandboxId>| {
        v.sort();
        v
    };
    assert_eq!(
        ids(SandboxFilter::default()),
        sorted(vec![a.clone(), b.clone(), c.clone()])
    );
    let f = |states: Vec<SandboxState>| SandboxFilter {
        states,
        ..Default::default()
    };
    assert_eq!(ids(f(vec![Running])), sorted(vec![a.clone(), c.clone()]));
    assert_eq!(ids(f(vec![Deleted])), vec![d.clone()]);
    assert_eq!(
        ids(f(vec![Hibernated, Deleted])),
        sorted(vec![b.clone(), d])
    );
    let by_template = SandboxFilter {
        template: Some(t2.id.clone()),
        ..Default::default()
    };
    assert_eq!(ids(by_template), vec![c.clone()]);
    let by_pod = SandboxFilter {
        pod: Some(p.id.clone()),
        ..Default::default()
    };
    assert_eq!(ids(by_pod), sorted(vec![a.clone(), b.clone()]));
    let meta = |pairs: &[(&str, &str)]| SandboxFilter {
        metadata: pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..Default::default()
    };
    assert_eq!(
        ids(meta(&[("user", "ada")])),
        sorted(vec![a.clone(), b.clone()])
    );
    assert_eq!(
        ids(meta(&[("env", "ci")])),
        sorted(vec![a.clone(), c.clone()])
    );
    assert_eq!(
        ids(meta(&[("user", "ada"), ("env", "ci")])),
        vec![a.clone()]
    );
    assert_eq!(ids(meta(&[("user", "eve")])), Vec::<SandboxId>::new());
    // Quotes and SQL in values are just values.
    assert_eq!(
        ids(meta(&[("user", "' OR 1=1 --")])),
        Vec::<SandboxId>::new()
    );
    let all = SandboxFilter {
        states: vec![Running],
        template: Some(t.id.clone()),
        pod: Some(p.id.clone()),
        metadata: meta(&[("env", "ci")]).metadata,
        tenant: None,
    };
    assert_eq!(ids(all), vec![a.clone()]);

    store
        .set_sandbox_metadata(&a, &BTreeMap::from([("user".into(), "eve".into())]))
        .unwrap();
    assert_eq!(ids(meta(&[("user", "eve")])), vec![a]);
}

#[test]
fn a_failed_write_closure_rolls_everything_back() {
    let (_dir, store, t) = setup();
    let err = store
        .write(|tx| {
            let s = Sandbox::new(t.id.clone(), 64, 1, 0);
            tx.insert_sandbox(&s)?;
            tx.begin_operation(Some(&s.id), OperationKind::Create, &json!({}), None)?;
            tx.insert_template(&template("probe")) // name taken: fails
        })
        .unwrap_err();
    assert!(matches!(err, StoreError::AlreadyExists { .. }));
    assert!(store
        .list_sandboxes(&SandboxFilter::default())
        .unwrap()
        .is_empty());
    assert!(store.interrupted_operations().unwrap().is_empty());
    // A panic inside a closure rolls back too, and the store stays usable.
    let store = Arc::new(store);
    let s2 = store.clone();
    let t2 = t.clone();
    let panicked = std::thread::spawn(move || {
        s2.write(|tx| -> Result<()> {
            tx.insert_sandbox(&Sandbox::new(t2.id.clone(), 64, 1, 0))?;
            panic!("bug in a closure");
        })
    })
    .join();
    assert!(panicked.is_err());
    assert!(store
        .list_sandboxes(&SandboxFilter::default())
        .unwrap()
        .is_empty());
    sandbox_in(&store, &t, Running);
}

#[test]
fn setters_and_touch() {
    let (_dir, store, t) = setup();
    let s = sandbox_in(&store, &t, Running);
    store
        .touch(&s.id, Timestamp(s.last_active_at.0 + 500))
        .unwrap();
    store.touch(&s.id, Timestamp(1)).unwrap();
    assert_eq!(
        store.get_sandbox(&s.id).unwrap().last_active_at,
        Timestamp(s.last_active_at.0 + 500)
    );
    let vmm = VmmHandle {
        pid: 77,
        start_time: None,
        control_socket: "/run/torpor/77.sock".into(),
    };
    store.set_sandbox_vmm(&s.id, Some(&vmm)).unwrap();
    store
        .set_sandbox_timeout(&s.id, 5, Some(Timestamp(9)))
        .unwrap();
    let back = store.get_sandbox(&s.id).unwrap();
    assert_eq!(
        (back.vmm, back.keep_alive_ms, back.expires_at),
        (Some(vmm), 5, Some(Timestamp(9)))
    );
    store.set_sandbox_vmm(&s.id, None).unwrap();
    assert_eq!(store.get_sandbox(&s.id).unwrap().vmm, None);
    assert!(matches!(
        store.set_sandbox_timeout(&s.id, u64::MAX, None),
        Err(StoreError::Invalid { .. })
    ));
    let missing = SandboxId::generate();
    assert!(matches!(
        store.touch(&missing, Timestamp::now()),
        Err(StoreError::NotFound { .. })
    ));
    assert!(matches!(
        store.set_sandbox_snapshot(&missing, None),
        Err(StoreError::NotFound { .. })
    ));
}

#[test]
fn tenants_own_sandboxes_and_templates_and_lists_filter_by_them() {
    let (_d, store, t) = setup();
    let mut mine = Sandbox::new(t.id.clone(), 64, 1, 60_000);
    mine.tenant = Some("acme".into());
    store.insert_sandbox(&mine).unwrap();
    let mut theirs = Sandbox::new(t.id.clone(), 64, 1, 60_000);
    theirs.tenant = Some("other".into());
    store.insert_sandbox(&theirs).unwrap();
    sandbox_in(&store, &t, Running);
    assert_eq!(
        store.get_sandbox(&mine.id).unwrap().tenant.as_deref(),
        Some("acme")
    );
    let of = |tenant: &str| -> Vec<SandboxId> {
        store
            .list_sandboxes(&SandboxFilter {
                tenant: Some(tenant.into()),
                ..Default::default()
            })
            .unwrap()
            .into_iter()
            .map(|s| s.id)
            .collect()
    };
    assert_eq!(of("acme"), vec![mine.id.clone()]);
    assert_eq!(of("other"), vec![theirs.id.clone()]);
    assert!(of("' OR 1=1 --").is_empty());
    assert_eq!(
        store
            .list_sandboxes(&SandboxFilter::default())
            .unwrap()
            .len(),
        3
    );

    let mut tpl = super::template("private");
    tpl.tenant = Some("acme".into());
    tpl.image = Some("debian".into());
    store.insert_template(&tpl).unwrap();
    let back = store.get_template(&tpl.id).unwrap();
    assert_eq!(back.tenant.as_deref(), Some("acme"));
    assert_eq!(back.image.as_deref(), Some("debian"));
}

#[test]
fn env_and_on_timeout_round_trip_and_a_version_2_store_upgrades() {
    use crate::model::OnTimeout;
    let (dir, store, t) = setup();
    let mut s = Sandbox::new(t.id.clone(), 64, 1, 60_000);
    s.env.insert("API_KEY".into(), "secret".into());
    s.on_timeout = OnTimeout::Hibernate;
    s.access_token = Some("tok".into());
    s.ingress_host = Some("localhost:${PORT}".into());
    s.volumes = vec![crate::model::MountedVolume {
        id: "vol_1".into(),
        name: "data".into(),
        path: "/mnt/data".into(),
    }];
    store.insert_sandbox(&s).unwrap();
    let back = store.get_sandbox(&s.id).unwrap();
    assert_eq!(back.ingress_host.as_deref(), Some("localhost:${PORT}"));
    assert_eq!(back.volumes, s.volumes);
    assert_eq!(back.env, s.env);
    assert_eq!(back.on_timeout, OnTimeout::Hibernate);
    assert_eq!(back.access_token.as_deref(), Some("tok"));
    let listed = store.list_sandboxes(&SandboxFilter::default()).unwrap();
    assert_eq!(listed[0].env, s.env);
    let plain = sandbox_in(&store, &t, Running);
    drop(store);

    // The same data as a version 2 store wrote it: no column, no table.
    let conn = rusqlite::Connection::open(dir.path().join(DB_FILE)).unwrap();
    conn.execute_batch(
        "DROP INDEX templates_live_tenant_name; \
         CREATE UNIQUE INDEX templates_live_name ON templates (name) WHERE state != 'deleted'; \
         ALTER TABLE sandboxes DROP COLUMN on_timeout; DROP TABLE sandbox_env; \
         DROP TABLE template_sources; ALTER TABLE sandboxes DROP COLUMN access_token; ALTER TABLE sandboxes DROP COLUMN vmm_start; \
         DROP TABLE sandbox_network; DROP TABLE nested_sandboxes; DROP TABLE layer_objects; DROP TABLE secrets; \
         DROP INDEX sandboxes_tenant; ALTER TABLE sandboxes DROP COLUMN tenant; \
         ALTER TABLE templates DROP COLUMN tenant; ALTER TABLE templates DROP COLUMN image; \
         ALTER TABLE sandboxes DROP COLUMN timeout_hibernation; \
         ALTER TABLE sandboxes DROP COLUMN disk_only; \
         ALTER TABLE sandboxes DROP COLUMN guest_unresponsive_at_pause; \
         ALTER TABLE sandboxes DROP COLUMN ingress_host; \
         ALTER TABLE sandboxes DROP COLUMN volumes; \
         UPDATE schema_version SET version = 2;",
    )
    .unwrap();
    drop(conn);
    let store = Store::open(dir.path()).unwrap();
    assert_eq!(store.schema_version().unwrap(), schema::CURRENT_VERSION);
    for id in [&s.id, &plain.id] {
        let old = store.get_sandbox(id).unwrap();
        assert_eq!(old.on_timeout, OnTimeout::Delete, "the old behaviour");
        assert!(old.env.is_empty());
        assert!(old.access_token.is_none());
        assert!(old.ingress_host.is_none());
        assert!(old.volumes.is_empty());
        // Version 8: memory hibernations, nothing marked.
        assert_eq!(
            old.timeout_hibernation,
            crate::model::HibernationKind::Memory
        );
        assert!(!old.disk_only && !old.guest_unresponsive_at_pause);
    }
    // And they round trip.
    store
        .set_sandbox_hibernation(&plain.id, true, true)
        .unwrap();
    let back = store.get_sandbox(&plain.id).unwrap();
    assert!(back.disk_only && back.guest_unresponsive_at_pause);
}
