//! `GET /v1/sandboxes/{id}/metrics?from=&to=`: a sandbox's resource use
//! over time, the samples its pod keeps (`service/history.rs`: one every
//! 5 s, the last 1440). Tenant scoping is the `/v1/sandboxes/{id}`
//! gate's (another tenant's sandbox answers 404). A backend whose
//! sandbox runs on another pod asks that pod the same route
//! ([`on_remote_pod`]).

use axum::extract::{Path, RawQuery, State};
use axum::Json;
use serde::{Deserialize, Serialize};
use torpor_scheduler::model::SandboxId;
use torpor_scheduler::service::history::MetricSample;

use crate::backend::SandboxApi;
use crate::handlers::{call, Api, ApiResult};
use crate::pods::RemotePod;
use crate::service::ServiceError;
use crate::wire::Range;

/// `GET /v1/sandboxes/{id}/metrics`.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct MetricHistory {
    /// The samples from `from` to `to`, oldest first.
    pub samples: Vec<MetricSample>,
}

/// `GET /v1/sandboxes/{id}/metrics?from=&to=`.
pub async fn get<S: SandboxApi>(
    State(st): Api<S>,
    Path(id): Path<String>,
    RawQuery(raw): RawQuery,
) -> ApiResult<Json<MetricHistory>> {
    let range = Range::parse(raw.as_deref())?;
    let id = SandboxId::new(id);
    let samples = call(&st, move |s| s.metrics_history(&id, range)).await?;
    Ok(Json(MetricHistory { samples }))
}

/// Sandbox `id`'s history as `pod` keeps it (its `/v1` route).
pub fn on_remote_pod(
    pod: &RemotePod,
    id: &SandboxId,
    range: Range,
) -> Result<Vec<MetricSample>, ServiceError> {
    let path = format!("/v1/sandboxes/{}/metrics{}", id.as_str(), range.query());
    let value = pod.call("GET", &path, None)?;
    serde_json::from_value::<MetricHistory>(value)
        .map(|h| h.samples)
        .map_err(|e| ServiceError::Pod {
            status: 502,
            code: crate::error::code::POD_UNREACHABLE.into(),
            message: format!("pod {}: its answer is not a metrics history ({e})", pod.id),
        })
}
