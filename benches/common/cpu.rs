//! CPU time the whole machine spent over an interval (`/proc/stat`), for
//! benches that say where a throughput's time went, and by process.

use std::collections::{BTreeMap, HashMap};

/// CPU time spent over an interval, from `/proc/stat`'s `cpu` line.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuSpent {
    pub busy_ms: f64,
    pub idle_ms: f64,
    pub cpus: usize,
}

impl CpuSpent {
    /// The `cpu` line's (busy, idle) jiffies, as ms.
    pub fn now() -> Option<(f64, f64)> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let line = stat.lines().find(|l| l.starts_with("cpu "))?;
        let v: Vec<f64> = line
            .split_whitespace()
            .skip(1)
            .filter_map(|f| f.parse().ok())
            .collect();
        // user nice system idle iowait irq softirq steal (guest is in user).
        let at = |i: usize| v.get(i).copied().unwrap_or(0.0);
        // SAFETY: sysconf reads a constant.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        let ms = 1000.0 / hz.max(1.0);
        let busy = at(0) + at(1) + at(2) + at(5) + at(6) + at(7);
        Some((busy * ms, (at(3) + at(4)) * ms))
    }

    /// What was spent since `before` ([`CpuSpent::now`]).
    pub fn since(before: Option<(f64, f64)>) -> Option<Self> {
        let (b0, i0) = before?;
        let (b1, i1) = Self::now()?;
        Some(Self {
            busy_ms: b1 - b0,
            idle_ms: i1 - i0,
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        })
    }
}

/// A process as `/proc/<pid>/stat` shows it.
#[derive(Clone, Debug)]
pub struct Proc {
    pub ppid: u32,
    pub name: String,
    /// Its CPU time so far (utime + stime), ms.
    pub cpu_ms: f64,
}

/// Every process now, by pid.
pub fn processes() -> HashMap<u32, Proc> {
    // SAFETY: sysconf reads a constant.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let ms = 1000.0 / hz.max(1.0);
    let mut out = HashMap::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // pid (name) state ppid ...; the name may hold ')' and spaces.
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let rest: Vec<&str> = stat[close + 1..].split_whitespace().collect();
        // After the name: state(0) ppid(1) ... utime(11) stime(12).
        let at = |i: usize| rest.get(i).and_then(|v| v.parse::<f64>().ok());
        let Some(ppid) = at(1) else {
            continue;
        };
        out.insert(
            pid,
            Proc {
                ppid: ppid as u32,
                name: stat[open + 1..close].to_string(),
                cpu_ms: (at(11).unwrap_or(0.0) + at(12).unwrap_or(0.0)) * ms,
            },
        );
    }
    out
}

/// CPU time (ms) each process has used so far, by pid, with what it is
/// to a bench ([`role`]).
pub fn by_process() -> HashMap<u32, (String, f64)> {
    let procs = processes();
    procs
        .iter()
        .map(|(pid, p)| (*pid, (role(*pid, &procs), p.cpu_ms)))
        .collect()
}

/// What process `pid` is to a bench: the bench's own clients,
/// `torpor serve`, a cluster's replicas or pods, PostgreSQL, nats-server;
/// a process under a pod or `torpor serve` (a VMM, its jail) is one of the
/// VMMs; else other.
fn role(pid: u32, procs: &HashMap<u32, Proc>) -> String {
    let own = |pid: u32| -> Option<&'static str> {
        if pid == std::process::id() {
            return Some("the bench's clients");
        }
        let comm = &procs.get(&pid)?.name;
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let has = |a: &[u8]| cmdline.split(|b| *b == 0).any(|x| x == a);
        match comm.as_str() {
            "postgres" => Some("PostgreSQL"),
            "nats-server" => Some("nats-server"),
            "torpor" if has(b"pod") => Some("pods"),
            "torpor" if has(b"--cluster") => Some("replicas"),
            "torpor" if has(b"serve") => Some("torpor serve"),
            _ => None,
        }
    };
    if let Some(role) = own(pid) {
        return role.into();
    }
    // Up its parents to the first that has a role (at most 16).
    let mut at = pid;
    for _ in 0..16 {
        let Some(p) = procs.get(&at) else {
            break;
        };
        at = p.ppid;
        match own(at) {
            Some("pods" | "torpor serve") => return "VMMs".into(),
            Some(role) => return role.into(),
            None => {}
        }
    }
    "other".into()
}

/// CPU time (ms) used by role between two [`by_process`] readings: a
/// process seen only in `after` counts whole; one gone by then is not
/// counted (its last moments are lost).
pub fn spent_by_role(
    before: &HashMap<u32, (String, f64)>,
    after: &HashMap<u32, (String, f64)>,
) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for (pid, (role, now)) in after {
        let was = before.get(pid).map_or(0.0, |(_, t)| *t);
        *out.entry(role.clone()).or_insert(0.0) += (now - was).max(0.0);
    }
    out
}
