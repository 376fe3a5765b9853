//! Spawned processes (protocol 1.1): they belong to the agent, not to a
//! connection, so a host can start one, go away, and come back (`attach`
//! by pid), list them, signal them, feed their stdin or PTY and resize it.
//!
//! Bounds: at most [`Procs::max`] entries (exited ones are dropped, oldest
//! first, to make room, and after [`EXITED_KEPT`]); each keeps at most
//! [`MAX_RETAINED`] bytes of recent output for attaches that replay
//! (older chunks are dropped; a slow attach skips what was dropped).
//! Threads per process: one reader per output pipe (or the PTY) and a
//! waiter; one more per attach.

use crate::proto::{
    AttachRequest, ErrorReply, ExitReply, InputRequest, OutputChunk, ProcessInfo, PtySize,
    ReplyBody, ResizeRequest, SignalRequest, SpawnRequest, Spawned,
};
use crate::sink::Sink;
use crate::users;
use std::collections::{BTreeMap, VecDeque};
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::io::AsRawFd;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Command, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};
use torpor_sync::{Locked, Waited};

/// Output bytes kept per process for replaying attaches.
pub const MAX_RETAINED: usize = 1 << 20;
/// How long an exited process stays attachable.
pub const EXITED_KEPT: Duration = Duration::from_secs(300);
/// Default and least keepalive interval of an attach.
const KEEPALIVE: Duration = Duration::from_secs(10);
const MIN_KEEPALIVE: Duration = Duration::from_millis(100);
/// How long the waiter lets the readers drain after the process exits.
const DRAIN_GRACE: Duration = Duration::from_millis(500);
const THREAD_STACK: usize = 256 << 10;
const MAX_TAG: usize = 256;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Stream {
    Stdout,
    Stderr,
    Pty,
}

#[derive(Default, Debug)]
struct Output {
    /// `(sequence number, stream, bytes)`, oldest first.
    chunks: VecDeque<(u64, Stream, Vec<u8>)>,
    bytes: usize,
    next_seq: u64,
    exit: Option<ExitReply>,
    exited_at: Option<Instant>,
}

#[derive(Debug)]
struct Proc {
    info: ProcessInfo,
    started: Instant,
    out: Mutex<Output>,
    changed: Condvar,
    /// The write side of stdin (a pipe) or the PTY master.
    input: Mutex<Option<File>>,
    /// The PTY master, for resizing.
    pty: Option<File>,
}

impl Proc {
    fn push(&self, stream: Stream, data: &[u8]) {
        let mut out = self.out.locked();
        let seq = out.next_seq;
        out.next_seq += 1;
        out.bytes += data.len();
        out.chunks.push_back((seq, stream, data.to_vec()));
        while out.bytes > MAX_RETAINED {
            let Some((_, _, old)) = out.chunks.pop_front() else {
                break;
            };
            out.bytes -= old.len();
        }
        drop(out);
        self.changed.notify_all();
    }

    fn running(&self) -> bool {
        self.out.locked().exit.is_none()
    }
}

/// The agent's spawned processes, shared by every connection.
#[derive(Debug)]
pub struct Procs {
    table: Mutex<BTreeMap<u32, Arc<Proc>>>,
    /// Most entries (running or exited) at once.
    pub max: usize,
}

impl Default for Procs {
    fn default() -> Self {
        Procs::new(256)
    }
}

fn spawn_thread(name: &str, f: impl FnOnce() + Send + 'static) -> std::io::Result<()> {
    thread::Builder::new()
        .name(name.to_string())
        .stack_size(THREAD_STACK)
        .spawn(f)
        .map(drop)
}

fn einval(msg: impl Into<String>) -> ErrorReply {
    ErrorReply::new(libc::EINVAL, msg)
}

fn check_size(size: PtySize) -> Result<libc::winsize, ErrorReply> {
    let ok = |n: u16| (1..=4096).contains(&n);
    if !ok(size.cols) || !ok(size.rows) {
        return Err(einval(format!(
            "terminal size {}x{} is outside 1..=4096",
            size.cols, size.rows
        )));
    }
    Ok(libc::winsize {
        ws_row: size.rows,
        ws_col: size.cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    })
}

/// A new PTY pair of `size`: (master, slave).
fn open_pty(size: PtySize) -> Result<(File, File), ErrorReply> {
    let ws = check_size(size)?;
    let (mut master, mut slave) = (-1, -1);
    // SAFETY: openpty writes two fds into the given ints; the name pointer
    // may be null; termios null means defaults.
    let rc = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            &ws,
        )
    };
    if rc != 0 {
        return Err(ErrorReply::io("openpty", &std::io::Error::last_os_error()));
    }
    // SAFETY: openpty succeeded: both fds are ours alone.
    let (master, slave) = unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
    for fd in [&master, &slave] {
        // SAFETY: plain fcntl on an fd we own.
        unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
    }
    Ok((File::from(master), File::from(slave)))
}

fn validate(req: &SpawnRequest) -> Result<(), ErrorReply> {
    if req.argv.is_empty() || req.argv[0].is_empty() {
        return Err(einval("argv must name a program"));
    }
    let nul = |s: &str| s.contains('\0');
    if req.argv.iter().any(|a| nul(a))
        || req.env.iter().any(|(k, v)| nul(k) || nul(v))
        || req.cwd.as_deref().is_some_and(nul)
    {
        return Err(einval("argv, env and cwd must not contain NUL bytes"));
    }
    if let Some(k) = req.env.keys().find(|k| k.is_empty() || k.contains('=')) {
        return Err(einval(format!("bad environment variable name {k:?}")));
    }
    if req.tag.as_ref().is_some_and(|t| t.len() > MAX_TAG) {
        return Err(einval(format!("tag longer than {MAX_TAG} bytes")));
    }
    Ok(())
}

impl Procs {
    /// A table of at most `max` processes.
    pub fn new(max: usize) -> Procs {
        Procs {
            table: Mutex::new(BTreeMap::new()),
            max,
        }
    }

    fn get(&self, pid: u32) -> Result<Arc<Proc>, ErrorReply> {
        self.table.locked().get(&pid).cloned().ok_or_else(|| {
            ErrorReply::new(libc::ESRCH, format!("no spawned process with pid {pid}"))
        })
    }

    /// Drops exited entries kept too long, then, if still full, the one
    /// that exited first; `EAGAIN` when every entry runs.
    fn make_room(&self, table: &mut BTreeMap<u32, Arc<Proc>>) -> Result<(), ErrorReply> {
        table.retain(|_, p| {
            p.out
                .locked()
                .exited_at
                .is_none_or(|t| t.elapsed() < EXITED_KEPT)
        });
        if table.len() < self.max {
            return Ok(());
        }
        let oldest = table
            .iter()
            .filter_map(|(pid, p)| p.out.locked().exited_at.map(|t| (t, *pid)))
            .min();
        match oldest {
            Some((_, pid)) => {
                table.remove(&pid);
                Ok(())
            }
            None => Err(ErrorReply::new(
                libc::EAGAIN,
                format!("{} spawned processes already running", self.max),
            )),
        }
    }

    /// `spawn`: starts the process and its reader and waiter threads.
    pub fn spawn(&self, req: SpawnRequest) -> Result<Spawned, ErrorReply> {
        validate(&req)?;
        let mut table = self.table.locked();
        self.make_room(&mut table)?;
        let user = req.user.as_deref().map(users::by_name).transpose()?;
        // SAFETY: geteuid has no preconditions.
        let euid = unsafe { libc::geteuid() };
        if let Some(u) = &user {
            if u.uid != euid && euid != 0 {
                return Err(ErrorReply::new(
                    libc::EPERM,
                    format!("the agent cannot run processes as {:?}", u.name),
                ));
            }
        }
        let cwd = match (&req.cwd, &user) {
            (Some(c), _) => c.clone(),
            (None, Some(u)) if u.home.is_dir() => u.home.to_string_lossy().into_owned(),
            (None, _) => "/".to_string(),
        };
        let mut cmd = Command::new(&req.argv[0]);
        cmd.args(&req.argv[1..]).current_dir(&cwd);
        if let Some(u) = &user {
            cmd.env("HOME", &u.home)
                .env("USER", &u.name)
                .env("LOGNAME", &u.name);
        }
        let pty = req.pty.map(open_pty).transpose()?;
        if pty.is_some() {
            cmd.env("TERM", "xterm-256color");
        }
        cmd.envs(&req.env);
        let mut input = None;
        let mut master = None;
        match &pty {
            Some((m, slave)) => {
                let dup = |f: &File| f.try_clone().map_err(|e| ErrorReply::io("dup pty", &e));
                cmd.stdin(Stdio::from(dup(slave)?))
                    .stdout(Stdio::from(dup(slave)?))
                    .stderr(Stdio::from(dup(slave)?));
                input = Some(dup(m)?);
                master = Some(dup(m)?);
            }
            None => {
                cmd.stdin(if req.stdin {
                    Stdio::piped()
                } else {
                    Stdio::null()
                })
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            }
        }
        let has_pty = pty.is_some();
        let ids = user
            .as_ref()
            .filter(|u| u.uid != euid)
            .map(|u| (u.uid, u.gid, u.groups.clone()));
        // SAFETY: between fork and exec the closure only makes
        // async-signal-safe syscalls on values prepared before the fork.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if has_pty && libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if let Some((uid, gid, groups)) = &ids {
                    if libc::setgroups(groups.len(), groups.as_ptr()) < 0
                        || libc::setgid(*gid) < 0
                        || libc::setuid(*uid) < 0
                    {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| ErrorReply::io(&format!("spawn {:?} in {cwd:?}", req.argv[0]), &e))?;
        drop(cmd);
        drop(pty);
        let pid = child.id();
        if input.is_none() {
            input = child.stdin.take().map(|s| File::from(OwnedFd::from(s)));
        }
        let proc = Arc::new(Proc {
            info: ProcessInfo {
                pid,
                argv: req.argv,
                env: req.env,
                cwd,
                user: req.user,
                tag: req.tag,
                pty: has_pty,
            },
            started: Instant::now(),
            out: Mutex::new(Output::default()),
            changed: Condvar::new(),
            input: Mutex::new(input),
            pty: master.as_ref().and_then(|m| m.try_clone().ok()),
        });
        let mut readers: Vec<(Stream, Box<dyn Read + Send>)> = Vec::new();
        if let Some(m) = master {
            readers.push((Stream::Pty, Box::new(m)));
        }
        if let Some(p) = child.stdout.take() {
            readers.push((Stream::Stdout, Box::new(p)));
        }
        if let Some(p) = child.stderr.take() {
            readers.push((Stream::Stderr, Box::new(p)));
        }
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let n_readers = readers.len();
        let mut started = Ok(());
        for (stream, mut pipe) in readers {
            let p = Arc::clone(&proc);
            let done = done_tx.clone();
            started = started.and(spawn_thread("proc-read", move || {
                crate::exec::drain(&mut pipe, |chunk| p.push(stream, chunk));
                let _ = done.send(());
            }));
        }
        drop(done_tx);
        let p = Arc::clone(&proc);
        started = started.and(spawn_thread("proc-wait", move || {
            let status = child.wait();
            let drain_until = Instant::now() + DRAIN_GRACE;
            for _ in 0..n_readers {
                let left = drain_until.saturating_duration_since(Instant::now());
                if done_rx.recv_timeout(left).is_err() {
                    break;
                }
            }
            let (code, signal) = match status {
                Ok(s) => (s.code(), s.signal()),
                Err(_) => (None, None),
            };
            let mut out = p.out.locked();
            out.exit = Some(ExitReply {
                code,
                signal,
                timed_out: false,
                truncated: false,
                duration_us: p.started.elapsed().as_micros() as u64,
                stdout_bytes: 0,
                stderr_bytes: 0,
            });
            out.exited_at = Some(Instant::now());
            drop(out);
            *p.input.locked() = None;
            p.changed.notify_all();
        }));
        if let Err(e) = started {
            // Out of threads: kill it; threads already started end with it.
            // SAFETY: plain syscall on our own child's group.
            unsafe { libc::kill(-(pid as i32), libc::SIGKILL) };
            return Err(ErrorReply::io("spawn: cannot start a thread", &e));
        }
        table.insert(pid, proc);
        Ok(Spawned { pid })
    }

    /// `attach`: streams the process's output to `sink` under `id` on a
    /// thread of its own, ending with `exit` (or when the connection goes).
    pub fn attach(&self, id: u64, req: AttachRequest, sink: &Arc<Sink>) -> Result<(), ErrorReply> {
        let proc = self.get(req.pid)?;
        let keepalive = req
            .keepalive_ms
            .map(Duration::from_millis)
            .unwrap_or(KEEPALIVE)
            .max(MIN_KEEPALIVE);
        let sink = Arc::clone(sink);
        let guard = sink.enter_stream().ok_or_else(|| {
            ErrorReply::new(libc::EAGAIN, "too many streams running on this connection")
        })?;
        let mut next = if req.replay {
            0
        } else {
            proc.out.locked().next_seq
        };
        spawn_thread("proc-attach", move || {
            let _guard = guard;
            loop {
                let out = proc.out.locked();
                let fresh: Vec<(Stream, Vec<u8>)> = out
                    .chunks
                    .iter()
                    .filter(|(seq, _, _)| *seq >= next)
                    .map(|(_, s, d)| (*s, d.clone()))
                    .collect();
                next = out.next_seq;
                if fresh.is_empty() {
                    if let Some(exit) = out.exit.clone() {
                        drop(out);
                        sink.send(Some(id), ReplyBody::Exit(exit));
                        return;
                    }
                    let (o, timeout) = proc.changed.wait_timeout_locked(out, keepalive);
                    drop(o);
                    if timeout.timed_out() && !sink.send(Some(id), ReplyBody::Keepalive) {
                        return;
                    }
                    continue;
                }
                drop(out);
                for (stream, data) in fresh {
                    let chunk = OutputChunk { data };
                    let body = match stream {
                        Stream::Stdout => ReplyBody::Stdout(chunk),
                        Stream::Stderr => ReplyBody::Stderr(chunk),
                        Stream::Pty => ReplyBody::Pty(chunk),
                    };
                    if !sink.send(Some(id), body) {
                        return;
                    }
                }
            }
        })
        .map_err(|e| ErrorReply::io("attach: cannot start a thread", &e))
    }

    /// `processes`: the running ones, by pid.
    pub fn list(&self) -> Vec<ProcessInfo> {
        self.table
            .locked()
            .values()
            .filter(|p| p.running())
            .map(|p| p.info.clone())
            .collect()
    }

    fn running(&self, pid: u32) -> Result<Arc<Proc>, ErrorReply> {
        let p = self.get(pid)?;
        if !p.running() {
            return Err(ErrorReply::new(
                libc::ESRCH,
                format!("process {pid} has exited"),
            ));
        }
        Ok(p)
    }

    /// `signal`: to the process's whole group.
    pub fn signal(&self, req: &SignalRequest) -> Result<(), ErrorReply> {
        if !(1..=64).contains(&req.signal) {
            return Err(einval(format!("bad signal number {}", req.signal)));
        }
        self.running(req.pid)?;
        // SAFETY: plain syscall; the group is one the agent spawned.
        if unsafe { libc::kill(-(req.pid as i32), req.signal) } < 0 {
            let e = std::io::Error::last_os_error();
            return Err(ErrorReply::io(&format!("kill {}", req.pid), &e));
        }
        Ok(())
    }

    /// `input`: written whole to stdin or the PTY. A process that does not
    /// read blocks this request (the host's deadline bounds it).
    pub fn input(&self, req: &InputRequest) -> Result<(), ErrorReply> {
        let p = self.running(req.pid)?;
        let input = p.input.locked().as_ref().map(File::try_clone);
        match input {
            Some(Ok(mut f)) => f
                .write_all(&req.data)
                .map_err(|e| ErrorReply::io(&format!("stdin of {}", req.pid), &e)),
            Some(Err(e)) => Err(ErrorReply::io("dup stdin", &e)),
            None => Err(ErrorReply::new(
                libc::EPIPE,
                format!("process {} has no open stdin", req.pid),
            )),
        }
    }

    /// `close_stdin`: EOF for the process (a PTY's is not closed: send ^D).
    pub fn close_stdin(&self, pid: u32) -> Result<(), ErrorReply> {
        let p = self.running(pid)?;
        if p.info.pty {
            return Err(einval(format!(
                "process {pid} runs on a PTY: send ^D (0x04) instead"
            )));
        }
        *p.input.locked() = None;
        Ok(())
    }

    /// `resize`: the PTY's window size (the process gets `SIGWINCH`).
    pub fn resize(&self, req: &ResizeRequest) -> Result<(), ErrorReply> {
        let ws = check_size(PtySize {
            cols: req.cols,
            rows: req.rows,
        })?;
        let p = self.running(req.pid)?;
        let Some(master) = &p.pty else {
            return Err(einval(format!("process {} has no PTY", req.pid)));
        };
        // SAFETY: TIOCSWINSZ reads a winsize from a valid pointer.
        if unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCSWINSZ, &ws) } < 0 {
            let e = std::io::Error::last_os_error();
            return Err(ErrorReply::io("TIOCSWINSZ", &e));
        }
        Ok(())
    }
}
