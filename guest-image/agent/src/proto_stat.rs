//! A file's `stat` as the protocol carries it ([`FileStat`], [`FileKind`]):
//! below the messages that carry it (`proto`'s `stat` and `list_dir`,
//! `proto_procs`' watch events). Re-exported by [`crate::proto`].

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// File type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FileKind {
    /// Regular file.
    File,
    /// Directory.
    Dir,
    /// Symbolic link.
    Symlink,
    /// Device, FIFO, socket.
    Other,
}

/// A directory entry or `stat` result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileStat {
    /// Last path component (lossy UTF-8).
    pub name: String,
    /// File type.
    pub kind: FileKind,
    /// Size in bytes.
    pub size: u64,
    /// Permission bits (`st_mode & 0o7777`).
    pub mode: u32,
    /// Modification time, ns since the Unix epoch.
    pub mtime_ns: i64,
    /// Target of a symlink.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_target: Option<String>,
    /// 1.1: owner's uid.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    /// 1.1: group's gid.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gid: Option<u32>,
    /// 1.1: owner's name (`/etc/passwd`), absent when it has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// 1.1: group's name (`/etc/group`), absent when it has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// 1.2: the whole `st_mode` (file type bits too).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub st_mode: Option<u32>,
    /// 1.2: a symlink's target with every link resolved (`realpath`), when
    /// it resolves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resolved: Option<String>,
    /// 1.2: user metadata (`user.e2b.<key>` xattrs, of the target for a
    /// symlink), absent when none.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
}
