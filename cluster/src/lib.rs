//! The cluster: any number of stateless API replicas
//! (`torpor serve --cluster postgres://...,nats://...`) and pods
//! (`torpor pod serve --cluster ...`), sharing state in PostgreSQL
//! ([`db`]) and talking over NATS JetStream ([`wire`]).
//!
//! - A replica ([`replica::Cluster`], a [`torpor_gate::backend::SandboxApi`]) places a
//!   create on a pod from the pods' heartbeats, journals the operation in
//!   PostgreSQL, sends it to that pod's work queue and waits for its result
//!   (up to a deadline: past it the answer is 202 with
//!   `/v1/operations/{id}`). Sandbox commands (pause, resume, connect,
//!   hibernate, delete) go the same way to the owning pod, and templates'
//!   builds and deletes to a pod ([`templates`]), checkpoints' takes and
//!   deletes to the sandbox's pod ([`checkpoints`]); the data plane
//!   (exec, files, ports, timeouts) is relayed straight to the pod's API
//!   (`torpor_gate::relay`). E2B's routes use the same commands; envd
//!   reaches the guest through the pod's agent tunnel, and any replica
//!   checks a sandbox's envd token, kept in PostgreSQL ([`guest`]).
//! - Every replica also consumes the pods' events ([`events`]): results
//!   and heartbeats, written to PostgreSQL, then acked.
//! - A pod ([`pod`]) takes its work queue, executes each operation at most
//!   once (its local journal), publishes the result, then acks.
//! - A pod silent for longer than `down_after` is down: its sandboxes
//!   answer 503 `unavailable` with the reason until it is back.
//! - A create its pod does not start in time (dead, stopped) is refused
//!   by the pod, or ended by the replicas, as failed: its tenant's quota
//!   is not held for ever ([`expiry`]).

pub mod admission;
pub mod catalog;
pub mod checkpoints;
pub mod conn;
pub mod db;
pub mod events;
pub mod expiry;
pub mod finished;
pub mod guest;
pub mod images;
pub mod layers;
pub mod moved;
pub mod placement;
pub mod pod;
pub mod queue;
pub mod replica;
pub mod schema;
pub mod secrets;
pub mod templates;
pub mod tenants;
#[cfg(test)]
mod test_pods;
pub mod wire;

use std::time::Duration;

use torpor_scheduler::service::ServiceError;

pub use replica::Cluster;

/// What fails in the cluster's own plumbing.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("--cluster: {0}")]
    Config(String),
    #[error("PostgreSQL: {0}")]
    Postgres(String),
    #[error("the database schema: {0}")]
    Schema(String),
    #[error("NATS: {0}")]
    Nats(String),
    #[error("the pod's journal: {0}")]
    Journal(String),
    /// A create refused at admission (`admission.rs`): 429.
    #[error(transparent)]
    Quota(#[from] torpor_gate::quota::QuotaExceeded),
}

impl From<ClusterError> for ServiceError {
    fn from(e: ClusterError) -> Self {
        match e {
            // The shared state or the bus is down: try again later.
            ClusterError::Postgres(_) | ClusterError::Nats(_) => ServiceError::Pod {
                status: 503,
                code: torpor_gate::error::code::UNAVAILABLE.into(),
                message: format!("the cluster cannot serve this now: {e}"),
            },
            ClusterError::Quota(q) => q.into(),
            ClusterError::Config(_) | ClusterError::Schema(_) | ClusterError::Journal(_) => {
                ServiceError::Internal(e.to_string())
            }
        }
    }
}

/// `--cluster postgres://...,nats://...`: the two URLs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterUrls {
    pub postgres: String,
    pub nats: String,
}

impl std::str::FromStr for ClusterUrls {
    type Err = ClusterError;

    fn from_str(s: &str) -> Result<Self, ClusterError> {
        let mut postgres = None;
        let mut nats = None;
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            if part.starts_with("postgres://") || part.starts_with("postgresql://") {
                if postgres.replace(part.to_string()).is_some() {
                    return Err(ClusterError::Config("two postgres:// URLs".into()));
                }
            } else if part.starts_with("nats://") {
                if nats.replace(part.to_string()).is_some() {
                    return Err(ClusterError::Config("two nats:// URLs".into()));
                }
            } else {
                return Err(ClusterError::Config(format!(
                    "{part:?} is neither a postgres:// nor a nats:// URL"
                )));
            }
        }
        match (postgres, nats) {
            (Some(postgres), Some(nats)) => Ok(ClusterUrls { postgres, nats }),
            _ => Err(ClusterError::Config(
                "expected postgres://...,nats://...".into(),
            )),
        }
    }
}

/// How a replica or a pod runs in the cluster.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    pub urls: ClusterUrls,
    /// How long a replica waits for an operation's result before it answers
    /// 202.
    pub wait: Duration,
    /// A pod silent this long is down.
    pub down_after: Duration,
    /// A pod silent this long is lost for good: its hibernated sandboxes
    /// stored in the object store are moved to a pod up when next used,
    /// and its stored templates are fetched by pods up (`moved.rs`).
    pub lost_after: Duration,
    /// A pod's heartbeat period.
    pub heartbeat: Duration,
    /// Each data-plane call to a pod.
    pub io_timeout: Duration,
    /// A create (an operation that holds its tenant's quota while it is
    /// pending) must be started by its pod within this of its admission,
    /// else the pod refuses it (`expiry.rs`).
    pub create_start: Duration,
    /// After that start deadline, how long more a started create may take
    /// before a replica ends it as failed and frees its quota
    /// (`expiry.rs`): longer than a create takes once started.
    pub create_grace: Duration,
    /// A create picks at random among this many of the pods ranked first
    /// (`replica::PLACEMENT_CHOICES` by default; 1: always the first).
    pub placement_choices: usize,
}

impl ClusterConfig {
    pub fn new(urls: ClusterUrls) -> Self {
        ClusterConfig {
            urls,
            wait: Duration::from_secs(20),
            down_after: Duration::from_secs(4),
            lost_after: Duration::from_secs(60),
            heartbeat: Duration::from_secs(1),
            io_timeout: Duration::from_secs(60),
            create_start: expiry::DEFAULT_START,
            create_grace: expiry::DEFAULT_GRACE,
            placement_choices: replica::PLACEMENT_CHOICES,
        }
    }
}

/// A NATS connection that reconnects by itself.
pub async fn connect_nats(url: &str) -> Result<async_nats::Client, ClusterError> {
    async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connection_timeout(Duration::from_secs(5))
        .connect(url)
        .await
        .map_err(|e| ClusterError::Nats(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_in_either_order() {
        let u: ClusterUrls = "nats://127.0.0.1:4222,postgres://u@127.0.0.1/db"
            .parse()
            .unwrap();
        assert_eq!(u.nats, "nats://127.0.0.1:4222");
        assert_eq!(u.postgres, "postgres://u@127.0.0.1/db");
        assert!("postgres://a".parse::<ClusterUrls>().is_err());
        assert!("postgres://a,nats://b,http://c"
            .parse::<ClusterUrls>()
            .is_err());
        assert!("postgres://a,postgres://b,nats://c"
            .parse::<ClusterUrls>()
            .is_err());
    }

    #[test]
    fn pod_ids_fit_subjects() {
        assert!(wire::valid_pod_id("pod-1"));
        assert!(!wire::valid_pod_id("a.b"));
        assert!(!wire::valid_pod_id("a*"));
        assert!(!wire::valid_pod_id(""));
        assert!(!wire::valid_pod_id(&"a".repeat(65)));
    }
}
