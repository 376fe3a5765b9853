//! Net device tests: a real tap in a network namespace each test creates,
//! a UDP socket there as the host, frames crafted by a fake guest driver
//! on mock queues, the device pumped one epoll round at a time (or by its
//! own thread). Rate limits run on a clock the test moves. Every wait is
//! bounded.

use std::time::Duration;

use virtio_bindings::virtio_net::{
    VIRTIO_NET_F_CSUM, VIRTIO_NET_F_GUEST_CSUM, VIRTIO_NET_F_GUEST_TSO4, VIRTIO_NET_F_MAC,
    VIRTIO_NET_F_MRG_RXBUF, VIRTIO_NET_HDR_GSO_TCPV4,
};
use vmm_sys_util::eventfd::EventFd;

use super::testrig::*;
use super::*;
use crate::devices::rate_limiter::{RateLimit, TokenRate};
use crate::devices::virtio::testutil::{guest_mem, read32};
use crate::devices::virtio::{MmioRestoreArgs, VirtioDevice, VIRTIO_F_VERSION_1};
use crate::devices::worker::poll_once;
use crate::devices::worker::EpollDevice;
use crate::devices::Pausable;
use crate::snapshot::Persist;
use torpor_vmm_api::launch::{MacAddr, NetSpec};
use virtio_queue::QueueT;

const MEM: usize = 4 << 20;
const PLAIN: u64 = VIRTIO_F_VERSION_1 | (1 << VIRTIO_NET_F_MAC);
const CSUM: u64 = PLAIN | (1 << VIRTIO_NET_F_CSUM) | (1 << VIRTIO_NET_F_GUEST_CSUM);
const NO_HDR: [u8; VNET_HDR_LEN] = [0; VNET_HDR_LEN];
const MERGEABLE: u64 = PLAIN | (1 << VIRTIO_NET_F_MRG_RXBUF);

fn spec() -> NetSpec {
    NetSpec::new(TAP)
}

macro_rules! rig {
    ($mem:expr, $tag:expr, $features:expr, $spec:expr) => {
        Rig::new(&$mem, $tag, $features, $spec)
    };
}

#[test]
fn config_space_holds_the_mac_and_offloads_are_offered() {
    let mem = guest_mem(MEM);
    let mac = MacAddr([0x06, 1, 2, 3, 4, 5]);
    let r = rig!(
        mem,
        "net-config",
        PLAIN,
        NetSpec {
            mac: Some(mac),
            ..spec()
        }
    );
    let mut t = r.t.lock().unwrap();
    assert_eq!(read32(&mut *t, 0x08), TYPE_NET);
    assert_eq!(read32(&mut *t, 0x100).to_le_bytes(), [6, 1, 2, 3]);
    assert_eq!(read32(&mut *t, 0x104).to_le_bytes(), [4, 5, 0, 0]);
    let features = VirtioDevice::avail_features(t.device());
    assert_eq!(features & OFFLOAD_FEATURES, OFFLOAD_FEATURES);
    assert_ne!(features & (1 << VIRTIO_NET_F_MRG_RXBUF), 0);
    assert_eq!(t.device().tap_name(), TAP);
}

#[test]
fn a_guest_frame_reaches_the_host_socket() {
    let mem = guest_mem(MEM);
    let mut r = rig!(mem, "net-tx", PLAIN, spec());
    let port = r.host_port();
    r.send(NO_HDR, &guest_udp_frame(port, b"hello host", Csum::Valid));
    r.pump();
    assert_eq!(r.host_recv(), b"hello host");
    let used = r.tx.take_used();
    assert_eq!(used.len(), 1, "the chain went back to the driver");
    let m = r.metrics();
    assert_eq!((m.tx_packets, m.tx_bytes), (1, 42 + 10));
    assert_eq!(m.malformed_chains, 0);
    // The used-ring interrupt was raised.
    assert_ne!(read32(&mut *r.t.lock().unwrap(), 0x60) & 1, 0);
}

#[test]
fn a_host_datagram_reaches_the_guest_with_a_complete_checksum() {
    let mem = guest_mem(MEM);
    let mut r = rig!(mem, "net-rx", PLAIN, spec());
    r.host_send(7000, b"hello guest");
    let f = r.expect_udp(7000);
    assert_eq!(f.udp_to(7000).unwrap(), b"hello guest");
    assert_eq!(&f.frame[..6], &GUEST_MAC.0);
    assert_eq!(&f.frame[6..12], &HOST_MAC);
    // Without GUEST_CSUM the tap computes the checksum itself.
    assert_eq!(f.hdr[0], 0, "no NEEDS_CSUM flag");
    assert!(udp_checksum_ok(&f.frame));
    assert_eq!(num_buffers(&f), 1);
    let m = r.metrics();
    assert_eq!(m.rx_packets, 1);
    assert_eq!(m.rx_bytes, f.frame.len() as u64);
}

#[test]
fn checksum_offload_headers_pass_both_ways() {
    let mem = guest_mem(MEM);
    let mut r = rig!(mem, "net-csum", CSUM, spec());
    let port = r.host_port();
    // A wrong checksum without the flag: the host kernel drops it. The
    // same frame flagged NEEDS_CSUM (start 34, offset 6: the UDP checksum)
    // is the host's to finish, and arrives. Same path, in order: the first
    // datagram the socket sees is the flagged one.
    r.send(NO_HDR, &guest_udp_frame(port, b"bad", Csum::Bad));
    r.send(
        vnet_hdr(1, 0, 34, 6),
        &guest_udp_frame(port, b"partial", Csum::Partial),
    );
    r.pump();
    assert_eq!(r.host_recv(), b"partial");
    assert_eq!(r.metrics().tx_packets, 2, "both reached the tap");
    // With GUEST_CSUM negotiated the tap hands the guest partial checksums
    // and says where to finish them.
    r.host_send(7001, b"offloaded");
    let f = r.expect_udp(7001);
    assert_eq!(f.hdr[0], 1, "NEEDS_CSUM");
    assert_eq!(u16::from_le_bytes([f.hdr[6], f.hdr[7]]), 34, "csum_start");
    assert_eq!(u16::from_le_bytes([f.hdr[8], f.hdr[9]]), 6, "csum_offset");
    assert_eq!(f.udp_to(7001).unwrap(), b"offloaded");
}

#[test]
fn offloads_the_driver_did_not_negotiate_are_refused() {
    let mem = guest_mem(MEM);
    let mut r = rig!(mem, "net-no-offload", PLAIN, spec());
    let port = r.host_port();
    r.send(
        vnet_hdr(1, 0, 34, 6),
        &guest_udp_frame(port, b"x", Csum::Partial),
    );
    r.send(
        vnet_hdr(1, VIRTIO_NET_HDR_GSO_TCPV4 as u8, 34, 16),
        &guest_udp_frame(port, b"y", Csum::Partial),
    );
    r.send(NO_HDR, &guest_udp_frame(port, b"fine", Csum::Valid));
    r.pump();
    assert_eq!(r.host_recv(), b"fine");
    let m = r.metrics();
    assert_eq!((m.tx_packets, m.malformed_chains), (1, 2));
    assert_eq!(r.tx.take_used().len(), 3, "refused chains are returned too");
}

#[test]
fn guest_tso_sets_the_tap_offloads() {
    let mem = guest_mem(MEM);
    let features = CSUM | (1 << VIRTIO_NET_F_GUEST_TSO4);
    let mut r = rig!(mem, "net-tso", features, spec());
    // The tap accepted TSO (activation would have failed otherwise) and
    // traffic flows.
    let status = read32(&mut *r.t.lock().unwrap(), 0x70);
    assert_eq!(status & 0x40, 0, "device does not need a reset");
    r.host_send(7002, b"tso on");
    assert_eq!(r.expect_udp(7002).udp_to(7002).unwrap(), b"tso on");
}

#[test]
fn malformed_chains_are_returned_counted_and_harmless() {
    let mem = guest_mem(MEM);
    let mut r = rig!(mem, "net-malformed", PLAIN, spec());
    let port = r.host_port();
    // tx: a device-writable descriptor, a chain shorter than the header, a
    // buffer outside guest memory, a frame larger than any frame.
    r.tx.push(&[(TX_BASE, 64, false), (TX_BASE + 64, 64, true)]);
    r.tx.push(&[(TX_BASE, 8, false)]);
    r.tx.push(&[(TX_BASE, 12, false), (MEM as u64 - 16, 64, false)]);
    r.tx.push(&[
        (TX_BASE, 12, false),
        (TX_BASE + 12, MAX_FRAME as u32 + 1, false),
    ]);
    r.send(NO_HDR, &guest_udp_frame(port, b"after", Csum::Valid));
    r.pump();
    assert_eq!(r.host_recv(), b"after");
    let used = r.tx.take_used();
    assert_eq!(used.len(), 5);
    assert!(used.iter().all(|&(_, len)| len == 0));
    assert_eq!(r.metrics().malformed_chains, 4);
    assert_eq!(r.metrics().tx_packets, 1);

    // rx: a readable descriptor, a buffer outside memory, a buffer too
    // small for the frame. Take every offered buffer back first so these
    // are the next ones the device sees.
    r.pump();
    let mut r = drain_rx(r);
    r.rx.push(&[(RX_BASE, 4096, false)]);
    r.rx.push(&[(MEM as u64 - 100, 4096, true)]);
    r.rx.push(&[(RX_BASE, 20, true)]);
    r.notify(0);
    for i in 0..3u8 {
        r.host_send(7100 + u16::from(i), &[i; 40]);
    }
    for _ in 0..3 {
        poll_once(&r.t, &r.epoll, Some(20)).unwrap();
    }
    let used = r.rx.take_used();
    assert_eq!(used.len(), 3, "{used:?}");
    assert!(used.iter().all(|&(_, len)| len == 0), "{used:?}");
    let m = r.metrics();
    assert_eq!((m.malformed_chains, m.rx_dropped), (4 + 2, 1));
    // Good buffers work again afterwards.
    for i in 0..4 {
        r.post_rx(RX_BASE + i * 0x2000, RX_BUF_LEN);
    }
    r.notify(0);
    r.host_send(7200, b"still fine");
    assert_eq!(r.expect_udp(7200).udp_to(7200).unwrap(), b"still fine");
}

fn num_buffers(f: &RxFrame) -> u16 {
    u16::from_le_bytes([f.hdr[10], f.hdr[11]])
}

/// A payload of `len` bytes that is not one byte repeated.
fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 + i / 251) as u8).collect()
}

#[test]
fn mergeable_rx_buffers_carry_a_frame_larger_than_one_buffer() {
    let mem = guest_mem(MEM);
    let mut r = Rig::with_rx_buffers(&mem, "net-mrg", MERGEABLE, spec(), 8, 256);
    let payload = pattern(1000);
    r.host_send(7300, &payload);
    let f = r.expect_udp(7300);
    assert_eq!(f.udp_to(7300).unwrap(), &payload[..]);
    assert!(udp_checksum_ok(&f.frame));
    // Header + Ethernet/IP/UDP headers + payload: 12 + 42 + 1000 bytes in
    // 256-byte buffers.
    assert_eq!(num_buffers(&f), 5);
    let m = r.metrics();
    assert_eq!((m.rx_packets, m.rx_dropped, m.malformed_chains), (1, 0, 0));
    // A small frame takes one buffer.
    r.host_send(7301, b"small");
    let f = r.expect_udp(7301);
    assert_eq!(f.udp_to(7301).unwrap(), b"small");
    assert_eq!(num_buffers(&f), 1);
}

#[test]
fn a_frame_waits_until_the_driver_offers_enough_mergeable_buffers() {
    let mem = guest_mem(MEM);
    let mut r = Rig::with_rx_buffers(&mem, "net-mrg-wait", MERGEABLE, spec(), 2, 256);
    let payload = pattern(1000);
    r.host_send(7310, &payload);
    for _ in 0..5 {
        r.pump();
    }
    // Two buffers cannot hold it: they stay offered, nothing is dropped.
    assert!(r.got.is_empty(), "{:?}", r.got);
    assert_eq!(r.metrics().rx_dropped, 0);
    for i in 2..5 {
        r.post_rx(RX_BASE + i * 0x2000, 256);
    }
    r.notify(0);
    let f = r.expect_udp(7310);
    assert_eq!(f.udp_to(7310).unwrap(), &payload[..]);
    assert_eq!(num_buffers(&f), 5);
}

#[test]
fn mergeable_buffers_too_small_for_the_header_are_malformed() {
    let mem = guest_mem(MEM);
    let mut r = Rig::with_rx_buffers(&mem, "net-mrg-hdr", MERGEABLE, spec(), 0, 256);
    r.rx.push(&[(RX_BASE, 8, true)]);
    r.rx.push(&[(RX_BASE + 0x2000, 256, true)]);
    r.notify(0);
    r.host_send(7320, b"split header");
    for _ in 0..3 {
        poll_once(&r.t, &r.epoll, Some(20)).unwrap();
    }
    let used = r.rx.take_used();
    assert_eq!(used.len(), 2, "{used:?}");
    assert!(used.iter().all(|&(_, len)| len == 0), "{used:?}");
    assert_eq!(r.metrics().malformed_chains, 1);
}

/// A rig whose rx buffers have all been used up by frames (taken and not
/// offered again).
fn drain_rx(mut r: Rig<'_>) -> Rig<'_> {
    for i in 0..RX_BUFS as u16 {
        r.host_send(6000 + i, b"fill");
    }
    let mut used = 0;
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while used < RX_BUFS as usize {
        assert!(std::time::Instant::now() < deadline, "rx buffers not used");
        poll_once(&r.t, &r.epoll, Some(20)).unwrap();
        used += r.rx.take_used().len();
    }
    r
}

#[test]
fn the_tx_limiter_holds_chains_until_tokens_come() {
    let mem = guest_mem(MEM);
    let limited = NetSpec {
        tx: RateLimit {
            bytes: None,
            packets: Some(TokenRate {
                per_sec: 2,
                burst: Some(2),
            }),
        },
        ..spec()
    };
    let mut r = rig!(mem, "net-tx-limit", PLAIN, limited);
    let port = r.host_port();
    for i in 0..5u8 {
        r.queue_tx(NO_HDR, &guest_udp_frame(port, &[b'0' + i], Csum::Valid));
    }
    r.notify(1);
    r.pump();
    assert_eq!(r.tx.take_used().len(), 2, "the burst");
    assert_eq!(r.metrics().tx_packets, 2);
    assert_eq!(r.metrics().tx_throttled, 1);
    // Half a second gives one token; the device asked to be woken then.
    let t = r.t.lock().unwrap().device().next_timeout_ms();
    assert_eq!(t, 500, "wake-up in 500 ms of the device's clock");
    r.clock.advance_ns(499_000_000);
    r.pump();
    assert_eq!(r.tx.take_used().len(), 0);
    r.clock.advance_ns(1_000_000);
    r.pump();
    assert_eq!(r.tx.take_used().len(), 1);
    r.clock.advance_ns(1_000_000_000);
    r.pump();
    assert_eq!(r.tx.take_used().len(), 2);
    let got: Vec<Vec<u8>> = (0..5).map(|_| r.host_recv()).collect();
    assert_eq!(got, [b"0", b"1", b"2", b"3", b"4"].map(|b| b.to_vec()));
    assert_eq!(r.t.lock().unwrap().device().tokens()[1], (None, Some(0)));
}

#[test]
fn the_rx_limiter_counts_bytes() {
    let mem = guest_mem(MEM);
    // Frames of 42 + 58 = 100 bytes; 250 bytes/s, bucket of 250.
    let limited = NetSpec {
        rx: RateLimit {
            bytes: Some(TokenRate {
                per_sec: 250,
                burst: Some(250),
            }),
            packets: None,
        },
        ..spec()
    };
    let mut r = rig!(mem, "net-rx-limit", PLAIN, limited);
    for _ in 0..3 {
        r.host_send(7300, &[7; 58]);
    }
    r.expect_udp(7300);
    r.expect_udp(7300);
    r.pump();
    assert!(
        r.got.iter().all(|f| f.udp_to(7300).is_none()),
        "third frame held"
    );
    assert_eq!(r.t.lock().unwrap().device().tokens()[0], (Some(50), None));
    // 50 more tokens take 200 ms.
    assert_eq!(r.t.lock().unwrap().device().next_timeout_ms(), 200);
    r.clock.advance_ns(200_000_000);
    r.expect_udp(7300);
    let m = r.metrics();
    assert_eq!((m.rx_packets, m.rx_bytes), (3, 300));
    assert!(m.rx_throttled >= 1);
}

#[test]
fn queue_state_survives_snapshot_and_restore() {
    let mem = guest_mem(MEM);
    let mut r = rig!(mem, "net-snapshot", CSUM, spec());
    let port = r.host_port();
    for i in 0..3u8 {
        r.send(NO_HDR, &guest_udp_frame(port, &[b'a' + i], Csum::Valid));
        r.pump();
        assert_eq!(r.host_recv(), [b'a' + i]);
    }
    r.host_send(7400, b"before");
    r.expect_udp(7400);
    assert_eq!(r.tx.take_used().len(), 3);
    // A frame queued but not yet notified when the snapshot is taken.
    r.queue_tx(NO_HDR, &guest_udp_frame(port, b"in flight", Csum::Valid));
    let state = r.t.lock().unwrap().save();
    assert_eq!(state.device.tap, TAP);
    assert_eq!(state.device.mac, GUEST_MAC.0);
    let tx_state = state.transport.queues[TXQ];
    assert_eq!((tx_state.next_avail, tx_state.next_used), (3, 3));

    // A different MAC is refused: the guest read its MAC at boot.
    let mut asked = spec();
    asked.mac = Some(MacAddr([6, 6, 6, 6, 6, 6]));
    let bad = NetDevice::restore(
        NetRestoreArgs {
            spec: Some(asked),
            clock: None,
        },
        &state.device,
    );
    assert!(
        matches!(bad, Err(NetError::MacChanged { .. })),
        "{:?}",
        bad.err()
    );

    let mem2 = guest_mem(MEM);
    let mem2c = mem2.clone();
    let clock: std::sync::Arc<dyn crate::devices::rate_limiter::Clock> = r.clock.clone();
    let mut r2 = r.clone_into(&mem2, || {
        NetMmio::restore(
            MmioRestoreArgs {
                mem: mem2c.clone(),
                irq: EventFd::new(libc::EFD_NONBLOCK).unwrap(),
                device: NetRestoreArgs {
                    spec: None,
                    clock: Some(clock.clone()),
                },
            },
            &state,
        )
    });
    // The restored device looks at its queues on its own: the frame
    // queued before the snapshot goes out.
    r2.pump();
    assert_eq!(r2.host_recv(), b"in flight");
    assert_eq!(r2.tx.take_used().len(), 1);
    assert_eq!(r2.metrics().tx_packets, 1, "counters start afresh");
    r2.host_send(7401, b"after");
    assert_eq!(r2.expect_udp(7401).udp_to(7401).unwrap(), b"after");
    // Offloads were set up again from the saved features.
    r2.host_send(7402, b"csum");
    assert_eq!(r2.expect_udp(7402).hdr[0], 1);
    let t = r2.t.lock().unwrap();
    assert_eq!(t.queues()[TXQ].next_used(), 4);
}

#[test]
fn the_worker_thread_moves_frames_and_pauses() {
    let mem = guest_mem(MEM);
    let mut r = rig!(mem, "net-worker", PLAIN, spec());
    let worker = NetWorker::spawn(r.t.clone()).unwrap();
    r.host_send(7500, b"threaded");
    wait_used(&mut r);
    worker.pause().unwrap();
    assert!(worker.is_paused());
    r.host_send(7501, b"while paused");
    std::thread::sleep(Duration::from_millis(30));
    assert!(r.rx.take_used().is_empty(), "delivered while paused");
    worker.resume().unwrap();
    wait_used(&mut r);
    worker.stop();
}

fn wait_used(r: &mut Rig<'_>) {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while r.rx.take_used().is_empty() {
        assert!(std::time::Instant::now() < deadline, "nothing delivered");
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn a_missing_namespace_is_a_clear_error() {
    let spec = NetSpec {
        netns: Some("/nonexistent/netns/x".into()),
        ..spec()
    };
    match NetDevice::new(&spec) {
        Err(NetError::Tap(e @ TapError::Netns { .. })) => {
            assert!(e.to_string().contains("/nonexistent/netns/x"), "{e}");
        }
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("a tap opened in a namespace that does not exist"),
    }
}
