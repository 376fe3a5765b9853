//! A tap device opened through `/dev/net/tun` with `IFF_TAP | IFF_NO_PI |
//! IFF_VNET_HDR`: every frame read or written starts with a 12-byte
//! `virtio_net_hdr_v1`, which is also what the guest puts before its
//! frames, so offload metadata (checksum start/offset, GSO type and size)
//! passes through unchanged.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use torpor_sync::Locked;
use torpor_vmm_api::launch::MAX_IFNAME;

/// `virtio_net_hdr_v1` (virtio 1.2, 5.1.6): what the tap and the guest
/// exchange before every frame once VIRTIO_F_VERSION_1 is negotiated.
pub const VNET_HDR_LEN: usize = 12;

/// Errors opening or configuring a tap.
#[derive(Debug, thiserror::Error)]
pub enum TapError {
    #[error("`{0}` is not a usable interface name")]
    Name(String),
    #[error("cannot open /dev/net/tun: {0}")]
    OpenTun(std::io::Error),
    #[error("cannot attach to tap `{name}` (TUNSETIFF): {source}")]
    SetIff {
        name: String,
        source: std::io::Error,
    },
    #[error("cannot enter network namespace {path}: {source}")]
    Netns {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("tap `{name}`: {what} failed: {source}")]
    Ioctl {
        name: String,
        what: &'static str,
        source: std::io::Error,
    },
}

/// An open tap; the interface goes away with it unless it is persistent.
#[derive(Debug)]
pub struct Tap {
    file: File,
    name: String,
}

/// The tap a jailed VMM opened as root, before it dropped its rights
/// ([`Tap::preopen`]): attaching to a tap the pod made needs
/// CAP_NET_ADMIN, and the jail has no `/dev/net/tun`.
static PREOPENED: std::sync::Mutex<Option<Tap>> = std::sync::Mutex::new(None);

fn ifreq_for(name: &str, flags: libc::c_short) -> libc::ifreq {
    // SAFETY: ifreq is plain old data (a name array and a union of plain
    // integers, arrays and raw pointers); all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, &src) in req.ifr_name.iter_mut().zip(name.as_bytes()) {
        *dst = src as libc::c_char;
    }
    req.ifr_ifru.ifru_flags = flags;
    req
}

impl Tap {
    /// `open` in network namespace `netns` (a namespace file), from a
    /// short-lived thread that joins it: the tap belongs there, the
    /// descriptor works from any thread, the process stays where it is.
    pub fn open_in(name: &str, netns: Option<&Path>) -> Result<Self, TapError> {
        if let Some(tap) = Self::take_preopened(name) {
            return Ok(tap);
        }
        let Some(path) = netns else {
            return Self::open(name);
        };
        let fail = |source| TapError::Netns {
            path: path.to_path_buf(),
            source,
        };
        let ns = std::fs::File::open(path).map_err(fail)?;
        std::thread::scope(|s| {
            s.spawn(|| {
                // SAFETY: setns on a namespace descriptor we hold; it
                // changes only this thread's network namespace, and the
                // thread ends right after opening the tap.
                if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                    return Err(fail(std::io::Error::last_os_error()));
                }
                Self::open(name)
            })
            .join()
            .unwrap_or_else(|_| Err(fail(std::io::Error::other("the tap thread panicked"))))
        })
    }

    /// Opens tap `name` in this thread's network namespace now and keeps
    /// it for the device ([`Tap::open_in`] of that name takes it): for a
    /// VMM about to drop its rights.
    pub fn preopen(name: &str) -> Result<(), TapError> {
        let tap = Self::open(name)?;
        *PREOPENED.locked() = Some(tap);
        Ok(())
    }

    fn take_preopened(name: &str) -> Option<Self> {
        let mut slot = PREOPENED.locked();
        if slot.as_ref().is_some_and(|t| t.name == name) {
            slot.take()
        } else {
            None
        }
    }

    /// Attaches to (or creates) tap `name` in this thread's network
    /// namespace, non-blocking, with 12-byte virtio-net headers.
    pub fn open(name: &str) -> Result<Self, TapError> {
        if name.is_empty() || name.len() > MAX_IFNAME || name.contains('\0') {
            return Err(TapError::Name(name.to_string()));
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open("/dev/net/tun")
            .map_err(TapError::OpenTun)?;
        let flags = (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as libc::c_short;
        let mut req = ifreq_for(name, flags);
        // SAFETY: TUNSETIFF reads and writes one `struct ifreq`; `req` is
        // one, alive for the call, and `file` is an open tun descriptor.
        let rc = unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETIFF, &mut req) };
        if rc < 0 {
            return Err(TapError::SetIff {
                name: name.to_string(),
                source: std::io::Error::last_os_error(),
            });
        }
        let tap = Self {
            file,
            name: name.to_string(),
        };
        let hdr_len = VNET_HDR_LEN as libc::c_int;
        // SAFETY: TUNSETVNETHDRSZ reads one int through the pointer, which
        // points at `hdr_len`, alive for the call.
        let rc = unsafe { libc::ioctl(tap.fd(), libc::TUNSETVNETHDRSZ, &hdr_len) };
        tap.check(rc, "TUNSETVNETHDRSZ")?;
        tap.set_offload(0)?;
        Ok(tap)
    }

    fn check(&self, rc: libc::c_int, what: &'static str) -> Result<(), TapError> {
        if rc < 0 {
            return Err(TapError::Ioctl {
                name: self.name.clone(),
                what,
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(())
    }

    /// Which offloads the reader (the guest) takes: `TUN_F_*` bits. The
    /// tap then hands over frames with partial checksums or of GSO size.
    pub fn set_offload(&self, tun_flags: libc::c_uint) -> Result<(), TapError> {
        // SAFETY: TUNSETOFFLOAD takes its argument by value (an unsigned
        // long of TUN_F_* bits); no memory is passed.
        let rc = unsafe {
            libc::ioctl(
                self.fd(),
                libc::TUNSETOFFLOAD,
                libc::c_ulong::from(tun_flags),
            )
        };
        self.check(rc, "TUNSETOFFLOAD")
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    /// Reads one frame (header included); `WouldBlock` when none waits.
    pub fn read(&self, buf: &mut [u8]) -> std::io::Result<usize> {
        (&self.file).read(buf)
    }

    /// Writes one frame (header included) whole.
    pub fn write(&self, frame: &[u8]) -> std::io::Result<usize> {
        (&self.file).write(frame)
    }
}

impl AsRawFd for Tap {
    fn as_raw_fd(&self) -> RawFd {
        self.fd()
    }
}
