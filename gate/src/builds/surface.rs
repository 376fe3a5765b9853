//! What the surfaces' build routes share (`/v1`'s in torpor-api, E2B's
//! in torpor-e2b): whose builds a caller sees and records for, a record's
//! log from an offset, and storing a build's uploaded files.

use axum::body::Body;
use axum::response::Response;
use serde::Serialize;

use super::{BuildRecord, Builds};
use crate::auth::Principal;
use crate::backend::SandboxApi;
use crate::handlers::{created, ApiResult};
use crate::service::ServiceError;

/// Whose builds `p` sees: an admin's every build (`None`), a tenant its own.
pub fn scope(p: &Principal) -> Option<String> {
    let owner = p.owner();
    (!owner.admin).then_some(owner.tenant)
}

/// The tenant a build of `p`'s is recorded for (an admin's builds make
/// shared templates: none).
pub fn tenant_of(p: &Principal) -> Option<String> {
    scope(p)
}

/// A build's record with its log from an offset.
pub fn with_logs_from(mut record: BuildRecord, offset: usize) -> BuildRecord {
    let skip = offset.saturating_sub(record.logs_dropped);
    record.logs.drain(..skip.min(record.logs.len()));
    record
}

/// Stores `body` as `tenant`'s files `hash`: 201 with their size.
pub async fn store<S: SandboxApi>(
    st: &crate::handlers::AppState<S>,
    tenant: Option<String>,
    hash: String,
    body: Body,
) -> ApiResult<Response> {
    super::files::check_hash(&hash)?;
    let builds: std::sync::Arc<Builds> = st.tenancy.builds.clone();
    let limit = st.max_upload_bytes;
    let (t, h) = (tenant.clone(), hash.clone());
    // Stored by a blocking thread of its own: the body's frames come on
    // the request's runtime meanwhile.
    let bytes = crate::body::with_body(st, body, move |_, mut reader| async move {
        tokio::task::spawn_blocking(move || {
            builds.files.store(t.as_deref(), &h, &mut reader, limit)
        })
        .await
        .map_err(|e| ServiceError::Internal(format!("storing build files: {e}")))?
    })
    .await?;
    #[derive(Serialize)]
    struct Stored {
        hash: String,
        bytes: u64,
    }
    Ok(created(
        format!("/v1/build-files/{hash}"),
        false,
        Stored { hash, bytes },
    ))
}
