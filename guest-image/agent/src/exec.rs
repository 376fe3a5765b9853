//! `exec`: spawn a process in a new session (so its process group can be
//! killed as a whole), stream its output as `stdout`/`stderr` frames and
//! finish with one `exit` frame.
//!
//! Threads per exec: a waiter (blocks in `wait`), one reader per output pipe,
//! a stdin writer when there is stdin, and a supervisor that enforces the
//! timeout and sends `exit`. After `exit` no frame with the exec's id is
//! sent again.

use crate::proto::{ErrorReply, ExecRequest, ExitReply, OutputChunk, ReplyBody};
use crate::sink::Sink;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};
use torpor_sync::Locked;

/// Output forwarded per exec when the request names no limit.
pub const DEFAULT_MAX_OUTPUT: u64 = 16 << 20;
/// How long to wait for the output pipes to close after the process exits
/// (a background child may hold them open; it is left running).
pub const DRAIN_GRACE: Duration = Duration::from_millis(500);
const READ_BUF: usize = 64 << 10;
const THREAD_STACK: usize = 256 << 10;

/// Process groups of the execs running on one connection, by request id.
/// Dropping the connection kills them all.
#[derive(Default, Debug)]
pub struct Running {
    pgids: Mutex<HashMap<u64, i32>>,
}

impl Running {
    /// How many execs are running.
    pub fn len(&self) -> usize {
        self.pgids.locked().len()
    }

    /// Whether no exec is running.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn remove(&self, id: u64) {
        self.pgids.locked().remove(&id);
    }

    /// SIGKILLs every running exec's process group.
    pub fn kill_all(&self) {
        for &pgid in self.pgids.locked().values() {
            kill_group(pgid);
        }
    }
}

fn kill_group(pgid: i32) {
    if pgid > 1 {
        // SAFETY: plain syscall; a negative pid addresses the process group.
        unsafe { libc::kill(-pgid, libc::SIGKILL) };
    }
}

fn spawn_thread(name: &str, f: impl FnOnce() + Send + 'static) -> std::io::Result<()> {
    thread::Builder::new()
        .name(name.to_string())
        .stack_size(THREAD_STACK)
        .spawn(f)
        .map(drop)
}

/// State shared by one exec's threads.
struct Shared {
    id: u64,
    sink: Arc<Sink>,
    /// Bytes that may still be forwarded.
    budget: AtomicU64,
    truncated: AtomicBool,
    /// Cleared (under the lock) just before `exit` is sent, so that no
    /// chunk can follow it.
    open: Mutex<bool>,
    produced: [AtomicU64; 2],
}

impl Shared {
    fn forward(&self, which: usize, data: &[u8]) {
        self.produced[which].fetch_add(data.len() as u64, Ordering::Relaxed);
        let want = data.len() as u64;
        let granted = match self
            .budget
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |b| {
                Some(b.saturating_sub(want))
            }) {
            Ok(before) => before.min(want) as usize,
            Err(_) => 0,
        };
        if granted < data.len() {
            self.truncated.store(true, Ordering::Relaxed);
        }
        if granted == 0 {
            return;
        }
        let chunk = OutputChunk {
            data: data[..granted].to_vec(),
        };
        let body = if which == 0 {
            ReplyBody::Stdout(chunk)
        } else {
            ReplyBody::Stderr(chunk)
        };
        let open = self.open.locked();
        if *open {
            self.sink.send(Some(self.id), body);
        }
    }
}

fn validate(req: &ExecRequest) -> Result<(), ErrorReply> {
    let einval = |m: String| Err(ErrorReply::new(libc::EINVAL, m));
    if req.argv.is_empty() || req.argv[0].is_empty() {
        return einval("argv must name a program".into());
    }
    let nul = |s: &str| s.contains('\0');
    if req.argv.iter().any(|a| nul(a))
        || req.env.iter().any(|(k, v)| nul(k) || nul(v))
        || req.cwd.as_deref().is_some_and(nul)
    {
        return einval("argv, env and cwd must not contain NUL bytes".into());
    }
    if let Some(k) = req.env.keys().find(|k| k.is_empty() || k.contains('=')) {
        return einval(format!("bad environment variable name {k:?}"));
    }
    Ok(())
}

/// Spawns the process and its helper threads; the `exit` frame follows
/// later. An `Err` means nothing runs and the caller replies with it.
pub fn start(
    id: u64,
    req: ExecRequest,
    sink: &Arc<Sink>,
    running: &Arc<Running>,
    max_running: usize,
) -> Result<(), ErrorReply> {
    validate(&req)?;
    {
        let map = running.pgids.locked();
        if map.contains_key(&id) {
            return Err(ErrorReply::new(
                libc::EEXIST,
                format!("exec id {id} is already running on this connection"),
            ));
        }
        if map.len() >= max_running {
            return Err(ErrorReply::new(
                libc::EAGAIN,
                format!("{max_running} execs already running on this connection"),
            ));
        }
    }
    let mut cmd = Command::new(&req.argv[0]);
    cmd.args(&req.argv[1..]);
    if req.clear_env {
        cmd.env_clear();
    }
    cmd.envs(&req.env);
    if let Some(cwd) = &req.cwd {
        cmd.current_dir(cwd);
    }
    cmd.stdin(if req.stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    });
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    // SAFETY: setsid is async-signal-safe; the closure touches nothing else.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let start = Instant::now();
    let mut child = cmd.spawn().map_err(|e| {
        let what = match &req.cwd {
            Some(cwd) => format!("spawn {:?} in {cwd:?}", req.argv[0]),
            None => format!("spawn {:?}", req.argv[0]),
        };
        ErrorReply::io(&what, &e)
    })?;
    let pgid = child.id() as i32;
    running.pgids.locked().insert(id, pgid);

    let shared = Arc::new(Shared {
        id,
        sink: Arc::clone(sink),
        budget: AtomicU64::new(req.max_output_bytes.unwrap_or(DEFAULT_MAX_OUTPUT)),
        truncated: AtomicBool::new(false),
        open: Mutex::new(true),
        produced: [AtomicU64::new(0), AtomicU64::new(0)],
    });
    let (status_tx, status_rx) = mpsc::channel();
    let (done_tx, done_rx) = mpsc::channel();
    let mut waiter_started = false;
    let result = start_threads(&mut child, req.stdin, &shared, done_tx).and_then(|()| {
        spawn_thread("exec-wait", move || {
            let _ = status_tx.send(child.wait());
        })?;
        waiter_started = true;
        let sh = Arc::clone(&shared);
        let run = Arc::clone(running);
        let timeout = req.timeout_ms.filter(|&t| t > 0).map(Duration::from_millis);
        spawn_thread("exec", move || {
            supervise(sh, &run, pgid, start, timeout, status_rx, done_rx)
        })
    });
    if let Err(e) = result {
        // Out of threads: undo everything. Helpers already started end when
        // the pipes close.
        *shared.open.locked() = false;
        kill_group(pgid);
        if !waiter_started {
            // SAFETY: reaps our own (killed) child so it leaves no zombie.
            unsafe { libc::waitpid(pgid, std::ptr::null_mut(), 0) };
        }
        running.remove(id);
        return Err(ErrorReply::io("exec: cannot start a thread", &e));
    }
    Ok(())
}

/// Starts the stdin writer and one reader per output pipe.
fn start_threads(
    child: &mut Child,
    stdin: Option<Vec<u8>>,
    shared: &Arc<Shared>,
    done_tx: mpsc::Sender<()>,
) -> std::io::Result<()> {
    if let (Some(mut pipe), Some(data)) = (child.stdin.take(), stdin) {
        // A process that never reads its stdin makes this fail with EPIPE
        // once it exits; that is fine.
        spawn_thread("exec-stdin", move || {
            let _ = pipe.write_all(&data);
        })?;
    }
    let mut pipes: Vec<(usize, Box<dyn Read + Send>)> = Vec::with_capacity(2);
    if let Some(p) = child.stdout.take() {
        pipes.push((0, Box::new(p)));
    }
    if let Some(p) = child.stderr.take() {
        pipes.push((1, Box::new(p)));
    }
    for (which, mut pipe) in pipes {
        let sh = Arc::clone(shared);
        let done = done_tx.clone();
        spawn_thread("exec-read", move || {
            drain(&mut pipe, |chunk| sh.forward(which, chunk));
            let _ = done.send(());
        })?;
    }
    Ok(())
}

/// Reads `pipe` to its end, or to an error (EIO when a PTY's last slave
/// fd closes), handing each chunk to `sink`.
pub(crate) fn drain<R: Read + ?Sized>(pipe: &mut R, mut sink: impl FnMut(&[u8])) {
    let mut buf = vec![0u8; READ_BUF];
    loop {
        match pipe.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => sink(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
}

fn supervise(
    shared: Arc<Shared>,
    running: &Running,
    pgid: i32,
    start: Instant,
    timeout: Option<Duration>,
    status_rx: mpsc::Receiver<std::io::Result<ExitStatus>>,
    done_rx: mpsc::Receiver<()>,
) {
    let mut timed_out = false;
    let status = match timeout {
        None => status_rx.recv(),
        Some(t) => match status_rx.recv_timeout(t) {
            Ok(s) => Ok(s),
            Err(RecvTimeoutError::Timeout) => {
                timed_out = true;
                kill_group(pgid);
                status_rx.recv()
            }
            Err(RecvTimeoutError::Disconnected) => Err(mpsc::RecvError),
        },
    };
    let duration = start.elapsed();
    if timed_out {
        // Grandchildren in the group were killed with the leader; make sure
        // none survived a race with the leader's exit.
        kill_group(pgid);
    }
    // Let the readers forward what is left in the pipes.
    let drain_until = Instant::now() + DRAIN_GRACE;
    for _ in 0..2 {
        let left = drain_until.saturating_duration_since(Instant::now());
        if done_rx.recv_timeout(left).is_err() {
            break;
        }
    }
    let (code, signal) = match status {
        Ok(Ok(s)) => (s.code(), s.signal()),
        _ => (None, None),
    };
    let exit = ExitReply {
        code,
        signal,
        timed_out,
        truncated: shared.truncated.load(Ordering::Relaxed),
        duration_us: duration.as_micros() as u64,
        stdout_bytes: shared.produced[0].load(Ordering::Relaxed),
        stderr_bytes: shared.produced[1].load(Ordering::Relaxed),
    };
    running.remove(shared.id);
    let mut open = shared.open.locked();
    *open = false;
    shared.sink.send(Some(shared.id), ReplyBody::Exit(exit));
}
