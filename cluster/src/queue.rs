//! A command's way through the cluster: journaled in PostgreSQL (a
//! create's admitted against its tenant's quota in the same statement),
//! queued to its pod's work subject, and its outcome waited for, woken by
//! the outcome's notification (`finished.rs`).

use std::time::{Duration, Instant};

use torpor_gate::quota::Usage;
use torpor_gate::service::ServiceError;
use torpor_scheduler::model::{random_hex, PodId};

use super::db::{NewOp, OpRow};
use super::finished::Waiting;
use super::replica::Cluster;
use super::wire::{self, OpOutcome, Operation, WorkItem};

/// How often a waiting replica reads its operation's row at first, and
/// for how long (then doubling up to 100 ms), while it hears no
/// notifications of outcomes (`finished.rs`).
const POLL_FAST: Duration = Duration::from_millis(3);
const POLL_FAST_FOR: Duration = Duration::from_millis(300);
/// How often it reads the row at first while it hears them (woken
/// otherwise): a fallback for an outcome written without one.
const POLL_LISTENING: Duration = Duration::from_millis(25);

impl Cluster {
    /// Journals `command` for `pod` (a create admitted against its
    /// tenant's quota for what it `asked`), queues it, and waits for its
    /// outcome.
    pub(super) async fn run(
        &self,
        pod: &PodId,
        tenant: &str,
        command: Operation,
        asked: Option<&Usage>,
    ) -> Result<OpOutcome, ServiceError> {
        let key = torpor_gate::request_context::idempotency_key();
        self.run_keyed(pod, tenant, command, asked, key).await
    }

    /// [`Cluster::run`] with this idempotency `key` rather than the
    /// request's.
    pub(super) async fn run_keyed(
        &self,
        pod: &PodId,
        tenant: &str,
        command: Operation,
        asked: Option<&Usage>,
        key: Option<String>,
    ) -> Result<OpOutcome, ServiceError> {
        let id = format!("op_{}", random_hex(12));
        let new = NewOp {
            id: &id,
            kind: command.kind(),
            sandbox: command.sandbox(),
            template: command.template().map(|t| t.as_str()),
            pod,
            tenant,
            idempotency_key: key.as_deref(),
            // What holds quota while pending is ended if its pod does not
            // run it in time (`expiry.rs`).
            deadlines: asked.map(|_| (self.config.create_start, self.config.create_grace)),
        };
        let (op, fresh) = self.db.begin_operation(&new, asked).await?;
        if !fresh {
            // A retry: the first request's outcome, if it was the same.
            let same_sandbox = command
                .sandbox()
                .is_none_or(|s| op.sandbox.as_deref() == Some(s.as_str()));
            let same_template = command
                .template()
                .is_none_or(|t| op.template.as_deref() == Some(t.as_str()));
            if op.kind != command.kind() || !same_sandbox || !same_template {
                return Err(op.key_used_elsewhere());
            }
        }
        // A retry of an operation still pending publishes its work item
        // again, to the pod it was placed on: the first request may have
        // ended (its replica killed, NATS down) between the journal and
        // the publish. The stream drops a copy within its duplicate window
        // (the operation id is the message id) and the pod's journal runs
        // an operation once.
        if fresh || op.outcome.is_none() {
            let item = WorkItem {
                operation: op.id.clone(),
                command,
            };
            let placed = PodId::new(op.pod.clone());
            // Its deadlines as journaled: a retry does not extend them.
            let mut headers = async_nats::HeaderMap::new();
            if let Some(d) = super::expiry::Deadlines::of(op.start_by_ms, op.expires_ms) {
                d.add_to(&mut headers);
            }
            // Waited for before it is sent, so that its outcome's
            // notification cannot come first: a new operation's row is
            // then not read before it is woken (its pod has it only now).
            let waiting = self.finished.wait_for(&op.id);
            let subject = wire::work_subject(&placed);
            wire::publish_with(&self.js, subject, Some(&op.id), headers, &item).await?;
            let read_first = !fresh || !self.finished.listening();
            return self.wait_with(op, waiting, read_first).await;
        }
        self.wait(op).await
    }

    /// The outcome of `op` once its pod answered; past the wait,
    /// [`ServiceError::Accepted`] (202 with `/v1/operations/{id}`).
    pub(super) async fn wait(&self, op: OpRow) -> Result<OpOutcome, ServiceError> {
        let waiting = self.finished.wait_for(&op.id);
        self.wait_with(op, waiting, true).await
    }

    /// [`Cluster::wait`] registered as `waiting`, its row read at once if
    /// `read_first`, else first when woken or after the fallback period.
    async fn wait_with(
        &self,
        op: OpRow,
        mut waiting: Waiting<'_>,
        read_first: bool,
    ) -> Result<OpOutcome, ServiceError> {
        let started = Instant::now();
        let deadline = started + self.config.wait;
        let listening = self.finished.listening();
        let mut pause = if listening { POLL_LISTENING } else { POLL_FAST };
        let mut read = read_first;
        loop {
            if read {
                if let Some(row) = self.db.operation(&op.id).await? {
                    if let Some(outcome) = row.outcome {
                        return Ok(outcome);
                    }
                }
            }
            read = true;
            if Instant::now() >= deadline {
                // It goes on: 202 with the operation to poll (a retry with
                // the same Idempotency-Key waits for it again).
                return Err(ServiceError::Accepted {
                    operation: op.id,
                    kind: op.kind,
                    sandbox: op.sandbox,
                    pod: op.pod,
                });
            }
            // Woken by the outcome's notification, else read again after
            // `pause`. Without notifications most commands finish within
            // the first period: polled every POLL_FAST (a primary-key
            // read) so that the answer waits at most that long for it;
            // then less and less often.
            // Never past the deadline (a wait of 1 ms answers 202 for a
            // command that takes longer, however soon it is woken).
            let left = deadline.saturating_duration_since(Instant::now());
            let _ = tokio::time::timeout(pause.min(left), waiting.notified()).await;
            if started.elapsed() >= POLL_FAST_FOR {
                pause = (pause * 2).min(Duration::from_millis(100));
            }
        }
    }
}
