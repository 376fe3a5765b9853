//! The virtio-vsock device: queues, guest CID, and the host side (a unix
//! listener, handshakes, connections) multiplexed on one epoll set that a
//! device thread waits on (see `worker.rs`). Guest-facing packet handling
//! is in `guest.rs`.

use std::collections::{HashMap, VecDeque};
use std::io::Write;
use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use super::conn::{ConnKey, ConnState, Connection};
use super::packet::{DEFAULT_GUEST_CID, OP_CREDIT_REQUEST, OP_REQUEST, OP_RST};
use super::unix::{Handshake, HandshakeStep, Listener, UnixError};
use crate::devices::virtio::{
    QueueContext, VirtioDevice, VirtioError, TYPE_VSOCK, VIRTIO_F_RING_EVENT_IDX,
    VIRTIO_F_VERSION_1,
};

pub const RXQ: usize = 0;
pub const TXQ: usize = 1;
pub const EVQ: usize = 2;
pub const QUEUE_SIZE: u16 = 256;

/// Epoll tokens: the queue eventfds are 0..3.
const TOKEN_LISTENER: u64 = 3;
/// Reserved for the device thread's wake eventfd (stop, pause).
pub const TOKEN_WAKE: u64 = 4;
const FIRST_DYNAMIC_TOKEN: u64 = 16;

pub const MAX_CONNECTIONS: usize = 1024;
const MAX_HANDSHAKES: usize = 64;
/// Control packets waiting for rx buffers; beyond this the guest is not
/// taking its packets and new ones are dropped.
const MAX_CONTROL: usize = 4096;
/// Host ports for host-initiated connections come from here up.
const HOST_PORT_BASE: u32 = 1 << 30;

/// Errors of the vsock device.
#[derive(Debug, thiserror::Error)]
pub enum VsockError {
    #[error(transparent)]
    Unix(#[from] UnixError),
    #[error("guest CID {0} is reserved (use 3 or more, below 2^32 - 1)")]
    ReservedCid(u64),
    #[error("epoll failed: {0}")]
    Epoll(std::io::Error),
    #[error(transparent)]
    Worker(#[from] crate::devices::worker::WorkerError),
    #[error("cannot get random bytes for the host ports: {0}")]
    Random(std::io::Error),
}

/// How to build a vsock device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VsockConfig {
    pub cid: u64,
    /// The host socket; guest connections to host port P go to `<uds_path>_P`.
    pub uds_path: PathBuf,
}

impl VsockConfig {
    pub fn new(uds_path: PathBuf) -> Self {
        Self {
            cid: DEFAULT_GUEST_CID,
            uds_path,
        }
    }
}

/// Deadlines, adjustable in tests.
#[derive(Debug, Clone, Copy)]
pub(super) struct Timeouts {
    /// A host client must send its CONNECT line within this.
    pub handshake: Duration,
    /// The guest must answer a host-initiated REQUEST within this. A
    /// guest that is not listening answers at once (RST); this only bounds
    /// a guest that does not answer at all. 10 s, not Firecracker's 2 s: a
    /// loaded guest (the nested host's, under TCG) can stall past 2 s, and
    /// its agent then looked unreachable.
    pub connect: Duration,
    /// After the guest shut a connection, left-over data must reach the
    /// host within this.
    pub close: Duration,
    /// A REQUEST unanswered this long makes the device look at the rings
    /// (and raise an unacknowledged interrupt again): long before the
    /// connect deadline, so a lost interrupt costs the host a delay, not
    /// a failed connection.
    pub nudge: Duration,
}

/// How long after a restore the device holds the rx queue back at most,
/// waiting for the driver to show it handled the transport reset (a
/// driver that never refills its event queue then gets its packets after
/// all, as before the hold existed). Under the host's connect deadline
/// ([`Timeouts::connect`], 10 s), so a connection held this long still
/// gets its answer. It was 3 s: in the nested pod's soak of five Linux
/// sandboxes at once a driver handled the reset later than that, and the
/// wake's first agent connection, delivered at the limit, was reset with
/// the snapshot's ("the agent closed the connection").
pub(super) const RESET_HOLD_LIMIT: Duration = Duration::from_secs(8);

/// How often a held rx queue looks whether the driver refilled its event
/// queue.
const RESET_POLL: Duration = Duration::from_millis(2);

/// The rx queue held back after a restore. Linux handles the
/// TRANSPORT_RESET event in a work item of its own and resets every
/// *connected* socket then, whenever that runs: a connection the host
/// opened in the meantime (its REQUEST delivered and accepted first, as
/// a wake's first agent call does) would be reset with the old ones, and
/// the host would see the agent close it. Linux refills the event buffer
/// after handling the event, so the event queue's available index moving
/// past where it stood when the event was delivered means the reset is
/// done.
#[derive(Debug, Clone, Copy)]
pub(super) struct ResetHold {
    /// The event queue's available index when the event went out
    /// (`None`: not delivered yet).
    pub delivered_at: Option<u16>,
    /// Past this the hold ends whatever the driver did: set on the
    /// device thread's first round after the restore, when the VM runs
    /// (a VM restored paused may wait long before it resumes).
    pub until: Option<Instant>,
}

#[derive(Debug)]
pub(super) enum Endpoint {
    Handshake(Handshake),
    Conn(ConnKey),
}

/// A packet without payload waiting for an rx buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Control {
    pub key: ConnKey,
    pub op: u16,
    pub flags: u32,
}

/// A virtio-vsock device with a unix-socket host side.
#[derive(Debug)]
pub struct VsockDevice {
    pub(super) cid: u64,
    pub(super) uds_path: PathBuf,
    listener: Listener,
    epoll: Arc<Epoll>,
    queue_evts: [EventFd; 3],
    pub(super) endpoints: HashMap<u64, Endpoint>,
    pub(super) conns: HashMap<ConnKey, Connection>,
    /// Connections that may have host data for the guest, in turn.
    pub(super) ready: VecDeque<ConnKey>,
    pub(super) control: VecDeque<Control>,
    next_token: u64,
    next_host_port: u32,
    /// A TRANSPORT_RESET event is owed to the guest (after a restore).
    pub(super) pending_reset_event: bool,
    /// After a restore: nothing goes to the guest's rx queue until its
    /// driver has handled the transport reset ([`ResetHold`]).
    pub(super) reset_hold: Option<ResetHold>,
    pub(super) scratch: Vec<u8>,
    pub(super) timeouts: Timeouts,
    /// Host connections the guest left unanswered past the nudge time or
    /// the connect deadline since the device thread last looked at the
    /// rings.
    unanswered: usize,
}

fn conn_events() -> EventSet {
    EventSet::IN | EventSet::OUT | EventSet::READ_HANG_UP | EventSet::EDGE_TRIGGERED
}

impl VsockDevice {
    /// Binds the host socket and sets up the epoll set.
    pub fn new(config: &VsockConfig) -> Result<Self, VsockError> {
        if config.cid < 3 || config.cid >= u64::from(u32::MAX) {
            return Err(VsockError::ReservedCid(config.cid));
        }
        let listener = Listener::bind(&config.uds_path)?;
        let epoll = Epoll::new().map_err(VsockError::Epoll)?;
        let queue_evts = crate::devices::worker::queue_eventfds(&epoll)?;
        epoll
            .ctl(
                ControlOperation::Add,
                listener.socket.as_raw_fd(),
                EpollEvent::new(EventSet::IN, TOKEN_LISTENER),
            )
            .map_err(VsockError::Epoll)?;
        Ok(Self {
            cid: config.cid,
            uds_path: config.uds_path.clone(),
            listener,
            epoll: Arc::new(epoll),
            queue_evts,
            endpoints: HashMap::new(),
            conns: HashMap::new(),
            ready: VecDeque::new(),
            control: VecDeque::new(),
            next_token: FIRST_DYNAMIC_TOKEN,
            next_host_port: HOST_PORT_BASE,
            pending_reset_event: false,
            reset_hold: None,
            unanswered: 0,
            scratch: vec![0; super::packet::MAX_PKT_PAYLOAD as usize],
            timeouts: Timeouts {
                handshake: Duration::from_secs(5),
                connect: Duration::from_secs(10),
                close: Duration::from_secs(2),
                nudge: Duration::from_secs(2),
            },
        })
    }

    pub fn cid(&self) -> u64 {
        self.cid
    }

    pub fn uds_path(&self) -> &Path {
        &self.uds_path
    }

    /// The epoll set the device thread waits on.
    pub fn epoll(&self) -> Arc<Epoll> {
        self.epoll.clone()
    }

    /// The notification eventfd of queue `index` (rx 0, tx 1, event 2), for
    /// KVM ioeventfd registration.
    pub fn queue_evt(&self, index: usize) -> Option<&EventFd> {
        self.queue_evts.get(index)
    }

    pub fn connection_count(&self) -> usize {
        self.conns.len()
    }

    /// How long the device thread may sleep before a deadline passes
    /// (-1: no deadline).
    pub fn next_timeout_ms(&self) -> i32 {
        let handshakes = self.endpoints.values().filter_map(|e| match e {
            Endpoint::Handshake(h) => Some(h.deadline),
            Endpoint::Conn(_) => None,
        });
        let conns = self.conns.values().filter_map(|c| match c.state {
            ConnState::LocalInit { deadline, nudge } => {
                Some(nudge.map_or(deadline, |n| n.min(deadline)))
            }
            ConnState::Closing { deadline } => Some(deadline),
            ConnState::Established => None,
        });
        // A delivered reset is watched for by polling the event queue: the
        // driver's refill need not notify (EVENT_IDX).
        let hold = self.reset_hold.and_then(|h| match h.delivered_at {
            Some(_) => Some(Instant::now() + RESET_POLL),
            None => h.until,
        });
        match handshakes.chain(conns).chain(hold).min() {
            None => -1,
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now()).as_millis();
                // Round up so the deadline has passed on wake-up.
                (left + 1).min(i32::MAX as u128) as i32
            }
        }
    }

    /// Handles what epoll reported, then moves packets both ways if the
    /// driver has activated the device.
    pub fn handle_events(&mut self, events: &[EpollEvent], ctx: Option<&mut QueueContext<'_>>) {
        let mut kick_tx = false;
        for ev in events {
            match ev.data() {
                t @ 0..=2 => {
                    let _ = self.queue_evts[t as usize].read();
                    kick_tx |= t as usize == TXQ;
                }
                TOKEN_LISTENER => self.accept_all(),
                TOKEN_WAKE => {}
                token => self.endpoint_event(token, ev.event_set()),
            }
        }
        self.sweep(Instant::now());
        if let Some(ctx) = ctx {
            if kick_tx {
                self.process_tx(ctx);
            }
            self.process_rx(ctx);
            self.process_events(ctx);
            self.look_at_unanswered(ctx);
        }
    }

    fn register(&mut self, fd: RawFd, events: EventSet) -> std::io::Result<u64> {
        let token = self.next_token;
        self.epoll
            .ctl(ControlOperation::Add, fd, EpollEvent::new(events, token))?;
        self.next_token += 1;
        Ok(token)
    }

    fn deregister(&mut self, token: u64) -> Option<Endpoint> {
        let endpoint = self.endpoints.remove(&token)?;
        let fd = match &endpoint {
            Endpoint::Handshake(h) => Some(h.stream.as_raw_fd()),
            Endpoint::Conn(key) => self.conns.get(key).map(|c| c.stream.as_raw_fd()),
        };
        if let Some(fd) = fd {
            let _ = self
                .epoll
                .ctl(ControlOperation::Delete, fd, EpollEvent::default());
        }
        Some(endpoint)
    }

    fn accept_all(&mut self) {
        loop {
            let stream = match self.listener.socket.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::warn!("vsock accept failed: {e}");
                    return;
                }
            };
            let handshakes = self
                .endpoints
                .values()
                .filter(|e| matches!(e, Endpoint::Handshake(_)))
                .count();
            if handshakes >= MAX_HANDSHAKES || stream.set_nonblocking(true).is_err() {
                continue;
            }
            let deadline = Instant::now() + self.timeouts.handshake;
            match self.register(stream.as_raw_fd(), EventSet::IN) {
                Ok(token) => {
                    let h = Handshake::new(stream, deadline);
                    self.endpoints.insert(token, Endpoint::Handshake(h));
                }
                Err(e) => tracing::warn!("cannot watch a vsock host connection: {e}"),
            }
        }
    }

    fn endpoint_event(&mut self, token: u64, events: EventSet) {
        match self.endpoints.get_mut(&token) {
            Some(Endpoint::Handshake(h)) => match h.advance() {
                HandshakeStep::Incomplete => {}
                HandshakeStep::Failed => {
                    self.deregister(token);
                }
                HandshakeStep::Connect(port) => self.start_host_connection(token, port),
            },
            Some(Endpoint::Conn(key)) => {
                let key = *key;
                self.connection_event(key, events);
            }
            None => {}
        }
    }

    /// Hands out host ports from a random point of the range from now on.
    /// A restored device does this: its snapshot's guest may still hold
    /// sockets of the connections it had when the snapshot was taken
    /// (Linux resets them only once it handles the transport reset, and a
    /// reset socket stays in the connected table until its owner closes
    /// it), and a REQUEST carrying the ports of one of them is answered
    /// RST, so a connection must not reuse them. Every restore of one
    /// snapshot would otherwise start again at [`HOST_PORT_BASE`], where
    /// the snapshot's own connections began.
    pub(super) fn scatter_host_ports(&mut self) -> Result<(), VsockError> {
        let r = u32::from_le_bytes(crate::identity::random_bytes().map_err(VsockError::Random)?);
        // Anywhere in the lower half of the range: room above for the
        // ports this VMM will hand out.
        self.next_host_port = HOST_PORT_BASE + r % ((u32::MAX - HOST_PORT_BASE) / 2);
        Ok(())
    }

    fn alloc_host_port(&mut self) -> u32 {
        loop {
            let port = self.next_host_port;
            self.next_host_port = match port.checked_add(1) {
                Some(p) if p < u32::MAX => p,
                _ => HOST_PORT_BASE,
            };
            if !self.conns.keys().any(|k| k.local_port == port) {
                return port;
            }
        }
    }

    /// The host asked for guest port `port`: send the guest a REQUEST.
    fn start_host_connection(&mut self, token: u64, port: u32) {
        if self.conns.len() >= MAX_CONNECTIONS {
            self.deregister(token);
            return;
        }
        let Some(Endpoint::Handshake(h)) = self.endpoints.remove(&token) else {
            return;
        };
        let event = EpollEvent::new(conn_events(), token);
        if let Err(e) = self
            .epoll
            .ctl(ControlOperation::Modify, h.stream.as_raw_fd(), event)
        {
            tracing::warn!("cannot watch a vsock connection: {e}");
            return;
        }
        let key = ConnKey {
            local_port: self.alloc_host_port(),
            peer_port: port,
        };
        let deadline = Instant::now() + self.timeouts.connect;
        let nudge = Some(Instant::now() + self.timeouts.nudge);
        let conn = Connection::new(h.stream, token, ConnState::LocalInit { deadline, nudge });
        self.endpoints.insert(token, Endpoint::Conn(key));
        self.conns.insert(key, conn);
        self.push_control(key, OP_REQUEST, 0);
    }

    /// Adds a connection the guest asked for and the host accepted.
    pub(super) fn add_connection(&mut self, key: ConnKey, mut conn: Connection) -> bool {
        match self.register(conn.stream.as_raw_fd(), conn_events()) {
            Ok(token) => {
                conn.token = token;
                self.endpoints.insert(token, Endpoint::Conn(key));
                self.conns.insert(key, conn);
                true
            }
            Err(e) => {
                tracing::warn!("cannot watch a vsock connection: {e}");
                false
            }
        }
    }

    fn connection_event(&mut self, key: ConnKey, events: EventSet) {
        let Some(conn) = self.conns.get_mut(&key) else {
            return;
        };
        let readable = EventSet::IN | EventSet::READ_HANG_UP | EventSet::HANG_UP | EventSet::ERROR;
        if events.intersects(readable) {
            conn.host_readable = true;
        }
        if events.contains(EventSet::OUT) {
            if let Err(e) = conn.flush_host() {
                tracing::debug!(?key, "vsock host write failed: {e}");
                self.reset_connection(key);
                return;
            }
            self.after_host_write(key);
        }
        self.mark_ready(key);
    }

    /// After data went to the host: tell the guest about freed credit, and
    /// finish a close that waited for the data to drain.
    pub(super) fn after_host_write(&mut self, key: ConnKey) {
        let Some(conn) = self.conns.get(&key) else {
            return;
        };
        if matches!(conn.state, ConnState::Closing { .. }) && !conn.has_pending() {
            self.reset_connection(key);
        } else if conn.needs_credit_update() {
            self.push_control(key, super::packet::OP_CREDIT_UPDATE, 0);
        }
    }

    /// Queues `key` for host→guest data if it has any to send; asks the
    /// guest for credit if that is what stops it.
    pub(super) fn mark_ready(&mut self, key: ConnKey) {
        let Some(conn) = self.conns.get_mut(&key) else {
            return;
        };
        if conn.wants_to_send() && !conn.queued {
            conn.queued = true;
            self.ready.push_back(key);
        } else if conn.starved_of_credit() && !conn.credit_requested {
            conn.credit_requested = true;
            self.push_control(key, OP_CREDIT_REQUEST, 0);
        }
    }

    pub(super) fn push_control(&mut self, key: ConnKey, op: u16, flags: u32) {
        if self.control.len() >= MAX_CONTROL {
            crate::guest_warn!(?key, op, "vsock control queue full; packet dropped");
            return;
        }
        self.control.push_back(Control { key, op, flags });
    }

    /// Closes the host side and forgets the connection, quietly.
    pub(super) fn remove_connection(&mut self, key: ConnKey) {
        if let Some(token) = self.conns.get(&key).map(|c| c.token) {
            self.deregister(token);
        }
        self.conns.remove(&key);
    }

    /// Closes the host side and tells the guest (RST).
    pub(super) fn reset_connection(&mut self, key: ConnKey) {
        self.remove_connection(key);
        self.push_control(key, OP_RST, 0);
    }

    fn sweep(&mut self, now: Instant) {
        let stale: Vec<u64> = self
            .endpoints
            .iter()
            .filter_map(|(&t, e)| match e {
                Endpoint::Handshake(h) if h.deadline <= now => Some(t),
                _ => None,
            })
            .collect();
        for token in stale {
            self.deregister(token);
        }
        let expired: Vec<(ConnKey, bool)> = self
            .conns
            .iter()
            .filter_map(|(&k, c)| match c.state {
                ConnState::LocalInit { deadline, .. } if deadline <= now => Some((k, true)),
                ConnState::Closing { deadline } if deadline <= now => Some((k, false)),
                _ => None,
            })
            .collect();
        for (key, unanswered) in expired {
            self.unanswered += usize::from(unanswered);
            self.reset_connection(key);
        }
        for conn in self.conns.values_mut() {
            if let ConnState::LocalInit { nudge, .. } = &mut conn.state {
                if nudge.is_some_and(|at| at <= now) {
                    *nudge = None;
                    self.unanswered += 1;
                }
            }
        }
    }

    /// After a host connection went unanswered (the guest neither accepted
    /// nor refused it within [`Timeouts::nudge`], or the connect
    /// deadline): logs where the rings
    /// stand, and raises the interrupt again if the driver has not
    /// acknowledged the last one. An edge-triggered interrupt lost on its
    /// way (seen under nested virtualization) would otherwise leave the
    /// driver waiting for ever: it takes no rx buffers back, answers no
    /// REQUEST, and every later connection times out too. A spurious
    /// interrupt is harmless (the driver finds nothing new).
    fn look_at_unanswered(&mut self, ctx: &QueueContext<'_>) {
        if self.unanswered == 0 {
            return;
        }
        let unanswered = std::mem::take(&mut self.unanswered);
        let rx = ctx.ring_state(RXQ);
        let tx = ctx.ring_state(TXQ);
        let ev = ctx.ring_state(EVQ);
        let pending = rx.map_or(0, |r| r.interrupt_status);
        crate::guest_warn!(
            unanswered,
            ?rx,
            ?tx,
            ?ev,
            control = self.control.len(),
            ready = self.ready.len(),
            connections = self.conns.len(),
            reraised = pending != 0,
            "vsock: the guest left host connections unanswered"
        );
        if pending != 0 {
            ctx.raise_again();
        }
    }

    /// Answers a host-initiated connection the guest accepted.
    pub(super) fn write_ok_line(conn: &mut Connection, key: ConnKey) -> std::io::Result<()> {
        conn.stream
            .write_all(format!("OK {}\n", key.local_port).as_bytes())
    }

    /// Drops every connection (the host sees EOF) and pending packet.
    fn drop_connections(&mut self) {
        let keys: Vec<ConnKey> = self.conns.keys().copied().collect();
        for key in keys {
            self.remove_connection(key);
        }
        self.ready.clear();
        self.control.clear();
    }
}

impl VirtioDevice for VsockDevice {
    fn device_type(&self) -> u32 {
        TYPE_VSOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE; 3]
    }

    fn avail_features(&self) -> u64 {
        VIRTIO_F_VERSION_1 | VIRTIO_F_RING_EVENT_IDX
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let config = self.cid.to_le_bytes();
        crate::devices::virtio::read_config_bytes(&config, offset, data);
    }

    /// Wakes the device thread to look at every queue (after a restore,
    /// notifications from before the snapshot are lost).
    fn activate(&mut self, _acked_features: u64) -> Result<(), VirtioError> {
        crate::devices::worker::kick_all(&self.queue_evts)
    }

    fn queue_notify(&mut self, index: usize, _ctx: &mut QueueContext<'_>) {
        crate::devices::worker::kick_queue(&self.queue_evts, index, "vsock");
    }

    fn reset(&mut self) {
        self.drop_connections();
        self.pending_reset_event = false;
        self.reset_hold = None;
    }
}
