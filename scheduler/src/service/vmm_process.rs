//! How a pod starts its `torpor-vmm` processes, and its handle on one.
//!
//! By default a VMM is forked by the pod's fork server (`torpor-vmm
//! --fork-server`, [`torpor_vmm_api::fork`]): one exec'd `torpor-vmm`,
//! started on first use, that forks a child per VMM with `CLONE_PARENT`,
//! so the child is the pod's own, waited for here like an exec'd one. A
//! fork skips the exec, the relocation of the static PIE and its runtime's
//! start, and the children share the server's relocated pages. A server
//! that fails is replaced once, and past that the VMM is exec'd
//! ([`SpawnMode::Exec`] always does). A server is retired after
//! [`MAX_FORKS_PER_SERVER`] forks, so a layout is shared by that many VMMs
//! at most.

use std::collections::HashMap;
use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use rustix::net::{
    recvmsg, sendmsg, AddressFamily, RecvAncillaryBuffer, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, SocketFlags, SocketType,
};
use rustix::process::{Pid, Signal, WaitOptions};
use torpor_sync::Locked;
use torpor_vmm_api::fork::{
    ForkReply, ForkRequest, FORK_FDS, MAX_FORKS_PER_SERVER, MAX_FORK_MESSAGE,
};

/// How long a fork server may take to answer one request.
const FORK_LIMIT: Duration = Duration::from_secs(5);

/// How the pod starts VMM processes (`torpor serve --vmm-spawn`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SpawnMode {
    /// Forked by the pod's fork server (exec'd if it fails).
    #[default]
    Fork,
    /// Each exec'd.
    Exec,
}

static EXEC_ONLY: AtomicBool = AtomicBool::new(false);

/// Sets how this process starts its VMMs from now on.
pub fn set_spawn_mode(mode: SpawnMode) {
    EXEC_ONLY.store(mode == SpawnMode::Exec, Ordering::Relaxed);
}

pub fn spawn_mode() -> SpawnMode {
    if EXEC_ONLY.load(Ordering::Relaxed) {
        SpawnMode::Exec
    } else {
        SpawnMode::Fork
    }
}

/// A started VMM process (a child of this one either way).
#[derive(Debug)]
pub struct VmmChild {
    pid: u32,
    how: How,
}

#[derive(Debug)]
enum How {
    Exec(Child),
    /// Forked; its status once waited for.
    Forked(Option<ExitStatus>),
}

impl From<Child> for VmmChild {
    fn from(child: Child) -> Self {
        VmmChild {
            pid: child.id(),
            how: How::Exec(child),
        }
    }
}

impl VmmChild {
    pub fn id(&self) -> u32 {
        self.pid
    }

    /// Whether it forked (rather than exec'd).
    pub fn forked(&self) -> bool {
        matches!(self.how, How::Forked(_))
    }

    /// Its exit status if it has ended (reaped then), else None.
    pub fn try_wait(&mut self) -> std::io::Result<Option<ExitStatus>> {
        match &mut self.how {
            How::Exec(c) => c.try_wait(),
            How::Forked(Some(s)) => Ok(Some(*s)),
            How::Forked(done) => {
                *done = waitpid(self.pid, WaitOptions::NOHANG)?;
                Ok(*done)
            }
        }
    }

    /// Waits for it to end.
    pub fn wait(&mut self) -> std::io::Result<ExitStatus> {
        match &mut self.how {
            How::Exec(c) => c.wait(),
            How::Forked(Some(s)) => Ok(*s),
            How::Forked(done) => {
                let status = waitpid(self.pid, WaitOptions::empty())?
                    .ok_or_else(|| std::io::Error::other("waitpid answered no status"))?;
                *done = Some(status);
                Ok(status)
            }
        }
    }

    /// SIGKILL, unless it was reaped already.
    pub fn kill(&mut self) -> std::io::Result<()> {
        match &mut self.how {
            How::Exec(c) => c.kill(),
            How::Forked(Some(_)) => Ok(()),
            How::Forked(None) => {
                // Not reaped: the pid is still its (a zombie at worst).
                match rustix::process::kill_process(pid_of(self.pid)?, Signal::KILL) {
                    Ok(()) | Err(rustix::io::Errno::SRCH) => Ok(()),
                    Err(e) => Err(e.into()),
                }
            }
        }
    }
}

fn pid_of(pid: u32) -> std::io::Result<Pid> {
    Pid::from_raw(pid as i32).ok_or_else(|| std::io::Error::other(format!("no pid {pid}")))
}

fn waitpid(pid: u32, options: WaitOptions) -> std::io::Result<Option<ExitStatus>> {
    let pid = pid_of(pid)?;
    loop {
        match rustix::process::waitpid(Some(pid), options) {
            Ok(found) => return Ok(found.map(|(_, s)| ExitStatus::from_raw(s.as_raw()))),
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// Starts `exe` with `stdin`, `stdout` and `stderr`: forked by the fork
/// server of `exe` unless exec'd is asked for or forking fails twice.
pub fn start(
    exe: &Path,
    stdin: OwnedFd,
    stdout: OwnedFd,
    stderr: OwnedFd,
) -> std::io::Result<VmmChild> {
    if spawn_mode() == SpawnMode::Fork {
        for attempt in 0..2 {
            match fork_from_server(exe, [&stdin, &stdout, &stderr]) {
                Ok(pid) => {
                    return Ok(VmmChild {
                        pid,
                        how: How::Forked(None),
                    })
                }
                Err(e) if attempt == 0 => {
                    tracing::warn!("the VMM fork server failed ({e}): starting a new one");
                }
                Err(e) => tracing::warn!("the VMM fork server failed again ({e}): exec'ing"),
            }
        }
    }
    Command::new(exe)
        .stdin(Stdio::from(stdin))
        .stdout(Stdio::from(stdout))
        .stderr(Stdio::from(stderr))
        .process_group(0)
        .spawn()
        .map(VmmChild::from)
}

/// One running fork server.
struct Server {
    socket: OwnedFd,
    process: Child,
    forks: u64,
}

impl Server {
    fn start(exe: &Path) -> std::io::Result<Self> {
        let (ours, theirs) = rustix::net::socketpair(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )?;
        rustix::net::sockopt::set_socket_timeout(
            &ours,
            rustix::net::sockopt::Timeout::Recv,
            Some(FORK_LIMIT),
        )?;
        let process = Command::new(exe)
            .arg("--fork-server")
            .stdin(Stdio::from(theirs))
            .stdout(Stdio::null())
            // Its own group: the pod's terminal's signals are not its.
            .process_group(0)
            .spawn()?;
        Ok(Server {
            socket: ours,
            process,
            forks: 0,
        })
    }

    fn fork(&mut self, fds: [&OwnedFd; FORK_FDS]) -> std::io::Result<u32> {
        let borrowed = fds.map(|f| f.as_fd());
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(FORK_FDS))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        control.push(SendAncillaryMessage::ScmRights(&borrowed));
        sendmsg(
            &self.socket,
            &[IoSlice::new(&ForkRequest::Fork {}.to_bytes())],
            &mut control,
            SendFlags::NOSIGNAL,
        )?;
        let mut buf = [0u8; MAX_FORK_MESSAGE];
        let mut none = RecvAncillaryBuffer::default();
        let got = loop {
            match recvmsg(
                &self.socket,
                &mut [IoSliceMut::new(&mut buf)],
                &mut none,
                RecvFlags::CMSG_CLOEXEC,
            ) {
                Ok(m) => break m,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            }
        };
        if got.bytes == 0 {
            return Err(std::io::Error::other("the fork server closed its socket"));
        }
        self.forks += 1;
        match ForkReply::from_bytes(&buf[..got.bytes.min(buf.len())]) {
            Ok(ForkReply::Forked { pid }) => Ok(pid),
            Ok(ForkReply::Failed { errno, message }) => Err(match errno {
                Some(e) => std::io::Error::from_raw_os_error(e),
                None => std::io::Error::other(message),
            }),
            Err(e) => Err(std::io::Error::other(e)),
        }
    }

    /// Closes its socket (a healthy server exits at the EOF; a stuck one
    /// is killed) and reaps it.
    fn retire(mut self) {
        drop(self.socket);
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}

/// The fork servers of this process, by `torpor-vmm` binary.
static SERVERS: Mutex<Option<HashMap<PathBuf, Server>>> = Mutex::new(None);

/// The pid of `exe`'s fork server, if one runs.
pub fn fork_server_pid(exe: &Path) -> Option<u32> {
    SERVERS.locked().as_ref()?.get(exe).map(|s| s.process.id())
}

/// A fork of `exe`'s server with `fds` as the child's stdin, stdout and
/// stderr; its pid. A server that fails, or has forked its share, is
/// retired (the next call starts another).
fn fork_from_server(exe: &Path, fds: [&OwnedFd; FORK_FDS]) -> std::io::Result<u32> {
    let mut servers = SERVERS.locked();
    let servers = servers.get_or_insert_with(HashMap::new);
    let server = match servers.entry(exe.to_path_buf()) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(v) => v.insert(Server::start(exe)?),
    };
    let forked = server.fork(fds);
    let worn = forked.is_err() || server.forks >= MAX_FORKS_PER_SERVER;
    if worn {
        if let Some(old) = servers.remove(exe) {
            old.retire();
        }
    }
    forked
}

/// A job of the [`Reaper`].
type ReapJob = Box<dyn FnOnce() + Send>;

/// Waits for VMMs already told to exit (a hibernation's: the VMM ends
/// itself once its snapshot is written) on a thread of its own, so the
/// operation that ended them answers without waiting for the kernel's
/// teardown of the process (its memory, its VM, a jail's cgroup and pid
/// namespace: about 1.5 ms, at times 15 to 30 ms). Jobs run in order, on
/// one thread started with the first; dropping the reaper waits for the
/// jobs queued.
#[derive(Default)]
pub struct Reaper {
    queue: Mutex<Option<std::sync::mpsc::Sender<ReapJob>>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl std::fmt::Debug for Reaper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reaper").finish_non_exhaustive()
    }
}

impl Reaper {
    /// Runs `job` on the reaper's thread, or here if no thread can be
    /// started.
    pub fn reap(&self, job: impl FnOnce() + Send + 'static) {
        let mut queue = self.queue.locked();
        if queue.is_none() {
            let (tx, rx) = std::sync::mpsc::channel::<ReapJob>();
            let spawned = std::thread::Builder::new()
                .name("torpor-reaper".into())
                .spawn(move || {
                    for job in rx {
                        job();
                    }
                });
            match spawned {
                Ok(thread) => {
                    *self.thread.locked() = Some(thread);
                    *queue = Some(tx);
                }
                Err(e) => {
                    drop(queue);
                    tracing::warn!("cannot start the reaper's thread, reaping here: {e}");
                    job();
                    return;
                }
            }
        }
        if let Some(Err(std::sync::mpsc::SendError(job))) =
            queue.as_ref().map(|tx| tx.send(Box::new(job) as ReapJob))
        {
            // The thread is gone (a job panicked): a new one next time.
            *queue = None;
            drop(queue);
            job();
        }
    }
}

impl Drop for Reaper {
    fn drop(&mut self) {
        self.queue.locked().take();
        if let Some(thread) = self.thread.locked().take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod reaper_tests {
    use super::Reaper;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    /// Jobs run off the caller's thread (the first waits for a release
    /// the caller sends after queueing them all), in order, and dropping
    /// the reaper waits for every job queued.
    #[test]
    fn jobs_run_apart_in_order_and_the_end_waits_for_them() {
        let reaper = Reaper::default();
        let order = Arc::new(std::sync::Mutex::new(Vec::new()));
        let here = std::thread::current().id();
        let (release, released) = std::sync::mpsc::channel::<()>();
        let first = Arc::clone(&order);
        reaper.reap(move || {
            let got = released.recv_timeout(Duration::from_secs(30)).is_ok();
            first.lock().unwrap().push(if got { 0 } else { 99 });
        });
        for n in 1..3 {
            let order = Arc::clone(&order);
            reaper.reap(move || {
                assert_ne!(std::thread::current().id(), here);
                order.lock().unwrap().push(n);
            });
        }
        release.send(()).unwrap();
        let done = Arc::new(AtomicUsize::new(0));
        let d = Arc::clone(&done);
        reaper.reap(move || {
            d.fetch_add(1, Ordering::SeqCst);
        });
        drop(reaper);
        assert_eq!(*order.lock().unwrap(), vec![0, 1, 2]);
        assert_eq!(done.load(Ordering::SeqCst), 1);
    }
}
