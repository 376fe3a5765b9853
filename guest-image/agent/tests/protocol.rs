//! Handshake, bad input, ping/info and `resumed` over a unix socket; one
//! test runs the real binary.

mod common;

use common::*;
use serde_json::json;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use torpor_agent::proto::{ReplyBody, ResumedRequest, StepStatus};
use torpor_agent::{AgentClient, FakeCall, FakeOps, IdentityPage, PROTOCOL_VERSION};

fn expect_error(s: &mut UnixStream, id: Option<u64>, code: &str) -> String {
    let r = recv(s).expect("an error reply before any close");
    assert_eq!(r.id, id, "{r:?}");
    match r.body {
        ReplyBody::Error(e) => {
            assert_eq!(e.code, code, "{e}");
            e.message
        }
        other => panic!("expected {code}, got {other:?}"),
    }
}

fn expect_closed(s: &mut UnixStream) {
    let mut buf = [0u8; 1];
    assert_eq!(s.read(&mut buf).unwrap(), 0, "connection should be closed");
}

#[test]
fn hello_reports_versions() {
    let agent = default_agent();
    let c = agent.client();
    assert_eq!(c.agent().protocol, PROTOCOL_VERSION);
    assert_eq!(c.agent().agent_version, env!("CARGO_PKG_VERSION"));
}

#[test]
fn an_incompatible_major_is_refused() {
    let agent = default_agent();
    let mut s = agent.raw();
    send_json(
        &mut s,
        json!({"id": 0, "op": "hello", "protocol": {"major": 2, "minor": 0}, "client": "future"}),
    );
    let msg = expect_error(&mut s, Some(0), "EPROTO");
    assert!(msg.contains("incompatible protocol 2.0"), "{msg}");
    assert!(msg.contains(&format!("speaks {PROTOCOL_VERSION}")), "{msg}");
    expect_closed(&mut s);

    // A newer minor is fine.
    let mut s = agent.raw();
    send_json(
        &mut s,
        json!({"id": 0, "op": "hello", "protocol": {"major": 1, "minor": 9}}),
    );
    assert!(matches!(recv(&mut s).unwrap().body, ReplyBody::Hello(_)));
}

#[test]
fn requests_before_hello_are_refused() {
    let agent = default_agent();
    let mut s = agent.raw();
    send_json(&mut s, json!({"id": 1, "op": "ping"}));
    expect_error(&mut s, Some(1), "EPROTO");
    expect_closed(&mut s);
}

#[test]
fn malformed_frames_get_errors_and_the_connection_survives() {
    let agent = default_agent();
    let mut s = agent.raw();
    hello(&mut s);
    send_raw(&mut s, b"{not json");
    expect_error(&mut s, None, "EBADMSG");
    send_raw(&mut s, b"[1,2,3]");
    expect_error(&mut s, None, "EBADMSG");
    send_raw(&mut s, &[0xff, 0xfe, 0x00]);
    expect_error(&mut s, None, "EBADMSG");
    s.write_all(&[0, 0, 0, 0]).unwrap();
    expect_error(&mut s, None, "EBADMSG");
    send_json(&mut s, json!({"op": "ping"}));
    expect_error(&mut s, None, "EINVAL");
    send_json(&mut s, json!({"id": -1, "op": "ping"}));
    expect_error(&mut s, None, "EINVAL");
    send_json(&mut s, json!({"id": 3}));
    expect_error(&mut s, Some(3), "EINVAL");
    let msg = {
        send_json(&mut s, json!({"id": 4, "op": "frobnicate"}));
        expect_error(&mut s, Some(4), "ENOSYS")
    };
    assert!(msg.contains("frobnicate"), "{msg}");
    send_json(&mut s, json!({"id": 5, "op": "exec", "argv": "not a list"}));
    expect_error(&mut s, Some(5), "EINVAL");
    send_json(
        &mut s,
        json!({"id": 6, "op": "write_file", "path": "/tmp/x", "data": "@@"}),
    );
    expect_error(&mut s, Some(6), "EINVAL");
    send_json(
        &mut s,
        json!({"id": 7, "op": "hello", "protocol": {"major": 1, "minor": 0}}),
    );
    expect_error(&mut s, Some(7), "EPROTO");
    // Still serving.
    send_json(&mut s, json!({"id": 8, "op": "ping", "unknown_field": 1}));
    let r = recv(&mut s).unwrap();
    assert_eq!((r.id, r.body), (Some(8), ReplyBody::Pong));
}

#[test]
fn oversized_frames_close_the_connection_cleanly() {
    let agent = default_agent();
    let mut s = agent.raw();
    hello(&mut s);
    s.write_all(&(16u32 << 20 | 1).to_be_bytes()).unwrap();
    let msg = expect_error(&mut s, None, "EMSGSIZE");
    assert!(msg.contains("exceeds"), "{msg}");
    expect_closed(&mut s);
    // The agent itself is fine.
    agent.client().ping().unwrap();
}

#[test]
fn truncated_frames_and_abrupt_closes_are_harmless() {
    let agent = default_agent();
    for junk in [&[0u8, 0][..], &[0, 0, 0, 10, b'{'][..]] {
        let mut s = agent.raw();
        hello(&mut s);
        s.write_all(junk).unwrap();
        drop(s);
    }
    let mut s = agent.raw();
    s.write_all(&[0, 0, 0, 200]).unwrap();
    s.shutdown(std::net::Shutdown::Write).unwrap();
    expect_closed(&mut s);
    agent.client().ping().unwrap();
}

#[test]
fn ping_and_info() {
    let agent = default_agent();
    let mut c = agent.client();
    c.ping().unwrap();
    let info = c.info().unwrap();
    assert_eq!(info.protocol, PROTOCOL_VERSION);
    assert_eq!(info.agent_version, env!("CARGO_PKG_VERSION"));
    assert!(!info.hostname.is_empty());
    assert_eq!(info.boot_id.len(), 36, "{:?}", info.boot_id);
    assert!(info.system_uptime_ms > 0);
    assert!(!info.kernel.is_empty());
}

#[test]
fn resumed_with_host_values() {
    let agent = start_agent(FakeOps::new().root(true));
    let r = agent
        .client()
        .resumed(ResumedRequest {
            wall_clock_ns: Some(1_700_000_000_000_000_000),
            seed: Some(vec![0xaa; 32]),
            hostname: Some("sbx-7".into()),
            sandbox_id: Some("sbx-7".into()),
        })
        .unwrap();
    assert_eq!(r.identity_page.status, StepStatus::Skipped);
    for step in [
        &r.clock,
        &r.rng_write,
        &r.rng_credit,
        &r.hostname,
        &r.identity,
    ] {
        assert_eq!(step.status, StepStatus::Ok, "{step:?}");
    }
    assert_eq!(
        agent.ops.calls(),
        [
            FakeCall::SetWallClock(1_700_000_000_000_000_000),
            FakeCall::WriteUrandom(vec![0xaa; 32]),
            FakeCall::CreditEntropy(vec![0xaa; 32]),
            FakeCall::SetHostname("sbx-7".into()),
            FakeCall::WriteIdentity("sbx-7".into()),
            FakeCall::AnnounceNetwork,
        ]
    );
    assert_eq!(r.network.unwrap().status, StepStatus::Ok);
}

#[test]
fn resumed_reports_each_failure_and_falls_back_to_the_page() {
    let page = IdentityPage {
        generation: 3,
        seed: [5; 32],
        wall_clock_ns: 42,
    };
    let ops = FakeOps::new()
        .page(page)
        .failing("SetWallClock", libc::EPERM)
        .failing("SetHostname", libc::EPERM);
    let agent = start_agent(ops);
    let r = agent
        .client()
        .resumed(ResumedRequest {
            hostname: Some("h".into()),
            ..Default::default()
        })
        .unwrap();
    assert_eq!(r.generation, Some(3));
    assert_eq!(r.identity_page.status, StepStatus::Ok);
    assert_eq!(r.clock.error.as_ref().unwrap().code, "EPERM");
    assert_eq!(r.rng_write.status, StepStatus::Ok);
    assert_eq!(r.rng_credit.status, StepStatus::Skipped, "not root");
    assert_eq!(r.hostname.error.as_ref().unwrap().code, "EPERM");
    assert_eq!(r.identity.status, StepStatus::Skipped);
    assert!(agent
        .ops
        .calls()
        .contains(&FakeCall::WriteUrandom(vec![5; 32])));
}

/// Kills the spawned agent binary on drop.
struct Reap(Child);
impl Drop for Reap {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn the_binary_serves_a_unix_socket() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("a.sock");
    let child = Command::new(env!("CARGO_BIN_EXE_torpor-agent"))
        .arg("--listen")
        .arg(format!("unix:{}", sock.display()))
        .arg("--fake-system")
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let _reap = Reap(child);
    let deadline = Instant::now() + Duration::from_secs(10);
    let stream = loop {
        match UnixStream::connect(&sock) {
            Ok(s) => break s,
            Err(e) if Instant::now() > deadline => panic!("agent never listened: {e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    };
    stream.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    let mut c = AgentClient::connect(stream, "tests").unwrap();
    c.ping().unwrap();
    let out = c
        .exec_collect(torpor_agent::proto::ExecRequest {
            argv: vec!["echo".into(), "from the binary".into()],
            ..Default::default()
        })
        .unwrap();
    assert_eq!(out.stdout, b"from the binary\n");
    let r = c
        .resumed(ResumedRequest {
            hostname: Some("not-really".into()),
            ..Default::default()
        })
        .unwrap();
    assert_eq!(
        r.hostname.status,
        StepStatus::Ok,
        "--fake-system only pretends"
    );
    assert_ne!(torpor_agent::system::hostname(), "not-really");
}
