//! Bearer-token auth: who a token is.
//!
//! Every token maps to a [`Principal`]: a tenant and a scope (`admin` or
//! `tenant`). Tokens come from the tokens file ([`tokens`], stored as
//! SHA-256) and, for operators and tests, from the command line
//! (`serve --token`, pods' token files: admin tokens of tenant
//! [`ADMIN_TENANT`]). A cluster replica keeps them in PostgreSQL instead,
//! shared by every replica ([`Auth::shared`], `cluster/tenants.rs`), and
//! caches them. [`Auth::principal`] is the one place a presented
//! token is mapped to its principal; [`require`] puts the principal in the
//! request's extensions for the handlers.
//!
//! The comparison takes the same time whatever the presented token holds:
//! its SHA-256 is compared with every stored digest, each over its whole
//! length, with `subtle`'s constant-time operations and no early exit. No
//! token at all refuses every request (fail closed).

pub mod store;
pub mod tokens;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, Weak};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use subtle::{Choice, ConstantTimeEq};
use torpor_scheduler::service::Owner;
use torpor_sync::RwLocked;

use crate::error::{code, ApiError};
use crate::pods::ON_BEHALF_OF;
use crate::quota::Quota;
use store::TokenStore;
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
    /// The tenant an admin acts for ([`ON_BEHALF_OF`]: the server in
    /// front of a pod, calling it with the pod's token for that tenant's
    /// request): what it makes is that tenant's, template names resolve in
    /// that tenant's namespace and the shared one, and it reaches only
    /// that tenant's sandboxes. Never set for a tenant's token.
    pub on_behalf_of: Option<String>,
}

impl Principal {
    /// A principal acting for itself.
    pub fn new(tenant: impl Into<String>, scope: Scope, token: impl Into<String>) -> Self {
        Principal {
            tenant: tenant.into(),
            scope,
            token: token.into(),
            on_behalf_of: None,
        }
    }

    /// Whether the token is an admin's (pods, images, tokens, limits).
    pub fn is_admin(&self) -> bool {
        self.scope == Scope::Admin
    }

    /// As the service's owner of what it makes, and whose template names
    /// it resolves: an admin acting for a tenant is that tenant.
    pub fn owner(&self) -> Owner {
        match &self.on_behalf_of {
            Some(tenant) => Owner {
                tenant: tenant.clone(),
                admin: false,
            },
            None => Owner {
                tenant: self.tenant.clone(),
                admin: self.is_admin(),
            },
        }
    }

    /// Whether this principal reaches every tenant's things: an admin not
    /// acting for a tenant.
    pub fn sees_all(&self) -> bool {
        self.is_admin() && self.on_behalf_of.is_none()
    }

    /// Whether this principal sees something of `tenant` (none: made
    /// before tenants, an admin's only).
    pub fn sees(&self, tenant: Option<&str>) -> bool {
        self.sees_all() || tenant == Some(self.owner().tenant.as_str())
    }
}

/// Where the tokens and quotas are kept.
enum Backing {
    /// Nowhere: the command line's tokens only (a pod).
    Nothing,
    /// The tokens file.
    File(PathBuf),
    /// A store shared by every replica (the cluster's PostgreSQL,
    /// `cluster/tenants.rs`), cached in [`Inner::file`].
    Shared(Arc<dyn TokenStore>),
}

struct Inner {
    /// Digests of the command-line admin tokens (none in a cluster: there
    /// they are seeded into PostgreSQL).
    fixed: Vec<[u8; 32]>,
    backing: Backing,
    file: RwLock<TenantsFile>,
    /// Loads from PostgreSQL begun, and the one [`Inner::file`] holds: a
    /// load stores its result only over an older one's.
    loads: AtomicU64,
    stored: AtomicU64,
}

/// How often a cluster replica reads the tenants again from PostgreSQL: a
/// token made or removed, or a quota set, through another replica holds
/// here within this (through this one, at once).
pub const SHARED_REFRESH: Duration = Duration::from_secs(1);

/// Token ids are `tok_` and 16 hex characters: a longer one is no token's.
const MAX_TOKEN_ID: usize = 64;

/// The tokens a server accepts, and the tenants' quotas.
#[derive(Clone)]
pub struct Auth(Arc<Inner>);

impl Auth {
    fn with(fixed: &[String], backing: Backing, file: TenantsFile) -> Self {
        Auth(Arc::new(Inner {
            fixed: fixed
                .iter()
                .filter(|t| !t.is_empty())
                .map(|t| digest(t.as_bytes()))
                .collect(),
            backing,
            file: RwLock::new(file),
            loads: AtomicU64::new(1),
            stored: AtomicU64::new(0),
        }))
    }

    /// `fixed`: admin tokens (empty ones dropped); `path`: the tokens
    /// file, read now (missing: none yet).
    pub fn new(fixed: &[String], path: Option<PathBuf>) -> Result<Self, TokensError> {
        Ok(match path {
            Some(p) => {
                let file = TenantsFile::load(&p)?;
                Self::with(fixed, Backing::File(p), file)
            }
            None => Self::with(fixed, Backing::Nothing, TenantsFile::default()),
        })
    }

    /// A cluster replica's: the tokens and quotas in PostgreSQL, shared by
    /// every replica, read now and again every [`SHARED_REFRESH`] (on a
    /// failed read the last one stays). First seeded, idempotently (a
    /// token already there by id or digest, a tenant's quota already set,
    /// stay as they are): `fixed` as admin tokens of [`ADMIN_TENANT`], and
    /// `seed`'s tokens and quotas (a replica's tenants file). With no
    /// `fixed` token and none in PostgreSQL, one admin token is made there:
    /// returned, to show once. Call it on a tokio runtime.
    pub async fn shared(
        db: Arc<dyn TokenStore>,
        fixed: &[String],
        seed: &TenantsFile,
    ) -> Result<(Self, Option<String>), TokensError> {
        for token in fixed.iter().filter(|t| !t.is_empty()) {
            db.add_token(&TokenRecord::new(ADMIN_TENANT, Scope::Admin, token)?, false)
                .await?;
        }
        for record in &seed.tokens {
            if record.digest().is_none() || tokens::check_tenant(&record.tenant).is_err() {
                tracing::warn!(id = %record.id, "a malformed token record is not seeded");
                continue;
            }
            db.add_token(record, false).await?;
        }
        for (tenant, quota) in &seed.quotas {
            if tokens::check_tenant(tenant).is_err() {
                tracing::warn!("a quota of a malformed tenant name is not seeded");
                continue;
            }
            db.set_quota(tenant, quota, false).await?;
        }
        let mut first = None;
        if fixed.iter().all(|t| t.is_empty()) {
            let token = tokens::random_token()?;
            let record = TokenRecord::new(ADMIN_TENANT, Scope::Admin, &token)?;
            if db.add_token(&record, true).await? {
                first = Some(token);
            }
        }
        let file = db.tenants().await?;
        let auth = Self::with(&[], Backing::Shared(db.clone()), file);
        tokio::spawn(refresh(Arc::downgrade(&auth.0), db));
        Ok((auth, first))
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
        self.0.file.read_locked()
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
            return Some(Principal::new(r.tenant.clone(), r.scope, r.id.clone()));
        }
        bool::from(fixed).then(|| Principal::new(ADMIN_TENANT, Scope::Admin, "command-line"))
    }

    /// True if no token at all is accepted.
    pub fn is_empty(&self) -> bool {
        self.0.fixed.is_empty() && self.read().tokens.is_empty()
    }

    /// A change to the tokens file (not in a cluster).
    fn change<T>(
        &self,
        f: impl FnOnce(&mut TenantsFile) -> Result<T, TokensError>,
    ) -> Result<T, TokensError> {
        let path = match &self.0.backing {
            Backing::File(path) => path,
            Backing::Nothing | Backing::Shared(_) => {
                return Err(TokensError::File {
                    path: "-".into(),
                    detail: "this server keeps no tokens file (a pod: its token file is its \
                             only token)"
                        .into(),
                })
            }
        };
        let mut file = self.0.file.write_locked();
        let mut next = file.clone();
        let out = f(&mut next)?;
        next.save(path)?;
        *file = next;
        Ok(out)
    }

    /// In a cluster, the tenants read again from PostgreSQL into the
    /// cache (after a change made here, so that it holds here at once).
    async fn reload(&self) -> Result<(), TokensError> {
        if let Backing::Shared(db) = &self.0.backing {
            load(&self.0, db.as_ref()).await?;
        }
        Ok(())
    }

    /// [`Auth::reload`] after a change that is made: a failure is only
    /// logged (the next refresh brings the change).
    async fn reload_after_change(&self) {
        if let Err(e) = self.reload().await {
            tracing::warn!(error = %e, "the tenants could not be read again after a change");
        }
    }

    /// A new token; its record and the token (shown once).
    pub async fn create_token(
        &self,
        tenant: &str,
        scope: Scope,
    ) -> Result<(TokenRecord, String), TokensError> {
        let Backing::Shared(db) = &self.0.backing else {
            return self.change(|f| f.add(tenant, scope));
        };
        let token = tokens::random_token()?;
        let record = TokenRecord::new(tenant, scope, &token)?;
        if !db.add_token(&record, false).await? {
            return Err(TokensError::Taken);
        }
        self.reload_after_change().await;
        Ok((record, token))
    }

    /// Every token's record (no token); in a cluster, as PostgreSQL has
    /// them now.
    pub async fn tokens(&self) -> Result<Vec<TokenRecord>, TokensError> {
        self.reload().await?;
        Ok(self.read().tokens.clone())
    }

    /// Removes token `id` (not the last admin one unless command-line
    /// admin tokens remain).
    pub async fn remove_token(&self, id: &str) -> Result<TokenRecord, TokensError> {
        if id.len() > MAX_TOKEN_ID {
            return Err(TokensError::NotFound(id.chars().take(40).collect()));
        }
        let Backing::Shared(db) = &self.0.backing else {
            let keep_admin = self.0.fixed.is_empty();
            return self.change(|f| f.remove(id, keep_admin));
        };
        let record = db.remove_token(id).await?;
        self.reload_after_change().await;
        Ok(record)
    }

    /// A tenant's quotas.
    pub fn quota(&self, tenant: &str) -> Quota {
        self.read().quotas.get(tenant).copied().unwrap_or_default()
    }

    pub async fn set_quota(&self, tenant: &str, quota: Quota) -> Result<(), TokensError> {
        tokens::check_tenant(tenant)?;
        let Backing::Shared(db) = &self.0.backing else {
            return self.change(|f| {
                f.quotas.insert(tenant.to_string(), quota);
                Ok(())
            });
        };
        db.set_quota(tenant, &quota, true).await?;
        self.reload_after_change().await;
        Ok(())
    }
}

/// Reads the tenants from PostgreSQL into `inner`'s cache, unless a load
/// begun later stored its result first.
async fn load(inner: &Inner, db: &dyn TokenStore) -> Result<(), TokensError> {
    let n = inner.loads.fetch_add(1, Ordering::SeqCst);
    let file = db.tenants().await?;
    let mut cached = inner.file.write_locked();
    if inner.stored.load(Ordering::SeqCst) < n {
        inner.stored.store(n, Ordering::SeqCst);
        *cached = file;
    }
    Ok(())
}

/// A replica's cache of the tenants, read again every [`SHARED_REFRESH`]
/// while its [`Auth`] lives; a failed read keeps the last (PostgreSQL down:
/// no change can be made either), logged once until a read succeeds.
async fn refresh(inner: Weak<Inner>, db: Arc<dyn TokenStore>) {
    let mut failing = false;
    loop {
        tokio::time::sleep(SHARED_REFRESH).await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        match load(&inner, db.as_ref()).await {
            Ok(()) if failing => {
                tracing::info!("the tenants are read from PostgreSQL again");
                failing = false;
            }
            Ok(()) => {}
            Err(e) if !failing => {
                tracing::warn!(error = %e, "the tenants cannot be read from PostgreSQL: the last read stays in force");
                failing = true;
            }
            Err(_) => {}
        }
    }
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Auth({} command-line, {} stored)",
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
    let principal = match on_behalf_of(&request, principal) {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    request.extensions_mut().insert(principal);
    next.run(request).await
}

/// `principal` acting for the tenant [`ON_BEHALF_OF`] names, if the
/// request names one: an admin's token only (403 for a tenant's), a
/// valid tenant name (400).
fn on_behalf_of(request: &Request, mut principal: Principal) -> Result<Principal, ApiError> {
    let Some(value) = request.headers().get(ON_BEHALF_OF) else {
        return Ok(principal);
    };
    if !principal.is_admin() {
        return Err(forbidden(
            "acting on behalf of a tenant (X-Torpor-On-Behalf-Of) needs an admin token",
        ));
    }
    let tenant = value
        .to_str()
        .ok()
        .filter(|t| tokens::check_tenant(t).is_ok())
        .ok_or_else(|| ApiError::invalid("X-Torpor-On-Behalf-Of is not a tenant name"))?;
    principal.on_behalf_of = Some(tenant.to_string());
    Ok(principal)
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
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let (rec, token) = rt
            .block_on(auth.create_token("acme", Scope::Tenant))
            .unwrap();
        let p = auth.principal(token.as_bytes()).unwrap();
        assert_eq!(p, Principal::new("acme", Scope::Tenant, rec.id.clone()));
        assert!(p.sees(Some("acme")) && !p.sees(Some("other")) && !p.sees(None));
        // A restarted server knows it; removed, it is refused.
        let again = Auth::new(&[], Some(path.clone())).unwrap();
        assert_eq!(again.principal(token.as_bytes()), Some(p));
        rt.block_on(again.remove_token(&rec.id)).unwrap();
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
