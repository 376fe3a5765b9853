//! The API tier's side of the pods' events: every replica pulls from the
//! one durable consumer [`wire::API_CONSUMER`]; each event is written to
//! PostgreSQL (up to [`AT_ONCE`] at a time, heartbeats one at a time)
//! and acked after that commit (a replica dying before the ack
//! leaves it for another, and writing one twice changes nothing). A
//! heartbeat of a pod back from being lost that lists sandboxes moved
//! away meanwhile (`moved.rs`) has each released on it.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use futures_util::StreamExt;
use tokio::sync::Semaphore;

use torpor_scheduler::model::{random_hex, PodId, SandboxId};
use torpor_scheduler::state::SandboxState;

use super::db::{pg, Db, NewOp};
use super::wire::{self, Event, Heartbeat, Operation, WorkItem};
use super::ClusterError;

/// Runs until the process ends, starting over after any failure.
pub async fn run(js: jetstream::Context, db: Arc<Db>) {
    loop {
        if let Err(e) = consume(&js, &db).await {
            tracing::warn!(error = %e, "pod events: starting over");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// How many events a replica writes at once. One at a time, every result
/// waited for the commit (and the ack) of the one before it.
const AT_ONCE: usize = 32;

async fn consume(js: &jetstream::Context, db: &Arc<Db>) -> Result<(), ClusterError> {
    let mut messages = wire::durable_messages(
        js,
        wire::EVENTS_STREAM,
        wire::API_CONSUMER,
        "torpor.events.*",
        wire::ACK_WAIT,
        AT_ONCE,
    )
    .await?;
    let room = Arc::new(Semaphore::new(AT_ONCE));
    // Heartbeats are written one at a time (a pod's come a second apart,
    // so the one before has long taken the lock; two replicas could always
    // write two of them out of order, and the next heartbeat replaces the
    // pod's row again); results are written each once by its operation's
    // condition, a sandbox's row by its generation, in any order.
    let heartbeats = Arc::new(tokio::sync::Mutex::new(()));
    while let Some(message) = messages.next().await {
        let message = message?;
        let permit = room.clone().acquire_owned().await.expect("never closed");
        let (js, db, heartbeats) = (js.clone(), db.clone(), heartbeats.clone());
        tokio::spawn(async move {
            settle(&js, &db, &heartbeats, &message).await;
            drop(permit);
        });
    }
    Ok(())
}

/// Writes `message`'s event and acks it; a failed write is delivered
/// again.
async fn settle(
    js: &jetstream::Context,
    db: &Db,
    heartbeats: &tokio::sync::Mutex<()>,
    message: &jetstream::Message,
) {
    match handle(js, db, heartbeats, &message.subject, &message.payload).await {
        Ok(()) => {}
        // Not the shape of an event, or from another pod than its
        // subject's: dropped (acked) with a log line.
        Err(Handled::Rejected(why)) => {
            tracing::warn!(subject = %message.subject, %why, "pod event rejected");
        }
        // Not acked: delivered again in a second (PostgreSQL may be
        // back by then).
        Err(Handled::Failed(e)) => {
            tracing::warn!(error = %e, "pod event not written; it comes again");
            let again = AckKind::Nak(Some(Duration::from_secs(1)));
            if let Err(e) = message.ack_with(again).await {
                tracing::warn!(error = %e, "pod event nak");
            }
            return;
        }
    }
    if let Err(e) = wire::ack_confirmed(message).await {
        tracing::warn!(error = %e, "pod event ack");
    }
}

enum Handled {
    Rejected(String),
    Failed(ClusterError),
}

async fn handle(
    js: &jetstream::Context,
    db: &Db,
    heartbeats: &tokio::sync::Mutex<()>,
    subject: &str,
    payload: &[u8],
) -> Result<(), Handled> {
    let event: Event = serde_json::from_slice(payload)
        .map_err(|e| Handled::Rejected(format!("not an event: {e}")))?;
    let pod = match &event {
        Event::Heartbeat { pod, .. } | Event::Result { pod, .. } => pod,
    };
    if !wire::valid_pod_id(pod.as_str()) || subject != wire::events_subject(pod) {
        return Err(Handled::Rejected(format!(
            "pod {pod} published on {subject}"
        )));
    }
    match &event {
        Event::Heartbeat { pod, heartbeat } => {
            heartbeat.check(pod).map_err(Handled::Rejected)?;
            let _in_order = heartbeats.lock().await;
            db.heartbeat(pod, heartbeat)
                .await
                .map_err(Handled::Failed)?;
            // A pod back from being lost still lists the sandboxes moved
            // away meanwhile (`moved.rs`): it is asked to release them.
            release_strays(js, db, pod, heartbeat).await
        }
        Event::Result {
            pod,
            operation,
            outcome,
        } => db.finish(pod, operation, outcome).await,
    }
    .map_err(Handled::Failed)
}

/// What `pod`'s heartbeat lists that is no longer its own, asked of it
/// once each (journaled with a key of the sandbox and the pod; the
/// result changes no row): a `release` of each sandbox whose row is
/// another pod's (moved away while `pod` was lost: hibernated, or running
/// from a durable checkpoint), and a `delete`
/// of each sandbox deleted while `pod` was lost (its row a tombstone of
/// `pod`'s, by a `forget` operation: `moved.rs`'s `delete_lost`), whose
/// VMM may still run there.
async fn release_strays(
    js: &jetstream::Context,
    db: &Db,
    pod: &PodId,
    hb: &Heartbeat,
) -> Result<(), ClusterError> {
    let live: Vec<String> = hb
        .sandboxes
        .iter()
        .filter(|s| s.state != SandboxState::Deleted)
        .map(|s| s.id.to_string())
        .collect();
    if live.is_empty() {
        return Ok(());
    }
    // What moved away (hibernated, or running from the durable checkpoint
    // it moved from) is released; what was deleted while the pod was
    // lost is deleted there. Not what this pod is adopting: between its
    // adopt's end and the replica's move of the row, the row still names
    // the pod it moves from (an adopt ended 30 s ago whose row never
    // moved, its replica gone, is a stray again).
    const MOVED: &str = "SELECT s.id, coalesce(s.tenant, '') FROM sandboxes s
        WHERE s.id = ANY($1) AND s.pod <> $2 AND s.state <> 'deleted'
            AND NOT EXISTS (SELECT 1 FROM operations o WHERE o.sandbox = s.id
                AND o.pod = $2 AND o.kind = 'adopt'
                AND (o.status = 'pending' OR o.finished_at > now() - interval '30 seconds'))";
    const FORGOTTEN: &str = "SELECT s.id, coalesce(s.tenant, '') FROM sandboxes s
        WHERE s.id = ANY($1) AND s.pod = $2 AND s.state = 'deleted'
            AND EXISTS (SELECT 1 FROM operations o WHERE o.sandbox = s.id
                AND o.pod = $2 AND o.kind = 'forget' AND o.status = 'done')";
    for (sql, kind, key) in [(MOVED, "release", "release"), (FORGOTTEN, "delete", "reap")] {
        let rows = db
            .client()
            .await?
            .query(sql, &[&live, &pod.as_str()])
            .await
            .map_err(pg)?;
        for row in rows {
            let sandbox = SandboxId::new(row.get::<_, String>(0));
            let tenant: String = row.get(1);
            tracing::warn!(%sandbox, %pod, kind, "a pod back from lost holds a sandbox no longer its own");
            let command = if kind == "release" {
                Operation::Release {
                    sandbox: sandbox.clone(),
                }
            } else {
                Operation::Delete {
                    sandbox: sandbox.clone(),
                }
            };
            let key = format!("{key}-{sandbox}-{pod}");
            ask_once(js, db, pod, &sandbox, &tenant, kind, &key, command).await?;
        }
    }
    Ok(())
}

/// How long after a stray's `release` or `delete` ended, with the pod
/// still listing the sandbox, it is asked again (a release that failed,
/// say on a sandbox still being recovered at the pod's start, is not
/// the last word).
const ASK_AGAIN_AFTER_S: f64 = 10.0;
/// How often a stray is asked in all: one a pod keeps refusing (say a copy
/// it runs, which no release takes) is left to an operator (the warnings
/// in the replicas' logs, the failed operations in the journal), the
/// journal not growing by an operation every [`ASK_AGAIN_AFTER_S`].
const ASK_AT_MOST: i64 = 10;

/// `command` on `sandbox`, journaled for `pod` under idempotency `key`
/// and sent to it, unless an operation of that key is pending or ended
/// less than [`ASK_AGAIN_AFTER_S`] ago: an older one gives up its key
/// (renamed `key#id`, kept in the journal) and the command is sent anew,
/// [`ASK_AT_MOST`] times in all.
#[allow(clippy::too_many_arguments)]
async fn ask_once(
    js: &jetstream::Context,
    db: &Db,
    pod: &PodId,
    sandbox: &SandboxId,
    tenant: &str,
    kind: &str,
    key: &str,
    command: Operation,
) -> Result<(), ClusterError> {
    let id = format!("op_{}", random_hex(12));
    let new = NewOp {
        id: &id,
        kind,
        sandbox: Some(sandbox),
        template: None,
        pod,
        tenant,
        idempotency_key: Some(key),
        deadlines: None,
    };
    let (mut op, mut fresh) = db.begin_operation(&new, None).await?;
    if !fresh && op.status != "pending" {
        // One replica renames the key (the row's condition), so one new
        // operation follows however many replicas saw the heartbeat.
        let renamed = db
            .client()
            .await?
            .execute(
                "UPDATE operations SET idempotency_key = idempotency_key || '#' || id
                 WHERE id = $1 AND status <> 'pending'
                   AND finished_at < now() - make_interval(secs => $2)
                   AND (SELECT count(*) FROM operations p WHERE p.tenant = operations.tenant
                        AND starts_with(p.idempotency_key, $3::text || '#')) < $4::bigint - 1",
                &[&op.id, &ASK_AGAIN_AFTER_S, &key, &ASK_AT_MOST],
            )
            .await
            .map_err(pg)?;
        if renamed == 1 {
            tracing::warn!(%sandbox, %pod, kind, previous = %op.id, status = %op.status,
                outcome = ?op.outcome, "asking a pod again to let go of a sandbox no longer its own");
            (op, fresh) = db.begin_operation(&new, None).await?;
        }
    }
    if !fresh {
        return Ok(());
    }
    let item = WorkItem {
        operation: op.id.clone(),
        command,
    };
    let headers = async_nats::HeaderMap::new();
    wire::publish_with(js, wire::work_subject(pod), Some(&op.id), headers, &item).await
}
