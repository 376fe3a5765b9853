//! Content codings of envd's `/files`, as E2B's envd has them: a download
//! is gzip-compressed when `Accept-Encoding` prefers gzip (quality values
//! read, `identity;q=0` and `*` understood), and an upload with
//! `Content-Encoding: gzip` is decompressed before it is written. gzip is
//! the only coding offered; another `Content-Encoding` is refused (400),
//! and an `Accept-Encoding` that rules out both gzip and identity is 406.
//! Decompression is bounded: an upload may not grow past the API's body
//! limit (`max_upload_bytes`), so a small bomb cannot fill the host.

use std::io::{Read, Write};

use axum::http::header::{self, HeaderMap};
use axum::http::StatusCode;
use flate2::read::MultiGzDecoder;
use flate2::write::GzEncoder;
use flate2::Compression;

use super::super::error::E2bError;

/// A content coding of `/files`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Coding {
    Identity,
    Gzip,
}

impl Coding {
    /// Its `Content-Encoding` name.
    pub fn name(self) -> &'static str {
        match self {
            Coding::Identity => "identity",
            Coding::Gzip => "gzip",
        }
    }
}

/// Why a request's coding cannot be served.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EncodingError {
    #[error("unsupported Content-Encoding {0:?}: only gzip and identity are offered")]
    Unsupported(String),
    #[error("Accept-Encoding {0:?} accepts neither gzip nor identity")]
    NotAcceptable(String),
    #[error("the gzip body is malformed: {0}")]
    Malformed(String),
    #[error("the decompressed body is over {0} bytes")]
    TooLarge(usize),
}

impl From<EncodingError> for E2bError {
    fn from(e: EncodingError) -> Self {
        let status = match e {
            EncodingError::Unsupported(_) | EncodingError::Malformed(_) => StatusCode::BAD_REQUEST,
            EncodingError::NotAcceptable(_) => StatusCode::NOT_ACCEPTABLE,
            EncodingError::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
        };
        E2bError::new(status, e.to_string())
    }
}

/// One `coding;q=N` of a header, the coding lowercased (RFC 9110: codings
/// are case-insensitive), quality 1 unless given.
fn coding_and_quality(item: &str) -> (String, f32) {
    let mut parts = item.split(';');
    let coding = parts.next().unwrap_or_default().trim().to_ascii_lowercase();
    let mut q = 1.0;
    for p in parts {
        let p = p.trim();
        if let Some(v) = p.strip_prefix("q=").or_else(|| p.strip_prefix("Q=")) {
            if let Ok(v) = v.trim().parse::<f32>() {
                q = v;
            }
        }
    }
    (coding, q)
}

/// The coding a download answers with, by `Accept-Encoding`: the most
/// preferred acceptable one (gzip on a tie with identity only when gzip
/// comes first, as envd's stable sort); identity when the header is
/// absent, empty or names nothing offered, unless identity is ruled out
/// (`identity;q=0`, or `*;q=0` without identity named).
pub fn accepted(headers: &HeaderMap) -> Result<Coding, EncodingError> {
    let text = headers
        .get_all(header::ACCEPT_ENCODING)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect::<Vec<_>>()
        .join(",");
    if text.trim().is_empty() {
        return Ok(Coding::Identity);
    }
    let mut items: Vec<(String, f32)> = text
        .split(',')
        .filter(|i| !i.trim().is_empty())
        .map(coding_and_quality)
        .collect();
    let named = |c: &str| items.iter().find(|(n, _)| n == c).map(|&(_, q)| q);
    let identity_ruled_out = match named("identity") {
        Some(q) => q == 0.0,
        None => named("*") == Some(0.0),
    };
    // Highest quality first; a stable sort keeps the header's order on ties.
    items.sort_by(|a, b| b.1.total_cmp(&a.1));
    for (coding, q) in &items {
        if *q <= 0.0 {
            continue;
        }
        match coding.as_str() {
            "gzip" | "x-gzip" => return Ok(Coding::Gzip),
            "identity" => return Ok(Coding::Identity),
            "*" => {
                return Ok(if identity_ruled_out {
                    Coding::Gzip
                } else {
                    Coding::Identity
                })
            }
            _ => {}
        }
    }
    if identity_ruled_out {
        return Err(EncodingError::NotAcceptable(text));
    }
    Ok(Coding::Identity)
}

/// The coding of an upload's body (`Content-Encoding`).
pub fn content(headers: &HeaderMap) -> Result<Coding, EncodingError> {
    let Some(v) = headers.get(header::CONTENT_ENCODING) else {
        return Ok(Coding::Identity);
    };
    let text = String::from_utf8_lossy(v.as_bytes()).into_owned();
    let (coding, _) = coding_and_quality(&text);
    match coding.as_str() {
        "" | "identity" => Ok(Coding::Identity),
        "gzip" | "x-gzip" => Ok(Coding::Gzip),
        _ => Err(EncodingError::Unsupported(text)),
    }
}

/// `data` gzip-compressed.
pub fn gzip(data: &[u8]) -> Vec<u8> {
    let mut enc = GzEncoder::new(Vec::with_capacity(data.len() / 2 + 64), Compression::fast());
    // Writing to a Vec does not fail.
    let _ = enc.write_all(data);
    enc.finish().unwrap_or_default()
}

/// A gzip body decompressed (every member, as Go's reader), at most
/// `limit` bytes of it.
pub fn gunzip(data: &[u8], limit: usize) -> Result<Vec<u8>, EncodingError> {
    let mut out = Vec::new();
    let mut dec = MultiGzDecoder::new(data).take(limit as u64 + 1);
    dec.read_to_end(&mut out)
        .map_err(|e| EncodingError::Malformed(e.to_string()))?;
    if out.len() > limit {
        return Err(EncodingError::TooLarge(limit));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn accept(v: &str) -> Result<Coding, EncodingError> {
        let mut h = HeaderMap::new();
        h.insert(header::ACCEPT_ENCODING, HeaderValue::from_str(v).unwrap());
        accepted(&h)
    }

    #[test]
    fn accept_encoding_picks_as_envd() {
        assert_eq!(accepted(&HeaderMap::new()), Ok(Coding::Identity));
        assert_eq!(accept("gzip"), Ok(Coding::Gzip));
        assert_eq!(accept("GZIP"), Ok(Coding::Gzip));
        // What httpx sends by default.
        assert_eq!(accept("gzip, deflate, br, zstd"), Ok(Coding::Gzip));
        assert_eq!(accept("br"), Ok(Coding::Identity));
        assert_eq!(accept("identity"), Ok(Coding::Identity));
        assert_eq!(accept("gzip;q=0.5, identity"), Ok(Coding::Identity));
        assert_eq!(accept("identity;q=0.1, gzip"), Ok(Coding::Gzip));
        assert_eq!(accept("gzip;q=0"), Ok(Coding::Identity));
        assert_eq!(accept("*"), Ok(Coding::Identity));
        assert_eq!(accept("*;q=0, gzip;q=0.2"), Ok(Coding::Gzip));
        assert_eq!(accept("identity;q=0, *"), Ok(Coding::Gzip));
        assert!(matches!(
            accept("identity;q=0, br"),
            Err(EncodingError::NotAcceptable(_))
        ));
    }

    #[test]
    fn content_encoding_is_gzip_or_identity() {
        let mut h = HeaderMap::new();
        assert_eq!(content(&h), Ok(Coding::Identity));
        h.insert(header::CONTENT_ENCODING, HeaderValue::from_static("Gzip"));
        assert_eq!(content(&h), Ok(Coding::Gzip));
        h.insert(header::CONTENT_ENCODING, HeaderValue::from_static("br"));
        assert!(matches!(content(&h), Err(EncodingError::Unsupported(_))));
    }

    #[test]
    fn gzip_round_trips_within_its_bound() {
        let data = b"compress me ".repeat(1000);
        let z = gzip(&data);
        assert!(z.len() < data.len() / 10);
        assert_eq!(gunzip(&z, data.len()).unwrap(), data);
        assert_eq!(
            gunzip(&z, data.len() - 1),
            Err(EncodingError::TooLarge(data.len() - 1))
        );
        assert!(matches!(
            gunzip(b"not gzip", 100),
            Err(EncodingError::Malformed(_))
        ));
        // Two members read as their concatenation.
        let two = [gzip(b"ab"), gzip(b"cd")].concat();
        assert_eq!(gunzip(&two, 10).unwrap(), b"abcd");
    }
}
