//! One vsock stream between a guest port and a host unix socket, with
//! virtio-vsock's credit-based flow control in both directions.

use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::num::Wrapping;
use std::os::unix::net::UnixStream;
use std::time::Instant;

use super::packet::Header;

/// Bytes the VMM buffers per connection for the host side: the credit the
/// guest gets.
pub const CONN_BUF_ALLOC: u32 = 256 * 1024;
/// Freed buffer space worth telling the guest about unasked.
pub const CREDIT_UPDATE_THRESHOLD: u32 = CONN_BUF_ALLOC / 4;

/// Connection identity: our (host-side) port and the guest's port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnKey {
    pub local_port: u32,
    pub peer_port: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnState {
    /// Host-initiated: REQUEST sent, waiting for the guest's RESPONSE.
    LocalInit {
        deadline: Instant,
        /// When the device looks at why the guest is slow to answer
        /// (`None` once it has).
        nudge: Option<Instant>,
    },
    Established,
    /// The guest shut both directions; flushing what is left to the host
    /// before answering RST.
    Closing {
        deadline: Instant,
    },
}

/// Why a connection must be reset.
#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    #[error("the guest sent {0} bytes beyond the credit it was given")]
    CreditOverrun(usize),
    #[error("host socket failed: {0}")]
    Host(std::io::Error),
}

#[derive(Debug)]
pub struct Connection {
    pub stream: UnixStream,
    pub token: u64,
    pub state: ConnState,
    /// Guest → host: bytes the host socket has not taken yet.
    pending: VecDeque<u8>,
    /// Bytes forwarded to the host (what the guest learns as fwd_cnt).
    fwd_cnt: Wrapping<u32>,
    last_fwd_cnt_sent: Wrapping<u32>,
    /// Host → guest: the guest's buffer and what it has consumed.
    peer_buf_alloc: u32,
    peer_fwd_cnt: Wrapping<u32>,
    tx_cnt: Wrapping<u32>,
    /// The host socket signalled readable and has not yet said EAGAIN.
    pub host_readable: bool,
    /// The host side ended (EOF): SHUTDOWN sent to the guest.
    pub host_eof: bool,
    pub guest_shut_rcv: bool,
    pub guest_shut_send: bool,
    /// CREDIT_REQUEST sent and not yet answered.
    pub credit_requested: bool,
    /// Listed among the connections with data for the guest.
    pub queued: bool,
}

impl Connection {
    pub fn new(stream: UnixStream, token: u64, state: ConnState) -> Self {
        Self {
            stream,
            token,
            state,
            pending: VecDeque::new(),
            fwd_cnt: Wrapping(0),
            last_fwd_cnt_sent: Wrapping(0),
            peer_buf_alloc: 0,
            peer_fwd_cnt: Wrapping(0),
            tx_cnt: Wrapping(0),
            host_readable: false,
            host_eof: false,
            guest_shut_rcv: false,
            guest_shut_send: false,
            credit_requested: false,
            queued: false,
        }
    }

    pub fn is_established(&self) -> bool {
        self.state == ConnState::Established
    }

    /// Takes the guest's view of its receive buffer from any packet it sent.
    pub fn update_peer_credit(&mut self, hdr: &Header) {
        self.peer_buf_alloc = hdr.buf_alloc;
        self.peer_fwd_cnt = Wrapping(hdr.fwd_cnt);
        self.credit_requested = false;
    }

    /// Bytes the guest can take now.
    pub fn peer_credit(&self) -> u32 {
        let in_flight = (self.tx_cnt - self.peer_fwd_cnt).0;
        self.peer_buf_alloc.saturating_sub(in_flight)
    }

    /// Whether there may be host data to move to the guest now.
    pub fn wants_to_send(&self) -> bool {
        self.is_established()
            && self.host_readable
            && !self.host_eof
            && !self.guest_shut_rcv
            && self.peer_credit() > 0
    }

    /// Whether the host has data but the guest gave no credit for it.
    pub fn starved_of_credit(&self) -> bool {
        self.is_established()
            && self.host_readable
            && !self.host_eof
            && !self.guest_shut_rcv
            && self.peer_credit() == 0
    }

    /// fwd_cnt for a packet about to be sent to the guest.
    pub fn fwd_cnt_to_send(&mut self) -> u32 {
        self.last_fwd_cnt_sent = self.fwd_cnt;
        self.fwd_cnt.0
    }

    /// The guest should hear about freed buffer space.
    pub fn needs_credit_update(&self) -> bool {
        (self.fwd_cnt - self.last_fwd_cnt_sent).0 >= CREDIT_UPDATE_THRESHOLD
    }

    /// Reads host data for the guest into `buf`. `Ok(0)` is EOF; EAGAIN
    /// clears `host_readable` and reads as `Ok(0)` with nothing changed.
    pub fn read_host(&mut self, buf: &mut [u8]) -> Result<Option<usize>, ConnError> {
        loop {
            match self.stream.read(buf) {
                Ok(n) => {
                    self.tx_cnt += Wrapping(n as u32);
                    return Ok(Some(n));
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    self.host_readable = false;
                    return Ok(None);
                }
                Err(e) => return Err(ConnError::Host(e)),
            }
        }
    }

    /// Writes as much pending data as the host socket takes now.
    pub fn flush_host(&mut self) -> Result<(), ConnError> {
        while !self.pending.is_empty() {
            let (front, _) = self.pending.as_slices();
            match self.stream.write(front) {
                Ok(0) => return Err(ConnError::Host(ErrorKind::WriteZero.into())),
                Ok(n) => {
                    self.pending.drain(..n);
                    self.fwd_cnt += Wrapping(n as u32);
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
                Err(e) => return Err(ConnError::Host(e)),
            }
        }
        if self.guest_shut_send {
            // Everything the guest sent is out: pass its end-of-stream on.
            let _ = self.stream.shutdown(std::net::Shutdown::Write);
        }
        Ok(())
    }

    /// Data from the guest for the host: written now or kept, within the
    /// credit the guest was given.
    pub fn send_to_host(&mut self, data: &[u8]) -> Result<(), ConnError> {
        if self.pending.len() + data.len() > CONN_BUF_ALLOC as usize {
            return Err(ConnError::CreditOverrun(
                self.pending.len() + data.len() - CONN_BUF_ALLOC as usize,
            ));
        }
        self.pending.extend(data);
        self.flush_host()
    }

    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }
}
