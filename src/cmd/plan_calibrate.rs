//! `torpor plan calibrate`: measures what `torpor plan` charges per event
//! with real VMMs, through the REST API of a running `torpor serve` (the
//! path operators' requests take): create, wake (resume of a hibernated
//! sandbox) and hibernate of probe sandboxes, for a guest that dirties
//! almost nothing and one that rewrites `--dirty-mib` MiB continuously,
//! from which the per-dirty-MiB hibernation cost follows. Snapshot sizes
//! are read from the service's data directory (`--data-dir`, this host);
//! the disk's write bandwidth is what those hibernations wrote over the
//! time they took (the extra bytes of a dirty MiB over its extra time,
//! see `calibration::measured_disk_write_mib_s`); a fresh sandbox's
//! memory from the pod's measured PSS.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use torpor_scheduler::plan::{calibration, sim::quantile, Calibration};

use super::client::{Client, Error};
use super::EXIT_FAILURE;
use crate::cli::CalibrateArgs;

/// Longest wait for a template build.
const BUILD_LIMIT: Duration = Duration::from_secs(300);

pub fn run(a: CalibrateArgs) -> i32 {
    if a.dirty_mib + 8 > a.mem_mib {
        eprintln!(
            "torpor plan calibrate: error: --dirty-mib must be at least 8 MiB below --mem-mib"
        );
        return EXIT_FAILURE;
    }
    let data_dir = a
        .data_dir
        .clone()
        .unwrap_or_else(super::server::default_data_dir);
    let out = a
        .out
        .clone()
        .unwrap_or_else(|| data_dir.join(calibration::FILE_NAME));
    Client::run(&a.client, |c| {
        let cal = measure(c, &a, &data_dir)?;
        cal.store(&out)
            .map_err(|e| Error::Transport(format!("cannot write {}: {e}", out.display())))?;
        if c.json {
            println!("{}", serde_json::to_string_pretty(&cal).unwrap_or_default());
        } else {
            println!(
                "create {:.1} ms, wake {:.1} ms (max {:.1}), hibernate {:.1} ms + {:.2} ms per dirty MiB, \
                 snapshot {:.0} B + {:.0} B per dirty MiB, disk writes {:.0} MiB/s, \
                 fresh sandbox {:.1} MiB PSS\n{}\nstored in {}",
                cal.create_ms,
                cal.wake_ms,
                cal.wake_ms_spread.last().copied().unwrap_or(cal.wake_ms),
                cal.hibernate_ms,
                cal.hibernate_ms_per_dirty_mib,
                cal.snapshot_base_bytes,
                cal.snapshot_bytes_per_dirty_mib,
                cal.disk_write_mib_s,
                cal.fresh_pss_mib,
                cal.description,
                out.display()
            );
        }
        Ok(())
    })
}

fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

fn fail(m: String) -> Error {
    Error::Transport(m)
}

/// Builds a probe template; its id once ready.
fn template(c: &Client, name: &str, mem: u32, cmdline: &str) -> Result<String, Error> {
    let body =
        json!({"name": name, "kind": "probe", "mem_mib": mem, "vcpus": 1, "cmdline": cmdline});
    let mut t = c.call("POST", "/v1/templates", Some(&body))?;
    let id = t["id"]
        .as_str()
        .ok_or_else(|| fail(format!("no id in {t}")))?
        .to_string();
    let deadline = Instant::now() + BUILD_LIMIT;
    loop {
        match t["state"].as_str() {
            Some("ready") => return Ok(id),
            Some("building") if Instant::now() < deadline => {}
            _ => return Err(fail(format!("template {name} did not become ready: {t}"))),
        }
        std::thread::sleep(Duration::from_millis(200));
        t = c.call("GET", &format!("/v1/templates/{id}"), None)?;
    }
}

fn local_pss_mib(c: &Client) -> Result<f64, Error> {
    let pods = c.call("GET", "/v1/pods", None)?;
    Ok(pods["pods"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["id"] == "pod_local")
        .and_then(|p| p["pss_mib"].as_f64())
        .unwrap_or(0.0))
}

/// The newest snapshot directory of sandbox `id`: its bytes on disk.
fn snapshot_bytes(data_dir: &Path, id: &str, generation: u64) -> Option<u64> {
    let dir = data_dir
        .join("sandboxes")
        .join(id)
        .join(format!("snap-{generation}"));
    dir.is_dir().then(|| torpor_storage::allocated_bytes(&dir))
}

/// One probe's figures: create, hibernate, wake ms; snapshot bytes; PSS.
struct Run {
    create: Vec<f64>,
    hibernate: Vec<f64>,
    wake: Vec<f64>,
    snapshot: Vec<f64>,
    pss: Vec<f64>,
}

fn sample(c: &Client, tpl: &str, n: u32, settle: Duration, data_dir: &Path) -> Result<Run, Error> {
    let mut r = Run {
        create: vec![],
        hibernate: vec![],
        wake: vec![],
        snapshot: vec![],
        pss: vec![],
    };
    // One cycle first, not counted: the pool's first shells of a new
    // shape, caches and the first snapshot layer are warm-up, not steady
    // state.
    for i in 0..=n {
        let before = local_pss_mib(c)?;
        let t = Instant::now();
        let s = c.call("POST", "/v1/sandboxes", Some(&json!({"template": tpl})))?;
        r.create.push(ms_since(t));
        let id = s["id"]
            .as_str()
            .ok_or_else(|| fail(format!("no id in {s}")))?
            .to_string();
        let result = (|| {
            std::thread::sleep(settle);
            r.pss.push((local_pss_mib(c)? - before).max(0.0));
            let t = Instant::now();
            let h = c.call("POST", &format!("/v1/sandboxes/{id}/hibernate"), None)?;
            r.hibernate.push(ms_since(t));
            let generation = h["sandbox"]["generation"].as_u64().unwrap_or(0);
            // The snapshot directory is named after the generation the
            // hibernation started from, plus one.
            if let Some(b) = (0..=generation)
                .rev()
                .find_map(|g| snapshot_bytes(data_dir, &id, g))
            {
                r.snapshot.push(b as f64);
            }
            let t = Instant::now();
            let w: Value = c.call("POST", &format!("/v1/sandboxes/{id}/resume"), None)?;
            r.wake.push(ms_since(t));
            if w["sandbox"]["state"] != "running" {
                return Err(fail(format!("wake of {id} did not leave it running: {w}")));
            }
            Ok(())
        })();
        c.call("DELETE", &format!("/v1/sandboxes/{id}"), None)?;
        result?;
        if i == 0 {
            for v in [
                &mut r.create,
                &mut r.hibernate,
                &mut r.wake,
                &mut r.snapshot,
                &mut r.pss,
            ] {
                v.clear();
            }
        }
    }
    Ok(r)
}

fn measure(c: &Client, a: &CalibrateArgs, data_dir: &Path) -> Result<Calibration, Error> {
    let tag = std::process::id();
    let quiet = template(
        c,
        &format!("plan-cal-quiet-{tag}"),
        a.mem_mib,
        "probe.mib=1 probe.ticks=100 probe.hz=100",
    )?;
    let dirty = template(
        c,
        &format!("plan-cal-dirty-{tag}"),
        a.mem_mib,
        &format!("probe.mib={} probe.hz=1000 probe.ticks=1", a.dirty_mib),
    );
    let result = dirty.and_then(|dirty| {
        let runs = (|| {
            let q = sample(c, &quiet, a.samples, Duration::from_millis(200), data_dir)?;
            // Long enough for the guest to rewrite its working set.
            let d = sample(c, &dirty, a.samples, Duration::from_millis(1000), data_dir)?;
            Ok((q, d))
        })();
        let _ = c.call("DELETE", &format!("/v1/templates/{dirty}"), None);
        runs
    });
    let _ = c.call("DELETE", &format!("/v1/templates/{quiet}"), None);
    let (mut q, mut d) = result?;
    let p50 = |v: &mut Vec<f64>| quantile(v, 0.5);
    let mib = f64::from(a.dirty_mib);
    let builtin = Calibration::builtin();
    let qh = p50(&mut q.hibernate);
    let dh = p50(&mut d.hibernate);
    let ms_per_mib = ((dh - qh) / mib).max(0.0);
    let (base, per_mib, disk, disk_note) = if q.snapshot.is_empty() || d.snapshot.is_empty() {
        (
            builtin.snapshot_base_bytes,
            builtin.snapshot_bytes_per_dirty_mib,
            builtin.disk_write_mib_s,
            format!(
                "snapshot sizes built-in (no snapshot readable under {}), disk writes built-in",
                data_dir.display()
            ),
        )
    } else {
        let qb = p50(&mut q.snapshot);
        let db = p50(&mut d.snapshot);
        let per_mib = ((db - qb) / mib).max(0.0);
        match calibration::measured_disk_write_mib_s(per_mib, ms_per_mib, db, dh) {
            Some(disk) => (
                qb,
                per_mib,
                disk,
                "snapshot sizes measured, disk writes measured from them".to_string(),
            ),
            None => (
                qb,
                per_mib,
                builtin.disk_write_mib_s,
                "snapshot sizes measured, disk writes built-in (no write time measured)"
                    .to_string(),
            ),
        }
    };
    let mut create = q.create.clone();
    create.extend(&d.create);
    let mut wake = q.wake.clone();
    wake.extend(&d.wake);
    let cal = Calibration {
        source: "measured".into(),
        description: format!(
            "torpor plan calibrate: {} probe sandboxes of {} MiB (quiet, and rewriting {} MiB) \
             through the API; {disk_note}",
            2 * a.samples,
            a.mem_mib,
            a.dirty_mib
        ),
        measured_at_ms: torpor_scheduler::Timestamp::now().0,
        samples: a.samples,
        create_ms: p50(&mut create),
        wake_ms: p50(&mut wake),
        // p50 sorted it.
        wake_ms_spread: wake.iter().copied().take(calibration::MAX_SPREAD).collect(),
        hibernate_ms: qh,
        hibernate_ms_per_dirty_mib: ms_per_mib,
        snapshot_base_bytes: base,
        snapshot_bytes_per_dirty_mib: per_mib,
        fresh_pss_mib: p50(&mut q.pss),
        // A probe holds what it holds at once: no ramp to model.
        touch_ms: 0.0,
        restored_pss_mib: 0.0,
        disk_write_mib_s: disk,
    };
    cal.validate().map_err(fail)?;
    Ok(cal)
}
