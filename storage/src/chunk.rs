//! Chunks: a file is cut into fixed-size chunks; each one that is not all
//! zeros is stored once, under the SHA-256 of its content, LZ4-compressed
//! and framed with a CRC-32 ([`encode`], [`decode`]).
//!
//! The chunk size is [`DEFAULT_CHUNK_SIZE`], 1 MiB. A wake on another pod
//! pages memory in lazily, a chunk per first fault in it, so a chunk is
//! what one fault waits for: 1 MiB is 256 guest pages, about 10 ms at
//! 100 MB/s from an object store (a few ms cached, under 1 ms on
//! loopback), while 4 MiB would make every cold fault four times slower for
//! pages the guest mostly does not touch yet. Smaller chunks would cost
//! more requests (S3 bills and rate-limits per request; 1 GiB of memory is
//! 1,024 objects at 1 MiB) and more manifest per GiB, for dedupe that
//! gains little: layers sharing content share it in whole runs of pages (a
//! template's memory under its sandboxes' diffs). A manifest records its
//! chunk size, so a later size reads old layers unchanged.
//!
//! The stored object, little endian:
//!
//! | offset | size | field                                        |
//! |-------:|-----:|----------------------------------------------|
//! |      0 |    4 | magic `TPCK`                                 |
//! |      4 |    1 | format version, 1                            |
//! |      5 |    1 | codec: 0 stored as is, 1 LZ4 block           |
//! |      6 |    2 | reserved, 0                                  |
//! |      8 |    4 | the content's length                         |
//! |     12 |    4 | CRC-32 of bytes 0..12 and the payload        |
//! |     16 |    … | payload                                      |
//!
//! A chunk that LZ4 does not shrink is stored as is. Reading checks the
//! frame, the CRC, the codec, the length, and last the SHA-256 of the
//! content against the key it was fetched by: a flipped bit anywhere is
//! caught, and a chunk stored under the wrong key too.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use sha2::{Digest, Sha256};

/// The chunk size of new uploads: 1 MiB (see the module's doc).
pub const DEFAULT_CHUNK_SIZE: u64 = 1 << 20;
/// The smallest chunk size a manifest may record: one page.
pub const MIN_CHUNK_SIZE: u64 = 4096;
/// The largest chunk size a manifest may record.
pub const MAX_CHUNK_SIZE: u64 = 64 << 20;

const MAGIC: [u8; 4] = *b"TPCK";
const FORMAT: u8 = 1;
const CODEC_STORED: u8 = 0;
const CODEC_LZ4: u8 = 1;
const HEADER: usize = 16;

/// A chunk's content address: the SHA-256 of its uncompressed bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkHash([u8; 32]);

impl ChunkHash {
    /// The address of `data`.
    pub fn of(data: &[u8]) -> Self {
        Self(Sha256::digest(data).into())
    }

    /// Parses 64 lowercase hex digits.
    pub fn from_hex(s: &str) -> Option<Self> {
        let b = s.as_bytes();
        if b.len() != 64 {
            return None;
        }
        let mut out = [0u8; 32];
        for (i, pair) in b.chunks_exact(2).enumerate() {
            let nibble = |c: u8| match c {
                b'0'..=b'9' => Some(c - b'0'),
                b'a'..=b'f' => Some(c - b'a' + 10),
                _ => None,
            };
            out[i] = nibble(pair[0])? << 4 | nibble(pair[1])?;
        }
        Some(Self(out))
    }

    /// The 64 lowercase hex digits.
    pub fn to_hex(&self) -> String {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut s = String::with_capacity(64);
        for b in self.0 {
            s.push(DIGITS[usize::from(b >> 4)] as char);
            s.push(DIGITS[usize::from(b & 15)] as char);
        }
        s
    }

    /// The object key under the store's prefix: `chunks/<first two hex
    /// digits>/<all 64>`. The fan-out keeps a local store's directories
    /// small and spreads S3's per-prefix request rate.
    pub fn key(&self) -> String {
        let hex = self.to_hex();
        format!("chunks/{}/{hex}", &hex[..2])
    }

    /// The hash a chunk key names, if `key` is one (`chunks/ab/ab…`).
    pub fn from_key(key: &str) -> Option<Self> {
        let rest = key.strip_prefix("chunks/")?;
        let (fan, hex) = rest.split_once('/')?;
        let hash = Self::from_hex(hex)?;
        (fan.len() == 2 && hex.starts_with(fan)).then_some(hash)
    }
}

impl fmt::Display for ChunkHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for ChunkHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ChunkHash({})", &self.to_hex()[..16])
    }
}

impl Serialize for ChunkHash {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> Deserialize<'de> for ChunkHash {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Self::from_hex(&s)
            .ok_or_else(|| serde::de::Error::custom("a chunk hash is 64 lowercase hex digits"))
    }
}

/// Whether every byte of `data` is zero (ORed 64 bytes at a time, which
/// the compiler vectorises).
pub fn is_zero(data: &[u8]) -> bool {
    let mut blocks = data.chunks_exact(64);
    let body = blocks
        .by_ref()
        .all(|b| b.iter().fold(0u8, |a, &x| a | x) == 0);
    body && blocks.remainder().iter().all(|&x| x == 0)
}

/// The stored object of a chunk whose content is `raw`.
pub fn encode(raw: &[u8]) -> Vec<u8> {
    let compressed = lz4_flex::block::compress(raw);
    let (codec, payload) = if compressed.len() < raw.len() {
        (CODEC_LZ4, compressed.as_slice())
    } else {
        (CODEC_STORED, raw)
    };
    let len = u32::try_from(raw.len()).expect("a chunk is at most MAX_CHUNK_SIZE");
    let mut out = Vec::with_capacity(HEADER + payload.len());
    out.extend_from_slice(&MAGIC);
    out.push(FORMAT);
    out.push(codec);
    out.extend_from_slice(&[0, 0]);
    out.extend_from_slice(&len.to_le_bytes());
    let crc = frame_crc(&out, payload);
    out.extend_from_slice(&crc.to_le_bytes());
    out.extend_from_slice(payload);
    out
}

/// The CRC-32 of a frame's first 12 bytes and its payload.
fn frame_crc(head: &[u8], payload: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&head[..12]);
    h.update(payload);
    h.finalize()
}

/// The content of a stored chunk fetched by `hash`, every check passed;
/// what failed otherwise. `max_len` bounds the length the frame may claim
/// (the manifest's chunk size) before anything is allocated.
pub fn decode(hash: &ChunkHash, stored: &[u8], max_len: u64) -> Result<Vec<u8>, String> {
    if stored.len() < HEADER {
        return Err(format!(
            "{} bytes, shorter than the {HEADER}-byte frame",
            stored.len()
        ));
    }
    if stored[..4] != MAGIC {
        return Err("not a chunk (bad magic)".into());
    }
    if stored[4] != FORMAT {
        return Err(format!(
            "chunk format {} (this torpor reads {FORMAT})",
            stored[4]
        ));
    }
    let word = |at: usize| u32::from_le_bytes(stored[at..at + 4].try_into().expect("4 bytes"));
    let len = word(8);
    if u64::from(len) > max_len {
        return Err(format!("claims {len} bytes, more than a chunk ({max_len})"));
    }
    let payload = &stored[HEADER..];
    let crc = frame_crc(stored, payload);
    if crc != word(12) {
        return Err(format!(
            "CRC-32 {crc:08x} of the frame, it says {:08x}",
            word(12)
        ));
    }
    let raw = match stored[5] {
        CODEC_STORED => payload.to_vec(),
        CODEC_LZ4 => lz4_flex::block::decompress(payload, len as usize)
            .map_err(|e| format!("LZ4 payload does not decode: {e}"))?,
        other => return Err(format!("unknown codec {other}")),
    };
    if raw.len() != len as usize {
        return Err(format!(
            "{} bytes of content, the frame says {len}",
            raw.len()
        ));
    }
    let got = ChunkHash::of(&raw);
    if got != *hash {
        return Err(format!("content hashes to {got}, not its key"));
    }
    Ok(raw)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_and_keys_round_trip() {
        let h = ChunkHash::of(b"torpor");
        assert_eq!(ChunkHash::from_hex(&h.to_hex()), Some(h));
        assert_eq!(ChunkHash::from_key(&h.key()), Some(h));
        assert!(h
            .key()
            .starts_with(&format!("chunks/{}/", &h.to_hex()[..2])));
        assert_eq!(ChunkHash::from_hex(&h.to_hex().to_uppercase()), None);
        assert_eq!(ChunkHash::from_key("chunks/zz/abc"), None);
        let wrong_fan = format!("chunks/00/{}", "1".repeat(64));
        assert_eq!(ChunkHash::from_key(&wrong_fan), None);
    }

    #[test]
    fn encode_decode_both_codecs() {
        let text = b"page ".repeat(1000);
        let stored = encode(&text);
        assert_eq!(stored[5], CODEC_LZ4);
        assert!(stored.len() < text.len());
        assert_eq!(
            decode(&ChunkHash::of(&text), &stored, 1 << 20).unwrap(),
            text
        );

        // Incompressible bytes are stored as they are.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let noise: Vec<u8> = (0..4096)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let stored = encode(&noise);
        assert_eq!(stored[5], CODEC_STORED);
        assert_eq!(
            decode(&ChunkHash::of(&noise), &stored, 1 << 20).unwrap(),
            noise
        );
    }

    #[test]
    fn every_flipped_bit_is_caught() {
        let text = b"guest memory ".repeat(300);
        let hash = ChunkHash::of(&text);
        let stored = encode(&text);
        for i in 0..stored.len() {
            let mut bad = stored.clone();
            bad[i] ^= 0x10;
            assert!(decode(&hash, &bad, 1 << 20).is_err(), "flip at byte {i}");
        }
        assert!(decode(&hash, &stored[..10], 1 << 20).is_err());
        let other = ChunkHash::of(b"another");
        let why = decode(&other, &stored, 1 << 20).unwrap_err();
        assert!(why.contains("not its key"), "{why}");
        let why = decode(&hash, &stored, 100).unwrap_err();
        assert!(why.contains("more than a chunk"), "{why}");
    }

    #[test]
    fn zero_detection() {
        assert!(is_zero(&[0; 4096]));
        assert!(is_zero(&[]));
        let mut page = vec![0u8; 4097];
        page[4096] = 1;
        assert!(!is_zero(&page));
        page[4096] = 0;
        page[5] = 1;
        assert!(!is_zero(&page));
    }
}
