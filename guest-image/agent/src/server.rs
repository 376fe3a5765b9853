//! The agent side: accept connections, handshake, dispatch requests. One
//! thread per connection reads frames in order; `exec` runs on its own
//! threads, every other operation answers inline. Replies from all threads
//! go through one [`Sink`] per connection, a frame at a time.

use crate::exec::{self, Running};
use crate::files;
use crate::frame::{read_frame, FrameError, MAX_FRAME};
use crate::procs::Procs;
use crate::proto::{
    ErrorReply, HelloReply, InfoReply, Op, ReplyBody, Request, AGENT_VERSION, KNOWN_OPS,
    PROTOCOL_VERSION,
};
use crate::proto::{ProcessList, WatchId};
use crate::resumed;
pub use crate::sink::{Sink, StreamGuard, MAX_STREAMS};
use crate::system::{self, SystemOps};
use crate::volumes::{RelayConfig, Volumes};
use crate::vsock::{VsockListener, VsockStream};
use crate::watch::Watches;
use std::io::{self, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Default vsock port the agent listens on.
pub const DEFAULT_VSOCK_PORT: u32 = 52;

/// Agent settings.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    /// Largest frame accepted or sent.
    pub max_frame: usize,
    /// Execs running at once on one connection.
    pub max_execs_per_connection: usize,
    /// Spawned processes kept at once (running or recently exited).
    pub max_processes: usize,
    /// The side effects of `resumed`.
    pub ops: Arc<dyn SystemOps>,
    /// Log connections and protocol errors to stderr.
    pub verbose: bool,
    /// Where `mount_volumes`' relay listens and what it reaches (1.5).
    pub volume_relay: RelayConfig,
}

impl AgentConfig {
    /// Defaults with the given system operations.
    pub fn new(ops: Arc<dyn SystemOps>) -> AgentConfig {
        AgentConfig {
            max_frame: MAX_FRAME,
            max_execs_per_connection: 64,
            max_processes: 256,
            ops,
            verbose: false,
            volume_relay: RelayConfig::default(),
        }
    }
}

/// Where to listen: `unix:/path` or `vsock:PORT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    /// A unix stream socket (host-side testing).
    Unix(PathBuf),
    /// AF_VSOCK on any CID.
    Vsock(u32),
}

impl FromStr for ListenAddr {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return Err("unix: needs a path".into());
            }
            Ok(ListenAddr::Unix(path.into()))
        } else if let Some(port) = s.strip_prefix("vsock:") {
            port.parse()
                .map(ListenAddr::Vsock)
                .map_err(|_| format!("bad vsock port {port:?}"))
        } else {
            Err(format!("{s:?}: want unix:/path or vsock:PORT"))
        }
    }
}

/// A bound listener.
#[derive(Debug)]
pub enum Listener {
    /// Unix socket.
    Unix(UnixListener),
    /// vsock.
    Vsock(VsockListener),
}

/// An accepted connection.
#[derive(Debug)]
pub enum Stream {
    /// Unix socket.
    Unix(UnixStream),
    /// vsock.
    Vsock(VsockStream),
}

impl Listener {
    /// Binds `addr`. A unix socket file nobody answers on is replaced; one
    /// that answers is `AddrInUse`.
    pub fn bind(addr: &ListenAddr) -> io::Result<Listener> {
        match addr {
            ListenAddr::Unix(path) => {
                if path.exists() {
                    if UnixStream::connect(path).is_ok() {
                        return Err(io::Error::new(
                            io::ErrorKind::AddrInUse,
                            format!("{} is in use by a live listener", path.display()),
                        ));
                    }
                    std::fs::remove_file(path)?;
                }
                UnixListener::bind(path).map(Listener::Unix)
            }
            ListenAddr::Vsock(port) => VsockListener::bind(*port).map(Listener::Vsock),
        }
    }

    /// Waits for the next connection.
    pub fn accept(&self) -> io::Result<Stream> {
        match self {
            Listener::Unix(l) => l.accept().map(|(s, _)| Stream::Unix(s)),
            Listener::Vsock(l) => l.accept().map(Stream::Vsock),
        }
    }
}

impl Stream {
    fn try_clone(&self) -> io::Result<Stream> {
        match self {
            Stream::Unix(s) => s.try_clone().map(Stream::Unix),
            Stream::Vsock(s) => s.try_clone().map(Stream::Vsock),
        }
    }

    fn shutdown(&self) {
        match self {
            Stream::Unix(s) => drop(s.shutdown(std::net::Shutdown::Both)),
            Stream::Vsock(s) => s.shutdown(),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.read(buf),
            Stream::Vsock(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.write(buf),
            Stream::Vsock(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The agent: configuration plus start time.
#[derive(Debug)]
pub struct Agent {
    cfg: AgentConfig,
    started: Instant,
    /// Spawned processes (1.1), shared by every connection.
    procs: Procs,
    /// Directory watches (1.1), shared by every connection.
    watches: Watches,
    /// The volumes' relay (1.5).
    volumes: Volumes,
}

impl Agent {
    /// A new agent.
    pub fn new(cfg: AgentConfig) -> Arc<Agent> {
        Arc::new(Agent {
            procs: Procs::new(cfg.max_processes),
            cfg,
            started: Instant::now(),
            watches: Watches::default(),
            volumes: Volumes::default(),
        })
    }

    fn log(&self, msg: std::fmt::Arguments) {
        if self.cfg.verbose {
            eprintln!("torpor-agent: {msg}");
        }
    }

    /// Accepts connections forever, one thread each.
    pub fn serve(self: &Arc<Self>, listener: &Listener) -> io::Result<()> {
        loop {
            let stream = match listener.accept() {
                Ok(s) => s,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // EMFILE, ECONNABORTED…: keep serving the others.
                    self.log(format_args!("accept: {e}"));
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            };
            let agent = Arc::clone(self);
            let spawned = std::thread::Builder::new()
                .name("conn".into())
                .spawn(move || agent.serve_connection(stream));
            if let Err(e) = spawned {
                self.log(format_args!("cannot start a connection thread: {e}"));
            }
        }
    }

    /// Serves one connection until it closes. Execs still running then are
    /// killed (their whole process groups).
    pub fn serve_connection(&self, stream: Stream) {
        let writer = match stream.try_clone() {
            Ok(w) => w,
            Err(e) => return self.log(format_args!("cannot clone the connection: {e}")),
        };
        self.log(format_args!("connection opened"));
        let sink = Arc::new(Sink::new(Box::new(writer), self.cfg.max_frame));
        let running = Arc::new(Running::default());
        let mut reader = io::BufReader::new(stream);
        let why = match self.connection_loop(&mut reader, &sink, &running) {
            Err(why) => why,
            Ok(server) => {
                // No frame flows any more: what the reader had buffered
                // past the `connect` request goes to the server first.
                let buffered = reader.buffer().to_vec();
                let stream = reader.into_inner();
                return self.pipe(stream, buffered, server);
            }
        };
        self.log(format_args!("connection closed: {why}"));
        running.kill_all();
        reader.get_ref().shutdown();
    }

    /// The rest of a connection that asked for `connect`: a byte pipe.
    fn pipe(&self, stream: Stream, buffered: Vec<u8>, server: std::net::TcpStream) {
        let clones = stream
            .try_clone()
            .and_then(|r| Ok((r, stream.try_clone()?)));
        let (reader, writer) = match clones {
            Ok(c) => c,
            Err(e) => return self.log(format_args!("cannot clone the connection: {e}")),
        };
        let ends = crate::portfwd::Ends {
            from_host: io::Cursor::new(buffered).chain(reader),
            to_host: writer,
            close_host: Box::new(move || stream.shutdown()),
        };
        match crate::portfwd::splice(ends, server) {
            Ok(()) => self.log(format_args!("port pipe closed")),
            Err(e) => self.log(format_args!("port pipe closed: {e}")),
        }
    }

    /// Serves frames until the connection ends (`Err`: why) or becomes a
    /// pipe to a guest port (`Ok`: the server's connection).
    fn connection_loop(
        &self,
        reader: &mut impl Read,
        sink: &Arc<Sink>,
        running: &Arc<Running>,
    ) -> Result<std::net::TcpStream, String> {
        let mut greeted = false;
        loop {
            let frame = match read_frame(reader, self.cfg.max_frame) {
                Ok(None) => return Err("end of stream".into()),
                Ok(Some(f)) => f,
                Err(FrameError::Empty) => {
                    sink.send(None, error(libc::EBADMSG, "empty frame"));
                    continue;
                }
                Err(e @ FrameError::TooLarge { .. }) => {
                    // The stream cannot be resynchronized cheaply: say why
                    // and close.
                    sink.send(None, error(libc::EMSGSIZE, &format!("{e}; closing")));
                    return Err(e.to_string());
                }
                Err(e) => return Err(e.to_string()),
            };
            let req: Request = match serde_json::from_slice(&frame) {
                Ok(r) => r,
                Err(e) => {
                    let (id, body) = explain_bad_request(&frame, &e);
                    self.log(format_args!("bad request: {e}"));
                    sink.send(id, body);
                    continue;
                }
            };
            if !greeted {
                let Op::Hello(hello) = &req.op else {
                    let msg = "the first request must be hello; closing";
                    sink.send(Some(req.id), error(libc::EPROTO, msg));
                    return Err(msg.into());
                };
                if hello.protocol.major != PROTOCOL_VERSION.major {
                    let msg = format!(
                        "incompatible protocol {} from {:?}: this agent speaks {} (major \
                         versions must match); closing",
                        hello.protocol, hello.client, PROTOCOL_VERSION
                    );
                    sink.send(Some(req.id), error(libc::EPROTO, &msg));
                    return Err(msg);
                }
                self.log(format_args!(
                    "hello from {:?}, protocol {}",
                    hello.client, hello.protocol
                ));
                greeted = true;
                sink.send(
                    Some(req.id),
                    ReplyBody::Hello(HelloReply {
                        protocol: PROTOCOL_VERSION,
                        agent_version: AGENT_VERSION.into(),
                    }),
                );
                continue;
            }
            if let Op::Connect(connect) = &req.op {
                // The connection becomes the pipe: nothing else may still
                // answer on it.
                if !running.is_empty() || sink.streams() > 0 {
                    let msg = "connect needs a connection with no exec or attach running";
                    sink.send(Some(req.id), error(libc::EBUSY, msg));
                    continue;
                }
                match crate::portfwd::dial(connect.port) {
                    Ok(server) => {
                        if sink.send(Some(req.id), ReplyBody::Connected) {
                            return Ok(server);
                        }
                        return Err("the host went away".into());
                    }
                    Err(e) => {
                        sink.send(Some(req.id), ReplyBody::Error(e));
                        continue;
                    }
                }
            }
            if let Some(body) = self.dispatch(req.id, req.op, sink, running) {
                sink.send(Some(req.id), body);
            }
        }
    }

    /// Runs one request; `None` when the reply comes later (exec).
    fn dispatch(
        &self,
        id: u64,
        op: Op,
        sink: &Arc<Sink>,
        running: &Arc<Running>,
    ) -> Option<ReplyBody> {
        let body = match op {
            Op::Hello(_) => error(libc::EPROTO, "hello was already exchanged"),
            Op::Ping => ReplyBody::Pong,
            Op::Info => ReplyBody::Info(self.info()),
            Op::Exec(req) => {
                match exec::start(id, req, sink, running, self.cfg.max_execs_per_connection) {
                    Ok(()) => return None,
                    Err(e) => ReplyBody::Error(e),
                }
            }
            Op::ReadFile(req) => {
                files::read_file(&req).map_or_else(ReplyBody::Error, ReplyBody::FileData)
            }
            Op::WriteFile(req) => {
                files::write_file(&req).map_or_else(ReplyBody::Error, ReplyBody::Written)
            }
            Op::ListDir(req) => {
                files::list_dir(&req.path).map_or_else(ReplyBody::Error, ReplyBody::DirEntries)
            }
            Op::Stat(req) => files::stat(&req).map_or_else(ReplyBody::Error, ReplyBody::Stat),
            Op::Resumed(req) => ReplyBody::Resumed(Box::new(resumed::run(&req, &*self.cfg.ops))),
            Op::Spawn(req) => self
                .procs
                .spawn(req)
                .map_or_else(ReplyBody::Error, ReplyBody::Spawned),
            Op::Attach(req) => match self.procs.attach(id, req, sink) {
                Ok(()) => return None,
                Err(e) => ReplyBody::Error(e),
            },
            Op::Processes => ReplyBody::ProcessList(ProcessList {
                processes: self.procs.list(),
            }),
            Op::Signal(req) => done(self.procs.signal(&req)),
            Op::Input(req) => done(self.procs.input(&req)),
            Op::CloseStdin(req) => done(self.procs.close_stdin(req.pid)),
            Op::Resize(req) => done(self.procs.resize(&req)),
            Op::Mkdir(req) => files::mkdir(&req).map_or_else(ReplyBody::Error, ReplyBody::Stat),
            Op::Remove(req) => done(files::remove(&req.path)),
            Op::Rename(req) => files::rename(&req).map_or_else(ReplyBody::Error, ReplyBody::Stat),
            Op::WatchAdd(req) => self
                .watches
                .add(&req)
                .map_or_else(ReplyBody::Error, |watch_id| {
                    ReplyBody::Watch(WatchId { watch_id })
                }),
            Op::WatchEvents(req) => self
                .watches
                .events(req.watch_id)
                .map_or_else(ReplyBody::Error, ReplyBody::WatchEvents),
            Op::WatchRemove(req) => done(self.watches.remove(req.watch_id)),
            Op::SetMetadata(req) => done(crate::xattrs::set(&req)),
            Op::Statfs(req) => {
                files::statfs(&req.path).map_or_else(ReplyBody::Error, ReplyBody::Statfs)
            }
            // Answered by the connection loop, which owns the connection.
            Op::MountVolumes(req) => done(self.volumes.mount(
                &req,
                &self.cfg.volume_relay,
                &*self.cfg.ops,
            )),
            Op::Connect(_) => error(libc::EPROTO, "connect is handled by the connection"),
        };
        Some(body)
    }

    fn info(&self) -> InfoReply {
        InfoReply {
            agent_version: AGENT_VERSION.into(),
            protocol: PROTOCOL_VERSION,
            agent_uptime_ms: self.started.elapsed().as_millis() as u64,
            system_uptime_ms: system::system_uptime_ms(),
            hostname: system::hostname(),
            boot_id: system::boot_id(),
            kernel: system::kernel_release(),
        }
    }
}

fn done(r: Result<(), ErrorReply>) -> ReplyBody {
    r.map_or_else(ReplyBody::Error, |()| ReplyBody::Done)
}

fn error(errno: i32, msg: &str) -> ReplyBody {
    ReplyBody::Error(ErrorReply::new(errno, msg))
}

/// Turns a frame that is not a valid request into the most useful error:
/// not JSON (EBADMSG), no usable id or op (EINVAL), unknown op (ENOSYS),
/// or bad arguments for a known op (EINVAL).
fn explain_bad_request(frame: &[u8], err: &serde_json::Error) -> (Option<u64>, ReplyBody) {
    let Ok(serde_json::Value::Object(obj)) = serde_json::from_slice(frame) else {
        return (
            None,
            error(libc::EBADMSG, &format!("not a JSON object: {err}")),
        );
    };
    let Some(id) = obj.get("id").and_then(|v| v.as_u64()) else {
        return (
            None,
            error(libc::EINVAL, "request without a valid \"id\" (u64)"),
        );
    };
    let body = match obj.get("op").and_then(|v| v.as_str()) {
        None => error(libc::EINVAL, "request without an \"op\" string"),
        Some(op) if !KNOWN_OPS.contains(&op) => error(
            libc::ENOSYS,
            &format!(
                "unknown op {op:?} (protocol {PROTOCOL_VERSION} knows {})",
                KNOWN_OPS.join(", ")
            ),
        ),
        Some(op) => error(libc::EINVAL, &format!("bad {op} request: {err}")),
    };
    (Some(id), body)
}
