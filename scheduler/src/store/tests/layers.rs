//! Reference counting of shared snapshot layers: a layer goes only when no
//! template, sandbox or checkpoint chain reaches it any more.

use std::path::{Path, PathBuf};

use super::*;

fn p(s: &str) -> PathBuf {
    PathBuf::from(s)
}

/// Records `dir` on `parent` (which must be recorded, or None).
fn layer(store: &Store, dir: &str, parent: Option<&str>) {
    store.register_layers(&[(p(dir), parent.map(p))]).unwrap();
}

fn checkpoint(sandbox: &Sandbox, name: &str, dir: &str) -> Checkpoint {
    Checkpoint {
        id: CheckpointId::generate(),
        sandbox: sandbox.id.clone(),
        name: name.into(),
        snapshot_dir: p(dir),
        parent: None,
        created_at: Timestamp::now(),
    }
}

fn set_snapshot(store: &Store, s: &Sandbox, dir: &str) {
    store
        .set_sandbox_snapshot(&s.id, Some(Path::new(dir)))
        .unwrap();
}

fn delete(store: &Store, s: &Sandbox) {
    let state = store.get_sandbox(&s.id).unwrap().state;
    store
        .update_sandbox_state(&s.id, state, Deleted, None)
        .unwrap();
}

#[test]
fn shared_layers_go_with_their_last_reference() {
    let (_dir, store, t) = setup();
    let tpl = "/data/templates/probe";
    layer(&store, tpl, None);
    // Source A: hibernated once, then checkpointed while running, then
    // hibernated again on top of the checkpoint.
    let a = sandbox_in(&store, &t, Running);
    layer(&store, "/a/snap1", Some(tpl));
    layer(&store, "/a/ckpt1", Some("/a/snap1"));
    let c1 = checkpoint(&a, "c1", "/a/ckpt1");
    store.insert_checkpoint(&c1).unwrap();
    layer(&store, "/a/snap2", Some("/a/ckpt1"));
    set_snapshot(&store, &a, "/a/snap2");
    // Fork F from c1, hibernated on top of it.
    let f = sandbox_in(&store, &t, Hibernated);
    layer(&store, "/f/snap1", Some("/a/ckpt1"));
    set_snapshot(&store, &f, "/f/snap1");
    // A layer nothing ever referenced (an interrupted hibernation's).
    layer(&store, "/a/stray", Some("/a/snap2"));
    assert_eq!(store.collect_dead_layers().unwrap(), vec![p("/a/stray")]);
    assert!(!store.layer_registered(Path::new("/a/stray")).unwrap());
    assert_eq!(store.collect_dead_layers().unwrap(), Vec::<PathBuf>::new());

    // The checkpoint's name goes; its layer stays under A's and F's diffs.
    store.remove_checkpoint(&c1.id).unwrap();
    assert_eq!(store.collect_dead_layers().unwrap(), Vec::<PathBuf>::new());

    // Deleting the source frees only what F does not sit on.
    delete(&store, &a);
    assert_eq!(store.collect_dead_layers().unwrap(), vec![p("/a/snap2")]);
    for kept in ["/a/ckpt1", "/a/snap1", "/f/snap1", tpl] {
        assert!(store.layer_registered(Path::new(kept)).unwrap(), "{kept}");
    }

    // The last user goes: everything but the template.
    delete(&store, &f);
    assert_eq!(
        store.collect_dead_layers().unwrap(),
        vec![p("/a/ckpt1"), p("/a/snap1"), p("/f/snap1")]
    );
    store.delete_template(&t.id).unwrap();
    assert_eq!(store.collect_dead_layers().unwrap(), vec![p(tpl)]);
}

#[test]
fn checkpoints_of_deleted_sandboxes_are_no_roots() {
    let (_dir, store, t) = setup();
    let tpl = "/data/templates/probe";
    layer(&store, tpl, None);
    let a = sandbox_in(&store, &t, Paused);
    layer(&store, "/a/ckpt", Some(tpl));
    store
        .insert_checkpoint(&checkpoint(&a, "keep", "/a/ckpt"))
        .unwrap();
    set_snapshot(&store, &a, tpl);
    assert_eq!(store.collect_dead_layers().unwrap(), Vec::<PathBuf>::new());
    // A delete interrupted before its checkpoints were removed.
    delete(&store, &a);
    assert_eq!(store.collect_dead_layers().unwrap(), vec![p("/a/ckpt")]);
    assert_eq!(store.remove_checkpoints_of_deleted().unwrap(), 1);
    assert!(store.list_checkpoints(&a.id).unwrap().is_empty());
}

#[test]
fn a_layer_needs_its_parent_recorded_and_names_are_per_sandbox() {
    let (_dir, store, t) = setup();
    let err = store
        .register_layers(&[(p("/x/diff"), Some(p("/x/unknown")))])
        .unwrap_err();
    assert!(matches!(err, StoreError::Invalid { .. }), "{err}");
    // A whole chain at once, base first; registering again is a no-op.
    let chain = [(p("/x/base"), None), (p("/x/diff"), Some(p("/x/base")))];
    store.register_layers(&chain).unwrap();
    store.register_layers(&chain).unwrap();
    let a = sandbox_in(&store, &t, Running);
    let b = sandbox_in(&store, &t, Running);
    store
        .insert_checkpoint(&checkpoint(&a, "n", "/x/diff"))
        .unwrap();
    store
        .insert_checkpoint(&checkpoint(&b, "n", "/x/diff"))
        .unwrap();
    assert!(matches!(
        store.insert_checkpoint(&checkpoint(&a, "n", "/x/diff")),
        Err(StoreError::AlreadyExists { .. })
    ));
    assert_eq!(store.find_checkpoint(&a.id, "n").unwrap().sandbox, a.id);
    assert!(matches!(
        store.find_checkpoint(&a.id, "other"),
        Err(StoreError::NotFound { .. })
    ));
}

#[test]
fn known_layers_are_an_owners_roots_and_what_they_reach() {
    let (_dir, store, t) = setup();
    let tpl = "/data/templates/probe";
    layer(&store, tpl, None);
    // A: a checkpoint on the template, then a hibernation on it.
    let a = sandbox_in(&store, &t, Hibernated);
    layer(&store, "/a/ckpt1", Some(tpl));
    store
        .insert_checkpoint(&checkpoint(&a, "c1", "/a/ckpt1"))
        .unwrap();
    layer(&store, "/a/snap2", Some("/a/ckpt1"));
    set_snapshot(&store, &a, "/a/snap2");
    // F: forked from A's checkpoint, its snapshot not recorded yet.
    let f = sandbox_in(&store, &t, Hibernated);
    set_snapshot(&store, &f, "/f/snap1");
    // V: another sandbox with a layer of its own.
    let v = sandbox_in(&store, &t, Hibernated);
    layer(&store, "/v/snap1", Some(tpl));
    set_snapshot(&store, &v, "/v/snap1");

    let known = |owner: &LayerOwner| -> Vec<(String, Option<Option<String>>)> {
        let text = |p: &Path| p.display().to_string();
        store
            .known_layers(owner)
            .unwrap()
            .into_iter()
            .map(|k| (text(&k.dir), k.parent.map(|p| p.as_deref().map(text))))
            .collect()
    };
    let s = |x: &str| x.to_string();
    assert_eq!(
        known(&LayerOwner::Sandbox(a.id.clone())),
        vec![
            (s("/a/ckpt1"), Some(Some(s(tpl)))),
            (s("/a/snap2"), Some(Some(s("/a/ckpt1")))),
            (s(tpl), Some(None)),
        ]
    );
    // A root the store names but has not recorded: known, parent unknown.
    assert_eq!(
        known(&LayerOwner::Sandbox(f.id.clone())),
        vec![(s(tpl), Some(None)), (s("/f/snap1"), None)]
    );
    // Nothing of A's is V's, nor anything of V's A's.
    let of_v = known(&LayerOwner::Sandbox(v.id.clone()));
    assert!(of_v.iter().all(|(d, _)| !d.starts_with("/a/")), "{of_v:?}");
    assert_eq!(
        known(&LayerOwner::Template(t.id.clone())),
        vec![(s(tpl), Some(None))]
    );
    assert!(known(&LayerOwner::Sandbox(SandboxId::new("sb-none"))).is_empty());
}

#[test]
fn live_layers_are_the_roots_and_the_recorded_layers_they_reach() {
    let (_dir, store, t) = setup();
    let tpl = "/data/templates/probe";
    layer(&store, tpl, None);
    let a = sandbox_in(&store, &t, Hibernated);
    layer(&store, "/a/snap1", Some(tpl));
    layer(&store, "/a/snap2", Some("/a/snap1"));
    set_snapshot(&store, &a, "/a/snap2");
    // A root not recorded (its chain failed the gate): only itself.
    let b = sandbox_in(&store, &t, Hibernated);
    set_snapshot(&store, &b, "/b/forged");
    // Recorded but reached by no root.
    layer(&store, "/a/stray", Some("/a/snap2"));
    let mut live = store.live_layers().unwrap();
    live.sort();
    // The fixture's template's snapshot is `tpl`.
    let want = vec![p("/a/snap1"), p("/a/snap2"), p("/b/forged"), p(tpl)];
    assert_eq!(live, want);
}

#[test]
fn storing_a_sandboxs_latest_snapshot_moves_it_to_a_new_generation() {
    let (_dir, store, t) = setup();
    let a = sandbox_in(&store, &t, Hibernated);
    let b = sandbox_in(&store, &t, Hibernated);
    set_snapshot(&store, &a, "/a/snap2");
    set_snapshot(&store, &b, "/b/snap1");
    let before = (
        store.get_sandbox(&a.id).unwrap(),
        store.get_sandbox(&b.id).unwrap(),
    );
    assert!(before.0.stored_snapshot.is_none());
    store
        .record_layer_object(Path::new("/a/snap2"), "m-a", true)
        .unwrap();
    // An older layer of b's: b's latest is not stored, its row unchanged.
    store
        .record_layer_object(Path::new("/b/snap0"), "m-b", true)
        .unwrap();
    let after = (
        store.get_sandbox(&a.id).unwrap(),
        store.get_sandbox(&b.id).unwrap(),
    );
    assert_eq!(after.0.stored_snapshot.as_deref(), Some("m-a"));
    assert_eq!(after.0.generation, before.0.generation + 1);
    assert_eq!(after.1.generation, before.1.generation);
    assert!(after.1.stored_snapshot.is_none());
}
