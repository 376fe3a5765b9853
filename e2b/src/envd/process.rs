//! `process.Process`: E2B's commands on the agent's spawned processes
//! (protocol 1.1). `Start` spawns and follows the process on one agent
//! connection (its output since the spawn, then live); `Connect` follows
//! an existing one from now on. Either stream ending (the client gone, its
//! timeout) leaves the process running, as envd does. Processes run as the
//! request's user (`Authorization: Basic`), by default `user`, or the
//! agent's own user when the guest has no `user`; the sandbox's
//! environment variables are under the request's.

use std::time::Duration;

use serde_json::Value;
use torpor_agent::proto::{AttachRequest, PtySize, SpawnRequest};
use torpor_agent::{AgentClient, AttachEvent, ClientError, OutputKind};
use torpor_scheduler::service::guest::{AgentLink, ExitReply, GuestStream};

use super::client_stream::Messages;
use super::envelope::ConnectError;
use super::files::{resolve, DEFAULT_USER};
use super::json::{
    Data, Empty, EndEvent, EnumValue, EventResponse, ListResponse, ProcessConfig, ProcessEvent,
    ProcessInfo, ProcessInput, ProcessSelector, SelectRequest, SendInputRequest, SendSignalRequest,
    StartEvent, StartRequest, StreamInputRequest, UpdateRequest,
};
use super::rpc::{guest_error, invalid, parse, unknown_user, CallContext, StreamTx};
use super::Code;

/// How much longer than the keepalive interval the guest may stay silent.
const IDLE_SLACK: Duration = Duration::from_secs(30);

type Client = AgentClient<GuestStream>;

fn connect(link: &AgentLink) -> Result<Client, ConnectError> {
    link.connect(Some(link.file_limit)).map_err(guest_error)
}

fn call_err(link: &AgentLink, e: ClientError) -> ConnectError {
    guest_error(link.error(e, Some(link.file_limit)))
}

fn not_found(message: String) -> ConnectError {
    ConnectError {
        code: Code::NotFound,
        message,
    }
}

/// The pid a selector names (a tag is looked up among running processes).
fn select(
    link: &AgentLink,
    client: &mut Client,
    selector: Option<ProcessSelector>,
) -> Result<u32, ConnectError> {
    match selector {
        Some(ProcessSelector { pid: Some(pid), .. }) => Ok(pid),
        Some(ProcessSelector { tag: Some(tag), .. }) => client
            .processes()
            .map_err(|e| call_err(link, e))?
            .into_iter()
            .find(|p| p.tag.as_deref() == Some(tag.as_str()))
            .map(|p| p.pid)
            .ok_or_else(|| not_found(format!("no process tagged {tag:?}"))),
        _ => Err(invalid("`process` must name a pid or a tag".into())),
    }
}

fn pty_size(size: Option<super::json::PtySize>) -> Result<Option<PtySize>, ConnectError> {
    let Some(s) = size else { return Ok(None) };
    let fit = |n: u32| u16::try_from(n).ok().filter(|n| (1..=4096).contains(n));
    match (fit(s.cols), fit(s.rows)) {
        (Some(cols), Some(rows)) => Ok(Some(PtySize { cols, rows })),
        _ => Err(invalid(format!(
            "terminal size {}x{} is outside 1..=4096",
            s.cols, s.rows
        ))),
    }
}

/// E2B's end event for an exit.
fn end_event(exit: &ExitReply) -> EndEvent {
    match (exit.code, exit.signal) {
        (Some(code), _) => EndEvent {
            exit_code: code,
            exited: true,
            status: format!("exit status {code}"),
            error: None,
        },
        (None, Some(sig)) => EndEvent {
            exit_code: -1,
            exited: false,
            status: format!("signal: {sig}"),
            error: None,
        },
        (None, None) => EndEvent {
            exit_code: -1,
            exited: false,
            status: "unknown".into(),
            error: Some("the process's status could not be read".into()),
        },
    }
}

fn event(e: ProcessEvent) -> EventResponse {
    EventResponse { event: e }
}

/// Follows `pid` on `client` until it exits, the client goes away or
/// the call's deadline passes.
fn follow(
    link: &AgentLink,
    client: &mut Client,
    ctx: &CallContext,
    pid: u32,
    replay: bool,
    out: &StreamTx,
) -> Result<(), ConnectError> {
    // Keepalives come often enough to see the client's timeout on time.
    let mut keepalive = ctx.keepalive;
    if let Some(d) = ctx.deadline {
        keepalive = keepalive.min(d.saturating_duration_since(std::time::Instant::now()));
    }
    let req = AttachRequest {
        pid,
        replay,
        keepalive_ms: Some(keepalive.as_millis().max(100) as u64),
    };
    let mut timed_out = false;
    let exit = client
        .attach(req, |e| {
            let sent = match e {
                AttachEvent::Output(OutputKind::Stdout, d) => {
                    out.send(&event(ProcessEvent::Data(Data::Stdout(d.to_vec()))))
                }
                AttachEvent::Output(OutputKind::Stderr, d) => {
                    out.send(&event(ProcessEvent::Data(Data::Stderr(d.to_vec()))))
                }
                AttachEvent::Pty(d) => out.send(&event(ProcessEvent::Data(Data::Pty(d.to_vec())))),
                AttachEvent::Keepalive => {
                    !out.closed() && out.send(&event(ProcessEvent::Keepalive(Empty {})))
                }
            };
            timed_out = ctx.expired();
            sent && !timed_out
        })
        .map_err(|e| guest_error(link.error(e, None)))?;
    match exit {
        Some(exit) => {
            out.send(&event(ProcessEvent::End(end_event(&exit))));
            Ok(())
        }
        None if timed_out => Err(ConnectError {
            code: Code::DeadlineExceeded,
            message: "the call's timeout passed (the process goes on)".into(),
        }),
        None => Ok(()),
    }
}

/// The agent connection of a stream: keepalives must come within
/// the keepalive interval plus slack.
fn stream_client(link: &AgentLink, ctx: &CallContext) -> Result<Client, ConnectError> {
    link.connect_idle(ctx.keepalive + IDLE_SLACK)
        .map_err(guest_error)
}

/// `Start` (server stream): a start event with the pid, output events,
/// keepalives, the end event.
pub fn start(
    link: &AgentLink,
    ctx: &CallContext,
    message: &[u8],
    out: &StreamTx,
) -> Result<(), ConnectError> {
    let req: StartRequest = parse(message)?;
    let config = req.process.unwrap_or_default();
    if config.cmd.is_empty() {
        return Err(invalid("`process.cmd` is empty".into()));
    }
    let user = ctx.user.clone().or_else(|| ctx.default_user.clone());
    let cwd = match config.cwd.as_deref().filter(|c| !c.is_empty()) {
        Some(c) => Some(resolve(c, user.as_deref()).map_err(|e| invalid(e.message))?),
        None => ctx.workdir.clone(),
    };
    let mut env = ctx.env.clone();
    env.extend(config.envs);
    let mut argv = vec![config.cmd];
    argv.extend(config.args);
    let mut spawn = SpawnRequest {
        argv,
        env,
        cwd,
        user: Some(user.clone().unwrap_or_else(|| DEFAULT_USER.to_string())),
        pty: pty_size(req.pty.and_then(|p| p.size))?,
        stdin: req.stdin.unwrap_or(true),
        tag: req.tag,
    };
    let mut client = stream_client(link, ctx)?;
    let pid = match client.spawn(spawn.clone()) {
        Ok(pid) => pid,
        // No `user` in this guest and none asked for: the agent's user.
        Err(ClientError::Agent(e)) if user.is_none() && unknown_user(&e) => {
            spawn.user = None;
            client.spawn(spawn).map_err(|e| call_err(link, e))?
        }
        Err(e) => return Err(call_err(link, e)),
    };
    if !out.send(&event(ProcessEvent::Start(StartEvent { pid }))) {
        return Ok(());
    }
    follow(link, &mut client, ctx, pid, true, out)
}

/// `Connect` (server stream): a start event, then the output from now on.
pub fn connect_stream(
    link: &AgentLink,
    ctx: &CallContext,
    message: &[u8],
    out: &StreamTx,
) -> Result<(), ConnectError> {
    let req: SelectRequest = parse(message)?;
    let mut client = stream_client(link, ctx)?;
    let pid = select(link, &mut client, req.process)?;
    if !client
        .processes()
        .map_err(|e| call_err(link, e))?
        .iter()
        .any(|p| p.pid == pid)
    {
        return Err(not_found(format!("process with pid {pid} not found")));
    }
    if !out.send(&event(ProcessEvent::Start(StartEvent { pid }))) {
        return Ok(());
    }
    follow(link, &mut client, ctx, pid, false, out)
}

/// `List`: the running processes.
pub fn list(link: &AgentLink, _ctx: &CallContext, message: &[u8]) -> Result<Value, ConnectError> {
    let _: Value = parse(message)?;
    let mut client = connect(link)?;
    let processes = client
        .processes()
        .map_err(|e| call_err(link, e))?
        .into_iter()
        .map(|p| {
            let mut argv = p.argv.into_iter();
            ProcessInfo {
                config: ProcessConfig {
                    cmd: argv.next().unwrap_or_default(),
                    args: argv.collect(),
                    envs: p.env,
                    cwd: Some(p.cwd),
                },
                pid: p.pid,
                tag: p.tag,
            }
        })
        .collect();
    Ok(serde_json::to_value(ListResponse { processes }).unwrap_or_default())
}

fn empty() -> Value {
    Value::Object(Default::default())
}

/// `SendSignal`: `SIGNAL_SIGTERM` or `SIGNAL_SIGKILL` (names or numbers),
/// to the process's group.
pub fn send_signal(
    link: &AgentLink,
    _ctx: &CallContext,
    message: &[u8],
) -> Result<Value, ConnectError> {
    let req: SendSignalRequest = parse(message)?;
    let signal = match req.signal {
        Some(EnumValue::Name(n)) if n == "SIGNAL_SIGKILL" => 9,
        Some(EnumValue::Name(n)) if n == "SIGNAL_SIGTERM" => 15,
        Some(EnumValue::Number(n)) if n == 9 || n == 15 => n as i32,
        other => return Err(invalid(format!("unsupported signal {other:?}"))),
    };
    let mut client = connect(link)?;
    let pid = select(link, &mut client, req.process)?;
    client.signal(pid, signal).map_err(|e| call_err(link, e))?;
    Ok(empty())
}

/// The bytes of a `ProcessInput` (one of `stdin` and `pty`).
fn input_bytes(input: Option<ProcessInput>) -> Result<Vec<u8>, ConnectError> {
    let input = input.unwrap_or_default();
    match (input.stdin, input.pty) {
        (Some(d), None) | (None, Some(d)) => Ok(d),
        _ => Err(invalid("`input` must hold one of `stdin` and `pty`".into())),
    }
}

/// `SendInput`: bytes to the process's stdin or PTY.
pub fn send_input(
    link: &AgentLink,
    _ctx: &CallContext,
    message: &[u8],
) -> Result<Value, ConnectError> {
    let req: SendInputRequest = parse(message)?;
    let data = input_bytes(req.input)?;
    let mut client = connect(link)?;
    let pid = select(link, &mut client, req.process)?;
    client.input(pid, &data).map_err(|e| call_err(link, e))?;
    Ok(empty())
}

/// `StreamInput`: `start{process}`, then each `data{input}` to the
/// process's stdin or PTY as it arrives, in order, on one agent
/// connection; `keepalive{}` is read and dropped. Ends when the client's
/// stream does (see [`super::client_stream`]).
pub fn stream_input(
    link: &AgentLink,
    _ctx: &CallContext,
    messages: &mut Messages,
) -> Result<(), ConnectError> {
    let next = |messages: &mut Messages| -> Result<Option<StreamInputRequest>, ConnectError> {
        messages.recv().transpose()?.map(|m| parse(&m)).transpose()
    };
    let selector = match next(messages)? {
        Some(StreamInputRequest {
            start: Some(start), ..
        }) => start.process,
        Some(_) => {
            return Err(invalid(
                "the input stream's first message must be `start`".into(),
            ))
        }
        None => return Err(invalid("the input stream ended before `start`".into())),
    };
    let mut client = connect(link)?;
    let pid = select(link, &mut client, selector)?;
    // Named by pid: it must run now (envd's `not_found`), not only when
    // the first input comes, which may be much later or never.
    let running = client.processes().map_err(|e| call_err(link, e))?;
    if !running.iter().any(|p| p.pid == pid) {
        return Err(not_found(format!("process {pid} not found")));
    }
    while let Some(req) = next(messages)? {
        match req {
            StreamInputRequest {
                data: Some(data),
                start: None,
                keepalive: None,
            } => {
                let bytes = input_bytes(data.input)?;
                client.input(pid, &bytes).map_err(|e| call_err(link, e))?;
            }
            StreamInputRequest {
                keepalive: Some(_),
                start: None,
                data: None,
            } => {}
            StreamInputRequest { start: Some(_), .. } => {
                return Err(invalid("`start` again in the same input stream".into()))
            }
            _ => {
                return Err(invalid(
                    "each message must hold one of `data` and `keepalive`".into(),
                ))
            }
        }
    }
    Ok(())
}

/// `CloseStdin`.
pub fn close_stdin(
    link: &AgentLink,
    _ctx: &CallContext,
    message: &[u8],
) -> Result<Value, ConnectError> {
    let req: SelectRequest = parse(message)?;
    let mut client = connect(link)?;
    let pid = select(link, &mut client, req.process)?;
    client.close_stdin(pid).map_err(|e| call_err(link, e))?;
    Ok(empty())
}

/// `Update`: resizes the process's PTY (nothing else can be updated).
pub fn update(link: &AgentLink, _ctx: &CallContext, message: &[u8]) -> Result<Value, ConnectError> {
    let req: UpdateRequest = parse(message)?;
    let size = pty_size(req.pty.and_then(|p| p.size))?;
    let mut client = connect(link)?;
    let pid = select(link, &mut client, req.process)?;
    if let Some(size) = size {
        client
            .resize(pid, size.cols, size.rows)
            .map_err(|e| call_err(link, e))?;
    }
    Ok(empty())
}
