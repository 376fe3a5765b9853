//! Bearer-token auth: who a token is.
//!
//! Every token maps to a [`Principal`]: a tenant and a scope (`admin` or
//! `tenant`). Tokens come from the tokens file ([`tokens`], stored as
//! SHA-256) and, for operators and tests, from the command line
//! (`serve --token`, pods' token files: admin tokens of tenant
//! [`ADMIN_TENANT`]). [`Auth::principal`] is the one place a presented
//! token is mapped to its principal; [`require`] puts the principal in the
//! request's extensions for the handlers.
//!
//! The comparison takes the same time whatever the presented token holds:
//! its SHA-256 is compared with every stored digest, each over its whole
//! length, with `subtle`'s constant-time operations and no early exit. No
//! token at all refuses every request (fail closed).

pub mod tokens;

use std::path::PathBuf;
use std::sync::{Arc, RwLock};

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use subtle::{Choice, ConstantTimeEq};
use torpor_scheduler::service::Owner;

use crate::error::{code, ApiError};
use crate::quota::Quota;
use tokens::{digest, TenantsFile, TokenRecord, TokensError};

/// The tenant of command-line admin tokens and of the first admin token.
pub const ADMIN_TENANT: &str = "admin";

/// What a token may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Scope {
    /// Everything: pods, images, shared templates, tokens, quotas, and
    /// every tenant's sandboxes.
    Admin,
    /// Its tenant's sandboxes and templates, shared templates and images.
    Tenant,
}

impl Scope {
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Admin => "admin",
            Scope::Tenant => "tenant",
        }
    }
}

/// Who a request is from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    pub tenant: String,
    pub scope: Scope,
    /// The token's id (`tok_...`; `command-line` for the command line's
    /// admin tokens): per-token limits count by it.
    pub token: String,
}

impl Principal {
    pub fn is_admin(&self) -> bool {
        self.scope == Scope::Admin
    }

    /// As the service's owner of what it makes.
    pub fn owner(&self) -> Owner {
        Owner {
            tenant: self.tenant.clone(),
            admin: self.is_admin(),
        }
    }

    /// Whether this principal sees something of `tenant` (none: made
    /// before tenants, an admin's only).
    pub fn sees(&self, tenant: Option<&str>) -> bool {
        self.is_admin() || tenant == Some(self.tenant.as_str())
    }
}

struct Inner {
    /// Digests of the command-line admin tokens.
    fixed: Vec<[u8; 32]>,
    /// The tokens file, if tokens are managed (`serve`; a pod has none).
    path: Option<PathBuf>,
    file: RwLock<TenantsFile>,
}

/// The tokens a server accepts, and the tenants' quotas.
#[derive(Clone)]
pub struct Auth(Arc<Inner>);

impl Auth {
    /// `fixed`: admin tokens (empty ones dropped); `path`: the tokens
    /// file, read now (missing: none yet).
    pub fn new(fixed: &[String], path: Option<PathBuf>) -> Result<Self, TokensError> {
        let file = match &path {
            Some(p) => TenantsFile::load(p)?,
            None => TenantsFile::default(),
        };
        Ok(Auth(Arc::new(Inner {
            fixed: fixed
                .iter()
                .filter(|t| !t.is_empty())
                .map(|t| digest(t.as_bytes()))
                .collect(),
            path,
            file: RwLock::new(file),
        })))
    }

    /// On a first start (a tokens file with no token): one admin token of
    /// tenant [`ADMIN_TENANT`], saved hashed; the token, to show once.
    pub fn bootstrap(path: &std::path::Path) -> Result<Option<String>, TokensError> {
        let mut file = TenantsFile::load(path)?;
        if !file.tokens.is_empty() {
            return Ok(None);
        }
        let (_, token) = file.add(ADMIN_TENANT, Scope::Admin)?;
        file.save(path)?;
        Ok(Some(token))
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, TenantsFile> {
        self.0.file.read().unwrap_or_else(|p| p.into_inner())
    }

    /// THE token check: the principal `presented` stands for, if any.
    /// Constant time in the presented token's content.
    pub fn principal(&self, presented: &[u8]) -> Option<Principal> {
        if presented.is_empty() {
            return None;
        }
        let presented = digest(presented);
        let mut fixed = Choice::from(0);
        for d in &self.0.fixed {
            fixed |= ct_equal(&presented, d);
        }
        let file = self.read();
        let mut found: Option<&TokenRecord> = None;
        for record in &file.tokens {
            let stored = record.digest().unwrap_or([0; 32]);
            let hit: bool = (ct_equal(&presented, &stored)
                & Choice::from(u8::from(record.digest().is_some())))
            .into();
            if hit && found.is_none() {
                found = Some(record);
            }
        }
        if let Some(r) = found {
            return Some(Principal {
                tenant: r.tenant.clone(),
                scope: r.scope,
                token: r.id.clone(),
            });
        }
        bool::from(fixed).then(|| Principal {
            tenant: ADMIN_TENANT.to_string(),
            scope: Scope::Admin,
            token: "command-line".to_string(),
        })
    }

    /// True if no token at all is accepted.
    pub fn is_empty(&self) -> bool {
        self.0.fixed.is_empty() && self.read().tokens.is_empty()
    }

    fn change<T>(
        &self,
        f: impl FnOnce(&mut TenantsFile) -> Result<T, TokensError>,
    ) -> Result<T, TokensError> {
        let path = self.0.path.as_ref().ok_or_else(|| TokensError::File {
            path: "-".into(),
            detail: "this server keeps no tokens file (a pod: its token file is its only token)"
                .into(),
        })?;
        let mut file = self.0.file.write().unwrap_or_else(|p| p.into_inner());
        let mut next = file.clone();
        let out = f(&mut next)?;
        next.save(path)?;
        *file = next;
        Ok(out)
    }

    /// A new token; its record and the token (shown once).
    pub fn create_token(
        &self,
        tenant: &str,
        scope: Scope,
    ) -> Result<(TokenRecord, String), TokensError> {
        self.change(|f| f.add(tenant, scope))
    }

    /// Every token's record (no token).
    pub fn tokens(&self) -> Vec<TokenRecord> {
        self.read().tokens.clone()
    }

    /// Removes token `id` (not the last admin one unless command-line
    /// admin tokens remain).
    pub fn remove_token(&self, id: &str) -> Result<TokenRecord, TokensError> {
        let keep_admin = self.0.fixed.is_empty();
        self.change(|f| f.remove(id, keep_admin))
    }

    /// A tenant's quotas.
    pub fn quota(&self, tenant: &str) -> Quota {
        self.read().quotas.get(tenant).copied().unwrap_or_default()
    }

    pub fn set_quota(&self, tenant: &str, quota: Quota) -> Result<(), TokensError> {
        tokens::check_tenant(tenant)?;
        self.change(|f| {
            f.quotas.insert(tenant.to_string(), quota);
            Ok(())
        })
    }
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Auth({} command-line, {} in the file)",
            self.0.fixed.len(),
            self.read().tokens.len()
        )
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

/// The presented token: `Authorization: Bearer <token>`.
pub fn presented(request: &Request) -> Result<&[u8], &'static str> {
    bearer(request)
}

/// Route middleware: 401 with `WWW-Authenticate: Bearer` unless the request
/// carries a known token; the [`Principal`] goes into the request's
/// extensions.
pub async fn require(State(auth): State<Auth>, mut request: Request, next: Next) -> Response {
    let principal = match bearer(&request) {
        Ok(token) => match auth.principal(token) {
            Some(p) => p,
            None => return ApiError::unauthorized("invalid bearer token").into_response(),
        },
        Err(why) => return ApiError::unauthorized(why).into_response(),
    };
    request.extensions_mut().insert(principal);
    next.run(request).await
}

/// Route middleware inside [`require`]: 403 unless the principal is an
/// admin.
pub async fn admin_only(request: Request, next: Next) -> Response {
    match request.extensions().get::<Principal>() {
        Some(p) if p.is_admin() => next.run(request).await,
        _ => forbidden("this needs an admin token").into_response(),
    }
}

/// A 403 `forbidden` answer.
pub fn forbidden(message: &str) -> ApiError {
    ApiError::new(StatusCode::FORBIDDEN, code::FORBIDDEN, message)
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;

    #[test]
    fn accepts_exactly_the_configured_tokens() {
        let auth = Auth::new(&["alpha-token".into(), "beta".into(), String::new()], None).unwrap();
        for ok in [&b"alpha-token"[..], b"beta"] {
            let p = auth.principal(ok).unwrap();
            assert_eq!((p.tenant.as_str(), p.scope), (ADMIN_TENANT, Scope::Admin));
        }
        for wrong in [
            &b""[..],
            b"alpha",
            b"alpha-token2",
            b"alpha-tokem",
            b"bet",
            b"betaa",
            b"\0\0\0\0",
        ] {
            assert!(auth.principal(wrong).is_none(), "{wrong:?}");
        }
    }

    #[test]
    fn no_tokens_refuses_everything() {
        let auth = Auth::new(&[String::new()], None).unwrap();
        assert!(auth.is_empty());
        assert!(auth.principal(b"").is_none());
        assert!(auth.principal(b"x").is_none());
    }

    #[test]
    fn file_tokens_map_to_their_tenant_and_scope() {
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path().to_path_buf();
        let path = dir.join(tokens::TENANTS_FILE);
        let first = Auth::bootstrap(&path).unwrap().unwrap();
        assert!(
            Auth::bootstrap(&path).unwrap().is_none(),
            "only on a first start"
        );
        let auth = Auth::new(&[], Some(path.clone())).unwrap();
        assert!(auth.principal(first.as_bytes()).unwrap().is_admin());
        let (rec, token) = auth.create_token("acme", Scope::Tenant).unwrap();
        let p = auth.principal(token.as_bytes()).unwrap();
        assert_eq!(
            p,
            Principal {
                tenant: "acme".into(),
                scope: Scope::Tenant,
                token: rec.id.clone()
            }
        );
        assert!(p.sees(Some("acme")) && !p.sees(Some("other")) && !p.sees(None));
        // A restarted server knows it; removed, it is refused.
        let again = Auth::new(&[], Some(path.clone())).unwrap();
        assert_eq!(again.principal(token.as_bytes()), Some(p));
        again.remove_token(&rec.id).unwrap();
        assert!(again.principal(token.as_bytes()).is_none());
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
