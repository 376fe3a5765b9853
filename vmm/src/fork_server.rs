//! `torpor-vmm --fork-server`: a pod's VMM processes forked from one
//! started `torpor-vmm` instead of exec'd one by one (the protocol, and
//! why: [`torpor_vmm_api::fork`]).
//!
//! The server is single-threaded and never starts a thread: a fork of it
//! holds no lock another thread had taken. Each child leaves [`serve`]
//! with the request's descriptors as its stdin, stdout and stderr, in a
//! process group of its own, and goes on as an exec'd `torpor-vmm` does
//! (it reads its launch spec on stdin). The server itself never leaves
//! [`serve`]: it exits when the pod closes the socket.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, OwnedFd};

use rustix::net::{
    recvmsg, sendmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags,
    SendAncillaryBuffer, SendFlags,
};
use torpor_vmm_api::fork::{ForkReply, ForkRequest, FORK_FDS, MAX_FORK_MESSAGE};

/// A forked child could not take its descriptors.
#[derive(Debug, thiserror::Error)]
#[error("the forked VMM could not take its {what}: {source}")]
pub struct ChildSetupError {
    what: &'static str,
    source: std::io::Error,
}

/// The fork server's process name (at most 15 bytes), and its children's.
const SERVER_COMM: &std::ffi::CStr = c"torpor-vmm-fork";
const VMM_COMM: &std::ffi::CStr = c"torpor-vmm";

/// Sets this thread's name (the main thread's is the process's `comm`).
fn set_comm(name: &std::ffi::CStr) {
    // SAFETY: prctl(PR_SET_NAME) reads a NUL-terminated string of at most
    // 16 bytes from a pointer valid for the call.
    unsafe { libc::prctl(libc::PR_SET_NAME, name.as_ptr() as libc::c_ulong, 0, 0, 0) };
}

/// One request as received: what it asked and the descriptors it carried.
struct Received {
    request: Result<ForkRequest, String>,
    fds: Vec<OwnedFd>,
}

/// Serves fork requests on `socket` until the pod closes it (the process
/// then exits 0, or 1 if the socket fails). Returns only in a forked
/// child, set up as its request asked.
pub fn serve(socket: OwnedFd) -> Result<(), ChildSetupError> {
    // Not a VMM: what ps, and the pod's scans for `torpor-vmm`, see.
    set_comm(SERVER_COMM);
    loop {
        let received = match receive(&socket) {
            Ok(Some(r)) => r,
            Ok(None) => std::process::exit(0),
            Err(e) => {
                tracing::error!("the fork server's socket failed: {e}");
                std::process::exit(1)
            }
        };
        let reply = match (received.request, received.fds.len()) {
            (Err(e), _) => ForkReply::Failed {
                errno: None,
                message: e,
            },
            (Ok(ForkRequest::Fork {}), n) if n != FORK_FDS => ForkReply::Failed {
                errno: None,
                message: format!("a fork request carries {FORK_FDS} descriptors, not {n}"),
            },
            (Ok(ForkRequest::Fork {}), _) => match clone_parent() {
                Ok(0) => return become_child(socket, received.fds),
                Ok(pid) => ForkReply::Forked { pid: pid as u32 },
                Err(e) => ForkReply::Failed {
                    errno: e.raw_os_error(),
                    message: format!("clone: {e}"),
                },
            },
        };
        // The parent's copies of the child's descriptors are closed here
        // (dropped with `received`), so the pod sees EOF when the child ends.
        let sent = sendmsg(
            &socket,
            &[IoSlice::new(&reply.to_bytes())],
            &mut SendAncillaryBuffer::default(),
            SendFlags::NOSIGNAL,
        );
        if sent.is_err() {
            // The pod went away.
            std::process::exit(0);
        }
    }
}

/// One datagram and its descriptors; None at EOF (the pod closed its end).
fn receive(socket: &OwnedFd) -> std::io::Result<Option<Received>> {
    let mut buf = [0u8; MAX_FORK_MESSAGE];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(FORK_FDS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let msg = loop {
        match recvmsg(
            socket,
            &mut [IoSliceMut::new(&mut buf)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        ) {
            Ok(m) => break m,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    let mut fds = Vec::new();
    for message in control.drain() {
        if let RecvAncillaryMessage::ScmRights(rights) = message {
            fds.extend(rights);
        }
    }
    if msg.bytes == 0 && fds.is_empty() {
        return Ok(None);
    }
    let request = if msg.flags.contains(ReturnFlags::TRUNC) {
        Err(format!("a request over {MAX_FORK_MESSAGE} bytes"))
    } else if msg.flags.contains(ReturnFlags::CTRUNC) {
        Err(format!("a request with more than {FORK_FDS} descriptors"))
    } else {
        ForkRequest::from_bytes(&buf[..msg.bytes])
    };
    Ok(Some(Received { request, fds }))
}

/// `clone(CLONE_PARENT | SIGCHLD)`: a fork whose child is the pod's (this
/// process's parent's), so the pod waits for it and reads its exit status
/// as for a VMM it exec'd. 0 in the child, its pid in the parent.
fn clone_parent() -> std::io::Result<libc::pid_t> {
    let flags = (libc::CLONE_PARENT | libc::SIGCHLD) as libc::c_ulong;
    // SAFETY: clone(2) with no new stack, no tid pointers and no TLS: the
    // child goes on from here on a copy of this process's memory, as after
    // fork(2). This process has one thread (the fork server starts none),
    // so the child inherits no lock held by another thread; glibc's own
    // self-signals use gettid(2), not the cached tid this skips updating.
    let pid = unsafe {
        libc::syscall(
            libc::SYS_clone,
            flags,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        )
    };
    if pid < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(pid as libc::pid_t)
}

/// In the child: the request's descriptors become stdin, stdout and
/// stderr; the server's socket is closed; a process group of its own (a
/// restart of the pod must not take it along).
fn become_child(socket: OwnedFd, fds: Vec<OwnedFd>) -> Result<(), ChildSetupError> {
    drop(socket);
    set_comm(VMM_COMM);
    for (fd, (target, what)) in fds.iter().zip([(0, "stdin"), (1, "stdout"), (2, "stderr")]) {
        // SAFETY: dup2(2) of a descriptor this process owns onto a standard
        // one; no memory is involved.
        if unsafe { libc::dup2(fd.as_raw_fd(), target) } < 0 {
            return Err(ChildSetupError {
                what,
                source: std::io::Error::last_os_error(),
            });
        }
    }
    drop(fds);
    // SAFETY: setpgid(2) on this process; no memory is involved.
    if unsafe { libc::setpgid(0, 0) } < 0 {
        return Err(ChildSetupError {
            what: "process group",
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}
