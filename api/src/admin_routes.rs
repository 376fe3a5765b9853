//! Tokens, tenants' quotas and images: the admin's routes (and what a
//! tenant may read of them: its own quota and use, the images' names).

use axum::body::Body;
use axum::extract::{Extension, Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use torpor_scheduler::images::ImagePart;
use torpor_scheduler::model::PodId;

use crate::auth::tokens::{TokenRecord, TokensError};
use crate::auth::{forbidden, Principal, Scope};
use crate::backend::SandboxApi;
use crate::calls::{ImageOp, ImageReply};
use crate::error::{code, ApiError};
use crate::handlers::{call, created, Api, ApiResult};
use crate::quota::{Quota, Quotas, Usage};
use crate::service::ServiceError;
use crate::wire::ApiJson;

fn tokens_error(e: TokensError) -> ApiError {
    match e {
        TokensError::BadTenant | TokensError::LastAdmin(_) => ApiError::invalid(e.to_string()),
        TokensError::NotFound(_) => {
            ApiError::new(StatusCode::NOT_FOUND, code::NOT_FOUND, e.to_string())
        }
        TokensError::TooMany => ApiError::new(StatusCode::CONFLICT, code::CONFLICT, e.to_string()),
        TokensError::File { .. } => {
            tracing::error!(error = %e, "tokens file");
            ApiError::internal("the tokens file could not be written (the server's log has why)")
        }
        TokensError::Taken => {
            tracing::error!(error = %e, "a new token");
            ApiError::internal("a new token could not be made; try again")
        }
        // PostgreSQL down: 503 `unavailable`; a bad row: 500.
        TokensError::Store(e) => e.into(),
    }
}

/// `POST /v1/tokens`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateToken {
    pub tenant: String,
    #[serde(default = "tenant_scope")]
    pub scope: Scope,
}

fn tenant_scope() -> Scope {
    Scope::Tenant
}

/// A new token: its record and, this once, the token.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct NewToken {
    #[serde(flatten)]
    pub record: TokenView,
    pub token: String,
}

/// A token as listed: never the token nor its digest.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[schema(as = TokenInfo)]
pub struct TokenView {
    pub id: String,
    pub tenant: String,
    pub scope: Scope,
    pub created_at: torpor_scheduler::model::Timestamp,
}

impl From<TokenRecord> for TokenView {
    fn from(r: TokenRecord) -> Self {
        TokenView {
            id: r.id,
            tenant: r.tenant,
            scope: r.scope,
            created_at: r.created_at,
        }
    }
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct TokenList {
    pub tokens: Vec<TokenView>,
}

pub async fn list_tokens<S: SandboxApi>(State(st): Api<S>) -> ApiResult<Json<TokenList>> {
    let tokens = st
        .tenancy
        .auth
        .tokens()
        .await
        .map_err(tokens_error)?
        .into_iter()
        .map(Into::into)
        .collect();
    Ok(Json(TokenList { tokens }))
}

pub async fn create_token<S: SandboxApi>(
    State(st): Api<S>,
    ApiJson(body): ApiJson<CreateToken>,
) -> ApiResult<Response> {
    let (record, token) = st
        .tenancy
        .auth
        .create_token(&body.tenant, body.scope)
        .await
        .map_err(tokens_error)?;
    tracing::info!(id = %record.id, tenant = %record.tenant, scope = record.scope.as_str(), "token created");
    let location = format!("/v1/tokens/{}", record.id);
    Ok(created(
        location,
        false,
        NewToken {
            record: record.into(),
            token,
        },
    ))
}

pub async fn delete_token<S: SandboxApi>(
    State(st): Api<S>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    st.tenancy
        .auth
        .remove_token(&id)
        .await
        .map_err(tokens_error)?;
    Ok(StatusCode::NO_CONTENT)
}

/// `GET /v1/tenants/{tenant}`: quotas and use.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[schema(as = Tenant)]
pub struct TenantBody {
    pub tenant: String,
    pub quota: Quota,
    pub usage: Usage,
}

pub async fn get_tenant<S: SandboxApi>(
    State(st): Api<S>,
    Extension(p): Extension<Principal>,
    Path(tenant): Path<String>,
) -> ApiResult<Json<TenantBody>> {
    if !p.is_admin() && p.tenant != tenant {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            code::NOT_FOUND,
            format!(
                "tenant {} not found",
                torpor_sandbox_api::sanitized(&tenant)
            ),
        ));
    }
    let quota = st.tenancy.auth.quota(&tenant);
    let who = tenant.clone();
    let usage = call(&st, move |s| async move {
        let s = &*s;
        Quotas::usage(s, &who, true).await
    })
    .await?;
    Ok(Json(TenantBody {
        tenant,
        quota,
        usage,
    }))
}

pub async fn set_quota<S: SandboxApi>(
    State(st): Api<S>,
    Path(tenant): Path<String>,
    ApiJson(quota): ApiJson<Quota>,
) -> ApiResult<Json<TenantBody>> {
    st.tenancy
        .auth
        .set_quota(&tenant, quota)
        .await
        .map_err(tokens_error)?;
    let who = tenant.clone();
    let usage = call(&st, move |s| async move {
        let s = &*s;
        Quotas::usage(s, &who, true).await
    })
    .await?;
    Ok(Json(TenantBody {
        tenant,
        quota,
        usage,
    }))
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ImageList {
    pub images: Vec<String>,
}

pub async fn list_images<S: SandboxApi>(State(st): Api<S>) -> ApiResult<Json<ImageList>> {
    let images = call(&st, |s| async move { s.image_names().await }).await?;
    Ok(Json(ImageList { images }))
}

pub async fn delete_image<S: SandboxApi>(
    State(st): Api<S>,
    Path(name): Path<String>,
) -> ApiResult<StatusCode> {
    call(&st, move |s| async move {
        let s = &*s;
        s.images(ImageOp::Delete(&name)).await.map(|_| ())
    })
    .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `PUT /v1/images/{name}/{part}`'s query.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UploadQuery {
    /// The pod to install it on.
    pub pod: Option<String>,
}

/// `PUT /v1/images/{name}/{part}`: the raw body, streamed to the image's
/// file (at most the configured upload size) and installed once complete.
pub async fn upload_image<S: SandboxApi>(
    State(st): Api<S>,
    Extension(p): Extension<Principal>,
    Path((name, part)): Path<(String, String)>,
    Query(on): Query<UploadQuery>,
    body: Body,
) -> ApiResult<Response> {
    if !p.is_admin() {
        return Err(forbidden("uploading images needs an admin token"));
    }
    let part = ImagePart::parse(&part).map_err(|e| ApiError::invalid(e.to_string()))?;
    torpor_scheduler::images::check_name(&name).map_err(|e| ApiError::invalid(e.to_string()))?;
    let limit = st.max_upload_bytes;
    let stored = name.clone();
    let size = crate::body::with_body(&st, body, move |s, mut reader| async move {
        let pod = on.pod.map(PodId::new);
        let install = ImageOp::Install {
            name: &stored,
            part,
            body: &mut reader,
            limit,
            pod: pod.as_ref(),
        };
        match s.images(install).await? {
            ImageReply::Installed(size) => Ok(size),
            other => Err(ServiceError::Internal(format!(
                "an image's upload answered {other:?}"
            ))),
        }
    })
    .await;
    let size = size?;
    #[derive(Serialize)]
    struct Installed {
        image: String,
        part: &'static str,
        bytes: u64,
    }
    let part = part.as_str();
    Ok(created(
        format!("/v1/images/{name}"),
        false,
        Installed {
            image: name,
            part,
            bytes: size,
        },
    )
    .into_response())
}
