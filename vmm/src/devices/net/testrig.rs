//! A test rig for the net device: a network namespace the test creates
//! (removed on drop) holding a persistent tap with an address and a static
//! neighbour entry for the guest, a UDP socket in that namespace as the
//! host's end, and a fake guest driver on mock queues that builds and
//! parses frames. Tests skip (loudly) where they cannot create namespaces
//! or taps.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::os::fd::AsRawFd;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::epoll::Epoll;
use vmm_sys_util::eventfd::EventFd;

use super::tap::TapError;
use super::{NetDevice, NetError, NetMmio, VNET_HDR_LEN};
use crate::devices::rate_limiter::{Clock, ManualClock};
use crate::devices::virtio::testutil::{activate, copy_mem, write32, Driver};
use crate::devices::virtio::VirtioError;
use crate::devices::worker::poll_once;
use torpor_vmm_api::launch::{MacAddr, NetSpec};

pub const QSIZE: u16 = 32;
pub const RX_BUFS: u64 = 8;
pub const RX_BASE: u64 = 0x10_0000;
pub const RX_BUF_LEN: u32 = 4096;
pub const TX_BASE: u64 = 0x20_0000;
pub const TX_SLOT: u64 = 0x1_1000;
pub const TAP: &str = "tap0";
pub const HOST_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];
pub const HOST_IP: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 1);
pub const GUEST_IP: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 2);
pub const GUEST_MAC: MacAddr = MacAddr::DEFAULT_GUEST;

/// A network namespace, deleted on drop.
pub struct NetNs {
    pub name: String,
}

impl NetNs {
    /// A new namespace; fails the test where this machine cannot make one
    /// or has no tun driver (scripts/test leaves these tests out there:
    /// tests/needs).
    pub fn create(tag: &str) -> Self {
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        assert!(
            root,
            "{tag}: needs root to create network namespaces and taps"
        );
        assert!(
            std::path::Path::new("/dev/net/tun").exists(),
            "{tag}: needs /dev/net/tun"
        );
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "torpor-net-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        match Command::new("ip").args(["netns", "add", &name]).status() {
            Ok(s) if s.success() => Self { name },
            other => panic!("{tag}: `ip netns add` failed: {other:?}"),
        }
    }

    /// The namespace file.
    pub fn path(&self) -> std::path::PathBuf {
        format!("/run/netns/{}", self.name).into()
    }

    /// Runs `ip -n <ns> args`, which must succeed.
    pub fn ip(&self, args: &[&str]) {
        let out = Command::new("ip")
            .arg("-n")
            .arg(&self.name)
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "ip {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Runs `f` on a thread inside the namespace: sockets and taps it
    /// opens belong there, and work from any thread afterwards.
    pub fn enter<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        let path = format!("/run/netns/{}", self.name);
        std::thread::scope(|s| {
            s.spawn(|| {
                let ns = std::fs::File::open(&path).unwrap();
                // SAFETY: setns on a namespace file descriptor we own; it
                // changes only this thread's network namespace, and the
                // thread ends with the scope.
                let rc = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
                assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
                f()
            })
            .join()
            .unwrap()
        })
    }

    /// A persistent tap with the host address and the guest as static
    /// neighbour (no ARP needed), up.
    pub fn add_tap(&self) {
        self.ip(&["link", "set", "lo", "up"]);
        self.ip(&["tuntap", "add", "dev", TAP, "mode", "tap"]);
        // Quiet: no IPv6 router solicitations among the test's frames.
        let _ = self
            .enter(|| std::fs::write(format!("/proc/sys/net/ipv6/conf/{TAP}/disable_ipv6"), "1"));
        self.ip(&[
            "link",
            "set",
            TAP,
            "address",
            &MacAddr(HOST_MAC).to_string(),
        ]);
        self.ip(&["addr", "add", &format!("{HOST_IP}/24"), "dev", TAP]);
        self.ip(&["link", "set", TAP, "up"]);
        self.ip(&[
            "neigh",
            "add",
            &GUEST_IP.to_string(),
            "lladdr",
            &GUEST_MAC.to_string(),
            "dev",
            TAP,
        ]);
    }
}

impl NetNs {
    /// Waits until the tap, just attached, has its carrier and its queue
    /// (the kernel's link watcher activates it a moment after the attach;
    /// frames the host sends before that are dropped).
    pub fn wait_carrier(&self) {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let out = Command::new("ip")
                .args(["-n", &self.name, "-o", "link", "show", TAP])
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout);
            if !text.contains("NO-CARRIER") && !text.contains("state DOWN") {
                return;
            }
            assert!(Instant::now() < deadline, "tap never came up: {text}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

/// One's-complement sum of 16-bit words (the internet checksum, unfolded).
fn sum16(bytes: &[u8], mut acc: u32) -> u32 {
    for pair in bytes.chunks(2) {
        let word = u16::from_be_bytes([pair[0], *pair.get(1).unwrap_or(&0)]);
        acc += u32::from(word);
    }
    acc
}

fn fold(mut acc: u32) -> u16 {
    while acc > 0xffff {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    acc as u16
}

/// The UDP checksum a frame's header says, and the one it should have
/// (computed over pseudo-header, header and payload).
pub fn udp_checksum_ok(frame: &[u8]) -> bool {
    let ip = &frame[14..34];
    let udp = &frame[34..];
    let len = u16::from_be_bytes([udp[4], udp[5]]);
    let mut acc = sum16(&ip[12..20], 0);
    acc += 17 + u32::from(len);
    fold(sum16(&udp[..usize::from(len)], acc)) == 0xffff
}

/// How a built frame's UDP checksum is set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Csum {
    Valid,
    /// Wrong on purpose.
    Bad,
    /// Left for the device (the host) to finish: the pseudo-header sum, as
    /// Linux leaves it for checksum offload.
    Partial,
}

/// An Ethernet + IPv4 + UDP frame from the guest to the host's port.
pub fn guest_udp_frame(dport: u16, payload: &[u8], csum: Csum) -> Vec<u8> {
    let udp_len = 8 + payload.len() as u16;
    let mut f = Vec::new();
    f.extend_from_slice(&HOST_MAC);
    f.extend_from_slice(&GUEST_MAC.0);
    f.extend_from_slice(&0x0800u16.to_be_bytes());
    let mut ip = [0u8; 20];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&(20 + udp_len).to_be_bytes());
    ip[6] = 0x40; // don't fragment
    ip[8] = 64;
    ip[9] = 17;
    ip[12..16].copy_from_slice(&GUEST_IP.octets());
    ip[16..20].copy_from_slice(&HOST_IP.octets());
    let c = !fold(sum16(&ip, 0));
    ip[10..12].copy_from_slice(&c.to_be_bytes());
    f.extend_from_slice(&ip);
    f.extend_from_slice(&40000u16.to_be_bytes());
    f.extend_from_slice(&dport.to_be_bytes());
    f.extend_from_slice(&udp_len.to_be_bytes());
    f.extend_from_slice(&[0, 0]);
    f.extend_from_slice(payload);
    let pseudo = sum16(&ip[12..20], 17 + u32::from(udp_len));
    let check = match csum {
        Csum::Valid => !fold(sum16(&f[34..], pseudo)),
        Csum::Bad => (!fold(sum16(&f[34..], pseudo))).wrapping_add(0x1111),
        Csum::Partial => fold(pseudo),
    };
    f[40..42].copy_from_slice(&check.to_be_bytes());
    f
}

/// A virtio_net_hdr_v1: flags, gso type, header len, gso size, checksum
/// start and offset, num_buffers.
pub fn vnet_hdr(flags: u8, gso_type: u8, csum_start: u16, csum_offset: u16) -> [u8; VNET_HDR_LEN] {
    let mut h = [0u8; VNET_HDR_LEN];
    h[0] = flags;
    h[1] = gso_type;
    h[6..8].copy_from_slice(&csum_start.to_le_bytes());
    h[8..10].copy_from_slice(&csum_offset.to_le_bytes());
    h
}

/// The tap is still attached to another descriptor (EBUSY).
fn tap_busy(e: &VirtioError) -> bool {
    let VirtioError::Device(inner) = e else {
        return false;
    };
    matches!(
        inner.downcast_ref::<NetError>(),
        Some(NetError::Tap(TapError::SetIff { source, .. })) if source.raw_os_error() == Some(libc::EBUSY)
    )
}

/// A frame the guest received: its header and the Ethernet frame.
#[derive(Debug, Clone)]
pub struct RxFrame {
    pub hdr: [u8; VNET_HDR_LEN],
    pub frame: Vec<u8>,
}

impl RxFrame {
    /// UDP to the guest on `port`: the payload.
    pub fn udp_to(&self, port: u16) -> Option<&[u8]> {
        let f = &self.frame;
        let ok = f.len() >= 42
            && f[12..14] == [0x08, 0x00]
            && f[23] == 17
            && f[30..34] == GUEST_IP.octets()
            && u16::from_be_bytes([f[36], f[37]]) == port;
        ok.then(|| &f[42..])
    }
}

pub struct Rig<'a> {
    pub mem: &'a GuestMemoryMmap,
    pub t: Arc<Mutex<NetMmio>>,
    pub epoll: Arc<Epoll>,
    pub rx: Driver<'a>,
    pub tx: Driver<'a>,
    rx_bufs: HashMap<u16, u64>,
    /// The length of the rx buffers the rig offers.
    rx_buf_len: u32,
    /// The driver negotiated mergeable rx buffers: a frame's later
    /// buffers follow its first in the used ring.
    mergeable: bool,
    /// Buffers of a frame whose `num_buffers` are not all used yet.
    partial: Vec<u8>,
    partial_left: u16,
    tx_slot: u64,
    pub got: Vec<RxFrame>,
    /// The host's end, in the namespace, bound to `HOST_IP`.
    pub sock: UdpSocket,
    pub clock: Arc<ManualClock>,
    pub ns: NetNs,
}

impl<'a> Rig<'a> {
    /// A namespace with a tap, a device on it driven with `features`, and
    /// `RX_BUFS` rx buffers of `RX_BUF_LEN` bytes offered.
    pub fn new(mem: &'a GuestMemoryMmap, tag: &str, features: u64, spec: NetSpec) -> Self {
        Self::with_rx_buffers(mem, tag, features, spec, RX_BUFS, RX_BUF_LEN)
    }

    /// [`Rig::new`] offering `count` rx buffers of `len` bytes.
    pub fn with_rx_buffers(
        mem: &'a GuestMemoryMmap,
        tag: &str,
        features: u64,
        spec: NetSpec,
        count: u64,
        len: u32,
    ) -> Self {
        let ns = NetNs::create(tag);
        ns.add_tap();
        let clock = Arc::new(ManualClock::default());
        let dyn_clock: Arc<dyn Clock> = clock.clone();
        // The tap is opened the way the VMM does it: by name, in the
        // namespace the spec names; the host's socket from inside it.
        let spec = NetSpec {
            netns: Some(ns.path()),
            ..spec
        };
        let dev = NetDevice::with_clock(&spec, dyn_clock).unwrap();
        let sock = ns.enter(|| UdpSocket::bind(SocketAddrV4::new(HOST_IP, 0)).unwrap());
        sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        ns.wait_carrier();
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let mut t = NetMmio::new(dev, mem.clone(), irq).unwrap();
        let rx = Driver::new(mem, 0x1000, QSIZE);
        let tx = Driver::new(mem, 0x2000, QSIZE);
        activate(&mut t, features, &[&rx, &tx], QSIZE);
        let epoll = crate::devices::worker::EpollDevice::epoll(t.device());
        let mut rig = Self {
            mem,
            t: Arc::new(Mutex::new(t)),
            epoll,
            rx,
            tx,
            rx_bufs: HashMap::new(),
            rx_buf_len: len,
            mergeable: features & (1 << virtio_bindings::virtio_net::VIRTIO_NET_F_MRG_RXBUF) != 0,
            partial: Vec::new(),
            partial_left: 0,
            tx_slot: 0,
            got: Vec::new(),
            sock,
            clock,
            ns,
        };
        assert!(len <= 0x2000, "rx buffers are 0x2000 apart");
        for i in 0..count {
            rig.post_rx(RX_BASE + i * 0x2000, len);
        }
        rig.notify(0);
        rig
    }

    /// The same guest driver state over a copy of this rig's memory (a
    /// snapshot), with the transport `restore` builds (inside the
    /// namespace), and this rig's namespace and socket. This rig's device
    /// is dropped first (a tap takes one owner). A child process another
    /// test forks holds the old tap's descriptor until it execs (it is
    /// close-on-exec): a busy tap is tried again for at most 5 s.
    pub fn clone_into<'b>(
        self,
        mem: &'b GuestMemoryMmap,
        restore: impl Fn() -> Result<NetMmio, VirtioError> + Send + Sync,
    ) -> Rig<'b> {
        let (rx, tx) = (self.rx.resume_on(mem), self.tx.resume_on(mem));
        copy_mem(self.mem, mem);
        drop(self.t);
        let deadline = Instant::now() + Duration::from_secs(5);
        let t = loop {
            match self.ns.enter(&restore) {
                Ok(t) => break t,
                Err(e) if tap_busy(&e) && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => panic!("restoring the net device failed: {e}"),
            }
        };
        self.ns.wait_carrier();
        let epoll = crate::devices::worker::EpollDevice::epoll(t.device());
        Rig {
            mem,
            t: Arc::new(Mutex::new(t)),
            epoll,
            rx,
            tx,
            rx_bufs: self.rx_bufs,
            rx_buf_len: self.rx_buf_len,
            mergeable: self.mergeable,
            partial: Vec::new(),
            partial_left: 0,
            tx_slot: self.tx_slot,
            got: Vec::new(),
            sock: self.sock,
            clock: self.clock,
            ns: self.ns,
        }
    }

    pub fn post_rx(&mut self, addr: u64, len: u32) {
        let head = self.rx.push(&[(addr, len, true)]);
        self.rx_bufs.insert(head, addr);
    }

    pub fn notify(&self, queue: u32) {
        write32(&mut *self.t.lock().unwrap(), 0x50, queue);
    }

    /// Queues `hdr` + `frame` on the tx queue as two descriptors, without
    /// notifying.
    pub fn queue_tx(&mut self, hdr: [u8; VNET_HDR_LEN], frame: &[u8]) -> u16 {
        let addr = TX_BASE + (self.tx_slot % 8) * TX_SLOT;
        self.tx_slot += 1;
        self.mem.write_slice(&hdr, GuestAddress(addr)).unwrap();
        let data = addr + VNET_HDR_LEN as u64;
        self.mem.write_slice(frame, GuestAddress(data)).unwrap();
        self.tx.push(&[
            (addr, VNET_HDR_LEN as u32, false),
            (data, frame.len() as u32, false),
        ])
    }

    pub fn send(&mut self, hdr: [u8; VNET_HDR_LEN], frame: &[u8]) -> u16 {
        let head = self.queue_tx(hdr, frame);
        self.notify(1);
        head
    }

    /// One epoll round, then what the guest's rx interrupt handler does.
    pub fn pump(&mut self) {
        poll_once(&self.t, &self.epoll, Some(20)).unwrap();
        self.collect();
    }

    /// Takes the frames in used rx buffers (joining a frame's buffers
    /// when they are mergeable), offers the buffers again.
    pub fn collect(&mut self) {
        let used = self.rx.take_used();
        if used.is_empty() {
            return;
        }
        for (head, len) in used {
            let addr = self.rx_bufs.remove(&head).expect("known rx buffer");
            let mut raw = vec![0u8; len as usize];
            self.mem.read_slice(&mut raw, GuestAddress(addr)).unwrap();
            self.post_rx(addr, self.rx_buf_len);
            if self.partial_left > 0 {
                self.partial.extend_from_slice(&raw);
                self.partial_left -= 1;
            } else if raw.len() > VNET_HDR_LEN {
                let n = u16::from_le_bytes([raw[10], raw[11]]);
                self.partial = raw;
                self.partial_left = if self.mergeable {
                    n.saturating_sub(1)
                } else {
                    0
                };
            } else {
                continue;
            }
            if self.partial_left == 0 {
                let raw = std::mem::take(&mut self.partial);
                let mut hdr = [0u8; VNET_HDR_LEN];
                hdr.copy_from_slice(&raw[..VNET_HDR_LEN]);
                self.got.push(RxFrame {
                    hdr,
                    frame: raw[VNET_HDR_LEN..].to_vec(),
                });
            }
        }
        self.notify(0);
    }

    /// Pumps until a UDP frame for guest port `port` arrived; takes it.
    pub fn expect_udp(&mut self, port: u16) -> RxFrame {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if let Some(i) = self.got.iter().position(|f| f.udp_to(port).is_some()) {
                return self.got.remove(i);
            }
            assert!(
                Instant::now() < deadline,
                "no frame for port {port}; got {:?}",
                self.got
            );
            self.pump();
        }
    }

    /// Sends a datagram from the host's socket to the guest.
    pub fn host_send(&self, port: u16, payload: &[u8]) {
        self.sock
            .send_to(payload, SocketAddrV4::new(GUEST_IP, port))
            .unwrap();
    }

    /// The next datagram the host's socket received (at most 5 s).
    pub fn host_recv(&self) -> Vec<u8> {
        let mut buf = vec![0u8; 65536];
        let n = self.sock.recv(&mut buf).unwrap();
        buf.truncate(n);
        buf
    }

    pub fn host_port(&self) -> u16 {
        self.sock.local_addr().unwrap().port()
    }

    pub fn metrics(&self) -> super::NetMetrics {
        self.t.lock().unwrap().device().metrics()
    }
}
