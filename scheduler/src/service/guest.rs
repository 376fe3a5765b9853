//! Guest access: exec and files in a sandbox's Linux guest through
//! torpor-agent, and the agent's `resumed` hook after every restore.
//!
//! The host reaches the agent over the VMM's hybrid vsock socket
//! (`<sandbox dir>/vsock.sock`): connect, send `CONNECT <port>\n`, read
//! `OK <host port>\n`, then speak the agent protocol ([`AgentLink`]). One
//! connection per request, so concurrent requests on one sandbox never
//! share a stream. Every request first wakes a hibernated sandbox
//! (`ensure_running`) and says whether it did ([`GuestCall`]).

use std::io;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use torpor_agent::client::{connect_vsock, guest_text};
pub use torpor_agent::proto::{
    DirListing, ErrorReply, ExecRequest, ExitReply, FileKind, FileStat, FsStats, ResumedReply,
};
use torpor_agent::proto::{ResumedRequest, Step, StepStatus};
use torpor_agent::{AgentClient, ClientError, FrameError, DEFAULT_VSOCK_PORT};
pub use torpor_agent::{ExecOutput, OutputKind};

#[path = "guest_stream.rs"]
mod stream;
pub use stream::{Check, GuestStream};

use super::{Cancel, Outcome, Service, ServiceError};
use crate::model::{SandboxId, TemplateKind, Timestamp};

/// The hybrid vsock socket's name in a sandbox or template directory.
pub const VSOCK_FILE: &str = "vsock.sock";
/// Longest wait for the `CONNECT` answer and the agent's hello.
const HANDSHAKE_LIMIT: Duration = Duration::from_secs(10);
/// The agent's own wait for a guest server's TCP handshake (its
/// `portfwd`), and a little more.
const PORT_CONNECT_LIMIT: Duration = Duration::from_secs(11);
/// Longest a file request (read, write, list) may take in all, however
/// the guest paces its answer.
const FILE_LIMIT: Duration = Duration::from_secs(60);
/// How long past its own timeout an exec's answer may take.
const EXEC_SLACK: Duration = Duration::from_secs(30);
/// How long an exec's connection may stay silent before the guest is
/// asked whether it still answers, and how long it has to answer.
pub const LIVENESS_EVERY: Duration = Duration::from_secs(30);
/// How long after a restore the agent may take to accept again.
const AGENT_WAIT: Duration = Duration::from_secs(60);
/// Largest file `read_file` returns whole.
pub const MAX_READ_BYTES: u64 = 64 << 20;
/// How often a sandbox with a guest request in flight is marked active.
const ACTIVE_TICK: Duration = Duration::from_secs(1);
/// The agent connection's client name, in its logs.
const CLIENT_NAME: &str = "torpor-service";

/// Why a guest request failed.
#[derive(Debug, thiserror::Error)]
pub enum GuestError {
    /// The sandbox's template has no agent (probe guests).
    #[error(
        "sandbox {id} runs a {kind} template, which has no guest agent: exec, files and \
         volumes need a sandbox of a Linux template"
    )]
    NoAgent { id: String, kind: TemplateKind },
    /// No connection to the agent, or it broke (guest gone, agent dead).
    #[error("the guest agent of sandbox {id} is unreachable: {reason}")]
    Unreachable { id: String, reason: String },
    /// The agent answered with an error (`error.code` is an errno name).
    #[error("in sandbox {id}: {error}")]
    Agent { id: String, error: ErrorReply },
    /// A file too large to return in one answer.
    #[error(
        "{path} in sandbox {id} is {size} bytes, more than the {limit} bytes one read returns"
    )]
    TooLarge {
        id: String,
        path: String,
        size: u64,
        limit: u64,
    },
    /// The request's deadline passed before the agent finished answering.
    #[error("the guest agent of sandbox {id} did not answer within {limit:?}")]
    Deadline { id: String, limit: Duration },
    /// The agent broke the protocol (more output than the cap, garbage or
    /// oversized frames, answers to other requests): this request fails,
    /// the guest's text in `reason` cut short.
    #[error("the guest agent of sandbox {id} misbehaved: {reason}")]
    Misbehaved { id: String, reason: String },
    /// The post-restore hook did not set the clock, entropy or identity.
    #[error("the guest agent's post-restore hook failed in sandbox {id}: {detail}")]
    ResumeHook { id: String, detail: String },
}

impl GuestError {
    /// Whether the agent does not know the operation (`ENOSYS`: an agent
    /// older than the protocol version that added it).
    pub fn is_unsupported(&self) -> bool {
        matches!(self, GuestError::Agent { error, .. } if error.code == "ENOSYS")
    }

    /// Whether this is the agent saying nothing listens on the port a
    /// `connect` asked for (E2B's "port is not open").
    pub fn is_port_closed(&self) -> bool {
        matches!(self, GuestError::Agent { error, .. } if error.code == "ECONNREFUSED")
    }
}

/// A guest request's answer, and whether answering it woke the sandbox.
#[derive(Debug, Clone)]
pub struct GuestCall<T> {
    pub outcome: Outcome,
    pub value: T,
}

/// Opens a byte stream to a guest's agent port, past any handshake of
/// the way there: the API server's tunnel through the pod that runs the
/// sandbox (`POST /v1/sandboxes/{id}/agent`).
pub type Dialer = Arc<dyn Fn() -> io::Result<UnixStream> + Send + Sync>;

/// How an [`AgentLink`] reaches its agent.
#[derive(Clone)]
enum Route {
    /// The VMM's hybrid vsock socket on this host.
    Vsock(PathBuf),
    /// A [`Dialer`], and what it reaches (for messages).
    Dial { what: String, dial: Dialer },
}

impl std::fmt::Debug for Route {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Route::Vsock(uds) => f.debug_tuple("Vsock").field(uds).finish(),
            Route::Dial { what, .. } => f.debug_tuple("Dial").field(what).finish(),
        }
    }
}

/// The agent of one guest, reached through its hybrid vsock socket (or
/// a [`Dialer`]).
#[derive(Debug, Clone)]
pub struct AgentLink {
    /// The sandbox (or template) id, for messages.
    pub id: String,
    route: Route,
    pub port: u32,
    /// Overall deadline of a file request (read, write, list, the
    /// post-restore hook), handshake included.
    pub file_limit: Duration,
    /// How long past its own timeout an exec may take in all.
    pub exec_slack: Duration,
    /// Leave an unreachable agent unlogged (the caller logs it its own
    /// way: the history sampler, at most once a minute per sandbox).
    pub quiet: bool,
    /// How long an exec may hear nothing before the guest is asked, on a
    /// connection of its own, whether it still answers; the answer must
    /// come within the same time. A guest that stopped fails the exec
    /// within twice this, not at the exec's timeout.
    pub liveness: Duration,
}

impl AgentLink {
    pub fn new(id: impl Into<String>, uds: PathBuf) -> Self {
        AgentLink {
            id: id.into(),
            route: Route::Vsock(uds),
            port: DEFAULT_VSOCK_PORT,
            file_limit: FILE_LIMIT,
            exec_slack: EXEC_SLACK,
            quiet: false,
            liveness: LIVENESS_EVERY,
        }
    }

    /// An agent reached through `dial` (`what` names the way, for
    /// messages).
    pub fn dialed(id: impl Into<String>, what: impl Into<String>, dial: Dialer) -> Self {
        AgentLink {
            route: Route::Dial {
                what: what.into(),
                dial,
            },
            ..AgentLink::new(id, PathBuf::new())
        }
    }

    /// A raw stream to the agent's port, before the agent protocol's
    /// greeting (the pod's end of a tunnel: the far side greets).
    pub fn connect_raw(&self) -> Result<UnixStream, GuestError> {
        self.connect_raw_within(HANDSHAKE_LIMIT)
    }

    /// [`Self::connect_raw`], each read and write of the vsock handshake
    /// waiting at most `limit`.
    fn connect_raw_within(&self, limit: Duration) -> Result<UnixStream, GuestError> {
        match &self.route {
            // The socket's path is the host's: logged, never in the error,
            // which reaches API clients.
            Route::Vsock(uds) => connect_vsock(uds, self.port, limit).map_err(|e| {
                tracing::debug!(sandbox = %self.id, socket = %uds.display(), error = %e, "agent connect");
                if !self.quiet {
                    log_unreachable(&self.id, uds, &e, &REFUSED_LOGGED);
                }
                // A refusal by a VMM whose guest shut down says so.
                self.unreachable(format!("its vsock: {e}{}", self.guest_end()))
            }),
            Route::Dial { what, dial } => {
                dial().map_err(|e| self.unreachable(format!("{what}: {e}")))
            }
        }
    }

    fn unreachable(&self, reason: impl std::fmt::Display) -> GuestError {
        GuestError::Unreachable {
            id: self.id.clone(),
            reason: reason.to_string(),
        }
    }

    fn client_error(&self, e: ClientError, limit: Option<Duration>) -> GuestError {
        let id = self.id.clone();
        match e {
            ClientError::Agent(error) => GuestError::Agent { id, error },
            ClientError::TooMuchData { path, size, limit } => GuestError::TooLarge {
                id,
                path,
                size,
                limit,
            },
            ClientError::Frame(FrameError::Io(e)) if e.kind() == io::ErrorKind::TimedOut => {
                GuestError::Deadline {
                    id,
                    limit: limit.unwrap_or_default(),
                }
            }
            e @ (ClientError::OutputOverflow { .. }
            | ClientError::Unexpected(_)
            | ClientError::Frame(
                FrameError::TooLarge { .. } | FrameError::Empty | FrameError::Json(_),
            )) => GuestError::Misbehaved {
                id,
                reason: guest_text(&e.to_string()),
            },
            other => {
                // A connection the agent dropped after the handshake: the
                // guest's console and the VMM's log say why, if anything,
                // and the error says so when the guest shut down.
                self.log_dropped(&other.to_string());
                self.unreachable(format!("{other}{}", self.guest_end()))
            }
        }
    }

    /// One greeted connection under an overall deadline `limit` from now
    /// (`None`: no deadline, for execs without a timeout), handshake
    /// included.
    pub fn connect(&self, limit: Option<Duration>) -> Result<AgentClient<GuestStream>, GuestError> {
        self.connect_cancellable(limit, &Cancel::default())
    }

    /// [`AgentLink::connect`], the connection attached to `cancel`:
    /// cancelling shuts it down (the agent then kills what runs on it).
    pub fn connect_cancellable(
        &self,
        limit: Option<Duration>,
        cancel: &Cancel,
    ) -> Result<AgentClient<GuestStream>, GuestError> {
        let deadline = limit.map(|l| Instant::now() + l);
        // The handshake is part of the deadline too: a short one (a
        // sample's `statfs`) must not wait the whole handshake limit.
        let stream = self.connect_raw_within(limit.map_or(HANDSHAKE_LIMIT, |l| {
            l.min(HANDSHAKE_LIMIT).max(Duration::from_millis(1))
        }))?;
        cancel.attach(&stream).map_err(|e| self.unreachable(e))?;
        AgentClient::connect(GuestStream::new(stream, deadline), CLIENT_NAME)
            .map_err(|e| self.client_error(e, limit))
    }

    /// [`Self::connect_cancellable`] for an exec: its reads check that
    /// the guest still answers after each [`AgentLink::liveness`] of
    /// silence ([`GuestStream::check_liveness`]).
    fn connect_exec(
        &self,
        limit: Option<Duration>,
        cancel: &Cancel,
    ) -> Result<AgentClient<GuestStream>, GuestError> {
        let every = self.liveness;
        let link = self.clone();
        let check: Check = Box::new(move || {
            link.connect(Some(every)).map(drop).map_err(|e| match e {
                GuestError::Deadline { .. } => format!("no greeting within {every:?}"),
                GuestError::Unreachable { reason, .. } => reason,
                other => other.to_string(),
            })
        });
        let mut client = self.connect_cancellable(limit, cancel)?;
        client.stream_mut().check_liveness(every, check);
        Ok(client)
    }

    /// A greeted connection for a long stream (an attach, a watch): no
    /// overall deadline, but each read or write waits at most `idle` (the
    /// agent's keepalives must arrive sooner), handshake included.
    pub fn connect_idle(&self, idle: Duration) -> Result<AgentClient<GuestStream>, GuestError> {
        let stream = self.connect_raw()?;
        let mut stream = GuestStream::new(stream, None);
        stream.idle = Some(idle);
        AgentClient::connect(stream, CLIENT_NAME).map_err(|e| self.client_error(e, Some(idle)))
    }

    /// A byte pipe to TCP `port` on the guest's loopback (the agent's
    /// `connect`, protocol 1.3): greeting and `connect` within
    /// [`HANDSHAKE_LIMIT`] plus the agent's own wait for the guest's TCP
    /// handshake; then no deadline. Nothing listening is
    /// `GuestError::Agent` with `ECONNREFUSED` ([`GuestError::is_port_closed`]).
    pub fn dial_port(&self, port: u16) -> Result<UnixStream, GuestError> {
        let limit = HANDSHAKE_LIMIT + PORT_CONNECT_LIMIT;
        let stream = self.connect_raw()?;
        let client = AgentClient::connect(
            GuestStream::new(stream, Some(Instant::now() + limit)),
            CLIENT_NAME,
        )
        .map_err(|e| self.client_error(e, Some(limit)))?;
        let piped = client
            .connect_port(port)
            .map_err(|e| self.client_error(e, Some(limit)))?;
        piped.into_inner().map_err(|e| self.unreachable(e))
    }

    /// What the VMM's log says ended the guest (`"; the guest shut down
    /// ..."`), or `""`: nothing, or a dialed link (its far end knows).
    pub fn guest_end(&self) -> &'static str {
        match &self.route {
            Route::Vsock(uds) => uds.parent().map_or("", |dir| {
                super::linux::guest_end(&super::vmm::VmmFiles::in_dir(dir))
            }),
            Route::Dial { .. } => "",
        }
    }

    /// Tells the operator that the agent dropped a connection it had
    /// accepted (`why`), with what the guest's console and the VMM's log
    /// said last (rate-limited; nothing for a quiet link or a dialed one,
    /// whose far end logs).
    pub fn log_dropped(&self, why: &str) {
        if let (Route::Vsock(uds), false) = (&self.route, self.quiet) {
            log_unreachable(&self.id, uds, &why, &CLOSED_LOGGED);
        }
    }

    /// Maps a client error of a call on a connection from [`Self::connect`]
    /// or [`Self::connect_idle`] (`limit`: its deadline, for the message).
    pub fn error(&self, e: ClientError, limit: Option<Duration>) -> GuestError {
        self.client_error(e, limit)
    }

    /// Connects, retrying until `wait` has passed (a guest still booting,
    /// or re-accepting after a restore), or until `alive` says the VM is
    /// gone.
    pub fn connect_waiting(
        &self,
        wait: Duration,
        mut alive: impl FnMut() -> Result<(), String>,
    ) -> Result<AgentClient<GuestStream>, GuestError> {
        let deadline = Instant::now() + wait;
        loop {
            match self.connect(Some(self.file_limit)) {
                Ok(c) => return Ok(c),
                Err(GuestError::Unreachable { reason, .. }) => {
                    alive().map_err(|why| self.unreachable(why))?;
                    if Instant::now() >= deadline {
                        return Err(
                            self.unreachable(format!("no answer within {wait:?} (last: {reason})"))
                        );
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(other) => return Err(other),
            }
        }
    }

    /// An exec's deadline: its own timeout plus slack, else none.
    fn exec_limit(&self, req: &ExecRequest) -> Option<Duration> {
        req.timeout_ms
            .filter(|&t| t > 0)
            .map(|t| Duration::from_millis(t) + self.exec_slack)
    }

    /// Runs a command, collecting its output (at most the request's
    /// `max_output_bytes`: a guest that sends more fails the request).
    /// `cancel` ends it early: the agent kills the command's process group.
    pub fn exec(&self, req: ExecRequest, cancel: &Cancel) -> Result<ExecOutput, GuestError> {
        let limit = self.exec_limit(&req);
        let mut client = self.connect_exec(limit, cancel)?;
        let out = client
            .exec_collect(req)
            .map_err(|e| self.exec_error(e, limit, cancel));
        cancel.detach();
        out
    }

    /// Runs a command, handing each output chunk to `on_output` as the
    /// agent streams it; `cancel` as for [`AgentLink::exec`].
    pub fn exec_streaming(
        &self,
        req: ExecRequest,
        cancel: &Cancel,
        on_output: &mut dyn FnMut(OutputKind, &[u8]),
    ) -> Result<ExitReply, GuestError> {
        let limit = self.exec_limit(&req);
        let mut client = self.connect_exec(limit, cancel)?;
        let out = client
            .exec(req, |kind, data| on_output(kind, data))
            .map_err(|e| self.exec_error(e, limit, cancel));
        cancel.detach();
        out
    }

    fn exec_error(&self, e: ClientError, limit: Option<Duration>, cancel: &Cancel) -> GuestError {
        if cancel.is_cancelled() {
            return self.unreachable("the exec was cancelled (its client went away)");
        }
        self.client_error(e, limit)
    }

    /// A whole file, refused past `limit` bytes (claimed or received).
    pub fn read_file(&self, path: &str, limit: u64) -> Result<Vec<u8>, GuestError> {
        let mut client = self.connect(Some(self.file_limit))?;
        client
            .read_file_all(path, limit)
            .map_err(|e| self.client_error(e, Some(self.file_limit)))
    }

    /// Writes (replaces) a file, creating missing parents; its final size.
    pub fn write_file(
        &self,
        path: &str,
        data: &[u8],
        mode: Option<u32>,
    ) -> Result<u64, GuestError> {
        self.write_file_as(path, data, mode, None)
    }

    /// [`Self::write_file`] whose file, and the parents it creates, go to
    /// `owner` (agent 1.4).
    pub fn write_file_as(
        &self,
        path: &str,
        data: &[u8],
        mode: Option<u32>,
        owner: Option<&str>,
    ) -> Result<u64, GuestError> {
        let mut client = self.connect(Some(self.file_limit))?;
        client
            .write_file_all_as(path, data, mode, true, owner)
            .map_err(|e| self.client_error(e, Some(self.file_limit)))
    }

    pub fn list_dir(&self, path: &str) -> Result<DirListing, GuestError> {
        let mut client = self.connect(Some(self.file_limit))?;
        client
            .list_dir(path)
            .map_err(|e| self.client_error(e, Some(self.file_limit)))
    }

    /// The size and free space of the guest's filesystem at `path` (the
    /// agent's `statfs`, protocol 1.4), connection, greeting and answer
    /// within `limit` in all. An older agent is `GuestError::Agent` with
    /// `ENOSYS` ([`GuestError::is_unsupported`]). The numbers are the
    /// guest's: untrusted.
    pub fn statfs(&self, path: &str, limit: Duration) -> Result<FsStats, GuestError> {
        let mut client = self.connect(Some(limit))?;
        client
            .statfs(path)
            .map_err(|e| self.client_error(e, Some(limit)))
    }

    /// Mounts the sandbox's volumes in its guest (agent protocol 1.5,
    /// `torpor_agent::volumes`), within `limit`.
    pub fn mount_volumes(
        &self,
        mounts: Vec<torpor_agent::proto::VolumeMount>,
        limit: Duration,
    ) -> Result<(), GuestError> {
        let mut client = self.connect(Some(limit))?;
        client
            .mount_volumes(mounts)
            .map_err(|e| self.client_error(e, Some(limit)))
    }

    /// The post-restore hook: the host's wall clock, the RNG reseeded from
    /// the clone's own seed (the identity page the VMM wrote at restore),
    /// the hostname and identity file. Fails unless the clock, the reseed,
    /// the hostname and the identity all took.
    ///
    /// A connection the guest closes during the call is tried once more
    /// on a new one, within the same wait: a restored guest's driver
    /// that handles the transport reset late (a starved guest, past the
    /// vsock device's hold) closes whatever it had accepted by then. The
    /// hook is idempotent (the clock set again, one more reseed).
    pub fn resumed(
        &self,
        sandbox_id: &str,
        mut alive: impl FnMut() -> Result<(), String>,
    ) -> Result<ResumedReply, GuestError> {
        let started = Instant::now();
        let mut client = self.connect_waiting(AGENT_WAIT, &mut alive)?;
        let req = |now: SystemTime| ResumedRequest {
            wall_clock_ns: Some(
                now.duration_since(UNIX_EPOCH)
                    .map(|d| d.as_nanos() as u64)
                    .unwrap_or(0),
            ),
            seed: None,
            hostname: Some(hostname_for(sandbox_id)),
            sandbox_id: Some(sandbox_id.to_string()),
        };
        let reply = match client.resumed(req(SystemTime::now())) {
            Err(e) if closed_by_the_guest(&e) => {
                tracing::info!(sandbox = %sandbox_id, "the guest closed the resume hook's connection ({e}); once more");
                let wait = AGENT_WAIT.saturating_sub(started.elapsed());
                let mut client = self.connect_waiting(wait, &mut alive)?;
                client.resumed(req(SystemTime::now()))
            }
            other => other,
        }
        .map_err(|e| self.client_error(e, Some(self.file_limit)))?;
        let steps: [(&str, &Step); 5] = [
            ("identity page", &reply.identity_page),
            ("clock", &reply.clock),
            ("rng reseed", &reply.rng_write),
            ("hostname", &reply.hostname),
            ("identity", &reply.identity),
        ];
        let failed: Vec<String> = steps
            .iter()
            .filter(|(_, s)| s.status != StepStatus::Ok)
            .map(|(name, s)| {
                let why = s
                    .error
                    .as_ref()
                    .map(ToString::to_string)
                    .or_else(|| s.detail.clone())
                    .unwrap_or_default();
                format!("{name} {:?}: {why}", s.status)
            })
            .collect();
        if !failed.is_empty() {
            return Err(GuestError::ResumeHook {
                id: sandbox_id.to_string(),
                detail: failed.join("; "),
            });
        }
        Ok(reply)
    }
}

/// A sandbox id as a hostname: `_` is not allowed there, so `sbx_12ab`
/// becomes `sbx-12ab`.
pub fn hostname_for(sandbox_id: &str) -> String {
    sandbox_id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' {
                c
            } else {
                '-'
            }
        })
        .take(64)
        .collect()
}

impl Service {
    /// The agent of a sandbox whose template has one (checked before any
    /// wake, so a probe sandbox is never woken for nothing).
    fn agent_link(&self, id: &SandboxId) -> Result<AgentLink, ServiceError> {
        let sandbox = self.store.get_sandbox(id)?;
        let template = self.store.get_template(&sandbox.template)?;
        if template.kind != TemplateKind::Linux {
            return Err(GuestError::NoAgent {
                id: id.to_string(),
                kind: template.kind,
            }
            .into());
        }
        Ok(AgentLink::new(
            id.as_str(),
            self.sandbox_dir(id).join(VSOCK_FILE),
        ))
    }

    /// Wakes the sandbox if needed, then runs `f` on its agent. The
    /// request is marked in flight before the wake takes the sandbox's
    /// lock and until `f` ends, so the policy (idle or watermark) never
    /// hibernates the sandbox under it; the sandbox is also marked active
    /// while `f` runs, so its keep-alive counts from the request's end.
    fn with_agent<T>(
        &self,
        id: &SandboxId,
        f: impl FnOnce(&AgentLink, &Outcome) -> Result<T, GuestError>,
    ) -> Result<GuestCall<T>, ServiceError> {
        let link = self.agent_link(id)?;
        let _in_flight = self.in_flight.enter(id);
        let started = Instant::now();
        let outcome = match self.ensure_running(id) {
            Ok(o) => o,
            Err(e) => {
                // A wake the pod refused is demand the trace keeps.
                if let (ServiceError::Admission { .. }, Ok(s)) = (&e, self.store.get_sandbox(id)) {
                    let kind = crate::trace::EventKind::Request;
                    self.record(started, id, kind, 0, s.mem_mib);
                }
                return Err(e);
            }
        };
        let (done, until_done) = mpsc::channel::<()>();
        let value = std::thread::scope(|scope| {
            scope.spawn(move || {
                while let Err(RecvTimeoutError::Timeout) = until_done.recv_timeout(ACTIVE_TICK) {
                    let _ = self
                        .store
                        .write_relaxed(|tx| tx.touch(id, Timestamp::now()));
                }
            });
            let value = f(&link, &outcome);
            drop(done);
            value
        });
        // Relaxed: the last activity of a running sandbox.
        let _ = self
            .store
            .write_relaxed(|tx| tx.touch(id, Timestamp::now()));
        self.record(
            started,
            id,
            crate::trace::EventKind::Request,
            started.elapsed().as_millis() as u64,
            outcome.sandbox.mem_mib,
        );
        Ok(GuestCall {
            outcome,
            value: value?,
        })
    }

    /// The sandbox's environment variables under the request's own (the
    /// request's win; with `clear_env` too, they are the sandbox's).
    fn with_sandbox_env(
        &self,
        id: &SandboxId,
        mut req: ExecRequest,
    ) -> Result<ExecRequest, ServiceError> {
        let mut env = self.store.get_sandbox(id)?.env;
        env.append(&mut req.env);
        req.env = env;
        Ok(req)
    }

    /// The exec's timeout: the service's (`exec_timeout_ms`) when it names
    /// none, refused past it, so an exec never holds a thread for ever.
    fn bounded_exec(&self, mut req: ExecRequest) -> Result<ExecRequest, ServiceError> {
        let max = self.config.exec_timeout_ms.max(1);
        match req.timeout_ms {
            None | Some(0) => req.timeout_ms = Some(max),
            Some(t) if t > max => {
                return Err(ServiceError::Invalid(format!(
                    "timeout_ms {t} is above this service's exec limit of {max} ms"
                )))
            }
            Some(_) => {}
        }
        Ok(req)
    }

    /// Runs `exec` and counts it, with its duration, in the metrics.
    fn timed_exec<T>(&self, exec: impl FnOnce() -> Result<T, GuestError>) -> Result<T, GuestError> {
        let started = Instant::now();
        let result = exec();
        self.metrics
            .observe_exec(started.elapsed().as_secs_f64() * 1000.0, result.is_ok());
        result
    }

    /// Runs a command in the sandbox and collects its output.
    /// `cancel` ends it early (the API cancels when its client goes away).
    pub fn exec(
        &self,
        id: &SandboxId,
        req: ExecRequest,
        cancel: &Cancel,
    ) -> Result<GuestCall<ExecOutput>, ServiceError> {
        let req = self.with_sandbox_env(id, self.bounded_exec(req)?)?;
        self.with_agent(id, |link, _| self.timed_exec(|| link.exec(req, cancel)))
    }

    /// Runs a command; `on_start` hears that the sandbox runs (and whether
    /// it was woken) before the first chunk goes to `on_output`.
    pub fn exec_streaming(
        &self,
        id: &SandboxId,
        req: ExecRequest,
        cancel: &Cancel,
        on_start: &mut dyn FnMut(&Outcome),
        on_output: &mut dyn FnMut(OutputKind, &[u8]),
    ) -> Result<GuestCall<ExitReply>, ServiceError> {
        let req = self.with_sandbox_env(id, self.bounded_exec(req)?)?;
        self.with_agent(id, |link, outcome| {
            on_start(outcome);
            self.timed_exec(|| link.exec_streaming(req, cancel, on_output))
        })
    }

    pub fn read_file(
        &self,
        id: &SandboxId,
        path: &str,
    ) -> Result<GuestCall<Vec<u8>>, ServiceError> {
        self.with_agent(id, |link, _| link.read_file(path, MAX_READ_BYTES))
    }

    /// Writes (replaces) a file, creating missing parent directories;
    /// answers its size.
    pub fn write_file(
        &self,
        id: &SandboxId,
        path: &str,
        data: &[u8],
        mode: Option<u32>,
    ) -> Result<GuestCall<u64>, ServiceError> {
        self.write_file_as(id, path, data, mode, None)
    }

    /// [`Self::write_file`] whose file, and the parents it creates, go to
    /// `owner` (agent 1.4).
    pub fn write_file_as(
        &self,
        id: &SandboxId,
        path: &str,
        data: &[u8],
        mode: Option<u32>,
        owner: Option<&str>,
    ) -> Result<GuestCall<u64>, ServiceError> {
        self.with_agent(id, |link, _| link.write_file_as(path, data, mode, owner))
    }

    pub fn list_dir(
        &self,
        id: &SandboxId,
        path: &str,
    ) -> Result<GuestCall<DirListing>, ServiceError> {
        self.with_agent(id, |link, _| link.list_dir(path))
    }

    /// Wakes the sandbox if needed and hands its agent to `f`, which makes
    /// its own connections (E2B's envd RPCs: processes, streams, watches).
    /// The sandbox counts as active until `f` returns.
    pub fn with_guest(
        &self,
        id: &SandboxId,
        f: &mut dyn FnMut(&AgentLink) -> Result<(), GuestError>,
    ) -> Result<Outcome, ServiceError> {
        Ok(self.with_agent(id, |link, _| f(link))?.outcome)
    }
}

#[cfg(test)]
#[path = "guest_tests.rs"]
pub(super) mod tests;

/// Whether `e` is the guest closing (or resetting) a connection it had
/// accepted, as opposed to an answer, a timeout or a protocol fault.
fn closed_by_the_guest(e: &ClientError) -> bool {
    match e {
        ClientError::Closed => true,
        ClientError::Frame(FrameError::Io(e)) => matches!(
            e.kind(),
            io::ErrorKind::ConnectionReset
                | io::ErrorKind::BrokenPipe
                | io::ErrorKind::UnexpectedEof
                | io::ErrorKind::ConnectionAborted
        ),
        _ => false,
    }
}

#[cfg(test)]
#[path = "guest_hostile_tests.rs"]
mod hostile_tests;

/// When the agent of `id` cannot be reached through its vsock (`uds`),
/// tells the operator what the guest's console and the VMM's log said last
/// (beside the socket, if they are there) and where its vCPUs stand (the
/// VMM's `vcpu_state`: a guest that takes no interrupt shows why), at
/// most once every
/// [`UNREACHABLE_LOG_EVERY`] for the whole service (`last_logged`: of
/// this kind): a guest that stopped
/// answering is otherwise a bare timeout.
fn log_unreachable(
    id: &str,
    uds: &std::path::Path,
    error: &dyn std::fmt::Display,
    last_logged: &AtomicU64,
) {
    use std::sync::atomic::Ordering;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let last = last_logged.load(Ordering::Relaxed);
    if now < last.saturating_add(UNREACHABLE_LOG_EVERY.as_secs())
        || last_logged
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_err()
    {
        return;
    }
    let Some(dir) = uds.parent() else { return };
    let files = super::vmm::VmmFiles::in_dir(dir);
    tracing::warn!(
        sandbox = %id,
        %error,
        console = %super::vmm::log_tail(&files.console),
        vmm = %super::vmm::log_tail(&files.log),
        vcpus = %super::vmm::vcpu_state_text(&files.socket),
        "guest agent unreachable through its vsock, or it dropped a connection"
    );
}

/// When [`log_unreachable`] last spoke of a guest that refused or never
/// answered a connection (every booting guest does that for a while).
static REFUSED_LOGGED: AtomicU64 = AtomicU64::new(0);

/// When [`log_unreachable`] last spoke of an agent that dropped a
/// connection it had accepted (rarer, and never part of a boot).
static CLOSED_LOGGED: AtomicU64 = AtomicU64::new(0);

/// How often [`log_unreachable`] may speak (of each kind).
const UNREACHABLE_LOG_EVERY: Duration = Duration::from_secs(30);
