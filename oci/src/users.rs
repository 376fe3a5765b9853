//! The account databases of an image as text (`/etc/passwd`, `/etc/group`,
//! `/etc/shadow`, `/etc/gshadow`): who is there, which ids are free, and
//! the lines that add the sandbox user, as `useradd --user-group` would
//! write them. No chroot and no tools of the image are run.

/// A `passwd` entry's fields that matter here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Account {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: String,
}

/// The entries of a `passwd` text (malformed lines are skipped).
pub(crate) fn accounts(passwd: &str) -> Vec<Account> {
    passwd
        .lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split(':').collect();
            if f.len() < 7 {
                return None;
            }
            Some(Account {
                name: f[0].to_string(),
                uid: f[2].parse().ok()?,
                gid: f[3].parse().ok()?,
                home: f[5].to_string(),
            })
        })
        .collect()
}

/// The groups of a `group` text: name and gid.
pub(crate) fn groups(group: &str) -> Vec<(String, u32)> {
    group
        .lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split(':').collect();
            if f.len() < 3 {
                return None;
            }
            Some((f[0].to_string(), f[2].parse().ok()?))
        })
        .collect()
}

/// `wanted` if no id in `taken` is it, else the next free one above.
pub(crate) fn free_id(wanted: u32, taken: &[u32]) -> u32 {
    (wanted..u32::MAX)
        .find(|id| !taken.contains(id))
        .unwrap_or(wanted)
}

/// `text` with `line` appended (and a newline before it if the text
/// lacks its last one).
pub(crate) fn append_line(text: &str, line: &str) -> String {
    let mut out = text.to_string();
    if !out.is_empty() && !out.ends_with('\n') {
        out.push('\n');
    }
    out.push_str(line);
    out.push('\n');
    out
}

/// The lines that add `name` (uid, gid, home, shell) to each database.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NewUser {
    pub passwd: String,
    pub group: String,
    pub shadow: String,
    pub gshadow: String,
}

impl NewUser {
    /// Lines for an account with a locked password (sudo is passwordless;
    /// `useradd` without `-p` locks it the same way).
    pub(crate) fn new(
        name: &str,
        uid: u32,
        gid: u32,
        home: &str,
        shell: &str,
        days: u64,
    ) -> NewUser {
        NewUser {
            passwd: format!("{name}:x:{uid}:{gid}::{home}:{shell}"),
            group: format!("{name}:x:{gid}:"),
            shadow: format!("{name}:!:{days}:0:99999:7:::"),
            gshadow: format!("{name}:!::"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_ids_and_new_lines() {
        let passwd =
            "root:x:0:0:root:/root:/bin/bash\nnode:x:1000:1000::/home/node:/bin/sh\nbad line\n";
        let a = accounts(passwd);
        assert_eq!(a.len(), 2);
        assert_eq!(a[1].home, "/home/node");
        let uids: Vec<u32> = a.iter().map(|a| a.uid).collect();
        assert_eq!(free_id(1000, &uids), 1001);
        assert_eq!(free_id(1000, &[0]), 1000);
        assert_eq!(
            groups("root:x:0:\nuser:x:1000:\n")[1],
            ("user".into(), 1000)
        );
        let u = NewUser::new("user", 1000, 1000, "/home/user", "/bin/bash", 19000);
        assert_eq!(u.passwd, "user:x:1000:1000::/home/user:/bin/bash");
        assert_eq!(u.shadow, "user:!:19000:0:99999:7:::");
        assert_eq!(append_line("a:x", "b"), "a:x\nb\n");
        assert_eq!(append_line("", "b"), "b\n");
    }
}
