//! `connect` (1.3): a connection becomes a byte pipe to a TCP port of the
//! agent's loopback (here the host's), or answers why not.

mod common;

use common::*;
use serde_json::json;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener};
use torpor_agent::proto::ReplyBody;
use torpor_agent::ClientError;

#[test]
fn connect_pipes_bytes_to_a_listening_port() {
    let agent = default_agent();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut got = Vec::new();
        s.read_to_end(&mut got).unwrap();
        s.write_all(b"got:").unwrap();
        s.write_all(&got).unwrap();
    });
    let mut pipe = agent.client().connect_port(port).unwrap();
    // Bytes that look like frames are only bytes now.
    pipe.write_all(&[0, 0, 0, 2, b'{', b'}']).unwrap();
    pipe.write_all(b"plain").unwrap();
    pipe.shutdown(Shutdown::Write).unwrap();
    let mut back = Vec::new();
    pipe.read_to_end(&mut back).unwrap();
    assert_eq!(back, b"got:\0\0\0\x02{}plain");
    server.join().unwrap();
}

#[test]
fn a_closed_port_is_refused_and_the_connection_still_speaks_the_protocol() {
    let agent = default_agent();
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    match agent.client().connect_port(port) {
        Err(ClientError::Agent(e)) => assert_eq!(e.code, "ECONNREFUSED", "{e}"),
        other => panic!("want ECONNREFUSED, got {other:?}"),
    }
    let mut s = agent.raw();
    hello(&mut s);
    send_json(&mut s, json!({"id": 1, "op": "connect", "port": port}));
    let r = recv(&mut s).unwrap();
    assert_eq!(r.id, Some(1));
    assert!(
        matches!(r.body, ReplyBody::Error(ref e) if e.code == "ECONNREFUSED"),
        "{r:?}"
    );
    send_json(&mut s, json!({"id": 2, "op": "ping"}));
    assert_eq!(recv(&mut s).unwrap().body, ReplyBody::Pong);
    // Port 0 is not a port.
    send_json(&mut s, json!({"id": 3, "op": "connect", "port": 0}));
    assert!(matches!(recv(&mut s).unwrap().body, ReplyBody::Error(ref e) if e.code == "EINVAL"));
}

#[test]
fn connect_is_refused_while_an_exec_runs_on_the_connection() {
    let agent = default_agent();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let mut s = agent.raw();
    hello(&mut s);
    send_json(
        &mut s,
        json!({"id": 1, "op": "exec", "argv": ["sleep", "5"]}),
    );
    send_json(&mut s, json!({"id": 2, "op": "connect", "port": port}));
    let r = recv(&mut s).unwrap();
    assert_eq!(r.id, Some(2));
    assert!(
        matches!(r.body, ReplyBody::Error(ref e) if e.code == "EBUSY"),
        "{r:?}"
    );
}
