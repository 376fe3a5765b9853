//! Waking the requests that wait for an operation's outcome as soon as it
//! is written, instead of each polling its row every few milliseconds.
//!
//! The database notifies [`CHANNEL`] with an operation's id when the
//! operation leaves `pending` (a trigger, [`NOTIFY_TRIGGER`], schema
//! version 15: whatever writes the end — a pod's result through
//! `Db::finish` on whichever replica consumed it, `expiry.rs`, a
//! checkpoint's — and delivered once its transaction commits). Every
//! replica keeps one PostgreSQL connection that `LISTEN`s on it
//! ([`listen`]) and wakes every one of its own waiters for that id
//! ([`Finished`]). A waiter still reads the row itself — first (unless it
//! registered before the operation was sent), and then whenever it is
//! woken or its fallback period passes — so a notification lost (the
//! listening connection down) costs latency, never an answer.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::Notify;
use tokio_postgres::{AsyncMessage, NoTls};
use torpor_sync::Locked;

/// The notification channel of written outcomes (the payload: the
/// operation's id).
pub const CHANNEL: &str = "torpor_op_finished";

/// Schema version 15: [`CHANNEL`] notified with an operation's id in the
/// transaction that ends it.
pub(super) const NOTIFY_TRIGGER: &str = "
    CREATE FUNCTION torpor_op_finished() RETURNS trigger LANGUAGE plpgsql AS $f$
    BEGIN
        PERFORM pg_notify('torpor_op_finished', NEW.id);
        RETURN NULL;
    END
    $f$;
    CREATE TRIGGER torpor_op_finished AFTER UPDATE OF status ON operations
        FOR EACH ROW WHEN (OLD.status = 'pending' AND NEW.status <> 'pending')
        EXECUTE FUNCTION torpor_op_finished()";

/// How long the listener waits before connecting again after its
/// connection failed or ended.
const RECONNECT: Duration = Duration::from_millis(500);

/// The operations this replica's requests wait for, each woken when its
/// outcome's notification arrives.
#[derive(Debug, Default)]
pub struct Finished {
    waiting: Mutex<HashMap<String, Arc<Signal>>>,
    /// Whether the listening connection is up (`LISTEN` done): waiters
    /// fall back to fast polling while it is not.
    listening: AtomicBool,
    /// Notifications that woke a waiter of this replica.
    woke: AtomicU64,
}

/// An operation's notification, shared by every request of this replica
/// that waits for it.
#[derive(Debug, Default)]
struct Signal {
    /// Set once the notification arrived (an operation ends once).
    arrived: AtomicBool,
    notify: Notify,
}

/// One request's wait for operation `op`: registered until dropped.
#[derive(Debug)]
pub struct Waiting<'a> {
    finished: &'a Finished,
    op: String,
    signal: Arc<Signal>,
    /// Whether a call already returned for the notification.
    seen: bool,
}

impl Waiting<'_> {
    /// Until the operation's notification arrives: at once if it arrived
    /// since the wait was registered and no call returned for it yet;
    /// never again after (an operation ends once).
    pub async fn notified(&mut self) {
        // Made before the flag is read: a wake in between reaches it.
        let notified = self.signal.notify.notified();
        if self.signal.arrived.load(Ordering::Acquire) {
            if !self.seen {
                self.seen = true;
                return;
            }
            return std::future::pending().await;
        }
        notified.await;
        self.seen = true;
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let mut waiting = self.finished.waiting.locked();
        // The last of its waiters (the map holds one more; waits are
        // made and ended under the lock).
        if Arc::strong_count(&self.signal) == 2
            && waiting
                .get(&self.op)
                .is_some_and(|n| Arc::ptr_eq(n, &self.signal))
        {
            waiting.remove(&self.op);
        }
    }
}

impl Finished {
    /// Registers a wait for `op`'s outcome (before its row is first read,
    /// so that a notification in between is kept).
    pub fn wait_for(&self, op: &str) -> Waiting<'_> {
        let signal = self
            .waiting
            .locked()
            .entry(op.to_string())
            .or_default()
            .clone();
        Waiting {
            finished: self,
            op: op.to_string(),
            signal,
            seen: false,
        }
    }

    /// Whether notifications arrive now.
    pub fn listening(&self) -> bool {
        self.listening.load(Ordering::Relaxed)
    }

    /// How many notifications woke a waiter here.
    pub fn woke(&self) -> u64 {
        self.woke.load(Ordering::Relaxed)
    }

    fn wake(&self, op: &str) {
        if let Some(s) = self.waiting.locked().get(op) {
            // Kept for a waiter between two reads (the flag), every
            // waiter of it woken.
            s.arrived.store(true, Ordering::Release);
            s.notify.notify_waiters();
            self.woke.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Keeps a connection to `url` listening on [`CHANNEL`] and wakes
/// `finished`'s waiters, connecting again after a failure, until the
/// process ends.
pub async fn listen(url: String, finished: Arc<Finished>) {
    loop {
        if let Err(e) = listen_once(&url, &finished).await {
            tracing::warn!(error = %e, "operation notifications: connecting again");
        }
        finished.listening.store(false, Ordering::Relaxed);
        tokio::time::sleep(RECONNECT).await;
    }
}

async fn listen_once(url: &str, finished: &Finished) -> Result<(), tokio_postgres::Error> {
    let (client, mut connection) = tokio_postgres::connect(url, NoTls).await?;
    // The connection's messages, notifications among them, are read here;
    // the client's one statement goes through the same connection.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let stream = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
    let driver = tokio::spawn(async move {
        futures_util::pin_mut!(stream);
        while let Some(message) = stream.next().await {
            if tx.send(message).is_err() {
                break;
            }
        }
    });
    let result = async {
        client.batch_execute(&format!("LISTEN {CHANNEL}")).await?;
        finished.listening.store(true, Ordering::Relaxed);
        while let Some(message) = rx.recv().await {
            match message? {
                AsyncMessage::Notification(n) if n.channel() == CHANNEL => {
                    finished.wake(n.payload())
                }
                _ => {}
            }
        }
        Ok(())
    }
    .await;
    driver.abort();
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_trigger_notifies_the_channel_listened_on() {
        assert!(NOTIFY_TRIGGER.contains(&format!("pg_notify('{CHANNEL}', NEW.id)")));
    }

    #[tokio::test]
    async fn a_wake_reaches_its_waiter_even_before_it_waits_and_ends_with_it() {
        let finished = Finished::default();
        let mut waiting = finished.wait_for("op_a");
        // Woken between two reads of its row: the permit is kept.
        finished.wake("op_a");
        finished.wake("op_other");
        tokio::time::timeout(Duration::from_secs(5), waiting.notified())
            .await
            .expect("the wake was kept");
        assert_eq!(finished.woke(), 1, "only op_a had a waiter");
        drop(waiting);
        assert!(finished.waiting.locked().is_empty());
        finished.wake("op_a");
        assert_eq!(finished.woke(), 1);
    }

    #[tokio::test]
    async fn every_waiter_of_one_operation_is_woken_and_the_last_ends_it() {
        let finished = Finished::default();
        let mut first = finished.wait_for("op_a");
        let mut second = finished.wait_for("op_a");
        let both = async {
            tokio::join!(first.notified(), second.notified());
        };
        let woken = async {
            tokio::task::yield_now().await;
            finished.wake("op_a");
        };
        tokio::time::timeout(Duration::from_secs(5), async { tokio::join!(both, woken) })
            .await
            .expect("both waiters were woken by the one notification");
        assert_eq!(finished.woke(), 1);
        drop(first);
        // The second still waits: its registration stays.
        assert_eq!(finished.waiting.locked().len(), 1);
        // A waiter woken once is not woken again (its next wait is its
        // fallback period's, not a busy loop).
        let again = tokio::time::timeout(Duration::from_millis(50), second.notified()).await;
        assert!(again.is_err(), "a notification wakes a waiter once");
        drop(second);
        let mut late = finished.wait_for("op_a");
        assert!(
            tokio::time::timeout(Duration::from_millis(50), late.notified())
                .await
                .is_err(),
            "a wait registered after the last one ended starts afresh"
        );
        drop(late);
        assert!(finished.waiting.locked().is_empty());
    }
}
