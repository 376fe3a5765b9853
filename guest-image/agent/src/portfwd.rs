//! `connect` (1.3): a connection of the agent protocol becomes a byte
//! pipe to a TCP port on the guest's loopback, so that the host reaches a
//! server in the guest (a web app, the code interpreter) without any
//! network device: the host's proxy speaks HTTP over the pipe.
//!
//! The port is tried on 127.0.0.1, then on ::1 (servers that bind
//! `localhost` to the IPv6 loopback only). Once `connected` is sent no
//! more frames flow on the connection: bytes from the host go to the
//! server and the server's to the host. The host ending its side shuts the
//! server's write side (a request body's end); the server ending its side
//! ends the pipe.

use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpStream};
use std::time::Duration;

use crate::proto::ErrorReply;

/// Longest the agent waits for the guest's own TCP handshake.
const CONNECT_LIMIT: Duration = Duration::from_secs(5);

/// A connection to `port` on the guest's loopback, or the error to answer
/// (`ECONNREFUSED` when nothing listens on either loopback address).
pub fn dial(port: u16) -> Result<TcpStream, ErrorReply> {
    if port == 0 {
        return Err(ErrorReply::new(libc::EINVAL, "port 0"));
    }
    let v4 = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let first = match TcpStream::connect_timeout(&v4, CONNECT_LIMIT) {
        Ok(s) => return Ok(ready(s)),
        Err(e) => e,
    };
    let v6 = SocketAddr::from((Ipv6Addr::LOCALHOST, port));
    match TcpStream::connect_timeout(&v6, CONNECT_LIMIT) {
        Ok(s) => Ok(ready(s)),
        // The IPv4 answer says more (IPv6 may be off in the guest).
        Err(_) => Err(ErrorReply::io(&format!("127.0.0.1:{port}"), &first)),
    }
}

fn ready(s: TcpStream) -> TcpStream {
    let _ = s.set_nodelay(true);
    s
}

/// The two ends of a pipe: the host's connection (its reading half, its
/// writing half, how to shut it) and the guest server's.
pub struct Ends<R, W> {
    /// Bytes from the host (what the frame reader had buffered comes
    /// first).
    pub from_host: R,
    /// Bytes to the host.
    pub to_host: W,
    /// Shuts the host's connection down both ways.
    pub close_host: Box<dyn FnOnce() + Send>,
}

impl<R, W> std::fmt::Debug for Ends<R, W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ends").finish_non_exhaustive()
    }
}

/// Splices `ends` and `server` until the server ends its side (or either
/// fails); then both connections are shut.
pub fn splice<R, W>(ends: Ends<R, W>, server: TcpStream) -> io::Result<()>
where
    R: Read + Send + 'static,
    W: Write,
{
    let Ends {
        mut from_host,
        mut to_host,
        close_host,
    } = ends;
    let mut upstream = server.try_clone()?;
    let up = std::thread::Builder::new()
        .name("portfwd".into())
        .spawn(move || {
            let _ = io::copy(&mut from_host, &mut upstream);
            // The host is done sending: the server sees the end of its
            // input and still answers.
            let _ = upstream.shutdown(Shutdown::Write);
        })?;
    let mut server_reader = server.try_clone()?;
    let down = io::copy(&mut server_reader, &mut to_host).and_then(|_| to_host.flush());
    // The server is done (or a side failed): end both, which also ends
    // the host-to-server copy.
    let _ = server.shutdown(Shutdown::Both);
    close_host();
    let _ = up.join();
    down
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::os::unix::net::UnixStream;

    /// A loopback port nothing listens on, held (bound, not listening)
    /// while the returned descriptor lives: a port freed instead could be
    /// taken by a test running beside (CI saw `dial` connect).
    fn closed_port() -> (std::os::fd::OwnedFd, u16) {
        use std::os::fd::FromRawFd;
        // SAFETY: socket takes integers; the descriptor is owned below.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
        assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        // SAFETY: a descriptor the kernel just returned, owned by nobody else.
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
        // SAFETY: sockaddr_in is plain integers, valid all zero.
        let mut addr: libc::sockaddr_in = unsafe { std::mem::zeroed() };
        addr.sin_family = libc::AF_INET as libc::sa_family_t;
        addr.sin_addr.s_addr = u32::from(std::net::Ipv4Addr::LOCALHOST).to_be();
        let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        use std::os::fd::AsRawFd;
        // SAFETY: `addr` is a sockaddr_in of `len` bytes, alive for both
        // calls; getsockname writes at most `len` bytes into it.
        unsafe {
            let p = (&mut addr as *mut libc::sockaddr_in).cast::<libc::sockaddr>();
            assert_eq!(libc::bind(fd.as_raw_fd(), p, len), 0);
            assert_eq!(libc::getsockname(fd.as_raw_fd(), p, &mut len), 0);
        }
        (fd, u16::from_be(addr.sin_port))
    }

    #[test]
    fn a_closed_port_is_refused_with_its_errno() {
        let (_held, port) = closed_port();
        let e = dial(port).unwrap_err();
        assert_eq!(e.code, "ECONNREFUSED", "{e}");
        assert_eq!(dial(0).unwrap_err().code, "EINVAL");
    }

    #[test]
    fn bytes_flow_both_ways_and_the_host_end_half_closes() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut got = Vec::new();
            s.read_to_end(&mut got).unwrap();
            s.write_all(&got.iter().rev().copied().collect::<Vec<_>>())
                .unwrap();
        });
        let guest = dial(port).unwrap();
        let (mut host, agent) = UnixStream::pair().unwrap();
        let (reader, writer, closer) = (
            agent.try_clone().unwrap(),
            agent.try_clone().unwrap(),
            agent,
        );
        let pipe = std::thread::spawn(move || {
            let ends = Ends {
                from_host: io::Cursor::new(b"ab".to_vec()).chain(reader),
                to_host: writer,
                close_host: Box::new(move || drop(closer.shutdown(Shutdown::Both))),
            };
            splice(ends, guest)
        });
        host.write_all(b"cd").unwrap();
        host.shutdown(Shutdown::Write).unwrap();
        let mut back = Vec::new();
        host.read_to_end(&mut back).unwrap();
        assert_eq!(back, b"dcba");
        pipe.join().unwrap().unwrap();
        server.join().unwrap();
    }
}
