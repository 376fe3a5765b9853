//! Directory changes, ownership in `stat` and inotify watches (protocol
//! 1.1), entries' `st_mode`, resolved targets and metadata, and watch
//! events with entries (1.2) against a real agent on this host's
//! filesystem.

mod common;

use common::{default_agent, ScratchPaths};
use std::time::{Duration, Instant};
use torpor_agent::proto::{FileKind, WatchAddRequest, WatchEvent, WatchEventKind};
use torpor_agent::ClientError;

fn code(e: ClientError) -> String {
    match e {
        ClientError::Agent(r) => r.code,
        other => panic!("not an agent error: {other}"),
    }
}

#[test]
fn mkdir_rename_remove_and_ownership() {
    let agent = default_agent();
    let mut c = agent.client();
    let d = agent.dir.file("a");
    let made = c.mkdir(&d, false).unwrap();
    assert_eq!(
        (made.name.as_str(), made.kind, made.mode),
        ("a", FileKind::Dir, 0o755)
    );
    // SAFETY: no preconditions.
    let uid = unsafe { libc::geteuid() };
    assert_eq!(made.uid, Some(uid));
    assert_eq!(made.owner, torpor_agent::users::user_name(uid));
    assert!(made.group.is_some());
    assert_eq!(code(c.mkdir(&d, false).unwrap_err()), "EEXIST");
    c.mkdir(&d, true).unwrap();
    let deep = agent.dir.file("a/b/c");
    assert_eq!(code(c.mkdir(&deep, false).unwrap_err()), "ENOENT");
    c.mkdir(&deep, true).unwrap();
    c.write_file_all(&agent.dir.file("a/b/c/f"), b"x", None, false)
        .unwrap();
    std::os::unix::fs::symlink("f", agent.dir.path().join("a/b/c/l")).unwrap();
    let l = c.stat(&agent.dir.file("a/b/c/l"), false).unwrap();
    assert_eq!(
        (l.kind, l.link_target.as_deref()),
        (FileKind::Symlink, Some("f"))
    );
    // A file where a directory is asked for.
    assert_eq!(
        code(c.mkdir(&agent.dir.file("a/b/c/f"), true).unwrap_err()),
        "EEXIST"
    );

    let moved = c
        .rename(&agent.dir.file("a/b"), &agent.dir.file("z"))
        .unwrap();
    assert_eq!((moved.name.as_str(), moved.kind), ("z", FileKind::Dir));
    assert_eq!(
        code(c.stat(&agent.dir.file("a/b"), true).unwrap_err()),
        "ENOENT"
    );
    assert_eq!(
        code(c.rename(&agent.dir.file("nope"), &d).unwrap_err()),
        "ENOENT"
    );
    assert_eq!(code(c.rename("rel", &d).unwrap_err()), "EINVAL");

    // Remove: a symlink (not its target), then a whole tree.
    c.remove(&agent.dir.file("z/c/l")).unwrap();
    assert!(agent.dir.path().join("z/c/f").exists());
    c.remove(&agent.dir.file("z")).unwrap();
    assert!(!agent.dir.path().join("z").exists());
    assert_eq!(code(c.remove(&agent.dir.file("z")).unwrap_err()), "ENOENT");
    assert_eq!(code(c.remove("/").unwrap_err()), "EBUSY");
    assert_eq!(code(c.remove("").unwrap_err()), "EINVAL");

    // New directories go to a named owner; an unknown owner creates none.
    let ghost = agent.dir.file("g/h");
    let e = c
        .mkdir_as(&ghost, true, Some("no-such-user-torpor"))
        .unwrap_err();
    assert_eq!(code(e), "ENOENT");
    assert!(!agent.dir.path().join("g").exists());
    let nobody = torpor_agent::users::by_name("nobody");
    if let (0, Ok(nobody)) = (uid, nobody) {
        let made = c
            .mkdir_as(&agent.dir.file("n/o"), true, Some("nobody"))
            .unwrap();
        assert_eq!(made.owner.as_deref(), Some("nobody"));
        assert_eq!(made.gid, Some(nobody.gid));
        let n = c.stat(&agent.dir.file("n"), false).unwrap();
        assert_eq!(n.uid, Some(nobody.uid));
        let top = c.stat(&agent.dir.file(""), false).unwrap();
        assert_eq!(top.uid, Some(0), "an existing parent keeps its owner");
    }
}

/// Polls a watch until `want` events arrived (or 10 s passed).
fn collect(
    c: &mut torpor_agent::AgentClient<std::os::unix::net::UnixStream>,
    id: u64,
    want: impl Fn(&[WatchEvent]) -> bool,
) -> Vec<WatchEvent> {
    let mut all = Vec::new();
    let until = Instant::now() + Duration::from_secs(10);
    while !want(&all) && Instant::now() < until {
        let got = c.watch_events(id).unwrap();
        assert!(!got.overflow);
        all.extend(got.events);
        std::thread::sleep(Duration::from_millis(20));
    }
    all
}

fn has(events: &[WatchEvent], name: &str, kind: WatchEventKind) -> bool {
    events.iter().any(|e| e.name == name && e.kind == kind)
}

#[test]
fn watches_report_changes_recursively_and_are_bounded() {
    let agent = default_agent();
    let mut c = agent.client();
    let root = agent.dir.path().join("w");
    std::fs::create_dir_all(root.join("old")).unwrap();
    let flat = c.watch_add(root.to_str().unwrap(), false).unwrap();
    let deep = c.watch_add(root.to_str().unwrap(), true).unwrap();
    assert_ne!(flat, deep);

    std::fs::write(root.join("f"), b"1").unwrap();
    std::fs::write(root.join("old/g"), b"1").unwrap();
    std::fs::create_dir(root.join("new")).unwrap();
    // Give the agent a chance to add the new directory before using it.
    let seen = collect(&mut c, deep, |e| has(e, "new", WatchEventKind::Create));
    assert!(has(&seen, "f", WatchEventKind::Create), "{seen:?}");
    assert!(has(&seen, "f", WatchEventKind::Write), "{seen:?}");
    assert!(has(&seen, "old/g", WatchEventKind::Create), "{seen:?}");
    std::fs::write(root.join("new/h"), b"1").unwrap();
    std::fs::rename(root.join("f"), root.join("f2")).unwrap();
    std::fs::remove_file(root.join("f2")).unwrap();
    let later = collect(&mut c, deep, |e| has(e, "f2", WatchEventKind::Remove));
    assert!(has(&later, "new/h", WatchEventKind::Create), "{later:?}");
    assert!(has(&later, "f", WatchEventKind::Rename), "{later:?}");
    assert!(has(&later, "f2", WatchEventKind::Create), "{later:?}");

    // A directory and a file made in it at once, with nothing read in
    // between: the watch's own thread adds the directory as its creation
    // comes and reports what it already holds.
    std::fs::create_dir(root.join("burst")).unwrap();
    std::fs::write(root.join("burst/inner"), b"1").unwrap();
    let burst = collect(&mut c, deep, |e| {
        has(e, "burst/inner", WatchEventKind::Create)
    });
    assert!(has(&burst, "burst", WatchEventKind::Create), "{burst:?}");
    assert!(
        has(&burst, "burst/inner", WatchEventKind::Create),
        "{burst:?}"
    );

    // The flat watch saw the top level only.
    let flat_seen = c.watch_events(flat).unwrap().events;
    assert!(
        has(&flat_seen, "f", WatchEventKind::Create),
        "{flat_seen:?}"
    );
    assert!(
        flat_seen.iter().all(|e| !e.name.contains('/')),
        "{flat_seen:?}"
    );

    c.watch_remove(flat).unwrap();
    assert_eq!(code(c.watch_events(flat).unwrap_err()), "ENOENT");
    assert_eq!(code(c.watch_remove(flat).unwrap_err()), "ENOENT");
    assert_eq!(
        code(c.watch_add(&agent.dir.file("missing"), false).unwrap_err()),
        "ENOENT"
    );
    std::fs::write(root.join("file"), b"").unwrap();
    assert_eq!(
        code(
            c.watch_add(root.join("file").to_str().unwrap(), false)
                .unwrap_err()
        ),
        "ENOTDIR"
    );
    assert_eq!(code(c.watch_add("rel", false).unwrap_err()), "EINVAL");
    // At most MAX_WATCHES at once (one is still open).
    let mut ids = Vec::new();
    for _ in 1..torpor_agent::watch::MAX_WATCHES {
        ids.push(c.watch_add(root.to_str().unwrap(), false).unwrap());
    }
    assert_eq!(
        code(c.watch_add(root.to_str().unwrap(), false).unwrap_err()),
        "EAGAIN"
    );
    for id in ids {
        c.watch_remove(id).unwrap();
    }
    c.watch_remove(deep).unwrap();
}

#[test]
fn entries_carry_st_mode_resolved_targets_metadata_and_watch_entries() {
    let agent = default_agent();
    let mut c = agent.client();
    let d = agent.dir.path().join("m");
    std::fs::create_dir(&d).unwrap();
    let id = c
        .watch_add_with(WatchAddRequest {
            path: d.to_str().unwrap().into(),
            recursive: false,
            include_entry: true,
            allow_network_mounts: false,
        })
        .unwrap();
    let f = d.join("f");
    c.write_file_all(f.to_str().unwrap(), b"x", None, false)
        .unwrap();
    std::os::unix::fs::symlink("f", d.join("l")).unwrap();
    let st = c.stat(f.to_str().unwrap(), false).unwrap();
    assert_eq!(st.st_mode, Some(libc::S_IFREG | 0o644));
    assert!(st.metadata.is_empty());
    let link = c.stat(d.join("l").to_str().unwrap(), false).unwrap();
    let real = std::fs::canonicalize(&f).unwrap();
    assert_eq!(link.resolved.as_deref(), real.to_str());
    assert_eq!(link.link_target.as_deref(), Some("f"));

    let meta = [("author".to_string(), "me".to_string())].into();
    c.set_metadata(f.to_str().unwrap(), meta).unwrap();
    let st = c.stat(f.to_str().unwrap(), true).unwrap();
    assert_eq!(st.metadata.get("author").map(String::as_str), Some("me"));
    // A link shows its target's.
    assert_eq!(
        c.stat(d.join("l").to_str().unwrap(), false)
            .unwrap()
            .metadata,
        st.metadata
    );
    let listed = c.list_dir(d.to_str().unwrap()).unwrap();
    assert_eq!(listed.entries[0].metadata, st.metadata);
    c.set_metadata(f.to_str().unwrap(), Default::default())
        .unwrap();
    assert!(c
        .stat(f.to_str().unwrap(), true)
        .unwrap()
        .metadata
        .is_empty());
    assert_eq!(
        code(
            c.set_metadata(&agent.dir.file("missing"), Default::default())
                .unwrap_err()
        ),
        "ENOENT"
    );

    // Events of what is there carry its stat; a link's its target's too.
    let seen = collect(&mut c, id, |e| has(e, "l", WatchEventKind::Create));
    let created = seen
        .iter()
        .find(|e| e.name == "f" && e.kind == WatchEventKind::Create)
        .unwrap_or_else(|| panic!("{seen:?}"));
    assert_eq!(created.path.as_deref(), f.to_str());
    assert_eq!(created.entry.as_ref().map(|e| e.kind), Some(FileKind::File));
    let l = seen.iter().find(|e| e.name == "l").unwrap();
    assert_eq!(l.entry.as_ref().map(|e| e.kind), Some(FileKind::Symlink));
    assert_eq!(l.target.as_ref().map(|e| e.kind), Some(FileKind::File));
    std::fs::remove_file(d.join("l")).unwrap();
    let gone = collect(&mut c, id, |e| has(e, "l", WatchEventKind::Remove));
    let removed = gone.iter().find(|e| e.name == "l").unwrap();
    assert!(
        removed.entry.is_none() && removed.path.is_none(),
        "{removed:?}"
    );
    c.watch_remove(id).unwrap();
}
