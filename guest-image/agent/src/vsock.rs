//! AF_VSOCK stream sockets through libc (std has none). The agent listens
//! on `VMADDR_CID_ANY` and a port; the host reaches it through the VMM.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// `VMADDR_CID_LOCAL`: the loopback CID (tests, with `vsock_loopback`).
pub const VMADDR_CID_LOCAL: u32 = 1;

fn cvt(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

fn sockaddr(cid: u32, port: u32) -> libc::sockaddr_vm {
    // SAFETY: sockaddr_vm is plain data; all-zero is valid.
    let mut addr: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
    addr.svm_family = libc::AF_VSOCK as libc::sa_family_t;
    addr.svm_cid = cid;
    addr.svm_port = port;
    addr
}

fn socket() -> io::Result<OwnedFd> {
    // SAFETY: plain syscall; the fd is owned right away.
    let fd =
        cvt(unsafe { libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) })?;
    // SAFETY: `fd` is a fresh descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

const ADDR_LEN: libc::socklen_t = std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t;

/// A listening vsock socket.
#[derive(Debug)]
pub struct VsockListener {
    fd: OwnedFd,
}

impl VsockListener {
    /// `socket(AF_VSOCK)`, `bind(VMADDR_CID_ANY, port)`, `listen`.
    pub fn bind(port: u32) -> io::Result<VsockListener> {
        let fd = socket()?;
        let addr = sockaddr(libc::VMADDR_CID_ANY, port);
        // SAFETY: `addr` is a valid sockaddr_vm of ADDR_LEN bytes.
        cvt(unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&addr as *const libc::sockaddr_vm).cast(),
                ADDR_LEN,
            )
        })?;
        // SAFETY: plain syscall on our fd.
        cvt(unsafe { libc::listen(fd.as_raw_fd(), 128) })?;
        Ok(VsockListener { fd })
    }

    /// Waits for a connection.
    pub fn accept(&self) -> io::Result<VsockStream> {
        // SAFETY: null address pointers are allowed; the fd is owned below.
        let fd = cvt(unsafe {
            libc::accept4(
                self.fd.as_raw_fd(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                libc::SOCK_CLOEXEC,
            )
        })?;
        // SAFETY: `fd` is a fresh descriptor nobody else owns.
        Ok(VsockStream::from_fd(unsafe { OwnedFd::from_raw_fd(fd) }))
    }
}

/// A connected vsock socket (read/write through the plain fd syscalls).
#[derive(Debug)]
pub struct VsockStream {
    file: File,
}

impl VsockStream {
    fn from_fd(fd: OwnedFd) -> VsockStream {
        VsockStream {
            file: File::from(fd),
        }
    }

    /// Connects to `cid:port` (host-side tests over the loopback transport).
    pub fn connect(cid: u32, port: u32) -> io::Result<VsockStream> {
        let fd = socket()?;
        let addr = sockaddr(cid, port);
        // SAFETY: `addr` is a valid sockaddr_vm of ADDR_LEN bytes.
        cvt(unsafe {
            libc::connect(
                fd.as_raw_fd(),
                (&addr as *const libc::sockaddr_vm).cast(),
                ADDR_LEN,
            )
        })?;
        Ok(VsockStream::from_fd(fd))
    }

    /// Another handle on the same connection.
    pub fn try_clone(&self) -> io::Result<VsockStream> {
        Ok(VsockStream {
            file: self.file.try_clone()?,
        })
    }

    /// `shutdown(SHUT_RDWR)`: wakes readers and fails writers on every handle.
    pub fn shutdown(&self) {
        // SAFETY: plain syscall on our fd.
        unsafe { libc::shutdown(self.file.as_raw_fd(), libc::SHUT_RDWR) };
    }
}

impl Read for VsockStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.file.read(buf)
    }
}

impl Write for VsockStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.file.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Binds a vsock port (`scripts/test` leaves this out where the host
    /// has no AF_VSOCK).
    #[test]
    fn vsock_bind() {
        let port = 40_000 + std::process::id() % 20_000;
        VsockListener::bind(port).expect("AF_VSOCK bind (scripts/test leaves this out without it)");
    }

    /// Talks through the kernel's vsock loopback transport (`scripts/test`
    /// leaves this out where `vsock_loopback` is not loaded).
    #[test]
    fn vsock_loopback() {
        let port = 40_000 + (std::process::id() + 1) % 20_000;
        let l = VsockListener::bind(port).expect("AF_VSOCK bind");
        let mut c = VsockStream::connect(VMADDR_CID_LOCAL, port)
            .expect("connect through vsock_loopback (scripts/test leaves this out without it)");
        let mut s = l.accept().unwrap();
        c.write_all(b"ping").unwrap();
        let mut buf = [0u8; 4];
        s.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"ping");
    }
}
