//! Mounting a sandbox's files into a standby shell's jail when the shell
//! is taken ([`inject`]): the trees are cloned in the host's mount
//! namespace and attached by a mount thread inside the jail's.
//!
//! The mount threads are kept, not spawned per create: each leaves the
//! service's file system context once (`unshare(CLONE_FS)`, which
//! `setns(CLONE_NEWNS)` needs, and umask 0 so mount points are 0755),
//! enters a jail's mount namespace for a job and goes back to the host's
//! after it, so it pins no jail's namespace once the job is done. A thread
//! that cannot go back ends (the next job starts another). At most
//! [`MOST_THREADS`] run; jobs beyond wait for one.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::DirBuilderExt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Mutex, OnceLock};

use torpor_sync::Locked;
use torpor_vmm_api::jail::Expose;

use super::jail::{cstring, internal};
use super::ServiceError;

/// Mount threads kept at most (jobs beyond wait for one).
const MOST_THREADS: usize = 4;

// Kernel ABI (include/uapi/linux/mount.h).
const OPEN_TREE_CLONE: libc::c_uint = 1;
const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 4;

/// Mounts `exposes` into the jail of the running VMM `pid` (a standby
/// shell being handed a sandbox), each at its own path, read-only where
/// asked. The trees are cloned here, in the host's mount namespace, then
/// attached by a mount thread that enters the jail's ([`mount_in`]).
pub fn inject(pid: u32, exposes: &[Expose]) -> Result<(), ServiceError> {
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/mnt"))
        .map_err(|e| internal("open the jail's mount namespace", e))?;
    let mut sorted = exposes.to_vec();
    sorted.sort_by_key(|e| e.path.components().count());
    let mut trees = Vec::with_capacity(sorted.len());
    for e in &sorted {
        let c = cstring(&e.path)?;
        // SAFETY: a NUL-terminated path alive for the call; the returned
        // descriptor is owned below.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_open_tree,
                libc::AT_FDCWD,
                c.as_ptr(),
                OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint,
            )
        };
        if fd < 0 {
            return Err(internal(
                &format!("clone the mount of {}", e.path.display()),
                std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: a descriptor the kernel just returned, owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        let is_dir = std::fs::metadata(&e.path)
            .map(|m| m.is_dir())
            .unwrap_or(true);
        trees.push((e.clone(), fd, is_dir));
    }
    mount_in(Job {
        ns,
        trees,
        reply: None,
    })
}

/// Attaches `trees` inside the mount namespace the calling mount thread
/// has entered.
fn attach(trees: &[(Expose, OwnedFd, bool)]) -> Result<(), ServiceError> {
    let sys = |ret: libc::c_long, what: &str| {
        if ret < 0 {
            Err(internal(what, std::io::Error::last_os_error()))
        } else {
            Ok(())
        }
    };
    let root = c"/";
    let remount = |flags: libc::c_ulong| {
        // SAFETY: NUL-terminated literal; null source, type and data.
        let ret = unsafe {
            libc::mount(
                std::ptr::null(),
                root.as_ptr(),
                std::ptr::null(),
                libc::MS_REMOUNT | libc::MS_NOSUID | libc::MS_NOEXEC | flags,
                std::ptr::null(),
            )
        };
        sys(ret as _, "remount the jail's root")
    };
    // The jail's root tmpfs is read-only; mount points are made in it.
    remount(0)?;
    let result = (|| {
        for (e, fd, is_dir) in trees {
            if *is_dir {
                std::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o755)
                    .create(&e.path)
                    .map_err(|err| {
                        internal(&format!("mkdir {} in the jail", e.path.display()), err)
                    })?;
            } else if !e.path.exists() {
                if let Some(p) = e.path.parent() {
                    let _ = std::fs::DirBuilder::new()
                        .recursive(true)
                        .mode(0o755)
                        .create(p);
                }
                std::fs::File::create(&e.path).map_err(|err| {
                    internal(&format!("create {} in the jail", e.path.display()), err)
                })?;
            }
            let target = cstring(&e.path)?;
            // SAFETY: a detached tree's descriptor we own, an empty path
            // and a NUL-terminated target, alive for the call.
            let ret = unsafe {
                libc::syscall(
                    libc::SYS_move_mount,
                    fd.as_raw_fd(),
                    c"".as_ptr(),
                    libc::AT_FDCWD,
                    target.as_ptr(),
                    MOVE_MOUNT_F_EMPTY_PATH,
                )
            };
            sys(ret, &format!("mount {} into the jail", e.path.display()))?;
            let mut flags = libc::MS_BIND
                | libc::MS_REMOUNT
                | libc::MS_NOSUID
                | libc::MS_NODEV
                | libc::MS_NOEXEC;
            if e.read_only {
                flags |= libc::MS_RDONLY;
            }
            // SAFETY: a NUL-terminated target; null source, type and data.
            let ret = unsafe {
                libc::mount(
                    std::ptr::null(),
                    target.as_ptr(),
                    std::ptr::null(),
                    flags,
                    std::ptr::null(),
                )
            };
            sys(
                ret as _,
                &format!("restrict {} in the jail", e.path.display()),
            )?;
        }
        Ok(())
    })();
    remount(libc::MS_RDONLY)?;
    result
}

/// One injection: the jail's mount namespace, the cloned trees, and where
/// the answer goes (set by [`mount_in`]).
struct Job {
    ns: File,
    trees: Vec<(Expose, OwnedFd, bool)>,
    reply: Option<mpsc::SyncSender<Result<(), ServiceError>>>,
}

/// The kept mount threads and their queue.
struct Mounters {
    queue: Mutex<mpsc::Sender<Job>>,
    jobs: Mutex<mpsc::Receiver<Job>>,
    /// Threads waiting for a job, and threads alive.
    idle: AtomicUsize,
    threads: AtomicUsize,
}

static MOUNTERS: OnceLock<Mounters> = OnceLock::new();

fn mounters() -> &'static Mounters {
    MOUNTERS.get_or_init(|| {
        let (queue, jobs) = mpsc::channel();
        Mounters {
            queue: Mutex::new(queue),
            jobs: Mutex::new(jobs),
            idle: AtomicUsize::new(0),
            threads: AtomicUsize::new(0),
        }
    })
}

/// Runs `job` on a mount thread (started if none is idle and fewer than
/// [`MOST_THREADS`] run) and waits for its answer.
fn mount_in(mut job: Job) -> Result<(), ServiceError> {
    let m = mounters();
    let (reply, answer) = mpsc::sync_channel(1);
    job.reply = Some(reply);
    if m.idle.load(Ordering::SeqCst) == 0 && m.threads.load(Ordering::SeqCst) < MOST_THREADS {
        m.threads.fetch_add(1, Ordering::SeqCst);
        let started = std::thread::Builder::new()
            .name("jail-mount".into())
            .spawn(move || mount_thread(mounters()));
        if let Err(e) = started {
            m.threads.fetch_sub(1, Ordering::SeqCst);
            if m.threads.load(Ordering::SeqCst) == 0 {
                return Err(internal("start a jail mount thread", e));
            }
        }
    }
    m.queue
        .locked()
        .send(job)
        .map_err(|_| ServiceError::Internal("the jail mount queue is gone".into()))?;
    answer
        .recv()
        .map_err(|_| ServiceError::Internal("a jail mount thread ended mid-job".into()))?
}

/// A mount thread: its own file system context, then jobs until it cannot
/// go back to the host's mount namespace.
fn mount_thread(m: &'static Mounters) {
    let home = leave_shared_fs();
    loop {
        m.idle.fetch_add(1, Ordering::SeqCst);
        let job = m.jobs.locked().recv();
        m.idle.fetch_sub(1, Ordering::SeqCst);
        let Ok(job) = job else { break };
        let (result, stay) = match &home {
            Ok(home) => run(&job, home),
            Err(e) => (Err(ServiceError::Internal(e.clone())), false),
        };
        if let Some(reply) = &job.reply {
            let _ = reply.send(result);
        }
        if !stay {
            break;
        }
    }
    m.threads.fetch_sub(1, Ordering::SeqCst);
}

/// `unshare(CLONE_FS)` and umask 0 for this thread; the host's mount
/// namespace, to come back to.
fn leave_shared_fs() -> Result<File, String> {
    // SAFETY: unshare takes flags only.
    if unsafe { libc::unshare(libc::CLONE_FS) } < 0 {
        return Err(format!(
            "unshare CLONE_FS: {}",
            std::io::Error::last_os_error()
        ));
    }
    // This thread's own umask now (CLONE_FS holds it): mount points get
    // 0755 whatever the service's is.
    // SAFETY: umask takes and returns a mode only.
    unsafe { libc::umask(0) };
    File::open("/proc/thread-self/ns/mnt")
        .map_err(|e| format!("open the host's mount namespace: {e}"))
}

/// Enters the job's namespace, attaches its trees, comes back: the
/// result, and whether this thread may take another job.
fn run(job: &Job, home: &File) -> (Result<(), ServiceError>, bool) {
    let enter = |ns: &File| {
        // SAFETY: setns takes a descriptor we own and flags.
        if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNS) } < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(())
        }
    };
    if let Err(e) = enter(&job.ns) {
        return (Err(internal("enter the jail's mount namespace", e)), true);
    }
    let result = attach(&job.trees);
    match enter(home) {
        Ok(()) => (result, true),
        Err(e) => {
            tracing::error!(
                "a jail mount thread cannot go back to the host's mount namespace: {e}"
            );
            (result, false)
        }
    }
}
