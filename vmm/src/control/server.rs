//! Control socket server: accepts connections and answers requests, one
//! connection at a time, for whatever this VMM is now.
//!
//! A VMM is served by this one loop in both of its lives: as a standby
//! shell (on its helper thread, answering `status`, `restore` and
//! `shutdown` through a [`StandbyController`], until a request ends the
//! shell: [`serve_standby`]) and once a VM runs (on the control thread,
//! answering the rest through a [`VmController`]: [`ControlServer`]). The
//! framing (a line, [`MAX_LINE`] at most per connection, a silent client
//! dropped after the read timeout), parsing, refusals and answer writing
//! are here once; each life only says what a request does.

use std::convert::Infallible;
use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use torpor_sync::Locked;

use super::{BalloonStatus, Request, Response, SnapshotInfo, VmStatus, MAX_LINE};
use torpor_vmm_api::vcpus::VcpuStates;
use torpor_vmm_api::{Console, ErrorKind as VmErrorKind, RestoreSpec, VmError};

/// How long a connection may stay silent before it is dropped.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// What the control server may ask of the VM; failures carry their kind.
pub trait VmController: Send + Sync + 'static {
    fn status(&self) -> VmStatus;
    fn pause(&self) -> Result<VmStatus, VmError>;
    fn resume(&self) -> Result<VmStatus, VmError>;
    fn shutdown(&self) -> Result<VmStatus, VmError>;
    fn snapshot(&self, path: &Path, diff: bool) -> Result<SnapshotInfo, VmError>;
    /// Pause, snapshot, and end the VMM once the answer is out; on failure
    /// the VM is left as it was (running or paused).
    fn hibernate(&self, path: &Path, diff: bool) -> Result<SnapshotInfo, VmError>;
    /// Sets the balloon's target (MiB the guest should give back).
    fn set_balloon(&self, target_mib: u64) -> Result<BalloonStatus, VmError>;
    /// The balloon's state; asks the guest for fresh statistics.
    fn balloon(&self) -> Result<BalloonStatus, VmError>;
    /// Where the vCPUs stand (a running VM is paused for the reading and
    /// runs on).
    fn vcpu_state(&self) -> Result<VcpuStates, VmError>;
}

/// What a standby shell does for the requests it takes (`status`,
/// `restore`, `shutdown`; the server refuses the others). A shutdown or a
/// restore may end its serving with an [`StandbyController::End`], which
/// [`serve_standby`] returns.
pub trait StandbyController {
    /// What ends the shell's serving (its shutdown, its restore).
    type End;
    fn status(&self) -> VmStatus;
    /// Ends the shell: the status to answer with, and the end, which
    /// [`serve_standby`] returns once that answer is out.
    fn shutdown(&mut self) -> (VmStatus, Self::End);
    fn restore(&mut self, request: RestoreRequest) -> Restoring<Self::End>;
}

/// A `restore` request to a standby shell.
#[derive(Debug)]
pub struct RestoreRequest {
    pub spec: RestoreSpec,
    pub console: Console,
    pub paused: bool,
    /// When its line was read, before it was parsed.
    pub received: Instant,
}

/// What came of a restore request.
#[derive(Debug)]
pub enum Restoring<E> {
    /// Under way: the request's connection goes with the end, unanswered,
    /// to whoever answers it once the VM runs.
    Started(E),
    /// Refused before the shell was touched: answered, the shell serves on.
    Refused(VmError),
    /// Failed once the shell was consumed: answered, then serving ends.
    Spent(VmError, E),
}

/// Errors while binding the control socket.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    #[error("control socket {0} is already in use by a running process")]
    InUse(PathBuf),
    #[error("cannot bind control socket {path}: {source}")]
    Bind {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Binds `path`. A socket file nobody answers on is stale and replaced;
/// one that answers belongs to a live VMM and is an error.
pub fn bind(path: &Path) -> Result<UnixListener, BindError> {
    let bind_err = |source| BindError::Bind {
        path: path.to_path_buf(),
        source,
    };
    match UnixListener::bind(path) {
        Ok(l) => Ok(l),
        Err(e) if e.kind() == ErrorKind::AddrInUse => {
            if UnixStream::connect(path).is_ok() {
                return Err(BindError::InUse(path.to_path_buf()));
            }
            std::fs::remove_file(path).map_err(bind_err)?;
            UnixListener::bind(path).map_err(bind_err)
        }
        Err(e) => Err(bind_err(e)),
    }
}

/// The running control server; removes its socket file when dropped.
#[derive(Debug)]
pub struct ControlServer {
    path: PathBuf,
    /// Held while a request is answered, so the VMM can let an answer in
    /// flight (e.g. to `shutdown`) reach the client before it exits.
    answering: Arc<Mutex<()>>,
    _thread: JoinHandle<()>,
}

/// What a spare control thread waits for: the socket and the VM to serve.
type Handover = (UnixListener, Arc<dyn VmController>);

/// A control-server thread made ahead of time (by a standby shell), under
/// its seccomp filter, waiting for the VM it will serve: a restore hands
/// it the listener instead of spawning a thread on its critical path.
#[derive(Debug)]
pub struct SpareControl {
    handover: std::sync::mpsc::Sender<Handover>,
    answering: Arc<Mutex<()>>,
    thread: JoinHandle<()>,
}

impl SpareControl {
    pub fn spawn() -> std::io::Result<Self> {
        let (handover, wait) = std::sync::mpsc::channel::<Handover>();
        let answering = Arc::new(Mutex::new(()));
        let lock = answering.clone();
        let thread = std::thread::Builder::new()
            .name("control".into())
            .spawn(move || {
                crate::seccomp::enter(crate::seccomp::ThreadKind::Control);
                if let Ok((listener, vm)) = wait.recv() {
                    serve(listener, vm.as_ref(), &lock);
                }
            })?;
        Ok(Self {
            handover,
            answering,
            thread,
        })
    }
}

impl ControlServer {
    /// Serves `listener` on the `spare` thread, or on a new one.
    pub fn start(
        listener: UnixListener,
        path: PathBuf,
        vm: Arc<dyn VmController>,
        spare: Option<SpareControl>,
    ) -> std::io::Result<Self> {
        let (listener, vm) = match spare {
            Some(spare) => match spare.handover.send((listener, vm)) {
                Ok(()) => {
                    return Ok(Self {
                        path,
                        answering: spare.answering,
                        _thread: spare.thread,
                    })
                }
                // The spare is gone: serve on a new thread.
                Err(std::sync::mpsc::SendError(handover)) => handover,
            },
            None => (listener, vm),
        };
        let answering = Arc::new(Mutex::new(()));
        let lock = answering.clone();
        let thread = std::thread::Builder::new()
            .name("control".into())
            .spawn(move || {
                crate::seccomp::enter(crate::seccomp::ThreadKind::Control);
                serve(listener, vm.as_ref(), &lock);
            })?;
        Ok(Self {
            path,
            answering,
            _thread: thread,
        })
    }

    /// Waits for the answer being written, if any; no answer starts while
    /// the guard lives.
    pub fn quiesce(&self) -> std::sync::MutexGuard<'_, ()> {
        self.answering.locked()
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The control thread: answers the running VM's requests, for good.
fn serve(listener: UnixListener, vm: &dyn VmController, answering: &Mutex<()>) {
    let mut step = |line: &str| Step::<Infallible>::Answer(answer(line, vm));
    loop {
        // Nothing ends this serving (its end is `Infallible`).
        let None = serve_next(&listener, answering, &mut step);
    }
}

/// Serves a standby shell on `listener` (on the calling thread) until a
/// request ends it: returns that end and the connection that asked (left
/// unanswered when a restore started, whose answer is the running VM's).
pub fn serve_standby<E>(
    listener: &UnixListener,
    shell: &mut dyn StandbyController<End = E>,
) -> (UnixStream, E) {
    // Nothing else answers on this socket while the shell lives.
    let answering = Mutex::new(());
    let mut step = |line: &str| answer_standby(line, shell);
    loop {
        if let Some(end) = serve_next(listener, &answering, &mut step) {
            return end;
        }
    }
}

/// What the loop does with one request line.
enum Step<E> {
    /// Writes the answer and serves on.
    Answer(Response),
    /// Writes the answer, then ends with `E`.
    AnswerThenEnd(Response, E),
    /// Ends with `E` at once, the connection unanswered.
    HandOver(E),
}

/// Accepts a connection and serves it: the connection and the end, if one
/// of its requests ended the serving.
fn serve_next<E>(
    listener: &UnixListener,
    answering: &Mutex<()>,
    step: &mut impl FnMut(&str) -> Step<E>,
) -> Option<(UnixStream, E)> {
    match listener.accept() {
        Ok((stream, _)) => serve_connection(stream, answering, step).unwrap_or_else(|e| {
            tracing::debug!("control connection ended: {e}");
            None
        }),
        Err(e) => {
            tracing::warn!("control accept failed: {e}");
            None
        }
    }
}

/// Answers requests on one connection until the client closes it, or a
/// request ends the serving (then returns the connection and the end).
/// Connections are served one at a time; a silent client is dropped after
/// the timeout so it cannot block the others.
fn serve_connection<E>(
    stream: UnixStream,
    answering: &Mutex<()>,
    step: &mut impl FnMut(&str) -> Step<E>,
) -> std::io::Result<Option<(UnixStream, E)>> {
    stream.set_read_timeout(Some(READ_TIMEOUT))?;
    let mut ended = None;
    // Read and written through references: the stream itself can then be
    // handed over as it is (no descriptor to duplicate or close).
    for line in BufReader::new(&stream).take(MAX_LINE).lines() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let _answering = answering.locked();
        match step(&line) {
            Step::Answer(response) => write_answer(&stream, &response)?,
            Step::AnswerThenEnd(response, end) => {
                // The end stands whether or not the answer got out.
                if let Err(e) = write_answer(&stream, &response) {
                    tracing::debug!("control answer lost: {e}");
                }
                ended = Some(end);
                break;
            }
            Step::HandOver(end) => {
                ended = Some(end);
                break;
            }
        }
    }
    Ok(ended.map(|end| (stream, end)))
}

fn write_answer(mut stream: &UnixStream, response: &Response) -> std::io::Result<()> {
    let mut out = serde_json::to_string(response).map_err(std::io::Error::other)?;
    out.push('\n');
    stream.write_all(out.as_bytes())
}

/// A request line parsed, or the refusal of what is not a request.
fn parse(line: &str) -> Result<Request, VmError> {
    serde_json::from_str::<Request>(line)
        .map_err(|e| VmError::new(VmErrorKind::InvalidRequest, format!("invalid request: {e}")))
}

/// What an answer carries beside the VM's status.
enum Extra {
    Nothing,
    Snapshot(SnapshotInfo),
    Balloon(BalloonStatus),
    Vcpus(VcpuStates),
}

/// The answer carrying `status` (and what else the request asked for).
fn answered(result: Result<(VmStatus, Extra), VmError>) -> Response {
    match result {
        Ok((status, extra)) => {
            let mut r = Response {
                ok: true,
                status: Some(status),
                ..Default::default()
            };
            match extra {
                Extra::Nothing => {}
                Extra::Snapshot(i) => r.snapshot = Some(i),
                Extra::Balloon(b) => r.balloon = Some(b),
                Extra::Vcpus(v) => r.vcpus = Some(v),
            }
            r
        }
        Err(e) => Response::refusal(e),
    }
}

/// The answer to one request line: a refusal for anything that is not a
/// request this server takes (also what `fuzz/` drives).
pub fn answer(line: &str, vm: &dyn VmController) -> Response {
    answered(parse(line).and_then(|request| {
        match request {
            Request::Status => Ok((vm.status(), Extra::Nothing)),
            Request::Pause => vm.pause().map(|s| (s, Extra::Nothing)),
            Request::Resume => vm.resume().map(|s| (s, Extra::Nothing)),
            Request::Shutdown => vm.shutdown().map(|s| (s, Extra::Nothing)),
            Request::Snapshot { path, diff } => vm
                .snapshot(&path, diff)
                .map(|i| (vm.status(), Extra::Snapshot(i))),
            Request::Hibernate { path, diff } => vm
                .hibernate(&path, diff)
                .map(|i| (vm.status(), Extra::Snapshot(i))),
            Request::SetBalloon { target_mib } => vm
                .set_balloon(target_mib)
                .map(|b| (vm.status(), Extra::Balloon(b))),
            Request::BalloonStats => vm.balloon().map(|b| (vm.status(), Extra::Balloon(b))),
            Request::VcpuState => vm.vcpu_state().map(|v| (vm.status(), Extra::Vcpus(v))),
            Request::Restore { .. } => Err(VmError::new(
                VmErrorKind::WrongState,
                "this VMM already runs a VM; restore goes to a standby VMM",
            )),
            // Under an enforced filter this does not return.
            #[cfg(debug_assertions)]
            Request::DebugForbiddenSyscall => match crate::seccomp::forbidden_syscall() {
                Ok(()) => Err(VmError::internal(
                    "the forbidden system call succeeded: this VMM's seccomp filters are off",
                )),
                Err(e) => Err(VmError::internal(format!(
                    "the forbidden system call failed ({e}) instead of killing the VMM"
                ))),
            },
        }
    }))
}

/// What a standby shell does with one request line.
fn answer_standby<E>(line: &str, shell: &mut dyn StandbyController<End = E>) -> Step<E> {
    // A restore's answer says how long it took from here to a running VM.
    let received = Instant::now();
    match parse(line) {
        Err(e) => Step::Answer(Response::refusal(e)),
        Ok(Request::Status) => Step::Answer(answered(Ok((shell.status(), Extra::Nothing)))),
        Ok(Request::Shutdown) => {
            let (status, end) = shell.shutdown();
            Step::AnswerThenEnd(answered(Ok((status, Extra::Nothing))), end)
        }
        Ok(Request::Restore {
            restore: spec,
            console,
            paused,
        }) => match shell.restore(RestoreRequest {
            spec,
            console,
            paused,
            received,
        }) {
            Restoring::Started(end) => Step::HandOver(end),
            Restoring::Refused(e) => Step::Answer(Response::refusal(e)),
            Restoring::Spent(e, end) => Step::AnswerThenEnd(Response::refusal(e), end),
        },
        Ok(_) => Step::Answer(Response::refusal(VmError::new(
            VmErrorKind::WrongState,
            "this VMM is on standby: it answers status, restore and shutdown",
        ))),
    }
}

/// The control server's own calls: its socket (accept, read requests,
/// send answers). What it does for a request (snapshots, VM state, dirty
/// pages, vCPU kicks) is declared by those mechanisms.
pub(crate) fn syscalls(r: &mut crate::seccomp::Rules) -> Result<(), crate::seccomp::SeccompError> {
    r.allow(&[
        libc::SYS_accept4,
        libc::SYS_read,
        libc::SYS_recvfrom,
        libc::SYS_sendto,
        libc::SYS_setsockopt,
    ]);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::{request, ClientError, VmState};
    use super::*;
    use std::sync::Mutex;

    fn status_in(state: VmState) -> VmStatus {
        VmStatus {
            dirty_tracking: String::new(),
            protocol: 1,
            state,
            pid: 1,
            vcpus: 1,
            mem_mib: 1,
            kernel: "k".into(),
            uptime_ms: 0,
            generation: 0,
            memory_backend: "anonymous".into(),
            base_snapshot: None,
            guest_clock_ns: None,
            console_dropped_bytes: 0,
        }
    }

    struct FakeVm(Mutex<VmState>);
    impl FakeVm {
        fn with(&self, s: VmState) -> VmStatus {
            *self.0.lock().unwrap() = s;
            self.status()
        }
    }
    impl VmController for FakeVm {
        fn status(&self) -> VmStatus {
            status_in(*self.0.lock().unwrap())
        }
        fn pause(&self) -> Result<VmStatus, VmError> {
            Ok(self.with(VmState::Paused))
        }
        fn resume(&self) -> Result<VmStatus, VmError> {
            Ok(self.with(VmState::Running))
        }
        fn shutdown(&self) -> Result<VmStatus, VmError> {
            Err(VmError::new(VmErrorKind::GuestGone, "no"))
        }
        fn snapshot(&self, _: &Path, _: bool) -> Result<SnapshotInfo, VmError> {
            Err(VmError::new(VmErrorKind::NotPaused, "no"))
        }
        fn hibernate(&self, _: &Path, _: bool) -> Result<SnapshotInfo, VmError> {
            Err(VmError::new(VmErrorKind::NoSpace, "full"))
        }
        fn set_balloon(&self, target_mib: u64) -> Result<BalloonStatus, VmError> {
            Ok(BalloonStatus {
                target_mib,
                ..Default::default()
            })
        }
        fn balloon(&self) -> Result<BalloonStatus, VmError> {
            Err(VmError::new(VmErrorKind::Unsupported, "no balloon"))
        }
        fn vcpu_state(&self) -> Result<VcpuStates, VmError> {
            Err(VmError::new(VmErrorKind::NotPaused, "no vCPUs"))
        }
    }

    #[test]
    fn serves_requests_and_refuses_a_second_owner() {
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path().to_path_buf();
        let path = dir.join("ctl.sock");
        let listener = bind(&path).unwrap();
        let _server = ControlServer::start(
            listener,
            path.clone(),
            Arc::new(FakeVm(Mutex::new(VmState::Running))),
            None,
        )
        .unwrap();
        let t = Duration::from_secs(2);
        assert_eq!(
            request(&path, &Request::Pause, t).unwrap().state,
            VmState::Paused
        );
        assert_eq!(
            request(&path, &Request::Status, t).unwrap().state,
            VmState::Paused
        );
        assert!(matches!(
            request(&path, &Request::Shutdown, t),
            Err(ClientError::Refused(VmError {
                kind: VmErrorKind::GuestGone,
                ..
            }))
        ));
        let hibernate = Request::Hibernate {
            path: "/h".into(),
            diff: true,
        };
        let refused = request(&path, &hibernate, t).unwrap_err();
        assert_eq!(refused.kind(), VmErrorKind::NoSpace, "{refused}");
        assert!(matches!(bind(&path), Err(BindError::InUse(_))));
    }

    #[test]
    fn stale_socket_file_is_replaced() {
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path().to_path_buf();
        let path = dir.join("ctl.sock");
        drop(UnixListener::bind(&path).unwrap());
        assert!(path.exists());
        assert!(bind(&path).is_ok());
    }

    #[test]
    fn garbage_gets_an_error_answer() {
        let vm = FakeVm(Mutex::new(VmState::Running));
        let a = answer("{not json", &vm);
        assert_eq!(a.vm_error().unwrap().kind, VmErrorKind::InvalidRequest);
        let r = answer(r#"{"op":"restore","snapshot":"/s"}"#, &vm);
        assert_eq!(r.vm_error().unwrap().kind, VmErrorKind::WrongState);
    }

    /// A shell whose restores go by the snapshot's name: `/bad` is refused,
    /// `/spent` fails once the shell is consumed, the rest start.
    struct FakeShell {
        restores: usize,
    }
    impl StandbyController for FakeShell {
        type End = &'static str;
        fn status(&self) -> VmStatus {
            status_in(VmState::Standby)
        }
        fn shutdown(&mut self) -> (VmStatus, &'static str) {
            (self.status(), "shut down")
        }
        fn restore(&mut self, request: RestoreRequest) -> Restoring<&'static str> {
            self.restores += 1;
            assert!(request.received <= Instant::now());
            match request.spec.snapshot.to_str() {
                Some("/bad") => {
                    Restoring::Refused(VmError::new(VmErrorKind::InvalidRequest, "bad"))
                }
                Some("/spent") => {
                    Restoring::Spent(VmError::new(VmErrorKind::BadSnapshot, "torn"), "spent")
                }
                _ => Restoring::Started("restored"),
            }
        }
    }

    fn restore_line(snapshot: &str) -> String {
        format!(r#"{{"op":"restore","snapshot":"{snapshot}","paused":true}}"#)
    }

    #[test]
    fn a_standby_shell_answers_status_restore_and_shutdown_only() {
        let mut shell = FakeShell { restores: 0 };
        let answered = |step: Step<&'static str>| match step {
            Step::Answer(r) => r,
            _ => panic!("the serving ended"),
        };
        let status = answered(answer_standby(r#"{"op":"status"}"#, &mut shell));
        assert_eq!(status.status.unwrap().state, VmState::Standby);
        for line in [r#"{"op":"pause"}"#, r#"{"op":"snapshot","path":"/s"}"#] {
            let e = answered(answer_standby(line, &mut shell))
                .vm_error()
                .unwrap();
            assert_eq!(e.kind, VmErrorKind::WrongState);
            assert_eq!(
                e.message,
                "this VMM is on standby: it answers status, restore and shutdown"
            );
        }
        let e = answered(answer_standby("{not json", &mut shell));
        assert_eq!(e.vm_error().unwrap().kind, VmErrorKind::InvalidRequest);
        assert_eq!(shell.restores, 0, "no restore for what is not one");
        let e = answered(answer_standby(&restore_line("/bad"), &mut shell));
        assert_eq!(e.vm_error().unwrap().kind, VmErrorKind::InvalidRequest);
        match answer_standby(&restore_line("/spent"), &mut shell) {
            Step::AnswerThenEnd(r, "spent") => {
                assert_eq!(r.vm_error().unwrap().kind, VmErrorKind::BadSnapshot)
            }
            _ => panic!("a spent shell answers, then ends"),
        }
        assert!(matches!(
            answer_standby(&restore_line("/s"), &mut shell),
            Step::HandOver("restored")
        ));
        match answer_standby(r#"{"op":"shutdown"}"#, &mut shell) {
            Step::AnswerThenEnd(r, "shut down") => assert!(r.ok && r.status.is_some()),
            _ => panic!("a shutdown answers, then ends"),
        }
    }

    #[test]
    fn a_restore_ends_the_standby_serving_with_its_connection_unanswered() {
        use std::io::BufRead;
        let scratch = tempfile::tempdir().unwrap();
        let path = scratch.path().join("standby.sock");
        let listener = bind(&path).unwrap();
        let serving = std::thread::spawn(move || {
            let mut shell = FakeShell { restores: 0 };
            let (stream, end) = serve_standby(&listener, &mut shell);
            (stream, end, shell.restores)
        });
        let t = Duration::from_secs(5);
        let refused = request(&path, &Request::Pause, t).unwrap_err().to_string();
        assert!(refused.contains("on standby"), "{refused}");
        // A bad restore leaves it serving, on the same connection too.
        let mut client = UnixStream::connect(&path).unwrap();
        client.set_read_timeout(Some(t)).unwrap();
        let mut answers = BufReader::new(client.try_clone().unwrap());
        let mut ask = |line: &str| {
            client.write_all(format!("{line}\n").as_bytes()).unwrap();
            let mut answer = String::new();
            answers.read_line(&mut answer).unwrap();
            answer
        };
        assert!(ask(&restore_line("/bad")).contains(r#""kind":"invalid_request""#));
        assert!(ask(r#"{"op":"status"}"#).contains(r#""state":"standby""#));
        client
            .write_all(format!("{}\n", restore_line("/s")).as_bytes())
            .unwrap();
        let (mut handed, end, restores) = serving.join().unwrap();
        assert_eq!((end, restores), ("restored", 2));
        // The answer is whoever got the connection's to write.
        handed.write_all(b"{\"ok\":true}\n").unwrap();
        let mut answer = String::new();
        answers.read_line(&mut answer).unwrap();
        assert_eq!(answer, "{\"ok\":true}\n");
    }

    #[test]
    fn a_standby_shutdown_is_answered_then_ends_the_serving() {
        let scratch = tempfile::tempdir().unwrap();
        let path = scratch.path().join("standby.sock");
        let listener = bind(&path).unwrap();
        let serving =
            std::thread::spawn(move || serve_standby(&listener, &mut FakeShell { restores: 0 }).1);
        let t = Duration::from_secs(5);
        let status = request(&path, &Request::Shutdown, t).unwrap();
        assert_eq!(status.state, VmState::Standby);
        assert_eq!(serving.join().unwrap(), "shut down");
    }
}
