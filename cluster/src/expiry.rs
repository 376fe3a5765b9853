//! A create placed on a pod that died (or stays stopped) must not hold its
//! tenant's quota for ever: it is counted while its operation is pending
//! (`admission.rs`), and only its pod ends it.
//!
//! - At admission, an operation that holds quota while pending (`asked`)
//!   is journaled with two deadlines, on PostgreSQL's clock: `start_by`
//!   (admission + [`ClusterConfig::create_start`](super::ClusterConfig),
//!   [`DEFAULT_START`]) and `expires_at` (`start_by` +
//!   `create_grace`, [`DEFAULT_GRACE`]).
//! - Its work item carries them ([`Deadlines`], as headers). A pod taking
//!   it past `start_by` does not run it: it journals and publishes
//!   [`not_started`], a typed failure (503 `unavailable`, `Retry-After`).
//!   A create it ran that ended past `expires_at` is deleted again and
//!   reported failed ([`too_late`]): by then a replica may have ended it.
//!   A fork holds its tenant's quota the same way (all of its count), and
//!   its sandboxes are deleted alike when it ended past `expires_at`.
//! - Every replica ends pending operations past `expires_at` as failed
//!   with the same typed error ([`Db::expire_operations`], one statement,
//!   pending rows only); their quota is free from that commit. A pod's
//!   outcome applied later changes nothing (`Db::finish` updates pending
//!   rows only, and writes its sandbox row only with that update).
//!
//! The grace must outlast a create once started (a restore takes seconds;
//! a pod's own requests are bounded by `--request-timeout-ms`, 120 s by
//! default): a create running past `expires_at` is undone by its pod.
//!
//! Clocks: the deadlines are PostgreSQL's, compared with the pod's clock
//! when it takes and ends an item; hosts are assumed NTP-synchronized
//! (skew of milliseconds to a second). Skew only moves the pod's checks by
//! that much against the windows of minutes. Left open: a create ending
//! within the skew (or the publish delay) before `expires_at` whose outcome
//! is applied after the sweep: its operation reads failed while its
//! sandbox exists. The pod's heartbeat writes that sandbox's row, so it is
//! listed and counted against its tenant's quota (nothing runs uncounted)
//! until it is deleted or times out.
//!
//! A pod lost for good (silent past
//! [`ClusterConfig::lost_after`](super::ClusterConfig)) answers nothing
//! more: the same sweep ends its pending operations that make nothing new
//! (lifecycle calls, deletes, checkpoints: [`Db::fail_operations_of_lost_pods`])
//! as failed (409 `conflict`: waiting does not help), so neither the request waiting for one nor a retry with its
//! `Idempotency-Key` waits for ever (before, a retry published the work
//! item again to the lost pod and answered 202 each time). A new request
//! takes the lost pod's paths (`moved.rs`: a hibernated sandbox moves, a
//! running one reads `lost`). Creates and forks (and template builds) are
//! ended so only once past their start deadline (and [`SKEW_MARGIN`]): a
//! pod that comes back before it would still make what it took, which must
//! not read failed; after it, it refuses the item ([`not_started`]). So a
//! create placed on a pod that died for good has its answer after
//! `create_start` (120 s by default) rather than its expiry's 420.
//!
//! Where the sweep runs: a periodic task in every replica
//! ([`run`], every [`sweep_period`]), not admission. Admission would free
//! the quota only of a tenant that creates again, while `GET
//! /v1/operations/{id}` of a tenant that does not would read pending for
//! ever; a periodic task serves every tenant and keeps the admission
//! transaction (which holds the tenant's lock) as short as it was. Every
//! replica runs it so that none is needed; they race harmlessly (a row is
//! ended once, by whichever statement updates it first).
//!
//! Wire: the deadlines travel as NATS headers, not [`WorkItem`] fields
//! (`WorkItem` denies unknown fields: a pod of an older build would drop an
//! item with a new field; it ignores headers and runs the item as before:
//! the replicas still end its operation, and a sandbox it makes late is
//! written by its heartbeat, so listed and counted). An item from an older
//! replica has none: no deadline, as before; nor has its operation (the
//! columns are null), which the sweep leaves alone.
//!
//! [`WorkItem`]: super::wire::WorkItem

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_nats::HeaderMap;
use torpor_scheduler::model::PodId;
use torpor_scheduler::service::ServiceError;

use super::db::{pg, Db};
use super::wire::OpOutcome;
use super::ClusterError;

/// The default start window of a create (`--cluster-create-start-ms`).
pub const DEFAULT_START: Duration = Duration::from_secs(120);
/// The default grace after it (`--cluster-create-grace-ms`): more than a
/// pod's default request timeout (120 s) twice over.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(300);

/// A work item's start deadline (unix ms, PostgreSQL's clock).
pub const START_BY_HEADER: &str = "Torpor-Start-By";
/// The time past which replicas end its operation (unix ms).
pub const EXPIRES_HEADER: &str = "Torpor-Expires";

/// Seconds after which a client may try again.
const RETRY_AFTER_S: u64 = 1;
/// A retry with the operation's `Idempotency-Key` reads its outcome, this
/// failure, as for any operation: only a new request makes one again (a
/// freed key could make a second sandbox, should the first be made late).
const AGAIN: &str = "a retry with the same Idempotency-Key reads this failure";

/// An operation's deadlines, unix milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadlines {
    pub start_by_ms: i64,
    pub expires_ms: i64,
}

impl Deadlines {
    /// From a journaled operation's columns: both or none.
    pub fn of(start_by_ms: Option<i64>, expires_ms: Option<i64>) -> Option<Self> {
        Some(Deadlines {
            start_by_ms: start_by_ms?,
            expires_ms: expires_ms?,
        })
    }

    /// Added to a work item's headers.
    pub fn add_to(&self, headers: &mut HeaderMap) {
        headers.insert(START_BY_HEADER, self.start_by_ms.to_string());
        headers.insert(EXPIRES_HEADER, self.expires_ms.to_string());
    }

    /// Read from a work item's headers: none without both (an item from a
    /// replica of an older build) or with one that is not a number.
    pub fn from_headers(headers: Option<&HeaderMap>) -> Option<Self> {
        let headers = headers?;
        let ms = |name: &str| -> Option<i64> { headers.get(name)?.as_str().trim().parse().ok() };
        Self::of(ms(START_BY_HEADER), ms(EXPIRES_HEADER))
    }
}

/// Now on this host's clock, unix milliseconds.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

fn failed(message: String) -> OpOutcome {
    OpOutcome::Failed(super::wire::failure(ServiceError::Unavailable {
        message,
        retry_after_s: RETRY_AFTER_S,
    }))
}

/// A pod's refusal of `operation` taken at `now_ms`, past its start
/// deadline; none before it (or without deadlines).
pub fn not_started(
    deadlines: Option<&Deadlines>,
    now_ms: i64,
    pod: &PodId,
    operation: &str,
) -> Option<OpOutcome> {
    let d = deadlines?;
    (now_ms > d.start_by_ms).then(|| {
        failed(format!(
            "pod {pod} took operation {operation} {} ms past its start deadline (it was down, \
             stopped or behind): not started, nothing was made; create again ({AGAIN})",
            now_ms.saturating_sub(d.start_by_ms)
        ))
    })
}

/// A pod's failure for `operation`, a create that ended at `now_ms`, past
/// its expiry (a replica may have ended it already): its sandbox deleted.
pub fn too_late(
    deadlines: Option<&Deadlines>,
    now_ms: i64,
    pod: &PodId,
    operation: &str,
) -> Option<OpOutcome> {
    let d = deadlines?;
    (now_ms > d.expires_ms).then(|| {
        failed(format!(
            "pod {pod} finished operation {operation} {} ms past its expiry: what it made was \
             deleted; create again ({AGAIN})",
            now_ms.saturating_sub(d.expires_ms)
        ))
    })
}

/// The outcome of an operation a replica ended (`%s`: its id, its pod),
/// with its error's JSON path.
fn expired_outcome() -> Result<serde_json::Value, ClusterError> {
    let outcome = failed(
        "pod %s did not start operation %s by its start deadline, nor end it within its grace \
         (it was down, stopped or behind): ended as failed, its quota freed; create again ("
            .to_string()
            + AGAIN
            + ")",
    );
    serde_json::to_value(outcome).map_err(|e| ClusterError::Schema(e.to_string()))
}

impl Db {
    /// Ends every pending operation past its expiry as failed (503
    /// `unavailable`); their ids. One statement over pending rows only: a
    /// pod's outcome written at the same time (`Db::finish`, also on
    /// pending rows only) waits for the row's lock and then finds it ended,
    /// or ended it first and this statement skips it. Never both.
    pub async fn expire_operations(&self) -> Result<Vec<String>, ClusterError> {
        let outcome = expired_outcome()?;
        let rows = self
            .client()
            .await?
            .query(
                "UPDATE operations SET status = 'failed', finished_at = now(),
                    outcome = jsonb_set($1::jsonb, '{failed,message}',
                        to_jsonb(format($1::jsonb #>> '{failed,message}', pod, id)))
                 WHERE status = 'pending' AND expires_at < now()
                 RETURNING id",
                &[&outcome],
            )
            .await
            .map_err(pg)?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }
}

/// The outcome of an operation whose pod was lost for good before it
/// answered (`%s`: its pod, its id), with its error's JSON path.
fn lost_outcome(lost_after: Duration) -> Result<serde_json::Value, ClusterError> {
    // 409, not 503: waiting does not help, and a retry with the same key
    // reads this failure; a new request goes the lost pod's way.
    let outcome = OpOutcome::Failed(super::wire::failure(ServiceError::ResourceConflict(
        format!(
            "pod %s was lost for good (no heartbeat for more than {} s) before it answered \
             operation %s: ended as failed; what it may have done went with that pod. Read the \
             sandbox and send a new request to act on it ({AGAIN})",
            lost_after.as_secs()
        ),
    )));
    serde_json::to_value(outcome).map_err(|e| ClusterError::Schema(e.to_string()))
}

/// Kinds a pod lost for good keeps pending until their start deadline
/// (they make something new a pod that comes back may still make before
/// it).
const KEPT_WHEN_LOST: [&str; 3] = ["create", "fork", "template_build"];

/// How far past an operation's start deadline (PostgreSQL's clock) a
/// lost pod's create is ended: a pod whose clock is behind by less still
/// refuses it when it comes back.
pub const SKEW_MARGIN: Duration = Duration::from_secs(2);

impl Db {
    /// Ends as failed (409 `conflict`) every pending operation whose pod
    /// has been silent for `lost_after` (lost for good), a create, fork or
    /// template build only once past its start deadline and
    /// [`SKEW_MARGIN`]; their ids. One statement over pending rows only,
    /// like [`Db::expire_operations`].
    pub async fn fail_operations_of_lost_pods(
        &self,
        lost_after: Duration,
    ) -> Result<Vec<String>, ClusterError> {
        let outcome = lost_outcome(lost_after)?;
        let kept: Vec<&str> = KEPT_WHEN_LOST.to_vec();
        let rows = self
            .client()
            .await?
            .query(
                "UPDATE operations o SET status = 'failed', finished_at = now(),
                    outcome = jsonb_set($1::jsonb, '{failed,message}',
                        to_jsonb(format($1::jsonb #>> '{failed,message}', o.pod, o.id)))
                 FROM pods p
                 WHERE o.status = 'pending' AND o.pod = p.id
                    AND extract(epoch FROM now() - p.last_heartbeat)::double precision >= $2
                    AND (NOT (o.kind = ANY($3))
                        OR extract(epoch FROM now() - o.start_by)::double precision > $4)
                 RETURNING o.id",
                &[
                    &outcome,
                    &lost_after.as_secs_f64(),
                    &kept,
                    &SKEW_MARGIN.as_secs_f64(),
                ],
            )
            .await
            .map_err(pg)?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }
}

/// How often a replica sweeps: a quarter of the grace, within 100 ms and
/// 5 s (an expired create holds its quota at most that much longer).
pub fn sweep_period(grace: Duration) -> Duration {
    (grace / 4).clamp(Duration::from_millis(100), Duration::from_secs(5))
}

/// A replica's sweep, until the process ends: expired operations, and
/// those of pods lost for good (silent `lost_after`).
pub async fn run(db: Arc<Db>, period: Duration, lost_after: Duration) {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match db.expire_operations().await {
            Ok(ended) if !ended.is_empty() => {
                tracing::warn!(operations = ?ended, "ended operations their pods did not");
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "the sweep of expired operations"),
        }
        match db.fail_operations_of_lost_pods(lost_after).await {
            Ok(ended) if !ended.is_empty() => {
                tracing::warn!(operations = ?ended, "ended operations of pods lost for good");
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "the sweep of lost pods' operations"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deadlines_go_as_headers_and_both_are_needed() {
        let d = Deadlines {
            start_by_ms: 1_000,
            expires_ms: 5_000,
        };
        let mut h = HeaderMap::new();
        h.insert("Nats-Msg-Id", "op_1");
        d.add_to(&mut h);
        assert_eq!(Deadlines::from_headers(Some(&h)), Some(d));
        // From an older replica: no headers, or only the message id.
        assert_eq!(Deadlines::from_headers(None), None);
        let mut old = HeaderMap::new();
        old.insert("Nats-Msg-Id", "op_1");
        assert_eq!(Deadlines::from_headers(Some(&old)), None);
        old.insert(START_BY_HEADER, "1000");
        assert_eq!(Deadlines::from_headers(Some(&old)), None);
        old.insert(EXPIRES_HEADER, "soon");
        assert_eq!(Deadlines::from_headers(Some(&old)), None);
        assert_eq!(Deadlines::of(Some(1), None), None);
    }

    #[test]
    fn a_pod_refuses_past_the_start_and_undoes_past_the_expiry() {
        let pod = PodId::new("pod-1");
        let d = Deadlines {
            start_by_ms: 1_000,
            expires_ms: 5_000,
        };
        assert!(not_started(Some(&d), 1_000, &pod, "op_1").is_none());
        assert!(not_started(None, i64::MAX, &pod, "op_1").is_none());
        let Some(OpOutcome::Failed(e)) = not_started(Some(&d), 1_001, &pod, "op_1") else {
            panic!("not refused");
        };
        assert_eq!((e.status, e.code.as_str()), (503, "unavailable"));
        assert!(
            e.message.contains("op_1") && e.message.contains("pod-1"),
            "{e:?}"
        );
        assert!(too_late(Some(&d), 5_000, &pod, "op_1").is_none());
        assert!(too_late(None, i64::MAX, &pod, "op_1").is_none());
        assert!(matches!(
            too_late(Some(&d), 5_001, &pod, "op_1"),
            Some(OpOutcome::Failed(crate::wire::OpError { status: 503, .. }))
        ));
    }

    #[test]
    fn the_swept_outcome_reads_as_a_failure() {
        let v = expired_outcome().unwrap();
        assert_eq!(v["failed"]["status"], 503);
        assert_eq!(v["failed"]["code"], "unavailable");
        // Two %s for format(): the pod, the operation.
        let m = v["failed"]["message"].as_str().unwrap();
        assert_eq!(m.matches("%s").count(), 2, "{m}");
        assert!(!m.replace("%s", "").contains('%'), "{m}");
        assert!(matches!(
            serde_json::from_value::<OpOutcome>(v).unwrap(),
            OpOutcome::Failed(_)
        ));
    }

    #[test]
    fn a_lost_pods_outcome_reads_as_a_failure_naming_both() {
        let v = lost_outcome(Duration::from_secs(60)).unwrap();
        assert_eq!(v["failed"]["status"], 409);
        let m = v["failed"]["message"].as_str().unwrap();
        assert_eq!(m.matches("%s").count(), 2, "{m}");
        assert!(!m.replace("%s", "").contains('%'), "{m}");
        assert!(m.contains("lost for good") && m.contains("60 s"), "{m}");
    }

    #[test]
    fn the_sweep_period_follows_the_grace() {
        assert_eq!(sweep_period(DEFAULT_GRACE), Duration::from_secs(5));
        assert_eq!(
            sweep_period(Duration::from_secs(2)),
            Duration::from_millis(500)
        );
        assert_eq!(sweep_period(Duration::ZERO), Duration::from_millis(100));
    }
}
