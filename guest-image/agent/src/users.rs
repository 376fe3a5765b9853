//! Users and groups from the guest's account database (`getpwnam_r` and
//! friends, which read `/etc/passwd` and `/etc/group`): who a spawned
//! process runs as, and the owner and group names `stat` reports.

use crate::proto::ErrorReply;
use std::ffi::{CStr, CString};
use std::path::PathBuf;

/// A resolved user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    /// Login name.
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    /// Home directory.
    pub home: PathBuf,
    /// Supplementary groups (the user's own `gid` included).
    pub groups: Vec<u32>,
}

/// Most supplementary groups taken for a user.
const MAX_GROUPS: usize = 256;
/// Buffer for one `getpw*_r`/`getgr*_r` answer (grown once on `ERANGE`).
const BUF: usize = 16 << 10;

/// Runs a reentrant lookup with a growing buffer; `None` when there is
/// no such entry.
fn lookup<T>(
    mut call: impl FnMut(&mut [libc::c_char], &mut *mut T) -> libc::c_int,
) -> Result<Option<Vec<libc::c_char>>, i32> {
    for size in [BUF, BUF * 16] {
        let mut buf = vec![0 as libc::c_char; size];
        let mut found: *mut T = std::ptr::null_mut();
        let rc = call(&mut buf, &mut found);
        if rc == libc::ERANGE {
            continue;
        }
        if rc != 0 {
            return Err(rc);
        }
        return Ok((!found.is_null()).then_some(buf));
    }
    Err(libc::ERANGE)
}

fn text(p: *const libc::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: libc filled the entry with NUL-terminated strings that live
    // in the buffer the caller still holds.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// The user named `name`: `ENOENT` when there is none.
pub fn by_name(name: &str) -> Result<User, ErrorReply> {
    let bad = || ErrorReply::new(libc::EINVAL, format!("bad user name {name:?}"));
    if name.is_empty() || name.len() > 256 {
        return Err(bad());
    }
    let cname = CString::new(name).map_err(|_| bad())?;
    // SAFETY: an all-zero passwd is a valid value for getpwnam_r to fill.
    let mut pw: libc::passwd = unsafe { std::mem::zeroed() };
    let found = lookup(|buf, out| {
        // SAFETY: every pointer is valid for the call; buf's length is given.
        unsafe { libc::getpwnam_r(cname.as_ptr(), &mut pw, buf.as_mut_ptr(), buf.len(), out) }
    })
    .map_err(|errno| ErrorReply::new(errno, format!("looking up user {name:?}")))?;
    if found.is_none() {
        return Err(ErrorReply::new(
            libc::ENOENT,
            format!("no user {name:?} in this guest"),
        ));
    }
    let (uid, gid) = (pw.pw_uid, pw.pw_gid);
    let home = PathBuf::from(text(pw.pw_dir));
    let mut groups = vec![0 as libc::gid_t; MAX_GROUPS];
    let mut n = MAX_GROUPS as libc::c_int;
    // SAFETY: groups has room for n entries; getgrouplist writes at most n.
    let rc = unsafe { libc::getgrouplist(cname.as_ptr(), gid, groups.as_mut_ptr(), &mut n) };
    groups.truncate(if rc < 0 {
        MAX_GROUPS
    } else {
        n.max(0) as usize
    });
    if !groups.contains(&gid) {
        groups.push(gid);
    }
    Ok(User {
        name: name.to_string(),
        uid,
        gid,
        home,
        groups,
    })
}

/// The login name of `uid`, if it has one.
pub fn user_name(uid: u32) -> Option<String> {
    // SAFETY: as in `by_name`.
    let mut pw: libc::passwd = unsafe { std::mem::zeroed() };
    let found = lookup(|buf, out| {
        // SAFETY: every pointer is valid for the call.
        unsafe { libc::getpwuid_r(uid, &mut pw, buf.as_mut_ptr(), buf.len(), out) }
    })
    .ok()??;
    let name = text(pw.pw_name);
    drop(found);
    Some(name)
}

/// The name of group `gid`, if it has one.
pub fn group_name(gid: u32) -> Option<String> {
    // SAFETY: an all-zero group is a valid value for getgrgid_r to fill.
    let mut gr: libc::group = unsafe { std::mem::zeroed() };
    let found = lookup(|buf, out| {
        // SAFETY: every pointer is valid for the call.
        unsafe { libc::getgrgid_r(gid, &mut gr, buf.as_mut_ptr(), buf.len(), out) }
    })
    .ok()??;
    let name = text(gr.gr_name);
    drop(found);
    Some(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_resolves_both_ways() {
        let root = by_name("root").unwrap();
        assert_eq!((root.uid, root.gid), (0, 0));
        assert_eq!(user_name(0).as_deref(), Some("root"));
        assert!(group_name(0).is_some());
        assert_eq!(by_name("no-such-user-torpor").unwrap_err().code, "ENOENT");
        assert_eq!(by_name("a\0b").unwrap_err().code, "EINVAL");
    }
}
