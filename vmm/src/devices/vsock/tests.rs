//! vsock device tests: real unix sockets in a temporary directory, guest
//! packets crafted on mock queues, the device pumped one epoll round at a
//! time. Every wait is bounded (see `Rig::pump_until`).

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::Duration;

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

use super::packet::*;
use super::testrig::{read_line, Rig, GUEST_CID, RX_BASE, RX_BUFS};
use super::*;
use crate::devices::virtio::testutil::{guest_mem, read32, write32};
use crate::devices::virtio::{MmioRestoreArgs, VirtioMmioState};
use crate::devices::Pausable;
use crate::snapshot::PageRuns;
use crate::snapshot::Persist;

const MEM: usize = 4 << 20;

fn read_exact_timeout(s: &mut UnixStream, n: usize) -> Vec<u8> {
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = vec![0u8; n];
    s.read_exact(&mut buf).unwrap();
    buf
}

fn assert_eof(s: &mut UnixStream) {
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut b = [0u8; 16];
    match s.read(&mut b) {
        Ok(0) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("expected EOF, got {other:?}"),
    }
}

#[test]
fn config_space_holds_the_guest_cid() {
    let mem = guest_mem(MEM);
    let r = Rig::new(&mem, "vsock-cfg");
    let mut t = r.t.lock().unwrap();
    assert_eq!(read32(&mut *t, 0x08), 19);
    assert_eq!(read32(&mut *t, 0x100), GUEST_CID as u32);
    assert_eq!(read32(&mut *t, 0x104), 0);
    drop(t);
    let bad = VsockConfig {
        cid: 2,
        uds_path: r.dir.path().join("x.sock"),
    };
    assert!(matches!(
        VsockDevice::new(&bad),
        Err(VsockError::ReservedCid(2))
    ));
}

#[test]
fn host_connect_handshake_relays_both_ways() {
    host_connect_relays(false);
}

/// With `worker`, the device thread (and its seccomp filter, if set up)
/// does the device's side.
fn host_connect_relays(worker: bool) {
    let mem = guest_mem(MEM);
    let mut r = Rig::new(&mem, "vsock-host");
    if worker {
        r.start_worker();
    }
    // Bytes right behind the CONNECT line are kept for the guest.
    let (mut host, port) = r.host_connect(52, b"early ");
    host.write_all(b"hello").unwrap();
    let mut got = Vec::new();
    r.pump_until(|r| {
        got.extend(r.take_data(port, 52));
        got.len() >= 11
    });
    assert_eq!(got, b"early hello");
    r.send(Rig::hdr(52, port, OP_RW), b"world");
    r.pump();
    assert_eq!(read_exact_timeout(&mut host, 5), b"world");
    assert_eq!(r.connections(), 1);
    // Interrupts were raised for the rx queue.
    assert_ne!(read32(&mut *r.t.lock().unwrap(), 0x60) & 1, 0);
}

#[test]
fn guest_connects_to_a_host_port_and_closes() {
    guest_connects_and_closes(false);
}

/// The worker thread does the device's side under its own seccomp filter:
/// host- and guest-initiated connections, data both ways, refusals,
/// shutdowns, pausing under traffic.
#[test]
fn the_worker_thread_runs_under_its_seccomp_filter() {
    if !crate::seccomp::tests::confined_child() {
        crate::seccomp::tests::run_in_confined_child(
            "devices::vsock::tests::the_worker_thread_runs_under_its_seccomp_filter",
        );
        return;
    }
    host_connect_relays(true);
    guest_connects_and_closes(true);
    worker_thread_serves_the_handshake();
    paused_worker_leaves_memory_and_queues_alone_under_traffic();
}

fn guest_connects_and_closes(worker: bool) {
    let mem = guest_mem(MEM);
    let mut r = Rig::new(&mem, "vsock-guest");
    if worker {
        r.start_worker();
    }
    let listener = UnixListener::bind(guest_target(&r.uds, 1234)).unwrap();
    r.send(Rig::hdr(5000, 1234, OP_REQUEST), &[]);
    let resp = r.expect(OP_RESPONSE);
    assert_eq!((resp.hdr.src_port, resp.hdr.dst_port), (1234, 5000));
    assert_eq!(resp.hdr.buf_alloc, CONN_BUF_ALLOC);
    let (mut host, _) = listener.accept().unwrap();
    r.send(Rig::hdr(5000, 1234, OP_RW), b"ping");
    r.pump();
    assert_eq!(read_exact_timeout(&mut host, 4), b"ping");
    host.write_all(b"pong").unwrap();
    let mut got = Vec::new();
    r.pump_until(|r| {
        got.extend(r.take_data(1234, 5000));
        got.len() >= 4
    });
    assert_eq!(got, b"pong");

    // Nobody listens on 9999: refused with RST.
    r.send(Rig::hdr(5001, 9999, OP_REQUEST), &[]);
    let rst = r.expect(OP_RST);
    assert_eq!((rst.hdr.src_port, rst.hdr.dst_port), (9999, 5001));

    // The guest closes: the host sees EOF and the guest gets its RST.
    let mut shut = Rig::hdr(5000, 1234, OP_SHUTDOWN);
    shut.flags = SHUTDOWN_RCV | SHUTDOWN_SEND;
    r.send(shut, &[]);
    let rst = r.expect(OP_RST);
    assert_eq!((rst.hdr.src_port, rst.hdr.dst_port), (1234, 5000));
    assert_eof(&mut host);
    assert_eq!(r.connections(), 0);
}

#[test]
fn resets_close_the_other_side() {
    let mem = guest_mem(MEM);
    let mut r = Rig::new(&mem, "vsock-rst");
    // Guest RST: the host stream ends, nothing is answered.
    let (mut host, port) = r.host_connect(52, b"");
    r.send(Rig::hdr(52, port, OP_RST), &[]);
    r.pump();
    assert_eof(&mut host);
    assert_eq!(r.connections(), 0);
    assert!(r.take(OP_RST).is_none());

    // The guest refuses a host connection: the host gets no OK, only EOF.
    let mut host = UnixStream::connect(&r.uds).unwrap();
    host.write_all(b"CONNECT 53\n").unwrap();
    let req = r.expect(OP_REQUEST);
    r.send(Rig::hdr(53, req.hdr.src_port, OP_RST), &[]);
    r.pump();
    assert_eof(&mut host);

    // The host closes: the guest is told (SHUTDOWN, send side), then RSTs.
    let (host, port) = r.host_connect(54, b"");
    drop(host);
    let shut = r.expect(OP_SHUTDOWN);
    assert_eq!(shut.hdr.flags, SHUTDOWN_SEND);
    assert_eq!(shut.hdr.src_port, port);
    r.send(Rig::hdr(54, port, OP_RST), &[]);
    r.pump();
    assert_eq!(r.connections(), 0);

    // Garbage instead of CONNECT: the host stream is dropped.
    let mut host = UnixStream::connect(&r.uds).unwrap();
    host.write_all(b"HELLO 1\n").unwrap();
    r.pump();
    r.pump();
    assert_eof(&mut host);
}

#[test]
fn credit_limits_what_the_guest_is_sent() {
    let mem = guest_mem(MEM);
    let mut r = Rig::new(&mem, "vsock-credit");
    let listener = UnixListener::bind(guest_target(&r.uds, 77)).unwrap();
    let mut req = Rig::hdr(6000, 77, OP_REQUEST);
    req.buf_alloc = 100;
    r.send(req, &[]);
    r.expect(OP_RESPONSE);
    let (mut host, _) = listener.accept().unwrap();
    host.write_all(&[7u8; 300]).unwrap();
    // Only 100 bytes fit the guest's buffer; then the device asks.
    let creq = r.expect(OP_CREDIT_REQUEST);
    assert_eq!(creq.hdr.dst_port, 6000);
    assert_eq!(r.take_data(77, 6000).len(), 100);
    // The guest consumed them: 100 more.
    let mut upd = Rig::hdr(6000, 77, OP_CREDIT_UPDATE);
    upd.buf_alloc = 100;
    upd.fwd_cnt = 100;
    r.send(upd, &[]);
    let mut got = 0;
    r.pump_until(|r| {
        got += r.take_data(77, 6000).len();
        got == 100
    });
    upd.fwd_cnt = 200;
    upd.buf_alloc = 1000;
    r.send(upd, &[]);
    r.pump_until(|r| {
        got += r.take_data(77, 6000).len();
        got == 200
    });

    // A credit request is answered with what was forwarded.
    r.send(Rig::hdr(6000, 77, OP_RW), &[1u8; 1000]);
    r.send(Rig::hdr(6000, 77, OP_CREDIT_REQUEST), &[]);
    let upd = r.expect(OP_CREDIT_UPDATE);
    assert_eq!((upd.hdr.buf_alloc, upd.hdr.fwd_cnt), (CONN_BUF_ALLOC, 1000));
    assert_eq!(read_exact_timeout(&mut host, 1000), [1u8; 1000]);

    // Forwarding a quarter of the buffer is announced unasked.
    let chunk = vec![2u8; 40 * 1024];
    r.send(Rig::hdr(6000, 77, OP_RW), &chunk);
    r.send(Rig::hdr(6000, 77, OP_RW), &chunk);
    let upd = r.expect(OP_CREDIT_UPDATE);
    assert_eq!(upd.hdr.fwd_cnt, 1000 + 80 * 1024);
    assert_eq!(read_exact_timeout(&mut host, 80 * 1024).len(), 80 * 1024);
}

#[test]
fn a_guest_overrunning_its_credit_is_reset() {
    let mem = guest_mem(MEM);
    let mut r = Rig::new(&mem, "vsock-overrun");
    let listener = UnixListener::bind(guest_target(&r.uds, 78)).unwrap();
    r.send(Rig::hdr(6001, 78, OP_REQUEST), &[]);
    r.expect(OP_RESPONSE);
    let (mut host, _) = listener.accept().unwrap();
    // The host never reads: its socket buffer fills, then ours.
    let chunk = vec![3u8; MAX_PKT_PAYLOAD as usize];
    for _ in 0..64 {
        r.send(Rig::hdr(6001, 78, OP_RW), &chunk);
        r.pump();
        if r.connections() == 0 {
            break;
        }
    }
    assert_eq!(r.connections(), 0, "connection reset");
    assert_eq!(r.expect(OP_RST).hdr.dst_port, 6001);
    host.set_nonblocking(true).unwrap();
    let mut sink = vec![0u8; 1 << 20];
    while matches!(host.read(&mut sink), Ok(n) if n > 0) {}
}

#[test]
fn bad_packets_are_refused() {
    let mem = guest_mem(MEM);
    let mut r = Rig::new(&mem, "vsock-bad");
    let (mut host, port) = r.host_connect(52, b"");

    // Unknown operation on a live connection: RST, and the host sees EOF.
    r.send(Rig::hdr(52, port, 42), &[]);
    assert_eq!(r.expect(OP_RST).hdr.src_port, port);
    assert_eof(&mut host);

    // RW longer than the packet limit, or than the payload present.
    for (len, desc) in [(MAX_PKT_PAYLOAD + 1, MAX_PKT_PAYLOAD + 1), (100, 50)] {
        let (mut host, port) = r.host_connect(52, b"");
        let mut h = Rig::hdr(52, port, OP_RW);
        h.len = len;
        r.send_raw(h, &[0u8; 8], Some(desc));
        assert_eq!(r.expect(OP_RST).hdr.src_port, port);
        assert_eof(&mut host);
    }
    // A control packet with a payload; a packet of another socket type.
    let mut h = Rig::hdr(1, 2, OP_CREDIT_REQUEST);
    h.len = 4;
    r.send_raw(h, &[0u8; 4], Some(4));
    assert_eq!(r.expect(OP_RST).hdr.dst_port, 1);
    let mut h = Rig::hdr(3, 4, OP_REQUEST);
    h.kind = 2;
    r.send(h, &[]);
    assert_eq!(r.expect(OP_RST).hdr.dst_port, 3);
    // Data or credit packets for connections that do not exist.
    r.send(Rig::hdr(5, 6, OP_RW), b"x");
    assert_eq!(r.expect(OP_RST).hdr.dst_port, 5);
    r.send(Rig::hdr(7, 8, OP_CREDIT_UPDATE), &[]);
    assert_eq!(r.expect(OP_RST).hdr.dst_port, 7);
    // Foreign CIDs and a stray RST are dropped without an answer.
    let mut h = Rig::hdr(9, 10, OP_REQUEST);
    h.src_cid = 99;
    r.send(h, &[]);
    r.send(Rig::hdr(11, 12, OP_RST), &[]);
    // A tx chain with only half a header, and one with a writable part.
    r.tx.push(&[(0x30_0000, 20, false)]);
    r.tx.push(&[(0x30_0000, 44, false), (0x30_1000, 8, true)]);
    r.notify(1);
    for _ in 0..5 {
        r.pump();
    }
    assert!(r.got.is_empty(), "unexpected {:?}", r.got);
    assert_eq!(r.connections(), 0);
    // The device still works.
    r.host_connect(52, b"");
}

#[test]
fn unanswered_requests_and_silent_hosts_time_out() {
    let mem = guest_mem(MEM);
    let mut r = Rig::new(&mem, "vsock-timeout");
    {
        let mut t = r.t.lock().unwrap();
        let dev = t.device_mut();
        dev.timeouts.connect = Duration::from_millis(50);
        dev.timeouts.handshake = Duration::from_millis(50);
    }
    let mut host = UnixStream::connect(&r.uds).unwrap();
    host.write_all(b"CONNECT 60\n").unwrap();
    let req = r.expect(OP_REQUEST);
    // This driver never acknowledges interrupts: the status stays pending.
    r.interrupts();
    // The guest never answers: RST after the deadline, host stream closed.
    let rst = r.expect(OP_RST);
    assert_eq!(rst.hdr.src_port, req.hdr.src_port);
    assert_eof(&mut host);
    // One interrupt for the RST, one raised again because the unanswered
    // connection found the last one unacknowledged (a lost edge).
    let raised = r.interrupts();
    assert_eq!(raised, 2, "interrupts raised after the deadline");
    // A host that never says CONNECT is dropped too.
    let mut quiet = UnixStream::connect(&r.uds).unwrap();
    quiet.write_all(b"CONN").unwrap();
    for _ in 0..10 {
        r.pump();
    }
    assert_eof(&mut quiet);
}

/// A driver that lost an interrupt takes nothing back and answers nothing:
/// long before the connect deadline the device raises the unacknowledged
/// interrupt again, and the connection survives to be accepted.
#[test]
fn a_slow_answer_raises_the_unacknowledged_interrupt_again() {
    let mem = guest_mem(MEM);
    let mut r = Rig::new(&mem, "vsock-nudge");
    r.t.lock().unwrap().device_mut().timeouts.nudge = Duration::from_millis(30);
    let mut host = UnixStream::connect(&r.uds).unwrap();
    host.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    host.write_all(b"CONNECT 52\n").unwrap();
    let req = r.expect(OP_REQUEST);
    r.interrupts();
    // Nothing else happens on the device; only the nudge raises.
    let start = std::time::Instant::now();
    let mut raised = 0;
    while raised == 0 && start.elapsed() < Duration::from_secs(5) {
        poll_once(&r.t, &r.epoll, Some(20)).unwrap();
        raised = r.interrupts();
    }
    assert_eq!(raised, 1, "the interrupt was raised again once");
    assert!(start.elapsed() < Duration::from_secs(5));
    assert_eq!(r.connections(), 1, "the connection waits on");
    // Once: later polls raise nothing more.
    for _ in 0..5 {
        poll_once(&r.t, &r.epoll, Some(20)).unwrap();
    }
    assert_eq!(r.interrupts(), 0);
    // The guest answers after all.
    r.send(Rig::hdr(52, req.hdr.src_port, OP_RESPONSE), &[]);
    r.pump();
    assert_eq!(read_line(&mut host), format!("OK {}", req.hdr.src_port));
}

#[test]
fn driver_reset_drops_connections() {
    let mem = guest_mem(MEM);
    let mut r = Rig::new(&mem, "vsock-reset");
    let (mut host, _) = r.host_connect(52, b"");
    write32(&mut *r.t.lock().unwrap(), 0x70, 0);
    assert_eq!(r.connections(), 0);
    assert_eof(&mut host);
}

/// A Linux driver resets the device at probe time, on a vCPU thread, when
/// a host client may already wait on the socket: the reset runs under the
/// vCPU's filter.
#[test]
fn driver_reset_runs_under_the_vcpu_filter() {
    if !crate::seccomp::tests::confined_child() {
        crate::seccomp::tests::run_in_confined_child(
            "devices::vsock::tests::driver_reset_runs_under_the_vcpu_filter",
        );
        return;
    }
    let mem = guest_mem(MEM);
    let mut r = Rig::new(&mem, "vsock-reset-vcpu");
    let (mut host, _) = r.host_connect(52, b"");
    let transport = r.t.clone();
    std::thread::spawn(move || {
        crate::seccomp::enter(crate::seccomp::ThreadKind::Vcpu);
        write32(&mut *transport.lock().unwrap(), 0x70, 0);
    })
    .join()
    .unwrap();
    assert_eq!(r.connections(), 0);
    assert_eof(&mut host);
}

/// `r`'s device restored from `state` into another "VM" whose memory
/// (`mem`) is a copy of `r`'s, on a new socket.
fn restored<'b>(
    r: &Rig<'_>,
    mem: &'b GuestMemoryMmap,
    state: &VirtioMmioState<VsockState>,
) -> Rig<'b> {
    r.clone_into(mem, |uds| {
        let args = MmioRestoreArgs {
            mem: mem.clone(),
            irq: EventFd::new(libc::EFD_NONBLOCK).unwrap(),
            device: VsockRestoreArgs {
                uds_path: Some(uds),
                cid: None,
            },
        };
        VsockMmio::restore(args, state).unwrap()
    })
}

#[test]
fn restore_resets_the_transport_and_serves_again() {
    let mem = guest_mem(MEM);
    let mut r = Rig::new(&mem, "vsock-restore");
    let (mut old_host, _) = r.host_connect(52, b"");
    let state = r.t.lock().unwrap().save();
    let bytes = bincode::serialize(&state).unwrap();
    let state: VirtioMmioState<VsockState> = bincode::deserialize(&bytes).unwrap();
    assert_eq!(state.device.cid, GUEST_CID);
    assert_eq!(state.transport.queues.len(), 3);

    // Restore into another "VM" whose memory is a copy, on a new socket.
    let mem2 = guest_mem(MEM);
    let mut r2 = restored(&r, &mem2, &state);
    assert!(r2.t.lock().unwrap().is_activated());
    drop(r);
    assert_eof(&mut old_host);

    // The guest gets VIRTIO_VSOCK_EVENT_TRANSPORT_RESET once it offers an
    // event buffer.
    r2.handle_transport_reset(0x3f_0000);
    // New connections work on the new socket, with the old rx buffers.
    r2.host_connect(52, b"");
}

/// Linux resets every connected socket when it handles the transport
/// reset, in a work item of its own: a connection the host opens after a
/// restore must not reach the guest before that, or it is reset with the
/// snapshot's (a wake's first agent call saw "the agent closed the
/// connection"). The REQUEST waits until the driver refilled its event
/// queue; with a driver that never does, until the hold's limit.
#[test]
fn a_restored_device_holds_rx_until_the_driver_handled_the_reset() {
    let mem = guest_mem(MEM);
    let mut r = Rig::new(&mem, "vsock-hold");
    r.host_connect(52, b"");
    let state = r.t.lock().unwrap().save();
    let mem2 = guest_mem(MEM);
    let mut r2 = restored(&r, &mem2, &state);
    r2.got.clear();
    let mut host = UnixStream::connect(&r2.uds).unwrap();
    host.write_all(b"CONNECT 52\n").unwrap();
    for _ in 0..5 {
        r2.pump();
    }
    assert!(
        r2.take(OP_REQUEST).is_none(),
        "REQUEST before the reset was delivered"
    );
    // The event goes out; the REQUEST still waits for its handling.
    r2.ev.push(&[(0x3f_0000, 4, true)]);
    r2.notify(2);
    r2.pump_until(|r| !r.ev.take_used().is_empty());
    for _ in 0..5 {
        r2.pump();
    }
    assert!(
        r2.take(OP_REQUEST).is_none(),
        "REQUEST before the reset was handled"
    );
    // The driver refills its event queue: handled; the REQUEST goes out.
    r2.ev.push(&[(0x3f_0000, 4, true)]);
    r2.notify(2);
    let req = r2.expect(OP_REQUEST);
    assert_eq!(req.hdr.dst_port, 52);

    // A driver that takes the event and never refills: the hold ends at
    // its limit (shortened here) and the REQUEST goes out after all.
    let mem3 = guest_mem(MEM);
    let mut r3 = restored(&r, &mem3, &state);
    r3.got.clear();
    let mut host3 = UnixStream::connect(&r3.uds).unwrap();
    host3.write_all(b"CONNECT 52\n").unwrap();
    r3.ev.push(&[(0x3f_0000, 4, true)]);
    r3.notify(2);
    r3.pump_until(|r| !r.ev.take_used().is_empty());
    assert!(r3.take(OP_REQUEST).is_none());
    if let Some(hold) = r3.t.lock().unwrap().device_mut().reset_hold.as_mut() {
        hold.until = Some(std::time::Instant::now());
    }
    r3.expect(OP_REQUEST);
}

/// The guest of a restored snapshot may still hold the sockets of the
/// connections it had (until it handles the transport reset, and a reset
/// socket until its owner closes it): a restored device's connections do
/// not reuse their host ports, and two restores of one snapshot do not
/// share theirs.
#[test]
fn a_restored_device_does_not_reuse_the_snapshots_host_ports() {
    let mem = guest_mem(MEM);
    let mut r = Rig::new(&mem, "vsock-ports");
    let before: Vec<u32> = (0..3).map(|_| r.host_connect(52, b"").1).collect();
    let state = r.t.lock().unwrap().save();
    let mut firsts = Vec::new();
    for n in 0..2 {
        let mem2 = guest_mem(MEM);
        let mut r2 = restored(&r, &mem2, &state);
        r2.handle_transport_reset(0x3f_0000);
        let after: Vec<u32> = (0..3).map(|_| r2.host_connect(52, b"").1).collect();
        assert!(
            after.iter().all(|p| !before.contains(p)),
            "restore {n} reuses the snapshot's host ports: {after:?} after {before:?}"
        );
        firsts.push(after[0]);
    }
    assert_ne!(
        firsts[0], firsts[1],
        "two restores start at the same host port"
    );
}

#[test]
fn worker_thread_serves_the_handshake() {
    let mem = guest_mem(MEM);
    let mut r = Rig::new(&mem, "vsock-worker");
    let worker = VsockWorker::spawn(r.t.clone()).unwrap();
    let mut host = UnixStream::connect(&r.uds).unwrap();
    host.write_all(b"CONNECT 52\n").unwrap();
    // The thread delivers the REQUEST into an rx buffer on its own.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while r.rx.take_used().is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "worker delivered nothing"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    worker.stop();
    // The stopped thread no longer holds anything: the rig still works.
    r.send(Rig::hdr(1, 2, OP_RW), b"x");
    assert_eq!(r.expect(OP_RST).hdr.dst_port, 1);
}

/// Bytes `from..from + len` of the numbered stream a host sends.
fn numbered(from: usize, len: usize) -> Vec<u8> {
    (from..from + len).map(|i| (i % 251) as u8).collect()
}

/// What a snapshot of the device takes, in the VMM's order: its saved
/// state, the pages it wrote since the last snapshot, all of guest memory;
/// and the interrupts raised since the last look.
struct Frozen {
    state: VirtioMmioState<VsockState>,
    dirty: PageRuns,
    memory: Vec<u8>,
    irqs: u64,
}

fn freeze(r: &Rig<'_>) -> Frozen {
    let mut t = r.t.lock().unwrap();
    let state = t.save();
    let dirty = t.take_dirty_pages();
    let irqs = t.interrupt().eventfd().read().unwrap_or(0);
    drop(t);
    let mut memory = vec![0u8; MEM];
    r.mem.read_slice(&mut memory, GuestAddress(0)).unwrap();
    Frozen {
        state,
        dirty,
        memory,
        irqs,
    }
}

/// Every rx-buffer page (only the device writes those) that changed
/// between two snapshots is in the second one's dirty set.
fn assert_dirty_covers(before: &[u8], after: &Frozen) {
    let pages = RX_BASE / PAGE..(RX_BASE + RX_BUFS * 0x2000) / PAGE;
    let mut changed = 0;
    for page in pages {
        let range = (page * PAGE) as usize..((page + 1) * PAGE) as usize;
        if before[range.clone()] != after.memory[range] {
            changed += 1;
            assert!(after.dirty.contains(page), "page {page} written, not dirty");
        }
    }
    assert!(
        changed > 0,
        "the device wrote no rx buffer since the last pause"
    );
}

const PAGE: u64 = 4096;

/// The used index in memory is the one saved: the rings and the queue
/// state were taken at the same moment.
fn assert_rings_match(state: &VirtioMmioState<VsockState>, memory: &[u8]) {
    for (i, q) in state.transport.queues.iter().enumerate() {
        if q.ready {
            let at = q.used_ring as usize + 2;
            let idx = u16::from_le_bytes([memory[at], memory[at + 1]]);
            assert_eq!(idx, q.next_used, "queue {i}: used index in memory vs saved");
        }
    }
}

/// Host side: sends `chunks` numbered chunks of `chunk` bytes, pausing
/// `gap` between them; returns the stream when done.
fn send_numbered(
    mut host: UnixStream,
    chunk: usize,
    chunks: usize,
    gap: Duration,
) -> std::thread::JoinHandle<UnixStream> {
    std::thread::spawn(move || {
        for i in 0..chunks {
            host.write_all(&numbered(i * chunk, chunk)).unwrap();
            std::thread::sleep(gap);
        }
        host
    })
}

#[test]
fn paused_worker_leaves_memory_and_queues_alone_under_traffic() {
    const CHUNK: usize = 1024;
    // 160 KiB: within the guest's 256 KiB buffer, no credit updates needed.
    const CHUNKS: usize = 160;
    const TOTAL: usize = CHUNK * CHUNKS;
    const ROUNDS: usize = 4;
    let mem = guest_mem(MEM);
    let mem2 = guest_mem(MEM);
    let mut r = Rig::new(&mem, "vsock-pause");
    let (host, port) = r.host_connect(52, b"");
    let mut before = freeze(&r).memory;
    r.start_worker();
    // Small paced writes: data keeps arriving through every pause.
    let sender = send_numbered(host, CHUNK, CHUNKS, Duration::from_millis(1));
    let mut got = Vec::new();
    let mut rounds = 0;
    let mut clone = None;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while got.len() < TOTAL {
        assert!(
            std::time::Instant::now() < deadline,
            "traffic stalled at {} of {TOTAL} bytes",
            got.len()
        );
        r.pump();
        got.extend(r.take_data(port, 52));
        if rounds < ROUNDS && got.len() >= (rounds + 1) * TOTAL / (ROUNDS + 1) {
            // The vCPUs are paused (this fake guest stops), then the device.
            r.worker.as_ref().unwrap().pause().unwrap();
            let snap = freeze(&r);
            std::thread::sleep(Duration::from_millis(30));
            let again = freeze(&r);
            assert_eq!(
                snap.state, again.state,
                "round {rounds}: device state changed while paused"
            );
            assert!(
                snap.memory == again.memory,
                "round {rounds}: guest memory changed while paused"
            );
            assert_eq!(
                again.irqs, 0,
                "round {rounds}: interrupt raised while paused"
            );
            // Nothing written since but the used rings, always listed.
            let rings: Vec<u64> = snap
                .state
                .transport
                .queues
                .iter()
                .map(|q| q.used_ring / PAGE)
                .collect();
            assert!(again.dirty.iter_pages().all(|p| rings.contains(&p)));
            assert_rings_match(&snap.state, &snap.memory);
            assert_dirty_covers(&before, &snap);
            assert!(r.worker.as_ref().unwrap().is_paused());
            let state = snap.state;
            before = snap.memory;
            if rounds == 1 {
                // The snapshot, restored into a fresh device.
                clone = Some(r.clone_into(&mem2, |uds| {
                    let args = MmioRestoreArgs {
                        mem: mem2.clone(),
                        irq: EventFd::new(libc::EFD_NONBLOCK).unwrap(),
                        device: VsockRestoreArgs {
                            uds_path: Some(uds),
                            cid: None,
                        },
                    };
                    VsockMmio::restore(args, &state).unwrap()
                }));
            }
            r.worker.as_ref().unwrap().resume().unwrap();
            assert!(!r.worker.as_ref().unwrap().is_paused());
            rounds += 1;
        }
    }
    assert_eq!(rounds, ROUNDS);
    assert!(got == numbered(0, TOTAL), "bytes lost or duplicated");
    let mut host = sender.join().unwrap();
    r.send(Rig::hdr(52, port, OP_RW), b"done");
    assert_eq!(read_exact_timeout(&mut host, 4), b"done");
    drop(r);

    // The restored device starts running and serves the guest from the
    // snapshot's rings: the transport reset, then a new connection.
    let mut r2 = clone.unwrap();
    r2.start_worker();
    r2.pump();
    // Packets of the old connection, in rx buffers the guest had not
    // read yet: the transport reset drops them.
    r2.got.clear();
    r2.handle_transport_reset(0x3f_0000);
    let (host, port) = r2.host_connect(52, b"");
    let sender = send_numbered(host, CHUNK, 64, Duration::ZERO);
    let mut got = Vec::new();
    r2.pump_until(|r| {
        got.extend(r.take_data(port, 52));
        got.len() >= 64 * CHUNK
    });
    assert!(got == numbered(0, 64 * CHUNK), "bytes lost or duplicated");
    let mut host = sender.join().unwrap();
    r2.send(Rig::hdr(52, port, OP_RW), b"done");
    assert_eq!(read_exact_timeout(&mut host, 4), b"done");
}

#[test]
fn a_worker_started_paused_waits_for_resume() {
    let mem = guest_mem(MEM);
    let mut r = Rig::new(&mem, "vsock-start-paused");
    let worker = VsockWorker::spawn_paused(r.t.clone()).unwrap();
    worker.pause().unwrap();
    assert!(worker.is_paused());
    let mut host = UnixStream::connect(&r.uds).unwrap();
    host.write_all(b"CONNECT 52\n").unwrap();
    std::thread::sleep(Duration::from_millis(30));
    assert_eq!(r.connections(), 0, "handshake served while paused");
    assert!(r.rx.take_used().is_empty(), "rx buffer used while paused");
    worker.resume().unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while r.rx.take_used().is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "nothing delivered after resume"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(r.connections(), 1);
    // Pausing twice, resuming twice: harmless.
    worker.pause().unwrap();
    worker.pause().unwrap();
    worker.resume().unwrap();
    worker.resume().unwrap();
    // Stopping a paused worker does not hang.
    worker.pause().unwrap();
    worker.stop();
}
