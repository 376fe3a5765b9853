//! `torpor serve`'s nested sandboxes in the store: kept across a reopen
//! (a restart of serve), the pod's latest answer with them, lost ones
//! marked with why, deleted ones forgotten.

use std::collections::BTreeMap;

use super::super::*;
use super::{sandbox_in, setup};
use crate::state::SandboxState::*;

fn nested(id: &SandboxId, pod: &str, tenant: &str) -> NestedSandbox {
    NestedSandbox {
        id: id.clone(),
        pod: PodId::new(pod),
        tenant: Some(tenant.into()),
        access_token: Some(format!("envd-{tenant}")),
        env: BTreeMap::from([("GREETING".to_string(), "hello".to_string())]),
        last_seen: None,
        lost: None,
        volumes: Vec::new(),
    }
}

#[test]
fn nested_sandboxes_survive_a_reopen_and_are_marked_lost_with_their_pod() {
    let (dir, store, t) = setup();
    // A sandbox record as a pod answers it (made in this store only to
    // have one; the nested pod's are in its own store).
    let answer = sandbox_in(&store, &t, Running);
    let a = nested(&SandboxId::generate(), "pod_aaaa", "alpha");
    let mut b = nested(&SandboxId::generate(), "pod_bbbb", "bravo");
    b.access_token = None;
    b.volumes = vec![crate::model::MountedVolume {
        id: "vol_1".into(),
        name: "data".into(),
        path: "/mnt/data".into(),
    }];
    store.put_nested_sandbox(&a).unwrap();
    store.put_nested_sandbox(&b).unwrap();
    store.set_nested_last_seen(&a.id, &answer).unwrap();
    drop(store);

    let store = Store::open(dir.path()).unwrap();
    let got = store.get_nested_sandbox(&a.id).unwrap().unwrap();
    assert_eq!(got.tenant.as_deref(), Some("alpha"));
    assert_eq!(got.access_token.as_deref(), Some("envd-alpha"));
    assert_eq!(got.env["GREETING"], "hello");
    assert_eq!(got.last_seen.as_ref().map(|s| &s.id), Some(&answer.id));
    assert_eq!(got.lost, None);
    assert_eq!(store.nested_sandboxes().unwrap().len(), 2);
    assert!(got.volumes.is_empty());
    assert_eq!(
        store.get_nested_sandbox(&b.id).unwrap().unwrap().volumes,
        b.volumes
    );

    // pod_aaaa's host is still there; every other pod's sandboxes are lost.
    let n = store
        .mark_nested_lost(Some(&PodId::new("pod_aaaa")), "its nested host stopped")
        .unwrap();
    assert_eq!(n, 1);
    let lost = store.get_nested_sandbox(&b.id).unwrap().unwrap();
    assert_eq!(lost.lost.as_deref(), Some("its nested host stopped"));
    assert_eq!(store.get_nested_sandbox(&a.id).unwrap().unwrap().lost, None);
    // Lost once: the first reason stays, and no later answer replaces
    // what was last seen.
    assert_eq!(store.mark_nested_lost(None, "again").unwrap(), 1);
    let a_lost = store.get_nested_sandbox(&a.id).unwrap().unwrap();
    assert_eq!(a_lost.lost.as_deref(), Some("again"));
    let mut later = answer.clone();
    later.state = Hibernated;
    store.set_nested_last_seen(&a.id, &later).unwrap();
    let kept = store.get_nested_sandbox(&a.id).unwrap().unwrap();
    assert_eq!(kept.last_seen.unwrap().state, Running);
    assert_eq!(store.mark_nested_lost(None, "third").unwrap(), 0);

    store.remove_nested_sandbox(&a.id).unwrap();
    assert_eq!(store.get_nested_sandbox(&a.id).unwrap(), None);
    assert_eq!(store.nested_sandboxes().unwrap().len(), 1);
}
