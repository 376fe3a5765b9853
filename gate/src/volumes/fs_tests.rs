use super::*;

fn p(s: &str) -> VolumePath {
    VolumePath::parse(s).unwrap()
}

/// A volume's content in a scratch directory, beside an `outside`
/// directory holding a secret a path must never reach.
fn content(limit: u64) -> (tempfile::TempDir, Content) {
    let t = tempfile::tempdir().unwrap();
    std::fs::create_dir(t.path().join("outside")).unwrap();
    std::fs::write(t.path().join("outside/secret"), b"host secret").unwrap();
    let c = Content::open(t.path().join("content"), limit).unwrap();
    (t, c)
}

fn write(c: &Content, path: &str, data: &[u8], force: bool) -> Result<EntryStat, FsError> {
    c.write_file(&p(path), &mut &data[..], &Meta::default(), force)
}

fn read(c: &Content, path: &str) -> Result<Vec<u8>, FsError> {
    let (mut f, _) = c.open_file(&p(path))?;
    let mut v = Vec::new();
    f.read_to_end(&mut v).unwrap();
    Ok(v)
}

#[test]
fn paths_are_names_beneath_the_root_and_dot_dot_is_refused() {
    assert_eq!(p("/a//b/./c/").shown(), "/a/b/c");
    assert_eq!(p("a/b").shown(), "/a/b");
    assert!(p("/").is_root());
    for bad in [
        "",
        "../x",
        "/a/../../x",
        "a/..",
        "..",
        "a\0b",
        "/.torpor-tmp.x",
    ] {
        assert!(
            matches!(VolumePath::parse(bad), Err(FsError::Invalid(_))),
            "{bad:?} is refused"
        );
    }
    assert!(VolumePath::parse(&"a".repeat(MAX_PATH + 1)).is_err());
}

#[test]
fn absolute_paths_are_the_volumes_own() {
    let (_t, c) = content(1 << 20);
    // `/etc/passwd` is the volume's, not the host's.
    assert!(matches!(read(&c, "/etc/passwd"), Err(FsError::NotFound(_))));
    c.make_dir(&p("/etc"), &Meta::default(), false).unwrap();
    write(&c, "/etc/passwd", b"mine", false).unwrap();
    assert_eq!(read(&c, "etc/passwd").unwrap(), b"mine");
}

#[test]
fn symbolic_links_are_never_followed() {
    let (t, c) = content(1 << 20);
    let root = t.path().join("content");
    // Links planted in the volume (the API makes none): to a directory
    // outside, to a file outside, and an absolute one.
    std::os::unix::fs::symlink("../outside", root.join("up")).unwrap();
    std::os::unix::fs::symlink(t.path().join("outside/secret"), root.join("abs")).unwrap();
    std::os::unix::fs::symlink("/etc", root.join("etc")).unwrap();
    for path in ["/up/secret", "/etc/passwd"] {
        for (what, r) in [
            ("read", read(&c, path).map(|_| ())),
            ("stat", c.stat(&p(path)).map(|_| ())),
            ("write", write(&c, path, b"x", true).map(|_| ())),
            ("remove", c.remove(&p(path))),
            ("list", c.list(&p(path), 1).map(|_| ())),
            (
                "make_dir",
                c.make_dir(&p(&format!("{path}/d")), &Meta::default(), true)
                    .map(|_| ()),
            ),
            (
                "set_meta",
                c.set_meta(
                    &p(path),
                    &Meta {
                        mode: Some(0o777),
                        ..Meta::default()
                    },
                )
                .map(|_| ()),
            ),
        ] {
            assert!(
                matches!(r, Err(FsError::Invalid(ref m)) if m.contains("symbolic link")),
                "{what} {path}: {r:?}"
            );
        }
    }
    // The link itself: shown as a link, not read, not listed through.
    let st = c.stat(&p("/abs")).unwrap();
    assert_eq!(st.kind, EntryType::Symlink);
    assert!(matches!(read(&c, "/abs"), Err(FsError::Invalid(_))));
    assert!(matches!(c.list(&p("/up"), 1), Err(FsError::Invalid(_))));
    assert!(c
        .set_meta(
            &p("/abs"),
            &Meta {
                mode: Some(0o600),
                ..Meta::default()
            }
        )
        .is_err());
    // make_dir with force through a link refuses rather than following.
    assert!(c.make_dir(&p("/up/made"), &Meta::default(), true).is_err());
    assert!(!t.path().join("outside/made").exists());
    // Writing over a link replaces the link, never its target.
    write(&c, "/abs", b"over", true).unwrap();
    assert_eq!(read(&c, "/abs").unwrap(), b"over");
    // Removing a link removes the link only.
    c.remove(&p("/up")).unwrap();
    assert_eq!(
        std::fs::read(t.path().join("outside/secret")).unwrap(),
        b"host secret"
    );
    // A listing of the root shows the links as links.
    let names: Vec<_> = c
        .list(&p("/"), 3)
        .unwrap()
        .into_iter()
        .map(|e| (e.path, e.kind))
        .collect();
    assert!(
        names.contains(&("/etc".to_string(), EntryType::Symlink)),
        "{names:?}"
    );
}

#[test]
fn files_dirs_metadata_and_limits() {
    let (_t, c) = content(1000);
    write(&c, "/a.txt", b"hello", false).unwrap();
    // An existing file is replaced only with force; a directory never.
    assert!(matches!(
        write(&c, "/a.txt", b"x", false),
        Err(FsError::Conflict(_))
    ));
    write(&c, "/a.txt", b"hello!", true).unwrap();
    assert_eq!(c.used(), 6);
    // A missing directory is 404, made with force (parents too).
    assert!(matches!(
        write(&c, "/d/e/f", b"x", false),
        Err(FsError::NotFound(_))
    ));
    assert!(matches!(
        c.make_dir(&p("/d/e"), &Meta::default(), false),
        Err(FsError::NotFound(_))
    ));
    let d = c
        .make_dir(
            &p("/d/e"),
            &Meta {
                mode: Some(0o700),
                ..Meta::default()
            },
            true,
        )
        .unwrap();
    assert_eq!(
        (d.kind, d.mode, d.path.as_str(), d.name.as_str()),
        (EntryType::Directory, 0o700, "/d/e", "e")
    );
    assert!(matches!(
        c.make_dir(&p("/d/e"), &Meta::default(), false),
        Err(FsError::Conflict(_))
    ));
    assert!(c.make_dir(&p("/d/e"), &Meta::default(), true).is_ok());
    assert!(matches!(
        write(&c, "/d", b"x", true),
        Err(FsError::Conflict(_))
    ));
    let f = c
        .write_file(
            &p("/d/e/f"),
            &mut &b"abc"[..],
            &Meta {
                mode: Some(0o640),
                ..Meta::default()
            },
            false,
        )
        .unwrap();
    assert_eq!((f.kind, f.size, f.mode), (EntryType::File, 3, 0o640));
    // Listing: depth 1 is the directory's own entries.
    let top: Vec<_> = c
        .list(&p("/"), 1)
        .unwrap()
        .into_iter()
        .map(|e| e.path)
        .collect();
    assert_eq!(top, ["/a.txt", "/d"]);
    let all: Vec<_> = c
        .list(&p("/"), 3)
        .unwrap()
        .into_iter()
        .map(|e| e.path)
        .collect();
    assert_eq!(all, ["/a.txt", "/d", "/d/e", "/d/e/f"]);
    assert!(matches!(c.list(&p("/a.txt"), 1), Err(FsError::NotFound(_))));
    // Metadata: the permission bits only.
    let m = c
        .set_meta(
            &p("/a.txt"),
            &Meta {
                mode: Some(0o600),
                ..Meta::default()
            },
        )
        .unwrap();
    assert_eq!(m.mode, 0o600);
    assert!(matches!(
        c.set_meta(
            &p("/a.txt"),
            &Meta {
                mode: Some(0o4755),
                ..Meta::default()
            }
        ),
        Err(FsError::Invalid(_))
    ));
    // Past the limit: 413, nothing left behind, the count unchanged.
    let big = vec![7u8; 2000];
    assert!(matches!(
        write(&c, "/big", &big, false),
        Err(FsError::TooLarge { limit: 1000 })
    ));
    assert_eq!(c.used(), 9);
    assert!(matches!(c.stat(&p("/big")), Err(FsError::NotFound(_))));
    assert_eq!(
        c.list(&p("/"), 1).unwrap().len(),
        2,
        "no temporary file left"
    );
    // Removing a tree frees its bytes; the root is not removed.
    c.remove(&p("/d")).unwrap();
    assert_eq!(c.used(), 6);
    assert!(matches!(c.remove(&p("/")), Err(FsError::NotFound(_))));
    assert!(matches!(c.remove(&p("/d")), Err(FsError::NotFound(_))));
}

#[test]
fn new_names_count_against_the_volumes_limit_on_entries() {
    use torpor_scheduler::volumes::usage::{count, MIN_ENTRIES};
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("content");
    std::fs::create_dir(&root).unwrap();
    for i in 0..MIN_ENTRIES - 4 {
        std::fs::write(root.join(format!("old{i}")), b"").unwrap();
    }
    // 100 bytes: the floor of entries.
    let c = Content::open(root.clone(), 100).unwrap();
    assert_eq!(c.usage.entries(), MIN_ENTRIES - 4);
    write(&c, "/a", b"", false).unwrap();
    c.make_dir(&p("/d/e/f"), &Meta::default(), true).unwrap();
    assert_eq!(c.usage.entries(), MIN_ENTRIES);
    // Full: no new file or directory, nothing left behind.
    assert!(matches!(
        write(&c, "/b", b"", false),
        Err(FsError::TooManyEntries { limit }) if limit == MIN_ENTRIES
    ));
    assert!(matches!(
        c.make_dir(&p("/g"), &Meta::default(), false),
        Err(FsError::TooManyEntries { .. })
    ));
    assert!(!root.join("b").exists() && !root.join("g").exists());
    assert_eq!(
        c.list(&p("/"), 1).unwrap().len() as u64,
        MIN_ENTRIES - 2,
        "no temporary file left"
    );
    assert_eq!(c.usage.entries(), MIN_ENTRIES, "a refusal counts nothing");
    // A directory that exists takes nothing more; a file replaced is
    // written under a temporary name first, which needs room for one.
    c.make_dir(&p("/d/e/f"), &Meta::default(), true).unwrap();
    assert!(matches!(
        write(&c, "/a", b"new", true),
        Err(FsError::TooManyEntries { .. })
    ));
    assert_eq!(c.usage.entries(), MIN_ENTRIES);
    // Removing a tree gives back each of its entries.
    c.remove(&p("/d")).unwrap();
    assert_eq!(c.usage.entries(), MIN_ENTRIES - 3);
    write(&c, "/a", b"new", true).unwrap();
    assert_eq!(
        c.usage.entries(),
        MIN_ENTRIES - 3,
        "a replacement takes none"
    );
    write(&c, "/b", b"", false).unwrap();
    assert_eq!(c.usage.entries(), count(&root).unwrap().entries);
}
