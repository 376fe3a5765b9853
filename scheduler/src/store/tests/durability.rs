//! The group commit (`store::sync`): an acknowledged write survives a
//! power cut, and a commit's fsync does not hold the connection.
//!
//! A power cut keeps what an fsync made durable and nothing else: the
//! [`PowerCut`] hook copies the database and its WAL, under the
//! connection's lock, just before each leader's fsync (what that fsync
//! covers), and publishes the copy as "the disk" once the fsync succeeded.
//! The cut itself is a copy of the disk taken at some instant; every
//! write acknowledged before that instant must be in it.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use torpor_sync::Locked;

use super::*;
use crate::store::sync::SyncHooks;

/// Copies of the store as each fsync left the disk.
#[derive(Debug)]
struct PowerCut {
    dir: PathBuf,
    /// Held while the disk's copy is replaced or read.
    publish: Mutex<()>,
}

impl PowerCut {
    fn pending(&self) -> PathBuf {
        self.dir.join("pending")
    }
    fn disk(&self) -> PathBuf {
        self.dir.join("disk")
    }

    /// The disk as a power cut now leaves it, copied to `to`.
    fn cut(&self, to: &Path) {
        let _p = self.publish.locked();
        copy_store(&self.disk(), to);
    }
}

fn copy_store(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for f in [DB_FILE.to_string(), format!("{DB_FILE}-wal")] {
        let src = from.join(&f);
        if src.exists() {
            fs::copy(&src, to.join(&f)).unwrap();
        }
    }
}

impl SyncHooks for PowerCut {
    fn before(&self, store: &Store, written: &dyn Fn() -> u64) -> u64 {
        let _conn = store.lock();
        let target = written();
        let _ = fs::remove_dir_all(self.pending());
        copy_store(store.dir(), &self.pending());
        target
    }

    fn after(&self, _target: u64) {
        let _p = self.publish.locked();
        let _ = fs::remove_dir_all(self.disk());
        fs::rename(self.pending(), self.disk()).unwrap();
    }
}

/// Four threads create sandboxes; at some instant the power is cut. Every
/// create acknowledged before it is on the disk the cut leaves. Fails when
/// a write returns before its group's fsync (checked: `Store::write`
/// without `durable` loses acknowledged rows here).
#[test]
fn a_power_cut_loses_no_acknowledged_write() {
    let (dir, store, t) = setup();
    let images = tempfile::tempdir().unwrap();
    let cut = Arc::new(PowerCut {
        dir: images.path().to_path_buf(),
        publish: Mutex::new(()),
    });
    // The template's insert is durable before the hook: the first disk.
    copy_store(dir.path(), &cut.disk());
    store
        .hooks
        .set(Box::new(SharedCut(cut.clone())))
        .expect("hooks set once");
    let acked: Mutex<Vec<SandboxId>> = Mutex::new(Vec::new());
    let stop = AtomicBool::new(false);
    let after_cut = images.path().join("after-cut");
    let at_cut = std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                while !stop.load(Ordering::SeqCst) {
                    let sb = Sandbox::new(t.id.clone(), 64, 1, 1000);
                    store.insert_sandbox(&sb).unwrap();
                    acked.locked().push(sb.id);
                }
            });
        }
        while acked.locked().len() < 200 {
            std::thread::sleep(Duration::from_millis(5));
        }
        // The instant of the cut: what was acknowledged, and the disk.
        let at_cut = {
            let a = acked.locked();
            cut.cut(&after_cut);
            a.clone()
        };
        stop.store(true, Ordering::SeqCst);
        at_cut
    });
    assert!(at_cut.len() >= 200);
    drop(store);
    let survivor = Store::open(&after_cut).unwrap();
    let rows: HashSet<SandboxId> = survivor
        .list_sandboxes(&SandboxFilter::default())
        .unwrap()
        .into_iter()
        .map(|s| s.id)
        .collect();
    let lost: Vec<&SandboxId> = at_cut.iter().filter(|id| !rows.contains(id)).collect();
    assert!(
        lost.is_empty(),
        "{} of {} acknowledged creates lost by the power cut, first {:?}",
        lost.len(),
        at_cut.len(),
        lost.iter().take(3).collect::<Vec<_>>()
    );
}

#[derive(Debug)]
struct SharedCut(Arc<PowerCut>);

impl SyncHooks for SharedCut {
    fn before(&self, store: &Store, written: &dyn Fn() -> u64) -> u64 {
        self.0.before(store, written)
    }
    fn after(&self, target: u64) {
        self.0.after(target)
    }
}

/// An fsync that takes as long as the test says.
#[derive(Debug)]
struct SlowDisk {
    entered: Mutex<mpsc::Sender<()>>,
    release: Mutex<mpsc::Receiver<()>>,
}

impl SyncHooks for SlowDisk {
    fn before(&self, _store: &Store, written: &dyn Fn() -> u64) -> u64 {
        written()
    }
    fn after(&self, _target: u64) {
        let _ = self.entered.locked().send(());
        let _ = self.release.locked().recv_timeout(Duration::from_secs(30));
    }
}

/// While one write's fsync is under way (a slow disk), other calls use the
/// connection: reads and relaxed writes return, durable writes commit and
/// wait; once the disk answers, the next fsync covers all of them at once.
#[test]
fn a_commit_s_fsync_does_not_hold_the_connection() {
    let (_dir, store, t) = setup();
    let (entered_tx, entered) = mpsc::channel();
    let (release, release_rx) = mpsc::channel();
    store
        .hooks
        .set(Box::new(SlowDisk {
            entered: Mutex::new(entered_tx),
            release: Mutex::new(release_rx),
        }))
        .expect("hooks set once");
    let a = sandbox_in_relaxed(&store, &t);
    let syncs = store.syncs();
    std::thread::scope(|s| {
        let deleting = s.spawn(|| store.update_sandbox_state(&a.id, Running, Paused, None));
        entered
            .recv_timeout(Duration::from_secs(30))
            .expect("the delete's fsync started");
        // The first fsync is stuck: the connection is free.
        assert_eq!(store.get_sandbox(&a.id).unwrap().state, Paused);
        let b = sandbox_in_relaxed(&store, &t);
        let creates: Vec<_> = (0..3)
            .map(|_| {
                s.spawn(|| {
                    let sb = Sandbox::new(t.id.clone(), 64, 1, 1000);
                    store.insert_sandbox(&sb).map(|()| sb.id)
                })
            })
            .collect();
        // They commit (visible) while they wait for their fsync.
        while store
            .list_sandboxes(&SandboxFilter::default())
            .unwrap()
            .len()
            < 5
        {
            std::thread::sleep(Duration::from_millis(2));
        }
        assert!(!deleting.is_finished(), "acknowledged before its fsync");
        assert!(creates.iter().all(|c| !c.is_finished()));
        // The disk answers the first fsync; the next one covers the rest.
        release.send(()).unwrap();
        deleting.join().unwrap().unwrap();
        entered.recv_timeout(Duration::from_secs(30)).unwrap();
        release.send(()).unwrap();
        for c in creates {
            c.join().unwrap().unwrap();
        }
        assert_eq!(store.get_sandbox(&b.id).unwrap().state, Running);
    });
    assert_eq!(store.syncs(), syncs + 2, "three creates, one fsync");
}

fn sandbox_in_relaxed(store: &Store, t: &Template) -> Sandbox {
    let mut s = Sandbox::new(t.id.clone(), 64, 1, 60_000);
    s.state = Running;
    store.write_relaxed(|tx| tx.insert_sandbox(&s)).unwrap();
    s
}
