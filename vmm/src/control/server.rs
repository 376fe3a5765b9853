//! Control socket server: one thread accepting connections and answering
//! requests against the VM's controller.

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use torpor_sync::Locked;

use super::{BalloonStatus, Request, Response, SnapshotInfo, VmStatus, MAX_LINE};
use torpor_vmm_api::{ErrorKind as VmErrorKind, VmError};

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

/// The control thread: accepts and answers, one connection at a time.
fn serve(listener: UnixListener, vm: &dyn VmController, answering: &Mutex<()>) {
    for stream in listener.incoming() {
        match stream {
            Ok(s) => {
                if let Err(e) = serve_connection(s, vm, answering) {
                    tracing::debug!("control connection ended: {e}");
                }
            }
            Err(e) => tracing::warn!("control accept failed: {e}"),
        }
    }
}

/// Answers requests on one connection until the client closes it.
/// Connections are served one at a time; a silent client is dropped after
/// the timeout so it cannot block the others.
fn serve_connection(
    stream: UnixStream,
    vm: &dyn VmController,
    answering: &Mutex<()>,
) -> std::io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut writer = stream.try_clone()?;
    let reader = BufReader::new(stream).take(MAX_LINE);
    for line in reader.lines() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let _answering = answering.locked();
        let response = answer(&line, vm);
        let mut out = serde_json::to_string(&response).map_err(std::io::Error::other)?;
        out.push('\n');
        writer.write_all(out.as_bytes())?;
    }
    Ok(())
}

/// The answer to one request line: a refusal for anything that is not a
/// request this server takes (also what `fuzz/` drives).
pub fn answer(line: &str, vm: &dyn VmController) -> Response {
    let result = match serde_json::from_str::<Request>(line) {
        Err(e) => Err(VmError::new(
            VmErrorKind::InvalidRequest,
            format!("invalid request: {e}"),
        )),
        Ok(Request::Status) => Ok((vm.status(), None, None)),
        Ok(Request::Pause) => vm.pause().map(|s| (s, None, None)),
        Ok(Request::Resume) => vm.resume().map(|s| (s, None, None)),
        Ok(Request::Shutdown) => vm.shutdown().map(|s| (s, None, None)),
        Ok(Request::Snapshot { path, diff }) => vm
            .snapshot(&path, diff)
            .map(|i| (vm.status(), Some(i), None)),
        Ok(Request::Hibernate { path, diff }) => vm
            .hibernate(&path, diff)
            .map(|i| (vm.status(), Some(i), None)),
        Ok(Request::SetBalloon { target_mib }) => vm
            .set_balloon(target_mib)
            .map(|b| (vm.status(), None, Some(b))),
        Ok(Request::BalloonStats) => vm.balloon().map(|b| (vm.status(), None, Some(b))),
        Ok(Request::Restore { .. }) => Err(VmError::new(
            VmErrorKind::WrongState,
            "this VMM already runs a VM; restore goes to a standby VMM",
        )),
        // Under an enforced filter this does not return.
        #[cfg(debug_assertions)]
        Ok(Request::DebugForbiddenSyscall) => match crate::seccomp::forbidden_syscall() {
            Ok(()) => Err(VmError::internal(
                "the forbidden system call succeeded: this VMM's seccomp filters are off",
            )),
            Err(e) => Err(VmError::internal(format!(
                "the forbidden system call failed ({e}) instead of killing the VMM"
            ))),
        },
    };
    match result {
        Ok((status, snapshot, balloon)) => Response {
            ok: true,
            status: Some(status),
            snapshot,
            balloon,
            ..Default::default()
        },
        Err(e) => Response::refusal(e),
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

    struct FakeVm(Mutex<VmState>);
    impl FakeVm {
        fn with(&self, s: VmState) -> VmStatus {
            *self.0.lock().unwrap() = s;
            self.status()
        }
    }
    impl VmController for FakeVm {
        fn status(&self) -> VmStatus {
            VmStatus {
                dirty_tracking: String::new(),
                protocol: 1,
                state: *self.0.lock().unwrap(),
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
}
