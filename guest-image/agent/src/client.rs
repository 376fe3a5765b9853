//! A small synchronous host-side client over any `Read + Write` stream (the
//! VMM's vsock connection, a unix socket in tests). One request at a time
//! through the typed calls; [`AgentClient::send`] and [`AgentClient::recv`]
//! allow several in flight (e.g. concurrent execs).
//!
//! Timeouts are the stream's business (`set_read_timeout` on sockets).

use crate::frame::{read_message, write_message, FrameError, MAX_FRAME};
use crate::proto::{
    DirListing, ErrorReply, ExecRequest, ExitReply, FileData, FileStat, Hello, HelloReply,
    InfoReply, Op, PathRequest, ReadFileRequest, Reply, ReplyBody, Request, ResumedReply,
    ResumedRequest, StatRequest, WriteFileRequest, Written, MAX_IO_CHUNK, PROTOCOL_VERSION,
};
use std::io::{Read, Write};

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
pub struct AgentClient<S> {
    stream: S,
    next_id: u64,
    max_frame: usize,
    hello: HelloReply,
}

fn unexpected(body: &ReplyBody) -> ClientError {
    let json = serde_json::to_string(body).unwrap_or_default();
    let short: String = json.chars().take(200).collect();
    ClientError::Unexpected(short)
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
            } if rid == Some(id) || rid.is_none() => Err(ClientError::Agent(e)),
            Reply {
                id: Some(rid),
                body,
            } if rid == id => Ok(body),
            other => Err(ClientError::Unexpected(format!(
                "reply for {:?} while waiting for {id}: {}",
                other.id,
                serde_json::to_string(&other.body).unwrap_or_default()
            ))),
        }
    }

    fn call(&mut self, op: Op) -> Result<ReplyBody, ClientError> {
        let id = self.send(op)?;
        self.recv_for(id)
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
    pub fn exec(
        &mut self,
        req: ExecRequest,
        mut on_output: impl FnMut(OutputKind, &[u8]),
    ) -> Result<ExitReply, ClientError> {
        let id = self.send(Op::Exec(req))?;
        loop {
            match self.recv_for(id)? {
                ReplyBody::Stdout(c) => on_output(OutputKind::Stdout, &c.data),
                ReplyBody::Stderr(c) => on_output(OutputKind::Stderr, &c.data),
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

    /// A whole file, in as many `read_file` requests as it takes.
    pub fn read_file_all(&mut self, path: &str) -> Result<Vec<u8>, ClientError> {
        let mut out = Vec::new();
        loop {
            let d = self.read_file(path, out.len() as u64, None)?;
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

    /// `resumed`: per-step results (a failed step is not an `Err`).
    pub fn resumed(&mut self, req: ResumedRequest) -> Result<ResumedReply, ClientError> {
        match self.call(Op::Resumed(req))? {
            ReplyBody::Resumed(r) => Ok(*r),
            other => Err(unexpected(&other)),
        }
    }
}
