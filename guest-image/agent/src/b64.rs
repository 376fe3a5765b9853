//! Standard base64 (RFC 4648, `+/` alphabet, `=` padding; the `base64`
//! crate) for the byte fields of the protocol, plus serde adapters
//! (`#[serde(with = "b64")]`).

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use serde::de::Visitor;
use serde::{Deserializer, Serializer};
use std::fmt;

pub use base64::DecodeError;

/// Encodes `data` as padded standard base64.
pub fn encode(data: &[u8]) -> String {
    STANDARD.encode(data)
}

/// Decodes padded standard base64, canonical only (no whitespace, no
/// stray low bits), so that every byte string has exactly one encoding.
pub fn decode(s: &str) -> Result<Vec<u8>, DecodeError> {
    STANDARD.decode(s)
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
        assert!(decode("abc").is_err(), "length");
        assert!(decode("ab!d").is_err(), "byte outside the alphabet");
        assert!(decode("Zm9v\n").is_err(), "whitespace");
        assert!(decode("Zg=a").is_err());
        assert!(decode("=Zg=").is_err());
        assert!(decode("Zh==").is_err(), "non-canonical low bits");
        assert!(decode("Zg==Zg==").is_err(), "padding only at the end");
    }
}
