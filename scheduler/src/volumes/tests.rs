//! The volume server driven through the protocol: an NFSv3 client
//! (`nfs3_client`) over the sandbox's unix socket, as the guest's traffic
//! arrives there. The server's namespace takes `CAP_SYS_ADMIN` (the tests
//! run as root, as the service does).

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use nfs3_client::nfs3_types::mount::{dirpath, mountstat3};
use nfs3_client::nfs3_types::nfs3::{
    createhow3, createverf3, diropargs3, ftype3, nfs_fh3, nfsstat3, sattr3, set_mode3, set_size3,
    set_uid3, stable_how, symlinkdata3, CREATE3args, GETATTR3args, LOOKUP3args, MKDIR3args,
    Nfs3Option, Nfs3Result, READ3args, READDIRPLUS3args, READLINK3args, REMOVE3args, RENAME3args,
    SETATTR3args, SYMLINK3args, WRITE3args,
};
use nfs3_client::nfs3_types::xdr_codec::Opaque;
use nfs3_client::tokio::TokioIo;
use nfs3_client::{MountClient, Nfs3Client};
use tokio::net::UnixStream;

use super::{VolumeError, VolumeExport, VolumeHandle, VolumeServer};

type Fh = nfs_fh3;

fn res<T, E: std::fmt::Debug>(r: Nfs3Result<T, E>) -> Result<T, nfsstat3> {
    match r {
        Nfs3Result::Ok(v) => Ok(v),
        Nfs3Result::Err((stat, _)) => Err(stat),
    }
}

fn fh(opt: Nfs3Option<nfs_fh3>) -> Fh {
    match opt {
        Nfs3Option::Some(fh) => fh,
        Nfs3Option::None => panic!("no handle in the answer"),
    }
}

fn dirop<'a>(dir: &Fh, name: &'a str) -> diropargs3<'a> {
    diropargs3 {
        dir: dir.clone(),
        name: name.as_bytes().into(),
    }
}

/// The limit of a test's volumes, unless it sets its own.
const LIMIT: u64 = super::usage::DEFAULT_LIMIT;

/// A scratch directory with volume directories in it.
struct Scratch {
    dir: tempfile::TempDir,
}

impl Scratch {
    fn new() -> Self {
        Scratch {
            dir: tempfile::tempdir().unwrap(),
        }
    }
    fn volume(&self, name: &str) -> VolumeExport {
        let dir = self.dir.path().join("volumes").join(name).join("content");
        std::fs::create_dir_all(&dir).unwrap();
        VolumeExport {
            name: name.into(),
            dir,
            limit: LIMIT,
        }
    }
    fn socket(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

async fn mount(socket: &Path, path: &str) -> Result<Fh, nfs3_client::error::Error> {
    let conn = UnixStream::connect(socket).await?;
    let mut client = MountClient::new(TokioIo::new(conn));
    let ok = client
        .mnt(dirpath(Opaque::borrowed(path.as_bytes())))
        .await?;
    Ok(nfs_fh3 {
        data: Opaque::owned(ok.fhandle.0.to_vec()),
    })
}

struct Nfs(Nfs3Client<TokioIo<UnixStream>>);

impl Nfs {
    async fn connect(socket: &Path) -> Self {
        Nfs(Nfs3Client::new(TokioIo::new(
            UnixStream::connect(socket).await.unwrap(),
        )))
    }

    async fn getattr(
        &mut self,
        obj: &Fh,
    ) -> Result<nfs3_client::nfs3_types::nfs3::fattr3, nfsstat3> {
        let args = GETATTR3args {
            object: obj.clone(),
        };
        res(self.0.getattr(&args).await.unwrap()).map(|ok| ok.obj_attributes)
    }

    async fn lookup(&mut self, dir: &Fh, name: &str) -> Result<Fh, nfsstat3> {
        let args = LOOKUP3args {
            what: dirop(dir, name),
        };
        res(self.0.lookup(&args).await.unwrap()).map(|ok| ok.object)
    }

    async fn create(&mut self, dir: &Fh, name: &str, guarded: bool) -> Result<Fh, nfsstat3> {
        let attrs = sattr3 {
            mode: set_mode3::Some(0o644),
            ..Default::default()
        };
        let args = CREATE3args {
            where_: dirop(dir, name),
            how: if guarded {
                createhow3::GUARDED(attrs)
            } else {
                createhow3::UNCHECKED(attrs)
            },
        };
        res(self.0.create(&args).await.unwrap()).map(|ok| fh(ok.obj))
    }

    async fn create_exclusive(&mut self, dir: &Fh, name: &str, verf: u8) -> Result<Fh, nfsstat3> {
        let args = CREATE3args {
            where_: dirop(dir, name),
            how: createhow3::EXCLUSIVE(createverf3([verf; 8])),
        };
        res(self.0.create(&args).await.unwrap()).map(|ok| fh(ok.obj))
    }

    async fn mkdir(&mut self, dir: &Fh, name: &str) -> Result<Fh, nfsstat3> {
        let args = MKDIR3args {
            where_: dirop(dir, name),
            attributes: sattr3::default(),
        };
        res(self.0.mkdir(&args).await.unwrap()).map(|ok| fh(ok.obj))
    }

    async fn symlink(&mut self, dir: &Fh, name: &str, target: &str) -> Result<Fh, nfsstat3> {
        let args = SYMLINK3args {
            where_: dirop(dir, name),
            symlink: symlinkdata3 {
                symlink_attributes: sattr3::default(),
                symlink_data: target.as_bytes().into(),
            },
        };
        res(self.0.symlink(&args).await.unwrap()).map(|ok| fh(ok.obj))
    }

    async fn readlink(&mut self, link: &Fh) -> Result<Vec<u8>, nfsstat3> {
        let args = READLINK3args {
            symlink: link.clone(),
        };
        res(self.0.readlink(&args).await.unwrap()).map(|ok| ok.data.0.to_vec())
    }

    async fn write(&mut self, file: &Fh, offset: u64, data: &[u8]) -> Result<u32, nfsstat3> {
        let args = WRITE3args {
            file: file.clone(),
            offset,
            count: data.len() as u32,
            stable: stable_how::FILE_SYNC,
            data: Opaque::borrowed(data),
        };
        res(self.0.write(&args).await.unwrap()).map(|ok| ok.count)
    }

    async fn read(
        &mut self,
        file: &Fh,
        offset: u64,
        count: u32,
    ) -> Result<(Vec<u8>, bool), nfsstat3> {
        let args = READ3args {
            file: file.clone(),
            offset,
            count,
        };
        res(self.0.read(&args).await.unwrap()).map(|ok| (ok.data.to_vec(), ok.eof))
    }

    /// Every name in `dir`, page by page (a small `maxcount` forces pages).
    async fn names(&mut self, dir: &Fh) -> Result<Vec<String>, nfsstat3> {
        let mut names = Vec::new();
        let (mut cookie, mut cookieverf) = (0, Default::default());
        loop {
            let args = READDIRPLUS3args {
                dir: dir.clone(),
                cookie,
                cookieverf,
                dircount: 512,
                maxcount: 600,
            };
            let ok = res(self.0.readdirplus(&args).await.unwrap())?;
            cookieverf = ok.cookieverf;
            for e in &ok.reply.entries.0 {
                names.push(String::from_utf8(e.name.0.to_vec()).unwrap());
                cookie = e.cookie;
            }
            if ok.reply.eof {
                return Ok(names);
            }
        }
    }

    async fn rename(&mut self, from: &Fh, a: &str, to: &Fh, b: &str) -> Result<(), nfsstat3> {
        let args = RENAME3args {
            from: dirop(from, a),
            to: dirop(to, b),
        };
        res(self.0.rename(&args).await.unwrap()).map(|_| ())
    }

    async fn remove(&mut self, dir: &Fh, name: &str) -> Result<(), nfsstat3> {
        let args = REMOVE3args {
            object: dirop(dir, name),
        };
        res(self.0.remove(&args).await.unwrap()).map(|_| ())
    }

    async fn setattr(&mut self, obj: &Fh, attrs: sattr3) -> Result<(), nfsstat3> {
        let args = SETATTR3args {
            object: obj.clone(),
            new_attributes: attrs,
            guard: Nfs3Option::None,
        };
        res(self.0.setattr(&args).await.unwrap()).map(|_| ())
    }
}

/// Serves `exports` with a tag of their own (another sandbox's).
fn serve(server: &VolumeServer, socket: &Path, exports: Vec<VolumeExport>) -> VolumeHandle {
    static TAGS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let tag = TAGS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    server.serve(socket, exports, tag).unwrap()
}

#[tokio::test]
async fn handles_outlive_the_export_and_the_server_for_the_same_tag() {
    let s = Scratch::new();
    let data = s.volume("data");
    std::fs::create_dir_all(data.dir.join("d/e")).unwrap();
    std::fs::write(data.dir.join("d/e/f"), b"kept").unwrap();
    std::fs::write(data.dir.join("gone"), b"x").unwrap();
    let sock = s.socket("a.sock");
    let (f, e, gone) = {
        let server = VolumeServer::start().unwrap();
        let _h = server.serve(&sock, vec![data.clone()], 7).unwrap();
        let mut nfs = Nfs::connect(&sock).await;
        let root = mount(&sock, "/data").await.unwrap();
        let d = nfs.lookup(&root, "d").await.unwrap();
        let e = nfs.lookup(&d, "e").await.unwrap();
        let f = nfs.lookup(&e, "f").await.unwrap();
        let gone = nfs.lookup(&root, "gone").await.unwrap();
        (f, e, gone)
    };
    // The pod restarted: a new server, the sandbox served again with its
    // tag. The guest's handles still name the same objects.
    std::fs::remove_file(data.dir.join("gone")).unwrap();
    let server = VolumeServer::start().unwrap();
    let _h = server.serve(&sock, vec![data.clone()], 7).unwrap();
    let mut nfs = Nfs::connect(&sock).await;
    assert_eq!(nfs.read(&f, 0, 4).await.unwrap().0, b"kept");
    assert!(nfs.lookup(&e, "f").await.is_ok());
    assert_eq!(
        nfs.getattr(&gone).await.err(),
        Some(nfsstat3::NFS3ERR_STALE)
    );
    // Another tag (another sandbox) on the same volume: stale.
    let other = s.socket("b.sock");
    let _o = server.serve(&other, vec![data], 8).unwrap();
    let mut on_other = Nfs::connect(&other).await;
    assert_eq!(
        on_other.getattr(&f).await.err(),
        Some(nfsstat3::NFS3ERR_STALE)
    );
}

#[tokio::test]
async fn mount_answers_only_the_sandboxs_volumes() {
    let s = Scratch::new();
    let server = VolumeServer::start().unwrap();
    let sock = s.socket("a.sock");
    let _h = serve(&server, &sock, vec![s.volume("alpha"), s.volume("beta")]);
    // Another sandbox's volume, on the same pod.
    let _other = serve(&server, &s.socket("b.sock"), vec![s.volume("gamma")]);

    for unknown in ["/gamma", "/nope", "/alpha/missing"] {
        match mount(&sock, unknown).await {
            Err(nfs3_client::error::Error::MountError(mountstat3::MNT3ERR_NOENT)) => {}
            other => panic!("MOUNT {unknown}: {other:?}"),
        }
    }
    let root = mount(&sock, "/").await.unwrap();
    let mut nfs = Nfs::connect(&sock).await;
    assert_eq!(nfs.names(&root).await.unwrap(), ["alpha", "beta"]);
    assert_eq!(
        nfs.lookup(&root, "gamma").await,
        Err(nfsstat3::NFS3ERR_NOENT)
    );
    let attrs = nfs.getattr(&root).await.unwrap();
    assert_eq!(
        (attrs.type_, attrs.uid, attrs.gid),
        (ftype3::NF3DIR, 1000, 1000)
    );
    // The root is read-only.
    assert_eq!(nfs.mkdir(&root, "new").await, Err(nfsstat3::NFS3ERR_ROFS));

    // MOUNT /alpha and LOOKUP alpha in the root are the same object.
    let alpha = mount(&sock, "/alpha").await.unwrap();
    assert_eq!(nfs.lookup(&root, "alpha").await.unwrap(), alpha);
    assert!(nfs.names(&alpha).await.unwrap().is_empty());
}

#[tokio::test]
async fn writes_count_against_the_volumes_limit_shared_with_the_content_api() {
    let s = Scratch::new();
    let server = VolumeServer::start().unwrap();
    let sock = s.socket("q.sock");
    let vol = VolumeExport {
        limit: 100,
        ..s.volume("q")
    };
    std::fs::write(vol.dir.join("before"), [7u8; 10]).unwrap();
    let _h = serve(&server, &sock, vec![vol.clone()]);
    // The content API's count of the same directory is the server's.
    let api = super::usage::Usage::of(&vol.dir, 5).unwrap();
    assert_eq!((api.used(), api.limit()), (10, 100));
    let root = mount(&sock, "/q").await.unwrap();
    let mut nfs = Nfs::connect(&sock).await;

    let f = nfs.create(&root, "f", false).await.unwrap();
    assert_eq!(nfs.write(&f, 0, &[1; 60]).await, Ok(60));
    assert_eq!(api.used(), 70);
    // Past the limit: refused whole, nothing written or counted.
    assert_eq!(
        nfs.write(&f, 50, &[2; 41]).await,
        Err(nfsstat3::NFS3ERR_DQUOT)
    );
    assert_eq!(std::fs::metadata(vol.dir.join("f")).unwrap().len(), 60);
    assert_eq!(api.used(), 70);
    // Rewriting bytes a file has takes nothing more.
    assert_eq!(nfs.write(&f, 20, &[3; 40]).await, Ok(40));
    assert_eq!(api.used(), 70);
    // Growing by truncation counts; past the limit it is refused too.
    let size = |n| sattr3 {
        size: set_size3::Some(n),
        ..Default::default()
    };
    assert_eq!(
        nfs.setattr(&f, size(91)).await,
        Err(nfsstat3::NFS3ERR_DQUOT)
    );
    nfs.setattr(&f, size(90)).await.unwrap();
    assert_eq!(api.used(), 100);
    // Full: neither the content API nor the guest gets a byte more.
    assert_eq!(api.reserve(1), Err(super::usage::OverLimit { limit: 100 }));
    let g = nfs.create(&root, "g", false).await.unwrap();
    assert_eq!(nfs.write(&g, 0, &[4]).await, Err(nfsstat3::NFS3ERR_DQUOT));
    // Shrinking frees; what the content API reserves (a file it is
    // writing), the guest cannot take.
    nfs.setattr(&f, size(30)).await.unwrap();
    assert_eq!(api.used(), 40);
    api.reserve(55).unwrap();
    assert_eq!(
        nfs.write(&g, 0, &[4; 6]).await,
        Err(nfsstat3::NFS3ERR_DQUOT)
    );
    assert_eq!(nfs.write(&g, 0, &[4; 5]).await, Ok(5));
    api.release(55);
    assert_eq!(api.used(), 45);
    // Renaming over a file and removing one free their bytes.
    nfs.rename(&root, "g", &root, "before").await.unwrap();
    assert_eq!(api.used(), 35, "the 10 bytes renamed over are freed");
    nfs.remove(&root, "f").await.unwrap();
    assert_eq!(api.used(), 5);
    assert_eq!(api.used(), super::usage::count(&vol.dir).unwrap().bytes);
}

#[tokio::test]
async fn new_names_count_against_the_volumes_limit_on_entries() {
    use super::usage::MIN_ENTRIES;
    let s = Scratch::new();
    let server = VolumeServer::start().unwrap();
    let sock = s.socket("e.sock");
    // 100 bytes: the floor of entries, MIN_ENTRIES.
    let vol = VolumeExport {
        limit: 100,
        ..s.volume("e")
    };
    for i in 0..MIN_ENTRIES - 4 {
        std::fs::write(vol.dir.join(format!("old{i}")), b"").unwrap();
    }
    let _h = serve(&server, &sock, vec![vol.clone()]);
    let api = super::usage::Usage::of(&vol.dir, 5).unwrap();
    assert_eq!(api.entries(), MIN_ENTRIES - 4);
    let root = mount(&sock, "/e").await.unwrap();
    let mut nfs = Nfs::connect(&sock).await;

    // Each kind of new name takes one: a file, a directory, a link, an
    // exclusive create.
    nfs.create(&root, "a", false).await.unwrap();
    let d = nfs.mkdir(&root, "d").await.unwrap();
    nfs.symlink(&root, "l", "a").await.unwrap();
    nfs.create_exclusive(&root, "x", 1).await.unwrap();
    assert_eq!(api.entries(), MIN_ENTRIES);
    // Full: no new name of any kind, however empty; nothing made.
    for refused in [
        nfs.create(&root, "y", false).await.map(|_| ()),
        nfs.mkdir(&d, "e").await.map(|_| ()),
        nfs.symlink(&root, "m", "a").await.map(|_| ()),
        nfs.create_exclusive(&root, "z", 2).await.map(|_| ()),
    ] {
        assert_eq!(refused, Err(nfsstat3::NFS3ERR_DQUOT));
    }
    for name in ["y", "d/e", "m", "z"] {
        assert!(!vol.dir.join(name).exists(), "{name} was not made");
    }
    assert_eq!(api.entries(), MIN_ENTRIES, "a refusal counts nothing");
    // An existing name takes nothing more (UNCHECKED, a retried EXCLUSIVE).
    nfs.create(&root, "a", false).await.unwrap();
    nfs.create_exclusive(&root, "x", 1).await.unwrap();
    // Removing one and renaming over one each give one back.
    nfs.remove(&root, "l").await.unwrap();
    nfs.create(&root, "y", false).await.unwrap();
    nfs.rename(&root, "y", &root, "a").await.unwrap();
    nfs.mkdir(&d, "e").await.unwrap();
    assert_eq!(api.entries(), MIN_ENTRIES);
    // Rename's rules, each counted: a directory over an empty one takes
    // its place; over one not empty, over a file, or a file over a
    // directory, nothing moves; onto its own name nothing happens.
    for name in ["x", "a", "old0"] {
        nfs.remove(&root, name).await.unwrap();
    }
    nfs.mkdir(&root, "empty").await.unwrap();
    let full = nfs.mkdir(&root, "full").await.unwrap();
    nfs.create(&full, "in", false).await.unwrap();
    let before = api.entries();
    assert_eq!(
        nfs.rename(&root, "d", &root, "full").await,
        Err(nfsstat3::NFS3ERR_NOTEMPTY)
    );
    assert_eq!(
        nfs.rename(&root, "d", &full, "in").await,
        Err(nfsstat3::NFS3ERR_NOTDIR)
    );
    assert_eq!(
        nfs.rename(&full, "in", &root, "empty").await,
        Err(nfsstat3::NFS3ERR_ISDIR)
    );
    nfs.rename(&full, "in", &full, "in").await.unwrap();
    assert_eq!(api.entries(), before, "nothing moved, nothing counted");
    assert!(vol.dir.join("d/e").is_dir() && vol.dir.join("full/in").is_file());
    nfs.rename(&root, "d", &root, "empty").await.unwrap();
    assert_eq!(api.entries(), before - 1);
    assert!(vol.dir.join("empty/e").is_dir() && !vol.dir.join("d").exists());
    // The content API and the server keep one count, the disk's.
    assert_eq!(
        api.entries(),
        super::usage::count(&vol.dir).unwrap().entries
    );
}

#[tokio::test]
async fn writes_land_at_their_offsets_and_read_back() {
    let s = Scratch::new();
    let server = VolumeServer::start().unwrap();
    let sock = s.socket("a.sock");
    let vol = s.volume("data");
    let _h = serve(&server, &sock, vec![vol.clone()]);
    let root = mount(&sock, "/data").await.unwrap();
    let mut nfs = Nfs::connect(&sock).await;

    let f = nfs.create(&root, "f.bin", false).await.unwrap();
    assert_eq!(nfs.write(&f, 0, b"hello").await, Ok(5));
    assert_eq!(nfs.write(&f, 10, b"world").await, Ok(5));
    assert_eq!(nfs.write(&f, 1, b"EL").await, Ok(2));
    let (all, eof) = nfs.read(&f, 0, 100).await.unwrap();
    assert_eq!(all, b"hELlo\0\0\0\0\0world");
    assert!(eof);
    assert_eq!(
        nfs.read(&f, 3, 4).await.unwrap(),
        (b"lo\0\0".to_vec(), false)
    );
    assert_eq!(nfs.read(&f, 14, 10).await.unwrap(), (b"d".to_vec(), true));
    assert_eq!(std::fs::read(vol.dir.join("f.bin")).unwrap(), all);
    let attrs = nfs.getattr(&f).await.unwrap();
    assert_eq!((attrs.size, attrs.uid, attrs.mode), (15, 1000, 0o644));

    // Truncate, chmod; a chown is accepted and changes nothing.
    let set = sattr3 {
        size: set_size3::Some(2),
        mode: set_mode3::Some(0o600),
        uid: set_uid3::Some(0),
        ..Default::default()
    };
    nfs.setattr(&f, set).await.unwrap();
    let meta = std::fs::metadata(vol.dir.join("f.bin")).unwrap();
    assert_eq!((meta.len(), meta.permissions().mode() & 0o777), (2, 0o600));
    assert_eq!(nfs.getattr(&f).await.unwrap().uid, 1000);
    // A directory is not written; one whose owner bits lack write takes
    // no new names (the pod may be root: the server checks).
    let d = nfs.mkdir(&root, "d").await.unwrap();
    assert_eq!(nfs.write(&d, 0, b"x").await, Err(nfsstat3::NFS3ERR_INVAL));
    let read_only = sattr3 {
        mode: set_mode3::Some(0o555),
        ..Default::default()
    };
    nfs.setattr(&d, read_only).await.unwrap();
    assert_eq!(
        nfs.create(&d, "no", false).await,
        Err(nfsstat3::NFS3ERR_ACCES)
    );
    assert!(!vol.dir.join("d/no").exists());

    // EXCLUSIVE: a retransmission (same verifier) finds its file, another
    // verifier does not.
    let x = nfs.create_exclusive(&root, "x", 7).await.unwrap();
    assert_eq!(nfs.create_exclusive(&root, "x", 7).await, Ok(x));
    assert_eq!(
        nfs.create_exclusive(&root, "x", 8).await,
        Err(nfsstat3::NFS3ERR_EXIST)
    );
}

#[tokio::test]
async fn names_are_made_listed_renamed_and_removed() {
    let s = Scratch::new();
    let server = VolumeServer::start().unwrap();
    let sock = s.socket("a.sock");
    let (one, two) = (s.volume("one"), s.volume("two"));
    let _h = serve(&server, &sock, vec![one.clone(), two.clone()]);
    let root = mount(&sock, "/one").await.unwrap();
    let other = mount(&sock, "/two").await.unwrap();
    let mut nfs = Nfs::connect(&sock).await;

    let d = nfs.mkdir(&root, "dir").await.unwrap();
    let f = nfs.create(&d, "file", false).await.unwrap();
    nfs.write(&f, 0, b"x").await.unwrap();
    for i in 0..40 {
        nfs.create(&d, &format!("n{i:02}"), false).await.unwrap();
    }
    let names = nfs.names(&d).await.unwrap();
    assert_eq!(names.len(), 41, "{names:?}");
    assert_eq!(names[0], "file");
    assert_eq!(
        nfs.create(&d, "file", true).await,
        Err(nfsstat3::NFS3ERR_EXIST)
    );
    assert_eq!(nfs.mkdir(&root, "dir").await, Err(nfsstat3::NFS3ERR_EXIST));
    assert_eq!(
        nfs.create(&d, "..", false).await,
        Err(nfsstat3::NFS3ERR_EXIST)
    );
    assert_eq!(
        nfs.create(&d, "a/b", false).await,
        Err(nfsstat3::NFS3ERR_ACCES)
    );
    assert_eq!(nfs.lookup(&d, "nope").await, Err(nfsstat3::NFS3ERR_NOENT));
    let long = "x".repeat(300);
    assert_eq!(
        nfs.create(&d, &long, false).await,
        Err(nfsstat3::NFS3ERR_NAMETOOLONG)
    );
    assert_eq!(nfs.lookup(&f, "x").await, Err(nfsstat3::NFS3ERR_NOTDIR));

    // A rename moves the object; its handle follows it, also through a
    // renamed parent.
    nfs.rename(&d, "file", &root, "moved").await.unwrap();
    assert_eq!(std::fs::read(one.dir.join("moved")).unwrap(), b"x");
    assert_eq!(nfs.read(&f, 0, 10).await.unwrap().0, b"x");
    let n00 = nfs.lookup(&d, "n00").await.unwrap();
    nfs.rename(&root, "dir", &root, "dir2").await.unwrap();
    nfs.write(&n00, 0, b"still").await.unwrap();
    assert_eq!(std::fs::read(one.dir.join("dir2/n00")).unwrap(), b"still");
    // Not across volumes.
    assert_eq!(
        nfs.rename(&root, "moved", &other, "moved").await,
        Err(nfsstat3::NFS3ERR_XDEV)
    );
    // A non-empty directory stays; an emptied one goes.
    assert_eq!(
        nfs.remove(&root, "dir2").await,
        Err(nfsstat3::NFS3ERR_NOTEMPTY)
    );
    for i in 0..40 {
        nfs.remove(&d, &format!("n{i:02}")).await.unwrap();
    }
    nfs.remove(&root, "dir2").await.unwrap();
    nfs.remove(&root, "moved").await.unwrap();
    assert_eq!(nfs.getattr(&f).await.err(), Some(nfsstat3::NFS3ERR_STALE));
    assert_eq!(std::fs::read_dir(&one.dir).unwrap().count(), 0);
    assert!(nfs.names(&other).await.unwrap().is_empty());
}

#[tokio::test]
async fn symlinks_are_text_and_never_followed() {
    let s = Scratch::new();
    let server = VolumeServer::start().unwrap();
    let sock = s.socket("a.sock");
    let vol = s.volume("v");
    // Put there on the host, as the content API never would.
    std::os::unix::fs::symlink("/etc/passwd", vol.dir.join("pw")).unwrap();
    std::os::unix::fs::symlink("/etc", vol.dir.join("etc")).unwrap();
    std::os::unix::fs::symlink("../../..", vol.dir.join("up")).unwrap();
    let _h = serve(&server, &sock, vec![vol.clone()]);
    let root = mount(&sock, "/v").await.unwrap();
    let mut nfs = Nfs::connect(&sock).await;

    let pw = nfs.lookup(&root, "pw").await.unwrap();
    assert_eq!(nfs.getattr(&pw).await.unwrap().type_, ftype3::NF3LNK);
    assert_eq!(nfs.readlink(&pw).await.unwrap(), b"/etc/passwd");
    assert!(nfs.read(&pw, 0, 100).await.is_err());
    assert!(nfs.write(&pw, 0, b"root::0:0").await.is_err());
    let etc = nfs.lookup(&root, "etc").await.unwrap();
    assert_eq!(
        nfs.lookup(&etc, "passwd").await,
        Err(nfsstat3::NFS3ERR_NOTDIR)
    );
    assert!(nfs.names(&etc).await.is_err());
    assert!(nfs.create(&etc, "planted", false).await.is_err());
    let up = nfs.lookup(&root, "up").await.unwrap();
    assert!(nfs.lookup(&up, "etc").await.is_err());
    assert!(!Path::new("/etc/planted").exists());

    // One made over NFS is stored as text.
    let made = nfs.symlink(&root, "shadow", "/etc/shadow").await.unwrap();
    assert_eq!(nfs.readlink(&made).await.unwrap(), b"/etc/shadow");
    let target = std::fs::read_link(vol.dir.join("shadow")).unwrap();
    assert_eq!(target, Path::new("/etc/shadow"));
    assert_eq!(
        nfs.setattr(
            &made,
            sattr3 {
                mode: set_mode3::Some(0o777),
                ..Default::default()
            }
        )
        .await,
        Err(nfsstat3::NFS3ERR_NOTSUPP)
    );
    assert_ne!(
        std::fs::metadata("/etc/shadow")
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o777
    );
}

#[tokio::test]
async fn dotdot_of_a_volume_root_is_that_root() {
    let s = Scratch::new();
    let server = VolumeServer::start().unwrap();
    let sock = s.socket("a.sock");
    let vol = s.volume("v");
    std::fs::write(vol.dir.parent().unwrap().join("secret"), b"no").unwrap();
    let _h = serve(&server, &sock, vec![vol]);
    let root = mount(&sock, "/v").await.unwrap();
    let mut nfs = Nfs::connect(&sock).await;

    assert_eq!(nfs.lookup(&root, "..").await.unwrap(), root);
    assert_eq!(nfs.lookup(&root, ".").await.unwrap(), root);
    let sub = nfs.mkdir(&root, "sub").await.unwrap();
    let deep = nfs.mkdir(&sub, "deep").await.unwrap();
    assert_eq!(nfs.lookup(&deep, "..").await.unwrap(), sub);
    assert_eq!(nfs.lookup(&sub, "..").await.unwrap(), root);
    let up = nfs.lookup(&root, "..").await.unwrap();
    assert_eq!(
        nfs.lookup(&up, "secret").await,
        Err(nfsstat3::NFS3ERR_NOENT)
    );
}

#[tokio::test]
async fn handles_of_another_sandbox_are_stale() {
    let s = Scratch::new();
    let server = VolumeServer::start().unwrap();
    let other_server = VolumeServer::start().unwrap();
    let (a, b, c) = (s.socket("a.sock"), s.socket("b.sock"), s.socket("c.sock"));
    let shared = s.volume("shared");
    std::fs::write(shared.dir.join("f"), b"data").unwrap();
    let _ha = serve(&server, &a, vec![shared.clone()]);
    // The same volume, for another sandbox on this pod and on another server.
    let _hb = serve(&server, &b, vec![shared.clone()]);
    let _hc = serve(&other_server, &c, vec![shared]);

    let (mut on_a, mut on_b, on_c) = (
        Nfs::connect(&a).await,
        Nfs::connect(&b).await,
        Nfs::connect(&c).await,
    );
    let root_a = mount(&a, "/shared").await.unwrap();
    let f_a = on_a.lookup(&root_a, "f").await.unwrap();
    let root_c = mount(&c, "/shared").await.unwrap();
    for h in [&root_a, &f_a] {
        assert_eq!(on_b.getattr(h).await.err(), Some(nfsstat3::NFS3ERR_STALE));
        assert!(on_b.read(h, 0, 4).await.is_err());
    }
    // Another server's (an older generation): stale too.
    assert_eq!(
        on_a.getattr(&root_c).await.err(),
        Some(nfsstat3::NFS3ERR_STALE)
    );
    // A handle this export never gave out, forged from one it did.
    let mut forged = f_a.data.to_vec();
    let last = forged.len() - 1;
    forged[last] ^= 0x40;
    let forged = nfs_fh3 {
        data: Opaque::owned(forged),
    };
    assert_eq!(
        on_a.getattr(&forged).await.err(),
        Some(nfsstat3::NFS3ERR_STALE)
    );
    assert_eq!(on_a.read(&f_a, 0, 4).await.unwrap().0, b"data");
    drop(on_c);
}

#[tokio::test]
async fn the_socket_is_private_replaced_and_removed() {
    let s = Scratch::new();
    let server = VolumeServer::start().unwrap();
    let sock = s.socket("a.sock");
    std::fs::write(&sock, b"stale").unwrap();
    let h = serve(&server, &sock, vec![s.volume("v")]);
    let meta = std::fs::symlink_metadata(&sock).unwrap();
    assert!(std::os::unix::fs::FileTypeExt::is_socket(&meta.file_type()));
    assert_eq!(meta.mode() & 0o777, 0o600);
    let mut nfs = Nfs::connect(&sock).await;
    let root = mount(&sock, "/v").await.unwrap();
    nfs.getattr(&root).await.unwrap();

    let mut open = UnixStream::connect(&sock).await.unwrap();
    drop(h);
    assert!(!sock.exists(), "the socket file outlived its handle");
    assert!(UnixStream::connect(&sock).await.is_err());
    // Open connections are closed too (nfs3_client waits forever on a
    // closed stream: read the socket itself).
    drop(nfs);
    let mut buf = [0u8; 4];
    let read = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        tokio::io::AsyncReadExt::read(&mut open, &mut buf),
    )
    .await
    .expect("the connection is still open");
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");

    // Bad exports are refused before anything is bound.
    let bad = VolumeExport {
        name: "a/b".into(),
        dir: s.dir.path().into(),
        limit: LIMIT,
    };
    assert!(matches!(
        server.serve(&sock, vec![bad], 1),
        Err(VolumeError::BadName(_))
    ));
    let twice = vec![s.volume("x"), s.volume("x")];
    assert!(matches!(
        server.serve(&sock, twice, 1),
        Err(VolumeError::DuplicateName(_))
    ));
    let missing = VolumeExport {
        name: "m".into(),
        dir: s.dir.path().join("missing"),
        limit: LIMIT,
    };
    assert!(matches!(
        server.serve(&sock, vec![missing], 1),
        Err(VolumeError::OpenVolume { .. })
    ));
    assert!(!sock.exists());
}

#[tokio::test]
async fn the_nfs_listener_is_not_in_the_hosts_namespace() {
    let s = Scratch::new();
    let server = VolumeServer::start().unwrap();
    let host_ns = std::fs::metadata("/proc/thread-self/ns/net").unwrap().ino();
    assert_ne!(server.netns_inode(), host_ns);
    let h = serve(&server, &s.socket("a.sock"), vec![s.volume("v")]);
    let port = h.nfs_port();
    assert_ne!(port, 0);
    let direct = std::net::TcpStream::connect(("127.0.0.1", port));
    assert!(
        direct.is_err(),
        "the NFS listener answers on the host's loopback"
    );
    // Through the socket it answers.
    mount(h.socket(), "/v").await.unwrap();
}
