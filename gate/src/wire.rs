//! The JSON the API reads and writes (their schemas in the OpenAPI document are derived from these types).
//!
//! Request bodies are the API's own types (unknown fields refused, so a
//! misspelt option is an error rather than silently ignored), converted to
//! the service's requests. Responses wrap the scheduler's model types, which
//! serialise as they are stored.

use std::collections::BTreeMap;

use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use torpor_sandbox_api::Lifecycle;
use torpor_scheduler::model::{
    HibernationKind, Pod, PodId, Sandbox, SandboxState, TemplateId, Timestamp,
};

use crate::error::{code, ApiError};
use crate::service::{Outcome, PodView, SandboxFilter};

/// `PATCH /v1/sandboxes/{id}`: at least one field.
#[derive(Debug, Clone, Default, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SandboxPatch {
    #[serde(default)]
    pub keep_alive_ms: Option<u64>,
    #[serde(default)]
    pub timeout_ms: Option<u64>,
}

/// `PATCH /v1/pods/{id}`: at least one field.
#[derive(Debug, Clone, Default, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PodPatch {
    #[serde(default)]
    pub oversubscription_ratio: Option<f64>,
    #[serde(default)]
    pub high_watermark: Option<f64>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Health {
    pub status: &'static str,
    pub version: &'static str,
}

/// Templates, each with the `pod` it is on.
#[derive(Debug, Serialize)]
pub struct TemplateList {
    pub templates: Vec<serde_json::Value>,
    /// The next page's token (also in `X-Next-Token`); absent on the last.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next: Option<String>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct SandboxList {
    pub sandboxes: Vec<Sandbox>,
    /// The next page's token (also in `X-Next-Token`); absent on the last.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next: Option<String>,
}

/// Pod entries: a [`PodBody`] with `reachable: true`, or for a remote pod
/// that does not answer `id`, `address`, `reachable: false` and `error`.
#[derive(Debug, Serialize)]
pub struct PodList {
    pub pods: Vec<serde_json::Value>,
}

/// `POST /v1/sandboxes/{id}/hibernate`'s optional body.
#[derive(Debug, Clone, Default, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct HibernateBody {
    /// What the hibernation keeps: `memory` (memory and disk, the default;
    /// the wake restores it) or `filesystem` (the disk only, after the
    /// guest synced it; the wake boots it again: a new boot).
    #[serde(default)]
    pub mode: HibernationKind,
    /// The guest agent's check first (Linux guests): `none` (the default),
    /// `mark` (an agent that does not answer is recorded on the sandbox,
    /// `guest_unresponsive_at_pause`, and it then wakes only by a reboot)
    /// or `require` (refused with 503 while it does not answer). A
    /// `filesystem` hibernation always requires it.
    #[serde(default)]
    pub guest_check: GuestCheckWord,
}

/// [`HibernateBody::guest_check`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum GuestCheckWord {
    #[default]
    None,
    Mark,
    Require,
}

impl HibernateBody {
    /// The lifecycle call it asks for.
    pub fn lifecycle(&self) -> Lifecycle {
        match (self.mode, self.guest_check) {
            (HibernationKind::Filesystem, _) => Lifecycle::HibernateFilesystem,
            (HibernationKind::Memory, GuestCheckWord::None) => Lifecycle::Hibernate,
            (HibernationKind::Memory, GuestCheckWord::Mark) => Lifecycle::HibernateMarking,
            (HibernationKind::Memory, GuestCheckWord::Require) => Lifecycle::HibernateStrict,
        }
    }
}

/// `POST /v1/sandboxes/{id}/connect`'s optional body.
#[derive(Debug, Clone, Default, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ConnectBody {
    /// How a hibernated sandbox wakes: `restore` (its snapshot, the
    /// default; one that kept only its disk reboots anyway) or `reboot`
    /// (a new boot from its disk, whatever its hibernation kept: the way
    /// to wake one hibernated while its guest agent did not answer).
    #[serde(default)]
    pub mode: WakeMode,
}

/// [`ConnectBody::mode`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum WakeMode {
    #[default]
    Restore,
    Reboot,
}

impl ConnectBody {
    /// The lifecycle call it asks for.
    pub fn lifecycle(&self) -> Lifecycle {
        match self.mode {
            WakeMode::Restore => Lifecycle::Connect,
            WakeMode::Reboot => Lifecycle::Reboot,
        }
    }
}

/// An optional JSON object body: empty is `T`'s default.
pub fn optional_body<T: DeserializeOwned + Default>(bytes: &[u8]) -> Result<T, ApiError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    let value: serde_json::Value = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::invalid(format!("the body is not JSON: {e}")))?;
    if !value.is_object() {
        return Err(ApiError::invalid("the body must be a JSON object"));
    }
    serde_json::from_value(value).map_err(|e| {
        ApiError::invalid(format!(
            "Failed to deserialize the JSON body into the target type: {e}"
        ))
    })
}

/// A sandbox after pause, resume or hibernate, and whether answering it
/// meant waking it from hibernation (and how long that took).
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[schema(as = Outcome)]
pub struct OutcomeBody {
    pub sandbox: Sandbox,
    pub resumed: bool,
    pub resume_ms: Option<f64>,
}

impl From<Outcome> for OutcomeBody {
    fn from(o: Outcome) -> Self {
        OutcomeBody {
            sandbox: o.sandbox,
            resumed: o.resumed,
            resume_ms: o.resume_ms,
        }
    }
}

/// A pod with its measured use.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[schema(as = Pod)]
pub struct PodBody {
    #[serde(flatten)]
    pub pod: Pod,
    /// Nominal memory of the sandboxes placed on it.
    pub committed_mib: u64,
    /// Measured proportional set size of its VMM processes.
    pub pss_mib: f64,
    /// Resident memory of its sandboxes: each VMM cgroup's usage less
    /// inactive page cache (PSS for a VMM without a cgroup); what the
    /// pressure marks (low, high, hard) count.
    pub resident_mib: f64,
    /// Sandboxes on it, by state.
    pub sandboxes: BTreeMap<String, u64>,
}

impl From<PodView> for PodBody {
    fn from(v: PodView) -> Self {
        PodBody {
            pod: v.pod,
            committed_mib: v.committed_mib,
            pss_mib: v.pss_mib,
            resident_mib: v.resident_mib,
            sandboxes: v.sandboxes,
        }
    }
}

/// A JSON body whose rejections are API errors: malformed or mistyped JSON
/// is 400 `invalid_request` with the parser's message, a missing or wrong
/// content type 415 `unsupported_media_type`, a body over the limit 413
/// `payload_too_large`.
#[derive(Debug)]
pub struct ApiJson<T>(pub T);

impl<S, T> FromRequest<S> for ApiJson<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let mut value = match axum::Json::<serde_json::Value>::from_request(req, state).await {
            Ok(axum::Json(value)) => value,
            Err(rejection) => return Err(json_rejection(rejection)),
        };
        // Every body is an object (serde would also take a struct as an
        // array of its fields, which the document does not offer).
        if !value.is_object() {
            return Err(ApiError::invalid("the body must be a JSON object"));
        }
        whole_numbers(&mut value);
        serde_json::from_value(value).map(ApiJson).map_err(|e| {
            ApiError::invalid(format!(
                "Failed to deserialize the JSON body into the target type: {e}"
            ))
        })
    }
}

/// Largest magnitude a JSON float spells a whole number exactly (2^53).
const EXACT_FLOAT: f64 = 9_007_199_254_740_992.0;

/// JSON has numbers, not integers and floats: `2.0` is the integer 2 (as
/// in JSON Schema, which the OpenAPI document's `integer` means), so a
/// whole float within 2^53 is read as that integer. A fraction still
/// fails an integer field, and bounds are checked as before.
fn whole_numbers(v: &mut serde_json::Value) {
    use serde_json::Value;
    match v {
        Value::Number(n) => {
            if let Some(f) = n.as_f64().filter(|_| n.is_f64()) {
                if f.fract() == 0.0 && f.abs() <= EXACT_FLOAT {
                    *n = if f < 0.0 {
                        (f as i64).into()
                    } else {
                        (f as u64).into()
                    };
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(whole_numbers),
        Value::Object(map) => map.values_mut().for_each(whole_numbers),
        _ => {}
    }
}

fn json_rejection(rejection: JsonRejection) -> ApiError {
    let message = rejection.body_text();
    match rejection {
        JsonRejection::JsonDataError(_) | JsonRejection::JsonSyntaxError(_) => {
            ApiError::invalid(message)
        }
        JsonRejection::MissingJsonContentType(_) => ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            code::UNSUPPORTED_MEDIA_TYPE,
            "expected `Content-Type: application/json`",
        ),
        other => ApiError::from_status(other.status(), message),
    }
}

/// The sandbox list filter from query pairs: `state` (repeated or
/// comma-separated, any of), `template`, `pod`, `metadata.KEY=VALUE` (all
/// must match). Unknown parameters are refused.
pub fn sandbox_filter(pairs: Vec<(String, String)>) -> Result<SandboxFilter, ApiError> {
    let mut filter = SandboxFilter::default();
    for (key, value) in pairs {
        match key.as_str() {
            "state" => {
                // Exact state names, comma-separated: an empty one (`state=`)
                // is refused, as the document's enum says.
                for word in value.split(',') {
                    let state: SandboxState = word.parse().map_err(|_| {
                        ApiError::invalid(format!(
                            "unknown state {word:?} (one of {})",
                            SandboxState::ALL
                                .iter()
                                .map(|s| s.as_str())
                                .collect::<Vec<_>>()
                                .join(", ")
                        ))
                    })?;
                    if !filter.states.contains(&state) {
                        filter.states.push(state);
                    }
                }
            }
            "template" => set_once(&mut filter.template, "template", TemplateId::new(value))?,
            "pod" => set_once(&mut filter.pod, "pod", PodId::new(value))?,
            _ => {
                // `metadata.KEY`, or OpenAPI's deepObject `metadata[KEY]`:
                // everything between the first `[` and the last `]` is the
                // key (deepObject has no escapes, and a metadata key may
                // hold brackets), but not `][`, which is how a nested
                // value (`metadata[k][0]=...`, not a string) reads: such a
                // key is filtered by `metadata.KEY`.
                let meta = key.strip_prefix("metadata.").or_else(|| {
                    key.strip_prefix("metadata[")
                        .and_then(|k| k.strip_suffix(']'))
                        .filter(|k| !k.contains("]["))
                });
                let Some(meta) = meta.filter(|k| !k.is_empty()) else {
                    return Err(ApiError::invalid(format!(
                        "unknown query parameter {key:?} (state, template, pod, metadata.KEY \
                         or metadata[KEY])"
                    )));
                };
                if let Some(old) = filter.metadata.insert(meta.to_string(), value) {
                    if filter.metadata[meta] != old {
                        return Err(ApiError::invalid(format!(
                            "metadata.{meta} given twice with different values"
                        )));
                    }
                }
            }
        }
    }
    Ok(filter)
}

fn set_once<T: PartialEq>(slot: &mut Option<T>, name: &str, value: T) -> Result<(), ApiError> {
    match slot {
        Some(old) if *old != value => Err(ApiError::invalid(format!(
            "query parameter {name} given twice with different values"
        ))),
        _ => {
            *slot = Some(value);
            Ok(())
        }
    }
}

/// The range of a history request (`GET /v1/sandboxes/{id}/metrics`,
/// `GET /v1/sandboxes/{id}/metrics`; E2B's metrics): `from` and `to`, ms since the
/// epoch, both included, either open.
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

/// `GET /v1/sandboxes/{id}/metrics`'s answer: a sandbox's resource use
/// over time, the samples its pod keeps (`service/history.rs`).
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct MetricHistory {
    /// The samples from `from` to `to`, oldest first.
    pub samples: Vec<torpor_scheduler::service::history::MetricSample>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn whole_floats_are_integers_and_fractions_are_not() {
        let mut v: serde_json::Value =
            serde_json::from_str(r#"{"a": 2.0, "b": [-3.0, 0.5], "c": 1e300, "d": "4.0"}"#)
                .unwrap();
        whole_numbers(&mut v);
        assert_eq!(v["a"].as_u64(), Some(2));
        assert_eq!(v["b"][0].as_i64(), Some(-3));
        assert!(v["b"][1].is_f64());
        assert!(v["c"].is_f64(), "past 2^53 a float stays a float");
        assert_eq!(v["d"], "4.0");
    }

    #[test]
    fn filter_from_query() {
        let f = sandbox_filter(pairs(&[
            ("state", "running,paused"),
            ("state", "hibernated"),
            ("state", "running"),
            ("template", "tpl_a"),
            ("pod", "pod_local"),
            ("metadata.team", "ml"),
            ("metadata[user]", "ada"),
            ("metadata[3]!þ]", "x"),
            ("metadata.a][b", "y"),
        ]))
        .unwrap();
        assert_eq!(
            f.states,
            vec![
                SandboxState::Running,
                SandboxState::Paused,
                SandboxState::Hibernated
            ]
        );
        assert_eq!(f.template, Some(TemplateId::new("tpl_a")));
        assert_eq!(f.pod, Some(PodId::new("pod_local")));
        assert_eq!(f.metadata["team"], "ml");
        assert_eq!(f.metadata["user"], "ada");
        assert_eq!(f.metadata["3]!þ"], "x");
        assert_eq!(f.metadata["a][b"], "y");
        assert_eq!(sandbox_filter(vec![]).unwrap(), SandboxFilter::default());
    }

    #[test]
    fn bad_filters_are_refused() {
        for bad in [
            pairs(&[("state", "asleep")]),
            pairs(&[("colour", "red")]),
            pairs(&[("metadata.", "x")]),
            pairs(&[("metadata[]", "x")]),
            pairs(&[("metadata[k", "x")]),
            // A nested deepObject value, not a string.
            pairs(&[("metadata[k][0]", "x")]),
            pairs(&[("template", "a"), ("template", "b")]),
            pairs(&[("metadata.k", "a"), ("metadata.k", "b")]),
        ] {
            let err = sandbox_filter(bad.clone()).unwrap_err();
            assert_eq!(err.status, StatusCode::BAD_REQUEST, "{bad:?}");
        }
    }

    #[test]
    fn request_bodies_refuse_unknown_fields() {
        let ok: crate::service::CreateSandbox =
            serde_json::from_str(r#"{"template":"probe"}"#).unwrap();
        assert!(!ok.queue);
        assert!(ok.metadata.is_empty());
        assert!(serde_json::from_str::<crate::service::CreateSandbox>(
            r#"{"template":"p","mem":1}"#
        )
        .is_err());
        assert!(serde_json::from_str::<PodPatch>(r#"{"ratio":2}"#).is_err());
    }

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
