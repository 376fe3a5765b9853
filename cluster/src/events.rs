//! The API tier's side of the pods' events: every replica pulls from the
//! one durable consumer [`wire::API_CONSUMER`]; each event is written to
//! PostgreSQL and acked after that commit (a replica dying before the ack
//! leaves it for another, and writing one twice changes nothing).

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use futures_util::StreamExt;

use super::db::Db;
use super::wire::{self, Event};
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

async fn consume(js: &jetstream::Context, db: &Db) -> Result<(), ClusterError> {
    let mut messages = wire::durable_messages(
        js,
        wire::EVENTS_STREAM,
        wire::API_CONSUMER,
        "torpor.events.*",
        wire::ACK_WAIT,
        32,
    )
    .await?;
    while let Some(message) = messages.next().await {
        let message = message?;
        match handle(js, db, &message.subject, &message.payload).await {
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
                continue;
            }
        }
        if let Err(e) = wire::ack_confirmed(&message).await {
            tracing::warn!(error = %e, "pod event ack");
        }
    }
    Ok(())
}

enum Handled {
    Rejected(String),
    Failed(ClusterError),
}

async fn handle(
    js: &jetstream::Context,
    db: &Db,
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
            db.heartbeat(pod, heartbeat)
                .await
                .map_err(Handled::Failed)?;
            // A pod back from being lost still lists the sandboxes moved
            // away meanwhile (`moved.rs`): it is asked to release them.
            super::moved::release_strays(js, db, pod, heartbeat).await
        }
        Event::Result {
            pod,
            operation,
            outcome,
        } => db.finish(pod, operation, outcome).await,
    }
    .map_err(Handled::Failed)
}
