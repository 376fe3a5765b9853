//! E2B's `volumeMounts` served to guests over NFSv3, the way E2B does it.
//!
//! A tenant's volume is a host directory (`DATA_DIR/volumes/ID/content/`,
//! `torpor_gate::volumes`). A sandbox that mounts volumes has its guest
//! kernel's NFS client mount `127.0.0.1:/NAME`; the guest agent relays each
//! guest TCP connection to port 2049 over vsock, and the VMM turns it into
//! a connection on the unix socket `<vsock uds path>_2049`. This module is
//! the pod's end of that socket: [`VolumeServer::serve`] answers NFSv3 and
//! MOUNT v3 (both on the one connection: the client mounts with
//! `mountport=2049,mountproto=tcp`) on it for one sandbox's
//! [`VolumeExport`]s.
//!
//! # How it is served
//!
//! The protocol (RPC record marking, XDR, MOUNT and NFS procedures) is the
//! `nfs3_server` crate's, over our filesystem (`fs.rs`: resolution and
//! reads; `change.rs`: writes and names; `nfs.rs`: the crate's traits).
//! That crate listens on TCP only, so a [`VolumeServer`] owns one thread in a network
//! namespace of its own (only `lo`, up), running a current-thread tokio
//! runtime: each served sandbox has an NFS listener on `127.0.0.1:0` there,
//! unreachable from the host's namespace, and the runtime accepts on the
//! sandbox's unix socket and pipes each connection to that listener. File
//! system calls run on the runtime's blocking threads.
//!
//! # What a sandbox sees
//!
//! - **The tree.** A virtual read-only root `/` lists exactly the sandbox's
//!   volumes by name; `MOUNT /NAME` answers the volume's root (an unknown
//!   name: `MNT3ERR_NOENT`). Nothing else of the host is reachable: every
//!   object is opened from the volume root's descriptor with
//!   `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`
//!   ([`crate::images::open_beneath`]), one name at a time for LOOKUP.
//!   Symbolic links are made and read back (READLINK) as text, never
//!   followed by the server (the guest's client resolves them in the
//!   guest). `..` of a volume's root is that root. Names with `/` or NUL
//!   are refused (`NFS3ERR_ACCES`, as knfsd), `.` and `..` cannot be made
//!   (`NFS3ERR_EXIST`), longer than 255 bytes is `NFS3ERR_NAMETOOLONG`.
//! - **Handles.** A handle is the server's generation (the crate's), a tag
//!   random per [`VolumeServer::serve`], the volume's index and the host
//!   inode. A handle of another sandbox (another tag) is `NFS3ERR_STALE`;
//!   so is one whose inode this export has not handed out (a table of
//!   (volume, inode) → path, filled by LOOKUP, READDIR(PLUS), CREATE,
//!   MKDIR and SYMLINK), and one whose path now holds another inode.
//!   Paths are relative to the volume's root, so an id never resolves into
//!   another volume. The table holds one entry per object the client has
//!   seen (a path and two integers); past 2^20 entries an arbitrary one is
//!   forgotten and its handle turns stale (the client looks it up again).
//!   Handles do not survive the [`VolumeHandle`]: a sandbox served again
//!   (after a restore, or a pod restart) must mount again.
//! - **Ownership.** Files are the pod's user's on the host. Every object
//!   is reported as uid and gid 1000 (the guest's `user`, whom E2B's SDK
//!   writes as); SETATTR of uid or gid is accepted and ignored, so `chown`
//!   (and `tar` or `cp -a` as root) does not fail. ACCESS is answered by
//!   `nfs3_server` itself with every right asked (the crate has no hook
//!   for it), so the guest's `user` and root both read and write; the
//!   server then refuses a change of names in a directory whose owner
//!   bits lack write or search (`NFS3ERR_ACCES`), and reads and writes
//!   file data the way knfsd does for a file's owner (whatever its mode,
//!   so a file made read-only by the open that created it can still be
//!   written through it).
//! - **Operations.** GETATTR, SETATTR (mode, size, times; a symbolic
//!   link takes none: `NFS3ERR_NOTSUPP`), LOOKUP, ACCESS, READ, WRITE (at
//!   its offset, all of it or an error; `FILE_SYNC` and `DATA_SYNC` synced
//!   before the answer), CREATE (UNCHECKED and GUARDED; EXCLUSIVE keeps the
//!   verifier in the file's times, as knfsd), MKDIR (mode 0755: the crate
//!   drops the client's), REMOVE and RMDIR, RENAME (within one volume;
//!   across volumes `NFS3ERR_XDEV`), READDIR and READDIRPLUS (names
//!   sorted, the cookie an index into them), SYMLINK, READLINK, COMMIT,
//!   FSSTAT, FSINFO, PATHCONF. LINK and MKNOD are refused by the crate
//!   (`PROC_UNAVAIL`).
//! - **Size limit.** What a guest writes counts against the volume's
//!   limit (`--volume-max-mib`), in one count per volume shared with the
//!   content API ([`usage`]): a WRITE or SETATTR that would grow the
//!   volume's files past it is refused whole with `NFS3ERR_DQUOT` (the
//!   guest's `write`, `fsync` or `close` fails with `EDQUOT`); REMOVE, a
//!   shrinking SETATTR and a RENAME over a file free their bytes.
//! - **Not here yet.** FSSTAT
//!   answers the crate's fixed figures (1 TiB free), not the host's. The
//!   content API's files being written (`.torpor-tmp.*`) show in listings
//!   until renamed.

mod change;
mod fs;
mod nfs;
mod relay;
mod serve;
#[cfg(test)]
mod tests;
pub mod usage;

use std::path::PathBuf;

pub use relay::{
    both_ways, greeting, read_greeting, Duplex, RelayHandle, VolumesRelay, MAX_GREETING,
};
pub use serve::{VolumeHandle, VolumeServer};

/// One volume of a sandbox: the name it is mounted by (`127.0.0.1:/NAME`)
/// and its content directory on this host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeExport {
    /// `[a-zA-Z0-9_-]{1,128}`, unique among one sandbox's exports.
    pub name: String,
    /// The volume's content directory (`DATA_DIR/volumes/ID/content/`).
    pub dir: PathBuf,
    /// The most bytes its files may hold ([`usage::Usage`], shared with
    /// the content API's count of the same directory).
    pub limit: u64,
}

/// Why a volume server or one sandbox's export could not start.
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    /// An export's name is not `[a-zA-Z0-9_-]{1,128}`.
    #[error("bad volume name {0:?}: [a-zA-Z0-9_-]{{1,128}} only")]
    BadName(String),
    /// Two exports of one sandbox have the same name.
    #[error("volume name {0:?} exported twice")]
    DuplicateName(String),
    /// An export's directory could not be opened as a directory.
    #[error("volume {name}: cannot open {}: {source}", dir.display())]
    OpenVolume {
        /// The export's name.
        name: String,
        /// Its directory.
        dir: PathBuf,
        /// What opening it said.
        source: std::io::Error,
    },
    /// The server's private network namespace could not be made (it takes
    /// `CAP_SYS_ADMIN`) or its loopback brought up.
    #[error("volume server namespace: {0}")]
    Namespace(std::io::Error),
    /// The server's thread or runtime could not start.
    #[error("volume server runtime: {0}")]
    Runtime(std::io::Error),
    /// The unix socket could not be replaced, bound or made private.
    #[error("volume socket {}: {source}", path.display())]
    Socket {
        /// The socket's path.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
    /// The sandbox's NFS listener could not be bound in the namespace.
    #[error("volume NFS listener: {0}")]
    Listener(std::io::Error),
    /// No random bytes for the export's handle tag.
    #[error("random bytes: {0}")]
    Random(std::io::Error),
    /// The server's thread has stopped.
    #[error("the volume server has stopped")]
    Stopped,
}

/// Whether `name` may name an export: `[a-zA-Z0-9_-]{1,128}`.
pub fn is_volume_name(name: &str) -> bool {
    (1..=128).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}
