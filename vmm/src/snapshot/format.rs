//! The state file: a fixed 32-byte header followed by a bincode payload.
//!
//! | offset | size | field                                   |
//! |-------:|-----:|-----------------------------------------|
//! |      0 |    8 | magic `TORPSNAP`                        |
//! |      8 |    2 | format major (u16 LE)                   |
//! |     10 |    2 | format minor (u16 LE)                   |
//! |     12 |    4 | flags (u32 LE), 0                       |
//! |     16 |    8 | payload length (u64 LE)                 |
//! |     24 |    4 | CRC32 of the payload (u32 LE)           |
//! |     28 |    4 | CRC32 of bytes 0..28 (u32 LE)           |
//!
//! Checks run in an order that never trusts a field before it is verified:
//! size of the header, magic, header CRC, version, payload length against
//! the limit (before any allocation), file length, payload CRC, decode.

use std::fs::File;
use std::io::Read;
use std::path::Path;

use serde::de::DeserializeOwned;
use serde::Serialize;

use super::atomic::AtomicFile;
use super::SnapshotError;
use std::os::unix::fs::FileExt;

/// First eight bytes of every state file.
pub const MAGIC: [u8; 8] = *b"TORPSNAP";
/// Incompatible format changes bump this; readers refuse any other major
/// (2: device state gained virtio-blk and virtio-vsock; 3: virtio-net; 4:
/// virtio-balloon).
pub const FORMAT_MAJOR: u16 = 4;
/// Additive format changes bump this; readers accept a newer minor.
pub const FORMAT_MINOR: u16 = 0;
/// Largest payload written or read: device and vCPU state is kilobytes, so
/// anything near this is corruption, not a snapshot.
pub const MAX_STATE_BYTES: u64 = 16 << 20;
/// Length of the fixed header.
pub const HEADER_LEN: usize = 32;

/// The checked header of a state file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateHeader {
    pub major: u16,
    pub minor: u16,
    /// 0 in 1.0. Bits defined by later minors must be safe to ignore.
    pub flags: u32,
    pub payload_len: u64,
    pub payload_crc32: u32,
}

impl StateHeader {
    fn to_bytes(self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[0..8].copy_from_slice(&MAGIC);
        h[8..10].copy_from_slice(&self.major.to_le_bytes());
        h[10..12].copy_from_slice(&self.minor.to_le_bytes());
        h[12..16].copy_from_slice(&self.flags.to_le_bytes());
        h[16..24].copy_from_slice(&self.payload_len.to_le_bytes());
        h[24..28].copy_from_slice(&self.payload_crc32.to_le_bytes());
        let crc = crc32fast::hash(&h[0..28]);
        h[28..32].copy_from_slice(&crc.to_le_bytes());
        h
    }

    /// Validates magic, header CRC, version and payload size limit.
    fn parse(path: &Path, h: &[u8; HEADER_LEN]) -> Result<Self, SnapshotError> {
        if h[0..8] != MAGIC {
            return Err(SnapshotError::NotASnapshot {
                path: path.to_path_buf(),
            });
        }
        let stored = u32::from_le_bytes(h[28..32].try_into().unwrap());
        let computed = crc32fast::hash(&h[0..28]);
        if stored != computed {
            return Err(SnapshotError::Corrupt {
                path: path.to_path_buf(),
                stored,
                computed,
            });
        }
        let header = StateHeader {
            major: u16::from_le_bytes(h[8..10].try_into().unwrap()),
            minor: u16::from_le_bytes(h[10..12].try_into().unwrap()),
            flags: u32::from_le_bytes(h[12..16].try_into().unwrap()),
            payload_len: u64::from_le_bytes(h[16..24].try_into().unwrap()),
            payload_crc32: u32::from_le_bytes(h[24..28].try_into().unwrap()),
        };
        if header.major != FORMAT_MAJOR {
            return Err(SnapshotError::UnsupportedVersion {
                path: path.to_path_buf(),
                found_major: header.major,
                found_minor: header.minor,
                supported_major: FORMAT_MAJOR,
            });
        }
        if header.payload_len > MAX_STATE_BYTES {
            return Err(SnapshotError::TooLarge {
                path: path.to_path_buf(),
                len: header.payload_len,
                max: MAX_STATE_BYTES,
            });
        }
        Ok(header)
    }

    fn check_payload(&self, path: &Path, payload: &[u8]) -> Result<(), SnapshotError> {
        let computed = crc32fast::hash(payload);
        if computed != self.payload_crc32 {
            return Err(SnapshotError::CrcMismatch {
                path: path.to_path_buf(),
                stored: self.payload_crc32,
                computed,
            });
        }
        Ok(())
    }
}

/// The complete state file bytes (header and payload) for `state`, with the
/// current format version. No size limit is applied here.
pub fn encode<T: Serialize>(state: &T) -> Result<Vec<u8>, bincode::Error> {
    let mut buf = vec![0u8; HEADER_LEN];
    bincode::serialize_into(&mut buf, state)?;
    let payload = &buf[HEADER_LEN..];
    let header = StateHeader {
        major: FORMAT_MAJOR,
        minor: FORMAT_MINOR,
        flags: 0,
        payload_len: payload.len() as u64,
        payload_crc32: crc32fast::hash(payload),
    };
    buf[..HEADER_LEN].copy_from_slice(&header.to_bytes());
    Ok(buf)
}

/// Writes `state` to `path` atomically; returns the file's size in bytes.
pub fn write_state<T: Serialize>(path: &Path, state: &T) -> Result<u64, SnapshotError> {
    let bytes = encode(state).map_err(|source| SnapshotError::Encode {
        path: path.to_path_buf(),
        source,
    })?;
    let payload_len = (bytes.len() - HEADER_LEN) as u64;
    if payload_len > MAX_STATE_BYTES {
        return Err(SnapshotError::TooLarge {
            path: path.to_path_buf(),
            len: payload_len,
            max: MAX_STATE_BYTES,
        });
    }
    let file = AtomicFile::create(path)?;
    file.file()
        .write_all_at(&bytes, 0)
        .map_err(|e| SnapshotError::io(file.target(), e))?;
    file.commit()?;
    Ok(bytes.len() as u64)
}

/// Reads, checks and decodes the state file at `path`.
pub fn read_state<T: DeserializeOwned>(path: &Path) -> Result<T, SnapshotError> {
    read_state_with_header(path).map(|(state, _)| state)
}

/// Like [`read_state`], and also returns the header, for readers that
/// decode older minor versions differently.
pub fn read_state_with_header<T: DeserializeOwned>(
    path: &Path,
) -> Result<(T, StateHeader), SnapshotError> {
    let io = |e| SnapshotError::io(path, e);
    let mut file = File::open(path).map_err(io)?;
    let mut h = [0u8; HEADER_LEN];
    let got = read_up_to(&mut file, &mut h).map_err(io)?;
    if got < HEADER_LEN {
        return Err(short_header(path, &h[..got]));
    }
    let header = StateHeader::parse(path, &h)?;
    // payload_len <= MAX_STATE_BYTES here, so this allocation is bounded.
    let mut payload = Vec::with_capacity(header.payload_len as usize);
    (&mut file)
        .take(header.payload_len + 1)
        .read_to_end(&mut payload)
        .map_err(io)?;
    let expected = HEADER_LEN as u64 + header.payload_len;
    let actual = HEADER_LEN as u64 + payload.len() as u64;
    if actual < expected {
        return Err(SnapshotError::Truncated {
            path: path.to_path_buf(),
            expected,
            actual,
        });
    }
    if actual > expected {
        let actual = file.metadata().map_err(io)?.len();
        return Err(SnapshotError::TrailingData {
            path: path.to_path_buf(),
            expected,
            actual,
        });
    }
    finish(path, header, &payload)
}

/// Checks and decodes state file contents already in memory; `path` is
/// only used in error messages.
pub fn read_state_bytes<T: DeserializeOwned>(
    path: &Path,
    bytes: &[u8],
) -> Result<T, SnapshotError> {
    let Some(h) = bytes.first_chunk::<HEADER_LEN>() else {
        return Err(short_header(path, bytes));
    };
    let header = StateHeader::parse(path, h)?;
    let expected = HEADER_LEN as u64 + header.payload_len;
    let actual = bytes.len() as u64;
    if actual < expected {
        return Err(SnapshotError::Truncated {
            path: path.to_path_buf(),
            expected,
            actual,
        });
    }
    if actual > expected {
        return Err(SnapshotError::TrailingData {
            path: path.to_path_buf(),
            expected,
            actual,
        });
    }
    finish(path, header, &bytes[HEADER_LEN..]).map(|(state, _)| state)
}

fn finish<T: DeserializeOwned>(
    path: &Path,
    header: StateHeader,
    payload: &[u8],
) -> Result<(T, StateHeader), SnapshotError> {
    header.check_payload(path, payload)?;
    // bincode::deserialize ignores trailing payload bytes: that is what lets
    // a reader decode a newer minor version that appended fields.
    let state = bincode::deserialize(payload).map_err(|source| SnapshotError::Decode {
        path: path.to_path_buf(),
        source,
    })?;
    Ok((state, header))
}

/// A file shorter than a header: not a snapshot at all if even its first
/// bytes differ from the magic, otherwise a truncated one.
fn short_header(path: &Path, got: &[u8]) -> SnapshotError {
    let n = got.len().min(MAGIC.len());
    if got[..n] != MAGIC[..n] {
        return SnapshotError::NotASnapshot {
            path: path.to_path_buf(),
        };
    }
    SnapshotError::Truncated {
        path: path.to_path_buf(),
        expected: HEADER_LEN as u64,
        actual: got.len() as u64,
    }
}

/// Reads until `buf` is full or EOF; returns the number of bytes read.
fn read_up_to(file: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match file.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

#[cfg(test)]
#[path = "format_tests.rs"]
mod tests;
