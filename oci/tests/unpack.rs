//! Layers made here with the `tar` crate, unpacked: the content (files,
//! directories, symlink chains, hard links, FIFOs, ownership, modes,
//! times, xattrs), whiteouts and opaque directories across layers, gzip
//! and zstd, diff ids; and every malformed layer refused with a typed
//! error naming its entry, with nothing written beside the root (a
//! sentinel next to it stays as it was). Needs root (ownership).

mod common;

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

use common::{gzip, zstd, Scratch, Tar};
use torpor_oci::{unpack_layers, BombLimit, Digest, Error, Limits, Refusal};

/// A `security.capability` value: v2, effective, CAP_NET_BIND_SERVICE.
fn capability() -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(&0x0200_0001u32.to_le_bytes());
    v.extend_from_slice(&(1u32 << 10).to_le_bytes());
    v.extend_from_slice(&0u32.to_le_bytes());
    v.extend_from_slice(&0u32.to_le_bytes());
    v.extend_from_slice(&0u32.to_le_bytes());
    v
}

fn xattr(path: &Path, name: &str) -> Option<Vec<u8>> {
    let mut buf = vec![0u8; 256];
    match rustix::fs::lgetxattr(path, name, &mut buf) {
        Ok(n) => Some(buf[..n].to_vec()),
        Err(_) => None,
    }
}

#[test]
fn layers_apply_in_order_with_whiteouts_links_owners_and_xattrs() {
    let mut s = Scratch::new();
    let mut l1 = Tar::new();
    l1.dir("etc/", 0o755)
        .file("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n", 0o644)
        .dir("srv/", 0o750)
        .file_owned("srv/owned", b"owned", 0o4750, 1234, 5678)
        .pax(&[
            ("uid", b"70000"),
            ("gid", b"70001"),
            ("mtime", b"1700000000.5"),
            ("SCHILY.xattr.user.note", b"hello"),
            ("SCHILY.xattr.security.capability", &capability()),
            (
                "SCHILY.xattr.security.selinux",
                b"system_u:object_r:bin_t:s0",
            ),
        ])
        .file("srv/ping", b"#!/bin/sh\n", 0o755)
        .symlink("srv/c", "ping")
        .symlink("srv/b", "c")
        .symlink("srv/a", "./b")
        .symlink("srv/abs", "/etc/passwd")
        .hardlink("srv/ping2", "srv/ping")
        .fifo("srv/fifo")
        .char_device("srv/null", 1, 3)
        .dir("gone/", 0o755)
        .file("gone/deep/x", b"x", 0o644)
        .file("old.txt", b"old", 0o644)
        .dir("opq/", 0o755)
        .file("opq/lower", b"lower", 0o644)
        .dir("opq/sub/", 0o755)
        .file("opq/sub/lower2", b"lower2", 0o644)
        .file("becomes-dir", b"file", 0o644);
    // Layer 2, gzip: whiteouts, an opaque directory whose new content
    // comes before its marker, a file replaced by a directory.
    let mut l2 = Tar::new();
    l2.file(".wh.old.txt", b"", 0o644)
        .file(".wh.gone", b"", 0o644)
        .file("opq/upper", b"upper", 0o644)
        .file("opq/.wh..wh..opq", b"", 0o644)
        .dir("becomes-dir/", 0o711)
        .file("becomes-dir/inside", b"in", 0o600)
        .hardlink("etc/passwd-link", "etc/passwd")
        .file(".wh.never-there", b"", 0o644);
    // Layer 3, zstd: a file through a relative symlink to a directory
    // (as /lib -> usr/lib), and a replaced symlink.
    let mut l3 = Tar::new();
    l3.dir("usr/", 0o755)
        .dir("usr/lib/", 0o755)
        .symlink("lib", "usr/lib")
        .file("lib/libx.so", b"elf", 0o644)
        .file("srv/abs", b"now a file", 0o644);
    let layers = [
        s.layer(&l1.bytes()),
        s.layer(&gzip(&l2.bytes())),
        s.layer(&zstd(&l3.bytes())),
    ];
    let report = unpack_layers(&layers, &s.root(), &Limits::default()).unwrap();
    let r = s.root();
    assert_eq!(
        common::read(&r.join("etc/passwd")),
        "root:x:0:0:root:/root:/bin/sh\n"
    );
    let owned = std::fs::metadata(r.join("srv/owned")).unwrap();
    assert_eq!(
        (owned.uid(), owned.gid(), owned.mode() & 0o7777),
        (1234, 5678, 0o4750)
    );
    let ping = std::fs::metadata(r.join("srv/ping")).unwrap();
    assert_eq!((ping.uid(), ping.gid()), (70000, 70001), "PAX uid/gid");
    assert_eq!(
        (ping.mtime(), ping.mtime_nsec()),
        (1_700_000_000, 500_000_000)
    );
    assert_eq!(
        xattr(&r.join("srv/ping"), "user.note").as_deref(),
        Some(&b"hello"[..])
    );
    assert_eq!(
        xattr(&r.join("srv/ping"), "security.capability"),
        Some(capability())
    );
    assert_eq!(xattr(&r.join("srv/ping"), "security.selinux"), None);
    assert!(report
        .skipped
        .iter()
        .any(|s| s.entry == "srv/ping" && s.what.contains("security.selinux")));
    // Symlinks are stored as they are (an absolute one is not followed).
    assert_eq!(
        std::fs::read_link(r.join("srv/a")).unwrap(),
        Path::new("./b")
    );
    assert_eq!(common::read(&r.join("srv/a")), "#!/bin/sh\n");
    assert_eq!(
        std::fs::symlink_metadata(r.join("srv/ping2"))
            .unwrap()
            .ino(),
        ping.ino()
    );
    assert!(std::fs::symlink_metadata(r.join("srv/fifo"))
        .unwrap()
        .file_type()
        .is_fifo());
    match std::fs::symlink_metadata(r.join("srv/null")) {
        Ok(m) => assert!(m.file_type().is_char_device()),
        Err(_) => assert!(report.skipped.iter().any(|s| s.entry == "srv/null")),
    }
    assert_eq!(
        std::fs::metadata(r.join("srv")).unwrap().mode() & 0o777,
        0o750
    );
    // Whiteouts: a file, a tree; the opaque directory keeps only its layer's.
    assert!(!r.join("old.txt").exists() && !r.join("gone").exists());
    let mut opq: Vec<_> = std::fs::read_dir(r.join("opq"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    opq.sort();
    assert_eq!(opq, ["upper"]);
    let becomes = std::fs::metadata(r.join("becomes-dir")).unwrap();
    assert!(becomes.is_dir());
    assert_eq!(becomes.mode() & 0o777, 0o711);
    assert_eq!(common::read(&r.join("becomes-dir/inside")), "in");
    assert_eq!(
        std::fs::metadata(r.join("etc/passwd-link")).unwrap().ino(),
        std::fs::metadata(r.join("etc/passwd")).unwrap().ino()
    );
    assert_eq!(common::read(&r.join("usr/lib/libx.so")), "elf");
    assert_eq!(
        std::fs::read_link(r.join("lib")).unwrap(),
        Path::new("usr/lib")
    );
    assert!(std::fs::symlink_metadata(r.join("srv/abs"))
        .unwrap()
        .is_file());
    assert_eq!(common::read(&r.join("srv/abs")), "now a file");
    let root = std::fs::metadata(&r).unwrap();
    assert_eq!((root.uid(), root.mode() & 0o777), (0, 0o755));
    s.assert_outside_untouched();
}

#[test]
fn a_layer_must_match_its_diff_id() {
    let mut s = Scratch::new();
    let tar = {
        let mut t = Tar::new();
        t.file("a", b"a", 0o644);
        t.bytes()
    };
    let mut good = s.layer(&gzip(&tar));
    good.diff_id = Some(Digest::of(&tar));
    unpack_layers(&[good.clone()], &s.root(), &Limits::default()).unwrap();
    good.diff_id = Some(Digest::of(b"something else"));
    std::fs::remove_dir_all(s.root()).unwrap();
    let err = unpack_layers(&[good], &s.root(), &Limits::default()).unwrap_err();
    assert!(matches!(err, Error::Digest { .. }), "{err}");
    // Nor is a root with something in it unpacked into.
    let err = unpack_layers(&[], &s.root(), &Limits::default()).unwrap_err();
    assert!(err.to_string().contains("fresh directory"), "{err}");
}

/// Unpacks `layers` (tar streams) and returns the error, checking that
/// nothing was written outside the root.
fn refused(layers: &[Vec<u8>], limits: &Limits) -> Error {
    let mut s = Scratch::new();
    let files: Vec<_> = layers.iter().map(|l| s.layer(l)).collect();
    let err = unpack_layers(&files, &s.root(), limits).unwrap_err();
    s.assert_outside_untouched();
    err
}

fn refusal(err: &Error) -> (&str, &Refusal) {
    match err {
        Error::Refused { entry, reason, .. } => (entry.as_str(), reason),
        other => panic!("not a refusal: {other}"),
    }
}

#[test]
fn traversal_and_escapes_are_refused_naming_the_entry() {
    let limits = Limits::default();
    let one = |f: &dyn Fn(&mut Tar)| {
        let mut t = Tar::new();
        f(&mut t);
        t.bytes()
    };
    let err = refused(
        &[one(&|t| {
            t.file("../outside/sentinel", b"overwritten", 0o644);
        })],
        &limits,
    );
    assert_eq!(
        refusal(&err),
        ("../outside/sentinel", &Refusal::ParentComponent)
    );
    assert!(err.to_string().contains("\"../outside/sentinel\""), "{err}");
    let err = refused(
        &[one(&|t| {
            t.file("a/../../outside/x", b"x", 0o644);
        })],
        &limits,
    );
    assert_eq!(refusal(&err).1, &Refusal::ParentComponent);
    let err = refused(
        &[one(&|t| {
            t.file("/tmp/torpor-oci-absolute", b"x", 0o644);
        })],
        &limits,
    );
    assert_eq!(
        refusal(&err),
        ("/tmp/torpor-oci-absolute", &Refusal::Absolute)
    );
    assert!(!Path::new("/tmp/torpor-oci-absolute").exists());
    // A symlink to / and then a file through it: the host's /etc is not
    // the image's.
    let name = format!("torpor-oci-evil-{}", std::process::id());
    let err = refused(
        &[one(&|t| {
            t.symlink("evil", "/")
                .file(&format!("evil/etc/{name}"), b"x", 0o644);
        })],
        &limits,
    );
    match refusal(&err) {
        (entry, Refusal::SymlinkOutOfRoot { link, target }) => {
            assert_eq!(entry, format!("evil/etc/{name}"));
            assert_eq!(
                (link.as_path(), target.as_path()),
                (Path::new("evil"), Path::new("/"))
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(!Path::new("/etc").join(&name).exists());
    // A relative one that climbs out, in another layer than the write.
    let err = refused(
        &[
            one(&|t| {
                t.dir("d/", 0o755).symlink("d/up", "../../outside");
            }),
            one(&|t| {
                t.file("d/up/sentinel", b"overwritten", 0o644);
            }),
        ],
        &limits,
    );
    assert!(
        matches!(refusal(&err).1, Refusal::SymlinkOutOfRoot { .. }),
        "{err}"
    );
    // Hard links out of the root, or to nothing.
    let err = refused(
        &[one(&|t| {
            t.hardlink("x", "../../outside/sentinel");
        })],
        &limits,
    );
    assert!(
        matches!(refusal(&err).1, Refusal::HardLinkOutOfRoot { .. }),
        "{err}"
    );
    let err = refused(
        &[one(&|t| {
            t.hardlink("x", "/etc/passwd");
        })],
        &limits,
    );
    assert!(
        matches!(refusal(&err).1, Refusal::HardLinkOutOfRoot { .. }),
        "{err}"
    );
    let err = refused(
        &[one(&|t| {
            t.symlink("up", "..").hardlink("x", "up/outside/sentinel");
        })],
        &limits,
    );
    assert!(
        matches!(refusal(&err).1, Refusal::SymlinkOutOfRoot { .. }),
        "{err}"
    );
    let err = refused(
        &[one(&|t| {
            t.hardlink("x", "missing");
        })],
        &limits,
    );
    assert!(
        matches!(refusal(&err).1, Refusal::HardLinkTarget { .. }),
        "{err}"
    );
    // A loop of symlinks, an unknown entry type, a nameless whiteout.
    let err = refused(
        &[one(&|t| {
            t.symlink("l1", "l2")
                .symlink("l2", "l1")
                .file("l1/x", b"", 0o644);
        })],
        &limits,
    );
    assert_eq!(refusal(&err).1, &Refusal::SymlinkLoop);
    let err = refused(
        &[one(&|t| {
            t.raw("volume", b'V', b"");
        })],
        &limits,
    );
    assert_eq!(refusal(&err).1, &Refusal::UnsupportedType { flag: 'V' });
    let err = refused(
        &[one(&|t| {
            t.file("dir/.wh.", b"", 0o644);
        })],
        &limits,
    );
    assert_eq!(refusal(&err).1, &Refusal::EmptyWhiteout);
}

#[test]
fn a_file_over_a_symlink_replaces_the_link_not_its_target() {
    let mut s = Scratch::new();
    let mut l1 = Tar::new();
    l1.symlink("s", "../outside/sentinel");
    let mut l2 = Tar::new();
    l2.file("s", b"mine", 0o644);
    let layers = [s.layer(&l1.bytes()), s.layer(&l2.bytes())];
    unpack_layers(&layers, &s.root(), &Limits::default()).unwrap();
    assert!(std::fs::symlink_metadata(s.root().join("s"))
        .unwrap()
        .is_file());
    s.assert_outside_untouched();
}

#[test]
fn tar_bombs_are_refused_by_count_size_and_ratio() {
    let many = {
        let mut t = Tar::new();
        for i in 0..20 {
            t.file(&format!("f{i}"), b"x", 0o644);
        }
        t.bytes()
    };
    let limits = Limits {
        max_entries: 10,
        ..Limits::default()
    };
    let err = refused(&[many], &limits);
    assert!(
        matches!(
            err,
            Error::Bomb {
                limit: BombLimit::Entries { max: 10 },
                ..
            }
        ),
        "{err}"
    );
    let big = {
        let mut t = Tar::new();
        t.file("big", &[7u8; 2000], 0o644);
        t.bytes()
    };
    let limits = Limits {
        max_file_bytes: 1000,
        ..Limits::default()
    };
    let err = refused(&[big], &limits);
    match &err {
        Error::Bomb {
            limit: BombLimit::FileBytes { entry, size, max },
            ..
        } => assert_eq!((entry.as_str(), *size, *max), ("big", 2000, 1000)),
        other => panic!("{other}"),
    }
    let several = {
        let mut t = Tar::new();
        for i in 0..4 {
            t.file(&format!("f{i}"), &[1u8; 1000], 0o644);
        }
        t.bytes()
    };
    let limits = Limits {
        max_total_bytes: 3000,
        ..Limits::default()
    };
    let err = refused(&[several], &limits);
    assert!(
        matches!(
            err,
            Error::Bomb {
                limit: BombLimit::TotalBytes { max: 3000 },
                ..
            }
        ),
        "{err}"
    );
    // 16 MiB of zeros gzip to about 16 KiB: past 100x once over 1 MiB.
    let zeros = {
        let mut t = Tar::new();
        t.file("zeros", &vec![0u8; 16 << 20], 0o644);
        gzip(&t.bytes())
    };
    let limits = Limits {
        max_ratio: 100,
        ratio_grace_bytes: 1 << 20,
        ..Limits::default()
    };
    let err = refused(&[zeros], &limits);
    match &err {
        Error::Bomb {
            limit:
                BombLimit::Ratio {
                    max: 100,
                    compressed,
                    unpacked,
                },
            ..
        } => assert!(*unpacked > 100 * compressed, "{err}"),
        other => panic!("{other}"),
    }
    assert!(err.to_string().contains("tar bomb"), "{err}");
}

#[test]
fn unknown_compressions_are_refused_clearly() {
    let mut s = Scratch::new();
    let xz = s.layer(&[0xfd, b'7', b'z', b'X', b'Z', 0, 0, 0]);
    let err = unpack_layers(&[xz], &s.root(), &Limits::default()).unwrap_err();
    assert!(matches!(err, Error::UnsupportedLayer { .. }), "{err}");
    assert!(err.to_string().contains("xz"), "{err}");
}
