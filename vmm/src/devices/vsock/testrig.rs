//! A test rig for the vsock device: guest memory with rx/tx/event queues
//! driven through virtio-queue's mock, the device driven one epoll round at
//! a time (or by its own thread, see `Rig::start_worker`), and a temporary
//! directory for the unix sockets.

use std::collections::HashMap;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::epoll::Epoll;
use vmm_sys_util::eventfd::EventFd;

use super::packet::*;
use super::{poll_once, VsockConfig, VsockDevice, VsockMmio, VsockWorker};
use crate::devices::virtio::testutil::{activate, copy_mem, write32, Driver};
use crate::devices::virtio::VIRTIO_F_VERSION_1;
use tempfile::TempDir;

pub const GUEST_CID: u64 = 3;
pub const QSIZE: u16 = 32;
pub const RX_BUFS: u64 = 8;
/// The rx buffers, 8 KiB apart: only the device writes there.
pub const RX_BASE: u64 = 0x10_0000;
const RX_PAYLOAD: u32 = 4096;
const TX_BASE: u64 = 0x20_0000;
const TX_SLOT: u64 = 0x1_1000;

/// A packet the guest received.
#[derive(Debug, Clone)]
pub struct Pkt {
    pub hdr: Header,
    pub data: Vec<u8>,
}

pub struct Rig<'a> {
    pub mem: &'a GuestMemoryMmap,
    pub t: Arc<Mutex<VsockMmio>>,
    pub epoll: Arc<Epoll>,
    pub rx: Driver<'a>,
    pub tx: Driver<'a>,
    pub ev: Driver<'a>,
    rx_bufs: HashMap<u16, u64>,
    tx_slot: u64,
    pub got: Vec<Pkt>,
    pub dir: TempDir,
    pub uds: PathBuf,
    /// The device thread, once started: then `pump` no longer polls.
    pub worker: Option<VsockWorker>,
}

impl<'a> Rig<'a> {
    pub fn new(mem: &'a GuestMemoryMmap, tag: &str) -> Self {
        let dir = tempfile::Builder::new().prefix(tag).tempdir().unwrap();
        let uds = dir.path().join("v.sock");
        let dev = VsockDevice::new(&VsockConfig::new(uds.clone())).unwrap();
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let mut t = VsockMmio::new(dev, mem.clone(), irq).unwrap();
        let rx = Driver::new(mem, 0x1000, QSIZE);
        let tx = Driver::new(mem, 0x2000, QSIZE);
        let ev = Driver::new(mem, 0x3000, QSIZE);
        activate(&mut t, VIRTIO_F_VERSION_1, &[&rx, &tx, &ev], QSIZE);
        let epoll = t.device().epoll();
        let mut rig = Self {
            mem,
            t: Arc::new(Mutex::new(t)),
            epoll,
            rx,
            tx,
            ev,
            rx_bufs: HashMap::new(),
            tx_slot: 0,
            got: Vec::new(),
            dir,
            uds,
            worker: None,
        };
        for i in 0..RX_BUFS {
            rig.post_rx(RX_BASE + i * 0x2000);
        }
        rig.notify(0);
        rig
    }

    /// The same guest driver state over a copy of this rig's memory (a
    /// snapshot), with the transport `restore` builds for a socket path.
    pub fn clone_into<'b>(
        &self,
        mem: &'b GuestMemoryMmap,
        restore: impl FnOnce(PathBuf) -> VsockMmio,
    ) -> Rig<'b> {
        let (rx, tx, ev) = (
            self.rx.resume_on(mem),
            self.tx.resume_on(mem),
            self.ev.resume_on(mem),
        );
        copy_mem(self.mem, mem);
        let dir = TempDir::new().unwrap();
        let uds = dir.path().join("v.sock");
        let t = restore(uds.clone());
        let epoll = t.device().epoll();
        Rig {
            mem,
            t: Arc::new(Mutex::new(t)),
            epoll,
            rx,
            tx,
            ev,
            rx_bufs: self.rx_bufs.clone(),
            tx_slot: self.tx_slot,
            got: Vec::new(),
            dir,
            uds,
            worker: None,
        }
    }

    /// Hands the device to its own thread, as the VMM runs it.
    pub fn start_worker(&mut self) {
        self.worker = Some(VsockWorker::spawn(self.t.clone()).unwrap());
    }

    /// Offers one rx buffer laid out as Linux 6.1 does: header, then 4 KiB.
    fn post_rx(&mut self, addr: u64) {
        let head = self.rx.push(&[
            (addr, HDR_LEN as u32, true),
            (addr + HDR_LEN as u64, RX_PAYLOAD, true),
        ]);
        self.rx_bufs.insert(head, addr);
    }

    pub fn notify(&self, queue: u32) {
        write32(&mut *self.t.lock().unwrap(), 0x50, queue);
    }

    /// How many times the device raised its interrupt since the last call
    /// (the irqfd's counter, read and cleared).
    pub fn interrupts(&self) -> u64 {
        let t = self.t.lock().unwrap();
        t.interrupt().eventfd().read().unwrap_or(0)
    }

    /// What Linux does after a restore: offers an event buffer at `addr`,
    /// takes the TRANSPORT_RESET event from it, handles it, then offers
    /// the buffer again (the refill that tells the device it is handled).
    pub fn handle_transport_reset(&mut self, addr: u64) {
        self.ev.push(&[(addr, 4, true)]);
        self.notify(2);
        self.pump_until(|r| match r.ev.take_used().first() {
            Some(&(_, len)) => {
                assert_eq!(len, 4);
                true
            }
            None => false,
        });
        let event: u32 = self.mem.read_obj(GuestAddress(addr)).unwrap();
        assert_eq!(event, EVENT_TRANSPORT_RESET);
        self.ev.push(&[(addr, 4, true)]);
        self.notify(2);
    }

    /// A guest → host header from guest port `src` to host port `dst`.
    pub fn hdr(src: u32, dst: u32, op: u16) -> Header {
        Header {
            src_cid: GUEST_CID,
            dst_cid: HOST_CID,
            src_port: src,
            dst_port: dst,
            len: 0,
            kind: TYPE_STREAM,
            op,
            flags: 0,
            buf_alloc: 256 * 1024,
            fwd_cnt: 0,
        }
    }

    /// Queues a packet on the tx queue as `[header][payload]` descriptors;
    /// `payload_desc_len` overrides the payload descriptor's length.
    pub fn send_raw(&mut self, hdr: Header, payload: &[u8], payload_desc_len: Option<u32>) {
        let addr = TX_BASE + (self.tx_slot % 8) * TX_SLOT;
        self.tx_slot += 1;
        self.mem
            .write_slice(&hdr.to_bytes(), GuestAddress(addr))
            .unwrap();
        let data = addr + HDR_LEN as u64;
        self.mem.write_slice(payload, GuestAddress(data)).unwrap();
        let len = payload_desc_len.unwrap_or(payload.len() as u32);
        if len == 0 {
            self.tx.push(&[(addr, HDR_LEN as u32, false)]);
        } else {
            self.tx
                .push(&[(addr, HDR_LEN as u32, false), (data, len, false)]);
        }
        self.notify(1);
    }

    pub fn send(&mut self, mut hdr: Header, payload: &[u8]) {
        hdr.len = payload.len() as u32;
        self.send_raw(hdr, payload, None);
    }

    /// One epoll round (or, with the device thread running, a short
    /// sleep), then collects used rx buffers.
    pub fn pump(&mut self) {
        if self.worker.is_some() {
            std::thread::sleep(Duration::from_millis(1));
        } else {
            poll_once(&self.t, &self.epoll, Some(20)).unwrap();
        }
        self.collect();
    }

    /// What the guest's rx interrupt handler does: takes the packets in
    /// used rx buffers, offers the buffers again, notifies.
    pub fn collect(&mut self) {
        let used = self.rx.take_used();
        if used.is_empty() {
            return;
        }
        for (head, len) in used {
            let addr = self.rx_bufs.remove(&head).expect("known rx buffer");
            if len as usize >= HDR_LEN {
                let mut raw = [0u8; HDR_LEN];
                self.mem.read_slice(&mut raw, GuestAddress(addr)).unwrap();
                let hdr = Header::from_bytes(&raw);
                let mut data = vec![0u8; len as usize - HDR_LEN];
                self.mem
                    .read_slice(&mut data, GuestAddress(addr + HDR_LEN as u64))
                    .unwrap();
                assert_eq!(hdr.len as usize, data.len(), "header len matches used len");
                self.got.push(Pkt { hdr, data });
            }
            self.post_rx(addr);
        }
        self.notify(0);
    }

    /// Pumps until `cond` holds (at most 5 s).
    pub fn pump_until(&mut self, mut cond: impl FnMut(&mut Self) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if cond(self) {
                return;
            }
            self.pump();
        }
        panic!("condition not reached; guest got {:?}", self.got);
    }

    /// Takes the first received packet with operation `op`.
    pub fn take(&mut self, op: u16) -> Option<Pkt> {
        let i = self.got.iter().position(|p| p.hdr.op == op)?;
        Some(self.got.remove(i))
    }

    /// Pumps until a packet with `op` arrives and takes it.
    pub fn expect(&mut self, op: u16) -> Pkt {
        self.pump_until(|r| r.got.iter().any(|p| p.hdr.op == op));
        self.take(op).unwrap()
    }

    /// All RW payload bytes received so far for `(local, peer)`, taken.
    pub fn take_data(&mut self, local: u32, peer: u32) -> Vec<u8> {
        let mut out = Vec::new();
        self.got.retain(|p| {
            let ours = p.hdr.op == OP_RW && p.hdr.src_port == local && p.hdr.dst_port == peer;
            if ours {
                out.extend_from_slice(&p.data);
            }
            !ours
        });
        out
    }

    pub fn connections(&self) -> usize {
        self.t.lock().unwrap().device().connection_count()
    }

    /// Host side: connects to the device socket and asks for `port`;
    /// returns the stream and the host port the guest sees, after the
    /// guest accepted.
    pub fn host_connect(&mut self, port: u32, extra: &[u8]) -> (UnixStream, u32) {
        use std::io::Write;
        let mut s = UnixStream::connect(&self.uds).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut line = format!("CONNECT {port}\n").into_bytes();
        line.extend_from_slice(extra);
        s.write_all(&line).unwrap();
        let req = self.expect(OP_REQUEST);
        assert_eq!((req.hdr.src_cid, req.hdr.dst_cid), (HOST_CID, GUEST_CID));
        assert_eq!(req.hdr.dst_port, port);
        assert!(req.hdr.src_port >= 1 << 30);
        self.send(Self::hdr(port, req.hdr.src_port, OP_RESPONSE), &[]);
        self.pump();
        let ok = read_line(&mut s);
        assert_eq!(ok, format!("OK {}", req.hdr.src_port));
        (s, req.hdr.src_port)
    }
}

/// Reads one `\n`-terminated line, byte by byte.
pub fn read_line(s: &mut UnixStream) -> String {
    use std::io::Read;
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while s.read(&mut b).unwrap() == 1 && b[0] != b'\n' {
        line.push(b[0]);
    }
    String::from_utf8(line).unwrap()
}
