//! The gate: the one place where a surface's request meets the tenancy
//! rules before it reaches the sandbox backend.
//!
//! Every route declares in its route table ([`crate::ROUTES`],
//! [`crate::e2b::ROUTES`]) what its `{id}` names and what it costs
//! ([`Gated`]); the router builders put [`sandbox`] on every route that
//! names a sandbox, for every surface alike, reading the id from the
//! matched route's parameters (no URL parsing). The gate then:
//!
//! - resolves the sandbox's owner: another tenant's sandbox answers
//!   exactly like a missing one (404 `not_found`), before any side effect;
//! - admits what the route costs ([`Admit`]) against the tenant's quotas
//!   (a wake, a fork, a snapshot) and the per-token rate limit
//!   ([`crate::tenancy::Limiter`]);
//! - lets the request through, holding the admission until it ends.
//!
//! What is not a sandbox route is checked by one rule each: [`sees`]
//! (lists) here, and templates (E2B's snapshots too) by the service's
//! resolver (`torpor_scheduler::names`: the caller's own name, then a
//! shared one; another tenant's is a missing one). envd, which
//! names its sandbox in a header, resolves it through [`owned`] too
//! (`e2b/envd/files.rs`). A route added to a table without its
//! declaration fails `api/tests/attack_matrix.rs` and the table tests
//! below.

use std::collections::HashMap;

use axum::extract::{FromRequestParts, RawPathParams, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use torpor_scheduler::model::SandboxId;

use crate::auth::Principal;
use crate::backend::SandboxApi;
use crate::error::ApiError;
use crate::quota::{Quota, Ticket, Usage};
use crate::service::ServiceError;
use crate::tenancy::{admit, admit_wake, wake_first, Limited, Tenancy};

/// What a route's `{id}` names, for the gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gated {
    /// No sandbox in the path (lists, creates, templates, tokens...): the
    /// handler filters by [`sees`] or the route is admin only.
    No,
    /// `{id}` is a sandbox: ownership checked, then `Admit` admitted.
    Sandbox(Admit),
}

/// What a sandbox route costs, admitted by the gate before the handler
/// runs. (E2B's control-plane handlers admit their own costs, which
/// depend on the body: `Plain` there.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// Nothing beyond ownership.
    Plain,
    /// A resume or connect: it wakes a hibernated sandbox (the running
    /// and memory quotas), admitted by a backend that admits its wakes.
    Resume,
    /// A guest route (files, restore): it wakes a hibernated sandbox
    /// first, admitted as a resume.
    Wake,
    /// It wakes and runs a command: a rate-limit slot too.
    Exec,
    /// A new sandbox of the source's memory, rate-limited.
    Fork,
    /// Snapshot disk of the sandbox's memory (a checkpoint), rate-limited;
    /// admitted by a backend that admits its creates itself.
    Snapshot,
    /// A template made from the sandbox: snapshot disk of its memory,
    /// rate-limited, admitted here on every backend (none admits it
    /// itself; a cluster replica counts its tenant's templates from the
    /// pods' catalogs).
    Template,
}

impl Admit {
    fn expensive(self) -> bool {
        matches!(
            self,
            Admit::Exec | Admit::Fork | Admit::Snapshot | Admit::Template
        )
    }
    fn counted(self) -> bool {
        !matches!(self, Admit::Plain)
    }
}

/// The principal [`crate::auth::require`] (or E2B's key check) put in the
/// request.
pub fn principal(request: &Request) -> Result<Principal, ApiError> {
    request
        .extensions()
        .get::<Principal>()
        .cloned()
        .ok_or_else(|| ApiError::unauthorized("no principal (auth layer missing)"))
}

/// The answer for a sandbox the caller may not see: the same as for one
/// that does not exist.
pub fn sandbox_not_found(id: &str) -> ServiceError {
    ServiceError::NotFound {
        kind: "sandbox",
        id: id.chars().take(64).collect(),
    }
}

/// Whether `principal` sees something of `tenant` in a list.
pub fn sees(principal: &Principal, tenant: Option<&str>) -> bool {
    principal.sees(tenant)
}

/// Ok if `principal` may reach sandbox `id`: an admin always (the service
/// answers for ids that do not exist), a tenant only its own; NotFound for
/// every other id alike.
pub async fn owned<S: SandboxApi + ?Sized>(
    service: &S,
    principal: &Principal,
    id: &SandboxId,
) -> Result<(), ServiceError> {
    if principal.sees_all() {
        return Ok(());
    }
    match service.sandbox_tenant(id).await {
        Ok(t) if principal.sees(t.as_deref()) => Ok(()),
        _ => Err(sandbox_not_found(id.as_str())),
    }
}

/// The `{id}` parameter of the matched route.
async fn id_param(request: Request) -> (Request, Option<String>) {
    let (mut parts, body) = request.into_parts();
    let id = RawPathParams::from_request_parts(&mut parts, &())
        .await
        .ok()
        .and_then(|params| {
            let map: HashMap<&str, &str> = params.iter().collect();
            map.get("id").map(|s| s.to_string())
        });
    (Request::from_parts(parts, body), id)
}

/// Route layer on every route whose `{id}` is a sandbox (see the module
/// documentation); its state is the tenancy and the route's [`Admit`].
pub async fn sandbox<S: SandboxApi>(
    State((t, cost)): State<(Tenancy<S>, Admit)>,
    request: Request,
    next: Next,
) -> Response {
    let p = match principal(&request) {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    let (request, id) = id_param(request).await;
    let Some(id) = id else {
        return ApiError::internal("a gated route without an {id}").into_response();
    };
    let id = SandboxId::new(id);
    let _permit = if cost.expensive() {
        match t.limiter.acquire(&p) {
            Ok(permit) => permit,
            Err(wait) => return ApiError::from(Limited(wait)).into_response(),
        }
    } else {
        None
    };
    // An admin owns every sandbox, and a tenant without a quota is
    // admitted without a count: then nothing here would refuse, so the
    // backend is not asked.
    let counted = cost.counted() && t.auth.quota(&p.tenant) != Quota::default();
    if p.sees_all() && !counted {
        return next.run(request).await;
    }
    let guard = t.clone();
    let checked: Result<Option<Ticket>, ServiceError> = async {
        owned(&*guard.service, &p, &id).await?;
        if !counted {
            return Ok(None);
        }
        let sandbox = guard.service.get_sandbox(&id).await.ok();
        let mem = sandbox.as_ref().map_or(0, |s| u64::from(s.mem_mib));
        match cost {
            Admit::Plain => Ok(None),
            // Admitted by the service itself with the rest of the request
            // (a cluster replica, in PostgreSQL: all of a fork's `count`
            // at once, a checkpoint with its operation).
            Admit::Fork | Admit::Snapshot if guard.service.admits_creates() => Ok(None),
            Admit::Fork => admit(&guard, &p, Usage::sandbox(mem)).await,
            Admit::Snapshot | Admit::Template => admit(&guard, &p, Usage::snapshot(mem)).await,
            // A resume or connect is the wake the service admits itself.
            Admit::Resume if guard.service.admits_wakes() => Ok(None),
            // A guest route wakes that way first.
            Admit::Wake | Admit::Exec if guard.service.admits_wakes() => match sandbox {
                Some(s) => wake_first(&*guard.service, true, &s).await,
                None => Ok(None),
            },
            Admit::Resume | Admit::Wake | Admit::Exec => match sandbox {
                Some(s) => admit_wake(&guard, &p, &s).await,
                None => Ok(None),
            },
        }
    }
    .await;
    let _ticket = match checked {
        Ok(ticket) => ticket,
        Err(e) => return ApiError::from(e).into_response(),
    };
    next.run(request).await
}

/// The gate of the wakes no request carries: a connection to an exposed
/// port of a hibernated sandbox, admitted against its tenant's quotas as
/// a resume is (installed on the pod's service by [`crate::Api::new`]).
pub struct PortWakes<S> {
    /// The API's backend, weakly: the service holds this gate.
    pub service: std::sync::Weak<S>,
    pub auth: crate::auth::Auth,
    pub quotas: std::sync::Arc<crate::quota::Quotas>,
}

impl<S> std::fmt::Debug for PortWakes<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PortWakes").finish_non_exhaustive()
    }
}

impl<S: SandboxApi> torpor_scheduler::service::WakeGate for PortWakes<S> {
    fn admit_wake(
        &self,
        _pod: &torpor_scheduler::service::Service,
        sandbox: &torpor_scheduler::model::Sandbox,
    ) -> Result<Box<dyn std::any::Any + Send>, ServiceError> {
        let Some(tenant) = sandbox.tenant.as_deref() else {
            return Ok(Box::new(()));
        };
        let service = self
            .service
            .upgrade()
            .ok_or_else(|| ServiceError::Internal("the API is stopping".into()))?;
        let quota = self.auth.quota(tenant);
        // Called by the pod's service on the port's blocking path.
        let ticket = crate::backend::wait(self.quotas.admit(
            &*service,
            tenant,
            &quota,
            Usage::wake(u64::from(sandbox.mem_mib)),
        ))?;
        Ok(Box::new(ticket))
    }
}
