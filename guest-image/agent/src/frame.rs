//! Framing: every message is a `u32` big-endian length followed by that many
//! bytes of UTF-8 JSON. Lengths of 0 or above the maximum are refused.

use serde::de::DeserializeOwned;
use serde::Serialize;
use std::io::{self, Read, Write};

/// Default and hard upper bound of a frame's payload: 16 MiB.
pub const MAX_FRAME: usize = 16 << 20;

/// Why a frame could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The stream failed.
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
    /// The peer closed the stream in the middle of a frame.
    #[error("stream closed inside a frame ({got} of {want} bytes)")]
    Truncated {
        /// Bytes received.
        got: usize,
        /// Bytes announced (4 for the header itself).
        want: usize,
    },
    /// The length prefix exceeds the maximum frame size.
    #[error("frame of {len} bytes exceeds the maximum of {max}")]
    TooLarge {
        /// Announced or serialized length.
        len: usize,
        /// The limit in force.
        max: usize,
    },
    /// A zero-length frame.
    #[error("empty frame")]
    Empty,
    /// The payload is not the JSON expected.
    #[error("bad JSON: {0}")]
    Json(#[from] serde_json::Error),
}

/// Reads exactly `buf.len()` bytes; `Ok(n < len)` only at end of stream.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

/// Reads one frame's payload. `Ok(None)` is a clean end of stream (at a frame
/// boundary). A `TooLarge` or `Truncated` error leaves the stream unusable:
/// the caller should report it and close.
pub fn read_frame(r: &mut impl Read, max: usize) -> Result<Option<Vec<u8>>, FrameError> {
    let mut hdr = [0u8; 4];
    match read_full(r, &mut hdr)? {
        0 => return Ok(None),
        4 => {}
        got => return Err(FrameError::Truncated { got, want: 4 }),
    }
    let len = u32::from_be_bytes(hdr) as usize;
    if len == 0 {
        return Err(FrameError::Empty);
    }
    if len > max {
        return Err(FrameError::TooLarge { len, max });
    }
    let mut buf = vec![0u8; len];
    let got = read_full(r, &mut buf)?;
    if got != len {
        return Err(FrameError::Truncated { got, want: len });
    }
    Ok(Some(buf))
}

/// Serializes `msg` into one complete frame (header included), refusing
/// payloads above `max`.
pub fn encode_frame<T: Serialize>(msg: &T, max: usize) -> Result<Vec<u8>, FrameError> {
    let mut buf = vec![0u8; 4];
    serde_json::to_writer(&mut buf, msg)?;
    let len = buf.len() - 4;
    if len > max || len > u32::MAX as usize {
        return Err(FrameError::TooLarge { len, max });
    }
    buf[..4].copy_from_slice(&(len as u32).to_be_bytes());
    Ok(buf)
}

/// Writes `msg` as one frame with a single `write_all` (callers sharing a
/// stream hold a lock around it, so frames never interleave).
pub fn write_message<T: Serialize>(
    w: &mut impl Write,
    msg: &T,
    max: usize,
) -> Result<(), FrameError> {
    let frame = encode_frame(msg, max)?;
    w.write_all(&frame)?;
    w.flush()?;
    Ok(())
}

/// Reads one frame and parses it as `T`; `Ok(None)` at a clean end of stream.
pub fn read_message<T: DeserializeOwned>(
    r: &mut impl Read,
    max: usize,
) -> Result<Option<T>, FrameError> {
    match read_frame(r, max)? {
        None => Ok(None),
        Some(buf) => Ok(Some(serde_json::from_slice(&buf)?)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_limits() {
        let frame = encode_frame(&serde_json::json!({"a": 1}), MAX_FRAME).unwrap();
        assert_eq!(&frame[..4], &7u32.to_be_bytes());
        let mut r = &frame[..];
        let v: serde_json::Value = read_message(&mut r, MAX_FRAME).unwrap().unwrap();
        assert_eq!(v["a"], 1);
        assert!(read_frame(&mut r, MAX_FRAME).unwrap().is_none());

        let mut big = &(100u32.to_be_bytes())[..];
        assert!(matches!(
            read_frame(&mut big, 99),
            Err(FrameError::TooLarge { len: 100, max: 99 })
        ));
        let mut empty = &[0u8, 0, 0, 0][..];
        assert!(matches!(read_frame(&mut empty, 99), Err(FrameError::Empty)));
        let mut short = &[0u8, 0][..];
        assert!(matches!(
            read_frame(&mut short, 99),
            Err(FrameError::Truncated { got: 2, want: 4 })
        ));
        let mut cut = &[0u8, 0, 0, 5, b'{'][..];
        assert!(matches!(
            read_frame(&mut cut, 99),
            Err(FrameError::Truncated { got: 1, want: 5 })
        ));
        assert!(matches!(
            encode_frame(&"x".repeat(100), 50),
            Err(FrameError::TooLarge { .. })
        ));
    }
}
