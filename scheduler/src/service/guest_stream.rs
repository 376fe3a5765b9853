//! One connection to a guest's agent under a request's overall deadline,
//! and the liveness check of a long call: a guest that stops answering
//! fails the call within about two check periods, not at its deadline.

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

/// Asks whether the guest still answers (a new connection greeted by
/// its agent); `Err` says why not.
pub type Check = Box<dyn FnMut() -> Result<(), String> + Send>;

/// The connection to one guest's agent under the request's overall
/// deadline: each read or write waits at most for what is left of it, so
/// a guest that dribbles bytes or never answers fails the request on time.
///
/// With a liveness check ([`GuestStream::check_liveness`]), a read that has
/// waited `every` with nothing arriving asks the guest, on a connection of
/// its own, whether it still answers. A silent command (a `sleep`, a long
/// build) passes the check and the read goes on; a guest that stopped (a
/// wedged kernel, a starved vCPU) fails it, and the read fails with
/// `ConnectionAborted` instead of waiting out an exec's whole timeout.
pub struct GuestStream {
    inner: UnixStream,
    deadline: Option<Instant>,
    /// Without a deadline: longest wait for any one read or write.
    pub(super) idle: Option<Duration>,
    liveness: Option<(Duration, Check)>,
}

impl std::fmt::Debug for GuestStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuestStream")
            .field("inner", &self.inner)
            .field("deadline", &self.deadline)
            .field("idle", &self.idle)
            .field("liveness", &self.liveness.as_ref().map(|(every, _)| every))
            .finish()
    }
}

impl GuestStream {
    pub fn new(inner: UnixStream, deadline: Option<Instant>) -> Self {
        GuestStream {
            inner,
            deadline,
            idle: None,
            liveness: None,
        }
    }

    /// From now on, reads check the guest's liveness with `check` after
    /// each `every` of silence.
    pub fn check_liveness(&mut self, every: Duration, check: Check) {
        self.liveness = Some((every.max(Duration::from_millis(1)), check));
    }

    /// The connection, its timeouts cleared.
    pub fn into_inner(self) -> io::Result<UnixStream> {
        self.inner.set_read_timeout(None)?;
        self.inner.set_write_timeout(None)?;
        Ok(self.inner)
    }

    /// When the current read or write must end: the deadline, else `idle`
    /// from `now`, else never.
    fn end(&self, now: Instant) -> Option<Instant> {
        self.deadline.or_else(|| self.idle.map(|idle| now + idle))
    }
}

/// What is left until `end` (`None`: no end), or the deadline's error.
fn left(end: Option<Instant>) -> io::Result<Option<Duration>> {
    let Some(end) = end else { return Ok(None) };
    let left = end.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(deadline_passed());
    }
    Ok(Some(left))
}

fn deadline_passed() -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, "the request's deadline passed")
}

/// Whether `e` is a socket timeout (it reads as `WouldBlock`).
fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// A socket timeout is the deadline.
fn timed_out(e: io::Error) -> io::Error {
    if is_timeout(&e) {
        deadline_passed()
    } else {
        e
    }
}

impl Read for GuestStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let end = self.end(Instant::now());
        loop {
            let left = left(end)?;
            let Some((every, check)) = self.liveness.as_mut() else {
                self.inner.set_read_timeout(left)?;
                return self.inner.read(buf).map_err(timed_out);
            };
            let wait = left.map_or(*every, |left| left.min(*every));
            self.inner.set_read_timeout(Some(wait))?;
            match self.inner.read(buf) {
                // A timed-out read took nothing from the stream, so asking
                // the guest and reading on keeps every frame whole.
                Err(e) if is_timeout(&e) && left.is_none_or(|left| left > wait) => {
                    check().map_err(|why| {
                        io::Error::new(
                            io::ErrorKind::ConnectionAborted,
                            format!("the guest stopped answering ({why})"),
                        )
                    })?;
                }
                other => return other.map_err(timed_out),
            }
        }
    }
}

impl Write for GuestStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let left = left(self.end(Instant::now()))?;
        self.inner.set_write_timeout(left)?;
        self.inner.write(buf).map_err(timed_out)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}
