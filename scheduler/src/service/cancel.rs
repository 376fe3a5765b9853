//! Cancelling a guest request from another thread: the API cancels an
//! exec whose HTTP client went away ([`Cancel::on_drop`] in the handler;
//! axum drops the handler's future, or the streaming body, when the
//! connection closes). Cancelling shuts the request's connection to the
//! agent down: the agent sees its connection close and SIGKILLs the
//! process groups of the execs it ran on it (`torpor-agent`'s `Running`),
//! and the blocked read on the host side returns at once.

use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};

use torpor_sync::Locked;

#[derive(Debug, Default)]
struct State {
    cancelled: bool,
    /// The request's connection to the agent while it is open.
    stream: Option<UnixStream>,
}

/// A cancellation handle, shared by the request (which attaches its agent
/// connection) and whoever may cancel it. The default never cancels
/// unless [`Cancel::cancel`] is called.
#[derive(Debug, Clone, Default)]
pub struct Cancel(Arc<Mutex<State>>);

/// A request cancelled before it reached the agent.
#[derive(Debug, thiserror::Error)]
#[error("the request was cancelled")]
pub struct Cancelled;

impl Cancel {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.0.locked()
    }

    /// Cancels: the attached connection (if any) is shut down now, and a
    /// later [`Cancel::attach`] fails.
    pub fn cancel(&self) {
        let mut st = self.state();
        st.cancelled = true;
        if let Some(stream) = st.stream.take() {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }

    pub fn is_cancelled(&self) -> bool {
        self.state().cancelled
    }

    /// Attaches the request's agent connection (a clone of its socket);
    /// refused once cancelled.
    pub fn attach(&self, stream: &UnixStream) -> Result<(), Cancelled> {
        let mut st = self.state();
        if st.cancelled {
            return Err(Cancelled);
        }
        st.stream = stream.try_clone().ok();
        Ok(())
    }

    /// Forgets the attached connection (the request is over).
    pub fn detach(&self) {
        self.state().stream = None;
    }

    /// A guard that cancels when dropped, unless [`OnDrop::disarm`]ed.
    pub fn on_drop(&self) -> OnDrop {
        OnDrop(Some(self.clone()))
    }
}

/// Cancels its request when dropped (an HTTP handler's future or body
/// dropped because the client went away), unless disarmed first.
#[derive(Debug)]
pub struct OnDrop(Option<Cancel>);

impl OnDrop {
    /// The request ended on its own: nothing to cancel.
    pub fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for OnDrop {
    fn drop(&mut self) {
        if let Some(c) = self.0.take() {
            c.cancel();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    #[test]
    fn cancel_shuts_the_attached_stream_and_refuses_later_attaches() {
        let (a, _b) = UnixStream::pair().unwrap();
        let c = Cancel::default();
        c.attach(&a).unwrap();
        let reader = {
            let mut a = a.try_clone().unwrap();
            std::thread::spawn(move || a.read(&mut [0u8; 8]).unwrap())
        };
        drop(c.on_drop());
        assert_eq!(reader.join().unwrap(), 0, "the blocked read ends");
        assert!(c.is_cancelled());
        assert!(c.attach(&a).is_err());
        let d = Cancel::default();
        d.on_drop().disarm();
        assert!(!d.is_cancelled());
    }
}
