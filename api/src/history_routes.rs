//! `GET /v1/sandboxes/{id}/metrics?from=&to=`: a sandbox's resource use
//! over time, the samples its pod keeps (`service/history.rs`: one every
//! 5 s, the last 1440). Tenant scoping is the `/v1/sandboxes/{id}`
//! gate's (another tenant's sandbox answers 404). A backend whose
//! sandbox runs on another pod asks that pod the same route
//! ([`on_remote_pod`]).

use axum::extract::{Path, RawQuery, State};
use axum::Json;
use serde::{Deserialize, Serialize};
use torpor_scheduler::model::{SandboxId, Timestamp};
use torpor_scheduler::service::history::MetricSample;

use crate::backend::SandboxApi;
use crate::error::ApiError;
use crate::handlers::{call, Api, ApiResult};
use crate::pods::RemotePod;
use crate::service::ServiceError;

/// `GET /v1/sandboxes/{id}/metrics`.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct MetricHistory {
    /// The samples from `from` to `to`, oldest first.
    pub samples: Vec<MetricSample>,
}

/// The range of a history request: `from` and `to`, ms since the epoch,
/// both included, either open.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Range {
    pub from: Option<Timestamp>,
    pub to: Option<Timestamp>,
}

impl Range {
    /// `from` and `to` of a query (unknown parameters or a value that is
    /// not a non-negative integer: 400). `from` after `to` is an empty
    /// range: no samples.
    pub fn parse(raw: Option<&str>) -> Result<Range, ApiError> {
        let mut range = Range::default();
        for (k, v) in form_urlencoded::parse(raw.unwrap_or_default().as_bytes()) {
            let slot = match k.as_ref() {
                "from" => &mut range.from,
                "to" => &mut range.to,
                other => {
                    return Err(ApiError::invalid(format!(
                        "unknown parameter {other:?} (from, to)"
                    )))
                }
            };
            let ms: i64 = v.parse().ok().filter(|n| *n >= 0).ok_or_else(|| {
                ApiError::invalid(format!("{k} {v:?} is not a time in ms since the epoch"))
            })?;
            *slot = Some(Timestamp(ms));
        }
        Ok(range)
    }

    /// Its query string (empty when open at both ends).
    pub fn query(&self) -> String {
        let mut parts = Vec::new();
        if let Some(f) = self.from {
            parts.push(format!("from={}", f.0));
        }
        if let Some(t) = self.to {
            parts.push(format!("to={}", t.0));
        }
        if parts.is_empty() {
            String::new()
        } else {
            format!("?{}", parts.join("&"))
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn history_range_parses_from_and_to() {
        assert_eq!(Range::parse(None).unwrap(), Range::default());
        let r = Range::parse(Some("from=1000&to=2000")).unwrap();
        assert_eq!(
            (r.from, r.to),
            (Some(Timestamp(1000)), Some(Timestamp(2000)))
        );
        assert_eq!(r.query(), "?from=1000&to=2000");
        assert_eq!(Range::parse(Some("to=5")).unwrap().query(), "?to=5");
        for bad in ["from=x", "from=-1", "to=1.5", "start=1"] {
            assert!(Range::parse(Some(bad)).is_err(), "{bad}");
        }
        // An empty range (the history then has no sample in it).
        assert!(Range::parse(Some("from=3&to=2")).is_ok());
    }
}
