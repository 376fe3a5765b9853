//! `--flame DIR`: CPU profiles of the sequential creates and of the wakes,
//! drawn as flame graphs.
//!
//! While a configuration's create samples run, and again while its wake
//! samples run, `perf record` samples every CPU (`-a`, the `cpu-clock`
//! software event: a PVM guest has no hardware counters) with DWARF call
//! graphs (Rust builds keep no frame pointers: `--call-graph fp` ends most
//! stacks after a frame or two). It starts disabled and is enabled over
//! the bench's control FIFO only around each sample's request (the create's
//! POST to its 201, the wake's resume to its 200), so neither the deletes
//! between creates nor the hibernates between wakes are in the graph. Then
//! perf stops (SIGINT, waited for; also when the phase fails), and its
//! samples are kept for `torpor serve` and the processes it started (its
//! VMMs, followed through perf's fork events), each stack rooted at its
//! process's name (`torpor`, `torpor-vmm`). inferno folds them
//! (`DIR/NAME-create.folded`, `DIR/NAME-wake.folded`, NAME the column's
//! configuration) and draws them (`.svg` beside). The bench prints each
//! graph's path, its CPU time by process, its five functions with the most
//! self time, and the five of torpor's own functions with the most CPU in
//! them and in the library and kernel frames under them (kernel frames
//! alone rarely name the caller). Sampling slows what it samples: compare
//! timings without `--flame`.
//!
//! If perf is missing or refuses (not root with `perf_event_paranoid` > 0,
//! no PMU access) the bench says why and runs without flame graphs.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use inferno::collapse::perf::{Folder, Options as FoldOptions};
use inferno::collapse::Collapse;
use inferno::flamegraph::{self, Options as GraphOptions};

use super::Results;

/// The perf binary (from `PATH`).
const PERF: &str = "perf";
/// Samples per second per CPU: the requests are milliseconds long.
const FREQ: &str = "4999";
/// User stack copied per sample for DWARF unwinding (bytes).
const STACK: &str = "32768";
/// perf answers a control command (its first: once it has synthesized
/// the running processes) within this.
const ACK_LIMIT: Duration = Duration::from_secs(60);
/// perf exits within this after SIGINT, else SIGKILL.
const STOP_LIMIT: Duration = Duration::from_secs(60);
/// Functions listed per graph.
pub(super) const TOP: usize = 5;

/// Where the graphs go, and the file names used so far.
pub(super) struct Flame {
    dir: PathBuf,
    used: HashSet<String>,
    /// Why perf stopped being tried (it refused once).
    off: Option<String>,
}

impl Flame {
    /// Checks that perf can record every CPU with DWARF stacks (a short
    /// recording of `true`); why not, if it cannot.
    pub(super) fn new(dir: &Path) -> Result<Flame, String> {
        std::fs::create_dir_all(dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
        let data = dir.join(".probe.data");
        let out = record()
            .arg("-q")
            .arg("-o")
            .arg(&data)
            .args(["--", "true"])
            .stdin(Stdio::null())
            .output();
        let _ = std::fs::remove_file(&data);
        let out = out.map_err(|e| format!("{PERF}: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "perf record -a refused ({}): {}",
                out.status,
                tail(&String::from_utf8_lossy(&out.stderr), 3)
            ));
        }
        Ok(Flame {
            dir: dir.to_path_buf(),
            used: HashSet::new(),
            off: None,
        })
    }

    /// Starts perf (disabled) for `phase` of configuration `config`, whose
    /// `torpor serve` is `root`. A failure is noted in `r` and turns the
    /// graphs off; the profile then does nothing.
    pub(super) fn start(
        &mut self,
        root: u32,
        config: &str,
        phase: &str,
        r: &mut Results,
    ) -> Profile {
        if let Some(why) = &self.off {
            r.notes.push(format!(
                "no {phase} flame graph: perf failed before ({why})"
            ));
            return Profile(None);
        }
        let mut stem = format!("{}-{phase}", slug(config));
        for n in 2.. {
            if self.used.insert(stem.clone()) {
                break;
            }
            stem = format!("{}-{phase}-{n}", slug(config));
        }
        match Recording::start(&self.dir, &stem, root, phase, config) {
            Ok(rec) => Profile(Some(rec)),
            Err(e) => {
                r.notes.push(format!("no {phase} flame graph: {e}"));
                self.off = Some(e);
                Profile(None)
            }
        }
    }
}

/// A phase's profile: enabled around each sample's request; nothing
/// without perf.
pub(super) struct Profile(Option<Recording>);

impl Profile {
    /// A profile that does nothing (no `--flame`).
    pub(super) fn none() -> Profile {
        Profile(None)
    }

    /// Samples from here (until [`Profile::off`]).
    pub(super) fn on(&mut self) {
        self.command("enable");
    }

    /// No samples from here.
    pub(super) fn off(&mut self) {
        self.command("disable");
    }

    fn command(&mut self, cmd: &str) {
        // After a failure perf is not asked again (each try would wait).
        if let Some(rec) = self.0.as_mut().filter(|r| r.failed.is_none()) {
            if let Err(e) = rec.command(cmd) {
                rec.failed.get_or_insert(e);
            }
        }
    }

    /// Stops perf, folds and draws its samples: the graph's path and top
    /// functions in `r.flame`, or why not in `r.notes`.
    pub(super) fn finish(mut self, r: &mut Results) {
        let Some(mut rec) = self.0.take() else { return };
        let drawn = rec.stop().and_then(|()| rec.draw());
        rec.clean();
        match drawn {
            Ok(lines) => {
                for l in &lines {
                    eprintln!("api: flame {l}");
                }
                r.flame.extend(lines);
            }
            Err(e) => r.notes.push(format!("no {} flame graph: {e}", rec.phase)),
        }
    }
}

/// One `perf record`, its data and control FIFOs under the graphs'
/// directory; stopped on drop.
struct Recording {
    child: Option<Child>,
    dir: PathBuf,
    stem: String,
    phase: String,
    title: String,
    root: u32,
    /// Every process when the recording started, pid -> (ppid, name),
    /// from /proc: perf's events give the parents of processes forked
    /// while it records (enabled) only, and a wake or create restores
    /// into a standby shell forked before.
    before: HashMap<u32, (u32, String)>,
    /// Its control and acknowledgement FIFOs, once open.
    fifos: Option<(File, File)>,
    /// A control command that failed (the graph is still drawn).
    failed: Option<String>,
}

impl Recording {
    fn path(dir: &Path, stem: &str, ext: &str) -> PathBuf {
        dir.join(format!(".{stem}.{ext}"))
    }

    fn start(
        dir: &Path,
        stem: &str,
        root: u32,
        phase: &str,
        config: &str,
    ) -> Result<Recording, String> {
        let (ctl, ack) = (Self::path(dir, stem, "ctl"), Self::path(dir, stem, "ack"));
        for f in [&ctl, &ack] {
            let _ = std::fs::remove_file(f);
            mkfifo(f)?;
        }
        let log =
            File::create(Self::path(dir, stem, "log")).map_err(|e| format!("perf log: {e}"))?;
        let mut child = record()
            .args(["-F", FREQ])
            // Larger buffers than the default: DWARF samples are big.
            .args(["--mmap-pages", "1024"])
            // Disabled until the first `enable`.
            .args(["-D", "-1", "--control"])
            .arg(format!("fifo:{},{}", ctl.display(), ack.display()))
            .arg("-o")
            .arg(Self::path(dir, stem, "data"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| format!("perf log: {e}"))?)
            .stderr(log)
            .spawn()
            .map_err(|e| format!("spawn {PERF}: {e}"))?;
        let log = Self::path(dir, stem, "log");
        let opened = open_fifos(&mut child, &log, &ctl, &ack);
        let mut rec = Recording {
            child: Some(child),
            dir: dir.to_path_buf(),
            stem: stem.to_string(),
            phase: phase.to_string(),
            title: format!("{phase}: {config}"),
            root,
            before: processes(),
            fifos: None,
            failed: None,
        };
        // Answered once perf records (the running processes synthesized).
        let ready = opened.and_then(|f| {
            rec.fifos = Some(f);
            rec.command("ping")
        });
        if let Err(e) = ready {
            let _ = rec.stop();
            rec.clean();
            return Err(e);
        }
        Ok(rec)
    }

    /// One control command (`enable`, `disable`, `ping`), once perf
    /// acknowledged it.
    fn command(&mut self, cmd: &str) -> Result<(), String> {
        let log = Self::path(&self.dir, &self.stem, "log");
        let (Some(child), Some((ctl, ack))) = (self.child.as_mut(), self.fifos.as_mut()) else {
            return Err(format!("perf control {cmd}: perf is not running"));
        };
        ctl.write_all(format!("{cmd}\n").as_bytes())
            .map_err(|e| format!("perf control {cmd}: {e}"))?;
        let deadline = Instant::now() + ACK_LIMIT;
        let mut got = Vec::new();
        let mut buf = [0u8; 64];
        // perf writes "ack\n" and a NUL.
        while !got.windows(4).any(|w| w == b"ack\n") {
            match ack.read(&mut buf) {
                Ok(n) if n > 0 => got.extend_from_slice(&buf[..n]),
                // 0 (no writer yet) or EAGAIN (nothing yet).
                _ => {
                    alive(child, &log, deadline)?;
                    std::thread::sleep(Duration::from_micros(100));
                }
            }
        }
        Ok(())
    }

    /// SIGINT, waited for (SIGKILL after STOP_LIMIT).
    fn stop(&mut self) -> Result<(), String> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        // SAFETY: signals the perf this bench spawned (not yet reaped).
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) };
        let deadline = Instant::now() + STOP_LIMIT;
        while Instant::now() < deadline {
            match child.try_wait() {
                Ok(Some(_)) => return Ok(()),
                Ok(None) => std::thread::sleep(Duration::from_millis(20)),
                Err(e) => return Err(format!("wait for perf: {e}")),
            }
        }
        let _ = child.kill();
        let _ = child.wait();
        Err(format!(
            "perf record ignored SIGINT for {STOP_LIMIT:?}: killed"
        ))
    }

    /// Removes the FIFOs, the log and the data.
    fn clean(&self) {
        for ext in ["ctl", "ack", "log", "data", "data.old"] {
            let _ = std::fs::remove_file(Self::path(&self.dir, &self.stem, ext));
        }
    }

    /// Folds the samples of serve's process tree, writes the folded
    /// stacks and the SVG; the lines to print.
    fn draw(&self) -> Result<Vec<String>, String> {
        let data = Self::path(&self.dir, &self.stem, "data");
        let tasks = perf_script(&data, &["--show-task-events", "-F", "pid,tid"], None)?;
        let names = tree(&tasks, self.root, &self.before);
        if names.is_empty() {
            return Err(format!("perf saw no process of pid {}", self.root));
        }
        let pids: Vec<String> = names.keys().map(u32::to_string).collect();
        let script = perf_script(
            &data,
            &["-F", "comm,pid,tid,time,period,event,ip,sym,dso"],
            Some(&pids.join(",")),
        )?;
        let script = rename(&script, &names);
        let mut folded = Vec::new();
        let mut folder = Folder::from(FoldOptions::default());
        folder
            .collapse(script.as_bytes(), &mut folded)
            .map_err(|e| format!("fold: {e}"))?;
        let folded = String::from_utf8_lossy(&folded).into_owned();
        let stats = Stats::of(&folded);
        if stats.total == 0 {
            return Err("no samples of torpor serve or its VMMs".into());
        }
        let base = self.dir.join(&self.stem);
        let (folded_path, svg_path) = (base.with_extension("folded"), base.with_extension("svg"));
        std::fs::write(&folded_path, &folded)
            .map_err(|e| format!("write {}: {e}", folded_path.display()))?;
        let svg = File::create(&svg_path).map_err(|e| format!("{}: {e}", svg_path.display()))?;
        let cpu_ms = stats.total as f64 / 1e6;
        let mut opt = GraphOptions::default();
        opt.title = format!("{} (perf cpu-clock, {cpu_ms:.1} ms of CPU)", self.title);
        // perf script's period: cpu-clock counts nanoseconds.
        opt.count_name = "ns".into();
        flamegraph::from_lines(&mut opt, folded.lines(), std::io::BufWriter::new(svg))
            .map_err(|e| format!("draw {}: {e}", svg_path.display()))?;
        let pct = |n: u64| n as f64 * 100.0 / stats.total as f64;
        let procs: Vec<String> = (stats.procs.iter())
            .map(|(p, n)| format!("{p} {:.0}%", pct(*n)))
            .collect();
        let mut lines = vec![format!(
            "{}: {} ({cpu_ms:.1} ms of CPU over the requests: {}{})",
            self.title,
            svg_path.display(),
            procs.join(", "),
            self.failed
                .as_ref()
                .map(|e| format!("; {e}"))
                .unwrap_or_default()
        )];
        lines.push(format!("  top {TOP} by self time:"));
        for (f, n) in top(stats.leaf) {
            lines.push(format!("    {:>5.1}%  {f}", pct(n)));
        }
        lines.push(format!(
            "  top {TOP} torpor functions by self time, with the library and kernel frames \
             under them:"
        ));
        for (f, n) in top(stats.own) {
            lines.push(format!("    {:>5.1}%  {f}", pct(n)));
        }
        Ok(lines)
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        if self.child.is_some() {
            let _ = self.stop();
            self.clean();
        }
    }
}

/// Opens perf's FIFOs (control, acknowledgement) once it reads its
/// control FIFO.
fn open_fifos(
    child: &mut Child,
    log: &Path,
    ctl: &Path,
    ack: &Path,
) -> Result<(File, File), String> {
    let ack = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(ack)
        .map_err(|e| format!("open {}: {e}", ack.display()))?;
    let deadline = Instant::now() + ACK_LIMIT;
    loop {
        // Fails (ENXIO) until perf has it open for reading.
        let opened = OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(ctl);
        if let Ok(ctl) = opened {
            return Ok((ctl, ack));
        }
        alive(child, log, deadline)?;
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Err if perf exited (the end of its `log`) or `deadline` passed.
fn alive(child: &mut Child, log: &Path, deadline: Instant) -> Result<(), String> {
    if let Ok(Some(status)) = child.try_wait() {
        let log = std::fs::read_to_string(log).unwrap_or_default();
        return Err(format!("perf record exited ({status}): {}", tail(&log, 3)));
    }
    if Instant::now() > deadline {
        return Err(format!("perf record did not answer within {ACK_LIMIT:?}"));
    }
    Ok(())
}

/// `perf record` of every CPU's `cpu-clock` with DWARF call graphs, no
/// copies of the binaries into ~/.debug (they are still there when perf
/// script reads the data).
fn record() -> Command {
    let mut cmd = Command::new(PERF);
    cmd.args(["record", "-N", "-e", "cpu-clock", "-a", "--call-graph"])
        .arg(format!("dwarf,{STACK}"));
    cmd
}

fn mkfifo(path: &Path) -> Result<(), String> {
    let c = CString::new(path.as_os_str().as_bytes()).map_err(|e| e.to_string())?;
    // SAFETY: `c` is a NUL-terminated path that outlives the call.
    if unsafe { libc::mkfifo(c.as_ptr(), 0o600) } != 0 {
        return Err(format!(
            "mkfifo {}: {}",
            path.display(),
            std::io::Error::last_os_error()
        ));
    }
    Ok(())
}

/// `perf script` of `data` with `args` (and `--pid pids`): its output.
fn perf_script(data: &Path, args: &[&str], pids: Option<&str>) -> Result<String, String> {
    let mut cmd = Command::new(PERF);
    // No inlined frames: addr2line over a debug build's lines takes
    // minutes.
    cmd.arg("script")
        .arg("--no-inline")
        .arg("-i")
        .arg(data)
        .args(args);
    if let Some(p) = pids {
        cmd.arg("--pid").arg(p);
    }
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{PERF} script: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "perf script failed ({}): {}",
            out.status,
            tail(&String::from_utf8_lossy(&out.stderr), 3)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The processes of `root`'s tree in perf's task events (its fork and
/// comm records, the running processes' synthesized first), by pid, each
/// with its name (its main thread's last comm, else its parent's).
fn tree(tasks: &str, root: u32, before: &HashMap<u32, (u32, String)>) -> BTreeMap<u32, String> {
    let mut comm: HashMap<u32, String> = HashMap::new();
    let mut parent: HashMap<u32, u32> = HashMap::new();
    for (&pid, (ppid, name)) in before {
        parent.insert(pid, *ppid);
        comm.insert(pid, name.clone());
    }
    for line in tasks.lines() {
        if let Some(rest) = line.split("PERF_RECORD_FORK(").nth(1) {
            // FORK(pid:tid):(ppid:ptid): a new process when pid != ppid.
            let nums: Vec<u32> = rest
                .split(|c: char| !c.is_ascii_digit())
                .filter_map(|n| n.parse().ok())
                .collect();
            if let [pid, _, ppid, _, ..] = nums[..] {
                if pid != ppid {
                    parent.insert(pid, ppid);
                    if let Some(name) = comm.get(&ppid).cloned() {
                        comm.insert(pid, name);
                    }
                }
            }
        } else if let Some(rest) = line.split("PERF_RECORD_COMM").nth(1) {
            // COMM[ exec]: name:pid/tid; the name may hold ':'.
            let rest = rest.split_once(": ").map_or("", |(_, r)| r);
            if let Some((name, ids)) = rest.trim_end().rsplit_once(':') {
                let (pid, tid) = ids.split_once('/').unwrap_or((ids, ids));
                if pid == tid {
                    if let Ok(pid) = pid.parse::<u32>() {
                        comm.insert(pid, name.to_string());
                    }
                }
            }
        }
    }
    let mut out = BTreeMap::new();
    for (&pid, name) in &comm {
        let mut p = pid;
        // Up the tree to the root, or to a process outside it.
        for _ in 0..64 {
            if p == root {
                out.insert(pid, name.clone());
                break;
            }
            match parent.get(&p) {
                Some(&pp) if pp != p => p = pp,
                _ => break,
            }
        }
    }
    out
}

/// Every process now: pid -> (ppid, name).
fn processes() -> HashMap<u32, (u32, String)> {
    crate::common::cpu::processes()
        .into_iter()
        .map(|(pid, p)| (pid, (p.ppid, p.name)))
        .collect()
}

/// `perf script` output with each sample's comm replaced by its process's
/// name: every stack is rooted at `torpor` or `torpor-vmm`, not at
/// threads' names.
fn rename(script: &str, names: &BTreeMap<u32, String>) -> String {
    let mut out = String::with_capacity(script.len());
    for line in script.lines() {
        let head = !line.is_empty() && !line.starts_with(char::is_whitespace);
        match head.then(|| pid_field(line)).flatten() {
            Some((at, pid)) if names.contains_key(&pid) => {
                out.push_str(&names[&pid]);
                out.push(' ');
                out.push_str(&line[at..]);
            }
            _ => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

/// Where a sample line's `pid/tid` field starts, and the pid.
fn pid_field(line: &str) -> Option<(usize, u32)> {
    let mut at = 0;
    for (i, word) in line.split(' ').enumerate() {
        if i > 0 && !word.is_empty() {
            if let Some((p, t)) = word.split_once('/') {
                let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
                if digits(p) && digits(t) {
                    return Some((at, p.parse().ok()?));
                }
            }
        }
        at += word.len() + 1;
    }
    None
}

/// What the folded stacks add up to (ns of CPU).
#[derive(Default)]
struct Stats {
    total: u64,
    /// By root frame: the process's name.
    procs: BTreeMap<String, u64>,
    /// By leaf frame: self time.
    leaf: HashMap<String, u64>,
    /// By the innermost frame of torpor's own code (its crates'
    /// functions): its self time with the library and kernel frames it
    /// called.
    own: HashMap<String, u64>,
}

impl Stats {
    fn of(folded: &str) -> Stats {
        let mut s = Stats::default();
        for line in folded.lines() {
            let Some((stack, n)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(n) = n.parse::<u64>() else { continue };
            s.total += n;
            let frames: Vec<&str> = stack.split(';').collect();
            let add = |map: &mut HashMap<String, u64>, f: &str| {
                *map.entry(f.to_string()).or_insert(0) += n;
            };
            add(&mut s.leaf, frames[frames.len() - 1]);
            let own = frames.iter().skip(1).rev().find(|f| {
                let f = f.trim_start_matches('<');
                f.starts_with("torpor_") || f.starts_with("torpor::")
            });
            add(&mut s.own, own.copied().unwrap_or("(no torpor frame)"));
            *s.procs.entry(frames[0].to_string()).or_insert(0) += n;
        }
        s
    }
}

/// The `TOP` heaviest.
fn top(by: HashMap<String, u64>) -> Vec<(String, u64)> {
    let mut top: Vec<(String, u64)> = by.into_iter().collect();
    top.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    top.truncate(TOP);
    top
}

/// A file name of a configuration's name: "256 MiB default" ->
/// "256-mib-default".
fn slug(name: &str) -> String {
    let words: Vec<String> = name
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_ascii_lowercase)
        .collect();
    words.join("-")
}

/// The last `n` non-empty lines of `text`, joined by " | ".
fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(n)..].join(" | ")
}
