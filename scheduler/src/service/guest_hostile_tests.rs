//! The service's agent client against a hostile guest: a stand-in agent
//! behind the hybrid vsock handshake that greets properly, then floods
//! frames, announces huge lengths, lies about file sizes, sends garbage or
//! never answers. Each request must fail with a typed error within its
//! deadline, and what the service holds must stay bounded.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::{Duration, Instant};

use torpor_agent::frame::{encode_frame, read_message, MAX_FRAME};
use torpor_agent::proto::Request;

use super::*;

/// Deadlines of the link under test where the deadline is what ends the
/// request: short, so that a guest that stalls fails the test quickly.
const FILE: Duration = Duration::from_millis(1500);
/// Where a cap must end the request first: generous, so that a loaded
/// machine cannot turn the cap's error into the deadline's.
const LONG: Duration = Duration::from_secs(60);
/// Slack for a loaded machine when checking that a request ended on time.
const LATE: Duration = Duration::from_secs(5);

/// What the stand-in agent does with the request after `hello`.
#[derive(Clone, Copy, Debug)]
enum Hostile {
    /// stdout chunks of 64 KiB, for ever.
    FloodOutput,
    /// Empty stdout chunks, for ever (no output, endless frames).
    FloodEmpty,
    /// A frame header announcing 4 GiB - 1.
    HugeLength,
    /// A frame header announcing 1 MiB, ten bytes of it, then silence.
    ShortFrame,
    /// Nothing at all.
    Silent,
    /// A frame of bytes that are not JSON.
    Garbage,
    /// `read_file` answers claiming a 10-byte file, each with 1 MiB of
    /// data and never `eof`.
    LyingSize,
    /// An error whose message is 100 KB.
    LongError,
}

fn send(conn: &mut UnixStream, reply: &serde_json::Value) -> std::io::Result<()> {
    conn.write_all(&encode_frame(reply, MAX_FRAME).expect("frame"))
}

/// Reads the `CONNECT` line, says OK, answers `hello`, reads one request
/// and answers it as `how` says. Write errors (the client gave up) end it.
fn serve(mut conn: UnixStream, how: Hostile) -> std::io::Result<()> {
    let mut b = [0u8; 1];
    while conn.read(&mut b)? == 1 && b[0] != b'\n' {}
    conn.write_all(b"OK 1073741824\n")?;
    let hello: Request = read_message(&mut conn, MAX_FRAME)
        .ok()
        .flatten()
        .expect("hello");
    send(
        &mut conn,
        &serde_json::json!({"id": hello.id, "type": "hello",
            "protocol": {"major": 1, "minor": 0}, "agent_version": "hostile"}),
    )?;
    let Ok(Some(req)) = read_message::<Request>(&mut conn, MAX_FRAME) else {
        return Ok(());
    };
    let id = req.id;
    match how {
        Hostile::FloodOutput => {
            let chunk = torpor_agent::b64::encode(&vec![b'x'; 64 << 10]);
            let frame = encode_frame(
                &serde_json::json!({"id": id, "type": "stdout", "data": chunk}),
                MAX_FRAME,
            )
            .expect("frame");
            loop {
                conn.write_all(&frame)?;
            }
        }
        Hostile::FloodEmpty => loop {
            send(
                &mut conn,
                &serde_json::json!({"id": id, "type": "stdout", "data": ""}),
            )?;
        },
        Hostile::HugeLength => conn.write_all(&u32::MAX.to_be_bytes())?,
        Hostile::ShortFrame => {
            conn.write_all(&(1u32 << 20).to_be_bytes())?;
            conn.write_all(b"{\"id\": 1, ")?;
        }
        Hostile::Silent => {}
        Hostile::Garbage => conn.write_all(b"\x00\x00\x00\x08garbage!")?,
        Hostile::LyingSize => {
            let chunk = torpor_agent::b64::encode(&vec![b'y'; 1 << 20]);
            let mut id = id;
            loop {
                // Answer every request the client still makes.
                send(
                    &mut conn,
                    &serde_json::json!({"id": id, "type": "file_data", "data": chunk,
                        "offset": 0, "size": 10, "eof": false}),
                )?;
                match read_message::<Request>(&mut conn, MAX_FRAME) {
                    Ok(Some(next)) => id = next.id,
                    _ => return Ok(()),
                }
            }
        }
        Hostile::LongError => send(
            &mut conn,
            &serde_json::json!({"id": id, "type": "error", "code": "E".repeat(5000),
                "errno": 5, "message": "m".repeat(100_000)}),
        )?,
    }
    // Keep the connection open (silent) until the client hangs up.
    let mut sink = [0u8; 4096];
    while conn.read(&mut sink)? > 0 {}
    Ok(())
}

/// A hybrid vsock socket whose every connection meets a hostile agent;
/// the link's deadlines are `limit` (file requests) and `limit / 3` (exec
/// slack).
fn hostile_agent(how: Hostile, limit: Duration) -> (tempfile::TempDir, AgentLink) {
    let dir = tempfile::tempdir().unwrap();
    let uds = dir.path().join(VSOCK_FILE);
    let listener = UnixListener::bind(&uds).unwrap();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { return };
            std::thread::spawn(move || {
                let _ = serve(conn, how);
            });
        }
    });
    let mut link = AgentLink::new("sbx_hostile", uds);
    link.file_limit = limit;
    link.exec_slack = limit / 3;
    (dir, link)
}

fn exec_req(max_output: u64) -> ExecRequest {
    ExecRequest {
        argv: vec!["true".into()],
        timeout_ms: Some(500),
        max_output_bytes: Some(max_output),
        ..Default::default()
    }
}

/// This process's resident set in KiB.
fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap()
}

fn ends_within<T: std::fmt::Debug>(
    limit: Duration,
    f: impl FnOnce() -> Result<T, GuestError>,
) -> GuestError {
    let started = Instant::now();
    let result = f();
    let took = started.elapsed();
    assert!(took < limit + LATE, "took {took:?}, deadline {limit:?}");
    result.expect_err("a hostile agent's request must fail")
}

#[test]
fn endless_output_fails_at_the_cap_and_memory_stays_bounded() {
    let (_dir, link) = hostile_agent(Hostile::FloodOutput, LONG);
    let before = rss_kib();
    let mut kept = 0usize;
    let e = ends_within(LONG, || {
        link.exec_streaming(exec_req(1 << 20), &Cancel::default(), &mut |_, data| {
            kept += data.len()
        })
    });
    assert!(matches!(e, GuestError::Misbehaved { .. }), "{e:?}");
    assert!(e.to_string().contains("1048576 bytes of output"), "{e}");
    assert!(kept <= 1 << 20, "{kept} bytes handed on past the 1 MiB cap");
    let e = ends_within(LONG, || link.exec(exec_req(1 << 20), &Cancel::default()));
    assert!(matches!(e, GuestError::Misbehaved { .. }), "{e:?}");
    // The bound: one frame (16 MiB at most) plus the cap, with room for the
    // test harness; an unbounded reader would hold gigabytes by now.
    let grown = rss_kib().saturating_sub(before);
    assert!(grown < 64 << 10, "RSS grew by {grown} KiB");
}

#[test]
fn endless_empty_frames_and_silence_end_at_the_deadline() {
    for how in [Hostile::FloodEmpty, Hostile::Silent, Hostile::ShortFrame] {
        let (_dir, link) = hostile_agent(how, FILE);
        let limit = Duration::from_millis(500) + FILE / 3;
        let e = ends_within(limit, || link.exec(exec_req(1 << 20), &Cancel::default()));
        assert!(matches!(e, GuestError::Deadline { .. }), "{how:?}: {e:?}");
        // Output frames are no answer to a listing.
        let e = ends_within(FILE, || link.list_dir("/"));
        match how {
            Hostile::FloodEmpty => assert!(matches!(e, GuestError::Misbehaved { .. }), "{e:?}"),
            _ => assert!(matches!(e, GuestError::Deadline { .. }), "{how:?}: {e:?}"),
        }
    }
}

#[test]
fn huge_lengths_and_garbage_fail_at_once() {
    for how in [Hostile::HugeLength, Hostile::Garbage] {
        let (_dir, link) = hostile_agent(how, LONG);
        let before = rss_kib();
        let e = ends_within(Duration::ZERO, || link.read_file("/f", MAX_READ_BYTES));
        assert!(matches!(e, GuestError::Misbehaved { .. }), "{how:?}: {e:?}");
        let grown = rss_kib().saturating_sub(before);
        assert!(grown < 16 << 10, "{how:?}: RSS grew by {grown} KiB");
    }
}

#[test]
fn file_reads_count_the_bytes_received_not_the_size_claimed() {
    let (_dir, link) = hostile_agent(Hostile::LyingSize, LONG);
    let e = ends_within(LONG, || link.read_file("/f", 3 << 20));
    match e {
        GuestError::TooLarge { size, limit, .. } => {
            assert_eq!(limit, 3 << 20);
            assert!(size > limit, "{size}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn guest_text_in_errors_is_cut_short() {
    let (_dir, link) = hostile_agent(Hostile::LongError, LONG);
    let e = ends_within(LONG, || link.list_dir("/"));
    let GuestError::Agent { error, .. } = &e else {
        panic!("{e:?}");
    };
    assert!(error.message.len() < 300, "{} bytes", error.message.len());
    assert!(error.code.len() < 300, "{} bytes", error.code.len());
    assert!(e.to_string().len() < 800, "{e}");
}
