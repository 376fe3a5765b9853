//! The API benchmark's measurements: each talks to one `torpor serve`
//! through its REST API and fills the root's `Results`.

use super::*;
use flame::{Flame, Profile};
use torpor_sync::Locked;

/// POST /v1/sandboxes -> 201 running: (id, answer, ms).
pub(super) fn create(serve: &Serve, template: &str) -> Result<(String, Value, f64), String> {
    let body = json!({"template": template, "metadata": {"bench": "api"}}).to_string();
    let t = Instant::now();
    let (status, text) = serve.raw("POST", "/v1/sandboxes", Some(&body), REQUEST_LIMIT)?;
    let took = ms(t);
    let v = parse(201, status, &text).map_err(|e| format!("create: {e}"))?;
    if v["state"] != "running" {
        return Err(format!("created sandbox is not running: {v}"));
    }
    let id = v["id"].as_str().ok_or(format!("no id in {v}"))?.to_string();
    Ok((id, v, took))
}

/// POST /v1/sandboxes/{id}/{op} -> 200 with the sandbox in `state`:
/// (answer, ms).
pub(super) fn lifecycle(
    serve: &Serve,
    id: &str,
    op: &str,
    state: &str,
) -> Result<(Value, f64), String> {
    let path = format!("/v1/sandboxes/{id}/{op}");
    let t = Instant::now();
    let (status, text) = serve.raw("POST", &path, None, REQUEST_LIMIT)?;
    let took = ms(t);
    let v = parse(200, status, &text).map_err(|e| format!("{op}: {e}"))?;
    if v["sandbox"]["state"] != state {
        return Err(format!("{op} of {id} did not leave it {state}: {v}"));
    }
    Ok((v, took))
}

/// Raises the pod's oversubscription ratio if `n` sandboxes of `mem` MiB
/// would not be admitted.
fn admit(serve: &Serve, n: usize, mem: u32) -> Result<Option<String>, String> {
    let pods = serve.expect(200, "GET", "/v1/pods", None)?;
    let pod = &pods["pods"][0];
    let id = pod["id"].as_str().unwrap_or("pod_local");
    let pod_mib = pod["memory_bytes"].as_f64().unwrap_or(0.0) / 1048576.0;
    let ratio = pod["oversubscription_ratio"].as_f64().unwrap_or(4.0);
    // Room for the clones and the standard sandboxes next to them.
    let need = (n + 8) as f64 * f64::from(mem);
    if pod_mib <= 0.0 || need <= pod_mib * ratio {
        return Ok(None);
    }
    let new = ((need / pod_mib * 1.05) * 100.0).ceil() / 100.0;
    let body = json!({ "oversubscription_ratio": new }).to_string();
    serve.expect(200, "PATCH", &format!("/v1/pods/{id}"), Some(&body))?;
    Ok(Some(format!(
        "oversubscription ratio raised {ratio} -> {new} for {n} x {mem} MiB clones"
    )))
}

/// torpor_restores_total summed by `path` label (None without the counter).
fn restore_counts(serve: &Serve) -> Option<BTreeMap<String, f64>> {
    let (status, text) = serve.raw("GET", "/metrics", None, REQUEST_LIMIT).ok()?;
    if status != 200 {
        return None;
    }
    let mut out = BTreeMap::new();
    for line in text
        .lines()
        .filter(|l| l.starts_with("torpor_restores_total"))
    {
        let path = line
            .split("path=\"")
            .nth(1)
            .and_then(|r| r.split('"').next())
            .unwrap_or("?");
        let value: f64 = line
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0);
        *out.entry(path.to_string()).or_insert(0.0) += value;
    }
    (!out.is_empty()).then_some(out)
}

/// The sum of the series of counter `name` (its `_total`, any labels) in
/// the service's metrics; None without it.
fn counter(serve: &Serve, name: &str) -> Option<f64> {
    let (status, text) = serve.raw("GET", "/metrics", None, REQUEST_LIMIT).ok()?;
    if status != 200 {
        return None;
    }
    let total = format!("{name}_total");
    let values: Vec<f64> = text
        .lines()
        .filter(|l| {
            let series = l.split([' ', '{']).next().unwrap_or_default();
            series == name || series == total
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

/// Complete `TORPOR-PROBE` lines in `text`.
fn probe_lines(text: &[u8]) -> usize {
    let end = text.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
    text[..end]
        .split(|b| *b == b'\n')
        .filter(|l| l.starts_with(b"TORPOR-PROBE "))
        .count()
}

/// Probe lines in `path` that were not there when it held `before`. A
/// restore truncates the console, so a file that no longer begins with
/// `before` is counted from its start.
fn new_lines(path: &Path, before: &[u8]) -> usize {
    let now = std::fs::read(path).unwrap_or_default();
    if now.starts_with(before) {
        probe_lines(&now[before.len()..])
    } else {
        probe_lines(&now)
    }
}

/// Polls (100 µs grain) until `path` has a probe line `before` did not;
/// when, or an error at `deadline`.
pub(super) fn wait_new_line(
    path: &Path,
    before: &[u8],
    deadline: Instant,
) -> Result<Instant, String> {
    loop {
        if new_lines(path, before) > 0 {
            return Ok(Instant::now());
        }
        if Instant::now() > deadline {
            return Err(format!("no new probe line in {}", path.display()));
        }
        std::thread::sleep(Duration::from_micros(100));
    }
}

/// Runs `f(0..n)` on `threads` threads; the first error.
fn par_for(
    n: usize,
    threads: usize,
    f: impl Fn(usize) -> Result<(), String> + Sync,
) -> Result<(), String> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let err: Mutex<Option<String>> = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..threads.min(n) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                if i >= n {
                    break;
                }
                if let Err(e) = f(i) {
                    err.locked().get_or_insert(e);
                    break;
                }
            });
        }
    });
    match err.into_inner_locked() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Lets the standby pool refill after a burst.
pub(super) fn settle() {
    std::thread::sleep(Duration::from_millis(1000));
}

/// `runs` sequential creates (each deleted before the next), after one
/// warm-up; each create's request profiled in `prof`.
fn measure_creates(
    serve: &Serve,
    tpl: &str,
    runs: usize,
    r: &mut Results,
    prof: &mut Profile,
) -> Result<(), String> {
    let (id, _, _) = create(serve, tpl)?;
    serve.delete(&id)?;
    settle();
    let before = restore_counts(serve);
    for _ in 0..runs {
        prof.on();
        let created = create(serve, tpl);
        prof.off();
        let (id, v, took) = created?;
        r.create.push(Sample {
            api_ms: took,
            restore: restore_of(&v),
        });
        serve.delete(&id)?;
    }
    let after = restore_counts(serve);
    if let (Some(b), Some(a)) = (before, after) {
        let delta = a
            .iter()
            .map(|(k, v)| (k.clone(), v - b.get(k).copied().unwrap_or(0.0)))
            .collect();
        r.create_metrics = Some(delta);
    }
    Ok(())
}

/// Pause and resume of one running sandbox, `runs` times after a warm-up.
fn measure_pause(serve: &Serve, tpl: &str, runs: usize, r: &mut Results) -> Result<(), String> {
    let (id, _, _) = create(serve, tpl)?;
    for i in 0..=runs {
        let (_, p) = lifecycle(serve, &id, "pause", "paused")?;
        let (_, q) = lifecycle(serve, &id, "resume", "running")?;
        if i > 0 {
            r.pause.push(p);
            r.resume.push(q);
        }
    }
    serve.delete(&id)
}

/// Hibernate, then wake (resume -> 200, -> first new console line), of one
/// fast-paced sandbox, `runs` times after a warm-up; each sample's resume
/// request profiled in `prof`.
fn measure_wake(
    serve: &Serve,
    fast: &str,
    runs: usize,
    r: &mut Results,
    prof: &mut Profile,
) -> Result<(), String> {
    let (id, created, _) = create(serve, fast)?;
    let mem_mib = created["mem_mib"].as_f64();
    let console = serve.console(&id);
    wait_new_line(&console, b"", Instant::now() + LINE_LIMIT)?;
    for i in 0..=runs {
        let (hibernated, h) = lifecycle(serve, &id, "hibernate", "hibernated")?;
        let before = std::fs::read(&console).unwrap_or_default();
        let path = format!("/v1/sandboxes/{id}/resume");
        if i > 0 {
            prof.on();
        }
        let t = Instant::now();
        let answer = serve.raw("POST", &path, None, REQUEST_LIMIT);
        let api = ms(t);
        prof.off();
        let (status, text) = answer?;
        let v = parse(200, status, &text).map_err(|e| format!("wake: {e}"))?;
        if v["resumed"] != true || v["sandbox"]["state"] != "running" {
            return Err(format!("resume of hibernated {id} did not wake it: {v}"));
        }
        let seen = wait_new_line(&console, &before, t + LINE_LIMIT)?;
        if i > 0 {
            r.hibernate.push(h);
            let report = &hibernated["sandbox"]["hibernation"];
            if let (Some(bytes), Some(mem)) = (report["memory_bytes"].as_f64(), mem_mib) {
                r.hibernate_dirty_pct
                    .push(100.0 * bytes / (mem * 1048576.0));
            }
            if let Some(phases) = report["phases"].as_array() {
                for phase in phases {
                    if let (Some(name), Some(ms)) = (phase[0].as_str(), phase[1].as_f64()) {
                        r.hibernate_phases
                            .entry(name.to_string())
                            .or_default()
                            .push(ms);
                    }
                }
            }
            if let Some(ms) = report["vmm_ms"].as_f64() {
                r.hibernate_vmm.push(ms);
            }
            r.wake.push(Sample {
                api_ms: api,
                restore: restore_of(&v),
            });
            r.wake_line.push((seen - t).as_secs_f64() * 1000.0);
        }
    }
    serve.delete(&id)
}

/// Creates from `threads` threads for `secs`, `DELETERS` threads deleting
/// behind them (a bounded queue holds them back if deletes fall behind).
fn measure_sustained(serve: &Serve, tpl: &str, threads: usize, secs: f64) -> Sustained {
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let (tx, rx) = mpsc::sync_channel::<String>(threads * 2);
    let rx = Mutex::new(rx);
    let out = Mutex::new(Sustained::default());
    let made = counter(serve, "torpor_standby_shells_made");
    let cpu = CpuSpent::now();
    let start = Instant::now();
    let ends: Mutex<Vec<Instant>> = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        let (rx, out, ends) = (&rx, &out, &ends);
        for _ in 0..DELETERS {
            s.spawn(move || loop {
                let next = rx.locked().recv();
                let Ok(id) = next else { break };
                let t = Instant::now();
                let deleted = serve.delete(&id);
                let took = ms(t);
                let mut o = out.locked();
                match deleted {
                    Ok(()) => o.delete_lat.push(took),
                    Err(e) => o.errors.push(e),
                }
            });
        }
        for _ in 0..threads {
            let tx = tx.clone();
            s.spawn(move || {
                while Instant::now() < deadline {
                    let done = create(serve, tpl);
                    let mut o = out.locked();
                    match done {
                        Ok((id, v, took)) => {
                            o.creates += 1;
                            o.lat.push(took);
                            let path = restore_of(&v).and_then(|r| r.path);
                            o.with_path += usize::from(path.is_some());
                            o.standby += usize::from(path.as_deref() == Some("standby"));
                            drop(o);
                            if tx.send(id).is_err() {
                                break;
                            }
                        }
                        Err(e) => {
                            o.errors.push(e);
                            if o.errors.len() > 20 {
                                break;
                            }
                            drop(o);
                            std::thread::sleep(Duration::from_millis(20));
                        }
                    }
                }
                ends.locked().push(Instant::now());
            });
        }
        drop(tx);
    });
    let mut o = out.into_inner_locked();
    o.cpu = CpuSpent::since(cpu);
    let end = ends.into_inner_locked().into_iter().max();
    o.secs = end.map_or(secs, |e| (e - start).as_secs_f64());
    o.refills = made
        .zip(counter(serve, "torpor_standby_shells_made"))
        .map(|(before, after)| after - before);
    o
}

/// `n` creates released at once (a thread each, behind one barrier), then
/// deleted.
fn measure_burst(serve: &Serve, tpl: &str, n: usize, threads: usize) -> Result<Burst, String> {
    let ready_before = counter(serve, "torpor_standby_shells");
    let made_before = counter(serve, "torpor_standby_shells_made");
    let fired = Instant::now();
    let gate = std::sync::Barrier::new(n);
    let out = Mutex::new(Burst {
        fired: n,
        ..Burst::default()
    });
    let made: Mutex<Vec<String>> = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..n {
            s.spawn(|| {
                gate.wait();
                let done = create(serve, tpl);
                let mut o = out.locked();
                match done {
                    Ok((id, v, took)) => {
                        o.lat.push(took);
                        let path = restore_of(&v).and_then(|r| r.path);
                        o.standby += usize::from(path.as_deref() == Some("standby"));
                        made.locked().push(id);
                    }
                    Err(e) => o.errors.push(e),
                }
            });
        }
    });
    let made = made.into_inner_locked();
    par_for(made.len(), threads, |i| serve.delete(&made[i]))?;
    let mut out = out.into_inner_locked();
    out.ready_before = ready_before;
    out.refill = refill_after(serve, ready_before, made_before, fired);
    Ok(out)
}

/// Shells made from `start` (the burst) until the pool holds `ready`
/// again (at most 10 s past its deletes), and the seconds that took; None
/// without the pool's metrics.
fn refill_after(
    serve: &Serve,
    ready: Option<f64>,
    before: Option<f64>,
    start: Instant,
) -> Option<(f64, f64)> {
    let (ready, before) = (ready.filter(|r| *r > 0.0)?, before?);
    let deleted = Instant::now();
    while counter(serve, "torpor_standby_shells")? < ready
        && deleted.elapsed() < Duration::from_secs(10)
    {
        std::thread::sleep(Duration::from_millis(10));
    }
    let made = counter(serve, "torpor_standby_shells_made")? - before;
    Some((made, start.elapsed().as_secs_f64()))
}

/// `n` clones: created and paused at once, PSS; resumed until each printed
/// a new line, PSS; deleted. Per clone, MiB.
fn measure_pss(
    serve: &Serve,
    tpl: &str,
    n: usize,
    threads: usize,
    r: &mut Results,
) -> Result<(), String> {
    let clones: Mutex<Vec<(String, u32)>> = Mutex::new(Vec::new());
    let made = par_for(n, threads, |_| {
        let (id, v, _) = create(serve, tpl)?;
        let pid = v["vmm"]["pid"].as_u64();
        clones.locked().push((id.clone(), pid.unwrap_or(0) as u32));
        lifecycle(serve, &id, "pause", "paused").map(drop)?;
        pid.map(drop)
            .ok_or(format!("no vmm.pid in the answer: {v}"))
    });
    let clones = clones.into_inner_locked();
    let result = made.and_then(|()| pss_phases(serve, &clones, threads, r));
    let deleted = par_for(clones.len(), threads, |i| serve.delete(&clones[i].0));
    result.and(deleted)
}

fn pss_phases(
    serve: &Serve,
    clones: &[(String, u32)],
    threads: usize,
    r: &mut Results,
) -> Result<(), String> {
    let per_clone = |clones: &[(String, u32)]| -> Result<f64, String> {
        let mut sum = 0.0;
        for (id, pid) in clones {
            sum += pss_kib(*pid).ok_or(format!("no PSS for {id}'s VMM (pid {pid})"))? as f64;
        }
        Ok(sum / 1024.0 / clones.len() as f64)
    };
    r.pss_paused = Some(per_clone(clones)?);
    let mine: HashSet<u32> = clones.iter().map(|c| c.1).collect();
    let shells: Vec<u32> = serve
        .vmm_children()
        .into_iter()
        .filter(|p| !mine.contains(p))
        .collect();
    let shells_kib = shells
        .iter()
        .filter_map(|p| pss_kib(*p))
        .fold(0.0, |a, b| a + b as f64);
    r.shells_pss = Some((shells.len(), shells_kib / 1024.0));
    let consoles: Vec<(PathBuf, Vec<u8>)> = clones
        .iter()
        .map(|(id, _)| {
            let c = serve.console(id);
            let before = std::fs::read(&c).unwrap_or_default();
            (c, before)
        })
        .collect();
    par_for(clones.len(), threads, |i| {
        lifecycle(serve, &clones[i].0, "resume", "running").map(drop)
    })?;
    let deadline = Instant::now() + LINE_LIMIT;
    for (c, before) in &consoles {
        wait_new_line(c, before, deadline)?;
    }
    r.pss_running = Some(per_clone(clones)?);
    Ok(())
}

/// Every measurement of one configuration, in order; stops at the first
/// failure (what was measured stays in `r`).
pub(super) fn measure(
    serve: &Serve,
    cfg: &Config,
    o: &Opts,
    mut flame: Option<&mut Flame>,
    r: &mut Results,
) -> Result<(), String> {
    let step = |what: &str| eprintln!("api: [{}] {what}", cfg.name());
    step("building templates");
    let tpl = serve.build_template(&format!("bench-{}", cfg.mem), cfg.mem, None)?;
    let fast = serve.build_template(
        &format!("bench-{}-fast", cfg.mem),
        cfg.mem,
        Some(FAST_CMDLINE),
    )?;
    if let Some(note) = admit(serve, o.clones.max(BURST), cfg.mem)? {
        r.notes.push(note);
    }
    settle();
    // `--flame`: perf runs over the sequential creates and the wakes only,
    // and is stopped (on drop) when they fail.
    let mut profile = |phase: &str, r: &mut Results| match flame.as_deref_mut() {
        Some(f) => f.start(serve.pid(), &cfg.name(), phase, r),
        None => Profile::none(),
    };
    step(&format!("{} creates", o.runs));
    let mut prof = profile("create", r);
    measure_creates(serve, &tpl, o.runs, r, &mut prof)?;
    prof.finish(r);
    step(&format!("{} pause/resume", o.runs));
    measure_pause(serve, &tpl, o.runs, r)?;
    step(&format!("{} hibernate/wake", o.runs));
    let mut prof = profile("wake", r);
    measure_wake(serve, &fast, o.runs, r, &mut prof)?;
    prof.finish(r);
    settle();
    step(&format!(
        "sustained creates, {} threads, {} s",
        o.threads, o.secs
    ));
    let s = measure_sustained(serve, &tpl, o.threads, o.secs);
    let errors = s.errors.clone();
    r.sustained = Some(s);
    if !errors.is_empty() {
        r.notes.push(format!(
            "sustained: {} errors, first: {}",
            errors.len(),
            errors[0]
        ));
    }
    settle();
    // The smoke run (`cargo test`) fires a few.
    let n = if o.smoke { o.clones } else { BURST };
    step(&format!("burst of {n} creates at once"));
    let b = measure_burst(serve, &tpl, n, o.threads)?;
    if !b.errors.is_empty() {
        r.notes.push(format!(
            "burst: {} of {n} not answered 201, first: {}",
            b.errors.len(),
            b.errors[0]
        ));
    }
    r.burst = Some(b);
    settle();
    step(&format!("PSS of {} clones", o.clones));
    measure_pss(serve, &tpl, o.clones, o.threads, r)?;
    Ok(())
}

/// Notes about what the answers said: backends, paths, missing fields.
pub(super) fn check_answers(cfg: &Config, r: &mut Results) {
    for s in r.create.iter().chain(&r.wake) {
        if let Some(b) = s.restore.as_ref().and_then(|r| r.backend.clone()) {
            *r.backend_seen.entry(b).or_insert(0) += 1;
        }
    }
    if let Some(want) = cfg.backend {
        let other: Vec<&String> = r.backend_seen.keys().filter(|b| *b != want).collect();
        if !other.is_empty() {
            r.notes
                .push(format!("restore.backend says {other:?}, configured {want}"));
        }
    }
    if cfg.pool == Some(false) && r.create.iter().any(|s| s.path() == Some("standby")) {
        r.notes
            .push("creates took the standby path with --standby-pool 0".into());
    }
    if !r.create.is_empty() && r.create.iter().all(|s| s.restore.is_none()) {
        r.notes
            .push("answers carry no `restore` object: its columns print -".into());
    }
}
