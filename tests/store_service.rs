//! One pod with an object store (`serve --object-store`, issue 29): a
//! hibernation answers once its full snapshot is stored, a wake whose
//! snapshot is gone from the pod's disk downloads it (the restore's
//! `fetch` phase) and the probe goes on with its exact sequence; an upload
//! that fails answers the error with the sandbox hibernated on the disk,
//! and a hibernate asked again stores it, as does the pod when it starts
//! again.
//!
//! Two faults (issue 29): the store stopping in the middle of an upload
//! (S3 on SeaweedFS behind a proxy the test cuts: `common/cut.rs`), which
//! must lose no sandbox and no stored layer, a wake from the pod's disk
//! and, once the store is back, a stored and cold-woken sandbox following;
//! and a garbage collection of another pod (no grace) looping while
//! a sandbox hibernates and wakes cold and another pod adopts it, which
//! must take no chunk a hibernation's manifest, a wake or an adoption
//! needs (the leases of torpor-storage).

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::cut::CutProxy;
use common::serve::DataDir;
use torpor_scheduler::model::SandboxId;
use torpor_scheduler::service::{CreateSandbox, Service, ServiceConfig, ServiceError};
use torpor_scheduler::SandboxState;
use torpor_vmm_api::lineage::Lineage;

const MIB: u32 = 1;
const WAIT: Duration = Duration::from_secs(30);

/// The probe's iterations in the sandbox's console (its current VMM's
/// run), once there are two, each reading what the one before wrote.
fn guest_iterates(data: &Path, id: &SandboxId) -> Vec<(u64, u64)> {
    guest_iterates_mib(data, id, MIB)
}

/// A service of `data` on object store `store` with a probe template
/// `name` (64 MiB, a workload of `mib` MiB, `hz` iterations a second), and
/// a sandbox of it whose guest iterates.
fn iterating_sandbox(
    data: &Path,
    store: String,
    name: &str,
    mib: u32,
    hz: u32,
) -> (Arc<Service>, SandboxId) {
    iterating_sandbox_with(data, store, name, mib, hz, |_| {})
}

/// [`iterating_sandbox`] with more of the service's configuration.
fn iterating_sandbox_with(
    data: &Path,
    store: String,
    name: &str,
    mib: u32,
    hz: u32,
    more: impl FnOnce(&mut ServiceConfig),
) -> (Arc<Service>, SandboxId) {
    let service = common::service_with_probe(
        data,
        |c| {
            c.object_store = Some(store);
            more(c);
        },
        name,
        64,
        &format!("probe.mib={mib} probe.ticks=1 probe.hz={hz}"),
    );
    let id = service
        .create_sandbox(CreateSandbox {
            template: name.into(),
            ..Default::default()
        })
        .expect("create")
        .id;
    guest_iterates_mib(data, &id, mib);
    (service, id)
}

/// [`guest_iterates`] of a probe whose workload is `mib` MiB.
fn guest_iterates_mib(data: &Path, id: &SandboxId, mib: u32) -> Vec<(u64, u64)> {
    let console = data.join("sandboxes").join(id.as_str()).join("console.log");
    let deadline = Instant::now() + WAIT;
    let iters = loop {
        let iters: Vec<(u64, u64)> = std::fs::read_to_string(&console)
            .unwrap_or_default()
            .lines()
            .filter_map(torpor_probe::parse_iter_line)
            .collect();
        if iters.len() >= 2 {
            break iters;
        }
        assert!(Instant::now() < deadline, "{id}: {iters:?} in {WAIT:?}");
        std::thread::sleep(Duration::from_millis(5));
    };
    common::snap::assert_exact_sequence(&iters, mib);
    iters
}

fn hibernate(service: &Arc<Service>, id: &SandboxId) -> Result<String, ServiceError> {
    let started = Instant::now();
    let s = service.hibernate(id)?.sandbox;
    println!(
        "hibernate with upload: {:.1} ms",
        started.elapsed().as_secs_f64() * 1000.0
    );
    assert_eq!(s.state, SandboxState::Hibernated);
    Ok(s.stored_snapshot.expect("a stored snapshot"))
}

#[test]
fn store_hibernations_are_stored_and_fetched_back() {
    let data = DataDir::new("store-service");
    let objects = data.0.join("objects");
    // Eager wakes (the default): the whole layer before the restore, on
    // the pod's own backend (the lazy tests are below).
    let (service, id) = iterating_sandbox(&data.0, objects.display().to_string(), "fast", MIB, 100);

    // Stored, a full snapshot: it restores alone.
    let manifest = hibernate(&service, &id).unwrap();
    assert!(objects.join("manifests").join(&manifest).exists());
    let snapshot = service.get_sandbox(&id).unwrap().snapshot.unwrap();
    assert_eq!(Lineage::read(&snapshot).unwrap().depth(), 1);
    let template = service
        .list_templates()
        .unwrap()
        .into_iter()
        .find(|t| t.name == "fast")
        .unwrap();
    assert!(template.stored_snapshot.is_some(), "{template:?}");

    // Gone from the pod's disk: the wake fetches it.
    std::fs::remove_dir_all(&snapshot).unwrap();
    let woken = service.resume(&id).expect("wake from the object store");
    let report = woken.sandbox.restore.expect("a restore report");
    println!("wake from the object store: {report:?}");
    assert!(
        report.phases.iter().any(|(p, _)| p == "fetch"),
        "{report:?}"
    );
    assert_eq!(report.backend, "file", "{report:?}");
    assert!(!snapshot.join(".arriving").exists(), "fetched whole");
    guest_iterates(&data.0, &id);

    // The store fails (its directory replaced by a file): the hibernation
    // answers the error, the sandbox hibernated on the disk; asked again
    // once the store is back, it is stored.
    let aside = data.0.join("objects-aside");
    std::fs::rename(&objects, &aside).unwrap();
    std::fs::write(&objects, b"not a directory").unwrap();
    let e = hibernate(&service, &id).unwrap_err();
    println!("with the store gone: {e}");
    assert!(matches!(e, ServiceError::ObjectStore(_)), "{e}");
    let s = service.get_sandbox(&id).unwrap();
    assert_eq!(s.state, SandboxState::Hibernated);
    assert!(s.stored_snapshot.is_none(), "{s:?}");
    std::fs::remove_file(&objects).unwrap();
    std::fs::rename(&aside, &objects).unwrap();
    let again = hibernate(&service, &id).unwrap();
    assert_ne!(again, manifest);
    let woken = service.resume(&id).expect("wake");
    assert_eq!(woken.sandbox.state, SandboxState::Running);
    guest_iterates(&data.0, &id);
    // Once more, the template stored already: the steady state. The
    // snapshot it woke from is gone, and its manifest with it.
    let last = hibernate(&service, &id).unwrap();
    assert!(!objects.join("manifests").join(&again).exists());
    // Deleted: its last manifest goes; the template's stays.
    service.delete_sandbox(&id).unwrap();
    assert!(!objects.join("manifests").join(&last).exists());
    let kept = template.stored_snapshot.unwrap();
    assert!(objects.join("manifests").join(&kept).exists());
}

/// The sandbox's snapshot removed from the pod's disk (as on a pod that
/// never held it): the next wake downloads it.
fn evict(service: &Arc<Service>, id: &SandboxId) {
    let snapshot = service.get_sandbox(id).unwrap().snapshot.unwrap();
    std::fs::remove_dir_all(&snapshot).unwrap();
}

/// A wake that must download the snapshot (the restore's `fetch` phase).
fn cold_wake(service: &Arc<Service>, id: &SandboxId) -> torpor_scheduler::model::RestoreReport {
    let woken = service
        .resume(id)
        .expect("a cold wake from the object store");
    let report = woken.sandbox.restore.expect("a restore report");
    assert!(
        report.phases.iter().any(|(p, _)| p == "fetch"),
        "{report:?}"
    );
    report
}

/// Sandbox `id` as `service` holds it, and its template: what another
/// pod adopting it is given.
fn sandbox_and_template(
    service: &Arc<Service>,
    id: &SandboxId,
) -> (
    torpor_scheduler::model::Sandbox,
    torpor_scheduler::model::Template,
) {
    let sandbox = service.get_sandbox(id).unwrap();
    let template = service
        .list_templates()
        .unwrap()
        .into_iter()
        .find(|t| t.id == sandbox.template)
        .unwrap();
    (sandbox, template)
}

/// A metric's value in the service's exposition (0 when absent).
fn metric(service: &Arc<Service>, series: &str) -> f64 {
    service
        .metrics()
        .lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0)
}

/// Two sandboxes of one template, hibernated and stored, woken cold one
/// after the other: the second's fetch reads the chunks the first
/// brought (those of the template's memory they share: the probe's 8 MiB
/// workload as the template's snapshot left it, the next iteration a
/// minute away) from the pod's chunk cache, not from the store.
#[test]
fn store_cold_wakes_of_one_templates_sandboxes_share_the_chunk_cache() {
    let data = DataDir::new("store-cache");
    let objects = data.0.join("objects");
    let service = common::service_with_probe(
        &data.0,
        |c| c.object_store = Some(objects.display().to_string()),
        "slow",
        64,
        "probe.mib=8 probe.ticks=600 probe.hz=10",
    );
    let ids: Vec<SandboxId> = (0..2)
        .map(|_| {
            service
                .create_sandbox(CreateSandbox {
                    template: "slow".into(),
                    ..Default::default()
                })
                .expect("create")
                .id
        })
        .collect();
    for id in &ids {
        hibernate(&service, id).unwrap();
        evict(&service, id);
    }
    assert!(
        data.0.join("chunk-cache").is_dir(),
        "no cache in the data directory"
    );
    let fetched = |s: &Arc<Service>| metric(s, "torpor_chunk_cache_fetched_bytes");
    let hits = |s: &Arc<Service>| metric(s, "torpor_chunk_cache_hits");
    assert_eq!((fetched(&service), hits(&service)), (0.0, 0.0));
    cold_wake(&service, &ids[0]);
    let first = fetched(&service);
    assert!(first > 0.0, "the first cold wake fetched nothing");
    cold_wake(&service, &ids[1]);
    let second = fetched(&service) - first;
    let hit = hits(&service);
    println!(
        "cold wakes of two sandboxes of one template: fetched {first} B, then {second} B \
         and {hit} chunks from the cache"
    );
    // The workload's 8 chunks at least.
    assert!(
        hit >= 8.0,
        "the second wake read {hit} chunks from the cache"
    );
    assert!(second < first / 2.0, "fetched {first} B, then {second} B");
    for id in &ids {
        assert_eq!(
            service.get_sandbox(id).unwrap().state,
            SandboxState::Running
        );
    }
    assert!(metric(&service, "torpor_chunk_cache_bytes") > 0.0);
    assert_eq!(
        metric(&service, "torpor_chunk_cache_limit_bytes"),
        (torpor_scheduler::service::DEFAULT_CHUNK_CACHE_MIB << 20) as f64
    );
}

#[test]
fn store_s3_stopped_mid_upload_loses_no_sandbox() {
    const WORK: u32 = 8;
    let (proxy, url, env, _one) = store_behind_proxy("outage");
    let data = DataDir::new("store-outage");
    let (service, id) = iterating_sandbox(&data.0, url.clone(), "fast", WORK, 100);
    hibernate(&service, &id).expect("stored while the store is up");
    let template = service
        .list_templates()
        .unwrap()
        .into_iter()
        .find(|t| t.name == "fast")
        .unwrap()
        .stored_snapshot
        .expect("the template's layer stored");
    service.resume(&id).expect("wake");
    guest_iterates_mib(&data.0, &id, WORK);

    // The store stops once the upload has sent 4 KiB (its lease and the
    // first requests for chunks): the hibernation answers the store's
    // error, the sandbox hibernated on the pod's disk.
    proxy.cut_after(4096);
    let started = Instant::now();
    let e = hibernate(&service, &id).unwrap_err();
    println!(
        "store stopped mid-upload: {e} after {:.1} s",
        started.elapsed().as_secs_f64()
    );
    assert!(proxy.is_cut(), "the upload ended before the cut: {e}");
    assert!(matches!(e, ServiceError::ObjectStore(_)), "{e}");
    let s = service.get_sandbox(&id).unwrap();
    assert_eq!(s.state, SandboxState::Hibernated);
    assert!(s.stored_snapshot.is_none(), "{s:?}");
    assert!(s.snapshot.as_ref().unwrap().join("state").exists(), "{s:?}");
    assert!(
        metric(
            &service,
            "torpor_object_store_uploads_total{result=\"failed\"}"
        ) >= 1.0
    );

    // Still down: the wake restores from the pod's disk, memory intact;
    // hibernated again, the upload fails again and nothing is lost.
    let woken = service.resume(&id).expect("a wake from the pod's disk");
    assert_eq!(woken.sandbox.state, SandboxState::Running);
    guest_iterates_mib(&data.0, &id, WORK);
    hibernate(&service, &id).unwrap_err();
    assert_eq!(
        service.get_sandbox(&id).unwrap().state,
        SandboxState::Hibernated
    );

    // The store back: a hibernate asked again stores the snapshot; gone
    // from the disk, the wake fetches it and the guest goes on.
    proxy.restore();
    hibernate(&service, &id).expect("stored once the store is back");
    evict(&service, &id);
    cold_wake(&service, &id);
    guest_iterates_mib(&data.0, &id, WORK);

    // Down while its snapshot is only in the store: the wake fails and
    // leaves it hibernated; back, the wake fetches it.
    let stored = hibernate(&service, &id).expect("stored");
    evict(&service, &id);
    proxy.cut();
    let e = service.resume(&id).unwrap_err();
    println!("a cold wake with the store down: {e}");
    assert!(matches!(e, ServiceError::ObjectStore(_)), "{e}");
    assert_eq!(
        service.get_sandbox(&id).unwrap().state,
        SandboxState::Hibernated
    );
    proxy.restore();
    cold_wake(&service, &id);
    guest_iterates_mib(&data.0, &id, WORK);

    // What a client was told is stored is still there: the template's
    // layer, and the last hibernation's while the sandbox ran on from it.
    let direct = torpor_storage::StoreConfig::parse_with_env(&url, |k| {
        if k == "AWS_ENDPOINT_URL" {
            Some(env["AWS_ENDPOINT_URL"].clone())
        } else {
            std::env::var(k).ok()
        }
    })
    .unwrap();
    let storage = torpor_storage::Storage::open(&direct).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let manifests: Vec<String> = rt
        .block_on(storage.list_manifests())
        .unwrap()
        .iter()
        .map(|m| m.as_str().to_string())
        .collect();
    assert!(manifests.contains(&template), "{manifests:?}");
    assert!(manifests.contains(&stored), "{manifests:?}");
    service.delete_sandbox(&id).unwrap();
}

#[test]
fn store_gc_racing_hibernations_and_cold_wakes_takes_nothing_they_need() {
    // One iteration a second: a sandbox hibernated right after a wake
    // keeps its workload, so its new snapshot shares chunks with the old
    // one that the template does not hold, unreferenced while the old
    // manifest is gone and the new one is being written.
    const WORK: u32 = 8;
    let data = DataDir::new("store-gc-race");
    let objects = data.0.join("objects");
    let (service, id) = iterating_sandbox(&data.0, objects.display().to_string(), "slow", WORK, 1);
    hibernate(&service, &id).unwrap();

    // Another pod's collector, without the grace period: whatever no
    // manifest and no live lease names is deleted at once.
    let stop = Arc::new(AtomicBool::new(false));
    let collector = std::thread::spawn({
        let (stop, objects) = (stop.clone(), objects.clone());
        move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            let config =
                torpor_storage::StoreConfig::parse(&objects.display().to_string()).unwrap();
            let options = torpor_storage::StorageOptions {
                grace: Duration::ZERO,
                ..Default::default()
            };
            let storage = torpor_storage::Storage::open_with(&config, options).unwrap();
            let (mut runs, mut deleted) = (0u64, 0u64);
            while !stop.load(Ordering::SeqCst) {
                let r = rt
                    .block_on(storage.collect_garbage())
                    .expect("a collection");
                runs += 1;
                deleted += r.deleted;
                std::thread::sleep(Duration::from_millis(10));
            }
            (runs, deleted)
        }
    });

    let counters = || {
        (
            metric(&service, "torpor_object_store_layer_data_bytes_total"),
            metric(&service, "torpor_object_store_new_bytes_total"),
        )
    };
    let (mut named, mut added) = (0.0, 0.0);
    for round in 0..4 {
        // Woken from the disk, hibernated at once: the upload races the
        // collector over the chunks it shares with the manifest just
        // dropped.
        service.resume(&id).expect("wake");
        let before = counters();
        let m = hibernate(&service, &id).unwrap();
        let after = counters();
        named += after.0 - before.0;
        added += after.1 - before.1;
        // Gone from the disk: the wake downloads every chunk while the
        // collector runs.
        evict(&service, &id);
        cold_wake(&service, &id);
        guest_iterates_mib(&data.0, &id, WORK);
        hibernate(&service, &id).unwrap();
        println!("round {round}: {m} stored, woken cold, hibernated again");
    }
    // Those hibernations named the workload the store held already: the
    // dedupe ratio's counters (`/metrics`) say so.
    println!(
        "hibernated at once after a wake: layers named {named} data bytes, the store added {added}"
    );
    assert!(
        named > 0.0 && added < named / 2.0,
        "named {named}, added {added}"
    );
    // Another pod adopts it (as a replica moves a lost pod's sandbox)
    // while the collector runs: the template's layer and the sandbox's
    // fetched there; this pod releases its copy, keeping the manifests.
    let other = DataDir::new("store-gc-race-adopter");
    let adopter = common::service_with_probe(
        &other.0,
        |c| c.object_store = Some(objects.display().to_string()),
        "slow",
        64,
        &format!("probe.mib={WORK} probe.ticks=1 probe.hz=1"),
    );
    let (sandbox, template) = sandbox_and_template(&service, &id);
    let moved = sandbox.stored_snapshot.clone().expect("stored");
    adopter
        .adopt_sandbox(sandbox, template)
        .expect("adopted by another pod");
    service.release_sandbox(&id).unwrap();
    adopter.resume(&id).expect("a wake on the other pod");
    guest_iterates_mib(&other.0, &id, WORK);
    hibernate(&adopter, &id).unwrap();
    // The manifest it moved with is the adopter's to drop once the layer
    // goes (before: left in the store for good, and its chunks with it).
    assert!(
        !objects.join("manifests").join(&moved).exists(),
        "the manifest {moved} it moved with is still in the store"
    );
    evict(&adopter, &id);
    cold_wake(&adopter, &id);
    guest_iterates_mib(&other.0, &id, WORK);

    stop.store(true, Ordering::SeqCst);
    let (runs, deleted) = collector.join().unwrap();
    println!("the collector ran {runs} times and deleted {deleted} chunks");
    // It had teeth: the older snapshots' own chunks went.
    assert!(runs >= 4 && deleted > 0, "{runs} runs, {deleted} deleted");
    adopter.delete_sandbox(&id).unwrap();
}

#[test]
fn store_two_sandboxes_of_one_template_hibernating_at_once_store_its_layer_once() {
    use torpor_scheduler::model::TemplateKind;
    use torpor_scheduler::service::{CreateTemplate, ServiceConfig};
    let data = DataDir::new("store-once");
    let objects = data.0.join("objects");
    let mut c = ServiceConfig::new(
        data.0.clone(),
        std::path::PathBuf::from(env!("CARGO_BIN_EXE_torpor-vmm")),
    );
    c.policy_interval_ms = 0;
    c.object_store = Some(objects.display().to_string());
    let service = Service::open(c).expect("open the service");
    // The store fails while the template is made: its layer is not
    // stored then, so its sandboxes' hibernations store it.
    let aside = data.0.join("objects-aside");
    std::fs::rename(&objects, &aside).unwrap();
    std::fs::write(&objects, b"not a directory").unwrap();
    service
        .create_template(CreateTemplate {
            name: "fast".into(),
            kind: TemplateKind::Probe,
            image: None,
            owner: None,
            mem_mib: 64,
            vcpus: 1,
            cmdline: Some(format!("probe.mib={MIB} probe.ticks=1 probe.hz=100")),
            pod: None,
        })
        .expect("build the probe template");
    std::fs::remove_file(&objects).unwrap();
    std::fs::rename(&aside, &objects).unwrap();
    let ids: Vec<SandboxId> = (0..2)
        .map(|_| {
            let id = service
                .create_sandbox(CreateSandbox {
                    template: "fast".into(),
                    ..Default::default()
                })
                .expect("create")
                .id;
            guest_iterates(&data.0, &id);
            id
        })
        .collect();
    // Both at once: each stores the template's layer before its own.
    let start = Arc::new(std::sync::Barrier::new(ids.len()));
    let stored: Vec<String> = ids
        .iter()
        .map(|id| {
            let (service, start, id) = (Arc::clone(&service), Arc::clone(&start), id.clone());
            std::thread::spawn(move || {
                start.wait();
                hibernate(&service, &id).expect("hibernate")
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().unwrap())
        .collect();
    // What the store holds is what the service records: every template's
    // layer (the built-in one's too) and the two hibernations, and no
    // second upload of the template's layer left behind by the record
    // that lost.
    let mut expected: Vec<String> = service
        .list_templates()
        .unwrap()
        .into_iter()
        .filter_map(|t| t.stored_snapshot)
        .chain(stored)
        .collect();
    expected.sort();
    let mut on_store: Vec<String> = std::fs::read_dir(objects.join("manifests"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    on_store.sort();
    assert_eq!(on_store, expected);
    for id in &ids {
        service.delete_sandbox(id).unwrap();
    }
}

#[test]
fn store_a_hibernation_left_unstored_is_stored_when_the_pod_starts_again() {
    // The chaos run's pod lost for good held a sandbox hibernated without
    // its snapshot in the store: the pod had stopped between the
    // hibernation and its upload, and nothing uploaded it after, so it was
    // lost with the pod. Here the upload fails (the store cut), the
    // service stops, and the one started on the same data stores it.
    const WORK: u32 = 8;
    let (proxy, url, _, _one) = store_behind_proxy("pending");
    let data = DataDir::new("store-pending");
    let (service, id) = iterating_sandbox(&data.0, url.clone(), "fast", WORK, 100);
    proxy.cut();
    let e = service.hibernate(&id).unwrap_err();
    assert!(matches!(e, ServiceError::ObjectStore(_)), "{e}");
    let s = service.get_sandbox(&id).unwrap();
    assert_eq!(s.state, SandboxState::Hibernated);
    assert!(s.stored_snapshot.is_none(), "{s:?}");
    service.close();
    drop(service);

    proxy.restore();
    let mut c = ServiceConfig::new(
        data.0.clone(),
        std::path::PathBuf::from(env!("CARGO_BIN_EXE_torpor-vmm")),
    );
    c.policy_interval_ms = 0;
    c.object_store = Some(url);
    let again = Service::open(c).expect("open the service again");
    let deadline = Instant::now() + WAIT;
    while again.get_sandbox(&id).unwrap().stored_snapshot.is_none() {
        assert!(
            Instant::now() < deadline,
            "the hibernation is still not stored {WAIT:?} after the start"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // What was stored is the whole of it: gone from the disk, the wake
    // fetches it and the guest goes on.
    evict(&again, &id);
    cold_wake(&again, &id);
    guest_iterates_mib(&data.0, &id, WORK);
    again.delete_sandbox(&id).unwrap();
}

#[test]
fn store_a_hibernation_acknowledged_locally_is_stored_right_after() {
    // `--hibernate-ack local`: the hibernation answers once its snapshot
    // is on the pod's disk, before the upload (here slowed to take
    // seconds), and the upkeep thread stores it at once, not at its next
    // 30 s pass.
    const WORK: u32 = 8;
    let (proxy, url, _, _one) = store_behind_proxy("local-ack");
    let data = DataDir::new("store-local-ack");
    let (service, id) = iterating_sandbox_with(&data.0, url, "fast", WORK, 100, |c| {
        c.hibernate_ack = torpor_scheduler::service::objects::HibernateAck::Local;
    });
    proxy.slow(Duration::from_millis(4));
    let s = service.hibernate(&id).expect("hibernate").sandbox;
    assert_eq!(s.state, SandboxState::Hibernated);
    assert!(
        s.stored_snapshot.is_none(),
        "answered after the upload: {s:?}"
    );
    let answered = Instant::now();
    proxy.slow(Duration::ZERO);
    let deadline = answered + Duration::from_secs(10);
    while service.get_sandbox(&id).unwrap().stored_snapshot.is_none() {
        assert!(
            Instant::now() < deadline,
            "not stored 10 s after the hibernation answered"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    println!(
        "stored {:.1} s after the answer",
        answered.elapsed().as_secs_f64()
    );
    // What the background stored is the whole of it.
    evict(&service, &id);
    cold_wake(&service, &id);
    guest_iterates_mib(&data.0, &id, WORK);
    service.delete_sandbox(&id).unwrap();
}

/// Held by a test whose service reaches the store through its proxy.
type OneAtATime = std::sync::MutexGuard<'static, ()>;

/// SeaweedFS behind a proxy the test slows and cuts (the service reaches
/// the store only through it); the store's URL, SeaweedFS's variables,
/// and a guard the test holds to its end: the proxy's address is in the
/// process's environment (`AWS_ENDPOINT_URL`, which a service reads when
/// it opens), so two such tests at once would open their services on
/// each other's proxy (one's cut then missed its upload: seen in CI).
fn store_behind_proxy(name: &str) -> (CutProxy, String, HashMap<String, String>, OneAtATime) {
    static PROXIED: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let one = PROXIED.lock().unwrap_or_else(|e| e.into_inner());
    let env = common::store::seaweedfs();
    let upstream = env["AWS_ENDPOINT_URL"]
        .trim_start_matches("http://")
        .to_string();
    let proxy = CutProxy::start(&upstream);
    for (k, v) in &env {
        std::env::set_var(k, v);
    }
    std::env::set_var("AWS_ENDPOINT_URL", proxy.url());
    let url = format!(
        "{}/{name}-{}",
        env["TORPOR_OBJECT_STORE"],
        std::process::id()
    );
    (proxy, url, env, one)
}

/// Lazy wakes (`serve --lazy-wake`) on the default `file` backend: a
/// lazy restore takes `uffd` for itself.
fn lazy(c: &mut ServiceConfig) {
    c.lazy_wake = true;
}

/// Lazy wakes on a pod whose backend is `uffd` for every restore.
fn lazy_uffd(c: &mut ServiceConfig) {
    c.lazy_wake = true;
    c.memory_backend = torpor_vmm_api::MemoryBackend::Uffd;
}

/// Whether the layer the sandbox runs from still has its memory file
/// arriving.
fn arriving(service: &Arc<Service>, id: &SandboxId) -> bool {
    let snapshot = service.get_sandbox(id).unwrap().snapshot.unwrap();
    snapshot.join(".arriving").exists()
}

#[test]
fn store_lazy_wake_answers_before_the_layer_arrived() {
    const WORK: u32 = 16;
    let (proxy, url, _, _one) = store_behind_proxy("lazy");
    let data = DataDir::new("store-lazy");
    let (service, id) = iterating_sandbox_with(&data.0, url, "fast", WORK, 100, lazy);
    hibernate(&service, &id).expect("stored");
    evict(&service, &id);

    // A slow store: every 16 KiB of an answer waits 4 ms, so the layer's
    // 16 MiB of workload take seconds; the wake answers long before.
    proxy.slow(Duration::from_millis(4));
    let started = Instant::now();
    let report = cold_wake(&service, &id);
    let waking = started.elapsed();
    // The pod's backend is `file`; the page server is uffd's.
    assert_eq!(report.backend, "uffd", "{report:?}");
    let still = arriving(&service, &id);
    println!("lazy cold wake through a slow store: {waking:?}, memory still arriving: {still}");
    assert!(
        still,
        "the whole layer arrived before the wake answered ({waking:?})"
    );
    // The guest goes on with its exact sequence while its memory arrives.
    guest_iterates_mib(&data.0, &id, WORK);
    proxy.slow(Duration::ZERO);
    // A hibernation waits for the rest, then stores a complete snapshot,
    // which wakes cold again (eager or lazy alike).
    hibernate(&service, &id).expect("hibernated after the memory arrived");
    evict(&service, &id);
    cold_wake(&service, &id);
    guest_iterates_mib(&data.0, &id, WORK);
    service.delete_sandbox(&id).unwrap();
}

/// A pod that stops while a lazy wake's memory file is arriving: the
/// sandbox's VMM runs on (its faults on chunks not here wait), and the
/// service started again on the same data re-attaches to it and goes on
/// fetching, the chunks the VMM waits for first. The guest keeps its
/// exact sequence throughout, the file arrives whole, and the next
/// hibernation stores a snapshot that wakes cold again. Before, nobody
/// fetched after the restart: the VMM's first fault on a missing chunk
/// failed at the map's deadline (20 s) and the sandbox with it.
#[test]
fn store_lazy_wake_goes_on_across_a_restart_of_its_pod() {
    const WORK: u32 = 16;
    let (proxy, url, _, _one) = store_behind_proxy("lazy-restart");
    let data = DataDir::new("store-lazy-restart");
    let (service, id) = iterating_sandbox_with(&data.0, url.clone(), "fast", WORK, 100, lazy);
    hibernate(&service, &id).expect("stored");
    evict(&service, &id);
    proxy.slow(Duration::from_millis(4));
    cold_wake(&service, &id);
    assert!(arriving(&service, &id), "the layer arrived before the stop");
    let pid = service.get_sandbox(&id).unwrap().vmm.expect("its VMM").pid;
    service.close();
    drop(service);
    // Down for a moment, as a restarted pod is.
    std::thread::sleep(Duration::from_secs(1));

    let mut c = ServiceConfig::new(
        data.0.clone(),
        std::path::PathBuf::from(env!("CARGO_BIN_EXE_torpor-vmm")),
    );
    c.policy_interval_ms = 0;
    c.object_store = Some(url);
    lazy(&mut c);
    let again = Service::open(c).expect("open the service again");
    let s = again.get_sandbox(&id).unwrap();
    assert_eq!(s.state, SandboxState::Running, "{s:?}");
    assert_eq!(s.vmm.as_ref().map(|v| v.pid), Some(pid), "{s:?}");
    proxy.slow(Duration::ZERO);
    let deadline = Instant::now() + Duration::from_secs(60);
    while arriving(&again, &id) {
        let s = again.get_sandbox(&id).unwrap();
        assert_eq!(s.state, SandboxState::Running, "{s:?}");
        assert!(Instant::now() < deadline, "the memory file never arrived");
        std::thread::sleep(Duration::from_millis(50));
    }
    println!("the memory file arrived after the restart");
    guest_iterates_mib(&data.0, &id, WORK);
    hibernate(&again, &id).expect("hibernated after the memory arrived");
    evict(&again, &id);
    cold_wake(&again, &id);
    guest_iterates_mib(&data.0, &id, WORK);
    again.delete_sandbox(&id).unwrap();
}

#[test]
fn store_cut_mid_lazy_fetch_fails_cleanly_and_a_later_wake_succeeds() {
    const WORK: u32 = 16;
    let (proxy, url, _, _one) = store_behind_proxy("lazy-cut");
    let data = DataDir::new("store-lazy-cut");
    let (service, id) = iterating_sandbox_with(&data.0, url, "fast", WORK, 100, lazy);
    let stored = hibernate(&service, &id).expect("stored");
    evict(&service, &id);

    // The store stops while the memory file is arriving: the sandbox's
    // VMM is stopped and the sandbox is back to its hibernation, its
    // stored snapshot untouched, its partial local copy gone.
    proxy.slow(Duration::from_millis(4));
    cold_wake(&service, &id);
    assert!(arriving(&service, &id), "the layer arrived before the cut");
    proxy.cut();
    let deadline = Instant::now() + Duration::from_secs(60);
    let s = loop {
        let s = service.get_sandbox(&id).unwrap();
        if s.state != SandboxState::Running || Instant::now() > deadline {
            break s;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    println!("after the cut: {:?} ({:?})", s.state, s.failure_reason);
    assert_eq!(s.state, SandboxState::Hibernated, "{s:?}");
    assert_eq!(s.stored_snapshot.as_deref(), Some(stored.as_str()));
    assert!(!s.snapshot.as_ref().unwrap().exists(), "{s:?}");

    // Back: the next wake fetches it again and the guest goes on.
    proxy.slow(Duration::ZERO);
    proxy.restore();
    cold_wake(&service, &id);
    guest_iterates_mib(&data.0, &id, WORK);
    service.delete_sandbox(&id).unwrap();
}

#[test]
fn store_lazy_wake_of_a_corrupt_chunk_fails_naming_the_layer() {
    let data = DataDir::new("store-lazy-corrupt");
    let objects = data.0.join("objects");
    let (service, id) = iterating_sandbox_with(
        &data.0,
        objects.display().to_string(),
        "fast",
        MIB,
        100,
        lazy_uffd,
    );
    let manifest = hibernate(&service, &id).unwrap();
    evict(&service, &id);

    // Every chunk of its memory file corrupted (the originals kept): the
    // first one the wake fetches fails its checksum, and the wake.
    let text = std::fs::read(objects.join("manifests").join(&manifest)).unwrap();
    let m: serde_json::Value = serde_json::from_slice(&text).unwrap();
    let memory = m["files"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["path"] == "memory")
        .unwrap();
    let mut kept = Vec::new();
    for hash in memory["chunks"].as_array().unwrap().iter() {
        let Some(hash) = hash.as_str() else { continue };
        let path = objects.join("chunks").join(&hash[..2]).join(hash);
        let good = std::fs::read(&path).unwrap();
        let mut bad = good.clone();
        let last = bad.len() - 1;
        bad[last] ^= 0x40;
        std::fs::write(&path, &bad).unwrap();
        kept.push((path, good));
    }
    assert!(!kept.is_empty());
    let e = service.resume(&id).unwrap_err();
    println!("a lazy wake of a corrupt layer: {e}");
    let message = e.to_string();
    assert!(
        message.contains(&manifest) && message.contains("corrupt"),
        "{message}"
    );
    assert!(matches!(e, ServiceError::ObjectStore(_)), "{e}");
    assert_eq!(
        service.get_sandbox(&id).unwrap().state,
        SandboxState::Hibernated
    );

    // The store repaired: the wake fetches it and the guest goes on.
    for (path, good) in kept {
        std::fs::write(path, good).unwrap();
    }
    cold_wake(&service, &id);
    guest_iterates(&data.0, &id);
    service.delete_sandbox(&id).unwrap();
}

#[test]
fn a_sandbox_failed_here_is_released_to_the_pod_it_moved_to() {
    // A pod killed with its VMMs finds its copy failed when it comes
    // back; the replica then asks it to release that copy (the sandbox
    // moved meanwhile), which must not be refused as a conflict.
    let data = DataDir::new("release-failed");
    let service = common::service_with_probe(&data.0, |_| {}, "p", 64, "probe.ticks=1");
    let id = service
        .create_sandbox(CreateSandbox {
            template: "p".into(),
            ..Default::default()
        })
        .expect("create")
        .id;
    let pid = service.get_sandbox(&id).unwrap().vmm.unwrap().pid;
    let killed = std::process::Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap();
    assert!(killed.success(), "kill {pid}: {killed}");
    let deadline = Instant::now() + WAIT;
    while service.get_sandbox(&id).unwrap().state != SandboxState::Failed {
        assert!(Instant::now() < deadline, "the sandbox never failed");
        service.run_policy();
        std::thread::sleep(Duration::from_millis(50));
    }
    service
        .release_sandbox(&id)
        .expect("a failed copy is released");
    assert!(matches!(
        service.get_sandbox(&id).map(|s| s.state),
        Ok(SandboxState::Deleted) | Err(_)
    ));
}

#[test]
fn store_lazy_adoption_leaves_the_layer_to_the_wake() {
    // A pod with lazy wakes adopting a sandbox (as a replica moves a lost
    // pod's) fetches none of its layer: the wake does, lazily, and
    // answers before the memory has arrived; the probe goes on with its
    // exact sequence there.
    const WORK: u32 = 16;
    let (proxy, url, _, _one) = store_behind_proxy("lazy-adopt");
    let data = DataDir::new("store-lazy-adopt-from");
    let (service, id) = iterating_sandbox_with(&data.0, url.clone(), "fast", WORK, 100, lazy);
    hibernate(&service, &id).expect("stored");
    let other = DataDir::new("store-lazy-adopt-to");
    let adopter = common::service_with_probe(
        &other.0,
        |c| {
            c.object_store = Some(url.clone());
            lazy(c);
        },
        "fast",
        64,
        &format!("probe.mib={WORK} probe.ticks=1 probe.hz=100"),
    );
    let (sandbox, template) = sandbox_and_template(&service, &id);
    let adopted = adopter
        .adopt_sandbox(sandbox, template)
        .expect("adopted by another pod");
    let layer = adopted.snapshot.clone().expect("its snapshot's place");
    assert!(
        !layer.join("memory").exists(),
        "the adoption fetched the memory file: {}",
        layer.display()
    );
    service.release_sandbox(&id).unwrap();
    // A slow store: the wake answers long before the layer's 16 MiB.
    proxy.slow(Duration::from_millis(4));
    let woken = adopter
        .resume(&id)
        .expect("a lazy wake on the adopting pod");
    assert_eq!(woken.sandbox.state, SandboxState::Running);
    let still = arriving(&adopter, &id);
    println!("lazy wake of an adopted sandbox, memory still arriving: {still}");
    assert!(still, "the whole layer arrived before the wake answered");
    guest_iterates_mib(&other.0, &id, WORK);
    proxy.slow(Duration::ZERO);
    adopter.delete_sandbox(&id).unwrap();
}
