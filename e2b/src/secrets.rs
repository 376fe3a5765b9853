//! E2B's secrets (`Secret` in both SDKs): `POST /secrets` (201),
//! `GET /secrets` (paged: `limit` 1 to 100, `nextToken`, the next page's
//! token in `x-next-token`), `GET`, `POST` (a new version) and `DELETE`
//! (204) of `/secrets/{id}`, where `{id}` is a secret's id (`sec_...`)
//! or its name. Each is the caller's tenant's only
//! ([`torpor_gate::auth::Principal::owner`]): another tenant's secret
//! is 404 by id and by name, and names are per tenant. Values are
//! write-only: no answer carries one, and a body that does not parse is
//! refused without quoting it. Rules and limits are the gate's
//! ([`torpor_gate::secrets`]); the store is the backend's
//! ([`SandboxApi::secret_store`]).

use std::collections::BTreeMap;

use axum::body::Bytes;
use axum::extract::{Extension, Path, RawQuery};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;
use serde_json::{Map, Value};

use super::error::E2bError;
use super::request::{page_query, query_pairs};
use super::routes::paged;
use super::wire::{page, Cursor};
use torpor_gate::auth::Principal;
use torpor_gate::backend::SandboxApi;
use torpor_gate::handlers::Api;
use torpor_gate::secrets::{
    key, new_secret, secret_update, SecretError, SecretInfo, SecretStore, SecretValue,
    MAX_SECRETS_PER_TENANT,
};

type E2bResult<T> = Result<T, E2bError>;

/// A secret as E2B's API shows it (`Secret` in its spec).
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct SecretBody {
    #[serde(rename = "secretID")]
    secret_id: String,
    name: String,
    current_version: u64,
    metadata: BTreeMap<String, String>,
    created_at: String,
    updated_at: String,
}

impl From<SecretInfo> for SecretBody {
    fn from(s: SecretInfo) -> Self {
        SecretBody {
            secret_id: s.id,
            name: s.name,
            current_version: s.version,
            metadata: s.metadata,
            created_at: super::time::format(s.created_at),
            updated_at: super::time::format(s.updated_at),
        }
    }
}

impl From<SecretError> for E2bError {
    fn from(e: SecretError) -> Self {
        let status = match &e {
            SecretError::NotFound(_) => StatusCode::NOT_FOUND,
            SecretError::NameTaken(_) => StatusCode::CONFLICT,
            SecretError::Invalid(_) | SecretError::TooMany(_) => StatusCode::BAD_REQUEST,
            SecretError::Unsupported => StatusCode::NOT_IMPLEMENTED,
            SecretError::Store {
                unavailable: true, ..
            } => StatusCode::SERVICE_UNAVAILABLE,
            SecretError::Store { message, .. } => {
                tracing::error!(error = %message, "secrets store");
                StatusCode::INTERNAL_SERVER_ERROR
            }
        };
        E2bError::new(status, e.to_string())
    }
}

fn store<S: SandboxApi>(state: &Api<S>) -> E2bResult<&dyn SecretStore> {
    state
        .service
        .secret_store()
        .ok_or_else(|| SecretError::Unsupported.into())
}

/// The body's fields: an object, its `value` a string, `metadata` an
/// object of strings (or null). The errors name fields, never quote them.
struct Fields(Map<String, Value>);

impl Fields {
    fn parse(bytes: &Bytes) -> E2bResult<Self> {
        match serde_json::from_slice::<Value>(bytes) {
            Ok(Value::Object(m)) => Ok(Fields(m)),
            _ => Err(E2bError::bad_request(
                "invalid request body: a JSON object is expected",
            )),
        }
    }

    fn string(&mut self, field: &str) -> E2bResult<String> {
        match self.0.remove(field) {
            Some(Value::String(s)) => Ok(s),
            None | Some(Value::Null) => Err(E2bError::bad_request(format!("{field}: required"))),
            Some(_) => Err(E2bError::bad_request(format!("{field}: must be a string"))),
        }
    }

    fn value(&mut self) -> E2bResult<SecretValue> {
        self.string("value").map(SecretValue::new)
    }

    fn metadata(&mut self) -> E2bResult<Option<BTreeMap<String, String>>> {
        let bad = || E2bError::bad_request("metadata: an object of strings");
        match self.0.remove("metadata") {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Object(m)) => m
                .into_iter()
                .map(|(k, v)| match v {
                    Value::String(s) => Ok((k, s)),
                    _ => Err(bad()),
                })
                .collect::<E2bResult<_>>()
                .map(Some),
            Some(_) => Err(bad()),
        }
    }
}

fn answer(status: StatusCode, s: SecretInfo) -> Response {
    (status, Json(SecretBody::from(s))).into_response()
}

/// `POST /secrets`: `name`, `value`, `metadata`; 201 with the secret at
/// version 1; 409 when the caller has that name.
pub async fn create<S: SandboxApi>(
    state: Api<S>,
    Extension(principal): Extension<Principal>,
    bytes: Bytes,
) -> E2bResult<Response> {
    let mut f = Fields::parse(&bytes)?;
    let name = f.string("name")?;
    let value = f.value()?;
    let metadata = f.metadata()?.unwrap_or_default();
    let new = new_secret(&principal.owner().tenant, &name, value, metadata)?;
    let made = store(&state)?
        .create_secret(new, MAX_SECRETS_PER_TENANT)
        .await?;
    Ok(answer(StatusCode::CREATED, made))
}

/// `GET /secrets`: the caller's secrets, oldest first, a page at a time.
pub async fn list<S: SandboxApi>(
    state: Api<S>,
    Extension(principal): Extension<Principal>,
    RawQuery(raw): RawQuery,
) -> E2bResult<Response> {
    let (limit, after) = page_query(&query_pairs(raw))?;
    let all = store(&state)?.secrets(&principal.owner().tenant).await?;
    let key = |s: &SecretInfo| Cursor {
        created_at: s.created_at.0,
        id: s.id.clone(),
    };
    let (items, next) = page(all, key, false, after.as_ref(), limit);
    let items: Vec<SecretBody> = items.into_iter().map(SecretBody::from).collect();
    Ok(paged(items, next))
}

/// `GET /secrets/{id}`: by id or name.
pub async fn get<S: SandboxApi>(
    state: Api<S>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> E2bResult<Response> {
    let s = store(&state)?
        .secret(&principal.owner().tenant, &key(&id))
        .await?;
    Ok(answer(StatusCode::OK, s))
}

/// `POST /secrets/{id}`: `value` (the next version), `metadata` (replaces
/// the stored one when given); 200 with the secret.
pub async fn update<S: SandboxApi>(
    state: Api<S>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    bytes: Bytes,
) -> E2bResult<Response> {
    let mut f = Fields::parse(&bytes)?;
    let value = f.value()?;
    let metadata = f.metadata()?;
    let update = secret_update(value, metadata)?;
    let s = store(&state)?
        .update_secret(&principal.owner().tenant, &key(&id), update)
        .await?;
    Ok(answer(StatusCode::OK, s))
}

/// `DELETE /secrets/{id}`: 204; its value is gone with it.
pub async fn delete<S: SandboxApi>(
    state: Api<S>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> E2bResult<StatusCode> {
    store(&state)?
        .delete_secret(&principal.owner().tenant, &key(&id))
        .await?;
    Ok(StatusCode::NO_CONTENT)
}
