//! COPY archives of a build context: what each source takes (files,
//! directories, globs, `.dockerignore`), the archive's layout (E2B's
//! names; deterministic headers), its hash, and the sources refused.

use std::io::Read;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::Path;

use sha2::{Digest, Sha256};
use torpor_build::{pack, ContextError};

/// A context: `a.txt`, `app/notes.md`, `app/src/main.py` (the fixtures'
/// context, as E2B's SDKs packed it).
fn context() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    std::fs::create_dir_all(root.join("app/src")).unwrap();
    for (path, text) in [
        ("a.txt", "hello\n"),
        ("app/src/main.py", "print(1)\n"),
        ("app/notes.md", "x"),
    ] {
        std::fs::write(root.join(path), text).unwrap();
        chmod(&root.join(path), 0o644);
    }
    for d in ["", "app", "app/src"] {
        chmod(&root.join(d), 0o755);
    }
    dir
}

fn chmod(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// Each entry of a gzip'd tar: name, type, mode, uid, gid, mtime, link,
/// content.
type Row = (String, char, u32, u64, u64, u64, String, String);

fn rows(archive: &[u8]) -> Vec<Row> {
    let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(archive));
    tar.entries()
        .unwrap()
        .map(|e| {
            let mut e = e.unwrap();
            let h = e.header().clone();
            let kind = match h.entry_type() {
                tar::EntryType::Directory => 'd',
                tar::EntryType::Regular => 'f',
                tar::EntryType::Symlink => 'l',
                other => panic!("{other:?}"),
            };
            let link = h
                .link_name()
                .unwrap()
                .map(|l| l.to_string_lossy().into_owned())
                .unwrap_or_default();
            let mut content = String::new();
            e.read_to_string(&mut content).unwrap();
            (
                String::from_utf8(h.path_bytes().into_owned()).unwrap(),
                kind,
                h.mode().unwrap(),
                h.uid().unwrap(),
                h.gid().unwrap(),
                h.mtime().unwrap(),
                link,
                content,
            )
        })
        .collect()
}

fn names(context: &Path, src: &str) -> Vec<String> {
    pack(context, src).unwrap().entries
}

#[test]
fn a_file_a_directory_and_globs_are_named_from_the_root() {
    let ctx = context();
    let packed = pack(ctx.path(), "app").unwrap();
    let row = |name: &str, kind, mode, content: &str| {
        (
            name.to_string(),
            kind,
            mode,
            0,
            0,
            0,
            String::new(),
            content.to_string(),
        )
    };
    assert_eq!(
        rows(&packed.archive),
        [
            row("app/", 'd', 0o755, ""),
            row("app/notes.md", 'f', 0o644, "x"),
            row("app/src/", 'd', 0o755, ""),
            row("app/src/main.py", 'f', 0o644, "print(1)\n"),
        ]
    );
    let sha: String = Sha256::digest(&packed.archive)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(packed.sha256, sha);
    // The same names as E2B's Python SDK gives (tar_file_stream).
    assert_eq!(names(ctx.path(), "a.txt"), ["a.txt"]);
    assert_eq!(
        names(ctx.path(), "./app/src/../src/*.py"),
        ["app/src/main.py"]
    );
    assert_eq!(names(ctx.path(), "app/"), names(ctx.path(), "app"));
    assert_eq!(names(ctx.path(), "**/*.py"), ["app/src/main.py"]);
    assert_eq!(names(ctx.path(), "*/*.m?"), ["app/notes.md"]);
    assert_eq!(
        names(ctx.path(), "."),
        [
            "./",
            "a.txt",
            "app/",
            "app/notes.md",
            "app/src/",
            "app/src/main.py"
        ]
    );
}

#[test]
fn archives_are_deterministic() {
    let ctx = context();
    let first = pack(ctx.path(), ".").unwrap();
    // Times and the directory's order on disk do not matter.
    let f = std::fs::File::options()
        .write(true)
        .open(ctx.path().join("a.txt"))
        .unwrap();
    f.set_modified(std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(12345))
        .unwrap();
    let other = context();
    assert_eq!(pack(ctx.path(), ".").unwrap(), first);
    assert_eq!(pack(other.path(), ".").unwrap().sha256, first.sha256);
    // Content and modes do.
    chmod(&ctx.path().join("a.txt"), 0o600);
    let moded = pack(ctx.path(), ".").unwrap();
    assert_ne!(moded.sha256, first.sha256);
    assert_eq!(rows(&moded.archive)[1].2, 0o600);
    std::fs::write(other.path().join("a.txt"), "hellO\n").unwrap();
    assert_ne!(pack(other.path(), ".").unwrap().sha256, first.sha256);
}

#[test]
fn dockerignore_applies() {
    let ctx = context();
    std::fs::write(
        ctx.path().join(".dockerignore"),
        "# build output\napp/src\n*.txt\n!app/src/main.py\n",
    )
    .unwrap();
    assert_eq!(
        names(ctx.path(), "."),
        [
            "./",
            ".dockerignore",
            "app/",
            "app/notes.md",
            "app/src/main.py"
        ]
    );
    std::fs::write(ctx.path().join(".dockerignore"), "app\n").unwrap();
    assert!(matches!(
        pack(ctx.path(), "app/notes.md"),
        Err(ContextError::NoMatch(s)) if s == "app/notes.md"
    ));
    std::fs::write(ctx.path().join(".dockerignore"), "[oops\n").unwrap();
    assert!(matches!(
        pack(ctx.path(), "a.txt"),
        Err(ContextError::Pattern(_))
    ));
}

#[test]
fn symlinks_are_kept_as_links_inside_and_refused_outside() {
    let ctx = context();
    let root = ctx.path();
    symlink("src/main.py", root.join("app/main")).unwrap();
    let packed = pack(root, "app").unwrap();
    let link = rows(&packed.archive)
        .into_iter()
        .find(|r| r.0 == "app/main")
        .unwrap();
    assert_eq!((link.1, link.6.as_str()), ('l', "src/main.py"));

    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("secret"), "s").unwrap();
    // A path through a symlinked directory that leaves the context.
    symlink(outside.path(), root.join("out")).unwrap();
    let err = pack(root, "out/secret").unwrap_err();
    assert!(
        matches!(&err, ContextError::SymlinkEscapes { path, .. } if path == "out"),
        "{err}"
    );
    // The link itself, or a directory holding it: its target leaves.
    assert!(matches!(
        pack(root, "out"),
        Err(ContextError::SymlinkEscapes { .. })
    ));
    symlink("../../etc/passwd", root.join("app/up")).unwrap();
    let err = pack(root, "app").unwrap_err();
    assert!(
        matches!(&err, ContextError::SymlinkEscapes { path, target } if path == "app/up" && target == Path::new("../../etc/passwd")),
        "{err}"
    );
    assert_eq!(
        err.to_string(),
        "app/up: symlink to \"../../etc/passwd\" leads out of the build context"
    );
}

#[test]
fn sources_outside_the_context_are_refused() {
    let ctx = context();
    let root = ctx.path();
    let err = |src: &str| pack(root, src).unwrap_err();
    assert!(matches!(err("../x"), ContextError::Escapes(s) if s == "../x"));
    assert!(matches!(err("app/../../x"), ContextError::Escapes(_)));
    assert!(matches!(err("/etc/passwd"), ContextError::Absolute(_)));
    assert!(matches!(err(""), ContextError::Empty));
    assert!(matches!(err("nope/*.c"), ContextError::NoMatch(_)));
    assert!(matches!(err("missing.txt"), ContextError::NoMatch(_)));
    assert!(matches!(err("app/[x"), ContextError::Pattern(_)));
    let _socket = std::os::unix::net::UnixListener::bind(root.join("app/sock")).unwrap();
    assert!(matches!(err("app"), ContextError::Special(s) if s == "app/sock"));
    // Inside is fine, `..` and all.
    assert_eq!(names(root, "app/../a.txt"), ["a.txt"]);
}
