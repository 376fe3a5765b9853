//! A small synchronous host-side client over any `Read + Write` stream (the
//! VMM's vsock connection, a unix socket in tests). One request at a time
//! through the typed calls; [`AgentClient::send`] and [`AgentClient::recv`]
//! allow several in flight (e.g. concurrent execs).
//!
//! The host does not trust the guest: an exec's output past its
//! `max_output_bytes` (the agent's own cap) and file data past the caller's
//! limit fail the call instead of growing without bound, file reads count
//! the bytes received rather than the size the agent claims, and guest
//! text that ends up in an error is cut to [`MAX_GUEST_TEXT`] bytes.
//! Timeouts are the stream's business (`set_read_timeout` on sockets; the
//! service wraps its stream with an overall deadline).

use crate::frame::{read_message, write_message, FrameError, MAX_FRAME};
use crate::proto::{
    AttachRequest, InputRequest, MkdirRequest, MountVolumesRequest, PidRequest, ProcessInfo,
    RenameRequest, ResizeRequest, SignalRequest, SpawnRequest, VolumeMount, WatchAddRequest,
    WatchEvents, WatchIdRequest,
};
use crate::proto::{
    DirListing, ErrorReply, ExecRequest, ExitReply, FileData, FileStat, FsStats, Hello, HelloReply,
    InfoReply, Op, PathRequest, ReadFileRequest, Reply, ReplyBody, Request, ResumedReply,
    ResumedRequest, StatRequest, WriteFileRequest, Written, MAX_IO_CHUNK, PROTOCOL_VERSION,
};
use std::io::{Read, Write};

/// Opens guest port `port` through a VMM's hybrid vsock socket `uds`
/// (Firecracker's protocol: send `CONNECT <port>\n`, read `OK <n>\n`).
/// The answer is read a byte at a time, so nothing the agent sends right
/// after it is consumed; a line past 64 bytes or anything but `OK` is
/// refused. Reads and writes wait at most `limit` each, and the stream is
/// returned with those timeouts still set (the caller sets its own).
pub fn connect_vsock(
    uds: &std::path::Path,
    port: u32,
    limit: std::time::Duration,
) -> std::io::Result<std::os::unix::net::UnixStream> {
    let mut stream = std::os::unix::net::UnixStream::connect(uds)?;
    stream.set_read_timeout(Some(limit))?;
    stream.set_write_timeout(Some(limit))?;
    stream.write_all(format!("CONNECT {port}\n").as_bytes())?;
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while line.len() < 64 {
        if stream.read(&mut byte)? == 0 || byte[0] == b'\n' {
            break;
        }
        line.push(byte[0]);
    }
    if !line.starts_with(b"OK ") {
        return Err(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            format!(
                "the guest refused vsock port {port}: {:?}",
                guest_text(&String::from_utf8_lossy(&line))
            ),
        ));
    }
    Ok(stream)
}

/// Longest guest-supplied text kept in an error.
pub const MAX_GUEST_TEXT: usize = 256;

/// The output cap of an exec that names none (the agent's default).
pub const DEFAULT_MAX_OUTPUT: u64 = 16 << 20;

/// `text` cut to at most [`MAX_GUEST_TEXT`] bytes (at a character
/// boundary), marked when cut.
pub fn guest_text(text: &str) -> String {
    if text.len() <= MAX_GUEST_TEXT {
        return text.to_string();
    }
    let mut end = MAX_GUEST_TEXT;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes)", &text[..end], text.len())
}

/// Why a client call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Framing or I/O failed (including a read timeout).
    #[error("agent connection: {0}")]
    Frame(#[from] FrameError),
    /// The agent closed the connection.
    #[error("the agent closed the connection")]
    Closed,
    /// The agent answered with an error.
    #[error("agent error {0}")]
    Agent(ErrorReply),
    /// The agent speaks another major protocol version.
    #[error("agent speaks protocol {agent}, this client {client}")]
    Incompatible {
        /// The agent's version.
        agent: String,
        /// Ours.
        client: String,
    },
    /// A reply that does not fit the request.
    #[error("unexpected reply: {0}")]
    Unexpected(String),
    /// The agent sent more exec output than the request's cap allows.
    #[error("the agent sent more than the {cap} bytes of output the exec allows")]
    OutputOverflow {
        /// The request's `max_output_bytes`.
        cap: u64,
    },
    /// A file larger than the caller accepts: the agent said so, or sent
    /// more bytes than that.
    #[error("{path} is {size} bytes, more than the {limit} accepted")]
    TooMuchData {
        /// The file.
        path: String,
        /// The larger of the size the agent claims and the bytes received.
        size: u64,
        /// The caller's limit.
        limit: u64,
    },
}

/// Which output stream a chunk came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputKind {
    /// stdout.
    Stdout,
    /// stderr.
    Stderr,
}

/// An exec's collected output.
#[derive(Debug, Clone, PartialEq)]
pub struct ExecOutput {
    /// All stdout chunks.
    pub stdout: Vec<u8>,
    /// All stderr chunks.
    pub stderr: Vec<u8>,
    /// How it ended.
    pub exit: ExitReply,
}

/// A connected, greeted agent.
#[derive(Debug)]
pub struct AgentClient<S> {
    stream: S,
    next_id: u64,
    max_frame: usize,
    hello: HelloReply,
}

fn unexpected(body: &ReplyBody) -> ClientError {
    ClientError::Unexpected(guest_text(&serde_json::to_string(body).unwrap_or_default()))
}

/// An agent's error with its text cut to size.
fn agent_error(e: ErrorReply) -> ClientError {
    ClientError::Agent(ErrorReply {
        code: guest_text(&e.code),
        errno: e.errno,
        message: guest_text(&e.message),
    })
}

impl<S: Read + Write> AgentClient<S> {
    /// Says hello (as `client_name`) and checks the agent's version.
    pub fn connect(stream: S, client_name: &str) -> Result<Self, ClientError> {
        let mut c = AgentClient {
            stream,
            next_id: 0,
            max_frame: MAX_FRAME,
            hello: HelloReply {
                protocol: PROTOCOL_VERSION,
                agent_version: String::new(),
            },
        };
        let hello = Op::Hello(Hello {
            protocol: PROTOCOL_VERSION,
            client: client_name.into(),
        });
        match c.call(hello)? {
            ReplyBody::Hello(h) if h.protocol.major == PROTOCOL_VERSION.major => c.hello = h,
            ReplyBody::Hello(h) => {
                return Err(ClientError::Incompatible {
                    agent: h.protocol.to_string(),
                    client: PROTOCOL_VERSION.to_string(),
                })
            }
            other => return Err(unexpected(&other)),
        }
        Ok(c)
    }

    /// The agent's hello.
    pub fn agent(&self) -> &HelloReply {
        &self.hello
    }

    /// The stream (e.g. to change its timeouts).
    pub fn stream_mut(&mut self) -> &mut S {
        &mut self.stream
    }

    /// Sends a request without waiting; returns its id.
    pub fn send(&mut self, op: Op) -> Result<u64, ClientError> {
        let id = self.next_id;
        self.next_id += 1;
        write_message(&mut self.stream, &Request { id, op }, self.max_frame)?;
        Ok(id)
    }

    /// Receives the next reply frame, whatever request it belongs to.
    pub fn recv(&mut self) -> Result<Reply, ClientError> {
        read_message(&mut self.stream, self.max_frame)?.ok_or(ClientError::Closed)
    }

    /// The next reply, which must belong to `id`; agent errors become `Err`.
    fn recv_for(&mut self, id: u64) -> Result<ReplyBody, ClientError> {
        let reply = self.recv()?;
        match reply {
            Reply {
                body: ReplyBody::Error(e),
                id: rid,
            } if rid == Some(id) || rid.is_none() => Err(agent_error(e)),
            Reply {
                id: Some(rid),
                body,
            } if rid == id => Ok(body),
            other => Err(ClientError::Unexpected(format!(
                "reply for {:?} while waiting for {id}: {}",
                other.id,
                guest_text(&serde_json::to_string(&other.body).unwrap_or_default())
            ))),
        }
    }

    fn call(&mut self, op: Op) -> Result<ReplyBody, ClientError> {
        let id = self.send(op)?;
        self.recv_for(id)
    }

    /// `connect` (1.3): the connection becomes a byte pipe to TCP `port`
    /// on the guest's loopback; the stream is handed back for it. A
    /// closed port is `ClientError::Agent` with `ECONNREFUSED` (the
    /// connection then still speaks the protocol, but is dropped here);
    /// an agent before 1.3 answers `ENOSYS`.
    pub fn connect_port(mut self, port: u16) -> Result<S, ClientError> {
        match self.call(Op::Connect(crate::proto::ConnectRequest { port }))? {
            ReplyBody::Connected => Ok(self.stream),
            other => Err(unexpected(&other)),
        }
    }

    /// `ping`.
    pub fn ping(&mut self) -> Result<(), ClientError> {
        match self.call(Op::Ping)? {
            ReplyBody::Pong => Ok(()),
            other => Err(unexpected(&other)),
        }
    }

    /// `info`.
    pub fn info(&mut self) -> Result<InfoReply, ClientError> {
        match self.call(Op::Info)? {
            ReplyBody::Info(i) => Ok(i),
            other => Err(unexpected(&other)),
        }
    }

    /// `exec`, handing each output chunk to `on_output` as it arrives.
    /// More output than the request's `max_output_bytes` (default
    /// [`DEFAULT_MAX_OUTPUT`]) is an error: the agent drops what is past
    /// it, so only a misbehaving guest sends it.
    pub fn exec(
        &mut self,
        req: ExecRequest,
        mut on_output: impl FnMut(OutputKind, &[u8]),
    ) -> Result<ExitReply, ClientError> {
        let cap = req.max_output_bytes.unwrap_or(DEFAULT_MAX_OUTPUT);
        let mut received = 0u64;
        let id = self.send(Op::Exec(req))?;
        let mut count = |len: usize| {
            received = received.saturating_add(len as u64);
            if received > cap {
                Err(ClientError::OutputOverflow { cap })
            } else {
                Ok(())
            }
        };
        loop {
            match self.recv_for(id)? {
                ReplyBody::Stdout(c) => {
                    count(c.data.len())?;
                    on_output(OutputKind::Stdout, &c.data)
                }
                ReplyBody::Stderr(c) => {
                    count(c.data.len())?;
                    on_output(OutputKind::Stderr, &c.data)
                }
                ReplyBody::Exit(e) => return Ok(e),
                other => return Err(unexpected(&other)),
            }
        }
    }

    /// `exec`, collecting the output.
    pub fn exec_collect(&mut self, req: ExecRequest) -> Result<ExecOutput, ClientError> {
        let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
        let exit = self.exec(req, |kind, data| match kind {
            OutputKind::Stdout => stdout.extend_from_slice(data),
            OutputKind::Stderr => stderr.extend_from_slice(data),
        })?;
        Ok(ExecOutput {
            stdout,
            stderr,
            exit,
        })
    }

    /// One `read_file` request.
    pub fn read_file(
        &mut self,
        path: &str,
        offset: u64,
        max_bytes: Option<u64>,
    ) -> Result<FileData, ClientError> {
        let op = Op::ReadFile(ReadFileRequest {
            path: path.into(),
            offset,
            max_bytes,
        });
        match self.call(op)? {
            ReplyBody::FileData(d) => Ok(d),
            other => Err(unexpected(&other)),
        }
    }

    /// A whole file, in as many `read_file` requests as it takes, refused
    /// once the agent says it is larger than `limit` or more than `limit`
    /// bytes have arrived (the bytes received count, whatever size the
    /// agent claims; each request asks for no more than is left).
    pub fn read_file_all(&mut self, path: &str, limit: u64) -> Result<Vec<u8>, ClientError> {
        let mut out = Vec::new();
        loop {
            let got = out.len() as u64;
            let ask = (limit - got).saturating_add(1).min(MAX_IO_CHUNK as u64);
            let d = self.read_file(path, got, Some(ask))?;
            let received = got.saturating_add(d.data.len() as u64);
            if received > limit || d.size > limit {
                return Err(ClientError::TooMuchData {
                    path: guest_text(path),
                    size: received.max(d.size),
                    limit,
                });
            }
            let empty = d.data.is_empty();
            out.extend_from_slice(&d.data);
            if d.eof || empty {
                return Ok(out);
            }
        }
    }

    /// One `write_file` request (at most [`MAX_IO_CHUNK`] bytes).
    pub fn write_file(&mut self, req: WriteFileRequest) -> Result<Written, ClientError> {
        match self.call(Op::WriteFile(req))? {
            ReplyBody::Written(w) => Ok(w),
            other => Err(unexpected(&other)),
        }
    }

    /// Writes (truncates) a file of any size, in chunks; `mode` as in
    /// [`WriteFileRequest::mode`]. Returns the final size.
    pub fn write_file_all(
        &mut self,
        path: &str,
        data: &[u8],
        mode: Option<u32>,
        create_parents: bool,
    ) -> Result<u64, ClientError> {
        self.write_file_all_as(path, data, mode, create_parents, None)
    }

    /// [`Self::write_file_all`] whose file (and the parents it creates) go
    /// to `owner` (1.4).
    pub fn write_file_all_as(
        &mut self,
        path: &str,
        data: &[u8],
        mode: Option<u32>,
        create_parents: bool,
        owner: Option<&str>,
    ) -> Result<u64, ClientError> {
        let mut size = 0;
        let mut chunks: Vec<&[u8]> = data.chunks(MAX_IO_CHUNK).collect();
        if chunks.is_empty() {
            chunks.push(&[]);
        }
        for (i, chunk) in chunks.into_iter().enumerate() {
            size = self
                .write_file(WriteFileRequest {
                    path: path.into(),
                    data: chunk.to_vec(),
                    mode,
                    create_parents,
                    append: i > 0,
                    owner: owner.map(str::to_string),
                })?
                .size;
        }
        Ok(size)
    }

    /// `list_dir`.
    pub fn list_dir(&mut self, path: &str) -> Result<DirListing, ClientError> {
        match self.call(Op::ListDir(PathRequest { path: path.into() }))? {
            ReplyBody::DirEntries(l) => Ok(l),
            other => Err(unexpected(&other)),
        }
    }

    /// `stat` (following symlinks when `follow_symlinks`).
    pub fn stat(&mut self, path: &str, follow_symlinks: bool) -> Result<FileStat, ClientError> {
        let op = Op::Stat(StatRequest {
            path: path.into(),
            follow_symlinks,
        });
        match self.call(op)? {
            ReplyBody::Stat(s) => Ok(s),
            other => Err(unexpected(&other)),
        }
    }

    /// `statfs` (1.4): the size and free space of the filesystem `path`
    /// is on. An agent before 1.4 answers `ENOSYS` (`ClientError::Agent`).
    /// The numbers are the guest's: a host must not trust them.
    pub fn statfs(&mut self, path: &str) -> Result<FsStats, ClientError> {
        match self.call(Op::Statfs(PathRequest { path: path.into() }))? {
            ReplyBody::Statfs(s) => Ok(s),
            other => Err(unexpected(&other)),
        }
    }

    /// `mount_volumes` (1.5): mounts each volume over NFS from the host
    /// (`crate::volumes`); volumes already mounted at their paths are
    /// left. An agent before 1.5 answers `ENOSYS`.
    pub fn mount_volumes(&mut self, mounts: Vec<VolumeMount>) -> Result<(), ClientError> {
        match self.call(Op::MountVolumes(MountVolumesRequest { mounts }))? {
            ReplyBody::Done => Ok(()),
            other => Err(unexpected(&other)),
        }
    }

    /// `resumed`: per-step results (a failed step is not an `Err`).
    pub fn resumed(&mut self, req: ResumedRequest) -> Result<ResumedReply, ClientError> {
        match self.call(Op::Resumed(req))? {
            ReplyBody::Resumed(r) => Ok(*r),
            other => Err(unexpected(&other)),
        }
    }

    fn expect_done(&mut self, op: Op) -> Result<(), ClientError> {
        match self.call(op)? {
            ReplyBody::Done => Ok(()),
            other => Err(unexpected(&other)),
        }
    }

    fn expect_stat(&mut self, op: Op) -> Result<FileStat, ClientError> {
        match self.call(op)? {
            ReplyBody::Stat(s) => Ok(s),
            other => Err(unexpected(&other)),
        }
    }

    /// `spawn` (1.1): the new process's pid.
    pub fn spawn(&mut self, req: SpawnRequest) -> Result<u32, ClientError> {
        match self.call(Op::Spawn(req))? {
            ReplyBody::Spawned(s) => Ok(s.pid),
            other => Err(unexpected(&other)),
        }
    }

    /// `attach` (1.1): hands every event to `on_event` until the process
    /// exits (`Ok(exit)`) or `on_event` answers `false` (`Ok(None)`: the
    /// caller gives up; drop the connection, the process goes on).
    pub fn attach(
        &mut self,
        req: AttachRequest,
        mut on_event: impl FnMut(AttachEvent<'_>) -> bool,
    ) -> Result<Option<ExitReply>, ClientError> {
        let id = self.send(Op::Attach(req))?;
        loop {
            let event = match self.recv_for(id)? {
                ReplyBody::Exit(e) => return Ok(Some(e)),
                ReplyBody::Stdout(c) => on_event(AttachEvent::Output(OutputKind::Stdout, &c.data)),
                ReplyBody::Stderr(c) => on_event(AttachEvent::Output(OutputKind::Stderr, &c.data)),
                ReplyBody::Pty(c) => on_event(AttachEvent::Pty(&c.data)),
                ReplyBody::Keepalive => on_event(AttachEvent::Keepalive),
                other => return Err(unexpected(&other)),
            };
            if !event {
                return Ok(None);
            }
        }
    }

    /// `processes` (1.1).
    pub fn processes(&mut self) -> Result<Vec<ProcessInfo>, ClientError> {
        match self.call(Op::Processes)? {
            ReplyBody::ProcessList(l) => Ok(l.processes),
            other => Err(unexpected(&other)),
        }
    }

    /// `signal` (1.1).
    pub fn signal(&mut self, pid: u32, signal: i32) -> Result<(), ClientError> {
        self.expect_done(Op::Signal(SignalRequest { pid, signal }))
    }

    /// `input` (1.1).
    pub fn input(&mut self, pid: u32, data: &[u8]) -> Result<(), ClientError> {
        self.expect_done(Op::Input(InputRequest {
            pid,
            data: data.to_vec(),
        }))
    }

    /// `close_stdin` (1.1).
    pub fn close_stdin(&mut self, pid: u32) -> Result<(), ClientError> {
        self.expect_done(Op::CloseStdin(PidRequest { pid }))
    }

    /// `resize` (1.1).
    pub fn resize(&mut self, pid: u32, cols: u16, rows: u16) -> Result<(), ClientError> {
        self.expect_done(Op::Resize(ResizeRequest { pid, cols, rows }))
    }

    /// `mkdir` (1.1): the new directory.
    pub fn mkdir(&mut self, path: &str, parents: bool) -> Result<FileStat, ClientError> {
        self.mkdir_as(path, parents, None)
    }

    /// `mkdir` (1.1) whose new directories go to `owner`.
    pub fn mkdir_as(
        &mut self,
        path: &str,
        parents: bool,
        owner: Option<&str>,
    ) -> Result<FileStat, ClientError> {
        self.expect_stat(Op::Mkdir(MkdirRequest {
            path: path.into(),
            parents,
            owner: owner.map(str::to_string),
        }))
    }

    /// `remove` (1.1).
    pub fn remove(&mut self, path: &str) -> Result<(), ClientError> {
        self.expect_done(Op::Remove(PathRequest { path: path.into() }))
    }

    /// `rename` (1.1): the destination.
    pub fn rename(&mut self, from: &str, to: &str) -> Result<FileStat, ClientError> {
        self.expect_stat(Op::Rename(RenameRequest {
            from: from.into(),
            to: to.into(),
        }))
    }

    /// `watch_add` (1.1): the watch's id.
    pub fn watch_add(&mut self, path: &str, recursive: bool) -> Result<u64, ClientError> {
        self.watch_add_with(WatchAddRequest {
            path: path.into(),
            recursive,
            include_entry: false,
            allow_network_mounts: false,
        })
    }

    /// `watch_add` with every option (1.2: `include_entry`, events carry
    /// their path's stat; 1.4: `allow_network_mounts`).
    pub fn watch_add_with(&mut self, req: WatchAddRequest) -> Result<u64, ClientError> {
        let op = Op::WatchAdd(req);
        match self.call(op)? {
            ReplyBody::Watch(w) => Ok(w.watch_id),
            other => Err(unexpected(&other)),
        }
    }

    /// `watch_events` (1.1).
    pub fn watch_events(&mut self, watch_id: u64) -> Result<WatchEvents, ClientError> {
        match self.call(Op::WatchEvents(WatchIdRequest { watch_id }))? {
            ReplyBody::WatchEvents(e) => Ok(e),
            other => Err(unexpected(&other)),
        }
    }

    /// `watch_remove` (1.1).
    pub fn watch_remove(&mut self, watch_id: u64) -> Result<(), ClientError> {
        self.expect_done(Op::WatchRemove(WatchIdRequest { watch_id }))
    }

    /// 1.2: replace `path`'s user metadata with `metadata` (empty clears it).
    pub fn set_metadata(
        &mut self,
        path: &str,
        metadata: std::collections::BTreeMap<String, String>,
    ) -> Result<(), ClientError> {
        self.expect_done(Op::SetMetadata(crate::proto::SetMetadataRequest {
            path: path.into(),
            metadata,
        }))
    }
}

/// What an attach hears.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttachEvent<'a> {
    /// Pipe output.
    Output(OutputKind, &'a [u8]),
    /// PTY output.
    Pty(&'a [u8]),
    /// Nothing happened for a keepalive interval.
    Keepalive,
}
