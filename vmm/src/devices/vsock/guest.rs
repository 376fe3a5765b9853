//! The guest side of the vsock device: packets the driver sends on the tx
//! queue, packets (control and data) delivered into its rx buffers, and the
//! transport-reset event.

use std::time::Instant;

use super::conn::{ConnKey, ConnState, Connection, CONN_BUF_ALLOC};
use super::device::{VsockDevice, EVQ, RXQ, TXQ};
use super::packet::*;
use super::unix::{connect_nonblocking, guest_target};
use crate::devices::virtio::{DescChain, QueueContext};

impl VsockDevice {
    /// Handles every packet the driver queued for sending.
    pub(super) fn process_tx(&mut self, ctx: &mut QueueContext<'_>) {
        ctx.drain(TXQ, |ctx, chain| {
            self.tx_packet(ctx, chain);
            0
        });
    }

    fn tx_packet(&mut self, ctx: &mut QueueContext<'_>, chain: &DescChain) {
        let readable = chain.readable_len();
        if chain.truncated
            || chain.writable_len() > 0
            || readable < HDR_LEN as u64
            || !chain.in_memory(ctx.mem)
        {
            tracing::debug!(head = chain.head, "malformed vsock tx chain dropped");
            return;
        }
        let mut raw = [0u8; HDR_LEN];
        if ctx.read(chain, 0, &mut raw).is_err() {
            return;
        }
        let hdr = Header::from_bytes(&raw);
        if hdr.src_cid != self.cid || hdr.dst_cid != HOST_CID {
            tracing::debug!(?hdr, "vsock packet with foreign addresses dropped");
            return;
        }
        let key = ConnKey {
            local_port: hdr.dst_port,
            peer_port: hdr.src_port,
        };
        let payload_ok = if hdr.op == OP_RW {
            hdr.len <= MAX_PKT_PAYLOAD && u64::from(hdr.len) <= readable - HDR_LEN as u64
        } else {
            hdr.len == 0
        };
        if hdr.kind != TYPE_STREAM || !payload_ok {
            tracing::debug!(?hdr, "bad vsock packet: connection reset");
            self.refuse(key, hdr.op);
            return;
        }
        if let Some(conn) = self.conns.get_mut(&key) {
            conn.update_peer_credit(&hdr);
        }
        match hdr.op {
            OP_REQUEST => self.guest_connect(key, &hdr),
            OP_RESPONSE => self.guest_accepted(key),
            OP_RST => self.remove_connection(key),
            OP_SHUTDOWN => self.guest_shutdown(key, hdr.flags),
            OP_RW => {
                let mut data = vec![0u8; hdr.len as usize];
                match ctx.read(chain, HDR_LEN as u64, &mut data) {
                    Ok(()) => self.guest_data(key, &data),
                    Err(_) => self.refuse(key, hdr.op),
                }
            }
            OP_CREDIT_UPDATE if self.conns.contains_key(&key) => self.mark_ready(key),
            OP_CREDIT_REQUEST if self.conns.contains_key(&key) => {
                self.push_control(key, OP_CREDIT_UPDATE, 0)
            }
            _ => self.refuse(key, hdr.op),
        }
    }

    /// Resets `key` (whether or not it exists); never answers an RST.
    fn refuse(&mut self, key: ConnKey, op: u16) {
        if op == OP_RST {
            self.remove_connection(key);
        } else {
            self.reset_connection(key);
        }
    }

    /// The guest connects to host port `key.local_port`.
    fn guest_connect(&mut self, key: ConnKey, hdr: &Header) {
        if self.conns.contains_key(&key) || self.conns.len() >= super::device::MAX_CONNECTIONS {
            self.reset_connection(key);
            return;
        }
        let target = guest_target(&self.uds_path, key.local_port);
        let stream = match connect_nonblocking(&target) {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(path = %target.display(), "vsock guest connect refused: {e}");
                self.push_control(key, OP_RST, 0);
                return;
            }
        };
        let mut conn = Connection::new(stream, 0, ConnState::Established);
        conn.update_peer_credit(hdr);
        if self.add_connection(key, conn) {
            self.push_control(key, OP_RESPONSE, 0);
        } else {
            self.push_control(key, OP_RST, 0);
        }
    }

    /// The guest accepted a host-initiated connection.
    fn guest_accepted(&mut self, key: ConnKey) {
        let Some(conn) = self.conns.get_mut(&key) else {
            self.push_control(key, OP_RST, 0);
            return;
        };
        if !matches!(conn.state, ConnState::LocalInit { .. }) {
            self.reset_connection(key);
            return;
        }
        conn.state = ConnState::Established;
        if Self::write_ok_line(conn, key).is_err() {
            self.reset_connection(key);
            return;
        }
        self.mark_ready(key);
    }

    fn guest_shutdown(&mut self, key: ConnKey, flags: u32) {
        let Some(conn) = self.conns.get_mut(&key) else {
            self.push_control(key, OP_RST, 0);
            return;
        };
        conn.guest_shut_rcv |= flags & SHUTDOWN_RCV != 0;
        conn.guest_shut_send |= flags & SHUTDOWN_SEND != 0;
        if conn.flush_host().is_err() {
            self.reset_connection(key);
            return;
        }
        if conn.guest_shut_rcv && conn.guest_shut_send {
            if conn.has_pending() {
                let deadline = Instant::now() + self.timeouts.close;
                conn.state = ConnState::Closing { deadline };
            } else {
                self.reset_connection(key);
            }
        }
    }

    fn guest_data(&mut self, key: ConnKey, data: &[u8]) {
        let Some(conn) = self.conns.get_mut(&key) else {
            self.push_control(key, OP_RST, 0);
            return;
        };
        if !conn.is_established() || conn.guest_shut_send {
            self.reset_connection(key);
            return;
        }
        if let Err(e) = conn.send_to_host(data) {
            tracing::debug!(?key, "vsock connection reset: {e}");
            self.reset_connection(key);
            return;
        }
        self.after_host_write(key);
    }

    /// Drops stale entries from the front of the ready list.
    fn next_ready(&mut self) -> Option<ConnKey> {
        while let Some(&key) = self.ready.front() {
            match self.conns.get_mut(&key) {
                Some(c) if c.wants_to_send() => return Some(key),
                Some(c) => c.queued = false,
                None => {}
            }
            self.ready.pop_front();
        }
        None
    }

    /// Whether the rx queue is held back after a restore (see
    /// [`super::device::ResetHold`]); ends the hold once the driver has
    /// refilled its event queue, or at the hold's limit (counted from the
    /// first look, when the VM runs).
    fn rx_held(&mut self, ctx: &QueueContext<'_>) -> bool {
        let Some(hold) = self.reset_hold.as_mut() else {
            return false;
        };
        let now = Instant::now();
        let until = *hold
            .until
            .get_or_insert(now + super::device::RESET_HOLD_LIMIT);
        let handled = hold.delivered_at.is_some_and(|at| {
            ctx.ring_state(EVQ)
                .and_then(|r| r.avail_idx)
                .is_some_and(|avail| avail != at)
        });
        let delivered = hold.delivered_at.is_some();
        if !handled && now < until {
            return true;
        }
        if !handled {
            crate::guest_warn!(
                delivered,
                "vsock: the driver did not show it handled the transport reset; rx goes on"
            );
        }
        self.reset_hold = None;
        false
    }

    /// Fills rx buffers with control packets first, then host data.
    pub(super) fn process_rx(&mut self, ctx: &mut QueueContext<'_>) {
        if self.rx_held(ctx) {
            return;
        }
        let mut used = false;
        loop {
            let control = !self.control.is_empty();
            if !control && self.next_ready().is_none() {
                break;
            }
            let Some(chain) = ctx.pop_or_enable(RXQ) else {
                break;
            };
            let usable = chain.is_ordered()
                && !chain.truncated
                && chain.readable_len() == 0
                && chain.writable_len() >= HDR_LEN as u64
                && chain.in_memory(ctx.mem);
            let written = if !usable {
                tracing::debug!(head = chain.head, "unusable vsock rx buffer returned empty");
                Some(0)
            } else if control {
                Some(self.deliver_control(ctx, &chain))
            } else {
                self.deliver_data(ctx, &chain)
            };
            match written {
                Some(len) => {
                    ctx.add_used(RXQ, chain.head, len);
                    used = true;
                }
                None => ctx.undo_pop(RXQ),
            }
        }
        if used {
            ctx.notify_guest(RXQ);
        }
    }

    fn header_for(&mut self, key: ConnKey, op: u16, flags: u32, len: u32) -> Header {
        let fwd_cnt = self
            .conns
            .get_mut(&key)
            .map_or(0, Connection::fwd_cnt_to_send);
        Header {
            src_cid: HOST_CID,
            dst_cid: self.cid,
            src_port: key.local_port,
            dst_port: key.peer_port,
            len,
            kind: TYPE_STREAM,
            op,
            flags,
            buf_alloc: CONN_BUF_ALLOC,
            fwd_cnt,
        }
    }

    fn deliver_control(&mut self, ctx: &mut QueueContext<'_>, chain: &DescChain) -> u32 {
        let Some(c) = self.control.pop_front() else {
            return 0;
        };
        let hdr = self.header_for(c.key, c.op, c.flags, 0);
        match ctx.write(chain, 0, &hdr.to_bytes()) {
            Ok(()) => HDR_LEN as u32,
            Err(_) => 0,
        }
    }

    /// One RW packet of host data; `None` if there was nothing to send
    /// after all (the buffer goes back).
    fn deliver_data(&mut self, ctx: &mut QueueContext<'_>, chain: &DescChain) -> Option<u32> {
        let key = self.ready.pop_front()?;
        let conn = self.conns.get_mut(&key)?;
        conn.queued = false;
        let room = (chain.writable_len() - HDR_LEN as u64)
            .min(u64::from(MAX_PKT_PAYLOAD))
            .min(u64::from(conn.peer_credit())) as usize;
        if room == 0 {
            // A buffer with no room for data: skip it, keep the data.
            self.mark_ready(key);
            return Some(0);
        }
        match conn.read_host(&mut self.scratch[..room]) {
            Ok(Some(0)) => {
                conn.host_eof = true;
                conn.host_readable = false;
                self.push_control(key, OP_SHUTDOWN, SHUTDOWN_SEND);
                None
            }
            Ok(Some(n)) => {
                let hdr = self.header_for(key, OP_RW, 0, n as u32);
                let ok = ctx.write(chain, 0, &hdr.to_bytes()).is_ok()
                    && ctx.write(chain, HDR_LEN as u64, &self.scratch[..n]).is_ok();
                self.mark_ready(key);
                Some(if ok { (HDR_LEN + n) as u32 } else { 0 })
            }
            Ok(None) => {
                self.mark_ready(key);
                None
            }
            Err(e) => {
                tracing::debug!(?key, "vsock host read failed: {e}");
                self.reset_connection(key);
                None
            }
        }
    }

    /// Sends the owed TRANSPORT_RESET event, if a buffer is there for it.
    pub(super) fn process_events(&mut self, ctx: &mut QueueContext<'_>) {
        while self.pending_reset_event {
            let Some(chain) = ctx.pop_or_enable(EVQ) else {
                return;
            };
            let event = EVENT_TRANSPORT_RESET.to_le_bytes();
            let usable =
                chain.is_ordered() && chain.readable_len() == 0 && chain.in_memory(ctx.mem);
            let len = if usable && ctx.write(&chain, 0, &event).is_ok() {
                self.pending_reset_event = false;
                event.len() as u32
            } else {
                0
            };
            ctx.add_used(EVQ, chain.head, len);
            if !self.pending_reset_event {
                let avail = ctx.ring_state(EVQ).and_then(|r| r.avail_idx);
                if let (Some(hold), Some(at)) = (&mut self.reset_hold, avail) {
                    hold.delivered_at = Some(at);
                }
            }
            ctx.notify_guest(EVQ);
        }
    }
}
