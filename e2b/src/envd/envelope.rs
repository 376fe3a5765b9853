//! The Connect protocol's envelopes, which frame the messages of a
//! streaming call (`application/connect+json`): one flags byte, the
//! payload's length as a big-endian `u32`, the payload. Flag `0x01` marks a
//! compressed payload (no compression is negotiated here, so it is an
//! error), `0x02` the end-of-stream message (a JSON `{"error": ...,
//! "metadata": ...}`). Unary calls carry a bare JSON body and no envelope.
//!
//! [`Decoder`] is incremental: bytes go in as they arrive, whole envelopes
//! come out, and malformed input is a typed [`EnvelopeError`], never a
//! panic or an unbounded buffer.

use serde::Serialize;

/// Flag of a compressed payload.
pub const FLAG_COMPRESSED: u8 = 0x01;
/// Flag of the end-of-stream message.
pub const FLAG_END_STREAM: u8 = 0x02;
/// Bytes before the payload.
pub const HEADER_LEN: usize = 5;

/// One envelope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope {
    pub flags: u8,
    pub payload: Vec<u8>,
}

impl Envelope {
    pub fn message(payload: Vec<u8>) -> Self {
        Envelope { flags: 0, payload }
    }

    pub fn is_end_stream(&self) -> bool {
        self.flags & FLAG_END_STREAM != 0
    }

    /// The envelope's bytes.
    ///
    /// # Panics
    /// If the payload is 4 GiB or more (a length the format cannot hold).
    pub fn encode(&self) -> Vec<u8> {
        let len = u32::try_from(self.payload.len()).expect("envelope payload under 4 GiB");
        let mut out = Vec::with_capacity(HEADER_LEN + self.payload.len());
        out.push(self.flags);
        out.extend_from_slice(&len.to_be_bytes());
        out.extend_from_slice(&self.payload);
        out
    }
}

/// Why a stream of envelopes is malformed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvelopeError {
    #[error("envelope of {len} bytes is over the limit of {limit}")]
    TooLarge { len: u64, limit: usize },
    #[error("envelope flags {flags:#04x} name unknown bits")]
    UnknownFlags { flags: u8 },
    #[error("compressed envelope, but no compression was negotiated")]
    Compressed,
    #[error("the stream ended inside an envelope ({have} of {want} bytes)")]
    Truncated { have: usize, want: usize },
    #[error("a message after the end-of-stream envelope")]
    AfterEnd,
}

/// Reads envelopes out of bytes as they arrive.
#[derive(Debug)]
pub struct Decoder {
    buf: Vec<u8>,
    limit: usize,
    ended: bool,
}

impl Decoder {
    /// A decoder refusing payloads over `limit` bytes (checked on the
    /// declared length, before buffering it).
    pub fn new(limit: usize) -> Self {
        Decoder {
            buf: Vec::new(),
            limit,
            ended: false,
        }
    }

    /// Adds bytes.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The next whole envelope, `None` until one has arrived.
    pub fn next_envelope(&mut self) -> Result<Option<Envelope>, EnvelopeError> {
        if self.buf.len() < HEADER_LEN {
            return Ok(None);
        }
        let flags = self.buf[0];
        if flags & !(FLAG_COMPRESSED | FLAG_END_STREAM) != 0 {
            return Err(EnvelopeError::UnknownFlags { flags });
        }
        if flags & FLAG_COMPRESSED != 0 {
            return Err(EnvelopeError::Compressed);
        }
        if self.ended {
            return Err(EnvelopeError::AfterEnd);
        }
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]);
        if len as u64 > self.limit as u64 {
            return Err(EnvelopeError::TooLarge {
                len: len.into(),
                limit: self.limit,
            });
        }
        let end = HEADER_LEN + len as usize;
        if self.buf.len() < end {
            return Ok(None);
        }
        let payload = self.buf[HEADER_LEN..end].to_vec();
        self.buf.drain(..end);
        let envelope = Envelope { flags, payload };
        self.ended = envelope.is_end_stream();
        Ok(Some(envelope))
    }

    /// The input is over: an error if it stopped inside an envelope.
    pub fn finish(&self) -> Result<(), EnvelopeError> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let want = if self.buf.len() < HEADER_LEN {
            HEADER_LEN
        } else {
            HEADER_LEN
                + u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize
        };
        Err(EnvelopeError::Truncated {
            have: self.buf.len(),
            want,
        })
    }
}

/// Decodes a whole body of envelopes (a client stream's request, a test's
/// response).
pub fn decode_all(bytes: &[u8], limit: usize) -> Result<Vec<Envelope>, EnvelopeError> {
    let mut d = Decoder::new(limit);
    d.push(bytes);
    let mut out = Vec::new();
    while let Some(e) = d.next_envelope()? {
        out.push(e);
    }
    d.finish()?;
    Ok(out)
}

/// The error of a Connect call: its code and message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ConnectError {
    pub code: super::Code,
    pub message: String,
}

#[derive(Serialize)]
struct EndStream<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<&'a ConnectError>,
}

/// The end-of-stream envelope: `{}` after success, `{"error": {...}}`.
pub fn end_stream(error: Option<&ConnectError>) -> Envelope {
    let payload = serde_json::to_vec(&EndStream { error }).unwrap_or_else(|_| b"{}".to_vec());
    Envelope {
        flags: FLAG_END_STREAM,
        payload,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envd::Code;

    #[test]
    fn envelopes_round_trip_whatever_the_chunking() {
        let messages = [
            Envelope::message(br#"{"event":{"start":{"pid":7}}}"#.to_vec()),
            Envelope::message(Vec::new()),
            end_stream(None),
        ];
        let bytes: Vec<u8> = messages.iter().flat_map(Envelope::encode).collect();
        assert_eq!(&bytes[..5], &[0, 0, 0, 0, 29]);
        assert_eq!(decode_all(&bytes, 1024).unwrap(), messages);
        // Byte by byte: the same envelopes, none early.
        let mut d = Decoder::new(1024);
        let mut out = Vec::new();
        for b in &bytes {
            d.push(std::slice::from_ref(b));
            while let Some(e) = d.next_envelope().unwrap() {
                out.push(e);
            }
        }
        d.finish().unwrap();
        assert_eq!(out, messages);
        assert!(out[2].is_end_stream());
        assert_eq!(out[2].payload, b"{}");
    }

    #[test]
    fn malformed_streams_are_typed_errors() {
        let msg = |flags: u8, len: u32, body: &[u8]| {
            let mut v = vec![flags];
            v.extend_from_slice(&len.to_be_bytes());
            v.extend_from_slice(body);
            v
        };
        // Wrong lengths: shorter than declared (truncated), a header cut.
        assert_eq!(
            decode_all(&msg(0, 10, b"abc"), 1024),
            Err(EnvelopeError::Truncated { have: 8, want: 15 })
        );
        assert_eq!(
            decode_all(&[0, 0, 0], 1024),
            Err(EnvelopeError::Truncated { have: 3, want: 5 })
        );
        // Longer than declared: the rest is read as the next header.
        assert_eq!(
            decode_all(&msg(0, 1, b"ab"), 1024),
            Err(EnvelopeError::Truncated { have: 1, want: 5 })
        );
        // A declared length over the limit is refused before buffering.
        let mut d = Decoder::new(16);
        d.push(&msg(0, u32::MAX, b""));
        assert_eq!(
            d.next_envelope(),
            Err(EnvelopeError::TooLarge {
                len: u32::MAX.into(),
                limit: 16
            })
        );
        assert_eq!(
            decode_all(&msg(0x04, 0, b""), 1024),
            Err(EnvelopeError::UnknownFlags { flags: 0x04 })
        );
        assert_eq!(
            decode_all(&msg(0x80, 0, b""), 1024),
            Err(EnvelopeError::UnknownFlags { flags: 0x80 })
        );
        assert_eq!(
            decode_all(&msg(FLAG_COMPRESSED, 2, b"{}"), 1024),
            Err(EnvelopeError::Compressed)
        );
        let mut after_end = end_stream(None).encode();
        after_end.extend(Envelope::message(b"{}".to_vec()).encode());
        assert_eq!(decode_all(&after_end, 1024), Err(EnvelopeError::AfterEnd));
        assert_eq!(decode_all(b"", 1024), Ok(Vec::new()));
    }

    #[test]
    fn end_stream_carries_the_error() {
        let e = ConnectError {
            code: Code::NotFound,
            message: "no such process".into(),
        };
        let end = end_stream(Some(&e));
        assert_eq!(end.flags, FLAG_END_STREAM);
        let v: serde_json::Value = serde_json::from_slice(&end.payload).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"error": {"code": "not_found", "message": "no such process"}})
        );
    }
}
