//! One connection to a guest's agent under a request's overall deadline,
//! and the liveness check of a long call: a guest that stops answering
//! fails the call within about two check periods, not at its deadline.

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

/// Asks whether the guest still answers (a new connection greeted by
/// its agent); `Err` says why not.
pub type Check = Box<dyn FnMut() -> Result<(), String> + Send>;

/// Failed checks in a row, with nothing read between them, that fail the
/// read. One is not enough: a guest under QEMU/TCG on a loaded host can
/// stall past the vsock's connect deadline (10 s) and then go on (CI 43:
/// an NFS-heavy exec in the nested host lost its guest's answer to one
/// check and was failed though its command was running).
pub const FAILED_CHECKS: u32 = 2;

/// The connection to one guest's agent under the request's overall
/// deadline: each read or write waits at most for what is left of it, so
/// a guest that dribbles bytes or never answers fails the request on time.
///
/// With a liveness check ([`GuestStream::check_liveness`]), a read that has
/// waited `every` with nothing arriving asks the guest, on a connection of
/// its own, whether it still answers. A silent command (a `sleep`, a long
/// build) passes the check and the read goes on; a guest that stopped (a
/// wedged kernel, a starved vCPU) fails [`FAILED_CHECKS`] checks in a row,
/// and the read fails with `ConnectionAborted` instead of waiting out an
/// exec's whole timeout.
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
        let mut failed = 0;
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
                Err(e) if is_timeout(&e) && left.is_none_or(|left| left > wait) => match check() {
                    Ok(()) => failed = 0,
                    Err(why) => {
                        failed += 1;
                        if failed >= FAILED_CHECKS {
                            return Err(io::Error::new(
                                io::ErrorKind::ConnectionAborted,
                                format!("the guest stopped answering ({why})"),
                            ));
                        }
                    }
                },
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;

    /// A stream whose peer writes `after` from now, checked every 100 ms
    /// by `answers` (the n-th check's answer).
    fn read_with(
        after: Duration,
        answers: impl Fn(u32) -> bool + Send + 'static,
    ) -> (io::Result<usize>, u32) {
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        let writer = std::thread::spawn(move || {
            std::thread::sleep(after);
            let _ = theirs.write_all(b"x");
            theirs
        });
        let mut stream = GuestStream::new(ours, Some(Instant::now() + Duration::from_secs(10)));
        let checks = Arc::new(AtomicU32::new(0));
        let n = Arc::clone(&checks);
        stream.check_liveness(
            Duration::from_millis(100),
            Box::new(move || {
                let i = n.fetch_add(1, Ordering::SeqCst);
                if answers(i) {
                    Ok(())
                } else {
                    Err(format!("check {i} unanswered"))
                }
            }),
        );
        let mut buf = [0u8; 1];
        let got = stream.read(&mut buf);
        drop(writer.join());
        (got, checks.load(Ordering::SeqCst))
    }

    /// One check the guest misses (a stall under TCG) between answered
    /// ones does not fail the read; the data arrives.
    #[test]
    fn one_missed_check_between_answered_ones_is_not_a_stopped_guest() {
        let (got, checks) = read_with(Duration::from_millis(650), |i| i % 2 == 0);
        assert_eq!(got.unwrap(), 1);
        assert!(checks >= 2, "{checks} checks: the second (missed) one ran");
    }

    /// Checks missed in a row fail the read at the second, before the
    /// data (3 s away) or the deadline could come.
    #[test]
    fn missed_checks_in_a_row_fail_the_read() {
        let (got, checks) = read_with(Duration::from_secs(3), |_| false);
        let e = got.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionAborted, "{e}");
        assert!(e.to_string().contains("check 1 unanswered"), "{e}");
        assert_eq!(checks, FAILED_CHECKS);
    }
}
