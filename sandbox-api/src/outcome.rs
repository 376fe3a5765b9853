//! An operation's outcome as it goes between processes (a cluster's pod
//! to its replicas, and into both sides' journals): its [`Reply`], or its
//! failure as an [`OpError`]: the status, code ([`crate::code`]) and
//! message the pod's own API would have answered.

use serde::{Deserialize, Serialize};
use torpor_scheduler::service::ServiceError;

use crate::Reply;

/// An operation's failure as the API answers it: status, code, message
/// (the typed error on the pod, mapped as the pod's own API would:
/// `torpor_api::error`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, thiserror::Error)]
#[serde(deny_unknown_fields)]
#[error("{status} {code}: {message}")]
pub struct OpError {
    pub status: u16,
    pub code: String,
    pub message: String,
}

/// The failure as this side answers it: the pod's status and code, its
/// message [`sanitized`].
impl From<OpError> for ServiceError {
    fn from(e: OpError) -> Self {
        ServiceError::Pod {
            status: e.status,
            code: e.code,
            message: sanitized(&e.message),
        }
    }
}

/// What an operation did ([`Reply`], in its own form on the wire), or
/// its failure (`{"failed": ...}`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum OpOutcome {
    Failed(OpError),
    #[serde(untagged)]
    Done(Reply),
}

impl OpOutcome {
    /// Its reply, or its failure as the error it was.
    pub fn reply(self) -> Result<Reply, ServiceError> {
        match self {
            OpOutcome::Done(reply) => Ok(reply),
            OpOutcome::Failed(e) => Err(e.into()),
        }
    }
}

impl From<Result<Reply, OpError>> for OpOutcome {
    fn from(r: Result<Reply, OpError>) -> Self {
        match r {
            Ok(reply) => OpOutcome::Done(reply),
            Err(e) => OpOutcome::Failed(e),
        }
    }
}

/// Another process's text (a pod's message) as we pass it on: printable characters only, at most 200.
pub fn sanitized(text: &str) -> String {
    let mut out: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(200)
        .collect();
    if text.chars().count() > 200 {
        out.push_str("...");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn an_outcome_is_its_reply_or_its_failure() {
        let gone = json!({"checkpoint_deleted": {"sandbox": "sbx_1", "name": "one"}});
        let outcome: OpOutcome = serde_json::from_value(gone.clone()).unwrap();
        assert!(matches!(
            &outcome,
            OpOutcome::Done(Reply::CheckpointDeleted { name, .. }) if name == "one"
        ));
        assert_eq!(serde_json::to_value(&outcome).unwrap(), gone);
        let failed = json!({"failed": {"status": 409, "code": "conflict", "message": "m"}});
        let outcome: OpOutcome = serde_json::from_value(failed.clone()).unwrap();
        assert!(matches!(&outcome, OpOutcome::Failed(e) if e.status == 409));
        assert_eq!(serde_json::to_value(&outcome).unwrap(), failed);
        let deleted = json!({"deleted": {"sandbox": "sbx_1"}});
        let outcome: OpOutcome = serde_json::from_value(deleted).unwrap();
        assert!(matches!(outcome, OpOutcome::Done(Reply::Deleted { .. })));
        let odd = json!({"failed": {"status": 409, "code": "conflict", "message": "m", "x": 1}});
        assert!(serde_json::from_value::<OpOutcome>(odd).is_err());
    }

    #[test]
    fn a_failure_is_told_sanitized() {
        let e = OpError {
            status: 409,
            code: code_conflict(),
            message: format!("a\nb{}", "x".repeat(300)),
        };
        match ServiceError::from(e) {
            ServiceError::Pod {
                status,
                code,
                message,
            } => {
                assert_eq!((status, code.as_str()), (409, "conflict"));
                assert!(
                    message.starts_with("a b") && message.ends_with("..."),
                    "{message}"
                );
                assert_eq!(message.chars().count(), 203);
            }
            other => panic!("{other:?}"),
        }
    }

    fn code_conflict() -> String {
        crate::code::CONFLICT.to_string()
    }
}
