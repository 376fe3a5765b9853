//! File operations over a unix socket against an in-process agent.

mod common;

use common::*;
use std::os::unix::fs::PermissionsExt;
use torpor_agent::proto::{FileKind, WriteFileRequest, MAX_IO_CHUNK};
use torpor_agent::ClientError;

fn agent_error<T: std::fmt::Debug>(r: Result<T, ClientError>) -> torpor_agent::proto::ErrorReply {
    match r {
        Err(ClientError::Agent(e)) => e,
        other => panic!("expected an agent error, got {other:?}"),
    }
}

#[test]
fn binary_round_trip() {
    let agent = default_agent();
    let mut c = agent.client();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.file("bin");
    let data: Vec<u8> = (0..=255u8).rev().cycle().take(70_001).collect();
    let size = c.write_file_all(&path, &data, None, false).unwrap();
    assert_eq!(size, data.len() as u64);
    assert!(std::fs::read(&path).unwrap() == data);
    assert!(c.read_file_all(&path, u64::MAX).unwrap() == data);

    // Partial reads: offset and max_bytes, eof at the end.
    let part = c.read_file(&path, 100, Some(10)).unwrap();
    assert_eq!(part.data, &data[100..110]);
    assert_eq!((part.offset, part.size, part.eof), (100, 70_001, false));
    let tail = c.read_file(&path, 70_000, Some(10)).unwrap();
    assert_eq!((tail.data.len(), tail.eof), (1, true));
    let past = c.read_file(&path, 80_000, None).unwrap();
    assert!(past.data.is_empty() && past.eof);
}

#[test]
fn files_larger_than_one_frame_go_in_chunks() {
    let agent = default_agent();
    let mut c = agent.client();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.file("big");
    let data: Vec<u8> = (0..MAX_IO_CHUNK + 12_345)
        .map(|i| (i * 7 % 251) as u8)
        .collect();
    c.write_file_all(&path, &data, Some(0o600), false).unwrap();
    assert!(c.read_file_all(&path, u64::MAX).unwrap() == data);
}

#[test]
fn append_mode_and_parents() {
    let agent = default_agent();
    let mut c = agent.client();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.file("a/b/c.txt");
    let write = |data: &[u8], append, mode, create_parents| WriteFileRequest {
        path: path.clone(),
        data: data.to_vec(),
        mode,
        create_parents,
        append,
        owner: None,
    };
    let e = agent_error(c.write_file(write(b"x", false, None, false)));
    assert_eq!(e.code, "ENOENT");
    c.write_file(write(b"one\n", false, Some(0o640), true))
        .unwrap();
    let w = c.write_file(write(b"two\n", true, None, false)).unwrap();
    assert_eq!((w.bytes, w.size), (4, 8));
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "one\ntwo\n");
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode, 0o640, "mode is exact, not masked by the umask");
    c.write_file(write(b"", false, Some(0o755), false)).unwrap();
    let st = c.stat(&path, true).unwrap();
    assert_eq!((st.size, st.mode, st.kind), (0, 0o755, FileKind::File));
    let e = agent_error(c.write_file(write(b"", false, Some(0o10000), false)));
    assert_eq!(e.code, "EINVAL");
}

#[test]
fn list_dir_and_stat() {
    let agent = default_agent();
    let mut c = agent.client();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("f"), b"12345").unwrap();
    std::fs::create_dir(dir.path().join("d")).unwrap();
    std::os::unix::fs::symlink("f", dir.path().join("l")).unwrap();
    let listing = c.list_dir(dir.path().to_str().unwrap()).unwrap();
    assert!(!listing.truncated);
    let names: Vec<_> = listing.entries.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, ["d", "f", "l"]);
    let (d, f, l) = (
        &listing.entries[0],
        &listing.entries[1],
        &listing.entries[2],
    );
    assert_eq!(d.kind, FileKind::Dir);
    assert_eq!((f.kind, f.size), (FileKind::File, 5));
    assert!(f.mtime_ns > 1_500_000_000_000_000_000);
    assert_eq!(l.kind, FileKind::Symlink);
    assert_eq!(l.link_target.as_deref(), Some("f"));

    let link = dir.file("l");
    assert_eq!(c.stat(&link, true).unwrap().kind, FileKind::File);
    assert_eq!(c.stat(&link, false).unwrap().kind, FileKind::Symlink);
    assert_eq!(c.stat("/", true).unwrap().name, "/");
}

#[test]
fn errors_are_structured() {
    let agent = default_agent();
    let mut c = agent.client();
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.file("missing");
    let e = agent_error(c.read_file(&missing, 0, None));
    assert_eq!((e.code.as_str(), e.errno), ("ENOENT", Some(libc::ENOENT)));
    assert!(e.message.contains("missing"), "{e}");
    assert_eq!(agent_error(c.stat(&missing, true)).code, "ENOENT");
    assert_eq!(agent_error(c.list_dir(&missing)).code, "ENOENT");
    std::fs::write(dir.path().join("file"), b"x").unwrap();
    assert_eq!(agent_error(c.list_dir(&dir.file("file"))).code, "ENOTDIR");
    let d = dir.path().to_str().unwrap();
    assert_eq!(agent_error(c.read_file(d, 0, None)).code, "EISDIR");
    assert_eq!(
        agent_error(c.read_file("relative/path", 0, None)).code,
        "EINVAL"
    );
    let fifo = std::ffi::CString::new(dir.file("fifo")).unwrap();
    // SAFETY: a valid C string.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
    assert_eq!(
        agent_error(c.read_file(&dir.file("fifo"), 0, None)).code,
        "EINVAL"
    );
    let w = WriteFileRequest {
        path: dir.file("fifo"),
        data: b"x".to_vec(),
        mode: None,
        create_parents: false,
        append: false,
        owner: None,
    };
    assert_eq!(agent_error(c.write_file(w)).code, "EINVAL");
    // The connection is still good.
    c.ping().unwrap();
}

#[test]
fn writes_go_to_the_owner_named() {
    let agent = default_agent();
    let mut c = agent.client();
    let dir = tempfile::tempdir().unwrap();
    // An unknown owner: refused before anything is written.
    let ghost = dir.file("g/h.txt");
    let e = c
        .write_file_all_as(&ghost, b"x", None, true, Some("no-such-user-torpor"))
        .unwrap_err();
    assert!(
        matches!(&e, ClientError::Agent(a) if a.code == "ENOENT"),
        "{e:?}"
    );
    assert!(!dir.path().join("g").exists());
    // SAFETY: no preconditions.
    let uid = unsafe { libc::geteuid() };
    let nobody = torpor_agent::users::by_name("nobody");
    let (0, Ok(nobody)) = (uid, nobody) else {
        // Only root may give files away; the agent in a guest is root.
        assert_eq!(
            code_of(c.write_file_all_as(&dir.file("x"), b"x", None, false, Some("nobody"))),
            "EPERM"
        );
        return;
    };
    let path = dir.file("n/o/f.txt");
    let data = vec![7u8; MAX_IO_CHUNK + 10];
    c.write_file_all_as(&path, &data, None, true, Some("nobody"))
        .unwrap();
    for p in [dir.file("n"), dir.file("n/o"), path.clone()] {
        let st = c.stat(&p, false).unwrap();
        assert_eq!(
            (st.uid, st.gid),
            (Some(nobody.uid), Some(nobody.gid)),
            "{p}"
        );
    }
    assert_eq!(
        c.stat(&dir.file(""), false).unwrap().uid,
        Some(0),
        "an existing parent keeps its owner"
    );
    // Without an owner the file keeps the one it has.
    c.write_file_all(&path, b"again", None, false).unwrap();
    assert_eq!(c.stat(&path, false).unwrap().uid, Some(nobody.uid));
}

fn code_of<T: std::fmt::Debug>(r: Result<T, ClientError>) -> String {
    agent_error(r).code
}

/// `statvfs(3)` of `path` on this side, as (fragment size, total, free,
/// available) bytes.
fn host_statvfs(path: &std::path::Path) -> (u64, u64, u64, u64) {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: `struct statvfs` is plain integers: all-zero is a valid value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is NUL-terminated and `st` a writable statvfs that
    // outlives the call.
    assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut st) }, 0);
    let unit = if st.f_frsize > 0 {
        st.f_frsize as u64
    } else {
        st.f_bsize as u64
    };
    (
        unit,
        st.f_blocks as u64 * unit,
        st.f_bfree as u64 * unit,
        st.f_bavail as u64 * unit,
    )
}

/// `statfs` answers what `statvfs` says of the directory's filesystem:
/// its size and block size exactly, its free space within what other
/// writers on this machine change meanwhile.
#[test]
fn statfs_is_the_filesystems_size_and_free_space() {
    let agent = default_agent();
    let mut c = agent.client();
    let dir = tempfile::tempdir().unwrap();
    let before = host_statvfs(dir.path());
    let got = c.statfs(dir.path().to_str().unwrap()).unwrap();
    let after = host_statvfs(dir.path());
    assert_eq!((got.block_size, got.total_bytes), (before.0, before.1));
    assert!(got.total_bytes > 0, "{got:?}");
    assert!(got.available_bytes <= got.free_bytes && got.free_bytes <= got.total_bytes);
    // Others write on this machine: the free space moves a little.
    const SLACK: u64 = 256 << 20;
    let within = |v: u64, a: u64, b: u64| v + SLACK >= a.min(b) && v <= a.max(b) + SLACK;
    assert!(
        within(got.free_bytes, before.2, after.2),
        "{got:?} {before:?} {after:?}"
    );
    assert!(
        within(got.available_bytes, before.3, after.3),
        "{got:?} {before:?} {after:?}"
    );
    // A file names the filesystem it is on, too.
    std::fs::write(dir.path().join("f"), b"x").unwrap();
    let file = c.statfs(&dir.file("f")).unwrap();
    assert_eq!(file.total_bytes, got.total_bytes);

    assert_eq!(agent_error(c.statfs("relative")).code, "EINVAL");
    assert_eq!(agent_error(c.statfs(&dir.file("missing"))).code, "ENOENT");
    // The connection goes on after errors.
    c.ping().unwrap();
}
