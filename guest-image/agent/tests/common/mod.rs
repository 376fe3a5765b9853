//! Shared test harness: an in-process agent on a unix socket in a fresh
//! temporary directory, with fake system operations, and clients for it.
//! Every socket has a read timeout so that a hung agent fails the test.

#![allow(dead_code)]

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tempfile::TempDir;
use torpor_agent::frame::{read_message, MAX_FRAME};
use torpor_agent::proto::Reply;
use torpor_agent::{Agent, AgentClient, AgentConfig, FakeOps, ListenAddr, Listener};

/// How long any single read may block in a test.
pub const IO_TIMEOUT: Duration = Duration::from_secs(20);

/// Paths in a scratch directory as the protocol takes them.
pub trait ScratchPaths {
    /// `self/name` as a String (the protocol's paths are strings).
    fn file(&self, name: &str) -> String;
}

impl ScratchPaths for TempDir {
    fn file(&self, name: &str) -> String {
        self.path().join(name).to_str().unwrap().to_string()
    }
}

/// An agent serving on `sock` from a background thread.
pub struct TestAgent {
    pub dir: TempDir,
    pub sock: PathBuf,
    pub ops: Arc<FakeOps>,
}

pub fn start_agent(ops: FakeOps) -> TestAgent {
    start_agent_with(ops, |_| {})
}

/// An agent whose configuration `tune` adjusts.
pub fn start_agent_with(ops: FakeOps, tune: impl FnOnce(&mut AgentConfig)) -> TestAgent {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("agent.sock");
    let ops = Arc::new(ops);
    let mut cfg = AgentConfig::new(ops.clone());
    tune(&mut cfg);
    let agent = Agent::new(cfg);
    let listener = Listener::bind(&ListenAddr::Unix(sock.clone())).unwrap();
    std::thread::spawn(move || agent.serve(&listener));
    TestAgent { dir, sock, ops }
}

impl TestAgent {
    /// A connected socket, not yet greeted.
    pub fn raw(&self) -> UnixStream {
        let s = UnixStream::connect(&self.sock).unwrap();
        s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
        s.set_write_timeout(Some(IO_TIMEOUT)).unwrap();
        s
    }

    /// A greeted client.
    pub fn client(&self) -> AgentClient<UnixStream> {
        AgentClient::connect(self.raw(), "tests").unwrap()
    }
}

pub fn default_agent() -> TestAgent {
    start_agent(FakeOps::new().root(true))
}

/// Writes one frame with an arbitrary payload.
pub fn send_raw(s: &mut UnixStream, payload: &[u8]) {
    let mut frame = (payload.len() as u32).to_be_bytes().to_vec();
    frame.extend_from_slice(payload);
    s.write_all(&frame).unwrap();
}

/// Writes a JSON value as one frame.
pub fn send_json(s: &mut UnixStream, v: serde_json::Value) {
    send_raw(s, v.to_string().as_bytes());
}

/// Reads one reply; `None` when the agent closed the connection.
pub fn recv(s: &mut UnixStream) -> Option<Reply> {
    read_message(s, MAX_FRAME).unwrap()
}

/// Greets on a raw socket.
pub fn hello(s: &mut UnixStream) {
    send_json(
        s,
        serde_json::json!({"id": 0, "op": "hello", "protocol": {"major": 1, "minor": 0}}),
    );
    let r = recv(s).unwrap();
    assert_eq!(r.id, Some(0));
    assert!(
        matches!(r.body, torpor_agent::proto::ReplyBody::Hello(_)),
        "{r:?}"
    );
}

/// Whether `pid` is gone (or a zombie: dead, waiting to be reaped by init).
pub fn is_dead(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| rest.starts_with('Z') || rest.starts_with('X')),
    }
}

/// Polls until `pid` is dead or `limit` passes.
pub fn wait_dead(pid: i32, limit: Duration) -> bool {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if is_dead(pid) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    is_dead(pid)
}
