//! Standard base64 (RFC 4648, `+/` alphabet, `=` padding) for the byte
//! fields of the protocol, plus serde adapters (`#[serde(with = "b64")]`).
//!
//! Written here rather than pulled from a crate: the agent binary should stay
//! small and std + serde only.

use serde::de::Visitor;
use serde::{Deserializer, Serializer};
use std::fmt;

const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
const INVALID: u8 = 0xff;

const fn decode_table() -> [u8; 256] {
    let mut t = [INVALID; 256];
    let mut i = 0;
    while i < 64 {
        t[ALPHABET[i] as usize] = i as u8;
        i += 1;
    }
    t
}
static DECODE: [u8; 256] = decode_table();

/// Encodes `data` as padded standard base64.
pub fn encode(data: &[u8]) -> String {
    let mut out = Vec::with_capacity(data.len().div_ceil(3) * 4);
    let mut chunks = data.chunks_exact(3);
    for c in &mut chunks {
        let n = (u32::from(c[0]) << 16) | (u32::from(c[1]) << 8) | u32::from(c[2]);
        for shift in [18, 12, 6, 0] {
            out.push(ALPHABET[((n >> shift) & 63) as usize]);
        }
    }
    match *chunks.remainder() {
        [a] => {
            let n = u32::from(a) << 16;
            out.extend_from_slice(&[
                ALPHABET[(n >> 18) as usize & 63],
                ALPHABET[(n >> 12) as usize & 63],
                b'=',
                b'=',
            ]);
        }
        [a, b] => {
            let n = (u32::from(a) << 16) | (u32::from(b) << 8);
            out.extend_from_slice(&[
                ALPHABET[(n >> 18) as usize & 63],
                ALPHABET[(n >> 12) as usize & 63],
                ALPHABET[(n >> 6) as usize & 63],
                b'=',
            ]);
        }
        _ => {}
    }
    // Only ASCII from ALPHABET and '=' was pushed.
    String::from_utf8(out).expect("base64 output is ASCII")
}

/// Why a string is not valid base64.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The length is not a multiple of 4.
    #[error("base64 length {0} is not a multiple of 4")]
    Length(usize),
    /// A byte outside the alphabet, or padding in the wrong place.
    #[error("invalid base64 byte at offset {0}")]
    Byte(usize),
}

/// Decodes padded standard base64. Whitespace is not allowed.
pub fn decode(s: &str) -> Result<Vec<u8>, DecodeError> {
    let s = s.as_bytes();
    if !s.len().is_multiple_of(4) {
        return Err(DecodeError::Length(s.len()));
    }
    let mut out = Vec::with_capacity(s.len() / 4 * 3);
    let last = s.len().saturating_sub(4);
    for (ci, quad) in s.chunks_exact(4).enumerate() {
        let base = ci * 4;
        let pad = if base == last {
            match quad {
                [_, _, b'=', b'='] => 2,
                [_, _, _, b'='] => 1,
                _ => 0,
            }
        } else {
            0
        };
        let mut n = 0u32;
        for (i, &c) in quad[..4 - pad].iter().enumerate() {
            let v = DECODE[c as usize];
            if v == INVALID {
                return Err(DecodeError::Byte(base + i));
            }
            n |= u32::from(v) << (18 - 6 * i);
        }
        let bytes = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        // Non-canonical encodings (stray low bits before the padding) are
        // rejected so that every byte string has exactly one encoding.
        if (pad == 1 && bytes[2] != 0) || (pad == 2 && bytes[1] != 0) {
            return Err(DecodeError::Byte(base + 3 - pad));
        }
        out.extend_from_slice(&bytes[..3 - pad]);
    }
    Ok(out)
}

/// `#[serde(with = "crate::b64")]` for `Vec<u8>` fields.
pub fn serialize<S: Serializer>(data: &[u8], s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&encode(data))
}

/// `#[serde(with = "crate::b64")]` for `Vec<u8>` fields.
pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
    d.deserialize_str(B64Visitor)
}

struct B64Visitor;

impl Visitor<'_> for B64Visitor {
    type Value = Vec<u8>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a base64 string")
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Vec<u8>, E> {
        decode(v).map_err(E::custom)
    }
}

/// `#[serde(with = "crate::b64::option")]` for `Option<Vec<u8>>` fields
/// (use with `#[serde(default)]`).
pub mod option {
    use super::*;

    /// Serializes `Some` as a base64 string and `None` as `null`.
    pub fn serialize<S: Serializer>(data: &Option<Vec<u8>>, s: S) -> Result<S::Ok, S::Error> {
        match data {
            Some(d) => s.serialize_str(&encode(d)),
            None => s.serialize_none(),
        }
    }

    /// Accepts a base64 string or `null`.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u8>>, D::Error> {
        struct Wrapped(Vec<u8>);
        impl<'de> serde::Deserialize<'de> for Wrapped {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                super::deserialize(d).map(Wrapped)
            }
        }
        let v: Option<Wrapped> = serde::Deserialize::deserialize(d)?;
        Ok(v.map(|w| w.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc4648_vectors() {
        let cases = [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ];
        for (plain, enc) in cases {
            assert_eq!(encode(plain.as_bytes()), enc);
            assert_eq!(decode(enc).unwrap(), plain.as_bytes());
        }
    }

    #[test]
    fn all_bytes_round_trip() {
        let data: Vec<u8> = (0..=255u8).cycle().take(1000).collect();
        for len in 0..data.len() {
            assert_eq!(decode(&encode(&data[..len])).unwrap(), &data[..len]);
        }
    }

    #[test]
    fn rejects_bad_input() {
        assert_eq!(decode("abc"), Err(DecodeError::Length(3)));
        assert_eq!(decode("ab!d"), Err(DecodeError::Byte(2)));
        assert!(decode("Zg=a").is_err());
        assert!(decode("=Zg=").is_err());
        assert!(decode("Zh==").is_err(), "non-canonical low bits");
        assert!(decode("Zg==Zg==").is_err(), "padding only at the end");
    }
}
