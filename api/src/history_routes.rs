//! `GET /v1/sandboxes/{id}/metrics?from=&to=`: a sandbox's resource use
//! over time, the samples its pod keeps (`service/history.rs`: one every
//! 5 s, the last 1440). Tenant scoping is the `/v1/sandboxes/{id}`
//! gate's (another tenant's sandbox answers 404). A backend whose
//! sandbox runs on another pod asks that pod the same route
//! (`torpor_gate::pods::metrics_history`).

use axum::extract::{Path, RawQuery, State};
use axum::Json;
use torpor_scheduler::model::SandboxId;

use torpor_gate::backend::SandboxApi;
use torpor_gate::handlers::{call, Api, ApiResult};
use torpor_gate::wire::{MetricHistory, Range};

/// `GET /v1/sandboxes/{id}/metrics?from=&to=`.
pub async fn get<S: SandboxApi>(
    State(st): Api<S>,
    Path(id): Path<String>,
    RawQuery(raw): RawQuery,
) -> ApiResult<Json<MetricHistory>> {
    let range = Range::parse(raw.as_deref())?;
    let id = SandboxId::new(id);
    let samples = call(&st, move |s| async move {
        let s = &*s;
        s.metrics_history(&id, range).await
    })
    .await?;
    Ok(Json(MetricHistory { samples }))
}
