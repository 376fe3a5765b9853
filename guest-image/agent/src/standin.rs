//! For host tests: a stand-in for the VMM's hybrid vsock socket in front
//! of an agent serving this host's filesystem. A host connects to the
//! stand-in's unix socket, writes `CONNECT <port>\n`, reads `OK <n>\n` (or
//! `REFUSED\n` for another port), then speaks the agent protocol, exactly
//! as through a VMM. Not used by the agent itself.

use crate::{Agent, AgentConfig, FakeOps, ListenAddr, Listener, DEFAULT_VSOCK_PORT};
use std::io::{self, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Starts an agent on `dir/agent.sock` (fake system operations, as root)
/// configured by `tune`, and the stand-in on `dir/vsock.sock`; returns the
/// stand-in's path. Both serve from background threads for the rest of
/// the process.
pub fn start(dir: &Path, tune: impl FnOnce(&mut AgentConfig)) -> io::Result<PathBuf> {
    let agent_sock = dir.join("agent.sock");
    let mut cfg = AgentConfig::new(Arc::new(FakeOps::new().root(true)));
    tune(&mut cfg);
    let agent = Agent::new(cfg);
    let listener = Listener::bind(&ListenAddr::Unix(agent_sock.clone()))?;
    std::thread::spawn(move || agent.serve(&listener));

    let vsock = dir.join("vsock.sock");
    let front = UnixListener::bind(&vsock)?;
    std::thread::spawn(move || {
        for host in front.incoming() {
            let Ok(mut host) = host else { return };
            let agent_sock = agent_sock.clone();
            std::thread::spawn(move || forward(&mut host, &agent_sock));
        }
    });
    Ok(vsock)
}

/// Reads the `CONNECT` line byte by byte (nothing behind it may be lost),
/// answers as the VMM does, then splices the two streams.
fn forward(host: &mut UnixStream, agent_sock: &Path) {
    let mut line = Vec::new();
    let mut byte = [0u8];
    while line.len() < 64 && host.read_exact(&mut byte).is_ok() && byte[0] != b'\n' {
        line.push(byte[0]);
    }
    if line != format!("CONNECT {DEFAULT_VSOCK_PORT}").as_bytes() {
        let _ = host.write_all(b"REFUSED\n");
        return;
    }
    let Ok(guest) = UnixStream::connect(agent_sock) else {
        return;
    };
    if host.write_all(b"OK 1073741824\n").is_err() {
        return;
    }
    let (Ok(mut h2), Ok(mut g2)) = (host.try_clone(), guest.try_clone()) else {
        return;
    };
    let mut guest = guest;
    let up = std::thread::spawn(move || {
        let _ = io::copy(&mut h2, &mut guest);
        let _ = guest.shutdown(std::net::Shutdown::Write);
    });
    let _ = io::copy(&mut g2, host);
    let _ = host.shutdown(std::net::Shutdown::Write);
    let _ = up.join();
}
