//! The system calls behind `resumed` (clock, entropy, hostname, identity,
//! identity page) as a [`SystemOps`] trait, so that tests run the whole hook
//! against [`FakeOps`] without touching the host's clock or hostname.
//! Also the read-only facts behind `info`.

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, FileExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use torpor_sync::Locked;

/// Guest-physical address of the VMM's identity page (reserved in e820).
/// Must match `torpor_probe::abi::IDENTITY_PAGE_ADDR`.
pub const IDENTITY_PAGE_ADDR: u64 = 0x9e000;
/// The page's first 8 bytes.
pub const IDENTITY_MAGIC: &[u8; 8] = b"TORPORID";
/// Bytes in use: magic, generation (+8), seed (+16, 32 bytes), clock (+48).
pub const IDENTITY_LEN: usize = 56;
/// Default identity file written by `resumed`.
pub const DEFAULT_IDENTITY_FILE: &str = "/run/torpor/identity";
/// `_IOW('R', 0x03, int[2])` from `<linux/random.h>`.
const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;

/// What the VMM writes into the identity page at boot and every restore.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdentityPage {
    /// 0 at cold boot, +1 on every restore.
    pub generation: u64,
    /// Fresh random bytes.
    pub seed: [u8; 32],
    /// Host wall clock at boot/restore, ns since the Unix epoch.
    pub wall_clock_ns: u64,
}

/// Why the identity page could not be used.
#[derive(Debug, thiserror::Error)]
pub enum IdentityPageError {
    /// Opening or reading the memory device failed.
    #[error("cannot read the identity page at {addr:#x} from {path}: {err}")]
    Io {
        /// The memory device (normally `/dev/mem`).
        path: String,
        /// Physical address.
        addr: u64,
        /// The error.
        err: io::Error,
    },
    /// The bytes do not start with `TORPORID`.
    #[error(
        "no identity page at {addr:#x} (magic {found:02x?}{hint}); the VMM must write it \
         and reserve it in e820"
    )]
    BadMagic {
        /// Physical address.
        addr: u64,
        /// The first 8 bytes found.
        found: [u8; 8],
        /// Extra hint for an all-zero read.
        hint: &'static str,
    },
}

impl IdentityPageError {
    /// The errno this maps to.
    pub fn errno(&self) -> i32 {
        match self {
            IdentityPageError::Io { err, .. } => err.raw_os_error().unwrap_or(libc::EIO),
            IdentityPageError::BadMagic { .. } => libc::ENODATA,
        }
    }
}

impl IdentityPage {
    /// Parses the first [`IDENTITY_LEN`] bytes of the page (`addr` only for
    /// the error message).
    pub fn parse(bytes: &[u8; IDENTITY_LEN], addr: u64) -> Result<Self, IdentityPageError> {
        let u64_at = |o: usize| u64::from_le_bytes(bytes[o..o + 8].try_into().expect("8 bytes"));
        if &bytes[..8] != IDENTITY_MAGIC {
            let zero = bytes.iter().all(|&b| b == 0);
            return Err(IdentityPageError::BadMagic {
                addr,
                found: bytes[..8].try_into().expect("8 bytes"),
                hint: if zero {
                    ", all zero: not written, or hidden by CONFIG_STRICT_DEVMEM"
                } else {
                    ""
                },
            });
        }
        Ok(IdentityPage {
            generation: u64_at(8),
            seed: bytes[16..48].try_into().expect("32 bytes"),
            wall_clock_ns: u64_at(48),
        })
    }

    /// The page's bytes (for tests and fake memory devices).
    pub fn to_bytes(&self) -> [u8; IDENTITY_LEN] {
        let mut b = [0u8; IDENTITY_LEN];
        b[..8].copy_from_slice(IDENTITY_MAGIC);
        b[8..16].copy_from_slice(&self.generation.to_le_bytes());
        b[16..48].copy_from_slice(&self.seed);
        b[48..56].copy_from_slice(&self.wall_clock_ns.to_le_bytes());
        b
    }
}

/// The side effects of `resumed`. Implementations must be thread-safe: one
/// agent serves several connections.
pub trait SystemOps: Send + Sync + std::fmt::Debug {
    /// `clock_settime(CLOCK_REALTIME)`.
    fn set_wall_clock(&self, ns_since_epoch: u64) -> io::Result<()>;
    /// Writes `seed` to `/dev/urandom` (mixed in, not credited).
    fn write_urandom(&self, seed: &[u8]) -> io::Result<()>;
    /// `ioctl(RNDADDENTROPY)` crediting `seed.len() * 8` bits.
    fn credit_entropy(&self, seed: &[u8]) -> io::Result<()>;
    /// Whether the agent runs as root (crediting entropy needs it).
    fn is_root(&self) -> bool;
    /// `sethostname`.
    fn set_hostname(&self, name: &str) -> io::Result<()>;
    /// Writes the identity file; returns its path.
    fn write_identity(&self, sandbox_id: &str) -> io::Result<PathBuf>;
    /// Reads the VMM's identity page.
    fn read_identity_page(&self) -> Result<IdentityPage, IdentityPageError>;
    /// Sends a gratuitous ARP for every IPv4 address of every interface
    /// that is up (not loopback); returns them as `interface address`.
    fn announce_network(&self) -> io::Result<Vec<String>>;
    /// 1.5: mounts the NFS export `source` at `target` (created with its
    /// parents when missing) with the kernel's text `options`; a `target`
    /// that already has `source` mounted is left as it is.
    fn mount_nfs(&self, source: &str, target: &Path, options: &str) -> io::Result<()>;
}

/// The real system calls.
#[derive(Debug, Clone)]
pub struct RealOps {
    /// Where `write_identity` writes.
    pub identity_file: PathBuf,
    /// The physical-memory device the identity page is read from.
    pub mem_device: PathBuf,
    /// The identity page's physical address (an offset into `mem_device`).
    pub identity_page_addr: u64,
}

impl Default for RealOps {
    fn default() -> Self {
        RealOps {
            identity_file: PathBuf::from(DEFAULT_IDENTITY_FILE),
            mem_device: PathBuf::from("/dev/mem"),
            identity_page_addr: IDENTITY_PAGE_ADDR,
        }
    }
}

fn cvt(rc: libc::c_int) -> io::Result<()> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

impl SystemOps for RealOps {
    fn set_wall_clock(&self, ns: u64) -> io::Result<()> {
        let ts = libc::timespec {
            tv_sec: (ns / 1_000_000_000) as libc::time_t,
            tv_nsec: (ns % 1_000_000_000) as libc::c_long,
        };
        // SAFETY: `ts` is a valid timespec for the duration of the call.
        cvt(unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) })
    }

    fn write_urandom(&self, seed: &[u8]) -> io::Result<()> {
        OpenOptions::new()
            .write(true)
            .open("/dev/urandom")?
            .write_all(seed)
    }

    fn credit_entropy(&self, seed: &[u8]) -> io::Result<()> {
        // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
        let words = seed.len().div_ceil(4);
        let mut info = vec![0u32; 2 + words];
        info[0] = (seed.len() * 8) as u32;
        info[1] = seed.len() as u32;
        // SAFETY: `info` has room for 2 + words u32s; we fill seed.len()
        // bytes after the two header ints.
        unsafe {
            std::ptr::copy_nonoverlapping(
                seed.as_ptr(),
                info.as_mut_ptr().add(2).cast::<u8>(),
                seed.len(),
            );
        }
        let f = OpenOptions::new().write(true).open("/dev/urandom")?;
        // SAFETY: RNDADDENTROPY reads a rand_pool_info of the declared size.
        cvt(unsafe { libc::ioctl(f.as_raw_fd(), RNDADDENTROPY as _, info.as_ptr()) })
    }

    fn is_root(&self) -> bool {
        // SAFETY: geteuid cannot fail.
        unsafe { libc::geteuid() == 0 }
    }

    fn set_hostname(&self, name: &str) -> io::Result<()> {
        // SAFETY: the pointer and length describe `name`'s bytes.
        cvt(unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) })
    }

    fn write_identity(&self, sandbox_id: &str) -> io::Result<PathBuf> {
        write_atomically(&self.identity_file, format!("{sandbox_id}\n").as_bytes())?;
        Ok(self.identity_file.clone())
    }

    fn read_identity_page(&self) -> Result<IdentityPage, IdentityPageError> {
        let addr = self.identity_page_addr;
        let io_err = |err| IdentityPageError::Io {
            path: self.mem_device.display().to_string(),
            addr,
            err,
        };
        let f = File::open(&self.mem_device).map_err(io_err)?;
        let mut buf = [0u8; IDENTITY_LEN];
        f.read_exact_at(&mut buf, addr).map_err(io_err)?;
        IdentityPage::parse(&buf, addr)
    }

    fn announce_network(&self) -> io::Result<Vec<String>> {
        let mut done = Vec::new();
        for a in crate::announce::ipv4_addresses()? {
            crate::announce::send(&a)?;
            done.push(format!("{} {}", a.interface, a.ip));
        }
        Ok(done)
    }

    fn mount_nfs(&self, source: &str, target: &Path, options: &str) -> io::Result<()> {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")?;
        if nfs_mounted(&mountinfo, source, target) {
            return Ok(());
        }
        std::fs::create_dir_all(target)?;
        let c = |s: &[u8]| {
            std::ffi::CString::new(s).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
        };
        let (src, dst) = (c(source.as_bytes())?, c(target.as_os_str().as_bytes())?);
        let (fstype, data) = (c(b"nfs")?, c(options.as_bytes())?);
        // SAFETY: every pointer is a NUL-terminated string alive for the call.
        cvt(unsafe {
            libc::mount(
                src.as_ptr(),
                dst.as_ptr(),
                fstype.as_ptr(),
                0,
                data.as_ptr().cast(),
            )
        })
    }
}

/// Whether `/proc/self/mountinfo` text lists an NFS mount of `source` at
/// `target` (mount points are octal-escaped there).
pub fn nfs_mounted(mountinfo: &str, source: &str, target: &Path) -> bool {
    let mut want = String::new();
    for ch in target.to_string_lossy().chars() {
        match ch {
            ' ' | '\t' | '\n' | '\\' => want.push_str(&format!("\\{:03o}", ch as u32)),
            c => want.push(c),
        }
    }
    mountinfo.lines().any(|line| {
        let (before, after) = line.split_once(" - ").unwrap_or((line, ""));
        let point = before.split(' ').nth(4);
        let mut after = after.split(' ');
        point == Some(want.as_str())
            && after.next().is_some_and(|t| t.starts_with("nfs"))
            && after.next() == Some(source)
    })
}

/// Writes `data` to a temporary sibling and renames it over `path`, creating
/// the parent directory (0o755) when missing.
pub fn write_atomically(path: &Path, data: &[u8]) -> io::Result<()> {
    if let Some(parent) = path.parent() {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(parent)?;
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let mut f = File::create(&tmp)?;
    f.write_all(data)?;
    f.sync_all()?;
    fs::rename(&tmp, path)
}

/// A call made on [`FakeOps`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FakeCall {
    /// `set_wall_clock(ns)`.
    SetWallClock(u64),
    /// `write_urandom(seed)`.
    WriteUrandom(Vec<u8>),
    /// `credit_entropy(seed)`.
    CreditEntropy(Vec<u8>),
    /// `set_hostname(name)`.
    SetHostname(String),
    /// `write_identity(id)`.
    WriteIdentity(String),
    /// `read_identity_page()`.
    ReadIdentityPage,
    /// `announce_network()`.
    AnnounceNetwork,
    /// `mount_nfs(source, target, options)`.
    MountNfs {
        /// The export.
        source: String,
        /// Where.
        target: PathBuf,
        /// The options.
        options: String,
    },
}

/// A [`SystemOps`] that changes nothing and records every call (tests, and
/// `torpor-agent --fake-system` on a development host).
#[derive(Debug, Default)]
pub struct FakeOps {
    root: bool,
    page: Option<IdentityPage>,
    failures: HashMap<&'static str, i32>,
    calls: Mutex<Vec<FakeCall>>,
}

impl FakeOps {
    /// Not root, no identity page (reads fail with ENOENT), nothing fails.
    pub fn new() -> FakeOps {
        FakeOps::default()
    }

    /// `is_root` answers `root`.
    pub fn root(mut self, root: bool) -> FakeOps {
        self.root = root;
        self
    }

    /// `read_identity_page` returns `page`.
    pub fn page(mut self, page: IdentityPage) -> FakeOps {
        self.page = Some(page);
        self
    }

    /// The call named like its [`FakeCall`] variant (e.g. `"SetHostname"`)
    /// fails with `errno` (after being recorded).
    pub fn failing(mut self, call: &'static str, errno: i32) -> FakeOps {
        self.failures.insert(call, errno);
        self
    }

    /// Every call so far, in order.
    pub fn calls(&self) -> Vec<FakeCall> {
        self.calls.locked().clone()
    }

    fn record(&self, call: FakeCall, name: &str) -> io::Result<()> {
        self.calls.locked().push(call);
        match self.failures.get(name) {
            Some(&errno) => Err(io::Error::from_raw_os_error(errno)),
            None => Ok(()),
        }
    }
}

impl SystemOps for FakeOps {
    fn set_wall_clock(&self, ns: u64) -> io::Result<()> {
        self.record(FakeCall::SetWallClock(ns), "SetWallClock")
    }
    fn write_urandom(&self, seed: &[u8]) -> io::Result<()> {
        self.record(FakeCall::WriteUrandom(seed.to_vec()), "WriteUrandom")
    }
    fn credit_entropy(&self, seed: &[u8]) -> io::Result<()> {
        self.record(FakeCall::CreditEntropy(seed.to_vec()), "CreditEntropy")
    }
    fn is_root(&self) -> bool {
        self.root
    }
    fn set_hostname(&self, name: &str) -> io::Result<()> {
        self.record(FakeCall::SetHostname(name.into()), "SetHostname")
    }
    fn write_identity(&self, id: &str) -> io::Result<PathBuf> {
        self.record(FakeCall::WriteIdentity(id.into()), "WriteIdentity")?;
        Ok(PathBuf::from("(fake)"))
    }
    fn read_identity_page(&self) -> Result<IdentityPage, IdentityPageError> {
        let res = self.record(FakeCall::ReadIdentityPage, "ReadIdentityPage");
        let err = |err| IdentityPageError::Io {
            path: "(fake /dev/mem)".into(),
            addr: IDENTITY_PAGE_ADDR,
            err,
        };
        res.map_err(err)?;
        self.page
            .ok_or_else(|| err(io::Error::from_raw_os_error(libc::ENOENT)))
    }
    fn announce_network(&self) -> io::Result<Vec<String>> {
        self.record(FakeCall::AnnounceNetwork, "AnnounceNetwork")?;
        Ok(vec!["eth0 172.16.0.2".into()])
    }
    fn mount_nfs(&self, source: &str, target: &Path, options: &str) -> io::Result<()> {
        let call = FakeCall::MountNfs {
            source: source.into(),
            target: target.into(),
            options: options.into(),
        };
        self.record(call, "MountNfs")
    }
}

/// The current hostname (`gethostname`, no NSS).
pub fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is writable for its length.
    if unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } != 0 {
        return String::new();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// `/proc/sys/kernel/random/boot_id`, trimmed; empty when unreadable.
pub fn boot_id() -> String {
    fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// Milliseconds since boot (`CLOCK_BOOTTIME`).
pub fn system_uptime_ms() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is writable.
    unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    ts.tv_sec as u64 * 1000 + ts.tv_nsec as u64 / 1_000_000
}

/// Kernel release (`uname -r`).
pub fn kernel_release() -> String {
    // SAFETY: utsname is plain data; uname fills it.
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: `u` is writable.
    if unsafe { libc::uname(&mut u) } != 0 {
        return String::new();
    }
    let bytes: Vec<u8> = u
        .release
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_nfs_mount_is_found_in_mountinfo_by_source_and_escaped_point() {
        let info = "22 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n\
            40 22 0:35 / /mnt/my\\040data rw,relatime - nfs 127.0.0.1:/data rw,vers=3\n\
            41 22 0:36 / /mnt/b rw shared:3 - nfs 127.0.0.1:/b rw\n";
        assert!(nfs_mounted(
            info,
            "127.0.0.1:/data",
            Path::new("/mnt/my data")
        ));
        assert!(nfs_mounted(info, "127.0.0.1:/b", Path::new("/mnt/b")));
        assert!(!nfs_mounted(info, "127.0.0.1:/other", Path::new("/mnt/b")));
        assert!(!nfs_mounted(info, "/dev/vda", Path::new("/")));
        assert!(!nfs_mounted(info, "127.0.0.1:/data", Path::new("/mnt/my")));
    }

    #[test]
    fn page_round_trip_and_bad_magic() {
        let page = IdentityPage {
            generation: 5,
            seed: [7; 32],
            wall_clock_ns: 1_700_000_000_123_456_789,
        };
        assert_eq!(IdentityPage::parse(&page.to_bytes(), 0).unwrap(), page);
        let err = IdentityPage::parse(&[0; IDENTITY_LEN], IDENTITY_PAGE_ADDR).unwrap_err();
        assert!(err.to_string().contains("STRICT_DEVMEM"), "{err}");
        assert_eq!(err.errno(), libc::ENODATA);
    }

    #[test]
    fn page_layout_matches_the_probe_abi() {
        use torpor_probe as abi;
        assert_eq!(IDENTITY_PAGE_ADDR, abi::IDENTITY_PAGE_ADDR);
        assert_eq!(IDENTITY_LEN, abi::IDENTITY_LEN);
        let page = torpor_probe::identity_page(9, &[3; 32], 42);
        let parsed = IdentityPage::parse(&page, 0).unwrap();
        assert_eq!(
            (parsed.generation, parsed.seed, parsed.wall_clock_ns),
            (9, [3; 32], 42)
        );
    }

    #[test]
    fn real_ops_read_the_page_from_a_memory_device_file() {
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path().to_path_buf();
        let mem = dir.join("mem");
        let page = IdentityPage {
            generation: 2,
            seed: [9; 32],
            wall_clock_ns: 77,
        };
        let f = File::create(&mem).unwrap();
        f.write_all_at(&page.to_bytes(), IDENTITY_PAGE_ADDR)
            .unwrap();
        let ops = RealOps {
            identity_file: dir.join("run/identity"),
            mem_device: mem,
            identity_page_addr: IDENTITY_PAGE_ADDR,
        };
        assert_eq!(ops.read_identity_page().unwrap(), page);
        assert_eq!(
            ops.write_identity("sbx-1").unwrap(),
            dir.join("run/identity")
        );
        assert_eq!(
            fs::read_to_string(dir.join("run/identity")).unwrap(),
            "sbx-1\n"
        );
        let missing = RealOps {
            mem_device: dir.join("nope"),
            ..ops
        };
        let err = missing.read_identity_page().unwrap_err();
        assert_eq!(err.errno(), libc::ENOENT);
    }

    /// Exercises the real RNDADDENTROPY encoding with bytes that are random
    /// already (read from /dev/urandom), so the host's pool loses nothing.
    /// Clock and hostname are never touched by tests.
    #[test]
    fn real_entropy_calls_with_random_bytes() {
        let ops = RealOps::default();
        let mut seed = [0u8; 32];
        use std::io::Read;
        File::open("/dev/urandom")
            .unwrap()
            .read_exact(&mut seed)
            .unwrap();
        ops.write_urandom(&seed).unwrap();
        match ops.credit_entropy(&seed[..31]) {
            Ok(()) => assert!(ops.is_root()),
            Err(e) => {
                assert!(!ops.is_root(), "as root RNDADDENTROPY must work: {e}");
                assert_eq!(e.raw_os_error(), Some(libc::EPERM));
            }
        }
    }

    #[test]
    fn info_facts() {
        assert!(!hostname().is_empty());
        assert!(system_uptime_ms() > 0);
        assert!(!kernel_release().is_empty());
    }
}
