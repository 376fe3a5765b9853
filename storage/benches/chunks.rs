//! torpor-storage's costs (issue 29): upload throughput of a sparse
//! memory file, the dedupe ratio of N layers sharing a base (a template's
//! sandboxes), download throughput, and the latency of a 4 KiB random read
//! whose chunk comes from the store (cold) against one from the chunk
//! cache (warm). On a local directory, and on SeaweedFS on loopback
//! (`scripts/object-store`) when its `weed` is installed. Prints one table.
//!
//! `cargo bench -p torpor-storage --bench chunks [-- --quick]`; under
//! `cargo test` (no `--bench`) a smoke run of a few chunks on a local
//! directory only.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use comfy_table::Table;
use torpor_storage::{ChunkCache, Storage, StoreConfig};

const MIB: u64 = 1 << 20;

/// Page-like content: each 4 KiB half noise, half a pattern.
fn content(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|i| {
            if i % 4096 < 2048 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            } else {
                (i % 251) as u8 | 1
            }
        })
        .collect()
}

/// A layer whose `memory` is `chunks` MiB long, every other MiB data
/// (from `seeds`, one per data chunk), the rest holes; and a `state`.
fn layer(dir: &Path, seeds: &[u64]) {
    std::fs::create_dir_all(dir).unwrap();
    let f = File::create(dir.join("memory")).unwrap();
    f.set_len(seeds.len() as u64 * 2 * MIB).unwrap();
    for (i, s) in seeds.iter().enumerate() {
        f.write_all_at(&content(*s, MIB as usize), i as u64 * 2 * MIB)
            .unwrap();
    }
    std::fs::write(dir.join("state"), content(1, 40_000)).unwrap();
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1000.0
}

fn mb_s(bytes: u64, d: Duration) -> String {
    format!("{:.0} MB/s", bytes as f64 / 1e6 / d.as_secs_f64())
}

/// Eight free loopback ports in a row, the first returned.
fn free_ports() -> u16 {
    let pid = std::process::id() as u16;
    (0..200u16)
        .map(|i| 20000 + (pid.wrapping_add(i.wrapping_mul(37)) % 2500) * 16)
        .find(|b| (0..8).all(|k| std::net::TcpListener::bind(("127.0.0.1", b + k)).is_ok()))
        .expect("eight free loopback ports")
}

/// SeaweedFS on loopback for this run, if weed is installed.
fn seaweedfs() -> Option<HashMap<String, String>> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/object-store");
    if !Command::new(&script)
        .arg("weed")
        .output()
        .ok()?
        .status
        .success()
    {
        eprintln!("no weed binary: SeaweedFS rows left out (scripts/object-store install)");
        return None;
    }
    let pid = std::process::id();
    let out = Command::new(&script)
        .arg("start")
        .env(
            "TORPOR_OBJECT_STORE_DIR",
            std::env::temp_dir().join(format!("torpor-bench-s3-{pid}")),
        )
        .env("TORPOR_OBJECT_STORE_PORT", free_ports().to_string())
        .env("TORPOR_OBJECT_STORE_PARENT", pid.to_string())
        .output()
        .ok()?;
    if !out.status.success() {
        eprintln!(
            "SeaweedFS did not start: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        return None;
    }
    Some(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.strip_prefix("export ")?.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    )
}

struct Sizes {
    /// Data chunks of the upload's memory file.
    upload_chunks: u64,
    /// Layers sharing a base, and the base's data chunks.
    layers: u64,
    base_chunks: u64,
    /// Random reads per kind.
    reads: usize,
}

async fn run(name: &str, storage: &Storage, sizes: &Sizes, table: &mut Table) {
    let scratch = tempfile::tempdir().unwrap();
    let row = |table: &mut Table, what: &str, value: String, note: String| {
        table.add_row(vec![name.to_string(), what.to_string(), value, note]);
    };

    // Upload: a memory file half data, half holes.
    let big = scratch.path().join("big");
    let seeds: Vec<u64> = (0..sizes.upload_chunks).map(|i| 1000 + i).collect();
    layer(&big, &seeds);
    let up = storage.upload_layer(&big).await.unwrap();
    row(
        table,
        "upload",
        mb_s(up.data_bytes, up.elapsed),
        format!(
            "{} MiB data of {} MiB, {} chunks + {} holes, {:.0}% sent after LZ4, {:.2} s",
            up.data_bytes / MIB,
            up.logical_bytes / MIB,
            up.chunks,
            up.holes,
            100.0 * up.uploaded_bytes as f64 / up.new_bytes as f64,
            up.elapsed.as_secs_f64()
        ),
    );
    let again = storage.upload_layer(&big).await.unwrap();
    row(
        table,
        "upload, all chunks stored",
        mb_s(again.data_bytes, again.elapsed),
        format!(
            "{} HEADs, nothing sent, {:.2} s",
            again.chunks,
            again.elapsed.as_secs_f64()
        ),
    );
    let down = storage
        .download_layer(&up.id, &scratch.path().join("down"))
        .await
        .unwrap();
    row(
        table,
        "download",
        mb_s(down.data_bytes, down.elapsed),
        format!("sparse, synced, {:.2} s", down.elapsed.as_secs_f64()),
    );

    // N layers over one base: each keeps 95% of the base's chunks.
    let base: Vec<u64> = (0..sizes.base_chunks).map(|i| 5000 + i).collect();
    let (mut named, mut stored, mut sent) = (0u64, 0u64, 0u64);
    let started = Instant::now();
    for n in 0..sizes.layers {
        let mut seeds = base.clone();
        if n > 0 {
            for (k, s) in seeds.iter_mut().enumerate() {
                if k as u64 % 20 == n % 20 {
                    *s = 100_000 * n + k as u64;
                }
            }
        }
        let dir = scratch.path().join(format!("layer{n}"));
        layer(&dir, &seeds);
        let r = storage.upload_layer(&dir).await.unwrap();
        named += r.data_bytes;
        stored += r.new_bytes;
        sent += r.uploaded_bytes;
        std::fs::remove_dir_all(&dir).unwrap();
    }
    row(
        table,
        &format!("dedupe, {} layers on a base", sizes.layers),
        format!("{:.1}x", named as f64 / stored as f64),
        format!(
            "{} MiB named, {} MiB stored, {} MiB sent (LZ4), {:.1} s",
            named / MIB,
            stored / MIB,
            sent / MIB,
            started.elapsed().as_secs_f64()
        ),
    );

    // 4 KiB reads at random data pages: cold (its chunk from the store)
    // and warm (the same reads again, from the cache).
    let cache = ChunkCache::open(&scratch.path().join("cache"), 1 << 30).unwrap();
    let reader = storage.open_layer(&up.id, cache.clone()).await.unwrap();
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut offsets = Vec::new();
    let mut used = std::collections::HashSet::new();
    while offsets.len() < sizes.reads.min(sizes.upload_chunks as usize) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let chunk = x % sizes.upload_chunks;
        if used.insert(chunk) {
            offsets.push(chunk * 2 * MIB + (x >> 32) % 256 * 4096);
        }
    }
    for kind in ["cold", "warm"] {
        let mut lat = Vec::new();
        for &at in &offsets {
            let t = Instant::now();
            reader.read_at("memory", at, 4096).await.unwrap();
            lat.push(t.elapsed());
        }
        lat.sort();
        row(
            table,
            &format!("4 KiB random read, {kind}"),
            format!("p50 {:.2} ms", percentile(&lat, 0.5)),
            format!(
                "p99 {:.2} ms, {} reads{}",
                percentile(&lat, 0.99),
                lat.len(),
                if kind == "cold" {
                    ", a 1 MiB chunk fetched, checked and cached each"
                } else {
                    ""
                }
            ),
        );
    }
    let s = cache.stats();
    assert_eq!(s.fetches as usize, offsets.len(), "{s:?}");
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // `cargo test --all-targets` runs this without `--bench`: a smoke run.
    let smoke = !args.iter().any(|a| a == "--bench");
    let quick = args.iter().any(|a| a == "--quick");
    let sizes = if smoke {
        Sizes {
            upload_chunks: 4,
            layers: 3,
            base_chunks: 4,
            reads: 4,
        }
    } else if quick {
        Sizes {
            upload_chunks: 32,
            layers: 5,
            base_chunks: 20,
            reads: 20,
        }
    } else {
        Sizes {
            upload_chunks: 128,
            layers: 20,
            base_chunks: 40,
            reads: 64,
        }
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut table = Table::new();
    table.set_header(vec!["store", "what", "result", "detail"]);
    rt.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let local = Storage::open(&StoreConfig::Local {
            dir: dir.path().to_path_buf(),
        })
        .unwrap();
        run("local directory", &local, &sizes, &mut table).await;
        if smoke {
            println!("smoke run (no --bench): the local directory only");
        } else if let Some(env) = seaweedfs() {
            let url = format!(
                "{}/bench-{}",
                env["TORPOR_OBJECT_STORE"],
                std::process::id()
            );
            let config = StoreConfig::parse_with_env(&url, |k| env.get(k).cloned()).unwrap();
            let s3 = Storage::open(&config).unwrap();
            run("SeaweedFS (S3, loopback)", &s3, &sizes, &mut table).await;
        }
    });
    println!("{table}");
}
