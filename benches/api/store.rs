//! The API benchmark's object-store table (issue 29): `torpor serve
//! --object-store` on a local directory and, when SeaweedFS's `weed` is
//! installed, on its S3 gateway on loopback (`scripts/object-store`). One
//! probe sandbox of [`STORE_MEM`] MiB whose guest rewrites
//! [`STORE_WORKLOAD_MIB`] MiB, hibernated and woken `runs` times, each run
//! a warm wake (its snapshot on the pod's disk) and a cold one (the
//! snapshot's directory removed first, as another pod that never held it
//! sees it: the wake downloads the layer, then restores). Per store:
//! hibernate with its upload (API time, the upload's own time and bytes
//! from `/metrics`), warm and cold wake (API time; the cold one split
//! into the download, the restore report's `fetch` phase, and the rest),
//! p50/p95, and the target (cold wake p50 <= 150 ms, release)
//! marked. Each store runs twice: eager (the default: the whole layer
//! before the restore) and lazy (`--lazy-wake`: the layer's small files
//! and working set before it, the memory file arriving while the guest
//! runs, that restore on `uffd`; "arrived MiB").

use super::measure::{create, lifecycle, settle, wait_new_line};
use super::*;

#[path = "../../tests/common/seaweedfs.rs"]
mod weed;

/// The guest's memory.
const STORE_MEM: u32 = 256;
/// What its workload rewrites every iteration (its pages are data, the
/// rest of the 256 MiB stays zero: holes in the layer).
const STORE_WORKLOAD_MIB: u32 = 64;
/// The target: a cold wake (snapshot not on the pod) p50, ms.
const COLD_TARGET_MS: f64 = 150.0;

/// A store's environment variables (the S3 store's `AWS_*`).
type Env = Vec<(String, String)>;

/// One store's samples.
#[derive(Default)]
struct StoreRuns {
    name: String,
    /// Hibernate (snapshot + upload) through the API, ms.
    hibernate: Vec<f64>,
    /// The upload's own time (`torpor_object_store_upload_ms`), ms.
    upload: Vec<f64>,
    /// Bytes each hibernation's upload sent (new chunks, compressed).
    sent: Vec<f64>,
    warm: Vec<f64>,
    warm_line: Vec<f64>,
    cold: Vec<f64>,
    cold_line: Vec<f64>,
    /// The cold wake's download (`fetch` phase), ms.
    fetch: Vec<f64>,
    /// Bytes each cold wake fetched before its restore (a lazy wake's
    /// small files and working set; an eager one's whole layer).
    fetched: Vec<f64>,
    /// Bytes a lazy cold wake's memory file fetched while the guest ran.
    arrived: Vec<f64>,
    /// Sandboxes of one template hibernated once each, the data bytes
    /// their layers named and the content bytes their new chunks added.
    dedupe: Option<(usize, f64, f64)>,
    /// Two of those sandboxes woken cold one after the other, the pod's
    /// chunk cache emptied first: bytes each wake fetched (the second
    /// reads what they share from the cache) and their API ms.
    siblings: Option<[(f64, f64); 2]>,
    notes: Vec<String>,
    failed: bool,
}

/// The counters and histogram sums of `/metrics` this table reads.
#[derive(Clone, Copy, Default)]
struct Counters {
    sent: f64,
    fetched: f64,
    arrived: f64,
    upload_ms: f64,
    /// Layers' data bytes uploaded, and the content bytes stored for them.
    data: f64,
    new: f64,
}

fn counters(serve: &Serve) -> Result<Counters, String> {
    let (status, text) = serve.raw("GET", "/metrics", None, REQUEST_LIMIT)?;
    if status != 200 {
        return Err(format!("/metrics: {status}"));
    }
    let value = |name: &str| -> f64 {
        text.lines()
            .find(|l| l.split([' ', '{']).next() == Some(name))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(f64::NAN)
    };
    Ok(Counters {
        sent: value("torpor_object_store_sent_bytes_total"),
        fetched: value("torpor_object_store_fetched_bytes_total"),
        arrived: value("torpor_object_store_arrived_bytes_total"),
        upload_ms: value("torpor_object_store_upload_ms_sum"),
        data: value("torpor_object_store_layer_data_bytes_total"),
        new: value("torpor_object_store_new_bytes_total"),
    })
}

/// SeaweedFS's variables, its scratch directory; why not (the S3 row is
/// left out) without a `weed` binary.
fn seaweedfs(scratch: &Path) -> Result<(Env, PathBuf), String> {
    let dir = scratch.join("seaweedfs");
    let env = weed::start(&dir).map_err(|e| format!("{e}: S3 row left out"))?;
    Ok((env, dir))
}

/// The sandbox's snapshot directories on the pod's disk removed, and
/// the pod's chunk cache emptied: the next wake finds none of it, as on a
/// pod that never held it (the cache's index learns of it when a read
/// finds a chunk's file gone, and fetches it again).
fn evict(serve: &Serve, id: &str) -> Result<usize, String> {
    let cache = serve.data().join("chunk-cache");
    if let Ok(fans) = std::fs::read_dir(&cache) {
        for fan in fans.flatten().filter(|e| e.path().is_dir()) {
            std::fs::remove_dir_all(fan.path()).map_err(|e| e.to_string())?;
        }
    }
    let dir = serve.data().join("sandboxes").join(id);
    let mut n = 0;
    for e in std::fs::read_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))? {
        let e = e.map_err(|e| e.to_string())?;
        if e.file_name().to_string_lossy().starts_with("snap-") {
            std::fs::remove_dir_all(e.path()).map_err(|e| e.to_string())?;
            n += 1;
        }
    }
    Ok(n)
}

/// One hibernation with its upload: the samples it adds.
fn hibernate(serve: &Serve, id: &str, r: &mut StoreRuns, keep: bool) -> Result<(), String> {
    let before = counters(serve)?;
    let (v, took) = lifecycle(serve, id, "hibernate", "hibernated")?;
    if !v["sandbox"]["stored_snapshot"].is_string() {
        return Err(format!("hibernate of {id} stored no snapshot: {v}"));
    }
    let after = counters(serve)?;
    if keep {
        r.hibernate.push(took);
        r.upload.push(after.upload_ms - before.upload_ms);
        r.sent.push(after.sent - before.sent);
    }
    Ok(())
}

/// One wake: (API ms, ms to the guest's next line, the `fetch` phase).
fn wake(serve: &Serve, id: &str) -> Result<(f64, f64, Option<f64>), String> {
    let console = serve.console(id);
    let before = std::fs::read(&console).unwrap_or_default();
    let t = Instant::now();
    let (status, text) = serve.raw(
        "POST",
        &format!("/v1/sandboxes/{id}/resume"),
        None,
        REQUEST_LIMIT,
    )?;
    let api = ms(t);
    let v = parse(200, status, &text).map_err(|e| format!("wake: {e}"))?;
    if v["sandbox"]["state"] != "running" {
        return Err(format!("resume of hibernated {id} did not wake it: {v}"));
    }
    let seen = wait_new_line(&console, &before, t + LINE_LIMIT)?;
    let fetch = restore_of(&v).and_then(|r| r.phases.get("fetch").copied());
    Ok((api, (seen - t).as_secs_f64() * 1000.0, fetch))
}

fn measure_store(
    serve: &Serve,
    runs: usize,
    dedupe: usize,
    r: &mut StoreRuns,
) -> Result<(), String> {
    let name = r.name.clone();
    let step = |what: &str| eprintln!("api: [store {name}] {what}");
    step("building the template");
    let cmdline = format!("probe.mib={STORE_WORKLOAD_MIB} probe.ticks=1 probe.hz=1000");
    let tpl = serve.build_template("bench-store", STORE_MEM, Some(&cmdline))?;
    let (id, _, _) = create(serve, &tpl)?;
    wait_new_line(&serve.console(&id), b"", Instant::now() + LINE_LIMIT)?;
    settle();
    step(&format!(
        "{runs} runs: hibernate, warm wake, hibernate, cold wake"
    ));
    // Run 0 warms up (and stores the template's layer).
    let mut arriving: Option<f64> = None;
    for i in 0..=runs {
        let keep = i > 0;
        hibernate(serve, &id, r, keep)?;
        // A hibernation waits for a lazy wake's memory file to arrive.
        if let Some(before) = arriving.take() {
            r.arrived.push(counters(serve)?.arrived - before);
        }
        let (api, line, fetch) = wake(serve, &id)?;
        if fetch.is_some() {
            return Err(format!("a warm wake fetched its snapshot: {fetch:?}"));
        }
        if keep {
            r.warm.push(api);
            r.warm_line.push(line);
        }
        hibernate(serve, &id, r, keep)?;
        if evict(serve, &id)? == 0 {
            return Err(format!("no snapshot of {id} on the pod's disk to evict"));
        }
        let before = counters(serve)?;
        let (api, line, fetch) = wake(serve, &id)?;
        let after = counters(serve)?;
        let fetch = fetch.ok_or("a cold wake without a fetch phase")?;
        if keep {
            r.cold.push(api);
            r.cold_line.push(line);
            r.fetch.push(fetch);
            r.fetched.push(after.fetched - before.fetched);
            arriving = Some(before.arrived);
        }
    }
    serve.delete(&id)?;
    if dedupe > 0 {
        step(&format!(
            "dedupe: {dedupe} sandboxes of the template, each hibernated once"
        ));
        let before = counters(serve)?;
        let mut ids = Vec::with_capacity(dedupe);
        for _ in 0..dedupe {
            let (id, _, _) = create(serve, &tpl)?;
            hibernate(serve, &id, r, false)?;
            ids.push(id);
        }
        let after = counters(serve)?;
        r.dedupe = Some((dedupe, after.data - before.data, after.new - before.new));
        step("two of them woken cold, the chunk cache empty before the first");
        let mut siblings = [(0.0, 0.0); 2];
        for id in &ids[..2] {
            evict(serve, id)?;
        }
        for (i, id) in ids[..2].iter().enumerate() {
            let before = counters(serve)?;
            let (api, _, fetch) = wake(serve, id)?;
            fetch.ok_or("a cold wake without a fetch phase")?;
            siblings[i] = (counters(serve)?.fetched - before.fetched, api);
        }
        r.siblings = Some(siblings);
        for id in &ids {
            serve.delete(id)?;
        }
    }
    Ok(())
}

/// Runs the table's stores; prints it. Whether everything ran.
pub(super) fn run(o: &Opts, scratch: &Path) -> bool {
    let runs = o.runs;
    let mut done: Vec<StoreRuns> = Vec::new();
    let mut notes = Vec::new();
    let mut stores: Vec<(String, String, Env)> = vec![(
        "directory".into(),
        scratch.join("store-objects").display().to_string(),
        Vec::new(),
    )];
    // Each store twice: eager (the default: the whole layer before the
    // restore) and lazy (`--lazy-wake`: that restore on `uffd`, warm
    // wakes on the default `file` backend).
    const LAZY: [&str; 1] = ["--lazy-wake"];
    let weed = match seaweedfs(scratch) {
        Ok((env, dir)) => {
            let url = format!(
                "{}/bench-{}",
                env_of(&env, "TORPOR_OBJECT_STORE"),
                std::process::id()
            );
            stores.push(("SeaweedFS S3, loopback".into(), url, env));
            Some(dir)
        }
        Err(why) => {
            notes.push(why);
            None
        }
    };
    let mut ok = true;
    let rows = stores.into_iter().flat_map(|(name, url, env)| {
        [
            (format!("{name}, eager"), url.clone(), env.clone(), false),
            (format!("{name}, lazy"), format!("{url}-lazy"), env, true),
        ]
    });
    for (i, (name, url, env, lazy)) in rows.enumerate() {
        // The service reads the store's AWS_* variables from its
        // environment (single-threaded here).
        for (k, v) in &env {
            std::env::set_var(k, v);
        }
        eprintln!("api: [store {name}] starting torpor serve --object-store {url}");
        let dir = scratch.join(format!("store{i}"));
        let mut flags = vec!["--object-store".to_string(), url.clone()];
        if lazy {
            flags.extend(LAZY.iter().map(|f| f.to_string()));
        }
        let mut r = StoreRuns {
            name: name.clone(),
            ..Default::default()
        };
        match Serve::start(&dir, &flags) {
            Started::Up(mut serve) => {
                // The dedupe of a template's sandboxes, once (the chunks
                // are the same whatever the store).
                let dedupe = match (i, o.quick) {
                    (0, true) => 20,
                    (0, false) => 100,
                    _ => 0,
                };
                if let Err(e) = measure_store(&serve, runs, dedupe, &mut r) {
                    r.failed = true;
                    r.notes.push(format!(
                        "FAILED: {e}\n      serve log ends:\n{}",
                        serve.log_tail(8)
                    ));
                }
                r.notes.extend(serve.stop());
            }
            Started::Rejected(why) | Started::Failed(why) => {
                r.failed = true;
                r.notes.push(format!("FAILED to start: {why}"));
            }
        }
        ok &= !r.failed;
        done.push(r);
    }
    if let Some(dir) = weed {
        weed::stop(&dir);
    }
    print_store_table(&done, runs, &notes);
    ok
}

fn env_of<'a>(env: &'a Env, key: &str) -> &'a str {
    env.iter()
        .find(|(k, _)| k == key)
        .map_or("", |(_, v)| v.as_str())
}

fn p(v: &[f64], q: f64) -> String {
    if v.is_empty() {
        "-".into()
    } else {
        format!("{:.1}", percentile(v, q))
    }
}

fn mib(v: &[f64]) -> String {
    if v.is_empty() || v.iter().any(|x| x.is_nan()) {
        "-".into()
    } else {
        format!("{:.1}", percentile(v, 0.5) / 1048576.0)
    }
}

fn print_store_table(done: &[StoreRuns], runs: usize, notes: &[String]) {
    println!(
        "\n== object store (issue 29): probe {STORE_MEM} MiB, workload {STORE_WORKLOAD_MIB} MiB \
         (the rest zero: holes), {runs} runs each of hibernate + warm wake + hibernate + cold \
         wake; ms, p50/p95 (nearest rank)"
    );
    println!(
        "{:<30} {:>15} {:>11} {:>9} {:>15} {:>13} {:>15} {:>13} {:>11} {:>11} {:>10} {:>11} {:>7}",
        "store",
        "hibernate+upl",
        "upload p50",
        "sent MiB",
        "warm wake",
        "warm->line",
        "COLD wake",
        "cold->line",
        "download",
        "restore+",
        "fetch MiB",
        "arrived MiB",
        "target"
    );
    for r in done {
        let pair = |v: &[f64]| format!("{}/{}", p(v, 0.5), p(v, 0.95));
        let rest: Vec<f64> = r.cold.iter().zip(&r.fetch).map(|(c, f)| c - f).collect();
        let target = if r.cold.is_empty() {
            "-"
        } else if percentile(&r.cold, 0.5) <= COLD_TARGET_MS {
            "ok"
        } else {
            "MISS"
        };
        println!(
            "{:<30} {:>15} {:>11} {:>9} {:>15} {:>13} {:>15} {:>13} {:>11} {:>11} {:>10} {:>11} {:>7}",
            r.name,
            pair(&r.hibernate),
            p(&r.upload, 0.5),
            mib(&r.sent),
            pair(&r.warm),
            pair(&r.warm_line),
            pair(&r.cold),
            pair(&r.cold_line),
            p(&r.fetch, 0.5),
            p(&rest, 0.5),
            mib(&r.fetched),
            mib(&r.arrived),
            target
        );
        if !r.cold.is_empty() {
            let (c, f) = (percentile(&r.cold, 0.5), percentile(&r.fetch, 0.5));
            let what = if r.arrived.iter().all(|&a| a == 0.0) {
                "the whole layer"
            } else {
                "its small files and working set; the rest arrived while the guest ran"
            };
            println!(
                "  {}: the cold wake's p50 {c:.1} ms is {:.0}% download ({what}, \
                 {} MiB fetched, before the restore starts) and {:.1} ms restore after it \
                 (warm wake p50 {})",
                r.name,
                100.0 * f / c,
                mib(&r.fetched),
                percentile(&rest, 0.5),
                p(&r.warm, 0.5)
            );
        }
        if let Some((n, data, new)) = r.dedupe {
            println!(
                "  {}: dedupe of {n} sandboxes of one template, each hibernated once (full \
                 layers): their layers name {:.1} MiB of data, the store added {:.1} MiB of \
                 chunks for them: {:.2}x ({:.2} MiB per sandbox)",
                r.name,
                data / 1048576.0,
                new / 1048576.0,
                if new > 0.0 { data / new } else { f64::NAN },
                new / 1048576.0 / n as f64
            );
        }
        if let Some([(first, first_ms), (second, second_ms)]) = r.siblings {
            println!(
                "  {}: two of them woken cold through the pod's chunk cache (empty before the \
                 first): the first fetched {:.2} MiB ({first_ms:.1} ms), the second {:.2} MiB \
                 ({second_ms:.1} ms), the chunks they share read from the cache",
                r.name,
                first / 1048576.0,
                second / 1048576.0
            );
        }
        for n in &r.notes {
            println!("  note: {}: {n}", r.name);
        }
    }
    for n in notes {
        println!("  note: {n}");
    }
    println!(
        "  target (the issue): cold wake (snapshot not on the pod) p50 <= {COLD_TARGET_MS} ms in \
         release. \"restore+\" is the cold wake's API time less its download: admission, the \
         restore, the commit. \"fetch MiB\" is what a cold wake fetched before its restore \
         (eager: the whole layer; lazy: its small files and working set), \"arrived MiB\" what \
         a lazy one's memory file fetched while its guest ran (the page server waiting on a \
         chunk's present bit, the pod fetching wanted chunks first)."
    );
}
