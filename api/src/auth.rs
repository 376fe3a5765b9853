//! Bearer-token auth.
//!
//! A request is let through when its `Authorization: Bearer <token>` equals
//! one of the configured tokens. The comparison takes the same time whatever
//! the presented token holds: every configured token is compared, each over
//! its whole length (its own length, which the presented token cannot
//! change), with `subtle`'s constant-time operations and no early exit on a
//! mismatching byte or length. An empty token list refuses every request
//! (fail closed): a server with no tokens serves only the public routes.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use subtle::{Choice, ConstantTimeEq};

use crate::error::ApiError;

/// The configured tokens, as bytes. Empty tokens are dropped.
#[derive(Clone)]
pub struct Tokens(Arc<Vec<Vec<u8>>>);

impl Tokens {
    pub fn new(tokens: &[String]) -> Self {
        Tokens(Arc::new(
            tokens
                .iter()
                .filter(|t| !t.is_empty())
                .map(|t| t.as_bytes().to_vec())
                .collect(),
        ))
    }

    /// True if `presented` equals one of the tokens (constant time in the
    /// presented token's content).
    pub fn accepts(&self, presented: &[u8]) -> bool {
        let mut any = Choice::from(0);
        for token in self.0.iter() {
            any |= ct_equal(presented, token);
        }
        any.into()
    }

    /// True if no token is configured.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tokens({} configured)", self.0.len())
    }
}

/// `presented == secret`, in time that depends only on `secret.len()`:
/// every byte of the secret is compared (a missing presented byte compares
/// as 0), and the lengths are compared in constant time too.
fn ct_equal(presented: &[u8], secret: &[u8]) -> Choice {
    let same_len = (presented.len() as u64).ct_eq(&(secret.len() as u64));
    let mut same_bytes = Choice::from(1);
    for (i, s) in secret.iter().enumerate() {
        let p = presented.get(i).copied().unwrap_or(0);
        same_bytes &= p.ct_eq(s);
    }
    same_len & same_bytes
}

/// The token of an `Authorization: Bearer <token>` header (scheme matched
/// case-insensitively, as RFC 7235 asks).
fn bearer(request: &Request) -> Result<&[u8], &'static str> {
    let value = request
        .headers()
        .get(header::AUTHORIZATION)
        .ok_or("missing Authorization header (expected `Bearer <token>`)")?;
    let value = value.as_bytes();
    let (scheme, rest) = value
        .iter()
        .position(|&b| b == b' ')
        .map(|i| value.split_at(i))
        .ok_or("Authorization header is not `Bearer <token>`")?;
    if !scheme.eq_ignore_ascii_case(b"bearer") {
        return Err("Authorization header is not `Bearer <token>`");
    }
    let token = rest.trim_ascii();
    if token.is_empty() {
        return Err("empty bearer token");
    }
    Ok(token)
}

/// Route middleware: 401 with `WWW-Authenticate: Bearer` unless the request
/// carries a configured token.
pub async fn require(State(tokens): State<Tokens>, request: Request, next: Next) -> Response {
    match bearer(&request) {
        Ok(token) if tokens.accepts(token) => next.run(request).await,
        Ok(_) => ApiError::unauthorized("invalid bearer token").into_response(),
        Err(why) => ApiError::unauthorized(why).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;

    #[test]
    fn accepts_exactly_the_configured_tokens() {
        let tokens = Tokens::new(&["alpha-token".into(), "beta".into(), String::new()]);
        assert!(tokens.accepts(b"alpha-token"));
        assert!(tokens.accepts(b"beta"));
        for wrong in [
            &b""[..],
            b"alpha",
            b"alpha-token2",
            b"alpha-tokem",
            b"bet",
            b"betaa",
            b"\0\0\0\0",
        ] {
            assert!(!tokens.accepts(wrong), "{wrong:?}");
        }
    }

    #[test]
    fn no_tokens_refuses_everything() {
        let tokens = Tokens::new(&[String::new()]);
        assert!(tokens.is_empty());
        assert!(!tokens.accepts(b""));
        assert!(!tokens.accepts(b"x"));
    }

    #[test]
    fn parses_bearer_headers() {
        let req = |v: Option<&str>| {
            let mut b = Request::builder().uri("/");
            if let Some(v) = v {
                b = b.header(header::AUTHORIZATION, v);
            }
            b.body(Body::empty()).unwrap()
        };
        assert_eq!(bearer(&req(Some("Bearer abc"))).unwrap(), b"abc");
        assert_eq!(bearer(&req(Some("bearer  abc "))).unwrap(), b"abc");
        assert!(bearer(&req(None)).is_err());
        assert!(bearer(&req(Some("Basic abc"))).is_err());
        assert!(bearer(&req(Some("Bearer"))).is_err());
        assert!(bearer(&req(Some("Bearer   "))).is_err());
    }
}
