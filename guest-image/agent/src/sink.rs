//! The write half of a connection ([`Sink`]): every thread that replies on
//! it (the connection's own, `exec`'s, attaches') sends whole frames
//! through it, one at a time; it counts the connection's streams.

use crate::frame::encode_frame;
use crate::proto::{ErrorReply, Reply, ReplyBody};
use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use torpor_sync::Locked;

/// The write half of a connection, shared by every thread that replies.
pub struct Sink {
    writer: Mutex<Box<dyn Write + Send>>,
    max_frame: usize,
    broken: AtomicBool,
    /// Attaches (1.1) running on the connection.
    streams: AtomicUsize,
}

impl std::fmt::Debug for Sink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The writer is a `dyn Write`: not printable.
        f.debug_struct("Sink")
            .field("max_frame", &self.max_frame)
            .field("broken", &self.broken)
            .field("streams", &self.streams)
            .finish_non_exhaustive()
    }
}

/// Most attaches running at once on one connection.
pub const MAX_STREAMS: usize = 64;

/// Counts one stream on a [`Sink`] until dropped.
#[derive(Debug)]
pub struct StreamGuard(Arc<Sink>);

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.0.streams.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Sink {
    /// Wraps a writer; frames above `max_frame` are replaced by an error.
    pub fn new(writer: Box<dyn Write + Send>, max_frame: usize) -> Sink {
        Sink {
            writer: Mutex::new(writer),
            max_frame,
            broken: AtomicBool::new(false),
            streams: AtomicUsize::new(0),
        }
    }

    /// Counts a new stream, `None` past [`MAX_STREAMS`].
    pub fn enter_stream(self: &Arc<Self>) -> Option<StreamGuard> {
        self.streams
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < MAX_STREAMS).then_some(n + 1)
            })
            .ok()
            .map(|_| StreamGuard(Arc::clone(self)))
    }

    /// Streams (attaches) running on the connection now.
    pub fn streams(&self) -> usize {
        self.streams.load(Ordering::Acquire)
    }

    /// Sends one reply frame; `false` once the connection is gone.
    pub fn send(&self, id: Option<u64>, body: ReplyBody) -> bool {
        let frame = encode_frame(&Reply { id, body }, self.max_frame).or_else(|e| {
            let err = ErrorReply::new(libc::EMSGSIZE, format!("reply not sent: {e}"));
            encode_frame(
                &Reply {
                    id,
                    body: ReplyBody::Error(err),
                },
                self.max_frame,
            )
        });
        let Ok(frame) = frame else { return false };
        let mut w = self.writer.locked();
        if self.broken.load(Ordering::Relaxed) {
            return false;
        }
        let ok = w.write_all(&frame).and_then(|()| w.flush()).is_ok();
        if !ok {
            self.broken.store(true, Ordering::Relaxed);
        }
        ok
    }
}
