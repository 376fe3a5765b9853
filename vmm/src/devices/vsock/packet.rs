//! The virtio-vsock wire format (virtio 1.2, 5.10.6): `virtio_vsock_hdr`,
//! operations, flags and the event the device sends on transport reset.

/// The host's CID, as the guest addresses it.
pub const HOST_CID: u64 = 2;
/// The guest CID used when none is configured.
pub const DEFAULT_GUEST_CID: u64 = 3;

pub const HDR_LEN: usize = 44;
pub const TYPE_STREAM: u16 = 1;

pub const OP_REQUEST: u16 = 1;
pub const OP_RESPONSE: u16 = 2;
pub const OP_RST: u16 = 3;
pub const OP_SHUTDOWN: u16 = 4;
pub const OP_RW: u16 = 5;
pub const OP_CREDIT_UPDATE: u16 = 6;
pub const OP_CREDIT_REQUEST: u16 = 7;

/// SHUTDOWN flags: the sender will receive / send no more.
pub const SHUTDOWN_RCV: u32 = 1;
pub const SHUTDOWN_SEND: u32 = 2;

/// `virtio_vsock_event.id` of a transport reset.
pub const EVENT_TRANSPORT_RESET: u32 = 0;

/// Largest payload of one packet, either way (Linux's
/// VIRTIO_VSOCK_MAX_PKT_BUF_SIZE).
pub const MAX_PKT_PAYLOAD: u32 = 64 * 1024;

/// One packet header, in host byte order.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Header {
    pub src_cid: u64,
    pub dst_cid: u64,
    pub src_port: u32,
    pub dst_port: u32,
    pub len: u32,
    pub kind: u16,
    pub op: u16,
    pub flags: u32,
    pub buf_alloc: u32,
    pub fwd_cnt: u32,
}

fn u16_at(b: &[u8; HDR_LEN], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8; HDR_LEN], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn u64_at(b: &[u8; HDR_LEN], at: usize) -> u64 {
    let mut v = [0u8; 8];
    v.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(v)
}

impl Header {
    pub fn from_bytes(b: &[u8; HDR_LEN]) -> Self {
        Self {
            src_cid: u64_at(b, 0),
            dst_cid: u64_at(b, 8),
            src_port: u32_at(b, 16),
            dst_port: u32_at(b, 20),
            len: u32_at(b, 24),
            kind: u16_at(b, 28),
            op: u16_at(b, 30),
            flags: u32_at(b, 32),
            buf_alloc: u32_at(b, 36),
            fwd_cnt: u32_at(b, 40),
        }
    }

    pub fn to_bytes(&self) -> [u8; HDR_LEN] {
        let mut b = [0u8; HDR_LEN];
        b[0..8].copy_from_slice(&self.src_cid.to_le_bytes());
        b[8..16].copy_from_slice(&self.dst_cid.to_le_bytes());
        b[16..20].copy_from_slice(&self.src_port.to_le_bytes());
        b[20..24].copy_from_slice(&self.dst_port.to_le_bytes());
        b[24..28].copy_from_slice(&self.len.to_le_bytes());
        b[28..30].copy_from_slice(&self.kind.to_le_bytes());
        b[30..32].copy_from_slice(&self.op.to_le_bytes());
        b[32..36].copy_from_slice(&self.flags.to_le_bytes());
        b[36..40].copy_from_slice(&self.buf_alloc.to_le_bytes());
        b[40..44].copy_from_slice(&self.fwd_cnt.to_le_bytes());
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips_in_little_endian() {
        let h = Header {
            src_cid: 3,
            dst_cid: HOST_CID,
            src_port: 0x0102_0304,
            dst_port: 52,
            len: 7,
            kind: TYPE_STREAM,
            op: OP_RW,
            flags: SHUTDOWN_SEND,
            buf_alloc: 1 << 18,
            fwd_cnt: 99,
        };
        let b = h.to_bytes();
        assert_eq!(&b[16..20], &[4, 3, 2, 1]);
        assert_eq!(b[30], OP_RW as u8);
        assert_eq!(Header::from_bytes(&b), h);
    }
}
