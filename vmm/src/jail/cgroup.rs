//! The VMM's cgroup, on cgroup v1 (one hierarchy per controller) or v2 (the
//! unified hierarchy): detection, creation, limits, joining, and the OOM
//! kill count its supervisor reads after the VMM died.

use std::path::{Path, PathBuf};

use torpor_vmm_api::jail::{CgroupSpec, CgroupVersion};

/// Controllers a jail limits.
const V1_CONTROLLERS: [&str; 3] = ["memory", "pids", "cpu"];

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error(
        "no usable cgroup hierarchy: neither a cgroup v2 mount with the memory and pids \
         controllers nor cgroup v1 memory and pids mounts were found in /proc/self/mounts"
    )]
    NoneUsable,
    #[error("cgroup {version:?} was asked for but this host has no usable one")]
    NotThisVersion { version: CgroupVersion },
    #[error("cannot read /proc/self/mounts: {0}")]
    Mounts(std::io::Error),
    #[error("cgroup: cannot write `{value}` to {path}: {source}")]
    Write {
        path: PathBuf,
        value: String,
        source: std::io::Error,
    },
    #[error("cgroup: cannot create {path}: {source}")]
    Create {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Where this host's cgroup hierarchies are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hierarchy {
    /// The unified hierarchy's mount point.
    V2(PathBuf),
    /// Each controller's mount point (memory, pids, and cpu when mounted).
    V1(Vec<(&'static str, PathBuf)>),
}

impl Hierarchy {
    pub fn version(&self) -> CgroupVersion {
        match self {
            Hierarchy::V2(_) => CgroupVersion::V2,
            Hierarchy::V1(_) => CgroupVersion::V1,
        }
    }
}

/// Finds the hierarchy to use: v2 when its root offers memory and pids
/// (a hybrid host's empty `unified` mount does not count), else v1.
pub fn detect(wanted: CgroupVersion) -> Result<Hierarchy, CgroupError> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").map_err(CgroupError::Mounts)?;
    let v2 = find_v2(&mounts);
    let v1 = find_v1(&mounts);
    match wanted {
        CgroupVersion::Auto => v2.or(v1).ok_or(CgroupError::NoneUsable),
        CgroupVersion::V2 => v2.ok_or(CgroupError::NotThisVersion { version: wanted }),
        CgroupVersion::V1 => v1.ok_or(CgroupError::NotThisVersion { version: wanted }),
    }
}

fn mount_lines(mounts: &str) -> impl Iterator<Item = (&str, &str, &str)> {
    mounts.lines().filter_map(|l| {
        let mut f = l.split_whitespace();
        let (_, dir, fstype, opts) = (f.next()?, f.next()?, f.next()?, f.next()?);
        Some((dir, fstype, opts))
    })
}

fn find_v2(mounts: &str) -> Option<Hierarchy> {
    mount_lines(mounts)
        .filter(|(_, fstype, _)| *fstype == "cgroup2")
        .map(|(dir, _, _)| PathBuf::from(dir))
        .find(|dir| {
            let controllers =
                std::fs::read_to_string(dir.join("cgroup.controllers")).unwrap_or_default();
            let has = |c: &str| controllers.split_whitespace().any(|x| x == c);
            has("memory") && has("pids")
        })
        .map(Hierarchy::V2)
}

fn find_v1(mounts: &str) -> Option<Hierarchy> {
    let found: Vec<(&'static str, PathBuf)> = V1_CONTROLLERS
        .iter()
        .filter_map(|&c| {
            mount_lines(mounts)
                .find(|(_, fstype, opts)| *fstype == "cgroup" && opts.split(',').any(|o| o == c))
                .map(|(dir, _, _)| (c, PathBuf::from(dir)))
        })
        .collect();
    let has = |c: &str| found.iter().any(|(n, _)| *n == c);
    (has("memory") && has("pids")).then_some(Hierarchy::V1(found))
}

/// A cgroup the VMM joined.
#[derive(Debug, Clone)]
pub struct Cgroup {
    pub hierarchy: Hierarchy,
    /// The cgroup's directory per controller (one for v2).
    pub dirs: Vec<PathBuf>,
    memory_dir: PathBuf,
}

fn write(path: &Path, value: &str) -> Result<(), CgroupError> {
    std::fs::write(path, value).map_err(|source| CgroupError::Write {
        path: path.to_path_buf(),
        value: value.to_string(),
        source,
    })
}

fn create(path: &Path) -> Result<(), CgroupError> {
    std::fs::create_dir_all(path).map_err(|source| CgroupError::Create {
        path: path.to_path_buf(),
        source,
    })
}

/// Makes the cgroup (or reuses the slot's) and sets its limits; the
/// jailed process joins it with [`Cgroup::join_self`].
pub fn create_limited(spec: &CgroupSpec) -> Result<Cgroup, CgroupError> {
    let hierarchy = detect(spec.version)?;
    match &hierarchy {
        Hierarchy::V2(root) => {
            let dir = root.join(&spec.name);
            enable_v2_controllers(root, &spec.name)?;
            create(&dir)?;
            if let Some(m) = spec.memory_max_bytes {
                write(&dir.join("memory.max"), &m.to_string())?;
                // The guest's memory must not go to swap behind the limit.
                let _ = std::fs::write(dir.join("memory.swap.max"), "0");
            }
            if let Some(p) = spec.pids_max {
                write(&dir.join("pids.max"), &p.to_string())?;
            }
            if let Some(q) = spec.cpu {
                write(
                    &dir.join("cpu.max"),
                    &format!("{} {}", q.quota_us, q.period_us),
                )?;
            }
            Ok(Cgroup {
                dirs: vec![dir.clone()],
                memory_dir: dir,
                hierarchy,
            })
        }
        Hierarchy::V1(mounts) => {
            let mut dirs = Vec::new();
            let mut memory_dir = PathBuf::new();
            for (controller, mount) in mounts {
                let dir = mount.join(&spec.name);
                create(&dir)?;
                match *controller {
                    "memory" => {
                        if let Some(m) = spec.memory_max_bytes {
                            write(&dir.join("memory.limit_in_bytes"), &m.to_string())?;
                        }
                        memory_dir = dir.clone();
                    }
                    "pids" => {
                        if let Some(p) = spec.pids_max {
                            write(&dir.join("pids.max"), &p.to_string())?;
                        }
                    }
                    _ => {
                        if let Some(q) = spec.cpu {
                            write(&dir.join("cpu.cfs_period_us"), &q.period_us.to_string())?;
                            write(&dir.join("cpu.cfs_quota_us"), &q.quota_us.to_string())?;
                        }
                    }
                }
                dirs.push(dir);
            }
            Ok(Cgroup {
                hierarchy,
                dirs,
                memory_dir,
            })
        }
    }
}

/// v2 hands controllers down: each ancestor of the cgroup enables them
/// for its children.
fn enable_v2_controllers(root: &Path, name: &str) -> Result<(), CgroupError> {
    let mut dir = root.to_path_buf();
    let parents: Vec<&str> = name.split('/').collect();
    for (i, part) in std::iter::once("")
        .chain(parents.iter().copied())
        .enumerate()
    {
        if i == parents.len() {
            break;
        }
        if !part.is_empty() {
            dir.push(part);
            create(&dir)?;
        }
        let offered = std::fs::read_to_string(dir.join("cgroup.controllers")).unwrap_or_default();
        let enable: Vec<String> = ["memory", "pids", "cpu"]
            .iter()
            .filter(|c| offered.split_whitespace().any(|o| o == **c))
            .map(|c| format!("+{c}"))
            .collect();
        write(&dir.join("cgroup.subtree_control"), &enable.join(" "))?;
    }
    Ok(())
}

impl Cgroup {
    /// Moves the calling process into the cgroup (`0`: the writer itself,
    /// whatever pid namespace it is in). The process must be
    /// single-threaded: on cgroup v1 its one thread is moved (`tasks`),
    /// which moves all of it, and the kernel then takes no global lock;
    /// moving a whole process (`cgroup.procs`) takes the write side of
    /// the threadgroup lock, which waits for an RCU grace period (7 ms on
    /// the development host, most of what the jail cost). v2 moves no
    /// thread alone out of its domain: `cgroup.procs` there.
    pub fn join_self(&self) -> Result<(), CgroupError> {
        let file = match self.hierarchy {
            Hierarchy::V1(_) => "tasks",
            Hierarchy::V2(_) => "cgroup.procs",
        };
        for d in &self.dirs {
            write(&d.join(file), "0")?;
        }
        Ok(())
    }

    /// OOM kills in this cgroup so far (v1 `memory.oom_control`, v2
    /// `memory.events`: `oom_kill N`).
    pub fn oom_kills(&self) -> u64 {
        let file = match self.hierarchy {
            Hierarchy::V2(_) => "memory.events",
            Hierarchy::V1(_) => "memory.oom_control",
        };
        std::fs::read_to_string(self.memory_dir.join(file))
            .ok()
            .and_then(|t| {
                t.lines()
                    .find_map(|l| l.strip_prefix("oom_kill "))
                    .and_then(|n| n.trim().parse().ok())
            })
            .unwrap_or(0)
    }

    /// Removes the cgroup's directories (once its processes are gone).
    pub fn remove(&self) {
        for d in &self.dirs {
            let _ = std::fs::remove_dir(d);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID: &str = "\
tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0
cgroup /sys/fs/cgroup/pids cgroup rw,relatime,pids 0 0
cgroup2 /nonexistent/unified cgroup2 rw,relatime 0 0
";

    #[test]
    fn v1_mounts_are_found_per_controller() {
        let Some(Hierarchy::V1(found)) = find_v1(HYBRID) else {
            panic!("no v1 found");
        };
        assert_eq!(found.len(), 3);
        assert!(found.contains(&("memory", PathBuf::from("/sys/fs/cgroup/memory"))));
        // A cgroup2 mount without controllers is not a v2 host.
        assert_eq!(find_v2(HYBRID), None);
        let no_pids = HYBRID.replace(",pids", ",x");
        assert_eq!(find_v1(&no_pids), None);
        let combined = "cgroup /c/cpu,cpuacct cgroup rw,cpu,cpuacct 0 0\n\
                        cgroup /c/memory cgroup rw,memory 0 0\ncgroup /c/pids cgroup rw,pids 0 0\n";
        let Some(Hierarchy::V1(found)) = find_v1(combined) else {
            panic!("no v1 found");
        };
        assert!(found.contains(&("cpu", PathBuf::from("/c/cpu,cpuacct"))));
    }
}
