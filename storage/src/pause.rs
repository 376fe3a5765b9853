//! Pause points: an upload or a collection stopped at a named stage until
//! its [`PauseHandle`] resumes it, so a test can run the other side in
//! between (the races of `gc.rs`) without sleeping and hoping.

use tokio::sync::oneshot;

/// Where an upload can be paused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UploadStage {
    /// Every chunk is stored (or found stored); the lease does not name
    /// the manifest yet.
    ChunksStored,
    /// The lease names the manifest; the upload has not looked for
    /// collections yet.
    ManifestPending,
}

/// Where a collection can be paused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GcStage {
    /// It knows which chunks it will delete and has deleted none.
    Marked,
}

/// The paused side's end.
#[derive(Debug)]
pub(crate) struct Pause {
    reached: oneshot::Sender<()>,
    resume: oneshot::Receiver<()>,
}

impl Pause {
    /// Says the stage is reached and waits to be resumed (or for the
    /// handle to be dropped).
    pub(crate) async fn wait(self) {
        let _ = self.reached.send(());
        let _ = self.resume.await;
    }
}

/// The controlling side's end: wait for the stage, then resume.
#[derive(Debug)]
pub struct PauseHandle {
    reached: Option<oneshot::Receiver<()>>,
    resume: Option<oneshot::Sender<()>>,
}

impl PauseHandle {
    /// Waits until the paused side is at its stage (returns at once if it
    /// ended before it).
    pub async fn reached(&mut self) {
        if let Some(r) = self.reached.take() {
            let _ = r.await;
        }
    }

    /// Lets the paused side go on.
    pub fn resume(&mut self) {
        if let Some(r) = self.resume.take() {
            let _ = r.send(());
        }
    }
}

/// A pause and its handle.
pub(crate) fn pause() -> (Pause, PauseHandle) {
    let (reached_tx, reached_rx) = oneshot::channel();
    let (resume_tx, resume_rx) = oneshot::channel();
    (
        Pause {
            reached: reached_tx,
            resume: resume_rx,
        },
        PauseHandle {
            reached: Some(reached_rx),
            resume: Some(resume_tx),
        },
    )
}
