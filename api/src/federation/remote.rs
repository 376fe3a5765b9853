//! A remote pod's sandbox operations as typed calls: what the federation's
//! own callers (the E2B routes, envd) need of a sandbox another pod runs.
//! (`/v1` requests for such a sandbox are relayed whole at the HTTP layer
//! instead, `routing.rs`.) The pod's answers are checked like any pod
//! answer: JSON of the expected shape, the pod's own id renamed to its id
//! here, errors as the pod's status and code.

use serde::de::DeserializeOwned;
use serde_json::Value;
use torpor_scheduler::model::{Sandbox, SandboxId};
use torpor_scheduler::service::{Outcome, ServiceError};

use super::pods::{rewrite_pod_ids, RemotePod};
use crate::error::code;

/// `METHOD /v1/sandboxes/{id}{suffix}` on `pod`; its JSON answer.
pub(super) fn call(
    pod: &RemotePod,
    method: &str,
    id: &SandboxId,
    suffix: &str,
    body: Option<&Value>,
) -> Result<Value, ServiceError> {
    let path = format!("/v1/sandboxes/{}{suffix}", id.as_str());
    let mut value = pod.call(method, &path, body)?;
    rewrite_pod_ids(&mut value, &pod.id);
    Ok(value)
}

fn typed<T: DeserializeOwned>(
    pod: &RemotePod,
    what: &str,
    value: Value,
) -> Result<T, ServiceError> {
    serde_json::from_value(value).map_err(|e| ServiceError::Pod {
        status: 502,
        code: code::POD_UNREACHABLE.into(),
        message: format!("pod {}: its answer is not {what} ({e})", pod.id),
    })
}

/// A call answered with a sandbox.
pub(super) fn sandbox(
    pod: &RemotePod,
    method: &str,
    id: &SandboxId,
    suffix: &str,
    body: Option<&Value>,
) -> Result<Sandbox, ServiceError> {
    let value = call(pod, method, id, suffix, body)?;
    typed(pod, "a sandbox", value)
}

/// `POST .../{action}`, answered with an outcome.
pub(super) fn outcome(
    pod: &RemotePod,
    id: &SandboxId,
    action: &str,
) -> Result<Outcome, ServiceError> {
    let value = call(pod, "POST", id, &format!("/{action}"), None)?;
    typed(pod, "an outcome", value)
}
